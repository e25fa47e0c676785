//! One connection to the cloud database: connect, log in with SCRAM, remember what
//! the backend reported at startup, and run the few statements the proxy sends on its
//! own account (the auth query, the pool reset).

use crate::net::cloud_tls::{CloudTls, TlsError};
use crate::net::stream::{send, ServerStream, Stream};
use crate::rt::net::TcpStream;
use crate::scram::{ClientExchange, Credentials, MECHANISM};
use futures_lite::{AsyncReadExt, AsyncWriteExt};
use lokadb_shared::wire::fields::Fields;
use lokadb_shared::wire::notice::Notice;
use lokadb_shared::wire::tags::*;
use lokadb_shared::wire::{backend, frontend, startup, FrameError, Header};
use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::os::fd::AsRawFd;

/// Largest message accepted from the cloud on the control path (rows of the auth
/// query, notices). Forwarded client traffic is not bounded by this.
const MAX_CONTROL_MESSAGE: u32 = 1 << 20;

/// Why a connection or a control statement failed.
#[derive(Debug)]
pub enum ConnError {
    /// TCP or socket error.
    Io(io::Error),
    /// TLS could not be set up (`sslmode` in `cloud`).
    Tls(TlsError),
    /// The cloud answered with an ErrorResponse (the whole frame, to forward).
    Rejected {
        /// The parsed fields.
        notice: Notice,
        /// The raw frame.
        frame: Vec<u8>,
    },
    /// The cloud asked for an authentication method passthrough cannot answer.
    UnsupportedAuth(&'static str),
    /// SCRAM failed (e.g. the cloud's verifier changed).
    Scram(crate::scram::ScramError),
    /// The cloud broke the protocol.
    Protocol(String),
}

impl fmt::Display for ConnError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConnError::Io(e) => write!(f, "{e}"),
            ConnError::Tls(e) => write!(f, "{e}"),
            ConnError::Rejected { notice, .. } => write!(
                f,
                "{}: {} ({})",
                notice.severity, notice.message, notice.code
            ),
            ConnError::UnsupportedAuth(m) => write!(
                f,
                "the cloud asks for {m} authentication; SCRAM passthrough needs scram-sha-256 \
                 (or a plain password in users_file)"
            ),
            ConnError::Scram(e) => write!(f, "{e}"),
            ConnError::Protocol(m) => write!(f, "protocol error from the cloud: {m}"),
        }
    }
}

impl From<io::Error> for ConnError {
    fn from(e: io::Error) -> Self {
        ConnError::Io(e)
    }
}

impl From<FrameError> for ConnError {
    fn from(e: FrameError) -> Self {
        ConnError::Protocol(e.to_string())
    }
}

/// A logged-in connection to the cloud database.
pub struct BackendConn {
    /// The socket, TLS or plain.
    pub stream: ServerStream,
    /// Bytes read but not consumed yet (handed to the session's pump).
    pub rbuf: Vec<u8>,
    /// ParameterStatus values, as they stand now.
    pub params: Vec<(String, String)>,
    /// Backend process ID (for cancel requests).
    pub pid: u32,
    /// Backend cancel secret.
    pub secret: Vec<u8>,
    /// Where it is connected (for cancel requests).
    pub addr: SocketAddr,
    /// Transaction status of the last ReadyForQuery.
    pub status: u8,
    /// A direct connection's place under `direct_max`, given back when it is dropped.
    pub permit: Option<super::slots::Permit>,
    /// A direct connection's lease: renewed (per core) each time a session takes it, so a
    /// session that gets back the one it had, under the same lease, knows nobody else
    /// used it since (0: never taken).
    pub lease: u64,
    /// What a cloud backend holds at login (its `lokadb.org`, its transaction defaults),
    /// once asked ([`super::at_login`]).
    pub at_login: Option<super::at_login::AtLogin>,
    /// A cloud backend's place under `pool_size`, given back when it is dropped.
    pub place: Option<super::gauge::Held>,
    /// … and its count on its core (each core's fair share of `pool_size` is its own).
    pub core_place: Option<super::slots::Permit<super::slots::CloudKey>>,
    /// What it holds of the sessions it served in transaction pooling.
    pub holds: super::pool::Holds,
}

impl BackendConn {
    /// Connects and logs in as `user` to `dbname`, sending `params` in the startup packet,
    /// over TLS as `tls` says (`None`: plain).
    ///
    /// # Errors
    ///
    /// [`ConnError`]; an ErrorResponse from the cloud (unknown role, no CONNECT
    /// privilege, too many connections) comes back as [`ConnError::Rejected`].
    pub async fn connect(
        addr: SocketAddr,
        user: &str,
        dbname: &str,
        params: &[(String, String)],
        creds: &Credentials,
        tls: Option<&CloudTls>,
    ) -> Result<BackendConn, ConnError> {
        let tcp = TcpStream::connect(addr).await?;
        tcp.set_nodelay(true)?;
        let stream = match tls {
            Some(tls) => tls.negotiate(tcp).await.map_err(ConnError::Tls)?,
            None => Stream::Plain(tcp),
        };
        let mut conn = BackendConn {
            stream,
            rbuf: Vec::with_capacity(4096),
            params: Vec::new(),
            pid: 0,
            secret: Vec::new(),
            addr,
            status: TX_IDLE,
            permit: None,
            lease: 0,
            at_login: None,
            place: None,
            core_place: None,
            holds: super::pool::Holds::default(),
        };
        let mut out = Vec::with_capacity(256);
        let mut startup_params: Vec<(&str, &str)> = vec![("user", user), ("database", dbname)];
        startup_params.extend(params.iter().map(|(k, v)| (k.as_str(), v.as_str())));
        startup::encode_startup(&startup_params, &mut out);
        send(&mut conn.stream, &out).await?;
        conn.login(creds).await?;
        Ok(conn)
    }

    async fn login(&mut self, creds: &Credentials) -> Result<(), ConnError> {
        let mut scram: Option<ClientExchange> = None;
        let mut expected_sig = None;
        loop {
            let (tag, body) = self.read_message().await?;
            match tag {
                BE_AUTHENTICATION => {
                    let mut f = Fields::new(&body, "Authentication");
                    match f.i32()? {
                        AUTH_OK => {}
                        AUTH_SASL => {
                            let mut offered = false;
                            while let Ok(m) = f.cstr() {
                                if m.is_empty() {
                                    break;
                                }
                                offered |= m == MECHANISM;
                            }
                            if !offered {
                                return Err(ConnError::UnsupportedAuth(
                                    "a SASL mechanism other than SCRAM-SHA-256",
                                ));
                            }
                            let (exchange, first) = ClientExchange::start();
                            scram = Some(exchange);
                            let mut out = Vec::new();
                            frontend::sasl_initial_response(&mut out, MECHANISM, first.as_bytes());
                            send(&mut self.stream, &out).await?;
                        }
                        AUTH_SASL_CONTINUE => {
                            let exchange = scram.take().ok_or_else(|| {
                                ConnError::Protocol("unexpected SASLContinue".into())
                            })?;
                            let first = exchange
                                .read_server_first(f.rest())
                                .map_err(ConnError::Scram)?;
                            let keys = crate::scram::keys(creds, &first)
                                .await
                                .map_err(ConnError::Scram)?;
                            let (fin, sig) = exchange.respond(&first, &keys);
                            expected_sig = Some(sig);
                            let mut out = Vec::new();
                            frontend::sasl_response(&mut out, fin.as_bytes());
                            send(&mut self.stream, &out).await?;
                        }
                        AUTH_SASL_FINAL => {
                            let sig = expected_sig.take().ok_or_else(|| {
                                ConnError::Protocol("unexpected SASLFinal".into())
                            })?;
                            ClientExchange::verify_final(f.rest(), &sig)
                                .map_err(ConnError::Scram)?;
                        }
                        AUTH_CLEARTEXT_PASSWORD => match creds {
                            Credentials::Password(p) => {
                                let mut out = Vec::new();
                                backend::write_frame(&mut out, FE_PASSWORD, |b| {
                                    backend::put_cstr(b, &p.0)
                                });
                                send(&mut self.stream, &out).await?;
                            }
                            Credentials::Keys(_) => {
                                return Err(ConnError::UnsupportedAuth("password"))
                            }
                        },
                        AUTH_MD5_PASSWORD => return Err(ConnError::UnsupportedAuth("md5")),
                        _ => return Err(ConnError::UnsupportedAuth("an unknown")),
                    }
                }
                BE_PARAMETER_STATUS => self.set_param(&body)?,
                BE_BACKEND_KEY_DATA => {
                    let mut f = Fields::new(&body, "BackendKeyData");
                    self.pid = f.i32()? as u32;
                    self.secret = f.rest().to_vec();
                }
                BE_NOTICE_RESPONSE | BE_NEGOTIATE_PROTOCOL_VERSION => {}
                BE_ERROR_RESPONSE => return Err(rejected(body)),
                BE_READY_FOR_QUERY => {
                    self.status = body.first().copied().unwrap_or(TX_IDLE);
                    return Ok(());
                }
                other => {
                    return Err(ConnError::Protocol(format!(
                        "unexpected message {other} during login"
                    )))
                }
            }
        }
    }

    fn set_param(&mut self, body: &[u8]) -> Result<(), ConnError> {
        let mut f = Fields::new(body, "ParameterStatus");
        let (name, value) = (f.cstr()?.to_owned(), f.cstr()?.to_owned());
        match self.params.iter_mut().find(|(k, _)| *k == name) {
            Some(slot) => slot.1 = value,
            None => self.params.push((name, value)),
        }
        Ok(())
    }

    /// Reads one whole message (control path only: allocates the body).
    ///
    /// # Errors
    ///
    /// EOF or a socket error as [`ConnError::Io`], bad framing as [`ConnError::Protocol`].
    pub async fn read_message(&mut self) -> Result<(u8, Vec<u8>), ConnError> {
        loop {
            if let Some(h) = Header::peek(&self.rbuf, MAX_CONTROL_MESSAGE)? {
                if self.rbuf.len() >= h.frame_len() {
                    let body = self.rbuf[5..h.frame_len()].to_vec();
                    self.rbuf.drain(..h.frame_len());
                    return Ok((h.tag, body));
                }
            }
            // Read straight into the buffer's tail: a stack array here would live in
            // every session's future (it is held across the await).
            let filled = self.rbuf.len();
            self.rbuf.resize(filled + 8192, 0);
            let read = self.stream.read(&mut self.rbuf[filled..]).await;
            let n = *read.as_ref().unwrap_or(&0);
            self.rbuf.truncate(filled + n);
            if read? == 0 {
                return Err(ConnError::Io(io::ErrorKind::UnexpectedEof.into()));
            }
        }
    }

    /// Sends `sql` statements as pipelined simple queries and waits for all of them.
    /// ParameterStatus changes they cause are recorded.
    ///
    /// # Errors
    ///
    /// The first ErrorResponse as [`ConnError::Rejected`] (after reading to the end).
    pub async fn execute_simple(&mut self, sqls: &[&str]) -> Result<(), ConnError> {
        self.simple_first_value(sqls).await.map(drop)
    }

    /// As [`Self::execute_simple`], and returns the first column of the first row any of
    /// them returned: `None` when none did, `Some(None)` for NULL.
    ///
    /// # Errors
    ///
    /// The first ErrorResponse as [`ConnError::Rejected`] (after reading to the end).
    pub async fn simple_first_value(
        &mut self,
        sqls: &[&str],
    ) -> Result<Option<Option<String>>, ConnError> {
        let mut out = Vec::new();
        for sql in sqls {
            frontend::query(&mut out, sql);
        }
        send(&mut self.stream, &out).await?;
        let mut first_error = None;
        let mut result = None;
        let mut remaining = sqls.len();
        while remaining > 0 {
            let (tag, body) = self.read_message().await?;
            match tag {
                BE_DATA_ROW if result.is_none() => result = Some(first_column(&body)?),
                BE_PARAMETER_STATUS => self.set_param(&body)?,
                BE_ERROR_RESPONSE => first_error = first_error.or(Some(rejected(body))),
                BE_READY_FOR_QUERY => {
                    self.status = body.first().copied().unwrap_or(TX_IDLE);
                    remaining -= 1;
                }
                _ => {}
            }
        }
        first_error.map_or(Ok(result), Err)
    }

    /// Runs a one-parameter query with the extended protocol and returns the first
    /// column of the first row: `None` when there is no row, `Some(None)` for NULL.
    /// The statement is prepared as `name` on this connection when `prepare` is set (the
    /// first call), so the cloud parses and plans it once per connection.
    ///
    /// # Errors
    ///
    /// [`ConnError::Rejected`] when the query fails.
    pub async fn query_one(
        &mut self,
        name: &str,
        sql: &str,
        prepare: bool,
        param: &str,
    ) -> Result<Option<Option<String>>, ConnError> {
        let mut out = Vec::new();
        if prepare {
            frontend::parse(&mut out, name, sql);
        }
        frontend::bind_text(&mut out, name, &[Some(param)]);
        frontend::execute(&mut out);
        frontend::sync(&mut out);
        send(&mut self.stream, &out).await?;
        let mut result = None;
        let mut error = None;
        loop {
            let (tag, body) = self.read_message().await?;
            match tag {
                BE_DATA_ROW if result.is_none() => result = Some(first_column(&body)?),
                BE_ERROR_RESPONSE => error = Some(rejected(body)),
                BE_PARAMETER_STATUS => self.set_param(&body)?,
                BE_READY_FOR_QUERY => {
                    self.status = body.first().copied().unwrap_or(TX_IDLE);
                    return error.map_or(Ok(result), Err);
                }
                _ => {}
            }
        }
    }

    /// Whether the idle socket is still usable: nothing to read, not closed. A pooled
    /// backend can be terminated by the server (idle timeouts, admin) while it waits.
    pub fn is_idle_and_open(&self) -> bool {
        if !self.rbuf.is_empty() {
            return false;
        }
        let mut byte = 0u8;
        // SAFETY: recv into a valid 1-byte buffer on a socket fd we own.
        let n = unsafe {
            libc::recv(
                self.stream.tcp().as_raw_fd(),
                (&mut byte as *mut u8).cast(),
                1,
                libc::MSG_PEEK | libc::MSG_DONTWAIT,
            )
        };
        n < 0 && io::Error::last_os_error().kind() == io::ErrorKind::WouldBlock
    }

    /// Says goodbye politely (best effort).
    pub async fn terminate(mut self) {
        let mut out = Vec::new();
        frontend::terminate(&mut out);
        let _ = send(&mut self.stream, &out).await;
        let _ = self.stream.close().await;
    }
}

/// The first column of a DataRow (text), `None` for NULL or no column.
fn first_column(body: &[u8]) -> Result<Option<String>, ConnError> {
    let mut f = Fields::new(body, "DataRow");
    if f.i16()? < 1 {
        return Ok(None);
    }
    match f.i32()? {
        -1 => Ok(None),
        n if n >= 0 => Ok(Some(
            String::from_utf8_lossy(f.take(n as usize)?).into_owned(),
        )),
        _ => Err(ConnError::Protocol("negative column length".into())),
    }
}
fn rejected(body: Vec<u8>) -> ConnError {
    let notice = Notice::parse(&body).unwrap_or_default();
    let mut frame = Vec::with_capacity(body.len() + 5);
    backend::write_frame(&mut frame, BE_ERROR_RESPONSE, |b| {
        b.extend_from_slice(&body)
    });
    ConnError::Rejected { notice, frame }
}
