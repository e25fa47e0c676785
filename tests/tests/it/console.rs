//! The operator's console: database `lokadb` on the client listener for `admin_users`,
//! its SHOW commands against live sessions, KILL, and what it refuses.

use crate::tunnel_world::{relay_section, Certs};
use crate::world::{self, connect, sqlstate, World, APP_USER};
use serde_json::json;
use std::time::{Duration, Instant};
use tokio_postgres::{Client, SimpleQueryMessage};

const OPS: &str = "ops";
const OPS_PASSWORD: &str = "ops-secret";

/// The rows of a console command, each as column name → value.
async fn show(c: &Client, sql: &str) -> Vec<Vec<(String, Option<String>)>> {
    c.simple_query(sql)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e:?}"))
        .into_iter()
        .filter_map(|m| match m {
            SimpleQueryMessage::Row(r) => Some(
                r.columns()
                    .iter()
                    .enumerate()
                    .map(|(i, col)| (col.name().to_owned(), r.get(i).map(str::to_owned)))
                    .collect(),
            ),
            _ => None,
        })
        .collect()
}

fn get<'a>(row: &'a [(String, Option<String>)], column: &str) -> Option<&'a str> {
    row.iter()
        .find(|(c, _)| c == column)
        .unwrap_or_else(|| panic!("no column {column} in {row:?}"))
        .1
        .as_deref()
}

/// Polls `sql` until some row satisfies `ok` (other cores publish once a second).
async fn show_until(
    c: &Client,
    sql: &str,
    ok: impl Fn(&[(String, Option<String>)]) -> bool,
) -> Vec<(String, Option<String>)> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let rows = show(c, sql).await;
        if let Some(row) = rows.iter().find(|r| ok(r)) {
            return row.clone();
        }
        assert!(Instant::now() < deadline, "{sql}: never found in {rows:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn the_console_shows_sessions_and_kills_one() {
    let certs = Certs::new().unwrap();
    let w = World::start(
        json!({ "admin_users": [OPS], "relay": relay_section(&certs, &[], json!({})) }),
        &[],
    )
    .unwrap();
    w.cloud.create_role(OPS, OPS_PASSWORD).unwrap();
    let console_dsn = |user: &str, password: &str| {
        format!(
            "host=127.0.0.1 port={} user={user} password={password} dbname=lokadb",
            w.proxy.port()
        )
    };

    // Only admin_users, and only with their password.
    let e = connect(&console_dsn(OPS, "wrong")).await.unwrap_err();
    assert_eq!(sqlstate(&e), "28P01");
    let e = connect(&console_dsn(APP_USER, crate::world::APP_PASSWORD))
        .await
        .unwrap_err();
    assert_eq!(sqlstate(&e), "28000", "{e:?}");
    let message = e.as_db_error().unwrap().message();
    assert!(message.contains("may not use the console"), "{message}");
    let console = connect(&console_dsn(OPS, OPS_PASSWORD)).await.unwrap();

    let version = show(&console, "SHOW VERSION").await;
    assert!(get(&version[0], "version").unwrap().starts_with("LokaDB "));
    let config = show(&console, "show config;").await;
    let value = |key: &str| {
        config
            .iter()
            .find(|r| get(r, "key") == Some(key))
            .and_then(|r| get(r, "value").map(str::to_owned))
    };
    assert_eq!(value("max_connections").as_deref(), Some("1000"));
    assert_eq!(value("auth_timeout").as_deref(), Some("30s"));
    assert_eq!(value("admin_users").as_deref(), Some("[\"ops\"]"));
    assert_eq!(value("databases.app.auth_password").as_deref(), Some("***"));
    assert!(config
        .iter()
        .all(|r| !get(r, "value").unwrap_or_default().contains("auth-secret")));
    let dbs = show(&console, "SHOW DATABASES").await;
    assert_eq!(get(&dbs[0], "name"), Some("app"));
    assert_eq!(get(&dbs[0], "sslmode"), Some("prefer"));
    assert!(show(&console, "SHOW ORGS").await.is_empty());
    assert!(show(&console, "SHOW TUNNELS").await.is_empty());

    // A client in a transaction, as the console sees it.
    let app = w.client().await.unwrap();
    let pid: i32 = app
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    app.batch_execute("BEGIN").await.unwrap();
    let client = show_until(&console, "SHOW CLIENTS", |r| {
        get(r, "user") == Some(APP_USER) && get(r, "state") == Some("idle in transaction")
    })
    .await;
    assert_eq!(get(&client, "database"), Some("app"));
    assert_eq!(get(&client, "backend_pid"), Some(pid.to_string().as_str()));
    assert!(get(&client, "address").unwrap().starts_with("127.0.0.1:"));
    let id = get(&client, "id").unwrap().to_owned();
    let server = show_until(&console, "SHOW SERVERS", |r| {
        get(r, "pid") == Some(pid.to_string().as_str())
    })
    .await;
    assert_eq!(
        (
            get(&server, "side"),
            get(&server, "state"),
            get(&server, "client_id")
        ),
        (Some("cloud"), Some("used"), Some(id.as_str()))
    );
    let pool = show_until(&console, "SHOW POOLS", |r| get(r, "user") == Some(APP_USER)).await;
    assert_eq!(get(&pool, "clients"), Some("1"));
    assert!(
        matches!(get(&pool, "pool_mode"), Some("session" | "transaction")),
        "{pool:?}"
    );
    assert_eq!(get(&pool, "waiting"), Some("0"));
    let stats = show(&console, "SHOW STATS").await;
    assert!(stats
        .iter()
        .any(|r| get(r, "metric") == Some("lokadb_requests_total{side=\"cloud\"}")));
    // Latency percentiles per database and route, once requests were timed (published
    // once a second).
    let p99 = "lokadb_request_p99_ms{database=\"app\",route=\"cloud\"}";
    let stats = show_until(&console, "SHOW STATS", |r| get(r, "metric") == Some(p99)).await;
    let value: f64 = get(&stats, "value").unwrap().parse().unwrap();
    assert!(value > 0.0, "{value}");

    // KILL ends the session as if its client had left; the cloud rolls its transaction back.
    assert_eq!(
        console
            .simple_query(&format!("KILL {id}"))
            .await
            .unwrap()
            .len(),
        1
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    while app.simple_query("SELECT 1").await.is_ok() {
        assert!(Instant::now() < deadline, "the killed client still works");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while show(&console, "SHOW CLIENTS")
        .await
        .iter()
        .any(|r| get(r, "id") == Some(id.as_str()))
    {
        assert!(
            Instant::now() < deadline,
            "the killed client is still listed"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    w.client()
        .await
        .unwrap()
        .simple_query("SELECT 1")
        .await
        .unwrap();

    // What it refuses, each with a reason; the console stays usable.
    let e = console.simple_query("KILL 12345").await.unwrap_err();
    assert_eq!(sqlstate(&e), "42704");
    let e = console.simple_query("SHOW TABLES").await.unwrap_err();
    assert_eq!(sqlstate(&e), "42601");
    let message = e.as_db_error().unwrap().message();
    assert!(message.contains("SHOW CLIENTS"), "{message}");
    let e = console.query("SHOW CLIENTS", &[]).await.unwrap_err();
    assert_eq!(sqlstate(&e), "0A000");
    assert_eq!(show(&console, "SHOW VERSION").await.len(), 1);

    // With admin_users, a database may not be called "lokadb".
    let mut config = world::config(&w.cloud, json!({ "admin_users": [OPS] }));
    config["databases"]["lokadb"] = config["databases"]["app"].clone();
    let e = lokadb_tests::proxy::Proxy::start(&config)
        .err()
        .unwrap_or_else(|| panic!("a database named lokadb is refused"));
    assert!(e.to_string().contains("databases.lokadb"), "{e}");
}

/// PAUSE waits for the transactions in progress, then holds every statement of the
/// database until RESUME; the held client's statement then runs.
#[tokio::test]
async fn pause_holds_statements_until_resume() {
    let w = World::start(json!({ "admin_users": [OPS] }), &[]).unwrap();
    w.cloud.create_role(OPS, OPS_PASSWORD).unwrap();
    let console = std::sync::Arc::new(
        connect(&format!(
            "host=127.0.0.1 port={} user={OPS} password={OPS_PASSWORD} dbname=lokadb",
            w.proxy.port()
        ))
        .await
        .unwrap(),
    );
    let app = std::sync::Arc::new(w.client().await.unwrap());
    app.batch_execute("BEGIN; SELECT 1").await.unwrap();

    let pausing = {
        let console = console.clone();
        tokio::spawn(async move { console.simple_query("PAUSE app").await })
    };
    // Not before the transaction in progress ends.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        !pausing.is_finished(),
        "PAUSE answered while a transaction ran"
    );
    app.batch_execute("COMMIT").await.unwrap();
    tokio::time::timeout(Duration::from_secs(30), pausing)
        .await
        .expect("PAUSE answered once the transaction ended")
        .unwrap()
        .unwrap();
    let dbs = show(&console, "SHOW DATABASES").await;
    assert_eq!(get(&dbs[0], "paused"), Some("true"));

    // A statement now waits, its session and connection intact.
    let held = {
        let app = app.clone();
        tokio::spawn(async move { app.query_one("SELECT 42", &[]).await })
    };
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(!held.is_finished(), "a statement ran while paused");
    console.simple_query("RESUME app").await.unwrap();
    let row = tokio::time::timeout(Duration::from_secs(30), held)
        .await
        .expect("the held statement ran after RESUME")
        .unwrap()
        .unwrap();
    assert_eq!(row.get::<_, i32>(0), 42);
    let e = console.simple_query("RESUME app").await.unwrap_err();
    assert_eq!(sqlstate(&e), "55000");
    let e = console.simple_query("PAUSE nowhere").await.unwrap_err();
    assert_eq!(sqlstate(&e), "3D000");
}

/// `SHOW ORGS` of moved organizations: state and profile from the cloud's metadata, the
/// direct connections each holds over all cores, and no tunnel column without a relay in
/// the proxy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn show_orgs_has_each_organizations_direct_connections() {
    let w = crate::several_proxies::world();
    w.cloud.create_role(OPS, OPS_PASSWORD).unwrap();
    let proxy =
        crate::tunnel_world::direct_proxy_with(&w.cloud, 2, json!({ "admin_users": [OPS] }));
    let app = connect(&crate::several_proxies::dsn(&proxy)).await.unwrap();
    app.simple_query("SELECT count(*) FROM notes WHERE organization_id = 2")
        .await
        .unwrap();
    let console = connect(&format!(
        "host=127.0.0.1 port={} user={OPS} password={OPS_PASSWORD} dbname=lokadb",
        proxy.port()
    ))
    .await
    .unwrap();
    let connections = |r: &[(String, Option<String>)]| {
        ["direct_used", "direct_idle"]
            .map(|c| get(r, c).unwrap().parse::<u64>().unwrap())
            .iter()
            .sum::<u64>()
    };
    let two = show_until(&console, "SHOW ORGS", |r| {
        get(r, "organization") == Some("2") && connections(r) >= 1
    })
    .await;
    assert_eq!(
        (
            get(&two, "state"),
            get(&two, "profile"),
            get(&two, "direct")
        ),
        (Some("moved"), Some("fdw+direct"), Some("true")),
        "{two:?}"
    );
    assert_eq!(get(&two, "tunnel"), None, "no relay in this proxy: {two:?}");
    let rows = show(&console, "SHOW ORGS").await;
    let three = rows
        .iter()
        .find(|r| get(r, "organization") == Some("3"))
        .unwrap();
    assert_eq!(
        (get(three, "profile"), connections(three)),
        (Some("fdw"), 0),
        "{three:?}"
    );
}
