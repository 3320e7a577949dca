//! # skein-extractor
//!
//! Reads the source's change stream in `(lower, upper]` batches of whole
//! transactions, resolves every change to the root key(s) of its
//! aggregate(s), hands the records to the transporter and — only after the
//! transporter acknowledged them — persists `upper` as its marker, then tells
//! the source (the replication slot) it may release what lies before it.
//!
//! A crash re-sends at most the batch in flight; appliers drop what they
//! already committed by position. One extractor runs per source: the state
//! directory is locked while it runs.

pub mod error;
pub mod marker;
pub mod pgoutput;
pub mod postgres;
pub mod resolve;
pub mod sqlserver;

use std::time::{Duration, Instant};

use skein_common::config::Config;
use skein_common::failpoint::failpoint;
use skein_common::PgLsn;
use skein_transporter::{Batch, Transport};
use tokio_util::sync::CancellationToken;
use tracing::{info, info_span, Instrument};

pub use error::{Error, Result};
pub use marker::{Marker, MarkerStore, SledMarkerStore};
pub use postgres::PgSource;

/// Runs the extractor until `cancel` fires or an error stops it.
pub async fn run<T: Transport + Sync>(
    cfg: &Config,
    source: &mut PgSource,
    markers: &dyn MarkerStore,
    transport: &T,
    cancel: CancellationToken,
) -> Result<()> {
    let span = info_span!("extractor", source = %cfg.source.slot);
    async move {
        let stored = markers.load()?;
        let start = source
            .prepare(
                stored.as_ref().map(|m| m.position),
                cfg.extractor.continue_with_data_loss,
            )
            .await?;
        let has_data_loss = stored.as_ref().is_some_and(|m| m.has_data_loss) || start.data_loss;
        let mut pending_loss = start.data_loss;
        if stored.as_ref().map(|m| m.position) != Some(start.position) {
            let m = Marker {
                position: start.position,
                has_data_loss,
                updated_at: marker::now_stamp(),
            };
            if start.data_loss {
                markers.reset(&m)?;
            } else {
                markers.store(&m)?;
            }
        }
        source.start_stream(start.position).await?;
        info!(position = %start.position, data_loss = start.data_loss, "extractor started");
        let mut lower: PgLsn = start.position;
        let mut seq = 0u64;
        let linger = Duration::from_millis(cfg.extractor.batch_linger_ms);
        let max_wait = Duration::from_millis(cfg.extractor.max_batch_wait_ms);
        while !cancel.is_cancelled() {
            let batch = tokio::select! {
                b = source.next_batch(lower, cfg.extractor.max_batch_changes, linger, max_wait) => b?,
                _ = cancel.cancelled() => break,
            };
            if batch.upper <= lower {
                continue;
            }
            let t0 = Instant::now();
            let records = source.resolve(&batch).await?;
            let record_count = records.len();
            if !records.is_empty() || pending_loss {
                seq += 1;
                transport
                    .send(Batch {
                        seq,
                        lower,
                        upper: batch.upper,
                        has_data_loss: pending_loss,
                        records,
                    })
                    .await?;
            }
            failpoint("extractor.after_ack_before_marker");
            markers.store(&Marker {
                position: batch.upper,
                has_data_loss,
                updated_at: marker::now_stamp(),
            })?;
            source.confirm(batch.upper);
            pending_loss = false;
            if !batch.txs.is_empty() {
                info!(
                    batch = seq,
                    lower = %lower,
                    upper = %batch.upper,
                    transactions = batch.txs.len(),
                    changes = batch.change_count(),
                    records = record_count,
                    ms = t0.elapsed().as_millis() as u64,
                    "batch acknowledged"
                );
            }
            lower = batch.upper;
        }
        info!(position = %lower, "extractor stopped");
        Ok(())
    }
    .instrument(span)
    .await
}
