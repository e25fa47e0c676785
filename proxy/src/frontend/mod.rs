//! The client side: negotiation (SSL, startup, cancel), SCRAM authentication, and the
//! session that forwards statements.

pub mod auth;
pub mod check;
pub mod cloud_org;
pub mod cloud_pool;
pub mod console;
pub mod direct;
#[cfg(test)]
mod harness;
#[cfg(test)]
mod harness_cases;
pub mod pump;
mod refusal;
pub mod replay;
pub mod router;
pub mod session;
pub mod session_org;
pub mod startup;
pub mod statement;
pub mod switch;
pub mod tally;
pub mod tx_pool;
