//! The operator's console: database `lokadb` on the client listener, for the roles in
//! `admin_users`, authenticated as any client is (the first database's auth query, or
//! `users_file`). Simple queries only; `docs/operations.md` lists the commands.
//!
//! What it shows of other cores comes from what they publish once a second
//! ([`crate::metrics::Published`]): a session is seen up to a second after it starts, and
//! its state as of the last second. `KILL` reaches a session on another core within a
//! tick of that core.

use super::auth::{authenticate, Authenticated};
use super::session::Admitted;
use crate::core::Core;
use crate::error::SessionError;
use crate::metrics::label_value;
use crate::net::stream::{send, ClientStream};
use crate::org::OrgId;
use crate::rt::net::TcpStream;
use futures_lite::AsyncReadExt;
use lokadb_shared::config::CONSOLE_DB;
use lokadb_shared::wire::backend::{self, ErrorFields, Severity};
use lokadb_shared::wire::startup::StartupMessage;
use lokadb_shared::wire::tags::*;
use lokadb_shared::wire::{sqlstate, Header};
use std::cell::RefCell;
use std::net::SocketAddr;
use std::os::fd::RawFd;
use std::rc::Rc;
use std::time::SystemTime;

/// Largest query accepted on the console.
const MAX_MESSAGE: u32 = 64 * 1024;

/// Whether the client asks for the console (and the configuration has one).
pub fn asked(core: &Core, startup: &StartupMessage) -> bool {
    startup.param("database") == Some(CONSOLE_DB)
        && !core.shared.settings().config.admin_users.is_empty()
}

/// Authenticates the role against the first configured database (or `users_file`) and
/// admits it if it is in `admin_users`; the client has its first ReadyForQuery then.
///
/// # Errors
///
/// [`SessionError`]: a wrong password, a role not in `admin_users`, `max_connections`.
pub(super) async fn login(
    core: &Core,
    stream: &mut ClientStream,
    startup: &StartupMessage,
) -> Result<Admitted, SessionError> {
    let user = startup.param("user").unwrap_or_default();
    let first = core.databases.borrow().keys().min().cloned();
    let db = first
        .and_then(|name| core.database(&name))
        .ok_or_else(|| SessionError::UnknownDatabase(CONSOLE_DB.to_owned()))?;
    let Authenticated { server_final, .. } = authenticate(stream, core, &db, user).await?;
    if !core
        .shared
        .settings()
        .config
        .admin_users
        .iter()
        .any(|a| a == user)
    {
        return Err(SessionError::NotAdmin(user.to_owned()));
    }
    let admitted = Admitted::new(&core.shared).ok_or(SessionError::TooManyConnections)?;
    let mut out = Vec::with_capacity(256);
    backend::auth_sasl_data(&mut out, AUTH_SASL_FINAL, server_final.as_bytes());
    backend::auth_ok(&mut out);
    for (k, v) in [
        ("server_version", "18.0 (LokaDB console)"),
        ("server_encoding", "UTF8"),
        ("client_encoding", "UTF8"),
        ("standard_conforming_strings", "on"),
        ("DateStyle", "ISO, MDY"),
        ("integer_datetimes", "on"),
    ] {
        backend::parameter_status(&mut out, k, v);
    }
    backend::ready_for_query(&mut out, TX_IDLE);
    send(stream, &out).await.map_err(SessionError::Client)?;
    tracing::info!(user, "console session");
    Ok(admitted)
}

/// Answers the console's queries until the client leaves.
pub(super) async fn serve(core: &Rc<Core>, mut stream: ClientStream, _admitted: Admitted) {
    let mut out = Vec::new();
    loop {
        let mut head = [0u8; 5];
        if stream.read_exact(&mut head).await.is_err() {
            return;
        }
        let header = match Header::peek(&head, MAX_MESSAGE) {
            Ok(Some(h)) => h,
            _ => {
                out.clear();
                error(
                    &mut out,
                    sqlstate::PROTOCOL_VIOLATION,
                    "invalid message on the console",
                    Severity::Fatal,
                );
                let _ = send(&mut stream, &out).await;
                return;
            }
        };
        let mut body = vec![0u8; header.body_len()];
        if stream.read_exact(&mut body).await.is_err() {
            return;
        }
        out.clear();
        match header.tag {
            FE_TERMINATE => return,
            FE_QUERY => {
                let sql = command_text(&body);
                let sql = sql.as_str();
                let words: Vec<&str> = sql.split_whitespace().collect();
                match words.as_slice() {
                    [w, rest @ ..] if w.eq_ignore_ascii_case("PAUSE") && rest.len() <= 1 => {
                        pause(core, rest.first().copied(), &mut out).await;
                    }
                    [w, rest @ ..] if w.eq_ignore_ascii_case("RESUME") && rest.len() <= 1 => {
                        resume(core, rest.first().copied(), &mut out);
                    }
                    _ => answer(core, sql, &mut out),
                }
                backend::ready_for_query(&mut out, TX_IDLE);
            }
            FE_SYNC => backend::ready_for_query(&mut out, TX_IDLE),
            // The rest of an extended batch is skipped up to its Sync, as Postgres does
            // after an error.
            FE_PARSE => error(
                &mut out,
                sqlstate::FEATURE_NOT_SUPPORTED,
                "the console takes simple queries only",
                Severity::Error,
            ),
            _ => {}
        }
        if !out.is_empty() && send(&mut stream, &out).await.is_err() {
            return;
        }
    }
}

/// A console command from a Query's body: without its NUL, spaces and final `;` (the
/// relay's admin database reads its commands so too).
pub fn command_text(body: &[u8]) -> String {
    String::from_utf8_lossy(body)
        .trim_end_matches('\0')
        .trim()
        .trim_end_matches(';')
        .trim()
        .to_owned()
}

/// `request_p50_ms{database,route}` and p95, p99 of each database's latency histogram, and
/// `org_request_p50_ms{database,org}` … of each organization's: the upper bound of the
/// bucket that holds it (`GET /metrics` leaves this to the scraper).
fn percentile_rows(
    databases: &std::collections::BTreeMap<String, crate::metrics::DbStats>,
) -> Vec<Vec<Option<String>>> {
    let mut out = Vec::new();
    let mut rows = |name: &str, labels: String, h: &crate::metrics::Histogram| {
        if h.count == 0 {
            return;
        }
        for (label, q) in [("p50", 0.5), ("p95", 0.95), ("p99", 0.99)] {
            let value = h
                .quantile_us(q)
                .map_or("> 10000".to_owned(), |us| format!("{}", us as f64 / 1000.0));
            out.push(vec![
                Some(format!("lokadb_{name}_{label}_ms{{{labels}}}")),
                Some(value),
            ]);
        }
    };
    for (name, s) in databases {
        for (route, h) in ["cloud", "direct"].iter().zip(&s.latency) {
            let labels = format!("database=\"{name}\",route=\"{route}\"");
            rows("request", labels, h);
        }
        let mut orgs: Vec<_> = s.orgs.iter().collect();
        orgs.sort_unstable_by(|a, b| a.0.cmp(b.0));
        for (org, o) in orgs {
            let labels = format!("database=\"{name}\",org=\"{}\"", label_value(org));
            rows("org_request", labels, &o.latency);
        }
    }
    out
}

/// The commands, for the error that lists them.
const COMMANDS: &str = "SHOW CLIENTS | SERVERS | POOLS | DATABASES | STATS | ORGS | TUNNELS | CONFIG | VERSION, PAUSE [db], RESUME [db], KILL <client id>";

/// `PAUSE [db]`: the sessions of `db` (of every database without one) send nothing more
/// once their transaction ends, until `RESUME`; answers once every one of them is
/// between transactions (as their cores last published: up to a second late).
async fn pause(core: &Rc<Core>, db: Option<&str>, out: &mut Vec<u8>) {
    if let Some(db) = db {
        if core.database(db).is_none() {
            return error(
                out,
                "3D000",
                &format!("no database \"{db}\" in the proxy's configuration"),
                Severity::Error,
            );
        }
    }
    let published = &core.shared.published;
    published.set_paused(|p| p.hold(db));
    tracing::info!(database = db.unwrap_or("(all)"), "console: PAUSE");
    // Every core has copied it and published its sessions since.
    crate::rt::sleep(crate::metrics::PUBLISH_EVERY * 2).await;
    loop {
        let busy = published
            .clients()
            .iter()
            .filter(|c| db.is_none_or(|db| c.database == db) && c.state != "idle")
            .count();
        if busy == 0 {
            break;
        }
        crate::rt::sleep(std::time::Duration::from_millis(100)).await;
    }
    backend::command_complete(out, "PAUSE");
}

/// `RESUME [db]`: what `PAUSE` held goes on.
fn resume(core: &Rc<Core>, db: Option<&str>, out: &mut Vec<u8>) {
    let mut held = false;
    core.shared.published.set_paused(|p| held = p.release(db));
    if !held {
        let what = db.map_or("nothing".to_owned(), |db| format!("database \"{db}\""));
        return error(
            out,
            "55000",
            &format!("{what} is not paused"),
            Severity::Error,
        );
    }
    tracing::info!(database = db.unwrap_or("(all)"), "console: RESUME");
    backend::command_complete(out, "RESUME");
}

fn answer(core: &Rc<Core>, sql: &str, out: &mut Vec<u8>) {
    let words: Vec<String> = sql
        .split_whitespace()
        .map(str::to_ascii_uppercase)
        .collect();
    let words: Vec<&str> = words.iter().map(String::as_str).collect();
    let published = &core.shared.published;
    match words.as_slice() {
        [] => backend::write_frame(out, BE_EMPTY_QUERY_RESPONSE, |_| {}),
        ["SHOW", "VERSION"] => rows(
            out,
            &["version"],
            vec![vec![Some(format!("LokaDB {}", env!("CARGO_PKG_VERSION")))]],
        ),
        ["SHOW", "CONFIG"] => rows(
            out,
            &["key", "value"],
            config_rows(&core.shared.settings().config),
        ),
        ["SHOW", "STATS"] => rows(
            out,
            &["metric", "value"],
            published
                .samples(&core.shared)
                .into_iter()
                .map(|s| {
                    vec![
                        Some(format!("{}{}", s.name, s.labels)),
                        Some(s.value.to_string()),
                    ]
                })
                .chain(percentile_rows(&published.databases()))
                .collect(),
        ),
        ["SHOW", "DATABASES"] => rows(
            out,
            &[
                "name",
                "host",
                "port",
                "dbname",
                "sslmode",
                "upstream_pool",
                "direct",
                "direct_max",
                "statement_org",
                "generation",
                "organizations",
                "paused",
            ],
            database_rows(core),
        ),
        ["SHOW", "ORGS"] => rows(
            out,
            &[
                "database",
                "organization",
                "state",
                "profile",
                "direct",
                "owes_migrations",
                "tunnel",
                "direct_used",
                "direct_idle",
            ],
            org_rows(core, published),
        ),
        ["SHOW", "CLIENTS"] => rows(
            out,
            &[
                "id",
                "core",
                "database",
                "user",
                "address",
                "state",
                "backend_pid",
                "organization",
                "connected_seconds",
                "pinned",
            ],
            published
                .clients()
                .into_iter()
                .map(ClientRow::cells)
                .collect(),
        ),
        ["SHOW", "SERVERS"] => rows(
            out,
            &[
                "core",
                "side",
                "database",
                "user",
                "organization",
                "pid",
                "state",
                "client_id",
            ],
            published
                .servers()
                .into_iter()
                .map(ServerRow::cells)
                .collect(),
        ),
        ["SHOW", "POOLS"] => rows(
            out,
            &[
                "database",
                "user",
                "clients",
                "servers_used",
                "servers_idle",
                "pool_mode",
                "pool_size",
                "waiting",
            ],
            pool_rows(published, core),
        ),
        // Before the relay's first publication (its first tick), no tunnels yet.
        ["SHOW", "TUNNELS"] => match core.shared.config.relay {
            Some(_) => rows(
                out,
                &crate::relay::TUNNEL_COLUMNS,
                published.tunnels().unwrap_or_default(),
            ),
            None => error(
                out,
                sqlstate::FEATURE_NOT_SUPPORTED,
                "no relay runs in this proxy (SHOW TUNNELS on the relay's admin database)",
                Severity::Error,
            ),
        },
        ["KILL", id] => match id.parse::<u32>() {
            Ok(id) if published.clients().iter().any(|c| c.id == id) => {
                published.kill(id);
                backend::command_complete(out, "KILL");
            }
            _ => error(
                out,
                "42704",
                &format!("no client {id} (SHOW CLIENTS lists their ids)"),
                Severity::Error,
            ),
        },
        _ => error(
            out,
            "42601",
            &format!("the console answers {COMMANDS}"),
            Severity::Error,
        ),
    }
}

fn rows(out: &mut Vec<u8>, columns: &[&str], rows: Vec<Vec<Option<String>>>) {
    backend::row_description_text(out, columns);
    for row in &rows {
        let cells: Vec<Option<&str>> = row.iter().map(Option::as_deref).collect();
        backend::data_row(out, &cells);
    }
    backend::command_complete(out, &format!("SHOW {}", rows.len()));
}

fn error(out: &mut Vec<u8>, code: &str, message: &str, severity: Severity) {
    backend::error_response(
        out,
        &ErrorFields {
            severity,
            code,
            message,
            detail: None,
            hint: None,
        },
    );
}

/// The configuration in force, one row per setting (`databases.app.cloud`, …); passwords
/// shown as `***`.
fn config_rows(config: &lokadb_shared::config::Config) -> Vec<Vec<Option<String>>> {
    fn flatten(prefix: &str, v: &serde_json::Value, out: &mut Vec<Vec<Option<String>>>) {
        match v {
            serde_json::Value::Object(map) => {
                for (k, v) in map {
                    let key = if prefix.is_empty() {
                        k.clone()
                    } else {
                        format!("{prefix}.{k}")
                    };
                    if k.contains("password") && !v.is_null() {
                        out.push(vec![Some(key), Some("***".into())]);
                    } else {
                        flatten(&key, v, out);
                    }
                }
            }
            serde_json::Value::String(s) => {
                out.push(vec![Some(prefix.to_owned()), Some(s.clone())])
            }
            serde_json::Value::Null => out.push(vec![Some(prefix.to_owned()), None]),
            other => out.push(vec![Some(prefix.to_owned()), Some(other.to_string())]),
        }
    }
    let mut out = Vec::new();
    if let Ok(v) = serde_json::to_value(config) {
        flatten("", &v, &mut out);
    }
    out
}

fn database_rows(core: &Core) -> Vec<Vec<Option<String>>> {
    let meta = core.meta.borrow();
    let paused = core.shared.published.paused();
    let databases = core.databases.borrow();
    let mut names: Vec<&String> = databases.keys().collect();
    names.sort();
    names
        .into_iter()
        .filter_map(|name| {
            let db = &databases[name];
            let config = &db.config;
            let m = meta.get(name.as_str());
            let cs = lokadb_shared::config::ConnString::parse(&config.cloud).ok()?;
            Some(vec![
                Some(name.clone()),
                Some(cs.host),
                Some(db.addr.port().to_string()),
                Some(db.dbname.clone()),
                Some(cs.tls.mode.as_str().to_owned()),
                Some(config.upstream_pool.to_string()),
                Some(config.direct.is_some().to_string()),
                Some(config.direct_max.to_string()),
                Some(config.statement_org.to_string()),
                m.map(|m| m.meta.generation.to_string()),
                m.map(|m| m.meta.orgs.len().to_string()),
                Some(paused.covers(name).to_string()),
            ])
        })
        .collect()
}

/// One row per organization of each database: its state and profile from the metadata,
/// its tunnel (when a relay runs in this process: `live` with its agent connected, `none`
/// without; empty otherwise) and its direct connections over all cores, used and idle.
fn org_rows(core: &Core, published: &crate::metrics::Published) -> Vec<Vec<Option<String>>> {
    let tunnels = published.tunnels().map(|rows| tunnels_by_org(&rows));
    let mut direct: std::collections::HashMap<(String, String), [u64; 2]> = Default::default();
    for s in published.servers() {
        if let (Some(org), "direct") = (s.org, s.side) {
            direct.entry((s.database, org)).or_default()[usize::from(s.client_id.is_none())] += 1;
        }
    }
    let meta = core.meta.borrow();
    let mut out = Vec::new();
    for (db, m) in meta.iter() {
        let mut orgs: Vec<_> = m.meta.orgs.iter().collect();
        orgs.sort_by(|a, b| a.0.cmp(b.0));
        for (id, o) in orgs {
            let tunnel = tunnels.as_ref().map(|t| match t.get(id) {
                Some(true) => "live".to_owned(),
                Some(false) => "standby".to_owned(),
                None => "none".to_owned(),
            });
            let [used, idle] = direct
                .get(&(db.to_string(), id.clone()))
                .copied()
                .unwrap_or_default();
            out.push(vec![
                Some(db.to_string()),
                Some(id.clone()),
                Some(o.state.clone()),
                Some(o.profile.as_str().to_owned()),
                Some(o.is_direct().to_string()),
                Some(o.owes.to_string()),
                tunnel,
                Some(used.to_string()),
                Some(idle.to_string()),
            ]);
        }
    }
    out
}

/// The relay's tunnel rows (`SHOW TUNNELS`: organization first, state fourth) as whether
/// each organization has a live tunnel (`false`: standbys only).
fn tunnels_by_org(rows: &[Vec<Option<String>>]) -> std::collections::HashMap<String, bool> {
    let mut by_org = std::collections::HashMap::new();
    for r in rows {
        if let (Some(Some(org)), Some(Some(state))) = (r.first(), r.get(3)) {
            *by_org.entry(org.clone()).or_default() |= state == "live";
        }
    }
    by_org
}

fn pool_rows(published: &crate::metrics::Published, core: &Core) -> Vec<Vec<Option<String>>> {
    let mut pools: std::collections::BTreeMap<(String, String), [u64; 3]> = Default::default();
    for c in published.clients() {
        pools
            .entry((c.database.clone(), c.user.clone()))
            .or_default()[0] += 1;
    }
    for s in published.servers() {
        if s.side != "cloud" {
            continue;
        }
        let p = pools
            .entry((s.database.clone(), s.user.clone()))
            .or_default();
        if s.client_id.is_some() {
            p[1] += 1;
        } else {
            p[2] += 1;
        }
    }
    pools
        .into_iter()
        .map(|((db, user), [c, used, idle])| {
            // The database's pooling as configured now, and the sessions of every core
            // waiting for a backend at its pool_size.
            let pooling = core
                .database(&db)
                .map(|d| (d.config.pool_mode, d.config.pool_size));
            let mode = pooling.map(|(mode, _)| match mode {
                lokadb_shared::config::PoolMode::Session => "session".to_owned(),
                lokadb_shared::config::PoolMode::Transaction => "transaction".to_owned(),
            });
            let size = pooling.map(|(_, size)| size.to_string());
            let waiting = core.shared.gauges.of(&db, &user).waiting();
            vec![
                Some(db),
                Some(user),
                Some(c.to_string()),
                Some(used.to_string()),
                Some(idle.to_string()),
                mode,
                size,
                Some(waiting.to_string()),
            ]
        })
        .collect()
}

/// What `PAUSE` holds: every database, or these.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Paused {
    /// `PAUSE` without a database.
    pub all: bool,
    /// `PAUSE db`.
    pub dbs: std::collections::BTreeSet<String>,
}

impl Paused {
    /// Whether sessions of `db` wait.
    pub fn covers(&self, db: &str) -> bool {
        self.all || self.dbs.contains(db)
    }

    /// Whether nothing waits.
    pub fn is_empty(&self) -> bool {
        !self.all && self.dbs.is_empty()
    }

    /// `PAUSE [db]`.
    fn hold(&mut self, db: Option<&str>) {
        match db {
            Some(db) => {
                self.dbs.insert(db.to_owned());
            }
            None => self.all = true,
        }
    }

    /// `RESUME [db]`: whether it was paused (by name, or anything without one).
    fn release(&mut self, db: Option<&str>) -> bool {
        match db {
            Some(db) => self.dbs.remove(db),
            None => !std::mem::take(self).is_empty(),
        }
    }
}

/// A session as its core keeps it for the console.
pub struct ClientInfo {
    /// The database it asked for.
    pub database: Rc<str>,
    /// Its role.
    pub user: String,
    /// Its address.
    pub addr: Option<SocketAddr>,
    /// When it authenticated.
    pub since: SystemTime,
    /// Its cloud backend's process ID.
    pub backend_pid: u32,
    /// Its socket, for `KILL` (valid while the entry exists: removed as the session ends,
    /// on the same thread).
    pub fd: RawFd,
    /// What it is doing, as of its last step.
    pub live: Rc<RefCell<Live>>,
}

/// What a session is doing, written by it at each pause.
#[derive(Debug, Clone, Default)]
pub struct Live {
    /// `active`, `idle`, `idle in transaction`, `idle in transaction (aborted)`.
    pub state: &'static str,
    /// The organization of its direct connection, if any.
    pub direct_org: Option<OrgId>,
    /// With transaction pooling, why the session keeps its cloud backend to its end
    /// (LISTEN, a temporary table, …).
    pub pinned: Option<&'static str>,
}

impl Live {
    /// The state's name from a backend's transaction status and whether requests wait.
    pub fn state_of(busy: bool, status: u8) -> &'static str {
        match (busy, status) {
            (true, _) => "active",
            (false, TX_IN_BLOCK) => "idle in transaction",
            (false, TX_FAILED) => "idle in transaction (aborted)",
            _ => "idle",
        }
    }
}

/// A row of `SHOW CLIENTS`, as a core published it.
#[derive(Debug, Clone)]
pub struct ClientRow {
    pub id: u32,
    pub core: usize,
    pub database: String,
    pub user: String,
    pub addr: Option<String>,
    pub state: &'static str,
    pub backend_pid: u32,
    pub org: Option<String>,
    pub pinned: Option<&'static str>,
    pub since: SystemTime,
}

impl ClientRow {
    /// A core's row for a session.
    pub fn of(id: u32, core: usize, info: &ClientInfo) -> ClientRow {
        let live = info.live.borrow();
        ClientRow {
            id,
            core,
            database: info.database.to_string(),
            user: info.user.clone(),
            addr: info.addr.map(|a| a.to_string()),
            state: live.state,
            backend_pid: info.backend_pid,
            org: live.direct_org.as_deref().map(str::to_owned),
            pinned: live.pinned,
            since: info.since,
        }
    }

    fn cells(self) -> Vec<Option<String>> {
        let age = SystemTime::now()
            .duration_since(self.since)
            .unwrap_or_default();
        vec![
            Some(self.id.to_string()),
            Some(self.core.to_string()),
            Some(self.database),
            Some(self.user),
            self.addr,
            Some(self.state.to_owned()),
            Some(self.backend_pid.to_string()),
            self.org,
            Some(age.as_secs().to_string()),
            self.pinned.map(str::to_owned),
        ]
    }
}

/// A row of `SHOW SERVERS`: a connection the proxy holds, in use by a client or idle in
/// the pool.
#[derive(Debug, Clone)]
pub struct ServerRow {
    pub core: usize,
    /// `cloud` or `direct`.
    pub side: &'static str,
    pub database: String,
    pub user: String,
    pub org: Option<String>,
    pub pid: u32,
    pub client_id: Option<u32>,
}

impl ServerRow {
    fn cells(self) -> Vec<Option<String>> {
        vec![
            Some(self.core.to_string()),
            Some(self.side.to_owned()),
            Some(self.database),
            Some(self.user),
            self.org,
            Some(self.pid.to_string()),
            Some(
                if self.client_id.is_some() {
                    "used"
                } else {
                    "idle"
                }
                .to_owned(),
            ),
            self.client_id.map(|id| id.to_string()),
        ]
    }
}

/// Ends a session of this core that `KILL` named: its client socket is shut down, so the
/// session ends as if the client had left (its backend reset and pooled, or closed).
pub fn kill_local(core: &Core, id: u32) {
    if let Some(info) = core.clients.borrow().get(&id) {
        // SAFETY: the fd is the session's open socket (the entry goes with the session).
        unsafe { libc::shutdown(info.fd, libc::SHUT_RDWR) };
        tracing::info!(client = id, "console: client killed");
    }
}

/// A client's socket and address, for its [`ClientInfo`].
pub fn socket_of(tcp: &TcpStream) -> (RawFd, Option<SocketAddr>) {
    use std::os::fd::AsRawFd;
    (tcp.as_raw_fd(), tcp.peer_addr().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_organization_with_a_live_tunnel_is_live_whatever_its_standbys() {
        let row = |org: &str, state: &str| {
            vec![
                Some(org.to_owned()),
                Some("1".to_owned()),
                Some("127.0.0.1:5".to_owned()),
                Some(state.to_owned()),
            ]
        };
        let by_org = tunnels_by_org(&[
            row("2", "standby"),
            row("2", "live"),
            row("3", "standby"),
            vec![None],
        ]);
        assert_eq!(by_org.get("2"), Some(&true));
        assert_eq!(by_org.get("3"), Some(&false));
        assert_eq!(by_org.len(), 2);
    }

    #[test]
    fn config_rows_are_dotted_and_hide_passwords() {
        let config = lokadb_shared::config::Config::from_json(
            r#"{"admin_users": ["ops"], "databases": {"app": {"cloud": "host=x", "auth_user": "a", "auth_password": "secret", "direct": {"user": "d", "password": "also"}}}}"#,
        )
        .unwrap();
        let rows = config_rows(&config);
        let get = |key: &str| {
            rows.iter()
                .find(|r| r[0].as_deref() == Some(key))
                .map(|r| r[1].clone())
        };
        assert_eq!(get("admin_users"), Some(Some("[\"ops\"]".into())));
        assert_eq!(get("databases.app.auth_password"), Some(Some("***".into())));
        assert_eq!(
            get("databases.app.direct.password"),
            Some(Some("***".into()))
        );
        assert_eq!(get("databases.app.direct.user"), Some(Some("d".into())));
        assert_eq!(get("auth_timeout"), Some(Some("30s".into())));
        assert_eq!(get("metrics"), Some(None));
        assert!(rows
            .iter()
            .all(|r| !r[1].as_deref().unwrap_or("").contains("secret")));
    }

    #[test]
    fn states_read_as_postgres_names_them() {
        assert_eq!(Live::state_of(true, TX_IN_BLOCK), "active");
        assert_eq!(Live::state_of(false, TX_IDLE), "idle");
        assert_eq!(Live::state_of(false, TX_IN_BLOCK), "idle in transaction");
        assert_eq!(
            Live::state_of(false, TX_FAILED),
            "idle in transaction (aborted)"
        );
    }
}
