//! Bad input on the relay's agent port: wrong tokens, garbage before and inside TLS,
//! oversized frames, frames for streams never opened, bad handshakes, agents that
//! go silent or never read. Each is refused or cut with a reason in the relay's log,
//! and a real agent of another organization, with its clients, keeps working during
//! and after.
//!
//! The offenders other than the wrong tokens are a fake agent written here: TCP,
//! rustls and frames encoded with `lokadb_shared::tunnel::Frame` (valid ones) or by
//! hand (invalid ones).

use crate::tunnel_world::*;
use crate::world::connect;
use bytes::BytesMut;
use lokadb_shared::tunnel::frame::{Hello, PROTOCOL_VERSION};
use lokadb_shared::tunnel::{ErrorCode, Frame, Role, StreamId, DEFAULT_WINDOW};
use lokadb_tests::agent::Agent;
use lokadb_tests::proxy::Proxy;
use rustls::pki_types::pem::PemObject;
use serde_json::{json, Value};
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The organization without a database whose agent is the fake one.
const FAKE_ORG: &str = "mallory";
/// The longest a query of the unaffected organization may take while another
/// organization's agent misbehaves (a stall behind it would take the idle timeout,
/// 6 s, or forever).
const CANARY_SLOWEST: Duration = Duration::from_secs(3);

/// Runs blocking code (the fake agent, the harness's waits) without holding up the
/// runtime's other tasks.
fn blocking<T>(f: impl FnOnce() -> T) -> T {
    tokio::task::block_in_place(f)
}

/// A relay knowing `org` (with its real agent) and [`FAKE_ORG`], whose token is
/// returned.
fn start_relay_with_fake(certs: &Certs, org: &Org) -> (Proxy, String) {
    let fake_token = format!("{FAKE_ORG}.{:032x}", rand::random::<u128>());
    let mut section = relay_section(certs, &[org], json!({}));
    section["tokens"][FAKE_ORG] = Value::String(token_hash(&fake_token));
    let relay = Proxy::builder(json!({ "relay": section }))
        .relay_only()
        .start()
        .unwrap();
    (relay, fake_token)
}

// ---- the unaffected organization ----

/// What the canary saw.
#[derive(Debug, Default)]
struct CanaryReport {
    queries: u32,
    connections: u32,
    failures: Vec<String>,
    slowest: Duration,
}

/// A client of a healthy organization querying through the relay in a loop (and
/// reconnecting every 10 queries) while a test misbehaves elsewhere.
struct Canary {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<CanaryReport>,
}

impl Canary {
    fn start(dsn: String) -> Canary {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let task = tokio::spawn(async move {
            let mut r = CanaryReport::default();
            while !flag.load(Ordering::Relaxed) {
                let started = Instant::now();
                let c = match connect(&dsn).await {
                    Ok(c) => c,
                    Err(e) => {
                        r.failures.push(format!("connect: {e:?}"));
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                r.slowest = r.slowest.max(started.elapsed());
                r.connections += 1;
                for _ in 0..10 {
                    let started = Instant::now();
                    match c.query_one("SELECT count(*) FROM items", &[]).await {
                        Ok(row) if row.get::<_, i64>(0) == 1000 => r.queries += 1,
                        Ok(row) => r.failures.push(format!("{} rows", row.get::<_, i64>(0))),
                        Err(e) => r.failures.push(format!("query: {e:?}")),
                    }
                    r.slowest = r.slowest.max(started.elapsed());
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            }
            r
        });
        Canary { stop, task }
    }

    /// Stops the loop and checks that every query worked, none slowly.
    async fn finish(self) -> CanaryReport {
        self.stop.store(true, Ordering::Relaxed);
        let r = self.task.await.unwrap();
        assert!(r.failures.is_empty(), "canary failures: {r:?}");
        assert!(r.queries >= 10 && r.connections >= 1, "{r:?}");
        assert!(r.slowest < CANARY_SLOWEST, "canary stalled: {r:?}");
        r
    }
}

/// One more connection and query of `org` through the relay, after the fact.
async fn still_works(relay: &Proxy, org: &str) {
    let c = connect(&relay_dsn(relay, org)).await.unwrap();
    let n: i64 = items(&c).await;
    assert_eq!(n, 1000);
}

// ---- the fake agent ----

fn tls_config(ca: &Path) -> Arc<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls::pki_types::CertificateDer::pem_file_iter(ca).unwrap() {
        roots.add(cert.unwrap()).unwrap();
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    Arc::new(
        rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth(),
    )
}

/// What a read from the relay gave.
#[derive(Debug)]
enum Got {
    Frame(Frame),
    /// The relay closed the connection (how).
    Closed(String),
    Timeout,
}

/// A hand-driven agent: blocking TCP, rustls, frames in and out.
struct FakeAgent {
    sock: TcpStream,
    tls: rustls::ClientConnection,
    /// Plaintext received and not yet a whole frame.
    plain: BytesMut,
    /// Set when the socket reached its end.
    eof: Option<String>,
}

impl FakeAgent {
    /// Connects and completes the TLS handshake.
    fn connect(addr: SocketAddr, ca: &Path) -> FakeAgent {
        let sock = TcpStream::connect(addr).unwrap();
        sock.set_nodelay(true).unwrap();
        sock.set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        sock.set_write_timeout(Some(Duration::from_secs(20)))
            .unwrap();
        let tls =
            rustls::ClientConnection::new(tls_config(ca), "localhost".try_into().unwrap()).unwrap();
        let mut agent = FakeAgent {
            sock,
            tls,
            plain: BytesMut::new(),
            eof: None,
        };
        while agent.tls.is_handshaking() {
            agent.tls.complete_io(&mut agent.sock).unwrap();
        }
        agent
    }

    /// Connects, authenticates with `token`, and checks the relay's HELLO_OK.
    fn authenticated(addr: SocketAddr, ca: &Path, token: &str, window: u32) -> FakeAgent {
        let mut agent = FakeAgent::connect(addr, ca);
        agent.send(&hello(PROTOCOL_VERSION, Role::Agent, window, token));
        match agent.recv(Duration::from_secs(5)) {
            Got::Frame(Frame::HelloOk(ok)) => assert_eq!(ok.version, PROTOCOL_VERSION),
            other => panic!("expected HELLO_OK, got {other:?}"),
        }
        agent
    }

    /// Sends plaintext through TLS as it is.
    fn send_raw(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.tls.writer().write_all(bytes)?;
        while self.tls.wants_write() {
            self.tls.write_tls(&mut self.sock)?;
        }
        Ok(())
    }

    fn send(&mut self, frame: &Frame) {
        let mut out = BytesMut::new();
        frame.encode(&mut out);
        self.send_raw(&out).unwrap();
    }

    /// The next frame from the relay.
    fn recv(&mut self, timeout: Duration) -> Got {
        let deadline = Instant::now() + timeout;
        let mut scratch = vec![0u8; 64 * 1024];
        loop {
            match Frame::decode(&mut self.plain) {
                Ok(Some(frame)) => return Got::Frame(frame),
                Ok(None) => {}
                Err(e) => panic!("the relay sent an invalid frame: {e}"),
            }
            match self.tls.reader().read(&mut scratch) {
                Ok(0) => return Got::Closed("TLS close_notify".into()),
                Ok(n) => {
                    self.plain.extend_from_slice(&scratch[..n]);
                    continue;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Got::Closed(format!("TLS: {e}")),
            }
            if let Some(why) = &self.eof {
                return Got::Closed(why.clone());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Got::Timeout;
            }
            self.sock.set_read_timeout(Some(left)).unwrap();
            match self.tls.read_tls(&mut self.sock) {
                Ok(0) => self.eof = Some("end of file".into()),
                Ok(_) => {}
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) =>
                {
                    return Got::Timeout
                }
                Err(e) => self.eof = Some(format!("socket: {e}")),
            }
            if let Err(e) = self.tls.process_new_packets() {
                return Got::Closed(format!("TLS alert: {e}"));
            }
        }
    }

    /// Frames received (keepalive PINGs left out) until the relay closes the
    /// connection; panics if it does not within `timeout`.
    fn expect_cut(&mut self, timeout: Duration) -> Vec<Frame> {
        let deadline = Instant::now() + timeout;
        let mut frames = Vec::new();
        loop {
            match self.recv(deadline.saturating_duration_since(Instant::now())) {
                Got::Frame(Frame::Ping(_)) => {}
                Got::Frame(f) => frames.push(f),
                Got::Closed(how) => {
                    eprintln!("fake agent: the relay closed the connection ({how})");
                    return frames;
                }
                Got::Timeout => panic!("the relay did not close within {timeout:?}: {frames:?}"),
            }
        }
    }
}

fn hello(version: u16, role: Role, window: u32, token: &str) -> Frame {
    Frame::Hello(Hello {
        version,
        role,
        window,
        max_streams: 100,
        token: token.to_owned(),
    })
}

/// The one RESET on stream 0 in `frames`, as (code, reason).
fn tunnel_reset(frames: &[Frame]) -> (ErrorCode, String) {
    match frames {
        [Frame::Reset {
            stream: StreamId::TUNNEL,
            code,
            reason,
        }] => (*code, reason.clone()),
        other => panic!("expected one RESET on stream 0, got {other:?}"),
    }
}

/// Waits for `needle` in the relay's log.
fn logged(relay: &Proxy, needle: &str) {
    assert!(
        blocking(|| relay.wait_for_output(needle, Duration::from_secs(5))),
        "the relay did not log {needle:?}:\n{}",
        relay.output()
    );
}

/// The relay's log lines that contain every one of `needles`.
fn log_lines(relay: &Proxy, needles: &[&str]) -> Vec<String> {
    relay
        .output()
        .lines()
        .filter(|l| needles.iter().all(|n| l.contains(n)))
        .map(str::to_owned)
        .collect()
}

// ---- the tests ----

/// The real agent binary with a wrong secret, a token of an organization the relay
/// does not know, and a token without an organization: each is refused with
/// HELLO_REJECT(BAD_TOKEN), which the agent logs; the relay logs "agent refused" and
/// the precise reason (which the agent is not told). The live agent of the same
/// organization, and its clients, are untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_tokens_are_refused_and_logged() {
    let certs = Certs::new().unwrap();
    let acme = Org::start("acme").unwrap();
    let relay = start_relay(&certs, &[&acme], json!({}), &[]).unwrap();
    let agents_addr = addrs(&relay).agents;
    let good = start_agent(&certs, &acme, agents_addr, &[]).unwrap();
    let canary = Canary::start(relay_dsn(&relay, "acme"));

    let wrong_secret = format!("acme.{:032x}", rand::random::<u128>());
    let unknown_org = format!("initech.{:032x}", rand::random::<u128>());
    let cases = [
        (wrong_secret.as_str(), "wrong token for organization"),
        (unknown_org.as_str(), "is not in relay.tokens"),
        ("no-organization-here", "not of the form ORG.SECRET"),
    ];
    for (token, relay_reason) in cases {
        let bad = Agent::spawn(
            &[agents_addr],
            token,
            acme.db.addr(),
            &certs.files.ca,
            &[],
            &[],
        )
        .unwrap();
        let told = "refused this agent (BAD_TOKEN): token not valid for this relay";
        assert!(
            blocking(|| bad.wait_for_output(told, Duration::from_secs(10))),
            "{}",
            bad.output()
        );
        assert!(!bad.output().contains("lokadb-agent connected to"));
        // The agent is not told which check failed; the relay's log says.
        assert!(!bad.output().contains(relay_reason), "{}", bad.output());
        logged(&relay, relay_reason);
        // The token itself is never printed.
        assert!(!relay.output().contains(token), "{}", relay.output());
    }
    let out = relay.output();
    assert!(out.matches("agent refused").count() >= 3, "{out}");
    assert!(!out.contains("agent disconnected"), "{out}");

    canary.finish().await;
    still_works(&relay, "acme").await;
    assert_eq!(good.count_output("lokadb-agent connected to"), 1);
}

/// Plain text on the agent port (no TLS) is cut with a TLS alert and logged; a TCP
/// connection that sends nothing, and one that completes TLS and then sends
/// nothing, are cut at the idle timeout (6 s, which covers the handshake).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_or_silence_before_the_handshake_is_cut() {
    let certs = Certs::new().unwrap();
    let acme = Org::start("acme").unwrap();
    let relay = start_relay(&certs, &[&acme], json!({}), &[]).unwrap();
    let agents_addr = addrs(&relay).agents;
    let _good = start_agent(&certs, &acme, agents_addr, &[]).unwrap();
    let canary = Canary::start(relay_dsn(&relay, "acme"));

    // The silent ones first: their clock runs while the rest of the test goes on.
    let started = Instant::now();
    let mut silent_tcp = tokio::net::TcpStream::connect(agents_addr).await.unwrap();
    let mut silent_tls = blocking(|| FakeAgent::connect(agents_addr, &certs.files.ca));

    // An HTTP request instead of a TLS ClientHello.
    let mut plain = tokio::net::TcpStream::connect(agents_addr).await.unwrap();
    plain
        .write_all(b"GET / HTTP/1.1\r\nHost: relay\r\n\r\n")
        .await
        .unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), plain.read_to_end(&mut answer))
        .await
        .expect("the relay did not close a plain-text connection")
        .unwrap();
    // At most a TLS alert record (content type 21), never anything else.
    assert!(answer.is_empty() || answer[0] == 21, "{answer:?}");
    logged(&relay, "agent connection closed before authenticating");
    assert_eq!(
        log_lines(&relay, &["closed before authenticating", "TLS"]).len(),
        1,
        "{}",
        relay.output()
    );

    // The silent TCP connection: cut by the idle timeout, not before.
    let mut got = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(12), silent_tcp.read_to_end(&mut got))
        .await
        .expect("the relay kept a silent connection past its idle timeout");
    // Nothing, or only a TLS alert (close_notify).
    assert!(got.is_empty() || got[0] == 21, "{got:?}");
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_secs(5) && waited < Duration::from_secs(10),
        "{waited:?}"
    );
    // The silent TLS connection is cut the same way, with RESET(IDLE_TIMEOUT).
    let frames = blocking(|| silent_tls.expect_cut(Duration::from_secs(5)));
    let (code, reason) = tunnel_reset(&frames);
    assert_eq!(code, ErrorCode::IDLE_TIMEOUT, "{reason}");
    logged(&relay, "nothing received from the peer for 6s");
    // The relay logs once its last bytes (RESET, close_notify) are written, which the
    // fake agent may read first.
    let deadline = Instant::now() + Duration::from_secs(3);
    while relay
        .output()
        .matches("agent connection closed before authenticating")
        .count()
        < 3
    {
        assert!(Instant::now() < deadline, "{}", relay.output());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    canary.finish().await;
    still_works(&relay, "acme").await;
}

/// Handshakes that are wrong: another protocol version (HELLO_REJECT BAD_VERSION
/// naming both versions), a relay's HELLO (BAD_ROLE), bytes that are not a HELLO
/// inside TLS, a HELLO with the wrong magic, a PING before HELLO (RESET PROTOCOL).
/// Each is cut and logged; the real agent goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_handshakes_are_rejected() {
    let certs = Certs::new().unwrap();
    let acme = Org::start("acme").unwrap();
    let (relay, fake_token) = start_relay_with_fake(&certs, &acme);
    let agents_addr = addrs(&relay).agents;
    let _good = start_agent(&certs, &acme, agents_addr, &[]).unwrap();
    let canary = Canary::start(relay_dsn(&relay, "acme"));
    let ca = certs.files.ca.clone();

    // Another version, with a valid token: refused before the token is looked at.
    let frames = blocking(|| {
        let mut a = FakeAgent::connect(agents_addr, &ca);
        a.send(&hello(2, Role::Agent, DEFAULT_WINDOW, &fake_token));
        a.expect_cut(Duration::from_secs(5))
    });
    match frames.as_slice() {
        [Frame::HelloReject { code, reason }] => {
            assert_eq!(*code, ErrorCode::BAD_VERSION);
            assert!(
                reason.contains("version 1") && reason.contains("sent 2"),
                "{reason}"
            );
        }
        other => panic!("{other:?}"),
    }
    logged(
        &relay,
        "peer speaks tunnel protocol version 2, this end speaks 1",
    );

    // A relay dialing a relay.
    let frames = blocking(|| {
        let mut a = FakeAgent::connect(agents_addr, &ca);
        a.send(&hello(
            PROTOCOL_VERSION,
            Role::Relay,
            DEFAULT_WINDOW,
            &fake_token,
        ));
        a.expect_cut(Duration::from_secs(5))
    });
    match frames.as_slice() {
        [Frame::HelloReject { code, .. }] => assert_eq!(*code, ErrorCode::BAD_ROLE),
        other => panic!("{other:?}"),
    }
    logged(&relay, "HELLO from a relay, expected an agent");

    // Raw bytes instead of a HELLO: an HTTP request inside TLS ('G' = 0x47).
    let frames = blocking(|| {
        let mut a = FakeAgent::connect(agents_addr, &ca);
        a.send_raw(b"GET / HTTP/1.1\r\n\r\n").unwrap();
        a.expect_cut(Duration::from_secs(5))
    });
    let (code, reason) = tunnel_reset(&frames);
    assert_eq!(code, ErrorCode::PROTOCOL);
    assert!(
        reason.contains("unknown tunnel frame type 0x47"),
        "{reason}"
    );
    logged(&relay, "unknown tunnel frame type 0x47");

    // A HELLO whose magic is not "LOKA".
    let frames = blocking(|| {
        let mut a = FakeAgent::connect(agents_addr, &ca);
        let mut out = BytesMut::new();
        hello(PROTOCOL_VERSION, Role::Agent, DEFAULT_WINDOW, &fake_token).encode(&mut out);
        out[10..14].copy_from_slice(b"HTTP");
        a.send_raw(&out).unwrap();
        a.expect_cut(Duration::from_secs(5))
    });
    let (code, reason) = tunnel_reset(&frames);
    assert_eq!(code, ErrorCode::PROTOCOL);
    assert!(reason.contains("magic"), "{reason}");
    logged(&relay, "HELLO frame with an invalid magic");

    // A PING before HELLO.
    let frames = blocking(|| {
        let mut a = FakeAgent::connect(agents_addr, &ca);
        a.send(&Frame::Ping([1; 8]));
        a.expect_cut(Duration::from_secs(5))
    });
    let (code, reason) = tunnel_reset(&frames);
    assert_eq!(code, ErrorCode::PROTOCOL);
    assert!(
        reason.contains("unexpected PING frame while awaiting HELLO"),
        "{reason}"
    );
    logged(&relay, "unexpected PING frame while awaiting HELLO");

    let out = relay.output();
    assert_eq!(
        out.matches("agent connection closed before authenticating")
            .count(),
        5,
        "{out}"
    );
    assert!(
        log_lines(&relay, &["agent connected", FAKE_ORG]).is_empty(),
        "{out}"
    );

    // The fake organization's token still works: nothing was left registered.
    blocking(|| FakeAgent::authenticated(agents_addr, &ca, &fake_token, DEFAULT_WINDOW));
    canary.finish().await;
    still_works(&relay, "acme").await;
}

/// Malformed frames after a valid handshake: an unknown frame type, a DATA header
/// announcing a 65,537-byte body, and one announcing 4 GiB (only the header is sent:
/// the relay must refuse it from the header, without waiting for or buffering the
/// body), a DATA frame on stream 0, a zero WINDOW_UPDATE, a second HELLO. Each ends
/// only that tunnel, with RESET(0, PROTOCOL, the decoder's message) and "agent
/// disconnected" with the reason in the log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_frames_cut_only_their_tunnel() {
    let certs = Certs::new().unwrap();
    let acme = Org::start("acme").unwrap();
    let (relay, fake_token) = start_relay_with_fake(&certs, &acme);
    let agents_addr = addrs(&relay).agents;
    let _good = start_agent(&certs, &acme, agents_addr, &[]).unwrap();
    let acme_client = connect(&relay_dsn(&relay, "acme")).await.unwrap();
    let canary = Canary::start(relay_dsn(&relay, "acme"));
    let ca = certs.files.ca.clone();

    let mut second_hello = BytesMut::new();
    hello(PROTOCOL_VERSION, Role::Agent, DEFAULT_WINDOW, &fake_token).encode(&mut second_hello);
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        (
            "unknown type",
            vec![0x7f, 0, 0, 0, 0, 1, 0, 0, 0, 3, b'a', b'b', b'c'],
            "unknown tunnel frame type 0x7f",
        ),
        (
            "oversized DATA header",
            vec![0x11, 0, 0, 0, 0, 1, 0, 1, 0, 1],
            "DATA frame with a 65537-byte body (allowed: 0 to 65536 bytes)",
        ),
        (
            "4 GiB DATA header",
            vec![0x11, 0, 0, 0, 0, 1, 0xff, 0xff, 0xff, 0xff],
            "DATA frame with a 4294967295-byte body",
        ),
        (
            "DATA on stream 0",
            vec![0x11, 0, 0, 0, 0, 0, 0, 0, 0, 1, b'x'],
            "DATA frame on tunnel stream 0",
        ),
        (
            "zero WINDOW_UPDATE",
            vec![0x12, 0, 0, 0, 0, 1, 0, 0, 0, 4, 0, 0, 0, 0],
            "WINDOW_UPDATE frame with an invalid increment",
        ),
        (
            "second HELLO",
            second_hello.to_vec(),
            "unexpected HELLO frame while the handshake is over",
        ),
    ];
    for (what, bytes, message) in cases {
        let started = Instant::now();
        let frames = blocking(|| {
            let mut a = FakeAgent::authenticated(agents_addr, &ca, &fake_token, DEFAULT_WINDOW);
            a.send_raw(&bytes).unwrap();
            a.expect_cut(Duration::from_secs(5))
        });
        let (code, reason) = tunnel_reset(&frames);
        assert_eq!(code, ErrorCode::PROTOCOL, "{what}: {reason}");
        assert!(reason.contains(message), "{what}: {reason}");
        // Cut at once, not at the idle timeout.
        assert!(started.elapsed() < Duration::from_secs(3), "{what}");
        logged(&relay, message);
        // The live acme tunnel and its open session are untouched.
        acme_client.simple_query("SELECT 1").await.unwrap();
    }
    let out = relay.output();
    assert_eq!(
        out.matches("agent disconnected").count(),
        6,
        "one per malformed tunnel, none for acme:\n{out}"
    );
    assert!(
        log_lines(&relay, &["agent disconnected", "acme"]).is_empty(),
        "{out}"
    );

    canary.finish().await;
    let n: i64 = items(&acme_client).await;
    assert_eq!(n, 1000);
    still_works(&relay, "acme").await;
}

/// DATA, WINDOW_UPDATE and CLOSE for streams that were never opened (either
/// parity), and a RESET for one, do not end the tunnel: the relay answers
/// RESET(STREAM_CLOSED) to each of the first three, ignores the RESET, answers a PING
/// after them, and still routes clients to this agent; the agent's stream-level
/// refusal reaches the client as an error naming the organization.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frames_for_streams_never_opened_are_reset_and_the_tunnel_stays() {
    let certs = Certs::new().unwrap();
    let acme = Org::start("acme").unwrap();
    let (relay, fake_token) = start_relay_with_fake(&certs, &acme);
    let agents_addr = addrs(&relay).agents;
    let _good = start_agent(&certs, &acme, agents_addr, &[]).unwrap();
    let canary = Canary::start(relay_dsn(&relay, "acme"));
    let mut fake = blocking(|| {
        FakeAgent::authenticated(agents_addr, &certs.files.ca, &fake_token, DEFAULT_WINDOW)
    });

    let sent = [
        Frame::Data {
            stream: StreamId(7),
            payload: bytes::Bytes::from_static(b"hello"),
        },
        Frame::Data {
            stream: StreamId(2),
            payload: bytes::Bytes::from_static(b"hello"),
        },
        Frame::WindowUpdate {
            stream: StreamId(9),
            increment: 1000,
        },
        Frame::Close {
            stream: StreamId(11),
        },
        Frame::Reset {
            stream: StreamId(13),
            code: ErrorCode::CANCEL,
            reason: "never answered".into(),
        },
        Frame::Ping(*b"pingpong"),
    ];
    let answers = blocking(|| {
        for f in &sent {
            fake.send(f);
        }
        let mut answers = Vec::new();
        loop {
            match fake.recv(Duration::from_secs(5)) {
                Got::Frame(Frame::Ping(_)) => {}
                Got::Frame(f @ Frame::Pong(_)) => {
                    answers.push(f);
                    return answers;
                }
                Got::Frame(f) => answers.push(f),
                other => panic!("{other:?} after {answers:?}"),
            }
        }
    });
    let expected = [
        (7, "DATA for relay stream 7, which was never opened"),
        (2, "DATA for agent stream 2, which was never opened"),
        (
            9,
            "WINDOW_UPDATE for relay stream 9, which was never opened",
        ),
        (11, "CLOSE for relay stream 11, which was never opened"),
    ];
    assert_eq!(answers.len(), expected.len() + 1, "{answers:?}");
    for (got, (id, text)) in answers.iter().zip(expected) {
        match got {
            Frame::Reset {
                stream,
                code,
                reason,
            } => {
                assert_eq!(*stream, StreamId(id));
                assert_eq!(*code, ErrorCode::STREAM_CLOSED);
                assert_eq!(reason, text);
            }
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(answers.last(), Some(&Frame::Pong(*b"pingpong")));
    assert!(!relay.output().contains("agent disconnected"));

    // The tunnel still serves its organization: a client's stream arrives (OPEN and
    // the startup packet), and the agent's refusal reaches the client.
    let client = tokio::spawn({
        let dsn = relay_dsn(&relay, FAKE_ORG);
        async move { connect(&dsn).await.map(|_| ()) }
    });
    let stream = blocking(|| loop {
        match fake.recv(Duration::from_secs(5)) {
            Got::Frame(Frame::Open { stream, target }) => {
                assert_eq!(target, ORG_DB);
                return stream;
            }
            Got::Frame(Frame::Ping(_) | Frame::Data { .. }) => {}
            other => panic!("{other:?}"),
        }
    });
    assert_eq!(stream, StreamId(1));
    blocking(|| {
        fake.send(&Frame::Reset {
            stream,
            code: ErrorCode::CONNECT_FAILED,
            reason: "no database here".into(),
        })
    });
    let e = tokio::time::timeout(Duration::from_secs(5), client)
        .await
        .expect("the client was not answered")
        .unwrap()
        .unwrap_err();
    let msg = e
        .as_db_error()
        .map_or_else(|| e.to_string(), |d| d.message().to_owned());
    assert!(
        msg.contains(&format!(
            "\"{FAKE_ORG}\" could not connect to its database: no database here"
        )),
        "{msg}"
    );

    canary.finish().await;
    still_works(&relay, "acme").await;
    assert!(!relay.output().contains("agent disconnected"));
    drop(fake);
}

/// An agent that authenticates and then neither reads nor writes, while a client of
/// its organization waits on it: the relay cuts it at the idle timeout (6 s), the
/// waiting client gets an error naming the organization instead of hanging, and the
/// other organization never notices.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_agent_is_cut_and_its_client_gets_an_error() {
    let certs = Certs::new().unwrap();
    let acme = Org::start("acme").unwrap();
    let (relay, fake_token) = start_relay_with_fake(&certs, &acme);
    let agents_addr = addrs(&relay).agents;
    let _good = start_agent(&certs, &acme, agents_addr, &[]).unwrap();
    let canary = Canary::start(relay_dsn(&relay, "acme"));
    let fake = blocking(|| {
        FakeAgent::authenticated(agents_addr, &certs.files.ca, &fake_token, DEFAULT_WINDOW)
    });
    logged(&relay, "agent connected");

    let started = Instant::now();
    let e = tokio::time::timeout(
        Duration::from_secs(15),
        connect(&relay_dsn(&relay, FAKE_ORG)),
    )
    .await
    .expect("the client of a silent agent hung")
    .map(|_| ())
    .unwrap_err();
    let waited = started.elapsed();
    let msg = e
        .as_db_error()
        .map_or_else(|| e.to_string(), |d| d.message().to_owned());
    assert!(
        msg.contains(&format!("the tunnel of organization \"{FAKE_ORG}\" ended")),
        "{msg}"
    );
    assert!(msg.contains("nothing received from the peer"), "{msg}");
    assert!(waited < Duration::from_secs(10), "{waited:?}");
    logged(&relay, "agent disconnected");
    logged(&relay, "nothing received from the peer for 6s");

    canary.finish().await;
    still_works(&relay, "acme").await;
    drop(fake);
}

/// An agent that announces a 64 MiB window, never reads its socket, and floods PINGs
/// while clients of its organization push hundreds of megabytes at it: the relay
/// reads only what fits (the clients are held back by TCP), its memory stays
/// bounded, and once the PONGs owed pass the control-frame limit it cuts the tunnel
/// ("peer does not read"). The clients get errors, the other organization is never
/// stalled, and the relay lives on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_that_never_reads_is_cut_and_memory_stays_bounded() {
    let certs = Certs::new().unwrap();
    let acme = Org::start("acme").unwrap();
    let (relay, fake_token) = start_relay_with_fake(&certs, &acme);
    let agents_addr = addrs(&relay).agents;
    let _good = start_agent(&certs, &acme, agents_addr, &[]).unwrap();
    let canary = Canary::start(relay_dsn(&relay, "acme"));
    let mut fake =
        blocking(|| FakeAgent::authenticated(agents_addr, &certs.files.ca, &fake_token, 64 << 20));
    let rss_before = lokadb_tests::rss_kib(relay.pid());

    // Two raw clients pushing 256 MB each into streams of the stuck organization.
    const PUSH: u64 = 256 << 20;
    let pushed = Arc::new(AtomicU64::new(0));
    let mut pushers = Vec::new();
    for _ in 0..2 {
        let pushed = pushed.clone();
        let addr = addrs(&relay).postgres;
        pushers.push(tokio::spawn(async move {
            let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
            let mut startup = Vec::new();
            lokadb_shared::wire::startup::encode_startup(
                &[
                    ("user", "raw"),
                    ("database", &format!("{FAKE_ORG}/{ORG_DB}")),
                ],
                &mut startup,
            );
            s.write_all(&startup).await.unwrap();
            let chunk = vec![b'x'; 64 * 1024];
            let mut sent = 0u64;
            while sent < PUSH {
                s.write_all(&chunk).await?;
                sent += chunk.len() as u64;
                pushed.fetch_add(chunk.len() as u64, Ordering::Relaxed);
            }
            Ok::<u64, io::Error>(sent)
        }));
    }
    // A regular client of the stuck organization, waiting for its login.
    let waiting = tokio::spawn({
        let dsn = relay_dsn(&relay, FAKE_ORG);
        async move { connect(&dsn).await.map(|_| ()) }
    });

    // Let the clients' streams open before the agent misbehaves.
    tokio::time::sleep(Duration::from_millis(300)).await;

    // PINGs, a thousand per write, without ever reading.
    let flooding = Arc::new(AtomicBool::new(true));
    let flooder = std::thread::spawn({
        let flooding = flooding.clone();
        move || {
            let mut batch = BytesMut::new();
            for i in 0..1000u64 {
                Frame::Ping(i.to_be_bytes()).encode(&mut batch);
            }
            let mut pings = 0u64;
            let end = loop {
                if !flooding.load(Ordering::Relaxed) {
                    break "stopped".to_owned();
                }
                match fake.send_raw(&batch) {
                    Ok(()) => pings += 1000,
                    Err(e) => break e.to_string(),
                }
            };
            (pings, end)
        }
    });

    // Cut within the 15 s allowed, sampling the relay's memory meanwhile.
    let started = Instant::now();
    let mut rss_max = rss_before;
    while !relay.output().contains("peer does not read") {
        rss_max = rss_max.max(lokadb_tests::rss_kib(relay.pid()));
        assert!(
            started.elapsed() < Duration::from_secs(15),
            "not cut after 15 s; pushed {} bytes; relay:\n{}",
            pushed.load(Ordering::Relaxed),
            relay.output()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    logged(&relay, "agent disconnected");
    logged(&relay, "control frames queued for it");
    flooding.store(false, Ordering::Relaxed);
    let (pings, end) = blocking(|| flooder.join().unwrap());
    assert!(pings >= 4096, "{pings} PINGs sent ({end})");

    // Every client of the stuck organization ends with an error, none hangs.
    let within = Duration::from_secs(15);
    for p in pushers {
        let r = tokio::time::timeout(within, p)
            .await
            .expect("a pushing client hung")
            .unwrap();
        assert!(
            r.is_err(),
            "a client pushed everything into a stuck agent: {r:?}"
        );
    }
    let e = tokio::time::timeout(within, waiting)
        .await
        .expect("the waiting client hung")
        .unwrap()
        .unwrap_err();
    let msg = e
        .as_db_error()
        .map_or_else(|| e.to_string(), |d| d.message().to_owned());
    assert!(msg.contains(FAKE_ORG), "{msg}");

    // The relay held back the clients instead of buffering for the stuck agent.
    let total = pushed.load(Ordering::Relaxed);
    eprintln!(
        "stuck agent cut after {:?}: {pings} PINGs sent, {total} bytes accepted from its clients, relay RSS {rss_before} KiB -> at most {rss_max} KiB",
        started.elapsed()
    );
    assert!(total < 64 << 20, "{total} bytes accepted for a stuck agent");
    let grown = rss_max.saturating_sub(rss_before);
    assert!(
        grown < 48 * 1024,
        "relay RSS grew by {grown} KiB (accepted {total} bytes)"
    );

    canary.finish().await;
    still_works(&relay, "acme").await;
    // The relay process is alive and still serves.
    assert!(std::path::Path::new(&format!("/proc/{}", relay.pid())).exists());
}

/// A HELLO trickled one byte every 4 s (each byte resets the idle timeout) is cut by
/// the relay's authentication deadline, with a logged reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trickled_hello_is_cut_at_the_authentication_deadline() {
    let certs = Certs::new().unwrap();
    let acme = Org::start("acme").unwrap();
    let (relay, fake_token) = start_relay_with_fake(&certs, &acme);
    let agents_addr = addrs(&relay).agents;
    let ca = certs.files.ca.clone();
    let started = Instant::now();
    let outcome = blocking(|| {
        let mut a = FakeAgent::connect(agents_addr, &ca);
        let mut out = BytesMut::new();
        hello(PROTOCOL_VERSION, Role::Agent, DEFAULT_WINDOW, &fake_token).encode(&mut out);
        for b in out.iter() {
            if a.send_raw(&[*b]).is_err() {
                return "cut";
            }
            match a.recv(Duration::from_secs(4)) {
                Got::Timeout => {}
                _ => return "cut",
            }
            if started.elapsed() > Duration::from_secs(20) {
                return "still open after 20 s";
            }
        }
        "the whole HELLO went through"
    });
    assert_eq!(outcome, "cut");
    let took = started.elapsed();
    assert!(took < Duration::from_secs(16), "{took:?}");
    logged(&relay, "did not authenticate within 10s");
}

/// Silent connections from one address on both relay listeners: past
/// `relay.max_handshakes_per_address` each new one is closed at once (the Postgres listener
/// says 53300 first), and an agent and clients from another address connect and work
/// meanwhile; once the silent ones go, the address is served again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_connections_from_one_address_hold_only_their_share() {
    let certs = Certs::new().unwrap();
    let org = Org::start("acme").unwrap();
    let relay = start_relay(
        &certs,
        &[&org],
        json!({ "max_handshakes_per_address": 4 }),
        &[],
    )
    .unwrap();
    let ports = addrs(&relay);
    let held: Vec<TcpStream> = (0..4)
        .flat_map(|_| {
            [
                lokadb_tests::connect_from("127.0.0.2:0", ports.agents).unwrap(),
                lokadb_tests::connect_from("127.0.0.2:0", ports.postgres).unwrap(),
            ]
        })
        .collect();
    // Counted once accepted: give the relay a moment to take all eight.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let refused_at_once = |to: SocketAddr| {
        let mut s = lokadb_tests::connect_from("127.0.0.2:0", to).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let mut answer = Vec::new();
        match s.read_to_end(&mut answer) {
            Ok(_) => answer,
            Err(e) if e.kind() == io::ErrorKind::ConnectionReset => answer,
            Err(e) => panic!("the connection over the limit was not closed: {e}"),
        }
    };
    assert!(blocking(|| refused_at_once(ports.agents)).is_empty());
    let answer = blocking(|| refused_at_once(ports.postgres));
    let text = String::from_utf8_lossy(&answer);
    assert!(
        answer.first() == Some(&b'E') && text.contains("53300"),
        "{text}"
    );

    // Another address is not held up: an agent authenticates, a client goes through.
    let _agent = start_agent(&certs, &org, ports.agents, &[]).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let dsn = relay_dsn(&relay, "acme");
    loop {
        if let Ok(c) = connect(&dsn).await {
            if c.simple_query("SELECT 1").await.is_ok() {
                break;
            }
        }
        assert!(
            Instant::now() < deadline,
            "acme unreachable during the flood"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    still_works(&relay, "acme").await;

    drop(held);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let mut s = lokadb_tests::connect_from("127.0.0.2:0", ports.postgres).unwrap();
        s.set_read_timeout(Some(Duration::from_millis(300)))
            .unwrap();
        // A place is free again when the relay waits for a startup packet (no answer).
        let mut byte = [0u8; 1];
        if matches!(blocking(|| s.read(&mut byte)), Err(e) if e.kind() == io::ErrorKind::WouldBlock || e.kind() == io::ErrorKind::TimedOut)
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the address was not served again"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
