//! Several proxies in front of one cloud share nothing but the cloud: a metadata change
//! and a pause are seen by every one of them at once, as a load balancer in front of them
//! needs.

use crate::admin_cli::{lokadb, ok};
use crate::tunnel_world::{direct_proxy, MovedWorld};
use crate::world::connect;
use lokadb_tests::pg::{SUPERUSER, SUPERUSER_PASSWORD};
use lokadb_tests::proxy::Proxy;
use std::time::{Duration, Instant};

pub(crate) fn world() -> MovedWorld {
    world_with(&crate::tunnel_world::WorldOptions::default())
}

/// [`world`] with options.
pub(crate) fn world_with(options: &crate::tunnel_world::WorldOptions<'_>) -> MovedWorld {
    crate::tunnel_world::moved_world_with(
        |cloud| {
            cloud.create_database("app", "postgres").unwrap();
            ok(&lokadb(&cloud.superuser_dsn("app"), &["init"]));
            cloud
                .psql(
                    "app",
                    "CREATE TABLE notes (organization_id bigint NOT NULL, id bigserial, body text,
                         PRIMARY KEY (organization_id, id));
                     INSERT INTO notes (organization_id, body)
                         SELECT o, 'note ' || i FROM generate_series(1, 3) o, generate_series(1, 10) i;",
                )
                .unwrap();
        },
        &["notes"],
        options,
    )
}

pub(crate) fn dsn(proxy: &Proxy) -> String {
    format!(
        "host=127.0.0.1 port={} user={SUPERUSER} password={SUPERUSER_PASSWORD} dbname=app",
        proxy.port()
    )
}

/// The route the last `route_log` line of `sql` gives (waiting for it to be logged).
pub(crate) fn last_route(proxy: &Proxy, sql: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let route = proxy
            .output()
            .lines()
            .rev()
            .find(|l| l.contains("lokadb::route") && l.contains(sql))
            .and_then(|l| l.split("route=").nth(1))
            .and_then(|r| r.split_whitespace().next())
            .map(str::to_owned);
        if let Some(route) = route {
            return route;
        }
        assert!(Instant::now() < deadline, "no route line for {sql}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_metadata_change_and_a_pause_reach_every_proxy() {
    let w = world();
    let second = direct_proxy(&w.cloud, 2);
    let proxies = [&w.proxy, &second];
    let cloud_dsn = w.cloud.superuser_dsn("app");

    // Organization 2 is fdw+direct: both proxies read it in its database.
    let read = "SELECT count(*) FROM notes WHERE organization_id = 2";
    for p in proxies {
        let c = connect(&dsn(p)).await.unwrap();
        c.simple_query(read).await.unwrap();
        assert_eq!(last_route(p, read), "\"direct\"", "{}", p.output());
    }

    // One change in the cloud: both proxies route by it, sessions already open included.
    let sessions = [
        connect(&dsn(proxies[0])).await.unwrap(),
        connect(&dsn(proxies[1])).await.unwrap(),
    ];
    w.cloud
        .psql(
            "app",
            "UPDATE lokadb.org SET profile = 'fdw' WHERE id = '2'",
        )
        .unwrap();
    for (p, c) in proxies.iter().zip(&sessions) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            c.simple_query(read).await.unwrap();
            if last_route(p, read) == "\"cloud\"" {
                break;
            }
            assert!(Instant::now() < deadline, "still direct: {}", p.output());
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    // A pause holds organization 2's writes through either proxy until resume.
    ok(&lokadb(&cloud_dsn, &["pause", "2", "--timeout", "60s"]));
    // Different rows through each (postgres_fdw runs remote writes in REPEATABLE READ: two
    // on one row would fail one with 40001, as straight at the cloud).
    let writes = [
        "UPDATE notes SET body = body || '!' WHERE organization_id = 2 AND id % 2 = 0",
        "UPDATE notes SET body = body || '!' WHERE organization_id = 2 AND id % 2 = 1",
    ];
    let writers: Vec<_> = proxies
        .iter()
        .zip(writes)
        .map(|(p, write)| crate::world::timed_write(&dsn(p), write))
        .collect();
    tokio::time::sleep(Duration::from_secs(2)).await;
    for w in &writers {
        assert!(
            !w.is_finished(),
            "a write went through a paused organization"
        );
    }
    // Another organization's writes go on through both.
    for c in &sessions {
        c.simple_query("UPDATE notes SET body = body WHERE organization_id = 3")
            .await
            .unwrap();
    }
    ok(&lokadb(&cloud_dsn, &["resume", "2"]));
    for w in writers {
        tokio::time::timeout(Duration::from_secs(30), w)
            .await
            .expect("the write went on after resume")
            .unwrap();
    }
    // Both writes happened, each row once.
    assert_eq!(
        w.cloud
            .psql(
                "app",
                "SELECT count(*) FILTER (WHERE body LIKE '%!' AND body NOT LIKE '%!!') FROM notes WHERE organization_id = 2"
            )
            .unwrap(),
        "10"
    );
}
