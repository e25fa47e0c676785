//! Throwaway real PostgreSQL clusters.
//!
//! `initdb` runs once per bin dir and Postgres version into a cached template under the temp
//! dir; each [`Cluster`] copies it (well under a second) and starts `postgres -D` directly as a
//! child that dies with the test process. Postgres refuses to run as root, so when the tests run
//! as root the cluster runs as the system user [`PG_OS_USER`] (created if missing).
//!
//! The superuser is [`SUPERUSER`] / [`SUPERUSER_PASSWORD`]; local (unix socket) connections are
//! trusted, TCP connections on 127.0.0.1 need a SCRAM-SHA-256 password.

use std::collections::BTreeMap;
use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::io::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Once, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};

/// The cluster's superuser.
pub const SUPERUSER: &str = "postgres";
/// The superuser's password (SCRAM over TCP).
pub const SUPERUSER_PASSWORD: &str = "postgres";
/// The OS user clusters run as when the tests run as root.
pub const PG_OS_USER: &str = "lokadb-pg";

/// Bumped when the template's initdb options change, so old templates are not reused.
const TEMPLATE_FORMAT: &str = "lokadb-pg-template-v1";
const START_TIMEOUT: Duration = Duration::from_secs(60);
const STOP_TIMEOUT: Duration = Duration::from_secs(10);

/// A running throwaway cluster; dropping it stops Postgres and removes its directory.
#[derive(Debug)]
pub struct Cluster {
    child: Option<Child>,
    dir: PathBuf,
    bin_dir: PathBuf,
    port: u16,
    version: String,
}

/// Options for [`Cluster`]: `Cluster::builder().setting("max_connections", "1100").start()`.
#[derive(Debug, Default, Clone)]
pub struct Builder {
    settings: Vec<(String, String)>,
    bin_dir: Option<PathBuf>,
}

impl Builder {
    /// A `postgresql.conf` setting, passed as `-c name=value`; overrides the defaults.
    pub fn setting(mut self, name: &str, value: &str) -> Self {
        self.settings.push((name.to_string(), value.to_string()));
        self
    }

    /// The directory with `initdb`, `postgres`, `psql`, `pg_isready` (default: [`default_bin_dir`]).
    pub fn bin_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.bin_dir = Some(dir.into());
        self
    }

    /// Copies the template, starts Postgres and waits until it accepts connections.
    pub fn start(self) -> Result<Cluster> {
        Cluster::start_with(self)
    }
}

/// `LOKADB_PG_BIN` if set, else `<repo>/.pg/bin` (set up by `scripts/setup.sh`).
pub fn default_bin_dir() -> PathBuf {
    match std::env::var_os("LOKADB_PG_BIN") {
        Some(dir) if !dir.is_empty() => PathBuf::from(dir),
        _ => crate::repo_root().join(".pg").join("bin"),
    }
}

impl Cluster {
    /// A cluster with the default settings and bin dir.
    pub fn start() -> Result<Cluster> {
        Builder::default().start()
    }

    pub fn builder() -> Builder {
        Builder::default()
    }

    fn start_with(builder: Builder) -> Result<Cluster> {
        static CLEAN: Once = Once::new();
        CLEAN.call_once(|| crate::remove_stale_temp_dirs("lokadb-pg"));

        let bin_dir = builder.bin_dir.clone().unwrap_or_else(default_bin_dir);
        if !bin_dir.join("postgres").exists() {
            bail!(
                "no postgres in {} (run scripts/setup.sh, or set LOKADB_PG_BIN)",
                bin_dir.display()
            );
        }
        let owner = os_owner()?;
        let version = postgres_version(&bin_dir)?;
        let template = template_data_dir(&bin_dir, &version, owner)?;

        let dir = crate::unique_temp_path("lokadb-pg");
        std::fs::create_dir(&dir).with_context(|| format!("create {}", dir.display()))?;
        // From here on, Drop removes the directory whatever happens.
        let mut cluster = Cluster {
            child: None,
            dir,
            bin_dir,
            port: 0,
            version,
        };
        crate::set_mode(&cluster.dir, 0o700)?;
        chown(&cluster.dir, owner)?;
        let data = cluster.data_dir();
        let out = Command::new("cp")
            .arg("-a")
            .arg(&template)
            .arg(&data)
            .output()
            .context("run cp")?;
        if !out.status.success() {
            bail!(
                "cp -a {} {}: {}",
                template.display(),
                data.display(),
                String::from_utf8_lossy(&out.stderr)
            );
        }

        let mut settings: BTreeMap<String, String> = [
            ("listen_addresses", "127.0.0.1"),
            ("fsync", "off"),
            ("synchronous_commit", "off"),
            ("full_page_writes", "off"),
            ("shared_buffers", "32MB"),
            ("max_connections", "200"),
            ("password_encryption", "scram-sha-256"),
            ("huge_pages", "off"),
            ("logging_collector", "off"),
            ("log_line_prefix", "%m [%p] %q%u@%d "),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        settings.insert(
            "unix_socket_directories".into(),
            cluster.dir.display().to_string(),
        );
        for (k, v) in &builder.settings {
            settings.insert(k.clone(), v.clone());
        }

        let mut last_err = None;
        for _attempt in 0..5 {
            let port = crate::free_port();
            settings.insert("port".into(), port.to_string());
            match cluster.spawn_and_wait(&settings, owner) {
                Ok(()) => {
                    cluster.port = port;
                    return Ok(cluster);
                }
                Err(StartError::PortTaken(e)) => last_err = Some(e),
                Err(StartError::Other(e)) => return Err(e),
            }
        }
        Err(last_err.unwrap_or_else(|| anyhow!("postgres did not start")))
    }

    fn spawn_and_wait(
        &mut self,
        settings: &BTreeMap<String, String>,
        owner: Option<Owner>,
    ) -> std::result::Result<(), StartError> {
        let log_path = self.log_path();
        let mut log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(|e| StartError::Other(anyhow!("open {}: {e}", log_path.display())))?;
        let log_start = log.seek(SeekFrom::End(0)).unwrap_or(0);
        let mut cmd = Command::new(self.bin_dir.join("postgres"));
        cmd.arg("-D").arg(self.data_dir());
        for (k, v) in settings {
            cmd.arg("-c").arg(format!("{k}={v}"));
        }
        cmd.current_dir(&self.dir)
            .stdin(Stdio::null())
            .stdout(log.try_clone().map_err(|e| StartError::Other(e.into()))?)
            .stderr(log.try_clone().map_err(|e| StartError::Other(e.into()))?);
        clean_pg_env(&mut cmd);
        run_as(&mut cmd, owner);
        crate::die_with_parent(&mut cmd, libc::SIGQUIT);
        let child = crate::spawn_long_lived(cmd).map_err(|e| {
            StartError::Other(anyhow!(
                "spawn {}: {e}",
                self.bin_dir.join("postgres").display()
            ))
        })?;
        let _ = log.flush();
        self.child = Some(child);
        let port = settings["port"].clone();

        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            let child = self.child.as_mut().expect("child set above");
            if let Ok(Some(status)) = child.try_wait() {
                self.child = None;
                let text = read_from(&log_path, log_start);
                let e = anyhow!("postgres exited with {status} while starting; log:\n{text}");
                if text.contains("could not bind")
                    || text.contains("Address already in use")
                    || text.contains("could not create any TCP/IP sockets")
                {
                    return Err(StartError::PortTaken(e));
                }
                return Err(StartError::Other(e));
            }
            let ready = Command::new(self.bin_dir.join("pg_isready"))
                .args(["-q", "-t", "2", "-h", "127.0.0.1", "-p", &port])
                .args(["-U", SUPERUSER, "-d", "postgres"])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .map_err(|e| StartError::Other(anyhow!("run pg_isready: {e}")))?;
            if ready.success() {
                return Ok(());
            }
            if Instant::now() > deadline {
                self.stop();
                return Err(StartError::Other(anyhow!(
                    "postgres did not accept connections within {START_TIMEOUT:?}; log:\n{}",
                    read_from(&log_path, log_start)
                )));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The TCP port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Always `127.0.0.1`.
    pub fn host(&self) -> &'static str {
        "127.0.0.1"
    }

    /// `127.0.0.1:port`.
    pub fn addr(&self) -> std::net::SocketAddr {
        crate::localhost(self.port)
    }

    pub fn bin_dir(&self) -> &Path {
        &self.bin_dir
    }

    /// `postgres --version` output, such as `postgres (PostgreSQL) 18.6`.
    pub fn version(&self) -> &str {
        &self.version
    }

    /// The directory that holds `data/` and the unix socket.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn data_dir(&self) -> PathBuf {
        self.dir.join("data")
    }

    /// The server's process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// libpq keyword form: `host=127.0.0.1 port=… user=… password=… dbname=…`.
    pub fn dsn(&self, user: &str, password: &str, db: &str) -> String {
        format!(
            "host=127.0.0.1 port={} user={} password={} dbname={}",
            self.port,
            dsn_value(user),
            dsn_value(password),
            dsn_value(db)
        )
    }

    /// `postgresql://user:password@127.0.0.1:port/db`.
    pub fn url(&self, user: &str, password: &str, db: &str) -> String {
        format!(
            "postgresql://{}:{}@127.0.0.1:{}/{}",
            percent_encode(user),
            percent_encode(password),
            self.port,
            percent_encode(db)
        )
    }

    /// The superuser's DSN for `db`.
    pub fn superuser_dsn(&self, db: &str) -> String {
        self.dsn(SUPERUSER, SUPERUSER_PASSWORD, db)
    }

    /// A tokio-postgres client as the superuser on database `postgres`; its connection task is
    /// spawned on the current tokio runtime.
    pub async fn superuser_client(&self) -> Result<tokio_postgres::Client> {
        self.client(SUPERUSER, SUPERUSER_PASSWORD, "postgres").await
    }

    /// A tokio-postgres client over TCP (no TLS); the connection task runs on the current runtime.
    pub async fn client(
        &self,
        user: &str,
        password: &str,
        db: &str,
    ) -> Result<tokio_postgres::Client> {
        let (client, conn) =
            tokio_postgres::connect(&self.dsn(user, password, db), tokio_postgres::NoTls)
                .await
                .with_context(|| format!("connect to {db} as {user} on port {}", self.port))?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        Ok(client)
    }

    /// Runs `sql` with the `psql` binary as the superuser on `db` (`-X -A -t -v ON_ERROR_STOP=1`,
    /// script on stdin, so each statement runs on its own) and returns its stdout without the
    /// trailing newline; on failure the error holds psql's stderr. Connects over the unix socket
    /// (trusted), so it works whatever the superuser's password has become.
    pub fn psql(&self, db: &str, sql: &str) -> Result<String> {
        let mut cmd = Command::new(self.bin_dir.join("psql"));
        cmd.args(["-X", "-A", "-t", "-q", "-v", "ON_ERROR_STOP=1", "-f", "-"])
            .arg("-h")
            .arg(&self.dir)
            .args(["-p", &self.port.to_string()])
            .args(["-U", SUPERUSER, "-d", db])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        clean_pg_env(&mut cmd);
        cmd.env("PGPASSWORD", SUPERUSER_PASSWORD)
            .env("PGCONNECT_TIMEOUT", "10");
        let mut child = cmd.spawn().context("spawn psql")?;
        let mut stdin = child.stdin.take().expect("piped");
        let script = sql.to_string();
        let writer = std::thread::spawn(move || {
            let _ = stdin.write_all(script.as_bytes());
        });
        let out = child.wait_with_output().context("wait for psql")?;
        let _ = writer.join();
        if !out.status.success() {
            bail!(
                "psql on {db} failed ({}): {}\nSQL: {sql}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim_end()
            );
        }
        let mut text = String::from_utf8_lossy(&out.stdout).into_owned();
        while text.ends_with('\n') {
            text.pop();
        }
        Ok(text)
    }

    /// `CREATE ROLE name LOGIN PASSWORD '…'`, stored as SCRAM-SHA-256.
    pub fn create_role(&self, name: &str, password: &str) -> Result<()> {
        self.psql(
            "postgres",
            &format!(
                "SET password_encryption = 'scram-sha-256';\nCREATE ROLE {} LOGIN PASSWORD {};",
                quote_ident(name),
                quote_literal(password)
            ),
        )
        .map(drop)
    }

    /// `CREATE DATABASE name OWNER owner`.
    pub fn create_database(&self, name: &str, owner: &str) -> Result<()> {
        self.psql(
            "postgres",
            &format!(
                "CREATE DATABASE {} OWNER {};",
                quote_ident(name),
                quote_ident(owner)
            ),
        )
        .map(drop)
    }

    /// Path of the server log (stdout and stderr of `postgres`), in the data dir.
    pub fn log_path(&self) -> PathBuf {
        self.data_dir().join("postgres.log")
    }

    /// Everything the server logged so far.
    pub fn log_contents(&self) -> String {
        read_from(&self.log_path(), 0)
    }

    /// Writes `name` into the data directory, owned by the server's OS user with `mode`
    /// (a TLS key must be 0600 and the server's), and returns its path.
    pub fn put_file(&self, name: &str, contents: &[u8], mode: u32) -> Result<PathBuf> {
        let path = self.data_dir().join(name);
        std::fs::write(&path, contents).with_context(|| format!("write {}", path.display()))?;
        crate::set_mode(&path, mode)?;
        chown(&path, os_owner()?)?;
        Ok(path)
    }

    /// Whether this build of the server has TLS (the PostgreSQL 18 wheel has not).
    pub fn has_tls(&self) -> Result<bool> {
        Ok(!self.psql("postgres", "SHOW ssl_library")?.trim().is_empty())
    }

    /// Immediate shutdown (SIGQUIT), SIGKILL if still running after a timeout. Idempotent.
    fn stop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        crate::signal(child.id(), libc::SIGQUIT);
        let deadline = Instant::now() + STOP_TIMEOUT;
        loop {
            match child.try_wait() {
                Ok(Some(_)) | Err(_) => return,
                Ok(None) if Instant::now() > deadline => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return;
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(5)),
            }
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

enum StartError {
    /// Lost the race for the port: retry with another.
    PortTaken(anyhow::Error),
    Other(anyhow::Error),
}

/// The OS user that owns and runs clusters: `Some` when we are root.
#[derive(Debug, Clone, Copy)]
struct Owner {
    uid: u32,
    gid: u32,
}

fn os_owner() -> Result<Option<Owner>> {
    static OWNER: OnceLock<std::result::Result<Option<Owner>, String>> = OnceLock::new();
    OWNER
        .get_or_init(|| {
            // SAFETY: plain syscall.
            if unsafe { libc::geteuid() } != 0 {
                return Ok(None);
            }
            if let Some(owner) = lookup_user(PG_OS_USER) {
                return Ok(Some(owner));
            }
            let out = Command::new("useradd")
                .args(["--system", "--no-create-home", "--home-dir", "/nonexistent"])
                .args(["--shell", "/usr/sbin/nologin", PG_OS_USER])
                .output()
                .map_err(|e| format!("run useradd: {e}"))?;
            // Another test process may have created it meanwhile: look again either way.
            lookup_user(PG_OS_USER).map(Some).ok_or_else(|| {
                format!(
                    "useradd {PG_OS_USER} failed: {}",
                    String::from_utf8_lossy(&out.stderr)
                )
            })
        })
        .clone()
        .map_err(|e| anyhow!(e))
}

fn lookup_user(name: &str) -> Option<Owner> {
    let cname = CString::new(name).ok()?;
    // SAFETY: getpwnam returns a pointer to static storage or null; read at once. Tests call
    // this once per process (OnceLock) so the non-reentrancy does not matter.
    unsafe {
        let pw = libc::getpwnam(cname.as_ptr());
        if pw.is_null() {
            None
        } else {
            Some(Owner {
                uid: (*pw).pw_uid,
                gid: (*pw).pw_gid,
            })
        }
    }
}

fn chown(path: &Path, owner: Option<Owner>) -> Result<()> {
    let Some(owner) = owner else {
        return Ok(());
    };
    std::os::unix::fs::chown(path, Some(owner.uid), Some(owner.gid))
        .with_context(|| format!("chown {}", path.display()))
}

fn run_as(cmd: &mut Command, owner: Option<Owner>) {
    if let Some(owner) = owner {
        // std drops supplementary groups (setgroups(0)) when it changes the uid as root.
        cmd.uid(owner.uid).gid(owner.gid);
        cmd.env("HOME", "/nonexistent").env("USER", PG_OS_USER);
    }
}

/// Keeps the environment's PG* variables from steering our binaries somewhere else.
fn clean_pg_env(cmd: &mut Command) {
    for (key, _) in std::env::vars_os() {
        if key.as_bytes().starts_with(b"PG") {
            cmd.env_remove(key);
        }
    }
}

fn postgres_version(bin_dir: &Path) -> Result<String> {
    let out = Command::new(bin_dir.join("postgres"))
        .arg("--version")
        .output()
        .with_context(|| format!("run {}/postgres --version", bin_dir.display()))?;
    if !out.status.success() {
        bail!(
            "{}/postgres --version: {}",
            bin_dir.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// The cached template's data dir for this bin dir, version and owner; made on first use.
///
/// Parallel threads and processes serialize on a `flock` on `<template>.lock`; the template is
/// built in a scratch directory and renamed into place, so a half-made one is never used.
fn template_data_dir(bin_dir: &Path, version: &str, owner: Option<Owner>) -> Result<PathBuf> {
    let canonical = bin_dir
        .canonicalize()
        .unwrap_or_else(|_| bin_dir.to_path_buf());
    // Keyed by what the data files depend on, not by the bin dir's path, so fresh clones of the
    // repo with the same Postgres build share one template.
    let postgres_size = std::fs::metadata(canonical.join("postgres"))
        .map(|m| m.len())
        .unwrap_or(0);
    let key = fnv1a(
        format!(
            "{TEMPLATE_FORMAT}\0{version}\0{postgres_size}\0{:?}",
            owner.map(|o| o.uid)
        )
        .as_bytes(),
    );
    let tmp = std::env::temp_dir();
    let base = tmp.join(format!("lokadb-pg-template-{key:016x}"));
    let ready = base.join("READY");
    let data = base.join("data");
    if ready.exists() {
        return Ok(data);
    }

    let lock_path = tmp.join(format!("lokadb-pg-template-{key:016x}.lock"));
    let lock = File::create(&lock_path).with_context(|| format!("{}", lock_path.display()))?;
    // SAFETY: flock on a descriptor we own; released when `lock` is closed.
    if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) } != 0 {
        return Err(std::io::Error::last_os_error()).context("flock template lock");
    }
    if ready.exists() {
        return Ok(data);
    }

    let scratch_prefix = format!("lokadb-pg-template-{key:016x}.tmp");
    crate::remove_stale_temp_dirs(&scratch_prefix);
    let scratch = crate::unique_temp_path(&scratch_prefix);
    std::fs::create_dir(&scratch)?;
    let result = (|| -> Result<()> {
        crate::set_mode(&scratch, 0o700)?;
        chown(&scratch, owner)?;
        let pwfile = scratch.join("pwfile");
        std::fs::write(&pwfile, format!("{SUPERUSER_PASSWORD}\n"))?;
        chown(&pwfile, owner)?;
        let mut cmd = Command::new(bin_dir.join("initdb"));
        cmd.arg("-D")
            .arg(scratch.join("data"))
            .args(["-U", SUPERUSER, "-E", "UTF8", "--locale=C", "--no-sync"])
            .args(["--auth-local=trust", "--auth-host=scram-sha-256"])
            .arg(format!("--pwfile={}", pwfile.display()))
            .current_dir(&scratch)
            .stdin(Stdio::null());
        clean_pg_env(&mut cmd);
        run_as(&mut cmd, owner);
        let out = cmd
            .output()
            .with_context(|| format!("run {}/initdb", bin_dir.display()))?;
        if !out.status.success() {
            bail!(
                "initdb failed ({}); if it says permission denied, run scripts/setup.sh so \
                 {PG_OS_USER} can reach {}:\n{}{}",
                out.status,
                bin_dir.display(),
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::fs::remove_file(&pwfile)?;
        std::fs::write(
            scratch.join("READY"),
            format!("{version}\n{}\n", canonical.display()),
        )?;
        if base.exists() {
            // A leftover without READY (such as a template a tmp cleaner emptied).
            std::fs::remove_dir_all(&base)?;
        }
        std::fs::rename(&scratch, &base)
            .with_context(|| format!("rename {} to {}", scratch.display(), base.display()))?;
        Ok(())
    })();
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&scratch);
    }
    result.map(|()| data)
}

fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

fn read_from(path: &Path, offset: u64) -> String {
    let mut text = Vec::new();
    if let Ok(mut f) = File::open(path) {
        let _ = f.seek(SeekFrom::Start(offset));
        let _ = f.read_to_end(&mut text);
    }
    String::from_utf8_lossy(&text).into_owned()
}

/// An SQL identifier in double quotes.
pub fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// An SQL string literal (standard_conforming_strings is on).
pub fn quote_literal(value: &str) -> String {
    format!("'{}'", value.replace('\'', "''"))
}

/// A libpq keyword value, quoted when needed.
fn dsn_value(value: &str) -> String {
    if !value.is_empty()
        && !value
            .chars()
            .any(|c| c.is_whitespace() || c == '\'' || c == '\\')
    {
        return value.to_string();
    }
    format!("'{}'", value.replace('\\', "\\\\").replace('\'', "\\'"))
}

fn percent_encode(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for b in value.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dsn_values_are_quoted_when_needed() {
        assert_eq!(dsn_value("alice"), "alice");
        assert_eq!(dsn_value(""), "''");
        assert_eq!(dsn_value("a b"), "'a b'");
        assert_eq!(dsn_value(r"it's\"), r"'it\'s\\'");
    }

    #[test]
    fn url_parts_are_percent_encoded() {
        assert_eq!(percent_encode("p@ss:w/rd"), "p%40ss%3Aw%2Frd");
        assert_eq!(percent_encode("a-b_c.d~e"), "a-b_c.d~e");
    }

    #[test]
    fn sql_quoting_doubles_quotes() {
        assert_eq!(quote_ident(r#"we"ird"#), r#""we""ird""#);
        assert_eq!(quote_literal("it's"), "'it''s'");
    }
}
