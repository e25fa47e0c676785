//! The startup phase: SSLRequest and GSSENCRequest, CancelRequest, StartupMessage.

use crate::core::Core;
use crate::error::SessionError;
use crate::net::stream::ClientStream;
use crate::rt::net::TcpStream;
use futures_lite::{AsyncReadExt, AsyncWriteExt};
use lokadb_shared::wire::startup::{self, StartupMessage, StartupPacket};
use lokadb_shared::wire::{backend, FrameError};

/// The outcome of negotiation.
pub enum Negotiated {
    /// A client that wants a session.
    Startup(ClientStream, StartupMessage),
    /// A cancel request, already handled.
    Cancelled,
}

/// Runs the startup phase up to the StartupMessage.
///
/// # Errors
///
/// Malformed packets, a TLS handshake failure, or a client that goes away; the stream
/// comes back with the error (when it still exists) so the client can be told why.
pub async fn negotiate(
    tcp: TcpStream,
    core: &Core,
) -> Result<Negotiated, (SessionError, Option<ClientStream>)> {
    let mut slot = Some(ClientStream::Plain(tcp));
    match negotiate_in(&mut slot, core).await {
        Ok(Some(m)) => Ok(Negotiated::Startup(slot.expect("stream after startup"), m)),
        Ok(None) => Ok(Negotiated::Cancelled),
        Err(e) => Err((e, slot)),
    }
}

/// The negotiation loop; `slot` is empty only while TLS is being set up.
async fn negotiate_in(
    slot: &mut Option<ClientStream>,
    core: &Core,
) -> Result<Option<StartupMessage>, SessionError> {
    let mut encryption_asked = false;
    loop {
        let stream = slot.as_mut().expect("stream outside TLS setup");
        let packet = read_packet(stream).await?;
        match startup::parse(&packet)? {
            StartupPacket::SslRequest | StartupPacket::GssEncRequest
                if encryption_asked && stream.is_tls() =>
            {
                return Err(FrameError::Invalid {
                    what: "second encryption request after TLS",
                }
                .into());
            }
            StartupPacket::SslRequest => {
                encryption_asked = true;
                match (&core.shared.settings().tls, slot.take()) {
                    (Some(config), Some(ClientStream::Plain(mut tcp))) => {
                        tcp.write_all(b"S").await.map_err(SessionError::Client)?;
                        let acceptor = futures_rustls::TlsAcceptor::from(config.clone());
                        let tls = acceptor.accept(tcp).await.map_err(SessionError::Client)?;
                        *slot = Some(ClientStream::Tls(Box::new(tls)));
                    }
                    (_, s) => {
                        *slot = s;
                        let stream = slot.as_mut().expect("stream outside TLS setup");
                        stream.write_all(b"N").await.map_err(SessionError::Client)?;
                    }
                }
            }
            StartupPacket::GssEncRequest => {
                encryption_asked = true;
                stream.write_all(b"N").await.map_err(SessionError::Client)?;
            }
            StartupPacket::Cancel { pid, secret } => {
                crate::cancel::handle(core, pid, secret, true).await;
                return Ok(None);
            }
            StartupPacket::PeerCancel { pid, secret } => {
                crate::cancel::handle(core, pid, secret, false).await;
                return Ok(None);
            }
            StartupPacket::Startup(m) => {
                if m.major != 3 {
                    return Err(SessionError::UnsupportedProtocol {
                        major: m.major,
                        minor: m.minor,
                    });
                }
                let unrecognized: Vec<&str> = m.protocol_options().collect();
                if m.minor > 0 || !unrecognized.is_empty() {
                    // We speak 3.0: tell the client, which then continues with 3.0.
                    let mut out = Vec::new();
                    backend::negotiate_protocol_version(&mut out, 0, &unrecognized);
                    crate::net::stream::send(stream, &out)
                        .await
                        .map_err(SessionError::Client)?;
                }
                if m.param("user").is_none_or(str::is_empty) {
                    return Err(SessionError::NoUser);
                }
                return Ok(Some(m));
            }
        }
    }
}

/// Reads one length-prefixed startup packet, exactly (no read-ahead, so a TLS
/// handshake can follow an SSLRequest).
async fn read_packet(stream: &mut ClientStream) -> Result<Vec<u8>, SessionError> {
    let mut len = [0u8; 4];
    stream
        .read_exact(&mut len)
        .await
        .map_err(SessionError::Client)?;
    let n = startup::peek_len(&len)?.expect("four bytes were read") as usize;
    let mut packet = vec![0u8; n];
    packet[..4].copy_from_slice(&len);
    stream
        .read_exact(&mut packet[4..])
        .await
        .map_err(SessionError::Client)?;
    Ok(packet)
}
