//! SIGTERM: no new connections, sessions served for a short grace then ended between
//! transactions, a running transaction may finish.

use crate::world::{connect, World};
use serde_json::json;
use std::time::{Duration, Instant};

#[tokio::test]
async fn sigterm_lets_a_running_transaction_commit_then_exits() {
    let mut w = World::start(json!({ "shutdown_timeout": "10s" }), &[]).unwrap();
    let idle = w.client().await.unwrap();
    let eager = w.client().await.unwrap();
    let busy = w.client().await.unwrap();
    busy.batch_execute("CREATE TABLE done (x int); BEGIN; INSERT INTO done VALUES (1)")
        .await
        .unwrap();
    let started = Instant::now();
    w.proxy.sigterm();
    // A statement sent at once is served (a client that had just connected), then its
    // session ends.
    eager.query_one("SELECT 1", &[]).await.unwrap();
    // Past the drain's grace for sessions that send nothing (500 ms).
    tokio::time::sleep(Duration::from_millis(1000)).await;

    // The idle session was told why it ends.
    let e = idle.query_one("SELECT 1", &[]).await.unwrap_err();
    assert!(
        e.is_closed() || e.code().is_some_and(|c| c.code() == "57P01"),
        "{e:?}"
    );
    // New connections are refused.
    assert!(connect(&w.dsn()).await.is_err());
    // The transaction in progress can still commit.
    if let Err(e) = busy
        .batch_execute("INSERT INTO done VALUES (2); COMMIT")
        .await
    {
        panic!("{e:?}\n{}", w.proxy.output());
    }
    let status = w
        .proxy
        .wait_exit(Duration::from_secs(10))
        .expect("the proxy exits");
    assert!(status.success(), "{status:?}");
    assert!(started.elapsed() < Duration::from_secs(8));
    assert_eq!(
        w.cloud
            .psql("app", "SELECT count(*) FROM done")
            .unwrap()
            .trim(),
        "2"
    );
}

#[tokio::test]
async fn shutdown_timeout_bounds_a_transaction_that_never_ends() {
    let mut w = World::start(json!({ "shutdown_timeout": "1s" }), &[]).unwrap();
    let busy = w.client().await.unwrap();
    busy.batch_execute("BEGIN; SELECT 1").await.unwrap();
    let started = Instant::now();
    w.proxy.sigterm();
    let status = w
        .proxy
        .wait_exit(Duration::from_secs(10))
        .expect("the proxy exits");
    assert!(status.success());
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(900) && waited < Duration::from_secs(5),
        "{waited:?}"
    );
}
