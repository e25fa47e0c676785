//! The agent binary against a fake relay: streams both ways, connect failures,
//! reconnects (link cut, idle relay, rejection), drain, and command-line errors.

mod support;

use std::process::Command;
use std::time::{Duration, Instant};

use bytes::Bytes;
use lokadb_shared::tunnel::{ErrorCode, Event, Read, StreamId};
use support::{agent_args, closed_port, echo_server, Agent, FakeRelay, RelayConn};

const SECS_5: Duration = Duration::from_secs(5);

/// Writes `data` on `stream`, closes it, and reads the echo back to the end.
fn echo_round_trip(conn: &mut RelayConn, stream: StreamId, data: &[u8]) {
    conn.tunnel()
        .handle_write(stream, Bytes::copy_from_slice(data))
        .unwrap();
    conn.tunnel().handle_close(stream).unwrap();
    let mut got = Vec::new();
    conn.until(Duration::from_secs(20), |c| loop {
        match c.tunnel().handle_read(stream, usize::MAX) {
            Ok(Read::Data(d)) => got.extend_from_slice(&d),
            Ok(Read::Blocked) => return None,
            Ok(Read::Finished) => return Some(()),
            Err(e) => panic!("{e} after {} bytes", got.len()),
        }
    });
    assert_eq!(got.len(), data.len());
    assert!(got == data, "echo differs");
}

fn connect(relay: &FakeRelay, agent: &Agent) -> RelayConn {
    let mut conn = relay.accept(SECS_5);
    assert_eq!(conn.accept_hello(), "org.secret");
    conn.until(SECS_5, |c| {
        agent
            .log()
            .contains("connected to relay")
            .then_some(())
            .or_else(|| {
                c.events.retain(|e| !matches!(e, Event::Readable(_)));
                None
            })
    });
    conn
}

#[test]
fn streams_carry_bytes_both_ways() {
    let relay = FakeRelay::new();
    let agent = Agent::start(
        &agent_args(&relay, echo_server(), "org.secret"),
        &[("LOKADB_MUX_WINDOW_KB", "64")],
    );
    let mut conn = relay.accept(SECS_5);
    assert_eq!(conn.accept_hello(), "org.secret");
    let line = agent.stdout_line(&mut conn, SECS_5);
    assert_eq!(line, format!("lokadb-agent connected to {}", relay.addr()));

    // Two streams at once, one large (many windows of 64 KiB), one small.
    let big: Vec<u8> = (0..3_000_000u32).map(|i| (i * 7 % 251) as u8).collect();
    let a = conn.tunnel().handle_open("appdb").unwrap();
    let b = conn.tunnel().handle_open("appdb").unwrap();
    conn.tunnel()
        .handle_write(b, Bytes::from_static(b"\0\0\0\x08\x04\xd2\x16\x2f"))
        .unwrap();
    echo_round_trip(&mut conn, a, &big);
    let mut small = Vec::new();
    conn.until(SECS_5, |c| match c.tunnel().handle_read(b, 100) {
        Ok(Read::Data(d)) => {
            small.extend_from_slice(&d);
            (small.len() == 8).then_some(())
        }
        _ => None,
    });
    assert_eq!(small, b"\0\0\0\x08\x04\xd2\x16\x2f");
    assert!(conn.tunnel().stats().bytes_received >= 3_000_008);
}

#[test]
fn unreachable_postgres_resets_the_stream() {
    let relay = FakeRelay::new();
    let postgres = closed_port();
    let agent = Agent::start(&agent_args(&relay, postgres, "org.secret"), &[]);
    let mut conn = connect(&relay, &agent);
    let s = conn.tunnel().handle_open("appdb").unwrap();
    conn.tunnel()
        .handle_write(s, Bytes::from_static(b"startup"))
        .unwrap();
    let event = conn.until(SECS_5, |c| {
        let i = c
            .events
            .iter()
            .position(|e| matches!(e, Event::Reset { .. }))?;
        c.events.remove(i)
    });
    match event {
        Event::Reset {
            stream,
            code,
            reason,
            ..
        } => {
            assert_eq!(stream, s);
            assert_eq!(code, ErrorCode::CONNECT_FAILED);
            assert_eq!(
                reason,
                format!("could not connect to postgres {postgres}: Connection refused")
            );
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn reconnects_within_a_second_after_the_link_is_cut() {
    let relay = FakeRelay::new();
    let agent = Agent::start(&agent_args(&relay, echo_server(), "org.secret"), &[]);
    let conn = connect(&relay, &agent);
    let cut = Instant::now();
    drop(conn);
    let mut conn = relay.accept(SECS_5);
    assert!(
        cut.elapsed() < Duration::from_secs(1),
        "back after {:?}",
        cut.elapsed()
    );
    conn.accept_hello();
    agent.wait_log("tunnel to relay", SECS_5);
    // The new tunnel works.
    let s = conn.tunnel().handle_open("appdb").unwrap();
    echo_round_trip(&mut conn, s, b"after the reconnect");
}

#[test]
fn a_silent_relay_is_left_after_the_idle_timeout() {
    let relay = FakeRelay::new();
    let agent = Agent::start(&agent_args(&relay, echo_server(), "org.secret"), &[]);
    let _silent = connect(&relay, &agent);
    // Nothing more is read or written on `_silent`: no PONG, no PING.
    let start = Instant::now();
    let mut conn = relay.accept(Duration::from_secs(10));
    let waited = start.elapsed();
    assert!(waited >= Duration::from_secs(5), "left after {waited:?}");
    conn.accept_hello();
    agent.wait_log("nothing received from the peer", SECS_5);
}

#[test]
fn a_rejected_agent_logs_the_reason_and_retries() {
    let relay = FakeRelay::new();
    let agent = Agent::start(&agent_args(&relay, echo_server(), "wrong"), &[]);
    for _ in 0..3 {
        let mut conn = relay.accept(SECS_5);
        match conn.next_event(SECS_5) {
            Event::Hello(h) => assert_eq!(h.token, "wrong"),
            other => panic!("{other:?}"),
        }
        conn.tunnel()
            .handle_reject(ErrorCode::BAD_TOKEN, "unknown organization token".into())
            .unwrap();
        conn.wait_ended(SECS_5);
    }
    let log = agent.log();
    assert!(
        log.contains("ERROR")
            && log.contains("refused this agent (BAD_TOKEN): unknown organization token"),
        "{log}"
    );
    assert!(!log.contains("wrong"), "the token was logged:\n{log}");
}

#[test]
fn drain_moves_new_streams_to_a_new_tunnel_and_keeps_old_ones() {
    let relay = FakeRelay::new();
    let agent = Agent::start(&agent_args(&relay, echo_server(), "org.secret"), &[]);
    let mut old = connect(&relay, &agent);
    let s = old.tunnel().handle_open("appdb").unwrap();
    old.tunnel()
        .handle_write(s, Bytes::from_static(b"before "))
        .unwrap();
    old.until(SECS_5, |c| {
        matches!(c.tunnel().handle_read(s, 100), Ok(Read::Data(_))).then_some(())
    });
    old.tunnel().handle_drain().unwrap();
    old.pump();
    let drained = Instant::now();
    let mut new = relay.accept(SECS_5);
    assert!(drained.elapsed() < Duration::from_secs(1));
    new.accept_hello();
    // The old tunnel still carries its stream; then it is closed by the agent.
    echo_round_trip(&mut old, s, b"and after the drain");
    let why = old.wait_ended(SECS_5);
    assert!(why.contains("closed"), "{why}");
    let t = new.tunnel().handle_open("appdb").unwrap();
    echo_round_trip(&mut new, t, b"on the new tunnel");
}

#[test]
fn bad_arguments_exit_with_code_2() {
    let relay = FakeRelay::new();
    let pg = closed_port();
    let run = |extra: &[&str]| {
        let mut args = agent_args(&relay, pg, "org.secret");
        let i = args.iter().position(|a| a == extra[0]);
        match i {
            Some(i) => args[i + 1] = extra[1].to_string(),
            None => args.extend(extra.iter().map(|s| s.to_string())),
        }
        let out = Command::new(env!("CARGO_BIN_EXE_lokadb-agent"))
            .args(&args)
            .env_remove("LOKADB_MUX_WINDOW_KB")
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let long_token = "t".repeat(2000);
    for (extra, expect) in [
        (
            vec!["--ca", "/nonexistent/ca.pem"],
            "--ca: cannot read the CA file",
        ),
        (vec!["--max-conns", "0"], "--max-conns: must be at least 1"),
        (vec!["--token", long_token.as_str()], "the limit is 1024"),
        (
            vec!["--relay", "nohost"],
            "--relay: \"nohost\" is not HOST:PORT",
        ),
        (vec!["--postgres", "db:99999"], "--postgres:"),
    ] {
        let (code, stderr) = run(&extra);
        assert_eq!(code, Some(2), "{extra:?}: {stderr}");
        assert!(stderr.contains(expect), "{extra:?}: {stderr}");
    }
}
