//! What the cloud learns of each statement's organization (`docs/routing.md`, "What the
//! cloud learns"): ahead of a statement on LokaDB tables, in the same write, the proxy sets
//! `lokadb.statement_org` on the client's cloud backend to the organization the analysis
//! placed it in (`''`: none it could name). Cloud-side code (a trigger, a policy, an audit)
//! reads it with `current_setting('lokadb.statement_org', true)`. It costs the client no
//! round trip: the answers are dropped as they come.
//!
//! It is sent only when the value changes. The proxy trusts the value it set only when its
//! request ran alone outside a transaction: one set inside a transaction (or the client's
//! batch) may be rolled back with it, so it is set again before the next statement.

use super::router::count;
use super::statement::{statement_of, ClientFrames};
use crate::route::analysis::{mentions, Analysis, Org};
use crate::route::meta::Placement;
use lokadb_shared::wire::fields::Fields;
use lokadb_shared::wire::frontend;
use lokadb_shared::wire::tags::*;
use std::borrow::Cow;
use std::rc::Rc;

/// The setting's name.
pub const SETTING: &str = "lokadb.statement_org";

/// The proxy's own prepared statement and portal that set it.
const OWN: &str = "lokadb_statement_org";

const SET_SQL: &str = "SELECT pg_catalog.set_config('lokadb.statement_org', $1, false)";

/// A session's state of it.
#[derive(Debug, Default)]
pub struct CloudOrg {
    /// Tell the cloud (`statement_org`, on by default).
    pub tell: bool,
    /// The value the cloud backend holds, when the proxy knows it.
    known: Option<Rc<str>>,
    /// The proxy's statement is parsed on the cloud backend.
    parsed: bool,
    /// The request number of the proxy's last request of its own that set it.
    last: Option<u64>,
    /// The statement was parsed inside a client's batch: that request's number and the
    /// exchange's error count then. It exists once that request is answered with no error
    /// since (a Parse that ran is not undone by a later error or rollback).
    parsed_in: Option<(u64, u64)>,
}

impl CloudOrg {
    /// Forgets what the cloud holds: the client's statement may have changed it, or
    /// deallocated the proxy's statement.
    fn forget(&mut self) {
        self.known = None;
        self.parsed = false;
        self.parsed_in = None;
    }
}

impl ClientFrames<'_> {
    /// What goes to the cloud just ahead of `frame` (a Query or Bind going there) so the
    /// cloud knows its statement's organization; registered on the cloud's exchange, so
    /// its answers are dropped. `None`: nothing (no LokaDB table, or the value is known).
    pub(super) fn tell_cloud(&mut self, tag: u8, frame: &[u8]) -> Option<Vec<u8>> {
        if !self.router.cloud_org.tell {
            return None;
        }
        let ex = &self.exchanges.cloud;
        if self
            .router
            .cloud_org
            .last
            .is_some_and(|last| ex.own_failed(last))
        {
            // The last one failed (its answers were dropped): nothing of it is known.
            self.router.cloud_org.forget();
        }
        if let Some((request, errors)) = self.router.cloud_org.parsed_in {
            if ex.answered > request {
                let state = &mut self.router.cloud_org;
                state.parsed_in = None;
                state.parsed = ex.errors == errors;
            }
        }
        let org = self.statement_org(tag, frame)?;
        if self.router.cloud_org.known.as_deref() == Some(&*org) {
            return None;
        }
        let org: Rc<str> = Rc::from(&*org);
        let ex = &mut self.exchanges.cloud;
        let state = &mut self.router.cloud_org;
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
        if ex.unsynced {
            // Inside the client's batch, in its implicit transaction: the value may be
            // rolled back with it; a Parse holds once the batch ran without error.
            ex.add_own(&out);
            state.known = None;
            if parse {
                state.parsed_in = Some((ex.answered + u64::from(ex.pending), ex.errors));
            }
        } else {
            // A request of its own, dropped whole. Alone outside a transaction it cannot be
            // rolled back: what it set and parsed is known.
            let alone = ex.is_idle();
            frontend::sync(&mut out);
            state.last = Some(ex.answered + u64::from(ex.pending));
            ex.silence_next();
            count(ex, FE_SYNC);
            state.parsed |= alone;
            state.known = alone.then_some(org);
        }
        Some(out)
    }

    /// The organization of a Query's or Bind's statement as the cloud should know it:
    /// `""` for a statement on LokaDB tables the analysis could not place in one;
    /// `None` for one on no LokaDB table (the setting stays as it is).
    fn statement_org(&self, tag: u8, frame: &[u8]) -> Option<Cow<'_, str>> {
        let meta = self.meta?;
        let mut f = Fields::new(&frame[5..], "message");
        let org = match tag {
            FE_QUERY => {
                let sql = f.cstr().ok()?;
                let session = self.router.session_org.as_deref().map(Cow::Borrowed);
                // A session limited to its organization sends every statement on LokaDB
                // tables limited to it, or refused.
                if session.is_some() {
                    return meta
                        .meta
                        .catalog
                        .may_touch(sql)
                        .then_some(session)
                        .flatten();
                }
                match meta.place(sql) {
                    Placement::NoLokaTable => return None,
                    Placement::Org(Org::Literal(v)) => Some(Cow::Owned(v)),
                    Placement::Org(_) | Placement::Unplaced => None,
                }
            }
            FE_BIND => {
                let _portal = f.cstr().ok()?;
                let name = f.cstr().ok()?;
                match self.router.prepared_analysis(name) {
                    Some(Analysis::NoLokaTable) => return None,
                    Some(Analysis::Org { org, .. }) => {
                        self.router.org_value(org, Some(&mut f)).ok()?
                    }
                    // Unplaced, or parsed before the metadata was loaded, or forgotten.
                    _ => None,
                }
            }
            _ => return None,
        };
        Some(org.unwrap_or(Cow::Borrowed("")))
    }

    /// A client's Query or Parse: forgets the value the cloud holds when the statement may
    /// change it (names it, or resets settings), and remembers a Parse's analysis for its
    /// Binds when routing does not.
    pub(super) fn note_for_cloud_org(&mut self, tag: u8, frame: &[u8]) {
        let Some(meta) = self.meta.filter(|_| self.router.cloud_org.tell) else {
            return;
        };
        let Some((name, sql, _)) = statement_of(tag, &frame[5..]) else {
            return;
        };
        let state = &mut self.router.cloud_org;
        if (state.known.is_some() || state.parsed)
            && (mentions(sql, b"statement_org")
                || mentions(sql, b"reset")
                || mentions(sql, b"discard")
                || mentions(sql, b"deallocate"))
        {
            state.forget();
        }
        if let (Some(name), false) = (name, self.router.enabled) {
            self.router.remember(name, &[], None, meta.analyze(sql));
        }
    }
}
