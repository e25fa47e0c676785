//! The cloud side: connections to the cloud database, logging in as the client's
//! role, what a backend holds at login, the per-core pool of warm backends, and the
//! verifier lookup.

pub mod at_login;
pub mod auth_query;
pub mod conn;
pub mod gauge;
pub mod pool;
pub mod slots;
