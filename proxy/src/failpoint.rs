//! Named points where a test makes the process exit, exactly as after `kill -9`:
//! connections drop, and each server rolls back what was open. For the tests of crash
//! safety (moves: `LOKADB_MOVE_FAILPOINT`; the proxy's sessions: `LOKADB_PROXY_FAILPOINT`).

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

fn exit(name: &str) -> ! {
    eprintln!("lokadb: failpoint {name}: exiting");
    std::process::exit(99);
}
