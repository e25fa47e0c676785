//! Messages to a core from other threads: a channel plus the eventfd that wakes the core's
//! task waiting on it. For rare events only (forwarded cancels, metadata generations);
//! nothing per statement crosses cores.

use super::reactor::EventFd;
use std::io;
use std::sync::Arc;

/// The sending side, cloneable, usable from any thread.
pub struct Mailbox<T> {
    tx: crossbeam_channel::Sender<T>,
    wake: Arc<EventFd>,
}

impl<T> Clone for Mailbox<T> {
    fn clone(&self) -> Self {
        Mailbox {
            tx: self.tx.clone(),
            wake: self.wake.clone(),
        }
    }
}

impl<T> Mailbox<T> {
    /// Queues `msg` and wakes the receiving core (dropped if the core is gone).
    pub fn send(&self, msg: T) {
        if self.tx.send(msg).is_ok() {
            self.wake.notify();
        }
    }
}

/// The receiving side, owned by one core.
pub struct Inbox<T> {
    rx: crossbeam_channel::Receiver<T>,
    wake: Arc<EventFd>,
}

impl<T> Inbox<T> {
    /// Hands every message to `f` as it arrives, for the core's life.
    pub async fn for_each(self, mut f: impl FnMut(T)) {
        loop {
            self.wake.wait().await;
            while let Ok(msg) = self.rx.try_recv() {
                f(msg);
            }
        }
    }
}

/// The senders of one mailbox per core (index = core), and each core's inbox.
pub type PerCore<T> = (Vec<Mailbox<T>>, Vec<Inbox<T>>);

/// One mailbox per core.
///
/// # Errors
///
/// An eventfd could not be made.
pub fn per_core<T>(cores: usize) -> io::Result<PerCore<T>> {
    let mut senders = Vec::with_capacity(cores);
    let mut inboxes = Vec::with_capacity(cores);
    for _ in 0..cores {
        let (tx, rx) = crossbeam_channel::unbounded();
        let wake = Arc::new(EventFd::new()?);
        senders.push(Mailbox {
            tx,
            wake: wake.clone(),
        });
        inboxes.push(Inbox { rx, wake });
    }
    Ok((senders, inboxes))
}
