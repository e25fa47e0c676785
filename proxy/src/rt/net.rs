//! TCP on the reactor: non-blocking sockets, `recv`/`send` tried first, a readiness
//! poll only when the kernel says "would block".

use super::reactor::Ready;
use futures_lite::{AsyncRead, AsyncWrite};
use socket2::{Domain, Protocol, SockAddr, Socket, Type};
use std::future::Future;
use std::io::{self, Read, Write};
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

/// A connected TCP stream.
pub struct TcpStream {
    inner: std::net::TcpStream,
    read_ready: Option<Ready>,
    write_ready: Option<Ready>,
}

impl TcpStream {
    fn from_std(inner: std::net::TcpStream) -> io::Result<TcpStream> {
        inner.set_nonblocking(true)?;
        Ok(TcpStream {
            inner,
            read_ready: None,
            write_ready: None,
        })
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
        let fd = this.inner.as_raw_fd();
        let inner = &mut this.inner;
        // std's TcpStream sends with MSG_NOSIGNAL: a closed peer is an error, not SIGPIPE.
        poll_io(
            fd,
            libc::POLLOUT,
            &mut this.write_ready,
            cx,
            buf.len(),
            || inner.write(buf),
        )
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_close(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(match self.inner.shutdown(Shutdown::Write) {
            Err(e) if e.kind() == io::ErrorKind::NotConnected => Ok(()),
            other => other,
        })
    }
}
