//! Reading a table's definition from the Postgres catalog, as `enable` and `disable` need
//! it: columns, indexes and unique keys, triggers, grants, owned sequences, foreign keys
//! that point at it, views that read it. Everything is read in the caller's transaction
//! (under its lock when it holds one), so what is rebuilt is what is there.
//!
//! Queries work on PostgreSQL 15 and later.

use super::db::{ident, AdminError};
use postgres::GenericClient;

/// A relation as resolved from the name the operator gave.
#[derive(Debug, Clone)]
pub struct Table {
    pub oid: u32,
    pub schema: String,
    pub name: String,
    /// `r` plain table, `p` partitioned, `v` view, …
    pub relkind: String,
    pub is_partition: bool,
    /// Inherits from or is inherited by another table.
    pub inherits: bool,
    pub owner: String,
    pub row_security: bool,
    pub comment: Option<String>,
    /// The relation's row type (functions and columns using it are bound to this table).
    pub reltype: u32,
    pub columns: Vec<Column>,
}

impl Table {
    /// `"schema"."name"`.
    pub fn qualified(&self) -> String {
        qualify(&self.schema, &self.name)
    }

    /// `schema.name`, for messages.
    pub fn display(&self) -> String {
        plain(&self.schema, &self.name)
    }

    /// The column named `name`.
    pub fn column(&self, name: &str) -> Option<&Column> {
        self.columns.iter().find(|c| c.name == name)
    }
}

/// `schema.name` unquoted, for messages.
pub fn plain(schema: &str, name: &str) -> String {
    format!("{schema}.{name}")
}

/// `"schema"."name"`.
pub fn qualify(schema: &str, name: &str) -> String {
    format!("{}.{}", ident(schema), ident(name))
}

#[derive(Debug, Clone)]
pub struct Column {
    pub name: String,
    /// `format_type(...)` plus ` COLLATE …` when the column's collation is not its type's.
    pub sql_type: String,
    pub not_null: bool,
    /// `a` (ALWAYS), `d` (BY DEFAULT) or empty.
    pub identity: String,
    /// A generated (computed) column.
    pub generated: bool,
}

/// An index of the table, with the constraint it backs if any.
#[derive(Debug, Clone)]
pub struct Index {
    pub oid: u32,
    pub name: String,
    /// `pg_get_indexdef`, read while the table still has its name.
    pub def: String,
    /// The definition from `USING` on (method, keys, INCLUDE, WITH, WHERE), cut after the
    /// prefix rebuilt with the same quoting: a name containing ` USING ` can't shift it.
    pub using: String,
    pub unique: bool,
    pub primary: bool,
    pub valid: bool,
    /// `p`, `u` or `x` when the index backs a constraint.
    pub constraint: Option<(String, String)>,
    pub deferrable: bool,
    pub partial: bool,
    pub expressions: bool,
    pub nulls_not_distinct: bool,
    /// Key columns (not INCLUDE ones), in index order.
    pub columns: Vec<String>,
}

impl Index {
    /// The name a message uses: the constraint's, else the index's.
    pub fn key_name(&self) -> &str {
        self.constraint.as_ref().map_or(&self.name, |c| &c.0)
    }
}

#[derive(Debug, Clone)]
pub struct Trigger {
    pub name: String,
    /// `pg_get_triggerdef`, read while the table still has its name.
    pub def: String,
    /// `O` origin (enabled), `D` disabled, `R` replica, `A` always.
    pub enabled: String,
}

impl Trigger {
    /// The statements that recreate this trigger on `table` (its definition must
    /// already name `table`), in its enabled state.
    pub fn recreate_sql(&self, table: &str) -> Vec<String> {
        let mut sql = vec![self.def.clone()];
        let state = match self.enabled.as_str() {
            "D" => Some("DISABLE TRIGGER"),
            "R" => Some("ENABLE REPLICA TRIGGER"),
            "A" => Some("ENABLE ALWAYS TRIGGER"),
            _ => None,
        };
        if let Some(state) = state {
            sql.push(format!(
                "ALTER TABLE {table} {state} {}",
                super::db::ident(&self.name)
            ));
        }
        sql
    }
}

/// A foreign key of another table (or of this one) that references this table.
#[derive(Debug, Clone)]
pub struct ForeignKey {
    pub name: String,
    /// The relation it references now, schema-qualified and quoted.
    pub referenced: String,
    pub child_oid: u32,
    pub child_schema: String,
    pub child_table: String,
    pub columns: Vec<String>,
    pub ref_columns: Vec<String>,
    /// `MATCH …`, `ON UPDATE …`, `ON DELETE …`, `DEFERRABLE …`, rebuilt from the catalog.
    pub tail: String,
    pub validated: bool,
}

impl ForeignKey {
    pub fn child(&self) -> String {
        qualify(&self.child_schema, &self.child_table)
    }

    /// `schema.table` of the child, for messages.
    pub fn child_display(&self) -> String {
        plain(&self.child_schema, &self.child_table)
    }

    /// `FOREIGN KEY (cols) REFERENCES target (ref cols) tail`.
    pub fn definition(&self, target: &str) -> String {
        format!(
            "FOREIGN KEY ({}) REFERENCES {target} ({}){}",
            idents(&self.columns),
            idents(&self.ref_columns),
            self.tail
        )
    }
}

/// A view or materialized view whose query reads the table.
#[derive(Debug, Clone)]
pub struct View {
    pub qualified: String,
    pub relkind: String,
    pub def: String,
    /// `reloptions` (security_barrier, check_option, security_invoker), comma-separated.
    pub options: String,
}

impl View {
    /// The statement that points the view at whatever the table's name now means.
    pub fn replace_sql(&self) -> String {
        let with = if self.options.is_empty() {
            String::new()
        } else {
            format!(" WITH ({})", self.options)
        };
        format!(
            "CREATE OR REPLACE VIEW {}{with} AS {}",
            self.qualified,
            self.def.trim_end().trim_end_matches(';')
        )
    }
}

/// A sequence owned by a column (serial or identity).
#[derive(Debug, Clone)]
pub struct OwnedSequence {
    pub qualified: String,
    pub schema: String,
    pub name: String,
    pub column: String,
    pub identity: bool,
    /// `START WITH … INCREMENT BY … MINVALUE … MAXVALUE … CACHE … [NO] CYCLE`.
    pub options: String,
    pub last_value: i64,
    pub is_called: bool,
}

/// `"a", "b"`.
pub fn idents(names: &[String]) -> String {
    names
        .iter()
        .map(|n| ident(n))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Resolves `name` (schema-qualified, or through the search_path).
///
/// # Errors
///
/// An unknown name is a usage error.
pub fn resolve(c: &mut impl GenericClient, name: &str) -> Result<Table, AdminError> {
    let oid: Option<u32> = c
        .query_one("SELECT to_regclass($1)::oid", &[&name])
        .map_err(|e| AdminError::usage(format!("{name:?} is not a table name: {e}")))?
        .get(0);
    let Some(oid) = oid else {
        return Err(AdminError::usage(format!(
            "table {name} does not exist (schema-qualify it, or check the search_path)"
        )));
    };
    table(c, oid)
}

/// The table with `oid`.
///
/// # Errors
///
/// The queries failed.
pub fn table(c: &mut impl GenericClient, oid: u32) -> Result<Table, AdminError> {
    let r = c.query_one(
        "SELECT n.nspname::text, c.relname::text, c.relkind::text, c.relispartition,
                EXISTS (SELECT 1 FROM pg_inherits WHERE inhrelid = c.oid OR inhparent = c.oid),
                pg_get_userbyid(c.relowner)::text, c.relrowsecurity,
                obj_description(c.oid, 'pg_class'), c.reltype
         FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = $1",
        &[&oid],
    )?;
    let columns = c
        .query(
            "SELECT a.attname::text, format_type(a.atttypid, a.atttypmod) ||
                    CASE WHEN a.attcollation <> t.typcollation AND a.attcollation <> 0
                         THEN ' COLLATE ' || quote_ident(co.collname) ELSE '' END,
                    a.attnotnull, a.attidentity::text, a.attgenerated <> ''
             FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid
             LEFT JOIN pg_collation co ON co.oid = a.attcollation
             WHERE a.attrelid = $1 AND a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum",
            &[&oid],
        )?
        .iter()
        .map(|r| Column {
            name: r.get(0),
            sql_type: r.get(1),
            not_null: r.get(2),
            identity: r.get(3),
            generated: r.get(4),
        })
        .collect();
    Ok(Table {
        oid,
        schema: r.get(0),
        name: r.get(1),
        relkind: r.get(2),
        is_partition: r.get(3),
        inherits: r.get(4),
        owner: r.get(5),
        row_security: r.get(6),
        comment: r.get(7),
        reltype: r.get(8),
        columns,
    })
}

/// The table's indexes.
///
/// # Errors
///
/// The query failed.
pub fn indexes(c: &mut impl GenericClient, oid: u32) -> Result<Vec<Index>, AdminError> {
    Ok(c.query(
        "SELECT i.indexrelid, ic.relname::text, pg_get_indexdef(i.indexrelid), i.indisunique,
                i.indisprimary, i.indisvalid, con.conname::text, con.contype::text,
                coalesce(con.condeferrable, false), i.indpred IS NOT NULL,
                i.indexprs IS NOT NULL, i.indnullsnotdistinct,
                array(SELECT a.attname::text
                      FROM unnest(i.indkey::int2[]) WITH ORDINALITY k(n, o)
                      JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.n
                      WHERE k.o <= i.indnkeyatts ORDER BY k.o),
                substr(pg_get_indexdef(i.indexrelid),
                       length(format('CREATE %sINDEX %I ON %s%I.%I ',
                                     CASE WHEN i.indisunique THEN 'UNIQUE ' END, ic.relname,
                                     CASE WHEN ic.relkind = 'I' THEN 'ONLY ' END,
                                     tn.nspname, t.relname)) + 1)
         FROM pg_index i JOIN pg_class ic ON ic.oid = i.indexrelid
         JOIN pg_class t ON t.oid = i.indrelid JOIN pg_namespace tn ON tn.oid = t.relnamespace
         LEFT JOIN pg_constraint con ON con.conindid = i.indexrelid AND con.conrelid = i.indrelid
              AND con.contype IN ('p', 'u', 'x')
         WHERE i.indrelid = $1 ORDER BY ic.relname",
        &[&oid],
    )?
    .iter()
    .map(|r| Index {
        oid: r.get(0),
        name: r.get(1),
        def: r.get(2),
        unique: r.get(3),
        primary: r.get(4),
        valid: r.get(5),
        constraint: r
            .get::<_, Option<String>>(6)
            .map(|n| (n, r.get::<_, String>(7))),
        deferrable: r.get(8),
        partial: r.get(9),
        expressions: r.get(10),
        nulls_not_distinct: r.get(11),
        columns: r.get(12),
        using: r.get(13),
    })
    .collect())
}

/// The table's own triggers (not the internal ones of constraints, nor clones).
///
/// # Errors
///
/// The query failed.
pub fn triggers(c: &mut impl GenericClient, oid: u32) -> Result<Vec<Trigger>, AdminError> {
    Ok(c.query(
        "SELECT tgname::text, pg_get_triggerdef(oid), tgenabled::text FROM pg_trigger
         WHERE tgrelid = $1 AND NOT tgisinternal AND tgparentid = 0 ORDER BY tgname",
        &[&oid],
    )?
    .iter()
    .map(|r| Trigger {
        name: r.get(0),
        def: r.get(1),
        enabled: r.get(2),
    })
    .collect())
}

/// Foreign keys (top-level, not partition clones) that reference `oid`.
///
/// # Errors
///
/// The query failed.
pub fn referencing(c: &mut impl GenericClient, oid: u32) -> Result<Vec<ForeignKey>, AdminError> {
    let rows = c.query(
        "SELECT con.conname::text, con.conrelid, n.nspname::text, cc.relname::text,
                array(SELECT a.attname::text FROM unnest(con.conkey) WITH ORDINALITY k(n, o)
                      JOIN pg_attribute a ON a.attrelid = con.conrelid AND a.attnum = k.n
                      ORDER BY k.o),
                array(SELECT a.attname::text FROM unnest(con.confkey) WITH ORDINALITY k(n, o)
                      JOIN pg_attribute a ON a.attrelid = con.confrelid AND a.attnum = k.n
                      ORDER BY k.o),
                con.confmatchtype::text, con.confupdtype::text, con.confdeltype::text,
                con.condeferrable, con.condeferred,
                array(SELECT a.attname::text FROM unnest(con.confdelsetcols) WITH ORDINALITY k(n, o)
                      JOIN pg_attribute a ON a.attrelid = con.conrelid AND a.attnum = k.n
                      ORDER BY k.o),
                con.convalidated, con.confrelid::regclass::text
         FROM pg_constraint con JOIN pg_class cc ON cc.oid = con.conrelid
         JOIN pg_namespace n ON n.oid = cc.relnamespace
         WHERE con.contype = 'f' AND con.confrelid = $1 AND con.conparentid = 0
         ORDER BY n.nspname, cc.relname, con.conname",
        &[&oid],
    )?;
    Ok(rows
        .iter()
        .map(|r| {
            let action = |code: &str, set_cols: &[String]| -> String {
                match code {
                    "r" => "RESTRICT".into(),
                    "c" => "CASCADE".into(),
                    "n" | "d" => {
                        let what = if code == "n" {
                            "SET NULL"
                        } else {
                            "SET DEFAULT"
                        };
                        if set_cols.is_empty() {
                            what.into()
                        } else {
                            format!("{what} ({})", idents(set_cols))
                        }
                    }
                    _ => "NO ACTION".into(),
                }
            };
            let set_cols: Vec<String> = r.get(11);
            let mut tail = String::new();
            if r.get::<_, String>(6) == "f" {
                tail.push_str(" MATCH FULL");
            }
            tail.push_str(&format!(" ON UPDATE {}", action(r.get(7), &[])));
            tail.push_str(&format!(" ON DELETE {}", action(r.get(8), &set_cols)));
            if r.get(9) {
                tail.push_str(" DEFERRABLE");
                if r.get(10) {
                    tail.push_str(" INITIALLY DEFERRED");
                }
            }
            ForeignKey {
                name: r.get(0),
                referenced: r.get(13),
                child_oid: r.get(1),
                child_schema: r.get(2),
                child_table: r.get(3),
                columns: r.get(4),
                ref_columns: r.get(5),
                tail,
                validated: r.get(12),
            }
        })
        .collect())
}

/// Views and materialized views whose query reads `oid` directly.
///
/// # Errors
///
/// The query failed.
pub fn dependent_views(c: &mut impl GenericClient, oid: u32) -> Result<Vec<View>, AdminError> {
    Ok(c.query(
        "SELECT DISTINCT format('%I.%I', vn.nspname, v.relname), v.relkind::text,
                pg_get_viewdef(v.oid), coalesce(array_to_string(v.reloptions, ', '), '')
         FROM pg_depend d JOIN pg_rewrite r ON r.oid = d.objid
         JOIN pg_class v ON v.oid = r.ev_class JOIN pg_namespace vn ON vn.oid = v.relnamespace
         WHERE d.classid = 'pg_rewrite'::regclass AND d.refclassid = 'pg_class'::regclass
           AND d.refobjid = $1 AND v.oid <> $1
         ORDER BY 1",
        &[&oid],
    )?
    .iter()
    .map(|r| View {
        qualified: r.get(0),
        relkind: r.get(1),
        def: r.get(2),
        options: r.get(3),
    })
    .collect())
}

/// Functions and other tables' columns that use the table's row type: they are bound to
/// the original table and would not accept the parent's rows.
///
/// # Errors
///
/// The query failed.
pub fn row_type_users(c: &mut impl GenericClient, t: &Table) -> Result<Vec<String>, AdminError> {
    Ok(c.query(
        "WITH ty AS (SELECT $1::oid AS t UNION ALL SELECT typarray FROM pg_type WHERE oid = $1)
         SELECT 'function ' || p.oid::regprocedure::text FROM pg_proc p
          WHERE p.prorettype IN (SELECT t FROM ty)
             OR p.proargtypes::oid[] && array(SELECT t FROM ty)
         UNION ALL
         SELECT 'column ' || a.attrelid::regclass::text || '.' || quote_ident(a.attname)
           FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
          WHERE a.atttypid IN (SELECT t FROM ty) AND NOT a.attisdropped AND a.attnum > 0
            AND c.relkind IN ('r', 'p', 'f', 'm')
         ORDER BY 1",
        &[&t.reltype],
    )?
    .iter()
    .map(|r| r.get(0))
    .collect())
}

/// Sequences owned by the table's columns (serial: `a`, identity: `i`), with their
/// options and position.
///
/// # Errors
///
/// The queries failed.
pub fn owned_sequences(
    c: &mut impl GenericClient,
    oid: u32,
) -> Result<Vec<OwnedSequence>, AdminError> {
    let rows = c.query(
        "SELECT format('%I.%I', sn.nspname, s.relname), sn.nspname::text, s.relname::text,
                a.attname::text, d.deptype = 'i',
                format('START WITH %s INCREMENT BY %s MINVALUE %s MAXVALUE %s CACHE %s %s',
                       q.seqstart, q.seqincrement, q.seqmin,
                       q.seqmax, q.seqcache, CASE WHEN q.seqcycle THEN 'CYCLE' ELSE 'NO CYCLE' END)
         FROM pg_depend d JOIN pg_class s ON s.oid = d.objid AND s.relkind = 'S'
         JOIN pg_namespace sn ON sn.oid = s.relnamespace
         JOIN pg_sequence q ON q.seqrelid = s.oid
         JOIN pg_attribute a ON a.attrelid = d.refobjid AND a.attnum = d.refobjsubid
         WHERE d.classid = 'pg_class'::regclass AND d.refclassid = 'pg_class'::regclass
           AND d.refobjid = $1 AND d.deptype IN ('a', 'i')
         ORDER BY a.attnum",
        &[&oid],
    )?;
    let mut out = Vec::new();
    for r in rows {
        let qualified: String = r.get(0);
        let pos = c.query_one(
            &format!("SELECT last_value, is_called FROM {qualified}"),
            &[],
        )?;
        out.push(OwnedSequence {
            qualified,
            schema: r.get(1),
            name: r.get(2),
            column: r.get(3),
            identity: r.get(4),
            options: r.get(5),
            last_value: pos.get(0),
            is_called: pos.get(1),
        });
    }
    Ok(out)
}

/// `GRANT` statements that give `target` the privileges `oid` has (table and column
/// level), preceded by a `REVOKE` of the owner's default ones when the table has an
/// explicit ACL (so the result is the same ACL, not a superset).
///
/// # Errors
///
/// The queries failed.
pub fn grants_sql(
    c: &mut impl GenericClient,
    oid: u32,
    target: &str,
    owner: &str,
    keyword: &str,
) -> Result<Vec<String>, AdminError> {
    let mut out = Vec::new();
    let has_acl: bool = c
        .query_one(
            "SELECT relacl IS NOT NULL FROM pg_class WHERE oid = $1",
            &[&oid],
        )?
        .get(0);
    if !has_acl {
        return Ok(out);
    }
    out.push(format!(
        "REVOKE ALL ON {keyword}{target} FROM {}",
        ident(owner)
    ));
    let rows = c.query(
        "SELECT '', CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE quote_ident(pg_get_userbyid(a.grantee)) END,
                a.privilege_type, a.is_grantable
         FROM pg_class c, aclexplode(c.relacl) a WHERE c.oid = $1
         UNION ALL
         SELECT quote_ident(att.attname), CASE WHEN a.grantee = 0 THEN 'PUBLIC'
                ELSE quote_ident(pg_get_userbyid(a.grantee)) END, a.privilege_type, a.is_grantable
         FROM pg_attribute att, aclexplode(att.attacl) a
         WHERE att.attrelid = $1 AND att.attacl IS NOT NULL AND NOT att.attisdropped
         ORDER BY 1, 2, 3",
        &[&oid],
    )?;
    for r in rows {
        let column: String = r.get(0);
        let cols = if column.is_empty() {
            String::new()
        } else {
            format!(" ({column})")
        };
        let option = if r.get(3) { " WITH GRANT OPTION" } else { "" };
        out.push(format!(
            "GRANT {}{cols} ON {keyword}{target} TO {}{option}",
            r.get::<_, String>(2),
            r.get::<_, String>(1)
        ));
    }
    Ok(out)
}

/// The partitions of a partitioned table: (name, is the default partition, relkind).
///
/// # Errors
///
/// The query failed.
pub fn partitions(
    c: &mut impl GenericClient,
    oid: u32,
) -> Result<Vec<(String, bool, String)>, AdminError> {
    Ok(c.query(
        "SELECT format('%I.%I', n.nspname, p.relname),
                pg_get_expr(p.relpartbound, p.oid) = 'DEFAULT', p.relkind::text
         FROM pg_inherits i JOIN pg_class p ON p.oid = i.inhrelid
         JOIN pg_namespace n ON n.oid = p.relnamespace
         WHERE i.inhparent = $1 ORDER BY 1",
        &[&oid],
    )?
    .iter()
    .map(|r| (r.get(0), r.get(1), r.get(2)))
    .collect())
}
