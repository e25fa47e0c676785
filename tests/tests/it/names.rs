//! Names resolve as the cloud resolves them: a temporary table or a search_path that gives a
//! LokaDB table's unqualified name another meaning sends the statement to the cloud as
//! written, on every cloud version (PostgreSQL 18 reports search_path; older ones do not).

use crate::direct::{client, direct_world, one_i64, org_ran, route_of};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_temporary_table_named_like_a_lokadb_table_is_the_sessions_own() {
    let (w, proxy) = direct_world(json!({}));
    let c = client(&proxy).await;
    let count = "SELECT count(*) FROM documents WHERE organization_id = 2";
    assert_eq!(one_i64(&c.simple_query(count).await.unwrap()), 100);
    assert_eq!(route_of(&proxy, "query", count), "\"direct\"");

    c.batch_execute(
        "CREATE TEMP TABLE documents (id bigint, organization_id bigint, title text);
         INSERT INTO documents VALUES (1, 2, 'temp')",
    )
    .await
    .unwrap();
    let count_again = "SELECT count(*) FROM documents WHERE organization_id = 2 AND true";
    assert_eq!(one_i64(&c.simple_query(count_again).await.unwrap()), 1);
    assert_eq!(route_of(&proxy, "query", count_again), "\"cloud\"");
    assert_eq!(org_ran(&w, count_again), 0);
    // The extended protocol, with the organization bound.
    let row = c
        .query_one(
            "SELECT count(*) FROM documents WHERE organization_id = $1",
            &[&2i64],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, i64>(0), 1);
    // An UPDATE changes the temporary table's row, not organization 2's.
    let update = "UPDATE documents SET title = 'changed' WHERE organization_id = 2";
    assert_eq!(c.execute(update, &[]).await.unwrap(), 1);
    assert_eq!(org_ran(&w, update), 0);
    let other = client(&proxy).await;
    let changed = "SELECT count(*) FROM documents WHERE organization_id = 2 AND title = 'changed'";
    assert_eq!(one_i64(&other.simple_query(changed).await.unwrap()), 0);
    // COPY of the temporary table is the cloud's to answer, not refused.
    let copied: Vec<_> =
        futures_util::StreamExt::collect(c.copy_out("COPY documents TO STDOUT").await.unwrap())
            .await;
    let text: Vec<u8> = copied
        .into_iter()
        .flat_map(|b| b.unwrap().to_vec())
        .collect();
    assert_eq!(String::from_utf8(text).unwrap(), "1\t2\tchanged\n");
    // The schema's own name still reaches the LokaDB table, and goes direct.
    let qualified = "SELECT count(*) FROM public.documents WHERE organization_id = 2";
    assert_eq!(one_i64(&c.simple_query(qualified).await.unwrap()), 100);
    assert_eq!(route_of(&proxy, "query", qualified), "\"direct\"");
    // Another session is not affected.
    let plain = "SELECT count(*) FROM documents WHERE organization_id = 2 AND 1 = 1";
    assert_eq!(one_i64(&other.simple_query(plain).await.unwrap()), 100);
    assert_eq!(route_of(&proxy, "query", plain), "\"direct\"");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_search_path_that_finds_another_table_first_is_followed() {
    let (w, proxy) = direct_world(json!({}));
    let c = client(&proxy).await;
    c.batch_execute(
        "CREATE SCHEMA s;
         CREATE TABLE s.documents (id bigint, organization_id bigint, title text);
         INSERT INTO s.documents VALUES (1, 2, 's'), (2, 2, 's')",
    )
    .await
    .unwrap();
    c.batch_execute("SET search_path = s, public")
        .await
        .unwrap();
    let count = "SELECT count(*) FROM documents WHERE organization_id = 2";
    assert_eq!(one_i64(&c.simple_query(count).await.unwrap()), 2);
    assert_eq!(org_ran(&w, count), 0);
    let update = "UPDATE documents SET title = 'mine' WHERE organization_id = 2";
    assert_eq!(c.execute(update, &[]).await.unwrap(), 2);
    assert_eq!(org_ran(&w, update), 0);
    // set_config too, and back to the default: organization 2's rows again.
    c.simple_query("SELECT set_config('search_path', 'public', false)")
        .await
        .unwrap();
    let again = "SELECT count(*) FROM documents WHERE organization_id = 2 AND true";
    assert_eq!(one_i64(&c.simple_query(again).await.unwrap()), 100);
    c.simple_query("SELECT set_config('search_path', 's', false)")
        .await
        .unwrap();
    let third = "SELECT count(*) FROM documents WHERE organization_id = 2 AND 1 = 1";
    assert_eq!(one_i64(&c.simple_query(third).await.unwrap()), 2);
    // A new session (its backend reset) starts with the default path again.
    drop(c);
    let fresh = client(&proxy).await;
    let fourth = "SELECT count(*) FROM documents WHERE organization_id = 2 AND 2 = 2";
    assert_eq!(one_i64(&fresh.simple_query(fourth).await.unwrap()), 100);
}
