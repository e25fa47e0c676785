//! A client connection, plain TCP or TLS, behind one `AsyncRead + AsyncWrite` type so
//! the session code is written once.

use crate::rt::net::TcpStream;
use futures_lite::{AsyncRead, AsyncWrite};
use futures_rustls::server::TlsStream;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

/// A client connection after SSL negotiation.
pub enum ClientStream {
    /// Plain TCP.
    Plain(TcpStream),
    /// TLS over TCP (boxed: the rustls state is large and rare connections pay for it).
    Tls(Box<TlsStream<TcpStream>>),
}

impl ClientStream {
    /// Whether the connection is encrypted.
    pub fn is_tls(&self) -> bool {
        matches!(self, ClientStream::Tls(_))
    }
}

macro_rules! delegate {
    ($self:ident, $s:ident => $e:expr) => {
        match $self.get_mut() {
            ClientStream::Plain($s) => {
                let $s = Pin::new($s);
                $e
            }
            ClientStream::Tls($s) => {
                let $s = Pin::new($s.as_mut());
                $e
            }
        }
    };
}

impl AsyncRead for ClientStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut [u8],
    ) -> Poll<io::Result<usize>> {
        delegate!(self, s => s.poll_read(cx, buf))
    }
}

impl AsyncWrite for ClientStream {
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
