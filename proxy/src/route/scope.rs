//! The session's organization (`SET lokadb.org`, `docs/routing.md`): a statement on LokaDB
//! tables is sent limited to it. Every LokaDB table it reads becomes a subquery of that
//! organization's rows, and the target of an UPDATE or DELETE gets the condition first in
//! its WHERE:
//!
//! ```sql
//! SELECT count(*) FROM documents d JOIN users u ON u.id = d.author_id
//! -- is sent as
//! SELECT count(*) FROM (SELECT * FROM documents WHERE organization_id =
//!     CAST(current_setting('lokadb.org') AS bigint)) d JOIN users u ON u.id = d.author_id
//!
//! UPDATE documents SET title = $1 WHERE id = $2
//! -- is sent as
//! UPDATE documents SET title = $1 WHERE documents.organization_id =
//!     CAST(current_setting('lokadb.org') AS bigint) AND (id = $2)
//! ```
//!
//! The organization is the cloud's setting, which the client's `SET lokadb.org` made there:
//! the text does not depend on it, so a prepared statement follows the session to another
//! organization. The cloud evaluates the setting once, at the statement's start, and prunes
//! every other organization's partition. The statement analysis ([`super::analysis`])
//! places the result in [`Org::Session`]; a rewrite it would not place that way is not
//! made, and the statement is refused instead: a statement of a session limited to one
//! organization never reaches another's rows.

use super::analysis::{analyze, Analysis, Catalog, Org, SESSION_ORG};
use super::meta::CoreMeta;
use super::rewrite::{after_where, bare_name, byte_at, quote_ident, span_bytes};
use sqlparser::ast::{CopySource, Statement, TableFactor, Visit, Visitor};
use sqlparser::dialect::PostgreSqlDialect;
use sqlparser::keywords::Keyword;
use sqlparser::tokenizer::{Token, Tokenizer};
use std::ops::ControlFlow;

/// What a session limited to an organization sends for a statement.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Limited {
    /// The statement as written: it touches no LokaDB table, or only the session's
    /// organization's rows already (an INSERT placed by a parameter is checked at Bind).
    AsWritten,
    /// This text instead ([`scope`]).
    Scoped(String),
    /// Refused: the SQLSTATE and the message.
    Refused(&'static str, String),
}

/// What `sql` (whose analysis is `analysis`) becomes in a session whose organization is
/// `org`.
pub fn limit(sql: &str, analysis: &Analysis, meta: &CoreMeta, org: &str) -> Limited {
    match analysis {
        Analysis::NoLokaTable
        | Analysis::Org {
            org: Org::Session, ..
        } => Limited::AsWritten,
        Analysis::Org {
            org: Org::Literal(x),
            ..
        } if x == org => Limited::AsWritten,
        Analysis::Org {
            org: Org::Literal(x),
            ..
        } => Limited::Refused(
            "42501",
            format!("this statement is for organization {x}, and the session's organization (lokadb.org) is {org}"),
        ),
        // The limit would be added to whatever the name means here: maybe not the LokaDB
        // table ([`super::names`]).
        Analysis::Unplaced(why) if *why == super::names::UNSURE => Limited::Refused(
            "0A000",
            format!("the session's organization (lokadb.org) is {org}, and the proxy cannot limit this statement to it: {why}; name the table with its schema"),
        ),
        // Checked through the core's cache: routing analyses the limited text next.
        _ => match rewritten(sql, &meta.meta.catalog).and_then(|out| checked(out, |t| meta.analyze(t))) {
            Ok(text) => Limited::Scoped(text),
            Err(_) if is_param_insert(analysis, sql) => Limited::AsWritten,
            Err(why) => Limited::Refused(
                "0A000",
                format!("the session's organization (lokadb.org) is {org}, and the proxy cannot limit this statement to it: {why}"),
            ),
        },
    }
}

/// An INSERT whose rows' organization is parameter `$n`: its Bind is checked.
fn is_param_insert(analysis: &Analysis, sql: &str) -> bool {
    let first = sql.trim_start().get(..6).unwrap_or_default();
    matches!(
        analysis,
        Analysis::Org {
            org: Org::Param(_),
            ..
        }
    ) && first.eq_ignore_ascii_case("insert")
}

/// What a named statement on LokaDB tables was limited to when the client prepared it; its
/// Binds must still fit the session's organization ([`Mark::allows`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mark {
    /// Prepared with no session organization, naming none: it reaches every organization.
    Unscoped,
    /// Limited to the session's organization, whichever it is when it runs.
    Session,
    /// Placed in this organization by its text.
    Org(String),
    /// Placed in the organization bound to `$n`.
    Param(u16),
}

impl Mark {
    /// The mark of a statement whose analysis (of the client's text) is `analysis`,
    /// `scoped` when it was sent limited to the session's organization.
    pub fn of(analysis: &Analysis, scoped: bool) -> Option<Mark> {
        Some(match analysis {
            _ if scoped => Mark::Session,
            Analysis::NoLokaTable => return None,
            Analysis::Org { org, .. } => match org {
                Org::Literal(x) => Mark::Org(x.clone()),
                Org::Param(n) => Mark::Param(*n),
                Org::Session => Mark::Session,
                // Whichever organization the key's is.
                Org::Key(_) => Mark::Unscoped,
            },
            Analysis::Unplaced(_) | Analysis::Keyed(_) => Mark::Unscoped,
        })
    }

    /// Whether a statement of this mark may run now that the session's organization is
    /// `org` (`bound`: the value of the Bind's parameter `$n`, for [`Mark::Param`]); if not,
    /// why.
    ///
    /// # Errors
    ///
    /// The message for the client.
    pub fn allows(
        &self,
        org: Option<&str>,
        bound: impl FnOnce(u16) -> Option<String>,
    ) -> Result<(), String> {
        match (self, org) {
            (Mark::Unscoped, None) | (Mark::Session, Some(_)) => Ok(()),
            (Mark::Org(_) | Mark::Param(_), None) => Ok(()),
            (Mark::Org(x), Some(o)) if x == o => Ok(()),
            (Mark::Unscoped, Some(o)) => Err(format!(
                "this prepared statement was prepared before lokadb.org was set, and is not limited to the session's organization ({o})"
            )),
            (Mark::Session, None) => Err(
                "this prepared statement was limited to the session's organization, and lokadb.org is no longer set".to_owned(),
            ),
            (Mark::Org(x), Some(o)) => Err(format!(
                "this prepared statement is for organization {x}, and the session's organization (lokadb.org) is {o}"
            )),
            (Mark::Param(n), Some(o)) => match bound(*n) {
                Some(v) if v == o => Ok(()),
                Some(v) => Err(format!(
                    "this statement is for organization {v}, and the session's organization (lokadb.org) is {o}"
                )),
                None => Err(format!("the organization bound to ${n} could not be read")),
            },
        }
    }
}

/// `sql` limited to the session's organization, or why it cannot be. `sql` is one statement
/// that touches LokaDB tables and does not name an organization of its own (the caller
/// checks that with the analysis).
///
/// # Errors
///
/// The statement is not of a form the proxy can limit (an INSERT, two statements, a LokaDB
/// table named where no condition can reach it, …): the reason, for the client's error.
pub fn scope(sql: &str, catalog: &Catalog) -> Result<String, &'static str> {
    checked(rewritten(sql, catalog)?, |t| analyze(t, catalog))
}

/// A limited text, if `analyze` places it in the session's organization.
fn checked(out: String, analyze: impl Fn(&str) -> Analysis) -> Result<String, &'static str> {
    match analyze(&out) {
        Analysis::Org {
            org: Org::Session, ..
        } => Ok(out),
        _ => Err("the proxy could not limit every LokaDB table in it"),
    }
}

/// [`scope`]'s text, not checked yet.
fn rewritten(sql: &str, catalog: &Catalog) -> Result<String, &'static str> {
    let statements = super::analysis::parse(sql)?;
    let [statement] = statements.as_slice() else {
        return Err("a query of several statements");
    };
    // The target of an UPDATE or DELETE: the condition goes into the WHERE.
    let target = match statement {
        Statement::Query(_)
        | Statement::Copy {
            source: CopySource::Query(_),
            to: true,
            ..
        } => None,
        Statement::Update(u) if u.table.joins.is_empty() => Some(&u.table.relation),
        Statement::Delete(d) if d.using.is_none() => {
            let (sqlparser::ast::FromTable::WithFromKeyword(from)
            | sqlparser::ast::FromTable::WithoutKeyword(from)) = &d.from;
            match from.as_slice() {
                [one] if one.joins.is_empty() => Some(&one.relation),
                _ => return Err("a DELETE of several tables"),
            }
        }
        Statement::Insert(_) => {
            return Err("an INSERT whose rows are not all of the session's organization")
        }
        _ => return Err("a statement of a kind the proxy cannot limit to one organization"),
    };
    let target = target
        .filter(|t| matches!(t, TableFactor::Table { name, .. } if catalog.lookup(name).is_some()));
    let mut edits = Edits {
        sql,
        catalog,
        target: target.map(|t| std::ptr::from_ref(t) as usize),
        edits: Vec::new(),
        factors: 0,
        error: None,
    };
    let _ = statement.visit(&mut edits);
    if let Some(why) = edits.error {
        return Err(why);
    }
    // Every LokaDB table the statement names is one of those limited: none hides elsewhere
    // (`TABLE t`, a LOCK, a COPY of the table itself).
    if super::rewrite::loka_references(statement, catalog)
        != edits.factors + usize::from(target.is_some())
    {
        return Err("a LokaDB table named where the proxy cannot limit it");
    }
    let mut edits = edits.edits;
    if let Some(TableFactor::Table { name, alias, .. }) = target {
        let table = catalog.lookup(name).expect("a LokaDB table");
        let qualifier = match alias {
            Some(a) if a.columns.is_empty() => a.name.to_string(),
            Some(_) => return Err("a table alias that renames columns"),
            None => name.0.last().map(ToString::to_string).unwrap_or_default(),
        };
        let condition = format!(
            "{qualifier}.{} = {}",
            quote_ident(&catalog.tables()[table].org_column),
            session_org(catalog, table)?
        );
        let end = where_end(sql).ok_or("the statement's end could not be found")?;
        match after_where(sql) {
            Some(at) => {
                edits.push((at, at, format!(" {condition} AND (")));
                edits.push((end, end, ")".to_owned()));
            }
            None if has_where(statement) => return Err("the WHERE could not be found"),
            None => edits.push((end, end, format!(" WHERE {condition}"))),
        }
    }
    edits.sort_by_key(|e| std::cmp::Reverse((e.0, e.1)));
    let mut out = sql.to_owned();
    for (start, end, text) in edits {
        out.replace_range(start..end, &text);
    }
    Ok(out)
}

/// The session's organization cast to table `table`'s organization column type.
fn session_org(catalog: &Catalog, table: usize) -> Result<String, &'static str> {
    let ty = catalog
        .org_type(table)
        .ok_or("the organization column's type is not known")?;
    Ok(format!("CAST({SESSION_ORG} AS {ty})"))
}

fn has_where(s: &Statement) -> bool {
    match s {
        Statement::Update(u) => u.selection.is_some(),
        Statement::Delete(d) => d.selection.is_some(),
        _ => false,
    }
}

/// Where an UPDATE's or DELETE's WHERE ends (or would end): before a top-level RETURNING,
/// else after the statement's last token (a final `;` and comments left out).
fn where_end(sql: &str) -> Option<usize> {
    let tokens = Tokenizer::new(&PostgreSqlDialect {}, sql)
        .tokenize_with_location()
        .ok()?;
    let mut depth = 0usize;
    let mut end = None;
    for t in &tokens {
        match &t.token {
            Token::LParen | Token::LBracket => depth += 1,
            Token::RParen | Token::RBracket => depth = depth.saturating_sub(1),
            Token::Word(w) if depth == 0 && w.keyword == Keyword::RETURNING => {
                return byte_at(sql, t.span.start).map(|b| {
                    // Before the whitespace ahead of RETURNING.
                    sql[..b].trim_end().len()
                });
            }
            Token::Whitespace(_) | Token::SemiColon | Token::EOF => {}
            _ => end = Some(t.span.end),
        }
    }
    byte_at(sql, end?)
}

/// Collects the replacements of LokaDB table factors by subqueries of the session's
/// organization's rows.
struct Edits<'a> {
    sql: &'a str,
    catalog: &'a Catalog,
    /// The UPDATE or DELETE target's factor (address): limited by its WHERE instead.
    target: Option<usize>,
    /// (start, end, replacement) in bytes of `sql`.
    edits: Vec<(usize, usize, String)>,
    /// LokaDB table factors seen (the target included).
    factors: usize,
    error: Option<&'static str>,
}

impl Visitor for Edits<'_> {
    type Break = ();

    fn pre_visit_table_factor(&mut self, f: &TableFactor) -> ControlFlow<()> {
        let TableFactor::Table {
            name,
            alias,
            args,
            with_hints,
            version,
            with_ordinality,
            partitions,
            json_path,
            sample,
            index_directives,
            inheritance,
        } = f
        else {
            return ControlFlow::Continue(());
        };
        let Some(table) = self.catalog.lookup(name) else {
            return ControlFlow::Continue(());
        };
        if self.target == Some(std::ptr::from_ref(f) as usize) {
            return ControlFlow::Continue(());
        }
        self.factors += 1;
        let plain = args.is_none()
            && with_hints.is_empty()
            && version.is_none()
            && !with_ordinality
            && partitions.is_empty()
            && json_path.is_none()
            && sample.is_none()
            && index_directives.is_empty()
            && inheritance.is_none()
            && alias.as_ref().is_none_or(|a| a.columns.is_empty());
        if !plain {
            self.error =
                Some("a LokaDB table with ONLY, TABLESAMPLE or an alias that renames columns");
            return ControlFlow::Break(());
        }
        match self.replacement(f, name, table) {
            Ok(edit) => {
                self.edits.push(edit);
                ControlFlow::Continue(())
            }
            Err(why) => {
                self.error = Some(why);
                ControlFlow::Break(())
            }
        }
    }
}

impl Edits<'_> {
    /// `name [AS] alias` → `(SELECT * FROM name WHERE org = <session>) [AS] alias`; a
    /// factor without an alias gets the table's name as one, so its columns keep their
    /// qualifier.
    fn replacement(
        &self,
        f: &TableFactor,
        name: &sqlparser::ast::ObjectName,
        table: usize,
    ) -> Result<(usize, usize, String), &'static str> {
        use sqlparser::ast::Spanned;
        const NOT_FOUND: &str = "a LokaDB table's place in the text could not be found";
        let (start, end) = span_bytes(self.sql, f).ok_or(NOT_FOUND)?;
        let name_end = byte_at(self.sql, name.span().end).ok_or(NOT_FOUND)?;
        if !(start < name_end && name_end <= end) {
            return Err(NOT_FOUND);
        }
        let name_sql = &self.sql[start..name_end];
        let alias_sql = match &self.sql[name_end..end] {
            a if a.trim().is_empty() => {
                bare_name(name).ok_or(NOT_FOUND)?;
                format!(" {}", name.0.last().ok_or(NOT_FOUND)?)
            }
            a => a.to_owned(),
        };
        let condition = format!(
            "{} = {}",
            quote_ident(&self.catalog.tables()[table].org_column),
            session_org(self.catalog, table)?
        );
        Ok((
            start,
            end,
            format!("(SELECT * FROM {name_sql} WHERE {condition}){alias_sql}"),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::route::analysis::LokaTable;

    fn catalog() -> Catalog {
        Catalog::new(vec![
            LokaTable {
                schema: "public".into(),
                name: "comments".into(),
                org_column: "organization_id".into(),
            },
            LokaTable {
                schema: "public".into(),
                name: "documents".into(),
                org_column: "organization_id".into(),
            },
        ])
        .with_org_types(vec!["bigint".into(), "bigint".into()])
    }

    const S: &str = "organization_id = CAST(current_setting('lokadb.org') AS bigint)";

    #[test]
    fn reads_see_the_session_organizations_rows_only() {
        let c = catalog();
        assert_eq!(
            scope("SELECT count(*) FROM documents", &c).unwrap(),
            format!("SELECT count(*) FROM (SELECT * FROM documents WHERE {S}) documents")
        );
        assert_eq!(
            scope(
                "SELECT d.title, u.name FROM public.documents AS d JOIN users u ON u.id = d.author_id WHERE d.id = $1",
                &c
            )
            .unwrap(),
            format!("SELECT d.title, u.name FROM (SELECT * FROM public.documents WHERE {S}) AS d JOIN users u ON u.id = d.author_id WHERE d.id = $1")
        );
        // Every reference, at every level.
        let sql = "WITH x AS (SELECT id FROM comments) SELECT * FROM documents WHERE id IN (SELECT document_id FROM comments c) AND id IN (SELECT id FROM x)";
        let out = scope(sql, &c).unwrap();
        assert_eq!(out.matches("current_setting").count(), 3, "{out}");
        // An organization given as a parameter only filters further.
        assert!(scope(
            "SELECT * FROM documents WHERE organization_id = $1 ORDER BY id DESC LIMIT 20",
            &c
        )
        .is_ok());
        assert!(scope("COPY (SELECT * FROM documents) TO STDOUT", &c).is_ok());
    }

    /// A text organization column with a length: the proxy's cast to it is the session's
    /// organization, a client's cast to another length is not.
    #[test]
    fn the_cast_to_the_organization_columns_own_type_is_the_sessions() {
        let c = Catalog::new(vec![LokaTable {
            schema: "public".into(),
            name: "documents".into(),
            org_column: "organization_id".into(),
        }])
        .with_org_types(vec!["character varying(64)".into()]);
        let out = scope("UPDATE documents SET title = 'x' WHERE id = 1", &c).unwrap();
        assert!(out.contains("AS character varying(64))"), "{out}");
        assert!(matches!(
            analyze(&out, &c),
            Analysis::Org {
                org: Org::Session,
                ..
            }
        ));
        assert!(matches!(
            analyze(
                "SELECT * FROM documents WHERE organization_id = CAST(current_setting('lokadb.org') AS varchar(1))",
                &c
            ),
            Analysis::Unplaced(_)
        ));
    }

    #[test]
    fn updates_and_deletes_get_the_condition_first_in_their_where() {
        let c = catalog();
        assert_eq!(
            scope(
                "UPDATE documents SET title = $1 WHERE id = $2 OR id = $3",
                &c
            )
            .unwrap(),
            format!(
                "UPDATE documents SET title = $1 WHERE documents.{S} AND ( id = $2 OR id = $3)"
            )
        );
        assert_eq!(
            scope("DELETE FROM documents d WHERE d.id = 1 RETURNING id;", &c).unwrap(),
            format!("DELETE FROM documents d WHERE d.{S} AND ( d.id = 1) RETURNING id;")
        );
        assert_eq!(
            scope("UPDATE documents SET title = 'x' RETURNING id", &c).unwrap(),
            format!("UPDATE documents SET title = 'x' WHERE documents.{S} RETURNING id")
        );
        assert_eq!(
            scope("delete from documents -- all of them\n", &c).unwrap(),
            format!("delete from documents WHERE documents.{S} -- all of them\n")
        );
        let out = scope(
            "DELETE FROM documents WHERE id IN (SELECT document_id FROM comments WHERE body = '')",
            &c,
        )
        .unwrap();
        assert_eq!(out.matches("current_setting").count(), 2, "{out}");
    }

    #[test]
    fn what_cannot_be_limited_is_refused() {
        let c = catalog();
        for sql in [
            "INSERT INTO documents (id) VALUES (1)",
            "INSERT INTO users SELECT * FROM documents",
            "SELECT 1; SELECT * FROM documents",
            "TABLE documents",
            "SELECT * FROM ONLY documents",
            "SELECT * FROM documents AS d(a, b)",
            "TRUNCATE documents",
            "COPY documents FROM STDIN",
            "UPDATE documents SET organization_id = 2 WHERE id = 1",
            "SELECT * FROM documents WHERE",
        ] {
            assert!(scope(sql, &c).is_err(), "{sql}");
        }
        // No type known: nothing is limited.
        let bare = Catalog::new(c.tables().to_vec());
        assert!(scope("SELECT * FROM documents", &bare).is_err());
    }
}
