//! `lokadb disable TABLE`: the reverse of enable, when every organization's rows are back in
//! the DEFAULT partition. Foreign keys go back from the key maps to the table (three short
//! transactions each, as on enable), then one short transaction detaches the default
//! partition, drops the parent and gives the table back its name, indexes' names,
//! identity, triggers, owner, grants and comment, and drops the key maps.

use super::catalog::{self, qualify, View};
use super::db::{connect, ident, literal, AdminError};
use super::enable::{gate_name, registered};
use super::fkeys::{self, run_all, with_lock_retry, StepError};
use super::guards;
use super::keymap::suffixed;
use super::migrations::require_current;
use postgres::GenericClient;

/// `lokadb disable`: returns the report (or the plan).
///
/// # Errors
///
/// Not a LokaDB table, or an organization not in the default partition (usage): nothing
/// changed. A failure midway leaves a state a rerun finishes.
pub fn disable(dsn: &str, table: &str, plan: bool) -> Result<String, AdminError> {
    let mut client = connect(dsn)?;
    require_current(&mut client)?;
    let t = catalog::resolve(&mut client, table)?;
    let Some(r) = registered(&mut client, &t)? else {
        return Err(AdminError::usage(format!(
            "{} is not a LokaDB table (lokadb enable makes one)",
            t.display()
        )));
    };
    let name = qualify(&r.schema, &r.table);
    if r.table != t.name {
        return Err(AdminError::usage(format!(
            "{} is the default partition of LokaDB table {}: disable it",
            t.display(),
            catalog::plain(&r.schema, &r.table)
        )));
    }
    let part = qualify(&r.schema, &r.partition);
    let others: Vec<String> = catalog::partitions(&mut client, t.oid)?
        .into_iter()
        .filter(|(_, default, _)| !default)
        .map(|(n, _, kind)| {
            if kind == "f" {
                format!("{n} (foreign)")
            } else {
                n
            }
        })
        .collect();
    if !others.is_empty() {
        return Err(AdminError::usage(format!(
            "{} has partitions other than the default one: {}; move those organizations back (lokadb move-back) and fold them into DEFAULT (lokadb fold) first",
            catalog::plain(&r.schema, &r.table),
            others.join(", ")
        )));
    }
    let keymaps: Vec<(String, u32)> = client
        .query(
            "SELECT k.keymap::text, c.oid FROM lokadb.keys k
             JOIN pg_class c ON c.relname = k.keymap
             JOIN pg_namespace n ON n.oid = c.relnamespace AND n.nspname = 'lokadb'
             WHERE k.schema_name = $1 AND k.table_name = $2 ORDER BY 1",
            &[&r.schema, &r.table],
        )?
        .iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect();
    let mut fks = Vec::new();
    for (_, oid) in &keymaps {
        fks.extend(catalog::referencing(&mut client, *oid)?);
    }
    if plan {
        let mut out = vec![format!(
            "-- lokadb disable {}: the SQL it would run\n",
            catalog::plain(&r.schema, &r.table)
        )];
        if !fks.is_empty() {
            out.push("-- 1. Foreign keys back to the table: three short transactions each.".into());
            for fk in &fks {
                for step in fkeys::repoint_sql(fk, &part) {
                    out.push(format!("{};", step.join(";\n")));
                }
            }
        }
        let mut tx = client.transaction()?;
        out.push(format!(
            "\n-- 2. One transaction, retried when a lock is not granted in {0}.\nBEGIN;\nSET LOCAL lock_timeout = '{0}';\nLOCK TABLE {name} IN ACCESS EXCLUSIVE MODE;",
            fkeys::LOCK_TIMEOUT
        ));
        for s in swap_back_sql(&mut tx, &r, &keymaps)? {
            out.push(format!("{s};"));
        }
        out.push("COMMIT;".into());
        tx.rollback()?;
        return Ok(out.join("\n"));
    }
    let mut report = Vec::new();
    for fk in &fks {
        fkeys::repoint(&mut client, fk, &part, &fkeys::unrecord_sql(fk))?;
        report.push(format!(
            "foreign key {} of {} references {} again",
            fk.name,
            fk.child_display(),
            catalog::plain(&r.schema, &r.table)
        ));
    }
    with_lock_retry(
        &mut client,
        &format!("disabling {}", catalog::plain(&r.schema, &r.table)),
        |tx| {
            let lock = format!("LOCK TABLE {name} IN ACCESS EXCLUSIVE MODE");
            tx.batch_execute(&lock)
                .map_err(|e| StepError::Pg(e, lock))?;
            // Its guards go; guards of other tables whose foreign keys referenced its key
            // maps are pointed at the table again.
            guards::remove_all(tx, &r.schema, &r.table)?;
            let sql = swap_back_sql(tx, &r, &keymaps)?;
            run_all(tx, &sql)?;
            guards::sync(tx)
        },
    )?;
    report.push(format!(
        "{} is a plain table again (key maps dropped: {})",
        catalog::plain(&r.schema, &r.table),
        if keymaps.is_empty() {
            "none".to_owned()
        } else {
            keymaps
                .iter()
                .map(|(k, _)| format!("lokadb.{k}"))
                .collect::<Vec<_>>()
                .join(", ")
        }
    ));
    Ok(report.join("\n"))
}

/// The statements of disable's transaction, after `LOCK`.
fn swap_back_sql(
    c: &mut impl GenericClient,
    r: &super::enable::Registered,
    keymaps: &[(String, u32)],
) -> Result<Vec<String>, AdminError> {
    let name = qualify(&r.schema, &r.table);
    let parent_oid: u32 = c
        .query_one("SELECT $1::text::regclass::oid", &[&name])?
        .get(0);
    let parent = catalog::table(c, parent_oid)?;
    let part = qualify(&r.schema, &r.partition);
    let part_oid: u32 = c
        .query_one("SELECT $1::text::regclass::oid", &[&part])?
        .get(0);
    let sequences = catalog::owned_sequences(c, parent_oid)?;
    let triggers: Vec<catalog::Trigger> = catalog::triggers(c, parent_oid)?
        .into_iter()
        .filter(|t| !t.name.starts_with("lokadb_"))
        .collect();
    let views = catalog::dependent_views(c, parent_oid)?;
    // Each parent index and the partition index attached to it.
    let index_names: Vec<(String, String)> = c
        .query(
            "SELECT format('%I.%I', n.nspname, ci.relname), pi.relname::text
             FROM pg_index x JOIN pg_class pi ON pi.oid = x.indexrelid
             JOIN pg_inherits h ON h.inhparent = x.indexrelid
             JOIN pg_class ci ON ci.oid = h.inhrelid AND ci.relnamespace = pi.relnamespace
             JOIN pg_index xi ON xi.indexrelid = ci.oid AND xi.indrelid = $2
             JOIN pg_namespace n ON n.oid = ci.relnamespace
             WHERE x.indrelid = $1 ORDER BY 2",
            &[&parent_oid, &part_oid],
        )?
        .iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect();
    let mut sql = Vec::new();
    let mut seq_grants = Vec::new();
    for s in &sequences {
        let col = ident(&s.column);
        if s.identity {
            let oid: u32 = c
                .query_one("SELECT $1::text::regclass::oid", &[&s.qualified])?
                .get(0);
            seq_grants.extend(catalog::grants_sql(
                c,
                oid,
                &s.qualified,
                &parent.owner,
                "SEQUENCE ",
            )?);
            sql.push(format!(
                "ALTER TABLE {name} ALTER COLUMN {col} DROP IDENTITY"
            ));
        } else {
            sql.push(format!(
                "ALTER SEQUENCE {} OWNED BY {part}.{col}",
                s.qualified
            ));
        }
    }
    let tmp = suffixed(&r.table, "__lokadb_parent");
    sql.push(format!("ALTER TABLE {name} DETACH PARTITION {part}"));
    sql.push(format!("ALTER TABLE {name} RENAME TO {}", ident(&tmp)));
    sql.push(format!("ALTER TABLE {part} RENAME TO {}", ident(&r.table)));
    // `name` now means the table again.
    sql.extend(views.iter().map(View::replace_sql));
    sql.push(format!("DROP TABLE {}", qualify(&r.schema, &tmp)));
    sql.push(format!(
        "DROP FUNCTION {}()",
        qualify("lokadb", &gate_name(&parent))
    ));
    for (km, _) in keymaps {
        let km = qualify("lokadb", km);
        sql.push(format!("DROP TABLE {km}"));
        sql.push(format!("DROP FUNCTION {km}()"));
    }
    for (child, parent_name) in &index_names {
        sql.push(format!(
            "ALTER INDEX {child} RENAME TO {}",
            ident(parent_name)
        ));
    }
    for s in sequences.iter().filter(|s| s.identity) {
        let kind = if parent.column(&s.column).is_some_and(|c| c.identity == "a") {
            "ALWAYS"
        } else {
            "BY DEFAULT"
        };
        sql.push(format!(
            "ALTER TABLE {name} ALTER COLUMN {} ADD GENERATED {kind} AS IDENTITY (SEQUENCE NAME {} {})",
            ident(&s.column),
            s.qualified,
            s.options
        ));
        sql.push(format!(
            "SELECT setval({}, {}, {})",
            literal(&s.qualified),
            s.last_value,
            s.is_called
        ));
    }
    for tr in &triggers {
        // Detaching removed the clones; the definitions name `name`, the table again.
        sql.extend(tr.recreate_sql(&name));
    }
    sql.push(format!(
        "ALTER TABLE {name} OWNER TO {}",
        ident(&parent.owner)
    ));
    sql.push(format!(
        "COMMENT ON TABLE {name} IS {}",
        parent
            .comment
            .as_deref()
            .map_or_else(|| "NULL".to_owned(), literal)
    ));
    // The table's own ACL still holds what it had before enable; when the parent's
    // differs (grants changed since), the table gets the parent's.
    let same_acl: bool = c
        .query_one(
            "SELECT (SELECT array_agg(x::text ORDER BY x::text) FROM unnest(p.relacl) x)
                    IS NOT DISTINCT FROM
                    (SELECT array_agg(x::text ORDER BY x::text) FROM unnest(t.relacl) x)
             FROM pg_class p, pg_class t WHERE p.oid = $1 AND t.oid = $2",
            &[&parent_oid, &part_oid],
        )?
        .get(0);
    if !same_acl {
        let grantees: Vec<String> = c
            .query(
                "SELECT DISTINCT CASE WHEN a.grantee = 0 THEN 'PUBLIC'
                        ELSE quote_ident(pg_get_userbyid(a.grantee)) END
                 FROM pg_class c, aclexplode(c.relacl) a WHERE c.oid = $1",
                &[&part_oid],
            )?
            .iter()
            .map(|row| row.get(0))
            .collect();
        for g in grantees {
            sql.push(format!("REVOKE ALL ON {name} FROM {g}"));
        }
        let grants = catalog::grants_sql(c, parent_oid, &name, &parent.owner, "")?;
        if grants.is_empty() {
            // The parent had the default ACL: the owner's privileges.
            sql.push(format!("GRANT ALL ON {name} TO {}", ident(&parent.owner)));
        }
        sql.extend(grants);
    }
    sql.extend(seq_grants);
    sql.push(format!(
        "DELETE FROM lokadb.tables WHERE schema_name = {} AND table_name = {}",
        literal(&r.schema),
        literal(&r.table)
    ));
    Ok(sql)
}
