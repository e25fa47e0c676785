//! A thin wrapper over `poll(2)`: the set of sockets is rebuilt before every wait, each
//! with the interest its owner has at that moment, so there is no registration state
//! to keep in sync.

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::time::{Duration, Instant};

/// What a socket waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Interest {
    /// Wake when there is something to read (or end of file).
    pub read: bool,
    /// Wake when the socket takes more bytes (or a connect completes).
    pub write: bool,
}

/// What a socket is ready for. Errors and hang-ups count as both, so the owner's
/// next read or write reports them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Ready {
    /// Read will not block.
    pub read: bool,
    /// Write will not block.
    pub write: bool,
}

/// The sockets of one wait, each with a token saying whose it is.
#[derive(Debug)]
pub struct Poller<T> {
    fds: Vec<libc::pollfd>,
    tokens: Vec<T>,
}

impl<T: Copy> Poller<T> {
    /// An empty set.
    pub fn new() -> Poller<T> {
        Poller {
            fds: Vec::new(),
            tokens: Vec::new(),
        }
    }

    /// Forgets every socket, before the set is rebuilt.
    pub fn clear(&mut self) {
        self.fds.clear();
        self.tokens.clear();
    }

    /// Adds a socket; one without interest is left out.
    pub fn add(&mut self, fd: &impl AsRawFd, interest: Interest, token: T) {
        let mut events = 0;
        if interest.read {
            events |= libc::POLLIN;
        }
        if interest.write {
            events |= libc::POLLOUT;
        }
        if events != 0 {
            self.add_raw(fd.as_raw_fd(), events, token);
        }
    }

    fn add_raw(&mut self, fd: RawFd, events: libc::c_short, token: T) {
        self.fds.push(libc::pollfd {
            fd,
            events,
            revents: 0,
        });
        self.tokens.push(token);
    }

    /// Waits until a socket is ready or `deadline` passes (`None`: no deadline).
    /// An interrupted wait returns early without error.
    pub fn wait(&mut self, deadline: Option<Instant>) -> io::Result<()> {
        let timeout_ms = match deadline {
            None => -1,
            Some(at) => {
                let left = at.saturating_duration_since(Instant::now());
                // Round up, so a wake-up never comes before the deadline.
                let ms = (left + Duration::from_nanos(999_999)).as_millis();
                ms.min(i32::MAX as u128) as libc::c_int
            }
        };
        // SAFETY: `fds` is a valid, initialised array of `fds.len()` pollfd structs.
        let n = unsafe { libc::poll(self.fds.as_mut_ptr(), self.fds.len() as _, timeout_ms) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() != io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
        Ok(())
    }

    /// The sockets ready after the last wait, with their tokens.
    pub fn ready(&self) -> impl Iterator<Item = (T, Ready)> + '_ {
        self.fds
            .iter()
            .zip(&self.tokens)
            .filter(|(fd, _)| fd.revents != 0)
            .map(|(fd, token)| {
                let failed = fd.revents & (libc::POLLERR | libc::POLLHUP | libc::POLLNVAL) != 0;
                let ready = Ready {
                    read: failed || fd.revents & libc::POLLIN != 0,
                    write: failed || fd.revents & libc::POLLOUT != 0,
                };
                (*token, ready)
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::net::{TcpListener, TcpStream};

    #[test]
    fn reports_readable_socket_and_deadline() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut a = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (b, _) = listener.accept().unwrap();
        let mut poller = Poller::new();
        poller.add(
            &b,
            Interest {
                read: true,
                write: false,
            },
            7u32,
        );
        let start = Instant::now();
        poller
            .wait(Some(start + Duration::from_millis(30)))
            .unwrap();
        assert!(start.elapsed() >= Duration::from_millis(30));
        assert_eq!(poller.ready().count(), 0);
        a.write_all(b"x").unwrap();
        poller.wait(None).unwrap();
        let ready: Vec<_> = poller.ready().collect();
        assert_eq!(
            ready,
            vec![(
                7,
                Ready {
                    read: true,
                    write: false
                }
            )]
        );
    }
}
