//! Running the `lokadb` admin commands from the tests: the binary as a subprocess, its
//! output, and the exit status asserted with the output in the message.

use std::process::Output;

/// Runs `lokadb ARGS` with `--cloud` taken from the environment (and no org password
/// inherited from it). `org add` registers plain TCP to the relay unless ARGS say
/// otherwise: the PostgreSQL 18 the tests download has no TLS in its libpq.
pub(crate) fn lokadb(cloud_dsn: &str, args: &[&str]) -> Output {
    let bin = lokadb_tests::proxy::find_binary().unwrap();
    std::process::Command::new(bin)
        .args(args)
        .env("LOKADB_CLOUD", cloud_dsn)
        .env_remove("LOKADB_ORG_PASSWORD")
        .env("LOKADB_RELAY_SSLMODE", "disable")
        .output()
        .unwrap()
}

pub(crate) fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub(crate) fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Asserts the command succeeded and returns its stdout.
#[track_caller]
pub(crate) fn ok(o: &Output) -> String {
    assert!(
        o.status.success(),
        "exit {:?}\nstdout: {}\nstderr: {}",
        o.status.code(),
        stdout(o),
        stderr(o)
    );
    stdout(o)
}
