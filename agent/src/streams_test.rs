//! Pipes between a tunnel and real local sockets; the relay's end is a second
//! `Tunnel` joined to the agent's by moving frames in memory (no TLS).

use super::*;
use lokadb_shared::tunnel::{Config, Event};
use std::net::TcpListener;
use std::thread;
use std::time::{Duration, Instant};

struct Harness {
    relay: Tunnel,
    agent: Tunnel,
    pipes: Pipes,
    poller: Poller<StreamId>,
    relay_events: Vec<Event>,
}

impl Harness {
    fn new(postgres: std::net::SocketAddr, window: u32) -> Harness {
        let now = Instant::now();
        let config = Config {
            window,
            ..Config::default()
        };
        let mut h = Harness {
            relay: Tunnel::relay(config.clone(), now),
            agent: Tunnel::agent(config, "token".into(), now),
            pipes: Pipes::new(HostPort::parse(&postgres.to_string()).unwrap()),
            poller: Poller::new(),
            relay_events: Vec::new(),
        };
        h.shuttle();
        assert!(matches!(h.relay_events.pop(), Some(Event::Hello(_))));
        h.relay.handle_accept(now).unwrap();
        h.shuttle();
        h.relay_events.clear();
        h
    }

    /// Frames both ways, agent events handled as the session does.
    fn shuttle(&mut self) {
        let now = Instant::now();
        loop {
            let mut buf = BytesMut::new();
            let a = self.relay.poll_transmit(&mut buf, usize::MAX);
            if a > 0 {
                self.agent.handle_input(now, &mut buf).unwrap();
            }
            while let Some(ev) = self.agent.poll_event() {
                match ev {
                    Event::Opened { stream, target } => {
                        self.pipes.open(&mut self.agent, stream, target)
                    }
                    Event::Readable(s) | Event::Finished(s) => self.pipes.mark_readable(s),
                    Event::Reset { stream, .. } => self.pipes.reset(stream),
                    _ => {}
                }
            }
            self.pipes.pump(&mut self.agent);
            let b = self.agent.poll_transmit(&mut buf, usize::MAX);
            if b > 0 {
                self.relay.handle_input(now, &mut buf).unwrap();
            }
            while let Some(ev) = self.relay.poll_event() {
                self.relay_events.push(ev);
            }
            if a == 0 && b == 0 {
                return;
            }
        }
    }

    /// One round of the agent's loop: wait for sockets, handle them, move frames.
    fn round(&mut self) {
        self.poller.clear();
        self.pipes.register(&self.agent, &mut self.poller, |s| s);
        self.poller
            .wait(Some(Instant::now() + Duration::from_millis(20)))
            .unwrap();
        let ready: Vec<_> = self.poller.ready().collect();
        for (stream, r) in ready {
            self.pipes.on_ready(&mut self.agent, stream, r);
        }
        self.shuttle();
    }
}

/// A "postgres" that echoes what it reads and closes after the client's end of file.
fn echo_server() -> std::net::SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut r = s.try_clone().unwrap();
        io::copy(&mut r, &mut s).unwrap();
        s.shutdown(Shutdown::Write).unwrap();
    });
    addr
}

#[test]
fn bytes_go_to_postgres_and_back_under_a_small_window() {
    let mut h = Harness::new(echo_server(), 16 * 1024);
    let data: Vec<u8> = (0..1_000_000u32).map(|i| (i % 251) as u8).collect();
    let s = h.relay.handle_open("appdb").unwrap();
    h.relay.handle_write(s, Bytes::from(data.clone())).unwrap();
    h.relay.handle_close(s).unwrap();
    let mut got = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        assert!(
            Instant::now() < deadline,
            "timed out with {} bytes back",
            got.len()
        );
        h.round();
        match h.relay.handle_read(s, usize::MAX) {
            Ok(Read::Data(d)) => got.extend_from_slice(&d),
            Ok(Read::Blocked) => {}
            Ok(Read::Finished) | Err(_) => break,
        }
        let queued = h.agent.stream_stats(s).map_or(0, |st| st.queued);
        assert!(queued < 16 * 1024 + CHUNK as u64, "{queued} bytes queued");
    }
    assert_eq!(got.len(), data.len());
    assert!(got == data);
    for _ in 0..5 {
        h.round();
    }
    assert_eq!(h.pipes.len(), 0, "pipe left behind");
}

#[test]
fn refused_connect_resets_with_connect_failed() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    drop(listener);
    let mut h = Harness::new(addr, 64 * 1024);
    let s = h.relay.handle_open("appdb").unwrap();
    h.relay
        .handle_write(s, Bytes::from_static(b"startup"))
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while h.relay_events.is_empty() {
        assert!(Instant::now() < deadline);
        h.round();
    }
    match &h.relay_events[0] {
        Event::Reset {
            stream,
            code,
            reason,
            remote: true,
        } => {
            assert_eq!(*stream, s);
            assert_eq!(*code, ErrorCode::CONNECT_FAILED);
            assert_eq!(
                reason,
                &format!("could not connect to postgres {addr}: Connection refused")
            );
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(h.pipes.len(), 0);
}

#[test]
fn postgres_is_not_read_beyond_one_window() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let _ = std::io::Write::write_all(&mut s, &vec![1u8; 8 << 20]);
    });
    let window = 32 * 1024;
    let mut h = Harness::new(addr, window);
    let s = h.relay.handle_open("appdb").unwrap();
    // The relay never reads: the agent may queue at most about one window.
    for _ in 0..30 {
        h.round();
    }
    let st = h.agent.stream_stats(s).unwrap();
    assert!(st.sent <= u64::from(window));
    assert!(st.queued >= u64::from(window) / 2, "{st:?}");
    assert!(st.queued < u64::from(window) + CHUNK as u64, "{st:?}");
    // Reading on the relay side lets it flow again.
    let mut got = 0usize;
    let deadline = Instant::now() + Duration::from_secs(20);
    while got < 8 << 20 {
        assert!(Instant::now() < deadline, "stalled at {got}");
        h.round();
        if let Ok(Read::Data(d)) = h.relay.handle_read(s, usize::MAX) {
            got += d.len();
        }
    }
}

#[test]
fn reset_from_the_relay_closes_the_postgres_socket() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut buf = [0u8; 16];
        // Reads end (0 or error) once the agent closes the socket.
        while matches!(std::io::Read::read(&mut s, &mut buf), Ok(n) if n > 0) {}
        tx.send(()).unwrap();
    });
    let mut h = Harness::new(addr, 64 * 1024);
    let s = h.relay.handle_open("appdb").unwrap();
    h.relay
        .handle_write(s, Bytes::from_static(b"hello"))
        .unwrap();
    for _ in 0..5 {
        h.round();
    }
    assert_eq!(h.pipes.len(), 1);
    h.relay
        .handle_reset(s, ErrorCode::CANCEL, "client went away".into())
        .unwrap();
    h.round();
    assert_eq!(h.pipes.len(), 0);
    rx.recv_timeout(Duration::from_secs(5))
        .expect("postgres socket still open");
}
