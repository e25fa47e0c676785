//! The one point every client statement passes before it is forwarded.
//!
//! Today every statement goes to the cloud; statement routing plugs in here, where
//! the frame is whole (Query, Parse, Bind) and nothing has been sent yet. With `route_log`
//! the analysis already runs here and is logged. The tracker that
//! knows whether the backend is between requests also lives here, because it sees
//! every frame of both directions.

use super::pump::{Action, Inspect};
use super::refusal::plain_refusal;
pub(super) use super::refusal::{raise_sql, refusal_frame};
use super::replay::Digest;
use super::router::{Exchanges, Lookup, Router, Side};
use super::session_org::OrgStep;
use crate::record::{Kind, Recorder};
use crate::route::analysis::{copy_out_of_loka_table, mentions, Analysis, Org};
use crate::route::meta::CoreMeta;
use crate::route::param::ValueType;
use crate::route::rewrite::quote_ident;
use lokadb_shared::wire::fields::Fields;
use lokadb_shared::wire::frontend::{Bind, Close, Message, Param, Statement};
use lokadb_shared::wire::tags::*;
use lokadb_shared::wire::FrameError;
use lokadb_shared::wire::Header;

/// What the session knows about its backend's request/response state.
#[derive(Debug, Clone)]
pub struct Exchange {
    /// Requests (Query, Sync, FunctionCall) sent whose ReadyForQuery has not come back.
    pub pending: u32,
    /// Extended-protocol messages sent since the last Sync: the backend holds state
    /// that only a Sync settles.
    pub unsynced: bool,
    /// Transaction status of the last ReadyForQuery.
    pub status: u8,
    /// The client sent Terminate.
    pub terminated: bool,
    /// ReadyForQuery messages received.
    pub answered: u64,
    /// Answers to messages the proxy added (ParseComplete, CloseComplete of a statement
    /// re-parsed on this side) to drop: (the request they belong to, counted as
    /// [`Exchange::answered`] when its answers begin; how many), oldest first.
    pub dropping: std::collections::VecDeque<(u64, u32)>,
    /// Requests the proxy added whose answers are all dropped (a deferred BEGIN, the
    /// ROLLBACK of a transaction that moved to the cloud), by request number.
    pub silenced: std::collections::VecDeque<u64>,
    /// The last few requests of the proxy's own that failed (their numbers), for the
    /// gate of direct writes, `lokadb.statement_org` and key-map lookups: one failing does
    /// not hide another's failure.
    pub silenced_failed: std::collections::VecDeque<u64>,
    /// With transaction pooling: the process IDs notifications name.
    pub notify: Option<NotifyPids>,
    /// ErrorResponses received.
    pub errors: u64,
    /// ErrorResponses by SQLSTATE class (its first two characters) since the session last
    /// handed them to its core ([`crate::metrics::DbStats`]).
    pub error_classes: Vec<([u8; 2], u64)>,
    /// The errors answered since the session last logged them (at most [`ERRORS_LOGGED`]).
    pub error_notes: Vec<ErrorNote>,
    /// The backend said why it ends (a FATAL error reached the client): its end needs no
    /// message of the proxy's.
    pub ended_with_fatal: bool,
    /// Syncs sent since the last Execute: ignored by the backend if that Execute began a
    /// COPY FROM STDIN.
    pub syncs_after_execute: u32,
    /// Messages sent since the last Sync that each end with one answer of their own
    /// ([`ends_answer`]): Parse, Bind, Close, Describe, Execute (the client's and the
    /// proxy's).
    pub sent_in_batch: u32,
    /// Binds among them: a portal bound in the batch may be executed later in it.
    pub binds_in_batch: u32,
    /// Messages of the proxy's own added inside a client's batch, whose answers are all
    /// dropped: (the request, how many answers of it come before theirs, how many answers
    /// they get), oldest first.
    pub added: std::collections::VecDeque<(u64, u32, u32)>,
    /// Answers ended ([`ends_answer`]) in the request being answered.
    pub ended: u32,
    /// Answers of the proxy's added messages still to drop (how many to end).
    pub dropping_added: u32,
    /// A request of the proxy's own whose one value is wanted (a key-map lookup): its
    /// number, and the first column of its first row once read (`None` for NULL).
    pub capture: Option<(u64, Option<Option<String>>)>,
    /// Queries whose text begins with a statement of the proxy's own: (the request, the
    /// characters it added), oldest first. The positions in their errors and notices are
    /// shifted back by that many, to the client's text.
    pub shifted: std::collections::VecDeque<(u64, u32)>,
    /// A digest of the answers of a transaction that may move to the cloud
    /// ([`super::replay`]).
    pub digest: Option<Digest>,
    /// Requests of the proxy's own ([`Exchange::send_own`]) not yet written: the session
    /// writes them to the backend before anything else of the client's.
    pub outbox: Vec<u8>,
}

/// The SQLSTATE class of an ErrorResponse body: the first two characters of its `C` field.
fn sqlstate_class(body: &[u8]) -> Option<[u8; 2]> {
    let mut rest = body;
    while let [field, tail @ ..] = rest {
        if *field == 0 {
            return None;
        }
        let end = memchr::memchr(0, tail)?;
        if *field == b'C' {
            return match &tail[..end] {
                [a, b, ..] => Some([*a, *b]),
                _ => None,
            };
        }
        rest = &tail[end + 1..];
    }
    None
}

/// How many failed requests of the proxy's own an exchange remembers.
const FAILED_KEPT: usize = 8;

/// Whether a backend message ends the answer to one extended-protocol message: ParseComplete,
/// BindComplete, CloseComplete, NoData or RowDescription (Describe), and what ends an
/// Execute. An ErrorResponse ends the whole batch.
pub fn ends_answer(tag: u8) -> bool {
    matches!(
        tag,
        BE_PARSE_COMPLETE
            | BE_BIND_COMPLETE
            | BE_CLOSE_COMPLETE
            | BE_NO_DATA
            | BE_ROW_DESCRIPTION
            | BE_COMMAND_COMPLETE
            | BE_EMPTY_QUERY_RESPONSE
            | BE_PORTAL_SUSPENDED
    )
}

/// The tags of the whole frames in `bytes`.
pub(super) fn tags(bytes: &[u8]) -> impl Iterator<Item = u8> + '_ {
    let mut at = 0;
    std::iter::from_fn(move || {
        let header = bytes
            .get(at..)
            .and_then(|b| Header::peek(b, u32::MAX).ok().flatten())?;
        at += header.frame_len();
        Some(header.tag)
    })
}

/// Whether a client message gets an answer of its own that [`ends_answer`] ends.
pub fn gets_answer(tag: u8) -> bool {
    matches!(
        tag,
        FE_PARSE | FE_BIND | FE_CLOSE | FE_DESCRIBE | FE_EXECUTE
    )
}

/// The most errors of one request the session logs a line for (a pipeline of failing
/// statements is counted, not logged in full).
pub const ERRORS_LOGGED: usize = 8;

/// An error a backend answered, for its log line.
#[derive(Debug, Clone)]
pub struct ErrorNote {
    pub sqlstate: String,
    /// The primary message, at most [`ErrorNote::MESSAGE_MAX`] bytes of it.
    pub message: String,
}

impl ErrorNote {
    const MESSAGE_MAX: usize = 300;

    /// From an ErrorResponse frame (`None`: too large to have been kept whole).
    fn of(frame: Option<&[u8]>) -> ErrorNote {
        let notice = frame
            .and_then(|f| f.get(5..))
            .and_then(|body| lokadb_shared::wire::notice::Notice::parse(body).ok());
        match notice {
            Some(n) => ErrorNote {
                message: lokadb_shared::text::prefix(&n.message, Self::MESSAGE_MAX).to_owned(),
                sqlstate: n.code,
            },
            None => ErrorNote {
                sqlstate: "?????".to_owned(),
                message: String::new(),
            },
        }
    }
}

/// With transaction pooling, the process IDs a session's notifications name: its own
/// backend's become its key's, another session's backend's that session's key's
/// ([`super::tx_pool::Notifiers`]).
#[derive(Debug, Clone)]
pub struct NotifyPids {
    /// The backend the session holds.
    pub backend: u32,
    /// The process ID its key carries.
    pub key: u32,
    /// The keys of the sessions that notified on other backends.
    pub others: std::sync::Arc<super::tx_pool::Notifiers>,
}

impl NotifyPids {
    /// What a notification from backend `pid` names.
    fn named(&self, pid: u32) -> Option<u32> {
        if pid == self.backend {
            Some(self.key)
        } else {
            self.others.key_of(pid)
        }
    }
}

impl Default for Exchange {
    fn default() -> Self {
        Exchange {
            pending: 0,
            unsynced: false,
            status: TX_IDLE,
            terminated: false,
            answered: 0,
            dropping: std::collections::VecDeque::new(),
            silenced: std::collections::VecDeque::new(),
            silenced_failed: std::collections::VecDeque::new(),
            notify: None,
            errors: 0,
            error_classes: Vec::new(),
            error_notes: Vec::new(),
            ended_with_fatal: false,
            syncs_after_execute: 0,
            sent_in_batch: 0,
            binds_in_batch: 0,
            added: std::collections::VecDeque::new(),
            ended: 0,
            dropping_added: 0,
            capture: None,
            shifted: std::collections::VecDeque::new(),
            digest: None,
            outbox: Vec::new(),
        }
    }
}

impl Exchange {
    /// Whether the backend is between requests, outside any transaction: it can be
    /// reset and pooled, or the session closed without interrupting anything.
    pub fn is_idle(&self) -> bool {
        self.pending == 0 && !self.unsynced && self.status == TX_IDLE
    }

    /// Notes that `n` answers (ParseComplete, CloseComplete) to messages the proxy adds
    /// to the request being sent now are to be dropped. Requests sent before it may still
    /// be answering: their answers pass.
    pub fn drop_answers(&mut self, n: u32) {
        let request = self.answered + u64::from(self.pending);
        match self.dropping.back_mut() {
            Some((r, count)) if *r == request => *count += n,
            _ => self.dropping.push_back((request, n)),
        }
    }

    /// Whether only requests of the proxy's own are unanswered (a gate's COMMIT or
    /// ROLLBACK, a direct transaction's ROLLBACK), which all end outside a transaction,
    /// or nothing is: the client's next statement finds the backend idle.
    pub fn idle_but_own(&self) -> bool {
        !self.unsynced
            && self.pending as usize == self.silenced.len()
            && (self.pending > 0 || self.status == TX_IDLE)
    }

    /// Notes that the request sent next is the proxy's own: its answers are dropped.
    pub fn silence_next(&mut self) {
        self.silenced
            .push_back(self.answered + u64::from(self.pending));
    }

    /// Queues a simple query of the proxy's own, its answers to be dropped, for the
    /// backend (which has answered everything the client sent): its request number.
    pub fn send_own(&mut self, sql: &str) -> u64 {
        let request = self.answered + u64::from(self.pending);
        lokadb_shared::wire::frontend::query(&mut self.outbox, sql);
        self.silence_next();
        self.pending += 1;
        request
    }

    /// Queues extended-protocol messages of the proxy's own ending with one Sync (one
    /// request), its answers to be dropped, like [`Exchange::send_own`].
    pub fn send_own_messages(&mut self, frames: &[u8]) -> u64 {
        debug_assert_eq!(tags(frames).last(), Some(FE_SYNC));
        let request = self.answered + u64::from(self.pending);
        self.outbox.extend_from_slice(frames);
        self.silence_next();
        self.pending += 1;
        request
    }

    /// Whether the answers coming now belong to a request the proxy added.
    fn silent_now(&self) -> bool {
        self.silenced.front() == Some(&self.answered)
    }

    /// Whether the next ParseComplete or CloseComplete is one the proxy added.
    fn drops_next(&self) -> bool {
        self.dropping
            .front()
            .is_some_and(|&(r, n)| r == self.answered && n > 0)
    }

    /// Notes that `messages` (whole frames) of the proxy's own go out now inside the
    /// client's batch (after everything counted in [`Exchange::sent_in_batch`]): their
    /// answers are dropped.
    pub fn add_own(&mut self, messages: &[u8]) {
        let request = self.answered + u64::from(self.pending);
        let answers = tags(messages).filter(|&t| gets_answer(t)).count();
        self.added.push_back((
            request,
            self.sent_in_batch,
            u32::try_from(answers).unwrap_or(u32::MAX),
        ));
    }

    /// Notes that the Query going out now begins with a statement of the proxy's own
    /// (`SET …;`, `chars` characters): its answer, a CommandComplete, is dropped, and the
    /// positions in the Query's errors are shifted back to the client's text.
    pub fn add_own_statement(&mut self, chars: usize) {
        let request = self.answered + u64::from(self.pending);
        self.added.push_back((request, 0, 1));
        self.shifted
            .push_back((request, u32::try_from(chars).unwrap_or(u32::MAX)));
    }

    /// The characters to shift positions back by in the answers coming now.
    fn shift_now(&self) -> Option<u32> {
        self.shifted
            .front()
            .filter(|&&(r, _)| r == self.answered)
            .map(|&(_, n)| n)
    }

    /// Counts the messages of `bytes` (whole frames) going out to this side.
    pub fn note_sent(&mut self, bytes: &[u8]) {
        for tag in tags(bytes) {
            self.note_sent_tag(tag);
        }
    }

    /// Counts a message with this tag going out to this side.
    pub fn note_sent_tag(&mut self, tag: u8) {
        match tag {
            FE_QUERY | FE_SYNC | FE_FUNCTION_CALL => {
                self.sent_in_batch = 0;
                self.binds_in_batch = 0;
            }
            FE_BIND => {
                self.sent_in_batch += 1;
                self.binds_in_batch += 1;
            }
            _ if gets_answer(tag) => self.sent_in_batch += 1,
            _ => {}
        }
    }

    /// Whether the answer coming next is the first of the proxy's added messages.
    fn added_next(&self) -> bool {
        self.added
            .front()
            .is_some_and(|&(r, at, _)| (r, at) == (self.answered, self.ended))
    }

    /// Whether the proxy's own request `request` failed (an ErrorResponse among its answers).
    pub fn own_failed(&self, request: u64) -> bool {
        self.silenced_failed.contains(&request)
    }

    /// Whether the backend is between requests (maybe in a transaction, which a
    /// ROLLBACK ends).
    pub fn is_settled(&self) -> bool {
        self.pending == 0 && !self.unsynced
    }
}

/// A client message as it is routed: decoded once, its statement analysed at most once
/// (by the first concern that asks), whichever concerns read it.
pub(super) struct Routed<'f> {
    pub msg: Message<'f>,
    analysis: std::cell::OnceCell<Analysis>,
}

impl<'f> Routed<'f> {
    pub fn new(msg: Message<'f>) -> Routed<'f> {
        Routed {
            msg,
            analysis: std::cell::OnceCell::new(),
        }
    }

    /// The statement of a Query or Parse.
    pub fn statement(&self) -> Option<&Statement<'f>> {
        self.msg.statement()
    }

    /// The analysis of its statement in this session: `analyze` of its text the first
    /// time ([`ClientFrames::analyze`]); `None` for a message without a statement.
    pub fn analysis(&self, analyze: impl FnOnce(&str) -> Analysis) -> Option<&Analysis> {
        let sql = self.statement()?.sql;
        Some(self.analysis.get_or_init(|| analyze(sql)))
    }
}

/// Inspects client → backend frames.
pub struct ClientFrames<'a> {
    /// Both backends' exchange state.
    pub exchanges: &'a mut Exchanges,
    /// Log each statement's route (`route_log`).
    pub route_log: bool,
    /// The database's routing metadata, when the watcher has loaded it.
    pub meta: Option<&'a CoreMeta>,
    /// Where messages go, and the session's prepared statements.
    pub router: &'a mut Router,
    /// The core's traffic recording and this session's id in it.
    pub record: Option<(&'a Recorder, u32)>,
    /// Transaction pooling: what the session keeps across backends ([`super::tx_pool`]).
    pub tx: Option<&'a mut super::tx_pool::TxSession>,
}

impl Inspect for ClientFrames<'_> {
    #[inline]
    fn wants_body(&self, tag: u8) -> bool {
        if let Some(tx) = self.tx.as_deref() {
            // Without a backend, a message is held whole or not at all (shown again once one
            // is acquired); with one, what the session keeps is read from these.
            if tx.detached {
                return tag == FE_TERMINATE;
            }
            if matches!(tag, FE_QUERY | FE_PARSE | FE_CLOSE) || (tag == FE_BIND && tx.follows_binds)
            {
                return true;
            }
        }
        match tag {
            FE_TERMINATE => true,
            _ if self.routing_wants_body(tag) => true,
            // Whole whenever the database has LokaDB tables: a statement may need refusing.
            FE_QUERY | FE_PARSE => self.route_log || self.meta.is_some_and(|m| m.has_tables()),
            // Whole whenever the database has LokaDB tables: the cloud learns the
            // statement's organization ahead of it.
            FE_BIND => {
                self.route_log
                    || self.router.org.ever_set
                    || (self.router.tally.is_some() && self.meta.is_some_and(|m| m.has_tables()))
                    || (self.router.cloud_org.tell && self.meta.is_some_and(|m| m.has_tables()))
                    || self.meta.is_some_and(|m| m.has_owing())
            }
            FE_CLOSE => self.route_log || !self.router.org.marks.is_empty(),
            _ => false,
        }
    }

    #[inline]
    fn on_read(&mut self, bytes: &[u8]) {
        if let Some((rec, session)) = self.record {
            rec.record(Kind::Frontend, session, bytes);
        }
    }

    #[inline]
    fn on_frame(&mut self, header: Header, frame: Option<&[u8]>) -> Action {
        let from = super::tx_pool::Position::next(&self.exchanges.cloud);
        if let Some(tx) = self.tx.as_deref_mut() {
            if tx.detached && header.tag != FE_TERMINATE {
                tx.wants_backend = true;
                return Action::Hold;
            }
        }
        let mut action = self.route_frame(header, frame);
        if let (Some(tx), Some(frame)) = (self.tx.as_deref_mut(), frame) {
            let sent = match &action {
                Action::Forward => Some(frame),
                Action::Replace(bytes) => Some(bytes.as_slice()),
                Action::Stop | Action::Hold => None,
            };
            if let Some(sent) = sent.filter(|_| self.router.target == Side::Cloud) {
                if let Some(out) = tx.sent(&mut self.exchanges.cloud, frame, sent, from) {
                    action = Action::Replace(out);
                }
            }
        }
        self.tally(header.tag, frame, &action);
        action
    }
}

impl ClientFrames<'_> {
    /// Where a client's message goes, and as what.
    fn route_frame(&mut self, header: Header, frame: Option<&[u8]>) -> Action {
        if header.tag == FE_TERMINATE {
            self.exchanges.cloud.terminated = true;
            return Action::Stop;
        }
        if header.tag == FE_FUNCTION_CALL {
            // A function the proxy does not follow may change what the cloud holds, and the
            // session's transaction defaults.
            self.router.cloud_org.forget();
            self.router.tx_defaults_may_change();
        }
        // A refused or rewritten statement is routed in place of the client's (a COPY of a
        // whole LokaDB table goes to the cloud, which raises the refusal, whatever was added
        // before it).
        let mut scoped = false;
        let mut keyed = false;
        // Decoded once for every concern that reads it; a malformed one goes as sent (the
        // cloud refuses it).
        let msg = frame
            .and_then(|f| Message::decode(header.tag, &f[5..]).ok())
            .map(Routed::new);
        let (refusal, refused) = match (frame, msg.as_ref()) {
            (
                Some(_),
                Some(
                    r @ Routed {
                        msg: Message::Query(st) | Message::Parse(st),
                        ..
                    },
                ),
            ) => {
                let reported = self.router.path_reported();
                self.router.names.note_statement(st.sql, reported);
                match self
                    .owing_refusal(header.tag, st)
                    .map(OrgStep::Refused)
                    .or_else(|| self.org_step(header.tag, r))
                {
                    Some(OrgStep::Scoped(frame)) => {
                        scoped = true;
                        (Some(frame), false)
                    }
                    Some(OrgStep::Refused(frame)) => (Some(frame), true),
                    Some(OrgStep::Settle) => {
                        self.router.want = Some(super::router::Want::Settle);
                        return Action::Hold;
                    }
                    None => match self.refusal(st) {
                        Some(r) => (Some(r), true),
                        None => match self.rewrite(r) {
                            Some((rewritten, by_key)) => {
                                keyed = by_key;
                                (Some(rewritten), false)
                            }
                            None => (None, false),
                        },
                    },
                }
            }
            (
                Some(_),
                Some(
                    r @ Routed {
                        msg: Message::Bind(bind),
                        ..
                    },
                ),
            ) => {
                if let Some(action) = self.owing_bind(r) {
                    return action;
                }
                if let Some(action) = self.check_bind(bind) {
                    return action;
                }
                (None, false)
            }
            (
                Some(_),
                Some(Routed {
                    msg: Message::Close(Close { kind: b'S', name }),
                    ..
                }),
            ) if !self.router.org.marks.is_empty() => {
                self.router.org.mark(name, None);
                (None, false)
            }
            _ => (None, false),
        };
        let routed = refusal.as_deref().or(frame);
        let routed_msg = match &refusal {
            Some(r) => Message::decode(header.tag, &r[5..]).ok().map(Routed::new),
            None => msg,
        };
        // The direct path runs the client's own text: the organization's database holds
        // only its rows (and has no key map).
        let action = self.route(
            header.tag,
            routed,
            routed_msg.as_ref(),
            frame.filter(|_| scoped || keyed),
        );
        // A held message is shown again once the switch is made: logged then, once.
        if action == Action::Hold {
            return action;
        }
        // A key-map lookup's answer served the message it was asked for, sent now.
        if matches!(self.router.lookup, Lookup::Answered(..)) {
            self.router.lookup = Lookup::None;
        }
        if let (Some(f), Some(r)) = (routed, routed_msg.as_ref()) {
            self.note_for_cloud_org(f, r);
        }
        self.router.refused_now |= refused;
        if refused && self.route_log {
            if let Some(f) = frame {
                log_refused(header.tag, &f[5..]);
            }
        }
        if self.route_log {
            // The statement as limited to the session's organization: its analysis is the
            // one routing used.
            let logged = if scoped { refusal.as_deref() } else { frame };
            if let Some(logged) = logged {
                // A malformed message is the cloud's to refuse; the log just skips it.
                let _ = self.log_route(header.tag, &logged[5..], scoped);
            }
        }
        match (action, refusal) {
            (Action::Forward, Some(refusal)) => Action::Replace(refusal),
            (action, _) => action,
        }
    }
}

/// The `route_log` line of a refused Query or Parse.
fn log_refused(tag: u8, body: &[u8]) {
    let Ok(Statement { sql, .. }) = Statement::decode(tag, body) else {
        return;
    };
    let kind = if tag == FE_PARSE { "parse" } else { "query" };
    tracing::info!(target: "lokadb::route", route = "refused", kind, statement = %sql.chars().take(200).collect::<String>());
}

/// The refusal of a statement of an organization that owes migrations.
fn owing_error(org: &str) -> (String, String) {
    (
        format!(
            "organization {org} has not received the application's latest migrations (it could not be reached when they ran): its statements are refused until it has them"
        ),
        format!(
            "The proxy applies them once the organization's database can be reached again (its agent connected); an operator can run lokadb org sync {org}"
        ),
    )
}

impl ClientFrames<'_> {
    /// A Query whose statement is placed in an organization that owes migrations
    /// (`lokadb.migration_offline = defer`, docs/migrations.md), as a Query that raises
    /// 55000: its database's tables lack the cloud's latest changes, and neither path may
    /// reach them. A Parse is looked at by its Binds (the debt may be paid meanwhile).
    fn owing_refusal(&self, tag: u8, st: &Statement<'_>) -> Option<Vec<u8>> {
        if tag != FE_QUERY || !self.meta?.has_owing() {
            return None;
        }
        let (org, _) = self.sql_org(st.sql)?;
        if !self.meta?.owes(&org) {
            return None;
        }
        let (message, hint) = owing_error(&org);
        Some(refusal_frame(None, "55000", &message, &hint))
    }

    /// A Bind of a statement placed in an organization that owes migrations: refused as
    /// [`Self::owing_refusal`] refuses a Query.
    fn owing_bind(&mut self, routed: &Routed<'_>) -> Option<Action> {
        if !self.meta?.has_owing() {
            return None;
        }
        let (org, _) = self.message_org(&routed.msg)?;
        if !self.meta?.owes(&org) {
            return None;
        }
        let (message, hint) = owing_error(&org);
        let portal = routed.msg.bind()?.portal.to_owned();
        Some(self.refuse_here(FE_BIND, &portal, "55000", &message, &hint))
    }

    /// A Query or Parse the proxy does not forward, as the same message with a statement
    /// that makes the cloud raise the refusal: the error comes in the stream's order, behind
    /// the answers to whatever the client pipelined before it, with no state in the proxy
    /// (a replaced Parse raises it when the client executes it). Today:
    /// `COPY <LokaDB table> TO …` (the whole message is refused).
    fn refusal(&self, st: &Statement<'_>) -> Option<Vec<u8>> {
        let meta = self.meta?;
        let (statement, sql) = (st.name, st.sql);
        let table = copy_out_of_loka_table(sql, &meta.meta.catalog)?;
        // `notes` may be a temporary table of the session's: the cloud decides.
        if self.router.names.unsure(sql, &meta.meta.catalog) {
            return None;
        }
        let name = format!(
            "{}.{}",
            quote_ident(&table.schema),
            quote_ident(&table.name)
        );
        let message = format!(
            "COPY of LokaDB table {name} needs an organization: the table holds every organization's rows"
        );
        let hint = format!(
            "Copy one organization's rows: COPY (SELECT * FROM {name} WHERE {} = '…') TO STDOUT",
            quote_ident(&table.org_column)
        );
        Some(refusal_frame(statement, "0A000", &message, &hint))
    }
}

impl ClientFrames<'_> {
    /// A Query or Parse whose statement the join or key-map rewrite changes
    /// ([`crate::route::rewrite`]),
    /// as the same message with the rewritten text (a Parse keeps its parameter types), and
    /// whether it was the key-map rewrite.
    fn rewrite(&self, routed: &Routed<'_>) -> Option<(Vec<u8>, bool)> {
        let meta = self.meta?;
        let statement = routed.statement()?;
        let sql = statement.sql;
        // Only a join, or a statement that may look a key up, can be rewritten: the rest
        // pay a short scan, no lookup (a simple query's text differs with every value, so
        // an analysis is a parse). A statement whose WHERE names an organization column needs no
        // key's organization (its select list may).
        let catalog = &meta.meta.catalog;
        // A migration's type change: its USING goes, which Postgres refuses once some
        // organization's partition is a foreign table ([`crate::route::rewrite::alter_type_using`]).
        if mentions(sql, b"using")
            && mentions(sql, b"alter")
            && meta.meta.orgs.values().any(|o| o.state != "cloud")
        {
            if let Some(rewritten) = crate::route::rewrite::alter_type_using(sql, catalog) {
                return Some((statement.with_sql(&rewritten), false));
            }
        }
        let keyed = catalog.has_key_maps()
            && mentions(sql, b"where")
            && !catalog.org_column_after_where(sql);
        if !keyed && !mentions(sql, b"join") {
            return None;
        }
        let (rewritten, by_key) = match routed.analysis(|sql| self.analyze(meta, sql))? {
            Analysis::Org {
                rewrite: Some(rewritten),
                ..
            } => (rewritten, false),
            Analysis::Keyed(rewritten) => (rewritten, true),
            _ => return None,
        };
        Some((statement.with_sql(rewritten), by_key))
    }
}

impl ClientFrames<'_> {
    /// `route_log`: one line per Query and Parse, and per Bind that places its statement
    /// by a parameter, with the route and what the analysis found.
    fn log_route(&mut self, tag: u8, body: &[u8], scoped: bool) -> Result<(), FrameError> {
        let meta = self.meta;
        let analyse = |sql: &str| match meta {
            Some(m) => self.analyze(m, sql),
            None => Analysis::Unplaced("no routing metadata (no auth_user, or not loaded yet)"),
        };
        let (kind, text, analysis) = match tag {
            FE_QUERY => {
                let text = Statement::decode(tag, body)?.sql;
                ("query", text, analyse(text))
            }
            FE_PARSE => {
                let st = Statement::decode(tag, body)?;
                let analysis = analyse(st.sql);
                let kind = if st.name == Some("") {
                    "parse"
                } else {
                    "prepare"
                };
                (kind, st.sql, analysis)
            }
            FE_BIND => {
                let bind = Bind::decode(body)?;
                let name = bind.statement;
                let Some(Analysis::Org {
                    org: Org::Param(n), ..
                }) = self.router.prepared_analysis(name)
                else {
                    return Ok(());
                };
                let n = *n;
                let mut analysis = self.router.prepared_analysis(name).cloned().expect("above");
                let value = bind_param(&bind, n, self.router.org_type(name))?;
                if let Analysis::Org { org, .. } = &mut analysis {
                    *org = Org::Literal(value.unwrap_or_else(|| "?".to_owned()));
                }
                ("bind", name, analysis)
            }
            FE_CLOSE => {
                let close = Close::decode(body)?;
                if close.kind == b'S' && !self.router.enabled {
                    self.router.forget(close.name);
                }
                return Ok(());
            }
            _ => return Ok(()),
        };
        let (org, why) = match &analysis {
            Analysis::NoLokaTable => ("-".to_owned(), ""),
            Analysis::Org {
                org: Org::Literal(v),
                ..
            } => (v.clone(), ""),
            Analysis::Org {
                org: Org::Param(n), ..
            } => (format!("${n}"), ""),
            Analysis::Org {
                org: Org::Session, ..
            } => (
                self.router.org.current.as_deref().unwrap_or("?").to_owned(),
                "",
            ),
            Analysis::Unplaced(why) => ("?".to_owned(), *why),
            Analysis::Keyed(_)
            | Analysis::Org {
                org: Org::Key(_), ..
            } => ("key".to_owned(), ""),
        };
        // The join rewrite sent this statement to the cloud rewritten (a Bind's statement:
        // see its Parse's line).
        let rewritten = match (kind, &analysis) {
            ("bind", _) => "-",
            _ if scoped => "true",
            // The direct path runs the client's own text (a read placed by a key included).
            _ if self.router.target == Side::Direct => "false",
            (
                _,
                Analysis::Org {
                    rewrite: Some(_), ..
                }
                | Analysis::Keyed(_),
            ) => "true",
            _ => "false",
        };
        let tables = match (&analysis, self.meta) {
            (Analysis::Org { tables, .. }, Some(m)) => tables
                .iter()
                .filter_map(|&i| m.meta.catalog.tables().get(i))
                .map(|t| format!("{}.{}", t.schema, t.name))
                .collect::<Vec<_>>()
                .join(","),
            _ => String::new(),
        };
        let text: String = text.chars().take(200).collect();
        tracing::info!(
            target: "lokadb::route",
            route = match self.router.target {
                Side::Cloud => "cloud",
                Side::Direct => "direct",
            },
            kind,
            org = %org,
            tables = %tables,
            why,
            rewritten,
            statement = %text
        );
        Ok(())
    }
}

/// The value `bind` binds to parameter `$n` (1-based), read as type `ty`
/// ([`ValueType::decode`]). `None`: no such parameter, NULL, or a value not read with
/// certainty (its statement goes through the cloud).
pub(super) fn bind_param(
    bind: &Bind<'_>,
    n: u16,
    ty: ValueType,
) -> Result<Option<String>, FrameError> {
    Ok(match bind.param(n)? {
        Param::Missing | Param::Null => None,
        Param::Value { binary, bytes } => ty.decode(binary, bytes),
    })
}

/// Inspects backend → client frames: ReadyForQuery (the exchange), answers to messages
/// the proxy added (dropped), ParameterStatus (the direct side's dropped, the cloud's
/// noted for the direct connection's login).
pub struct ServerFrames<'a> {
    /// The exchange of the side being read.
    pub exchange: &'a mut Exchange,
    /// The side being read.
    pub side: Side,
    /// The cloud's reported settings.
    pub reported: &'a mut Reported,
    /// The core's traffic recording and this session's id in it.
    pub record: Option<(&'a Recorder, u32)>,
}

/// Settings the cloud reported (ParameterStatus) that shape how values are written, so
/// a direct connection writes them the same way.
#[derive(Debug, Default)]
pub struct Reported {
    pub params: Vec<(String, String)>,
    /// Bumped on every change.
    pub version: u32,
    /// The `search_path` the cloud reported (PostgreSQL 18+ does), which unqualified names
    /// resolve by ([`crate::route::names`]); never copied to direct connections.
    pub search_path: Option<String>,
    /// Bumped on every report of `search_path`.
    pub path_changes: u32,
}

/// The reported settings a direct connection copies.
pub const COPIED_SETTINGS: &[&str] = &[
    "DateStyle",
    "IntervalStyle",
    "TimeZone",
    "client_encoding",
    "standard_conforming_strings",
    "application_name",
    "default_transaction_read_only",
];

impl Reported {
    /// Notes a ParameterStatus body.
    pub fn note(&mut self, body: &[u8]) {
        let mut f = Fields::new(body, "ParameterStatus");
        let (Ok(name), Ok(value)) = (f.cstr(), f.cstr()) else {
            return;
        };
        if name == "search_path" {
            self.search_path = Some(value.to_owned());
            self.path_changes = self.path_changes.wrapping_add(1);
            return;
        }
        if !COPIED_SETTINGS.contains(&name) {
            return;
        }
        match self.params.iter_mut().find(|(n, _)| n == name) {
            Some((_, v)) if v == value => return,
            Some((_, v)) => *v = value.to_owned(),
            None => self.params.push((name.to_owned(), value.to_owned())),
        }
        self.version = self.version.wrapping_add(1);
    }
}

impl Inspect for ServerFrames<'_> {
    #[inline]
    fn wants_body(&self, tag: u8) -> bool {
        let ex = &*self.exchange;
        if ex.silent_now() || ex.dropping_added > 0 || ex.added_next() {
            return true;
        }
        if ex.digest.is_some() && Digest::covers(tag) {
            return true;
        }
        match tag {
            // Every error: it may be a refusal's ([`plain_refusal`]). Errors are rare, and
            // short.
            BE_READY_FOR_QUERY | BE_PARAMETER_STATUS | BE_ERROR_RESPONSE => true,
            BE_NOTICE_RESPONSE => ex.shift_now().is_some(),
            BE_NOTIFICATION_RESPONSE => ex.notify.is_some(),
            BE_PARSE_COMPLETE | BE_CLOSE_COMPLETE => self.exchange.drops_next(),
            _ => false,
        }
    }

    #[inline]
    fn on_read(&mut self, bytes: &[u8]) {
        if let Some((rec, session)) = self.record {
            rec.record(Kind::Backend, session, bytes);
        }
    }

    #[inline]
    fn on_frame(&mut self, header: Header, frame: Option<&[u8]>) -> Action {
        // Answers to the proxy's own request: dropped, but for what is not an answer.
        let silent = self.exchange.silent_now()
            && !matches!(header.tag, BE_NOTIFICATION_RESPONSE | BE_PARAMETER_STATUS);
        if silent && header.tag == BE_READY_FOR_QUERY {
            self.exchange.silenced.pop_front();
        }
        if header.tag == BE_ERROR_RESPONSE {
            self.exchange.errors += 1;
            if !silent {
                let class = frame
                    .and_then(|f| sqlstate_class(&f[5..]))
                    .unwrap_or(*b"??");
                let classes = &mut self.exchange.error_classes;
                match classes.iter_mut().find(|(c, _)| *c == class) {
                    Some((_, n)) => *n += 1,
                    None => classes.push((class, 1)),
                }
                if self.exchange.error_notes.len() < ERRORS_LOGGED {
                    self.exchange.error_notes.push(ErrorNote::of(frame));
                }
            }
            if silent {
                let failed = &mut self.exchange.silenced_failed;
                if failed.len() == FAILED_KEPT {
                    failed.pop_front();
                }
                failed.push_back(self.exchange.answered);
            }
        }
        if silent && header.tag == BE_DATA_ROW {
            let answered = self.exchange.answered;
            if let Some((request, value @ None)) = &mut self.exchange.capture {
                if *request == answered {
                    *value = Some(frame.and_then(|f| first_column(&f[5..])));
                }
            }
        }
        let shift = match header.tag {
            BE_ERROR_RESPONSE | BE_NOTICE_RESPONSE => self.exchange.shift_now(),
            _ => None,
        };
        let action = self.account(header.tag, frame);
        let action = match (silent, shift, frame) {
            (true, ..) => Action::Replace(Vec::new()),
            (false, _, Some(frame))
                if header.tag == BE_ERROR_RESPONSE && action == Action::Forward =>
            {
                if super::refusal::is_fatal(frame) {
                    self.exchange.ended_with_fatal = true;
                }
                // A refusal's error as the proxy meant it; a refusal has no position.
                match plain_refusal(frame) {
                    Some(plain) => Action::Replace(plain),
                    None => shift
                        .and_then(|chars| shift_position(frame, chars))
                        .map_or(action, Action::Replace),
                }
            }
            (false, Some(chars), Some(frame)) if action == Action::Forward => {
                shift_position(frame, chars).map_or(action, Action::Replace)
            }
            (false, _, Some(frame))
                if header.tag == BE_NOTIFICATION_RESPONSE && action == Action::Forward =>
            {
                let pid = frame
                    .get(5..9)
                    .map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]));
                match (self.exchange.notify.as_ref(), pid) {
                    (Some(n), Some(pid)) => match n.named(pid) {
                        Some(key) => {
                            let mut named = frame.to_vec();
                            named[5..9].copy_from_slice(&key.to_be_bytes());
                            Action::Replace(named)
                        }
                        None => action,
                    },
                    _ => action,
                }
            }
            _ => action,
        };
        if let Some(d) = &mut self.exchange.digest {
            let dropped = matches!(&action, Action::Replace(b) if b.is_empty());
            if d.of_dropped == dropped && Digest::covers(header.tag) {
                d.add(header.tag, frame);
            }
        }
        action
    }
}

/// An ErrorResponse or NoticeResponse with its position (`P`, in characters of the
/// Query's text) moved back by `chars`, the statement the proxy put in front of the
/// client's text; a position inside that statement is left out. `None`: no position, or
/// a message the proxy cannot read (it passes as it is).
fn shift_position(frame: &[u8], chars: u32) -> Option<Vec<u8>> {
    let body = &frame[5..];
    let mut f = Fields::new(body, "ErrorResponse");
    // The `P` field: where it starts and ends in the body, and its value (the other
    // fields, in the client's encoding, are copied as bytes).
    let (start, end, p) = loop {
        let start = body.len() - f.rest().len();
        let code = f.u8().ok()?;
        if code == 0 {
            return None;
        }
        let value = f.cstr_bytes().ok()?;
        if code == b'P' {
            let p: u32 = std::str::from_utf8(value).ok()?.parse().ok()?;
            break (start, body.len() - f.rest().len(), p);
        }
    };
    let mut out = Vec::with_capacity(frame.len());
    lokadb_shared::wire::backend::write_frame(&mut out, frame[0], |out| {
        out.extend_from_slice(&body[..start]);
        if p > chars {
            out.push(b'P');
            lokadb_shared::wire::backend::put_cstr(out, &(p - chars).to_string());
        }
        out.extend_from_slice(&body[end..]);
    });
    Some(out)
}

/// The first column of a DataRow body as text (`None`: NULL, or not UTF-8).
fn first_column(body: &[u8]) -> Option<String> {
    let mut f = Fields::new(body, "DataRow");
    if f.i16().ok()? < 1 {
        return None;
    }
    let len = f.i32().ok()?;
    let bytes = f.take(usize::try_from(len).ok()?).ok()?;
    std::str::from_utf8(bytes).ok().map(str::to_owned)
}

impl ServerFrames<'_> {
    /// Drops the answers to messages the proxy added inside a client's batch, found by
    /// their position: they begin once the answers to everything sent before them ended.
    fn added_answer(&mut self, tag: u8) -> Option<Action> {
        if matches!(
            tag,
            BE_READY_FOR_QUERY
                | BE_PARAMETER_STATUS
                | BE_NOTICE_RESPONSE
                | BE_NOTIFICATION_RESPONSE
        ) {
            return None;
        }
        let ex = &mut *self.exchange;
        if ex.dropping_added == 0 && ex.added_next() {
            ex.dropping_added = ex.added.pop_front().map_or(0, |(_, _, n)| n);
        }
        if tag == BE_ERROR_RESPONSE {
            // The batch stops here; the error is the client's to see.
            ex.dropping_added = 0;
            return None;
        }
        let ends = ends_answer(tag);
        if ends {
            ex.ended += 1;
        }
        if ex.dropping_added == 0 {
            return None;
        }
        if ends {
            ex.dropping_added -= 1;
        }
        Some(Action::Replace(Vec::new()))
    }

    fn account(&mut self, tag: u8, frame: Option<&[u8]>) -> Action {
        if let Some(action) = self.added_answer(tag) {
            return action;
        }
        match tag {
            BE_READY_FOR_QUERY => {
                let ex = &mut *self.exchange;
                ex.pending = ex.pending.saturating_sub(1);
                ex.answered += 1;
                // Answers of a finished request are not waited for any more.
                while ex.dropping.front().is_some_and(|&(r, _)| r < ex.answered) {
                    ex.dropping.pop_front();
                }
                while ex.added.front().is_some_and(|&(r, _, _)| r < ex.answered) {
                    ex.added.pop_front();
                }
                while ex.shifted.front().is_some_and(|&(r, _)| r < ex.answered) {
                    ex.shifted.pop_front();
                }
                ex.ended = 0;
                ex.dropping_added = 0;
                if let Some(&status) = frame.and_then(|f| f.get(5)) {
                    self.exchange.status = status;
                }
            }
            BE_PARSE_COMPLETE | BE_CLOSE_COMPLETE if self.exchange.drops_next() => {
                if let Some((_, n)) = self.exchange.dropping.front_mut() {
                    *n -= 1;
                }
                return Action::Replace(Vec::new());
            }
            // A failed added Parse: the rest of its batch is skipped, answers included.
            BE_ERROR_RESPONSE if self.exchange.drops_next() => {
                self.exchange.dropping.pop_front();
            }
            BE_PARAMETER_STATUS => match (self.side, frame) {
                (Side::Direct, _) => return Action::Replace(Vec::new()),
                (Side::Cloud, Some(frame)) => self.reported.note(&frame[5..]),
                (Side::Cloud, None) => {}
            },
            _ => {}
        }
        Action::Forward
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_errors_class_is_read_from_its_code_field() {
        let mut body = Vec::new();
        for (field, value) in [(b'S', "ERROR"), (b'C', "23505"), (b'M', "duplicate key")] {
            body.push(field);
            body.extend_from_slice(value.as_bytes());
            body.push(0);
        }
        body.push(0);
        assert_eq!(sqlstate_class(&body), Some(*b"23"));
        assert_eq!(sqlstate_class(b"SERROR\0\0"), None);
        assert_eq!(sqlstate_class(b"SERR"), None, "a field without its end");
    }

    fn hdr(tag: u8) -> Header {
        Header { tag, len: 4 }
    }

    fn server<'a>(ex: &'a mut Exchange, reported: &'a mut Reported) -> ServerFrames<'a> {
        ServerFrames {
            exchange: ex,
            side: Side::Cloud,
            reported,
            record: None,
        }
    }

    fn ready(s: &mut ServerFrames<'_>, status: u8) -> Action {
        s.on_frame(
            Header {
                tag: BE_READY_FOR_QUERY,
                len: 5,
            },
            Some(&[b'Z', 0, 0, 0, 5, status]),
        )
    }

    #[test]
    fn extended_protocol_is_settled_only_after_sync_and_ready() {
        let mut exs = Exchanges::default();
        let mut router = Router::default();
        let mut c = ClientFrames {
            exchanges: &mut exs,
            route_log: false,
            meta: None,
            router: &mut router,
            record: None,
            tx: None,
        };
        for tag in [FE_PARSE, FE_BIND, FE_EXECUTE] {
            c.on_frame(hdr(tag), None);
        }
        assert!(
            !c.exchanges.cloud.is_settled(),
            "Parse/Bind/Execute without Sync"
        );
        c.on_frame(hdr(FE_SYNC), None);
        let ex = &mut exs.cloud;
        assert_eq!(ex.pending, 1);
        let mut reported = Reported::default();
        let mut s = server(ex, &mut reported);
        ready(&mut s, b'T');
        assert!(ex.is_settled());
        assert!(!ex.is_idle(), "in a transaction block");
    }

    /// An ErrorResponse (or NoticeResponse) of the fields `(code, value)`.
    fn error_frame(fields: &[(u8, &str)]) -> Vec<u8> {
        let mut body = Vec::new();
        for (code, value) in fields {
            body.push(*code);
            body.extend_from_slice(value.as_bytes());
            body.push(0);
        }
        body.push(0);
        let mut f = vec![BE_ERROR_RESPONSE];
        f.extend_from_slice(&(body.len() as u32 + 4).to_be_bytes());
        f.extend_from_slice(&body);
        f
    }

    /// The position in an error of a Query the proxy put its statement in front of points
    /// into the client's text again; one inside the proxy's statement is left out.
    #[test]
    fn positions_in_errors_of_a_prefixed_query_point_into_the_clients_text() {
        let base = [
            (b'S', "ERROR"),
            (b'C', "42703"),
            (b'M', "column \"x\" does not exist"),
        ];
        let with = |p: &str| {
            let mut f = base.to_vec();
            f.push((b'P', p));
            error_frame(&f)
        };
        assert_eq!(shift_position(&with("75"), 60), Some(with("15")));
        assert_eq!(shift_position(&with("61"), 60), Some(with("1")));
        assert_eq!(shift_position(&with("60"), 60), Some(error_frame(&base)));
        assert_eq!(shift_position(&error_frame(&base), 60), None);
        assert_eq!(shift_position(&with("x"), 60), None);
        assert_eq!(
            shift_position(&[BE_ERROR_RESPONSE, 0, 0, 0, 6, b'P'], 60),
            None
        );

        // Only in the answers of that Query.
        let mut ex = Exchange {
            pending: 2,
            ..Exchange::default()
        };
        ex.pending -= 1;
        ex.add_own_statement(60);
        ex.pending += 1;
        let mut reported = Reported::default();
        let mut s = server(&mut ex, &mut reported);
        let h = |f: &[u8]| Header::peek(f, u32::MAX).unwrap().unwrap();
        let e = with("75");
        // The earlier request's error passes as it is.
        assert!(!s.wants_body(BE_NOTICE_RESPONSE));
        assert_eq!(s.on_frame(h(&e), Some(&e)), Action::Forward);
        assert_eq!(ready(&mut s, b'I'), Action::Forward);
        // The prefixed Query's: its own statement's answer dropped, then the error shifted.
        assert!(s.wants_body(BE_NOTICE_RESPONSE));
        let tag = BE_COMMAND_COMPLETE;
        assert_eq!(
            s.on_frame(Header { tag, len: 4 }, Some(&[tag, 0, 0, 0, 4])),
            Action::Replace(Vec::new())
        );
        assert_eq!(s.on_frame(h(&e), Some(&e)), Action::Replace(with("15")));
        assert_eq!(ready(&mut s, b'I'), Action::Forward);
        assert!(!s.wants_body(BE_NOTICE_RESPONSE));
    }

    /// Answers to messages the proxy added are dropped only once the requests sent before
    /// them are answered: a ReadyForQuery still owed to an earlier request (the client sent
    /// on after an ErrorResponse, before its ReadyForQuery) does not cancel the dropping.
    #[test]
    fn added_answers_are_dropped_in_request_order() {
        let mut ex = Exchange {
            pending: 1,
            ..Exchange::default()
        };
        // The next request carries an added Close + Parse.
        ex.drop_answers(2);
        ex.pending += 1;
        let mut reported = Reported::default();
        let mut s = server(&mut ex, &mut reported);
        let h = |tag| Header { tag, len: 4 };
        // The earlier request's answers pass, its ReadyForQuery included.
        assert!(!s.wants_body(BE_PARSE_COMPLETE));
        assert_eq!(s.on_frame(h(BE_PARSE_COMPLETE), None), Action::Forward);
        assert_eq!(ready(&mut s, b'I'), Action::Forward);
        // Then the added ones are dropped, and the client's own pass.
        assert!(s.wants_body(BE_CLOSE_COMPLETE));
        let empty = Action::Replace(Vec::new());
        assert_eq!(
            s.on_frame(h(BE_CLOSE_COMPLETE), Some(b"3\0\0\0\x04")),
            empty
        );
        assert_eq!(
            s.on_frame(h(BE_PARSE_COMPLETE), Some(b"1\0\0\0\x04")),
            empty
        );
        assert!(!s.wants_body(BE_PARSE_COMPLETE));
        assert_eq!(s.on_frame(h(BE_BIND_COMPLETE), None), Action::Forward);
        assert_eq!(ready(&mut s, b'I'), Action::Forward);
        assert!(ex.dropping.is_empty());

        // An added Parse that fails: nothing more of its request is dropped.
        ex.drop_answers(2);
        ex.pending += 1;
        let mut s = server(&mut ex, &mut reported);
        assert_eq!(
            s.on_frame(h(BE_CLOSE_COMPLETE), Some(b"3\0\0\0\x04")),
            empty
        );
        assert_eq!(s.on_frame(h(BE_ERROR_RESPONSE), None), Action::Forward);
        assert!(!s.wants_body(BE_PARSE_COMPLETE));
        ready(&mut s, b'I');
        assert!(ex.dropping.is_empty() && ex.pending == 0);
    }

    /// A lookup of the proxy's own (a silenced request) gives its one value to the proxy and
    /// nothing to the client; a NULL is told apart from no row; a client's rows pass.
    #[test]
    fn a_silenced_lookup_captures_its_value() {
        let data_row = |value: Option<&[u8]>| {
            let mut body = 1i16.to_be_bytes().to_vec();
            match value {
                Some(v) => {
                    body.extend_from_slice(&(v.len() as i32).to_be_bytes());
                    body.extend_from_slice(v);
                }
                None => body.extend_from_slice(&(-1i32).to_be_bytes()),
            }
            let mut frame = vec![BE_DATA_ROW];
            frame.extend_from_slice(&(body.len() as u32 + 4).to_be_bytes());
            frame.extend_from_slice(&body);
            frame
        };
        let h = |f: &[u8]| Header {
            tag: f[0],
            len: u32::from_be_bytes([f[1], f[2], f[3], f[4]]),
        };
        // A lookup sent, its value wanted.
        let asked = || {
            let mut ex = Exchange::default();
            ex.silence_next();
            ex.pending += 1;
            ex.capture = Some((0, None));
            ex
        };
        let empty = Action::Replace(Vec::new());
        for (value, want) in [(Some(&b"42"[..]), Some("42")), (None, None)] {
            let mut ex = asked();
            let mut reported = Reported::default();
            let mut s = server(&mut ex, &mut reported);
            let row = data_row(value);
            assert!(s.wants_body(BE_DATA_ROW));
            assert_eq!(s.on_frame(h(&row), Some(&row)), empty);
            assert_eq!(ready(&mut s, b'I'), empty);
            assert_eq!(ex.capture, Some((0, Some(want.map(str::to_owned)))));
            // The client's next request: its row passes, the capture stays the lookup's.
            ex.pending += 1;
            let mut s = server(&mut ex, &mut reported);
            let row = data_row(Some(b"7"));
            assert_eq!(s.on_frame(h(&row), Some(&row)), Action::Forward);
            assert_eq!(ex.capture, Some((0, Some(want.map(str::to_owned)))));
        }
        // No row: the capture stays empty (no organization has the key).
        let mut ex = asked();
        let mut reported = Reported::default();
        let mut s = server(&mut ex, &mut reported);
        ready(&mut s, b'I');
        assert_eq!(ex.capture, Some((0, None)));
    }

    /// Messages the proxy adds inside a client's batch are found by position: their answers
    /// begin once the answers to everything sent before them ended, whatever those were.
    #[test]
    fn answers_to_messages_added_inside_a_batch_are_dropped_by_position() {
        let mut ex = Exchange::default();
        // The client: Parse, Bind, Execute; then the proxy's five; then the client's Bind.
        let mut sent = Vec::new();
        for tag in [FE_PARSE, FE_BIND, FE_EXECUTE] {
            sent.extend_from_slice(&[tag, 0, 0, 0, 4]);
        }
        ex.note_sent(&sent);
        ex.unsynced = true;
        let mut own = Vec::new();
        for tag in [FE_CLOSE, FE_CLOSE, FE_PARSE, FE_BIND, FE_EXECUTE] {
            own.extend_from_slice(&[tag, 0, 0, 0, 4]);
        }
        ex.add_own(&own);
        ex.note_sent_tag(FE_CLOSE);
        ex.pending += 1; // the batch's Sync
        let mut reported = Reported::default();
        let mut s = server(&mut ex, &mut reported);
        let h = |tag| Header { tag, len: 4 };
        let frame = |tag| [tag, 0, 0, 0, 4];
        let empty = Action::Replace(Vec::new());
        // The client's answers pass: three end, rows between them.
        for tag in [
            BE_PARSE_COMPLETE,
            BE_BIND_COMPLETE,
            BE_DATA_ROW,
            BE_DATA_ROW,
        ] {
            assert_eq!(s.on_frame(h(tag), Some(&frame(tag))), Action::Forward);
        }
        assert!(!s.wants_body(BE_COMMAND_COMPLETE));
        assert_eq!(s.on_frame(h(BE_COMMAND_COMPLETE), None), Action::Forward);
        // The proxy's: dropped, its row included, a notice passes.
        for tag in [
            BE_CLOSE_COMPLETE,
            BE_CLOSE_COMPLETE,
            BE_PARSE_COMPLETE,
            BE_BIND_COMPLETE,
            BE_DATA_ROW,
        ] {
            assert!(s.wants_body(tag));
            assert_eq!(
                s.on_frame(h(tag), Some(&frame(tag))),
                empty,
                "{}",
                tag as char
            );
        }
        assert_eq!(
            s.on_frame(h(BE_NOTICE_RESPONSE), Some(&frame(BE_NOTICE_RESPONSE))),
            Action::Forward
        );
        assert_eq!(
            s.on_frame(h(BE_COMMAND_COMPLETE), Some(&frame(BE_COMMAND_COMPLETE))),
            empty
        );
        // The client's next answers pass.
        assert!(!s.wants_body(BE_BIND_COMPLETE));
        assert_eq!(s.on_frame(h(BE_BIND_COMPLETE), None), Action::Forward);
        assert_eq!(ready(&mut s, b'I'), Action::Forward);
        assert!(ex.added.is_empty() && ex.dropping_added == 0);

        // An error before the added messages: the batch stops, nothing is dropped.
        ex.note_sent_tag(FE_BIND);
        ex.add_own(&own);
        ex.pending += 1;
        let mut s = server(&mut ex, &mut reported);
        assert_eq!(s.on_frame(h(BE_ERROR_RESPONSE), None), Action::Forward);
        assert_eq!(ready(&mut s, b'I'), Action::Forward);
        assert!(ex.added.is_empty() && ex.ended == 0);
    }

    /// A COPY FROM STDIN begun by an Execute: the backend ignores the Syncs sent during it
    /// (tokio-postgres sends one right after the Execute), so they are no requests.
    #[test]
    fn syncs_sent_during_an_extended_copy_in_are_not_requests() {
        let mut ex = Exchange::default();
        for tag in [
            FE_BIND,
            FE_EXECUTE,
            FE_SYNC,
            FE_COPY_DATA,
            FE_COPY_DONE,
            FE_SYNC,
        ] {
            crate::frontend::router::count(&mut ex, tag);
        }
        assert_eq!(ex.pending, 1);
        // A simple query's COPY: its Query is the request.
        let mut ex = Exchange::default();
        for tag in [FE_QUERY, FE_COPY_DATA, FE_COPY_DONE] {
            crate::frontend::router::count(&mut ex, tag);
        }
        assert_eq!(ex.pending, 1);
    }

    #[test]
    fn the_clouds_settings_are_noted_and_the_direct_sides_dropped() {
        let mut ex = Exchange::default();
        let mut reported = Reported::default();
        let mut frame = vec![b'S', 0, 0, 0, 0];
        frame.extend_from_slice(b"TimeZone\0Europe/Paris\0");
        let h = Header {
            tag: BE_PARAMETER_STATUS,
            len: frame.len() as u32 - 1,
        };
        let mut s = server(&mut ex, &mut reported);
        assert_eq!(s.on_frame(h, Some(&frame)), Action::Forward);
        s.side = Side::Direct;
        assert_eq!(s.on_frame(h, Some(&frame)), Action::Replace(Vec::new()));
        assert_eq!(
            reported.params,
            vec![("TimeZone".to_owned(), "Europe/Paris".to_owned())]
        );
        assert_eq!(reported.version, 1);
        let mut other = vec![b'S', 0, 0, 0, 0];
        other.extend_from_slice(b"server_version\x0018.6\0");
        reported.note(&other[5..]);
        reported.note(&frame[5..]);
        assert_eq!(reported.version, 1, "unchanged and uncopied settings");
    }

    #[test]
    fn copy_in_stays_pending_until_ready() {
        let mut exs = Exchanges::default();
        let mut router = Router::default();
        let mut c = ClientFrames {
            exchanges: &mut exs,
            route_log: false,
            meta: None,
            router: &mut router,
            record: None,
            tx: None,
        };
        c.on_frame(hdr(FE_QUERY), None);
        c.on_frame(hdr(FE_COPY_DATA), None);
        c.on_frame(hdr(FE_COPY_DONE), None);
        let ex = &mut exs.cloud;
        assert_eq!(ex.pending, 1);
        assert!(!ex.unsynced);
        let mut reported = Reported::default();
        ready(&mut server(ex, &mut reported), b'I');
        assert!(ex.is_idle());
    }

    /// A Bind body after its portal and statement names.
    fn bind_tail(formats: &[i16], params: &[Option<&[u8]>]) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend((formats.len() as i16).to_be_bytes());
        for f in formats {
            b.extend(f.to_be_bytes());
        }
        b.extend((params.len() as i16).to_be_bytes());
        for p in params {
            match p {
                Some(v) => {
                    b.extend((v.len() as i32).to_be_bytes());
                    b.extend(*v);
                }
                None => b.extend((-1i32).to_be_bytes()),
            }
        }
        b
    }

    #[test]
    fn bound_organizations_are_read_by_their_type() {
        let read = |tail: Vec<u8>, n, ty| {
            let mut body = b"\0\0".to_vec();
            body.extend(tail);
            bind_param(&Bind::decode(&body)?, n, ty)
        };
        let text = bind_tail(&[], &[Some(b"x"), Some(b"acme")]);
        assert_eq!(
            read(text.clone(), 2, ValueType::Text).unwrap().as_deref(),
            Some("acme")
        );
        assert_eq!(
            read(text.clone(), 3, ValueType::Text).unwrap(),
            None,
            "no third parameter"
        );
        assert_eq!(read(text, 0, ValueType::Text).unwrap(), None);
        let eight = 42i64.to_be_bytes();
        let binary = bind_tail(&[1], &[Some(&eight[..])]);
        assert_eq!(
            read(binary.clone(), 1, ValueType::Int8).unwrap().as_deref(),
            Some("42")
        );
        // Eight bytes of a parameter whose type is not known are not guessed at.
        assert_eq!(read(binary, 1, ValueType::Other).unwrap(), None);
        let four = 7i32.to_be_bytes();
        let mixed = bind_tail(&[0, 1], &[Some(b"12"), Some(&four[..])]);
        assert_eq!(
            read(mixed.clone(), 1, ValueType::Int8).unwrap().as_deref(),
            Some("12")
        );
        assert_eq!(
            read(mixed, 2, ValueType::Int4).unwrap().as_deref(),
            Some("7")
        );
        // A text id bound in binary (asyncpg, tokio-postgres): its text, not the int2 12592.
        let ten = bind_tail(&[1], &[Some(b"10")]);
        assert_eq!(
            read(ten, 1, ValueType::Text).unwrap().as_deref(),
            Some("10")
        );
        assert_eq!(
            read(bind_tail(&[], &[None]), 1, ValueType::Text).unwrap(),
            None
        );
        // A length past the end is an error, not a panic.
        let mut truncated = bind_tail(&[], &[Some(b"acme")]);
        truncated.truncate(truncated.len() - 2);
        assert!(read(truncated, 1, ValueType::Text).is_err());
    }

    #[test]
    fn terminate_stops_and_is_not_forwarded() {
        let mut exs = Exchanges::default();
        let mut router = Router::default();
        let mut c = ClientFrames {
            exchanges: &mut exs,
            route_log: false,
            meta: None,
            router: &mut router,
            record: None,
            tx: None,
        };
        assert!(c.wants_body(FE_TERMINATE));
        assert_eq!(
            c.on_frame(hdr(FE_TERMINATE), Some(b"X\0\0\0\x04")),
            Action::Stop
        );
        assert!(exs.cloud.terminated);
    }
}
