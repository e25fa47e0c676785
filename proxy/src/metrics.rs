//! `GET /metrics` in Prometheus' text format, on the address `metrics` names.
//!
//! Counters live where they change (each core's [`CoreStats`], the relay's own), in plain
//! `Cell`s: nothing is shared per statement. Once a second each owner copies them into its
//! slot of [`Published`] (one short lock per core per second); a scrape reads the slots, so
//! what it shows is at most a second old. The endpoint is a thread of its own with blocking
//! sockets, one request at a time with short timeouts: a scraper that stalls delays the
//! next scrape, never a session.

use std::cell::Cell;
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

    fn snapshot(&self) -> CoreSnapshot {
        CoreSnapshot {
            sessions: self.sessions.get(),
            requests: [self.requests_cloud.get(), self.requests_direct.get()],
            errors: [self.errors_cloud.get(), self.errors_direct.get()],
            transactions_moved: self.transactions_moved.get(),
            sessions_open: 0,
            idle_backends: 0,
        }
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

/// The counters every owner publishes, read by the endpoint.
#[derive(Debug, Default)]
pub struct Published {
    cores: Mutex<Vec<CoreSnapshot>>,
    relay: Mutex<Vec<(&'static str, u64)>>,
}

impl Published {
    /// Core `id` publishes its counters and gauges.
    pub fn core(&self, id: usize, stats: &CoreStats, sessions_open: usize, idle_backends: usize) {
        let mut snap = stats.snapshot();
        snap.sessions_open = sessions_open as u64;
        snap.idle_backends = idle_backends as u64;
        let mut cores = self.cores.lock().unwrap_or_else(|p| p.into_inner());
        if cores.len() <= id {
            cores.resize(id + 1, CoreSnapshot::default());
        }
        cores[id] = snap;
    }

    /// The relay publishes its counters ([`crate::relay::counters`]).
    pub fn relay(&self, counters: Vec<(&'static str, u64)>) {
        *self.relay.lock().unwrap_or_else(|p| p.into_inner()) = counters;
    }

    /// The page: every name prefixed `lokadb_`.
    pub fn render(&self, shared: &crate::core::Shared) -> String {
        let cores = self.cores.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let relay = self.relay.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let sum = |f: &dyn Fn(&CoreSnapshot) -> u64| cores.iter().map(f).sum::<u64>();
        let mut out = String::with_capacity(4096);
        let mut metric = |name: &str, kind: &str, help: &str, samples: &[(&str, u64)]| {
            let _ = writeln!(
                out,
                "# HELP lokadb_{name} {help}\n# TYPE lokadb_{name} {kind}"
            );
            for (labels, value) in samples {
                let _ = writeln!(out, "lokadb_{name}{labels} {value}");
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
        out
    }
}

/// Starts the endpoint on `addr`.
///
/// # Errors
///
/// The address cannot be bound, or the thread cannot start.
pub fn serve(addr: SocketAddr, shared: Arc<crate::core::Shared>) -> anyhow::Result<SocketAddr> {
    let listener = TcpListener::bind(addr)
        .map_err(|e| anyhow::anyhow!("metrics: cannot listen on {addr}: {e}"))?;
    let bound = listener.local_addr()?;
    std::thread::Builder::new()
        .name("lokadb-metrics".into())
        .spawn(move || {
            for conn in listener.incoming() {
                if shared.shutdown.load(Ordering::Relaxed) {
                    return;
                }
                if let Ok(conn) = conn {
                    if let Err(e) = answer(conn, &shared.published, &shared) {
                        tracing::debug!(error = %e, "metrics: a request failed");
                    }
                }
            }
        })?;
    Ok(bound)
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
