//! The `lokadb` schema in the cloud database, versioned: each `sql/NNNN_name.sql` is one
//! migration, applied once, in order, each in its own transaction, and recorded in
//! `lokadb.migrations`. `lokadb init` applies what is missing, so running it again is
//! harmless and a newer `lokadb` upgrades an existing install.

use super::db::{connect, AdminError};

/// Every migration, in order: (version, description, SQL).
pub const MIGRATIONS: &[(i32, &str, &str)] = &[
    (
        1,
        "organizations, metadata generation, pause",
        include_str!("sql/0001_init.sql"),
    ),
    (
        2,
        "LokaDB tables, key maps, re-pointed foreign keys",
        include_str!("sql/0002_tables.sql"),
    ),
    (
        3,
        "foreign keys kept across foreign partitions: parent checks, refs",
        include_str!("sql/0003_guards.sql"),
    ),
    (
        4,
        "moving organizations: journal, change capture, marker, eviction at the split",
        include_str!("sql/0004_moves.sql"),
    ),
    (
        5,
        "moves: a clean-up step in the journal; refs_fill under a given table and at any depth",
        include_str!("sql/0005_moves_cleanup.sql"),
    ),
    (
        6,
        "the direct path's writes: what they may not change, the gate before them",
        include_str!("sql/0006_direct.sql"),
    ),
    (
        7,
        "the join rewrite: the foreign keys an inner join may lean on",
        include_str!("sql/0007_joins.sql"),
    ),
    (
        8,
        "the key-map rewrite: a key's organization for statements that name none",
        include_str!("sql/0008_keys.sql"),
    ),
    (
        9,
        "the gate of direct writes only for roles that may write organizations' rows",
        include_str!("sql/0009_direct_gate.sql"),
    ),
    (
        10,
        "the partitions of a LokaDB table belong to the table's owner",
        include_str!("sql/0010_owners.sql"),
    ),
    (
        11,
        "migrations of LokaDB tables reach moved organizations (two-phase commit)",
        include_str!("sql/0011_migrations.sql"),
    ),
    (
        12,
        "moves and migrations: a move's switch checks the shape it copied; migrations reach returning organizations",
        include_str!("sql/0012_moves_meet_migrations.sql"),
    ),
    (
        13,
        "what cannot run in a transaction: indexes built concurrently in organizations",
        include_str!("sql/0013_concurrently.sql"),
    ),
    (
        14,
        "migrations open their connections to organizations before the cloud's locks, and keep them",
        include_str!("sql/0014_ddl_connections.sql"),
    ),
    (
        15,
        "an organization that cannot be reached may owe a migration (lokadb.migration_offline = defer) until it is synced",
        include_str!("sql/0015_owed_migrations.sql"),
    ),
    (
        16,
        "ALTER TYPE … ADD VALUE and RENAME VALUE of a LokaDB table's enum reach moved organizations",
        include_str!("sql/0016_enum_values.sql"),
    ),
    (
        17,
        "the watcher and the resolver read the migration tables through SECURITY DEFINER functions; the resolver forgets only the prepared rows it read before listing an organization",
        include_str!("sql/0017_resolver_fixes.sql"),
    ),
    (
        18,
        "lokadb enable's key map backfill resumes after the last key a killed run copied",
        include_str!("sql/0018_backfill_resume.sql"),
    ),
    (
        19,
        "a move in progress publishes its figures (phase, rows, bytes, rate, lag, ETA) for lokadb status --watch",
        include_str!("sql/0019_move_figures.sql"),
    ),
    (
        20,
        "lokadb split gives an organization in the cloud partitions of its own ahead of its move",
        include_str!("sql/0020_split_ahead.sql"),
    ),
];

/// Serializes concurrent `lokadb init` runs.
const INIT_LOCK: i64 = 0x4c4f_4b41_0000_0001;

/// What `init` did.
#[derive(Debug, PartialEq, Eq)]
pub struct InitReport {
    /// Version before.
    pub from: i32,
    /// Version now.
    pub to: i32,
}

/// The version installed in the database (0 without the schema).
///
/// # Errors
///
/// The query failed.
pub fn installed_version(client: &mut postgres::Client) -> Result<i32, AdminError> {
    let exists: bool = client
        .query_one("SELECT to_regclass('lokadb.migrations') IS NOT NULL", &[])?
        .get(0);
    if !exists {
        return Ok(0);
    }
    Ok(client
        .query_one(
            "SELECT coalesce(max(version), 0) FROM lokadb.migrations",
            &[],
        )?
        .get(0))
}

/// `lokadb init --cloud DSN`.
///
/// # Errors
///
/// Connection or migration failure (a failed migration is rolled back whole).
pub fn init(dsn: &str) -> Result<InitReport, AdminError> {
    let mut client = connect(dsn)?;
    client.execute("SELECT pg_advisory_lock($1)", &[&INIT_LOCK])?;
    let from = installed_version(&mut client)?;
    let newest = MIGRATIONS.last().map_or(0, |m| m.0);
    if from > newest {
        return Err(AdminError::failed(format!(
            "the lokadb schema is at version {from}, newer than this lokadb ({newest}): upgrade lokadb"
        )));
    }
    for (version, description, sql) in MIGRATIONS.iter().filter(|m| m.0 > from) {
        let mut tx = client.transaction()?;
        tx.batch_execute(sql).map_err(|e| {
            AdminError::failed(format!(
                "migration {version} ({description}) failed and was rolled back: {}",
                super::db::describe(&e)
            ))
        })?;
        tx.execute(
            "INSERT INTO lokadb.migrations (version, description) VALUES ($1, $2)",
            &[version, description],
        )?;
        tx.commit()?;
    }
    client.execute("SELECT pg_advisory_unlock($1)", &[&INIT_LOCK])?;
    Ok(InitReport { from, to: newest })
}

/// Fails unless `lokadb init` has been run.
///
/// # Errors
///
/// No schema, or an older one.
pub fn require_current(client: &mut postgres::Client) -> Result<(), AdminError> {
    let v = installed_version(client)?;
    let newest = MIGRATIONS.last().map_or(0, |m| m.0);
    match v {
        0 => Err(AdminError::usage(
            "the cloud database has no lokadb schema: run `lokadb init --cloud DSN` first",
        )),
        v if v < newest => Err(AdminError::usage(format!(
            "the lokadb schema is at version {v}, this lokadb needs {newest}: run `lokadb init --cloud DSN` to upgrade"
        ))),
        _ => Ok(()),
    }
}
