//! Process-wide settings ([`Shared`], read-only after start) and the state each
//! executor owns ([`Core`]: pool, auth connections, cancel keys). Sessions reach their
//! core through an `Rc`; nothing here is locked.

use crate::backend::auth_query::{AuthQuery, UsersFile};
use crate::backend::pool::Pool;
use crate::cancel::{CancelRegistry, Peer};
use crate::net::cloud_tls::CloudTls;
use crate::record::Recorder;
use crate::route::meta::CoreMeta;
use crate::scram::Secret;
use lokadb_shared::config::{Config, ConnString, DatabaseConfig, DirectLogin};
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::net::{SocketAddr, ToSocketAddrs};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU32};
use std::sync::Arc;
use std::task::{Context, Waker};

/// A new connection's freshness check: the cloud's metadata generation then, and the
/// role's (read, update) privileges on the LokaDB tables by schema and name.
#[derive(Debug, Clone)]
pub struct Check {
    pub at: std::time::Instant,
    pub generation: i64,
    pub by_name: HashMap<(String, String), (bool, bool)>,
}

/// A configured database with its cloud address resolved.
#[derive(Debug)]
pub struct Database {
    /// The name clients ask for.
    pub name: Rc<str>,
    /// The cloud's address (resolved once at start).
    pub addr: SocketAddr,
    /// The database name in the cloud.
    pub dbname: String,
    /// TLS to the cloud (`None`: plain).
    pub tls: Option<Arc<CloudTls>>,
    /// The configuration block.
    pub config: DatabaseConfig,
}

/// What a reload (SIGHUP) puts in force: the configuration file as read then, and the
/// client TLS and users files it names.
pub struct Settings {
    /// The configuration as last loaded.
    pub config: Arc<Config>,
    /// TLS for clients, if configured.
    pub tls: Option<Arc<rustls::ServerConfig>>,
    /// Users from `users_file`, if configured.
    pub users: Option<UsersFile>,
    /// Each database's organizations' own logins (`direct.logins`, then `direct.logins_file`),
    /// their passwords read (`password_env`).
    pub direct_logins: HashMap<String, std::collections::BTreeMap<String, DirectLogin>>,
}

impl Settings {
    /// Reads the files `config` names.
    ///
    /// # Errors
    ///
    /// Unreadable TLS or users files, a database with an `auth_user` but no password
    /// anywhere.
    pub fn new(config: Config, env_auth_password: bool) -> anyhow::Result<Settings> {
        let tls = config
            .tls
            .as_ref()
            .map(crate::net::tls::server_config)
            .transpose()?;
        let users = config
            .users_file
            .as_deref()
            .map(UsersFile::load)
            .transpose()?;
        let mut direct_logins = HashMap::new();
        for (name, db) in &config.databases {
            if db.auth_user.is_some() && db.auth_password.is_none() && !env_auth_password {
                anyhow::bail!("databases.{name}: auth_user is set but neither auth_password nor LOKADB_AUTH_PASSWORD is");
            }
            let Some(direct) = &db.direct else { continue };
            // The organizations' own logins, their passwords read from the environment
            // where they say so: `logins` wins over `logins_file`.
            let mut logins = match direct.logins_file.as_deref() {
                Some(path) => DirectLogin::load_file(path)
                    .map_err(|e| anyhow::anyhow!("databases.{name}.{e}"))?,
                None => Default::default(),
            };
            logins.extend(direct.logins.clone());
            for (org, login) in &mut logins {
                *login = login
                    .resolved()
                    .map_err(|e| anyhow::anyhow!("databases.{name}.direct.logins.{org}: {e}"))?;
            }
            direct_logins.insert(name.clone(), logins);
        }
        Ok(Settings {
            config: Arc::new(config),
            tls,
            users,
            direct_logins,
        })
    }
}

/// A configured database's cloud, resolved once at start (DNS, certificates).
pub struct Resolved {
    /// The name clients ask for.
    pub name: String,
    /// The cloud's host as configured (for TLS names and the `postgres` crate).
    pub host: String,
    /// Its address.
    pub addr: SocketAddr,
    /// The database name in the cloud.
    pub dbname: String,
    /// TLS to the cloud (`None`: plain).
    pub tls: Option<Arc<CloudTls>>,
}

impl Resolved {
    /// A `postgres` crate configuration for the cloud as `user` (the address resolved at
    /// start, the host name kept for TLS).
    pub fn postgres_config(&self, user: &str, password: String) -> postgres::Config {
        let mut pg = postgres::Config::new();
        pg.host(&self.host)
            .hostaddr(self.addr.ip())
            .port(self.addr.port())
            .dbname(&self.dbname)
            .user(user)
            .password(password)
            .connect_timeout(std::time::Duration::from_secs(10));
        pg
    }
}

/// Everything the cores share.
pub struct Shared {
    /// The configuration at start: what a reload does not change (the listening
    /// addresses, `record`, `metrics`, the relay's addresses) is read here.
    pub config: Config,
    /// What SIGHUP reloads ([`Shared::settings`]).
    settings: std::sync::RwLock<Arc<Settings>>,
    /// Authenticated client sessions now over all cores (`max_connections`; checked per
    /// connection, not per statement).
    pub connections: AtomicU32,
    /// Clients in the handshake now over all cores (`max_handshakes`).
    pub handshakes: AtomicU32,
    /// Set by the signal thread on SIGTERM/SIGINT.
    pub shutdown: Arc<AtomicBool>,
    /// Salts the mock verifiers of unknown roles.
    pub mock_secret: [u8; 32],
    /// The auth password from `LOKADB_AUTH_PASSWORD`, for databases without one.
    pub env_auth_password: Option<String>,
    /// The direct path's password from `LOKADB_DIRECT_PASSWORD`, for databases without one.
    pub env_direct_password: Option<String>,
    /// What the cores and the relay published last, for `GET /metrics`.
    pub published: crate::metrics::Published,
    /// The process this one took its sockets from, while it drains: cancels for its
    /// sessions arrive here now ([`crate::handover::Predecessor`]).
    pub predecessor: std::sync::Mutex<Option<crate::handover::Predecessor>>,
    /// Open cloud backends per database and role over all cores (`pool_size`).
    pub gauges: crate::backend::gauge::Gauges,
    /// With transaction pooling, the session each cloud backend's notifications name.
    pub notifiers: Arc<crate::frontend::tx_pool::Notifiers>,
}

impl Shared {
    /// Builds the shared state, resolving and checking what can be checked up front.
    ///
    /// # Errors
    ///
    /// An unresolvable cloud host, unreadable TLS or users files, a database with an
    /// `auth_user` but no password anywhere.
    pub fn new(config: Config) -> anyhow::Result<Shared> {
        let env_auth_password = std::env::var("LOKADB_AUTH_PASSWORD").ok();
        let env_direct_password = std::env::var("LOKADB_DIRECT_PASSWORD").ok();
        let settings = Settings::new(config.clone(), env_auth_password.is_some())?;
        Ok(Shared {
            config,
            settings: std::sync::RwLock::new(Arc::new(settings)),
            connections: AtomicU32::new(0),
            handshakes: AtomicU32::new(0),
            shutdown: Arc::new(AtomicBool::new(false)),
            mock_secret: rand::random(),
            env_auth_password,
            env_direct_password,
            published: crate::metrics::Published::default(),
            predecessor: std::sync::Mutex::new(None),
            gauges: crate::backend::gauge::Gauges::default(),
            notifiers: Arc::default(),
        })
    }

    /// The settings in force: read once per connection or session, never per statement.
    pub fn settings(&self) -> Arc<Settings> {
        self.settings
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Puts reloaded settings in force for the connections and sessions that start next.
    pub fn set_settings(&self, settings: Settings) {
        *self.settings.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(settings);
    }

    /// Whether `LOKADB_AUTH_PASSWORD` is set (checked again at a reload).
    pub fn has_env_auth_password(&self) -> bool {
        self.env_auth_password.is_some()
    }

    /// Whether the cores and the relay publish what they hold: for `metrics` and the
    /// console (`admin_users`, which a reload may set).
    pub fn publishes(&self) -> bool {
        self.config.metrics.is_some() || !self.settings().config.admin_users.is_empty()
    }

    /// The password of a database's `auth_user`: `auth_password`, else
    /// `LOKADB_AUTH_PASSWORD` (one of them exists: checked at start).
    pub fn auth_password(&self, db: &DatabaseConfig) -> String {
        db.auth_password
            .clone()
            .or_else(|| self.env_auth_password.clone())
            .unwrap_or_default()
    }

    /// The direct path's login to `org`'s database for database `name` (configured as
    /// `db`): the organization's own (`direct.logins`, then `direct.logins_file`), else the
    /// shared one (`direct.user` with its password, else `LOKADB_DIRECT_PASSWORD`).
    pub fn direct_login(&self, name: &str, db: &DatabaseConfig, org: &str) -> Option<DirectLogin> {
        let direct = db.direct.as_ref()?;
        if let Some(own) = self
            .settings()
            .direct_logins
            .get(name)
            .and_then(|l| l.get(org))
        {
            return Some(own.clone());
        }
        Some(DirectLogin {
            user: direct.user.clone(),
            password: direct
                .password
                .clone()
                .or_else(|| self.env_direct_password.clone())
                .unwrap_or_default(),
            password_env: None,
        })
    }

    /// Resolves the databases (DNS happens here, once, never on an executor) and reads
    /// their TLS files.
    ///
    /// # Errors
    ///
    /// A cloud host that does not resolve, a certificate or key that cannot be used.
    pub fn resolve_databases(&self) -> anyhow::Result<Vec<Resolved>> {
        let mut out = Vec::new();
        for (name, db) in &self.config.databases {
            let cs = ConnString::parse(&db.cloud)
                .map_err(|e| anyhow::anyhow!("databases.{name}.cloud: {e}"))?;
            let addr = match cs.hostaddr {
                Some(ip) => SocketAddr::new(ip, cs.port),
                None => (cs.host.as_str(), cs.port)
                    .to_socket_addrs()
                    .map_err(|e| {
                        anyhow::anyhow!("databases.{name}.cloud: cannot resolve {:?}: {e}", cs.host)
                    })?
                    .next()
                    .ok_or_else(|| {
                        anyhow::anyhow!("databases.{name}.cloud: {:?} resolves to nothing", cs.host)
                    })?,
            };
            let tls = CloudTls::new(&cs.tls, &cs.host)
                .map_err(|e| anyhow::anyhow!("databases.{name}.cloud: {e:#}"))?
                .map(Arc::new);
            out.push(Resolved {
                name: name.clone(),
                dbname: cs.dbname.unwrap_or_else(|| name.clone()),
                host: cs.host,
                addr,
                tls,
            });
        }
        Ok(out)
    }
}

/// The state one executor owns.
pub struct Core {
    /// Executor index (also the top byte of its sessions' ids).
    pub id: usize,
    /// Shared settings.
    pub shared: Arc<Shared>,
    /// Databases by the name clients ask for.
    pub databases: RefCell<HashMap<String, Rc<Database>>>,
    /// Auth queries by database name.
    pub auth: RefCell<HashMap<String, Rc<AuthQuery>>>,
    /// Warm cloud backends (and direct connections, with `direct_pool`).
    pub pool: RefCell<Pool>,
    /// Direct connections per organization under `direct_max`, and who waits for one.
    pub direct_slots: crate::backend::slots::Slots,
    /// Sessions of this core waiting for a cloud backend at `pool_size`, by database and role.
    pub cloud_slots: crate::backend::slots::Slots<crate::backend::slots::CloudKey>,
    /// The last lease given to a direct connection ([`Core::next_lease`]).
    pub leases: Cell<u64>,
    /// Cancel keys of this core's sessions.
    pub cancels: RefCell<CancelRegistry>,
    /// Every core's inbox, by core id, for forwarding cancels this core has no session for.
    pub peers: Arc<Vec<Peer>>,
    /// Fired once when the proxy starts shutting down.
    pub shutdown: Notify,
    /// Fired [`crate::server::IDLE_GRACE`] after `shutdown`: sessions that ran nothing
    /// since then end now (until then a client that just connected gets its statement
    /// served, as it would by the next process).
    pub idle_cut: Notify,
    /// Sessions running on this core.
    pub sessions: Cell<usize>,
    /// Counters for `GET /metrics` ([`crate::metrics`]).
    pub stats: crate::metrics::CoreStats,
    /// Per database: request latencies and errors by SQLSTATE class, also per
    /// organization (`SHOW STATS`, `GET /metrics`); its sessions hold their database's.
    pub db_stats: RefCell<HashMap<Rc<str>, Rc<RefCell<crate::metrics::DbStats>>>>,
    /// This core's sessions by id, for the console ([`crate::frontend::console`]).
    pub clients: RefCell<HashMap<u32, crate::frontend::console::ClientInfo>>,
    /// What the console's PAUSE holds, as this core last copied it, and the count of
    /// changes it copied.
    paused: RefCell<crate::frontend::console::Paused>,
    paused_seen: Cell<u64>,
    /// Sessions waiting for RESUME.
    resume_waiters: RefCell<Vec<Waker>>,
    /// Clients of this core in the handshake, by address (`max_handshakes_per_address`).
    pub handshaking: RefCell<HashMap<std::net::IpAddr, u32>>,
    /// Each database's routing metadata, as the watcher last sent it (absent until the
    /// first load, and for databases without an `auth_user`).
    pub meta: RefCell<HashMap<String, Rc<CoreMeta>>>,
    /// Bumped with every new generation in `meta`, so sessions look it up again only then.
    pub meta_version: Cell<u64>,
    /// New connections' freshness checks by (database, role), reused within
    /// `meta_cache.verify`.
    pub checks: RefCell<HashMap<(Rc<str>, String), Check>>,
    /// This core's traffic recording (`--record`).
    pub record: Option<Recorder>,
}

impl Core {
    /// Whether the console paused `db`: its sessions send nothing between transactions.
    pub fn pauses(&self, db: &str) -> bool {
        let paused = self.paused.borrow();
        !paused.is_empty() && paused.covers(db)
    }

    /// Wakes the session when what is paused changes.
    pub fn wait_resume(&self, cx: &Context<'_>) {
        let mut waiters = self.resume_waiters.borrow_mut();
        if !waiters.iter().any(|w| w.will_wake(cx.waker())) {
            waiters.push(cx.waker().clone());
        }
    }

    /// Copies what the console paused, when it changed, and wakes the sessions waiting.
    pub fn follow_pause(&self) {
        let mut seen = self.paused_seen.get();
        if let Some(paused) = self.shared.published.paused_since(&mut seen) {
            self.paused_seen.set(seen);
            *self.paused.borrow_mut() = paused;
            for waker in self.resume_waiters.take() {
                waker.wake();
            }
        }
    }

    /// The database clients ask for by `name`.
    pub fn database(&self, name: &str) -> Option<Rc<Database>> {
        self.databases.borrow().get(name).cloned()
    }

    /// The auth query of database `name`, when it has an `auth_user`.
    pub fn auth_query(&self, name: &str) -> Option<Rc<AuthQuery>> {
        self.auth.borrow().get(name).cloned()
    }

    /// Puts a reloaded configuration in force for this core's next sessions: each
    /// database's settings, its auth query; a database no longer configured takes no new
    /// session. What needs a restart (a database added, its `cloud`, `auth_user` or
    /// `auth_password` changed) is left as it is ([`crate::reload`] says so).
    pub fn apply(&self, config: &Config) {
        let mut databases = self.databases.borrow_mut();
        let mut auth = self.auth.borrow_mut();
        databases.retain(|name, _| config.databases.contains_key(name));
        auth.retain(|name, _| config.databases.contains_key(name));
        for (name, db) in databases.iter_mut() {
            let new = &config.databases[name];
            if !crate::reload::same_cloud(&db.config, new) {
                continue;
            }
            if new.auth_query != db.config.auth_query {
                if let Some(user) = &new.auth_user {
                    auth.insert(
                        name.clone(),
                        Rc::new(AuthQuery::new(
                            db.addr,
                            db.dbname.clone(),
                            user.clone(),
                            Secret(self.shared.auth_password(new)),
                            new.auth_query.clone(),
                            db.tls.clone(),
                        )),
                    );
                }
            }
            *db = Rc::new(Database {
                name: db.name.clone(),
                addr: db.addr,
                dbname: db.dbname.clone(),
                tls: db.tls.clone(),
                config: new.clone(),
            });
        }
    }

    /// Builds a core's state from the shared settings and resolved databases.
    pub fn new(
        id: usize,
        shared: Arc<Shared>,
        resolved: &[Resolved],
        peers: Arc<Vec<Peer>>,
    ) -> Core {
        let mut databases = HashMap::new();
        let mut auth = HashMap::new();
        for Resolved {
            name,
            addr,
            dbname,
            tls,
            ..
        } in resolved
        {
            let config = shared.config.databases[name].clone();
            if let Some(user) = &config.auth_user {
                let password = shared.auth_password(&config);
                auth.insert(
                    name.clone(),
                    Rc::new(AuthQuery::new(
                        *addr,
                        dbname.clone(),
                        user.clone(),
                        Secret(password),
                        config.auth_query.clone(),
                        tls.clone(),
                    )),
                );
            }
            let db = Database {
                name: Rc::from(name.as_str()),
                addr: *addr,
                dbname: dbname.clone(),
                tls: tls.clone(),
                config,
            };
            databases.insert(name.clone(), Rc::new(db));
        }
        Core {
            id,
            shared,
            databases: RefCell::new(databases),
            auth: RefCell::new(auth),
            pool: RefCell::new(Pool::default()),
            direct_slots: crate::backend::slots::Slots::default(),
            cloud_slots: crate::backend::slots::Slots::default(),
            leases: Cell::new(0),
            cancels: RefCell::new(CancelRegistry::default()),
            peers,
            shutdown: Notify::default(),
            idle_cut: Notify::default(),
            sessions: Cell::new(0),
            stats: crate::metrics::CoreStats::default(),
            db_stats: RefCell::default(),
            clients: RefCell::new(HashMap::new()),
            paused: RefCell::default(),
            paused_seen: Cell::new(0),
            resume_waiters: RefCell::default(),
            handshaking: RefCell::new(HashMap::new()),
            meta: RefCell::new(HashMap::new()),
            meta_version: Cell::new(0),
            checks: RefCell::new(HashMap::new()),
            record: None,
        }
    }
}

impl Core {
    /// A new lease for a direct connection a session takes (never 0).
    pub fn next_lease(&self) -> u64 {
        self.leases.set(self.leases.get() + 1);
        self.leases.get()
    }
}

/// A one-shot, single-threaded notification: fired once, wakes every registered task.
#[derive(Default)]
pub struct Notify {
    fired: Cell<bool>,
    next_id: Cell<u64>,
    wakers: RefCell<HashMap<u64, Waker>>,
}

impl Notify {
    /// Fires, waking every waiter.
    pub fn fire(&self) {
        self.fired.set(true);
        for (_, w) in self.wakers.borrow_mut().drain() {
            w.wake();
        }
    }

    /// Whether it has fired.
    pub fn is_fired(&self) -> bool {
        self.fired.get()
    }

    /// A slot for one waiter; registering again with the same slot replaces its waker.
    pub fn slot(&self) -> u64 {
        let id = self.next_id.get() + 1;
        self.next_id.set(id);
        id
    }

    /// Whether it has fired; if not, `cx`'s waker is registered under `slot`.
    pub fn poll_fired(&self, slot: u64, cx: &Context<'_>) -> bool {
        if self.fired.get() {
            return true;
        }
        let mut wakers = self.wakers.borrow_mut();
        match wakers.get_mut(&slot) {
            Some(w) if w.will_wake(cx.waker()) => {}
            Some(w) => *w = cx.waker().clone(),
            None => {
                wakers.insert(slot, cx.waker().clone());
            }
        }
        false
    }

    /// Removes a waiter's slot.
    pub fn release(&self, slot: u64) {
        self.wakers.borrow_mut().remove(&slot);
    }
}
