//! Message tags of protocol 3.0, named as in the Postgres documentation
//! ("Message Formats"). Frontend and backend reuse some letters, hence the prefixes.

/// Frontend: Bind.
pub const FE_BIND: u8 = b'B';
/// Frontend: Close (statement or portal).
pub const FE_CLOSE: u8 = b'C';
/// Frontend: CopyData.
pub const FE_COPY_DATA: u8 = b'd';
/// Frontend: CopyDone.
pub const FE_COPY_DONE: u8 = b'c';
/// Frontend: CopyFail.
pub const FE_COPY_FAIL: u8 = b'f';
/// Frontend: Describe.
pub const FE_DESCRIBE: u8 = b'D';
/// Frontend: Execute.
pub const FE_EXECUTE: u8 = b'E';
/// Frontend: Flush.
pub const FE_FLUSH: u8 = b'H';
/// Frontend: FunctionCall.
pub const FE_FUNCTION_CALL: u8 = b'F';
/// Frontend: Parse.
pub const FE_PARSE: u8 = b'P';
/// Frontend: PasswordMessage, SASLInitialResponse and SASLResponse share this tag.
pub const FE_PASSWORD: u8 = b'p';
/// Frontend: Query (simple protocol).
pub const FE_QUERY: u8 = b'Q';
/// Frontend: Sync.
pub const FE_SYNC: u8 = b'S';
/// Frontend: Terminate.
pub const FE_TERMINATE: u8 = b'X';

/// Backend: Authentication* (the subtype is the first Int32 of the body).
pub const BE_AUTHENTICATION: u8 = b'R';
/// Backend: BackendKeyData.
pub const BE_BACKEND_KEY_DATA: u8 = b'K';
/// Backend: BindComplete.
pub const BE_BIND_COMPLETE: u8 = b'2';
/// Backend: CloseComplete.
pub const BE_CLOSE_COMPLETE: u8 = b'3';
/// Backend: CommandComplete.
pub const BE_COMMAND_COMPLETE: u8 = b'C';
/// Backend: CopyData.
pub const BE_COPY_DATA: u8 = b'd';
/// Backend: CopyDone.
pub const BE_COPY_DONE: u8 = b'c';
/// Backend: CopyInResponse.
pub const BE_COPY_IN_RESPONSE: u8 = b'G';
/// Backend: CopyOutResponse.
pub const BE_COPY_OUT_RESPONSE: u8 = b'H';
/// Backend: CopyBothResponse.
pub const BE_COPY_BOTH_RESPONSE: u8 = b'W';
/// Backend: DataRow.
pub const BE_DATA_ROW: u8 = b'D';
/// Backend: EmptyQueryResponse.
pub const BE_EMPTY_QUERY_RESPONSE: u8 = b'I';
/// Backend: ErrorResponse.
pub const BE_ERROR_RESPONSE: u8 = b'E';
/// Backend: NegotiateProtocolVersion.
pub const BE_NEGOTIATE_PROTOCOL_VERSION: u8 = b'v';
/// Backend: NoData.
pub const BE_NO_DATA: u8 = b'n';
/// Backend: NoticeResponse.
pub const BE_NOTICE_RESPONSE: u8 = b'N';
/// Backend: NotificationResponse.
pub const BE_NOTIFICATION_RESPONSE: u8 = b'A';
/// Backend: ParameterDescription.
pub const BE_PARAMETER_DESCRIPTION: u8 = b't';
/// Backend: ParameterStatus.
pub const BE_PARAMETER_STATUS: u8 = b'S';
/// Backend: ParseComplete.
pub const BE_PARSE_COMPLETE: u8 = b'1';
/// Backend: PortalSuspended.
pub const BE_PORTAL_SUSPENDED: u8 = b's';
/// Backend: ReadyForQuery.
pub const BE_READY_FOR_QUERY: u8 = b'Z';
/// Backend: RowDescription.
pub const BE_ROW_DESCRIPTION: u8 = b'T';

/// Authentication subtype: AuthenticationOk.
pub const AUTH_OK: i32 = 0;
/// Authentication subtype: AuthenticationCleartextPassword.
pub const AUTH_CLEARTEXT_PASSWORD: i32 = 3;
/// Authentication subtype: AuthenticationMD5Password.
pub const AUTH_MD5_PASSWORD: i32 = 5;
/// Authentication subtype: AuthenticationSASL.
pub const AUTH_SASL: i32 = 10;
/// Authentication subtype: AuthenticationSASLContinue.
pub const AUTH_SASL_CONTINUE: i32 = 11;
/// Authentication subtype: AuthenticationSASLFinal.
pub const AUTH_SASL_FINAL: i32 = 12;

/// ReadyForQuery status: idle, outside a transaction block.
pub const TX_IDLE: u8 = b'I';
/// ReadyForQuery status: in a transaction block.
pub const TX_IN_BLOCK: u8 = b'T';
/// ReadyForQuery status: in a failed transaction block.
pub const TX_FAILED: u8 = b'E';
