//! `lokadb-agent`: runs beside an organization's Postgres, dials the relay and turns
//! tunnel streams into local connections.
//!
//! Placeholder: the command line is the contract of product.md; the tunnel itself is
//! built in the tunnel issue. Until then it refuses to run instead of pretending.

use clap::Parser;
use std::process::ExitCode;

/// LokaDB agent (the tunnel is not built yet: this binary only checks its arguments).
#[derive(Parser, Debug)]
#[command(name = "lokadb-agent", version, about)]
struct Args {
    /// Relay address, HOST:PORT (repeat for several relays).
    #[arg(long, env = "LOKADB_RELAY", required = true)]
    relay: Vec<String>,
    /// The organization's token.
    #[arg(long, env = "LOKADB_TOKEN", hide_env_values = true)]
    token: String,
    /// The organization's Postgres, HOST:PORT.
    #[arg(long, env = "LOKADB_POSTGRES")]
    postgres: String,
    /// Most connections to the organization's Postgres at once.
    #[arg(long = "max-conns", env = "LOKADB_MAX_CONNS", default_value_t = 100)]
    max_conns: u32,
}

fn main() -> ExitCode {
    let args = Args::parse();
    eprintln!(
        "lokadb-agent: the tunnel is not implemented in this version (relay {:?}, postgres {}, max-conns {})",
        args.relay, args.postgres, args.max_conns
    );
    ExitCode::from(2)
}
