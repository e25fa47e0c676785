//! Frames from the peer: the handshake, stream frames, and the tunnel-wide ones.
//!
//! Each rule for a frame that arrives where it should not is here, next to the
//! frame: a stream fault resets that stream; a fault no correct peer commits ends
//! the tunnel with a [`TunnelError`].

use std::time::Instant;

use super::super::code::ErrorCode;
use super::super::error::TunnelError;
use super::super::frame::{Frame, FrameType, Hello, HelloOk, Role, StreamId, PROTOCOL_VERSION};
use super::super::stream::{Stream, Transition};
use super::{Event, PeerSettings, Phase, Tunnel, MAX_QUEUED_CONTROL};

impl Tunnel {
    pub(super) fn on_frame(&mut self, now: Instant, frame: Frame) -> Result<(), TunnelError> {
        if let Frame::Reset {
            stream: StreamId::TUNNEL,
            code,
            reason,
        } = frame
        {
            return Err(TunnelError::PeerAborted { code, reason });
        }
        match (self.phase, frame) {
            (Phase::AwaitHello, Frame::Hello(hello)) => self.on_hello(hello),
            (Phase::AwaitHelloOk, Frame::HelloOk(ok)) => self.on_hello_ok(now, ok),
            (Phase::AwaitHelloOk, Frame::HelloReject { code, reason }) => {
                Err(TunnelError::Rejected { code, reason })
            }
            (Phase::Ready, frame) => self.on_ready_frame(now, frame),
            (phase, frame) => Err(TunnelError::Unexpected {
                frame: frame.ty(),
                phase: phase.describe(),
            }),
        }
    }

    fn on_hello(&mut self, hello: Hello) -> Result<(), TunnelError> {
        if hello.version != PROTOCOL_VERSION {
            self.control.push_back(Frame::HelloReject {
                code: ErrorCode::BAD_VERSION,
                reason: format!(
                    "relay speaks tunnel protocol version {PROTOCOL_VERSION}, agent sent {}",
                    hello.version
                ),
            });
            return Err(TunnelError::Version {
                ours: PROTOCOL_VERSION,
                theirs: hello.version,
            });
        }
        if hello.role != Role::Agent {
            self.control.push_back(Frame::HelloReject {
                code: ErrorCode::BAD_ROLE,
                reason: format!("HELLO from a {}; only agents connect here", hello.role),
            });
            return Err(TunnelError::Role { got: hello.role });
        }
        self.peer = Some(PeerSettings {
            version: hello.version,
            window: hello.window,
            max_streams: hello.max_streams,
        });
        self.phase = Phase::HelloReceived;
        self.events.push_back(Event::Hello(hello));
        Ok(())
    }

    fn on_hello_ok(&mut self, now: Instant, ok: HelloOk) -> Result<(), TunnelError> {
        if ok.version != PROTOCOL_VERSION {
            return Err(TunnelError::Version {
                ours: PROTOCOL_VERSION,
                theirs: ok.version,
            });
        }
        let settings = PeerSettings {
            version: ok.version,
            window: ok.window,
            max_streams: ok.max_streams,
        };
        self.peer = Some(settings);
        self.become_ready(now);
        self.events.push_back(Event::Connected(settings));
        Ok(())
    }

    pub(super) fn become_ready(&mut self, now: Instant) {
        self.phase = Phase::Ready;
        self.next_ping = self.config.keepalive.map(|every| now + every);
    }

    fn on_ready_frame(&mut self, now: Instant, frame: Frame) -> Result<(), TunnelError> {
        match frame {
            Frame::Open { stream, target } => self.on_open(stream, target),
            Frame::Data { stream, payload } => self.on_data(stream, &payload),
            Frame::WindowUpdate { stream, increment } => {
                let Some(s) = self.streams.get_mut(&stream) else {
                    return self.on_absent(FrameType::WindowUpdate, stream);
                };
                s.send.add_credit(increment);
                self.schedule(stream);
                Ok(())
            }
            Frame::Close { stream } => self.on_close(stream),
            Frame::Reset {
                stream,
                code,
                reason,
            } => {
                if self.remove(stream).is_some() {
                    self.events.push_back(Event::Reset {
                        stream,
                        code,
                        reason,
                        remote: true,
                    });
                }
                // RESET for an absent stream is ignored: never answer a RESET.
                Ok(())
            }
            Frame::Ping(payload) => self.reply(Frame::Pong(payload)),
            Frame::Pong(payload) => {
                if let Some((seq, at)) = self.ping_out {
                    if payload == seq.to_be_bytes() {
                        self.rtt = Some(now.saturating_duration_since(at));
                        self.ping_out = None;
                    }
                }
                Ok(())
            }
            Frame::Drain => {
                if !self.draining_peer {
                    self.draining_peer = true;
                    self.events.push_back(Event::Drain);
                }
                Ok(())
            }
            frame @ (Frame::Hello(_) | Frame::HelloOk(_) | Frame::HelloReject { .. }) => {
                Err(TunnelError::Unexpected {
                    frame: frame.ty(),
                    phase: "the handshake is over",
                })
            }
        }
    }

    fn on_open(&mut self, stream: StreamId, target: String) -> Result<(), TunnelError> {
        if stream.opener() == Some(self.role) {
            return Err(TunnelError::Violation {
                frame: FrameType::Open,
                stream,
                what: "the peer may not open ids of this end's parity",
            });
        }
        if stream.0 <= self.highest_peer_id {
            return Err(TunnelError::Violation {
                frame: FrameType::Open,
                stream,
                what: "stream ids must increase",
            });
        }
        self.highest_peer_id = stream.0;
        let refusal = if self.draining_local {
            Some(format!(
                "this {} is draining: open the stream on another tunnel",
                self.role
            ))
        } else if self.peer_streams >= self.config.max_streams {
            Some(format!(
                "stream limit of this {} reached ({} concurrent streams)",
                self.role, self.config.max_streams
            ))
        } else {
            None
        };
        if let Some(reason) = refusal {
            self.stats.streams_refused += 1;
            return self.reply(Frame::Reset {
                stream,
                code: ErrorCode::REFUSED,
                reason,
            });
        }
        let send_window = self.peer_window();
        self.streams
            .insert(stream, Stream::new(true, send_window, self.config.window));
        self.peer_streams += 1;
        self.stats.streams_opened += 1;
        self.events.push_back(Event::Opened { stream, target });
        Ok(())
    }

    fn on_data(&mut self, stream: StreamId, payload: &[u8]) -> Result<(), TunnelError> {
        let Some(s) = self.streams.get_mut(&stream) else {
            return self.on_absent(FrameType::Data, stream);
        };
        if !s.state.can_receive() {
            return self.stream_fault(
                stream,
                ErrorCode::STREAM_CLOSED,
                format!("DATA on {stream} after its CLOSE"),
            );
        }
        if !s.recv.fits(payload.len()) {
            let reason = format!(
                "{}-byte DATA on {stream} exceeds its window: {} of {} bytes granted already used",
                payload.len(),
                s.recv.received,
                s.recv.limit
            );
            self.stats.flow_violations += 1;
            return self.stream_fault(stream, ErrorCode::FLOW_CONTROL, reason);
        }
        if !self.charge_arrival(stream, payload.len())? {
            return Ok(()); // shed: this stream's reader was the slowest
        }
        let Some(s) = self.streams.get_mut(&stream) else {
            return Ok(());
        };
        s.recv.push(payload);
        self.stats.bytes_received += payload.len() as u64;
        if !payload.is_empty() && !s.recv.signalled {
            s.recv.signalled = true;
            self.events.push_back(Event::Readable(stream));
        }
        Ok(())
    }

    fn on_close(&mut self, stream: StreamId) -> Result<(), TunnelError> {
        let Some(s) = self.streams.get_mut(&stream) else {
            return self.on_absent(FrameType::Close, stream);
        };
        let Some(next) = s.state.next(Transition::RemoteClose) else {
            return self.stream_fault(
                stream,
                ErrorCode::STREAM_CLOSED,
                format!("second CLOSE on {stream}"),
            );
        };
        s.state = next;
        self.events.push_back(Event::Finished(stream));
        self.remove_if_done(stream);
        Ok(())
    }

    /// A frame for a stream not in the table. Late frames for a closed stream are
    /// normal (they crossed our RESET or CLOSE) and ignored; a frame for an id never
    /// opened is answered with RESET so the peer's stream does not hang.
    fn on_absent(&mut self, frame: FrameType, stream: StreamId) -> Result<(), TunnelError> {
        let opened = if stream.opener() == Some(self.role) {
            u64::from(stream.0) < self.next_local_id
        } else {
            stream.0 <= self.highest_peer_id
        };
        if opened {
            return Ok(());
        }
        self.reply(Frame::Reset {
            stream,
            code: ErrorCode::STREAM_CLOSED,
            reason: format!("{frame} for {stream}, which was never opened"),
        })
    }

    /// The peer broke a stream rule, or this end sheds the stream: reset that
    /// stream only.
    pub(super) fn stream_fault(
        &mut self,
        stream: StreamId,
        code: ErrorCode,
        reason: String,
    ) -> Result<(), TunnelError> {
        self.remove(stream);
        self.events.push_back(Event::Reset {
            stream,
            code,
            reason: reason.clone(),
            remote: false,
        });
        self.reply(Frame::Reset {
            stream,
            code,
            reason,
        })
    }

    /// Queues a frame the peer provoked, refusing to queue without bound for a peer
    /// that sends and never reads.
    fn reply(&mut self, frame: Frame) -> Result<(), TunnelError> {
        if self.control.len() >= MAX_QUEUED_CONTROL {
            return Err(TunnelError::PeerNotReading {
                queued: self.control.len(),
            });
        }
        self.control.push_back(frame);
        Ok(())
    }

    /// Ends the tunnel, telling the peer why when the error calls for it.
    pub(super) fn fail(&mut self, e: TunnelError) -> TunnelError {
        if let Some(code) = e.code() {
            self.control.push_back(Frame::Reset {
                stream: StreamId::TUNNEL,
                code,
                reason: e.to_string(),
            });
        }
        self.phase = Phase::Closed;
        self.ready.clear();
        self.updates.clear();
        e
    }
}
