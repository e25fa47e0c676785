//! `GET /metrics`: Prometheus' text format, every name prefixed `lokadb_`, counters that
//! follow the traffic, the relay's counters when it runs inside the proxy, and bad requests
//! answered without disturbing anything.

use crate::tunnel_world::{relay_section, Certs};
use crate::world::World;
use serde_json::json;
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

/// The raw answer to `request` sent to `addr`.
fn http(addr: SocketAddr, request: &[u8]) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    s.write_all(request).unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

/// The samples of a scrape, by name with labels.
fn scrape(addr: SocketAddr) -> HashMap<String, u64> {
    let answer = http(addr, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
    let (head, body) = answer.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.1 200 OK"), "{head}");
    assert!(head.contains("text/plain; version=0.0.4"), "{head}");
    let mut samples = HashMap::new();
    for line in body.lines().filter(|l| !l.is_empty()) {
        if let Some(rest) = line.strip_prefix("# ") {
            let name = rest.split_whitespace().nth(1).unwrap_or_default();
            assert!(name.starts_with("lokadb_"), "{line}");
            continue;
        }
        let (name, value) = line.rsplit_once(' ').unwrap();
        assert!(name.starts_with("lokadb_"), "{line}");
        // Counters and gauges are whole; a histogram's _sum is in seconds (whole here).
        samples.insert(name.to_owned(), value.parse::<f64>().unwrap() as u64);
    }
    samples
}

/// Scrapes until `ok` holds (counters are published once a second).
async fn scrape_until(
    addr: SocketAddr,
    ok: impl Fn(&HashMap<String, u64>) -> bool,
) -> HashMap<String, u64> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let samples = scrape(addr);
        if ok(&samples) {
            return samples;
        }
        assert!(Instant::now() < deadline, "never reached: {samples:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn the_endpoint_follows_the_traffic() {
    let certs = Certs::new().unwrap();
    let addr: SocketAddr = format!("127.0.0.1:{}", lokadb_tests::free_port())
        .parse()
        .unwrap();
    let w = World::start(
        json!({ "metrics": addr, "relay": relay_section(&certs, &[], json!({})) }),
        &[],
    )
    .unwrap();
    let before = scrape(addr);
    assert_eq!(before["lokadb_client_connections"], 0);
    assert!(before
        .keys()
        .any(|k| k.starts_with("lokadb_build_info{version=")));

    let c = w.client().await.unwrap();
    for _ in 0..10 {
        c.simple_query("SELECT 1").await.unwrap();
    }
    assert!(c.simple_query("SELECT 1/0").await.is_err());
    let timed = "lokadb_request_duration_seconds_count{database=\"app\",route=\"cloud\"}";
    let during = scrape_until(addr, |s| {
        s["lokadb_requests_total{side=\"cloud\"}"] >= 11
            && s["lokadb_backend_errors_total{side=\"cloud\"}"] >= 1
            && s.get(timed).is_some_and(|n| *n >= 11)
    })
    .await;
    // Errors by SQLSTATE class (22012, division by zero), latencies as a histogram.
    assert_eq!(
        during["lokadb_client_errors_total{database=\"app\",class=\"22\"}"],
        1
    );
    assert_eq!(
        during["lokadb_request_duration_seconds_bucket{database=\"app\",route=\"cloud\",le=\"+Inf\"}"],
        during[timed]
    );
    assert_eq!(
        during["lokadb_request_duration_seconds_count{database=\"app\",route=\"direct\"}"],
        0
    );
    let page = http(addr, b"GET /metrics HTTP/1.1\r\n\r\n");
    assert!(
        page.contains("# TYPE lokadb_request_duration_seconds histogram"),
        "{page}"
    );
    assert_eq!(during["lokadb_client_connections"], 1);
    assert!(during["lokadb_sessions_total"] >= 1);
    assert_eq!(during["lokadb_requests_total{side=\"direct\"}"], 0);
    assert_eq!(
        during
            .iter()
            .filter(|(k, _)| k.starts_with("lokadb_core_sessions{"))
            .map(|(_, v)| v)
            .sum::<u64>(),
        1
    );
    assert_eq!(during["lokadb_relay_organizations_connected"], 0);
    assert!(during.contains_key("lokadb_relay_agents_refused_total"));
    // Every metric the Grafana dashboard in docs/ plots is one the proxy serves.
    let dashboard = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/grafana-dashboard.json"),
    )
    .unwrap();
    let served: std::collections::HashSet<&str> = during
        .keys()
        .map(|k| k.split('{').next().unwrap())
        .collect();
    let mut plotted = 0;
    for part in dashboard.split("lokadb_").skip(1) {
        let name: String = part
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        if name.is_empty() {
            continue;
        }
        assert!(
            served.contains(format!("lokadb_{name}").as_str()),
            "lokadb_{name} is not served"
        );
        plotted += 1;
    }
    assert!(plotted >= 10, "{plotted}");

    drop(c);
    scrape_until(addr, |s| {
        s["lokadb_client_connections"] == 0 && s["lokadb_pool_idle_backends"] >= 1
    })
    .await;

    // Anything else is answered and nothing else changes.
    assert!(http(addr, b"GET /other HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 404"));
    assert!(http(addr, b"\x16\x03\x01garbage\r\n\r\n").starts_with("HTTP/1.1 400"));
    // Nine reads of the server's 1 KiB buffer, all taken before it answers (no reset).
    let huge = vec![b'a'; 9 * 1024];
    assert!(http(addr, &huge).starts_with("HTTP/1.1 431"));
    // A scraper that connects and says nothing is given up on; the next one is served.
    let silent = TcpStream::connect(addr).unwrap();
    let after = scrape(addr);
    drop(silent);
    assert!(after["lokadb_requests_total{side=\"cloud\"}"] >= 11);
    w.client()
        .await
        .unwrap()
        .simple_query("SELECT 1")
        .await
        .unwrap();

    // An address that cannot be bound stops the start, naming it.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let e = crate::world::start_proxy(
        &w.cloud,
        json!({ "metrics": taken.local_addr().unwrap() }),
        &[],
    )
    .err()
    .unwrap_or_else(|| panic!("a metrics address in use stops the start"));
    assert!(e.to_string().contains("metrics: cannot listen on"), "{e}");
}

/// Per organization: statements by route (organization 2 on fdw+direct reads direct,
/// organization 1 in the cloud, a statement refused in a session limited to organization
/// 2), errors by SQLSTATE class and latency under the organization their request named;
/// in `GET /metrics` and in the console's `SHOW STATS` with percentiles.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn figures_per_organization_follow_each_route() {
    let w = crate::moves::world_at(0, false, None);
    crate::direct::direct_world_setup(&w);
    w.cloud.create_role("ops", "ops-secret").unwrap();
    let addr: SocketAddr = format!("127.0.0.1:{}", lokadb_tests::free_port())
        .parse()
        .unwrap();
    let proxy = crate::direct::direct_proxy_with(
        &w,
        json!({}),
        json!({ "metrics": addr, "admin_users": ["ops"] }),
        &[],
    );
    let c = crate::direct::client(&proxy).await;
    for _ in 0..5 {
        c.simple_query("SELECT count(*) FROM documents WHERE organization_id = 2")
            .await
            .unwrap();
    }
    // Bound in binary, as most drivers send it.
    let bound = "SELECT count(*) FROM documents WHERE organization_id = $1";
    for org in [2i64, 2, 1] {
        c.query_one(bound, &[&org]).await.unwrap();
    }
    for _ in 0..3 {
        c.simple_query("SELECT count(*) FROM documents WHERE organization_id = 1")
            .await
            .unwrap();
    }
    let e = c
        .simple_query("SELECT 1 / (id - id) FROM documents WHERE organization_id = 1 LIMIT 1")
        .await
        .unwrap_err();
    assert_eq!(crate::world::sqlstate(&e), "22012");
    // Logged with the organization the statement named.
    let deadline = Instant::now() + Duration::from_secs(30);
    while !proxy
        .output()
        .lines()
        .any(|l| l.contains("statement error") && l.contains("22012") && l.contains("org=\"1\""))
    {
        assert!(Instant::now() < deadline, "{}", proxy.output());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Nothing names an organization: counted for the database only.
    c.simple_query("SELECT 1").await.unwrap();
    // A session limited to organization 2 naming organization 1: refused, under 2.
    c.simple_query("SET lokadb.org = 2").await.unwrap();
    let e = c
        .simple_query("SELECT count(*) FROM documents WHERE organization_id = 1")
        .await
        .unwrap_err();
    assert_eq!(crate::world::sqlstate(&e), "42501");

    let key = |org: &str, route: &str| {
        format!("lokadb_org_statements_total{{database=\"app\",org=\"{org}\",route=\"{route}\"}}")
    };
    let s = scrape_until(addr, |s| {
        s.get(&key("2", "refused")).is_some_and(|n| *n >= 1)
            && s.get(&key("1", "cloud")).is_some_and(|n| *n >= 5)
    })
    .await;
    assert_eq!(s[&key("2", "direct")], 7, "{s:?}");
    assert_eq!(s[&key("2", "cloud")], 0, "{s:?}");
    assert_eq!(s[&key("2", "refused")], 1, "{s:?}");
    assert_eq!(s[&key("1", "cloud")], 5, "{s:?}");
    assert_eq!(s[&key("1", "direct")], 0, "{s:?}");
    assert_eq!(
        s["lokadb_org_errors_total{database=\"app\",org=\"1\",class=\"22\"}"],
        1
    );
    assert_eq!(
        s["lokadb_org_errors_total{database=\"app\",org=\"2\",class=\"42\"}"],
        1
    );
    assert!(!s.keys().any(|k| k.contains("org=\"\"")), "{s:?}");
    // Every request of each is timed (the refused one too).
    let count = |org: &str| {
        s[&format!("lokadb_org_request_duration_seconds_count{{database=\"app\",org=\"{org}\"}}")]
    };
    assert_eq!(count("1"), 5);
    assert_eq!(count("2"), 8);

    // The console: the same counters, and percentiles per organization.
    let ops = crate::world::connect(&format!(
        "host=127.0.0.1 port={} user=ops password=ops-secret dbname=lokadb",
        proxy.port()
    ))
    .await
    .unwrap();
    let rows = ops.simple_query("SHOW STATS").await.unwrap();
    let value = |metric: &str| {
        rows.iter().find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) if r.get(0) == Some(metric) => {
                r.get(1).map(str::to_owned)
            }
            _ => None,
        })
    };
    assert_eq!(value(&key("2", "direct")).as_deref(), Some("7"));
    for q in ["p50", "p95", "p99"] {
        let ms = value(&format!(
            "lokadb_org_request_{q}_ms{{database=\"app\",org=\"1\"}}"
        ))
        .unwrap_or_else(|| panic!("no {q} for organization 1: {rows:?}"));
        assert!(ms.parse::<f64>().is_ok_and(|v| v > 0.0), "{q}: {ms}");
    }
}

/// `LOKADB_LOG_FORMAT=json`: every log line is a JSON object, with the level, the message
/// and its fields (what a log collector filters on).
#[tokio::test]
async fn logs_can_be_json_lines() {
    let w = World::start(json!({}), &[("LOKADB_LOG_FORMAT", "json")]).unwrap();
    // A refused login logs an error line with the role.
    let _ = crate::world::connect(&w.dsn_as("app", "wrong")).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    while !w.proxy.output().contains("client error") {
        assert!(Instant::now() < deadline, "{}", w.proxy.output());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut lines = 0;
    for line in w.proxy.output().lines().filter(|l| l.starts_with('{')) {
        let v: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("{line}: {e}"));
        assert!(
            v["level"].is_string() && v["fields"]["message"].is_string(),
            "{line}"
        );
        lines += 1;
    }
    assert!(lines >= 2, "{}", w.proxy.output());
    let error = w
        .proxy
        .output()
        .lines()
        .find(|l| l.contains("client error"))
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .unwrap();
    assert!(
        error["fields"]["error"].as_str().unwrap().contains("app"),
        "{error}"
    );
    assert_eq!(error["fields"]["sqlstate"], "28P01", "{error}");
    assert_eq!(
        (
            error["fields"]["user"].as_str(),
            error["fields"]["database"].as_str(),
            error["fields"]["client"].as_str()
        ),
        (Some("app"), Some("app"), Some("127.0.0.0/24")),
        "{error}"
    );

    // An error a statement gets: one line with the session's fields and the SQLSTATE.
    let c = w.client().await.unwrap();
    let e = c.simple_query("SELECT 1 / 0").await.unwrap_err();
    assert_eq!(crate::world::sqlstate(&e), "22012");
    drop(c);
    let deadline = Instant::now() + Duration::from_secs(30);
    let failed = loop {
        let line = w
            .proxy
            .output()
            .lines()
            .find(|l| l.contains("statement error"))
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap());
        if let Some(line) = line {
            break line;
        }
        assert!(Instant::now() < deadline, "{}", w.proxy.output());
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let f = &failed["fields"];
    assert_eq!(
        (
            f["sqlstate"].as_str(),
            f["user"].as_str(),
            f["database"].as_str(),
            f["client"].as_str(),
            f["side"].as_str()
        ),
        (
            Some("22012"),
            Some("app"),
            Some("app"),
            Some("127.0.0.0/24"),
            Some("cloud")
        ),
        "{failed}"
    );
    assert_eq!(
        (f["message"].as_str(), f["error"].as_str()),
        (Some("statement error"), Some("division by zero")),
        "{failed}"
    );

    // One line as a session starts and one as it ends, with what an operator filters on.
    drop(w.client().await.unwrap());
    let deadline = Instant::now() + Duration::from_secs(30);
    while !w.proxy.output().contains("session ended") {
        assert!(Instant::now() < deadline, "{}", w.proxy.output());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let field = |message: &str| {
        w.proxy
            .output()
            .lines()
            .find(|l| l.contains(message))
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["fields"].clone())
            .unwrap()
    };
    let started = field("session started");
    assert_eq!(
        (started["user"].as_str(), started["database"].as_str()),
        (Some("app"), Some("app"))
    );
    assert_eq!(started["client"], "127.0.0.0/24");
    let ended = field("session ended");
    assert_eq!(ended["end"], "client left", "{ended}");
}
