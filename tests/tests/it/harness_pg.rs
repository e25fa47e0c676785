//! `pg::Cluster`: a real cluster starts, checks SCRAM passwords, has postgres_fdw, cleans up.

use lokadb_tests::pg::{Cluster, PG_OS_USER};
use tokio_postgres::error::SqlState;
use tokio_postgres::NoTls;

#[tokio::test]
async fn scram_role_logs_in_with_its_password_and_is_refused_with_another() {
    let pg = Cluster::start().unwrap();
    pg.create_role("alice", "s3cret pass'word").unwrap();
    pg.create_database("alice_db", "alice").unwrap();

    let stored = pg
        .psql(
            "postgres",
            "SELECT left(rolpassword, 19) FROM pg_authid WHERE rolname = 'alice'",
        )
        .unwrap();
    assert_eq!(stored, "SCRAM-SHA-256$4096:");

    let client = pg
        .client("alice", "s3cret pass'word", "alice_db")
        .await
        .unwrap();
    let row = client
        .query_one("SELECT current_user::text, current_database()::text", &[])
        .await
        .unwrap();
    assert_eq!(row.get::<_, String>(0), "alice");
    assert_eq!(row.get::<_, String>(1), "alice_db");

    let err = tokio_postgres::connect(&pg.dsn("alice", "wrong", "alice_db"), NoTls)
        .await
        .err()
        .expect("a wrong password must be refused");
    assert_eq!(err.code(), Some(&SqlState::INVALID_PASSWORD), "{err}");

    let url_client =
        tokio_postgres::connect(&pg.url("alice", "s3cret pass'word", "alice_db"), NoTls).await;
    assert!(
        url_client.is_ok(),
        "url() works too: {:?}",
        url_client.err()
    );
}

#[tokio::test]
async fn superuser_client_and_postgres_fdw_work() {
    let pg = Cluster::start().unwrap();
    let su = pg.superuser_client().await.unwrap();
    let is_super: String = su
        .query_one("SELECT current_setting('is_superuser')", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(is_super, "on");

    let port = pg.port();
    let out = pg
        .psql(
            "postgres",
            &format!(
                "CREATE EXTENSION postgres_fdw;
                 CREATE TABLE t (x int);
                 INSERT INTO t VALUES (1), (2), (3);
                 CREATE SERVER self FOREIGN DATA WRAPPER postgres_fdw
                     OPTIONS (host '127.0.0.1', port '{port}', dbname 'postgres');
                 CREATE USER MAPPING FOR postgres SERVER self
                     OPTIONS (user 'postgres', password 'postgres');
                 CREATE FOREIGN TABLE ft (x int) SERVER self OPTIONS (table_name 't');
                 SELECT sum(x) FROM ft;"
            ),
        )
        .unwrap();
    assert_eq!(out, "6");
}

#[test]
fn psql_reports_the_servers_error() {
    let pg = Cluster::start().unwrap();
    let err = pg.psql("postgres", "SELECT 1/0").unwrap_err().to_string();
    assert!(err.contains("division by zero"), "{err}");
    assert_eq!(pg.psql("postgres", "SELECT 40 + 2").unwrap(), "42");
}

#[test]
fn builder_settings_reach_the_server() {
    let pg = Cluster::builder()
        .setting("max_connections", "1100")
        .start()
        .unwrap();
    assert_eq!(pg.psql("postgres", "SHOW max_connections").unwrap(), "1100");
    assert_eq!(pg.psql("postgres", "SHOW fsync").unwrap(), "off");
    assert_eq!(
        pg.psql("postgres", "SHOW password_encryption").unwrap(),
        "scram-sha-256"
    );
}

#[test]
fn runs_unprivileged_and_is_gone_after_drop() {
    let pg = Cluster::start().unwrap();
    let dir = pg.dir().to_path_buf();
    let pid = pg.pid().unwrap();
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let uid = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|l| l.split_whitespace().next())
        .unwrap();
    if unsafe { libc::geteuid() } == 0 {
        let id = std::process::Command::new("id")
            .args(["-u", PG_OS_USER])
            .output()
            .unwrap();
        assert_eq!(uid, String::from_utf8_lossy(&id.stdout).trim());
    }
    assert!(pg.log_path().exists());
    assert!(dir.join("data").join("PG_VERSION").exists());
    drop(pg);
    assert!(!dir.exists(), "{} must be removed", dir.display());
    assert!(!std::path::Path::new(&format!("/proc/{pid}")).exists());
}

#[test]
fn cluster_is_cleaned_up_when_the_test_panics() {
    let dir = std::sync::Mutex::new(None);
    let pid = std::sync::Mutex::new(None);
    let result = std::panic::catch_unwind(|| {
        let pg = Cluster::start().unwrap();
        *dir.lock().unwrap() = Some(pg.dir().to_path_buf());
        *pid.lock().unwrap() = pg.pid();
        panic!("test failure while the cluster runs");
    });
    assert!(result.is_err());
    let dir = dir.into_inner().unwrap().unwrap();
    let pid = pid.into_inner().unwrap().unwrap();
    assert!(!dir.exists(), "{} must be removed", dir.display());
    assert!(!std::path::Path::new(&format!("/proc/{pid}")).exists());
}

#[test]
fn clusters_started_in_parallel_are_independent() {
    let handles: Vec<_> = (0..3)
        .map(|i| {
            std::thread::spawn(move || {
                let pg = Cluster::start().unwrap();
                pg.psql("postgres", &format!("CREATE TABLE only_in_{i} ()"))
                    .unwrap();
                let tables = pg
                    .psql(
                        "postgres",
                        "SELECT string_agg(relname, ',') FROM pg_class WHERE relname LIKE 'only_in_%'",
                    )
                    .unwrap();
                (pg.port(), tables, i)
            })
        })
        .collect();
    let mut ports = Vec::new();
    for h in handles {
        let (port, tables, i) = h.join().unwrap();
        assert_eq!(tables, format!("only_in_{i}"));
        ports.push(port);
    }
    ports.sort();
    ports.dedup();
    assert_eq!(ports.len(), 3);
}
