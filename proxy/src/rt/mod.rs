//! The per-core runtime: one thread per core, each with its own io_uring and its own
//! task queue. Nothing in it is shared between threads.
//!
//! # Why not glommio
//!
//! The proxy first ran on glommio. Measured on this project's machines
//! (`research/proxy-cost.md`), every time a glommio executor parked it made 4–6
//! `io_uring_enter` calls (it keeps three rings and re-arms a preemption timer on each
//! loop) and one `membarrier` that interrupts every CPU running a thread of the process.
//! A proxy parks twice per forwarded round trip, so that cost was most of its CPU time
//! per statement. This runtime does what the proxy needs and no more: readiness polls
//! (`IORING_OP_POLL_ADD`) submitted together with the wait, in **one** `io_uring_enter`
//! per loop turn; the socket I/O itself is a plain non-blocking `recv`/`send`, which
//! usually succeeds at once.
//!
//! # Layout
//!
//! - [`reactor`]: the io_uring of a thread, readiness futures, timers.
//! - [`executor`]: the task queue of a thread (async-executor's `LocalExecutor`) and the
//!   loop that alternates between running tasks and waiting on the ring.
//! - [`net`]: TCP listener and stream on top of them.
//!
//! # Limits
//!
//! Wakers may only be woken on their own thread; cross-core messages go through a
//! channel plus an eventfd the receiving core polls ([`reactor::EventFd`]).

mod bufring;
pub mod executor;
pub mod mailbox;
pub mod net;
pub mod reactor;

pub use executor::{block_on, spawn};
pub use reactor::{sleep, sleep_until};

/// Runs `work` on a thread of its own and waits for it without blocking the core: for the
/// rare CPU-bound step (deriving a password's keys) that would stall every session of the
/// core. A thread per call: such steps are rare and bounded, and a pool would be idle.
///
/// # Errors
///
/// No thread or eventfd could be had (the caller may then do the work itself).
pub async fn off_core<T: Send + 'static>(
    work: impl FnOnce() -> T + Send + 'static,
) -> std::io::Result<T> {
    let done = std::sync::Arc::new(reactor::EventFd::new()?);
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    let signal = done.clone();
    std::thread::Builder::new()
        .name("lokadb-off-core".into())
        .spawn(move || {
            let _ = tx.send(work());
            signal.notify();
        })?;
    done.wait().await;
    rx.recv()
        .map_err(|_| std::io::Error::other("the worker thread ended without an answer"))
}

#[cfg(test)]
mod tests {
    use super::net::{TcpListener, TcpStream};
    use super::reactor::EventFd;
    use super::*;
    use futures_lite::{AsyncRead, AsyncReadExt, AsyncWriteExt};
    use std::os::fd::IntoRawFd;
    use std::time::{Duration, Instant};

    fn listener() -> (TcpListener, std::net::SocketAddr) {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        // SAFETY: a fresh listening socket handed over whole.
        (
            unsafe { TcpListener::from_raw_fd(l.into_raw_fd()) }.unwrap(),
            addr,
        )
    }

    #[test]
    fn timers_fire_in_order_and_not_early() {
        let order = block_on(async {
            let started = Instant::now();
            let log = std::rc::Rc::new(std::cell::RefCell::new(Vec::new()));
            let tasks: Vec<_> = [30u64, 10, 20]
                .into_iter()
                .map(|ms| {
                    let log = log.clone();
                    spawn(async move {
                        sleep(Duration::from_millis(ms)).await;
                        assert!(started.elapsed() >= Duration::from_millis(ms));
                        log.borrow_mut().push(ms);
                    })
                })
                .collect();
            for t in tasks {
                t.await;
            }
            let v = log.borrow().clone();
            v
        });
        assert_eq!(order, vec![10, 20, 30]);
    }

    #[test]
    fn echo_over_tcp_with_a_large_transfer() {
        let received = block_on(async {
            let (listener, addr) = listener();
            let server = spawn(async move {
                let mut s = listener.accept().await.unwrap();
                let mut buf = vec![0u8; 64 * 1024];
                loop {
                    let n = s.read(&mut buf).await.unwrap();
                    if n == 0 {
                        break;
                    }
                    s.write_all(&buf[..n]).await.unwrap();
                }
            });
            let client = TcpStream::connect(addr).await.unwrap();
            let data: Vec<u8> = (0..8_000_000u32).map(|i| (i % 251) as u8).collect();
            let (mut r, mut w) = futures_lite::io::split(client);
            let expected = data.clone();
            let writer = spawn(async move {
                w.write_all(&data).await.unwrap();
                w.close().await.unwrap();
            });
            let mut back = Vec::new();
            r.read_to_end(&mut back).await.unwrap();
            writer.await;
            server.await;
            (back == expected, back.len())
        });
        assert_eq!(received, (true, 8_000_000));
    }

    #[test]
    fn bytes_written_just_before_a_drop_arrive_and_only_on_their_socket() {
        let got = block_on(async {
            let (listener, addr) = listener();
            let server = spawn(async move {
                for i in 0..50u32 {
                    let mut s = listener.accept().await.unwrap();
                    s.write_all(format!("reply {i}").as_bytes()).await.unwrap();
                    // Dropped with the send only queued: it must reach this socket before
                    // its number is closed (and reused by the next accept).
                }
            });
            let mut got = Vec::new();
            for _ in 0..50 {
                let mut c = TcpStream::connect(addr).await.unwrap();
                let mut back = String::new();
                c.read_to_string(&mut back).await.unwrap();
                got.push(back);
            }
            server.await;
            got
        });
        let want: Vec<String> = (0..50).map(|i| format!("reply {i}")).collect();
        assert_eq!(got, want);
    }

    #[test]
    fn reads_go_on_when_every_ring_buffer_is_taken() {
        // More sockets than ring buffers, each with a receive queued and data arriving at
        // once: the receives past the ring's buffers fail with ENOBUFS and must fall back
        // to poll + recv without losing or mixing bytes.
        let n = 200usize;
        let got = block_on(async move {
            let (listener, addr) = listener();
            let mut peers = Vec::new();
            let mut streams = Vec::new();
            for _ in 0..n {
                let peer = std::net::TcpStream::connect(addr).unwrap();
                streams.push(listener.accept().await.unwrap());
                peers.push(peer);
            }
            // First read of each: nothing there yet, so each queues a ring receive.
            let waker = std::task::Waker::noop();
            let mut cx = std::task::Context::from_waker(waker);
            for s in &mut streams {
                let mut b = [0u8; 64];
                let pending = std::pin::Pin::new(&mut *s).poll_read(&mut cx, &mut b);
                assert!(pending.is_pending());
            }
            for (i, p) in peers.iter_mut().enumerate() {
                std::io::Write::write_all(p, format!("message {i}").as_bytes()).unwrap();
            }
            sleep(Duration::from_millis(50)).await;
            let mut got = Vec::new();
            for s in &mut streams {
                let mut b = [0u8; 64];
                let k = s.read(&mut b).await.unwrap();
                got.push(String::from_utf8_lossy(&b[..k]).into_owned());
            }
            // The ring is whole again: a second round of receives all succeed.
            for (i, p) in peers.iter_mut().enumerate() {
                std::io::Write::write_all(p, format!("again {i}").as_bytes()).unwrap();
            }
            for (i, s) in streams.iter_mut().enumerate() {
                let mut b = [0u8; 64];
                let k = s.read(&mut b).await.unwrap();
                assert_eq!(&b[..k], format!("again {i}").as_bytes());
            }
            got
        });
        let want: Vec<String> = (0..n).map(|i| format!("message {i}")).collect();
        assert_eq!(got, want);
    }

    #[test]
    fn a_write_to_a_closed_peer_reports_the_error() {
        let kind = block_on(async {
            let (listener, addr) = listener();
            let client = std::thread::spawn(move || {
                let s = std::net::TcpStream::connect(addr).unwrap();
                // SO_LINGER 0: the close resets the connection.
                socket2::SockRef::from(&s)
                    .set_linger(Some(Duration::ZERO))
                    .unwrap();
            });
            let mut s = listener.accept().await.unwrap();
            client.join().unwrap();
            sleep(Duration::from_millis(20)).await;
            let mut err = None;
            for _ in 0..100 {
                if let Err(e) = s.write_all(b"into the void").await {
                    err = Some(e.kind());
                    break;
                }
                sleep(Duration::from_millis(1)).await;
            }
            err
        });
        assert!(
            matches!(
                kind,
                Some(std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe)
            ),
            "{kind:?}"
        );
    }

    #[test]
    fn a_dropped_readiness_wait_is_cancelled() {
        block_on(async {
            let (listener, _addr) = listener();
            // Waiting for a connection that never comes, given up after 20 ms.
            let r = crate::time::with_timeout(Duration::from_millis(20), listener.accept()).await;
            assert!(r.is_none());
            // The reactor is still healthy: timers and new waits work.
            sleep(Duration::from_millis(5)).await;
        });
    }

    #[test]
    fn connect_to_a_closed_port_is_refused() {
        let e = block_on(async {
            let port = {
                let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
                l.local_addr().unwrap().port()
            };
            TcpStream::connect(([127, 0, 0, 1], port).into())
                .await
                .err()
                .unwrap()
                .kind()
        });
        assert_eq!(e, std::io::ErrorKind::ConnectionRefused);
    }

    #[test]
    fn an_eventfd_wakes_a_waiting_thread() {
        let efd = std::sync::Arc::new(EventFd::new().unwrap());
        let remote = efd.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            remote.notify();
        });
        let waited = block_on(async move {
            let started = Instant::now();
            efd.wait().await;
            started.elapsed()
        });
        t.join().unwrap();
        assert!(waited >= Duration::from_millis(25), "{waited:?}");
    }
}
