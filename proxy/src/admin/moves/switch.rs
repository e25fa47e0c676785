//! The switch and what follows it.
//!
//! The switch is one cloud transaction: lock the organization's own partitioned tables
//! (EXCLUSIVE: its writes wait, its reads go on; nobody else takes these locks), apply the
//! last changes, fix a snapshot of the destination for the verification, detach the old
//! partition, attach the new one, record the new state. The time from the lock to the
//! commit is the pause. After it the old side is frozen (detached), so the verification
//! compares it with the snapshot while the organization works.

use super::capture::CatchUp;
use super::layout::MoveTable;
use super::shapes;
use super::verify;
use super::{dest_rel, failpoint, logical, source_rel, Direction, Mode, Move};
use crate::admin::db::{describe, AdminError};
use std::time::{Duration, Instant};

/// The catch-up stops and the switch begins when fewer records than this are waiting.
pub const SWITCH_BACKLOG: u64 = 2_000;
/// Attempts at the switch's lock (each waits up to [`LOCK_WAIT`]).
pub const LOCK_ATTEMPTS: u32 = 10;
pub const LOCK_WAIT: &str = "1s";

/// What a switch did.
pub enum Switched {
    /// Switched; the connection holds the destination's snapshot for [`finish_with`].
    Yes(Box<postgres::Client>),
    /// Not switched: a migration changed the tables since the destination was made
    /// (checked under the switch's lock, which every DDL on the tables waits for).
    SchemaChanged(shapes::SchemaChanged),
}

/// Switches the organization to the destination. On return the journal says `verify`,
/// unless a migration changed the tables since the destination was made.
///
/// # Errors
///
/// A failure before the commit leaves everything as it was (a rerun switches again).
pub fn switch(m: &mut Move) -> Result<Switched, AdminError> {
    let direction = m.direction;
    let tables = m.tables.clone();
    let logical = m.journal.mode == Mode::Logical && direction == Direction::Out;
    let (mut src, mut dst) = match direction {
        Direction::Out => (m.cloud_session()?, m.org_session()?),
        Direction::Back => (m.org_session()?, m.cloud_session()?),
    };
    let mut marker = if logical {
        Some(m.cloud_session()?)
    } else {
        None
    };
    let mut cu = CatchUp::new();
    let org = m.org.id.clone();
    let (state, profile) = match direction {
        Direction::Out => ("moved", m.journal.profile.clone()),
        Direction::Back => ("cloud", m.journal.profile.clone()),
    };
    // What comes back was written in the organization's database: checked against the
    // cloud's key maps and foreign keys before it is attached. The whole copy here, while
    // the organization works (the key maps learn its keys, which stays right if the move is
    // aborted: they are its keys); under the lock only the rows the last rounds write.
    let mut learned = 0;
    if direction == Direction::Back {
        let mut tx = m.cloud.transaction()?;
        learned = super::take_back::check(&mut tx, &tables, &org, super::take_back::Rows::All)?;
        tx.commit()?;
        cu.keep_applied();
        failpoint("switch-checked");
    }
    for attempt in 1..=LOCK_ATTEMPTS {
        let mut tx = m.cloud.transaction()?;
        let locked = lock_own(&mut tx, &tables)
            .and_then(|locked| {
                if locked {
                    hold_direct_writers(&mut tx, &org)
                } else {
                    Ok(false)
                }
            })
            .map_err(|e| AdminError::failed(format!("switch of {org}: {}", describe(&e))))?;
        if !locked {
            drop(tx);
            if attempt == LOCK_ATTEMPTS {
                return Err(AdminError::failed(format!(
                    "switch of {org}: its tables' lock was not granted within {LOCK_WAIT}, {LOCK_ATTEMPTS} times (a long transaction on its rows?); nothing was switched, run the command again"
                )));
            }
            eprintln!("lokadb: switch of {org}: lock not granted within {LOCK_WAIT} (attempt {attempt}), retrying");
            std::thread::sleep(Duration::from_millis(200));
            continue;
        }
        // Under the lock no migration of these tables can commit: the destination was made
        // with the shape they have now, or the move copies again.
        if let Some(c) = shapes::changed(&mut tx, &org)? {
            drop(tx);
            return Ok(Switched::SchemaChanged(c));
        }
        let paused = Instant::now();
        // The destination's snapshot for the verification, taken right after the last
        // changes, in the same round trip.
        let snapshot = "BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT 1;";
        let applied = if let Some(mc) = marker.as_mut() {
            logical::marker(mc, &mut dst, &org)?;
            failpoint("switch-renamed-before");
            logical::rename(&tables, &mut dst, snapshot)?;
            failpoint("switch-renamed");
            0
        } else {
            cu.finish_then(
                &tables,
                &mut src,
                &|t| source_rel(t, direction),
                &mut dst,
                &|t| dest_rel(t, direction),
                snapshot,
            )?
        };
        let caught_up = paused.elapsed();
        if direction == Direction::Back {
            let applied = cu.take_applied();
            let rows = super::take_back::Rows::Applied(&applied);
            learned += super::take_back::check(&mut tx, &tables, &org, rows)?;
        }
        for t in &tables {
            let (old, new) = match direction {
                Direction::Out => (t.cloud_part(), t.foreign_part()),
                Direction::Back => (t.foreign_part(), t.cloud_part()),
            };
            tx.batch_execute(&format!(
                "ALTER TABLE {own} DETACH PARTITION {old};
                 ALTER TABLE {own} ATTACH PARTITION {new} FOR VALUES IN ({lit})",
                own = t.own(),
                lit = t.org_literal
            ))
            .map_err(|e| {
                AdminError::failed(format!(
                    "switch of {org} ({}): {}; nothing was switched",
                    t.display(),
                    describe(&e)
                ))
            })?;
            if direction == Direction::Out && !logical {
                for s in super::capture::remove_sql(t, &old) {
                    tx.batch_execute(&s)?;
                }
            }
        }
        tx.execute(
            "UPDATE lokadb.org SET state = $2, profile = $3 WHERE id = $1",
            &[&org, &state, &profile],
        )?;
        tx.execute(
            "UPDATE lokadb.moves SET step = 'verify', updated_at = now() WHERE org = $1",
            &[&org],
        )?;
        failpoint("switch");
        tx.commit()?;
        let pause = paused.elapsed();
        m.journal.step = "verify".to_owned();
        m.pause = Some(pause.as_secs_f64());
        m.say(format!(
            "switched {org} to {}: its writes paused {:.0} ms ({} last records applied in {:.0} ms)",
            match direction {
                Direction::Out => "its database",
                Direction::Back => "the cloud",
            },
            pause.as_secs_f64() * 1e3,
            applied,
            caught_up.as_secs_f64() * 1e3
        ));
        if learned > 0 {
            m.say(format!(
                "key maps: {learned} keys written in {org}'s database taken into the cloud's key maps"
            ));
        }
        return Ok(Switched::Yes(Box::new(dst)));
    }
    unreachable!("the last attempt returns")
}

/// Takes the organization's tables' lock in `tx`, a transaction (in the order the tables were enabled,
/// which is the order writers following foreign keys take them). Returns false when it
/// was not granted in time or this transaction was a deadlock's victim — this side
/// notices a deadlock first (its deadlock_timeout is short), so it is the victim, never a
/// writer of the application.
///
/// # Errors
///
/// Any other failure.
pub fn lock_own(
    tx: &mut impl postgres::GenericClient,
    tables: &[MoveTable],
) -> Result<bool, postgres::Error> {
    tx.batch_execute(&format!("SET LOCAL lock_timeout = '{LOCK_WAIT}'"))?;
    // Without it the order above still avoids most deadlocks.
    be_the_deadlock_victim(tx)?;
    for t in tables {
        if let Err(e) = tx.batch_execute(&format!("LOCK TABLE {} IN EXCLUSIVE MODE", t.own())) {
            if e.as_db_error()
                .is_some_and(|d| matches!(d.code().code(), "55P03" | "40P01"))
            {
                return Ok(false);
            }
            return Err(e);
        }
    }
    Ok(true)
}

/// Makes `tx` notice a deadlock before the application's transactions do (a short
/// `deadlock_timeout`), so an admin step is its victim, retried, never a writer. A superuser
/// setting: for another role nothing changes.
///
/// # Errors
///
/// The savepoint failed.
pub fn be_the_deadlock_victim(
    tx: &mut impl postgres::GenericClient,
) -> Result<(), postgres::Error> {
    set_local_if_allowed(tx, "deadlock_timeout", "'100ms'")
}

/// `SET LOCAL setting = value` in `tx`, inside a savepoint: a server or role that refuses it
/// leaves the transaction as it was.
///
/// # Errors
///
/// The savepoint failed.
pub fn set_local_if_allowed(
    tx: &mut impl postgres::GenericClient,
    setting: &str,
    value: &str,
) -> Result<(), postgres::Error> {
    if tx
        .batch_execute(&format!(
            "SAVEPOINT s; SET LOCAL {setting} = {value}; RELEASE s"
        ))
        .is_err()
    {
        tx.batch_execute("ROLLBACK TO SAVEPOINT s; RELEASE s")?;
    }
    Ok(())
}

/// Takes the organization's direct-writers key exclusively for the switch's transaction:
/// the proxy's direct writes hold it shared from their gate (`lokadb_client.direct_gate`)
/// until the organization's transaction ends, so those in flight finish first, and those
/// after it find the organization switched and go through the cloud. Cloud writers never
/// take it (they take the pause key, which the switch leaves alone: with the table locks
/// above, a cloud writer holding the pause key would wait for the switch and the switch for
/// it). False when not granted within the lock timeout [`lock_own`] set (retried like its
/// locks).
///
/// # Errors
///
/// Any other failure.
fn hold_direct_writers(
    tx: &mut impl postgres::GenericClient,
    org: &str,
) -> Result<bool, postgres::Error> {
    match tx.execute(
        "SELECT pg_advisory_xact_lock(lokadb.direct_key($1))",
        &[&org],
    ) {
        Ok(_) => Ok(true),
        Err(e)
            if e.as_db_error()
                .is_some_and(|d| matches!(d.code().code(), "55P03" | "40P01")) =>
        {
            Ok(false)
        }
        Err(e) => Err(e),
    }
}

/// Verification and clean-up after a switch (a rerun at step `verify` comes here).
///
/// # Errors
///
/// A failed check (the old copy is kept; the journal stays at `verify`) or a failure.
pub fn finish(m: &mut Move) -> Result<(), AdminError> {
    finish_with(m, None)
}

pub fn finish_with(m: &mut Move, snap: Option<postgres::Client>) -> Result<(), AdminError> {
    let direction = m.direction;
    let tables = m.tables.clone();
    let org = m.org.id.clone();
    failpoint("verify");
    // The destination as of the switch. On a rerun the organization has written since:
    // the keys it wrote (recorded by the destination's capture) are left out on both sides.
    let rerun = snap.is_none();
    let mut dest = match snap {
        Some(s) => s,
        None => {
            let mut d = match direction {
                Direction::Out => m.org_session()?,
                Direction::Back => m.cloud_session()?,
            };
            d.batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ")?;
            d
        }
    };
    let mut old_side = match direction {
        Direction::Out => m.cloud_session()?,
        Direction::Back => m.org_session()?,
    };
    // The destination's side first, then its snapshot ends: it holds the tables' locks
    // there, and a migration that waited for the switch may hold the cloud's (DEFAULT's, read
    // below) while it waits for those — a deadlock only its lock_timeout would end.
    let mut dest_sums = Vec::new();
    for t in &tables {
        let new = match direction {
            Direction::Out => t.org_table(),
            Direction::Back => t.cloud_part(),
        };
        let since: Vec<String> = if rerun {
            dest.query(
                "SELECT DISTINCT key::text FROM lokadb.changes WHERE org = $1 AND rel = $2",
                &[&org, &t.display()],
            )?
            .iter()
            .map(|r| r.get(0))
            .collect()
        } else {
            Vec::new()
        };
        let b = verify::sum(&mut dest, t, &new, &since)?;
        dest_sums.push((since, b));
    }
    let _ = dest.batch_execute("COMMIT");
    let mut ok = true;
    let mut lines = Vec::new();
    for (t, (since, b)) in tables.iter().zip(dest_sums) {
        let old = match direction {
            Direction::Out => t.cloud_part(),
            Direction::Back => t.org_table(),
        };
        let a = verify::sum(&mut old_side, t, &old, &since)?;
        let in_default = verify::left_in_default(&mut m.cloud, t)?;
        let (mut line, good) = verify::compare(t, &a, &b, in_default);
        if !since.is_empty() {
            line.push_str(&format!(
                " (without {} rows written since the switch)",
                since.len()
            ));
        }
        ok &= good;
        lines.push(line);
    }
    for l in &lines {
        m.say(format!("verify {l}"));
    }
    if !ok {
        m.progress("verification failed: the old copy is kept");
        return Err(AdminError::failed(format!(
            "verification of {org} FAILED (see above); the old copy is kept ({}), the switch stands; investigate before rerunning",
            tables
                .iter()
                .map(|t| match direction {
                    Direction::Out => t.cloud_part(),
                    Direction::Back => format!("{} in its database", t.org_table()),
                })
                .collect::<Vec<_>>()
                .join(", ")
        )));
    }
    // The old copy goes next: a rerun from here must not verify against it again.
    m.set_step("cleanup")?;
    failpoint("cleanup");
    cleanup(m)
}

/// Removes the old copy and what the move installed (each step idempotent: a rerun
/// after a crash here repeats it), then ends the move.
///
/// # Errors
///
/// A step failed; a rerun repeats the clean-up.
pub fn cleanup(m: &mut Move) -> Result<(), AdminError> {
    let tables = m.tables.clone();
    match m.direction {
        Direction::Out => {
            if m.journal.mode == Mode::Logical {
                logical::stop(m)?;
            }
            let mut oc = m.org_session()?;
            for t in &tables {
                let table = t.org_table();
                let mut tx = oc.transaction()?;
                for s in super::capture::remove_sql(t, &table) {
                    tx.batch_execute(&s)?;
                }
                tx.commit()?;
                // Its row count lets postgres_fdw sample it remotely (analyze_sampling)
                // rather than read it whole through the tunnel.
                oc.batch_execute(&format!("ANALYZE {table}"))?;
                m.cloud
                    .batch_execute(&format!("DROP TABLE IF EXISTS {}", t.cloud_part()))?;
                // Autovacuum does not analyze foreign tables: without statistics the
                // planner pushes neither aggregates nor LIMIT to the organization.
                m.cloud
                    .batch_execute(&format!("ANALYZE {}", t.foreign_part()))?;
            }
            let id = m.org.id.clone();
            m.say(format!(
                "removed {id}'s rows from the cloud; analyzed its foreign partitions"
            ));
        }
        Direction::Back => {
            let mut oc = m.org_session()?;
            for t in &tables {
                let table = t.org_table();
                let mut tx = oc.transaction()?;
                for s in super::capture::remove_sql(t, &table) {
                    tx.batch_execute(&s)?;
                }
                tx.batch_execute(&format!("DROP TABLE IF EXISTS {table}"))?;
                tx.commit()?;
                m.cloud.batch_execute(&format!(
                    "DROP FOREIGN TABLE IF EXISTS {}",
                    t.foreign_part()
                ))?;
                let part = t.cloud_part();
                let mut tx = m.cloud.transaction()?;
                for s in super::capture::remove_sql(t, &part) {
                    tx.batch_execute(&s)?;
                }
                tx.commit()?;
                m.cloud.batch_execute(&format!("ANALYZE {part}"))?;
            }
            let id = m.org.id.clone();
            m.say(format!(
                "removed {id}'s tables from its database (they are in the cloud again)"
            ));
        }
    }
    let org = m.org.id.clone();
    m.cloud
        .execute("DELETE FROM lokadb.moves WHERE org = $1", &[&org])?;
    Ok(())
}
