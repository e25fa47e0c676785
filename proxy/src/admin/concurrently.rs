//! `lokadb concurrently "CREATE INDEX CONCURRENTLY name ON table ..."`: an index built
//! without blocking writes, on a LokaDB table, in the cloud and in every moved
//! organization's database (docs/migrations.md, "Not in a transaction").
//!
//! Postgres refuses CREATE INDEX CONCURRENTLY on a partitioned table, and no transaction
//! can hold one, so the migration path (one transaction, two-phase commit) cannot carry
//! it. Instead, step by step, each step kept when a later one fails:
//! 1. each of the cloud's partitions that holds rows gets the index, built concurrently;
//! 2. each moved organization's table gets it, built concurrently in its database under
//!    the index's name (`lokadb.index_in_org`, through its server as migrations go);
//!    an organization that fails is reported and the others go on;
//! 3. once every organization has it, a plain `CREATE INDEX IF NOT EXISTS` on the table
//!    declares it: Postgres attaches the partitions' indexes instead of building, and the
//!    migration it makes reaches organizations as `CREATE INDEX IF NOT EXISTS`, which finds
//!    theirs.
//!
//! A rerun finds what is built (valid) and builds the rest; an index left invalid by a
//! build that failed is dropped and built again.

use super::db::{connect, describe, ident, AdminError};
use super::index_statement::{parse, CreateIndex};
use std::time::Instant;

/// What one organization's build did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OrgOutcome {
    /// `built`, `rebuilt` or `there`.
    Done(String),
    /// Its error.
    Failed(String),
}

/// `lokadb concurrently --cloud DSN SQL`: prints progress on stderr, returns the summary.
///
/// # Errors
///
/// Not a CREATE INDEX (usage); a cloud step failed; an organization could not build it (the
/// message names the organizations done and those not).
pub fn run(dsn: &str, sql: &str) -> Result<String, AdminError> {
    let stmt = parse(sql).map_err(|e| AdminError::usage(e.to_string()))?;
    let mut client = connect(dsn)?;
    super::migrations::require_current(&mut client)?;
    let Some(table) = loka_table(&mut client, &stmt.table)? else {
        // A plain table: Postgres builds it concurrently itself.
        client.batch_execute(&statement(&stmt, true, &ident(&stmt.name), &stmt.table))?;
        return Ok(format!(
            "index {} built concurrently ({} is not a LokaDB table)",
            stmt.name, stmt.table
        ));
    };
    // The table's index of that name, if any (an index lives in its table's schema).
    let existing: Option<(u32, bool)> = client
        .query_opt(
            "SELECT coalesce(i.indrelid, 0), coalesce(i.indisvalid, false)
             FROM pg_class c LEFT JOIN pg_index i ON i.indexrelid = c.oid
             WHERE c.oid = to_regclass(format('%I.%I', (SELECT n.nspname FROM pg_class t JOIN pg_namespace n ON n.oid = t.relnamespace WHERE t.oid = $1), $2::text))",
            &[&table.oid, &stmt.name],
        )?
        .map(|r| (r.get(0), r.get(1)));
    match existing {
        Some((on, true)) if on == table.oid && stmt.if_not_exists => {
            return Ok(format!(
                "index {} on {} exists already: nothing to do",
                stmt.name, table.qualified
            ))
        }
        Some(_) => {
            return Err(AdminError::usage(format!(
                "relation {} already exists (42P07); nothing was changed",
                stmt.name
            )))
        }
        None => {}
    }
    let orgs: Vec<String> = client
        .query(
            "SELECT org FROM lokadb.ddl_orgs($1::text::regclass)",
            &[&table.qualified],
        )?
        .iter()
        .map(|r| r.get(0))
        .collect();
    if stmt.unique && !orgs.is_empty() {
        return Err(AdminError::usage(format!(
            "a unique index cannot be declared on {} while organizations' rows are in foreign partitions (Postgres refuses it: 42809); nothing was changed",
            table.qualified
        )));
    }

    let model = build_in_cloud(&mut client, &stmt, &table)?;
    let mut outcomes = Vec::with_capacity(orgs.len());
    for org in &orgs {
        let started = Instant::now();
        let outcome = match &model {
            None => OrgOutcome::Failed("no partition in the cloud to model it on".into()),
            Some(model) => match client.query_one(
                "SELECT lokadb.index_in_org($1::text::regclass, $2, $3::text::regclass, $4)",
                &[&table.qualified, &stmt.name, model, org],
            ) {
                Ok(row) => OrgOutcome::Done(row.get(0)),
                Err(e) => OrgOutcome::Failed(describe(&e).replace('\n', " ")),
            },
        };
        match &outcome {
            OrgOutcome::Done(what) => eprintln!(
                "lokadb: organization {org}: index {} {what} ({:.1} s)",
                stmt.name,
                started.elapsed().as_secs_f64()
            ),
            OrgOutcome::Failed(e) => eprintln!("lokadb: organization {org}: failed: {e}"),
        }
        outcomes.push((org.clone(), outcome));
    }
    let failed: Vec<&(String, OrgOutcome)> = outcomes
        .iter()
        .filter(|o| matches!(o.1, OrgOutcome::Failed(_)))
        .collect();
    if !failed.is_empty() {
        return Err(AdminError::failed(half_way(
            &stmt.name,
            &table.qualified,
            &outcomes,
        )));
    }

    // Every piece is there: declaring it on the table attaches them.
    client.batch_execute(&format!(
        "CREATE {}INDEX IF NOT EXISTS {} ON {} {}",
        if stmt.unique { "UNIQUE " } else { "" },
        ident(&stmt.name),
        table.qualified,
        stmt.rest
    ))?;
    // Its migration is prepared in the organizations (a no-op there, holding the table's
    // lock): commit it now rather than wait for a proxy's resolver.
    if !orgs.is_empty() {
        crate::migrate::resolve(&mut client, false)?;
    }
    let valid: bool = client
        .query_one(
            "SELECT i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
             WHERE i.indrelid = $1::text::regclass AND c.relname = $2",
            &[&table.qualified, &stmt.name],
        )?
        .get(0);
    if !valid {
        return Err(AdminError::failed(format!(
            "index {} on {} was declared but is not valid: a partition's index did not attach; run the command again",
            stmt.name, table.qualified
        )));
    }
    Ok(format!(
        "index {} on {}: built in the cloud{}",
        stmt.name,
        table.qualified,
        if orgs.is_empty() {
            String::new()
        } else {
            format!(
                " and in organization{} {}",
                plural(orgs.len()),
                orgs.join(", ")
            )
        }
    ))
}

/// The operator's message when some organizations could not build it.
fn half_way(name: &str, table: &str, outcomes: &[(String, OrgOutcome)]) -> String {
    let done: Vec<&str> = outcomes
        .iter()
        .filter(|o| matches!(o.1, OrgOutcome::Done(_)))
        .map(|o| o.0.as_str())
        .collect();
    let mut lines = vec![format!(
        "index {name} on {table} is not complete: built in the cloud's partitions{}; not in organization{} {}",
        if done.is_empty() {
            String::new()
        } else {
            format!(" and in organization{} {}", plural(done.len()), done.join(", "))
        },
        plural(outcomes.len() - done.len()),
        outcomes
            .iter()
            .filter(|o| matches!(o.1, OrgOutcome::Failed(_)))
            .map(|o| o.0.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    )];
    for (org, o) in outcomes {
        if let OrgOutcome::Failed(e) = o {
            lines.push(format!("organization {org}: {e}"));
        }
    }
    lines.push(
        "What is built stays; the table does not declare the index yet. Bring those organizations' databases back and run the same command again: it builds only what is missing."
            .into(),
    );
    lines.join("\n")
}

fn plural(n: usize) -> &'static str {
    if n == 1 {
        ""
    } else {
        "s"
    }
}

/// A LokaDB table, as the cloud names it.
struct LokaTable {
    oid: u32,
    /// `schema.table`, quoted as needed.
    qualified: String,
}

fn loka_table(
    client: &mut postgres::Client,
    written: &str,
) -> Result<Option<LokaTable>, AdminError> {
    let row = client
        .query_opt(
            "SELECT c.oid, format('%I.%I', n.nspname, c.relname),
                    EXISTS (SELECT 1 FROM lokadb.tables t WHERE t.state = 'enabled'
                            AND t.schema_name = n.nspname AND t.table_name = c.relname)
             FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
             WHERE c.oid = to_regclass($1)",
            &[&written],
        )?
        .ok_or_else(|| AdminError::usage(format!("relation {written} does not exist")))?;
    Ok(row.get::<_, bool>(2).then(|| LokaTable {
        oid: row.get(0),
        qualified: row.get(1),
    }))
}

fn statement(stmt: &CreateIndex, concurrently: bool, name: &str, on: &str) -> String {
    format!(
        "CREATE {}INDEX {}{} ON {} {}",
        if stmt.unique { "UNIQUE " } else { "" },
        if concurrently { "CONCURRENTLY " } else { "" },
        name,
        on,
        stmt.rest
    )
}

/// Step 1: every partition of the table in the cloud that holds rows (not the foreign
/// ones, not the partitioned ones). Returns an index to model organizations' on (the
/// first partition's), `None` when the table has no such partition.
fn build_in_cloud(
    client: &mut postgres::Client,
    stmt: &CreateIndex,
    table: &LokaTable,
) -> Result<Option<String>, AdminError> {
    let leaves = client.query(
        "SELECT p.relid::oid, format('%I.%I', n.nspname, c.relname), n.nspname
         FROM pg_partition_tree($1::oid::regclass) p
         JOIN pg_class c ON c.oid = p.relid JOIN pg_namespace n ON n.oid = c.relnamespace
         WHERE c.relkind = 'r'
         ORDER BY p.level, c.relname",
        &[&table.oid],
    )?;
    let mut model = None;
    for leaf in &leaves {
        let oid: u32 = leaf.get(0);
        let qualified: String = leaf.get(1);
        let schema: String = leaf.get(2);
        let name = leaf_index_name(&stmt.name, oid);
        let index = format!("{}.{}", ident(&schema), ident(&name));
        let started = Instant::now();
        let state: Option<bool> = client
            .query_opt(
                "SELECT i.indisvalid FROM pg_index i
                 WHERE i.indexrelid = to_regclass($1) AND i.indrelid = $2::oid",
                &[&index, &oid],
            )?
            .map(|r| r.get(0));
        let what = match state {
            Some(true) => "there",
            Some(false) => {
                client.batch_execute(&format!("DROP INDEX CONCURRENTLY IF EXISTS {index}"))?;
                "rebuilt"
            }
            None => "built",
        };
        if what != "there" {
            client
                .batch_execute(&statement(stmt, true, &ident(&name), &qualified))
                .map_err(|e| {
                    AdminError::failed(format!(
                        "index {} not built on the cloud's partition {qualified}: {}\nNo organization was changed; run the command again once the cause is fixed.",
                        stmt.name,
                        describe(&e)
                    ))
                })?;
        }
        eprintln!(
            "lokadb: cloud: {qualified}: index {name} {what} ({:.1} s)",
            started.elapsed().as_secs_f64()
        );
        model.get_or_insert(index);
    }
    Ok(model)
}

/// A partition's index: the table's index's name and the partition's oid, within
/// Postgres's 63 bytes, the same at every rerun.
fn leaf_index_name(name: &str, leaf: u32) -> String {
    let suffix = format!("_p{leaf}");
    let mut head = name.to_owned();
    while head.len() + suffix.len() > 63 {
        head.pop();
    }
    head + &suffix
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leaf_names_fit_and_are_stable() {
        assert_eq!(
            leaf_index_name("documents_title_idx", 16401),
            "documents_title_idx_p16401"
        );
        let long = "x".repeat(70);
        let n = leaf_index_name(&long, 4_000_000_000);
        assert_eq!(n.len(), 63);
        assert!(n.ends_with("_p4000000000"));
    }

    #[test]
    fn a_half_way_failure_names_who_is_done_and_who_is_not() {
        let m = half_way(
            "i",
            "public.t",
            &[
                ("2".into(), OrgOutcome::Done("built".into())),
                ("3".into(), OrgOutcome::Failed("gone (08001)".into())),
            ],
        );
        assert!(m.starts_with("index i on public.t is not complete: built in the cloud's partitions and in organization 2; not in organization 3\norganization 3: gone (08001)\n"), "{m}");
    }
}
