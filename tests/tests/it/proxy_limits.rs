//! Limits and bad input: each gets a clear error, and the proxy and its other clients go on.

use crate::world::{connect, sqlstate, World};
use lokadb_shared::wire::notice::Notice;
use serde_json::json;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Reads everything until the proxy closes, with a deadline.
async fn read_to_close(s: &mut TcpStream) -> Vec<u8> {
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut out))
        .await
        .expect("proxy closed the connection");
    out
}

/// The first ErrorResponse in `bytes`.
fn first_error(bytes: &[u8]) -> Notice {
    let mut at = 0;
    while at + 5 <= bytes.len() {
        let len = u32::from_be_bytes(bytes[at + 1..at + 5].try_into().unwrap()) as usize;
        if bytes[at] == b'E' {
            return Notice::parse(&bytes[at + 5..at + 1 + len]).unwrap();
        }
        at += 1 + len;
    }
    panic!("no ErrorResponse in {bytes:?}");
}

/// A startup packet with `params` and protocol `version`.
pub(crate) fn startup(params: &[(&str, &str)], version: u32) -> Vec<u8> {
    let mut body = version.to_be_bytes().to_vec();
    for (k, v) in params {
        body.extend_from_slice(k.as_bytes());
        body.push(0);
        body.extend_from_slice(v.as_bytes());
        body.push(0);
    }
    body.push(0);
    let mut pkt = ((body.len() + 4) as u32).to_be_bytes().to_vec();
    pkt.extend(body);
    pkt
}

async fn assert_proxy_serves(w: &World) {
    let c = w.client().await.unwrap();
    assert_eq!(
        c.query_one("SELECT 41 + 1", &[])
            .await
            .unwrap()
            .get::<_, i32>(0),
        42
    );
}

#[tokio::test]
async fn max_connections_gives_53300_not_a_hang() {
    let w = World::start(json!({ "max_connections": 3 }), &[]).unwrap();
    let held: Vec<_> = futures_util::future::join_all((0..3).map(|_| w.client())).await;
    assert!(held.iter().all(Result::is_ok));
    let started = Instant::now();
    let e = connect(&w.dsn()).await.unwrap_err();
    assert_eq!(sqlstate(&e), "53300");
    assert!(started.elapsed() < Duration::from_secs(5));
    drop(held);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_proxy_serves(&w).await;
}

/// Idle sockets that never authenticate are limited by the handshake limits, not by
/// max_connections: they cannot lock authenticated clients out.
#[tokio::test]
async fn idle_sockets_do_not_lock_out_authenticated_clients() {
    let w = World::start(
        json!({ "max_connections": 2, "max_handshakes_per_address": 3, "auth_timeout": "60s" }),
        &[],
    )
    .unwrap();
    // Forty idle sockets from another address: at most three per core stay open, the rest
    // get 53300 naming the limit and are closed at once.
    let mut idle = Vec::new();
    for _ in 0..40 {
        let sock = tokio::net::TcpSocket::new_v4().unwrap();
        sock.bind("127.0.0.2:0".parse().unwrap()).unwrap();
        idle.push(sock.connect(w.proxy.addr()).await.unwrap());
    }
    let mut closed = 0;
    for s in &mut idle {
        let mut out = Vec::new();
        if let Ok(Ok(_)) =
            tokio::time::timeout(Duration::from_millis(500), s.read_to_end(&mut out)).await
        {
            let e = first_error(&out);
            assert_eq!(e.code, "53300", "{e:?}");
            let text = String::from_utf8_lossy(&out);
            assert!(text.contains("max_handshakes_per_address"), "{text}");
            closed += 1;
        }
    }
    assert!(
        (34..40).contains(&closed),
        "{closed} of 40 idle sockets closed at once (3 kept per core)"
    );
    // Authenticated clients from another address: max_connections counts only them.
    let held: Vec<_> = futures_util::future::join_all((0..2).map(|_| w.client())).await;
    assert!(held.iter().all(Result::is_ok), "{held:?}");
    let e = connect(&w.dsn()).await.unwrap_err();
    assert_eq!(sqlstate(&e), "53300", "{e:?}");
    drop(held);
    drop(idle);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_proxy_serves(&w).await;
}

#[tokio::test]
async fn an_oversized_message_is_refused_without_allocating_it() {
    let w = World::start(json!({ "max_message_bytes": 1_048_576 }), &[]).unwrap();
    let c = w.client().await.unwrap();
    let big = "x".repeat(2 << 20);
    let e = c
        .simple_query(&format!("SELECT '{big}'"))
        .await
        .unwrap_err();
    // The proxy closes the connection after its FATAL error.
    assert!(
        e.is_closed() || e.code().is_some_and(|c| c.code() == "54000"),
        "{e:?}"
    );
    // A raw client announcing 2 GB gets the error at once, before sending any of it.
    let mut s = TcpStream::connect(w.proxy.addr()).await.unwrap();
    // Log in first through tokio-postgres would hide the bytes; check the startup limit
    // instead: a startup packet claiming 100 MB.
    s.write_all(&(100u32 << 20).to_be_bytes()).await.unwrap();
    let out = read_to_close(&mut s).await;
    assert_eq!(first_error(&out).code, "54000");
    assert_proxy_serves(&w).await;
}

#[tokio::test]
async fn auth_timeout_drops_a_silent_client() {
    let w = World::start(json!({ "auth_timeout": "1s" }), &[]).unwrap();
    let mut s = TcpStream::connect(w.proxy.addr()).await.unwrap();
    let started = Instant::now();
    let out = read_to_close(&mut s).await;
    assert!(out.is_empty());
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(900) && waited < Duration::from_secs(5),
        "{waited:?}"
    );
    assert_proxy_serves(&w).await;
}

#[tokio::test]
async fn malformed_startup_packets_get_protocol_errors() {
    let w = World::start(json!({}), &[]).unwrap();
    // Length below the minimum.
    let mut s = TcpStream::connect(w.proxy.addr()).await.unwrap();
    s.write_all(&[0, 0, 0, 2]).await.unwrap();
    assert_eq!(first_error(&read_to_close(&mut s).await).code, "08P01");
    // A parameter without its value.
    let mut s = TcpStream::connect(w.proxy.addr()).await.unwrap();
    let mut pkt = vec![0, 0, 0, 0, 0, 3, 0, 0];
    pkt.extend_from_slice(b"user\0");
    let len = pkt.len() as u32;
    pkt[..4].copy_from_slice(&len.to_be_bytes());
    s.write_all(&pkt).await.unwrap();
    assert_eq!(first_error(&read_to_close(&mut s).await).code, "08P01");
    // No user.
    let mut s = TcpStream::connect(w.proxy.addr()).await.unwrap();
    s.write_all(&startup(&[("database", "app")], 196_608))
        .await
        .unwrap();
    assert_eq!(first_error(&read_to_close(&mut s).await).code, "28000");
    // Garbage (an HTTP request).
    let mut s = TcpStream::connect(w.proxy.addr()).await.unwrap();
    s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let out = read_to_close(&mut s).await;
    assert_eq!(first_error(&out).code, "54000");
    assert_proxy_serves(&w).await;
}

#[tokio::test]
async fn unknown_protocol_versions() {
    let w = World::start(json!({}), &[]).unwrap();
    let mut s = TcpStream::connect(w.proxy.addr()).await.unwrap();
    s.write_all(&startup(&[("user", "app")], 2 << 16))
        .await
        .unwrap();
    let e = first_error(&read_to_close(&mut s).await);
    assert_eq!(e.code, "0A000");
    assert!(
        e.message.contains("unsupported frontend protocol 2.0"),
        "{}",
        e.message
    );
    // 3.2 is negotiated down to 3.0 with NegotiateProtocolVersion, then auth goes on.
    let mut s = TcpStream::connect(w.proxy.addr()).await.unwrap();
    s.write_all(&startup(
        &[("user", "app"), ("database", "app"), ("_pq_.extra", "1")],
        (3 << 16) | 2,
    ))
    .await
    .unwrap();
    let mut head = [0u8; 1];
    s.read_exact(&mut head).await.unwrap();
    assert_eq!(head[0], b'v', "NegotiateProtocolVersion first");
    assert_proxy_serves(&w).await;
}

#[tokio::test]
async fn gssenc_request_is_refused_cleanly_and_startup_goes_on() {
    let w = World::start(json!({}), &[]).unwrap();
    let mut s = TcpStream::connect(w.proxy.addr()).await.unwrap();
    s.write_all(&[0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x30])
        .await
        .unwrap();
    let mut answer = [0u8; 1];
    s.read_exact(&mut answer).await.unwrap();
    assert_eq!(&answer, b"N");
    s.write_all(&startup(&[("user", "app"), ("database", "app")], 196_608))
        .await
        .unwrap();
    let mut tag = [0u8; 1];
    s.read_exact(&mut tag).await.unwrap();
    assert_eq!(tag[0], b'R', "authentication request follows");
}

#[tokio::test]
async fn garbage_after_login_ends_only_that_session() {
    let w = World::start(json!({}), &[("LOKADB_CORES", "1")]).unwrap();
    let other = w.client().await.unwrap();
    // Log in with psql-like raw bytes is long; use a real client, then a raw socket that
    // sends garbage after the startup: a message whose length field is 1.
    let mut s = TcpStream::connect(w.proxy.addr()).await.unwrap();
    s.write_all(&startup(&[("user", "app"), ("database", "app")], 196_608))
        .await
        .unwrap();
    let mut tag = [0u8; 1];
    s.read_exact(&mut tag).await.unwrap();
    assert_eq!(tag[0], b'R');
    s.write_all(b"Q\0\0\0\x01garbage").await.unwrap();
    let out = read_to_close(&mut s).await;
    assert!(!out.is_empty());
    assert_eq!(
        other
            .query_one("SELECT 7", &[])
            .await
            .unwrap()
            .get::<_, i32>(0),
        7
    );
}

#[tokio::test]
async fn an_upstream_that_dies_mid_query_gives_an_error_and_others_go_on() {
    let w = World::start(json!({}), &[]).unwrap();
    let victim = w.client().await.unwrap();
    let bystander = w.client().await.unwrap();
    let pid: i32 = victim
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    let query = tokio::spawn(async move { victim.simple_query("SELECT pg_sleep(10)").await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    w.cloud
        .psql("postgres", &format!("SELECT pg_terminate_backend({pid})"))
        .unwrap();
    let e = query.await.unwrap().unwrap_err();
    assert!(
        e.code().is_some_and(|c| c.code() == "57P01") || e.is_closed(),
        "{e:?}"
    );
    assert_eq!(
        bystander
            .query_one("SELECT 1", &[])
            .await
            .unwrap()
            .get::<_, i32>(0),
        1
    );
}

#[tokio::test]
async fn an_upstream_that_refuses_connections_gives_08001() {
    let w = World::start(json!({}), &[]).unwrap();
    let mut config = crate::world::config(&w.cloud, json!({}));
    // A port nobody listens on, for a second database; auth goes to the real cloud.
    let closed = lokadb_tests::free_port();
    config["databases"]["app"]["cloud"] = json!(format!("host=127.0.0.1 port={closed} dbname=app"));
    let proxy = lokadb_tests::proxy::Proxy::start(&config).unwrap();
    let dsn = w
        .dsn()
        .replace(&w.proxy.port().to_string(), &proxy.port().to_string());
    let e = connect(&dsn).await.unwrap_err();
    assert_eq!(sqlstate(&e), "08001");
    // The proxy is still up.
    let e = connect(&dsn).await.unwrap_err();
    assert_eq!(sqlstate(&e), "08001");
}
