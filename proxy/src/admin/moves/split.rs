//! The first move of an organization: giving it a partition of its own out of DEFAULT.
//!
//! Its rows are copied (inside the cloud) into `<table>__lokadb_<org>_c`, under the
//! organization's own partitioned table, while it keeps working; triggers on the DEFAULT
//! partition record what it writes meanwhile, and catch-up rounds apply it. Then its
//! writes pause (`lokadb.write_gate`); a CHECK excluding it is put on DEFAULT, not
//! validated (a moment's lock); and in one transaction its rows are deleted from DEFAULT,
//! the check validated (a scan of DEFAULT that lets the other organizations read and
//! write on), and its table attached: the CHECK on the partition spares a scan of it, the
//! validated check one of DEFAULT, so the other organizations wait only for the attach's
//! catalog work. Writers that wait at the pause hold a lock on DEFAULT the check and the
//! attach need: they are told to retry (40001) — only those waiting at those moments.

use super::capture::{self, CatchUp};
use super::figures::{Figures, Pace};
use super::layout::{self, MoveTable, Place};
use super::{failpoint, Move};
use crate::admin::db::{describe, AdminError};
use crate::admin::fkeys::{run_all, with_lock_retry};
use std::time::{Duration, Instant};

/// How long the split waits for the organization's writes in flight before pausing.
pub const PAUSE_WAIT: &str = "10s";
/// Attempts at the attach (each waits up to 2 s for the DEFAULT partition's lock).
pub const ATTACH_ATTEMPTS: u32 = 5;

/// Refuses, before anything changes, what the split can't do right.
///
/// # Errors
///
/// Usage: a DEFAULT partition with triggers enabled ALWAYS or REPLICA.
pub fn preflight(c: &mut postgres::Client, tables: &[MoveTable]) -> Result<(), AdminError> {
    for t in tables {
        if layout::place(c, t)? != Place::Default {
            continue;
        }
        // The DELETE from DEFAULT runs as a replica so no ordinary trigger sees the rows
        // leave; triggers enabled ALWAYS or REPLICA would, and act on a move as a delete.
        if let Some(tg) = replica_trigger(c, t)? {
            return Err(AdminError::usage(format!(
                "trigger {tg} on {} is enabled ALWAYS or REPLICA: it would take the organization's rows leaving DEFAULT for deletions. Make it an ordinary trigger for the move (ALTER TABLE {} ENABLE TRIGGER {}) and set it back afterwards. Nothing was changed",
                t.default(),
                t.default(),
                crate::admin::db::ident(&tg)
            )));
        }
    }
    Ok(())
}

/// A trigger on `t`'s DEFAULT partition that fires for a session in replica role (enabled
/// ALWAYS or REPLICA): it would see rows a move takes out of DEFAULT, or a fold puts in.
///
/// # Errors
///
/// The query failed.
pub fn replica_trigger(
    c: &mut postgres::Client,
    t: &MoveTable,
) -> Result<Option<String>, AdminError> {
    Ok(c.query_opt(
        "SELECT tgname::text FROM pg_trigger
         WHERE tgrelid = to_regclass($1) AND NOT tgisinternal AND tgenabled IN ('A', 'R')
         LIMIT 1",
        &[&t.default()],
    )?
    .map(|r| r.get(0)))
}

/// Whether any of `tables` still has the organization's rows in DEFAULT (a split is needed).
///
/// # Errors
///
/// A failed query.
pub fn in_default(c: &mut postgres::Client, tables: &[MoveTable]) -> Result<bool, AdminError> {
    for t in tables {
        if layout::place(c, t)? == Place::Default {
            return Ok(true);
        }
    }
    Ok(false)
}

/// What removes an unfinished split of `t` — its capture on DEFAULT and its unattached
/// table — once its check is taken off DEFAULT (done here: it needs its own short lock).
///
/// # Errors
///
/// The check's lock was not granted, or a query failed.
pub fn undo(c: &mut postgres::Client, t: &MoveTable) -> Result<Vec<String>, AdminError> {
    drop_checks(c, std::slice::from_ref(t))?;
    let mut sql = capture::remove_sql(t, &t.default());
    sql.push(format!("DROP TABLE IF EXISTS {} CASCADE", t.own()));
    Ok(sql)
}

/// Runs the split of every table whose organization rows are still in DEFAULT.
///
/// # Errors
///
/// A failure; a rerun starts the split's copy again.
pub fn run(m: &mut Move) -> Result<(), AdminError> {
    let mut todo = Vec::new();
    for t in &m.tables {
        if layout::place(&mut m.cloud, t)? == Place::Default {
            todo.push(t.clone());
        }
    }
    if todo.is_empty() {
        return Ok(());
    }
    // A split killed between adding its check and attaching left it: DEFAULT would refuse
    // the organization's writes while it copies.
    drop_checks(&mut m.cloud, &todo)?;
    let started = Instant::now();
    for t in &todo {
        // A split cut short left an unattached table: start its copy again.
        let own = t.own();
        let mut sql = vec![format!("DROP TABLE IF EXISTS {own} CASCADE")];
        sql.extend(t.own_ddl());
        sql.extend(t.cloud_part_ddl());
        sql.push(format!(
            "ALTER TABLE {own} ATTACH PARTITION {} FOR VALUES IN ({})",
            t.cloud_part(),
            t.org_literal
        ));
        let mut tx = m.cloud.transaction()?;
        for s in &sql {
            tx.batch_execute(s).map_err(|e| {
                AdminError::failed(format!(
                    "creating {}'s partition of {}: {}\nstatement: {s}",
                    m.org.id,
                    t.display(),
                    describe(&e)
                ))
            })?;
        }
        tx.commit()?;
        let default = t.default();
        if !capture::installed(&mut m.cloud, t, &default)? {
            let sql = capture::install_sql(t, &default, capture::Capture::FilteredSource);
            with_lock_retry(
                &mut m.cloud,
                &format!("starting change capture on {default}"),
                |tx| run_all(tx, &sql),
            )?;
        }
        // One statement inside the cloud: no figures of its own to show while it runs.
        m.publish(&Figures {
            phase: format!("split: copying into {}", t.cloud_part_name()),
            seconds: started.elapsed().as_secs_f64(),
            ..Figures::default()
        });
        let n = m.cloud.execute(
            &format!(
                "INSERT INTO {own} ({cols}) SELECT {scols} FROM ONLY {default} s WHERE {filter}",
                cols = t.cols(),
                scols = t.cols_of("s"),
                filter = t.org_filter("s")
            ),
            &[],
        )?;
        let line = format!(
            "split {}: {n} rows copied to {}",
            t.display(),
            t.cloud_part_name()
        );
        m.say(line);
        failpoint("split-copy");
    }
    let mut src = m.cloud_session()?;
    let mut dst = m.cloud_session()?;
    let mut cu = CatchUp::new();
    let source = |t: &MoveTable| (t.default(), true);
    let dest = |t: &MoveTable| t.cloud_part();
    let (caught_up, mut applied) = (Instant::now(), 0u64);
    let mut pace = Pace::default();
    loop {
        let r = cu.round(&todo, &mut src, &source, &mut dst, &dest)?;
        applied += r.records;
        let waiting = r.backlog.saturating_sub(r.records);
        if pace.due() {
            m.publish(&Figures::catch_up(
                "split: catch-up",
                applied,
                waiting,
                caught_up.elapsed().as_secs_f64(),
            ));
        }
        if waiting < super::switch::SWITCH_BACKLOG {
            break;
        }
    }
    switch(m, &todo, &mut cu, &mut src, &mut dst)?;
    m.say(format!(
        "split of {} out of DEFAULT done in {:.1} s",
        m.org.id,
        started.elapsed().as_secs_f64()
    ));
    Ok(())
}

fn switch(
    m: &mut Move,
    todo: &[MoveTable],
    cu: &mut CatchUp,
    src: &mut postgres::Client,
    dst: &mut postgres::Client,
) -> Result<(), AdminError> {
    let org = m.org.id.clone();
    m.cloud
        .batch_execute(&format!("SET lock_timeout = '{PAUSE_WAIT}'"))
        .map_err(AdminError::from)?;
    if let Err(e) = m
        .cloud
        .execute("SELECT pg_advisory_lock(lokadb.pause_key($1))", &[&org])
    {
        let _ = m.cloud.batch_execute("RESET lock_timeout");
        return Err(AdminError::failed(format!(
            "could not pause {org} for the split: {} (a transaction writing its rows ran longer than {PAUSE_WAIT}?); nothing changed, run the command again",
            describe(&e)
        )));
    }
    m.cloud.batch_execute("RESET lock_timeout")?;
    let paused = Instant::now();
    let result = (|| {
        m.cloud.execute(
            "INSERT INTO lokadb.pause (org, holder_pid, reason, timeout)
             VALUES ($1, pg_backend_pid(), 'move-org: split out of DEFAULT', interval '30 seconds')
             ON CONFLICT (org) DO UPDATE SET holder_pid = excluded.holder_pid,
               reason = excluded.reason, timeout = excluded.timeout, since = now()",
            &[&org],
        )?;
        let source = |t: &MoveTable| (t.default(), true);
        let dest = |t: &MoveTable| t.cloud_part();
        cu.drain(todo, src, &source, dst, &dest)?;
        add_checks(m, todo)?;
        failpoint("split-check");
        for attempt in 1..=ATTACH_ATTEMPTS {
            match attach(m, todo) {
                Ok(()) => return Ok(()),
                Err(Retry::Lock) if attempt < ATTACH_ATTEMPTS => {
                    eprintln!(
                        "lokadb: split of {org}: the DEFAULT partition's lock was not granted in 2 s (attempt {attempt} of {ATTACH_ATTEMPTS}), retrying"
                    );
                    std::thread::sleep(Duration::from_millis(100 * u64::from(attempt)));
                }
                Err(Retry::Lock) => {
                    return Err(AdminError::failed(format!(
                        "split of {org}: the DEFAULT partition's lock was not granted in {ATTACH_ATTEMPTS} attempts (long transactions on it?); nothing changed, run the command again"
                    )))
                }
                Err(Retry::Fail(e)) => return Err(e),
            }
        }
        unreachable!("the last attempt returns")
    })();
    if result.is_err() {
        // DEFAULT refuses the organization's rows while its check is there.
        if let Err(e) = drop_checks(&mut m.cloud, todo) {
            eprintln!("lokadb: split of {org}: {e}; a rerun or --abort removes the check");
        }
    }
    // Ends the pause; the move's own lock stays.
    let unpause = m.cloud.batch_execute(&format!(
        "SELECT pg_advisory_unlock(lokadb.pause_key({o}));
         DELETE FROM lokadb.pause WHERE org = {o} AND holder_pid = pg_backend_pid()",
        o = crate::admin::db::literal(&org)
    ));
    result?;
    unpause?;
    let ms = paused.elapsed().as_millis();
    m.say(format!(
        "split of {org}: its writes paused {ms} ms (the DELETE from DEFAULT, the check of DEFAULT and the attach)"
    ));
    Ok(())
}

/// How long adding the split's check may wait for DEFAULT's lock: every statement on
/// DEFAULT queues behind the request meanwhile.
const CHECK_LOCK_WAIT: &str = "100ms";

/// Puts the split's check on each DEFAULT partition, not validated ([`MoveTable::split_check_add`]):
/// a moment's lock. The organization's writers waiting at its pause hold DEFAULT and are
/// told to retry first, as at the attach.
fn add_checks(m: &mut Move, todo: &[MoveTable]) -> Result<(), AdminError> {
    let mut sql = vec![format!(
        "SELECT pg_advisory_xact_lock(lokadb.evict_key({}))",
        crate::admin::db::literal(&m.org.id)
    )];
    // A check a killed run left is gone already (`run` removes it first).
    sql.extend(todo.iter().map(MoveTable::split_check_add));
    crate::admin::fkeys::with_lock_retry_within(
        &mut m.cloud,
        &format!(
            "split of {}: checking DEFAULT holds none of its rows",
            m.org.id
        ),
        CHECK_LOCK_WAIT,
        |tx| run_all(tx, &sql),
    )
}

/// Removes the split's checks a failed or interrupted split left on DEFAULT (only where
/// there is one: dropping takes DEFAULT's lock).
///
/// # Errors
///
/// The lock was not granted, or a query failed.
pub fn drop_checks(c: &mut postgres::Client, tables: &[MoveTable]) -> Result<(), AdminError> {
    let mut sql = Vec::new();
    for t in tables {
        let left = c.query_opt(
            "SELECT 1 FROM pg_constraint WHERE conrelid = to_regclass($1) AND conname = $2",
            &[&t.default(), &t.split_check_name()],
        )?;
        if left.is_some() {
            sql.push(t.split_check_drop());
        }
    }
    if sql.is_empty() {
        return Ok(());
    }
    crate::admin::fkeys::with_lock_retry_within(
        c,
        "removing the split's check of DEFAULT",
        CHECK_LOCK_WAIT,
        |tx| run_all(tx, &sql),
    )
}

enum Retry {
    Lock,
    Fail(AdminError),
}

/// The split's transaction: delete from DEFAULT, attach, record references.
fn attach(m: &mut Move, todo: &[MoveTable]) -> Result<(), Retry> {
    let org = m.org.id.clone();
    let fail = |e: postgres::Error| {
        if e.as_db_error()
            .is_some_and(|d| matches!(d.code().code(), "55P03" | "40P01"))
        {
            Retry::Lock
        } else {
            Retry::Fail(AdminError::failed(format!(
                "split of {org} failed and was rolled back: {}",
                describe(&e)
            )))
        }
    };
    let mut tx = m.cloud.transaction().map_err(fail)?;
    // Replica role: the DELETE fires no trigger (the key maps keep the organization's
    // keys, the capture records nothing).
    tx.batch_execute("SET LOCAL lock_timeout = '2s'; SET LOCAL session_replication_role = replica")
        .map_err(fail)?;
    for t in todo {
        tx.execute(
            &format!(
                "DELETE FROM ONLY {} s WHERE {}",
                t.default(),
                t.org_filter("s")
            ),
            &[],
        )
        .map_err(fail)?;
    }
    // The references of its rows, recorded before the attach: other organizations' writers
    // wait for the attach (DEFAULT's lock), not for this. Nobody sees them before the commit,
    // and the organization's rows do not change meanwhile (paused, changes drained).
    // DEFAULT holds none of its rows now: the check is validated by a scan under a lock that
    // lets every other organization read and write on, and the attach needs no scan of its
    // own (Postgres takes the validated check as proof).
    for t in todo {
        tx.batch_execute(&t.split_check_validate()).map_err(fail)?;
    }
    for t in todo {
        tx.batch_execute(&format!(
            "SELECT lokadb.refs_fill_under({}::regclass, {}::regclass, {})",
            crate::admin::db::literal(&t.parent()),
            crate::admin::db::literal(&t.cloud_part()),
            t.org_literal
        ))
        .map_err(fail)?;
    }
    // From here writers waiting at the pause are told to retry: they hold DEFAULT. Until
    // the commit only: a writer that reaches the pause after it holds nothing the attach
    // needs, and waits for the unpause rather than being failed a second time.
    // New writes wait for the attach at the parent: one that got past the parent's lock
    // would route by the old partitions and fail on DEFAULT's new constraint (23514).
    // Both in one message, so that no evicted writer gets round to this organization
    // again between the two.
    let parents: Vec<String> = todo.iter().map(MoveTable::parent).collect();
    tx.batch_execute(&format!(
        "SELECT pg_advisory_xact_lock(lokadb.evict_key({}));
         LOCK TABLE {} IN SHARE ROW EXCLUSIVE MODE",
        crate::admin::db::literal(&org),
        parents.join(", ")
    ))
    .map_err(fail)?;
    for t in todo {
        let mut sql = vec![format!(
            "ALTER TABLE {} ATTACH PARTITION {} FOR VALUES IN ({})",
            t.parent(),
            t.own(),
            t.org_literal
        )];
        sql.extend(capture::remove_sql(t, &t.default()));
        // DEFAULT's own partition constraint excludes the organization from here.
        sql.push(t.split_check_drop());
        for s in &sql {
            tx.batch_execute(s).map_err(fail)?;
        }
    }
    tx.execute(
        "UPDATE lokadb.moves SET step = 'prepare', updated_at = now() WHERE org = $1",
        &[&org],
    )
    .map_err(fail)?;
    failpoint("split-switch");
    tx.commit().map_err(fail)?;
    m.journal.step = "prepare".to_owned();
    Ok(())
}
