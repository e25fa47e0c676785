//! Folding an organization back into DEFAULT (`lokadb fold`, and the end of a small
//! organization's `move-back`): its rows leave its own partition for the DEFAULT partition,
//! and its partitions are dropped, so the cloud keeps partitions only for organizations that
//! are away or moving.
//!
//! Why: Postgres pays per partition and per backend (relation cache, LokaDB's row triggers
//! compiled per partition, the lock table), so a cloud with thousands of partitions serves
//! every organization slower (research/bench/README.md, "Organizations results"). An
//! organization moved back keeps nothing in its own partition that DEFAULT can't hold.
//!
//! How: one transaction takes each LokaDB table the organization has a partition in, and its
//! DEFAULT partition, ACCESS EXCLUSIVE (short lock waits, retried, since everyone queues
//! behind a waiting ACCESS EXCLUSIVE), checks the rows against DEFAULT's foreign keys, deletes
//! the guards' refs of them, detaches the organization's table, copies its rows into DEFAULT
//! in replica role (no trigger sees a write: the key maps already hold its keys, and
//! DEFAULT's native foreign keys take over from the guards), and drops the detached table. No
//! write is paused separately: the lock holds every writer of the tables, and no transaction
//! sees the rows twice (one whose snapshot predates the fold sees none: docs/moving.md).
//! Every organization's statements on these tables wait for that transaction, which is why
//! `move-back` folds only up to `--fold-max-rows`.

use super::layout::{self, MoveTable, Place};
use super::switch::{be_the_deadlock_victim, set_local_if_allowed};
use super::{in_progress, read_journal, under_move_lock};
use crate::admin::db::AdminError;
use crate::admin::fkeys::{with_lock_retry_within, StepError};
use std::time::{Duration, Instant};

/// What `move-back` folds by default: at most this many rows over all LokaDB tables (a few
/// tens of milliseconds of the tables' lock on the machines measured).
pub const DEFAULT_FOLD_MAX_ROWS: u64 = 10_000;

/// How long the fold waits for each table's lock: new statements on the table queue behind
/// the waiting lock, so waiting long would stall every organization.
pub const FOLD_LOCK_WAIT: &str = "500ms";

/// A fold done.
#[derive(Debug, Clone, PartialEq)]
pub struct Folded {
    pub rows: u64,
    pub tables: usize,
    /// From the lock granted to the commit: how long every statement on the tables waited.
    pub held: Duration,
}

/// The organization's tables that have a partition of their own (in the cloud).
///
/// # Errors
///
/// A table whose partition is foreign (the organization is away), or a failed query.
pub fn own_partitions(
    c: &mut postgres::Client,
    org: &str,
    tables: &[MoveTable],
) -> Result<Vec<MoveTable>, AdminError> {
    let mut out = Vec::new();
    for t in tables {
        match layout::place(c, t)? {
            Place::Default => {}
            Place::Cloud => out.push(t.clone()),
            Place::Foreign => {
                return Err(AdminError::usage(format!(
                    "organization {org}'s {} is in its own database: only an organization in the cloud folds into DEFAULT (lokadb move-back {org} first)",
                    t.display()
                )))
            }
        }
    }
    Ok(out)
}

/// Rows in the organization's own partitions, counted up to `limit + 1` (enough to compare).
///
/// # Errors
///
/// A failed query.
pub fn rows_up_to(
    c: &mut postgres::Client,
    tables: &[MoveTable],
    limit: u64,
) -> Result<u64, AdminError> {
    let mut total = 0u64;
    for t in tables {
        let left = (limit + 1).saturating_sub(total);
        let n: i64 = c
            .query_one(
                &format!(
                    "SELECT count(*) FROM (SELECT 1 FROM {} LIMIT {left}) s",
                    t.cloud_part()
                ),
                &[],
            )?
            .get(0);
        total += n.unsigned_abs();
        if total > limit {
            break;
        }
    }
    Ok(total)
}

/// Folds the organization's own partitions (`tables`: those [`own_partitions`] found) into
/// DEFAULT, in one transaction.
///
/// # Errors
///
/// A trigger on DEFAULT that a replica-role insert would fire (usage, nothing changed), the
/// lock not granted after the retries, or a failure (rolled back: nothing changed).
pub fn fold(
    c: &mut postgres::Client,
    org: &str,
    tables: &[MoveTable],
) -> Result<Folded, AdminError> {
    for t in tables {
        if let Some(tg) = super::split::replica_trigger(c, t)? {
            return Err(AdminError::usage(format!(
                "trigger {tg} on {} is enabled ALWAYS or REPLICA: it would take organization {org}'s rows arriving in DEFAULT for insertions. Make it an ordinary trigger for the fold and set it back afterwards. Nothing was changed",
                t.default()
            )));
        }
    }
    let mut checks = Vec::new();
    let mut refs = Vec::new();
    for t in tables {
        checks.extend(foreign_key_checks(c, t, &t.cloud_part())?);
        refs.extend(refs_deletes(c, t)?);
    }
    // In the order the tables were enabled (that of `tables`), as the moves lock them; ONLY:
    // the parent (every statement through it) and DEFAULT (foreign keys' checks and cascades
    // go to it directly), not every organization's partitions. DETACH and DROP lock the
    // organization's own.
    let lock = format!(
        "LOCK TABLE {} IN ACCESS EXCLUSIVE MODE",
        tables
            .iter()
            .flat_map(|t| [
                format!("ONLY {}", t.parent()),
                format!("ONLY {}", t.default())
            ])
            .collect::<Vec<_>>()
            .join(", ")
    );
    let what = format!("folding organization {org} into DEFAULT");
    with_lock_retry_within(c, &what, FOLD_LOCK_WAIT, |tx| {
        be_the_deadlock_victim(tx)?;
        // A killed command's backend notices its client gone within a second, rather than
        // after its copy, holding every lock (PostgreSQL 14 on; earlier ones lack it).
        set_local_if_allowed(tx, "client_connection_check_interval", "'1s'")?;
        tx.batch_execute(&lock)
            .map_err(|e| StepError::Pg(e, lock.clone()))?;
        let held = Instant::now();
        // The rows enter DEFAULT without its foreign keys' checks (replica role, below):
        // checked here, as they stand now, under the lock. A guard keeps most of them for a
        // moved organization, not those that include the organization column.
        for (name, sql) in &checks {
            let found = tx
                .query(sql.as_str(), &[])
                .map_err(|e| StepError::Pg(e, sql.clone()))?;
            if !found.is_empty() {
                return Err(StepError::Admin(AdminError::failed(format!(
                    "organization {org}'s rows break the DEFAULT partition's foreign key {name}: {}; nothing was changed",
                    offending(&found)
                ))));
            }
        }
        // Its rows fall under DEFAULT's native foreign keys: the guards' record of them
        // goes (a parent's delete would otherwise still be refused for them, or cascade
        // twice). Through their keys, which the refs are indexed by.
        for sql in &refs {
            tx.batch_execute(sql)
                .map_err(|e| StepError::Pg(e, sql.clone()))?;
        }
        // Replica role: no trigger fires (the rows are the organization's already, in the
        // key maps; DEFAULT's disabled guard clones and the capture have nothing to do).
        tx.batch_execute("SET LOCAL session_replication_role = replica")?;
        let mut rows = 0u64;
        for t in tables {
            let detach = format!("ALTER TABLE {} DETACH PARTITION {}", t.parent(), t.own());
            tx.batch_execute(&detach)
                .map_err(|e| StepError::Pg(e, detach.clone()))?;
            // The rows keep their identity values (a no-op for tables without identity).
            let copy = format!(
                "INSERT INTO {} ({cols}) OVERRIDING SYSTEM VALUE SELECT {cols} FROM {}",
                t.default(),
                t.cloud_part(),
                cols = t.cols()
            );
            let n = tx
                .execute(&copy, &[])
                .map_err(|e| StepError::Pg(e, copy.clone()))?;
            rows += n;
            // With its partition; not CASCADE: a view of the client's on it fails the fold
            // (rolled back, named in the error) rather than vanish.
            let drop = format!("DROP TABLE {}", t.own());
            tx.batch_execute(&drop)
                .map_err(|e| StepError::Pg(e, drop.clone()))?;
        }
        Ok(Folded {
            rows,
            tables: tables.len(),
            held: held.elapsed(),
        })
    })
}

/// The rows a check found, for an error: `(col, …)=(value, …)` of up to [`SHOWN`] of them.
pub fn offending(rows: &[postgres::Row]) -> String {
    let shown: Vec<String> = rows.iter().map(|r| r.get::<_, String>(0)).collect();
    format!(
        "{}{}",
        shown.join(", "),
        if rows.len() >= SHOWN as usize {
            " …"
        } else {
            ""
        }
    )
}

/// How many offending rows an error names.
pub const SHOWN: i64 = 5;

/// An SQL expression showing a row's key as the text `(names)=(value, …)` (`values`: the
/// key's columns as SQL expressions), for [`offending`].
pub fn shown_key(names: &str, values: &[String]) -> String {
    let text: Vec<String> = values.iter().map(|v| format!("{v}::text")).collect();
    format!(
        "format('(%s)=(%s)', {}, concat_ws(', ', {}))",
        crate::admin::db::literal(names),
        text.join(", ")
    )
}

/// For each foreign key of `t`'s DEFAULT partition: its name, and a query that finds up to
/// [`SHOWN`] rows of `rows` (the organization's cloud partition, or a subquery of some of
/// its rows) it would refuse, each as the text `(columns)=(values)` (MATCH SIMPLE: rows
/// with a NULL column pass).
pub fn foreign_key_checks(
    c: &mut impl postgres::GenericClient,
    t: &MoveTable,
    rows: &str,
) -> Result<Vec<(String, String)>, AdminError> {
    let keys = c.query(
        "SELECT k.conname::text, k.confrelid::regclass::text,
                ARRAY(SELECT quote_ident(a.attname) FROM unnest(k.conkey) WITH ORDINALITY u(n, i)
                      JOIN pg_attribute a ON a.attrelid = k.conrelid AND a.attnum = u.n ORDER BY u.i),
                ARRAY(SELECT quote_ident(a.attname) FROM unnest(k.confkey) WITH ORDINALITY u(n, i)
                      JOIN pg_attribute a ON a.attrelid = k.confrelid AND a.attnum = u.n ORDER BY u.i)
         FROM pg_constraint k WHERE k.conrelid = to_regclass($1) AND k.contype = 'f' ORDER BY 1",
        &[&t.default()],
    )?;
    Ok(keys
        .iter()
        .map(|r| {
            let (name, target): (String, String) = (r.get(0), r.get(1));
            let (cols, refd): (Vec<String>, Vec<String>) = (r.get(2), r.get(3));
            let present: Vec<String> = cols.iter().map(|c| format!("c.{c} IS NOT NULL")).collect();
            let equal: Vec<String> = cols
                .iter()
                .zip(&refd)
                .map(|(c, k)| format!("t.{k} = c.{c}"))
                .collect();
            let values: Vec<String> = cols.iter().map(|c| format!("c.{c}")).collect();
            let shown = shown_key(&cols.join(", "), &values);
            let sql = format!(
                "SELECT {shown} FROM {rows} c WHERE {} AND NOT EXISTS (SELECT 1 FROM {target} t WHERE {}) LIMIT {SHOWN}",
                present.join(" AND "),
                equal.join(" AND ")
            );
            (name, sql)
        })
        .collect())
}

/// The statements that delete the guards' refs of the organization's rows of `t`, joined
/// through the rows' keys (the refs' index is `(k…, org)`; a scan by organization alone
/// would read every moved organization's refs while every table is locked).
fn refs_deletes(c: &mut postgres::Client, t: &MoveTable) -> Result<Vec<String>, AdminError> {
    let rows = c.query(
        "SELECT refs::text, columns::text[] FROM lokadb.guards
         WHERE child_schema = $1 AND child_table = $2 ORDER BY refs",
        &[&t.schema, &t.name],
    )?;
    Ok(rows
        .iter()
        .map(|r| {
            let (refs, columns): (String, Vec<String>) = (r.get(0), r.get(1));
            let keys: Vec<String> = columns
                .iter()
                .enumerate()
                .map(|(i, col)| format!("r.k{} = c.{}", i + 1, crate::admin::db::ident(col)))
                .collect();
            format!(
                "DELETE FROM lokadb.{} r USING {} c WHERE {} AND r.org = {}",
                crate::admin::db::ident(&refs),
                t.cloud_part(),
                keys.join(" AND "),
                t.org_literal
            )
        })
        .collect())
}

/// `lokadb fold ORG`: folds an organization in the cloud that has partitions of its own
/// (moved back with them kept, or a move aborted after its split) into DEFAULT, whatever
/// its size.
///
/// # Errors
///
/// Unknown organization, one that is moved or moving (usage), or a failed fold.
pub fn fold_org(dsn: &str, org_id: &str) -> Result<String, AdminError> {
    crate::admin::org::check_id(org_id)?;
    under_move_lock(dsn, org_id, |slot, org| {
        let cloud = slot.as_mut().expect("the cloud session is in the slot");
        if let Some(j) = read_journal(cloud, &org.id)? {
            return Err(in_progress(&org.id, &j));
        }
        if org.state != "cloud" {
            return Err(AdminError::usage(format!(
                "organization {} is {}: only an organization in the cloud folds into DEFAULT (lokadb move-back {} first); nothing was changed",
                org.id, org.state, org.id
            )));
        }
        let tables = layout::tables(cloud, &org.id)?;
        let own = own_partitions(cloud, &org.id, &tables)?;
        if own.is_empty() {
            return Ok(format!(
                "organization {}'s rows are in DEFAULT already: nothing to fold",
                org.id
            ));
        }
        let f = fold(cloud, &org.id, &own)?;
        analyze_defaults(cloud, &own)?;
        Ok(summary(&org.id, &f))
    })
}

/// ANALYZE of the DEFAULT partitions a fold filled, after it committed: their statistics
/// count the organization's rows from now on (autovacuum would wait for a tenth of the table
/// to change, and the planner would take the organization for one with no rows there).
///
/// # Errors
///
/// A failed ANALYZE (the fold stays done).
pub fn analyze_defaults(c: &mut postgres::Client, tables: &[MoveTable]) -> Result<(), AdminError> {
    for t in tables {
        c.batch_execute(&format!("ANALYZE {}", t.default()))?;
    }
    Ok(())
}

/// One line saying what a fold did.
pub fn summary(org: &str, f: &Folded) -> String {
    format!(
        "folded organization {org} into DEFAULT: {} rows of {} tables, its partitions dropped; the tables were locked {:.0} ms",
        f.rows,
        f.tables,
        f.held.as_secs_f64() * 1e3
    )
}
