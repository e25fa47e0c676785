//! Checks the command line into an [`AgentConfig`]; every error is a sentence for the
//! operator, and `main` exits with code 2 on it.

use std::path::PathBuf;
use std::sync::Arc;

use lokadb_shared::tunnel::frame::MAX_TEXT_LEN;
use rustls::pki_types::ServerName;
use rustls::ClientConfig;

use crate::net::HostPort;
use crate::tls;

/// The arguments as given, before checks (filled by clap in `main`).
#[derive(Debug, Clone)]
pub struct RawArgs {
    pub relays: Vec<String>,
    pub token: String,
    pub postgres: String,
    pub max_conns: u32,
    pub ca: PathBuf,
    pub server_name: Option<String>,
}

/// One relay to keep a tunnel to.
#[derive(Debug, Clone)]
pub struct Relay {
    /// Where to dial.
    pub addr: HostPort,
    /// The name its certificate must carry.
    pub server_name: ServerName<'static>,
}

/// The checked configuration.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// The relays, each with its own tunnel and thread.
    pub relays: Vec<Relay>,
    /// The organization's token, sent in HELLO.
    pub token: String,
    /// The organization's Postgres.
    pub postgres: HostPort,
    /// Streams (Postgres connections) the relay may have open at once, per tunnel.
    pub max_conns: u32,
    /// Receive window per stream (`LOKADB_MUX_WINDOW_KB`).
    pub window: u32,
    /// Window auto-tuning (`LOKADB_MUX_AUTO`, `LOKADB_MUX_MAX_WINDOW_KB`); off by default.
    pub auto_window: Option<lokadb_shared::tunnel::AutoWindow>,
    /// Receive memory one tunnel may hold (`LOKADB_MUX_TUNNEL_MEMORY_MB`).
    pub memory_cap: Option<u64>,
    /// TLS client configuration (trusted CA certificates).
    pub tls: Arc<ClientConfig>,
}

impl AgentConfig {
    /// Checks `args`; `window` is the result of parsing `LOKADB_MUX_WINDOW_KB`.
    pub fn check(args: RawArgs, window: Result<u32, String>) -> Result<AgentConfig, String> {
        let mut relays: Vec<Relay> = Vec::new();
        for spec in args.relays.iter().map(|r| r.trim()) {
            let addr = HostPort::parse(spec).map_err(|e| format!("--relay: {e}"))?;
            if relays.iter().any(|r| r.addr == addr) {
                return Err(format!("--relay: {addr} is listed twice"));
            }
            let name = args.server_name.as_deref().unwrap_or(&addr.host);
            let server_name = tls::server_name(name).map_err(|e| format!("--server-name: {e}"))?;
            relays.push(Relay { addr, server_name });
        }
        if relays.is_empty() {
            return Err("--relay: give at least one relay HOST:PORT".into());
        }
        if args.token.is_empty() {
            return Err("--token: the token is empty".into());
        }
        if args.token.len() > MAX_TEXT_LEN {
            return Err(format!(
                "--token: the token is {} bytes long, the limit is {MAX_TEXT_LEN}",
                args.token.len()
            ));
        }
        let postgres =
            HostPort::parse(args.postgres.trim()).map_err(|e| format!("--postgres: {e}"))?;
        if args.max_conns == 0 {
            return Err("--max-conns: must be at least 1".into());
        }
        let window = window?;
        let tls = tls::client_config(&args.ca).map_err(|e| format!("--ca: {e}"))?;
        Ok(AgentConfig {
            relays,
            token: args.token,
            postgres,
            max_conns: args.max_conns,
            window,
            auto_window: None,
            memory_cap: None,
            tls,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One CA file per test process, written once: tests run in parallel, and one must
    /// never read the file while another is writing it.
    fn ca_file() -> PathBuf {
        static CA: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
        let _ = rustls::crypto::ring::default_provider().install_default();
        CA.get_or_init(|| {
            let path = std::env::temp_dir()
                .join(format!("lokadb-agent-config-ca-{}.pem", std::process::id()));
            let ck = rcgen::generate_simple_self_signed(vec!["relay.test".into()]).unwrap();
            std::fs::write(&path, ck.cert.pem()).unwrap();
            path
        })
        .clone()
    }

    fn args() -> RawArgs {
        RawArgs {
            relays: vec!["relay.example.com:7443".into(), " 10.0.0.2:7443".into()],
            token: "org.secret".into(),
            postgres: "127.0.0.1:5432".into(),
            max_conns: 100,
            ca: ca_file(),
            server_name: None,
        }
    }

    fn error(change: impl FnOnce(&mut RawArgs)) -> String {
        let mut a = args();
        change(&mut a);
        AgentConfig::check(a, Ok(4096)).unwrap_err()
    }

    #[test]
    fn good_arguments() {
        let c = AgentConfig::check(args(), Ok(65536)).unwrap();
        assert_eq!(c.relays.len(), 2);
        assert_eq!(c.relays[0].server_name.to_str(), "relay.example.com");
        assert_eq!(c.relays[1].server_name.to_str(), "10.0.0.2");
        assert_eq!(c.postgres.port, 5432);
        assert_eq!(c.window, 65536);
        let mut a = args();
        a.server_name = Some("relay.internal".into());
        let c = AgentConfig::check(a, Ok(1)).unwrap();
        assert!(c
            .relays
            .iter()
            .all(|r| r.server_name.to_str() == "relay.internal"));
    }

    #[test]
    fn bad_arguments() {
        assert!(error(|a| a.relays = vec!["relay".into()]).starts_with("--relay:"));
        assert!(error(|a| a.relays.clear()).contains("at least one relay"));
        assert!(error(|a| a.relays.push("10.0.0.2:7443".into())).contains("listed twice"));
        assert!(error(|a| a.token = "x".repeat(1025)).contains("1025 bytes long"));
        assert!(error(|a| a.token.clear()).contains("empty"));
        assert!(error(|a| a.postgres = "localhost".into()).starts_with("--postgres:"));
        assert!(error(|a| a.max_conns = 0).contains("at least 1"));
        assert!(error(|a| a.ca = "/nonexistent.pem".into()).starts_with("--ca: cannot read"));
        assert!(error(|a| a.server_name = Some("no good".into())).starts_with("--server-name:"));
        assert_eq!(
            AgentConfig::check(args(), Err("LOKADB_MUX_WINDOW_KB bad".into())).unwrap_err(),
            "LOKADB_MUX_WINDOW_KB bad"
        );
    }
}
