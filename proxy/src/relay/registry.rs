//! The relay's state: which tunnel serves which organization, the relay-wide stream
//! count, and the counters operators read. One thread owns it all (`Rc`, `Cell`).

use super::tokens::Tokens;
use super::tunnel_conn::TunnelConn;
use lokadb_shared::config::RelayConfig;
use std::cell::{Cell, RefCell};
use std::collections::{HashMap, VecDeque};
use std::rc::Rc;
use std::sync::Arc;

/// Agents beyond the live one that an organization may keep connected as standbys.
pub const MAX_STANDBY: usize = 4;

/// The relay of this process.
pub struct Relay {
    /// Its configuration.
    pub config: RelayConfig,
    /// TLS for agent connections (replaced by a reload: new connections only).
    pub tls: RefCell<Arc<rustls::ServerConfig>>,
    /// TLS for the Postgres listener, the same certificate (`None`: `postgres_tls` off).
    pub postgres_tls: RefCell<Option<Arc<rustls::ServerConfig>>>,
    /// Known organizations and their token hashes (replaced by a reload).
    pub tokens: RefCell<Tokens>,
    /// The tunnel settings every agent connection starts with: window, auto-tuning,
    /// memory caps (the relay-wide budget is shared by all of them).
    pub tunnel: lokadb_shared::tunnel::Config,
    orgs: RefCell<HashMap<String, OrgTunnels>>,
    /// Streams open now over all agents (checked against `max_streams`).
    pub streams: Cell<u32>,
    /// Set on SIGTERM once the clients accepted before it opened their streams: no new
    /// agents, no new streams.
    pub draining: Cell<bool>,
    /// Postgres clients accepted whose stream is not open yet (startup, TLS, the wait for
    /// an agent). A drain lets them open theirs before it tells agents to reconnect: a
    /// draining tunnel takes no new stream, and the next relay never sees these clients.
    pub starting: Cell<u32>,
    /// Agents connected and not authenticated yet.
    pub agent_handshakes: Handshakes,
    /// Postgres clients that have not sent their startup packet yet.
    pub client_handshakes: Handshakes,
    /// Counters.
    pub stats: RefCell<RelayStats>,
    /// Backend keys seen on streams, for CancelRequests: key → the streams that carry
    /// it (organization, agent connection, stream). A key seen on two streams at once is
    /// ambiguous and cancels nothing.
    cancel_keys: RefCell<HashMap<CancelKey, Vec<CancelOwner>>>,
    /// Sessions of the `lokadb_relay` admin database open now.
    pub admin_sessions: Cell<u32>,
    /// Read buffer shared by every agent connection (each read is consumed at once).
    pub scratch: RefCell<Vec<u8>>,
    next_id: Cell<u64>,
}

/// An organization's tunnels: the live one carries new streams; standbys wait.
#[derive(Default)]
struct OrgTunnels {
    live: Option<Rc<TunnelConn>>,
    standby: VecDeque<Rc<TunnelConn>>,
}

/// Counters since the relay started.
#[derive(Debug, Default, Clone)]
pub struct RelayStats {
    /// Agents authenticated.
    pub agents_connected: u64,
    /// Agents refused (bad token, version, duplicate beyond the standbys).
    pub agents_refused: u64,
    /// Streams opened.
    pub streams_opened: u64,
    /// Client connections refused, by reason.
    pub refused_no_agent: u64,
    /// … at the relay's `max_streams`.
    pub refused_max_streams: u64,
    /// … at the agent's `-max-conns`.
    pub refused_agent_limit: u64,
    /// … organization not known.
    pub refused_unknown_org: u64,
    /// … refused by the agent itself (REFUSED: its own count of -max-conns, or draining).
    pub refused_by_agents: u64,
    /// Connections closed at once because a handshake limit was reached (either listener).
    pub refused_handshakes: u64,
    /// Postgres clients that came over TLS.
    pub clients_tls: u64,
    /// Bytes from clients to agents.
    pub bytes_to_agents: u64,
    /// Bytes from agents to clients.
    pub bytes_from_agents: u64,
}

/// A backend key: process id and secret.
pub type CancelKey = (u32, Vec<u8>);

/// The stream a backend key was seen on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CancelOwner {
    /// The organization.
    pub org: String,
    /// The agent connection.
    pub conn: u64,
    /// The stream.
    pub stream: u32,
}

/// What registering an authenticated agent gave.
#[derive(Debug, PartialEq, Eq)]
pub enum Registered {
    /// It carries the organization's new streams.
    Live,
    /// Another agent is live; this one takes over when that one goes.
    Standby,
    /// Too many agents for the organization.
    Refused,
}

impl Relay {
    /// A relay with no agent yet.
    pub fn new(
        config: RelayConfig,
        tls: super::RelayTls,
        tunnel: lokadb_shared::tunnel::Config,
    ) -> Relay {
        Relay {
            postgres_tls: RefCell::new(tls.postgres),
            tokens: RefCell::new(Tokens::new(&config.tokens)),
            config,
            tls: RefCell::new(tls.agents),
            tunnel,
            orgs: RefCell::default(),
            streams: Cell::new(0),
            draining: Cell::new(false),
            starting: Cell::new(0),
            agent_handshakes: Handshakes::default(),
            client_handshakes: Handshakes::default(),
            stats: RefCell::default(),
            cancel_keys: RefCell::default(),
            admin_sessions: Cell::new(0),
            scratch: RefCell::new(vec![0; 64 * 1024]),
            next_id: Cell::new(1),
        }
    }

    /// Notes that `key` belongs to `owner`'s stream.
    pub fn note_cancel_key(&self, key: CancelKey, owner: CancelOwner) {
        self.cancel_keys
            .borrow_mut()
            .entry(key)
            .or_default()
            .push(owner);
    }

    /// Forgets `owner`'s key when its stream ends.
    pub fn forget_cancel_key(&self, key: &CancelKey, owner: &CancelOwner) {
        let mut keys = self.cancel_keys.borrow_mut();
        if let Some(owners) = keys.get_mut(key) {
            owners.retain(|o| o != owner);
            if owners.is_empty() {
                keys.remove(key);
            }
        }
    }

    /// The organization a cancel request for `key` goes to: only when exactly one live
    /// stream carries the key, so a collision never sends it to another organization.
    pub fn cancel_target(&self, key: &CancelKey) -> Option<String> {
        match self.cancel_keys.borrow().get(key).map(Vec::as_slice) {
            Some([owner]) => Some(owner.org.clone()),
            _ => None,
        }
    }

    /// A number for log lines about one agent connection.
    pub fn next_conn_id(&self) -> u64 {
        let id = self.next_id.get();
        self.next_id.set(id + 1);
        id
    }

    /// Registers an authenticated agent of `org`.
    pub fn register(&self, org: &str, conn: &Rc<TunnelConn>) -> Registered {
        let mut orgs = self.orgs.borrow_mut();
        let entry = orgs.entry(org.to_owned()).or_default();
        if entry.live.is_none() {
            entry.live = Some(conn.clone());
            Registered::Live
        } else if entry.standby.len() < MAX_STANDBY {
            entry.standby.push_back(conn.clone());
            Registered::Standby
        } else {
            Registered::Refused
        }
    }

    /// Forgets an agent connection that ended; a standby takes over if it was live.
    /// Returns the id of the promoted standby.
    pub fn unregister(&self, org: &str, conn: &Rc<TunnelConn>) -> Option<u64> {
        let mut orgs = self.orgs.borrow_mut();
        let entry = orgs.get_mut(org)?;
        let mut promoted = None;
        if entry.live.as_ref().is_some_and(|l| Rc::ptr_eq(l, conn)) {
            entry.live = entry.standby.pop_front();
            promoted = entry.live.as_ref().map(|c| c.id);
        } else {
            entry.standby.retain(|c| !Rc::ptr_eq(c, conn));
        }
        if entry.live.is_none() {
            orgs.remove(org);
        }
        promoted
    }

    /// The tunnel carrying `org`'s new streams.
    pub fn live(&self, org: &str) -> Option<Rc<TunnelConn>> {
        self.orgs.borrow().get(org).and_then(|e| e.live.clone())
    }

    /// Every connected agent, live and standby.
    pub fn all_conns(&self) -> Vec<Rc<TunnelConn>> {
        self.orgs
            .borrow()
            .values()
            .flat_map(|e| e.live.iter().chain(e.standby.iter()).cloned())
            .collect()
    }

    /// Organizations with a live agent.
    pub fn connected_orgs(&self) -> usize {
        self.orgs.borrow().len()
    }
}

/// One listener's connections in their handshake, total and by address
/// (`relay.max_handshakes`, `relay.max_handshakes_per_address`): a flood of silent
/// connections from one address holds at most its share, never the others'.
#[derive(Default)]
pub struct Handshakes {
    total: Cell<u32>,
    by_address: RefCell<HashMap<std::net::IpAddr, u32>>,
}

/// A connection's place among [`Handshakes`], given back when dropped.
pub struct Handshake {
    relay: Rc<Relay>,
    agents: bool,
    ip: std::net::IpAddr,
}

impl Handshakes {
    /// Takes a place for a connection from `ip`, or `None` when a limit is reached.
    pub fn begin(relay: &Rc<Relay>, agents: bool, ip: std::net::IpAddr) -> Option<Handshake> {
        let this = if agents {
            &relay.agent_handshakes
        } else {
            &relay.client_handshakes
        };
        let mut by_address = this.by_address.borrow_mut();
        let from_ip = by_address.get(&ip).copied().unwrap_or(0);
        if this.total.get() >= relay.config.max_handshakes
            || from_ip >= relay.config.max_handshakes_per_address
        {
            relay.stats.borrow_mut().refused_handshakes += 1;
            return None;
        }
        by_address.insert(ip, from_ip + 1);
        this.total.set(this.total.get() + 1);
        Some(Handshake {
            relay: relay.clone(),
            agents,
            ip,
        })
    }
}

impl Drop for Handshake {
    fn drop(&mut self) {
        let this = if self.agents {
            &self.relay.agent_handshakes
        } else {
            &self.relay.client_handshakes
        };
        this.total.set(this.total.get() - 1);
        let mut by_address = this.by_address.borrow_mut();
        if let Some(n) = by_address.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                by_address.remove(&self.ip);
            }
        }
    }
}
