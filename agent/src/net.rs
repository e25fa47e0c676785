//! Addresses and sockets: `HOST:PORT` parsing, resolution, non-blocking connect.
//!
//! An IP address needs no DNS. A host name is resolved with the system resolver
//! (`getaddrinfo`, blocking) each time it is dialed, so a moved relay or database is
//! found on the next connection.

use std::fmt;
use std::io;
use std::net::{IpAddr, SocketAddr, TcpStream, ToSocketAddrs};

use socket2::{Domain, Protocol, SockAddr, Socket, Type};

/// A `HOST:PORT` from the command line; IPv6 addresses go in brackets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostPort {
    /// The host, without brackets.
    pub host: String,
    /// The port, never 0.
    pub port: u16,
}

impl HostPort {
    /// Parses `host:port`, `1.2.3.4:port` or `[::1]:port`.
    pub fn parse(s: &str) -> Result<HostPort, String> {
        let bad = |why: &str| format!("{s:?} is not HOST:PORT: {why}");
        let (host, port) = s.rsplit_once(':').ok_or_else(|| bad("no port"))?;
        let host = match host.strip_prefix('[') {
            Some(inner) => {
                let inner = inner.strip_suffix(']').ok_or_else(|| bad("unclosed '['"))?;
                inner
                    .parse::<std::net::Ipv6Addr>()
                    .map_err(|_| bad("not an IPv6 address in brackets"))?;
                inner
            }
            None if host.contains(':') => return Err(bad("put an IPv6 address in brackets")),
            None => host,
        };
        if host.is_empty() {
            return Err(bad("empty host"));
        }
        if host.contains(|c: char| c.is_whitespace() || c == '/') {
            return Err(bad("invalid host"));
        }
        let port = match port.parse::<u16>() {
            Ok(0) | Err(_) => return Err(bad("the port must be a number from 1 to 65535")),
            Ok(p) => p,
        };
        Ok(HostPort {
            host: host.to_owned(),
            port,
        })
    }

    /// The host as an IP address, if it is one.
    pub fn ip(&self) -> Option<IpAddr> {
        self.host.parse().ok()
    }

    /// The socket address: at once for an IP, by the system resolver for a name
    /// (first address returned).
    pub fn resolve(&self) -> io::Result<SocketAddr> {
        if let Some(ip) = self.ip() {
            return Ok(SocketAddr::new(ip, self.port));
        }
        (self.host.as_str(), self.port)
            .to_socket_addrs()?
            .next()
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "no address for host"))
    }
}

impl fmt::Display for HostPort {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

/// A non-blocking TCP socket whose connect has started: `true` if it is still in
/// progress (wait for POLLOUT, then [`connect_result`]).
pub fn connect_nonblocking(addr: SocketAddr) -> io::Result<(TcpStream, bool)> {
    connect_with(addr, None)
}

/// [`connect_nonblocking`] with the socket's receive buffer fixed at `recv_buffer`
/// bytes (`SO_RCVBUF`, set before the connect so the window scale fits it), which
/// turns off the kernel's receive autotuning for it.
pub fn connect_nonblocking_rcvbuf(
    addr: SocketAddr,
    recv_buffer: usize,
) -> io::Result<(TcpStream, bool)> {
    connect_with(addr, Some(recv_buffer))
}

fn connect_with(addr: SocketAddr, recv_buffer: Option<usize>) -> io::Result<(TcpStream, bool)> {
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    socket.set_nonblocking(true)?;
    socket.set_nodelay(true)?;
    if let Some(size) = recv_buffer {
        socket.set_recv_buffer_size(size)?;
    }
    let in_progress = match socket.connect(&SockAddr::from(addr)) {
        Ok(()) => false,
        Err(e) if e.raw_os_error() == Some(libc::EINPROGRESS) => true,
        Err(e) => return Err(e),
    };
    Ok((socket.into(), in_progress))
}

/// After POLLOUT (or an error) on a connecting socket: whether the connect succeeded.
pub fn connect_result(sock: &TcpStream) -> io::Result<()> {
    if let Some(e) = sock.take_error()? {
        return Err(e);
    }
    sock.peer_addr().map(|_| ())
}

/// An I/O error without the "(os error N)" suffix, for log lines and RESET reasons.
pub fn describe(e: &io::Error) -> String {
    let text = e.to_string();
    match text.find(" (os error ") {
        Some(i) => text[..i].to_owned(),
        None => text,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_port_forms() {
        let hp = HostPort::parse("relay.example.com:7443").unwrap();
        assert_eq!((hp.host.as_str(), hp.port), ("relay.example.com", 7443));
        assert_eq!(hp.ip(), None);
        let hp = HostPort::parse("127.0.0.1:5432").unwrap();
        assert_eq!(hp.resolve().unwrap(), "127.0.0.1:5432".parse().unwrap());
        let hp = HostPort::parse("[::1]:5432").unwrap();
        assert_eq!(hp.host, "::1");
        assert_eq!(hp.to_string(), "[::1]:5432");
    }

    #[test]
    fn bad_host_ports() {
        for bad in [
            "",
            "host",
            "host:",
            ":5432",
            "host:0",
            "host:65536",
            "host:x",
            "::1:5432",
            "[::1:5432",
            "[nope]:1",
            "a b:1",
        ] {
            assert!(HostPort::parse(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn receive_buffer_is_fixed() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let (sock, _) = connect_nonblocking_rcvbuf(addr, 128 * 1024).unwrap();
        let size = socket2::SockRef::from(&sock).recv_buffer_size().unwrap();
        // Linux reports the doubled value; the point is that it is not autotuned.
        assert!(
            (128 * 1024..=256 * 1024).contains(&size),
            "SO_RCVBUF {size}"
        );
    }

    #[test]
    fn refused_connect_is_reported() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        drop(listener);
        let err = match connect_nonblocking(addr) {
            Err(e) => e,
            Ok((sock, _)) => {
                let mut fds = [libc::pollfd {
                    fd: std::os::fd::AsRawFd::as_raw_fd(&sock),
                    events: libc::POLLOUT,
                    revents: 0,
                }];
                unsafe { libc::poll(fds.as_mut_ptr(), 1, 2000) };
                connect_result(&sock).unwrap_err()
            }
        };
        assert_eq!(describe(&err), "Connection refused");
    }
}
