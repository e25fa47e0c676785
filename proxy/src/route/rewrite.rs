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
//!
//! Key-map rewrite ([`key_lookup`]): a statement on one LokaDB table that names no
//! organization but a key a key map keeps — `SELECT … WHERE id = $1`, an ORM's get by primary
//! key, its UPDATE and DELETE — is sent with the key's organization added:
//!
//! ```sql
//! SELECT … FROM documents WHERE documents.id = $1
//! -- is sent as
//! SELECT … FROM documents WHERE documents.organization_id =
//!   lokadb_client.key_org('km_documents_id', CAST($1 AS bigint))::bigint AND documents.id = $1
//! ```
//!
//! The cloud evaluates the function once, as the statement starts, and prunes every other
//! partition: one organization is touched instead of all of them (for a moved one a round
//! trip to its database each). The rows are the same: every row's key is in the key map with
//! its organization, and no other organization has a row with that key.

use super::analysis::{conjuncts, constant, fold, Catalog, JoinKey};
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
        || !same_columns_through_a_subquery(q, &alias)
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

/// The statement to send instead of `sql` (one statement, `statements`, that the analysis
/// could not place) when it reads, updates or deletes rows of one LokaDB table by a key a key
/// map keeps: a top-level WHERE conjunct `key = constant` (or `IN` one constant). See the
/// module's doc.
pub fn key_lookup(sql: &str, statements: &[Statement], catalog: &Catalog) -> Option<String> {
    if !catalog.has_key_maps() {
        return None;
    }
    let [statement] = statements else {
        return None;
    };
    let (relation, others, selection) = match statement {
        Statement::Query(q) if q.with.is_none() => {
            let SetExpr::Select(s) = q.body.as_ref() else {
                return None;
            };
            let [from] = s.from.as_slice() else {
                return None;
            };
            (
                &from.relation,
                !from.joins.is_empty(),
                s.selection.as_ref()?,
            )
        }
        Statement::Update(u) if u.from.is_none() && u.table.joins.is_empty() => {
            (&u.table.relation, false, u.selection.as_ref()?)
        }
        Statement::Delete(d) if d.using.is_none() => {
            let (sqlparser::ast::FromTable::WithFromKeyword(from)
            | sqlparser::ast::FromTable::WithoutKeyword(from)) = &d.from;
            let [from] = from.as_slice() else {
                return None;
            };
            if !from.joins.is_empty() {
                return None;
            }
            (&from.relation, false, d.selection.as_ref()?)
        }
        _ => return None,
    };
    let TableFactor::Table {
        name,
        alias,
        args: None,
        ..
    } = relation
    else {
        return None;
    };
    let table = catalog.lookup(name)?;
    // `AS d(a, b)` renames the columns: `d.organization_id` may be another one.
    if alias.as_ref().is_some_and(|a| !a.columns.is_empty()) {
        return None;
    }
    // The only LokaDB table anywhere in the statement (joined ones are cloud tables).
    if loka_references(statement, catalog) != 1 {
        return None;
    }
    let qualifier = match alias {
        Some(a) => fold(&a.name.value, a.name.quote_style.is_some()),
        None => bare_name(name)?,
    };
    let org_column = &catalog.tables()[table].org_column;
    let parts = conjuncts(selection);
    // A statement that names an organization column already is not helped.
    let names_org = |e: &Expr| {
        let mut found = false;
        let _ = sqlparser::ast::visit_expressions(e, |x| {
            if column_named(x, &qualifier, others).as_deref() == Some(org_column.as_str()) {
                found = true;
            }
            std::ops::ControlFlow::<()>::Continue(())
        });
        found
    };
    if parts.iter().any(|p| names_org(p)) {
        return None;
    }
    let (map, value) = parts.iter().find_map(|p| {
        let (column, value) = key_equality(p, &qualifier, others)?;
        Some((catalog.key_map(table, &column)?, value))
    })?;
    let qualifier_sql = match alias {
        Some(a) => a.name.to_string(),
        None => name.0.last()?.to_string(),
    };
    let condition = format!(
        "{qualifier_sql}.{} = lokadb_client.key_org('{}', CAST({value} AS {}))::{}",
        quote_ident(org_column),
        map.keymap.replace('\'', "''"),
        map.column_type,
        map.org_type,
    );
    let at = after_where(sql)?;
    let rewritten = format!("{} {condition} AND{}", &sql[..at], &sql[at..]);
    adds_only(statement, &condition, &rewritten).then_some(rewritten)
}

/// How many references to LokaDB tables `statement` holds.
pub(super) fn loka_references(statement: &Statement, catalog: &Catalog) -> usize {
    let mut n = 0;
    let _ = sqlparser::ast::visit_relations(statement, |r| {
        if catalog.lookup(r).is_some() {
            n += 1;
        }
        std::ops::ControlFlow::<()>::Continue(())
    });
    n
}

/// The column `e` names, when it is `qualifier.column`, or a bare column when the statement
/// has no join (then it can only be the table's).
fn column_named(e: &Expr, qualifier: &str, joined: bool) -> Option<String> {
    match e {
        Expr::CompoundIdentifier(p) => column_of(p, qualifier),
        Expr::Identifier(i) if !joined => Some(fold(&i.value, i.quote_style.is_some())),
        _ => None,
    }
}

/// `column = constant` (either way round, casts allowed) or `column IN (constant)`: the
/// column and the constant's text.
fn key_equality(e: &Expr, qualifier: &str, joined: bool) -> Option<(String, String)> {
    let (column, value) = match e {
        Expr::BinaryOp {
            left,
            op: BinaryOperator::Eq,
            right,
            // The column bare: `id::float4 = 16777217` matches more keys than one.
        } => match (
            column_named(left, qualifier, joined),
            column_named(right, qualifier, joined),
        ) {
            (Some(c), None) => (c, right.as_ref()),
            (None, Some(c)) => (c, left.as_ref()),
            _ => return None,
        },
        Expr::In {
            expr,
            target: sqlparser::ast::InTarget::List(list),
            negated: false,
            ..
        } if list.len() == 1 => (column_named(expr, qualifier, joined)?, &list[0]),
        _ => return None,
    };
    constant(value)?;
    // As written, casts included: a parameter's type is the one the statement gives it.
    Some((column, value.to_string()))
}

/// The byte offset just after the statement's one top-level `WHERE` keyword (none in
/// parentheses counted; two, or none, and there is no offset).
pub(super) fn after_where(sql: &str) -> Option<usize> {
    use sqlparser::keywords::Keyword;
    use sqlparser::tokenizer::{Token, Tokenizer};
    let tokens = Tokenizer::new(&PostgreSqlDialect {}, sql)
        .tokenize_with_location()
        .ok()?;
    let mut depth = 0usize;
    let mut found = None;
    for t in &tokens {
        match &t.token {
            Token::LParen | Token::LBracket => depth += 1,
            Token::RParen | Token::RBracket => depth = depth.saturating_sub(1),
            Token::Word(w) if depth == 0 && w.keyword == Keyword::WHERE => {
                if found.is_some() {
                    return None;
                }
                found = Some(byte_at(sql, t.span.end)?);
            }
            _ => {}
        }
    }
    found
}

/// Whether `rewritten` parses as `original` with `condition` as its WHERE's first conjunct
/// and nothing else changed: the text went in where it should.
fn adds_only(original: &Statement, condition: &str, rewritten: &str) -> bool {
    let Ok(parsed) = super::analysis::parse(rewritten) else {
        return false;
    };
    let [new] = parsed.as_slice() else {
        return false;
    };
    let Ok(cond) = Parser::new(&PostgreSqlDialect {})
        .try_with_sql(condition)
        .and_then(|mut p| p.parse_expr())
    else {
        return false;
    };
    let (mut old, mut new) = (original.clone(), new.clone());
    let (Some(old_where), Some(new_where)) = (take_selection(&mut old), take_selection(&mut new))
    else {
        return false;
    };
    let text = |e: &Expr| {
        conjuncts(e)
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
    };
    let mut want = vec![cond.to_string()];
    want.extend(text(&old_where));
    text(&new_where) == want && old.to_string() == new.to_string()
}

/// Takes the WHERE out of a SELECT, UPDATE or DELETE.
fn take_selection(s: &mut Statement) -> Option<Expr> {
    match s {
        Statement::Query(q) => match q.body.as_mut() {
            SetExpr::Select(s) => s.selection.take(),
            _ => None,
        },
        Statement::Update(u) => u.selection.take(),
        Statement::Delete(d) => d.selection.take(),
        _ => None,
    }
}

/// An identifier as SQL needs it written (quoted unless plain lower case).
pub fn quote_ident(name: &str) -> String {
    let plain = name
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_lowercase() || c == '_')
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    if plain {
        name.to_owned()
    } else {
        format!("\"{}\"", name.replace('"', "\"\""))
    }
}

/// Whether every reference to the LokaDB table (`alias`) in `q` means the same through a
/// subquery `SELECT *` of it: no system column (`ctid`, `tableoid`, …), no whole-row
/// reference (its type would become `record`); and no parameter in a join's ON (its type
/// would now come from the subquery's WHERE, analysed before it).
fn same_columns_through_a_subquery(q: &Query, alias: &str) -> bool {
    let mut ok = true;
    let _ = sqlparser::ast::visit_expressions(q, |e| {
        match e {
            Expr::Identifier(i) if fold(&i.value, i.quote_style.is_some()) == alias => ok = false,
            Expr::CompoundIdentifier(p)
                if column_of(p, alias)
                    .is_some_and(|c| super::analysis::SYSTEM_COLUMNS.contains(&c.as_str())) =>
            {
                ok = false;
            }
            _ => {}
        }
        std::ops::ControlFlow::<()>::Continue(())
    });
    if let SetExpr::Select(s) = q.body.as_ref() {
        for j in s.from.iter().flat_map(|f| &f.joins) {
            let _ = sqlparser::ast::visit_expressions(&j.join_operator, |e| {
                if matches!(e, Expr::Value(v) if matches!(v.value, Value::Placeholder(_))) {
                    ok = false;
                }
                std::ops::ControlFlow::<()>::Continue(())
            });
        }
    }
    ok
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
    // A parameter here would get its type from the subquery's WHERE, analysed first now.
    let plain = |e: &Expr| match strip_casts(e) {
        Expr::Identifier(_) | Expr::CompoundIdentifier(_) => true,
        Expr::Value(v) => !matches!(v.value, Value::Placeholder(_)),
        _ => false,
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
pub(super) fn bare_name(name: &ObjectName) -> Option<String> {
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
pub(super) fn span_bytes(sql: &str, f: &TableFactor) -> Option<(usize, usize)> {
    use sqlparser::ast::Spanned;
    let span = f.span();
    Some((byte_at(sql, span.start)?, byte_at(sql, span.end)?))
}

/// The byte offset of a 1-based line and column (in characters) of `sql`.
pub(super) fn byte_at(sql: &str, at: Location) -> Option<usize> {
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
    let Ok(parsed) = super::analysis::parse(rewritten) else {
        return false;
    };
    let [Statement::Query(q)] = parsed.as_slice() else {
        return false;
    };
    let (SetExpr::Select(new), SetExpr::Select(old)) = (q.body.as_ref(), original.body.as_ref())
    else {
        return false;
    };
    let Some(TableFactor::Derived { subquery, .. }) = new.from.first().map(|f| &f.relation) else {
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

/// `ALTER TABLE t ALTER COLUMN c TYPE x USING c::x` on a LokaDB table, as Django and other
/// migration tools write every type change, without its USING (`None`: not such a
/// statement). Postgres refuses a USING on a partitioned table whose partitions include
/// foreign tables (`"…" is not a table`: the moved organizations' partitions); a cast of the
/// column to its own new type is what Postgres does without one where an assignment cast
/// exists (int to bigint, varchar to text). Where only an explicit cast exists, Postgres
/// now says the column cannot be cast automatically; a cast that shortens (varchar(20) to
/// varchar(10)) now fails on a value too long instead of cutting it (docs/migrations.md).
pub fn alter_type_using(sql: &str, catalog: &Catalog) -> Option<String> {
    use sqlparser::ast::{AlterColumnOperation, AlterTableOperation, CastKind};
    let mut statements = Parser::parse_sql(&PostgreSqlDialect {}, sql).ok()?;
    let [Statement::AlterTable(alter)] = statements.as_mut_slice() else {
        return None;
    };
    let names: Vec<String> = alter
        .name
        .0
        .iter()
        .map(|p| match p {
            ObjectNamePart::Identifier(i) => Some(fold(&i.value, i.quote_style.is_some())),
            _ => None,
        })
        .collect::<Option<_>>()?;
    let loka = catalog.tables().iter().any(|t| match names.as_slice() {
        [name] => *name == t.name,
        [schema, name] => *schema == t.schema && *name == t.name,
        _ => false,
    });
    if !loka {
        return None;
    }
    let mut changed = false;
    for op in &mut alter.operations {
        let AlterTableOperation::AlterColumn {
            column_name,
            op:
                AlterColumnOperation::SetDataType {
                    data_type, using, ..
                },
        } = op
        else {
            continue;
        };
        let Some(Expr::Cast {
            kind: CastKind::DoubleColon,
            expr,
            data_type: to,
            format: None,
            ..
        }) = using
        else {
            continue;
        };
        let same_column = matches!(&**expr, Expr::Identifier(i)
            if fold(&i.value, i.quote_style.is_some())
                == fold(&column_name.value, column_name.quote_style.is_some()));
        if same_column && to == data_type {
            *using = None;
            changed = true;
        }
    }
    changed.then(|| alter.to_string())
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
            // A parameter in the select list or an ON, a system column, a whole-row reference.
            "SELECT d.id, $2 FROM documents d LEFT JOIN projects p ON p.id = d.project_id WHERE d.organization_id = $1 ORDER BY d.id LIMIT 5",
            "SELECT d.id FROM documents d LEFT JOIN projects p ON p.id = d.project_id AND p.id > $2 WHERE d.organization_id = $1 ORDER BY d.id LIMIT 5",
            "SELECT d.ctid FROM documents d LEFT JOIN projects p ON p.id = d.project_id WHERE d.organization_id = 1 ORDER BY d.id LIMIT 5",
            "SELECT d FROM documents d LEFT JOIN projects p ON p.id = d.project_id WHERE d.organization_id = 1 ORDER BY d.id LIMIT 5",
            // No join, or the LokaDB table not first, or two FROM items, or FOR UPDATE.
            "SELECT d.id FROM documents d WHERE d.organization_id = 1 ORDER BY d.id LIMIT 5",
            "SELECT d.id FROM projects p RIGHT JOIN documents d ON p.id = d.project_id WHERE d.organization_id = 1 ORDER BY d.id LIMIT 5",
            "SELECT d.id FROM documents d LEFT JOIN projects p ON p.id = d.project_id, users u WHERE d.organization_id = 1 ORDER BY d.id LIMIT 5",
            "SELECT d.id FROM documents d LEFT JOIN projects p ON p.id = d.project_id WHERE d.organization_id = 1 ORDER BY d.id LIMIT 5 FOR UPDATE",
        ] {
            assert_eq!(rewrite(sql), None, "{sql}");
        }
    }

    /// The test catalog with the key map of `documents.id`.
    fn keyed_catalog() -> Catalog {
        catalog().with_key_maps(vec![super::super::analysis::KeyMap {
            table: 0,
            column: "id".into(),
            column_type: "bigint".into(),
            org_type: "bigint".into(),
            keymap: "km_documents_id".into(),
        }])
    }

    fn keyed(sql: &str) -> Option<String> {
        match super::super::analysis::analyze(sql, &keyed_catalog()) {
            super::super::analysis::Analysis::Keyed(r) => Some(r.to_string()),
            _ => None,
        }
    }

    #[test]
    fn a_lookup_by_a_mapped_key_gets_the_keys_organization() {
        let org = |q: &str, v: &str| {
            format!("{q}.organization_id = lokadb_client.key_org('km_documents_id', CAST({v} AS bigint))::bigint AND")
        };
        // Django's get by primary key, its UPDATE and DELETE, select_related's get.
        for (sql, want) in [
            (
                r#"SELECT "documents"."id", "documents"."title" FROM "documents" WHERE "documents"."id" = $1 LIMIT 21"#,
                format!(r#"SELECT "documents"."id", "documents"."title" FROM "documents" WHERE {} "documents"."id" = $1 LIMIT 21"#, org("\"documents\"", "$1")),
            ),
            (
                "UPDATE documents SET title = 'x' WHERE id = 5 RETURNING id",
                format!("UPDATE documents SET title = 'x' WHERE {} id = 5 RETURNING id", org("documents", "5")),
            ),
            (
                r#"DELETE FROM "documents" WHERE "documents"."id" IN ($1)"#,
                format!(r#"DELETE FROM "documents" WHERE {} "documents"."id" IN ($1)"#, org("\"documents\"", "$1")),
            ),
            (
                "SELECT d.id, p.id FROM documents d LEFT JOIN projects p ON p.id = d.project_id\nWHERE (d.title IS NOT NULL) AND d.id = '7'::bigint",
                format!("SELECT d.id, p.id FROM documents d LEFT JOIN projects p ON p.id = d.project_id\nWHERE {} (d.title IS NOT NULL) AND d.id = '7'::bigint", org("d", "'7'::BIGINT")),
            ),
        ] {
            assert_eq!(keyed(sql).as_deref(), Some(want.as_str()), "{sql}");
        }
    }

    /// The rewritten text, analysed again (routing does), is placed by the key: a plain
    /// read of the key's organization, whichever that is; an UPDATE, with its columns.
    #[test]
    fn the_rewritten_text_is_placed_by_its_key() {
        use super::super::analysis::{analyze, Analysis, KeyOrg, Org};
        let catalog = keyed_catalog();
        let key = |k: Org| {
            Org::Key(std::sync::Arc::new(KeyOrg {
                keymap: "km_documents_id".into(),
                key_type: "BIGINT".into(),
                key: k,
            }))
        };
        for (sql, want, read) in [
            (
                "SELECT id, title FROM documents WHERE id = $1",
                key(Org::Param(1)),
                true,
            ),
            (
                "SELECT d.title FROM documents d WHERE d.id = '7'",
                key(Org::Literal("7".into())),
                true,
            ),
            (
                "UPDATE documents SET title = 'x' WHERE id = 5",
                key(Org::Literal("5".into())),
                false,
            ),
            (
                "SELECT id FROM documents WHERE id = -5",
                key(Org::Literal("-5".into())),
                true,
            ),
        ] {
            let rewritten = keyed(sql).expect(sql);
            match analyze(&rewritten, &catalog) {
                Analysis::Org { org, read: r, .. } => {
                    assert_eq!(org, want, "{rewritten}");
                    assert_eq!(r, read, "{rewritten}");
                }
                other => panic!("{rewritten}: {other:?}"),
            }
        }
        // Written by a client with another form, or with the key cast by the client (the
        // cast may change its value): not a key the proxy looks up.
        let by_key = |sql: &str| {
            matches!(
                analyze(sql, &catalog),
                Analysis::Org {
                    org: Org::Key(_),
                    ..
                }
            )
        };
        for other in [
            "SELECT * FROM documents WHERE organization_id = lokadb_client.key_org('km_documents_id', 5)",
            "SELECT * FROM documents WHERE organization_id = lokadb_client.key_org('km_documents_id', CAST('abcdef'::varchar(3) AS text))",
            &keyed("SELECT * FROM documents WHERE id = '7'::bigint").unwrap(),
        ] {
            assert!(!by_key(other), "{other}");
        }
        // A call of the client's own is not a read the organization's database can answer
        // (it has no such function), whatever placed the statement.
        for sql in [
            "SELECT lokadb_client.key_org('km_documents_id', CAST(5 AS bigint)) FROM documents WHERE organization_id = 2",
            &keyed("SELECT lokadb_client.key_org('km_documents_id', CAST(5 AS bigint)) FROM documents WHERE id = 5").unwrap(),
        ] {
            match analyze(sql, &catalog) {
                Analysis::Org { read, .. } => assert!(!read, "{sql}"),
                other => panic!("{sql}: {other:?}"),
            }
        }
    }

    #[test]
    fn statements_a_key_does_not_place_are_sent_as_written() {
        for sql in [
            // The key under OR, not mapped, or compared to a column.
            "SELECT * FROM documents WHERE id = 1 OR id = 2",
            "SELECT * FROM documents WHERE title = 'x'",
            "SELECT * FROM documents WHERE id = project_id",
            // Unqualified with a join: it may be the joined table's column.
            "SELECT * FROM documents d JOIN projects p ON p.id = d.project_id WHERE id = 1",
            // Two LokaDB tables, a WITH, a subquery's WHERE only.
            "SELECT * FROM documents d, document_versions v WHERE d.id = 1 AND v.id = 2",
            "WITH x AS (SELECT 1) SELECT * FROM documents WHERE id = 1",
            "SELECT * FROM documents WHERE id IN (SELECT id FROM documents WHERE id = 1)",
            // Placed by its organization already.
            "SELECT * FROM documents WHERE id = 1 AND organization_id = 2",
            // A cast of the column matches more keys than one; renamed columns.
            "SELECT * FROM documents WHERE id::float4 = 16777217",
            "SELECT * FROM documents AS d(organization_id, id) WHERE d.id = 1",
        ] {
            assert_eq!(keyed(sql), None, "{sql}");
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

    #[test]
    fn a_type_change_loses_a_using_that_only_casts_the_column() {
        let c = catalog();
        assert_eq!(
            alter_type_using(
                r#"ALTER TABLE "documents" ALTER COLUMN "rank" TYPE bigint USING "rank"::bigint"#,
                &c
            )
            .as_deref(),
            Some(r#"ALTER TABLE "documents" ALTER COLUMN "rank" TYPE BIGINT"#)
        );
        assert_eq!(
            alter_type_using(
                "alter table public.documents alter column Rank set data type numeric(10, 2) using rank::numeric(10, 2), alter column title set not null",
                &c
            )
            .as_deref(),
            Some("ALTER TABLE public.documents ALTER COLUMN Rank SET DATA TYPE NUMERIC(10,2), ALTER COLUMN title SET NOT NULL")
        );
        for sql in [
            // Not a LokaDB table, another expression, another type, another column.
            r#"ALTER TABLE tags ALTER COLUMN n TYPE bigint USING n::bigint"#,
            r#"ALTER TABLE documents ALTER COLUMN n TYPE bigint USING (n * 2)::bigint"#,
            r#"ALTER TABLE documents ALTER COLUMN n TYPE bigint USING n::int"#,
            r#"ALTER TABLE documents ALTER COLUMN n TYPE bigint USING m::bigint"#,
            r#"ALTER TABLE documents ALTER COLUMN n TYPE bigint"#,
            r#"ALTER TABLE documents ALTER COLUMN n TYPE bigint USING n::bigint; DROP TABLE tags"#,
            "SELECT 1",
        ] {
            assert_eq!(alter_type_using(sql, &c), None, "{sql}");
        }
    }
}
