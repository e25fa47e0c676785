//! Random operation sequences on two connected ends (after quinn's
//! `tests/proptest.rs`), checked against a model of what each stream must deliver.

use bytes::Bytes;
use proptest::prelude::*;

use super::super::frame::tests::frame_strategy;
use super::super::memory::{AutoWindow, MemoryBudget};
use super::super::pair::{Pair, Side};
use super::*;

const MAX_STREAMS: usize = 6;

#[derive(Debug, Clone)]
enum Op {
    Open,
    Write {
        stream: usize,
        side: Side,
        len: usize,
    },
    Read {
        stream: usize,
        side: Side,
        max: usize,
    },
    Close {
        stream: usize,
        side: Side,
    },
    Reset {
        stream: usize,
        side: Side,
    },
    /// Deliver at most `max` bytes one way: frames arrive in pieces.
    Deliver {
        from: Side,
        max: usize,
    },
    Drive,
    /// Move the clock: keepalives (and so RTT samples) and idle-window shrinking.
    Tick {
        ms: u64,
    },
}

fn side() -> impl Strategy<Value = Side> {
    prop_oneof![Just(Side::Relay), Just(Side::Agent)]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        1 => Just(Op::Open),
        4 => (any::<usize>(), side(), 1..5000usize)
            .prop_map(|(stream, side, len)| Op::Write { stream, side, len }),
        4 => (any::<usize>(), side(), 1..8000usize)
            .prop_map(|(stream, side, max)| Op::Read { stream, side, max }),
        1 => (any::<usize>(), side()).prop_map(|(stream, side)| Op::Close { stream, side }),
        1 => (any::<usize>(), side()).prop_map(|(stream, side)| Op::Reset { stream, side }),
        3 => (side(), 1..3000usize).prop_map(|(from, max)| Op::Deliver { from, max }),
        2 => Just(Op::Drive),
        2 => (1..40u64).prop_map(|ms| Op::Tick { ms }),
    ]
}

fn other(side: Side) -> Side {
    match side {
        Side::Relay => Side::Agent,
        Side::Agent => Side::Relay,
    }
}

/// The byte at `offset` of the data `writer` sends on stream number `idx`, so that
/// every received byte can be checked for order without keeping what was sent.
fn byte(idx: usize, writer: Side, offset: u64) -> u8 {
    ((offset * 31 + idx as u64 * 7 + writer as u64 * 101) % 251) as u8
}

/// One direction of a stream, indexed by its writer.
#[derive(Debug, Default, Clone)]
struct Dir {
    written: u64,
    read: u64,
    write_closed: bool,
    finished_read: bool,
}

#[derive(Debug)]
struct ModelStream {
    id: StreamId,
    dirs: [Dir; 2],
    /// Who reset it, and whether the peer still had the stream at that moment.
    reset: Option<(Side, bool)>,
    reset_seen_by: [bool; 2],
    /// The agent has seen `Event::Opened`; until then the stream is unknown to it.
    opened_at_agent: bool,
}

struct Harness {
    pair: Pair,
    streams: Vec<ModelStream>,
    /// The largest window each end may grant (its auto-tuning maximum, or its window).
    windows: [u64; 2],
    /// Each end's `memory_cap`, and the budget both share, if any.
    caps: [Option<u64>; 2],
    budget: Option<MemoryBudget>,
}

impl Harness {
    fn tunnel(&mut self, side: Side) -> &mut Tunnel {
        &mut self.pair.end(side).tunnel
    }

    fn pick(&self, i: &usize) -> Option<usize> {
        (!self.streams.is_empty()).then(|| i % self.streams.len())
    }

    fn apply(&mut self, op: &Op) {
        if self.not_yet_opened(op) {
            self.check();
            return;
        }
        match op {
            Op::Open => {
                if self.streams.len() < MAX_STREAMS {
                    let target = format!("db{}", self.streams.len());
                    let id = self.tunnel(Side::Relay).handle_open(&target).unwrap();
                    self.streams.push(ModelStream {
                        id,
                        dirs: Default::default(),
                        reset: None,
                        reset_seen_by: [false; 2],
                        opened_at_agent: false,
                    });
                }
            }
            Op::Write { stream, side, len } => {
                let Some(i) = self.pick(stream) else { return };
                let (id, dir) = (
                    self.streams[i].id,
                    self.streams[i].dirs[*side as usize].clone(),
                );
                let data: Vec<u8> = (0..*len as u64)
                    .map(|k| byte(i, *side, dir.written + k))
                    .collect();
                let result = self.tunnel(*side).handle_write(id, Bytes::from(data));
                let reset = self.streams[i].reset.is_some();
                let dir = &mut self.streams[i].dirs[*side as usize];
                match result {
                    Ok(()) => {
                        assert!(!dir.write_closed, "write after close accepted");
                        dir.written += *len as u64;
                    }
                    // A reset stream may still exist locally until the RESET arrives.
                    Err(e) => assert!(reset || dir.write_closed, "write refused: {e}"),
                }
            }
            Op::Read { stream, side, max } => {
                if let Some(i) = self.pick(stream) {
                    self.read(i, *side, *max);
                }
            }
            Op::Close { stream, side } => {
                if let Some(i) = self.pick(stream) {
                    self.close(i, *side);
                }
            }
            Op::Reset { stream, side } => {
                let Some(i) = self.pick(stream) else { return };
                let id = self.streams[i].id;
                let result =
                    self.tunnel(*side)
                        .handle_reset(id, ErrorCode::CANCEL, "test reset".into());
                if result.is_ok() {
                    if self.streams[i].reset.is_none() {
                        let peer_had = self.tunnel(other(*side)).stream_state(id).is_some();
                        self.streams[i].reset = Some((*side, peer_had));
                    }
                    // Both ends reset: each knows without hearing from the other.
                    self.streams[i].reset_seen_by[*side as usize] = true;
                }
            }
            Op::Deliver { from, max } => {
                self.pair.step(*from, *max).unwrap();
            }
            Op::Drive => self.pair.drive(),
            Op::Tick { ms } => {
                self.pair.now += std::time::Duration::from_millis(*ms);
                let now = self.pair.now;
                for side in [Side::Relay, Side::Agent] {
                    self.tunnel(side).handle_timeout(now).unwrap();
                }
            }
        }
        self.check();
    }

    /// An operation on the agent's side of a stream whose OPEN has not arrived:
    /// the agent must not know the stream. Returns whether that was the case.
    fn not_yet_opened(&mut self, op: &Op) -> bool {
        let (Op::Write { stream, side, .. }
        | Op::Read { stream, side, .. }
        | Op::Close { stream, side }
        | Op::Reset { stream, side }) = op
        else {
            return false;
        };
        let Some(i) = self.pick(stream) else {
            return false;
        };
        if *side != Side::Agent || self.streams[i].opened_at_agent {
            return false;
        }
        let id = self.streams[i].id;
        let agent = self.tunnel(Side::Agent);
        assert_eq!(agent.stream_state(id), None);
        assert_eq!(agent.handle_read(id, 1), Err(StreamError::Unknown(id)));
        assert_eq!(agent.handle_close(id), Err(StreamError::Unknown(id)));
        true
    }

    fn close(&mut self, i: usize, side: Side) {
        let id = self.streams[i].id;
        let result = self.tunnel(side).handle_close(id);
        let reset = self.streams[i].reset.is_some();
        let dir = &mut self.streams[i].dirs[side as usize];
        match result {
            Ok(()) => {
                assert!(!dir.write_closed, "second close accepted");
                dir.write_closed = true;
            }
            Err(e) => assert!(reset || dir.write_closed, "close refused: {e}"),
        }
    }

    /// Reads stream `i` on `side` once; returns whether anything happened.
    fn read(&mut self, i: usize, side: Side, max: usize) -> bool {
        let id = self.streams[i].id;
        let writer = other(side) as usize;
        let result = self.tunnel(side).handle_read(id, max);
        let s = &mut self.streams[i];
        let reset = s.reset.is_some();
        let done_here = s.dirs[side as usize].write_closed && s.dirs[writer].finished_read;
        let dir = &mut s.dirs[writer];
        match result {
            Ok(Read::Data(d)) => {
                assert!(!d.is_empty() && d.len() <= max);
                for (k, b) in d.iter().enumerate() {
                    let expect = byte(i, other(side), dir.read + k as u64);
                    assert_eq!(*b, expect, "stream {i} byte {} out of order", dir.read);
                }
                dir.read += d.len() as u64;
                true
            }
            Ok(Read::Finished) => {
                if !reset {
                    assert!(dir.write_closed, "finished before the writer closed");
                    assert_eq!(dir.read, dir.written, "finished with bytes missing");
                }
                let first = !dir.finished_read;
                dir.finished_read = true;
                first
            }
            // After a reset, reads may fail; only order and the end are checked.
            _ if reset => false,
            Ok(Read::Blocked) => false,
            Err(StreamError::Unknown(_)) if done_here => false,
            Err(e) => panic!("read of a live stream failed: {e}"),
        }
    }

    /// After every operation: the window holds from the sender's counters, the
    /// receiver never buffers past its window, memory stays under the caps, and no
    /// honest end resets a stream except to shed it under a cap.
    fn check(&mut self) {
        for side in [Side::Relay, Side::Agent] {
            for e in self.pair.end(side).take_events() {
                match e {
                    Event::Reset {
                        stream,
                        remote,
                        code,
                        reason,
                    } => {
                        let capped = self.caps[side as usize].is_some() || self.budget.is_some();
                        let shed = code == ErrorCode::FLOW_CONTROL && reason.contains("too slow");
                        assert!(
                            remote || (capped && shed),
                            "{side:?} reset {stream} itself ({code}: {reason})"
                        );
                        let peer_had = self.tunnel(other(side)).stream_state(stream).is_some();
                        let s = self.streams.iter_mut().find(|s| s.id == stream).unwrap();
                        if !remote && s.reset.is_none() {
                            s.reset = Some((side, peer_had));
                        }
                        s.reset_seen_by[side as usize] = true;
                    }
                    Event::Opened { stream, target } => {
                        let i = self.streams.iter().position(|s| s.id == stream).unwrap();
                        assert_eq!(target, format!("db{i}"));
                        self.streams[i].opened_at_agent = true;
                    }
                    _ => {}
                }
            }
        }
        for s in &self.streams {
            for writer in [Side::Relay, Side::Agent] {
                let reader = other(writer);
                let window = self.windows[reader as usize];
                let read = s.dirs[writer as usize].read;
                let tx = self.pair.end(writer).tunnel.stream_stats(s.id);
                let rx = self.pair.end(reader).tunnel.stream_stats(s.id);
                if let Some(st) = tx {
                    assert!(st.sent <= st.send_limit);
                    assert!(
                        st.sent <= read + window,
                        "{} bytes sent, {read} read, window {window}",
                        st.sent
                    );
                }
                if let Some(st) = rx {
                    assert!(st.buffered <= window);
                    assert!(st.received <= st.recv_limit);
                    assert!(st.window <= window);
                    assert!(st.recv_limit - st.consumed <= window, "{st:?}");
                }
                if let (Some(tx), Some(rx)) = (tx, rx) {
                    // In flight: never more than the receiver granted.
                    assert!(tx.send_limit <= rx.recv_limit, "{tx:?} {rx:?}");
                }
            }
        }
        for side in [Side::Relay, Side::Agent] {
            let charged = self.pair.end(side).tunnel.stats().memory_charged;
            if let Some(cap) = self.caps[side as usize] {
                assert!(
                    charged <= cap,
                    "{side:?} charges {charged} over its cap {cap}"
                );
            }
        }
        if let Some(b) = &self.budget {
            assert!(b.used() <= b.capacity());
        }
    }

    /// Closes every live stream, then drives and reads until nothing moves.
    fn finish(&mut self) {
        self.pair.drive();
        self.check();
        for i in 0..self.streams.len() {
            for side in [Side::Relay, Side::Agent] {
                if self.streams[i].reset.is_none()
                    && !self.streams[i].dirs[side as usize].write_closed
                {
                    self.close(i, side);
                }
            }
        }
        loop {
            self.pair.drive();
            // Driving may shed a stream under a cap: its reset is noted before the
            // reads, which would otherwise take it for a live stream gone missing.
            self.check();
            let mut progress = false;
            for i in 0..self.streams.len() {
                for side in [Side::Relay, Side::Agent] {
                    while self.read(i, side, usize::MAX) {
                        progress = true;
                    }
                }
            }
            self.check();
            if !progress {
                break;
            }
        }
    }
}

fn run(ops: &[Op], windows: [u32; 2], max_payload: u32) {
    let cfg = |window| Config {
        window,
        max_streams: MAX_STREAMS as u32,
        max_payload,
        keepalive: None,
        idle_timeout: None,
        ..Config::default()
    };
    run_with(ops, [cfg(windows[0]), cfg(windows[1])]);
}

fn run_with(ops: &[Op], cfgs: [Config; 2]) {
    let largest = |c: &Config| u64::from(c.auto_window.map_or(c.window, |a| a.max.max(c.window)));
    let budget = cfgs[0]
        .memory_budget
        .clone()
        .or_else(|| cfgs[1].memory_budget.clone());
    let mut h = Harness {
        windows: [largest(&cfgs[0]), largest(&cfgs[1])],
        caps: [cfgs[0].memory_cap, cfgs[1].memory_cap],
        budget: budget.clone(),
        pair: Pair::new(cfgs[0].clone(), cfgs[1].clone()),
        streams: Vec::new(),
    };
    for op in ops {
        h.apply(op);
    }
    h.finish();
    for (i, s) in h.streams.iter().enumerate() {
        for side in [Side::Relay, Side::Agent] {
            assert_eq!(
                h.pair.end(side).tunnel.stream_state(s.id),
                None,
                "stream {i} left open on {side:?}: {s:?}"
            );
        }
        match s.reset {
            None => {
                for d in &s.dirs {
                    assert!(d.finished_read);
                    assert_eq!(d.read, d.written, "stream {i}: {s:?}");
                }
            }
            Some((by, peer_had)) => {
                let peer = other(by) as usize;
                // The peer learns of the reset, unless it had already finished the
                // stream cleanly before the RESET arrived.
                let clean = s.dirs[peer].write_closed && s.dirs[by as usize].finished_read;
                assert!(
                    !peer_had || s.reset_seen_by[peer] || clean,
                    "stream {i}: reset not observed: {s:?}"
                );
            }
        }
    }
    for side in [Side::Relay, Side::Agent] {
        assert_eq!(h.pair.end(side).tunnel.stats().memory_charged, 0);
    }
    if let Some(b) = budget {
        assert_eq!(b.used(), 0, "memory not given back");
    }
}

/// Moves a frame's stream id into 1..=8 (stream frames) so that random frames hit
/// the streams a test opened, not only ids never seen.
fn near(frame: Frame) -> Frame {
    let id = |s: StreamId| StreamId(s.0 % 8 + 1);
    match frame {
        Frame::Open { stream, target } => Frame::Open {
            stream: id(stream),
            target,
        },
        Frame::Data { stream, payload } => Frame::Data {
            stream: id(stream),
            payload,
        },
        Frame::WindowUpdate { stream, increment } => Frame::WindowUpdate {
            stream: id(stream),
            increment,
        },
        Frame::Close { stream } => Frame::Close { stream: id(stream) },
        Frame::Reset {
            stream,
            code,
            reason,
        } if !stream.is_tunnel() => Frame::Reset {
            stream: id(stream),
            code,
            reason,
        },
        other => other,
    }
}

fn window() -> impl Strategy<Value = u32> {
    prop_oneof![
        Just(1),
        Just(7),
        50..2000u32,
        Just(65536),
        Just(DEFAULT_WINDOW)
    ]
}

proptest! {
    // Failures are frozen as `regression_*` tests below, not in a seed file.
    #![proptest_config(ProptestConfig {
        cases: 128,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    /// The same with window auto-tuning, per-tunnel caps and a budget shared by
    /// both ends: windows grow and shrink, slow readers may be shed, and still
    /// nothing is in flight beyond what the receiver granted, memory stays under
    /// the caps, and every byte reserved is given back.
    #[test]
    fn random_operations_with_auto_tuning_and_memory_caps(
        ops in proptest::collection::vec(op(), 1..80),
        windows in (window(), window()),
        growth in (1..64u32, 1..64u32),
        caps in (
            proptest::option::of(1..20_000u64),
            proptest::option::of(1..20_000u64),
            proptest::option::of(1..40_000u64),
        ),
        max_payload in prop_oneof![Just(1u32), 2..5000u32, Just(MAX_FRAME_BODY)],
    ) {
        let budget = caps.2.map(MemoryBudget::new);
        let cfg = |window: u32, growth: u32, cap| Config {
            window,
            max_streams: MAX_STREAMS as u32,
            max_payload,
            keepalive: Some(std::time::Duration::from_millis(5)),
            idle_timeout: None,
            auto_window: Some(AutoWindow { max: window.saturating_mul(growth) }),
            memory_cap: cap,
            memory_budget: budget.clone(),
        };
        run_with(
            &ops,
            [cfg(windows.0, growth.0, caps.0), cfg(windows.1, growth.1, caps.1)],
        );
    }

    #[test]
    fn random_operations_deliver_every_byte_in_order(
        ops in proptest::collection::vec(op(), 1..60),
        windows in (window(), window()),
        max_payload in prop_oneof![Just(1u32), 2..5000u32, Just(MAX_FRAME_BODY)],
    ) {
        run(&ops, [windows.0, windows.1], max_payload);
    }

    /// Any sequence of well-formed frames from a hostile peer, on a tunnel with open
    /// streams: no panic; the end either stays ready or ends with an error, and what
    /// it queues for the peer stays bounded.
    #[test]
    fn arbitrary_frames_never_panic_a_ready_end(
        frames in proptest::collection::vec(frame_strategy().prop_map(near), 0..40),
        side in side(),
    ) {
        let cfg = Config { window: 64, max_streams: 3, ..Config::default() };
        let mut p = Pair::new(cfg.clone(), cfg);
        for _ in 0..2 {
            let s = p.end(Side::Relay).tunnel.handle_open("db").unwrap();
            p.end(Side::Relay).tunnel.handle_write(s, Bytes::from_static(b"x")).unwrap();
        }
        p.drive();
        let now = p.now;
        let t = &mut p.end(side).tunnel;
        let mut wire = bytes::BytesMut::new();
        for f in &frames {
            f.encode(&mut wire);
        }
        let result = t.handle_input(now, &mut wire);
        prop_assert_eq!(result.is_ok(), t.phase() == Phase::Ready);
        prop_assert!(t.stats().streams_open <= 2 + 3);
        let queued = std::iter::from_fn(|| t.poll_frame()).count();
        prop_assert!(queued <= 2 * frames.len() + 8, "{} frames queued", queued);
    }

    /// A stream whose reader never reads holds exactly one window, and another
    /// stream still delivers everything.
    #[test]
    fn a_stuck_reader_never_blocks_another_stream(
        window in 1000..200_000u32,
        max_payload in 1000..=MAX_FRAME_BODY,
        stuck_len in 0..400_000usize,
        busy_len in 1..400_000usize,
    ) {
        let cfg = Config {
            window,
            max_payload,
            keepalive: None,
            idle_timeout: None,
            ..Config::default()
        };
        let mut p = Pair::new(cfg.clone(), cfg);
        let relay = &mut p.end(Side::Relay).tunnel;
        let stuck = relay.handle_open("stuck").unwrap();
        let busy = relay.handle_open("busy").unwrap();
        let stuck_data: Vec<u8> = (0..stuck_len).map(|k| byte(0, Side::Relay, k as u64)).collect();
        let busy_data: Vec<u8> = (0..busy_len).map(|k| byte(1, Side::Relay, k as u64)).collect();
        relay.handle_write(stuck, Bytes::from(stuck_data)).unwrap();
        relay.handle_write(busy, Bytes::from(busy_data.clone())).unwrap();
        relay.handle_close(busy).unwrap();
        let mut got = Vec::with_capacity(busy_len);
        loop {
            p.drive();
            match p.end(Side::Agent).tunnel.handle_read(busy, usize::MAX).unwrap() {
                Read::Data(d) => got.extend_from_slice(&d),
                Read::Finished => break,
                Read::Blocked => panic!("busy stream stalled after {} bytes", got.len()),
            }
        }
        prop_assert_eq!(got, busy_data);
        let in_flight = stuck_len.min(window as usize) as u64;
        let sender = p.end(Side::Relay).tunnel.stream_stats(stuck).unwrap();
        prop_assert_eq!(sender.sent, in_flight);
        prop_assert_eq!(sender.queued, stuck_len as u64 - in_flight);
        let receiver = p.end(Side::Agent).tunnel.stream_stats(stuck).unwrap();
        prop_assert_eq!(receiver.buffered, in_flight);
    }
}

/// Found by proptest (seed replaced by the case itself): operations on the agent's
/// side of streams whose OPEN had not arrived. The harness now checks that the agent
/// does not know such streams.
#[test]
fn regression_agent_ops_before_open_arrives() {
    run(&[Op::Open, Op::Open], [1, 1], 1);
}

/// Found by proptest: the relay reset a stream both ends had closed; the agent read
/// to the end before the RESET arrived, so it finished cleanly and ignored the RESET.
#[test]
fn regression_reset_after_both_closed() {
    let ops = [
        Op::Open,
        Op::Close {
            stream: 0,
            side: Side::Relay,
        },
        Op::Deliver {
            from: Side::Relay,
            max: 13,
        },
        Op::Close {
            stream: 0,
            side: Side::Agent,
        },
        Op::Drive,
        Op::Reset {
            stream: 0,
            side: Side::Relay,
        },
        Op::Read {
            stream: 0,
            side: Side::Agent,
            max: 1,
        },
    ];
    run(&ops, [1, 1], 1);
}

/// The case CI's proptest found on 2026-12-04 (shrunk): the last delivery sheds stream 0
/// under the relay's cap while the harness finishes, and the harness read it before it
/// had taken the reset from the events.
#[test]
fn regression_a_stream_shed_while_finishing() {
    let ops = [
        Op::Open,
        Op::Open,
        Op::Open,
        Op::Open,
        Op::Write {
            stream: 0,
            side: Side::Relay,
            len: 1,
        },
        Op::Write {
            stream: 0,
            side: Side::Relay,
            len: 1,
        },
        Op::Deliver {
            from: Side::Relay,
            max: 13,
        },
        Op::Write {
            stream: 4782007862417905928,
            side: Side::Agent,
            len: 4527,
        },
        Op::Deliver {
            from: Side::Agent,
            max: 2608,
        },
        Op::Read {
            stream: 8001741837728015788,
            side: Side::Relay,
            max: 3766,
        },
    ];
    let cfg = |window: u32, growth: u32, cap| Config {
        window,
        max_streams: MAX_STREAMS as u32,
        max_payload: 1,
        keepalive: Some(std::time::Duration::from_millis(5)),
        idle_timeout: None,
        auto_window: Some(AutoWindow {
            max: window.saturating_mul(growth),
        }),
        memory_cap: cap,
        memory_budget: None,
    };
    run_with(&ops, [cfg(1522, 19, Some(1312)), cfg(65536, 5, None)]);
}
