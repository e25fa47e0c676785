//! One agent's connection: TLS, the tunnel, and the slots through which the client
//! tasks of its streams are woken.
//!
//! The connection task ([`serve`]) owns the socket and moves bytes between it and the
//! [`Link`]; client tasks ([`super::client`]) call the stream methods of
//! [`TunnelConn`] and are woken from the tunnel's events. Everything runs on the
//! relay's thread, so the shared state is a `RefCell` and wakers are plain.

use super::registry::{Registered, Relay};
use crate::rt::net::TcpStream;
use crate::rt::{reactor::Sleep, sleep_until};
use bytes::Bytes;
use futures_lite::{AsyncRead, AsyncWrite, AsyncWriteExt};
use lokadb_shared::tunnel::{
    self, ErrorCode, Event, Link, Phase, Read, StreamError, StreamId, StreamState, Tunnel,
};
use std::cell::RefCell;
use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

/// Ciphertext gathered per socket write.
const WRITE_CHUNK: usize = 256 * 1024;
/// An agent whose socket takes no bytes for this long while the relay has some to
/// send is cut: it is stuck or not reading, and its streams' clients get an error
/// instead of waiting forever.
const WRITE_STALL_TIMEOUT: Duration = Duration::from_secs(10);
/// Reads from an agent's socket per poll of its task before it yields, so one busy (or
/// hostile) agent cannot hold the relay's thread from every other tunnel and client.
const READS_PER_POLL: u32 = 16;
/// An agent connection must have authenticated (TLS and HELLO) within this long: the
/// idle timeout alone would let a peer trickle its HELLO a byte at a time.
const AUTH_TIMEOUT: Duration = Duration::from_secs(10);
/// A write buffer grown past this is given back when it empties, so idle agents
/// stay small.
const KEEP_WRITE_CAPACITY: usize = 64 * 1024;

/// One agent connection, shared by its task and its streams' client tasks.
pub struct TunnelConn {
    /// Number for log lines.
    pub id: u64,
    /// The agent's address.
    pub peer: SocketAddr,
    inner: RefCell<Inner>,
}

struct Inner {
    link: Link,
    /// The organization, once the agent authenticated.
    org: Option<String>,
    slots: HashMap<StreamId, Slot>,
    /// The connection task, woken when the tunnel has something to send.
    driver: Option<Waker>,
    /// Why the relay cut it (its token was revoked by a reload).
    revoked: Option<String>,
    /// Streams waiting for their send queue to shrink.
    send_waiters: Vec<StreamId>,
    /// Why the connection ended.
    ended: Option<String>,
}

/// What a client task waits for on its stream.
#[derive(Default)]
struct Slot {
    waker: Option<Waker>,
    /// Set when the stream was reset or the tunnel ended.
    reset: Option<String>,
    /// The agent refused the stream (its `-max-conns`, or it is draining).
    refused: bool,
}

impl Slot {
    fn wake(&mut self) {
        if let Some(w) = self.waker.take() {
            w.wake();
        }
    }
}

impl TunnelConn {
    fn new(relay: &Relay, peer: SocketAddr) -> TunnelConn {
        let tls = rustls::ServerConnection::new(relay.tls.borrow().clone())
            .expect("server TLS config without client auth");
        let config = tunnel::Config {
            // The relay opens every stream; an agent's OPEN is refused by the tunnel.
            max_streams: 0,
            ..relay.tunnel.clone()
        };
        TunnelConn {
            id: relay.next_conn_id(),
            peer,
            inner: RefCell::new(Inner {
                link: Link::new(tls, Tunnel::relay(config, Instant::now())),
                org: None,
                slots: HashMap::new(),
                driver: None,
                revoked: None,
                send_waiters: Vec::new(),
                ended: None,
            }),
        }
    }

    /// The organization this agent serves (after authentication).
    pub fn org(&self) -> Option<String> {
        self.inner.borrow().org.clone()
    }

    /// The tunnel's counters.
    pub fn stats(&self) -> tunnel::TunnelStats {
        self.inner.borrow().link.tunnel_ref().stats()
    }

    /// The most bytes any stream holds received and not yet read by its client: at
    /// most the window, which is what bounds the relay's memory per stream.
    pub fn max_stream_buffered(&self) -> u64 {
        let inner = self.inner.borrow();
        let tunnel = inner.link.tunnel_ref();
        inner
            .slots
            .keys()
            .filter_map(|id| tunnel.stream_stats(*id))
            .map(|s| s.buffered)
            .max()
            .unwrap_or(0)
    }

    /// The round-trip time measured by the last keepalive PING.
    pub fn rtt(&self) -> Option<Duration> {
        self.inner.borrow().link.tunnel_ref().rtt()
    }

    /// Opens a stream towards `target`.
    ///
    /// # Errors
    ///
    /// The tunnel's refusal (the agent's stream limit, draining, not ready).
    pub fn open(&self, target: &str) -> Result<StreamId, StreamError> {
        let mut inner = self.inner.borrow_mut();
        if inner.ended.is_some() {
            return Err(StreamError::Draining);
        }
        let id = inner.link.tunnel().handle_open(target)?;
        inner.slots.insert(id, Slot::default());
        inner.wake_driver();
        Ok(id)
    }

    /// Queues bytes on the stream.
    ///
    /// # Errors
    ///
    /// The stream was reset or closed.
    pub fn write(&self, id: StreamId, data: Bytes) -> Result<(), String> {
        let mut inner = self.inner.borrow_mut();
        if let Some(reason) = inner.slots.get(&id).and_then(|s| s.reset.clone()) {
            return Err(reason);
        }
        inner
            .link
            .tunnel()
            .handle_write(id, data)
            .map_err(|e| e.to_string())?;
        inner.wake_driver();
        Ok(())
    }

    /// Closes the stream's sending side after the queued bytes.
    pub fn close(&self, id: StreamId) {
        let mut inner = self.inner.borrow_mut();
        if inner.link.tunnel().handle_close(id).is_ok() {
            inner.wake_driver();
        }
    }

    /// Ready when the stream's unsent bytes are below `limit` (or it is gone).
    pub fn poll_send_capacity(&self, id: StreamId, limit: u64, cx: &mut Context<'_>) -> Poll<()> {
        let mut inner = self.inner.borrow_mut();
        // A stream that is gone or failed has "capacity": the write that follows reports why.
        if inner.ended.is_some() || inner.slots.get(&id).is_none_or(|s| s.reset.is_some()) {
            return Poll::Ready(());
        }
        let queued = inner
            .link
            .tunnel_ref()
            .stream_stats(id)
            .map_or(0, |s| s.queued);
        if queued < limit {
            return Poll::Ready(());
        }
        if let Some(slot) = inner.slots.get_mut(&id) {
            slot.waker = Some(cx.waker().clone());
        }
        if !inner.send_waiters.contains(&id) {
            inner.send_waiters.push(id);
        }
        Poll::Pending
    }

    /// Wakes the stream's task when the stream is reset or its tunnel ends, whatever
    /// else it waits for (e.g. a client socket that takes no bytes).
    pub fn watch(&self, id: StreamId, cx: &Context<'_>) {
        if let Some(slot) = self.inner.borrow_mut().slots.get_mut(&id) {
            if !slot.waker.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                slot.waker = Some(cx.waker().clone());
            }
        }
    }

    /// Whether the agent refused the stream (a limit of its own), counted once.
    pub fn take_refused(&self, id: StreamId) -> bool {
        self.inner
            .borrow_mut()
            .slots
            .get_mut(&id)
            .is_some_and(|s| std::mem::take(&mut s.refused))
    }

    /// Why the stream failed (reset by the agent, or its tunnel ended), if it did.
    pub fn reset_reason(&self, id: StreamId) -> Option<String> {
        let inner = self.inner.borrow();
        match inner.slots.get(&id) {
            Some(slot) => slot.reset.clone(),
            None => inner.ended.clone(),
        }
    }

    /// Reads what the agent sent on the stream: `Some(bytes)`, `None` at its end.
    ///
    /// # Errors
    ///
    /// The stream was reset or the tunnel ended, with the reason.
    pub fn poll_read(
        &self,
        id: StreamId,
        max: usize,
        cx: &mut Context<'_>,
    ) -> Poll<Result<Option<Bytes>, String>> {
        let mut inner = self.inner.borrow_mut();
        if let Some(reason) = inner.slots.get(&id).and_then(|s| s.reset.clone()) {
            return Poll::Ready(Err(reason));
        }
        match inner.link.tunnel().handle_read_at(Instant::now(), id, max) {
            Ok(Read::Data(data)) => {
                // Reading may have made a WINDOW_UPDATE due.
                inner.wake_driver();
                Poll::Ready(Ok(Some(data)))
            }
            Ok(Read::Finished) | Err(StreamError::Unknown(_)) => Poll::Ready(Ok(None)),
            Ok(Read::Blocked) => {
                if let Some(slot) = inner.slots.get_mut(&id) {
                    slot.waker = Some(cx.waker().clone());
                }
                Poll::Pending
            }
            Err(e) => Poll::Ready(Err(e.to_string())),
        }
    }

    /// Forgets the stream; resets it first if it is still open (its client went away).
    pub fn release(&self, id: StreamId) {
        let mut inner = self.inner.borrow_mut();
        inner.slots.remove(&id);
        // A stream closed both ways leaves by itself once its CLOSE is sent; a reset would
        // drop its last bytes.
        let state = inner.link.tunnel_ref().stream_state(id);
        if state.is_some_and(|s| s != StreamState::Closed) {
            let _ = inner.link.tunnel().handle_reset(
                id,
                ErrorCode::CANCEL,
                "the relay's client closed the connection".into(),
            );
            inner.wake_driver();
        }
    }

    /// Cuts the connection (its organization's token was revoked): its streams fail, the
    /// agent is told nothing more.
    pub fn revoke(&self, reason: String) {
        let mut inner = self.inner.borrow_mut();
        inner.revoked = Some(reason);
        inner.wake_driver();
    }

    /// Tells the agent to reconnect (SIGTERM): no new streams here.
    pub fn drain(&self) {
        let mut inner = self.inner.borrow_mut();
        if inner.link.tunnel().handle_drain().is_ok() {
            inner.wake_driver();
        }
    }

    /// Bytes this stream has sent and been allowed to send, for tests of the window.
    pub fn stream_stats(&self, id: StreamId) -> Option<tunnel::StreamStats> {
        self.inner.borrow().link.tunnel_ref().stream_stats(id)
    }
}

impl Inner {
    fn wake_driver(&mut self) {
        if let Some(w) = self.driver.take() {
            w.wake();
        }
    }

    /// Wakes every client task waiting for send capacity; they check again.
    fn wake_send_waiters(&mut self) {
        for id in std::mem::take(&mut self.send_waiters) {
            if let Some(slot) = self.slots.get_mut(&id) {
                slot.wake();
            }
        }
    }
}

/// Serves one agent connection until it ends.
pub async fn serve(
    relay: Rc<Relay>,
    tcp: TcpStream,
    peer: SocketAddr,
    handshake: super::registry::Handshake,
) {
    let _ = tcp.set_nodelay(true);
    let conn = Rc::new(TunnelConn::new(&relay, peer));
    tracing::debug!(conn = conn.id, %peer, "agent connection");
    let mut driver = Driver {
        relay: relay.clone(),
        conn: conn.clone(),
        tcp,
        out: Vec::new(),
        sent: 0,
        timer: None,
        stall: None,
        auth: Some(crate::rt::sleep(AUTH_TIMEOUT)),
        handshake: Some(handshake),
    };
    let reason = futures_lite::future::poll_fn(|cx| driver.poll(cx)).await;
    // Unregistered first: no client is handed this tunnel, and a standby takes over,
    // while the last bytes go out.
    end(&relay, &conn, reason);
    // A last flush carries the RESET, HELLO_REJECT or TLS alert that says why, then
    // close_notify, so the agent can tell a deliberate end from a cut connection.
    let mut out = std::mem::take(&mut driver.out);
    let sent = driver.sent;
    {
        let mut inner = conn.inner.borrow_mut();
        inner.link.transmit(&mut out, WRITE_CHUNK);
        inner.link.close();
        inner.link.transmit(&mut out, WRITE_CHUNK);
    }
    let _ = crate::time::with_timeout(
        Duration::from_secs(1),
        driver.tcp.write_all(&out[sent.min(out.len())..]),
    )
    .await;
}

/// Unregisters the connection and fails its streams.
fn end(relay: &Relay, conn: &Rc<TunnelConn>, reason: String) {
    let org = {
        let mut inner = conn.inner.borrow_mut();
        inner.ended = Some(reason.clone());
        let why = match &inner.org {
            Some(org) => format!("the tunnel of organization \"{org}\" ended: {reason}"),
            None => format!("the tunnel ended: {reason}"),
        };
        for slot in inner.slots.values_mut() {
            slot.reset = Some(why.clone());
            slot.wake();
        }
        inner.org.clone()
    };
    match org {
        Some(org) => {
            let promoted = relay.unregister(&org, conn);
            tracing::info!(conn = conn.id, org, peer = %conn.peer, reason, "agent disconnected");
            if let Some(id) = promoted {
                tracing::info!(conn = id, org, "standby agent is now live");
            }
        }
        None => {
            tracing::info!(conn = conn.id, peer = %conn.peer, reason, "agent connection closed before authenticating")
        }
    }
}

struct Driver {
    relay: Rc<Relay>,
    conn: Rc<TunnelConn>,
    tcp: TcpStream,
    /// Ciphertext to write; `sent` bytes of it are written.
    out: Vec<u8>,
    sent: usize,
    timer: Option<(Instant, Sleep)>,
    /// Armed while bytes wait for the socket: fires [`WRITE_STALL_TIMEOUT`] after the
    /// last write progress.
    stall: Option<Sleep>,
    /// Armed until the agent has authenticated.
    auth: Option<Sleep>,
    /// Its place under `relay.max_handshakes` until it has authenticated.
    handshake: Option<super::registry::Handshake>,
}

impl Driver {
    /// Moves bytes until nothing can move; `Ready` with the reason when the
    /// connection ends.
    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<String> {
        let mut reads = 0;
        loop {
            if let Some(reason) = self.conn.inner.borrow_mut().revoked.take() {
                return Poll::Ready(reason);
            }
            let mut busy = false;
            if reads == READS_PER_POLL {
                // Yield: the executor runs the other tasks and polls this one again.
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }

            // Socket → link.
            let read = {
                let mut scratch = self.relay.scratch.borrow_mut();
                match Pin::new(&mut self.tcp).poll_read(cx, &mut scratch) {
                    Poll::Ready(Ok(n)) => {
                        let r = self
                            .conn
                            .inner
                            .borrow_mut()
                            .link
                            .receive(Instant::now(), &scratch[..n]);
                        Some(r)
                    }
                    Poll::Ready(Err(e)) => return Poll::Ready(format!("read failed: {e}")),
                    Poll::Pending => None,
                }
            };
            if let Some(r) = read {
                busy = true;
                reads += 1;
                self.dispatch();
                if let Err(e) = r {
                    return Poll::Ready(e.to_string());
                }
            }

            if let Some(auth) = self.auth.as_mut() {
                if self.conn.inner.borrow().org.is_some() {
                    self.auth = None;
                    self.handshake = None;
                } else if Pin::new(auth).poll(cx).is_ready() {
                    return Poll::Ready(format!(
                        "the agent did not authenticate within {AUTH_TIMEOUT:?}"
                    ));
                }
            }

            // The tunnel's clock: keepalive and idle timeout.
            let deadline = self.conn.inner.borrow().link.tunnel_ref().poll_timeout();
            match deadline {
                None => self.timer = None,
                Some(d) => {
                    if self.timer.as_ref().is_none_or(|(at, _)| *at != d) {
                        self.timer = Some((d, sleep_until(d)));
                    }
                    let (_, sleep) = self.timer.as_mut().expect("just set");
                    if Pin::new(sleep).poll(cx).is_ready() {
                        self.timer = None;
                        busy = true;
                        let r = self
                            .conn
                            .inner
                            .borrow_mut()
                            .link
                            .tunnel()
                            .handle_timeout(Instant::now());
                        if let Err(e) = r {
                            return Poll::Ready(e.to_string());
                        }
                    }
                }
            }

            // Link → socket.
            loop {
                if self.sent == self.out.len() {
                    self.out.clear();
                    self.sent = 0;
                    if self.out.capacity() > KEEP_WRITE_CAPACITY {
                        self.out = Vec::new();
                    }
                    let mut inner = self.conn.inner.borrow_mut();
                    if !inner.link.transmit(&mut self.out, WRITE_CHUNK) {
                        break;
                    }
                    // Queues shrank: streams waiting to send may go on.
                    inner.wake_send_waiters();
                }
                match Pin::new(&mut self.tcp).poll_write(cx, &self.out[self.sent..]) {
                    Poll::Ready(Ok(n)) => {
                        self.sent += n;
                        self.stall = None;
                        busy = true;
                    }
                    Poll::Ready(Err(e)) => return Poll::Ready(format!("write failed: {e}")),
                    Poll::Pending => {
                        let stall = self
                            .stall
                            .get_or_insert_with(|| crate::rt::sleep(WRITE_STALL_TIMEOUT));
                        if Pin::new(stall).poll(cx).is_ready() {
                            return Poll::Ready(format!(
                                "the agent took no bytes for {WRITE_STALL_TIMEOUT:?}: it is not reading"
                            ));
                        }
                        break;
                    }
                }
            }

            let mut inner = self.conn.inner.borrow_mut();
            if inner.link.tunnel_ref().phase() == Phase::Closed && self.sent == self.out.len() {
                return Poll::Ready("the tunnel was closed".into());
            }
            if !busy {
                inner.driver = Some(cx.waker().clone());
                return Poll::Pending;
            }
        }
    }

    /// Acts on the tunnel's events.
    fn dispatch(&mut self) {
        loop {
            let event = self.conn.inner.borrow_mut().link.tunnel().poll_event();
            let Some(event) = event else { return };
            match event {
                Event::Hello(hello) => self.authenticate(&hello.token),
                Event::Readable(id) | Event::Finished(id) => {
                    if let Some(slot) = self.conn.inner.borrow_mut().slots.get_mut(&id) {
                        slot.wake();
                    }
                }
                Event::Reset {
                    stream,
                    code,
                    reason,
                    remote,
                } => {
                    let mut inner = self.conn.inner.borrow_mut();
                    let org = inner.org.clone().unwrap_or_default();
                    tracing::debug!(
                        conn = self.conn.id,
                        org,
                        stream = stream.0,
                        ?code,
                        reason,
                        remote,
                        "stream reset"
                    );
                    if let Some(slot) = inner.slots.get_mut(&stream) {
                        slot.reset = Some(describe_reset(&org, code, &reason));
                        slot.refused = remote && code == ErrorCode::REFUSED;
                        slot.wake();
                    }
                }
                Event::Drain => {
                    tracing::info!(conn = self.conn.id, "agent announced it is going away");
                }
                Event::Opened { .. } | Event::Connected(_) => {
                    // Refused by the tunnel itself (max_streams 0) / agent-only event.
                }
            }
        }
    }

    fn authenticate(&mut self, token: &str) {
        let relay = &self.relay;
        let conn = &self.conn;
        let verdict = if relay.draining.get() {
            Err((
                ErrorCode::REFUSED,
                "this relay is shutting down".to_owned(),
                "draining".to_owned(),
            ))
        } else {
            relay.tokens.borrow().verify(token).map_err(|e| {
                (
                    ErrorCode::BAD_TOKEN,
                    "token not valid for this relay".to_owned(),
                    e.to_string(),
                )
            })
        };
        let verdict = verdict.and_then(|org| match relay.register(&org, conn) {
            Registered::Refused => Err((
                ErrorCode::DUPLICATE,
                format!(
                    "organization \"{org}\" already has a live agent and {} standbys on this relay",
                    super::registry::MAX_STANDBY
                ),
                "too many agents".to_owned(),
            )),
            r => Ok((org, r)),
        });
        let mut inner = conn.inner.borrow_mut();
        match verdict {
            Ok((org, registered)) => {
                let _ = inner.link.tunnel().handle_accept(Instant::now());
                inner.org = Some(org.clone());
                relay.stats.borrow_mut().agents_connected += 1;
                tracing::info!(conn = conn.id, org, peer = %conn.peer, role = ?registered, "agent connected");
            }
            Err((code, told, logged)) => {
                let _ = inner.link.tunnel().handle_reject(code, told);
                relay.stats.borrow_mut().agents_refused += 1;
                tracing::warn!(conn = conn.id, peer = %conn.peer, reason = logged, "agent refused");
            }
        }
    }
}

/// A stream reset as the client will read it.
fn describe_reset(org: &str, code: ErrorCode, reason: &str) -> String {
    match code {
        ErrorCode::CONNECT_FAILED => {
            format!(
                "the agent of organization \"{org}\" could not connect to its database: {reason}"
            )
        }
        ErrorCode::REFUSED => {
            format!("the agent of organization \"{org}\" refused the connection: {reason}")
        }
        _ => format!("the connection to organization \"{org}\" was reset by its agent: {reason}"),
    }
}
