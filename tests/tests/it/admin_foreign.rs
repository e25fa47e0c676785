//! Foreign keys of LokaDB tables kept across a foreign partition: organization 2 moved by
//! hand into its own database behind a real relay and agent (postgres_fdw → relay →
//! agent), organization 1 in the cloud. Parent checks, refs, refusals and cascades that
//! cross into the moved organization, and the round trips each write costs it.

use crate::admin_cli::{lokadb, ok, stderr};
use crate::admin_enable::SCHEMA;
use crate::tunnel_world::{
    addrs, org_add, start_agent, start_relay, Certs, Org, APP_PASSWORD, APP_USER, ORG_DB,
};
use lokadb_tests::pg::Cluster;
use serde_json::json;

/// Organization `id`'s database, every statement logged with its protocol phase
/// (`log_min_duration_statement = 0`: `statement:`, `parse`, `bind`, `execute`), so round
/// trips can be counted.
fn org_logging(id: &str) -> Org {
    let db = Cluster::builder()
        .setting("log_min_duration_statement", "0")
        .start()
        .unwrap();
    db.create_role(APP_USER, APP_PASSWORD).unwrap();
    db.create_database(ORG_DB, APP_USER).unwrap();
    Org {
        id: id.to_owned(),
        token: format!("{id}.{:032x}", rand::random::<u128>()),
        db,
    }
}

const ORG_TABLES: &str = "
CREATE TABLE documents (id bigint PRIMARY KEY, organization_id bigint NOT NULL,
                        project_id bigint, title text);
CREATE TABLE document_versions (id bigint PRIMARY KEY, organization_id bigint NOT NULL,
                                document_id bigint NOT NULL, body text);
CREATE TABLE mark (note text);
ALTER TABLE documents OWNER TO app;
ALTER TABLE document_versions OWNER TO app;
";

/// Moves organization 2's rows of `table` into its database and attaches the foreign
/// table as the partition `FOR VALUES IN (2)` (what move-org will do, by hand): copy
/// through the foreign table, delete from the default partition without firing triggers
/// (the key map rows stay: the keys still belong to organization 2), attach, record refs.
fn move_org2(cloud: &Cluster, table: &str, columns: &str) {
    q(
        cloud,
        &format!(
            "CREATE FOREIGN TABLE {table}_org2 ({columns}) SERVER lokadb_org_2 OPTIONS (table_name '{table}');
             INSERT INTO {table}_org2 SELECT * FROM ONLY {table}__lokadb_default WHERE organization_id = 2;
             SET session_replication_role = replica;
             DELETE FROM ONLY {table}__lokadb_default WHERE organization_id = 2;
             SET session_replication_role = origin;
             ALTER TABLE {table} ATTACH PARTITION {table}_org2 FOR VALUES IN (2);
             SELECT lokadb.refs_fill('{table}_org2', '2');"
        ),
    );
}

fn q(cloud: &Cluster, sql: &str) -> String {
    cloud.psql("app", sql).unwrap()
}

#[track_caller]
fn refused(cloud: &Cluster, sql: &str, expect: &[&str]) {
    let e = cloud.psql("app", sql).unwrap_err().to_string();
    for x in expect {
        assert!(e.contains(x), "{sql}: expected {x:?} in\n{e}");
    }
}

struct World {
    _certs: Certs,
    org: Org,
    _relay: lokadb_tests::proxy::Proxy,
    _agent: lokadb_tests::agent::Agent,
    cloud: Cluster,
    dsn: String,
}

const DOC_COLUMNS: &str =
    "id bigint NOT NULL, organization_id bigint NOT NULL, project_id bigint, title text";
const VERSION_COLUMNS: &str =
    "id bigint NOT NULL, organization_id bigint NOT NULL, document_id bigint NOT NULL, body text";

/// Cloud with the test schema, both tables enabled, organization 2 moved behind the relay.
fn world() -> World {
    let certs = Certs::new().unwrap();
    let org = org_logging("2");
    org.db.psql(ORG_DB, ORG_TABLES).unwrap();
    let relay = start_relay(&certs, &[&org], json!({}), &[]).unwrap();
    let agent = start_agent(&certs, &org, addrs(&relay).agents, &[]).unwrap();
    let cloud = Cluster::start().unwrap();
    cloud.create_database("app", "postgres").unwrap();
    let dsn = cloud.superuser_dsn("app");
    ok(&lokadb(&dsn, &["init"]));
    cloud.psql("app", SCHEMA).unwrap();
    let out = ok(&lokadb(&dsn, &["enable", "documents"]));
    assert!(
        out.contains("foreign key documents_project_id_fkey is kept for moved organizations"),
        "{out}"
    );
    let out = ok(&lokadb(&dsn, &["enable", "document_versions"]));
    assert!(
        out.contains("foreign key document_versions_document_id_fkey is kept for moved organizations: parent check in lokadb.km_documents_id (id)"),
        "{out}"
    );
    let via = addrs(&relay).postgres.to_string();
    ok(&lokadb(
        &dsn,
        &org_add("2", std::slice::from_ref(&via), &[]),
    ));
    move_org2(&cloud, "documents", DOC_COLUMNS);
    move_org2(&cloud, "document_versions", VERSION_COLUMNS);
    World {
        _certs: certs,
        org,
        _relay: relay,
        _agent: agent,
        cloud,
        dsn,
    }
}

fn org_q(w: &World, sql: &str) -> String {
    w.org.db.psql(ORG_DB, sql).unwrap()
}

#[test]
fn constraints_hold_across_a_foreign_partition() {
    let w = world();
    let cloud = &w.cloud;
    assert_eq!(
        q(
            cloud,
            "SELECT relkind FROM pg_class WHERE relname = 'documents_org2'"
        ),
        "f"
    );
    assert_eq!(org_q(&w, "SELECT count(*) FROM documents"), "100");
    assert_eq!(
        q(
            cloud,
            "SELECT count(*) FROM ONLY documents__lokadb_default WHERE organization_id = 2"
        ),
        "0"
    );
    // Refs of the moved rows: one per reference.
    assert_eq!(
        q(
            cloud,
            "SELECT count(*), min(org), max(org) FROM lokadb.__refs_documents_documents_project_id_fkey"
        ),
        "100|2|2"
    );

    // A duplicate id in another organization is refused, both ways (document 1 is
    // organization 2's, document 2 organization 1's).
    refused(
        cloud,
        "INSERT INTO documents (id, organization_id, title) VALUES (2, 2, 'dup')",
        &[
            "violates unique constraint \"documents_pkey\"",
            "already exists in another organization (1)",
        ],
    );
    refused(
        cloud,
        "INSERT INTO documents (id, organization_id, title) VALUES (1, 1, 'dup')",
        &[
            "violates unique constraint \"documents_pkey\"",
            "already exists in another organization (2)",
        ],
    );
    // A version in organization 2 pointing at a missing document: refused in the cloud.
    refused(
        cloud,
        "INSERT INTO document_versions (id, organization_id, document_id) VALUES (9000, 2, 999999)",
        &[
            "insert or update on table \"document_versions\" violates foreign key constraint \"document_versions_document_id_fkey\"",
            "Key (document_id)=(999999) is not present in table \"documents\"",
        ],
    );
    // A document in organization 2 pointing at a missing project; also by an update.
    refused(
        cloud,
        "INSERT INTO documents (id, organization_id, project_id, title) VALUES (9001, 2, 99, 'x')",
        &[
            "violates foreign key constraint \"documents_project_id_fkey\"",
            "Key (project_id)=(99) is not present in table \"projects\"",
        ],
    );
    refused(
        cloud,
        "UPDATE documents SET project_id = 98 WHERE id = 1",
        &["violates foreign key constraint \"documents_project_id_fkey\""],
    );
    assert_eq!(
        org_q(
            &w,
            "SELECT count(*) FROM documents WHERE id IN (9001) OR project_id = 98"
        ),
        "0"
    );
    // Valid rows go to organization 2's database, and their references are recorded.
    q(
        cloud,
        "INSERT INTO documents (id, organization_id, project_id, title) VALUES (7000, 2, NULL, 'loose');
         INSERT INTO document_versions (id, organization_id, document_id, body) VALUES (7000, 2, 7000, 'v'), (7001, 2, 1, 'v2');",
    );
    assert_eq!(
        org_q(
            &w,
            "SELECT count(*) FROM document_versions WHERE id IN (7000, 7001)"
        ),
        "2"
    );
    assert_eq!(
        q(cloud, "SELECT count(*) FROM lokadb.__refs_document_versions_document_versions_document_id_fkey WHERE k1 IN (1, 7000) AND org = 2"),
        "3"
    );
    // A key change of a referenced project (ON UPDATE NO ACTION) is refused.
    refused(
        cloud,
        "UPDATE projects SET id = 21 WHERE id = 20",
        &[
            "update or delete on table \"projects\" violates foreign key constraint \"documents_project_id_fkey\" on table \"documents\"",
            "Key (id)=(20) is still referenced from table \"documents\" in organization 2",
        ],
    );

    // Deleting project 20, referenced only by organization 2's documents: ON DELETE CASCADE
    // crosses into organization 2's database, and on to the versions of those documents
    // (document_versions → documents, ON DELETE CASCADE, through the key map).
    let docs20 = org_q(&w, "SELECT count(*) FROM documents WHERE project_id = 20");
    assert_eq!(docs20, "100");
    q(cloud, "DELETE FROM projects WHERE id = 20");
    assert_eq!(
        org_q(&w, "SELECT count(*) FROM documents WHERE project_id = 20"),
        "0"
    );
    assert_eq!(
        org_q(
            &w,
            "SELECT string_agg(id::text, ',' ORDER BY id) FROM documents"
        ),
        "7000"
    );
    assert_eq!(
        org_q(
            &w,
            "SELECT string_agg(id::text, ',' ORDER BY id) FROM document_versions"
        ),
        "7000"
    );
    assert_eq!(
        q(
            cloud,
            "SELECT count(*) FROM lokadb.__refs_documents_documents_project_id_fkey"
        ),
        "0"
    );
    assert_eq!(
        q(
            cloud,
            "SELECT count(*) FROM lokadb.km_documents_id WHERE organization_id = 2"
        ),
        "1"
    );
    // Organization 2 (a NO ACTION parent) is still referenced by its document 7000 alone.
    refused(
        cloud,
        "DELETE FROM organizations WHERE id = 2",
        &["Key (id)=(2) is still referenced from table \"documents\" in organization 2"],
    );
    // Deleting the last document (in organization 2's database) cascades to its version
    // there, and frees the organization.
    q(cloud, "DELETE FROM documents WHERE id = 7000");
    assert_eq!(org_q(&w, "SELECT count(*) FROM document_versions"), "0");
    q(cloud, "DELETE FROM organizations WHERE id = 2");

    // Organization 1 (in the cloud) behaves as before: native foreign keys.
    refused(
        cloud,
        "INSERT INTO document_versions (organization_id, document_id) VALUES (1, 999999)",
        &[
            "violates foreign key constraint \"document_versions_document_id_fkey\"",
            "km_documents_id",
        ],
    );
    refused(
        cloud,
        "INSERT INTO documents (organization_id, project_id, title) VALUES (1, 99, 'x')",
        &["violates foreign key constraint \"documents_project_id_fkey\""],
    );
    q(cloud, "DELETE FROM projects WHERE id = 10");
    assert_eq!(q(cloud, "SELECT count(*) FROM documents"), "0");
    assert_eq!(q(cloud, "SELECT count(*) FROM document_versions"), "0");
    // No refs for cloud rows were ever recorded.
    assert_eq!(
        q(
            cloud,
            "SELECT count(*) FROM lokadb.__refs_documents_documents_organization_id_fkey"
        ),
        "0"
    );
    // Disable refuses while organization 2 has its partition; a rerun of enable changes nothing.
    let o = lokadb(&w.dsn, &["disable", "documents"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let o = lokadb(&w.dsn, &["enable", "documents"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
}

/// Round trips to the organization per statement, from its log: a simple query
/// (`statement:`), an `execute` (with its bind, in one trip), and a named `parse` (a
/// prepare, its own trip); an unnamed parse travels with its bind and execute.
fn round_trips(log: &str) -> (usize, Vec<String>) {
    let mut lines = Vec::new();
    for l in log.lines().filter(|l| l.contains("app@orgdb")) {
        let Some(i) = l.find("duration: ") else {
            continue;
        };
        let rest = &l[i..];
        let Some(j) = rest.find("  ") else { continue };
        let what = rest[j + 2..].to_owned();
        let trip = what.starts_with("statement: ")
            || what.starts_with("execute ")
            || (what.starts_with("parse ") && !what.starts_with("parse <unnamed>"));
        if trip {
            lines.push(what);
        }
    }
    (lines.len(), lines)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_trips_per_write_to_a_foreign_partition() {
    let w = world();
    // The same remote table without any trigger: a plain foreign table.
    q(
        &w.cloud,
        &format!(
            "CREATE FOREIGN TABLE documents_bare ({DOC_COLUMNS}) SERVER lokadb_org_2 OPTIONS (table_name 'documents')"
        ),
    );
    let c = crate::world::connect(&w.dsn).await.unwrap();
    // Warm the session's connection to the organization.
    c.simple_query("SELECT count(*) FROM documents_bare")
        .await
        .unwrap();
    c.simple_query("SELECT count(*) FROM documents WHERE organization_id = 2")
        .await
        .unwrap();
    let cases: &[(&str, &str)] = &[
        ("insert, triggers", "INSERT INTO documents (id, organization_id, project_id, title) VALUES (9001, 2, 20, 'rt')"),
        ("insert, no trigger", "INSERT INTO documents_bare (id, organization_id, project_id, title) VALUES (9002, 2, 20, 'rt')"),
        ("insert 10 rows, triggers", "INSERT INTO documents (id, organization_id, project_id, title) SELECT 9100 + g, 2, 20, 'rt' FROM generate_series(1, 10) g"),
        ("insert 10 rows, no trigger", "INSERT INTO documents_bare (id, organization_id, project_id, title) SELECT 9200 + g, 2, 20, 'rt' FROM generate_series(1, 10) g"),
        ("update, triggers", "UPDATE documents SET title = 'rt2' WHERE id = 9001 AND organization_id = 2"),
        ("update, no trigger", "UPDATE documents_bare SET title = 'rt2' WHERE id = 9002"),
        ("update of the foreign key, triggers", "UPDATE documents SET project_id = 10 WHERE id = 9001 AND organization_id = 2"),
        ("delete, triggers", "DELETE FROM documents WHERE id = 9001 AND organization_id = 2"),
        ("delete, no trigger", "DELETE FROM documents_bare WHERE id = 9002"),
    ];
    let mut report = String::new();
    let log_path = w.org.db.log_path();
    for (what, sql) in cases {
        let before = std::fs::metadata(&log_path).unwrap().len() as usize;
        c.simple_query(sql).await.unwrap();
        // The remote COMMIT is logged before the cloud's statement returns.
        let log = std::fs::read(&log_path).unwrap();
        let (n, lines) = round_trips(&String::from_utf8_lossy(&log[before..]));
        report.push_str(&format!("{what}: {n}\n"));
        for l in &lines {
            let l: String = l.chars().take(110).collect();
            report.push_str(&format!("    {l}\n"));
        }
    }
    eprintln!("round trips to the organization per statement:\n{report}");
    let get = |what: &str| -> usize {
        report
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{what}: ")))
            .unwrap()
            .parse()
            .unwrap()
    };
    // The guards run in the cloud: they add no round trip to what the key map and gate
    // triggers already cost (postgres_fdw cannot push a modification down when the foreign
    // table has row triggers).
    assert!(get("insert, triggers") <= 5, "{report}");
    assert!(get("update, triggers") <= 8, "{report}");
    assert!(get("delete, triggers") <= 8, "{report}");
    assert!(get("update of the foreign key, triggers") <= 8, "{report}");
    assert_eq!(
        org_q(
            &w,
            "SELECT count(*) FROM documents WHERE id BETWEEN 9000 AND 9300"
        ),
        "20"
    );
}
