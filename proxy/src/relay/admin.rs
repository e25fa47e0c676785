//! The relay's admin database: `psql "host=RELAY port=PG_PORT dbname=lokadb_relay"`
//! answers `SHOW STATS` (the relay's counters) and `SHOW TUNNELS` (one row per agent
//! connection). Read-only, no password: it is on the relay's Postgres listener, which
//! only the cloud database and the proxy reach, and it shows counters, not data.

use super::registry::Relay;
use crate::net::stream::ClientStream;
use futures_lite::AsyncReadExt;
use lokadb_shared::wire::backend::{self, ErrorFields, Severity};
use lokadb_shared::wire::{sqlstate, Header};
use std::rc::Rc;

/// The database name of the admin interface; no organization may have it.
pub const ADMIN_DB: &str = "lokadb_relay";
/// Largest query accepted.
const MAX_MESSAGE: u32 = 64 * 1024;
/// Admin sessions at once; the listener is internal, but a leak of idle sessions must
/// not exhaust the relay's file descriptors.
const MAX_SESSIONS: u32 = 16;
/// An admin session idle this long is closed.
const IDLE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

/// Serves one admin session.
pub async fn serve(relay: &Rc<Relay>, tcp: &mut ClientStream) {
    let mut out = Vec::new();
    if relay.admin_sessions.get() >= MAX_SESSIONS {
        backend::error_response(
            &mut out,
            &ErrorFields {
                severity: Severity::Fatal,
                code: sqlstate::TOO_MANY_CONNECTIONS,
                message: &format!(
                    "the relay's admin database takes {MAX_SESSIONS} sessions at once"
                ),
                detail: None,
                hint: None,
            },
        );
        let _ = crate::net::stream::send(tcp, &out).await;
        return;
    }
    relay.admin_sessions.set(relay.admin_sessions.get() + 1);
    session(relay, tcp, &mut out).await;
    relay.admin_sessions.set(relay.admin_sessions.get() - 1);
}

async fn session(relay: &Rc<Relay>, tcp: &mut ClientStream, out: &mut Vec<u8>) {
    backend::auth_ok(out);
    for (k, v) in [
        ("server_version", "18.0 (lokadb relay)"),
        ("client_encoding", "UTF8"),
        ("standard_conforming_strings", "on"),
        ("DateStyle", "ISO, MDY"),
    ] {
        backend::parameter_status(out, k, v);
    }
    backend::ready_for_query(out, b'I');
    if crate::net::stream::send(tcp, out).await.is_err() {
        return;
    }
    loop {
        let mut head = [0u8; 5];
        match crate::time::with_timeout(IDLE_TIMEOUT, tcp.read_exact(&mut head)).await {
            Some(Ok(())) => {}
            _ => return,
        }
        let header = match Header::peek(&head, MAX_MESSAGE) {
            Ok(Some(h)) => h,
            _ => return,
        };
        let mut body = vec![0u8; header.body_len()];
        match crate::time::with_timeout(IDLE_TIMEOUT, tcp.read_exact(&mut body)).await {
            Some(Ok(())) => {}
            _ => return,
        }
        out.clear();
        match header.tag {
            b'X' => return,
            b'Q' => {
                let sql = crate::frontend::console::command_text(&body);
                answer(relay, &sql, out);
                backend::ready_for_query(out, b'I');
            }
            b'S' => backend::ready_for_query(out, b'I'),
            _ => error(
                out,
                sqlstate::FEATURE_NOT_SUPPORTED,
                "the relay's admin database takes simple queries only",
            ),
        }
        if crate::net::stream::send(tcp, out).await.is_err() {
            return;
        }
    }
}

fn answer(relay: &Relay, sql: &str, out: &mut Vec<u8>) {
    match sql.to_ascii_uppercase().as_str() {
        "SHOW STATS" => {
            let counters = super::counters(relay);
            backend::row_description_text(out, &["counter", "value"]);
            for (name, value) in &counters {
                backend::data_row(out, &[Some(name), Some(&value.to_string())]);
            }
            let n = counters.len();
            backend::command_complete(out, &format!("SELECT {n}"));
        }
        "SHOW TUNNELS" => {
            let tunnels = super::tunnel_rows(relay);
            backend::row_description_text(out, &super::TUNNEL_COLUMNS);
            for row in &tunnels {
                let cells: Vec<Option<&str>> = row.iter().map(Option::as_deref).collect();
                backend::data_row(out, &cells);
            }
            backend::command_complete(out, &format!("SELECT {}", tunnels.len()));
        }
        "" => backend::write_frame(out, b'I', |_| {}),
        _ => error(
            out,
            "42601",
            "the relay's admin database answers SHOW STATS and SHOW TUNNELS",
        ),
    }
}

fn error(out: &mut Vec<u8>, code: &str, message: &str) {
    backend::error_response(
        out,
        &ErrorFields {
            severity: Severity::Error,
            code,
            message,
            detail: None,
            hint: None,
        },
    );
}
