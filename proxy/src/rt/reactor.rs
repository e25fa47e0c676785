//! The io_uring of one thread: readiness polls, the wait, and timers.

use super::bufring::{self, BufRing};
use io_uring::{cqueue, opcode, squeue, types, IoUring};
use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::future::Future;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::pin::Pin;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

/// user_data of cancel requests, whose completions are ignored.
const CANCEL_TOKEN: u64 = u64::MAX;
/// Submission queue entries per ring: readiness polls are small and short-lived.
const RING_ENTRIES: u32 = 1024;

/// The state of one submitted operation.
enum Op {
    /// Submitted; the waker of the task waiting for it.
    Waiting(Option<Waker>),
    /// Completed with this result (poll mask, bytes, or -errno) and completion flags.
    Done(i32, u32),
    /// Its future was dropped; the slot is freed when the completion arrives.
    Abandoned,
}

/// A submitted operation and the memory the kernel may still be reading. The buffer of a
/// send lives here, not in its caller, so it outlives a caller that goes away before the
/// kernel is done with it.
struct Slot {
    op: Op,
    buf: Option<Vec<u8>>,
}

/// One thread's reactor.
pub struct Reactor {
    ring: RefCell<IoUring>,
    ops: RefCell<slab::Slab<Slot>>,
    timers: RefCell<BTreeMap<(Instant, u64), Waker>>,
    timer_seq: Cell<u64>,
    /// SQEs pushed since the last submit.
    unsubmitted: Cell<usize>,
    /// Receive buffers; `None` where the kernel cannot register them (receives then use
    /// a readiness poll and `recv(2)`).
    bufs: Option<BufRing>,
}

/// A collected completion: result, flags, and the buffer its slot kept.
struct Completion {
    res: i32,
    flags: u32,
    buf: Option<Vec<u8>>,
}

/// What a receive queued with [`Reactor::recv`] brought.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Received {
    /// `len` bytes in buffer `bid`: copy them out with [`Reactor::copy_received`], then
    /// [`Reactor::give_back`] the buffer.
    Data { bid: u16, len: usize },
    /// The peer closed its side.
    Eof,
    /// -errno (ENOBUFS: every buffer was in use).
    Failed(i32),
}

thread_local! {
    static REACTOR: Reactor = Reactor::new().expect("cannot create an io_uring (kernel 5.11+ with io_uring enabled is required)");
}

/// Runs `f` with this thread's reactor.
pub fn with<R>(f: impl FnOnce(&Reactor) -> R) -> R {
    REACTOR.with(f)
}

/// Runs `f` with this thread's reactor, unless the thread is exiting and it is gone.
pub fn try_with<R>(f: impl FnOnce(&Reactor) -> R) -> Option<R> {
    REACTOR.try_with(f).ok()
}

impl Reactor {
    fn new() -> io::Result<Reactor> {
        let ring = IoUring::new(RING_ENTRIES)?;
        let bufs = match BufRing::new() {
            Ok(bufs) => {
                let (addr, count) = bufs.registration();
                // SAFETY: the ring's memory stays mapped for the reactor's life (and
                // after: it is leaked, not unmapped, when the reactor goes).
                match unsafe {
                    ring.submitter()
                        .register_buf_ring_with_flags(addr, count, bufring::GROUP, 0)
                } {
                    Ok(()) => Some(bufs),
                    Err(e) => {
                        tracing::debug!(error = %e, "no provided-buffer ring: receives use poll + recv");
                        // SAFETY: never registered.
                        unsafe { bufs.unmap() };
                        None
                    }
                }
            }
            Err(e) => {
                tracing::debug!(error = %e, "no receive buffers: receives use poll + recv");
                None
            }
        };
        Ok(Reactor {
            ring: RefCell::new(ring),
            ops: RefCell::new(slab::Slab::with_capacity(256)),
            timers: RefCell::new(BTreeMap::new()),
            timer_seq: Cell::new(0),
            unsubmitted: Cell::new(0),
            bufs,
        })
    }

    /// Queues a receive on the socket `fd` into a buffer the kernel picks when data
    /// arrives; `None` when this thread has no receive buffers.
    pub fn recv(&self, fd: RawFd) -> Option<usize> {
        self.bufs.as_ref()?;
        let token = self.ops.borrow_mut().insert(Slot {
            op: Op::Waiting(None),
            buf: None,
        });
        let entry = opcode::Recv::new(types::Fd(fd), std::ptr::null_mut(), bufring::SIZE as u32)
            .buf_group(bufring::GROUP)
            .build()
            .flags(squeue::Flags::BUFFER_SELECT)
            .user_data(token as u64);
        // SAFETY: the kernel writes only into a buffer of the registered ring.
        unsafe { self.push(entry) };
        Some(token)
    }

    /// Collects a completed operation (its slot freed), or registers `cx`'s waker.
    fn poll_op(&self, token: usize, cx: &mut Context<'_>) -> Poll<Completion> {
        let mut ops = self.ops.borrow_mut();
        match &mut ops[token].op {
            Op::Done(res, flags) => {
                let (res, flags) = (*res, *flags);
                let buf = ops.remove(token).buf;
                Poll::Ready(Completion { res, flags, buf })
            }
            Op::Waiting(w) => {
                if !w.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                    *w = Some(cx.waker().clone());
                }
                Poll::Pending
            }
            Op::Abandoned => unreachable!("a live owner's operation is never abandoned"),
        }
    }

    /// Collects a receive queued with [`Reactor::recv`], or registers `cx`'s waker.
    pub fn poll_recv(&self, token: usize, cx: &mut Context<'_>) -> Poll<Received> {
        self.poll_op(token, cx)
            .map(|c| match (c.res, cqueue::buffer_select(c.flags)) {
                (n, Some(bid)) if n > 0 => Received::Data {
                    bid,
                    len: n as usize,
                },
                (n, bid) => {
                    if let Some(bid) = bid {
                        self.give_back(bid);
                    }
                    if n == 0 {
                        Received::Eof
                    } else {
                        Received::Failed(n.min(-libc::EIO))
                    }
                }
            })
    }

    /// Copies bytes `from..` of received buffer `bid` (of `len` bytes) into `out`; returns
    /// how many.
    pub fn copy_received(&self, bid: u16, from: usize, len: usize, out: &mut [u8]) -> usize {
        let bufs = self
            .bufs
            .as_ref()
            .expect("a received buffer without a ring");
        // SAFETY: `bid` came from a completion and is given back only after its last copy.
        let bytes = unsafe { bufs.bytes(bid, len) };
        let n = out.len().min(len - from);
        out[..n].copy_from_slice(&bytes[from..from + n]);
        n
    }

    /// Returns a received buffer to the kernel.
    pub fn give_back(&self, bid: u16) {
        if let Some(bufs) = &self.bufs {
            bufs.give_back(bid);
        }
    }

    /// Queues an entry for the next `io_uring_enter`.
    ///
    /// # Safety
    ///
    /// Memory the entry refers to must stay valid until its completion arrives (the
    /// buffers of sends are kept in their [`Slot`]).
    unsafe fn push(&self, entry: io_uring::squeue::Entry) {
        let mut ring = self.ring.borrow_mut();
        // SAFETY: per the function's contract.
        while unsafe { ring.submission().push(&entry) }.is_err() {
            // Queue full: hand what is queued to the kernel and retry.
            let _ = ring.submit();
            self.unsubmitted.set(0);
        }
        self.unsubmitted.set(self.unsubmitted.get() + 1);
    }

    fn poll_add(&self, fd: RawFd, events: u32, waker: Waker) -> usize {
        let token = self.ops.borrow_mut().insert(Slot {
            op: Op::Waiting(Some(waker)),
            buf: None,
        });
        // SAFETY: a poll refers to no memory.
        unsafe {
            self.push(
                opcode::PollAdd::new(types::Fd(fd), events)
                    .build()
                    .user_data(token as u64),
            );
        }
        token
    }

    /// Queues a send of all of `buf` on the socket `fd`; it goes to the kernel with the
    /// loop's next `io_uring_enter`, together with every other send and wait of the turn.
    /// Returns the token to collect it with [`Reactor::poll_send`].
    pub fn send(&self, fd: RawFd, buf: Vec<u8>) -> usize {
        let mut ops = self.ops.borrow_mut();
        let entry = ops.vacant_entry();
        let token = entry.key();
        let (ptr, len) = (buf.as_ptr(), buf.len() as u32);
        entry.insert(Slot {
            op: Op::Waiting(None),
            buf: Some(buf),
        });
        drop(ops);
        // MSG_WAITALL: the kernel retries a short send itself once the socket drains.
        let entry = opcode::Send::new(types::Fd(fd), ptr, len)
            .flags(libc::MSG_NOSIGNAL | libc::MSG_WAITALL)
            .build()
            .user_data(token as u64);
        // SAFETY: the buffer is owned by the slot until the completion arrives; a
        // Vec's heap memory does not move when the Vec does.
        unsafe { self.push(entry) };
        token
    }

    /// Hands what is queued to the kernel now, without waiting for anything.
    pub fn submit_queued(&self) {
        if self.unsubmitted.get() > 0 {
            let _ = self.ring.borrow().submit();
            self.unsubmitted.set(0);
        }
    }

    /// Collects a send queued with [`Reactor::send`]: its result and its buffer back
    /// (to reuse), or `Pending` with `cx`'s waker registered.
    pub fn poll_send(&self, token: usize, cx: &mut Context<'_>) -> Poll<(i32, Vec<u8>)> {
        self.poll_op(token, cx)
            .map(|c| (c.res, c.buf.unwrap_or_default()))
    }

    /// Whether the send `token` has completed (without collecting it).
    pub fn send_done(&self, token: usize) -> bool {
        matches!(self.ops.borrow()[token].op, Op::Done(..))
    }

    /// Gives up on an operation whose owner is going away: freed now if it completed,
    /// else cancelled and freed when its completion arrives (its buffer with it).
    pub fn abandon(&self, token: usize) {
        let mut ops = self.ops.borrow_mut();
        let done = match ops.get(token).map(|s| &s.op) {
            Some(Op::Done(_, flags)) => Some(cqueue::buffer_select(*flags)),
            _ => None,
        };
        if let Some(bid) = done {
            ops.remove(token);
            if let Some(bid) = bid {
                self.give_back(bid);
            }
        } else {
            ops[token].op = Op::Abandoned;
            drop(ops);
            // SAFETY: a cancel refers to no memory.
            unsafe {
                self.push(
                    opcode::AsyncCancel::new(token as u64)
                        .build()
                        .user_data(CANCEL_TOKEN),
                );
            }
        }
    }

    /// Waits for I/O or the next timer, then wakes what completed. With `block` false
    /// it only collects what has already completed. One `io_uring_enter` either way
    /// (none when nothing was queued and nothing is to be waited for).
    pub fn turn(&self, block: bool) {
        let timeout = if block {
            self.timers
                .borrow()
                .keys()
                .next()
                .map(|(at, _)| at.saturating_duration_since(Instant::now()))
        } else {
            Some(Duration::ZERO)
        };
        {
            let ring = self.ring.borrow();
            let submitter = ring.submitter();
            let result = match timeout {
                Some(t) if t.is_zero() => {
                    if self.unsubmitted.get() > 0 {
                        submitter.submit()
                    } else {
                        Ok(0)
                    }
                }
                Some(t) => {
                    let ts = types::Timespec::from(t);
                    let args = types::SubmitArgs::new().timespec(&ts);
                    submitter.submit_with_args(1, &args)
                }
                None => submitter.submit_and_wait(1),
            };
            self.unsubmitted.set(0);
            if let Err(e) = result {
                if !matches!(
                    e.raw_os_error(),
                    Some(libc::ETIME) | Some(libc::EINTR) | Some(libc::EBUSY)
                ) {
                    tracing::error!(error = %e, "io_uring_enter failed");
                }
            }
        }
        self.complete();
        self.fire_timers();
    }

    fn complete(&self) {
        let mut woken = Vec::new();
        {
            let mut ring = self.ring.borrow_mut();
            let mut ops = self.ops.borrow_mut();
            for cqe in ring.completion() {
                let token = cqe.user_data();
                if token == CANCEL_TOKEN {
                    continue;
                }
                let token = token as usize;
                match ops.get_mut(token).map(|s| &mut s.op) {
                    Some(op @ Op::Waiting(_)) => {
                        if let Op::Waiting(Some(w)) =
                            std::mem::replace(op, Op::Done(cqe.result(), cqe.flags()))
                        {
                            woken.push(w);
                        }
                    }
                    Some(Op::Abandoned) => {
                        ops.remove(token);
                        if let Some(bid) = cqueue::buffer_select(cqe.flags()) {
                            self.give_back(bid);
                        }
                    }
                    _ => {}
                }
            }
        }
        for w in woken {
            w.wake();
        }
    }

    fn fire_timers(&self) {
        let now = Instant::now();
        let due: Vec<Waker> = {
            let mut timers = self.timers.borrow_mut();
            let later = timers.split_off(&(now, u64::MAX));
            std::mem::replace(&mut *timers, later)
                .into_values()
                .collect()
        };
        for w in due {
            w.wake();
        }
    }
}

impl Drop for Reactor {
    fn drop(&mut self) {
        // The ring goes next; the kernel may still read a send's buffer while it tears
        // the ring down, so buffers of sends that did not complete are leaked, not freed
        // (as are the receive buffers: `BufRing` never unmaps on its own).
        for slot in self.ops.get_mut().drain() {
            if !matches!(slot.op, Op::Done(..)) {
                std::mem::forget(slot.buf);
            }
        }
    }
}

/// Completes when `fd` is ready for `events` (`libc::POLLIN`, `libc::POLLOUT`).
/// Dropping it before completion cancels the poll.
pub struct Ready {
    fd: RawFd,
    events: u32,
    token: Option<usize>,
}

impl Ready {
    /// A readiness wait, submitted on first poll.
    pub fn new(fd: RawFd, events: i16) -> Ready {
        Ready {
            fd,
            events: events as u16 as u32,
            token: None,
        }
    }
}

impl Future for Ready {
    type Output = io::Result<()>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        with(|r| match self.token {
            None => {
                self.token = Some(r.poll_add(self.fd, self.events, cx.waker().clone()));
                Poll::Pending
            }
            Some(token) => r.poll_op(token, cx).map(|c| {
                self.token = None;
                if c.res < 0 {
                    Err(io::Error::from_raw_os_error(-c.res))
                } else {
                    Ok(())
                }
            }),
        })
    }
}

impl Drop for Ready {
    fn drop(&mut self) {
        let Some(token) = self.token else { return };
        // The reactor may be gone if the thread is exiting.
        let _ = try_with(|r| r.abandon(token));
    }
}

/// Completes after `duration`.
pub fn sleep(duration: Duration) -> Sleep {
    sleep_until(Instant::now() + duration)
}

/// Completes at `deadline`.
pub fn sleep_until(deadline: Instant) -> Sleep {
    Sleep {
        deadline,
        key: None,
    }
}

/// The future of [`sleep`].
pub struct Sleep {
    deadline: Instant,
    key: Option<(Instant, u64)>,
}

impl Future for Sleep {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if Instant::now() >= self.deadline {
            if let Some(key) = self.key.take() {
                with(|r| r.timers.borrow_mut().remove(&key));
            }
            return Poll::Ready(());
        }
        with(|r| {
            let mut timers = r.timers.borrow_mut();
            match self.key {
                Some(key) if timers.contains_key(&key) => {
                    timers.insert(key, cx.waker().clone());
                }
                _ => {
                    let seq = r.timer_seq.get() + 1;
                    r.timer_seq.set(seq);
                    let key = (self.deadline, seq);
                    timers.insert(key, cx.waker().clone());
                    self.key = Some(key);
                }
            }
        });
        Poll::Pending
    }
}

impl Drop for Sleep {
    fn drop(&mut self) {
        if let Some(key) = self.key {
            let _ = REACTOR.try_with(|r| r.timers.borrow_mut().remove(&key));
        }
    }
}

/// An eventfd: another thread signals it, this thread's tasks wait on it. The one
/// cross-thread wake-up path of the runtime.
pub struct EventFd(OwnedFd);

impl EventFd {
    /// A new non-blocking eventfd.
    ///
    /// # Errors
    ///
    /// `eventfd(2)` failed.
    pub fn new() -> io::Result<EventFd> {
        // SAFETY: plain syscall; the fd is owned below.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a fresh fd we own.
        Ok(EventFd(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    /// Signals it (from any thread).
    pub fn notify(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a valid u64 to our fd.
        unsafe { libc::write(self.0.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }

    /// Waits until it was signalled, and resets it.
    pub async fn wait(&self) {
        loop {
            let mut value: u64 = 0;
            // SAFETY: reads 8 bytes into a valid u64 from our fd.
            let n = unsafe { libc::read(self.0.as_raw_fd(), (&mut value as *mut u64).cast(), 8) };
            if n == 8 {
                return;
            }
            let _ = Ready::new(self.0.as_raw_fd(), libc::POLLIN).await;
        }
    }
}
