//! A bound parameter's value as the text the cloud would compare: the organization (or key)
//! a Bind places its statement in, read by the parameter's type, never by its length.
//!
//! The type is the one the client's Parse declared for the parameter, else (declared 0: left
//! to the server) the organization column's, which the server then gives it. A value this
//! module cannot read with certainty is `None`, and its statement goes through the cloud,
//! which is always correct: a wrong reading could send it to another organization's
//! database, where a read answers nothing and a write changes nothing (issue 22).

/// How a parameter's bytes are read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ValueType {
    Int2,
    Int4,
    Int8,
    /// `text`, `varchar`, `name`, `unknown`: the bytes are the text in both formats.
    Text,
    Uuid,
    /// Any other type (`numeric`, `char(n)`, …), or a type not known here: a text value is
    /// taken as it is (the cloud's cast decides), a binary one is not read.
    Other,
}

/// Type OIDs (`pg_type.h`; fixed since PostgreSQL 7).
const NAME: u32 = 19;
const INT8: u32 = 20;
const INT2: u32 = 21;
const INT4: u32 = 23;
const TEXT: u32 = 25;
const UNKNOWN: u32 = 705;
const VARCHAR: u32 = 1043;
const UUID: u32 = 2950;

impl ValueType {
    /// The type of a declared type OID.
    pub fn from_oid(oid: u32) -> ValueType {
        match oid {
            INT2 => ValueType::Int2,
            INT4 => ValueType::Int4,
            INT8 => ValueType::Int8,
            NAME | TEXT | UNKNOWN | VARCHAR => ValueType::Text,
            UUID => ValueType::Uuid,
            _ => ValueType::Other,
        }
    }

    /// The type of an SQL type name, as `format_type` writes it (`bigint`, `character
    /// varying(64)`) or as a statement spells it (`INT8`, `VARCHAR(3)`).
    pub fn from_sql(name: &str) -> ValueType {
        let lower = name.trim().to_ascii_lowercase();
        let base = lower.split('(').next().unwrap_or("").trim();
        let base = base.strip_prefix("pg_catalog.").unwrap_or(base);
        match base {
            "smallint" | "int2" => ValueType::Int2,
            "integer" | "int" | "int4" => ValueType::Int4,
            "bigint" | "int8" => ValueType::Int8,
            "text" | "varchar" | "character varying" | "name" => ValueType::Text,
            "uuid" => ValueType::Uuid,
            _ => ValueType::Other,
        }
    }

    /// The parameter's type: the `declared` OID (0: left to the server, `None`: the Parse is
    /// not known here), else the type of the `column` it is compared with, which the server
    /// infers for it.
    pub fn resolve(declared: Option<u32>, column: Option<ValueType>) -> ValueType {
        match declared {
            Some(0) => column.unwrap_or(ValueType::Other),
            Some(oid) => ValueType::from_oid(oid),
            // Whatever the client declared is unknown: only a text value is read, as it is.
            None => ValueType::Other,
        }
    }

    /// The value's text as the cloud compares it, or `None` when it cannot be read with
    /// certainty (the statement then goes through the cloud): integers without sign, zeros
    /// or spaces of their own, uuids in their canonical lowercase form.
    pub fn decode(self, binary: bool, bytes: &[u8]) -> Option<String> {
        match (self, binary) {
            (ValueType::Int2, true) => Some(i16::from_be_bytes(bytes.try_into().ok()?).to_string()),
            (ValueType::Int4, true) => Some(i32::from_be_bytes(bytes.try_into().ok()?).to_string()),
            (ValueType::Int8, true) => Some(i64::from_be_bytes(bytes.try_into().ok()?).to_string()),
            (ValueType::Int2 | ValueType::Int4 | ValueType::Int8, false) => {
                let v = parse_int(std::str::from_utf8(bytes).ok()?)?;
                let fits = match self {
                    ValueType::Int2 => i16::try_from(v).is_ok(),
                    ValueType::Int4 => i32::try_from(v).is_ok(),
                    _ => true,
                };
                fits.then(|| v.to_string())
            }
            (ValueType::Uuid, true) => Some(uuid_text(bytes.try_into().ok()?)),
            (ValueType::Uuid, false) => parse_uuid(std::str::from_utf8(bytes).ok()?).map(uuid_text),
            (ValueType::Text | ValueType::Other, false) | (ValueType::Text, true) => {
                std::str::from_utf8(bytes).ok().map(str::to_owned)
            }
            (ValueType::Other, true) => None,
        }
    }
}

/// The type the server gives `$n` (1-based) of `sql` when the Parse left it to the server
/// and a cast is written right after it (`$1::text`, `$1 :: varchar(64)::bigint`: the
/// first cast), or in `CAST($1 AS type)`: `None` when it is written without one (it takes
/// the type of what it is compared with), [`ValueType::Other`] when that is not certain
/// (`($1)::text`, a cast of an expression, `$n` written bare and cast, or cast to two types).
pub fn param_cast(sql: &str, n: u16) -> Option<ValueType> {
    let needle = format!("${n}");
    let bytes = sql.as_bytes();
    let (mut uses, mut casts, mut cast) = (0, 0, None::<ValueType>);
    let mut from = 0;
    while let Some(at) = sql[from..].find(&needle).map(|i| i + from) {
        from = at + needle.len();
        let before = sql[..at].trim_end();
        let ident = |b: u8| b.is_ascii_alphanumeric() || b == b'_' || b == b'$';
        if bytes.get(from).is_some_and(|&b| ident(b)) || before.bytes().last().is_some_and(ident) {
            continue;
        }
        uses += 1;
        let after = sql[from..].trim_start();
        let cast_as = before.len() >= 5
            && before.is_char_boundary(before.len() - 5)
            && before[before.len() - 5..].eq_ignore_ascii_case("cast(");
        if let Some(rest) = after.strip_prefix("::") {
            cast = agree(cast, type_word(rest), &mut casts);
        } else if after
            .trim_start_matches(|c: char| c == ')' || c.is_ascii_whitespace())
            .starts_with("::")
        {
            // `($1)::text`: a cast of the parenthesis, which may hold more than `$1`.
            cast = agree(cast, ValueType::Other, &mut casts);
        } else if cast_as {
            // `CAST($1 AS bigint)`.
            let ty = match after.get(..3) {
                Some(a)
                    if a[..2].eq_ignore_ascii_case("as")
                        && a.ends_with(|c: char| c.is_ascii_whitespace()) =>
                {
                    type_word(&after[3..])
                }
                _ => ValueType::Other,
            };
            cast = agree(cast, ty, &mut casts);
        }
    }
    match cast {
        None => None,
        // Every use cast to one type: the server gives it that type.
        Some(t) if casts == uses => Some(t),
        Some(_) => Some(ValueType::Other),
    }
}

/// One more cast of a parameter: its type when every cast so far agrees, else `Other`.
fn agree(so_far: Option<ValueType>, ty: ValueType, casts: &mut usize) -> Option<ValueType> {
    *casts += 1;
    Some(match so_far {
        Some(t) if t != ty => ValueType::Other,
        _ => ty,
    })
}

/// The type named at the start of `text` (`bigint`, `character varying(64)`, …).
fn type_word(text: &str) -> ValueType {
    let text = text.trim_start();
    let word: String = text
        .chars()
        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
        .collect();
    let tail = text[word.len()..].trim_start();
    if word.eq_ignore_ascii_case("character")
        && tail
            .get(..7)
            .is_some_and(|t| t.eq_ignore_ascii_case("varying"))
    {
        ValueType::Text
    } else {
        ValueType::from_sql(&word)
    }
}

/// An integer as Postgres's integer input reads it in its plain form: spaces around, an
/// optional sign, decimal digits. Underscores and `0x` prefixes (PostgreSQL 16+) are left to
/// the cloud (`None`).
fn parse_int(text: &str) -> Option<i64> {
    let t = text.trim_matches(|c: char| c.is_ascii_whitespace());
    let digits = t.strip_prefix(['+', '-']).unwrap_or(t);
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    t.strip_prefix('+').unwrap_or(t).parse().ok()
}

/// A uuid's 16 bytes from its text as Postgres's `uuid_in` accepts it: 32 hex digits, a
/// hyphen allowed after any group of four, optionally in braces.
fn parse_uuid(text: &str) -> Option<[u8; 16]> {
    let inner = match text.strip_prefix('{') {
        Some(rest) => rest.strip_suffix('}')?,
        None => text,
    };
    let mut out = [0u8; 16];
    let mut digits = 0usize;
    let mut bytes = inner.bytes().peekable();
    while let Some(b) = bytes.next() {
        let v = (b as char).to_digit(16)? as u8;
        if digits >= 32 {
            return None;
        }
        out[digits / 2] |= if digits.is_multiple_of(2) { v << 4 } else { v };
        digits += 1;
        if digits.is_multiple_of(4) && digits < 32 && bytes.peek() == Some(&b'-') {
            bytes.next();
        }
    }
    (digits == 32).then_some(out)
}

/// The canonical text of a uuid: lowercase, `8-4-4-4-12`.
fn uuid_text(b: [u8; 16]) -> String {
    let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &hex[..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..]
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_bound_in_binary_is_read_as_text_not_as_an_integer() {
        // asyncpg and tokio-postgres bind a text organization id `'10'` in binary: two bytes,
        // which the length rule read as the int2 12592.
        assert_eq!(ValueType::Text.decode(true, b"10"), Some("10".into()));
        assert_eq!(ValueType::Text.decode(true, b"acme"), Some("acme".into()));
        assert_eq!(ValueType::Text.decode(true, b"\xff\xfe"), None);
    }

    #[test]
    fn integers_by_their_declared_width() {
        assert_eq!(
            ValueType::Int2.decode(true, &7i16.to_be_bytes()),
            Some("7".into())
        );
        assert_eq!(
            ValueType::Int4.decode(true, &(-9i32).to_be_bytes()),
            Some("-9".into())
        );
        assert_eq!(
            ValueType::Int8.decode(true, &10_000_000_000i64.to_be_bytes()),
            Some("10000000000".into())
        );
        // A width the type does not have is not guessed at.
        assert_eq!(ValueType::Int8.decode(true, &7i32.to_be_bytes()), None);
        assert_eq!(ValueType::Int4.decode(true, b"10"), None);
    }

    #[test]
    fn integers_in_text_as_the_cloud_compares_them() {
        assert_eq!(ValueType::Int8.decode(false, b" 007 "), Some("7".into()));
        assert_eq!(ValueType::Int4.decode(false, b"+42"), Some("42".into()));
        assert_eq!(ValueType::Int4.decode(false, b"-0"), Some("0".into()));
        assert_eq!(ValueType::Int2.decode(false, b"40000"), None);
        assert_eq!(ValueType::Int8.decode(false, b"1_000"), None);
        assert_eq!(ValueType::Int8.decode(false, b"4.0"), None);
        assert_eq!(ValueType::Int8.decode(false, b""), None);
        assert_eq!(ValueType::Int8.decode(false, b"-"), None);
    }

    #[test]
    fn uuids_in_both_formats_give_the_canonical_text() {
        let canonical = "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11";
        let bytes: [u8; 16] = [
            0xa0, 0xee, 0xbc, 0x99, 0x9c, 0x0b, 0x4e, 0xf8, 0xbb, 0x6d, 0x6b, 0xb9, 0xbd, 0x38,
            0x0a, 0x11,
        ];
        assert_eq!(ValueType::Uuid.decode(true, &bytes), Some(canonical.into()));
        for text in [
            canonical,
            "A0EEBC99-9C0B-4EF8-BB6D-6BB9BD380A11",
            "{a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11}",
            "a0eebc999c0b4ef8bb6d6bb9bd380a11",
            "a0ee-bc99-9c0b-4ef8-bb6d-6bb9-bd38-0a11",
        ] {
            assert_eq!(
                ValueType::Uuid.decode(false, text.as_bytes()),
                Some(canonical.into()),
                "{text}"
            );
        }
        for bad in [
            "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a1",
            "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a111",
            "a0eebc9-99c0b-4ef8-bb6d-6bb9bd380a11",
            "{a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11",
            "a0eebc99--9c0b-4ef8-bb6d-6bb9bd380a11",
            "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11-",
        ] {
            assert_eq!(ValueType::Uuid.decode(false, bad.as_bytes()), None, "{bad}");
        }
        assert_eq!(ValueType::Uuid.decode(true, &bytes[..15]), None);
    }

    #[test]
    fn a_cast_written_after_the_parameter_gives_its_type() {
        let sql = |s: &str| param_cast(s, 1);
        assert_eq!(sql("SELECT 1 FROM t WHERE org = $1"), None);
        assert_eq!(sql("WHERE org = $1::text::bigint"), Some(ValueType::Text));
        assert_eq!(sql("WHERE org = $1 :: INT4"), Some(ValueType::Int4));
        assert_eq!(
            sql("WHERE org = ($1)::character varying(64)"),
            Some(ValueType::Other)
        );
        assert_eq!(sql("WHERE (org = $1)"), None);
        assert_eq!(
            sql("WHERE org = $1::character  varying(64)"),
            Some(ValueType::Text)
        );
        assert_eq!(sql("WHERE org = $1::numeric"), Some(ValueType::Other));
        assert_eq!(sql("WHERE org = CAST($1 AS bigint)"), Some(ValueType::Int8));
        assert_eq!(sql("WHERE org = cast( $1 as text)"), Some(ValueType::Text));
        assert_eq!(
            sql("WHERE org = CAST($1 || 'x' AS text)"),
            Some(ValueType::Other)
        );
        assert_eq!(
            sql("WHERE a.org = $1::bigint AND b.org = $1::int8"),
            Some(ValueType::Int8)
        );
        assert_eq!(
            sql("WHERE a.org = $1::bigint AND b.org = $1::text"),
            Some(ValueType::Other)
        );
        assert_eq!(
            sql("WHERE org = $1::text AND x = $1"),
            Some(ValueType::Other)
        );
        // `$10` and `x$1` are not `$1`.
        assert_eq!(
            sql("WHERE org = $1 AND y = $10::text AND x$1::text = 'a'"),
            None
        );
        assert_eq!(param_cast("WHERE a = $2::uuid", 2), Some(ValueType::Uuid));
    }

    #[test]
    fn other_types_only_in_text() {
        assert_eq!(ValueType::Other.decode(false, b"ab "), Some("ab ".into()));
        assert_eq!(ValueType::Other.decode(true, &7i32.to_be_bytes()), None);
    }

    #[test]
    fn the_declared_type_wins_over_the_column() {
        let column = |sql| Some(ValueType::from_sql(sql));
        assert_eq!(
            ValueType::resolve(Some(INT8), column("integer")),
            ValueType::Int8
        );
        assert_eq!(
            ValueType::resolve(Some(TEXT), column("bigint")),
            ValueType::Text
        );
        assert_eq!(
            ValueType::resolve(Some(0), column("bigint")),
            ValueType::Int8
        );
        assert_eq!(
            ValueType::resolve(Some(0), column("character varying(64)")),
            ValueType::Text
        );
        assert_eq!(ValueType::resolve(Some(0), column("uuid")), ValueType::Uuid);
        assert_eq!(
            ValueType::resolve(Some(0), column("character(8)")),
            ValueType::Other
        );
        assert_eq!(ValueType::resolve(Some(0), None), ValueType::Other);
        assert_eq!(ValueType::resolve(None, column("bigint")), ValueType::Other);
        assert_eq!(ValueType::from_sql("BIGINT"), ValueType::Int8);
        assert_eq!(ValueType::from_sql("INT"), ValueType::Int4);
        assert_eq!(ValueType::from_sql("VARCHAR(3)"), ValueType::Text);
    }
}
