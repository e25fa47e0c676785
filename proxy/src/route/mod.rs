//! Routing statements by organization (issue 6, `docs/routing.md`): [`analysis`] finds the
//! organization a statement concerns and whether its database can answer it alone;
//! [`rewrite`], the join and key-map rewrites for statements that stay on the cloud;
//! [`scope`], statements limited to the session's organization (`SET lokadb.org`) and
//! [`setting`], which follows that setting; [`names`], what an unqualified name means in a
//! session (temporary tables, search_path); [`param`], a bound organization or key read by
//! its type; [`meta`], the
//! per-core metadata and analysis cache, with [`literals`] for statements that differ only in
//! their values; [`watch`], which keeps every core's metadata
//! current. Where a statement goes is the session's router's to decide
//! (`frontend::router`).

pub mod analysis;
pub mod literals;
pub mod meta;
pub mod names;
pub mod param;
pub mod rewrite;
pub mod scope;
pub mod setting;
pub mod watch;

#[cfg(test)]
mod analysis_cases;
