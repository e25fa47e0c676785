//! Routing statements by organization (issue 6). So far: [`analysis`], which finds the
//! organization a statement concerns; the proxy does not act on it yet.

pub mod analysis;
