//! What a move works on: the LokaDB tables as the cloud catalog describes them, the names
//! of an organization's partitions, and the DDL of the copies.
//!
//! An organization that has left the DEFAULT partition sits in a partitioned table of
//! its own, `<table>__lokadb_<org>` (LIST by the organization column, one value), holding
//! exactly one partition: `…_c`, a cloud table, or `…_f`, the foreign table on its
//! database. A switch detaches one and attaches the other under that table's lock, which
//! only the organization's own statements take (other organizations never wait).

use crate::admin::catalog::{self, qualify, Column};
use crate::admin::db::{ident, literal, AdminError};
use crate::admin::keymap::suffixed;
use postgres::GenericClient;

/// One LokaDB table, as a move of one organization sees it.
#[derive(Debug, Clone)]
pub struct MoveTable {
    pub schema: String,
    pub name: String,
    pub org_column: String,
    pub default_partition: String,
    /// The parent's columns, in order.
    pub columns: Vec<Column>,
    /// The key the catch-up identifies rows by (the default partition's primary key, or
    /// a unique key over NOT NULL columns), and its columns' types.
    pub key: Vec<String>,
    pub key_types: Vec<String>,
    /// The default partition's indexes and CHECK constraints, rebuilt on the copies.
    pub indexes: Vec<IndexDef>,
    pub checks: Vec<(String, String)>,
    /// The organization, as an SQL literal.
    pub org_literal: String,
    pub org: String,
    /// The parent's owner: every relation a move makes for the table is given to it, so
    /// the owner can still `ALTER TABLE` the parent (Postgres recurses into every
    /// partition and requires ownership of each).
    pub owner: String,
}

#[derive(Debug, Clone)]
pub struct IndexDef {
    pub primary: bool,
    pub unique: bool,
    pub columns: Vec<String>,
    /// `pg_get_indexdef` from `USING …` on.
    pub using: String,
    /// The parent's index it is a partition of, whose name the organization's copy takes
    /// (a migration's `DROP INDEX` then reaches it); none for the keys only DEFAULT has.
    pub parent_name: Option<String>,
}

impl MoveTable {
    /// `schema.table`, as messages, the journal and the change records name it.
    pub fn display(&self) -> String {
        catalog::plain(&self.schema, &self.name)
    }

    /// The parent (what the application uses), quoted.
    pub fn parent(&self) -> String {
        qualify(&self.schema, &self.name)
    }

    pub fn default(&self) -> String {
        qualify(&self.schema, &self.default_partition)
    }

    /// The organization's partitioned table in the parent.
    pub fn own(&self) -> String {
        qualify(&self.schema, &self.own_name())
    }

    pub fn own_name(&self) -> String {
        suffixed(&self.name, &format!("__lokadb_{}", org_key(&self.org)))
    }

    /// Its cloud partition.
    pub fn cloud_part(&self) -> String {
        qualify(&self.schema, &self.cloud_part_name())
    }

    pub fn cloud_part_name(&self) -> String {
        suffixed(&self.name, &format!("__lokadb_{}_c", org_key(&self.org)))
    }

    /// Its foreign partition (the organization's database).
    pub fn foreign_part(&self) -> String {
        qualify(&self.schema, &self.foreign_part_name())
    }

    pub fn foreign_part_name(&self) -> String {
        suffixed(&self.name, &format!("__lokadb_{}_f", org_key(&self.org)))
    }

    /// The table in the organization's database (same schema and name as the parent).
    pub fn org_table(&self) -> String {
        self.parent()
    }

    /// Its name during a logical-mode copy: a subscription writes into the table named
    /// like the published one (the cloud partition); the switch renames it.
    pub fn org_staging_table(&self) -> String {
        self.cloud_part()
    }

    /// Quoted column list.
    pub fn cols(&self) -> String {
        self.columns
            .iter()
            .map(|c| ident(&c.name))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// `alias.col, …`.
    pub fn cols_of(&self, alias: &str) -> String {
        self.columns
            .iter()
            .map(|c| format!("{alias}.{}", ident(&c.name)))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// `(alias.k1, alias.k2)`.
    pub fn key_of(&self, alias: &str) -> String {
        let k: Vec<String> = self
            .key
            .iter()
            .map(|c| format!("{alias}.{}", ident(c)))
            .collect();
        format!("({})", k.join(", "))
    }

    /// The CHECK the split puts on DEFAULT while it runs: validated, it proves DEFAULT holds
    /// none of the organization's rows, so attaching its table next to DEFAULT needs no scan
    /// of DEFAULT under its lock (docs/moving.md).
    pub fn split_check_name(&self) -> String {
        suffixed(&self.name, &format!("__lokadb_{}_s", org_key(&self.org)))
    }

    /// Adds [`Self::split_check_name`] without checking the rows DEFAULT holds (a moment's
    /// ACCESS EXCLUSIVE lock on DEFAULT).
    pub fn split_check_add(&self) -> String {
        format!(
            "ALTER TABLE {} ADD CONSTRAINT {} CHECK ({} <> {}) NOT VALID",
            self.default(),
            ident(&self.split_check_name()),
            ident(&self.org_column),
            self.org_literal
        )
    }

    /// Validates it: a scan of DEFAULT under SHARE UPDATE EXCLUSIVE, which lets every other
    /// organization read and write on.
    pub fn split_check_validate(&self) -> String {
        format!(
            "ALTER TABLE {} VALIDATE CONSTRAINT {}",
            self.default(),
            ident(&self.split_check_name())
        )
    }

    pub fn split_check_drop(&self) -> String {
        format!(
            "ALTER TABLE {} DROP CONSTRAINT IF EXISTS {}",
            self.default(),
            ident(&self.split_check_name())
        )
    }

    /// `org_column = 'org'`, for `alias`.
    pub fn org_filter(&self, alias: &str) -> String {
        format!("{alias}.{} = {}", ident(&self.org_column), self.org_literal)
    }

    /// `CREATE TABLE` of the copy in the organization's database: the columns, their
    /// NOT NULL, CHECK constraints, and the indexes (the primary key as a primary key).
    /// No defaults (they may call cloud sequences; writes through the cloud get them
    /// there) and no foreign keys (the cloud keeps them, see docs/cloud-schema.md).
    pub fn org_ddl(&self, table: &str) -> Vec<String> {
        let cols: Vec<String> = self
            .columns
            .iter()
            .map(|c| {
                format!(
                    "{} {}{}",
                    ident(&c.name),
                    c.sql_type,
                    if c.not_null { " NOT NULL" } else { "" }
                )
            })
            .collect();
        let mut sql = vec![
            format!("CREATE SCHEMA IF NOT EXISTS {}", ident(&self.schema)),
            format!("CREATE TABLE {table} ({})", cols.join(", ")),
        ];
        sql.extend(self.checks_sql(table, "TABLE"));
        sql.extend(self.indexes_sql(table, true));
        sql
    }

    /// The cloud partition: like the parent, with the default partition's indexes and a
    /// CHECK of the organization (so attaching it scans nothing).
    pub fn cloud_part_ddl(&self) -> Vec<String> {
        let part = self.cloud_part();
        let org = ident(&self.org_column);
        let mut sql = vec![format!(
            "CREATE TABLE {part} (LIKE {} INCLUDING DEFAULTS INCLUDING GENERATED INCLUDING CONSTRAINTS INCLUDING STORAGE, CONSTRAINT lokadb_org CHECK ({org} IS NOT NULL AND {org} = {}))",
            self.parent(),
            self.org_literal
        )];
        sql.push(self.owner_sql("TABLE", &part));
        sql.extend(self.indexes_sql(&part, false));
        sql
    }

    /// The organization's own partitioned table (created empty, not attached).
    pub fn own_ddl(&self) -> Vec<String> {
        vec![
            format!(
                "CREATE TABLE {} (LIKE {} INCLUDING DEFAULTS INCLUDING GENERATED INCLUDING CONSTRAINTS) PARTITION BY LIST ({})",
                self.own(),
                self.parent(),
                ident(&self.org_column)
            ),
            self.owner_sql("TABLE", &self.own()),
        ]
    }

    /// Gives `rel` (made in the cloud for this table) to the parent's owner.
    fn owner_sql(&self, kind: &str, rel: &str) -> String {
        format!("ALTER {kind} {rel} OWNER TO {}", ident(&self.owner))
    }

    /// The foreign table on the organization's server (created standalone).
    pub fn foreign_ddl(&self, server: &str) -> Vec<String> {
        let f = self.foreign_part();
        let cols: Vec<String> = self
            .columns
            .iter()
            .map(|c| {
                format!(
                    "{} {}{}",
                    ident(&c.name),
                    c.sql_type,
                    if c.not_null { " NOT NULL" } else { "" }
                )
            })
            .collect();
        let mut sql = vec![format!(
            "CREATE FOREIGN TABLE {f} ({}) SERVER {} OPTIONS (schema_name {}, table_name {})",
            cols.join(", "),
            ident(server),
            literal(&self.schema),
            literal(&self.name)
        )];
        sql.push(self.owner_sql("FOREIGN TABLE", &f));
        sql.extend(self.checks_sql(&f, "FOREIGN TABLE"));
        sql
    }

    fn checks_sql(&self, table: &str, kind: &str) -> Vec<String> {
        self.checks
            .iter()
            .map(|(name, def)| format!("ALTER {kind} {table} ADD CONSTRAINT {} {def}", ident(name)))
            .collect()
    }

    /// The indexes on `table`; `named`: under the parent's names (in the organization's
    /// database; in the cloud those names are the parent's own).
    fn indexes_sql(&self, table: &str, named: bool) -> Vec<String> {
        self.indexes
            .iter()
            .map(|i| {
                if i.primary {
                    let cols: Vec<String> = i.columns.iter().map(|c| ident(c)).collect();
                    format!("ALTER TABLE {table} ADD PRIMARY KEY ({})", cols.join(", "))
                } else {
                    format!(
                        "CREATE {}INDEX {}ON {table} {}",
                        if i.unique { "UNIQUE " } else { "" },
                        i.parent_name
                            .as_deref()
                            .filter(|_| named)
                            .map(|n| ident(n) + " ")
                            .unwrap_or_default(),
                        i.using
                    )
                }
            })
            .collect()
    }
}

/// FNV-1a 64: stable across builds and versions, so a rerun finds what a killed run made.
fn hash64(parts: &[&str]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for b in p.bytes().chain([0]) {
            h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

/// The organization as object names carry it: the id itself when it is up to 20 ASCII
/// letters and digits (readable names in the common case), otherwise `_` and a hash.
/// No plain id starts with `_` nor holds one, so `t__lokadb_a_c` can't be both
/// organization `a`'s cloud partition and organization `a_c`'s own table.
pub fn org_key(org: &str) -> String {
    if !org.is_empty() && org.len() <= 20 && org.bytes().all(|b| b.is_ascii_alphanumeric()) {
        org.to_owned()
    } else {
        format!("_{:016x}", hash64(&[org]))
    }
}

/// A short, stable tag of an organization id, for names with a restricted alphabet
/// (replication slots, publications).
pub fn tag(org: &str) -> String {
    format!("lokadb_move_{:016x}", hash64(&[org]))
}

/// The capture function of a table for an organization (one per source database); the
/// hash keeps `(org, schema, table)` triples that read alike apart.
pub fn capture_function(t: &MoveTable) -> String {
    let h = hash64(&[&t.org, &t.schema, &t.name]) >> 32;
    qualify(
        "lokadb",
        &suffixed(
            &format!("capture_{}_{}", org_key(&t.org), t.name),
            &format!("_{h:08x}"),
        ),
    )
}

/// Every LokaDB table, read for a move of `org`.
///
/// # Errors
///
/// No LokaDB table, a table still being enabled, or one without a usable key.
pub fn tables(c: &mut impl GenericClient, org: &str) -> Result<Vec<MoveTable>, AdminError> {
    let rows = c.query(
        "SELECT schema_name::text, table_name::text, org_column::text, default_partition::text,
                state, format('%I.%I', schema_name, default_partition)::regclass::oid,
                format('%I.%I', schema_name, table_name)::regclass::oid
         FROM lokadb.tables ORDER BY enabled_at, schema_name, table_name",
        &[],
    )?;
    if rows.is_empty() {
        return Err(AdminError::usage(
            "there is no LokaDB table to move (lokadb enable TABLE makes one)",
        ));
    }
    let mut out = Vec::new();
    for r in &rows {
        let (schema, name): (String, String) = (r.get(0), r.get(1));
        let state: String = r.get(4);
        if state != "enabled" {
            return Err(AdminError::usage(format!(
                "{schema}.{name} is still being enabled; run lokadb enable {schema}.{name} again to finish it first"
            )));
        }
        let default_oid: u32 = r.get(5);
        let parent_oid: u32 = r.get(6);
        let parent = catalog::table(c, parent_oid)?;
        let idx = catalog::indexes(c, default_oid)?;
        let org_column: String = r.get(2);
        let usable: Vec<&catalog::Index> = idx
            .iter()
            .filter(|i| i.valid && !i.partial && !i.expressions)
            .collect();
        let key_index = usable.iter().find(|i| i.primary).or_else(|| {
            usable.iter().find(|i| {
                i.unique
                    && i.columns
                        .iter()
                        .all(|c| parent.column(c).is_some_and(|c| c.not_null))
            })
        });
        let Some(key_index) = key_index else {
            return Err(AdminError::usage(format!(
                "{schema}.{name} has no primary key nor unique key over NOT NULL columns: a move identifies changed rows by one; add one first"
            )));
        };
        // The partition bounds and CHECKs compare the id cast to the column's type: an id
        // that prints otherwise ('02' for a bigint 2) would name another organization's rows.
        if let Some(g) = parent.columns.iter().find(|c| c.generated) {
            return Err(AdminError::usage(format!(
                "{schema}.{name}.{} is a generated column: moving tables with generated columns is not supported yet. Nothing was changed",
                g.name
            )));
        }
        if let Some(col) = parent.column(&org_column) {
            let ty = col.sql_type.split(" COLLATE ").next().unwrap_or_default();
            let canonical: Option<String> = c
                .query_one(&format!("SELECT ($1::text)::{ty}::text"), &[&org])
                .map_err(|e| {
                    AdminError::usage(format!(
                        "organization id {org:?} is not a value of {schema}.{name}.{org_column} ({}): {}",
                        col.sql_type,
                        crate::admin::db::describe(&e)
                    ))
                })?
                .get(0);
            if canonical.as_deref() != Some(org) {
                return Err(AdminError::usage(format!(
                    "organization id {org:?} reads as {canonical:?} in {schema}.{name}.{org_column} ({}); register the organization by that value",
                    col.sql_type
                )));
            }
        }
        let key = key_index.columns.clone();
        let key_types = key
            .iter()
            .map(|k| {
                parent
                    .column(k)
                    .map(|c| c.sql_type.clone())
                    .unwrap_or_default()
            })
            .collect();
        // Every valid index, partial and expression ones too: the organization's table gets
        // the cloud's indexes (lokadb verify compares them).
        let indexes = idx
            .iter()
            .filter(|i| i.valid)
            .map(|i| {
                if i.using.starts_with("USING ") {
                    let parent_name: Option<String> = c
                        .query_opt(
                            "SELECT p.relname::text FROM pg_inherits h JOIN pg_class p ON p.oid = h.inhparent
                             WHERE h.inhrelid = $1",
                            &[&i.oid],
                        )?
                        .map(|r| r.get(0));
                    Ok(IndexDef {
                        primary: i.primary,
                        unique: i.unique,
                        columns: i.columns.clone(),
                        using: i.using.clone(),
                        parent_name,
                    })
                } else {
                    Err(AdminError::failed(format!(
                        "{schema}.{name}: can't read the definition of index {} ({}); please report it",
                        i.name, i.def
                    )))
                }
            })
            .collect::<Result<_, _>>()?;
        let checks = c
            .query(
                "SELECT conname::text, pg_get_constraintdef(oid) FROM pg_constraint
                 WHERE conrelid = $1 AND contype = 'c' ORDER BY conname",
                &[&parent_oid],
            )?
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect();
        out.push(MoveTable {
            schema,
            name,
            org_column,
            default_partition: r.get(3),
            columns: parent.columns,
            key,
            key_types,
            indexes,
            checks,
            org_literal: literal(org),
            org: org.to_owned(),
            owner: parent.owner,
        });
    }
    Ok(out)
}

/// Where an organization's rows of `t` are now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Place {
    /// In the DEFAULT partition (never moved).
    Default,
    /// In its own partitioned table, in the cloud partition.
    Cloud,
    /// In its own partitioned table, in the foreign partition.
    Foreign,
}

/// Where `t`'s rows of the organization are, from the catalog.
///
/// # Errors
///
/// The query failed, or the catalog is in a state no move leaves.
pub fn place(c: &mut impl GenericClient, t: &MoveTable) -> Result<Place, AdminError> {
    let r = c.query_one(
        "SELECT (SELECT inhparent FROM pg_inherits WHERE inhrelid = to_regclass($1)) = to_regclass($2),
                EXISTS (SELECT 1 FROM pg_inherits WHERE inhparent = to_regclass($1) AND inhrelid = to_regclass($3)),
                EXISTS (SELECT 1 FROM pg_inherits WHERE inhparent = to_regclass($1) AND inhrelid = to_regclass($4))",
        &[&t.own(), &t.parent(), &t.cloud_part(), &t.foreign_part()],
    )?;
    let attached: Option<bool> = r.get(0);
    if attached != Some(true) {
        return Ok(Place::Default);
    }
    match (r.get::<_, bool>(1), r.get::<_, bool>(2)) {
        (true, false) => Ok(Place::Cloud),
        (false, true) => Ok(Place::Foreign),
        _ => Err(AdminError::failed(format!(
            "{}: the organization's partition {} holds neither exactly its cloud nor its foreign partition; inspect it (\\d+ {})",
            t.display(),
            t.own(),
            t.own()
        ))),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn table(org: &str, name: &str) -> MoveTable {
        let col = |n: &str, t: &str, nn: bool| Column {
            name: n.to_owned(),
            sql_type: t.to_owned(),
            not_null: nn,
            identity: String::new(),
            generated: false,
        };
        MoveTable {
            schema: "public".to_owned(),
            name: name.to_owned(),
            org_column: "organization_id".to_owned(),
            default_partition: format!("{name}__lokadb_default"),
            columns: vec![
                col("id", "bigint", true),
                col("organization_id", "bigint", true),
                col("title", "text", false),
            ],
            key: vec!["id".to_owned()],
            key_types: vec!["bigint".to_owned()],
            indexes: vec![IndexDef {
                primary: true,
                unique: true,
                columns: vec!["id".to_owned()],
                using: "USING btree (id)".to_owned(),
                parent_name: None,
            }],
            checks: vec![],
            org_literal: literal(org),
            org: org.to_owned(),
            owner: "app".to_owned(),
        }
    }

    #[test]
    fn names_fit_and_stay_distinct_per_organization() {
        let long = "a".repeat(60);
        let a = table("42", &long);
        let b = table("43", &long);
        for n in [a.own_name(), a.cloud_part_name(), a.foreign_part_name()] {
            assert!(n.len() <= 63, "{n}");
        }
        assert_ne!(a.cloud_part_name(), b.cloud_part_name());
        assert_ne!(a.cloud_part_name(), a.foreign_part_name());
        assert_eq!(
            table("42", "documents").cloud_part_name(),
            "documents__lokadb_42_c"
        );
    }

    #[test]
    fn organizations_that_read_alike_get_distinct_names() {
        let a = table("a", "t");
        let ac = table("a_c", "t");
        let names = |t: &MoveTable| [t.own_name(), t.cloud_part_name(), t.foreign_part_name()];
        for x in names(&a) {
            for y in names(&ac) {
                assert_ne!(x, y);
            }
        }
        assert_eq!(a.cloud_part_name(), "t__lokadb_a_c");
        assert!(
            ac.own_name().starts_with("t__lokadb__"),
            "{}",
            ac.own_name()
        );
        let long = table(&"9".repeat(200), &"n".repeat(63));
        for n in names(&long) {
            assert!(n.len() <= 63, "{n}");
        }
        assert_ne!(
            capture_function(&table("a_b", "t")),
            capture_function(&table("a", "b_t"))
        );
        assert!(capture_function(&long).len() <= 63 + "\"lokadb\".\"\"".len());
    }

    #[test]
    fn slot_tags_are_stable_and_valid_slot_names() {
        let t = tag("acme/../corp ü");
        assert_eq!(t, tag("acme/../corp ü"));
        assert_ne!(t, tag("acme"));
        assert!(t.len() <= 63);
        assert!(t
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_'));
    }

    #[test]
    fn the_organization_copy_has_no_defaults_and_keeps_the_key() {
        let ddl = table("42", "documents").org_ddl("\"public\".\"documents\"");
        assert_eq!(
            ddl[1],
            "CREATE TABLE \"public\".\"documents\" (\"id\" bigint NOT NULL, \"organization_id\" bigint NOT NULL, \"title\" text)"
        );
        assert_eq!(
            ddl[2],
            "ALTER TABLE \"public\".\"documents\" ADD PRIMARY KEY (\"id\")"
        );
    }
}
