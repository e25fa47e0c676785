//! A Postgres client of the relay (postgres_fdw in the cloud database, or the
//! proxy's direct path): its startup packet names the organization, and its bytes go
//! through a stream of that organization's tunnel.
//!
//! The database name is `ORG` or `ORG/DBNAME`. With `ORG/DBNAME` the startup packet
//! is rewritten to ask the organization's Postgres for `DBNAME`; with `ORG` alone it
//! is forwarded unchanged (the database there has the organization's name).
//! Authentication is end to end: the relay never sees a password.

use super::cancel::KeySniffer;
use super::registry::{CancelOwner, Relay};
use super::tunnel_conn::TunnelConn;
use crate::net::stream::{send, ClientStream};
use crate::rt::net::TcpStream;
use bytes::Bytes;
use futures_lite::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use lokadb_shared::config::PostgresTls;
use lokadb_shared::tunnel::{StreamError, StreamId};
use lokadb_shared::wire::backend::{self, ErrorFields, Severity};
use lokadb_shared::wire::sqlstate;
use lokadb_shared::wire::startup::{self, StartupMessage, StartupPacket};
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll};
use std::time::Instant;

/// Bytes a client may have queued in the tunnel beyond its window before the relay
/// stops reading from it.
const SEND_QUEUE_LIMIT: u64 = 256 * 1024;
/// Largest read from a client, and from a stream, at once.
const CHUNK: usize = 64 * 1024;
/// How often a client waiting for its organization's agent looks again.
const AGENT_POLL: std::time::Duration = std::time::Duration::from_millis(10);

/// A refusal sent to the client as a FATAL ErrorResponse.
struct Refusal {
    code: &'static str,
    message: String,
    hint: Option<&'static str>,
}

impl Refusal {
    fn new(code: &'static str, message: String) -> Refusal {
        Refusal {
            code,
            message,
            hint: None,
        }
    }

    fn hint(mut self, hint: &'static str) -> Refusal {
        self.hint = Some(hint);
        self
    }
}

/// Serves one client connection of the relay's Postgres listener.
pub async fn serve(relay: Rc<Relay>, tcp: TcpStream) {
    let starting = Starting::new(&relay);
    let _ = tcp.set_nodelay(true);
    let peer = tcp.peer_addr();
    let mut slot = Some(ClientStream::Plain(tcp));
    let Some(handshake) = peer
        .ok()
        .and_then(|peer| super::registry::Handshakes::begin(&relay, false, peer.ip()))
    else {
        let refusal = Refusal::new(
            sqlstate::TOO_MANY_CONNECTIONS,
            "too many connections to the relay have not sent their startup packet yet".into(),
        )
        .hint("relay.max_handshakes and relay.max_handshakes_per_address bound them; a client that connects and says nothing holds a place for relay.startup_timeout.");
        return refuse(stream_of(&mut slot), refusal).await;
    };
    let timeout = relay.config.startup_timeout;
    let startup = match crate::time::with_timeout(timeout, read_startup(&relay, &mut slot)).await {
        None => Err(Refusal::new(
            sqlstate::PROTOCOL_VIOLATION,
            format!("no startup packet within {timeout:?}"),
        )),
        Some(r) => r,
    };
    drop(handshake);
    // A TLS handshake cut short by the timeout leaves no stream to answer on.
    let Some(mut stream) = slot else { return };
    let m = match startup {
        Ok(Startup::Session(m)) => m,
        // Outside the startup timeout: a forward cut short would leave its stream behind.
        Ok(Startup::Cancel { pid, secret }) => {
            return super::cancel::forward(&relay, pid, secret).await;
        }
        Err(refusal) => return refuse(&mut stream, refusal).await,
    };
    if stream.is_tls() {
        relay.stats.borrow_mut().clients_tls += 1;
    } else if relay.config.postgres_tls == PostgresTls::Require {
        let refusal = Refusal::new(
            sqlstate::INVALID_AUTHORIZATION,
            "the relay accepts only TLS connections (relay.postgres_tls = \"require\")".into(),
        )
        .hint("Connect with sslmode=require or stronger (lokadb org add --relay-sslmode).");
        return refuse(&mut stream, refusal).await;
    }
    if m.param("database") == Some(super::admin::ADMIN_DB) {
        drop(starting);
        return super::admin::serve(&relay, &mut stream).await;
    }
    wait_for_agent(&relay, &m).await;
    let route = match open(&relay, &m) {
        Ok(r) => r,
        Err(refusal) => return refuse(&mut stream, refusal).await,
    };
    relay.streams.set(relay.streams.get() + 1);
    drop(starting);
    relay.stats.borrow_mut().streams_opened += 1;
    tracing::debug!(org = route.org, stream = route.id.0, "stream opened");
    let result = pipe(&relay, &route, &mut stream).await;
    let refused_by_agent = route.conn.take_refused(route.id);
    relay.streams.set(relay.streams.get() - 1);
    route.conn.release(route.id);
    match result {
        Ok(()) => tracing::debug!(org = route.org, stream = route.id.0, "stream closed"),
        Err(PipeError::Client(e)) => {
            tracing::debug!(org = route.org, stream = route.id.0, error = %e, "client connection lost");
        }
        Err(PipeError::Stream { reason, answered }) => {
            tracing::info!(
                org = route.org,
                stream = route.id.0,
                reason,
                "stream failed"
            );
            if !answered {
                // Nothing from the organization reached the client yet, so a FATAL
                // error keeps the protocol in step and says why.
                let code = if refused_by_agent {
                    // A limit of the agent's (its -max-conns as it counts, or it drains).
                    relay.stats.borrow_mut().refused_by_agents += 1;
                    sqlstate::TOO_MANY_CONNECTIONS
                } else {
                    sqlstate::CONNECTION_FAILURE
                };
                refuse(&mut stream, Refusal::new(code, reason)).await;
            }
        }
    }
}

/// Reads the startup phase: an SSLRequest is answered with TLS as `relay.postgres_tls`
/// says (the certificate agents verify), a GSSENCRequest `N`; a CancelRequest or a
/// StartupMessage is returned. `slot` is empty only if a TLS handshake failed.
async fn read_startup(relay: &Relay, slot: &mut Option<ClientStream>) -> Result<Startup, Refusal> {
    let mut encryption_asked = false;
    loop {
        let packet = read_packet(stream_of(slot)).await?;
        let parsed = startup::parse(&packet).map_err(|e| {
            Refusal::new(
                sqlstate::PROTOCOL_VIOLATION,
                format!("invalid startup packet: {e}"),
            )
        })?;
        match parsed {
            StartupPacket::SslRequest | StartupPacket::GssEncRequest if encryption_asked => {
                return Err(Refusal::new(
                    sqlstate::PROTOCOL_VIOLATION,
                    "second encryption request".into(),
                ));
            }
            StartupPacket::SslRequest => {
                encryption_asked = true;
                let tls = relay.postgres_tls.borrow().clone();
                match (tls, slot.take()) {
                    (Some(config), Some(ClientStream::Plain(mut tcp))) => {
                        tcp.write_all(b"S").await.map_err(|_| gone())?;
                        let acceptor = futures_rustls::TlsAcceptor::from(config);
                        match acceptor.accept(tcp).await {
                            Ok(tls) => *slot = Some(ClientStream::Tls(Box::new(tls))),
                            Err(e) => {
                                tracing::info!(error = %e, "relay: a Postgres client's TLS handshake failed");
                                return Err(gone());
                            }
                        }
                    }
                    (_, s) => {
                        *slot = s;
                        send(stream_of(slot), b"N").await.map_err(|_| gone())?;
                    }
                }
            }
            StartupPacket::GssEncRequest => {
                encryption_asked = true;
                send(stream_of(slot), b"N").await.map_err(|_| gone())?;
            }
            StartupPacket::Cancel { pid, secret } => {
                return Ok(Startup::Cancel { pid, secret });
            }
            // Proxies hand each other cancels on their client listeners, not here.
            StartupPacket::PeerCancel { .. } => {
                return Err(Refusal::new(
                    sqlstate::PROTOCOL_VIOLATION,
                    "a proxy's cancel request is not for the relay".into(),
                ));
            }
            StartupPacket::Startup(m) => {
                if m.major != 3 {
                    return Err(Refusal::new(
                        sqlstate::FEATURE_NOT_SUPPORTED,
                        format!("unsupported frontend protocol {}.{}", m.major, m.minor),
                    ));
                }
                return Ok(Startup::Session(m));
            }
        }
    }
}

fn gone() -> Refusal {
    Refusal::new(sqlstate::CONNECTION_FAILURE, "client went away".into())
}

/// The client's stream while it is in its slot.
fn stream_of(slot: &mut Option<ClientStream>) -> &mut ClientStream {
    slot.as_mut()
        .expect("the stream is in its slot outside the TLS handshake")
}

async fn read_packet(tcp: &mut ClientStream) -> Result<Vec<u8>, Refusal> {
    let mut len = [0u8; 4];
    tcp.read_exact(&mut len).await.map_err(|_| gone())?;
    let n = startup::peek_len(&len)
        .map_err(|e| {
            Refusal::new(
                sqlstate::PROTOCOL_VIOLATION,
                format!("invalid startup packet: {e}"),
            )
        })?
        .expect("four bytes were read") as usize;
    let mut packet = vec![0u8; n];
    packet[..4].copy_from_slice(&len);
    tcp.read_exact(&mut packet[4..]).await.map_err(|_| gone())?;
    Ok(packet)
}

/// What the startup phase ended with.
enum Startup {
    /// A session for an organization.
    Session(StartupMessage),
    /// A CancelRequest, forwarded after the startup timeout no longer applies.
    Cancel { pid: u32, secret: Vec<u8> },
}

/// A client's stream.
struct Route {
    org: String,
    conn: Rc<TunnelConn>,
    id: StreamId,
}

/// The organization and the database there a startup packet asks for.
fn target(m: &StartupMessage) -> Result<(&str, &str), Refusal> {
    let database = m
        .param("database")
        .or_else(|| m.param("user"))
        .unwrap_or("");
    match database.split_once('/') {
        Some((org, db)) if !db.is_empty() => Ok((org, db)),
        Some(_) => Err(Refusal::new(
            sqlstate::INVALID_CATALOG_NAME,
            format!("database \"{database}\" names no database after the '/'"),
        )
        .hint("The relay's database name is ORG or ORG/DBNAME.")),
        None => Ok((database, database)),
    }
}

/// Counts a client in [`Relay::starting`] until its stream is open or it is refused.
struct Starting<'a>(&'a Relay);

impl<'a> Starting<'a> {
    fn new(relay: &'a Relay) -> Self {
        relay.starting.set(relay.starting.get() + 1);
        Starting(relay)
    }
}

impl Drop for Starting<'_> {
    fn drop(&mut self) {
        self.0.starting.set(self.0.starting.get() - 1);
    }
}

/// Waits up to `agent_wait` for a known organization's agent when none is connected:
/// agents dial again after a relay restart (a handover's DRAIN) or their own, and a
/// client arriving in that second is served instead of refused.
async fn wait_for_agent(relay: &Relay, m: &StartupMessage) {
    let Ok((org, _)) = target(m) else { return };
    if !relay.tokens.borrow().knows(org) {
        return;
    }
    let deadline = Instant::now() + relay.config.agent_wait;
    while relay.live(org).is_none() && Instant::now() < deadline && !relay.draining.get() {
        crate::rt::sleep(AGENT_POLL).await;
    }
}

/// Picks the organization and opens a stream carrying the (rewritten) startup packet.
fn open(relay: &Relay, m: &StartupMessage) -> Result<Route, Refusal> {
    let (org, dbname) = target(m)?;
    if relay.draining.get() {
        return Err(Refusal::new(
            sqlstate::CANNOT_CONNECT_NOW,
            "the relay is shutting down".into(),
        ));
    }
    if !relay.tokens.borrow().knows(org) {
        relay.stats.borrow_mut().refused_unknown_org += 1;
        return Err(Refusal::new(
            sqlstate::INVALID_CATALOG_NAME,
            format!("organization \"{org}\" is not known to this relay"),
        )
        .hint("The relay's database name is ORG or ORG/DBNAME, with ORG in relay.tokens."));
    }
    let Some(conn) = relay.live(org) else {
        relay.stats.borrow_mut().refused_no_agent += 1;
        return Err(Refusal::new(
            sqlstate::CANNOT_CONNECT,
            format!("organization \"{org}\" has no agent connected to this relay"),
        )
        .hint("Start lokadb-agent beside the organization's database, or check its logs."));
    };
    let max = relay.config.max_streams;
    if relay.streams.get() >= max {
        relay.stats.borrow_mut().refused_max_streams += 1;
        return Err(Refusal::new(
            sqlstate::TOO_MANY_CONNECTIONS,
            format!("the relay's max_streams limit ({max} streams over all agents) is reached"),
        )
        .hint("Raise relay.max_streams, or use fewer connections per organization."));
    }
    let id = conn.open(dbname).map_err(|e| match e {
        StreamError::Limit { max } => {
            relay.stats.borrow_mut().refused_agent_limit += 1;
            Refusal::new(
                sqlstate::TOO_MANY_CONNECTIONS,
                format!("the agent of organization \"{org}\" is at its -max-conns limit ({max} connections)"),
            )
            .hint("Raise the agent's -max-conns, or use fewer connections to this organization.")
        }
        StreamError::Draining => Refusal::new(
            sqlstate::CANNOT_CONNECT_NOW,
            format!("the agent of organization \"{org}\" is reconnecting"),
        )
        .hint("Try again in a second."),
        e => Refusal::new(sqlstate::CONNECTION_FAILURE, format!("cannot open a stream to organization \"{org}\": {e}")),
    })?;
    let params: Vec<(&str, &str)> = m
        .params
        .iter()
        .map(|(k, v)| {
            if k == "database" {
                (k.as_str(), dbname)
            } else {
                (k.as_str(), v.as_str())
            }
        })
        .collect();
    let mut packet = Vec::new();
    startup::encode_startup_version(m.major, m.minor, &params, &mut packet);
    let route = Route {
        org: org.to_owned(),
        conn,
        id,
    };
    if let Err(reason) = route.conn.write(id, Bytes::from(packet)) {
        route.conn.release(id);
        return Err(Refusal::new(sqlstate::CONNECTION_FAILURE, reason));
    }
    Ok(route)
}

enum PipeError {
    /// The client's socket failed.
    Client(std::io::Error),
    /// The stream was reset or its tunnel ended; `answered` if the client already got
    /// bytes from the organization.
    Stream { reason: String, answered: bool },
}

/// Moves bytes both ways until both directions have ended.
async fn pipe(relay: &Relay, route: &Route, tcp: &mut ClientStream) -> Result<(), PipeError> {
    let mut up = vec![0u8; CHUNK];
    let mut up_done = false;
    let mut down: Option<Bytes> = None;
    // The stream's end arrived from the organization; the client's socket is then closed
    // for writing (`down_closed`) once what was written to it has gone out.
    let mut down_done = false;
    let mut down_closed = false;
    let mut answered = false;
    let mut unflushed = false;
    let mut sniffer = KeySniffer::default();
    let owner = CancelOwner {
        org: route.org.clone(),
        conn: route.conn.id,
        stream: route.id.0,
    };
    let (conn, id) = (&route.conn, route.id);
    let result = futures_lite::future::poll_fn(|cx: &mut Context<'_>| loop {
        let mut busy = false;
        // A reset or a dead tunnel ends the pipe even while the client reads nothing.
        if let Some(reason) = conn.reset_reason(id) {
            return Poll::Ready(Err(PipeError::Stream { reason, answered }));
        }

        // Client → tunnel, while the stream's send queue is short.
        if !up_done && conn.poll_send_capacity(id, SEND_QUEUE_LIMIT, cx).is_ready() {
            match Pin::new(&mut *tcp).poll_read(cx, &mut up) {
                Poll::Ready(Ok(0)) => {
                    conn.close(id);
                    up_done = true;
                    busy = true;
                }
                Poll::Ready(Ok(n)) => {
                    relay.stats.borrow_mut().bytes_to_agents += n as u64;
                    if let Err(reason) = conn.write(id, Bytes::copy_from_slice(&up[..n])) {
                        return Poll::Ready(Err(PipeError::Stream { reason, answered }));
                    }
                    busy = true;
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Err(PipeError::Client(e))),
                Poll::Pending => {}
            }
        }

        // Tunnel → client.
        if !down_done {
            if down.is_none() {
                match conn.poll_read(id, CHUNK, cx) {
                    Poll::Ready(Ok(Some(data))) => {
                        if !sniffer.done() {
                            if let Some(key) = sniffer.feed(&data) {
                                relay.note_cancel_key(key, owner.clone());
                            }
                        }
                        relay.stats.borrow_mut().bytes_from_agents += data.len() as u64;
                        down = Some(data);
                    }
                    Poll::Ready(Ok(None)) => {
                        down_done = true;
                        busy = true;
                    }
                    Poll::Ready(Err(reason)) => {
                        return Poll::Ready(Err(PipeError::Stream { reason, answered }))
                    }
                    Poll::Pending => {}
                }
            }
            if let Some(data) = down.as_mut() {
                match Pin::new(&mut *tcp).poll_write(cx, data) {
                    Poll::Ready(Ok(n)) => {
                        answered = true;
                        unflushed = true;
                        let _ = data.split_to(n);
                        if data.is_empty() {
                            down = None;
                        }
                        busy = true;
                    }
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(PipeError::Client(e))),
                    Poll::Pending => {}
                }
            }
            // TLS keeps a record back until flushed; plain TCP has nothing to flush.
            if unflushed && down.is_none() {
                match Pin::new(&mut *tcp).poll_flush(cx) {
                    Poll::Ready(Ok(())) => unflushed = false,
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(PipeError::Client(e))),
                    Poll::Pending => {}
                }
            }
        }

        // Half-close towards the client once the last bytes are written: a client waits
        // for the end of file after a FATAL (libpq does), so a close that has to wait for
        // a send still in flight is polled again, never dropped. Errors mean it is gone.
        if down_done && !down_closed && down.is_none() {
            if let Poll::Ready(r) = Pin::new(&mut *tcp).poll_close(cx) {
                if let Err(e) = r {
                    tracing::debug!(org = owner.org, "half-close towards the client failed: {e}");
                }
                down_closed = true;
                busy = true;
            }
        }
        if up_done && down_closed {
            return Poll::Ready(Ok(()));
        }
        if !busy {
            conn.watch(id, cx);
            return Poll::Pending;
        }
    })
    .await;
    if let Some(key) = sniffer.key() {
        relay.forget_cancel_key(&key, &owner);
    }
    result
}

async fn refuse(tcp: &mut ClientStream, r: Refusal) {
    let mut out = Vec::new();
    backend::error_response(
        &mut out,
        &ErrorFields {
            severity: Severity::Fatal,
            code: r.code,
            message: &r.message,
            detail: None,
            hint: r.hint,
        },
    );
    tracing::debug!(code = r.code, message = r.message, "relay client refused");
    let _ = crate::time::with_timeout(std::time::Duration::from_secs(1), send(tcp, &out)).await;
}
