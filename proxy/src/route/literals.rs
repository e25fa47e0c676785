//! A statement's text with its constants taken out, so statements that differ only in their
//! values share one analysis ([`super::meta::CoreMeta::place`]): a simple query's text
//! changes with every value, and parsing each one costs tens of microseconds.
//!
//! Each plain string (`'…'`) and plain number (`42`, `4.5`) becomes its index among the
//! distinct constants, written the same way (`'1'`, `1`): constants with the same text
//! share an index, so the analysis compares them as it would the originals. Anything the
//! scan does not follow exactly (an escape string, a dollar-quoted one, `1e5`, two strings
//! in a row) makes it give up: the caller analyses the text itself.

/// The most distinct constants followed.
const MAX_VALUES: usize = 64;

/// `sql` with its constants replaced by their indexes, and the constants' texts (a string's
/// with its `''` made `'`). `None`: a form the scan does not follow.
pub fn normalize(sql: &str) -> Option<(String, Vec<String>)> {
    let b = sql.as_bytes();
    let mut out = String::with_capacity(sql.len());
    let mut values: Vec<String> = Vec::new();
    let index_of = |value: String, values: &mut Vec<String>| -> Option<usize> {
        match values.iter().position(|v| *v == value) {
            Some(i) => Some(i),
            // A long VALUES list: its own analysis is cheaper than this search.
            None if values.len() >= MAX_VALUES => None,
            None => {
                values.push(value);
                Some(values.len() - 1)
            }
        }
    };
    let (mut i, mut copied) = (0, 0);
    while i < b.len() {
        let c = b[i];
        let after_word = i > 0 && is_word_byte(b[i - 1]);
        match c {
            b'-' if b.get(i + 1) == Some(&b'-') => i = line_comment_end(b, i),
            b'/' if b.get(i + 1) == Some(&b'*') => i = block_comment_end(b, i)?,
            b'"' => i = quoted_end(b, i, b'"')?,
            // A prefixed string (E'', U&'', B'', X''), a dollar quote or a parameter:
            // left to the full analysis, or kept as they are.
            b'\'' if after_word || (i > 0 && b[i - 1] == b'&') => return None,
            b'$' if !b.get(i + 1).is_some_and(u8::is_ascii_digit) => return None,
            b'$' => i = digits_end(b, i + 1),
            b'\'' => {
                let end = quoted_end(b, i, b'\'')?;
                let body = &sql[i + 1..end - 1];
                if body.contains('\\') {
                    return None; // an escape, if standard_conforming_strings is off
                }
                // `'a'` newline `'b'` is one string in SQL.
                if sql[end..].trim_start().starts_with('\'') {
                    return None;
                }
                let k = index_of(body.replace("''", "'"), &mut values)?;
                out.push_str(&sql[copied..i]);
                out.push('\'');
                out.push_str(&k.to_string());
                out.push('\'');
                (i, copied) = (end, end);
            }
            b'.' if b.get(i + 1).is_some_and(u8::is_ascii_digit) && !after_word => return None,
            b'0'..=b'9' if after_word => i = digits_end(b, i),
            b'0'..=b'9' => {
                let mut end = digits_end(b, i);
                if b.get(end) == Some(&b'.') {
                    if !b.get(end + 1).is_some_and(u8::is_ascii_digit) {
                        return None;
                    }
                    end = digits_end(b, end + 1);
                }
                // `1e5`, `0x1F`, `1_000`, `1.2.3`: not followed.
                if b.get(end).is_some_and(|&x| is_word_byte(x) || x == b'.') {
                    return None;
                }
                let k = index_of(sql[i..end].to_owned(), &mut values)?;
                out.push_str(&sql[copied..i]);
                out.push_str(&k.to_string());
                (i, copied) = (end, end);
            }
            _ => i += 1,
        }
    }
    out.push_str(&sql[copied..]);
    Some((out, values))
}

/// Whether `sql` is one SELECT, INSERT, UPDATE, DELETE, WITH, VALUES or TABLE statement
/// (a `;` after it only, comments and whitespace aside), as far as this scan can tell: any
/// form it does not follow (an escape or dollar-quoted string, an unclosed quote or comment)
/// says no. Postgres runs such a statement alike alone in a Query or after another
/// statement in the same Query (in the Query's implicit transaction block), where a LOCK, a
/// DECLARE, a CALL, VACUUM and the like run differently or not at all.
pub fn one_dml_statement(sql: &str) -> bool {
    const DML: &[&str] = &[
        "select", "insert", "update", "delete", "with", "values", "table",
    ];
    let b = sql.as_bytes();
    let (mut i, mut first, mut ended) = (0, true, false);
    while i < b.len() {
        let c = b[i];
        let after_word = i > 0 && is_word_byte(b[i - 1]);
        match c {
            b'-' if b.get(i + 1) == Some(&b'-') => i = line_comment_end(b, i),
            b'/' if b.get(i + 1) == Some(&b'*') => match block_comment_end(b, i) {
                Some(end) => i = end,
                None => return false,
            },
            _ if c.is_ascii_whitespace() => i += 1,
            // Anything after the statement's `;`, or a form not followed.
            _ if ended => return false,
            b';' => {
                ended = true;
                i += 1;
            }
            b'\'' if after_word || (i > 0 && b[i - 1] == b'&') => return false,
            b'$' if !b.get(i + 1).is_some_and(u8::is_ascii_digit) && !after_word => return false,
            b'"' | b'\'' if first => return false,
            b'"' | b'\'' => match quoted_end(b, i, c) {
                Some(end) if c == b'"' || !sql[i..end].contains('\\') => i = end,
                _ => return false,
            },
            _ if first => {
                let end = b[i..]
                    .iter()
                    .position(|&x| !is_word_byte(x))
                    .map_or(b.len(), |n| i + n);
                if !DML.iter().any(|k| sql[i..end].eq_ignore_ascii_case(k)) {
                    return false;
                }
                first = false;
                i = end.max(i + 1);
            }
            _ => i += 1,
        }
    }
    !first
}

/// A byte of an identifier or keyword (any non-ASCII byte may be one).
fn is_word_byte(x: u8) -> bool {
    x.is_ascii_alphanumeric() || x == b'_' || x == b'$' || x >= 0x80
}

fn digits_end(b: &[u8], mut i: usize) -> usize {
    while b.get(i).is_some_and(u8::is_ascii_digit) {
        i += 1;
    }
    i
}

/// Just past the closing `quote` of the quoted text at `start` (a doubled quote is one
/// inside it).
fn quoted_end(b: &[u8], start: usize, quote: u8) -> Option<usize> {
    let mut i = start + 1;
    loop {
        let n = b[i..].iter().position(|&x| x == quote)?;
        i += n + 1;
        if b.get(i) != Some(&quote) {
            return Some(i);
        }
        i += 1;
    }
}

/// The end of the line comment at `start`: a newline or a carriage return ends it, as
/// Postgres's lexer has it.
fn line_comment_end(b: &[u8], start: usize) -> usize {
    b[start..]
        .iter()
        .position(|&x| x == b'\n' || x == b'\r')
        .map_or(b.len(), |n| start + n)
}

/// Just past the end of the (nested, as in Postgres) block comment at `start`.
fn block_comment_end(b: &[u8], start: usize) -> Option<usize> {
    let (mut depth, mut i) = (0usize, start);
    while i + 1 < b.len() {
        match (b[i], b[i + 1]) {
            (b'/', b'*') => {
                depth += 1;
                i += 2;
            }
            (b'*', b'/') => {
                depth -= 1;
                i += 2;
                if depth == 0 {
                    return Some(i);
                }
            }
            _ => i += 1,
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn n(sql: &str) -> Option<(String, Vec<String>)> {
        normalize(sql)
    }

    #[test]
    fn constants_become_indexes_shared_by_equal_texts() {
        let (key, values) = n(
            "SELECT * FROM documents d WHERE d.organization_id = 42 AND title = 'it''s' AND id > 42 AND x = 4.50",
        )
        .unwrap();
        assert_eq!(
            key,
            "SELECT * FROM documents d WHERE d.organization_id = 0 AND title = '1' AND id > 0 AND x = 2"
        );
        assert_eq!(values, ["42", "it's", "4.50"]);
        // The same statement with other values has the same key.
        let (other, values) = n(
            "SELECT * FROM documents d WHERE d.organization_id = 7 AND title = 'b' AND id > 9 AND x = 1.25",
        )
        .unwrap();
        assert_eq!(
            other,
            "SELECT * FROM documents d WHERE d.organization_id = 0 AND title = '1' AND id > 2 AND x = 3"
        );
        assert_eq!(values, ["7", "b", "9", "1.25"]);
        // A number and a string of the same text share an index, as their values compare.
        assert_eq!(
            n("SELECT 1 WHERE a = 2 AND b = '2'::int").unwrap(),
            (
                "SELECT 0 WHERE a = 1 AND b = '1'::int".to_owned(),
                vec!["1".into(), "2".into()]
            )
        );
    }

    #[test]
    fn identifiers_parameters_comments_and_quoted_names_are_kept() {
        let sql = "SELECT t1.\"col 1\", $1 FROM t1 -- where a = 5\n WHERE /* 'x' /* 3 */ */ a = $2";
        assert_eq!(n(sql).unwrap(), (sql.to_owned(), vec![]));
        assert_eq!(
            n("SELECT \"a\"\"b\" FROM x WHERE y = 3").unwrap().0,
            "SELECT \"a\"\"b\" FROM x WHERE y = 0"
        );
        assert_eq!(
            n("SELECT interval '1 day', date '2020-01-01'").unwrap().0,
            "SELECT interval '0', date '1'"
        );
    }

    #[test]
    fn forms_the_scan_does_not_follow_give_up() {
        for sql in [
            "SELECT E'a\\'b'",
            "SELECT U&'d\\0061t'",
            "SELECT x'1F'",
            "SELECT $$a$$",
            "SELECT $tag$a$tag$",
            "SELECT 'a\\b'",
            "SELECT 'a'\n'b'",
            "SELECT 1e5",
            "SELECT 0x1F",
            "SELECT 1_000",
            "SELECT .5",
            "SELECT 2.",
            "SELECT 'open",
            "SELECT \"open",
            "SELECT /* open",
        ] {
            assert_eq!(n(sql), None, "{sql}");
        }
    }

    #[test]
    fn one_dml_statement_is_told_from_others() {
        for sql in [
            "SELECT 1",
            "select * from documents where organization_id = 2;",
            "  -- a comment\n/* and /* nested */ one */ UPDATE documents SET title = 'a;b' WHERE id = 1 ;  -- done",
            "WITH x AS (SELECT 1) SELECT * FROM x",
            "INSERT INTO \"my;table\" VALUES (1)",
            "DELETE FROM t",
            "VALUES (1)",
            "TABLE t",
        ] {
            assert!(one_dml_statement(sql), "{sql}");
        }
        for sql in [
            "",
            ";",
            "-- only a comment",
            "SELECT 1; SELECT 2",
            "SELECT 1; BEGIN",
            "BEGIN; SELECT 1",
            "LOCK documents",
            "DECLARE c CURSOR FOR SELECT 1",
            "CALL p()",
            "VACUUM documents",
            "COPY documents FROM STDIN",
            "EXPLAIN SELECT 1",
            "SET lokadb.org = '2'",
            "SELECT E'a\\'b'",
            "SELECT 'a\\b'",
            "SELECT $$a$$",
            "SELECT 'open",
            "SELECT /* open",
            "selector",
            "(SELECT 1)",
            "\"select\" FROM t",
        ] {
            assert!(!one_dml_statement(sql), "{sql}");
        }
    }

    proptest::proptest! {
        /// Any text is scanned without panicking, and a key is its own key (its constants
        /// are the indexes 0, 1, … in order).
        #[test]
        fn any_text_is_scanned_and_a_key_is_its_own_key(sql in "[ -~\n\u{e9}]{0,80}") {
            if let Some((key, values)) = normalize(&sql) {
                proptest::prop_assert!(values.len() <= MAX_VALUES);
                let (again, indexes) = normalize(&key).expect("a key scans");
                proptest::prop_assert_eq!(&again, &key);
                let expected: Vec<String> = (0..values.len()).map(|i| i.to_string()).collect();
                proptest::prop_assert_eq!(indexes, expected);
            }
        }
    }
}
