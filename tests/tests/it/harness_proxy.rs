//! `proxy::Proxy` against a stand-in script that keeps the binary's contract, so the harness's
//! own behavior (listening line, output, env, signals, start failures) is pinned down.

use std::time::Duration;

use lokadb_tests::proxy::Proxy;
use lokadb_tests::TempDir;

/// Writes an executable `lokadb` stand-in running `body` under `sh`.
fn stand_in(dir: &TempDir, body: &str) -> std::path::PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let path = dir.path().join("lokadb");
    std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

/// Starts, retrying ETXTBSY: another test thread's fork may briefly hold the script open.
fn start(builder: lokadb_tests::proxy::Builder) -> anyhow::Result<Proxy> {
    for _ in 0..20 {
        match builder.clone().start() {
            Err(e) if format!("{e:#}").contains("Text file busy") => {
                std::thread::sleep(Duration::from_millis(20))
            }
            other => return other,
        }
    }
    builder.start()
}

#[test]
fn waits_for_the_listening_line_and_keeps_output() {
    let dir = TempDir::new("lokadb-proxy-standin").unwrap();
    let bin = stand_in(
        &dir,
        r#"echo "starting with $1 $2 log=$LOKADB_LOG extra=$EXTRA" >&2
cat "$3" >&2
trap 'echo "got TERM"; exit 0' TERM
echo "lokadb proxy listening on 127.0.0.1:6543"
while :; do sleep 0.02; done"#,
    );
    let config = serde_json::json!({ "listen": "127.0.0.1:0", "marker": "config-reached-it" });
    let mut proxy = start(Proxy::builder(config).bin(&bin).env("EXTRA", "yes")).unwrap();
    assert_eq!(proxy.addr(), "127.0.0.1:6543".parse().unwrap());
    assert_eq!(proxy.port(), 6543);
    assert!(proxy.pid() > 0);
    let second = Duration::from_secs(1);
    assert!(
        proxy.wait_for_output("starting with proxy --config log=info extra=yes", second),
        "{}",
        proxy.output()
    );
    assert!(
        proxy.wait_for_output("config-reached-it", second),
        "{}",
        proxy.output()
    );

    proxy.sigterm();
    let status = proxy
        .wait_exit(Duration::from_secs(5))
        .expect("exits on SIGTERM");
    assert!(status.success(), "{status}");
    assert!(
        proxy.wait_for_output("got TERM", second),
        "{}",
        proxy.output()
    );
}

#[test]
fn exit_before_listening_is_an_error_with_the_output() {
    let dir = TempDir::new("lokadb-proxy-standin").unwrap();
    let bin = stand_in(&dir, "echo 'config is broken' >&2\nexit 3");
    let err = start(Proxy::builder(serde_json::json!({})).bin(&bin)).expect_err("must fail");
    let text = format!("{err:#}");
    assert!(text.contains("config is broken"), "{text}");
    assert!(text.contains("before listening"), "{text}");
}

#[test]
fn silence_times_out_and_kills_the_process() {
    let dir = TempDir::new("lokadb-proxy-standin").unwrap();
    let bin = stand_in(&dir, "echo 'still thinking' >&2\nexec sleep 30");
    let t = std::time::Instant::now();
    let err = start(
        Proxy::builder(serde_json::json!({}))
            .bin(&bin)
            .start_timeout(Duration::from_millis(500)),
    )
    .expect_err("must time out");
    let text = format!("{err:#}");
    assert!(text.contains("did not print"), "{text}");
    assert!(text.contains("still thinking"), "{text}");
    assert!(t.elapsed() < Duration::from_secs(5));
}

#[test]
fn drop_kills_the_process() {
    let dir = TempDir::new("lokadb-proxy-standin").unwrap();
    let bin = stand_in(
        &dir,
        "echo 'lokadb proxy listening on 127.0.0.1:1'\ntrap '' TERM\nexec sleep 30",
    );
    let proxy = start(Proxy::builder(serde_json::json!({})).bin(&bin)).unwrap();
    let pid = proxy.pid();
    drop(proxy);
    assert!(!std::path::Path::new(&format!("/proc/{pid}")).exists());
}
