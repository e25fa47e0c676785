//! What a cloud backend holds at login — its `lokadb.org`, its transaction defaults and its
//! `search_path`, from
//! its startup `options`, its role's or its database's defaults — asked of it once, in one
//! round trip, and kept with it: a pooled backend is reset (`DISCARD ALL`) to the same
//! values.

use super::conn::{BackendConn, ConnError};

/// The transaction defaults a direct login carries (`docs/routing.md`, "What the client
/// sees"): GUCs, settable at startup.
pub const TX_DEFAULTS: [&str; 3] = [
    "default_transaction_isolation",
    "default_transaction_read_only",
    "default_transaction_deferrable",
];

/// One text: the three transaction defaults, the `search_path` (a newline in a quoted
/// schema name made a space: it then names no schema the proxy knows), then `lokadb.org`
/// (`$1`) when set; one a line (`concat_ws` leaves the NULL of an unknown setting out, and
/// the organization, last, may hold anything).
const SQL: &str = "SELECT concat_ws(E'\\n', \
     current_setting('default_transaction_isolation'), \
     current_setting('default_transaction_read_only'), \
     current_setting('default_transaction_deferrable'), \
     replace(current_setting('search_path'), E'\\n', ' '), \
     current_setting($1, true))";

/// What a cloud backend holds when nothing was set in it since login.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AtLogin {
    /// Its `lokadb.org`, if any: what `RESET` returns the session's organization to.
    pub org: Option<String>,
    /// Its transaction defaults.
    pub tx: TxDefaults,
    /// Its `search_path`, which a cloud older than PostgreSQL 18 does not report
    /// ([`crate::route::names`]).
    pub search_path: String,
}

/// A session's transaction defaults, as Postgres writes them (`read committed`, `on`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TxDefaults {
    pub isolation: String,
    pub read_only: String,
    pub deferrable: String,
}

impl Default for TxDefaults {
    /// Postgres's own.
    fn default() -> TxDefaults {
        TxDefaults {
            isolation: "read committed".to_owned(),
            read_only: "off".to_owned(),
            deferrable: "off".to_owned(),
        }
    }
}

impl TxDefaults {
    /// As startup parameters.
    pub fn params(&self) -> [(&'static str, &str); 3] {
        [
            (TX_DEFAULTS[0], &self.isolation),
            (TX_DEFAULTS[1], &self.read_only),
            (TX_DEFAULTS[2], &self.deferrable),
        ]
    }

    /// Transactions run at READ COMMITTED: each statement sees the data as of its own
    /// start, so a transaction may begin in one database and go on in another.
    pub fn read_committed(&self) -> bool {
        self.isolation == "read committed"
    }
}

impl AtLogin {
    /// Reads the answer of [`SQL`]; `None` if it is not one.
    fn parse(answer: &str) -> Option<AtLogin> {
        let mut lines = answer.splitn(5, '\n');
        let mut next = || lines.next().map(str::to_owned);
        let tx = TxDefaults {
            isolation: next()?,
            read_only: next()?,
            deferrable: next()?,
        };
        let search_path = next()?;
        let org = next().filter(|o| !o.is_empty());
        Some(AtLogin {
            org,
            tx,
            search_path,
        })
    }
}

/// What `backend` holds at login: asked of it the first time, then kept with it.
///
/// # Errors
///
/// The query failed, or its answer is not one.
pub async fn at_login(backend: &mut BackendConn) -> Result<AtLogin, ConnError> {
    if let Some(known) = &backend.at_login {
        return Ok(known.clone());
    }
    let answer = backend
        .query_one("", SQL, true, crate::route::setting::NAME)
        .await?
        .flatten()
        .unwrap_or_default();
    let known = AtLogin::parse(&answer)
        .ok_or_else(|| ConnError::Protocol(format!("unexpected settings at login: {answer:?}")))?;
    backend.at_login = Some(known.clone());
    Ok(known)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_answer_at_login_is_read_line_by_line() {
        let got =
            AtLogin::parse("repeatable read\non\noff\ns, public\nacme\nwith a newline").unwrap();
        assert_eq!(got.org.as_deref(), Some("acme\nwith a newline"));
        assert_eq!(got.search_path, "s, public");
        assert_eq!(got.tx.isolation, "repeatable read");
        assert!(!got.tx.read_committed());
        assert_eq!(
            got.tx.params(),
            [
                ("default_transaction_isolation", "repeatable read"),
                ("default_transaction_read_only", "on"),
                ("default_transaction_deferrable", "off"),
            ]
        );
        // No organization set (NULL, left out), or set empty.
        for answer in [
            "read committed\noff\noff\n\"$user\", public",
            "read committed\noff\noff\n\"$user\", public\n",
        ] {
            let got = AtLogin::parse(answer).unwrap();
            assert_eq!(got.org, None, "{answer:?}");
            assert_eq!(got.tx, TxDefaults::default(), "{answer:?}");
            assert!(got.tx.read_committed());
        }
        assert_eq!(AtLogin::parse("read committed\noff\noff"), None);
    }
}
