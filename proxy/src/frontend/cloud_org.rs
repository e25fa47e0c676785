//! What the cloud learns of each statement's organization (`docs/routing.md`, "What the
//! cloud learns"): ahead of a statement on LokaDB tables, in the same write, the proxy sets
//! `lokadb.statement_org` on the client's cloud backend to the organization the analysis
//! placed it in (`''`: none it could name). Cloud-side code (a trigger, a policy, an audit)
//! reads it with `current_setting('lokadb.statement_org', true)`. It costs the client no
//! round trip: the answers are dropped as they come.
//!
//! It is sent only when the value changes, and in the cheapest form the protocol allows:
//! - inside the client's batch (the extended protocol) where the statement is: the proxy's
//!   Bind and Execute go just before its Bind, at the front of the batch when that Bind
//!   begins it and its statement is placed; the client's Sync ends both;
//! - ahead of a simple Query of one SELECT, INSERT, UPDATE, DELETE, WITH, VALUES or TABLE
//!   statement: the proxy's `SET lokadb.statement_org = '…';` in front of its text, in the
//!   same Query (one request, one transaction, no ReadyForQuery of its own for the backend
//!   to flush), when the cloud is PostgreSQL 18+ (whose pg_stat_statements counts the SETs
//!   of every value as one statement); the positions in the Query's errors are shifted
//!   back to the client's text;
//! - otherwise a request of its own (Bind, Execute, Sync): a simple Query after Bind and
//!   Execute without a Sync would run in their implicit transaction (PostgreSQL 18 leaves it
//!   open), a statement after another in one Query runs in a transaction block (a LOCK, a
//!   DECLARE or a CALL differently, VACUUM not at all), and an unplaced statement may be one
//!   Postgres runs only alone.
//!
//! The proxy trusts the value it set only where it cannot have been rolled back: its own
//! request that ran alone outside a transaction, a batch begun outside a transaction
//! whose one Bind was its statement's, placed in one organization (so no transaction
//! control), that ran without error, or such a Query of one statement. Otherwise it sets it
//! again before the next statement.

use super::router::count;
use super::statement::{ClientFrames, Exchange, Routed};
use crate::org::OrgId;
use crate::route::analysis::{mentions, Analysis, Org, RUNS_ALONE};
use crate::route::literals::one_dml_statement;
use crate::route::meta::Placement;
use lokadb_shared::wire::frontend::{self, Message, Statement};
use lokadb_shared::wire::tags::*;
use std::borrow::Cow;

/// The setting's name.
pub const SETTING: &str = "lokadb.statement_org";

/// The proxy's own prepared statement and portal that set it.
const OWN: &str = "lokadb_statement_org";

const SET_SQL: &str = "SELECT pg_catalog.set_config('lokadb.statement_org', $1, false)";

/// What the cloud gets so it learns a statement's organization.
#[derive(Debug)]
pub(super) enum Told {
    /// Whole messages just ahead of the statement's.
    Ahead(Vec<u8>),
    /// A statement to put in front of the Query's text, in the same Query.
    Prefix(String),
}

/// The proxy's statement in front of a Query's text: `SET lokadb.statement_org = '…';`
/// (what `set_config(…, false)` does, without planning or running a query: half the
/// backend's time), the value as a literal (an escape string when it holds a backslash,
/// which a session with `standard_conforming_strings` off would read as an escape).
fn prefix(org: &str) -> String {
    let quoted = org.replace('\'', "''");
    let literal = if quoted.contains('\\') {
        format!("E'{}'", quoted.replace('\\', "\\\\"))
    } else {
        format!("'{quoted}'")
    };
    format!("SET {SETTING} = {literal};")
}

/// A session's state of it.
#[derive(Debug, Default)]
pub struct CloudOrg {
    /// Tell the cloud (`statement_org`, on by default).
    pub tell: bool,
    /// The value the cloud backend holds, when the proxy knows it.
    known: Option<OrgId>,
    /// The proxy's statement is parsed on the cloud backend.
    parsed: bool,
    /// The request number of the proxy's last request of its own that set it.
    last: Option<u64>,
    /// The proxy's last messages inside a client's batch.
    added: Option<Added>,
    /// The client prepared a statement that may change the setting or drop the proxy's
    /// statement when it runs (its text names `statement_org`, RESET, DISCARD or
    /// DEALLOCATE; the router marks it): each Bind of one forgets, as its Parse did.
    changers: bool,
    /// The client prepared such a statement with SQL (`PREPARE`): every `EXECUTE` may run it.
    sql_prepared: bool,
}

/// The proxy's messages inside a client's batch, known once that batch is answered: they
/// ran if it ran without error. (A Parse that ran is not undone by a later error or
/// rollback; the value may be.)
#[derive(Debug)]
struct Added {
    /// The batch's request number.
    request: u64,
    /// The exchange's error count when they were added.
    errors: u64,
    /// They parsed the proxy's statement.
    parsed: bool,
    /// The value the cloud keeps if the batch runs without error: its one statement was
    /// placed in one organization and it began outside a transaction.
    keeps: Option<OrgId>,
}

impl CloudOrg {
    /// Forgets what the cloud holds: the client's statement may have changed it, or
    /// deallocated the proxy's statement.
    pub(super) fn forget(&mut self) {
        self.known = None;
        self.parsed = false;
        self.added = None;
    }

    /// Learns what became of the proxy's messages in a batch that is answered now.
    fn settle(&mut self, ex: &Exchange) {
        if self.last.is_some_and(|last| ex.own_failed(last)) {
            // The last request of its own failed (its answers were dropped): nothing of it
            // is known.
            self.last = None;
            self.forget();
        }
        let Some(added) = self.added.take_if(|a| ex.answered > a.request) else {
            return;
        };
        if ex.errors == added.errors {
            self.parsed |= added.parsed;
            if added.keeps.is_some() {
                self.known = added.keeps;
            }
        } else {
            // An error in that batch, or since: the proxy's statement may not exist.
            self.forget();
        }
    }
}

impl ClientFrames<'_> {
    /// What goes to the cloud just ahead of `frame` (a Query or Bind going there) so the
    /// cloud knows its statement's organization; registered on the cloud's exchange, so
    /// its answers are dropped. `None`: nothing (no LokaDB table, or the value is known).
    pub(super) fn tell_cloud(&mut self, tag: u8, msg: &Message<'_>) -> Option<Told> {
        if !self.router.cloud_org.tell || !matches!(tag, FE_QUERY | FE_BIND) {
            return None;
        }
        if self.router.cloud_org.changers
            && msg
                .bind()
                .is_some_and(|b| self.router.changes_setting(b.statement))
        {
            self.router.cloud_org.forget();
        }
        let ex = &self.exchanges.cloud;
        let state = &mut self.router.cloud_org;
        state.settle(ex);
        let batch = ex.answered + u64::from(ex.pending);
        if let Some(added) = state.added.as_mut().filter(|a| a.request == batch) {
            // A second statement in the batch the value was added to: it may end the
            // transaction (a ROLLBACK).
            added.keeps = None;
        }
        if ex.status == TX_FAILED && ex.pending == 0 && !ex.unsynced {
            // Every statement fails until the transaction ends; so would the proxy's.
            return None;
        }
        // The tally counts the statement under it too (`frame` is what goes to the cloud).
        let mut tally = self.router.tally.take();
        let found = self.message_org(msg).map(|(org, placed)| {
            if let Some(t) = &mut tally {
                t.remember(&org);
            }
            let known = self.router.cloud_org.known.as_deref() == Some(&*org);
            ((!known).then(|| OrgId::from(&*org)), placed)
        });
        self.router.tally = tally;
        let (org, placed) = found?;
        let org = org?;
        let holds = self.router.holds_message();
        let ex = &mut self.exchanges.cloud;
        let state = &mut self.router.cloud_org;
        // Nothing of the client's ahead of it in the request (a held Parse the Query takes
        // along answers first), and an ASCII value: the positions Postgres gives count
        // characters in the client's encoding.
        let one_statement = tag == FE_QUERY
            && !ex.unsynced
            && !holds
            && org.is_ascii()
            && self.meta.is_some_and(|m| m.meta.set_normalized)
            && msg.statement().is_some_and(|q| one_dml_statement(q.sql));
        if one_statement {
            // In front of the Query's text: its answer (CommandComplete) is dropped by
            // position. Begun outside a transaction with nothing pending, one statement that
            // runs without an error commits the value.
            let text = prefix(&org);
            let first = ex.pending == 0 && ex.status == TX_IDLE;
            // ASCII (the value is): as many characters as bytes.
            ex.add_own_statement(text.len());
            state.known = None;
            state.added = Some(Added {
                request: batch,
                errors: ex.errors,
                parsed: false,
                keeps: first.then_some(org),
            });
            return Some(Told::Prefix(text));
        }
        // The proxy's own named statement and portal: the client's unnamed ones stay as
        // they are (a simple Query would destroy the unnamed statement). Parsed once: a
        // client's statement that could deallocate it (DISCARD, DEALLOCATE) makes the proxy
        // forget it, as it is seen, also earlier in the same batch.
        let mut out = Vec::with_capacity(160 + org.len());
        frontend::close_portal(&mut out, OWN);
        let parse = !state.parsed;
        if parse {
            frontend::close_statement(&mut out, OWN);
            frontend::parse(&mut out, OWN, SET_SQL);
        }
        frontend::bind_portal_text(&mut out, OWN, OWN, &[Some(&org)]);
        frontend::execute_portal(&mut out, OWN);
        // Inside the client's batch: where its statement is inside one, or at the front of
        // the one a Bind begins when its statement is placed (a statement the analysis could
        // not place may be one Postgres runs only alone, or end the transaction).
        if ex.unsynced || (tag == FE_BIND && placed) {
            // Nothing of the batch can run but this statement: it began outside a
            // transaction with nothing pending, and no portal was bound in it before.
            let first = ex.pending == 0 && ex.status == TX_IDLE && ex.binds_in_batch == 0;
            ex.add_own(&out);
            state.known = None;
            state.added = Some(Added {
                request: batch,
                errors: ex.errors,
                parsed: parse,
                keeps: (placed && first).then_some(org),
            });
        } else {
            // A request of its own, dropped whole. Alone outside a transaction it cannot be
            // rolled back: what it set and parsed is known.
            let alone = ex.is_idle();
            frontend::sync(&mut out);
            state.last = Some(batch);
            // An earlier batch still unanswered must not make its older value known.
            if let Some(added) = &mut state.added {
                added.keeps = None;
            }
            ex.silence_next();
            count(ex, FE_SYNC);
            state.parsed |= alone;
            state.known = alone.then_some(org);
        }
        Some(Told::Ahead(out))
    }

    /// The organization of a Query's or Bind's statement as the cloud should know it
    /// (`""` for a statement on LokaDB tables the analysis could not place in one), and
    /// whether the analysis placed it; `None` for one on no LokaDB table (the setting stays
    /// as it is), or one Postgres runs only alone.
    pub(super) fn statement_org(&self, tag: u8, frame: &[u8]) -> Option<(Cow<'_, str>, bool)> {
        self.message_org(&Message::decode(tag, &frame[5..]).ok()?)
    }

    /// [`Self::statement_org`] of a decoded message.
    pub(super) fn message_org(&self, msg: &Message<'_>) -> Option<(Cow<'_, str>, bool)> {
        self.meta?;
        let org = match msg {
            Message::Query(q) => return self.sql_org(q.sql),
            Message::Bind(bind) => {
                let name = bind.statement;
                match self.router.prepared_analysis(name) {
                    Some(Analysis::NoLokaTable) => return None,
                    // Inside a batch nothing may go ahead of it; at a batch's front the
                    // proxy's request of its own may.
                    Some(Analysis::Unplaced(why))
                        if *why == RUNS_ALONE && self.exchanges.cloud.unsynced =>
                    {
                        return None
                    }
                    Some(Analysis::Org { org, .. }) => {
                        let ty = self.router.org_type(name);
                        let org = self.router.org_value(org, Some(bind), ty).ok()?;
                        return Some((readable(org), true));
                    }
                    // Unplaced, or parsed before the metadata was loaded, or forgotten.
                    _ => None,
                }
            }
            _ => return None,
        };
        Some((org.unwrap_or(Cow::Borrowed("")), false))
    }

    /// [`Self::statement_org`] of a statement's text (a Query's, or a Parse's).
    pub(super) fn sql_org(&self, sql: &str) -> Option<(Cow<'_, str>, bool)> {
        let meta = self.meta?;
        let session = self.router.org.current.as_deref().map(Cow::Borrowed);
        // A session limited to its organization sends every statement on LokaDB tables
        // limited to it, or refused.
        if session.is_some() {
            return meta
                .meta
                .catalog
                .may_touch(sql)
                .then_some(session)
                .flatten()
                .map(|org| (org, false));
        }
        let org = match self.place(meta, sql) {
            Placement::NoLokaTable => return None,
            Placement::Org(Org::Literal(v)) => Cow::Owned(v),
            Placement::Org(_) | Placement::Unplaced => Cow::Borrowed(""),
        };
        Some((org, false))
    }

    /// A client's Query or Parse: forgets the value the cloud holds when the statement may
    /// change it (names it, or resets settings), and remembers a Parse's analysis for its
    /// Binds when routing does not.
    pub(super) fn note_for_cloud_org(&mut self, frame: &[u8], routed: &Routed<'_>) {
        // Also when some organization owes migrations: its Binds are refused by analysis.
        let Some(meta) = self
            .meta
            .filter(|m| self.router.cloud_org.tell || m.has_owing())
        else {
            return;
        };
        let Some(&Statement { name, sql, .. }) = routed.statement() else {
            return;
        };
        let state = &mut self.router.cloud_org;
        let names_it = mentions(sql, b"statement_org")
            || mentions(sql, b"reset")
            || mentions(sql, b"discard")
            || mentions(sql, b"deallocate");
        if names_it && mentions(sql, b"prepare") {
            state.sql_prepared = true;
        }
        let changes = names_it || (state.sql_prepared && mentions(sql, b"execute"));
        if changes {
            state.forget();
        }
        if let Some(name) = name {
            if !self.router.enabled {
                let analysis = routed
                    .analysis(|sql| self.analyze(meta, sql))
                    .cloned()
                    .expect("a statement (read above)");
                let ty = super::router::org_param_type(frame, &analysis, Some(&meta.meta.catalog));
                self.router.remember(name, &[], None, analysis, ty);
            }
            if changes {
                self.router.mark_changes_setting(name);
                self.router.cloud_org.changers = true;
            }
        }
    }
}

/// The organization as the cloud should know it, `""` when the proxy cannot read it: a
/// bound value in binary that is not an integer (a uuid's 16 bytes) is no text the cloud
/// accepts, and the proxy's messages ride in the client's batch (their failure fails it).
fn readable(org: Option<Cow<'_, str>>) -> Cow<'_, str> {
    match org {
        Some(v)
            if !v
                .chars()
                .any(|c| c.is_control() || c == char::REPLACEMENT_CHARACTER) =>
        {
            v
        }
        _ => Cow::Borrowed(""),
    }
}

#[cfg(test)]
mod tests {
    use super::super::pump::{Action, Inspect};
    use super::super::router::{Exchanges, Router, Side};
    use super::super::statement::{ClientFrames, Reported, ServerFrames};
    use super::*;
    use crate::route::analysis::tests::core_meta;
    use crate::route::meta::CoreMeta;
    use lokadb_shared::wire::Header;

    /// A session with the cloud: what reaches the cloud of the client's messages, and what
    /// reaches the client of the cloud's answers.
    struct Session {
        exchanges: Exchanges,
        router: Router,
        meta: CoreMeta,
    }

    /// The whole frames of `bytes`.
    fn frames(bytes: &[u8]) -> Vec<&[u8]> {
        let mut out = Vec::new();
        let mut at = 0;
        while let Some(h) = Header::peek(&bytes[at..], u32::MAX).unwrap() {
            out.push(&bytes[at..at + h.frame_len()]);
            at += h.frame_len();
        }
        out
    }

    fn tags(bytes: &[u8]) -> String {
        frames(bytes).iter().map(|f| f[0] as char).collect()
    }

    fn header(f: &[u8]) -> Header {
        Header::peek(f, u32::MAX).unwrap().unwrap()
    }

    impl Session {
        fn new() -> Session {
            let mut router = Router::default();
            router.cloud_org.tell = true;
            Session {
                exchanges: Exchanges::default(),
                router,
                meta: core_meta(),
            }
        }

        /// The client sends `bytes`: what goes to the cloud.
        fn send(&mut self, bytes: &[u8]) -> Vec<u8> {
            let mut c = ClientFrames {
                exchanges: &mut self.exchanges,
                route_log: false,
                meta: Some(&self.meta),
                router: &mut self.router,
                record: None,
                tx: None,
            };
            let mut out = Vec::new();
            for f in frames(bytes) {
                match c.on_frame(header(f), Some(f)) {
                    Action::Forward => out.extend_from_slice(f),
                    Action::Replace(b) => out.extend_from_slice(&b),
                    a => panic!("{a:?}"),
                }
            }
            out
        }

        /// The cloud answers with messages of these tags (`Z`: ReadyForQuery, its status
        /// `status`): the tags the client gets.
        fn answer(&mut self, answers: &str, status: u8) -> String {
            let mut reported = Reported::default();
            let mut s = ServerFrames {
                exchange: &mut self.exchanges.cloud,
                side: Side::Cloud,
                reported: &mut reported,
                record: None,
            };
            let mut seen = String::new();
            for tag in answers.bytes() {
                let body: &[u8] = match tag {
                    b'Z' => &[status],
                    b'C' => b"SELECT 1\0",
                    b'D' => b"\0\x01\0\0\0\x011",
                    b'E' => b"SERROR\0C22012\0\0",
                    _ => b"",
                };
                let mut f = vec![tag];
                f.extend_from_slice(&(body.len() as u32 + 4).to_be_bytes());
                f.extend_from_slice(body);
                match s.on_frame(header(&f), Some(&f)) {
                    Action::Forward => seen.push(tag as char),
                    Action::Replace(b) => seen.push_str(&tags(&b)),
                    a => panic!("{a:?}"),
                }
            }
            seen
        }
    }

    fn bind_batch(statement: &str, org: &str) -> Vec<u8> {
        let mut out = Vec::new();
        frontend::bind_text(&mut out, statement, &[Some(org)]);
        frontend::execute(&mut out);
        frontend::sync(&mut out);
        out
    }

    /// The proxy's messages go at the front of the client's batch (no Sync of their own),
    /// their answers are dropped, and the value is trusted only after a batch that cannot
    /// have rolled it back: begun outside a transaction, one placed statement, no error.
    #[test]
    fn a_bind_batch_carries_the_setting_and_trusts_it_only_when_it_cannot_roll_back() {
        let mut s = Session::new();
        let mut out = Vec::new();
        frontend::parse(
            &mut out,
            "q",
            "SELECT * FROM documents WHERE organization_id = $1",
        );
        frontend::parse(&mut out, "one", "SELECT 1");
        frontend::parse(&mut out, "v", "VACUUM documents");
        frontend::parse(&mut out, "u", "SELECT * FROM documents");
        frontend::sync(&mut out);
        assert_eq!(s.send(&out), out);
        assert_eq!(s.answer("1111Z", TX_IDLE), "1111Z");

        // Organization 1: Close, Close, Parse, Bind, Execute of the proxy's, then the
        // client's Bind, Execute, Sync; its answers only reach the client.
        let b1 = bind_batch("q", "1");
        assert_eq!(tags(&s.send(&b1)), "CCPBEBES");
        assert_eq!(s.answer("3312DC2DCZ", TX_IDLE), "2DCZ");
        // Known now: nothing added.
        assert_eq!(s.send(&b1), b1);
        assert_eq!(s.answer("2DCZ", TX_IDLE), "2DCZ");

        // Organization 2, and an error in the client's statement: the value went with it,
        // and the proxy's statement is parsed again (it might be what failed).
        let b2 = bind_batch("q", "2");
        assert_eq!(tags(&s.send(&b2)), "CBEBES");
        assert_eq!(s.answer("32DC2EZ", TX_IDLE), "2EZ");
        assert_eq!(tags(&s.send(&b2)), "CCPBEBES");
        assert_eq!(s.answer("3312DC2DCZ", TX_IDLE), "2DCZ");
        assert_eq!(s.send(&b2), b2);
        assert_eq!(s.answer("2DCZ", TX_IDLE), "2DCZ");

        // A second statement in the batch (it could be a ROLLBACK): not trusted.
        let mut two = Vec::new();
        frontend::bind_text(&mut two, "q", &[Some("3")]);
        frontend::execute(&mut two);
        frontend::bind_text(&mut two, "one", &[]);
        frontend::execute(&mut two);
        frontend::sync(&mut two);
        assert_eq!(tags(&s.send(&two)), "CBEBEBES");
        assert_eq!(s.answer("32DC2DC2DCZ", TX_IDLE), "2DC2DCZ");
        let b3 = bind_batch("q", "3");
        assert_eq!(tags(&s.send(&b3)), "CBEBES");
        assert_eq!(s.answer("32DC2DCZ", TX_IDLE), "2DCZ");
        assert_eq!(s.send(&b3), b3);
        assert_eq!(s.answer("2DCZ", TX_IDLE), "2DCZ");

        // In a transaction block: added each time (a ROLLBACK would undo it).
        let mut begin = Vec::new();
        frontend::query(&mut begin, "BEGIN");
        s.send(&begin);
        assert_eq!(s.answer("CZ", TX_IN_BLOCK), "CZ");
        let b4 = bind_batch("q", "4");
        for _ in 0..2 {
            assert_eq!(tags(&s.send(&b4)), "CBEBES");
            assert_eq!(s.answer("32DC2DCZ", TX_IN_BLOCK), "2DCZ");
        }
        // A failed transaction runs nothing: nothing added.
        assert_eq!(tags(&s.send(&b4)), "CBEBES");
        assert_eq!(s.answer("32DC2EZ", TX_FAILED), "2EZ");
        assert_eq!(s.send(&b4), b4);
        assert_eq!(s.answer("EZ", TX_FAILED), "EZ");
        let mut rollback = Vec::new();
        frontend::query(&mut rollback, "ROLLBACK");
        s.send(&rollback);
        assert_eq!(s.answer("CZ", TX_IDLE), "CZ");

        // The unnamed statement parsed in each batch (Parse, Bind, Describe, Execute, Sync):
        // trusted alike, the Parse ran nothing. (The proxy's statement is parsed again: the
        // failed transaction above may have failed it.)
        let mut unnamed = Vec::new();
        frontend::parse(
            &mut unnamed,
            "",
            "SELECT * FROM documents WHERE organization_id = $1",
        );
        frontend::bind_text(&mut unnamed, "", &[Some("7")]);
        unnamed.extend_from_slice(b"D\0\0\0\x06P\0"); // Describe of the unnamed portal
        frontend::execute(&mut unnamed);
        frontend::sync(&mut unnamed);
        assert_eq!(tags(&s.send(&unnamed)), "PCCPBEBDES");
        assert_eq!(s.answer("13312DC2TDCZ", TX_IDLE), "12TDCZ");
        assert_eq!(s.send(&unnamed), unnamed);
        assert_eq!(s.answer("12TDCZ", TX_IDLE), "12TDCZ");

        // A prepared RESET ALL, run later: each run forgets what the cloud held (and the
        // proxy's statement: a DEALLOCATE would drop it); the name parsed again as something
        // else does not.
        let mut reset = Vec::new();
        frontend::parse(&mut reset, "r", "RESET ALL");
        frontend::sync(&mut reset);
        s.send(&reset);
        assert_eq!(s.answer("1Z", TX_IDLE), "1Z");
        let u7 = bind_batch("q", "7");
        assert_eq!(tags(&s.send(&u7)), "CCPBEBES");
        assert_eq!(s.answer("3312DC2DCZ", TX_IDLE), "2DCZ");
        assert_eq!(s.send(&u7), u7);
        assert_eq!(s.answer("2DCZ", TX_IDLE), "2DCZ");
        let r = bind_batch("r", "");
        assert_eq!(s.send(&r), r);
        assert_eq!(s.answer("2CZ", TX_IDLE), "2CZ");
        assert_eq!(tags(&s.send(&u7)), "CCPBEBES");
        assert_eq!(s.answer("3312DC2DCZ", TX_IDLE), "2DCZ");
        let mut other = Vec::new();
        frontend::parse(&mut other, "r", "SELECT 2");
        frontend::sync(&mut other);
        s.send(&other);
        assert_eq!(s.answer("1Z", TX_IDLE), "1Z");
        s.send(&r);
        assert_eq!(s.answer("2DCZ", TX_IDLE), "2DCZ");
        assert_eq!(s.send(&u7), u7);
        assert_eq!(s.answer("2DCZ", TX_IDLE), "2DCZ");

        // A statement Postgres runs only alone: at a batch's front, a request of the proxy's
        // own goes ahead of it (''); inside a batch, nothing.
        let v = bind_batch("v", "");
        assert_eq!(tags(&s.send(&v)), "CBESBES");
        assert_eq!(s.answer("32DCZ", TX_IDLE), "");
        assert_eq!(s.answer("2CZ", TX_IDLE), "2CZ");
        let mut pv = Vec::new();
        frontend::parse(&mut pv, "", "VACUUM documents");
        frontend::bind_text(&mut pv, "", &[]);
        frontend::execute(&mut pv);
        frontend::sync(&mut pv);
        assert_eq!(s.send(&pv), pv);
        assert_eq!(s.answer("12CZ", TX_IDLE), "12CZ");

        // A simple Query of one statement: the proxy's statement in front of its text, in
        // the same Query; its answers are dropped.
        let sql = "SELECT * FROM documents WHERE organization_id = 5";
        let mut q = Vec::new();
        frontend::query(&mut q, sql);
        let mut told = Vec::new();
        frontend::query(&mut told, &format!("{}{sql}", prefix("5")));
        assert_eq!(s.send(&q), told);
        assert_eq!(prefix("5"), "SET lokadb.statement_org = '5';");
        assert_eq!(prefix("it's"), "SET lokadb.statement_org = 'it''s';");
        // A value cannot end the SET: one literal, whatever it holds.
        assert_eq!(
            prefix("x'; DROP TABLE t; --"),
            "SET lokadb.statement_org = 'x''; DROP TABLE t; --';"
        );
        assert_eq!(prefix(r"a\b'"), r"SET lokadb.statement_org = E'a\\b''';");
        assert_eq!(s.answer("CTDCZ", TX_IDLE), "TDCZ");
        // One statement begun outside a transaction, no error: known.
        assert_eq!(s.send(&q), q);
        assert_eq!(s.answer("TDCZ", TX_IDLE), "TDCZ");
        // Its statement fails: the value is not known (the transaction rolled back).
        let mut q7 = Vec::new();
        frontend::query(&mut q7, "SELECT * FROM documents WHERE organization_id = 7");
        assert_eq!(tags(&s.send(&q7)), "Q");
        assert_eq!(s.answer("CEZ", TX_IDLE), "EZ");
        assert_eq!(tags(&s.send(&q7)), "Q");
        assert_eq!(s.answer("CTDCZ", TX_IDLE), "TDCZ");
        assert_eq!(s.send(&q7), q7);
        assert_eq!(s.answer("TDCZ", TX_IDLE), "TDCZ");
        // The proxy's statement fails (a cancel): the client sees the error.
        let mut q8 = Vec::new();
        frontend::query(&mut q8, "SELECT * FROM documents WHERE organization_id = 8");
        assert_eq!(tags(&s.send(&q8)), "Q");
        assert_eq!(s.answer("EZ", TX_IDLE), "EZ");
        // Inside a transaction: set, not known.
        s.send(&begin);
        assert_eq!(s.answer("CZ", TX_IN_BLOCK), "CZ");
        assert_eq!(tags(&s.send(&q8)), "Q");
        assert_eq!(s.answer("CTDCZ", TX_IN_BLOCK), "TDCZ");
        assert_eq!(tags(&s.send(&q8)), "Q");
        assert_eq!(s.answer("CTDCZ", TX_IN_BLOCK), "TDCZ");
        s.send(&rollback);
        assert_eq!(s.answer("CZ", TX_IDLE), "CZ");
        // Two statements, or one a transaction block changes (a LOCK): a request of the
        // proxy's own, with its Sync, then the Query (the failure above made the proxy
        // parse its statement again).
        for (sql, sent) in [
            (
                "SELECT * FROM documents WHERE organization_id = 5; SELECT 1",
                "CCPBESQ",
            ),
            ("LOCK documents", "CBESQ"),
        ] {
            let mut q = Vec::new();
            frontend::query(&mut q, sql);
            assert_eq!(tags(&s.send(&q)), sent, "{sql}");
            let answers = if sent.contains('P') {
                "3312DCZ"
            } else {
                "32DCZ"
            };
            assert_eq!(s.answer(answers, TX_IDLE), "");
            assert_eq!(s.answer("CZ", TX_IDLE), "CZ");
        }
        // Alone outside a transaction: known.
        let mut lock = Vec::new();
        frontend::query(&mut lock, "LOCK documents");
        assert_eq!(s.send(&lock), lock);
        assert_eq!(s.answer("CZ", TX_IDLE), "CZ");

        // A Query inside the client's batch (no Sync before it): the proxy's messages go in
        // the batch too, with no Sync of theirs.
        let mut mixed = Vec::new();
        frontend::bind_text(&mut mixed, "one", &[]);
        frontend::execute(&mut mixed);
        frontend::query(
            &mut mixed,
            "SELECT * FROM documents WHERE organization_id = 6",
        );
        assert_eq!(tags(&s.send(&mixed)), "BECBEQ");
        assert_eq!(s.answer("2DC32DCTDCZ", TX_IDLE), "2DCTDCZ");

        // Pipelined batches: an older batch's value is not made known once a newer one was
        // sent (here '' for an unplaced statement, in a request of the proxy's own).
        let a = bind_batch("q", "8");
        assert_eq!(tags(&s.send(&a)), "CBEBES");
        assert_eq!(tags(&s.send(&bind_batch("u", ""))), "CBESBES");
        assert_eq!(s.answer("32DC2DCZ", TX_IDLE), "2DCZ");
        assert_eq!(s.answer("32DCZ", TX_IDLE), "");
        assert_eq!(s.answer("2DCZ", TX_IDLE), "2DCZ");
        assert_eq!(tags(&s.send(&a)), "CBEBES");
        assert_eq!(s.answer("32DC2DCZ", TX_IDLE), "2DCZ");

        // A portal bound earlier in the batch may run after the proxy's messages (it could be
        // a ROLLBACK): not trusted.
        let mut late = Vec::new();
        frontend::bind_portal_text(&mut late, "p", "one", &[]);
        frontend::bind_text(&mut late, "q", &[Some("9")]);
        frontend::execute(&mut late);
        frontend::execute_portal(&mut late, "p");
        frontend::sync(&mut late);
        assert_eq!(tags(&s.send(&late)), "BCBEBEES");
        assert_eq!(s.answer("232DC2DCDCZ", TX_IDLE), "22DCDCZ");
        assert_eq!(tags(&s.send(&bind_batch("q", "9"))), "CBEBES");
        assert_eq!(s.answer("32DC2DCZ", TX_IDLE), "2DCZ");

        // A failed transaction that a ROLLBACK earlier in the batch ends: the statement after
        // it gets the setting.
        s.send(&begin);
        assert_eq!(s.answer("CZ", TX_IN_BLOCK), "CZ");
        s.send(&bind_batch("one", ""));
        assert_eq!(s.answer("EZ", TX_FAILED), "EZ");
        let mut rb = Vec::new();
        frontend::parse(&mut rb, "", "ROLLBACK");
        frontend::bind_text(&mut rb, "", &[]);
        frontend::execute(&mut rb);
        frontend::bind_text(&mut rb, "q", &[Some("10")]);
        frontend::execute(&mut rb);
        frontend::sync(&mut rb);
        assert_eq!(tags(&s.send(&rb)), "PBECBEBES");
        assert_eq!(s.answer("12C32DC2DCZ", TX_IDLE), "12C2DCZ");

        // The proxy's messages fail: the client's batch fails with Postgres's error, and the
        // proxy parses its statement again.
        assert_eq!(tags(&s.send(&bind_batch("q", "11"))), "CBEBES");
        assert_eq!(s.answer("3EZ", TX_IDLE), "EZ");
        assert_eq!(tags(&s.send(&bind_batch("q", "11"))), "CCPBEBES");
        assert_eq!(s.answer("3312DC2DCZ", TX_IDLE), "2DCZ");
    }

    /// A bound value in binary that is no integer (a uuid's 16 bytes) is told as unknown: as
    /// text the cloud could refuse it, failing the client's batch.
    #[test]
    fn a_value_the_cloud_cannot_read_is_told_as_unknown() {
        let uuid = [
            0x8f, 0x00, 0x2a, 0x41, 0x9c, 0x11, 0x4e, 0x02, 0xb3, 0x5d, 0x7e, 0x18, 0x00, 0x6a,
            0xc4, 0x21,
        ];
        assert_eq!(readable(Some(String::from_utf8_lossy(&uuid))), "");
        assert_eq!(readable(Some(Cow::Borrowed("\u{1}\u{2}"))), "");
        assert_eq!(readable(Some(Cow::Borrowed("acme-é"))), "acme-é");
        assert_eq!(readable(None), "");
    }
}
