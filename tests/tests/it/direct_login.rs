//! The direct login is the proxy's, not the client's (issue 22): it carries a fixed list of
//! the client's startup parameters and the session's transaction defaults, whatever set
//! them; a session that may have changed those runs its transactions and writes on the
//! cloud; and only a role that may write organizations' rows opens the gate of direct
//! writes.
//!
//! A trigger in organization 2's database records, in the row a direct UPDATE writes, the
//! settings of the connection that ran it.

use crate::direct::{client, direct_world, org_ran, rows};
use crate::moves::World;
use crate::tunnel_world::ORG_DB;
use crate::world::{connect, sqlstate};
use lokadb_tests::proxy::Proxy;
use lokadb_tests::raw::Raw;
use serde_json::json;

/// In organization 2's database: an UPDATE that sets a version's body to 'probe' stores
/// there instead `isolation|read only|search_path|application_name|extra_float_digits` of
/// the connection that ran it (an ordinary trigger: `session_replication_role = replica`
/// skips it).
const PROBE: &str = "
    CREATE FUNCTION probe() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        IF NEW.body = 'probe' THEN
            NEW.body := concat_ws('|',
                current_setting('transaction_isolation'),
                current_setting('transaction_read_only'),
                current_setting('search_path'),
                current_setting('application_name'),
                current_setting('extra_float_digits'));
        END IF;
        RETURN NEW;
    END
    $$;
    CREATE TRIGGER probe BEFORE UPDATE ON document_versions
        FOR EACH ROW EXECUTE FUNCTION probe();";

/// Organization 2 on fdw+direct with the probe, and one of its versions' id.
fn probed_world() -> (World, Proxy, i64) {
    let (w, proxy) = direct_world(json!({}));
    w.org.db.psql(ORG_DB, PROBE).unwrap();
    let id = w
        .cloud
        .psql(
            "app",
            "SELECT min(id) FROM document_versions WHERE organization_id = 2",
        )
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    (w, proxy, id)
}

fn probe_write(id: i64) -> String {
    format!("UPDATE document_versions SET body = 'probe' WHERE organization_id = 2 AND id = {id}")
}

/// What the probe recorded in version `id`, read in the organization's database.
fn probed(w: &World, id: i64) -> Vec<String> {
    w.org
        .db
        .psql(
            ORG_DB,
            &format!("SELECT body FROM document_versions WHERE id = {id}"),
        )
        .unwrap()
        .split('|')
        .map(str::to_owned)
        .collect()
}

/// A session of `user` (password `USER-secret`) through the proxy, with startup `options`.
async fn login(proxy: &Proxy, user: &str, options: &str) -> tokio_postgres::Client {
    let mut dsn = format!(
        "host=127.0.0.1 port={} user={user} password={user}-secret dbname=app",
        proxy.port()
    );
    if !options.is_empty() {
        dsn.push_str(&format!(" options='{options}'"));
    }
    connect(&dsn).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_direct_login_carries_only_the_listed_startup_parameters() {
    let (w, proxy, id) = probed_world();
    // A raw startup packet with settings the direct role should never get: its search_path,
    // and session_replication_role (which skips the organization's triggers, and which the
    // direct role, no superuser, may not even set: its login would fail).
    let mut raw = Raw::connect_with(
        proxy.port(),
        &[
            ("application_name", "probe-app"),
            ("extra_float_digits", "2"),
            // public first: the proxy trusts the unqualified name (route/names.rs).
            ("search_path", "public, nowhere"),
            ("session_replication_role", "replica"),
        ],
    )
    .await;
    let write = probe_write(id);
    raw.run("", &write, true).await;
    assert_eq!(org_ran(&w, &write), 1, "{}", proxy.output());
    assert_eq!(
        probed(&w, id),
        [
            "read committed",
            "off",
            "\"$user\", public",
            "probe-app",
            "2"
        ]
    );
}

/// A role whose transactions default to REPEATABLE READ (its role's default, or its startup
/// options' SERIALIZABLE) sees one snapshot per transaction through the proxy, as at the
/// cloud, and its direct statements run at its level.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transaction_defaults_from_any_source_are_the_sessions() {
    let (w, proxy, id) = probed_world();
    w.cloud
        .psql(
            "app",
            "CREATE ROLE rr LOGIN PASSWORD 'rr-secret';
             GRANT SELECT ON documents TO rr;
             GRANT SELECT, UPDATE ON document_versions TO rr;
             ALTER ROLE rr SET default_transaction_isolation = 'repeatable read';",
        )
        .unwrap();
    let doc: i64 = w
        .cloud
        .psql(
            "app",
            "SELECT min(id) FROM documents WHERE organization_id = 2",
        )
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let read = format!("SELECT title FROM documents WHERE organization_id = 2 AND id = {doc}");
    let retitle = |title: &str| {
        w.cloud
            .psql(
                "app",
                &format!(
                    "UPDATE documents SET title = '{title}' WHERE organization_id = 2 AND id = {doc}"
                ),
            )
            .unwrap();
    };

    // The role's default: a direct statement runs at it in the organization's database.
    let rr = login(&proxy, "rr", "").await;
    let write = probe_write(id);
    rr.batch_execute(&write).await.unwrap();
    assert_eq!(org_ran(&w, &write), 1, "{}", proxy.output());
    assert_eq!(probed(&w, id)[0], "repeatable read");
    // Its transaction reads one snapshot, as at the cloud: a title changed meanwhile is
    // seen only after it.
    retitle("before");
    rr.batch_execute("BEGIN").await.unwrap();
    assert_eq!(rows(&rr.simple_query(&read).await.unwrap()), ["before"]);
    retitle("meanwhile");
    assert_eq!(rows(&rr.simple_query(&read).await.unwrap()), ["before"]);
    assert_eq!(
        rows(&rr.simple_query("SHOW transaction_isolation").await.unwrap()),
        ["repeatable read"]
    );
    rr.batch_execute("COMMIT").await.unwrap();
    assert_eq!(rows(&rr.simple_query(&read).await.unwrap()), ["meanwhile"]);

    // The startup options' default (either spelling) wins over the role's.
    for options in [
        "-c default_transaction_isolation=serializable",
        "--default_transaction_isolation=serializable",
    ] {
        let s = login(&proxy, "rr", options).await;
        let before = org_ran(&w, &write);
        s.batch_execute(&write).await.unwrap();
        assert_eq!(org_ran(&w, &write), before + 1, "{options}");
        assert_eq!(probed(&w, id)[0], "serializable", "{options}");
    }

    // A read-committed session whose defaults change in a way the proxy does not follow
    // (set_config, through the extended protocol): its transactions run on the cloud, and
    // its writes go through it.
    let c = client(&proxy).await;
    c.query(
        "SELECT set_config('default_transaction_isolation', 'repeatable read', false)",
        &[],
    )
    .await
    .unwrap();
    retitle("before");
    c.batch_execute("BEGIN").await.unwrap();
    assert_eq!(rows(&c.simple_query(&read).await.unwrap()), ["before"]);
    retitle("meanwhile");
    assert_eq!(rows(&c.simple_query(&read).await.unwrap()), ["before"]);
    c.batch_execute("COMMIT").await.unwrap();
    let other = format!(
        "UPDATE document_versions SET body = 'through the cloud' WHERE organization_id = 2 AND id = {id}"
    );
    c.batch_execute(&other).await.unwrap();
    assert_eq!(org_ran(&w, &other), 0, "{}", proxy.output());
    assert_eq!(probed(&w, id), ["through the cloud"]);
    // Its plain reads still go direct.
    let marked = format!("{read} AND true");
    assert_eq!(rows(&c.simple_query(&marked).await.unwrap()), ["meanwhile"]);
    assert_eq!(org_ran(&w, &marked), 1);
}

/// Only a role that may update a LokaDB table opens the gate of direct writes (which holds
/// up a pause and a move back while its transaction is open).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gate_of_direct_writes_is_for_roles_that_may_write() {
    let (w, proxy) = direct_world(json!({}));
    w.cloud
        .psql(
            "app",
            "CREATE ROLE nosy LOGIN PASSWORD 'nosy-secret';
             GRANT SELECT ON documents, document_versions TO nosy;
             CREATE ROLE writer LOGIN PASSWORD 'writer-secret';
             GRANT SELECT, UPDATE ON document_versions TO writer;",
        )
        .unwrap();
    let at_cloud = |user: &str| {
        let dsn = w.cloud.dsn(user, &format!("{user}-secret"), "app");
        async move { connect(&dsn).await.unwrap() }
    };

    // Straight at the cloud: refused to a role that may not write, also in another's name.
    let nosy = at_cloud("nosy").await;
    let e = nosy
        .batch_execute("BEGIN; SELECT lokadb_client.direct_gate('2')")
        .await
        .unwrap_err();
    assert_eq!(sqlstate(&e), "42501", "{e:?}");
    let message = e.as_db_error().unwrap().message().to_owned();
    assert!(message.contains("gate of direct writes"), "{message}");
    nosy.batch_execute("ROLLBACK").await.unwrap();
    let e = nosy
        .batch_execute("SELECT lokadb_client.direct_gate_as('2', 'writer')")
        .await
        .unwrap_err();
    assert_eq!(sqlstate(&e), "42501", "{e:?}");
    // A role that may write opens it.
    let writer = at_cloud("writer").await;
    writer
        .batch_execute("BEGIN; SELECT lokadb_client.direct_gate('2'); ROLLBACK")
        .await
        .unwrap();

    // Through the proxy the writer writes directly.
    let body = |v: &str| {
        format!("UPDATE document_versions SET body = '{v}' WHERE organization_id = 2 AND id > 0")
    };
    let writer = login(&proxy, "writer", "").await;
    writer.batch_execute(&body("by writer")).await.unwrap();
    assert_eq!(org_ran(&w, &body("by writer")), 1, "{}", proxy.output());

    // A session that set a role that may not write: its write goes through the cloud, which
    // refuses it as it would (the gate asks the role in use, not the login's).
    let c = client(&proxy).await;
    c.batch_execute("SET ROLE nosy").await.unwrap();
    let e = c.batch_execute(&body("as nosy")).await.unwrap_err();
    assert_eq!(sqlstate(&e), "42501", "{e:?}");
    assert_eq!(org_ran(&w, &body("as nosy")), 0);
}

/// An organization's own login (`direct.logins`, `direct.logins_file`) is the one its
/// database gets; a wrong one fails only its direct statements (answered through the
/// cloud), never borrowing the shared login; a logins file that cannot be read stops the
/// start, naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_organization_has_a_login_of_its_own() {
    use crate::tunnel_world::{APP_PASSWORD, APP_USER};
    let own = json!({ "user": "org2_reader", "password": "r-secret" });
    let (w, proxy) = direct_world(json!({ "direct": {
        "user": APP_USER, "password": APP_PASSWORD, "logins": { "2": own },
    } }));
    w.org
        .db
        .psql(
            ORG_DB,
            "CREATE ROLE org2_reader LOGIN PASSWORD 'r-secret';
             GRANT USAGE ON SCHEMA public TO org2_reader;
             GRANT SELECT ON ALL TABLES IN SCHEMA public TO org2_reader;",
        )
        .unwrap();
    let sql = "SELECT count(*) FROM documents WHERE organization_id = 2";
    let c = client(&proxy).await;
    assert_eq!(
        crate::direct::one_i64(&c.simple_query(sql).await.unwrap()),
        100
    );
    assert_eq!(org_ran(&w, sql), 1, "{}", w.org.db.log_contents());
    let log = w.org.db.log_contents();
    let line = log.lines().find(|l| l.contains(sql)).unwrap();
    assert!(line.contains(&format!("org2_reader@{ORG_DB}")), "{line}");

    // From a file, with a wrong password: the statement is answered through the cloud.
    let dir = lokadb_tests::TempDir::new("lokadb-direct-logins").unwrap();
    let file = dir.path().join("logins.json");
    std::fs::write(
        &file,
        json!({ "2": { "user": "org2_reader", "password": "wrong" } }).to_string(),
    )
    .unwrap();
    let wrong = crate::direct::direct_proxy(
        &w,
        json!({ "direct": { "user": APP_USER, "password": APP_PASSWORD, "logins_file": file } }),
        &[],
    );
    let c = client(&wrong).await;
    assert_eq!(
        crate::direct::one_i64(&c.simple_query(sql).await.unwrap()),
        100
    );
    assert_eq!(
        org_ran(&w, sql),
        1,
        "the wrong login reached the organization's database"
    );
    assert!(
        wrong.wait_for_output(
            "refused the login of org2_reader",
            std::time::Duration::from_secs(20)
        ),
        "{}",
        wrong.output()
    );

    let missing = dir.path().join("missing.json");
    let mut config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(wrong.config_path()).unwrap()).unwrap();
    config["databases"]["app"]["direct"]["logins_file"] = json!(missing);
    let e = Proxy::start(&config)
        .err()
        .unwrap_or_else(|| panic!("a missing logins file stops the start"));
    assert!(e.to_string().contains("logins_file"), "{e}");

    // The password in an environment variable: the login works as from the file.
    let from_env = json!({ "direct": { "user": APP_USER, "password": APP_PASSWORD,
        "logins": { "2": { "user": "org2_reader", "password_env": "ORG2_READER_PASSWORD" } } } });
    let env = crate::direct::direct_proxy(
        &w,
        from_env.clone(),
        &[("ORG2_READER_PASSWORD", "r-secret")],
    );
    let c = client(&env).await;
    assert_eq!(
        crate::direct::one_i64(&c.simple_query(sql).await.unwrap()),
        100
    );
    assert_eq!(org_ran(&w, sql), 2, "{}", env.output());
    let log = w.org.db.log_contents();
    let last = log.lines().rev().find(|l| l.contains(sql)).unwrap();
    assert!(last.contains(&format!("org2_reader@{ORG_DB}")), "{last}");
    // Not set: the proxy does not start, and says which variable.
    let mut config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(env.config_path()).unwrap()).unwrap();
    config["databases"]["app"]["direct"]["logins"]["2"]["password_env"] =
        json!("LOKADB_TEST_UNSET_PASSWORD");
    let e = Proxy::start(&config)
        .err()
        .unwrap_or_else(|| panic!("an unset password_env stops the start"));
    assert!(e.to_string().contains("LOKADB_TEST_UNSET_PASSWORD"), "{e}");
}
