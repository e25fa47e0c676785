//! `lokadb move-org`, `move-back`, `fold`, `verify` and `status`: moving an organization's rows
//! between the cloud and its own database while it keeps working. See docs/moving.md.
//!
//! A move is a journal row (`lokadb.moves`) and a sequence of steps, each of which a
//! rerun can repeat: the split out of DEFAULT ([`split`]), preparing the destination,
//! the copy ([`copy`]), the catch-up ([`capture`] or [`logical`]), the switch
//! ([`switch`]) and the verification ([`verify`]). Until the switch commits the
//! organization is served from where it was and `--abort` rolls everything back; the
//! switch is one cloud transaction; after it, a rerun finishes verification and clean-up.
//! A small organization moved back is then folded into DEFAULT ([`fold`]).
//! The command holds a session advisory lock per organization, so a second move of the
//! same organization is refused, and any pause it takes ends with its session.

pub mod capture;
pub mod copy;
pub mod figures;
pub mod fold;
pub mod layout;
pub mod logical;
pub mod schema_diff;
pub mod shapes;
pub mod split;
pub mod split_ahead;
pub mod status;
pub mod switch;
pub mod take_back;
pub mod verify;

use crate::admin::db::{connect, describe, AdminError};
use crate::admin::migrations::require_current;
use layout::{MoveTable, Place};
use std::time::{Duration, Instant};

/// How changes made during the copy reach the destination.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    Trigger,
    Logical,
}

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Trigger => "trigger",
            Mode::Logical => "logical",
        }
    }

    /// Parses `trigger` or `logical`.
    ///
    /// # Errors
    ///
    /// Anything else (usage).
    pub fn parse(s: &str) -> Result<Mode, AdminError> {
        match s {
            "trigger" => Ok(Mode::Trigger),
            "logical" => Ok(Mode::Logical),
            _ => Err(AdminError::usage(format!(
                "--mode must be trigger or logical, got {s:?}"
            ))),
        }
    }
}

/// `lokadb move-org` / `move-back` arguments.
#[derive(Debug, Clone)]
pub struct MoveOptions {
    pub org: String,
    pub mode: Mode,
    /// The profile after the move (default: the organization's).
    pub profile: Option<crate::profile::Profile>,
    /// Copy streams at once (pairs of connections; a large table is copied in parts).
    pub jobs: usize,
    /// About this many bytes of a table's heap per copy part.
    pub part_bytes: u64,
    /// Roll back a move that has not switched.
    pub abort: bool,
    /// Only finish an interrupted move (refused when there is none).
    pub resume: bool,
    /// Connection string of the organization's database as this command reaches it
    /// (default: through the relay, with the credentials of its postgres_fdw mapping).
    pub org_dsn: Option<String>,
    /// Connection string of the cloud database as the organization's database reaches
    /// it (logical mode's subscription; required there).
    pub cloud_from_org: Option<String>,
    /// move-back: fold the organization into DEFAULT afterwards when it has at most this
    /// many rows ([`fold`]); 0 keeps its partitions.
    pub fold_max_rows: u64,
}

/// Which way a move goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    Out,
    Back,
}

impl Direction {
    fn as_str(self) -> &'static str {
        match self {
            Direction::Out => "out",
            Direction::Back => "back",
        }
    }

    fn command(self) -> &'static str {
        match self {
            Direction::Out => "move-org",
            Direction::Back => "move-back",
        }
    }
}

/// The command whose journal row says `direction` (`lokadb.moves.direction`).
pub fn command_of(direction: &str) -> &'static str {
    match direction {
        "out" => Direction::Out.command(),
        "back" => Direction::Back.command(),
        _ => "split",
    }
}

/// The organization as the move reads it.
#[derive(Debug, Clone)]
pub struct Org {
    pub id: String,
    pub state: String,
    pub profile: String,
    pub server: String,
    pub pg_version: String,
}

/// The journal row.
#[derive(Debug, Clone)]
pub struct Journal {
    pub direction: String,
    pub mode: Mode,
    pub profile: String,
    pub from_state: String,
    pub step: String,
    pub copied: Vec<String>,
}

/// Everything a running move works with.
pub struct Move {
    pub dsn: String,
    pub org_dsn: String,
    pub cloud: postgres::Client,
    pub org: Org,
    pub tables: Vec<MoveTable>,
    pub opts: MoveOptions,
    pub journal: Journal,
    pub direction: Direction,
    /// What the run printed (stderr), kept for the tests' and the caller's inspection.
    pub report: Vec<String>,
    /// The switch's pause, seconds.
    pub pause: Option<f64>,
}

/// Exits the process at the named point when `LOKADB_MOVE_FAILPOINT` names it: a crash
/// at that step, for the tests of crash safety (connections drop, the server rolls
/// back what was open, exactly as after `kill -9`); or stalls there while
/// `LOKADB_MOVE_STALL` names it (see [`crate::failpoint::stall_at`]).
pub fn failpoint(name: &str) {
    crate::failpoint::exit_at("LOKADB_MOVE_FAILPOINT", name);
    crate::failpoint::stall_at("LOKADB_MOVE_STALL", name);
}

/// Settings every connection of a move uses, so rows print the same text on both sides
/// (COPY and checksums).
///
/// # Errors
///
/// The statement failed.
pub fn session_settings(c: &mut postgres::Client) -> Result<(), AdminError> {
    c.batch_execute(
        "SET TimeZone = 'UTC'; SET DateStyle = 'ISO, YMD'; SET IntervalStyle = 'postgres';
         SET extra_float_digits = 1; SET bytea_output = 'hex'; SET statement_timeout = 0;
         SET standard_conforming_strings = on;
         SET client_min_messages = warning; SET lokadb.applying = 'on'",
    )?;
    Ok(())
}

/// The session lock that makes one move per organization.
fn move_lock(c: &mut postgres::Client, org: &str) -> Result<(), AdminError> {
    let got: bool = c
        .query_one(
            "SELECT pg_try_advisory_lock(hashtextextended('lokadb.move:' || $1, 0))",
            &[&org],
        )?
        .get(0);
    if !got {
        return Err(AdminError::usage(format!(
            "a move of organization {org} is already running (lokadb status shows it); nothing was changed"
        )));
    }
    Ok(())
}

/// Lets go of [`move_lock`] now, not when the server notices this process has gone: a
/// command run right after this one must not find the move "already running".
fn move_unlock(c: &mut postgres::Client, org: &str) {
    let _ = c.execute(
        "SELECT pg_advisory_unlock(hashtextextended('lokadb.move:' || $1, 0))",
        &[&org],
    );
}

fn read_org(c: &mut postgres::Client, id: &str) -> Result<Org, AdminError> {
    let row = c.query_opt(
        "SELECT state, profile, coalesce(server::text, ''), coalesce(pg_version, '')
         FROM lokadb.org WHERE id = $1",
        &[&id],
    )?;
    let Some(r) = row else {
        return Err(AdminError::usage(format!(
            "organization {id} is not registered (lokadb org add registers its database; lokadb org list shows those that are)"
        )));
    };
    Ok(Org {
        id: id.to_owned(),
        state: r.get(0),
        profile: r.get(1),
        server: r.get(2),
        pg_version: r.get(3),
    })
}

fn read_journal(c: &mut postgres::Client, org: &str) -> Result<Option<Journal>, AdminError> {
    let row = c.query_opt(
        "SELECT direction, mode, profile, from_state, step, copied::text[] FROM lokadb.moves WHERE org = $1",
        &[&org],
    )?;
    row.map(|r| {
        Ok(Journal {
            direction: r.get(0),
            mode: Mode::parse(r.get(1))?,
            profile: r.get(2),
            from_state: r.get(3),
            step: r.get(4),
            copied: r.get(5),
        })
    })
    .transpose()
}

/// The organization's database as this command reaches it: through the relay, as the
/// role of its postgres_fdw user mapping.
fn org_dsn(c: &mut postgres::Client, org: &Org) -> Result<String, AdminError> {
    let r = c.query_opt(
        "SELECT o.relay_host, o.relay_port, o.dbname,
                (SELECT split_part(opt, '=', 2) FROM unnest(um.umoptions) opt WHERE opt LIKE 'user=%'),
                (SELECT substr(opt, 10) FROM unnest(um.umoptions) opt WHERE opt LIKE 'password=%'),
                (SELECT array_agg(opt) FROM pg_foreign_server s, unnest(s.srvoptions) opt
                 WHERE s.srvname = o.server AND (opt LIKE 'sslmode=%' OR opt LIKE 'sslrootcert=%'))
         FROM lokadb.org o
         LEFT JOIN pg_user_mappings um ON um.srvname = o.server AND um.usename = 'public'
         WHERE o.id = $1",
        &[&org.id],
    )?;
    let Some(r) = r else {
        return Err(AdminError::failed("the organization disappeared"));
    };
    let (host, port, db): (Option<String>, Option<i32>, Option<String>) =
        (r.get(0), r.get(1), r.get(2));
    let (user, password): (Option<String>, Option<String>) = (r.get(3), r.get(4));
    let (Some(host), Some(port), Some(db), Some(user)) = (host, port, db, user) else {
        return Err(AdminError::usage(format!(
            "organization {}'s database is not fully registered (relay, database or user mapping missing); pass --org-dsn or re-add it",
            org.id
        )));
    };
    let q = |v: &str| format!("'{}'", v.replace('\\', "\\\\").replace('\'', "\\'"));
    let mut dsn = format!(
        "host={} port={port} dbname={} user={}",
        q(&host),
        q(&format!("{}/{db}", org.id)),
        q(&user)
    );
    if let Some(p) = password {
        dsn.push_str(&format!(" password={}", q(&p)));
    }
    // The relay as postgres_fdw reaches it: the same TLS.
    if let Some(tls) = r.get::<_, Option<Vec<String>>>(5) {
        for opt in &tls {
            if let Some((k, v)) = opt.split_once('=') {
                dsn.push_str(&format!(" {k}={}", q(v)));
            }
        }
    }
    Ok(dsn)
}

/// Connects to the organization's database, naming the path on failure.
///
/// # Errors
///
/// The database does not answer (agent down, relay unreachable, wrong credentials).
pub fn connect_org(dsn: &str, org: &str) -> Result<postgres::Client, AdminError> {
    let mut c = connect(dsn).map_err(|e| {
        AdminError::failed(format!(
            "organization {org}'s database does not answer (is its agent connected? lokadb status, SHOW TUNNELS on the relay): {}",
            e.message
        ))
    })?;
    session_settings(&mut c)?;
    Ok(c)
}

/// The version of the `lokadb` schema in an organization's database.
pub const ORG_SCHEMA_VERSION: i32 = 1;

/// Creates (or checks) the `lokadb` schema in the organization's database: it must be
/// this organization's and of this version.
fn org_schema(c: &mut postgres::Client, org: &str) -> Result<(), AdminError> {
    let exists: bool = c
        .query_one("SELECT to_regclass('lokadb.info') IS NOT NULL", &[])?
        .get(0);
    if exists {
        let r = c.query_opt("SELECT org, version FROM lokadb.info", &[])?;
        if let Some(r) = r {
            let (o, v): (String, i32) = (r.get(0), r.get(1));
            if o != org {
                return Err(AdminError::usage(format!(
                    "the database registered for organization {org} belongs to organization {o} (its lokadb.info says so); nothing was changed"
                )));
            }
            if v != ORG_SCHEMA_VERSION {
                return Err(AdminError::usage(format!(
                    "organization {org}'s database has LokaDB schema version {v}; this lokadb writes version {ORG_SCHEMA_VERSION}. Upgrade lokadb (or the database) first; nothing was changed"
                )));
            }
            return Ok(());
        }
    }
    c.batch_execute(include_str!("../sql/org_schema.sql"))?;
    c.execute(
        "INSERT INTO lokadb.info (org, version) VALUES ($1, $2) ON CONFLICT DO NOTHING",
        &[&org, &ORG_SCHEMA_VERSION],
    )?;
    Ok(())
}

impl Move {
    pub(crate) fn set_step(&mut self, step: &str) -> Result<(), AdminError> {
        self.cloud.execute(
            "UPDATE lokadb.moves SET step = $2, figures = NULL, updated_at = now() WHERE org = $1",
            &[&self.org.id, &step],
        )?;
        self.journal.step = step.to_owned();
        Ok(())
    }

    fn progress(&mut self, line: &str) {
        let _ = self.cloud.execute(
            "UPDATE lokadb.moves SET progress = $2, updated_at = now() WHERE org = $1",
            &[&self.org.id, &line],
        );
    }

    /// Publishes the move's figures for `lokadb status` (and its line as the progress);
    /// for onlookers only, so a failed write is not the move's failure.
    fn publish(&mut self, f: &figures::Figures) {
        let _ = publish(&mut self.cloud, &self.org.id, f);
    }

    fn say(&mut self, line: String) {
        eprintln!("lokadb: {line}");
        self.report.push(line);
    }

    /// Connects another session to the cloud.
    fn cloud_session(&self) -> Result<postgres::Client, AdminError> {
        let mut c = connect(&self.dsn)?;
        session_settings(&mut c)?;
        Ok(c)
    }

    fn org_session(&self) -> Result<postgres::Client, AdminError> {
        connect_org(&self.org_dsn, &self.org.id)
    }
}

/// `lokadb move-org ORG` (and `--abort`): returns the report.
///
/// # Errors
///
/// Bad input (usage: nothing changed) or a failure (what was done is in the journal; a
/// rerun resumes, `--abort` rolls back).
pub fn move_org(dsn: &str, opts: &MoveOptions) -> Result<String, AdminError> {
    run(dsn, opts, Direction::Out)
}

/// `lokadb move-back ORG` (and `--abort`).
///
/// # Errors
///
/// As [`move_org`].
pub fn move_back(dsn: &str, opts: &MoveOptions) -> Result<String, AdminError> {
    run(dsn, opts, Direction::Back)
}

fn run(dsn: &str, opts: &MoveOptions, direction: Direction) -> Result<String, AdminError> {
    crate::admin::org::check_id(&opts.org)?;
    if opts.jobs == 0 || opts.jobs > 64 {
        return Err(AdminError::usage("--jobs must be between 1 and 64"));
    }
    if opts.part_bytes < 8 << 10 {
        return Err(AdminError::usage(
            "--part-size must be at least 8kB (one block of a table's heap)",
        ));
    }
    under_move_lock(dsn, &opts.org, |slot, org| {
        run_locked(slot, dsn, org, opts, direction)
    })
}

/// Connects to the cloud as a move does, reads the organization and runs `f` under its move
/// lock (one move, split or fold of an organization at a time), which is let go afterwards.
/// `f` gets the cloud session in a slot it may take it from, and hand it back to for the
/// unlock.
fn under_move_lock<T>(
    dsn: &str,
    org_id: &str,
    f: impl FnOnce(&mut Option<postgres::Client>, Org) -> Result<T, AdminError>,
) -> Result<T, AdminError> {
    let mut cloud = connect(dsn)?;
    require_current(&mut cloud)?;
    session_settings(&mut cloud)?;
    let org = read_org(&mut cloud, org_id)?;
    move_lock(&mut cloud, &org.id)?;
    let id = org.id.clone();
    let mut slot = Some(cloud);
    let result = f(&mut slot, org);
    if let Some(c) = slot.as_mut() {
        move_unlock(c, &id);
    }
    result
}

/// The refusal of a command while another's journal row `j` is there.
fn in_progress(org: &str, j: &Journal) -> AdminError {
    let cmd = command_of(&j.direction);
    AdminError::usage(format!(
        "a {cmd} of organization {org} is in progress (step {}): finish it (lokadb {cmd} {org}) or roll it back (lokadb {cmd} {org} --abort) first; nothing was changed",
        j.step
    ))
}

/// The move, under its lock; hands the cloud session back in `slot` for the unlock.
fn run_locked(
    slot: &mut Option<postgres::Client>,
    dsn: &str,
    org: Org,
    opts: &MoveOptions,
    direction: Direction,
) -> Result<String, AdminError> {
    let cloud = slot.as_mut().expect("the cloud session is in the slot");
    let journal = read_journal(cloud, &org.id)?;
    let started = Instant::now();
    let (journal, resumed) = match journal {
        Some(j) => {
            if j.direction != direction.as_str() {
                return Err(in_progress(&org.id, &j));
            }
            if !opts.abort && opts.mode != j.mode && opts.mode != Mode::Trigger {
                return Err(AdminError::usage(format!(
                    "the interrupted move of {} runs in {} mode; rerun it without --mode {}",
                    org.id,
                    j.mode.as_str(),
                    opts.mode.as_str()
                )));
            }
            (j, true)
        }
        None => {
            if opts.abort || opts.resume {
                return Err(AdminError::usage(format!(
                    "no {} of organization {} is in progress; nothing to {}",
                    direction.command(),
                    org.id,
                    if opts.abort { "abort" } else { "resume" }
                )));
            }
            (start(cloud, &org, opts, direction)?, false)
        }
    };
    let org_dsn = match &opts.org_dsn {
        Some(d) => d.clone(),
        None => org_dsn(cloud, &org)?,
    };
    let tables = layout::tables(cloud, &org.id)?;
    let mut m = Move {
        dsn: dsn.to_owned(),
        org_dsn,
        cloud: slot.take().expect("the cloud session is in the slot"),
        org,
        tables,
        opts: opts.clone(),
        journal,
        direction,
        report: Vec::new(),
        pause: None,
    };
    let result = (|| {
        if opts.abort {
            abort(&mut m)?;
            return Ok(format!(
                "{} of {} rolled back",
                direction.command(),
                m.org.id
            ));
        }
        if resumed {
            let (step, mode) = (m.journal.step.clone(), m.journal.mode);
            m.say(format!(
                "resuming the {} of {} ({} mode) at step {step}",
                direction.command(),
                m.org.id,
                mode.as_str()
            ));
        }
        match direction {
            Direction::Out => out(&mut m)?,
            Direction::Back => {
                back(&mut m)?;
                fold_after_back(&mut m);
            }
        }
        let secs = started.elapsed().as_secs_f64();
        Ok(format!(
            "{} of {} done in {secs:.1} s{}; verified",
            direction.command(),
            m.org.id,
            m.pause
                .map(|p| format!(", writes paused {:.0} ms at the switch", p * 1e3))
                .unwrap_or_default()
        ))
    })();
    *slot = Some(m.cloud);
    result
}

/// Checks a new move and writes its journal row (and the organization's state).
fn start(
    cloud: &mut postgres::Client,
    org: &Org,
    opts: &MoveOptions,
    direction: Direction,
) -> Result<Journal, AdminError> {
    let (want, next) = match direction {
        Direction::Out => ("cloud", "moving"),
        Direction::Back => ("moved", "returning"),
    };
    if org.state != want {
        let why = match (direction, org.state.as_str()) {
            (Direction::Out, "moved") => format!(
                "organization {} is already moved (lokadb move-back {} returns it)",
                org.id, org.id
            ),
            (Direction::Back, "cloud") => format!(
                "organization {} is in the cloud: there is nothing to move back",
                org.id
            ),
            (_, s) => format!(
                "organization {} is {s}; a {} needs it {want}",
                org.id,
                direction.command()
            ),
        };
        return Err(AdminError::usage(format!("{why}; nothing was changed")));
    }
    // Its database's tables lack migrations the cloud's have: moving its rows would copy
    // between different shapes.
    let owed: i64 = cloud
        .query_one(
            "SELECT count(*) FROM lokadb.ddl_owed WHERE org = $1",
            &[&org.id],
        )?
        .get(0);
    if owed > 0 {
        return Err(AdminError::usage(format!(
            "organization {} owes {owed} migration{} (it could not be reached when they ran): run lokadb org sync {} first; nothing was changed",
            org.id,
            if owed == 1 { "" } else { "s" },
            org.id
        )));
    }
    if direction == Direction::Back && opts.mode == Mode::Logical {
        return Err(AdminError::usage(
            "move-back runs in trigger mode (logical mode would need a publication in the organization's database); drop --mode logical",
        ));
    }
    let tables = layout::tables(cloud, &org.id)?;
    let dsn_org = match &opts.org_dsn {
        Some(d) => d.clone(),
        None => org_dsn(cloud, org)?,
    };
    let mut oc = connect_org(&dsn_org, &org.id)?;
    match direction {
        Direction::Out => {
            for t in &tables {
                let exists: bool = oc
                    .query_one("SELECT to_regclass($1) IS NOT NULL", &[&t.org_table()])?
                    .get(0);
                if exists {
                    return Err(AdminError::usage(format!(
                        "organization {}'s database already has a table {}: move-org creates it; drop or rename it there first. Nothing was changed",
                        org.id,
                        t.display()
                    )));
                }
            }
            split::preflight(cloud, &tables)?;
            if opts.mode == Mode::Logical {
                logical::preflight(cloud, &mut oc, &tables, opts)?;
            }
        }
        Direction::Back => {
            for t in &tables {
                if layout::place(cloud, t)? != Place::Foreign {
                    return Err(AdminError::failed(format!(
                        "{}: organization {}'s partition is not its foreign table; lokadb verify {} shows where its rows are",
                        t.display(),
                        org.id,
                        org.id
                    )));
                }
            }
        }
    }
    org_schema(&mut oc, &org.id)?;
    let split_needed = direction == Direction::Out && split::in_default(cloud, &tables)?;
    let step = if split_needed { "split" } else { "prepare" };
    let profile = opts
        .profile
        .map_or_else(|| org.profile.clone(), |p| p.as_str().to_owned());
    let mut tx = cloud.transaction()?;
    tx.execute(
        "INSERT INTO lokadb.moves (org, direction, mode, profile, from_state, step)
         VALUES ($1, $2, $3, $4, $5, $6)",
        &[
            &org.id,
            &direction.as_str(),
            &opts.mode.as_str(),
            &profile,
            &org.state,
            &step,
        ],
    )?;
    tx.execute(
        "UPDATE lokadb.org SET state = $2 WHERE id = $1",
        &[&org.id, &next],
    )?;
    tx.commit()?;
    Ok(Journal {
        direction: direction.as_str().to_owned(),
        mode: opts.mode,
        profile,
        from_state: org.state.clone(),
        step: step.to_owned(),
        copied: Vec::new(),
    })
}

/// Times a run copies again because a migration changed the tables during its copy,
/// before it gives up (the journal then says `prepare`: a rerun starts from there).
const SCHEMA_RESTARTS: u32 = 3;

/// What a pass through the steps ended with.
enum Pass {
    Done,
    /// A migration changed the tables since the destination was made: make it again.
    SchemaChanged(shapes::SchemaChanged),
}

/// move-org from wherever the journal stands.
fn out(m: &mut Move) -> Result<(), AdminError> {
    with_restarts(m, out_pass)
}

/// move-back from wherever the journal stands.
fn back(m: &mut Move) -> Result<(), AdminError> {
    with_restarts(m, back_pass)
}

/// Runs `pass` until it is done; after a migration changed the tables during the copy,
/// starts again at step `prepare` (the destination made with the new shape, copied again).
fn with_restarts(
    m: &mut Move,
    pass: fn(&mut Move) -> Result<Pass, AdminError>,
) -> Result<(), AdminError> {
    for restart in 0..=SCHEMA_RESTARTS {
        let changed = match pass(m)? {
            Pass::Done => return Ok(()),
            Pass::SchemaChanged(c) => c,
        };
        m.cloud.execute(
            "UPDATE lokadb.moves SET step = 'prepare', copied = '{}', updated_at = now() WHERE org = $1",
            &[&m.org.id],
        )?;
        m.journal.step = "prepare".to_owned();
        m.journal.copied.clear();
        if restart == SCHEMA_RESTARTS {
            return Err(AdminError::failed(format!(
                "{changed}, {} times in this run: nothing was switched. Run lokadb {} {} again once the migrations are done",
                SCHEMA_RESTARTS + 1,
                m.direction.command(),
                m.org.id
            )));
        }
        m.say(format!(
            "{changed}: making organization {}'s destination again with the new shape and copying again; nothing was switched",
            m.org.id
        ));
    }
    unreachable!("the last restart returns")
}

/// Before a step that relies on the destination having the shape the tables had when it
/// was made (a rerun reads the tables as they are now).
fn check_shapes(m: &mut Move) -> Result<Option<shapes::SchemaChanged>, AdminError> {
    let org = m.org.id.clone();
    shapes::changed(&mut m.cloud, &org)
}

fn out_pass(m: &mut Move) -> Result<Pass, AdminError> {
    if m.journal.step == "split" {
        split::run(m)?;
        m.set_step("prepare")?;
        failpoint("after-split");
    }
    if m.journal.step == "prepare" {
        prepare_out(m)?;
        m.set_step("copy")?;
        failpoint("after-prepare");
    }
    let logical = m.journal.mode == Mode::Logical;
    if m.journal.step == "copy" {
        if let Some(c) = check_shapes(m)? {
            return Ok(Pass::SchemaChanged(c));
        }
        if logical {
            logical::wait_copied(m)?;
        } else {
            copy_out(m)?;
        }
        m.set_step("catchup")?;
    }
    if m.journal.step == "catchup" {
        if let Some(c) = check_shapes(m)? {
            return Ok(Pass::SchemaChanged(c));
        }
        if logical {
            logical::wait_caught_up(m)?;
        } else {
            catch_up(m, Direction::Out)?;
        }
        failpoint("catchup");
        let snap = match switch::switch(m)? {
            switch::Switched::Yes(snap) => *snap,
            switch::Switched::SchemaChanged(c) => return Ok(Pass::SchemaChanged(c)),
        };
        failpoint("after-switch");
        switch::finish_with(m, Some(snap))?;
    } else if m.journal.step == "verify" {
        switch::finish(m)?;
    } else if m.journal.step == "cleanup" {
        switch::cleanup(m)?;
    }
    Ok(Pass::Done)
}

fn back_pass(m: &mut Move) -> Result<Pass, AdminError> {
    if m.journal.step == "prepare" {
        prepare_back(m)?;
        m.set_step("copy")?;
        failpoint("after-prepare");
    }
    if m.journal.step == "copy" {
        if let Some(c) = check_shapes(m)? {
            return Ok(Pass::SchemaChanged(c));
        }
        copy_back(m)?;
        m.set_step("catchup")?;
    }
    if m.journal.step == "catchup" {
        if let Some(c) = check_shapes(m)? {
            return Ok(Pass::SchemaChanged(c));
        }
        catch_up(m, Direction::Back)?;
        failpoint("catchup");
        let snap = match switch::switch(m)? {
            switch::Switched::Yes(snap) => *snap,
            switch::Switched::SchemaChanged(c) => return Ok(Pass::SchemaChanged(c)),
        };
        failpoint("after-switch");
        switch::finish_with(m, Some(snap))?;
    } else if m.journal.step == "verify" {
        switch::finish(m)?;
    } else if m.journal.step == "cleanup" {
        switch::cleanup(m)?;
    }
    Ok(Pass::Done)
}

/// Records the tables' shapes, then reads the tables again: the destination is made from
/// what they are now, and the switch knows what that was.
fn shapes_then_tables(m: &mut Move) -> Result<(), AdminError> {
    let org = m.org.id.clone();
    shapes::record(&mut m.cloud, &org)?;
    m.tables = layout::tables(&mut m.cloud, &org)?;
    Ok(())
}

/// After a move back: folds a small organization into DEFAULT ([`fold`]). The move is done
/// whatever happens here; a fold that fails or is too big is said, for `lokadb fold` later.
fn fold_after_back(m: &mut Move) {
    let max = m.opts.fold_max_rows;
    if max == 0 {
        return;
    }
    let id = m.org.id.clone();
    let later = format!("lokadb fold {id} folds them into DEFAULT later");
    let tables = m.tables.clone();
    let result = (|| -> Result<Option<String>, AdminError> {
        let own = fold::own_partitions(&mut m.cloud, &id, &tables)?;
        if own.is_empty() {
            return Ok(None);
        }
        let rows = fold::rows_up_to(&mut m.cloud, &own, max)?;
        if rows > max {
            return Ok(Some(format!(
                "kept {id}'s partitions: more than {max} rows (--fold-max-rows); {later}, locking its tables for the copy"
            )));
        }
        let f = fold::fold(&mut m.cloud, &id, &own)?;
        let mut line = fold::summary(&id, &f);
        if let Err(e) = fold::analyze_defaults(&mut m.cloud, &own) {
            line.push_str(&format!(
                "; ANALYZE of DEFAULT failed ({e}): autovacuum will do it later"
            ));
        }
        Ok(Some(line))
    })();
    match result {
        Ok(Some(line)) => m.say(line),
        Ok(None) => {}
        Err(e) => m.say(format!("kept {id}'s partitions: {e}; {later}")),
    }
}

/// The organization's tables in its database (created again: nothing was copied yet),
/// the foreign tables in the cloud, and the change capture on the cloud partitions.
fn prepare_out(m: &mut Move) -> Result<(), AdminError> {
    shapes_then_tables(m)?;
    let logical = m.journal.mode == Mode::Logical;
    if logical {
        // A run killed after creating the subscription: it would not copy into the tables
        // recreated below; start it again from nothing.
        logical::stop(m)?;
    }
    let mut oc = m.org_session()?;
    let mut tx = oc.transaction()?;
    for t in &m.tables {
        let table = if logical {
            t.org_staging_table()
        } else {
            t.org_table()
        };
        tx.batch_execute(&format!(
            "DROP TABLE IF EXISTS {}; DROP TABLE IF EXISTS {}",
            t.org_table(),
            t.org_staging_table()
        ))?;
        // The destination's capture records what the organization writes after the
        // switch, so a verification cut short can be redone (this command's own writes
        // are not recorded).
        let mut ddl = t.org_ddl(&table);
        ddl.extend(capture::install_sql(
            t,
            &table,
            capture::Capture::Destination,
        ));
        for s in ddl {
            tx.batch_execute(&s).map_err(|e| {
                AdminError::failed(format!(
                    "creating {} in organization {}'s database: {}\nstatement: {s}",
                    t.display(),
                    m.org.id,
                    describe(&e)
                ))
            })?;
        }
    }
    tx.commit()?;
    let server = m.org.server.clone();
    let tables = m.tables.clone();
    let mut tx = m.cloud.transaction()?;
    for t in &tables {
        tx.batch_execute(&format!(
            "DROP FOREIGN TABLE IF EXISTS {}",
            t.foreign_part()
        ))?;
        for s in t.foreign_ddl(&server) {
            tx.batch_execute(&s)?;
        }
    }
    tx.commit()?;
    match m.journal.mode {
        Mode::Trigger => {
            for t in &tables {
                let part = t.cloud_part();
                if capture::installed(&mut m.cloud, t, &part)? {
                    continue;
                }
                let sql = capture::install_sql(t, &part, capture::Capture::Source);
                crate::admin::fkeys::with_lock_retry(
                    &mut m.cloud,
                    &format!("starting change capture on {}", t.display()),
                    |tx| crate::admin::fkeys::run_all(tx, &sql),
                )?;
            }
        }
        Mode::Logical => logical::start(m)?,
    }
    let n = tables.len();
    m.say(format!(
        "prepared {n} tables in organization {}'s database",
        m.org.id
    ));
    Ok(())
}

fn copy_out(m: &mut Move) -> Result<(), AdminError> {
    let mut jobs = Vec::new();
    for t in &m.tables {
        if m.journal.copied.contains(&t.display()) {
            continue;
        }
        let estimate: i64 = m
            .cloud
            .query_one(
                "SELECT coalesce(pg_table_size(to_regclass($1)), 0)",
                &[&t.cloud_part()],
            )?
            .get(0);
        jobs.push(copy::Job {
            source: t.cloud_part(),
            dest: t.org_table(),
            estimate: estimate.unsigned_abs(),
            table: t.clone(),
        });
    }
    run_copy(m, &m.dsn.clone(), &m.org_dsn.clone(), jobs)
}

fn run_copy(m: &mut Move, src: &str, dst: &str, jobs: Vec<copy::Job>) -> Result<(), AdminError> {
    let mut journal = m.cloud_session()?;
    let org = m.org.id.clone();
    let mut lines = Vec::new();
    let split = copy::Split {
        streams: m.opts.jobs,
        part_bytes: m.opts.part_bytes,
    };
    copy::run(src, dst, jobs, split, |r| {
        let (d, figures) = match r {
            copy::Report::Tick(f) => return publish(&mut journal, &org, &f),
            copy::Report::Done(d, f) => (d, f),
        };
        journal.execute(
            "UPDATE lokadb.moves SET copied = array_append(copied, $2), progress = $3, figures = ($4::text)::jsonb, updated_at = now() WHERE org = $1",
            &[&org, &d.table, &figures.line(), &figures.to_json()],
        )?;
        let parts = if d.parts > 1 {
            format!(" ({} parts)", d.parts)
        } else {
            String::new()
        };
        lines.push(format!(
            "copied {}: {} rows, {:.1} MB in {:.1} s{parts}",
            d.table,
            d.rows,
            d.bytes as f64 / 1e6,
            d.seconds
        ));
        failpoint("after-copy-table");
        Ok(())
    })?;
    m.report.extend(lines);
    Ok(())
}

/// Writes a move's figures and their line into its journal row.
fn publish(c: &mut postgres::Client, org: &str, f: &figures::Figures) -> Result<(), AdminError> {
    c.execute(
        "UPDATE lokadb.moves SET progress = $2, figures = ($3::text)::jsonb, updated_at = now() WHERE org = $1",
        &[&org, &f.line(), &f.to_json()],
    )?;
    Ok(())
}

/// Catch-up rounds until the backlog is small enough to finish under the switch's lock.
fn catch_up(m: &mut Move, direction: Direction) -> Result<(), AdminError> {
    let (mut src, mut dst) = match direction {
        Direction::Out => (m.cloud_session()?, m.org_session()?),
        Direction::Back => (m.org_session()?, m.cloud_session()?),
    };
    let tables = m.tables.clone();
    let mut cu = capture::CatchUp::new();
    let mut lag = capture::LagReport::new(Duration::from_secs(5));
    let started = Instant::now();
    let mut applied = 0u64;
    let mut pace = figures::Pace::default();
    loop {
        let t0 = Instant::now();
        let r = cu.round(
            &tables,
            &mut src,
            &|t| source_rel(t, direction),
            &mut dst,
            &|t| dest_rel(t, direction),
        )?;
        applied += r.records;
        let waiting = r.backlog.saturating_sub(r.records);
        let line = format!(
            "catch-up: {applied} records applied, {waiting} waiting, last round {} records in {} ms",
            r.records,
            t0.elapsed().as_millis()
        );
        lag.maybe(|| line.clone());
        let done = waiting < switch::SWITCH_BACKLOG;
        if pace.due() || done {
            m.publish(&figures::Figures::catch_up(
                "catch-up",
                applied,
                waiting,
                started.elapsed().as_secs_f64(),
            ));
        }
        if done {
            m.say(format!(
                "catch-up done: {applied} records in {:.1} s",
                started.elapsed().as_secs_f64()
            ));
            return Ok(());
        }
        failpoint("in-catchup");
    }
}

/// The relation the organization's rows are read from, before the switch.
pub fn source_rel(t: &MoveTable, direction: Direction) -> (String, bool) {
    match direction {
        Direction::Out => (t.cloud_part(), false),
        Direction::Back => (t.org_table(), false),
    }
}

/// The relation they are written to.
pub fn dest_rel(t: &MoveTable, direction: Direction) -> String {
    match direction {
        Direction::Out => t.org_table(),
        Direction::Back => t.cloud_part(),
    }
}

/// move-back: the cloud partitions (standalone until the switch), change capture in the
/// organization's database.
fn prepare_back(m: &mut Move) -> Result<(), AdminError> {
    shapes_then_tables(m)?;
    let tables = m.tables.clone();
    let mut tx = m.cloud.transaction()?;
    for t in &tables {
        tx.batch_execute(&format!("DROP TABLE IF EXISTS {}", t.cloud_part()))?;
        let mut ddl = t.cloud_part_ddl();
        // As for move-org: what is written after the switch, for a verification redone.
        ddl.extend(capture::install_sql(
            t,
            &t.cloud_part(),
            capture::Capture::Destination,
        ));
        for s in ddl {
            tx.batch_execute(&s)?;
        }
    }
    tx.commit()?;
    let mut oc = m.org_session()?;
    org_schema(&mut oc, &m.org.id)?;
    for t in &tables {
        let table = t.org_table();
        if capture::installed(&mut oc, t, &table)? {
            continue;
        }
        let mut tx = oc.transaction()?;
        for s in capture::install_sql(t, &table, capture::Capture::Source) {
            tx.batch_execute(&s)?;
        }
        tx.commit()?;
    }
    m.say(format!(
        "prepared {} cloud partitions for organization {}",
        tables.len(),
        m.org.id
    ));
    Ok(())
}

fn copy_back(m: &mut Move) -> Result<(), AdminError> {
    let mut oc = m.org_session()?;
    let mut jobs = Vec::new();
    for t in &m.tables {
        if m.journal.copied.contains(&t.display()) {
            continue;
        }
        let estimate: i64 = oc
            .query_one(
                "SELECT coalesce(pg_table_size(to_regclass($1)), 0)",
                &[&t.org_table()],
            )?
            .get(0);
        jobs.push(copy::Job {
            source: t.org_table(),
            dest: t.cloud_part(),
            estimate: estimate.unsigned_abs(),
            table: t.clone(),
        });
    }
    run_copy(m, &m.org_dsn.clone(), &m.dsn.clone(), jobs)
}

/// `--abort`: rolls back a move that has not switched.
fn abort(m: &mut Move) -> Result<(), AdminError> {
    if matches!(m.journal.step.as_str(), "verify" | "cleanup") {
        let id = m.org.id.clone();
        return Err(AdminError::usage(format!(
            "the {} of {id} has already switched; it cannot be aborted. Run lokadb {} {id} to finish it{}",
            m.direction.command(),
            m.direction.command(),
            if m.direction == Direction::Out {
                format!(" (then lokadb move-back {id} returns it)")
            } else {
                String::new()
            }
        )));
    }
    let tables = m.tables.clone();
    if m.journal.mode == Mode::Logical {
        logical::stop(m)?;
    }
    // What lives in the organization's database (it may be unreachable: then say so and
    // stop before changing the cloud, so a later --abort can finish).
    let mut oc = m.org_session()?;
    match m.direction {
        Direction::Out => {
            for t in &tables {
                let table = t.org_table();
                let mut sql = capture::remove_sql(t, &table);
                sql.push(format!("DROP TABLE IF EXISTS {table}"));
                sql.extend(capture::remove_sql(t, &t.org_staging_table()));
                sql.push(format!("DROP TABLE IF EXISTS {}", t.org_staging_table()));
                let mut tx = oc.transaction()?;
                for s in sql {
                    tx.batch_execute(&s)?;
                }
                tx.commit()?;
            }
        }
        Direction::Back => {
            for t in &tables {
                let table = t.org_table();
                let mut tx = oc.transaction()?;
                for s in capture::remove_sql(t, &table) {
                    tx.batch_execute(&s)?;
                }
                tx.commit()?;
            }
        }
    }
    for t in &tables {
        let place = layout::place(&mut m.cloud, t)?;
        let mut sql = Vec::new();
        match m.direction {
            Direction::Out => {
                if place == Place::Default {
                    sql.extend(split::undo(&mut m.cloud, t)?);
                } else {
                    sql.extend(capture::remove_sql(t, &t.cloud_part()));
                }
                sql.push(format!("DROP FOREIGN TABLE IF EXISTS {}", t.foreign_part()));
            }
            Direction::Back => {
                sql.extend(capture::remove_sql(t, &t.cloud_part()));
                sql.push(format!("DROP TABLE IF EXISTS {}", t.cloud_part()));
            }
        }
        crate::admin::fkeys::with_lock_retry(
            &mut m.cloud,
            &format!("rolling back {}", t.display()),
            |tx| crate::admin::fkeys::run_all(tx, &sql),
        )?;
    }
    let mut tx = m.cloud.transaction()?;
    tx.execute(
        "UPDATE lokadb.org SET state = $2 WHERE id = $1",
        &[&m.org.id, &m.journal.from_state],
    )?;
    tx.execute("DELETE FROM lokadb.moves WHERE org = $1", &[&m.org.id])?;
    tx.commit()?;
    let (cmd, id, st) = (
        m.direction.command(),
        m.org.id.clone(),
        m.journal.from_state.clone(),
    );
    m.say(format!(
        "{cmd} of {id} rolled back: its rows stay where they were, state {st}"
    ));
    Ok(())
}

/// `lokadb verify` without an organization: [`verify_org`] for every moved organization.
///
/// # Errors
///
/// A failed query, or a failed check of any of them (the text says each one's result).
pub fn verify_moved(dsn: &str) -> Result<String, AdminError> {
    let mut cloud = connect(dsn)?;
    require_current(&mut cloud)?;
    let orgs: Vec<String> = cloud
        .query(
            "SELECT id FROM lokadb.org WHERE state = 'moved' ORDER BY id",
            &[],
        )?
        .iter()
        .map(|r| r.get(0))
        .collect();
    drop(cloud);
    if orgs.is_empty() {
        return Ok("no organization is moved: nothing to verify\n".to_owned());
    }
    let mut text = String::new();
    let mut ok = true;
    for org in &orgs {
        match verify_org(dsn, org, None) {
            Ok(t) => text.push_str(&t),
            Err(e) if !e.usage => {
                ok = false;
                text.push_str(&e.message);
                if !e.message.ends_with('\n') {
                    text.push('\n');
                }
            }
            Err(e) => return Err(e),
        }
    }
    if ok {
        Ok(text)
    } else {
        Err(AdminError::failed(text))
    }
}

/// `lokadb verify ORG`: where the organization's rows are, and that nothing of another
/// organization is among them. Rows are counted on both paths (through the cloud and
/// directly) for a moved organization, and its tables' schema is compared with the cloud's
/// ([`schema_diff`]).
///
/// # Errors
///
/// Unknown organization (usage), a failed query, or a failed check.
pub fn verify_org(
    dsn: &str,
    org_id: &str,
    org_dsn_opt: Option<&str>,
) -> Result<String, AdminError> {
    let mut cloud = connect(dsn)?;
    require_current(&mut cloud)?;
    session_settings(&mut cloud)?;
    let org = read_org(&mut cloud, org_id)?;
    let tables = layout::tables(&mut cloud, org_id)?;
    let mut oc = None;
    let mut out = Vec::new();
    let mut ok = true;
    for t in &tables {
        let place = layout::place(&mut cloud, t)?;
        let in_default = verify::left_in_default(&mut cloud, t)?;
        let (line, good) = match place {
            Place::Default => {
                let s = verify::sum(&mut cloud, t, &format!("ONLY {}", t.default()), &[])?;
                (
                    format!(
                        "{:<28} {:>10} rows  in the cloud (DEFAULT partition)",
                        t.display(),
                        s.rows
                    ),
                    true,
                )
            }
            Place::Cloud => {
                let s = verify::sum(&mut cloud, t, &t.cloud_part(), &[])?;
                let good = s.foreign_rows == 0 && in_default == 0;
                (
                    format!(
                        "{:<28} {:>10} rows  in the cloud (own partition){}",
                        t.display(),
                        s.rows,
                        if in_default > 0 {
                            format!(", {in_default} rows still in DEFAULT!")
                        } else {
                            String::new()
                        }
                    ),
                    good,
                )
            }
            Place::Foreign => {
                if oc.is_none() {
                    let d = match org_dsn_opt {
                        Some(d) => d.to_owned(),
                        None => org_dsn(&mut cloud, &org)?,
                    };
                    oc = Some(connect_org(&d, org_id)?);
                }
                let c = oc.as_mut().expect("connected above");
                // The schema first: the rows are summed over the columns both sides have.
                let want = schema_diff::cloud(&mut cloud, &t.parent(), &t.default())?;
                let have = schema_diff::organization(c, &t.org_table())?;
                let diffs = schema_diff::differences(&want, &have);
                let mut common = t.clone();
                common
                    .columns
                    .retain(|col| have.columns.contains_key(&col.name));
                let direct = verify::sum(c, &common, &t.org_table(), &[])?;
                let through: i64 = cloud
                    .query_one(
                        &format!(
                            "SELECT count(*) FROM {} s WHERE {}",
                            t.parent(),
                            t.org_filter("s")
                        ),
                        &[],
                    )?
                    .get(0);
                let good = direct.foreign_rows == 0 && in_default == 0 && through == direct.rows;
                let mut line = format!(
                    "{:<28} {:>10} rows  in its database",
                    t.display(),
                    direct.rows
                );
                if through != direct.rows {
                    line.push_str(&format!(
                        ", {through} through the cloud (writes in between?)"
                    ));
                }
                if direct.foreign_rows != 0 {
                    line.push_str(&format!(
                        ", {} rows of other organizations!",
                        direct.foreign_rows
                    ));
                }
                if in_default != 0 {
                    line.push_str(&format!(", {in_default} rows still in the cloud!"));
                }
                if diffs.is_empty() {
                    line.push_str(", schema equal");
                } else {
                    line.push_str(&format!(
                        ", schema DIFFERS from the cloud's ({}):",
                        diffs.len()
                    ));
                    for d in &diffs {
                        line.push_str(&format!("\n    {d}"));
                    }
                }
                (line, good && diffs.is_empty())
            }
        };
        ok &= good;
        out.push(line);
    }
    let owed: i64 = cloud
        .query_one(
            "SELECT count(*) FROM lokadb.ddl_owed WHERE org = $1",
            &[&org.id],
        )?
        .get(0);
    if owed > 0 {
        ok = false;
        out.push(format!(
            "owes {owed} migration{} it could not be reached for (its statements are refused): lokadb org sync {} applies them",
            if owed == 1 { "" } else { "s" },
            org.id
        ));
    }
    let summary = format!(
        "organization {} ({}): {}",
        org.id,
        org.state,
        if ok {
            "verified"
        } else {
            "VERIFICATION FAILED"
        }
    );
    out.push(summary);
    let text = out.join("\n") + "\n";
    if ok {
        Ok(text)
    } else {
        Err(AdminError::failed(text))
    }
}
