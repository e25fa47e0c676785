//! Calls from the application: handshake answers, and opening, writing, reading,
//! closing and resetting streams. A refused call changes nothing and sends nothing.

use std::time::Instant;

use bytes::Bytes;

use super::super::code::ErrorCode;
use super::super::error::StreamError;
use super::super::frame::{Frame, HelloOk, StreamId, MAX_TEXT_LEN, PROTOCOL_VERSION};
use super::super::stream::{Stream, Transition};
use super::{Phase, Read, Tunnel};

impl Tunnel {
    /// Relay: accepts the agent whose HELLO was reported by [`super::Event::Hello`].
    ///
    /// # Errors
    ///
    /// [`StreamError::NotReady`] unless a HELLO is awaiting an answer.
    pub fn handle_accept(&mut self, now: Instant) -> Result<(), StreamError> {
        self.expect_phase(Phase::HelloReceived)?;
        self.tick(now);
        self.control.push_back(Frame::HelloOk(HelloOk {
            version: PROTOCOL_VERSION,
            window: self.config.window,
            max_streams: self.config.max_streams,
        }));
        self.become_ready(now);
        Ok(())
    }

    /// Relay: refuses the agent (bad token, duplicate, draining). The tunnel ends
    /// once HELLO_REJECT is flushed.
    ///
    /// # Errors
    ///
    /// [`StreamError::NotReady`] unless a HELLO is awaiting an answer.
    pub fn handle_reject(&mut self, code: ErrorCode, reason: String) -> Result<(), StreamError> {
        self.expect_phase(Phase::HelloReceived)?;
        self.control.push_back(Frame::HelloReject { code, reason });
        self.phase = Phase::Closed;
        Ok(())
    }

    /// Opens a stream towards `target` (for the relay: the organization's
    /// database name). DATA may be written at once; it flows after the OPEN.
    ///
    /// # Errors
    ///
    /// [`StreamError::NotReady`], [`StreamError::Draining`],
    /// [`StreamError::Limit`] (the peer's `max_streams`, so the caller can refuse its
    /// client without a round trip), [`StreamError::TargetTooLong`],
    /// [`StreamError::IdsExhausted`].
    pub fn handle_open(&mut self, target: &str) -> Result<StreamId, StreamError> {
        self.expect_phase(Phase::Ready)?;
        if self.draining_local || self.draining_peer {
            return Err(StreamError::Draining);
        }
        if target.len() > MAX_TEXT_LEN {
            return Err(StreamError::TargetTooLong { len: target.len() });
        }
        let max = self.peer.map_or(0, |p| p.max_streams);
        if self.local_streams >= max {
            return Err(StreamError::Limit { max });
        }
        let id = u32::try_from(self.next_local_id).map_err(|_| StreamError::IdsExhausted)?;
        let stream = StreamId(id);
        self.next_local_id += 2;
        let send_window = self.peer_window();
        self.streams
            .insert(stream, Stream::new(false, send_window, self.config.window));
        self.local_streams += 1;
        self.stats.streams_opened += 1;
        self.control.push_back(Frame::Open {
            stream,
            target: target.to_owned(),
        });
        Ok(stream)
    }

    /// Queues `data` on the stream. It is sent as the stream's window allows;
    /// nothing beyond the window is sent. The driver applies backpressure to its
    /// source from [`crate::tunnel::StreamStats::queued`].
    ///
    /// # Errors
    ///
    /// [`StreamError::Unknown`], or [`StreamError::Closed`] after
    /// [`Tunnel::handle_close`].
    pub fn handle_write(&mut self, stream: StreamId, data: Bytes) -> Result<(), StreamError> {
        let s = self
            .streams
            .get_mut(&stream)
            .ok_or(StreamError::Unknown(stream))?;
        if !s.state.can_send() {
            return Err(StreamError::Closed(stream));
        }
        if !data.is_empty() {
            s.send.push(data);
            self.schedule(stream);
        }
        Ok(())
    }

    /// Reads up to `max` buffered bytes. Reading is what returns credit to the peer
    /// (a WINDOW_UPDATE once half the window has been read), so a stream whose
    /// reader stops holds at most one window and stalls only itself.
    ///
    /// # Errors
    ///
    /// [`StreamError::Unknown`] if the stream does not exist (or was reset).
    ///
    /// With [`super::Config::auto_window`], the time of the read is the latest `now`
    /// given to the tunnel; [`Tunnel::handle_read_at`] gives it exactly.
    pub fn handle_read(&mut self, stream: StreamId, max: usize) -> Result<Read, StreamError> {
        let s = self
            .streams
            .get_mut(&stream)
            .ok_or(StreamError::Unknown(stream))?;
        s.recv.signalled = false;
        let read = if !s.recv.buf.is_empty() {
            let n = max.min(s.recv.buf.len());
            let data = s.recv.buf.split_to(n).freeze();
            let before = s.recv.consumed;
            s.recv.consumed += n as u64;
            s.recv.last_read = Some(self.clock);
            self.settle(stream);
            self.measure_read(stream, before);
            self.queue_update(stream);
            Read::Data(data)
        } else if s.state.can_receive() {
            Read::Blocked
        } else {
            s.recv.eof_read = true;
            Read::Finished
        };
        self.remove_if_done(stream);
        Ok(read)
    }

    /// [`Tunnel::handle_read`] at `now`: drivers that enable
    /// [`super::Config::auto_window`] read with it (or give the time to another
    /// `handle_*` call just before), so that the time a window takes to read is
    /// measured exactly.
    ///
    /// # Errors
    ///
    /// [`StreamError::Unknown`] if the stream does not exist (or was reset).
    pub fn handle_read_at(
        &mut self,
        now: Instant,
        stream: StreamId,
        max: usize,
    ) -> Result<Read, StreamError> {
        self.tick(now);
        self.handle_read(stream, max)
    }

    /// Closes the sending side of the stream: a CLOSE follows the bytes already
    /// written. The peer may go on sending until it closes too.
    ///
    /// # Errors
    ///
    /// [`StreamError::Unknown`], or [`StreamError::Closed`] if already closed.
    pub fn handle_close(&mut self, stream: StreamId) -> Result<(), StreamError> {
        let s = self
            .streams
            .get_mut(&stream)
            .ok_or(StreamError::Unknown(stream))?;
        s.state = s
            .state
            .next(Transition::LocalClose)
            .ok_or(StreamError::Closed(stream))?;
        self.schedule(stream);
        Ok(())
    }

    /// Aborts the stream both ways: queued and buffered bytes are dropped and the
    /// peer gets RESET with `code` and `reason`.
    ///
    /// # Errors
    ///
    /// [`StreamError::Unknown`].
    pub fn handle_reset(
        &mut self,
        stream: StreamId,
        code: ErrorCode,
        reason: String,
    ) -> Result<(), StreamError> {
        self.remove(stream).ok_or(StreamError::Unknown(stream))?;
        self.control.push_back(Frame::Reset {
            stream,
            code,
            reason,
        });
        Ok(())
    }

    /// Starts draining: DRAIN is sent, the peer's new OPENs are refused, and
    /// [`Tunnel::handle_open`] fails. Existing streams continue.
    ///
    /// # Errors
    ///
    /// [`StreamError::NotReady`] before the handshake completes.
    pub fn handle_drain(&mut self) -> Result<(), StreamError> {
        self.expect_phase(Phase::Ready)?;
        if !self.draining_local {
            self.draining_local = true;
            self.control.push_back(Frame::Drain);
        }
        Ok(())
    }
}
