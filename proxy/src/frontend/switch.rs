//! The switches of a session's target between the cloud and an organization's database,
//! with the gate of direct writes, key-map lookups and the move of a transaction that
//! wrote directly to the cloud — without I/O.
//!
//! The router asks for a switch ([`Want`]) and holds the client's message; once the side
//! in use has answered everything, the session calls [`switch`] until it says done. What a
//! switch sends of the proxy's own (the gate's `BEGIN`, a `ROLLBACK`, a lookup, the
//! replayed transaction) is queued in the side's [`Exchange`] outbox, which the session
//! writes before anything else of the client's; the one thing it cannot do itself, opening
//! a direct connection, it asks of a [`Link`]. So the same code runs in the session (real
//! sockets, `direct.rs`) and in the in-memory harness that tests it message by message
//! (`harness.rs`).

use super::replay::{Digest, Replay};
use super::router::{count, Exchanges, Lookup, Router, Side, Want};
use super::statement::Exchange;
use crate::backend::at_login::TxDefaults;
use crate::org::OrgId;
use lokadb_shared::wire::tags::{FE_QUERY, FE_SYNC, TX_IDLE};
use std::collections::HashMap;
use std::task::Poll;
use std::time::{Duration, Instant};

/// The cloud-side gate of direct writes: a transaction on the client's cloud backend that
/// passed `lokadb_client.direct_gate(org)` (the pause gate, and the organization still moved
/// with fdw+direct) and stays open until the organization's transaction ends, so a pause
/// waits for the write and the write waits for a pause.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Gate {
    #[default]
    Closed,
    /// Asked: the request number of the gate on the cloud.
    Opening(OrgId, u64),
    Open(OrgId),
}

/// How long direct writes of an organization go through the cloud after its gate refused
/// (a pause that timed out, a move back under way).
pub const GATE_REFUSED_FOR: Duration = Duration::from_secs(1);

/// The gate of direct writes of a session, and the organizations whose gate refused.
#[derive(Debug, Default)]
pub struct WriteGate {
    pub state: Gate,
    /// The direct transaction has written through it: it cannot move to the cloud but
    /// whole ([`super::replay`]).
    pub wrote: bool,
    /// Organizations whose gate refused, until when (their writes go through the cloud).
    refused: HashMap<OrgId, Instant>,
}

impl WriteGate {
    pub fn is_closed(&self) -> bool {
        self.state == Gate::Closed
    }

    pub fn is_open(&self) -> bool {
        matches!(self.state, Gate::Open(_))
    }

    pub fn is_open_for(&self, org: &str) -> bool {
        matches!(&self.state, Gate::Open(o) if **o == *org)
    }

    /// `org`'s gate refused: its writes go through the cloud for a while.
    fn refuse(&mut self, org: OrgId) {
        self.refused.insert(org, Instant::now() + GATE_REFUSED_FOR);
    }

    /// Whether `org`'s writes go through the cloud at `now`: its gate refused lately.
    pub fn refuses(&self, org: &str, now: Instant) -> bool {
        self.refused.get(org).is_some_and(|t| now < *t)
    }
}

/// A direct connection made ready for an organization ([`Link::ensure`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Opened {
    /// The session's connection was already this organization's, and current.
    Kept,
    /// Another one: its transaction status at login, and whether the session had it
    /// before under the same lease (what was parsed there then still is).
    New { status: u8, same_lease: bool },
}

/// Why no direct connection came.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OpenError {
    /// The organization's database could not be reached, or refused the login.
    Failed(String),
    /// `direct_max` connections to it are open, and none came free in time.
    Busy,
}

/// What a switch needs done that is I/O: the session's direct connection.
pub trait Link {
    /// Makes the session's direct connection `org`'s (opened with the session's current
    /// settings and still open), opening one or taking one from the pool when not; any
    /// other it held is given up. Pending while one is being opened.
    /// `idle`: nothing is in flight on the connection held now; `tx`: the session's
    /// transaction defaults at login, which a new connection logs in with.
    fn ensure(
        &mut self,
        org: &OrgId,
        idle: bool,
        tx: Option<&TxDefaults>,
    ) -> Poll<Result<Opened, OpenError>>;

    /// Cancel requests go to this side's backend from now on.
    fn retarget(&mut self, side: Side);

    /// A transaction that wrote directly began moving to the cloud (counted).
    fn transaction_moved(&mut self) {}
}

/// Makes the switch the router asks for, once the side in use has answered everything.
/// True when done (the held message may go); false while waiting (a direct connection
/// being opened, the gate of direct writes being asked or closed, what was queued not yet
/// written). A direct connection that cannot be opened marks the organization unavailable
/// for a while, a gate that refuses marks its writes so: the message, shown again, then
/// goes to the cloud.
pub fn switch(router: &mut Router, exchanges: &mut Exchanges, link: &mut impl Link) -> bool {
    let Some(mut want) = router.want.clone() else {
        return true;
    };
    if let Want::Lookup(sql) = &want {
        return lookup(router, &mut exchanges.cloud, sql);
    }
    if want == Want::Replay {
        return replay(router, exchanges, link);
    }
    // A transaction open on the direct connection keeps the session there: the message
    // is shown again, and the transaction rules decide (`Router`'s Migrate).
    let direct_transaction = router.target == Side::Direct && exchanges.direct.status != TX_IDLE;
    let same_org = |org: &OrgId| router.direct_org.as_deref() == Some(&**org);
    match &want {
        Want::Migrate => {}
        Want::Direct(org) | Want::DirectWrite(org) if direct_transaction && same_org(org) => {}
        _ if direct_transaction => want = Want::Settle,
        _ => {}
    }
    let (org, write) = match want {
        Want::Lookup(_) | Want::Replay => unreachable!("handled above"),
        Want::Settle => {
            router.want = None;
            return true;
        }
        Want::Cloud | Want::Migrate => {
            match router.gate.state {
                Gate::Closed => {}
                // Opened for a write that now goes to the cloud (the metadata changed
                // while it was asked): nothing went through it, so it is let go here.
                Gate::Open(_) if !router.gate.wrote => {
                    exchanges.cloud.send_own("ROLLBACK");
                    router.gate.state = Gate::Closed;
                }
                // Else it closes first ([`close_gate`], once the organization's
                // transaction ended).
                _ => return false,
            }
            if want == Want::Migrate {
                // The direct transaction has only read: rolled back (answers dropped),
                // and the cloud's begins with the held message.
                if router.direct_org.is_some() {
                    exchanges.direct.send_own("ROLLBACK");
                }
                router.begin_on_next();
                router.moving.end();
                exchanges.direct.digest = None;
            }
            router.target = Side::Cloud;
            router.want = None;
            link.retarget(Side::Cloud);
            return true;
        }
        Want::Direct(org) => (org, false),
        Want::DirectWrite(org) => (org, true),
    };
    match link.ensure(
        &org,
        exchanges.direct.is_idle(),
        router.tx_defaults.as_ref(),
    ) {
        Poll::Pending => {
            // Whatever connection the session had is given up for the one being opened.
            router.direct_org = None;
            return false;
        }
        Poll::Ready(Ok(Opened::Kept)) => {}
        Poll::Ready(Ok(Opened::New { status, same_lease })) => {
            exchanges.direct = Exchange {
                status,
                ..Exchange::default()
            };
            router.direct_org = Some(org.clone());
            if !same_lease {
                router.direct_replaced();
            }
        }
        Poll::Ready(Err(e)) => {
            router.direct_org = None;
            let for_ = match e {
                OpenError::Busy => {
                    tracing::debug!(org = %org, "every direct connection to this organization is in use (direct_max); its statements go through the cloud for {:?}", super::router::BUSY_FOR);
                    super::router::BUSY_FOR
                }
                OpenError::Failed(e) => {
                    tracing::warn!(org = %org, error = %e, "the direct path to this organization's database failed; its statements go through the cloud for {:?}", super::router::UNAVAILABLE_FOR);
                    super::router::UNAVAILABLE_FOR
                }
            };
            router.mark_unavailable(org, for_);
            // The message goes to the cloud.
            router.want = None;
            return true;
        }
    }
    if write {
        match router.gate.state.clone() {
            Gate::Open(o) if o == org => {}
            // Another organization's gate closes first ([`close_gate`]).
            Gate::Open(_) => return false,
            Gate::Closed => {
                let sql = format!(
                    "BEGIN; SELECT lokadb_client.direct_gate('{}')",
                    org.replace('\'', "''")
                );
                let request = exchanges.cloud.send_own(&sql);
                router.gate.state = Gate::Opening(org, request);
                return false;
            }
            Gate::Opening(o, request) => {
                if exchanges.cloud.answered <= request {
                    return false;
                }
                if exchanges.cloud.own_failed(request) {
                    // Paused past its timeout, moving back, or an old cloud schema: this
                    // write goes through the cloud, which decides.
                    tracing::info!(org = %o, "the gate of direct writes refused; the write goes through the cloud");
                    exchanges.cloud.send_own("ROLLBACK");
                    router.gate.state = Gate::Closed;
                    router.gate.refuse(o);
                    router.want = None;
                    return true;
                }
                router.gate.state = Gate::Open(o);
            }
        }
    }
    router.target = Side::Direct;
    router.want = None;
    link.retarget(Side::Direct);
    true
}

/// Closes the gate of direct writes once the organization's transaction ended (its
/// direct side is idle): the cloud's transaction that held it commits. True when it sent
/// something.
pub fn close_gate(router: &mut Router, exchanges: &mut Exchanges) -> bool {
    if router.gate.is_closed() || !exchanges.direct.is_idle() {
        return false;
    }
    router.gate.wrote = false;
    if !router.gate.is_open() {
        return false;
    }
    exchanges.cloud.send_own("COMMIT");
    router.gate.state = Gate::Closed;
    true
}

/// Moves a transaction that wrote directly to the cloud ([`super::replay`]): rolls the
/// direct one back, runs what the client sent in it again in the cloud transaction the
/// gate opened, and compares the answers. True once done: the held message then goes to
/// the cloud, or, when the answers differed, fails with 40001 in a failed transaction
/// the proxy begins in place of the client's.
fn replay(router: &mut Router, exchanges: &mut Exchanges, link: &mut impl Link) -> bool {
    loop {
        match std::mem::take(&mut router.moving.step) {
            Replay::None => {
                let (Some(_), true, Some(digest)) = (
                    router.direct_org.as_ref(),
                    router.moving.movable(),
                    exchanges.direct.digest.as_ref(),
                ) else {
                    // Checked when asked; nothing to move without them.
                    router.want = None;
                    return true;
                };
                let expected = digest.value();
                exchanges.direct.send_own("ROLLBACK");
                exchanges.direct.digest = None;
                let moving = &mut router.moving;
                moving.opener_moved = moving.opener.take();
                crate::failpoint::proxy("replay-rolled-back");
                let (bytes, requests) = moving.log.take().unwrap_or_default().take();
                // The gate's transaction on the cloud is the client's from now on.
                router.gate.state = Gate::Closed;
                router.gate.wrote = false;
                let ex = &mut exchanges.cloud;
                let until = ex.answered + u64::from(ex.pending) + u64::from(requests);
                for tag in super::statement::tags(&bytes) {
                    if matches!(tag, FE_QUERY | FE_SYNC) {
                        ex.silence_next();
                    }
                    count(ex, tag);
                    ex.note_sent_tag(tag);
                }
                ex.outbox.extend_from_slice(&bytes);
                ex.digest = Some(Digest::new(true));
                router.unnamed_gone_on_cloud();
                router.cloud_org.forget();
                link.retarget(Side::Cloud);
                tracing::debug!(org = ?router.direct_org, requests, "a transaction that wrote directly moves to the cloud");
                link.transaction_moved();
                router.moving.step = Replay::Sending { until, expected };
            }
            Replay::Sending { until, expected } => {
                if !exchanges.cloud.outbox.is_empty() {
                    router.moving.step = Replay::Sending { until, expected };
                    return false;
                }
                crate::failpoint::proxy("replay-sent");
                router.moving.step = Replay::Waiting { until, expected };
            }
            Replay::Waiting { until, expected } => {
                if exchanges.cloud.answered < until {
                    router.moving.step = Replay::Waiting { until, expected };
                    return false;
                }
                let got = exchanges.cloud.digest.take().map(|d| d.value());
                if got == Some(expected) {
                    crate::failpoint::proxy("replay-matched");
                    if router.route_log {
                        tracing::info!(target: "lokadb::route", route = "moved", org = router.direct_org.as_deref().unwrap_or("?"), "a transaction that wrote directly moved to the cloud");
                    }
                    router.target = Side::Cloud;
                    router.want = None;
                    return true;
                }
                // Always logged: the client gets an error the proxy made.
                tracing::info!(target: "lokadb::route", route = "moved", differed = true, org = router.direct_org.as_deref().unwrap_or("?"), "a transaction that wrote directly answered differently on the cloud: 40001");
                exchanges.cloud.send_own("ROLLBACK; BEGIN");
                router.unnamed_gone_on_cloud();
                router.moving.differed = true;
                router.target = Side::Cloud;
                router.want = None;
                return true;
            }
        }
    }
}

/// Asks the cloud's key map whose key the held statement's is (a request of the proxy's
/// own, its one value captured): true once answered, the answer in `router.lookup` for the
/// held message, shown again. A lookup that fails answers "none": the statement goes
/// through the cloud.
fn lookup(router: &mut Router, ex: &mut Exchange, sql: &str) -> bool {
    match &router.lookup {
        Lookup::Asked(asked, request) if asked == sql => {
            let request = *request;
            if ex.answered <= request {
                return false;
            }
            let org = match ex.capture.take() {
                Some((r, Some(value))) if r == request && !ex.own_failed(request) => {
                    value.map(OrgId::from)
                }
                // A failed lookup (a key that does not cast, the metadata behind): the
                // statement goes through the cloud, which answers or fails it.
                _ => None,
            };
            router.lookup = Lookup::Answered(sql.to_owned(), org);
            router.want = None;
            true
        }
        _ => {
            let request = ex.send_own(sql);
            ex.capture = Some((request, None));
            // A simple query destroys the cloud's unnamed statement.
            router.unnamed_gone_on_cloud();
            router.lookup = Lookup::Asked(sql.to_owned(), request);
            false
        }
    }
}

/// The session's direct connection is gone (closed by the organization's side while idle,
/// or given back to the pool): statements that follow go to the cloud unless one is held
/// for the direct side (`held`: it opens another). True when the target changed.
pub fn direct_gone(router: &mut Router, held: bool) -> bool {
    router.direct_org = None;
    if router.target == Side::Direct && !held {
        router.target = Side::Cloud;
        return true;
    }
    false
}
