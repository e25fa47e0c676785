//! Starting and stopping the proxy: one pinned thread per core, each running its own
//! runtime ([`crate::rt`]) with its own listening socket (SO_REUSEPORT), its own state,
//! and a watcher for shutdown.

use crate::cancel::{CancelMsg, Peer};
use crate::core::{Core, Shared};
use crate::route::meta::CoreMeta;
use crate::route::watch::{self, MetaUpdate};
use crate::rt::mailbox::{self, Inbox};
use crate::rt::net::TcpListener;
use crate::rt::sleep;
use lokadb_shared::config::Config;
use std::net::SocketAddr;
use std::os::fd::RawFd;

/// Each core thread's stack: the statement analysis walks parse trees recursively, as
/// deep as [`crate::route::analysis::MAX_OPERATORS`] allows; reserved, not committed until
/// used.
const CORE_STACK_BYTES: usize = 16 << 20;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How often each core checks the process-wide shutdown flag and reaps idle backends.
const TICK: Duration = Duration::from_millis(100);
/// Reap idle pooled backends every this many ticks.
const REAP_EVERY: u32 = 50;
/// Publish the core's counters for `GET /metrics` every this many ticks.
const PUBLISH_TICKS: u32 = (crate::metrics::PUBLISH_EVERY.as_millis() / TICK.as_millis()) as u32;

/// Runs the proxy until SIGTERM/SIGINT and the drain that follows.
///
/// `on_listening` is called once every socket is bound, with the resolved address
/// (and the relay's, when it runs in this process).
///
/// # Errors
///
/// Configuration that cannot be used (files, addresses), bind failures, or core
/// threads that cannot start.
pub fn run(
    config: Config,
    config_path: Option<std::path::PathBuf>,
    cores: usize,
    on_listening: impl FnOnce(SocketAddr, Option<(SocketAddr, SocketAddr)>),
) -> anyhow::Result<()> {
    if config.databases.is_empty() {
        anyhow::bail!(
            "\"databases\" is empty: name at least one database clients may ask for (to run only the relay, use `lokadb relay`)"
        );
    }
    let shared = Arc::new(Shared::new(config)?);
    let resolved = Arc::new(shared.resolve_databases()?);
    // A process running at `handover` gives us its listening sockets.
    let mut taken = crate::handover::take_from(shared.config.handover.as_deref())?;
    let inherited = taken
        .as_mut()
        .map(|t| std::mem::take(&mut t.listeners))
        .unwrap_or_default();
    let sockets = crate::net::listener::adopt_or_bind(shared.config.listen, cores, inherited.proxy)
        .map_err(|e| anyhow::anyhow!("cannot listen on {}: {e}", shared.config.listen))?;
    // Copies of every listener for the next process; without `handover` none are kept
    // (a copy would hold a listener open, unaccepted, through the drain).
    let handing_over = shared.config.handover.is_some();
    let mut successor = crate::handover::Listeners::default();
    if handing_over {
        successor.proxy = sockets
            .fds
            .iter()
            .flatten()
            .map(|&fd| crate::handover::dup(fd))
            .collect::<Result<_, _>>()?;
    }
    // Each core's inbox for a reloaded configuration (SIGHUP).
    let (reload_peers, reload_inboxes) = mailbox::per_core::<Arc<Config>>(cores)?;
    let (relay_reloads, relay_reloaded) = crossbeam_channel::unbounded();
    let on_hangup: Option<Box<dyn Fn() + Send>> = config_path.map(|path| {
        let reloader = crate::reload::Reloader {
            path,
            shared: shared.clone(),
            cores: reload_peers,
            relay: shared.config.relay.is_some().then_some(relay_reloads),
        };
        Box::new(move || reloader.reload()) as _
    });
    crate::signals::install(shared.shutdown.clone(), on_hangup)?;
    if let Some(addr) = shared.config.metrics {
        let (bound, copy) = crate::metrics::serve(addr, inherited.metrics, shared.clone())?;
        successor.metrics = handing_over.then_some(copy);
        tracing::info!(addr = %bound, "metrics listening (GET /metrics)");
    }
    let mut relay = match shared.config.relay.clone() {
        Some(relay_config) => {
            let flag = shared.shutdown.clone();
            let publish: Option<crate::relay::Publish> = shared.publishes().then(|| {
                let shared = shared.clone();
                Box::new(move |counters, tunnels| shared.published.relay(counters, tunnels)) as _
            });
            Some(crate::relay::start(
                relay_config,
                inherited.relay,
                move || flag.load(Ordering::Relaxed),
                publish,
                Some(relay_reloaded),
            )?)
        }
        None => None,
    };

    // Each core's inbox for cancel requests that arrive on another core.
    let (peers, inboxes) = mailbox::per_core::<CancelMsg>(cores)?;
    let peers = Arc::new(peers);
    // Each core's inbox for metadata generations, and one watcher per database that has
    // a role to read them with.
    let (meta_peers, meta_inboxes) = mailbox::per_core::<MetaUpdate>(cores)?;
    for cloud in resolved.iter() {
        let name = &cloud.name;
        let db = &shared.config.databases[name];
        let Some(user) = &db.auth_user else {
            tracing::info!(database = %name, "no auth_user: no routing metadata for this database");
            continue;
        };
        let password = shared.auth_password(db);
        let mut pg = cloud.postgres_config(user, password);
        pg.application_name("lokadb meta");
        let mut resolver = pg.clone();
        resolver.application_name("lokadb migrations");
        let (pg, resolver) = [pg, resolver]
            .map(|config| crate::net::cloud_tls::PgLogin {
                config,
                tls: cloud.tls.clone(),
            })
            .into();
        // Migrations' second phase in organizations' databases (docs/migrations.md).
        crate::migrate::spawn(name.clone(), resolver, shared.shutdown.clone())?;
        watch::spawn(
            name.clone(),
            pg,
            db.direct.as_ref().and_then(|d| d.sslrootcert.clone()),
            meta_peers.clone(),
            shared.shutdown.clone(),
        )?;
    }
    drop(meta_peers);
    // Recording files are opened here so a path that cannot be written stops the start.
    let mut recorders = Vec::with_capacity(cores);
    for id in 0..cores {
        recorders.push(match &shared.config.record {
            Some(prefix) => Some(crate::record::Recorder::open(prefix, id).map_err(|e| {
                anyhow::anyhow!(
                    "cannot open the traffic recording {}: {e}",
                    crate::record::core_path(prefix, id).display()
                )
            })?),
            None => None,
        });
    }
    let online = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let pin = cores <= online && pinning_enabled();

    tracing::info!(addr = %sockets.addr, cores, pinned = pin, "listening");
    on_listening(sockets.addr, relay.as_ref().map(|r| (r.agents, r.postgres)));
    successor.relay = relay
        .as_mut()
        .and_then(|r| r.copies.take())
        .filter(|_| handing_over);

    let mut threads = Vec::with_capacity(cores);
    for (id, ((((fds, inbox), meta_inbox), reloads), recorder)) in sockets
        .fds
        .into_iter()
        .zip(inboxes)
        .zip(meta_inboxes)
        .zip(reload_inboxes)
        .zip(recorders)
        .enumerate()
    {
        let (shared, resolved, peers) = (shared.clone(), resolved.clone(), peers.clone());
        let thread = std::thread::Builder::new()
            .name(format!("lokadb-core-{id}"))
            .stack_size(CORE_STACK_BYTES)
            .spawn(move || {
                if pin {
                    pin_to_cpu(id);
                }
                let own = CoreStart {
                    id,
                    fds,
                    cancels: inbox,
                    meta: meta_inbox,
                    reloads,
                    recorder,
                };
                crate::rt::block_on(run_core(own, shared, resolved, peers))
            })?;
        threads.push(thread);
    }
    // Every core accepts: the process we took the sockets from may drain now, and the next
    // one may take them from us.
    if let Some(taken) = taken {
        *shared.predecessor.lock().unwrap_or_else(|p| p.into_inner()) = taken.ready();
    }
    if let Some(path) = &shared.config.handover {
        // While draining, the cancels the successor cannot place go to every core here.
        let cores_cancel = peers.clone();
        let on_cancel: crate::handover::OnCancel = Box::new(move |pid, secret| {
            let left = Arc::new(std::sync::atomic::AtomicUsize::new(cores_cancel.len()));
            for core in cores_cancel.iter() {
                core.send(CancelMsg {
                    pid,
                    secret: secret.clone(),
                    left: left.clone(),
                });
            }
        });
        crate::handover::offer(
            path.clone(),
            successor,
            shared.shutdown.clone(),
            Some(on_cancel),
        );
    }
    for t in threads {
        t.join()
            .map_err(|_| anyhow::anyhow!("a core thread panicked"))?;
    }
    if let Some(relay) = relay {
        relay.join()?;
    }
    tracing::info!("stopped");
    Ok(())
}

/// Runs the relay alone (`lokadb relay`) until SIGTERM/SIGINT and its drain.
///
/// `on_listening` gets the agents' and the Postgres listener's addresses.
///
/// # Errors
///
/// No `relay` in the config, its TLS files, or a listener that cannot be bound.
pub fn run_relay(
    config: Config,
    config_path: Option<std::path::PathBuf>,
    on_listening: impl FnOnce(SocketAddr, SocketAddr),
) -> anyhow::Result<()> {
    let relay_config = config
        .relay
        .ok_or_else(|| anyhow::anyhow!("the config has no \"relay\" section"))?;
    let flag = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (reloads, reloaded) = crossbeam_channel::unbounded();
    let on_hangup: Option<Box<dyn Fn() + Send>> = config_path.map(|path| {
        let start = relay_config.clone();
        Box::new(move || crate::reload::reload_relay(&path, &start, &reloads)) as _
    });
    crate::signals::install(flag.clone(), on_hangup)?;
    // A relay running at `handover` gives us its two listeners.
    let mut taken = crate::handover::take_from(config.handover.as_deref())?;
    let inherited = taken.as_mut().and_then(|t| t.listeners.relay.take());
    let relay_flag = flag.clone();
    let mut relay = crate::relay::start(
        relay_config,
        inherited,
        move || relay_flag.load(Ordering::Relaxed),
        None,
        Some(reloaded),
    )?;
    on_listening(relay.agents, relay.postgres);
    if let Some(taken) = taken {
        // A relay's cancels go to the organizations' databases by its own keys: nothing to
        // hand the old one.
        drop(taken.ready());
    }
    // Kept only for a successor: a copy would hold the listeners open through the drain.
    let copies = relay.copies.take();
    if let Some(path) = config.handover {
        let successor = crate::handover::Listeners {
            relay: copies,
            ..Default::default()
        };
        crate::handover::offer(path, successor, flag, None);
    }
    relay.join()
}

/// `LOKADB_PIN=0` leaves core threads to the scheduler (default: pinned).
fn pinning_enabled() -> bool {
    std::env::var("LOKADB_PIN").map_or(true, |v| v != "0")
}

/// Pins the calling thread to one CPU (best effort: a restricted cpuset just logs).
fn pin_to_cpu(cpu: usize) {
    // SAFETY: cpu_set_t is plain data; CPU_SET stays within its bounds for cpu < 1024.
    let ok = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu % libc::CPU_SETSIZE as usize, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0
    };
    if !ok {
        tracing::warn!(cpu, error = %std::io::Error::last_os_error(), "cannot pin core thread");
    }
}

/// What one core starts with that is its own.
struct CoreStart {
    id: usize,
    /// Its listening sockets: one it bound, or those handed over to it.
    fds: Vec<RawFd>,
    /// Cancel requests forwarded from other cores.
    cancels: Inbox<CancelMsg>,
    /// Metadata generations from the watchers.
    meta: Inbox<MetaUpdate>,
    /// Configurations reloaded on SIGHUP.
    reloads: Inbox<Arc<Config>>,
    /// Its traffic recording file (`--record`).
    recorder: Option<crate::record::Recorder>,
}

async fn run_core(
    own: CoreStart,
    shared: Arc<Shared>,
    resolved: Arc<Vec<crate::core::Resolved>>,
    peers: Arc<Vec<Peer>>,
) {
    let CoreStart {
        id,
        fds,
        cancels,
        meta,
        reloads,
        recorder,
    } = own;
    let mut listeners = Vec::with_capacity(fds.len());
    for fd in fds {
        // SAFETY: `fd` is a listening socket given to this core and owned by no one else.
        match unsafe { TcpListener::from_raw_fd(fd) } {
            Ok(l) => listeners.push(l),
            Err(e) => {
                return tracing::error!(core = id, error = %e, "cannot use the listening socket")
            }
        }
    }
    let mut core = Core::new(id, shared, &resolved, peers);
    core.record = recorder;
    let core = Rc::new(core);
    crate::rt::spawn(forwarded_cancels(core.clone(), cancels)).detach();
    crate::rt::spawn(meta_updates(core.clone(), meta)).detach();
    let reloaded = core.clone();
    crate::rt::spawn(reloads.for_each(move |config| reloaded.apply(&config))).detach();
    crate::rt::spawn(watch(core.clone())).detach();

    let accepting: Vec<_> = listeners
        .into_iter()
        .map(|listener| crate::rt::spawn(accept(core.clone(), listener)))
        .collect();
    for task in accepting {
        // Each returns at shutdown, its listener closed.
        task.await;
    }
    drain(&core).await;
}

/// Accepts sessions on one listener until shutdown.
async fn accept(core: Rc<Core>, listener: TcpListener) {
    loop {
        let accepted = futures_lite::future::or(async { Some(listener.accept().await) }, async {
            wait_shutdown(&core).await;
            None
        })
        .await;
        match accepted {
            None => break,
            Some(Ok(stream)) => {
                crate::rt::spawn(crate::frontend::session::serve(core.clone(), stream)).detach();
            }
            Some(Err(e)) => {
                // EMFILE and friends: back off instead of spinning.
                tracing::warn!(error = %e, "accept failed");
                sleep(Duration::from_millis(10)).await;
            }
        }
    }
}

/// Cancel requests other cores received and found no session for: maybe this core's.
async fn forwarded_cancels(core: Rc<Core>, inbox: Inbox<CancelMsg>) {
    inbox
        .for_each(|msg| crate::cancel::handle_forwarded(&core, msg))
        .await;
}

/// New metadata generations from the watchers: swapped in whole (the analyses kept when
/// the LokaDB tables did not change); sessions see it from their next statement.
async fn meta_updates(core: Rc<Core>, inbox: Inbox<MetaUpdate>) {
    inbox
        .for_each(|update| {
            let mut metas = core.meta.borrow_mut();
            let next = match metas.get(&update.database) {
                Some(old) => old.next(update.meta),
                None => CoreMeta::new(update.meta),
            };
            metas.insert(update.database, Rc::new(next));
            core.meta_version.set(core.meta_version.get() + 1);
        })
        .await;
}

/// Sets the core's shutdown notification when the process-wide flag is raised, and
/// reaps idle backends meanwhile.
async fn watch(core: Rc<Core>) {
    let mut ticks = 0u32;
    loop {
        sleep(TICK).await;
        if core.shared.shutdown.load(Ordering::Relaxed) {
            core.shutdown.fire();
            return;
        }
        ticks += 1;
        core.follow_pause();
        if core.shared.publishes() {
            for id in core.shared.published.kills_for(core.id) {
                crate::frontend::console::kill_local(&core, id);
            }
            if ticks.is_multiple_of(PUBLISH_TICKS) {
                core.shared.published.core(&core);
            }
        }
        if let Some(rec) = &core.record {
            // A recording is at most a tick behind, whatever the sessions do.
            rec.flush();
        }
        crate::frontend::cloud_pool::free_a_place_for_other_cores(&core);
        if ticks.is_multiple_of(REAP_EVERY) {
            let now = Instant::now();
            let databases = core.databases.borrow();
            core.pool.borrow_mut().reap(now, |key| {
                databases
                    .get(&*key.database)
                    .map_or(Duration::ZERO, |d| d.config.pool_idle_timeout)
            });
        }
    }
}

async fn wait_shutdown(core: &Core) {
    let slot = core.shutdown.slot();
    futures_lite::future::poll_fn(|cx| {
        if core.shutdown.poll_fired(slot, cx) {
            std::task::Poll::Ready(())
        } else {
            std::task::Poll::Pending
        }
    })
    .await;
    core.shutdown.release(slot);
}

/// How long after shutdown a session that sends nothing is kept: a client accepted just
/// before the listener closed (or was handed over) gets its first statement served.
pub const IDLE_GRACE: Duration = Duration::from_millis(500);

/// Lets sessions finish for at most `shutdown_timeout`: each ends at its next ReadyForQuery
/// outside a transaction once it sent something since the shutdown, or at
/// [`IDLE_GRACE`] if it sent nothing.
async fn drain(core: &Core) {
    let started = Instant::now();
    let deadline = started + core.shared.config.shutdown_timeout;
    tracing::info!(core = core.id, sessions = core.sessions.get(), "draining");
    while core.sessions.get() > 0 && Instant::now() < deadline {
        if !core.idle_cut.is_fired() && started.elapsed() >= IDLE_GRACE {
            core.idle_cut.fire();
        }
        sleep(Duration::from_millis(20)).await;
    }
    if core.sessions.get() > 0 {
        tracing::warn!(
            core = core.id,
            sessions = core.sessions.get(),
            "shutdown_timeout reached; closing sessions"
        );
    }
    let idle = core.pool.borrow_mut().drain();
    for backend in idle {
        backend.terminate().await;
    }
}
