//! `lokadb verify`'s schema check: a LokaDB table in the cloud against the organization's
//! table in its database — columns (name, type, NOT NULL), CHECK constraints and indexes.
//!
//! What the organization's table must have is what `move-org` and the migrations give it:
//! the parent's columns without their defaults (writes through the cloud get the cloud's;
//! docs/migrations.md), the parent's CHECKs by name, the parent's indexes by name (a later
//! `DROP INDEX` reaches it by that name) and the DEFAULT partition's unique keys, which the
//! parent cannot carry, by definition only (their names differ by construction).

use crate::admin::db::AdminError;
use postgres::GenericClient;
use std::collections::BTreeMap;

/// A table's schema as compared.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Schema {
    /// name -> (type with a non-default collation, NOT NULL).
    pub columns: BTreeMap<String, (String, bool)>,
    /// name -> definition.
    pub checks: BTreeMap<String, String>,
    pub indexes: Vec<Index>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Index {
    pub name: String,
    /// `[UNIQUE ]USING method (…)[ WHERE …]`: without its name and table.
    pub def: String,
    /// Matched by name (the parent's indexes); otherwise by definition alone.
    pub by_name: bool,
}

const COLUMNS: &str = "SELECT a.attname::text,
        format_type(a.atttypid, a.atttypmod)
        || CASE WHEN a.attcollation <> 0 AND a.attcollation <> ty.typcollation
                THEN ' COLLATE ' || a.attcollation::regcollation::text ELSE '' END,
        a.attnotnull
    FROM pg_attribute a JOIN pg_type ty ON ty.oid = a.atttypid
    WHERE a.attrelid = to_regclass($1) AND a.attnum > 0 AND NOT a.attisdropped";

const CHECKS: &str = "SELECT conname::text, pg_get_constraintdef(oid) FROM pg_constraint
    WHERE conrelid = to_regclass($1) AND contype = 'c'";

/// Indexes of `$1`; with `$2`, only the unique ones that no index of a parent table owns.
const INDEXES: &str = "SELECT ic.relname::text,
        CASE WHEN i.indisunique THEN 'UNIQUE ' ELSE '' END
        || substr(pg_get_indexdef(i.indexrelid),
                  length(format('CREATE %sINDEX %I ON %s%I.%I ',
                                CASE WHEN i.indisunique THEN 'UNIQUE ' END, ic.relname,
                                CASE WHEN ic.relkind = 'I' THEN 'ONLY ' END,
                                tn.nspname, t.relname)) + 1)
    FROM pg_index i JOIN pg_class ic ON ic.oid = i.indexrelid
    JOIN pg_class t ON t.oid = i.indrelid JOIN pg_namespace tn ON tn.oid = t.relnamespace
    WHERE i.indrelid = to_regclass($1)
      AND (NOT $2 OR (i.indisunique
                      AND NOT EXISTS (SELECT 1 FROM pg_inherits h WHERE h.inhrelid = i.indexrelid)))";

fn columns(
    c: &mut impl GenericClient,
    rel: &str,
) -> Result<BTreeMap<String, (String, bool)>, AdminError> {
    Ok(c.query(COLUMNS, &[&rel])?
        .iter()
        .map(|r| (r.get(0), (r.get(1), r.get(2))))
        .collect())
}

fn checks(c: &mut impl GenericClient, rel: &str) -> Result<BTreeMap<String, String>, AdminError> {
    Ok(c.query(CHECKS, &[&rel])?
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect())
}

fn indexes(
    c: &mut impl GenericClient,
    rel: &str,
    keys_only: bool,
    by_name: bool,
) -> Result<Vec<Index>, AdminError> {
    Ok(c.query(INDEXES, &[&rel, &keys_only])?
        .iter()
        .map(|r| Index {
            name: r.get(0),
            def: r.get(1),
            by_name,
        })
        .collect())
}

/// What the organization's table must be: `parent` (the LokaDB table) and its DEFAULT
/// partition `default` in the cloud, both quoted and qualified.
///
/// # Errors
///
/// A query failed.
pub fn cloud(
    c: &mut impl GenericClient,
    parent: &str,
    default: &str,
) -> Result<Schema, AdminError> {
    let mut idx = indexes(c, parent, false, true)?;
    idx.extend(indexes(c, default, true, false)?);
    Ok(Schema {
        columns: columns(c, parent)?,
        checks: checks(c, parent)?,
        indexes: idx,
    })
}

/// The organization's table `table` (quoted and qualified) in its database.
///
/// # Errors
///
/// A query failed.
pub fn organization(c: &mut impl GenericClient, table: &str) -> Result<Schema, AdminError> {
    Ok(Schema {
        columns: columns(c, table)?,
        checks: checks(c, table)?,
        indexes: indexes(c, table, false, true)?,
    })
}

fn null(not_null: bool) -> &'static str {
    if not_null {
        " NOT NULL"
    } else {
        ""
    }
}

/// Every difference of the organization's table `org` from the cloud's `cloud`, one line
/// each; empty when they agree. Defaults are not compared (organizations' tables have none).
pub fn differences(cloud: &Schema, org: &Schema) -> Vec<String> {
    let mut out = Vec::new();
    for (name, (ty, nn)) in &cloud.columns {
        match org.columns.get(name) {
            None => out.push(format!(
                "column {name} ({ty}{}) is missing in its database",
                null(*nn)
            )),
            Some((oty, onn)) if oty != ty || onn != nn => out.push(format!(
                "column {name} is {ty}{} in the cloud, {oty}{} in its database",
                null(*nn),
                null(*onn)
            )),
            Some(_) => {}
        }
    }
    for (name, (ty, nn)) in &org.columns {
        if !cloud.columns.contains_key(name) {
            out.push(format!(
                "column {name} ({ty}{}) is in its database only",
                null(*nn)
            ));
        }
    }
    for (name, def) in &cloud.checks {
        match org.checks.get(name) {
            None => out.push(format!("check {name} ({def}) is missing in its database")),
            Some(o) if o != def => out.push(format!(
                "check {name} is {def} in the cloud, {o} in its database"
            )),
            Some(_) => {}
        }
    }
    for (name, def) in &org.checks {
        if !cloud.checks.contains_key(name) {
            out.push(format!("check {name} ({def}) is in its database only"));
        }
    }
    // Indexes: the parent's by name first, then the keys by definition among those left.
    let mut left: Vec<&Index> = org.indexes.iter().collect();
    let mut take = |pred: &dyn Fn(&Index) -> bool| -> Option<&Index> {
        let i = left.iter().position(|o| pred(o))?;
        Some(left.remove(i))
    };
    let mut unmatched = Vec::new();
    for i in cloud.indexes.iter().filter(|i| i.by_name) {
        match take(&|o: &Index| o.name == i.name) {
            Some(o) if o.def != i.def => out.push(format!(
                "index {} is {} in the cloud, {} in its database",
                i.name, i.def, o.def
            )),
            Some(_) => {}
            None => unmatched.push(i),
        }
    }
    for i in cloud.indexes.iter().filter(|i| !i.by_name) {
        if take(&|o: &Index| o.def == i.def).is_none() {
            out.push(format!(
                "key {} ({}) is missing in its database",
                i.name, i.def
            ));
        }
    }
    for i in unmatched {
        match take(&|o: &Index| o.def == i.def) {
            Some(o) => out.push(format!(
                "index {} ({}) is named {} in its database",
                i.name, i.def, o.name
            )),
            None => out.push(format!(
                "index {} ({}) is missing in its database",
                i.name, i.def
            )),
        }
    }
    for o in left {
        out.push(format!(
            "index {} ({}) is in its database only",
            o.name, o.def
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schema(
        cols: &[(&str, &str, bool)],
        checks: &[(&str, &str)],
        idx: &[(&str, &str, bool)],
    ) -> Schema {
        Schema {
            columns: cols
                .iter()
                .map(|(n, t, nn)| ((*n).to_owned(), ((*t).to_owned(), *nn)))
                .collect(),
            checks: checks
                .iter()
                .map(|(n, d)| ((*n).to_owned(), (*d).to_owned()))
                .collect(),
            indexes: idx
                .iter()
                .map(|(n, d, by_name)| Index {
                    name: (*n).to_owned(),
                    def: (*d).to_owned(),
                    by_name: *by_name,
                })
                .collect(),
        }
    }

    fn cloud() -> Schema {
        schema(
            &[("id", "bigint", true), ("title", "text", false)],
            &[("title_len", "CHECK ((length(title) < 100))")],
            &[
                ("t_title_idx", "USING btree (title)", true),
                ("t_pkey__lokadb_default", "UNIQUE USING btree (id)", false),
            ],
        )
    }

    #[test]
    fn the_same_schema_has_no_difference_whatever_the_key_is_called() {
        let mut org = cloud();
        org.indexes[1].name = "t_pkey".to_owned();
        org.indexes[1].by_name = true;
        org.indexes.reverse();
        assert_eq!(differences(&cloud(), &org), Vec::<String>::new());
    }

    #[test]
    fn every_kind_of_difference_is_said() {
        let org = schema(
            &[("id", "integer", true), ("extra", "int", false)],
            &[
                ("title_len", "CHECK ((length(title) < 50))"),
                ("mine", "CHECK (true)"),
            ],
            &[
                ("t_title_idx2", "USING btree (title)", true),
                ("t_extra_idx", "USING btree (extra)", true),
            ],
        );
        assert_eq!(
            differences(&cloud(), &org),
            vec![
                "column id is bigint NOT NULL in the cloud, integer NOT NULL in its database",
                "column title (text) is missing in its database",
                "column extra (int) is in its database only",
                "check title_len is CHECK ((length(title) < 100)) in the cloud, CHECK ((length(title) < 50)) in its database",
                "check mine (CHECK (true)) is in its database only",
                "key t_pkey__lokadb_default (UNIQUE USING btree (id)) is missing in its database",
                "index t_title_idx (USING btree (title)) is named t_title_idx2 in its database",
                "index t_extra_idx (USING btree (extra)) is in its database only",
            ]
        );
    }
}
