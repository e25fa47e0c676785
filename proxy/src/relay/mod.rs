//! The relay: agents dial in over TLS, each carrying its organization's tunnel;
//! Postgres clients (postgres_fdw in the cloud database, the proxy's direct path)
//! connect to its Postgres listener and are piped through a stream of the tunnel of
//! the organization their database name names.
//!
//! It runs on one thread of its own with its own runtime ([`crate::rt`]): inside
//! `lokadb proxy` when the config has `relay`, or alone as `lokadb relay`. One thread
//! keeps every tunnel and every stream in one place, so opening a stream is a local
//! call; its work per byte is a copy and a TLS record.
//!
//! # Layout
//!
//! - [`registry`]: which agent serves which organization, counters.
//! - [`tunnel_conn`]: one agent connection (TLS + tunnel) and its streams' slots.
//! - [`client`]: one Postgres client: startup packet → organization → stream → pipe.
//! - [`cancel`]: CancelRequests routed by the backend keys seen on streams.
//! - [`tokens`]: agent tokens and their hashes.
//! - [`admin`]: the `lokadb_relay` admin database (`SHOW STATS`, `SHOW TUNNELS`).

pub mod admin;
pub mod cancel;
pub mod client;
pub mod registry;
pub mod tokens;
pub mod tunnel_conn;

use crate::rt::net::TcpListener;
use crate::rt::{sleep, spawn};
use registry::Relay;
use std::net::SocketAddr;
use std::os::fd::IntoRawFd;
use std::rc::Rc;
use std::time::{Duration, Instant};

/// How often the relay checks for shutdown.
const TICK: Duration = Duration::from_millis(50);
/// How often the counters are logged (when they changed).
const STATS_EVERY: Duration = Duration::from_secs(60);
/// How long a drain waits for clients accepted before it to open their streams.
const STARTING_GRACE: Duration = Duration::from_secs(2);

/// A running relay.
pub struct Handle {
    /// Where agents connect.
    pub agents: SocketAddr,
    /// The Postgres listener.
    pub postgres: SocketAddr,
    /// Copies of both listeners, for the next process (`handover`).
    pub copies: Option<(std::os::fd::OwnedFd, std::os::fd::OwnedFd)>,
    thread: std::thread::JoinHandle<()>,
}

impl Handle {
    /// Waits until the relay has drained and stopped.
    ///
    /// # Errors
    ///
    /// The relay thread panicked.
    pub fn join(self) -> anyhow::Result<()> {
        self.thread
            .join()
            .map_err(|_| anyhow::anyhow!("the relay thread panicked"))
    }
}

/// Binds the relay's two listeners and starts its thread; it drains and stops once
/// `shutdown()` returns true.
///
/// # Errors
///
/// The TLS files, `LOKADB_MUX_WINDOW_KB`, or a listener that cannot be bound.
pub fn start(
    config: lokadb_shared::config::RelayConfig,
    inherited: Option<(std::os::fd::OwnedFd, std::os::fd::OwnedFd)>,
    shutdown: impl Fn() -> bool + Send + 'static,
    publish: Option<Publish>,
    reloads: Option<crossbeam_channel::Receiver<lokadb_shared::config::RelayConfig>>,
) -> anyhow::Result<Handle> {
    let tls = relay_tls(&config)?;
    let window = lokadb_shared::tunnel::window_from_env().map_err(anyhow::Error::msg)?;
    let caps = lokadb_shared::tunnel::memory_caps_from_env().map_err(anyhow::Error::msg)?;
    let tunnel = lokadb_shared::tunnel::Config {
        window,
        auto_window: lokadb_shared::tunnel::auto_from_env().map_err(anyhow::Error::msg)?,
        memory_cap: caps.tunnel,
        memory_budget: caps.budget(),
        ..lokadb_shared::tunnel::Config::default()
    };
    let adopted = inherited.and_then(|(a, p)| {
        let both = crate::handover::tcp_listener(a, config.agents)
            .and_then(|a| Ok((a, crate::handover::tcp_listener(p, config.postgres)?)));
        both.map_err(|e| {
            tracing::warn!(
                error = format!("{e:#}"),
                "relay: not using the listeners handed over"
            )
        })
        .ok()
    });
    let (agents, postgres) = match adopted {
        Some(both) => both,
        None => (
            std::net::TcpListener::bind(config.agents).map_err(|e| {
                anyhow::anyhow!("relay: cannot listen for agents on {}: {e}", config.agents)
            })?,
            std::net::TcpListener::bind(config.postgres).map_err(|e| {
                anyhow::anyhow!(
                    "relay: cannot listen for Postgres clients on {}: {e}",
                    config.postgres
                )
            })?,
        ),
    };
    let (agents_addr, postgres_addr) = (agents.local_addr()?, postgres.local_addr()?);
    let copies = (
        std::os::fd::OwnedFd::from(agents.try_clone()?),
        std::os::fd::OwnedFd::from(postgres.try_clone()?),
    );
    let (agents_fd, postgres_fd) = (agents.into_raw_fd(), postgres.into_raw_fd());
    tracing::info!(
        agents = %agents_addr,
        postgres = %postgres_addr,
        max_streams = config.max_streams,
        window,
        auto_window = tunnel.auto_window.is_some(),
        tunnel_memory_cap = ?caps.tunnel,
        relay_memory_cap = ?caps.shared,
        organizations = config.tokens.len(),
        "relay listening"
    );
    let thread = std::thread::Builder::new()
        .name("lokadb-relay".into())
        .spawn(move || {
            let relay = Rc::new(Relay::new(config, tls, tunnel));
            // SAFETY: both fds are listening sockets handed over whole.
            let (agents, postgres) = unsafe {
                (
                    TcpListener::from_raw_fd(agents_fd).expect("agents listener"),
                    TcpListener::from_raw_fd(postgres_fd).expect("postgres listener"),
                )
            };
            crate::rt::block_on(run(relay, agents, postgres, shutdown, publish, reloads));
        })?;
    Ok(Handle {
        agents: agents_addr,
        postgres: postgres_addr,
        copies: Some(copies),
        thread,
    })
}

/// Puts a reloaded `relay` section in force: its certificate for the agent connections
/// that start next (tunnels up keep theirs), its tokens for the next authentications, and
/// the tunnels of an organization whose token was removed or replaced are cut.
pub fn apply(relay: &Relay, config: &lokadb_shared::config::RelayConfig) {
    match relay_tls(config) {
        Ok(tls) => {
            *relay.tls.borrow_mut() = tls.agents;
            *relay.postgres_tls.borrow_mut() = tls.postgres;
        }
        Err(e) => tracing::warn!(
            error = format!("{e:#}"),
            "relay reload: the certificate stays"
        ),
    }
    let tokens = tokens::Tokens::new(&config.tokens);
    for conn in relay.all_conns() {
        if let Some(org) = conn.org() {
            if !tokens.same_for(&relay.tokens.borrow(), &org) {
                tracing::info!(
                    conn = conn.id,
                    org,
                    "relay reload: the organization's token was revoked; its tunnel is cut"
                );
                conn.revoke("its token was revoked (relay.tokens reloaded)".into());
            }
        }
    }
    *relay.tokens.borrow_mut() = tokens;
    tracing::info!(
        organizations = config.tokens.len(),
        "relay: tokens and certificate reloaded"
    );
}

/// The relay's TLS, one certificate for both listeners.
pub struct RelayTls {
    /// For agents (no ALPN: agents do not send one).
    pub agents: std::sync::Arc<rustls::ServerConfig>,
    /// For the Postgres listener (ALPN `postgresql`, as libpq 17+ asks), unless
    /// `postgres_tls` is off.
    pub postgres: Option<std::sync::Arc<rustls::ServerConfig>>,
}

/// Reads the relay's certificate and key.
///
/// # Errors
///
/// The certificate or key cannot be used.
pub fn relay_tls(config: &lokadb_shared::config::RelayConfig) -> anyhow::Result<RelayTls> {
    let postgres = crate::net::tls::server_config(&config.tls)?;
    let mut agents = (*postgres).clone();
    agents.alpn_protocols.clear();
    Ok(RelayTls {
        agents: std::sync::Arc::new(agents),
        postgres: (config.postgres_tls != lokadb_shared::config::PostgresTls::Off)
            .then_some(postgres),
    })
}

/// Where the relay hands its counters and tunnels once a second (`GET /metrics`, the
/// console).
pub type Publish = Box<dyn Fn(Vec<(&'static str, u64)>, Vec<Vec<Option<String>>>) + Send>;

async fn run(
    relay: Rc<Relay>,
    agents: TcpListener,
    postgres: TcpListener,
    shutdown: impl Fn() -> bool,
    publish: Option<Publish>,
    reloads: Option<crossbeam_channel::Receiver<lokadb_shared::config::RelayConfig>>,
) {
    let agents_task = spawn(accept_agents(relay.clone(), agents));
    let clients_task = spawn(accept_clients(relay.clone(), postgres));
    let mut last_stats = String::new();
    let mut next_stats = Instant::now() + STATS_EVERY;
    let mut next_publish = Instant::now();
    while !shutdown() {
        sleep(TICK).await;
        if let Some(reloads) = &reloads {
            while let Ok(config) = reloads.try_recv() {
                apply(&relay, &config);
            }
        }
        if let Some(publish) = &publish {
            if Instant::now() >= next_publish {
                next_publish += crate::metrics::PUBLISH_EVERY;
                publish(counters(&relay), tunnel_rows(&relay));
            }
        }
        if Instant::now() >= next_stats {
            next_stats += STATS_EVERY;
            let line = stats_line(&relay);
            if line != last_stats {
                tracing::info!("relay counters: {line}");
                last_stats = line;
            }
        }
    }
    // Drain: stop accepting on both listeners at once, so agents that reconnect find
    // the next relay process instead of a backlog nobody accepts.
    drop(agents_task);
    drop(clients_task);
    // Clients accepted before that open their streams first (a draining tunnel takes no
    // new stream); one that says nothing within the grace is refused.
    tracing::info!(
        starting = relay.starting.get(),
        "relay stopped accepting; clients accepted before open their streams"
    );
    let grace = Instant::now() + relay.config.drain_timeout.min(STARTING_GRACE);
    while relay.starting.get() > 0 && Instant::now() < grace {
        sleep(Duration::from_millis(5)).await;
    }
    relay.draining.set(true);
    let conns = relay.all_conns();
    for conn in &conns {
        conn.drain();
    }
    let deadline = Instant::now() + relay.config.drain_timeout;
    tracing::info!(
        agents = conns.len(),
        streams = relay.streams.get(),
        "relay draining: agents told to reconnect"
    );
    while relay.streams.get() > 0 && Instant::now() < deadline {
        sleep(Duration::from_millis(20)).await;
    }
    if relay.streams.get() > 0 {
        tracing::warn!(
            streams = relay.streams.get(),
            "relay drain_timeout reached; closing streams"
        );
    }
    // Give DRAIN and the last bytes a moment to leave.
    sleep(Duration::from_millis(20)).await;
    tracing::info!("relay stopped");
}

async fn accept_agents(relay: Rc<Relay>, listener: TcpListener) {
    loop {
        match listener.accept().await {
            Ok(tcp) => {
                let Ok(peer) = tcp.peer_addr() else { continue };
                let Some(handshake) = registry::Handshakes::begin(&relay, true, peer.ip()) else {
                    // At debug: a flood must not flood the log.
                    tracing::debug!(%peer, "agent connection closed: relay.max_handshakes reached");
                    continue;
                };
                spawn(tunnel_conn::serve(relay.clone(), tcp, peer, handshake)).detach();
            }
            Err(e) => {
                tracing::warn!(error = %e, "relay: accept failed (agents)");
                sleep(Duration::from_millis(10)).await;
            }
        }
    }
}

async fn accept_clients(relay: Rc<Relay>, listener: TcpListener) {
    loop {
        match listener.accept().await {
            Ok(tcp) => spawn(client::serve(relay.clone(), tcp)).detach(),
            Err(e) => {
                tracing::warn!(error = %e, "relay: accept failed (postgres)");
                sleep(Duration::from_millis(10)).await;
            }
        }
    }
}

/// The relay's counters by name, in the order `SHOW STATS` and the log line show them.
pub fn counters(relay: &Relay) -> Vec<(&'static str, u64)> {
    let s = relay.stats.borrow().clone();
    let (mut stalls, mut violations, mut max_buffered) = (0, 0, 0);
    let (mut growths, mut shed) = (0, 0);
    for conn in relay.all_conns() {
        let t = conn.stats();
        stalls += t.window_stalls;
        violations += t.flow_violations;
        max_buffered = max_buffered.max(conn.max_stream_buffered());
        growths += t.window_growths;
        shed += t.streams_shed;
    }
    vec![
        ("organizations_connected", relay.connected_orgs() as u64),
        ("streams_open", u64::from(relay.streams.get())),
        ("streams_opened", s.streams_opened),
        ("bytes_to_agents", s.bytes_to_agents),
        ("bytes_from_agents", s.bytes_from_agents),
        ("window_stalls", stalls),
        ("flow_violations", violations),
        ("max_stream_buffered", max_buffered),
        ("window_growths", growths),
        ("streams_shed", shed),
        (
            "relay_memory_used",
            relay.tunnel.memory_budget.as_ref().map_or(0, |b| b.used()),
        ),
        ("agents_connected", s.agents_connected),
        ("agents_refused", s.agents_refused),
        ("refused_no_agent", s.refused_no_agent),
        ("refused_max_streams", s.refused_max_streams),
        ("refused_agent_limit", s.refused_agent_limit),
        ("refused_unknown_org", s.refused_unknown_org),
        ("refused_by_agents", s.refused_by_agents),
        ("refused_handshakes", s.refused_handshakes),
        ("clients_tls", s.clients_tls),
    ]
}

/// The columns of `SHOW TUNNELS` (the relay's admin database, the proxy's console).
pub const TUNNEL_COLUMNS: [&str; 12] = [
    "organization",
    "connection",
    "agent",
    "role",
    "streams_open",
    "streams_opened",
    "bytes_sent",
    "bytes_received",
    "window_stalls",
    "flow_violations",
    "max_stream_buffered",
    "rtt_ms",
];

/// One row per agent connection, in [`TUNNEL_COLUMNS`].
pub fn tunnel_rows(relay: &Relay) -> Vec<Vec<Option<String>>> {
    relay
        .all_conns()
        .iter()
        .map(|conn| {
            let org = conn.org().unwrap_or_default();
            let live = relay.live(&org).is_some_and(|l| Rc::ptr_eq(&l, conn));
            let s = conn.stats();
            let rtt = conn
                .rtt()
                .map(|d| format!("{:.3}", d.as_secs_f64() * 1000.0));
            vec![
                Some(org.clone()),
                Some(conn.id.to_string()),
                Some(conn.peer.to_string()),
                Some(if live { "live" } else { "standby" }.to_owned()),
                Some(s.streams_open.to_string()),
                Some(s.streams_opened.to_string()),
                Some(s.bytes_sent.to_string()),
                Some(s.bytes_received.to_string()),
                Some(s.window_stalls.to_string()),
                Some(s.flow_violations.to_string()),
                Some(conn.max_stream_buffered().to_string()),
                rtt,
            ]
        })
        .collect()
}

/// The counters as one log line, `name=value` separated by spaces.
pub fn stats_line(relay: &Relay) -> String {
    counters(relay)
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(" ")
}
