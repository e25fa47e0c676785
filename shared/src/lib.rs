//! Sans-IO code shared by the LokaDB proxy (`lokadb`) and agent (`lokadb-agent`).
//!
//! This crate does no I/O: no sockets, no runtime, no clock. It turns bytes into
//! frames and frames into bytes, and it holds the typed configuration. Both binaries
//! drive it from their own event loops, so the wire logic exists exactly once.
//!
//! # Layout
//!
//! - [`wire`]: the Postgres protocol 3.0 framing — tag constants, frame headers,
//!   startup packets, the backend messages the proxy writes itself, field readers.
//! - [`tunnel`]: the relay–agent tunnel protocol — frames, and the multiplexer
//!   with per-stream flow control, as a state machine driven by the binaries.
//! - [`config`]: the JSON configuration file (`lokadb.json`), typed, with unknown
//!   keys rejected by name.
//!
//! # Why a separate crate
//!
//! The proxy and the agent are separate binaries with different dependency budgets
//! (the agent must stay a small static binary). What both must agree on — framing,
//! and later the tunnel protocol — lives here, with no runtime dependency.
#![deny(missing_docs)]

pub mod config;
pub mod conninfo;
pub mod text;
pub mod tunnel;
pub mod wire;
