//! `link::LatencyLink`: delay precision, byte order, pipelining, backpressure, cut and restore.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use lokadb_tests::link::{LatencyLink, MAX_IN_FLIGHT};

/// Serializes this module's timing-sensitive and bulk tests, so they do not skew each other on a
/// 2-core machine.
fn exclusive() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A TCP echo server on 127.0.0.1:0 that counts the connections it accepted.
struct Echo {
    addr: SocketAddr,
    accepted: Arc<AtomicUsize>,
}

fn echo_server() -> Echo {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let accepted = Arc::new(AtomicUsize::new(0));
    let count = accepted.clone();
    thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { return };
            count.fetch_add(1, Ordering::SeqCst);
            conn.set_nodelay(true).unwrap();
            thread::spawn(move || {
                let mut buf = vec![0u8; 64 << 10];
                loop {
                    match conn.read(&mut buf) {
                        Ok(0) | Err(_) => return,
                        Ok(n) => {
                            if conn.write_all(&buf[..n]).is_err() {
                                return;
                            }
                        }
                    }
                }
            });
        }
    });
    Echo { addr, accepted }
}

/// A server that reads everything and answers with the byte count and FNV-1a hash at EOF.
fn hashing_sink() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { return };
            thread::spawn(move || {
                let mut buf = vec![0u8; 64 << 10];
                let (mut len, mut hash) = (0u64, Fnv::new());
                loop {
                    match conn.read(&mut buf) {
                        Ok(0) => break,
                        Ok(n) => {
                            len += n as u64;
                            hash.write(&buf[..n]);
                        }
                        Err(_) => return,
                    }
                }
                let _ = conn.write_all(format!("{len} {:016x}", hash.0).as_bytes());
            });
        }
    });
    addr
}

struct Fnv(u64);

impl Fnv {
    fn new() -> Fnv {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 ^= u64::from(*b);
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
}

/// Pseudo-random bytes (xorshift64 from a random seed): fast even in a debug build.
fn random_bytes(len: usize) -> Vec<u8> {
    let mut x = rand::random::<u64>() | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

fn connect(addr: SocketAddr) -> TcpStream {
    let s = TcpStream::connect(addr).unwrap();
    s.set_nodelay(true).unwrap();
    s
}

/// Median round trip of `n` 32-byte ping-pongs.
fn median_rtt(stream: &mut TcpStream, n: usize) -> Duration {
    let ping = [7u8; 32];
    let mut pong = [0u8; 32];
    let mut rtts: Vec<Duration> = (0..n)
        .map(|_| {
            let t = Instant::now();
            stream.write_all(&ping).unwrap();
            stream.read_exact(&mut pong).unwrap();
            let rtt = t.elapsed();
            assert_eq!(pong, ping);
            rtt
        })
        .collect();
    rtts.sort();
    eprintln!(
        "round trips: min {:?} median {:?} max {:?}",
        rtts[0],
        rtts[n / 2],
        rtts[n - 1]
    );
    rtts[n / 2]
}

/// Reads what arrives within `wait`: `Err(kind)` for a timeout, else the bytes (empty = EOF).
fn read_within(stream: &mut TcpStream, wait: Duration) -> Result<Vec<u8>, ErrorKind> {
    stream.set_read_timeout(Some(wait)).unwrap();
    let mut buf = [0u8; 1024];
    let r = stream.read(&mut buf);
    stream.set_read_timeout(None).unwrap();
    match r {
        Ok(n) => Ok(buf[..n].to_vec()),
        Err(e) => Err(e.kind()),
    }
}

/// Asserts that the median round trip is within `tolerance` of `expected`; a noisy 2-core
/// machine gets up to three rounds of 21 round trips.
fn assert_rtt_near(stream: &mut TcpStream, expected: Duration, tolerance: Duration) {
    let mut medians = Vec::new();
    for _ in 0..3 {
        let median = median_rtt(stream, 21);
        if median.abs_diff(expected) <= tolerance {
            return;
        }
        medians.push(median);
    }
    panic!("median round trips {medians:?} are not within {tolerance:?} of {expected:?}");
}

#[test]
fn round_trip_is_twice_the_one_way_delay() {
    let _serial = exclusive();
    let echo = echo_server();
    let link = LatencyLink::start(echo.addr, Duration::from_millis(10)).unwrap();
    let mut s = connect(link.addr());
    assert_rtt_near(&mut s, Duration::from_millis(20), Duration::from_millis(1));

    link.set_delay(Duration::from_millis(3));
    let _ = median_rtt(&mut s, 1); // the first one may straddle the change
    assert_rtt_near(&mut s, Duration::from_millis(6), Duration::from_millis(1));
}

#[test]
fn zero_delay_adds_under_a_millisecond() {
    let _serial = exclusive();
    let echo = echo_server();
    let link = LatencyLink::start(echo.addr, Duration::ZERO).unwrap();
    let mut s = connect(link.addr());
    let medians: Vec<Duration> = (0..3).map(|_| median_rtt(&mut s, 21)).collect();
    let best = *medians.iter().min().unwrap();
    assert!(best < Duration::from_millis(1), "medians {medians:?}");
}

#[test]
fn twenty_megabytes_echo_back_in_order() {
    let _serial = exclusive();
    const LEN: usize = 20 << 20;
    let echo = echo_server();
    let link = LatencyLink::start(echo.addr, Duration::from_millis(2)).unwrap();
    let data = Arc::new(random_bytes(LEN));
    let s = connect(link.addr());
    let mut writer = s.try_clone().unwrap();
    let sent = data.clone();
    let w = thread::spawn(move || {
        // Uneven writes, so chunk borders move around.
        for piece in sent.chunks(7919) {
            writer.write_all(piece).unwrap();
        }
    });
    let mut got = vec![0u8; LEN];
    let mut reader = s;
    reader.read_exact(&mut got).unwrap();
    w.join().unwrap();
    let (mut a, mut b) = (Fnv::new(), Fnv::new());
    a.write(&data);
    b.write(&got);
    assert_eq!(a.0, b.0, "checksums differ");
    assert!(got == *data, "bytes differ");
}

/// Sends `data` through `link` to the hashing sink and returns the reply and the time taken.
fn timed_transfer(link: &LatencyLink, data: &[u8]) -> (String, Duration) {
    let mut s = connect(link.addr());
    let t = Instant::now();
    s.write_all(data).unwrap();
    s.shutdown(std::net::Shutdown::Write).unwrap();
    let mut reply = String::new();
    s.read_to_string(&mut reply).unwrap();
    (reply, t.elapsed())
}

#[test]
fn transfer_is_pipelined_not_stop_and_wait() {
    let _serial = exclusive();
    const LEN: usize = 20 << 20;
    let one_way = Duration::from_millis(5);
    let sink = hashing_sink();
    let direct = LatencyLink::start(sink, Duration::ZERO).unwrap();
    let delayed = LatencyLink::start(sink, one_way).unwrap();
    let data = random_bytes(LEN);
    let mut hash = Fnv::new();
    hash.write(&data);
    let expected = format!("{LEN} {:016x}", hash.0);

    // Side by side, best of two, so a busy machine slows both alike.
    let (mut base, mut with_delay) = (Duration::MAX, Duration::MAX);
    for _ in 0..2 {
        let (reply, took) = timed_transfer(&direct, &data);
        assert_eq!(reply, expected);
        base = base.min(took);
        let (reply, took) = timed_transfer(&delayed, &data);
        assert_eq!(reply, expected);
        with_delay = with_delay.min(took);
    }
    eprintln!("{LEN} bytes: {base:?} without delay, {with_delay:?} with {one_way:?} one way");

    // Stop-and-wait would add the one-way delay at least once per 64 KiB read: 1.6 s here.
    let stop_and_wait = one_way * (LEN / (64 << 10)) as u32;
    let added = with_delay.saturating_sub(base);
    assert!(
        added < stop_and_wait / 4,
        "the delay added {added:?} ({base:?} -> {with_delay:?}); stop-and-wait adds {stop_and_wait:?}"
    );
    assert!(
        with_delay >= one_way * 2,
        "{with_delay:?} cannot beat the delay"
    );
}

#[test]
fn a_receiver_that_does_not_read_stops_the_sender() {
    let _serial = exclusive();
    // A server that accepts and never reads.
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let target = listener.local_addr().unwrap();
    let held = thread::spawn(move || listener.accept().unwrap().0);
    let link = LatencyLink::start(target, Duration::from_millis(1)).unwrap();
    let mut s = connect(link.addr());
    let _server_side = held.join().unwrap();

    s.set_write_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    let chunk = vec![1u8; 1 << 20];
    let mut written = 0usize;
    loop {
        match s.write(&chunk) {
            Ok(n) => written += n,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => break,
            Err(e) => panic!("write failed: {e}"),
        }
        assert!(
            written < 4 * MAX_IN_FLIGHT,
            "no backpressure after {written} bytes"
        );
    }
    // The link holds its cap; the rest sits in the four sockets' kernel buffers.
    assert!(written >= MAX_IN_FLIGHT, "stopped early at {written} bytes");
    assert!(
        written < MAX_IN_FLIGHT + (48 << 20),
        "{written} bytes accepted"
    );
}

#[test]
fn cut_holds_traffic_and_restore_resumes_it() {
    let echo = echo_server();
    let link = LatencyLink::start(echo.addr, Duration::from_millis(1)).unwrap();
    let mut before = connect(link.addr());
    before.write_all(b"hello").unwrap();
    assert_eq!(
        read_within(&mut before, Duration::from_secs(2)).unwrap(),
        b"hello"
    );
    assert_eq!(echo.accepted.load(Ordering::SeqCst), 1);

    link.cut();
    before.write_all(b"during cut").unwrap();
    let stalled = read_within(&mut before, Duration::from_millis(300));
    assert!(
        matches!(stalled, Err(ErrorKind::WouldBlock | ErrorKind::TimedOut)),
        "{stalled:?}"
    );
    // New connections are accepted but go nowhere.
    let mut during = connect(link.addr());
    during.write_all(b"new").unwrap();
    let stalled = read_within(&mut during, Duration::from_millis(300));
    assert!(
        matches!(stalled, Err(ErrorKind::WouldBlock | ErrorKind::TimedOut)),
        "{stalled:?}"
    );
    assert_eq!(echo.accepted.load(Ordering::SeqCst), 1);
    assert_eq!(link.accepted(), 2);

    link.restore();
    assert_eq!(
        read_within(&mut before, Duration::from_secs(2)).unwrap(),
        b"during cut"
    );
    assert_eq!(
        read_within(&mut during, Duration::from_secs(2)).unwrap(),
        b"new"
    );
    assert_eq!(echo.accepted.load(Ordering::SeqCst), 2);
    let mut after = connect(link.addr());
    after.write_all(b"after").unwrap();
    assert_eq!(
        read_within(&mut after, Duration::from_secs(2)).unwrap(),
        b"after"
    );
}

#[test]
fn reset_all_closes_current_connections_only() {
    let echo = echo_server();
    let link = LatencyLink::start(echo.addr, Duration::from_millis(1)).unwrap();
    let mut a = connect(link.addr());
    a.write_all(b"x").unwrap();
    assert_eq!(read_within(&mut a, Duration::from_secs(2)).unwrap(), b"x");
    assert_eq!(link.connections(), 1);

    link.reset_all();
    assert_eq!(read_within(&mut a, Duration::from_secs(2)).unwrap(), b"");
    let mut b = connect(link.addr());
    b.write_all(b"y").unwrap();
    assert_eq!(read_within(&mut b, Duration::from_secs(2)).unwrap(), b"y");
}

#[test]
fn dropping_the_link_closes_connections_and_the_listener() {
    let echo = echo_server();
    let link = LatencyLink::start(echo.addr, Duration::from_millis(1)).unwrap();
    let addr = link.addr();
    let mut a = connect(addr);
    a.write_all(b"x").unwrap();
    assert_eq!(read_within(&mut a, Duration::from_secs(2)).unwrap(), b"x");
    drop(link);
    assert_eq!(read_within(&mut a, Duration::from_secs(2)).unwrap(), b"");
    assert!(TcpStream::connect(addr).is_err());
}
