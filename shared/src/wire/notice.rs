//! Reading ErrorResponse and NoticeResponse bodies received from Postgres.

use super::fields::Fields;
use super::frame::FrameError;

/// The fields of a received error or notice that the proxy looks at.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Notice {
    /// Severity (`S`, localized; `V` is preferred when present).
    pub severity: String,
    /// SQLSTATE (`C`).
    pub code: String,
    /// Primary message (`M`).
    pub message: String,
}

impl Notice {
    /// Parses an ErrorResponse or NoticeResponse body.
    ///
    /// # Errors
    ///
    /// [`FrameError::Truncated`] when a field is not NUL-terminated.
    pub fn parse(body: &[u8]) -> Result<Notice, FrameError> {
        let mut f = Fields::new(body, "ErrorResponse");
        let mut n = Notice::default();
        loop {
            let field = f.u8()?;
            if field == 0 {
                break;
            }
            let value = String::from_utf8_lossy(f.cstr_bytes()?).into_owned();
            match field {
                b'V' => n.severity = value,
                b'S' if n.severity.is_empty() => n.severity = value,
                b'C' => n.code = value,
                b'M' => n.message = value,
                _ => {}
            }
        }
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::backend::{error_response, ErrorFields, Severity};

    #[test]
    fn round_trip_with_encoder() {
        let mut out = Vec::new();
        error_response(
            &mut out,
            &ErrorFields {
                severity: Severity::Error,
                code: "42P01",
                message: "no table",
                detail: Some("d"),
                hint: None,
            },
        );
        let n = Notice::parse(&out[5..]).unwrap();
        assert_eq!(
            n,
            Notice {
                severity: "ERROR".into(),
                code: "42P01".into(),
                message: "no table".into()
            }
        );
    }

    #[test]
    fn truncated_is_an_error() {
        assert!(Notice::parse(b"Mno nul").is_err());
    }
}
