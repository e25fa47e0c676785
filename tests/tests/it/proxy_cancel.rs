//! The session's identity is its cloud backend's: the process ID in BackendKeyData is the one
//! `pg_backend_pid()` and notifications give, and a CancelRequest with the session's key
//! (received on any core) cancels its statement wherever it runs — the cloud or an
//! organization's database — while a wrong secret, or a key of an ended session, cancels
//! nothing.

use crate::world::{World, APP_PASSWORD, APP_USER};
use lokadb_tests::raw::{be32, field, first_column, Raw};
use serde_json::json;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A client that speaks the protocol by hand, to see its BackendKeyData (drivers keep it
/// to themselves).
struct Session {
    raw: Raw,
    /// BackendKeyData: process ID and secret.
    key: (u32, u32),
}

/// What one simple Query got back.
#[derive(Debug, Default, PartialEq)]
struct Answer {
    /// The first column of each row, as text.
    rows: Vec<String>,
    /// The SQLSTATE of an ErrorResponse.
    error: Option<String>,
    /// The process ID of each NotificationResponse.
    notified: Vec<u32>,
}

impl Session {
    /// Logs in through the proxy at `port` (SCRAM), up to the first ReadyForQuery.
    async fn login(port: u16, user: &str, password: &str) -> Session {
        let raw = Raw::login(port, user, password, &[]).await;
        let [body] = raw.key_data.as_slice() else {
            panic!("one BackendKeyData: {:?}", raw.key_data);
        };
        assert_eq!(body.len(), 8, "a 4-byte secret (protocol 3.0)");
        let key = (be32(&body[..4]), be32(&body[4..]));
        Session { raw, key }
    }

    /// Sends a simple Query without waiting for its answer.
    async fn start(&mut self, sql: &str) {
        let mut out = bytes::BytesMut::new();
        postgres_protocol::message::frontend::query(sql, &mut out).unwrap();
        self.raw.send(&out).await;
    }

    /// Reads the answer of a Query, up to its ReadyForQuery.
    async fn answer(&mut self) -> Answer {
        let mut a = Answer::default();
        loop {
            let (tag, body) = self.raw.message().await;
            match tag {
                b'D' => a.rows.push(first_column(&body)),
                b'E' => a.error = Some(field(&body, b'C').unwrap_or_default()),
                b'A' => a.notified.push(be32(&body[..4])),
                b'Z' => return a,
                _ => {}
            }
        }
    }

    async fn run(&mut self, sql: &str) -> Answer {
        self.start(sql).await;
        self.answer().await
    }

    /// The first column of the one row `sql` answers.
    async fn one(&mut self, sql: &str) -> String {
        let a = self.run(sql).await;
        assert_eq!(a.error, None, "{sql}");
        assert_eq!(a.rows.len(), 1, "{sql}");
        a.rows.into_iter().next().unwrap()
    }
}

/// Sends a CancelRequest to `port` and waits until the proxy has handled it (it closes the
/// connection then).
async fn cancel(port: u16, pid: u32, secret: u32) {
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    let mut pkt = Vec::with_capacity(16);
    pkt.extend_from_slice(&16u32.to_be_bytes());
    pkt.extend_from_slice(&80_877_102u32.to_be_bytes());
    pkt.extend_from_slice(&pid.to_be_bytes());
    pkt.extend_from_slice(&secret.to_be_bytes());
    s.write_all(&pkt).await.unwrap();
    let mut rest = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut rest))
        .await
        .expect("the proxy closes a cancel connection")
        .unwrap();
    assert!(rest.is_empty(), "a cancel gets no reply: {rest:?}");
}

/// Waits until backend `pid` of `db` waits on `event` (a statement is running there).
async fn wait_for(db: &tokio_postgres::Client, pid: u32, event: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let row = db
            .query_opt(
                "SELECT wait_event FROM pg_stat_activity WHERE pid = $1",
                &[&(pid as i32)],
            )
            .await
            .unwrap();
        if row.and_then(|r| r.get::<_, Option<String>>(0)).as_deref() == Some(event) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "backend {pid} never waited on {event}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The one value `sql` answers right after a cancel. Postgres signals a cancelled backend
/// twice (the process, then its process group): on a loaded machine the second can land on
/// the next statement, so that one is run once more if it got it.
async fn after_cancel(s: &mut Session, sql: &str) -> String {
    let mut a = s.run(sql).await;
    if a.error.as_deref() == Some("57014") {
        a = s.run(sql).await;
    }
    assert_eq!(a.error, None, "{sql}");
    assert_eq!(a.rows.len(), 1, "{sql}");
    a.rows.remove(0)
}

#[tokio::test]
async fn backend_key_data_and_notifications_carry_the_cloud_backends_pid() {
    let w = World::start(json!({}), &[]).unwrap();
    let mut s = Session::login(w.proxy.port(), APP_USER, APP_PASSWORD).await;
    let pid = s.one("SELECT pg_backend_pid()").await;
    assert_eq!(pid, s.key.0.to_string());
    // The cloud knows the session by that pid.
    let cloud = w.cloud.superuser_client().await.unwrap();
    let user: String = cloud
        .query_one(
            "SELECT usename::text FROM pg_stat_activity WHERE pid = $1",
            &[&(s.key.0 as i32)],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(user, APP_USER);
    // A notification of the session's own says it came from the session.
    let a = s.run("LISTEN own; NOTIFY own, 'hi'").await;
    assert_eq!(a.error, None);
    assert_eq!(a.notified, vec![s.key.0]);
}

/// How many lines of the proxy's output contain `needle`.
fn lines_with(w: &World, needle: &str) -> usize {
    w.proxy
        .output()
        .lines()
        .filter(|l| l.contains(needle))
        .count()
}

/// Waits until `n` lines of the proxy's output contain `needle` (the output is read by
/// other threads, a moment after it is written).
async fn wait_lines(w: &World, needle: &str, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while lines_with(w, needle) < n {
        assert!(Instant::now() < deadline, "{}", w.proxy.output());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn a_cancel_with_the_key_cancels_on_whichever_core_it_lands() {
    // Two executors: a CancelRequest lands on either (SO_REUSEPORT), and the process ID no
    // longer says which one holds the session. Sessions and cancels are repeated until
    // both cases were seen: the cancel on the session's core, and on the other one.
    let w = World::start(
        json!({}),
        &[
            ("LOKADB_CORES", "2"),
            ("LOKADB_LOG", "info,lokadb::cancel=debug"),
        ],
    )
    .unwrap();
    let port = w.proxy.port();
    let cloud = w.cloud.superuser_client().await.unwrap();
    let (mut tries, mut local, mut forwarded) = (0, 0, 0);
    while (local == 0 || forwarded == 0) && tries < 40 {
        tries += 1;
        let mut s = Session::login(port, APP_USER, APP_PASSWORD).await;
        s.start("SELECT pg_sleep(60)").await;
        wait_for(&cloud, s.key.0, "PgSleep").await;
        cancel(port, s.key.0, s.key.1).await;
        let a = tokio::time::timeout(Duration::from_secs(30), s.answer())
            .await
            .expect("the cancel stops the sleep");
        assert_eq!(a.error.as_deref(), Some("57014"), "try {tries}");
        assert_eq!(after_cancel(&mut s, "SELECT 1").await, "1");
        // Each cancel was sent to the cloud once; by the core that received it, or by the
        // session's core after the other one forwarded it.
        wait_lines(&w, "cancel request sent", tries).await;
        assert_eq!(lines_with(&w, "cancel request sent"), tries);
        forwarded = lines_with(&w, "forwarded cancel request matched a session here");
        local = tries - forwarded;
    }
    assert!(
        local > 0 && forwarded > 0,
        "{tries} tries: {local} on the session's core, {forwarded} forwarded"
    );
    assert_eq!(
        lines_with(&w, "cancel request forwarded to the other cores"),
        forwarded
    );
}

#[tokio::test]
async fn a_wrong_secret_cancels_nothing() {
    let w = World::start(json!({}), &[("LOKADB_CORES", "2")]).unwrap();
    let port = w.proxy.port();
    let cloud = w.cloud.superuser_client().await.unwrap();
    let mut s = Session::login(port, APP_USER, APP_PASSWORD).await;
    let other = Session::login(port, APP_USER, APP_PASSWORD).await;
    let (pid, secret) = s.key;
    s.start("SELECT 'slept' FROM pg_sleep(3)").await;
    wait_for(&cloud, pid, "PgSleep").await;
    // Another secret; another session's secret with this pid; this secret with the other
    // session's pid; the backend's pid with a made-up secret of 0.
    for (p, k) in [
        (pid, secret ^ 1),
        (pid, other.key.1),
        (other.key.0, secret),
        (pid, 0),
    ] {
        if (p, k) != s.key {
            cancel(port, p, k).await;
        }
    }
    // Forwarded cancels are handled within milliseconds: a second later the sleep still runs.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let state: String = cloud
        .query_one(
            "SELECT state FROM pg_stat_activity WHERE pid = $1",
            &[&(pid as i32)],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(state, "active");
    let a = s.answer().await;
    assert_eq!(a.error, None);
    assert_eq!(a.rows, vec!["slept"]);
    // The right key does cancel.
    s.start("SELECT pg_sleep(60)").await;
    wait_for(&cloud, pid, "PgSleep").await;
    cancel(port, pid, secret).await;
    assert_eq!(s.answer().await.error.as_deref(), Some("57014"));
}

#[tokio::test]
async fn the_last_clients_key_cannot_cancel_the_next_client_of_a_pooled_backend() {
    // One executor, so both clients share one pool.
    let w = World::start(json!({}), &[("LOKADB_CORES", "1")]).unwrap();
    let port = w.proxy.port();
    let cloud = w.cloud.superuser_client().await.unwrap();
    let mut first = Session::login(port, APP_USER, APP_PASSWORD).await;
    let old = first.key;
    assert_eq!(
        first.one("SELECT pg_backend_pid()").await,
        old.0.to_string()
    );
    first.raw.send(&[b'X', 0, 0, 0, 4]).await;
    drop(first);
    // The backend is reset (DISCARD ALL, then its temporary schema checked) and pooled.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let row = cloud
            .query_opt(
                "SELECT 1 FROM pg_stat_activity WHERE pid = $1 AND state = 'idle' AND query LIKE '%pg_my_temp_schema%'",
                &[&(old.0 as i32)],
            )
            .await
            .unwrap();
        if row.is_some() {
            break;
        }
        assert!(Instant::now() < deadline, "the backend was not pooled");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The proxy puts it in its pool once it read the reset's answer.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut next = Session::login(port, APP_USER, APP_PASSWORD).await;
    assert_eq!(
        next.key.0, old.0,
        "the pooled backend serves the next client"
    );
    assert_ne!(next.key.1, old.1, "with a secret of its own");
    next.start("SELECT 'slept' FROM pg_sleep(3)").await;
    wait_for(&cloud, old.0, "PgSleep").await;
    cancel(port, old.0, old.1).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let a = next.answer().await;
    assert_eq!((a.error, a.rows), (None, vec!["slept".to_owned()]));
    next.start("SELECT pg_sleep(60)").await;
    wait_for(&cloud, old.0, "PgSleep").await;
    cancel(port, next.key.0, next.key.1).await;
    assert_eq!(next.answer().await.error.as_deref(), Some("57014"));
}

#[tokio::test]
async fn a_cancel_reaches_a_statement_in_the_organizations_database_then_the_cloud_again() {
    use crate::tunnel_world::ORG_DB;
    let (w, proxy) = crate::direct::direct_world(json!({}));
    let port = proxy.port();
    let user = lokadb_tests::pg::SUPERUSER;
    let mut s = Session::login(port, user, lokadb_tests::pg::SUPERUSER_PASSWORD).await;
    // The session's direct connection is opened by a first read (a connection starting
    // behind the lock below would wait for it before the read is even sent).
    let read = "SELECT count(*) FROM documents WHERE organization_id = 2";
    assert_eq!(s.one(read).await, "100");
    assert_eq!(crate::direct::route_of(&proxy, "query", read), "\"direct\"");
    // The read waits for a lock held in the organization's database.
    let org = w
        .org
        .db
        .client(user, lokadb_tests::pg::SUPERUSER_PASSWORD, ORG_DB)
        .await
        .unwrap();
    org.batch_execute("BEGIN; LOCK TABLE documents IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    s.start(read).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let waiting: i64 = org
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query = $1",
                &[&read],
            )
            .await
            .unwrap()
            .get(0);
        if waiting == 1 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the read never waited in the organization's database"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    cancel(port, s.key.0, s.key.1).await;
    let a = tokio::time::timeout(Duration::from_secs(30), s.answer())
        .await
        .expect("the cancel stops the read");
    assert_eq!(a.error.as_deref(), Some("57014"));
    org.batch_execute("ROLLBACK").await.unwrap();
    assert_eq!(after_cancel(&mut s, read).await, "100");

    // Back on the cloud, the same key cancels there; the pid is still the cloud backend's.
    assert_eq!(s.one("SELECT pg_backend_pid()").await, s.key.0.to_string());
    let cloud = w.cloud.superuser_client().await.unwrap();
    s.start("SELECT pg_sleep(60)").await;
    wait_for(&cloud, s.key.0, "PgSleep").await;
    cancel(port, s.key.0, s.key.1).await;
    assert_eq!(s.answer().await.error.as_deref(), Some("57014"));
    assert_eq!(after_cancel(&mut s, "SELECT 1").await, "1");
}

/// Several proxies in front of one cloud: a cancel that lands on another proxy than the one
/// holding the session is handed on to its `peers` and cancels the statement there; without
/// `peers` it cancels nothing; a wrong secret handed on cancels nothing either.
#[tokio::test]
async fn a_cancel_reaches_the_session_through_another_proxy() {
    let w = World::start(json!({}), &[]).unwrap();
    let cloud = w.cloud.superuser_client().await.unwrap();
    let holder = w.proxy.port();
    let with_peer = crate::world::start_proxy(
        &w.cloud,
        json!({ "peers": [format!("127.0.0.1:{holder}")] }),
        &[],
    )
    .unwrap();
    let alone = crate::world::start_proxy(&w.cloud, json!({}), &[]).unwrap();
    let mut s = Session::login(holder, APP_USER, APP_PASSWORD).await;
    let (pid, secret) = s.key;

    s.start("SELECT 'slept' FROM pg_sleep(3)").await;
    wait_for(&cloud, pid, "PgSleep").await;
    cancel(alone.port(), pid, secret).await;
    cancel(with_peer.port(), pid, secret ^ 1).await;
    let a = s.answer().await;
    assert_eq!(
        (a.error, a.rows),
        (None, vec!["slept".to_owned()]),
        "no peers, or a wrong secret: nothing cancelled"
    );

    s.start("SELECT pg_sleep(60)").await;
    wait_for(&cloud, pid, "PgSleep").await;
    cancel(with_peer.port(), pid, secret).await;
    let a = tokio::time::timeout(Duration::from_secs(30), s.answer())
        .await
        .expect("the statement was cancelled through the peer");
    assert_eq!(a.error.as_deref(), Some("57014"));
    // A proxy naming itself as a peer is refused at start.
    let me = "127.0.0.1:45999";
    let bad = lokadb_tests::proxy::Proxy::builder(crate::world::config(
        &w.cloud,
        json!({ "listen": me, "peers": [me] }),
    ))
    .start();
    let err = match bad {
        Ok(_) => panic!("a proxy naming itself as a peer started"),
        Err(e) => format!("{e:#}"),
    };
    assert!(err.contains("own \"listen\" address"), "{err}");
}
