//! Frontend messages: encoders for those the proxy sends itself when it acts as a client
//! of the cloud (login, the auth query, the pool reset) or adds to client traffic (a
//! prepared statement re-parsed on the backend that runs it), and typed decoders of those
//! it routes ([`Statement`] for Query and Parse, [`Bind`], [`Close`]). The decoders borrow
//! the body and never allocate; every read is bounds-checked ([`Fields`]).

use super::backend::{put_cstr, write_frame};
use super::fields::Fields;
use super::frame::FrameError;
use super::tags::*;

/// A Query or a Parse: the statement's text, a Parse's statement name (`""`: the unnamed
/// one), and what follows the text in a Parse (its declared parameter types).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Statement<'a> {
    /// The statement name of a Parse; `None` for a Query.
    pub name: Option<&'a str>,
    /// The statement's text.
    pub sql: &'a str,
    /// A Parse's parameter types as sent (count, then one OID each); empty for a Query.
    pub rest: &'a [u8],
}

impl<'a> Statement<'a> {
    /// Decodes the body of a Query (`tag` [`FE_QUERY`]) or a Parse ([`FE_PARSE`]).
    ///
    /// # Errors
    ///
    /// A body cut short or a text that is not UTF-8.
    pub fn decode(tag: u8, body: &'a [u8]) -> Result<Statement<'a>, FrameError> {
        let mut f = Fields::new(body, if tag == FE_PARSE { "Parse" } else { "Query" });
        let name = if tag == FE_PARSE {
            Some(f.cstr()?)
        } else {
            None
        };
        let sql = f.cstr()?;
        Ok(Statement {
            name,
            sql,
            rest: f.rest(),
        })
    }

    /// The type a Parse declared for parameter `$n` (1-based): 0 when it left it to the
    /// server, or declared fewer.
    ///
    /// # Errors
    ///
    /// The types are cut short.
    pub fn param_type(&self, n: u16) -> Result<u32, FrameError> {
        let mut f = Fields::new(self.rest, "Parse");
        if self.rest.is_empty() {
            return Ok(0);
        }
        let count = f.i16()?.max(0) as u16;
        if n == 0 || n > count {
            return Ok(0);
        }
        for _ in 1..n {
            f.i32()?;
        }
        Ok(f.i32()? as u32)
    }

    /// The same message with `sql` in place of its text, framed (tag and length).
    pub fn with_sql(&self, sql: &str) -> Vec<u8> {
        let mut frame = Vec::with_capacity(sql.len() + self.rest.len() + 64);
        let tag = if self.name.is_some() {
            FE_PARSE
        } else {
            FE_QUERY
        };
        write_frame(&mut frame, tag, |b| {
            if let Some(name) = self.name {
                put_cstr(b, name);
            }
            put_cstr(b, sql);
            b.extend_from_slice(self.rest);
        });
        frame
    }
}

/// A parameter of a [`Bind`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Param<'a> {
    /// The Bind has no such parameter.
    Missing,
    /// Bound to NULL.
    Null,
    /// A value.
    Value {
        /// Sent in binary format (else text).
        binary: bool,
        /// Its bytes as sent.
        bytes: &'a [u8],
    },
}

/// A Bind: portal and statement names; its format codes and parameters are read on demand
/// ([`Bind::param`]), so a Bind whose names are whole is routed by them even when the rest
/// is malformed (the server then refuses it, in the stream's order).
#[derive(Debug, Clone, Copy)]
pub struct Bind<'a> {
    /// The portal it creates (`""`: the unnamed one).
    pub portal: &'a str,
    /// The prepared statement it binds (`""`: the unnamed one).
    pub statement: &'a str,
    /// Everything after the statement name, as sent.
    tail: &'a [u8],
}

impl<'a> Bind<'a> {
    /// Decodes a Bind body's portal and statement names.
    ///
    /// # Errors
    ///
    /// A body cut short or a name that is not UTF-8.
    pub fn decode(body: &'a [u8]) -> Result<Bind<'a>, FrameError> {
        let mut f = Fields::new(body, "Bind");
        Ok(Bind {
            portal: f.cstr()?,
            statement: f.cstr()?,
            tail: f.rest(),
        })
    }

    /// The same Bind of statement `statement` instead, framed (tag and length).
    pub fn with_statement(&self, statement: &str) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.tail.len() + self.portal.len() + 16);
        write_frame(&mut out, FE_BIND, |b| {
            put_cstr(b, self.portal);
            put_cstr(b, statement);
            b.extend_from_slice(self.tail);
        });
        out
    }

    /// The format codes (Int16 each, as sent), and a reader at the parameter count.
    fn formats(&self) -> Result<(&'a [u8], Fields<'a>), FrameError> {
        let mut f = Fields::new(self.tail, "Bind");
        let n = f.i16()?.max(0) as usize;
        let formats = f.take(n * 2)?;
        Ok((formats, f))
    }

    /// How many parameters it binds.
    ///
    /// # Errors
    ///
    /// The format codes or the count are cut short.
    pub fn param_count(&self) -> Result<u16, FrameError> {
        let (_, mut f) = self.formats()?;
        Ok(f.i16()?.max(0) as u16)
    }

    /// Parameter `$n` (1-based).
    ///
    /// # Errors
    ///
    /// The format codes or the parameters are cut short.
    pub fn param(&self, n: u16) -> Result<Param<'a>, FrameError> {
        let (formats, mut f) = self.formats()?;
        let count = f.i16()?.max(0) as u16;
        if n == 0 || n > count {
            return Ok(Param::Missing);
        }
        for i in 1..=n {
            let len = f.i32()?;
            let bytes = if len < 0 {
                None
            } else {
                Some(f.take(len as usize)?)
            };
            if i < n {
                continue;
            }
            return Ok(match bytes {
                None => Param::Null,
                Some(bytes) => Param::Value {
                    binary: binary(formats, n),
                    bytes,
                },
            });
        }
        Ok(Param::Missing)
    }
}

/// Whether parameter `$n` is sent in binary by `formats` (a Bind's codes): no code is text
/// for all, one code is for all, otherwise one code each.
fn binary(formats: &[u8], n: u16) -> bool {
    let code = |i: usize| {
        formats
            .get(i * 2..i * 2 + 2)
            .map(|b| i16::from_be_bytes([b[0], b[1]]))
    };
    match formats.len() / 2 {
        0 => false,
        1 => code(0) == Some(1),
        _ => code(usize::from(n) - 1) == Some(1),
    }
}

/// A Close of a prepared statement or a portal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Close<'a> {
    /// `b'S'` (statement) or `b'P'` (portal); any other byte as sent (the server refuses
    /// it, in the stream's order).
    pub kind: u8,
    /// The statement's or portal's name (`""`: the unnamed one).
    pub name: &'a str,
}

impl<'a> Close<'a> {
    /// Decodes a Close body.
    ///
    /// # Errors
    ///
    /// A body cut short or a name that is not UTF-8.
    pub fn decode(body: &'a [u8]) -> Result<Close<'a>, FrameError> {
        let mut f = Fields::new(body, "Close");
        let kind = f.u8()?;
        Ok(Close {
            kind,
            name: f.cstr()?,
        })
    }
}

/// A client message the proxy routes by, decoded once: the statement of a Query or Parse,
/// a Bind's names, a Close; any other message by its tag alone.
#[derive(Debug, Clone, Copy)]
pub enum Message<'a> {
    /// A simple Query.
    Query(Statement<'a>),
    /// A Parse.
    Parse(Statement<'a>),
    /// A Bind.
    Bind(Bind<'a>),
    /// A Close.
    Close(Close<'a>),
    /// Any other message: its tag.
    Other(u8),
}

impl<'a> Message<'a> {
    /// Decodes the body of a message with tag `tag`.
    ///
    /// # Errors
    ///
    /// A Query, Parse, Bind or Close cut short, or with a name or text that is not UTF-8.
    pub fn decode(tag: u8, body: &'a [u8]) -> Result<Message<'a>, FrameError> {
        Ok(match tag {
            FE_QUERY => Message::Query(Statement::decode(tag, body)?),
            FE_PARSE => Message::Parse(Statement::decode(tag, body)?),
            FE_BIND => Message::Bind(Bind::decode(body)?),
            FE_CLOSE => Message::Close(Close::decode(body)?),
            other => Message::Other(other),
        })
    }

    /// The statement of a Query or a Parse.
    pub fn statement(&self) -> Option<&Statement<'a>> {
        match self {
            Message::Query(s) | Message::Parse(s) => Some(s),
            _ => None,
        }
    }

    /// A Bind's names.
    pub fn bind(&self) -> Option<&Bind<'a>> {
        match self {
            Message::Bind(b) => Some(b),
            _ => None,
        }
    }
}

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

/// Appends Describe of prepared statement `name`.
pub fn describe_statement(out: &mut Vec<u8>, name: &str) {
    write_frame(out, FE_DESCRIBE, |b| {
        b.push(b'S');
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
    fn a_message_decodes_by_its_tag_once() {
        let body = |f: &[u8]| f[5..].to_vec();
        let mut q = Vec::new();
        query(&mut q, "SELECT 1");
        let q = body(&q);
        assert!(
            matches!(Message::decode(FE_QUERY, &q), Ok(Message::Query(s)) if s.sql == "SELECT 1" && s.name.is_none())
        );
        let mut p = Vec::new();
        parse(&mut p, "s1", "SELECT $1");
        let p = body(&p);
        let m = Message::decode(FE_PARSE, &p).unwrap();
        assert_eq!(
            m.statement().map(|s| (s.name, s.sql)),
            Some((Some("s1"), "SELECT $1"))
        );
        let mut b = Vec::new();
        bind_portal_text(&mut b, "p", "s1", &[Some("x")]);
        let b = body(&b);
        let m = Message::decode(FE_BIND, &b).unwrap();
        assert_eq!(m.bind().map(|b| (b.portal, b.statement)), Some(("p", "s1")));
        assert!(m.statement().is_none());
        let mut c = Vec::new();
        close_statement(&mut c, "s1");
        let c = body(&c);
        assert!(matches!(
            Message::decode(FE_CLOSE, &c),
            Ok(Message::Close(Close {
                kind: b'S',
                name: "s1"
            }))
        ));
        // Others by their tag alone, whatever their body; the four cut short are refused.
        assert!(matches!(
            Message::decode(FE_SYNC, b"junk"),
            Ok(Message::Other(FE_SYNC))
        ));
        for tag in [FE_QUERY, FE_PARSE, FE_BIND, FE_CLOSE] {
            assert!(Message::decode(tag, b"no end").is_err(), "{}", tag as char);
        }
    }

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
    fn statements_decode_from_what_the_encoders_write() {
        let mut out = Vec::new();
        parse(&mut out, "s1", "SELECT $1");
        let p = Statement::decode(FE_PARSE, &out[5..]).unwrap();
        assert_eq!(
            (p.name, p.sql, p.rest),
            (Some("s1"), "SELECT $1", &[0u8, 0][..])
        );
        assert_eq!(p.param_type(1), Ok(0));
        assert_eq!(p.with_sql("SELECT $1"), out);
        out.clear();
        query(&mut out, "SELECT 1");
        let q = Statement::decode(FE_QUERY, &out[5..]).unwrap();
        assert_eq!((q.name, q.sql, q.rest), (None, "SELECT 1", &[][..]));
        assert_eq!(q.with_sql("SELECT 2")[5..], b"SELECT 2\0"[..]);
    }

    #[test]
    fn declared_types_are_read_by_position() {
        // Parse "" "SELECT $1, $2" with types int4 (23) and 0.
        let body = b"\0SELECT $1, $2\0\0\x02\0\0\0\x17\0\0\0\0";
        let p = Statement::decode(FE_PARSE, body).unwrap();
        assert_eq!(p.param_type(1), Ok(23));
        assert_eq!(p.param_type(2), Ok(0));
        assert_eq!(p.param_type(3), Ok(0));
        assert!(Statement::decode(FE_PARSE, &body[..body.len() - 2])
            .unwrap()
            .param_type(2)
            .is_err());
    }

    #[test]
    fn bind_parameters_and_their_formats() {
        let mut out = Vec::new();
        bind_portal_text(&mut out, "p", "s1", &[Some("ab"), None]);
        let b = Bind::decode(&out[5..]).unwrap();
        assert_eq!((b.portal, b.statement), ("p", "s1"));
        assert_eq!(b.param_count(), Ok(2));
        assert_eq!(
            b.param(1),
            Ok(Param::Value {
                binary: false,
                bytes: b"ab"
            })
        );
        assert_eq!(b.param(2), Ok(Param::Null));
        assert_eq!(b.param(3), Ok(Param::Missing));
        assert_eq!(b.param(0), Ok(Param::Missing));
        let mut other = Vec::new();
        bind_portal_text(&mut other, "p", "s2", &[Some("ab"), None]);
        assert_eq!(b.with_statement("s2"), other);
        // Two format codes (text, binary), two values.
        let body = b"\0\0\0\x02\0\0\0\x01\0\x02\0\0\0\x01x\0\0\0\x02\0\x07\0\0";
        let b = Bind::decode(body).unwrap();
        assert_eq!(
            b.param(1),
            Ok(Param::Value {
                binary: false,
                bytes: b"x"
            })
        );
        assert_eq!(
            b.param(2),
            Ok(Param::Value {
                binary: true,
                bytes: b"\0\x07"
            })
        );
        // One code for all.
        let body = b"\0\0\0\x01\0\x01\0\x01\0\0\0\x01x\0\0";
        assert_eq!(
            Bind::decode(body).unwrap().param(1),
            Ok(Param::Value {
                binary: true,
                bytes: b"x"
            })
        );
    }

    #[test]
    fn malformed_bodies_are_errors_not_panics() {
        assert!(Bind::decode(b"p\0s").is_err());
        // Names whole, format codes cut short: routed by its names, its parameters errors.
        let codes_cut = Bind::decode(b"\0\0\0\x05").unwrap();
        assert!(codes_cut.param(1).is_err() && codes_cut.param_count().is_err());
        let cut = Bind::decode(b"\0\0\0\0\0\x02\0\0\0\x09ab").unwrap();
        assert!(cut.param(1).is_err());
        assert_eq!(Close::decode(b"Xname\0").map(|c| c.kind), Ok(b'X'));
        assert!(Close::decode(b"S").is_err());
        assert_eq!(
            Close::decode(b"Pcur\0"),
            Ok(Close {
                kind: b'P',
                name: "cur"
            })
        );
        assert!(Statement::decode(FE_QUERY, b"SELECT 1").is_err());
        assert!(Statement::decode(FE_QUERY, b"\xff\0").is_err());
        for len in 0..40 {
            let junk: Vec<u8> = (0..len).map(|i| (i * 37 + 11) as u8).collect();
            let _ = Statement::decode(FE_PARSE, &junk).map(|s| s.param_type(3));
            if let Ok(b) = Bind::decode(&junk) {
                for n in 0..4 {
                    let _ = b.param(n);
                }
            }
            let _ = Close::decode(&junk);
        }
    }

    proptest::proptest! {
        /// Whatever a client sends, the decoders answer or refuse: no panic, and a value
        /// read lies inside the body.
        #[test]
        fn any_body_decodes_or_is_refused(body in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..64), n in 0u16..6) {
            for tag in [FE_QUERY, FE_PARSE] {
                if let Ok(st) = Statement::decode(tag, &body) {
                    let _ = st.param_type(n);
                    proptest::prop_assert!(st.sql.len() < body.len());
                }
            }
            if let Ok(b) = Bind::decode(&body) {
                let _ = b.param_count();
                if let Ok(Param::Value { bytes, .. }) = b.param(n) {
                    proptest::prop_assert!(bytes.len() <= body.len());
                }
            }
            let _ = Close::decode(&body);
        }

        /// What the encoders write, the decoders read back.
        #[test]
        fn encoded_binds_read_back(
            portal in "[a-z]{0,8}",
            statement in "[a-z0-9_]{0,8}",
            params in proptest::collection::vec(proptest::option::of("[ -~]{0,12}"), 0..6),
        ) {
            let refs: Vec<Option<&str>> = params.iter().map(|p| p.as_deref()).collect();
            let mut out = Vec::new();
            bind_portal_text(&mut out, &portal, &statement, &refs);
            let b = Bind::decode(&out[5..]).unwrap();
            proptest::prop_assert_eq!((b.portal, b.statement), (portal.as_str(), statement.as_str()));
            proptest::prop_assert_eq!(b.param_count().unwrap() as usize, params.len());
            for (i, p) in params.iter().enumerate() {
                let want = match p {
                    None => Param::Null,
                    Some(v) => Param::Value { binary: false, bytes: v.as_bytes() },
                };
                proptest::prop_assert_eq!(b.param(i as u16 + 1).unwrap(), want);
            }
            proptest::prop_assert_eq!(b.with_statement(&statement), out);
        }
    }

    #[test]
    fn sasl_initial() {
        let mut out = Vec::new();
        sasl_initial_response(&mut out, "M", b"xy");
        assert_eq!(out, b"p\0\0\0\x0cM\0\0\0\0\x02xy");
    }
}
