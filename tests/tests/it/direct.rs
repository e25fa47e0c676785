//! The direct path (fdw+direct): organization 2 is moved behind a real relay and agent;
//! through the proxy, plain reads of its LokaDB tables run in its database directly (seen
//! verbatim in its statement log), everything else through the cloud, with the same answers.

use crate::admin_cli::{lokadb, ok};
use crate::moves::{world_at, World};
use crate::tunnel_world::{APP_PASSWORD, APP_USER, ORG_DB};
use lokadb_tests::proxy::Proxy;
use lokadb_tests::raw::Raw;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

/// Organization 2 moved with the fdw+direct profile, its database logging every
/// statement, and a proxy with the direct path configured (`db` merged into its database
/// block).
pub(crate) fn direct_world(db: Value) -> (World, Proxy) {
    direct_world_env(db, &[])
}

fn direct_world_env(db: Value, env: &[(&str, &str)]) -> (World, Proxy) {
    let w = world_at(0, false, None);
    direct_world_setup(&w);
    let proxy = direct_proxy(&w, db, env);
    (w, proxy)
}

/// The world's organization 2 moved with fdw+direct, its database logging every statement.
pub(crate) fn direct_world_setup(w: &World) {
    w.org
        .db
        .psql(
            "postgres",
            &format!("ALTER DATABASE {ORG_DB} SET log_statement = 'all'"),
        )
        .unwrap();
    ok(&lokadb(
        &w.dsn,
        &["move-org", "2", "--profile", "fdw+direct"],
    ));
    crate::world::create_auth_role(&w.cloud).unwrap();
}

/// A proxy with the direct path configured for `w` (`db` merged into its database block,
/// `env` its environment).
pub(crate) fn direct_proxy(w: &World, db: Value, env: &[(&str, &str)]) -> Proxy {
    direct_proxy_with(w, db, json!({}), env)
}

/// [`direct_proxy`] with `top` merged into the configuration's top level.
pub(crate) fn direct_proxy_with(w: &World, db: Value, top: Value, env: &[(&str, &str)]) -> Proxy {
    let mut database = json!({
        "cloud": format!("host=127.0.0.1 port={} dbname=app", w.cloud.port()),
        "auth_user": "lokadb_auth",
        "auth_password": "auth-secret",
        "direct": { "user": APP_USER, "password": APP_PASSWORD },
    });
    if let (Some(base), Value::Object(extra)) = (database.as_object_mut(), db) {
        base.extend(extra);
    }
    let mut config = json!({
        "listen": "127.0.0.1:0",
        "route_log": true,
        "databases": { "app": database },
    });
    if let (Some(base), Value::Object(extra)) = (config.as_object_mut(), top) {
        base.extend(extra);
    }
    let mut builder = Proxy::builder(config);
    for (k, v) in env {
        builder = builder.env(k, v);
    }
    let proxy = builder.start().unwrap();
    assert!(
        proxy.wait_for_output("organizations=1", Duration::from_secs(10)),
        "{}",
        proxy.output()
    );
    proxy
}

/// A session of role `nosy` (password `nosy-secret`) through the proxy.
async fn nosy(proxy: &Proxy) -> tokio_postgres::Client {
    crate::world::connect(&format!(
        "host=127.0.0.1 port={} user=nosy password=nosy-secret dbname=app",
        proxy.port()
    ))
    .await
    .unwrap()
}

pub(crate) async fn client(proxy: &Proxy) -> tokio_postgres::Client {
    crate::world::connect(&format!(
        "host=127.0.0.1 port={} user={} password={} dbname=app",
        proxy.port(),
        lokadb_tests::pg::SUPERUSER,
        lokadb_tests::pg::SUPERUSER_PASSWORD
    ))
    .await
    .unwrap()
}

/// The route of the one `lokadb::route` line mentioning `needle` and `kind` (waiting for
/// it: the log reaches the test through a pipe).
#[track_caller]
pub(crate) fn route_of(proxy: &Proxy, kind: &str, needle: &str) -> String {
    let lines = || -> Vec<String> {
        proxy
            .output()
            .lines()
            .filter(|l| {
                l.contains("lokadb::route")
                    && l.contains(needle)
                    && l.contains(&format!("kind=\"{kind}\""))
            })
            .map(str::to_owned)
            .collect()
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while lines().is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    let found = lines();
    let last = found.last().unwrap_or_else(|| {
        panic!("no route line for {needle:?}\n{}", proxy.output());
    });
    let route = last.split("route=").nth(1).unwrap_or_default();
    route
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .to_owned()
}

/// How many times the organization's database logged `sql` verbatim.
pub(crate) fn org_ran(w: &World, sql: &str) -> usize {
    w.org.db.log_contents().matches(sql).count()
}

pub(crate) fn one_i64(rows: &[tokio_postgres::SimpleQueryMessage]) -> i64 {
    rows.iter()
        .find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => r.get(0).map(|v| v.parse().unwrap()),
            _ => None,
        })
        .expect("a row")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_reads_of_a_moved_organization_run_in_its_database() {
    let (w, proxy) = direct_world(json!({}));
    let c = client(&proxy).await;

    // Simple protocol: the organization's database answers, and logs the client's text.
    let sql = "SELECT count(*) FROM documents WHERE organization_id = 2";
    assert_eq!(one_i64(&c.simple_query(sql).await.unwrap()), 100);
    assert_eq!(route_of(&proxy, "query", sql), "\"direct\"");
    assert_eq!(org_ran(&w, sql), 1, "{}", w.org.db.log_contents());

    // COPY of a plain read to the client: streamed from there too.
    let copy = "COPY (SELECT id, title FROM documents WHERE organization_id = 2) TO STDOUT";
    let chunks: Vec<_> = futures_util::StreamExt::collect(c.copy_out(copy).await.unwrap()).await;
    let text: Vec<u8> = chunks
        .into_iter()
        .flat_map(|c| c.unwrap().to_vec())
        .collect();
    assert_eq!(text.iter().filter(|&&b| b == b'\n').count(), 100);
    assert_eq!(org_ran(&w, copy), 1);

    // Organization 1 and a join with a cloud table: the cloud.
    let sql1 = "SELECT count(*) FROM documents WHERE organization_id = 1";
    assert_eq!(one_i64(&c.simple_query(sql1).await.unwrap()), 100);
    assert_eq!(route_of(&proxy, "query", sql1), "\"cloud\"");
    let join = "SELECT count(*) FROM documents d JOIN projects p ON p.id = d.project_id WHERE d.organization_id = 2";
    assert_eq!(one_i64(&c.simple_query(join).await.unwrap()), 100);
    assert_eq!(route_of(&proxy, "query", join), "\"cloud\"");
    assert_eq!(org_ran(&w, join), 0);

    // Extended protocol: one prepared statement, placed by its bound value each time.
    let by_id = c
        .prepare("SELECT title FROM documents WHERE organization_id = $1 AND id = $2")
        .await
        .unwrap();
    let ids: Vec<(i64, i64)> = c
        .query(
            "SELECT organization_id, min(id) FROM documents GROUP BY 1 ORDER BY 1",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    for _ in 0..3 {
        for &(org, id) in &ids {
            let row = c.query_one(&by_id, &[&org, &id]).await.unwrap();
            let title: String = row.get(0);
            assert!(title.starts_with("doc "), "{title}");
        }
    }
    // Organization 2's three executions ran there (organization 1's in the cloud).
    assert_eq!(
        org_ran(
            &w,
            "SELECT title FROM documents WHERE organization_id = $1 AND id = $2"
        ),
        3,
        "{}",
        w.org.db.log_contents()
    );
    assert_eq!(route_of(&proxy, "bind", "org=2 "), "\"direct\"");
    assert_eq!(route_of(&proxy, "bind", "org=1 "), "\"cloud\"");

    // Writes go through the cloud; the next direct read sees them.
    c.execute(
        "UPDATE documents SET title = 'edited' WHERE organization_id = 2 AND id = $1",
        &[&ids[1].1],
    )
    .await
    .unwrap();
    let row = c.query_one(&by_id, &[&2i64, &ids[1].1]).await.unwrap();
    assert_eq!(row.get::<_, String>(0), "edited");

    // Inside a transaction on the cloud, reads stay there (they must see its writes).
    let marker = "SELECT title FROM documents WHERE organization_id = 2 AND title = 'in tx'";
    c.batch_execute(&format!(
        "BEGIN; UPDATE documents SET title = 'in tx' WHERE organization_id = 2 AND id = {}",
        ids[1].1
    ))
    .await
    .unwrap();
    let rows = c.simple_query(marker).await.unwrap();
    assert_eq!(
        rows.iter()
            .filter(|m| matches!(m, tokio_postgres::SimpleQueryMessage::Row(_)))
            .count(),
        1
    );
    assert_eq!(route_of(&proxy, "query", marker), "\"cloud\"");
    c.batch_execute("ROLLBACK").await.unwrap();

    // The client's settings reach the direct connection (a new one, after a SET).
    c.batch_execute("SET TimeZone = 'America/New_York'")
        .await
        .unwrap();
    let tz = "SELECT '2020-01-01 00:00:00+00'::timestamptz::text FROM documents WHERE organization_id = 2 LIMIT 1";
    let rows = c.simple_query(tz).await.unwrap();
    let text = rows
        .iter()
        .find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => r.get(0).map(str::to_owned),
            _ => None,
        })
        .unwrap();
    assert_eq!(text, "2019-12-31 19:00:00-05");
    assert_eq!(route_of(&proxy, "query", "2020-01-01"), "\"direct\"");

    // An error in the organization's database reaches the client; the session goes on.
    let e = c
        .simple_query("SELECT no_such_column FROM documents WHERE organization_id = 2")
        .await
        .unwrap_err();
    assert_eq!(crate::world::sqlstate(&e), "42703");

    // Pipelined: direct and cloud statements interleaved keep their order and answers.
    let (two, one) = ((2i64, ids[1].1), (1i64, ids[0].1));
    let p2: [&(dyn tokio_postgres::types::ToSql + Sync); 2] = [&two.0, &two.1];
    let p1: [&(dyn tokio_postgres::types::ToSql + Sync); 2] = [&one.0, &one.1];
    let p3: [&(dyn tokio_postgres::types::ToSql + Sync); 1] = [&two.0];
    let (a, b, d) = tokio::join!(
        c.query_one(&by_id, &p2),
        c.query_one(&by_id, &p1),
        c.query_one(
            "SELECT count(*) FROM document_versions WHERE organization_id = $1",
            &p3
        ),
    );
    assert_eq!(a.unwrap().get::<_, String>(0), "edited");
    assert!(b.unwrap().get::<_, String>(0).starts_with("doc "));
    assert_eq!(d.unwrap().get::<_, i64>(0), 100);
    drop(c);
    drop(proxy);
}

/// The direct path logs in as one role everywhere; a client whose own role may not read a
/// table in the cloud does not get to read it there either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_role_without_the_privilege_is_refused_as_in_the_cloud() {
    let (w, proxy) = direct_world(json!({}));
    w.cloud
        .psql(
            "app",
            "CREATE ROLE nosy LOGIN PASSWORD 'nosy-secret'; GRANT SELECT ON projects TO nosy;",
        )
        .unwrap();
    let c = nosy(&proxy).await;
    let sql = "SELECT count(*) FROM documents WHERE organization_id = 2 AND id > 0";
    let e = c.simple_query(sql).await.unwrap_err();
    assert_eq!(crate::world::sqlstate(&e), "42501", "{e:?}");
    assert_eq!(route_of(&proxy, "query", "AND id > 0"), "\"cloud\"");
    assert_eq!(org_ran(&w, sql), 0);
    // After a GRANT, a new session reads directly.
    w.cloud
        .psql("app", "GRANT SELECT ON documents TO nosy")
        .unwrap();
    let c = nosy(&proxy).await;
    assert_eq!(one_i64(&c.simple_query(sql).await.unwrap()), 100);
    assert_eq!(org_ran(&w, sql), 1);
    // A plain role's direct write: it may call the gate (schema lokadb_client), and needs
    // UPDATE in the cloud.
    let write =
        "UPDATE document_versions SET body = 'by nosy' WHERE organization_id = 2 AND id > 0";
    assert_eq!(
        crate::world::sqlstate(&c.batch_execute(write).await.unwrap_err()),
        "42501"
    );
    assert_eq!(org_ran(&w, write), 0);
    w.cloud
        .psql("app", "GRANT SELECT, UPDATE ON document_versions TO nosy")
        .unwrap();
    let c = nosy(&proxy).await;
    c.batch_execute(write).await.unwrap();
    assert_eq!(org_ran(&w, write), 1, "{}", proxy.output());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_organization_fails_only_its_own_statements() {
    // Without direct_pool a session keeps its direct connection between statements.
    let (mut w, proxy) = direct_world(json!({ "direct_pool": false }));
    let c2 = client(&proxy).await;
    let sql2 = "SELECT count(*) FROM documents WHERE organization_id = 2";
    assert_eq!(one_i64(&c2.simple_query(sql2).await.unwrap()), 100);
    drop(c2);
    // A session that keeps its (idle) direct connection across the outage.
    let kept = client(&proxy).await;
    assert_eq!(one_i64(&kept.simple_query(sql2).await.unwrap()), 100);

    // The agent goes away: organization 2's database cannot be reached at all.
    drop(w.agent.take());
    let c1 = client(&proxy).await;
    let c2 = client(&proxy).await;
    let sql1 = "SELECT count(*) FROM documents WHERE organization_id = 1";
    for _ in 0..3 {
        assert!(c2.simple_query(sql2).await.is_err());
        assert_eq!(one_i64(&c1.simple_query(sql1).await.unwrap()), 100);
    }
    assert!(
        proxy
            .output()
            .contains("the direct path to this organization's database failed")
            || proxy
                .output()
                .contains("lost the connection to organization 2"),
        "{}",
        proxy.output()
    );

    // The agent comes back: the session that kept an idle direct connection (closed by the
    // outage) gets a new one instead of an error, and a new session reads directly at once.
    let to = crate::tunnel_world::addrs(&w.relay).agents;
    w.agent = Some(crate::tunnel_world::start_agent(&w.certs, &w.org, to, &[]).unwrap());
    let sql = "SELECT count(*) FROM documents WHERE organization_id = 2 AND id > 0";
    let before = org_ran(&w, sql);
    assert_eq!(one_i64(&kept.simple_query(sql).await.unwrap()), 100);
    assert_eq!(org_ran(&w, sql) - before, 1, "{}", proxy.output());
    assert!(
        proxy
            .output()
            .contains("the direct connection was closed while idle"),
        "{}",
        proxy.output()
    );
    let fresh = client(&proxy).await;
    assert_eq!(one_i64(&fresh.simple_query(sql).await.unwrap()), 100);
    assert_eq!(org_ran(&w, sql) - before, 2, "{}", proxy.output());
}

/// A moved organization's database stopped (the database itself: its agent and the tunnel
/// stay up), on fdw+direct and then on fdw: organization 2's clients get errors for its
/// statements, direct reads and reads and writes through the cloud's postgres_fdw alike,
/// and their sessions go on; organization 1's clients, working all along on a session of
/// their own, get none; the proxy stays up and takes new sessions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_organization_database_fails_only_its_own_clients() {
    let (w, proxy) = direct_world(json!({}));
    let org2 = client(&proxy).await;
    let read2 = "SELECT count(*) FROM documents WHERE organization_id = 2";
    let write2 = "INSERT INTO document_versions (organization_id, document_id, body) \
                  SELECT 2, min(id), 'while stopped' FROM documents WHERE organization_id = 2";
    let read1 = "SELECT count(*) FROM documents WHERE organization_id = 1";
    assert_eq!(one_i64(&org2.simple_query(read2).await.unwrap()), 100);

    // Organization 1 works all along.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let org1 = client(&proxy).await;
    let worker = tokio::spawn({
        let stop = stop.clone();
        async move {
            let (mut ops, mut errors) = (0, Vec::new());
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                for sql in [
                    "SELECT count(*) FROM documents WHERE organization_id = 1",
                    "INSERT INTO document_versions (organization_id, document_id, body) \
                     SELECT 1, min(id), 'org 1 meanwhile' FROM documents WHERE organization_id = 1",
                ] {
                    match org1.simple_query(sql).await {
                        Ok(_) => ops += 1,
                        Err(e) => errors.push(format!("{sql}: {e}")),
                    }
                }
            }
            (ops, errors)
        }
    });

    // Fast shutdown (SIGINT) of organization 2's Postgres: its sessions end; then it
    // refuses connections.
    let pid = w.org.db.pid().expect("running") as libc::pid_t;
    // SAFETY: a plain syscall on the cluster this test started.
    unsafe { libc::kill(pid, libc::SIGINT) };
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::net::TcpStream::connect(w.org.db.addr()).is_ok() {
        assert!(Instant::now() < deadline, "organization 2's database stops");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for profile in ["fdw+direct", "fdw"] {
        w.cloud
            .psql(
                "app",
                &format!("UPDATE lokadb.org SET profile = '{profile}' WHERE id = '2'"),
            )
            .unwrap();
        for _ in 0..3 {
            for sql in [read2, write2] {
                let err = org2
                    .simple_query(sql)
                    .await
                    .expect_err(&format!("{profile}: {sql} fails"));
                // The server's error (the session is kept): a connection failure, naming
                // the organization's server.
                let db = err
                    .as_db_error()
                    .unwrap_or_else(|| panic!("{profile}: {sql}: {err}"));
                assert!(
                    db.code().code().starts_with("08") && db.message().contains("lokadb_org_2"),
                    "{profile}: {sql}: {db:?}"
                );
            }
            // The same session, for organization 1: answered.
            assert!(one_i64(&org2.simple_query(read1).await.unwrap()) >= 100);
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (ops, errors) = worker.await.unwrap();
    assert!(errors.is_empty(), "organization 1: {errors:#?}");
    assert!(ops > 0);
    // A new session is served.
    let fresh = client(&proxy).await;
    assert!(one_i64(&fresh.simple_query(read1).await.unwrap()) >= 100);
}

/// Django's patterns, as its PostgreSQL backend sends them (psycopg's extended protocol,
/// quoted names), for organization 2 on fdw+direct, then on fdw, and for organization 1 in
/// the cloud: the select_related feed, a get (by the organization and the key, and by the
/// primary key alone) and the count of the document's versions, a bulk insert returning
/// ids, a queryset update and a save() (which sets every column, the organization's too).
/// Each answers as the cloud answers the statement as written, and every write is seen
/// there; on fdw+direct the get and the count run in the organization's database.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn orm_patterns_answer_alike_through_every_profile() {
    use tokio_postgres::Row;
    const FEED: &str = r#"SELECT "documents"."id", "documents"."title", "projects"."id" FROM "documents" INNER JOIN "projects" ON ("documents"."project_id" = "projects"."id") WHERE "documents"."organization_id" = $1 ORDER BY "documents"."id" DESC LIMIT 20"#;
    const GET: &str = r#"SELECT "documents"."id", "documents"."title" FROM "documents" WHERE ("documents"."organization_id" = $1 AND "documents"."id" = $2) LIMIT 21"#;
    const GET_BY_PK: &str = r#"SELECT "documents"."id", "documents"."title" FROM "documents" WHERE "documents"."id" = $1 LIMIT 21"#;
    const VERSIONS: &str = r#"SELECT COUNT(*) AS "__count" FROM "document_versions" WHERE ("document_versions"."document_id" = $1 AND "document_versions"."organization_id" = $2)"#;
    const BULK: &str = r#"INSERT INTO "document_versions" ("organization_id", "document_id", "body") VALUES ($1, $2, $3), ($4, $5, $6), ($7, $8, $9) RETURNING "document_versions"."id""#;
    const UPDATE: &str = r#"UPDATE "documents" SET "title" = $1 WHERE ("documents"."organization_id" = $2 AND "documents"."id" = $3)"#;
    const SAVE: &str = r#"UPDATE "documents" SET "organization_id" = $1, "project_id" = $2, "title" = $3 WHERE "documents"."id" = $4"#;
    let (w, proxy) = direct_world(json!({}));
    let cloud = crate::world::connect(&w.cloud.superuser_dsn("app"))
        .await
        .unwrap();
    for (org, profile) in [(2i64, "fdw+direct"), (2, "fdw"), (1, "cloud")] {
        if org == 2 {
            w.cloud
                .psql(
                    "app",
                    &format!("UPDATE lokadb.org SET profile = '{profile}' WHERE id = '2'"),
                )
                .unwrap();
        }
        // A new session: the check at login routes it by the new profile.
        let c = client(&proxy).await;
        let direct = usize::from(profile == "fdw+direct");

        let feed = row_texts(c.query(FEED, &[&org]).await.unwrap());
        assert_eq!(feed.len(), 20, "{profile}");
        assert_eq!(
            feed,
            row_texts(cloud.query(FEED, &[&org]).await.unwrap()),
            "{profile}"
        );
        let id: i64 = feed[0].split('|').next().unwrap().parse().unwrap();

        let before = org_ran(&w, GET);
        let got = row_texts(c.query(GET, &[&org, &id]).await.unwrap());
        assert_eq!(got.len(), 1, "{profile}");
        assert_eq!(
            got,
            row_texts(cloud.query(GET, &[&org, &id]).await.unwrap()),
            "{profile}"
        );
        assert_eq!(
            org_ran(&w, GET) - before,
            direct,
            "{profile}: the get ran there"
        );
        let by_pk = row_texts(c.query(GET_BY_PK, &[&id]).await.unwrap());
        assert_eq!(by_pk, got, "{profile}");

        let before = org_ran(&w, VERSIONS);
        let count = |rows: Vec<Row>| rows[0].get::<_, i64>(0);
        let versions = count(c.query(VERSIONS, &[&id, &org]).await.unwrap());
        assert_eq!(
            org_ran(&w, VERSIONS) - before,
            direct,
            "{profile}: the count ran there"
        );
        assert_eq!(
            versions,
            count(cloud.query(VERSIONS, &[&id, &org]).await.unwrap()),
            "{profile}"
        );

        let bodies = [
            format!("{profile} a"),
            format!("{profile} b"),
            format!("{profile} c"),
        ];
        let ids = c
            .query(
                BULK,
                &[
                    &org, &id, &bodies[0], &org, &id, &bodies[1], &org, &id, &bodies[2],
                ],
            )
            .await
            .unwrap();
        assert_eq!(ids.len(), 3, "{profile}");
        assert_eq!(
            count(c.query(VERSIONS, &[&id, &org]).await.unwrap()),
            versions + 3,
            "{profile}"
        );
        assert_eq!(
            count(cloud.query(VERSIONS, &[&id, &org]).await.unwrap()),
            versions + 3,
            "{profile}"
        );

        let title = format!("updated on {profile}");
        assert_eq!(c.execute(UPDATE, &[&title, &org, &id]).await.unwrap(), 1);
        let seen = cloud
            .query_one(r#"SELECT title FROM documents WHERE id = $1"#, &[&id])
            .await
            .unwrap();
        assert_eq!(seen.get::<_, String>(0), title, "{profile}");
        let title = format!("saved on {profile}");
        let project = org * 10;
        assert_eq!(
            c.execute(SAVE, &[&org, &project, &title, &id])
                .await
                .unwrap(),
            1,
            "{profile}"
        );
        let seen = cloud
            .query_one(
                r#"SELECT title, organization_id FROM documents WHERE id = $1"#,
                &[&id],
            )
            .await
            .unwrap();
        assert_eq!(
            (seen.get::<_, String>(0), seen.get::<_, i64>(1)),
            (title, org),
            "{profile}"
        );
    }
}

/// Each row of an extended-protocol answer as its `bigint` and text columns joined by `|`.
fn row_texts(rows: Vec<tokio_postgres::Row>) -> Vec<String> {
    rows.iter()
        .map(|r| {
            (0..r.len())
                .map(|i| match r.columns()[i].type_().name() {
                    "int8" => r.get::<_, i64>(i).to_string(),
                    _ => r.get::<_, String>(i),
                })
                .collect::<Vec<_>>()
                .join("|")
        })
        .collect()
}

pub(crate) fn rows(msgs: &[tokio_postgres::SimpleQueryMessage]) -> Vec<String> {
    msgs.iter()
        .filter_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => r.get(0).map(str::to_owned),
            _ => None,
        })
        .collect()
}

/// The statements the organization's database logged from `from` on (bytes), but for
/// postgres_fdw's (the test's own reads through the cloud).
fn org_statements_since(w: &World, from: usize) -> Vec<String> {
    const FDW: &[&str] = &[
        "SET ",
        "START TRANSACTION ISOLATION LEVEL REPEATABLE READ",
        "<unnamed>: DECLARE c",
        "FETCH ",
        "CLOSE c",
        "COMMIT TRANSACTION",
    ];
    w.org.db.log_contents()[from..]
        .lines()
        .filter_map(|l| {
            l.split_once("LOG:  statement: ")
                .or_else(|| l.split_once("LOG:  execute "))
                .map(|(_, s)| s.to_owned())
        })
        .filter(|s| !FDW.iter().any(|f| s.starts_with(f)))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transactions_of_direct_reads_run_there_and_move_to_the_cloud_when_needed() {
    let (w, proxy) = direct_world(json!({}));
    let c = client(&proxy).await;
    let id: i64 = c
        .query_one(
            "SELECT min(id) FROM documents WHERE organization_id = 2",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let read = format!("SELECT title FROM documents WHERE organization_id = 2 AND id = {id}");
    // Warm the direct connection, so the log below is the transaction's alone.
    c.simple_query(&read).await.unwrap();

    // BEGIN, two reads, COMMIT: all in the organization's database, BEGIN sent with
    // the first read (the proxy answered it), nothing through the cloud.
    let mark = w.org.db.log_contents().len();
    c.batch_execute("BEGIN").await.unwrap();
    assert_eq!(rows(&c.simple_query(&read).await.unwrap()).len(), 1);
    let count = "SELECT count(*) FROM document_versions WHERE organization_id = 2";
    assert_eq!(rows(&c.simple_query(count).await.unwrap()), ["100"]);
    c.batch_execute("COMMIT").await.unwrap();
    let seen = org_statements_since(&w, mark);
    assert_eq!(seen, ["BEGIN", read.as_str(), count, "COMMIT"], "{seen:#?}");

    // A read, then a write: the transaction moves to the cloud; the write is its own, the
    // read after it sees it, and ROLLBACK undoes it.
    c.batch_execute("BEGIN").await.unwrap();
    assert_eq!(rows(&c.simple_query(&read).await.unwrap()).len(), 1);
    c.batch_execute(&format!(
        "UPDATE documents SET title = 'uncommitted' WHERE organization_id = 2 AND id = {id}"
    ))
    .await
    .unwrap();
    assert_eq!(rows(&c.simple_query(&read).await.unwrap()), ["uncommitted"]);
    c.batch_execute("ROLLBACK").await.unwrap();
    assert_ne!(rows(&c.simple_query(&read).await.unwrap()), ["uncommitted"]);
    // And COMMIT keeps it.
    c.batch_execute("BEGIN").await.unwrap();
    c.simple_query(&read).await.unwrap();
    c.batch_execute(&format!(
        "UPDATE documents SET title = 'committed' WHERE organization_id = 2 AND id = {id}"
    ))
    .await
    .unwrap();
    c.batch_execute("COMMIT").await.unwrap();
    assert_eq!(rows(&c.simple_query(&read).await.unwrap()), ["committed"]);

    // An error in a direct transaction: the statements after it fail as in Postgres
    // (25P02) until ROLLBACK; the session goes on.
    c.batch_execute("BEGIN").await.unwrap();
    let e = c
        .simple_query("SELECT no_such_column FROM documents WHERE organization_id = 2")
        .await
        .unwrap_err();
    assert_eq!(crate::world::sqlstate(&e), "42703");
    let e = c.simple_query("SELECT 1").await.unwrap_err();
    assert_eq!(crate::world::sqlstate(&e), "25P02");
    c.batch_execute("ROLLBACK").await.unwrap();
    assert_eq!(rows(&c.simple_query("SELECT 1").await.unwrap()), ["1"]);

    // In a failed direct transaction nothing but its end reaches the organization's
    // database: a multi-statement query that would write there fails with 25P02.
    c.batch_execute("BEGIN").await.unwrap();
    let e = c
        .simple_query("SELECT 1/0 FROM documents WHERE organization_id = 2")
        .await
        .unwrap_err();
    assert_eq!(crate::world::sqlstate(&e), "22012");
    let sneaky = format!(
        "ROLLBACK; UPDATE documents SET title = 'sneaky' WHERE organization_id = 2 AND id = {id}"
    );
    let e = c.batch_execute(&sneaky).await.unwrap_err();
    assert_eq!(crate::world::sqlstate(&e), "25P02", "{e:?}");
    c.batch_execute("ROLLBACK").await.unwrap();
    assert_eq!(org_ran(&w, "sneaky"), 0);
    assert_eq!(rows(&c.simple_query(&read).await.unwrap()), ["committed"]);

    // After an error, the transaction's end and what unwinds it reach it in either
    // protocol, as in Postgres: ROLLBACK TO a savepoint it does not have fails with 3B001
    // (a direct transaction has none: SAVEPOINT moves it to the cloud), an extended-protocol
    // COMMIT rolls it back. Nothing else rides along with a savepoint's name.
    for end in ["COMMIT", "ROLLBACK", "END"] {
        c.batch_execute("BEGIN").await.unwrap();
        let e = c
            .simple_query("SELECT 1/0 FROM documents WHERE organization_id = 2")
            .await
            .unwrap_err();
        assert_eq!(crate::world::sqlstate(&e), "22012");
        let e = c.query("ROLLBACK TO SAVEPOINT a", &[]).await.unwrap_err();
        assert_eq!(crate::world::sqlstate(&e), "3B001", "{e:?}");
        let e = c
            .simple_query("RELEASE a;DELETE/**/FROM/**/documents")
            .await
            .unwrap_err();
        assert_eq!(crate::world::sqlstate(&e), "25P02", "{e:?}");
        let e = c.simple_query("ROLLBACK TO a").await.unwrap_err();
        assert_eq!(crate::world::sqlstate(&e), "3B001", "{e:?}");
        c.query(end, &[]).await.unwrap();
        assert_eq!(
            rows(&c.simple_query(&read).await.unwrap()),
            ["committed"],
            "{end}"
        );
    }
    let n = c
        .simple_query("SELECT count(*) FROM documents WHERE organization_id = 2")
        .await
        .unwrap();
    assert_eq!(one_i64(&n), 100);
    assert_eq!(org_ran(&w, "DELETE/**/FROM"), 0);
    // Savepoints in a direct transaction: it moves to the cloud, where they work.
    c.batch_execute("BEGIN").await.unwrap();
    c.simple_query(&read).await.unwrap();
    c.query("SAVEPOINT a", &[]).await.unwrap();
    let e = c
        .simple_query("SELECT 1/0 FROM documents WHERE organization_id = 2")
        .await
        .unwrap_err();
    assert_eq!(crate::world::sqlstate(&e), "22012");
    c.query("ROLLBACK TO SAVEPOINT a", &[]).await.unwrap();
    assert_eq!(rows(&c.simple_query(&read).await.unwrap()), ["committed"]);
    c.query("RELEASE SAVEPOINT a", &[]).await.unwrap();
    c.query("COMMIT", &[]).await.unwrap();

    // Unnamed statements in a transaction (psycopg 3's way): the direct reads stay there,
    // a read of a cloud table moves the transaction to the cloud.
    {
        use tokio_postgres::types::Type;
        c.batch_execute("BEGIN").await.unwrap();
        let q = "SELECT title FROM documents WHERE organization_id = $1 AND id = $2";
        for _ in 0..2 {
            let r = c
                .query_typed(q, &[(&2i64, Type::INT8), (&id, Type::INT8)])
                .await
                .unwrap();
            assert_eq!(r[0].get::<_, String>(0), "committed");
        }
        let p = c
            .query_typed(
                "SELECT count(*) FROM projects WHERE id = $1",
                &[(&20i64, Type::INT8)],
            )
            .await
            .unwrap();
        assert_eq!(p[0].get::<_, i64>(0), 1);
        let r = c
            .query_typed(q, &[(&2i64, Type::INT8), (&id, Type::INT8)])
            .await
            .unwrap();
        assert_eq!(r[0].get::<_, String>(0), "committed");
        c.batch_execute("COMMIT").await.unwrap();
    }

    // An empty transaction, and tokio-postgres' transaction API (extended protocol).
    c.batch_execute("BEGIN").await.unwrap();
    c.batch_execute("COMMIT").await.unwrap();
    let mut c = c;
    let by_id = c
        .prepare("SELECT title FROM documents WHERE organization_id = $1 AND id = $2")
        .await
        .unwrap();
    let tx = c.transaction().await.unwrap();
    let row = tx.query_one(&by_id, &[&2i64, &id]).await.unwrap();
    assert_eq!(row.get::<_, String>(0), "committed");
    let n: i64 = tx
        .query_one(
            "SELECT count(*) FROM documents WHERE organization_id = $1",
            &[&2i64],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(n, 100);
    // A write prepared inside the direct transaction (parsed there), then executed: the
    // transaction moves to the cloud, which parses the statement first.
    let rename = tx
        .prepare("UPDATE documents SET title = $3 WHERE organization_id = $1 AND id = $2")
        .await
        .unwrap();
    assert_eq!(
        tx.execute(&rename, &[&2i64, &id, &"in a moved transaction"])
            .await
            .unwrap(),
        1
    );
    let row = tx.query_one(&by_id, &[&2i64, &id]).await.unwrap();
    assert_eq!(row.get::<_, String>(0), "in a moved transaction");
    tx.commit().await.unwrap();
    let row = c.query_one(&by_id, &[&2i64, &id]).await.unwrap();
    assert_eq!(row.get::<_, String>(0), "in a moved transaction");
    assert_eq!(
        org_ran(
            &w,
            "SELECT count(*) FROM documents WHERE organization_id = $1"
        ),
        1,
        "the transaction ran in the organization's database"
    );

    // A client that changes transaction defaults gets no deferred BEGIN: its transactions
    // run on the cloud with its isolation level.
    c.batch_execute("SET default_transaction_isolation = 'repeatable read'")
        .await
        .unwrap();
    c.batch_execute("BEGIN").await.unwrap();
    assert_eq!(
        rows(&c.simple_query("SHOW transaction_isolation").await.unwrap()),
        ["repeatable read"]
    );
    c.simple_query(&read).await.unwrap();
    c.batch_execute("COMMIT").await.unwrap();
}

/// An UPDATE of columns the cloud keeps no constraint on, by a role that may, runs in the
/// organization's database, behind the cloud's gate: a pause holds it, and it never joins
/// a cloud transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn updates_of_unconstrained_columns_run_in_its_database_behind_the_pause() {
    let (w, proxy) = direct_world(json!({}));
    let c = client(&proxy).await;
    let id: i64 = c
        .query_one(
            "SELECT min(id) FROM document_versions WHERE organization_id = 2",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let body = |v: &str| {
        format!("UPDATE document_versions SET body = '{v}' WHERE organization_id = 2 AND id = {id}")
    };
    let read =
        format!("SELECT body FROM document_versions WHERE organization_id = 2 AND id = {id}");
    let cloud_read = || {
        w.cloud
            .psql(
                "app",
                &format!(
                    "SELECT body FROM document_versions WHERE organization_id = 2 AND id = {id}"
                ),
            )
            .unwrap()
    };

    // Autocommit: one statement in the organization's database.
    let mark = w.org.db.log_contents().len();
    c.batch_execute(&body("direct 1")).await.unwrap();
    assert_eq!(
        org_statements_since(&w, mark),
        [body("direct 1")],
        "{}",
        proxy.output()
    );
    assert_eq!(cloud_read(), "direct 1", "the cloud reads it through fdw");

    // In a transaction: BEGIN goes with the UPDATE, the read sees it, COMMIT keeps it.
    let mark = w.org.db.log_contents().len();
    c.batch_execute("BEGIN").await.unwrap();
    c.batch_execute(&body("direct 2")).await.unwrap();
    assert_eq!(rows(&c.simple_query(&read).await.unwrap()), ["direct 2"]);
    assert_eq!(cloud_read(), "direct 1", "not committed yet");
    c.batch_execute("COMMIT").await.unwrap();
    assert_eq!(cloud_read(), "direct 2");
    let seen = org_statements_since(&w, mark);
    assert_eq!(
        seen,
        ["BEGIN", body("direct 2").as_str(), read.as_str(), "COMMIT"],
        "{seen:#?}"
    );
    // ROLLBACK undoes it.
    c.batch_execute("BEGIN").await.unwrap();
    c.batch_execute(&body("rolled back")).await.unwrap();
    c.batch_execute("ROLLBACK").await.unwrap();
    assert_eq!(cloud_read(), "direct 2");

    // Unnamed statements (Parse, Bind, Execute, Sync in one batch, as psycopg 3 and JDBC
    // send them): the Parse is held until its Bind places it.
    use tokio_postgres::types::Type;
    let typed = "UPDATE document_versions SET body = $1 WHERE organization_id = $2 AND id = $3";
    let n = c
        .query_typed(
            typed,
            &[
                (&"typed", Type::TEXT),
                (&2i64, Type::INT8),
                (&id, Type::INT8),
            ],
        )
        .await
        .unwrap();
    assert!(n.is_empty());
    assert_eq!(cloud_read(), "typed");
    assert_eq!(org_ran(&w, typed), 1, "{}", w.org.db.log_contents());
    let typed_read = "SELECT body FROM document_versions WHERE organization_id = $1 AND id = $2";
    let r = c
        .query_typed(typed_read, &[(&2i64, Type::INT8), (&id, Type::INT8)])
        .await
        .unwrap();
    assert_eq!(r[0].get::<_, String>(0), "typed");
    assert_eq!(org_ran(&w, typed_read), 1);
    c.batch_execute(&body("direct 2")).await.unwrap();

    // A constrained column (project_id: a foreign key the cloud checks) goes through the
    // cloud.
    let title = "UPDATE documents SET project_id = 20 WHERE organization_id = 2 AND id IN (SELECT min(id) FROM documents WHERE organization_id = 2)";
    c.batch_execute(title).await.unwrap();
    assert_eq!(org_ran(&w, title), 0);

    // A transaction that wrote directly and then needs the cloud moves there (`mixed.rs`);
    // ROLLBACK undoes both writes.
    c.batch_execute("BEGIN").await.unwrap();
    c.batch_execute(&body("mixed")).await.unwrap();
    c.batch_execute(title).await.unwrap();
    assert_eq!(rows(&c.simple_query(&read).await.unwrap()), ["mixed"]);
    c.batch_execute("ROLLBACK").await.unwrap();
    assert_eq!(cloud_read(), "direct 2");

    // A pause holds a direct write until resume; reads go on.
    ok(&lokadb(&w.dsn, &["pause", "2", "--timeout", "20s"]));
    let dsn = format!(
        "host=127.0.0.1 port={} user={} password={} dbname=app",
        proxy.port(),
        lokadb_tests::pg::SUPERUSER,
        lokadb_tests::pg::SUPERUSER_PASSWORD
    );
    let writer = crate::world::timed_write(&dsn, Box::leak(body("after pause").into_boxed_str()));
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !writer.is_finished(),
        "the direct write did not wait for the pause"
    );
    assert_eq!(rows(&c.simple_query(&read).await.unwrap()), ["direct 2"]);
    ok(&lokadb(&w.dsn, &["resume", "2"]));
    let waited = writer.await.unwrap();
    assert!(waited >= Duration::from_millis(400), "{waited:?}");
    assert_eq!(cloud_read(), "after pause");
    assert!(org_ran(&w, &body("after pause")) == 1, "it ran directly");
}

/// A new connection is routed by the cloud's current metadata: one made right after the
/// profile changed routes by the change (the check at login waits for the new generation).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_connection_routes_by_the_clouds_current_metadata() {
    let (w, proxy) = direct_world(json!({}));
    for (profile, direct) in [
        ("fdw", false),
        ("fdw+direct", true),
        ("fdw", false),
        ("fdw+direct", true),
    ] {
        w.cloud
            .psql(
                "app",
                &format!("UPDATE lokadb.org SET profile = '{profile}' WHERE id = '2'"),
            )
            .unwrap();
        let c = client(&proxy).await;
        let q = format!(
            "SELECT count(*) FROM documents WHERE organization_id = 2 AND '{profile}' <> ''"
        );
        let before = org_ran(&w, &q);
        assert_eq!(one_i64(&c.simple_query(&q).await.unwrap()), 100);
        assert_eq!(org_ran(&w, &q) - before, usize::from(direct), "{profile}");
    }
}

/// With `meta_cache.verify`, a new connection of the same role on the same core within the
/// interval reuses another's check (the documented trade-off: a REVOKE reaches it that much
/// later).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn meta_cache_verify_lets_new_connections_reuse_a_recent_check() {
    let (w, proxy) = direct_world_env(
        json!({ "meta_cache": { "verify": "60s" } }),
        &[("LOKADB_CORES", "1")],
    );
    w.cloud
        .psql(
            "app",
            "CREATE ROLE nosy LOGIN PASSWORD 'nosy-secret'; GRANT SELECT ON documents TO nosy;",
        )
        .unwrap();
    let sql = "SELECT count(*) FROM documents WHERE organization_id = 2 AND id > 1";
    let c1 = nosy(&proxy).await;
    assert_eq!(one_i64(&c1.simple_query(sql).await.unwrap()), 99);
    assert_eq!(org_ran(&w, sql), 1);
    w.cloud
        .psql("app", "REVOKE SELECT ON documents FROM nosy")
        .unwrap();
    let c2 = nosy(&proxy).await;
    assert_eq!(one_i64(&c2.simple_query(sql).await.unwrap()), 99);
    assert_eq!(
        org_ran(&w, sql),
        2,
        "the second connection reused the check"
    );
    // Through the cloud the REVOKE holds at once.
    let e = c2
        .simple_query("SELECT count(*) FROM documents WHERE organization_id = 1")
        .await
        .unwrap_err();
    assert_eq!(crate::world::sqlstate(&e), "42501");
}

/// SIGTERM lets a transaction the proxy began itself (a deferred BEGIN, then direct
/// statements) finish like any other, then the proxy exits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_lets_a_direct_transaction_finish() {
    let (w, mut proxy) = direct_world(json!({}));
    let c = client(&proxy).await;
    let held = client(&proxy).await;
    let read = "SELECT count(*) FROM documents WHERE organization_id = 2 AND id > 2";
    c.batch_execute("BEGIN").await.unwrap();
    assert_eq!(one_i64(&c.simple_query(read).await.unwrap()), 99);
    // Only a BEGIN, answered by the proxy: the client is in a transaction too.
    held.batch_execute("BEGIN").await.unwrap();
    proxy.sigterm();
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(one_i64(&c.simple_query(read).await.unwrap()), 99);
    c.batch_execute("COMMIT").await.unwrap();
    held.batch_execute("COMMIT").await.unwrap();
    assert_eq!(org_ran(&w, read), 2);
    let status = proxy
        .wait_exit(Duration::from_secs(10))
        .expect("the proxy exits");
    assert!(status.success(), "{status:?}");
}

/// The queries postgres_fdw declared in the organization's database from `from` on (bytes
/// of its log), once one is there (the log may trail the answer) and its transaction ended.
fn remote_queries(w: &World, from: usize) -> Vec<String> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let log = w.org.db.log_contents();
        let tail = &log[from..];
        if (tail.contains("CURSOR FOR") && tail.contains("COMMIT TRANSACTION"))
            || Instant::now() > deadline
        {
            return tail
                .split("CURSOR FOR\n")
                .skip(1)
                .map(|rest| rest.lines().next().unwrap_or_default().trim().to_owned())
                .collect();
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The rows of a query as text, every column joined by `|`.
fn all_rows(msgs: &[tokio_postgres::SimpleQueryMessage]) -> Vec<String> {
    msgs.iter()
        .filter_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => Some(
                (0..r.len())
                    .map(|i| r.get(i).unwrap_or("NULL"))
                    .collect::<Vec<_>>()
                    .join("|"),
            ),
            _ => None,
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_orm_feed_joined_with_cloud_tables_is_ordered_and_limited_in_the_organizations_database()
{
    let (w, proxy) = direct_world(json!({}));
    let c = client(&proxy).await;
    let cloud = crate::world::connect(&w.cloud.superuser_dsn("app"))
        .await
        .unwrap();

    // Django's select_related feed on a nullable foreign key (LEFT OUTER JOIN), extended
    // protocol, the organization bound: the same rows as the cloud gives the statement as
    // written, and the organization's database sorts and limits.
    let feed = r#"SELECT "documents"."id", "documents"."title", "projects"."id" FROM "documents" LEFT OUTER JOIN "projects" ON ("documents"."project_id" = "projects"."id") WHERE "documents"."organization_id" = $1 ORDER BY "documents"."id" DESC LIMIT 3"#;
    let log_from = w.org.db.log_contents().len();
    let got = row_texts(c.query(feed, &[&2i64]).await.unwrap());
    let sent = remote_queries(&w, log_from);
    assert_eq!(got.len(), 3);
    assert_eq!(got, row_texts(cloud.query(feed, &[&2i64]).await.unwrap()));
    assert_eq!(route_of(&proxy, "prepare", "LEFT OUTER JOIN"), "\"cloud\"");
    assert!(
        matches!(sent.as_slice(), [q] if q.contains("ORDER BY id DESC")),
        "{sent:#?}"
    );

    // An inner join on the table's NOT NULL foreign key to a cloud table, simple protocol,
    // ordered by a column without an index, with OFFSET, the planner kept from nested
    // loops (as with many rows).
    let inner = "SELECT d.id, d.title, o.id FROM documents d JOIN organizations o ON o.id = d.organization_id WHERE d.organization_id = 2 ORDER BY d.title DESC LIMIT 4 OFFSET 2";
    for s in [&c, &cloud] {
        s.batch_execute("SET enable_nestloop = off").await.unwrap();
    }
    let log_from = w.org.db.log_contents().len();
    let got = all_rows(&c.simple_query(inner).await.unwrap());
    let sent = remote_queries(&w, log_from);
    assert_eq!(got.len(), 4);
    assert_eq!(got, all_rows(&cloud.simple_query(inner).await.unwrap()));
    assert!(
        matches!(sent.as_slice(), [q] if q.contains("ORDER BY title DESC")),
        "{sent:#?}"
    );
    assert!(proxy
        .output()
        .lines()
        .any(|l| l.contains("rewritten=\"true\"") && l.contains("ORDER BY d.title")));

    // An inner join on a nullable foreign key could drop rows after the limit: as written.
    let nullable = "SELECT d.id, p.id FROM documents d JOIN projects p ON p.id = d.project_id WHERE d.organization_id = 2 ORDER BY d.id LIMIT 2";
    let got = all_rows(&c.simple_query(nullable).await.unwrap());
    assert_eq!(got, all_rows(&cloud.simple_query(nullable).await.unwrap()));
    assert!(proxy
        .output()
        .lines()
        .any(|l| l.contains("rewritten=\"false\"") && l.contains("JOIN projects p ON")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn direct_connections_are_shared_between_transactions_under_direct_max() {
    // One connection to organization 2 per core (2 over 2 cores) for six clients.
    let (w, proxy) = direct_world(json!({ "direct_pool": true, "direct_max": 2 }));
    let port = proxy.port();
    // Every client names its statement "feed", each with its own text: a client that gets a
    // connection another one used since must parse its own there again before running it.
    let mut tasks = Vec::new();
    for k in 0..6i64 {
        tasks.push(tokio::spawn(async move {
            let mut c = Raw::connect(port).await;
            let sql = format!(
                "SELECT {k}::bigint + count(*) * 0 FROM documents WHERE organization_id = 2"
            );
            for round in 0..30 {
                let got =
                    tokio::time::timeout(Duration::from_secs(20), c.run("feed", &sql, round == 0))
                        .await
                        .unwrap_or_else(|_| panic!("client {k}, round {round}: no answer"));
                assert_eq!(got, vec![k.to_string()], "client {k}, round {round}");
                if round % 3 == 0 {
                    // A transaction keeps its connection to its end.
                    let tx = async {
                        c.send(&simple("BEGIN")).await;
                        while c.message().await.0 != b'Z' {}
                        let a = c.run("feed", &sql, false).await;
                        let b = c.run("feed", &sql, false).await;
                        c.send(&simple("COMMIT")).await;
                        while c.message().await.0 != b'Z' {}
                        (a, b)
                    };
                    let (a, b) = tokio::time::timeout(Duration::from_secs(20), tx)
                        .await
                        .unwrap_or_else(|_| panic!("client {k}, round {round}: transaction stuck"));
                    assert_eq!((a, b), (vec![k.to_string()], vec![k.to_string()]));
                }
            }
            c
        }));
    }
    let mut kept = Vec::new();
    for t in tasks {
        match t.await {
            Ok(c) => kept.push(c),
            Err(e) => panic!("{e}\n{}", proxy.output()),
        }
    }
    // Every statement ran in organization 2's database, over at most two connections.
    let org = crate::world::connect(&format!(
        "host=127.0.0.1 port={} user={APP_USER} password={APP_PASSWORD} dbname={ORG_DB}",
        w.org.db.port()
    ))
    .await
    .unwrap();
    let direct: i64 = org
        .query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
             AND backend_type = 'client backend' AND pid <> pg_backend_pid() \
             AND application_name NOT IN ('postgres_fdw', 'lokadb resolver')",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!((1..=2).contains(&direct), "{direct} direct connections");
    let ran = w
        .org
        .db
        .log_contents()
        .matches("::bigint + count(*) * 0 FROM documents")
        .count();
    // 50 runs per client, but the first: its Bind comes in the batch of the Parse, which
    // named statements leave on the cloud.
    assert_eq!(
        ran,
        6 * 49,
        "statements logged in organization 2's database"
    );
    drop(kept);
}

/// The smallest id of organization `org`'s documents, read straight from the cloud.
pub(crate) async fn first_document(cloud: &tokio_postgres::Client, org: i64) -> i64 {
    cloud
        .query_one(
            "SELECT min(id) FROM documents WHERE organization_id = $1",
            &[&org],
        )
        .await
        .unwrap()
        .get(0)
}

fn simple(sql: &str) -> Vec<u8> {
    let mut out = bytes::BytesMut::new();
    postgres_protocol::message::frontend::query(sql, &mut out).unwrap();
    out.to_vec()
}

/// The direct world with a client through the proxy, one straight at the cloud, and the
/// first document of organizations 1 and 2.
struct KeyWorld {
    w: World,
    proxy: Proxy,
    c: tokio_postgres::Client,
    cloud: tokio_postgres::Client,
    id1: i64,
    id2: i64,
}

async fn key_world(db: Value) -> KeyWorld {
    let (w, proxy) = direct_world(db);
    let c = client(&proxy).await;
    let cloud = crate::world::connect(&w.cloud.superuser_dsn("app"))
        .await
        .unwrap();
    let (id1, id2) = (
        first_document(&cloud, 1).await,
        first_document(&cloud, 2).await,
    );
    KeyWorld {
        w,
        proxy,
        c,
        cloud,
        id1,
        id2,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lookup_by_primary_key_touches_only_the_keys_organization() {
    let KeyWorld {
        w,
        proxy,
        c,
        cloud,
        id1,
        id2,
    } = key_world(json!({})).await;
    let get = r#"SELECT "documents"."id", "documents"."organization_id" FROM "documents" WHERE "documents"."id" = $1 LIMIT 21"#;

    // Straight at the cloud, a lookup of organization 1's row asks organization 2's database
    // too (every partition is scanned).
    let from = w.org.db.log_contents().len();
    let row = cloud.query_one(get, &[&id1]).await.unwrap();
    assert_eq!(row.get::<_, i64>(1), 1);
    assert_eq!(remote_queries(&w, from).len(), 1, "the cloud as written");

    // Through the proxy the key's organization is added: organization 2's database hears
    // nothing of it, and the row is the same.
    let before = w.org.db.log_contents().len();
    let row = c.query_one(get, &[&id1]).await.unwrap();
    assert_eq!((row.get::<_, i64>(0), row.get::<_, i64>(1)), (id1, 1));
    let update = "UPDATE documents SET title = 'by key' WHERE id = $1";
    assert_eq!(c.execute(update, &[&id1]).await.unwrap(), 1);
    assert_eq!(
        c.execute("SELECT 1 FROM documents WHERE id = $1", &[&-5i64])
            .await
            .unwrap(),
        0,
        "a key no organization has"
    );
    std::thread::sleep(Duration::from_millis(300));
    let heard = &w.org.db.log_contents()[before..];
    assert!(
        !heard.contains("DECLARE"),
        "organization 2 was asked:\n{heard}"
    );
    assert!(proxy
        .output()
        .lines()
        .any(|l| l.contains("org=key") && l.contains("rewritten=\"true\"")));

    // Organization 2's row is read from its database, and updated and deleted there.
    let row = c.query_one(get, &[&id2]).await.unwrap();
    assert_eq!((row.get::<_, i64>(0), row.get::<_, i64>(1)), (id2, 2));
    assert_eq!(c.execute(update, &[&id2]).await.unwrap(), 1);
    let title: String = cloud
        .query_one("SELECT title FROM documents WHERE id = $1", &[&id2])
        .await
        .unwrap()
        .get(0);
    assert_eq!(title, "by key");
    let delete = r#"DELETE FROM "document_versions" WHERE "document_versions"."id" IN ($1)"#;
    let version: i64 = cloud
        .query_one(
            "SELECT min(id) FROM document_versions WHERE organization_id = 1",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(c.execute(delete, &[&version]).await.unwrap(), 1);

    // The lookup fails loudly, never answers "no organization", for a key map not in use
    // and for a table that got row-level security after the proxy loaded its metadata.
    let state = |e: tokio_postgres::Error| e.code().map(|c| c.code().to_owned());
    let e = cloud
        .query_one("SELECT lokadb_client.key_org('km_nope', 1::bigint)", &[])
        .await
        .unwrap_err();
    assert_eq!(state(e).as_deref(), Some("55000"));
    cloud
        .batch_execute("ALTER TABLE documents ENABLE ROW LEVEL SECURITY")
        .await
        .unwrap();
    let e = c.query_one(get, &[&id1]).await.unwrap_err();
    assert_eq!(state(e).as_deref(), Some("55000"));
    cloud
        .batch_execute("ALTER TABLE documents DISABLE ROW LEVEL SECURITY")
        .await
        .unwrap();
    assert_eq!(c.query(get, &[&id1]).await.unwrap().len(), 1);
}

/// A read placed by a key alone (an ORM's get by primary key, no organization condition):
/// the proxy asks the cloud's key map whose key it is, and a direct organization's row is
/// read from its database, the client's own text; another organization's key, a key no row
/// has, a write by key and a session with `direct_key_lookup` off go through the cloud.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_by_key_of_a_direct_organization_runs_in_its_database() {
    let KeyWorld {
        w,
        proxy,
        c,
        cloud,
        id1,
        id2,
    } = key_world(json!({})).await;
    // The cloud logs statements of sessions that start now: the lookups are counted.
    cloud
        .batch_execute("ALTER DATABASE app SET log_statement = 'all'")
        .await
        .unwrap();
    // A new backend (the first client's stays busy with it): the setting applies.
    let (c, _first) = (client(&proxy).await, c);
    // (The cloud's log is read once the statement after the lookup ran: it is written.)
    let lookups = || {
        w.cloud
            .log_contents()
            .matches("SELECT lokadb_client.key_org('km_documents_id', CAST('")
            .count()
    };

    // Simple protocol: organization 2's database runs the client's text, after one lookup.
    let by_key = |id: i64| format!("SELECT id, organization_id FROM documents WHERE id = {id}");
    let sql = by_key(id2);
    let rows = c.simple_query(&sql).await.unwrap();
    assert_eq!(all_rows(&rows), vec![format!("{id2}|2")]);
    assert_eq!(org_ran(&w, &sql), 1, "{}", w.org.db.log_contents());
    assert_eq!(route_of(&proxy, "query", &sql), "\"direct\"");
    assert_eq!(lookups(), 1, "one lookup per read");
    // Organization 1's key, and a key no row has: through the cloud, same answers.
    let sql1 = by_key(id1);
    let rows = c.simple_query(&sql1).await.unwrap();
    assert_eq!(all_rows(&rows), vec![format!("{id1}|1")]);
    assert_eq!(org_ran(&w, &sql1), 0);
    assert_eq!(route_of(&proxy, "query", &sql1), "\"cloud\"");
    assert_eq!(lookups(), 2);
    let none = by_key(-5);
    assert!(all_rows(&c.simple_query(&none).await.unwrap()).is_empty());
    assert_eq!(route_of(&proxy, "query", &none), "\"cloud\"");
    // A key too long to be one is not asked for.
    let long = format!("SELECT id FROM documents WHERE id = '{}'", "9".repeat(2000));
    assert!(
        c.simple_query(&long).await.is_err(),
        "out of range for bigint"
    );
    assert_eq!(lookups(), 3);

    // The extended protocol, a named statement with a binary bigint, then an unnamed one
    // with a typed parameter: organization 2's key there, organization 1's through the cloud.
    let get = "SELECT organization_id, title FROM documents WHERE id = $1";
    let stmt = c.prepare(get).await.unwrap();
    let ran = |w: &World| w.org.db.log_contents().matches(get).count();
    let before = ran(&w);
    let row = c.query_one(&stmt, &[&id2]).await.unwrap();
    assert_eq!(row.get::<_, i64>(0), 2);
    assert!(ran(&w) > before, "organization 2's database ran it");
    let before = ran(&w);
    let row = c.query_one(&stmt, &[&id1]).await.unwrap();
    assert_eq!(row.get::<_, i64>(0), 1);
    assert_eq!(
        ran(&w),
        before,
        "organization 1's key went through the cloud"
    );
    let typed = "SELECT title FROM documents WHERE id = $1 AND title IS NOT NULL";
    for (id, org_db) in [(id2, 1), (id1, 0)] {
        let before = w.org.db.log_contents().matches(typed).count();
        let rows = c
            .query_typed(typed, &[(&id, tokio_postgres::types::Type::INT8)])
            .await
            .unwrap();
        assert_eq!(rows.len(), 1);
        let after = w.org.db.log_contents().matches(typed).count();
        assert_eq!(after - before, org_db, "key {id}");
    }

    // In a transaction of organization 2's reads: direct, BEGIN sent with it.
    c.batch_execute("BEGIN").await.unwrap();
    let tx = format!("SELECT title FROM documents WHERE id = {id2} AND true");
    c.simple_query(&tx).await.unwrap();
    c.batch_execute("COMMIT").await.unwrap();
    assert_eq!(org_ran(&w, &tx), 1);

    // A write by key stays on the cloud (through postgres_fdw), the right row changed.
    let update = format!("UPDATE documents SET title = 'keyed' WHERE id = {id2}");
    assert_eq!(c.execute(update.as_str(), &[]).await.unwrap(), 1);
    assert_eq!(org_ran(&w, &update), 0);
    let title: String = cloud
        .query_one("SELECT title FROM documents WHERE id = $1", &[&id2])
        .await
        .unwrap()
        .get(0);
    assert_eq!(title, "keyed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_direct_key_lookup_off_a_read_by_key_goes_through_the_cloud() {
    let KeyWorld {
        w, proxy, c, id2, ..
    } = key_world(json!({ "direct_key_lookup": false })).await;
    let sql = format!("SELECT id, organization_id FROM documents WHERE id = {id2}");
    let rows = c.simple_query(&sql).await.unwrap();
    assert_eq!(all_rows(&rows), vec![format!("{id2}|2")]);
    assert_eq!(route_of(&proxy, "query", &sql), "\"cloud\"");
    assert_eq!(org_ran(&w, &sql), 0);
}

/// The client's unnamed statement on the cloud outlives what the proxy sends there as a
/// simple query of its own (a key-map lookup, a deferred BEGIN), which destroys it: a Bind of
/// it without a new Parse still finds it (the proxy parses it again first).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_clients_unnamed_statement_outlives_the_proxys_own_queries() {
    use crate::statement_org::answers;
    use lokadb_shared::wire::frontend;
    let KeyWorld {
        w: _world,
        proxy,
        id2,
        ..
    } = key_world(json!({})).await;
    let mut raw = Raw::connect(proxy.port()).await;
    let query = |sql: &str| {
        let mut out = Vec::new();
        frontend::query(&mut out, sql);
        out
    };
    // A Bind of the unnamed statement for organization 1 (the cloud's), run, synced.
    let mut run = Vec::new();
    frontend::bind_text(&mut run, "", &[Some("1")]);
    frontend::execute(&mut run);
    frontend::sync(&mut run);
    let rows = |got: Vec<String>| -> Vec<String> {
        got.into_iter().filter(|m| m.starts_with("D=")).collect()
    };
    let mut out = Vec::new();
    frontend::parse(
        &mut out,
        "",
        "SELECT count(*)::text FROM documents WHERE organization_id = $1",
    );
    out.extend_from_slice(&run);
    let first = rows(answers(&mut raw, &out).await);
    assert_eq!(first.len(), 1);

    // A read by organization 2's key (the lookup goes to the cloud first), then a deferred
    // BEGIN sent with the Bind: the Bind finds the statement each time.
    let by_key = format!("SELECT id::text FROM documents WHERE id = {id2}");
    assert_eq!(
        rows(answers(&mut raw, &query(&by_key)).await),
        vec![format!("D={id2}")]
    );
    assert_eq!(rows(answers(&mut raw, &run).await), first);
    assert_eq!(answers(&mut raw, &query("BEGIN")).await, vec!["C", "Z"]);
    assert_eq!(rows(answers(&mut raw, &run).await), first);
    assert_eq!(answers(&mut raw, &query("COMMIT")).await, vec!["C", "Z"]);
}

/// A Bind's organization is read by the type its Parse declared (else the column's), never
/// by its length: integers of every width go direct; a float8 bound in binary (8 bytes, which
/// the length rule read as a bigint) is not read and goes through the cloud, with the same
/// answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bound_organization_is_read_by_its_declared_type() {
    use tokio_postgres::types::{ToSql, Type};
    let (w, proxy) = direct_world(json!({}));
    let c = client(&proxy).await;
    let sql = "SELECT count(*) FROM documents WHERE organization_id = $1";
    let cases: [(&(dyn ToSql + Sync), Type, usize); 4] = [
        (&2i16, Type::INT2, 1),
        (&2i32, Type::INT4, 1),
        (&2i64, Type::INT8, 1),
        (&2f64, Type::FLOAT8, 0),
    ];
    for (value, ty, direct) in cases {
        let before = w.org.db.log_contents().matches(sql).count();
        let rows = c.query_typed(sql, &[(value, ty.clone())]).await.unwrap();
        assert_eq!(rows[0].get::<_, i64>(0), 100, "{ty}");
        let after = w.org.db.log_contents().matches(sql).count();
        assert_eq!(
            after - before,
            direct,
            "{ty}: ran in organization 2's database"
        );
    }
}
