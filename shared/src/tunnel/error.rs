//! The two kinds of tunnel errors: fatal to the tunnel, or a refused application call.
//!
//! Stream-level faults of the peer (DATA beyond the window, DATA after CLOSE, an OPEN
//! past the limit) are not errors of either kind: the stream is reset and the
//! application sees [`super::Event::Reset`].

use std::time::Duration;

use super::code::ErrorCode;
use super::frame::{FrameError, FrameType, Role, StreamId};

/// A fault that ends the whole tunnel. After [`super::Tunnel::handle_input`] or
/// [`super::Tunnel::handle_timeout`] returns one, the driver flushes
/// [`super::Tunnel::poll_transmit`] (it may hold a RESET on stream 0 or a
/// HELLO_REJECT telling the peer why) and closes the connection.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TunnelError {
    /// The bytes received are not a valid frame.
    #[error(transparent)]
    Frame(#[from] FrameError),
    /// A frame arrived in a phase where the protocol does not allow it.
    #[error("unexpected {frame} frame while {phase}")]
    Unexpected {
        /// The frame type received.
        frame: FrameType,
        /// What the tunnel was waiting for.
        phase: &'static str,
    },
    /// The peer speaks another protocol version.
    #[error("peer speaks tunnel protocol version {theirs}, this end speaks {ours}")]
    Version {
        /// Our version.
        ours: u16,
        /// The version in the peer's HELLO or HELLO_OK.
        theirs: u16,
    },
    /// A HELLO came from an end with the wrong role.
    #[error("HELLO from a {got}, expected an agent")]
    Role {
        /// The role in the HELLO.
        got: Role,
    },
    /// The relay refused this agent (HELLO_REJECT).
    #[error("relay refused the agent ({code}): {reason}")]
    Rejected {
        /// The relay's code.
        code: ErrorCode,
        /// The relay's reason.
        reason: String,
    },
    /// The peer broke a rule no correct peer breaks, such as reusing a stream id.
    #[error("{frame} frame on {stream}: {what}")]
    Violation {
        /// The frame type received.
        frame: FrameType,
        /// The stream it named.
        stream: StreamId,
        /// The rule broken.
        what: &'static str,
    },
    /// The peer aborted the tunnel (RESET on stream 0).
    #[error("peer aborted the tunnel ({code}): {reason}")]
    PeerAborted {
        /// The peer's code.
        code: ErrorCode,
        /// The peer's reason.
        reason: String,
    },
    /// Nothing was received for the configured idle timeout.
    #[error("nothing received from the peer for {idle:?}")]
    IdleTimeout {
        /// The timeout in force.
        idle: Duration,
    },
    /// The peer provokes replies (PONG, RESET) faster than it reads them.
    #[error("peer does not read: {queued} control frames queued for it")]
    PeerNotReading {
        /// Control frames waiting to be sent.
        queued: usize,
    },
    /// The tunnel already ended; no more input is processed.
    #[error("tunnel closed")]
    Closed,
}

impl TunnelError {
    /// The code sent to the peer in the RESET on stream 0 announcing this error, or
    /// `None` when nothing is sent (the peer ended the tunnel itself, or the relay
    /// already answered with HELLO_REJECT).
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            TunnelError::Frame(_) | TunnelError::Unexpected { .. } => Some(ErrorCode::PROTOCOL),
            TunnelError::Violation { .. } => Some(ErrorCode::PROTOCOL),
            TunnelError::IdleTimeout { .. } => Some(ErrorCode::IDLE_TIMEOUT),
            TunnelError::PeerNotReading { .. } => Some(ErrorCode::FLOW_CONTROL),
            TunnelError::Version { .. }
            | TunnelError::Role { .. }
            | TunnelError::Rejected { .. }
            | TunnelError::PeerAborted { .. }
            | TunnelError::Closed => None,
        }
    }
}

/// Why an application call on the tunnel was refused. Nothing is sent and no state
/// changes when one is returned.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StreamError {
    /// The handshake has not completed, or the tunnel has ended.
    #[error("tunnel not ready: {phase}")]
    NotReady {
        /// The tunnel's phase.
        phase: &'static str,
    },
    /// No such stream: never opened, or already closed or reset and removed.
    #[error("no {0} on this tunnel")]
    Unknown(StreamId),
    /// The application already closed its sending side of this stream.
    #[error("{0} is closed for writing")]
    Closed(StreamId),
    /// The peer's limit of concurrent streams is reached.
    #[error("the peer allows at most {max} concurrent streams")]
    Limit {
        /// The peer's `max_streams`.
        max: u32,
    },
    /// One end is draining: no new streams.
    #[error("tunnel draining: no new streams")]
    Draining,
    /// This end has used every stream id it may open; open a new tunnel.
    #[error("stream ids exhausted")]
    IdsExhausted,
    /// An OPEN target longer than the protocol allows.
    #[error("target of {len} bytes, the limit is 1024")]
    TargetTooLong {
        /// The target's length.
        len: usize,
    },
}
