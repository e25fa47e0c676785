//! Postgres protocol 3.0 framing.
//!
//! Regular messages are `tag:u8, len:i32 (including itself), body`. Startup-phase
//! messages have no tag. Following rust-postgres, we peek a [`frame::Header`], wait
//! for the whole frame only when its body must be read, and decode bodies lazily.
//!
//! # Layout
//!
//! - [`tags`]: every message tag, defined once.
//! - [`frame`]: [`frame::Header`] peeking with length limits.
//! - [`startup`]: the untagged startup packets (StartupMessage, SSLRequest,
//!   GSSENCRequest, CancelRequest).
//! - [`backend`]: encoders for the backend messages the proxy writes itself.
//! - [`frontend`]: encoders for the frontend messages the proxy sends as a client.
//! - [`notice`]: reading received ErrorResponse and NoticeResponse bodies.
//! - [`fields`]: bounds-checked readers for message bodies.
//! - [`sqlstate`]: the SQLSTATE codes the proxy reports.

pub mod backend;
pub mod fields;
pub mod frame;
pub mod frontend;
pub mod notice;
pub mod sqlstate;
pub mod startup;
pub mod tags;

pub use frame::{FrameError, Header};
