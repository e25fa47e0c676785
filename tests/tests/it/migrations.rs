//! The application's migrations once organizations have moved (docs/migrations.md):
//! organization 1 in the cloud, 2 moved with fdw, 3 with fdw+direct, each behind the real
//! relay and its agent. The application's own role `app` owns the tables and migrates
//! through the proxy; every moved organization's table follows the cloud's, or nothing
//! changes anywhere.

use crate::admin_cli::{lokadb, ok, stderr, stdout};
use crate::admin_enable::SCHEMA;
use crate::moves::org_db;
use crate::tunnel_world::{
    addrs, org_add, start_agent, start_relay, token_hash, Certs, Org, APP_PASSWORD, APP_USER,
    ORG_DB,
};
use lokadb_tests::agent::Agent;
use lokadb_tests::pg::Cluster;
use lokadb_tests::proxy::Proxy;
use serde_json::json;
use std::time::{Duration, Instant};

struct World {
    certs: Certs,
    relay: Proxy,
    /// Organizations 2 and 3.
    orgs: Vec<Org>,
    agents: Vec<Option<Agent>>,
    cloud: Cluster,
    /// The cloud as its superuser (admin commands).
    dsn: String,
    proxy: Option<Proxy>,
    /// Organization 4 when the world has it: its database `orgdb4` is in organization 2's
    /// cluster, behind its own agent.
    shared: Option<Agent>,
}

/// The database of organization 4 ([`World::shared`]).
const SHARED_DB: &str = "orgdb4";

/// The moves world with two moved organizations and tables owned by `app`; with a proxy
/// (its direct path configured) when `with_proxy`.
fn world(with_proxy: bool) -> World {
    world_with(with_proxy, true, false)
}

/// As [`world`]; organization 3 registered but left in the cloud unless `move_3`; with
/// `shared` a third moved organization whose database is in organization 2's Postgres cluster.
fn world_with(with_proxy: bool, move_3: bool, shared: bool) -> World {
    let certs = Certs::new().unwrap();
    let orgs = vec![org_db("2", false), org_db("3", false)];
    let token4 = format!("4.{:032x}", rand::random::<u128>());
    let mut tokens = serde_json::Map::new();
    for o in &orgs {
        tokens.insert(o.id.clone(), o.token_hash().into());
    }
    if shared {
        tokens.insert("4".into(), token_hash(&token4).into());
        orgs[0].db.create_database(SHARED_DB, APP_USER).unwrap();
    }
    let relay = start_relay(
        &certs,
        &[&orgs[0], &orgs[1]],
        json!({ "tokens": tokens }),
        &[],
    )
    .unwrap();
    let agents = orgs
        .iter()
        .map(|o| Some(start_agent(&certs, o, addrs(&relay).agents, &[]).unwrap()))
        .collect();
    let shared = shared.then(|| {
        Agent::start(
            &[addrs(&relay).agents],
            &token4,
            orgs[0].db.addr(),
            &certs.files.ca,
            &[],
            &[],
        )
        .unwrap()
    });
    let cloud = Cluster::builder()
        .setting("max_connections", "100")
        .start()
        .unwrap();
    cloud.create_role(APP_USER, APP_PASSWORD).unwrap();
    cloud.create_database("app", APP_USER).unwrap();
    let dsn = cloud.superuser_dsn("app");
    ok(&lokadb(&dsn, &["init"]));
    cloud.psql("app", SCHEMA).unwrap();
    cloud
        .psql(
            "app",
            &format!(
                "INSERT INTO organizations VALUES (3);
                 INSERT INTO projects VALUES (30, 3);
                 INSERT INTO documents (organization_id, project_id, title)
                   SELECT 3, 30, 'doc ' || g FROM generate_series(1, 100) g;
                 ALTER TABLE organizations OWNER TO {APP_USER};
                 ALTER TABLE projects OWNER TO {APP_USER};
                 ALTER TABLE documents OWNER TO {APP_USER};
                 ALTER TABLE document_versions OWNER TO {APP_USER};
                 ALTER TABLE audit OWNER TO {APP_USER};"
            ),
        )
        .unwrap();
    ok(&lokadb(&dsn, &["enable", "documents"]));
    ok(&lokadb(&dsn, &["enable", "document_versions"]));
    let via = addrs(&relay).postgres.to_string();
    for o in &orgs {
        ok(&lokadb(
            &dsn,
            &org_add(&o.id, std::slice::from_ref(&via), &[]),
        ));
    }
    ok(&lokadb(&dsn, &["move-org", "2", "--profile", "fdw"]));
    if move_3 {
        ok(&lokadb(&dsn, &["move-org", "3", "--profile", "fdw+direct"]));
    }
    if shared.is_some() {
        cloud
            .psql(
                "app",
                "INSERT INTO organizations VALUES (4);
                 INSERT INTO projects VALUES (40, 4);
                 INSERT INTO documents (organization_id, project_id, title)
                   SELECT 4, 40, 'doc ' || g FROM generate_series(1, 10) g;",
            )
            .unwrap();
        ok(&lokadb(
            &dsn,
            &[
                "org",
                "add",
                "4",
                "--via-relay",
                &via,
                "--dbname",
                SHARED_DB,
                "--user",
                APP_USER,
                "--password",
                APP_PASSWORD,
            ],
        ));
        ok(&lokadb(&dsn, &["move-org", "4", "--profile", "fdw"]));
    }
    let moved = 1 + usize::from(move_3) + usize::from(shared.is_some());
    let proxy = with_proxy.then(|| crate::tunnel_world::direct_proxy(&cloud, moved));
    World {
        certs,
        relay,
        orgs,
        agents,
        cloud,
        dsn,
        proxy,
        shared,
    }
}

impl World {
    /// The application's role through the proxy.
    async fn app(&self) -> tokio_postgres::Client {
        let port = self.proxy.as_ref().expect("a proxy").port();
        crate::world::connect(&format!(
            "host=127.0.0.1 port={port} user={APP_USER} password={APP_PASSWORD} dbname=app"
        ))
        .await
        .unwrap()
    }

    fn cloud_q(&self, sql: &str) -> String {
        self.cloud.psql("app", sql).unwrap().trim().to_owned()
    }

    fn org_q(&self, i: usize, sql: &str) -> String {
        self.orgs[i].db.psql(ORG_DB, sql).unwrap().trim().to_owned()
    }

    /// Waits until no organization's database holds a prepared transaction.
    #[track_caller]
    fn settled(&self) {
        let deadline = Instant::now() + Duration::from_secs(15);
        for i in 0..self.orgs.len() {
            while self.org_q(i, "SELECT count(*) FROM pg_prepared_xacts") != "0" {
                assert!(
                    Instant::now() < deadline,
                    "organization {} keeps a prepared transaction: {}\n{}",
                    self.orgs[i].id,
                    self.org_q(i, "SELECT gid FROM pg_prepared_xacts"),
                    self.proxy.as_ref().map(Proxy::output).unwrap_or_default()
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
}

/// Columns (name, type, NOT NULL) and CHECK constraints of `documents`, as Postgres lists them.
const COLUMNS: &str = "SELECT string_agg(attname || ' ' || format_type(atttypid, atttypmod)
        || CASE WHEN attnotnull THEN ' not null' ELSE '' END, ', ' ORDER BY attname)
    FROM pg_attribute WHERE attrelid = 'documents'::regclass AND attnum > 0 AND NOT attisdropped";
const CHECKS: &str = "SELECT coalesce(string_agg(conname || ' ' || pg_get_constraintdef(oid), ', ' ORDER BY conname), '')
    FROM pg_constraint WHERE conrelid = 'documents'::regclass AND contype = 'c'";
/// Index definitions without their names and tables.
fn indexes(rels: &str) -> String {
    format!(
        "SELECT coalesce(string_agg(d, ', ' ORDER BY d), '') FROM (
           SELECT regexp_replace(pg_get_indexdef(indexrelid), '^CREATE (UNIQUE )?INDEX \\S+ ON (ONLY )?\\S+ ', 'CREATE \\1INDEX ON t ') AS d
           FROM pg_index WHERE {rels}) s"
    )
}
const NAMED_INDEXES: &str = "SELECT coalesce(string_agg(c.relname, ', ' ORDER BY c.relname), '')
    FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid WHERE i.indrelid = 'documents'::regclass AND NOT i.indisunique";

/// Every moved organization's `documents` has the cloud's columns, types, NOT NULL, checks and
/// indexes (the default partition's unique ones, the parent's others, by name), and no
/// defaults (writes through the cloud get the cloud's).
#[track_caller]
fn assert_same_shape(w: &World, step: &str) {
    w.settled();
    let cloud_indexes = w.cloud_q(&indexes(
        "indrelid = 'documents'::regclass OR (indrelid = 'documents__lokadb_default'::regclass AND indisunique)",
    ));
    for i in 0..w.orgs.len() {
        let org = &w.orgs[i].id;
        assert_eq!(
            w.org_q(i, COLUMNS),
            w.cloud_q(COLUMNS),
            "{step}: columns of organization {org}"
        );
        assert_eq!(
            w.org_q(i, CHECKS),
            w.cloud_q(CHECKS),
            "{step}: checks of organization {org}"
        );
        assert_eq!(
            w.org_q(i, &indexes("indrelid = 'documents'::regclass")),
            cloud_indexes,
            "{step}: indexes of organization {org}"
        );
        assert_eq!(
            w.org_q(i, NAMED_INDEXES),
            w.cloud_q(NAMED_INDEXES),
            "{step}: index names of organization {org}"
        );
        assert_eq!(
            w.org_q(
                i,
                "SELECT count(*) FROM pg_attrdef WHERE adrelid = 'documents'::regclass"
            ),
            "0",
            "{step}: organization {org}'s table has defaults"
        );
    }
}

/// The server's error that `sql`, as one migration transaction, fails with.
async fn migration_error(c: &tokio_postgres::Client, sql: &str) -> tokio_postgres::error::DbError {
    let e = migrate(c, sql).await.unwrap_err();
    e.as_db_error().unwrap_or_else(|| panic!("{e:?}")).clone()
}

/// `sql` as one transaction of the application's role through the proxy.
async fn migrate(c: &tokio_postgres::Client, sql: &str) -> Result<(), tokio_postgres::Error> {
    c.batch_execute("BEGIN").await?;
    if let Err(e) = c.batch_execute(sql).await {
        c.batch_execute("ROLLBACK").await.unwrap();
        return Err(e);
    }
    c.batch_execute("COMMIT").await
}

fn one(rows: &[tokio_postgres::SimpleQueryMessage]) -> String {
    rows.iter()
        .find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => {
                Some(r.get(0).unwrap_or("NULL").to_owned())
            }
            _ => None,
        })
        .expect("a row")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_migration_history_reaches_every_moved_organization() {
    let w = world(true);
    let app = w.app().await;
    assert_same_shape(&w, "after the moves");

    // The table's owner may alter it: every partition LokaDB made is the owner's.
    assert_eq!(
        w.cloud_q(
            "SELECT count(*) FROM pg_partition_tree('documents') p JOIN pg_class c ON c.oid = p.relid
             WHERE c.relowner <> 'app'::regrole"
        ),
        "0"
    );

    migrate(
        &app,
        "ALTER TABLE documents ADD COLUMN priority int NOT NULL DEFAULT 0",
    )
    .await
    .unwrap();
    assert_same_shape(&w, "ADD COLUMN with a default");
    for (org, project) in [(1, 10), (2, 20), (3, 30)] {
        let sql = format!(
            "SELECT count(*) FROM documents WHERE organization_id = {org} AND priority = 0"
        );
        assert_eq!(
            one(&app.simple_query(&sql).await.unwrap()),
            "100",
            "organization {org}"
        );
        app.simple_query(&format!(
            "INSERT INTO documents (organization_id, project_id, title, priority) VALUES ({org}, {project}, 'urgent', 5)"
        ))
        .await
        .unwrap();
        let sql = format!(
            "SELECT priority FROM documents WHERE organization_id = {org} AND title = 'urgent'"
        );
        assert_eq!(
            one(&app.simple_query(&sql).await.unwrap()),
            "5",
            "organization {org}"
        );
    }
    // Organization 3's read went to its own database, which has the column.
    assert_eq!(
        crate::direct::route_of(
            w.proxy.as_ref().unwrap(),
            "query",
            "organization_id = 3 AND title = 'urgent'"
        ),
        "\"direct\""
    );

    migrate(&app, "ALTER TABLE documents ADD COLUMN note text")
        .await
        .unwrap();
    assert_same_shape(&w, "ADD nullable COLUMN");
    migrate(
        &app,
        "UPDATE documents SET note = 'n' || id WHERE title = 'urgent'",
    )
    .await
    .unwrap();

    migrate(&app, "ALTER TABLE documents RENAME COLUMN note TO remark")
        .await
        .unwrap();
    assert_same_shape(&w, "RENAME COLUMN");
    for org in 1..=3 {
        // A rename keeps the values (it is not a drop and an add).
        let sql = format!(
            "SELECT count(*) FROM documents WHERE organization_id = {org} AND remark LIKE 'n%'"
        );
        assert_eq!(
            one(&app.simple_query(&sql).await.unwrap()),
            "1",
            "organization {org}"
        );
    }

    migrate(
        &app,
        "ALTER TABLE documents ALTER COLUMN priority TYPE bigint",
    )
    .await
    .unwrap();
    assert_same_shape(&w, "ALTER TYPE");

    migrate(
        &app,
        "ALTER TABLE documents ADD CONSTRAINT documents_priority_check CHECK (priority >= 0)",
    )
    .await
    .unwrap();
    assert_same_shape(&w, "ADD CHECK");
    for org in 1..=3 {
        let e = app
            .simple_query(&format!(
                "INSERT INTO documents (organization_id, title, priority) VALUES ({org}, 'negative', -1)"
            ))
            .await
            .unwrap_err();
        assert_eq!(
            crate::world::sqlstate(&e),
            "23514",
            "organization {org}: {e:?}"
        );
    }

    migrate(
        &app,
        "CREATE INDEX documents_priority_idx ON documents (priority, remark)",
    )
    .await
    .unwrap();
    assert_same_shape(&w, "CREATE INDEX");
    assert_eq!(
        w.org_q(
            1,
            "SELECT to_regclass('documents_priority_idx') IS NOT NULL"
        ),
        "t"
    );
    migrate(&app, "DROP INDEX documents_priority_idx")
        .await
        .unwrap();
    assert_same_shape(&w, "DROP INDEX");

    // Several changes in one transaction, with a swap of two names.
    migrate(
        &app,
        "ALTER TABLE documents ADD COLUMN a text; ALTER TABLE documents ADD COLUMN b text",
    )
    .await
    .unwrap();
    app.batch_execute("UPDATE documents SET a = 'a', b = 'b' WHERE title = 'urgent'")
        .await
        .unwrap();
    migrate(
        &app,
        "ALTER TABLE documents RENAME COLUMN a TO tmp;
         ALTER TABLE documents RENAME COLUMN b TO a;
         ALTER TABLE documents RENAME COLUMN tmp TO b;
         CREATE INDEX ON documents (b)",
    )
    .await
    .unwrap();
    assert_same_shape(&w, "a swap of two names and an index");
    for org in 1..=3 {
        let sql = format!(
            "SELECT a || b FROM documents WHERE organization_id = {org} AND title = 'urgent'"
        );
        assert_eq!(
            one(&app.simple_query(&sql).await.unwrap()),
            "ba",
            "organization {org}"
        );
    }

    migrate(
        &app,
        "ALTER TABLE documents DROP COLUMN remark, DROP COLUMN a, DROP COLUMN b",
    )
    .await
    .unwrap();
    assert_same_shape(&w, "DROP COLUMN");

    // A unique key with the organization column cannot be declared on the parent once a
    // partition is a foreign table: Postgres refuses it, and nothing changes.
    let e = migrate(
        &app,
        "ALTER TABLE documents ADD CONSTRAINT documents_org_priority_key UNIQUE (organization_id, id, priority)",
    )
    .await
    .unwrap_err();
    assert_eq!(crate::world::sqlstate(&e), "42809", "{e:?}");
    assert_same_shape(&w, "a refused unique key");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_organization_fails_the_migration_and_nothing_changes() {
    let mut w = world(true);
    let app = w.app().await;
    let before = (w.cloud_q(COLUMNS), w.org_q(0, COLUMNS), w.org_q(1, COLUMNS));
    w.agents[1].take().unwrap().kill();

    let db = migration_error(
        &app,
        "ALTER TABLE documents ADD COLUMN priority int NOT NULL DEFAULT 0",
    )
    .await;
    assert_eq!(db.code().code(), "08001", "{db:?}");
    assert!(
        db.message()
            .starts_with("migration not applied: organization 3 could not take it"),
        "{db:?}"
    );
    assert!(
        db.detail().unwrap_or_default().contains("organization 3: "),
        "{db:?}"
    );
    assert!(
        db.hint()
            .unwrap_or_default()
            .starts_with("Nothing was changed"),
        "{db:?}"
    );
    // Nothing changed: the cloud, organization 2 (prepared, then rolled back), organization 3.
    w.settled();
    assert_eq!(w.cloud_q(COLUMNS), before.0);
    assert_eq!(w.org_q(0, COLUMNS), before.1);
    assert_eq!(w.org_q(1, COLUMNS), before.2);
    // The session goes on.
    assert_eq!(
        one(&app
            .simple_query("SELECT count(*) FROM documents WHERE organization_id = 2")
            .await
            .unwrap()),
        "100"
    );

    // A conflict in one organization's database: the same.
    w.agents[1] = Some(start_agent(&w.certs, &w.orgs[1], addrs(&w.relay).agents, &[]).unwrap());
    w.agents[1]
        .as_ref()
        .unwrap()
        .wait_connected(Duration::from_secs(10))
        .unwrap();
    w.org_q(1, "ALTER TABLE documents ADD COLUMN priority text");
    let db = migration_error(
        &app,
        "ALTER TABLE documents ADD COLUMN priority int NOT NULL DEFAULT 0",
    )
    .await;
    assert_eq!(db.code().code(), "42701", "{db:?}");
    assert!(db.message().contains("organization 3"), "{db:?}");
    assert!(
        db.message()
            .contains("column \"priority\" of relation \"documents\" already exists"),
        "{db:?}"
    );
    w.settled();
    assert_eq!(w.cloud_q(COLUMNS), before.0);
    assert_eq!(w.org_q(0, COLUMNS), before.1);

    // Fixed, the migration goes through everywhere.
    w.org_q(1, "ALTER TABLE documents DROP COLUMN priority");
    migrate(
        &app,
        "ALTER TABLE documents ADD COLUMN priority int NOT NULL DEFAULT 0",
    )
    .await
    .unwrap();
    assert_same_shape(&w, "after the agent came back");
}

/// Without a proxy (migrations straight to the cloud): what the cloud committed is committed
/// in the organizations by `lokadb resolve`, what it rolled back after preparing is rolled back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prepared_migrations_are_settled_by_the_cloud_outcome() {
    let w = world(false);
    let app = w.cloud.client(APP_USER, APP_PASSWORD, "app").await.unwrap();
    let before = w.org_q(0, COLUMNS);

    // Committed in the cloud, prepared in the organizations, and nobody to finish it yet.
    migrate(
        &app,
        "ALTER TABLE documents ADD COLUMN priority int NOT NULL DEFAULT 0",
    )
    .await
    .unwrap();
    for i in 0..2 {
        assert_eq!(w.org_q(i, "SELECT count(*) FROM pg_prepared_xacts"), "1");
        assert_eq!(w.org_q(i, COLUMNS), before);
    }
    // The next migration finishes the one before it in each organization first (it holds the
    // table's locks there), whether a resolver ran or not.
    migrate(&app, "ALTER TABLE documents ADD COLUMN extra text")
        .await
        .unwrap();
    for i in 0..2 {
        assert_eq!(w.org_q(i, "SELECT count(*) FROM pg_prepared_xacts"), "1");
        assert!(w.org_q(i, COLUMNS).contains("priority integer not null"));
        assert!(!w.org_q(i, COLUMNS).contains("extra"));
    }
    let out = ok(&lokadb(&w.dsn, &["resolve"]));
    assert!(out.contains("2 committed, 0 rolled back"), "{out}");
    assert_same_shape(&w, "resolved after the cloud committed");
    assert_eq!(w.cloud_q("SELECT count(*) FROM lokadb.ddl_prepared"), "0");

    // The cloud's commit fails after the organizations prepared (a deferred constraint of the
    // application's that fires after LokaDB's).
    w.cloud_q(
        "CREATE TABLE late (x int);
         CREATE FUNCTION late_fail() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN RAISE EXCEPTION 'late failure' USING ERRCODE = '23514'; END $$;
         CREATE CONSTRAINT TRIGGER late_fail AFTER INSERT ON late DEFERRABLE INITIALLY DEFERRED
           FOR EACH ROW EXECUTE FUNCTION late_fail();
         ALTER TABLE late OWNER TO app;",
    );
    let e = migrate(
        &app,
        "ALTER TABLE documents ADD COLUMN note text; INSERT INTO late VALUES (1)",
    )
    .await
    .unwrap_err();
    assert_eq!(crate::world::sqlstate(&e), "23514", "{e:?}");
    let shape = w.org_q(0, COLUMNS);
    assert!(!shape.contains("note"), "{shape}");
    for i in 0..2 {
        assert_eq!(w.org_q(i, "SELECT count(*) FROM pg_prepared_xacts"), "1");
    }
    let out = stdout(&lokadb(&w.dsn, &["resolve"]));
    assert!(out.contains("0 committed, 2 rolled back"), "{out}");
    w.settled();
    assert_same_shape(&w, "rolled back after the cloud's commit failed");
    assert!(!w.cloud_q(COLUMNS).contains("note"));
}

/// Organizations whose databases share one Postgres cluster: each gets its own prepared
/// transaction (a gid is unique in a whole cluster, not per database).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn organizations_that_share_a_cluster_migrate_together() {
    let w = world_with(true, true, true);
    assert!(w.shared.is_some());
    let app = w.app().await;
    migrate(&app, "ALTER TABLE documents ADD COLUMN shared_note text")
        .await
        .unwrap();
    w.settled();
    assert_same_shape(&w, "ADD COLUMN, organizations 2 and 4 in one cluster");
    let in_4 = w.orgs[0]
        .db
        .psql(
            SHARED_DB,
            "SELECT count(*) FROM pg_attribute WHERE attrelid = 'documents'::regclass
               AND attname = 'shared_note' AND NOT attisdropped",
        )
        .unwrap();
    assert_eq!(in_4.trim(), "1", "organization 4's table did not follow");
    // Its rows are still there, read through the proxy.
    let n = app
        .simple_query("SELECT count(*) FROM documents WHERE organization_id = 4")
        .await
        .unwrap();
    assert_eq!(one(&n), "10");
}

/// `lokadb verify` compares each moved organization's tables with the cloud's: columns,
/// types, NOT NULL, checks, indexes; not defaults (organizations' tables have none).
#[test]
fn verify_reports_schema_differences() {
    let w = world(false);
    let out = ok(&lokadb(&w.dsn, &["verify"]));
    assert_eq!(out.matches("schema equal").count(), 4, "{out}");
    assert!(!out.contains("DIFFERS"), "{out}");

    // Changed by hand in organization 2's database.
    w.org_q(
        0,
        "ALTER TABLE documents ADD COLUMN extra int;
         ALTER TABLE documents ALTER COLUMN project_id SET NOT NULL;
         ALTER TABLE documents ADD CONSTRAINT documents_extra_check CHECK (extra > 0);
         ALTER INDEX documents_title_idx RENAME TO documents_title_idx2;
         CREATE INDEX documents_extra_idx ON documents (extra);
         ALTER TABLE document_versions ALTER COLUMN body TYPE varchar(20);",
    );
    for args in [&["verify", "2"][..], &["verify"][..]] {
        let o = lokadb(&w.dsn, args);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {}", stdout(&o));
        let text = crate::admin_cli::stderr(&o) + &stdout(&o);
        for want in [
            "column extra (integer) is in its database only",
            "column project_id is bigint in the cloud, bigint NOT NULL in its database",
            "check documents_extra_check (CHECK ((extra > 0))) is in its database only",
            "index documents_title_idx (USING btree (title)) is named documents_title_idx2 in its database",
            "index documents_extra_idx (USING btree (extra)) is in its database only",
            "column body is text in the cloud, character varying(20) in its database",
            "organization 2 (moved): VERIFICATION FAILED",
        ] {
            assert!(text.contains(want), "{args:?}: no {want:?} in\n{text}");
        }
        assert!(!text.to_lowercase().contains("default"), "{text}");
        assert!(text.contains("schema DIFFERS"), "{text}");
    }
    // Organization 3 is as the cloud.
    let out = ok(&lokadb(&w.dsn, &["verify", "3"]));
    assert_eq!(out.matches("schema equal").count(), 2, "{out}");

    // Missing in the organization's database: a column, a check, an index, a key.
    w.org_q(
        0,
        "ALTER TABLE documents DROP COLUMN extra;
         ALTER TABLE documents ALTER COLUMN project_id DROP NOT NULL;
         ALTER INDEX documents_title_idx2 RENAME TO documents_title_idx;
         ALTER TABLE document_versions ALTER COLUMN body TYPE text;",
    );
    ok(&lokadb(&w.dsn, &["verify", "2"]));
    w.cloud_q(
        "ALTER TABLE documents DISABLE TRIGGER USER;
         ALTER EVENT TRIGGER lokadb_ddl_start DISABLE;
         ALTER TABLE documents ADD COLUMN cloud_only int;
         ALTER TABLE documents ADD CONSTRAINT documents_title_check CHECK (title <> '');
         CREATE INDEX documents_project_idx ON documents (project_id, title);
         ALTER EVENT TRIGGER lokadb_ddl_start ENABLE;
         ALTER TABLE documents ENABLE TRIGGER USER;",
    );
    w.org_q(0, "DROP INDEX documents_title_idx");
    let o = lokadb(&w.dsn, &["verify", "2"]);
    assert_eq!(o.status.code(), Some(1), "{}", stdout(&o));
    let text = crate::admin_cli::stderr(&o);
    for want in [
        "column cloud_only (integer) is missing in its database",
        "check documents_title_check (CHECK ((title <> ''::text))) is missing in its database",
        "index documents_project_idx (USING btree (project_id, title)) is missing in its database",
        "index documents_title_idx (USING btree (title)) is missing in its database",
    ] {
        assert!(text.contains(want), "no {want:?} in\n{text}");
    }
}

/// Runs `lokadb ARGS` in the background, stalled at move failpoint `point` until the test
/// lets it go on; returns the child and the path that lets it.
fn stalled(w: &World, args: &[&str], point: &str) -> (std::process::Child, std::path::PathBuf) {
    stalled_at(&w.dsn, w.cloud.port(), args, point)
}

/// [`stalled`] for the cloud at `dsn` (`port` tells the stall files of parallel tests apart).
pub(crate) fn stalled_at(
    dsn: &str,
    port: u16,
    args: &[&str],
    point: &str,
) -> (std::process::Child, std::path::PathBuf) {
    let dir = std::env::temp_dir().join(format!(
        "lokadb-stall-{}-{point}-{port}",
        std::process::id(),
    ));
    let _ = std::fs::remove_file(&dir);
    let reached = dir.with_extension("reached");
    let _ = std::fs::remove_file(&reached);
    let mut child = std::process::Command::new(lokadb_tests::proxy::find_binary().unwrap())
        .args(args)
        .env("LOKADB_CLOUD", dsn)
        .env(
            "LOKADB_MOVE_STALL",
            format!("{point}:{}", dir.to_str().unwrap()),
        )
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    while !reached.exists() {
        if child.try_wait().unwrap().is_some() {
            let out = child.wait_with_output().unwrap();
            panic!(
                "{args:?} ended before {point}: {}{}",
                crate::admin_cli::stdout(&out),
                crate::admin_cli::stderr(&out)
            );
        }
        assert!(Instant::now() < deadline, "{args:?} never reached {point}");
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = std::fs::remove_file(&reached);
    (child, dir)
}

/// Lets a stalled command go on and returns its output.
#[track_caller]
pub(crate) fn go_on_output(
    child: std::process::Child,
    path: &std::path::Path,
) -> std::process::Output {
    std::fs::write(path, b"").unwrap();
    let out = child.wait_with_output().unwrap();
    let _ = std::fs::remove_file(path);
    let _ = std::fs::remove_file(path.with_extension("reached"));
    out
}

/// Lets a stalled command go on and returns its output, asserting it succeeded.
#[track_caller]
fn go_on(child: std::process::Child, path: &std::path::Path) -> String {
    let out = go_on_output(child, path);
    crate::admin_cli::stderr(&out) + &ok(&out)
}

/// Migrations during moves: one committed during the copy makes the move copy again with the
/// new shape at its switch (both directions); one that meets the switch waits for it and then
/// reaches the organization that has just moved. Every schema ends equal and verified.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrations_during_moves_end_with_equal_schemas() {
    let w = world_with(false, false, false);
    let app = w.cloud.client(APP_USER, APP_PASSWORD, "app").await.unwrap();
    // The second phase of migrations, as a proxy's resolver would run it.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let resolver = {
        let (stop, dsn) = (stop.clone(), w.dsn.clone());
        std::thread::spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let _ = lokadb(&dsn, &["resolve"]);
                std::thread::sleep(Duration::from_millis(100));
            }
        })
    };

    // 1. move-org of 3, stalled after its catch-up: a migration commits (the cloud and its
    // attached cloud partition change, its new database's table does not), and 3 writes the
    // new column. The switch sees it, and the move copies again.
    let (child, path) = stalled(&w, &["move-org", "3", "--profile", "fdw"], "catchup");
    migrate(
        &app,
        "ALTER TABLE documents ADD COLUMN priority int NOT NULL DEFAULT 0;
         CREATE INDEX documents_priority_idx ON documents (priority)",
    )
    .await
    .unwrap();
    app.batch_execute(
        "UPDATE documents SET priority = 7 WHERE organization_id = 3 AND id % 10 = 0",
    )
    .await
    .unwrap();
    let out = go_on(child, &path);
    assert!(
        out.contains("a migration changed public.documents"),
        "{out}"
    );
    assert!(out.contains("copying again"), "{out}");
    w.settled();
    assert_same_shape(&w, "a migration during move-org's copy");
    assert_eq!(
        w.org_q(1, "SELECT count(*) FROM documents WHERE priority = 7"),
        "10"
    );
    let v = ok(&lokadb(&w.dsn, &["verify", "3"]));
    assert_eq!(v.matches("schema equal").count(), 2, "{v}");

    // 2. move-back of 3, stalled the same way: the migration reaches 3's database (its rows
    // are still served from there) and the cloud, not the cloud copy being filled; the
    // switch sees it and the move copies again.
    let (child, path) = stalled(&w, &["move-back", "3", "--fold-max-rows", "0"], "catchup");
    migrate(&app, "ALTER TABLE documents ADD COLUMN note text")
        .await
        .unwrap();
    app.batch_execute(
        "UPDATE documents SET note = 'n' || id WHERE organization_id = 3 AND id % 10 = 1",
    )
    .await
    .unwrap();
    let out = go_on(child, &path);
    assert!(
        out.contains("a migration changed public.documents"),
        "{out}"
    );
    assert_eq!(
        w.cloud_q("SELECT count(*) FROM ONLY documents__lokadb_3_c WHERE note LIKE 'n%'"),
        "10"
    );
    assert_eq!(
        w.cloud_q("SELECT count(*) FROM documents WHERE organization_id = 3 AND priority = 7"),
        "10"
    );

    // 3. move-org of 3 stalled inside its switch, holding its tables' lock: a migration waits
    // for it, then commits and reaches 3's database, which has just become 3's.
    let (child, path) = stalled(&w, &["move-org", "3", "--profile", "fdw"], "switch");
    let waiting = tokio::spawn(async move {
        migrate(&app, "ALTER TABLE documents ADD COLUMN waited text")
            .await
            .map(|()| app)
    });
    let deadline = Instant::now() + Duration::from_secs(30);
    while w.cloud_q(
        "SELECT count(*) FROM pg_stat_activity WHERE usename = 'app' AND wait_event_type = 'Lock'",
    ) != "1"
    {
        assert!(
            Instant::now() < deadline,
            "the migration never waited for the switch"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = go_on(child, &path);
    assert!(!out.contains("a migration changed"), "{out}");
    let app = waiting.await.unwrap().unwrap();
    w.settled();
    assert_same_shape(&w, "a migration that waited for the switch");
    let v = ok(&lokadb(&w.dsn, &["verify"]));
    assert_eq!(v.matches("schema equal").count(), 4, "{v}");
    assert!(!v.contains("DIFFERS"), "{v}");
    app.batch_execute("UPDATE documents SET waited = 'w' WHERE organization_id = 3")
        .await
        .unwrap();
    assert_eq!(
        w.org_q(1, "SELECT count(*) FROM documents WHERE waited = 'w'"),
        "100"
    );
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    resolver.join().unwrap();
}

const CONCURRENT_INDEX: &str =
    "CREATE INDEX CONCURRENTLY documents_lower_title_idx ON documents (lower(title)) WHERE title <> ''";

/// Whether organization `i`'s database has `documents_lower_title_idx`: "valid", "invalid" or "none".
fn title_idx(w: &World, i: usize) -> String {
    w.org_q(
        i,
        "SELECT coalesce((SELECT CASE WHEN indisvalid THEN 'valid' ELSE 'invalid' END FROM pg_index
                          WHERE indexrelid = to_regclass('documents_lower_title_idx')), 'none')",
    )
}

/// Postgres refuses CREATE INDEX CONCURRENTLY on a LokaDB table (a partitioned table);
/// `lokadb concurrently` builds it in the cloud's partitions and in every moved
/// organization's database, with a line per organization, then declares it on the table.
/// With an organization unreachable it says who is done and leaves the table without the
/// index; run again once it is back, it builds only what is missing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_index_built_concurrently_reaches_every_moved_organization() {
    let mut w = world(true);
    let app = w.app().await;

    // As the application's migration sends it, through the proxy: Postgres's refusal.
    let e = app.batch_execute(CONCURRENT_INDEX).await.unwrap_err();
    assert_eq!(crate::world::sqlstate(&e), "0A000", "{e:?}");
    assert_eq!(title_idx(&w, 0), "none");
    // An index of that name on the table already: nothing done.
    let out = lokadb(
        &w.dsn,
        &[
            "concurrently",
            "CREATE INDEX CONCURRENTLY documents_title_idx ON documents (id)",
        ],
    );
    assert_eq!(
        out.status.code(),
        Some(2),
        "{}",
        crate::admin_cli::stderr(&out)
    );
    assert!(crate::admin_cli::stderr(&out).contains("relation documents_title_idx already exists"));

    // Organization 3 unreachable: the cloud's partitions and organization 2 get it; the
    // command fails naming who is done and who is not.
    w.agents[1].take().unwrap().kill();
    let out = lokadb(&w.dsn, &["concurrently", CONCURRENT_INDEX]);
    let err = crate::admin_cli::stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains(
            "lokadb: cloud: public.documents__lokadb_default: index documents_lower_title_idx_p"
        ),
        "{err}"
    );
    assert!(
        err.contains("lokadb: organization 2: index documents_lower_title_idx built"),
        "{err}"
    );
    assert!(err.contains("lokadb: organization 3: failed: "), "{err}");
    assert!(
        err.contains("index documents_lower_title_idx on public.documents is not complete: built in the cloud's partitions and in organization 2; not in organization 3"),
        "{err}"
    );
    assert!(err.contains("run the same command again"), "{err}");
    assert_eq!(title_idx(&w, 0), "valid");
    assert_eq!(title_idx(&w, 1), "none");
    assert_eq!(
        w.cloud_q("SELECT to_regclass('documents_lower_title_idx') IS NULL"),
        "t",
        "the table does not declare the index yet"
    );
    assert_eq!(
        w.cloud_q(
            "SELECT count(*) FROM pg_index WHERE indrelid = 'documents__lokadb_default'::regclass
             AND indisvalid AND pg_get_indexdef(indexrelid) LIKE '%lower(title)%'"
        ),
        "1"
    );
    // The other organizations work meanwhile.
    assert_eq!(
        one(&app
            .simple_query("SELECT count(*) FROM documents WHERE organization_id = 2")
            .await
            .unwrap()),
        "100"
    );

    // A build that failed in organization 3 left an invalid index of that name (here a
    // unique one that met duplicates): the rerun drops it and builds the right one.
    assert!(w.orgs[1]
        .db
        .psql(
            ORG_DB,
            "CREATE UNIQUE INDEX CONCURRENTLY documents_lower_title_idx ON documents (organization_id)"
        )
        .is_err());
    assert_eq!(title_idx(&w, 1), "invalid");

    // Back: a rerun builds what is missing and declares the index.
    w.agents[1] = Some(start_agent(&w.certs, &w.orgs[1], addrs(&w.relay).agents, &[]).unwrap());
    w.agents[1]
        .as_ref()
        .unwrap()
        .wait_connected(Duration::from_secs(10))
        .unwrap();
    let out = lokadb(&w.dsn, &["concurrently", CONCURRENT_INDEX]);
    let stdout = ok(&out);
    let err = crate::admin_cli::stderr(&out);
    assert!(
        err.contains(
            "lokadb: cloud: public.documents__lokadb_default: index documents_lower_title_idx_p"
        ) && err.contains(" there ("),
        "{err}"
    );
    assert!(
        err.contains("lokadb: organization 2: index documents_lower_title_idx there"),
        "{err}"
    );
    assert!(
        err.contains("lokadb: organization 3: index documents_lower_title_idx rebuilt"),
        "{err}"
    );
    assert!(
        stdout.contains(
            "index documents_lower_title_idx on public.documents: built in the cloud and in organizations 2, 3"
        ),
        "{stdout}"
    );
    assert_eq!(title_idx(&w, 1), "valid");
    assert_eq!(
        w.cloud_q("SELECT indisvalid FROM pg_index WHERE indexrelid = 'documents_lower_title_idx'::regclass"),
        "t"
    );
    // Every partition's index is the table's, none built twice.
    assert_eq!(
        w.cloud_q(
            "SELECT count(*) FROM pg_index i JOIN pg_class c ON c.oid = i.indrelid
             WHERE pg_get_indexdef(i.indexrelid) LIKE '%lower(title)%' AND c.relkind = 'r'
               AND NOT EXISTS (SELECT 1 FROM pg_inherits h WHERE h.inhrelid = i.indexrelid)"
        ),
        "0"
    );
    assert_same_shape(&w, "an index built concurrently");

    // Once complete, the same statement is refused as Postgres would (the index exists);
    // with IF NOT EXISTS there is nothing to do.
    let out = lokadb(&w.dsn, &["concurrently", CONCURRENT_INDEX]);
    assert_eq!(
        out.status.code(),
        Some(2),
        "{}",
        crate::admin_cli::stderr(&out)
    );
    let out = lokadb(
        &w.dsn,
        &[
            "concurrently",
            &CONCURRENT_INDEX.replace("CONCURRENTLY", "CONCURRENTLY IF NOT EXISTS"),
        ],
    );
    assert!(ok(&out).contains("exists already: nothing to do"));
    assert_same_shape(&w, "a run with nothing to build");

    // The organizations' statements go on, through the cloud and the direct path.
    for (org, project) in [(1, 10), (2, 20), (3, 30)] {
        app.simple_query(&format!(
            "INSERT INTO documents (organization_id, project_id, title) VALUES ({org}, {project}, 'indexed')"
        ))
        .await
        .unwrap();
        let sql = format!(
            "SELECT count(*) FROM documents WHERE organization_id = {org} AND title = 'indexed'"
        );
        assert_eq!(
            one(&app.simple_query(&sql).await.unwrap()),
            "1",
            "organization {org}"
        );
    }
}

/// The connections a migration opens to organizations stay open for the session's next
/// migration; one that died since (the organization's database restarted its backends) is
/// opened again, and the migration goes through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sessions_migrations_keep_their_connections_and_survive_their_loss() {
    let w = world(true);
    let app = w.app().await;
    let from_cloud = "SELECT count(*) FROM pg_stat_activity
                      WHERE datname = current_database() AND pid <> pg_backend_pid()
                        AND backend_type = 'client backend' AND state = 'idle'
                        AND application_name <> 'lokadb resolver'";
    let before: Vec<String> = (0..2).map(|i| w.org_q(i, from_cloud)).collect();
    migrate(&app, "ALTER TABLE documents ADD COLUMN kept_a int")
        .await
        .unwrap();
    w.settled();
    for (i, n) in before.iter().enumerate() {
        let after: i64 = w.org_q(i, from_cloud).parse().unwrap();
        assert!(
            after > n.parse::<i64>().unwrap(),
            "organization {}: no connection kept ({n} idle before, {after} after)",
            i + 2
        );
    }
    migrate(&app, "ALTER TABLE documents ADD COLUMN kept_b int")
        .await
        .unwrap();
    assert_same_shape(&w, "a second migration on kept connections");

    // Organization 2's database ends every other backend: the session's kept connection
    // and the resolver's are dead; both are opened again (settled() needs the resolver).
    w.org_q(
        0,
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
         WHERE datname = current_database() AND pid <> pg_backend_pid()
           AND backend_type = 'client backend'",
    );
    migrate(
        &app,
        "ALTER TABLE documents ADD COLUMN kept_c int;
         CREATE INDEX documents_kept_c_idx ON documents (kept_c)",
    )
    .await
    .unwrap();
    assert_same_shape(&w, "a migration after the kept connection died");
    // And from a session whose first DDL opens them ahead.
    let other = w.app().await;
    migrate(&other, "ALTER TABLE documents DROP COLUMN kept_a")
        .await
        .unwrap();
    assert_same_shape(&w, "another session");
}

/// A client of the proxy that keeps the notices (warnings) the server sends it.
async fn app_with_notices(
    w: &World,
) -> (
    tokio_postgres::Client,
    tokio::sync::mpsc::UnboundedReceiver<tokio_postgres::error::DbError>,
) {
    use futures_util::StreamExt;
    let port = w.proxy.as_ref().expect("a proxy").port();
    let (client, mut conn) = tokio_postgres::connect(
        &format!("host=127.0.0.1 port={port} user={APP_USER} password={APP_PASSWORD} dbname=app"),
        tokio_postgres::NoTls,
    )
    .await
    .unwrap();
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut messages = futures_util::stream::poll_fn(move |cx| conn.poll_message(cx));
        while let Some(Ok(m)) = messages.next().await {
            if let tokio_postgres::AsyncMessage::Notice(n) = m {
                let _ = tx.send(n);
            }
        }
    });
    (client, rx)
}

/// The error of `sql` through the proxy, asserted to be the owing organization's refusal.
#[track_caller]
fn assert_owing(e: &tokio_postgres::Error, org: &str) {
    let db = e.as_db_error().unwrap_or_else(|| panic!("{e:?}"));
    assert_eq!(db.code().code(), "55000", "{db:?}");
    assert!(
        db.message().starts_with(&format!(
            "organization {org} has not received the application's latest migrations"
        )),
        "{db:?}"
    );
    assert!(
        db.hint()
            .unwrap_or_default()
            .contains(&format!("lokadb org sync {org}")),
        "{db:?}"
    );
}

/// With `lokadb.migration_offline = defer` a migration goes on without an organization that
/// cannot be reached; the organization owes it, its statements are refused (both paths, the
/// simple and the extended protocol) while the others are served, and it gets what it owes
/// in order: from the proxy's resolver when its agent is back, or `lokadb org sync`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_organization_may_owe_a_migration_until_it_is_synced() {
    let mut w = world(true);
    let (app, mut notices) = app_with_notices(&w).await;
    let org3_before = w.org_q(1, COLUMNS);
    w.agents[1].take().unwrap().kill();

    // A bad value is refused, and the migration with it.
    app.batch_execute("SET lokadb.migration_offline = 'later'")
        .await
        .unwrap();
    let db = migration_error(
        &app,
        "ALTER TABLE documents ADD COLUMN priority int NOT NULL DEFAULT 0",
    )
    .await;
    assert_eq!(db.code().code(), "22023", "{db:?}");
    assert!(db.message().contains("lokadb.migration_offline"), "{db:?}");

    app.batch_execute("SET lokadb.migration_offline = defer")
        .await
        .unwrap();
    migrate(
        &app,
        "ALTER TABLE documents ADD COLUMN priority int NOT NULL DEFAULT 0",
    )
    .await
    .unwrap();
    let warning = tokio::time::timeout(Duration::from_secs(30), notices.recv())
        .await
        .expect("a warning")
        .expect("a warning");
    assert_eq!(warning.severity(), "WARNING", "{warning:?}");
    assert!(
        warning
            .message()
            .contains("organization 3 could not be reached and owes it"),
        "{warning:?}"
    );
    assert!(
        warning
            .detail()
            .unwrap_or_default()
            .contains("organization 3: "),
        "{warning:?}"
    );
    migrate(&app, "ALTER TABLE documents RENAME COLUMN title TO heading")
        .await
        .unwrap();
    // Organization 2 has both; organization 3 neither.
    w.settled();
    assert_eq!(w.org_q(0, COLUMNS), w.cloud_q(COLUMNS));
    assert_eq!(w.org_q(1, COLUMNS), org3_before);
    let listed = ok(&lokadb(&w.dsn, &["org", "list"]));
    assert!(listed.contains("2 migrations"), "{listed}");

    // Organization 3's statements are refused, in both protocols; the others are served.
    let deadline = Instant::now() + Duration::from_secs(30);
    let e = loop {
        // The proxy learns of the debt with the metadata's next generation.
        // Until then they fail in postgres_fdw (the organization cannot be reached).
        match app
            .simple_query("SELECT count(*) FROM documents WHERE organization_id = 3")
            .await
        {
            Err(e) if e.code().is_some_and(|c| c.code() == "55000") => break e,
            r if Instant::now() < deadline => {
                let _ = r;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            r => panic!("organization 3's statements are not refused: {r:?}"),
        }
    };
    assert_owing(&e, "3");
    let e = app
        .query(
            "SELECT heading FROM documents WHERE organization_id = $1",
            &[&3i64],
        )
        .await
        .unwrap_err();
    assert_owing(&e, "3");
    let e = app
        .execute(
            "UPDATE documents SET heading = 'x' WHERE organization_id = $1",
            &[&3i64],
        )
        .await
        .unwrap_err();
    assert_owing(&e, "3");
    for org in [1i64, 2] {
        let row = app
            .query_one(
                "SELECT count(*), count(*) FILTER (WHERE priority = 0), count(heading)
                 FROM documents WHERE organization_id = $1",
                &[&org],
            )
            .await
            .unwrap();
        let (all, zero, named): (i64, i64, i64) = (row.get(0), row.get(1), row.get(2));
        assert!(
            all > 0 && zero == all && named == all,
            "organization {org}: {all} {zero} {named}"
        );
    }

    // Without defer, a migration still fails on it, and changes nothing.
    app.batch_execute("RESET lokadb.migration_offline")
        .await
        .unwrap();
    let db = migration_error(&app, "ALTER TABLE documents ADD COLUMN later int").await;
    assert_eq!(db.code().code(), "08001", "{db:?}");
    assert!(
        db.hint()
            .unwrap_or_default()
            .contains("lokadb.migration_offline = defer"),
        "{db:?}"
    );
    // Nor can it be synced or moved back while it cannot be reached.
    let o = lokadb(&w.dsn, &["org", "sync", "3"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("owed migrations not applied (2)"),
        "{}",
        stderr(&o)
    );
    let o = lokadb(&w.dsn, &["move-back", "3"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("owes 2 migrations"), "{}", stderr(&o));

    // Its agent is back: the proxy's resolver applies what it owes, in order.
    w.agents[1] = Some(start_agent(&w.certs, &w.orgs[1], addrs(&w.relay).agents, &[]).unwrap());
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match app
            .simple_query("SELECT count(heading) FROM documents WHERE organization_id = 3")
            .await
        {
            Ok(rows) => {
                assert_eq!(one(&rows), "100");
                break;
            }
            Err(e) if Instant::now() < deadline => {
                assert_owing(&e, "3");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!(
                "organization 3 still refused: {e:?}\n{}",
                w.proxy.as_ref().unwrap().output()
            ),
        }
    }
    assert_same_shape(&w, "after the resolver applied what organization 3 owed");
    assert_eq!(
        w.org_q(1, "SELECT count(*) FROM documents WHERE priority = 0"),
        "100"
    );
    let shown = ok(&lokadb(&w.dsn, &["org", "show", "3"]));
    assert!(shown.contains("owes        nothing"), "{shown}");

    // With no proxy running, `lokadb org sync` pays the debt.
    drop(w.proxy.take());
    let cloud_app = w.cloud.client(APP_USER, APP_PASSWORD, "app").await.unwrap();
    w.agents[1].take().unwrap().kill();
    cloud_app
        .batch_execute("SET lokadb.migration_offline = defer")
        .await
        .unwrap();
    migrate(&cloud_app, "ALTER TABLE documents DROP COLUMN priority")
        .await
        .unwrap();
    ok(&lokadb(&w.dsn, &["resolve"]));
    let verified = lokadb(&w.dsn, &["verify", "2"]);
    assert!(verified.status.success(), "{}", stdout(&verified));
    w.agents[1] = Some(start_agent(&w.certs, &w.orgs[1], addrs(&w.relay).agents, &[]).unwrap());
    w.agents[1]
        .as_ref()
        .unwrap()
        .wait_connected(Duration::from_secs(10))
        .unwrap();
    let synced = ok(&lokadb(&w.dsn, &["org", "sync", "3"]));
    assert!(
        synced.contains("organization 3: 1 owed migration applied (1 statement)"),
        "{synced}"
    );
    assert_same_shape(&w, "after lokadb org sync");
    let again = ok(&lokadb(&w.dsn, &["org", "sync", "3"]));
    assert!(
        again.contains("organization 3 owes no migration"),
        "{again}"
    );
    ok(&lokadb(&w.dsn, &["verify", "3"]));
}

/// The labels of enum `mood`, in order.
const MOOD: &str = "SELECT string_agg(enumlabel, ',' ORDER BY enumsortorder) FROM pg_enum WHERE enumtypid = 'mood'::regtype";

/// `ALTER TYPE … ADD VALUE` and `RENAME VALUE` of an enum a LokaDB table's column uses run in
/// every moved organization's database with the migration, and its rows can take the value.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enum_values_added_and_renamed_reach_every_organization() {
    let w = world(true);
    let app = w.app().await;
    let create =
        format!("CREATE TYPE mood AS ENUM ('sad', 'ok'); ALTER TYPE mood OWNER TO {APP_USER}");
    w.cloud_q(&create);
    for i in 0..w.orgs.len() {
        w.org_q(i, &create);
    }
    migrate(&app, "ALTER TABLE documents ADD COLUMN mood mood")
        .await
        .unwrap();
    assert_same_shape(&w, "an enum column");

    // One value at the end, one at the front, in one transaction; then a rename and another
    // in the middle, outside any transaction block (as a migration tool may send them).
    migrate(
        &app,
        "ALTER TYPE mood ADD VALUE 'happy' AFTER 'ok';
         ALTER TYPE mood ADD VALUE 'awful' BEFORE 'sad'",
    )
    .await
    .unwrap();
    app.batch_execute("ALTER TYPE mood RENAME VALUE 'ok' TO 'fine'")
        .await
        .unwrap();
    app.batch_execute("ALTER TYPE mood ADD VALUE 'meh' BEFORE 'fine'")
        .await
        .unwrap();
    w.settled();
    let cloud = w.cloud_q(MOOD);
    assert_eq!(cloud, "awful,sad,meh,fine,happy");
    for i in 0..w.orgs.len() {
        assert_eq!(w.org_q(i, MOOD), cloud, "organization {}", w.orgs[i].id);
    }
    // The organizations' rows take the new values, through either path.
    for org in 1..=3 {
        app.batch_execute(&format!(
            "UPDATE documents SET mood = 'happy' WHERE organization_id = {org} AND id IN
               (SELECT id FROM documents WHERE organization_id = {org} ORDER BY id LIMIT 2)"
        ))
        .await
        .unwrap();
        let sql = format!(
            "SELECT count(*) FROM documents WHERE organization_id = {org} AND mood = 'happy'"
        );
        assert_eq!(
            one(&app.simple_query(&sql).await.unwrap()),
            "2",
            "organization {org}"
        );
    }
    ok(&lokadb(&w.dsn, &["verify"]));
}
