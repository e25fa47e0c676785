//! SIGHUP: the configuration file given with `--config` is read again and put in force for
//! what starts next — connections and sessions (limits, `auth_timeout`, `route_log`,
//! `users_file`, client TLS certificates, `admin_users`, `peers`) and each database's
//! settings (pool, direct path, `statement_org`, the auth query). Running sessions keep
//! what they started with. A file that does not load, or names files that cannot be
//! used, changes nothing and the log says why. What needs new sockets or threads (the
//! listening and metrics addresses, `record`, the relay, a database added or pointed at
//! another cloud or role) is logged as waiting for a restart.

use crate::core::{Settings, Shared};
use crate::rt::mailbox::Mailbox;
use lokadb_shared::config::{Config, DatabaseConfig};
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
        let waiting = needs_restart(&self.shared.config, &settings.config);
        let config = settings.config.clone();
        self.shared.set_settings(settings);
        for core in &self.cores {
            core.send(config.clone());
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
    // The relay's section has no PartialEq: compared as written.
    if serde_json::to_string(&start.relay).ok() != serde_json::to_string(&new.relay).ok() {
        out.push("relay".to_owned());
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
