//! SQLSTATE codes the proxy reports itself (Postgres Appendix A).

/// A SQLSTATE code: five ASCII characters.
pub type SqlState = &'static str;

/// `08P01` protocol_violation.
pub const PROTOCOL_VIOLATION: SqlState = "08P01";
/// `08001` sqlclient_unable_to_establish_sqlconnection.
pub const CANNOT_CONNECT: SqlState = "08001";
/// `08006` connection_failure.
pub const CONNECTION_FAILURE: SqlState = "08006";
/// `28000` invalid_authorization_specification.
pub const INVALID_AUTHORIZATION: SqlState = "28000";
/// `28P01` invalid_password.
pub const INVALID_PASSWORD: SqlState = "28P01";
/// `3D000` invalid_catalog_name (unknown database).
pub const INVALID_CATALOG_NAME: SqlState = "3D000";
/// `53300` too_many_connections.
pub const TOO_MANY_CONNECTIONS: SqlState = "53300";
/// `54000` program_limit_exceeded.
pub const PROGRAM_LIMIT_EXCEEDED: SqlState = "54000";
/// `57P01` admin_shutdown.
pub const ADMIN_SHUTDOWN: SqlState = "57P01";
/// `57P03` cannot_connect_now.
pub const CANNOT_CONNECT_NOW: SqlState = "57P03";
/// `0A000` feature_not_supported.
pub const FEATURE_NOT_SUPPORTED: SqlState = "0A000";
/// `XX000` internal_error.
pub const INTERNAL_ERROR: SqlState = "XX000";
/// `57014` query_canceled (timeouts).
pub const QUERY_CANCELED: SqlState = "57014";
