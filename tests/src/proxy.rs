//! The `lokadb` proxy binary, started for a test.
//!
//! Contract with the binary: `lokadb proxy --config FILE` prints the line
//! `lokadb proxy listening on HOST:PORT` on stdout once it accepts connections (its SIGTERM
//! handler already installed), and exits on SIGTERM after a graceful shutdown. Logging is steered by `LOKADB_LOG` (default here: `info`).

use std::io::{BufRead, BufReader, Read};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};

const LISTENING: &str = "lokadb proxy listening on ";
const RELAY_LISTENING: &str = "lokadb relay listening on ";
const START_TIMEOUT: Duration = Duration::from_secs(20);

/// A running proxy; dropping it kills the process (SIGKILL) and removes its config file.
#[derive(Debug)]
pub struct Proxy {
    child: Child,
    addr: SocketAddr,
    output: Arc<Mutex<String>>,
    exit: Option<ExitStatus>,
    config_dir: crate::TempDir,
    relay: Option<RelayAddrs>,
}

/// The relay's listeners, from `lokadb relay listening on A (agents) and P (postgres)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RelayAddrs {
    /// Where agents dial.
    pub agents: SocketAddr,
    /// The Postgres listener.
    pub postgres: SocketAddr,
}

#[derive(Debug, Clone, Copy)]
enum Listening {
    Proxy(SocketAddr),
    Relay(RelayAddrs),
}

/// Options for [`Proxy`]: `Proxy::builder(config).env("K", "V").start()`.
#[derive(Debug, Clone)]
pub struct Builder {
    config: serde_json::Value,
    env: Vec<(String, String)>,
    args: Vec<String>,
    bin: Option<PathBuf>,
    start_timeout: Duration,
    subcommand: &'static str,
}

impl Builder {
    /// An environment variable for the proxy (`LOKADB_LOG` overrides the default `info`).
    pub fn env(mut self, key: &str, value: &str) -> Self {
        self.env.push((key.to_string(), value.to_string()));
        self
    }

    /// An extra command-line argument after `proxy --config FILE`.
    pub fn arg(mut self, arg: &str) -> Self {
        self.args.push(arg.to_string());
        self
    }

    /// The binary to run (default: [`find_binary`]).
    pub fn bin(mut self, path: impl Into<PathBuf>) -> Self {
        self.bin = Some(path.into());
        self
    }

    pub fn start_timeout(mut self, timeout: Duration) -> Self {
        self.start_timeout = timeout;
        self
    }

    /// Runs `lokadb relay` instead of `lokadb proxy`; the returned handle's
    /// [`Proxy::relay`] has the addresses and [`Proxy::addr`] is the agents' address.
    pub fn relay_only(mut self) -> Self {
        self.subcommand = "relay";
        self
    }

    pub fn start(self) -> Result<Proxy> {
        Proxy::start_with(self)
    }
}

/// `LOKADB_BIN` if set; else the newest of `lokadb` next to this test binary's target profile
/// dir, `<repo>/target/release/lokadb` and `<repo>/target/debug/lokadb`.
pub fn find_binary() -> Result<PathBuf> {
    find_named_binary("lokadb", "LOKADB_BIN", "lokadb")
}

/// The binary `name`: the path in the environment variable `env` if set, else the newest
/// build next to this test binary or in `<repo>/target/{release,debug}`.
pub fn find_named_binary(name: &str, env: &str, package: &str) -> Result<PathBuf> {
    if let Some(bin) = std::env::var_os(env).filter(|b| !b.is_empty()) {
        let bin = PathBuf::from(bin);
        if !bin.is_file() {
            bail!("{env}={} is not a file", bin.display());
        }
        return Ok(bin);
    }
    let mut candidates = Vec::new();
    // The test binary is <target>/<profile>/deps/it-<hash>.
    if let Ok(exe) = std::env::current_exe() {
        if let Some(profile_dir) = exe.parent().and_then(Path::parent) {
            candidates.push(profile_dir.join(name));
        }
    }
    let target = crate::repo_root().join("target");
    candidates.push(target.join("release").join(name));
    candidates.push(target.join("debug").join(name));
    candidates
        .into_iter()
        .filter_map(|p| {
            let modified = std::fs::metadata(&p).ok()?.modified().ok()?;
            Some((modified, p))
        })
        .max_by_key(|(modified, _)| *modified)
        .map(|(_, p)| p)
        .ok_or_else(|| {
            anyhow!("no {name} binary: build it (cargo build --release -p {package}) or set {env}")
        })
}

impl Proxy {
    /// Starts `lokadb proxy` with `config` and waits for its listening line.
    pub fn start(config: &serde_json::Value) -> Result<Proxy> {
        Proxy::builder(config.clone()).start()
    }

    pub fn builder(config: serde_json::Value) -> Builder {
        Builder {
            config,
            env: Vec::new(),
            args: Vec::new(),
            bin: None,
            start_timeout: START_TIMEOUT,
            subcommand: "proxy",
        }
    }

    fn start_with(b: Builder) -> Result<Proxy> {
        static CLEAN: std::sync::Once = std::sync::Once::new();
        CLEAN.call_once(|| crate::remove_stale_temp_dirs("lokadb-proxy"));
        let bin = match b.bin {
            Some(bin) => bin,
            None => find_binary()?,
        };
        let config_dir = crate::TempDir::new("lokadb-proxy")?;
        let config_path = config_dir.path().join("config.json");
        let mut config = b.config;
        if b.subcommand == "proxy" {
            pool_mode_from_env(&mut config);
        }
        std::fs::write(&config_path, serde_json::to_vec_pretty(&config)?)
            .with_context(|| format!("write {}", config_path.display()))?;

        let mut cmd = Command::new(&bin);
        cmd.arg(b.subcommand)
            .arg("--config")
            .arg(&config_path)
            .args(&b.args)
            .env("LOKADB_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for (k, v) in &b.env {
            cmd.env(k, v);
        }
        crate::die_with_parent(&mut cmd, libc::SIGKILL);
        let mut child =
            crate::spawn_long_lived(cmd).with_context(|| format!("spawn {}", bin.display()))?;

        let output = Arc::new(Mutex::new(String::new()));
        let (addr_tx, addr_rx) = mpsc::channel::<Listening>();
        let stdout = child.stdout.take().expect("piped");
        let stderr = child.stderr.take().expect("piped");
        drain(stdout, output.clone(), addr_tx.clone());
        drain(stderr, output.clone(), addr_tx);

        let deadline = Instant::now() + b.start_timeout;
        let mut relay = None;
        let addr = loop {
            match addr_rx.recv_timeout(Duration::from_millis(50)) {
                Ok(Listening::Relay(r)) => {
                    relay = Some(r);
                    if b.subcommand == "relay" {
                        break r.agents;
                    }
                }
                Ok(Listening::Proxy(addr)) => break addr,
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    // Both pipes closed: the process is exiting.
                    let status = child.wait().ok();
                    bail!(
                        "{} exited ({status:?}) before listening; output:\n{}",
                        bin.display(),
                        output.lock().unwrap()
                    );
                }
            }
            if let Ok(Some(status)) = child.try_wait() {
                // Let the drain threads pick up the last lines.
                std::thread::sleep(Duration::from_millis(100));
                bail!(
                    "{} exited with {status} before listening; output:\n{}",
                    bin.display(),
                    output.lock().unwrap()
                );
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                bail!(
                    "{} did not print `{LISTENING}HOST:PORT` within {:?}; output:\n{}",
                    bin.display(),
                    b.start_timeout,
                    output.lock().unwrap()
                );
            }
        };
        Ok(Proxy {
            child,
            addr,
            output,
            exit: None,
            config_dir,
            relay,
        })
    }

    /// The relay's addresses, when the process runs one.
    pub fn relay(&self) -> Option<RelayAddrs> {
        self.relay
    }

    /// The address from the listening line.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The config file the proxy was started with.
    pub fn config_path(&self) -> PathBuf {
        self.config_dir.path().join("config.json")
    }

    /// Everything the proxy printed so far, stdout and stderr interleaved by line.
    pub fn output(&self) -> String {
        self.output.lock().unwrap().clone()
    }

    /// Waits up to `timeout` until the output contains `needle`. stdout and stderr are drained
    /// by separate threads, so a line written before the listening line may land after it.
    pub fn wait_for_output(&self, needle: &str, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            if self.output.lock().unwrap().contains(needle) {
                return true;
            }
            if Instant::now() > deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Asks for a graceful shutdown.
    pub fn sigterm(&self) {
        if self.exit.is_none() {
            crate::signal(self.child.id(), libc::SIGTERM);
        }
    }

    /// Sends any signal, such as `libc::SIGHUP`.
    pub fn signal(&self, sig: libc::c_int) {
        if self.exit.is_none() {
            crate::signal(self.child.id(), sig);
        }
    }

    /// Waits up to `timeout` for the process to exit; `None` if it still runs.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        if self.exit.is_some() {
            return self.exit;
        }
        let deadline = Instant::now() + timeout;
        loop {
            match self.child.try_wait() {
                Ok(Some(status)) => {
                    self.exit = Some(status);
                    return self.exit;
                }
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(5))
                }
                _ => return None,
            }
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        if self.exit.is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Copies lines from `pipe` into `output` and reports the listening addresses.
fn drain(
    pipe: impl Read + Send + 'static,
    output: Arc<Mutex<String>>,
    addr_tx: mpsc::Sender<Listening>,
) {
    capture(pipe, output, move |text| {
        if let Some(addr) = parse_listening(text) {
            let _ = addr_tx.send(Listening::Proxy(addr));
        }
        if let Some(relay) = parse_relay_listening(text) {
            let _ = addr_tx.send(Listening::Relay(relay));
        }
    });
}

/// Copies lines from `pipe` into `output` on a thread of its own, showing each line to
/// `on_line` first.
pub(crate) fn capture(
    pipe: impl Read + Send + 'static,
    output: Arc<Mutex<String>>,
    on_line: impl Fn(&str) + Send + 'static,
) {
    std::thread::spawn(move || {
        let mut reader = BufReader::new(pipe);
        let mut line = Vec::new();
        loop {
            line.clear();
            match reader.read_until(b'\n', &mut line) {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
            let text = String::from_utf8_lossy(&line);
            on_line(&text);
            let mut out = output.lock().unwrap();
            out.push_str(&text);
            if !text.ends_with('\n') {
                out.push('\n');
            }
        }
    });
}

fn parse_listening(line: &str) -> Option<SocketAddr> {
    let rest = &line[line.find(LISTENING)? + LISTENING.len()..];
    let token = rest.split_whitespace().next()?;
    token.parse().ok()
}

fn parse_relay_listening(line: &str) -> Option<RelayAddrs> {
    let rest = &line[line.find(RELAY_LISTENING)? + RELAY_LISTENING.len()..];
    let mut words = rest.split_whitespace();
    let agents = words.next()?.parse().ok()?;
    let postgres = words.nth(2)?.parse().ok()?;
    Some(RelayAddrs { agents, postgres })
}

/// `LOKADB_TEST_POOL_MODE=transaction` (with `LOKADB_TEST_POOL_SIZE`, default 3): every
/// database of a proxy a test starts pools by transaction unless the test chose a mode, so
/// the suites that check the proxy answers as the cloud does run in that mode too.
fn pool_mode_from_env(config: &mut serde_json::Value) {
    let Ok(mode) = std::env::var("LOKADB_TEST_POOL_MODE") else {
        return;
    };
    let size: u32 = std::env::var("LOKADB_TEST_POOL_SIZE")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3);
    let Some(dbs) = config
        .get_mut("databases")
        .and_then(serde_json::Value::as_object_mut)
    else {
        return;
    };
    for db in dbs.values_mut() {
        if let Some(db) = db.as_object_mut() {
            let shared = db.get("upstream_pool") != Some(&serde_json::Value::Bool(false));
            if shared && !db.contains_key("pool_mode") {
                db.insert("pool_mode".into(), mode.clone().into());
                db.entry("pool_size").or_insert(size.into());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listening_line_is_parsed() {
        assert_eq!(
            parse_listening("lokadb proxy listening on 127.0.0.1:6432\n"),
            Some("127.0.0.1:6432".parse().unwrap())
        );
        assert_eq!(
            parse_listening("2025-01-01 INFO lokadb proxy listening on [::1]:7 (tls off)"),
            Some("[::1]:7".parse().unwrap())
        );
        assert_eq!(parse_listening("lokadb proxy starting"), None);
        assert_eq!(
            parse_relay_listening(
                "lokadb relay listening on 127.0.0.1:7000 (agents) and 127.0.0.1:7001 (postgres)"
            ),
            Some(RelayAddrs {
                agents: "127.0.0.1:7000".parse().unwrap(),
                postgres: "127.0.0.1:7001".parse().unwrap()
            })
        );
    }
}
