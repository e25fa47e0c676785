//! Cancel requests: each client session gets its own key, mapped to the backend it
//! uses, so a client can only ever cancel its own queries — never those of the next
//! client of a pooled backend.
//!
//! The key's process ID is the real one of the session's cloud backend (session pooling:
//! one backend for the whole session), so what the driver learns from BackendKeyData is
//! what `pg_backend_pid()`, NotificationResponse and `pg_stat_activity` say. The secret is
//! the proxy's own, random per session: a client never learns a backend's real secret, and
//! its key stops meaning anything when its session ends, while the backend goes on serving
//! the next client of the pool.
//!
//! The process ID no longer names the core that owns the session. A CancelRequest lands on
//! any core (SO_REUSEPORT); the core looks in its own registry and, if the key is not
//! there, hands it to every other core over the cross-core mailboxes, where each looks in
//! its own. Cancels are rare, so this is the one cross-core message of the proxy besides
//! shutdown and metadata generations. Several proxies in front of one cloud hand each other
//! the cancels none of their sessions has (`peers` in the configuration): the receiving
//! proxy sends a key it does not know to each peer as a request of its own code
//! ([`startup::PEER_CANCEL_REQUEST_CODE`]), which the peer looks up on all its cores and
//! hands to no one else, so a cancel never loops. It gives no one more than a plain
//! CancelRequest to that peer would.
//!
//! Process IDs repeat across clusters (two configured cloud databases) and, over time,
//! within one, so the registry is keyed by the whole key and tolerates sessions that share a
//! process ID; a session's own handle is its [`SessionId`].

use crate::core::Core;
use crate::rt::net::TcpStream;
use futures_lite::{AsyncReadExt, AsyncWriteExt};
use lokadb_shared::wire::startup;
use std::collections::HashMap;
use std::fmt;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a cancel is waited for: Postgres closes a cancel connection once it has
/// signalled the backend, and the proxy keeps the client's open until then (or until the
/// other cores and peers that may own the key have done the same), so a driver that waits
/// for that close knows the cancel has landed before it sends its next statement.
const DELIVERY_TIMEOUT: Duration = Duration::from_secs(5);

/// The key a client receives in BackendKeyData.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CancelKey {
    /// Process ID field: the session's cloud backend's.
    pub pid: u32,
    /// Secret field: the proxy's own, random per session.
    pub secret: u32,
}

/// A session in its core's registry: `core << 24 | sequence`, unique among the sessions
/// alive in the process (the traffic recording names sessions by it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SessionId(u32);

impl SessionId {
    /// The number, as written in traffic recordings.
    pub fn get(self) -> u32 {
        self.0
    }
}

impl fmt::Display for SessionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// The bit that marks a pooled session's key ([`CancelRegistry::register_pooled`]).
const POOLED_PID: u32 = 1 << 30;

/// The process ID a session's key carries with transaction pooling.
pub fn pooled_pid(id: SessionId) -> u32 {
    POOLED_PID | (id.0 & (POOLED_PID - 1))
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

/// A cancel forwarded from the core that received it to the other cores.
#[derive(Debug)]
pub struct CancelMsg {
    /// Process ID field of the key.
    pub pid: u32,
    /// Secret as received.
    pub secret: Vec<u8>,
    /// Counted down by each core (and peer) once it has sent the cancel on, or found it is
    /// not its own.
    pub left: Arc<AtomicUsize>,
}

fn done(left: &AtomicUsize) {
    left.fetch_sub(1, Ordering::AcqRel);
}

/// The way to another core, to hand it a cancel that may be for a session it owns.
pub type Peer = crate::rt::mailbox::Mailbox<CancelMsg>;

/// One registered session.
struct Entry {
    key: CancelKey,
    /// `None` while the session holds no backend (transaction pooling, between its
    /// transactions): its cancels are ignored, as Postgres ignores one for an idle backend.
    target: Option<CancelTarget>,
}

/// The sessions of one core by cancel key.
#[derive(Default)]
pub struct CancelRegistry {
    next: u32,
    sessions: HashMap<SessionId, Entry>,
    /// Sessions by their key's process ID; nearly always one each.
    by_pid: HashMap<u32, Vec<SessionId>>,
}

impl CancelRegistry {
    /// Registers a session of core `core` whose cloud backend is `target`; returns its
    /// handle and the key the client is given (the backend's process ID, a fresh secret
    /// from a cryptographic RNG).
    pub fn register(&mut self, core: usize, target: CancelTarget) -> (SessionId, CancelKey) {
        self.register_with(core, target, false, rand::random)
    }

    /// [`register`](Self::register) for a session whose backends change (transaction
    /// pooling): its key's process ID is the proxy's own, above any Linux process ID
    /// (`PID_MAX_LIMIT` is 2^22), so `pg_terminate_backend` with it ends no backend another
    /// client may be using.
    pub fn register_pooled(&mut self, core: usize, target: CancelTarget) -> (SessionId, CancelKey) {
        self.register_with(core, target, true, rand::random)
    }

    /// [`register`](Self::register) with the secrets drawn from `secrets`.
    fn register_with(
        &mut self,
        core: usize,
        target: CancelTarget,
        pooled: bool,
        mut secrets: impl FnMut() -> u32,
    ) -> (SessionId, CancelKey) {
        let id = loop {
            self.next = (self.next + 1) & 0x00ff_ffff;
            let id = SessionId(((core as u32) << 24) | self.next);
            if !self.sessions.contains_key(&id) {
                break id;
            }
        };
        // Positive as an int4 for any core below 64 (the id's top byte).
        let pid = if pooled { pooled_pid(id) } else { target.pid };
        let same_pid = self.by_pid.entry(pid).or_default();
        // Two sessions with one process ID (two clouds) never share a secret on a core.
        let secret = loop {
            let secret = secrets();
            if !same_pid
                .iter()
                .any(|s| self.sessions[s].key.secret == secret)
            {
                break secret;
            }
        };
        same_pid.push(id);
        let key = CancelKey { pid, secret };
        self.sessions.insert(
            id,
            Entry {
                key,
                target: Some(target),
            },
        );
        (id, key)
    }

    /// Points a session's key at another backend (the session switched between the cloud
    /// and an organization's database).
    pub fn retarget(&mut self, id: SessionId, target: CancelTarget) {
        if let Some(e) = self.sessions.get_mut(&id) {
            e.target = Some(target);
        }
    }

    /// The session gave its backend back (transaction pooling): its key cancels nothing
    /// until it holds one again, so a late cancel never reaches another client's statement.
    pub fn detach(&mut self, id: SessionId) {
        if let Some(e) = self.sessions.get_mut(&id) {
            e.target = None;
        }
    }

    /// Forgets a session: its key cancels nothing from now on.
    pub fn unregister(&mut self, id: SessionId) {
        let Some(e) = self.sessions.remove(&id) else {
            return;
        };
        if let Some(list) = self.by_pid.get_mut(&e.key.pid) {
            list.retain(|s| *s != id);
            if list.is_empty() {
                self.by_pid.remove(&e.key.pid);
            }
        }
    }

    /// The target of a key, if a session here has it (secrets compared in constant time).
    pub fn lookup(&self, pid: u32, secret: &[u8]) -> Option<CancelTarget> {
        self.by_pid.get(&pid)?.iter().find_map(|id| {
            let e = &self.sessions[id];
            crate::scram::constant_time_eq(&e.key.secret.to_be_bytes(), secret)
                .then(|| e.target.clone())
                .flatten()
        })
    }
}

/// A CancelRequest received by `core`: sent on if one of its sessions has the key, else
/// handed to every other core (the process ID does not say which one owns it) and, when it
/// came from a client (`to_peers`), to the other proxies (`peers`).
pub async fn handle(core: &Core, pid: u32, secret: Vec<u8>, to_peers: bool) {
    let target = core.cancels.borrow().lookup(pid, &secret);
    if let Some(t) = target {
        return send(t).await;
    }
    let settings = core.shared.settings();
    let peers: &[SocketAddr] = if to_peers {
        &settings.config.peers
    } else {
        &[]
    };
    // A session still draining in the process this one took the sockets from.
    {
        let mut predecessor = core
            .shared
            .predecessor
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if let Some(p) = predecessor.as_mut() {
            if p.cancel(pid, &secret) {
                tracing::debug!(pid, "cancel request handed to the draining process");
            } else {
                *predecessor = None;
            }
        }
    }
    let forwarded = core.peers.len().saturating_sub(1);
    let left = Arc::new(AtomicUsize::new(forwarded + peers.len()));
    for &peer in peers {
        let (left, secret) = (left.clone(), secret.clone());
        crate::rt::spawn(async move {
            hand_to_peer(peer, pid, secret).await;
            done(&left);
        })
        .detach();
    }
    for (id, peer) in core.peers.iter().enumerate() {
        if id != core.id {
            peer.send(CancelMsg {
                pid,
                secret: secret.clone(),
                left: left.clone(),
            });
        }
    }
    if forwarded > 0 {
        tracing::debug!(
            pid,
            cores = forwarded,
            "cancel request forwarded to the other cores"
        );
    } else {
        tracing::debug!(pid, "cancel request with an unknown key ignored");
    }
    // Cancels are rare and usually delivered within a millisecond: a short poll is cheaper
    // than a cross-core wake-up channel.
    let deadline = Instant::now() + DELIVERY_TIMEOUT;
    while left.load(Ordering::Acquire) > 0 && Instant::now() < deadline {
        crate::rt::sleep(Duration::from_millis(1)).await;
    }
}

/// A CancelRequest another core received and did not own: sent on if one of this core's
/// sessions has the key, else ignored (each core looks only in its own registry, so a
/// forwarded request is never forwarded again).
pub fn handle_forwarded(core: &Core, msg: CancelMsg) {
    let target = core.cancels.borrow().lookup(msg.pid, &msg.secret);
    match target {
        Some(t) => {
            tracing::debug!(
                pid = msg.pid,
                "forwarded cancel request matched a session here"
            );
            crate::rt::spawn(async move {
                send(t).await;
                done(&msg.left);
            })
            .detach();
        }
        None => {
            tracing::trace!(pid = msg.pid, "forwarded cancel request not for this core");
            done(&msg.left);
        }
    }
}

/// Hands a cancel no session of this proxy has to another proxy (best effort): it looks in
/// its own sessions and hands it to no one else.
async fn hand_to_peer(peer: SocketAddr, pid: u32, secret: Vec<u8>) {
    let mut out = Vec::with_capacity(16);
    startup::encode_peer_cancel(pid, &secret, &mut out);
    match TcpStream::connect(peer).await {
        Ok(mut s) => {
            let _ = s.write_all(&out).await;
            until_closed(&mut s).await;
            let _ = s.close().await;
            tracing::debug!(pid, %peer, "cancel request handed to a peer proxy");
        }
        Err(e) => {
            tracing::warn!(error = %e, %peer, "could not hand a cancel request to a peer proxy")
        }
    }
}

/// Sends a CancelRequest to a backend (best effort, as Postgres' own cancel is).
pub async fn send(target: CancelTarget) {
    let mut out = Vec::with_capacity(16);
    startup::encode_cancel(target.pid, &target.secret, &mut out);
    match TcpStream::connect(target.addr).await {
        Ok(mut s) => {
            let _ = s.write_all(&out).await;
            until_closed(&mut s).await;
            let _ = s.close().await;
            tracing::debug!(backend_pid = target.pid, "cancel request sent");
        }
        Err(e) => tracing::warn!(error = %e, "could not send a cancel request to the cloud"),
    }
}

/// Waits until the other end closes `s` (it has acted on the request), for at most
/// [`DELIVERY_TIMEOUT`].
async fn until_closed(s: &mut TcpStream) {
    let mut buf = [0u8; 64];
    let closed = async { while let Ok(1..) = s.read(&mut buf).await {} };
    let _ = crate::time::with_timeout(DELIVERY_TIMEOUT, closed).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target(pid: u32, secret: u8) -> CancelTarget {
        CancelTarget {
            addr: "127.0.0.1:5432".parse().unwrap(),
            pid,
            secret: vec![secret; 4],
        }
    }

    /// Secrets drawn in this order.
    fn secrets(list: &[u32]) -> impl FnMut() -> u32 + '_ {
        let mut next = list.iter();
        move || *next.next().expect("no more scripted secrets")
    }

    #[test]
    fn the_key_carries_the_backends_pid_and_a_secret_of_its_own() {
        let mut reg = CancelRegistry::default();
        let (id, key) = reg.register_with(3, target(42, 7), false, secrets(&[0xa1b2_c3d4]));
        assert_eq!(
            key,
            CancelKey {
                pid: 42,
                secret: 0xa1b2_c3d4
            }
        );
        assert_eq!(id.get() >> 24, 3, "the session id names its core");
        assert_eq!(
            reg.lookup(42, &[0xa1, 0xb2, 0xc3, 0xd4]).unwrap().secret,
            vec![7; 4]
        );
        assert!(
            reg.lookup(42, &[7; 4]).is_none(),
            "the backend's own secret"
        );
        assert!(reg.lookup(42, &[0xa1, 0xb2, 0xc3, 0xd5]).is_none());
        assert!(
            reg.lookup(42, &[0xa1, 0xb2, 0xc3, 0xd4, 0]).is_none(),
            "wrong length"
        );
        assert!(
            reg.lookup(43, &[0xa1, 0xb2, 0xc3, 0xd4]).is_none(),
            "wrong pid"
        );
        reg.unregister(id);
        assert!(reg.lookup(42, &[0xa1, 0xb2, 0xc3, 0xd4]).is_none());
        assert!(reg.by_pid.is_empty() && reg.sessions.is_empty());
    }

    #[test]
    fn two_sessions_with_one_pid_are_told_apart_by_their_secret() {
        // Two cloud databases: their backends' process IDs may be equal. The second
        // session's first secret is the first's: drawn again.
        let mut reg = CancelRegistry::default();
        let (a, ka) = reg.register_with(0, target(1234, 1), false, secrets(&[5]));
        let (b, kb) = reg.register_with(0, target(1234, 2), false, secrets(&[5, 6]));
        assert_ne!(a, b);
        assert_eq!(
            (ka, kb),
            (
                CancelKey {
                    pid: 1234,
                    secret: 5
                },
                CancelKey {
                    pid: 1234,
                    secret: 6
                }
            )
        );
        assert_eq!(
            reg.lookup(1234, &5u32.to_be_bytes()).unwrap().secret,
            vec![1; 4]
        );
        assert_eq!(
            reg.lookup(1234, &6u32.to_be_bytes()).unwrap().secret,
            vec![2; 4]
        );
        assert!(reg.lookup(1234, &7u32.to_be_bytes()).is_none());
        // Each key follows its own session.
        reg.retarget(a, target(99, 3));
        assert_eq!(reg.lookup(1234, &5u32.to_be_bytes()).unwrap().pid, 99);
        assert_eq!(reg.lookup(1234, &6u32.to_be_bytes()).unwrap().pid, 1234);
        reg.unregister(a);
        assert!(reg.lookup(1234, &5u32.to_be_bytes()).is_none());
        assert_eq!(
            reg.lookup(1234, &6u32.to_be_bytes()).unwrap().secret,
            vec![2; 4]
        );
        assert_eq!(reg.by_pid[&1234], vec![b]);
    }

    #[test]
    fn a_pooled_backends_next_session_has_a_key_the_last_one_cannot_use() {
        let mut reg = CancelRegistry::default();
        let (first, old) = reg.register_with(0, target(77, 9), false, secrets(&[10]));
        reg.unregister(first);
        let (_, new) = reg.register_with(0, target(77, 9), false, secrets(&[11]));
        assert_eq!((old.pid, new.pid), (77, 77));
        assert!(reg.lookup(77, &10u32.to_be_bytes()).is_none());
        assert_eq!(reg.lookup(77, &11u32.to_be_bytes()).unwrap().pid, 77);
    }

    #[test]
    fn session_ids_are_unique_per_core_and_skip_live_ones() {
        let mut reg = CancelRegistry::default();
        let (a, _) = reg.register(1, target(1, 1));
        let (b, _) = reg.register(1, target(1, 1));
        assert_eq!((a.get(), b.get()), (1 << 24 | 1, 1 << 24 | 2));
        // After a wrap, a live session's id is not given again.
        reg.next = 0;
        let (c, _) = reg.register(1, target(1, 1));
        assert_eq!(c.get(), 1 << 24 | 3);
    }

    #[test]
    fn a_pooled_sessions_key_is_no_process_id_and_finds_its_session() {
        let mut reg = CancelRegistry::default();
        let (id, key) = reg.register_with(3, target(42, 7), true, secrets(&[9]));
        assert!(key.pid > 1 << 22, "above any Linux process ID: {}", key.pid);
        assert!(i32::try_from(key.pid).is_ok(), "positive as an int4");
        assert_eq!(
            reg.lookup(key.pid, &9u32.to_be_bytes()).map(|t| t.pid),
            Some(42)
        );
        // Between its transactions it holds no backend: its cancel goes nowhere.
        reg.detach(id);
        assert!(reg.lookup(key.pid, &9u32.to_be_bytes()).is_none());
        reg.retarget(id, target(43, 8));
        assert_eq!(
            reg.lookup(key.pid, &9u32.to_be_bytes()).map(|t| t.pid),
            Some(43)
        );
    }
}
