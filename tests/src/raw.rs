//! [`Raw`], a client that speaks the Postgres protocol by hand, for tests that must send or
//! see what drivers hide: its own statement names, a batch without a Sync between
//! statements, any startup parameter, the BackendKeyData, every field of an ErrorResponse.

use postgres_protocol::authentication::sasl::{ChannelBinding, ScramSha256, SCRAM_SHA_256};
use postgres_protocol::message::frontend;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A protocol 3.0 session on a TCP connection, logged in to database `app`.
pub struct Raw {
    stream: TcpStream,
    /// Bytes read and not yet returned as a message.
    buf: Vec<u8>,
    /// The bodies of the BackendKeyData messages of the login, in order.
    pub key_data: Vec<Vec<u8>>,
}

impl Raw {
    /// Logs in at 127.0.0.1:`port` as the harness's superuser ([`crate::pg::SUPERUSER`]).
    ///
    /// # Panics
    ///
    /// As [`Raw::login`].
    pub async fn connect(port: u16) -> Raw {
        Raw::connect_with(port, &[]).await
    }

    /// [`Raw::connect`] with `params` in the startup packet besides user and database.
    ///
    /// # Panics
    ///
    /// As [`Raw::login`].
    pub async fn connect_with(port: u16, params: &[(&str, &str)]) -> Raw {
        let (user, password) = (crate::pg::SUPERUSER, crate::pg::SUPERUSER_PASSWORD);
        Raw::login(port, user, password, params).await
    }

    /// Logs in at 127.0.0.1:`port` to database `app` as `user` (SCRAM-SHA-256 with
    /// `password`, or whatever the server asks none of), with `params` in the startup
    /// packet besides user and database, up to the first ReadyForQuery.
    ///
    /// # Panics
    ///
    /// If the connection fails or the login is refused.
    pub async fn login(port: u16, user: &str, password: &str, params: &[(&str, &str)]) -> Raw {
        let stream = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
        let mut raw = Raw {
            stream,
            buf: Vec::new(),
            key_data: Vec::new(),
        };
        let mut startup = vec![("user", user), ("database", "app")];
        startup.extend_from_slice(params);
        let mut out = bytes::BytesMut::new();
        frontend::startup_message(startup, &mut out).unwrap();
        raw.send(&out).await;
        let mut scram = ScramSha256::new(password.as_bytes(), ChannelBinding::unsupported());
        loop {
            let (tag, body) = raw.message().await;
            let mut out = bytes::BytesMut::new();
            match (tag, body.get(..4).map(be32)) {
                (b'R', Some(10)) => {
                    frontend::sasl_initial_response(SCRAM_SHA_256, scram.message(), &mut out)
                        .unwrap();
                }
                (b'R', Some(11)) => {
                    scram.update(&body[4..]).unwrap();
                    frontend::sasl_response(scram.message(), &mut out).unwrap();
                }
                (b'R', Some(12)) => scram.finish(&body[4..]).unwrap(),
                (b'K', _) => raw.key_data.push(body),
                (b'Z', _) => return raw,
                (b'E', _) => panic!("login refused: {}", String::from_utf8_lossy(&body)),
                _ => {}
            }
            if !out.is_empty() {
                raw.send(&out).await;
            }
        }
    }

    /// Writes `bytes` (whole messages).
    ///
    /// # Panics
    ///
    /// If the write fails.
    pub async fn send(&mut self, bytes: &[u8]) {
        self.stream.write_all(bytes).await.unwrap();
    }

    /// The next message: its tag and body.
    ///
    /// # Panics
    ///
    /// If the read fails or the server closed the connection.
    pub async fn message(&mut self) -> (u8, Vec<u8>) {
        loop {
            if self.buf.len() >= 5 {
                let len = be32(&self.buf[1..5]) as usize;
                if self.buf.len() > len {
                    let body = self.buf[5..=len].to_vec();
                    let tag = self.buf[0];
                    self.buf.drain(..=len);
                    return (tag, body);
                }
            }
            let mut chunk = [0u8; 8192];
            let n = self.stream.read(&mut chunk).await.unwrap();
            assert!(n > 0, "the proxy closed the connection");
            self.buf.extend_from_slice(&chunk[..n]);
        }
    }

    /// Parses `sql` as statement `name` (when `parse`), binds and executes it, and syncs;
    /// the first column of each row as text.
    ///
    /// # Panics
    ///
    /// On an ErrorResponse.
    pub async fn run(&mut self, name: &str, sql: &str, parse: bool) -> Vec<String> {
        match self.try_run(name, sql, parse).await {
            Ok(rows) => rows,
            Err(body) => panic!("{name}: {}", String::from_utf8_lossy(&body)),
        }
    }

    /// [`Raw::run`], with an ErrorResponse's body as the error (the batch then ends at its
    /// ReadyForQuery).
    ///
    /// # Panics
    ///
    /// If the read or write fails.
    pub async fn try_run(
        &mut self,
        name: &str,
        sql: &str,
        parse: bool,
    ) -> Result<Vec<String>, Vec<u8>> {
        let mut out = bytes::BytesMut::new();
        if parse {
            frontend::parse(name, sql, [], &mut out).unwrap();
        }
        let no_values: [Option<&[u8]>; 0] = [];
        frontend::bind(
            "",
            name,
            [],
            no_values,
            |_: Option<&[u8]>, _| Ok(postgres_protocol::IsNull::Yes),
            [],
            &mut out,
        )
        .map_err(|_| "bind")
        .unwrap();
        frontend::execute("", 0, &mut out).unwrap();
        frontend::sync(&mut out);
        self.send(&out).await;
        let mut rows = Vec::new();
        let mut error = None;
        loop {
            let (tag, body) = self.message().await;
            match tag {
                b'D' => rows.push(first_column(&body)),
                b'E' => error = Some(body),
                b'Z' => return error.map_or(Ok(rows), Err),
                _ => {}
            }
        }
    }
}

/// A big-endian u32 from the first four bytes of `b`.
///
/// # Panics
///
/// If `b` is shorter.
pub fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes(b[..4].try_into().unwrap())
}

/// The first column of a DataRow body, as text.
///
/// # Panics
///
/// If it is NULL or the body is malformed.
pub fn first_column(body: &[u8]) -> String {
    let len = be32(&body[2..6]) as usize;
    String::from_utf8(body[6..6 + len].to_vec()).unwrap()
}

/// The fields of an ErrorResponse or NoticeResponse body: (code, value), in order.
pub fn fields(body: &[u8]) -> Vec<(u8, String)> {
    body.split(|&b| b == 0)
        .take_while(|f| !f.is_empty())
        .map(|f| (f[0], String::from_utf8_lossy(&f[1..]).into_owned()))
        .collect()
}

/// One field of an ErrorResponse or NoticeResponse body (`b'C'`: its SQLSTATE).
pub fn field(body: &[u8], code: u8) -> Option<String> {
    fields(body)
        .into_iter()
        .find(|&(c, _)| c == code)
        .map(|(_, v)| v)
}
