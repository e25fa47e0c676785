//! Connecting to the cloud database for an admin command.

use crate::net::cloud_tls::{connect_postgres, CloudTls};
use lokadb_shared::conninfo::{split_tls, TlsOptions};
use std::fmt;

/// What an admin command reports when it fails: a message for the operator, and
/// whether the fault was the input (exit status 2) or the environment (1).
#[derive(Debug)]
pub struct AdminError {
    /// The message, one or a few lines.
    pub message: String,
    /// The command line or its arguments were wrong: nothing was changed.
    pub usage: bool,
}

impl AdminError {
    /// Bad input: nothing was changed.
    pub fn usage(message: impl Into<String>) -> AdminError {
        AdminError {
            message: message.into(),
            usage: true,
        }
    }

    /// The database or the network failed.
    pub fn failed(message: impl Into<String>) -> AdminError {
        AdminError {
            message: message.into(),
            usage: false,
        }
    }
}

impl fmt::Display for AdminError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl From<postgres::Error> for AdminError {
    fn from(e: postgres::Error) -> AdminError {
        AdminError::failed(describe(&e))
    }
}

/// A Postgres error as `message (SQLSTATE)` plus its detail and hint.
pub fn describe(e: &postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => {
            let mut s = format!("{} ({})", db.message(), db.code().code());
            if let Some(d) = db.detail() {
                s.push_str(&format!("\nDETAIL: {d}"));
            }
            if let Some(h) = db.hint() {
                s.push_str(&format!("\nHINT: {h}"));
            }
            s
        }
        None => e.to_string(),
    }
}

/// Parses `dsn` (libpq keyword form or a `postgresql://` URL), TLS words included.
///
/// # Errors
///
/// A DSN that does not parse (usage).
pub fn parse(dsn: &str) -> Result<(postgres::Config, TlsOptions), AdminError> {
    let invalid =
        |e: &dyn fmt::Display| AdminError::usage(format!("invalid connection string: {e}"));
    let (rest, tls) = split_tls(dsn).map_err(|e| invalid(&e))?;
    let config: postgres::Config = rest.parse().map_err(|e| invalid(&e))?;
    Ok((config, tls))
}

/// Connects to `dsn` (libpq keyword form or a `postgresql://` URL), with TLS as its
/// `sslmode`, `sslrootcert`, `sslcert` and `sslkey` say.
///
/// # Errors
///
/// A DSN that does not parse or TLS files that cannot be used (usage), or a connection
/// that fails.
pub fn connect(dsn: &str) -> Result<postgres::Client, AdminError> {
    let (mut config, tls) = parse(dsn)?;
    if config.get_connect_timeout().is_none() {
        config.connect_timeout(std::time::Duration::from_secs(10));
    }
    config.application_name("lokadb admin");
    let host = match config.get_hosts().first() {
        Some(postgres::config::Host::Tcp(host)) => host.clone(),
        _ => "localhost".to_owned(),
    };
    let tls = CloudTls::new(&tls, &host)
        .map_err(|e| AdminError::usage(format!("connection string: {e:#}")))?;
    connect_postgres(&config, tls.as_ref()).map_err(|e| {
        AdminError::failed(format!("cannot connect to the database: {}", describe(&e)))
    })
}

/// Quotes an identifier for SQL text.
pub fn ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// Quotes a string literal for SQL text (for DDL options, which take no parameters).
pub fn literal(value: &str) -> String {
    format!("'{}'", value.replace('\'', "''"))
}
