use std::time::Duration;

use bytes::{Bytes, BytesMut};

use super::super::frame::FrameType;
use super::super::pair::{Pair, Side, TOKEN};
use super::*;

fn config(window: u32, max_streams: u32) -> Config {
    Config {
        window,
        max_streams,
        max_payload: DEFAULT_MAX_PAYLOAD,
        keepalive: None,
        idle_timeout: None,
        ..Config::default()
    }
}

fn pair() -> Pair {
    Pair::new(Config::default(), Config::default())
}

fn encode(frames: &[Frame]) -> BytesMut {
    let mut buf = BytesMut::new();
    for f in frames {
        f.encode(&mut buf);
    }
    buf
}

/// Feeds raw frames to one end, as a misbehaving peer would.
fn inject(t: &mut Tunnel, frames: &[Frame]) -> Result<(), TunnelError> {
    let now = Instant::now();
    t.handle_input(now, &mut encode(frames))
}

fn drain_frames(t: &mut Tunnel) -> Vec<Frame> {
    std::iter::from_fn(|| t.poll_frame()).collect()
}

fn drain_events(t: &mut Tunnel) -> Vec<Event> {
    std::iter::from_fn(|| t.poll_event()).collect()
}

fn read_all(t: &mut Tunnel, s: StreamId) -> Vec<u8> {
    let mut out = Vec::new();
    while let Read::Data(d) = t.handle_read(s, usize::MAX).unwrap() {
        out.extend_from_slice(&d);
    }
    out
}

#[test]
fn handshake_exchanges_settings() {
    let mut p = Pair::unaccepted(config(1 << 20, 10), config(2 << 20, 5));
    assert_eq!(p.relay().tunnel.phase(), Phase::AwaitHello);
    p.step(Side::Agent, usize::MAX).unwrap();
    let events = p.relay().take_events();
    assert_eq!(
        events,
        vec![Event::Hello(Hello {
            version: 1,
            role: Role::Agent,
            window: 2 << 20,
            max_streams: 5,
            token: TOKEN.into(),
        })]
    );
    assert_eq!(p.relay().tunnel.phase(), Phase::HelloReceived);
    let now = p.now;
    p.relay().tunnel.handle_accept(now).unwrap();
    p.step(Side::Relay, usize::MAX).unwrap();
    let settings = PeerSettings {
        version: 1,
        window: 1 << 20,
        max_streams: 10,
    };
    assert_eq!(p.agent().take_events(), vec![Event::Connected(settings)]);
    assert_eq!(p.agent().tunnel.peer(), Some(settings));
    assert_eq!(p.relay().tunnel.phase(), Phase::Ready);
    assert_eq!(p.agent().tunnel.phase(), Phase::Ready);
}

#[test]
fn rejected_agent_gets_code_and_reason() {
    let mut p = Pair::unaccepted(Config::default(), Config::default());
    p.step(Side::Agent, usize::MAX).unwrap();
    let reason = "unknown organization token".to_owned();
    p.relay()
        .tunnel
        .handle_reject(ErrorCode::BAD_TOKEN, reason.clone())
        .unwrap();
    assert_eq!(p.relay().tunnel.phase(), Phase::Closed);
    assert_eq!(
        p.step(Side::Relay, usize::MAX),
        Err(TunnelError::Rejected {
            code: ErrorCode::BAD_TOKEN,
            reason
        })
    );
    assert_eq!(p.agent().tunnel.phase(), Phase::Closed);
    assert_eq!(
        p.relay().tunnel.handle_open("db"),
        Err(StreamError::NotReady { phase: "closed" })
    );
}

#[test]
fn wrong_version_is_rejected_by_the_relay() {
    let mut relay = Tunnel::relay(Config::default(), Instant::now());
    let hello = Frame::Hello(Hello {
        version: 2,
        role: Role::Agent,
        window: 100,
        max_streams: 1,
        token: "t".into(),
    });
    assert_eq!(
        inject(&mut relay, &[hello]),
        Err(TunnelError::Version { ours: 1, theirs: 2 })
    );
    assert_eq!(
        drain_frames(&mut relay),
        vec![Frame::HelloReject {
            code: ErrorCode::BAD_VERSION,
            reason: "relay speaks tunnel protocol version 1, agent sent 2".into()
        }]
    );
    assert_eq!(inject(&mut relay, &[]), Err(TunnelError::Closed));
}

#[test]
fn frame_before_hello_aborts_with_a_reason() {
    let mut relay = Tunnel::relay(Config::default(), Instant::now());
    let err = inject(&mut relay, &[Frame::Ping([0; 8])]).unwrap_err();
    assert_eq!(
        err,
        TunnelError::Unexpected {
            frame: FrameType::Ping,
            phase: "awaiting HELLO"
        }
    );
    assert_eq!(
        drain_frames(&mut relay),
        vec![Frame::Reset {
            stream: StreamId::TUNNEL,
            code: ErrorCode::PROTOCOL,
            reason: "unexpected PING frame while awaiting HELLO".into()
        }]
    );
}

#[test]
fn garbage_aborts_the_tunnel_with_the_decoder_error() {
    let mut relay = Tunnel::relay(Config::default(), Instant::now());
    let mut buf = BytesMut::from(&b"GET / HTTP/1.1\r\n"[..]);
    let err = relay.handle_input(Instant::now(), &mut buf).unwrap_err();
    assert_eq!(err.to_string(), "unknown tunnel frame type 0x47");
    assert_eq!(relay.phase(), Phase::Closed);
}

#[test]
fn open_write_close_in_both_directions() {
    let mut p = pair();
    let s = p.relay().tunnel.handle_open("org_42").unwrap();
    assert_eq!(s, StreamId(1));
    p.relay()
        .tunnel
        .handle_write(s, Bytes::from_static(b"hello"))
        .unwrap();
    p.relay().tunnel.handle_close(s).unwrap();
    p.drive();
    assert_eq!(
        p.agent().take_events(),
        vec![
            Event::Opened {
                stream: s,
                target: "org_42".into()
            },
            Event::Readable(s),
            Event::Finished(s),
        ]
    );
    assert_eq!(read_all(&mut p.agent().tunnel, s), b"hello");
    assert_eq!(p.agent().tunnel.handle_read(s, 10), Ok(Read::Finished));
    assert_eq!(
        p.agent().tunnel.stream_state(s),
        Some(StreamState::HalfClosedRemote)
    );
    p.agent()
        .tunnel
        .handle_write(s, Bytes::from_static(b"world"))
        .unwrap();
    p.agent().tunnel.handle_close(s).unwrap();
    p.drive();
    assert_eq!(p.agent().tunnel.stream_state(s), None, "agent is done");
    assert_eq!(
        p.relay().take_events(),
        vec![Event::Readable(s), Event::Finished(s)]
    );
    assert_eq!(read_all(&mut p.relay().tunnel, s), b"world");
    assert_eq!(p.relay().tunnel.stream_state(s), None, "relay is done");
    assert_eq!(
        p.relay().tunnel.handle_write(s, Bytes::from_static(b"x")),
        Err(StreamError::Unknown(s))
    );
    assert_eq!(p.relay().tunnel.stats().streams_open, 0);
    assert_eq!(p.relay().tunnel.stats().bytes_sent, 5);
    assert_eq!(p.relay().tunnel.stats().bytes_received, 5);
}

#[test]
fn writes_beyond_the_window_wait_for_the_reader() {
    let mut p = Pair::new(config(1000, 10), config(100, 10));
    let s = p.relay().tunnel.handle_open("db").unwrap();
    p.relay()
        .tunnel
        .handle_write(s, Bytes::from(vec![7; 250]))
        .unwrap();
    p.drive();
    let sent = p.relay().tunnel.stream_stats(s).unwrap();
    assert_eq!((sent.sent, sent.send_limit, sent.queued), (100, 100, 150));
    assert_eq!(sent.stalls, 1);
    assert_eq!(p.agent().tunnel.stream_stats(s).unwrap().buffered, 100);
    // Arriving bytes return no credit; reading under half a window returns none yet.
    let _ = p.agent().tunnel.handle_read(s, 49).unwrap();
    p.drive();
    assert_eq!(p.relay().tunnel.stream_stats(s).unwrap().sent, 100);
    let _ = p.agent().tunnel.handle_read(s, 1).unwrap();
    p.drive();
    let sent = p.relay().tunnel.stream_stats(s).unwrap();
    assert_eq!((sent.sent, sent.send_limit, sent.queued), (150, 150, 100));
    assert_eq!(p.relay().tunnel.stats().window_stalls, 2);
}

#[test]
fn a_reader_that_never_reads_stalls_only_its_own_stream() {
    let window = 64 * 1024;
    let mut p = Pair::new(config(window, 10), config(window, 10));
    let stuck = p.relay().tunnel.handle_open("stuck").unwrap();
    let busy = p.relay().tunnel.handle_open("busy").unwrap();
    let payload: Vec<u8> = (0..1 << 20).map(|i| (i % 251) as u8).collect();
    for s in [stuck, busy] {
        p.relay()
            .tunnel
            .handle_write(s, Bytes::from(payload.clone()))
            .unwrap();
        p.relay().tunnel.handle_close(s).unwrap();
    }
    let mut got = Vec::new();
    loop {
        p.drive();
        let before = got.len();
        match p.agent().tunnel.handle_read(busy, usize::MAX) {
            Ok(Read::Data(d)) => got.extend_from_slice(&d),
            Ok(Read::Finished) => break,
            other => panic!("busy stream stalled after {before} bytes: {other:?}"),
        }
    }
    assert_eq!(got, payload);
    let stuck_stats = p.relay().tunnel.stream_stats(stuck).unwrap();
    assert_eq!(stuck_stats.sent, u64::from(window));
    assert_eq!(stuck_stats.queued, (1 << 20) - u64::from(window));
    assert_eq!(
        p.agent().tunnel.stream_stats(stuck).unwrap().buffered,
        u64::from(window)
    );
}

#[test]
fn data_beyond_the_window_resets_the_stream() {
    let mut agent = Pair::new(config(100, 10), config(10, 10));
    let agent = &mut agent.agent().tunnel;
    let s = StreamId(1);
    let frames = [
        Frame::Open {
            stream: s,
            target: "db".into(),
        },
        Frame::Data {
            stream: s,
            payload: Bytes::from(vec![1; 6]),
        },
        Frame::Data {
            stream: s,
            payload: Bytes::from(vec![2; 6]),
        },
    ];
    inject(agent, &frames).unwrap();
    let reason =
        "6-byte DATA on relay stream 1 exceeds its window: 6 of 10 bytes granted already used";
    assert_eq!(
        drain_events(agent),
        vec![
            Event::Opened {
                stream: s,
                target: "db".into()
            },
            Event::Readable(s),
            Event::Reset {
                stream: s,
                code: ErrorCode::FLOW_CONTROL,
                reason: reason.into(),
                remote: false
            },
        ]
    );
    assert_eq!(
        drain_frames(agent),
        vec![Frame::Reset {
            stream: s,
            code: ErrorCode::FLOW_CONTROL,
            reason: reason.into()
        }]
    );
    assert_eq!(agent.stream_stats(s), None, "buffered bytes discarded");
    assert_eq!(agent.stats().flow_violations, 1);
    // Frames still in flight for the reset stream are ignored.
    inject(agent, &[frames[1].clone(), Frame::Close { stream: s }]).unwrap();
    assert_eq!(drain_frames(agent), vec![]);
    assert_eq!(drain_events(agent), vec![]);
}

#[test]
fn frames_for_never_opened_streams_are_answered_with_reset() {
    let mut p = pair();
    let agent = &mut p.agent().tunnel;
    inject(
        agent,
        &[
            Frame::Data {
                stream: StreamId(7),
                payload: Bytes::from_static(b"x"),
            },
            Frame::WindowUpdate {
                stream: StreamId(4),
                increment: 5,
            },
            Frame::Reset {
                stream: StreamId(9),
                code: ErrorCode::CANCEL,
                reason: String::new(),
            },
        ],
    )
    .unwrap();
    assert_eq!(
        drain_frames(agent),
        vec![
            Frame::Reset {
                stream: StreamId(7),
                code: ErrorCode::STREAM_CLOSED,
                reason: "DATA for relay stream 7, which was never opened".into()
            },
            Frame::Reset {
                stream: StreamId(4),
                code: ErrorCode::STREAM_CLOSED,
                reason: "WINDOW_UPDATE for agent stream 4, which was never opened".into()
            },
        ]
    );
    assert_eq!(drain_events(agent), vec![]);
}

#[test]
fn data_after_close_resets_the_stream() {
    let mut p = pair();
    let agent = &mut p.agent().tunnel;
    let s = StreamId(1);
    let open = Frame::Open {
        stream: s,
        target: String::new(),
    };
    let data = Frame::Data {
        stream: s,
        payload: Bytes::from_static(b"late"),
    };
    inject(agent, &[open, Frame::Close { stream: s }, data]).unwrap();
    let events = drain_events(agent);
    assert_eq!(
        events.last(),
        Some(&Event::Reset {
            stream: s,
            code: ErrorCode::STREAM_CLOSED,
            reason: "DATA on relay stream 1 after its CLOSE".into(),
            remote: false
        })
    );
}

#[test]
fn opens_past_the_limit_are_refused_with_a_reason() {
    let mut p = Pair::new(Config::default(), config(DEFAULT_WINDOW, 2));
    let agent = &mut p.agent().tunnel;
    let opens: Vec<Frame> = [1, 3, 5]
        .map(|id| Frame::Open {
            stream: StreamId(id),
            target: "db".into(),
        })
        .to_vec();
    inject(agent, &opens).unwrap();
    assert_eq!(
        drain_frames(agent),
        vec![Frame::Reset {
            stream: StreamId(5),
            code: ErrorCode::REFUSED,
            reason: "stream limit of this agent reached (2 concurrent streams)".into()
        }]
    );
    assert_eq!(agent.stats().streams_refused, 1);
    assert_eq!(agent.stats().streams_open, 2);
    // The relay knows the agent's limit from HELLO and refuses locally.
    let relay = &mut p.relay().tunnel;
    relay.handle_open("a").unwrap();
    relay.handle_open("b").unwrap();
    assert_eq!(relay.handle_open("c"), Err(StreamError::Limit { max: 2 }));
}

#[test]
fn reused_or_wrong_parity_ids_abort_the_tunnel() {
    let mut p = pair();
    let open = |id| Frame::Open {
        stream: StreamId(id),
        target: String::new(),
    };
    assert_eq!(
        inject(&mut p.agent().tunnel, &[open(3), open(1)]),
        Err(TunnelError::Violation {
            frame: FrameType::Open,
            stream: StreamId(1),
            what: "stream ids must increase"
        })
    );
    let mut p = pair();
    assert_eq!(
        inject(&mut p.agent().tunnel, &[open(2)])
            .unwrap_err()
            .to_string(),
        "OPEN frame on agent stream 2: the peer may not open ids of this end's parity"
    );
}

#[test]
fn reset_reaches_the_peer_with_code_and_reason() {
    let mut p = pair();
    let s = p.relay().tunnel.handle_open("db").unwrap();
    p.relay()
        .tunnel
        .handle_write(s, Bytes::from(vec![0; 1000]))
        .unwrap();
    p.drive();
    p.agent().take_events();
    p.agent()
        .tunnel
        .handle_reset(s, ErrorCode::CONNECT_FAILED, "connection refused".into())
        .unwrap();
    assert_eq!(p.agent().tunnel.stream_stats(s), None);
    p.drive();
    assert_eq!(
        p.relay().take_events(),
        vec![Event::Reset {
            stream: s,
            code: ErrorCode::CONNECT_FAILED,
            reason: "connection refused".into(),
            remote: true
        }]
    );
    assert_eq!(
        p.relay().tunnel.handle_read(s, 1),
        Err(StreamError::Unknown(s))
    );
}

#[test]
fn drain_stops_new_streams_both_ways() {
    let mut p = pair();
    let s = p.relay().tunnel.handle_open("db").unwrap();
    p.relay().tunnel.handle_drain().unwrap();
    p.drive();
    let events = p.agent().take_events();
    assert_eq!(events.last(), Some(&Event::Drain));
    assert_eq!(
        p.agent().tunnel.handle_open("x"),
        Err(StreamError::Draining)
    );
    assert_eq!(
        p.relay().tunnel.handle_open("x"),
        Err(StreamError::Draining)
    );
    // An OPEN that crossed the DRAIN is refused; the existing stream still works.
    let relay = &mut p.relay().tunnel;
    let crossed = Frame::Open {
        stream: StreamId(2),
        target: String::new(),
    };
    inject(relay, &[crossed]).unwrap();
    assert_eq!(
        drain_frames(relay),
        vec![Frame::Reset {
            stream: StreamId(2),
            code: ErrorCode::REFUSED,
            reason: "this relay is draining: open the stream on another tunnel".into()
        }]
    );
    p.relay()
        .tunnel
        .handle_write(s, Bytes::from_static(b"ok"))
        .unwrap();
    p.drive();
    assert_eq!(read_all(&mut p.agent().tunnel, s), b"ok");
}

#[test]
fn keepalive_measures_rtt_and_silence_times_out() {
    let timed = Config {
        keepalive: Some(Duration::from_secs(1)),
        idle_timeout: Some(Duration::from_secs(3)),
        ..Config::default()
    };
    let mut p = Pair::new(timed.clone(), timed);
    let t0 = p.now;
    assert_eq!(
        p.relay().tunnel.poll_timeout(),
        Some(t0 + Duration::from_secs(1))
    );
    p.now = t0 + Duration::from_secs(1);
    let now = p.now;
    p.relay().tunnel.handle_timeout(now).unwrap();
    p.step(Side::Relay, usize::MAX).unwrap(); // PING
    p.now = t0 + Duration::from_millis(1040);
    p.step(Side::Agent, usize::MAX).unwrap(); // PONG
    assert_eq!(p.relay().tunnel.rtt(), Some(Duration::from_millis(40)));
    // The agent last heard from the relay at t0 + 1 s.
    let agent = &mut p.agent().tunnel;
    assert_eq!(agent.poll_timeout(), Some(t0 + Duration::from_secs(1)));
    agent.handle_timeout(t0 + Duration::from_secs(1)).unwrap();
    assert_eq!(drain_frames(agent), vec![Frame::Ping(1u64.to_be_bytes())]);
    assert_eq!(
        agent.handle_timeout(t0 + Duration::from_secs(4)),
        Err(TunnelError::IdleTimeout {
            idle: Duration::from_secs(3)
        })
    );
    assert_eq!(
        drain_frames(agent),
        vec![Frame::Reset {
            stream: StreamId::TUNNEL,
            code: ErrorCode::IDLE_TIMEOUT,
            reason: "nothing received from the peer for 3s".into()
        }]
    );
    assert_eq!(agent.poll_timeout(), None);
}

#[test]
fn data_frames_alternate_between_streams() {
    let cfg = Config {
        max_payload: 10,
        ..config(DEFAULT_WINDOW, 10)
    };
    let mut p = Pair::new(cfg.clone(), cfg);
    let relay = &mut p.relay().tunnel;
    let a = relay.handle_open("a").unwrap();
    let b = relay.handle_open("b").unwrap();
    relay.handle_write(a, Bytes::from(vec![b'a'; 30])).unwrap();
    relay.handle_write(b, Bytes::from(vec![b'b'; 15])).unwrap();
    relay.handle_close(b).unwrap();
    let order: Vec<(FrameType, u32, usize)> = drain_frames(relay)
        .iter()
        .map(|f| match f {
            Frame::Data { stream, payload } => (f.ty(), stream.0, payload.len()),
            f => (f.ty(), f.stream().0, 0),
        })
        .collect();
    assert_eq!(
        order,
        vec![
            (FrameType::Open, 1, 0),
            (FrameType::Open, 3, 0),
            (FrameType::Data, 1, 10),
            (FrameType::Data, 3, 10),
            (FrameType::Data, 1, 10),
            (FrameType::Data, 3, 5),
            (FrameType::Data, 1, 10),
            (FrameType::Close, 3, 0),
        ]
    );
}

#[test]
fn a_peer_that_never_reads_cannot_queue_replies_without_bound() {
    let mut p = pair();
    let pings = vec![Frame::Ping([1; 8]); MAX_QUEUED_CONTROL + 1];
    assert_eq!(
        inject(&mut p.agent().tunnel, &pings),
        Err(TunnelError::PeerNotReading {
            queued: MAX_QUEUED_CONTROL
        })
    );
}

#[test]
fn peer_abort_ends_the_tunnel() {
    let mut p = pair();
    let abort = Frame::Reset {
        stream: StreamId::TUNNEL,
        code: ErrorCode::PROTOCOL,
        reason: "bad frame".into(),
    };
    assert_eq!(
        inject(&mut p.agent().tunnel, &[abort]),
        Err(TunnelError::PeerAborted {
            code: ErrorCode::PROTOCOL,
            reason: "bad frame".into()
        })
    );
    assert_eq!(drain_frames(&mut p.agent().tunnel), vec![]);
}
