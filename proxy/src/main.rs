//! `lokadb`: the proxy (and, later, the relay and admin commands).

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
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging();
    match cli.command {
        Command::Proxy { config, cores } => {
            let config = match lokadb_shared::config::Config::load(&config) {
                Ok(c) => c,
                Err(e) => {
                    eprintln!("lokadb: {e}");
                    return ExitCode::from(2);
                }
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
            let result = lokadb::server::run(config, cores, |addr| {
                // Scripts and the test harness wait for this line.
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
