//! The session's organization (`SET lokadb.org`, `docs/routing.md`): the proxy follows the
//! setting ([`crate::route::setting`]) and sends each statement on LokaDB tables limited to
//! that organization ([`crate::route::scope`]), or refuses it. The cloud holds the same
//! setting (the client's `SET` is forwarded), which the limited statements read there.

use super::pump::Action;
use super::statement::{refusal_frame, ClientFrames, Routed};
use crate::org::OrgId;
use crate::route::scope::{limit, Limited, Mark};
use crate::route::setting::{setting, Setting};
use lokadb_shared::wire::frontend::Bind;
use lokadb_shared::wire::tags::*;
use std::collections::HashMap;

/// The session's organization, and what named statements were limited to.
#[derive(Debug, Default)]
pub struct SessionOrg {
    /// The organization its statements are limited to now.
    pub current: Option<OrgId>,
    /// The one `RESET lokadb.org` and `RESET ALL` return to: the one the session's cloud
    /// backend held at login (its startup `options`', its role's or database's), if any.
    pub default: Option<OrgId>,
    /// The session has set or reset `lokadb.org`: Binds are checked against `marks`.
    pub ever_set: bool,
    /// Named statements on LokaDB tables: what they were limited to when parsed.
    pub marks: HashMap<String, Mark>,
}

impl SessionOrg {
    /// The session's organization is now `org` (`None`: none).
    pub fn set(&mut self, org: Option<OrgId>) {
        self.current = org;
        self.ever_set = true;
    }

    /// The session starts limited to `org` (its cloud backend's `lokadb.org` at login),
    /// which `RESET` returns to.
    pub fn start_in(&mut self, org: OrgId) {
        self.default = Some(org.clone());
        self.set(Some(org));
    }

    /// Notes what a named statement was limited to (`None`: it touches no LokaDB table).
    pub fn mark(&mut self, name: &str, mark: Option<Mark>) {
        match mark {
            // Not capped: the cloud holds each of these statements too, and a forgotten
            // mark would let one run unchecked. A Close forgets it.
            Some(m) => {
                self.marks.insert(name.to_owned(), m);
            }
            None => {
                self.marks.remove(name);
            }
        }
    }
}

/// What the session's organization makes of a Query or Parse.
pub(super) enum OrgStep {
    /// Send this message instead (the statement limited to the organization) to the cloud;
    /// the direct path sends the client's own.
    Scoped(Vec<u8>),
    /// Send this message instead: it raises the refusal when executed.
    Refused(Vec<u8>),
    /// Hold the message until everything sent before it is answered (whether the session
    /// is in a transaction is known then), and look at it again.
    Settle,
}

const HINT_SET: &str = "Send SET lokadb.org = '…' (or RESET lokadb.org) as a query of its own, outside a transaction block, once the answers to earlier queries are in";
const HINT_LIMIT: &str = "Name the organization in the statement (its organization column = the session's organization), or RESET lokadb.org to work across organizations";
const HINT_PREPARE: &str = "Prepare the statement again after changing lokadb.org (close it first), or keep lokadb.org for the connection's life";

impl ClientFrames<'_> {
    /// A Query or Parse: follows a change of the session's organization, and limits a
    /// statement to it. `None`: the message goes as written.
    pub(super) fn org_step(&mut self, tag: u8, routed: &Routed<'_>) -> Option<OrgStep> {
        let statement = routed.statement()?;
        let (name, sql) = (statement.name, statement.sql);
        let thorough = self.router.org.current.is_some() || self.router.org.default.is_some();
        if let Some(s) = setting(sql, thorough) {
            return self.follow(tag, name, s);
        }
        let meta = self.meta?;
        let org = self.router.org.current.clone();
        let named = name.is_some_and(|n| !n.is_empty());
        if org.is_none() && !named {
            return None;
        }
        let analysis = routed.analysis(|sql| self.analyze(meta, sql))?;
        let step = match org.as_deref().map(|o| limit(sql, analysis, meta, o)) {
            None | Some(Limited::AsWritten) => None,
            Some(Limited::Scoped(text)) => Some(OrgStep::Scoped(statement.with_sql(&text))),
            Some(Limited::Refused(code, message)) => Some(OrgStep::Refused(refusal_frame(
                name, code, &message, HINT_LIMIT,
            ))),
        };
        if let Some(name) = name.filter(|_| named) {
            // A refused statement raises wherever it runs: nothing to check at its Binds.
            let mark = match step {
                Some(OrgStep::Refused(_)) => None,
                Some(OrgStep::Scoped(_)) => Mark::of(analysis, true),
                _ => Mark::of(analysis, false),
            };
            self.router.org.mark(name, mark);
        }
        step
    }

    /// A statement that changes the session's organization: followed when the proxy knows
    /// it takes effect as sent, else refused (and not sent, so the cloud's setting and the
    /// proxy's stay the same).
    fn follow(&mut self, tag: u8, name: Option<&str>, s: Setting) -> Option<OrgStep> {
        let refuse = |message: &str| {
            Some(OrgStep::Refused(refusal_frame(
                name, "0A000", message, HINT_SET,
            )))
        };
        let idle = self.idle_outside_transaction();
        let default = self.router.org.default.clone();
        // What the session's organization becomes, when the statement takes effect.
        let target = match &s {
            Setting::To(org) => org.as_deref().map(OrgId::from),
            Setting::Default | Setting::ResetAll { .. } => default,
            Setting::Refused(_) => None,
        };
        match s {
            Setting::Refused(what) => refuse(&format!("{what} is not supported through LokaDB's proxy")),
            Setting::To(_) | Setting::Default if tag != FE_QUERY => {
                refuse("SET lokadb.org through the extended protocol is not supported")
            }
            Setting::To(Some(_)) if self.meta.is_none() => refuse(
                "the proxy has no LokaDB metadata for this database (auth_user), so it cannot limit statements to an organization",
            ),
            Setting::To(_) | Setting::Default | Setting::ResetAll { alone: true }
                if !idle && !self.exchanges.get(self.router.target).is_settled() =>
            {
                Some(OrgStep::Settle)
            }
            Setting::To(_) | Setting::Default if !idle => refuse(
                "SET lokadb.org inside a transaction block, or before the answers to earlier queries, is not supported",
            ),
            Setting::To(_) | Setting::Default => {
                self.router.org.set(target);
                None
            }
            Setting::ResetAll { .. } if self.router.org.current == target => None,
            Setting::ResetAll { alone: true } if tag == FE_QUERY && idle => {
                self.router.org.set(target);
                None
            }
            Setting::ResetAll { .. } => refuse(
                "RESET ALL or DISCARD ALL that changes lokadb.org is supported only as a query of its own, outside a transaction block",
            ),
        }
    }

    /// The session is outside any transaction with nothing in flight (a client's earlier
    /// requests, such as the Close of a statement it dropped, are waited for): a `SET` sent
    /// now takes effect, and before anything sent after it.
    fn idle_outside_transaction(&self) -> bool {
        self.exchanges.cloud.idle_but_own()
            && self.exchanges.direct.idle_but_own()
            && !self.router.holds_begin()
            && !self.router.holds_message()
            && self.router.gate.is_closed()
    }

    /// A Bind of a named statement prepared for another organization than the session's
    /// now: refused (the refusal raised at its Execute).
    pub(super) fn check_bind(&mut self, bind: &Bind<'_>) -> Option<Action> {
        if !self.router.org.ever_set {
            return None;
        }
        let (portal, name) = (bind.portal, bind.statement);
        // The unnamed statement never outlives a SET: its simple query destroys it.
        let mark = self.router.org.marks.get(name)?;
        let org = self.router.org.current.clone();
        let ty = self.router.org_type(name);
        let message = mark
            .allows(org.as_deref(), |n| {
                super::statement::bind_param(bind, n, ty).ok().flatten()
            })
            .err()?;
        let portal = portal.to_owned();
        Some(self.refuse_here(FE_BIND, &portal, "42501", &message, HINT_PREPARE))
    }
}
