//! One connection to the relay: a TCP socket, TLS, and the tunnel it carries
//! ([`Link`]), with the Postgres connections of its streams ([`Pipes`]).
//!
//! A session is driven by its relay's thread: [`Session::register`] before each
//! `poll(2)`, `on_*_ready` for the sockets that woke, then [`Session::advance`]
//! (timers, bytes towards Postgres, bytes towards the relay). What the thread must act
//! on comes out of [`Session::take_notices`]; a session that has ended reports why
//! from [`Session::end`] and is dropped, which closes its sockets.

use std::fmt;
use std::io::{self, Read as _, Write as _};
use std::net::{Shutdown, TcpStream};
use std::os::fd::AsRawFd;
use std::time::Instant;

use lokadb_shared::tunnel::{
    Config, ErrorCode, Event, Link, LinkError, PeerSettings, StreamId, Tunnel, TunnelError,
    TunnelStats,
};
use rustls::ClientConnection;
use tracing::debug;

use crate::config::{AgentConfig, Relay};
use crate::net;
use crate::poller::{Interest, Poller, Ready};
use crate::streams::Pipes;

/// Ciphertext read from the relay per read call.
const READ_CHUNK: usize = 64 * 1024;
/// Reads from the relay per wake-up before the streams get their turn.
const READS_PER_WAKE: usize = 16;
/// Ciphertext prepared per write to the relay.
const WRITE_CHUNK: usize = 256 * 1024;

/// Whose socket woke `poll(2)`: a session (by its index in the relay's list) and
/// either its relay connection or one of its streams.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Token {
    /// The connection to the relay.
    Tunnel(usize),
    /// A stream's Postgres connection.
    Stream(usize, StreamId),
}

/// What the relay's thread must act on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Notice {
    /// The relay accepted the agent (HELLO_OK).
    Connected(PeerSettings),
    /// The relay drains this tunnel: dial a new one.
    Drain,
}

/// Why a session ended.
#[derive(Debug)]
pub enum End {
    /// The TCP connection to the relay failed.
    Connect(io::Error),
    /// TLS or the tunnel ended it (rejection, idle timeout, the relay closed, …).
    Link(LinkError),
    /// Reading or writing the socket failed.
    Io(io::Error),
    /// Drained: every stream finished, the session was closed.
    Drained,
}

impl End {
    /// The relay's HELLO_REJECT, if that is why.
    pub fn rejection(&self) -> Option<(ErrorCode, &str)> {
        match self {
            End::Link(LinkError::Tunnel(TunnelError::Rejected { code, reason })) => {
                Some((*code, reason))
            }
            _ => None,
        }
    }
}

impl fmt::Display for End {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            End::Connect(e) => write!(f, "{}", net::describe(e)),
            End::Link(e) => write!(f, "{e}"),
            End::Io(e) => write!(f, "{}", net::describe(e)),
            End::Drained => f.write_str("drained"),
        }
    }
}

/// One connection to the relay and its streams.
#[derive(Debug)]
pub struct Session {
    sock: TcpStream,
    /// The TCP connect is in progress.
    tcp_connecting: bool,
    link: Link,
    /// Ciphertext for the relay, written from `out_pos`.
    out: Vec<u8>,
    out_pos: usize,
    read_buf: Vec<u8>,
    pipes: Pipes,
    connected: bool,
    draining: bool,
    notices: Vec<Notice>,
    end: Option<End>,
}

impl Session {
    /// Starts connecting to `relay`: TCP (non-blocking), then TLS, then HELLO. The
    /// tunnel's idle timeout bounds all of it.
    ///
    /// # Errors
    ///
    /// The relay's name does not resolve, or the connect fails at once.
    pub fn dial(relay: &Relay, config: &AgentConfig, now: Instant) -> io::Result<Session> {
        let addr = relay.addr.resolve()?;
        let (sock, tcp_connecting) = net::connect_nonblocking(addr)?;
        let tls = ClientConnection::new(config.tls.clone(), relay.server_name.clone())
            .map_err(io::Error::other)?;
        let tunnel_config = Config {
            window: config.window,
            max_streams: config.max_conns,
            auto_window: config.auto_window,
            memory_cap: config.memory_cap,
            ..Config::default()
        };
        let tunnel = Tunnel::agent(tunnel_config, config.token.clone(), now);
        Ok(Session {
            sock,
            tcp_connecting,
            link: Link::new(tls, tunnel),
            out: Vec::new(),
            out_pos: 0,
            read_buf: vec![0; READ_CHUNK],
            pipes: Pipes::new(config.postgres.clone()),
            connected: false,
            draining: false,
            notices: Vec::new(),
            end: None,
        })
    }

    /// Whether the relay accepted this agent on this connection.
    pub fn is_connected(&self) -> bool {
        self.connected
    }

    /// Whether the relay drains this tunnel (no new streams come on it).
    pub fn is_draining(&self) -> bool {
        self.draining
    }

    /// Why the session ended, once it has.
    pub fn end(&self) -> Option<&End> {
        self.end.as_ref()
    }

    /// The tunnel's counters.
    pub fn stats(&self) -> TunnelStats {
        self.link.tunnel_ref().stats()
    }

    /// Streams with a Postgres connection.
    pub fn streams(&self) -> usize {
        self.pipes.len()
    }

    /// What happened since the last call.
    pub fn take_notices(&mut self) -> Vec<Notice> {
        std::mem::take(&mut self.notices)
    }

    /// When [`Session::advance`] must run even if no socket wakes.
    pub fn poll_timeout(&self) -> Option<Instant> {
        if self.end.is_some() {
            return None;
        }
        self.link.tunnel_ref().poll_timeout()
    }

    /// Adds the relay socket and the stream sockets, as session `index`.
    pub fn register(&self, index: usize, poller: &mut Poller<Token>) {
        if self.end.is_some() {
            return;
        }
        let interest = if self.tcp_connecting {
            Interest {
                read: false,
                write: true,
            }
        } else {
            Interest {
                read: true,
                write: self.out_pos < self.out.len(),
            }
        };
        poller.add(&self.sock.as_raw_fd(), interest, Token::Tunnel(index));
        self.pipes
            .register(self.link.tunnel_ref(), poller, |s| Token::Stream(index, s));
    }

    /// The relay socket woke.
    pub fn on_tunnel_ready(&mut self, ready: Ready, now: Instant) {
        if self.end.is_some() {
            return;
        }
        if self.tcp_connecting {
            if let Err(e) = net::connect_result(&self.sock) {
                return self.finish(End::Connect(e));
            }
            self.tcp_connecting = false;
            debug!("TCP connected to the relay, TLS handshake");
        }
        if ready.read {
            self.read_relay(now);
        }
    }

    /// A stream's Postgres socket woke.
    pub fn on_stream_ready(&mut self, stream: StreamId, ready: Ready) {
        if self.end.is_none() {
            self.pipes.on_ready(self.link.tunnel(), stream, ready);
        }
    }

    /// Timers, bytes from the tunnel to Postgres, bytes to the relay; closes a drained
    /// session whose streams have all ended.
    pub fn advance(&mut self, now: Instant) {
        if self.end.is_some() {
            return;
        }
        if self
            .link
            .tunnel_ref()
            .poll_timeout()
            .is_some_and(|at| at <= now)
        {
            if let Err(e) = self.link.tunnel().handle_timeout(now) {
                return self.finish(End::Link(e.into()));
            }
        }
        self.pipes.pump(self.link.tunnel());
        if let Err(e) = self.write_relay() {
            return self.finish(End::Io(e));
        }
        // Drained: once the last stream's bytes and CLOSE are written, say goodbye.
        if self.draining && self.pipes.len() == 0 && self.out_pos == self.out.len() {
            self.link.close();
            self.finish(End::Drained);
        }
    }

    fn read_relay(&mut self, now: Instant) {
        for _ in 0..READS_PER_WAKE {
            let n = match (&self.sock).read(&mut self.read_buf) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return self.finish(End::Io(e)),
            };
            // n == 0 (end of file) is reported by the link as `Eof`.
            let received = self.link.receive(now, &self.read_buf[..n]);
            self.handle_events();
            if let Err(e) = received {
                return self.finish(End::Link(e));
            }
        }
    }

    fn handle_events(&mut self) {
        while let Some(event) = self.link.tunnel().poll_event() {
            match event {
                Event::Connected(settings) => {
                    self.connected = true;
                    self.notices.push(Notice::Connected(settings));
                }
                Event::Opened { stream, target } => {
                    self.pipes.open(self.link.tunnel(), stream, target)
                }
                Event::Readable(stream) | Event::Finished(stream) => {
                    self.pipes.mark_readable(stream)
                }
                Event::Reset {
                    stream,
                    code,
                    reason,
                    remote,
                } => {
                    debug!(%stream, %code, reason, by_relay = remote, "stream reset");
                    self.pipes.reset(stream);
                }
                Event::Drain => {
                    if !self.draining {
                        self.draining = true;
                        self.notices.push(Notice::Drain);
                    }
                }
                Event::Hello(_) => {} // only a relay receives HELLO
            }
        }
    }

    /// Writes what the link has for the relay until the socket is full.
    fn write_relay(&mut self) -> io::Result<()> {
        if self.tcp_connecting {
            return Ok(());
        }
        loop {
            if self.out_pos == self.out.len() {
                self.out.clear();
                self.out_pos = 0;
                if !self.link.transmit(&mut self.out, WRITE_CHUNK) {
                    return Ok(());
                }
            }
            match (&self.sock).write(&self.out[self.out_pos..]) {
                Ok(n) => self.out_pos += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }

    /// Ends the session: the last bytes the link has (an alert, a RESET saying why,
    /// close_notify) are written if the socket takes them, then every socket closes.
    fn finish(&mut self, end: End) {
        if self.end.is_some() {
            return;
        }
        debug!(streams = self.pipes.len(), "session ended: {end}");
        let _ = self.write_relay();
        let _ = self.sock.shutdown(Shutdown::Both);
        self.pipes.clear();
        self.end = Some(end);
    }
}
