//! The session's second backend: a connection to an organization's database through the
//! relay (the direct path, `docs/routing.md`), opened when a statement first goes direct
//! (at most `direct_max` per organization), watched while idle, and with `direct_pool`
//! given back to the core's pool at the end of each of the organization's transactions.
//! The switches between it and the cloud are `switch.rs`'s; this is their [`Link`].

use super::router::{Exchanges, Router, Side};
use super::statement::Reported;
use super::switch::{self, Link, OpenError, Opened};
use crate::backend::at_login::TxDefaults;
use crate::backend::conn::{BackendConn, ConnError};
use crate::backend::pool::PoolKey;
use crate::cancel::{CancelTarget, SessionId};
use crate::core::{Core, Database};
use crate::org::OrgId;
use crate::scram::{Credentials, Secret};
use crate::time::with_timeout;
use futures_lite::AsyncRead;
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
    OrgId,
    Pin<Box<dyn Future<Output = Result<DirectConn, OpenError>>>>,
);

/// The session's side of a switch ([`Link`]): its sockets, its core and its registry
/// of cancel keys.
pub struct SessionLink<'a, 'c> {
    pub cx: &'a mut Context<'c>,
    pub ctx: &'a Ctx<'a>,
    pub direct: &'a mut Direct,
    pub cloud: &'a BackendConn,
    pub reported: &'a Reported,
}

impl Link for SessionLink<'_, '_> {
    fn ensure(
        &mut self,
        org: &OrgId,
        idle: bool,
        tx: Option<&TxDefaults>,
    ) -> Poll<Result<Opened, OpenError>> {
        self.direct
            .ensure(self.cx, self.ctx, self.reported, org, idle, tx)
    }

    fn retarget(&mut self, side: Side) {
        let target = match (side, self.direct.conn.as_ref()) {
            (Side::Direct, Some(d)) => cancel_target(&d.conn),
            _ => cancel_target(self.cloud),
        };
        self.ctx
            .core
            .cancels
            .borrow_mut()
            .retarget(self.ctx.session, target);
    }

    fn transaction_moved(&mut self) {
        crate::metrics::CoreStats::add(&self.ctx.core.stats.transactions_moved, 1);
    }
}

impl Direct {
    /// Makes sure the session's direct connection is `org`'s, opened with the settings
    /// reported now and still open (`idle`: nothing is in flight on it), opening one (or
    /// taking one from `direct_pool`) when not; `tx` is the session's transaction defaults
    /// at login. Pending while it is being opened.
    fn ensure(
        &mut self,
        cx: &mut Context<'_>,
        ctx: &Ctx<'_>,
        reported: &Reported,
        org: &OrgId,
        idle: bool,
        tx: Option<&TxDefaults>,
    ) -> Poll<Result<Opened, OpenError>> {
        let usable = self
            .conn
            .as_ref()
            .is_some_and(|d| d.version == reported.version && d.key.org.as_deref() == Some(&**org));
        // An idle connection the organization's side closed meanwhile (a restarted agent
        // or relay, an idle timeout there) is replaced rather than failing the statement.
        let alive = self
            .conn
            .as_ref()
            .is_some_and(|d| !idle || d.conn.is_idle_and_open());
        if usable && alive {
            return Poll::Ready(Ok(Opened::Kept));
        }
        if usable {
            tracing::info!(org = %org, "the direct connection was closed while idle; opening another");
            self.conn = None;
        }
        if let Some(old) = self.conn.take() {
            // Another organization's, or opened with settings the client has changed
            // since (then not pooled: its key says the old settings, which is right).
            put_back(ctx.core, ctx.db, old, idle);
        }
        if self.connecting.as_ref().is_none_or(|(o, _)| o != org) {
            let params = direct_params(ctx.key, reported, tx);
            let fut = open(ctx, org, params);
            self.connecting = Some((org.clone(), fut));
        }
        let (_, fut) = self.connecting.as_mut().expect("set above");
        let mut d = match fut.as_mut().poll(cx) {
            Poll::Pending => return Poll::Pending,
            Poll::Ready(Err(e)) => {
                self.connecting = None;
                return Poll::Ready(Err(e));
            }
            Poll::Ready(Ok(d)) => d,
        };
        self.connecting = None;
        d.version = reported.version;
        let opened = Opened::New {
            status: d.conn.status,
            same_lease: self.lease == Some(d.conn.lease),
        };
        let lease = ctx.core.next_lease();
        d.conn.lease = lease;
        self.lease = Some(lease);
        self.conn = Some(d);
        Poll::Ready(Ok(opened))
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
        if !router.gate.is_closed() || !exchanges.direct.is_idle() {
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
        switch::direct_gone(router, held);
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
        if switch::direct_gone(router, false) {
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

pub(super) fn cancel_target(b: &BackendConn) -> CancelTarget {
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
    org: &OrgId,
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
            let idle = core.pool.borrow_mut().take_oldest(|k, _, _| {
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
