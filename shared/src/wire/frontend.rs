//! Encoders for the frontend messages the proxy sends itself when it acts as a client
//! of the cloud (login, the auth query, the pool reset), or adds to client traffic (a
//! prepared statement re-parsed on the backend that runs it).

use super::backend::{put_cstr, write_frame};
use super::tags::*;

/// Appends Query.
pub fn query(out: &mut Vec<u8>, sql: &str) {
    write_frame(out, FE_QUERY, |b| put_cstr(b, sql));
}

/// Appends Parse of statement `name` (`""`: the unnamed one) with no declared
/// parameter types.
pub fn parse(out: &mut Vec<u8>, name: &str, sql: &str) {
    write_frame(out, FE_PARSE, |b| {
        put_cstr(b, name);
        put_cstr(b, sql);
        b.extend_from_slice(&0i16.to_be_bytes());
    });
}

/// Appends Bind of the unnamed portal to statement `statement` (`""`: the unnamed one),
/// parameters in text format (`None` is NULL), results in text format.
pub fn bind_text(out: &mut Vec<u8>, statement: &str, params: &[Option<&str>]) {
    bind_portal_text(out, "", statement, params);
}

/// [`bind_text`] of portal `portal`.
pub fn bind_portal_text(out: &mut Vec<u8>, portal: &str, statement: &str, params: &[Option<&str>]) {
    write_frame(out, FE_BIND, |b| {
        put_cstr(b, portal);
        put_cstr(b, statement);
        b.extend_from_slice(&0i16.to_be_bytes()); // all parameters text
        b.extend_from_slice(&(params.len() as i16).to_be_bytes());
        for p in params {
            match p {
                Some(v) => {
                    b.extend_from_slice(&(v.len() as i32).to_be_bytes());
                    b.extend_from_slice(v.as_bytes());
                }
                None => b.extend_from_slice(&(-1i32).to_be_bytes()),
            }
        }
        b.extend_from_slice(&0i16.to_be_bytes()); // all results text
    });
}

/// Appends Execute of the unnamed portal, all rows.
pub fn execute(out: &mut Vec<u8>) {
    execute_portal(out, "");
}

/// Appends Execute of portal `portal`, all rows.
pub fn execute_portal(out: &mut Vec<u8>, portal: &str) {
    write_frame(out, FE_EXECUTE, |b| {
        put_cstr(b, portal);
        b.extend_from_slice(&0i32.to_be_bytes());
    });
}

/// Appends Close of prepared statement `name` (closing one that does not exist is not
/// an error).
pub fn close_statement(out: &mut Vec<u8>, name: &str) {
    close(out, b'S', name);
}

/// Appends Close of portal `name` (closing one that does not exist is not an error).
pub fn close_portal(out: &mut Vec<u8>, name: &str) {
    close(out, b'P', name);
}

fn close(out: &mut Vec<u8>, kind: u8, name: &str) {
    write_frame(out, FE_CLOSE, |b| {
        b.push(kind);
        put_cstr(b, name);
    });
}

/// Appends Sync.
pub fn sync(out: &mut Vec<u8>) {
    write_frame(out, FE_SYNC, |_| {});
}

/// Appends Terminate.
pub fn terminate(out: &mut Vec<u8>) {
    write_frame(out, FE_TERMINATE, |_| {});
}

/// Appends SASLInitialResponse.
pub fn sasl_initial_response(out: &mut Vec<u8>, mechanism: &str, data: &[u8]) {
    write_frame(out, FE_PASSWORD, |b| {
        put_cstr(b, mechanism);
        b.extend_from_slice(&(data.len() as i32).to_be_bytes());
        b.extend_from_slice(data);
    });
}

/// Appends SASLResponse.
pub fn sasl_response(out: &mut Vec<u8>, data: &[u8]) {
    write_frame(out, FE_PASSWORD, |b| b.extend_from_slice(data));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn simple_messages() {
        let mut out = Vec::new();
        query(&mut out, "SELECT 1");
        sync(&mut out);
        terminate(&mut out);
        assert_eq!(out, b"Q\0\0\0\x0dSELECT 1\0S\0\0\0\x04X\0\0\0\x04");
    }

    #[test]
    fn bind_with_null() {
        let mut out = Vec::new();
        bind_text(&mut out, "", &[Some("ab"), None]);
        let expected: &[u8] = b"B\0\0\0\x16\0\0\0\0\0\x02\0\0\0\x02ab\xff\xff\xff\xff\0\0";
        assert_eq!(out, expected);
    }

    #[test]
    fn named_parse_and_bind() {
        let mut out = Vec::new();
        parse(&mut out, "s1", "SELECT $1");
        bind_text(&mut out, "s1", &[Some("x")]);
        let expected: &[u8] =
            b"P\0\0\0\x13s1\0SELECT $1\0\0\0B\0\0\0\x13\0s1\0\0\0\0\x01\0\0\0\x01x\0\0";
        assert_eq!(out, expected);
    }

    #[test]
    fn sasl_initial() {
        let mut out = Vec::new();
        sasl_initial_response(&mut out, "M", b"xy");
        assert_eq!(out, b"p\0\0\0\x0cM\0\0\0\0\x02xy");
    }
}
