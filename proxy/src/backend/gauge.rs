//! `pool_size`: the cap on one database's cloud backends for one role, in use and idle,
//! over all cores together. One pair of atomics per database and role, touched only when
//! a backend is opened or closed and when a session starts or stops waiting — never per
//! statement. Each core keeps its own idle backends and its own queue of waiting sessions
//! ([`super::slots::Slots`]); a core that would pool a backend while sessions of another
//! core wait at the cap closes it instead, so the cap's places follow the waiting.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

/// Open cloud backends and waiting sessions of one database and role, over all cores.
#[derive(Debug, Default)]
pub struct Gauge {
    open: AtomicU32,
    waiting: AtomicU32,
}

impl Gauge {
    /// A place for one more backend, if fewer than `max` are open (`max` 0: no cap).
    pub fn try_open(self: &Arc<Self>, max: u32) -> Option<Held> {
        let mut open = self.open.load(Ordering::Relaxed);
        loop {
            if max != 0 && open >= max {
                return None;
            }
            match self.open.compare_exchange_weak(
                open,
                open + 1,
                Ordering::AcqRel,
                Ordering::Relaxed,
            ) {
                Ok(_) => return Some(Held(self.clone())),
                Err(now) => open = now,
            }
        }
    }

    /// Sessions waiting for a backend at the cap, on any core.
    pub fn waiting(&self) -> u32 {
        self.waiting.load(Ordering::Relaxed)
    }

    /// Backends open now.
    pub fn open(&self) -> u32 {
        self.open.load(Ordering::Relaxed)
    }

    /// Counts a session waiting until the returned guard drops.
    pub fn wait(self: &Arc<Self>) -> Waiting {
        self.waiting.fetch_add(1, Ordering::AcqRel);
        Waiting(self.clone())
    }
}

/// One open backend's place under the cap, given back when the backend is dropped.
#[derive(Debug)]
pub struct Held(Arc<Gauge>);

impl Held {
    /// The gauge it counts in.
    pub fn gauge(&self) -> &Gauge {
        &self.0
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A session counted as waiting.
pub struct Waiting(Arc<Gauge>);

impl Drop for Waiting {
    fn drop(&mut self) {
        self.0.waiting.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The gauges of the process, by database and role; looked up once per session.
#[derive(Debug, Default)]
pub struct Gauges(Mutex<HashMap<(String, String), Arc<Gauge>>>);

impl Gauges {
    /// The gauge of `database` and `user`, made on first use.
    pub fn of(&self, database: &str, user: &str) -> Arc<Gauge> {
        let mut map = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        map.entry((database.to_owned(), user.to_owned()))
            .or_default()
            .clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn places_are_capped_and_given_back_on_drop() {
        let g = Arc::new(Gauge::default());
        let a = g.try_open(2).unwrap();
        let _b = g.try_open(2).unwrap();
        assert!(g.try_open(2).is_none());
        drop(a);
        assert_eq!(g.open(), 1);
        assert!(g.try_open(2).is_some());
        // 0: no cap.
        let many: Vec<_> = (0..100).map(|_| g.try_open(0).unwrap()).collect();
        assert_eq!(g.open(), 101);
        drop(many);
        let w = g.wait();
        assert_eq!(g.waiting(), 1);
        drop(w);
        assert_eq!(g.waiting(), 0);
    }

    #[test]
    fn one_gauge_per_database_and_role() {
        let gauges = Gauges::default();
        let a = gauges.of("app", "alice");
        let _held = a.try_open(1).unwrap();
        assert!(gauges.of("app", "alice").try_open(1).is_none());
        assert!(gauges.of("app", "bob").try_open(1).is_some());
        assert!(gauges.of("other", "alice").try_open(1).is_some());
    }
}
