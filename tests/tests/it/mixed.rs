//! Transactions that write in an organization's database directly and then need the cloud
//! (an INSERT, a constrained column, a cloud table): they move to the cloud whole — the
//! direct transaction rolled back, what it ran so far run again on the cloud, where its
//! answers must be the ones the client already has, else 40001 (`docs/routing.md`,
//! "Transactions that need both").

use crate::direct::{client, direct_world, one_i64, org_ran, rows};
use crate::moves::World;
use lokadb_tests::proxy::Proxy;
use serde_json::json;
use std::time::{Duration, Instant};

/// The cloud's answer to `sql` (one value).
fn cloud(w: &World, sql: &str) -> String {
    w.cloud.psql("app", sql).unwrap()
}

/// A document version of organization 2, and its document.
async fn a_version(c: &tokio_postgres::Client) -> (i64, i64) {
    let r = c
        .query_one(
            "SELECT id, document_id FROM document_versions WHERE organization_id = 2 ORDER BY id LIMIT 1",
            &[],
        )
        .await
        .unwrap();
    (r.get(0), r.get(1))
}

/// How many transactions the proxy moved to the cloud (`differed`: of those whose answers
/// differed there).
fn moved(proxy: &Proxy, differed: bool) -> usize {
    proxy
        .output()
        .lines()
        .filter(|l| l.contains("lokadb::route") && l.contains("route=\"moved\""))
        .filter(|l| l.contains("differed=true") == differed)
        .count()
}

/// Update-then-insert, the most common write transaction there is (an audit row, a version
/// row), and a statement on a constrained column after a direct write: through the proxy
/// they commit as at the cloud, each write once, in both protocols; ROLLBACK undoes both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_that_wrote_directly_moves_to_the_cloud_when_it_needs_it() {
    let (w, proxy) = direct_world(json!({}));
    let c = client(&proxy).await;
    // Asked on another session: tokio-postgres closes a statement it drops without waiting,
    // and a BEGIN that finds the cloud busy starts the transaction there.
    let (id, doc) = a_version(&client(&proxy).await).await;
    let body = |v: &str| {
        format!("UPDATE document_versions SET body = '{v}' WHERE organization_id = 2 AND id = {id}")
    };
    let count_audit = |tag: &str| {
        cloud(
            &w,
            &format!("SELECT count(*) FROM document_versions WHERE organization_id = 2 AND body = '{tag}'"),
        )
    };

    // Simple protocol: the UPDATE runs direct, the INSERT needs the cloud.
    let update = body("moved 1");
    c.batch_execute("BEGIN").await.unwrap();
    c.batch_execute(&update).await.unwrap();
    let inserted = c
        .simple_query(&format!(
            "INSERT INTO document_versions (organization_id, document_id, body) VALUES (2, {doc}, 'audit 1') RETURNING id"
        ))
        .await
        .unwrap();
    assert_eq!(rows(&inserted).len(), 1, "{}", proxy.output());
    // The transaction goes on on the cloud: it sees its own writes.
    let read =
        format!("SELECT body FROM document_versions WHERE organization_id = 2 AND id = {id}");
    assert_eq!(rows(&c.simple_query(&read).await.unwrap()), ["moved 1"]);
    assert_ne!(
        cloud(
            &w,
            &format!("SELECT body FROM document_versions WHERE id = {id}")
        ),
        "moved 1",
        "not committed yet"
    );
    c.batch_execute("COMMIT").await.unwrap();
    assert_eq!(
        cloud(
            &w,
            &format!("SELECT body FROM document_versions WHERE id = {id}")
        ),
        "moved 1"
    );
    assert_eq!(count_audit("audit 1"), "1");
    assert_eq!(
        org_ran(&w, &update),
        1,
        "it ran direct first\n{}",
        proxy.output()
    );
    assert_eq!(moved(&proxy, false), 1, "{}", proxy.output());

    // Extended protocol (named statements, binary parameters): statements prepared
    // before the transaction (a Parse inside it before any statement starts it on the
    // cloud), bound in it.
    let mut c2 = client(&proxy).await;
    let update = c2
        .prepare("UPDATE document_versions SET body = $1 WHERE organization_id = $2 AND id = $3")
        .await
        .unwrap();
    let insert = c2
        .prepare("INSERT INTO document_versions (organization_id, document_id, body) VALUES ($1, $2, $3) RETURNING id")
        .await
        .unwrap();
    let select = c2
        .prepare("SELECT body FROM document_versions WHERE organization_id = $1 AND id = $2")
        .await
        .unwrap();
    let tx = c2.transaction().await.unwrap();
    let n = tx
        .execute(&update, &[&"moved 2", &2i64, &id])
        .await
        .unwrap();
    assert_eq!(n, 1);
    let seen: String = tx.query_one(&select, &[&2i64, &id]).await.unwrap().get(0);
    assert_eq!(seen, "moved 2", "read in the organization's database");
    let new_id: i64 = tx
        .query_one(&insert, &[&2i64, &doc, &"audit 2"])
        .await
        .unwrap()
        .get(0);
    let seen: String = tx.query_one(&select, &[&2i64, &id]).await.unwrap().get(0);
    assert_eq!(seen, "moved 2", "read on the cloud");
    tx.commit().await.unwrap();
    assert_eq!(
        cloud(
            &w,
            &format!("SELECT body FROM document_versions WHERE id = {id}")
        ),
        "moved 2"
    );
    assert_eq!(
        cloud(
            &w,
            &format!("SELECT body FROM document_versions WHERE id = {new_id}")
        ),
        "audit 2"
    );
    assert_eq!(count_audit("audit 2"), "1");
    assert_eq!(moved(&proxy, false), 2, "{}", proxy.output());

    // A constrained column (a foreign key the cloud checks) after a direct write.
    c.batch_execute("BEGIN").await.unwrap();
    c.batch_execute(&body("moved 3")).await.unwrap();
    c.batch_execute(
        "UPDATE documents SET project_id = 20 WHERE organization_id = 2 AND id IN (SELECT min(id) FROM documents WHERE organization_id = 2)",
    )
    .await
    .unwrap();
    c.batch_execute("COMMIT").await.unwrap();
    assert_eq!(
        cloud(
            &w,
            &format!("SELECT body FROM document_versions WHERE id = {id}")
        ),
        "moved 3"
    );

    // A read of a cloud table after a direct write, and a savepoint rolled back to: the
    // replay runs both, in order.
    c.batch_execute("BEGIN").await.unwrap();
    c.batch_execute(&body("moved 4")).await.unwrap();
    c.batch_execute("SAVEPOINT a").await.unwrap();
    c.batch_execute(&body("undone")).await.unwrap();
    c.batch_execute("ROLLBACK TO SAVEPOINT a").await.unwrap();
    let projects = one_i64(
        &c.simple_query("SELECT count(*) FROM projects")
            .await
            .unwrap(),
    );
    assert!(projects > 0);
    assert_eq!(rows(&c.simple_query(&read).await.unwrap()), ["moved 4"]);
    c.batch_execute("COMMIT").await.unwrap();
    assert_eq!(
        cloud(
            &w,
            &format!("SELECT body FROM document_versions WHERE id = {id}")
        ),
        "moved 4"
    );
    assert_eq!(moved(&proxy, false), 4, "{}", proxy.output());

    // ROLLBACK after the move undoes both writes.
    c.batch_execute("BEGIN").await.unwrap();
    c.batch_execute(&body("rolled back")).await.unwrap();
    c.batch_execute(&format!(
        "INSERT INTO document_versions (organization_id, document_id, body) VALUES (2, {doc}, 'audit 4')"
    ))
    .await
    .unwrap();
    c.batch_execute("ROLLBACK").await.unwrap();
    assert_eq!(
        cloud(
            &w,
            &format!("SELECT body FROM document_versions WHERE id = {id}")
        ),
        "moved 4"
    );
    assert_eq!(count_audit("audit 4"), "0");

    // The session goes on as before: a direct read, an autocommit direct write.
    let r = c.simple_query(&read).await.unwrap();
    assert_eq!(rows(&r), ["moved 4"]);
    assert_eq!(moved(&proxy, true), 0);

    // The same transaction again: its opener moved a moment ago, so it starts on the cloud
    // (no direct round trips, no rollback), on this core and on a session of its own.
    let opener = body("learned");
    for (i, session) in [&c, &client(&proxy).await].into_iter().enumerate() {
        let tag = format!("learned {i}");
        let moves = moved(&proxy, false);
        session.batch_execute("BEGIN").await.unwrap();
        session.batch_execute(&opener).await.unwrap();
        session
            .batch_execute(&format!(
                "INSERT INTO document_versions (organization_id, document_id, body) VALUES (2, {doc}, '{tag}')"
            ))
            .await
            .unwrap();
        session.batch_execute("COMMIT").await.unwrap();
        assert_eq!(count_audit(&tag), "1");
        if i == 0 {
            assert_eq!(moved(&proxy, false), moves + 1, "the first moves");
        } else {
            // Another session may be on the other core, which has not learned it.
            assert!(moved(&proxy, false) <= moves + 1);
        }
    }
    let moves = moved(&proxy, false);
    c.batch_execute("BEGIN").await.unwrap();
    c.batch_execute(&opener).await.unwrap();
    c.batch_execute(&format!(
        "INSERT INTO document_versions (organization_id, document_id, body) VALUES (2, {doc}, 'learned')"
    ))
    .await
    .unwrap();
    c.batch_execute("COMMIT").await.unwrap();
    assert_eq!(
        moved(&proxy, false),
        moves,
        "it started on the cloud\n{}",
        proxy.output()
    );
    assert!(org_ran(&w, &opener) <= 2, "{}", w.org.db.log_contents());
}

/// What the transaction read directly changed before it moved: the cloud answers
/// differently, and the transaction fails with 40001 (which clients retry) — never goes
/// on with a silent difference. Nothing of it stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_moved_transaction_that_answers_differently_fails_with_40001() {
    let (w, proxy) = direct_world(json!({}));
    let c = client(&proxy).await;
    let other = client(&proxy).await;
    let ids: Vec<i64> = c
        .query(
            "SELECT id FROM document_versions WHERE organization_id = 2 ORDER BY id LIMIT 2",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let (a, b) = (ids[0], ids[1]);
    let set = |id: i64, v: &str| {
        format!("UPDATE document_versions SET body = '{v}' WHERE organization_id = 2 AND id = {id}")
    };
    let read_b =
        format!("SELECT body FROM document_versions WHERE organization_id = 2 AND id = {b}");
    other.batch_execute(&set(b, "before")).await.unwrap();

    c.batch_execute("BEGIN").await.unwrap();
    c.batch_execute(&set(a, "written")).await.unwrap();
    assert_eq!(rows(&c.simple_query(&read_b).await.unwrap()), ["before"]);
    // Another session changes what it read, and commits.
    other.batch_execute(&set(b, "after")).await.unwrap();
    let e = c
        .batch_execute(
            "UPDATE documents SET project_id = 20 WHERE organization_id = 2 AND id IN (SELECT min(id) FROM documents WHERE organization_id = 2)",
        )
        .await
        .unwrap_err();
    assert_eq!(
        crate::world::sqlstate(&e),
        "40001",
        "{e:?}\n{}",
        proxy.output()
    );
    let e = c.simple_query("SELECT 1").await.unwrap_err();
    assert_eq!(crate::world::sqlstate(&e), "25P02", "{e:?}");
    c.batch_execute("ROLLBACK").await.unwrap();
    assert_ne!(
        cloud(
            &w,
            &format!("SELECT body FROM document_versions WHERE id = {a}")
        ),
        "written"
    );
    assert_eq!(moved(&proxy, true), 1, "{}", proxy.output());

    // The session is usable, and a retry goes through.
    c.batch_execute("BEGIN").await.unwrap();
    c.batch_execute(&set(a, "written")).await.unwrap();
    assert_eq!(rows(&c.simple_query(&read_b).await.unwrap()), ["after"]);
    c.batch_execute(
        "UPDATE documents SET project_id = 20 WHERE organization_id = 2 AND id IN (SELECT min(id) FROM documents WHERE organization_id = 2)",
    )
    .await
    .unwrap();
    c.batch_execute("COMMIT").await.unwrap();
    assert_eq!(
        cloud(
            &w,
            &format!("SELECT body FROM document_versions WHERE id = {a}")
        ),
        "written"
    );
    let n = one_i64(
        &c.simple_query("SELECT count(*) FROM document_versions WHERE organization_id = 2")
            .await
            .unwrap(),
    );
    assert!(n > 0);
}

/// The proxy dies at each step of a move (the direct transaction rolled back; the replay
/// sent; its answers matched): the client's connection fails, nothing of the transaction
/// is committed anywhere, no transaction is left open, and a new proxy runs it whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proxy_that_dies_while_moving_a_transaction_leaves_nothing_behind() {
    let (w, proxy) = direct_world(json!({}));
    let (id, doc) = a_version(&client(&proxy).await).await;
    let body = |v: &str| {
        format!("UPDATE document_versions SET body = '{v}' WHERE organization_id = 2 AND id = {id}")
    };
    let insert = |v: &str| {
        format!(
            "INSERT INTO document_versions (organization_id, document_id, body) VALUES (2, {doc}, '{v}')"
        )
    };
    let before = cloud(
        &w,
        &format!("SELECT body FROM document_versions WHERE id = {id}"),
    );
    for point in ["replay-rolled-back", "replay-sent", "replay-matched"] {
        let mut dying =
            crate::direct::direct_proxy(&w, json!({}), &[("LOKADB_PROXY_FAILPOINT", point)]);
        let c = client(&dying).await;
        c.batch_execute("BEGIN").await.unwrap();
        c.batch_execute(&body(point)).await.unwrap();
        let e = c.batch_execute(&insert(point)).await.unwrap_err();
        assert!(e.is_closed() || e.as_db_error().is_none(), "{point}: {e:?}");
        assert!(
            dying.wait_exit(Duration::from_secs(10)).is_some(),
            "{point}: {}",
            dying.output()
        );
        assert!(
            dying.output().contains(&format!("failpoint {point}")),
            "{}",
            dying.output()
        );
        // The organization's database and the cloud roll back what the proxy held open.
        let open = "SELECT count(*) FROM pg_stat_activity WHERE state LIKE 'idle in transaction%'";
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let org = w.org.db.psql(crate::tunnel_world::ORG_DB, open).unwrap();
            let cl = cloud(&w, open);
            if org == "0" && cl == "0" {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{point}: open transactions: org {org}, cloud {cl}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        assert_eq!(
            cloud(
                &w,
                &format!("SELECT body FROM document_versions WHERE id = {id}")
            ),
            before,
            "{point}"
        );
        assert_eq!(
            cloud(
                &w,
                &format!("SELECT count(*) FROM document_versions WHERE body = '{point}'")
            ),
            "0",
            "{point}"
        );
    }
    // The same transaction through a live proxy commits once.
    let c = client(&proxy).await;
    c.batch_execute("BEGIN").await.unwrap();
    c.batch_execute(&body("survived")).await.unwrap();
    c.batch_execute(&insert("survived")).await.unwrap();
    c.batch_execute("COMMIT").await.unwrap();
    assert_eq!(
        cloud(
            &w,
            "SELECT count(*) FROM document_versions WHERE body = 'survived'"
        ),
        "2"
    );
}

/// An unnamed statement for the cloud inside a direct transaction, sent as most drivers send
/// one (Parse, Bind, Execute, Sync in one batch: tokio-postgres's `query_typed`): the
/// transaction moves to the cloud, after a direct read as after a direct write, and the
/// statement answers as at the cloud. Its Parse, sent direct, used to begin a batch there
/// that its own Bind for the cloud was refused in (0A000, "this pipeline mixes …"; found by
/// the differential suite).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unnamed_statement_for_the_cloud_in_a_direct_transaction_moves_it() {
    use tokio_postgres::types::Type;
    let (w, proxy) = direct_world(json!({}));
    let c = client(&proxy).await;
    let (v2, _) = a_version(&client(&proxy).await).await;
    let v1: i64 = cloud(
        &w,
        "SELECT min(id) FROM document_versions WHERE organization_id = 1",
    )
    .trim()
    .parse()
    .unwrap();
    let read2 =
        format!("SELECT body FROM document_versions WHERE organization_id = 2 AND id = {v2}");

    // After a direct read: organization 1 written in the text, then bound as a parameter.
    c.batch_execute("BEGIN").await.unwrap();
    assert_eq!(rows(&c.simple_query(&read2).await.unwrap()).len(), 1);
    assert_eq!(org_ran(&w, &read2), 1, "read directly");
    let literal = format!(
        "UPDATE document_versions SET body = 'unnamed 1' WHERE organization_id = 1 AND id = {v1} RETURNING id"
    );
    let got = c.query_typed(&literal, &[]).await.unwrap();
    assert_eq!(got.len(), 1, "{}", proxy.output());
    let bound = "SELECT body FROM document_versions WHERE organization_id = $1 AND id = $2";
    let got = c
        .query_typed(bound, &[(&1i64, Type::INT8), (&v1, Type::INT8)])
        .await
        .unwrap();
    assert_eq!(got[0].get::<_, String>(0), "unnamed 1");
    c.batch_execute("COMMIT").await.unwrap();
    assert_eq!(
        cloud(
            &w,
            &format!("SELECT body FROM document_versions WHERE id = {v1}")
        )
        .trim(),
        "unnamed 1"
    );

    // After a direct write: the transaction moves whole, and commits once.
    let write2 = format!(
        "UPDATE document_versions SET body = 'unnamed 2' WHERE organization_id = 2 AND id = {v2}"
    );
    let moves = moved(&proxy, false);
    c.batch_execute("BEGIN").await.unwrap();
    c.batch_execute(&write2).await.unwrap();
    assert_eq!(org_ran(&w, &write2), 1, "written directly");
    let got = c
        .query_typed(
            "UPDATE document_versions SET body = $1 WHERE organization_id = $2 AND id = $3",
            &[
                (&"unnamed 3", Type::TEXT),
                (&1i64, Type::INT8),
                (&v1, Type::INT8),
            ],
        )
        .await
        .unwrap();
    assert!(got.is_empty());
    c.batch_execute("COMMIT").await.unwrap();
    assert_eq!(moved(&proxy, false), moves + 1, "{}", proxy.output());
    assert_eq!(
        cloud(
            &w,
            &format!("SELECT body FROM document_versions WHERE id = {v2}")
        )
        .trim(),
        "unnamed 2"
    );
    assert_eq!(
        cloud(
            &w,
            &format!("SELECT body FROM document_versions WHERE id = {v1}")
        )
        .trim(),
        "unnamed 3"
    );
    assert!(
        !proxy.output().contains("this pipeline mixes"),
        "{}",
        proxy.output()
    );
}
