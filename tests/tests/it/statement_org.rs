//! What the cloud learns of each statement's organization: before a statement on LokaDB
//! tables reaches the cloud, `lokadb.statement_org` holds the organization the proxy placed
//! it in (`''` when it could name none). The statements below read it themselves, so each
//! answer shows what the cloud held while it ran; the client sees nothing else of it.

use crate::direct::{client, direct_world};
use lokadb_shared::wire::frontend;
use lokadb_tests::proxy::Proxy;
use lokadb_tests::raw::Raw;
use serde_json::json;

/// Cloud-side code that reads the setting (a client text naming it makes the proxy forget
/// what the cloud holds, so the statements call this instead).
const SEEN_ORG: &str = "CREATE FUNCTION seen_org() RETURNS text LANGUAGE sql VOLATILE AS $$ SELECT current_setting('lokadb.statement_org', true) $$";

/// A statement that shows the setting as the cloud holds while it runs, and the count of one
/// organization's documents ($1).
const SEEN: &str = "SELECT seen_org(), count(*)::text FROM documents WHERE organization_id = $1";

/// Bind of the unnamed portal (parameters as text) and its Execute.
fn bind(out: &mut Vec<u8>, statement: &str, params: &[&str]) {
    let params: Vec<Option<&str>> = params.iter().copied().map(Some).collect();
    frontend::bind_text(out, statement, &params);
    frontend::execute(out);
}

/// Every message answering one request, in order: its tag, a DataRow as `D=` and its values.
pub(crate) async fn answers(c: &mut Raw, out: &[u8]) -> Vec<String> {
    c.send(out).await;
    let mut seen = Vec::new();
    loop {
        let (tag, body) = c.message().await;
        match tag {
            b'D' => {
                let mut values = Vec::new();
                let mut at = 2;
                for _ in 0..i16::from_be_bytes([body[0], body[1]]) {
                    let len = i32::from_be_bytes(body[at..at + 4].try_into().unwrap());
                    at += 4;
                    let len = usize::try_from(len).unwrap_or(0);
                    values.push(String::from_utf8_lossy(&body[at..at + len]).into_owned());
                    at += len;
                }
                seen.push(format!("D={}", values.join(",")));
            }
            b'E' => seen.push(format!("E={}", String::from_utf8_lossy(&body))),
            b'N' | b'S' | b'A' => {}
            _ => seen.push((tag as char).to_string()),
        }
        if tag == b'Z' {
            return seen;
        }
    }
}

/// Checks through `proxy`, against the cloud (`cloud`, straight).
async fn the_cloud_learns_each_statements_organization(
    proxy: &Proxy,
    cloud: &tokio_postgres::Client,
) {
    let port = proxy.port();
    let count = |org: i64| async move {
        cloud
            .query_one(
                "SELECT count(*)::text FROM documents WHERE organization_id = $1",
                &[&org],
            )
            .await
            .unwrap()
            .get::<_, String>(0)
    };
    let (n1, n2) = (count(1).await, count(2).await);
    cloud.batch_execute(SEEN_ORG).await.unwrap();
    let c = client(proxy).await;
    // Simple and extended protocol, a literal and a bound organization.
    let simple = |sql: &str| {
        let c = &c;
        let sql = sql.to_owned();
        async move {
            match &c.simple_query(&sql).await.unwrap()[1] {
                tokio_postgres::SimpleQueryMessage::Row(r) => {
                    (r.get(0).map(str::to_owned), r.get(1).unwrap().to_owned())
                }
                m => panic!("{m:?}"),
            }
        }
    };
    let of = |org: i64| SEEN.replace("$1", &org.to_string());
    assert_eq!(simple(&of(1)).await, (Some("1".into()), n1.clone()));
    assert_eq!(simple(&of(2)).await, (Some("2".into()), n2.clone()));
    let seen_bound = |org: i64| {
        let c = &c;
        async move {
            let row = c.query_one(SEEN, &[&org]).await.unwrap();
            (row.get::<_, Option<String>>(0), row.get::<_, String>(1))
        }
    };
    assert_eq!(seen_bound(1).await, (Some("1".into()), n1.clone()));
    assert_eq!(seen_bound(2).await, (Some("2".into()), n2.clone()));
    // A statement the proxy cannot place in one organization: none.
    let total = "SELECT seen_org(), count(*)::text FROM documents";
    assert_eq!(simple(total).await.0.as_deref(), Some(""));
    assert_eq!(seen_bound(2).await.0.as_deref(), Some("2"));

    // A simple Query of one statement gets the proxy's statement in front of its text: an
    // error in the client's statement points into the client's text as straight at the
    // cloud, and leaves the value unknown (the Query's transaction rolled back).
    let bad = "SELECT seen_org(), nosuch FROM documents WHERE organization_id = 2";
    let position = |e: tokio_postgres::Error| {
        let db = e.as_db_error().expect("the server's error").clone();
        (db.code().code().to_owned(), format!("{:?}", db.position()))
    };
    // The Query as the cloud runs it: with the SET in front on PostgreSQL 18+, whose
    // pg_stat_statements counts the SETs of every value as one statement; else after a
    // request of the proxy's own.
    let version: i32 = cloud
        .query_one("SELECT current_setting('server_version_num')::int", &[])
        .await
        .unwrap()
        .get(0);
    let seen_query = "SELECT current_query() FROM documents WHERE organization_id = 1 LIMIT 1";
    assert_eq!(simple(&of(2)).await.0.as_deref(), Some("2"));
    let ran = match &c.simple_query(seen_query).await.unwrap()[1] {
        tokio_postgres::SimpleQueryMessage::Row(r) => r.get(0).unwrap().to_owned(),
        m => panic!("{m:?}"),
    };
    if version >= 180_000 {
        assert_eq!(ran, format!("SET lokadb.statement_org = '1';{seen_query}"));
    } else {
        assert_eq!(ran, seen_query);
    }
    let straight = position(cloud.simple_query(bad).await.unwrap_err());
    assert!(straight.1.contains("Original(20)"), "{straight:?}");
    assert_eq!(position(c.simple_query(bad).await.unwrap_err()), straight);
    assert_eq!(simple(&of(1)).await.0.as_deref(), Some("1"));
    assert_eq!(simple(&of(1)).await.0.as_deref(), Some("1"));
    // Two statements in one Query, and a LOCK (which Postgres refuses alone outside a
    // transaction block, and runs after another statement of the same Query): a request of
    // the proxy's own ahead of them, the LOCK refused as straight at the cloud.
    let two = c
        .simple_query(&format!("{}; {}", of(2), of(2)))
        .await
        .unwrap();
    let seen: Vec<_> = two
        .iter()
        .filter_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => r.get(0).map(str::to_owned),
            _ => None,
        })
        .collect();
    assert_eq!(seen, ["2", "2"]);
    let lock = c.simple_query("LOCK documents").await.unwrap_err();
    assert_eq!(
        lock.as_db_error().map(|e| e.code().code()),
        Some("25P01"),
        "{lock}"
    );
    assert_eq!(simple(&of(1)).await.0.as_deref(), Some("1"));

    // Set inside a transaction that rolls back, the value goes with it: the proxy sets it
    // again before the next statement.
    c.batch_execute("BEGIN").await.unwrap();
    assert_eq!(seen_bound(1).await.0.as_deref(), Some("1"));
    c.batch_execute("ROLLBACK").await.unwrap();
    assert_eq!(seen_bound(1).await.0.as_deref(), Some("1"));
    // The client's RESET ALL clears it: set again.
    c.batch_execute("RESET ALL").await.unwrap();
    assert_eq!(seen_bound(1).await.0.as_deref(), Some("1"));
    // DEALLOCATE ALL drops the proxy's statement too: it is parsed again.
    c.batch_execute("DEALLOCATE ALL").await.unwrap();
    assert_eq!(seen_bound(2).await.0.as_deref(), Some("2"));

    // A pipeline: Parse, then three Bind/Execute of the unnamed statement for organizations
    // 1, 2, 1, one Sync. Each statement sees its own organization, and the client gets
    // exactly the answers to its own messages.
    let mut raw = Raw::connect(port).await;
    let mut out = Vec::new();
    frontend::parse(&mut out, "", SEEN);
    for org in ["1", "2", "1"] {
        bind(&mut out, "", &[org]);
    }
    frontend::sync(&mut out);
    let expect = |orgs: &[&str]| {
        let mut e = vec!["1".to_owned()];
        for org in orgs {
            let n = if *org == "1" { &n1 } else { &n2 };
            e.extend(["2".to_owned(), format!("D={org},{n}"), "C".to_owned()]);
        }
        e.push("Z".to_owned());
        e
    };
    assert_eq!(answers(&mut raw, &out).await, expect(&["1", "2", "1"]));
    // A named statement, parsed and bound in one batch, then bound alone.
    let mut out = Vec::new();
    frontend::parse(&mut out, "seen", SEEN);
    bind(&mut out, "seen", &["2"]);
    frontend::sync(&mut out);
    assert_eq!(answers(&mut raw, &out).await, expect(&["2"]));
    let mut out = Vec::new();
    bind(&mut out, "seen", &["1"]);
    bind(&mut out, "seen", &["2"]);
    frontend::sync(&mut out);
    let mut e = expect(&["1", "2"]);
    e.remove(0); // no Parse
    assert_eq!(answers(&mut raw, &out).await, e);
    // An error in the batch before the proxy's statement: the batch's answers, the error
    // and nothing of the proxy's.
    let mut out = Vec::new();
    frontend::parse(
        &mut out,
        "",
        "SELECT 1 / (SELECT count(*) FROM pg_class WHERE false)::int",
    );
    bind(&mut out, "", &[]);
    bind(&mut out, "seen", &["1"]);
    frontend::sync(&mut out);
    let got = answers(&mut raw, &out).await;
    assert!(
        matches!(got.as_slice(), [p, b, e, z] if p == "1" && b == "2" && e.contains("22012") && z == "Z"),
        "{got:?}"
    );
    let mut out = Vec::new();
    bind(&mut out, "seen", &["2"]);
    frontend::sync(&mut out);
    let mut e = expect(&["2"]);
    e.remove(0);
    assert_eq!(answers(&mut raw, &out).await, e);
    // A DEALLOCATE ALL earlier in the same batch drops the proxy's statement before its
    // Bind runs: it is seen, and the statement parsed again in the batch. The next batches
    // use it without parsing it again.
    for first in [true, false, false] {
        let mut out = Vec::new();
        if first {
            frontend::parse(&mut out, "", "DEALLOCATE ALL");
            bind(&mut out, "", &[]);
        }
        frontend::parse(&mut out, "", SEEN);
        bind(&mut out, "", &["1"]);
        bind(&mut out, "", &["2"]);
        frontend::sync(&mut out);
        let mut e = expect(&["1", "2"]);
        if first {
            e.splice(0..0, ["1".to_owned(), "2".to_owned(), "C".to_owned()]);
        }
        assert_eq!(answers(&mut raw, &out).await, e);
    }

    // The proxy's messages at the front of a batch that ends with a ROLLBACK are rolled
    // back with it: the next statement of organization 1 gets the setting again. (The
    // DEALLOCATE ALL above dropped the client's statement too.)
    let mut out = Vec::new();
    frontend::parse(&mut out, "seen", SEEN);
    frontend::sync(&mut out);
    assert_eq!(answers(&mut raw, &out).await, ["1", "Z"]);
    assert_eq!(
        answers(&mut raw, &bound("seen", "2")).await,
        expect(&["2"])[1..]
    );
    let mut out = Vec::new();
    bind(&mut out, "seen", &["1"]);
    frontend::parse(&mut out, "", "ROLLBACK");
    bind(&mut out, "", &[]);
    frontend::sync(&mut out);
    let mut e = expect(&["1"]);
    e.remove(0);
    e.splice(3..3, ["1".to_owned(), "2".to_owned(), "C".to_owned()]);
    assert_eq!(answers(&mut raw, &out).await, e);
    for _ in 0..2 {
        assert_eq!(
            answers(&mut raw, &bound("seen", "1")).await,
            expect(&["1"])[1..]
        );
    }

    // Statements Postgres runs only alone in their request, parsed and run in one batch:
    // nothing of the proxy's goes ahead of them (it would make Postgres refuse them).
    for sql in ["VACUUM documents", "REINDEX TABLE CONCURRENTLY documents"] {
        let mut out = Vec::new();
        frontend::parse(&mut out, "", sql);
        bind(&mut out, "", &[]);
        frontend::sync(&mut out);
        assert_eq!(answers(&mut raw, &out).await, ["1", "2", "C", "Z"], "{sql}");
    }

    // Cloud-side code that deallocates the proxy's statement where the proxy cannot see
    // it: the next batch that needs the setting fails once, with Postgres's error, and the
    // proxy parses its statement again.
    cloud
        .batch_execute(
            "CREATE FUNCTION drop_prepared() RETURNS int LANGUAGE plpgsql AS $$ \
             BEGIN EXECUTE 'DEALLOC' || 'ATE ALL'; RETURN 1; END $$",
        )
        .await
        .unwrap();
    let mut out = Vec::new();
    frontend::query(&mut out, "SELECT drop_prepared()");
    assert_eq!(answers(&mut raw, &out).await, ["T", "D=1", "C", "Z"]);
    let mut out = Vec::new();
    frontend::parse(&mut out, "seen", SEEN);
    frontend::sync(&mut out);
    answers(&mut raw, &out).await;
    let got = answers(&mut raw, &bound("seen", "2")).await;
    assert!(
        matches!(got.as_slice(), [e, z] if e.contains("26000") && e.contains("lokadb_statement_org") && z == "Z"),
        "{got:?}"
    );
    assert_eq!(
        answers(&mut raw, &bound("seen", "2")).await,
        expect(&["2"])[1..]
    );

    // A prepared RESET ALL run later clears the setting each time it runs: the next
    // statement gets it again.
    let mut out = Vec::new();
    frontend::parse(&mut out, "reset", "RESET ALL");
    frontend::sync(&mut out);
    assert_eq!(answers(&mut raw, &out).await, ["1", "Z"]);
    for _ in 0..2 {
        assert_eq!(
            answers(&mut raw, &bound("seen", "2")).await,
            expect(&["2"])[1..]
        );
        let mut out = Vec::new();
        bind(&mut out, "reset", &[]);
        frontend::sync(&mut out);
        assert_eq!(answers(&mut raw, &out).await, ["2", "C", "Z"]);
    }
    // So does a statement prepared with SQL that sets it, at each EXECUTE.
    let mut out = Vec::new();
    frontend::query(
        &mut out,
        "PREPARE set_it AS SELECT pg_catalog.set_config('lokadb.statement_org', 'x', false)",
    );
    assert_eq!(answers(&mut raw, &out).await, ["C", "Z"]);
    for _ in 0..2 {
        assert_eq!(
            answers(&mut raw, &bound("seen", "2")).await,
            expect(&["2"])[1..]
        );
        let mut out = Vec::new();
        frontend::query(&mut out, "EXECUTE set_it");
        assert_eq!(answers(&mut raw, &out).await, ["T", "D=x", "C", "Z"]);
    }
    // And a FunctionCall (the protocol's own call of a function by its oid): set_config.
    for _ in 0..2 {
        assert_eq!(
            answers(&mut raw, &bound("seen", "2")).await,
            expect(&["2"])[1..]
        );
        let mut body = 2078u32.to_be_bytes().to_vec(); // pg_catalog.set_config
        body.extend_from_slice(&0i16.to_be_bytes()); // arguments as text
        body.extend_from_slice(&3i16.to_be_bytes());
        for arg in ["lokadb.statement_org", "y", "false"] {
            body.extend_from_slice(&(arg.len() as i32).to_be_bytes());
            body.extend_from_slice(arg.as_bytes());
        }
        body.extend_from_slice(&0i16.to_be_bytes()); // result as text
        let mut out = vec![b'F'];
        out.extend_from_slice(&(body.len() as u32 + 4).to_be_bytes());
        out.extend_from_slice(&body);
        assert_eq!(answers(&mut raw, &out).await, ["V", "Z"]);
    }
    assert_eq!(
        answers(&mut raw, &bound("seen", "2")).await,
        expect(&["2"])[1..]
    );
    assert_eq!(
        answers(&mut raw, &bound("seen", "2")).await,
        expect(&["2"])[1..]
    );
}

/// A batch of one Bind and Execute of `statement` for organization `org`.
fn bound(statement: &str, org: &str) -> Vec<u8> {
    let mut out = Vec::new();
    bind(&mut out, statement, &[org]);
    frontend::sync(&mut out);
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cloud_learns_the_organization_of_each_statement_with_the_direct_path() {
    let (w, proxy) = direct_world(json!({}));
    let cloud = crate::world::connect(&w.cloud.superuser_dsn("app"))
        .await
        .unwrap();
    the_cloud_learns_each_statements_organization(&proxy, &cloud).await;
    // A plain read of organization 1 held until its Bind (it might have gone direct) goes
    // to the cloud with the organization set ahead of it.
    let mut raw = Raw::connect(proxy.port()).await;
    let mut out = Vec::new();
    frontend::parse(
        &mut out,
        "",
        "SELECT count(*)::text FROM documents WHERE organization_id = $1",
    );
    bind(&mut out, "", &["1"]);
    frontend::sync(&mut out);
    let got = answers(&mut raw, &out).await;
    assert_eq!(got.len(), 5, "{got:?}");
    let mut out = Vec::new();
    frontend::query(&mut out, "SELECT seen_org()");
    let got = answers(&mut raw, &out).await;
    assert!(got.contains(&"D=1".to_owned()), "{got:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cloud_learns_the_organization_of_each_statement_without_the_direct_path() {
    let w = crate::moves::world_at(0, false, None);
    crate::world::create_auth_role(&w.cloud).unwrap();
    let proxy = crate::world::start_proxy(&w.cloud, json!({}), &[]).unwrap();
    assert!(proxy.wait_for_output("metadata loaded", std::time::Duration::from_secs(10)));
    let cloud = crate::world::connect(&w.cloud.superuser_dsn("app"))
        .await
        .unwrap();
    the_cloud_learns_each_statements_organization(&proxy, &cloud).await;

    // With `statement_org` off the cloud learns nothing: a new proxy, so new backends.
    let mut config = crate::world::config(&w.cloud, json!({}));
    config["databases"]["app"]["statement_org"] = json!(false);
    let off = Proxy::builder(config).start().unwrap();
    assert!(off.wait_for_output("metadata loaded", std::time::Duration::from_secs(10)));
    let c = client(&off).await;
    let row = c.query_one(SEEN, &[&1i64]).await.unwrap();
    assert_eq!(row.get::<_, Option<String>>(0), None);
}
