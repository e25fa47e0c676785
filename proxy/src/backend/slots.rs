//! The cap on a core's connections to each organization's database (`direct_max`, split
//! between the cores). Every open direct connection, in use or pooled, holds a [`Permit`];
//! dropping the connection gives it back and wakes the session that waited longest for
//! one. A connection put back in the pool wakes one too (it may take that connection).
//! Per core, so no lock: only this core's sessions wait here.

use crate::org::OrgId;
use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::hash::Hash;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll, Waker};

/// A database entry's name and an organization.
pub type SlotKey = (Rc<str>, OrgId);

/// A database entry's name and a role: the key of cloud backends under `pool_size`.
pub type CloudKey = (Rc<str>, Rc<str>);

#[derive(Default)]
struct Count {
    open: usize,
    /// Waiting sessions, longest first, by wait id.
    waiters: VecDeque<(u64, Waker)>,
}

struct Inner<K> {
    counts: HashMap<K, Count>,
    next_wait: u64,
}

/// A core's connections per key (direct ones per organization; cloud backends per database
/// and role, whose cap is global: [`super::gauge`]), and the sessions waiting for one.
pub struct Slots<K = SlotKey>(Rc<RefCell<Inner<K>>>);

impl<K> Default for Slots<K> {
    fn default() -> Self {
        Slots(Rc::new(RefCell::new(Inner {
            counts: HashMap::new(),
            next_wait: 0,
        })))
    }
}

impl<K> Clone for Slots<K> {
    fn clone(&self) -> Self {
        Slots(self.0.clone())
    }
}

/// One open connection's place under the cap, given back on drop.
pub struct Permit<K: Clone + Eq + Hash = SlotKey> {
    slots: Slots<K>,
    key: K,
}

impl<K: Clone + Eq + Hash> Slots<K> {
    /// A permit for one more connection to `key`, if fewer than `max` are open.
    pub fn try_acquire(&self, key: &K, max: usize) -> Option<Permit<K>> {
        let mut inner = self.0.borrow_mut();
        let count = inner.counts.entry(key.clone()).or_default();
        if count.open >= max {
            return None;
        }
        count.open += 1;
        Some(Permit {
            slots: self.clone(),
            key: key.clone(),
        })
    }

    /// Wakes the session that waited longest for `key` (a connection came free).
    pub fn wake_one(&self, key: &K) {
        let waker = {
            let mut inner = self.0.borrow_mut();
            inner
                .counts
                .get_mut(key)
                .and_then(|c| c.waiters.pop_front())
        };
        if let Some((_, w)) = waker {
            w.wake();
        }
    }

    /// Resolves once woken by [`Slots::wake_one`]: a permit was given back or a connection
    /// pooled for `key` (which another session may still take first: look again).
    pub fn wait(&self, key: &K) -> Wait<K> {
        Wait {
            slots: self.clone(),
            key: key.clone(),
            id: None,
        }
    }

    /// How many sessions wait for `key`.
    pub fn waiting(&self, key: &K) -> usize {
        self.0
            .borrow()
            .counts
            .get(key)
            .map_or(0, |c| c.waiters.len())
    }

    /// How many connections to `key` are open.
    pub fn open(&self, key: &K) -> usize {
        self.0.borrow().counts.get(key).map_or(0, |c| c.open)
    }
}

impl<K: Clone + Eq + Hash> Drop for Permit<K> {
    fn drop(&mut self) {
        {
            let mut inner = self.slots.0.borrow_mut();
            let Some(count) = inner.counts.get_mut(&self.key) else {
                return;
            };
            count.open -= 1;
            if count.open == 0 && count.waiters.is_empty() {
                inner.counts.remove(&self.key);
            }
        }
        self.slots.wake_one(&self.key);
    }
}

/// See [`Slots::wait`]. Dropped before it was woken (a timeout), it leaves the queue, so
/// a wake-up never goes to a session that stopped waiting.
pub struct Wait<K: Clone + Eq + Hash = SlotKey> {
    slots: Slots<K>,
    key: K,
    id: Option<u64>,
}

// Nothing in it is pinned: it is moved freely, whatever the key.
impl<K: Clone + Eq + Hash> Unpin for Wait<K> {}

impl<K: Clone + Eq + Hash> Future for Wait<K> {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let slots = self.slots.clone();
        let mut inner = slots.0.borrow_mut();
        let inner = &mut *inner;
        let Some(id) = self.id else {
            let id = inner.next_wait;
            inner.next_wait += 1;
            inner
                .counts
                .entry(self.key.clone())
                .or_default()
                .waiters
                .push_back((id, cx.waker().clone()));
            self.id = Some(id);
            return Poll::Pending;
        };
        let queued = inner
            .counts
            .get_mut(&self.key)
            .and_then(|c| c.waiters.iter_mut().find(|(w, _)| *w == id));
        match queued {
            Some((_, waker)) => {
                waker.clone_from(cx.waker());
                Poll::Pending
            }
            // Taken out of the queue: woken.
            None => {
                self.id = None;
                Poll::Ready(())
            }
        }
    }
}

impl<K: Clone + Eq + Hash> Drop for Wait<K> {
    fn drop(&mut self) {
        let Some(id) = self.id else {
            return;
        };
        let woken = {
            let mut inner = self.slots.0.borrow_mut();
            match inner.counts.get_mut(&self.key) {
                Some(count) => {
                    let queued = count.waiters.len();
                    count.waiters.retain(|(w, _)| *w != id);
                    let woken = count.waiters.len() == queued;
                    if count.open == 0 && count.waiters.is_empty() {
                        inner.counts.remove(&self.key);
                    }
                    woken
                }
                None => true,
            }
        };
        // Woken but gone before it looked (its session ended, or wants another
        // organization now): the wake-up goes on to the next waiter.
        if woken {
            self.slots.wake_one(&self.key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::task::Wake;

    struct Counter(AtomicUsize);
    impl Wake for Counter {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn key() -> SlotKey {
        (Rc::from("app"), OrgId::from("acme"))
    }

    #[test]
    fn permits_are_capped_and_a_dropped_one_wakes_the_longest_waiter_only() {
        let slots = Slots::default();
        let a = slots.try_acquire(&key(), 2).unwrap();
        let _b = slots.try_acquire(&key(), 2).unwrap();
        assert!(slots.try_acquire(&key(), 2).is_none());
        assert_eq!(slots.open(&key()), 2);

        let (first, second) = (
            Arc::new(Counter(AtomicUsize::new(0))),
            Arc::new(Counter(AtomicUsize::new(0))),
        );
        let (wf, ws) = (Waker::from(first.clone()), Waker::from(second.clone()));
        let mut w1 = Box::pin(slots.wait(&key()));
        let mut w2 = Box::pin(slots.wait(&key()));
        assert!(w1.as_mut().poll(&mut Context::from_waker(&wf)).is_pending());
        assert!(w2.as_mut().poll(&mut Context::from_waker(&ws)).is_pending());

        drop(a);
        assert_eq!(slots.open(&key()), 1);
        assert_eq!(first.0.load(Ordering::SeqCst), 1);
        assert_eq!(second.0.load(Ordering::SeqCst), 0);
        assert!(w1.as_mut().poll(&mut Context::from_waker(&wf)).is_ready());
        assert!(slots.try_acquire(&key(), 2).is_some());
    }

    #[test]
    fn a_wake_up_to_a_waiter_that_left_goes_on_to_the_next() {
        let slots = Slots::default();
        let a = slots.try_acquire(&key(), 1).unwrap();
        let (left, next) = (
            Arc::new(Counter(AtomicUsize::new(0))),
            Arc::new(Counter(AtomicUsize::new(0))),
        );
        let (wl, wn) = (Waker::from(left.clone()), Waker::from(next.clone()));
        let mut w1 = Box::pin(slots.wait(&key()));
        let mut w2 = Box::pin(slots.wait(&key()));
        assert!(w1.as_mut().poll(&mut Context::from_waker(&wl)).is_pending());
        assert!(w2.as_mut().poll(&mut Context::from_waker(&wn)).is_pending());
        drop(a);
        assert_eq!(left.0.load(Ordering::SeqCst), 1);
        drop(w1); // woken, never polled again
        assert_eq!(next.0.load(Ordering::SeqCst), 1);
        assert!(w2.as_mut().poll(&mut Context::from_waker(&wn)).is_ready());
    }

    #[test]
    fn a_waiter_that_gave_up_is_not_woken() {
        let slots = Slots::default();
        let a = slots.try_acquire(&key(), 1).unwrap();
        let (gone, stays) = (
            Arc::new(Counter(AtomicUsize::new(0))),
            Arc::new(Counter(AtomicUsize::new(0))),
        );
        let (wg, wst) = (Waker::from(gone.clone()), Waker::from(stays.clone()));
        let mut w1 = Box::pin(slots.wait(&key()));
        let mut w2 = Box::pin(slots.wait(&key()));
        assert!(w1.as_mut().poll(&mut Context::from_waker(&wg)).is_pending());
        assert!(w2
            .as_mut()
            .poll(&mut Context::from_waker(&wst))
            .is_pending());
        drop(w1); // timed out
        drop(a);
        assert_eq!(gone.0.load(Ordering::SeqCst), 0);
        assert_eq!(stays.0.load(Ordering::SeqCst), 1);
        assert_eq!(slots.open(&key()), 0);
    }
}
