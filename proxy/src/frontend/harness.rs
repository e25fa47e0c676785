//! A deterministic in-memory harness for a session's routing: the router, both
//! backends' exchanges and the switch, driven message by message against scripted cloud
//! and organization backends in the order the session loop (`session.rs`) drives them
//! against sockets — client frames through [`ClientFrames`], the proxy's own requests
//! from the exchanges' outboxes first, the switch once the side in use has answered,
//! backend answers through [`ServerFrames`]. No runtime, no clock, no sockets: each test
//! reads the exact sequence of messages each party saw.

use super::pump::{Action, Inspect};
use super::router::{Exchanges, Privileges, Router, Side};
use super::statement::{ClientFrames, Reported, ServerFrames};
use super::switch::{self, Link, OpenError, Opened};
use crate::backend::at_login::TxDefaults;
use crate::org::OrgId;
use crate::route::analysis::{Catalog, LokaTable};
use crate::route::meta::{CoreMeta, DirectPath, DirectWrites, Meta, OrgMeta, RelayEnd};
use lokadb_shared::wire::backend::{self as be, ErrorFields, Severity};
use lokadb_shared::wire::frontend::{Bind, Close, Statement};
use lokadb_shared::wire::tags::*;
use lokadb_shared::wire::Header;
use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::Arc;
use std::task::Poll;

/// What a scripted backend answers a statement with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// Rows of one text column, then `SELECT n`.
    Rows(Vec<String>),
    /// A command tag alone.
    Tag(String),
    /// An ErrorResponse with this SQLSTATE.
    Error(&'static str),
}

/// A scripted Postgres backend: it keeps a transaction status and prepared statements
/// as Postgres does, and answers each statement by its script — by default a read
/// answers one row naming the backend, so a test sees where it ran.
pub struct Scripted {
    name: &'static str,
    status: u8,
    inbox: Vec<u8>,
    /// Answers not yet read by the session.
    out: std::collections::VecDeque<Vec<u8>>,
    /// Prepared statements and portals: their text.
    statements: HashMap<String, String>,
    portals: HashMap<String, String>,
    /// After an error in an extended-protocol batch: messages are skipped until Sync.
    skipping: bool,
    /// Statements whose text contains the key answer the value instead of the default.
    replies: Vec<(String, Reply)>,
    /// The database refuses connections (an organization's only).
    pub down: bool,
}

impl Scripted {
    fn new(name: &'static str) -> Scripted {
        Scripted {
            name,
            status: TX_IDLE,
            inbox: Vec::new(),
            out: Default::default(),
            statements: HashMap::new(),
            portals: HashMap::new(),
            skipping: false,
            replies: Vec::new(),
            down: false,
        }
    }

    /// Statements containing `needle` answer `reply`.
    pub fn reply(&mut self, needle: &str, reply: Reply) {
        self.replies.push((needle.to_owned(), reply));
    }

    /// A new connection: no transaction, no prepared statements.
    fn reconnect(&mut self) {
        self.status = TX_IDLE;
        self.statements.clear();
        self.portals.clear();
        self.skipping = false;
        self.inbox.clear();
        self.out.clear();
    }

    fn answer(&mut self, frame: Vec<u8>) {
        self.out.push_back(frame);
    }

    fn ready(&mut self) {
        let mut f = Vec::new();
        be::ready_for_query(&mut f, self.status);
        self.answer(f);
    }

    /// Runs one statement; false when it failed.
    fn run(&mut self, sql: &str, log: &mut Vec<String>, describe_rows: bool) -> bool {
        let sql = sql.trim();
        log.push(format!("{} <- {sql}", self.name));
        let word = sql
            .split_whitespace()
            .next()
            .unwrap_or("")
            .to_ascii_uppercase();
        let mut f = Vec::new();
        if self.status == TX_FAILED && !matches!(word.as_str(), "ROLLBACK" | "COMMIT" | "END") {
            self.error("25P02");
            return false;
        }
        let scripted = self
            .replies
            .iter()
            .find(|(needle, _)| sql.contains(needle.as_str()))
            .map(|(_, r)| r.clone());
        let reply = match (scripted, word.as_str()) {
            (Some(r), _) => r,
            // The proxy's refusals: a DO block that raises the refusal's SQLSTATE.
            (None, "DO") => match sql.split("ERRCODE = '").nth(1) {
                Some(rest) => {
                    self.error(&rest[..5]);
                    return false;
                }
                None => Reply::Tag("DO".into()),
            },
            (None, "BEGIN" | "START") => {
                self.status = TX_IN_BLOCK;
                Reply::Tag("BEGIN".into())
            }
            (None, "COMMIT" | "END") => {
                let tag = if self.status == TX_FAILED {
                    "ROLLBACK"
                } else {
                    "COMMIT"
                };
                self.status = TX_IDLE;
                Reply::Tag(tag.into())
            }
            (None, "ROLLBACK") => {
                self.status = TX_IDLE;
                Reply::Tag("ROLLBACK".into())
            }
            (None, "SELECT" | "WITH") => Reply::Rows(vec![self.name.to_owned()]),
            (None, "UPDATE") => Reply::Tag("UPDATE 1".into()),
            (None, "DELETE") => Reply::Tag("DELETE 1".into()),
            (None, "INSERT") => Reply::Tag("INSERT 0 1".into()),
            (None, _) => Reply::Tag(word.clone()),
        };
        match reply {
            Reply::Rows(rows) => {
                if describe_rows {
                    be::row_description_text(&mut f, &["v"]);
                }
                for r in &rows {
                    be::data_row(&mut f, &[Some(r)]);
                }
                be::command_complete(&mut f, &format!("SELECT {}", rows.len()));
                self.answer(f);
                true
            }
            Reply::Tag(tag) => {
                be::command_complete(&mut f, &tag);
                self.answer(f);
                true
            }
            Reply::Error(code) => {
                self.error(code);
                false
            }
        }
    }

    fn error(&mut self, code: &str) {
        let mut f = Vec::new();
        be::error_response(
            &mut f,
            &ErrorFields {
                severity: Severity::Error,
                code,
                message: "scripted error",
                detail: None,
                hint: None,
            },
        );
        self.answer(f);
        if self.status == TX_IN_BLOCK {
            self.status = TX_FAILED;
        }
    }

    /// Answers every whole message received.
    fn serve(&mut self, log: &mut Vec<String>) {
        while let Ok(Some(h)) = Header::peek(&self.inbox, u32::MAX) {
            let len = h.frame_len();
            if self.inbox.len() < len {
                return;
            }
            let frame: Vec<u8> = self.inbox.drain(..len).collect();
            let body = &frame[5..];
            if self.skipping && h.tag != FE_SYNC {
                continue;
            }
            let mut f = Vec::new();
            match h.tag {
                FE_QUERY => {
                    let q = Statement::decode(FE_QUERY, body).expect("a Query");
                    for part in statements(q.sql) {
                        if !self.run(part, log, true) {
                            break;
                        }
                    }
                    self.ready();
                }
                FE_PARSE => {
                    let p = Statement::decode(FE_PARSE, body).expect("a Parse");
                    let name = p.name.unwrap_or_default();
                    log.push(format!("{} <- Parse {name:?}: {}", self.name, p.sql));
                    self.statements.insert(name.to_owned(), p.sql.to_owned());
                    be::write_frame(&mut f, BE_PARSE_COMPLETE, |_| {});
                    self.answer(f);
                }
                FE_BIND => {
                    let b = Bind::decode(body).expect("a Bind");
                    match self.statements.get(b.statement) {
                        Some(sql) => {
                            self.portals.insert(b.portal.to_owned(), sql.clone());
                            be::write_frame(&mut f, BE_BIND_COMPLETE, |_| {});
                            self.answer(f);
                        }
                        None => {
                            log.push(format!(
                                "{} <- Bind of unknown {:?}",
                                self.name, b.statement
                            ));
                            self.error("26000");
                            self.skipping = true;
                        }
                    }
                }
                FE_DESCRIBE => {
                    be::write_frame(&mut f, BE_NO_DATA, |_| {});
                    self.answer(f);
                }
                FE_EXECUTE => {
                    let portal = lokadb_shared::wire::fields::Fields::new(body, "Execute")
                        .cstr()
                        .unwrap_or_default()
                        .to_owned();
                    let sql = self.portals.get(&portal).cloned().unwrap_or_default();
                    if !self.run(&sql, log, false) {
                        self.skipping = true;
                    }
                }
                FE_CLOSE => {
                    let c = Close::decode(body).expect("a Close");
                    if c.kind == b'S' {
                        self.statements.remove(c.name);
                    } else {
                        self.portals.remove(c.name);
                    }
                    be::write_frame(&mut f, BE_CLOSE_COMPLETE, |_| {});
                    self.answer(f);
                }
                FE_SYNC => {
                    self.skipping = false;
                    if self.status == TX_IDLE {
                        self.portals.clear();
                    }
                    self.ready();
                }
                FE_TERMINATE => {}
                other => panic!("the scripted backend got message {:?}", other as char),
            }
        }
    }
}

/// A session's routing between a client and scripted backends.
pub struct Harness {
    pub router: Router,
    pub exchanges: Exchanges,
    reported: Reported,
    meta: CoreMeta,
    pub cloud: Scripted,
    /// Organizations' databases by organization id.
    pub orgs: HashMap<String, Scripted>,
    /// Whose database the direct side is connected to.
    connected: Option<OrgId>,
    /// Direct connections opened.
    pub opened: u32,
    client_in: Vec<u8>,
    /// The client's next message waits for a switch.
    held: bool,
    /// Every message in the order it was delivered: `cloud <- …`, `acme <- …`,
    /// `client <- …`.
    pub log: Vec<String>,
}

/// The metadata of the tests: table `notes` (organization column `organization_id`,
/// text), organization `acme` moved with fdw+direct (`direct`) or in the cloud, every
/// other in the cloud.
fn meta(direct: bool) -> CoreMeta {
    let mut orgs = HashMap::new();
    if direct {
        orgs.insert(
            "acme".to_owned(),
            OrgMeta {
                state: "moved".into(),
                profile: crate::profile::Profile::FdwDirect,
                direct: Some(DirectPath {
                    relays: vec![RelayEnd {
                        addr: "127.0.0.1:9".parse().expect("an address"),
                        tls: Default::default(),
                    }],
                    dbname: "acme/app".into(),
                }),
                owes: false,
            },
        );
    }
    CoreMeta::new(Arc::new(Meta {
        generation: 1,
        catalog: Catalog::new(vec![LokaTable {
            schema: "public".into(),
            name: "notes".into(),
            org_column: "organization_id".into(),
        }])
        .with_org_types(vec!["text".into()]),
        orgs,
        writes: vec![DirectWrites::default()],
        direct_orgs: usize::from(direct),
        owing_orgs: 0,
        set_normalized: true,
    }))
}

impl Harness {
    /// A session of a role that may read and update `notes`, in the database of [`meta`].
    pub fn new() -> Harness {
        Harness::with(true)
    }

    /// The same session with `acme` in the cloud: what the client would see without the
    /// direct path.
    pub fn cloud_only() -> Harness {
        Harness::with(false)
    }

    fn with(direct: bool) -> Harness {
        let mut by_name = HashMap::new();
        by_name.insert(("public".to_owned(), "notes".to_owned()), (true, true));
        let meta = meta(direct);
        let mut router = Router::new(true, Privileges::new(by_name));
        router.privileges.index(&meta.meta.catalog);
        // Read committed, as the session learns at login.
        router.tx_defaults = Some(TxDefaults::default());
        let mut orgs = HashMap::new();
        orgs.insert("acme".to_owned(), Scripted::new("acme"));
        Harness {
            router,
            exchanges: Exchanges::default(),
            reported: Reported::default(),
            meta,
            cloud: Scripted::new("cloud"),
            orgs,
            connected: None,
            opened: 0,
            client_in: Vec::new(),
            held: false,
            log: Vec::new(),
        }
    }

    /// The client sends `bytes` (whole messages); everything that follows is run until
    /// nothing moves. Returns the log lines it added.
    pub fn send(&mut self, bytes: &[u8]) -> Vec<String> {
        let from = self.log.len();
        self.client_in.extend_from_slice(bytes);
        self.run();
        self.log[from..].to_vec()
    }

    /// A simple Query.
    pub fn query(&mut self, sql: &str) -> Vec<String> {
        let mut q = Vec::new();
        lokadb_shared::wire::frontend::query(&mut q, sql);
        self.send(&q)
    }

    /// Simple Queries, one after the other (each answered before the next is sent).
    pub fn queries(&mut self, sqls: &[&str]) -> Vec<String> {
        sqls.iter().flat_map(|sql| self.query(sql)).collect()
    }

    /// Lines of `lines` that the client got.
    pub fn client_got(lines: &[String]) -> Vec<&str> {
        lines
            .iter()
            .filter_map(|l| l.strip_prefix("client <- "))
            .collect()
    }

    /// Statements `who` ran, of `lines`.
    pub fn ran<'a>(lines: &'a [String], who: &str) -> Vec<&'a str> {
        let prefix = format!("{who} <- ");
        lines
            .iter()
            .filter_map(|l| l.strip_prefix(prefix.as_str()))
            .collect()
    }

    fn org_backend(&mut self) -> Option<&mut Scripted> {
        let org = self.connected.as_deref()?;
        self.orgs.get_mut(org)
    }

    fn deliver(&mut self, side: Side, bytes: &[u8]) {
        match side {
            Side::Cloud => self.cloud.inbox.extend_from_slice(bytes),
            Side::Direct => match self.org_backend() {
                Some(b) => b.inbox.extend_from_slice(bytes),
                None => panic!("a message for the direct side with no direct connection"),
            },
        }
    }

    fn run(&mut self) {
        for _ in 0..10_000 {
            if !self.step() {
                return;
            }
        }
        panic!("the session did not settle:\n{}", self.log.join("\n"));
    }

    /// One turn of the session loop; false when nothing moved.
    fn step(&mut self) -> bool {
        let mut progress = false;
        // What the proxy queued of its own goes first.
        for side in [Side::Cloud, Side::Direct] {
            let own = std::mem::take(&mut self.exchanges.get_mut(side).outbox);
            if !own.is_empty() {
                self.deliver(side, &own);
                progress = true;
            }
        }
        // The client gets every answer whole and at once here.
        self.router.down_ready = true;
        // The client's messages, to the side the router sends to, until one is held.
        let target = self.router.target;
        while !self.held {
            let Ok(Some(h)) = Header::peek(&self.client_in, u32::MAX) else {
                break;
            };
            let len = h.frame_len();
            assert!(self.client_in.len() >= len, "tests send whole messages");
            let frame: Vec<u8> = self.client_in[..len].to_vec();
            let mut inspect = ClientFrames {
                exchanges: &mut self.exchanges,
                route_log: false,
                meta: Some(&self.meta),
                router: &mut self.router,
                record: None,
                tx: None,
            };
            let body = inspect.wants_body(h.tag).then_some(&frame[..]);
            match inspect.on_frame(h, body) {
                Action::Hold => {
                    self.held = true;
                    break;
                }
                Action::Forward => self.deliver(target, &frame),
                Action::Replace(bytes) => self.deliver(target, &bytes),
                Action::Stop => {}
            }
            self.client_in.drain(..len);
            progress = true;
        }
        let local = std::mem::take(&mut self.router.local_out);
        if !local.is_empty() {
            self.deliver_to_client(&local);
            progress = true;
        }
        progress |= switch::close_gate(&mut self.router, &mut self.exchanges);
        if self.held && self.exchanges.get(self.router.target).is_settled() {
            let mut link = TestLink {
                orgs: &mut self.orgs,
                connected: &mut self.connected,
                opened: &mut self.opened,
                log: &mut self.log,
            };
            if switch::switch(&mut self.router, &mut self.exchanges, &mut link) {
                self.held = false;
                progress = true;
            }
            progress |=
                !self.exchanges.cloud.outbox.is_empty() || !self.exchanges.direct.outbox.is_empty();
        }
        // The backends answer; the session reads the direct side while it owes answers.
        let mut log = std::mem::take(&mut self.log);
        self.cloud.serve(&mut log);
        if let Some(b) = self.org_backend() {
            b.serve(&mut log);
        }
        self.log = log;
        let direct_busy = self.exchanges.direct.pending > 0 || self.exchanges.direct.unsynced;
        let reading = if direct_busy && self.connected.is_some() {
            Side::Direct
        } else {
            Side::Cloud
        };
        let frame = match reading {
            Side::Cloud => self.cloud.out.pop_front(),
            Side::Direct => self.org_backend().and_then(|b| b.out.pop_front()),
        };
        for frame in frame.iter().flat_map(|f| frames(f)) {
            let h = Header::peek(frame, u32::MAX)
                .expect("a frame")
                .expect("a whole frame");
            let mut inspect = ServerFrames {
                exchange: self.exchanges.get_mut(reading),
                side: reading,
                reported: &mut self.reported,
                record: None,
            };
            let body = inspect.wants_body(h.tag).then_some(frame);
            match inspect.on_frame(h, body) {
                Action::Forward => self.deliver_to_client(frame),
                Action::Replace(bytes) => self.deliver_to_client(&bytes),
                Action::Hold | Action::Stop => panic!("a server frame held or stopped"),
            }
            progress = true;
        }
        progress
    }

    fn deliver_to_client(&mut self, bytes: &[u8]) {
        for f in frames(bytes) {
            let line = describe(f);
            self.log.push(format!("client <- {line}"));
        }
    }
}

/// The statements of a simple query's text: split at semicolons outside quotes and
/// dollar quotes.
fn statements(sql: &str) -> Vec<&str> {
    let (mut parts, mut start, mut i) = (Vec::new(), 0, 0);
    let b = sql.as_bytes();
    while i < b.len() {
        match b[i] {
            b'\'' => i += sql[i + 1..].find('\'').map_or(b.len(), |n| n + 2),
            b'$' => {
                let tag_end = sql[i + 1..].find('$').map_or(b.len(), |n| i + n + 2);
                let tag = &sql[i..tag_end.min(b.len())];
                i = sql[tag_end.min(b.len())..]
                    .find(tag)
                    .map_or(b.len(), |n| tag_end + n + tag.len());
            }
            b';' => {
                parts.push(&sql[start..i]);
                start = i + 1;
                i += 1;
            }
            _ => i += 1,
        }
    }
    parts.push(&sql[start..]);
    parts.retain(|p| !p.trim().is_empty());
    parts
}

/// The whole frames of `bytes`.
fn frames(bytes: &[u8]) -> impl Iterator<Item = &[u8]> {
    let mut at = 0;
    std::iter::from_fn(move || {
        let h = Header::peek(bytes.get(at..)?, u32::MAX).ok()??;
        let f = bytes.get(at..at + h.frame_len())?;
        at += f.len();
        Some(f)
    })
}

/// A backend message in a line: `Z I`, `C UPDATE 1`, `D acme`, `E 40001`.
fn describe(frame: &[u8]) -> String {
    let tag = frame[0] as char;
    let body = &frame[5..];
    let mut line = tag.to_string();
    match frame[0] {
        BE_READY_FOR_QUERY => {
            let _ = write!(line, " {}", body[0] as char);
        }
        BE_COMMAND_COMPLETE => {
            let _ = write!(
                line,
                " {}",
                String::from_utf8_lossy(&body[..body.len() - 1])
            );
        }
        BE_DATA_ROW => {
            let mut f = lokadb_shared::wire::fields::Fields::new(body, "DataRow");
            let n = f.i16().unwrap_or(0);
            for _ in 0..n {
                let len = f.i32().unwrap_or(-1);
                if len < 0 {
                    line.push_str(" NULL");
                } else {
                    let v = f.take(len as usize).unwrap_or_default();
                    let _ = write!(line, " {}", String::from_utf8_lossy(v));
                }
            }
        }
        BE_ERROR_RESPONSE => {
            let code = body
                .split(|&b| b == 0)
                .find_map(|field| field.strip_prefix(b"C"))
                .unwrap_or_default();
            let _ = write!(line, " {}", String::from_utf8_lossy(code));
        }
        _ => {}
    }
    line
}

/// The harness's direct connections: to the scripted organization databases.
struct TestLink<'a> {
    orgs: &'a mut HashMap<String, Scripted>,
    connected: &'a mut Option<OrgId>,
    opened: &'a mut u32,
    log: &'a mut Vec<String>,
}

impl Link for TestLink<'_> {
    fn ensure(
        &mut self,
        org: &OrgId,
        _idle: bool,
        _tx: Option<&TxDefaults>,
    ) -> Poll<Result<Opened, OpenError>> {
        if self.connected.as_deref() == Some(&**org) {
            return Poll::Ready(Ok(Opened::Kept));
        }
        *self.connected = None;
        match self.orgs.get_mut(&**org) {
            Some(db) if !db.down => {
                db.reconnect();
                *self.connected = Some(org.clone());
                *self.opened += 1;
                self.log.push(format!("{org} <- (connected)"));
                Poll::Ready(Ok(Opened::New {
                    status: TX_IDLE,
                    same_lease: false,
                }))
            }
            _ => Poll::Ready(Err(OpenError::Failed("the database is down".into()))),
        }
    }

    fn retarget(&mut self, _side: Side) {}
}
