//! `GET /metrics` in Prometheus' text format, on the address `metrics` names.
//!
//! Counters live where they change (each core's [`CoreStats`], the relay's own), in plain
//! `Cell`s: nothing is shared per statement. Once a second each owner copies them into its
//! slot of [`Published`] (one short lock per core per second); a scrape reads the slots, so
//! what it shows is at most a second old. The endpoint is a thread of its own with blocking
//! sockets, one request at a time with short timeouts: a scraper that stalls delays the
//! next scrape, never a session.

use crate::frontend::console::{ClientRow, ServerRow};
use std::borrow::Cow;
use std::cell::Cell;
use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How often the owners publish their counters.
pub const PUBLISH_EVERY: Duration = Duration::from_secs(1);
/// A scraper gets this long to send its request and read the answer.
const IO_TIMEOUT: Duration = Duration::from_secs(2);
/// The longest request head read.
const MAX_REQUEST: usize = 8 * 1024;

/// One core's counters, changed only by its own thread.
#[derive(Debug, Default)]
pub struct CoreStats {
    /// Sessions that authenticated.
    pub sessions: Cell<u64>,
    /// Requests answered (a ReadyForQuery) by the cloud.
    pub requests_cloud: Cell<u64>,
    /// Requests answered by organizations' databases on the direct path.
    pub requests_direct: Cell<u64>,
    /// ErrorResponses from the cloud.
    pub errors_cloud: Cell<u64>,
    /// ErrorResponses from organizations' databases on the direct path.
    pub errors_direct: Cell<u64>,
    /// Transactions that wrote directly and moved to the cloud ([`crate::frontend::replay`]).
    pub transactions_moved: Cell<u64>,
}

/// A session's counts as last added to its core's ([`CoreStats::follow`]).
#[derive(Debug, Default)]
pub struct Seen([u64; 4]);

impl CoreStats {
    /// Adds `n` to `cell`.
    pub fn add(cell: &Cell<u64>, n: u64) {
        cell.set(cell.get().wrapping_add(n));
    }

    /// Adds what a session's backends answered since `seen`: requests answered and
    /// errors, of the cloud and of the direct side, as its exchanges count them (a count
    /// that went back started again with a new connection).
    pub fn follow(&self, seen: &mut Seen, now: [u64; 4]) {
        let cells = [
            &self.requests_cloud,
            &self.requests_direct,
            &self.errors_cloud,
            &self.errors_direct,
        ];
        for ((cell, seen), now) in cells.into_iter().zip(&mut seen.0).zip(now) {
            let new = if now >= *seen { now - *seen } else { now };
            if new > 0 {
                Self::add(cell, new);
            }
            *seen = now;
        }
    }

    fn snapshot(&self, sessions_open: usize, idle_backends: usize) -> CoreSnapshot {
        CoreSnapshot {
            sessions: self.sessions.get(),
            requests: [self.requests_cloud.get(), self.requests_direct.get()],
            errors: [self.errors_cloud.get(), self.errors_direct.get()],
            transactions_moved: self.transactions_moved.get(),
            sessions_open: sessions_open as u64,
            idle_backends: idle_backends as u64,
        }
    }
}

/// Upper bounds of the request latency histogram's buckets, in microseconds (the last bucket,
/// `+Inf`, holds the rest).
pub const LATENCY_BUCKETS_US: [u64; 16] = [
    100, 200, 500, 1_000, 2_000, 5_000, 10_000, 20_000, 50_000, 100_000, 200_000, 500_000,
    1_000_000, 2_000_000, 5_000_000, 10_000_000,
];

/// Request latencies: how long a client's request (or pipelined batch) took from the proxy
/// sending it to the last answer of it written back.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Histogram {
    /// Counts per bucket of [`LATENCY_BUCKETS_US`] (not cumulative), then `+Inf`.
    pub buckets: [u64; LATENCY_BUCKETS_US.len() + 1],
    pub sum_us: u64,
    pub count: u64,
}

impl Histogram {
    /// Notes one request of `us` microseconds.
    pub fn record(&mut self, us: u64) {
        let i = LATENCY_BUCKETS_US.partition_point(|&b| b < us);
        self.buckets[i] += 1;
        self.sum_us = self.sum_us.saturating_add(us);
        self.count += 1;
    }

    fn merge(&mut self, other: &Histogram) {
        for (a, b) in self.buckets.iter_mut().zip(other.buckets) {
            *a += b;
        }
        self.sum_us = self.sum_us.saturating_add(other.sum_us);
        self.count += other.count;
    }

    /// The upper bound of the bucket that holds quantile `q` (0–1), in microseconds; `None`
    /// without requests or past the last bound.
    pub fn quantile_us(&self, q: f64) -> Option<u64> {
        if self.count == 0 {
            return None;
        }
        let rank = ((self.count as f64) * q).ceil().max(1.0) as u64;
        let mut seen = 0;
        for (i, n) in self.buckets.iter().enumerate() {
            seen += n;
            if seen >= rank {
                return LATENCY_BUCKETS_US.get(i).copied();
            }
        }
        None
    }
}

/// One database's request latencies (cloud, direct) and errors by SQLSTATE class, and the
/// same per organization, on one core; merged over the cores when published.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct DbStats {
    /// Requests answered by the cloud, by an organization's database (direct path).
    pub latency: [Histogram; 2],
    /// ErrorResponses the clients got, by SQLSTATE class.
    pub errors: BTreeMap<[u8; 2], u64>,
    /// Per organization its statements named; past [`MAX_ORGS`] on a core the others
    /// share [`OTHER_ORGS`].
    pub orgs: HashMap<String, OrgStats>,
}

/// Organizations a core counts apart per database: an organization is whatever value a
/// statement names, so clients could otherwise grow the map without bound.
pub const MAX_ORGS: usize = 10_000;
/// Where the statements of organizations past [`MAX_ORGS`] are counted.
pub const OTHER_ORGS: &str = "(other)";

/// The routes a statement of an organization took.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// Through the cloud (where the organization's rows are, or postgres_fdw).
    Cloud = 0,
    /// Straight to the organization's database (the direct path).
    Direct = 1,
    /// Refused by the proxy (the client got its error).
    Refused = 2,
}

impl Route {
    pub const NAMES: [&'static str; 3] = ["cloud", "direct", "refused"];
}

/// One organization's figures: statements (Query, Bind) by route, requests' latency and
/// errors by SQLSTATE class. A request is counted under the organization of its first
/// statement (a pipelined batch naming several is counted under the first).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct OrgStats {
    /// By [`Route`].
    pub statements: [u64; 3],
    pub latency: Histogram,
    pub errors: BTreeMap<[u8; 2], u64>,
}

impl OrgStats {
    fn merge(&mut self, other: &OrgStats) {
        for (a, b) in self.statements.iter_mut().zip(other.statements) {
            *a += b;
        }
        self.latency.merge(&other.latency);
        for (class, n) in &other.errors {
            *self.errors.entry(*class).or_default() += n;
        }
    }
}

impl DbStats {
    fn merge(&mut self, other: &DbStats) {
        for (a, b) in self.latency.iter_mut().zip(&other.latency) {
            a.merge(b);
        }
        for (class, n) in &other.errors {
            *self.errors.entry(*class).or_default() += n;
        }
        for (org, s) in &other.orgs {
            match self.orgs.get_mut(org) {
                Some(mine) => mine.merge(s),
                None => {
                    self.orgs.insert(org.clone(), s.clone());
                }
            }
        }
    }

    /// `org`'s figures (those of [`OTHER_ORGS`] once the core counts [`MAX_ORGS`]);
    /// allocates only for an organization not seen before.
    pub fn org(&mut self, org: &str) -> &mut OrgStats {
        let key = if self.orgs.contains_key(org) || self.orgs.len() < MAX_ORGS {
            org
        } else {
            OTHER_ORGS
        };
        if !self.orgs.contains_key(key) {
            self.orgs.insert(key.to_owned(), OrgStats::default());
        }
        self.orgs.get_mut(key).expect("inserted")
    }
}

/// What a core published last.
#[derive(Debug, Default, Clone, Copy)]
pub struct CoreSnapshot {
    sessions: u64,
    /// Cloud, direct.
    requests: [u64; 2],
    errors: [u64; 2],
    transactions_moved: u64,
    sessions_open: u64,
    idle_backends: u64,
}

/// What every owner publishes, read by the endpoint and the console.
#[derive(Debug, Default)]
pub struct Published {
    cores: Mutex<Vec<CorePublished>>,
    relay: Mutex<Option<RelayPublished>>,
    /// Sessions the console asked to end, for their cores to take.
    kills: Mutex<Vec<u32>>,
    /// What the console paused, and a count of its changes (the cores copy it when the
    /// count moved).
    paused: Mutex<crate::frontend::console::Paused>,
    paused_version: std::sync::atomic::AtomicU64,
}

#[derive(Debug, Default, Clone)]
struct CorePublished {
    stats: CoreSnapshot,
    databases: Vec<(String, DbStats)>,
    clients: Vec<ClientRow>,
    servers: Vec<ServerRow>,
}

#[derive(Debug, Default, Clone)]
struct RelayPublished {
    counters: Vec<(&'static str, u64)>,
    tunnels: Vec<Vec<Option<String>>>,
}

/// One sample of the metrics page.
pub struct Sample {
    /// `lokadb_…`.
    pub name: String,
    /// The name `# HELP` and `# TYPE` give: `name`, or a histogram's name without its
    /// `_bucket`, `_sum` or `_count`.
    pub family: String,
    /// `{side="cloud"}`, or empty.
    pub labels: String,
    /// `counter` or `gauge`.
    pub kind: &'static str,
    /// The `# HELP` text.
    pub help: &'static str,
    /// The value.
    pub value: f64,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Published {
    /// A core publishes its counters, gauges, sessions and connections.
    pub fn core(&self, core: &crate::core::Core) {
        let pool = core.pool.borrow();
        let stats = core.stats.snapshot(core.sessions.get(), pool.idle_count());
        let clients: Vec<ClientRow> = core
            .clients
            .borrow()
            .iter()
            .map(|(&id, info)| ClientRow::of(id, core.id, info))
            .collect();
        // A client between transactions (transaction pooling) holds no backend: pid 0.
        let mut servers: Vec<ServerRow> = clients
            .iter()
            .filter(|c| c.backend_pid != 0)
            .map(|c| ServerRow {
                core: core.id,
                side: "cloud",
                database: c.database.clone(),
                user: c.user.clone(),
                org: None,
                pid: c.backend_pid,
                client_id: Some(c.id),
            })
            .collect();
        servers.extend(pool.idle_keys().map(|(key, pid)| ServerRow {
            core: core.id,
            side: if key.org.is_some() { "direct" } else { "cloud" },
            database: key.database.to_string(),
            user: key.user.clone(),
            org: key.org.as_deref().map(str::to_owned),
            pid,
            client_id: None,
        }));
        let mut cores = lock(&self.cores);
        if cores.len() <= core.id {
            cores.resize(core.id + 1, CorePublished::default());
        }
        let databases = core
            .db_stats
            .borrow()
            .iter()
            .map(|(name, s)| (name.to_string(), s.borrow().clone()))
            .collect();
        cores[core.id] = CorePublished {
            stats,
            databases,
            clients,
            servers,
        };
    }

    /// The relay publishes its counters ([`crate::relay::counters`]) and tunnels.
    pub fn relay(&self, counters: Vec<(&'static str, u64)>, tunnels: Vec<Vec<Option<String>>>) {
        *lock(&self.relay) = Some(RelayPublished { counters, tunnels });
    }

    /// Every core's sessions, as last published.
    pub fn clients(&self) -> Vec<ClientRow> {
        lock(&self.cores)
            .iter()
            .flat_map(|c| c.clients.clone())
            .collect()
    }

    /// Every core's connections (used and idle), as last published.
    pub fn servers(&self) -> Vec<ServerRow> {
        lock(&self.cores)
            .iter()
            .flat_map(|c| c.servers.clone())
            .collect()
    }

    /// The relay's tunnels, when a relay runs in this process.
    pub fn tunnels(&self) -> Option<Vec<Vec<Option<String>>>> {
        lock(&self.relay).as_ref().map(|r| r.tunnels.clone())
    }

    /// Changes what is paused; the cores follow within a tick.
    pub fn set_paused(&self, change: impl FnOnce(&mut crate::frontend::console::Paused)) {
        change(&mut lock(&self.paused));
        self.paused_version.fetch_add(1, Ordering::Relaxed);
    }

    /// What is paused, when it changed since `seen` (which is updated).
    pub fn paused_since(&self, seen: &mut u64) -> Option<crate::frontend::console::Paused> {
        let now = self.paused_version.load(Ordering::Relaxed);
        if now == *seen {
            return None;
        }
        *seen = now;
        Some(lock(&self.paused).clone())
    }

    /// What is paused now.
    pub fn paused(&self) -> crate::frontend::console::Paused {
        lock(&self.paused).clone()
    }

    /// Asks session `id`'s core to end it.
    pub fn kill(&self, id: u32) {
        lock(&self.kills).push(id);
    }

    /// The sessions of core `core` the console asked to end (taken).
    pub fn kills_for(&self, core: usize) -> Vec<u32> {
        let mut kills = lock(&self.kills);
        if kills.is_empty() {
            return Vec::new();
        }
        let (mine, rest): (Vec<u32>, Vec<u32>) =
            kills.iter().partition(|&&id| (id >> 24) as usize == core);
        *kills = rest;
        mine
    }

    /// Each database's latencies and errors, merged over the cores, by name.
    pub fn databases(&self) -> std::collections::BTreeMap<String, DbStats> {
        let mut merged: std::collections::BTreeMap<String, DbStats> = Default::default();
        for core in lock(&self.cores).iter() {
            for (name, s) in &core.databases {
                merged.entry(name.clone()).or_default().merge(s);
            }
        }
        merged
    }

    /// The page: every name prefixed `lokadb_`.
    pub fn render(&self, shared: &crate::core::Shared) -> String {
        let mut out = String::with_capacity(4096);
        let mut last = String::new();
        for s in self.samples(shared) {
            if s.family != last {
                let _ = writeln!(
                    out,
                    "# HELP {} {}\n# TYPE {} {}",
                    s.family, s.help, s.family, s.kind
                );
                last.clone_from(&s.family);
            }
            let _ = writeln!(out, "{}{} {}", s.name, s.labels, s.value);
        }
        out
    }

    /// Every sample, grouped by name.
    pub fn samples(&self, shared: &crate::core::Shared) -> Vec<Sample> {
        let cores: Vec<CoreSnapshot> = lock(&self.cores).iter().map(|c| c.stats).collect();
        let relay = lock(&self.relay)
            .as_ref()
            .map(|r| r.counters.clone())
            .unwrap_or_default();
        let sum = |f: &dyn Fn(&CoreSnapshot) -> u64| cores.iter().map(f).sum::<u64>();
        let mut out = Vec::with_capacity(64);
        let mut metric =
            |name: &str, kind: &'static str, help: &'static str, samples: &[(&str, u64)]| {
                for (labels, value) in samples {
                    out.push(Sample {
                        name: format!("lokadb_{name}"),
                        family: format!("lokadb_{name}"),
                        labels: (*labels).to_owned(),
                        kind,
                        help,
                        value: *value as f64,
                    });
                }
            };
        metric(
            "build_info",
            "gauge",
            "The proxy's version.",
            &[(&format!("{{version=\"{}\"}}", env!("CARGO_PKG_VERSION")), 1)],
        );
        metric(
            "client_connections",
            "gauge",
            "Authenticated client sessions now (max_connections).",
            &[("", u64::from(shared.connections.load(Ordering::Relaxed)))],
        );
        metric(
            "client_handshakes",
            "gauge",
            "Client connections not authenticated yet (max_handshakes).",
            &[("", u64::from(shared.handshakes.load(Ordering::Relaxed)))],
        );
        metric(
            "sessions_total",
            "counter",
            "Client sessions that authenticated.",
            &[("", sum(&|c| c.sessions))],
        );
        metric(
            "requests_total",
            "counter",
            "Requests answered (ReadyForQuery), by the side that answered: the cloud or an organization's database on the direct path.",
            &[
                ("{side=\"cloud\"}", sum(&|c| c.requests[0])),
                ("{side=\"direct\"}", sum(&|c| c.requests[1])),
            ],
        );
        metric(
            "backend_errors_total",
            "counter",
            "ErrorResponses from the backends, by side.",
            &[
                ("{side=\"cloud\"}", sum(&|c| c.errors[0])),
                ("{side=\"direct\"}", sum(&|c| c.errors[1])),
            ],
        );
        metric(
            "transactions_moved_total",
            "counter",
            "Transactions that wrote directly and then moved to the cloud.",
            &[("", sum(&|c| c.transactions_moved))],
        );
        metric(
            "pool_idle_backends",
            "gauge",
            "Idle pooled connections (cloud backends and direct connections).",
            &[("", sum(&|c| c.idle_backends))],
        );
        let per_core: Vec<(String, u64)> = cores
            .iter()
            .enumerate()
            .map(|(i, c)| (format!("{{core=\"{i}\"}}"), c.sessions_open))
            .collect();
        let per_core: Vec<(&str, u64)> = per_core.iter().map(|(l, v)| (l.as_str(), *v)).collect();
        metric(
            "core_sessions",
            "gauge",
            "Sessions running on each core.",
            &per_core,
        );
        let databases = self.databases();
        let mut errors = Vec::new();
        for (name, s) in &databases {
            for (class, n) in &s.errors {
                let class = String::from_utf8_lossy(class);
                let name = label_value(name);
                errors.push((format!("{{database=\"{name}\",class=\"{class}\"}}"), *n));
            }
        }
        let errors: Vec<(&str, u64)> = errors.iter().map(|(l, v)| (l.as_str(), *v)).collect();
        metric(
            "client_errors_total",
            "counter",
            "ErrorResponses the clients got from the backends, by database and SQLSTATE class (its first two characters).",
            &errors,
        );
        let (mut statements, mut org_errors) = (Vec::new(), Vec::new());
        for (name, s) in &databases {
            let name = label_value(name);
            let mut orgs: Vec<_> = s.orgs.iter().collect();
            orgs.sort_unstable_by(|a, b| a.0.cmp(b.0));
            for (org, o) in orgs {
                let org = label_value(org);
                for (route, n) in Route::NAMES.iter().zip(o.statements) {
                    statements.push((
                        format!("{{database=\"{name}\",org=\"{org}\",route=\"{route}\"}}"),
                        n,
                    ));
                }
                for (class, n) in &o.errors {
                    let class = String::from_utf8_lossy(class);
                    org_errors.push((
                        format!("{{database=\"{name}\",org=\"{org}\",class=\"{class}\"}}"),
                        *n,
                    ));
                }
            }
        }
        let statements: Vec<(&str, u64)> =
            statements.iter().map(|(l, v)| (l.as_str(), *v)).collect();
        metric(
            "org_statements_total",
            "counter",
            "Statements (a Query, or a Bind) naming an organization, by database, organization and route: cloud, direct, or refused by the proxy.",
            &statements,
        );
        let org_errors: Vec<(&str, u64)> =
            org_errors.iter().map(|(l, v)| (l.as_str(), *v)).collect();
        metric(
            "org_errors_total",
            "counter",
            "ErrorResponses the clients got, by database, organization (of the request's first statement) and SQLSTATE class.",
            &org_errors,
        );
        let latency = latency_samples(&databases);
        for (name, value) in relay {
            let gauge = ["_connected", "_open", "_used", "_buffered"]
                .iter()
                .any(|s| name.ends_with(s));
            let (full, kind) = if gauge {
                (format!("relay_{name}"), "gauge")
            } else {
                (format!("relay_{name}_total"), "counter")
            };
            metric(
                &full,
                kind,
                "The relay's counter of this name (docs/operations.md).",
                &[("", value)],
            );
        }
        out.extend(latency);
        out.extend(org_latency_samples(&databases));
        out
    }
}

/// A label's value as Prometheus' text format reads it: an organization is any text a
/// statement named.
pub fn label_value(v: &str) -> Cow<'_, str> {
    if !v.contains(['\\', '"', '\n']) {
        return Cow::Borrowed(v);
    }
    Cow::Owned(
        v.replace('\\', "\\\\")
            .replace('"', "\\\"")
            .replace('\n', "\\n"),
    )
}

/// `lokadb_org_request_duration_seconds`, a summary (sum and count) per database and
/// organization: a histogram per organization would be thousands of series; SHOW STATS
/// gives its percentiles.
fn org_latency_samples(databases: &BTreeMap<String, DbStats>) -> Vec<Sample> {
    const FAMILY: &str = "lokadb_org_request_duration_seconds";
    let sample = |suffix: &str, labels: String, value: f64| {
        Sample {
        name: format!("{FAMILY}{suffix}"),
        family: FAMILY.to_owned(),
        labels,
        kind: "summary",
        help: "Requests from sent to answered, by database and organization (of the request's first statement).",
        value,
    }
    };
    let mut out = Vec::new();
    for (name, s) in databases {
        let name = label_value(name);
        let mut orgs: Vec<_> = s.orgs.iter().filter(|(_, o)| o.latency.count > 0).collect();
        orgs.sort_unstable_by(|a, b| a.0.cmp(b.0));
        for (org, o) in orgs {
            let labels = format!("{{database=\"{name}\",org=\"{}\"}}", label_value(org));
            out.push(sample(
                "_sum",
                labels.clone(),
                o.latency.sum_us as f64 / 1e6,
            ));
            out.push(sample("_count", labels, o.latency.count as f64));
        }
    }
    out
}

/// `lokadb_request_duration_seconds`, a Prometheus histogram by database and route.
fn latency_samples(databases: &std::collections::BTreeMap<String, DbStats>) -> Vec<Sample> {
    const FAMILY: &str = "lokadb_request_duration_seconds";
    let sample = |suffix: &str, labels: String, value: f64| {
        Sample {
        name: format!("{FAMILY}{suffix}"),
        family: FAMILY.to_owned(),
        labels,
        kind: "histogram",
        help: "Requests (a Query, or extended-protocol messages up to Sync, pipelined ones together) from sent to answered, by database and the route that answered.",
        value,
    }
    };
    let mut out = Vec::new();
    for (name, s) in databases {
        for (route, h) in ["cloud", "direct"].iter().zip(&s.latency) {
            let mut cumulative = 0;
            for (i, n) in h.buckets.iter().enumerate() {
                cumulative += n;
                let le = LATENCY_BUCKETS_US
                    .get(i)
                    .map_or("+Inf".to_owned(), |us| format!("{}", *us as f64 / 1e6));
                let labels = format!("{{database=\"{name}\",route=\"{route}\",le=\"{le}\"}}");
                out.push(sample("_bucket", labels, cumulative as f64));
            }
            let labels = format!("{{database=\"{name}\",route=\"{route}\"}}");
            out.push(sample("_sum", labels.clone(), h.sum_us as f64 / 1e6));
            out.push(sample("_count", labels, h.count as f64));
        }
    }
    out
}

/// Starts the endpoint on `addr` (on `inherited`, a listener handed over by the process
/// this one replaces, when it listens there). Returns the address and a copy of the
/// listener for the next handover.
///
/// # Errors
///
/// The address cannot be bound, or the thread cannot start.
pub fn serve(
    addr: SocketAddr,
    inherited: Option<std::os::fd::OwnedFd>,
    shared: Arc<crate::core::Shared>,
) -> anyhow::Result<(SocketAddr, std::os::fd::OwnedFd)> {
    let listener = match inherited.map(|fd| crate::handover::tcp_listener(fd, addr)) {
        Some(Ok(listener)) => listener,
        other => {
            if let Some(Err(e)) = other {
                tracing::warn!(
                    error = format!("{e:#}"),
                    "metrics: not using the listener handed over"
                );
            }
            TcpListener::bind(addr)
                .map_err(|e| anyhow::anyhow!("metrics: cannot listen on {addr}: {e}"))?
        }
    };
    let bound = listener.local_addr()?;
    let copy = std::os::fd::OwnedFd::from(listener.try_clone()?);
    std::thread::Builder::new()
        .name("lokadb-metrics".into())
        .spawn(move || {
            for conn in listener.incoming() {
                // A request accepted is answered, also while draining.
                if let Ok(conn) = conn {
                    if let Err(e) = answer(conn, &shared.published, &shared) {
                        tracing::debug!(error = %e, "metrics: a request failed");
                    }
                }
                if shared.shutdown.load(Ordering::Relaxed) {
                    return;
                }
            }
        })?;
    Ok((bound, copy))
}

fn answer(
    mut conn: TcpStream,
    published: &Published,
    shared: &crate::core::Shared,
) -> std::io::Result<()> {
    conn.set_read_timeout(Some(IO_TIMEOUT))?;
    conn.set_write_timeout(Some(IO_TIMEOUT))?;
    let mut head = Vec::with_capacity(1024);
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && !head.windows(2).any(|w| w == b"\n\n") {
        let n = conn.read(&mut buf)?;
        if n == 0 {
            break;
        }
        head.extend_from_slice(&buf[..n]);
        if head.len() > MAX_REQUEST {
            return respond(
                &mut conn,
                "431 Request Header Fields Too Large",
                "request too large\n",
            );
        }
    }
    let line = head.split(|&b| b == b'\n').next().unwrap_or_default();
    let line = String::from_utf8_lossy(line);
    let mut words = line.split_whitespace();
    match (words.next(), words.next()) {
        (Some("GET"), Some(path)) if path == "/metrics" || path.starts_with("/metrics?") => {
            respond(&mut conn, "200 OK", &published.render(shared))
        }
        (Some("GET"), Some(_)) => {
            respond(&mut conn, "404 Not Found", "only GET /metrics is served\n")
        }
        _ => respond(&mut conn, "400 Bad Request", "expected GET /metrics\n"),
    }
}

fn respond(conn: &mut TcpStream, status: &str, body: &str) -> std::io::Result<()> {
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    conn.write_all(head.as_bytes())?;
    conn.write_all(body.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_histogram_places_requests_and_answers_quantiles_by_bucket() {
        let mut h = Histogram::default();
        assert_eq!(h.quantile_us(0.5), None);
        for us in [50, 150, 150, 900, 30_000_000] {
            h.record(us);
        }
        assert_eq!(h.count, 5);
        assert_eq!(h.buckets[0], 1, "50 µs: up to 100");
        assert_eq!(h.buckets[1], 2, "150 µs: up to 200");
        assert_eq!(h.buckets[3], 1, "900 µs: up to 1 ms");
        assert_eq!(h.buckets[LATENCY_BUCKETS_US.len()], 1, "past 10 s");
        assert_eq!(h.quantile_us(0.5), Some(200));
        assert_eq!(h.quantile_us(0.8), Some(1_000));
        assert_eq!(h.quantile_us(0.99), None, "in +Inf");
        let mut merged = DbStats::default();
        let mut one = DbStats {
            latency: [h, Histogram::default()],
            errors: [(*b"22", 2)].into(),
            orgs: HashMap::new(),
        };
        one.org("acme").statements[Route::Direct as usize] += 3;
        one.org("acme").latency.record(150);
        merged.merge(&one);
        merged.merge(&one);
        assert_eq!(merged.latency[0].count, 10);
        assert_eq!(merged.errors[b"22"], 4);
        assert_eq!(merged.orgs["acme"].statements, [0, 6, 0]);
        assert_eq!(merged.orgs["acme"].latency.count, 2);
    }

    #[test]
    fn organizations_past_the_cap_share_one_entry_and_labels_are_escaped() {
        let mut db = DbStats::default();
        for i in 0..MAX_ORGS + 5 {
            db.org(&i.to_string()).statements[0] += 1;
        }
        assert_eq!(db.orgs.len(), MAX_ORGS + 1);
        assert_eq!(db.orgs[OTHER_ORGS].statements[0], 5);
        // One counted before the cap keeps its own.
        db.org("7").statements[0] += 1;
        assert_eq!(db.orgs["7"].statements[0], 2);
        assert_eq!(label_value("plain"), "plain");
        assert_eq!(label_value("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }

    #[test]
    fn a_count_that_went_back_started_again() {
        let stats = CoreStats::default();
        let mut seen = Seen::default();
        stats.follow(&mut seen, [3, 1, 0, 0]);
        stats.follow(&mut seen, [5, 1, 1, 0]);
        // A new direct connection: its exchange counts from 0 again.
        stats.follow(&mut seen, [5, 2, 1, 0]);
        stats.follow(&mut seen, [5, 1, 1, 0]);
        assert_eq!(stats.requests_cloud.get(), 5);
        assert_eq!(stats.requests_direct.get(), 3);
        assert_eq!(stats.errors_cloud.get(), 1);
    }

    #[test]
    fn the_page_names_each_metric_once_with_the_prefix() {
        let config = lokadb_shared::config::Config::from_json(
            r#"{"databases": {"app": {"cloud": "host=x", "auth_user": "a", "auth_password": "p"}}}"#,
        )
        .unwrap();
        let shared = crate::core::Shared::new(config).unwrap();
        shared
            .published
            .relay(vec![("streams_open", 2), ("agents_refused", 3)], Vec::new());
        let page = shared.published.render(&shared);
        for line in page.lines() {
            let name = line
                .trim_start_matches("# HELP ")
                .trim_start_matches("# TYPE ");
            assert!(name.starts_with("lokadb_"), "{line}");
        }
        assert_eq!(
            page.matches("# TYPE lokadb_requests_total counter").count(),
            1
        );
        assert!(page.contains("lokadb_requests_total{side=\"direct\"} 0\n"));
        assert!(page.contains("lokadb_relay_streams_open 2\n"));
        assert!(page.contains("# TYPE lokadb_relay_agents_refused_total counter\n"));
    }
}
