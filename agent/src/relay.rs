//! One relay's thread: keeps a tunnel to it, for ever.
//!
//! The thread owns a small list of sessions: the current one, plus tunnels the relay
//! drains (a relay being replaced sends DRAIN: the agent dials a new tunnel at once,
//! and the old one carries its streams until they end). When the current session
//! ends (relay gone, link cut, idle timeout, rejection) the next dial waits a
//! jittered backoff ([`Backoff`]), reset after every successful handshake.
//!
//! Everything is one `poll(2)` loop over non-blocking sockets: each session's relay
//! connection and its streams' Postgres connections.

use std::sync::{Arc, Once};
use std::time::{Duration, Instant};

use lokadb_shared::tunnel::TunnelStats;
use tracing::{debug, error, info};

use crate::backoff::{self, Backoff, FIRST_DELAY, MAX_DELAY};
use crate::config::{AgentConfig, Relay};
use crate::poller::Poller;
use crate::session::{End, Notice, Session, Token};

/// How often the counters are logged (when they changed).
const SUMMARY_EVERY: Duration = Duration::from_secs(60);
/// A failure repeated within this time is logged at debug only.
const REPEAT_QUIET: Duration = Duration::from_secs(60);

/// The first tunnel up, in any thread, prints the line scripts wait for.
static ANNOUNCED: Once = Once::new();

/// Runs the loop for `relay`; never returns.
pub fn run(relay: Relay, config: Arc<AgentConfig>, salt: u64) -> ! {
    let now = Instant::now();
    let mut r = RelayLoop {
        label: relay.addr.to_string(),
        relay,
        config,
        sessions: Vec::new(),
        next_dial: Some(now),
        backoff: Backoff::new(FIRST_DELAY, MAX_DELAY, backoff::seed(salt)),
        poller: Poller::new(),
        failures: Failures::default(),
        summary: Summary::new(now),
    };
    loop {
        r.turn();
    }
}

struct RelayLoop {
    relay: Relay,
    label: String,
    config: Arc<AgentConfig>,
    /// The current session (not draining) and the draining ones.
    sessions: Vec<Session>,
    /// When to dial, if there is no current session.
    next_dial: Option<Instant>,
    backoff: Backoff,
    poller: Poller<Token>,
    failures: Failures,
    summary: Summary,
}

impl RelayLoop {
    fn turn(&mut self) {
        let now = Instant::now();
        if self.next_dial.is_some_and(|at| at <= now) {
            self.next_dial = None;
            self.dial(now);
        }
        self.poller.clear();
        for (i, s) in self.sessions.iter().enumerate() {
            s.register(i, &mut self.poller);
        }
        let deadline = self
            .sessions
            .iter()
            .filter_map(Session::poll_timeout)
            .chain(self.next_dial)
            .chain([self.summary.next_at])
            .min();
        if let Err(e) = self.poller.wait(deadline) {
            error!(relay = %self.label, "poll failed: {e}");
            std::thread::sleep(Duration::from_millis(100));
        }
        let now = Instant::now();
        for (token, ready) in self.poller.ready() {
            match token {
                Token::Tunnel(i) => self.sessions[i].on_tunnel_ready(ready, now),
                Token::Stream(i, stream) => self.sessions[i].on_stream_ready(stream, ready),
            }
        }
        for s in &mut self.sessions {
            s.advance(now);
        }
        self.settle(now);
        self.summary.maybe_log(now, &self.label, &self.sessions);
    }

    fn dial(&mut self, now: Instant) {
        debug!(relay = %self.label, "dialing the relay");
        match Session::dial(&self.relay, &self.config, now) {
            Ok(s) => self.sessions.push(s),
            Err(e) => {
                let delay = self.backoff.next_delay();
                self.next_dial = Some(now + delay);
                let msg = format!(
                    "could not connect to relay {}: {}",
                    self.label,
                    crate::net::describe(&e)
                );
                self.failures.report(false, msg, delay, now);
            }
        }
    }

    /// Acts on what the sessions reported; drops the ones that ended.
    fn settle(&mut self, now: Instant) {
        let mut i = 0;
        while i < self.sessions.len() {
            for notice in self.sessions[i].take_notices() {
                match notice {
                    Notice::Connected(peer) => {
                        info!(
                            relay = %self.label,
                            window = peer.window,
                            max_streams = peer.max_streams,
                            "connected to relay {}", self.label
                        );
                        self.backoff.reset();
                        self.failures = Failures::default();
                        ANNOUNCED.call_once(|| {
                            use std::io::Write;
                            let mut out = std::io::stdout().lock();
                            let _ = writeln!(out, "lokadb-agent connected to {}", self.label);
                            let _ = out.flush();
                        });
                    }
                    Notice::Drain => {
                        info!(
                            relay = %self.label,
                            streams = self.sessions[i].streams(),
                            "relay {} is draining this tunnel: dialing a new one, open streams finish on the old one",
                            self.label
                        );
                        self.next_dial = Some(now);
                    }
                }
            }
            if self.sessions[i].end().is_none() {
                i += 1;
                continue;
            }
            let s = self.sessions.remove(i);
            self.summary.retire(s.stats());
            self.ended(s, now);
        }
    }

    fn ended(&mut self, s: Session, now: Instant) {
        let end = s.end().expect("ended session");
        if s.is_draining() {
            match end {
                End::Drained => {
                    info!(relay = %self.label, "drained tunnel to relay {} closed: its streams ended", self.label)
                }
                _ => {
                    info!(relay = %self.label, "drained tunnel to relay {} ended: {end}", self.label)
                }
            }
            return;
        }
        let delay = self.backoff.next_delay();
        self.next_dial = Some(now + delay);
        if let Some((code, reason)) = end.rejection() {
            let msg = format!("relay {} refused this agent ({code}): {reason}", self.label);
            self.failures.report(true, msg, delay, now);
        } else if s.is_connected() {
            info!(
                relay = %self.label,
                "tunnel to relay {} lost: {end}; reconnecting in {} ms", self.label, delay.as_millis()
            );
        } else {
            let msg = format!("could not connect to relay {}: {end}", self.label);
            self.failures.report(false, msg, delay, now);
        }
    }
}

/// Logs failures, quietly while the same one repeats (an agent retries every
/// second or so for as long as a relay is down or refuses it).
#[derive(Default)]
struct Failures {
    last: Option<String>,
    repeats: u64,
    logged_at: Option<Instant>,
}

impl Failures {
    /// `rejected`: the relay refused the agent, logged at error level; other failures
    /// are logged at info.
    fn report(&mut self, rejected: bool, msg: String, delay: Duration, now: Instant) {
        let retry = delay.as_millis();
        let recent = self
            .logged_at
            .is_some_and(|at| now.saturating_duration_since(at) < REPEAT_QUIET);
        if recent && self.last.as_deref() == Some(msg.as_str()) {
            self.repeats += 1;
            debug!("{msg}; retrying in {retry} ms");
            return;
        }
        let again = match self.repeats {
            0 => String::new(),
            n => format!(" (failed {n} more times since the last report)"),
        };
        if rejected {
            error!("{msg}; retrying in {retry} ms{again}");
        } else {
            info!("{msg}; retrying in {retry} ms{again}");
        }
        self.last = Some(msg);
        self.repeats = 0;
        self.logged_at = Some(now);
    }
}

/// The counters logged every minute, if they changed.
struct Summary {
    next_at: Instant,
    /// Counters of the tunnels that ended.
    retired: TunnelStats,
    last: TunnelStats,
}

impl Summary {
    fn new(now: Instant) -> Summary {
        Summary {
            next_at: now + SUMMARY_EVERY,
            retired: TunnelStats::default(),
            last: TunnelStats::default(),
        }
    }

    fn retire(&mut self, s: TunnelStats) {
        add(&mut self.retired, &s);
        self.retired.streams_open = 0;
    }

    fn maybe_log(&mut self, now: Instant, label: &str, sessions: &[Session]) {
        if now < self.next_at {
            return;
        }
        self.next_at = now + SUMMARY_EVERY;
        let mut total = self.retired;
        for s in sessions {
            add(&mut total, &s.stats());
        }
        if total != self.last {
            info!(
                relay = %label,
                "{} streams open, {} opened, {} refused, {} bytes to the relay, {} bytes from it",
                total.streams_open,
                total.streams_opened,
                total.streams_refused,
                total.bytes_sent,
                total.bytes_received
            );
            self.last = total;
        }
    }
}

fn add(total: &mut TunnelStats, s: &TunnelStats) {
    total.streams_open += s.streams_open;
    total.streams_opened += s.streams_opened;
    total.streams_refused += s.streams_refused;
    total.bytes_sent += s.bytes_sent;
    total.bytes_received += s.bytes_received;
    total.window_stalls += s.window_stalls;
    total.flow_violations += s.flow_violations;
    total.window_growths += s.window_growths;
    total.window_growths_refused += s.window_growths_refused;
    total.streams_shed += s.streams_shed;
}
