//! SIGHUP: the configuration file given with `--config` is read again and put in force for
//! what starts next — connections and sessions (limits, `auth_timeout`, `route_log`,
//! `users_file`, client TLS certificates, `admin_users`, `peers`) and each database's
//! settings (pool, direct path, `statement_org`, the auth query). Running sessions keep
//! what they started with. A file that does not load, or names files that cannot be
//! used, changes nothing and the log says why. What needs new sockets or threads (the
//! listening and metrics addresses, `record`, the relay's addresses and limits, a database
//! added or pointed at another cloud or role) is logged as waiting for a restart. The
//! relay takes its new tokens (cutting the tunnels of an organization whose token went)
//! and certificate, in this process or in `lokadb relay` run alone.

use crate::core::{Settings, Shared};
use crate::rt::mailbox::Mailbox;
use lokadb_shared::config::{Config, DatabaseConfig, RelayConfig};
use std::path::PathBuf;
use std::sync::Arc;

/// Reloads on SIGHUP (on the signal thread: reading files and certificates blocks).
pub struct Reloader {
    /// The file given with `--config`.
    pub path: PathBuf,
    /// The shared settings it replaces.
    pub shared: Arc<Shared>,
    /// Each core's inbox for the new configuration.
    pub cores: Vec<Mailbox<Arc<Config>>>,
    /// The relay's, when it runs in this process.
    pub relay: Option<crossbeam_channel::Sender<RelayConfig>>,
}

impl Reloader {
    /// Reads the file again and puts it in force, or says why not.
    pub fn reload(&self) {
        let path = self.path.display().to_string();
        let mut config = match Config::load(&self.path) {
            Ok(c) => c,
            Err(e) => {
                return tracing::warn!(path, error = %e, "reload refused: the running configuration stays");
            }
        };
        // `--record` on the command line wins over the file, as at start.
        config.record.clone_from(&self.shared.config.record);
        let settings = match Settings::new(config, self.shared.has_env_auth_password()) {
            Ok(s) => s,
            Err(e) => {
                return tracing::warn!(
                    path,
                    error = format!("{e:#}"),
                    "reload refused: the running configuration stays"
                );
            }
        };
        if let Some(relay) = &settings.config.relay {
            if let Err(e) = crate::relay::relay_tls(relay) {
                return tracing::warn!(
                    path,
                    error = format!("relay.tls: {e:#}"),
                    "reload refused: the running configuration stays"
                );
            }
        }
        let waiting = needs_restart(&self.shared.config, &settings.config);
        let config = settings.config.clone();
        self.shared.set_settings(settings);
        for core in &self.cores {
            core.send(config.clone());
        }
        if let (Some(tx), Some(relay)) = (&self.relay, &config.relay) {
            let _ = tx.send(relay.clone());
        }
        if waiting.is_empty() {
            tracing::info!(path, "configuration reloaded");
        } else {
            tracing::warn!(
                path,
                not_applied = waiting.join(", "),
                "configuration reloaded; what is listed in not_applied takes a restart"
            );
        }
    }
}

/// Whether a reload may put `new` in place of `old` for a running database: the same
/// cloud, reached as the same role.
pub fn same_cloud(old: &DatabaseConfig, new: &DatabaseConfig) -> bool {
    old.cloud == new.cloud
        && old.auth_user == new.auth_user
        && old.auth_password == new.auth_password
}

/// What differs between the configuration at start and `new` that a reload cannot apply.
pub fn needs_restart(start: &Config, new: &Config) -> Vec<String> {
    let mut out = Vec::new();
    if start.listen != new.listen {
        out.push("listen".to_owned());
    }
    if start.metrics != new.metrics {
        out.push("metrics".to_owned());
    }
    if start.handover != new.handover {
        out.push("handover".to_owned());
    }
    match (&start.relay, &new.relay) {
        (Some(a), Some(b)) if relay_fixed(a) == relay_fixed(b) => {}
        (None, None) => {}
        _ => out.push("relay (other than its tokens and certificate)".to_owned()),
    }
    for (name, db) in &new.databases {
        match start.databases.get(name) {
            None => out.push(format!("databases.{name} (added)")),
            Some(old) if !same_cloud(old, db) => {
                out.push(format!(
                    "databases.{name}.cloud, auth_user or auth_password"
                ));
            }
            Some(_) => {}
        }
    }
    out
}

/// What of a relay section a reload cannot change, as written (it has no `PartialEq`):
/// all but its tokens and certificate.
fn relay_fixed(relay: &RelayConfig) -> String {
    let mut fixed = relay.clone();
    fixed.tokens.clear();
    fixed.tls = lokadb_shared::config::TlsConfig {
        cert: PathBuf::new(),
        key: PathBuf::new(),
    };
    serde_json::to_string(&fixed).unwrap_or_default()
}

/// SIGHUP for `lokadb relay` run alone: its tokens and certificate from the file again.
pub fn reload_relay(
    path: &std::path::Path,
    start: &RelayConfig,
    relay: &crossbeam_channel::Sender<RelayConfig>,
) {
    let shown = path.display().to_string();
    let new = match Config::load(path) {
        Ok(Config { relay: Some(r), .. }) => r,
        Ok(_) => {
            return tracing::warn!(path = shown, "reload refused: the file has no \"relay\" section; the running configuration stays");
        }
        Err(e) => {
            return tracing::warn!(path = shown, error = %e, "reload refused: the running configuration stays");
        }
    };
    if let Err(e) = crate::relay::relay_tls(&new) {
        return tracing::warn!(
            path = shown,
            error = format!("relay.tls: {e:#}"),
            "reload refused: the running configuration stays"
        );
    }
    if relay_fixed(start) != relay_fixed(&new) {
        tracing::warn!(path = shown, "the relay's addresses and limits take a restart; its tokens and certificate are reloaded");
    }
    let _ = relay.send(new);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(extra: &str) -> Config {
        let relay = r#""relay": {"agents": "127.0.0.1:7443", "postgres": "127.0.0.1:6543", "tls": {"cert": "c.pem", "key": "k.pem"}, "tokens": {}}"#;
        Config::from_json(&format!(
            r#"{{"databases": {{"app": {{"cloud": "host=127.0.0.1 dbname=app", "auth_user": "a", "auth_password": "p"}}}}, {relay}{extra}}}"#
        ))
        .unwrap()
    }

    #[test]
    fn what_takes_a_restart_is_named() {
        let start = config("");
        assert!(needs_restart(
            &start,
            &config(r#", "max_connections": 5, "route_log": true"#)
        )
        .is_empty());
        let mut tokens = config("");
        let token = format!("sha256:{}", "ab".repeat(32));
        tokens
            .relay
            .as_mut()
            .unwrap()
            .tokens
            .insert("acme".into(), token);
        tokens.relay.as_mut().unwrap().tls.cert = "other.pem".into();
        assert!(
            needs_restart(&start, &tokens).is_empty(),
            "tokens and certificate reload"
        );
        let mut moved = config("");
        moved.relay.as_mut().unwrap().agents = "127.0.0.1:7444".parse().unwrap();
        moved.listen = "127.0.0.1:7000".parse().unwrap();
        let mut cloud = moved.databases["app"].clone();
        cloud.cloud = "host=10.0.0.1 dbname=app".into();
        moved.databases.insert("app".into(), cloud.clone());
        moved.databases.insert("new".into(), cloud);
        assert_eq!(
            needs_restart(&start, &moved),
            [
                "listen",
                "relay (other than its tokens and certificate)",
                "databases.app.cloud, auth_user or auth_password",
                "databases.new (added)"
            ]
        );
    }
}
