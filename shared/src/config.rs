//! The configuration file (`lokadb proxy --config lokadb.json`).
//!
//! Typed throughout: addresses are `SocketAddr`, durations are strings such as
//! `"30s"`, unknown keys are rejected by name. Every field's default is the one
//! documented in `docs/configuration.md` and `tuning.md`.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

pub use crate::conninfo::ConnString;

/// The database name of the console (`admin_users`) on the client listener.
pub const CONSOLE_DB: &str = "lokadb";

/// The whole configuration file.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Address the proxy listens on for applications.
    #[serde(default = "defaults::listen")]
    pub listen: SocketAddr,
    /// TLS for client connections; without it, SSLRequest is answered `N`.
    #[serde(default)]
    pub tls: Option<TlsConfig>,
    /// Authenticated client sessions at once over all cores; past it, SQLSTATE 53300.
    #[serde(default = "defaults::max_connections")]
    pub max_connections: u32,
    /// Clients in the handshake (connected, not yet authenticated) at once over all cores;
    /// past it a new connection is closed at once. They do not count in `max_connections`.
    #[serde(default = "defaults::max_handshakes")]
    pub max_handshakes: u32,
    /// Clients in the handshake at once from one address, on each core.
    #[serde(default = "defaults::max_handshakes_per_address")]
    pub max_handshakes_per_address: u32,
    /// Largest protocol message accepted from a client, in bytes.
    #[serde(default = "defaults::max_message_bytes")]
    pub max_message_bytes: u32,
    /// Time a client has to connect and authenticate.
    #[serde(default = "defaults::auth_timeout", with = "duration")]
    pub auth_timeout: Duration,
    /// On SIGTERM, how long running transactions may take to finish.
    #[serde(default = "defaults::shutdown_timeout", with = "duration")]
    pub shutdown_timeout: Duration,
    /// Log one line per statement with its route.
    #[serde(default)]
    pub route_log: bool,
    /// Record sessions' traffic for replay into `<record>.<core>` (`lokadb proxy --record`).
    #[serde(default)]
    pub record: Option<PathBuf>,
    /// A JSON file mapping role names to passwords or SCRAM verifiers, for setups
    /// without an `auth_user`.
    #[serde(default)]
    pub users_file: Option<PathBuf>,
    /// The databases clients may ask for, by the name they ask for.
    #[serde(default)]
    pub databases: BTreeMap<String, DatabaseConfig>,
    /// The relay agents dial into; run inside `lokadb proxy` when present, or alone
    /// by `lokadb relay`.
    #[serde(default)]
    pub relay: Option<RelayConfig>,
    /// The client listeners of the other proxies in front of the same clouds: a
    /// CancelRequest whose key no session of this proxy has is handed on to each of them
    /// (which hand it to no one else), so a client's cancel works whichever proxy it lands on.
    #[serde(default)]
    pub peers: Vec<SocketAddr>,
    /// Where `GET /metrics` answers in Prometheus' text format (plain HTTP).
    #[serde(default)]
    pub metrics: Option<SocketAddr>,
    /// Roles that may connect to the console, database `lokadb` on the client listener
    /// (authenticated as any client is).
    #[serde(default)]
    pub admin_users: Vec<String>,
    /// A Unix socket for restarts without refusing a client: a process started with it
    /// takes the listening sockets of the one running there, which then drains; it then
    /// listens there itself for the next.
    #[serde(default)]
    pub handover: Option<PathBuf>,
}

/// The relay: where agents connect, where Postgres clients (postgres_fdw, the
/// proxy's direct path) reach organizations, and who may connect.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RelayConfig {
    /// Address agents dial (TLS).
    pub agents: SocketAddr,
    /// Address of the Postgres listener: database `ORG` or `ORG/DBNAME` reaches that
    /// organization's database through its agent.
    pub postgres: SocketAddr,
    /// Streams open at once over all agents; past it, SQLSTATE 53300.
    #[serde(default = "defaults::max_streams")]
    pub max_streams: u32,
    /// The relay's certificate and key, which agents verify.
    pub tls: TlsConfig,
    /// Organization id → the SHA-256 of its agent token, `"sha256:<64 hex digits>"`
    /// (`lokadb token new ORG` makes both).
    #[serde(default)]
    pub tokens: BTreeMap<String, String>,
    /// On SIGTERM, how long open streams may take to finish.
    #[serde(default = "defaults::drain_timeout", with = "duration")]
    pub drain_timeout: Duration,
    /// How long a Postgres client waits for its organization's agent when none is
    /// connected (one reconnecting: after a relay restart, its own) before 08001.
    #[serde(default = "defaults::agent_wait", with = "duration")]
    pub agent_wait: Duration,
    /// Time a Postgres client has to send its startup packet.
    #[serde(default = "defaults::startup_timeout", with = "duration")]
    pub startup_timeout: Duration,
    /// Connections in their handshake at once on each listener: agents not yet
    /// authenticated, Postgres clients that have not sent their startup packet.
    #[serde(default = "defaults::max_handshakes")]
    pub max_handshakes: u32,
    /// The same from one address, on each listener.
    #[serde(default = "defaults::max_handshakes_per_address")]
    pub max_handshakes_per_address: u32,
    /// TLS on the Postgres listener (postgres_fdw in the cloud, the proxy's direct path),
    /// with the certificate agents verify.
    #[serde(default)]
    pub postgres_tls: PostgresTls,
}

/// Whether the relay's Postgres listener answers an SSLRequest with TLS.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PostgresTls {
    /// TLS for clients that ask (`sslmode=prefer` and up); plain for the others.
    #[default]
    Offer,
    /// TLS or nothing: a client that does not ask is refused (cancel requests excepted:
    /// libpq sends them in plain text).
    Require,
    /// Plain TCP only (an SSLRequest is answered `N`).
    Off,
}

/// TLS certificate and key for client connections (PEM files).
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct TlsConfig {
    /// Certificate chain, PEM.
    pub cert: PathBuf,
    /// Private key, PEM (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
}

/// One database clients can connect to.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct DatabaseConfig {
    /// libpq keyword connection string of the cloud database, e.g.
    /// `"host=10.0.0.5 port=5432 dbname=app"`. `user` and `password` here are ignored:
    /// the proxy logs in as each client's own role.
    pub cloud: String,
    /// Role the proxy logs in as to read the SCRAM verifiers of client roles.
    #[serde(default)]
    pub auth_user: Option<String>,
    /// Password of `auth_user`; `LOKADB_AUTH_PASSWORD` is used when absent.
    #[serde(default)]
    pub auth_password: Option<String>,
    /// The query that returns a role's verifier; `$1` is the role name.
    #[serde(default = "defaults::auth_query")]
    pub auth_query: String,
    /// Keep cloud backends warm between clients of the same role.
    #[serde(default = "defaults::yes")]
    pub upstream_pool: bool,
    /// An idle pooled backend is closed after this long.
    #[serde(default = "defaults::pool_idle_timeout", with = "duration")]
    pub pool_idle_timeout: Duration,
    /// How long a client holds a cloud backend: its whole session (`"session"`), or one
    /// transaction, autocommit statement or extended-protocol batch (`"transaction"`), after
    /// which the backend serves the next client of the same role and startup parameters.
    #[serde(default)]
    pub pool_mode: PoolMode,
    /// The most cloud backends the proxy holds for this database and one role, in use and
    /// idle, over all cores together; clients beyond it wait for one up to `pool_timeout`.
    /// 0: no limit.
    #[serde(default)]
    pub pool_size: u32,
    /// How long a client waits for a cloud backend at `pool_size` before its error.
    #[serde(default = "defaults::pool_timeout", with = "duration")]
    pub pool_timeout: Duration,
    /// With transaction pooling, the most prepared statements a cloud backend keeps: past
    /// it, statements of other sessions are closed before a session's own are prepared
    /// (a session's own are all kept, however many).
    #[serde(default = "defaults::max_prepared_statements")]
    pub max_prepared_statements: u32,
    /// Time allowed to connect and log in to the cloud database (and, on the direct
    /// path, to an organization's database).
    #[serde(default = "defaults::connect_timeout", with = "duration")]
    pub connect_timeout: Duration,
    /// The role the direct path logs in as in organizations' databases (fdw+direct).
    /// Without it, fdw+direct organizations are served through the cloud.
    #[serde(default)]
    pub direct: Option<DirectConfig>,
    /// Share direct connections: each goes back to the core's pool at the end of every
    /// transaction of the organization's, for the next statement of any client (per core,
    /// organization, role and settings).
    #[serde(default = "defaults::yes")]
    pub direct_pool: bool,
    /// The most direct connections the proxy opens to one organization's database (split
    /// between the cores). At the limit a statement waits for one with `direct_pool`, or
    /// goes through the cloud without it.
    #[serde(default = "defaults::direct_max")]
    pub direct_max: u32,
    /// Set `lokadb.statement_org` in the cloud ahead of each statement on LokaDB tables
    /// (the organization the proxy placed it in), for cloud-side triggers and policies.
    #[serde(default = "defaults::yes")]
    pub statement_org: bool,
    /// With `direct`: a read placed by a key map (`WHERE id = $1`, no organization) asks
    /// the cloud's key map for the key's organization first, and goes direct when that is
    /// a direct organization (one more cloud round trip for the other organizations' keys).
    #[serde(default = "defaults::yes")]
    pub direct_key_lookup: bool,
    /// The new-connection freshness check of the routing metadata.
    #[serde(default)]
    pub meta_cache: MetaCacheConfig,
}

/// `pool_mode`: what a client holds a cloud backend for.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PoolMode {
    /// Its whole session (reset with `DISCARD ALL` when it leaves).
    #[default]
    Session,
    /// One transaction (or autocommit statement, or batch up to Sync) at a time.
    Transaction,
}

/// `meta_cache`: how new connections check the routing metadata.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct MetaCacheConfig {
    /// A new connection of a role may reuse the check (the metadata generation and the
    /// role's privileges on the LokaDB tables) another connection of that role made on the
    /// same core within this interval. Absent: every new connection checks.
    #[serde(default, with = "opt_duration")]
    pub verify: Option<Duration>,
}

/// The direct path's login in organizations' databases.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct DirectConfig {
    /// The role; it needs SELECT on the organization's LokaDB tables there.
    pub user: String,
    /// Its password; `LOKADB_DIRECT_PASSWORD` is used when absent.
    #[serde(default)]
    pub password: Option<String>,
    /// Logins of their own for some organizations, by organization id: what one
    /// organization's database is given never opens another's.
    #[serde(default)]
    pub logins: BTreeMap<String, DirectLogin>,
    /// A JSON file of more such logins (`{"ORG": {"user": …, "password": …}}`), read at
    /// start and on SIGHUP, so the passwords need not be in this file. `logins` wins.
    #[serde(default)]
    pub logins_file: Option<PathBuf>,
    /// The CA the direct path verifies the relay's certificate with, where the
    /// organization's postgres_fdw server asks for verification (`sslmode=verify-ca` or
    /// `verify-full`); default: the server's own `sslrootcert` path.
    #[serde(default)]
    pub sslrootcert: Option<PathBuf>,
}

/// One organization's login for the direct path.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct DirectLogin {
    /// The role in the organization's database.
    pub user: String,
    /// Its password (or `password_env`).
    #[serde(default)]
    pub password: String,
    /// The environment variable holding its password instead, read at start and on
    /// SIGHUP (the passwords then live where the service manager keeps secrets).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub password_env: Option<String>,
}

impl DirectLogin {
    /// The login with its password read from `password_env` where it names one.
    ///
    /// # Errors
    ///
    /// Both `password` and `password_env` given, or the variable not set.
    pub fn resolved(&self) -> Result<DirectLogin, String> {
        match &self.password_env {
            None => Ok(self.clone()),
            Some(_) if !self.password.is_empty() => {
                Err("give \"password\" or \"password_env\", not both".to_owned())
            }
            Some(var) => match std::env::var(var) {
                Ok(password) => Ok(DirectLogin {
                    user: self.user.clone(),
                    password,
                    password_env: None,
                }),
                Err(_) => Err(format!(
                    "password_env: the environment variable {var} is not set"
                )),
            },
        }
    }

    /// Reads a `logins_file`.
    ///
    /// # Errors
    ///
    /// A message naming the file and what is wrong with it.
    pub fn load_file(path: &std::path::Path) -> Result<BTreeMap<String, DirectLogin>, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read direct.logins_file {}: {e}", path.display()))?;
        serde_json::from_str(&text).map_err(|e| {
            format!(
                "direct.logins_file {}: expected {{\"ORG\": {{\"user\": …, \"password\": …}}}} (or \"password_env\": VARIABLE): {e}",
                path.display()
            )
        })
    }
}

mod defaults {
    use std::net::SocketAddr;
    use std::time::Duration;

    pub fn listen() -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], 6432))
    }
    pub fn max_connections() -> u32 {
        1000
    }
    pub fn max_handshakes() -> u32 {
        1024
    }
    pub fn max_handshakes_per_address() -> u32 {
        256
    }
    pub fn max_message_bytes() -> u32 {
        256 << 20
    }
    pub fn auth_timeout() -> Duration {
        Duration::from_secs(30)
    }
    pub fn shutdown_timeout() -> Duration {
        Duration::from_secs(30)
    }
    pub fn pool_idle_timeout() -> Duration {
        Duration::from_secs(300)
    }
    pub fn max_streams() -> u32 {
        2048
    }
    pub fn drain_timeout() -> Duration {
        Duration::from_secs(5)
    }
    pub fn agent_wait() -> Duration {
        Duration::from_secs(1)
    }
    pub fn startup_timeout() -> Duration {
        Duration::from_secs(10)
    }
    pub fn pool_timeout() -> Duration {
        Duration::from_secs(30)
    }
    pub fn max_prepared_statements() -> u32 {
        200
    }
    pub fn connect_timeout() -> Duration {
        Duration::from_secs(10)
    }
    pub fn direct_max() -> u32 {
        32
    }
    pub fn auth_query() -> String {
        super::DEFAULT_AUTH_QUERY.to_owned()
    }
    pub fn yes() -> bool {
        true
    }
}

/// The default `auth_query`: the verifier of a role that may log in now.
pub const DEFAULT_AUTH_QUERY: &str = "SELECT rolpassword FROM pg_catalog.pg_authid \
     WHERE rolname = $1 AND rolcanlogin \
     AND (rolvaliduntil IS NULL OR rolvaliduntil > now())";

/// Durations written as `"30s"`, `"1m 30s"`, `"250ms"`.
mod duration {
    use serde::{Deserialize, Deserializer, Serializer};
    use std::time::Duration;

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&humantime::format_duration(*d).to_string())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let s = String::deserialize(d)?;
        humantime::parse_duration(&s)
            .map_err(|e| serde::de::Error::custom(format!("invalid duration {s:?}: {e}")))
    }
}

/// An optional duration, written as for [`duration`].
mod opt_duration {
    use serde::{Deserializer, Serializer};
    use std::time::Duration;

    pub fn serialize<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        match d {
            Some(d) => super::duration::serialize(d, s),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        super::duration::deserialize(d).map(Some)
    }
}

/// Why a configuration could not be loaded.
#[derive(Debug)]
pub enum ConfigError {
    /// The file could not be read.
    Read {
        /// The path given.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The JSON is malformed or does not match the schema (unknown key, wrong type).
    Parse(serde_json::Error),
    /// The values are individually valid but do not make a usable configuration.
    Invalid(String),
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConfigError::Read { path, source } => {
                write!(f, "cannot read config file {}: {source}", path.display())
            }
            ConfigError::Parse(e) => write!(f, "invalid config: {e}"),
            ConfigError::Invalid(msg) => write!(f, "invalid config: {msg}"),
        }
    }
}

impl std::error::Error for ConfigError {}

impl Config {
    /// Reads and validates a config file.
    ///
    /// # Errors
    ///
    /// Any [`ConfigError`]; a missing file is an error, never a fallback to defaults.
    pub fn load(path: &std::path::Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        Config::from_json(&text)
    }

    /// Parses and validates config text.
    ///
    /// # Errors
    ///
    /// [`ConfigError::Parse`] or [`ConfigError::Invalid`].
    pub fn from_json(text: &str) -> Result<Config, ConfigError> {
        let config: Config = serde_json::from_str(text).map_err(ConfigError::Parse)?;
        config.validate()?;
        Ok(config)
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        if self.peers.contains(&self.listen) {
            return bad(format!(
                "\"peers\" lists this proxy's own \"listen\" address {}: name the other proxies only",
                self.listen
            ));
        }
        if self.databases.is_empty() && self.relay.is_none() {
            return bad(
                "nothing to run: name at least one database clients may ask for in \"databases\", or configure a \"relay\"".into(),
            );
        }
        if let Some(relay) = &self.relay {
            relay.validate()?;
        }
        if self.max_connections == 0 {
            return bad("\"max_connections\" must be at least 1".into());
        }
        if self.max_handshakes == 0 || self.max_handshakes_per_address == 0 {
            return bad(
                "\"max_handshakes\" and \"max_handshakes_per_address\" must be at least 1".into(),
            );
        }
        if self.max_message_bytes < 1024 {
            return bad("\"max_message_bytes\" must be at least 1024".into());
        }
        if !self.admin_users.is_empty() && self.databases.contains_key(CONSOLE_DB) {
            return bad(format!(
                "databases.{CONSOLE_DB}: with \"admin_users\" the name {CONSOLE_DB:?} is the console's; give the database another name (its cloud dbname may stay)"
            ));
        }
        for (name, db) in &self.databases {
            ConnString::parse(&db.cloud)
                .map_err(|e| ConfigError::Invalid(format!("databases.{name}.cloud: {e}")))?;
            if db.auth_user.is_none() && self.users_file.is_none() {
                return bad(format!(
                    "databases.{name}: set \"auth_user\" (a role that can read verifiers) or a top-level \"users_file\""
                ));
            }
            if db.direct_max == 0 {
                return bad(format!("databases.{name}.direct_max must be at least 1"));
            }
            if db.pool_mode == PoolMode::Transaction && !db.upstream_pool {
                return bad(format!(
                    "databases.{name}.pool_mode \"transaction\" needs upstream_pool: backends are shared between clients"
                ));
            }
        }
        Ok(())
    }
}

impl RelayConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        if self.max_streams == 0 {
            return bad("relay.max_streams must be at least 1".into());
        }
        if self.max_handshakes == 0 || self.max_handshakes_per_address == 0 {
            return bad(
                "relay.max_handshakes and relay.max_handshakes_per_address must be at least 1"
                    .into(),
            );
        }
        if self.agents == self.postgres && self.agents.port() != 0 {
            return bad(format!(
                "relay.agents and relay.postgres are both {}: they need different addresses",
                self.agents
            ));
        }
        for (org, hash) in &self.tokens {
            if org.is_empty() || org.contains('/') || org == "lokadb_relay" {
                return bad(format!(
                    "relay.tokens: organization id {org:?} must be non-empty, without '/', and not lokadb_relay (the relay's admin database)"
                ));
            }
            parse_token_hash(hash)
                .map_err(|e| ConfigError::Invalid(format!("relay.tokens.{org}: {e}")))?;
        }
        Ok(())
    }
}

/// Parses `"sha256:<64 hex digits>"` into the digest.
///
/// # Errors
///
/// A message saying what the form should be.
pub fn parse_token_hash(s: &str) -> Result<[u8; 32], String> {
    let hex = s.strip_prefix("sha256:").ok_or_else(|| {
        "a token hash is written \"sha256:<64 hex digits>\" (see `lokadb token new`)".to_owned()
    })?;
    if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(format!(
            "a token hash has 64 hex digits after \"sha256:\", got {} characters",
            hex.len()
        ));
    }
    let mut out = [0u8; 32];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).expect("checked hex");
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: &str = r#"{"databases": {"app": {"cloud": "host=127.0.0.1 port=5433 dbname=app", "auth_user": "lokadb_auth"}}}"#;

    #[test]
    fn defaults_apply() {
        let c = Config::from_json(MIN).unwrap();
        assert_eq!(c.max_connections, 1000);
        assert_eq!(
            (c.max_handshakes, c.max_handshakes_per_address),
            (1024, 256)
        );
        assert_eq!(c.max_message_bytes, 256 << 20);
        assert_eq!(c.auth_timeout, Duration::from_secs(30));
        assert!(!c.route_log);
        assert!(c.record.is_none());
        let db = &c.databases["app"];
        assert!(db.upstream_pool);
        assert_eq!(db.auth_query, DEFAULT_AUTH_QUERY);
        assert!(db.direct.is_none() && db.direct_pool && db.statement_org && db.direct_key_lookup);
        assert_eq!(db.direct_max, 32);
        assert_eq!(db.meta_cache.verify, None);
        assert_eq!(
            (db.pool_mode, db.pool_size, db.pool_timeout),
            (PoolMode::Session, 0, Duration::from_secs(30))
        );
        assert_eq!(db.max_prepared_statements, 200);
    }

    #[test]
    fn the_direct_path_and_meta_cache_are_read_and_checked() {
        let c = Config::from_json(&MIN.replace(
            r#""auth_user": "lokadb_auth""#,
            r#""auth_user": "lokadb_auth", "direct": {"user": "d"}, "direct_pool": false, "statement_org": false, "direct_key_lookup": false, "meta_cache": {"verify": "1s"}"#,
        ))
        .unwrap();
        let db = &c.databases["app"];
        assert_eq!(db.direct.as_ref().unwrap().user, "d");
        assert!(db.direct.as_ref().unwrap().password.is_none());
        assert!(!db.direct_pool && !db.statement_org && !db.direct_key_lookup);
        assert_eq!(db.meta_cache.verify, Some(Duration::from_secs(1)));
        for (bad, says) in [
            (r#""meta_cache": {"verify": "soon"}"#, "invalid duration"),
            (
                r#""meta_cache": {"verfiy": "1s"}"#,
                "unknown field `verfiy`",
            ),
            (
                r#""direct": {"user": "d", "pass": "x"}"#,
                "unknown field `pass`",
            ),
            (r#""direct": {}"#, "missing field `user`"),
            (r#""direct_max": 0"#, "direct_max must be at least 1"),
            (r#""pool_mode": "statement""#, "unknown variant `statement`"),
            (
                r#""pool_mode": "transaction", "upstream_pool": false"#,
                "needs upstream_pool",
            ),
        ] {
            let e = Config::from_json(&MIN.replace(
                r#""auth_user": "lokadb_auth""#,
                &format!(r#""auth_user": "lokadb_auth", {bad}"#),
            ))
            .unwrap_err();
            assert!(e.to_string().contains(says), "{bad}: {e}");
        }
    }

    #[test]
    fn handshake_limits_must_admit_someone() {
        for key in ["max_handshakes", "max_handshakes_per_address"] {
            let e =
                Config::from_json(&MIN.replacen('{', &format!("{{\"{key}\": 0, "), 1)).unwrap_err();
            assert!(e.to_string().contains("must be at least 1"), "{key}: {e}");
        }
    }

    #[test]
    fn unknown_keys_are_rejected_by_name() {
        let e = Config::from_json(r#"{"databases": {}, "max_conections": 5}"#).unwrap_err();
        assert!(
            e.to_string().contains("unknown field `max_conections`"),
            "{e}"
        );
        let e = Config::from_json(
            r#"{"databases": {"app": {"cloud": "host=x", "auth_user": "a", "pool": true}}}"#,
        )
        .unwrap_err();
        assert!(e.to_string().contains("unknown field `pool`"), "{e}");
    }

    const RELAY: &str = r#"{"relay": {"agents": "127.0.0.1:7000", "postgres": "127.0.0.1:7001",
        "tls": {"cert": "c.pem", "key": "k.pem"},
        "tokens": {"acme": "sha256:00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff"}}}"#;

    #[test]
    fn a_relay_alone_is_a_config() {
        let c = Config::from_json(RELAY).unwrap();
        let r = c.relay.unwrap();
        assert_eq!(r.max_streams, 2048);
        assert_eq!(r.drain_timeout, Duration::from_secs(5));
        assert_eq!(parse_token_hash(&r.tokens["acme"]).unwrap()[1], 0x11);
        assert!(c.databases.is_empty());
        let e = Config::from_json("{}").unwrap_err();
        assert!(e.to_string().contains("nothing to run"), "{e}");
    }

    #[test]
    fn relay_mistakes_are_named() {
        let e = Config::from_json(&RELAY.replace("sha256:00", "sha1:00")).unwrap_err();
        assert!(e.to_string().contains("relay.tokens.acme"), "{e}");
        let e = Config::from_json(&RELAY.replace("7001", "7000")).unwrap_err();
        assert!(e.to_string().contains("different addresses"), "{e}");
        let e = Config::from_json(&RELAY.replace("\"tokens\"", "\"max_streams\": 0, \"tokens\""))
            .unwrap_err();
        assert!(e.to_string().contains("max_streams"), "{e}");
        let e = Config::from_json(&RELAY.replace("\"acme\"", "\"a/b\"")).unwrap_err();
        assert!(e.to_string().contains("without '/'"), "{e}");
        let e = Config::from_json(&RELAY.replace("\"tokens\"", "\"token\"")).unwrap_err();
        assert!(e.to_string().contains("unknown field `token`"), "{e}");
    }

    #[test]
    fn durations_are_typed() {
        let text = MIN.replacen('{', r#"{"auth_timeout": "1m 30s", "#, 1);
        assert_eq!(
            Config::from_json(&text).unwrap().auth_timeout,
            Duration::from_secs(90)
        );
        let text = MIN.replacen('{', r#"{"auth_timeout": "soon", "#, 1);
        let e = Config::from_json(&text).unwrap_err().to_string();
        assert!(e.contains("invalid duration \"soon\""), "{e}");
    }

    #[test]
    fn a_database_needs_a_way_to_authenticate() {
        let e = Config::from_json(r#"{"databases": {"app": {"cloud": "host=x"}}}"#).unwrap_err();
        assert!(e.to_string().contains("auth_user"), "{e}");
    }
}
