//! A userspace latency link: a TCP forwarder that adds a one-way delay in each direction.
//!
//! These machines' kernels have no netem, so distance is made here. Each accepted connection
//! gets a connection to the target and two directions; each direction is a pipeline of two
//! threads: a reader stamps every chunk with `read time + delay` and queues it, a writer sleeps
//! until a chunk is due and writes it. Bytes keep their order and many chunks are in flight at
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
use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
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
    mut src: TcpStream,
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
            loop {
                shared.wait_while_cut();
                if shared.stopping() || writer_gone.load(Ordering::Acquire) {
                    return;
                }
                let n = match src.read(&mut buf) {
                    Ok(n) => n,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(_) => 0,
                };
                let due = Instant::now() + shared.delay();
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
            sleep_until(due);
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

/// Sleeps until `due`. With the writer's timer slack at 1 µs the wakeup is on time; no
/// yield-spinning, which on a busy machine would give the CPU away for a whole scheduler tick.
fn sleep_until(due: Instant) {
    loop {
        let now = Instant::now();
        if now >= due {
            return;
        }
        thread::sleep(due - now);
    }
}

/// Asks the kernel to wake this thread's sleeps on time (default slack: 50 µs).
fn tight_timer_slack() {
    // SAFETY: PR_SET_TIMERSLACK only changes the calling thread's timer slack.
    unsafe {
        libc::prctl(libc::PR_SET_TIMERSLACK, 1_000 as libc::c_ulong, 0, 0, 0);
    }
}
