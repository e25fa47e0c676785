//! Per-organization figures (`SHOW STATS`, `GET /metrics`): each Query and Bind naming an
//! organization is counted under it by the route it took (cloud, direct, refused by the
//! proxy), and its request's latency and errors with it. Kept only where something reads
//! them (`metrics` or `admin_users` set): the organization is read from the statement's
//! analysis, which routing already cached.

use super::pump::Action;
use super::router::Side;
use super::statement::{statement_of, ClientFrames};
use crate::metrics::{DbStats, Route};
use lokadb_shared::wire::tags::*;
use std::cell::RefCell;
use std::rc::Rc;

/// A session's share of its database's figures on its core.
#[derive(Debug)]
pub struct Tally {
    /// The database's figures on this core.
    pub stats: Rc<RefCell<DbStats>>,
    /// The organization of the request in flight (its first statement's), kept for its
    /// latency and errors; the buffer is reused.
    org: String,
    has_org: bool,
    /// The organization routing read for the message being routed ([`Self::remember`]).
    seen: String,
    has_seen: bool,
}

impl Tally {
    pub fn new(stats: Rc<RefCell<DbStats>>) -> Tally {
        Tally {
            stats,
            org: String::new(),
            has_org: false,
            seen: String::new(),
            has_seen: false,
        }
    }

    /// Keeps the organization routing read for the message being routed (telling the
    /// cloud): counting it then costs no second analysis.
    pub fn remember(&mut self, org: &str) {
        self.seen.clear();
        self.seen.push_str(org);
        self.has_seen = true;
    }

    /// The request in flight's organization, taken (its request is done).
    pub fn take_org(&mut self) -> Option<&str> {
        std::mem::take(&mut self.has_org).then_some(self.org.as_str())
    }

    /// The request in flight's organization, if a statement of it named one.
    pub fn org(&self) -> Option<&str> {
        self.has_org.then_some(self.org.as_str())
    }

    fn note(&mut self, org: &str, route: Route) {
        self.stats.borrow_mut().org(org).statements[route as usize] += 1;
        if !self.has_org {
            self.org.clear();
            self.org.push_str(org);
            self.has_org = true;
        }
    }
}

impl ClientFrames<'_> {
    /// Counts a client's message once routed (`action`: not held, its turn comes again).
    pub(super) fn tally(&mut self, tag: u8, frame: Option<&[u8]>, action: &Action) {
        let refused = std::mem::take(&mut self.router.refused_now);
        if self.router.tally.is_none() || *action == Action::Hold {
            return;
        }
        // A refused Parse is the refused statement (its Binds run the refusal).
        if !(matches!(tag, FE_QUERY | FE_BIND) || (tag == FE_PARSE && refused)) {
            return;
        }
        let route = match (refused, self.router.target) {
            (true, _) => Route::Refused,
            (false, Side::Direct) => Route::Direct,
            (false, Side::Cloud) => Route::Cloud,
        };
        // Out of the router while the statement's organization (read from it) is at hand.
        let Some(mut tally) = self.router.tally.take() else {
            return;
        };
        let seen = std::mem::take(&mut tally.has_seen);
        match route {
            Route::Direct => {
                if let Some(org) = self.router.direct_org.clone() {
                    tally.note(&org, route);
                }
            }
            Route::Cloud if seen => {
                let org = std::mem::take(&mut tally.seen);
                if !org.is_empty() {
                    tally.note(&org, route);
                }
                tally.seen = org;
            }
            _ => {
                let org = match frame {
                    Some(f) if tag == FE_PARSE => statement_of(tag, &f[5..])
                        .and_then(|(_, sql, _)| self.sql_org(sql))
                        .map(|(org, _)| org),
                    Some(f) => self.statement_org(tag, f).map(|(org, _)| org),
                    None => None,
                };
                // No LokaDB table, or none the analysis could place in one organization.
                if let Some(org) = org.filter(|o| !o.is_empty()) {
                    tally.note(&org, route);
                }
            }
        }
        self.router.tally = Some(tally);
    }
}
