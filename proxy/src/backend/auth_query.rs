//! Where client roles' SCRAM verifiers come from: the cloud itself (an auth query run
//! as `auth_user`, as PgBouncer does) or a `users_file`.

use super::conn::{BackendConn, ConnError};
use crate::scram::{Credentials, Secret, Verifier};
use std::cell::RefCell;
use std::collections::HashMap;
use std::net::SocketAddr;

/// A verifier and, for plain-password `users_file` entries, the password itself (then
/// the proxy logs in to the cloud with the password instead of passthrough keys).
#[derive(Clone, Debug)]
pub struct UserSecret {
    /// What the client's proof is checked against.
    pub verifier: Verifier,
    /// The plain password, when known.
    pub password: Option<Secret>,
}

/// Entries of a `users_file`: `{"role": "password or SCRAM-SHA-256$… verifier"}`.
#[derive(Clone, Debug, Default)]
pub struct UsersFile(pub HashMap<String, UserSecret>);

impl UsersFile {
    /// Loads a users file.
    ///
    /// # Errors
    ///
    /// A message naming the file and the problem.
    pub fn load(path: &std::path::Path) -> anyhow::Result<UsersFile> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| anyhow::anyhow!("cannot read users_file {}: {e}", path.display()))?;
        let map: HashMap<String, String> = serde_json::from_str(&text).map_err(|e| {
            anyhow::anyhow!(
                "users_file {}: expected {{\"role\": \"password or verifier\"}}: {e}",
                path.display()
            )
        })?;
        let mut out = HashMap::new();
        for (role, secret) in map {
            let entry = if secret.starts_with("SCRAM-SHA-256$") {
                let verifier = Verifier::parse(&secret).map_err(|e| {
                    anyhow::anyhow!("users_file {}: role {role:?}: {e}", path.display())
                })?;
                UserSecret {
                    verifier,
                    password: None,
                }
            } else if secret.starts_with("md5") && secret.len() == 35 {
                anyhow::bail!(
                    "users_file {}: role {role:?}: md5 hashes are not supported, use SCRAM",
                    path.display()
                )
            } else {
                let salt: [u8; 16] = rand::random();
                UserSecret {
                    verifier: Verifier::from_password(&secret, salt.to_vec(), 4096),
                    password: Some(Secret(secret)),
                }
            };
            out.insert(role, entry);
        }
        Ok(UsersFile(out))
    }
}

/// The auth query of one database on one core, with its idle connections.
pub struct AuthQuery {
    addr: SocketAddr,
    dbname: String,
    user: String,
    password: Secret,
    query: String,
    tls: Option<std::sync::Arc<crate::net::cloud_tls::CloudTls>>,
    /// Idle connections, with whether the query is prepared on each.
    idle: RefCell<Vec<(BackendConn, bool)>>,
}

/// Name of the prepared auth query on auth connections.
const AUTH_STATEMENT: &str = "lokadb_auth_query";

/// At most this many auth connections stay open per database and core.
const MAX_IDLE_AUTH_CONNS: usize = 2;

impl AuthQuery {
    /// An auth query; connections are opened on first use.
    pub fn new(
        addr: SocketAddr,
        dbname: String,
        user: String,
        password: Secret,
        query: String,
        tls: Option<std::sync::Arc<crate::net::cloud_tls::CloudTls>>,
    ) -> AuthQuery {
        AuthQuery {
            addr,
            dbname,
            user,
            password,
            query,
            tls,
            idle: RefCell::new(Vec::new()),
        }
    }

    /// Looks up `role`'s verifier: `Ok(None)` when the role does not exist, cannot log
    /// in, or has no SCRAM verifier (the client then fails like a wrong password).
    ///
    /// # Errors
    ///
    /// The cloud could not be reached or refused `auth_user`.
    pub async fn lookup(&self, role: &str) -> Result<Option<UserSecret>, ConnError> {
        let pooled = self.idle.borrow_mut().pop();
        let (mut conn, prepared) = match pooled {
            Some((c, prepared)) if c.is_idle_and_open() => (c, prepared),
            _ => {
                let creds = Credentials::Password(self.password.clone());
                let conn = BackendConn::connect(
                    self.addr,
                    &self.user,
                    &self.dbname,
                    &[],
                    &creds,
                    self.tls.as_deref(),
                )
                .await?;
                (conn, false)
            }
        };
        let row = conn
            .query_one(AUTH_STATEMENT, &self.query, !prepared, role)
            .await;
        if row.is_ok() {
            let mut idle = self.idle.borrow_mut();
            if idle.len() < MAX_IDLE_AUTH_CONNS {
                idle.push((conn, true));
            }
        }
        let verifier = match row? {
            Some(Some(text)) => Verifier::parse(&text).ok(),
            _ => None,
        };
        if verifier.is_none() {
            tracing::debug!(role, "no usable SCRAM verifier for role");
        }
        Ok(verifier.map(|verifier| UserSecret {
            verifier,
            password: None,
        }))
    }
}
