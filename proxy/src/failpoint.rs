//! Named points where a test makes the process exit, exactly as after `kill -9`:
//! connections drop, and each server rolls back what was open. For the tests of crash
//! safety (moves: `LOKADB_MOVE_FAILPOINT`; the proxy's sessions: `LOKADB_PROXY_FAILPOINT`).
//! A move can also stall at a named point until a test lets it go on
//! (`LOKADB_MOVE_STALL=name:path`), for what happens meanwhile (a migration during a move).

use std::sync::OnceLock;

/// Exits the process at `name` when the environment variable `var` names it.
pub fn exit_at(var: &str, name: &str) {
    if std::env::var(var).is_ok_and(|v| v == name) {
        exit(name);
    }
}

/// Exits the proxy at `name` when `LOKADB_PROXY_FAILPOINT` names it (read once: these
/// points are on the sessions' path).
pub fn proxy(name: &str) {
    static POINT: OnceLock<Option<String>> = OnceLock::new();
    let point = POINT.get_or_init(|| std::env::var("LOKADB_PROXY_FAILPOINT").ok());
    if point.as_deref() == Some(name) {
        exit(name);
    }
}

/// When `var` is `name:path`, at `name`: creates `path.reached`, then waits until `path`
/// exists (at most two minutes, so a forgotten test does not hang the command for ever).
pub fn stall_at(var: &str, name: &str) {
    let Ok(v) = std::env::var(var) else {
        return;
    };
    let Some(path) = v.strip_prefix(name).and_then(|r| r.strip_prefix(':')) else {
        return;
    };
    eprintln!("lokadb: failpoint {name}: waiting for {path}");
    let _ = std::fs::write(format!("{path}.reached"), b"");
    let until = std::time::Instant::now() + std::time::Duration::from_secs(120);
    while !std::path::Path::new(path).exists() && std::time::Instant::now() < until {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

fn exit(name: &str) -> ! {
    eprintln!("lokadb: failpoint {name}: exiting");
    std::process::exit(99);
}
