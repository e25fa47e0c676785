//! Routing statements by organization (issue 6). So far: [`analysis`], which finds the
//! organization a statement concerns; [`meta`], the per-core metadata and analysis cache;
//! [`watch`], which keeps every core's metadata current. The proxy logs the analysis
//! (`route_log`) but still sends every statement to the cloud.

pub mod analysis;
pub mod meta;
pub mod watch;
