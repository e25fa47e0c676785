//! Test support: a fake relay (TLS + `Tunnel::relay`, driven by hand), a Postgres
//! stand-in that echoes, and the agent binary as a child process.

#![allow(dead_code)]

use std::collections::VecDeque;
use std::io::{self, BufRead, BufReader, Read as _, Write as _};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::mpsc::{self, Receiver};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use lokadb_shared::tunnel::{Config, Event, Link, Tunnel};

static NEXT_FILE: AtomicU32 = AtomicU32::new(0);

/// A relay listener with a self-signed certificate for `127.0.0.1` and `relay.test`.
pub struct FakeRelay {
    listener: TcpListener,
    server: Arc<rustls::ServerConfig>,
    /// The certificate, as a PEM file for the agent's `--ca`.
    pub ca_file: PathBuf,
}

impl FakeRelay {
    pub fn new() -> FakeRelay {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let ck = rcgen::generate_simple_self_signed(vec!["127.0.0.1".into(), "relay.test".into()])
            .unwrap();
        let ca_file = std::env::temp_dir().join(format!(
            "lokadb-agent-test-ca-{}-{}.pem",
            std::process::id(),
            NEXT_FILE.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::write(&ca_file, ck.cert.pem()).unwrap();
        let key = rustls::pki_types::PrivateKeyDer::Pkcs8(ck.key_pair.serialize_der().into());
        let server = rustls::ServerConfig::builder()
            .with_no_client_auth()
            .with_single_cert(vec![ck.cert.der().clone()], key)
            .unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        listener.set_nonblocking(true).unwrap();
        FakeRelay {
            listener,
            server: Arc::new(server),
            ca_file,
        }
    }

    pub fn addr(&self) -> SocketAddr {
        self.listener.local_addr().unwrap()
    }

    /// The next connection from the agent, within `timeout`.
    pub fn accept(&self, timeout: Duration) -> RelayConn {
        let deadline = Instant::now() + timeout;
        loop {
            match self.listener.accept() {
                Ok((sock, _)) => {
                    sock.set_nonblocking(false).unwrap();
                    sock.set_read_timeout(Some(Duration::from_millis(10)))
                        .unwrap();
                    sock.set_nodelay(true).unwrap();
                    let tls = rustls::ServerConnection::new(self.server.clone()).unwrap();
                    let tunnel = Tunnel::relay(Config::default(), Instant::now());
                    return RelayConn {
                        sock,
                        link: Link::new(tls, tunnel),
                        events: VecDeque::new(),
                        ended: None,
                    };
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    assert!(
                        Instant::now() < deadline,
                        "the agent did not connect within {timeout:?}"
                    );
                    thread::sleep(Duration::from_millis(5));
                }
                Err(e) => panic!("accept: {e}"),
            }
        }
    }
}

impl Drop for FakeRelay {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.ca_file);
    }
}

/// One agent connection, seen from the relay.
pub struct RelayConn {
    pub sock: TcpStream,
    pub link: Link,
    pub events: VecDeque<Event>,
    /// Why the link ended, once it has.
    pub ended: Option<String>,
}

impl RelayConn {
    pub fn tunnel(&mut self) -> &mut Tunnel {
        self.link.tunnel()
    }

    /// One round: write what the link has, read for up to 10 ms, run timers.
    pub fn pump(&mut self) {
        if self.ended.is_some() {
            thread::sleep(Duration::from_millis(10));
            return;
        }
        let mut out = Vec::new();
        while self.link.transmit(&mut out, 1 << 20) {
            if let Err(e) = self.sock.write_all(&out) {
                self.ended = Some(format!("write: {e}"));
                return;
            }
            out.clear();
        }
        let mut buf = vec![0u8; 64 * 1024];
        let now = Instant::now();
        let received = match self.sock.read(&mut buf) {
            Ok(n) => self.link.receive(now, &buf[..n]).map_err(|e| e.to_string()),
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                Ok(())
            }
            Err(e) => Err(format!("read: {e}")),
        };
        let timed = self
            .link
            .tunnel()
            .handle_timeout(now)
            .map_err(|e| e.to_string());
        while let Some(ev) = self.link.tunnel().poll_event() {
            self.events.push_back(ev);
        }
        if let Err(e) = received.and(timed) {
            self.ended = Some(e);
        }
    }

    /// Pumps until `f` returns something, or panics after `timeout`.
    pub fn until<T>(
        &mut self,
        timeout: Duration,
        mut f: impl FnMut(&mut RelayConn) -> Option<T>,
    ) -> T {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(t) = f(self) {
                return t;
            }
            assert!(
                Instant::now() < deadline,
                "timed out; link ended: {:?}",
                self.ended
            );
            self.pump();
        }
    }

    /// The next tunnel event.
    pub fn next_event(&mut self, timeout: Duration) -> Event {
        self.until(timeout, |c| c.events.pop_front())
    }

    /// Waits for HELLO and accepts it; returns the token.
    pub fn accept_hello(&mut self) -> String {
        let token = match self.next_event(Duration::from_secs(5)) {
            Event::Hello(h) => h.token,
            other => panic!("expected HELLO, got {other:?}"),
        };
        self.tunnel().handle_accept(Instant::now()).unwrap();
        self.pump();
        token
    }

    /// Waits until the agent's side of the link is gone (EOF, reset, close_notify).
    pub fn wait_ended(&mut self, timeout: Duration) -> String {
        self.until(timeout, |c| c.ended.clone())
    }
}

/// A Postgres stand-in: echoes each connection's bytes and closes after its end of file.
pub fn echo_server() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut s) = conn else { return };
            thread::spawn(move || {
                let mut r = s.try_clone().unwrap();
                let _ = io::copy(&mut r, &mut s);
                let _ = s.shutdown(Shutdown::Write);
            });
        }
    });
    addr
}

/// An address nobody listens on.
pub fn closed_port() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap()
}

/// The agent binary, running; killed on drop.
pub struct Agent {
    child: Child,
    stdout: Receiver<String>,
    stderr: Arc<Mutex<String>>,
}

impl Agent {
    pub fn start(args: &[String], envs: &[(&str, &str)]) -> Agent {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_lokadb-agent"));
        for var in [
            "LOKADB_RELAY",
            "LOKADB_TOKEN",
            "LOKADB_POSTGRES",
            "LOKADB_MAX_CONNS",
            "LOKADB_CA",
            "LOKADB_SERVER_NAME",
            "LOKADB_MUX_WINDOW_KB",
            "LOKADB_LOG",
        ] {
            cmd.env_remove(var);
        }
        cmd.args(args).envs(envs.iter().copied());
        cmd.stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .stdin(Stdio::null());
        let mut child = cmd.spawn().unwrap();
        let (tx, stdout) = mpsc::channel();
        let out = child.stdout.take().unwrap();
        thread::spawn(move || {
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { return };
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        let stderr = Arc::new(Mutex::new(String::new()));
        let err = child.stderr.take().unwrap();
        let sink = stderr.clone();
        thread::spawn(move || {
            for line in BufReader::new(err).lines() {
                let Ok(line) = line else { return };
                let mut s = sink.lock().unwrap();
                s.push_str(&line);
                s.push('\n');
            }
        });
        Agent {
            child,
            stdout,
            stderr,
        }
    }

    /// The agent's log so far.
    pub fn log(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }

    /// The next stdout line, pumping `conn` while waiting.
    pub fn stdout_line(&self, conn: &mut RelayConn, timeout: Duration) -> String {
        conn.until(timeout, |_| self.stdout.try_recv().ok())
    }

    /// Waits until the log contains `text`, pumping `conn` if given.
    pub fn wait_log(&self, text: &str, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while !self.log().contains(text) {
            assert!(
                Instant::now() < deadline,
                "{text:?} not logged; log:\n{}",
                self.log()
            );
            thread::sleep(Duration::from_millis(10));
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The usual arguments.
pub fn agent_args(relay: &FakeRelay, postgres: SocketAddr, token: &str) -> Vec<String> {
    vec![
        "--relay".into(),
        relay.addr().to_string(),
        "--token".into(),
        token.into(),
        "--postgres".into(),
        postgres.to_string(),
        "--ca".into(),
        relay.ca_file.display().to_string(),
    ]
}
