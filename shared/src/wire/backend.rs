//! Encoders for the backend messages the proxy writes itself (during the startup
//! phase, and errors). Everything after that is forwarded from the cloud as is.
//!
//! Each helper appends one whole frame to `out`; the length is backpatched once, in
//! [`write_frame`].

use super::tags::*;

/// Appends a NUL-terminated string. A NUL inside `s` would end the field early, so it
/// is replaced (the proxy writes only its own text and names it validated).
pub fn put_cstr(out: &mut Vec<u8>, s: &str) {
    out.extend(s.bytes().map(|b| if b == 0 { b'?' } else { b }));
    out.push(0);
}

/// Appends a frame with `tag` whose body is written by `body`, backpatching the length.
#[inline]
pub fn write_frame(out: &mut Vec<u8>, tag: u8, body: impl FnOnce(&mut Vec<u8>)) {
    out.push(tag);
    let len_at = out.len();
    out.extend_from_slice(&[0; 4]);
    body(out);
    let len = (out.len() - len_at) as u32;
    out[len_at..len_at + 4].copy_from_slice(&len.to_be_bytes());
}

/// Severity of an ErrorResponse or NoticeResponse.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Severity {
    /// ERROR: the statement failed, the session goes on.
    Error,
    /// FATAL: the session ends.
    Fatal,
    /// NOTICE.
    Notice,
    /// WARNING.
    Warning,
}

impl Severity {
    fn as_str(self) -> &'static str {
        match self {
            Severity::Error => "ERROR",
            Severity::Fatal => "FATAL",
            Severity::Notice => "NOTICE",
            Severity::Warning => "WARNING",
        }
    }
}

/// The fields of an error or notice the proxy reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ErrorFields<'a> {
    /// Severity.
    pub severity: Severity,
    /// SQLSTATE, five characters.
    pub code: &'a str,
    /// Primary message.
    pub message: &'a str,
    /// Optional detail.
    pub detail: Option<&'a str>,
    /// Optional hint.
    pub hint: Option<&'a str>,
}

/// Appends an ErrorResponse (or a NoticeResponse for notice severities).
pub fn error_response(out: &mut Vec<u8>, e: &ErrorFields<'_>) {
    let tag = match e.severity {
        Severity::Error | Severity::Fatal => BE_ERROR_RESPONSE,
        Severity::Notice | Severity::Warning => BE_NOTICE_RESPONSE,
    };
    write_frame(out, tag, |b| {
        for (field, value) in [
            (b'S', Some(e.severity.as_str())),
            (b'V', Some(e.severity.as_str())),
            (b'C', Some(e.code)),
            (b'M', Some(e.message)),
            (b'D', e.detail),
            (b'H', e.hint),
        ] {
            if let Some(v) = value {
                b.push(field);
                put_cstr(b, v);
            }
        }
        b.push(0);
    });
}

/// Appends AuthenticationOk.
pub fn auth_ok(out: &mut Vec<u8>) {
    write_frame(out, BE_AUTHENTICATION, |b| {
        b.extend_from_slice(&AUTH_OK.to_be_bytes())
    });
}

/// Appends AuthenticationSASL listing `mechanisms`.
pub fn auth_sasl(out: &mut Vec<u8>, mechanisms: &[&str]) {
    write_frame(out, BE_AUTHENTICATION, |b| {
        b.extend_from_slice(&AUTH_SASL.to_be_bytes());
        for m in mechanisms {
            put_cstr(b, m);
        }
        b.push(0);
    });
}

/// Appends AuthenticationSASLContinue or AuthenticationSASLFinal with `data`.
pub fn auth_sasl_data(out: &mut Vec<u8>, subtype: i32, data: &[u8]) {
    write_frame(out, BE_AUTHENTICATION, |b| {
        b.extend_from_slice(&subtype.to_be_bytes());
        b.extend_from_slice(data);
    });
}

/// Appends ParameterStatus.
pub fn parameter_status(out: &mut Vec<u8>, name: &str, value: &str) {
    write_frame(out, BE_PARAMETER_STATUS, |b| {
        put_cstr(b, name);
        put_cstr(b, value);
    });
}

/// Appends BackendKeyData with a 4-byte secret (protocol 3.0).
pub fn backend_key_data(out: &mut Vec<u8>, pid: u32, secret: u32) {
    write_frame(out, BE_BACKEND_KEY_DATA, |b| {
        b.extend_from_slice(&pid.to_be_bytes());
        b.extend_from_slice(&secret.to_be_bytes());
    });
}

/// Appends ReadyForQuery with transaction status `status`.
pub fn ready_for_query(out: &mut Vec<u8>, status: u8) {
    write_frame(out, BE_READY_FOR_QUERY, |b| b.push(status));
}

/// Appends NegotiateProtocolVersion: the newest minor version we support and the
/// protocol options we did not recognize.
pub fn negotiate_protocol_version(out: &mut Vec<u8>, newest_minor: i32, unrecognized: &[&str]) {
    write_frame(out, BE_NEGOTIATE_PROTOCOL_VERSION, |b| {
        b.extend_from_slice(&newest_minor.to_be_bytes());
        b.extend_from_slice(&(unrecognized.len() as i32).to_be_bytes());
        for o in unrecognized {
            put_cstr(b, o);
        }
    });
}

/// Appends a RowDescription of text columns (type `text`, OID 25, text format).
pub fn row_description_text(out: &mut Vec<u8>, columns: &[&str]) {
    write_frame(out, BE_ROW_DESCRIPTION, |b| {
        b.extend_from_slice(&(columns.len() as i16).to_be_bytes());
        for name in columns {
            put_cstr(b, name);
            b.extend_from_slice(&0i32.to_be_bytes()); // table OID
            b.extend_from_slice(&0i16.to_be_bytes()); // column number
            b.extend_from_slice(&25i32.to_be_bytes()); // type OID: text
            b.extend_from_slice(&(-1i16).to_be_bytes()); // type size: varlena
            b.extend_from_slice(&(-1i32).to_be_bytes()); // type modifier
            b.extend_from_slice(&0i16.to_be_bytes()); // text format
        }
    });
}

/// Appends a DataRow of text values (`None` is NULL).
pub fn data_row(out: &mut Vec<u8>, values: &[Option<&str>]) {
    write_frame(out, BE_DATA_ROW, |b| {
        b.extend_from_slice(&(values.len() as i16).to_be_bytes());
        for v in values {
            match v {
                Some(v) => {
                    b.extend_from_slice(&(v.len() as i32).to_be_bytes());
                    b.extend_from_slice(v.as_bytes());
                }
                None => b.extend_from_slice(&(-1i32).to_be_bytes()),
            }
        }
    });
}

/// Appends a CommandComplete with `tag` (e.g. `SHOW`, `SELECT 3`).
pub fn command_complete(out: &mut Vec<u8>, tag: &str) {
    write_frame(out, BE_COMMAND_COMPLETE, |b| put_cstr(b, tag));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_for_query_bytes() {
        let mut out = Vec::new();
        ready_for_query(&mut out, TX_IDLE);
        assert_eq!(out, b"Z\0\0\0\x05I");
    }

    #[test]
    fn error_response_bytes() {
        let mut out = Vec::new();
        error_response(
            &mut out,
            &ErrorFields {
                severity: Severity::Fatal,
                code: "53300",
                message: "too many",
                detail: None,
                hint: Some("h"),
            },
        );
        let expected: &[u8] = b"E\0\0\0\x27SFATAL\0VFATAL\0C53300\0Mtoo many\0Hh\0\0";
        assert_eq!(out, expected);
    }

    #[test]
    fn nul_in_text_cannot_end_a_field() {
        let mut out = Vec::new();
        parameter_status(&mut out, "a\0b", "c");
        assert_eq!(out, b"S\0\0\0\x0aa?b\0c\0");
    }

    #[test]
    fn backend_key_data_bytes() {
        let mut out = Vec::new();
        backend_key_data(&mut out, 1, 2);
        assert_eq!(out, b"K\0\0\0\x0c\0\0\0\x01\0\0\0\x02");
    }
}
