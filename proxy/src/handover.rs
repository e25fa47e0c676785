//! Restarts without refusing a client: a new process takes over the running one's
//! listening sockets over a Unix socket (`"handover"` in the config), so no connection
//! finds a port nobody listens on, and the old one then drains as on SIGTERM.
//!
//! The exchange, on the Unix socket the running process listens on:
//! 1. the new process connects and sends `TAKE 1\n`;
//! 2. the old one answers with one message: a JSON header saying which listener each
//!    descriptor is, and the descriptors themselves (SCM_RIGHTS);
//! 3. the new process accepts on them and sends `READY\n`; only then does the old one stop
//!    accepting and drain. Had the new process died before step 3, the old one goes on.
//!
//! The sockets are the same kernel objects in both processes: connections queued on
//! them are accepted by whichever process asks first, and none is lost when the old
//! process closes its copies.
//!
//! 4. the connection stays open while the old process drains: a client of a draining
//!    session cancels through the listening socket, which the new process serves now; a
//!    key it does not know it sends on as `CANCEL <pid> <secret in hex>\n`, and the old
//!    process hands it to its cores (which send it to the backend, if one of theirs has
//!    it). It goes no further, so a cancel never loops.

use anyhow::Context as _;
use sendfd::{RecvWithFd, SendWithFd};
use serde::{Deserialize, Serialize};
use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

const TAKE: &str = "TAKE 1\n";
const READY: &str = "READY\n";
/// Most descriptors one handover carries (cores' listeners, metrics, the relay's two).
const MAX_FDS: usize = 256;
/// How long each side waits for the other's next step.
const STEP_TIMEOUT: Duration = Duration::from_secs(10);
/// How often the waiting side looks at the shutdown flag.
const POLL: Duration = Duration::from_millis(50);

/// The listening sockets a process hands over.
#[derive(Default)]
pub struct Listeners {
    /// The client listener, one socket per core of the process that bound them.
    pub proxy: Vec<OwnedFd>,
    /// `GET /metrics`.
    pub metrics: Option<OwnedFd>,
    /// The relay's agent listener and its Postgres listener.
    pub relay: Option<(OwnedFd, OwnedFd)>,
}

/// What the header says of the descriptors that follow it, in this order: `proxy` client
/// listeners, then the metrics listener, then the relay's agents and Postgres listeners.
#[derive(Serialize, Deserialize)]
struct Header {
    proxy: usize,
    metrics: bool,
    relay: bool,
}

impl Listeners {
    fn header(&self) -> Header {
        Header {
            proxy: self.proxy.len(),
            metrics: self.metrics.is_some(),
            relay: self.relay.is_some(),
        }
    }

    fn raw(&self) -> Vec<RawFd> {
        let mut fds: Vec<RawFd> = self.proxy.iter().map(AsRawFd::as_raw_fd).collect();
        fds.extend(self.metrics.as_ref().map(AsRawFd::as_raw_fd));
        if let Some((a, p)) = &self.relay {
            fds.extend([a.as_raw_fd(), p.as_raw_fd()]);
        }
        fds
    }
}

/// A copy of `fd` (close-on-exec), owned.
///
/// # Errors
///
/// Out of descriptors.
pub fn dup(fd: RawFd) -> std::io::Result<OwnedFd> {
    // SAFETY: fcntl on a descriptor this process holds; the result is a new descriptor.
    let copy = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
    if copy < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `copy` was just created and is owned by no one else.
    Ok(unsafe { OwnedFd::from_raw_fd(copy) })
}

/// The listeners taken from a running process, and the way to tell it to drain.
pub struct Taken {
    /// The sockets, for this process to accept on.
    pub listeners: Listeners,
    conn: UnixStream,
}

impl Taken {
    /// Tells the old process this one accepts now: it stops accepting and drains. Returns
    /// the way to hand it cancels for its sessions meanwhile.
    pub fn ready(mut self) -> Option<Predecessor> {
        if let Err(e) = self.conn.write_all(READY.as_bytes()) {
            tracing::warn!(error = %e, "handover: the old process did not hear READY; it goes on serving beside this one");
            return None;
        }
        // A cancel is a few bytes into a socket buffer nobody else writes: a peer that
        // stopped reading costs a core at most this long, once.
        self.conn
            .set_write_timeout(Some(CANCEL_WRITE_TIMEOUT))
            .ok()?;
        Some(Predecessor { conn: self.conn })
    }
}

/// How long sending a cancel to the predecessor may block.
const CANCEL_WRITE_TIMEOUT: Duration = Duration::from_millis(100);
/// The longest line the predecessor reads from its successor (a `CANCEL` line is shorter).
const CANCEL_LINE_MAX: usize = 64;

/// The draining process this one took its sockets from.
pub struct Predecessor {
    conn: UnixStream,
}

impl Predecessor {
    /// Hands it a cancel key no session here has. `false`: it is gone (drained and exited).
    pub fn cancel(&mut self, pid: u32, secret: &[u8]) -> bool {
        let hex: String = secret.iter().map(|b| format!("{b:02x}")).collect();
        self.conn
            .write_all(format!("CANCEL {pid} {hex}\n").as_bytes())
            .is_ok()
    }
}

/// A `CANCEL` line from the successor: the key's process ID and secret.
fn cancel_line(line: &str) -> Option<(u32, Vec<u8>)> {
    let mut words = line.strip_suffix('\n')?.split(' ');
    let (verb, pid, hex) = (words.next()?, words.next()?, words.next()?);
    if verb != "CANCEL" || words.next().is_some() || hex.len() % 2 != 0 || hex.len() > 16 {
        return None;
    }
    let secret = (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).ok())
        .collect::<Option<Vec<u8>>>()?;
    Some((pid.parse().ok()?, secret))
}

/// What the old process does with a cancel the successor could not place.
pub type OnCancel = Box<dyn Fn(u32, Vec<u8>) + Send>;

/// Takes the listeners of the process listening at `path`, when the config names one.
///
/// # Errors
///
/// As [`take`].
pub fn take_from(path: Option<&Path>) -> anyhow::Result<Option<Taken>> {
    let Some(path) = path else { return Ok(None) };
    let taken = take(path)?;
    if let Some(t) = &taken {
        tracing::info!(
            sockets = t.listeners.proxy.len(),
            relay = t.listeners.relay.is_some(),
            "handover: took the listening sockets of the running process"
        );
    }
    Ok(taken)
}

/// Takes the listeners of the process listening at `path`; `None` when none does (no
/// socket there, or one a process left behind).
///
/// # Errors
///
/// A process answered but the exchange failed (it keeps serving; this one should not
/// start beside it).
pub fn take(path: &Path) -> anyhow::Result<Option<Taken>> {
    let mut conn = match UnixStream::connect(path) {
        Ok(c) => c,
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused
            ) =>
        {
            return Ok(None)
        }
        Err(e) => {
            return Err(e)
                .with_context(|| format!("handover: cannot connect to {}", path.display()))
        }
    };
    conn.set_read_timeout(Some(STEP_TIMEOUT))?;
    conn.write_all(TAKE.as_bytes())?;
    let mut bytes = vec![0u8; 4096];
    let mut raw = vec![-1; MAX_FDS];
    let (n, count) = conn
        .recv_with_fd(&mut bytes, &mut raw)
        .with_context(|| format!("handover: no answer from the process at {}", path.display()))?;
    // Owned at once, so every descriptor is closed whatever goes wrong below.
    let mut fds = raw[..count]
        .iter()
        .map(|&fd| {
            // SAFETY: SCM_RIGHTS made these descriptors for this process.
            let fd = unsafe { OwnedFd::from_raw_fd(fd) };
            // SAFETY: setting a flag on a descriptor we own.
            unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFD, libc::FD_CLOEXEC) };
            fd
        })
        .collect::<Vec<_>>()
        .into_iter();
    let header: Header = serde_json::from_slice(&bytes[..n])
        .with_context(|| format!("handover: the process at {} sent no header", path.display()))?;
    let wanted = header.proxy + usize::from(header.metrics) + 2 * usize::from(header.relay);
    anyhow::ensure!(
        wanted == count,
        "handover: the header names {wanted} sockets, {count} came"
    );
    let listeners = Listeners {
        proxy: fds.by_ref().take(header.proxy).collect(),
        metrics: header.metrics.then(|| fds.next()).flatten(),
        relay: if header.relay {
            fds.next().zip(fds.next())
        } else {
            None
        },
    };
    conn.set_read_timeout(None)?;
    Ok(Some(Taken { listeners, conn }))
}

/// Listens at `path` for the next process: it gets copies of `listeners`, and once it
/// says it accepts, `shutdown` is raised (the drain, as on SIGTERM) and this process stops
/// listening there. When `shutdown` is raised otherwise (SIGTERM), the copies are closed at
/// once, so a drain without a successor leaves no listening socket nobody accepts on. A
/// socket that cannot be made at `path` is logged: this process serves on without it.
pub fn offer(
    path: PathBuf,
    listeners: Listeners,
    shutdown: Arc<AtomicBool>,
    on_cancel: Option<OnCancel>,
) {
    if let Err(e) = serve(path, listeners, shutdown, on_cancel) {
        tracing::error!(
            error = format!("{e:#}"),
            "handover: the next process will not find this one; its start will bind the ports anew"
        );
    }
}

fn serve(
    path: PathBuf,
    listeners: Listeners,
    shutdown: Arc<AtomicBool>,
    on_cancel: Option<OnCancel>,
) -> anyhow::Result<()> {
    // A socket left there (by the process that handed over to us, or one that crashed).
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path)
        .with_context(|| format!("handover: cannot listen at {}", path.display()))?;
    // Only this user's processes may take the sockets.
    std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o600))?;
    listener.set_nonblocking(true)?;
    std::thread::Builder::new()
        .name("lokadb-handover".into())
        .spawn(move || loop {
            if shutdown.load(Ordering::Relaxed) {
                return drop(listeners);
            }
            let conn = match listener.accept() {
                Ok((conn, _)) => conn,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    std::thread::sleep(POLL);
                    continue;
                }
                Err(_) => {
                    std::thread::sleep(POLL);
                    continue;
                }
            };
            let _ = conn.set_nonblocking(false);
            match hand_over(&conn, &listeners) {
                Ok(reader) => {
                    tracing::info!(path = %path.display(), "handover: the new process accepts on our sockets; draining");
                    shutdown.store(true, Ordering::Relaxed);
                    drop(listeners);
                    if let Some(on_cancel) = &on_cancel {
                        serve_cancels(reader, on_cancel);
                    }
                    return;
                }
                Err(e) => tracing::warn!(error = format!("{e:#}"), "handover: a process asked for the sockets and did not take them; serving on"),
            }
        })?;
    Ok(())
}

fn hand_over<'c>(
    conn: &'c UnixStream,
    listeners: &Listeners,
) -> anyhow::Result<BufReader<&'c UnixStream>> {
    conn.set_read_timeout(Some(STEP_TIMEOUT))?;
    let mut reader = BufReader::new(conn);
    let mut line = String::new();
    reader.read_line(&mut line)?;
    anyhow::ensure!(line == TAKE, "it asked {line:?}, not {TAKE:?}");
    let header = serde_json::to_vec(&listeners.header())?;
    conn.send_with_fd(&header, &listeners.raw())?;
    line.clear();
    reader.read_line(&mut line)?;
    anyhow::ensure!(line == READY, "it did not say READY (it said {line:?})");
    Ok(reader)
}

/// While this process drains: the successor's `CANCEL` lines, each handed to `on_cancel`,
/// until it closes the connection (it exited or handed over in turn) or this process exits.
fn serve_cancels(mut reader: BufReader<&UnixStream>, on_cancel: &OnCancel) {
    let _ = reader.get_ref().set_read_timeout(None);
    let mut line = String::new();
    loop {
        line.clear();
        // A line longer than any CANCEL is not one: the successor is not ours to trust
        // blindly, but it is this user's process; stop listening to it.
        match std::io::Read::take(&mut reader, CANCEL_LINE_MAX as u64).read_line(&mut line) {
            Ok(0) | Err(_) => return,
            Ok(_) => match cancel_line(&line) {
                Some((pid, secret)) => {
                    tracing::debug!(pid, "handover: a cancel request from the new process");
                    on_cancel(pid, secret);
                }
                None => {
                    tracing::warn!("handover: the new process sent a line that is not a cancel; no more cancels from it");
                    return;
                }
            },
        }
    }
}

/// A TCP listener from a taken descriptor, checked against the address the config asks
/// for (port 0 takes any).
///
/// # Errors
///
/// It is not a listening TCP socket on that address.
pub fn tcp_listener(fd: OwnedFd, wanted: SocketAddr) -> anyhow::Result<TcpListener> {
    let listener = TcpListener::from(fd);
    let bound = listener.local_addr()?;
    anyhow::ensure!(
        same_address(bound, wanted),
        "the socket handed over listens on {bound}, the config asks for {wanted}"
    );
    Ok(listener)
}

/// Whether a socket bound to `bound` serves the configured `wanted` (port 0: any).
pub fn same_address(bound: SocketAddr, wanted: SocketAddr) -> bool {
    wanted.port() == 0 || bound == wanted
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    #[test]
    fn the_sockets_cross_to_a_new_process_and_the_old_one_hears_ready() {
        let dir = std::env::temp_dir().join(format!("lokadb-handover-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("h.sock");
        assert!(take(&path).unwrap().is_none(), "nobody listens yet");

        let a = TcpListener::bind("127.0.0.1:0").unwrap();
        let m = TcpListener::bind("127.0.0.1:0").unwrap();
        let (ra, rp) = (
            TcpListener::bind("127.0.0.1:0").unwrap(),
            TcpListener::bind("127.0.0.1:0").unwrap(),
        );
        let addr = a.local_addr().unwrap();
        let ours = Listeners {
            proxy: vec![dup(a.as_raw_fd()).unwrap()],
            metrics: Some(dup(m.as_raw_fd()).unwrap()),
            relay: Some((dup(ra.as_raw_fd()).unwrap(), dup(rp.as_raw_fd()).unwrap())),
        };
        let shutdown = Arc::new(AtomicBool::new(false));
        let cancels = Arc::new(Mutex::new(Vec::new()));
        let seen = cancels.clone();
        let on_cancel: OnCancel =
            Box::new(move |pid, secret| seen.lock().unwrap().push((pid, secret)));
        serve(path.clone(), ours, shutdown.clone(), Some(on_cancel)).unwrap();
        let drains = |within: Duration| {
            let deadline = std::time::Instant::now() + within;
            while std::time::Instant::now() < deadline {
                if shutdown.load(Ordering::Relaxed) {
                    return true;
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            false
        };

        let taken = take(&path).unwrap().expect("the running one answers");
        assert_eq!(taken.listeners.proxy.len(), 1);
        assert!(taken.listeners.metrics.is_some() && taken.listeners.relay.is_some());
        assert!(!drains(Duration::from_millis(200)), "no drain before READY");
        // A connection queued on the old socket is accepted through the new descriptor.
        let _client = std::net::TcpStream::connect(addr).unwrap();
        let Taken { listeners, conn } = taken;
        let taker = tcp_listener(listeners.proxy.into_iter().next().unwrap(), addr).unwrap();
        taker.accept().unwrap();
        let mut predecessor = Taken {
            listeners: Listeners::default(),
            conn,
        }
        .ready()
        .expect("READY heard");
        assert!(drains(STEP_TIMEOUT), "the old process drains after READY");
        // A cancel the new process could not place reaches the old one's cores.
        assert!(predecessor.cancel(4242, &[0xde, 0xad, 0xbe, 0xef]));
        let deadline = std::time::Instant::now() + STEP_TIMEOUT;
        while cancels.lock().unwrap().is_empty() && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(
            *cancels.lock().unwrap(),
            vec![(4242, vec![0xde, 0xad, 0xbe, 0xef])]
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn cancel_lines_are_read_strictly() {
        assert_eq!(
            cancel_line("CANCEL 7 0a0b0c0d\n"),
            Some((7, vec![10, 11, 12, 13]))
        );
        for bad in [
            "CANCEL 7 0a0b0c0d",
            "CANCEL x 0a0b\n",
            "CANCEL 7 0a0\n",
            "CANCEL 7 zz\n",
            "CANCEL 7 0a 0b\n",
            "TAKE 1\n",
            "CANCEL 7 000000000000000000\n",
        ] {
            assert_eq!(cancel_line(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_socket_for_another_address_is_not_used() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let bound = l.local_addr().unwrap();
        let other: SocketAddr = "127.0.0.1:1".parse().unwrap();
        assert!(tcp_listener(OwnedFd::from(l), other).is_err());
        assert!(same_address(bound, "0.0.0.0:0".parse().unwrap()));
    }
}
