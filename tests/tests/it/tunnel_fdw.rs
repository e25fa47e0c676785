//! postgres_fdw and direct clients reaching organization databases through the relay,
//! the tunnel and the agent.

use crate::tunnel_world::*;
use crate::world::{connect, sqlstate};
use serde_json::json;
use std::time::{Duration, Instant};

/// The server's message of a tokio-postgres error, or its Display.
fn msg(e: &tokio_postgres::Error) -> String {
    e.as_db_error()
        .map_or_else(|| e.to_string(), |d| d.message().to_owned())
}

/// Reads, inserts, updates and deletes an organization's rows from the cloud
/// database through postgres_fdw → relay → tunnel → agent, with no delay and with
/// 20 ms round-trip time between relay and agent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fdw_reads_and_writes_through_the_tunnel_at_0_and_20_ms() {
    let certs = Certs::new().unwrap();
    let acme = Org::start("acme").unwrap();
    let relay = start_relay(&certs, &[&acme], json!({}), &[]).unwrap();
    let link = link_to(&relay, Duration::ZERO).unwrap();
    let _agent = start_agent(&certs, &acme, link.addr(), &[]).unwrap();
    let cloud = start_cloud(&relay, &[&acme]).unwrap();

    for (round, one_way) in [Duration::ZERO, Duration::from_millis(10)]
        .into_iter()
        .enumerate()
    {
        link.set_delay(one_way);
        // A new session: postgres_fdw opens its own connection through the relay.
        let c = cloud_client(&cloud).await.unwrap();
        let n: i64 = c
            .query_one("SELECT count(*) FROM items_acme", &[])
            .await
            .unwrap()
            .get(0);
        // 9 rows stay from each earlier round.
        assert_eq!(n, 1000 + 9 * round as i64);
        let base = 10_000 + one_way.as_millis() as i32 * 100;
        c.execute(
            "INSERT INTO items_acme SELECT g, 'acme', 'new' FROM generate_series($1::int, $1::int + 9) g",
            &[&base],
        )
        .await
        .unwrap();
        let updated = c
            .execute(
                "UPDATE items_acme SET body = 'changed' WHERE id BETWEEN $1::int AND $1::int + 4",
                &[&base],
            )
            .await
            .unwrap();
        assert_eq!(updated, 5);
        let deleted = c
            .execute("DELETE FROM items_acme WHERE id = $1::int + 9", &[&base])
            .await
            .unwrap();
        assert_eq!(deleted, 1);
        // A point read takes at least one round trip of the link.
        let started = Instant::now();
        let body: String = c
            .query_one("SELECT body FROM items_acme WHERE id = $1", &[&base])
            .await
            .unwrap()
            .get(0);
        assert_eq!(body, "changed");
        assert!(started.elapsed() >= one_way * 2, "{:?}", started.elapsed());

        // The organization's own database has exactly those rows.
        let check = acme
            .db
            .psql(
                ORG_DB,
                &format!(
                    "SELECT count(*), count(*) FILTER (WHERE body = 'changed') FROM items WHERE id BETWEEN {base} AND {base} + 9"
                ),
            )
            .unwrap();
        assert_eq!(check, "9|5");
    }
}

/// 100 streams at once on one tunnel, each with its own query and asserted result.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_concurrent_streams() {
    let certs = Certs::new().unwrap();
    let acme = Org::start("acme").unwrap();
    let relay = start_relay(&certs, &[&acme], json!({}), &[]).unwrap();
    let _agent = start_agent(&certs, &acme, addrs(&relay).agents, &["--max-conns", "200"]).unwrap();
    let dsn = relay_dsn(&relay, "acme");
    let mut tasks = Vec::new();
    for i in 0..100i32 {
        let dsn = dsn.clone();
        tasks.push(tokio::spawn(async move {
            let c = connect(&dsn).await.unwrap();
            // Hold every connection open together before querying.
            tokio::time::sleep(Duration::from_millis(300)).await;
            let mut sums = Vec::new();
            for _ in 0..5 {
                let row = c
                    .query_one(
                        "SELECT sum(id)::int8, count(*) FROM items WHERE id % 100 = $1",
                        &[&i],
                    )
                    .await
                    .unwrap();
                sums.push((row.get::<_, i64>(0), row.get::<_, i64>(1)));
            }
            (i, sums)
        }));
    }
    for t in tasks {
        let (i, sums) = t.await.unwrap();
        let expected: i64 = (1..=1000i64).filter(|id| id % 100 == i64::from(i)).sum();
        for (sum, count) in sums {
            assert_eq!((sum, count), (expected, 10), "stream {i}");
        }
    }
}

/// Each refusal is a Postgres error at once, naming what refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_name_the_organization_or_the_limit() {
    let certs = Certs::new().unwrap();
    let acme = Org::start("acme").unwrap();
    let globex = Org::start("globex").unwrap();
    let relay = start_relay(&certs, &[&acme, &globex], json!({ "max_streams": 3 }), &[]).unwrap();
    let _agent = start_agent(&certs, &acme, addrs(&relay).agents, &["--max-conns", "2"]).unwrap();

    // Unknown organization.
    let started = Instant::now();
    let e = connect(&relay_dsn(&relay, "initech")).await.unwrap_err();
    assert_eq!(sqlstate(&e), "3D000", "{e}");
    assert!(msg(&e).contains("\"initech\" is not known"), "{e}");
    // Known, but no agent connected.
    let e = connect(&relay_dsn(&relay, "globex")).await.unwrap_err();
    assert_eq!(sqlstate(&e), "08001", "{e}");
    assert!(msg(&e).contains("\"globex\" has no agent"), "{e}");
    assert!(started.elapsed() < Duration::from_secs(2));

    // The agent's -max-conns (2).
    let a1 = connect(&relay_dsn(&relay, "acme")).await.unwrap();
    let a2 = connect(&relay_dsn(&relay, "acme")).await.unwrap();
    let e = connect(&relay_dsn(&relay, "acme")).await.unwrap_err();
    assert_eq!(sqlstate(&e), "53300", "{e}");
    assert!(msg(&e).contains("-max-conns limit (2"), "{e}");
    for c in [&a1, &a2] {
        c.simple_query("SELECT 1").await.unwrap();
    }
    drop(a2);
    tokio::time::sleep(Duration::from_millis(200)).await;

    // The relay's max_streams (3), with a second agent so the agent limit is not first.
    let _agent2 = start_agent(&certs, &globex, addrs(&relay).agents, &[]).unwrap();
    let g1 = connect(&relay_dsn(&relay, "globex")).await.unwrap();
    let g2 = connect(&relay_dsn(&relay, "globex")).await.unwrap();
    let e = connect(&relay_dsn(&relay, "globex")).await.unwrap_err();
    assert_eq!(sqlstate(&e), "53300", "{e}");
    assert!(msg(&e).contains("max_streams limit (3"), "{e}");
    for c in [&a1, &g1, &g2] {
        c.simple_query("SELECT 1").await.unwrap();
    }
}

/// An agent killed: its streams fail with a clear error, another organization's
/// streams go on; a new agent brings the organization back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_killed_fails_only_its_streams() {
    let certs = Certs::new().unwrap();
    let acme = Org::start("acme").unwrap();
    let globex = Org::start("globex").unwrap();
    let relay = start_relay(&certs, &[&acme, &globex], json!({}), &[]).unwrap();
    let mut acme_agent = start_agent(&certs, &acme, addrs(&relay).agents, &[]).unwrap();
    let _globex_agent = start_agent(&certs, &globex, addrs(&relay).agents, &[]).unwrap();
    let a = connect(&relay_dsn(&relay, "acme")).await.unwrap();
    let g = connect(&relay_dsn(&relay, "globex")).await.unwrap();
    a.simple_query("SELECT 1").await.unwrap();
    g.simple_query("SELECT 1").await.unwrap();

    acme_agent.kill();
    // The relay learns at once (the agent's socket closed).
    let e = a.simple_query("SELECT 1").await.unwrap_err();
    assert!(a.is_closed() || msg(&e).contains("acme"), "{e}");
    assert_eq!(items(&g).await, 1000);
    let e = connect(&relay_dsn(&relay, "acme")).await.unwrap_err();
    assert!(msg(&e).contains("\"acme\" has no agent"), "{e}");

    let _back = start_agent(&certs, &acme, addrs(&relay).agents, &[]).unwrap();
    let a = connect(&relay_dsn(&relay, "acme")).await.unwrap();
    let n: i64 = items(&a).await;
    assert_eq!(n, 1000);
    assert!(relay.output().contains("agent disconnected"));
}
