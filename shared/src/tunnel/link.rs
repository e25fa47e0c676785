//! A tunnel over TLS, still sans-IO: ciphertext in, ciphertext out.
//!
//! Both binaries drive the same two calls from their own event loops (the relay from
//! its io_uring runtime, the agent from `poll(2)`): [`Link::receive`] with the bytes
//! read from the socket, [`Link::transmit`] for the bytes to write. Plaintext never
//! leaves this module, so the TLS record layer and the tunnel framing are glued in one
//! place.

use std::io::{self, Read, Write};
use std::time::Instant;

use bytes::BytesMut;
use rustls::Connection;

use super::error::TunnelError;
use super::flow::Tunnel;
use super::memory::{
    AutoWindow, MemoryCaps, DEFAULT_MAX_WINDOW, DEFAULT_SHARED_MEMORY_CAP,
    DEFAULT_TUNNEL_MEMORY_CAP,
};

/// Frames pulled from the tunnel per [`Link::transmit`] round before they are
/// encrypted: large enough for full TLS records, small enough that a stalled socket
/// leaves the backlog in the tunnel (where it is counted and bounded per stream) and
/// not in TLS buffers.
const TRANSMIT_CHUNK: usize = 64 * 1024;

/// Why a link ended.
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    /// The TLS layer failed (handshake, certificate, corrupt record).
    #[error("TLS: {0}")]
    Tls(#[from] rustls::Error),
    /// The tunnel protocol ended the connection.
    #[error(transparent)]
    Tunnel(#[from] TunnelError),
    /// The peer closed the TLS session (close_notify) or the socket.
    #[error("the peer closed the connection")]
    Eof,
}

/// One tunnel carried by one TLS connection.
#[derive(Debug)]
pub struct Link {
    tls: Connection,
    tunnel: Tunnel,
    /// Plaintext received and not yet a whole frame.
    plain: BytesMut,
    /// Frames encoded and not yet handed to TLS.
    frames: BytesMut,
}

impl Link {
    /// Joins a TLS connection (client or server, before its handshake) and a tunnel end.
    pub fn new(tls: impl Into<Connection>, tunnel: Tunnel) -> Link {
        Link {
            tls: tls.into(),
            tunnel,
            plain: BytesMut::new(),
            frames: BytesMut::new(),
        }
    }

    /// The tunnel, for the application's calls and events.
    pub fn tunnel(&mut self) -> &mut Tunnel {
        &mut self.tunnel
    }

    /// The tunnel, read-only.
    pub fn tunnel_ref(&self) -> &Tunnel {
        &self.tunnel
    }

    /// The TLS connection (for the peer's certificate, the SNI name, …).
    pub fn tls(&self) -> &Connection {
        &self.tls
    }

    /// Takes ciphertext read from the socket; every whole frame it completes is handled
    /// by the tunnel (drain [`Tunnel::poll_event`] afterwards). An empty `data` means
    /// the socket reached end of file.
    ///
    /// # Errors
    ///
    /// [`LinkError`]: the connection must be closed after a last [`Link::transmit`]
    /// (which carries a TLS alert or the tunnel's RESET).
    pub fn receive(&mut self, now: Instant, mut data: &[u8]) -> Result<(), LinkError> {
        if data.is_empty() {
            return Err(LinkError::Eof);
        }
        let mut eof = false;
        while !data.is_empty() {
            // read_tls takes at most one buffer's worth; loop until all is consumed.
            match self.tls.read_tls(&mut data) {
                Ok(0) => break,
                Ok(_) => {}
                Err(e) => return Err(LinkError::Tls(rustls::Error::General(e.to_string()))),
            }
            let state = self.tls.process_new_packets()?;
            let mut want = state.plaintext_bytes_to_read();
            while want > 0 {
                let start = self.plain.len();
                self.plain.resize(start + want, 0);
                match self.tls.reader().read(&mut self.plain[start..]) {
                    Ok(n) => {
                        self.plain.truncate(start + n);
                        want -= n.min(want);
                        if n == 0 {
                            break;
                        }
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        self.plain.truncate(start);
                        break;
                    }
                    Err(e) => {
                        self.plain.truncate(start);
                        return Err(LinkError::Tls(rustls::Error::General(e.to_string())));
                    }
                }
            }
            if state.peer_has_closed() {
                eof = true;
            }
            if !self.plain.is_empty() {
                self.tunnel.handle_input(now, &mut self.plain)?;
            }
        }
        if eof {
            return Err(LinkError::Eof);
        }
        Ok(())
    }

    /// Appends ciphertext to send to `out`: TLS handshake records first, then the
    /// tunnel's frames, until `out` holds at least `max` bytes or nothing is left.
    /// Returns whether anything was appended.
    pub fn transmit(&mut self, out: &mut Vec<u8>, max: usize) -> bool {
        let before = out.len();
        loop {
            self.flush_tls(out);
            if out.len() >= max || self.tls.is_handshaking() {
                break;
            }
            if self.frames.is_empty()
                && self.tunnel.poll_transmit(&mut self.frames, TRANSMIT_CHUNK) == 0
            {
                break;
            }
            // A rustls writer takes everything (it buffers without limit), so hand it
            // one chunk at a time and encrypt it before taking more.
            let n = self
                .tls
                .writer()
                .write(&self.frames)
                .expect("rustls writer does not fail");
            let _ = self.frames.split_to(n);
        }
        self.flush_tls(out);
        out.len() > before
    }

    fn flush_tls(&mut self, out: &mut Vec<u8>) {
        while self.tls.wants_write() {
            if self.tls.write_tls(out).is_err() {
                break;
            }
        }
    }

    /// Whether TLS still negotiates (no tunnel frame has been exchanged yet).
    pub fn is_handshaking(&self) -> bool {
        self.tls.is_handshaking()
    }

    /// Queues a TLS close_notify, sent by the next [`Link::transmit`].
    pub fn close(&mut self) {
        self.tls.send_close_notify();
    }
}

/// The per-stream window from `LOKADB_MUX_WINDOW_KB` (in KiB), or the default 4 MiB.
///
/// # Errors
///
/// A value that is not a whole number from 1 to 4194303 (4 GiB − 1 KiB).
pub fn window_from_env() -> Result<u32, String> {
    match std::env::var("LOKADB_MUX_WINDOW_KB") {
        Err(_) => Ok(super::DEFAULT_WINDOW),
        Ok(v) => parse_window_kb(&v),
    }
}

fn parse_window_kb(v: &str) -> Result<u32, String> {
    parse_kb("LOKADB_MUX_WINDOW_KB", v)
}

fn parse_kb(name: &str, v: &str) -> Result<u32, String> {
    let kb: u32 = v
        .trim()
        .parse()
        .map_err(|_| format!("{name} must be a whole number of KiB, got {v:?}"))?;
    if kb == 0 || kb > (u32::MAX >> 10) {
        return Err(format!(
            "{name} must be from 1 to {}, got {kb}",
            u32::MAX >> 10
        ));
    }
    Ok(kb << 10)
}

/// Window auto-tuning from the environment, for [`super::Config::auto_window`]:
/// `LOKADB_MUX_AUTO` (`1` on, `0` or unset off) and `LOKADB_MUX_MAX_WINDOW_KB`
/// (the largest window a stream may grow to, in KiB; default 16384, 16 MiB).
///
/// # Errors
///
/// `LOKADB_MUX_AUTO` other than `0` or `1`, or a maximum that is not a whole
/// number from 1 to 4194303.
pub fn auto_from_env() -> Result<Option<AutoWindow>, String> {
    parse_auto(
        std::env::var("LOKADB_MUX_AUTO").ok().as_deref(),
        std::env::var("LOKADB_MUX_MAX_WINDOW_KB").ok().as_deref(),
    )
}

/// Receive memory caps from the environment: `LOKADB_MUX_TUNNEL_MEMORY_MB`, the cap
/// of one tunnel (default 512), and `LOKADB_MUX_MEMORY_MB`, the budget shared by all
/// tunnels of the process (default 1024); `0` turns a cap off. The relay uses both;
/// see `docs/tunnel-protocol.md` for what they bound.
///
/// # Errors
///
/// A value that is not a whole number of MiB.
pub fn memory_caps_from_env() -> Result<MemoryCaps, String> {
    parse_memory_caps(
        std::env::var("LOKADB_MUX_TUNNEL_MEMORY_MB").ok().as_deref(),
        std::env::var("LOKADB_MUX_MEMORY_MB").ok().as_deref(),
    )
}

fn parse_memory_caps(tunnel: Option<&str>, shared: Option<&str>) -> Result<MemoryCaps, String> {
    let mb = |name: &str, v: Option<&str>, default: u64| -> Result<Option<u64>, String> {
        let Some(v) = v else {
            return Ok(Some(default));
        };
        let mb: u64 = v
            .trim()
            .parse()
            .ok()
            .filter(|&mb: &u64| mb <= 1 << 40)
            .ok_or_else(|| {
                format!("{name} must be a whole number of MiB (0: no cap), got {v:?}")
            })?;
        Ok((mb > 0).then_some(mb << 20))
    };
    Ok(MemoryCaps {
        tunnel: mb(
            "LOKADB_MUX_TUNNEL_MEMORY_MB",
            tunnel,
            DEFAULT_TUNNEL_MEMORY_CAP,
        )?,
        shared: mb("LOKADB_MUX_MEMORY_MB", shared, DEFAULT_SHARED_MEMORY_CAP)?,
    })
}

fn parse_auto(auto: Option<&str>, max_kb: Option<&str>) -> Result<Option<AutoWindow>, String> {
    let max = match max_kb {
        None => DEFAULT_MAX_WINDOW,
        Some(v) => parse_kb("LOKADB_MUX_MAX_WINDOW_KB", v)?,
    };
    match auto.map(str::trim) {
        None | Some("0") => Ok(None),
        Some("1") => Ok(Some(AutoWindow { max })),
        Some(v) => Err(format!("LOKADB_MUX_AUTO must be 0 or 1, got {v:?}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn window_kb_is_checked() {
        assert_eq!(parse_window_kb("4096"), Ok(4 << 20));
        assert_eq!(parse_window_kb(" 256 "), Ok(256 << 10));
        assert!(parse_window_kb("0").unwrap_err().contains("from 1"));
        assert!(parse_window_kb("4MB").unwrap_err().contains("whole number"));
        assert!(parse_window_kb("99999999").is_err());
    }

    #[test]
    fn memory_caps_default_and_turn_off() {
        assert_eq!(
            parse_memory_caps(None, None),
            Ok(MemoryCaps {
                tunnel: Some(512 << 20),
                shared: Some(1 << 30)
            })
        );
        let caps = parse_memory_caps(Some("0"), Some(" 64 ")).unwrap();
        assert_eq!(caps.tunnel, None);
        assert_eq!(caps.shared, Some(64 << 20));
        assert_eq!(caps.budget().unwrap().capacity(), 64 << 20);
        assert!(parse_memory_caps(Some("1GB"), None)
            .unwrap_err()
            .contains("LOKADB_MUX_TUNNEL_MEMORY_MB must be a whole number"));
        assert!(parse_memory_caps(None, Some("-1")).is_err());
    }

    #[test]
    fn auto_window_is_off_unless_asked() {
        assert_eq!(parse_auto(None, None), Ok(None));
        assert_eq!(parse_auto(Some("0"), Some("1024")), Ok(None));
        assert_eq!(
            parse_auto(Some("1"), None),
            Ok(Some(AutoWindow { max: 16 << 20 }))
        );
        assert_eq!(
            parse_auto(Some(" 1 "), Some("65536")),
            Ok(Some(AutoWindow { max: 64 << 20 }))
        );
        assert!(parse_auto(Some("yes"), None)
            .unwrap_err()
            .contains("LOKADB_MUX_AUTO must be 0 or 1"));
        assert!(parse_auto(Some("1"), Some("0"))
            .unwrap_err()
            .contains("LOKADB_MUX_MAX_WINDOW_KB must be from 1"));
    }
}

#[cfg(test)]
mod tls_tests {
    use super::*;
    use crate::tunnel::{Config, Event, Read};
    use bytes::Bytes;
    use std::sync::Arc;

    fn pair() -> (Link, Link) {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let ck = rcgen::generate_simple_self_signed(vec!["relay.test".into()]).unwrap();
        let cert = ck.cert.der().clone();
        let key = rustls::pki_types::PrivateKeyDer::Pkcs8(ck.key_pair.serialize_der().into());
        let server = rustls::ServerConfig::builder()
            .with_no_client_auth()
            .with_single_cert(vec![cert.clone()], key)
            .unwrap();
        let mut roots = rustls::RootCertStore::empty();
        roots.add(cert).unwrap();
        let client = rustls::ClientConfig::builder()
            .with_root_certificates(roots)
            .with_no_client_auth();
        let now = Instant::now();
        let agent = Link::new(
            rustls::ClientConnection::new(Arc::new(client), "relay.test".try_into().unwrap())
                .unwrap(),
            Tunnel::agent(Config::default(), "org.secret".into(), now),
        );
        let relay = Link::new(
            rustls::ServerConnection::new(Arc::new(server)).unwrap(),
            Tunnel::relay(Config::default(), now),
        );
        (agent, relay)
    }

    /// Moves ciphertext both ways until neither side has anything to send.
    fn pump(a: &mut Link, b: &mut Link) {
        loop {
            let ab = step(a, b);
            let ba = step(b, a);
            if !ab && !ba {
                return;
            }
        }
    }

    fn step(from: &mut Link, to: &mut Link) -> bool {
        let mut out = Vec::new();
        let sent = from.transmit(&mut out, 1 << 20);
        if sent {
            to.receive(Instant::now(), &out).unwrap();
        }
        sent
    }

    #[test]
    fn a_stream_crosses_tls_both_ways() {
        let (mut agent, mut relay) = pair();
        pump(&mut agent, &mut relay);
        match relay.tunnel().poll_event() {
            Some(Event::Hello(h)) => assert_eq!(h.token, "org.secret"),
            other => panic!("{other:?}"),
        }
        relay.tunnel().handle_accept(Instant::now()).unwrap();
        pump(&mut agent, &mut relay);
        assert!(matches!(
            agent.tunnel().poll_event(),
            Some(Event::Connected(_))
        ));
        let s = relay.tunnel().handle_open("appdb").unwrap();
        let big = Bytes::from(vec![7u8; 300_000]);
        relay.tunnel().handle_write(s, big.clone()).unwrap();
        pump(&mut agent, &mut relay);
        assert!(matches!(
            agent.tunnel().poll_event(),
            Some(Event::Opened { .. })
        ));
        let mut got = Vec::new();
        while got.len() < big.len() {
            match agent.tunnel().handle_read(s, 1 << 20).unwrap() {
                Read::Data(d) => got.extend_from_slice(&d),
                Read::Blocked => pump(&mut agent, &mut relay),
                Read::Finished => panic!("finished early"),
            }
        }
        assert_eq!(got, big);
    }

    #[test]
    fn garbage_instead_of_tls_is_an_error() {
        let (_, mut relay) = pair();
        let e = relay
            .receive(Instant::now(), b"GET / HTTP/1.1\r\n\r\n")
            .unwrap_err();
        assert!(matches!(e, LinkError::Tls(_)), "{e}");
        // The alert goes out and the link stays usable for that.
        let mut out = Vec::new();
        relay.transmit(&mut out, 1 << 16);
    }

    #[test]
    fn end_of_file_is_reported() {
        let (_, mut relay) = pair();
        assert!(matches!(
            relay.receive(Instant::now(), b""),
            Err(LinkError::Eof)
        ));
    }
}
