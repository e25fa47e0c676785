//! Statement analysis: which LokaDB tables a statement touches and which organization it
//! concerns, so the proxy can route it (issue 6). Pure: SQL text and the LokaDB tables in,
//! an [`Analysis`] out.
//!
//! The rule is conservative: a statement is placed in an organization only when *every*
//! reference to a LokaDB table in it is limited to that one organization, by a condition
//! the statement cannot escape:
//! - `org_column = literal` or `= $n` (casts that keep the value's text allowed, `IN` with
//!   one value), in a WHERE, ON or HAVING conjunct of the reference's own query level (never
//!   under OR or NOT);
//! - an equality with another placed reference's organization column (`a.org = b.org`);
//! - for INSERT … VALUES, the organization column's value in every row.
//!
//! Anything else (no condition, two organizations, `SET org_column = …`, INSERT … SELECT,
//! a parse error, a statement over the parse bounds [`parse`] sets) is not placed, and goes
//! to the cloud, which is always correct. More cases: `super::analysis_cases`.

use sqlparser::ast::{
    CopySource, Expr, InTarget, JoinConstraint, JoinOperator, ObjectName, ObjectNamePart, Query,
    SetExpr, Statement, TableFactor, TableObject, TableWithJoins, UnaryOperator, Value, Visit,
    Visitor,
};
use sqlparser::dialect::PostgreSqlDialect;
use sqlparser::keywords::Keyword;
use sqlparser::parser::Parser;
use sqlparser::tokenizer::{Token, Tokenizer};
use std::collections::HashMap;
use std::ops::ControlFlow;
use std::sync::Arc;

/// A LokaDB table as routing sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LokaTable {
    pub schema: String,
    pub name: String,
    pub org_column: String,
}

/// A foreign key from a LokaDB table to a cloud table that every row of it meets in
/// exactly one row (`lokadb.join_meta()`: every column NOT NULL, not deferrable, kept for
/// moved organizations by a guard): an inner join on it keeps every row, which the join
/// rewrite ([`super::rewrite`]) relies on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JoinKey {
    /// The LokaDB table (catalog index).
    pub table: usize,
    pub columns: Vec<String>,
    pub target_schema: String,
    pub target: String,
    pub target_columns: Vec<String>,
}

/// A key map the key-map rewrite may use (`lokadb.key_meta()`): a backfilled map of one
/// column of a LokaDB table without row-level security.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyMap {
    /// The LokaDB table (catalog index).
    pub table: usize,
    pub column: String,
    /// The key's and the organization column's SQL types (`bigint`, `uuid`, …).
    pub column_type: String,
    pub org_type: String,
    /// The key map's name in schema `lokadb`.
    pub keymap: String,
}

/// The LokaDB tables, looked up by the names a statement may use.
#[derive(Debug, Clone, Default)]
pub struct Catalog {
    /// `name` and `schema.name`, lowercased as Postgres folds unquoted names → index. A
    /// name of tables in several schemas is the one in `public`, else it is in `ambiguous`.
    by_name: HashMap<String, usize>,
    /// Names of LokaDB tables in several schemas, none of them `public`: which one a
    /// statement means depends on the session's search_path, so a statement naming one
    /// without its schema is not placed.
    ambiguous: Vec<String>,
    tables: Vec<LokaTable>,
    join_keys: Vec<JoinKey>,
    key_maps: Vec<KeyMap>,
    /// Each table's organization column's SQL type (`bigint`, `uuid`, …), by index; empty
    /// when not loaded (then no statement is limited to the session's organization).
    org_types: Vec<String>,
    /// Lowercased bare names, for the fast path, and `u&"` (a Unicode-escaped name, which
    /// may spell any of them).
    needles: Vec<memchr::memmem::Finder<'static>>,
}

impl Catalog {
    /// A catalog of `tables`. An unqualified name resolves as if `search_path` held its
    /// table's schema, or `public` first when several schemas have a table of that name
    /// (the default search_path; a session's own is `super::names`'s to check).
    pub fn new(tables: Vec<LokaTable>) -> Catalog {
        let mut by_name = HashMap::new();
        let mut ambiguous: Vec<String> = Vec::new();
        let mut needles = Vec::new();
        for (i, t) in tables.iter().enumerate() {
            by_name.insert(format!("{}.{}", t.schema, t.name), i);
            let same: Vec<usize> = (0..tables.len())
                .filter(|&j| tables[j].name == t.name)
                .collect();
            let public = same.iter().find(|&&j| tables[j].schema == "public");
            match (same.as_slice(), public) {
                ([_], _) => {
                    by_name.insert(t.name.clone(), i);
                }
                (_, Some(&j)) => {
                    by_name.insert(t.name.clone(), j);
                }
                _ if !ambiguous.contains(&t.name) => ambiguous.push(t.name.clone()),
                _ => {}
            }
            needles.push(
                memchr::memmem::Finder::new(t.name.to_ascii_lowercase().as_bytes()).into_owned(),
            );
        }
        if !needles.is_empty() {
            // `U&"\0064ocuments"` names documents: not found by its text.
            needles.push(memchr::memmem::Finder::new(b"u&\"").into_owned());
        }
        Catalog {
            by_name,
            ambiguous,
            tables,
            join_keys: Vec::new(),
            key_maps: Vec::new(),
            org_types: Vec::new(),
            needles,
        }
    }

    /// The catalog with the organization columns' types, in the order of its tables.
    #[must_use]
    pub fn with_org_types(mut self, types: Vec<String>) -> Catalog {
        self.org_types = types;
        self
    }

    /// The SQL type of table `table`'s organization column, if known.
    pub fn org_type(&self, table: usize) -> Option<&str> {
        self.org_types
            .get(table)
            .map(String::as_str)
            .filter(|t| !t.is_empty())
    }

    /// The catalog with the foreign keys the join rewrite may lean on.
    #[must_use]
    pub fn with_join_keys(mut self, keys: Vec<JoinKey>) -> Catalog {
        self.join_keys = keys;
        self
    }

    pub fn tables(&self) -> &[LokaTable] {
        &self.tables
    }

    /// The catalog with the key maps the key-map rewrite may use.
    #[must_use]
    pub fn with_key_maps(mut self, maps: Vec<KeyMap>) -> Catalog {
        self.key_maps = maps;
        self
    }

    /// The key map of `table`'s column `column`, if the key-map rewrite may use one.
    pub fn key_map(&self, table: usize, column: &str) -> Option<&KeyMap> {
        self.key_maps
            .iter()
            .find(|k| k.table == table && k.column == column)
    }

    /// Whether `sql`, from its first `where` on, mentions any LokaDB table's organization
    /// column (a scan, no parse): a statement may look for a key's organization only if not.
    pub fn org_column_after_where(&self, sql: &str) -> bool {
        let Some(at) = find(sql, b"where") else {
            return false;
        };
        let rest = &sql[at..];
        self.tables
            .iter()
            .any(|t| mentions(rest, t.org_column.as_bytes()))
    }

    /// Whether any key map may be used (else no statement is looked at for one).
    pub fn has_key_maps(&self) -> bool {
        !self.key_maps.is_empty()
    }

    /// The [`JoinKey`]s of table `table` (catalog index).
    pub fn join_keys(&self, table: usize) -> impl Iterator<Item = &JoinKey> {
        self.join_keys.iter().filter(move |k| k.table == table)
    }

    /// Whether an analysis made with `other` holds with this one: the same tables and keys.
    pub fn same_as(&self, other: &Catalog) -> bool {
        self.tables == other.tables
            && self.join_keys == other.join_keys
            && self.key_maps == other.key_maps
            && self.org_types == other.org_types
    }

    /// Whether `sql` may mention a LokaDB table (a substring test on the lowercased
    /// text): when not, the statement needs no parse.
    pub fn may_touch(&self, sql: &str) -> bool {
        if self.needles.is_empty() {
            return false;
        }
        let lower = sql.to_ascii_lowercase();
        self.needles
            .iter()
            .any(|n| n.find(lower.as_bytes()).is_some())
    }

    /// The LokaDB table `name` resolves to: `table`, `schema.table` or
    /// `database.schema.table` (Postgres accepts the current database's name there), each
    /// part folded as Postgres folds it. A quoted part holding a dot is one name.
    pub(super) fn lookup(&self, name: &ObjectName) -> Option<usize> {
        let mut parts = Vec::with_capacity(name.0.len());
        for p in &name.0 {
            match p {
                ObjectNamePart::Identifier(i) if !i.value.contains('.') => {
                    parts.push(fold(&i.value, i.quote_style.is_some()));
                }
                _ => return None,
            }
        }
        match parts.as_slice() {
            [table] => self.by_name.get(table).copied(),
            [schema, table] | [_, schema, table] => {
                self.by_name.get(&format!("{schema}.{table}")).copied()
            }
            _ => None,
        }
    }

    /// The LokaDB table an unqualified name (folded) resolves to in the analyses.
    pub(super) fn unqualified(&self, name: &str) -> Option<usize> {
        self.by_name.get(name).copied()
    }

    /// Whether `statements` name a LokaDB table of [`Catalog::ambiguous`] without its schema.
    fn names_ambiguously(&self, statements: &[Statement]) -> bool {
        let ambiguous = |name: &ObjectName| match name.0.as_slice() {
            [ObjectNamePart::Identifier(i)]
                if self
                    .ambiguous
                    .contains(&fold(&i.value, i.quote_style.is_some())) =>
            {
                ControlFlow::Break(())
            }
            _ => ControlFlow::Continue(()),
        };
        !self.ambiguous.is_empty()
            && statements
                .iter()
                .any(|s| sqlparser::ast::visit_relations(s, ambiguous).is_break())
    }

    /// Whether a name (folded) is a LokaDB table's, in any schema.
    fn is_table_name(&self, name: &str) -> bool {
        self.tables.iter().any(|t| t.name == name)
    }
}

/// The longest statement text the proxy parses: a longer one goes to the cloud unplaced
/// (the parse runs on the session's core, in time with the text's length).
pub const MAX_PARSED_BYTES: usize = 1 << 20;

/// The most operators (AND, OR, UNION, `=`, `+`, `::`, …) a parsed statement may hold.
/// Each may nest the parse tree one level deeper (`a AND b AND c …` is a chain as deep as
/// it is long), and the tree is walked and dropped recursively: a deeper one would overflow
/// the core's stack.
pub const MAX_OPERATORS: usize = 4096;

/// Parses `sql` as routing does (every parse of a client's text goes through here): texts
/// over [`MAX_PARSED_BYTES`] or [`MAX_OPERATORS`] are refused before the parse. Spans are
/// kept (the rewrites edit the text by them).
///
/// # Errors
///
/// Why it was not parsed.
pub fn parse(sql: &str) -> Result<Vec<Statement>, &'static str> {
    if sql.len() > MAX_PARSED_BYTES {
        return Err("the statement is too long for the proxy to analyse (over 1 MiB)");
    }
    let dialect = PostgreSqlDialect {};
    let tokens = Tokenizer::new(&dialect, sql)
        .tokenize_with_location()
        .map_err(|_| "the statement did not parse")?;
    if tokens.iter().filter(|t| is_operator(&t.token)).count() > MAX_OPERATORS {
        return Err("the statement holds too many operators for the proxy to analyse");
    }
    Parser::new(&dialect)
        .with_tokens_with_locations(tokens)
        .parse_statements()
        .map_err(|_| "the statement did not parse")
}

/// Whether a token may join two expressions or queries (and so deepen the parse tree):
/// anything but names, literals, parameters and punctuation. Every keyword counts (AND, OR,
/// UNION, but also IN, IS, LIKE, COLLATE, AT TIME ZONE …: `x IN (1) IN (1) …` chains
/// too), and so every word that is one, even as a name: an ordinary statement has a few
/// dozen.
fn is_operator(t: &Token) -> bool {
    match t {
        Token::Word(w) => w.keyword != Keyword::NoKeyword,
        Token::Whitespace(_)
        | Token::Number(..)
        | Token::Placeholder(_)
        | Token::Comma
        | Token::Period
        | Token::LParen
        | Token::RParen
        | Token::SemiColon
        | Token::EOF
        | Token::SingleQuotedString(_)
        | Token::DoubleQuotedString(_)
        | Token::DollarQuotedString(_)
        | Token::EscapedStringLiteral(_)
        | Token::UnicodeStringLiteral(_)
        | Token::NationalStringLiteral(_)
        | Token::HexStringLiteral(_)
        | Token::SingleQuotedByteStringLiteral(_) => false,
        _ => true,
    }
}

/// The LokaDB table a `COPY <table> TO …` in `sql` copies out whole, if any: a LokaDB
/// table holds every organization's rows (the moved ones' through their tunnels), so the
/// proxy refuses that form and points to `COPY (SELECT … WHERE <org column> = …) TO`.
/// `COPY … FROM` and `COPY (query) TO` are not matched.
pub fn copy_out_of_loka_table<'c>(sql: &str, catalog: &'c Catalog) -> Option<&'c LokaTable> {
    // Cheap tests first: most statements are not COPY and name no LokaDB table.
    if !mentions(sql, b"copy") || !catalog.may_touch(sql) {
        return None;
    }
    let statements = parse(sql).ok()?;
    statements.iter().find_map(|s| match s {
        Statement::Copy {
            source: CopySource::Table { table_name, .. },
            to: true,
            ..
        } => catalog.lookup(table_name).map(|i| &catalog.tables[i]),
        _ => None,
    })
}

/// Whether `sql` holds `word` (ASCII) in any case: a scan with no allocation,
/// to skip statements a rule cannot concern before any lookup or parse.
pub fn mentions(sql: &str, word: &[u8]) -> bool {
    find(sql, word).is_some()
}

/// Where `word` (ASCII) first occurs in `sql`, in any case: a vectorised scan for its
/// first letter, either case, then a comparison there.
pub fn find(sql: &str, word: &[u8]) -> Option<usize> {
    let bytes = sql.as_bytes();
    let (&first, _) = word.split_first()?;
    memchr::memchr2_iter(
        first.to_ascii_lowercase(),
        first.to_ascii_uppercase(),
        bytes,
    )
    .find(|&i| {
        bytes
            .get(i..i + word.len())
            .is_some_and(|w| w.eq_ignore_ascii_case(word))
    })
}

/// Postgres folds unquoted identifiers to lower case: ASCII letters only, in a UTF-8
/// database (`Ä` and `ä` are two names).
pub(super) fn fold(value: &str, quoted: bool) -> String {
    if quoted {
        value.to_owned()
    } else {
        value.to_ascii_lowercase()
    }
}

/// The organization a statement concerns.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Org {
    /// A constant, as its text (`42` for `42`, `'42'`, `'42'::bigint`).
    Literal(String),
    /// The value bound to parameter `$n` (1-based).
    Param(u16),
    /// The session's organization (`SET lokadb.org`): the condition the proxy adds,
    /// [`SESSION_ORG`] cast to the organization column's type.
    Session,
    /// The organization a key map gives a key: the condition the key-map rewrite adds
    /// (`lokadb_client.key_org(keymap, CAST(key AS type))`, [`super::rewrite::key_lookup`]).
    Key(Arc<KeyOrg>),
}

/// A key-map lookup in a statement: which key map, the key's type, and the key (a
/// constant's text or a parameter).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct KeyOrg {
    pub keymap: String,
    pub key_type: String,
    pub key: Org,
}

/// `lokadb_client.key_org('<keymap>', CAST(<constant or $n> AS <type>))`, as the key-map
/// rewrite writes it (an outer cast stripped).
fn key_org(e: &Expr) -> Option<KeyOrg> {
    use sqlparser::ast::{FunctionArg, FunctionArgExpr, FunctionArguments};
    let Expr::Function(f) = e else {
        return None;
    };
    let named = matches!(f.name.0.as_slice(), [ObjectNamePart::Identifier(s), ObjectNamePart::Identifier(n)]
        if s.quote_style.is_none() && s.value.eq_ignore_ascii_case("lokadb_client")
            && n.quote_style.is_none() && n.value.eq_ignore_ascii_case("key_org"));
    let FunctionArguments::List(list) = &f.args else {
        return None;
    };
    if !named || !list.clauses.is_empty() || f.filter.is_some() || f.over.is_some() {
        return None;
    }
    let [FunctionArg::Unnamed(FunctionArgExpr::Expr(Expr::Value(map))), FunctionArg::Unnamed(FunctionArgExpr::Expr(Expr::Cast {
        expr, data_type, ..
    }))] = list.args.as_slice()
    else {
        return None;
    };
    let Value::SingleQuotedString(keymap) = &map.value else {
        return None;
    };
    // The key bare: a cast the client wrote (`'abcdef'::varchar(3)`) may change its value,
    // which the lookup would not see.
    let bare = match expr.as_ref() {
        Expr::Value(_) => true,
        Expr::UnaryOp {
            op: UnaryOperator::Minus,
            expr,
        } => matches!(expr.as_ref(), Expr::Value(_)),
        _ => false,
    };
    if !bare {
        return None;
    }
    let key = match constant(expr)? {
        k @ (Org::Literal(_) | Org::Param(_)) => k,
        _ => return None,
    };
    Some(KeyOrg {
        keymap: keymap.clone(),
        key_type: data_type.to_string(),
        key,
    })
}

/// The expression that stands for the session's organization in a statement the proxy
/// limited to it (`super::rewrite::scope`): the cloud evaluates it from the setting the
/// client's `SET lokadb.org` made there, so a prepared statement follows the session's
/// organization wherever it changes to.
pub const SESSION_ORG: &str = "current_setting('lokadb.org')";

/// Whether `e` is [`SESSION_ORG`] (as the proxy writes it).
fn is_session_org(e: &Expr) -> bool {
    use sqlparser::ast::{FunctionArg, FunctionArgExpr, FunctionArguments};
    let Expr::Function(f) = e else {
        return false;
    };
    let name = matches!(f.name.0.as_slice(), [ObjectNamePart::Identifier(n)]
        if n.quote_style.is_none() && n.value.eq_ignore_ascii_case("current_setting"));
    let FunctionArguments::List(list) = &f.args else {
        return false;
    };
    let arg = matches!(list.args.as_slice(), [FunctionArg::Unnamed(FunctionArgExpr::Expr(Expr::Value(v)))]
        if v.value == Value::SingleQuotedString("lokadb.org".into()));
    name && arg && list.clauses.is_empty() && f.filter.is_none() && f.over.is_none()
}

/// What the analysis found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Analysis {
    /// Touches no LokaDB table.
    NoLokaTable,
    /// Touches LokaDB tables (indexes into the catalog), all limited to one organization.
    /// `read` when it is one plain read of LokaDB tables only, which the organization's
    /// database can answer alone (the direct path); see [`plain_read`]. `set` when it is
    /// one plain UPDATE of `tables[0]`: the columns it sets (see [`plain_update`]).
    /// `rewrite`: the text to send the cloud instead (the join rewrite,
    /// [`super::rewrite`]).
    Org {
        org: Org,
        tables: Vec<usize>,
        read: bool,
        set: Option<Vec<String>>,
        rewrite: Option<Arc<str>>,
    },
    /// Touches LokaDB tables but cannot be placed in one organization; why.
    Unplaced(&'static str),
    /// Names no organization, but one key a key map keeps: sent to the cloud as this text,
    /// which adds the key's organization ([`super::rewrite::key_lookup`]).
    Keyed(Arc<str>),
}

/// Analyses `sql` (one or more statements).
pub fn analyze(sql: &str, catalog: &Catalog) -> Analysis {
    if !catalog.may_touch(sql) {
        return Analysis::NoLokaTable;
    }
    let statements = match parse(sql) {
        Ok(s) => s,
        Err(_) if runs_alone(sql) => return Analysis::Unplaced(RUNS_ALONE),
        Err(why) => return Analysis::Unplaced(why),
    };
    if catalog.names_ambiguously(&statements) {
        return Analysis::Unplaced(
            "a LokaDB table's name is in several schemas, none of them public: which one is meant depends on the search_path",
        );
    }
    let mut w = Walk {
        catalog,
        refs: Vec::new(),
        by_factor: HashMap::new(),
        links: Vec::new(),
        unplaceable: None,
    };
    for s in &statements {
        let _ = s.visit(&mut w);
    }
    // A LokaDB table named where no reference is counted (a LOCK, TRUNCATE, COPY of the
    // table, DDL) is one no condition limits.
    let named: usize = statements
        .iter()
        .map(|s| super::rewrite::loka_references(s, catalog))
        .sum();
    if named > w.refs.len() {
        w.unplaceable = Some("a LokaDB table named where no condition can reach it");
    }
    // Other statements (COPY of a table, DDL, GRANT, VACUUM, MERGE …) name tables where the
    // walk does not look: any word that is a LokaDB table's name counts.
    if statements
        .iter()
        .any(|s| !walked(s) && names_a_table(s, catalog))
    {
        w.unplaceable = Some(if runs_alone(sql) {
            RUNS_ALONE
        } else {
            "a LokaDB table named in a statement no condition limits"
        });
    }
    match w.finish() {
        Analysis::Org { org, tables, .. } => {
            // A key's organization comes from the one lookup the key-map rewrite adds; any
            // other call of it is the client's, which the organization's database lacks.
            let keys = usize::from(matches!(org, Org::Key(_)));
            Analysis::Org {
                read: plain_read(&statements, catalog, keys),
                set: plain_update(&statements, catalog, keys).filter(|_| tables.len() == 1),
                rewrite: (tables.len() == 1)
                    .then(|| super::rewrite::limit_pushdown(sql, &statements, catalog))
                    .flatten()
                    .map(Arc::from),
                org,
                tables,
            }
        }
        Analysis::Unplaced(why) => match super::rewrite::key_lookup(sql, &statements, catalog) {
            Some(rewritten) => Analysis::Keyed(Arc::from(rewritten)),
            None => Analysis::Unplaced(why),
        },
        other => other,
    }
}

/// Why a statement Postgres runs only alone in its request is unplaced: VACUUM,
/// `… CONCURRENTLY`, `CREATE DATABASE` and the like. Nothing of the proxy's may go ahead of
/// it in the client's batch (Postgres would refuse it "within a pipeline").
pub const RUNS_ALONE: &str =
    "a statement Postgres runs only outside a transaction (VACUUM, CONCURRENTLY, DATABASE …)";

/// Whether `sql` is a statement Postgres runs only outside a transaction block (comments
/// and quoted names aside): VACUUM, one with the keyword CONCURRENTLY, or CREATE, DROP,
/// ALTER or REINDEX of a DATABASE, TABLESPACE, SUBSCRIPTION or the SYSTEM.
fn runs_alone(sql: &str) -> bool {
    if sql.len() > MAX_PARSED_BYTES {
        return false;
    }
    let Ok(tokens) = Tokenizer::new(&PostgreSqlDialect {}, sql).tokenize() else {
        return false;
    };
    // Each token but spaces and comments: an unquoted word as lower case, else nothing.
    let words: Vec<Option<String>> = tokens
        .iter()
        .filter_map(|t| match t {
            Token::Whitespace(_) => None,
            Token::Word(w) if w.quote_style.is_none() => Some(Some(w.value.to_ascii_lowercase())),
            _ => Some(None),
        })
        .collect();
    let word = |i: usize| words.get(i).and_then(Option::as_deref);
    match (word(0), word(1)) {
        (Some("vacuum"), _) => true,
        // REFRESH MATERIALIZED VIEW CONCURRENTLY runs in a transaction.
        (Some("refresh"), _) => false,
        (
            Some("create" | "drop" | "alter" | "reindex"),
            Some("database" | "tablespace" | "subscription" | "system"),
        ) => true,
        _ => words.iter().any(|w| w.as_deref() == Some("concurrently")),
    }
}

/// Whether the walk sees every table `s` can touch: a query, INSERT, UPDATE, DELETE,
/// `COPY (query)`, a cursor's query, or an EXPLAIN of one. (A `PREPARE` is not: its `$n`
/// are bound by an EXECUTE the proxy does not follow.)
fn walked(s: &Statement) -> bool {
    match s {
        Statement::Query(_)
        | Statement::Insert(_)
        | Statement::Update(_)
        | Statement::Delete(_) => true,
        Statement::Copy {
            source: CopySource::Query(_),
            ..
        } => true,
        Statement::Explain { statement, .. } => walked(statement),
        // `DECLARE c CURSOR FOR <query>`: the query is walked.
        Statement::Declare { stmts, .. } => stmts.iter().all(|d| d.for_query.is_some()),
        _ => false,
    }
}

/// Whether a word of `s` (as printed) is a LokaDB table's name.
fn names_a_table(s: &Statement, catalog: &Catalog) -> bool {
    let text = s.to_string();
    let Ok(tokens) = Tokenizer::new(&PostgreSqlDialect {}, &text).tokenize() else {
        return true;
    };
    tokens.iter().any(|t| {
        matches!(t, Token::Word(w) if catalog.is_table_name(&fold(&w.value, w.quote_style.is_some())))
    })
}

/// Built-in functions a direct read may call: the organization's database has them and
/// they read nothing of the cloud's. Anything else (a user's function, a sequence, an
/// advisory lock, `set_config`) keeps the statement on the cloud.
const READ_FUNCTIONS: &[&str] = &[
    "abs",
    "array_agg",
    "array_length",
    "avg",
    "bool_and",
    "bool_or",
    "btrim",
    "ceil",
    "char_length",
    "coalesce",
    "concat",
    "concat_ws",
    "count",
    "date_part",
    "date_trunc",
    "every",
    "floor",
    "format",
    "greatest",
    "json_agg",
    "json_build_object",
    "jsonb_agg",
    "jsonb_build_object",
    "least",
    "left",
    "length",
    "lower",
    "ltrim",
    "max",
    "md5",
    "min",
    "now",
    "nullif",
    "octet_length",
    "position",
    "replace",
    "right",
    "round",
    "row_number",
    "rtrim",
    "split_part",
    "string_agg",
    "substr",
    "sum",
    "to_char",
    "trim",
    "trunc",
    "upper",
];

/// Whether `statements` is one plain read of LokaDB tables only (or a `COPY` of one to the
/// client): a SELECT (no INTO, no
/// locking clause, no WITH) whose every relation is a LokaDB table and whose functions are
/// [`READ_FUNCTIONS`]. Such a statement gives the same answer in the organization's
/// database as through the cloud; anything else could not (a cloud table, a side effect).
fn plain_read(statements: &[Statement], catalog: &Catalog, keys: usize) -> bool {
    let q = match statements {
        [Statement::Query(q)] => q,
        // `COPY (plain read) TO STDOUT`: the organization's database streams it the same.
        [Statement::Copy {
            source: CopySource::Query(q),
            to: true,
            target: sqlparser::ast::CopyTarget::Stdout,
            ..
        }] => q,
        _ => return false,
    };
    answered_alone(q.as_ref(), catalog, keys)
}

/// Whether the organization's database answers `node` alone ([`Check`]), `keys` being how
/// many key-map lookups it holds (the rewrite's) and none other.
fn answered_alone<V: Visit + ?Sized>(node: &V, catalog: &Catalog, keys: usize) -> bool {
    let mut check = Check {
        catalog,
        key_orgs: 0,
    };
    node.visit(&mut check).is_continue() && check.key_orgs == keys
}

/// The columns a plain UPDATE sets: one statement, one LokaDB table without FROM or joins,
/// single-column assignments, and (like [`plain_read`]) no other relation and only
/// [`READ_FUNCTIONS`] anywhere in it. Whether those columns may change directly depends
/// on the cloud's constraints (`Meta::may_update`), not on the text.
fn plain_update(statements: &[Statement], catalog: &Catalog, keys: usize) -> Option<Vec<String>> {
    let [s @ Statement::Update(u)] = statements else {
        return None;
    };
    if u.from.is_some() || !u.table.joins.is_empty() || u.or.is_some() {
        return None;
    }
    let TableFactor::Table { name, .. } = &u.table.relation else {
        return None;
    };
    catalog.lookup(name)?;
    let mut columns = Vec::new();
    for a in &u.assignments {
        let sqlparser::ast::AssignmentTarget::ColumnName(c) = &a.target else {
            return None;
        };
        let [ObjectNamePart::Identifier(i)] = c.0.last().map(std::slice::from_ref)? else {
            return None;
        };
        columns.push(fold(&i.value, i.quote_style.is_some()));
    }
    answered_alone(s, catalog, keys).then_some(columns)
}

/// A statement the organization's database answers alone: every relation a LokaDB table,
/// every query plain (no WITH, locking clause, INTO), every function a [`READ_FUNCTIONS`].
struct Check<'a> {
    catalog: &'a Catalog,
    /// `lokadb_client.key_org` calls seen (the key-map rewrite adds one).
    key_orgs: usize,
}

impl Visitor for Check<'_> {
    type Break = ();
    fn pre_visit_query(&mut self, q: &Query) -> ControlFlow<()> {
        let plain =
            q.with.is_none() && q.locks.is_empty() && q.for_clause.is_none() && plain_body(&q.body);
        if plain {
            ControlFlow::Continue(())
        } else {
            ControlFlow::Break(())
        }
    }
    fn pre_visit_relation(&mut self, r: &ObjectName) -> ControlFlow<()> {
        // `app.public.documents` names the cloud's database, not the organization's.
        match self.catalog.lookup(r) {
            Some(_) if r.0.len() <= 2 => ControlFlow::Continue(()),
            _ => ControlFlow::Break(()),
        }
    }
    fn pre_visit_table_factor(&mut self, f: &TableFactor) -> ControlFlow<()> {
        match f {
            TableFactor::Table { args: None, .. } | TableFactor::Derived { .. } => {
                ControlFlow::Continue(())
            }
            _ => ControlFlow::Break(()),
        }
    }
    fn pre_visit_expr(&mut self, e: &Expr) -> ControlFlow<()> {
        // A system column answers for the organization's own table there, not for the
        // cloud's partition of it (another `tableoid`, `ctid`, `xmin`): the cloud answers.
        if names_system_column(e) {
            return ControlFlow::Break(());
        }
        // The session's organization, a key's: the direct path sends the client's text,
        // without them (a key's only where the rewrite put it: counted).
        if is_session_org(e) {
            return ControlFlow::Continue(());
        }
        if key_org(e).is_some() {
            self.key_orgs += 1;
            return ControlFlow::Continue(());
        }
        if let Expr::Function(f) = e {
            let known = match f.name.0.as_slice() {
                [ObjectNamePart::Identifier(n)] => {
                    n.quote_style.is_none()
                        && READ_FUNCTIONS.contains(&n.value.to_ascii_lowercase().as_str())
                }
                _ => false,
            };
            if !known {
                return ControlFlow::Break(());
            }
        }
        ControlFlow::Continue(())
    }
}

/// Postgres's system columns: every table has them, with values of the database that holds
/// the row. A LokaDB table can have no column of these names (Postgres refuses it).
pub(super) const SYSTEM_COLUMNS: &[&str] = &["tableoid", "ctid", "xmin", "xmax", "cmin", "cmax"];

/// Whether `e` is a column reference (`ctid`, `d.ctid`, `public.documents."xmin"`) to a
/// system column. A name of the statement's own (an output alias `AS xmin` in ORDER BY, a
/// subquery's column) counts too: the statement then goes to the cloud, which is always
/// correct.
fn names_system_column(e: &Expr) -> bool {
    let name = match e {
        Expr::Identifier(i) => i,
        Expr::CompoundIdentifier(parts) => match parts.last() {
            Some(i) => i,
            None => return false,
        },
        _ => return false,
    };
    SYSTEM_COLUMNS.contains(&fold(&name.value, name.quote_style.is_some()).as_str())
}

fn plain_body(body: &SetExpr) -> bool {
    match body {
        SetExpr::Select(s) => s.into.is_none(),
        SetExpr::Query(_) => true,
        SetExpr::SetOperation { left, right, .. } => plain_body(left) && plain_body(right),
        _ => false,
    }
}

/// One reference to a LokaDB table in the statement.
#[derive(Debug)]
struct Ref {
    table: usize,
    /// The name it goes by at its query level (alias, else table name).
    alias: String,
    /// Not aliased: `schema.table` qualifies its columns too.
    aliased: bool,
    org: Option<Org>,
    /// Two different organizations were required of it.
    conflict: bool,
}

/// The most references to LokaDB tables one statement may hold to be placed: linking them
/// costs up to their number squared.
pub const MAX_REFERENCES: usize = 256;

struct Walk<'a> {
    catalog: &'a Catalog,
    refs: Vec<Ref>,
    /// TableFactor address → reference, so each reference is counted once.
    by_factor: HashMap<usize, usize>,
    /// `a.org = b.org` between two references.
    links: Vec<(usize, usize)>,
    unplaceable: Option<&'static str>,
}

impl Walk<'_> {
    fn finish(mut self) -> Analysis {
        if self.refs.is_empty() {
            return self
                .unplaceable
                .map_or(Analysis::NoLokaTable, Analysis::Unplaced);
        }
        if let Some(why) = self.unplaceable {
            return Analysis::Unplaced(why);
        }
        if self.refs.len() > MAX_REFERENCES {
            return Analysis::Unplaced("more LokaDB table references than the proxy analyses");
        }
        self.link();
        let mut org: Option<Org> = None;
        for r in &self.refs {
            if r.conflict {
                return Analysis::Unplaced("two organizations");
            }
            match (&org, &r.org) {
                (_, None) => {
                    return Analysis::Unplaced("a LokaDB table without an organization condition")
                }
                (None, Some(o)) => org = Some(o.clone()),
                (Some(a), Some(b)) if a != b => return Analysis::Unplaced("two organizations"),
                _ => {}
            }
        }
        let mut tables: Vec<usize> = self.refs.iter().map(|r| r.table).collect();
        tables.sort_unstable();
        tables.dedup();
        Analysis::Org {
            org: org.expect("at least one reference"),
            tables,
            read: false,
            set: None,
            rewrite: None,
        }
    }

    /// Organization equalities (`a.org = b.org`) carry a placed reference's organization to
    /// every reference they connect: each connected group takes its one organization, or all
    /// of it conflicts. Linear in references and links.
    fn link(&mut self) {
        let n = self.refs.len();
        let mut next: Vec<Vec<usize>> = vec![Vec::new(); n];
        for &(a, b) in &self.links {
            next[a].push(b);
            next[b].push(a);
        }
        let mut seen = vec![false; n];
        for start in 0..n {
            if seen[start] || next[start].is_empty() {
                continue;
            }
            let (mut group, mut todo) = (Vec::new(), vec![start]);
            seen[start] = true;
            while let Some(i) = todo.pop() {
                group.push(i);
                for &j in &next[i] {
                    if !std::mem::replace(&mut seen[j], true) {
                        todo.push(j);
                    }
                }
            }
            let mut org: Option<Org> = None;
            let mut conflict = group.iter().any(|&i| self.refs[i].conflict);
            for &i in &group {
                match (&org, &self.refs[i].org) {
                    (None, Some(o)) => org = Some(o.clone()),
                    (Some(a), Some(b)) if a != b => conflict = true,
                    _ => {}
                }
            }
            for &i in &group {
                self.refs[i].conflict = conflict;
                if self.refs[i].org.is_none() {
                    self.refs[i].org.clone_from(&org);
                }
            }
        }
    }

    /// The reference of a table factor (registering it on first sight).
    fn reference(&mut self, f: &TableFactor) -> Option<usize> {
        let key = std::ptr::from_ref(f) as usize;
        if let Some(&i) = self.by_factor.get(&key) {
            return Some(i);
        }
        let TableFactor::Table {
            name,
            alias,
            inheritance,
            ..
        } = f
        else {
            return None;
        };
        let table = self.catalog.lookup(name)?;
        if matches!(
            inheritance,
            Some(sqlparser::ast::TableInheritance::Only { .. })
        ) {
            // The cloud's parent holds no rows of its own; the organization's table does.
            self.unplaceable = Some("ONLY of a LokaDB table");
        }
        let alias = match alias {
            // `documents d (id, organization_id)`: its organization column may go by
            // another name, and another of its columns by that one.
            Some(a) if !a.columns.is_empty() => {
                self.unplaceable = Some("a LokaDB table's alias that renames its columns");
                fold(&a.name.value, a.name.quote_style.is_some())
            }
            Some(a) => fold(&a.name.value, a.name.quote_style.is_some()),
            None => self.catalog.tables[table].name.clone(),
        };
        self.refs.push(Ref {
            table,
            alias,
            aliased: matches!(f, TableFactor::Table { alias: Some(_), .. }),
            org: None,
            conflict: false,
        });
        self.by_factor.insert(key, self.refs.len() - 1);
        Some(self.refs.len() - 1)
    }

    /// Applies the conjuncts of `cond` to the references `scope` (one query level).
    fn constrain(&mut self, scope: &[usize], cond: &Expr) {
        if self.refs.len() > MAX_REFERENCES {
            return; // not placed (`finish`): no links to build
        }
        for c in conjuncts(cond) {
            match c {
                Expr::BinaryOp { left, op, right } if op.to_string() == "=" => {
                    let l = self.column_refs(scope, left);
                    let r = self.column_refs(scope, right);
                    match (l.is_empty(), r.is_empty()) {
                        (false, true) => {
                            if let Some(v) = self.value(right, &l) {
                                self.place(&l, v);
                            }
                        }
                        (true, false) => {
                            if let Some(v) = self.value(left, &r) {
                                self.place(&r, v);
                            }
                        }
                        // Every reference on either side is one group: a star from the
                        // first keeps the links linear (an unqualified `organization_id =
                        // organization_id` names every reference on both sides).
                        (false, false) => {
                            let first = l[0];
                            for &b in l[1..].iter().chain(&r) {
                                self.links.push((first, b));
                            }
                        }
                        (true, true) => {}
                    }
                }
                Expr::In {
                    expr,
                    target: InTarget::List(list),
                    negated: false,
                    ..
                } if list.len() == 1 => {
                    let l = self.column_refs(scope, expr);
                    if let Some(v) = self.value(&list[0], &l) {
                        self.place(&l, v);
                    }
                }
                _ => {}
            }
        }
    }

    /// [`constant`] as the organization of `refs`: the session's or a key's organization
    /// only under a cast that keeps its value or one to their organization column's type (the
    /// cast the proxy writes): `current_setting('lokadb.org')::varchar(1)` is another value.
    fn value(&self, e: &Expr, refs: &[usize]) -> Option<Org> {
        let v = constant(e)?;
        if !matches!(v, Org::Session | Org::Key(_)) {
            return Some(v);
        }
        let Some((_, data_type)) = outer_cast(e) else {
            return Some(v);
        };
        if faithful(data_type).0 {
            return Some(v);
        }
        let ty = data_type.to_string();
        let columns = refs.iter().all(|&i| {
            let table = self.refs[i].table;
            self.catalog
                .org_type(table)
                .into_iter()
                .chain(
                    self.catalog
                        .key_maps
                        .iter()
                        .filter(|k| k.table == table)
                        .map(|k| k.org_type.as_str()),
                )
                .any(|t| t.eq_ignore_ascii_case(&ty))
        });
        columns.then_some(v)
    }

    fn place(&mut self, refs: &[usize], org: Org) {
        for &i in refs {
            match &self.refs[i].org {
                // The session's organization limits the rows whatever a parameter says
                // (`org = $1` then only filters further).
                Some(Org::Session) if matches!(org, Org::Param(_)) => {}
                Some(Org::Param(_)) if org == Org::Session => self.refs[i].org = Some(org.clone()),
                Some(o) if *o != org => self.refs[i].conflict = true,
                _ => self.refs[i].org = Some(org.clone()),
            }
        }
    }

    /// The references in `scope` whose organization column `e` names.
    fn column_refs(&self, scope: &[usize], e: &Expr) -> Vec<usize> {
        // Parentheses only: a cast of the column (`organization_id::int = 42` of a text
        // column) may equal the value for several organizations.
        let mut e = e;
        while let Expr::Nested(inner) = e {
            e = inner;
        }
        let f = |i: &sqlparser::ast::Ident| fold(&i.value, i.quote_style.is_some());
        // The column and what qualifies it: nothing, `alias`, `schema.table` or
        // `database.schema.table` (the latter two name an unaliased reference).
        let (schema, qualifier, column) = match e {
            Expr::Identifier(i) => (None, None, f(i)),
            Expr::CompoundIdentifier(p) => match p.as_slice() {
                [q, c] => (None, Some(f(q)), f(c)),
                [s, q, c] | [_, s, q, c] => (Some(f(s)), Some(f(q)), f(c)),
                _ => return Vec::new(),
            },
            _ => return Vec::new(),
        };
        scope
            .iter()
            .copied()
            .filter(|&i| {
                let r = &self.refs[i];
                let t = &self.catalog.tables[r.table];
                t.org_column == column
                    && qualifier.as_ref().is_none_or(|q| *q == r.alias)
                    && schema.as_ref().is_none_or(|s| !r.aliased && *s == t.schema)
            })
            .collect()
    }

    /// One SELECT level: its FROM references, constrained by its WHERE, ON and HAVING.
    fn select_level(&mut self, from: &[TableWithJoins], conds: &[&Expr]) {
        let mut scope = Vec::new();
        let mut on: Vec<(Vec<usize>, &Expr)> = Vec::new();
        for twj in from {
            let mut level = Vec::new();
            if let Some(i) = self.reference(&twj.relation) {
                level.push(i);
            }
            for j in &twj.joins {
                let right = self.reference(&j.relation);
                let (constraint, inner) = join_constraint(&j.join_operator);
                if let Some(i) = right {
                    level.push(i);
                }
                if let Some(JoinConstraint::On(e)) = constraint {
                    // An inner join's ON limits both sides; an outer join's only the
                    // side whose rows it filters (LEFT: the right one).
                    let applies: Vec<usize> = if inner {
                        level.clone()
                    } else {
                        right.into_iter().collect()
                    };
                    on.push((applies, e));
                }
            }
            scope.extend(level);
        }
        for (applies, e) in on {
            self.constrain(&applies, e);
        }
        for c in conds {
            self.constrain(&scope, c);
        }
    }

    fn set_expr(&mut self, body: &SetExpr) {
        match body {
            SetExpr::Select(s) => {
                let conds: Vec<&Expr> = s.selection.iter().chain(s.having.iter()).collect();
                self.select_level(&s.from, &conds);
            }
            SetExpr::SetOperation { left, right, .. } => {
                self.set_expr(left);
                self.set_expr(right);
            }
            // `TABLE t`: every row of it.
            SetExpr::Table(t) => {
                let name = t.schema_name.iter().chain(&t.table_name).cloned();
                let name = ObjectName::from(name.collect::<Vec<_>>());
                if self.catalog.lookup(&name).is_some() {
                    self.unplaceable = Some("TABLE of a LokaDB table");
                }
            }
            _ => {}
        }
    }
}

impl Visitor for Walk<'_> {
    type Break = ();

    fn pre_visit_query(&mut self, q: &Query) -> ControlFlow<()> {
        self.set_expr(&q.body);
        ControlFlow::Continue(())
    }

    fn pre_visit_statement(&mut self, s: &Statement) -> ControlFlow<()> {
        match s {
            Statement::Insert(ins) => {
                let TableObject::TableName(name) = &ins.table else {
                    return ControlFlow::Continue(());
                };
                let Some(table) = self.catalog.lookup(name) else {
                    return ControlFlow::Continue(());
                };
                let col = &self.catalog.tables[table].org_column;
                // The organization column named once, as itself (`meta.organization_id` is
                // a field of a composite column).
                let is_org = |c: &ObjectName| {
                    matches!(c.0.as_slice(), [ObjectNamePart::Identifier(i)]
                        if fold(&i.value, i.quote_style.is_some()) == *col)
                };
                let mut named = ins.columns.iter().enumerate().filter(|(_, c)| is_org(c));
                let pos = match (named.next(), named.next()) {
                    (Some((i, _)), None) => Some(i),
                    _ => None,
                };
                if let Some(sqlparser::ast::OnInsert::OnConflict(sqlparser::ast::OnConflict {
                    action: sqlparser::ast::OnConflictAction::DoUpdate(u),
                    ..
                })) = &ins.on
                {
                    if self.sets_org_column(&u.assignments) {
                        self.unplaceable = Some("an upsert that changes the organization column");
                    }
                }
                let org = match (pos, ins.source.as_deref().map(|q| q.body.as_ref())) {
                    (Some(pos), Some(SetExpr::Values(v))) => {
                        let mut org: Option<Org> = None;
                        let mut ok = !v.rows.is_empty();
                        let width = ins.columns.len();
                        for row in &v.rows {
                            if row.len() != width {
                                ok = false;
                            }
                            match (row.get(pos).and_then(constant), &org) {
                                (Some(o), None) => org = Some(o),
                                (Some(o), Some(p)) if o == *p => {}
                                _ => ok = false,
                            }
                        }
                        org.filter(|_| ok)
                    }
                    _ => None,
                };
                let alias = self.catalog.tables[table].name.clone();
                self.refs.push(Ref {
                    table,
                    alias,
                    aliased: false,
                    org,
                    conflict: false,
                });
            }
            Statement::Update(u) => {
                let mut items: Vec<&TableWithJoins> = vec![&u.table];
                if let Some(
                    sqlparser::ast::UpdateTableFromKind::BeforeSet(v)
                    | sqlparser::ast::UpdateTableFromKind::AfterSet(v),
                ) = &u.from
                {
                    items.extend(v.iter());
                }
                // Changing the organization column moves a row between organizations.
                if self.sets_org_column(&u.assignments) {
                    self.unplaceable = Some("an UPDATE of the organization column");
                }
                let conds: Vec<&Expr> = u.selection.iter().collect();
                self.dml_level(&items, &conds);
            }
            Statement::Delete(d) => {
                let (sqlparser::ast::FromTable::WithFromKeyword(from)
                | sqlparser::ast::FromTable::WithoutKeyword(from)) = &d.from;
                let mut items: Vec<&TableWithJoins> = from.iter().collect();
                if let Some(u) = &d.using {
                    items.extend(u.iter());
                }
                let conds: Vec<&Expr> = d.selection.iter().collect();
                self.dml_level(&items, &conds);
            }
            _ => {}
        }
        ControlFlow::Continue(())
    }

    fn pre_visit_table_factor(&mut self, f: &TableFactor) -> ControlFlow<()> {
        // Every reference counts, even one no query level constrained.
        let _ = self.reference(f);
        ControlFlow::Continue(())
    }
}

impl Walk<'_> {
    /// Whether assignments set an organization column (`SET organization_id = …`,
    /// `SET (title, organization_id) = …`).
    fn sets_org_column(&self, assignments: &[sqlparser::ast::Assignment]) -> bool {
        assignments.iter().any(|a| {
            let names = match &a.target {
                sqlparser::ast::AssignmentTarget::ColumnName(c) => std::slice::from_ref(c),
                sqlparser::ast::AssignmentTarget::Tuple(t) => t.as_slice(),
            };
            names.iter().any(|n| {
                matches!(n.0.last(), Some(ObjectNamePart::Identifier(i))
                if self.catalog.tables.iter().any(|t| {
                    fold(&i.value, i.quote_style.is_some()) == t.org_column
                }))
            })
        })
    }

    /// UPDATE and DELETE: the target and the FROM / USING items form one level.
    fn dml_level(&mut self, items: &[&TableWithJoins], conds: &[&Expr]) {
        let mut scope = Vec::new();
        for twj in items {
            if let Some(i) = self.reference(&twj.relation) {
                scope.push(i);
            }
            for j in &twj.joins {
                if let Some(i) = self.reference(&j.relation) {
                    scope.push(i);
                }
            }
        }
        for twj in items {
            for j in &twj.joins {
                if let (Some(JoinConstraint::On(e)), true) = join_constraint(&j.join_operator) {
                    self.constrain(&scope, e);
                }
            }
        }
        for c in conds {
            self.constrain(&scope, c);
        }
    }
}

/// A join's constraint and whether it is an inner join.
fn join_constraint(op: &JoinOperator) -> (Option<&JoinConstraint>, bool) {
    match op {
        JoinOperator::Join(c) | JoinOperator::Inner(c) => (Some(c), true),
        JoinOperator::Left(c) | JoinOperator::LeftOuter(c) => (Some(c), false),
        _ => (None, false),
    }
}

/// The AND-ed parts of `e` (parentheses removed; nothing under OR or NOT).
pub(super) fn conjuncts(e: &Expr) -> Vec<&Expr> {
    match e {
        Expr::Nested(inner) => conjuncts(inner),
        Expr::BinaryOp { left, op, right } if op.to_string() == "AND" => {
            let mut v = conjuncts(left);
            v.extend(conjuncts(right));
            v
        }
        _ => vec![e],
    }
}

/// `e` without parentheses and casts, and whether every cast removed keeps a value's text
/// as it reads (see [`faithful`]); whether one made it an integer.
fn strip(e: &Expr) -> (&Expr, bool, bool) {
    let (mut e, mut kept, mut integer) = (e, true, false);
    loop {
        match e {
            Expr::Nested(inner) => e = inner,
            Expr::Cast {
                expr,
                data_type,
                format: None,
                ..
            } => {
                let (keeps, to_integer) = faithful(data_type);
                kept &= keeps;
                integer |= to_integer;
                e = expr;
            }
            Expr::Cast { expr, .. } => {
                kept = false;
                e = expr;
            }
            _ => return (e, kept, integer),
        }
    }
}

/// Whether a cast to `t` keeps the text of an organization's id as it reads (integers,
/// `text`, `varchar` and `numeric` without a length, `uuid`), and whether it is an integer
/// type (which rounds `8.4` to 8). `varchar(1)`, `char`, `bit(4)`, `float4` … change it:
/// `'81'::varchar(1)::bigint` is organization 8.
fn faithful(t: &sqlparser::ast::DataType) -> (bool, bool) {
    use sqlparser::ast::{DataType as T, ExactNumberInfo};
    match t {
        T::BigInt(None)
        | T::Int8(None)
        | T::Int(None)
        | T::Integer(None)
        | T::Int4(None)
        | T::SmallInt(None)
        | T::Int2(None) => (true, true),
        T::Text
        | T::Uuid
        | T::Varchar(None)
        | T::CharacterVarying(None)
        | T::Numeric(ExactNumberInfo::None)
        | T::Decimal(ExactNumberInfo::None) => (true, false),
        _ => (false, false),
    }
}

/// The outermost cast of `e` (brackets aside): what it casts, and to what type.
fn outer_cast(mut e: &Expr) -> Option<(&Expr, &sqlparser::ast::DataType)> {
    while let Expr::Nested(inner) = e {
        e = inner;
    }
    match e {
        Expr::Cast {
            expr, data_type, ..
        } => Some((expr, data_type)),
        _ => None,
    }
}

/// A constant or parameter value, cast only in ways that keep its text ([`faithful`]).
pub(super) fn constant(e: &Expr) -> Option<Org> {
    let (bare, kept, integer) = strip(e);
    let session = is_session_org(bare);
    if session || matches!(bare, Expr::Function(_)) {
        // The proxy writes one cast around these, to the organization column's type,
        // whatever it is (`character varying(64)`); any other must keep the value.
        let inside = outer_cast(e).map_or(e, |(inner, _)| inner);
        if !strip(inside).1 {
            return None;
        }
        if session {
            return Some(Org::Session);
        }
        return key_org(bare).map(|k| Org::Key(Arc::new(k)));
    }
    if !kept {
        return None;
    }
    let number = |n: &str, minus: &str, integer: bool| {
        // `0x10`, `1_000` (PostgreSQL 16) and `1e3` read otherwise: not followed.
        if !n.bytes().all(|b| b.is_ascii_digit() || b == b'.') {
            return None;
        }
        // `8.4::bigint` is 8.
        if integer && n.contains('.') {
            return None;
        }
        // `05` is 5 (an integer column; a text one has no `=` with a number).
        let n = match n.trim_start_matches('0') {
            "" => "0",
            t if t.starts_with('.') => n,
            t => t,
        };
        Some(Org::Literal(format!("{minus}{n}")))
    };
    match bare {
        Expr::Value(v) => match &v.value {
            Value::Number(n, _) => number(n, "", integer),
            Value::SingleQuotedString(s) => Some(Org::Literal(s.clone())),
            Value::Placeholder(p) => p
                .strip_prefix('$')
                .and_then(|n| n.parse().ok())
                .filter(|n| *n > 0)
                .map(Org::Param),
            _ => None,
        },
        Expr::UnaryOp {
            op: UnaryOperator::Minus,
            expr,
        } => match strip(expr) {
            (Expr::Value(v), true, inner_integer) => match &v.value {
                Value::Number(n, _) => number(n, "-", integer || inner_integer),
                _ => None,
            },
            _ => None,
        },
        _ => None,
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// The tests' catalog: `public.documents` and `public.document_versions`, organization
    /// column `organization_id` (`projects` is a cloud table).
    pub(crate) fn catalog() -> Catalog {
        let t = |name: &str| LokaTable {
            schema: "public".to_owned(),
            name: name.to_owned(),
            org_column: "organization_id".to_owned(),
        };
        Catalog::new(vec![t("documents"), t("document_versions")])
    }

    /// A core's metadata over [`catalog`], no organization.
    pub(crate) fn core_meta() -> super::super::meta::CoreMeta {
        use super::super::meta::{CoreMeta, Meta};
        CoreMeta::new(Arc::new(Meta {
            generation: 1,
            catalog: catalog(),
            orgs: HashMap::new(),
            writes: Vec::new(),
            direct_orgs: 0,
            owing_orgs: 0,
            set_normalized: true,
        }))
    }

    fn lit(s: &str) -> Org {
        Org::Literal(s.to_owned())
    }

    /// Statements Postgres runs only alone in their request are told apart (nothing of the
    /// proxy's may go ahead of them); a word in a literal or a quoted name does not count.
    #[test]
    fn statements_that_run_only_alone_are_told_apart() {
        let c = catalog();
        for sql in [
            "VACUUM documents",
            "/* maintenance */ vacuum (analyze) documents",
            "CREATE INDEX CONCURRENTLY documents_title ON documents (title)",
            "reindex table concurrently documents",
            "DROP INDEX CONCURRENTLY documents_title",
            "CREATE DATABASE documents",
        ] {
            assert_eq!(analyze(sql, &c), Analysis::Unplaced(RUNS_ALONE), "{sql}");
        }
        // Statements the walk does not see, so each reaches the check.
        for sql in [
            "CREATE INDEX documents_title ON documents (title)",
            "CREATE INDEX documents_title ON documents (title) WHERE title <> 'concurrently'",
            "CREATE INDEX \"concurrently\" ON documents (title)",
            "REFRESH MATERIALIZED VIEW CONCURRENTLY documents",
            "ANALYZE documents",
            "COPY documents FROM STDIN",
        ] {
            assert_ne!(analyze(sql, &c), Analysis::Unplaced(RUNS_ALONE), "{sql}");
        }
    }

    #[test]
    fn copy_of_a_whole_loka_table_out_is_found_and_nothing_else() {
        let c = catalog();
        let found = |sql: &str| copy_out_of_loka_table(sql, &c).map(|t| t.name.clone());
        assert_eq!(
            found("COPY documents TO STDOUT").as_deref(),
            Some("documents")
        );
        assert_eq!(
            found("copy public.Documents (id, title) to stdout with (format csv)").as_deref(),
            Some("documents")
        );
        assert_eq!(
            found("SELECT 1; COPY document_versions TO STDOUT").as_deref(),
            Some("document_versions")
        );
        assert_eq!(found("COPY documents FROM STDIN"), None);
        assert_eq!(
            found("COPY (SELECT * FROM documents WHERE organization_id = 2) TO STDOUT"),
            None
        );
        assert_eq!(found("COPY projects TO STDOUT"), None);
        assert_eq!(found("SELECT * FROM documents"), None);
        assert_eq!(
            found("COPY documents TO"),
            None,
            "does not parse: the cloud answers"
        );
    }

    /// Statement → expected organization (None: not placed, or no LokaDB table when
    /// `loka` is false).
    const CASES: &[(&str, Option<&str>, bool)] = &[
        ("SELECT 1", None, false),
        ("SELECT * FROM projects WHERE organization_id = 1", None, false),
        ("SELECT * FROM documents WHERE organization_id = 42", Some("42"), true),
        ("select * from Documents where ORGANIZATION_ID = '42'", Some("42"), true),
        ("SELECT * FROM public.documents WHERE organization_id = $1", Some("$1"), true),
        ("SELECT * FROM documents d WHERE d.organization_id = $2::bigint AND d.id = $1", Some("$2"), true),
        ("SELECT * FROM documents d WHERE (d.organization_id = CAST($1 AS int8))", Some("$1"), true),
        ("SELECT * FROM documents WHERE organization_id IN (7)", Some("7"), true),
        ("SELECT * FROM documents WHERE organization_id IN (7, 8)", None, true),
        ("SELECT * FROM documents WHERE 7 = (organization_id) AND id > 1", Some("7"), true),
        // A cast of the column may match several organizations' values ('7', '07' as int).
        ("SELECT * FROM documents WHERE organization_id::int = 7", None, true),
        ("SELECT * FROM documents d JOIN document_versions v ON v.organization_id::text = d.organization_id::text WHERE d.organization_id = 3", None, true),
        ("SELECT * FROM documents WHERE organization_id = 7 OR organization_id = 8", None, true),
        ("SELECT * FROM documents WHERE NOT (organization_id = 7)", None, true),
        ("SELECT * FROM documents WHERE id = 5", None, true),
        ("SELECT * FROM documents WHERE organization_id = 7 AND organization_id = 8", None, true),
        ("SELECT count(*) FROM documents", None, true),
        // Joins: each LokaDB reference needs the condition, directly or through an equality.
        ("SELECT * FROM documents d JOIN document_versions v ON v.document_id = d.id WHERE d.organization_id = 3", None, true),
        ("SELECT * FROM documents d JOIN document_versions v ON v.document_id = d.id AND v.organization_id = d.organization_id WHERE d.organization_id = 3", Some("3"), true),
        ("SELECT * FROM documents d, document_versions v WHERE v.organization_id = 3 AND d.organization_id = 3", Some("3"), true),
        ("SELECT * FROM documents d JOIN projects p ON p.id = d.project_id WHERE d.organization_id = $1 ORDER BY d.id DESC LIMIT 20", Some("$1"), true),
        ("SELECT * FROM projects p LEFT JOIN documents d ON d.project_id = p.id AND d.organization_id = 9", Some("9"), true),
        // Subqueries and CTEs: each level constrains its own references.
        ("SELECT * FROM projects WHERE id IN (SELECT project_id FROM documents WHERE organization_id = 4)", Some("4"), true),
        ("SELECT * FROM (SELECT * FROM documents WHERE organization_id = 4) x", Some("4"), true),
        ("WITH x AS (SELECT * FROM documents WHERE organization_id = 4) SELECT * FROM x", Some("4"), true),
        ("SELECT * FROM documents WHERE organization_id = 4 AND id IN (SELECT document_id FROM document_versions)", None, true),
        ("SELECT (SELECT count(*) FROM document_versions v WHERE v.organization_id = 5) FROM documents WHERE organization_id = 5", Some("5"), true),
        ("SELECT * FROM documents WHERE organization_id = 1 UNION ALL SELECT * FROM documents WHERE organization_id = 2", None, true),
        // INSERT, UPDATE, DELETE.
        ("INSERT INTO documents (id, organization_id, title) VALUES (1, 6, 'x')", Some("6"), true),
        ("INSERT INTO documents (organization_id, title) VALUES ($1, $2), ($1, $3)", Some("$1"), true),
        ("INSERT INTO documents (organization_id, title) VALUES (1, 'a'), (2, 'b')", None, true),
        ("INSERT INTO documents (title) VALUES ('a')", None, true),
        ("INSERT INTO documents SELECT * FROM documents WHERE organization_id = 1", None, true),
        ("UPDATE documents SET title = 'x' WHERE organization_id = 8 AND id = 1", Some("8"), true),
        ("UPDATE documents SET organization_id = 9 WHERE organization_id = 8", None, true),
        ("UPDATE documents d SET title = p.name FROM projects p WHERE p.id = d.project_id AND d.organization_id = $1", Some("$1"), true),
        ("DELETE FROM documents WHERE organization_id = '8' AND id = $1", Some("8"), true),
        ("DELETE FROM document_versions WHERE id = 3", None, true),
        // Multi-statement: all placed in one organization.
        ("BEGIN; UPDATE documents SET title = '' WHERE organization_id = 2; COMMIT", Some("2"), true),
        ("SELECT * FROM documents WHERE organization_id = 2; SELECT * FROM documents WHERE organization_id = 3", None, true),
        // Quoting: a quoted mixed-case name is another table.
        ("SELECT * FROM \"Documents\" WHERE organization_id = 1", None, false),
        ("SELECT * FROM \"documents\" WHERE \"organization_id\" = 1", Some("1"), true),
        // A name that only contains a LokaDB table's name.
        ("SELECT * FROM documents_archive WHERE organization_id = 1", None, false),
        ("SELEC broken documents", None, true),
    ];

    #[test]
    fn statements_route_as_the_table_says() {
        let c = catalog();
        for (sql, want, loka) in CASES {
            let got = analyze(sql, &c);
            match (want, loka) {
                (Some(w), _) => {
                    let org = match w.strip_prefix('$') {
                        Some(n) => Org::Param(n.parse().unwrap()),
                        None => lit(w),
                    };
                    assert!(
                        matches!(&got, Analysis::Org { org: o, .. } if *o == org),
                        "{sql}: {got:?}"
                    );
                }
                (None, true) => assert!(matches!(got, Analysis::Unplaced(_)), "{sql}: {got:?}"),
                (None, false) => assert_eq!(got, Analysis::NoLokaTable, "{sql}"),
            }
        }
    }

    /// Placing a statement by the analysis of its text without constants gives what its own
    /// analysis gives, and statements that differ only in values share that analysis.
    #[test]
    fn placing_without_constants_agrees_with_the_analysis() {
        use super::super::meta::Placement;
        let m = core_meta();
        let more = [
            "SELECT * FROM documents WHERE organization_id = 7 AND organization_id = 7",
            "SELECT * FROM documents WHERE organization_id = -7 AND id = 7",
            "SELECT * FROM documents WHERE organization_id = '7' AND title = 'O''Brien'",
            "SELECT * FROM documents WHERE organization_id = '-7'",
            "SELECT * FROM documents WHERE organization_id = 7 AND created > now() - interval '1 day'",
            "SELECT * FROM documents WHERE organization_id = E'7'",
            "SELECT * FROM documents WHERE organization_id = 7.5",
            "SELECT * FROM documents WHERE organization_id = current_setting('lokadb.org')",
            "UPDATE documents SET title = 'x' WHERE organization_id = 8 AND id = 3 -- 'y' 9",
        ];
        for sql in CASES.iter().map(|c| c.0).chain(more) {
            assert_eq!(
                m.place(sql),
                Placement::of(&analyze(sql, &m.meta.catalog)),
                "{sql}"
            );
        }
        let before = m.cached();
        for org in 100..110 {
            let sql = format!("SELECT * FROM documents WHERE organization_id = {org} AND id = 5");
            assert_eq!(m.place(&sql), Placement::Org(lit(&org.to_string())));
        }
        assert_eq!(m.cached(), before + 1, "one analysis for the ten texts");
    }

    /// Placed statements → whether the organization's database can answer them alone
    /// (the direct path).
    const READS: &[(&str, bool)] = &[
        ("SELECT * FROM documents WHERE organization_id = 2", true),
        ("SELECT d.title, count(*) FROM documents d JOIN document_versions v ON v.document_id = d.id AND v.organization_id = d.organization_id WHERE d.organization_id = $1 GROUP BY 1 ORDER BY 2 DESC LIMIT 20", true),
        ("SELECT * FROM (SELECT lower(title) FROM documents WHERE organization_id = 2) x", true),
        ("SELECT id FROM documents WHERE organization_id = 2 UNION SELECT document_id FROM document_versions WHERE organization_id = 2", true),
        ("SELECT COUNT(*), max(id) FROM public.documents WHERE organization_id = '2'", true),
        // A cloud table, a CTE, a locking clause, INTO, a write, a function of the cloud's.
        ("SELECT * FROM documents d JOIN projects p ON p.id = d.project_id WHERE d.organization_id = 2", false),
        ("WITH x AS (SELECT * FROM documents WHERE organization_id = 4) SELECT * FROM x", false),
        ("SELECT * FROM documents WHERE organization_id = 2 FOR UPDATE", false),
        ("SELECT * INTO copy_of FROM documents WHERE organization_id = 2", false),
        ("UPDATE documents SET title = 'x' WHERE organization_id = 2", false),
        ("DELETE FROM documents WHERE organization_id = 2", false),
        ("INSERT INTO documents (organization_id, title) VALUES (2, 'x')", false),
        ("SELECT my_func(id) FROM documents WHERE organization_id = 2", false),
        ("SELECT nextval('s') FROM documents WHERE organization_id = 2", false),
        ("SELECT set_config('a.b', 'c', false) FROM documents WHERE organization_id = 2", false),
        ("SELECT public.lower(title) FROM documents WHERE organization_id = 2", false),
        ("SELECT * FROM documents WHERE organization_id = 2 AND project_id IN (SELECT id FROM projects)", false),
        ("SELECT * FROM documents WHERE organization_id = 2; SELECT 1", false),
        ("COPY (SELECT * FROM documents WHERE organization_id = 2) TO STDOUT WITH (FORMAT csv)", true),
        ("COPY (SELECT * FROM documents d JOIN projects p ON p.id = d.project_id WHERE d.organization_id = 2) TO STDOUT", false),
        ("COPY (SELECT * FROM documents WHERE organization_id = 2) TO '/tmp/x'", false),
        // System columns: the organization's database has its own (item 5 of issue 22).
        ("SELECT tableoid::regclass, id FROM documents WHERE organization_id = 2", false),
        ("SELECT d.ctid FROM documents d WHERE d.organization_id = 2", false),
        ("SELECT id FROM documents WHERE organization_id = 2 AND public.documents.\"xmax\" = '0'", false),
        ("SELECT id FROM documents WHERE organization_id = 2 ORDER BY XMIN", false),
        ("SELECT count(*) FROM documents WHERE organization_id = 2 GROUP BY cmin HAVING max(cmax) > '0'", false),
        ("SELECT * FROM (SELECT id, xmin FROM documents WHERE organization_id = 2) x", false),
        ("COPY (SELECT ctid FROM documents WHERE organization_id = 2) TO STDOUT", false),
        // Not system columns: a quoted name of another case, a longer name, a string.
        ("SELECT \"XMIN\", xmin_id, 'ctid' FROM documents WHERE organization_id = 2", true),
    ];

    /// Placed statements → the columns a plain UPDATE sets (None: not one).
    const UPDATES: &[(&str, Option<&[&str]>)] = &[
        ("UPDATE document_versions SET body = 'x' WHERE organization_id = 2 AND id = 5", Some(&["body"])),
        ("UPDATE documents SET title = $3, \"Project_Id\" = 1 WHERE organization_id = $1 AND id = $2", Some(&["title", "Project_Id"])),
        ("UPDATE documents d SET title = upper(d.title) WHERE d.organization_id = 2 RETURNING id", Some(&["title"])),
        ("UPDATE documents SET title = 'x' FROM projects p WHERE documents.organization_id = 2 AND p.id = documents.project_id", None),
        ("UPDATE documents SET title = (SELECT name FROM projects LIMIT 1) WHERE organization_id = 2", None),
        ("UPDATE documents SET title = my_func(title) WHERE organization_id = 2", None),
        ("UPDATE documents SET (title, project_id) = ('x', 1) WHERE organization_id = 2", None),
        ("DELETE FROM documents WHERE organization_id = 2 AND id = 1", None),
        ("SELECT * FROM documents WHERE organization_id = 2", None),
        // System columns, in RETURNING or anywhere: the cloud answers.
        ("UPDATE documents SET title = 'x' WHERE organization_id = 2 AND id = 5 RETURNING ctid", None),
        ("UPDATE documents d SET title = 'x' WHERE d.organization_id = 2 AND d.xmin = '5'", None),
        ("UPDATE documents SET title = tableoid::regclass::text WHERE organization_id = 2", None),
    ];

    #[test]
    fn plain_updates_give_the_columns_they_set() {
        let c = catalog();
        for (sql, want) in UPDATES {
            let got = match analyze(sql, &c) {
                Analysis::Org { set, .. } => set,
                other => panic!("{sql}: {other:?}"),
            };
            let want = want.map(|w| w.iter().map(|s| s.to_string()).collect::<Vec<_>>());
            assert_eq!(got, want, "{sql}");
        }
    }

    #[test]
    fn plain_reads_of_one_organization_are_told_apart() {
        let c = catalog();
        for (sql, want) in READS {
            match analyze(sql, &c) {
                Analysis::Org { read, .. } => assert_eq!(read, *want, "{sql}"),
                other => assert!(!want, "{sql}: {other:?}"),
            }
        }
    }

    #[test]
    fn the_fast_path_skips_statements_without_a_loka_table_name() {
        let c = catalog();
        assert!(!c.may_touch("SELECT * FROM projects"));
        assert!(c.may_touch("select * from DOCUMENTS"));
        assert!(!Catalog::new(vec![]).may_touch("SELECT * FROM documents"));
    }

    #[test]
    fn a_name_in_several_schemas_is_public_s_or_not_placed() {
        let t = |schema: &str, name: &str| LokaTable {
            schema: schema.to_owned(),
            name: name.to_owned(),
            org_column: "organization_id".to_owned(),
        };
        // Loaded in either order, the unqualified name is public's (the default path).
        for tables in [
            vec![t("s", "notes"), t("public", "notes")],
            vec![t("public", "notes"), t("s", "notes")],
        ] {
            let c = Catalog::new(tables);
            let public = c.tables().iter().position(|t| t.schema == "public");
            assert_eq!(c.unqualified("notes"), public);
            match analyze("SELECT * FROM notes WHERE organization_id = 1", &c) {
                Analysis::Org { tables, .. } => assert_eq!(Some(tables[0]), public),
                other => panic!("{other:?}"),
            }
        }
        // Neither in public: which one depends on the session's search_path.
        let c = Catalog::new(vec![t("a", "notes"), t("b", "notes"), t("a", "tasks")]);
        assert_eq!(c.unqualified("notes"), None);
        assert!(matches!(
            analyze("SELECT * FROM notes WHERE organization_id = 1", &c),
            Analysis::Unplaced(why) if why.contains("several schemas")
        ));
        assert!(matches!(
            analyze("SELECT * FROM b.notes WHERE organization_id = 1", &c),
            Analysis::Org { ref tables, .. } if tables == &[1]
        ));
        assert!(matches!(
            analyze("SELECT * FROM tasks WHERE organization_id = 1", &c),
            Analysis::Org { ref tables, .. } if tables == &[2]
        ));
    }
}
