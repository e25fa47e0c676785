//! A userspace latency link: a TCP forwarder that adds a one-way delay in each direction.
//!
//! These machines' kernels have no netem, so distance is made here. Each accepted connection
//! gets a connection to the target and two directions; each direction is a pipeline of two
//! threads: a reader stamps every chunk with `arrival time + delay` and queues it, a writer sleeps
//! until a chunk is due and writes it. The arrival time is the kernel's receive timestamp
//! (SO_TIMESTAMPNS), so the time the reader takes to wake up is part of the delay rather than
//! added to it, and the writer wakes early by its own measured wake-up lateness: on an idle
//! machine (deep CPU idle states) each wake-up costs a few hundred microseconds, which would
//! otherwise add up to a millisecond per round trip. Bytes keep their order and many chunks are in flight at
//! once (the link never waits for one chunk to arrive before reading the next), up to
//! [`MAX_IN_FLIGHT`] bytes per direction, beyond which the reader stops reading (backpressure
//! through TCP flow control). Plain threads and `thread::sleep` give sub-millisecond precision,
//! which tokio's 1 ms timer does not.
//!
//! [`LatencyLink::cut`] acts as a network partition: no byte is forwarded either way and new
//! connections are accepted (the kernel completes the handshake) but not connected onward; no
//! connection is reset. Bytes already read are held, as TCP's retransmissions would hold them.
//! [`LatencyLink::restore`] heals the partition: held bytes and held new connections go on (a
//! peer that gave up meanwhile closes its side and the link closes the other).
//! [`LatencyLink::reset_all`] closes every current connection.

use std::collections::HashMap;
use std::io::{self, Write};
use std::net::{Ipv4Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

/// Bytes one direction of one connection may hold in flight before the reader stops reading.
pub const MAX_IN_FLIGHT: usize = 32 << 20;
const CHUNK: usize = 64 << 10;
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
const THREAD_STACK: usize = 256 << 10;

/// A running link; dropping it closes the listener and every connection.
pub struct LatencyLink {
    addr: SocketAddr,
    target: SocketAddr,
    shared: Arc<Shared>,
    acceptor: Option<JoinHandle<()>>,
}

struct Shared {
    delay_nanos: AtomicU64,
    stopping: AtomicBool,
    /// True while cut; threads that must not forward wait on `cut_changed`.
    cut: Mutex<bool>,
    cut_changed: Condvar,
    /// When the last cut ended: held chunks are due no earlier than this plus the delay.
    restored_at: Mutex<Option<Instant>>,
    conns: Mutex<HashMap<u64, Vec<TcpStream>>>,
    next_id: AtomicU64,
    accepted: AtomicU64,
}

impl Shared {
    fn delay(&self) -> Duration {
        Duration::from_nanos(self.delay_nanos.load(Ordering::Relaxed))
    }

    fn stopping(&self) -> bool {
        self.stopping.load(Ordering::Acquire)
    }

    /// Blocks while the link is cut; returns whether it had to wait.
    fn wait_while_cut(&self) -> bool {
        let mut cut = self.cut.lock().unwrap();
        let mut waited = false;
        while *cut && !self.stopping() {
            waited = true;
            cut = self.cut_changed.wait(cut).unwrap();
        }
        waited
    }

    fn register(&self, id: u64, sockets: Vec<TcpStream>) {
        self.conns.lock().unwrap().insert(id, sockets);
    }

    fn close(&self, id: u64) {
        if let Some(sockets) = self.conns.lock().unwrap().remove(&id) {
            for s in sockets {
                let _ = s.shutdown(Shutdown::Both);
            }
        }
    }
}

impl LatencyLink {
    /// Listens on 127.0.0.1:0 and forwards to `target` with `one_way` delay in each direction.
    pub fn start(target: SocketAddr, one_way: Duration) -> io::Result<LatencyLink> {
        Self::start_on(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)), target, one_way)
    }

    /// Like [`LatencyLink::start`] on a chosen listen address.
    pub fn start_on(
        listen: SocketAddr,
        target: SocketAddr,
        one_way: Duration,
    ) -> io::Result<LatencyLink> {
        let listener = TcpListener::bind(listen)?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            delay_nanos: AtomicU64::new(one_way.as_nanos() as u64),
            stopping: AtomicBool::new(false),
            cut: Mutex::new(false),
            cut_changed: Condvar::new(),
            restored_at: Mutex::new(None),
            conns: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(0),
            accepted: AtomicU64::new(0),
        });
        let acceptor = {
            let shared = shared.clone();
            thread::Builder::new()
                .name(format!("link-accept-{}", addr.port()))
                .spawn(move || accept_loop(listener, target, shared))?
        };
        Ok(LatencyLink {
            addr,
            target,
            shared,
            acceptor: Some(acceptor),
        })
    }

    /// The address clients connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn target(&self) -> SocketAddr {
        self.target
    }

    pub fn delay(&self) -> Duration {
        self.shared.delay()
    }

    /// Changes the one-way delay for bytes read from now on (order is kept either way).
    pub fn set_delay(&self, one_way: Duration) {
        self.shared
            .delay_nanos
            .store(one_way.as_nanos() as u64, Ordering::Relaxed);
    }

    /// Partitions the link: nothing is forwarded, new connections are accepted and held.
    pub fn cut(&self) {
        *self.shared.cut.lock().unwrap() = true;
    }

    /// Heals a [`cut`](Self::cut): held bytes and connections go on.
    pub fn restore(&self) {
        *self.shared.restored_at.lock().unwrap() = Some(Instant::now());
        *self.shared.cut.lock().unwrap() = false;
        self.shared.cut_changed.notify_all();
    }

    pub fn is_cut(&self) -> bool {
        *self.shared.cut.lock().unwrap()
    }

    /// Closes every current connection (both sides see EOF); new connections are served.
    pub fn reset_all(&self) {
        let all: Vec<u64> = self.shared.conns.lock().unwrap().keys().copied().collect();
        for id in all {
            self.shared.close(id);
        }
    }

    /// Connections currently open through the link (including held ones).
    pub fn connections(&self) -> usize {
        self.shared.conns.lock().unwrap().len()
    }

    /// Connections accepted since start.
    pub fn accepted(&self) -> u64 {
        self.shared.accepted.load(Ordering::Relaxed)
    }
}

impl Drop for LatencyLink {
    fn drop(&mut self) {
        self.shared.stopping.store(true, Ordering::Release);
        {
            let _guard = self.shared.cut.lock().unwrap();
            self.shared.cut_changed.notify_all();
        }
        self.reset_all();
        // Wake the acceptor, blocked in accept().
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
        if let Some(acceptor) = self.acceptor.take() {
            let _ = acceptor.join();
        }
        self.reset_all();
    }
}

impl std::fmt::Debug for LatencyLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LatencyLink")
            .field("addr", &self.addr)
            .field("target", &self.target)
            .field("delay", &self.delay())
            .field("cut", &self.is_cut())
            .finish()
    }
}

fn spawn_named(name: String, f: impl FnOnce() + Send + 'static) {
    let _ = thread::Builder::new()
        .name(name)
        .stack_size(THREAD_STACK)
        .spawn(f);
}

fn accept_loop(listener: TcpListener, target: SocketAddr, shared: Arc<Shared>) {
    loop {
        let client = match listener.accept() {
            Ok((client, _)) => client,
            Err(_) if shared.stopping() => return,
            Err(_) => {
                thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        if shared.stopping() {
            return;
        }
        shared.accepted.fetch_add(1, Ordering::Relaxed);
        let id = shared.next_id.fetch_add(1, Ordering::Relaxed);
        let Ok(client_ctl) = client.try_clone() else {
            continue;
        };
        shared.register(id, vec![client_ctl]);
        let shared = shared.clone();
        spawn_named(format!("link-conn-{id}"), move || {
            connect_onward(id, client, target, shared)
        });
    }
}

/// Waits out a cut, connects to the target and starts both directions.
fn connect_onward(id: u64, client: TcpStream, target: SocketAddr, shared: Arc<Shared>) {
    shared.wait_while_cut();
    if shared.stopping() || !shared.conns.lock().unwrap().contains_key(&id) {
        return;
    }
    let server = match TcpStream::connect_timeout(&target, CONNECT_TIMEOUT) {
        Ok(s) => s,
        Err(_) => {
            shared.close(id);
            return;
        }
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (Ok(client2), Ok(server2), Ok(server_ctl)) =
        (client.try_clone(), server.try_clone(), server.try_clone())
    else {
        shared.close(id);
        return;
    };
    {
        let mut conns = shared.conns.lock().unwrap();
        match conns.get_mut(&id) {
            // reset_all ran while we connected.
            None => {
                let _ = server.shutdown(Shutdown::Both);
                return;
            }
            Some(sockets) => sockets.push(server_ctl),
        }
    }
    let open_dirs = Arc::new(AtomicU64::new(2));
    start_direction(id, "up", client, server, shared.clone(), open_dirs.clone());
    start_direction(id, "down", server2, client2, shared, open_dirs);
}

enum Item {
    Data(Instant, Vec<u8>),
    Eof(Instant),
}

struct InFlight {
    bytes: Mutex<usize>,
    changed: Condvar,
}

fn start_direction(
    id: u64,
    name: &str,
    src: TcpStream,
    mut dst: TcpStream,
    shared: Arc<Shared>,
    open_dirs: Arc<AtomicU64>,
) {
    let (tx, rx) = mpsc::channel::<Item>();
    let in_flight = Arc::new(InFlight {
        bytes: Mutex::new(0),
        changed: Condvar::new(),
    });
    let writer_gone = Arc::new(AtomicBool::new(false));

    {
        let shared = shared.clone();
        let in_flight = in_flight.clone();
        let writer_gone = writer_gone.clone();
        spawn_named(format!("link-{id}-{name}-r"), move || {
            let mut buf = vec![0u8; CHUNK];
            enable_rx_timestamps(&src);
            loop {
                shared.wait_while_cut();
                if shared.stopping() || writer_gone.load(Ordering::Acquire) {
                    return;
                }
                let (n, arrived) = match read_stamped(&src, &mut buf) {
                    Ok(read) => read,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(_) => (0, Instant::now()),
                };
                let due = arrived + shared.delay();
                if n == 0 {
                    let _ = tx.send(Item::Eof(due));
                    return;
                }
                {
                    let mut bytes = in_flight.bytes.lock().unwrap();
                    while *bytes + n > MAX_IN_FLIGHT && *bytes > 0 {
                        if writer_gone.load(Ordering::Acquire) || shared.stopping() {
                            return;
                        }
                        bytes = in_flight
                            .changed
                            .wait_timeout(bytes, Duration::from_millis(100))
                            .unwrap()
                            .0;
                    }
                    *bytes += n;
                }
                if tx.send(Item::Data(due, buf[..n].to_vec())).is_err() {
                    return;
                }
            }
        });
    }

    spawn_named(format!("link-{id}-{name}-w"), move || {
        tight_timer_slack();
        let mut wake = WakeCompensation::default();
        let finish = |shared: &Shared| {
            writer_gone.store(true, Ordering::Release);
            in_flight.changed.notify_all();
            if open_dirs.fetch_sub(1, Ordering::AcqRel) == 1 {
                shared.close(id);
            }
        };
        for item in rx {
            let due = match &item {
                Item::Data(due, _) | Item::Eof(due) => *due,
            };
            let mut due = due;
            if shared.wait_while_cut() {
                if let Some(at) = *shared.restored_at.lock().unwrap() {
                    due = due.max(at + shared.delay());
                }
            }
            if shared.stopping() {
                break;
            }
            wake.sleep_until(due);
            match item {
                Item::Data(_, bytes) => {
                    let n = bytes.len();
                    if dst.write_all(&bytes).is_err() {
                        // The receiver is gone: close the whole connection.
                        finish(&shared);
                        shared.close(id);
                        return;
                    }
                    *in_flight.bytes.lock().unwrap() -= n;
                    in_flight.changed.notify_all();
                }
                Item::Eof(_) => {
                    let _ = dst.shutdown(Shutdown::Write);
                    break;
                }
            }
        }
        finish(&shared);
    });
}

/// Most of its wake-up lateness the writer learns and subtracts from its next sleep.
const MAX_WAKE_COMPENSATION: Duration = Duration::from_millis(1);
/// Older receive timestamps mean bytes queued behind backpressure or a cut, not a slow wake-up.
const MAX_ARRIVAL_AGE: Duration = Duration::from_millis(2);

/// The writer's running estimate of how late its sleeps end (an average over about 8 sleeps).
#[derive(Default)]
struct WakeCompensation {
    lateness: Duration,
}

impl WakeCompensation {
    /// Sleeps until about `due`: until `due` less the learned lateness, which it then updates
    /// with this sleep's. No spinning: on a busy 2-core machine that would take the CPU from
    /// the processes whose latency is being measured.
    fn sleep_until(&mut self, due: Instant) {
        let target = due.checked_sub(self.lateness).unwrap_or(due);
        let mut slept = false;
        loop {
            let now = Instant::now();
            if now >= target {
                if slept {
                    let late = (now - target).min(MAX_WAKE_COMPENSATION);
                    self.lateness = (self.lateness * 7 + late) / 8;
                }
                return;
            }
            thread::sleep(target - now);
            slept = true;
        }
    }
}

/// Asks the kernel to timestamp what this socket receives (read back by [`read_stamped`]).
fn enable_rx_timestamps(socket: &TcpStream) {
    let on: libc::c_int = 1;
    // SAFETY: a valid socket descriptor and a c_int option value of the size passed.
    unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            SO_TIMESTAMPNS,
            (&on as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        );
    }
}

/// SO_TIMESTAMPNS (the "old" 64-bit-time variant on x86_64 and aarch64); its control message
/// type SCM_TIMESTAMPNS has the same value.
const SO_TIMESTAMPNS: libc::c_int = 35;

/// Reads into `buf`, returning the byte count and when the kernel received the last of them
/// (now, if the socket gave no timestamp or an implausible one).
fn read_stamped(socket: &TcpStream, buf: &mut [u8]) -> io::Result<(usize, Instant)> {
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    let mut control = [0u64; 8];
    // SAFETY: msghdr is plain data; all-zero is a valid empty header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&control) as _;
    // SAFETY: msg points at live buffers of the lengths it states.
    let n = unsafe { libc::recvmsg(socket.as_raw_fd(), &mut msg, 0) };
    let now = Instant::now();
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut arrived = now;
    // SAFETY: the CMSG_* walk stays within msg_control as the kernel filled it.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == SO_TIMESTAMPNS {
                let stamp: libc::timespec =
                    std::ptr::read_unaligned(libc::CMSG_DATA(cmsg).cast::<libc::timespec>());
                if let Some(age) = realtime_age(&stamp).filter(|age| *age <= MAX_ARRIVAL_AGE) {
                    arrived = now - age;
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    Ok((n as usize, arrived))
}

/// How long ago a CLOCK_REALTIME instant was; `None` if it lies in the future (a clock step).
fn realtime_age(stamp: &libc::timespec) -> Option<Duration> {
    // SAFETY: timespec is plain data; clock_gettime fills it.
    let mut now: libc::timespec = unsafe { std::mem::zeroed() };
    unsafe { libc::clock_gettime(libc::CLOCK_REALTIME, &mut now) };
    let nanos = |t: &libc::timespec| t.tv_sec as i128 * 1_000_000_000 + t.tv_nsec as i128;
    u64::try_from(nanos(&now) - nanos(stamp))
        .ok()
        .map(Duration::from_nanos)
}

/// Asks the kernel to wake this thread's sleeps on time (default slack: 50 µs).
fn tight_timer_slack() {
    // SAFETY: PR_SET_TIMERSLACK only changes the calling thread's timer slack.
    unsafe {
        libc::prctl(libc::PR_SET_TIMERSLACK, 1_000 as libc::c_ulong, 0, 0, 0);
    }
}
