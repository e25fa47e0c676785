//! Chaos and abuse: each way a client, an agent or an organization's database can
//! misbehave, while clients of other organizations keep working beside it — the cloud's
//! organization 1 (a read and a write) and organization 3, moved on fdw through the same
//! relay as the abused organization 2 (fdw+direct). For every phase they must see no error
//! and no statement (or login: they reconnect every few statements) slower than
//! [`BOUND`], however long the abuse lasts; and the proxy serves the abused organization
//! again once it is over.

use crate::several_proxies::{dsn, world};
use crate::tunnel_world::{addrs, MovedWorld, APP_PASSWORD, APP_USER, ORG_DB};
use crate::world::connect;
use lokadb_tests::pg::{Cluster, SUPERUSER, SUPERUSER_PASSWORD};
use lokadb_tests::raw::Raw;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

/// The slowest statement or login another organization's client may see during an abuse.
/// Expected: milliseconds (at most a few hundred on a loaded machine); every abuse lasts
/// longer than this, so a client held up by it is caught.
const BOUND: Duration = Duration::from_secs(3);
/// How long each abuse lasts while the others are watched.
const PHASE: Duration = Duration::from_secs(8);
/// Observers open a new session after this many statements (logins are watched too).
const RECONNECT_EVERY: usize = 20;

/// What one observer saw: each statement's (or login's) time and error.
#[derive(Default)]
struct Seen {
    count: usize,
    slowest: Duration,
    errors: Vec<String>,
}

/// Clients of the other organizations, running until [`Observers::stop`].
struct Observers {
    stop: Arc<AtomicBool>,
    tasks: Vec<(String, Arc<Mutex<Seen>>, tokio::task::JoinHandle<()>)>,
}

impl Observers {
    fn start(w: &MovedWorld) -> Observers {
        let stop = Arc::new(AtomicBool::new(false));
        let work = [
            (
                "organization 1 (cloud) read",
                "SELECT count(*) FROM notes WHERE organization_id = 1",
            ),
            (
                "organization 1 (cloud) write",
                "UPDATE notes SET body = body WHERE organization_id = 1 AND id = 1",
            ),
            (
                "organization 3 (fdw, same relay) read",
                "SELECT count(*) FROM notes WHERE organization_id = 3",
            ),
        ];
        let tasks = work
            .into_iter()
            .map(|(name, sql)| {
                let seen = Arc::new(Mutex::new(Seen::default()));
                let task = tokio::spawn(observe(
                    dsn(&w.proxy),
                    sql.to_owned(),
                    seen.clone(),
                    stop.clone(),
                ));
                (name.to_owned(), seen, task)
            })
            .collect();
        Observers { stop, tasks }
    }

    /// Stops the clients and asserts none of them saw an error or waited past [`BOUND`].
    async fn stop(self, phase: &str) {
        self.stop.store(true, Ordering::SeqCst);
        for (name, seen, task) in self.tasks {
            task.await.unwrap();
            let seen = seen.lock().unwrap();
            eprintln!(
                "chaos {phase}: {name}: {} statements, slowest {:?}, {} errors",
                seen.count,
                seen.slowest,
                seen.errors.len()
            );
            assert!(
                seen.errors.is_empty(),
                "{phase}: {name} saw errors: {:?}",
                &seen.errors[..seen.errors.len().min(5)]
            );
            assert!(
                seen.slowest < BOUND,
                "{phase}: {name} waited {:?}",
                seen.slowest
            );
            assert!(seen.count >= 10, "{phase}: {name} ran only {}", seen.count);
        }
    }
}

async fn observe(dsn: String, sql: String, seen: Arc<Mutex<Seen>>, stop: Arc<AtomicBool>) {
    let mut client = None;
    let mut n = 0usize;
    let record = |started: Instant, error: Option<String>| {
        let mut s = seen.lock().unwrap();
        s.count += 1;
        s.slowest = s.slowest.max(started.elapsed());
        s.errors.extend(error);
    };
    while !stop.load(Ordering::SeqCst) {
        if client.is_none() || n.is_multiple_of(RECONNECT_EVERY) {
            let started = Instant::now();
            match tokio::time::timeout(BOUND * 4, connect(&dsn)).await {
                Ok(Ok(c)) => {
                    record(started, None);
                    client = Some(c);
                }
                Ok(Err(e)) => record(started, Some(format!("login: {e:?}"))),
                Err(_) => record(started, Some("login timed out".to_owned())),
            }
        }
        if let Some(c) = &client {
            let started = Instant::now();
            match tokio::time::timeout(BOUND * 4, c.simple_query(&sql)).await {
                Ok(Ok(_)) => record(started, None),
                Ok(Err(e)) => record(started, Some(format!("{e:?}"))),
                Err(_) => record(started, Some("statement timed out".to_owned())),
            }
        }
        n += 1;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Runs `abuse` (which lasts about [`PHASE`]) while the other organizations' clients run,
/// then checks them.
async fn while_others_run<F: std::future::Future>(
    w: &MovedWorld,
    phase: &str,
    abuse: F,
) -> F::Output {
    let observers = Observers::start(w);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let out = abuse.await;
    observers.stop(phase).await;
    out
}

/// Organization 2's read on the direct path, retried until it answers (its agent or
/// database coming back).
async fn org2_served(w: &MovedWorld) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok(c) = connect(&dsn(&w.proxy)).await {
            if c.simple_query("SELECT count(*) FROM notes WHERE organization_id = 2")
                .await
                .is_ok()
            {
                return;
            }
        }
        assert!(
            Instant::now() < deadline,
            "organization 2 not served again: {}",
            w.proxy.output()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// One statement on a session of its own: its error, if any, as text.
async fn once(dsn: String, sql: &'static str) -> Result<(), String> {
    let c = connect(&dsn).await.map_err(|e| format!("{e:?}"))?;
    c.simple_query(sql)
        .await
        .map(|_| ())
        .map_err(|e| format!("{e:?}"))
}

/// Waits (at most `within`) for the abused organization's statement `what` once its abuse is over: an answer or
/// a clear error (printed), not a hang.
async fn finishes(task: tokio::task::JoinHandle<Result<(), String>>, within: Duration, what: &str) {
    let answer = tokio::time::timeout(within, task)
        .await
        .unwrap_or_else(|_| panic!("{what}: still waiting"))
        .unwrap();
    if let Err(e) = answer {
        eprintln!("{what}: {e}");
    }
}

/// Organization 2's own clients, reads and writes in a loop (their errors are expected).
struct Org2Load {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<(usize, Vec<String>)>,
}

fn org2_load(w: &MovedWorld) -> Org2Load {
    let stop = Arc::new(AtomicBool::new(false));
    let (dsn, until) = (dsn(&w.proxy), stop.clone());
    let task = tokio::spawn(async move {
        let (mut served, mut failed) = (0, Vec::new());
        while !until.load(Ordering::SeqCst) {
            let sql = "SELECT count(*) FROM notes WHERE organization_id = 2";
            let outcome = match tokio::time::timeout(BOUND * 4, connect(&dsn)).await {
                Ok(Ok(c)) => tokio::time::timeout(BOUND * 4, c.simple_query(sql))
                    .await
                    .map_err(|_| "timed out".to_owned())
                    .and_then(|r| r.map(|_| ()).map_err(|e| format!("{e:?}"))),
                Ok(Err(e)) => Err(format!("login: {e:?}")),
                Err(_) => Err("login timed out".to_owned()),
            };
            match outcome {
                Ok(()) => served += 1,
                Err(e) => failed.push(e),
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        (served, failed)
    });
    Org2Load { stop, task }
}

impl Org2Load {
    /// Stops it: how many statements were served, and the errors (the first few).
    async fn stop(self) -> (usize, Vec<String>) {
        self.stop.store(true, Ordering::SeqCst);
        let (served, mut failed) = self.task.await.unwrap();
        failed.truncate(3);
        (served, failed)
    }
}

/// The postmaster of `c` and its children.
fn cluster_pids(c: &Cluster) -> Vec<i32> {
    let postmaster = c.pid().expect("cluster running") as i32;
    let mut pids = vec![postmaster];
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        // The parent pid is the second field after the parenthesised command.
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1))
            .and_then(|p| p.parse::<i32>().ok());
        if ppid == Some(postmaster) {
            pids.push(pid);
        }
    }
    pids
}

fn signal_all(pids: &[i32], sig: libc::c_int) {
    for &pid in pids {
        // SAFETY: kill(2) with a pid of a process this test started (through the harness).
        unsafe {
            libc::kill(pid, sig);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_abuse_leaves_the_other_organizations_unharmed() {
    let w = world();

    // Slow-loris: 600 connections from another address trickle their startup packets a
    // byte at a time, on the proxy's client listener and the relay's Postgres listener.
    // The per-address handshake limit holds them to their share; the observers log in.
    let targets = [w.proxy.addr(), addrs(&w.relay).postgres];
    while_others_run(&w, "slow-loris clients", async {
        let packet =
            crate::proxy_limits::startup(&[("user", SUPERUSER), ("database", "app")], 196_608);
        let mut held = Vec::new();
        for i in 0..600 {
            let s = lokadb_tests::connect_from("127.0.0.2:0", targets[i % 2])
                .and_then(|s| s.set_nonblocking(true).map(|()| s))
                .and_then(TcpStream::from_std);
            // One refused at once (over the limit) is as good as held.
            held.extend(s.ok());
        }
        let started = Instant::now();
        let mut at = 0;
        while started.elapsed() < PHASE {
            for s in &mut held {
                // A closed one (over the limit, or cut at the authentication deadline) stays closed.
                let _ = s.write_all(&packet[at % packet.len()..][..1]).await;
            }
            at += 1;
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    })
    .await;

    // Messages declaring 200 MB each from 50 logged-in clients, 1 KB of it sent: the proxy's
    // memory follows the bytes that arrived, not the headers.
    let before = lokadb_tests::rss_kib(w.proxy.pid());
    let grew = while_others_run(&w, "oversized message headers", async {
        let mut held = Vec::new();
        for _ in 0..50 {
            let mut raw = Raw::login(w.proxy.port(), SUPERUSER, SUPERUSER_PASSWORD, &[]).await;
            let mut msg = vec![b'Q'];
            msg.extend_from_slice(&(200u32 << 20).to_be_bytes());
            msg.extend(std::iter::repeat_n(b'x', 1024));
            raw.send(&msg).await;
            held.push(raw);
        }
        tokio::time::sleep(PHASE).await;
        let grew = lokadb_tests::rss_kib(w.proxy.pid()).saturating_sub(before);
        drop(held);
        grew
    })
    .await;
    // 50 × 200 MB were declared; what arrived is 50 KB (plus the sessions' own state).
    assert!(grew < 200 * 1024, "the proxy grew by {grew} KiB");

    // Organization 2's database stops answering (SIGSTOP): its own clients wait (or get an
    // error once connect_timeout passes), the others do not; once it goes on, the waiting
    // statements finish.
    let pids = cluster_pids(&w.orgs[0].db);
    let waiting = while_others_run(&w, "an organization database that never answers", async {
        signal_all(&pids, libc::SIGSTOP);
        let waiting: Vec<_> = (0..3)
            .map(|_| {
                tokio::spawn(once(
                    dsn(&w.proxy),
                    "SELECT count(*) FROM notes WHERE organization_id = 2",
                ))
            })
            .collect();
        tokio::time::sleep(PHASE).await;
        waiting
    })
    .await;
    signal_all(&pids, libc::SIGCONT);
    for t in waiting {
        finishes(
            t,
            Duration::from_secs(60),
            "organization 2's statement after its database went on",
        )
        .await;
    }
    org2_served(&w).await;

    // Organization 2's agent stalls in the middle of a large answer (SIGSTOP): frames half
    // sent, its tunnel full; organization 3's tunnel on the same relay goes on.
    let agent = w.agents[0].pid().expect("agent running") as i32;
    let big = tokio::spawn(once(
        dsn(&w.proxy),
        "SELECT repeat(body, 20000) FROM notes, generate_series(1, 400) WHERE organization_id = 2",
    ));
    tokio::time::sleep(Duration::from_millis(200)).await;
    while_others_run(&w, "an agent that stalls mid-frame", async {
        signal_all(&[agent], libc::SIGSTOP);
        tokio::time::sleep(PHASE).await;
    })
    .await;
    signal_all(&[agent], libc::SIGCONT);
    finishes(
        big,
        Duration::from_secs(120),
        "organization 2's large read after its agent went on",
    )
    .await;
    org2_served(&w).await;

    // A client killed in the middle of a transaction holding organization 1's row: the
    // proxy rolls its backend back, so organization 1's writer is not held up.
    while_others_run(&w, "a client killed mid-transaction", async {
        for _ in 0..5 {
            let c = connect(&dsn(&w.proxy)).await.unwrap();
            c.batch_execute(
                "BEGIN; UPDATE notes SET body = body WHERE organization_id = 1 AND id = 1",
            )
            .await
            .unwrap();
            drop(c);
            tokio::time::sleep(PHASE / 5).await;
        }
    })
    .await;

    // Organization 2's database asks for 30 million SCRAM iterations (PostgreSQL 16 and
    // later can): the proxy refuses to compute them (a minute of a core's time) and its
    // direct logins fail at once with a message saying why; nobody else waits.
    let org_db = &w.orgs[0].db;
    let major: u32 = org_db
        .version()
        .rsplit(' ')
        .next()
        .and_then(|v| v.split('.').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    if major >= 16 {
        let set = |iterations: u32| {
            org_db
                .psql(
                    ORG_DB,
                    &format!(
                        "SET scram_iterations = {iterations};
                         ALTER ROLE {APP_USER} PASSWORD '{APP_PASSWORD}';
                         SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
                          WHERE usename = '{APP_USER}';"
                    ),
                )
                .unwrap();
        };
        let failures = while_others_run(&w, "30 million SCRAM iterations", async {
            set(30_000_000);
            let load = org2_load(&w);
            tokio::time::sleep(PHASE).await;
            load.stop().await
        })
        .await;
        assert!(
            w.proxy.output().contains("SCRAM iterations"),
            "no direct login was refused for its iterations ({failures:?}): {}",
            w.proxy.output()
        );
        set(4096);
        org2_served(&w).await;
    } else {
        eprintln!(
            "chaos: SCRAM iterations phase skipped: {} has no scram_iterations",
            org_db.version()
        );
    }

    // Organization 2's agent and database killed (SIGKILL) under its clients' load.
    while_others_run(&w, "killed agent and database", async {
        let load = org2_load(&w);
        tokio::time::sleep(PHASE / 4).await;
        signal_all(&[agent], libc::SIGKILL);
        tokio::time::sleep(PHASE / 2).await;
        signal_all(&cluster_pids(&w.orgs[0].db), libc::SIGKILL);
        tokio::time::sleep(PHASE / 4).await;
        let (served, failed) = load.stop().await;
        eprintln!("chaos: organization 2 while killed: {served} served, {failed:?}");
    })
    .await;

    // Still one process serving everyone.
    let c = connect(&dsn(&w.proxy)).await.unwrap();
    c.simple_query("SELECT count(*) FROM notes WHERE organization_id = 3")
        .await
        .unwrap();
    assert!(
        !w.proxy.output().contains("panicked"),
        "{}",
        w.proxy.output()
    );
}
