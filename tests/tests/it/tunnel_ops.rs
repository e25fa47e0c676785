//! The tunnel in operation: relay restarts, cut links, slow readers, counters, and the
//! relay inside the proxy.

use crate::tunnel_world::*;
use crate::world::connect;
use lokadb_tests::proxy::Proxy;
use serde_json::json;
use std::collections::HashMap;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// `SHOW STATS` of the relay's admin database as a map.
async fn relay_stats(relay: &Proxy) -> HashMap<String, u64> {
    let dsn = format!(
        "host=127.0.0.1 port={} user=ops dbname=lokadb_relay",
        addrs(relay).postgres.port()
    );
    let c = connect(&dsn).await.unwrap();
    let mut stats = HashMap::new();
    for m in c.simple_query("SHOW STATS").await.unwrap() {
        if let tokio_postgres::SimpleQueryMessage::Row(r) = m {
            stats.insert(
                r.get(0).unwrap().to_owned(),
                r.get(1).unwrap().parse().unwrap(),
            );
        }
    }
    stats
}

/// Organizations acme and globex, each with its agent connected to one `lokadb relay`.
struct TwoOrgs {
    certs: Certs,
    acme: Org,
    globex: Org,
    relay: Proxy,
    _agents: [lokadb_tests::agent::Agent; 2],
}

impl TwoOrgs {
    fn start() -> TwoOrgs {
        let certs = Certs::new().unwrap();
        let acme = Org::start("acme").unwrap();
        let globex = Org::start("globex").unwrap();
        let relay = start_relay(&certs, &[&acme, &globex], json!({}), &[]).unwrap();
        let agents = [&acme, &globex]
            .map(|org| start_agent(&certs, org, addrs(&relay).agents, &[]).unwrap());
        TwoOrgs {
            certs,
            acme,
            globex,
            relay,
            _agents: agents,
        }
    }
}

/// Polls a new connection through the relay until a query works.
async fn wait_reachable(dsn: &str, timeout: Duration) -> Duration {
    let started = Instant::now();
    loop {
        if let Ok(c) = connect(dsn).await {
            if c.simple_query("SELECT 1").await.is_ok() {
                return started.elapsed();
            }
        }
        assert!(
            started.elapsed() < timeout,
            "not reachable within {timeout:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// SIGTERM under load: the relay drains (no new streams, agents told to reconnect,
/// streams finish within drain_timeout), and a new relay process on the same ports has
/// the agents back within a second of listening.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_relay_has_its_agents_back_within_a_second() {
    let TwoOrgs {
        certs,
        acme,
        globex,
        relay,
        _agents,
    } = TwoOrgs::start();
    let ports = addrs(&relay);

    // Load: clients querying in a loop, reconnecting after errors.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut load = Vec::new();
    for org in ["acme", "globex"] {
        let dsn = relay_dsn(&relay, org);
        let stop = stop.clone();
        load.push(tokio::spawn(async move {
            let (mut ok, mut failed) = (0u32, 0u32);
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                match connect(&dsn).await {
                    Ok(c) => {
                        for _ in 0..20 {
                            match c.simple_query("SELECT count(*) FROM items").await {
                                Ok(_) => ok += 1,
                                Err(_) => {
                                    failed += 1;
                                    break;
                                }
                            }
                        }
                    }
                    Err(_) => {
                        failed += 1;
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                }
            }
            (ok, failed)
        }));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;

    let mut old = relay;
    let stopping = Instant::now();
    old.sigterm();
    let status = tokio::task::block_in_place(|| old.wait_exit(Duration::from_secs(10)));
    assert!(
        status.is_some_and(|s| s.success()),
        "{status:?}\n{}",
        old.output()
    );
    // The drain is bounded by drain_timeout (5 s).
    assert!(stopping.elapsed() < Duration::from_secs(7));
    assert!(old.output().contains("relay draining"), "{}", old.output());

    let section = relay_section(
        &certs,
        &[&acme, &globex],
        json!({ "agents": ports.agents.to_string(), "postgres": ports.postgres.to_string() }),
    );
    let new = Proxy::builder(json!({ "relay": section }))
        .relay_only()
        .start()
        .unwrap();
    // Time from the listening line until both organizations answer again.
    let listening = Instant::now();
    for org in ["acme", "globex"] {
        wait_reachable(&relay_dsn(&new, org), Duration::from_secs(5)).await;
    }
    let back = listening.elapsed();
    assert!(back < Duration::from_secs(1), "agents back after {back:?}");

    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for l in load {
        let (ok, _failed) = l.await.unwrap();
        assert!(ok > 0);
    }
}

/// A link cut by the latency link: the agent notices by its pings and reconnects
/// once the link is restored; new streams work.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_link_is_noticed_and_the_agent_reconnects() {
    let certs = Certs::new().unwrap();
    let acme = Org::start("acme").unwrap();
    let relay = start_relay(&certs, &[&acme], json!({}), &[]).unwrap();
    let link = link_to(&relay, Duration::from_millis(2)).unwrap();
    let agent = start_agent(&certs, &acme, link.addr(), &[]).unwrap();
    let dsn = relay_dsn(&relay, "acme");
    wait_reachable(&dsn, Duration::from_secs(5)).await;

    link.cut();
    // Both ends notice through the keepalive (idle timeout 6 s).
    assert!(
        relay.wait_for_output("agent disconnected", Duration::from_secs(10)),
        "{}",
        relay.output()
    );
    let e = connect(&dsn).await.unwrap_err();
    assert!(format!("{e:?}").contains("has no agent"), "{e:?}");
    link.restore();
    let took = wait_reachable(&dsn, Duration::from_secs(15)).await;
    assert!(took < Duration::from_secs(15));
    assert!(agent.count_output("lokadb-agent connected to") >= 1);
}

/// With a 64 KiB window, a client that stops reading a large result holds only its
/// own stream: another stream on the same tunnel keeps working. The relay's counters
/// show the stalled stream holding a full window and never more: the agent never sent
/// beyond it (a violation would be counted and the stream reset).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_reader_does_not_stall_other_streams() {
    let certs = Certs::new().unwrap();
    let acme = Org::start("acme").unwrap();
    let env = [("LOKADB_MUX_WINDOW_KB", "64")];
    let relay = start_relay(&certs, &[&acme], json!({}), &env).unwrap();
    let _agent = start_agent_env(&certs, &acme, addrs(&relay).agents, &[], &env).unwrap();

    // A raw client through the relay that asks for ~50 MB and never reads.
    acme.trust_raw_role().unwrap();
    let dsn = relay_dsn(&relay, "acme");
    let stalled = raw_query_then_stall(
        addrs(&relay).postgres,
        "acme/orgdb",
        "SELECT repeat('x', 1000) FROM generate_series(1, 50000)",
    )
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;

    // Another stream on the same tunnel is unaffected.
    let c = connect(&dsn).await.unwrap();
    for _ in 0..20 {
        let started = Instant::now();
        let n: i64 = items(&c).await;
        assert_eq!(n, 1000);
        assert!(started.elapsed() < Duration::from_secs(1));
    }
    let stats = relay_stats(&relay).await;
    assert_eq!(stats["max_stream_buffered"], 64 * 1024, "{stats:?}");
    assert_eq!(stats["flow_violations"], 0, "{stats:?}");
    // The stalled stream and `c`; the admin session is not a stream.
    assert_eq!(stats["streams_open"], 2, "{stats:?}");
    drop(stalled);
}

/// One backend message: its tag and body.
async fn read_message(s: &mut tokio::net::TcpStream) -> (u8, Vec<u8>) {
    let tag = s.read_u8().await.unwrap();
    let len = s.read_u32().await.unwrap() as usize;
    let mut body = vec![0u8; len - 4];
    s.read_exact(&mut body).await.unwrap();
    (tag, body)
}

/// Logs in as `raw` (trusted), sends `sql`, and returns the socket unread.
async fn raw_query_then_stall(
    addr: std::net::SocketAddr,
    database: &str,
    sql: &str,
) -> tokio::net::TcpStream {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut startup = Vec::new();
    lokadb_shared::wire::startup::encode_startup(
        &[("user", "raw"), ("database", database)],
        &mut startup,
    );
    s.write_all(&startup).await.unwrap();
    // Read up to ReadyForQuery.
    loop {
        let (tag, body) = read_message(&mut s).await;
        assert_ne!(tag, b'E', "{}", String::from_utf8_lossy(&body));
        if tag == b'Z' {
            break;
        }
    }
    let mut q = Vec::new();
    lokadb_shared::wire::frontend::query(&mut q, sql);
    s.write_all(&q).await.unwrap();
    s
}

/// The relay inside `lokadb proxy` (the default deployment): agents and relay clients
/// next to application clients, and one SIGTERM stops both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relay_runs_inside_the_proxy() {
    let certs = Certs::new().unwrap();
    let acme = Org::start("acme").unwrap();
    let mut world = crate::world::World::start(
        json!({ "relay": relay_section(&certs, &[&acme], json!({})) }),
        &[],
    )
    .unwrap();
    let ports = addrs(&world.proxy);
    let _agent = start_agent(&certs, &acme, ports.agents, &[]).unwrap();
    let org = connect(&relay_dsn(&world.proxy, "acme")).await.unwrap();
    let app = world.client().await.unwrap();
    let n: i64 = items(&org).await;
    assert_eq!(n, 1000);
    app.simple_query("SELECT 1").await.unwrap();
    let stats = relay_stats(&world.proxy).await;
    assert_eq!(stats["organizations_connected"], 1, "{stats:?}");
    drop((org, app));
    world.proxy.sigterm();
    let status = tokio::task::block_in_place(|| world.proxy.wait_exit(Duration::from_secs(10)));
    assert!(
        status.is_some_and(|s| s.success()),
        "{}",
        world.proxy.output()
    );
    assert!(world.proxy.output().contains("relay stopped"));
}

/// An agent with two `--relay`s keeps a tunnel to each: with one relay gone, the
/// organization is still reachable through the other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_with_two_relays_survives_one() {
    let certs = Certs::new().unwrap();
    let acme = Org::start("acme").unwrap();
    let mut first = start_relay(&certs, &[&acme], json!({}), &[]).unwrap();
    let second = start_relay(&certs, &[&acme], json!({}), &[]).unwrap();
    let agent = lokadb_tests::agent::Agent::start(
        &[addrs(&first).agents, addrs(&second).agents],
        &acme.token,
        acme.db.addr(),
        &certs.files.ca,
        &[],
        &[],
    )
    .unwrap();
    for relay in [&first, &second] {
        wait_reachable(&relay_dsn(relay, "acme"), Duration::from_secs(10)).await;
    }
    first.sigterm();
    tokio::task::block_in_place(|| first.wait_exit(Duration::from_secs(10))).unwrap();
    let c = connect(&relay_dsn(&second, "acme")).await.unwrap();
    let n: i64 = items(&c).await;
    assert_eq!(n, 1000);
    assert!(agent.output().contains("connected to"));
}

/// With a 1 MiB tunnel memory cap and 512 KiB windows, three clients that stop reading
/// cannot make the relay hold more than the cap: the one holding the most is shed (its
/// connection closes), and another client on the same tunnel keeps working.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tunnel_memory_cap_sheds_the_slowest_reader() {
    let certs = Certs::new().unwrap();
    let acme = Org::start("acme").unwrap();
    acme.trust_raw_role().unwrap();
    let env = [
        ("LOKADB_MUX_WINDOW_KB", "512"),
        ("LOKADB_MUX_TUNNEL_MEMORY_MB", "1"),
    ];
    let relay = start_relay(&certs, &[&acme], json!({}), &env).unwrap();
    let _agent = start_agent(&certs, &acme, addrs(&relay).agents, &[]).unwrap();
    let mut stalled = Vec::new();
    for _ in 0..3 {
        stalled.push(
            raw_query_then_stall(
                addrs(&relay).postgres,
                "acme/orgdb",
                "SELECT repeat('x', 1000) FROM generate_series(1, 50000)",
            )
            .await,
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let c = connect(&relay_dsn(&relay, "acme")).await.unwrap();
    let n: i64 = items(&c).await;
    assert_eq!(n, 1000);
    let stats = relay_stats(&relay).await;
    assert!(stats["streams_shed"] >= 1, "{stats:?}");
    assert!(stats["max_stream_buffered"] <= 512 * 1024, "{stats:?}");
    drop(stalled);
}

/// With auto-tuning on, a stream over a 20 ms link grows its window beyond the 64 KiB
/// base and moves data faster than 64 KiB per round trip.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_tuning_grows_a_window_on_a_long_link() {
    let certs = Certs::new().unwrap();
    let acme = Org::start("acme").unwrap();
    let env = [("LOKADB_MUX_WINDOW_KB", "64"), ("LOKADB_MUX_AUTO", "1")];
    let relay = start_relay(&certs, &[&acme], json!({}), &env).unwrap();
    let link = link_to(&relay, Duration::from_millis(10)).unwrap();
    let _agent = start_agent_env(&certs, &acme, link.addr(), &[], &env).unwrap();
    let c = connect(&relay_dsn(&relay, "acme")).await.unwrap();
    // Let a keepalive measure the RTT first (pings every 2 s).
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let started = Instant::now();
    let rows = c
        .query(
            "SELECT repeat('x', 10000) FROM generate_series(1, 2000)",
            &[],
        )
        .await
        .unwrap();
    let took = started.elapsed();
    assert_eq!(rows.len(), 2000);
    // 20 MB at the fixed 64 KiB per 20 ms would take over 6 s.
    let mb_per_s = 20.0 / took.as_secs_f64();
    let stats = relay_stats(&relay).await;
    assert!(stats["window_growths"] > 0, "{stats:?}");
    assert!(
        mb_per_s > 3.2 * 1.5,
        "{mb_per_s:.1} MB/s in {took:?}; {stats:?}"
    );
}

/// A client that stops reading a large result while its agent dies: the relay ends its
/// stream at once (no stream left counted, nothing of the dead tunnel kept), instead of
/// waiting for the client to read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_client_of_a_dead_agent_is_let_go() {
    let certs = Certs::new().unwrap();
    let acme = Org::start("acme").unwrap();
    acme.trust_raw_role().unwrap();
    let relay = start_relay(&certs, &[&acme], json!({}), &[]).unwrap();
    let mut agent = start_agent(&certs, &acme, addrs(&relay).agents, &[]).unwrap();
    let _stalled = raw_query_then_stall(
        addrs(&relay).postgres,
        "acme/orgdb",
        "SELECT repeat('x', 1000) FROM generate_series(1, 50000)",
    )
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(relay_stats(&relay).await["streams_open"], 1);
    agent.kill();
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let stats = relay_stats(&relay).await;
        if stats["streams_open"] == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "{stats:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A second agent of the same organization is held as a standby (SHOW TUNNELS says
/// so) and takes over at once when the live one dies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_agent_is_a_standby_and_takes_over() {
    let certs = Certs::new().unwrap();
    let acme = Org::start("acme").unwrap();
    let relay = start_relay(&certs, &[&acme], json!({}), &[]).unwrap();
    let mut first = start_agent(&certs, &acme, addrs(&relay).agents, &[]).unwrap();
    let _second = start_agent(&certs, &acme, addrs(&relay).agents, &[]).unwrap();
    let dsn = format!(
        "host=127.0.0.1 port={} user=ops dbname=lokadb_relay",
        addrs(&relay).postgres.port()
    );
    let admin = connect(&dsn).await.unwrap();
    let roles: Vec<String> = admin
        .simple_query("SHOW TUNNELS")
        .await
        .unwrap()
        .into_iter()
        .filter_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => Some(r.get(3).unwrap().to_owned()),
            _ => None,
        })
        .collect();
    assert_eq!(roles.len(), 2, "{roles:?}");
    assert!(roles.contains(&"live".to_owned()) && roles.contains(&"standby".to_owned()));
    first.kill();
    assert!(
        relay.wait_for_output("standby agent is now live", Duration::from_secs(5)),
        "{}",
        relay.output()
    );
    let c = connect(&relay_dsn(&relay, "acme")).await.unwrap();
    assert_eq!(items(&c).await, 1000);
}

/// SIGHUP on `lokadb relay`: a token removed from `relay.tokens` cuts that organization's
/// tunnel and refuses its agent from then on, another organization is not disturbed, and
/// the token put back lets the agent in again; a bad file changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_revokes_a_token_and_keeps_the_others() {
    let TwoOrgs {
        certs: _certs,
        acme: _acme,
        globex: _globex,
        relay,
        _agents,
    } = TwoOrgs::start();
    let globex_dsn = relay_dsn(&relay, "globex");
    wait_reachable(&relay_dsn(&relay, "acme"), Duration::from_secs(30)).await;
    wait_reachable(&globex_dsn, Duration::from_secs(30)).await;
    let globex_client = connect(&globex_dsn).await.unwrap();

    let path = relay.config_path();
    let original = std::fs::read(&path).unwrap();
    let mut config: serde_json::Value = serde_json::from_slice(&original).unwrap();
    config["relay"]["tokens"]
        .as_object_mut()
        .unwrap()
        .remove("acme");
    std::fs::write(&path, serde_json::to_vec_pretty(&config).unwrap()).unwrap();
    relay.signal(libc::SIGHUP);
    assert!(
        relay.wait_for_output("its tunnel is cut", Duration::from_secs(30)),
        "{}",
        relay.output()
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    while relay_stats(&relay).await["organizations_connected"] != 1 {
        assert!(Instant::now() < deadline, "acme's tunnel is still up");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // acme's agent comes back and is refused; globex's session went on throughout.
    let deadline = Instant::now() + Duration::from_secs(30);
    while relay_stats(&relay).await["agents_refused"] == 0 {
        assert!(Instant::now() < deadline, "acme's agent was not refused");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(connect(&relay_dsn(&relay, "acme")).await.is_err());
    globex_client.simple_query("SELECT 1").await.unwrap();

    // A file that does not load changes nothing.
    std::fs::write(&path, b"{ \"relay\": ").unwrap();
    relay.signal(libc::SIGHUP);
    assert!(relay.wait_for_output("reload refused", Duration::from_secs(30)));

    std::fs::write(&path, &original).unwrap();
    relay.signal(libc::SIGHUP);
    wait_reachable(&relay_dsn(&relay, "acme"), Duration::from_secs(60)).await;
    globex_client.simple_query("SELECT 1").await.unwrap();
}

/// A new certificate for the relay (a new CA even), put in place and SIGHUP: tunnels up
/// keep running on the old one — acme's agent does not reconnect, its session goes on —
/// and an agent that connects next gets the new one (globex's, trusting only the new CA).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reloaded_certificate_keeps_the_tunnels_up() {
    let certs = Certs::new().unwrap();
    let acme = Org::start("acme").unwrap();
    let globex = Org::start("globex").unwrap();
    let relay = start_relay(&certs, &[&acme, &globex], json!({}), &[]).unwrap();
    let _acme_agent = start_agent(&certs, &acme, addrs(&relay).agents, &[]).unwrap();
    let acme_dsn = relay_dsn(&relay, "acme");
    wait_reachable(&acme_dsn, Duration::from_secs(30)).await;
    let session = connect(&acme_dsn).await.unwrap();
    assert_eq!(items(&session).await, 1000);

    let ca = lokadb_tests::certs::TestCa::new("LokaDB rotated CA").unwrap();
    let (cert, key) = ca.issue("relay", &["localhost", "127.0.0.1"]).unwrap();
    std::fs::write(&certs.files.cert, cert).unwrap();
    std::fs::write(&certs.files.key, key).unwrap();
    let rotated = certs.files.ca.with_file_name("rotated-ca.crt");
    std::fs::write(&rotated, ca.pem()).unwrap();
    relay.signal(libc::SIGHUP);
    assert!(
        relay.wait_for_output("tokens and certificate reloaded", Duration::from_secs(30)),
        "{}",
        relay.output()
    );

    // The next agent sees the new certificate: one trusting only the new CA connects.
    let _globex_agent = lokadb_tests::agent::Agent::start(
        &[addrs(&relay).agents],
        &globex.token,
        globex.db.addr(),
        &rotated,
        &[],
        &[],
    )
    .unwrap();
    wait_reachable(&relay_dsn(&relay, "globex"), Duration::from_secs(30)).await;
    // acme's tunnel never dropped: its session works and its agent connected once.
    assert_eq!(items(&session).await, 1000);
    assert_eq!(
        relay.output().matches("agent connected").count(),
        2,
        "{}",
        relay.output()
    );
}

/// A backend that ends (terminated, as at a fast shutdown: FATAL 57P01, then the end of
/// its connection) is seen ended by its client through the relay: the client reads the
/// FATAL and then the end of file. libpq (psql, postgres_fdw, psycopg) waits for that end
/// after a FATAL; a relay that dropped its half-close while the FATAL's bytes were still
/// being sent left such clients waiting for ever. A raw client, to see the end of file
/// itself; each round a fresh connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_terminated_backend_ends_its_client_through_the_relay() {
    let certs = Certs::new().unwrap();
    let acme = Org::start("acme").unwrap();
    acme.trust_raw_role().unwrap();
    let relay = start_relay(&certs, &[&acme], json!({}), &[]).unwrap();
    let _agent = start_agent(&certs, &acme, addrs(&relay).agents, &[]).unwrap();
    for round in 0..20 {
        let mut s = raw_query_then_stall(addrs(&relay).postgres, "acme/orgdb", "SELECT 1").await;
        // The answer, up to ReadyForQuery.
        while read_message(&mut s).await.0 != b'Z' {}
        acme.db
            .psql(
                "postgres",
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = 'raw'",
            )
            .unwrap();
        // FATAL, then the end of file: a few milliseconds expected.
        let mut rest = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut rest)).await;
        assert!(
            read.is_ok(),
            "round {round}: no end of file within 10 s after {:?}",
            String::from_utf8_lossy(&rest)
        );
        assert_eq!(rest.first(), Some(&b'E'), "round {round}: {rest:?}");
        assert!(
            String::from_utf8_lossy(&rest).contains("57P01"),
            "round {round}: {:?}",
            String::from_utf8_lossy(&rest)
        );
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while relay_stats(&relay).await["streams_open"] != 0 {
        assert!(Instant::now() < deadline, "streams left open at the relay");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
