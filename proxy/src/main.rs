//! `lokadb`: the proxy, the relay, and (later) the admin commands.

use clap::{Parser, Subcommand};
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

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
        /// Record every session's traffic after login into FILE.<core> (mode 0600; see
        /// docs/operations.md). Overrides the config's "record".
        #[arg(long, value_name = "FILE")]
        record: Option<PathBuf>,
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
    /// Create or upgrade the lokadb schema in the cloud database (idempotent).
    Init {
        #[command(flatten)]
        cloud: Cloud,
    },
    /// Organizations whose database is registered (reached through the relay).
    #[command(subcommand)]
    Org(OrgCommand),
    /// Hold an organization's writes (reads go on) until `lokadb resume`.
    Pause {
        /// The organization.
        org: String,
        /// Writers wait at most this long, then get an error (55P03).
        #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
        timeout: std::time::Duration,
        /// The pause ends by itself after this long.
        #[arg(long, default_value = "1h", value_parser = humantime::parse_duration)]
        max: std::time::Duration,
        #[command(flatten)]
        cloud: Cloud,
    },
    /// End an organization's pause.
    Resume {
        /// The organization.
        org: String,
        #[command(flatten)]
        cloud: Cloud,
    },
    /// Make a table a LokaDB table: LIST-partitioned by organization, its rows in a
    /// DEFAULT partition, every constraint kept (online; a rerun resumes).
    Enable {
        /// The table (schema-qualified, or found through the search_path).
        table: String,
        /// The organization column.
        #[arg(long, default_value = "organization_id")]
        org_column: String,
        /// Print the SQL it would run and change nothing.
        #[arg(long)]
        plan: bool,
        #[command(flatten)]
        cloud: Cloud,
    },
    /// Make a LokaDB table a plain table again (every organization's rows in the cloud).
    Disable {
        /// The table.
        table: String,
        /// Print the SQL it would run and change nothing.
        #[arg(long)]
        plan: bool,
        #[command(flatten)]
        cloud: Cloud,
    },
    /// Move an organization's rows to its own database while it keeps working; a rerun
    /// resumes an interrupted move, --abort rolls back one that has not switched.
    MoveOrg {
        /// The organization (registered with `lokadb org add`).
        org: String,
        #[command(flatten)]
        args: MoveArgs,
        /// How changes made during the copy are caught up: trigger (row triggers in the
        /// cloud) or logical (a publication and a subscription; wal_level = logical).
        #[arg(long, value_enum, default_value_t = lokadb::admin::moves::Mode::Trigger)]
        mode: lokadb::admin::moves::Mode,
        /// The organization's profile once moved (default: the one it has).
        #[arg(long, value_enum)]
        profile: Option<lokadb::profile::Profile>,
        /// Connection string of the cloud database as the organization's database reaches
        /// it, for logical mode's subscription: a role with REPLICATION, not a superuser
        /// (it is stored in the organization's database while the move runs).
        #[arg(long, env = "LOKADB_CLOUD_FROM_ORG", hide_env_values = true)]
        cloud_from_org: Option<String>,
    },
    /// Move a moved organization's rows back into the cloud (same guarantees), then fold a
    /// small one into DEFAULT.
    MoveBack {
        /// The organization.
        org: String,
        #[command(flatten)]
        args: MoveArgs,
        /// Fold the organization into DEFAULT afterwards (see `lokadb fold`) when it has at
        /// most this many rows in all LokaDB tables; 0 keeps its partitions.
        #[arg(long, default_value_t = lokadb::admin::moves::fold::DEFAULT_FOLD_MAX_ROWS)]
        fold_max_rows: u64,
    },
    /// Give an organization in the cloud partitions of its own, out of DEFAULT, ahead of
    /// its move: its later move-org has no split and pauses its writes only at the switch.
    /// Its writes pause for the split itself (longer the bigger it is): pick the moment.
    Split {
        /// The organization.
        org: String,
        /// Remove what an interrupted split made (its partitions once attached stay:
        /// `lokadb fold` puts the organization back into DEFAULT).
        #[arg(long)]
        abort: bool,
        #[command(flatten)]
        cloud: Cloud,
    },
    /// Put an organization in the cloud that has partitions of its own back into the
    /// DEFAULT partition, whatever its size: every organization's statements on the LokaDB
    /// tables wait while its rows are copied.
    Fold {
        /// The organization.
        org: String,
        #[command(flatten)]
        cloud: Cloud,
    },
    /// Check where an organization's rows are (all in one place, none of another's) and,
    /// once moved, that its tables' schema is the cloud's.
    Verify {
        /// The organization (default: every moved organization).
        org: Option<String>,
        /// Connection string of its database (default: through the relay).
        #[arg(long)]
        org_dsn: Option<String>,
        #[command(flatten)]
        cloud: Cloud,
    },
    /// Every organization's state, pause and move in progress (phase, rows and bytes, rate,
    /// lag and ETA of each move, from any machine that reaches the cloud).
    Status {
        /// Show it again every SECONDS (default 2) until interrupted.
        #[arg(long, value_name = "SECONDS", num_args = 0..=1, default_missing_value = "2",
              value_parser = parse_interval)]
        watch: Option<Duration>,
        /// With --watch: stop after N refreshes.
        #[arg(long, value_name = "N", requires = "watch",
              value_parser = clap::value_parser!(u64).range(1..))]
        count: Option<u64>,
        #[command(flatten)]
        cloud: Cloud,
    },
    /// Settle the migrations prepared in organizations' databases: commit those whose cloud
    /// transaction committed, roll back the others (the proxy does it by itself; this is for
    /// when none runs).
    Resolve {
        #[command(flatten)]
        cloud: Cloud,
    },
    /// Build an index concurrently on a LokaDB table, in the cloud and in every moved
    /// organization's database, with progress per organization; a rerun finishes what a
    /// failed run left (see docs/migrations.md).
    Concurrently {
        /// The statement: CREATE [UNIQUE] INDEX [CONCURRENTLY] [IF NOT EXISTS] name ON table ...
        statement: String,
        #[command(flatten)]
        cloud: Cloud,
    },
    /// Internal: the process that holds a pause (started by `lokadb pause`).
    #[command(hide = true)]
    PauseHolder {
        org: String,
        #[arg(long, value_parser = humantime::parse_duration)]
        timeout: std::time::Duration,
        #[arg(long, value_parser = humantime::parse_duration)]
        max: std::time::Duration,
        #[arg(long, default_value = "lokadb pause")]
        reason: String,
        #[command(flatten)]
        cloud: Cloud,
    },
}

/// A size as Postgres writes one: a number and `kB`, `MB` or `GB` (1024-based).
fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (n, unit) = t.split_at(split);
    let n: u64 = n
        .parse()
        .map_err(|_| format!("{s:?} is not a size: write a number and kB, MB or GB"))?;
    let scale = match unit.trim().to_ascii_lowercase().as_str() {
        "kb" => 1 << 10,
        "mb" => 1 << 20,
        "gb" => 1 << 30,
        _ => {
            return Err(format!(
                "{s:?} is not a size: write a number and kB, MB or GB"
            ))
        }
    };
    match n.checked_mul(scale) {
        Some(b) if b > 0 => Ok(b),
        _ => Err(format!("{s:?}: the size must be above 0 and below 16 EB")),
    }
}

/// A refresh interval in seconds, at least 0.1 and at most a day.
fn parse_interval(s: &str) -> Result<Duration, String> {
    match s.trim().parse::<f64>() {
        Ok(n) if (0.1..=86_400.0).contains(&n) => Ok(Duration::from_secs_f64(n)),
        _ => Err(format!(
            "{s:?} is not an interval: write seconds, from 0.1 to 86400"
        )),
    }
}

/// What move-org and move-back share.
#[derive(clap::Args)]
struct MoveArgs {
    /// Roll back an interrupted move that has not switched yet.
    #[arg(long)]
    abort: bool,
    /// Finish an interrupted move (what a plain rerun does too).
    #[arg(long, conflicts_with = "abort")]
    resume: bool,
    /// Copy streams at once, each a pair of connections (a large table is copied in parts).
    #[arg(long, default_value_t = 4)]
    jobs: usize,
    /// About this much of a table's heap per copy part (kB, MB or GB; 1024-based).
    #[arg(long, default_value = "16MB", value_parser = parse_size)]
    part_size: u64,
    /// Connection string of the organization's database as this command reaches it
    /// (default: through the relay, as its postgres_fdw user mapping's role).
    #[arg(long)]
    org_dsn: Option<String>,
    #[command(flatten)]
    cloud: Cloud,
}

impl MoveArgs {
    fn options(
        &self,
        org: String,
        mode: lokadb::admin::moves::Mode,
        profile: Option<lokadb::profile::Profile>,
        cloud_from_org: Option<String>,
    ) -> lokadb::admin::moves::MoveOptions {
        lokadb::admin::moves::MoveOptions {
            org,
            mode,
            profile,
            jobs: self.jobs,
            part_bytes: self.part_size,
            abort: self.abort,
            resume: self.resume,
            org_dsn: self.org_dsn.clone(),
            cloud_from_org,
            fold_max_rows: 0,
        }
    }
}

/// The cloud database an admin command works on.
#[derive(clap::Args)]
struct Cloud {
    /// Connection string of the cloud database, as a role that may create schemas,
    /// servers and triggers (libpq keywords or a postgresql:// URL).
    #[arg(long = "cloud", env = "LOKADB_CLOUD", hide_env_values = true)]
    dsn: String,
}

#[derive(Subcommand)]
enum OrgCommand {
    /// Register an organization's database, reached through the relay.
    Add {
        /// The organization id (as in relay.tokens).
        id: String,
        /// The relay's Postgres listener as the cloud database reaches it, HOST:PORT;
        /// repeated for several relays (tried in this order: losing one loses nothing).
        #[arg(long = "via-relay", required = true)]
        via_relay: Vec<String>,
        /// The database in the organization's Postgres.
        #[arg(long)]
        dbname: String,
        /// fdw (through the cloud) or fdw+direct (the proxy may go straight there).
        #[arg(long, value_enum, default_value_t = lokadb::profile::Profile::Fdw)]
        profile: lokadb::profile::Profile,
        /// Display name.
        #[arg(long)]
        name: Option<String>,
        /// The role postgres_fdw logs in as in the organization's database.
        #[arg(long, env = "LOKADB_ORG_USER")]
        user: String,
        /// Its password.
        #[arg(long, env = "LOKADB_ORG_PASSWORD", hide_env_values = true)]
        password: String,
        /// TLS from the cloud (postgres_fdw) and the proxy (direct path) to the relay, as
        /// libpq's sslmode: verify-full, verify-ca, require, prefer or disable (plain TCP).
        #[arg(long = "relay-sslmode", env = "LOKADB_RELAY_SSLMODE", default_value = "verify-full", value_parser = parse_sslmode)]
        relay_sslmode: lokadb_shared::conninfo::SslMode,
        /// The CA certificate (PEM) the relay's certificate chains to, as a path on the
        /// cloud database's host (postgres_fdw reads it there).
        #[arg(long = "relay-sslrootcert", env = "LOKADB_RELAY_SSLROOTCERT")]
        relay_sslrootcert: Option<String>,
        #[command(flatten)]
        cloud: Cloud,
    },
    /// List registered organizations.
    List {
        #[command(flatten)]
        cloud: Cloud,
    },
    /// Show one organization.
    Show {
        id: String,
        #[command(flatten)]
        cloud: Cloud,
    },
    /// Apply the migrations an organization owes (it could not be reached when they ran,
    /// with lokadb.migration_offline = defer), in order; its statements are served again.
    Sync {
        id: String,
        #[command(flatten)]
        cloud: Cloud,
    },
    /// Unregister an organization whose rows are in the cloud.
    Remove {
        id: String,
        #[command(flatten)]
        cloud: Cloud,
    },
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

/// `--relay-sslmode`: libpq's words, `allow` excepted (it would try plain first).
fn parse_sslmode(s: &str) -> Result<lokadb_shared::conninfo::SslMode, String> {
    match lokadb_shared::conninfo::SslMode::parse(s)? {
        lokadb_shared::conninfo::SslMode::Allow => {
            Err("allow tries plain TCP first; say prefer or disable".into())
        }
        mode => Ok(mode),
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging();
    match cli.command {
        Command::Token(t) => token(t),
        Command::Init { cloud } => admin(lokadb::admin::migrations::init(&cloud.dsn).map(|r| {
            if r.from == r.to {
                format!("lokadb schema is up to date (version {})", r.to)
            } else {
                format!("lokadb schema upgraded from version {} to {}", r.from, r.to)
            }
        })),
        Command::Org(o) => org(o),
        Command::Pause {
            org,
            timeout,
            max,
            cloud,
        } => {
            let opts = lokadb::admin::pause::PauseOptions {
                timeout,
                max,
                reason: "lokadb pause".into(),
            };
            admin(lokadb::admin::pause::pause(&cloud.dsn, &org, &opts).map(|pid| {
                format!(
                    "organization {org} is paused: its writes wait (at most {}), reads go on; `lokadb resume {org}` ends it (holder pid {pid}, ends by itself after {})",
                    humantime::format_duration(timeout),
                    humantime::format_duration(max)
                )
            }))
        }
        Command::Resume { org, cloud } => admin(
            lokadb::admin::pause::resume(&cloud.dsn, &org)
                .map(|()| format!("organization {org} resumed")),
        ),
        Command::Enable {
            table,
            org_column,
            plan,
            cloud,
        } => admin(lokadb::admin::enable::enable(
            &cloud.dsn,
            &lokadb::admin::enable::EnableOptions {
                table,
                org_column,
                plan,
            },
        )),
        Command::Disable { table, plan, cloud } => {
            admin(lokadb::admin::disable::disable(&cloud.dsn, &table, plan))
        }
        Command::MoveOrg {
            org,
            args,
            mode,
            profile,
            cloud_from_org,
        } => {
            let opts = args.options(org, mode, profile, cloud_from_org);
            admin(lokadb::admin::moves::move_org(&args.cloud.dsn, &opts))
        }
        Command::MoveBack {
            org,
            args,
            fold_max_rows,
        } => {
            let mut opts = args.options(org, lokadb::admin::moves::Mode::Trigger, None, None);
            opts.fold_max_rows = fold_max_rows;
            admin(lokadb::admin::moves::move_back(&args.cloud.dsn, &opts))
        }
        Command::Split { org, abort, cloud } => admin(
            lokadb::admin::moves::split_ahead::split_org(&cloud.dsn, &org, abort),
        ),
        Command::Fold { org, cloud } => {
            admin(lokadb::admin::moves::fold::fold_org(&cloud.dsn, &org))
        }
        Command::Verify {
            org,
            org_dsn,
            cloud,
        } => admin(match (org, org_dsn) {
            (Some(org), dsn) => lokadb::admin::moves::verify_org(&cloud.dsn, &org, dsn.as_deref()),
            (None, None) => lokadb::admin::moves::verify_moved(&cloud.dsn),
            (None, Some(_)) => Err(lokadb::admin::db::AdminError::usage(
                "--org-dsn is one organization's database: name the organization",
            )),
        }),
        Command::Status {
            watch: None, cloud, ..
        } => admin(lokadb::admin::moves::status::status(&cloud.dsn)),
        Command::Status {
            watch: Some(every),
            count,
            cloud,
        } => admin(lokadb::admin::moves::status::watch(
            &cloud.dsn, every, count,
        )),
        Command::Resolve { cloud } => admin(resolve(&cloud.dsn)),
        Command::Concurrently { statement, cloud } => {
            admin(lokadb::admin::concurrently::run(&cloud.dsn, &statement))
        }
        Command::PauseHolder {
            org,
            timeout,
            max,
            reason,
            cloud,
        } => {
            let opts = lokadb::admin::pause::PauseOptions {
                timeout,
                max,
                reason,
            };
            admin(lokadb::admin::pause::hold(&cloud.dsn, &org, &opts).map(|()| String::new()))
        }
        Command::Relay { config } => {
            let config_path = config.clone();
            let config = match load(&config) {
                Ok(c) => c,
                Err(code) => return code,
            };
            let result =
                lokadb::server::run_relay(config, Some(config_path), |agents, postgres| {
                    println!(
                        "lokadb relay listening on {agents} (agents) and {postgres} (postgres)"
                    );
                    let _ = std::io::stdout().flush();
                });
            if let Err(e) = result {
                eprintln!("lokadb: {e:#}");
                return ExitCode::from(1);
            }
            ExitCode::SUCCESS
        }
        Command::Proxy {
            config,
            cores,
            record,
        } => {
            let config_path = config.clone();
            let mut config = match load(&config) {
                Ok(c) => c,
                Err(code) => return code,
            };
            if record.is_some() {
                config.record = record;
            }
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
            let result = lokadb::server::run(config, Some(config_path), cores, |addr, relay| {
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

/// Prints an admin command's result; exit status 2 for bad input, 1 for a failure.
/// `lokadb resolve`: one sweep of every organization.
fn resolve(dsn: &str) -> Result<String, lokadb::admin::AdminError> {
    let mut client = lokadb::admin::db::connect(dsn)?;
    lokadb::admin::migrations::require_current(&mut client)?;
    let r = lokadb::migrate::resolve(&mut client, true)?;
    Ok(format!(
        "prepared migrations: {} committed, {} rolled back, {} left (their cloud transaction is still running), {} organizations unreachable",
        r.committed, r.rolled_back, r.in_doubt, r.unreachable
    ))
}

fn admin(result: Result<String, lokadb::admin::AdminError>) -> ExitCode {
    match result {
        Ok(out) => {
            if !out.is_empty() {
                println!("{}", out.trim_end());
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("lokadb: {e}");
            ExitCode::from(if e.usage { 2 } else { 1 })
        }
    }
}

fn org(command: OrgCommand) -> ExitCode {
    use lokadb::admin::org;
    match command {
        OrgCommand::Add {
            id,
            via_relay,
            dbname,
            profile,
            name,
            user,
            password,
            relay_sslmode,
            relay_sslrootcert,
            cloud,
        } => {
            let mut relays = Vec::with_capacity(via_relay.len());
            for relay in &via_relay {
                let Some((host, port)) = relay.rsplit_once(':').and_then(|(h, p)| {
                    Some((
                        h.trim_matches(['[', ']']).to_owned(),
                        p.parse::<u16>().ok()?,
                    ))
                }) else {
                    eprintln!("lokadb: --via-relay must be HOST:PORT, got {relay:?}");
                    return ExitCode::from(2);
                };
                relays.push((host, port));
            }
            let new = org::NewOrg {
                id: id.clone(),
                name,
                relays,
                dbname,
                profile,
                user,
                password,
                relay_sslmode,
                relay_sslrootcert,
            };
            admin(org::add(&cloud.dsn, &new).map(|v| {
                format!("organization {id} registered: its database answers through the relay (PostgreSQL {v})")
            }))
        }
        OrgCommand::List { cloud } => admin(org::list(&cloud.dsn)),
        OrgCommand::Show { id, cloud } => admin(org::show(&cloud.dsn, &id)),
        OrgCommand::Sync { id, cloud } => admin(org::sync(&cloud.dsn, &id)),
        OrgCommand::Remove { id, cloud } => {
            admin(org::remove(&cloud.dsn, &id).map(|()| format!("organization {id} removed")))
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

/// Logs go to stderr; `LOKADB_LOG` takes a tracing filter (default `info`), and
/// `LOKADB_LOG_FORMAT=json` writes one JSON object per line (for log collectors).
fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("LOKADB_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    use std::io::IsTerminal;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match std::env::var("LOKADB_LOG_FORMAT").as_deref() {
        Ok("json") => builder.json().init(),
        Ok("text") | Err(_) => builder.with_ansi(std::io::stderr().is_terminal()).init(),
        Ok(other) => {
            builder.with_ansi(false).init();
            tracing::warn!(
                value = other,
                "LOKADB_LOG_FORMAT is text or json; logging text"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::parse_size;

    #[test]
    fn sizes_are_read_as_postgres_writes_them() {
        assert_eq!(parse_size("16MB"), Ok(16 << 20));
        assert_eq!(parse_size("128kB"), Ok(128 << 10));
        assert_eq!(parse_size("1 gb"), Ok(1 << 30));
        for bad in ["", "MB", "16", "16 MiB", "0kB", "-1MB", "99999999999999GB"] {
            assert!(parse_size(bad).is_err(), "{bad}");
        }
    }
}
