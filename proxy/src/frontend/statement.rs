//! The one point every client statement passes before it is forwarded.
//!
//! Today every statement goes to the cloud; statement routing plugs in here, where
//! the frame is whole (Query, Parse, Bind) and nothing has been sent yet. With `route_log`
//! the analysis already runs here and is logged. The tracker that
//! knows whether the backend is between requests also lives here, because it sees
//! every frame of both directions.

use super::pump::{Action, Inspect};
use crate::record::{Kind, Recorder};
use crate::route::analysis::{copy_out_of_loka_table, Analysis, Org};
use crate::route::meta::CoreMeta;
use lokadb_shared::wire::fields::Fields;
use lokadb_shared::wire::tags::*;
use lokadb_shared::wire::FrameError;
use lokadb_shared::wire::Header;
use std::collections::HashMap;

/// Where a statement is sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// The cloud database, which is always correct.
    Cloud,
}

impl Route {
    fn as_str(self) -> &'static str {
        match self {
            Route::Cloud => "cloud",
        }
    }
}

/// What the session knows about its backend's request/response state.
#[derive(Debug, Clone, Copy)]
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
}

impl Default for Exchange {
    fn default() -> Self {
        Exchange {
            pending: 0,
            unsynced: false,
            status: TX_IDLE,
            terminated: false,
        }
    }
}

impl Exchange {
    /// Whether the backend is between requests, outside any transaction: it can be
    /// reset and pooled, or the session closed without interrupting anything.
    pub fn is_idle(&self) -> bool {
        self.pending == 0 && !self.unsynced && self.status == TX_IDLE
    }

    /// Whether the backend is between requests (maybe in a transaction, which a
    /// ROLLBACK ends).
    pub fn is_settled(&self) -> bool {
        self.pending == 0 && !self.unsynced
    }
}

/// What the session knows of its statements for routing: the analysis of each prepared
/// statement by name (`""` for the unnamed one), so a Bind can be placed by its values.
#[derive(Default)]
pub struct Statements {
    prepared: HashMap<String, Analysis>,
}

/// The most prepared statements a session's routing remembers; past it the map starts
/// over (a Bind of a forgotten statement is not logged).
const MAX_PREPARED: usize = 1000;

/// Inspects client → cloud frames.
pub struct ClientFrames<'a> {
    /// Shared exchange state.
    pub exchange: &'a mut Exchange,
    /// Log each statement's route (`route_log`).
    pub route_log: bool,
    /// The database's routing metadata, when the watcher has loaded it.
    pub meta: Option<&'a CoreMeta>,
    /// The session's prepared statements' analyses.
    pub statements: &'a mut Statements,
    /// The core's traffic recording and this session's id in it.
    pub record: Option<(&'a Recorder, u32)>,
}

impl Inspect for ClientFrames<'_> {
    #[inline]
    fn wants_body(&self, tag: u8) -> bool {
        match tag {
            FE_TERMINATE => true,
            // Whole whenever the database has LokaDB tables: a statement may need refusing.
            FE_QUERY | FE_PARSE => self.route_log || self.meta.is_some_and(|m| m.has_tables()),
            FE_BIND | FE_CLOSE => self.route_log,
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
        let ex = &mut *self.exchange;
        match header.tag {
            FE_TERMINATE => {
                ex.terminated = true;
                return Action::Stop;
            }
            FE_QUERY | FE_SYNC | FE_FUNCTION_CALL => {
                ex.pending += 1;
                ex.unsynced = false;
            }
            // COPY data belongs to a request already counted.
            FE_COPY_DATA | FE_COPY_DONE | FE_COPY_FAIL => {}
            _ => ex.unsynced = true,
        }
        let Some(frame) = frame else {
            return Action::Forward;
        };
        if header.tag == FE_QUERY || header.tag == FE_PARSE {
            if let Some(refusal) = self.refusal(header.tag, &frame[5..]) {
                return Action::Replace(refusal);
            }
        }
        if self.route_log {
            // A malformed message is the cloud's to refuse; the log just skips it.
            let _ = self.log_route(header.tag, &frame[5..]);
        }
        Action::Forward
    }
}

/// Dollar-quote tag of the refusal's DO block.
const REFUSAL_TAG: &str = "$lokadb_refusal$";

impl ClientFrames<'_> {
    /// A Query or Parse the proxy does not forward, as the same message with a statement
    /// that makes the cloud raise the refusal: the error comes in the stream's order, behind
    /// the answers to whatever the client pipelined before it, with no state in the proxy
    /// (a replaced Parse raises it when the client executes it). Today:
    /// `COPY <LokaDB table> TO …` (the whole message is refused).
    fn refusal(&self, tag: u8, body: &[u8]) -> Option<Vec<u8>> {
        let meta = self.meta?;
        let mut f = Fields::new(body, "statement");
        let statement = if tag == FE_PARSE {
            Some(f.cstr().ok()?)
        } else {
            None
        };
        let sql = f.cstr().ok()?;
        let table = copy_out_of_loka_table(sql, &meta.meta.catalog)?;
        let name = format!("{}.{}", ident(&table.schema), ident(&table.name));
        let message = format!(
            "COPY of LokaDB table {name} needs an organization: the table holds every organization's rows"
        );
        let hint = format!(
            "Copy one organization's rows: COPY (SELECT * FROM {name} WHERE {} = '…') TO STDOUT",
            ident(&table.org_column)
        );
        if self.route_log {
            let kind = if tag == FE_PARSE { "parse" } else { "query" };
            tracing::info!(target: "lokadb::route", route = "refused", kind, statement = %sql.chars().take(200).collect::<String>());
        }
        let (message, hint) = if message.contains(REFUSAL_TAG) || hint.contains(REFUSAL_TAG) {
            (
                "COPY of a LokaDB table needs an organization".to_owned(),
                "Copy one organization's rows: COPY (SELECT … WHERE <organization column> = '…') TO STDOUT".to_owned(),
            )
        } else {
            (message, hint)
        };
        let sql = format!(
            "DO {REFUSAL_TAG}BEGIN RAISE EXCEPTION USING ERRCODE = '0A000', MESSAGE = '{}', HINT = '{}'; END{REFUSAL_TAG}",
            message.replace('\'', "''"),
            hint.replace('\'', "''"),
        );
        let mut body = Vec::with_capacity(sql.len() + 64);
        if let Some(statement) = statement {
            body.extend_from_slice(statement.as_bytes());
            body.push(0);
        }
        body.extend_from_slice(sql.as_bytes());
        body.push(0);
        if statement.is_some() {
            // No parameter types: the DO block takes none.
            body.extend_from_slice(&0i16.to_be_bytes());
        }
        let mut frame = Vec::with_capacity(body.len() + 5);
        frame.push(tag);
        frame.extend_from_slice(&((body.len() + 4) as u32).to_be_bytes());
        frame.extend_from_slice(&body);
        Some(frame)
    }
}

/// An identifier as SQL would need it written (quoted unless plain lower case).
fn ident(name: &str) -> String {
    let plain = name
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_lowercase() || c == '_')
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    if plain {
        name.to_owned()
    } else {
        format!("\"{}\"", name.replace('"', "\"\""))
    }
}

impl ClientFrames<'_> {
    /// `route_log`: one line per Query and Parse, and per Bind that places its statement
    /// by a parameter, with the route and what the analysis found.
    fn log_route(&mut self, tag: u8, body: &[u8]) -> Result<(), FrameError> {
        let mut f = Fields::new(body, "statement");
        let meta = self.meta;
        let analyse = |sql: &str| match meta {
            Some(m) => m.analyze(sql),
            None => Analysis::Unplaced("no routing metadata (no auth_user, or not loaded yet)"),
        };
        let (kind, text, analysis) = match tag {
            FE_QUERY => {
                let text = f.cstr()?;
                ("query", text, analyse(text))
            }
            FE_PARSE => {
                let name = f.cstr()?;
                let text = f.cstr()?;
                let analysis = analyse(text);
                if self.statements.prepared.len() >= MAX_PREPARED {
                    self.statements.prepared.clear();
                }
                self.statements
                    .prepared
                    .insert(name.to_owned(), analysis.clone());
                (
                    if name.is_empty() { "parse" } else { "prepare" },
                    text,
                    analysis,
                )
            }
            FE_BIND => {
                let _portal = f.cstr()?;
                let name = f.cstr()?;
                let Some(Analysis::Org {
                    org: Org::Param(n),
                    tables,
                }) = self.statements.prepared.get(name)
                else {
                    return Ok(());
                };
                let value = bind_param(&mut f, *n)?;
                let org = Analysis::Org {
                    org: Org::Literal(value),
                    tables: tables.clone(),
                };
                ("bind", name, org)
            }
            FE_CLOSE => {
                if f.u8()? == b'S' {
                    self.statements.prepared.remove(f.cstr()?);
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
            Analysis::Unplaced(why) => ("?".to_owned(), *why),
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
            route = Route::Cloud.as_str(),
            kind,
            org = %org,
            tables = %tables,
            why,
            statement = %text
        );
        Ok(())
    }
}

/// The value bound to parameter `$n` (1-based) of a Bind body whose portal and statement
/// names were read: text as is; binary as an integer when 2, 4 or 8 bytes (the usual
/// organization column types), else as text if it is UTF-8.
fn bind_param(f: &mut Fields<'_>, n: u16) -> Result<String, FrameError> {
    let formats: Vec<i16> = (0..f.i16()?.max(0))
        .map(|_| f.i16())
        .collect::<Result<_, _>>()?;
    let count = f.i16()?.max(0) as u16;
    let index = usize::from(n.saturating_sub(1));
    if n == 0 || n > count {
        return Ok("?".to_owned());
    }
    for i in 0..count {
        let len = f.i32()?;
        let bytes = if len < 0 {
            None
        } else {
            Some(f.take(len as usize)?)
        };
        if usize::from(i) != index {
            continue;
        }
        let Some(bytes) = bytes else {
            return Ok("NULL".to_owned());
        };
        let binary = match formats.len() {
            0 => false,
            1 => formats[0] == 1,
            _ => formats.get(index) == Some(&1),
        };
        return Ok(match (binary, bytes.len()) {
            (true, 2) => i16::from_be_bytes([bytes[0], bytes[1]]).to_string(),
            (true, 4) => i32::from_be_bytes(bytes.try_into().expect("4 bytes")).to_string(),
            (true, 8) => i64::from_be_bytes(bytes.try_into().expect("8 bytes")).to_string(),
            _ => String::from_utf8_lossy(bytes).into_owned(),
        });
    }
    Ok("?".to_owned())
}

/// Inspects cloud → client frames: only ReadyForQuery matters.
pub struct ServerFrames<'a> {
    /// Shared exchange state.
    pub exchange: &'a mut Exchange,
    /// The core's traffic recording and this session's id in it.
    pub record: Option<(&'a Recorder, u32)>,
}

impl Inspect for ServerFrames<'_> {
    #[inline]
    fn wants_body(&self, tag: u8) -> bool {
        tag == BE_READY_FOR_QUERY
    }

    #[inline]
    fn on_read(&mut self, bytes: &[u8]) {
        if let Some((rec, session)) = self.record {
            rec.record(Kind::Backend, session, bytes);
        }
    }

    #[inline]
    fn on_frame(&mut self, header: Header, frame: Option<&[u8]>) -> Action {
        if header.tag == BE_READY_FOR_QUERY {
            self.exchange.pending = self.exchange.pending.saturating_sub(1);
            if let Some(&status) = frame.and_then(|f| f.get(5)) {
                self.exchange.status = status;
            }
        }
        Action::Forward
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hdr(tag: u8) -> Header {
        Header { tag, len: 4 }
    }

    #[test]
    fn extended_protocol_is_settled_only_after_sync_and_ready() {
        let mut ex = Exchange::default();
        let mut statements = Statements::default();
        let mut c = ClientFrames {
            exchange: &mut ex,
            route_log: false,
            meta: None,
            statements: &mut statements,
            record: None,
        };
        for tag in [FE_PARSE, FE_BIND, FE_EXECUTE] {
            c.on_frame(hdr(tag), None);
        }
        assert!(!c.exchange.is_settled(), "Parse/Bind/Execute without Sync");
        c.on_frame(hdr(FE_SYNC), None);
        assert_eq!(ex.pending, 1);
        let mut s = ServerFrames {
            exchange: &mut ex,
            record: None,
        };
        s.on_frame(
            Header {
                tag: BE_READY_FOR_QUERY,
                len: 5,
            },
            Some(b"Z\0\0\0\x05T"),
        );
        assert!(ex.is_settled());
        assert!(!ex.is_idle(), "in a transaction block");
    }

    #[test]
    fn copy_in_stays_pending_until_ready() {
        let mut ex = Exchange::default();
        let mut statements = Statements::default();
        let mut c = ClientFrames {
            exchange: &mut ex,
            route_log: false,
            meta: None,
            statements: &mut statements,
            record: None,
        };
        c.on_frame(hdr(FE_QUERY), None);
        c.on_frame(hdr(FE_COPY_DATA), None);
        c.on_frame(hdr(FE_COPY_DONE), None);
        assert_eq!(ex.pending, 1);
        assert!(!ex.unsynced);
        let mut s = ServerFrames {
            exchange: &mut ex,
            record: None,
        };
        s.on_frame(
            Header {
                tag: BE_READY_FOR_QUERY,
                len: 5,
            },
            Some(b"Z\0\0\0\x05I"),
        );
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
    fn bound_organizations_are_read_in_text_and_binary() {
        let read = |body: Vec<u8>, n| bind_param(&mut Fields::new(&body, "bind"), n);
        let text = bind_tail(&[], &[Some(b"x"), Some(b"acme")]);
        assert_eq!(read(text.clone(), 2).unwrap(), "acme");
        assert_eq!(read(text.clone(), 3).unwrap(), "?", "no third parameter");
        assert_eq!(read(text, 0).unwrap(), "?");
        let eight = 42i64.to_be_bytes();
        let binary = bind_tail(&[1], &[Some(&eight[..])]);
        assert_eq!(read(binary, 1).unwrap(), "42");
        let four = 7i32.to_be_bytes();
        let mixed = bind_tail(&[0, 1], &[Some(b"12"), Some(&four[..])]);
        assert_eq!(read(mixed.clone(), 1).unwrap(), "12");
        assert_eq!(read(mixed, 2).unwrap(), "7");
        assert_eq!(read(bind_tail(&[], &[None]), 1).unwrap(), "NULL");
        // A length past the end is an error, not a panic.
        let mut truncated = bind_tail(&[], &[Some(b"acme")]);
        truncated.truncate(truncated.len() - 2);
        assert!(read(truncated, 1).is_err());
    }

    #[test]
    fn terminate_stops_and_is_not_forwarded() {
        let mut ex = Exchange::default();
        let mut statements = Statements::default();
        let mut c = ClientFrames {
            exchange: &mut ex,
            route_log: false,
            meta: None,
            statements: &mut statements,
            record: None,
        };
        assert!(c.wants_body(FE_TERMINATE));
        assert_eq!(
            c.on_frame(hdr(FE_TERMINATE), Some(b"X\0\0\0\x04")),
            Action::Stop
        );
        assert!(ex.terminated);
    }
}
