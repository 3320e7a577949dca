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

pub mod admin;
pub mod error;
pub mod marker;
pub mod pgoutput;
pub mod postgres;
pub mod resolve;
pub mod sqlserver;

use std::future::Future;
use std::time::{Duration, Instant};

use skein_common::config::{Config, Source};
use skein_common::failpoint::failpoint;
use skein_common::{ChangeRecord, SourcePosition};
use skein_sql::Catalog;
use skein_transporter::{Batch, Transport};
use tokio_util::sync::CancellationToken;
use tracing::{info, info_span, Instrument};

pub use error::{Error, Result};
pub use marker::{Marker, MarkerStore, SledMarkerStore};
pub use postgres::PgSource;
pub use sqlserver::MssqlSource;

/// Where to start reading, decided against the source.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StartPoint {
    /// The position to read after.
    pub position: SourcePosition,
    /// Changes were skipped to get here.
    pub data_loss: bool,
}

/// How large and how late a batch may be.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchLimits {
    /// Close the batch at the first transaction boundary at or past this
    /// many changes (a larger single transaction is taken whole).
    pub max_changes: usize,
    /// Close it when the source has been quiet this long after something arrived.
    pub linger: Duration,
    /// Close it after this long in any case (an empty batch may still move
    /// the position past changes that concern no tracked table).
    pub max_wait: Duration,
}

/// One batch read and resolved: whole transactions in `(lower, upper]`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReadBatch {
    /// Inclusive upper bound; equal to `lower` when nothing happened.
    pub upper: Option<SourcePosition>,
    /// Transactions read.
    pub transactions: usize,
    /// Row changes read.
    pub changes: usize,
    /// Change records, in source order.
    pub records: Vec<ChangeRecord>,
}

/// A source of committed changes: PostgreSQL logical decoding or SQL Server
/// CDC.
///
/// Contract: `next_batch(lower)` returns every change of every transaction
/// that committed in `(lower, upper]`, whole transactions only, in commit
/// order, resolved to root keys; calling it again with the same `lower`
/// (after a crash) returns the same records for the transactions it
/// covers. `confirm(upper)` tells the source it may release what lies at
/// or before `upper`; it is called only after the marker holding `upper`
/// is durable, and may be a no-op.
pub trait ChangeSource {
    /// A name for logs (slot or database).
    fn label(&self) -> String;
    /// Checks the source against the stored marker and decides where to
    /// start; [`Error::DataLoss`] when the source lost changes after it
    /// (unless `continue_with_data_loss`). `floor`: with no marker, where
    /// the sidecar says the pipeline had already applied to — a state
    /// directory lost after the pipeline ran; a source that can no longer
    /// serve from there has lost changes too.
    fn prepare(
        &mut self,
        marker: Option<SourcePosition>,
        floor: Option<SourcePosition>,
        continue_with_data_loss: bool,
    ) -> impl Future<Output = Result<StartPoint>> + Send;
    /// Starts reading after `from`.
    fn start(&mut self, from: SourcePosition) -> impl Future<Output = Result<()>> + Send;
    /// The next batch after `lower`.
    fn next_batch(
        &mut self,
        lower: SourcePosition,
        limits: BatchLimits,
    ) -> impl Future<Output = Result<ReadBatch>> + Send;
    /// `upper` is durably handed over.
    fn confirm(&mut self, upper: SourcePosition);
}

/// The configured source, whichever the dialect.
pub enum AnySource {
    /// PostgreSQL logical decoding.
    Postgres(Box<PgSource>),
    /// SQL Server CDC.
    SqlServer(Box<MssqlSource>),
}

impl AnySource {
    /// Connects to the configured source and reads its catalog.
    pub async fn connect(cfg: &Config) -> Result<AnySource> {
        Ok(match &cfg.source {
            Source::Postgres(s) => AnySource::Postgres(Box::new(PgSource::connect(cfg, s).await?)),
            Source::SqlServer(s) => {
                AnySource::SqlServer(Box::new(MssqlSource::connect(cfg, s).await?))
            }
        })
    }

    /// The catalog read at connect time.
    pub fn catalog(&self) -> &Catalog {
        match self {
            AnySource::Postgres(s) => s.catalog(),
            AnySource::SqlServer(s) => s.catalog(),
        }
    }
}

impl ChangeSource for AnySource {
    fn label(&self) -> String {
        match self {
            AnySource::Postgres(s) => s.label(),
            AnySource::SqlServer(s) => s.label(),
        }
    }

    async fn prepare(
        &mut self,
        marker: Option<SourcePosition>,
        floor: Option<SourcePosition>,
        continue_with_data_loss: bool,
    ) -> Result<StartPoint> {
        match self {
            AnySource::Postgres(s) => s.prepare(marker, floor, continue_with_data_loss).await,
            AnySource::SqlServer(s) => s.prepare(marker, floor, continue_with_data_loss).await,
        }
    }

    async fn start(&mut self, from: SourcePosition) -> Result<()> {
        match self {
            AnySource::Postgres(s) => s.start(from).await,
            AnySource::SqlServer(s) => s.start(from).await,
        }
    }

    async fn next_batch(
        &mut self,
        lower: SourcePosition,
        limits: BatchLimits,
    ) -> Result<ReadBatch> {
        match self {
            AnySource::Postgres(s) => s.next_batch(lower, limits).await,
            AnySource::SqlServer(s) => s.next_batch(lower, limits).await,
        }
    }

    fn confirm(&mut self, upper: SourcePosition) {
        match self {
            AnySource::Postgres(s) => s.confirm(upper),
            AnySource::SqlServer(s) => s.confirm(upper),
        }
    }
}

/// Refuses to start when the config names tables or columns the source
/// lacks, then builds the resolution plans and their table index.
pub(crate) fn plans_for(
    cfg: &Config,
    catalog: &Catalog,
) -> Result<(Vec<resolve::EntityPlan>, resolve::TableIndex)> {
    let missing = skein_sql::postgres::check_catalog(cfg, catalog);
    if let Some(first) = missing.first() {
        return Err(Error::NotReady {
            message: first.to_string(),
            fix: format!("{}, then run `skein validate`", first.fix()),
        });
    }
    let plans: Vec<resolve::EntityPlan> = cfg
        .entities
        .iter()
        .map(|e| resolve::EntityPlan::new(&e.name, e.nodes(), catalog))
        .collect();
    let by_table = resolve::table_index(&plans);
    Ok((plans, by_table))
}

/// The stored marker in this source's dialect; a marker of the other
/// dialect (a state directory shared by two sources) is refused.
pub(crate) fn marker_in<T>(
    marker: Option<SourcePosition>,
    as_dialect: fn(SourcePosition) -> skein_common::Result<T>,
) -> Result<Option<T>> {
    marker
        .map(as_dialect)
        .transpose()
        .map_err(|e| Error::NotReady {
            message: format!("the marker in state_dir: {e}"),
            fix: "give this source its own state_dir".into(),
        })
}

/// Reads the catalog of the configured source (for appliers, which do not
/// read changes).
pub async fn load_catalog(cfg: &Config) -> Result<Catalog> {
    match &cfg.source {
        Source::Postgres(s) => {
            let client = postgres::connect(&s.url, "source").await?;
            postgres::load_catalog(&client, cfg).await
        }
        Source::SqlServer(s) => {
            let mut client = skein_sql::sqlserver::MssqlClient::connect(s.url.expose()).await?;
            sqlserver::load_catalog(&mut client, cfg).await
        }
    }
}

/// Runs the extractor until `cancel` fires or an error stops it. `floor`:
/// where the sidecar's progress says the pipeline had applied to (see
/// [`ChangeSource::prepare`]); consulted only when there is no marker.
pub async fn run<S: ChangeSource + Send, T: Transport + Sync>(
    cfg: &Config,
    source: &mut S,
    markers: &dyn MarkerStore,
    floor: Option<SourcePosition>,
    transport: &T,
    cancel: CancellationToken,
) -> Result<()> {
    let span = info_span!("extractor", source = %source.label());
    async move {
        let stored = markers.load()?;
        let start = source
            .prepare(
                stored.as_ref().map(|m| m.position),
                floor,
                cfg.extractor.continue_with_data_loss,
            )
            .await?;
        let has_data_loss = stored.as_ref().is_some_and(|m| m.has_data_loss) || start.data_loss;
        // A loss not yet carried to the sidecar: found now, or recorded in
        // the marker by a reset (or a start that crashed before sending).
        let mut pending_loss =
            start.data_loss || stored.as_ref().is_some_and(|m| m.loss_unreported);
        if stored.as_ref().map(|m| m.position) != Some(start.position) {
            let m = Marker {
                position: start.position,
                has_data_loss,
                updated_at: marker::now_stamp(),
                loss_unreported: pending_loss,
            };
            if start.data_loss {
                markers.reset(&m)?;
            } else {
                markers.store(&m)?;
            }
        }
        source.start(start.position).await?;
        info!(position = %start.position, data_loss = start.data_loss, "extractor started");
        let mut lower = start.position;
        let mut seq = 0u64;
        let limits = BatchLimits {
            max_changes: cfg.extractor.max_batch_changes,
            linger: Duration::from_millis(cfg.extractor.batch_linger_ms),
            max_wait: Duration::from_millis(cfg.extractor.max_batch_wait_ms),
        };
        while !cancel.is_cancelled() {
            let batch = tokio::select! {
                b = source.next_batch(lower, limits) => b?,
                _ = cancel.cancelled() => break,
            };
            // Hand-over time: transport acknowledgement plus marker write.
            let t0 = Instant::now();
            let Some(upper) = batch.upper.filter(|u| *u > lower) else {
                continue;
            };
            let record_count = batch.records.len();
            if !batch.records.is_empty() || pending_loss {
                seq += 1;
                transport
                    .send(Batch {
                        seq,
                        lower,
                        upper,
                        has_data_loss: pending_loss,
                        records: batch.records,
                    })
                    .await?;
            }
            failpoint("extractor.after_ack_before_marker");
            // Whatever loss was pending went with this batch (a batch is
            // sent whenever one is pending), acknowledged.
            markers.store(&Marker {
                position: upper,
                has_data_loss,
                updated_at: marker::now_stamp(),
                loss_unreported: false,
            })?;
            source.confirm(upper);
            pending_loss = false;
            if batch.transactions > 0 {
                info!(
                    batch = seq,
                    lower = %lower,
                    upper = %upper,
                    transactions = batch.transactions,
                    changes = batch.changes,
                    records = record_count,
                    ms = t0.elapsed().as_millis() as u64,
                    "batch acknowledged"
                );
            }
            lower = upper;
        }
        info!(position = %lower, "extractor stopped");
        Ok(())
    }
    .instrument(span)
    .await
}
