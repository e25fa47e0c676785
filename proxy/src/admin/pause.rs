//! `lokadb pause ORG` and `lokadb resume ORG`.
//!
//! A pause is an exclusive advisory lock on the organization's key
//! ([`lokadb.pause_key`](../sql/0001_init.sql)), which every write of its rows asks for in
//! shared mode (the row triggers of LokaDB tables call `lokadb.write_gate`). Taking it
//! waits for the organization's writes in flight, then holds new ones back; reads take no
//! lock. A lock lives as long as its session, so `lokadb pause` starts a small holder
//! process that keeps the session until `lokadb resume`, until `--max` elapses, or until it
//! dies — a pause never outlives its holder, so an organization cannot be left paused by a
//! crash.

use super::db::{connect, describe, AdminError};
use super::migrations::require_current;
use std::io::BufRead;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The NOTIFY channel `lokadb resume` signals holders on (payload: the organization).
const RESUME_CHANNEL: &str = "lokadb_resume";

/// How a pause is held.
#[derive(Debug, Clone)]
pub struct PauseOptions {
    /// Writers wait at most this long, then get SQLSTATE 55P03; also how long the pause
    /// may wait for writes in flight before giving up.
    pub timeout: Duration,
    /// The pause ends by itself after this long.
    pub max: Duration,
    /// Shown by `lokadb org show`.
    pub reason: String,
}

/// `lokadb pause`: starts the holder and returns once the pause is in force, with the
/// holder's process id.
///
/// # Errors
///
/// Unknown organization, already paused, or writes in flight longer than `timeout`:
/// nothing stays paused.
pub fn pause(dsn: &str, org: &str, opts: &PauseOptions) -> Result<u32, AdminError> {
    let exe = std::env::current_exe()
        .map_err(|e| AdminError::failed(format!("cannot find the lokadb binary: {e}")))?;
    let mut cmd = Command::new(exe);
    cmd.arg("pause-holder")
        .arg(org)
        .arg("--timeout")
        .arg(humantime::format_duration(opts.timeout).to_string())
        .arg("--max")
        .arg(humantime::format_duration(opts.max).to_string())
        .arg("--reason")
        .arg(&opts.reason)
        .env("LOKADB_CLOUD", dsn)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // Its own session: the holder outlives this command and the terminal's Ctrl-C.
    // SAFETY: setsid is async-signal-safe.
    unsafe {
        use std::os::unix::process::CommandExt;
        cmd.pre_exec(|| {
            libc::setsid();
            Ok(())
        });
    }
    let mut child = cmd
        .spawn()
        .map_err(|e| AdminError::failed(format!("cannot start the pause holder: {e}")))?;
    let pid = child.id();
    let mut line = String::new();
    let stdout = child.stdout.take().expect("piped");
    let _ = std::io::BufReader::new(stdout).read_line(&mut line);
    if line.trim() == "paused" {
        return Ok(pid);
    }
    let mut err = String::new();
    if let Some(mut e) = child.stderr.take() {
        use std::io::Read;
        let _ = e.read_to_string(&mut err);
    }
    let status = child.wait().ok();
    let err = err.trim().trim_start_matches("lokadb: ").to_owned();
    Err(match status.and_then(|s| s.code()) {
        Some(2) => AdminError::usage(err),
        _ => AdminError::failed(if err.is_empty() {
            "the pause holder exited before the pause was in force".to_owned()
        } else {
            err
        }),
    })
}

/// The holder (`lokadb pause-holder`, started by [`pause`]): takes the lock, prints
/// `paused`, and keeps the session until resumed or `max` elapses.
///
/// # Errors
///
/// As [`pause`].
pub fn hold(dsn: &str, org: &str, opts: &PauseOptions) -> Result<(), AdminError> {
    let mut client = connect(dsn)?;
    require_current(&mut client)?;
    let known: bool = client
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM lokadb.org WHERE id = $1)",
            &[&org],
        )?
        .get(0);
    if !known {
        return Err(AdminError::usage(format!(
            "organization {org} is not registered (lokadb org list shows those that are)"
        )));
    }
    let holder = live_holder(&mut client, org)?;
    if let Some(pid) = holder {
        return Err(AdminError::usage(format!(
            "organization {org} is already paused (held by backend {pid}); lokadb resume {org} ends it"
        )));
    }
    let timeout_ms = i64::try_from(opts.timeout.as_millis()).unwrap_or(i64::MAX);
    client.execute(
        "INSERT INTO lokadb.pause (org, holder_pid, reason, timeout)
         VALUES ($1, pg_backend_pid(), $2, make_interval(secs => $3::float8 / 1000))
         ON CONFLICT (org) DO UPDATE SET holder_pid = excluded.holder_pid,
           reason = excluded.reason, timeout = excluded.timeout, since = now()",
        &[&org, &opts.reason, &(timeout_ms as f64)],
    )?;
    client.batch_execute(&format!("SET lock_timeout = {timeout_ms}"))?;
    if let Err(e) = client.execute("SELECT pg_advisory_lock(lokadb.pause_key($1))", &[&org]) {
        let _ = client.execute(
            "DELETE FROM lokadb.pause WHERE org = $1 AND holder_pid = pg_backend_pid()",
            &[&org],
        );
        let lock_timeout = e.as_db_error().is_some_and(|d| d.code().code() == "55P03");
        return Err(AdminError::failed(if lock_timeout {
            format!(
                "could not pause {org}: a transaction writing its rows ran for longer than {}; nothing is paused",
                humantime::format_duration(opts.timeout)
            )
        } else {
            describe(&e)
        }));
    }
    client.batch_execute(&format!("RESET lock_timeout; LISTEN {RESUME_CHANNEL}"))?;
    println!("paused");
    use std::io::Write;
    let _ = std::io::stdout().flush();

    let deadline = Instant::now() + opts.max;
    let why = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break "--max elapsed";
        }
        let mut resumed = false;
        let mut notes = client.notifications();
        let mut iter = notes.timeout_iter(left.min(Duration::from_secs(1)));
        while let Some(n) = postgres::fallible_iterator::FallibleIterator::next(&mut iter)? {
            if n.payload() == org {
                resumed = true;
            }
        }
        if resumed {
            break "resumed";
        }
    };
    client.execute(
        "DELETE FROM lokadb.pause WHERE org = $1 AND holder_pid = pg_backend_pid()",
        &[&org],
    )?;
    client.execute("SELECT pg_advisory_unlock(lokadb.pause_key($1))", &[&org])?;
    eprintln!("lokadb: pause of {org} ended ({why})");
    Ok(())
}

/// The backend holding `org`'s pause, if its session is alive (a row left by a holder
/// that died means nothing: its lock went with it).
fn live_holder(client: &mut postgres::Client, org: &str) -> Result<Option<i32>, AdminError> {
    Ok(client
        .query_opt(
            "SELECT holder_pid FROM lokadb.pause p WHERE org = $1
               AND EXISTS (SELECT 1 FROM pg_stat_activity a WHERE a.pid = p.holder_pid)",
            &[&org],
        )?
        .map(|r| r.get(0)))
}

/// `lokadb resume ORG`: ends the pause and waits until writes may flow.
///
/// # Errors
///
/// The organization is not paused (usage).
pub fn resume(dsn: &str, org: &str) -> Result<(), AdminError> {
    let mut client = connect(dsn)?;
    require_current(&mut client)?;
    let holder = live_holder(&mut client, org)?;
    let Some(pid) = holder else {
        return Err(AdminError::usage(format!(
            "organization {org} is not paused"
        )));
    };
    client.execute("SELECT pg_notify($1, $2)", &[&RESUME_CHANNEL, &org])?;
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let held: bool = client
            .query_one(
                "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND pid = $1
                   AND granted AND mode = 'ExclusiveLock'
                   AND ((classid::bigint << 32) | objid::bigint) = lokadb.pause_key($2))",
                &[&pid, &org],
            )?
            .get(0);
        if !held {
            return Ok(());
        }
        if Instant::now() > deadline {
            // The holder does not answer: end its session, which ends the pause.
            client.execute("SELECT pg_terminate_backend($1)", &[&pid])?;
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}
