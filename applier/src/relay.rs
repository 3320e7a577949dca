//! The relay: outbox → sink, at least once with a stable event id.
//!
//! It knows no dialect: claiming, sending and marking rows is one
//! [`Sidecar::relay_once`] transaction; this module decides only which
//! partitions to take and when to poll.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::{info, info_span, Instrument};

use crate::error::Result;
use crate::sidecar::Sidecar;
use crate::sink::Sink;

/// Which outbox rows a relay takes.
#[derive(Clone, Debug, Default)]
pub enum RelayScope {
    /// Every partition, skipping rows another relay holds: it takes the
    /// sidecar's relay lease exclusively, so it relays alone.
    #[default]
    All,
    /// Only the partitions this process owns (`skein apply`). Rows are locked
    /// without skipping, so a relay that takes a partition over waits for
    /// the previous owner's send to finish and keeps per-aggregate order.
    Partitions(Arc<Mutex<Vec<i32>>>),
}

/// Sends at most `limit` pending outbox rows of `scope` in id order and
/// marks them dequeued in the same transaction, after the sink has them
/// ([`Sidecar::relay_once`]). Returns how many were sent; 0 as well when
/// the scope owns no partition right now.
pub async fn relay_once<S: Sidecar>(
    sidecar: &mut S,
    sink: &mut dyn Sink,
    limit: i64,
    scope: &RelayScope,
) -> Result<usize> {
    let owned: Option<Vec<i32>> = match scope {
        RelayScope::All => None,
        RelayScope::Partitions(owned) => {
            // A snapshot: the lock is not held across the transaction.
            let owned: Vec<i32> = owned.lock().map(|o| o.clone()).unwrap_or_default();
            if owned.is_empty() {
                return Ok(0);
            }
            Some(owned)
        }
    };
    sidecar.relay_once(limit, owned.as_deref(), sink).await
}

/// Relays until cancelled, then drains what is pending once more.
pub async fn run_relay<S: Sidecar + Send>(
    mut sidecar: S,
    mut sink: Box<dyn Sink>,
    limit: i64,
    scope: RelayScope,
    cancel: CancellationToken,
) -> Result<()> {
    async move {
        // One relay of every partition, or any number of relays of owned
        // partitions, per sidecar: the others stand by.
        let exclusive = matches!(scope, RelayScope::All);
        let mut standing_by = false;
        while !sidecar.relay_lease(exclusive).await? {
            if !standing_by {
                info!(
                    "another relay of this sidecar is running ({}); standing by until it stops",
                    if exclusive {
                        "a `skein relay` / `skein run`, or appliers that relay their partitions"
                    } else {
                        "a relay of every partition"
                    }
                );
                standing_by = true;
            }
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                _ = cancel.cancelled() => {
                    info!("relay stopped while standing by");
                    return Ok(());
                }
            }
        }
        if standing_by {
            info!("relay lease taken; relaying");
        }
        let mut total = 0usize;
        loop {
            let n = relay_once(&mut sidecar, sink.as_mut(), limit, &scope).await?;
            total += n;
            if n > 0 {
                tracing::debug!(sent = n, "relayed");
                continue;
            }
            if cancel.is_cancelled() {
                break;
            }
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(50)) => {}
                _ = cancel.cancelled() => {}
            }
        }
        info!(sent = total, "relay stopped");
        Ok(())
    }
    .instrument(info_span!("relay"))
    .await
}
