//! TCP on the reactor: non-blocking sockets; `recv` tried first, a readiness poll only
//! when the kernel says "would block"; sends handed to the ring (write-behind).
//!
//! # Why sends go through the ring
//!
//! A `send(2)` that wakes the peer (a Postgres backend, a client) often hands it the CPU
//! right there: the proxy is preempted on its way out of the syscall, once per message.
//! Queued on the ring, every send of a loop turn reaches the kernel in the turn's one
//! `io_uring_enter`, so a turn pays for one syscall and at most one preemption however many
//! sessions it served (`research/proxy-cost.md`). The bytes are copied into a buffer the
//! reactor owns until the kernel is done with them, so a caller may reuse its own at once.

use super::bufring;
use super::reactor::{self, Ready, Received};
use futures_lite::{AsyncRead, AsyncWrite};
use socket2::{Domain, Protocol, SockAddr, Socket, Type};
use std::future::Future;
use std::io::{self, Read};
use std::net::{Shutdown, SocketAddr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::pin::Pin;
use std::task::{Context, Poll};

/// A listening socket owned by one core.
pub struct TcpListener(std::net::TcpListener);

impl TcpListener {
    /// Adopts a bound, listening socket.
    ///
    /// # Safety
    ///
    /// `fd` must be a listening TCP socket owned by no one else.
    pub unsafe fn from_raw_fd(fd: RawFd) -> io::Result<TcpListener> {
        // SAFETY: per the function's contract.
        let l = unsafe { std::net::TcpListener::from_raw_fd(fd) };
        l.set_nonblocking(true)?;
        Ok(TcpListener(l))
    }

    /// Accepts a connection.
    ///
    /// # Errors
    ///
    /// `accept(2)` errors other than "would block" (EMFILE, ENFILE, …).
    pub async fn accept(&self) -> io::Result<TcpStream> {
        loop {
            match self.0.accept() {
                Ok((s, _)) => return TcpStream::from_std(s),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    Ready::new(self.0.as_raw_fd(), libc::POLLIN).await?;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }
}

/// The most bytes one write copies and queues; a larger write is taken in parts.
const MAX_SEND: usize = 256 * 1024;

/// A connected TCP stream.
pub struct TcpStream {
    inner: std::net::TcpStream,
    /// Readiness wait of a read that could not use the ring.
    read_ready: Option<Ready>,
    /// The receive queued on the ring.
    receiving: Option<usize>,
    /// A received buffer not yet copied out whole: (buffer id, next byte, length).
    received: Option<(u16, usize, usize)>,
    /// The last read drained the socket: the next one waits for data first.
    drained: bool,
    /// Writability wait before re-sending what the kernel refused with EAGAIN.
    write_ready: Option<Ready>,
    /// The send queued on the ring and not yet collected: at most one, so bytes leave in
    /// the order they were written.
    sending: Option<usize>,
    /// What a refused send still has to send, waiting for `write_ready`.
    unsent: Option<Vec<u8>>,
    /// The buffer of the last completed send, kept for the next.
    spare: Vec<u8>,
}

impl TcpStream {
    fn from_std(inner: std::net::TcpStream) -> io::Result<TcpStream> {
        inner.set_nonblocking(true)?;
        Ok(TcpStream {
            inner,
            read_ready: None,
            receiving: None,
            received: None,
            drained: false,
            write_ready: None,
            sending: None,
            unsent: None,
            spare: Vec::new(),
        })
    }

    /// Drives the queued send until the kernel has taken all of it: re-sends what a short
    /// or refused send left, and reports its error.
    fn poll_sent(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let fd = self.inner.as_raw_fd();
        loop {
            std::task::ready!(poll_slot(&mut self.write_ready, cx))?;
            if let Some(buf) = self.unsent.take() {
                self.sending = Some(reactor::with(|r| r.send(fd, buf)));
            }
            let Some(token) = self.sending else {
                return Poll::Ready(Ok(()));
            };
            let (res, mut buf) = match reactor::with(|r| r.poll_send(token, cx)) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(done) => done,
            };
            self.sending = None;
            if res == -libc::EAGAIN || res == -libc::EINTR {
                // A non-blocking socket's send is not retried by the kernel.
                self.write_ready = Some(Ready::new(fd, libc::POLLOUT));
                self.unsent = Some(buf);
                continue;
            }
            if res < 0 {
                return Poll::Ready(Err(io::Error::from_raw_os_error(-res)));
            }
            let sent = res as usize;
            if sent < buf.len() {
                buf.drain(..sent);
                self.unsent = Some(buf);
                continue;
            }
            buf.clear();
            self.spare = buf;
            return Poll::Ready(Ok(()));
        }
    }

    /// Connects to `addr`.
    ///
    /// # Errors
    ///
    /// The connect error (refused, unreachable, …).
    pub async fn connect(addr: SocketAddr) -> io::Result<TcpStream> {
        let socket = Socket::new(
            Domain::for_address(addr),
            Type::STREAM.cloexec(),
            Some(Protocol::TCP),
        )?;
        socket.set_nonblocking(true)?;
        match socket.connect(&SockAddr::from(addr)) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::EINPROGRESS) => {
                Ready::new(socket.as_raw_fd(), libc::POLLOUT).await?;
                if let Some(e) = socket.take_error()? {
                    return Err(e);
                }
            }
            Err(e) => return Err(e),
        }
        let fd: OwnedFd = socket.into();
        TcpStream::from_std(std::net::TcpStream::from(fd))
    }

    /// Sets TCP_NODELAY.
    ///
    /// # Errors
    ///
    /// `setsockopt(2)` failed.
    pub fn set_nodelay(&self, on: bool) -> io::Result<()> {
        self.inner.set_nodelay(on)
    }

    /// The peer's address.
    ///
    /// # Errors
    ///
    /// The socket is not connected.
    pub fn peer_addr(&self) -> io::Result<SocketAddr> {
        self.inner.peer_addr()
    }
}

impl AsRawFd for TcpStream {
    fn as_raw_fd(&self) -> RawFd {
        self.inner.as_raw_fd()
    }
}

/// Waits for the readiness poll in `slot`, if there is one, and empties the slot once it
/// completed.
fn poll_slot(slot: &mut Option<Ready>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
    let Some(ready) = slot.as_mut() else {
        return Poll::Ready(Ok(()));
    };
    let result = std::task::ready!(Pin::new(ready).poll(cx));
    *slot = None;
    Poll::Ready(result)
}

impl TcpStream {
    /// Copies out what a ring receive brought and the caller has not taken yet.
    fn take_received(&mut self, buf: &mut [u8]) -> Option<usize> {
        let (bid, from, len) = self.received?;
        let n = reactor::with(|r| {
            let n = r.copy_received(bid, from, len, buf);
            if from + n == len {
                r.give_back(bid);
            }
            n
        });
        self.received = (from + n < len).then_some((bid, from + n, len));
        Some(n)
    }
}

impl AsyncRead for TcpStream {
    /// Reads with `recv(2)` while data is likely there; once the socket was drained (a
    /// short read, or "would block") the next read is a receive on the ring, which
    /// completes in the loop's `io_uring_enter` when data arrives. Without free ring
    /// buffers (or a ring) it waits for readiness and reads with `recv(2)` again.
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut [u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if buf.is_empty() {
            return Poll::Ready(Ok(0));
        }
        let fd = this.inner.as_raw_fd();
        loop {
            if let Some(n) = this.take_received(buf) {
                return Poll::Ready(Ok(n));
            }
            if let Some(token) = this.receiving {
                let received = match reactor::with(|r| r.poll_recv(token, cx)) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(received) => received,
                };
                this.receiving = None;
                match received {
                    Received::Data { bid, len } => {
                        this.drained = len < bufring::SIZE;
                        this.received = Some((bid, 0, len));
                        continue;
                    }
                    Received::Eof => return Poll::Ready(Ok(0)),
                    Received::Failed(e) if e == -libc::ENOBUFS || e == -libc::EINTR => {
                        this.read_ready = Some(Ready::new(fd, libc::POLLIN));
                    }
                    Received::Failed(e) => {
                        return Poll::Ready(Err(io::Error::from_raw_os_error(-e)))
                    }
                }
            }
            if this.read_ready.is_some() {
                std::task::ready!(poll_slot(&mut this.read_ready, cx))?;
            } else if this.drained {
                this.drained = false;
                match reactor::with(|r| r.recv(fd)) {
                    Some(token) => this.receiving = Some(token),
                    None => this.read_ready = Some(Ready::new(fd, libc::POLLIN)),
                }
                continue;
            }
            match this.inner.read(buf) {
                Ok(n) => {
                    this.drained = n > 0 && n < buf.len();
                    return Poll::Ready(Ok(n));
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => this.drained = true,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }
}

impl AsyncWrite for TcpStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.sending.is_some() || this.unsent.is_some() {
            match this.poll_sent(cx) {
                Poll::Ready(Ok(())) => {}
                other => return other.map_ok(|()| 0),
            }
        }
        if buf.is_empty() {
            return Poll::Ready(Ok(0));
        }
        let n = buf.len().min(MAX_SEND);
        let mut owned = std::mem::take(&mut this.spare);
        owned.extend_from_slice(&buf[..n]);
        let fd = this.inner.as_raw_fd();
        this.sending = Some(reactor::with(|r| r.send(fd, owned)));
        Poll::Ready(Ok(n))
    }

    /// Reports a queued send's error if it already failed; does not wait for the kernel to
    /// take the bytes (they go with the loop's next `io_uring_enter` in any case).
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        match this.sending {
            Some(token) if reactor::with(|r| r.send_done(token)) => match this.poll_sent(cx) {
                Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
                _ => Poll::Ready(Ok(())),
            },
            _ => Poll::Ready(Ok(())),
        }
    }

    /// Waits until everything written has been sent, then shuts the write side down.
    fn poll_close(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if let Err(e) = std::task::ready!(this.poll_sent(cx)) {
            return Poll::Ready(Err(e));
        }
        Poll::Ready(match this.inner.shutdown(Shutdown::Write) {
            Err(e) if e.kind() == io::ErrorKind::NotConnected => Ok(()),
            other => other,
        })
    }
}

impl Drop for TcpStream {
    fn drop(&mut self) {
        if self.sending.is_none() && self.receiving.is_none() && self.received.is_none() {
            return;
        }
        // A queued send or receive names the socket by number: it must reach the kernel
        // before the number is closed and maybe reused by another connection (which would
        // get this one's bytes, or lose its own to this receive). Once submitted the kernel
        // holds the socket itself. Then what still waits is cancelled: a receive, and a
        // send to a peer that does not read (a closed socket's unsent bytes are lost too).
        let _ = reactor::try_with(|r| {
            r.submit_queued();
            for token in [self.sending, self.receiving].into_iter().flatten() {
                r.abandon(token);
            }
            if let Some((bid, _, _)) = self.received {
                r.give_back(bid);
            }
        });
    }
}
