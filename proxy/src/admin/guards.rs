//! Foreign keys of LokaDB tables kept across foreign partitions (a moved organization's
//! rows), in the cloud, without asking the organization's database.
//!
//! A LokaDB table's foreign keys live on its DEFAULT partition (a partitioned table with a
//! foreign key cannot get a foreign partition), so they hold for the organizations in the
//! cloud only. For every such foreign key (`documents.project_id → projects`, or
//! `document_versions.document_id → lokadb.km_documents_id` once `documents` is a LokaDB
//! table too) enable installs a *guard*:
//!
//! - **the parent check**: `AFTER INSERT OR DELETE` and `AFTER UPDATE OF <columns> WHEN
//!   (changed)` row triggers on the LokaDB table, cloned by Postgres onto every partition and
//!   disabled on the default one (the native foreign key holds there). For a row of another
//!   partition they lock the referenced row `FOR KEY SHARE` in the cloud (a concurrent delete
//!   waits) and raise 23503 when it is missing, as Postgres does;
//! - **refs** (`lokadb.__refs_<table>_<constraint>`): one row (key, organization) per
//!   reference from such a row, added and removed by the same triggers. One row per
//!   reference rather than a counter per (key, organization): a counter would be one hot
//!   row that every writer of an organization locks until it commits (think of
//!   `organization_id → organizations`);
//! - **the refs check**: `AFTER DELETE` and `AFTER UPDATE OF <key> WHEN (changed)` row
//!   triggers on the referenced table (a cloud table or a key map) that look the old key up
//!   in refs (one index probe) and, per organization found, refuse (NO ACTION, RESTRICT:
//!   23503 naming the table and organization) or act (CASCADE, SET NULL, SET DEFAULT:
//!   through the LokaDB table with the organization's condition, so only its partition is
//!   touched — the one case that reaches the organization's database).
//!
//! The trigger functions are generated per foreign key (static SQL, plans cached per
//! session). [`sync`] installs, re-targets and removes guards so they match the catalog; it
//! is idempotent (a guard whose generated SQL has not changed is left alone) and runs in
//! enable's and disable's transactions. See docs/cloud-schema.md.

use super::catalog::{idents, qualify, Column};
use super::db::{ident, literal, AdminError};
use super::keymap::{fit, suffixed};
use super::DEFINER;
use postgres::GenericClient;

/// One foreign key of a LokaDB table, as a guard keeps it.
#[derive(Debug, Clone)]
pub struct Guard {
    /// The LokaDB table (the partitioned parent).
    pub schema: String,
    pub table: String,
    /// Its default partition's name.
    pub partition: String,
    pub org: Column,
    /// The constraint's name (on the default partition).
    pub name: String,
    pub columns: Vec<String>,
    /// The relation the check reads and the refs check sits on.
    pub target_oid: u32,
    pub target: String,
    /// The name messages give the referenced table (the LokaDB table of a key map).
    pub target_display: String,
    pub target_columns: Vec<String>,
    pub target_types: Vec<String>,
    pub match_full: bool,
    /// `a` no action, `r` restrict, `c` cascade, `n` set null, `d` set default.
    pub on_update: String,
    pub on_delete: String,
    /// `ON DELETE SET NULL (cols)`: the columns set (all when empty).
    pub delete_set: Vec<String>,
    pub deferrable: bool,
    pub deferred: bool,
}

/// A foreign key a guard cannot keep, and why (reported, not refused).
#[derive(Debug, Clone)]
pub struct Skipped {
    pub name: String,
    pub reason: String,
}

impl Guard {
    fn parent(&self) -> String {
        qualify(&self.schema, &self.table)
    }

    /// `lokadb.__refs_…` (name only).
    pub fn refs_name(&self) -> String {
        fit(&format!("__refs_{}_{}", self.table, self.name))
    }

    fn refs(&self) -> String {
        qualify("lokadb", &self.refs_name())
    }

    fn child_function(&self) -> String {
        qualify("lokadb", &suffixed(&self.refs_name(), "_child"))
    }

    fn parent_function(&self) -> String {
        qualify("lokadb", &suffixed(&self.refs_name(), "_parent"))
    }

    /// A deferrable key's checks waiting for their time: `lokadb.__refs_…_checks`.
    fn checks(&self) -> String {
        qualify("lokadb", &suffixed(&self.refs_name(), "_checks"))
    }

    fn check_function(&self) -> String {
        qualify("lokadb", &suffixed(&self.refs_name(), "_check"))
    }

    fn child_triggers(&self) -> [String; 2] {
        let base = format!("lokadb_fk_{}", self.name);
        [fit(&base), suffixed(&base, "_upd")]
    }

    fn parent_triggers(&self) -> [String; 2] {
        let base = format!("lokadb_refs_{}_{}", self.table, self.name);
        [fit(&base), suffixed(&base, "_upd")]
    }

    fn keys(&self) -> Vec<String> {
        (1..=self.columns.len()).map(|i| format!("k{i}")).collect()
    }

    /// `NEW.a, NEW.b`.
    fn vals(rec: &str, cols: &[String]) -> String {
        cols.iter()
            .map(|c| format!("{rec}.{}", ident(c)))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// `l.a = NEW.b AND …`.
    fn eq(left: &[String], rec: &str, right: &[String]) -> String {
        left.iter()
            .zip(right)
            .map(|(l, r)| format!("{} = {rec}.{}", ident(l), ident(r)))
            .collect::<Vec<_>>()
            .join(" AND ")
    }

    /// Every referencing column of `rec` is non-NULL (MATCH SIMPLE checks only then; MATCH
    /// FULL refuses a mix, see [`Guard::child_sql`]).
    fn present(&self, rec: &str) -> String {
        self.columns
            .iter()
            .map(|c| format!("{rec}.{} IS NOT NULL", ident(c)))
            .collect::<Vec<_>>()
            .join(" AND ")
    }

    fn changed(&self, cols: &[String]) -> String {
        format!(
            "ROW({}) IS DISTINCT FROM ROW({})",
            Self::vals("OLD", cols),
            Self::vals("NEW", cols)
        )
    }

    fn deferral(&self) -> &'static str {
        match (self.deferrable, self.deferred) {
            (true, true) => " DEFERRABLE INITIALLY DEFERRED",
            (true, false) => " DEFERRABLE INITIALLY IMMEDIATE",
            _ => "",
        }
    }

    /// The child-side trigger function: parent check and refs.
    fn child_sql(&self) -> String {
        let refs = self.refs();
        let keys = self.keys();
        let org = ident(&self.org.name);
        let match_full = if self.match_full && self.columns.len() > 1 {
            format!(
                "IF NOT ({present}) AND ROW({vals}) IS DISTINCT FROM ROW({nulls}) THEN
        RAISE EXCEPTION 'insert or update on table \"%\" violates foreign key constraint \"%\"', {tname}, {con}
            USING ERRCODE = '23503', CONSTRAINT = {con}, TABLE = {tname}, SCHEMA = {sname},
                  DETAIL = 'MATCH FULL does not allow mixing of null and nonnull key values.';
    END IF;
    ",
                present = self.present("NEW"),
                vals = Self::vals("NEW", &self.columns),
                nulls = vec!["NULL"; self.columns.len()].join(", "),
                tname = literal(&self.table),
                con = literal(&self.name),
                sname = literal(&self.schema),
            )
        } else {
            String::new()
        };
        let old_match = keys
            .iter()
            .zip(&self.columns)
            .map(|(k, c)| format!("{k} = OLD.{}", ident(c)))
            .collect::<Vec<_>>()
            .join(" AND ");
        let new_vals = Self::vals("NEW", &self.columns);
        format!(
            "CREATE OR REPLACE FUNCTION {f}() RETURNS trigger LANGUAGE plpgsql {DEFINER} AS $lokadb$
-- LokaDB: foreign key {con_plain} of {table_plain} for the rows of partitions other than the
-- default one (moved organizations): parent check and refs. Generated by lokadb enable.
BEGIN
    IF TG_TABLE_NAME = {part} THEN
        RETURN NULL;  -- the native foreign key holds there (and this trigger is disabled there)
    END IF;
    IF TG_OP <> 'INSERT' THEN
        IF {old_present} THEN
            DELETE FROM {refs} WHERE ctid = (SELECT ctid FROM {refs}
                WHERE {old_match} AND org = OLD.{org} LIMIT 1 FOR UPDATE);{forget}
        END IF;
        IF TG_OP = 'DELETE' THEN
            RETURN NULL;
        END IF;
    END IF;
    {match_full}IF {new_present} THEN
        {check}
        INSERT INTO {refs} ({keys}, org) VALUES ({new_vals}, NEW.{org});
    END IF;
    RETURN NULL;
END
$lokadb$",
            f = self.child_function(),
            con_plain = self.name.replace('\n', " "),
            table_plain = format!("{}.{}", self.schema, self.table).replace('\n', " "),
            part = literal(&self.partition),
            forget = if self.deferrable {
                // The row's check still waiting, if any: nothing to check any more.
                format!(
                    "\n            DELETE FROM {c} WHERE ctid = (SELECT ctid FROM {c}
                WHERE {m} AND org = OLD.{org} LIMIT 1 FOR UPDATE);",
                    c = self.checks(),
                    m = old_match,
                )
            } else {
                String::new()
            },
            check = if self.deferrable {
                // Checked when the constraint's time comes ([`Guard::check_sql`]).
                format!(
                    "INSERT INTO {} ({}, org) VALUES ({new_vals}, NEW.{org});",
                    self.checks(),
                    keys.join(", "),
                )
            } else {
                self.parent_check(&self.columns)
            },
            old_present = self.present("OLD"),
            new_present = self.present("NEW"),
            keys = keys.join(", "),
        )
    }

    /// The check that the key in NEW's `cols` (the table's own columns, or the checks
    /// queue's `k1…`) is in the referenced table, raising Postgres's own error if not.
    fn parent_check(&self, cols: &[String]) -> String {
        format!(
            "PERFORM 1 FROM {target} t WHERE {target_match} FOR KEY SHARE;
        IF NOT FOUND THEN
            RAISE EXCEPTION 'insert or update on table \"%\" violates foreign key constraint \"%\"', {tname}, {con}
                USING ERRCODE = '23503', CONSTRAINT = {con}, TABLE = {tname}, SCHEMA = {sname},
                      DETAIL = format('Key ({names})=(%s) is not present in table \"%s\".',
                                      concat_ws(', ', {vals}), {target_name});
        END IF;",
            target = self.target,
            target_match = self
                .target_columns
                .iter()
                .zip(cols)
                .map(|(t, c)| format!("t.{} = NEW.{}", ident(t), ident(c)))
                .collect::<Vec<_>>()
                .join(" AND "),
            tname = literal(&self.table),
            con = literal(&self.name),
            sname = literal(&self.schema),
            names = self.columns.join(", ").replace('\'', "''"),
            vals = Self::vals("NEW", cols),
            target_name = literal(&self.target_display),
        )
    }

    /// A deferrable key: the queue of its checks and the constraint trigger that makes them
    /// when the constraint's time comes (at COMMIT when deferred, or at `SET CONSTRAINTS
    /// ALL IMMEDIATE`). A constraint trigger cannot be on the table itself: Postgres clones
    /// a partitioned table's row triggers to its partitions, and refuses constraint
    /// triggers on foreign tables (the moved organizations' partitions).
    fn check_sql(&self) -> Vec<String> {
        let checks = self.checks();
        let keys = self.keys();
        let defs: Vec<String> = keys
            .iter()
            .zip(&self.target_types)
            .map(|(k, t)| format!("{k} {t} NOT NULL"))
            .collect();
        let f = self.check_function();
        vec![
            format!(
                "CREATE TABLE IF NOT EXISTS {checks} ({}, org {} NOT NULL)",
                defs.join(", "),
                self.org.sql_type
            ),
            format!(
                "CREATE OR REPLACE FUNCTION {f}() RETURNS trigger LANGUAGE plpgsql {DEFINER} AS $lokadb$
-- LokaDB: the deferred check of foreign key {con_plain} of {table_plain} for a moved
-- organization's row. Generated by lokadb enable.
BEGIN
    -- Gone meanwhile (the row deleted, or its key changed): nothing to check.
    DELETE FROM {checks} WHERE ctid = (SELECT ctid FROM {checks}
        WHERE {match} AND org = NEW.org LIMIT 1 FOR UPDATE);
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    {check}
    RETURN NULL;
END
$lokadb$",
                con_plain = self.name.replace('\n', " "),
                table_plain = format!("{}.{}", self.schema, self.table).replace('\n', " "),
                match = keys
                    .iter()
                    .map(|k| format!("{k} = NEW.{k}"))
                    .collect::<Vec<_>>()
                    .join(" AND "),
                check = self.parent_check(&keys),
            ),
            format!(
                "DROP TRIGGER IF EXISTS {} ON {checks}",
                ident(&self.name)
            ),
            format!(
                "CREATE CONSTRAINT TRIGGER {} AFTER INSERT ON {checks}{} FOR EACH ROW EXECUTE FUNCTION {f}()",
                ident(&self.name),
                self.deferral()
            ),
        ]
    }

    /// The SQL that applies `action` (`a`, `r`, `c`, `n`, `d`) to organization `o`'s
    /// references of OLD's key; `None` for a refusal.
    fn action_sql(&self, action: &str, delete: bool) -> Option<String> {
        let parent = self.parent();
        let org = ident(&self.org.name);
        let filter = format!(
            "{org} = o AND {}",
            Self::eq(&self.columns, "OLD", &self.target_columns)
        );
        match action {
            "c" if delete => Some(format!("DELETE FROM {parent} WHERE {filter};")),
            "c" => Some(format!(
                "UPDATE {parent} SET ({}) = ROW({}) WHERE {filter};",
                idents(&self.columns),
                Self::vals("NEW", &self.target_columns)
            )),
            "n" | "d" => {
                let cols = if delete && !self.delete_set.is_empty() {
                    &self.delete_set
                } else {
                    &self.columns
                };
                let value = if action == "n" { "NULL" } else { "DEFAULT" };
                Some(format!(
                    "UPDATE {parent} SET ({}) = ROW({}) WHERE {filter};",
                    idents(cols),
                    vec![value; cols.len()].join(", ")
                ))
            }
            _ => None,
        }
    }

    fn refusal_sql(&self, action: &str) -> String {
        let raise = format!(
            "RAISE EXCEPTION 'update or delete on table \"%\" violates foreign key constraint \"%\" on table \"%\"', {target}, {con}, {tname}
                USING ERRCODE = '23503', CONSTRAINT = {con}, TABLE = {tname}, SCHEMA = {sname},
                      DETAIL = format('Key ({cols})=(%s) is still referenced from table \"%s\" in organization %s.',
                                      concat_ws(', ', {old_vals}), {tname}, o);",
            target = literal(&self.target_display),
            con = literal(&self.name),
            tname = literal(&self.table),
            sname = literal(&self.schema),
            cols = self.target_columns.join(", ").replace('\'', "''"),
            old_vals = Self::vals("OLD", &self.target_columns),
        );
        if action == "r" {
            raise
        } else {
            // NO ACTION: fine if the key exists again (another row now has it).
            format!(
                "IF NOT EXISTS (SELECT 1 FROM {} t WHERE {}) THEN
                {raise}
            END IF;",
                self.target,
                self.target_columns
                    .iter()
                    .map(|c| format!("t.{0} = OLD.{0}", ident(c)))
                    .collect::<Vec<_>>()
                    .join(" AND ")
            )
        }
    }

    /// The referenced-side trigger function: the refs check on delete and key change.
    fn parent_sql(&self) -> String {
        let on = |action: &str, delete: bool| {
            self.action_sql(action, delete)
                .unwrap_or_else(|| self.refusal_sql(action))
        };
        format!(
            "CREATE OR REPLACE FUNCTION {f}() RETURNS trigger LANGUAGE plpgsql {DEFINER} AS $lokadb$
-- LokaDB: a delete or key change of a row that rows of moved organizations reference
-- (foreign key {con_plain} of {table_plain}), checked against refs. Generated by lokadb enable.
DECLARE
    o {org_type};
BEGIN
    FOR o IN SELECT DISTINCT r.org FROM {refs} r WHERE {match} LOOP
        IF TG_OP = 'DELETE' THEN
            {on_delete}
        ELSE
            {on_update}
        END IF;
    END LOOP;
    RETURN NULL;
END
$lokadb$",
            f = self.parent_function(),
            con_plain = self.name.replace('\n', " "),
            table_plain = format!("{}.{}", self.schema, self.table).replace('\n', " "),
            org_type = self.org.sql_type,
            refs = self.refs(),
            match = self
                .keys()
                .iter()
                .zip(&self.target_columns)
                .map(|(k, c)| format!("r.{k} = OLD.{}", ident(c)))
                .collect::<Vec<_>>()
                .join(" AND "),
            on_delete = on(&self.on_delete, true),
            on_update = on(&self.on_update, false),
        )
    }

    /// Everything a guard is, in order; rerunnable (IF NOT EXISTS, OR REPLACE, DROP … IF
    /// EXISTS). `old_target` is where its refs check was before (when it moves).
    pub fn install_sql(&self, old_target: Option<&str>) -> Vec<String> {
        let refs = self.refs();
        let parent = self.parent();
        let part = qualify(&self.schema, &self.partition);
        let keys = self.keys();
        let defs: Vec<String> = keys
            .iter()
            .zip(&self.target_types)
            .map(|(k, t)| format!("{k} {t} NOT NULL"))
            .collect();
        let mut sql = vec![
            format!(
                "CREATE TABLE IF NOT EXISTS {refs} ({}, org {} NOT NULL)",
                defs.join(", "),
                self.org.sql_type
            ),
            format!(
                "CREATE INDEX IF NOT EXISTS {} ON {refs} ({}, org)",
                ident(&suffixed(&self.refs_name(), "_key")),
                keys.join(", ")
            ),
            format!(
                "COMMENT ON TABLE {refs} IS {}",
                literal(&format!(
                    "LokaDB refs of foreign key {} of {}.{}: one row per reference from a moved organization's row",
                    self.name, self.schema, self.table
                ))
            ),
            self.child_sql(),
            self.parent_sql(),
        ];
        if self.deferrable {
            sql.extend(self.check_sql());
        }
        let [ins, upd] = self.child_triggers();
        // Plain triggers, also for a deferrable key: its check waits in the queue instead.
        let kind = "TRIGGER";
        let deferral = self.deferral();
        let f = self.child_function();
        sql.push(format!(
            "DROP TRIGGER IF EXISTS {} ON {parent}",
            ident(&ins)
        ));
        sql.push(format!(
            "DROP TRIGGER IF EXISTS {} ON {parent}",
            ident(&upd)
        ));
        sql.push(format!(
            "CREATE {kind} {} AFTER INSERT OR DELETE ON {parent} FOR EACH ROW EXECUTE FUNCTION {f}()",
            ident(&ins)
        ));
        sql.push(format!(
            "CREATE {kind} {} AFTER UPDATE OF {} ON {parent} FOR EACH ROW WHEN ({}) EXECUTE FUNCTION {f}()",
            ident(&upd),
            idents(&self.columns),
            self.changed(&self.columns)
        ));
        // The native foreign key holds on the default partition: no trigger call there.
        sql.push(format!(
            "ALTER TABLE {part} DISABLE TRIGGER {}",
            ident(&ins)
        ));
        sql.push(format!(
            "ALTER TABLE {part} DISABLE TRIGGER {}",
            ident(&upd)
        ));
        let [pdel, pupd] = self.parent_triggers();
        let pf = self.parent_function();
        for t in [old_target, Some(self.target.as_str())]
            .into_iter()
            .flatten()
        {
            sql.push(format!("DROP TRIGGER IF EXISTS {} ON {t}", ident(&pdel)));
            sql.push(format!("DROP TRIGGER IF EXISTS {} ON {t}", ident(&pupd)));
        }
        // Only NO ACTION can wait for the end of the transaction, as Postgres's own.
        let (pkind, pdefer) = if self.deferrable && self.on_delete == "a" {
            ("CONSTRAINT TRIGGER", deferral)
        } else {
            ("TRIGGER", "")
        };
        sql.push(format!(
            "CREATE {pkind} {} AFTER DELETE ON {}{pdefer} FOR EACH ROW EXECUTE FUNCTION {pf}()",
            ident(&pdel),
            self.target
        ));
        let (ukind, udefer) = if self.deferrable && self.on_update == "a" {
            ("CONSTRAINT TRIGGER", deferral)
        } else {
            ("TRIGGER", "")
        };
        sql.push(format!(
            "CREATE {ukind} {} AFTER UPDATE OF {} ON {}{udefer} FOR EACH ROW WHEN ({}) EXECUTE FUNCTION {pf}()",
            ident(&pupd),
            idents(&self.target_columns),
            self.target,
            self.changed(&self.target_columns)
        ));
        sql
    }

    /// The lokadb.guards row.
    fn record_sql(&self, definition: &str) -> String {
        format!(
            "INSERT INTO lokadb.guards (child_schema, child_table, constraint_name, columns, target, target_columns, refs, definition)
             VALUES ({}, {}, {}, ARRAY[{}]::name[], {}::regclass, ARRAY[{}]::name[], {}, {})
             ON CONFLICT (child_schema, child_table, constraint_name) DO UPDATE
             SET columns = EXCLUDED.columns, target = EXCLUDED.target, target_columns = EXCLUDED.target_columns,
                 refs = EXCLUDED.refs, definition = EXCLUDED.definition",
            literal(&self.schema),
            literal(&self.table),
            literal(&self.name),
            self.columns.iter().map(|c| literal(c)).collect::<Vec<_>>().join(", "),
            literal(&self.target_oid.to_string()),
            self.target_columns.iter().map(|c| literal(c)).collect::<Vec<_>>().join(", "),
            literal(&self.refs_name()),
            literal(definition),
        )
    }
}

/// A guard as recorded in lokadb.guards.
struct Recorded {
    schema: String,
    table: String,
    name: String,
    /// None when the relation is gone.
    target: Option<String>,
    refs: String,
    definition: String,
}

fn recorded(c: &mut impl GenericClient) -> Result<Vec<Recorded>, AdminError> {
    Ok(c.query(
        "SELECT child_schema::text, child_table::text, constraint_name::text,
                CASE WHEN r.oid IS NOT NULL THEN format('%I.%I', n.nspname, r.relname) END,
                refs::text, definition
         FROM lokadb.guards g LEFT JOIN pg_class r ON r.oid = g.target
         LEFT JOIN pg_namespace n ON n.oid = r.relnamespace
         ORDER BY 1, 2, 3",
        &[],
    )?
    .iter()
    .map(|r| Recorded {
        schema: r.get(0),
        table: r.get(1),
        name: r.get(2),
        target: r.get(3),
        refs: r.get(4),
        definition: r.get(5),
    })
    .collect())
}

/// The guards the catalog asks for: every foreign key of every LokaDB table's default
/// partition, and the ones that cannot be kept.
///
/// # Errors
///
/// A catalog query failed.
pub fn wanted(c: &mut impl GenericClient) -> Result<(Vec<Guard>, Vec<Skipped>), AdminError> {
    let rows = c.query(
        "SELECT t.schema_name::text, t.table_name::text, t.default_partition::text, t.org_column::text,
                format_type(oa.atttypid, oa.atttypmod),
                con.conname::text, con.confrelid,
                format('%I.%I', rn.nspname, rc.relname), rn.nspname::text, rc.relname::text,
                array(SELECT a.attname::text FROM unnest(con.conkey) WITH ORDINALITY k(n, o)
                      JOIN pg_attribute a ON a.attrelid = con.conrelid AND a.attnum = k.n ORDER BY k.o),
                array(SELECT a.attname::text FROM unnest(con.confkey) WITH ORDINALITY k(n, o)
                      JOIN pg_attribute a ON a.attrelid = con.confrelid AND a.attnum = k.n ORDER BY k.o),
                array(SELECT format_type(a.atttypid, a.atttypmod) FROM unnest(con.confkey) WITH ORDINALITY k(n, o)
                      JOIN pg_attribute a ON a.attrelid = con.confrelid AND a.attnum = k.n ORDER BY k.o),
                con.confmatchtype = 'f', con.confupdtype::text, con.confdeltype::text,
                array(SELECT a.attname::text FROM unnest(con.confdelsetcols) WITH ORDINALITY k(n, o)
                      JOIN pg_attribute a ON a.attrelid = con.conrelid AND a.attnum = k.n ORDER BY k.o),
                con.condeferrable, con.condeferred
         FROM lokadb.tables t
         JOIN pg_namespace tn ON tn.nspname = t.schema_name
         JOIN pg_class p ON p.relnamespace = tn.oid AND p.relname = t.default_partition
         JOIN pg_attribute oa ON oa.attrelid = p.oid AND oa.attname = t.org_column
         JOIN pg_constraint con ON con.conrelid = p.oid AND con.contype = 'f' AND con.conparentid = 0
         JOIN pg_class rc ON rc.oid = con.confrelid
         JOIN pg_namespace rn ON rn.oid = rc.relnamespace
         ORDER BY 1, 2, 6",
        &[],
    )?;
    let mut out = Vec::new();
    let mut skipped = Vec::new();
    for r in rows {
        let schema: String = r.get(0);
        let table: String = r.get(1);
        let target_schema: String = r.get(8);
        let target_rel: String = r.get(9);
        let target_columns: Vec<String> = r.get(11);
        let name: String = r.get(5);
        // A key map: messages name its LokaDB table.
        let km: Option<(String, String)> = if target_schema == "lokadb" {
            c.query_opt(
                "SELECT schema_name::text, table_name::text FROM lokadb.keys WHERE keymap = $1",
                &[&target_rel],
            )?
            .map(|k| (k.get(0), k.get(1)))
        } else {
            None
        };
        // The default partition of a LokaDB table: fine while the key is one a key map
        // keeps (enable points the foreign key at the key map next; until then the
        // partition holds every row), not for a key with the organization column.
        let of_lokadb: Option<(String, bool)> = c
            .query_opt(
                "SELECT t.table_name::text,
                        EXISTS (SELECT 1 FROM lokadb.keys k WHERE k.schema_name = t.schema_name
                                AND k.table_name = t.table_name
                                AND (SELECT array_agg(x ORDER BY x) FROM unnest(k.columns) x)
                                    = (SELECT array_agg(x ORDER BY x) FROM unnest($3::name[]) x))
                 FROM lokadb.tables t WHERE t.schema_name = $1 AND t.default_partition = $2",
                &[&target_schema, &target_rel, &target_columns],
            )?
            .map(|x| (x.get(0), x.get(1)));
        let target_display = match (&km, &of_lokadb) {
            (Some((_, t)), _) => t.clone(),
            (None, Some((t, true))) => t.clone(),
            (None, Some((t, false))) => {
                skipped.push(Skipped {
                    name: format!("{name} of {schema}.{table}"),
                    reason: format!(
                        "it references a key of LokaDB table {target_schema}.{t} that includes its organization column: for a moved organization both rows are in its own database, which must keep it"
                    ),
                });
                continue;
            }
            (None, None) => target_rel.clone(),
        };
        out.push(Guard {
            schema,
            table,
            partition: r.get(2),
            org: Column {
                name: r.get(3),
                sql_type: r.get(4),
                not_null: true,
                identity: String::new(),
                generated: false,
            },
            name,
            columns: r.get(10),
            target_oid: r.get(6),
            target: r.get(7),
            target_display,
            target_columns,
            target_types: r.get(12),
            match_full: r.get(13),
            on_update: r.get(14),
            on_delete: r.get(15),
            delete_set: r.get(16),
            deferrable: r.get(17),
            deferred: r.get(18),
        });
    }
    Ok((out, skipped))
}

/// The SQL that removes a recorded guard (triggers, functions, refs and its row).
fn remove_sql(r: &Recorded) -> Vec<String> {
    // Names as Guard derives them.
    let refs = qualify("lokadb", &r.refs);
    let parent = qualify(&r.schema, &r.table);
    let cbase = format!("lokadb_fk_{}", r.name);
    let pbase = format!("lokadb_refs_{}_{}", r.table, r.name);
    let mut sql = vec![format!(
        "DO $lokadb$ BEGIN IF to_regclass({}) IS NOT NULL THEN EXECUTE {}; EXECUTE {}; END IF; END $lokadb$",
        literal(&parent),
        literal(&format!("DROP TRIGGER IF EXISTS {} ON {parent}", ident(&fit(&cbase)))),
        literal(&format!(
            "DROP TRIGGER IF EXISTS {} ON {parent}",
            ident(&suffixed(&cbase, "_upd"))
        )),
    )];
    if let Some(target) = &r.target {
        sql.push(format!(
            "DROP TRIGGER IF EXISTS {} ON {target}",
            ident(&fit(&pbase))
        ));
        sql.push(format!(
            "DROP TRIGGER IF EXISTS {} ON {target}",
            ident(&suffixed(&pbase, "_upd"))
        ));
    }
    sql.extend([
        format!(
            "DROP FUNCTION IF EXISTS {}()",
            qualify("lokadb", &suffixed(&r.refs, "_child"))
        ),
        format!(
            "DROP FUNCTION IF EXISTS {}()",
            qualify("lokadb", &suffixed(&r.refs, "_parent"))
        ),
        format!("DROP TABLE IF EXISTS {refs}"),
        format!(
            "DROP TABLE IF EXISTS {}",
            qualify("lokadb", &suffixed(&r.refs, "_checks"))
        ),
        format!(
            "DROP FUNCTION IF EXISTS {}()",
            qualify("lokadb", &suffixed(&r.refs, "_check"))
        ),
        format!(
            "DELETE FROM lokadb.guards WHERE child_schema = {} AND child_table = {} AND constraint_name = {}",
            literal(&r.schema),
            literal(&r.table),
            literal(&r.name)
        ),
    ]);
    sql
}

/// Makes the guards match the catalog: installs missing ones, re-targets those whose
/// referenced relation changed (a foreign key re-pointed to a key map, a table renamed),
/// removes those whose foreign key or table is gone. Returns the SQL; the caller runs it in
/// its transaction.
///
/// # Errors
///
/// A catalog query failed.
pub fn sync_sql(c: &mut impl GenericClient) -> Result<Vec<String>, AdminError> {
    let (want, _) = wanted(c)?;
    let have = recorded(c)?;
    let mut sql = Vec::new();
    for r in &have {
        if !want
            .iter()
            .any(|g| g.schema == r.schema && g.table == r.table && g.name == r.name)
        {
            sql.extend(remove_sql(r));
        }
    }
    for g in &want {
        let old = have
            .iter()
            .find(|r| r.schema == g.schema && r.table == g.table && r.name == g.name);
        let definition = g.install_sql(None).join(";\n");
        if old.is_some_and(|r| r.definition == definition && r.refs == g.refs_name()) {
            continue;
        }
        let moved = old
            .and_then(|r| r.target.clone())
            .filter(|t| *t != g.target);
        sql.extend(g.install_sql(moved.as_deref()));
        sql.push(g.record_sql(&definition));
    }
    Ok(sql)
}

/// [`sync_sql`], run in the caller's transaction.
///
/// # Errors
///
/// A statement failed.
pub fn sync(c: &mut impl GenericClient) -> Result<(), super::fkeys::StepError> {
    let sql = sync_sql(c)?;
    if !sql.is_empty() {
        // DROP … IF EXISTS would say "does not exist, skipping" for each new guard.
        c.batch_execute("SET LOCAL client_min_messages = warning")?;
    }
    for s in sql {
        c.batch_execute(&s)
            .map_err(|e| super::fkeys::StepError::Pg(e, s))?;
    }
    Ok(())
}

/// Report lines: how the foreign keys of LokaDB table `schema.table` are kept for moved
/// organizations.
///
/// # Errors
///
/// A catalog query failed.
pub fn describe(
    c: &mut impl GenericClient,
    schema: &str,
    table: &str,
) -> Result<Vec<String>, AdminError> {
    let (want, skipped) = wanted(c)?;
    let mut out: Vec<String> = want
        .iter()
        .filter(|g| g.schema == schema && g.table == table)
        .map(|g| {
            format!(
                "foreign key {} is kept for moved organizations: parent check in {} ({}), references in lokadb.{}",
                g.name,
                g.target,
                g.target_columns.join(", "),
                g.refs_name()
            )
        })
        .collect();
    let prefix = format!(" of {schema}.{table}");
    out.extend(
        skipped
            .iter()
            .filter(|s| s.name.ends_with(&prefix))
            .map(|s| {
                format!(
                    "foreign key {} is not checked for moved organizations: {}",
                    s.name, s.reason
                )
            }),
    );
    Ok(out)
}

/// Removes every guard of LokaDB table `schema.table` (disable).
///
/// # Errors
///
/// A statement failed.
pub fn remove_all(
    c: &mut impl GenericClient,
    schema: &str,
    table: &str,
) -> Result<(), super::fkeys::StepError> {
    let sql: Vec<String> = recorded(c)?
        .iter()
        .filter(|r| r.schema == schema && r.table == table)
        .flat_map(remove_sql)
        .collect();
    for s in &sql {
        c.batch_execute(s)
            .map_err(|e| super::fkeys::StepError::Pg(e, s.clone()))?;
    }
    Ok(())
}
