//! The `lokadb-agent` binary, started for a test.
//!
//! Contract with the binary: it prints `lokadb-agent connected to RELAY` on stdout once
//! its first tunnel is up. Dropping the handle kills the process.

use crate::proxy::{capture, find_named_binary};
use anyhow::{Context, Result};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A running agent.
#[derive(Debug)]
pub struct Agent {
    child: Option<Child>,
    output: Arc<Mutex<String>>,
}

impl Agent {
    /// Starts an agent for `relays` (each `HOST:PORT`) that trusts `ca`, serving the
    /// Postgres at `postgres`; `extra` are more arguments (e.g. `--max-conns 5`).
    /// `env` are more environment variables. Does not wait for the tunnel: see
    /// [`Agent::wait_connected`].
    pub fn spawn(
        relays: &[SocketAddr],
        token: &str,
        postgres: SocketAddr,
        ca: &Path,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Result<Agent> {
        let bin = find_named_binary("lokadb-agent", "LOKADB_AGENT_BIN", "lokadb-agent")?;
        let mut cmd = Command::new(&bin);
        for relay in relays {
            cmd.arg("--relay").arg(relay.to_string());
        }
        cmd.arg("--postgres")
            .arg(postgres.to_string())
            .arg("--ca")
            .arg(ca)
            .args(extra)
            .env("LOKADB_TOKEN", token)
            .env(
                "LOKADB_LOG",
                std::env::var("LOKADB_AGENT_LOG").unwrap_or("info".into()),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for (k, v) in env {
            cmd.env(k, v);
        }
        crate::die_with_parent(&mut cmd, libc::SIGKILL);
        let mut child =
            crate::spawn_long_lived(cmd).with_context(|| format!("spawn {}", bin.display()))?;
        let output = Arc::new(Mutex::new(String::new()));
        capture(child.stdout.take().expect("piped"), output.clone(), |_| {});
        capture(child.stderr.take().expect("piped"), output.clone(), |_| {});
        Ok(Agent {
            child: Some(child),
            output,
        })
    }

    /// Starts an agent and waits until its tunnel is up.
    pub fn start(
        relays: &[SocketAddr],
        token: &str,
        postgres: SocketAddr,
        ca: &Path,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Result<Agent> {
        let agent = Agent::spawn(relays, token, postgres, ca, extra, env)?;
        agent.wait_connected(Duration::from_secs(20))?;
        Ok(agent)
    }

    /// Waits for the `connected` line.
    pub fn wait_connected(&self, timeout: Duration) -> Result<()> {
        if self.wait_for_output("lokadb-agent connected to", timeout) {
            Ok(())
        } else {
            anyhow::bail!(
                "the agent did not connect within {timeout:?}; output:\n{}",
                self.output()
            )
        }
    }

    /// Everything the agent printed.
    pub fn output(&self) -> String {
        self.output.lock().unwrap().clone()
    }

    /// Waits up to `timeout` until the output contains `needle`.
    pub fn wait_for_output(&self, needle: &str, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if self.output.lock().unwrap().contains(needle) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        false
    }

    /// How many times `needle` appears in the output.
    pub fn count_output(&self, needle: &str) -> usize {
        self.output.lock().unwrap().matches(needle).count()
    }

    /// The process id.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Kills the agent at once (SIGKILL) and reaps it.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.kill();
    }
}
