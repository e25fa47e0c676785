//! Transaction pooling (`pool_mode: "transaction"`): what a session believes it keeps on
//! "its" cloud backend, kept true on whichever backend serves its next transaction.
//!
//! A session gives its backend back at each idle point (ReadyForQuery `I`, nothing in
//! flight) and takes one again with its next message ([`super::session`]). Between them:
//!
//! - **Prepared statements.** The session keeps the Parse of each statement it made (named,
//!   and its unnamed one until a simple query destroys it); a backend keeps which it holds
//!   ([`Holds`]), by a keyed hash of the Parse. A backend taken that lacks one gets it
//!   again ahead of the client's message (Close, Parse, Sync: one request of the proxy's
//!   own per statement, so one that fails cannot undo the others; answers dropped; no
//!   round trip waited for). A client's named Parse of a name it does not hold goes out
//!   after a Close of that name, since the backend may hold another client's.
//! - **Settings.** After a transaction whose text may change a setting (SET, RESET,
//!   `set_config`, DISCARD), the session reads back what its session settings are (one
//!   request of its own, before the backend is given back) as the statement that applies
//!   them; a backend that holds other settings gets `RESET ALL` and that statement first.
//! - **What cannot move pins** the session to its backend until it ends: LISTEN, temporary
//!   tables, session advisory locks, `WITH HOLD` cursors, `SET SESSION AUTHORIZATION`,
//!   SQL `PREPARE`. The backend is then reset (`DISCARD ALL`) as in session pooling.
//!
//! What the proxy cannot see (a function that sets a setting or takes a session lock) is
//! not carried: such applications keep `pool_mode: "session"` (docs/configuration.md).

use crate::backend::pool::Holds;
use crate::route::analysis::find;
use lokadb_shared::wire::frontend::{self, Close, Message, Statement};
use lokadb_shared::wire::tags::*;
use lokadb_shared::wire::Header;
use std::collections::{BTreeSet, HashMap};
use std::hash::{BuildHasher, RandomState};
use std::sync::OnceLock;

use super::statement::{gets_answer, Exchange};

/// The statement that reads a session's settings back as the statement that applies them
/// elsewhere: those whose source is the session, the role, and the custom ones its SETs
/// named (`{names}`), which `pg_settings` does not list (nor the role).
const READ_BACK: &str = "SELECT coalesce('SELECT ' || string_agg(pg_catalog.format('pg_catalog.set_config(%L, %L, false)', n, v), ', ' ORDER BY n), '') FROM (SELECT name AS n, pg_catalog.current_setting(name) AS v FROM pg_catalog.pg_settings WHERE source = 'session' UNION SELECT n, pg_catalog.current_setting(n, true) FROM pg_catalog.unnest(ARRAY[{names}]::text[]) AS n) AS s WHERE v IS NOT NULL AND NOT (n = 'role' AND v = 'none')";

/// What a session's statements and settings are, and what it knows of the backend it holds.
#[derive(Debug, Default)]
pub struct TxSession {
    /// Named statements: the Parse as sent to the cloud, and its hash.
    statements: HashMap<String, Stmt>,
    /// The unnamed statement, until a simple query destroys it.
    unnamed: Option<Stmt>,
    /// Custom settings (`a.b`) the session's statements named.
    custom: BTreeSet<String>,
    /// The statement that applies the session's settings (empty: those of its login).
    settings: String,
    /// Its hash (0 when empty).
    settings_hash: u64,
    /// A statement since the last read-back may have changed a setting.
    touched: bool,
    /// The read-back's request number, while it runs.
    reading_back: Option<u64>,
    /// Why the session keeps its backend to its end.
    pub pinned: Option<&'static str>,
    /// The session holds no backend now.
    pub detached: bool,
    /// A message of the client's waits for a backend.
    pub wants_backend: bool,
    /// What the backend held now holds (taken from it when acquired, given back with it).
    on_backend: Holds,
    /// The cloud exchange's error count when the backend was acquired.
    errors_at_acquire: u64,
    /// The most statements a backend keeps (`max_prepared_statements`).
    max_statements: usize,
    /// Which session each backend's notifications name ([`Notifiers`]).
    notifiers: std::sync::Arc<Notifiers>,
    /// A statement of the session's needs its Binds followed ([`Stmt::rescan`]).
    pub follows_binds: bool,
}

/// With transaction pooling, which session's key each cloud backend's notifications name:
/// the last session that sent `NOTIFY` (or `pg_notify`) on it. A client that notifies holds
/// a shared backend whose process ID it never saw; its listeners are told the one of its
/// key, as at the cloud, where drivers compare it with the notifier's (asyncpg's
/// `get_server_pid()`). Touched only by statements that name NOTIFY and by notifications:
/// a lock over all cores is cheap at that rate.
#[derive(Debug, Default)]
pub struct Notifiers(std::sync::Mutex<HashMap<u32, u32>>);

impl Notifiers {
    /// The most backends remembered; past it the map starts again (a backend's next NOTIFY
    /// enters it again).
    const MAX: usize = 4096;

    /// Notes that `key` is the process ID the notifications of backend `pid` name now.
    pub fn record(&self, pid: u32, key: u32) {
        let mut map = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if map.len() >= Self::MAX && !map.contains_key(&pid) {
            map.clear();
        }
        map.insert(pid, key);
    }

    /// The process ID a notification from backend `pid` names.
    pub fn key_of(&self, pid: u32) -> Option<u32> {
        let map = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        map.get(&pid).copied()
    }
}

/// Where a read-back of the settings stands ([`TxSession::read_back`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadBack {
    /// Not needed, or answered: the backend may go.
    Done,
    /// Queued now.
    Queued,
    /// Sent, not answered yet.
    Waiting,
}

#[derive(Debug)]
struct Stmt {
    frame: Box<[u8]>,
    hash: u64,
    /// Its text may change a setting, pin, notify or deallocate: each execution (Bind) is
    /// followed as its Parse was.
    rescan: bool,
}

/// Hashes a Parse (or the settings' statement) with a key of the process's: a client cannot
/// make its statement collide with another's.
fn hash(bytes: &[u8]) -> u64 {
    static KEY: OnceLock<RandomState> = OnceLock::new();
    // 0 means "none" or "not known" in [`Holds`].
    KEY.get_or_init(RandomState::new).hash_one(bytes).max(1)
}

/// Where a message of the proxy's own goes in the cloud's answers: its request, and how
/// many answers of that request come before its own.
#[derive(Debug, Clone, Copy)]
pub struct Position {
    request: u64,
    at: u32,
}

impl Position {
    /// The position of the next message sent to `ex`.
    pub fn next(ex: &Exchange) -> Position {
        Position {
            request: ex.answered + u64::from(ex.pending),
            at: ex.sent_in_batch,
        }
    }

    /// After `frames` (whole) went out from this position.
    fn after(mut self, frames: &[u8]) -> Position {
        for tag in super::statement::tags(frames) {
            match tag {
                FE_QUERY | FE_SYNC | FE_FUNCTION_CALL => {
                    self.request += 1;
                    self.at = 0;
                }
                t if gets_answer(t) => self.at += 1,
                _ => {}
            }
        }
        self
    }
}

impl TxSession {
    /// A session whose backends keep at most `max_statements` prepared statements (its
    /// own all the same).
    pub fn new(max_statements: u32, notifiers: std::sync::Arc<Notifiers>) -> TxSession {
        TxSession {
            max_statements: max_statements as usize,
            notifiers,
            ..TxSession::default()
        }
    }

    /// Notes a client message as it goes to the cloud: `sent` is what went out for it
    /// (whole frames), `client` the client's own frame, `from` where `sent` began. Returns
    /// what to send instead when a Close must go ahead of a named Parse.
    pub fn sent(
        &mut self,
        ex: &mut Exchange,
        client: &[u8],
        sent: &[u8],
        from: Position,
    ) -> Option<Vec<u8>> {
        let own = Message::decode(client[0], &client[5..]);
        if let Ok(Message::Query(Statement { sql, .. }) | Message::Parse(Statement { sql, .. })) =
            own
        {
            self.follow(ex, sql);
        }
        // The client's Parse, among what went out: the proxy adds Parses of its own (the
        // cloud's `statement_org` statement, a client statement parsed again before its
        // Bind), which need no Close ahead of them and are not the session's to keep.
        let client_parse = match own {
            Ok(Message::Parse(Statement { name, .. })) => Some(name.unwrap_or_default()),
            _ => None,
        };
        let mut at = 0;
        let mut replaced = None;
        while let Some(header) = sent
            .get(at..)
            .and_then(|b| Header::peek(b, u32::MAX).ok().flatten())
        {
            let frame = &sent[at..at + header.frame_len()];
            match Message::decode(header.tag, &frame[5..]) {
                Ok(Message::Parse(Statement {
                    name: Some(name), ..
                })) if !name.is_empty() && client_parse != Some(name) => {
                    // A statement of the session's parsed again (its Close went ahead):
                    // the backend holds it now. (An unnamed Parse is always the client's:
                    // one the router held for its Bind.)
                    if let Some(stmt) = self.statements.get(name) {
                        self.on_backend
                            .statements
                            .insert(name.to_owned(), stmt.hash);
                    }
                }
                Ok(Message::Parse(Statement { name, sql, .. })) => {
                    let name = name.unwrap_or_default();
                    let rescan = may_act(sql);
                    self.follows_binds |= rescan;
                    let stmt = Stmt {
                        frame: frame.into(),
                        hash: hash(frame),
                        rescan,
                    };
                    if name.is_empty() {
                        self.on_backend.unnamed = Some(stmt.hash);
                        self.unnamed = Some(stmt);
                    } else if self.statements.contains_key(name) {
                        // The backend has the client's statement of that name (made again
                        // on each backend before its messages): Postgres refuses this one
                        // (42P05), and the client's stays.
                    } else {
                        // The client holds no statement of that name; the backend may hold
                        // another client's.
                        let foreign = self.on_backend.unknown
                            || self.on_backend.statements.contains_key(name);
                        if foreign {
                            let mut out = Vec::with_capacity(sent.len() + name.len() + 7);
                            out.extend_from_slice(&sent[..at]);
                            frontend::close_statement(&mut out, name);
                            out.extend_from_slice(&sent[at..]);
                            let p = from.after(&sent[..at]);
                            ex.added.push_back((p.request, p.at, 1));
                            ex.note_sent_tag(FE_CLOSE);
                            replaced = Some(out);
                        }
                        self.on_backend
                            .statements
                            .insert(name.to_owned(), stmt.hash);
                        self.statements.insert(name.to_owned(), stmt);
                    }
                }
                Ok(Message::Close(Close { kind: b'S', name })) => self.forget(name),
                Ok(Message::Bind(bind)) => {
                    // A SET (or LISTEN, NOTIFY, …) prepared once acts at each execution.
                    let stmt = match bind.statement {
                        "" => self.unnamed.as_ref(),
                        name => self.statements.get(name),
                    };
                    let sql = stmt.filter(|s| s.rescan).and_then(|s| {
                        match Message::decode(s.frame[0], &s.frame[5..]) {
                            Ok(Message::Parse(st)) => Some(st.sql.to_owned()),
                            _ => None,
                        }
                    });
                    if let Some(sql) = sql {
                        self.follow(ex, &sql);
                    }
                }
                Ok(Message::Query(_)) => {
                    // A simple query destroys the unnamed statement.
                    self.unnamed = None;
                    self.on_backend.unnamed = None;
                }
                _ => {}
            }
            at += header.frame_len();
        }
        replaced
    }

    /// Follows a statement's text as it goes to the backend ([`TxSession::scan`]), and
    /// notes its NOTIFY before the backend runs it: the notification may reach a listener
    /// at once.
    fn follow(&mut self, ex: &Exchange, sql: &str) {
        self.scan(sql);
        if let Some(n) = ex.notify.as_ref().filter(|_| notifies(sql)) {
            self.notifiers.record(n.backend, n.key);
        }
    }

    fn forget(&mut self, name: &str) {
        if name.is_empty() {
            self.unnamed = None;
            self.on_backend.unnamed = None;
        } else {
            self.statements.remove(name);
            self.on_backend.statements.remove(name);
        }
    }

    /// Follows what a statement's text may do to the session: pin it, change its
    /// settings, deallocate its statements.
    fn scan(&mut self, sql: &str) {
        if self.pinned.is_none() {
            self.pinned = pin_reason(sql);
        }
        if find(sql, b"set_config").is_some() {
            self.touched = true;
            if let Some(name) = set_config_name(sql) {
                self.note_custom(&name);
            }
        }
        for statement in statement_starts(sql) {
            let mut words = words(statement);
            let first = words.next().unwrap_or_default();
            if first.eq_ignore_ascii_case("set") || first.eq_ignore_ascii_case("reset") {
                self.touched = true;
                let mut name = words.next().unwrap_or_default();
                if name.eq_ignore_ascii_case("session") || name.eq_ignore_ascii_case("local") {
                    name = words.next().unwrap_or_default();
                }
                self.note_custom(&fold(name));
            } else if first.eq_ignore_ascii_case("discard") {
                self.touched = true;
                let what = words.next().unwrap_or_default();
                if what.eq_ignore_ascii_case("all") || what.eq_ignore_ascii_case("plans") {
                    self.deallocate_all();
                }
            } else if first.eq_ignore_ascii_case("deallocate") {
                let mut name = words.next().unwrap_or_default();
                if name.eq_ignore_ascii_case("prepare") {
                    name = words.next().unwrap_or_default();
                }
                if name.eq_ignore_ascii_case("all") {
                    self.deallocate_all();
                } else {
                    let name = fold(name);
                    self.statements.remove(&name);
                    self.on_backend.statements.remove(&name);
                }
            }
        }
    }

    fn deallocate_all(&mut self) {
        self.statements.clear();
        self.unnamed = None;
        self.on_backend.statements.clear();
        self.on_backend.unknown = false;
        self.on_backend.unnamed = None;
    }

    fn note_custom(&mut self, name: &str) {
        let plain = name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'.');
        if name.contains('.') && plain && self.custom.len() < CUSTOM_MAX {
            self.custom.insert(name.to_owned());
        }
    }

    /// A backend was acquired for the session: what it lacks of the session's settings and
    /// statements is queued in `ex`'s outbox, ahead of the client's message.
    pub fn acquired(&mut self, holds: Holds, ex: &mut Exchange) {
        self.on_backend = holds;
        self.errors_at_acquire = ex.errors;
        if self.on_backend.settings != self.settings_hash {
            // RESET ALL leaves the role.
            let mut sql = String::from("RESET ALL; RESET ROLE");
            if !self.settings.is_empty() {
                sql.push_str("; ");
                sql.push_str(&self.settings);
            }
            ex.send_own(&sql);
            // A query destroys the unnamed statement.
            self.on_backend.unnamed = None;
            self.on_backend.settings = self.settings_hash;
        }
        let mut out = Vec::new();
        // Past the cap, other sessions' statements make room for this one's.
        let foreign =
            (self.on_backend.statements.keys()).filter(|name| !self.statements.contains_key(*name));
        let over =
            (foreign.clone().count() + self.statements.len()).saturating_sub(self.max_statements);
        if over > 0 {
            let evicted: Vec<String> = foreign.take(over).cloned().collect();
            for name in &evicted {
                frontend::close_statement(&mut out, name);
                self.on_backend.statements.remove(name);
            }
            frontend::sync(&mut out);
            ex.send_own_messages(&out);
            out.clear();
        }
        for (name, stmt) in &self.statements {
            if self.on_backend.statements.get(name) == Some(&stmt.hash) {
                continue;
            }
            frontend::close_statement(&mut out, name);
            out.extend_from_slice(&stmt.frame);
            frontend::sync(&mut out);
            ex.send_own_messages(&out);
            out.clear();
            self.on_backend.statements.insert(name.clone(), stmt.hash);
        }
        match &self.unnamed {
            Some(stmt) if self.on_backend.unnamed != Some(stmt.hash) => {
                out.extend_from_slice(&stmt.frame);
                frontend::sync(&mut out);
                ex.send_own_messages(&out);
                self.on_backend.unnamed = Some(stmt.hash);
            }
            // Another client's unnamed statement is not the session's to bind.
            None if self.on_backend.unnamed.is_some() => {
                frontend::close_statement(&mut out, "");
                frontend::sync(&mut out);
                ex.send_own_messages(&out);
                self.on_backend.unnamed = None;
            }
            _ => {}
        }
    }

    /// At an idle point: reads the settings back first when a statement may have changed
    /// them (a request of the proxy's own, queued in `ex`), and takes in its answer.
    pub fn read_back(&mut self, ex: &mut Exchange) -> ReadBack {
        if let Some(request) = self.reading_back {
            if ex.answered <= request {
                return ReadBack::Waiting;
            }
            self.reading_back = None;
            let value = ex
                .capture
                .take_if(|(r, _)| *r == request)
                .and_then(|(_, v)| v)
                .flatten();
            match value {
                Some(sql) if !ex.own_failed(request) => {
                    self.settings_hash = if sql.is_empty() {
                        0
                    } else {
                        hash(sql.as_bytes())
                    };
                    self.settings = sql;
                    self.on_backend.settings = self.settings_hash;
                }
                // Not known: the session keeps this backend, which has them.
                _ => self.pinned = Some("its settings could not be read back"),
            }
            // The read-back, a query, destroyed the unnamed statement.
            self.on_backend.unnamed = None;
        }
        if !self.touched {
            return ReadBack::Done;
        }
        self.touched = false;
        // The names are plain (letters, digits, `_`, `.`: [`TxSession::note_custom`]).
        let names: Vec<String> = std::iter::once("role")
            .chain(self.custom.iter().map(String::as_str))
            .map(|n| format!("'{n}'"))
            .collect();
        let sql = READ_BACK.replace("{names}", &names.join(","));
        let request = ex.send_own(&sql);
        ex.capture = Some((request, None));
        self.reading_back = Some(request);
        ReadBack::Queued
    }

    /// Whether the backend may go back as it is at the session's end: not pinned, and its
    /// settings read back.
    pub fn gives_back_as_is(&self) -> bool {
        self.pinned.is_none() && !self.touched && self.reading_back.is_none()
    }

    /// The backend goes back to the pool: what it holds now.
    pub fn released(&mut self, ex: &Exchange) -> Holds {
        let mut holds = std::mem::take(&mut self.on_backend);
        if ex.errors != self.errors_at_acquire {
            // A batch failed: a Parse in it may not have run.
            holds.statements.clear();
            holds.unknown = true;
            holds.unnamed = Some(0);
        }
        holds
    }
}

/// The most custom setting names a session's read-back names.
const CUSTOM_MAX: usize = 64;

/// Why a statement's text pins its session to its backend, if it does. Matches words, so
/// it may pin where nothing needed it (a column named `temp`), never the reverse for the
/// forms it knows.
pub fn pin_reason(sql: &str) -> Option<&'static str> {
    let w = |word: &str| has_word(sql, word.as_bytes());
    if w("listen") {
        Some("LISTEN")
    } else if (w("temp") || w("temporary")) && (w("create") || w("into")) {
        Some("a temporary table")
    } else if find(sql, b"pg_advisory_lock").is_some()
        || find(sql, b"pg_try_advisory_lock").is_some()
    {
        Some("a session advisory lock")
    } else if w("hold") && w("declare") {
        Some("a WITH HOLD cursor")
    } else if w("authorization") && w("session") {
        Some("SET SESSION AUTHORIZATION")
    } else if w("prepare") {
        Some("PREPARE")
    } else {
        None
    }
}

/// The first words of the statements [`TxSession::scan`] follows by their start.
const ACTING_FIRST_WORDS: [&str; 4] = ["set", "reset", "discard", "deallocate"];

/// Whether a statement's text may do what [`TxSession::scan`] follows (a setting, a pin,
/// a deallocation) or notify: by words, like them.
fn may_act(sql: &str) -> bool {
    pin_reason(sql).is_some()
        || notifies(sql)
        || find(sql, b"set_config").is_some()
        || statement_starts(sql).any(|st| {
            let first = words(st).next().unwrap_or_default();
            ACTING_FIRST_WORDS
                .iter()
                .any(|w| first.eq_ignore_ascii_case(w))
        })
}

/// Whether a statement's text may send a notification (by words: may say so where none
/// is sent).
fn notifies(sql: &str) -> bool {
    has_word(sql, b"notify") || find(sql, b"pg_notify").is_some()
}

/// Whether `sql` holds `word` (ASCII, any case) as a whole word.
fn has_word(sql: &str, word: &[u8]) -> bool {
    let bytes = sql.as_bytes();
    let ident = |b: u8| b.is_ascii_alphanumeric() || b == b'_' || b == b'$' || b >= 0x80;
    let mut from = 0;
    while let Some(i) = find(&sql[from..], word).map(|i| i + from) {
        let before = i.checked_sub(1).map(|j| bytes[j]);
        let after = bytes.get(i + word.len()).copied();
        if !before.is_some_and(ident) && !after.is_some_and(ident) {
            return true;
        }
        from = i + 1;
        while !sql.is_char_boundary(from) {
            from += 1;
        }
    }
    false
}

/// Where each statement of `sql` may begin: the start and after every `;`, comments and
/// blanks skipped (a `;` in a literal makes one more, which only costs a look).
fn statement_starts(sql: &str) -> impl Iterator<Item = &str> {
    sql.split(';').map(skip_blank)
}

fn skip_blank(mut s: &str) -> &str {
    loop {
        let t = s.trim_start();
        if let Some(rest) = t.strip_prefix("--") {
            s = rest.split_once('\n').map_or("", |(_, r)| r);
        } else if let Some(rest) = t.strip_prefix("/*") {
            s = rest.split_once("*/").map_or("", |(_, r)| r);
        } else {
            return t;
        }
    }
}

/// The words of a statement's start: names (quoted ones whole) and keywords.
fn words(s: &str) -> impl Iterator<Item = &str> {
    let mut rest = s;
    std::iter::from_fn(move || {
        rest = skip_blank(rest);
        if rest.is_empty() {
            return None;
        }
        let end = if let Some(q) = rest.strip_prefix('"') {
            q.find('"').map_or(rest.len(), |i| i + 2)
        } else {
            rest.find(|c: char| !(c.is_alphanumeric() || c == '_' || c == '.' || c == '"'))
                .unwrap_or(rest.len())
                .max(1)
        };
        let (word, tail) = rest.split_at(end);
        rest = tail;
        Some(word)
    })
}

/// A name as Postgres reads it: unquoted folded to lower case, quotes removed.
fn fold(name: &str) -> String {
    if name.contains('"') {
        name.replace('"', "")
    } else {
        name.to_ascii_lowercase()
    }
}

/// The name of the first `set_config('name', …)` in `sql`, when it is a literal.
fn set_config_name(sql: &str) -> Option<String> {
    let at = find(sql, b"set_config")?;
    let rest = sql[at + "set_config".len()..].trim_start();
    let rest = rest.strip_prefix('(')?.trim_start();
    let rest = rest.strip_prefix('\'')?;
    let end = rest.find('\'')?;
    Some(rest[..end].to_ascii_lowercase())
}

#[cfg(test)]
mod tests {
    use super::*;

    impl TxSession {
        /// [`TxSession::sent`] of a message sent next.
        fn sent_at(&mut self, ex: &mut Exchange, client: &[u8], sent: &[u8]) -> Option<Vec<u8>> {
            let from = Position::next(ex);
            self.sent(ex, client, sent, from)
        }
    }

    #[test]
    fn pins_are_found_by_word() {
        for (sql, reason) in [
            ("LISTEN jobs", Some("LISTEN")),
            ("select 1; listen \"x\"", Some("LISTEN")),
            ("SELECT listener FROM t", None),
            ("CREATE TEMP TABLE t (a int)", Some("a temporary table")),
            (
                "create temporary table t as select 1",
                Some("a temporary table"),
            ),
            ("SELECT * INTO TEMP t FROM x", Some("a temporary table")),
            ("SELECT temperature FROM t", None),
            (
                "SELECT pg_advisory_lock(1)",
                Some("a session advisory lock"),
            ),
            (
                "SELECT pg_try_advisory_lock_shared(1)",
                Some("a session advisory lock"),
            ),
            ("SELECT pg_advisory_xact_lock(1)", None),
            (
                "DECLARE c CURSOR WITH HOLD FOR SELECT 1",
                Some("a WITH HOLD cursor"),
            ),
            ("DECLARE c CURSOR FOR SELECT 1", None),
            (
                "SET SESSION AUTHORIZATION bob",
                Some("SET SESSION AUTHORIZATION"),
            ),
            ("PREPARE p AS SELECT 1", Some("PREPARE")),
            ("UPDATE t SET a = 1", None),
        ] {
            assert_eq!(pin_reason(sql), reason, "{sql}");
        }
    }

    #[test]
    fn settings_statements_are_found_at_statement_starts_only() {
        let mut s = TxSession::new(200, Default::default());
        s.scan("UPDATE t SET a = 1 WHERE b = 'x; set'");
        // A `;` inside a literal begins a statement for the scan: a look too many.
        assert!(s.touched);
        let mut s = TxSession::new(200, Default::default());
        s.scan("UPDATE t SET a = 1");
        assert!(!s.touched);
        s.scan("/* c */ SET LOCAL statement_timeout = 5");
        assert!(s.touched);
        let mut s = TxSession::new(200, Default::default());
        s.scan("select 1; set myapp.Tenant = 'a'; reset \"Other.X\"");
        assert!(s.touched);
        assert_eq!(
            s.custom.iter().collect::<Vec<_>>(),
            ["Other.X", "myapp.tenant"]
        );
        let mut s = TxSession::new(200, Default::default());
        s.scan("SELECT set_config('app.user', '7', false)");
        assert!(s.touched);
        assert!(s.custom.contains("app.user"));
    }

    #[test]
    fn deallocate_and_discard_forget_statements() {
        let mut s = TxSession::new(200, Default::default());
        let mut ex = Exchange::default();
        let parse = |name: &str| {
            let mut f = Vec::new();
            frontend::parse(&mut f, name, "SELECT 1");
            f
        };
        for name in ["a", "b", ""] {
            let f = parse(name);
            s.sent_at(&mut ex, &f, &f);
        }
        assert_eq!(s.statements.len(), 2);
        assert!(s.unnamed.is_some());
        let mut q = Vec::new();
        frontend::query(&mut q, "DEALLOCATE PREPARE \"a\"");
        s.sent_at(&mut ex, &q, &q);
        assert!(!s.statements.contains_key("a") && s.statements.contains_key("b"));
        // The query destroyed the unnamed statement.
        assert!(s.unnamed.is_none());
        let mut q = Vec::new();
        frontend::query(&mut q, "DISCARD ALL");
        s.sent_at(&mut ex, &q, &q);
        assert!(s.statements.is_empty() && s.on_backend.is_clean());
    }

    #[test]
    fn a_backend_gets_what_it_lacks_and_a_foreign_name_is_closed_first() {
        let mut s = TxSession::new(200, Default::default());
        let mut ex = Exchange::default();
        let mut f = Vec::new();
        frontend::parse(&mut f, "s1", "SELECT 1");
        assert!(s.sent_at(&mut ex, &f, &f).is_none());
        let holds = s.released(&ex);
        assert_eq!(holds.statements.len(), 1);
        // The same backend again: nothing to send.
        s.acquired(holds.clone(), &mut ex);
        assert!(ex.outbox.is_empty());
        s.released(&ex);
        // A fresh one: Close, Parse, Sync, as a request of the proxy's own.
        s.acquired(Holds::default(), &mut ex);
        let tags: Vec<u8> = super::super::statement::tags(&ex.outbox).collect();
        assert_eq!(tags, [FE_CLOSE, FE_PARSE, FE_SYNC]);
        assert_eq!((ex.pending, ex.silenced.len()), (1, 1));
        // Another session's backend holding "s1": its Parse of "s1" is closed first.
        let mut other = TxSession::new(200, Default::default());
        let mut ex2 = Exchange::default();
        other.acquired(holds, &mut ex2);
        let mut g = Vec::new();
        frontend::parse(&mut g, "s1", "SELECT 2");
        let out = other.sent_at(&mut ex2, &g, &g).unwrap();
        let tags: Vec<u8> = super::super::statement::tags(&out).collect();
        assert_eq!(tags, [FE_CLOSE, FE_PARSE]);
        assert_eq!(ex2.added.front(), Some(&(0, 0, 1)));
    }

    #[test]
    fn past_the_cap_other_sessions_statements_are_closed_first() {
        let mut ex = Exchange::default();
        let mut holds = Holds::default();
        for i in 0..5 {
            holds.statements.insert(format!("other{i}"), 7);
        }
        let mut s = TxSession::new(4, Default::default());
        let mut f = Vec::new();
        frontend::parse(&mut f, "mine", "SELECT 1");
        s.statements.insert(
            "mine".into(),
            Stmt {
                hash: hash(&f),
                frame: f.into(),
                rescan: false,
            },
        );
        s.acquired(holds, &mut ex);
        let tags: Vec<u8> = super::super::statement::tags(&ex.outbox).collect();
        // Two others' statements closed (5 + 1 over 4), then the session's own prepared.
        assert_eq!(
            tags,
            [FE_CLOSE, FE_CLOSE, FE_SYNC, FE_CLOSE, FE_PARSE, FE_SYNC]
        );
        assert_eq!(s.on_backend.statements.len(), 4);
        assert!(s.on_backend.statements.contains_key("mine"));
    }
}
