//! Frame headers: peek tag and length, check them, and say how much is missing.

use std::fmt;

/// Length of a tagged message header: tag (1) + length (4).
pub const HEADER_LEN: usize = 5;

/// The header of a tagged message: its tag and the length of its body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// The message tag (see [`super::tags`]).
    pub tag: u8,
    /// The length field as sent: body length plus the 4 bytes of the field itself.
    pub len: u32,
}

impl Header {
    /// Reads a header from the start of `buf` without consuming anything.
    ///
    /// Returns `Ok(None)` while fewer than [`HEADER_LEN`] bytes are buffered — "need
    /// more bytes" is a value, not an error, so the hot path does not allocate for it.
    ///
    /// # Errors
    ///
    /// [`FrameError::BadLength`] when the length field is below 4 (it counts itself),
    /// [`FrameError::TooLarge`] when it exceeds `max_len`, so a hostile length never
    /// causes an allocation.
    #[inline]
    pub fn peek(buf: &[u8], max_len: u32) -> Result<Option<Header>, FrameError> {
        if buf.len() < HEADER_LEN {
            return Ok(None);
        }
        let tag = buf[0];
        let len = u32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]);
        if len < 4 {
            return Err(FrameError::BadLength { tag, len });
        }
        if len > max_len {
            return Err(FrameError::TooLarge {
                tag,
                len,
                max: max_len,
            });
        }
        Ok(Some(Header { tag, len }))
    }

    /// Total length of the frame on the wire: tag + length field + body.
    #[inline]
    pub fn frame_len(&self) -> usize {
        1 + self.len as usize
    }

    /// Length of the body alone.
    #[inline]
    pub fn body_len(&self) -> usize {
        self.len as usize - 4
    }
}

/// Why a byte stream is not valid protocol framing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FrameError {
    /// The length field is smaller than the 4 bytes it counts itself.
    BadLength {
        /// Tag of the offending message.
        tag: u8,
        /// The length field as received.
        len: u32,
    },
    /// The length field exceeds the configured maximum.
    TooLarge {
        /// Tag of the offending message.
        tag: u8,
        /// The length field as received.
        len: u32,
        /// The limit in force.
        max: u32,
    },
    /// A body ended before a field it must contain.
    Truncated {
        /// Which message or field was being read.
        what: &'static str,
    },
    /// A field holds a value the protocol does not allow.
    Invalid {
        /// Which message or field was being read.
        what: &'static str,
    },
}

impl fmt::Display for FrameError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FrameError::BadLength { tag, len } => {
                write!(f, "invalid message length {len} for message type {}", Tag(*tag))
            }
            FrameError::TooLarge { tag: 0, len, max } => {
                write!(f, "invalid length of startup packet: {len} bytes, the limit is {max}")
            }
            FrameError::TooLarge { tag, len, max } => write!(
                f,
                "message of type {} is {len} bytes, over the limit of {max} bytes (max_message_bytes)",
                Tag(*tag)
            ),
            FrameError::Truncated { what } => write!(f, "truncated {what}"),
            FrameError::Invalid { what } => write!(f, "invalid {what}"),
        }
    }
}

impl std::error::Error for FrameError {}

/// Displays a tag as a quoted character when printable, else as a number, the way
/// Postgres names it in "invalid frontend message type" errors.
#[derive(Debug, Clone, Copy)]
pub struct Tag(pub u8);

impl fmt::Display for Tag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_ascii_graphic() {
            write!(f, "'{}'", self.0 as char)
        } else {
            write!(f, "{}", self.0)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peek_needs_five_bytes() {
        assert_eq!(Header::peek(b"Q\0\0\0", 100), Ok(None));
    }

    #[test]
    fn peek_reads_tag_and_length() {
        let h = Header::peek(b"Q\0\0\0\x09SELECT", 100).unwrap().unwrap();
        assert_eq!(h, Header { tag: b'Q', len: 9 });
        assert_eq!(h.frame_len(), 10);
        assert_eq!(h.body_len(), 5);
    }

    #[test]
    fn peek_rejects_short_and_huge_lengths() {
        assert_eq!(
            Header::peek(b"Q\0\0\0\x03", 100),
            Err(FrameError::BadLength { tag: b'Q', len: 3 })
        );
        assert_eq!(
            Header::peek(b"d\x7f\xff\xff\xff", 1 << 20),
            Err(FrameError::TooLarge {
                tag: b'd',
                len: 0x7fff_ffff,
                max: 1 << 20
            })
        );
    }

    #[test]
    fn error_text_names_the_tag() {
        let e = FrameError::TooLarge {
            tag: b'Q',
            len: 10,
            max: 5,
        };
        assert_eq!(
            e.to_string(),
            "message of type 'Q' is 10 bytes, over the limit of 5 bytes (max_message_bytes)"
        );
        assert_eq!(Tag(0).to_string(), "0");
    }
}
