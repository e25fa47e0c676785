//! The untagged packets a client sends before authentication.

use super::fields::Fields;
use super::frame::FrameError;

/// Upper bound on a startup packet, as in Postgres (`MAX_STARTUP_PACKET_LENGTH`,
/// src/include/libpq/pqcomm.h). Checked before the body is read.
pub const MAX_STARTUP_PACKET_LEN: u32 = 10_000;

/// Protocol version 3.0 as sent in a StartupMessage.
pub const PROTOCOL_3_0: i32 = 196_608;
/// Request code of CancelRequest (`1234 << 16 | 5678`).
pub const CANCEL_REQUEST_CODE: i32 = 80_877_102;
/// Request code of a CancelRequest one LokaDB proxy hands another (`1234 << 16 | 5699`, a
/// code Postgres does not use): the same key, looked up there and handed to no one else.
pub const PEER_CANCEL_REQUEST_CODE: i32 = 80_877_123;
/// Request code of SSLRequest (`1234 << 16 | 5679`).
pub const SSL_REQUEST_CODE: i32 = 80_877_103;
/// Request code of GSSENCRequest (`1234 << 16 | 5680`).
pub const GSSENC_REQUEST_CODE: i32 = 80_877_104;

/// One parsed startup-phase packet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StartupPacket {
    /// StartupMessage.
    Startup(StartupMessage),
    /// SSLRequest: the client asks for TLS before anything else.
    SslRequest,
    /// GSSENCRequest: the client asks for GSSAPI encryption.
    GssEncRequest,
    /// CancelRequest: cancel the query running under this key.
    Cancel {
        /// Process ID part of the key.
        pid: u32,
        /// Secret part of the key (4 bytes in protocol 3.0, longer in 3.2).
        secret: Vec<u8>,
    },
    /// A CancelRequest handed on by another LokaDB proxy ([`PEER_CANCEL_REQUEST_CODE`]).
    PeerCancel {
        /// Process ID part of the key.
        pid: u32,
        /// Secret part of the key (4 bytes in protocol 3.0, longer in 3.2).
        secret: Vec<u8>,
    },
}

/// A StartupMessage: protocol version and parameters in the order sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StartupMessage {
    /// Major version (3).
    pub major: u16,
    /// Minor version requested by the client.
    pub minor: u16,
    /// Parameters, `user` and `database` among them, in the order sent.
    pub params: Vec<(String, String)>,
}

impl StartupMessage {
    /// The value of a parameter, if sent.
    pub fn param(&self, key: &str) -> Option<&str> {
        self.params
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// Protocol extension options (`_pq_.*`) the client asked for.
    pub fn protocol_options(&self) -> impl Iterator<Item = &str> {
        self.params
            .iter()
            .map(|(k, _)| k.as_str())
            .filter(|k| k.starts_with("_pq_."))
    }
}

/// Reads the length prefix of a startup packet.
///
/// Returns `Ok(None)` until 4 bytes are buffered.
///
/// # Errors
///
/// [`FrameError::BadLength`] below 8 bytes (length + code), [`FrameError::TooLarge`]
/// above [`MAX_STARTUP_PACKET_LEN`].
pub fn peek_len(buf: &[u8]) -> Result<Option<u32>, FrameError> {
    if buf.len() < 4 {
        return Ok(None);
    }
    let len = u32::from_be_bytes([buf[0], buf[1], buf[2], buf[3]]);
    if len < 8 {
        return Err(FrameError::BadLength { tag: 0, len });
    }
    if len > MAX_STARTUP_PACKET_LEN {
        return Err(FrameError::TooLarge {
            tag: 0,
            len,
            max: MAX_STARTUP_PACKET_LEN,
        });
    }
    Ok(Some(len))
}

/// Parses a whole startup packet (length prefix included).
///
/// # Errors
///
/// [`FrameError::Truncated`] or [`FrameError::Invalid`] for a malformed body; an
/// unknown protocol version is *not* an error here (the caller answers it).
pub fn parse(packet: &[u8]) -> Result<StartupPacket, FrameError> {
    let mut f = Fields::new(packet.get(4..).unwrap_or_default(), "startup packet");
    let code = f.i32()?;
    match code {
        SSL_REQUEST_CODE => Ok(StartupPacket::SslRequest),
        GSSENC_REQUEST_CODE => Ok(StartupPacket::GssEncRequest),
        CANCEL_REQUEST_CODE | PEER_CANCEL_REQUEST_CODE => {
            let pid = f.i32()? as u32;
            let secret = f.rest().to_vec();
            if secret.is_empty() || secret.len() > 256 {
                return Err(FrameError::Invalid {
                    what: "cancel request key",
                });
            }
            Ok(if code == CANCEL_REQUEST_CODE {
                StartupPacket::Cancel { pid, secret }
            } else {
                StartupPacket::PeerCancel { pid, secret }
            })
        }
        version => {
            let major = (version >> 16) as u16;
            let minor = (version & 0xffff) as u16;
            let mut params = Vec::new();
            if major == 3 {
                loop {
                    let key = f.cstr()?;
                    if key.is_empty() {
                        break;
                    }
                    let value = f.cstr()?;
                    params.push((key.to_owned(), value.to_owned()));
                }
                if !f.is_empty() {
                    return Err(FrameError::Invalid {
                        what: "startup packet: data after the terminator",
                    });
                }
            }
            Ok(StartupPacket::Startup(StartupMessage {
                major,
                minor,
                params,
            }))
        }
    }
}

/// Encodes a StartupMessage for protocol 3.0 with the given parameters.
pub fn encode_startup(params: &[(&str, &str)], out: &mut Vec<u8>) {
    encode_startup_version(3, 0, params, out);
}

/// Encodes a StartupMessage asking for protocol `major.minor`.
pub fn encode_startup_version(major: u16, minor: u16, params: &[(&str, &str)], out: &mut Vec<u8>) {
    let start = out.len();
    out.extend_from_slice(&[0; 4]);
    out.extend_from_slice(&(i32::from(major) << 16 | i32::from(minor)).to_be_bytes());
    for (k, v) in params {
        super::backend::put_cstr(out, k);
        super::backend::put_cstr(out, v);
    }
    out.push(0);
    let len = (out.len() - start) as u32;
    out[start..start + 4].copy_from_slice(&len.to_be_bytes());
}

/// Encodes an SSLRequest: the server answers one byte, `S` (TLS follows) or `N`.
pub fn encode_ssl_request(out: &mut Vec<u8>) {
    out.extend_from_slice(&8u32.to_be_bytes());
    out.extend_from_slice(&SSL_REQUEST_CODE.to_be_bytes());
}

/// Encodes a CancelRequest.
pub fn encode_cancel(pid: u32, secret: &[u8], out: &mut Vec<u8>) {
    encode_cancel_with(CANCEL_REQUEST_CODE, pid, secret, out);
}

/// Encodes the CancelRequest one proxy hands another ([`PEER_CANCEL_REQUEST_CODE`]).
pub fn encode_peer_cancel(pid: u32, secret: &[u8], out: &mut Vec<u8>) {
    encode_cancel_with(PEER_CANCEL_REQUEST_CODE, pid, secret, out);
}

fn encode_cancel_with(code: i32, pid: u32, secret: &[u8], out: &mut Vec<u8>) {
    let len = (8 + 4 + secret.len()) as u32;
    out.extend_from_slice(&len.to_be_bytes());
    out.extend_from_slice(&code.to_be_bytes());
    out.extend_from_slice(&pid.to_be_bytes());
    out.extend_from_slice(secret);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_ssl_request_reads_back() {
        let mut out = Vec::new();
        encode_ssl_request(&mut out);
        assert_eq!(parse(&out).unwrap(), StartupPacket::SslRequest);
    }

    #[test]
    fn a_peer_cancel_is_told_from_a_clients() {
        let mut out = Vec::new();
        encode_cancel(7, &[1, 2, 3, 4], &mut out);
        assert_eq!(
            parse(&out).unwrap(),
            StartupPacket::Cancel {
                pid: 7,
                secret: vec![1, 2, 3, 4]
            }
        );
        out.clear();
        encode_peer_cancel(7, &[1, 2, 3, 4], &mut out);
        assert_eq!(
            parse(&out).unwrap(),
            StartupPacket::PeerCancel {
                pid: 7,
                secret: vec![1, 2, 3, 4]
            }
        );
    }

    #[test]
    fn startup_round_trip() {
        let mut buf = Vec::new();
        encode_startup(&[("user", "alice"), ("database", "app")], &mut buf);
        assert_eq!(peek_len(&buf).unwrap(), Some(buf.len() as u32));
        let StartupPacket::Startup(m) = parse(&buf).unwrap() else {
            panic!("not a startup")
        };
        assert_eq!((m.major, m.minor), (3, 0));
        assert_eq!(m.param("user"), Some("alice"));
        assert_eq!(m.param("database"), Some("app"));
        assert_eq!(m.param("options"), None);
    }

    #[test]
    fn cancel_round_trip() {
        let mut buf = Vec::new();
        encode_cancel(7, &[1, 2, 3, 4], &mut buf);
        assert_eq!(buf.len(), 16);
        assert_eq!(
            parse(&buf).unwrap(),
            StartupPacket::Cancel {
                pid: 7,
                secret: vec![1, 2, 3, 4]
            }
        );
    }

    #[test]
    fn ssl_and_gss_requests() {
        let ssl = [0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f];
        assert_eq!(parse(&ssl).unwrap(), StartupPacket::SslRequest);
        let gss = [0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x30];
        assert_eq!(parse(&gss).unwrap(), StartupPacket::GssEncRequest);
    }

    #[test]
    fn bad_lengths_and_bodies() {
        assert!(matches!(
            peek_len(&[0, 0, 0, 4]),
            Err(FrameError::BadLength { .. })
        ));
        assert!(matches!(
            peek_len(&[0, 1, 0, 0]),
            Err(FrameError::TooLarge { .. })
        ));
        // user without a value, no terminator
        let mut pkt = vec![0, 0, 0, 0, 0, 3, 0, 0];
        pkt.extend_from_slice(b"user\0");
        let len = pkt.len() as u32;
        pkt[..4].copy_from_slice(&len.to_be_bytes());
        assert!(matches!(parse(&pkt), Err(FrameError::Truncated { .. })));
    }

    #[test]
    fn other_versions_are_reported_not_rejected() {
        let pkt = [0, 0, 0, 8, 0, 2, 0, 0];
        let StartupPacket::Startup(m) = parse(&pkt).unwrap() else {
            panic!()
        };
        assert_eq!((m.major, m.minor), (2, 0));
    }
}

#[cfg(test)]
mod proptests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn arbitrary_packets_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..300)) {
            let _ = peek_len(&bytes);
            let _ = parse(&bytes);
            let _ = crate::wire::Header::peek(&bytes, 1000);
            let _ = crate::wire::notice::Notice::parse(&bytes);
        }

        #[test]
        fn startup_messages_round_trip(
            params in prop::collection::vec(("[a-z_]{1,12}", "[ -~]{0,20}"), 0..8)
        ) {
            let refs: Vec<(&str, &str)> = params.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
            let mut buf = Vec::new();
            encode_startup(&refs, &mut buf);
            let StartupPacket::Startup(m) = parse(&buf).unwrap() else { panic!("not a startup message") };
            prop_assert_eq!(m.params, params);
        }
    }
}
