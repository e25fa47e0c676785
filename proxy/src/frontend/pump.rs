//! The hot path: one direction of a session's byte stream, framed but not decoded.
//!
//! A [`Pipe`] reads into a reusable buffer, walks frame headers, and hands the
//! [`Inspect`]or only the frames it asks to see whole (statements, ReadyForQuery);
//! everything else — DataRow, CopyData, a 50 MB Bind — streams through in pieces
//! without being buffered whole. Bytes are written out from the same buffer: one copy
//! in (the kernel's), one copy out.

use futures_lite::{AsyncRead, AsyncWrite};
use lokadb_shared::wire::{FrameError, Header};
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

/// Default buffer size of a pipe; grows for a whole inspected frame, shrinks back after.
pub const PIPE_BUFFER: usize = 16 * 1024;

/// The most spare buffers a core keeps for its pipes (4 MiB).
const SPARES_MAX: usize = 256;

thread_local! {
    /// Buffers of this core's pipes that hold nothing now, for the next pipe that reads: an
    /// idle session holds none (the runtime reads into its own ring until data arrives), and
    /// taking one costs a pop, not an allocation. Per thread, so per core: no lock.
    static SPARES: std::cell::RefCell<Vec<Vec<u8>>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// A buffer of [`PIPE_BUFFER`] bytes: a spare one, else a new one.
fn take_buffer() -> Vec<u8> {
    SPARES
        .with(|s| s.borrow_mut().pop())
        .unwrap_or_else(|| vec![0; PIPE_BUFFER])
}

/// Keeps a buffer of the usual size for the next pipe; drops a grown one.
fn give_buffer(buf: Vec<u8>) {
    if buf.len() == PIPE_BUFFER {
        SPARES.with(|s| {
            let mut spares = s.borrow_mut();
            if spares.len() < SPARES_MAX {
                spares.push(buf);
            }
        });
    }
}

/// What to do with a frame the inspector saw whole.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Forward it.
    Forward,
    /// Do not forward it, and stop reading this direction (client Terminate).
    Stop,
    /// Forward these bytes (whole frames) in its place (a refused statement becomes one
    /// that makes the server answer with the refusal, in the stream's order); empty drops it.
    Replace(Vec<u8>),
    /// Not yet: stop before this frame (nothing of it is consumed) until [`Pipe::release`];
    /// the frame is then shown again. The session uses it to change a statement's
    /// destination once what was sent before it is answered.
    Hold,
}

/// Sees the frames of one direction.
pub trait Inspect {
    /// Whether the inspector needs the whole frame with this tag in one piece.
    fn wants_body(&self, tag: u8) -> bool;
    /// Called for every frame once its header is read; `frame` is the whole frame
    /// (header included) when [`Inspect::wants_body`] said so, else `None`.
    fn on_frame(&mut self, header: Header, frame: Option<&[u8]>) -> Action;
    /// Sees the bytes of each read as they came (traffic recording).
    #[inline]
    fn on_read(&mut self, _bytes: &[u8]) {}
}

/// One direction of a session.
pub struct Pipe {
    buf: Vec<u8>,
    /// First byte not yet written out.
    start: usize,
    /// Bytes `start..scanned` are cleared to be written.
    scanned: usize,
    /// Bytes `..end` have been read.
    end: usize,
    /// Bytes of a streamed frame that have not been read yet.
    pass: usize,
    max_frame: u32,
    /// The reader reached EOF, or the inspector stopped it.
    pub read_closed: bool,
    /// A frame the inspector stopped on, or EOF, means no more reads.
    pub stopped: bool,
    /// The inspector asked to hold the next frame ([`Action::Hold`]).
    pub held: bool,
}

impl Pipe {
    /// A pipe whose frames may be at most `max_frame` bytes (the length field).
    pub fn new(max_frame: u32) -> Pipe {
        Pipe {
            buf: Vec::new(),
            start: 0,
            scanned: 0,
            end: 0,
            pass: 0,
            max_frame,
            read_closed: false,
            stopped: false,
            held: false,
        }
    }

    /// Lets a held frame be shown to the inspector again on the next step.
    pub fn release(&mut self) {
        self.held = false;
    }

    /// Puts bytes already read elsewhere (e.g. during login) in front of the stream.
    pub fn preload(&mut self, bytes: &[u8]) {
        if bytes.is_empty() {
            return;
        }
        if self.buf.is_empty() {
            self.buf = take_buffer();
        }
        if self.buf.len() < bytes.len() {
            self.buf.resize(bytes.len(), 0);
        }
        self.buf[..bytes.len()].copy_from_slice(bytes);
        self.end = bytes.len();
    }

    /// Whether everything cleared for writing has been written.
    pub fn is_flushed(&self) -> bool {
        self.start == self.scanned
    }

    /// Whether the stream is between frames: nothing partial read or written.
    pub fn at_frame_boundary(&self) -> bool {
        self.pass == 0 && self.scanned == self.end
    }

    /// Whether bytes are buffered that have not been written.
    pub fn has_unwritten(&self) -> bool {
        self.start < self.end
    }

    /// Appends bytes the proxy itself wants written after what is cleared (errors).
    /// Only valid at a frame boundary.
    pub fn inject(&mut self, bytes: &[u8]) {
        debug_assert!(self.at_frame_boundary());
        if self.buf.is_empty() {
            self.buf = take_buffer();
        }
        if self.buf.len() - self.end < bytes.len() {
            self.buf.resize(self.end + bytes.len(), 0);
        }
        self.buf[self.end..self.end + bytes.len()].copy_from_slice(bytes);
        self.end += bytes.len();
        self.scanned = self.end;
    }

    /// Reads what is available, scans it, and writes what is cleared. Returns
    /// `Ready(Ok(true))` when it made progress, `Pending` when both sides would block.
    ///
    /// # Errors
    ///
    /// [`PipeError::Read`] / [`PipeError::Write`] for socket errors and
    /// [`PipeError::Frame`] for bad framing (the bytes before it are still written).
    pub fn poll_step<R, W, I>(
        &mut self,
        cx: &mut Context<'_>,
        mut reader: Pin<&mut R>,
        mut writer: Pin<&mut W>,
        inspect: &mut I,
    ) -> Poll<Result<bool, PipeError>>
    where
        R: AsyncRead + ?Sized,
        W: AsyncWrite + ?Sized,
        I: Inspect,
    {
        let mut progress = false;
        if self.buf.is_empty() {
            self.buf = take_buffer();
        }
        if !self.stopped && self.make_room() {
            match reader.as_mut().poll_read(cx, &mut self.buf[self.end..]) {
                Poll::Ready(Ok(0)) => {
                    self.read_closed = true;
                    self.stopped = true;
                    progress = true;
                }
                Poll::Ready(Ok(n)) => {
                    inspect.on_read(&self.buf[self.end..self.end + n]);
                    self.end += n;
                    progress = true;
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Err(PipeError::Read(e))),
                Poll::Pending => {}
            }
        }
        // Room made for a frame wanted whole counts as progress: the read that fills it
        // comes on the next step (a frame held at its header and shown again once released
        // may find the buffer full, with no read pending to wake the session).
        if self.scanned < self.end && self.scan(inspect).map_err(PipeError::Frame)? {
            progress = true;
        }
        while self.start < self.scanned {
            match writer
                .as_mut()
                .poll_write(cx, &self.buf[self.start..self.scanned])
            {
                Poll::Ready(Ok(0)) => {
                    return Poll::Ready(Err(PipeError::Write(io::ErrorKind::WriteZero.into())));
                }
                Poll::Ready(Ok(n)) => {
                    self.start += n;
                    progress = true;
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Err(PipeError::Write(e))),
                Poll::Pending => break,
            }
        }
        if self.start == self.scanned && progress {
            // TLS buffers records until flushed; plain TCP's flush is free.
            if let Poll::Ready(Err(e)) = writer.as_mut().poll_flush(cx) {
                return Poll::Ready(Err(PipeError::Write(e)));
            }
        }
        // Holding nothing, the pipe gives its buffer back until its next read.
        if self.start == self.end {
            self.start = 0;
            self.scanned = 0;
            self.end = 0;
            give_buffer(std::mem::take(&mut self.buf));
        }
        if progress {
            Poll::Ready(Ok(true))
        } else {
            Poll::Pending
        }
    }

    /// Makes sure there is space to read into; false when the buffer is full of bytes
    /// waiting to be written (then the write side's waker drives us).
    fn make_room(&mut self) -> bool {
        if self.end < self.buf.len() {
            return true;
        }
        if self.start > 0 {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.scanned -= self.start;
            self.start = 0;
        }
        self.end < self.buf.len()
    }

    /// Walks the frames read so far, advancing `scanned` over what may be written. True when
    /// it made room to read the rest of a frame wanted whole into.
    fn scan<I: Inspect>(&mut self, inspect: &mut I) -> Result<bool, FrameError> {
        loop {
            if self.held {
                return Ok(false);
            }
            if self.pass > 0 {
                let n = self.pass.min(self.end - self.scanned);
                self.scanned += n;
                self.pass -= n;
                if self.pass > 0 {
                    return Ok(false);
                }
            }
            let Some(header) = Header::peek(&self.buf[self.scanned..self.end], self.max_frame)?
            else {
                return Ok(false);
            };
            let frame_len = header.frame_len();
            if inspect.wants_body(header.tag) {
                if self.end - self.scanned < frame_len {
                    let full = self.end == self.buf.len();
                    self.reserve_frame(frame_len);
                    return Ok(full && self.end < self.buf.len());
                }
                let frame = &self.buf[self.scanned..self.scanned + frame_len];
                match inspect.on_frame(header, Some(frame)) {
                    Action::Forward => self.scanned += frame_len,
                    Action::Replace(bytes) => {
                        self.splice(self.scanned, frame_len, &bytes);
                        self.scanned += bytes.len();
                    }
                    Action::Stop => {
                        // Drop the frame and anything after it.
                        self.end = self.scanned;
                        self.stopped = true;
                        return Ok(false);
                    }
                    Action::Hold => {
                        self.held = true;
                        return Ok(false);
                    }
                }
            } else {
                if inspect.on_frame(header, None) == Action::Hold {
                    self.held = true;
                    return Ok(false);
                }
                let avail = frame_len.min(self.end - self.scanned);
                self.scanned += avail;
                self.pass = frame_len - avail;
            }
        }
    }

    /// Replaces the `old_len` bytes at `at` (read, not yet scanned) with `bytes`.
    fn splice(&mut self, at: usize, old_len: usize, bytes: &[u8]) {
        let new_end = self.end - old_len + bytes.len();
        if new_end > self.buf.len() {
            self.buf.resize(new_end, 0);
        }
        self.buf
            .copy_within(at + old_len..self.end, at + bytes.len());
        self.buf[at..at + bytes.len()].copy_from_slice(bytes);
        self.end = new_end;
    }

    /// Grows or compacts the buffer towards a frame of `frame_len` starting at `scanned`.
    /// Memory follows the bytes received, not the length the peer declared: the room for the
    /// frame at most doubles what it has brought so far, so a header declaring 4 GiB
    /// followed by a few bytes costs a few kilobytes (it grows again as the bytes come).
    fn reserve_frame(&mut self, frame_len: usize) {
        if self.buf.len() - self.scanned >= frame_len {
            return;
        }
        if self.start > 0 {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.scanned -= self.start;
            self.start = 0;
        }
        let have = self.end - self.scanned;
        let room = frame_len.min((2 * have).max(PIPE_BUFFER));
        if self.buf.len() - self.scanned < room {
            self.buf.resize(self.scanned + room, 0);
        }
    }
}

/// Why a pipe stopped.
#[derive(Debug)]
pub enum PipeError {
    /// Reading failed.
    Read(io::Error),
    /// Writing failed.
    Write(io::Error),
    /// The reader broke the framing rules.
    Frame(FrameError),
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_lite::future::block_on;
    use lokadb_shared::wire::tags::*;

    /// Records every frame and asks for the bodies of Query and Terminate.
    #[derive(Default)]
    struct Recorder {
        seen: Vec<(u8, Option<Vec<u8>>)>,
    }

    impl Inspect for Recorder {
        fn wants_body(&self, tag: u8) -> bool {
            tag == FE_QUERY || tag == FE_TERMINATE
        }
        fn on_frame(&mut self, h: Header, frame: Option<&[u8]>) -> Action {
            self.seen.push((h.tag, frame.map(<[u8]>::to_vec)));
            if h.tag == FE_TERMINATE {
                Action::Stop
            } else {
                Action::Forward
            }
        }
    }

    fn run(input: Vec<u8>, chunk: usize, max: u32) -> (Vec<u8>, Recorder, Result<(), String>) {
        let mut pipe = Pipe::new(max);
        let mut reader = super::proptests::Script::new(input, vec![chunk]);
        let mut out: Vec<u8> = Vec::new();
        let mut rec = Recorder::default();
        let result = block_on(futures_lite::future::poll_fn(|cx| loop {
            match pipe.poll_step(cx, Pin::new(&mut reader), Pin::new(&mut out), &mut rec) {
                Poll::Ready(Ok(_)) if pipe.stopped && pipe.is_flushed() => {
                    return Poll::Ready(Ok(()))
                }
                Poll::Ready(Ok(_)) => continue,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(format!("{e:?}"))),
                Poll::Pending => return Poll::Ready(Err("pending".into())),
            }
        }));
        (out, rec, result)
    }

    fn frame(tag: u8, body: &[u8]) -> Vec<u8> {
        let mut v = vec![tag];
        v.extend_from_slice(&((body.len() + 4) as u32).to_be_bytes());
        v.extend_from_slice(body);
        v
    }

    #[test]
    fn forwards_bytes_exactly_and_stops_at_terminate() {
        let mut input = frame(FE_QUERY, b"SELECT 1\0");
        input.extend(frame(FE_COPY_DATA, &vec![7u8; 200_000]));
        input.extend(frame(FE_SYNC, b""));
        let forwarded = input.clone();
        input.extend(frame(FE_TERMINATE, b""));
        input.extend(b"junk after terminate");
        for chunk in [1, 3, 4096, 1 << 20] {
            let (out, rec, result) = run(input.clone(), chunk, 1 << 20);
            assert_eq!(result, Ok(()));
            assert_eq!(out, forwarded, "chunk {chunk}");
            let tags: Vec<u8> = rec.seen.iter().map(|s| s.0).collect();
            assert_eq!(tags, vec![FE_QUERY, FE_COPY_DATA, FE_SYNC, FE_TERMINATE]);
            assert_eq!(
                rec.seen[0].1.as_deref(),
                Some(&frame(FE_QUERY, b"SELECT 1\0")[..])
            );
            assert_eq!(rec.seen[1].1, None, "CopyData streams through");
        }
    }

    /// Replaces each Query with the frame given, keeps the rest.
    struct Replacer(Vec<u8>);

    impl Inspect for Replacer {
        fn wants_body(&self, tag: u8) -> bool {
            tag == FE_QUERY
        }
        fn on_frame(&mut self, h: Header, _: Option<&[u8]>) -> Action {
            if h.tag == FE_QUERY {
                Action::Replace(self.0.clone())
            } else {
                Action::Forward
            }
        }
    }

    #[test]
    fn a_replaced_frame_goes_out_in_its_place_longer_or_shorter() {
        let mut input = frame(FE_SYNC, b"");
        input.extend(frame(FE_QUERY, b"COPY t TO STDOUT\0"));
        input.extend(frame(FE_COPY_DATA, &[9u8; 3000]));
        input.extend(frame(FE_QUERY, b"again\0"));
        input.extend(frame(FE_SYNC, b""));
        for replacement in [frame(FE_QUERY, &[b'x'; 20_000]), frame(FE_QUERY, b"\0")] {
            let mut expected = frame(FE_SYNC, b"");
            expected.extend(&replacement);
            expected.extend(frame(FE_COPY_DATA, &[9u8; 3000]));
            expected.extend(&replacement);
            expected.extend(frame(FE_SYNC, b""));
            for chunk in [1, 7, 4096, 1 << 20] {
                let mut pipe = Pipe::new(1 << 20);
                let mut reader = super::proptests::Script::new(input.clone(), vec![chunk]);
                let mut out: Vec<u8> = Vec::new();
                let mut r = Replacer(replacement.clone());
                block_on(futures_lite::future::poll_fn(|cx| loop {
                    match pipe.poll_step(cx, Pin::new(&mut reader), Pin::new(&mut out), &mut r) {
                        Poll::Ready(Ok(_)) if pipe.stopped && pipe.is_flushed() => {
                            return Poll::Ready(())
                        }
                        Poll::Ready(Ok(_)) => continue,
                        other => panic!("{other:?}"),
                    }
                }));
                assert_eq!(out, expected, "chunk {chunk}");
            }
        }
    }

    #[test]
    fn an_inspected_frame_larger_than_the_buffer_is_assembled() {
        let mut body = vec![b'x'; 3 * PIPE_BUFFER];
        body.push(0);
        let mut input = frame(FE_QUERY, &body);
        input.extend(frame(FE_TERMINATE, b""));
        let (out, rec, result) = run(input, 1000, 1 << 20);
        assert_eq!(result, Ok(()));
        assert_eq!(out, frame(FE_QUERY, &body));
        assert_eq!(rec.seen[0].1.as_ref().map(Vec::len), Some(body.len() + 5));
    }

    #[test]
    fn an_oversized_length_is_refused_before_allocating() {
        let mut input = frame(FE_SYNC, b"");
        input.extend([FE_QUERY, 0x7f, 0xff, 0xff, 0xff]);
        let (out, _, result) = run(input, 64, 1 << 20);
        assert!(result.unwrap_err().contains("TooLarge"));
        assert_eq!(
            out,
            Vec::<u8>::new(),
            "nothing written yet: the error stops the step"
        );
    }
}

/// Property tests: the framing never panics and never changes, drops or reorders bytes,
/// whatever the frames and however the reads are cut.
#[cfg(test)]
mod proptests {
    use super::*;
    use futures_lite::future::block_on;
    use lokadb_shared::wire::tags::*;
    use proptest::prelude::*;

    struct Counter {
        frames: usize,
        inspected: usize,
    }

    impl Inspect for Counter {
        fn wants_body(&self, tag: u8) -> bool {
            tag == FE_QUERY || tag == FE_PARSE
        }
        fn on_frame(&mut self, _: Header, frame: Option<&[u8]>) -> Action {
            self.frames += 1;
            self.inspected += usize::from(frame.is_some());
            Action::Forward
        }
    }

    /// Reads `data` in the given chunk sizes (cycled), then EOF.
    pub(super) struct Script {
        data: Vec<u8>,
        pos: usize,
        chunks: Vec<usize>,
        next: usize,
    }

    impl Script {
        pub(super) fn new(data: Vec<u8>, chunks: Vec<usize>) -> Script {
            Script {
                data,
                pos: 0,
                chunks,
                next: 0,
            }
        }
    }

    impl AsyncRead for Script {
        fn poll_read(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
            buf: &mut [u8],
        ) -> Poll<io::Result<usize>> {
            let chunk = self.chunks[self.next % self.chunks.len()].max(1);
            self.next += 1;
            let n = chunk.min(buf.len()).min(self.data.len() - self.pos);
            buf[..n].copy_from_slice(&self.data[self.pos..self.pos + n]);
            self.pos += n;
            Poll::Ready(Ok(n))
        }
    }

    /// Accepts at most `limit` bytes per write, to exercise partial writes.
    struct Slow {
        out: Vec<u8>,
        limit: usize,
    }

    impl AsyncWrite for Slow {
        fn poll_write(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<io::Result<usize>> {
            let n = buf.len().min(self.limit);
            self.out.extend_from_slice(&buf[..n]);
            Poll::Ready(Ok(n))
        }
        fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
        fn poll_close(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    fn drive(
        input: Vec<u8>,
        chunks: Vec<usize>,
        write_limit: usize,
        max: u32,
    ) -> (Vec<u8>, Counter, Option<PipeError>) {
        let mut pipe = Pipe::new(max);
        let mut reader = Script::new(input, chunks);
        let mut writer = Slow {
            out: Vec::new(),
            limit: write_limit,
        };
        let mut counter = Counter {
            frames: 0,
            inspected: 0,
        };
        let err = block_on(futures_lite::future::poll_fn(|cx| loop {
            match pipe.poll_step(
                cx,
                Pin::new(&mut reader),
                Pin::new(&mut writer),
                &mut counter,
            ) {
                Poll::Ready(Ok(_)) if pipe.stopped && pipe.is_flushed() => {
                    return Poll::Ready(None)
                }
                Poll::Ready(Ok(_)) => continue,
                Poll::Ready(Err(e)) => return Poll::Ready(Some(e)),
                Poll::Pending => return Poll::Ready(None),
            }
        }));
        (writer.out, counter, err)
    }

    fn frames() -> impl Strategy<Value = Vec<(u8, Vec<u8>)>> {
        let tag = prop::sample::select(vec![
            FE_QUERY,
            FE_PARSE,
            FE_BIND,
            FE_SYNC,
            FE_COPY_DATA,
            FE_EXECUTE,
        ]);
        prop::collection::vec((tag, prop::collection::vec(any::<u8>(), 0..3000)), 0..40)
    }

    /// A frame whose header declares far more than arrives.
    fn declared(len: u32, sent: usize) -> Vec<u8> {
        let mut input = vec![FE_QUERY];
        input.extend_from_slice(&len.to_be_bytes());
        input.extend(std::iter::repeat_n(b'x', sent));
        input
    }

    /// Runs `pipe` over `input` until the reader is exhausted; the pipe's buffer size.
    fn buffered(pipe: &mut Pipe, input: Vec<u8>) -> usize {
        let mut reader = Script::new(input, vec![4096]);
        let mut writer = Slow {
            out: Vec::new(),
            limit: usize::MAX,
        };
        let mut counter = Counter {
            frames: 0,
            inspected: 0,
        };
        block_on(futures_lite::future::poll_fn(|cx| loop {
            match pipe.poll_step(
                cx,
                Pin::new(&mut reader),
                Pin::new(&mut writer),
                &mut counter,
            ) {
                Poll::Ready(Ok(_)) if !pipe.read_closed => continue,
                _ => return Poll::Ready(()),
            }
        }));
        pipe.buf.len()
    }

    #[test]
    fn memory_follows_the_bytes_received_not_the_declared_length() {
        // 4 GiB declared, a few bytes sent: a buffer of the usual size.
        let mut pipe = Pipe::new(u32::MAX);
        assert_eq!(buffered(&mut pipe, declared(u32::MAX, 10)), PIPE_BUFFER);
        // 1 GiB declared, 1 MiB sent: at most about twice what came.
        let mut pipe = Pipe::new(u32::MAX);
        let len = buffered(&mut pipe, declared(1 << 30, 1 << 20));
        assert!(len <= 3 << 20, "{len} bytes buffered for 1 MiB received");
    }

    proptest! {
        #[test]
        fn valid_frames_pass_through_unchanged(
            frames in frames(),
            chunks in prop::collection::vec(1usize..9000, 1..8),
            write_limit in 1usize..70_000,
        ) {
            let mut input = Vec::new();
            for (tag, body) in &frames {
                input.push(*tag);
                input.extend_from_slice(&((body.len() + 4) as u32).to_be_bytes());
                input.extend_from_slice(body);
            }
            let (out, counter, err) = drive(input.clone(), chunks, write_limit, 1 << 20);
            prop_assert!(err.is_none());
            prop_assert_eq!(out, input);
            prop_assert_eq!(counter.frames, frames.len());
            let inspected = frames.iter().filter(|(t, _)| *t == FE_QUERY || *t == FE_PARSE).count();
            prop_assert_eq!(counter.inspected, inspected);
        }

        #[test]
        fn arbitrary_bytes_never_panic(
            input in prop::collection::vec(any::<u8>(), 0..5000),
            chunks in prop::collection::vec(1usize..600, 1..5),
        ) {
            let (out, _, err) = drive(input.clone(), chunks, 4096, 4096);
            // Whatever was forwarded is a prefix of the input: nothing invented.
            prop_assert!(input.starts_with(&out));
            if err.is_none() {
                // Only an incomplete frame at EOF stays behind.
                let tail = &input[out.len()..];
                if tail.len() >= 5 {
                    let len = u32::from_be_bytes([tail[1], tail[2], tail[3], tail[4]]) as usize;
                    prop_assert!(1 + len > tail.len(), "a whole frame was held back");
                }
            }
        }
    }
}
