//! A cloud cluster with the roles an application has, and the proxy in front of it.

use anyhow::Result;
use lokadb_tests::pg::Cluster;
use lokadb_tests::proxy::Proxy;
use serde_json::{json, Value};

pub const APP_USER: &str = "app";
pub const APP_PASSWORD: &str = "app-secret";
pub const AUTH_USER: &str = "lokadb_auth";
pub const AUTH_PASSWORD: &str = "auth-secret";

/// The cloud database and a proxy in front of it.
pub struct World {
    pub cloud: Cluster,
    pub proxy: Proxy,
}

impl World {
    /// A cloud cluster with role `app` owning database `app`, and the proxy with the
    /// default configuration plus `extra` (merged at the top level) and `env`.
    pub fn start(extra: Value, env: &[(&str, &str)]) -> Result<World> {
        let cloud = Cluster::builder()
            .setting("max_connections", "300")
            .start()?;
        cloud.create_role(APP_USER, APP_PASSWORD)?;
        cloud.create_database("app", APP_USER)?;
        create_auth_role(&cloud)?;
        let proxy = start_proxy(&cloud, extra, env)?;
        Ok(World { cloud, proxy })
    }

    /// Connection string for `user` through the proxy.
    pub fn dsn_as(&self, user: &str, password: &str) -> String {
        format!(
            "host=127.0.0.1 port={} user={user} password={password} dbname=app",
            self.proxy.port()
        )
    }

    /// Connection string for the application role through the proxy.
    pub fn dsn(&self) -> String {
        self.dsn_as(APP_USER, APP_PASSWORD)
    }

    /// A tokio-postgres client through the proxy.
    pub async fn client(&self) -> Result<tokio_postgres::Client> {
        Ok(connect(&self.dsn()).await?)
    }
}

/// The proxy config for `cloud`, with `extra` merged in at the top level.
pub fn config(cloud: &Cluster, extra: Value) -> Value {
    let mut config = json!({
        "listen": "127.0.0.1:0",
        "databases": {
            "app": {
                "cloud": format!("host=127.0.0.1 port={} dbname=app", cloud.port()),
                "auth_user": AUTH_USER,
                "auth_password": AUTH_PASSWORD,
            }
        }
    });
    if let (Some(base), Value::Object(extra)) = (config.as_object_mut(), extra) {
        for (k, v) in extra {
            base.insert(k, v);
        }
    }
    config
}

/// The role the proxy's `auth_user` logs in as (reads verifiers and the routing metadata).
pub fn create_auth_role(cloud: &Cluster) -> Result<()> {
    cloud.psql(
        "postgres",
        &format!("CREATE ROLE {AUTH_USER} LOGIN SUPERUSER PASSWORD '{AUTH_PASSWORD}'"),
    )?;
    Ok(())
}

pub fn start_proxy(cloud: &Cluster, extra: Value, env: &[(&str, &str)]) -> Result<Proxy> {
    let mut builder = Proxy::builder(config(cloud, extra));
    for (k, v) in env {
        builder = builder.env(k, v);
    }
    builder.start()
}

/// A tokio-postgres client; its connection task runs on the current runtime.
pub async fn connect(dsn: &str) -> Result<tokio_postgres::Client, tokio_postgres::Error> {
    let (client, conn) = tokio_postgres::connect(dsn, tokio_postgres::NoTls).await?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(client)
}

/// The SQLSTATE of a tokio-postgres error (panics with the error when it has none).
pub fn sqlstate(e: &tokio_postgres::Error) -> String {
    match e.code() {
        Some(c) => c.code().to_owned(),
        None => panic!("error without SQLSTATE: {e:?}"),
    }
}

/// Runs `sql` on a new connection to `dsn` in the background; the task returns how long
/// the statement took (for writes that must wait, e.g. behind a pause).
pub fn timed_write(dsn: &str, sql: &'static str) -> tokio::task::JoinHandle<std::time::Duration> {
    let dsn = dsn.to_owned();
    tokio::spawn(async move {
        let w = connect(&dsn).await.unwrap();
        let started = std::time::Instant::now();
        w.execute(sql, &[]).await.unwrap();
        started.elapsed()
    })
}
