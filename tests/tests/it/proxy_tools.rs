//! Real clients through the proxy: psql, pgbench and psycopg 3.

use crate::world::{World, APP_PASSWORD};
use serde_json::json;
use std::process::Command;

fn run(cmd: &mut Command) -> String {
    let out = cmd.env("PGPASSWORD", APP_PASSWORD).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(out.status.success(), "{cmd:?} failed:\n{stdout}\n{stderr}");
    stdout + &stderr
}

#[test]
fn psql_scripts_copy_and_errors() {
    let w = World::start(json!({}), &[]).unwrap();
    let psql = w.cloud.bin_dir().join("psql");
    let conn = format!("host=127.0.0.1 port={} user=app dbname=app", w.proxy.port());
    let out = run(Command::new(&psql)
        .args(["-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1", "-c"])
        .arg(
            "CREATE TABLE items (id int primary key, name text); \
         INSERT INTO items SELECT g, 'item ' || g FROM generate_series(1, 1000) g; \
         SELECT count(*) FROM items",
        )
        .arg(&conn));
    assert_eq!(out.trim(), "1000");
    let dir = lokadb_tests::TempDir::new("lokadb-psql").unwrap();
    let file = dir.path().join("items.csv");
    let out = run(Command::new(&psql)
        .args(["-X", "-v", "ON_ERROR_STOP=1", "-c"])
        .arg(format!("\\copy items TO '{}' CSV", file.display()))
        .arg(&conn));
    assert!(out.contains("COPY 1000"), "{out}");
    let out = run(Command::new(&psql)
        .args(["-X", "-v", "ON_ERROR_STOP=1", "-c", "TRUNCATE items", "-c"])
        .arg(format!("\\copy items FROM '{}' CSV", file.display()))
        .arg(&conn));
    assert!(out.contains("COPY 1000"), "{out}");
    // An error is reported with its SQLSTATE text and psql exits 1 (ON_ERROR_STOP).
    let out = Command::new(&psql)
        .args([
            "-X",
            "-v",
            "ON_ERROR_STOP=1",
            "-v",
            "VERBOSITY=verbose",
            "-c",
            "INSERT INTO items VALUES (1, 'dup')",
        ])
        .arg(&conn)
        .env("PGPASSWORD", APP_PASSWORD)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("23505"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn pgbench_all_protocols_without_failures() {
    let w = World::start(json!({}), &[]).unwrap();
    let pgbench = w.cloud.bin_dir().join("pgbench");
    let conn = format!("host=127.0.0.1 port={} user=app dbname=app", w.proxy.port());
    run(Command::new(&pgbench)
        .args(["-i", "-s", "1", "-q"])
        .arg(&conn));
    for mode in ["simple", "extended", "prepared"] {
        let out = run(Command::new(&pgbench)
            .args(["-n", "-c", "4", "-j", "2", "-t", "200", "-M", mode])
            .arg(&conn));
        assert!(
            out.contains("number of transactions actually processed: 800/800"),
            "{mode}: {out}"
        );
        assert!(
            !out.contains("number of failed transactions: 1"),
            "{mode}: {out}"
        );
    }
    // A new connection per transaction (-C) goes through the pool.
    let out = run(Command::new(&pgbench)
        .args(["-n", "-C", "-c", "4", "-j", "2", "-t", "50", "-S"])
        .arg(&conn));
    assert!(out.contains("actually processed: 200/200"), "{out}");
    let balanced = w
        .cloud
        .psql("app", "SELECT (SELECT sum(abalance) FROM pgbench_accounts) = (SELECT sum(delta) FROM pgbench_history)")
        .unwrap();
    assert_eq!(balanced.trim(), "t", "every update landed exactly once");
    let history = w
        .cloud
        .psql("app", "SELECT count(*) FROM pgbench_history")
        .unwrap();
    assert_eq!(
        history.trim(),
        "2400",
        "every committed transaction is there"
    );
}

#[test]
fn psycopg3_pipeline_copy_notify_cursors() {
    let w = World::start(json!({}), &[]).unwrap();
    let root = lokadb_tests::repo_root();
    let python = root.join(".venv/bin/python");
    let out = run(Command::new(python)
        .arg(root.join("tests/python/psycopg_check.py"))
        .arg(w.dsn()));
    assert!(out.contains("psycopg checks passed: 9"), "{out}");
}
