//! A transaction that wrote in an organization's database directly and then needs the
//! cloud (an INSERT the cloud checks, a cloud table, another organization) moves to the
//! cloud whole (`docs/routing.md`, "Transactions that need both"): the direct transaction
//! is rolled back, and what the client sent in it so far runs again on the cloud, in the
//! transaction the gate of direct writes opened there (the cloud reaches the
//! organization's rows through postgres_fdw). The answers must be the ones the client
//! already has — rows, command tags, SQLSTATEs, compared by a digest of each side's
//! answers — or the transaction fails with 40001 (serialization failure), which clients
//! retry; it never goes on with a silent difference.
//!
//! Nothing is committed twice or lost: the direct transaction is rolled back before the
//! replay, and the cloud's commits (or not) as one, with its fdw writes. A proxy that dies
//! meanwhile leaves both transactions to roll back with their connections.

use lokadb_shared::wire::fields::Fields;
use lokadb_shared::wire::frontend::{Bind, Statement};
use lokadb_shared::wire::tags::*;
use std::hash::Hasher;

/// The most a transaction's log holds; past it the transaction cannot move (it is refused
/// as before, [`Log::usable`]).
pub const MAX_LOG_BYTES: usize = 1 << 20;

/// SQLSTATE and message of a replay whose answers differ.
pub const DIFFERED_CODE: &str = "40001";
pub const DIFFERED_MESSAGE: &str = "could not serialize access: this transaction moved from the organization's database to the cloud, and its statements so far answered differently there";
pub const DIFFERED_HINT: &str = "The transaction might succeed if retried.";

/// What the client sent in the direct transaction, as the cloud would run it: simple
/// Queries as routed to the cloud, and each Bind as an unnamed Parse of its statement and
/// the Bind of that, with the client's Executes, portal Closes and Syncs. Describe,
/// Flush and statement Close have no answers the digest covers.
#[derive(Debug, Default)]
pub struct Log {
    bytes: Vec<u8>,
    /// Requests (Query, Sync) in it.
    requests: u32,
    /// False once something was sent that cannot run again (COPY, a function call, a
    /// Bind of a statement the proxy does not remember), or the log grew past
    /// [`MAX_LOG_BYTES`].
    broken: bool,
}

impl Log {
    /// Notes a client message sent to the organization's database. `frame`: its cloud
    /// form (`None` when its body was not read); `parse`: for a Bind, its statement's
    /// Parse as the cloud would get it.
    pub fn note(&mut self, tag: u8, frame: Option<&[u8]>, parse: Option<&[u8]>) {
        if self.broken {
            return;
        }
        match (tag, frame) {
            (FE_QUERY, Some(f)) | (FE_EXECUTE, Some(f)) => self.bytes.extend_from_slice(f),
            (FE_SYNC, _) => lokadb_shared::wire::frontend::sync(&mut self.bytes),
            (FE_CLOSE, Some(f)) if f.get(5) == Some(&b'P') => self.bytes.extend_from_slice(f),
            (FE_CLOSE | FE_DESCRIBE | FE_FLUSH | FE_PARSE, _) => {}
            (FE_BIND, Some(f)) => match (parse.and_then(unnamed_parse), unnamed_bind(f)) {
                (Some(p), Some(b)) => {
                    self.bytes.extend_from_slice(&p);
                    self.bytes.extend_from_slice(&b);
                }
                _ => self.broken = true,
            },
            _ => self.broken = true,
        }
        if matches!(tag, FE_QUERY | FE_SYNC) {
            self.requests += 1;
        }
        if self.bytes.len() > MAX_LOG_BYTES {
            self.broken = true;
        }
    }

    /// Whether the transaction can run again on the cloud.
    pub fn usable(&self) -> bool {
        !self.broken
    }

    /// The messages to send, and the requests among them.
    pub fn take(self) -> (Vec<u8>, u32) {
        (self.bytes, self.requests)
    }
}

/// The same Parse without its statement name.
fn unnamed_parse(parse: &[u8]) -> Option<Vec<u8>> {
    let p = Statement::decode(FE_PARSE, parse.get(5..)?).ok()?;
    Some(
        Statement {
            name: Some(""),
            ..p
        }
        .with_sql(p.sql),
    )
}

/// The same Bind of the unnamed statement.
fn unnamed_bind(bind: &[u8]) -> Option<Vec<u8>> {
    Some(Bind::decode(bind.get(5..)?).ok()?.with_statement(""))
}

/// A digest of the answers a client got (or would get): rows, command tags, empty
/// queries, suspended portals and the SQLSTATE of errors, in order. Row descriptions are
/// left out (the table OIDs in them are each database's own).
#[derive(Debug, Clone)]
pub struct Digest {
    hasher: std::collections::hash_map::DefaultHasher,
    /// Which answers it covers: those the proxy drops (a replay's), or those it forwards.
    pub of_dropped: bool,
}

impl Digest {
    pub fn new(of_dropped: bool) -> Digest {
        Digest {
            hasher: std::collections::hash_map::DefaultHasher::new(),
            of_dropped,
        }
    }

    /// Whether answers with this tag are in the digest.
    pub fn covers(tag: u8) -> bool {
        matches!(
            tag,
            BE_DATA_ROW
                | BE_COMMAND_COMPLETE
                | BE_ERROR_RESPONSE
                | BE_EMPTY_QUERY_RESPONSE
                | BE_PORTAL_SUSPENDED
        )
    }

    /// Adds an answer (a whole frame, when [`Digest::covers`] its tag).
    pub fn add(&mut self, tag: u8, frame: Option<&[u8]>) {
        self.hasher.write_u8(tag);
        let body = frame.and_then(|f| f.get(5..)).unwrap_or_default();
        match tag {
            BE_ERROR_RESPONSE => self.hasher.write(sqlstate(body).unwrap_or_default()),
            BE_DATA_ROW | BE_COMMAND_COMPLETE => {
                self.hasher.write_usize(body.len());
                self.hasher.write(body);
            }
            _ => {}
        }
    }

    pub fn value(&self) -> u64 {
        self.hasher.finish()
    }
}

/// The `C` field of an ErrorResponse body.
fn sqlstate(body: &[u8]) -> Option<&[u8]> {
    let mut f = Fields::new(body, "ErrorResponse");
    loop {
        let code = f.u8().ok()?;
        if code == 0 {
            return None;
        }
        let value = f.cstr_bytes().ok()?;
        if code == b'C' {
            return Some(value);
        }
    }
}

/// A session's direct transaction as something that may move to the cloud: what it sent,
/// what opened it, where a move of it is.
#[derive(Debug, Default)]
pub struct Moving {
    /// What the client sent in the open direct transaction, to run again on the cloud if
    /// it needs the cloud after writing; `None` outside one.
    pub log: Option<Log>,
    /// The statement that opened it (its SQL).
    pub opener: Option<Box<str>>,
    /// Where a move of it is.
    pub step: Replay,
    /// The moved transaction answered differently on the cloud: the next statement fails
    /// with 40001 there.
    pub differed: bool,
    /// An opener whose transaction just moved to the cloud, for the core to learn
    /// (`CoreMeta::opener_moved`) at the next message.
    pub opener_moved: Option<Box<str>>,
}

impl Moving {
    /// A direct transaction began with `opener`: what it sends is kept from now on.
    pub fn begin(&mut self, opener: Option<Box<str>>) {
        self.log = Some(Log::default());
        self.opener = opener;
    }

    /// The direct transaction ended, or left for the cloud without being run again:
    /// nothing of it can move any more.
    pub fn end(&mut self) {
        self.log = None;
        self.opener = None;
    }

    /// Whether a transaction that wrote directly can move: its log is whole.
    pub fn movable(&self) -> bool {
        self.log.as_ref().is_some_and(Log::usable)
    }
}

/// Where a move of the transaction to the cloud is.
#[derive(Debug, Default)]
pub enum Replay {
    #[default]
    None,
    /// The log is queued for the cloud, not yet all written; then answers up to request
    /// `until` (exclusive), and the direct side's digest to compare with.
    Sending { until: u64, expected: u64 },
    /// Sent: waiting for the cloud's answers.
    Waiting { until: u64, expected: u64 },
}

/// Whether a message can carry the 40001 of a replay whose answers differed (a Parse
/// cannot: the client's Bind of it that follows does).
pub fn fails_here(tag: u8) -> bool {
    matches!(tag, FE_QUERY | FE_BIND | FE_FUNCTION_CALL)
}

#[cfg(test)]
mod tests {
    use super::*;
    use lokadb_shared::wire::frontend;

    #[test]
    fn a_bind_is_logged_as_the_unnamed_statement_it_binds() {
        let mut parse = Vec::new();
        frontend::parse(&mut parse, "s1", "UPDATE t SET a = $1 WHERE org = $2");
        let mut bind = Vec::new();
        frontend::bind_portal_text(&mut bind, "p", "s1", &[Some("1"), Some("acme")]);
        let mut log = Log::default();
        log.note(FE_PARSE, Some(&parse), None);
        log.note(FE_BIND, Some(&bind), Some(&parse));
        let mut exec = Vec::new();
        frontend::execute_portal(&mut exec, "p");
        log.note(FE_EXECUTE, Some(&exec), None);
        log.note(FE_SYNC, None, None);
        assert!(log.usable());
        let (bytes, requests) = log.take();
        assert_eq!(requests, 1);
        let mut want = Vec::new();
        frontend::parse(&mut want, "", "UPDATE t SET a = $1 WHERE org = $2");
        frontend::bind_portal_text(&mut want, "p", "", &[Some("1"), Some("acme")]);
        frontend::execute_portal(&mut want, "p");
        frontend::sync(&mut want);
        assert_eq!(bytes, want);
    }

    #[test]
    fn what_cannot_run_again_breaks_the_log() {
        let mut log = Log::default();
        log.note(FE_COPY_DATA, Some(b"d\0\0\0\x05x"), None);
        assert!(!log.usable());
        let mut log = Log::default();
        let mut bind = Vec::new();
        frontend::bind_portal_text(&mut bind, "", "unknown", &[]);
        log.note(FE_BIND, Some(&bind), None);
        assert!(!log.usable());
        let mut log = Log::default();
        let mut q = Vec::new();
        frontend::query(&mut q, &"x".repeat(MAX_LOG_BYTES));
        log.note(FE_QUERY, Some(&q), None);
        assert!(!log.usable());
    }

    #[test]
    fn the_digest_covers_rows_tags_and_sqlstates_only() {
        let frame = |tag: u8, body: &[u8]| {
            let mut out = Vec::new();
            lokadb_shared::wire::backend::write_frame(&mut out, tag, |o| o.extend_from_slice(body));
            out
        };
        let digest = |frames: &[Vec<u8>]| {
            let mut d = Digest::new(false);
            for f in frames {
                d.add(f[0], Some(f));
            }
            d.value()
        };
        let row = frame(BE_DATA_ROW, b"\0\x01\0\0\0\x011");
        let tag = frame(BE_COMMAND_COMPLETE, b"UPDATE 1\0");
        let err = |msg: &[u8]| {
            let mut b = b"SERROR\0C23505\0M".to_vec();
            b.extend_from_slice(msg);
            b.extend_from_slice(b"\0\0");
            frame(BE_ERROR_RESPONSE, &b)
        };
        let a = digest(&[row.clone(), tag.clone(), err(b"one text")]);
        assert_eq!(a, digest(&[row.clone(), tag.clone(), err(b"another text")]));
        assert_ne!(a, digest(&[tag.clone(), row.clone(), err(b"one text")]));
        let other_row = frame(BE_DATA_ROW, b"\0\x01\0\0\0\x012");
        assert_ne!(a, digest(&[other_row, tag, err(b"one text")]));
    }
}
