//! Reads the head of a `CREATE INDEX` statement — `CREATE [UNIQUE] INDEX [CONCURRENTLY]
//! [IF NOT EXISTS] name ON [ONLY] table` — and keeps the rest (method, columns, INCLUDE,
//! WITH, WHERE) as written: `lokadb concurrently` runs that rest on each partition and in
//! each organization, so only the head needs understanding.

use std::fmt;

/// A `CREATE INDEX` statement, its head read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CreateIndex {
    /// `UNIQUE`.
    pub unique: bool,
    /// `IF NOT EXISTS`.
    pub if_not_exists: bool,
    /// The index's name, as Postgres stores it (unquoted, folded to lower case unless quoted).
    pub name: String,
    /// The table as written (quotes kept), for `to_regclass`.
    pub table: String,
    /// Everything after the table (`USING …`, `(columns)`, `WHERE …`), as written, without a
    /// trailing semicolon.
    pub rest: String,
}

/// Why a statement is not one `lokadb concurrently` runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NotCreateIndex {
    /// It does not begin with `CREATE [UNIQUE] INDEX`.
    NotCreateIndex,
    /// The index has no name: Postgres would choose one per partition and organization.
    Unnamed,
    /// Something else than expected at a place in the head.
    Expected(&'static str, String),
    /// Several statements.
    Several,
}

impl fmt::Display for NotCreateIndex {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NotCreateIndex::NotCreateIndex => {
                f.write_str("only CREATE INDEX [CONCURRENTLY] statements run this way")
            }
            NotCreateIndex::Unnamed => f.write_str(
                "name the index (CREATE INDEX CONCURRENTLY name ON ...): it must have the same name in the cloud and in every organization",
            ),
            NotCreateIndex::Expected(what, found) => {
                write!(f, "expected {what} in CREATE INDEX, found {found:?}")
            }
            NotCreateIndex::Several => f.write_str("give one statement"),
        }
    }
}

/// One word of the head: an identifier (folded unless quoted) or a punctuation character.
#[derive(Debug, PartialEq)]
enum Word {
    Ident { folded: String, quoted: bool },
    Punct(char),
}

struct Lexer<'a> {
    sql: &'a str,
    at: usize,
}

impl<'a> Lexer<'a> {
    fn skip_space(&mut self) {
        loop {
            let rest = &self.sql[self.at..];
            let trimmed = rest.trim_start();
            self.at += rest.len() - trimmed.len();
            if trimmed.starts_with("--") {
                self.at += trimmed.find('\n').unwrap_or(trimmed.len());
            } else if trimmed.starts_with("/*") {
                self.at += trimmed.find("*/").map_or(trimmed.len(), |e| e + 2);
            } else {
                return;
            }
        }
    }

    /// The next word and where it started; `None` at the end.
    fn next(&mut self) -> Option<(usize, Word)> {
        self.skip_space();
        let start = self.at;
        let rest = &self.sql[start..];
        let c = rest.chars().next()?;
        if c == '"' {
            let mut name = String::new();
            let mut chars = rest.char_indices().skip(1).peekable();
            while let Some((i, ch)) = chars.next() {
                if ch == '"' {
                    if chars.peek().map(|p| p.1) == Some('"') {
                        name.push('"');
                        chars.next();
                    } else {
                        self.at = start + i + 1;
                        return Some((
                            start,
                            Word::Ident {
                                folded: name,
                                quoted: true,
                            },
                        ));
                    }
                } else {
                    name.push(ch);
                }
            }
            self.at = self.sql.len();
            return Some((
                start,
                Word::Ident {
                    folded: name,
                    quoted: true,
                },
            ));
        }
        if c.is_alphabetic() || c == '_' {
            let len = rest
                .find(|ch: char| !(ch.is_alphanumeric() || ch == '_' || ch == '$'))
                .unwrap_or(rest.len());
            self.at = start + len;
            return Some((
                start,
                Word::Ident {
                    folded: rest[..len].to_lowercase(),
                    quoted: false,
                },
            ));
        }
        self.at = start + c.len_utf8();
        Some((start, Word::Punct(c)))
    }

    fn peek(&mut self) -> Option<Word> {
        let at = self.at;
        let w = self.next().map(|w| w.1);
        self.at = at;
        w
    }

    /// Takes the next word if it is the keyword `kw`.
    fn keyword(&mut self, kw: &str) -> bool {
        match self.peek() {
            Some(Word::Ident {
                folded,
                quoted: false,
            }) if folded == kw => {
                self.next();
                true
            }
            _ => false,
        }
    }
}

fn describe(w: Option<Word>) -> String {
    match w {
        None => "the end".into(),
        Some(Word::Ident { folded, .. }) => folded,
        Some(Word::Punct(c)) => c.to_string(),
    }
}

/// Reads `sql` as a `CREATE INDEX` statement.
///
/// # Errors
///
/// It is not one, names no index, or holds several statements.
pub fn parse(sql: &str) -> Result<CreateIndex, NotCreateIndex> {
    let sql = sql.trim().trim_end_matches(';').trim_end();
    let mut lx = Lexer { sql, at: 0 };
    if !lx.keyword("create") {
        return Err(NotCreateIndex::NotCreateIndex);
    }
    let unique = lx.keyword("unique");
    if !lx.keyword("index") {
        return Err(NotCreateIndex::NotCreateIndex);
    }
    lx.keyword("concurrently");
    let if_not_exists = lx.keyword("if");
    if if_not_exists && !(lx.keyword("not") && lx.keyword("exists")) {
        return Err(NotCreateIndex::Expected(
            "IF NOT EXISTS",
            describe(lx.peek()),
        ));
    }
    if lx.keyword("on") {
        return Err(NotCreateIndex::Unnamed);
    }
    let name = match lx.next() {
        Some((_, Word::Ident { folded, .. })) => folded,
        other => {
            return Err(NotCreateIndex::Expected(
                "the index's name",
                describe(other.map(|w| w.1)),
            ))
        }
    };
    if !lx.keyword("on") {
        return Err(NotCreateIndex::Expected("ON", describe(lx.peek())));
    }
    lx.keyword("only");
    lx.skip_space();
    let table_start = lx.at;
    match lx.next() {
        Some((_, Word::Ident { .. })) => {}
        other => {
            return Err(NotCreateIndex::Expected(
                "the table",
                describe(other.map(|w| w.1)),
            ))
        }
    }
    if lx.peek() == Some(Word::Punct('.')) {
        lx.next();
        match lx.next() {
            Some((_, Word::Ident { .. })) => {}
            other => {
                return Err(NotCreateIndex::Expected(
                    "the table",
                    describe(other.map(|w| w.1)),
                ))
            }
        }
    }
    let table = sql[table_start..lx.at].to_owned();
    let rest = sql[lx.at..].trim().to_owned();
    if has_semicolon(&rest) {
        return Err(NotCreateIndex::Several);
    }
    Ok(CreateIndex {
        unique,
        if_not_exists,
        name,
        table,
        rest,
    })
}

/// A `;` outside quotes and comments.
fn has_semicolon(s: &str) -> bool {
    let mut lx = Lexer { sql: s, at: 0 };
    while let Some((start, w)) = lx.next() {
        match w {
            Word::Punct(';') => return true,
            Word::Punct('\'') => {
                // A string literal: up to its closing quote ('' inside is a quote).
                let body = &s[start + 1..];
                let mut i = 0;
                let bytes = body.as_bytes();
                loop {
                    match body[i..].find('\'') {
                        None => return false,
                        Some(j) if bytes.get(i + j + 1) == Some(&b'\'') => i += j + 2,
                        Some(j) => {
                            lx.at = start + 1 + i + j + 1;
                            break;
                        }
                    }
                }
            }
            _ => {}
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_head_is_read_and_the_rest_kept() {
        let s = parse(
            "create index concurrently if not exists \"Doc_Idx\" ON ONLY public.documents USING btree (lower(title)) WHERE title <> ';';",
        )
        .unwrap();
        assert_eq!(
            s,
            CreateIndex {
                unique: false,
                if_not_exists: true,
                name: "Doc_Idx".into(),
                table: "public.documents".into(),
                rest: "USING btree (lower(title)) WHERE title <> ';'".into(),
            }
        );
        let s = parse("CREATE UNIQUE INDEX Docs_X ON \"My \"\"T\"(a)").unwrap();
        assert!(s.unique);
        assert!(!s.if_not_exists);
        assert_eq!(s.name, "docs_x");
        assert_eq!(s.table, "\"My \"\"T\"");
        assert_eq!(s.rest, "(a)");
    }

    #[test]
    fn other_statements_are_refused() {
        assert_eq!(
            parse("CREATE INDEX CONCURRENTLY ON documents (a)"),
            Err(NotCreateIndex::Unnamed)
        );
        assert_eq!(parse("DROP INDEX x"), Err(NotCreateIndex::NotCreateIndex));
        assert_eq!(
            parse("CREATE INDEX x ON t (a); DROP TABLE t"),
            Err(NotCreateIndex::Several)
        );
        assert!(parse("CREATE INDEX x ON (a)").is_err());
    }
}
