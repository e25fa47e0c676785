//! Protocol features through the proxy, with tokio-postgres.

use crate::world::{sqlstate, World};
use futures_util::{SinkExt, StreamExt};
use serde_json::json;
use std::time::{Duration, Instant};
use tokio_postgres::AsyncMessage;

#[tokio::test]
async fn simple_query_with_several_statements() {
    let w = World::start(json!({}), &[]).unwrap();
    let c = w.client().await.unwrap();
    let msgs = c
        .simple_query("SELECT 1 AS a; SELECT 'two' AS b, 3 AS c")
        .await
        .unwrap();
    let rows: Vec<_> = msgs
        .iter()
        .filter_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => Some(r.get(0).unwrap().to_owned()),
            _ => None,
        })
        .collect();
    assert_eq!(rows, vec!["1", "two"]);
    let e = c
        .simple_query("SELECT 1; SELECT 1/0; SELECT 3")
        .await
        .unwrap_err();
    assert_eq!(sqlstate(&e), "22012");
    // The session goes on after an error.
    let r = c
        .query_one("SELECT current_user::text, current_database()::text", &[])
        .await
        .unwrap();
    assert_eq!(
        (r.get::<_, String>(0), r.get::<_, String>(1)),
        ("app".into(), "app".into())
    );
}

#[tokio::test]
async fn pipelined_extended_queries() {
    let w = World::start(json!({}), &[]).unwrap();
    let c = w.client().await.unwrap();
    let stmt = c.prepare("SELECT $1::int * 2").await.unwrap();
    // tokio-postgres sends all of these before reading any response: one pipeline of
    // Bind/Execute/Sync groups.
    let futures = (0..200).map(|i| {
        let c = &c;
        let stmt = &stmt;
        async move { c.query_one(stmt, &[&i]).await.map(|r| r.get::<_, i32>(0)) }
    });
    let results = futures_util::future::join_all(futures).await;
    let values: Vec<i32> = results.into_iter().map(Result::unwrap).collect();
    assert_eq!(values, (0..200).map(|i| i * 2).collect::<Vec<_>>());
}

#[tokio::test]
async fn copy_in_and_out_with_row_counts() {
    let w = World::start(json!({}), &[]).unwrap();
    let c = w.client().await.unwrap();
    c.batch_execute("CREATE TABLE t (id int, name text)")
        .await
        .unwrap();
    let sink = c.copy_in("COPY t FROM STDIN").await.unwrap();
    futures_util::pin_mut!(sink);
    let mut data = String::new();
    for i in 0..10_000 {
        data.push_str(&format!("{i}\tname {i}\n"));
    }
    sink.send(bytes::Bytes::from(data.clone())).await.unwrap();
    let copied = sink.finish().await.unwrap();
    assert_eq!(copied, 10_000);

    let stream = c
        .copy_out("COPY (SELECT id, name FROM t ORDER BY id) TO STDOUT")
        .await
        .unwrap();
    futures_util::pin_mut!(stream);
    let mut out = Vec::new();
    while let Some(chunk) = stream.next().await {
        out.extend_from_slice(&chunk.unwrap());
    }
    assert_eq!(String::from_utf8(out).unwrap(), data);
}

#[tokio::test]
async fn cursors_in_a_transaction() {
    let w = World::start(json!({}), &[]).unwrap();
    let mut c = w.client().await.unwrap();
    let tx = c.transaction().await.unwrap();
    tx.batch_execute("DECLARE cur CURSOR FOR SELECT g FROM generate_series(1, 2500) g")
        .await
        .unwrap();
    let mut total = 0i64;
    loop {
        let rows = tx.query("FETCH 1000 FROM cur", &[]).await.unwrap();
        if rows.is_empty() {
            break;
        }
        total += rows.iter().map(|r| r.get::<_, i32>(0) as i64).sum::<i64>();
    }
    tx.commit().await.unwrap();
    assert_eq!(total, 2500 * 2501 / 2);
}

#[tokio::test]
async fn listen_notify_between_two_clients_while_idle() {
    let w = World::start(json!({}), &[]).unwrap();
    let (listener, mut conn) = tokio_postgres::connect(&w.dsn(), tokio_postgres::NoTls)
        .await
        .unwrap();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut messages = futures_util::stream::poll_fn(move |cx| conn.poll_message(cx));
        while let Some(Ok(m)) = messages.next().await {
            if let AsyncMessage::Notification(n) = m {
                let _ = tx.send((n.channel().to_owned(), n.payload().to_owned()));
            }
        }
    });
    listener.batch_execute("LISTEN jobs").await.unwrap();
    let notifier = w.client().await.unwrap();
    notifier
        .batch_execute("NOTIFY jobs, 'first'")
        .await
        .unwrap();
    notifier
        .execute("SELECT pg_notify('jobs', $1)", &[&"second"])
        .await
        .unwrap();
    // The listener sends nothing: the notifications arrive while it is idle.
    for expected in ["first", "second"] {
        let got = tokio::time::timeout(Duration::from_secs(5), rx.recv())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(got, ("jobs".to_owned(), expected.to_owned()));
    }
}

#[tokio::test]
async fn cancel_request_reaches_the_backend_and_the_session_survives() {
    // Two executors: a cancel request lands on either core (SO_REUSEPORT), so some of
    // these go through the cross-core forwarding.
    let w = World::start(json!({}), &[("LOKADB_CORES", "2")]).unwrap();
    for _ in 0..6 {
        let c = w.client().await.unwrap();
        let token = c.cancel_token();
        let started = Instant::now();
        let sleeper = tokio::spawn(async move {
            let r = c.simple_query("SELECT pg_sleep(30)").await;
            (c, r)
        });
        tokio::time::sleep(Duration::from_millis(300)).await;
        token.cancel_query(tokio_postgres::NoTls).await.unwrap();
        let (c, r) = sleeper.await.unwrap();
        assert_eq!(sqlstate(&r.unwrap_err()), "57014");
        assert!(started.elapsed() < Duration::from_secs(10));
        // Postgres signals the backend twice for one cancel (the process, then its process
        // group): on a loaded machine the second can land on the next statement. Once.
        let one = match c.query_one("SELECT 1", &[]).await {
            Err(e) if sqlstate(&e) == "57014" => c.query_one("SELECT 1", &[]).await,
            r => r,
        };
        assert_eq!(one.unwrap().get::<_, i32>(0), 1);
    }
}

#[tokio::test]
async fn a_wrong_cancel_key_cancels_nothing() {
    let w = World::start(json!({}), &[]).unwrap();
    let c = w.client().await.unwrap();
    // A CancelRequest with a made-up key, sent by hand.
    let mut s = tokio::net::TcpStream::connect(w.proxy.addr())
        .await
        .unwrap();
    let mut pkt = Vec::new();
    pkt.extend_from_slice(&16u32.to_be_bytes());
    pkt.extend_from_slice(&80_877_102u32.to_be_bytes());
    pkt.extend_from_slice(&1u32.to_be_bytes());
    pkt.extend_from_slice(&12345u32.to_be_bytes());
    tokio::io::AsyncWriteExt::write_all(&mut s, &pkt)
        .await
        .unwrap();
    let v: i32 = c
        .query_one("SELECT count(*)::int FROM pg_sleep(0.5)", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(v, 1);
}

#[tokio::test]
async fn a_50_mb_value_round_trip() {
    let w = World::start(json!({}), &[]).unwrap();
    let c = w.client().await.unwrap();
    let value: Vec<u8> = (0..50 * 1024 * 1024)
        .map(|i: u32| (i.wrapping_mul(2_654_435_761) >> 24) as u8)
        .collect();
    c.batch_execute("CREATE TABLE blobs (id int primary key, data bytea)")
        .await
        .unwrap();
    c.execute("INSERT INTO blobs VALUES (1, $1)", &[&value])
        .await
        .unwrap();
    let back: Vec<u8> = c
        .query_one("SELECT data FROM blobs WHERE id = 1", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(back.len(), value.len());
    assert!(back == value, "the value changed on the way");
    let md5: String = c
        .query_one("SELECT md5(data) FROM blobs", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(md5.len(), 32);
}

#[tokio::test]
async fn notices_and_errors_keep_their_fields() {
    let w = World::start(json!({}), &[]).unwrap();
    let c = w.client().await.unwrap();
    let e = c
        .query("SELECT * FROM no_such_table", &[])
        .await
        .unwrap_err();
    assert_eq!(sqlstate(&e), "42P01");
    let db = e.as_db_error().unwrap();
    assert!(db.message().contains("no_such_table"), "{}", db.message());
    assert!(db.position().is_some(), "the error position is forwarded");
}
