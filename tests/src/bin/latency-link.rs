//! `latency-link --listen 127.0.0.1:0 --target HOST:PORT --delay-ms 20`
//!
//! Runs a [`lokadb_tests::link::LatencyLink`] until killed; prints `listening on ADDR` once ready.
//! `--delay-ms` takes fractions (`0.5`).

use std::net::{SocketAddr, ToSocketAddrs};
use std::time::Duration;

fn usage() -> ! {
    eprintln!("usage: latency-link [--listen 127.0.0.1:0] --target HOST:PORT [--delay-ms MS]");
    std::process::exit(2);
}

fn main() {
    let mut listen: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let mut target: Option<SocketAddr> = None;
    let mut delay_ms = 0.0f64;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let (key, inline) = match arg.split_once('=') {
            Some((k, v)) => (k.to_string(), Some(v.to_string())),
            None => (arg.clone(), None),
        };
        let mut value = || {
            inline
                .clone()
                .or_else(|| args.next())
                .unwrap_or_else(|| usage())
        };
        match key.as_str() {
            "--listen" => {
                listen = resolve(&value());
            }
            "--target" => target = Some(resolve(&value())),
            "--delay-ms" => {
                delay_ms = value().parse().unwrap_or_else(|_| usage());
                if !(delay_ms >= 0.0 && delay_ms.is_finite()) {
                    usage();
                }
            }
            "-h" | "--help" => usage(),
            _ => usage(),
        }
    }
    let Some(target) = target else { usage() };
    let link = lokadb_tests::link::LatencyLink::start_on(
        listen,
        target,
        Duration::from_secs_f64(delay_ms / 1000.0),
    )
    .unwrap_or_else(|e| {
        eprintln!("latency-link: listen on {listen}: {e}");
        std::process::exit(1);
    });
    println!("listening on {}", link.addr());
    loop {
        std::thread::park();
    }
}

fn resolve(addr: &str) -> SocketAddr {
    addr.to_socket_addrs()
        .ok()
        .and_then(|mut a| a.next())
        .unwrap_or_else(|| {
            eprintln!("latency-link: bad address {addr}");
            std::process::exit(2);
        })
}
