//! The direct login is the proxy's, not the client's (issue 22): only a role that may
//! write organizations' rows opens the gate of direct writes.

use crate::direct::{client, direct_world, org_ran};
use crate::world::{connect, sqlstate};
use lokadb_tests::proxy::Proxy;
use serde_json::json;

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
