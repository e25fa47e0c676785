//! Bounds-checked readers over a message body. Every read checks its length first and
//! returns [`FrameError::Truncated`] instead of panicking on peer input.

use super::frame::FrameError;

/// A cursor over a message body.
#[derive(Debug, Clone)]
pub struct Fields<'a> {
    buf: &'a [u8],
    what: &'static str,
}

impl<'a> Fields<'a> {
    /// Starts reading `buf`; `what` names the message in errors.
    pub fn new(buf: &'a [u8], what: &'static str) -> Self {
        Fields { buf, what }
    }

    /// The bytes not read yet.
    pub fn rest(&self) -> &'a [u8] {
        self.buf
    }

    /// Whether everything has been read.
    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    /// Reads one byte.
    pub fn u8(&mut self) -> Result<u8, FrameError> {
        Ok(self.take(1)?[0])
    }

    /// Reads a big-endian Int16.
    pub fn i16(&mut self) -> Result<i16, FrameError> {
        let b = self.take(2)?;
        Ok(i16::from_be_bytes([b[0], b[1]]))
    }

    /// Reads a big-endian Int32.
    pub fn i32(&mut self) -> Result<i32, FrameError> {
        let b = self.take(4)?;
        Ok(i32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }

    /// Reads `n` bytes.
    pub fn take(&mut self, n: usize) -> Result<&'a [u8], FrameError> {
        if self.buf.len() < n {
            return Err(FrameError::Truncated { what: self.what });
        }
        let (head, tail) = self.buf.split_at(n);
        self.buf = tail;
        Ok(head)
    }

    /// Reads a NUL-terminated string (without the NUL) as raw bytes.
    pub fn cstr_bytes(&mut self) -> Result<&'a [u8], FrameError> {
        let end = memchr::memchr(0, self.buf).ok_or(FrameError::Truncated { what: self.what })?;
        let s = &self.buf[..end];
        self.buf = &self.buf[end + 1..];
        Ok(s)
    }

    /// Reads a NUL-terminated UTF-8 string.
    pub fn cstr(&mut self) -> Result<&'a str, FrameError> {
        let b = self.cstr_bytes()?;
        std::str::from_utf8(b).map_err(|_| FrameError::Invalid { what: self.what })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_fields_in_order() {
        let mut f = Fields::new(b"\0\x01\0\0\0\x02abc\0z", "test");
        assert_eq!(f.i16().unwrap(), 1);
        assert_eq!(f.i32().unwrap(), 2);
        assert_eq!(f.cstr().unwrap(), "abc");
        assert_eq!(f.u8().unwrap(), b'z');
        assert!(f.is_empty());
    }

    #[test]
    fn short_input_is_an_error_not_a_panic() {
        let mut f = Fields::new(b"\0\x01", "Bind");
        assert_eq!(f.i32(), Err(FrameError::Truncated { what: "Bind" }));
        let mut f = Fields::new(b"no-nul", "Query");
        assert_eq!(f.cstr(), Err(FrameError::Truncated { what: "Query" }));
    }
}
