//! `lokadb proxy --record FILE`: each core's file holds every session's traffic after login,
//! in the documented format (`proxy/src/record.rs`, docs/operations.md); never the login.

use crate::world::{config, World, APP_PASSWORD};
use lokadb_tests::pg::Cluster;
use lokadb_tests::proxy::Proxy;
use serde_json::json;
use std::os::unix::fs::PermissionsExt;
use std::process::Command;
use std::time::Duration;

/// One record of a recording file.
#[derive(Debug)]
struct Record {
    kind: u8,
    session: u32,
    data: Vec<u8>,
}

fn parse(bytes: &[u8]) -> Vec<Record> {
    let header = b"LOKADB-RECORD 1\n";
    assert!(bytes.starts_with(header), "no header");
    let mut rest = &bytes[header.len()..];
    let mut out = Vec::new();
    while !rest.is_empty() {
        assert!(rest.len() >= 17, "a truncated record head");
        let kind = rest[0];
        let session = u32::from_be_bytes(rest[1..5].try_into().unwrap());
        let micros = u64::from_be_bytes(rest[5..13].try_into().unwrap());
        assert!(
            micros > 1_700_000_000_000_000,
            "a wall-clock time: {micros}"
        );
        let len = u32::from_be_bytes(rest[13..17].try_into().unwrap()) as usize;
        assert!(rest.len() >= 17 + len, "a truncated record");
        out.push(Record {
            kind,
            session,
            data: rest[17..17 + len].to_vec(),
        });
        rest = &rest[17 + len..];
    }
    out
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

#[test]
fn record_keeps_every_sessions_traffic_after_login() {
    let dir = lokadb_tests::TempDir::new("lokadb-record").unwrap();
    let prefix = dir.path().join("traffic");
    let mut w = World::start(json!({ "record": prefix }), &[("LOKADB_CORES", "2")]).unwrap();
    let psql = w.cloud.bin_dir().join("psql");
    for n in [41, 99] {
        let out = Command::new(&psql)
            .args(["-X", "-At", "-c"])
            .arg(format!("SELECT 'recorded ' || {n} + 1"))
            .arg(format!(
                "host=127.0.0.1 port={} user=app dbname=app",
                w.proxy.port()
            ))
            .env("PGPASSWORD", APP_PASSWORD)
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
    }
    w.proxy.sigterm();
    assert!(w.proxy.wait_exit(Duration::from_secs(10)).is_some());

    let mut records = Vec::new();
    for core in 0..2 {
        let path = dir.path().join(format!("traffic.{core}"));
        let meta = std::fs::metadata(&path).unwrap();
        assert_eq!(
            meta.permissions().mode() & 0o777,
            0o600,
            "{}",
            path.display()
        );
        let bytes = std::fs::read(&path).unwrap();
        assert!(
            !contains(&bytes, APP_PASSWORD.as_bytes()),
            "the login is not recorded"
        );
        records.extend(parse(&bytes));
    }
    let starts: Vec<&Record> = records.iter().filter(|r| r.kind == b'S').collect();
    assert_eq!(starts.len(), 2, "{records:?}");
    for start in &starts {
        assert_eq!(start.data, b"app\0app\0");
        let of_session = |kind: u8| -> Vec<u8> {
            records
                .iter()
                .filter(|r| r.session == start.session && r.kind == kind)
                .flat_map(|r| r.data.clone())
                .collect()
        };
        let sent = of_session(b'F');
        let got = of_session(b'B');
        let ends = records
            .iter()
            .filter(|r| r.session == start.session && r.kind == b'E')
            .count();
        assert_eq!(ends, 1);
        // Whole protocol messages: the Query, then psql's Terminate.
        assert_eq!(sent[0], b'Q');
        assert!(sent.ends_with(b"X\0\0\0\x04"), "psql's Terminate ends it");
        let which = if contains(&sent, b"41 + 1") {
            "42"
        } else {
            "100"
        };
        assert!(contains(&got, format!("recorded {which}").as_bytes()));
        assert_eq!(got.last(), Some(&b'I'), "ends with ReadyForQuery (idle)");
    }
}

#[test]
fn a_recording_path_that_cannot_be_written_stops_the_start() {
    let cloud = Cluster::start().unwrap();
    let result = Proxy::builder(config(&cloud, json!({})))
        .arg("--record")
        .arg("/nonexistent-dir/traffic")
        .start();
    let err = match result {
        Ok(_) => panic!("the proxy must not start"),
        Err(e) => format!("{e:#}"),
    };
    assert!(
        err.contains("cannot open the traffic recording /nonexistent-dir/traffic.0"),
        "{err}"
    );
}
