//! Tunnel streams ↔ Postgres sockets: one [`Pipe`] per stream the relay opened.
//!
//! Flow control is end to end. Towards Postgres, a stream's bytes are taken from the
//! tunnel ([`Tunnel::handle_read`], which is what returns window credit to the relay)
//! only once Postgres has taken the previous ones, so a slow Postgres connection holds
//! at most one window in the tunnel plus one chunk here. From Postgres, the socket is
//! read only while the stream has less than [`SEND_QUEUE_LIMIT`] queued in the tunnel.

use std::collections::HashMap;
use std::io::{self, Read as _, Write as _};
use std::net::{Shutdown, TcpStream};
use std::os::fd::AsRawFd;

use bytes::{Buf, Bytes, BytesMut};
use lokadb_shared::tunnel::{ErrorCode, Read, StreamId, Tunnel};
use tracing::debug;

use crate::net::{self, HostPort};
use crate::poller::{Interest, Poller, Ready};

/// Largest read from the tunnel or from Postgres at a time.
const CHUNK: usize = 64 * 1024;
/// Reads from one Postgres socket per wake-up, so one busy stream cannot starve the
/// others (poll is level-triggered: the rest is read on the next round).
const READS_PER_WAKE: usize = 16;

/// `SO_RCVBUF` of the Postgres connections; the kernel doubles it for its bookkeeping,
/// so a connection holds at most about 256 KiB in the kernel, as much as
/// [`SEND_QUEUE_LIMIT`] lets the stream queue in the tunnel.
///
/// Without it the kernel's receive autotuning grows each buffer while the agent
/// reads fast (towards `net.ipv4.tcp_rmem`'s maximum, 6 MiB by default), and
/// every busy stream that waits for window then parks that much in the kernel:
/// with a thousand streams, gigabytes of TCP memory, past `net.ipv4.tcp_mem`'s
/// pressure threshold, where the kernel drops segments of every connection — the
/// tunnel's to the relay included (retransmissions, a collapsed congestion window).
pub const POSTGRES_RECV_BUFFER: usize = 128 * 1024;

/// One stream and its Postgres connection.
#[derive(Debug)]
struct Pipe {
    sock: TcpStream,
    /// The TCP connect to Postgres is in progress.
    connecting: bool,
    /// Bytes taken from the tunnel that Postgres has not taken yet.
    to_postgres: Bytes,
    /// The tunnel may have bytes (or the end) of this stream to read.
    tunnel_readable: bool,
    /// Postgres closed its side; the tunnel was told (`handle_close`).
    postgres_done: bool,
    /// The relay closed its side; the socket was shut down for writing.
    tunnel_done: bool,
    /// The database name the relay asked for (for logs).
    target: String,
}

/// The pipes of one tunnel.
#[derive(Debug)]
pub struct Pipes {
    postgres: HostPort,
    pipes: HashMap<StreamId, Pipe>,
    buf: BytesMut,
}

impl Pipes {
    /// No pipes yet; new ones connect to `postgres`.
    pub fn new(postgres: HostPort) -> Pipes {
        Pipes {
            postgres,
            pipes: HashMap::new(),
            buf: BytesMut::new(),
        }
    }

    /// Streams with a Postgres connection (or one being made).
    pub fn len(&self) -> usize {
        self.pipes.len()
    }

    /// The relay opened `stream`: start connecting to Postgres. A failure resets the
    /// stream with `CONNECT_FAILED`.
    pub fn open(&mut self, tunnel: &mut Tunnel, stream: StreamId, target: String) {
        let connected = self
            .postgres
            .resolve()
            .and_then(|addr| net::connect_nonblocking_rcvbuf(addr, POSTGRES_RECV_BUFFER));
        match connected {
            Ok((sock, connecting)) => {
                debug!(%stream, database = %target, postgres = %self.postgres, "stream opened");
                let pipe = Pipe {
                    sock,
                    connecting,
                    to_postgres: Bytes::new(),
                    tunnel_readable: false,
                    postgres_done: false,
                    tunnel_done: false,
                    target,
                };
                self.pipes.insert(stream, pipe);
            }
            Err(e) => self.connect_failed(tunnel, stream, &e),
        }
    }

    fn connect_failed(&mut self, tunnel: &mut Tunnel, stream: StreamId, e: &io::Error) {
        let reason = format!(
            "could not connect to postgres {}: {}",
            self.postgres,
            net::describe(e)
        );
        debug!(%stream, "{reason}");
        self.pipes.remove(&stream);
        let _ = tunnel.handle_reset(stream, ErrorCode::CONNECT_FAILED, reason);
    }

    /// Closes every Postgres connection (the tunnel ended).
    pub fn clear(&mut self) {
        self.pipes.clear();
    }

    /// The tunnel has bytes or the end of `stream` to read (`Readable`, `Finished`).
    pub fn mark_readable(&mut self, stream: StreamId) {
        if let Some(p) = self.pipes.get_mut(&stream) {
            p.tunnel_readable = true;
        }
    }

    /// The stream was reset: its Postgres connection is closed at once.
    pub fn reset(&mut self, stream: StreamId) {
        if let Some(p) = self.pipes.remove(&stream) {
            debug!(%stream, database = %p.target, "stream reset, postgres connection closed");
        }
    }

    /// Adds every socket that waits for something, with the stream's token.
    pub fn register<T: Copy>(
        &self,
        tunnel: &Tunnel,
        poller: &mut Poller<T>,
        token: impl Fn(StreamId) -> T,
    ) {
        let window = send_queue_limit(tunnel);
        for (&stream, p) in &self.pipes {
            let interest = if p.connecting {
                Interest {
                    read: false,
                    write: true,
                }
            } else {
                let queued = tunnel.stream_stats(stream).map_or(u64::MAX, |s| s.queued);
                Interest {
                    read: !p.postgres_done && queued < window,
                    write: !p.to_postgres.is_empty(),
                }
            };
            poller.add(&p.sock.as_raw_fd(), interest, token(stream));
        }
    }

    /// `stream`'s Postgres socket is ready.
    pub fn on_ready(&mut self, tunnel: &mut Tunnel, stream: StreamId, ready: Ready) {
        let Some(p) = self.pipes.get_mut(&stream) else {
            return;
        };
        if p.connecting {
            match net::connect_result(&p.sock) {
                Ok(()) => {
                    p.connecting = false;
                    debug!(%stream, "connected to postgres");
                }
                Err(e) => return self.connect_failed(tunnel, stream, &e),
            }
        }
        let result = if ready.write && !p.to_postgres.is_empty() {
            flush(p)
        } else {
            Ok(())
        };
        let result = result.and_then(|()| {
            if ready.read {
                from_postgres(p, tunnel, stream, &mut self.buf)
            } else {
                Ok(())
            }
        });
        self.settle(tunnel, stream, result);
    }

    /// Moves bytes the tunnel holds to the Postgres sockets that can take them.
    pub fn pump(&mut self, tunnel: &mut Tunnel) {
        let ready: Vec<StreamId> = self
            .pipes
            .iter()
            .filter(|(_, p)| p.tunnel_readable && !p.connecting && p.to_postgres.is_empty())
            .map(|(&s, _)| s)
            .collect();
        for stream in ready {
            if let Some(p) = self.pipes.get_mut(&stream) {
                let result = to_postgres(p, tunnel, stream);
                self.settle(tunnel, stream, result);
            }
        }
    }

    /// After I/O on a pipe: reset the stream on a socket error, drop the pipe when both
    /// sides are done.
    fn settle(&mut self, tunnel: &mut Tunnel, stream: StreamId, result: io::Result<()>) {
        let Some(p) = self.pipes.get(&stream) else {
            return;
        };
        if let Err(e) = result {
            let reason = format!("postgres connection failed: {}", net::describe(&e));
            debug!(%stream, database = %p.target, "{reason}");
            self.pipes.remove(&stream);
            let _ = tunnel.handle_reset(stream, ErrorCode::CANCEL, reason);
        } else if p.postgres_done && p.tunnel_done {
            debug!(%stream, database = %p.target, "stream closed");
            self.pipes.remove(&stream);
        }
    }
}

/// Writes the pending bytes to Postgres; `Ok` also when the socket is full.
fn flush(p: &mut Pipe) -> io::Result<()> {
    while !p.to_postgres.is_empty() {
        match (&p.sock).write(&p.to_postgres) {
            Ok(n) => p.to_postgres.advance(n),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Takes the stream's bytes from the tunnel while Postgres takes them; shuts the
/// socket for writing once the relay's side has ended and every byte is written.
fn to_postgres(p: &mut Pipe, tunnel: &mut Tunnel, stream: StreamId) -> io::Result<()> {
    while p.tunnel_readable && p.to_postgres.is_empty() {
        match tunnel.handle_read_at(std::time::Instant::now(), stream, CHUNK) {
            Ok(Read::Data(data)) => {
                p.to_postgres = data;
                flush(p)?;
            }
            Ok(Read::Blocked) => p.tunnel_readable = false,
            Ok(Read::Finished) | Err(_) => {
                p.tunnel_readable = false;
                p.tunnel_done = true;
                debug!(%stream, "relay closed the stream; shutting down writes to postgres");
                match p.sock.shutdown(Shutdown::Write) {
                    Err(e) if e.kind() != io::ErrorKind::NotConnected => return Err(e),
                    _ => {}
                }
            }
        }
    }
    Ok(())
}

/// Reads from Postgres into the tunnel while the stream has less than
/// [`SEND_QUEUE_LIMIT`] (or one window, if smaller) queued; Postgres's end of file
/// closes the stream's sending side. The queue is bytes waiting for window: it need not
/// hold a whole window (what is in flight is buffered at the relay), so a small queue
/// keeps the agent small with thousands of streams; the rest waits in the socket.
/// Most bytes a stream queues in the tunnel beyond what its window lets it send.
pub const SEND_QUEUE_LIMIT: u64 = 256 * 1024;

fn send_queue_limit(tunnel: &Tunnel) -> u64 {
    tunnel
        .peer()
        .map_or(0, |s| u64::from(s.window))
        .min(SEND_QUEUE_LIMIT)
}

fn from_postgres(
    p: &mut Pipe,
    tunnel: &mut Tunnel,
    stream: StreamId,
    buf: &mut BytesMut,
) -> io::Result<()> {
    let window = send_queue_limit(tunnel);
    for _ in 0..READS_PER_WAKE {
        let queued = tunnel.stream_stats(stream).map_or(u64::MAX, |s| s.queued);
        if p.postgres_done || queued >= window {
            break;
        }
        buf.clear();
        buf.resize(CHUNK, 0);
        match (&p.sock).read(&mut buf[..]) {
            Ok(0) => {
                p.postgres_done = true;
                debug!(%stream, "postgres closed the connection");
                let _ = tunnel.handle_close(stream);
            }
            Ok(n) => {
                buf.truncate(n);
                if tunnel.handle_write(stream, buf.split().freeze()).is_err() {
                    // The stream is gone from the tunnel: the pipe is finished.
                    p.postgres_done = true;
                    p.tunnel_done = true;
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

#[cfg(test)]
#[path = "streams_test.rs"]
mod tests;
