//! A client session from accept to close: negotiate, authenticate, attach a cloud
//! backend (warm from the pool or new), forward, and give the backend back.

use super::auth::{authenticate, Authenticated};
use super::pump::{Pipe, PipeError};
use super::router::{Exchanges, Gate, Privileges, Router, Side, Want};
use super::startup::{negotiate, Negotiated};
use super::statement::{ClientFrames, Exchange, Reported, ServerFrames};
use crate::backend::conn::{BackendConn, ConnError};
use crate::backend::pool::{self, PoolKey};
use crate::cancel::CancelTarget;
use crate::core::{Core, Database};
use crate::error::{ErrorKind, SessionError};
use crate::net::stream::ClientStream;
use crate::rt::net::TcpStream;
use crate::scram::{Credentials, Secret};
use crate::time::with_timeout;
use futures_lite::{AsyncRead, AsyncWrite, AsyncWriteExt};
use lokadb_shared::wire::backend;
use lokadb_shared::wire::startup::StartupMessage;
use lokadb_shared::wire::tags::TX_IDLE;
use lokadb_shared::wire::tags::*;
use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::task::Poll;
use std::time::Instant;
use tracing::Instrument;

/// Serves one client connection to the end. Never panics on client input; every
/// failure ends only this session.
pub async fn serve(core: Rc<Core>, tcp: TcpStream) {
    let subnet = tcp
        .peer_addr()
        .map(|a| crate::net::subnet(a.ip()))
        .unwrap_or_else(|_| "?".into());
    let span = tracing::debug_span!("session", core = core.id, client = %subnet);
    let count = SessionCount::new(&core);
    serve_inner(&core, tcp, count.over_limit)
        .instrument(span)
        .await
}

async fn serve_inner(core: &Rc<Core>, tcp: TcpStream, over_limit: bool) {
    let _ = tcp.set_nodelay(true);
    let auth_timeout = core.shared.config.auth_timeout;
    let started = Instant::now();
    let (mut stream, startup) = match with_timeout(auth_timeout, negotiate(tcp, core)).await {
        None => return tracing::debug!("auth_timeout during the startup phase"),
        Some(Err((e, Some(mut stream)))) => return report(&mut stream, e).await,
        Some(Err((e, None))) => return log_error(&e),
        Some(Ok(Negotiated::Cancelled)) => return,
        Some(Ok(Negotiated::Startup(stream, startup))) => (stream, startup),
    };
    let refusal = if over_limit {
        Some(SessionError::TooManyConnections)
    } else if core.shutdown.is_fired() {
        Some(SessionError::Shutdown)
    } else {
        None
    };
    if let Some(e) = refusal {
        return report(&mut stream, e).await;
    }
    let remaining = auth_timeout.saturating_sub(started.elapsed());
    let attached = match with_timeout(remaining, attach(core, &mut stream, &startup)).await {
        None => Err(SessionError::AuthTimeout),
        Some(r) => r,
    };
    match attached {
        Ok((key, backend)) => forward(core, stream, key, backend).await,
        Err(e) => report(&mut stream, e).await,
    }
}

/// Authenticates the client and gives it a logged-in backend; on success the client
/// has received everything up to its first ReadyForQuery.
async fn attach(
    core: &Core,
    stream: &mut ClientStream,
    startup: &StartupMessage,
) -> Result<(PoolKey, Attached), SessionError> {
    let user = startup.param("user").unwrap_or_default();
    let database = startup
        .param("database")
        .filter(|d| !d.is_empty())
        .unwrap_or(user);
    if startup
        .param("replication")
        .is_some_and(|r| r != "false" && r != "off" && r != "0")
    {
        return Err(SessionError::Unsupported("replication connections"));
    }
    let db = core
        .databases
        .get(database)
        .ok_or_else(|| SessionError::UnknownDatabase(database.to_owned()))?;
    let Authenticated {
        credentials,
        server_final,
    } = authenticate(stream, core, db, user).await?;

    let mut params: Vec<(String, String)> = startup
        .params
        .iter()
        .filter(|(k, _)| k != "user" && k != "database" && !k.starts_with("_pq_."))
        .cloned()
        .collect();
    params.sort();
    let key = PoolKey {
        database: db.name.clone(),
        user: user.to_owned(),
        org: None,
        params,
    };
    let pooled = if db.config.upstream_pool {
        core.pool
            .borrow_mut()
            .take(&key, db.config.pool_idle_timeout, Instant::now())
    } else {
        None
    };
    let mut backend = match pooled {
        Some(b) => b,
        None => connect_backend(db, &key, &credentials).await?,
    };

    let privileges = if db.config.direct.is_some() {
        direct_privileges(core, db, user, &mut backend).await
    } else {
        Privileges::default()
    };
    let cancel = core.cancels.borrow_mut().register(
        core.id,
        CancelTarget {
            addr: backend.addr,
            pid: backend.pid,
            secret: backend.secret.clone(),
        },
    );
    let mut out = Vec::with_capacity(512);
    backend::auth_sasl_data(&mut out, AUTH_SASL_FINAL, server_final.as_bytes());
    backend::auth_ok(&mut out);
    for (name, value) in &backend.params {
        backend::parameter_status(&mut out, name, value);
    }
    backend::backend_key_data(&mut out, cancel.pid, cancel.secret);
    backend::ready_for_query(&mut out, backend.status);
    let attached = Attached {
        backend,
        cancel_pid: cancel.pid,
        db: db.clone(),
        privileges,
    };
    let written = async {
        stream.write_all(&out).await?;
        stream.flush().await
    };
    if let Err(e) = written.await {
        core.cancels.borrow_mut().unregister(cancel.pid);
        return Err(SessionError::Client(e));
    }
    tracing::debug!(
        user,
        database,
        backend_pid = attached.backend.pid,
        "session attached"
    );
    Ok((key, attached))
}

async fn connect_backend(
    db: &Database,
    key: &PoolKey,
    creds: &crate::scram::Credentials,
) -> Result<BackendConn, SessionError> {
    let connect = BackendConn::connect(db.addr, &key.user, &db.dbname, &key.params, creds);
    match with_timeout(db.config.connect_timeout, connect).await {
        None => Err(SessionError::UpstreamConnect(format!(
            "no answer within connect_timeout from {}",
            db.addr
        ))),
        Some(Ok(b)) => Ok(b),
        Some(Err(ConnError::Rejected { frame, notice })) => {
            tracing::info!(code = %notice.code, message = %notice.message, "the cloud refused the login");
            Err(SessionError::UpstreamRejected(frame))
        }
        Some(Err(e)) => Err(SessionError::UpstreamConnect(format!("{}: {e}", db.addr))),
    }
}

/// A backend attached to a session, with the session's cancel key.
struct Attached {
    backend: BackendConn,
    cancel_pid: u32,
    db: Rc<Database>,
    privileges: Privileges,
}

/// How long a login waits for this core's metadata to reach the cloud's generation.
const METADATA_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// The cloud's metadata generation and what the client's role may do to each LokaDB table
/// (read, update), as the cloud says when it logs in: `GENERATION:flags,flags,…`.
const CHECK_SQL: &str = "SELECT lokadb_client.generation()::text || ':' || coalesce((\
     SELECT string_agg(CASE WHEN c.relrowsecurity THEN '--' ELSE \
     CASE WHEN has_table_privilege(c.oid, 'SELECT') THEN 'r' ELSE '-' END || \
     CASE WHEN has_table_privilege(c.oid, 'UPDATE') THEN 'u' ELSE '-' END END, ',' ORDER BY t.n) \
     FROM unnest(string_to_array($1, E'\\n')) WITH ORDINALITY AS t(name, n) \
     LEFT JOIN pg_catalog.pg_class c ON c.oid = pg_catalog.to_regclass(t.name)), '')";

/// The freshness check of a new connection, when the database has the direct path (the
/// only route that depends on the metadata for correctness of reads): one round trip on the
/// client's own backend, as its role, that returns the cloud's metadata generation — the
/// login waits until this core has it, so a statement right after a move is routed by it —
/// and the role's privileges on the LokaDB tables. The direct path runs as one role in every
/// organization's database, so a statement takes it only if the client's role could run it
/// in the cloud (SELECT, or UPDATE; no row-level security). With `meta_cache.verify`, a
/// check of the same role on this core within that interval is reused instead.
async fn direct_privileges(
    core: &Core,
    db: &Database,
    user: &str,
    backend: &mut BackendConn,
) -> Privileges {
    let now = Instant::now();
    let key = (db.name.clone(), user.to_owned());
    let core_generation = || core.meta.borrow().get(&*db.name).map(|m| m.meta.generation);
    if let Some(verify) = db.config.meta_cache.verify {
        let cached = core.checks.borrow().get(&key).and_then(|c| {
            let fresh =
                now.duration_since(c.at) < verify && Some(c.generation) <= core_generation();
            fresh.then(|| c.by_name.clone())
        });
        if let Some(by_name) = cached {
            return Privileges::new(by_name);
        }
    }
    // Right after the proxy starts, the metadata may still be on its way to this core.
    let deadline = now + METADATA_WAIT;
    while core_generation().is_none() && Instant::now() < deadline {
        crate::rt::sleep(std::time::Duration::from_millis(5)).await;
    }
    let tables = match core.meta.borrow().get(&*db.name) {
        Some(m) if m.has_tables() => m.meta.catalog.tables().to_vec(),
        _ => return Privileges::default(),
    };
    let quote = |s: &str| format!("\"{}\"", s.replace('"', "\"\""));
    let names: Vec<String> = tables
        .iter()
        .map(|t| format!("{}.{}", quote(&t.schema), quote(&t.name)))
        .collect();
    let answer = match backend
        .query_one("", CHECK_SQL, true, &names.join("\n"))
        .await
    {
        Ok(Some(Some(answer))) => answer,
        other => {
            tracing::info!(result = ?other.map(|_| ()), "could not check the routing metadata and the client's privileges (is the cloud's schema at version 6? lokadb init); its statements go through the cloud");
            return Privileges::default();
        }
    };
    let Some((generation, flags)) = answer
        .split_once(':')
        .and_then(|(g, f)| Some((g.parse::<i64>().ok()?, f)))
    else {
        return Privileges::default();
    };
    while core_generation().is_some_and(|g| g < generation) && Instant::now() < deadline {
        crate::rt::sleep(std::time::Duration::from_millis(2)).await;
    }
    if core_generation().is_some_and(|g| g < generation) {
        tracing::warn!(generation, "this core's routing metadata is behind the cloud's; the session's statements go through the cloud");
        return Privileges::default();
    }
    let by_name: HashMap<(String, String), (bool, bool)> = tables
        .iter()
        .zip(flags.split(','))
        .map(|(t, f)| {
            (
                (t.schema.clone(), t.name.clone()),
                (f.starts_with('r'), f.ends_with('u')),
            )
        })
        .collect();
    if db.config.meta_cache.verify.is_some() {
        core.checks.borrow_mut().insert(
            key,
            crate::core::Check {
                at: now,
                generation,
                by_name: by_name.clone(),
            },
        );
    }
    Privileges::new(by_name)
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
    DirectLost(Rc<str>, std::io::Error),
    /// The proxy is shutting down and the session is idle.
    Shutdown,
}

/// A session's connection to an organization's database.
struct DirectConn {
    conn: BackendConn,
    /// Its pool key: the organization, and the settings it was opened with.
    key: PoolKey,
    /// [`Reported::version`] when it was opened: a later `SET` of a copied setting makes
    /// it stale.
    version: u32,
}

/// A direct connection being opened, for the organization it is for.
type Connecting = (
    Rc<str>,
    Pin<Box<dyn Future<Output = Result<DirectConn, String>>>>,
);

async fn forward(core: &Rc<Core>, mut client: ClientStream, key: PoolKey, attached: Attached) {
    let Attached {
        mut backend,
        cancel_pid,
        db,
        privileges,
    } = attached;
    let max = core.shared.config.max_message_bytes;
    let route_log = core.shared.config.route_log;
    let mut exchanges = Exchanges {
        cloud: Exchange {
            status: backend.status,
            ..Exchange::default()
        },
        direct: Exchange::default(),
    };
    let mut router = Router::new(db.config.direct.is_some(), privileges);
    let mut reported = Reported::default();
    for (name, value) in &backend.params {
        reported.note(&parameter_status_body(name, value));
    }
    // The direct connection, and the cloud settings it was opened with.
    let mut direct: Option<DirectConn> = None;
    let mut connecting: Option<Connecting> = None;
    // Which backend the server → client pipe reads.
    let mut reading = Side::Cloud;
    // The database's routing metadata, looked up again only when a generation arrived.
    let mut meta: Option<Rc<crate::route::meta::CoreMeta>> = None;
    let mut meta_seen = None;
    let record = core.record.as_ref().map(|r| (r, cancel_pid));
    if let Some((rec, session)) = record {
        rec.start(session, &key.database, &key.user);
    }
    let mut up = Pipe::new(max);
    let mut down = Pipe::new(u32::MAX);
    down.preload(&std::mem::take(&mut backend.rbuf));
    let slot = core.shutdown.slot();

    // A task's waker does not change, so it is registered for shutdown once; each
    // step then only reads a Cell.
    let mut shutdown_registered = false;
    let end = futures_lite::future::poll_fn(|cx| {
        if !shutdown_registered {
            core.shutdown.poll_fired(slot, cx);
            shutdown_registered = true;
        }
        // Bounded work per poll so one busy session cannot starve the core.
        for _ in 0..32 {
            if core.shutdown.is_fired()
                && exchanges.cloud.is_idle()
                && exchanges.direct.is_settled()
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
            let target = router.target;
            let to = match (target, direct.as_mut()) {
                (Side::Direct, Some(d)) => &mut d.conn.stream,
                _ => &mut backend.stream,
            };
            let mut inspect = ClientFrames {
                exchanges: &mut exchanges,
                route_log,
                meta: meta.as_deref(),
                router: &mut router,
                record,
            };
            match up.poll_step(cx, Pin::new(&mut client), Pin::new(to), &mut inspect) {
                Poll::Ready(Ok(_)) => progress = true,
                Poll::Ready(Err(PipeError::Read(e))) => return Poll::Ready(End::ClientFailed(e)),
                Poll::Ready(Err(PipeError::Write(e))) => {
                    return Poll::Ready(lost(target, &router, e));
                }
                Poll::Ready(Err(PipeError::Frame(e))) => {
                    return Poll::Ready(End::ClientProtocol(e))
                }
                Poll::Pending => {}
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
            if router.gate != Gate::Closed && exchanges.direct.is_idle() {
                router.direct_wrote = false;
                if matches!(router.gate, Gate::Open(_))
                    && send_own(cx, &mut backend, &mut exchanges.cloud, "COMMIT").is_ready()
                {
                    router.gate = Gate::Closed;
                    progress = true;
                }
            }

            // A message waits for another destination: switch once everything sent
            // before it is answered.
            if up.held {
                let ready = up.is_flushed()
                    && exchanges.get(router.target).is_settled()
                    && down.at_frame_boundary()
                    && !down.has_unwritten();
                if ready
                    && switch(
                        cx,
                        core,
                        &db,
                        &key,
                        &mut router,
                        &mut exchanges,
                        &reported,
                        &mut direct,
                        &mut connecting,
                        &mut backend,
                        cancel_pid,
                    )
                {
                    up.release();
                    progress = true;
                }
            }

            if down.at_frame_boundary() {
                let direct_busy = exchanges.direct.pending > 0 || exchanges.direct.unsynced;
                reading = match direct {
                    Some(_) if direct_busy => Side::Direct,
                    _ => Side::Cloud,
                };
            }
            let from = match (reading, direct.as_mut()) {
                (Side::Direct, Some(d)) => &mut d.conn.stream,
                _ => &mut backend.stream,
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
            // An idle direct connection has nothing to say: anything it sends (a FATAL, its
            // end) means the organization's side closed it — a restarted agent or relay, an
            // idle timeout there. It is dropped now, so the next direct statement opens
            // another instead of failing on it.
            if let Some(d) = direct.as_mut() {
                if reading == Side::Cloud
                    && router.gate == Gate::Closed
                    && exchanges.direct.is_idle()
                {
                    let mut probe = [0u8; 1];
                    if Pin::new(&mut d.conn.stream)
                        .poll_read(cx, &mut probe)
                        .is_ready()
                    {
                        tracing::info!(org = ?router.direct_org, "the direct connection was closed while idle; the next direct statement opens another");
                        direct = None;
                        router.direct_org = None;
                        if router.target == Side::Direct && !up.held {
                            router.target = Side::Cloud;
                        }
                        progress = true;
                    }
                }
            }
            if !progress {
                return Poll::Pending;
            }
        }
        cx.waker().wake_by_ref();
        Poll::Pending
    })
    .await;

    core.shutdown.release(slot);
    core.cancels.borrow_mut().unregister(cancel_pid);
    if let Some((rec, session)) = record {
        rec.record(crate::record::Kind::End, session, &[]);
        rec.flush();
    }

    // What the client is told, if it can still be told something without cutting a
    // message in half.
    let notice = match &end {
        End::ClientProtocol(e) => Some(SessionError::Protocol(e.clone())),
        End::ServerLost(e) => Some(SessionError::UpstreamLost(std::io::Error::new(
            e.kind(),
            e.to_string(),
        ))),
        End::DirectLost(org, e) => Some(SessionError::DirectLost(
            org.to_string(),
            std::io::Error::new(e.kind(), e.to_string()),
        )),
        End::Shutdown => Some(SessionError::Shutdown),
        End::ClientFailed(e) => {
            tracing::debug!(error = %e, "client connection failed");
            None
        }
        End::ClientDone => None,
    };
    if let Some(e) = notice {
        log_error(&e);
        if down.at_frame_boundary() && !down.has_unwritten() {
            report(&mut client, e).await;
        }
    }
    drop(client);

    let clean = matches!(end, End::ClientDone | End::ClientFailed(_))
        && !router.holds_message()
        && up.at_frame_boundary()
        && !up.has_unwritten()
        && down.at_frame_boundary()
        && !down.has_unwritten();
    if let Some(d) = direct {
        put_back_direct(
            core.clone(),
            db.clone(),
            d,
            clean && exchanges.direct.is_idle(),
        )
        .await;
    }
    let reusable = clean && exchanges.cloud.is_settled();
    if !db.config.upstream_pool || !reusable || core.shutdown.is_fired() {
        tracing::debug!(backend_pid = backend.pid, reusable, "closing backend");
        return backend.terminate().await;
    }
    backend.status = exchanges.cloud.status;
    match pool::reset(&mut backend).await {
        Ok(()) => core.pool.borrow_mut().put(key, backend, Instant::now()),
        Err(e) => tracing::info!(error = %e, "backend reset failed; closing it"),
    }
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

/// Makes the switch the router asks for, once the side in use has answered everything.
/// True when done (the held message may go); false while waiting (a direct connection
/// being opened, the gate of direct writes being asked or closed). A direct connection
/// that cannot be opened marks the organization unavailable for a while, a gate that
/// refuses marks its writes so: the message, shown again, then goes to the cloud.
#[allow(clippy::too_many_arguments)]
fn switch(
    cx: &mut std::task::Context<'_>,
    core: &Rc<Core>,
    db: &Rc<Database>,
    key: &PoolKey,
    router: &mut Router,
    exchanges: &mut Exchanges,
    reported: &Reported,
    direct: &mut Option<DirectConn>,
    connecting: &mut Option<Connecting>,
    cloud: &mut BackendConn,
    cancel_pid: u32,
) -> bool {
    let Some(mut want) = router.want.clone() else {
        return true;
    };
    // A transaction open on the direct connection keeps the session there: the message
    // is shown again, and the transaction rules decide (`Router`'s Migrate).
    let direct_transaction = router.target == Side::Direct && exchanges.direct.status != TX_IDLE;
    let same_org = |org: &Rc<str>| router.direct_org.as_deref() == Some(&**org);
    match &want {
        Want::Migrate => {}
        Want::Direct(org) | Want::DirectWrite(org) if direct_transaction && same_org(org) => {}
        _ if direct_transaction => want = Want::Settle,
        _ => {}
    }
    let (org, write) = match want {
        Want::Settle => {
            router.want = None;
            return true;
        }
        Want::Cloud | Want::Migrate => {
            if router.gate != Gate::Closed {
                // The gate's transaction closes first (the session loop does it).
                return false;
            }
            if want == Want::Migrate {
                // The direct transaction has only read: rolled back (answers dropped),
                // and the cloud's begins with the held message.
                if let Some(d) = direct.as_mut() {
                    match send_own(cx, &mut d.conn, &mut exchanges.direct, "ROLLBACK") {
                        Poll::Pending => return false,
                        // A lost connection shows when it is read.
                        Poll::Ready(_) => {}
                    }
                }
                router.begin_on_next();
            }
            router.target = Side::Cloud;
            router.want = None;
            core.cancels
                .borrow_mut()
                .retarget(cancel_pid, cancel_target(cloud));
            return true;
        }
        Want::Direct(org) => (org, false),
        Want::DirectWrite(org) => (org, true),
    };
    if !direct_connection(
        cx, core, db, key, router, exchanges, reported, direct, connecting, &org,
    ) {
        return false;
    }
    if router.want.is_none() {
        // The connection failed: the message goes to the cloud.
        return true;
    }
    if write {
        match router.gate.clone() {
            Gate::Open(o) if o == org => {}
            // Another organization's gate closes first (the session loop does it).
            Gate::Open(_) => return false,
            Gate::Closed => {
                let sql = format!(
                    "BEGIN; SELECT lokadb_client.direct_gate('{}')",
                    org.replace('\'', "''")
                );
                let request = exchanges.cloud.answered + u64::from(exchanges.cloud.pending);
                if send_own(cx, cloud, &mut exchanges.cloud, &sql).is_pending() {
                    return false;
                }
                router.gate = Gate::Opening(org, request);
                return false;
            }
            Gate::Opening(o, request) => {
                if exchanges.cloud.answered <= request {
                    return false;
                }
                if exchanges.cloud.silenced_failed == Some(request) {
                    // Paused past its timeout, moving back, or an old cloud schema: this
                    // write goes through the cloud, which decides.
                    tracing::info!(org = %o, "the gate of direct writes refused; the write goes through the cloud");
                    if send_own(cx, cloud, &mut exchanges.cloud, "ROLLBACK").is_pending() {
                        return false;
                    }
                    router.gate = Gate::Closed;
                    router.gate_refused(o);
                    router.want = None;
                    return true;
                }
                router.gate = Gate::Open(o);
            }
        }
    }
    router.target = Side::Direct;
    router.want = None;
    if let Some(d) = direct.as_ref() {
        core.cancels
            .borrow_mut()
            .retarget(cancel_pid, cancel_target(&d.conn));
    }
    true
}

/// Makes sure the session's direct connection is `org`'s, opening one (or taking one from
/// `direct_pool`) when not. False while it is being opened; on failure the organization is
/// marked unavailable and `router.want` cleared.
#[allow(clippy::too_many_arguments)]
fn direct_connection(
    cx: &mut std::task::Context<'_>,
    core: &Rc<Core>,
    db: &Rc<Database>,
    key: &PoolKey,
    router: &mut Router,
    exchanges: &mut Exchanges,
    reported: &Reported,
    direct: &mut Option<DirectConn>,
    connecting: &mut Option<Connecting>,
    org: &Rc<str>,
) -> bool {
    let usable = direct
        .as_ref()
        .is_some_and(|d| d.version == reported.version && d.key.org.as_deref() == Some(&**org));
    // An idle connection the organization's side closed meanwhile (a restarted agent or
    // relay, an idle timeout there) is replaced here rather than failing the next statement.
    let alive = direct
        .as_ref()
        .is_some_and(|d| !exchanges.direct.is_idle() || d.conn.is_idle_and_open());
    if usable && alive {
        return true;
    }
    if usable {
        tracing::info!(org = %org, "the direct connection was closed while idle; opening another");
        drop(direct.take());
        router.direct_org = None;
    }
    if let Some(old) = direct.take() {
        // Another organization's, or opened with settings the client has changed
        // since (then not pooled: its key says the old settings, which is right).
        router.direct_org = None;
        let idle = exchanges.direct.is_idle();
        crate::rt::spawn(put_back_direct(core.clone(), db.clone(), old, idle)).detach();
    }
    if connecting.as_ref().is_none_or(|(o, _)| o != org) {
        let params = direct_params(key, reported);
        let fut = open_direct(core, db, key, org, params);
        *connecting = Some((org.clone(), fut));
    }
    let (_, fut) = connecting.as_mut().expect("set above");
    match fut.as_mut().poll(cx) {
        Poll::Pending => false,
        Poll::Ready(Err(e)) => {
            *connecting = None;
            tracing::warn!(org = %org, error = %e, "the direct path to this organization's database failed; its statements go through the cloud for {:?}", super::router::UNAVAILABLE_FOR);
            router.mark_unavailable(org.clone());
            router.want = None;
            true
        }
        Poll::Ready(Ok(mut d)) => {
            *connecting = None;
            d.version = reported.version;
            exchanges.direct = Exchange {
                status: d.conn.status,
                ..Exchange::default()
            };
            router.direct_org = Some(org.clone());
            router.direct_replaced();
            *direct = Some(d);
            true
        }
    }
}

/// Sends a simple query of the proxy's own on `conn` (which has answered everything the
/// client sent), its answers to be dropped. Pending while an earlier send is in flight.
fn send_own(
    cx: &mut std::task::Context<'_>,
    conn: &mut BackendConn,
    exchange: &mut Exchange,
    sql: &str,
) -> Poll<std::io::Result<()>> {
    let mut q = Vec::with_capacity(sql.len() + 6);
    lokadb_shared::wire::frontend::query(&mut q, sql);
    match Pin::new(&mut conn.stream).poll_write(cx, &q) {
        Poll::Pending => Poll::Pending,
        Poll::Ready(Ok(n)) if n == q.len() => {
            exchange.silence_next();
            exchange.pending += 1;
            Poll::Ready(Ok(()))
        }
        Poll::Ready(Ok(_)) => Poll::Ready(Err(std::io::ErrorKind::WriteZero.into())),
        Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
    }
}

fn cancel_target(b: &BackendConn) -> CancelTarget {
    CancelTarget {
        addr: b.addr,
        pid: b.pid,
        secret: b.secret.clone(),
    }
}

/// The startup parameters of a direct connection: the client's, with the settings the
/// cloud reports now (a client's `SET TimeZone` included), so values are written alike.
fn direct_params(key: &PoolKey, reported: &Reported) -> Vec<(String, String)> {
    let mut params: Vec<(String, String)> = key
        .params
        .iter()
        .filter(|(k, _)| !reported.params.iter().any(|(n, _)| n == k))
        .cloned()
        .collect();
    params.extend(reported.params.iter().cloned());
    params.sort();
    params
}

/// Opens (or takes from `direct_pool`) a connection to `org`'s database through the relay.
fn open_direct(
    core: &Core,
    db: &Rc<Database>,
    key: &PoolKey,
    org: &Rc<str>,
    params: Vec<(String, String)>,
) -> Pin<Box<dyn Future<Output = Result<DirectConn, String>>>> {
    let direct_key = PoolKey {
        database: db.name.clone(),
        user: key.user.clone(),
        org: Some(org.clone()),
        params,
    };
    if db.config.direct_pool {
        let pooled =
            core.pool
                .borrow_mut()
                .take(&direct_key, db.config.pool_idle_timeout, Instant::now());
        if let Some(conn) = pooled {
            return Box::pin(async move {
                Ok(DirectConn {
                    conn,
                    key: direct_key,
                    version: 0,
                })
            });
        }
    }
    let org_meta = core
        .meta
        .borrow()
        .get(&*db.name)
        .and_then(|m| m.meta.orgs.get(&**org).and_then(|o| o.direct.clone()));
    let login = db.config.direct.clone();
    let password = core.shared.direct_password(&db.config);
    let timeout = db.config.connect_timeout;
    Box::pin(async move {
        let (Some((addr, dbname)), Some(login)) = (org_meta, login) else {
            return Err("no direct path configured (metadata changed)".to_owned());
        };
        let creds = Credentials::Password(Secret(password.unwrap_or_default()));
        let connect = BackendConn::connect(addr, &login.user, &dbname, &direct_key.params, &creds);
        match with_timeout(timeout, connect).await {
            None => Err(format!("no answer within connect_timeout from the relay at {addr}")),
            Some(Ok(conn)) => Ok(DirectConn {
                conn,
                key: direct_key,
                version: 0,
            }),
            Some(Err(ConnError::Rejected { notice, .. })) => Err(format!(
                "the organization's database (through the relay at {addr}, database {dbname}) refused the login of {}: {} ({})",
                login.user, notice.message, notice.code
            )),
            Some(Err(e)) => Err(format!("through the relay at {addr}: {e}")),
        }
    })
}

/// Ends a session's use of a direct connection: kept in the pool (`direct_pool`) when it
/// is idle — it holds no session state of the client's but prepared statements, which are
/// re-parsed by name before use — else closed.
async fn put_back_direct(core: Rc<Core>, db: Rc<Database>, d: DirectConn, idle: bool) {
    if idle && db.config.direct_pool && !core.shutdown.is_fired() && d.conn.is_idle_and_open() {
        core.pool.borrow_mut().put(d.key, d.conn, Instant::now());
    } else {
        d.conn.terminate().await;
    }
}

/// Sends an error to the client (if it is one the client may see) and closes.
async fn report(stream: &mut ClientStream, e: SessionError) {
    log_error(&e);
    let mut out = Vec::new();
    e.to_client(&mut out);
    if !out.is_empty() {
        let _ = stream.write_all(&out).await;
        let _ = stream.flush().await;
    }
    let _ = stream.close().await;
}

fn log_error(e: &SessionError) {
    match e.kind() {
        ErrorKind::ClientDisconnect => tracing::debug!(error = %e, "client went away"),
        ErrorKind::User => tracing::info!(error = %e, "client error"),
        ErrorKind::Limit | ErrorKind::Service => tracing::info!(error = %e, "connection refused"),
        ErrorKind::Upstream => tracing::warn!(error = %e, "cloud error"),
    }
}

/// Counts a connection on its core (so shutdown knows when sessions are gone) and
/// over all cores (`max_connections`), for as long as it lives.
struct SessionCount<'a> {
    core: &'a Core,
    over_limit: bool,
}

impl<'a> SessionCount<'a> {
    fn new(core: &'a Core) -> Self {
        core.sessions.set(core.sessions.get() + 1);
        let open = core.shared.connections.fetch_add(1, Ordering::Relaxed) + 1;
        SessionCount {
            core,
            over_limit: open > core.shared.config.max_connections,
        }
    }
}

impl Drop for SessionCount<'_> {
    fn drop(&mut self) {
        self.core.sessions.set(self.core.sessions.get() - 1);
        self.core.shared.connections.fetch_sub(1, Ordering::Relaxed);
    }
}
