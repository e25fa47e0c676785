//! Window auto-tuning and receive memory caps: a simulated long link (delay and
//! bandwidth, with a clock the test moves), budgets, and shedding slow readers.

use std::collections::VecDeque;
use std::time::Duration;

use bytes::{Bytes, BytesMut};

use super::super::memory::{AutoWindow, MemoryBudget};
use super::super::pair::{Pair, Side};
use super::*;

const KIB: u32 = 1024;

fn other(side: Side) -> Side {
    match side {
        Side::Relay => Side::Agent,
        Side::Agent => Side::Relay,
    }
}

/// A link with a one-way `delay` and `bytes_per_ms` of bandwidth each way, moved
/// one millisecond at a time.
struct LongLink {
    pair: Pair,
    delay: Duration,
    bytes_per_ms: usize,
    /// Bytes on their way to each end (indexed by the receiver), with arrival times.
    flight: [VecDeque<(Instant, BytesMut)>; 2],
}

impl LongLink {
    fn new(relay: Config, agent: Config, delay_ms: u64, bytes_per_ms: usize) -> LongLink {
        LongLink {
            pair: Pair::new(relay, agent),
            delay: Duration::from_millis(delay_ms),
            bytes_per_ms,
            flight: Default::default(),
        }
    }

    fn tunnel(&mut self, side: Side) -> &mut Tunnel {
        &mut self.pair.end(side).tunnel
    }

    /// One millisecond: timers, what each end sends, what arrives.
    fn tick(&mut self) {
        self.pair.now += Duration::from_millis(1);
        let now = self.pair.now;
        for side in [Side::Relay, Side::Agent] {
            self.tunnel(side).handle_timeout(now).unwrap();
            let bytes = self.pair.take_wire(side, self.bytes_per_ms);
            if !bytes.is_empty() {
                self.flight[other(side) as usize].push_back((now + self.delay, bytes));
            }
        }
        for side in [Side::Relay, Side::Agent] {
            while self.flight[side as usize]
                .front()
                .is_some_and(|(at, _)| *at <= now)
            {
                let (_, bytes) = self.flight[side as usize].pop_front().unwrap();
                self.pair.deliver(side, &bytes).unwrap();
            }
        }
    }

    /// Reads everything buffered on `stream` at the agent; returns the bytes read.
    fn read_all(&mut self, stream: StreamId) -> usize {
        let now = self.pair.now;
        let mut n = 0;
        while let Ok(Read::Data(d)) = self
            .tunnel(Side::Agent)
            .handle_read_at(now, stream, 1 << 30)
        {
            n += d.len();
        }
        n
    }

    /// The flow-control invariants of one stream, relay to agent.
    fn check_window(&mut self, stream: StreamId, max_window: u64) {
        let sender = self.tunnel(Side::Relay).stream_stats(stream);
        let receiver = self.tunnel(Side::Agent).stream_stats(stream);
        if let (Some(tx), Some(rx)) = (sender, receiver) {
            assert!(tx.sent <= tx.send_limit);
            assert!(tx.send_limit <= rx.recv_limit, "{tx:?} {rx:?}");
            assert!(rx.received <= rx.recv_limit);
            assert!(rx.recv_limit - rx.consumed <= max_window, "{rx:?}");
            assert!(rx.window <= max_window);
        }
    }
}

fn long_link_config(window: u32, auto: Option<AutoWindow>) -> Config {
    Config {
        window,
        keepalive: Some(Duration::from_millis(100)),
        idle_timeout: None,
        auto_window: auto,
        ..Config::default()
    }
}

/// Sends `total` bytes relay to agent over a 40 ms, 10 MB/s link (BDP 400 KB) for
/// `ms` milliseconds, reading at once; returns the link, the stream and the bytes
/// read in the last second.
fn transfer(agent: Config, ms: usize) -> (LongLink, StreamId, usize) {
    let max_window = agent
        .auto_window
        .map_or(agent.window, |a| a.max.max(agent.window));
    let relay = long_link_config(64 * KIB, None);
    let mut link = LongLink::new(relay, agent, 20, 10_000);
    let s = link.tunnel(Side::Relay).handle_open("db").unwrap();
    let data = Bytes::from(vec![7u8; 40 << 20]);
    link.tunnel(Side::Relay).handle_write(s, data).unwrap();
    let mut last_second = 0;
    for t in 0..ms {
        link.tick();
        let n = link.read_all(s);
        if t + 1000 >= ms {
            last_second += n;
        }
        link.check_window(s, u64::from(max_window));
    }
    (link, s, last_second)
}

#[test]
fn a_fixed_window_caps_a_long_link() {
    let (mut link, s, last_second) = transfer(long_link_config(64 * KIB, None), 3000);
    // 64 KiB per round trip of 40 ms, at most.
    assert!(last_second < 2_000_000, "{last_second} bytes/s");
    let stats = link.tunnel(Side::Agent).stats();
    assert_eq!(stats.window_growths, 0);
    assert_eq!(
        link.tunnel(Side::Agent).stream_stats(s).unwrap().window,
        u64::from(64 * KIB)
    );
}

#[test]
fn the_window_grows_to_about_twice_the_bandwidth_delay_product() {
    let auto = Some(AutoWindow { max: 16 << 20 });
    let (mut link, s, last_second) = transfer(long_link_config(64 * KIB, auto), 3000);
    let rtt = link.tunnel(Side::Agent).rtt().unwrap();
    assert!(rtt >= Duration::from_millis(40) && rtt <= Duration::from_millis(45));
    // BDP = 10 MB/s × 40 ms = 400 KB: doubling from 64 KiB stops at the first
    // window read in two round trips or more, 1 MiB (between 2 and 4 BDP).
    let window = link.tunnel(Side::Agent).stream_stats(s).unwrap().window;
    assert_eq!(window, 1 << 20, "window {window}");
    let stats = link.tunnel(Side::Agent).stats();
    assert_eq!(stats.window_growths, 4);
    assert_eq!(stats.window_growths_refused, 0);
    // The link, not the window, is the limit now.
    assert!(last_second >= 9_500_000, "{last_second} bytes/s");
}

#[test]
fn growth_stops_at_the_maximum() {
    let auto = Some(AutoWindow { max: 200 * KIB });
    let (mut link, s, _) = transfer(long_link_config(64 * KIB, auto), 1500);
    let window = link.tunnel(Side::Agent).stream_stats(s).unwrap().window;
    assert_eq!(window, u64::from(200 * KIB));
}

#[test]
fn growth_is_refused_when_the_caps_are_reached_and_counted() {
    let auto = Some(AutoWindow { max: 16 << 20 });
    // Growth may fill half of a cap: 128 KiB, one doubling of 64 KiB.
    let budget = MemoryBudget::new(256 << 10);
    let shared = Config {
        memory_budget: Some(budget.clone()),
        ..long_link_config(64 * KIB, auto)
    };
    let per_tunnel = Config {
        memory_cap: Some(256 << 10),
        ..long_link_config(64 * KIB, auto)
    };
    for agent in [shared, per_tunnel] {
        let (mut link, s, _) = transfer(agent, 1500);
        let stats = link.tunnel(Side::Agent).stats();
        assert_eq!(stats.window_growths, 1);
        assert!(stats.window_growths_refused >= 1, "{stats:?}");
        assert_eq!(stats.streams_shed, 0);
        let window = link.tunnel(Side::Agent).stream_stats(s).unwrap().window;
        assert_eq!(window, u64::from(128 * KIB));
        assert!(stats.memory_charged <= 256 << 10);
    }
    assert_eq!(budget.used(), 0, "the dropped tunnel gave its memory back");
}

#[test]
fn the_budget_is_released_when_streams_end() {
    let budget = MemoryBudget::new(64 << 20);
    let agent = Config {
        memory_budget: Some(budget.clone()),
        memory_cap: Some(32 << 20),
        ..long_link_config(64 * KIB, Some(AutoWindow { max: 16 << 20 }))
    };
    let relay = long_link_config(64 * KIB, None);
    let mut link = LongLink::new(relay, agent, 20, 10_000);
    let streams: Vec<StreamId> = (0..3)
        .map(|_| link.tunnel(Side::Relay).handle_open("db").unwrap())
        .collect();
    for &s in &streams {
        let data = Bytes::from(vec![1u8; 4 << 20]);
        link.tunnel(Side::Relay).handle_write(s, data).unwrap();
    }
    // Streams 0 and 1 are read (and grow); stream 2 is never read.
    for _ in 0..1000 {
        link.tick();
        link.read_all(streams[0]);
        link.read_all(streams[1]);
    }
    let grown = link.tunnel(Side::Agent).stream_stats(streams[0]).unwrap();
    assert!(grown.window > u64::from(64 * KIB), "{grown:?}");
    assert!(budget.used() > u64::from(64 * KIB));
    assert_eq!(
        budget.used(),
        link.tunnel(Side::Agent).stats().memory_charged
    );
    // Ends: 0 reset by the agent, 1 reset by the relay, 2 closed both ways.
    link.tunnel(Side::Agent)
        .handle_reset(streams[0], ErrorCode::CANCEL, "done".into())
        .unwrap();
    link.tunnel(Side::Relay)
        .handle_reset(streams[1], ErrorCode::CANCEL, "done".into())
        .unwrap();
    link.tunnel(Side::Relay).handle_close(streams[2]).unwrap();
    link.tunnel(Side::Agent).handle_close(streams[2]).unwrap();
    for _ in 0..3000 {
        link.tick();
        let n = link.read_all(streams[2]);
        let _ = n;
        let _ = link.tunnel(Side::Agent).handle_read(streams[2], 1);
    }
    assert_eq!(link.tunnel(Side::Agent).stats().streams_open, 0);
    assert_eq!(link.tunnel(Side::Agent).stats().memory_charged, 0);
    assert_eq!(budget.used(), 0);
}

#[test]
fn an_idle_grown_window_shrinks_back_and_releases_its_reservation() {
    let budget = MemoryBudget::new(64 << 20);
    let agent = Config {
        memory_budget: Some(budget.clone()),
        ..long_link_config(64 * KIB, Some(AutoWindow { max: 16 << 20 }))
    };
    let relay = long_link_config(64 * KIB, None);
    let mut link = LongLink::new(relay, agent, 20, 10_000);
    let s = link.tunnel(Side::Relay).handle_open("db").unwrap();
    let data = Bytes::from(vec![1u8; 8 << 20]);
    link.tunnel(Side::Relay).handle_write(s, data).unwrap();
    let mut read = 0;
    while read < 4 << 20 {
        link.tick();
        read += link.read_all(s);
    }
    assert!(link.tunnel(Side::Agent).stream_stats(s).unwrap().window > u64::from(64 * KIB));
    // The reader stops: after a second, the window is the base one again, and the
    // reservation covers only the credit the relay still holds.
    for _ in 0..1500 {
        link.tick();
    }
    let rx = link.tunnel(Side::Agent).stream_stats(s).unwrap();
    assert_eq!(rx.window, u64::from(64 * KIB));
    assert_eq!(
        budget.used(),
        (rx.recv_limit - rx.consumed).saturating_sub(u64::from(64 * KIB))
            + rx.buffered.min(u64::from(64 * KIB))
    );
    // Read again, it grows again; once it ends, everything is given back.
    let mut tx_done = false;
    for _ in 0..3000 {
        link.tick();
        read += link.read_all(s);
        link.check_window(s, 16 << 20);
        tx_done = link.tunnel(Side::Relay).stream_stats(s).unwrap().queued == 0;
        if tx_done {
            break;
        }
    }
    assert!(tx_done);
    link.tunnel(Side::Relay).handle_close(s).unwrap();
    link.tunnel(Side::Agent).handle_close(s).unwrap();
    while link.tunnel(Side::Agent).stream_stats(s).is_some() {
        link.tick();
        read += link.read_all(s);
        let _ = link.tunnel(Side::Agent).handle_read(s, 1);
    }
    assert_eq!(read, 8 << 20);
    assert_eq!(budget.used(), 0);
}

fn fixed(window: u32, max_payload: u32) -> Config {
    Config {
        window,
        max_payload,
        keepalive: None,
        idle_timeout: None,
        ..Config::default()
    }
}

#[test]
fn the_tunnel_cap_sheds_the_slowest_reader_and_the_others_run_on() {
    let agent = Config {
        memory_cap: Some(100 << 10),
        ..fixed(64 * KIB, 16 * KIB)
    };
    let mut p = Pair::new(fixed(64 * KIB, 16 * KIB), agent);
    let slow = p.relay().tunnel.handle_open("slow").unwrap();
    p.relay()
        .tunnel
        .handle_write(slow, Bytes::from(vec![1u8; 200_000]))
        .unwrap();
    p.drive();
    assert_eq!(
        p.agent().tunnel.stream_stats(slow).unwrap().buffered,
        u64::from(64 * KIB)
    );
    let fast = p.relay().tunnel.handle_open("fast").unwrap();
    let payload: Vec<u8> = (0..1 << 20).map(|i| (i % 251) as u8).collect();
    p.relay()
        .tunnel
        .handle_write(fast, Bytes::from(payload.clone()))
        .unwrap();
    p.relay().tunnel.handle_close(fast).unwrap();
    let mut got = Vec::new();
    loop {
        p.drive();
        assert!(p.agent().tunnel.stats().memory_charged <= 100 << 10);
        match p.agent().tunnel.handle_read(fast, usize::MAX).unwrap() {
            Read::Data(d) => got.extend_from_slice(&d),
            Read::Finished => break,
            Read::Blocked => panic!("fast stream stalled after {} bytes", got.len()),
        }
    }
    assert_eq!(got, payload);
    let reason =
        "the reader of this stream is too slow: the tunnel's memory cap (100 KiB) was reached";
    let reset = Event::Reset {
        stream: slow,
        code: ErrorCode::FLOW_CONTROL,
        reason: reason.into(),
        remote: false,
    };
    assert!(p.agent().take_events().contains(&reset));
    assert_eq!(p.agent().tunnel.stream_stats(slow), None);
    assert_eq!(p.agent().tunnel.stats().streams_shed, 1);
    assert_eq!(
        p.relay().take_events(),
        vec![Event::Reset {
            stream: slow,
            code: ErrorCode::FLOW_CONTROL,
            reason: reason.into(),
            remote: true,
        }]
    );
}

#[test]
fn the_shared_budget_sheds_in_the_tunnel_that_reaches_it() {
    let budget = MemoryBudget::new(128 << 10);
    let agent = Config {
        memory_budget: Some(budget.clone()),
        ..fixed(64 * KIB, 16 * KIB)
    };
    let mut a = Pair::new(fixed(64 * KIB, 16 * KIB), agent.clone());
    let mut b = Pair::new(fixed(64 * KIB, 16 * KIB), agent);
    let stuck_a = a.relay().tunnel.handle_open("a").unwrap();
    a.relay()
        .tunnel
        .handle_write(stuck_a, Bytes::from(vec![1u8; 100_000]))
        .unwrap();
    a.drive();
    let slow_b = b.relay().tunnel.handle_open("b-slow").unwrap();
    b.relay()
        .tunnel
        .handle_write(slow_b, Bytes::from(vec![2u8; 40 << 10]))
        .unwrap();
    b.drive();
    assert_eq!(budget.used(), 104 << 10);
    let fast_b = b.relay().tunnel.handle_open("b-fast").unwrap();
    b.relay()
        .tunnel
        .handle_write(fast_b, Bytes::from(vec![3u8; 1 << 20]))
        .unwrap();
    b.relay().tunnel.handle_close(fast_b).unwrap();
    let mut got = 0;
    loop {
        b.drive();
        assert!(budget.used() <= 128 << 10);
        match b.agent().tunnel.handle_read(fast_b, usize::MAX).unwrap() {
            Read::Data(d) => got += d.len(),
            Read::Finished => break,
            Read::Blocked => panic!("fast stream stalled after {got} bytes"),
        }
    }
    assert_eq!(got, 1 << 20);
    // Tunnel b reached the budget: its slowest reader went, tunnel a is untouched.
    let shed = b.agent().take_events();
    assert!(
        shed.iter().any(
            |e| matches!(e, Event::Reset { stream, code, reason, remote: false }
            if *stream == slow_b && *code == ErrorCode::FLOW_CONTROL
            && reason.contains("the memory cap shared by all tunnels (128 KiB)"))
        ),
        "{shed:?}"
    );
    assert_eq!(
        a.agent().tunnel.stream_stats(stuck_a).unwrap().buffered,
        u64::from(64 * KIB)
    );
    assert_eq!(a.agent().tunnel.stats().streams_shed, 0);
    drop(b);
    assert_eq!(budget.used(), 64 << 10);
    drop(a);
    assert_eq!(budget.used(), 0);
}

#[test]
fn by_default_nothing_is_capped_or_tuned() {
    let c = Config::default();
    assert_eq!(c.window, 4 << 20);
    assert_eq!(c.auto_window, None);
    assert_eq!(c.memory_cap, None);
    assert_eq!(c.memory_budget, None);
}
