//! Where each client message goes: the cloud, or an organization's database directly
//! (the fdw+direct profile, `docs/routing.md`).
//!
//! The rule is that of the whole proxy: the cloud is always correct, so a message goes
//! direct only when the answer cannot differ. Today that is a *plain read* of one moved
//! fdw+direct organization's LokaDB tables (the analysis says `read`), outside any
//! transaction on the cloud. Everything else goes to the cloud.
//!
//! Messages keep their order: the destination changes only between requests, once the
//! side that was used has answered everything (the inspector answers [`Action::Hold`] and
//! the session switches). An extended-protocol batch (up to its Sync) stays on the side
//! where it began; a batch that began direct and then asks for the cloud is refused with
//! a clear error rather than split, since its messages form one implicit transaction.
//!
//! Prepared statements live on the cloud. The first Bind of one on the direct side
//! re-parses it there first (Close + Parse, their answers dropped); an unnamed Parse that
//! may go direct is held until its Bind says where.

use super::pump::Action;
use super::statement::{bind_param, ClientFrames, Exchange};
use crate::route::analysis::{Analysis, Org};
use lokadb_shared::wire::fields::Fields;
use lokadb_shared::wire::frontend;
use lokadb_shared::wire::tags::*;
use lokadb_shared::wire::FrameError;
use std::collections::{HashMap, HashSet};
use std::rc::Rc;
use std::time::{Duration, Instant};

/// A backend of the session.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Side {
    /// The cloud database.
    #[default]
    Cloud,
    /// The organization's database, through the relay.
    Direct,
}

/// The request/response state of both backends.
#[derive(Debug, Default)]
pub struct Exchanges {
    pub cloud: Exchange,
    pub direct: Exchange,
}

impl Exchanges {
    pub fn get(&self, side: Side) -> &Exchange {
        match side {
            Side::Cloud => &self.cloud,
            Side::Direct => &self.direct,
        }
    }

    pub fn get_mut(&mut self, side: Side) -> &mut Exchange {
        match side {
            Side::Cloud => &mut self.cloud,
            Side::Direct => &mut self.direct,
        }
    }
}

/// Where a message should go.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Dest {
    /// Wherever the session sends now (the rest of a batch).
    Current,
    /// The cloud, unless a batch on the other side is open (Close and Describe of a
    /// statement: harmless on either side).
    PreferCloud,
    /// The cloud.
    Cloud,
    /// This organization's database.
    Direct(Rc<str>),
    /// Nowhere yet: an unnamed Parse held until its Bind.
    Hold,
}

/// A switch of destination the session is asked to make.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Want {
    Cloud,
    Direct(Rc<str>),
}

/// A prepared statement as the client parsed it.
struct Prepared {
    /// Its Parse message, whole, to parse it again on the other side.
    parse: Box<[u8]>,
    analysis: Analysis,
}

/// The most prepared statements a session's routing remembers; past it the map starts
/// over (a Bind of a forgotten statement goes to the cloud, which has it).
const MAX_PREPARED: usize = 1000;

/// How long a session sends an organization's statements through the cloud after its
/// database could not be reached directly.
pub const UNAVAILABLE_FOR: Duration = Duration::from_secs(5);

/// A session's routing state.
#[derive(Default)]
pub struct Router {
    /// The direct path is configured for this database (`direct` in its config).
    pub enabled: bool,
    /// Where client messages go now.
    pub target: Side,
    /// The organization of the session's direct connection.
    pub direct_org: Option<Rc<str>>,
    /// A switch the inspector asked for, with the held message waiting on it.
    pub want: Option<Want>,
    prepared: HashMap<String, Prepared>,
    /// An unnamed Parse not forwarded yet (its Bind decides the side).
    held_parse: Option<Vec<u8>>,
    /// Statements parsed on the direct connection as the client last defined them.
    on_direct: HashSet<String>,
    /// The cloud's unnamed statement is the client's last one.
    unnamed_on_cloud: bool,
    /// Statements the client closed while a batch ran direct: the cloud still has them.
    close_on_cloud: HashSet<String>,
    /// Organizations whose database could not be reached, until when.
    unavailable: HashMap<Rc<str>, Instant>,
}

impl Router {
    /// A session's router; `enabled` when the database has the direct path configured.
    pub fn new(enabled: bool) -> Router {
        Router {
            enabled,
            ..Router::default()
        }
    }

    /// Notes that `org`'s database could not be reached: its statements go through the
    /// cloud for a while (which answers them, or fails them with the reason).
    pub fn mark_unavailable(&mut self, org: Rc<str>) {
        self.unavailable
            .insert(org, Instant::now() + UNAVAILABLE_FOR);
    }

    /// A new direct connection knows none of the client's statements.
    pub fn direct_replaced(&mut self) {
        self.on_direct.clear();
    }

    /// Whether the router holds a message of the client's (a held unnamed Parse).
    pub fn holds_message(&self) -> bool {
        self.held_parse.is_some()
    }

    /// The analysis of a prepared statement (route_log of a Bind).
    pub fn prepared_analysis(&self, name: &str) -> Option<&Analysis> {
        self.prepared.get(name).map(|p| &p.analysis)
    }

    /// Forgets a closed statement.
    pub(super) fn forget(&mut self, name: &str) {
        self.prepared.remove(name);
        self.on_direct.remove(name);
    }

    pub(super) fn remember(&mut self, name: &str, parse: &[u8], analysis: Analysis) {
        if self.prepared.len() >= MAX_PREPARED {
            self.prepared.clear();
            self.on_direct.clear();
        }
        self.on_direct.remove(name);
        self.prepared.insert(
            name.to_owned(),
            Prepared {
                parse: parse.into(),
                analysis,
            },
        );
    }
}

impl ClientFrames<'_> {
    /// Whether routing needs the whole frame of `tag`.
    pub(super) fn routing_wants_body(&self, tag: u8) -> bool {
        if !self.router.enabled {
            return false;
        }
        // A held Parse is forwarded together with whatever comes next.
        self.router.held_parse.is_some()
            || matches!(tag, FE_QUERY | FE_PARSE | FE_BIND | FE_CLOSE | FE_DESCRIBE)
    }

    /// Routes one client message: where it goes (asking the session to switch first when
    /// that is elsewhere) and what is sent. Counts it on the exchange of the side it goes to.
    pub(super) fn route(&mut self, tag: u8, frame: Option<&[u8]>) -> Action {
        let dest = match frame {
            Some(frame) if self.router.enabled => {
                // A malformed message goes to the cloud, which refuses it.
                self.destination(tag, frame).unwrap_or(Dest::Cloud)
            }
            _ => Dest::Current,
        };
        let current = self.router.target;
        let mid_batch = self.exchanges.get(current).unsynced;
        let same_direct = |org: &Rc<str>| {
            current == Side::Direct && self.router.direct_org.as_deref() == Some(&**org)
        };
        let side = match &dest {
            Dest::Current | Dest::Hold => current,
            Dest::PreferCloud if current == Side::Cloud || mid_batch => current,
            Dest::Cloud if current == Side::Cloud => Side::Cloud,
            Dest::Direct(org) if same_direct(org) => Side::Direct,
            // A batch begun on the cloud stays there: the cloud answers everything.
            Dest::Direct(_) if mid_batch && current == Side::Cloud => Side::Cloud,
            Dest::Cloud | Dest::Direct(_) | Dest::PreferCloud if mid_batch => {
                return self.refuse_mixed(tag);
            }
            Dest::Direct(org) => {
                self.router.want = Some(Want::Direct(org.clone()));
                return Action::Hold;
            }
            Dest::Cloud | Dest::PreferCloud => {
                self.router.want = Some(Want::Cloud);
                return Action::Hold;
            }
        };
        let action = match frame {
            Some(frame) if self.router.enabled => {
                match self.apply(tag, frame, side, dest == Dest::Hold) {
                    Ok(a) => a,
                    Err(_) => Action::Forward,
                }
            }
            _ => Action::Forward,
        };
        if dest != Dest::Hold {
            count(self.exchanges.get_mut(side), tag);
        }
        action
    }

    /// Where a whole message should go.
    fn destination(&self, tag: u8, frame: &[u8]) -> Result<Dest, FrameError> {
        let mut f = Fields::new(&frame[5..], "message");
        let held = self.router.held_parse.is_some();
        Ok(match tag {
            FE_QUERY => {
                let sql = f.cstr()?;
                match self.meta {
                    Some(m) => self.direct_dest(&m.analyze(sql), None)?,
                    None => Dest::Cloud,
                }
            }
            FE_PARSE => {
                let name = f.cstr()?;
                let sql = f.cstr()?;
                let may_go_direct = name.is_empty()
                    && self.cloud_is_idle()
                    && self.meta.is_some_and(|m| {
                        m.has_direct_orgs()
                            && matches!(m.analyze(sql), Analysis::Org { read: true, .. })
                    });
                if may_go_direct {
                    Dest::Hold
                } else {
                    Dest::Cloud
                }
            }
            FE_BIND => {
                let _portal = f.cstr()?;
                let name = f.cstr()?;
                let analysis = if name.is_empty() && held {
                    self.router.prepared.get("").map(|p| &p.analysis)
                } else if name.is_empty() {
                    // The client's unnamed statement is on the cloud (or re-parsed there).
                    None
                } else {
                    self.router.prepared.get(name).map(|p| &p.analysis)
                };
                match analysis {
                    Some(a) => self.direct_dest(a, Some(&mut f))?,
                    None => Dest::Cloud,
                }
            }
            _ if held => Dest::Cloud,
            FE_CLOSE | FE_DESCRIBE if f.u8()? == b'S' => Dest::PreferCloud,
            FE_FUNCTION_CALL => Dest::Cloud,
            _ => Dest::Current,
        })
    }

    /// The cloud is between requests and outside a transaction: nothing a statement on
    /// the direct side could fail to see.
    fn cloud_is_idle(&self) -> bool {
        self.exchanges.cloud.is_idle()
    }

    /// `Direct(org)` when `analysis` is a plain read of a direct organization (`bind`:
    /// the Bind's remaining fields, for an organization given as a parameter).
    fn direct_dest(
        &self,
        analysis: &Analysis,
        bind: Option<&mut Fields<'_>>,
    ) -> Result<Dest, FrameError> {
        let Analysis::Org {
            org, read: true, ..
        } = analysis
        else {
            return Ok(Dest::Cloud);
        };
        if !self.cloud_is_idle() {
            return Ok(Dest::Cloud);
        }
        let value = match (org, bind) {
            (Org::Literal(v), _) => std::borrow::Cow::Borrowed(v.as_str()),
            (Org::Param(n), Some(f)) => std::borrow::Cow::Owned(bind_param(f, *n)?),
            (Org::Param(_), None) => return Ok(Dest::Cloud),
        };
        let Some(meta) = self.meta else {
            return Ok(Dest::Cloud);
        };
        if !meta.meta.orgs.get(&*value).is_some_and(|o| o.is_direct()) {
            return Ok(Dest::Cloud);
        }
        if let Some(org) = self.router.direct_org.as_ref().filter(|o| ***o == *value) {
            return Ok(Dest::Direct(org.clone()));
        }
        let org: Rc<str> = Rc::from(&*value);
        if self
            .router
            .unavailable
            .get(&org)
            .is_some_and(|until| Instant::now() < *until)
        {
            return Ok(Dest::Cloud);
        }
        Ok(Dest::Direct(org))
    }

    /// Sends a message to `side`, with what that side needs first.
    fn apply(
        &mut self,
        tag: u8,
        frame: &[u8],
        side: Side,
        hold: bool,
    ) -> Result<Action, FrameError> {
        let mut f = Fields::new(&frame[5..], "message");
        let router = &mut *self.router;
        match tag {
            FE_PARSE => {
                let name = f.cstr()?;
                let sql = f.cstr()?;
                let analysis = match self.meta {
                    Some(m) => m.analyze(sql),
                    None => Analysis::Unplaced("no routing metadata"),
                };
                router.remember(name, frame, analysis);
                if hold {
                    router.held_parse = Some(frame.to_vec());
                    return Ok(Action::Replace(Vec::new()));
                }
                if side == Side::Cloud {
                    if name.is_empty() {
                        router.unnamed_on_cloud = true;
                    }
                    if router.close_on_cloud.remove(name) {
                        let mut out = Vec::with_capacity(frame.len() + 16);
                        frontend::close_statement(&mut out, name);
                        out.extend_from_slice(frame);
                        self.exchanges.cloud.drop_answers(1);
                        return Ok(Action::Replace(out));
                    }
                }
                Ok(Action::Forward)
            }
            FE_BIND => {
                let _portal = f.cstr()?;
                let name = f.cstr()?;
                let mut out = Vec::new();
                if let Some(held) = router.held_parse.take() {
                    if side == Side::Cloud {
                        router.unnamed_on_cloud = true;
                    }
                    out = held;
                } else if side == Side::Direct && !router.on_direct.contains(name) {
                    let Some(p) = router.prepared.get(name) else {
                        return Ok(Action::Forward);
                    };
                    frontend::close_statement(&mut out, name);
                    out.extend_from_slice(&p.parse);
                    router.on_direct.insert(name.to_owned());
                    self.exchanges.direct.drop_answers(2);
                } else if side == Side::Cloud && name.is_empty() && !router.unnamed_on_cloud {
                    // The last unnamed Parse ran direct: the cloud needs it again.
                    if let Some(p) = router.prepared.get("") {
                        out.extend_from_slice(&p.parse);
                        self.exchanges.cloud.drop_answers(1);
                    }
                    router.unnamed_on_cloud = true;
                }
                if out.is_empty() {
                    return Ok(Action::Forward);
                }
                out.extend_from_slice(frame);
                Ok(Action::Replace(out))
            }
            FE_CLOSE => {
                if f.u8()? == b'S' {
                    let name = f.cstr()?;
                    router.prepared.remove(name);
                    router.on_direct.remove(name);
                    if side == Side::Direct {
                        router.close_on_cloud.insert(name.to_owned());
                    }
                }
                Ok(Action::Forward)
            }
            _ => {
                // What follows a held Parse takes it along (to the cloud).
                match router.held_parse.take() {
                    Some(mut out) => {
                        router.unnamed_on_cloud = true;
                        out.extend_from_slice(frame);
                        Ok(Action::Replace(out))
                    }
                    None => Ok(Action::Forward),
                }
            }
        }
    }

    /// A batch begun direct asks for the cloud: the message becomes one that makes the
    /// organization's database raise a clear error (when the client executes it), so the
    /// batch fails whole, as a batch does, instead of being split across two databases.
    fn refuse_mixed(&mut self, tag: u8) -> Action {
        let org = self.router.direct_org.as_deref().unwrap_or("?");
        let message = format!(
            "this pipeline mixes a statement that ran directly in organization {org}'s database with one for the cloud before a Sync"
        );
        let hint = "Send a Sync between them (end the batch), or run them in a transaction";
        let sql = super::statement::raise_sql("0A000", &message, hint);
        let mut out = Vec::new();
        let side = self.router.target;
        // The batch fails whole; a held Parse of it is not sent anywhere.
        self.router.held_parse = None;
        match tag {
            FE_QUERY | FE_FUNCTION_CALL => frontend::query(&mut out, &sql),
            FE_PARSE | FE_BIND => {
                // An unnamed statement raising at its Execute; a Bind of it replaces the
                // client's Bind (its ParseComplete is dropped).
                frontend::parse(&mut out, "", &sql);
                if tag == FE_BIND {
                    frontend::bind_text(&mut out, "", &[]);
                    self.exchanges.get_mut(side).drop_answers(1);
                }
                self.router.on_direct.remove("");
            }
            // Close and Describe stay on the batch's side (`PreferCloud`): not refused.
            _ => return Action::Forward,
        }
        count(self.exchanges.get_mut(side), tag);
        Action::Replace(out)
    }
}

/// Counts a message forwarded to a side on that side's exchange.
fn count(ex: &mut Exchange, tag: u8) {
    match tag {
        FE_QUERY | FE_SYNC | FE_FUNCTION_CALL => {
            ex.pending += 1;
            ex.unsynced = false;
        }
        // COPY data belongs to a request already counted.
        FE_COPY_DATA | FE_COPY_DONE | FE_COPY_FAIL => {}
        _ => ex.unsynced = true,
    }
}
