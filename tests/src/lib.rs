//! The test harness: it starts real things for LokaDB's integration tests and benchmarks.
//!
//! # Layout
//!
//! - [`pg`]: [`pg::Cluster`], a throwaway PostgreSQL cluster (PostgreSQL 18 from
//!   `<repo>/.pg/bin`, installed by `scripts/setup.sh`, or any bin dir in `LOKADB_PG_BIN`, such as
//!   Debian's `/usr/lib/postgresql/15/bin`). Runs as the unprivileged user `lokadb-pg` when the
//!   tests run as root.
//! - [`link`]: [`link::LatencyLink`], a userspace TCP forwarder that adds a one-way delay in each
//!   direction and can cut and restore the path (these machines' kernels have no netem). The
//!   `latency-link` binary (`src/bin/latency-link.rs`) runs one from the command line.
//! - [`proxy`]: [`proxy::Proxy`], the `lokadb` binary started with a JSON config; it waits for
//!   `lokadb proxy listening on HOST:PORT` and keeps the process's output.
//! - [`agent`]: [`agent::Agent`], the `lokadb-agent` binary; [`certs`]: a test CA and relay
//!   certificate.
//! - [`raw`]: [`raw::Raw`], a client that speaks the protocol by hand (what drivers hide).
//! - this file: [`repo_root`], [`free_port`], [`TempDir`] and the spawner that starts long-lived
//!   children so they die with the test process (`PR_SET_PDEATHSIG`).
//!
//! The integration tests themselves are in `tests/it/`, one binary.

pub mod agent;
pub mod certs;
pub mod link;
pub mod pg;
pub mod proxy;
pub mod raw;

use std::io;
use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, OnceLock};

/// The repository root: the parent of this crate's manifest directory.
pub fn repo_root() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let root = manifest.parent().unwrap_or(manifest);
    root.canonicalize().unwrap_or_else(|_| root.to_path_buf())
}

/// A TCP port on 127.0.0.1 that was free a moment ago (bound to :0, read, released).
///
/// Another process may take it before the caller binds it: callers that start servers retry.
pub fn free_port() -> u16 {
    TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("bind 127.0.0.1:0")
}

/// `127.0.0.1:port`.
pub fn localhost(port: u16) -> SocketAddr {
    SocketAddr::from((Ipv4Addr::LOCALHOST, port))
}

/// A directory under the system temp dir, removed with everything in it on drop.
#[derive(Debug)]
pub struct TempDir {
    path: PathBuf,
}

impl TempDir {
    /// Creates `<temp>/<prefix>-<pid>-<seq>-<random>`, mode 0700.
    pub fn new(prefix: &str) -> io::Result<TempDir> {
        let path = unique_temp_path(prefix);
        std::fs::create_dir(&path)?;
        set_mode(&path, 0o700)?;
        Ok(TempDir { path })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// `<temp>/<prefix>-<pid>-<seq>-<random>`; the pid lets a later run remove what a killed run
/// left behind (see [`remove_stale_temp_dirs`]).
pub(crate) fn unique_temp_path(prefix: &str) -> PathBuf {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let seq = SEQ.fetch_add(1, Ordering::Relaxed);
    std::env::temp_dir().join(format!(
        "{prefix}-{}-{seq}-{:08x}",
        std::process::id(),
        rand::random::<u32>()
    ))
}

/// Removes `<temp>/<prefix>-<pid>-...` entries whose process is gone.
pub(crate) fn remove_stale_temp_dirs(prefix: &str) {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    let lead = format!("{prefix}-");
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(&lead)) else {
            continue;
        };
        let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<i32>().ok()) else {
            continue;
        };
        if pid > 0 && !process_alive(pid) {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

pub(crate) fn process_alive(pid: i32) -> bool {
    // SAFETY: kill with signal 0 only checks for existence and permission.
    let rc = unsafe { libc::kill(pid, 0) };
    rc == 0 || io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

pub(crate) fn set_mode(path: &Path, mode: u32) -> io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
}

/// Sends `sig` to `pid`; errors (such as an already reaped process) are ignored.
pub(crate) fn signal(pid: u32, sig: libc::c_int) {
    // SAFETY: plain syscall on a pid we spawned.
    unsafe {
        libc::kill(pid as libc::pid_t, sig);
    }
}

/// Makes the child get `sig` when the thread that forked it dies (`PR_SET_PDEATHSIG`).
///
/// The kernel ties the signal to the forking *thread*, so spawn such children with
/// [`spawn_long_lived`], whose thread lives as long as the process.
pub(crate) fn die_with_parent(cmd: &mut Command, sig: libc::c_int) {
    // SAFETY: getpid is async-signal-safe; the closure only calls prctl and getppid, both
    // async-signal-safe, between fork and exec.
    let parent = unsafe { libc::getpid() };
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, sig as libc::c_ulong, 0, 0, 0) != 0 {
                return Err(io::Error::last_os_error());
            }
            if libc::getppid() != parent {
                return Err(io::Error::other("parent died before exec"));
            }
            Ok(())
        });
    }
}

type SpawnJob = (Command, mpsc::Sender<io::Result<Child>>);

/// Spawns `cmd` from a thread that lives as long as the process, so a `PR_SET_PDEATHSIG` set
/// with [`die_with_parent`] fires when the process ends, not when the calling test thread does
/// (a cluster shared by several tests outlives the test that started it).
pub fn spawn_long_lived(cmd: Command) -> io::Result<Child> {
    static SPAWNER: OnceLock<mpsc::Sender<SpawnJob>> = OnceLock::new();
    let spawner = SPAWNER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<SpawnJob>();
        std::thread::Builder::new()
            .name("lokadb-tests-spawner".into())
            .spawn(move || {
                for (mut cmd, reply) in rx {
                    let _ = reply.send(cmd.spawn());
                }
            })
            .expect("spawn the spawner thread");
        tx
    });
    let (reply_tx, reply_rx) = mpsc::channel();
    spawner
        .send((cmd, reply_tx))
        .map_err(|_| io::Error::other("spawner thread is gone"))?;
    reply_rx
        .recv()
        .map_err(|_| io::Error::other("spawner thread is gone"))?
}

/// A process's resident memory in KiB, from `/proc/PID/status`.
///
/// # Panics
///
/// If the process is gone or the file has no `VmRSS` line.
pub fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_else(|e| panic!("/proc/{pid}/status: {e}"))
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .expect("VmRSS in /proc/PID/status")
}

/// A TCP connection to `to` from the local address `from` (another loopback address than the
/// tests' own, e.g. `127.0.0.2:0`: per-address limits count it apart).
///
/// # Errors
///
/// The socket could not be made, bound or connected.
pub fn connect_from(from: &str, to: SocketAddr) -> io::Result<std::net::TcpStream> {
    use socket2::{Domain, Socket, Type};
    let s = Socket::new(Domain::IPV4, Type::STREAM, None)?;
    let from: SocketAddr = from
        .parse()
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, format!("{from}: {e}")))?;
    s.bind(&from.into())?;
    s.connect(&to.into())?;
    Ok(s.into())
}
