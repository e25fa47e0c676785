//! `lokadb status`: every organization's state, pause and move in progress.

use crate::admin::db::{connect, AdminError};
use crate::admin::migrations::require_current;
use crate::admin::org::format_table;

/// The status table, then one line per move in progress.
///
/// # Errors
///
/// The queries failed.
pub fn status(dsn: &str) -> Result<String, AdminError> {
    let mut c = connect(dsn)?;
    require_current(&mut c)?;
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
                coalesce(m.progress, '')
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
        let mv = match dir.as_str() {
            "out" => "move-org",
            "back" => "move-back",
            _ => "",
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
        let p: String = r.get(9);
        if !p.is_empty() {
            progress.push(format!("{}: {p}", r.get::<_, String>(0)));
        }
    }
    let mut out = format_table(&table);
    for p in progress {
        out.push_str(&p);
        out.push('\n');
    }
    Ok(out)
}
