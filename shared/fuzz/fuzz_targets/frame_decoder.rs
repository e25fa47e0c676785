//! Arbitrary bytes against the tunnel's frame decoder and against a whole tunnel end.
//!
//! 1. `Frame::decode` in a loop over the input: it never panics, always consumes a
//!    whole frame or nothing, and every frame it returns encodes back to bytes that
//!    decode to the same frame.
//! 2. The same bytes as what a peer sent to a relay (or an agent), in chunks, with the
//!    application accepting the HELLO, opening, writing and reading streams, and the
//!    clock moving: `handle_input` never panics; when it fails the tunnel is closed
//!    and says so on the next call; everything the tunnel sends is valid frames.
//!
//! The first input byte picks the mode: bit 0 the role (relay or agent), bit 1
//! whether a valid handshake comes first (so the rest starts in the ready phase),
//! bits 2-7 the chunk size (1 to 64 bytes).

#![no_main]

use bytes::{Bytes, BytesMut};
use libfuzzer_sys::fuzz_target;
use lokadb_shared::tunnel::frame::{Hello, HelloOk, PROTOCOL_VERSION};
use lokadb_shared::tunnel::{Config, Event, Frame, Phase, Role, Tunnel, TunnelError};
use std::time::{Duration, Instant};

fuzz_target!(|data: &[u8]| {
    decode_all(data);
    if let Some((&mode, rest)) = data.split_first() {
        drive(mode, rest);
    }
});

fn decode_all(data: &[u8]) {
    let mut buf = BytesMut::from(data);
    loop {
        let before = buf.len();
        match Frame::decode(&mut buf) {
            Ok(Some(frame)) => {
                assert!(buf.len() < before, "a frame decoded from nothing");
                let mut again = BytesMut::new();
                frame.encode(&mut again);
                let back = Frame::decode(&mut again)
                    .expect("an encoded frame decodes")
                    .expect("an encoded frame is whole");
                assert_eq!(back, frame);
                assert!(again.is_empty(), "encode wrote more than one frame");
            }
            Ok(None) => {
                assert_eq!(buf.len(), before, "a partial frame was consumed");
                return;
            }
            Err(e) => {
                let _ = e.to_string();
                return;
            }
        }
    }
}

fn config() -> Config {
    Config {
        window: 4096,
        max_streams: 8,
        max_payload: 1024,
        ..Config::default()
    }
}

fn drive(mode: u8, data: &[u8]) {
    let start = Instant::now();
    let relay = mode & 1 == 0;
    let chunk = usize::from(mode >> 2) + 1;
    let mut tunnel = if relay {
        Tunnel::relay(config(), start)
    } else {
        Tunnel::agent(config(), "org.secret".into(), start)
    };
    let mut input = BytesMut::new();
    if mode & 2 != 0 {
        let first = if relay {
            Frame::Hello(Hello {
                version: PROTOCOL_VERSION,
                role: Role::Agent,
                window: 2048,
                max_streams: 4,
                token: "org.secret".into(),
            })
        } else {
            Frame::HelloOk(HelloOk {
                version: PROTOCOL_VERSION,
                window: 2048,
                max_streams: 4,
            })
        };
        first.encode(&mut input);
    }
    let mut now = start;
    let mut pieces = data.chunks(chunk).peekable();
    // The handshake prefix goes in on its own first.
    let mut first_round = !input.is_empty();
    while first_round || pieces.peek().is_some() {
        if !first_round {
            input.extend_from_slice(pieces.next().expect("peeked"));
        }
        first_round = false;
        now += Duration::from_millis(250);
        let result = tunnel.handle_input(now, &mut input);
        application(&mut tunnel, now);
        check_output(&mut tunnel);
        match result {
            Ok(()) => {
                if let Err(e) = tunnel.handle_timeout(now) {
                    closed_cleanly(&mut tunnel, &e, now);
                    return;
                }
            }
            Err(e) => {
                closed_cleanly(&mut tunnel, &e, now);
                return;
            }
        }
    }
}

/// What the relay or agent application does with the events.
fn application(tunnel: &mut Tunnel, now: Instant) {
    while let Some(event) = tunnel.poll_event() {
        match event {
            Event::Hello(hello) => {
                if hello.token == "org.secret" {
                    let _ = tunnel.handle_accept(now);
                    // Open two streams and send on them so that the peer's frames
                    // have streams to land on.
                    for _ in 0..2 {
                        if let Ok(id) = tunnel.handle_open("orgdb") {
                            let _ = tunnel.handle_write(id, Bytes::from(vec![7u8; 3000]));
                        }
                    }
                } else {
                    let _ = tunnel
                        .handle_reject(lokadb_shared::tunnel::ErrorCode::BAD_TOKEN, "no".into());
                }
            }
            Event::Opened { stream, .. } => {
                let _ = tunnel.handle_write(stream, Bytes::from_static(b"R"));
            }
            Event::Readable(id) | Event::Finished(id) => {
                let _ = tunnel.handle_read(id, 1500);
                if tunnel.stream_state(id).is_some() {
                    let _ = tunnel.handle_close(id);
                }
            }
            Event::Connected(_) | Event::Reset { .. } | Event::Drain => {}
        }
    }
}

/// Everything the tunnel sends is a sequence of valid, whole frames.
fn check_output(tunnel: &mut Tunnel) {
    let mut out = BytesMut::new();
    while tunnel.poll_transmit(&mut out, 16 * 1024) > 0 {
        loop {
            match Frame::decode(&mut out) {
                Ok(Some(_)) => {}
                Ok(None) => break,
                Err(e) => panic!("the tunnel sent an invalid frame: {e}"),
            }
        }
        assert!(out.is_empty(), "the tunnel sent a partial frame");
    }
}

/// After an error the tunnel is closed, sends only what says why, and refuses input.
fn closed_cleanly(tunnel: &mut Tunnel, e: &TunnelError, now: Instant) {
    let _ = e.to_string();
    assert_eq!(tunnel.phase(), Phase::Closed, "{e}");
    check_output(tunnel);
    let mut more = BytesMut::from(&b"\x20\x00\x00\x00\x00\x00\x00\x00\x00\x08pingpong"[..]);
    assert_eq!(
        tunnel.handle_input(now, &mut more),
        Err(TunnelError::Closed),
        "a closed tunnel took input"
    );
    assert!(tunnel.handle_timeout(now).is_ok());
    assert_eq!(tunnel.poll_timeout(), None);
}
