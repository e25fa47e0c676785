//! The multiplexer for one end of a tunnel: handshake, streams, flow control and the
//! DATA scheduler, as a pure data structure.
//!
//! The driver (the relay or the agent, with its socket and clock) feeds it with
//! `handle_*` calls and drains it with `poll_*` calls:
//!
//! - input: [`Tunnel::handle_input`] (bytes received), [`Tunnel::handle_timeout`]
//!   (the clock), and the application's calls [`Tunnel::handle_open`],
//!   [`Tunnel::handle_write`], [`Tunnel::handle_read`], [`Tunnel::handle_close`],
//!   [`Tunnel::handle_reset`], [`Tunnel::handle_accept`], [`Tunnel::handle_reject`],
//!   [`Tunnel::handle_drain`];
//! - output: [`Tunnel::poll_transmit`] (bytes to send), [`Tunnel::poll_event`]
//!   (what the application must act on), [`Tunnel::poll_timeout`] (when to call
//!   `handle_timeout`).
//!
//! After any `handle_*` call the driver drains `poll_transmit` and `poll_event`.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};

use super::code::ErrorCode;
use super::error::{StreamError, TunnelError};
use super::frame::{Frame, Hello, Role, StreamId, MAX_FRAME_BODY, MAX_TEXT_LEN, PROTOCOL_VERSION};
use super::memory::{AutoWindow, MemoryBudget};
use super::stream::{Stream, StreamState, StreamStats};

mod app;
mod peer;
mod tune;

/// Default per-stream receive window: 4 MiB (`LOKADB_MUX_WINDOW_KB` = 4096).
pub const DEFAULT_WINDOW: u32 = 4 << 20;
/// Default limit of concurrent streams the peer may open.
pub const DEFAULT_MAX_STREAMS: u32 = 2048;
/// Default largest DATA payload sent: the scheduler's quantum, so one busy stream
/// delays another by at most one such frame.
pub const DEFAULT_MAX_PAYLOAD: u32 = 64 * 1024;
/// Control frames provoked by the peer (PONG, RESET answers) that may wait unsent
/// before the peer counts as not reading. Bounds the memory a peer that sends
/// without reading can make us spend.
pub const MAX_QUEUED_CONTROL: usize = 4096;

/// Settings of one end. Both ends announce `window` and `max_streams` in the
/// handshake, so they may differ between the ends. The receive memory settings
/// (`auto_window`, `memory_cap`, `memory_budget`) are local: the peer never learns
/// them, and an end that uses them works with any version-1 peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// Receive window granted to each stream, in bytes, at least 1.
    pub window: u32,
    /// Concurrent streams the peer may open towards this end.
    pub max_streams: u32,
    /// Largest DATA payload this end sends (at most [`MAX_FRAME_BODY`]).
    pub max_payload: u32,
    /// Send a PING this often once the tunnel is ready.
    pub keepalive: Option<Duration>,
    /// End the tunnel when nothing at all is received for this long (the handshake
    /// included, so it also bounds the time to authenticate).
    pub idle_timeout: Option<Duration>,
    /// Window auto-tuning: grow the window of a stream whose reader keeps up towards
    /// twice its bandwidth-delay product. Off (`None`) by default: every stream has
    /// exactly `window`.
    pub auto_window: Option<AutoWindow>,
    /// Cap on this tunnel's receive memory, in bytes: unread bytes within the base
    /// windows plus the credit reserved by auto-tuning. Reaching it resets the
    /// stream with the most unread bytes (`FLOW_CONTROL`); window growth stops at
    /// half of it. `None` (default): no cap, `max_streams × window` at most.
    pub memory_cap: Option<u64>,
    /// A budget shared with other tunnels (the relay passes one to all its tunnels),
    /// charged like `memory_cap`, with the same effects. `None` by default.
    pub memory_budget: Option<MemoryBudget>,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            window: DEFAULT_WINDOW,
            max_streams: DEFAULT_MAX_STREAMS,
            max_payload: DEFAULT_MAX_PAYLOAD,
            keepalive: Some(Duration::from_secs(2)),
            idle_timeout: Some(Duration::from_secs(6)),
            auto_window: None,
            memory_cap: None,
            memory_budget: None,
        }
    }
}

/// Where the tunnel is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Relay: waiting for the agent's HELLO.
    AwaitHello,
    /// Relay: HELLO received ([`Event::Hello`]); waiting for the application to
    /// check the token and call [`Tunnel::handle_accept`] or [`Tunnel::handle_reject`].
    HelloReceived,
    /// Agent: HELLO sent, waiting for HELLO_OK or HELLO_REJECT.
    AwaitHelloOk,
    /// Streams may be opened.
    Ready,
    /// Ended; only the frames announcing why remain to be sent.
    Closed,
}

impl Phase {
    fn describe(self) -> &'static str {
        match self {
            Phase::AwaitHello => "awaiting HELLO",
            Phase::HelloReceived => "awaiting the relay's answer to HELLO",
            Phase::AwaitHelloOk => "awaiting HELLO_OK",
            Phase::Ready => "ready",
            Phase::Closed => "closed",
        }
    }
}

/// What the peer announced in the handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerSettings {
    /// Protocol version in use.
    pub version: u16,
    /// The window the peer grants each stream: what we may have in flight.
    pub window: u32,
    /// Concurrent streams the peer lets us open.
    pub max_streams: u32,
}

/// What the application must act on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// Relay: an agent said HELLO. Check `token`, then accept or reject.
    Hello(Hello),
    /// Agent: the relay accepted; streams may flow.
    Connected(PeerSettings),
    /// The peer opened a stream.
    Opened {
        /// The new stream.
        stream: StreamId,
        /// Its target, e.g. a database name.
        target: String,
    },
    /// Bytes are waiting on the stream. Sent once until the next
    /// [`Tunnel::handle_read`] of that stream.
    Readable(StreamId),
    /// The peer closed its side: after the buffered bytes, the stream ends.
    Finished(StreamId),
    /// The stream was aborted and removed; its buffered bytes are gone.
    Reset {
        /// The stream.
        stream: StreamId,
        /// Why.
        code: ErrorCode,
        /// The reason text.
        reason: String,
        /// Reset by the peer (`true`), or by this end because the peer broke a
        /// stream rule (`false`; the peer was sent a RESET saying which).
        remote: bool,
    },
    /// The peer is going away: open no new streams on this tunnel; the agent
    /// reconnects, existing streams finish.
    Drain,
}

/// The result of [`Tunnel::handle_read`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Read {
    /// Bytes, in order, at most the amount asked for.
    Data(Bytes),
    /// Nothing buffered yet; an [`Event::Readable`] will follow.
    Blocked,
    /// The peer closed its side and every byte has been read.
    Finished,
}

/// Counters of one tunnel, for operators.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TunnelStats {
    /// Streams open now (in either direction).
    pub streams_open: u64,
    /// Streams opened since the tunnel started.
    pub streams_opened: u64,
    /// OPENs from the peer refused (limit or draining).
    pub streams_refused: u64,
    /// DATA payload bytes sent.
    pub bytes_sent: u64,
    /// DATA payload bytes received.
    pub bytes_received: u64,
    /// Times a stream had bytes to send and no window.
    pub window_stalls: u64,
    /// Streams reset because the peer sent beyond their window.
    pub flow_violations: u64,
    /// Times auto-tuning doubled a stream's window.
    pub window_growths: u64,
    /// Times a window should have grown and the memory cap or the shared budget
    /// did not allow it.
    pub window_growths_refused: u64,
    /// Streams reset to keep receive memory under `memory_cap` or the shared
    /// budget (their reader was the slowest).
    pub streams_shed: u64,
    /// Receive memory charged now (unread bytes within base windows plus credit
    /// reserved by auto-tuning), in bytes.
    pub memory_charged: u64,
}

/// One end of a tunnel.
#[derive(Debug)]
pub struct Tunnel {
    role: Role,
    config: Config,
    phase: Phase,
    peer: Option<PeerSettings>,
    streams: HashMap<StreamId, Stream>,
    /// Next id this end opens; u64 so that running past `u32::MAX` is detectable.
    next_local_id: u64,
    /// Highest id the peer opened; ids at or below it of its parity are "closed"
    /// once gone from `streams`, ids above it "never opened".
    highest_peer_id: u32,
    /// Streams in `streams` opened by the peer / by us.
    peer_streams: u32,
    local_streams: u32,
    /// Frames sent before any WINDOW_UPDATE or DATA, in order.
    control: VecDeque<Frame>,
    /// Streams with credit to return.
    updates: VecDeque<StreamId>,
    /// Round robin of streams with DATA or CLOSE to send.
    ready: VecDeque<StreamId>,
    events: VecDeque<Event>,
    draining_local: bool,
    draining_peer: bool,
    last_recv: Instant,
    next_ping: Option<Instant>,
    ping_seq: u64,
    ping_out: Option<(u64, Instant)>,
    rtt: Option<Duration>,
    /// The latest `now` passed in: the time of reads ([`Tunnel::handle_read`] takes
    /// none) for auto-tuning.
    clock: Instant,
    /// What the streams charge to the caps: the sum of their `recv.charge()`.
    memory: u64,
    stats: TunnelStats,
}

impl Tunnel {
    /// The agent's end: queues HELLO with the organization token at once.
    ///
    /// # Panics
    ///
    /// If the token is longer than [`MAX_TEXT_LEN`], or `config.window` is 0;
    /// check configuration before building a tunnel.
    pub fn agent(config: Config, token: String, now: Instant) -> Tunnel {
        assert!(
            token.len() <= MAX_TEXT_LEN,
            "token over {MAX_TEXT_LEN} bytes"
        );
        let mut t = Tunnel::new(Role::Agent, config, Phase::AwaitHelloOk, now);
        t.control.push_back(Frame::Hello(Hello {
            version: PROTOCOL_VERSION,
            role: Role::Agent,
            window: t.config.window,
            max_streams: t.config.max_streams,
            token,
        }));
        t
    }

    /// The relay's end: waits for the agent's HELLO.
    ///
    /// # Panics
    ///
    /// If `config.window` is 0.
    pub fn relay(config: Config, now: Instant) -> Tunnel {
        Tunnel::new(Role::Relay, config, Phase::AwaitHello, now)
    }

    fn new(role: Role, mut config: Config, phase: Phase, now: Instant) -> Tunnel {
        assert!(config.window > 0, "window must be at least 1 byte");
        config.max_payload = config.max_payload.clamp(1, MAX_FRAME_BODY);
        Tunnel {
            role,
            config,
            phase,
            peer: None,
            streams: HashMap::new(),
            next_local_id: match role {
                Role::Relay => 1,
                Role::Agent => 2,
            },
            highest_peer_id: 0,
            peer_streams: 0,
            local_streams: 0,
            control: VecDeque::new(),
            updates: VecDeque::new(),
            ready: VecDeque::new(),
            events: VecDeque::new(),
            draining_local: false,
            draining_peer: false,
            last_recv: now,
            next_ping: None,
            ping_seq: 0,
            ping_out: None,
            rtt: None,
            clock: now,
            memory: 0,
            stats: TunnelStats::default(),
        }
    }

    /// Moves the tunnel's clock forward (never back).
    fn tick(&mut self, now: Instant) {
        if now > self.clock {
            self.clock = now;
        }
    }

    // ---- input: bytes and time ----

    /// Decodes and handles every whole frame at the front of `buf`, leaving a
    /// partial frame there for the next call.
    ///
    /// # Errors
    ///
    /// A [`TunnelError`] ends the tunnel: the driver flushes
    /// [`Tunnel::poll_transmit`] and closes the connection.
    pub fn handle_input(&mut self, now: Instant, buf: &mut BytesMut) -> Result<(), TunnelError> {
        if self.phase == Phase::Closed {
            return Err(TunnelError::Closed);
        }
        self.tick(now);
        if !buf.is_empty() {
            self.last_recv = now;
        }
        loop {
            let frame = match Frame::decode(buf) {
                Ok(Some(frame)) => frame,
                Ok(None) => return Ok(()),
                Err(e) => return Err(self.fail(e.into())),
            };
            if let Err(e) = self.on_frame(now, frame) {
                return Err(self.fail(e));
            }
        }
    }

    /// Fires the idle timeout and the keepalive PING.
    ///
    /// # Errors
    ///
    /// [`TunnelError::IdleTimeout`] when nothing was received for
    /// [`Config::idle_timeout`]; the tunnel has ended.
    pub fn handle_timeout(&mut self, now: Instant) -> Result<(), TunnelError> {
        if self.phase == Phase::Closed {
            return Ok(());
        }
        self.tick(now);
        self.shrink_idle_windows();
        if let Some(idle) = self.config.idle_timeout {
            if now.saturating_duration_since(self.last_recv) >= idle {
                return Err(self.fail(TunnelError::IdleTimeout { idle }));
            }
        }
        if let (Some(at), Some(every)) = (self.next_ping, self.config.keepalive) {
            if now >= at {
                self.ping_seq += 1;
                self.control
                    .push_back(Frame::Ping(self.ping_seq.to_be_bytes()));
                self.ping_out.get_or_insert((self.ping_seq, now));
                self.next_ping = Some(now + every);
            }
        }
        Ok(())
    }

    /// When [`Tunnel::handle_timeout`] must next be called, if ever.
    pub fn poll_timeout(&self) -> Option<Instant> {
        if self.phase == Phase::Closed {
            return None;
        }
        let idle = self.config.idle_timeout.map(|d| self.last_recv + d);
        match (idle, self.next_ping) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    // ---- output ----

    /// The next frame to send: control frames first (handshake, OPEN, RESET, PING,
    /// PONG, DRAIN, in order), then WINDOW_UPDATEs, then one DATA or CLOSE from the
    /// next stream in round robin.
    pub fn poll_frame(&mut self) -> Option<Frame> {
        if let Some(frame) = self.control.pop_front() {
            return Some(frame);
        }
        if self.phase != Phase::Ready {
            return None;
        }
        while let Some(stream) = self.updates.pop_front() {
            let Some(s) = self.streams.get_mut(&stream) else {
                continue;
            };
            s.recv.update_queued = false;
            if !s.state.can_receive() {
                continue; // the peer sends no more; credit would be wasted
            }
            let increment = s.recv.take_credit();
            if increment > 0 {
                return Some(Frame::WindowUpdate { stream, increment });
            }
        }
        while let Some(stream) = self.ready.pop_front() {
            let Some(s) = self.streams.get_mut(&stream) else {
                continue; // reset while scheduled
            };
            s.send.scheduled = false;
            if s.send.queued > 0 {
                let payload = s.send.take(self.config.max_payload as usize);
                if payload.is_empty() {
                    // No credit: counted as a stall, off the queue until WINDOW_UPDATE.
                    self.schedule(stream);
                    continue;
                }
                self.stats.bytes_sent += payload.len() as u64;
                // Back of the queue: every other ready stream sends one frame first.
                self.schedule(stream);
                return Some(Frame::Data { stream, payload });
            }
            if !s.state.can_send() && !s.send.fin_sent {
                s.send.fin_sent = true;
                self.remove_if_done(stream);
                return Some(Frame::Close { stream });
            }
        }
        None
    }

    /// Encodes frames from [`Tunnel::poll_frame`] into `out` until at least
    /// `max_bytes` were written or nothing is left. Returns the bytes written.
    pub fn poll_transmit(&mut self, out: &mut BytesMut, max_bytes: usize) -> usize {
        let start = out.len();
        while out.len() - start < max_bytes {
            let Some(frame) = self.poll_frame() else {
                break;
            };
            frame.encode(out);
        }
        out.len() - start
    }

    /// The next event for the application.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    // ---- state ----

    /// This end's role.
    pub fn role(&self) -> Role {
        self.role
    }

    /// Where the tunnel is in its life.
    pub fn phase(&self) -> Phase {
        self.phase
    }

    /// What the peer announced, once its HELLO or HELLO_OK arrived.
    pub fn peer(&self) -> Option<PeerSettings> {
        self.peer
    }

    /// The last round-trip time measured by a keepalive PING.
    pub fn rtt(&self) -> Option<Duration> {
        self.rtt
    }

    /// Whether either end announced DRAIN.
    pub fn is_draining(&self) -> bool {
        self.draining_local || self.draining_peer
    }

    /// The tunnel's counters.
    pub fn stats(&self) -> TunnelStats {
        TunnelStats {
            streams_open: self.streams.len() as u64,
            window_stalls: self.streams.values().map(|s| s.send.stalls).sum::<u64>()
                + self.stats.window_stalls,
            memory_charged: self.memory,
            ..self.stats
        }
    }

    /// A stream's counters, while it exists.
    pub fn stream_stats(&self, stream: StreamId) -> Option<StreamStats> {
        self.streams.get(&stream).map(Stream::stats)
    }

    /// A stream's state, while it exists.
    pub fn stream_state(&self, stream: StreamId) -> Option<StreamState> {
        self.streams.get(&stream).map(|s| s.state)
    }

    // ---- helpers ----

    fn expect_phase(&self, phase: Phase) -> Result<(), StreamError> {
        if self.phase != phase {
            return Err(StreamError::NotReady {
                phase: self.phase.describe(),
            });
        }
        Ok(())
    }

    fn peer_window(&self) -> u32 {
        self.peer.map_or(DEFAULT_WINDOW, |p| p.window)
    }

    /// Puts the stream at the back of the round robin if it has something to send;
    /// counts a stall if it has bytes and no window.
    fn schedule(&mut self, stream: StreamId) {
        let Some(s) = self.streams.get_mut(&stream) else {
            return;
        };
        if s.send.scheduled {
            return;
        }
        if s.wants_send() {
            s.send.scheduled = true;
            self.ready.push_back(stream);
        } else if s.send.queued > 0 && !s.send.stalled {
            s.send.stalled = true;
            s.send.stalls += 1;
        }
    }

    fn remove(&mut self, stream: StreamId) -> Option<Stream> {
        let mut s = self.streams.remove(&stream)?;
        s.send.discard();
        if s.remote {
            self.peer_streams -= 1;
        } else {
            self.local_streams -= 1;
        }
        // Keep the stalls of removed streams in the tunnel's total.
        self.stats.window_stalls += s.send.stalls;
        self.uncharge(s.recv.charge());
        Some(s)
    }

    fn remove_if_done(&mut self, stream: StreamId) {
        if self.streams.get(&stream).is_some_and(Stream::is_done) {
            self.remove(stream);
        }
    }
}

/// Gives the receive memory of the streams still here back to the shared budget.
impl Drop for Tunnel {
    fn drop(&mut self) {
        if let Some(budget) = &self.config.memory_budget {
            budget.release(self.streams.values().map(|s| s.recv.charge()).sum());
        }
    }
}

#[cfg(test)]
#[path = "flow_test.rs"]
mod tests;

#[cfg(test)]
#[path = "flow_auto_test.rs"]
mod auto_tests;

#[cfg(test)]
#[path = "flow_proptest.rs"]
mod proptests;
