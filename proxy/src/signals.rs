//! SIGTERM and SIGINT: the first starts a graceful shutdown, a second one exits at once.
//! SIGHUP: the configuration is read again ([`crate::reload`]), or, where nothing reloads,
//! the signal is logged and ignored (never the default: ending the process).

use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
use signal_hook::iterator::Signals;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// Starts the thread that turns signals into the shutdown flag, which the proxy's
/// cores and the relay watch.
///
/// # Errors
///
/// The signal handlers cannot be installed.
pub fn install(
    shutdown: Arc<AtomicBool>,
    on_hangup: Option<Box<dyn Fn() + Send>>,
) -> anyhow::Result<()> {
    let mut signals = Signals::new([SIGTERM, SIGINT, SIGHUP])?;
    std::thread::Builder::new()
        .name("lokadb-signals".into())
        .spawn(move || {
            for signal in signals.forever() {
                if signal == SIGHUP {
                    match &on_hangup {
                        Some(reload) => reload(),
                        None => tracing::info!("SIGHUP: nothing to reload here (ignored)"),
                    }
                    continue;
                }
                if shutdown.swap(true, Ordering::Relaxed) {
                    tracing::warn!(signal, "second signal: exiting now");
                    std::process::exit(1);
                }
                tracing::info!(
                    signal,
                    "shutting down: no new connections, running transactions may finish"
                );
            }
        })?;
    Ok(())
}
