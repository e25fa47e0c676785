//! Organization databases behind agents, a relay, and a cloud database reaching them
//! through postgres_fdw: the fixture of the tunnel tests.

use anyhow::Result;
use lokadb_tests::agent::Agent;
use lokadb_tests::certs::TestCerts;
use lokadb_tests::link::LatencyLink;
use lokadb_tests::pg::Cluster;
use lokadb_tests::proxy::{Proxy, RelayAddrs};
use lokadb_tests::TempDir;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use std::net::SocketAddr;
use std::time::Duration;

pub const APP_USER: &str = "app";
pub const APP_PASSWORD: &str = "app-secret";
/// The organization's database name in its own cluster.
pub const ORG_DB: &str = "orgdb";

/// One organization: its database and the token of its agent.
pub struct Org {
    pub id: String,
    pub token: String,
    pub db: Cluster,
}

impl Org {
    /// A cluster with role `app`, database `orgdb` and a table `items` of 1000 rows.
    pub fn start(id: &str) -> Result<Org> {
        // Migrations are prepared in organizations' databases (two-phase commit).
        let db = Cluster::builder()
            .setting("max_connections", "300")
            .setting("max_prepared_transactions", "10")
            .start()?;
        db.create_role(APP_USER, APP_PASSWORD)?;
        db.create_database(ORG_DB, APP_USER)?;
        db.psql(
            ORG_DB,
            &format!(
                "CREATE TABLE items (id int PRIMARY KEY, organization_id text NOT NULL, body text);
                 INSERT INTO items SELECT g, '{id}', 'row ' || g FROM generate_series(1, 1000) g;
                 ALTER TABLE items OWNER TO {APP_USER};"
            ),
        )?;
        Ok(Org {
            id: id.to_owned(),
            token: format!("{id}.{:032x}", rand::random::<u128>()),
            db,
        })
    }

    /// Lets role `raw` log in without a password over TCP, for raw-protocol clients.
    pub fn trust_raw_role(&self) -> Result<()> {
        self.db.psql(
            "postgres",
            &format!("CREATE ROLE raw LOGIN; GRANT {APP_USER} TO raw"),
        )?;
        let hba = self.db.data_dir().join("pg_hba.conf");
        let old = std::fs::read_to_string(&hba)?;
        std::fs::write(&hba, format!("host all raw 127.0.0.1/32 trust\n{old}"))?;
        self.db.psql("postgres", "SELECT pg_reload_conf()")?;
        Ok(())
    }

    /// The `relay.tokens` value for this organization's token.
    pub fn token_hash(&self) -> String {
        token_hash(&self.token)
    }
}

/// `org add ID --via-relay R… --dbname orgdb --user app --password …`, then `extra`: an
/// organization registered through `relays` (each `HOST:PORT`) as the tests do.
pub fn org_add<'a>(id: &'a str, relays: &'a [String], extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec!["org", "add", id];
    for relay in relays {
        args.extend(["--via-relay", relay.as_str()]);
    }
    args.extend([
        "--dbname",
        ORG_DB,
        "--user",
        APP_USER,
        "--password",
        APP_PASSWORD,
    ]);
    args.extend_from_slice(extra);
    args
}

/// `sha256:<hex>` of a token, as `lokadb token new` prints it.
pub fn token_hash(token: &str) -> String {
    let digest = Sha256::digest(token.as_bytes());
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    format!("sha256:{hex}")
}

/// Test certificates in a directory that lives as long as the fixture.
pub struct Certs {
    _dir: TempDir,
    pub files: TestCerts,
}

impl Certs {
    pub fn new() -> Result<Certs> {
        let dir = TempDir::new("lokadb-certs")?;
        let files = TestCerts::generate(dir.path())?;
        Ok(Certs { _dir: dir, files })
    }

    /// The CA file's path, made readable by the clusters' unprivileged user (postgres_fdw
    /// reads it in the cloud's server process).
    pub fn readable_ca(&self) -> String {
        use std::os::unix::fs::PermissionsExt;
        let dir = self.files.ca.parent().expect("the CA is in a directory");
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::set_permissions(&self.files.ca, std::fs::Permissions::from_mode(0o644)).unwrap();
        self.files.ca.display().to_string()
    }
}

/// The relay config section for `orgs`, with `extra` merged in.
pub fn relay_section(certs: &Certs, orgs: &[&Org], extra: Value) -> Value {
    let tokens: serde_json::Map<String, Value> = orgs
        .iter()
        .map(|o| (o.id.clone(), Value::String(o.token_hash())))
        .collect();
    let mut relay = json!({
        "agents": "127.0.0.1:0",
        "postgres": "127.0.0.1:0",
        "tls": { "cert": certs.files.cert, "key": certs.files.key },
        "tokens": tokens,
    });
    if let (Some(base), Value::Object(extra)) = (relay.as_object_mut(), extra) {
        for (k, v) in extra {
            base.insert(k, v);
        }
    }
    relay
}

/// `lokadb relay` for `orgs`.
pub fn start_relay(
    certs: &Certs,
    orgs: &[&Org],
    extra: Value,
    env: &[(&str, &str)],
) -> Result<Proxy> {
    let mut b = Proxy::builder(json!({ "relay": relay_section(certs, orgs, extra) })).relay_only();
    for (k, v) in env {
        b = b.env(k, v);
    }
    b.start()
}

/// The addresses of a running relay.
pub fn addrs(relay: &Proxy) -> RelayAddrs {
    relay.relay().expect("a relay")
}

/// An agent for `org` dialing `relay` (an address: the relay's, or a latency link's).
pub fn start_agent(certs: &Certs, org: &Org, relay: SocketAddr, extra: &[&str]) -> Result<Agent> {
    start_agent_env(certs, org, relay, extra, &[])
}

/// [`start_agent`] with environment variables.
pub fn start_agent_env(
    certs: &Certs,
    org: &Org,
    relay: SocketAddr,
    extra: &[&str],
    env: &[(&str, &str)],
) -> Result<Agent> {
    Agent::start(
        &[relay],
        &org.token,
        org.db.addr(),
        &certs.files.ca,
        extra,
        env,
    )
}

/// A latency link in front of the relay's agent port, `one_way` each way.
pub fn link_to(relay: &Proxy, one_way: Duration) -> Result<LatencyLink> {
    Ok(LatencyLink::start(addrs(relay).agents, one_way)?)
}

/// The DSN of `org`'s database through the relay's Postgres listener.
pub fn relay_dsn(relay: &Proxy, org: &str) -> String {
    format!(
        "host=127.0.0.1 port={} user={APP_USER} password={APP_PASSWORD} dbname={org}/{ORG_DB} connect_timeout=10",
        addrs(relay).postgres.port()
    )
}

/// A cloud cluster where `cloud_items_<org>` is a foreign table on each
/// organization's `items`, through the relay.
pub fn start_cloud(relay: &Proxy, orgs: &[&Org]) -> Result<Cluster> {
    let cloud = Cluster::builder()
        .setting("max_connections", "300")
        .start()?;
    cloud.create_role(APP_USER, APP_PASSWORD)?;
    cloud.create_database("app", APP_USER)?;
    let port = addrs(relay).postgres.port();
    let mut sql = String::from("CREATE EXTENSION postgres_fdw;\n");
    for org in orgs {
        let id = &org.id;
        sql.push_str(&format!(
            "CREATE SERVER org_{id} FOREIGN DATA WRAPPER postgres_fdw
               OPTIONS (host '127.0.0.1', port '{port}', dbname '{id}/{ORG_DB}', fetch_size '1000');
             CREATE USER MAPPING FOR {APP_USER} SERVER org_{id}
               OPTIONS (user '{APP_USER}', password '{APP_PASSWORD}');
             CREATE FOREIGN TABLE items_{id} (id int, organization_id text, body text)
               SERVER org_{id} OPTIONS (table_name 'items');
             ALTER FOREIGN TABLE items_{id} OWNER TO {APP_USER};\n"
        ));
    }
    cloud.psql("app", &sql)?;
    Ok(cloud)
}

/// A tokio-postgres client as `app` on the cloud database.
pub async fn cloud_client(cloud: &Cluster) -> Result<tokio_postgres::Client> {
    cloud.client(APP_USER, APP_PASSWORD, "app").await
}

/// `SELECT count(*) FROM items` on an organization's connection.
pub async fn items(c: &tokio_postgres::Client) -> i64 {
    c.query_one("SELECT count(*) FROM items", &[])
        .await
        .unwrap()
        .get(0)
}

/// Organizations 2 (moved with fdw+direct) and 3 (moved with fdw), each in its own cluster
/// behind its agent and one relay; the cloud's database `app`; a proxy with the direct path.
/// The world of the differential suite and of the Django application's tests.
pub struct MovedWorld {
    _certs: Certs,
    pub relay: Proxy,
    pub more_relays: Vec<Proxy>,
    pub orgs: Vec<Org>,
    pub agents: Vec<Agent>,
    pub cloud: Cluster,
    pub proxy: Proxy,
}

/// Builds a [`MovedWorld`]: `schema` makes the cloud's database `app` with its tables and
/// rows (given the cloud; `lokadb init` is its to run), then `tables` are enabled and
/// organizations 2 and 3 registered and moved.
pub fn moved_world(schema: impl FnOnce(&Cluster), tables: &[&str]) -> MovedWorld {
    moved_world_with(schema, tables, &WorldOptions::default())
}

/// What a [`MovedWorld`] may be built with besides its defaults.
#[derive(Default)]
pub struct WorldOptions<'a> {
    /// Merged into the relay's section.
    pub relay: Value,
    /// More arguments of `lokadb org add` (plain TCP to the relay without them).
    pub org_add: &'a [&'a str],
    /// Relays besides the first: every agent dials each, every organization is registered
    /// through all of them.
    pub more_relays: usize,
}

/// The path `org add` arguments in [`WorldOptions`] write for the relay's CA file.
pub const RELAY_CA: &str = "{relay_ca}";

/// [`moved_world`] with options.
pub fn moved_world_with(
    schema: impl FnOnce(&Cluster),
    tables: &[&str],
    options: &WorldOptions<'_>,
) -> MovedWorld {
    use crate::admin_cli::{lokadb, ok};
    let certs = Certs::new().unwrap();
    let orgs = vec![
        crate::moves::org_db("2", false),
        crate::moves::org_db("3", false),
    ];
    let refs: Vec<&Org> = orgs.iter().collect();
    let relay = start_relay(&certs, &refs, options.relay.clone(), &[]).unwrap();
    let more_relays: Vec<Proxy> = (0..options.more_relays)
        .map(|_| start_relay(&certs, &refs, options.relay.clone(), &[]).unwrap())
        .collect();
    let all: Vec<&Proxy> = std::iter::once(&relay).chain(&more_relays).collect();
    let dialled: Vec<SocketAddr> = all.iter().map(|r| addrs(r).agents).collect();
    let agents = orgs
        .iter()
        .map(|o| Agent::start(&dialled, &o.token, o.db.addr(), &certs.files.ca, &[], &[]).unwrap())
        .collect();
    for r in &all {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while r.output().matches("agent connected").count() < orgs.len() {
            assert!(std::time::Instant::now() < deadline, "{}", r.output());
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    let cloud = Cluster::builder()
        .setting("max_connections", "100")
        .start()
        .unwrap();
    schema(&cloud);
    let dsn = cloud.superuser_dsn("app");
    for table in tables {
        ok(&lokadb(&dsn, &["enable", table]));
    }
    let via: Vec<String> = all.iter().map(|r| addrs(r).postgres.to_string()).collect();
    let ca = certs.readable_ca();
    for (org, profile) in [("2", "fdw+direct"), ("3", "fdw")] {
        let extra: Vec<&str> = options
            .org_add
            .iter()
            .map(|a| if *a == RELAY_CA { ca.as_str() } else { a })
            .collect();
        let args = org_add(org, &via, &extra);
        ok(&lokadb(&dsn, &args));
        ok(&lokadb(&dsn, &["move-org", org, "--profile", profile]));
    }
    let proxy = direct_proxy(&cloud, 2);
    MovedWorld {
        _certs: certs,
        relay,
        more_relays,
        orgs,
        agents,
        cloud,
        proxy,
    }
}

/// A proxy in front of the cloud's database `app`, its direct path logging in as `app`,
/// `route_log` on; returned once it has loaded `orgs` organizations.
pub fn direct_proxy(cloud: &Cluster, orgs: usize) -> Proxy {
    direct_proxy_with(cloud, orgs, json!({}))
}

/// [`direct_proxy`] with `extra` merged into its configuration's top level.
pub fn direct_proxy_with(cloud: &Cluster, orgs: usize, extra: Value) -> Proxy {
    // A second proxy in front of the same cloud finds the role there.
    let exists = cloud
        .psql(
            "postgres",
            "SELECT count(*) FROM pg_roles WHERE rolname = 'lokadb_auth'",
        )
        .unwrap();
    if exists.trim() == "0" {
        crate::world::create_auth_role(cloud).unwrap();
    }
    let mut config = json!({
        "listen": "127.0.0.1:0",
        "route_log": true,
        "databases": { "app": {
            "cloud": format!("host=127.0.0.1 port={} dbname=app", cloud.port()),
            "auth_user": "lokadb_auth",
            "auth_password": "auth-secret",
            "direct": { "user": APP_USER, "password": APP_PASSWORD },
        } },
    });
    if let (Some(config), Some(extra)) = (config.as_object_mut(), extra.as_object()) {
        config.extend(extra.clone());
    }
    let proxy = Proxy::builder(config).start().unwrap();
    assert!(
        proxy.wait_for_output(&format!("organizations={orgs}"), Duration::from_secs(10)),
        "{}",
        proxy.output()
    );
    proxy
}
