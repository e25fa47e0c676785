//! Receive memory: the budget shared by tunnels, and the window auto-tuning settings.
//!
//! What a tunnel charges for one stream is `reserved + min(buffered, window)`:
//!
//! - `reserved` covers the credit granted beyond the base window by auto-tuning. It
//!   is reserved *before* the extra credit is granted (growth is refused, never
//!   forced, when the caps do not allow it) and released as the stream shrinks back
//!   or ends.
//! - `min(buffered, window)` is the part of the bytes received and not yet read that
//!   lies within the base window. The peer may send it without asking, so it is
//!   charged as it arrives; when a cap would be exceeded, the tunnel resets the
//!   stream holding the most unread bytes (it sheds its slowest reader).
//!
//! Since a stream's unread bytes never exceed its granted credit, which is at most
//! `window + reserved`, the sum of the charges bounds the real receive memory: the
//! per-tunnel cap bounds one tunnel, a [`MemoryBudget`] shared by every tunnel of a
//! process bounds them all.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// A byte budget shared by tunnels, possibly on several threads (the relay keeps
/// one for all its tunnels). Cloning gives another handle on the same budget.
#[derive(Debug, Clone)]
pub struct MemoryBudget {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    capacity: u64,
    used: AtomicU64,
}

impl MemoryBudget {
    /// A budget of `capacity` bytes, none used.
    pub fn new(capacity: u64) -> MemoryBudget {
        MemoryBudget {
            inner: Arc::new(Inner {
                capacity,
                used: AtomicU64::new(0),
            }),
        }
    }

    /// The capacity in bytes.
    pub fn capacity(&self) -> u64 {
        self.inner.capacity
    }

    /// Bytes reserved now, over every tunnel charging this budget.
    pub fn used(&self) -> u64 {
        self.inner.used.load(Ordering::Relaxed)
    }

    /// Reserves `n` bytes if the budget has room for them; returns whether it did.
    pub fn try_reserve(&self, n: u64) -> bool {
        self.try_reserve_below(n, self.inner.capacity)
    }

    /// Reserves `n` bytes if the budget then uses at most `limit` bytes (a share of
    /// the capacity); returns whether it did.
    pub fn try_reserve_below(&self, n: u64, limit: u64) -> bool {
        let limit = limit.min(self.inner.capacity);
        self.inner
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(n).filter(|&after| after <= limit)
            })
            .is_ok()
    }

    /// Gives back `n` bytes reserved earlier.
    pub fn release(&self, n: u64) {
        if n == 0 {
            return;
        }
        let before = self.inner.used.fetch_sub(n, Ordering::AcqRel);
        debug_assert!(before >= n, "released {n} bytes of {before} reserved");
    }
}

/// Two handles are equal when they share one budget.
impl PartialEq for MemoryBudget {
    fn eq(&self, other: &MemoryBudget) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}

impl Eq for MemoryBudget {}

/// Window auto-tuning, off by default ([`super::Config::auto_window`]).
///
/// When the application reads a stream's whole current window in less than twice
/// the tunnel's round-trip time (measured by the keepalive PING), the window, not
/// the link or the reader, limits the stream: its window doubles, up to `max`, if
/// the per-tunnel cap and the shared budget allow. Doubling stops once reading a
/// window takes two round trips, i.e. near twice the stream's bandwidth-delay
/// product (between 2× and 4× of it, doubling being coarse).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AutoWindow {
    /// Largest window a stream may grow to, in bytes. At or below
    /// [`super::Config::window`], nothing grows.
    pub max: u32,
}

/// Default [`AutoWindow::max`]: 16 MiB (`LOKADB_MUX_MAX_WINDOW_KB` = 16384).
pub const DEFAULT_MAX_WINDOW: u32 = 16 << 20;

impl Default for AutoWindow {
    fn default() -> AutoWindow {
        AutoWindow {
            max: DEFAULT_MAX_WINDOW,
        }
    }
}

/// Default per-tunnel receive memory cap suggested for the relay: 512 MiB
/// (`LOKADB_MUX_TUNNEL_MEMORY_MB` = 512), 128 full 4 MiB windows.
pub const DEFAULT_TUNNEL_MEMORY_CAP: u64 = 512 << 20;

/// Default receive memory budget shared by all the relay's tunnels: 1 GiB
/// (`LOKADB_MUX_MEMORY_MB` = 1024).
pub const DEFAULT_SHARED_MEMORY_CAP: u64 = 1 << 30;

/// Receive memory caps read from the environment ([`super::memory_caps_from_env`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryCaps {
    /// For [`super::Config::memory_cap`] of each tunnel; `None` when set to 0.
    pub tunnel: Option<u64>,
    /// The capacity of the one [`MemoryBudget`] shared by all tunnels, for
    /// [`super::Config::memory_budget`]; `None` when set to 0.
    pub shared: Option<u64>,
}

impl MemoryCaps {
    /// The shared budget to create once and clone into every tunnel's config.
    pub fn budget(&self) -> Option<MemoryBudget> {
        self.shared.map(MemoryBudget::new)
    }
}

/// Share of a cap (per tunnel or shared) that window growth may fill: growth is
/// refused once the charges would pass half the cap, so the other half stays for
/// the bytes of base windows, and auto-tuning alone never makes a tunnel shed.
pub(super) fn growth_limit(cap: u64) -> u64 {
    cap / 2
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budget_reserves_within_capacity_across_handles() {
        let a = MemoryBudget::new(100);
        let b = a.clone();
        assert_eq!(a, b);
        assert_ne!(a, MemoryBudget::new(100));
        assert!(a.try_reserve(60));
        assert!(!b.try_reserve(41));
        assert!(b.try_reserve(40));
        assert_eq!(a.used(), 100);
        assert!(!a.try_reserve(1));
        b.release(70);
        assert!(!a.try_reserve_below(20, 40));
        assert!(a.try_reserve_below(10, 40));
        assert!(!a.try_reserve(u64::MAX));
        a.release(40);
        assert_eq!(b.used(), 0);
    }

    #[test]
    fn budget_is_shared_between_threads() {
        let budget = MemoryBudget::new(1000);
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let b = budget.clone();
                std::thread::spawn(move || {
                    let mut got = 0;
                    for _ in 0..1000 {
                        if b.try_reserve(1) {
                            got += 1;
                        }
                    }
                    got
                })
            })
            .collect();
        let total: u64 = threads.into_iter().map(|t| t.join().unwrap()).sum();
        assert_eq!(total, 1000);
        assert_eq!(budget.used(), 1000);
    }
}
