//! upstream_pool: warm backends reused between clients, with nothing of one client's
//! session seen by the next.

use crate::world::{connect, World};
use serde_json::json;

/// The single `count(*)` a query returns.
async fn count(c: &tokio_postgres::Client, sql: &str) -> i64 {
    c.query_one(sql, &[]).await.unwrap().get(0)
}

async fn backend_pid(c: &tokio_postgres::Client) -> i32 {
    c.query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0)
}

#[tokio::test]
async fn the_next_client_reuses_the_backend_and_sees_nothing_of_the_last() {
    // One executor, so both clients share one pool.
    let w = World::start(json!({}), &[("LOKADB_CORES", "1")]).unwrap();
    let first = w.client().await.unwrap();
    let pid = backend_pid(&first).await;
    first
        .batch_execute(
            "SET work_mem = '77MB';
             PREPARE leftover AS SELECT 1;
             LISTEN leftover_channel;
             SELECT pg_advisory_lock(4242);
             CREATE TABLE kept (x int);",
        )
        .await
        .unwrap();
    first
        .batch_execute("BEGIN; INSERT INTO kept VALUES (1)")
        .await
        .unwrap();
    drop(first); // leaves with a transaction open
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;

    let second = w.client().await.unwrap();
    assert_eq!(
        backend_pid(&second).await,
        pid,
        "a warm backend is reused, no new one started"
    );
    let work_mem: String = second.query_one("SHOW work_mem", &[]).await.unwrap().get(0);
    assert_ne!(work_mem, "77MB");
    let prepared = count(
        &second,
        "SELECT count(*) FROM pg_prepared_statements WHERE name = 'leftover'",
    )
    .await;
    assert_eq!(prepared, 0);
    let listening = count(&second, "SELECT count(*) FROM pg_listening_channels()").await;
    assert_eq!(listening, 0);
    let locks = count(
        &second,
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()",
    )
    .await;
    assert_eq!(locks, 0);
    let rows = count(&second, "SELECT count(*) FROM kept").await;
    assert_eq!(rows, 0, "the open transaction was rolled back");
    let status: String = second.query_one("SELECT 'idle'", &[]).await.unwrap().get(0);
    assert_eq!(status, "idle");

    // A session that made a temporary table leaves its backend to no one: the temporary
    // schema would stay, and a new connection has none (`backend/pool.rs`, `reset`).
    second
        .batch_execute("CREATE TEMP TABLE leftover_temp (x int)")
        .await
        .unwrap();
    drop(second);
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let third = w.client().await.unwrap();
    assert_ne!(backend_pid(&third).await, pid, "a new backend");
    let temp = count(
        &third,
        "SELECT count(*) FROM pg_class WHERE relname = 'leftover_temp'",
    )
    .await;
    assert_eq!(temp, 0);
    let schema: bool = third
        .query_one("SELECT pg_my_temp_schema() = 0", &[])
        .await
        .unwrap()
        .get(0);
    assert!(schema, "no temporary schema");
    // Its backend is pooled again.
    let pid = backend_pid(&third).await;
    drop(third);
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let fourth = w.client().await.unwrap();
    assert_eq!(backend_pid(&fourth).await, pid);
}

#[tokio::test]
async fn different_roles_and_parameters_do_not_share_backends() {
    let w = World::start(json!({}), &[("LOKADB_CORES", "1")]).unwrap();
    w.cloud.create_role("other", "other-secret").unwrap();
    let a = w.client().await.unwrap();
    let pid = backend_pid(&a).await;
    drop(a);
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    let b = connect(&w.dsn_as("other", "other-secret")).await.unwrap();
    assert_ne!(backend_pid(&b).await, pid);
    let who: String = b
        .query_one("SELECT session_user::text", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(who, "other");
    let c = connect(&format!("{} application_name=reports", w.dsn()))
        .await
        .unwrap();
    assert_ne!(
        backend_pid(&c).await,
        pid,
        "other startup parameters, other pool"
    );
    let name: String = c
        .query_one("SHOW application_name", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(name, "reports");
}

#[tokio::test]
async fn without_the_pool_every_client_gets_a_new_backend() {
    let w = World::start(json!({}), &[("LOKADB_CORES", "1")]).unwrap();
    let mut config = crate::world::config(&w.cloud, json!({}));
    config["databases"]["app"]["upstream_pool"] = json!(false);
    let proxy = lokadb_tests::proxy::Proxy::start(&config).unwrap();
    let dsn = w
        .dsn()
        .replace(&w.proxy.port().to_string(), &proxy.port().to_string());
    let a = connect(&dsn).await.unwrap();
    let pid = backend_pid(&a).await;
    drop(a);
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    let b = connect(&dsn).await.unwrap();
    assert_ne!(backend_pid(&b).await, pid);
}

#[tokio::test]
async fn a_client_that_vanishes_mid_query_does_not_leave_its_backend_to_the_next() {
    let w = World::start(json!({}), &[("LOKADB_CORES", "1")]).unwrap();
    // psql killed with SIGKILL while its query runs: the socket closes mid-request.
    let mut psql = std::process::Command::new(w.cloud.bin_dir().join("psql"))
        .args(["-X", "-c", "SELECT pg_backend_pid(), pg_sleep(3)"])
        .arg(w.dsn())
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(800)).await;
    let busy: i32 = w
        .cloud
        .psql("postgres", "SELECT pid FROM pg_stat_activity WHERE query LIKE 'SELECT pg_backend_pid(), pg_sleep(3)%'")
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    psql.kill().unwrap();
    psql.wait().unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    let b = w.client().await.unwrap();
    assert_ne!(
        backend_pid(&b).await,
        busy,
        "a busy backend is never handed to another client"
    );
    assert_eq!(
        b.query_one("SELECT 1", &[]).await.unwrap().get::<_, i32>(0),
        1
    );
}
