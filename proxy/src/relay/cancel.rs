//! CancelRequests through the relay.
//!
//! A client's cancel request carries the backend key its session got from the
//! organization's Postgres, on a new connection without a startup packet naming the
//! organization. The relay therefore notes each stream's BackendKeyData as it passes
//! (once, at the start of the stream) and sends a cancel request for that key through
//! a new stream of the same organization's tunnel.

use super::registry::Relay;
use bytes::Bytes;
use lokadb_shared::wire::startup;
use lokadb_shared::wire::Header;
use std::rc::Rc;
use std::time::Duration;

/// Bytes at the start of a stream searched for BackendKeyData: authentication and
/// ParameterStatus come first and are far smaller.
const SNIFF_LIMIT: usize = 64 * 1024;
/// Largest message looked at while sniffing.
const MAX_SNIFFED_MESSAGE: u32 = 16 * 1024;

/// Finds BackendKeyData (`K`) in the first messages of a stream.
#[derive(Default)]
pub struct KeySniffer {
    buf: Vec<u8>,
    key: Option<(u32, Vec<u8>)>,
    done: bool,
}

impl KeySniffer {
    /// Whether there is nothing more to look for.
    pub fn done(&self) -> bool {
        self.done
    }

    /// The key found, if any.
    pub fn key(&self) -> Option<(u32, Vec<u8>)> {
        self.key.clone()
    }

    /// Looks at the next bytes from the server; returns the key when it is found.
    pub fn feed(&mut self, data: &[u8]) -> Option<(u32, Vec<u8>)> {
        if self.done {
            return None;
        }
        self.buf.extend_from_slice(data);
        let mut at = 0;
        loop {
            let header = match Header::peek(&self.buf[at..], MAX_SNIFFED_MESSAGE) {
                Ok(Some(h)) => h,
                Ok(None) => break,
                Err(_) => {
                    self.finish();
                    return None;
                }
            };
            let end = at + header.frame_len();
            if end > self.buf.len() {
                break;
            }
            let body = &self.buf[at + 5..end];
            match header.tag {
                b'K' if body.len() >= 5 => {
                    let pid = u32::from_be_bytes(body[..4].try_into().expect("4 bytes"));
                    let key = (pid, body[4..].to_vec());
                    self.key = Some(key.clone());
                    self.finish();
                    return Some(key);
                }
                // ReadyForQuery or an error before any key: there is none.
                b'Z' | b'E' => {
                    self.finish();
                    return None;
                }
                _ => {}
            }
            at = end;
        }
        self.buf.drain(..at);
        if self.buf.len() > SNIFF_LIMIT {
            self.finish();
        }
        None
    }

    fn finish(&mut self) {
        self.done = true;
        self.buf = Vec::new();
    }
}

/// Sends a cancel request for `pid`/`secret` to the organization whose stream saw
/// that key; an unknown key is ignored, as Postgres does.
pub async fn forward(relay: &Rc<Relay>, pid: u32, secret: Vec<u8>) {
    let org = relay.cancel_target(&(pid, secret.clone()));
    let Some(org) = org else {
        tracing::debug!(pid, "cancel request with an unknown key ignored");
        return;
    };
    let Some(conn) = relay.live(&org) else {
        tracing::debug!(pid, org, "cancel request for an organization without agent");
        return;
    };
    let Ok(id) = conn.open("cancel") else {
        tracing::debug!(pid, org, "no stream for a cancel request");
        return;
    };
    let mut packet = Vec::new();
    startup::encode_cancel(pid, &secret, &mut packet);
    if conn.write(id, Bytes::from(packet)).is_ok() {
        conn.close(id);
        // Postgres answers a cancel request by closing the connection.
        let _ = crate::time::with_timeout(
            Duration::from_secs(5),
            futures_lite::future::poll_fn(|cx| loop {
                match conn.poll_read(id, 1024, cx) {
                    std::task::Poll::Ready(Ok(Some(_))) => continue,
                    std::task::Poll::Ready(_) => return std::task::Poll::Ready(()),
                    std::task::Poll::Pending => return std::task::Poll::Pending,
                }
            }),
        )
        .await;
    }
    conn.release(id);
    tracing::debug!(pid, org, "cancel request forwarded");
}

#[cfg(test)]
mod tests {
    use super::*;
    use lokadb_shared::wire::backend;

    #[test]
    fn finds_the_key_across_split_reads() {
        let mut server = Vec::new();
        backend::auth_ok(&mut server);
        backend::parameter_status(&mut server, "server_version", "18.1");
        backend::backend_key_data(&mut server, 4242, 0xdead_beef);
        backend::ready_for_query(&mut server, b'I');
        for split in 1..server.len() {
            let mut s = KeySniffer::default();
            let a = s.feed(&server[..split]);
            let b = s.feed(&server[split..]);
            assert_eq!(
                a.or(b),
                Some((4242, 0xdead_beef_u32.to_be_bytes().to_vec()))
            );
            assert!(s.done());
        }
    }

    #[test]
    fn gives_up_at_ready_for_query_or_garbage() {
        let mut s = KeySniffer::default();
        let mut server = Vec::new();
        backend::ready_for_query(&mut server, b'I');
        assert_eq!(s.feed(&server), None);
        assert!(s.done());
        let mut s = KeySniffer::default();
        assert_eq!(s.feed(&[b'K', 0xff, 0xff, 0xff, 0xff]), None);
        assert!(s.done());
    }
}
