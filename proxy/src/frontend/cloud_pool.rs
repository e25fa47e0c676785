//! Where a session gets its cloud backends: the core's pool, a new login under
//! `pool_size`, or a wait in line up to `pool_timeout`; and where it gives them back.
//!
//! In session pooling a session takes one at its start; in transaction pooling, one per
//! transaction ([`super::tx_pool`]). Either way a backend holds a place under the
//! database's and role's `pool_size` over all cores ([`crate::backend::gauge`]) for as long
//! as it is open, in use or idle.

use crate::backend::conn::{BackendConn, ConnError};
use crate::backend::gauge::{Gauge, Held};
use crate::backend::pool::PoolKey;
use crate::backend::slots::CloudKey;
use crate::core::{Core, Database};
use crate::error::SessionError;
use crate::scram::Credentials;
use crate::time::with_timeout;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How often a session waiting at the cap looks again when nothing on its core woke it (a
/// backend closed on another core frees a place there).
const LOOK_AGAIN: Duration = Duration::from_millis(20);

/// An idle backend unused this long goes to sessions waiting on other cores even within its
/// core's share of `pool_size` (its core's sessions do not need it now).
const UNUSED: Duration = Duration::from_millis(500);

/// A session's way to cloud backends.
pub struct CloudSource<'a> {
    core: &'a Core,
    db: &'a Database,
    key: &'a PoolKey,
    creds: Credentials,
    gauge: Arc<Gauge>,
    slot: CloudKey,
}

impl<'a> CloudSource<'a> {
    pub fn new(
        core: &'a Core,
        db: &'a Database,
        key: &'a PoolKey,
        creds: Credentials,
    ) -> CloudSource<'a> {
        CloudSource {
            core,
            db,
            key,
            creds,
            gauge: core.shared.gauges.of(&db.name, &key.user),
            slot: key.cloud_slot(),
        }
    }

    /// A logged-in backend: a pooled one (when `pooled`), else a new login while fewer
    /// than `pool_size` are open, else the first to come free, in the order sessions asked,
    /// within `pool_timeout`.
    pub async fn acquire(&self, pooled: bool) -> Result<BackendConn, SessionError> {
        let config = &self.db.config;
        let started = Instant::now();
        // Counted over all cores while it waits; its place in this core's line.
        let mut waiting = None;
        let mut line = None;
        let mut woken = false;
        loop {
            // The first in line when woken; one that arrives while others wait queues
            // behind them.
            let turn = woken || (line.is_none() && self.core.cloud_slots.waiting(&self.slot) == 0);
            if turn && pooled {
                let taken = self.core.pool.borrow_mut().take(
                    self.key,
                    config.pool_idle_timeout,
                    Instant::now(),
                );
                if let Some(b) = taken {
                    return Ok(b);
                }
            }
            // A place under the cap: in turn, or freed on another core (which wakes no
            // one here) while in line.
            if turn || line.is_some() {
                let place =
                    (self.gauge.try_open(config.pool_size)).or_else(|| self.place_of_other_idle());
                if let Some(place) = place {
                    drop((waiting, line));
                    let mut b = self.connect().await?;
                    b.place = Some(place);
                    b.core_place = self.core.cloud_slots.try_acquire(&self.slot, usize::MAX);
                    return Ok(b);
                }
            }
            let left = config.pool_timeout.saturating_sub(started.elapsed());
            if left.is_zero() {
                return Err(SessionError::PoolTimeout {
                    database: self.db.name.to_string(),
                    user: self.key.user.clone(),
                    size: config.pool_size,
                    waited: started.elapsed(),
                });
            }
            waiting.get_or_insert_with(|| self.gauge.wait());
            let wait = line.get_or_insert_with(|| self.core.cloud_slots.wait(&self.slot));
            woken = with_timeout(left.min(LOOK_AGAIN), wait).await.is_some();
            if woken {
                // Out of the line: its turn.
                line = None;
            }
        }
    }

    /// Gives a backend, idle and holding nothing of a pinned session's, back to the core's
    /// pool for the next session, or closes it when sessions of another core wait at the cap
    /// and none of this one's does (its place is theirs).
    pub fn give_back(&self, b: BackendConn) {
        let here = self.core.cloud_slots.waiting(&self.slot);
        if here == 0 && self.gauge.waiting() > 0 && above_share(self.core, self.db, &self.slot) {
            crate::rt::spawn(b.terminate()).detach();
            return;
        }
        self.core
            .pool
            .borrow_mut()
            .put(self.key.clone(), b, Instant::now());
        self.core.cloud_slots.wake_one(&self.slot);
    }

    /// At the cap: the place of an idle backend of this database and role with other
    /// startup parameters, closed (it would hold its place until it expires, and its
    /// parameters' sessions may not come again).
    fn place_of_other_idle(&self) -> Option<Held> {
        let key = self.key;
        let mut other = self.core.pool.borrow_mut().take_oldest(|k, _, _| {
            k.org.is_none() && k.database == key.database && k.user == key.user && k != key
        })?;
        let place = other.place.take();
        crate::rt::spawn(other.terminate()).detach();
        place
    }

    async fn connect(&self) -> Result<BackendConn, SessionError> {
        connect_backend(self.db, self.key, &self.creds).await
    }
}

/// Whether this core holds more than its share of `pool_size` (the cap ÷ the cores, up):
/// only then does it close a backend for sessions waiting on other cores. Below it, its
/// backends stay its own: handing places back and forth between busy cores would log in a
/// backend per transaction (measured: 446 logins in 5 s at 100 pgbench clients on 2 cores).
fn above_share(core: &Core, db: &Database, slot: &CloudKey) -> bool {
    let share = (db.config.pool_size as usize).div_ceil(core.peers.len().max(1));
    core.cloud_slots.open(slot) > share
}

/// Closes one idle cloud backend of a database and role whose sessions wait at its cap on
/// other cores while none waits on this one, if this core holds more than its share or the
/// backend sat idle for [`UNUSED`]: their wait ends when a place frees, and an idle backend
/// here (other startup parameters, or no session here wants it) may hold it until it
/// expires. Runs on the core's tick.
pub fn free_a_place_for_other_cores(core: &Core) {
    let databases = core.databases.borrow();
    let now = Instant::now();
    let idle = core.pool.borrow_mut().take_oldest(|k, conn, since| {
        let slot = k.cloud_slot();
        k.org.is_none()
            && conn.place.as_ref().is_some_and(|p| p.gauge().waiting() > 0)
            && core.cloud_slots.waiting(&slot) == 0
            && (now.duration_since(since) >= UNUSED
                || (databases.get(&*k.database)).is_some_and(|db| above_share(core, db, &slot)))
    });
    drop(databases);
    if let Some(b) = idle {
        crate::rt::spawn(b.terminate()).detach();
    }
}

/// Logs in a new cloud backend for `key`, within `connect_timeout`.
pub async fn connect_backend(
    db: &Database,
    key: &PoolKey,
    creds: &Credentials,
) -> Result<BackendConn, SessionError> {
    let connect = BackendConn::connect(
        db.addr,
        &key.user,
        &db.dbname,
        &key.params,
        creds,
        db.tls.as_deref(),
    );
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
