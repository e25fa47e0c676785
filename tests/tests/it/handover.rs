//! Restarts without refusing a client (`"handover"`): a new process takes the listening
//! sockets of the running one over a Unix socket, the old one drains as on SIGTERM and
//! exits by itself, and clients connecting all along are all served — for the proxy, and
//! for a relay whose agent moves to the new process.

use crate::tunnel_world::{addrs, relay_dsn, relay_section, start_agent, Certs, Org};
use crate::world::{self, connect, World};
use lokadb_tests::proxy::Proxy;
use lokadb_tests::TempDir;
use serde_json::json;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Clients that each connect, run one query and leave, one after another, until stopped:
/// what a restart must not refuse.
struct Churn {
    stop: Arc<AtomicBool>,
    served: Arc<Mutex<(u64, Vec<String>)>>,
    task: tokio::task::JoinHandle<()>,
}

impl Churn {
    fn start(dsn: String, sql: &'static str) -> Churn {
        let stop = Arc::new(AtomicBool::new(false));
        let served = Arc::new(Mutex::new((0u64, Vec::new())));
        let (flag, tally) = (stop.clone(), served.clone());
        let task = tokio::spawn(async move {
            while !flag.load(Ordering::Relaxed) {
                let result = async {
                    let c = connect(&dsn).await?;
                    c.simple_query(sql).await
                }
                .await;
                let mut t = tally.lock().unwrap();
                match result {
                    Ok(_) => t.0 += 1,
                    Err(e) => t.1.push(format!("{e:?}")),
                }
            }
        });
        Churn { stop, served, task }
    }

    fn served(&self) -> u64 {
        self.served.lock().unwrap().0
    }

    /// Stops and returns (connections served, errors).
    async fn finish(self) -> (u64, Vec<String>) {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await.unwrap();
        let t = self.served.lock().unwrap();
        (t.0, t.1.clone())
    }

    /// Waits until `more` further connections were served.
    async fn wait_more(&self, more: u64) {
        let target = self.served() + more;
        let deadline = Instant::now() + Duration::from_secs(60);
        while self.served() < target {
            assert!(
                Instant::now() < deadline,
                "the clients stalled at {}",
                self.served()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_proxy_takes_the_sockets_and_the_old_one_drains() {
    let dir = TempDir::new("lokadb-handover").unwrap();
    let sock = dir.path().join("proxy.sock");
    let extra = json!({ "handover": sock, "metrics": "127.0.0.1:0" });
    let mut w = World::start(extra.clone(), &[]).unwrap();
    let dsn = w.dsn();

    // A session in a transaction on the old process: it may finish it there.
    let held = connect(&dsn).await.unwrap();
    held.simple_query("BEGIN; SELECT 1").await.unwrap();
    // And one running a long statement there, which its client cancels after the handover.
    let busy = connect(&dsn).await.unwrap();
    let cancel = busy.cancel_token();
    let sleeping = tokio::spawn(async move {
        let r = busy.simple_query("SELECT pg_sleep(120)").await;
        (busy, r)
    });
    let churn = Churn::start(dsn.clone(), "SELECT 1");
    churn.wait_more(20).await;

    let mut next = Proxy::builder(world::config(&w.cloud, extra.clone()))
        .start()
        .unwrap();
    assert_eq!(next.port(), w.proxy.port(), "{}", next.output());
    // stdout and stderr are read apart: the log line may come after "listening on".
    assert!(
        next.wait_for_output(
            "handover: took the listening sockets",
            Duration::from_secs(20)
        ),
        "{}",
        next.output()
    );
    assert!(
        w.proxy
            .wait_for_output("handover: the new process accepts", Duration::from_secs(20)),
        "{}",
        w.proxy.output()
    );
    // The cancel reaches the listening socket, served by the new process now, which hands
    // the key it does not know to the old one.
    cancel.cancel_query(tokio_postgres::NoTls).await.unwrap();
    let (busy, r) = tokio::time::timeout(Duration::from_secs(60), sleeping)
        .await
        .expect("the cancel of a draining session's statement was lost")
        .unwrap();
    let e = r.expect_err("cancelled");
    assert_eq!(world::sqlstate(&e), "57014", "{e:?}");
    drop(busy);
    // The transaction goes on and commits on the old process, which then ends the session.
    held.simple_query("SELECT 2").await.unwrap();
    held.simple_query("COMMIT").await.unwrap();
    let exited = w.proxy.wait_exit(Duration::from_secs(60));
    assert!(
        exited.is_some_and(|s| s.success()),
        "the old process did not exit by itself: {exited:?}\n{}",
        w.proxy.output()
    );
    churn.wait_more(50).await;

    // And again: the new process hands over in turn.
    let third = Proxy::builder(world::config(&w.cloud, extra))
        .start()
        .unwrap();
    assert_eq!(third.port(), next.port());
    assert!(
        next.wait_exit(Duration::from_secs(60)).is_some(),
        "{}",
        next.output()
    );
    churn.wait_more(50).await;

    let (served, errors) = churn.finish().await;
    assert!(
        errors.is_empty(),
        "{} of {} connections failed across two restarts: {:?}",
        errors.len(),
        served + errors.len() as u64,
        &errors[..errors.len().min(5)]
    );
    let c = connect(&dsn)
        .await
        .unwrap_or_else(|e| panic!("{e:?}\n{}", third.output()));
    c.simple_query("SELECT 1").await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_relay_takes_the_sockets_and_the_agent_follows() {
    let dir = TempDir::new("lokadb-handover").unwrap();
    let sock = dir.path().join("relay.sock");
    let certs = Certs::new().unwrap();
    let org = Org::start("7").unwrap();
    let config = json!({
        "relay": relay_section(&certs, &[&org], json!({})),
        "handover": sock,
    });
    let mut old = Proxy::builder(config.clone()).relay_only().start().unwrap();
    let agent = start_agent(&certs, &org, addrs(&old).agents, &[]).unwrap();
    let dsn = relay_dsn(&old, "7");
    let deadline = Instant::now() + Duration::from_secs(30);
    while connect(&dsn).await.is_err() {
        assert!(Instant::now() < deadline, "the agent never connected");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let churn = Churn::start(dsn.clone(), "SELECT count(*) FROM items");
    churn.wait_more(20).await;
    // A client the old relay accepted that sends its startup packet only once the new
    // one took the sockets: the old one must still open its stream (a draining tunnel
    // takes none, and the new relay never sees this client).
    let early = tokio::net::TcpStream::connect(addrs(&old).postgres)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;

    let started = Instant::now();
    let new = Proxy::builder(config).relay_only().start().unwrap();
    assert_eq!(addrs(&new).agents, addrs(&old).agents);
    assert_eq!(addrs(&new).postgres, addrs(&old).postgres);
    assert!(
        old.wait_for_output("relay stopped accepting", Duration::from_secs(20)),
        "{}",
        old.output()
    );
    let (early, conn) = dsn
        .parse::<tokio_postgres::Config>()
        .unwrap()
        .connect_raw(early, tokio_postgres::NoTls)
        .await
        .unwrap_or_else(|e| panic!("the client accepted before the handover: {e}"));
    tokio::spawn(conn);
    early.simple_query("SELECT 1").await.unwrap();
    drop(early);
    assert!(
        new.wait_for_output("agent connected", Duration::from_secs(20)),
        "the agent did not move to the new relay\n{}\n{}",
        new.output(),
        agent.output()
    );
    eprintln!(
        "the agent reached the new relay {:?} after it started",
        started.elapsed()
    );
    let exited = old.wait_exit(Duration::from_secs(60));
    assert!(
        exited.is_some_and(|s| s.success()),
        "{exited:?}\n{}",
        old.output()
    );
    churn.wait_more(50).await;

    let (served, errors) = churn.finish().await;
    assert!(
        errors.is_empty(),
        "{} of {} connections through the relay failed across its restart: {:?}",
        errors.len(),
        served + errors.len() as u64,
        &errors[..errors.len().min(5)]
    );
}
