//! Differential: generated statements and transactions run through the proxy and straight at
//! the cloud, with the same answers (rows, row counts, SQLSTATEs of errors) and the same final
//! rows in every table (issue 22, "Tests").
//!
//! One world: a cloud with table `notes` (a LokaDB table, key map on `id`, a foreign key to the
//! cloud table `organizations`), the cloud-only tables `organizations`, `tags` and `s.notes`
//! (a table named like the LokaDB table in another schema, for `search_path`), and three
//! organizations: 1 in the cloud, 2 moved with fdw+direct, 3 moved with fdw. Each case (a short
//! sequence of statements, transactions with savepoints, session changes and simple-protocol
//! batches; see [`step`]) runs twice from the same data: through the proxy, then straight at the
//! cloud (the reference). The data are reset through the cloud before each run, the sequence
//! included, so both runs start from the same rows.
//!
//! Cases come from proptest, with a fixed seed and [`DEFAULT_CASES`] cases; a failing case is
//! shrunk to a minimal one, printed with the statements in order. `LOKADB_DIFF_CASES` (how
//! many) and `LOKADB_DIFF_SEED` (a number) run more or others (`docs/testing.md`).
//!
//! Shapes the generator stays away from, with the reason, are marked `Known limit` below.

use crate::admin_cli::{lokadb, ok};
use crate::tunnel_world::{moved_world, MovedWorld};
use bytes::BytesMut;
use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestCaseError, TestRng, TestRunner};
use std::collections::HashMap;
use std::fmt;
use std::time::{Duration, Instant};
use tokio_postgres::types::{to_sql_checked, Format, IsNull, ToSql, Type};
use tokio_postgres::SimpleQueryMessage;

/// Cases per run in CI (the seed fixed): about 30 s on two cores, once the world is up.
const DEFAULT_CASES: u32 = 200;
/// The fixed seed's bytes (`LOKADB_DIFF_SEED` replaces them with a number's).
const DEFAULT_SEED: u64 = 22;

const SCHEMA: &str = "
CREATE TABLE organizations (id bigint PRIMARY KEY, name text NOT NULL);
INSERT INTO organizations VALUES (1, 'cloud'), (2, 'direct'), (3, 'fdw'), (4, 'empty');
CREATE TABLE notes (
    id bigserial PRIMARY KEY,
    organization_id bigint NOT NULL REFERENCES organizations,
    body text,
    n int NOT NULL DEFAULT 0);
CREATE TABLE tags (id int PRIMARY KEY, label text);
CREATE SCHEMA s;
CREATE TABLE s.notes (id bigint, organization_id bigint, body text, n int);
";

/// The rows every run starts from: four notes per organization 1–3 (ids 11–14, 21–24,
/// 31–34), two tags, one row in `s.notes`, the sequence at 100.
const RESET: &str = "
BEGIN;
DELETE FROM public.notes;
INSERT INTO public.notes (id, organization_id, body, n)
  SELECT o * 10 + k, o, 'o' || o || 'n' || k, k FROM generate_series(1, 3) o, generate_series(1, 4) k;
DELETE FROM tags;
INSERT INTO tags VALUES (1, 'one'), (2, 'two');
DELETE FROM s.notes;
INSERT INTO s.notes VALUES (21, 2, 's', 1);
SELECT setval(pg_get_serial_sequence('public.notes', 'id'), 100);
COMMIT;
";

/// Every table's rows, in one text.
const SNAPSHOT: &[&str] = &[
    "SELECT id, organization_id, body, n FROM public.notes ORDER BY id",
    "SELECT id, label FROM tags ORDER BY id",
    "SELECT id, organization_id, body, n FROM s.notes ORDER BY id, body",
    "SELECT id, name FROM organizations ORDER BY id",
];

type DiffWorld = MovedWorld;

fn diff_world() -> DiffWorld {
    moved_world(
        |cloud| {
            cloud.create_database("app", "postgres").unwrap();
            ok(&lokadb(&cloud.superuser_dsn("app"), &["init"]));
            cloud.psql("app", SCHEMA).unwrap();
            cloud.psql("app", RESET).unwrap();
        },
        &["notes"],
    )
}

// ---------------------------------------------------------------------------------------
// The grammar.

/// How an organization id is written as a literal.
#[derive(Clone, Copy, Debug)]
enum Spell {
    /// `2`
    Bare,
    /// `'2'`
    Quoted,
    /// `2::bigint`
    Cast,
    /// `CAST('2' AS bigint)`
    CastQuoted,
}

/// A value of a statement: a literal in its text, or a parameter.
#[derive(Clone, Debug)]
enum V {
    Org(i64, Spell),
    Key(i64),
    Int(i32),
    Text(String),
}

#[derive(Clone, Debug)]
enum Part {
    S(String),
    V(V),
}

/// A statement's text with its values apart.
#[derive(Clone, Debug, Default)]
struct Tpl(Vec<Part>);

impl Tpl {
    fn s(mut self, s: &str) -> Tpl {
        self.0.push(Part::S(s.to_owned()));
        self
    }
    fn v(mut self, v: V) -> Tpl {
        self.0.push(Part::V(v));
        self
    }
    fn cat(mut self, other: Tpl) -> Tpl {
        self.0.extend(other.0);
        self
    }
    fn has_values(&self) -> bool {
        self.0.iter().any(|p| matches!(p, Part::V(_)))
    }
}

fn t(s: &str) -> Tpl {
    Tpl::default().s(s)
}

/// How a statement is sent.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Proto {
    /// A simple Query, values as literals.
    Simple,
    /// Parse (unnamed, parameter types declared), Bind, Execute, Sync (`query_typed`).
    Unnamed,
    /// A named prepared statement, kept for the session and bound again when the same text
    /// comes back; `declared`: its parameter types given in the Parse, else left to the server.
    Prepared { declared: bool },
}

/// How values of an extended-protocol statement are bound.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Bind {
    /// Written into the text.
    Literal,
    /// Parameters in binary, each of its column's type.
    Binary,
    /// Parameters in text format (an organization id sometimes `' 02'`).
    Text,
    /// The organization id a binary `text` parameter cast to bigint, the rest in binary.
    OrgAsText,
}

#[derive(Clone)]
struct Stmt {
    tpl: Tpl,
    proto: Proto,
    bind: Bind,
}

impl fmt::Debug for Stmt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (sql, params) = self.render();
        write!(f, "{:?}/{:?} {sql}", self.proto, self.bind)?;
        if !params.is_empty() {
            let shown: Vec<String> = params.iter().map(|p| p.shown()).collect();
            write!(f, "  -- [{}]", shown.join(", "))?;
        }
        Ok(())
    }
}

/// A bound parameter.
#[derive(Clone, Debug)]
enum P {
    I64(i64),
    I32(i32),
    Str(String),
    /// Text format, declared as `ty`.
    TextFmt(TextParam, Type),
}

impl P {
    fn ty(&self) -> Type {
        match self {
            P::I64(_) => Type::INT8,
            P::I32(_) => Type::INT4,
            P::Str(_) => Type::TEXT,
            P::TextFmt(_, ty) => ty.clone(),
        }
    }
    fn shown(&self) -> String {
        match self {
            P::I64(v) => format!("{v}::int8"),
            P::I32(v) => format!("{v}::int4"),
            P::Str(v) => format!("{v:?}::text(binary)"),
            P::TextFmt(v, ty) => format!("{:?}::{}(text format)", v.0, ty.name()),
        }
    }
    fn sql(&self) -> &(dyn ToSql + Sync) {
        match self {
            P::I64(v) => v,
            P::I32(v) => v,
            P::Str(v) => v,
            P::TextFmt(v, _) => v,
        }
    }
}

/// A parameter sent in text format.
#[derive(Clone, Debug)]
struct TextParam(String);

impl ToSql for TextParam {
    fn to_sql(
        &self,
        _ty: &Type,
        out: &mut BytesMut,
    ) -> Result<IsNull, Box<dyn std::error::Error + Sync + Send>> {
        out.extend_from_slice(self.0.as_bytes());
        Ok(IsNull::No)
    }
    fn accepts(_ty: &Type) -> bool {
        true
    }
    fn encode_format(&self, _ty: &Type) -> Format {
        Format::Text
    }
    to_sql_checked!();
}

impl Stmt {
    /// The text sent and its parameters.
    fn render(&self) -> (String, Vec<P>) {
        let mut sql = String::new();
        let mut params = Vec::new();
        let declared = !matches!(self.proto, Proto::Prepared { declared: false });
        for part in &self.tpl.0 {
            let v = match part {
                Part::S(s) => {
                    sql.push_str(s);
                    continue;
                }
                Part::V(v) => v,
            };
            if self.bind == Bind::Literal {
                sql.push_str(&match v {
                    V::Org(o, Spell::Bare) => o.to_string(),
                    V::Org(o, Spell::Quoted) => format!("'{o}'"),
                    V::Org(o, Spell::Cast) => format!("{o}::bigint"),
                    V::Org(o, Spell::CastQuoted) => format!("CAST('{o}' AS bigint)"),
                    V::Key(k) => k.to_string(),
                    V::Int(i) => i.to_string(),
                    V::Text(s) => format!("'{s}'"),
                });
                continue;
            }
            let n = params.len() + 1;
            let (text, p) = match (self.bind, v) {
                (Bind::OrgAsText, V::Org(o, _)) if declared => {
                    (format!("${n}::bigint"), P::Str(o.to_string()))
                }
                (Bind::OrgAsText, V::Org(o, _)) => {
                    (format!("${n}::text::bigint"), P::Str(o.to_string()))
                }
                (Bind::Text, V::Org(o, Spell::Bare)) => (
                    format!("${n}"),
                    P::TextFmt(TextParam(o.to_string()), Type::INT8),
                ),
                (Bind::Text, V::Org(o, _)) => (
                    format!("${n}"),
                    P::TextFmt(TextParam(format!(" 0{o}")), Type::INT8),
                ),
                (Bind::Text, V::Key(k)) => (
                    format!("${n}"),
                    P::TextFmt(TextParam(k.to_string()), Type::INT8),
                ),
                (Bind::Text, V::Int(i)) => (
                    format!("${n}"),
                    P::TextFmt(TextParam(i.to_string()), Type::INT4),
                ),
                (Bind::Text, V::Text(s)) => (
                    format!("${n}"),
                    P::TextFmt(TextParam(s.clone()), Type::TEXT),
                ),
                (_, V::Org(o, _)) | (_, V::Key(o)) => (format!("${n}"), P::I64(*o)),
                (_, V::Int(i)) => (format!("${n}"), P::I32(*i)),
                (_, V::Text(s)) => (format!("${n}"), P::Str(s.clone())),
            };
            sql.push_str(&text);
            params.push(p);
        }
        (sql, params)
    }
}

/// One step of a case: a statement, a transaction, or a simple-protocol batch.
#[derive(Clone, Debug)]
enum Step {
    One(Stmt),
    Tx {
        begin: Stmt,
        body: Vec<Stmt>,
        end: Stmt,
    },
    /// Several statements in one simple Query.
    Batch(Vec<String>),
}

impl Step {
    fn stmts(&self) -> Vec<Stmt> {
        match self {
            Step::One(s) => vec![s.clone()],
            Step::Tx { begin, body, end } => {
                let mut v = vec![begin.clone()];
                v.extend(body.iter().cloned());
                v.push(end.clone());
                v
            }
            Step::Batch(sqls) => vec![Stmt {
                tpl: t(&sqls.join("; ")),
                proto: Proto::Simple,
                bind: Bind::Literal,
            }],
        }
    }
}

fn org() -> impl Strategy<Value = i64> {
    prop_oneof![2 => Just(1i64), 4 => Just(2), 2 => Just(3)]
}

fn org_v() -> impl Strategy<Value = V> {
    let spell = prop_oneof![
        3 => Just(Spell::Bare),
        1 => Just(Spell::Quoted),
        1 => Just(Spell::Cast),
        1 => Just(Spell::CastQuoted),
    ];
    (org(), spell).prop_map(|(o, s)| V::Org(o, s))
}

/// A note's id: one of the initial rows, one inserted in the case (101, 102), or none.
fn key() -> impl Strategy<Value = i64> {
    prop_oneof![
        6 => (1i64..=3, 1i64..=4).prop_map(|(o, k)| o * 10 + k),
        1 => Just(101i64),
        1 => Just(99i64),
    ]
}

fn int() -> impl Strategy<Value = i32> {
    0i32..=5
}

fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("x".to_owned()),
        Just("o2n1".to_owned()),
        Just("o%".to_owned()),
        Just("o2%".to_owned()),
        Just("new".to_owned()),
    ]
}

/// A condition on `notes` (`q`: its qualifier, `x.` or nothing), in every shape the proxy
/// places, and some it does not.
fn cond(q: &'static str) -> impl Strategy<Value = Tpl> {
    let oc = format!("{q}organization_id");
    let oc = Box::leak(oc.into_boxed_str()) as &'static str;
    prop_oneof![
        4 => org_v().prop_map(move |o| t(oc).s(" = ").v(o)),
        1 => org_v().prop_map(move |o| Tpl::default().v(o).s(" = ").s(oc)),
        1 => org_v().prop_map(move |o| t(oc).s(" IN (").v(o).s(")")),
        1 => (org_v(), org_v()).prop_map(move |(a, b)| t(oc).s(" IN (").v(a).s(", ").v(b).s(")")),
        2 => (org_v(), int()).prop_map(move |(o, i)| t(oc).s(" = ").v(o).s(&format!(" AND {q}n >= ")).v(V::Int(i))),
        2 => (org_v(), key()).prop_map(move |(o, k)| t(oc).s(" = ").v(o).s(&format!(" AND {q}id = ")).v(V::Key(k))),
        1 => (org_v(), org_v()).prop_map(move |(a, b)| t("(").s(oc).s(" = ").v(a).s(" OR ").s(oc).s(" = ").v(b).s(")")),
        1 => (org_v(), org_v()).prop_map(move |(a, b)| t(oc).s(" BETWEEN ").v(a).s(" AND ").v(b)),
        1 => int().prop_map(move |i| t(&format!("{q}n >= ")).v(V::Int(i))),
        1 => (org_v(), text()).prop_map(move |(o, s)| t(oc).s(" = ").v(o).s(&format!(" AND {q}body LIKE ")).v(V::Text(s))),
        1 => org_v().prop_map(move |o| t("NOT (").s(oc).s(" <> ").v(o).s(")")),
        1 => (org_v(), int(), text()).prop_map(move |(o, i, s)| t(oc).s(" = ").v(o)
            .s(&format!(" AND ({q}n = ")).v(V::Int(i)).s(&format!(" OR {q}body = ")).v(V::Text(s)).s(")")),
    ]
}

/// A read.
fn read() -> impl Strategy<Value = Tpl> {
    prop_oneof![
        4 => (cond(""), any::<bool>()).prop_map(|(c, ordered)| {
            let tpl = t("SELECT id, body, n FROM notes WHERE ").cat(c);
            if ordered { tpl.s(" ORDER BY id") } else { tpl }
        }),
        2 => cond("").prop_map(|c| t("SELECT count(*), coalesce(sum(n), 0) FROM notes WHERE ").cat(c)),
        1 => cond("").prop_map(|c| t("SELECT count(*) FROM public.notes WHERE ").cat(c)),
        2 => cond("x.").prop_map(|c| t("SELECT x.id, x.body FROM notes x WHERE ").cat(c)),
        // Key lookups: the key's organization from the key map.
        3 => key().prop_map(|k| t("SELECT organization_id, body, n FROM notes WHERE id = ").v(V::Key(k))),
        1 => key().prop_map(|k| t("SELECT x.body FROM notes x WHERE x.id = ").v(V::Key(k)).s(" AND x.n >= 0")),
        // Subqueries and joins across organizations.
        2 => (org_v(), org_v()).prop_map(|(a, b)| t("SELECT count(*) FROM notes WHERE organization_id = ").v(a)
            .s(" AND n IN (SELECT n FROM notes WHERE organization_id = ").v(b).s(")")),
        2 => (org_v(), org_v()).prop_map(|(a, b)| t("SELECT a.id, b.id FROM notes a JOIN notes b ON a.n = b.n WHERE a.organization_id = ").v(a)
            .s(" AND b.organization_id = ").v(b)),
        1 => (org_v(), int()).prop_map(|(o, i)| t("SELECT EXISTS (SELECT 1 FROM notes WHERE organization_id = ").v(o).s(" AND n = ").v(V::Int(i)).s(")")),
        1 => (org_v(), org_v()).prop_map(|(a, b)| t("SELECT id FROM notes WHERE organization_id = ").v(a)
            .s(" UNION ALL SELECT id FROM notes WHERE organization_id = ").v(b)),
        // Joins with cloud tables (the rewritten feed, a LEFT JOIN).
        2 => (org_v(), 1i64..=3).prop_map(|(o, lim)| t("SELECT x.id, x.body, o.name FROM notes x JOIN organizations o ON o.id = x.organization_id WHERE x.organization_id = ")
            .v(o).s(&format!(" ORDER BY x.id DESC LIMIT {lim}"))),
        1 => org_v().prop_map(|o| t("SELECT x.id, t.label FROM notes x LEFT JOIN tags t ON t.id = x.n WHERE x.organization_id = ").v(o)),
        // Cloud tables alone.
        1 => Just(t("SELECT id, label FROM tags ORDER BY id")),
        1 => Just(t("SELECT count(*) FROM s.notes")),
        // A locking read.
        1 => (org_v(), key()).prop_map(|(o, k)| t("SELECT id FROM notes WHERE organization_id = ").v(o).s(" AND id = ").v(V::Key(k)).s(" FOR UPDATE")),
        // Errors: division by zero (when a row matches), an unknown column.
        1 => org_v().prop_map(|o| t("SELECT n / 0 FROM notes WHERE organization_id = ").v(o)),
        1 => org_v().prop_map(|o| t("SELECT nope FROM notes WHERE organization_id = ").v(o)),
    ]
}

/// A write.
fn write() -> impl Strategy<Value = Tpl> {
    prop_oneof![
        3 => (text(), cond("")).prop_map(|(s, c)| t("UPDATE notes SET body = ").v(V::Text(s)).s(" WHERE ").cat(c)),
        2 => cond("").prop_map(|c| t("UPDATE notes SET n = n + 1 WHERE ").cat(c)),
        2 => (text(), org_v(), key()).prop_map(|(s, o, k)| t("UPDATE notes SET body = ").v(V::Text(s))
            .s(" WHERE organization_id = ").v(o).s(" AND id = ").v(V::Key(k)).s(" RETURNING id, body, n")),
        // By key alone (placed by the key map, through the cloud).
        1 => key().prop_map(|k| t("UPDATE notes SET n = n + 10 WHERE id = ").v(V::Key(k))),
        1 => (org_v(), key()).prop_map(|(o, k)| t("UPDATE notes SET n = n / 0 WHERE organization_id = ").v(o).s(" AND id = ").v(V::Key(k))),
        3 => (org_v(), text(), int()).prop_map(|(o, s, i)| t("INSERT INTO notes (organization_id, body, n) VALUES (").v(o)
            .s(", ").v(V::Text(s)).s(", ").v(V::Int(i)).s(") RETURNING id, organization_id")),
        // An explicit id: a key another row may have (23505), or an organization that has
        // no row in `organizations` (23503).
        1 => (key(), org_v()).prop_map(|(k, o)| t("INSERT INTO notes (id, organization_id, body) VALUES (").v(V::Key(k))
            .s(", ").v(o).s(", 'explicit')")),
        1 => Just(t("INSERT INTO notes (organization_id, body) VALUES (5, 'no such organization')")),
        2 => (org_v(), key()).prop_map(|(o, k)| t("DELETE FROM notes WHERE organization_id = ").v(o).s(" AND id = ").v(V::Key(k))),
        1 => key().prop_map(|k| t("DELETE FROM notes WHERE id = ").v(V::Key(k))),
        1 => (org_v(), org_v()).prop_map(|(a, b)| t("INSERT INTO notes (organization_id, body, n) SELECT ").v(a)
            .s(", body, n FROM notes WHERE organization_id = ").v(b).s(" AND n = 1 ORDER BY id RETURNING organization_id, body")),
        // (Ordered: the rows take the sequence's values in the order they are inserted.)
        // Cloud tables.
        1 => (int(), text()).prop_map(|(i, s)| t("INSERT INTO tags VALUES (").v(V::Int(i)).s(", ").v(V::Text(s))
            .s(") ON CONFLICT (id) DO UPDATE SET label = excluded.label")),
        1 => (text(), int()).prop_map(|(s, i)| t("UPDATE tags SET label = ").v(V::Text(s)).s(" WHERE id = ").v(V::Int(i))),
    ]
}

/// Session changes: a temporary table named like the LokaDB table, search_path.
fn session() -> impl Strategy<Value = Tpl> {
    prop_oneof![
        1 => Just(t("CREATE TEMP TABLE notes (id bigint, organization_id bigint, body text, n int)")),
        1 => Just(t("CREATE TEMP TABLE IF NOT EXISTS notes (id bigint, organization_id bigint, body text, n int) ON COMMIT PRESERVE ROWS")),
        2 => Just(t("SET search_path = s, public")),
        1 => Just(t("SET search_path = public")),
        1 => Just(t("RESET search_path")),
        1 => Just(t("SELECT set_config('search_path', 's, public', false)")),
    ]
}

fn proto() -> impl Strategy<Value = Proto> {
    prop_oneof![
        3 => Just(Proto::Simple),
        2 => Just(Proto::Unnamed),
        2 => Just(Proto::Prepared { declared: false }),
        1 => Just(Proto::Prepared { declared: true }),
    ]
}

fn bind() -> impl Strategy<Value = Bind> {
    prop_oneof![
        1 => Just(Bind::Literal),
        3 => Just(Bind::Binary),
        2 => Just(Bind::Text),
        1 => Just(Bind::OrgAsText),
    ]
}

fn stmt(tpl: impl Strategy<Value = Tpl>) -> impl Strategy<Value = Stmt> {
    (tpl, proto(), bind()).prop_map(|(tpl, proto, bind)| {
        let bind = if proto == Proto::Simple || !tpl.has_values() {
            Bind::Literal
        } else {
            bind
        };
        Stmt { tpl, proto, bind }
    })
}

/// A statement without values (BEGIN, COMMIT, SAVEPOINT …), in either protocol.
fn control(sql: &'static str) -> impl Strategy<Value = Stmt> {
    prop_oneof![4 => Just(Proto::Simple), 1 => Just(Proto::Unnamed)].prop_map(move |proto| Stmt {
        tpl: t(sql),
        proto,
        bind: Bind::Literal,
    })
}

fn dml() -> impl Strategy<Value = Tpl> {
    prop_oneof![3 => read(), 2 => write()]
}

fn in_tx() -> impl Strategy<Value = Stmt> {
    prop_oneof![
        8 => stmt(dml()),
        1 => control("SAVEPOINT a"),
        1 => control("ROLLBACK TO SAVEPOINT a"),
        1 => control("RELEASE SAVEPOINT a"),
        1 => stmt(session()),
    ]
}

/// A statement that opens a direct transaction in organization 2 (fdw+direct): a plain read,
/// or a plain UPDATE of a column the cloud keeps no constraint on. What follows it in the
/// transaction may need the cloud, which moves the transaction there.
fn direct_opener() -> impl Strategy<Value = Stmt> {
    let org2 = prop_oneof![
        3 => Just(Spell::Bare),
        1 => Just(Spell::Quoted),
        1 => Just(Spell::CastQuoted),
    ]
    .prop_map(|s| V::Org(2, s));
    let key2 = (21i64..=24).prop_map(V::Key);
    stmt(prop_oneof![
        3 => (text(), org2.clone(), key2.clone()).prop_map(|(s, o, k)| t("UPDATE notes SET body = ").v(V::Text(s))
            .s(" WHERE organization_id = ").v(o).s(" AND id = ").v(k)),
        1 => (org2.clone(), key2).prop_map(|(o, k)| t("UPDATE notes SET n = n + 1 WHERE organization_id = ").v(o)
            .s(" AND id = ").v(k).s(" RETURNING n")),
        2 => (org2, int()).prop_map(|(o, i)| t("SELECT id, body FROM notes WHERE organization_id = ").v(o)
            .s(" AND n >= ").v(V::Int(i)).s(" ORDER BY id")),
    ])
}

fn step() -> impl Strategy<Value = Step> {
    let begin = prop_oneof![
        6 => control("BEGIN"),
        1 => control("START TRANSACTION"),
        1 => control("BEGIN ISOLATION LEVEL REPEATABLE READ"),
        1 => control("BEGIN READ ONLY"),
    ];
    let end = prop_oneof![
        3 => control("COMMIT"),
        1 => control("ROLLBACK"),
        1 => control("END"),
    ];
    let literal = |tpl: Tpl| {
        Stmt {
            tpl,
            proto: Proto::Simple,
            bind: Bind::Literal,
        }
        .render()
        .0
    };
    let batch = (any::<bool>(), proptest::collection::vec(dml(), 2..=3)).prop_map(
        move |(wrapped, tpls)| {
            let mut sqls: Vec<String> = tpls.into_iter().map(literal).collect();
            if wrapped {
                sqls.insert(0, "BEGIN".into());
                sqls.push("COMMIT".into());
            }
            Step::Batch(sqls)
        },
    );
    prop_oneof![
        5 => stmt(read()).prop_map(Step::One),
        3 => stmt(write()).prop_map(Step::One),
        3 => (begin.clone(), proptest::collection::vec(in_tx(), 1..=5), end.clone())
            .prop_map(|(begin, body, end)| Step::Tx { begin, body, end }),
        3 => (control("BEGIN"), direct_opener(), proptest::collection::vec(in_tx(), 0..=4), end)
            .prop_map(|(begin, first, rest, end)| {
                let body = std::iter::once(first).chain(rest).collect();
                Step::Tx { begin, body, end }
            }),
        1 => stmt(session()).prop_map(Step::One),
        1 => batch,
    ]
}

fn case() -> impl Strategy<Value = Vec<Step>> {
    proptest::collection::vec(step(), 1..=6)
}

// ---------------------------------------------------------------------------------------
// Running a case.

/// What one statement gave the client.
#[derive(Debug, PartialEq)]
enum Outcome {
    /// Each result's rows (as text, sorted unless the statement orders them) and the row
    /// count of its command tag.
    Ok(Vec<(Vec<String>, u64)>),
    /// The SQLSTATE.
    Err(String),
}

fn err(e: tokio_postgres::Error) -> Outcome {
    match e.code() {
        Some(c) => Outcome::Err(c.code().to_owned()),
        None => Outcome::Err(format!("no SQLSTATE: {e}")),
    }
}

fn row_text(row: &tokio_postgres::Row) -> String {
    let cols: Vec<String> = (0..row.len())
        .map(|i| {
            let ty = row.columns()[i].type_();
            let v: Option<String> = match *ty {
                Type::INT8 => row.get::<_, Option<i64>>(i).map(|v| v.to_string()),
                Type::INT4 => row.get::<_, Option<i32>>(i).map(|v| v.to_string()),
                Type::INT2 => row.get::<_, Option<i16>>(i).map(|v| v.to_string()),
                Type::BOOL => row
                    .get::<_, Option<bool>>(i)
                    .map(|v| if v { "t" } else { "f" }.to_owned()),
                Type::TEXT | Type::VARCHAR | Type::NAME => row.get::<_, Option<String>>(i),
                ref other => Some(format!("<type {other}>")),
            };
            v.unwrap_or_else(|| "NULL".to_owned())
        })
        .collect();
    cols.join("|")
}

/// A session of a run: its client, its connection's task, its prepared statements.
struct Session {
    client: tokio_postgres::Client,
    conn: tokio::task::JoinHandle<()>,
    prepared: HashMap<(String, Vec<Type>), tokio_postgres::Statement>,
}

impl Session {
    async fn connect(dsn: &str) -> Session {
        let (client, conn) = tokio_postgres::connect(dsn, tokio_postgres::NoTls)
            .await
            .unwrap();
        let conn = tokio::spawn(async move {
            let _ = conn.await;
        });
        Session {
            client,
            conn,
            prepared: HashMap::new(),
        }
    }

    /// Ends the session and waits until its connection is closed.
    async fn close(self) {
        drop(self.client);
        let _ = self.conn.await;
    }

    async fn run(&mut self, stmt: &Stmt) -> Outcome {
        let (sql, params) = stmt.render();
        let mut out = match stmt.proto {
            Proto::Simple => match self.client.simple_query(&sql).await {
                Err(e) => return err(e),
                Ok(msgs) => {
                    let mut sets = Vec::new();
                    let mut rows = Vec::new();
                    for m in msgs {
                        match m {
                            SimpleQueryMessage::Row(r) => rows.push(
                                (0..r.len())
                                    .map(|i| r.get(i).unwrap_or("NULL").to_owned())
                                    .collect::<Vec<_>>()
                                    .join("|"),
                            ),
                            SimpleQueryMessage::CommandComplete(n) => {
                                sets.push((std::mem::take(&mut rows), n))
                            }
                            _ => {}
                        }
                    }
                    sets
                }
            },
            Proto::Unnamed => {
                let typed: Vec<(&(dyn ToSql + Sync), Type)> =
                    params.iter().map(|p| (p.sql(), p.ty())).collect();
                match self.client.query_typed_raw(&sql, typed).await {
                    Err(e) => return err(e),
                    Ok(stream) => match collect(stream).await {
                        Ok(set) => vec![set],
                        Err(e) => return err(e),
                    },
                }
            }
            Proto::Prepared { declared } => {
                let types: Vec<Type> = if declared {
                    params.iter().map(P::ty).collect()
                } else {
                    Vec::new()
                };
                let key = (sql.clone(), types);
                let prepared = match self.prepared.get(&key) {
                    Some(s) => s.clone(),
                    None => match self.client.prepare_typed(&sql, &key.1).await {
                        Err(e) => return err(e),
                        Ok(s) => {
                            self.prepared.insert(key, s.clone());
                            s
                        }
                    },
                };
                let values: Vec<&(dyn ToSql + Sync)> = params.iter().map(P::sql).collect();
                match self.client.query_raw(&prepared, values).await {
                    Err(e) => return err(e),
                    Ok(stream) => match collect(stream).await {
                        Ok(set) => vec![set],
                        Err(e) => return err(e),
                    },
                }
            }
        };
        // Each result's statement (a batch's are joined by "; "): rows sorted unless it
        // orders them.
        let parts: Vec<&str> = sql.split("; ").collect();
        for (i, (rows, _)) in out.iter_mut().enumerate() {
            if !parts.get(i).unwrap_or(&"").contains("ORDER BY") {
                rows.sort();
            }
        }
        Outcome::Ok(out)
    }
}

async fn collect(
    stream: tokio_postgres::RowStream,
) -> Result<(Vec<String>, u64), tokio_postgres::Error> {
    use futures_util::TryStreamExt;
    let mut stream = std::pin::pin!(stream);
    let mut rows = Vec::new();
    while let Some(row) = stream.try_next().await? {
        rows.push(row_text(&row));
    }
    Ok((rows, stream.rows_affected().unwrap_or(0)))
}

/// What a run gave: each statement's outcome, then every table's rows.
struct Run {
    outcomes: Vec<Outcome>,
    tables: String,
}

async fn snapshot(cloud: &tokio_postgres::Client) -> String {
    let mut all = String::new();
    for sql in SNAPSHOT {
        for m in cloud.simple_query(sql).await.unwrap() {
            if let SimpleQueryMessage::Row(r) = m {
                let cols: Vec<&str> = (0..r.len()).map(|i| r.get(i).unwrap_or("NULL")).collect();
                all.push_str(&cols.join("|"));
                all.push('\n');
            }
        }
        all.push_str("--\n");
    }
    all
}

async fn run_case(dsn: &str, cloud: &tokio_postgres::Client, stmts: &[Stmt]) -> Run {
    cloud.batch_execute(RESET).await.unwrap();
    let mut s = Session::connect(dsn).await;
    let mut outcomes = Vec::with_capacity(stmts.len());
    for stmt in stmts {
        outcomes.push(s.run(stmt).await);
    }
    s.close().await;
    Run {
        outcomes,
        tables: snapshot(cloud).await,
    }
}

/// Runs `steps` through the proxy and at the cloud; the differences, if any.
async fn differences(w: &DiffWorld, steps: &[Step]) -> Option<String> {
    let stmts: Vec<Stmt> = steps.iter().flat_map(Step::stmts).collect();
    let cloud = crate::world::connect(&w.cloud.superuser_dsn("app"))
        .await
        .unwrap();
    let through = format!(
        "host=127.0.0.1 port={} user={} password={} dbname=app",
        w.proxy.port(),
        lokadb_tests::pg::SUPERUSER,
        lokadb_tests::pg::SUPERUSER_PASSWORD
    );
    let proxy = run_case(&through, &cloud, &stmts).await;
    let reference = run_case(&w.cloud.superuser_dsn("app"), &cloud, &stmts).await;
    let mut report = String::new();
    for (i, stmt) in stmts.iter().enumerate() {
        let (p, c) = (&proxy.outcomes[i], &reference.outcomes[i]);
        let mark = if p == c { "  " } else { "!!" };
        report.push_str(&format!("{mark} {i}: {stmt:?}\n"));
        if p != c {
            report.push_str(&format!("     proxy: {p:?}\n     cloud: {c:?}\n"));
        }
    }
    let same_answers = proxy.outcomes == reference.outcomes;
    let same_tables = proxy.tables == reference.tables;
    if same_answers && same_tables {
        return None;
    }
    if !same_tables {
        report.push_str(&format!(
            "!! final rows differ\nproxy:\n{}cloud:\n{}",
            proxy.tables, reference.tables
        ));
    }
    Some(report)
}

/// The runtime the cases run on.
fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn env_number(name: &str) -> Option<u64> {
    std::env::var(name).ok().map(|v| {
        v.trim()
            .parse()
            .unwrap_or_else(|_| panic!("{name} must be a number, not {v:?}"))
    })
}

#[test]
fn generated_statements_answer_through_the_proxy_as_at_the_cloud() {
    let w = diff_world();
    let rt = runtime();
    let cases = env_number("LOKADB_DIFF_CASES").map_or(DEFAULT_CASES, |n| n as u32);
    let seed = env_number("LOKADB_DIFF_SEED").unwrap_or(DEFAULT_SEED);
    let mut seed_bytes = [0u8; 32];
    seed_bytes[..8].copy_from_slice(&seed.to_le_bytes());
    let config = Config {
        cases,
        failure_persistence: None,
        max_shrink_iters: 400,
        max_shrink_time: 300_000,
        ..Config::default()
    };
    let mut runner = TestRunner::new_with_rng(
        config,
        TestRng::from_seed(RngAlgorithm::ChaCha, &seed_bytes),
    );
    let started = Instant::now();
    let result = runner.run(&case(), |steps| {
        let found = rt.block_on(async {
            tokio::time::timeout(Duration::from_secs(60), differences(&w, &steps))
                .await
                .unwrap_or_else(|_| Some("the case took over 60 s".to_owned()))
        });
        match found {
            None => Ok(()),
            Some(report) => Err(TestCaseError::fail(report)),
        }
    });
    let routed = |route: &str| {
        w.proxy
            .output()
            .lines()
            .filter(|l| l.contains("lokadb::route") && l.contains(&format!("route=\"{route}\"")))
            .count()
    };
    eprintln!(
        "differential: {cases} cases (seed {seed}) in {:.1?}; route lines: direct {}, cloud {}, moved {}",
        started.elapsed(),
        routed("direct"),
        routed("cloud"),
        routed("moved"),
    );
    if let Ok(path) = std::env::var("LOKADB_DIFF_PROXY_LOG") {
        std::fs::write(path, w.proxy.output()).unwrap();
    }
    if let Err(e) = result {
        panic!("{e}");
    }
    assert!(routed("direct") > 0, "nothing took the direct path");
}

/// Cases the generator found, kept as they were shrunk.
fn found_cases() -> Vec<(&'static str, Vec<Step>)> {
    let simple = |tpl: Tpl| Stmt {
        tpl,
        proto: Proto::Simple,
        bind: Bind::Literal,
    };
    let join = || Stmt {
        tpl: t(
            "SELECT a.id, b.id FROM notes a JOIN notes b ON a.n = b.n WHERE a.organization_id = ",
        )
        .v(V::Org(1, Spell::Bare))
        .s(" AND b.organization_id = ")
        .v(V::Org(1, Spell::Bare)),
        proto: Proto::Prepared { declared: false },
        bind: Bind::Binary,
    };
    vec![(
        "a statement prepared before a temporary table of the same name, run in a direct transaction",
        vec![
            Step::One(join()),
            Step::One(simple(t(
                "CREATE TEMP TABLE notes (id bigint, organization_id bigint, body text, n int)",
            ))),
            Step::Tx {
                begin: simple(t("BEGIN")),
                body: vec![
                    simple(t("UPDATE notes SET body = 'x' WHERE organization_id = 2 AND id = 21")),
                    join(),
                ],
                end: simple(t("COMMIT")),
            },
        ],
    )]
}

#[test]
fn cases_found_before_answer_as_at_the_cloud() {
    let w = diff_world();
    let rt = runtime();
    // Each three times: what the proxy learns from one run (openers that moved) changes
    // the next.
    for (what, steps) in found_cases()
        .iter()
        .flat_map(|c| [c.clone(), c.clone(), c.clone()])
    {
        if let Some(report) = rt.block_on(differences(&w, &steps)) {
            if let Ok(path) = std::env::var("LOKADB_DIFF_PROXY_LOG") {
                std::fs::write(path, w.proxy.output()).unwrap();
            }
            panic!("{what}:\n{report}");
        }
    }
}
