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

use super::cloud_org::Told;
use super::pump::Action;
use super::statement::{bind_param, ClientFrames, Exchange, Reported, Routed};
use super::switch::{Gate, WriteGate};
use crate::backend::at_login::TxDefaults;
use crate::org::OrgId;
use crate::route::analysis::{Analysis, Catalog, KeyOrg, Org};
use crate::route::meta::{CoreMeta, Placement};
use crate::route::names::{self, Names};
use crate::route::param::{param_cast, ValueType};
use crate::route::setting::may_change_transaction_defaults;
use lokadb_shared::wire::fields::Fields;
use lokadb_shared::wire::frontend::{self, Bind, Close, Message, Statement};
use lokadb_shared::wire::tags::*;
use lokadb_shared::wire::FrameError;
use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
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
    Direct(OrgId),
    /// This organization's database, a write: behind the cloud's gate ([`WriteGate`]).
    DirectWrite(OrgId),
    /// Nowhere yet: an unnamed Parse held until its Bind.
    Hold,
    /// Not decided until the cloud has answered what was sent before.
    Settle,
    /// Not decided until the cloud's key map has said whose key it is: this lookup.
    Lookup(String),
}

/// The longest key (bytes of its text) the proxy looks up; a longer one's statement goes
/// through the cloud.
const MAX_LOOKUP_KEY: usize = 1024;

/// The type a Parse message (whole) declared for parameter `$n`: 0 when it left it to the
/// server (or declared fewer); `None` for a malformed message.
fn declared_type(parse: &[u8], n: u16) -> Option<u32> {
    parsed(parse)?.param_type(n).ok()
}

/// A Parse message (whole), decoded; `None` when malformed.
fn parsed(parse: &[u8]) -> Option<Statement<'_>> {
    Statement::decode(FE_PARSE, parse.get(5..)?).ok()
}

/// Where a statement placed by a key goes ([`ClientFrames::key_org`]).
enum KeyDest {
    /// Ask the cloud's key map this first.
    Ask(String),
    /// The key is this organization's.
    Found(OrgId),
    /// Through the cloud: the key is no row's, or cannot be asked for here.
    Cloud,
}

/// A Bind's parameter `$n` as text that casts back to the same key of type `key_type`, read
/// by the type its Parse (`parse`) declared or, left to the server, the key's
/// ([`ValueType`]). `None` for NULL and any value not read with certainty (the statement
/// goes through the cloud).
fn key_param(
    bind: &Bind<'_>,
    n: u16,
    key_type: &str,
    parse: Option<&[u8]>,
) -> Result<Option<String>, FrameError> {
    let declared = parse.and_then(|p| declared_type(p, n));
    let ty = ValueType::resolve(declared, Some(ValueType::from_sql(key_type)));
    bind_param(bind, n, ty)
}

/// The analysis of `sql` in a session whose names are `names` ([`ClientFrames::analyze`]).
fn analyze_in(names: &Names, meta: &CoreMeta, sql: &str) -> Analysis {
    let analysis = meta.analyze(sql);
    if names.plain() || analysis == Analysis::NoLokaTable {
        return analysis;
    }
    if names.unsure(sql, &meta.meta.catalog) {
        return Analysis::Unplaced(names::UNSURE);
    }
    analysis
}

/// How the parameter naming the organization of a statement (`analysis`, parsed by the
/// Parse message `parse`, whole) is read: the type the Parse declared for it, else the
/// organization column's of its tables (when they agree), which the server infers.
pub(super) fn org_param_type(
    parse: &[u8],
    analysis: &Analysis,
    catalog: Option<&Catalog>,
) -> ValueType {
    let Analysis::Org {
        org: Org::Param(n),
        tables,
        ..
    } = analysis
    else {
        return ValueType::Other;
    };
    let mut types = tables
        .iter()
        .map(|&t| catalog.and_then(|c| c.org_type(t)).map(ValueType::from_sql));
    let column = match types.next().flatten() {
        Some(first) if types.all(|t| t == Some(first)) => Some(first),
        _ => None,
    };
    // A cast written after the parameter gives it its type, not the column.
    let cast = parsed(parse).and_then(|p| param_cast(p.sql, *n));
    ValueType::resolve(declared_type(parse, *n), cast.or(column))
}

/// A switch of destination the session is asked to make.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Want {
    Cloud,
    Direct(OrgId),
    /// The direct connection, with the gate open for this organization.
    DirectWrite(OrgId),
    /// No switch: only wait until the side in use has answered everything (its
    /// transaction status is then known).
    Settle,
    /// A transaction that has only read directly moves to the cloud: the direct one is
    /// rolled back (its answers dropped) and the cloud's begins with the held message.
    Migrate,
    /// No switch: ask the cloud this key-map lookup first (a statement placed by a key
    /// may go direct once its organization is known).
    Lookup(String),
    /// A transaction that wrote directly moves to the cloud: the direct one is rolled
    /// back and what it ran so far runs again on the cloud ([`super::replay`]).
    Replay,
}

/// A key-map lookup for the held statement (the direct path for statements placed by a
/// key, [`Want::Lookup`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Lookup {
    #[default]
    None,
    /// Sent to the cloud as a request of the proxy's own: its number.
    Asked(String, u64),
    /// The cloud answered: the key's organization (`None`: no row has the key, or the
    /// lookup failed; the statement goes through the cloud, which decides).
    Answered(String, Option<OrgId>),
}

/// A prepared statement as the client parsed it.
struct Prepared {
    /// Its Parse message, whole, to parse it again on the other side.
    parse: Box<[u8]>,
    /// For a statement limited to the session's organization: the client's own Parse, which
    /// the organization's database runs (its rows are all that organization's).
    direct_parse: Option<Box<[u8]>>,
    analysis: Analysis,
    /// How the parameter that names its organization is read (when one does).
    org_type: ValueType,
    /// Running it may change what the cloud holds of `lokadb.statement_org`
    /// ([`super::cloud_org`]).
    changes_setting: bool,
}

/// The most prepared statements a session's routing remembers; past it the map starts
/// over (a Bind of a forgotten statement goes to the cloud, which has it).
const MAX_PREPARED: usize = 1000;

/// How long a session sends an organization's statements through the cloud after its
/// database could not be reached directly.
pub const UNAVAILABLE_FOR: Duration = Duration::from_secs(5);

/// How long a session sends an organization's statements through the cloud after it found
/// every direct connection to it in use (`direct_max`), before it asks for one again.
pub const BUSY_FOR: Duration = Duration::from_secs(1);

/// What the client's role may do to the LokaDB tables (read, update), by schema and name,
/// and by index in the current catalog.
#[derive(Debug, Default)]
pub struct Privileges {
    by_name: HashMap<(String, String), (bool, bool)>,
    /// By catalog index: (read, update).
    indexed: Vec<(bool, bool)>,
}

impl Privileges {
    pub fn new(by_name: HashMap<(String, String), (bool, bool)>) -> Privileges {
        Privileges {
            by_name,
            indexed: Vec::new(),
        }
    }

    /// Re-indexes by a new generation's catalog.
    pub fn index(&mut self, catalog: &crate::route::analysis::Catalog) {
        self.indexed = catalog
            .tables()
            .iter()
            .map(|t| {
                self.by_name
                    .get(&(t.schema.clone(), t.name.clone()))
                    .copied()
                    .unwrap_or_default()
            })
            .collect();
    }

    /// Whether the role may update (and read) every table of `tables`.
    pub fn may_update(&self, tables: &[usize]) -> bool {
        tables
            .iter()
            .all(|&i| self.indexed.get(i).is_some_and(|p| p.0 && p.1))
    }

    /// Whether the role may read every table of `tables` (catalog indexes).
    pub fn may_read(&self, tables: &[usize]) -> bool {
        tables
            .iter()
            .all(|&i| self.indexed.get(i).is_some_and(|p| p.0))
    }
}

/// A session's routing state.
#[derive(Default)]
pub struct Router {
    /// The direct path is configured for this database (`direct` in its config).
    pub enabled: bool,
    /// What the client's role may do to the LokaDB tables.
    pub privileges: Privileges,
    /// Where client messages go now.
    pub target: Side,
    /// The organization of the session's direct connection.
    pub direct_org: Option<OrgId>,
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
    /// Statements parsed on the direct connection only (inside a direct transaction): a
    /// Bind on the cloud parses them there first.
    not_on_cloud: HashSet<String>,
    /// Organizations whose database could not be reached, until when.
    unavailable: HashMap<OrgId, Instant>,
    /// A plain BEGIN the proxy answered itself, sent ahead of the next statement to the
    /// side that statement goes to (so a transaction of direct reads costs no round trip
    /// for its BEGIN, and none to the cloud).
    held_begin: Option<Vec<u8>>,
    /// The session's transaction defaults as its cloud backend held them at login, which
    /// its direct login carries (`None`: not asked).
    pub tx_defaults: Option<TxDefaults>,
    /// The session ran something that may have changed them since
    /// ([`may_change_transaction_defaults`]): not known any more.
    tx_defaults_changed: bool,
    /// Set by the session before each step: the server → client stream is between
    /// messages with nothing unwritten, so the proxy may answer a message itself.
    pub down_ready: bool,
    /// What the proxy answers itself, for the session to put in the server → client
    /// stream right after this step.
    pub local_out: Vec<u8>,
    /// The gate of direct writes.
    pub gate: WriteGate,
    /// The direct side's error count when `on_direct` was last trusted.
    direct_errors_seen: u64,
    /// Reads placed by a key may ask the cloud for its organization (`direct_key_lookup`).
    pub key_lookup: bool,
    /// The key-map lookup of the held statement.
    pub lookup: Lookup,
    /// The session's organization (`SET lokadb.org`), which its statements are limited to.
    pub org: super::session_org::SessionOrg,
    /// What the cloud knows of the statements' organization ([`super::cloud_org`]).
    pub cloud_org: super::cloud_org::CloudOrg,
    /// What an unqualified name means in this session ([`crate::route::names`]).
    pub names: Names,
    /// [`Reported::path_changes`] as last followed.
    path_seen: u32,
    /// The open direct transaction, should it move to the cloud ([`super::replay`]).
    pub moving: super::replay::Moving,
    /// `route_log`: moves of transactions are logged too.
    pub route_log: bool,
    /// Per-organization figures, where something reads them ([`super::tally`]).
    pub tally: Option<super::tally::Tally>,
    /// The message just routed was refused by the proxy (for the tally).
    pub refused_now: bool,
}

impl Router {
    /// Follows the `search_path` the cloud reported, when it changed since last time.
    pub fn follow_path(&mut self, reported: &Reported) {
        if reported.path_changes != self.path_seen {
            self.path_seen = reported.path_changes;
            if let Some(path) = &reported.search_path {
                self.names.note_path(path);
            }
        }
    }

    /// Whether the cloud reports `search_path` (PostgreSQL 18+: it did at login).
    pub fn path_reported(&self) -> bool {
        self.path_seen != 0
    }

    /// A session's router; `enabled` when the database has the direct path configured.
    pub fn new(enabled: bool, privileges: Privileges) -> Router {
        Router {
            enabled,
            privileges,
            ..Router::default()
        }
    }

    /// Notes that `org`'s database could not be reached, or that every direct connection
    /// to it is in use: its statements go through the cloud for a while (which answers
    /// them, or fails them with the reason).
    pub fn mark_unavailable(&mut self, org: OrgId, for_: Duration) {
        self.unavailable.insert(org, Instant::now() + for_);
    }

    /// A new direct connection knows none of the client's statements.
    pub fn direct_replaced(&mut self) {
        self.on_direct.clear();
    }

    /// Whether the router holds a message of the client's (a held unnamed Parse). A held
    /// BEGIN is not one: nothing was sent for it, and nothing needs undoing.
    pub fn holds_message(&self) -> bool {
        self.held_parse.is_some()
    }

    /// Whether the client is in a transaction the proxy answered (a deferred BEGIN not sent
    /// yet) — a session to let finish at shutdown like one in a transaction.
    pub fn holds_begin(&self) -> bool {
        self.held_begin.is_some()
    }

    /// The session's transaction defaults, while the proxy knows them (their values at
    /// login, not changed since).
    pub fn known_tx_defaults(&self) -> Option<&TxDefaults> {
        self.tx_defaults
            .as_ref()
            .filter(|_| !self.tx_defaults_changed)
    }

    /// The session may have changed its transaction defaults (a statement that names them,
    /// a function call the proxy does not follow): from now on its transactions run on the
    /// cloud, and its writes go through it.
    pub fn tx_defaults_may_change(&mut self) {
        if !self.tx_defaults_changed && self.tx_defaults.is_some() {
            tracing::debug!("the session may have changed its transaction defaults; its transactions and writes go through the cloud");
        }
        self.tx_defaults_changed = true;
    }

    /// A BEGIN may be deferred and sent with the next statement, to either side: the
    /// session's transactions run at READ COMMITTED (a direct transaction that then needs
    /// the cloud moves there, which only READ COMMITTED hides: under REPEATABLE READ or
    /// SERIALIZABLE the cloud's snapshot would be a later one), as the proxy knows.
    fn defers_begin(&self) -> bool {
        self.known_tx_defaults()
            .is_some_and(TxDefaults::read_committed)
    }

    /// After [`Want::Migrate`]: the cloud's transaction begins with the next message.
    pub fn begin_on_next(&mut self) {
        let mut begin = Vec::new();
        frontend::query(&mut begin, "BEGIN");
        self.held_begin = Some(begin);
    }

    /// The analysis of a prepared statement (route_log of a Bind).
    pub fn prepared_analysis(&self, name: &str) -> Option<&Analysis> {
        self.prepared.get(name).map(|p| &p.analysis)
    }

    /// How prepared statement `name`'s organization parameter is read ([`org_param_type`]);
    /// not at all in binary when the statement is not remembered.
    pub(super) fn org_type(&self, name: &str) -> ValueType {
        self.prepared
            .get(name)
            .map_or(ValueType::Other, |p| p.org_type)
    }

    /// The value of organization `org` for a message: a literal's text, a parameter's value
    /// bound by the Bind whose remaining fields are `bind` (read as `ty`), the session's
    /// organization. `None`: not known here (a parameter without its Bind, NULL, a value not
    /// read with certainty, no session organization).
    pub(super) fn org_value<'a>(
        &'a self,
        org: &'a Org,
        bind: Option<&Bind<'_>>,
        ty: ValueType,
    ) -> Result<Option<Cow<'a, str>>, FrameError> {
        Ok(match (org, bind) {
            (Org::Literal(v), _) => Some(Cow::Borrowed(v)),
            (Org::Param(n), Some(b)) => bind_param(b, *n, ty)?.map(Cow::Owned),
            (Org::Param(_), None) => None,
            (Org::Session, _) => self.org.current.as_deref().map(Cow::Borrowed),
            // Known only once the cloud's key map is asked ([`Want::Lookup`]).
            (Org::Key(_), _) => None,
        })
    }

    /// A simple query of the proxy's own went to the cloud, which destroys its unnamed
    /// statement: a Bind of it there parses it again first.
    pub fn unnamed_gone_on_cloud(&mut self) {
        self.unnamed_on_cloud = false;
    }

    /// Forgets a closed statement.
    pub(super) fn forget(&mut self, name: &str) {
        self.prepared.remove(name);
        self.on_direct.remove(name);
        self.not_on_cloud.remove(name);
    }

    pub(super) fn remember(
        &mut self,
        name: &str,
        parse: &[u8],
        direct_parse: Option<&[u8]>,
        analysis: Analysis,
        org_type: ValueType,
    ) {
        if self.prepared.len() >= MAX_PREPARED {
            self.prepared.clear();
            self.on_direct.clear();
            self.not_on_cloud.clear();
        }
        self.on_direct.remove(name);
        self.prepared.insert(
            name.to_owned(),
            Prepared {
                parse: parse.into(),
                direct_parse: direct_parse.map(Into::into),
                analysis,
                org_type,
                changes_setting: false,
            },
        );
    }

    /// Marks a remembered statement as one whose run may change `lokadb.statement_org`.
    pub(super) fn mark_changes_setting(&mut self, name: &str) {
        if let Some(p) = self.prepared.get_mut(name) {
            p.changes_setting = true;
        }
    }

    /// Whether running a statement may change `lokadb.statement_org`: marked so, or no
    /// longer remembered.
    pub(super) fn changes_setting(&self, name: &str) -> bool {
        !matches!(self.prepared.get(name), Some(p) if !p.changes_setting)
    }
}

impl ClientFrames<'_> {
    /// The analysis of `sql` in this session: the core's, unless a temporary table or the
    /// session's search_path may make a name in it mean another table
    /// ([`crate::route::names`]): then not placed, and sent to the cloud as written.
    pub(super) fn analyze(&self, meta: &CoreMeta, sql: &str) -> Analysis {
        analyze_in(&self.router.names, meta, sql)
    }

    /// Where `sql` is placed in this session ([`CoreMeta::place`], as [`Self::analyze`]).
    pub(super) fn place(&self, meta: &CoreMeta, sql: &str) -> Placement {
        let placement = meta.place(sql);
        if self.router.names.plain() || placement == Placement::NoLokaTable {
            return placement;
        }
        if self.router.names.unsure(sql, &meta.meta.catalog) {
            return Placement::Unplaced;
        }
        placement
    }

    /// Whether the statement a Query, Parse or Bind runs ends or unwinds the transaction
    /// ([`unwinds_transaction`]).
    fn unwinds(&self, msg: Option<&Message<'_>>) -> bool {
        msg.and_then(|m| self.statement_text(m))
            .is_some_and(unwinds_transaction)
    }

    /// The SQL of the statement a message runs: a Query's, a Parse's, a Bind's prepared
    /// statement's.
    fn statement_text<'f>(&'f self, msg: &Message<'f>) -> Option<&'f str> {
        match msg {
            Message::Query(s) | Message::Parse(s) => Some(s.sql),
            Message::Bind(bind) => {
                parsed(&self.router.prepared.get(bind.statement)?.parse).map(|p| p.sql)
            }
            _ => None,
        }
    }

    /// Whether routing needs the whole frame of `tag`.
    pub(super) fn routing_wants_body(&self, tag: u8) -> bool {
        if !self.router.enabled {
            return false;
        }
        // A held Parse or BEGIN is forwarded together with whatever comes next.
        if self.router.held_parse.is_some() || self.router.held_begin.is_some() {
            return true;
        }
        // A direct transaction's log keeps what could run again on the cloud.
        if self.router.moving.log.is_some() && matches!(tag, FE_EXECUTE | FE_CLOSE | FE_BIND) {
            return true;
        }
        // While no organization takes the direct path and the session is on the cloud,
        // messages stream through unassembled (a statement parsed meanwhile is unknown to
        // the router later, and goes to the cloud, which has it).
        let active = self.router.target == Side::Direct
            || !self.router.gate.is_closed()
            || self.meta.is_some_and(|m| m.has_direct_orgs());
        active && matches!(tag, FE_QUERY | FE_PARSE | FE_BIND | FE_CLOSE | FE_DESCRIBE)
    }

    /// Routes one client message: where it goes (asking the session to switch first when
    /// that is elsewhere) and what is sent. Counts it on the exchange of the side it goes to.
    /// `direct_text`: the client's own message when `frame` is it limited to the session's
    /// organization — what the direct path sends.
    pub(super) fn route(
        &mut self,
        tag: u8,
        frame: Option<&[u8]>,
        routed: Option<&Routed<'_>>,
        direct_text: Option<&[u8]>,
    ) -> Action {
        let msg = routed.map(|r| &r.msg);
        // The transaction moved to the cloud answered differently there: the client's next
        // statement fails with 40001, in the failed transaction the proxy put in its place.
        if self.router.moving.differed && frame.is_some() && super::replay::fails_here(tag) {
            self.router.moving.differed = false;
            let portal = msg.and_then(Message::bind).map_or("", |b| b.portal);
            return self.refuse_here(
                tag,
                portal,
                super::replay::DIFFERED_CODE,
                super::replay::DIFFERED_MESSAGE,
                super::replay::DIFFERED_HINT,
            );
        }
        if let (Some(text), Some(m)) = (self.router.moving.opener_moved.take(), self.meta) {
            m.opener_moved(&text);
        }
        // The direct transaction ended: nothing of it can move any more.
        if self.router.moving.log.is_some()
            && self.router.held_begin.is_none()
            && self.exchanges.direct.is_settled()
            && self.exchanges.direct.status == TX_IDLE
        {
            self.router.moving.end();
            self.exchanges.direct.digest = None;
        }
        let cloud_frame = frame;
        // After an error on the direct side, what it has parsed is not known for sure (a
        // Parse skipped in a failed batch): statements are parsed again there before use.
        if self.exchanges.direct.errors != self.router.direct_errors_seen {
            self.router.direct_errors_seen = self.exchanges.direct.errors;
            self.router.on_direct.clear();
        }
        let mut dest = match (frame, routed) {
            (Some(frame), Some(routed)) if self.router.enabled => self
                .destination(frame, routed, direct_text.is_some())
                .unwrap_or(Dest::Cloud),
            // A malformed message goes to the cloud, which refuses it.
            (Some(_), None) if self.router.enabled => Dest::Cloud,
            _ => Dest::Current,
        };
        // A transaction whose opener moved to the cloud not long ago starts there.
        if self.router.held_begin.is_some()
            && matches!(dest, Dest::Direct(_) | Dest::DirectWrite(_))
        {
            let learned = self.meta.zip(msg.and_then(|m| self.statement_text(m)));
            if learned.is_some_and(|(m, text)| m.opens_on_cloud(text)) {
                dest = Dest::Cloud;
            }
        }
        if let (Some(frame), true) = (frame, self.router.enabled) {
            match self.transaction_step(tag, frame, msg, &dest) {
                TxStep::Go => {}
                TxStep::To(d) => dest = d,
                TxStep::Done(action) => return action,
            }
        }
        let current = self.router.target;
        let mid_batch = self.exchanges.get(current).unsynced;
        let same_direct = |org: &OrgId| {
            current == Side::Direct && self.router.direct_org.as_deref() == Some(&**org)
        };
        if dest == Dest::Settle {
            self.router.want = Some(Want::Settle);
            return Action::Hold;
        }
        if let Dest::Lookup(sql) = dest {
            if mid_batch {
                // The lookup is a request of its own: not inside the client's batch.
                dest = Dest::Cloud;
            } else {
                self.router.want = Some(Want::Lookup(sql));
                return Action::Hold;
            }
        }
        let gate_open = |org: &OrgId| self.router.gate.is_open_for(org);
        if let Dest::DirectWrite(org) = &dest {
            if same_direct(org) && gate_open(org) {
                self.router.gate.wrote = true;
                dest = Dest::Direct(org.clone());
            } else if !mid_batch {
                self.router.want = Some(Want::DirectWrite(org.clone()));
                return Action::Hold;
            } else if current == Side::Cloud {
                dest = Dest::Cloud;
            } else {
                return self.refuse_mixed(tag);
            }
        }
        let side = match &dest {
            Dest::Current | Dest::Hold => current,
            Dest::PreferCloud
                if current == Side::Cloud || mid_batch || self.direct_transaction() =>
            {
                current
            }
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
            Dest::DirectWrite(_) | Dest::Settle | Dest::Lookup(_) => {
                unreachable!("handled above")
            }
        };
        // The client's BEGIN, answered already, goes first (its own answers dropped).
        let begin = match (dest != Dest::Hold, frame.is_some()) {
            (true, true) => self.router.held_begin.take(),
            _ => None,
        };
        if begin.is_some() {
            let ex = self.exchanges.get_mut(side);
            ex.silence_next();
            count(ex, FE_QUERY);
            if side == Side::Cloud {
                self.router.unnamed_gone_on_cloud();
            } else {
                // A direct transaction: what it sends and gets is kept, should it have to
                // move to the cloud after writing.
                ex.digest = Some(super::replay::Digest::new(false));
                let opener = msg.and_then(|m| self.statement_text(m)).map(Box::from);
                self.router.moving.begin(opener);
            }
        }
        // The cloud learns the statement's organization ahead of it.
        let told = match msg {
            Some(msg) if side == Side::Cloud && dest != Dest::Hold => self.tell_cloud(tag, msg),
            _ => None,
        };
        let mut action = match (frame, routed) {
            (Some(frame), Some(routed)) if self.router.enabled => {
                match self.apply(frame, routed, direct_text, side, dest == Dest::Hold) {
                    Ok(a) => a,
                    Err(_) => Action::Forward,
                }
            }
            _ => Action::Forward,
        };
        // A statement limited to the session's organization goes to its database as the
        // client wrote it.
        let frame = match (side, direct_text) {
            (Side::Direct, Some(own)) => {
                if action == Action::Forward {
                    action = Action::Replace(own.to_vec());
                }
                Some(own)
            }
            _ => frame,
        };
        let ahead = match told {
            Some(Told::Ahead(bytes)) => Some(bytes),
            Some(Told::Prefix(text)) => {
                // The Query as it goes out (rewritten or not, after a held Parse it takes
                // along) with the proxy's statement in front of its text.
                let out = match &action {
                    Action::Replace(bytes) => bytes.as_slice(),
                    _ => frame.expect("a Query told"),
                };
                action = Action::Replace(prefixed(out, &text));
                None
            }
            None => None,
        };
        let prefix = match (begin, ahead) {
            (None, None) => None,
            (begin, ahead) => {
                let mut out = begin.unwrap_or_default();
                out.extend_from_slice(ahead.as_deref().unwrap_or_default());
                Some(out)
            }
        };
        if let (Some(mut out), Some(frame)) = (prefix, frame) {
            match action {
                Action::Replace(bytes) => out.extend_from_slice(&bytes),
                _ => out.extend_from_slice(frame),
            }
            action = Action::Replace(out);
        }
        if dest != Dest::Hold {
            if side == Side::Direct {
                if let Some(log) = &mut self.router.moving.log {
                    let parse = match (tag, cloud_frame) {
                        (FE_BIND, Some(f)) => Bind::decode(&f[5..])
                            .ok()
                            .and_then(|b| self.router.prepared.get(b.statement))
                            .map(|p| &*p.parse),
                        _ => None,
                    };
                    log.note(tag, cloud_frame, parse);
                }
            }
            let ex = self.exchanges.get_mut(side);
            count(ex, tag);
            match &action {
                Action::Replace(bytes) => ex.note_sent(bytes),
                _ => ex.note_sent_tag(tag),
            }
        }
        action
    }

    /// Transactions. A plain BEGIN while nothing is in flight is answered by the proxy and
    /// sent with the next statement, to that statement's side: a transaction whose
    /// statements are all direct reads of one organization runs in its database; one that
    /// starts on the cloud stays there. A direct transaction has only read (only plain
    /// reads go direct); when it needs the cloud it moves there ([`Want::Migrate`]): under
    /// READ COMMITTED each statement sees the data as of its own start anyway, and it holds
    /// no lock a reader needs. Its COMMIT, ROLLBACK and everything after an error go where
    /// it runs.
    fn transaction_step(
        &mut self,
        tag: u8,
        frame: &[u8],
        msg: Option<&Message<'_>>,
        dest: &Dest,
    ) -> TxStep {
        let statement = msg.and_then(Message::statement).copied();
        let sql = statement.filter(|s| s.name.is_none()).map(|s| s.sql);
        if !self.router.tx_defaults_changed {
            let text = statement.map(|s| s.sql);
            if text.is_some_and(may_change_transaction_defaults) {
                self.router.tx_defaults_may_change();
            }
        }
        let (ex, router) = (&*self.exchanges, &mut *self.router);
        if router.held_begin.is_some() {
            let Some(end) = sql.and_then(transaction_end) else {
                return TxStep::Go;
            };
            // BEGIN then COMMIT or ROLLBACK: nothing was sent, nothing is.
            if !router.down_ready {
                router.want = Some(Want::Settle);
                return TxStep::Done(Action::Hold);
            }
            router.held_begin = None;
            lokadb_shared::wire::backend::command_complete(&mut router.local_out, end);
            lokadb_shared::wire::backend::ready_for_query(&mut router.local_out, TX_IDLE);
            return TxStep::Done(Action::Replace(Vec::new()));
        }
        let begin = sql.is_some_and(is_plain_begin);
        if begin
            && router.defers_begin()
            && router.down_ready
            && router.gate.is_closed()
            && ex.cloud.idle_but_own()
            && ex.direct.idle_but_own()
            && self.meta.is_some_and(|m| m.has_direct_orgs())
        {
            router.held_begin = Some(frame.to_vec());
            lokadb_shared::wire::backend::command_complete(&mut router.local_out, "BEGIN");
            lokadb_shared::wire::backend::ready_for_query(&mut router.local_out, TX_IN_BLOCK);
            return TxStep::Done(Action::Replace(Vec::new()));
        }
        // Only statements open or take part in a transaction; the rest of a batch follows
        // its first message, and a batch's own rule applies while one is open.
        let statement = matches!(dest, Dest::Cloud | Dest::Direct(_) | Dest::DirectWrite(_));
        if router.target != Side::Direct || !statement {
            return TxStep::Go;
        }
        let org = router.direct_org.clone();
        // COMMIT, ROLLBACK, ROLLBACK TO and RELEASE go where the transaction (or the batch)
        // runs, in either protocol; a Bind with its statement's text. Looked at only where
        // it decides (not for the statements of an open batch or of the direct organization).
        if self.exchanges.direct.unsynced {
            return match org {
                Some(org) if self.unwinds(msg) => TxStep::To(Dest::Direct(org)),
                _ => TxStep::Go,
            };
        }
        let same_org =
            matches!(dest, Dest::Direct(o) | Dest::DirectWrite(o) if Some(o) == org.as_ref());
        if same_org {
            return TxStep::Go;
        }
        if !self.exchanges.direct.is_settled() {
            // Whether a direct transaction is open is known once its answers are in.
            self.router.want = Some(Want::Settle);
            return TxStep::Done(Action::Hold);
        }
        let Some(org) = org else {
            return TxStep::Go;
        };
        let unwinds = self.exchanges.direct.status != TX_IDLE && self.unwinds(msg);
        let (ex, router) = (&*self.exchanges, &mut *self.router);
        match ex.direct.status {
            TX_IDLE => TxStep::Go,
            // Its end (or what unwinds part of it) runs where it runs.
            _ if unwinds => TxStep::To(Dest::Direct(org)),
            // Failed: until it ends, every statement fails there with 25P02, as in Postgres.
            // Nothing else of the client's is sent: a statement the analysis placed in the
            // cloud must never run in the organization's database.
            TX_FAILED => TxStep::Done(self.aborted_on_direct(tag)),
            // It wrote in the organization's database: it moves to the cloud whole, what it
            // ran so far run again there ([`super::replay`]); one that cannot (COPY, past
            // the log's size) fails, clearly, as Postgres would fail it.
            _ if router.gate.wrote => {
                let movable = router.moving.movable() && router.gate.is_open();
                if movable {
                    router.want = Some(Want::Replay);
                    TxStep::Done(Action::Hold)
                } else {
                    TxStep::Done(self.refuse_in_transaction(tag, &org))
                }
            }
            _ => {
                router.want = Some(Want::Migrate);
                TxStep::Done(Action::Hold)
            }
        }
    }

    /// Where a whole message should go. `own`: the direct path would send the client's own
    /// text of a Query (the one routed is the proxy's rewrite of it).
    fn destination(
        &self,
        frame: &[u8],
        routed: &Routed<'_>,
        own: bool,
    ) -> Result<Dest, FrameError> {
        let body = &frame[5..];
        let held = self.router.held_parse.is_some();
        Ok(match &routed.msg {
            Message::Query(_) => match self.meta {
                Some(m) => {
                    let analysis = routed
                        .analysis(|sql| self.analyze(m, sql))
                        .expect("a Query");
                    self.direct_dest(analysis, None, own, None, ValueType::Other)?
                }
                None => Dest::Cloud,
            },
            Message::Parse(Statement { name, .. }) => {
                let name = name.unwrap_or_default();
                let may_run_direct = self.meta.is_some_and(|m| {
                    m.has_direct_orgs()
                        && matches!(
                            routed.analysis(|sql| self.analyze(m, sql)),
                            Some(
                                Analysis::Org { read: true, .. }
                                    | Analysis::Org { set: Some(_), .. }
                            )
                        )
                });
                if may_run_direct && self.direct_transaction() {
                    // Inside a direct transaction a statement that may run there is parsed
                    // there; where it runs is its Bind's to decide. Any other goes to the
                    // cloud (which moves the transaction, or refuses if it wrote). An
                    // unnamed one is held for its Bind, as outside transactions: parsed
                    // direct, it would begin a batch there that its own Bind for the cloud
                    // (another organization's value) could only be refused in.
                    if name.is_empty() {
                        Dest::Hold
                    } else {
                        Dest::Current
                    }
                } else if may_run_direct && name.is_empty() && self.cloud_is_idle() {
                    Dest::Hold
                } else {
                    Dest::Cloud
                }
            }
            Message::Bind(bind) => {
                let name = bind.statement;
                let prepared = if name.is_empty() && (held || !self.router.unnamed_on_cloud) {
                    // Held, or parsed on the direct side last: placed by its analysis.
                    self.router.prepared.get("")
                } else if name.is_empty() {
                    // The client's unnamed statement is on the cloud.
                    None
                } else {
                    self.router.prepared.get(name)
                };
                match prepared {
                    Some(p) => self.direct_dest(
                        &p.analysis,
                        Some(bind),
                        p.direct_parse.is_some(),
                        Some(&p.parse),
                        p.org_type,
                    )?,
                    None => Dest::Cloud,
                }
            }
            _ if held => Dest::Cloud,
            Message::Close(Close { kind: b'S', .. }) => Dest::PreferCloud,
            Message::Other(FE_DESCRIBE) if Fields::new(body, "message").u8()? == b'S' => {
                Dest::PreferCloud
            }
            Message::Other(FE_FUNCTION_CALL) => Dest::Cloud,
            _ => Dest::Current,
        })
    }

    /// Where a statement placed by `key` goes, as far as the key's organization is known:
    /// the lookup to ask the cloud first, or its answer for this very key.
    fn key_org(
        &self,
        key: &KeyOrg,
        bind: Option<&Bind<'_>>,
        parse: Option<&[u8]>,
    ) -> Result<KeyDest, FrameError> {
        let value = match (&key.key, bind) {
            (Org::Literal(v), _) => Cow::Borrowed(v.as_str()),
            (Org::Param(n), Some(b)) => match key_param(b, *n, &key.key_type, parse)? {
                Some(v) => Cow::Owned(v),
                None => return Ok(KeyDest::Cloud),
            },
            _ => return Ok(KeyDest::Cloud),
        };
        // Written into the proxy's own query as a string: only text every server reads
        // back the same (no backslash, whatever standard_conforming_strings says), and short
        // (a key is; the query goes out in one write).
        if value.len() > MAX_LOOKUP_KEY || value.contains(['\\', '\0']) {
            return Ok(KeyDest::Cloud);
        }
        let sql = format!(
            "SELECT lokadb_client.key_org('{}', CAST('{}' AS {}))",
            key.keymap.replace('\'', "''"),
            value.replace('\'', "''"),
            key.key_type,
        );
        Ok(match &self.router.lookup {
            Lookup::Answered(asked, org) if *asked == sql => match org {
                Some(org) => KeyDest::Found(org.clone()),
                None => KeyDest::Cloud,
            },
            _ => KeyDest::Ask(sql),
        })
    }

    /// A transaction is open on the direct connection (as of its last answer).
    fn direct_transaction(&self) -> bool {
        self.router.target == Side::Direct && self.exchanges.direct.status != TX_IDLE
    }

    /// The cloud is between requests and outside a transaction: nothing a statement on
    /// the direct side could fail to see.
    fn cloud_is_idle(&self) -> bool {
        let cloud = &self.exchanges.cloud;
        match self.router.gate.state {
            Gate::Closed => cloud.idle_but_own(),
            // The gate's transaction is the proxy's, not the client's.
            _ => !cloud.unsynced && cloud.pending as usize == cloud.silenced.len(),
        }
    }

    /// `Direct(org)` when `analysis` is a plain read of a direct organization (`bind`:
    /// the Bind's remaining fields, for an organization given as a parameter). `own`: the
    /// direct path sends the client's own text (the analysed one is the proxy's rewrite).
    fn direct_dest(
        &self,
        analysis: &Analysis,
        bind: Option<&Bind<'_>>,
        own: bool,
        parse: Option<&[u8]>,
        org_type: ValueType,
    ) -> Result<Dest, FrameError> {
        let Analysis::Org {
            org,
            read,
            tables,
            set,
            ..
        } = analysis
        else {
            return Ok(Dest::Cloud);
        };
        let Some(meta) = self.meta else {
            return Ok(Dest::Cloud);
        };
        let privileges = &self.router.privileges;
        // A write is a transaction of its own (or joins a direct one): it runs in the
        // organization's database with the transaction defaults of the direct login, which
        // are the session's only while the proxy knows them.
        let write = match (read, set) {
            (true, _) if privileges.may_read(tables) => false,
            (false, Some(columns))
                if privileges.may_update(tables)
                    && meta.meta.may_update(tables[0], columns)
                    && self.router.known_tx_defaults().is_some() =>
            {
                true
            }
            _ => return Ok(Dest::Cloud),
        };
        if !self.cloud_is_idle() {
            // The client sent on before the cloud's last answer was in: whether it is in
            // a transaction there is known once it is.
            let cloud = &self.exchanges.cloud;
            let busy = cloud.pending > 0 && !cloud.unsynced;
            return Ok(if busy { Dest::Settle } else { Dest::Cloud });
        }
        let value = match org {
            // Placed by a key (the key-map rewrite): a read goes direct once the cloud's key
            // map says the key is a direct organization's. Writes stay on the cloud: the
            // key's organization could change between the lookup and the write.
            // Not inside the gate's transaction (a direct transaction that wrote): a lookup
            // that fails would abort it.
            Org::Key(key)
                if !write
                    && own
                    && self.router.key_lookup
                    && self.router.gate.is_closed()
                    && meta.has_direct_orgs() =>
            {
                match self.key_org(key, bind, parse)? {
                    KeyDest::Ask(sql) => return Ok(Dest::Lookup(sql)),
                    KeyDest::Found(org) => Cow::Owned(org.to_string()),
                    KeyDest::Cloud => return Ok(Dest::Cloud),
                }
            }
            _ => match self.router.org_value(org, bind, org_type)? {
                Some(v) => v,
                None => return Ok(Dest::Cloud),
            },
        };
        if !meta.meta.orgs.get(&*value).is_some_and(|o| o.is_direct()) {
            return Ok(Dest::Cloud);
        }
        let org: OrgId = match self.router.direct_org.as_ref().filter(|o| ***o == *value) {
            Some(o) => o.clone(),
            None => OrgId::from(&*value),
        };
        let now = Instant::now();
        let refused = |m: &HashMap<OrgId, Instant>| m.get(&org).is_some_and(|t| now < *t);
        if refused(&self.router.unavailable) || (write && self.router.gate.refuses(&org, now)) {
            return Ok(Dest::Cloud);
        }
        Ok(if write {
            Dest::DirectWrite(org)
        } else {
            Dest::Direct(org)
        })
    }

    /// Sends a message to `side`, with what that side needs first.
    fn apply(
        &mut self,
        frame: &[u8],
        routed: &Routed<'_>,
        direct_frame: Option<&[u8]>,
        side: Side,
        hold: bool,
    ) -> Result<Action, FrameError> {
        let router = &mut *self.router;
        match routed.msg {
            Message::Parse(Statement { name, .. }) => {
                let name = name.unwrap_or_default();
                let analysis = match self.meta {
                    Some(m) => routed
                        .analysis(|sql| analyze_in(&router.names, m, sql))
                        .cloned()
                        .expect("a Parse"),
                    None => Analysis::Unplaced("no routing metadata"),
                };
                let org_type = org_param_type(frame, &analysis, self.meta.map(|m| &m.meta.catalog));
                router.remember(name, frame, direct_frame, analysis, org_type);
                if hold {
                    router.held_parse = Some(frame.to_vec());
                    return Ok(Action::Replace(Vec::new()));
                }
                if side == Side::Direct {
                    router.on_direct.insert(name.to_owned());
                    router.not_on_cloud.insert(name.to_owned());
                    if name.is_empty() {
                        router.unnamed_on_cloud = false;
                    }
                    // Closed first, so a Parse that fails leaves no older statement of that
                    // name behind to be run under the new one's analysis.
                    let mut out = Vec::with_capacity(frame.len() + 16);
                    frontend::close_statement(&mut out, name);
                    out.extend_from_slice(direct_frame.unwrap_or(frame));
                    self.exchanges.direct.drop_answers(1);
                    return Ok(Action::Replace(out));
                }
                router.not_on_cloud.remove(name);
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
            Message::Bind(Bind {
                statement: name, ..
            }) => {
                let mut out = Vec::new();
                if let Some(held) = router.held_parse.take() {
                    router.unnamed_on_cloud = side == Side::Cloud;
                    out = held;
                    if side == Side::Direct {
                        router.on_direct.insert(String::new());
                        if let Some(own) = router
                            .prepared
                            .get("")
                            .and_then(|p| p.direct_parse.as_deref())
                        {
                            out = own.to_vec();
                        }
                    }
                } else if side == Side::Direct && !router.on_direct.contains(name) {
                    let Some(p) = router.prepared.get(name) else {
                        return Ok(Action::Forward);
                    };
                    frontend::close_statement(&mut out, name);
                    out.extend_from_slice(p.direct_parse.as_deref().unwrap_or(&p.parse));
                    router.on_direct.insert(name.to_owned());
                    self.exchanges.direct.drop_answers(2);
                } else if side == Side::Cloud
                    && router.not_on_cloud.remove(name)
                    && !name.is_empty()
                {
                    // Parsed inside a direct transaction: the cloud needs it now.
                    if let Some(p) = router.prepared.get(name) {
                        frontend::close_statement(&mut out, name);
                        out.extend_from_slice(&p.parse);
                        self.exchanges.cloud.drop_answers(2);
                    }
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
            Message::Close(close) => {
                if close.kind == b'S' {
                    let name = close.name;
                    let only_direct = router.not_on_cloud.contains(name);
                    router.forget(name);
                    if side == Side::Direct && !only_direct {
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
        self.refuse_on_direct(tag, &message, hint)
    }

    /// A transaction that wrote in `org`'s database directly asks for the cloud (another
    /// organization, a cloud table, a write the cloud must check): refused, failing the
    /// transaction there.
    fn refuse_in_transaction(&mut self, tag: u8, org: &str) -> Action {
        let message = format!(
            "this transaction wrote directly in organization {org}'s database; this statement needs the cloud, and one transaction cannot span both"
        );
        let hint = "Roll back, and run the statement in a transaction of its own, or run the whole transaction through the cloud (start it with a statement the cloud runs, e.g. SELECT 1)";
        self.refuse_on_direct(tag, &message, hint)
    }

    /// In a failed direct transaction: the message is replaced by one the organization's
    /// database refuses with 25P02 (a failed transaction refuses everything but its end).
    fn aborted_on_direct(&mut self, tag: u8) -> Action {
        self.refuse_on_direct(
            tag,
            "current transaction is aborted, commands ignored until end of transaction block",
            "Roll back",
        )
    }

    /// Replaces a message with one that makes the side in use raise `message` when executed.
    fn refuse_on_direct(&mut self, tag: u8, message: &str, hint: &str) -> Action {
        self.refuse_here(tag, "", "0A000", message, hint)
    }

    /// Replaces a message (a Bind: of portal `portal`) with one that makes the side in use
    /// raise `code` and `message` when executed.
    pub(super) fn refuse_here(
        &mut self,
        tag: u8,
        portal: &str,
        code: &str,
        message: &str,
        hint: &str,
    ) -> Action {
        if self.route_log {
            tracing::info!(target: "lokadb::route", route = "refused", %message);
        }
        self.router.refused_now = true;
        let sql = super::statement::raise_sql(code, message, hint);
        let mut out = Vec::new();
        let side = self.router.target;
        // The batch fails whole; a held Parse of it is not sent anywhere, but the client
        // waits for its ParseComplete: the refusal's own Parse answers in its place.
        let held = self.router.held_parse.take().is_some();
        match tag {
            FE_QUERY | FE_FUNCTION_CALL => frontend::query(&mut out, &sql),
            FE_PARSE | FE_BIND => {
                // An unnamed statement raising at its Execute; a Bind of it replaces the
                // client's Bind (its ParseComplete is dropped, unless it answers the
                // client's held Parse).
                frontend::parse(&mut out, "", &sql);
                if tag == FE_BIND {
                    frontend::bind_portal_text(&mut out, portal, "", &[]);
                    if !held {
                        self.exchanges.get_mut(side).drop_answers(1);
                    }
                    self.router.on_direct.remove("");
                } else {
                    // The refusal is the unnamed statement now: the client's Binds of it
                    // run it, and one on the other side parses it there first (not the
                    // unnamed statement before it, whose answer the client would get).
                    let router = &mut *self.router;
                    router.remember("", &out, None, Analysis::NoLokaTable, ValueType::Other);
                    if side == Side::Direct {
                        router.on_direct.insert(String::new());
                    }
                    router.unnamed_on_cloud = side == Side::Cloud;
                }
            }
            // Close and Describe stay on the batch's side (`PreferCloud`): not refused.
            _ => return Action::Forward,
        }
        let ex = self.exchanges.get_mut(side);
        count(ex, tag);
        ex.note_sent(&out);
        Action::Replace(out)
    }
}

/// What [`ClientFrames::transaction_step`] decided.
enum TxStep {
    /// Route as usual.
    Go,
    /// Route to this destination instead.
    To(Dest),
    /// Done: this action.
    Done(Action),
}

/// `BEGIN`, `BEGIN WORK|TRANSACTION`, `START TRANSACTION`, with no options (an isolation
/// level or READ ONLY goes to the cloud as sent).
fn is_plain_begin(sql: &str) -> bool {
    let words: Vec<&str> = sql
        .trim()
        .trim_end_matches(';')
        .split_whitespace()
        .collect();
    match words.as_slice() {
        [w] => w.eq_ignore_ascii_case("begin"),
        [a, b] => {
            (a.eq_ignore_ascii_case("begin")
                && (b.eq_ignore_ascii_case("work") || b.eq_ignore_ascii_case("transaction")))
                || (a.eq_ignore_ascii_case("start") && b.eq_ignore_ascii_case("transaction"))
        }
        _ => false,
    }
}

/// Whether `sql` ends the transaction or unwinds part of it without starting anything:
/// a plain end ([`transaction_end`], also `AND NO CHAIN`), `ROLLBACK TO [SAVEPOINT] name`,
/// `RELEASE [SAVEPOINT] name`. In a direct transaction these run where it runs, in either
/// protocol: the organization's database answers them as the cloud would (a direct
/// transaction holds no savepoint: a `SAVEPOINT` moves it to the cloud, so these fail there
/// with 3B001 as they would in the cloud, or end it). Not `AND CHAIN`: the chained
/// transaction would carry on with the log of the one committed.
fn unwinds_transaction(sql: &str) -> bool {
    if transaction_end(sql).is_some() {
        return true;
    }
    let words: Vec<&str> = sql
        .trim()
        .trim_end_matches(';')
        .split_whitespace()
        .collect();
    let is = |w: &&str, k: &str| w.eq_ignore_ascii_case(k);
    let Some((verb, mut rest)) = words.split_first() else {
        return false;
    };
    let ends = ["commit", "end", "rollback", "abort"]
        .iter()
        .any(|k| is(verb, k));
    let rolls_back = is(verb, "rollback");
    if !ends && !is(verb, "release") {
        return false;
    }
    if ends {
        if let [w, tail @ ..] = rest {
            if is(w, "work") || is(w, "transaction") {
                rest = tail;
            }
        }
    }
    let name = |n: &&str| savepoint_name(n);
    match rest {
        [a, n, c] if ends && is(a, "and") => is(n, "no") && is(c, "chain"),
        [to, n] if rolls_back => is(to, "to") && name(n),
        [to, s, n] if rolls_back => is(to, "to") && is(s, "savepoint") && name(n),
        [n] => is(verb, "release") && name(n),
        [s, n] => is(verb, "release") && is(s, "savepoint") && name(n),
        _ => false,
    }
}

/// Whether `word` is one identifier, plain or quoted: nothing else may ride along with a
/// savepoint's name into the organization's database (`RELEASE a;DELETE …`).
fn savepoint_name(word: &str) -> bool {
    let plain = |w: &str| {
        w.starts_with(|c: char| c.is_alphabetic() || c == '_')
            && w.chars()
                .all(|c| c.is_alphanumeric() || c == '_' || c == '$')
    };
    match word.strip_prefix('"').and_then(|w| w.strip_suffix('"')) {
        Some(inner) => !inner.is_empty() && !inner.contains('"'),
        None => plain(word),
    }
}

/// The command tag of a plain transaction end: `COMMIT`/`END` → "COMMIT",
/// `ROLLBACK`/`ABORT` → "ROLLBACK" (optionally WORK or TRANSACTION; not AND CHAIN, not
/// TO SAVEPOINT, not PREPARED).
fn transaction_end(sql: &str) -> Option<&'static str> {
    let words: Vec<&str> = sql
        .trim()
        .trim_end_matches(';')
        .split_whitespace()
        .collect();
    let (verb, rest) = words.split_first()?;
    let plain = match rest {
        [] => true,
        [w] => w.eq_ignore_ascii_case("work") || w.eq_ignore_ascii_case("transaction"),
        _ => false,
    };
    if !plain {
        return None;
    }
    if verb.eq_ignore_ascii_case("commit") || verb.eq_ignore_ascii_case("end") {
        Some("COMMIT")
    } else if verb.eq_ignore_ascii_case("rollback") || verb.eq_ignore_ascii_case("abort") {
        Some("ROLLBACK")
    } else {
        None
    }
}

/// Counts a message forwarded to a side on that side's exchange.
pub(super) fn count(ex: &mut Exchange, tag: u8) {
    match tag {
        FE_QUERY | FE_FUNCTION_CALL => {
            ex.pending += 1;
            ex.unsynced = false;
            ex.syncs_after_execute = 0;
        }
        FE_SYNC => {
            ex.pending += 1;
            ex.unsynced = false;
            ex.syncs_after_execute += 1;
        }
        FE_EXECUTE => {
            ex.unsynced = true;
            ex.syncs_after_execute = 0;
        }
        // The end of a COPY FROM STDIN an Execute began: the backend ignored the Syncs sent
        // since (tokio-postgres sends one right after the Execute), and answers none.
        FE_COPY_DONE | FE_COPY_FAIL => {
            ex.pending = ex.pending.saturating_sub(ex.syncs_after_execute);
            ex.syncs_after_execute = 0;
        }
        // COPY data belongs to a request already counted; a Flush only asks for answers.
        FE_COPY_DATA | FE_FLUSH => {}
        _ => ex.unsynced = true,
    }
}

/// `bytes` (whole frames, ending with a Query) with `text` in front of the Query's text.
fn prefixed(bytes: &[u8], text: &str) -> Vec<u8> {
    let mut at = 0;
    while let Ok(Some(h)) = lokadb_shared::wire::Header::peek(&bytes[at..], u32::MAX) {
        let end = at + h.frame_len();
        if h.tag == FE_QUERY && end == bytes.len() {
            if let Ok(query) = Statement::decode(FE_QUERY, &bytes[at + 5..end]) {
                let mut out = bytes[..at].to_vec();
                out.extend_from_slice(&query.with_sql(&format!("{text}{}", query.sql)));
                return out;
            }
        }
        at = end;
    }
    // Not reached: what goes out for a Query ends with it (after a held Parse at most).
    tracing::error!("no Query to put the statement_org setting in front of");
    bytes.to_vec()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A Bind's key as text the cloud casts back to the same key: read by the declared type,
    /// else the key's; NULL and binary values of other types are not.
    #[test]
    fn a_bound_key_is_read_only_when_it_casts_back_the_same() {
        let bind = |format: i16, value: Option<&[u8]>| {
            let mut b = b"\0\0".to_vec(); // portal and statement names
            b.extend_from_slice(&1i16.to_be_bytes());
            b.extend_from_slice(&format.to_be_bytes());
            b.extend_from_slice(&1i16.to_be_bytes());
            match value {
                Some(v) => {
                    b.extend_from_slice(&(v.len() as i32).to_be_bytes());
                    b.extend_from_slice(v);
                }
                None => b.extend_from_slice(&(-1i32).to_be_bytes()),
            }
            b
        };
        // A Parse declaring `$1` of type `oid` (0: left to the server).
        let parse = |oid: u32| {
            let mut body = b"\0SELECT $1\0".to_vec();
            body.extend_from_slice(&1i16.to_be_bytes());
            body.extend_from_slice(&oid.to_be_bytes());
            let mut p = vec![FE_PARSE];
            p.extend_from_slice(&(body.len() as u32 + 4).to_be_bytes());
            p.extend_from_slice(&body);
            p
        };
        let key = |body: &[u8], ty: &str, oid: u32| {
            key_param(&Bind::decode(body).unwrap(), 1, ty, Some(&parse(oid))).unwrap()
        };
        let big = 42i64.to_be_bytes();
        assert_eq!(
            key(&bind(1, Some(&big)), "BIGINT", 0).as_deref(),
            Some("42")
        );
        assert_eq!(
            key(&bind(1, Some(&big)), "BIGINT", 20).as_deref(),
            Some("42")
        );
        let seven = 7i32.to_be_bytes();
        assert_eq!(
            key(&bind(1, Some(&seven)), "INTEGER", 23).as_deref(),
            Some("7")
        );
        assert_eq!(
            key(&bind(0, Some(b"abc")), "TEXT", 0).as_deref(),
            Some("abc")
        );
        assert_eq!(
            key(&bind(0, Some(b"42")), "BIGINT", 0).as_deref(),
            Some("42")
        );
        // Eight bytes of a float8 are not the integer they would read as.
        assert_eq!(
            key(&bind(1, Some(&1.5f64.to_be_bytes())), "BIGINT", 701),
            None
        );
        // A text key in binary is its text (not the int4 its four bytes would read as), a
        // uuid its canonical text.
        assert_eq!(
            key(&bind(1, Some(b"abcd")), "TEXT", 0).as_deref(),
            Some("abcd")
        );
        assert_eq!(
            key(&bind(1, Some(&[0xabu8; 16])), "UUID", 0).as_deref(),
            Some("abababab-abab-abab-abab-abababababab")
        );
        // A binary value of a type the key is not read: its bytes would mean something else.
        assert_eq!(key(&bind(1, Some(&seven)), "INTEGER", 1700), None);
        assert_eq!(key(&bind(0, None), "BIGINT", 0), None);
        assert_eq!(
            key_param(&Bind::decode(b"\0\0\0\0\0\0").unwrap(), 1, "BIGINT", None).unwrap(),
            None,
            "no such parameter"
        );
    }

    #[test]
    fn transaction_statements_are_told_apart() {
        for sql in [
            "BEGIN",
            "begin;",
            "  Begin Work ",
            "START TRANSACTION",
            "begin transaction;",
        ] {
            assert!(is_plain_begin(sql), "{sql}");
        }
        for sql in [
            "BEGIN ISOLATION LEVEL SERIALIZABLE",
            "BEGIN READ ONLY",
            "START TRANSACTION READ WRITE",
            "BEGIN; SELECT 1",
            "-- c\nBEGIN",
            "BEGINNING",
        ] {
            assert!(!is_plain_begin(sql), "{sql}");
        }
        assert_eq!(transaction_end("COMMIT"), Some("COMMIT"));
        assert_eq!(transaction_end("end transaction;"), Some("COMMIT"));
        assert_eq!(transaction_end("rollback work"), Some("ROLLBACK"));
        assert_eq!(transaction_end("ABORT"), Some("ROLLBACK"));
        for sql in [
            "COMMIT",
            "rollback work",
            "COMMIT AND NO CHAIN",
            "abort transaction and no chain;",
            "ROLLBACK TO a",
            "rollback to savepoint a",
            "ROLLBACK WORK TO SAVEPOINT \"b\"",
            "RELEASE a",
            "release savepoint a;",
        ] {
            assert!(unwinds_transaction(sql), "{sql}");
        }
        for sql in [
            "COMMIT AND CHAIN",
            "SAVEPOINT a",
            "RELEASE",
            "ROLLBACK TO",
            "COMMIT PREPARED 'x'",
            "ROLLBACK PREPARED 'x'",
            "RELEASE a;DELETE/**/FROM/**/documents",
            "ROLLBACK TO \"a\";DELETE\"",
            "ROLLBACK TO 1a",
            "SELECT 1",
            "",
        ] {
            assert!(!unwinds_transaction(sql), "{sql}");
        }
        for sql in [
            "ROLLBACK TO SAVEPOINT a",
            "COMMIT AND CHAIN",
            "COMMIT PREPARED 'x'",
            "SELECT 1",
        ] {
            assert_eq!(transaction_end(sql), None, "{sql}");
        }
    }
}
