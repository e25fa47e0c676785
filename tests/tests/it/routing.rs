//! Routing's groundwork through the proxy: the metadata watcher (a live session learns a
//! LokaDB table enabled after it connected), and the analysis of each statement as
//! `route_log` reports it — simple and extended protocol, a bound organization.

use crate::admin_cli::{lokadb, ok};
use crate::admin_enable::SCHEMA;
use crate::world::World;
use serde_json::json;
use std::time::Duration;

/// The `lokadb::route` lines of the proxy's output that mention `needle`.
fn route_lines(w: &World, needle: &str) -> Vec<String> {
    w.proxy
        .output()
        .lines()
        .filter(|l| l.contains("lokadb::route") && l.contains(needle))
        .map(str::to_owned)
        .collect()
}

/// The one `lokadb::route` line mentioning `needle`, waiting for it: the proxy's log reaches
/// the test through a pipe, possibly after the client has its answer.
#[track_caller]
fn one_line(w: &World, needle: &str) -> String {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while route_lines(w, needle).is_empty() && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    let lines = route_lines(w, needle);
    assert_eq!(lines.len(), 1, "{needle}: {lines:#?}\n{}", w.proxy.output());
    lines[0].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn route_log_places_statements_with_metadata_learned_live() {
    let w = World::start(json!({ "route_log": true }), &[]).unwrap();
    // The watcher comes up before the cloud has the LokaDB schema: generation 0.
    assert!(
        w.proxy
            .wait_for_output("generation=0 tables=0", Duration::from_secs(10)),
        "{}",
        w.proxy.output()
    );
    // A session opened before any LokaDB table exists.
    let client = w.client().await.unwrap();
    client
        .simple_query("SELECT 'before' FROM pg_class LIMIT 0")
        .await
        .unwrap();
    assert!(one_line(&w, "SELECT 'before'").contains("org=-"));

    enable_documents(&w);

    // The live session now routes by the new generation.
    let rows = client
        .simple_query("SELECT title FROM documents d WHERE d.organization_id = 2 AND d.id = 2")
        .await
        .unwrap();
    assert!(!rows.is_empty());
    let line = one_line(&w, "d.organization_id = 2 AND d.id = 2");
    assert!(line.contains("kind=\"query\""), "{line}");
    assert!(line.contains("org=2 "), "{line}");
    assert!(line.contains("tables=public.documents"), "{line}");

    // Extended protocol: the Parse is placed by $1, the Bind by its value (binary int8).
    let row = client
        .query_one(
            "SELECT count(*) FROM documents WHERE organization_id = $1 AND project_id = 20",
            &[&2i64],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, i64>(0), 100);
    let parse = one_line(&w, "AND project_id = 20");
    assert!(parse.contains("org=$1"), "{parse}");
    let bind = one_line(&w, "kind=\"bind\"");
    assert!(bind.contains("org=2 "), "{bind}");

    // Not placed: no organization condition, or an OR; and a statement on cloud tables only.
    client
        .simple_query("SELECT count(*) FROM documents WHERE organization_id = 1 OR id = 3")
        .await
        .unwrap();
    assert!(one_line(&w, "organization_id = 1 OR id = 3").contains("org=?"));
    client
        .simple_query("SELECT count(*) FROM projects")
        .await
        .unwrap();
    assert!(one_line(&w, "FROM projects").contains("org=-"));

    // A new session sees the same generation at once.
    let other = w.client().await.unwrap();
    other
        .simple_query("SELECT 1 FROM documents WHERE organization_id = '1' LIMIT 1")
        .await
        .unwrap();
    assert!(one_line(&w, "organization_id = '1' LIMIT 1").contains("org=1 "));
}

/// The cloud with the LokaDB schema, the test schema and `documents` enabled, owned so the
/// application role can use it; returns once the proxy's watcher has read it.
fn enable_documents(w: &World) {
    let dsn = w.cloud.superuser_dsn("app");
    ok(&lokadb(&dsn, &["init"]));
    w.cloud.psql("app", SCHEMA).unwrap();
    w.cloud
        .psql(
            "app",
            "GRANT ALL ON ALL TABLES IN SCHEMA public TO app; \
             GRANT ALL ON ALL SEQUENCES IN SCHEMA public TO app",
        )
        .unwrap();
    ok(&lokadb(&dsn, &["enable", "documents"]));
    assert!(
        w.proxy
            .wait_for_output("tables=1 organizations=0", Duration::from_secs(10)),
        "the NOTIFY of the enable reaches the watcher:\n{}",
        w.proxy.output()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_watcher_reconnects_and_catches_up_on_what_it_missed() {
    let w = World::start(json!({ "route_log": true }), &[]).unwrap();
    enable_documents(&w);
    // The watcher's connection dies; a change is made while it is away.
    let killed = w
        .cloud
        .psql(
            "app",
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
             WHERE application_name = 'lokadb meta'",
        )
        .unwrap();
    assert_eq!(killed.trim(), "1");
    // The reconnected watcher reads the change it was not told of.
    enable_versions(&w);
    assert!(w.proxy.output().contains("metadata watcher: cannot read"));
    let client = w.client().await.unwrap();
    client
        .simple_query("SELECT count(*) FROM document_versions WHERE organization_id = 1")
        .await
        .unwrap();
    assert!(
        one_line(&w, "FROM document_versions WHERE").contains("tables=public.document_versions")
    );
}

/// The auth role of docs/configuration.md ("The auth role"): not a superuser; verifiers
/// through a SECURITY DEFINER function, and the routing metadata through the grants the
/// docs list.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_auth_role_needs_the_documented_grants_to_read_the_metadata() {
    let cloud = lokadb_tests::pg::Cluster::builder()
        .setting("max_connections", "100")
        .start()
        .unwrap();
    cloud
        .create_role("app", crate::world::APP_PASSWORD)
        .unwrap();
    cloud.create_database("app", "app").unwrap();
    cloud
        .psql(
            "app",
            "CREATE ROLE meta_auth LOGIN PASSWORD 'meta-secret';
             CREATE SCHEMA lokadb_auth AUTHORIZATION postgres;
             CREATE FUNCTION lokadb_auth.user_verifier(role_name text) RETURNS text
             LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog AS $$
                 SELECT rolpassword FROM pg_catalog.pg_authid
                 WHERE rolname = role_name AND rolcanlogin AND NOT rolsuper
             $$;
             REVOKE ALL ON FUNCTION lokadb_auth.user_verifier(text) FROM PUBLIC;
             GRANT USAGE ON SCHEMA lokadb_auth TO meta_auth;
             GRANT EXECUTE ON FUNCTION lokadb_auth.user_verifier(text) TO meta_auth;",
        )
        .unwrap();
    let dsn = cloud.superuser_dsn("app");
    ok(&lokadb(&dsn, &["init"]));
    cloud.psql("app", SCHEMA).unwrap();
    cloud
        .psql("app", "GRANT ALL ON ALL TABLES IN SCHEMA public TO app")
        .unwrap();
    ok(&lokadb(&dsn, &["enable", "documents"]));
    let config = json!({
        "listen": "127.0.0.1:0",
        "route_log": true,
        "databases": { "app": {
            "cloud": format!("host=127.0.0.1 port={} dbname=app", cloud.port()),
            "auth_user": "meta_auth",
            "auth_password": "meta-secret",
            "auth_query": "SELECT lokadb_auth.user_verifier($1)",
        }}
    });
    let proxy = lokadb_tests::proxy::Proxy::start(&config).unwrap();
    assert!(
        proxy.wait_for_output(
            "permission denied for schema lokadb",
            Duration::from_secs(10)
        ),
        "{}",
        proxy.output()
    );
    // Clients are served all the same; statements just cannot be placed.
    let w = World { cloud, proxy };
    let client = w.client().await.unwrap();
    client
        .simple_query("SELECT count(*) FROM documents WHERE organization_id = 2")
        .await
        .unwrap();
    assert!(one_line(&w, "FROM documents WHERE organization_id = 2").contains("org=?"));
    w.cloud
        .psql(
            "app",
            "GRANT USAGE ON SCHEMA lokadb TO meta_auth;
             GRANT SELECT ON lokadb.meta, lokadb.tables, lokadb.org TO meta_auth;",
        )
        .unwrap();
    assert!(
        w.proxy
            .wait_for_output("tables=1 organizations=0", Duration::from_secs(30)),
        "the watcher's retry reads the metadata once granted:\n{}",
        w.proxy.output()
    );
    // The core applies it from its mailbox: at once, or a moment later on a busy machine.
    placed_soon(
        &w,
        &client,
        "SELECT count(*) FROM documents WHERE organization_id = 1",
        "org=1 ",
    )
    .await;
    // Nor do the watcher and the migration resolver need more than those grants: neither
    // logs a refusal once they are given (both retry within 5 s of one).
    let denied = || w.proxy.output().matches("permission denied").count();
    let before = denied();
    tokio::time::sleep(Duration::from_secs(12)).await;
    assert_eq!(
        denied(),
        before,
        "refused after the documented grants:\n{}",
        w.proxy.output()
    );
}

/// Runs `sql` (marked `/*soonN*/`) until its route line contains `want`, for up to 5 s: a
/// core applies a new generation from its mailbox as soon as it runs, which on a busy
/// machine may be a moment after the watcher logged it. Returns that line.
async fn placed_soon(w: &World, client: &tokio_postgres::Client, sql: &str, want: &str) -> String {
    static MARK: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let mark = format!(
            "soon{}",
            MARK.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        );
        client
            .simple_query(&format!("{sql} /*{mark}*/"))
            .await
            .unwrap();
        let line = marked_line(w, &mark);
        if line.contains(want) || std::time::Instant::now() > deadline {
            assert!(line.contains(want), "{line}");
            return line;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copy_of_a_whole_loka_table_out_is_refused_and_the_allowed_forms_work() {
    use futures_util::{SinkExt, StreamExt};
    // No route_log: the refusal does not depend on it.
    let w = World::start(json!({}), &[]).unwrap();
    enable_documents(&w);
    let client = w.client().await.unwrap();
    for sql in [
        "COPY documents TO STDOUT",
        "copy public.documents (id, title) to stdout with (format csv)",
    ] {
        let err = match client.copy_out(sql).await {
            Ok(_) => panic!("{sql}: refused"),
            Err(e) => e,
        };
        let db = err.as_db_error().expect("a Postgres error");
        assert_eq!(db.code().code(), "0A000", "{db:?}");
        assert_eq!(
            db.message(),
            "COPY of LokaDB table public.documents needs an organization: the table holds every organization's rows"
        );
        assert_eq!(
            db.hint(),
            Some("Copy one organization's rows: COPY (SELECT * FROM public.documents WHERE organization_id = '…') TO STDOUT")
        );
    }
    // The simple protocol (psql's \copy, a COPY in a multi-statement Query: the whole
    // message is refused).
    for sql in [
        "COPY documents TO STDOUT",
        "SELECT 1; COPY documents TO STDOUT",
    ] {
        let err = client.simple_query(sql).await.unwrap_err();
        let db = err.as_db_error().expect("a Postgres error");
        assert_eq!(db.code().code(), "0A000", "{sql}: {db:?}");
    }
    // The session goes on, also inside a transaction the refusal aborted.
    client.simple_query("BEGIN").await.unwrap();
    assert!(client.copy_out("COPY documents TO STDOUT").await.is_err());
    client.simple_query("ROLLBACK").await.unwrap();

    // One organization's rows, through a query.
    let stream = client
        .copy_out("COPY (SELECT id FROM documents WHERE organization_id = 2) TO STDOUT")
        .await
        .unwrap();
    let chunks: Vec<_> = stream.collect().await;
    let text: Vec<u8> = chunks
        .into_iter()
        .flat_map(|c| c.unwrap().to_vec())
        .collect();
    assert_eq!(text.iter().filter(|&&b| b == b'\n').count(), 100);

    // COPY FROM goes to the cloud, which puts each row in its organization's partition.
    let sink = client
        .copy_in("COPY documents (organization_id, title) FROM STDIN")
        .await
        .unwrap();
    futures_util::pin_mut!(sink);
    sink.send(bytes::Bytes::from_static(b"1\tcopied in\n2\tcopied in\n"))
        .await
        .unwrap();
    assert_eq!(sink.finish().await.unwrap(), 2);
    let n = client
        .query_one(
            "SELECT count(*) FROM documents WHERE title = 'copied in'",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(n.get::<_, i64>(0), 2);
}

/// Statements a client could use to take a core down before the parse was bounded: thousands
/// of AND terms (8,000 overflowed an unoptimised core's stack and aborted the process, 20,000
/// an optimised one's; 5,000 here, as the cloud plans them in seconds) and 400 references
/// linked by one unqualified `organization_id = organization_id` (over a minute of a core's
/// time). Both go to the cloud unplaced and are answered; the session and
/// the proxy go on, and a session limited by `lokadb.org` is refused them with the reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn statements_too_deep_or_wide_to_analyse_go_to_the_cloud() {
    let w = World::start(json!({ "route_log": true }), &[]).unwrap();
    enable_documents(&w);
    let client = w.client().await.unwrap();
    let mut deep =
        String::from("SELECT count(*) FROM documents WHERE organization_id = 2 /* deep */");
    for i in 0..5_000 {
        deep.push_str(&format!(" AND id <> -{i}"));
    }
    let refs: Vec<String> = (0..400).map(|i| format!("documents d{i}")).collect();
    let wide = format!(
        "SELECT count(*) FROM (SELECT 1 FROM {} WHERE organization_id = organization_id LIMIT 0) s",
        refs.join(", ")
    );
    let started = std::time::Instant::now();
    let n: i64 = client.query_one(&deep, &[]).await.unwrap().get(0);
    assert_eq!(n, 100);
    assert!(one_line(&w, "/* deep */").contains("too many operators"));
    // Postgres refuses the column as ambiguous; the proxy passes its answer on.
    let err = client.simple_query(&wide).await.unwrap_err();
    assert_eq!(
        err.as_db_error().map(|e| e.code().code()),
        Some("42702"),
        "{err}"
    );
    assert!(
        one_line(&w, "FROM documents d0, documents d1,").contains("more LokaDB table references")
    );
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "{:?}",
        started.elapsed()
    );
    client.simple_query("SET lokadb.org = '2'").await.unwrap();
    let err = client.simple_query(&deep).await.unwrap_err();
    let db = err.as_db_error().expect("a refusal");
    assert_eq!(db.code().code(), "0A000", "{err}");
    assert!(db.message().contains("too many operators"), "{err}");
    let rows = client
        .simple_query("SELECT count(*) FROM documents")
        .await
        .unwrap();
    assert!(!rows.is_empty());
}

/// `documents` and `document_versions` enabled (see [`enable_documents`]).
fn enable_both(w: &World) {
    enable_documents(w);
    enable_versions(w);
}

/// `document_versions` enabled after `documents`; returns once the proxy's watcher has
/// passed it to the cores.
fn enable_versions(w: &World) {
    ok(&lokadb(
        &w.cloud.superuser_dsn("app"),
        &["enable", "document_versions"],
    ));
    assert!(
        w.proxy
            .wait_for_output("tables=2 organizations=0", Duration::from_secs(10)),
        "{}",
        w.proxy.output()
    );
}

/// The `lokadb::route` line of the statement marked `/*mark*/` (each case's text ends with
/// its own mark), waiting for it.
#[track_caller]
fn marked_line(w: &World, mark: &str) -> String {
    one_line(w, &format!("/*{mark}*/"))
}

/// The statement table of `docs/routing.md`'s rules through the real proxy and the real
/// cloud catalog, as `route_log` reports each statement: quoting, schemas, CTEs, subqueries,
/// joins, IN, casts, multi-statement queries, key-map lookups, UPDATE and INSERT, over the
/// simple protocol and the extended one (the Parse placed by `$n`, its Bind by the bound
/// value). `org=` is the placement, `?` none, `-` no LokaDB table, `key` a key map's.
/// (`route/analysis_cases.rs` holds the longer table, against a stand-in catalog.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_statement_table_routes_through_the_proxy_in_both_protocols() {
    let w = World::start(json!({ "route_log": true }), &[]).unwrap();
    enable_both(&w);
    let client = w.client().await.unwrap();
    // (statement, expected org, expected tables)
    let simple: &[(&str, &str, &str)] = &[
        ("SELECT count(*) FROM documents WHERE organization_id = 2", "2", "public.documents"),
        ("SELECT * FROM public.documents d WHERE d.organization_id = '2'", "2", "public.documents"),
        ("SELECT * FROM \"documents\" WHERE \"organization_id\" = 2", "2", "public.documents"),
        ("SELECT * FROM DOCUMENTS WHERE Organization_Id = 2", "2", "public.documents"),
        ("SELECT * FROM documents WHERE organization_id = '2'::bigint", "2", "public.documents"),
        ("SELECT * FROM documents WHERE organization_id = CAST(2 AS int8)", "2", "public.documents"),
        ("SELECT * FROM documents WHERE 2 = organization_id", "2", "public.documents"),
        ("SELECT * FROM documents WHERE organization_id IN (2)", "2", "public.documents"),
        ("SELECT * FROM documents WHERE organization_id IN (1, 2)", "?", ""),
        ("SELECT * FROM documents WHERE organization_id = 1 OR organization_id = 2", "?", ""),
        ("SELECT count(*) FROM documents", "?", ""),
        ("SELECT * FROM documents WHERE organization_id = 2 AND organization_id = 1", "?", ""),
        ("WITH x AS (SELECT id FROM documents WHERE organization_id = 2) SELECT count(*) FROM x", "2", "public.documents"),
        ("WITH x AS (SELECT id FROM documents) SELECT count(*) FROM x", "?", ""),
        (
            "SELECT count(*) FROM document_versions v WHERE v.organization_id = 2 AND v.document_id IN (SELECT id FROM documents WHERE organization_id = 2)",
            "2",
            "public.document_versions,public.documents",
        ),
        (
            "SELECT count(*) FROM document_versions v WHERE v.organization_id = 2 AND v.document_id IN (SELECT id FROM documents)",
            "?",
            "",
        ),
        (
            "SELECT count(*) FROM documents d JOIN document_versions v ON v.document_id = d.id AND v.organization_id = d.organization_id WHERE d.organization_id = 2",
            "2",
            "public.documents,public.document_versions",
        ),
        (
            "SELECT d.title, p.id FROM documents d JOIN projects p ON p.id = d.project_id WHERE d.organization_id = 2",
            "2",
            "public.documents",
        ),
        ("SELECT count(*) FROM projects p JOIN organizations o ON o.id = p.organization_id", "-", ""),
        ("SELECT (SELECT count(*) FROM documents WHERE organization_id = 2) AS n", "2", "public.documents"),
        (
            "SELECT 1 FROM documents WHERE organization_id = 2 LIMIT 1; SELECT 1 FROM document_versions WHERE organization_id = 2 LIMIT 1",
            "2",
            "public.documents,public.document_versions",
        ),
        (
            "SELECT 1 FROM documents WHERE organization_id = 2 LIMIT 1; SELECT 1 FROM document_versions WHERE organization_id = 1 LIMIT 1",
            "?",
            "",
        ),
        ("SELECT 1; SELECT count(*) FROM projects", "-", ""),
        ("SELECT title FROM documents WHERE id = 3", "key", ""),
        ("SELECT title FROM documents WHERE documents.id = '3' AND title <> ''", "key", ""),
        ("UPDATE documents SET title = title WHERE organization_id = 2 AND id = 2", "2", "public.documents"),
        ("UPDATE documents SET organization_id = 2 WHERE organization_id = 2 AND id = 2", "?", ""),
        (
            "INSERT INTO document_versions (organization_id, document_id, body) VALUES (2, 2, 'a'), ('2', 2, 'b')",
            "2",
            "public.document_versions",
        ),
        ("DELETE FROM document_versions WHERE organization_id = 2 AND body = 'a'", "2", "public.document_versions"),
        ("SELECT 'documents WHERE organization_id = 2' FROM projects", "-", ""),
    ];
    for (i, (sql, org, tables)) in simple.iter().enumerate() {
        let mark = format!("s{i}");
        client
            .simple_query(&format!("{sql} /*{mark}*/"))
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
        let line = marked_line(&w, &mark);
        assert!(line.contains("route=\"cloud\""), "{sql}: {line}");
        assert!(line.contains("kind=\"query\""), "{sql}: {line}");
        assert!(
            line.contains(&format!(" org={org} ")),
            "{sql}: want org={org}: {line}"
        );
        // The tables in the catalog's order: compared as sets.
        let sorted = |t: &str| {
            let mut v: Vec<String> = t
                .split(',')
                .filter(|s| !s.is_empty())
                .map(str::to_owned)
                .collect();
            v.sort();
            v
        };
        let logged = line
            .split(" tables=")
            .nth(1)
            .and_then(|t| t.split(' ').next())
            .unwrap_or_default();
        assert_eq!(sorted(logged), sorted(tables), "{sql}: {line}");
    }

    // The extended protocol: (statement, its Parse's org, a text value for $1, its Bind's org
    // or "" when its Bind is not placed by a parameter).
    let extended: &[(&str, &str, &str, &str)] = &[
        ("SELECT count(*) FROM documents WHERE organization_id = $1", "$1", "2", "2"),
        ("SELECT count(*) FROM documents WHERE organization_id = $1::bigint", "$1", "2", "2"),
        ("SELECT count(*) FROM documents WHERE organization_id = CAST($1 AS bigint)", "$1", "1", "1"),
        ("SELECT count(*) FROM documents WHERE organization_id = $1::text::bigint", "$1", "2", "2"),
        ("SELECT count(*) FROM documents WHERE organization_id = $1::int + 0", "?", "2", ""),
        ("SELECT count(*) FROM documents WHERE organization_id = 2 AND id > $1::bigint", "2", "0", ""),
        (
            "WITH x AS (SELECT id FROM documents WHERE organization_id = $1::bigint) SELECT count(*) FROM x",
            "$1",
            "2",
            "2",
        ),
        (
            "SELECT count(*) FROM documents d JOIN document_versions v ON v.document_id = d.id WHERE d.organization_id = $1::bigint AND v.organization_id = $1::bigint",
            "$1",
            "1",
            "1",
        ),
        ("SELECT title FROM documents WHERE id = $1::bigint", "key", "3", ""),
        ("UPDATE documents SET title = title WHERE organization_id = $1::bigint AND id = 2", "$1", "2", "2"),
    ];
    for (i, (sql, org, value, bound)) in extended.iter().enumerate() {
        let mark = format!("e{i}");
        let statement = client
            .prepare(&format!("{sql} /*{mark}*/"))
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
        let parse = marked_line(&w, &mark);
        assert!(parse.contains("kind=\"prepare\""), "{sql}: {parse}");
        assert!(
            parse.contains(&format!(" org={org} ")),
            "{sql}: want org={org}: {parse}"
        );
        // Bound as the type the statement gave the parameter.
        use tokio_postgres::types::{ToSql, Type};
        let (int4, int8): (i32, i64) = (value.parse().unwrap(), value.parse().unwrap());
        let param: &(dyn ToSql + Sync) = if statement.params()[0] == Type::INT4 {
            &int4
        } else if statement.params()[0] == Type::INT8 {
            &int8
        } else {
            value
        };
        let binds = route_lines(&w, "kind=\"bind\"").len();
        client
            .execute(&statement, &[param])
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
        // A marked Query after it: the session's lines come in order, so once that one is
        // in, so is the Bind's, if any.
        client
            .simple_query(&format!("SELECT 1 /*{mark}-after*/"))
            .await
            .unwrap();
        marked_line(&w, &format!("{mark}-after"));
        let new = route_lines(&w, "kind=\"bind\"");
        if bound.is_empty() {
            assert_eq!(new.len(), binds, "{sql}: no Bind line: {new:#?}");
        } else {
            assert_eq!(new.len(), binds + 1, "{sql}: one Bind line: {new:#?}");
            let bind = &new[binds];
            assert!(
                bind.contains(&format!(" org={bound} ")),
                "{sql}: want org={bound}: {bind}"
            );
        }
    }
}

/// A metadata change reaches live sessions on every core: sessions spread over two cores
/// (the kernel's SO_REUSEPORT spread, 16 of them) route a table enabled after they
/// connected by the new generation, each on its own core (`core=` of the session's span).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_metadata_change_reaches_live_sessions_on_every_core() {
    let w = World::start(
        json!({ "route_log": true }),
        &[("LOKADB_CORES", "2"), ("LOKADB_LOG", "info,lokadb=debug")],
    )
    .unwrap();
    enable_documents(&w);
    let mut clients = Vec::new();
    for i in 0..16 {
        let c = w.client().await.unwrap();
        c.simple_query(&format!(
            "SELECT count(*) FROM document_versions WHERE organization_id = 2 /*before{i}*/"
        ))
        .await
        .unwrap();
        assert!(marked_line(&w, &format!("before{i}")).contains(" org=- "));
        clients.push(c);
    }
    enable_versions(&w);
    let mut cores = std::collections::BTreeSet::new();
    for c in &clients {
        let line = placed_soon(
            &w,
            c,
            "SELECT count(*) FROM document_versions WHERE organization_id = 2",
            " org=2 ",
        )
        .await;
        assert!(line.contains(" tables=public.document_versions "), "{line}");
        let core = line
            .split("core=")
            .nth(1)
            .and_then(|s| s.split([' ', '}']).next())
            .unwrap_or_else(|| panic!("a session span with its core: {line}"))
            .to_owned();
        cores.insert(core);
    }
    assert_eq!(
        cores.into_iter().collect::<Vec<_>>(),
        ["0", "1"],
        "sessions on both cores"
    );
}
