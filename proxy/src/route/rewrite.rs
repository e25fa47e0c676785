//! Join rewrite (issue 6, `docs/routing.md`, "Joins with cloud tables"): a SELECT that joins
//! one organization's LokaDB table with cloud tables and is ordered and limited by the
//! LokaDB table's columns — an ORM feed, `select_related(...).order_by("-id")[:20]` — is sent
//! with the LokaDB table replaced by a subquery holding the statement's WHERE, ORDER BY and
//! LIMIT:
//!
//! ```sql
//! SELECT … FROM documents d JOIN organizations o ON d.organization_id = o.id
//! WHERE d.organization_id = $1 ORDER BY d.id DESC LIMIT 20
//! -- is sent as
//! SELECT … FROM (SELECT * FROM documents d WHERE d.organization_id = $1
//!                ORDER BY d.id DESC LIMIT 20) d JOIN organizations o ON d.organization_id = o.id
//! WHERE d.organization_id = $1 ORDER BY d.id DESC LIMIT 20
//! ```
//!
//! The cloud plans the subquery on its own: only the organization's partition is touched,
//! and for a moved organization the ORDER BY runs in its database (postgres_fdw sends it)
//! and at most one batch of rows comes back, whatever plan the join would have had alone (a
//! hash join fetching every row of the organization through its tunnel, then sorting).
//!
//! The rows are the same only when each row of the LokaDB table that passes the WHERE
//! yields at least one row of the join, keeping its ORDER BY key; so the rewrite is made
//! only when (anything else is sent as written):
//! - one SELECT, no WITH, DISTINCT, GROUP BY, HAVING, window, locking clause, FETCH; its
//!   select list plain columns and constants (no aggregate, no function);
//! - the LokaDB table first in FROM, the only item there, every other table joined by
//!   `LEFT [OUTER] JOIN` (the LokaDB table's rows are all kept), or by an inner join whose
//!   ON is exactly a foreign key of the LokaDB table to that cloud table ([`JoinKey`]:
//!   every column NOT NULL, not deferrable, kept for every organization — exactly one row
//!   matches);
//! - WHERE, ORDER BY only on the LokaDB table's columns (written `alias.column`), WHERE with
//!   the organization condition and simple operators only (no function, no subquery);
//! - LIMIT a number or a parameter; OFFSET, if any, a number with a numeric LIMIT.

use super::analysis::{conjuncts, fold, Catalog, JoinKey};
use sqlparser::ast::{
    BinaryOperator, Expr, Join, JoinOperator, LimitClause, ObjectName, ObjectNamePart, OrderByKind,
    Query, Select, SelectItem, SetExpr, Statement, TableFactor, UnaryOperator, Value,
};
use sqlparser::dialect::PostgreSqlDialect;
use sqlparser::parser::Parser;
use sqlparser::tokenizer::Location;

/// The statement to send instead of `sql` (whose parse is `statements`, placed by the
/// analysis in one organization), when the join rewrite applies.
pub fn limit_pushdown(sql: &str, statements: &[Statement], catalog: &Catalog) -> Option<String> {
    let [Statement::Query(q)] = statements else {
        return None;
    };
    let (select, limit) = shape(q)?;
    let [from] = select.from.as_slice() else {
        return None;
    };
    let TableFactor::Table {
        name,
        alias: table_alias,
        args: None,
        ..
    } = &from.relation
    else {
        return None;
    };
    let table = catalog.lookup(name)?;
    if table_alias.as_ref().is_some_and(|a| !a.columns.is_empty()) {
        return None;
    }
    let alias = match table_alias {
        Some(a) => fold(&a.name.value, a.name.quote_style.is_some()),
        None => bare_name(name)?,
    };
    let alias_sql = match table_alias {
        Some(a) => a.name.to_string(),
        None => name.0.last()?.to_string(),
    };
    if from.joins.is_empty()
        || !from
            .joins
            .iter()
            .all(|j| keeps_every_row(j, &alias, table, catalog))
    {
        return None;
    }
    let org_column = &catalog.tables()[table].org_column;
    let selection = select.selection.as_ref()?;
    let names_org = conjuncts(selection)
        .iter()
        .any(|c| is_org_condition(c, &alias, org_column));
    if !names_org || !only_columns_of(selection, &alias) {
        return None;
    }
    let OrderByKind::Expressions(order) = &q.order_by.as_ref()?.kind else {
        return None;
    };
    if order.is_empty()
        || !order.iter().all(|o| {
            o.with_fill.is_none()
                && matches!(&o.expr, Expr::CompoundIdentifier(p) if column_of(p, &alias).is_some())
        })
    {
        return None;
    }
    let order_sql: Vec<String> = order.iter().map(ToString::to_string).collect();
    let (start, end) = span_bytes(sql, &from.relation)?;
    let inner = format!(
        "(SELECT * FROM {} WHERE {selection} ORDER BY {} LIMIT {limit}) {alias_sql}",
        &sql[start..end],
        order_sql.join(", "),
    );
    let rewritten = format!("{}{inner}{}", &sql[..start], &sql[end..]);
    same_but_the_table(q, &rewritten).then_some(rewritten)
}

/// The SELECT of a query of the rewritable shape, and the inner LIMIT's text.
fn shape(q: &Query) -> Option<(&Select, String)> {
    if q.with.is_some()
        || !q.locks.is_empty()
        || q.fetch.is_some()
        || q.for_clause.is_some()
        || q.settings.is_some()
        || q.format_clause.is_some()
        || !q.pipe_operators.is_empty()
    {
        return None;
    }
    let SetExpr::Select(s) = q.body.as_ref() else {
        return None;
    };
    let plain = s.distinct.is_none()
        && s.top.is_none()
        && s.select_modifiers.is_none()
        && s.exclude.is_none()
        && s.into.is_none()
        && s.lateral_views.is_empty()
        && s.prewhere.is_none()
        && s.connect_by.is_empty()
        && matches!(&s.group_by, sqlparser::ast::GroupByExpr::Expressions(g, m) if g.is_empty() && m.is_empty())
        && s.cluster_by.is_empty()
        && s.distribute_by.is_empty()
        && s.sort_by.is_empty()
        && s.having.is_none()
        && s.named_window.is_empty()
        && s.qualify.is_none()
        && s.value_table_mode.is_none();
    if !plain || !s.projection.iter().all(plain_item) {
        return None;
    }
    let LimitClause::LimitOffset {
        limit: Some(limit),
        offset,
        limit_by,
    } = q.limit_clause.as_ref()?
    else {
        return None;
    };
    if !limit_by.is_empty() {
        return None;
    }
    let limit_sql = match (limit, offset) {
        (Expr::Value(v), None) if matches!(v.value, Value::Number(..) | Value::Placeholder(_)) => {
            v.to_string()
        }
        // The subquery keeps the rows the OFFSET skips too.
        (Expr::Value(l), Some(o)) => match (&l.value, &o.value) {
            (Value::Number(l, _), Expr::Value(o)) => match &o.value {
                Value::Number(o, _) => {
                    let (l, o): (u64, u64) = (l.parse().ok()?, o.parse().ok()?);
                    l.checked_add(o)?.to_string()
                }
                _ => return None,
            },
            _ => return None,
        },
        _ => return None,
    };
    Some((s, limit_sql))
}

/// A select-list item that is evaluated per row of the join: columns, wildcards, constants.
fn plain_item(item: &SelectItem) -> bool {
    let plain = |e: &Expr| {
        matches!(
            strip_casts(e),
            Expr::Identifier(_) | Expr::CompoundIdentifier(_) | Expr::Value(_)
        )
    };
    match item {
        SelectItem::UnnamedExpr(e) | SelectItem::ExprWithAlias { expr: e, .. } => plain(e),
        SelectItem::Wildcard(o) | SelectItem::QualifiedWildcard(_, o) => {
            o.opt_exclude.is_none()
                && o.opt_except.is_none()
                && o.opt_replace.is_none()
                && o.opt_rename.is_none()
        }
        _ => false,
    }
}

fn strip_casts(e: &Expr) -> &Expr {
    match e {
        Expr::Nested(inner) | Expr::Cast { expr: inner, .. } => strip_casts(inner),
        _ => e,
    }
}

/// Whether joining `j` keeps every row of the LokaDB table (`alias`, catalog index
/// `table`) at least once: a LEFT join, or an inner join on one of its [`JoinKey`]s.
fn keeps_every_row(j: &Join, alias: &str, table: usize, catalog: &Catalog) -> bool {
    use sqlparser::ast::JoinConstraint;
    let on = match &j.join_operator {
        JoinOperator::Left(_) | JoinOperator::LeftOuter(_) => return true,
        JoinOperator::Join(JoinConstraint::On(e)) | JoinOperator::Inner(JoinConstraint::On(e)) => e,
        _ => return false,
    };
    let TableFactor::Table {
        name,
        alias: joined_alias,
        args: None,
        ..
    } = &j.relation
    else {
        return false;
    };
    let joined = match joined_alias {
        Some(a) if a.columns.is_empty() => fold(&a.name.value, a.name.quote_style.is_some()),
        Some(_) => return false,
        None => match bare_name(name) {
            Some(n) => n,
            None => return false,
        },
    };
    // The ON's equalities, as (LokaDB table's column, joined table's column).
    let mut pairs = Vec::new();
    for c in conjuncts(on) {
        let Expr::BinaryOp {
            left,
            op: BinaryOperator::Eq,
            right,
        } = c
        else {
            return false;
        };
        let (Expr::CompoundIdentifier(l), Expr::CompoundIdentifier(r)) =
            (left.as_ref(), right.as_ref())
        else {
            return false;
        };
        match (
            column_of(l, alias),
            column_of(r, &joined),
            column_of(r, alias),
            column_of(l, &joined),
        ) {
            (Some(t), Some(o), _, _) | (_, _, Some(t), Some(o)) if alias != joined => {
                pairs.push((t, o));
            }
            _ => return false,
        }
    }
    pairs.sort();
    catalog.join_keys(table).any(|k| {
        names_target(name, k) && {
            let mut want: Vec<(String, String)> = k
                .columns
                .iter()
                .cloned()
                .zip(k.target_columns.iter().cloned())
                .collect();
            want.sort();
            want == pairs
        }
    })
}

/// Whether `name` (as written in the statement) is the key's target table.
fn names_target(name: &ObjectName, k: &JoinKey) -> bool {
    let parts: Option<Vec<String>> = name
        .0
        .iter()
        .map(|p| match p {
            ObjectNamePart::Identifier(i) => Some(fold(&i.value, i.quote_style.is_some())),
            ObjectNamePart::Function(_) => None,
        })
        .collect();
    match parts.as_deref() {
        Some([t]) => *t == k.target,
        Some([s, t]) => *s == k.target_schema && *t == k.target,
        _ => false,
    }
}

/// The table's own name, as Postgres folds it (what an unaliased reference goes by).
fn bare_name(name: &ObjectName) -> Option<String> {
    match name.0.last()? {
        ObjectNamePart::Identifier(i) => Some(fold(&i.value, i.quote_style.is_some())),
        ObjectNamePart::Function(_) => None,
    }
}

/// The column of `alias.column`, when `parts` is written so.
fn column_of(parts: &[sqlparser::ast::Ident], alias: &str) -> Option<String> {
    match parts {
        [q, c] if fold(&q.value, q.quote_style.is_some()) == alias => {
            Some(fold(&c.value, c.quote_style.is_some()))
        }
        _ => None,
    }
}

/// `alias.org_column = constant` (or the other way round).
fn is_org_condition(e: &Expr, alias: &str, org_column: &str) -> bool {
    let Expr::BinaryOp {
        left,
        op: BinaryOperator::Eq,
        right,
    } = e
    else {
        return false;
    };
    let is_org = |e: &Expr| matches!(strip_casts(e), Expr::CompoundIdentifier(p) if column_of(p, alias).as_deref() == Some(org_column));
    let is_constant = |e: &Expr| matches!(strip_casts(e), Expr::Value(_));
    (is_org(left) && is_constant(right)) || (is_constant(left) && is_org(right))
}

/// Whether `e` reads only `alias`'s columns, constants and parameters, through operators
/// whose text the parser writes back as given (no function, no subquery).
fn only_columns_of(e: &Expr, alias: &str) -> bool {
    let only = |e: &Expr| only_columns_of(e, alias);
    match e {
        Expr::CompoundIdentifier(p) => column_of(p, alias).is_some(),
        Expr::Value(v) => matches!(
            v.value,
            Value::Number(..)
                | Value::SingleQuotedString(_)
                | Value::Boolean(_)
                | Value::Null
                | Value::Placeholder(_)
        ),
        Expr::Nested(x) | Expr::Cast { expr: x, .. } => only(x),
        Expr::UnaryOp { op, expr } => {
            matches!(op, UnaryOperator::Not | UnaryOperator::Minus) && only(expr)
        }
        Expr::BinaryOp { left, op, right } => {
            use BinaryOperator as B;
            matches!(
                op,
                B::Eq | B::NotEq | B::Lt | B::LtEq | B::Gt | B::GtEq | B::And | B::Or
            ) && only(left)
                && only(right)
        }
        Expr::IsNull(x)
        | Expr::IsNotNull(x)
        | Expr::IsTrue(x)
        | Expr::IsFalse(x)
        | Expr::IsNotTrue(x)
        | Expr::IsNotFalse(x) => only(x),
        Expr::In {
            expr,
            target: sqlparser::ast::InTarget::List(list),
            ..
        } => only(expr) && list.iter().all(only),
        Expr::Between {
            expr, low, high, ..
        } => only(expr) && only(low) && only(high),
        Expr::Like {
            expr,
            pattern,
            escape_char: None,
            any: false,
            ..
        }
        | Expr::ILike {
            expr,
            pattern,
            escape_char: None,
            any: false,
            ..
        } => only(expr) && only(pattern),
        _ => false,
    }
}

/// The byte range of `f` in `sql`, from the parser's line and column positions.
fn span_bytes(sql: &str, f: &TableFactor) -> Option<(usize, usize)> {
    use sqlparser::ast::Spanned;
    let span = f.span();
    Some((byte_at(sql, span.start)?, byte_at(sql, span.end)?))
}

/// The byte offset of a 1-based line and column (in characters) of `sql`.
fn byte_at(sql: &str, at: Location) -> Option<usize> {
    if at.line == 0 || at.column == 0 {
        return None;
    }
    let mut line = 1;
    let mut column = 1;
    for (i, c) in sql.char_indices() {
        if line == at.line && column == at.column {
            return Some(i);
        }
        if c == '\n' {
            line += 1;
            column = 1;
        } else {
            column += 1;
        }
    }
    (line == at.line && column == at.column).then_some(sql.len())
}

/// Whether `rewritten` parses as `original` with only its first table replaced by a
/// subquery of that table: the splice by position hit exactly the table's text.
fn same_but_the_table(original: &Query, rewritten: &str) -> bool {
    let Ok(parsed) = Parser::parse_sql(&PostgreSqlDialect {}, rewritten) else {
        return false;
    };
    let [Statement::Query(q)] = parsed.as_slice() else {
        return false;
    };
    let (SetExpr::Select(new), SetExpr::Select(old)) = (q.body.as_ref(), original.body.as_ref())
    else {
        return false;
    };
    let TableFactor::Derived { subquery, .. } = &new.from[0].relation else {
        return false;
    };
    let SetExpr::Select(inner) = subquery.body.as_ref() else {
        return false;
    };
    let text = |items: &[SelectItem]| items.iter().map(ToString::to_string).collect::<Vec<_>>();
    let joins = |s: &Select| {
        s.from[0]
            .joins
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
    };
    inner.from.len() == 1
        && inner.from[0].joins.is_empty()
        && inner.from[0].relation.to_string() == old.from[0].relation.to_string()
        && inner.selection == old.selection
        && new.from.len() == 1
        && joins(new) == joins(old)
        && text(&new.projection) == text(&old.projection)
        && new.selection == old.selection
        && q.order_by == original.order_by
        && q.limit_clause == original.limit_clause
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::route::analysis::LokaTable;

    fn catalog() -> Catalog {
        let table = |name: &str| LokaTable {
            schema: "public".into(),
            name: name.into(),
            org_column: "organization_id".into(),
        };
        Catalog::new(vec![table("documents"), table("document_versions")]).with_join_keys(vec![
            JoinKey {
                table: 0,
                columns: vec!["organization_id".into()],
                target_schema: "public".into(),
                target: "organizations".into(),
                target_columns: vec!["id".into()],
            },
        ])
    }

    fn rewrite(sql: &str) -> Option<String> {
        let statements = Parser::parse_sql(&PostgreSqlDialect {}, sql).unwrap();
        limit_pushdown(sql, &statements, &catalog())
    }

    #[test]
    fn an_orm_feed_gets_its_limit_next_to_the_loka_table() {
        // Django's select_related feed, a nullable foreign key (LEFT OUTER JOIN).
        let sql = r#"SELECT "documents"."id", "documents"."title", "projects"."id" FROM "documents" LEFT OUTER JOIN "projects" ON ("documents"."project_id" = "projects"."id") WHERE "documents"."organization_id" = $1 ORDER BY "documents"."id" DESC LIMIT 20"#;
        assert_eq!(
            rewrite(sql).as_deref(),
            Some(
                r#"SELECT "documents"."id", "documents"."title", "projects"."id" FROM (SELECT * FROM "documents" WHERE "documents"."organization_id" = $1 ORDER BY "documents"."id" DESC LIMIT 20) "documents" LEFT OUTER JOIN "projects" ON ("documents"."project_id" = "projects"."id") WHERE "documents"."organization_id" = $1 ORDER BY "documents"."id" DESC LIMIT 20"#
            )
        );
        // An inner join on the table's NOT NULL foreign key; aliases, a literal, OFFSET,
        // line breaks and a multi-byte character before the table.
        let sql = "SELECT d.*, o.id AS org, 'é' FROM\n  public.documents AS d\n  JOIN organizations o ON o.id = d.organization_id\nWHERE d.organization_id = 7 AND d.title IS NOT NULL ORDER BY d.id LIMIT 10 OFFSET 5";
        assert_eq!(
            rewrite(sql).as_deref(),
            Some("SELECT d.*, o.id AS org, 'é' FROM\n  (SELECT * FROM public.documents AS d WHERE d.organization_id = 7 AND d.title IS NOT NULL ORDER BY d.id LIMIT 15) d\n  JOIN organizations o ON o.id = d.organization_id\nWHERE d.organization_id = 7 AND d.title IS NOT NULL ORDER BY d.id LIMIT 10 OFFSET 5")
        );
    }

    #[test]
    fn joins_that_may_drop_or_multiply_rows_before_the_limit_are_sent_as_written() {
        for sql in [
            // An inner join on a column that is not a kept foreign key.
            "SELECT d.id FROM documents d JOIN projects p ON p.id = d.project_id WHERE d.organization_id = 1 ORDER BY d.id LIMIT 5",
            // The key with an extra condition.
            "SELECT d.id FROM documents d JOIN organizations o ON o.id = d.organization_id AND o.id > 3 WHERE d.organization_id = 1 ORDER BY d.id LIMIT 5",
            // The key to another table of the same name elsewhere.
            "SELECT d.id FROM documents d JOIN other.organizations o ON o.id = d.organization_id WHERE d.organization_id = 1 ORDER BY d.id LIMIT 5",
            // A condition on the joined table.
            "SELECT d.id FROM documents d LEFT JOIN projects p ON p.id = d.project_id WHERE d.organization_id = 1 AND p.id > 2 ORDER BY d.id LIMIT 5",
            // Ordered by the joined table.
            "SELECT d.id FROM documents d LEFT JOIN projects p ON p.id = d.project_id WHERE d.organization_id = 1 ORDER BY p.id LIMIT 5",
            // An unqualified column may be the joined table's.
            "SELECT d.id FROM documents d LEFT JOIN projects p ON p.id = d.project_id WHERE d.organization_id = 1 AND title = 'x' ORDER BY d.id LIMIT 5",
            // Aggregates, DISTINCT, GROUP BY, a function in WHERE, no LIMIT, a parameter OFFSET.
            "SELECT count(*) FROM documents d LEFT JOIN projects p ON p.id = d.project_id WHERE d.organization_id = 1 ORDER BY d.id LIMIT 5",
            "SELECT DISTINCT d.id FROM documents d LEFT JOIN projects p ON p.id = d.project_id WHERE d.organization_id = 1 ORDER BY d.id LIMIT 5",
            "SELECT d.id FROM documents d LEFT JOIN projects p ON p.id = d.project_id WHERE d.organization_id = 1 GROUP BY d.id ORDER BY d.id LIMIT 5",
            "SELECT d.id FROM documents d LEFT JOIN projects p ON p.id = d.project_id WHERE d.organization_id = 1 AND random() < 0.5 ORDER BY d.id LIMIT 5",
            "SELECT d.id FROM documents d LEFT JOIN projects p ON p.id = d.project_id WHERE d.organization_id = 1 ORDER BY d.id",
            "SELECT d.id FROM documents d LEFT JOIN projects p ON p.id = d.project_id WHERE d.organization_id = 1 ORDER BY d.id LIMIT $1 OFFSET $2",
            // The organization only in an inner join's ON, not in WHERE.
            "SELECT d.id FROM documents d JOIN organizations o ON o.id = d.organization_id WHERE d.id > 1 ORDER BY d.id LIMIT 5",
            // No join, or the LokaDB table not first, or two FROM items, or FOR UPDATE.
            "SELECT d.id FROM documents d WHERE d.organization_id = 1 ORDER BY d.id LIMIT 5",
            "SELECT d.id FROM projects p RIGHT JOIN documents d ON p.id = d.project_id WHERE d.organization_id = 1 ORDER BY d.id LIMIT 5",
            "SELECT d.id FROM documents d LEFT JOIN projects p ON p.id = d.project_id, users u WHERE d.organization_id = 1 ORDER BY d.id LIMIT 5",
            "SELECT d.id FROM documents d LEFT JOIN projects p ON p.id = d.project_id WHERE d.organization_id = 1 ORDER BY d.id LIMIT 5 FOR UPDATE",
        ] {
            assert_eq!(rewrite(sql), None, "{sql}");
        }
    }

    #[test]
    fn positions_map_to_bytes() {
        let sql = "ab\ncé f";
        let at = |line, column| byte_at(sql, Location { line, column });
        assert_eq!(at(1, 1), Some(0));
        assert_eq!(at(2, 1), Some(3));
        assert_eq!(at(2, 3), Some(6));
        assert_eq!(at(2, 5), Some(sql.len()));
        assert_eq!(at(2, 6), None);
        assert_eq!(at(3, 1), None);
        assert_eq!(at(0, 0), None);
    }
}
