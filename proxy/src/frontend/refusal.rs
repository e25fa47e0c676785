//! Refusals: errors the proxy makes a backend raise in the stream's order.
//!
//! A refused message is replaced by one whose statement raises the proxy's error when
//! executed (a `DO` block), so the error comes behind the answers to whatever the client
//! pipelined before it and fails its batch or transaction as Postgres's own would. The
//! block marks its error (the `SCHEMA` field, a token random per process), and on the way
//! down [`plain_refusal`] rewrites a marked ErrorResponse to what the proxy meant:
//! severity, SQLSTATE, message and hint, without the PL/pgSQL `CONTEXT` and the
//! `pl_exec.c` file, line and routine that would tell how it was made. A marked error
//! cannot be told from another: a prepared statement replaced by a refusal raises at every
//! Execute, whenever that is.

use lokadb_shared::wire::backend::write_frame;
use lokadb_shared::wire::fields::Fields;
use std::sync::OnceLock;

use lokadb_shared::wire::frontend::Statement;

/// Dollar-quote tag of the refusal's DO block.
const REFUSAL_TAG: &str = "$lokadb_refusal$";

/// The fields of a refusal the client sees: severity (localized and not), SQLSTATE,
/// message, detail, hint. The rest (`W` context, `F`/`L`/`R` source position, `s` the
/// mark) is how it was made.
const KEPT_FIELDS: &[u8] = b"SVCMDH";

/// The token a refusal's error carries in its `SCHEMA` field. Random per process, so a
/// client cannot mark an error of its own (were it to learn it from the cloud's logs, the
/// most it could do is have its own error's context left out).
fn mark() -> &'static str {
    static MARK: OnceLock<String> = OnceLock::new();
    MARK.get_or_init(|| format!("lokadb_refusal_{:016x}", rand::random::<u64>()))
}

/// A statement that raises an error with this SQLSTATE, message and hint when executed.
/// Text from the client in them (an organization's name) cannot end the block early: its
/// dollar-quote tag is taken out of both.
pub(super) fn raise_sql(code: &str, message: &str, hint: &str) -> String {
    let literal = |s: &str| {
        let mut s = s.to_owned();
        while s.contains(REFUSAL_TAG) {
            s = s.replace(REFUSAL_TAG, "lokadb_refusal");
        }
        s.replace('\'', "''")
    };
    format!(
        "DO {REFUSAL_TAG}BEGIN RAISE EXCEPTION USING ERRCODE = '{code}', MESSAGE = '{}', HINT = '{}', SCHEMA = '{}'; END{REFUSAL_TAG}",
        literal(message),
        literal(hint),
        mark(),
    )
}

/// The same Query (`name` `None`) or Parse (of statement `name`) with a statement that
/// raises `code`, `message` and `hint` when executed.
pub(super) fn refusal_frame(name: Option<&str>, code: &str, message: &str, hint: &str) -> Vec<u8> {
    // No parameter types: the DO block takes none.
    let rest: &[u8] = if name.is_some() { &[0, 0] } else { &[] };
    Statement {
        name,
        sql: "",
        rest,
    }
    .with_sql(&raise_sql(code, message, hint))
}

/// A whole ErrorResponse `frame` that a refusal raised, as the error the proxy meant
/// ([`KEPT_FIELDS`] only). `None`: another error (or one the proxy cannot read), which
/// passes as it is.
pub(super) fn plain_refusal(frame: &[u8]) -> Option<Vec<u8>> {
    let body = frame.get(5..)?;
    let marked = fields(body)?
        .iter()
        .any(|&(code, value)| code == b's' && value == mark().as_bytes());
    if !marked {
        return None;
    }
    let mut out = Vec::with_capacity(frame.len());
    write_frame(&mut out, frame[0], |out| {
        for (code, value) in fields(body).into_iter().flatten() {
            if KEPT_FIELDS.contains(&code) {
                out.push(code);
                out.extend_from_slice(value);
                out.push(0);
            }
        }
        out.push(0);
    });
    Some(out)
}

/// Whether an ErrorResponse frame (header included) ends its session: FATAL or PANIC.
pub(super) fn is_fatal(frame: &[u8]) -> bool {
    frame.get(5..).and_then(fields).is_some_and(|all| {
        all.iter()
            .any(|&(code, v)| matches!(code, b'S' | b'V') && matches!(v, b"FATAL" | b"PANIC"))
    })
}

/// The `(code, value)` fields of an ErrorResponse body; `None` if it is malformed.
fn fields(body: &[u8]) -> Option<Vec<(u8, &[u8])>> {
    let mut f = Fields::new(body, "ErrorResponse");
    let mut all = Vec::new();
    loop {
        match f.u8().ok()? {
            0 => return Some(all),
            code => all.push((code, f.cstr_bytes().ok()?)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lokadb_shared::wire::backend::put_cstr;
    use lokadb_shared::wire::tags::BE_ERROR_RESPONSE;

    fn error_frame(fields: &[(u8, &str)]) -> Vec<u8> {
        let mut out = Vec::new();
        write_frame(&mut out, BE_ERROR_RESPONSE, |b| {
            for (code, value) in fields {
                b.push(*code);
                put_cstr(b, value);
            }
            b.push(0);
        });
        out
    }

    /// What PostgreSQL 18 sends for the refusal's DO block, in its field order.
    fn raised(schema: &str) -> Vec<u8> {
        error_frame(&[
            (b'S', "ERROR"),
            (b'V', "ERROR"),
            (b'C', "0A000"),
            (b'M', "this pipeline mixes …"),
            (b'H', "Send a Sync"),
            (b'W', "PL/pgSQL function inline_code_block line 1 at RAISE"),
            (b's', schema),
            (b'F', "pl_exec.c"),
            (b'L', "3911"),
            (b'R', "exec_stmt_raise"),
        ])
    }

    #[test]
    fn a_refusals_error_keeps_only_what_the_proxy_meant() {
        assert_eq!(
            plain_refusal(&raised(mark())),
            Some(error_frame(&[
                (b'S', "ERROR"),
                (b'V', "ERROR"),
                (b'C', "0A000"),
                (b'M', "this pipeline mixes …"),
                (b'H', "Send a Sync"),
            ]))
        );
    }

    #[test]
    fn a_fatal_error_is_told_from_others() {
        let terminated = error_frame(&[
            (b'S', "FATAL"),
            (b'V', "FATAL"),
            (b'C', "57P01"),
            (b'M', "terminating connection due to administrator command"),
        ]);
        assert!(is_fatal(&terminated));
        assert!(is_fatal(&error_frame(&[(b'V', "PANIC")])));
        assert!(!is_fatal(&raised(mark())));
        // A message that merely says FATAL, a malformed frame.
        assert!(!is_fatal(&error_frame(&[(b'M', "FATAL")])));
        assert!(!is_fatal(&[BE_ERROR_RESPONSE, 0, 0, 0, 6, b'V']));
    }

    #[test]
    fn other_errors_pass_as_they_are() {
        // The client's own DO block, with a schema of its own or none.
        assert_eq!(
            plain_refusal(&raised("lokadb_refusal_0000000000000000")),
            None
        );
        assert_eq!(plain_refusal(&error_frame(&[(b'C', "0A000")])), None);
        // Malformed: no terminator, a field without its NUL.
        let mut cut = raised(mark());
        cut.truncate(cut.len() - 1);
        assert_eq!(plain_refusal(&cut), None);
        assert_eq!(plain_refusal(&[BE_ERROR_RESPONSE, 0, 0, 0, 6, b's']), None);
        assert_eq!(plain_refusal(&[BE_ERROR_RESPONSE, 0]), None);
    }

    #[test]
    fn the_mark_is_in_the_raised_statement_and_client_text_cannot_end_it() {
        let sql = raise_sql("42501", "it's $lokadb_refusal$; x", "h");
        assert!(sql.contains(&format!("SCHEMA = '{}'", mark())), "{sql}");
        assert_eq!(sql.matches(REFUSAL_TAG).count(), 2, "{sql}");
        assert!(sql.contains("it''s lokadb_refusal; x"), "{sql}");
    }
}
