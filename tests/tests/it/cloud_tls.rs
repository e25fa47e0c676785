//! TLS from the proxy to the cloud, against a cluster that accepts only `hostssl` (as
//! managed Postgres does): `sslmode` from `prefer` to `verify-full` with a throwaway CA, a
//! client certificate, the watcher, the auth query and an admin command over TLS, and each
//! way it must fail, with the reason in the proxy's log and the proxy still serving.

use crate::admin_cli::{lokadb, ok, stderr};
use crate::world::{self, connect, sqlstate, APP_PASSWORD, APP_USER, AUTH_PASSWORD, AUTH_USER};
use lokadb_tests::certs::TestCa;
use lokadb_tests::pg::Cluster;
use lokadb_tests::proxy::Proxy;
use lokadb_tests::TempDir;
use serde_json::json;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The server certificate's only name: the proxy reaches it as `hostaddr=127.0.0.1`.
const CLOUD_NAME: &str = "cloud.lokadb.test";

struct TlsCloud {
    cloud: Cluster,
    /// The CA that signed the server's and the client's certificates.
    ca: PathBuf,
    /// Another CA, which signed neither.
    other_ca: PathBuf,
    client_cert: PathBuf,
    client_key: PathBuf,
    _dir: TempDir,
}

impl TlsCloud {
    /// A cloud with TLS on and only `hostssl` lines; `None` (test skipped) when the
    /// server was built without TLS.
    fn start() -> Option<TlsCloud> {
        let cloud = Cluster::builder().start().unwrap();
        if !cloud.has_tls().unwrap() {
            eprintln!(
                "skipped: PostgreSQL {} in {} has no TLS (run with LOKADB_PG_BIN=/usr/lib/postgresql/15/bin)",
                cloud.version(),
                cloud.bin_dir().display()
            );
            return None;
        }
        cloud.create_role(APP_USER, APP_PASSWORD).unwrap();
        cloud.create_database("app", APP_USER).unwrap();
        world::create_auth_role(&cloud).unwrap();
        let dir = TempDir::new("lokadb-cloud-tls").unwrap();
        let ca = TestCa::new("LokaDB cloud CA").unwrap();
        let (cert, key) = ca.issue(CLOUD_NAME, &[CLOUD_NAME]).unwrap();
        cloud
            .put_file("server.crt", cert.as_bytes(), 0o600)
            .unwrap();
        cloud.put_file("server.key", key.as_bytes(), 0o600).unwrap();
        cloud
            .put_file("ca.crt", ca.pem().as_bytes(), 0o600)
            .unwrap();
        let write = |name: &str, text: &str| {
            let path = dir.path().join(name);
            std::fs::write(&path, text).unwrap();
            path
        };
        let (client_cert, client_key) = ca.issue(APP_USER, &[]).unwrap();
        let tls = TlsCloud {
            ca: write("ca.crt", &ca.pem()),
            other_ca: write("other.crt", &TestCa::new("Another CA").unwrap().pem()),
            client_cert: write("client.crt", &client_cert),
            client_key: write("client.key", &client_key),
            cloud,
            _dir: dir,
        };
        tls.cloud
            .psql(
                "postgres",
                "ALTER SYSTEM SET ssl = on;\n\
                 ALTER SYSTEM SET ssl_cert_file = 'server.crt';\n\
                 ALTER SYSTEM SET ssl_key_file = 'server.key';\n\
                 ALTER SYSTEM SET ssl_ca_file = 'ca.crt';",
            )
            .unwrap();
        tls.hba("scram-sha-256");
        Some(tls)
    }

    /// Only TLS connections from 127.0.0.1, authenticated by `method` (and options).
    fn hba(&self, method: &str) {
        let hba = format!("local all all trust\nhostssl all all 127.0.0.1/32 {method}\n");
        self.cloud
            .put_file("pg_hba.conf", hba.as_bytes(), 0o600)
            .unwrap();
        self.cloud
            .psql("postgres", "SELECT pg_reload_conf()")
            .unwrap();
        // The reload is asynchronous: wait until a plain login is refused.
        let deadline = Instant::now() + Duration::from_secs(30);
        let plain = self.cloud.dsn(APP_USER, APP_PASSWORD, "app");
        loop {
            let dsn = plain.clone();
            let refused = std::thread::spawn(move || postgres_refuses_plain(&dsn))
                .join()
                .unwrap();
            if refused {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the cloud still accepts plain TCP"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The proxy's `cloud` for this cluster, reached at 127.0.0.1 under `name`.
    fn cloud_string(&self, name: &str, tls: &str) -> String {
        format!(
            "host={name} hostaddr=127.0.0.1 port={} dbname=app {tls}",
            self.cloud.port()
        )
    }

    fn proxy(&self, cloud: &str) -> anyhow::Result<Proxy> {
        let mut config = world::config(&self.cloud, json!({}));
        config["databases"]["app"]["cloud"] = json!(cloud);
        Proxy::start(&config)
    }
}

fn postgres_refuses_plain(dsn: &str) -> bool {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async { connect(dsn).await.is_err() })
}

fn dsn(proxy: &Proxy) -> String {
    format!(
        "host=127.0.0.1 port={} user={APP_USER} password={APP_PASSWORD} dbname=app connect_timeout=30",
        proxy.port()
    )
}

/// A client through `proxy` sees a TLS connection to the cloud.
async fn assert_served_over_tls(proxy: &Proxy) {
    let c = match connect(&dsn(proxy)).await {
        Ok(c) => c,
        Err(e) => panic!("{e:?}; proxy output:\n{}", proxy.output()),
    };
    let ssl: bool = c
        .query_one(
            "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(ssl, "the cloud backend's connection is not TLS");
}

/// A client through `proxy` is refused with 08001 and the proxy logs `cause`; the proxy
/// keeps running and refuses the next client the same way.
async fn assert_refused(proxy: &Proxy, cause: &str) {
    for _ in 0..2 {
        let e = connect(&dsn(proxy)).await.unwrap_err();
        assert_eq!(sqlstate(&e), "08001", "{e:?}");
    }
    assert!(
        proxy.wait_for_output(cause, Duration::from_secs(20)),
        "the proxy's log does not say {cause:?}:\n{}",
        proxy.output()
    );
}

fn path(p: &Path) -> String {
    p.display().to_string()
}

#[tokio::test]
async fn a_cloud_that_accepts_only_tls() {
    let Some(t) = TlsCloud::start() else { return };
    let ca = path(&t.ca);

    // verify-full: the chain and the name.
    let full = t
        .proxy(&t.cloud_string(CLOUD_NAME, &format!("sslmode=verify-full sslrootcert={ca}")))
        .unwrap();
    assert_served_over_tls(&full).await;
    // The auth query ran over TLS (the login above needed it); the watcher too.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let watcher = t
            .cloud
            .psql(
                "postgres",
                "SELECT count(*) FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid) \
                 WHERE a.application_name = 'lokadb meta' AND s.ssl",
            )
            .unwrap();
        if watcher.trim() == "1" {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the metadata watcher has no TLS connection; proxy output:\n{}",
            full.output()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // An admin command over TLS, the TLS words in either form of connection string.
    let admin = format!(
        "host={CLOUD_NAME} hostaddr=127.0.0.1 port={} user={AUTH_USER} password={AUTH_PASSWORD} dbname=app sslmode=verify-full sslrootcert={ca}",
        t.cloud.port()
    );
    ok(&lokadb(&admin, &["init"]));
    let url = format!(
        "postgresql://{AUTH_USER}:{AUTH_PASSWORD}@{CLOUD_NAME}:{}/app?hostaddr=127.0.0.1&sslmode=verify-full&sslrootcert={}",
        t.cloud.port(),
        ca.replace('/', "%2F")
    );
    ok(&lokadb(&url, &["status"]));
    let plain = lokadb(&admin.replace("verify-full", "disable"), &["status"]);
    assert!(
        stderr(&plain).contains("no encryption"),
        "{}",
        stderr(&plain)
    );
    let unusable = lokadb(
        &admin.replace(&format!(" sslrootcert={ca}"), ""),
        &["status"],
    );
    assert_eq!(unusable.status.code(), Some(2), "{}", stderr(&unusable));
    assert!(
        stderr(&unusable).contains("needs sslrootcert"),
        "{}",
        stderr(&unusable)
    );

    // verify-ca checks the chain, not the name; require without a root checks neither;
    // prefer takes TLS when offered.
    for tls in [
        format!("sslmode=verify-ca sslrootcert={ca}"),
        "sslmode=require".to_owned(),
        "sslmode=prefer".to_owned(),
        String::new(),
    ] {
        let p = t
            .proxy(&t.cloud_string("elsewhere.lokadb.test", &tls))
            .unwrap();
        assert_served_over_tls(&p).await;
    }

    // What must fail, each with its reason in the log.
    let wrong_name = t
        .proxy(&t.cloud_string(
            "elsewhere.lokadb.test",
            &format!("sslmode=verify-full sslrootcert={ca}"),
        ))
        .unwrap();
    assert_refused(&wrong_name, "certificate not valid for name").await;
    let wrong_ca = t
        .proxy(&t.cloud_string(
            CLOUD_NAME,
            &format!("sslmode=verify-full sslrootcert={}", path(&t.other_ca)),
        ))
        .unwrap();
    assert_refused(&wrong_ca, "invalid peer certificate").await;
    // Plain TCP: the cloud refuses the auth query's login, and says why.
    let plain = t
        .proxy(&t.cloud_string(CLOUD_NAME, "sslmode=disable"))
        .unwrap();
    assert_refused(&plain, "no encryption").await;
    // The proxy that verifies is not disturbed by the others' failures.
    assert_served_over_tls(&full).await;

    // Files that cannot be used stop the start, naming the file.
    let missing = t.dir_path("missing.crt");
    let e = t
        .proxy(&t.cloud_string(
            CLOUD_NAME,
            &format!("sslmode=verify-full sslrootcert={missing}"),
        ))
        .err()
        .unwrap_or_else(|| panic!("a missing root certificate stops the start"));
    assert!(
        e.to_string().contains("databases.app.cloud") && e.to_string().contains(&missing),
        "{e}"
    );

    // A cloud that asks for a client certificate.
    t.hba("scram-sha-256 clientcert=verify-ca");
    let without = t
        .proxy(&t.cloud_string(CLOUD_NAME, &format!("sslmode=verify-full sslrootcert={ca}")))
        .unwrap();
    assert_refused(&without, "valid client certificate").await;
    let with = t
        .proxy(&t.cloud_string(
            CLOUD_NAME,
            &format!(
                "sslmode=verify-full sslrootcert={ca} sslcert={} sslkey={}",
                path(&t.client_cert),
                path(&t.client_key)
            ),
        ))
        .unwrap();
    assert_served_over_tls(&with).await;
}

impl TlsCloud {
    fn dir_path(&self, name: &str) -> String {
        path(&self._dir.path().join(name))
    }
}
