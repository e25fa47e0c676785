//! The LokaDB proxy: a thread-per-core Postgres protocol proxy in front of the cloud
//! database.
//!
//! # Design
//!
//! One thread per core, pinned, each running its own io_uring runtime ([`rt`]),
//! accepting on its own SO_REUSEPORT socket and owning its sessions, pool of cloud backends, auth connections and
//! cancel keys ([`core::Core`]). Nothing on the per-statement path is shared between
//! cores or locked; the only cross-core traffic is a forwarded cancel request and the
//! shutdown flag. A session's bytes are framed but not decoded ([`frontend::pump`]),
//! except the few frames the proxy must see ([`frontend::statement`]).
//!
//! # Layout
//!
//! - [`admin`]: the admin commands (`lokadb init | org | pause | resume`) on a blocking
//!   Postgres client.
//! - [`server`]: core threads, listeners, shutdown drain.
//! - [`rt`]: the per-core runtime — io_uring reactor, task queue, TCP.
//! - [`core`]: shared settings and per-core state.
//! - [`frontend`]: the client side — [`frontend::startup`] (SSL, startup, cancel),
//!   [`frontend::auth`] (SCRAM), [`frontend::session`] (a session's life),
//!   [`frontend::pump`] (the forwarding hot path), [`frontend::statement`] (the point
//!   every statement passes).
//! - [`backend`]: the cloud side — [`backend::conn`] (login as the client's role),
//!   [`backend::at_login`] (what a backend holds at login), [`backend::pool`] (warm
//!   backends), [`backend::auth_query`] (verifiers).
//! - [`relay`]: the relay agents dial into, on a thread of its own, and its Postgres
//!   listener for postgres_fdw and the direct path.
//! - [`migrate`]: the second phase of the application's migrations in moved
//!   organizations' databases (COMMIT PREPARED once the cloud committed).
//! - [`scram`]: SCRAM-SHA-256 for both sides, including passthrough.
//! - [`cancel`]: per-session cancel keys and cross-core forwarding.
//! - [`net`]: client and cloud streams, TLS both ways, listening sockets.
//! - [`metrics`]: `GET /metrics`, from counters each core keeps and publishes once a second.
//! - [`error`]: classified session errors and what the client sees.
//! - [`reload`]: SIGHUP re-reads the configuration file.
//! - [`signals`], [`time`]: SIGTERM and SIGHUP handling, timeouts.
//!
//! # Limits
//!
//! Session pooling only: a client keeps its backend until it disconnects.

pub mod admin;
pub mod backend;
pub mod cancel;
pub mod core;
pub mod error;
pub mod failpoint;
pub mod frontend;
pub mod handover;
pub mod metrics;
pub mod migrate;
pub mod net;
pub mod org;
pub mod profile;
pub mod record;
pub mod relay;
pub mod reload;
pub mod route;
pub mod rt;
pub mod scram;
pub mod server;
pub mod signals;
pub mod time;
