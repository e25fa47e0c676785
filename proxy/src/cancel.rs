//! Cancel requests: each client session gets its own key, mapped to the backend it
//! uses, so a client can only ever cancel its own queries — never those of the next
//! client of a pooled backend.
//!
//! The key's process ID carries the core that owns the session in its top 8 bits. A
//! CancelRequest lands on any core (SO_REUSEPORT); if it is not the owner, it is
//! forwarded over the cross-core mesh. Cancels are rare, so this is the one cross-core
//! message of the proxy besides shutdown.

use crate::rt::net::TcpStream;
use futures_lite::AsyncWriteExt;
use lokadb_shared::wire::startup;
use std::collections::HashMap;
use std::net::SocketAddr;

/// The key a client receives in BackendKeyData.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CancelKey {
    /// Process ID field: `core << 24 | sequence`.
    pub pid: u32,
    /// Secret field.
    pub secret: u32,
}

impl CancelKey {
    /// The core that owns the session with this key.
    pub fn core(pid: u32) -> usize {
        (pid >> 24) as usize
    }
}

/// Where a cancel must go: the backend's address and its own key.
#[derive(Debug, Clone)]
pub struct CancelTarget {
    /// The backend's address (the cloud's, or the relay's for a direct connection).
    pub addr: SocketAddr,
    /// The backend's process ID.
    pub pid: u32,
    /// The backend's secret.
    pub secret: Vec<u8>,
}

/// A cancel forwarded from the core that received it to the owner.
#[derive(Debug)]
pub struct CancelMsg {
    /// Process ID field of the key.
    pub pid: u32,
    /// Secret as received.
    pub secret: Vec<u8>,
}

/// The way to another core, to hand it a cancel for a session it owns.
pub type Peer = crate::rt::mailbox::Mailbox<CancelMsg>;

/// The sessions of one core by cancel key.
#[derive(Default)]
pub struct CancelRegistry {
    next: u32,
    sessions: HashMap<u32, (u32, CancelTarget)>,
}

impl CancelRegistry {
    /// Registers a session on core `core` and returns its key.
    pub fn register(&mut self, core: usize, target: CancelTarget) -> CancelKey {
        loop {
            self.next = (self.next + 1) & 0x00ff_ffff;
            let pid = ((core as u32) << 24) | self.next;
            if pid != 0 && !self.sessions.contains_key(&pid) {
                let secret = rand::random();
                self.sessions.insert(pid, (secret, target));
                return CancelKey { pid, secret };
            }
        }
    }

    /// Points a session's key at another backend (the session switched between the cloud
    /// and an organization's database).
    pub fn retarget(&mut self, pid: u32, target: CancelTarget) {
        if let Some((_, t)) = self.sessions.get_mut(&pid) {
            *t = target;
        }
    }

    /// Forgets a session.
    pub fn unregister(&mut self, pid: u32) {
        self.sessions.remove(&pid);
    }

    /// The target of a key, if the secret matches (compared in constant time).
    pub fn lookup(&self, pid: u32, secret: &[u8]) -> Option<CancelTarget> {
        let (expected, target) = self.sessions.get(&pid)?;
        crate::scram::constant_time_eq(&expected.to_be_bytes(), secret).then(|| target.clone())
    }
}

/// Sends a CancelRequest to a backend (best effort, as Postgres' own cancel is).
pub async fn send(target: CancelTarget) {
    let mut out = Vec::with_capacity(16);
    startup::encode_cancel(target.pid, &target.secret, &mut out);
    match TcpStream::connect(target.addr).await {
        Ok(mut s) => {
            let _ = s.write_all(&out).await;
            let _ = s.close().await;
            tracing::debug!(backend_pid = target.pid, "cancel request sent");
        }
        Err(e) => tracing::warn!(error = %e, "could not send a cancel request to the cloud"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target() -> CancelTarget {
        CancelTarget {
            addr: "127.0.0.1:5432".parse().unwrap(),
            pid: 42,
            secret: vec![1, 2, 3, 4],
        }
    }

    #[test]
    fn keys_carry_their_core_and_need_the_secret() {
        let mut reg = CancelRegistry::default();
        let key = reg.register(3, target());
        assert_eq!(CancelKey::core(key.pid), 3);
        assert_eq!(
            reg.lookup(key.pid, &key.secret.to_be_bytes()).unwrap().pid,
            42
        );
        assert!(reg
            .lookup(key.pid, &key.secret.wrapping_add(1).to_be_bytes())
            .is_none());
        assert!(reg.lookup(key.pid, &[0; 8]).is_none(), "wrong length");
        reg.unregister(key.pid);
        assert!(reg.lookup(key.pid, &key.secret.to_be_bytes()).is_none());
    }

    #[test]
    fn keys_are_unique_per_core() {
        let mut reg = CancelRegistry::default();
        let a = reg.register(0, target());
        let b = reg.register(0, target());
        assert_ne!(a.pid, b.pid);
    }
}
