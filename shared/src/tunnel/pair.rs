//! Two tunnel ends connected in memory, for tests (after quinn's `tests/util.rs`
//! `Pair`). Bytes, not frames, cross between them, so every test also runs the codec,
//! and [`Pair::step`] can deliver a frame in pieces.

use std::time::Instant;

use bytes::BytesMut;

use super::{Config, Event, Tunnel, TunnelError};

/// One end and the bytes around it.
pub(super) struct End {
    pub(super) tunnel: Tunnel,
    /// Encoded by this end, not yet delivered to the other.
    wire: BytesMut,
    /// Delivered to this end, not yet decoded (a partial frame).
    input: BytesMut,
    /// Every event this end reported, in order.
    pub(super) events: Vec<Event>,
}

impl End {
    fn new(tunnel: Tunnel) -> End {
        End {
            tunnel,
            wire: BytesMut::new(),
            input: BytesMut::new(),
            events: Vec::new(),
        }
    }

    /// Takes the events reported so far.
    pub(super) fn take_events(&mut self) -> Vec<Event> {
        while let Some(e) = self.tunnel.poll_event() {
            self.events.push(e);
        }
        std::mem::take(&mut self.events)
    }
}

/// Which end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Side {
    Relay,
    Agent,
}

pub(super) struct Pair {
    pub(super) now: Instant,
    ends: [End; 2],
}

pub(super) const TOKEN: &str = "org-42-token";

impl Pair {
    /// A pair whose handshake is done and whose handshake events are consumed.
    pub(super) fn new(relay: Config, agent: Config) -> Pair {
        let mut pair = Pair::unaccepted(relay, agent);
        pair.step(Side::Agent, usize::MAX).unwrap();
        match &pair.relay().take_events()[..] {
            [Event::Hello(h)] => assert_eq!(h.token, TOKEN),
            other => panic!("relay events after HELLO: {other:?}"),
        }
        let now = pair.now;
        pair.relay().tunnel.handle_accept(now).unwrap();
        pair.step(Side::Relay, usize::MAX).unwrap();
        match &pair.agent().take_events()[..] {
            [Event::Connected(_)] => {}
            other => panic!("agent events after HELLO_OK: {other:?}"),
        }
        pair
    }

    /// A pair whose agent has queued HELLO and nothing more.
    pub(super) fn unaccepted(relay: Config, agent: Config) -> Pair {
        let now = Instant::now();
        Pair {
            now,
            ends: [
                End::new(Tunnel::relay(relay, now)),
                End::new(Tunnel::agent(agent, TOKEN.to_owned(), now)),
            ],
        }
    }

    pub(super) fn end(&mut self, side: Side) -> &mut End {
        &mut self.ends[side as usize]
    }

    pub(super) fn relay(&mut self) -> &mut End {
        self.end(Side::Relay)
    }

    pub(super) fn agent(&mut self) -> &mut End {
        self.end(Side::Agent)
    }

    /// Encodes everything `from` has to send, then delivers at most `max` of the
    /// bytes waiting on its wire to the other end. Returns the bytes delivered.
    ///
    /// # Errors
    ///
    /// The receiving end's [`TunnelError`].
    pub(super) fn step(&mut self, from: Side, max: usize) -> Result<usize, TunnelError> {
        let now = self.now;
        let [relay, agent] = &mut self.ends;
        let (src, dst) = match from {
            Side::Relay => (relay, agent),
            Side::Agent => (agent, relay),
        };
        src.tunnel.poll_transmit(&mut src.wire, usize::MAX);
        let n = max.min(src.wire.len());
        dst.input.extend_from_slice(&src.wire.split_to(n));
        let result = dst.tunnel.handle_input(now, &mut dst.input);
        while let Some(e) = dst.tunnel.poll_event() {
            dst.events.push(e);
        }
        result.map(|()| n)
    }

    /// Encodes what `from` has to send and takes at most `max` bytes of it off its
    /// wire, for a simulated link that delivers them later ([`Pair::deliver`]).
    /// Frames are pulled from the tunnel only as the link takes them, so the backlog
    /// stays in the tunnel, where control frames (PING, PONG) jump the DATA queue.
    pub(super) fn take_wire(&mut self, from: Side, max: usize) -> BytesMut {
        let src = self.end(from);
        if src.wire.len() < max {
            let want = max - src.wire.len();
            src.tunnel.poll_transmit(&mut src.wire, want);
        }
        let n = max.min(src.wire.len());
        src.wire.split_to(n)
    }

    /// Hands `bytes` to `to` at `self.now`.
    ///
    /// # Errors
    ///
    /// The receiving end's [`TunnelError`].
    pub(super) fn deliver(&mut self, to: Side, bytes: &[u8]) -> Result<(), TunnelError> {
        let now = self.now;
        let dst = self.end(to);
        dst.input.extend_from_slice(bytes);
        let result = dst.tunnel.handle_input(now, &mut dst.input);
        while let Some(e) = dst.tunnel.poll_event() {
            dst.events.push(e);
        }
        result
    }

    /// Shuttles bytes both ways until neither end has anything to send.
    ///
    /// # Panics
    ///
    /// On a tunnel error at either end.
    pub(super) fn drive(&mut self) {
        loop {
            let a = self.step(Side::Relay, usize::MAX).expect("agent failed");
            let b = self.step(Side::Agent, usize::MAX).expect("relay failed");
            if a == 0 && b == 0 {
                return;
            }
        }
    }
}
