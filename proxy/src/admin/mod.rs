//! The admin commands (`lokadb init | org | pause | resume | enable | disable | move-org | move-back | verify | status`): they
//! prepare the cloud database and change organizations. They run once and exit, so they use a plain
//! blocking Postgres client (the `postgres` crate), not the proxy's runtime.
//!
//! - [`db`]: connecting, and the errors the commands report.
//! - [`migrations`]: the versioned `lokadb` schema (`sql/NNNN_*.sql`) and `lokadb init`.
//! - [`org`]: `lokadb org add | list | show | remove`.
//! - [`pause`]: `lokadb pause` / `lokadb resume` and the holder that keeps a pause.
//! - [`enable`]: `lokadb enable TABLE`, the online swap to a LokaDB table; [`disable`]
//!   reverses it. [`preflight`] decides what can be kept; both read tables through
//!   [`catalog`], keep unique keys without the organization column in [`keymap`]s, and
//!   move foreign keys with [`fkeys`]; [`guards`] keep foreign keys for the rows of
//!   foreign partitions (parent check, refs). See docs/cloud-schema.md.
//! - [`moves`]: `lokadb move-org | move-back | verify | status`. See docs/moving.md.
//! - [`concurrently`]: `lokadb concurrently`, an index built concurrently in the cloud and
//!   in every moved organization ([`index_statement`] reads it). See docs/migrations.md.

pub mod catalog;
pub mod concurrently;
pub mod db;
pub mod disable;
pub mod enable;
pub mod fkeys;
pub mod guards;
pub mod index_statement;
pub mod keymap;
pub mod migrations;
pub mod moves;
pub mod org;
pub mod pause;
pub mod preflight;

pub use db::AdminError;

/// How LokaDB's trigger functions run: with the rights of the role that enabled the
/// table (as Postgres's own foreign-key triggers run as the table's owner), so the
/// application's role needs no rights on schema `lokadb`; with a fixed search_path, so
/// a writer's search_path cannot redirect them (their bodies name everything by schema).
pub const DEFINER: &str = "SECURITY DEFINER SET search_path = pg_catalog, pg_temp";
