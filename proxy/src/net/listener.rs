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
    /// One listening fd per core; each executor takes ownership of its own.
    pub fds: Vec<RawFd>,
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
        fds.push(sock.into_raw_fd());
    }
    Ok(ReusePortSockets {
        addr: resolved,
        fds,
    })
}
