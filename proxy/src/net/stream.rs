//! A connection, plain TCP or TLS, behind one `AsyncRead + AsyncWrite` type so the
//! session code is written once: [`ClientStream`] for clients (the proxy is the TLS
//! server), [`ServerStream`] for the cloud (the proxy is the TLS client).

use crate::rt::net::TcpStream;
use futures_lite::{AsyncRead, AsyncWrite};
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

/// A connection after SSL negotiation; `T` is the TLS stream over TCP.
pub enum Stream<T> {
    /// Plain TCP.
    Plain(TcpStream),
    /// TLS over TCP (boxed: the rustls state is large and rare connections pay for it).
    Tls(Box<T>),
}

/// A client's connection.
pub type ClientStream = Stream<futures_rustls::server::TlsStream<TcpStream>>;

/// A connection to the cloud (or, without TLS, to an organization's database).
pub type ServerStream = Stream<futures_rustls::client::TlsStream<TcpStream>>;

/// Writes `bytes` and flushes: TLS holds records a write could not hand to the socket at
/// once (a send still in flight) until it is flushed, and a reader waiting for the answer
/// would wait forever.
///
/// # Errors
///
/// The socket's or TLS's.
pub async fn send<S: AsyncWrite + Unpin + ?Sized>(stream: &mut S, bytes: &[u8]) -> io::Result<()> {
    use futures_lite::AsyncWriteExt;
    stream.write_all(bytes).await?;
    stream.flush().await
}

impl<T> Stream<T> {
    /// Whether the connection is encrypted.
    pub fn is_tls(&self) -> bool {
        matches!(self, Stream::Tls(_))
    }
}

impl ClientStream {
    /// The TCP connection under it.
    pub fn tcp(&self) -> &TcpStream {
        match self {
            Stream::Plain(s) => s,
            Stream::Tls(s) => s.get_ref().0,
        }
    }
}

impl ServerStream {
    /// The TCP connection under it.
    pub fn tcp(&self) -> &TcpStream {
        match self {
            Stream::Plain(s) => s,
            Stream::Tls(s) => s.get_ref().0,
        }
    }
}

macro_rules! delegate {
    ($self:ident, $s:ident => $e:expr) => {
        match $self.get_mut() {
            Stream::Plain($s) => {
                let $s = Pin::new($s);
                $e
            }
            Stream::Tls($s) => {
                let $s = Pin::new($s.as_mut());
                $e
            }
        }
    };
}

impl<T: AsyncRead + Unpin> AsyncRead for Stream<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut [u8],
    ) -> Poll<io::Result<usize>> {
        delegate!(self, s => s.poll_read(cx, buf))
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Stream<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        delegate!(self, s => s.poll_write(cx, buf))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        delegate!(self, s => s.poll_flush(cx))
    }

    fn poll_close(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        delegate!(self, s => s.poll_close(cx))
    }
}
