//! `lokadb split ORG`: the first move's split ([`super::split`]) on its own, ahead of any
//! move. The organization stays in the cloud, in partitions of its own; its later
//! `move-org` has no split, so its writes pause only at the switch, whatever its size.
//!
//! Why a command of its own: the split's pause grows with the organization (its rows leave
//! DEFAULT's heap under it, and nothing in Postgres removes a subset of a heap's rows
//! faster than their number), so an operator picks its moment — a quiet hour, or while the
//! organization is still small — instead of paying it at the move.
//!
//! Crash safety is the move's: a journal row (direction `split`) says a split is in
//! progress; a rerun starts the split's copy again (or, after the attach committed, only
//! ends the journal); `--abort` removes what an unfinished split made, all of it in the
//! cloud (the organization's database is not needed at any point).

use super::layout::{self, MoveTable, Place};
use super::{
    in_progress, read_journal, split, under_move_lock, Direction, Journal, Mode, Move, MoveOptions,
};
use crate::admin::db::AdminError;
use crate::admin::fkeys::{run_all, with_lock_retry};
use std::time::Instant;

/// The journal's direction for a split on its own.
pub const DIRECTION: &str = "split";

/// `lokadb split ORG [--abort]`: returns the report.
///
/// # Errors
///
/// Bad input (usage: nothing changed) or a failure (the journal keeps the split; a rerun
/// finishes it, `--abort` removes it).
pub fn split_org(dsn: &str, org_id: &str, abort: bool) -> Result<String, AdminError> {
    crate::admin::org::check_id(org_id)?;
    under_move_lock(dsn, org_id, |slot, org| run_locked(slot, dsn, org, abort))
}

fn run_locked(
    slot: &mut Option<postgres::Client>,
    dsn: &str,
    org: super::Org,
    abort: bool,
) -> Result<String, AdminError> {
    let cloud = slot.as_mut().expect("the cloud session is in the slot");
    let started = Instant::now();
    let tables = layout::tables(cloud, &org.id)?;
    let journal = match read_journal(cloud, &org.id)? {
        Some(j) if j.direction == DIRECTION => j,
        Some(j) => return Err(in_progress(&org.id, &j)),
        None if abort => {
            return Err(AdminError::usage(format!(
                "no split of organization {} is in progress; nothing to abort",
                org.id
            )))
        }
        None => match start(cloud, &org, &tables)? {
            Some(j) => j,
            None => {
                return Ok(format!(
                    "organization {} has partitions of its own already: nothing to split (its next move-org has no split)",
                    org.id
                ))
            }
        },
    };
    let opts = MoveOptions {
        org: org.id.clone(),
        mode: Mode::Trigger,
        profile: None,
        jobs: 1,
        part_bytes: u64::MAX,
        abort,
        resume: false,
        org_dsn: None,
        cloud_from_org: None,
        fold_max_rows: 0,
    };
    let mut m = Move {
        dsn: dsn.to_owned(),
        // Never used: a split reads and writes only the cloud.
        org_dsn: String::new(),
        cloud: slot.take().expect("the cloud session is in the slot"),
        org,
        tables,
        opts,
        journal,
        direction: Direction::Out,
        report: Vec::new(),
        pause: None,
    };
    let result = if abort {
        abort_split(&mut m).map(|()| format!("split of {} rolled back", m.org.id))
    } else {
        finish(&mut m, started)
    };
    *slot = Some(m.cloud);
    result
}

/// Checks the organization can be split and writes the journal row; `None` when it has no
/// table left in DEFAULT.
fn start(
    cloud: &mut postgres::Client,
    org: &super::Org,
    tables: &[MoveTable],
) -> Result<Option<Journal>, AdminError> {
    if org.state != "cloud" {
        return Err(AdminError::usage(format!(
            "organization {} is {}: only an organization in the cloud is split (its rows are where a move put them); nothing was changed",
            org.id, org.state
        )));
    }
    if !split::in_default(cloud, tables)? {
        return Ok(None);
    }
    split::preflight(cloud, tables)?;
    cloud.execute(
        "INSERT INTO lokadb.moves (org, direction, mode, profile, from_state, step)
         VALUES ($1, $2, 'trigger', $3, $4, 'split')",
        &[&org.id, &DIRECTION, &org.profile, &org.state],
    )?;
    Ok(Some(Journal {
        direction: DIRECTION.to_owned(),
        mode: Mode::Trigger,
        profile: org.profile.clone(),
        from_state: org.state.clone(),
        step: "split".to_owned(),
        copied: Vec::new(),
    }))
}

/// The split, then the end of the journal. The attach's transaction sets the journal's
/// step to `prepare`: a rerun that finds it there only ends the journal.
fn finish(m: &mut Move, started: Instant) -> Result<String, AdminError> {
    if m.journal.step == "split" {
        split::run(m)?;
    } else {
        m.say(format!(
            "the split of {} was done; ending its journal",
            m.org.id
        ));
    }
    super::failpoint("after-split");
    m.cloud
        .execute("DELETE FROM lokadb.moves WHERE org = $1", &[&m.org.id])?;
    Ok(format!(
        "split of {} done in {:.1} s: it has partitions of its own in the cloud, and its next move-org has no split",
        m.org.id,
        started.elapsed().as_secs_f64()
    ))
}

/// Removes what an unfinished split made (its capture on DEFAULT, its check, its
/// unattached tables); after the attach there is nothing to remove, and the partitions
/// stay (`lokadb fold` puts the organization back into DEFAULT).
fn abort_split(m: &mut Move) -> Result<(), AdminError> {
    let tables = m.tables.clone();
    for t in &tables {
        if layout::place(&mut m.cloud, t)? != Place::Default {
            continue;
        }
        let sql = split::undo(&mut m.cloud, t)?;
        with_lock_retry(
            &mut m.cloud,
            &format!("rolling back the split of {}", t.display()),
            |tx| run_all(tx, &sql),
        )?;
    }
    m.cloud
        .execute("DELETE FROM lokadb.moves WHERE org = $1", &[&m.org.id])?;
    Ok(())
}
