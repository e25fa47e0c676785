//! `pool_mode: "transaction"`: a client holds a cloud backend for one transaction at a
//! time, and what its session believes it keeps (prepared statements, settings) follows it
//! from backend to backend; what cannot follow (LISTEN) pins it; `pool_size` caps the
//! backends, clients beyond it wait in order up to `pool_timeout`, then get a clear error.

use crate::world::{config, create_auth_role, sqlstate, World, APP_PASSWORD, APP_USER};
use lokadb_tests::pg::Cluster;
use lokadb_tests::proxy::Proxy;
use lokadb_tests::raw::{be32, field, Raw};
use serde_json::json;
use std::collections::HashSet;
use std::time::{Duration, Instant};

/// A cloud and a proxy whose `app` database pools by transaction, on one core (one pool).
const OPS: &str = "ops";
const OPS_PASSWORD: &str = "ops-secret";

fn tx_world(pool_size: u32, pool_timeout: &str) -> World {
    tx_world_with(pool_size, pool_timeout, json!({}))
}

/// [`tx_world`] with more settings of the `app` database.
fn tx_world_with(pool_size: u32, pool_timeout: &str, extra: serde_json::Value) -> World {
    let cloud = Cluster::builder()
        .setting("max_connections", "300")
        .start()
        .unwrap();
    cloud.create_role(APP_USER, APP_PASSWORD).unwrap();
    cloud.create_database("app", APP_USER).unwrap();
    create_auth_role(&cloud).unwrap();
    cloud.create_role(OPS, OPS_PASSWORD).unwrap();
    let mut conf = config(&cloud, json!({ "admin_users": [OPS] }));
    let app = &mut conf["databases"]["app"];
    app["pool_mode"] = json!("transaction");
    app["pool_size"] = json!(pool_size);
    app["pool_timeout"] = json!(pool_timeout);
    for (k, v) in extra.as_object().unwrap() {
        app[k] = v.clone();
    }
    let proxy = Proxy::builder(conf)
        .env("LOKADB_CORES", "1")
        .start()
        .unwrap();
    World { cloud, proxy }
}

async fn pid(c: &tokio_postgres::Client) -> i32 {
    c.query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0)
}

async fn text(c: &tokio_postgres::Client, sql: &str) -> Option<String> {
    c.query_one(sql, &[]).await.unwrap().get(0)
}

#[tokio::test]
async fn statements_and_settings_follow_a_client_across_backends() {
    let w = tx_world(4, "10s");
    let c = w.client().await.unwrap();
    let other = w.client().await.unwrap();
    let double = c
        .prepare("SELECT $1::int * 2, pg_backend_pid()")
        .await
        .unwrap();
    let setting = c
        .prepare(
            "SELECT current_setting('work_mem') || ' ' || current_setting('myapp.tenant', true)",
        )
        .await
        .unwrap();
    c.batch_execute("SET work_mem = '3MB'; SET myapp.tenant = 'acme'")
        .await
        .unwrap();
    let mut pids = HashSet::new();
    for i in 0..50i32 {
        // Every other turn another client takes the backend given back last (the pool's
        // most recent), so this one gets another.
        let holds = i % 2 == 0;
        if holds {
            other.batch_execute("BEGIN; SELECT 1").await.unwrap();
        }
        let tx = c.query_one(&double, &[&i]).await.unwrap();
        assert_eq!(tx.get::<_, i32>(0), 2 * i);
        pids.insert(tx.get::<_, i32>(1));
        let s: String = c.query_one(&setting, &[]).await.unwrap().get(0);
        assert_eq!(s, "3MB acme", "transaction {i}");
        if holds {
            // The other client sees nothing of them.
            let seen = text(
                &other,
                "SELECT current_setting('work_mem') || ' ' || coalesce(current_setting('myapp.tenant', true), '')",
            )
            .await;
            assert_eq!(seen.as_deref(), Some("4MB "), "transaction {i}");
            other.batch_execute("COMMIT").await.unwrap();
        }
    }
    assert!(pids.len() > 1, "one backend only: {pids:?}");

    // DISCARD ALL from the client: its statements and settings are gone, as on Postgres.
    c.batch_execute("DISCARD ALL").await.unwrap();
    let e = c.query_one(&double, &[&1i32]).await.unwrap_err();
    assert_eq!(sqlstate(&e), "26000", "{e}");
    other.batch_execute("BEGIN; SELECT 1").await.unwrap();
    assert_eq!(text(&c, "SHOW work_mem").await.as_deref(), Some("4MB"));
    other.batch_execute("COMMIT").await.unwrap();
    // A rolled-back SET is not kept.
    c.batch_execute("BEGIN; SET work_mem = '5MB'; ROLLBACK")
        .await
        .unwrap();
    other.batch_execute("BEGIN; SELECT 1").await.unwrap();
    assert_eq!(text(&c, "SHOW work_mem").await.as_deref(), Some("4MB"));
    other.batch_execute("COMMIT").await.unwrap();
}

/// Parse (when `parse`) + Bind + Execute + Sync of statement `name`: its one value, or the
/// SQLSTATE of its error.
async fn run(raw: &mut Raw, name: &str, sql: &str, parse: bool) -> Result<String, String> {
    match raw.try_run(name, sql, parse).await {
        Ok(rows) => rows.into_iter().next().ok_or_else(|| "no row".to_owned()),
        Err(body) => Err(field(&body, b'C').unwrap_or_default()),
    }
}

#[tokio::test]
async fn a_backend_keeps_at_most_max_prepared_statements_beyond_a_sessions_own() {
    // One backend, a cap of 2: the client with 3 statements keeps all 3 on it; the other,
    // with 2 of the same names and other texts, finds 2 there (the third was closed).
    let w = tx_world_with(1, "10s", json!({ "max_prepared_statements": 2 }));
    let (a, b) = (w.client().await.unwrap(), w.client().await.unwrap());
    let count = "SELECT count(*)::int FROM pg_prepared_statements WHERE NOT from_sql";
    let mine = [
        a.prepare("SELECT 1").await.unwrap(),
        a.prepare("SELECT 2").await.unwrap(),
        a.prepare(count).await.unwrap(),
    ];
    let theirs = [
        b.prepare("SELECT 10").await.unwrap(),
        b.prepare(count).await.unwrap(),
    ];
    for _ in 0..5 {
        for (i, want) in [(0, 1), (1, 2)] {
            let got: i32 = a.query_one(&mine[i], &[]).await.unwrap().get(0);
            assert_eq!(got, want);
        }
        let held: i32 = a.query_one(&mine[2], &[]).await.unwrap().get(0);
        assert_eq!(held, 3, "a session's own statements are all kept");
        let got: i32 = b.query_one(&theirs[0], &[]).await.unwrap().get(0);
        assert_eq!(got, 10);
        let held: i32 = b.query_one(&theirs[1], &[]).await.unwrap().get(0);
        assert_eq!(held, 2, "the other session's third statement was closed");
    }
}

#[tokio::test]
async fn at_the_cap_an_idle_backend_of_other_startup_parameters_gives_its_place() {
    // pool_size 1: the one backend, idle with client a's parameters, must not keep client
    // b (another application_name) waiting until pool_timeout, nor a after b.
    let w = tx_world(1, "5s");
    let named = |name: &str| format!("{} application_name={name}", w.dsn());
    let a = crate::world::connect(&named("a")).await.unwrap();
    assert_eq!(
        text(&a, "SHOW application_name").await.as_deref(),
        Some("a")
    );
    let b = crate::world::connect(&named("b")).await.unwrap();
    for _ in 0..3 {
        assert_eq!(
            text(&b, "SHOW application_name").await.as_deref(),
            Some("b")
        );
        assert_eq!(
            text(&a, "SHOW application_name").await.as_deref(),
            Some("a")
        );
    }
}

#[tokio::test]
async fn a_prepared_set_acts_at_each_execution_and_stays_with_its_client() {
    // One backend for both: a SET prepared by a, run later, is a's alone.
    let w = tx_world(1, "10s");
    let (a, b) = (w.client().await.unwrap(), w.client().await.unwrap());
    let set = a.prepare("SET work_mem = '7MB'").await.unwrap();
    assert_eq!(text(&b, "SHOW work_mem").await.as_deref(), Some("4MB"));
    for _ in 0..3 {
        a.execute(&set, &[]).await.unwrap();
        assert_eq!(text(&b, "SHOW work_mem").await.as_deref(), Some("4MB"));
        assert_eq!(text(&a, "SHOW work_mem").await.as_deref(), Some("7MB"));
        b.batch_execute("SET work_mem = '5MB'").await.unwrap();
        assert_eq!(text(&a, "SHOW work_mem").await.as_deref(), Some("7MB"));
        assert_eq!(text(&b, "SHOW work_mem").await.as_deref(), Some("5MB"));
        b.batch_execute("RESET work_mem").await.unwrap();
    }
}

#[tokio::test]
async fn two_clients_statements_of_one_name_never_mix() {
    // One backend for both: each client's "s1" must be its own on it.
    let w = tx_world(1, "10s");
    let port = w.proxy.port();
    let mut a = Raw::login(port, APP_USER, APP_PASSWORD, &[]).await;
    let mut b = Raw::login(port, APP_USER, APP_PASSWORD, &[]).await;
    assert_eq!(run(&mut a, "s1", "SELECT 'a'", true).await.unwrap(), "a");
    assert_eq!(run(&mut b, "s1", "SELECT 'b'", true).await.unwrap(), "b");
    for _ in 0..5 {
        assert_eq!(run(&mut a, "s1", "", false).await.unwrap(), "a");
        assert_eq!(run(&mut b, "s1", "", false).await.unwrap(), "b");
    }
    // The unnamed statement, parsed in one batch and bound in the next, is the client's.
    let mut out = bytes::BytesMut::new();
    postgres_protocol::message::frontend::parse("", "SELECT 'unnamed a'", [], &mut out).unwrap();
    postgres_protocol::message::frontend::sync(&mut out);
    a.send(&out).await;
    while a.message().await.0 != b'Z' {}
    assert_eq!(
        run(&mut b, "", "SELECT 'unnamed b'", true).await.unwrap(),
        "unnamed b"
    );
    assert_eq!(run(&mut a, "", "", false).await.unwrap(), "unnamed a");
    // Parsing a name the client holds is the client's error, as on Postgres.
    assert_eq!(
        run(&mut a, "s1", "SELECT 'again'", true).await.unwrap_err(),
        "42P05"
    );
    assert_eq!(run(&mut a, "s1", "", false).await.unwrap(), "a");
    // Closed: gone for it, not for the other.
    let mut out = bytes::BytesMut::new();
    postgres_protocol::message::frontend::close(b'S', "s1", &mut out).unwrap();
    postgres_protocol::message::frontend::sync(&mut out);
    a.send(&out).await;
    while a.message().await.0 != b'Z' {}
    assert_eq!(run(&mut a, "s1", "", false).await.unwrap_err(), "26000");
    assert_eq!(run(&mut b, "s1", "", false).await.unwrap(), "b");
}

/// A simple Query: the first column of its rows, and the process IDs of the notifications
/// that came with its answer.
async fn simple(raw: &mut Raw, sql: &str) -> (Vec<String>, Vec<u32>) {
    let mut out = bytes::BytesMut::new();
    postgres_protocol::message::frontend::query(sql, &mut out).unwrap();
    raw.send(&out).await;
    let (mut rows, mut notified) = (Vec::new(), Vec::new());
    loop {
        let (tag, body) = raw.message().await;
        match tag {
            b'D' => rows.push(lokadb_tests::raw::first_column(&body)),
            b'A' => notified.push(be32(&body[..4])),
            b'E' => panic!("{sql}: {}", String::from_utf8_lossy(&body)),
            b'Z' => return (rows, notified),
            _ => {}
        }
    }
}

#[tokio::test]
async fn listen_pins_the_client_and_its_notifications_arrive() {
    let w = tx_world(4, "10s");
    let port = w.proxy.port();
    let mut listener = Raw::login(port, APP_USER, APP_PASSWORD, &[]).await;
    let other = w.client().await.unwrap();
    let (rows, _) = simple(&mut listener, "LISTEN jobs; SELECT pg_backend_pid()").await;
    let pinned = rows[0].clone();
    for _ in 0..5 {
        other.batch_execute("BEGIN; SELECT 1").await.unwrap();
        let (rows, _) = simple(&mut listener, "SELECT pg_backend_pid()").await;
        assert_eq!(rows[0], pinned, "LISTEN keeps the client on its backend");
        other.batch_execute("COMMIT").await.unwrap();
    }
    other.batch_execute("NOTIFY jobs, 'x'").await.unwrap();
    let (_, notified) = simple(&mut listener, "SELECT 1").await;
    assert_eq!(notified.len(), 1, "the notification arrives");
    // Its own notification names the process ID of its key, as a client's own does at
    // the cloud (drivers tell their own notifications apart by it).
    let key_pid = be32(&listener.key_data[0][..4]);
    let (_, notified) = simple(&mut listener, "NOTIFY jobs, 'mine'").await;
    assert_eq!(notified, [key_pid]);
    // Another client's, sent from a backend it shares, names that client's key.
    let mut notifier = Raw::login(port, APP_USER, APP_PASSWORD, &[]).await;
    let notifier_pid = be32(&notifier.key_data[0][..4]);
    simple(&mut notifier, "NOTIFY jobs, 'theirs'").await;
    let (_, notified) = simple(&mut listener, "SELECT 1").await;
    assert_eq!(notified, [notifier_pid]);

    // The console says which session is pinned and why; the other shares.
    let console = crate::world::connect(&format!(
        "host=127.0.0.1 port={port} user={OPS} password={OPS_PASSWORD} dbname=lokadb"
    ))
    .await
    .unwrap();
    // Cores publish their sessions once a second.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let clients = console.simple_query("SHOW CLIENTS").await.unwrap();
        let mut pins: Vec<Option<String>> = clients
            .iter()
            .filter_map(|m| match m {
                tokio_postgres::SimpleQueryMessage::Row(r) if r.get("user") == Some(APP_USER) => {
                    Some(r.get("pinned").map(str::to_owned))
                }
                _ => None,
            })
            .collect();
        pins.sort();
        // The listener pinned; the two others (one that notified) sharing.
        if pins == [None, None, Some("LISTEN".to_owned())] {
            break;
        }
        assert!(Instant::now() < deadline, "SHOW CLIENTS: {pins:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn a_client_killed_mid_transaction_leaves_a_clean_backend() {
    let w = tx_world(1, "10s");
    let setup = w.client().await.unwrap();
    setup
        .batch_execute("CREATE TABLE kept (x int)")
        .await
        .unwrap();
    let killed = w.client().await.unwrap();
    let pid_before = pid(&killed).await;
    killed
        .batch_execute("BEGIN; INSERT INTO kept VALUES (1); SET LOCAL work_mem = '9MB'")
        .await
        .unwrap();
    drop(killed);
    // The one backend comes back, rolled back, to the next client.
    let next = w.client().await.unwrap();
    assert_eq!(pid(&next).await, pid_before);
    let rows: i64 = next
        .query_one("SELECT count(*) FROM kept", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(rows, 0);
    assert_eq!(text(&next, "SHOW work_mem").await.as_deref(), Some("4MB"));
    drop(setup);
}

#[tokio::test]
async fn at_pool_size_clients_wait_in_order_then_get_a_clear_error() {
    let w = tx_world(2, "3s");
    let holders = [w.client().await.unwrap(), w.client().await.unwrap()];
    let (first, second) = (w.client().await.unwrap(), w.client().await.unwrap());
    for h in &holders {
        h.batch_execute("BEGIN; SELECT 1").await.unwrap();
    }
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let ask = |c: tokio_postgres::Client, name: &'static str| {
        let tx = tx.clone();
        tokio::spawn(async move {
            let r = c.query_one("SELECT 1", &[]).await.map(|_| ());
            tx.send(name).unwrap();
            (c, r)
        })
    };
    // Both backends are held: the first asks, then the second.
    let first = ask(first, "first");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let second = ask(second, "second");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(rx.try_recv().is_err(), "both wait");
    holders[0].batch_execute("COMMIT").await.unwrap();
    assert_eq!(rx.recv().await, Some("first"));
    holders[1].batch_execute("COMMIT").await.unwrap();
    assert_eq!(rx.recv().await, Some("second"));
    let (first, r) = first.await.unwrap();
    r.unwrap();
    let (second, r) = second.await.unwrap();
    r.unwrap();

    // Past pool_timeout: an error that names the pool; the others go on.
    for h in &holders {
        h.batch_execute("BEGIN; SELECT 1").await.unwrap();
    }
    let started = Instant::now();
    let e = first.query_one("SELECT 1", &[]).await.unwrap_err();
    assert!(started.elapsed() >= Duration::from_secs(2), "{e}");
    assert_eq!(sqlstate(&e), "53300", "{e}");
    let message = e.as_db_error().map(|d| d.message().to_owned());
    assert!(
        message.as_deref().is_some_and(|m| m.contains("pool")),
        "{message:?}"
    );
    holders[0].batch_execute("COMMIT").await.unwrap();
    second.query_one("SELECT 1", &[]).await.unwrap();
    holders[1].batch_execute("COMMIT").await.unwrap();
}

#[tokio::test]
async fn the_key_cancels_the_running_statement_and_terminates_no_backend() {
    let w = tx_world(4, "10s");
    let port = w.proxy.port();
    let mut raw = Raw::login(port, APP_USER, APP_PASSWORD, &[]).await;
    let key = raw.key_data[0].clone();
    let (pid, secret) = (be32(&key[..4]), be32(&key[4..]));
    // The key's process ID is no process's: ending it ends nothing, the client goes on.
    assert!(pid > 1 << 22, "{pid}");
    let admin = w.cloud.superuser_client().await.unwrap();
    let ended: bool = admin
        .query_one("SELECT pg_terminate_backend($1)", &[&(pid as i32)])
        .await
        .unwrap()
        .get(0);
    assert!(!ended);
    assert_eq!(simple(&mut raw, "SELECT 1").await.0, ["1"]);
    // A statement running on whichever backend: the key cancels it.
    let mut out = bytes::BytesMut::new();
    postgres_protocol::message::frontend::query("SELECT pg_sleep(30)", &mut out).unwrap();
    raw.send(&out).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut cancel = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    let mut req = Vec::new();
    for n in [16u32, 80_877_102, pid, secret] {
        req.extend_from_slice(&n.to_be_bytes());
    }
    tokio::io::AsyncWriteExt::write_all(&mut cancel, &req)
        .await
        .unwrap();
    let started = Instant::now();
    let mut code = None;
    loop {
        let (tag, body) = raw.message().await;
        match tag {
            b'E' => code = field(&body, b'C'),
            b'Z' => break,
            _ => {}
        }
    }
    assert_eq!(code.as_deref(), Some("57014"));
    assert!(started.elapsed() < Duration::from_secs(20));
    assert_eq!(simple(&mut raw, "SELECT 2").await.0, ["2"]);
}
