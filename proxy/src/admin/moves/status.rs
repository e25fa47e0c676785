//! `lokadb status`: every organization's state, pause and move in progress, once or
//! refreshed (`--watch`). What it shows of a move is in the cloud (the journal row and the
//! figures the move publishes), so a move started on one machine is followed from any other.

use super::figures::Figures;
use crate::admin::db::{connect, AdminError};
use crate::admin::migrations::require_current;
use crate::admin::org::format_table;
use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

/// The status table, then one line per move in progress.
///
/// # Errors
///
/// The queries failed.
pub fn status(dsn: &str) -> Result<String, AdminError> {
    let mut c = connect(dsn)?;
    require_current(&mut c)?;
    render(&mut c)
}

/// `--watch`: the status every `every`, `count` times (without end if `None`), each under a
/// line with the time. On a terminal the screen is redrawn; otherwise each status follows the
/// last. A cloud that cannot be reached is said and tried again at the next refresh.
///
/// # Errors
///
/// The first connection failed, or the schema is not this version's.
pub fn watch(dsn: &str, every: Duration, count: Option<u64>) -> Result<String, AdminError> {
    let mut c = connect(dsn)?;
    require_current(&mut c)?;
    let terminal = std::io::stdout().is_terminal();
    let mut shown = 0u64;
    loop {
        let t0 = Instant::now();
        if c.is_closed() {
            if let Ok(again) = connect(dsn) {
                c = again;
            }
        }
        let body = render(&mut c).unwrap_or_else(|e| format!("lokadb: {e} (trying again)\n"));
        let now = c
            .query_one("SELECT to_char(now(), 'YYYY-MM-DD HH24:MI:SS TZ')", &[])
            .map(|r| r.get::<_, String>(0))
            .unwrap_or_default();
        let mut out = std::io::stdout().lock();
        let clear = if terminal { "\x1b[H\x1b[2J" } else { "" };
        let written = write!(
            out,
            "{clear}lokadb status at {now} (every {:.1} s)\n{body}\n",
            every.as_secs_f64()
        )
        .and_then(|()| out.flush());
        if written.is_err() {
            // Whoever read the output is gone (a closed pipe): so is the point of watching.
            return Ok(String::new());
        }
        shown += 1;
        if count.is_some_and(|n| shown >= n) {
            return Ok(String::new());
        }
        std::thread::sleep(every.saturating_sub(t0.elapsed()));
    }
}

/// The status through a connection.
fn render(c: &mut postgres::Client) -> Result<String, AdminError> {
    let rows = c.query(
        "SELECT o.id, o.state, o.profile,
                coalesce((SELECT 'yes (' || p.reason || ', since ' || to_char(p.since, 'HH24:MI:SS') || ')'
                          FROM lokadb.pause p WHERE p.org = o.id
                            AND EXISTS (SELECT 1 FROM pg_stat_activity a WHERE a.pid = p.holder_pid)), 'no'),
                coalesce(m.direction, ''), coalesce(m.mode, ''), coalesce(m.step, ''),
                coalesce(to_char(m.updated_at, 'YYYY-MM-DD HH24:MI:SS'), ''),
                CASE WHEN m.org IS NULL THEN ''
                     WHEN EXISTS (SELECT 1 FROM pg_locks l WHERE l.locktype = 'advisory' AND l.granted
                                   AND l.objsubid = 1
                                   AND l.classid::bigint = (hashtextextended('lokadb.move:' || o.id, 0) >> 32) & 4294967295
                                   AND l.objid::bigint = hashtextextended('lokadb.move:' || o.id, 0) & 4294967295)
                     THEN 'running' ELSE 'interrupted (rerun or --abort)' END,
                coalesce(m.progress, ''),
                m.figures::text,
                coalesce(extract(epoch FROM now() - m.updated_at)::float8, 0)
         FROM lokadb.org o LEFT JOIN lokadb.moves m ON m.org = o.id ORDER BY o.id",
        &[],
    )?;
    let mut table = vec![[
        "org", "state", "profile", "paused", "move", "mode", "step", "updated", "command",
    ]
    .map(str::to_owned)];
    let mut progress = Vec::new();
    for r in &rows {
        let dir: String = r.get(4);
        let mv = if dir.is_empty() {
            ""
        } else {
            super::command_of(&dir)
        };
        table.push([
            r.get(0),
            r.get(1),
            r.get(2),
            r.get(3),
            mv.to_owned(),
            r.get(5),
            r.get(6),
            r.get(7),
            r.get(8),
        ]);
        // The figures when this version can read them, else the move's last line.
        let figures: Option<String> = r.get(10);
        let line = figures
            .as_deref()
            .and_then(Figures::shown)
            .unwrap_or_else(|| r.get(9));
        if !line.is_empty() {
            let ago: f64 = r.get(11);
            progress.push(format!(
                "{}: {line} (updated {:.0} s ago)",
                r.get::<_, String>(0),
                ago
            ));
        }
    }
    let mut out = format_table(&table);
    if !progress.is_empty() {
        out.push('\n');
    }
    for p in progress {
        out.push_str(&p);
        out.push('\n');
    }
    Ok(out)
}
