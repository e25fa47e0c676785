//! Starting and stopping the proxy: one pinned glommio executor per core, each with
//! its own listening socket (SO_REUSEPORT), its own state, and a watcher for shutdown.

use crate::cancel::CancelMsg;
use crate::core::{Core, Shared};
use glommio::channels::channel_mesh::MeshBuilder;
use glommio::net::TcpListener;
use glommio::timer::sleep;
use glommio::{LocalExecutorPoolBuilder, PoolPlacement};
use lokadb_shared::config::Config;
use std::net::SocketAddr;
use std::os::fd::{FromRawFd, RawFd};
use std::rc::Rc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How often each core checks the process-wide shutdown flag and reaps idle backends.
const TICK: Duration = Duration::from_millis(100);
/// Reap idle pooled backends every this many ticks.
const REAP_EVERY: u32 = 50;

/// Runs the proxy until SIGTERM/SIGINT and the drain that follows.
///
/// `on_listening` is called once every socket is bound, with the resolved address.
///
/// # Errors
///
/// Configuration that cannot be used (files, addresses), bind failures, or executors
/// that cannot start.
pub fn run(
    config: Config,
    cores: usize,
    on_listening: impl FnOnce(SocketAddr),
) -> anyhow::Result<()> {
    let shared = Arc::new(Shared::new(config)?);
    let resolved = Arc::new(shared.resolve_databases()?);
    let sockets = crate::net::listener::bind_reuseport(shared.config.listen, cores)
        .map_err(|e| anyhow::anyhow!("cannot listen on {}: {e}", shared.config.listen))?;
    crate::signals::install(shared.clone())?;
    tracing::info!(addr = %sockets.addr, cores, "listening");
    on_listening(sockets.addr);

    // Each executor takes one fd; the Mutex is touched once per core at start.
    let fds: Arc<Mutex<Vec<RawFd>>> = Arc::new(Mutex::new(sockets.fds));
    let started = Arc::new(AtomicUsize::new(0));
    let mesh = (cores > 1).then(|| MeshBuilder::<CancelMsg, _>::full(cores, 64));
    let online = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let placement = if cores <= online {
        PoolPlacement::MaxSpread(cores, None)
    } else {
        PoolPlacement::Unbound(cores)
    };
    let mut builder = LocalExecutorPoolBuilder::new(placement)
        .name("lokadb-core")
        .io_memory(1 << 20);
    if let Some(spin) = spin_before_park() {
        builder = builder.spin_before_park(spin);
    }
    let handles = builder
        .on_all_shards(move || async move {
            let fd = fds
                .lock()
                .expect("fd list")
                .pop()
                .expect("one socket per core");
            let index = started.fetch_add(1, Ordering::Relaxed);
            run_core(index, fd, shared, resolved, mesh).await
        })
        .map_err(|e| anyhow::anyhow!("cannot start executors: {e}"))?;
    for result in handles.join_all() {
        result.map_err(|e| anyhow::anyhow!("executor failed: {e}"))?;
    }
    tracing::info!("stopped");
    Ok(())
}

/// `LOKADB_SPIN_US`: how long an idle executor polls before it parks (default 0).
fn spin_before_park() -> Option<Duration> {
    let us: u64 = std::env::var("LOKADB_SPIN_US").ok()?.parse().ok()?;
    (us > 0).then(|| Duration::from_micros(us))
}

async fn run_core(
    index: usize,
    fd: RawFd,
    shared: Arc<Shared>,
    resolved: Arc<Vec<(String, SocketAddr, String)>>,
    mesh: Option<MeshBuilder<CancelMsg, glommio::channels::channel_mesh::Full>>,
) {
    // SAFETY: `fd` is a listening socket created for this core and owned by no one else.
    let listener = unsafe { TcpListener::from_raw_fd(fd) };
    let (id, peers) = match mesh {
        Some(mesh) => {
            let (senders, receivers) = mesh.join().await.expect("mesh join");
            (senders.peer_id(), Some((senders, receivers)))
        }
        None => (index, None),
    };
    let core = Rc::new(Core::new(id, shared.clone(), &resolved));
    if let Some((senders, mut receivers)) = peers {
        for (_, rx) in receivers.streams() {
            let core = core.clone();
            glommio::spawn_local(async move {
                while let Some(msg) = rx.recv().await {
                    let target = core.cancels.borrow().lookup(msg.pid, &msg.secret);
                    if let Some(t) = target {
                        crate::cancel::send(t).await;
                    }
                }
            })
            .detach();
        }
        let _ = core.peers.set(senders);
    }
    glommio::spawn_local(watch(core.clone())).detach();

    loop {
        let accepted = futures_lite::future::or(async { Some(listener.accept().await) }, async {
            wait_shutdown(&core).await;
            None
        })
        .await;
        match accepted {
            None => break,
            Some(Ok(stream)) => {
                glommio::spawn_local(crate::frontend::session::serve(core.clone(), stream))
                    .detach();
            }
            Some(Err(e)) => {
                // EMFILE and friends: back off instead of spinning.
                tracing::warn!(error = %e, "accept failed");
                sleep(Duration::from_millis(10)).await;
            }
        }
    }
    drop(listener);
    drain(&core).await;
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
        if ticks.is_multiple_of(REAP_EVERY) {
            let now = Instant::now();
            let databases = &core.databases;
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

/// Lets sessions finish (idle ones end at once; those in a transaction end at their
/// next ReadyForQuery outside one) for at most `shutdown_timeout`.
async fn drain(core: &Core) {
    let deadline = Instant::now() + core.shared.config.shutdown_timeout;
    tracing::info!(core = core.id, sessions = core.sessions.get(), "draining");
    while core.sessions.get() > 0 && Instant::now() < deadline {
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
