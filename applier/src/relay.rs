//! The relay: outbox → sink, at least once with a stable event id.
//!
//! It knows no dialect: claiming, sending and marking rows is one
//! [`Sidecar::relay_once`] transaction; this module decides only which
//! partitions to take and when to poll.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use skein_common::metrics as m;
use tokio_util::sync::CancellationToken;
use tracing::{info, info_span, warn, Instrument};

use crate::error::{Error, Result};
use crate::sidecar::Sidecar;
use crate::sink::Sink;

/// Wakes this process's idle relay when an applier of the process has
/// committed outbox rows, so they go out at once instead of after up to
/// `sink.relay_poll_ms`. A wake-up that finds the relay busy is kept for its
/// next idle wait (one at most), so none is lost between its last look and
/// its wait. A relay of another process (`skein relay`) still polls.
#[derive(Clone, Debug, Default)]
pub struct RelayWake(Arc<tokio::sync::Notify>);

impl RelayWake {
    /// Says that outbox rows were committed.
    pub fn outbox_written(&self) {
        self.0.notify_one();
    }

    async fn wait(&self) {
        self.0.notified().await
    }
}

/// Which outbox rows a relay takes.
#[derive(Clone, Debug, Default)]
pub enum RelayScope {
    /// Every partition: it takes the sidecar's relay lease exclusively, so
    /// it relays alone.
    #[default]
    All,
    /// Only the partitions this process owns (`skein apply`). Their relay
    /// cursors are locked for a round, so a relay that takes a partition
    /// over waits for the previous owner's send to finish and keeps
    /// per-aggregate order.
    Partitions(Arc<Mutex<Vec<i32>>>),
}

/// Sends at most `limit` pending outbox rows of `scope` in id order and
/// moves the relay's cursors past them in the same transaction, after the
/// sink has them
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

/// How long a stopping relay goes on sending what is pending: a stop with
/// a large backlog of sends ends in time (the process exits 15 s after
/// the signal at the latest), and the rest is sent at the next start.
const STOP_DRAIN: Duration = Duration::from_secs(5);

/// How often a running relay refreshes its reported state.
const HEARTBEAT: Duration = Duration::from_secs(10);

/// How often an idle relay purges relayed outbox rows past their retention.
const PURGE_EVERY: Duration = Duration::from_secs(60);

/// Rows per purge transaction.
const PURGE_CHUNK: i64 = 10_000;

/// A relay's tuning, from the config.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RelaySettings {
    /// Outbox rows per relay transaction (`sink.relay_batch`).
    pub batch: i64,
    /// How long an idle relay waits before it looks again (`sink.relay_poll_ms`).
    pub poll: Duration,
    /// How long relayed rows are kept (`sidecar.outbox_retention_secs`).
    pub retention: Duration,
}

impl RelaySettings {
    /// The configured settings.
    pub fn from_config(cfg: &skein_common::config::Config) -> RelaySettings {
        RelaySettings {
            batch: cfg.relay_batch,
            poll: Duration::from_millis(cfg.relay_poll_ms),
            retention: Duration::from_secs(cfg.sidecar.outbox_retention_secs),
        }
    }
}

/// Deletes relayed outbox rows past `retention`, a chunk per transaction,
/// until none is left or `cancel` fires; returns how many.
pub async fn purge<S: Sidecar>(
    sidecar: &mut S,
    retention: Duration,
    cancel: &CancellationToken,
) -> Result<u64> {
    let secs = i64::try_from(retention.as_secs()).unwrap_or(i64::MAX);
    let mut total = 0;
    loop {
        let n = sidecar.purge_outbox(secs, PURGE_CHUNK).await?;
        total += n;
        if n < PURGE_CHUNK as u64 || cancel.is_cancelled() {
            return Ok(total);
        }
    }
}

/// First and longest wait between attempts after a transient failure.
const BACKOFF: (Duration, Duration) = (Duration::from_millis(200), Duration::from_secs(30));

/// Whether a relay failure may pass by itself: the sink is away (a broker
/// outage, a full disk). A rejected event (`sink.on_reject: stop`), bad
/// data or a lost sidecar connection stops the relay, and the process.
pub fn is_transient(e: &Error) -> bool {
    matches!(e, Error::Sink { .. })
}

/// Relays until cancelled, then drains what is pending for at most
/// [`STOP_DRAIN`]. A
/// transient failure is retried with exponential backoff (the rows stay
/// pending and keep their order); any other stops the relay with the
/// error. Its state and last error are reported to the sidecar under
/// `name` (`skein status`); the report is best effort. An idle relay looks
/// again after `settings.poll`, or as soon as `wake` says rows were written.
/// A relay its appliers wake goes idle after a round that was not full; one
/// nobody wakes (`None`: a `skein relay`) looks again at once after every
/// round that sent rows, or rows committed during a round would wait for
/// the next poll.
pub async fn run_relay<S: Sidecar + Send>(
    mut sidecar: S,
    mut sink: Box<dyn Sink>,
    settings: RelaySettings,
    scope: RelayScope,
    name: String,
    wake: Option<RelayWake>,
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
                // A relay of every partition shares its name with the one
                // it waits for: only the lease holder reports under it.
                if !exclusive {
                    report(&mut sidecar, &name, "standing by", None).await;
                }
                standing_by = true;
            }
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                _ = cancel.cancelled() => {
                    info!("relay stopped while standing by");
                    if !exclusive {
                        report(&mut sidecar, &name, "stopped", None).await;
                    }
                    return Ok(());
                }
            }
        }
        if standing_by {
            info!("relay lease taken; relaying");
        }
        report(&mut sidecar, &name, "running", None).await;
        let mut reported = Instant::now();
        let mut purged: Option<Instant> = None;
        let mut total = 0usize;
        let mut backoff = BACKOFF.0;
        let mut failures = 0u32;
        let mut stop_seen: Option<Instant> = None;
        loop {
            let started = Instant::now();
            let n = match relay_once(&mut sidecar, sink.as_mut(), settings.batch, &scope).await {
                Ok(n) => {
                    metrics::counter!(m::RELAY_SENT).increment(n as u64);
                    n
                }
                Err(e) if is_transient(&e) => {
                    metrics::counter!(m::RELAY_FAILURES).increment(1);
                    failures += 1;
                    warn!(error = %e, attempt = failures, retry_in = ?backoff, "relay failed; retrying (the rows stay pending, in order)");
                    report(&mut sidecar, &name, "retrying", Some(&e.to_string())).await;
                    tokio::select! {
                        _ = tokio::time::sleep(backoff) => {}
                        _ = cancel.cancelled() => {
                            warn!(error = %e, "relay stopped while retrying; the pending rows are sent at the next start");
                            report(&mut sidecar, &name, "stopped", None).await;
                            return Ok(());
                        }
                    }
                    backoff = (backoff * 2).min(BACKOFF.1);
                    continue;
                }
                Err(e) => {
                    metrics::counter!(m::RELAY_FAILURES).increment(1);
                    report(&mut sidecar, &name, "stopped", Some(&e.to_string())).await;
                    return Err(e);
                }
            };
            if failures > 0 {
                info!(attempts = failures + 1, "relay recovered");
                report(&mut sidecar, &name, "running", None).await;
                (failures, backoff) = (0, BACKOFF.0);
            }
            total += n;
            // Stopping: what is pending goes out for at most STOP_DRAIN,
            // then the rest waits for the next start (it stays pending).
            let draining = cancel.is_cancelled();
            if draining {
                stop_seen.get_or_insert_with(Instant::now);
            }
            let drained_enough = stop_seen.is_some_and(|t| t.elapsed() > STOP_DRAIN);
            // Only a full round may have left rows behind. One that took
            // fewer took every pending row it could see, so a woken relay
            // goes idle rather than look again at once, which finds nothing
            // unless more were committed meanwhile: those wake it. A relay
            // nobody wakes, and a stopping one (for rows its appliers
            // commit as they stop), look until a round finds nothing.
            let more = if draining || wake.is_none() {
                n > 0
            } else {
                n as i64 >= settings.batch
            };
            if n > 0 {
                tracing::debug!(sent = n, ms = started.elapsed().as_millis() as u64, "relayed");
            }
            if more && !drained_enough {
                continue;
            }
            if draining {
                break;
            }
            // A heartbeat: `updated_at` tells a live relay from one that was
            // killed without reporting.
            if reported.elapsed() > HEARTBEAT {
                report(&mut sidecar, &name, "running", None).await;
                reported = Instant::now();
            }
            // Idle: relayed rows past their retention go, in chunks. A
            // failure is said and tried again at the next purge.
            if purged.is_none_or(|t| t.elapsed() > PURGE_EVERY) {
                purged = Some(Instant::now());
                match purge(&mut sidecar, settings.retention, &cancel).await {
                    Ok(0) => {}
                    Ok(n) => info!(deleted = n, retention_s = settings.retention.as_secs(), "relayed outbox rows past their retention deleted"),
                    Err(e) => warn!(error = %e, "purging relayed outbox rows failed; trying again later"),
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(settings.poll) => {}
                _ = async {
                    match &wake {
                        Some(w) => w.wait().await,
                        None => std::future::pending().await,
                    }
                } => {}
                _ = cancel.cancelled() => {}
            }
        }
        info!(sent = total, "relay stopped");
        report(&mut sidecar, &name, "stopped", None).await;
        Ok(())
    }
    .instrument(info_span!("relay"))
    .await
}

/// Best effort: a relay that cannot report its state still relays.
async fn report<S: Sidecar>(sidecar: &mut S, name: &str, state: &str, error: Option<&str>) {
    if let Err(e) = sidecar.relay_report(name, state, error).await {
        warn!(error = %e, state, "could not record the relay's state in the sidecar");
    }
}
