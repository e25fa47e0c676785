//! The session's second backend: a connection to an organization's database through the
//! relay (the direct path, `docs/routing.md`), opened when a statement first goes direct
//! (at most `direct_max` per organization), watched while idle, and with `direct_pool`
//! given back to the core's pool at the end of each of the organization's transactions;
//! and the switches of a session's target between it and the cloud, with the gate of
//! direct writes.

use super::replay::{Digest, Replay};
use super::router::{count, Exchanges, Gate, Lookup, Router, Side, Want};
use super::statement::{Exchange, Reported};
use crate::backend::at_login::TxDefaults;
use crate::backend::conn::{BackendConn, ConnError};
use crate::backend::pool::PoolKey;
use crate::cancel::{CancelTarget, SessionId};
use crate::core::{Core, Database};
use crate::scram::{Credentials, Secret};
use crate::time::with_timeout;
use futures_lite::{AsyncRead, AsyncWrite};
use lokadb_shared::wire::tags::{FE_QUERY, FE_SYNC, TX_IDLE};
use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll};
use std::time::Instant;

/// What a session's switches need to know about it.
pub struct Ctx<'a> {
    pub core: &'a Rc<Core>,
    pub db: &'a Rc<Database>,
    /// The session's cloud pool key: its role and startup parameters.
    pub key: &'a PoolKey,
    /// The session's handle in the cancel registry.
    pub session: SessionId,
}

/// The session's direct connection, or the one being opened.
#[derive(Default)]
pub struct Direct {
    pub conn: Option<DirectConn>,
    connecting: Option<Connecting>,
    /// The lease under which the session last had a connection: what the router knows
    /// was parsed there still holds if it gets that connection back under the same lease
    /// (no other session had it since).
    lease: Option<u64>,
}

/// A session's connection to an organization's database.
pub struct DirectConn {
    pub conn: BackendConn,
    /// Its pool key: the organization, and the settings it was opened with.
    key: PoolKey,
    /// [`Reported::version`] when it was opened: a later `SET` of a copied setting makes
    /// it stale.
    version: u32,
}

/// A direct connection being opened, for the organization it is for.
type Connecting = (
    Rc<str>,
    Pin<Box<dyn Future<Output = Result<DirectConn, OpenError>>>>,
);

/// Why no direct connection came.
enum OpenError {
    /// The organization's database could not be reached, or refused the login.
    Failed(String),
    /// `direct_max` connections to it are open, and none came free in time.
    Busy,
}

/// Makes the switch the router asks for, once the side in use has answered everything.
/// True when done (the held message may go); false while waiting (a direct connection
/// being opened, the gate of direct writes being asked or closed). A direct connection
/// that cannot be opened marks the organization unavailable for a while, a gate that
/// refuses marks its writes so: the message, shown again, then goes to the cloud.
pub fn switch(
    cx: &mut Context<'_>,
    ctx: &Ctx<'_>,
    router: &mut Router,
    exchanges: &mut Exchanges,
    reported: &Reported,
    direct: &mut Direct,
    cloud: &mut BackendConn,
) -> bool {
    let (core, session) = (ctx.core, ctx.session);
    let Some(mut want) = router.want.clone() else {
        return true;
    };
    if let Want::Lookup(sql) = &want {
        return lookup(cx, router, exchanges, cloud, sql);
    }
    if want == Want::Replay {
        return replay(cx, ctx, router, exchanges, direct, cloud);
    }
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
        Want::Lookup(_) | Want::Replay => unreachable!("handled above"),
        Want::Settle => {
            router.want = None;
            return true;
        }
        Want::Cloud | Want::Migrate => {
            match router.gate {
                Gate::Closed => {}
                // Opened for a write that now goes to the cloud (the metadata changed
                // while it was asked): nothing went through it, so it is let go here.
                Gate::Open(_) if !router.direct_wrote => {
                    if send_own(cx, cloud, &mut exchanges.cloud, "ROLLBACK").is_pending() {
                        return false;
                    }
                    router.gate = Gate::Closed;
                }
                // Else it closes first (the session loop does it once the organization's
                // transaction ended).
                _ => return false,
            }
            if want == Want::Migrate {
                // The direct transaction has only read: rolled back (answers dropped),
                // and the cloud's begins with the held message.
                if let Some(d) = direct.conn.as_mut() {
                    match send_own(cx, &mut d.conn, &mut exchanges.direct, "ROLLBACK") {
                        Poll::Pending => return false,
                        // A lost connection shows when it is read.
                        Poll::Ready(_) => {}
                    }
                }
                router.begin_on_next();
                router.tx_log = None;
                router.tx_opener = None;
                exchanges.direct.digest = None;
            }
            router.target = Side::Cloud;
            router.want = None;
            core.cancels
                .borrow_mut()
                .retarget(session, cancel_target(cloud));
            return true;
        }
        Want::Direct(org) => (org, false),
        Want::DirectWrite(org) => (org, true),
    };
    if !direct.ensure(cx, ctx, router, exchanges, reported, &org) {
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
                if exchanges.cloud.own_failed(request) {
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
    if let Some(d) = direct.conn.as_ref() {
        core.cancels
            .borrow_mut()
            .retarget(session, cancel_target(&d.conn));
    }
    true
}

/// Moves a transaction that wrote directly to the cloud ([`super::replay`]): rolls the
/// direct one back, runs what the client sent in it again in the cloud transaction the
/// gate opened, and compares the answers. True once done: the held message then goes to
/// the cloud, or, when the answers differed, fails with 40001 in a failed transaction
/// the proxy begins in place of the client's.
fn replay(
    cx: &mut Context<'_>,
    ctx: &Ctx<'_>,
    router: &mut Router,
    exchanges: &mut Exchanges,
    direct: &mut Direct,
    cloud: &mut BackendConn,
) -> bool {
    loop {
        match std::mem::take(&mut router.replay) {
            Replay::None => {
                let (Some(d), Some(log), Some(digest)) = (
                    direct.conn.as_mut(),
                    router.tx_log.as_ref(),
                    exchanges.direct.digest.as_ref(),
                ) else {
                    // Checked when asked; nothing to move without them.
                    router.want = None;
                    return true;
                };
                if !log.usable() {
                    router.want = None;
                    return true;
                }
                let expected = digest.value();
                match send_own(cx, &mut d.conn, &mut exchanges.direct, "ROLLBACK") {
                    Poll::Pending => return false,
                    // A lost connection shows when it is read.
                    Poll::Ready(_) => {}
                }
                exchanges.direct.digest = None;
                router.opener_moved = router.tx_opener.take();
                crate::failpoint::proxy("replay-rolled-back");
                let (bytes, requests) = router.tx_log.take().unwrap_or_default().take();
                // The gate's transaction on the cloud is the client's from now on.
                router.gate = Gate::Closed;
                router.direct_wrote = false;
                let ex = &mut exchanges.cloud;
                let until = ex.answered + u64::from(ex.pending) + u64::from(requests);
                for tag in super::statement::tags(&bytes) {
                    if matches!(tag, FE_QUERY | FE_SYNC) {
                        ex.silence_next();
                    }
                    count(ex, tag);
                    ex.note_sent_tag(tag);
                }
                ex.digest = Some(Digest::new(true));
                router.unnamed_gone_on_cloud();
                router.cloud_org.forget();
                ctx.core
                    .cancels
                    .borrow_mut()
                    .retarget(ctx.session, cancel_target(cloud));
                tracing::debug!(org = ?router.direct_org, requests, "a transaction that wrote directly moves to the cloud");
                crate::metrics::CoreStats::add(&ctx.core.stats.transactions_moved, 1);
                router.replay = Replay::Sending {
                    bytes,
                    written: 0,
                    until,
                    expected,
                };
            }
            Replay::Sending {
                bytes,
                mut written,
                until,
                expected,
            } => {
                while written < bytes.len() {
                    match Pin::new(&mut cloud.stream).poll_write(cx, &bytes[written..]) {
                        Poll::Ready(Ok(n)) if n > 0 => written += n,
                        Poll::Pending => {
                            router.replay = Replay::Sending {
                                bytes,
                                written,
                                until,
                                expected,
                            };
                            return false;
                        }
                        // A lost connection shows when it is read.
                        Poll::Ready(_) => break,
                    }
                }
                // TLS may hold the last records until flushed; a flush that cannot finish
                // now wakes the session when it can (the pump flushes too).
                let _ = Pin::new(&mut cloud.stream).poll_flush(cx);
                crate::failpoint::proxy("replay-sent");
                router.replay = Replay::Waiting { until, expected };
            }
            Replay::Waiting { until, expected } => {
                if exchanges.cloud.answered < until {
                    router.replay = Replay::Waiting { until, expected };
                    return false;
                }
                let got = exchanges.cloud.digest.take().map(|d| d.value());
                if got == Some(expected) {
                    crate::failpoint::proxy("replay-matched");
                    if router.route_log {
                        tracing::info!(target: "lokadb::route", route = "moved", org = router.direct_org.as_deref().unwrap_or("?"), "a transaction that wrote directly moved to the cloud");
                    }
                    router.target = Side::Cloud;
                    router.want = None;
                    return true;
                }
                // Always logged: the client gets an error the proxy made.
                tracing::info!(target: "lokadb::route", route = "moved", differed = true, org = router.direct_org.as_deref().unwrap_or("?"), "a transaction that wrote directly answered differently on the cloud: 40001");
                router.replay = Replay::Failing;
            }
            Replay::Failing => {
                if send_own(cx, cloud, &mut exchanges.cloud, "ROLLBACK; BEGIN").is_pending() {
                    router.replay = Replay::Failing;
                    return false;
                }
                router.unnamed_gone_on_cloud();
                router.replay_differed = true;
                router.target = Side::Cloud;
                router.want = None;
                return true;
            }
        }
    }
}

/// Asks the cloud's key map whose key the held statement's is (a request of the proxy's
/// own, its one value captured): true once answered, the answer in `router.lookup` for the
/// held message, shown again. A lookup that fails or cannot be sent answers "none": the
/// statement goes through the cloud.
fn lookup(
    cx: &mut Context<'_>,
    router: &mut Router,
    exchanges: &mut Exchanges,
    cloud: &mut BackendConn,
    sql: &str,
) -> bool {
    let ex = &mut exchanges.cloud;
    let answer = |router: &mut Router, org: Option<Rc<str>>| {
        router.lookup = Lookup::Answered(sql.to_owned(), org);
        router.want = None;
        true
    };
    match &router.lookup {
        Lookup::Asked(asked, request) if asked == sql => {
            let request = *request;
            if ex.answered <= request {
                return false;
            }
            let org = match ex.capture.take() {
                Some((r, Some(value))) if r == request && !ex.own_failed(request) => {
                    value.map(Rc::from)
                }
                // A failed lookup (a key that does not cast, the metadata behind): the
                // statement goes through the cloud, which answers or fails it.
                _ => None,
            };
            answer(router, org)
        }
        _ => {
            let request = ex.answered + u64::from(ex.pending);
            match send_own(cx, cloud, ex, sql) {
                Poll::Pending => false,
                // The lost connection shows when it is read.
                Poll::Ready(Err(_)) => answer(router, None),
                Poll::Ready(Ok(())) => {
                    ex.capture = Some((request, None));
                    // A simple query destroys the cloud's unnamed statement.
                    router.unnamed_gone_on_cloud();
                    router.lookup = Lookup::Asked(sql.to_owned(), request);
                    false
                }
            }
        }
    }
}

impl Direct {
    /// Makes sure the session's direct connection is `org`'s, opening one (or taking one
    /// from `direct_pool`) when not. False while it is being opened; on failure the
    /// organization is marked unavailable and `router.want` cleared.
    fn ensure(
        &mut self,
        cx: &mut Context<'_>,
        ctx: &Ctx<'_>,
        router: &mut Router,
        exchanges: &mut Exchanges,
        reported: &Reported,
        org: &Rc<str>,
    ) -> bool {
        let usable = self
            .conn
            .as_ref()
            .is_some_and(|d| d.version == reported.version && d.key.org.as_deref() == Some(&**org));
        // An idle connection the organization's side closed meanwhile (a restarted agent
        // or relay, an idle timeout there) is replaced rather than failing the statement.
        let alive = self
            .conn
            .as_ref()
            .is_some_and(|d| !exchanges.direct.is_idle() || d.conn.is_idle_and_open());
        if usable && alive {
            return true;
        }
        if usable {
            tracing::info!(org = %org, "the direct connection was closed while idle; opening another");
            self.conn = None;
            router.direct_org = None;
        }
        if let Some(old) = self.conn.take() {
            // Another organization's, or opened with settings the client has changed
            // since (then not pooled: its key says the old settings, which is right).
            router.direct_org = None;
            put_back(ctx.core, ctx.db, old, exchanges.direct.is_idle());
        }
        if self.connecting.as_ref().is_none_or(|(o, _)| o != org) {
            let params = direct_params(ctx.key, reported, router.tx_defaults.as_ref());
            let fut = open(ctx, org, params);
            self.connecting = Some((org.clone(), fut));
        }
        let (_, fut) = self.connecting.as_mut().expect("set above");
        match fut.as_mut().poll(cx) {
            Poll::Pending => false,
            Poll::Ready(Err(OpenError::Busy)) => {
                self.connecting = None;
                tracing::debug!(org = %org, "every direct connection to this organization is in use (direct_max); its statements go through the cloud for {:?}", super::router::BUSY_FOR);
                router.mark_unavailable(org.clone(), super::router::BUSY_FOR);
                router.want = None;
                true
            }
            Poll::Ready(Err(OpenError::Failed(e))) => {
                self.connecting = None;
                tracing::warn!(org = %org, error = %e, "the direct path to this organization's database failed; its statements go through the cloud for {:?}", super::router::UNAVAILABLE_FOR);
                router.mark_unavailable(org.clone(), super::router::UNAVAILABLE_FOR);
                router.want = None;
                true
            }
            Poll::Ready(Ok(mut d)) => {
                self.connecting = None;
                d.version = reported.version;
                exchanges.direct = Exchange {
                    status: d.conn.status,
                    ..Exchange::default()
                };
                router.direct_org = Some(org.clone());
                if self.lease != Some(d.conn.lease) {
                    router.direct_replaced();
                }
                let lease = ctx.core.next_lease();
                d.conn.lease = lease;
                self.lease = Some(lease);
                self.conn = Some(d);
                true
            }
        }
    }

    /// Watches the connection while it is idle (a pending receive, no syscall per call):
    /// an idle backend has nothing to say, so anything it sends (a FATAL, its end) means
    /// the organization's side closed it — a restarted agent or relay, an idle timeout
    /// there. It is dropped then, and the next direct statement opens another instead of
    /// failing on it. True when it was dropped.
    pub fn watch_idle(
        &mut self,
        cx: &mut Context<'_>,
        router: &mut Router,
        exchanges: &Exchanges,
        held: bool,
    ) -> bool {
        let Some(d) = self.conn.as_mut() else {
            return false;
        };
        if router.gate != Gate::Closed || !exchanges.direct.is_idle() {
            return false;
        }
        let mut probe = [0u8; 1];
        if Pin::new(&mut d.conn.stream)
            .poll_read(cx, &mut probe)
            .is_pending()
        {
            return false;
        }
        tracing::info!(org = ?router.direct_org, "the direct connection was closed while idle; the next direct statement opens another");
        self.conn = None;
        router.direct_org = None;
        if router.target == Side::Direct && !held {
            router.target = Side::Cloud;
        }
        true
    }

    /// `direct_pool`: gives the connection back to the core's pool between the
    /// organization's transactions (the caller made sure it is idle and nothing of the
    /// client's is on its way to it), so that an organization's database serves as many
    /// connections as transactions in flight, not as clients. The next direct statement
    /// takes one again (most likely this one).
    pub fn release(&mut self, ctx: &Ctx<'_>, router: &mut Router, cloud: &BackendConn) {
        let Some(d) = self.conn.take() else {
            return;
        };
        router.direct_org = None;
        if router.target == Side::Direct {
            router.target = Side::Cloud;
            ctx.core
                .cancels
                .borrow_mut()
                .retarget(ctx.session, cancel_target(cloud));
        }
        put_back(ctx.core, ctx.db, d, true);
    }

    /// Ends the session's use of its direct connection, if any: kept in the pool
    /// (`direct_pool`) when `idle`, else closed.
    pub fn finish(self, core: &Rc<Core>, db: &Rc<Database>, idle: bool) {
        if let Some(d) = self.conn {
            put_back(core, db, d, idle);
        }
    }
}

/// Sends a simple query of the proxy's own on `conn` (which has answered everything the
/// client sent), its answers to be dropped. Pending while an earlier send is in flight. The
/// runtime takes a write of up to 256 KiB whole (`rt::net`); these queries are far shorter,
/// so a short write would be a broken promise of the runtime, reported as an error.
pub fn send_own(
    cx: &mut Context<'_>,
    conn: &mut BackendConn,
    exchange: &mut Exchange,
    sql: &str,
) -> Poll<std::io::Result<()>> {
    let mut q = Vec::with_capacity(sql.len() + 6);
    lokadb_shared::wire::frontend::query(&mut q, sql);
    match Pin::new(&mut conn.stream).poll_write(cx, &q) {
        Poll::Pending => Poll::Pending,
        Poll::Ready(Ok(n)) if n == q.len() => {
            // TLS may hold records until flushed (see the replay above).
            let _ = Pin::new(&mut conn.stream).poll_flush(cx);
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

/// The client's startup parameters a direct login copies: how values are written and read,
/// and the name it shows in `pg_stat_activity`. Nothing else of the client's startup packet
/// reaches the organization's database (`role`, `search_path`, `session_replication_role`,
/// `options`… would apply as the direct role, with its rights).
const COPIED_STARTUP: &[&str] = &[
    "client_encoding",
    "DateStyle",
    "TimeZone",
    "IntervalStyle",
    "extra_float_digits",
    "application_name",
];

/// The startup parameters of a direct connection: those of the client's in
/// [`COPIED_STARTUP`], the settings the cloud reports now (a client's `SET TimeZone`
/// included), so values are written alike, and the session's transaction defaults at login
/// (`tx`; a reported `default_transaction_read_only` is the newer). Names are matched in
/// any case, as Postgres matches them; each is sent once.
fn direct_params(
    key: &PoolKey,
    reported: &Reported,
    tx: Option<&TxDefaults>,
) -> Vec<(String, String)> {
    let has = |params: &[(String, String)], name: &str| {
        params.iter().any(|(n, _)| n.eq_ignore_ascii_case(name))
    };
    let mut params = reported.params.clone();
    for (name, value) in tx.map(TxDefaults::params).into_iter().flatten() {
        if !has(&params, name) {
            params.push((name.to_owned(), value.to_owned()));
        }
    }
    for (name, value) in &key.params {
        let copied = COPIED_STARTUP.iter().any(|c| c.eq_ignore_ascii_case(name));
        if copied && !has(&params, name) {
            params.push((name.clone(), value.clone()));
        }
    }
    params.sort();
    params
}

/// Whether a login refusal is the relay's own (no agent, draining, its limits), so another
/// relay may do better: 08001, 57P03, 53300.
fn relay_refusal(code: &str) -> bool {
    use lokadb_shared::wire::sqlstate::{CANNOT_CONNECT, CANNOT_CONNECT_NOW, TOO_MANY_CONNECTIONS};
    [CANNOT_CONNECT, CANNOT_CONNECT_NOW, TOO_MANY_CONNECTIONS].contains(&code)
}

/// Opens (or takes from `direct_pool`) a connection to `org`'s database through the relay.
/// At `direct_max` it waits for one to come free with `direct_pool` (up to
/// `connect_timeout`), or gives up at once without it: the statement goes through the cloud.
fn open(
    ctx: &Ctx<'_>,
    org: &Rc<str>,
    params: Vec<(String, String)>,
) -> Pin<Box<dyn Future<Output = Result<DirectConn, OpenError>>>> {
    let (core, db, key) = (ctx.core.clone(), ctx.db.clone(), ctx.key);
    let org_meta = core
        .meta
        .borrow()
        .get(&*db.name)
        .and_then(|m| m.meta.orgs.get(&**org).and_then(|o| o.direct.clone()));
    let direct_key = PoolKey {
        database: db.name.clone(),
        user: key.user.clone(),
        org: Some(org.clone()),
        target: org_meta
            .as_ref()
            .map(crate::route::meta::DirectPath::target),
        params,
    };
    let slot = (db.name.clone(), org.clone());
    let per_core = (db.config.direct_max as usize).div_ceil(core.peers.len().max(1));
    let org_id = org.clone();
    Box::pin(async move {
        let timeout = db.config.connect_timeout;
        let deadline = Instant::now() + timeout;
        let permit = loop {
            if db.config.direct_pool {
                let pooled = core.pool.borrow_mut().take(
                    &direct_key,
                    db.config.pool_idle_timeout,
                    Instant::now(),
                );
                if let Some(conn) = pooled {
                    return Ok(DirectConn {
                        conn,
                        key: direct_key,
                        version: 0,
                    });
                }
            }
            if let Some(permit) = core.direct_slots.try_acquire(&slot, per_core) {
                break permit;
            }
            // At the cap, an idle pooled connection to this organization opened for another
            // role or other settings gives its place up (it would hold it until it expires).
            let idle = core.pool.borrow_mut().take_oldest(|k| {
                k.database == direct_key.database && k.org == direct_key.org && *k != direct_key
            });
            if let Some(mut other) = idle {
                drop(other.permit.take());
                crate::rt::spawn(other.terminate()).detach();
                continue;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if !db.config.direct_pool
                || left.is_zero()
                || with_timeout(left, core.direct_slots.wait(&slot))
                    .await
                    .is_none()
            {
                return Err(OpenError::Busy);
            }
        };
        let login = core.shared.direct_login(&db.name, &db.config, &org_id);
        let (Some(path), Some(login)) = (org_meta, login) else {
            return Err(OpenError::Failed(
                "no direct path configured (metadata changed)".to_owned(),
            ));
        };
        let creds = Credentials::Password(Secret(login.password));
        // Each relay in the order the organization's postgres_fdw server lists them, with
        // its TLS: the next one when a relay does not answer (down, unreachable, no agent);
        // not when the organization's database refused the login (every relay reaches it).
        let mut failures = Vec::new();
        for relay in &path.relays {
            let left = deadline.saturating_duration_since(Instant::now());
            let connect = BackendConn::connect(
                relay.addr,
                &login.user,
                &path.dbname,
                &direct_key.params,
                &creds,
                relay.tls.tls.as_deref(),
            );
            let addr = relay.addr;
            match with_timeout(left.max(timeout / 4), connect).await {
                Some(Ok(mut conn)) => {
                    conn.permit = Some(permit);
                    return Ok(DirectConn {
                        conn,
                        key: direct_key,
                        version: 0,
                    });
                }
                Some(Err(ConnError::Rejected { notice, .. })) if !relay_refusal(&notice.code) => {
                    return Err(OpenError::Failed(format!(
                        "the organization's database (through the relay at {addr}, database {}) refused the login of {}: {} ({})",
                        path.dbname, login.user, notice.message, notice.code
                    )));
                }
                Some(Err(ConnError::Rejected { notice, .. })) => {
                    failures.push(format!("{addr}: {} ({})", notice.message, notice.code));
                }
                Some(Err(e)) => failures.push(format!("{addr}: {e}")),
                None => failures.push(format!("{addr}: no answer within connect_timeout")),
            }
        }
        Err(OpenError::Failed(format!(
            "no relay answered: {}",
            failures.join("; ")
        )))
    })
}

/// Ends a session's use of a direct connection: kept in the pool (`direct_pool`) when it
/// is idle — it holds no session state of the client's but prepared statements, which are
/// re-parsed by name before use — and a session waiting for one woken; else closed.
fn put_back(core: &Rc<Core>, db: &Rc<Database>, d: DirectConn, idle: bool) {
    if idle && db.config.direct_pool && !core.shutdown.is_fired() && d.conn.is_idle_and_open() {
        let slot = d.key.org.clone().map(|org| (db.name.clone(), org));
        core.pool.borrow_mut().put(d.key, d.conn, Instant::now());
        if let Some(slot) = slot {
            core.direct_slots.wake_one(&slot);
        }
    } else {
        crate::rt::spawn(d.conn.terminate()).detach();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(p: &[(&str, &str)]) -> Vec<(String, String)> {
        p.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    /// A direct login carries the listed settings of the client's, the cloud's reported
    /// ones (newer) and the session's transaction defaults; nothing else of the client's
    /// startup packet.
    #[test]
    fn the_direct_login_is_the_proxys_not_the_clients() {
        let key = PoolKey {
            database: Rc::from("app"),
            user: "app".to_owned(),
            org: None,
            target: None,
            params: pairs(&[
                ("application_name", "shop"),
                ("datestyle", "SQL, DMY"),
                ("default_transaction_isolation", "read uncommitted"),
                ("extra_float_digits", "3"),
                ("options", "-c search_path=evil"),
                ("role", "postgres"),
                ("search_path", "evil, public"),
                ("session_replication_role", "replica"),
            ]),
        };
        let reported = Reported {
            params: pairs(&[
                ("DateStyle", "ISO, MDY"),
                ("TimeZone", "Europe/Paris"),
                ("default_transaction_read_only", "on"),
            ]),
            version: 3,
            ..Reported::default()
        };
        let tx = TxDefaults {
            isolation: "serializable".to_owned(),
            read_only: "off".to_owned(),
            deferrable: "on".to_owned(),
        };
        assert_eq!(
            direct_params(&key, &reported, Some(&tx)),
            pairs(&[
                ("DateStyle", "ISO, MDY"),
                ("TimeZone", "Europe/Paris"),
                ("application_name", "shop"),
                ("default_transaction_deferrable", "on"),
                ("default_transaction_isolation", "serializable"),
                ("default_transaction_read_only", "on"),
                ("extra_float_digits", "3"),
            ])
        );
        // Without the defaults at login (not asked), the client's startup packet still
        // gives none.
        let none = direct_params(&key, &Reported::default(), None);
        assert_eq!(
            none,
            pairs(&[
                ("application_name", "shop"),
                ("datestyle", "SQL, DMY"),
                ("extra_float_digits", "3"),
            ])
        );
    }
}
