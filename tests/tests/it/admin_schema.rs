//! `lokadb init`, `lokadb org`, `lokadb pause` / `resume` against real clusters.

use crate::admin_cli::{lokadb, stderr, stdout};
use crate::tunnel_world::*;
use lokadb_tests::pg::Cluster;
use serde_json::json;
use std::time::{Duration, Instant};

/// A cloud cluster with database `app` and the lokadb schema.
fn cloud_with_schema() -> (Cluster, String) {
    let cloud = Cluster::start().unwrap();
    cloud.create_database("app", "postgres").unwrap();
    let dsn = cloud.superuser_dsn("app");
    let out = lokadb(&dsn, &["init"]);
    assert!(out.status.success(), "{}", stderr(&out));
    (cloud, dsn)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn init_is_versioned_idempotent_and_announces_changes() {
    let cloud = Cluster::start().unwrap();
    cloud.create_database("app", "postgres").unwrap();
    let dsn = cloud.superuser_dsn("app");
    let out = lokadb(&dsn, &["init"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).contains("upgraded from version 0 to 20"),
        "{}",
        stdout(&out)
    );
    let out = lokadb(&dsn, &["init"]);
    assert!(
        stdout(&out).contains("up to date (version 20)"),
        "{}",
        stdout(&out)
    );
    assert_eq!(
        cloud
            .psql("app", "SELECT version FROM lokadb.migrations ORDER BY 1")
            .unwrap(),
        "1\n2\n3\n4\n5\n6\n7\n8\n9\n10\n11\n12\n13\n14\n15\n16\n17\n18\n19\n20"
    );

    // Every change of lokadb.org bumps the generation and NOTIFYs it.
    let (client, mut conn) = tokio_postgres::connect(&dsn, tokio_postgres::NoTls)
        .await
        .unwrap();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut stream = futures_util::stream::poll_fn(move |cx| conn.poll_message(cx));
        use futures_util::StreamExt;
        while let Some(Ok(m)) = stream.next().await {
            if let tokio_postgres::AsyncMessage::Notification(n) = m {
                let _ = tx.send(n.payload().to_owned());
            }
        }
    });
    client.batch_execute("LISTEN lokadb_meta").await.unwrap();
    let before: i64 = client
        .query_one("SELECT generation FROM lokadb.meta", &[])
        .await
        .unwrap()
        .get(0);
    cloud
        .psql("app", "INSERT INTO lokadb.org (id) VALUES ('acme')")
        .unwrap();
    let note = tokio::time::timeout(Duration::from_secs(5), rx.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(note, (before + 1).to_string());
    cloud
        .psql(
            "app",
            "UPDATE lokadb.org SET name = 'Acme' WHERE id = 'acme'",
        )
        .unwrap();
    let note = tokio::time::timeout(Duration::from_secs(5), rx.recv())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(note, (before + 2).to_string());

    // Commands refuse a database without the schema, naming the fix.
    let bare = cloud.superuser_dsn("postgres");
    let out = lokadb(&bare, &["org", "list"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("run `lokadb init"),
        "{}",
        stderr(&out)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn org_add_checks_the_database_through_the_relay() {
    let certs = Certs::new().unwrap();
    let acme = Org::start("acme").unwrap();
    let globex = Org::start("globex").unwrap();
    let relay = start_relay(&certs, &[&acme, &globex], json!({}), &[]).unwrap();
    let _agent = start_agent(&certs, &acme, addrs(&relay).agents, &[]).unwrap();
    let (cloud, dsn) = cloud_with_schema();
    let via = addrs(&relay).postgres.to_string();
    let add = |id: &str| {
        lokadb(
            &dsn,
            &org_add(id, std::slice::from_ref(&via), &["--profile", "fdw+direct"]),
        )
    };
    let out = add("acme");
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains("PostgreSQL 1"), "{}", stdout(&out));
    assert_eq!(
        cloud
            .psql(
                "app",
                "SELECT srvname || ' ' || array_to_string(srvoptions, ',') FROM pg_foreign_server"
            )
            .unwrap(),
        format!(
            "lokadb_org_acme host=127.0.0.1,port={},dbname=acme/orgdb,fetch_size=1000,sslmode=disable",
            addrs(&relay).postgres.port()
        )
    );
    let list = stdout(&lokadb(&dsn, &["org", "list"]));
    assert!(
        list.contains("acme") && list.contains("fdw+direct"),
        "{list}"
    );
    let show = stdout(&lokadb(&dsn, &["org", "show", "acme"]));
    assert!(show.contains("state       cloud"), "{show}");

    // Twice: refused, nothing changed.
    let out = add("acme");
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("already registered"));
    // globex has no agent: the check fails and nothing is left behind.
    let out = add("globex");
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("does not answer through the relay"),
        "{}",
        stderr(&out)
    );
    assert!(stderr(&out).contains("has no agent"), "{}", stderr(&out));
    assert_eq!(
        cloud
            .psql(
                "app",
                "SELECT count(*) FROM pg_foreign_server WHERE srvname = 'lokadb_org_globex'"
            )
            .unwrap(),
        "0"
    );
    assert_eq!(
        cloud
            .psql("app", "SELECT count(*) FROM lokadb.org")
            .unwrap(),
        "1"
    );
    // Bad input.
    let out = add("a/b");
    assert_eq!(out.status.code(), Some(2));
    let out = lokadb(&dsn, &["org", "show", "initech"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("not registered"));

    let out = lokadb(&dsn, &["org", "remove", "acme"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(
        cloud
            .psql("app", "SELECT count(*) FROM pg_foreign_server")
            .unwrap(),
        "0"
    );
    let out = lokadb(&dsn, &["org", "remove", "acme"]);
    assert_eq!(out.status.code(), Some(2));
}

/// A table whose rows' writes pass the pause gate, for tests before `enable`.
fn gated_table(cloud: &Cluster) {
    cloud
        .psql(
            "app",
            "CREATE TABLE docs (organization_id text, v int);
             CREATE FUNCTION gate() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN PERFORM lokadb.write_gate(coalesce(NEW.organization_id, OLD.organization_id)); RETURN NEW; END $$;
             CREATE TRIGGER gate BEFORE INSERT OR UPDATE ON docs FOR EACH ROW EXECUTE FUNCTION gate();
             INSERT INTO lokadb.org (id) VALUES ('acme'), ('globex');
             INSERT INTO docs VALUES ('acme', 0), ('globex', 0);",
        )
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pause_holds_one_organizations_writes_until_resume() {
    let (cloud, dsn) = cloud_with_schema();
    gated_table(&cloud);
    let out = lokadb(&dsn, &["pause", "acme", "--timeout", "20s"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains("organization acme is paused"));
    let again = lokadb(&dsn, &["pause", "acme"]);
    assert_eq!(again.status.code(), Some(2));
    assert!(
        stderr(&again).contains("already paused"),
        "{}",
        stderr(&again)
    );

    let app = crate::world::connect(&dsn).await.unwrap();
    // acme's write waits; globex's write and acme's read do not.
    let writer = crate::world::timed_write(
        &dsn,
        "UPDATE docs SET v = v + 1 WHERE organization_id = 'acme'",
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!writer.is_finished());
    app.execute(
        "UPDATE docs SET v = v + 1 WHERE organization_id = 'globex'",
        &[],
    )
    .await
    .unwrap();
    app.query("SELECT * FROM docs WHERE organization_id = 'acme'", &[])
        .await
        .unwrap();
    let show = stdout(&lokadb(&dsn, &["org", "show", "acme"]));
    assert!(show.contains("lokadb pause"), "{show}");

    let out = lokadb(&dsn, &["resume", "acme"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let waited = writer.await.unwrap();
    assert!(waited >= Duration::from_millis(400), "{waited:?}");
    assert_eq!(
        cloud
            .psql("app", "SELECT v FROM docs WHERE organization_id = 'acme'")
            .unwrap(),
        "1"
    );
    let out = lokadb(&dsn, &["resume", "acme"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("not paused"));
    let out = lokadb(&dsn, &["pause", "initech"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("not registered"), "{}", stderr(&out));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pause_times_out_writers_and_never_outlives_its_holder() {
    let (cloud, dsn) = cloud_with_schema();
    gated_table(&cloud);
    let out = lokadb(&dsn, &["pause", "acme", "--timeout", "1s"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let w = crate::world::connect(&dsn).await.unwrap();
    let started = Instant::now();
    let e = w
        .execute(
            "UPDATE docs SET v = v + 1 WHERE organization_id = 'acme'",
            &[],
        )
        .await
        .unwrap_err();
    let db = e.as_db_error().unwrap();
    assert_eq!(db.code().code(), "55P03");
    assert!(
        db.message().contains("organization acme is paused"),
        "{}",
        db.message()
    );
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(900) && waited < Duration::from_secs(5),
        "{waited:?}"
    );

    // The holder dies: the pause ends with it.
    let holder: i32 = cloud
        .psql(
            "app",
            "SELECT holder_pid FROM lokadb.pause WHERE org = 'acme'",
        )
        .unwrap()
        .parse()
        .unwrap();
    cloud
        .psql("app", &format!("SELECT pg_terminate_backend({holder})"))
        .unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    w.execute(
        "UPDATE docs SET v = v + 1 WHERE organization_id = 'acme'",
        &[],
    )
    .await
    .unwrap();
}
