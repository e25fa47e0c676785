//! Logical mode: a publication in the cloud of the organization's cloud partitions (they
//! hold only its rows) and a subscription in the organization's database that copies them
//! and then follows the changes, into tables named like those partitions. The switch
//! writes a marker row (published with a row filter on the organization) under its lock;
//! once the marker has arrived, so has every earlier change; then it renames the tables
//! to the LokaDB tables' names.

use super::figures::{Figures, Pace};
use super::layout::tag;
use super::Move;
use crate::admin::db::{describe, ident, literal, AdminError};
use std::time::{Duration, Instant};

/// The catch-up is done when the subscription is this close to the cloud's WAL.
pub const CAUGHT_UP_BYTES: i64 = 1 << 20;
/// Before the switch, markers are sent until one arrives within [`PROBE_GOAL`] (at most
/// [`PROBES`] of them).
pub const PROBE_GOAL: Duration = Duration::from_millis(50);
pub const PROBES: u32 = 100;
/// The switch gives up on the marker after this long.
pub const MARKER_WAIT: Duration = Duration::from_secs(30);
/// The initial copy is given up when it makes no progress for this long
/// (`LOKADB_MOVE_COPY_STALL_S` overrides).
pub const STALL: Duration = Duration::from_secs(300);

fn stall() -> Duration {
    std::env::var("LOKADB_MOVE_COPY_STALL_S")
        .ok()
        .and_then(|v| v.parse().ok())
        .map_or(STALL, Duration::from_secs)
}

/// Checks what logical mode needs before anything is changed.
///
/// # Errors
///
/// wal_level below logical, a Postgres older than 15 on either side, or an organization
/// role that may not create subscriptions (usage).
pub fn preflight(
    cloud: &mut postgres::Client,
    org: &mut postgres::Client,
    tables: &[super::layout::MoveTable],
    opts: &super::MoveOptions,
) -> Result<(), AdminError> {
    let wal: String = cloud
        .query_one("SELECT current_setting('wal_level')", &[])?
        .get(0);
    if wal != "logical" {
        return Err(AdminError::usage(format!(
            "--mode logical needs wal_level = logical in the cloud database (it is {wal}; changing it needs a restart); or use --mode trigger. Nothing was changed"
        )));
    }
    for (side, c) in [("cloud", &mut *cloud), ("organization's", &mut *org)] {
        let v: i32 = c
            .query_one("SELECT current_setting('server_version_num')::int", &[])?
            .get(0);
        if v < 150_000 {
            return Err(AdminError::usage(format!(
                "--mode logical needs PostgreSQL 15 or later (row filters) in both databases; the {side} database runs {}.{}; use --mode trigger. Nothing was changed",
                v / 10_000,
                v % 10_000 / 100
            )));
        }
    }
    // The walsender of a logical slot wakes up with the WAL writer: the marker under the
    // switch's lock waits up to wal_writer_delay.
    let delay: String = cloud
        .query_one("SELECT current_setting('wal_writer_delay')", &[])?
        .get(0);
    if !matches!(delay.as_str(), "1ms" | "5ms" | "10ms" | "20ms" | "50ms") {
        eprintln!(
            "lokadb: note: the cloud's wal_writer_delay is {delay}: logical mode's pause at the switch is about that long; 10ms makes it short (docs/moving.md)"
        );
    }
    subscriber_role(cloud, opts)?;
    // The publication carries UPDATE and DELETE: without a replica identity the
    // application's own updates of the organization's rows would fail.
    if let Some(t) = tables.iter().find(|t| !t.indexes.iter().any(|i| i.primary)) {
        return Err(AdminError::usage(format!(
            "--mode logical publishes updates, which needs a primary key: {} identifies rows by a unique key only; add a primary key or use --mode trigger. Nothing was changed",
            t.display()
        )));
    }
    let may: bool = org
        .query_one(
            "SELECT rolsuper OR (EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'pg_create_subscription')
                                 AND pg_has_role(current_user, 'pg_create_subscription', 'MEMBER'))
             FROM pg_roles WHERE rolname = current_user",
            &[],
        )?
        .get(0);
    if !may {
        return Err(AdminError::usage(
            "--mode logical creates a subscription in the organization's database: its role (the postgres_fdw user mapping's) must be a superuser or a member of pg_create_subscription; or use --mode trigger. Nothing was changed",
        ));
    }
    Ok(())
}

/// The cloud role the subscription logs in as, from `--cloud-from-org`: it is stored in
/// the organization's database (readable by its superusers), so it must be named, exist,
/// have REPLICATION and not be a superuser.
///
/// # Errors
///
/// Usage: any of those is not so.
fn subscriber_role(
    cloud: &mut postgres::Client,
    opts: &super::MoveOptions,
) -> Result<String, AdminError> {
    let Some(conninfo) = &opts.cloud_from_org else {
        return Err(AdminError::usage(
            "--mode logical needs --cloud-from-org (or LOKADB_CLOUD_FROM_ORG): how the organization's database reaches the cloud, as a role with REPLICATION that is not a superuser (the connection string is stored in the organization's database). Nothing was changed",
        ));
    };
    let (config, _) = crate::admin::db::parse(conninfo).map_err(|e| {
        AdminError::usage(format!(
            "--cloud-from-org: {}. Nothing was changed",
            e.message
        ))
    })?;
    let Some(user) = config.get_user().map(str::to_owned) else {
        return Err(AdminError::usage(
            "--cloud-from-org must name its role (user=…): the subscription may not log in as the organization database's default user. Nothing was changed",
        ));
    };
    let role = cloud.query_opt(
        "SELECT rolsuper, rolreplication FROM pg_roles WHERE rolname = $1",
        &[&user],
    )?;
    match role.map(|r| (r.get::<_, bool>(0), r.get::<_, bool>(1))) {
        None => Err(AdminError::usage(format!(
            "--cloud-from-org: the cloud has no role {user}. Nothing was changed"
        ))),
        Some((true, _)) => Err(AdminError::usage(format!(
            "--cloud-from-org: {user} is a superuser of the cloud; its password would be stored in the organization's database. Use a role with REPLICATION only (CREATE ROLE … LOGIN REPLICATION). Nothing was changed"
        ))),
        Some((false, false)) => Err(AdminError::usage(format!(
            "--cloud-from-org: {user} lacks REPLICATION (ALTER ROLE {user} REPLICATION). Nothing was changed"
        ))),
        Some((false, true)) => Ok(user),
    }
}

/// Creates the publication (cloud) and the subscription (organization's database).
///
/// # Errors
///
/// Either failed (the subscription's error names the connection it tried).
pub fn start(m: &mut Move) -> Result<(), AdminError> {
    let name = tag(&m.org.id);
    let org = literal(&m.org.id);
    let exists: bool = m
        .cloud
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = $1)",
            &[&name],
        )?
        .get(0);
    if !exists {
        // The organization's cloud partitions hold only its rows: no row filter (which
        // would also bind the other partitions' updates), no publishing through the root.
        let mut items: Vec<String> = m
            .tables
            .iter()
            .map(|t| format!("TABLE {}", t.cloud_part()))
            .collect();
        items.push(format!("TABLE lokadb.move_marker WHERE (org = {org})"));
        m.cloud.batch_execute(&format!(
            "DELETE FROM lokadb.move_marker WHERE org = {org};
             CREATE PUBLICATION {} FOR {}",
            ident(&name),
            items.join(", ")
        ))?;
    }
    // The subscriber reads the partitions it copies, and the marker.
    let role = ident(&subscriber_role(&mut m.cloud, &m.opts)?);
    let parts: Vec<String> = m.tables.iter().map(|t| t.cloud_part()).collect();
    let schemas: std::collections::BTreeSet<String> =
        m.tables.iter().map(|t| ident(&t.schema)).collect();
    m.cloud.batch_execute(&format!(
        "GRANT USAGE ON SCHEMA lokadb, {} TO {role};
         GRANT SELECT ON lokadb.move_marker, {} TO {role}",
        schemas.into_iter().collect::<Vec<_>>().join(", "),
        parts.join(", ")
    ))?;
    let conninfo = m.opts.cloud_from_org.clone().unwrap_or_default();
    let mut oc = m.org_session()?;
    oc.batch_execute("DELETE FROM lokadb.move_marker")?;
    let sub: bool = oc
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_subscription WHERE subname = $1)",
            &[&name],
        )?
        .get(0);
    if !sub {
        oc.batch_execute(&format!(
            "CREATE SUBSCRIPTION {n} CONNECTION {c} PUBLICATION {n} WITH (slot_name = {s}, copy_data = true)",
            n = ident(&name),
            c = literal(&conninfo),
            s = literal(&name)
        ))
        .map_err(|e| {
            AdminError::failed(format!(
                "creating the subscription in organization {}'s database (it connects to the cloud with --cloud-from-org): {}",
                m.org.id,
                describe(&e)
            ))
        })?;
    }
    Ok(())
}

/// Waits until the subscription's initial copy of every table is done.
///
/// # Errors
///
/// The organization's database failed, or the copy made no progress for {} s.
pub fn wait_copied(m: &mut Move) -> Result<(), AdminError> {
    let name = tag(&m.org.id);
    let mut oc = m.org_session()?;
    staging_names(m, &mut oc)?;
    let started = Instant::now();
    let (mut last_bytes, mut last_change) = (-1i64, Instant::now());
    let (mut told, mut pace) = (Instant::now(), Pace::default());
    // Done when every staging table is one of the subscription's and copied.
    let staging: Vec<String> = m.tables.iter().map(|t| t.org_staging_table()).collect();
    loop {
        let r = oc.query_one(
            "SELECT count(*) FILTER (WHERE sr.srsubstate IS DISTINCT FROM 'r' AND sr.srsubstate IS DISTINCT FROM 's'),
                    count(*),
                    coalesce((SELECT sum(bytes_processed) FROM pg_stat_progress_copy), 0)::bigint,
                    coalesce((SELECT sum(tuples_processed) FROM pg_stat_progress_copy), 0)::bigint
             FROM unnest($2::text[]) n
             LEFT JOIN (pg_subscription_rel sr JOIN pg_subscription s ON s.oid = sr.srsubid AND s.subname = $1)
                    ON sr.srrelid = to_regclass(n)",
            &[&name, &staging],
        )?;
        let (pending, total, bytes, rows): (i64, i64, i64, i64) =
            (r.get(0), r.get(1), r.get(2), r.get(3));
        if pending == 0 {
            m.say(format!(
                "initial copy by the subscription done in {:.1} s ({total} tables)",
                started.elapsed().as_secs_f64()
            ));
            return Ok(());
        }
        if bytes != last_bytes {
            (last_bytes, last_change) = (bytes, Instant::now());
        }
        if pace.due() {
            // The subscription reports only the copies running now: no total, no ETA.
            let seconds = started.elapsed().as_secs_f64();
            m.publish(&Figures {
                phase: format!("copy (subscription, {pending} of {total} tables left)"),
                rows: Some(rows.unsigned_abs()),
                bytes: Some(bytes.unsigned_abs()),
                seconds,
                ..Figures::default()
            });
        }
        if told.elapsed() >= Duration::from_secs(5) {
            told = Instant::now();
            eprintln!(
                "lokadb: copy (subscription): {pending} of {total} tables copying, {rows} rows, {:.1} MB in the current copies, {:.0} s",
                bytes as f64 / 1e6,
                started.elapsed().as_secs_f64()
            );
        }
        if last_change.elapsed() > stall() {
            return Err(AdminError::failed(format!(
                "the subscription's initial copy made no progress for {} s; see organization {}'s Postgres log (a conflict or a connection the cloud refuses?). Rerun to keep waiting, or --abort",
                stall().as_secs(),
                m.org.id
            )));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Waits until the subscription is within [`CAUGHT_UP_BYTES`] of the cloud.
///
/// # Errors
///
/// The slot is missing or a query failed.
pub fn wait_caught_up(m: &mut Move) -> Result<(), AdminError> {
    let name = tag(&m.org.id);
    let mut oc = m.org_session()?;
    staging_names(m, &mut oc)?;
    drop(oc);
    let started = Instant::now();
    let (mut told, mut pace) = (Instant::now(), Pace::default());
    loop {
        let lag: Option<i64> = m
            .cloud
            .query_opt(
                "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)::bigint
                 FROM pg_replication_slots WHERE slot_name = $1",
                &[&name],
            )?
            .and_then(|r| r.get(0));
        let Some(lag) = lag else {
            return Err(AdminError::failed(format!(
                "the replication slot {name} of the move is missing in the cloud; --abort and move again"
            )));
        };
        if lag < CAUGHT_UP_BYTES {
            // The slot's position lags by the subscriber's feedback interval: probe with
            // markers until one arrives fast, so the one under the switch's lock does too.
            let mut oc = m.org_session()?;
            let mut last = Duration::ZERO;
            for _ in 0..PROBES {
                let t0 = Instant::now();
                marker(&mut m.cloud, &mut oc, &m.org.id.clone())?;
                last = t0.elapsed();
                if last <= PROBE_GOAL {
                    break;
                }
            }
            m.say(format!(
                "subscription caught up after {:.1} s (a marker arrives in {:.0} ms)",
                started.elapsed().as_secs_f64(),
                last.as_secs_f64() * 1e3
            ));
            return Ok(());
        }
        if pace.due() {
            m.publish(&Figures {
                phase: "catch-up (subscription)".to_owned(),
                lag_bytes: Some(lag.unsigned_abs()),
                seconds: started.elapsed().as_secs_f64(),
                ..Figures::default()
            });
        }
        if told.elapsed() >= Duration::from_secs(5) {
            told = Instant::now();
            eprintln!(
                "lokadb: catch-up (subscription): {:.1} MB behind",
                lag as f64 / 1e6
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The names the subscription writes to: a switch cut short after its rename in the
/// organization's database (and before the cloud's commit) is undone.
fn staging_names(m: &Move, oc: &mut postgres::Client) -> Result<(), AdminError> {
    for t in &m.tables {
        let r = oc.query_one(
            "SELECT to_regclass($1) IS NOT NULL, to_regclass($2) IS NOT NULL",
            &[&t.org_table(), &t.org_staging_table()],
        )?;
        if r.get::<_, bool>(0) && !r.get::<_, bool>(1) {
            oc.batch_execute(&format!(
                "ALTER TABLE {} RENAME TO {}",
                t.org_table(),
                ident(&t.cloud_part_name())
            ))?;
        }
    }
    Ok(())
}

/// Under the switch's lock, once the marker arrived: the tables get their names; `then`
/// runs in the same round trip.
///
/// # Errors
///
/// The rename failed (nothing was renamed).
pub fn rename(
    tables: &[super::layout::MoveTable],
    oc: &mut postgres::Client,
    then: &str,
) -> Result<(), AdminError> {
    let sql: Vec<String> = tables
        .iter()
        .map(|t| {
            format!(
                "ALTER TABLE {} RENAME TO {}",
                t.org_staging_table(),
                ident(&t.name)
            )
        })
        .collect();
    oc.batch_execute(&format!("BEGIN; {}; COMMIT; {then}", sql.join(";\n")))?;
    Ok(())
}

/// Under the switch's lock: writes the marker in the cloud and waits for it to arrive.
///
/// # Errors
///
/// It did not arrive within [`MARKER_WAIT`].
pub fn marker(
    cloud: &mut postgres::Client,
    org_db: &mut postgres::Client,
    org: &str,
) -> Result<(), AdminError> {
    let token = format!("{:032x}", rand::random::<u128>());
    cloud.execute(
        "INSERT INTO lokadb.move_marker (org, token) VALUES ($1, $2)
         ON CONFLICT (org) DO UPDATE SET token = excluded.token",
        &[&org, &token],
    )?;
    let started = Instant::now();
    loop {
        let seen: bool = org_db
            .query_one(
                "SELECT EXISTS (SELECT 1 FROM lokadb.move_marker WHERE org = $1 AND token = $2)",
                &[&org, &token],
            )?
            .get(0);
        if seen {
            return Ok(());
        }
        if started.elapsed() > MARKER_WAIT {
            return Err(AdminError::failed(format!(
                "the subscription did not deliver the switch's marker within {} s; nothing was switched, run the command again",
                MARKER_WAIT.as_secs()
            )));
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Drops the subscription (its slot in the cloud too) and the publication.
///
/// # Errors
///
/// A step failed (a rerun repeats what is left).
pub fn stop(m: &mut Move) -> Result<(), AdminError> {
    let name = tag(&m.org.id);
    let mut oc = m.org_session()?;
    let subid: Option<u32> = oc
        .query_opt(
            "SELECT oid FROM pg_subscription WHERE subname = $1",
            &[&name],
        )?
        .map(|r| r.get(0));
    if subid.is_none() {
        // A run killed between dropping the subscription and its slot.
        m.cloud.execute(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots
             WHERE slot_name = $1 AND NOT active",
            &[&name],
        )?;
    }
    if let Some(subid) = subid {
        let n = ident(&name);
        oc.batch_execute(&format!("ALTER SUBSCRIPTION {n} DISABLE"))?;
        oc.batch_execute(&format!("ALTER SUBSCRIPTION {n} SET (slot_name = NONE)"))?;
        oc.batch_execute(&format!("DROP SUBSCRIPTION {n}"))?;
        // Its slot, and those of table copies cut short, are the cloud's to drop.
        let started = Instant::now();
        loop {
            let r = m.cloud.query_one(
                "SELECT count(*) FILTER (WHERE active), count(*) FROM pg_replication_slots
                 WHERE slot_name = $1 OR slot_name LIKE $2",
                &[&name, &format!("pg\\_{subid}\\_sync\\_%")],
            )?;
            let (active, all): (i64, i64) = (r.get(0), r.get(1));
            if all == 0 {
                break;
            }
            if active == 0 {
                m.cloud.execute(
                    "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots
                     WHERE slot_name = $1 OR slot_name LIKE $2",
                    &[&name, &format!("pg\\_{subid}\\_sync\\_%")],
                )?;
                break;
            }
            if started.elapsed() > Duration::from_secs(30) {
                return Err(AdminError::failed(format!(
                    "the replication slot {name} stayed in use 30 s after its subscription was dropped; drop it with SELECT pg_drop_replication_slot('{name}') in the cloud"
                )));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    m.cloud.batch_execute(&format!(
        "DROP PUBLICATION IF EXISTS {}; DELETE FROM lokadb.move_marker WHERE org = {}",
        ident(&name),
        literal(&m.org.id)
    ))?;
    oc.batch_execute("DELETE FROM lokadb.move_marker")?;
    Ok(())
}
