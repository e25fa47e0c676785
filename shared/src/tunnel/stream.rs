//! One stream: its state machine and the send and receive halves of its flow control.
//!
//! The accounting follows quinn's `streams/{send,recv}.rs`: counters only grow, and the
//! window is the difference between what the receiver has allowed and what has been
//! sent. Nothing here touches other streams; [`super::Tunnel`] schedules between them.

use std::collections::VecDeque;
use std::time::Instant;

use bytes::{Bytes, BytesMut};

/// Where a stream is in its life.
///
/// ```text
///                 Open
///      local CLOSE /  \ remote CLOSE
///   HalfClosedLocal    HalfClosedRemote
///      remote CLOSE \  / local CLOSE
///                 Closed
///
///   any state --RESET (either way)--> Reset
/// ```
///
/// `Closed` and `Reset` are terminal. A stream reaching `Reset` is removed from the
/// tunnel at once, its buffered bytes discarded; a `Closed` one once its last bytes
/// have been read and its CLOSE sent. Frames arriving later for its id follow the
/// rules for closed ids (see [`super::Tunnel`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamState {
    /// Both ends may send.
    Open,
    /// The local application closed its side; the peer may still send.
    HalfClosedLocal,
    /// The peer sent CLOSE; the local application may still send.
    HalfClosedRemote,
    /// Both sides closed.
    Closed,
    /// Aborted by either end.
    Reset,
}

/// What happens to a stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transition {
    /// The local application closes its sending side.
    LocalClose,
    /// A CLOSE arrives from the peer.
    RemoteClose,
    /// Either end resets the stream.
    Reset,
}

impl StreamState {
    /// The state after `t`, or `None` when `t` is not allowed in this state (closing
    /// a side twice, or anything after a terminal state).
    pub fn next(self, t: Transition) -> Option<StreamState> {
        use StreamState::*;
        match (self, t) {
            (Open, Transition::LocalClose) => Some(HalfClosedLocal),
            (Open, Transition::RemoteClose) => Some(HalfClosedRemote),
            (HalfClosedRemote, Transition::LocalClose)
            | (HalfClosedLocal, Transition::RemoteClose) => Some(Closed),
            (Open | HalfClosedLocal | HalfClosedRemote, Transition::Reset) => Some(Reset),
            _ => None,
        }
    }

    /// Whether the local application may still write.
    pub fn can_send(self) -> bool {
        matches!(self, StreamState::Open | StreamState::HalfClosedRemote)
    }

    /// Whether the peer may still send DATA.
    pub fn can_receive(self) -> bool {
        matches!(self, StreamState::Open | StreamState::HalfClosedLocal)
    }
}

/// Counters of one stream, for operators and for tests that check the window.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StreamStats {
    /// Bytes sent in DATA frames.
    pub sent: u64,
    /// Total bytes the peer has allowed us to send: its window plus its updates.
    /// `sent <= send_limit` always holds.
    pub send_limit: u64,
    /// Bytes written by the application and not sent yet.
    pub queued: u64,
    /// Bytes received in DATA frames.
    pub received: u64,
    /// Bytes the application has read.
    pub consumed: u64,
    /// Bytes received and not read yet (`received - consumed`).
    pub buffered: u64,
    /// Times the stream had bytes to send and no window left.
    pub stalls: u64,
    /// The receive window granted to the peer now: the base window, or more once
    /// auto-tuning grew it. `recv_limit - consumed <= window` after every read,
    /// except after a shrink, while the peer uses credit granted before it.
    pub window: u64,
    /// Total bytes the peer may send on this stream: its base window plus every
    /// WINDOW_UPDATE sent. `received <= recv_limit` always holds.
    pub recv_limit: u64,
}

/// One stream's state and buffers.
#[derive(Debug)]
pub(super) struct Stream {
    pub(super) state: StreamState,
    /// Opened by the peer (counts against our `max_streams`) or by us (against theirs).
    pub(super) remote: bool,
    pub(super) send: SendHalf,
    pub(super) recv: RecvHalf,
}

impl Stream {
    pub(super) fn new(remote: bool, send_window: u32, recv_window: u32) -> Stream {
        Stream {
            state: StreamState::Open,
            remote,
            send: SendHalf {
                queue: VecDeque::new(),
                queued: 0,
                limit: u64::from(send_window),
                sent: 0,
                fin_sent: false,
                scheduled: false,
                stalled: false,
                stalls: 0,
            },
            recv: RecvHalf {
                buf: BytesMut::new(),
                base: recv_window,
                window: recv_window,
                limit: u64::from(recv_window),
                received: 0,
                consumed: 0,
                update_queued: false,
                signalled: false,
                eof_read: false,
                reserved: 0,
                charged: 0,
                epoch: None,
                last_read: None,
            },
        }
    }

    /// Whether the stream holds nothing more for anyone: both sides closed, its
    /// CLOSE on the wire, and the application has read up to the end
    /// ([`super::Read::Finished`]), so it learns the end from a read, never from a
    /// stream that vanished.
    pub(super) fn is_done(&self) -> bool {
        self.state == StreamState::Closed && self.send.fin_sent && self.recv.eof_read
    }

    /// Whether the scheduler has something to send for this stream now: DATA within
    /// the window, or the CLOSE once all DATA is out.
    pub(super) fn wants_send(&self) -> bool {
        if self.send.queued > 0 {
            self.send.credit() > 0
        } else {
            !self.state.can_send() && !self.send.fin_sent
        }
    }

    pub(super) fn stats(&self) -> StreamStats {
        StreamStats {
            sent: self.send.sent,
            send_limit: self.send.limit,
            queued: self.send.queued,
            received: self.recv.received,
            consumed: self.recv.consumed,
            buffered: self.recv.buf.len() as u64,
            stalls: self.send.stalls,
            window: u64::from(self.recv.window),
            recv_limit: self.recv.limit,
        }
    }
}

/// The sending half: bytes the application wrote, and the peer's credit.
#[derive(Debug)]
pub(super) struct SendHalf {
    /// Written and not yet sent. Writes beyond the window wait here.
    queue: VecDeque<Bytes>,
    pub(super) queued: u64,
    /// Total bytes the peer allows: its initial window plus every WINDOW_UPDATE.
    pub(super) limit: u64,
    pub(super) sent: u64,
    pub(super) fin_sent: bool,
    /// In the tunnel's round-robin queue.
    pub(super) scheduled: bool,
    /// Has queued bytes and no credit; counted once per stall.
    pub(super) stalled: bool,
    pub(super) stalls: u64,
}

impl SendHalf {
    pub(super) fn credit(&self) -> u64 {
        self.limit - self.sent
    }

    pub(super) fn push(&mut self, data: Bytes) {
        self.queued += data.len() as u64;
        self.queue.push_back(data);
    }

    pub(super) fn add_credit(&mut self, increment: u32) {
        // A peer may grant more than it can hold; that is its own memory to spend.
        // Saturating keeps a hostile peer from overflowing the counter.
        self.limit = self.limit.saturating_add(u64::from(increment));
        self.stalled = false;
    }

    /// Takes up to `max` bytes from the front of the queue, and no more than the
    /// credit left. One write is sent without copying; small writes are coalesced so
    /// that a stream of small Postgres messages does not become a stream of tiny frames.
    pub(super) fn take(&mut self, max: usize) -> Bytes {
        let n = (self.credit().min(self.queued) as usize).min(max);
        let Some(front) = self.queue.front_mut() else {
            return Bytes::new();
        };
        let out = if front.len() >= n {
            let out = front.split_to(n);
            if front.is_empty() {
                self.queue.pop_front();
            }
            out
        } else {
            let mut out = BytesMut::with_capacity(n);
            while out.len() < n {
                let Some(front) = self.queue.front_mut() else {
                    break;
                };
                let k = front.len().min(n - out.len());
                out.extend_from_slice(&front.split_to(k));
                if front.is_empty() {
                    self.queue.pop_front();
                }
            }
            out.freeze()
        };
        self.queued -= out.len() as u64;
        self.sent += out.len() as u64;
        out
    }

    /// Drops everything queued (the stream was reset).
    pub(super) fn discard(&mut self) {
        self.queue.clear();
        self.queued = 0;
    }
}

/// The receiving half: bytes received and not read, and the credit we gave.
#[derive(Debug)]
pub(super) struct RecvHalf {
    /// Received and not read. Payloads are copied in rather than kept as slices of
    /// the input buffer: a peer sending one-byte frames could otherwise pin a whole
    /// read buffer per byte, and memory would no longer be bounded by the window.
    pub(super) buf: BytesMut,
    /// The window announced in the handshake, which every stream starts with.
    pub(super) base: u32,
    /// The window we grant this stream now: `base`, or more once auto-tuning grew it.
    pub(super) window: u32,
    /// Total bytes the peer may send: `base` plus every WINDOW_UPDATE we sent.
    pub(super) limit: u64,
    pub(super) received: u64,
    pub(super) consumed: u64,
    /// In the tunnel's WINDOW_UPDATE queue.
    pub(super) update_queued: bool,
    /// A `Readable` event is outstanding (not yet followed by a read).
    pub(super) signalled: bool,
    /// The application was told the stream ended ([`super::Read::Finished`]).
    pub(super) eof_read: bool,
    /// Bytes reserved for credit beyond `base` (auto-tuning): at least
    /// `max(window, granted) - base`, so that `granted <= base + reserved`.
    pub(super) reserved: u64,
    /// Bytes charged for unread bytes within the base window: `min(buffered, base)`.
    pub(super) charged: u64,
    /// Auto-tuning: when the current measurement began, and `consumed` then.
    pub(super) epoch: Option<(Instant, u64)>,
    /// When the application last read bytes (the tunnel's clock).
    pub(super) last_read: Option<Instant>,
}

impl RecvHalf {
    /// Whether `len` more bytes stay within the credit granted.
    pub(super) fn fits(&self, len: usize) -> bool {
        self.received + len as u64 <= self.limit
    }

    pub(super) fn push(&mut self, payload: &[u8]) {
        self.received += payload.len() as u64;
        self.buf.extend_from_slice(payload);
    }

    /// Credit consumed by the reader and not yet returned to the peer: what brings
    /// the granted credit (`limit - consumed`) back up to the window. None while the
    /// peer still holds more than the window (after the window shrank).
    pub(super) fn pending_credit(&self) -> u64 {
        (self.consumed + u64::from(self.window)).saturating_sub(self.limit)
    }

    /// Bytes the peer may still send plus bytes received and not read: the most this
    /// stream can hold without granting more.
    pub(super) fn granted(&self) -> u64 {
        self.limit - self.consumed
    }

    /// What this stream charges to the caps now: `reserved + charged`.
    pub(super) fn charge(&self) -> u64 {
        self.reserved + self.charged
    }

    /// Whether enough has been consumed to be worth a WINDOW_UPDATE. Half the window
    /// batches updates; a reader that keeps up always leaves the sender more than
    /// half a window of credit, so the threshold never deadlocks.
    pub(super) fn update_due(&self) -> bool {
        self.pending_credit() >= u64::from(self.window / 2).max(1)
    }

    /// Returns the pending credit as one WINDOW_UPDATE increment.
    pub(super) fn take_credit(&mut self) -> u32 {
        let inc = self.pending_credit().min(u64::from(u32::MAX)) as u32;
        self.limit += u64::from(inc);
        inc
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_transitions() {
        use StreamState::*;
        use Transition::*;
        let table = [
            (Open, LocalClose, Some(HalfClosedLocal)),
            (Open, RemoteClose, Some(HalfClosedRemote)),
            (Open, Transition::Reset, Some(StreamState::Reset)),
            (HalfClosedLocal, LocalClose, None),
            (HalfClosedLocal, RemoteClose, Some(Closed)),
            (HalfClosedRemote, RemoteClose, None),
            (HalfClosedRemote, LocalClose, Some(Closed)),
            (
                HalfClosedRemote,
                Transition::Reset,
                Some(StreamState::Reset),
            ),
            (Closed, Transition::Reset, None),
            (Closed, RemoteClose, None),
            (StreamState::Reset, LocalClose, None),
        ];
        for (from, t, to) in table {
            assert_eq!(from.next(t), to, "{from:?} + {t:?}");
        }
    }

    #[test]
    fn take_respects_credit_and_coalesces() {
        let mut s = Stream::new(false, 10, 10);
        s.send.push(Bytes::from_static(b"abc"));
        s.send.push(Bytes::from_static(b"defgh"));
        s.send.push(Bytes::from_static(b"ijklmnop"));
        assert_eq!(&s.send.take(6)[..], b"abcdef");
        assert_eq!(&s.send.take(100)[..], b"ghij");
        assert_eq!(s.send.credit(), 0);
        assert_eq!(&s.send.take(100)[..], b"");
        assert_eq!(s.send.queued, 6);
        s.send.add_credit(4);
        assert_eq!(&s.send.take(100)[..], b"klmn");
        assert_eq!(s.stats().sent, 14);
        assert_eq!(s.stats().send_limit, 14);
    }

    #[test]
    fn credit_returns_after_half_a_window_is_consumed() {
        let mut s = Stream::new(true, 10, 10);
        s.recv.push(b"0123456789");
        assert!(!s.recv.fits(1));
        s.recv.consumed = 4;
        assert!(!s.recv.update_due());
        s.recv.consumed = 5;
        assert!(s.recv.update_due());
        assert_eq!(s.recv.take_credit(), 5);
        assert!(s.recv.fits(5));
        assert!(!s.recv.fits(6));
        assert_eq!(s.recv.pending_credit(), 0);
    }
}
