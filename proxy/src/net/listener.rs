//! One listening socket per core, all bound to the same address with SO_REUSEPORT so
//! the kernel spreads connections over cores.
//!
//! The sockets are created on the main thread: binding the first one resolves port 0
//! to a real port, which the others then share. Each executor adopts its socket by fd.

use socket2::{Domain, Protocol, Socket, Type};
use std::net::SocketAddr;
use std::os::fd::{IntoRawFd, RawFd};

/// Sockets bound and listening, one per core, and the address they share.
pub struct ReusePortSockets {
    /// The resolved address (port 0 replaced by the real port).
    pub addr: SocketAddr,
    /// Per core, its listening fds (one unless sockets were handed over from a process
    /// with more cores); each executor takes ownership of its own.
    pub fds: Vec<Vec<RawFd>>,
}

/// The sockets handed over by the process this one replaces (`handover`), spread over
/// `n` cores, with more bound beside them (SO_REUSEPORT, same address) when it had fewer
/// cores; bound anew when none came or they listen elsewhere than `addr` asks.
///
/// # Errors
///
/// The bind or listen error.
pub fn adopt_or_bind(
    addr: SocketAddr,
    n: usize,
    inherited: Vec<std::os::fd::OwnedFd>,
) -> std::io::Result<ReusePortSockets> {
    let mut adopted = Vec::with_capacity(inherited.len());
    let mut resolved = addr;
    for fd in inherited {
        match crate::handover::tcp_listener(fd, addr) {
            Ok(l) => {
                resolved = l.local_addr()?;
                adopted.push(l.into_raw_fd());
            }
            Err(e) => {
                tracing::warn!(error = format!("{e:#}"), "not using a listener handed over");
            }
        }
    }
    if adopted.is_empty() {
        return bind_reuseport(addr, n);
    }
    let mut fds = vec![Vec::new(); n];
    for (i, fd) in adopted.iter().enumerate() {
        fds[i % n].push(*fd);
    }
    if adopted.len() < n {
        let more = bind_reuseport(resolved, n - adopted.len())?;
        for (slot, mut fd) in fds[adopted.len()..].iter_mut().zip(more.fds) {
            slot.append(&mut fd);
        }
    }
    Ok(ReusePortSockets {
        addr: resolved,
        fds,
    })
}

/// Binds `n` listening sockets to `addr` with SO_REUSEPORT.
///
/// # Errors
///
/// The bind or listen error, e.g. address in use by another program.
pub fn bind_reuseport(addr: SocketAddr, n: usize) -> std::io::Result<ReusePortSockets> {
    let mut resolved = addr;
    let mut fds = Vec::with_capacity(n);
    for _ in 0..n {
        let sock = Socket::new(
            Domain::for_address(resolved),
            Type::STREAM,
            Some(Protocol::TCP),
        )?;
        sock.set_reuse_port(true)?;
        sock.set_reuse_address(true)?;
        sock.bind(&resolved.into())?;
        sock.listen(1024)?;
        if resolved.port() == 0 {
            resolved = sock.local_addr()?.as_socket().expect("inet socket");
        }
        fds.push(vec![sock.into_raw_fd()]);
    }
    Ok(ReusePortSockets {
        addr: resolved,
        fds,
    })
}
