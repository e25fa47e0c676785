//! TLS between the cloud (postgres_fdw) or the proxy (direct path) and the relay's Postgres
//! listener: `lokadb org add` records `sslmode=verify-full` and the relay's CA in the
//! organization's server, the direct path verifies the relay by the same options, and a
//! relay with `postgres_tls = "require"` serves nothing in plain text. Needs a PostgreSQL
//! whose libpq has TLS (the distribution's 15; skipped, with a message, where not).

use crate::admin_cli::{lokadb, ok, stderr};
use crate::several_proxies::{dsn, last_route, world_with};
use crate::tunnel_world::{addrs, org_add, WorldOptions, APP_PASSWORD, APP_USER, ORG_DB, RELAY_CA};
use crate::world::connect;
use lokadb_tests::certs::TestCa;
use lokadb_tests::pg::Cluster;
use lokadb_tests::proxy::Proxy;
use serde_json::json;
use std::time::Duration;

/// Whether this PostgreSQL can speak TLS (its libpq too: same build).
fn postgres_has_tls() -> bool {
    let probe = Cluster::builder().start().unwrap();
    let tls = probe.has_tls().unwrap();
    if !tls {
        eprintln!(
            "skipped: PostgreSQL {} in {} has no TLS (run with LOKADB_PG_BIN=/usr/lib/postgresql/15/bin)",
            probe.version(),
            probe.bin_dir().display()
        );
    }
    tls
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cloud_and_the_proxy_reach_the_relay_over_verified_tls() {
    if !postgres_has_tls() {
        return;
    }
    // Only TLS on the relay's Postgres listener: anything plain would be refused.
    let w = world_with(&WorldOptions {
        relay: json!({ "postgres_tls": "require" }),
        org_add: &[
            "--relay-sslmode",
            "verify-full",
            "--relay-sslrootcert",
            RELAY_CA,
        ],
        ..WorldOptions::default()
    });
    let cloud_dsn = w.cloud.superuser_dsn("app");

    // The server's options say what org add recorded.
    let options = w
        .cloud
        .psql(
            "app",
            "SELECT array_to_string(srvoptions, ' ') FROM pg_foreign_server WHERE srvname = 'lokadb_org_2'",
        )
        .unwrap();
    assert!(options.contains("sslmode=verify-full"), "{options}");
    assert!(options.contains("sslrootcert="), "{options}");

    // Organization 3 (fdw) through the cloud, 2 (fdw+direct) in its database: both over
    // the relay's TLS.
    let c = connect(&dsn(&w.proxy)).await.unwrap();
    let read3 = "SELECT count(*) FROM notes WHERE organization_id = 3";
    let rows = c.query_one(read3, &[]).await.unwrap();
    assert_eq!(rows.get::<_, i64>(0), 10);
    let read2 = "SELECT count(*) FROM notes WHERE organization_id = 2";
    let rows = c.simple_query(read2).await.unwrap();
    assert_eq!(crate::direct::rows(&rows), vec!["10"]);
    assert_eq!(
        last_route(&w.proxy, read2),
        "\"direct\"",
        "{}",
        w.proxy.output()
    );
    let update = "UPDATE notes SET body = 'over tls' WHERE organization_id = 3 AND id = 21";
    assert_eq!(c.execute(update, &[]).await.unwrap(), 1);

    // A plain client is refused by the relay, saying why.
    let plain = format!(
        "host=127.0.0.1 port={} user={APP_USER} password={APP_PASSWORD} dbname=2/{ORG_DB} sslmode=disable",
        addrs(&w.relay).postgres.port()
    );
    let Err(err) = connect(&plain).await else {
        panic!("a plain client is served by a relay that requires TLS");
    };
    let refusal = err.as_db_error().expect("refused by the relay");
    assert!(refusal.message().contains("accepts only TLS"), "{err:?}");

    // org add: verify-full needs a CA; a CA that did not sign the relay's certificate, or
    // plain TCP to a relay that requires TLS, fail and change nothing.
    let via = [addrs(&w.relay).postgres.to_string()];
    let add = |extra: &[&str]| lokadb(&cloud_dsn, &org_add("2b", &via, extra));
    let out = add(&["--relay-sslmode", "verify-full"]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("--relay-sslrootcert"),
        "{}",
        stderr(&out)
    );
    let other = w.cloud.data_dir().join("other-ca.crt");
    let other_ca = TestCa::new("Another CA").unwrap();
    w.cloud
        .put_file("other-ca.crt", other_ca.pem().as_bytes(), 0o644)
        .unwrap();
    let other = other.display().to_string();
    let out = add(&[
        "--relay-sslmode",
        "verify-full",
        "--relay-sslrootcert",
        &other,
    ]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("certificate"), "{}", stderr(&out));
    let out = add(&["--relay-sslmode", "disable"]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("accepts only TLS"),
        "{}",
        stderr(&out)
    );
    let left = w
        .cloud
        .psql("app", "SELECT count(*) FROM lokadb.org WHERE id = '2b'")
        .unwrap();
    assert_eq!(left.trim(), "0");

    // The admin commands reach the organization by the same TLS (move-back connects to its
    // database through the relay).
    ok(&lokadb(&cloud_dsn, &["verify", "2"]));

    // A proxy told to trust another CA for the relay does not speak plain instead: the
    // direct path fails, names the reason, and the statement is served through the cloud.
    let strict = Proxy::builder(json!({
        "listen": "127.0.0.1:0",
        "route_log": true,
        "databases": { "app": {
            "cloud": format!("host=127.0.0.1 port={} dbname=app", w.cloud.port()),
            "auth_user": "lokadb_auth",
            "auth_password": "auth-secret",
            "direct": { "user": APP_USER, "password": APP_PASSWORD, "sslrootcert": other },
        } },
    }))
    .start()
    .unwrap();
    assert!(strict.wait_for_output("organizations=2", Duration::from_secs(10)));
    let c = connect(&dsn(&strict)).await.unwrap();
    let rows = c.simple_query(read2).await.unwrap();
    assert_eq!(crate::direct::rows(&rows), vec!["10"]);
    assert!(
        strict.wait_for_output("TLS handshake failed", Duration::from_secs(10)),
        "{}",
        strict.output()
    );
}
