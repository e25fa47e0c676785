//! Errors of a client session, each classified, and how each reaches the client.
//!
//! Following Neon's proxy: every error has a [`ErrorKind`], and only what
//! [`SessionError::to_client`] renders reaches the client — as a Postgres
//! ErrorResponse with a SQLSTATE. Internal detail (addresses, io errors) goes to logs.

use lokadb_shared::wire::backend::{error_response, ErrorFields, Severity};
use lokadb_shared::wire::sqlstate::{self, SqlState};
use lokadb_shared::wire::FrameError;
use std::fmt;

/// Who or what caused an error; decides the log level and what the client is told.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// The client sent something wrong (bad password, bad bytes, unknown database).
    User,
    /// The client went away.
    ClientDisconnect,
    /// A configured limit was reached.
    Limit,
    /// The proxy is shutting down.
    Service,
    /// The cloud database failed or refused.
    Upstream,
}

/// Why a client session ended or a request was refused.
#[derive(Debug)]
pub enum SessionError {
    /// The client broke the framing rules.
    Protocol(FrameError),
    /// A message arrived that is not valid in the current state.
    UnexpectedMessage {
        /// What the proxy was waiting for.
        expected: &'static str,
        /// The tag that arrived.
        got: u8,
    },
    /// Protocol version other than 3.
    UnsupportedProtocol {
        /// Requested major version.
        major: u16,
        /// Requested minor version.
        minor: u16,
    },
    /// The startup packet has no `user`.
    NoUser,
    /// Password authentication failed (wrong password or unknown role; the client is
    /// not told which).
    AuthFailed {
        /// The role the client asked for.
        user: String,
    },
    /// SCRAM message or option problems.
    Scram(crate::scram::ScramError),
    /// The database name is not configured.
    UnknownDatabase(String),
    /// `max_connections` reached.
    TooManyConnections,
    /// No cloud backend came free within `pool_timeout` at `pool_size`.
    PoolTimeout {
        database: String,
        user: String,
        size: u32,
        waited: std::time::Duration,
    },
    /// `max_handshakes` (or, when `per_address`, `max_handshakes_per_address`) reached.
    TooManyHandshakes { per_address: bool },
    /// `auth_timeout` passed before the client authenticated.
    AuthTimeout,
    /// Could not reach or log in to the cloud database (detail is for the log).
    UpstreamConnect(String),
    /// The cloud sent an ErrorResponse at login; forwarded to the client verbatim.
    UpstreamRejected(Vec<u8>),
    /// The cloud connection was lost mid-session.
    UpstreamLost(std::io::Error),
    /// The direct connection to this organization's database was lost under a statement.
    DirectLost(String, std::io::Error),
    /// The verifier lookup failed (detail is for the log).
    AuthLookup(String),
    /// The client connection failed.
    Client(std::io::Error),
    /// Something the proxy does not do (replication connections).
    Unsupported(&'static str),
    /// The startup `options` set `lokadb.org`, and the proxy has no LokaDB metadata for the
    /// database (no `auth_user`, or not loaded yet), so it could not limit the session.
    StartupOrgUnlimited(String),
    /// An authenticated role asked for the console and is not in `admin_users`.
    NotAdmin(String),
    /// The proxy is shutting down.
    Shutdown,
}

impl SessionError {
    /// The error's classification.
    pub fn kind(&self) -> ErrorKind {
        use SessionError::*;
        match self {
            Protocol(_)
            | UnexpectedMessage { .. }
            | UnsupportedProtocol { .. }
            | NoUser
            | AuthFailed { .. }
            | Scram(_)
            | UnknownDatabase(_)
            | AuthTimeout
            | Unsupported(_)
            | StartupOrgUnlimited(_)
            | NotAdmin(_) => ErrorKind::User,
            TooManyConnections | TooManyHandshakes { .. } | PoolTimeout { .. } => ErrorKind::Limit,
            UpstreamConnect(_) | UpstreamRejected(_) | UpstreamLost(_) | DirectLost(..)
            | AuthLookup(_) => ErrorKind::Upstream,
            Client(_) => ErrorKind::ClientDisconnect,
            Shutdown => ErrorKind::Service,
        }
    }

    /// Appends what the client is told, if anything (nothing when it is gone).
    pub fn to_client(&self, out: &mut Vec<u8>) {
        use SessionError::*;
        let fatal = |out: &mut Vec<u8>, code: SqlState, message: &str, hint: Option<&str>| {
            error_response(
                out,
                &ErrorFields {
                    severity: Severity::Fatal,
                    code,
                    message,
                    detail: None,
                    hint,
                },
            )
        };
        match self {
            Protocol(e) => {
                let code = match e {
                    FrameError::TooLarge { .. } => sqlstate::PROGRAM_LIMIT_EXCEEDED,
                    _ => sqlstate::PROTOCOL_VIOLATION,
                };
                fatal(out, code, &e.to_string(), None)
            }
            UnexpectedMessage { expected, got } => fatal(
                out,
                sqlstate::PROTOCOL_VIOLATION,
                &format!(
                    "expected {expected}, got message type {}",
                    lokadb_shared::wire::frame::Tag(*got)
                ),
                None,
            ),
            UnsupportedProtocol { major, minor } => fatal(
                out,
                sqlstate::FEATURE_NOT_SUPPORTED,
                &format!(
                    "unsupported frontend protocol {major}.{minor}: server supports 3.0 to 3.0"
                ),
                None,
            ),
            NoUser => fatal(
                out,
                sqlstate::INVALID_AUTHORIZATION,
                "no PostgreSQL user name specified in startup packet",
                None,
            ),
            AuthFailed { user } => fatal(
                out,
                sqlstate::INVALID_PASSWORD,
                &format!("password authentication failed for user \"{user}\""),
                None,
            ),
            Scram(e) => fatal(out, sqlstate::PROTOCOL_VIOLATION, &e.to_string(), None),
            UnknownDatabase(db) => fatal(
                out,
                sqlstate::INVALID_CATALOG_NAME,
                &format!("database \"{db}\" does not exist"),
                Some("The LokaDB proxy serves only the databases listed in its configuration."),
            ),
            TooManyConnections => fatal(
                out,
                sqlstate::TOO_MANY_CONNECTIONS,
                "sorry, too many clients already",
                Some("The LokaDB proxy's max_connections was reached."),
            ),
            PoolTimeout {
                database,
                user,
                size,
                waited,
            } => fatal(
                out,
                sqlstate::TOO_MANY_CONNECTIONS,
                &format!(
                    "no cloud backend came free for database \"{database}\" and role \"{user}\" within {} ms: all {size} of its pool are in use",
                    waited.as_millis()
                ),
                Some("The LokaDB proxy's pool_size for this database was reached and pool_timeout passed. Shorten transactions, or raise pool_size (and the cloud's max_connections)."),
            ),
            TooManyHandshakes { per_address } => fatal(
                out,
                sqlstate::TOO_MANY_CONNECTIONS,
                "sorry, too many clients already",
                Some(if *per_address {
                    "Too many connections from this address are logging in at once (the LokaDB proxy's max_handshakes_per_address)."
                } else {
                    "Too many connections are logging in at once (the LokaDB proxy's max_handshakes)."
                }),
            ),
            AuthTimeout => fatal(
                out,
                sqlstate::QUERY_CANCELED,
                "canceling authentication due to timeout",
                None,
            ),
            UpstreamConnect(_) => fatal(
                out,
                sqlstate::CANNOT_CONNECT,
                "could not connect to the cloud database",
                Some("See the LokaDB proxy's log for the cause."),
            ),
            UpstreamRejected(frame) => out.extend_from_slice(frame),
            UpstreamLost(_) => fatal(
                out,
                sqlstate::CONNECTION_FAILURE,
                "lost the connection to the cloud database",
                None,
            ),
            DirectLost(org, _) => fatal(
                out,
                sqlstate::CONNECTION_FAILURE,
                &format!("lost the connection to organization {org}'s database (the direct path, through the relay)"),
                Some("Reconnect: its statements go through the cloud until its database answers again"),
            ),
            AuthLookup(_) => fatal(
                out,
                sqlstate::CANNOT_CONNECT,
                "could not look up the role's password verifier",
                Some("See the LokaDB proxy's log for the cause."),
            ),
            Client(_) => {}
            Unsupported(what) => fatal(
                out,
                sqlstate::FEATURE_NOT_SUPPORTED,
                &format!("{what} are not supported by the LokaDB proxy"),
                None,
            ),
            StartupOrgUnlimited(db) => fatal(
                out,
                sqlstate::FEATURE_NOT_SUPPORTED,
                &format!("lokadb.org in the connection's options: the proxy has no LokaDB metadata for database \"{db}\" to limit the session with"),
                Some("The database needs auth_user in the proxy's configuration (metadata loads at start: retry in a moment), or connect without lokadb.org in options"),
            ),
            NotAdmin(user) => fatal(
                out,
                "28000",
                &format!("role \"{user}\" may not use the console"),
                Some("The console (database \"lokadb\") admits the roles listed in the proxy's admin_users."),
            ),
            Shutdown => fatal(
                out,
                sqlstate::ADMIN_SHUTDOWN,
                "terminating connection due to administrator command",
                None,
            ),
        }
    }
}

impl fmt::Display for SessionError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use SessionError::*;
        match self {
            Protocol(e) => write!(f, "protocol error: {e}"),
            UnexpectedMessage { expected, got } => write!(f, "expected {expected}, got tag {got}"),
            UnsupportedProtocol { major, minor } => {
                write!(f, "unsupported protocol {major}.{minor}")
            }
            NoUser => f.write_str("no user in startup packet"),
            AuthFailed { user } => write!(f, "authentication failed for role {user:?}"),
            Scram(e) => write!(f, "{e}"),
            UnknownDatabase(db) => write!(f, "unknown database {db:?}"),
            TooManyConnections => f.write_str("max_connections reached"),
            PoolTimeout { size, .. } => write!(f, "pool_timeout at pool_size {size}"),
            TooManyHandshakes { per_address: false } => f.write_str("max_handshakes reached"),
            TooManyHandshakes { per_address: true } => {
                f.write_str("max_handshakes_per_address reached")
            }
            AuthTimeout => f.write_str("auth_timeout reached"),
            UpstreamConnect(e) => write!(f, "cloud connect failed: {e}"),
            UpstreamRejected(_) => f.write_str("cloud rejected the login"),
            UpstreamLost(e) => write!(f, "cloud connection lost: {e}"),
            DirectLost(org, e) => {
                write!(f, "organization {org}'s database lost (direct path): {e}")
            }
            AuthLookup(e) => write!(f, "verifier lookup failed: {e}"),
            Client(e) => write!(f, "client connection: {e}"),
            Unsupported(what) => write!(f, "unsupported: {what}"),
            StartupOrgUnlimited(db) => {
                write!(
                    f,
                    "lokadb.org in startup options without metadata for {db:?}"
                )
            }
            NotAdmin(user) => write!(f, "role {user:?} is not in admin_users"),
            Shutdown => f.write_str("shutting down"),
        }
    }
}

impl std::error::Error for SessionError {}

impl From<FrameError> for SessionError {
    fn from(e: FrameError) -> Self {
        SessionError::Protocol(e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lokadb_shared::wire::notice::Notice;

    fn rendered(e: SessionError) -> Notice {
        let mut out = Vec::new();
        e.to_client(&mut out);
        Notice::parse(&out[5..]).unwrap()
    }

    #[test]
    fn wrong_password_matches_postgres() {
        let n = rendered(SessionError::AuthFailed { user: "app".into() });
        assert_eq!(n.code, "28P01");
        assert_eq!(n.message, "password authentication failed for user \"app\"");
        assert_eq!(n.severity, "FATAL");
    }

    #[test]
    fn oversized_message_is_a_limit_error() {
        let n = rendered(SessionError::Protocol(FrameError::TooLarge {
            tag: b'Q',
            len: 10,
            max: 5,
        }));
        assert_eq!(n.code, "54000");
    }

    #[test]
    fn internal_detail_does_not_reach_the_client() {
        let n = rendered(SessionError::UpstreamConnect(
            "connect 10.0.0.5:5432: refused".into(),
        ));
        assert_eq!(n.code, "08001");
        assert!(!n.message.contains("10.0.0.5"));
    }

    #[test]
    fn a_vanished_client_is_told_nothing() {
        let mut out = Vec::new();
        SessionError::Client(std::io::ErrorKind::BrokenPipe.into()).to_client(&mut out);
        assert!(out.is_empty());
        assert_eq!(SessionError::TooManyConnections.kind(), ErrorKind::Limit);
    }
}
