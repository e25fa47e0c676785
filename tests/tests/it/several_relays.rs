//! Several relays: every agent dials each, and `lokadb org add --via-relay A --via-relay B`
//! lists both in the organization's postgres_fdw server (libpq tries them in order) and for
//! the direct path. One relay killed under load: the cloud's organizations see nothing, a
//! moved organization's statements fail at most for the time it takes to reach the other.

use crate::several_proxies::{dsn, world_with};
use crate::tunnel_world::WorldOptions;
use crate::world::connect;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// (time, error) of every statement a loop ran; the loop reconnects after an error that
/// ended its session.
type Outcomes = Arc<Mutex<Vec<(Instant, Option<String>)>>>;

fn statements(
    dsn: String,
    sql: String,
    until: Arc<Mutex<bool>>,
) -> (Outcomes, tokio::task::JoinHandle<()>) {
    let out: Outcomes = Arc::default();
    let seen = out.clone();
    let task = tokio::spawn(async move {
        let mut client = None;
        while !*until.lock().unwrap() {
            if client.is_none() {
                client = connect(&dsn).await.ok();
            }
            let result = match &client {
                Some(c) => c
                    .simple_query(&sql)
                    .await
                    .map(|_| ())
                    .map_err(|e| format!("{e:?}")),
                None => Err("cannot connect".to_owned()),
            };
            if result.is_err() && client.as_ref().is_none_or(|c| c.is_closed()) {
                client = None;
            }
            seen.lock().unwrap().push((Instant::now(), result.err()));
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    });
    (out, task)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_killed_under_load_loses_no_organization() {
    let w = world_with(&WorldOptions {
        more_relays: 1,
        ..WorldOptions::default()
    });
    let hosts = w
        .cloud
        .psql(
            "app",
            "SELECT array_to_string(srvoptions, ' ') FROM pg_foreign_server WHERE srvname = 'lokadb_org_2'",
        )
        .unwrap();
    let ports = [&w.relay, &w.more_relays[0]]
        .map(|r| r.relay().unwrap().postgres.port().to_string())
        .join(",");
    assert!(hosts.contains(&format!("port={ports}")), "{hosts}");

    let stop = Arc::new(Mutex::new(false));
    // Organization 1 in the cloud, 2 moved with fdw+direct (the proxy to a relay), 3 moved
    // with fdw (the cloud to a relay).
    let loops: Vec<_> = [1, 2, 3]
        .map(|org| {
            statements(
                dsn(&w.proxy),
                format!("SELECT count(*) FROM notes WHERE organization_id = {org}"),
                stop.clone(),
            )
        })
        .into_iter()
        .collect();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let killed = Instant::now();
    w.relay.signal(libc::SIGKILL);
    tokio::time::sleep(Duration::from_secs(8)).await;
    *stop.lock().unwrap() = true;
    let mut outcomes = Vec::new();
    for (out, task) in loops {
        task.await.unwrap();
        outcomes.push(out.lock().unwrap().clone());
    }

    let errors = |o: &[(Instant, Option<String>)]| -> Vec<(Duration, String)> {
        o.iter()
            .filter_map(|(t, e)| e.clone().map(|e| (t.saturating_duration_since(killed), e)))
            .collect()
    };
    let cloud = errors(&outcomes[0]);
    assert!(
        cloud.is_empty(),
        "the cloud's organization saw errors: {cloud:?}"
    );
    for (org, o) in [(2, &outcomes[1]), (3, &outcomes[2])] {
        let failed = errors(o);
        eprintln!(
            "organization {org}: {} statements, {} failed, the last failure {:?} after the kill",
            o.len(),
            failed.len(),
            failed.last().map(|(d, _)| *d)
        );
        // Bounded: the expected reconnect is well under a second; 5 s on a loaded machine.
        assert!(
            failed.iter().all(|(d, _)| *d < Duration::from_secs(5)),
            "organization {org} failed late: {:?}",
            &failed[..failed.len().min(5)]
        );
        let served_after = o
            .iter()
            .filter(|(t, e)| {
                e.is_none() && t.saturating_duration_since(killed) > Duration::from_secs(5)
            })
            .count();
        assert!(
            served_after > 10,
            "organization {org} not served after the kill: {served_after}"
        );
    }
}
