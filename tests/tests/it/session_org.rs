//! `SET lokadb.org`: a session limited to one organization. Organization 2 is moved with
//! fdw+direct (its statements may run in its database), organization 1 stays in the cloud.
//! Every statement on LokaDB tables sees and changes that organization's rows only, whichever
//! path it takes; what the proxy cannot limit is refused, and never runs.

use crate::direct::{client, direct_world, first_document, one_i64, org_ran, route_of};
use serde_json::json;

fn state(e: &tokio_postgres::Error) -> String {
    e.code().map(|c| c.code().to_owned()).unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_limited_to_its_organization_sees_and_changes_only_its_rows() {
    let (w, proxy) = direct_world(json!({}));
    let c = client(&proxy).await;
    let other = client(&proxy).await;
    let cloud = crate::world::connect(&w.cloud.superuser_dsn("app"))
        .await
        .unwrap();
    let count = |sql: &'static str| {
        let cloud = &cloud;
        async move { cloud.query_one(sql, &[]).await.unwrap().get::<_, i64>(0) }
    };
    let total = count("SELECT count(*) FROM documents").await;
    let of_2 = count("SELECT count(*) FROM documents WHERE organization_id = 2").await;
    let of_1 = count("SELECT count(*) FROM documents WHERE organization_id = 1").await;
    assert!(of_1 > 0 && of_2 > 0 && total == of_1 + of_2);
    let (id1, id2) = (
        first_document(&cloud, 1).await,
        first_document(&cloud, 2).await,
    );

    // Organization 2: a count without any condition is its rows', answered by its database
    // (which runs the client's text as written); the cloud knows the setting too.
    c.batch_execute("SET lokadb.org = 2").await.unwrap();
    let all = "SELECT count(*) FROM documents";
    let ran = org_ran(&w, all);
    assert_eq!(one_i64(&c.simple_query(all).await.unwrap()), of_2);
    assert_eq!(
        org_ran(&w, all),
        ran + 1,
        "organization 2's database ran it"
    );
    assert_eq!(route_of(&proxy, "query", "current_setting"), "\"direct\"");
    let shown = c.query_one("SHOW lokadb.org", &[]).await.unwrap();
    assert_eq!(shown.get::<_, &str>(0), "2");
    // The extended protocol, a lookup by key: organization 1's row is not this session's.
    let get = "SELECT id, organization_id FROM documents WHERE id = $1";
    assert!(c.query(get, &[&id1]).await.unwrap().is_empty());
    let row = c.query_one(get, &[&id2]).await.unwrap();
    assert_eq!(row.get::<_, i64>(1), 2);
    // A join with a cloud table, and a subquery.
    let joined = c
        .query_one(
            "SELECT count(*) FROM documents d JOIN organizations o ON o.id = d.organization_id \
             WHERE d.id IN (SELECT document_id FROM document_versions)",
            &[],
        )
        .await
        .unwrap()
        .get::<_, i64>(0);
    let expected = count(
        "SELECT count(*) FROM documents d WHERE organization_id = 2 \
         AND d.id IN (SELECT document_id FROM document_versions WHERE organization_id = 2)",
    )
    .await;
    assert_eq!(joined, expected);
    // An UPDATE without a WHERE changes this organization's rows only.
    let changed = c
        .execute("UPDATE documents SET title = title || ' limited'", &[])
        .await
        .unwrap();
    assert_eq!(changed, u64::try_from(of_2).unwrap());
    assert_eq!(
        count(
            "SELECT count(*) FROM documents WHERE title LIKE '% limited' AND organization_id = 1"
        )
        .await,
        0
    );
    // Another session is not limited.
    assert_eq!(one_i64(&other.simple_query(all).await.unwrap()), total);

    // Another organization named, or bound, is refused; so is what cannot be limited. None
    // of them ran: the counts stay.
    let refused = [
        (
            "SELECT count(*) FROM documents WHERE organization_id = 1",
            "42501",
        ),
        (
            "INSERT INTO documents (organization_id, project_id, title) VALUES (1, 10, 'x')",
            "42501",
        ),
        ("TRUNCATE documents", "0A000"),
        ("TABLE documents", "0A000"),
        ("SELECT set_config('lokadb.org', '1', false)", "0A000"),
        ("SET LOCAL lokadb.org = 1", "0A000"),
    ];
    for (sql, code) in refused {
        let e = c.simple_query(sql).await.unwrap_err();
        assert_eq!(state(&e), code, "{sql}: {e:?}");
    }
    let insert =
        "INSERT INTO documents (organization_id, project_id, title) VALUES ($1, $2, 'bound')";
    let e = c.execute(insert, &[&1i64, &10i64]).await.unwrap_err();
    assert_eq!(state(&e), "42501", "{e:?}");
    assert_eq!(c.execute(insert, &[&2i64, &20i64]).await.unwrap(), 1);
    // Inside a transaction the setting cannot change; the transaction goes on.
    c.batch_execute("BEGIN").await.unwrap();
    let e = c.batch_execute("SET lokadb.org = 1").await.unwrap_err();
    assert_eq!(state(&e), "0A000");
    c.batch_execute("ROLLBACK").await.unwrap();
    assert_eq!(
        c.query_one("SHOW lokadb.org", &[])
            .await
            .unwrap()
            .get::<_, &str>(0),
        "2"
    );
    assert_eq!(count("SELECT count(*) FROM documents").await, total + 1);

    // Organization 1, in the cloud: a statement prepared under organization 2 follows the
    // session; one prepared before any setting is refused once one is set, and the reverse.
    let counted = c.prepare(all).await.unwrap();
    // (tokio-postgres closes a dropped statement without waiting: the SET waits for it.)
    c.batch_execute("SET lokadb.org TO '1'").await.unwrap();
    assert_eq!(
        c.query_one(&counted, &[]).await.unwrap().get::<_, i64>(0),
        of_1
    );
    assert!(c.query(get, &[&id2]).await.unwrap().is_empty());
    c.batch_execute("RESET lokadb.org").await.unwrap();
    let e = c.query_one(&counted, &[]).await.unwrap_err();
    assert_eq!(state(&e), "42501", "{e:?}");
    let unlimited = c.prepare(all).await.unwrap();
    assert_eq!(
        c.query_one(&unlimited, &[]).await.unwrap().get::<_, i64>(0),
        total + 1
    );
    c.batch_execute("SET lokadb.org = 2").await.unwrap();
    let e = c.query_one(&unlimited, &[]).await.unwrap_err();
    assert_eq!(state(&e), "42501", "{e:?}");
    // RESET ALL ends it too.
    c.batch_execute("RESET ALL").await.unwrap();
    assert_eq!(one_i64(&c.simple_query(all).await.unwrap()), total + 1);
}

/// Without the direct path configured (every statement through the cloud), the setting is
/// followed and statements limited the same; a SET sent while a dropped statement's Close is
/// still unanswered waits for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_direct_path_the_session_is_limited_all_the_same() {
    let w = crate::moves::world_at(0, false, None);
    crate::world::create_auth_role(&w.cloud).unwrap();
    let proxy = crate::world::start_proxy(&w.cloud, json!({}), &[]).unwrap();
    assert!(proxy.wait_for_output("metadata loaded", std::time::Duration::from_secs(10)));
    let c = client(&proxy).await;
    let cloud = crate::world::connect(&w.cloud.superuser_dsn("app"))
        .await
        .unwrap();
    let of = |org: i64| {
        let cloud = &cloud;
        async move {
            cloud
                .query_one(
                    "SELECT count(*) FROM documents WHERE organization_id = $1",
                    &[&org],
                )
                .await
                .unwrap()
                .get::<_, i64>(0)
        }
    };
    let all = "SELECT count(*) FROM documents";
    for org in [1i64, 2] {
        // The statement is dropped at once: its Close is in flight when the SET is sent.
        drop(c.prepare(all).await.unwrap());
        c.batch_execute(&format!("SET lokadb.org = {org}"))
            .await
            .unwrap();
        assert_eq!(one_i64(&c.simple_query(all).await.unwrap()), of(org).await);
    }
    let changed = c
        .execute("UPDATE documents SET title = title || ' two'", &[])
        .await
        .unwrap();
    assert_eq!(changed, u64::try_from(of(2).await).unwrap());
    let e = c
        .simple_query("DELETE FROM documents WHERE organization_id = 1")
        .await
        .unwrap_err();
    assert_eq!(state(&e), "42501", "{e:?}");
    assert!(of(1).await > 0);
}

/// `PGOPTIONS='-c lokadb.org=2'` (the startup packet's `options`): the session is limited
/// from its first statement, as after `SET lokadb.org = 2`, and `RESET` returns to it (the
/// cloud's backend holds it as its default).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_startup_options_limit_the_session_from_its_start() {
    let w = crate::moves::world_at(0, false, None);
    crate::world::create_auth_role(&w.cloud).unwrap();
    let proxy = crate::world::start_proxy(&w.cloud, json!({}), &[]).unwrap();
    assert!(proxy.wait_for_output("metadata loaded", std::time::Duration::from_secs(10)));
    let connect = |options: &str| {
        let dsn = format!(
            "host=127.0.0.1 port={} user={} password={} dbname=app options='{options}'",
            proxy.port(),
            lokadb_tests::pg::SUPERUSER,
            lokadb_tests::pg::SUPERUSER_PASSWORD
        );
        async move { crate::world::connect(&dsn).await.unwrap() }
    };
    let cloud = crate::world::connect(&w.cloud.superuser_dsn("app"))
        .await
        .unwrap();
    let count = |sql: String| {
        let cloud = &cloud;
        async move { cloud.query_one(&sql, &[]).await.unwrap().get::<_, i64>(0) }
    };
    let all = "SELECT count(*) FROM documents";
    let total = count(all.to_owned()).await;
    let of = |org: i64| count(format!("{all} WHERE organization_id = {org}"));
    let (of_1, of_2) = (of(1).await, of(2).await);
    assert!(of_1 > 0 && of_2 > 0 && of_1 + of_2 == total);

    let c = connect("-c lokadb.org=2").await;
    assert_eq!(one_i64(&c.simple_query(all).await.unwrap()), of_2);
    let counted = c.query_one(all, &[]).await.unwrap().get::<_, i64>(0);
    assert_eq!(counted, of_2, "the extended protocol");
    let e = c
        .simple_query("DELETE FROM documents WHERE organization_id = 1")
        .await
        .unwrap_err();
    assert_eq!(state(&e), "42501", "{e:?}");
    // SET moves it; RESET and RESET ALL come back to the startup value, as in the cloud.
    c.batch_execute("SET lokadb.org = 1").await.unwrap();
    assert_eq!(one_i64(&c.simple_query(all).await.unwrap()), of_1);
    c.batch_execute("RESET lokadb.org").await.unwrap();
    assert_eq!(one_i64(&c.simple_query(all).await.unwrap()), of_2);
    let shown = c.query_one("SHOW lokadb.org", &[]).await.unwrap();
    assert_eq!(shown.get::<_, &str>(0), "2");
    c.batch_execute("SET lokadb.org = ''").await.unwrap();
    assert_eq!(one_i64(&c.simple_query(all).await.unwrap()), total);
    c.batch_execute("RESET ALL").await.unwrap();
    assert_eq!(one_i64(&c.simple_query(all).await.unwrap()), of_2);
    c.batch_execute("SET lokadb.org TO DEFAULT").await.unwrap();
    assert_eq!(one_i64(&c.simple_query(all).await.unwrap()), of_2);
    drop(c);

    // The other spellings the server reads, the last one winning; other settings alongside.
    let c = connect(r"-c search_path=public --lokadb.org=2 -clokadb.org=1").await;
    assert_eq!(one_i64(&c.simple_query(all).await.unwrap()), of_1);
    // A session without it is not limited, on a backend of its own (the pool key holds the
    // options).
    let plain = connect("-c search_path=public").await;
    assert_eq!(one_i64(&plain.simple_query(all).await.unwrap()), total);
    let shown = plain
        .query_one("SELECT current_setting('lokadb.org', true)", &[])
        .await
        .unwrap();
    assert_eq!(shown.get::<_, Option<&str>>(0).unwrap_or(""), "");

    // A role whose default the cloud sets (`ALTER ROLE … SET lokadb.org`): limited the same.
    cloud
        .batch_execute(
            "CREATE ROLE limited LOGIN PASSWORD 'limited-secret'; \
             GRANT SELECT ON documents TO limited; \
             ALTER ROLE limited SET lokadb.org = '1'",
        )
        .await
        .unwrap();
    let limited = crate::world::connect(&format!(
        "host=127.0.0.1 port={} user=limited password=limited-secret dbname=app",
        proxy.port()
    ))
    .await
    .unwrap();
    assert_eq!(one_i64(&limited.simple_query(all).await.unwrap()), of_1);
    limited.batch_execute("SET lokadb.org = 2").await.unwrap();
    assert_eq!(one_i64(&limited.simple_query(all).await.unwrap()), of_2);
    limited.batch_execute("RESET lokadb.org").await.unwrap();
    assert_eq!(one_i64(&limited.simple_query(all).await.unwrap()), of_1);
}
