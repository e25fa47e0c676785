//! The one point every client statement passes before it is forwarded.
//!
//! Today every statement goes to the cloud; statement routing plugs in here, where
//! the frame is whole (Query, Parse) and nothing has been sent yet. The tracker that
//! knows whether the backend is between requests also lives here, because it sees
//! every frame of both directions.

use super::pump::{Action, Inspect};
use lokadb_shared::wire::fields::Fields;
use lokadb_shared::wire::tags::*;
use lokadb_shared::wire::Header;

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

/// Inspects client → cloud frames.
pub struct ClientFrames<'a> {
    /// Shared exchange state.
    pub exchange: &'a mut Exchange,
    /// Log each statement's route (`route_log`).
    pub route_log: bool,
}

impl Inspect for ClientFrames<'_> {
    #[inline]
    fn wants_body(&self, tag: u8) -> bool {
        match tag {
            FE_TERMINATE => true,
            FE_QUERY | FE_PARSE => self.route_log,
            _ => false,
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
        if let Some(frame) = frame {
            if header.tag == FE_QUERY || header.tag == FE_PARSE {
                log_route(header.tag, &frame[5..], Route::Cloud);
            }
        }
        Action::Forward
    }
}

fn log_route(tag: u8, body: &[u8], route: Route) {
    let mut f = Fields::new(body, "statement");
    let (kind, text) = if tag == FE_PARSE {
        let name = f.cstr().unwrap_or("?");
        (
            if name.is_empty() { "parse" } else { "prepare" },
            f.cstr().unwrap_or("?"),
        )
    } else {
        ("query", f.cstr().unwrap_or("?"))
    };
    let text: String = text.chars().take(200).collect();
    tracing::info!(target: "lokadb::route", route = route.as_str(), kind, statement = %text);
}

/// Inspects cloud → client frames: only ReadyForQuery matters.
pub struct ServerFrames<'a> {
    /// Shared exchange state.
    pub exchange: &'a mut Exchange,
}

impl Inspect for ServerFrames<'_> {
    #[inline]
    fn wants_body(&self, tag: u8) -> bool {
        tag == BE_READY_FOR_QUERY
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
        let mut c = ClientFrames {
            exchange: &mut ex,
            route_log: false,
        };
        for tag in [FE_PARSE, FE_BIND, FE_EXECUTE] {
            c.on_frame(hdr(tag), None);
        }
        assert!(!c.exchange.is_settled(), "Parse/Bind/Execute without Sync");
        c.on_frame(hdr(FE_SYNC), None);
        assert_eq!(ex.pending, 1);
        let mut s = ServerFrames { exchange: &mut ex };
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
        let mut c = ClientFrames {
            exchange: &mut ex,
            route_log: false,
        };
        c.on_frame(hdr(FE_QUERY), None);
        c.on_frame(hdr(FE_COPY_DATA), None);
        c.on_frame(hdr(FE_COPY_DONE), None);
        assert_eq!(ex.pending, 1);
        assert!(!ex.unsynced);
        let mut s = ServerFrames { exchange: &mut ex };
        s.on_frame(
            Header {
                tag: BE_READY_FOR_QUERY,
                len: 5,
            },
            Some(b"Z\0\0\0\x05I"),
        );
        assert!(ex.is_idle());
    }

    #[test]
    fn terminate_stops_and_is_not_forwarded() {
        let mut ex = Exchange::default();
        let mut c = ClientFrames {
            exchange: &mut ex,
            route_log: false,
        };
        assert!(c.wants_body(FE_TERMINATE));
        assert_eq!(
            c.on_frame(hdr(FE_TERMINATE), Some(b"X\0\0\0\x04")),
            Action::Stop
        );
        assert!(ex.terminated);
    }
}
