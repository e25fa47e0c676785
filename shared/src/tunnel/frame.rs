//! Tunnel frames: the fixed header, every frame type, and the codec.
//!
//! Every frame is a 10-byte header and a body of at most [`MAX_FRAME_BODY`] bytes:
//!
//! ```text
//! type:u8 | flags:u8 | stream:u32 | length:u32 (body only) | body
//! ```
//!
//! All integers are big-endian. Tunnel-wide frames (the handshake, PING, PONG, DRAIN)
//! travel on stream 0; stream frames on any other id. RESET may also name stream 0,
//! which aborts the whole tunnel. The byte layout of each body is in
//! `docs/tunnel-protocol.md` and beside each variant of [`Frame`].

use std::fmt;

use bytes::{Buf, BufMut, Bytes, BytesMut};

use super::code::ErrorCode;

/// Length of the fixed frame header: type, flags, stream id, body length.
pub const HEADER_LEN: usize = 10;
/// Upper bound on a frame body in protocol version 1, checked from the header before
/// anything is buffered for the frame. DATA payloads are cut to at most this size.
pub const MAX_FRAME_BODY: u32 = 64 * 1024;
/// Upper bound on the text fields: the HELLO token, the OPEN target and the reasons
/// of HELLO_REJECT and RESET. A reason longer than this is cut when encoded.
pub const MAX_TEXT_LEN: usize = 1024;
/// The protocol version this code speaks, sent in HELLO and echoed in HELLO_OK.
pub const PROTOCOL_VERSION: u16 = 1;
/// First bytes of a HELLO body, so that a Postgres client or an HTTP probe that
/// reaches the tunnel port is refused at its first frame.
pub const HELLO_MAGIC: [u8; 4] = *b"LOKA";

/// HELLO: the agent opens the handshake.
pub const HELLO_TAG: u8 = 0x01;
/// HELLO_OK: the relay accepts the agent.
pub const HELLO_OK_TAG: u8 = 0x02;
/// HELLO_REJECT: the relay refuses the agent, with a code and a reason.
pub const HELLO_REJECT_TAG: u8 = 0x03;
/// OPEN: a new stream, with its target.
pub const OPEN_TAG: u8 = 0x10;
/// DATA: stream payload.
pub const DATA_TAG: u8 = 0x11;
/// WINDOW_UPDATE: credit returned to the sender of a stream.
pub const WINDOW_UPDATE_TAG: u8 = 0x12;
/// CLOSE: the sender will send no more DATA on the stream (half-close).
pub const CLOSE_TAG: u8 = 0x13;
/// RESET: the stream (or, on stream 0, the tunnel) is aborted.
pub const RESET_TAG: u8 = 0x14;
/// PING: liveness probe with an opaque 8-byte payload.
pub const PING_TAG: u8 = 0x20;
/// PONG: the answer to PING, echoing its payload.
pub const PONG_TAG: u8 = 0x21;
/// DRAIN: the sender is going away; open no new streams, reconnect.
pub const DRAIN_TAG: u8 = 0x22;

/// The identifier of a stream within one tunnel.
///
/// Stream 0 is the tunnel itself. The relay opens odd ids and the agent even ids,
/// each strictly increasing, so an id is never reused within a tunnel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StreamId(pub u32);

impl StreamId {
    /// Stream 0: the tunnel as a whole.
    pub const TUNNEL: StreamId = StreamId(0);

    /// Whether this is stream 0.
    pub fn is_tunnel(self) -> bool {
        self.0 == 0
    }

    /// Which end opens streams with this id (`None` for stream 0).
    pub fn opener(self) -> Option<Role> {
        match self.0 {
            0 => None,
            n if n % 2 == 1 => Some(Role::Relay),
            _ => Some(Role::Agent),
        }
    }
}

impl fmt::Display for StreamId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.opener() {
            None => f.write_str("tunnel stream 0"),
            Some(role) => write!(f, "{role} stream {}", self.0),
        }
    }
}

/// The two ends of a tunnel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// The agent beside an organization's database; dials out, sends HELLO.
    Agent,
    /// The relay beside the proxy; accepts agents, answers HELLO.
    Relay,
}

impl Role {
    fn to_u8(self) -> u8 {
        match self {
            Role::Agent => 1,
            Role::Relay => 2,
        }
    }

    fn from_u8(b: u8) -> Option<Role> {
        match b {
            1 => Some(Role::Agent),
            2 => Some(Role::Relay),
            _ => None,
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Role::Agent => "agent",
            Role::Relay => "relay",
        })
    }
}

/// The type of a frame, one per tag constant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum FrameType {
    /// [`HELLO_TAG`].
    Hello = HELLO_TAG,
    /// [`HELLO_OK_TAG`].
    HelloOk = HELLO_OK_TAG,
    /// [`HELLO_REJECT_TAG`].
    HelloReject = HELLO_REJECT_TAG,
    /// [`OPEN_TAG`].
    Open = OPEN_TAG,
    /// [`DATA_TAG`].
    Data = DATA_TAG,
    /// [`WINDOW_UPDATE_TAG`].
    WindowUpdate = WINDOW_UPDATE_TAG,
    /// [`CLOSE_TAG`].
    Close = CLOSE_TAG,
    /// [`RESET_TAG`].
    Reset = RESET_TAG,
    /// [`PING_TAG`].
    Ping = PING_TAG,
    /// [`PONG_TAG`].
    Pong = PONG_TAG,
    /// [`DRAIN_TAG`].
    Drain = DRAIN_TAG,
}

impl FrameType {
    /// The frame type for a tag, if the tag is known.
    pub fn from_tag(tag: u8) -> Option<FrameType> {
        Some(match tag {
            HELLO_TAG => FrameType::Hello,
            HELLO_OK_TAG => FrameType::HelloOk,
            HELLO_REJECT_TAG => FrameType::HelloReject,
            OPEN_TAG => FrameType::Open,
            DATA_TAG => FrameType::Data,
            WINDOW_UPDATE_TAG => FrameType::WindowUpdate,
            CLOSE_TAG => FrameType::Close,
            RESET_TAG => FrameType::Reset,
            PING_TAG => FrameType::Ping,
            PONG_TAG => FrameType::Pong,
            DRAIN_TAG => FrameType::Drain,
            _ => return None,
        })
    }

    /// The tag byte.
    pub fn tag(self) -> u8 {
        self as u8
    }

    /// The name used in the protocol document and in error messages.
    pub fn name(self) -> &'static str {
        match self {
            FrameType::Hello => "HELLO",
            FrameType::HelloOk => "HELLO_OK",
            FrameType::HelloReject => "HELLO_REJECT",
            FrameType::Open => "OPEN",
            FrameType::Data => "DATA",
            FrameType::WindowUpdate => "WINDOW_UPDATE",
            FrameType::Close => "CLOSE",
            FrameType::Reset => "RESET",
            FrameType::Ping => "PING",
            FrameType::Pong => "PONG",
            FrameType::Drain => "DRAIN",
        }
    }

    /// Which stream ids the frame may carry.
    fn stream_rule(self) -> StreamRule {
        match self {
            FrameType::Hello
            | FrameType::HelloOk
            | FrameType::HelloReject
            | FrameType::Ping
            | FrameType::Pong
            | FrameType::Drain => StreamRule::TunnelOnly,
            FrameType::Open | FrameType::Data | FrameType::WindowUpdate | FrameType::Close => {
                StreamRule::StreamOnly
            }
            FrameType::Reset => StreamRule::Any,
        }
    }

    /// The body lengths the frame may have, as (minimum, maximum).
    fn body_len(self) -> (u32, u32) {
        const TEXT: u32 = MAX_TEXT_LEN as u32;
        match self {
            FrameType::Hello => (HELLO_FIXED_LEN, HELLO_FIXED_LEN + TEXT),
            FrameType::HelloOk => (HELLO_OK_LEN, HELLO_OK_LEN),
            FrameType::HelloReject | FrameType::Reset => (2, 2 + TEXT),
            FrameType::Open => (0, TEXT),
            FrameType::Data => (0, MAX_FRAME_BODY),
            FrameType::WindowUpdate => (4, 4),
            FrameType::Close | FrameType::Drain => (0, 0),
            FrameType::Ping | FrameType::Pong => (8, 8),
        }
    }
}

impl fmt::Display for FrameType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[derive(Clone, Copy)]
enum StreamRule {
    TunnelOnly,
    StreamOnly,
    Any,
}

/// HELLO body before the token: magic, version, role, window, max_streams.
const HELLO_FIXED_LEN: u32 = 4 + 2 + 1 + 4 + 4;
/// HELLO_OK body: version, window, max_streams.
const HELLO_OK_LEN: u32 = 2 + 4 + 4;

/// A frame header, read without consuming anything.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// The frame type.
    pub ty: FrameType,
    /// Flag bits; none are defined in version 1 (sent as 0, ignored on receipt).
    pub flags: u8,
    /// The stream the frame belongs to.
    pub stream: StreamId,
    /// Length of the body that follows the header.
    pub len: u32,
}

impl Header {
    /// Reads the header at the start of `buf` and checks it: a known type, a stream
    /// id the type allows, and a body length within the type's bounds.
    ///
    /// Returns `Ok(None)` while fewer than [`HEADER_LEN`] bytes are buffered.
    ///
    /// # Errors
    ///
    /// [`FrameError::UnknownType`], [`FrameError::BadStream`] or
    /// [`FrameError::BadLength`]. The length is checked here, before the caller
    /// waits for or buffers the body, so a hostile length never causes an allocation.
    pub fn peek(buf: &[u8]) -> Result<Option<Header>, FrameError> {
        let Some(h) = buf.get(..HEADER_LEN) else {
            return Ok(None);
        };
        let ty = FrameType::from_tag(h[0]).ok_or(FrameError::UnknownType { tag: h[0] })?;
        let stream = StreamId(u32::from_be_bytes([h[2], h[3], h[4], h[5]]));
        let len = u32::from_be_bytes([h[6], h[7], h[8], h[9]]);
        let stream_ok = match ty.stream_rule() {
            StreamRule::TunnelOnly => stream.is_tunnel(),
            StreamRule::StreamOnly => !stream.is_tunnel(),
            StreamRule::Any => true,
        };
        if !stream_ok {
            return Err(FrameError::BadStream { frame: ty, stream });
        }
        let (min, max) = ty.body_len();
        if len < min || len > max {
            return Err(FrameError::BadLength {
                frame: ty,
                len,
                min,
                max,
            });
        }
        Ok(Some(Header {
            ty,
            flags: h[1],
            stream,
            len,
        }))
    }

    /// Length of the whole frame on the wire.
    pub fn frame_len(&self) -> usize {
        HEADER_LEN + self.len as usize
    }
}

/// The handshake frame sent by the agent.
#[derive(Clone, PartialEq, Eq)]
pub struct Hello {
    /// The protocol version the agent speaks ([`PROTOCOL_VERSION`]).
    pub version: u16,
    /// The sender's role; the relay accepts only [`Role::Agent`].
    pub role: Role,
    /// The receive window, in bytes, the sender grants each stream.
    pub window: u32,
    /// How many concurrent streams the peer may open towards the sender.
    pub max_streams: u32,
    /// The organization token. A secret: `Debug` prints only its length.
    pub token: String,
}

impl fmt::Debug for Hello {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Hello")
            .field("version", &self.version)
            .field("role", &self.role)
            .field("window", &self.window)
            .field("max_streams", &self.max_streams)
            .field("token", &format_args!("<{} bytes>", self.token.len()))
            .finish()
    }
}

/// The relay's acceptance of a HELLO: its own settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HelloOk {
    /// The protocol version in use for this tunnel.
    pub version: u16,
    /// The receive window, in bytes, the relay grants each stream.
    pub window: u32,
    /// How many concurrent streams the agent may open towards the relay.
    pub max_streams: u32,
}

/// One decoded frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    /// HELLO (stream 0). Body: magic `LOKA`, version u16, role u8, window u32,
    /// max_streams u32, token (UTF-8, the rest of the body).
    Hello(Hello),
    /// HELLO_OK (stream 0). Body: version u16, window u32, max_streams u32.
    HelloOk(HelloOk),
    /// HELLO_REJECT (stream 0). Body: code u16, reason (UTF-8, the rest).
    HelloReject {
        /// Why (e.g. [`ErrorCode::BAD_TOKEN`]).
        code: ErrorCode,
        /// Human-readable reason, logged by the agent.
        reason: String,
    },
    /// OPEN. Body: the target (UTF-8), e.g. the database name.
    Open {
        /// The new stream.
        stream: StreamId,
        /// What the stream connects to on the far end.
        target: String,
    },
    /// DATA. Body: the payload.
    Data {
        /// The stream.
        stream: StreamId,
        /// The bytes.
        payload: Bytes,
    },
    /// WINDOW_UPDATE. Body: increment u32, at least 1.
    WindowUpdate {
        /// The stream whose sender gets the credit.
        stream: StreamId,
        /// Bytes of credit added to the window.
        increment: u32,
    },
    /// CLOSE. Empty body.
    Close {
        /// The stream half-closed by the sender.
        stream: StreamId,
    },
    /// RESET. Body: code u16, reason (UTF-8, the rest).
    Reset {
        /// The stream, or stream 0 for the whole tunnel.
        stream: StreamId,
        /// Why.
        code: ErrorCode,
        /// Human-readable reason.
        reason: String,
    },
    /// PING (stream 0). Body: 8 opaque bytes.
    Ping([u8; 8]),
    /// PONG (stream 0). Body: the 8 bytes of the PING answered.
    Pong([u8; 8]),
    /// DRAIN (stream 0). Empty body.
    Drain,
}

impl Frame {
    /// The frame's type.
    pub fn ty(&self) -> FrameType {
        match self {
            Frame::Hello(_) => FrameType::Hello,
            Frame::HelloOk(_) => FrameType::HelloOk,
            Frame::HelloReject { .. } => FrameType::HelloReject,
            Frame::Open { .. } => FrameType::Open,
            Frame::Data { .. } => FrameType::Data,
            Frame::WindowUpdate { .. } => FrameType::WindowUpdate,
            Frame::Close { .. } => FrameType::Close,
            Frame::Reset { .. } => FrameType::Reset,
            Frame::Ping(_) => FrameType::Ping,
            Frame::Pong(_) => FrameType::Pong,
            Frame::Drain => FrameType::Drain,
        }
    }

    /// The stream the frame travels on (stream 0 for tunnel-wide frames).
    pub fn stream(&self) -> StreamId {
        match self {
            Frame::Open { stream, .. }
            | Frame::Data { stream, .. }
            | Frame::WindowUpdate { stream, .. }
            | Frame::Close { stream }
            | Frame::Reset { stream, .. } => *stream,
            _ => StreamId::TUNNEL,
        }
    }

    /// Decodes one frame from the front of `buf`, consuming it.
    ///
    /// Returns `Ok(None)`, consuming nothing, until the whole frame is buffered; the
    /// header is checked first, so the caller never buffers more than
    /// [`HEADER_LEN`] + [`MAX_FRAME_BODY`] bytes for one frame. A DATA payload is a
    /// slice of `buf`'s allocation, not a copy.
    ///
    /// # Errors
    ///
    /// A [`FrameError`] naming the frame type and the fault. The tunnel cannot be
    /// resynchronised after one; what `buf` holds afterwards is unspecified.
    pub fn decode(buf: &mut BytesMut) -> Result<Option<Frame>, FrameError> {
        let Some(header) = Header::peek(buf)? else {
            return Ok(None);
        };
        if buf.len() < header.frame_len() {
            return Ok(None);
        }
        buf.advance(HEADER_LEN);
        let body = buf.split_to(header.len as usize).freeze();
        Frame::parse(header, body).map(Some)
    }

    /// Decodes a body whose header has been checked by [`Header::peek`].
    ///
    /// # Errors
    ///
    /// [`FrameError::Invalid`] when a field holds a value the protocol forbids.
    pub fn parse(header: Header, mut body: Bytes) -> Result<Frame, FrameError> {
        let ty = header.ty;
        let stream = header.stream;
        let (min, max) = ty.body_len();
        if body.len() < min as usize || body.len() > max as usize {
            // Only reachable when a caller builds a Header by hand.
            return Err(FrameError::BadLength {
                frame: ty,
                len: body.len() as u32,
                min,
                max,
            });
        }
        // Every fixed-size read below is covered by the minimum length checked above.
        Ok(match ty {
            FrameType::Hello => {
                if body[..4] != HELLO_MAGIC {
                    return Err(FrameError::Invalid {
                        frame: ty,
                        what: "magic (not a LokaDB tunnel)",
                    });
                }
                body.advance(4);
                let version = body.get_u16();
                let role = Role::from_u8(body.get_u8()).ok_or(FrameError::Invalid {
                    frame: ty,
                    what: "role",
                })?;
                let window = nonzero(ty, body.get_u32(), "window")?;
                let max_streams = body.get_u32();
                Frame::Hello(Hello {
                    version,
                    role,
                    window,
                    max_streams,
                    token: text(ty, body, "token")?,
                })
            }
            FrameType::HelloOk => Frame::HelloOk(HelloOk {
                version: body.get_u16(),
                window: nonzero(ty, body.get_u32(), "window")?,
                max_streams: body.get_u32(),
            }),
            FrameType::HelloReject => Frame::HelloReject {
                code: ErrorCode(body.get_u16()),
                reason: text(ty, body, "reason")?,
            },
            FrameType::Open => Frame::Open {
                stream,
                target: text(ty, body, "target")?,
            },
            FrameType::Data => Frame::Data {
                stream,
                payload: body,
            },
            FrameType::WindowUpdate => Frame::WindowUpdate {
                stream,
                increment: nonzero(ty, body.get_u32(), "increment")?,
            },
            FrameType::Close => Frame::Close { stream },
            FrameType::Reset => Frame::Reset {
                stream,
                code: ErrorCode(body.get_u16()),
                reason: text(ty, body, "reason")?,
            },
            FrameType::Ping => Frame::Ping(eight(&body)),
            FrameType::Pong => Frame::Pong(eight(&body)),
            FrameType::Drain => Frame::Drain,
        })
    }

    /// Appends the frame to `out`.
    ///
    /// A HELLO_REJECT or RESET reason longer than [`MAX_TEXT_LEN`] is cut at a
    /// character boundary.
    ///
    /// # Panics
    ///
    /// If a DATA payload exceeds [`MAX_FRAME_BODY`] or a token or target exceeds
    /// [`MAX_TEXT_LEN`]: the peer would refuse the frame, so building one is a bug in
    /// the caller. [`super::Tunnel`] never does.
    pub fn encode(&self, out: &mut BytesMut) {
        let stream = self.stream();
        write_frame(out, self.ty(), stream, |out| match self {
            Frame::Hello(h) => {
                assert!(h.token.len() <= MAX_TEXT_LEN, "HELLO token too long");
                out.put_slice(&HELLO_MAGIC);
                out.put_u16(h.version);
                out.put_u8(h.role.to_u8());
                out.put_u32(h.window);
                out.put_u32(h.max_streams);
                out.put_slice(h.token.as_bytes());
            }
            Frame::HelloOk(ok) => {
                out.put_u16(ok.version);
                out.put_u32(ok.window);
                out.put_u32(ok.max_streams);
            }
            Frame::HelloReject { code, reason } | Frame::Reset { code, reason, .. } => {
                out.put_u16(code.0);
                out.put_slice(cut_text(reason).as_bytes());
            }
            Frame::Open { target, .. } => {
                assert!(target.len() <= MAX_TEXT_LEN, "OPEN target too long");
                out.put_slice(target.as_bytes());
            }
            Frame::Data { payload, .. } => {
                assert!(payload.len() <= MAX_FRAME_BODY as usize, "DATA too long");
                out.put_slice(payload);
            }
            Frame::WindowUpdate { increment, .. } => out.put_u32(*increment),
            Frame::Close { .. } | Frame::Drain => {}
            Frame::Ping(p) | Frame::Pong(p) => out.put_slice(p),
        });
    }
}

/// The single framing helper: writes the header, lets `body` append the body, then
/// backpatches the length.
fn write_frame(
    out: &mut BytesMut,
    ty: FrameType,
    stream: StreamId,
    body: impl FnOnce(&mut BytesMut),
) {
    let start = out.len();
    out.put_u8(ty.tag());
    out.put_u8(0);
    out.put_u32(stream.0);
    out.put_u32(0);
    body(out);
    let len = (out.len() - start - HEADER_LEN) as u32;
    out[start + 6..start + HEADER_LEN].copy_from_slice(&len.to_be_bytes());
}

/// Reads a text field; its length is already bounded by the type's body length.
fn text(frame: FrameType, body: Bytes, what: &'static str) -> Result<String, FrameError> {
    String::from_utf8(body.to_vec()).map_err(|_| FrameError::Invalid { frame, what })
}

fn cut_text(s: &str) -> &str {
    crate::text::prefix(s, MAX_TEXT_LEN)
}

fn nonzero(frame: FrameType, v: u32, what: &'static str) -> Result<u32, FrameError> {
    if v == 0 {
        return Err(FrameError::Invalid { frame, what });
    }
    Ok(v)
}

fn eight(body: &[u8]) -> [u8; 8] {
    let mut p = [0; 8];
    p.copy_from_slice(&body[..8]);
    p
}

/// Why bytes received on a tunnel are not a valid frame. Every error is fatal to the
/// tunnel: framing cannot be resynchronised.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// The type byte names no frame type.
    #[error("unknown tunnel frame type 0x{tag:02x}")]
    UnknownType {
        /// The type byte received.
        tag: u8,
    },
    /// The frame travels on a stream its type does not allow.
    #[error("{frame} frame on {stream}, which that frame type may not use")]
    BadStream {
        /// The frame type.
        frame: FrameType,
        /// The stream id received.
        stream: StreamId,
    },
    /// The body length is outside the bounds of its type.
    #[error("{frame} frame with a {len}-byte body (allowed: {min} to {max} bytes)")]
    BadLength {
        /// The frame type.
        frame: FrameType,
        /// The length field received.
        len: u32,
        /// Smallest body allowed for the type.
        min: u32,
        /// Largest body allowed for the type.
        max: u32,
    },
    /// A field of the body holds a value the protocol forbids.
    #[error("{frame} frame with an invalid {what}")]
    Invalid {
        /// The frame type.
        frame: FrameType,
        /// Which field.
        what: &'static str,
    },
}

#[cfg(test)]
#[path = "frame_test.rs"]
pub(crate) mod tests;
