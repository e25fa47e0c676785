//! Per-organization figures (`SHOW STATS`, `GET /metrics`): each Query and Bind naming an
//! organization is counted under it by the route it took (cloud, direct, refused by the
//! proxy), and its request's latency and errors with it. Kept only where something reads
//! them (`metrics` or `admin_users` set): the organization is read from the statement's
//! analysis, which routing already cached. Requests are timed here too, for the database's
//! latency histograms ([`DbStats`]).

use super::pump::Action;
use super::router::{Exchanges, Router, Side};
use super::statement::ClientFrames;
use crate::metrics::{DbStats, Route};
use lokadb_shared::wire::frontend::Statement;
use lokadb_shared::wire::tags::*;
use std::cell::RefCell;
use std::rc::Rc;
use std::time::Instant;

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
    /// When the proxy found requests in flight, and the direct side's answers then.
    since: Option<(Instant, u64)>,
}

impl Tally {
    pub fn new(stats: Rc<RefCell<DbStats>>) -> Tally {
        Tally {
            stats,
            org: String::new(),
            has_org: false,
            seen: String::new(),
            has_seen: false,
            since: None,
        }
    }

    /// The organization of the request in flight, if it named one.
    pub fn org(&self) -> Option<&str> {
        self.has_org.then_some(self.org.as_str())
    }

    /// Keeps the organization routing read for the message being routed (telling the
    /// cloud): counting it then costs no second analysis.
    pub fn remember(&mut self, org: &str) {
        self.seen.clear();
        self.seen.push_str(org);
        self.has_seen = true;
    }

    /// At a pause of the session: a request in flight starts its clock; one answered and
    /// written back to the client stops it (pipelined requests are timed together). Its
    /// latency and the errors since go to the database's figures and its organization's.
    fn follow(&mut self, ex: &Exchanges, classes: [Vec<([u8; 2], u64)>; 2], unwritten: bool) {
        let busy = ex.cloud.pending > 0 || ex.direct.pending > 0;
        let done = match self.since {
            None if busy => {
                self.since = Some((Instant::now(), ex.direct.answered));
                None
            }
            Some(start) if !busy && !unwritten => {
                self.since = None;
                Some(start)
            }
            _ => None,
        };
        if done.is_none() && classes.iter().all(Vec::is_empty) {
            return;
        }
        let mut db = self.stats.borrow_mut();
        let took = done.map(|(started, direct_answered)| {
            let us = u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX);
            (us, usize::from(ex.direct.answered != direct_answered))
        });
        if let Some((us, route)) = took {
            db.latency[route].record(us);
        }
        for (class, n) in classes.iter().flatten() {
            *db.errors.entry(*class).or_default() += n;
        }
        // The request's organization, kept until it is done.
        if !self.has_org {
            return;
        }
        self.has_org = done.is_none();
        let org = db.org(&self.org);
        if let Some((us, _)) = took {
            org.latency.record(us);
        }
        for (class, n) in classes.into_iter().flatten() {
            *org.errors.entry(class).or_default() += n;
        }
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

/// A session's pause: the errors its backends answered are taken (they are kept only
/// until then), and timed and counted where something reads them.
pub fn follow(router: &mut Router, ex: &mut Exchanges, unwritten: bool) {
    let classes = [&mut ex.cloud, &mut ex.direct].map(|e| std::mem::take(&mut e.error_classes));
    if let Some(t) = &mut router.tally {
        t.follow(ex, classes, unwritten);
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
                    Some(f) if tag == FE_PARSE => Statement::decode(tag, &f[5..])
                        .ok()
                        .and_then(|p| self.sql_org(p.sql))
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
