//! `lokadb-agent`: runs beside an organization's Postgres, dials the relay over TLS
//! and turns each tunnel stream into a TCP connection to that Postgres.
//!
//! The relay sends a stream's Postgres startup packet as its first bytes, so the
//! agent never parses Postgres: it pipes bytes, with the tunnel's per-stream flow
//! control carried end to end. No async runtime: one thread per relay, each a
//! `poll(2)` loop over non-blocking sockets.
//!
//! # Layout
//!
//! - `main.rs`: command line, logging, one thread per relay, signals.
//! - [`config`]: checks the arguments into an [`config::AgentConfig`].
//! - [`tls`]: the rustls client configuration (CA file, server name).
//! - [`relay`]: one relay's thread: the current tunnel, draining tunnels, reconnects.
//! - [`session`]: one TLS connection to the relay carrying one tunnel.
//! - [`streams`]: tunnel streams ↔ Postgres sockets, with flow control.
//! - [`backoff`]: jittered exponential reconnect delays.
//! - [`poller`]: a thin wrapper over `poll(2)`.
//! - [`net`]: `HOST:PORT`, resolution, non-blocking connect.

mod backoff;
mod config;
mod net;
mod poller;
mod relay;
mod session;
mod streams;
mod tls;

use std::ffi::OsString;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;
use signal_hook::consts::{SIGINT, SIGTERM};
use tracing::{error, info};
use tracing_subscriber::EnvFilter;

use crate::config::{AgentConfig, RawArgs};

/// LokaDB agent: keeps a TLS tunnel to the relay and connects the streams it carries
/// to the organization's Postgres.
#[derive(Parser, Debug)]
#[command(name = "lokadb-agent", version, about)]
struct Args {
    /// Relay address, HOST:PORT (repeat, or comma-separate, for several relays: one
    /// tunnel to each).
    #[arg(long, env = "LOKADB_RELAY", required = true, value_delimiter = ',')]
    relay: Vec<String>,
    /// The organization's token.
    #[arg(long, env = "LOKADB_TOKEN", hide_env_values = true)]
    token: String,
    /// The organization's Postgres, HOST:PORT.
    #[arg(long, env = "LOKADB_POSTGRES")]
    postgres: String,
    /// Most connections to the organization's Postgres at once (per relay tunnel).
    #[arg(long = "max-conns", env = "LOKADB_MAX_CONNS", default_value_t = 100)]
    max_conns: u32,
    /// CA certificates (PEM) the relay's certificate must chain to.
    #[arg(long, env = "LOKADB_CA", default_value = tls::DEFAULT_CA_FILE)]
    ca: PathBuf,
    /// Name the relay's certificate must carry [default: the host of --relay].
    #[arg(long, env = "LOKADB_SERVER_NAME")]
    server_name: Option<String>,
}

fn main() -> ExitCode {
    let args = Args::parse_from(std::env::args_os().map(long_spelling));
    init_logging();
    let _ = rustls::crypto::ring::default_provider().install_default();
    let raw = RawArgs {
        relays: args.relay,
        token: args.token,
        postgres: args.postgres,
        max_conns: args.max_conns,
        ca: args.ca,
        server_name: args.server_name,
    };
    let checked =
        AgentConfig::check(raw, lokadb_shared::tunnel::window_from_env()).and_then(|mut c| {
            c.auto_window = lokadb_shared::tunnel::auto_from_env()?;
            c.memory_cap = lokadb_shared::tunnel::memory_caps_from_env()?.tunnel;
            Ok(c)
        });
    let config = match checked {
        Ok(config) => Arc::new(config),
        Err(e) => {
            eprintln!("lokadb-agent: {e}");
            return ExitCode::from(2);
        }
    };
    let signals = signal_hook::iterator::Signals::new([SIGTERM, SIGINT]);
    let mut signals = match signals {
        Ok(s) => s,
        Err(e) => {
            eprintln!("lokadb-agent: cannot handle signals: {e}");
            return ExitCode::FAILURE;
        }
    };
    exit_on_thread_panic();
    info!(
        relays = %config.relays.iter().map(|r| r.addr.to_string()).collect::<Vec<_>>().join(","),
        postgres = %config.postgres,
        max_conns = config.max_conns,
        window = config.window,
        "lokadb-agent {} starting", env!("CARGO_PKG_VERSION")
    );
    for (i, relay) in config.relays.iter().enumerate() {
        let (relay, config) = (relay.clone(), config.clone());
        let name = format!("relay-{}", relay.addr);
        let spawned = std::thread::Builder::new()
            .name(name)
            .stack_size(256 * 1024)
            .spawn(move || relay::run(relay, config, i as u64));
        if let Err(e) = spawned {
            error!("cannot start a thread: {e}");
            return ExitCode::FAILURE;
        }
    }
    let signal = signals.forever().next();
    info!("signal {} received, exiting", signal.unwrap_or(0));
    ExitCode::SUCCESS
}

/// Logs to stderr (stdout carries only the "connected" line), filtered by
/// `LOKADB_LOG` (default `info`).
fn init_logging() {
    let filter = EnvFilter::try_from_env("LOKADB_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
}

/// A relay thread must never stop alone: a panic ends the process (exit code 70)
/// so that its supervisor restarts it.
fn exit_on_thread_panic() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        default(info);
        std::process::exit(70);
    }));
}

/// Accepts the single-dash `-max-conns` spelling of `--max-conns`.
fn long_spelling(arg: OsString) -> OsString {
    match arg.to_str() {
        Some(s) if s == "-max-conns" || s.starts_with("-max-conns=") => format!("-{s}").into(),
        _ => arg,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Args, clap::Error> {
        Args::try_parse_from(args.iter().map(|a| long_spelling(a.into())))
    }

    #[test]
    fn flags() {
        let a = parse(&[
            "lokadb-agent",
            "--relay",
            "a:1,b:2",
            "--relay",
            "c:3",
            "--token",
            "t",
            "--postgres",
            "127.0.0.1:5432",
            "-max-conns",
            "7",
            "--server-name",
            "relay.test",
        ])
        .unwrap();
        assert_eq!(a.relay, ["a:1", "b:2", "c:3"]);
        assert_eq!(a.max_conns, 7);
        assert_eq!(a.server_name.as_deref(), Some("relay.test"));
        let a = parse(&[
            "lokadb-agent",
            "--relay=a:1",
            "--token=t",
            "--postgres=p:1",
            "-max-conns=9",
        ])
        .unwrap();
        assert_eq!(a.max_conns, 9);
    }

    #[test]
    fn bad_max_conns_is_a_usage_error() {
        let e = parse(&[
            "lokadb-agent",
            "--relay=a:1",
            "--token=t",
            "--postgres=p:1",
            "--max-conns=lots",
        ])
        .unwrap_err();
        assert_eq!(e.exit_code(), 2);
    }
}
