//! Which table an unqualified name means in one session, as far as the proxy can tell.
//!
//! The core's analyses ([`super::meta::CoreMeta`]) are shared by every session and resolve
//! an unqualified name to the LokaDB table of that name (the one in `public` when several
//! schemas have one). A session can give the name another meaning: a temporary table of the
//! same name (`pg_temp` comes first in every search path), or a `search_path` that finds
//! another schema's table first. The proxy does not know every relation of the cloud, so
//! where a session may have done either, a statement naming a LokaDB table without its
//! schema is not placed: it goes to the cloud as written, which resolves it itself
//! (issue 22, `docs/routing.md`).
//!
//! What it sees: the `search_path` the cloud reports (PostgreSQL 18+ reports it at login and
//! on every change, whatever set it: `SET`, `set_config`, a function's `SET`, the role's or
//! database's default, startup options); on older clouds, any statement naming
//! `search_path` makes the session's path unknown from then on. A temporary relation is
//! assumed once a statement mentions `temp` with `create` or `into` (`CREATE TEMP TABLE`,
//! `CREATE TABLE pg_temp.…`, `SELECT … INTO TEMP`). Neither is seen inside a function the
//! client calls: a function that creates a temporary table of a LokaDB table's name, or sets
//! `search_path` for the session on an older cloud, is not followed.

use super::analysis::{fold, mentions, parse, Catalog};
use sqlparser::ast::{visit_relations, CopySource, ObjectName, ObjectNamePart, Statement};
use std::ops::ControlFlow;

/// The reason given for a statement [`Names::unsure`] holds back.
pub const UNSURE: &str =
    "a temporary table or the session's search_path may give a LokaDB table's unqualified name another meaning";

/// One session's name resolution, as far as it differs from the core's analyses.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Names {
    /// The session may have a temporary relation named like a LokaDB table.
    temp: bool,
    path: Path,
}

/// The session's `search_path`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
enum Path {
    /// `"$user", public` (or `public`): the analyses' own assumption.
    #[default]
    Default,
    /// The schemas it lists, folded, `$user`, `pg_catalog` and `pg_temp` left out.
    Schemas(Vec<String>),
    /// Changed in a way the proxy did not follow.
    Unknown,
}

impl Names {
    /// Whether the core's analyses hold for this session as they are (the fast path).
    pub fn plain(&self) -> bool {
        !self.temp && self.path == Path::Default
    }

    /// A client's statement text. `reported`: the cloud reports `search_path`, so a change
    /// of it arrives as a ParameterStatus.
    pub fn note_statement(&mut self, sql: &str, reported: bool) {
        if !self.temp
            && mentions(sql, b"temp")
            && (mentions(sql, b"create") || mentions(sql, b"into"))
        {
            self.temp = true;
        }
        if !reported && mentions(sql, b"search_path") {
            self.path = Path::Unknown;
        }
    }

    /// The startup parameters' `options` (`-c search_path=…`), on a cloud that does not
    /// report `search_path`.
    pub fn note_options(&mut self, options: &str) {
        if mentions(options, b"search_path") {
            self.path = Path::Unknown;
        }
    }

    /// The `search_path` the cloud reported.
    pub fn note_path(&mut self, value: &str) {
        self.path = match schemas(value) {
            Some(s) if s == ["public"] => Path::Default,
            Some(s) => Path::Schemas(s),
            None => Path::Unknown,
        };
    }

    /// Whether `sql`, one or more statements, names a LokaDB table without its schema where
    /// this session may resolve that name to another relation than the core's analyses did.
    pub fn unsure(&self, sql: &str, catalog: &Catalog) -> bool {
        if self.plain() {
            return false;
        }
        let Ok(statements) = parse(sql) else {
            // Not parsed: the analysis did not place it either.
            return false;
        };
        let first = match &self.path {
            Path::Default => Some("public"),
            Path::Schemas(s) => s.first().map(String::as_str),
            Path::Unknown => None,
        };
        let check = |name: &ObjectName| {
            let [ObjectNamePart::Identifier(i)] = name.0.as_slice() else {
                return ControlFlow::Continue(());
            };
            let table = fold(&i.value, i.quote_style.is_some());
            let Some(resolved) = catalog.unqualified(&table) else {
                return ControlFlow::Continue(());
            };
            // The first schema of the path holds the LokaDB table the analyses took: no
            // relation of another schema can come before it (a temporary one could).
            let found = first.is_some_and(|s| catalog.tables()[resolved].schema == s);
            if self.temp || !found {
                ControlFlow::Break(())
            } else {
                ControlFlow::Continue(())
            }
        };
        statements.iter().any(|s| {
            // COPY's table is no relation of the visitor's.
            let copied = match s {
                Statement::Copy {
                    source: CopySource::Table { table_name, .. },
                    ..
                } => check(table_name).is_break(),
                _ => false,
            };
            copied || visit_relations(s, check).is_break()
        })
    }
}

/// The schemas of a `search_path` value, folded, without `$user`, `pg_catalog` and
/// `pg_temp` (neither holds a LokaDB table; a `$user` schema is assumed to hold none of
/// their names, as the analyses assume). `None` when the value does not read as a list.
fn schemas(value: &str) -> Option<Vec<String>> {
    let mut out = Vec::new();
    for part in split_list(value)? {
        let (name, quoted) = match part.strip_prefix('"') {
            Some(rest) => (rest.strip_suffix('"')?.replace("\"\"", "\""), true),
            None => (part.to_owned(), false),
        };
        let name = fold(&name, quoted);
        if name.is_empty() || name == "$user" || name == "pg_catalog" || name.starts_with("pg_temp")
        {
            continue;
        }
        out.push(name);
    }
    Some(out)
}

/// The comma-separated items of a list, trimmed; a comma inside double quotes is part of
/// its item.
fn split_list(value: &str) -> Option<Vec<&str>> {
    let mut items = Vec::new();
    let (mut start, mut quoted) = (0, false);
    for (i, c) in value.char_indices() {
        match c {
            '"' => quoted = !quoted,
            ',' if !quoted => {
                items.push(value[start..i].trim());
                start = i + 1;
            }
            _ => {}
        }
    }
    if quoted {
        return None;
    }
    items.push(value[start..].trim());
    Some(items.into_iter().filter(|s| !s.is_empty()).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::route::analysis::LokaTable;

    fn catalog() -> Catalog {
        let t = |schema: &str, name: &str| LokaTable {
            schema: schema.into(),
            name: name.into(),
            org_column: "organization_id".into(),
        };
        Catalog::new(vec![
            t("public", "notes"),
            t("s", "notes"),
            t("app", "tasks"),
        ])
    }

    #[test]
    fn a_plain_session_trusts_the_analyses() {
        let n = Names::default();
        assert!(n.plain());
        assert!(!n.unsure("SELECT * FROM notes", &catalog()));
    }

    #[test]
    fn a_temporary_table_makes_every_unqualified_lokadb_name_unsure() {
        let mut n = Names::default();
        n.note_statement("SELECT 1", false);
        assert!(n.plain());
        n.note_statement("CREATE TEMP TABLE notes (id int)", true);
        assert!(!n.plain());
        let c = catalog();
        assert!(n.unsure("SELECT count(*) FROM notes WHERE organization_id = 1", &c));
        assert!(n.unsure("UPDATE notes SET x = 1 WHERE organization_id = 1", &c));
        assert!(!n.unsure("SELECT * FROM public.notes WHERE organization_id = 1", &c));
        assert!(!n.unsure("SELECT * FROM other", &c));
        assert!(n.unsure("COPY notes TO STDOUT", &c));
        assert!(!n.unsure("COPY public.notes TO STDOUT", &c));
        let mut n = Names::default();
        n.note_statement("select 1 into temporary tasks", true);
        assert!(n.unsure("select * from tasks", &c));
        let mut n = Names::default();
        n.note_statement("CREATE TABLE pg_temp.notes ()", true);
        assert!(!n.plain());
    }

    #[test]
    fn a_search_path_is_followed_as_the_cloud_reports_it() {
        let c = catalog();
        let mut n = Names::default();
        n.note_path("\"$user\", public");
        assert!(n.plain());
        n.note_path("s, public");
        assert!(!n.plain());
        // `notes` is s.notes there, not public.notes, which the analyses took.
        assert!(n.unsure("SELECT * FROM notes", &c));
        assert!(!n.unsure("SELECT * FROM public.notes", &c));
        // `tasks` is app.tasks only if app comes first.
        assert!(n.unsure("SELECT * FROM tasks", &c));
        n.note_path("app, \"$user\"");
        assert!(!n.unsure("SELECT * FROM tasks", &c));
        assert!(n.unsure("SELECT * FROM notes", &c));
        n.note_path("public, s");
        assert!(!n.unsure("SELECT * FROM notes", &c));
        n.note_path("\"Odd,Name\", public");
        assert!(n.unsure("SELECT * FROM notes", &c));
        n.note_path("\"unclosed");
        assert!(n.unsure("SELECT * FROM public.notes JOIN notes USING (id)", &c));
    }

    #[test]
    fn an_unreported_search_path_is_unknown_once_named() {
        let c = catalog();
        let mut n = Names::default();
        n.note_statement("SET search_path = public", true);
        assert!(n.plain(), "reported: the ParameterStatus says");
        n.note_statement("SELECT set_config('search_path', 's', false)", false);
        assert!(n.unsure("SELECT * FROM notes", &c));
        let mut n = Names::default();
        n.note_options("-c search_path=s");
        assert!(n.unsure("SELECT * FROM notes", &c));
    }

    #[test]
    fn search_path_lists() {
        assert_eq!(
            schemas("\"$user\", public"),
            Some(vec!["public".to_owned()])
        );
        assert_eq!(
            schemas("A, \"B\", pg_catalog, pg_temp_3"),
            Some(vec!["a".to_owned(), "B".to_owned()])
        );
        assert_eq!(schemas("\"a,b\""), Some(vec!["a,b".to_owned()]));
        assert_eq!(schemas("\"a"), None);
        assert_eq!(schemas(""), Some(vec![]));
    }
}
