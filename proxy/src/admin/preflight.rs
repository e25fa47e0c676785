//! `lokadb enable`'s preflight: what the design can keep of a table, and the refusals
//! (usage errors, nothing changed) for what it cannot. Checks that read every row
//! (NULL organizations) are in `enable`, outside the swap's lock.

use super::catalog::{self, Column, Index, Table, View};
use super::db::AdminError;
use super::keymap::KeyMap;
use postgres::GenericClient;

/// What the design keeps of a table, decided by [`check`].
#[derive(Debug)]
pub struct Analysis {
    pub table: Table,
    pub org: Column,
    /// Unique keys without the organization column, each kept by a key map.
    pub keymaps: Vec<KeyMap>,
    /// Unique keys with the organization column: they stay on the default partition,
    /// where they hold globally (an organization's rows are all in one partition).
    pub native_keys: Vec<Index>,
    /// Non-unique indexes, recreated on the parent.
    pub indexes: Vec<Index>,
    pub triggers: Vec<catalog::Trigger>,
    pub views: Vec<View>,
    pub sequences: Vec<catalog::OwnedSequence>,
}

/// Checks that `t` can become a LokaDB table partitioned by `org_column`.
///
/// # Errors
///
/// A usage error naming what the design cannot keep.
pub fn check(
    c: &mut impl GenericClient,
    t: Table,
    org_column: &str,
) -> Result<Analysis, AdminError> {
    let name = t.display();
    if t.is_partition {
        return Err(AdminError::usage(format!(
            "{name} is a partition of another table: enable the partitioned table, or detach it first"
        )));
    }
    match t.relkind.as_str() {
        "r" => {}
        "p" => {
            return Err(AdminError::usage(format!(
                "{name} is already partitioned: lokadb enable partitions a plain table by organization itself"
            )))
        }
        _ => {
            return Err(AdminError::usage(format!(
                "{name} is not a plain table (a view, sequence, foreign or materialized table?)"
            )))
        }
    }
    if t.inherits {
        return Err(AdminError::usage(format!(
            "{name} uses table inheritance, which a partitioned table cannot keep"
        )));
    }
    let Some(org) = t.column(org_column).cloned() else {
        return Err(AdminError::usage(format!(
            "{name} has no column {org_column} (the organization column; choose another with --org-column)"
        )));
    };
    if t.row_security
        || c.query_one(
            "SELECT count(*) FROM pg_policy WHERE polrelid = $1",
            &[&t.oid],
        )?
        .get::<_, i64>(0)
            > 0
    {
        return Err(AdminError::usage(format!(
            "{name} has row-level security or policies, which enable does not carry over yet: drop them, enable, and create them again"
        )));
    }
    let rules: Vec<String> = c
        .query(
            "SELECT rulename::text FROM pg_rewrite WHERE ev_class = $1 AND rulename <> '_RETURN'",
            &[&t.oid],
        )?
        .iter()
        .map(|r| r.get(0))
        .collect();
    if !rules.is_empty() {
        return Err(AdminError::usage(format!(
            "{name} has rules ({}), which enable does not carry over",
            rules.join(", ")
        )));
    }
    let users = catalog::row_type_users(c, &t)?;
    if !users.is_empty() {
        return Err(AdminError::usage(format!(
            "{name}'s row type is used by {}: they are bound to the table that becomes the default partition, and would not accept the rows of other partitions; change them to take the columns they need",
            users.join(", ")
        )));
    }
    let views = catalog::dependent_views(c, t.oid)?;
    if let Some(m) = views.iter().find(|v| v.relkind != "v") {
        return Err(AdminError::usage(format!(
            "materialized view {} reads {name}: it would keep reading the default partition only; drop it, enable, and create it again",
            m.qualified
        )));
    }
    let mut keymaps: Vec<KeyMap> = Vec::new();
    let mut native_keys = Vec::new();
    let mut indexes = Vec::new();
    for i in catalog::indexes(c, t.oid)? {
        if !i.valid {
            return Err(AdminError::usage(format!(
                "index {} of {name} is invalid (a failed CREATE INDEX CONCURRENTLY?): drop or rebuild it first",
                i.name
            )));
        }
        if let Some((con, kind)) = &i.constraint {
            if kind == "x" {
                return Err(AdminError::usage(format!(
                    "{name} has exclusion constraint {con}: Postgres cannot keep one across partitions and the design cannot either; drop it first"
                )));
            }
        }
        if !i.unique {
            indexes.push(i);
            continue;
        }
        if i.columns.iter().any(|c| c == org_column) {
            native_keys.push(i);
            continue;
        }
        let why = if i.deferrable {
            Some("deferrable")
        } else if i.partial {
            Some("partial")
        } else if i.expressions {
            Some("on expressions")
        } else if i.nulls_not_distinct {
            Some("NULLS NOT DISTINCT")
        } else {
            None
        };
        if let Some(why) = why {
            return Err(AdminError::usage(format!(
                "{name} has a unique key the design can't keep: {} is {why} and does not include {org_column}; a key map keeps only plain unique keys on columns. Add {org_column} to it, or make it a plain unique key",
                i.key_name()
            )));
        }
        let mut set = i.columns.clone();
        set.sort();
        let known = keymaps.iter().any(|k| {
            let mut s: Vec<String> = k.columns.iter().map(|c| c.name.clone()).collect();
            s.sort();
            s == set
        });
        if !known {
            let cols = i
                .columns
                .iter()
                .map(|n| t.column(n).cloned().expect("index column"))
                .collect();
            keymaps.push(KeyMap::new(
                &t.schema,
                &t.name,
                i.key_name(),
                cols,
                org.clone(),
            ));
        }
    }
    // LokaDB's own triggers on a cloud table (the refs check of a foreign key kept across
    // foreign partitions, see guards.rs) stay where they are: on the table, which becomes
    // the default partition; enable points them at the key map afterwards.
    let triggers: Vec<catalog::Trigger> = catalog::triggers(c, t.oid)?
        .into_iter()
        .filter(|tr| !tr.name.starts_with("lokadb_"))
        .collect();
    let sequences = catalog::owned_sequences(c, t.oid)?;
    Ok(Analysis {
        table: t,
        org,
        keymaps,
        native_keys,
        indexes,
        triggers,
        views,
        sequences,
    })
}
