//! The metadata watcher: one thread per database with an `auth_user`, off the cores. It
//! keeps a connection to the cloud that LISTENs on `lokadb_meta` (the channel every
//! metadata change NOTIFYs with its new generation), loads a new [`Meta`] when the
//! generation moves, and hands it to every core: the one cross-core message of routing,
//! as rare as metadata changes.

use super::meta::Meta;
use crate::rt::mailbox::Mailbox;
use postgres::fallible_iterator::FallibleIterator;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// A new generation of one database's metadata.
pub struct MetaUpdate {
    /// The database's name in the proxy's config.
    pub database: String,
    pub meta: Arc<Meta>,
}

/// The way to one core.
pub type CoreInbox = Mailbox<MetaUpdate>;

/// How long a wait for notifications lasts before the shutdown flag is looked at again.
const POLL: Duration = Duration::from_millis(200);
/// Retry delays after the connection fails; the last repeats. Stale metadata only costs
/// placement (statements still go to the cloud), but it should not stay stale for long.
const BACKOFF: [Duration; 3] = [
    Duration::from_millis(200),
    Duration::from_secs(1),
    Duration::from_secs(5),
];

/// Starts the watcher of `database`.
///
/// # Errors
///
/// The thread could not be spawned.
pub fn spawn(
    database: String,
    config: crate::net::cloud_tls::PgLogin,
    relay_rootcert: Option<std::path::PathBuf>,
    cores: Vec<CoreInbox>,
    shutdown: Arc<AtomicBool>,
) -> std::io::Result<()> {
    std::thread::Builder::new()
        .name(format!("lokadb-meta-{database}"))
        .spawn(move || {
            let watcher = Watcher {
                database: &database,
                config: &config,
                relay_rootcert: relay_rootcert.as_deref(),
                cores: &cores,
            };
            run(&watcher, &shutdown);
        })?;
    Ok(())
}

/// What one database's watcher works with.
struct Watcher<'a> {
    database: &'a str,
    config: &'a crate::net::cloud_tls::PgLogin,
    /// `direct.sslrootcert` ([`Meta::load`]).
    relay_rootcert: Option<&'a std::path::Path>,
    cores: &'a [CoreInbox],
}

fn run(w: &Watcher<'_>, shutdown: &AtomicBool) {
    let database = w.database;
    let mut published: Option<i64> = None;
    let mut failures = 0usize;
    while !shutdown.load(Ordering::Relaxed) {
        match watch(w, shutdown, &mut published, &mut failures) {
            Ok(()) => return,
            Err(e) => {
                let delay = BACKOFF[failures.min(BACKOFF.len() - 1)];
                failures += 1;
                tracing::warn!(
                    database,
                    error = %crate::admin::db::describe(&e),
                    retry_in = ?delay,
                    "metadata watcher: cannot read the cloud's LokaDB metadata; statements are routed by the last generation read"
                );
                let until = std::time::Instant::now() + delay;
                while std::time::Instant::now() < until && !shutdown.load(Ordering::Relaxed) {
                    std::thread::sleep(POLL.min(delay));
                }
            }
        }
    }
}

/// One connection's life: LISTEN, load, publish, then reload on each notification.
/// Returns `Ok` at shutdown.
fn watch(
    w: &Watcher<'_>,
    shutdown: &AtomicBool,
    published: &mut Option<i64>,
    failures: &mut usize,
) -> Result<(), postgres::Error> {
    let mut client = w.config.connect()?;
    // LISTEN before the load: a change committed in between is then both seen by the
    // load or announced after it, never lost.
    client.batch_execute("LISTEN lokadb_meta")?;
    load_and_publish(w, &mut client, published)?;
    // Connected and current: a later failure retries from the shortest delay.
    *failures = 0;
    loop {
        let mut changed = false;
        {
            let mut notes = client.notifications();
            let mut iter = notes.timeout_iter(POLL);
            while let Some(note) = iter.next()? {
                let generation = note.payload().parse::<i64>().ok();
                if generation.is_none_or(|g| Some(g) != *published) {
                    changed = true;
                }
            }
        }
        if shutdown.load(Ordering::Relaxed) {
            return Ok(());
        }
        if changed {
            load_and_publish(w, &mut client, published)?;
        } else if client.is_closed() {
            // Surfaces the error of a connection the server ended.
            client.simple_query("SELECT 1")?;
        }
    }
}

fn load_and_publish(
    w: &Watcher<'_>,
    client: &mut postgres::Client,
    published: &mut Option<i64>,
) -> Result<(), postgres::Error> {
    let (database, cores) = (w.database, w.cores);
    let started = std::time::Instant::now();
    let mut tx = client
        .build_transaction()
        .isolation_level(postgres::IsolationLevel::RepeatableRead)
        .read_only(true)
        .start()?;
    let meta = Meta::load(&mut tx, w.relay_rootcert)?;
    tx.commit()?;
    if *published == Some(meta.generation) {
        return Ok(());
    }
    *published = Some(meta.generation);
    let meta = Arc::new(meta);
    for core in cores {
        let update = MetaUpdate {
            database: database.to_owned(),
            meta: meta.clone(),
        };
        core.send(update);
    }
    // Logged once every core has it in its mailbox (tests wait for this line).
    tracing::info!(
        database,
        generation = meta.generation,
        tables = meta.catalog.tables().len(),
        organizations = meta.orgs.len(),
        load_ms = started.elapsed().as_secs_f64() * 1e3,
        "metadata loaded"
    );
    Ok(())
}
