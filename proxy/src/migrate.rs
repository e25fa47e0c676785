//! The second phase of the application's migrations (docs/migrations.md).
//!
//! A migration's DDL on a LokaDB table is run and PREPAREd in every moved organization's
//! database from inside the cloud's own COMMIT (`lokadb.ddl_commit()`, cloud schema
//! version 11). What is left once the cloud's transaction has ended is to COMMIT PREPARED
//! (or, if it rolled back after preparing, ROLLBACK PREPARED) in each organization:
//! `lokadb.ddl_resolve()`, which decides by the cloud's record alone. Until then the
//! prepared transaction holds its locks in the organization's database, so its statements
//! on the table wait (they never see the old shape after the cloud's commit).
//!
//! One thread per database with an `auth_user`, off the cores, calls it:
//! - on `NOTIFY lokadb_ddl` (sent by a committed migration): the organizations it prepared;
//! - at start, and while `lokadb.ddl_attempt` moves: every organization (a sweep), which
//!   also finds what a migration prepared before its cloud transaction rolled back or the
//!   cloud crashed. Prepared transactions of a cloud transaction still running are left and
//!   looked at again a second later.
//!
//! - every few seconds while some organization owes migrations (it could not be reached,
//!   `lokadb.migration_offline = defer`): [`sync`] applies them once it can be reached.
//!
//! The thread's session keeps `lokadb.ddl_resolve()`'s connections to organizations (one
//! each, schema 17), so a pass opens none and settles every organization at once.
//!
//! `lokadb resolve` does the same sweep by hand (no proxy running), `lokadb org sync` the
//! sync.

use postgres::fallible_iterator::FallibleIterator;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// What one call of `lokadb.ddl_resolve` did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Resolved {
    /// Prepared transactions committed (their cloud transaction committed).
    pub committed: i32,
    /// Rolled back (their cloud transaction did not commit).
    pub rolled_back: i32,
    /// Left: their cloud transaction is still running.
    pub in_doubt: i32,
    /// Organizations that could not be reached.
    pub unreachable: i32,
}

impl Resolved {
    fn settled(&self) -> bool {
        self.in_doubt == 0 && self.unreachable == 0
    }
}

/// Settles prepared migrations: those of committed rounds, and with `sweep` every
/// organization's.
///
/// # Errors
///
/// The cloud's query failed (an unreachable organization is counted, not an error).
pub fn resolve(client: &mut postgres::Client, sweep: bool) -> Result<Resolved, postgres::Error> {
    let row = client.query_one(
        "SELECT committed, rolled_back, in_doubt, unreachable FROM lokadb.ddl_resolve($1)",
        &[&sweep],
    )?;
    Ok(Resolved {
        committed: row.get(0),
        rolled_back: row.get(1),
        in_doubt: row.get(2),
        unreachable: row.get(3),
    })
}

/// What one call of `lokadb.ddl_sync` applied in an organization.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Synced {
    /// Migrations it owed (0: it owed nothing).
    pub migrations: i32,
    /// Their statements.
    pub statements: i32,
}

/// Applies what organization `org` owes (migrations it could not be reached for, with
/// `lokadb.migration_offline = defer`), in order, in one transaction there, and commits it
/// there as a migration's second phase does.
///
/// # Errors
///
/// The organization still cannot take them (the organization's error, named), its rows are
/// locked by another sync or a migration (55P03), or the cloud's query failed. Nothing
/// changed then.
pub fn sync(client: &mut postgres::Client, org: &str) -> Result<Synced, postgres::Error> {
    let mut tx = client.transaction()?;
    let row = tx.query_one(
        "SELECT migrations, statements FROM lokadb.ddl_sync($1)",
        &[&org],
    )?;
    tx.commit()?;
    let synced = Synced {
        migrations: row.get(0),
        statements: row.get(1),
    };
    if synced.migrations > 0 {
        resolve(client, false)?;
    }
    Ok(synced)
}

/// The organizations that owe migrations (schema 17+), in order.
pub const OWED_ORGS_SQL: &str = "SELECT * FROM lokadb.owed_orgs()";

/// The organizations that owe migrations, when the cloud's schema knows of owing (15+).
///
/// # Errors
///
/// The cloud's query failed.
pub fn owing(client: &mut postgres::Client) -> Result<Vec<String>, postgres::Error> {
    let rows = client.query(OWED_ORGS_SQL, &[]);
    match rows {
        Ok(rows) => Ok(rows.iter().map(|r| r.get(0)).collect()),
        // An older schema: nobody owes (15 and 16 did not have the function; their owing
        // organizations are found once the schema is upgraded).
        Err(e) if e.code() == Some(&postgres::error::SqlState::UNDEFINED_FUNCTION) => {
            Ok(Vec::new())
        }
        Err(e) => Err(e),
    }
}

/// How long a wait for notifications lasts before the shutdown flag and the attempt
/// counter are looked at again.
const POLL: Duration = Duration::from_secs(1);
/// How often organizations that could not be reached are asked again.
const UNREACHABLE_RETRY: Duration = Duration::from_secs(30);
/// How often an organization that owes migrations is tried (a connection the relay refuses
/// at once while its agent is away; the organization's statements are refused until then).
const OWED_RETRY: Duration = Duration::from_secs(5);
const RECONNECT: Duration = Duration::from_secs(5);

/// Starts the resolver of `database`.
///
/// # Errors
///
/// The thread could not be spawned.
pub fn spawn(
    database: String,
    config: crate::net::cloud_tls::PgLogin,
    shutdown: Arc<AtomicBool>,
) -> std::io::Result<()> {
    std::thread::Builder::new()
        .name(format!("lokadb-ddl-{database}"))
        .spawn(move || {
            while !shutdown.load(Ordering::Relaxed) {
                if let Err(e) = run(&database, &config, &shutdown) {
                    tracing::warn!(
                        database,
                        error = %crate::admin::db::describe(&e),
                        "migration resolver: cannot reach the cloud; prepared migrations in organizations' databases wait"
                    );
                }
                let until = Instant::now() + RECONNECT;
                while Instant::now() < until && !shutdown.load(Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(200));
                }
            }
        })?;
    Ok(())
}

/// One connection's life. Returns `Ok` at shutdown or when the cloud has no migration
/// support (an older LokaDB schema: it is looked for again after a reconnect delay).
fn run(
    database: &str,
    config: &crate::net::cloud_tls::PgLogin,
    shutdown: &AtomicBool,
) -> Result<(), postgres::Error> {
    let mut client = config.connect()?;
    let schema = client.query_one(
        "SELECT to_regprocedure('lokadb.ddl_resolve(boolean)') IS NOT NULL, \
                to_regprocedure('lokadb.ddl_attempts()') IS NOT NULL",
        &[],
    )?;
    if !schema.get::<_, bool>(0) {
        return Ok(());
    }
    // Before version 17 the counter is read as the sequence (a plain auth_user needs a grant).
    let attempts_sql = if schema.get::<_, bool>(1) {
        "SELECT lokadb.ddl_attempts()"
    } else {
        "SELECT last_value FROM lokadb.ddl_attempt"
    };
    // LISTEN first: a migration committed after it is announced; one before it is swept.
    client.batch_execute("LISTEN lokadb_ddl")?;
    let attempts = |c: &mut postgres::Client| -> Result<i64, postgres::Error> {
        Ok(c.query_one(attempts_sql, &[])?.get(0))
    };
    let mut swept_at = attempts(&mut client)?;
    let mut last = sweep_logged(database, &mut client)?;
    let mut last_sweep = Instant::now();
    let mut last_owed = Instant::now()
        .checked_sub(OWED_RETRY)
        .unwrap_or_else(Instant::now);
    loop {
        // Woken by the first announcement (or POLL without one); those that came with it
        // are taken along without waiting: a prepared transaction holds its locks in the
        // organization's database until it is committed here.
        let committed = {
            let mut notes = client.notifications();
            let first = notes.timeout_iter(POLL).next()?.is_some();
            let mut pending = notes.iter();
            while pending.next()?.is_some() {}
            first
        };
        if shutdown.load(Ordering::Relaxed) {
            return Ok(());
        }
        if committed {
            log(database, resolve(&mut client, false)?);
        }
        // A sweep is done again while attempts happen, and until one finds nothing still
        // running: a round prepares before it moves the counter the second time, so the
        // first sweep that starts after that sees what it prepared.
        let now_at = attempts(&mut client)?;
        let due = now_at != swept_at
            || last.in_doubt > 0
            || (last.unreachable > 0 && last_sweep.elapsed() >= UNREACHABLE_RETRY);
        if due {
            swept_at = now_at;
            last = sweep_logged(database, &mut client)?;
            last_sweep = Instant::now();
        }
        if last_owed.elapsed() >= OWED_RETRY {
            last_owed = Instant::now();
            sync_owing(database, &mut client)?;
        }
    }
}

/// Tries every organization that owes migrations: one that can be reached again gets them.
fn sync_owing(database: &str, client: &mut postgres::Client) -> Result<(), postgres::Error> {
    for org in owing(client)? {
        match sync(client, &org) {
            Ok(s) if s.migrations > 0 => tracing::info!(
                database,
                org,
                migrations = s.migrations,
                statements = s.statements,
                "migration resolver: an organization that owed migrations has them now"
            ),
            Ok(_) => {}
            // Still away, or a conflict there: its statements stay refused; said once per
            // try at debug, the operator sees it with lokadb org sync.
            Err(e) if e.as_db_error().is_some() => tracing::debug!(
                database,
                org,
                error = %crate::admin::db::describe(&e),
                "migration resolver: an organization still owes migrations"
            ),
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn sweep_logged(
    database: &str,
    client: &mut postgres::Client,
) -> Result<Resolved, postgres::Error> {
    let r = resolve(client, true)?;
    log(database, r);
    Ok(r)
}

fn log(database: &str, r: Resolved) {
    if r.committed > 0 || r.rolled_back > 0 {
        tracing::info!(
            database,
            committed = r.committed,
            rolled_back = r.rolled_back,
            in_doubt = r.in_doubt,
            "migration resolver: prepared migrations settled in organizations' databases"
        );
    }
    if !r.settled() {
        tracing::debug!(
            database,
            in_doubt = r.in_doubt,
            unreachable = r.unreachable,
            "migration resolver: prepared migrations left for now"
        );
    }
}
