//! `lokadb enable TABLE`: turns a table into a LokaDB table, online.
//!
//! 1. Preflight: refuses, changing nothing, what the design cannot keep ([`check`]).
//! 2. The swap, one short transaction under `lock_timeout` (retried): the table is renamed
//!    `<table>__lokadb_default` and attached as the DEFAULT partition of a new parent
//!    `<table>` (LIST by the organization column) — metadata only, no scan, no copy. The
//!    parent gets the defaults, identity, non-unique indexes (attached, not rebuilt),
//!    triggers, owner, grants and comment; the pause gate; a key map per unique key
//!    without the organization column, with the trigger that keeps it.
//! 3. Backfill of the key maps from the existing rows, in batches, online; then a wait for
//!    older transactions and a cleanup of stale keys ([`keymap::settle`]).
//! 4. Foreign keys that referenced such a key now reference its key map.
//!
//! Progress is recorded in `lokadb.tables` (`enabling`, then `enabled`), so a rerun after
//! a crash resumes at step 3. See docs/cloud-schema.md.

use super::catalog::{self, qualify, Column, Table, View};
use super::db::{connect, ident, literal, AdminError};
use super::fkeys::{self, run_all, with_lock_retry, StepError};
use super::guards;
use super::keymap::{self, fit, suffixed, KeyMap};
use super::migrations::require_current;
pub use super::preflight::{check, Analysis};
use super::DEFINER;
use postgres::GenericClient;

/// The suffix of the default partition's name (and of its renamed indexes).
pub const DEFAULT_SUFFIX: &str = "__lokadb_default";

/// The name of the default partition of `table`.
pub fn partition_name(table: &str) -> String {
    suffixed(table, DEFAULT_SUFFIX)
}

/// The statements of the swap transaction, after `LOCK`, built from the catalog as it is
/// under that lock.
///
/// # Errors
///
/// A catalog query failed.
pub fn swap_sql(c: &mut impl GenericClient, a: &Analysis) -> Result<Vec<String>, AdminError> {
    let t = &a.table;
    let parent = t.qualified();
    let part_name = partition_name(&t.name);
    let part = qualify(&t.schema, &part_name);
    let org = ident(&a.org.name);
    let mut sql = vec![format!(
        "ALTER TABLE {parent} RENAME TO {}",
        ident(&part_name)
    )];
    for i in &a.indexes {
        sql.push(format!(
            "ALTER INDEX {} RENAME TO {}",
            qualify(&t.schema, &i.name),
            ident(&suffixed(&i.name, DEFAULT_SUFFIX))
        ));
    }
    let mut seq_grants = Vec::new();
    for s in a.sequences.iter().filter(|s| s.identity) {
        // The identity's sequence goes with it; the parent gets one of the same name,
        // options and position.
        let oid = oid_of(c, &s.qualified)?;
        seq_grants.extend(catalog::grants_sql(
            c,
            oid,
            &s.qualified,
            &t.owner,
            "SEQUENCE ",
        )?);
        sql.push(format!(
            "ALTER TABLE {part} ALTER COLUMN {} DROP IDENTITY",
            ident(&s.column)
        ));
    }
    sql.push(format!(
        "CREATE TABLE {parent} (LIKE {part} INCLUDING DEFAULTS INCLUDING GENERATED INCLUDING CONSTRAINTS INCLUDING STORAGE INCLUDING COMMENTS INCLUDING COMPRESSION INCLUDING STATISTICS) PARTITION BY LIST ({org})"
    ));
    // Owned first: a sequence can only belong to a column of a table with its owner.
    sql.push(format!("ALTER TABLE {parent} OWNER TO {}", ident(&t.owner)));
    for s in &a.sequences {
        let col = ident(&s.column);
        if s.identity {
            let kind = if t.column(&s.column).is_some_and(|c| c.identity == "a") {
                "ALWAYS"
            } else {
                "BY DEFAULT"
            };
            sql.push(format!(
                "ALTER TABLE {parent} ALTER COLUMN {col} ADD GENERATED {kind} AS IDENTITY (SEQUENCE NAME {} {})",
                s.qualified, s.options
            ));
            sql.push(format!(
                "SELECT setval({}, {}, {})",
                literal(&s.qualified),
                s.last_value,
                s.is_called
            ));
        } else {
            sql.push(format!(
                "ALTER SEQUENCE {} OWNED BY {parent}.{col}",
                s.qualified
            ));
        }
    }
    sql.push(format!(
        "ALTER TABLE {parent} ATTACH PARTITION {part} DEFAULT"
    ));
    // Built from the same definitions, they attach the partition's indexes, not rebuild.
    sql.extend(a.indexes.iter().map(|i| i.def.clone()));
    if let Some(comment) = &t.comment {
        sql.push(format!("COMMENT ON TABLE {parent} IS {}", literal(comment)));
    }
    sql.extend(catalog::grants_sql(c, t.oid, &parent, &t.owner, "")?);
    sql.extend(seq_grants);
    for tr in &a.triggers {
        // On the parent, a row trigger is cloned onto every partition, the foreign ones too.
        sql.push(format!("DROP TRIGGER {} ON {part}", ident(&tr.name)));
        sql.extend(tr.recreate_sql(&parent));
    }
    sql.extend(gate_sql(t, &a.org));
    for km in &a.keymaps {
        sql.extend(km.create_sql(&parent));
    }
    sql.extend(a.views.iter().map(View::replace_sql));
    sql.push(format!(
        "INSERT INTO lokadb.tables (schema_name, table_name, org_column, default_partition, state) VALUES ({}, {}, {}, {}, 'enabling')",
        literal(&t.schema),
        literal(&t.name),
        literal(&a.org.name),
        literal(&part_name)
    ));
    for km in &a.keymaps {
        let cols: Vec<String> = km.columns.iter().map(|c| literal(&c.name)).collect();
        sql.push(format!(
            "INSERT INTO lokadb.keys (schema_name, table_name, key_name, columns, keymap) VALUES ({}, {}, {}, ARRAY[{}]::name[], {})",
            literal(&t.schema),
            literal(&t.name),
            literal(&km.key_name),
            cols.join(", "),
            literal(&km.name)
        ));
    }
    Ok(sql)
}

fn oid_of(c: &mut impl GenericClient, qualified: &str) -> Result<u32, AdminError> {
    Ok(
        c.query_one("SELECT $1::text::regclass::oid", &[&qualified])?
            .get(0),
    )
}

/// The name of the pause gate's function for a table.
pub fn gate_name(t: &Table) -> String {
    if t.schema == "public" {
        fit(&format!("gate_{}", t.name))
    } else {
        fit(&format!("gate_{}_{}", t.schema, t.name))
    }
}

/// The pause gate: a BEFORE row trigger on the parent that passes each write through
/// `lokadb.write_gate(organization)`, so `lokadb pause` holds it; it also keeps the
/// organization column from being NULL (such a row would belong to no organization).
fn gate_sql(t: &Table, org: &Column) -> Vec<String> {
    let f = qualify("lokadb", &gate_name(t));
    let o = ident(&org.name);
    vec![
        format!(
            "CREATE FUNCTION {f}() RETURNS trigger LANGUAGE plpgsql {DEFINER} AS $lokadb$
BEGIN
    IF TG_OP <> 'DELETE' AND NEW.{o} IS NULL THEN
        RAISE EXCEPTION 'null value in column \"%\" of LokaDB table % violates not-null constraint', {col}, {tbl}
            USING ERRCODE = '23502', COLUMN = {col}, TABLE = {tname}, SCHEMA = {sname};
    END IF;
    IF TG_OP = 'INSERT' THEN
        PERFORM lokadb.write_gate(NEW.{o}::text);
        RETURN NEW;
    END IF;
    IF OLD.{o} IS NOT NULL THEN
        PERFORM lokadb.write_gate(OLD.{o}::text);
    END IF;
    IF TG_OP = 'UPDATE' THEN
        IF NEW.{o} IS DISTINCT FROM OLD.{o} THEN
            PERFORM lokadb.write_gate(NEW.{o}::text);
        END IF;
        RETURN NEW;
    END IF;
    RETURN OLD;
END
$lokadb$",
            col = literal(&org.name),
            tbl = literal(&t.display()),
            tname = literal(&t.name),
            sname = literal(&t.schema),
        ),
        format!(
            "CREATE TRIGGER lokadb_gate BEFORE INSERT OR UPDATE OR DELETE ON {} FOR EACH ROW EXECUTE FUNCTION {f}()",
            t.qualified()
        ),
    ]
}

/// `lokadb enable` arguments.
#[derive(Debug, Clone)]
pub struct EnableOptions {
    /// The table, schema-qualified or found through the search_path.
    pub table: String,
    /// The organization column.
    pub org_column: String,
    /// Print the SQL, change nothing.
    pub plan: bool,
}

/// A lokadb.tables row.
#[derive(Debug, Clone)]
pub struct Registered {
    pub schema: String,
    pub table: String,
    pub org_column: String,
    pub partition: String,
    pub state: String,
}

/// The lokadb.tables row of `t`, or of the table whose default partition `t` is.
///
/// # Errors
///
/// The query failed.
pub fn registered(c: &mut impl GenericClient, t: &Table) -> Result<Option<Registered>, AdminError> {
    Ok(c.query_opt(
        "SELECT schema_name::text, table_name::text, org_column::text, default_partition::text, state
         FROM lokadb.tables WHERE schema_name = $1 AND (table_name = $2 OR default_partition = $2)",
        &[&t.schema, &t.name],
    )?
    .map(|r| Registered {
        schema: r.get(0),
        table: r.get(1),
        org_column: r.get(2),
        partition: r.get(3),
        state: r.get(4),
    }))
}

/// `lokadb enable`: returns the report (or the plan).
///
/// # Errors
///
/// Usage errors change nothing; a failure after the swap leaves state `enabling`, which a
/// rerun resumes.
pub fn enable(dsn: &str, opts: &EnableOptions) -> Result<String, AdminError> {
    let mut client = connect(dsn)?;
    require_current(&mut client)?;
    let t = catalog::resolve(&mut client, &opts.table)?;
    if let Some(r) = registered(&mut client, &t)? {
        let name = catalog::plain(&r.schema, &r.table);
        if r.state == "enabled" {
            return Err(AdminError::usage(format!(
                "{name} is already a LokaDB table (partitioned by {}); lokadb disable {name} reverses it",
                r.org_column
            )));
        }
        if r.table != t.name {
            return Err(AdminError::usage(format!(
                "{} is the default partition of LokaDB table {name}: enable {name}",
                t.display()
            )));
        }
        if opts.plan {
            return Ok(format!(
                "-- {name} is being enabled (state enabling): a run would resume the key map backfill and the foreign keys"
            ));
        }
        eprintln!("lokadb: {name} was being enabled (an earlier run stopped): resuming");
        return finish(&mut client, &r);
    }
    if opts.plan {
        return plan(&mut client, t, &opts.org_column);
    }
    // Checks that read every row run before the lock, so the lock stays short.
    let a = check(&mut client, t, &opts.org_column)?;
    null_orgs(&mut client, &a.table, &a.org.name)?;
    let oid = a.table.oid;
    let org_column = opts.org_column.clone();
    let name = a.table.qualified();
    let reg = with_lock_retry(
        &mut client,
        &format!("swapping {}", a.table.display()),
        |tx| {
            let lock = format!("LOCK TABLE {name} IN ACCESS EXCLUSIVE MODE");
            tx.batch_execute(&lock)
                .map_err(|e| StepError::Pg(e, lock))?;
            // Under the lock: what is rebuilt is what is there now.
            let t = catalog::table(tx, oid)?;
            if t.name != a.table.name || t.schema != a.table.schema {
                return Err(
                    AdminError::failed(format!("{name} was renamed meanwhile; run again")).into(),
                );
            }
            let a = check(tx, t, &org_column)?;
            let sql = swap_sql(tx, &a)?;
            run_all(tx, &sql)?;
            // Guards for its foreign keys (and re-targeted guards of tables whose foreign
            // keys reference it), in the same transaction: no write goes unchecked.
            guards::sync(tx)?;
            Ok(Registered {
                schema: a.table.schema.clone(),
                table: a.table.name.clone(),
                org_column: a.org.name.clone(),
                partition: partition_name(&a.table.name),
                state: "enabling".into(),
            })
        },
    )?;
    finish(&mut client, &reg)
}

/// Refuses rows without an organization.
fn null_orgs(c: &mut impl GenericClient, t: &Table, org: &str) -> Result<(), AdminError> {
    let n: i64 = c
        .query_one(
            &format!(
                "SELECT count(*) FROM ONLY {} WHERE {} IS NULL",
                t.qualified(),
                ident(org)
            ),
            &[],
        )?
        .get(0);
    if n > 0 {
        return Err(AdminError::usage(format!(
            "{} has {n} row{} with NULL {org}: each row must belong to an organization; set it (or delete them) first",
            t.display(),
            if n == 1 { "" } else { "s" }
        )));
    }
    Ok(())
}

/// The key maps of a registered table, from lokadb.keys and the partition's columns.
fn keymaps_of(
    c: &mut postgres::Client,
    r: &Registered,
) -> Result<(Table, Vec<(KeyMap, bool)>), AdminError> {
    let oid = oid_of(c, &qualify(&r.schema, &r.partition))?;
    let part = catalog::table(c, oid)?;
    let org = part.column(&r.org_column).cloned().ok_or_else(|| {
        AdminError::failed(format!("{} lost column {}", r.partition, r.org_column))
    })?;
    let rows = c.query(
        "SELECT key_name::text, columns::text[], keymap::text, backfilled FROM lokadb.keys
         WHERE schema_name = $1 AND table_name = $2 ORDER BY keymap",
        &[&r.schema, &r.table],
    )?;
    let mut out = Vec::new();
    for row in rows {
        let cols: Vec<String> = row.get(1);
        let cols = cols
            .iter()
            .map(|n| {
                part.column(n)
                    .cloned()
                    .ok_or_else(|| AdminError::failed(format!("{} lost column {n}", r.partition)))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let mut km = KeyMap::new(
            &r.schema,
            &r.table,
            &row.get::<_, String>(0),
            cols,
            org.clone(),
        );
        km.name = row.get(2);
        out.push((km, row.get(3)));
    }
    Ok((part, out))
}

/// Steps 3 and 4: backfill, settle, cleanup, foreign keys, state `enabled`.
fn finish(client: &mut postgres::Client, r: &Registered) -> Result<String, AdminError> {
    let name = qualify(&r.schema, &r.table);
    let part = qualify(&r.schema, &r.partition);
    let (part_table, keymaps) = keymaps_of(client, r)?;
    let mut report = vec![format!(
        "{} is a LokaDB table: LIST-partitioned by {}, its rows in the DEFAULT partition {}",
        catalog::plain(&r.schema, &r.table),
        r.org_column,
        catalog::plain(&r.schema, &r.partition)
    )];
    let pending: Vec<&KeyMap> = keymaps
        .iter()
        .filter(|(_, done)| !done)
        .map(|(k, _)| k)
        .collect();
    let mut copied = Vec::new();
    for km in &pending {
        copied.push(keymap::backfill(client, km, &part)?);
    }
    if !pending.is_empty() {
        keymap::settle(client)?;
    }
    for (km, (seen, _)) in pending.iter().zip(&copied) {
        let stale = client.execute(&km.cleanup_sql(&name), &[])?;
        client.execute(
            "UPDATE lokadb.keys SET backfilled = true, backfill_last = NULL WHERE keymap = $1",
            &[&km.name],
        )?;
        let mut line = format!(
            "key map {} keeps {} ({}) unique across organizations: {seen} existing keys copied",
            km.display(),
            km.key_name,
            km.columns
                .iter()
                .map(|c| c.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        );
        if stale > 0 {
            line.push_str(&format!(", {stale} stale removed"));
        }
        report.push(line);
    }
    for fk in catalog::referencing(client, part_table.oid)? {
        let mut set = fk.ref_columns.clone();
        set.sort();
        let target = keymaps.iter().map(|(k, _)| k).find(|k| {
            let mut s: Vec<String> = k.columns.iter().map(|c| c.name.clone()).collect();
            s.sort();
            s == set
        });
        match target {
            Some(km) => {
                fkeys::repoint(
                    client,
                    &fk,
                    &km.qualified(),
                    &fkeys::record_sql(&fk, &km.name),
                )?;
                report.push(format!(
                    "foreign key {} of {} now references {}",
                    fk.name,
                    fk.child_display(),
                    km.display()
                ));
            }
            None => report.push(format!(
                "foreign key {} of {} stays on the default partition (it references a key with {})",
                fk.name,
                fk.child_display(),
                r.org_column
            )),
        }
    }
    // Guards whose foreign key now references a key map are pointed at it.
    with_lock_retry(
        client,
        &format!("foreign keys of {name} for moved organizations"),
        |tx| guards::sync(tx),
    )?;
    report.extend(guards::describe(client, &r.schema, &r.table)?);
    client.execute(
        "UPDATE lokadb.tables SET state = 'enabled' WHERE schema_name = $1 AND table_name = $2",
        &[&r.schema, &r.table],
    )?;
    Ok(report.join("\n"))
}

/// The guards the swap's transaction would install: the swap is run in a savepoint that
/// is rolled back (the catalog must show the partitioned parent for the guards to be
/// derived), under a short lock timeout; if the table is busy, a comment says so instead.
fn guards_plan(tx: &mut postgres::Transaction<'_>, name: &str, swap: &[String]) -> String {
    let attempt = (|| -> Result<Vec<String>, AdminError> {
        let mut sp = tx.transaction()?;
        sp.batch_execute(&format!(
            "SET LOCAL lock_timeout = '{}'; LOCK TABLE {name} IN ACCESS EXCLUSIVE MODE",
            fkeys::LOCK_TIMEOUT
        ))?;
        for s in swap {
            sp.batch_execute(s)?;
        }
        let sql = guards::sync_sql(&mut sp)?;
        sp.rollback()?;
        Ok(sql)
    })();
    match attempt {
        Ok(sql) if sql.is_empty() => "-- (no foreign key needs a guard across foreign partitions)".into(),
        Ok(sql) => {
            let mut out = vec!["-- Guards that keep foreign keys across foreign partitions:".to_owned()];
            out.extend(sql.into_iter().map(|s| format!("{s};")));
            out.join("\n")
        }
        Err(e) => format!("-- (the guards' SQL could not be derived now: {e}; it is generated in this transaction)"),
    }
}

/// `--plan`: the SQL, read from the catalog as it is now, nothing changed.
fn plan(client: &mut postgres::Client, t: Table, org_column: &str) -> Result<String, AdminError> {
    let mut tx = client.transaction()?;
    let a = check(&mut tx, t, org_column)?;
    null_orgs(&mut tx, &a.table, &a.org.name)?;
    let name = a.table.qualified();
    let part = qualify(&a.table.schema, &partition_name(&a.table.name));
    let mut out = vec![format!(
        "-- lokadb enable {} --org-column {org_column}: the SQL it would run (sequence positions as of now)\n\n-- 1. The swap: one transaction, retried when a lock is not granted in {}.\nBEGIN;\nSET LOCAL lock_timeout = '{}';\nLOCK TABLE {name} IN ACCESS EXCLUSIVE MODE;",
        a.table.display(),
        fkeys::LOCK_TIMEOUT,
        fkeys::LOCK_TIMEOUT
    )];
    let swap = swap_sql(&mut tx, &a)?;
    for s in &swap {
        out.push(format!("{s};"));
    }
    out.push(guards_plan(&mut tx, &name, &swap));
    out.push("COMMIT;".into());
    if !a.keymaps.is_empty() {
        out.push(format!(
            "\n-- 2. Key map backfill: batches of {} rows in key order, each its own transaction (the next batch starts after the last key of the previous one, $1…).",
            keymap::BATCH
        ));
        for km in &a.keymaps {
            out.push(format!("{};", km.backfill_sql(&part, false, keymap::BATCH)));
        }
        out.push("-- Then: wait for transactions older than the backfill, and remove keys whose row is gone:".into());
        for km in &a.keymaps {
            out.push(format!("{};", km.cleanup_sql(&name)));
        }
    }
    let fks = catalog::referencing(&mut tx, a.table.oid)?;
    let mut first = true;
    for fk in &fks {
        let mut set = fk.ref_columns.clone();
        set.sort();
        let Some(km) = a.keymaps.iter().find(|k| {
            let mut s: Vec<String> = k.columns.iter().map(|c| c.name.clone()).collect();
            s.sort();
            s == set
        }) else {
            continue;
        };
        if first {
            out.push("\n-- 3. Foreign keys to the key maps: three short transactions each.".into());
            first = false;
        }
        for step in fkeys::repoint_sql(fk, &km.qualified()) {
            out.push(format!("{};", step.join(";\n")));
        }
    }
    out.push(format!(
        "\n-- 4. Done.\nUPDATE lokadb.tables SET state = 'enabled' WHERE schema_name = {} AND table_name = {};",
        literal(&a.table.schema),
        literal(&a.table.name)
    ));
    tx.rollback()?;
    Ok(out.join("\n"))
}
