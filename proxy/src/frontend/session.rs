//! A client session from accept to close: negotiate, authenticate, attach a cloud
//! backend (warm from the pool or new), forward, and give the backend back.

use super::auth::{authenticate, Authenticated};
use super::cloud_pool::CloudSource;
use super::console::{ClientInfo, Live};
use super::direct::{Ctx, Direct, SessionLink};
use super::pump::{Pipe, PipeError};
use super::router::{Exchanges, Privileges, Router, Side};
use super::startup::{negotiate, Negotiated};
use super::statement::NotifyPids;
use super::statement::{ClientFrames, Exchange, Reported, ServerFrames};
use super::tx_pool::TxSession;
use crate::backend::at_login::{at_login, TxDefaults};
use crate::backend::conn::BackendConn;
use crate::backend::pool::{self, PoolKey};
use crate::cancel::{CancelTarget, SessionId};
use crate::core::{Core, Database};
use crate::error::{ErrorKind, SessionError};
use crate::metrics::{CoreStats, Seen};
use crate::net::stream::ClientStream;
use crate::org::OrgId;
use crate::rt::net::TcpStream;
use crate::time::with_timeout;
use futures_lite::{AsyncRead, AsyncWrite, AsyncWriteExt};
use lokadb_shared::config::PoolMode;
use lokadb_shared::wire::backend;
use lokadb_shared::wire::startup::StartupMessage;
use lokadb_shared::wire::tags::*;
use std::cell::RefCell;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::task::Poll;
use std::time::Instant;
use tracing::Instrument;

/// Serves one client connection to the end. Never panics on client input; every
/// failure ends only this session.
pub async fn serve(core: Rc<Core>, tcp: TcpStream) {
    let peer = tcp.peer_addr().ok().map(|a| a.ip());
    let subnet = peer.map_or_else(|| "?".into(), crate::net::subnet);
    let span = tracing::debug_span!("session", core = core.id, client = %subnet);
    let _count = SessionCount::new(&core);
    // Past the handshake limits the connection gets its error and is closed before a byte
    // is read (as Postgres's postmaster does when it cannot start a backend): a flood of
    // idle or slow sockets costs a socket each, and authenticated clients are not refused
    // for it (they count in max_connections only once authenticated).
    let handshake = match Handshake::begin(&core, peer) {
        Ok(h) => h,
        Err(e) => {
            // At debug: a flood must not flood the log.
            tracing::debug!(client = %subnet, error = %e, "connection refused");
            let mut out = Vec::new();
            e.to_client(&mut out);
            let mut stream = ClientStream::Plain(tcp);
            let _ = with_timeout(REFUSAL_WRITE, stream.write_all(&out)).await;
            let _ = stream.close().await;
            return;
        }
    };
    serve_inner(&core, tcp, handshake, &subnet)
        .instrument(span)
        .await
}

/// The largest message a backend (the cloud or an organization's database) may send: what
/// Postgres itself can build (a message is assembled in at most 1 GiB), with room to
/// spare. A header declaring more ends the session with an error naming it; below it,
/// memory follows the bytes that arrive, not the length declared ([`Pipe`]).
const SERVER_MESSAGE_MAX: u32 = (1 << 30) + (64 << 10);

/// Whose session a log line is about: the fields operators filter on.
#[derive(Clone, Copy)]
struct Who<'a> {
    user: &'a str,
    database: &'a str,
    /// The client's subnet, never its full address (docs/security.md).
    client: &'a str,
}

async fn serve_inner(core: &Rc<Core>, tcp: TcpStream, handshake: Handshake<'_>, subnet: &str) {
    let _ = tcp.set_nodelay(true);
    let auth_timeout = core.shared.settings().config.auth_timeout;
    let started = Instant::now();
    let unknown = Who {
        user: "",
        database: "",
        client: subnet,
    };
    // The steps before forwarding run boxed: a task's future is as large as its largest
    // state, and every session keeps its task for its whole life, idle or not.
    let (mut stream, startup) =
        match with_timeout(auth_timeout, Box::pin(negotiate(tcp, core))).await {
            None => return tracing::debug!("auth_timeout during the startup phase"),
            Some(Err((e, Some(mut stream)))) => return report(&mut stream, e, &unknown).await,
            Some(Err((e, None))) => return log_error(&e, &unknown),
            Some(Ok(Negotiated::Cancelled)) => return,
            Some(Ok(Negotiated::Startup(stream, startup))) => (stream, startup),
        };
    let user = startup.param("user").unwrap_or_default();
    let who = Who {
        user,
        database: startup
            .param("database")
            .filter(|d| !d.is_empty())
            .unwrap_or(user),
        client: subnet,
    };
    // Accepted before the listener closed: served, unless the drain is past its grace.
    if core.idle_cut.is_fired() {
        return report(&mut stream, SessionError::Shutdown, &who).await;
    }
    let remaining = auth_timeout.saturating_sub(started.elapsed());
    if super::console::asked(core, &startup) {
        let login = with_timeout(
            remaining,
            Box::pin(super::console::login(core, &mut stream, &startup)),
        )
        .await;
        drop(handshake);
        return match login.unwrap_or(Err(SessionError::AuthTimeout)) {
            Ok(admitted) => Box::pin(super::console::serve(core, stream, admitted)).await,
            Err(e) => report(&mut stream, e, &who).await,
        };
    }
    let attached = match with_timeout(
        remaining,
        Box::pin(attach(core, &mut stream, &startup, &who)),
    )
    .await
    {
        None => Err(SessionError::AuthTimeout),
        Some(r) => r,
    };
    drop(handshake);
    match attached {
        Ok((key, backend)) => forward(core, stream, key, backend, subnet).await,
        Err(e) => report(&mut stream, e, &who).await,
    }
}

/// Authenticates the client and gives it a logged-in backend; on success the client
/// has received everything up to its first ReadyForQuery.
async fn attach(
    core: &Core,
    stream: &mut ClientStream,
    startup: &StartupMessage,
    who: &Who<'_>,
) -> Result<(PoolKey, Attached), SessionError> {
    let Who {
        user,
        database,
        client,
    } = *who;
    if startup
        .param("replication")
        .is_some_and(|r| r != "false" && r != "off" && r != "0")
    {
        return Err(SessionError::Unsupported("replication connections"));
    }
    let db = &core
        .database(database)
        .ok_or_else(|| SessionError::UnknownDatabase(database.to_owned()))?;
    let Authenticated {
        credentials,
        server_final,
    } = authenticate(stream, core, db, user).await?;
    // Counted from here, once the client has proved who it is.
    let admitted = Admitted::new(&core.shared).ok_or(SessionError::TooManyConnections)?;

    let mut params: Vec<(String, String)> = startup
        .params
        .iter()
        .filter(|(k, _)| k != "user" && k != "database" && !k.starts_with("_pq_."))
        .cloned()
        .collect();
    params.sort();
    // A session limited from its start (`PGOPTIONS='-c lokadb.org=42'`) needs metadata to
    // limit it with.
    let in_options = params
        .iter()
        .find(|(k, _)| k == "options")
        .and_then(|(_, v)| crate::route::setting::from_options(v))
        .flatten()
        .is_some();
    let limits = core.meta.borrow().get(&*db.name).map(|m| m.has_tables());
    if in_options && limits.is_none() {
        return Err(SessionError::StartupOrgUnlimited(db.name.to_string()));
    }
    let key = PoolKey {
        database: db.name.clone(),
        user: user.to_owned(),
        org: None,
        target: None,
        params,
    };
    let mut backend = CloudSource::new(core, db, &key, credentials.clone())
        .acquire(db.config.upstream_pool)
        .await?;
    // A backend given back between transactions may hold another session's settings
    // (`lokadb.org` among them, which is read below): back to those of its login.
    if backend.holds.settings != 0 {
        pool::reset(&mut backend).await.map_err(|e| {
            SessionError::UpstreamConnect(format!("resetting a pooled backend: {e}"))
        })?;
    }

    // What its backend holds at login (the startup options', the role's or the database's
    // defaults), asked once per backend: the organization the session starts limited to,
    // and the transaction defaults a direct login carries.
    let direct = db.config.direct.is_some();
    let held = if limits == Some(true) || in_options || direct {
        Some(at_login(&mut backend).await.map_err(|e| {
            SessionError::UpstreamConnect(format!("reading the settings at login: {e}"))
        })?)
    } else {
        None
    };
    let start_org = held
        .as_ref()
        .filter(|_| limits == Some(true) || in_options)
        .and_then(|a| a.org.as_deref())
        .map(OrgId::from);
    let login_path = held.as_ref().map(|a| a.search_path.clone());
    let tx_defaults = held.filter(|_| direct).map(|a| a.tx);
    let privileges = if direct {
        super::check::direct_privileges(core, db, user, &mut backend).await
    } else {
        Privileges::default()
    };
    // The client's key: its cloud backend's process ID (what `pg_backend_pid()` and
    // notifications say), a secret of the proxy's own.
    let target = CancelTarget {
        addr: backend.addr,
        pid: backend.pid,
        secret: backend.secret.clone(),
    };
    // With transaction pooling the backend changes hands: the key's process ID is the
    // proxy's own (no backend's, so `pg_terminate_backend` with it ends no other client's).
    let (session, cancel) = match db.config.pool_mode {
        PoolMode::Session => core.cancels.borrow_mut().register(core.id, target),
        PoolMode::Transaction => core.cancels.borrow_mut().register_pooled(core.id, target),
    };
    let mut out = Vec::with_capacity(512);
    backend::auth_sasl_data(&mut out, AUTH_SASL_FINAL, server_final.as_bytes());
    backend::auth_ok(&mut out);
    for (name, value) in &backend.params {
        backend::parameter_status(&mut out, name, value);
    }
    backend::backend_key_data(&mut out, cancel.pid, cancel.secret);
    backend::ready_for_query(&mut out, backend.status);
    let attached = Attached {
        _admitted: admitted,
        backend,
        creds: credentials,
        session,
        db: db.clone(),
        privileges,
        start_org,
        tx_defaults,
        login_path,
    };
    let written = async {
        stream.write_all(&out).await?;
        stream.flush().await
    };
    if let Err(e) = written.await {
        core.cancels.borrow_mut().unregister(session);
        return Err(SessionError::Client(e));
    }
    tracing::info!(
        user,
        database,
        client,
        backend_pid = attached.backend.pid,
        "session started"
    );
    Ok((key, attached))
}

/// A backend attached to a session, with the session's handle in the cancel registry.
struct Attached {
    /// Its slot of `max_connections`, for the session's life.
    _admitted: Admitted,
    backend: BackendConn,
    /// The client's credentials, for the backends it logs in later (transaction pooling).
    creds: crate::scram::Credentials,
    session: SessionId,
    db: Rc<Database>,
    privileges: Privileges,
    /// The organization the startup `options` limit the session to.
    start_org: Option<OrgId>,
    /// The transaction defaults at login, when the database has the direct path.
    tx_defaults: Option<TxDefaults>,
    /// The `search_path` at login, when it was read.
    login_path: Option<String>,
}

/// How forwarding ended.
enum End {
    /// The client sent Terminate or closed its socket.
    ClientDone,
    /// The client's socket failed.
    ClientFailed(std::io::Error),
    /// The client broke the framing rules.
    ClientProtocol(lokadb_shared::wire::FrameError),
    /// The cloud closed or failed.
    ServerLost(std::io::Error),
    /// The organization's database closed or failed under a direct statement.
    DirectLost(OrgId, std::io::Error),
    /// The proxy is shutting down and the session is idle.
    Shutdown,
    /// No cloud backend for the session's next transaction (`pool_timeout`, a failed login).
    NoBackend(SessionError),
}

impl End {
    /// How the session ended, for its log line.
    fn as_str(&self) -> &'static str {
        match self {
            End::ClientDone => "client left",
            End::ClientFailed(_) => "client connection failed",
            End::ClientProtocol(_) => "client broke the protocol",
            End::ServerLost(_) => "cloud connection lost",
            End::DirectLost(..) => "organization's database lost",
            End::Shutdown => "shutdown",
            End::NoBackend(_) => "no cloud backend",
        }
    }
}

async fn forward(
    core: &Rc<Core>,
    mut client: ClientStream,
    key: PoolKey,
    attached: Attached,
    subnet: &str,
) {
    let Attached {
        _admitted,
        mut backend,
        creds,
        session,
        db,
        privileges,
        start_org,
        tx_defaults,
        login_path,
    } = attached;
    let (max, route_log) = {
        let settings = core.shared.settings();
        (settings.config.max_message_bytes, settings.config.route_log)
    };
    CoreStats::add(&core.stats.sessions, 1);
    let started = Instant::now();
    let who = Who {
        user: &key.user,
        database: &db.name,
        client: subnet,
    };
    let mut seen = Seen::default();
    // The console's view of the session (only kept when something reads it).
    let live = core.shared.publishes().then(|| {
        let live = Rc::new(RefCell::new(Live {
            state: "idle",
            direct_org: None,
            pinned: None,
        }));
        let (fd, addr) = super::console::socket_of(client.tcp());
        core.clients.borrow_mut().insert(
            session.get(),
            ClientInfo {
                database: db.name.clone(),
                user: key.user.clone(),
                addr,
                since: std::time::SystemTime::now(),
                backend_pid: backend.pid,
                fd,
                live: live.clone(),
            },
        );
        live
    });
    let counts = |ex: &Exchanges| {
        [
            ex.cloud.answered,
            ex.direct.answered,
            ex.cloud.errors,
            ex.direct.errors,
        ]
    };
    let mut exchanges = Exchanges {
        cloud: Exchange {
            status: backend.status,
            ..Exchange::default()
        },
        direct: Exchange::default(),
    };
    // Transaction pooling: the backend goes back at each idle point; the next message waits
    // for one ([`super::tx_pool`]).
    let source = CloudSource::new(core, &db, &key, creds);
    let mut tx = (db.config.pool_mode == PoolMode::Transaction).then(|| {
        TxSession::new(
            db.config.max_prepared_statements,
            core.shared.notifiers.clone(),
        )
    });
    if let Some(t) = tx.as_mut() {
        t.acquired(std::mem::take(&mut backend.holds), &mut exchanges.cloud);
        exchanges.cloud.notify = Some(NotifyPids {
            backend: backend.pid,
            key: crate::cancel::pooled_pid(session),
            others: core.shared.notifiers.clone(),
        });
    }
    let mut acquiring: Option<Acquiring<'_>> = None;
    let mut detached_io = Detached;
    let mut router = Router::new(db.config.direct.is_some(), privileges);
    router.cloud_org.tell = db.config.statement_org;
    router.key_lookup = db.config.direct_key_lookup;
    if let Some(org) = start_org {
        router.org.start_in(org);
    }
    router.tx_defaults = tx_defaults;
    router.route_log = route_log;
    let mut reported = Reported::default();
    for (name, value) in &backend.params {
        reported.note(&parameter_status_body(name, value));
    }
    if reported.search_path.is_none() {
        // An older cloud does not report search_path: the one read at login if it was read
        // (the proxy routes by names only where it was), else any set at startup is not
        // followed.
        match &login_path {
            Some(path) => router.names.note_path(path),
            None => {
                if let Some((_, options)) = key.params.iter().find(|(k, _)| k == "options") {
                    router.names.note_options(options);
                }
            }
        }
    }
    // The connection to an organization's database, once a statement went direct.
    let mut direct = Direct::default();
    // Which backend the server → client pipe reads.
    let mut reading = Side::Cloud;
    // The database's routing metadata, looked up again only when a generation arrived.
    let mut meta: Option<Rc<crate::route::meta::CoreMeta>> = None;
    let mut meta_seen = None;
    let record = core.record.as_ref().map(|r| (r, session.get()));
    if let Some((rec, id)) = record {
        rec.start(id, &key.database, &key.user);
    }
    let mut up = Pipe::new(max);
    let mut down = Pipe::new(SERVER_MESSAGE_MAX);
    down.preload(&std::mem::take(&mut backend.rbuf));
    let mut cloud = Some(backend);
    // Timed and counted where it is read (`GET /metrics`, the console), as `live` is kept.
    router.tally = live.is_some().then(|| {
        let stats = core
            .db_stats
            .borrow_mut()
            .entry(db.name.clone())
            .or_default()
            .clone();
        super::tally::Tally::new(stats)
    });
    // Sessions end at their first idle point after `idle_cut` (shutdown + a grace).
    let cut_slot = core.idle_cut.slot();

    // A task's waker does not change, so it is registered for the cut once; each step
    // then only reads a Cell.
    let mut cut_registered = false;
    let mut end = futures_lite::future::poll_fn(|cx| {
        if !cut_registered {
            core.idle_cut.poll_fired(cut_slot, cx);
            cut_registered = true;
        }
        // Bounded work per poll so one busy session cannot starve the core.
        for _ in 0..32 {
            if core.idle_cut.is_fired()
                && exchanges.cloud.is_idle()
                && exchanges.direct.is_idle()
                && !router.holds_begin()
                && !router.holds_message()
                && up.at_frame_boundary()
                && !up.has_unwritten()
                && !down.has_unwritten()
            {
                return Poll::Ready(End::Shutdown);
            }
            let mut progress = false;
            // A live session routes by the newest generation from its next step on.
            if meta_seen != Some(core.meta_version.get()) {
                meta = core.meta.borrow().get(&*db.name).cloned();
                meta_seen = Some(core.meta_version.get());
                if let Some(m) = &meta {
                    router.privileges.index(&m.meta.catalog);
                }
            }
            router.down_ready = down.at_frame_boundary() && !down.has_unwritten();
            // PAUSE (the console): a session between transactions sends nothing more
            // until RESUME; its next message waits in its socket.
            let paused = core.pauses(&db.name)
                && exchanges.cloud.is_idle()
                && exchanges.direct.is_idle()
                && exchanges.cloud.status == TX_IDLE
                && exchanges.direct.status == TX_IDLE
                && up.is_flushed()
                && up.at_frame_boundary()
                && !up.held
                && !router.holds_begin()
                && !router.holds_message();
            // What the proxy queued of its own goes before anything else of the client's.
            if let Some(b) = cloud.as_mut() {
                match flush_own(cx, &mut b.stream, &mut exchanges.cloud) {
                    Ok(wrote) => progress |= wrote,
                    Err(e) => return Poll::Ready(lost(Side::Cloud, &router, e)),
                }
            }
            if let Some(d) = direct.conn.as_mut() {
                match flush_own(cx, &mut d.conn.stream, &mut exchanges.direct) {
                    Ok(wrote) => progress |= wrote,
                    Err(e) => return Poll::Ready(lost(Side::Direct, &router, e)),
                }
            }
            if paused {
                core.wait_resume(cx);
            } else if !exchanges.get(router.target).outbox.is_empty() {
                // Waits for its own requests to be written (the flush above is woken).
            } else {
                let target = router.target;
                let to: &mut (dyn AsyncWrite + Unpin) =
                    match (target, direct.conn.as_mut(), cloud.as_mut()) {
                        (Side::Direct, Some(d), _) => &mut d.conn.stream,
                        (_, _, Some(b)) => &mut b.stream,
                        // Without a backend every message is held ([`TxSession::detached`]).
                        _ => &mut detached_io,
                    };
                router.follow_path(&reported);
                let mut inspect = ClientFrames {
                    exchanges: &mut exchanges,
                    route_log,
                    meta: meta.as_deref(),
                    router: &mut router,
                    record,
                    tx: tx.as_mut(),
                };
                match up.poll_step(cx, Pin::new(&mut client), Pin::new(to), &mut inspect) {
                    Poll::Ready(Ok(_)) => progress = true,
                    Poll::Ready(Err(PipeError::Read(e))) => {
                        return Poll::Ready(End::ClientFailed(e))
                    }
                    Poll::Ready(Err(PipeError::Write(e))) => {
                        return Poll::Ready(lost(target, &router, e));
                    }
                    Poll::Ready(Err(PipeError::Frame(e))) => {
                        return Poll::Ready(End::ClientProtocol(e))
                    }
                    Poll::Pending => {}
                }
            }
            if !router.local_out.is_empty() {
                // The proxy's own answers (a deferred BEGIN): nothing is in flight, so
                // they come in order.
                down.inject(&std::mem::take(&mut router.local_out));
                progress = true;
            }
            if up.stopped && up.is_flushed() {
                return Poll::Ready(End::ClientDone);
            }

            // The gate of direct writes closes once the organization's transaction ended.
            if super::switch::close_gate(&mut router, &mut exchanges) {
                progress = true;
            }

            // Transaction pooling: a message waits for a backend.
            if let Some(t) = tx.as_mut().filter(|t| t.wants_backend && cloud.is_none()) {
                let fut = acquiring.get_or_insert_with(|| Box::pin(source.acquire(true)));
                match fut.as_mut().poll(cx) {
                    Poll::Ready(Ok(mut b)) => {
                        acquiring = None;
                        t.acquired(std::mem::take(&mut b.holds), &mut exchanges.cloud);
                        if let Some(n) = exchanges.cloud.notify.as_mut() {
                            n.backend = b.pid;
                        }
                        t.detached = false;
                        t.wants_backend = false;
                        // What the proxy knew the last backend held of `statement_org`.
                        router.cloud_org.forget();
                        core.cancels
                            .borrow_mut()
                            .retarget(session, super::direct::cancel_target(&b));
                        if live.is_some() {
                            show_backend(core, session, b.pid);
                        }
                        cloud = Some(b);
                        up.release();
                        progress = true;
                    }
                    Poll::Ready(Err(e)) => return Poll::Ready(End::NoBackend(e)),
                    Poll::Pending => {}
                }
            }

            // A message waits for another destination: switch once everything sent
            // before it is answered.
            if let (true, Some(backend)) = (up.held, cloud.as_ref()) {
                let ready = up.is_flushed()
                    && exchanges.get(router.target).is_settled()
                    && down.at_frame_boundary()
                    && !down.has_unwritten();
                let ctx = Ctx {
                    core,
                    db: &db,
                    key: &key,
                    session,
                };
                if ready {
                    let mut link = SessionLink {
                        cx,
                        ctx: &ctx,
                        direct: &mut direct,
                        cloud: backend,
                        reported: &reported,
                    };
                    let queued_before =
                        exchanges.cloud.outbox.len() + exchanges.direct.outbox.len();
                    let done = super::switch::switch(&mut router, &mut exchanges, &mut link);
                    // What it queued now is written at the next step; bytes queued before
                    // that wait for their socket are no reason to turn again (woken when
                    // it is writable).
                    let queued = exchanges.cloud.outbox.len() + exchanges.direct.outbox.len()
                        > queued_before;
                    if done {
                        up.release();
                    }
                    progress |= done || queued;
                }
            }

            if down.at_frame_boundary() {
                let direct_busy = exchanges.direct.pending > 0 || exchanges.direct.unsynced;
                reading = match direct.conn {
                    Some(_) if direct_busy => Side::Direct,
                    _ => Side::Cloud,
                };
            }
            let from: &mut (dyn AsyncRead + Unpin) =
                match (reading, direct.conn.as_mut(), cloud.as_mut()) {
                    (Side::Direct, Some(d), _) => &mut d.conn.stream,
                    (_, _, Some(b)) => &mut b.stream,
                    _ => &mut detached_io,
                };
            let mut inspect = ServerFrames {
                exchange: exchanges.get_mut(reading),
                side: reading,
                reported: &mut reported,
                record,
            };
            match down.poll_step(cx, Pin::new(from), Pin::new(&mut client), &mut inspect) {
                Poll::Ready(Ok(_)) => progress = true,
                Poll::Ready(Err(PipeError::Read(e))) => {
                    return Poll::Ready(lost(reading, &router, e))
                }
                Poll::Ready(Err(PipeError::Write(e))) => return Poll::Ready(End::ClientFailed(e)),
                Poll::Ready(Err(PipeError::Frame(e))) => {
                    let e = std::io::Error::other(e.to_string());
                    return Poll::Ready(lost(reading, &router, e));
                }
                Poll::Pending => {}
            }
            if down.stopped && down.is_flushed() {
                let e = std::io::ErrorKind::UnexpectedEof.into();
                return Poll::Ready(lost(reading, &router, e));
            }
            if reading == Side::Cloud && direct.watch_idle(cx, &mut router, &exchanges, up.held) {
                progress = true;
            }
            // direct_pool: between the organization's transactions its connection goes
            // back to the core's pool, once it has answered everything (the server → client
            // pipe reads the cloud again: checked after its step, which switches it) and
            // nothing of the client's is on its way to it.
            // (A session using its direct connection holds its cloud backend too.)
            let direct_done = db.config.direct_pool
                && direct.conn.is_some()
                && router.gate.is_closed()
                && exchanges.direct.is_idle()
                && reading == Side::Cloud
                && !up.held
                && !router.holds_begin()
                && !router.holds_message()
                && up.at_frame_boundary()
                && !up.has_unwritten();
            if let Some(backend) = cloud.as_ref().filter(|_| direct_done) {
                let ctx = Ctx {
                    core,
                    db: &db,
                    key: &key,
                    session,
                };
                direct.release(&ctx, &mut router, backend);
                progress = true;
            }

            // Transaction pooling: at an idle point the backend goes back to the pool (once
            // the settings a transaction may have changed are read back).
            if let (Some(t), true) = (tx.as_mut(), cloud.is_some()) {
                let idle_point = t.pinned.is_none()
                    && exchanges.cloud.is_idle()
                    && exchanges.cloud.outbox.is_empty()
                    && exchanges.cloud.silenced.is_empty()
                    && exchanges.direct.is_idle()
                    && direct.conn.is_none()
                    && reading == Side::Cloud
                    && router.target == Side::Cloud
                    && router.gate.is_closed()
                    && router.want.is_none()
                    && router.lookup == super::router::Lookup::None
                    && !router.holds_begin()
                    && !router.holds_message()
                    && !up.held
                    && up.at_frame_boundary()
                    && !up.has_unwritten()
                    && down.at_frame_boundary()
                    && !down.has_unwritten();
                if idle_point {
                    match t.read_back(&mut exchanges.cloud) {
                        super::tx_pool::ReadBack::Queued => progress = true,
                        super::tx_pool::ReadBack::Done if t.pinned.is_none() => {
                            if let Some(mut b) = cloud.take() {
                                b.holds = t.released(&exchanges.cloud);
                                b.status = TX_IDLE;
                                core.cancels.borrow_mut().detach(session);
                                if live.is_some() {
                                    show_backend(core, session, 0);
                                }
                                t.detached = true;
                                source.give_back(b);
                                progress = true;
                            }
                        }
                        _ => {}
                    }
                }
            }

            if !progress {
                // Idle until the next event: what was answered so far is counted now.
                core.stats.follow(&mut seen, counts(&exchanges));
                log_statement_errors(&router, &mut exchanges, &who);
                super::tally::follow(&mut router, &mut exchanges, down.has_unwritten());
                if let Some(live) = &live {
                    let busy = exchanges.cloud.pending > 0 || exchanges.direct.pending > 0;
                    let status = match exchanges.direct.status {
                        TX_IDLE => exchanges.cloud.status,
                        direct => direct,
                    };
                    let mut live = live.borrow_mut();
                    live.state = Live::state_of(busy, status);
                    live.direct_org.clone_from(&router.direct_org);
                    live.pinned = tx.as_ref().and_then(|t| t.pinned);
                }
                return Poll::Pending;
            }
        }
        cx.waker().wake_by_ref();
        Poll::Pending
    })
    .await;

    core.stats.follow(&mut seen, counts(&exchanges));
    log_statement_errors(&router, &mut exchanges, &who);
    super::tally::follow(&mut router, &mut exchanges, false);
    if live.is_some() {
        core.clients.borrow_mut().remove(&session.get());
    }
    core.idle_cut.release(cut_slot);
    core.cancels.borrow_mut().unregister(session);
    if let Some((rec, id)) = record {
        rec.record(crate::record::Kind::End, id, &[]);
        rec.flush();
    }

    // What the client is told, if it can still be told something without cutting a
    // message in half.
    let notice = match &mut end {
        End::ClientProtocol(e) => Some(SessionError::Protocol(e.clone())),
        // The client has the backend's own reason (a FATAL error: terminated by an
        // administrator, shut down), as it would straight at Postgres.
        End::ServerLost(e) if exchanges.get(Side::Cloud).ended_with_fatal => {
            tracing::debug!(error = %e, "the cloud ended the session with a FATAL error");
            None
        }
        End::ServerLost(e) => Some(SessionError::UpstreamLost(std::io::Error::new(
            e.kind(),
            e.to_string(),
        ))),
        End::DirectLost(org, e) => Some(SessionError::DirectLost(
            org.to_string(),
            std::io::Error::new(e.kind(), e.to_string()),
        )),
        End::Shutdown => Some(SessionError::Shutdown),
        End::NoBackend(e) => Some(std::mem::replace(e, SessionError::Shutdown)),
        End::ClientFailed(e) => {
            tracing::debug!(error = %e, "client connection failed");
            None
        }
        End::ClientDone => None,
    };
    tracing::info!(
        user = %key.user,
        database = %db.name,
        seconds = started.elapsed().as_secs(),
        requests = exchanges.cloud.answered + exchanges.direct.answered,
        errors = exchanges.cloud.errors + exchanges.direct.errors,
        end = end.as_str(),
        "session ended"
    );
    if let Some(e) = notice {
        if down.at_frame_boundary() && !down.has_unwritten() {
            Box::pin(report(&mut client, e, &who)).await;
        } else {
            log_error(&e, &who);
        }
    }
    drop(client);

    let clean = matches!(end, End::ClientDone | End::ClientFailed(_))
        && !router.holds_message()
        && up.at_frame_boundary()
        && !up.has_unwritten()
        && down.at_frame_boundary()
        && !down.has_unwritten();
    direct.finish(core, &db, clean && exchanges.direct.is_idle());
    // Between transactions (transaction pooling) the session holds none.
    let Some(mut backend) = cloud else {
        return;
    };
    let reusable = clean && exchanges.cloud.is_settled();
    if !db.config.upstream_pool || !reusable || core.shutdown.is_fired() {
        tracing::debug!(backend_pid = backend.pid, reusable, "closing backend");
        return Box::pin(backend.terminate()).await;
    }
    backend.status = exchanges.cloud.status;
    // Transaction pooling: a backend idle, unpinned, with its settings known, goes back as
    // at any idle point; any other is reset.
    if let Some(t) = tx.as_mut().filter(|t| t.gives_back_as_is()) {
        if exchanges.cloud.is_idle() && exchanges.cloud.silenced.is_empty() {
            backend.holds = t.released(&exchanges.cloud);
            return source.give_back(backend);
        }
    }
    // Boxed, as what follows forwarding: the session's future stays the size of its loop.
    match Box::pin(pool::reset(&mut backend)).await {
        Ok(true) => source.give_back(backend),
        Ok(false) => {
            tracing::debug!(
                backend_pid = backend.pid,
                "closing backend: it has a temporary schema"
            );
            Box::pin(backend.terminate()).await;
        }
        Err(e) => tracing::info!(error = %e, "backend reset failed; closing it"),
    }
}

/// The cloud backend the console shows for a session (0: none, between its transactions).
fn show_backend(core: &Core, session: SessionId, pid: u32) {
    if let Some(c) = core.clients.borrow_mut().get_mut(&session.get()) {
        c.backend_pid = pid;
    }
}

/// Writes the requests of the proxy's own queued for a backend ([`Exchange::send_own`]):
/// true when all of them are written now; false when there were none or some are left (the
/// session is woken when the socket is writable).
fn flush_own(
    cx: &mut std::task::Context<'_>,
    stream: &mut (impl futures_lite::AsyncWrite + Unpin),
    ex: &mut Exchange,
) -> std::io::Result<bool> {
    if ex.outbox.is_empty() {
        return Ok(false);
    }
    while !ex.outbox.is_empty() {
        match Pin::new(&mut *stream).poll_write(cx, &ex.outbox) {
            Poll::Ready(Ok(0)) => return Err(std::io::ErrorKind::WriteZero.into()),
            Poll::Ready(Ok(n)) => {
                ex.outbox.drain(..n);
            }
            Poll::Ready(Err(e)) => return Err(e),
            Poll::Pending => return Ok(false),
        }
    }
    // TLS may hold the last records until flushed; a flush that cannot finish now wakes
    // the session when it can (the pump flushes too).
    let _ = Pin::new(&mut *stream).poll_flush(cx);
    Ok(true)
}

/// How a failed backend ends the session.
fn lost(side: Side, router: &Router, e: std::io::Error) -> End {
    match (side, &router.direct_org) {
        (Side::Direct, Some(org)) => End::DirectLost(org.clone(), e),
        _ => End::ServerLost(e),
    }
}

/// A ParameterStatus body.
fn parameter_status_body(name: &str, value: &str) -> Vec<u8> {
    let mut b = Vec::with_capacity(name.len() + value.len() + 2);
    backend::put_cstr(&mut b, name);
    backend::put_cstr(&mut b, value);
    b
}

/// Sends an error to the client (if it is one the client may see) and closes.
async fn report(stream: &mut ClientStream, e: SessionError, who: &Who<'_>) {
    log_error(&e, who);
    let mut out = Vec::new();
    e.to_client(&mut out);
    if !out.is_empty() {
        let _ = stream.write_all(&out).await;
        let _ = stream.flush().await;
    }
    let _ = stream.close().await;
}

fn log_error(e: &SessionError, who: &Who<'_>) {
    // The SQLSTATE the client is told, for filtering (errors are rare: encoding it again
    // costs nothing).
    let mut told = Vec::new();
    e.to_client(&mut told);
    let notice = told
        .get(5..)
        .and_then(|body| lokadb_shared::wire::notice::Notice::parse(body).ok());
    let sqlstate = notice.as_ref().map_or("", |n| n.code.as_str());
    let Who {
        user,
        database,
        client,
    } = *who;
    match e.kind() {
        ErrorKind::ClientDisconnect => {
            tracing::debug!(user, database, client, error = %e, "client went away")
        }
        ErrorKind::User => {
            tracing::info!(user, database, client, sqlstate, error = %e, "client error")
        }
        ErrorKind::Limit | ErrorKind::Service => {
            tracing::info!(user, database, client, sqlstate, error = %e, "connection refused")
        }
        ErrorKind::Upstream => {
            tracing::warn!(user, database, client, sqlstate, error = %e, "cloud error")
        }
    }
}

/// One line per error a backend answered the client with (at most [`ERRORS_LOGGED`] per
/// request: the rest are counted), with the session's fields and the organization: the
/// direct connection's, else the session's (`lokadb.org`), else the statement's where the
/// figures per organization are kept.
fn log_statement_errors(router: &Router, exchanges: &mut Exchanges, who: &Who<'_>) {
    for side in [Side::Cloud, Side::Direct] {
        let notes = std::mem::take(&mut exchanges.get_mut(side).error_notes);
        if notes.is_empty() {
            continue;
        }
        let org = match side {
            Side::Direct => router.direct_org.as_ref().map(OrgId::as_str),
            Side::Cloud => router
                .org
                .current
                .as_ref()
                .map(OrgId::as_str)
                .or_else(|| router.tally.as_ref().and_then(|t| t.org())),
        }
        .unwrap_or("");
        for n in &notes {
            tracing::info!(
                user = who.user,
                database = who.database,
                client = who.client,
                org,
                side = match side {
                    Side::Cloud => "cloud",
                    Side::Direct => "direct",
                },
                sqlstate = n.sqlstate.as_str(),
                error = n.message.as_str(),
                "statement error"
            );
        }
    }
}

/// Counts a connection on its core, so shutdown knows when sessions are gone.
struct SessionCount<'a> {
    core: &'a Core,
}

impl<'a> SessionCount<'a> {
    fn new(core: &'a Core) -> Self {
        core.sessions.set(core.sessions.get() + 1);
        SessionCount { core }
    }
}

impl Drop for SessionCount<'_> {
    fn drop(&mut self) {
        self.core.sessions.set(self.core.sessions.get() - 1);
    }
}

/// An authenticated session's slot of `max_connections` over all cores.
pub(super) struct Admitted {
    shared: std::sync::Arc<crate::core::Shared>,
}

impl Admitted {
    pub(super) fn new(shared: &std::sync::Arc<crate::core::Shared>) -> Option<Admitted> {
        let open = shared.connections.fetch_add(1, Ordering::Relaxed) + 1;
        let slot = Admitted {
            shared: shared.clone(),
        };
        // Over the limit, the slot is given back as it drops.
        (open <= shared.settings().config.max_connections).then_some(slot)
    }
}

impl Drop for Admitted {
    fn drop(&mut self) {
        self.shared.connections.fetch_sub(1, Ordering::Relaxed);
    }
}

/// How long a refused connection's error may take to be written before it is closed.
const REFUSAL_WRITE: std::time::Duration = std::time::Duration::from_secs(1);

/// A client in the handshake (accepted, not yet authenticated): counted over all cores
/// (`max_handshakes`) and by address on its core (`max_handshakes_per_address`).
struct Handshake<'a> {
    core: &'a Core,
    peer: Option<std::net::IpAddr>,
}

impl<'a> Handshake<'a> {
    /// Counts a new connection from `peer` (not counted by address when it has none), or
    /// says which limit it is over.
    fn begin(
        core: &'a Core,
        peer: Option<std::net::IpAddr>,
    ) -> Result<Handshake<'a>, SessionError> {
        let settings = core.shared.settings();
        let config = &settings.config;
        let all = core.shared.handshakes.fetch_add(1, Ordering::Relaxed) + 1;
        // From here on, dropping it gives back what it took.
        let mut h = Handshake { core, peer: None };
        if all > config.max_handshakes {
            return Err(SessionError::TooManyHandshakes { per_address: false });
        }
        let Some(ip) = peer else { return Ok(h) };
        let mut by_address = core.handshaking.borrow_mut();
        let n = by_address.entry(ip).or_insert(0);
        if *n >= config.max_handshakes_per_address {
            return Err(SessionError::TooManyHandshakes { per_address: true });
        }
        *n += 1;
        drop(by_address);
        h.peer = Some(ip);
        Ok(h)
    }
}

impl Drop for Handshake<'_> {
    fn drop(&mut self) {
        self.core.shared.handshakes.fetch_sub(1, Ordering::Relaxed);
        if let Some(ip) = self.peer {
            let mut by_address = self.core.handshaking.borrow_mut();
            if let Some(n) = by_address.get_mut(&ip) {
                *n -= 1;
                if *n == 0 {
                    by_address.remove(&ip);
                }
            }
        }
    }
}

/// A cloud backend being acquired (transaction pooling).
type Acquiring<'a> =
    Pin<Box<dyn std::future::Future<Output = Result<BackendConn, SessionError>> + 'a>>;

/// The cloud side of a session that holds no backend: nothing to read; nothing is written
/// to it (every message is held until a backend is acquired).
struct Detached;

impl AsyncRead for Detached {
    fn poll_read(
        self: Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
        _: &mut [u8],
    ) -> Poll<std::io::Result<usize>> {
        Poll::Pending
    }
}

impl AsyncWrite for Detached {
    fn poll_write(
        self: Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
        _: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Poll::Ready(Err(std::io::Error::other(
            "no cloud backend held: nothing may be written",
        )))
    }

    fn poll_flush(
        self: Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_close(
        self: Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}
