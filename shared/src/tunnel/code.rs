//! The error codes carried by RESET and HELLO_REJECT, defined once.

use std::fmt;

/// Why a stream was reset or an agent refused: carried by RESET and HELLO_REJECT.
///
/// A newtype rather than an enum so that a code this version does not know still
/// travels and prints (as its number).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ErrorCode(pub u16);

impl ErrorCode {
    /// No error: the application gave up on the stream.
    pub const CANCEL: ErrorCode = ErrorCode(0);
    /// The peer broke a rule of this protocol.
    pub const PROTOCOL: ErrorCode = ErrorCode(1);
    /// The peer sent more DATA than the window it was granted.
    pub const FLOW_CONTROL: ErrorCode = ErrorCode(2);
    /// A frame arrived for a stream that is closed or was never opened.
    pub const STREAM_CLOSED: ErrorCode = ErrorCode(3);
    /// The stream was refused: stream limit reached, or the receiver is draining.
    pub const REFUSED: ErrorCode = ErrorCode(4);
    /// The agent could not connect to its database for the stream's target.
    pub const CONNECT_FAILED: ErrorCode = ErrorCode(5);
    /// An internal error of the sender.
    pub const INTERNAL: ErrorCode = ErrorCode(6);
    /// The tunnel was idle past its timeout (PINGs unanswered).
    pub const IDLE_TIMEOUT: ErrorCode = ErrorCode(7);
    /// HELLO_REJECT: the protocol version is not supported.
    pub const BAD_VERSION: ErrorCode = ErrorCode(16);
    /// HELLO_REJECT: the organization token is not valid.
    pub const BAD_TOKEN: ErrorCode = ErrorCode(17);
    /// HELLO_REJECT: the organization already has a live tunnel.
    pub const DUPLICATE: ErrorCode = ErrorCode(18);
    /// HELLO_REJECT: the HELLO came from the wrong role (a relay dialing a relay).
    pub const BAD_ROLE: ErrorCode = ErrorCode(19);

    /// The code's name, if this version knows it.
    pub fn name(self) -> Option<&'static str> {
        Some(match self {
            ErrorCode::CANCEL => "CANCEL",
            ErrorCode::PROTOCOL => "PROTOCOL",
            ErrorCode::FLOW_CONTROL => "FLOW_CONTROL",
            ErrorCode::STREAM_CLOSED => "STREAM_CLOSED",
            ErrorCode::REFUSED => "REFUSED",
            ErrorCode::CONNECT_FAILED => "CONNECT_FAILED",
            ErrorCode::INTERNAL => "INTERNAL",
            ErrorCode::IDLE_TIMEOUT => "IDLE_TIMEOUT",
            ErrorCode::BAD_VERSION => "BAD_VERSION",
            ErrorCode::BAD_TOKEN => "BAD_TOKEN",
            ErrorCode::DUPLICATE => "DUPLICATE",
            ErrorCode::BAD_ROLE => "BAD_ROLE",
            _ => return None,
        })
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(name) => f.write_str(name),
            None => write!(f, "error code {}", self.0),
        }
    }
}
