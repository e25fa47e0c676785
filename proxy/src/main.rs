//! `lokadb`: the proxy, the relay, and (later) the admin commands.

use clap::{Parser, Subcommand};
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

/// LokaDB: keep each organization's rows in its own Postgres while the application
/// keeps one database connection.
#[derive(Parser)]
#[command(name = "lokadb", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the proxy in front of the cloud database.
    Proxy {
        /// Path of the JSON configuration file.
        #[arg(long, env = "LOKADB_CONFIG")]
        config: PathBuf,
        /// Number of executors, one per core (default: all cores).
        #[arg(long, env = "LOKADB_CORES")]
        cores: Option<usize>,
    },
    /// Run the relay alone (it also runs inside `lokadb proxy` when configured).
    Relay {
        /// Path of the JSON configuration file (its "relay" section is used).
        #[arg(long, env = "LOKADB_CONFIG")]
        config: PathBuf,
    },
    /// Agent tokens.
    #[command(subcommand)]
    Token(TokenCommand),
}

#[derive(Subcommand)]
enum TokenCommand {
    /// Make a new token for an organization, and the hash to put in relay.tokens.
    New {
        /// The organization id.
        org: String,
    },
    /// Print the relay.tokens hash of an existing token (read from stdin).
    Hash,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging();
    match cli.command {
        Command::Token(t) => token(t),
        Command::Relay { config } => {
            let config = match load(&config) {
                Ok(c) => c,
                Err(code) => return code,
            };
            let result = lokadb::server::run_relay(config, |agents, postgres| {
                println!("lokadb relay listening on {agents} (agents) and {postgres} (postgres)");
                let _ = std::io::stdout().flush();
            });
            if let Err(e) = result {
                eprintln!("lokadb: {e:#}");
                return ExitCode::from(1);
            }
            ExitCode::SUCCESS
        }
        Command::Proxy { config, cores } => {
            let config = match load(&config) {
                Ok(c) => c,
                Err(code) => return code,
            };
            let cores = match cores {
                Some(0) => {
                    eprintln!("lokadb: LOKADB_CORES must be at least 1");
                    return ExitCode::from(2);
                }
                Some(n) => n,
                None => std::thread::available_parallelism()
                    .map(|n| n.get())
                    .unwrap_or(1),
            };
            let result = lokadb::server::run(config, cores, |addr, relay| {
                // Scripts and the test harness wait for these lines.
                if let Some((agents, postgres)) = relay {
                    println!(
                        "lokadb relay listening on {agents} (agents) and {postgres} (postgres)"
                    );
                }
                println!("lokadb proxy listening on {addr}");
                let _ = std::io::stdout().flush();
            });
            if let Err(e) = result {
                eprintln!("lokadb: {e:#}");
                return ExitCode::from(1);
            }
            ExitCode::SUCCESS
        }
    }
}

fn load(path: &std::path::Path) -> Result<lokadb_shared::config::Config, ExitCode> {
    lokadb_shared::config::Config::load(path).map_err(|e| {
        eprintln!("lokadb: {e}");
        ExitCode::from(2)
    })
}

fn token(command: TokenCommand) -> ExitCode {
    use lokadb::relay::tokens;
    match command {
        TokenCommand::New { org } => {
            if org.is_empty() || org.contains('/') || org.len() > 200 {
                eprintln!("lokadb: an organization id is 1 to 200 characters without '/'");
                return ExitCode::from(2);
            }
            let token = tokens::generate(&org);
            println!("token: {token}");
            println!(
                "relay.tokens entry: \"{org}\": \"{}\"",
                tokens::hash_text(&token)
            );
        }
        TokenCommand::Hash => {
            let mut line = String::new();
            if std::io::stdin().read_line(&mut line).is_err() || line.trim().is_empty() {
                eprintln!("lokadb: give the token on stdin");
                return ExitCode::from(2);
            }
            println!("{}", tokens::hash_text(line.trim()));
        }
    }
    ExitCode::SUCCESS
}

/// Logs go to stderr; `LOKADB_LOG` takes a tracing filter (default `info`).
fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("LOKADB_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    use std::io::IsTerminal;
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr)
        .init();
}
