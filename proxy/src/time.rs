//! Timeouts on the runtime's timers.

use crate::rt::sleep;
use std::future::Future;
use std::time::Duration;

/// Runs `f` for at most `limit`; `None` when the time ran out (and `f` is dropped).
pub async fn with_timeout<T>(limit: Duration, f: impl Future<Output = T>) -> Option<T> {
    futures_lite::future::or(async { Some(f.await) }, async {
        sleep(limit).await;
        None
    })
    .await
}
