//! What a client sees through the proxy is what the cloud would give it (issue 22, items 5
//! and 6): the proxy's own refusals read as Postgres errors, with the SQLSTATE, message and
//! hint the proxy meant and nothing of how it made a backend raise them; system columns
//! answer as at the cloud, not as in the organization's database. Organization 2 is moved
//! with fdw+direct.

use crate::direct::{client, direct_world, first_document, org_ran, route_of};
use crate::tunnel_world::ORG_DB;
use lokadb_shared::wire::frontend;
use lokadb_tests::raw::{fields, Raw};
use serde_json::json;

/// `e`'s ErrorResponse as the client got it: the proxy's error, and no trace of the DO
/// block that raised it (CONTEXT, source file, line, routine, the schema field it marks
/// it with).
#[track_caller]
fn assert_plain(e: &tokio_postgres::Error, code: &str, message: &str, hint: &str) {
    let db = e.as_db_error().unwrap_or_else(|| panic!("{e:?}"));
    assert_eq!(db.code().code(), code, "{db:?}");
    assert_eq!(db.message(), message, "{db:?}");
    assert_eq!(db.hint(), Some(hint), "{db:?}");
    assert_eq!(db.severity(), "ERROR", "{db:?}");
    assert_eq!(
        db.parsed_severity(),
        Some(tokio_postgres::error::Severity::Error)
    );
    assert_eq!(db.detail(), None, "{db:?}");
    assert_eq!(db.where_(), None, "{db:?}");
    assert_eq!(db.file(), None, "{db:?}");
    assert_eq!(db.line(), None, "{db:?}");
    assert_eq!(db.routine(), None, "{db:?}");
    assert_eq!(db.schema(), None, "{db:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxys_refusals_carry_its_error_and_nothing_of_how_it_was_made() {
    let (w, proxy) = direct_world(json!({}));

    // A session limited to organization 2, which names organization 1: refused as a simple
    // Query, and as a prepared statement (its Parse replaced, raising at each Execute).
    let c = client(&proxy).await;
    c.batch_execute("SET lokadb.org = 2").await.unwrap();
    let other = "SELECT count(*) FROM documents WHERE organization_id = 1";
    let message =
        "this statement is for organization 1, and the session's organization (lokadb.org) is 2";
    let hint = "Name the organization in the statement (its organization column = the session's organization), or RESET lokadb.org to work across organizations";
    let e = c.simple_query(other).await.unwrap_err();
    assert_plain(&e, "42501", message, hint);
    let prepared = c.prepare(other).await.unwrap();
    for _ in 0..2 {
        let e = c.query(&prepared, &[]).await.unwrap_err();
        assert_plain(&e, "42501", message, hint);
    }
    // The client's own DO block keeps everything Postgres gives it.
    let e = c
        .batch_execute("DO $$BEGIN RAISE EXCEPTION USING ERRCODE = '42501', MESSAGE = 'mine', SCHEMA = 'lokadb_refusal_0'; END$$")
        .await
        .unwrap_err();
    let db = e.as_db_error().unwrap();
    assert_eq!(db.message(), "mine");
    assert_eq!(db.schema(), Some("lokadb_refusal_0"));
    assert_eq!(db.routine(), Some("exec_stmt_raise"), "{db:?}");
    assert!(
        db.where_().is_some_and(|w| w.contains("PL/pgSQL")),
        "{db:?}"
    );

    // A batch that began directly in organization 2's database and then asks for the cloud
    // (no Sync between): the organization's database raises the refusal at the second
    // statement's Execute. Every field the client gets, in order.
    let mut raw = Raw::connect(proxy.port()).await;
    let direct = "SELECT count(*) FROM documents WHERE organization_id = 2";
    let mut out = Vec::new();
    for sql in [direct, "SELECT count(*) FROM projects"] {
        frontend::parse(&mut out, "", sql);
        frontend::bind_text(&mut out, "", &[]);
        frontend::execute(&mut out);
    }
    frontend::sync(&mut out);
    raw.send(&out).await;
    let mut errors = Vec::new();
    loop {
        match raw.message().await {
            (b'E', body) => errors.push(fields(&body)),
            (b'Z', _) => break,
            _ => {}
        }
    }
    let field = |code: u8, v: &str| (code, v.to_owned());
    assert_eq!(
        errors,
        [vec![
            field(b'S', "ERROR"),
            field(b'V', "ERROR"),
            field(b'C', "0A000"),
            field(b'M', "this pipeline mixes a statement that ran directly in organization 2's database with one for the cloud before a Sync"),
            field(b'H', "Send a Sync between them (end the batch), or run them in a transaction"),
        ]],
        "{}",
        proxy.output()
    );
    assert_eq!(org_ran(&w, direct), 1, "the batch began directly");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn system_columns_answer_as_the_cloud_would() {
    let (w, proxy) = direct_world(json!({}));
    let c = client(&proxy).await;
    let cloud = crate::world::connect(&w.cloud.superuser_dsn("app"))
        .await
        .unwrap();
    let id = first_document(&cloud, 2).await;
    let text = |rows: &[tokio_postgres::Row]| -> Vec<String> {
        rows.iter().map(|r| r.get::<_, String>(0)).collect()
    };

    // The organization's database names its own table: the direct path would answer that.
    let named = format!(
        "SELECT tableoid::regclass::text FROM documents WHERE organization_id = 2 AND id = {id}"
    );
    let at_cloud = text(&cloud.query(&named, &[]).await.unwrap());
    let in_org = w.org.db.psql(ORG_DB, &named).unwrap();
    assert_ne!(at_cloud, [in_org.trim()], "the two databases differ");
    let ran = org_ran(&w, &named);

    // Simple and extended protocol, qualified or not, in the select list or the WHERE.
    let got = text(&c.query(&named, &[]).await.unwrap());
    assert_eq!(got, at_cloud);
    assert_eq!(org_ran(&w, &named), ran);
    let bound = "SELECT d.tableoid::regclass::text FROM documents d WHERE d.organization_id = $1 AND d.id = $2";
    assert_eq!(
        text(&c.query(bound, &[&2i64, &id]).await.unwrap()),
        at_cloud
    );
    assert_eq!(org_ran(&w, bound), 0);
    let simple = format!("SELECT count(*) FROM documents WHERE organization_id = 2 AND ctid IS NOT NULL AND id = {id}");
    c.simple_query(&simple).await.unwrap();
    assert_eq!(route_of(&proxy, "query", "ctid IS NOT NULL"), "\"cloud\"");
    assert_eq!(org_ran(&w, &simple), 0);

    // A plain UPDATE with RETURNING tableoid goes through the cloud too.
    let update = format!("UPDATE documents SET title = title WHERE organization_id = 2 AND id = {id} RETURNING tableoid::regclass::text");
    assert_eq!(text(&c.query(&update, &[]).await.unwrap()), at_cloud);
    assert_eq!(org_ran(&w, &update), 0, "{}", proxy.output());

    // Without a system column the same read goes direct (the world has the direct path).
    let plain = format!("SELECT title FROM documents WHERE organization_id = 2 AND id = {id}");
    c.query(&plain, &[]).await.unwrap();
    assert_eq!(org_ran(&w, &plain), 1, "{}", proxy.output());
}
