//! Sockets: client and cloud streams (plain or TLS), TLS setup both ways, the listeners.

pub mod cloud_tls;
pub mod listener;
pub mod stream;
pub mod tls;

use std::net::IpAddr;

/// The client's subnet, for logs: full client addresses are not logged.
pub fn subnet(ip: IpAddr) -> String {
    match ip {
        IpAddr::V4(v4) => {
            let [a, b, c, _] = v4.octets();
            format!("{a}.{b}.{c}.0/24")
        }
        IpAddr::V6(v6) => {
            let s = v6.segments();
            format!("{:x}:{:x}:{:x}::/48", s[0], s[1], s[2])
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn subnets_hide_the_host() {
        assert_eq!(super::subnet("10.1.2.3".parse().unwrap()), "10.1.2.0/24");
        assert_eq!(
            super::subnet("2001:db8:1:2::5".parse().unwrap()),
            "2001:db8:1::/48"
        );
    }
}
