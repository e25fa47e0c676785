//! SIGHUP re-reads `--config`: limits, `admin_users` and databases change for what starts
//! next, running sessions keep going, a bad file changes nothing, and what needs a restart
//! is named in the log.

use crate::world::{connect, sqlstate, World};
use serde_json::{json, Value};
use std::time::Duration;

/// Rewrites the proxy's config file with `change` applied, sends SIGHUP and waits for the
/// log line that says how it went (the `n`-th such line).
fn reload(w: &World, change: impl FnOnce(&mut Value), says: &str, n: usize) {
    let path = w.proxy.config_path();
    let mut config: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    change(&mut config);
    std::fs::write(&path, serde_json::to_vec_pretty(&config).unwrap()).unwrap();
    reload_as_is(w, says, n);
}

fn reload_as_is(w: &World, says: &str, n: usize) {
    w.proxy.signal(libc::SIGHUP);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while w.proxy.output().matches(says).count() < n {
        assert!(
            std::time::Instant::now() < deadline,
            "no {says:?} (#{n}) in the log:\n{}",
            w.proxy.output()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[tokio::test]
async fn sighup_reloads_what_starts_next() {
    let w = World::start(json!({}), &[]).unwrap();
    let first = w.client().await.unwrap();

    // A limit: the running session stays, the next one is refused.
    reload(
        &w,
        |c| c["max_connections"] = json!(1),
        "configuration reloaded",
        1,
    );
    assert_eq!(sqlstate(&connect(&w.dsn()).await.unwrap_err()), "53300");
    first.simple_query("SELECT 1").await.unwrap();

    // A file that does not load changes nothing, and says why.
    let path = w.proxy.config_path();
    let good = std::fs::read(&path).unwrap();
    std::fs::write(&path, b"{ \"max_connections\": ").unwrap();
    reload_as_is(&w, "reload refused", 1);
    assert_eq!(sqlstate(&connect(&w.dsn()).await.unwrap_err()), "53300");
    std::fs::write(&path, &good).unwrap();
    reload(
        &w,
        |c| c["max_connections"] = json!("many"),
        "reload refused",
        2,
    );

    // Back to room for more, and the console switched on; a database no longer
    // configured takes no new session while the running one goes on.
    reload(
        &w,
        |c| {
            c["max_connections"] = json!(100);
            c["admin_users"] = json!(["app"]);
        },
        "configuration reloaded",
        2,
    );
    let console = connect(&w.dsn().replace("dbname=app", "dbname=lokadb"))
        .await
        .unwrap();
    console.simple_query("SHOW VERSION").await.unwrap();
    let second = w.client().await.unwrap();
    reload(
        &w,
        |c| {
            let app = c["databases"]["app"].clone();
            c["databases"] = json!({ "renamed": app });
        },
        "takes a restart",
        1,
    );
    assert!(w.proxy.output().contains("databases.renamed (added)"));
    assert_eq!(sqlstate(&connect(&w.dsn()).await.unwrap_err()), "3D000");
    first.simple_query("SELECT 1").await.unwrap();
    second.simple_query("SELECT 1").await.unwrap();
}
