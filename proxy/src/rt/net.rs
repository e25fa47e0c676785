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

use super::reactor::{self, Ready};
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
    read_ready: Option<Ready>,
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
            if let Some(ready) = self.write_ready.as_mut() {
                match Pin::new(ready).poll(cx) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(r) => {
                        self.write_ready = None;
                        r?;
                    }
                }
            }
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

/// Does `op` when the socket may be ready. A pending readiness wait in `slot` is polled
/// first, so a task woken for another reason does not spend a syscall on a socket known to
/// be empty; after "would block", or after a short transfer (the socket was drained or its
/// buffer filled), the next attempt waits for readiness first. The readiness poll is
/// submitted with the loop's one `io_uring_enter` and completes at once if the socket is
/// already ready.
fn poll_io(
    fd: RawFd,
    events: i16,
    slot: &mut Option<Ready>,
    cx: &mut Context<'_>,
    len: usize,
    mut op: impl FnMut() -> io::Result<usize>,
) -> Poll<io::Result<usize>> {
    loop {
        if let Some(ready) = slot.as_mut() {
            match Pin::new(ready).poll(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(r) => {
                    *slot = None;
                    r?;
                }
            }
        }
        match op() {
            Ok(n) => {
                if n > 0 && n < len {
                    *slot = Some(Ready::new(fd, events));
                }
                return Poll::Ready(Ok(n));
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => *slot = Some(Ready::new(fd, events)),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Poll::Ready(Err(e)),
        }
    }
}

impl AsyncRead for TcpStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut [u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let fd = this.inner.as_raw_fd();
        let inner = &mut this.inner;
        let len = buf.len();
        poll_io(fd, libc::POLLIN, &mut this.read_ready, cx, len, || {
            inner.read(buf)
        })
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
        let Some(token) = self.sending else { return };
        // The queued send names the socket by number: it must reach the kernel before the
        // number is closed and maybe reused by another connection. Once submitted the
        // kernel holds the socket itself; a send still waiting for a peer that does not
        // read is cancelled, as the unsent bytes of a closed socket would be lost anyway.
        let _ = reactor::try_with(|r| {
            r.submit_queued();
            r.abandon(token);
        });
    }
}
