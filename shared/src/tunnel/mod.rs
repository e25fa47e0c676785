//! The tunnel protocol between the relay and the agent, sans-IO.
//!
//! One connection (TLS, set up by the driver) per agent carries many streams; each
//! stream is one Postgres connection between the relay and the agent's database.
//! This module turns bytes into frames and frames into stream events; it opens no
//! socket, reads no clock (time enters as a `now: Instant` argument) and does no TLS.
//! The relay (in the proxy) and the agent drive it from their own event loops.
//! The protocol itself is written down in `docs/tunnel-protocol.md`.
//!
//! Flow control is per stream: a stream never has more than its window in flight,
//! and credit returns only when the application reads, so a slow reader stalls only
//! its own stream. DATA from streams with something to send is interleaved round
//! robin, one bounded frame at a time.
//!
//! # Limits of this version
//!
//! - Windows are fixed per tunnel (set in the handshake) unless
//!   [`Config::auto_window`] is set (off by default): then a stream whose reader
//!   keeps up grows its window towards twice its bandwidth-delay product.
//!   [`Config::memory_cap`] and a [`MemoryBudget`] shared by tunnels bound receive
//!   memory by resetting the slowest reader ([`memory`] has the accounting,
//!   `docs/tunnel-protocol.md` the worst cases). Without caps, the receive memory of
//!   one tunnel is bounded by `max_streams × window` (plus one frame being decoded).
//! - There is no connection-level window: by design, so that one stream's reader
//!   cannot take credit from the others.
//!
//! # Layout
//!
//! - [`frame`]: the frame header, tag constants, [`StreamId`], and the codec.
//! - [`code`]: [`ErrorCode`], the codes of RESET and HELLO_REJECT.
//! - [`stream`]: one stream's state machine ([`StreamState`]) and its send and
//!   receive halves.
//! - [`flow`]: [`Tunnel`], the multiplexer for one end: stream table, flow control
//!   and the DATA scheduler; `flow/peer.rs` handles frames from the peer (the
//!   handshake included), `flow/app.rs` the application's calls.
//! - [`memory`]: [`MemoryBudget`] and [`AutoWindow`]; `flow/tune.rs` charges,
//!   sheds and grows windows.
//! - [`link`]: [`Link`], a tunnel carried by a rustls connection, still sans-IO.
//! - [`error`]: [`TunnelError`] (fatal to the tunnel) and [`StreamError`] (a refused
//!   application call).

pub mod code;
pub mod error;
pub mod flow;
pub mod frame;
pub mod link;
pub mod memory;
pub mod stream;

#[cfg(test)]
mod pair;

pub use code::ErrorCode;
pub use error::{StreamError, TunnelError};
pub use flow::{
    Config, Event, PeerSettings, Phase, Read, Tunnel, TunnelStats, DEFAULT_MAX_PAYLOAD,
    DEFAULT_MAX_STREAMS, DEFAULT_WINDOW,
};
pub use frame::{Frame, FrameError, FrameType, Role, StreamId};
pub use link::{auto_from_env, memory_caps_from_env, window_from_env, Link, LinkError};
pub use memory::{
    AutoWindow, MemoryBudget, MemoryCaps, DEFAULT_MAX_WINDOW, DEFAULT_SHARED_MEMORY_CAP,
    DEFAULT_TUNNEL_MEMORY_CAP,
};
pub use stream::{StreamState, StreamStats};
