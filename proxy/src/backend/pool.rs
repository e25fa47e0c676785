//! The per-core pool of warm cloud backends (`upstream_pool`).
//!
//! Session pooling: a client owns its backend for its whole session; when it leaves
//! cleanly, the backend is reset (`DISCARD ALL`, after `ROLLBACK` if a transaction
//! was open) and kept for the next client of the same database, role and startup
//! parameters. postgres_fdw connections live in the backend and survive the reset.
//! Each core has its own pool: no lock, no cross-core traffic.

use super::conn::BackendConn;
use crate::org::OrgId;
use lokadb_shared::wire::tags::TX_IDLE;
use std::collections::HashMap;
use std::rc::Rc;
use std::time::{Duration, Instant};

/// What makes two clients' backends interchangeable.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PoolKey {
    /// The database name the client asked for.
    pub database: Rc<str>,
    /// The role.
    pub user: String,
    /// For a direct connection (`direct_pool`): the organization whose database it is.
    pub org: Option<OrgId>,
    /// For a direct connection: where it leads (the relay's address, `ORG/DBNAME`), so that
    /// one to where an organization was is not reused once it moved elsewhere.
    pub target: Option<String>,
    /// Startup parameters other than user and database, sorted: they become the
    /// session's defaults that `RESET ALL` returns to, so only equal sets can share.
    pub params: Vec<(String, String)>,
}

/// What a cloud backend holds of the clients it served in transaction pooling, as far as
/// the proxy knows: what a session that takes it need not send again.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Holds {
    /// Named prepared statements: name → keyed hash of the Parse that made it.
    pub statements: HashMap<String, u64>,
    /// It may hold statements not listed (a batch failed: what it parsed is not known).
    pub unknown: bool,
    /// The unnamed statement's hash (`Some(0)`: one that may exist, not known).
    pub unnamed: Option<u64>,
    /// The hash of the settings a session applied on it (0: those of its login).
    pub settings: u64,
}

impl PoolKey {
    /// Its database and role: the key of `pool_size` on a core ([`super::slots::CloudKey`]).
    pub fn cloud_slot(&self) -> super::slots::CloudKey {
        (self.database.clone(), Rc::from(self.user.as_str()))
    }
}

impl Holds {
    /// As at login, or after `DISCARD ALL`.
    pub fn is_clean(&self) -> bool {
        *self == Holds::default()
    }
}

struct Idle {
    conn: BackendConn,
    since: Instant,
}

/// Idle backends of one core.
#[derive(Default)]
pub struct Pool {
    idle: HashMap<PoolKey, Vec<Idle>>,
}

impl Pool {
    /// Takes the most recently used live backend for `key`, closing dead or expired
    /// ones found on the way.
    pub fn take(
        &mut self,
        key: &PoolKey,
        idle_timeout: Duration,
        now: Instant,
    ) -> Option<BackendConn> {
        let list = self.idle.get_mut(key)?;
        while let Some(idle) = list.pop() {
            if now.duration_since(idle.since) < idle_timeout && idle.conn.is_idle_and_open() {
                return Some(idle.conn);
            }
            tracing::debug!(
                pid = idle.conn.pid,
                "dropping a dead or expired pooled backend"
            );
        }
        None
    }

    /// Takes the longest idle backend whose key, connection and time it was pooled
    /// `matches` (to close it: another key needs its place under a cap).
    pub fn take_oldest(
        &mut self,
        matches: impl Fn(&PoolKey, &BackendConn, Instant) -> bool,
    ) -> Option<BackendConn> {
        // Each list is oldest first.
        let key = self
            .idle
            .iter()
            .filter(|(k, l)| l.first().is_some_and(|i| matches(k, &i.conn, i.since)))
            .min_by_key(|(_, l)| l[0].since)
            .map(|(k, _)| k.clone())?;
        let list = self.idle.get_mut(&key)?;
        let conn = list.remove(0).conn;
        if list.is_empty() {
            self.idle.remove(&key);
        }
        Some(conn)
    }

    /// Keeps a backend that has been reset.
    pub fn put(&mut self, key: PoolKey, mut conn: BackendConn, now: Instant) {
        conn.rbuf = Vec::new(); // empty after a reset; an idle backend keeps no buffer
        self.idle
            .entry(key)
            .or_default()
            .push(Idle { conn, since: now });
    }

    /// Closes backends idle longer than their database's timeout.
    pub fn reap(&mut self, now: Instant, idle_timeout: impl Fn(&PoolKey) -> Duration) {
        self.idle.retain(|key, list| {
            let limit = idle_timeout(key);
            list.retain(|i| now.duration_since(i.since) < limit);
            !list.is_empty()
        });
    }

    /// How many connections wait in the pool.
    pub fn idle_count(&self) -> usize {
        self.idle.values().map(Vec::len).sum()
    }

    /// Each idle connection's key and process ID.
    pub fn idle_keys(&self) -> impl Iterator<Item = (&PoolKey, u32)> {
        self.idle
            .iter()
            .flat_map(|(key, list)| list.iter().map(move |i| (key, i.conn.pid)))
    }

    /// Removes every idle backend (shutdown).
    pub fn drain(&mut self) -> Vec<BackendConn> {
        self.idle
            .drain()
            .flat_map(|(_, l)| l.into_iter().map(|i| i.conn))
            .collect()
    }
}

/// Resets a backend so that nothing of its last client's session remains: open
/// transaction, SET, prepared statements, cursors, temp tables, LISTEN, advisory locks
/// and sequence state (`DISCARD ALL` covers all but the transaction). `Ok(false)`: reset,
/// but not to be reused. A session that made a temporary schema leaves it behind (DISCARD
/// drops its tables, not the schema), and the next client would see what a new connection
/// never shows: a statement it prepared is not planned again when its first temporary
/// table takes a table's name (a new connection's first temporary table changes its
/// search path, which re-plans it; found by the differential suite, issue 22).
///
/// # Errors
///
/// Any failure: the caller then closes the backend instead of pooling it.
pub async fn reset(conn: &mut BackendConn) -> Result<bool, super::conn::ConnError> {
    // DISCARD ALL cannot run in a transaction block, so ROLLBACK goes first, as a separate
    // Query; all pipelined: one round trip.
    let rollback = conn.status != TX_IDLE;
    let sqls = [
        "ROLLBACK",
        "DISCARD ALL",
        "SELECT pg_catalog.pg_my_temp_schema() <> 0",
    ];
    let temp = conn
        .simple_first_value(&sqls[usize::from(!rollback)..])
        .await?;
    conn.holds = Holds::default();
    Ok(temp != Some(Some("t".to_owned())))
}
