//! Moving a foreign key's target (to a key map on enable, back to the table on disable)
//! without a long lock, and running short DDL transactions that give way to the
//! application: each takes its locks with `lock_timeout`, and is retried when a lock is
//! not granted in time.

use super::catalog::ForeignKey;
use super::db::{describe, ident, literal, AdminError};
use super::keymap::suffixed;
use std::time::Duration;

/// How long a DDL transaction waits for a lock before it gives way and retries.
pub const LOCK_TIMEOUT: &str = "2s";
/// How many times it tries.
pub const ATTEMPTS: u32 = 5;

/// How long a step waits for a lock while it holds another: under the server's default
/// deadlock_timeout (1 s), so a deadlock with an application's transaction aborts the step.
pub const SECOND_LOCK_TIMEOUT: &str = "300ms";

/// Runs `body` in a transaction with `SET LOCAL lock_timeout`, retrying when a lock is not
/// granted in time (SQLSTATE 55P03), and saying so on stderr. `what` names the step.
///
/// # Errors
///
/// Any other failure (rolled back), or no lock after [`ATTEMPTS`].
pub fn with_lock_retry<T>(
    client: &mut postgres::Client,
    what: &str,
    body: impl FnMut(&mut postgres::Transaction<'_>) -> Result<T, StepError>,
) -> Result<T, AdminError> {
    with_lock_retry_within(client, what, LOCK_TIMEOUT, body)
}

/// [`with_lock_retry`], waiting at most `wait` (a Postgres interval) for a lock: shorter
/// for a lock whose waiting blocks everyone queued behind it (ACCESS EXCLUSIVE).
///
/// # Errors
///
/// As [`with_lock_retry`].
pub fn with_lock_retry_within<T>(
    client: &mut postgres::Client,
    what: &str,
    wait: &str,
    mut body: impl FnMut(&mut postgres::Transaction<'_>) -> Result<T, StepError>,
) -> Result<T, AdminError> {
    for attempt in 1..=ATTEMPTS {
        let mut tx = client.transaction()?;
        tx.batch_execute(&format!("SET LOCAL lock_timeout = '{wait}'"))?;
        match body(&mut tx) {
            Ok(v) => {
                tx.commit()?;
                return Ok(v);
            }
            Err(StepError::Pg(e, _))
                // Lock timeout, or chosen as a deadlock's victim: nothing was done; again.
                if e
                    .as_db_error()
                    .is_some_and(|d| matches!(d.code().code(), "55P03" | "40P01")) =>
            {
                drop(tx);
                if attempt == ATTEMPTS {
                    return Err(AdminError::failed(format!(
                        "{what}: a lock was not granted within {wait}, {ATTEMPTS} times (long transactions on the table?); nothing of this step was changed, run the command again"
                    )));
                }
                eprintln!(
                    "lokadb: {what}: a lock was not granted within {wait} (attempt {attempt} of {ATTEMPTS}), retrying"
                );
                std::thread::sleep(Duration::from_millis(200 * u64::from(attempt)));
            }
            Err(StepError::Pg(e, sql)) => {
                return Err(AdminError::failed(format!(
                    "{what} failed and was rolled back: {}\nstatement: {sql}",
                    describe(&e)
                )))
            }
            Err(StepError::Admin(e)) => return Err(e),
        }
    }
    unreachable!("the last attempt returns")
}

/// A failure inside [`with_lock_retry`]'s body.
#[derive(Debug)]
pub enum StepError {
    /// A statement failed: the error and the statement.
    Pg(postgres::Error, String),
    /// A check failed.
    Admin(AdminError),
}

impl From<AdminError> for StepError {
    fn from(e: AdminError) -> StepError {
        StepError::Admin(e)
    }
}

impl From<postgres::Error> for StepError {
    fn from(e: postgres::Error) -> StepError {
        StepError::Pg(e, String::new())
    }
}

/// Runs each statement, naming the one that fails.
///
/// # Errors
///
/// The first failure.
pub fn run_all(tx: &mut postgres::Transaction<'_>, sql: &[String]) -> Result<(), StepError> {
    for s in sql {
        tx.batch_execute(s)
            .map_err(|e| StepError::Pg(e, s.clone()))?;
    }
    Ok(())
}

/// The name a foreign key has while both it and its replacement exist.
pub fn temp_name(fk: &ForeignKey) -> String {
    suffixed(&fk.name, "__lokadb")
}

/// The three steps that point `fk` at `target` (columns `fk.ref_columns` there) under the
/// same name: add NOT VALID (a brief lock on child and target), validate (scans the child
/// and blocks no writes), then drop the old one and rename, in one short transaction.
pub fn repoint_sql(fk: &ForeignKey, target: &str) -> [Vec<String>; 3] {
    let child = fk.child();
    let tmp = ident(&temp_name(fk));
    let old = &fk.referenced;
    // Writers take these relations in either order: an insert into the child checks the
    // key map after, a delete from the table cascades to the child before its key map's
    // trigger runs. So each step waits long only for its first lock, holding nothing; the
    // others it waits for less than the server's deadlock_timeout (1 s by default), so in a
    // deadlock it is the step that gives up (and is retried), never the application.
    let rest = format!("SET LOCAL lock_timeout = '{SECOND_LOCK_TIMEOUT}'");
    [
        vec![
            format!("LOCK TABLE {target} IN SHARE ROW EXCLUSIVE MODE"),
            rest.clone(),
            format!("LOCK TABLE {child} IN SHARE ROW EXCLUSIVE MODE"),
            format!(
                "ALTER TABLE {child} ADD CONSTRAINT {tmp} {} NOT VALID",
                fk.definition(target)
            ),
        ],
        vec![format!("ALTER TABLE {child} VALIDATE CONSTRAINT {tmp}")],
        vec![
            format!("LOCK TABLE {old} IN ACCESS EXCLUSIVE MODE"),
            rest,
            format!("LOCK TABLE {target}, {child} IN ACCESS EXCLUSIVE MODE"),
            format!("ALTER TABLE {child} DROP CONSTRAINT {}", ident(&fk.name)),
            format!(
                "ALTER TABLE {child} RENAME CONSTRAINT {tmp} TO {}",
                ident(&fk.name)
            ),
        ],
    ]
}

/// Points `fk` at `target`, resuming where a previous run stopped (the temporary
/// constraint may already exist, validated or not). `record` runs in the last
/// transaction (it writes lokadb.fkeys).
///
/// # Errors
///
/// A step failed; what was done stays and a rerun goes on.
pub fn repoint(
    client: &mut postgres::Client,
    fk: &ForeignKey,
    target: &str,
    record: &str,
) -> Result<(), AdminError> {
    let [add, validate, swap] = repoint_sql(fk, target);
    let what = format!(
        "pointing foreign key {} of {} at {target}",
        fk.name,
        fk.child_display()
    );
    let tmp: Option<bool> = client
        .query_opt(
            "SELECT convalidated FROM pg_constraint WHERE conrelid = $1 AND conname = $2",
            &[&fk.child_oid, &temp_name(fk)],
        )?
        .map(|r| r.get(0));
    if tmp.is_none() {
        with_lock_retry(client, &what, |tx| run_all(tx, &add))?;
    }
    if tmp != Some(true) {
        with_lock_retry(client, &what, |tx| run_all(tx, &validate))?;
    }
    with_lock_retry(client, &what, |tx| {
        run_all(tx, &swap)?;
        tx.batch_execute(record)
            .map_err(|e| StepError::Pg(e, record.to_owned()))
    })
}

/// The lokadb.fkeys row of a re-pointed foreign key.
pub fn record_sql(fk: &ForeignKey, keymap: &str) -> String {
    format!(
        "INSERT INTO lokadb.fkeys (child_schema, child_table, constraint_name, keymap) VALUES ({}, {}, {}, {}) ON CONFLICT DO NOTHING",
        literal(&fk.child_schema),
        literal(&fk.child_table),
        literal(&fk.name),
        literal(keymap)
    )
}

/// Deletes the lokadb.fkeys row of a foreign key pointed back at its table.
pub fn unrecord_sql(fk: &ForeignKey) -> String {
    format!(
        "DELETE FROM lokadb.fkeys WHERE child_schema = {} AND child_table = {} AND constraint_name = {}",
        literal(&fk.child_schema),
        literal(&fk.child_table),
        literal(&fk.name)
    )
}
