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
pub mod spill;
pub mod sqlserver;

use std::future::Future;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use skein_common::config::{Config, Source};
use skein_common::failpoint::failpoint;
use skein_common::metrics as m;
use skein_common::{ChangeRecord, SourcePosition};
use skein_sql::Catalog;
use skein_transporter::{Ack, Batch, Error as TransportError, Transport};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tracing::{info, info_span, warn, Instrument};

pub use error::{Error, Result};
pub use marker::{InFlight, Marker, MarkerStore, SledMarkerStore};
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
    /// many changes. A larger transaction is handed over in parts of this
    /// many changes, each a batch of its own ([`ReadBatch::in_flight`]):
    /// memory holds one part, whatever the transaction's size.
    pub max_changes: usize,
    /// Close it when the source has been quiet this long after something arrived.
    pub linger: Duration,
    /// Close it after this long in any case (an empty batch may still move
    /// the position past changes that concern no tracked table).
    pub max_wait: Duration,
}

/// One batch read and resolved: whole transactions in `(lower, upper]`,
/// or one part of a transaction too large for one batch.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReadBatch {
    /// Inclusive upper bound; equal to `lower` when nothing happened.
    /// For a part of a large transaction, the transaction's end.
    pub upper: Option<SourcePosition>,
    /// A part of a large transaction that is not its last: how much of it
    /// is handed over with this batch. The marker keeps its position and
    /// records this; the transaction's last part has `None`.
    pub in_flight: Option<InFlight>,
    /// Transactions read.
    pub transactions: usize,
    /// Row changes read.
    pub changes: usize,
    /// Change records, in source order.
    pub records: Vec<ChangeRecord>,
    /// More was ready when the batch closed: a backlog is being read.
    /// PostgreSQL: the read reached `max_changes`, or a large transaction
    /// follows or is being handed over in parts. SQL Server: the window
    /// stopped short of the highest LSN CDC holds, or a part. `false` when
    /// it closed because nothing more was ready.
    pub more: bool,
}

/// A source of committed changes: PostgreSQL logical decoding or SQL Server
/// CDC.
///
/// Contract: `next_batch(lower)` returns every change of every transaction
/// that committed in `(lower, upper]`, in commit order, resolved to root
/// keys; calling it again with the same `lower` (after a crash) returns the
/// same records for the transactions it covers. A transaction of more than
/// `max_changes` changes comes in parts, one per batch, its records'
/// positions increasing across them; every part but the last says how far
/// it got ([`ReadBatch::in_flight`]), and `start` with that skips what was
/// handed over. `confirm(upper)` tells the source it may release what lies at
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
    /// Starts reading after `from`, skipping what `in_flight` says was
    /// handed over of the transaction after it.
    fn start(
        &mut self,
        from: SourcePosition,
        in_flight: Option<InFlight>,
    ) -> impl Future<Output = Result<()>> + Send;
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

    async fn start(&mut self, from: SourcePosition, in_flight: Option<InFlight>) -> Result<()> {
        match self {
            AnySource::Postgres(s) => s.start(from, in_flight).await,
            AnySource::SqlServer(s) => s.start(from, in_flight).await,
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
        let pending_loss = start.data_loss || stored.as_ref().is_some_and(|m| m.loss_unreported);
        // What was handed over of a transaction in flight holds only
        // while the marker's position does.
        let in_flight = stored
            .as_ref()
            .filter(|m| m.position == start.position)
            .and_then(|m| m.in_flight);
        if stored.as_ref().map(|m| m.position) != Some(start.position) {
            let m = Marker {
                position: start.position,
                has_data_loss,
                updated_at: marker::now_stamp(),
                loss_unreported: pending_loss,
                in_flight: None,
            };
            if start.data_loss {
                markers.reset(&m)?;
            } else {
                markers.store(&m)?;
            }
        }
        source.start(start.position, in_flight).await?;
        match &in_flight {
            None => {
                info!(position = %start.position, data_loss = start.data_loss, "extractor started")
            }
            Some(f) => info!(position = %start.position, data_loss = start.data_loss,
                in_flight_end = %f.end, in_flight_changes = f.changes,
                "extractor started; {}", f.resumption()),
        }
        let limits = BatchLimits {
            max_changes: cfg.extractor.max_batch_changes,
            linger: Duration::from_millis(cfg.extractor.batch_linger_ms),
            max_wait: Duration::from_millis(cfg.extractor.max_batch_wait_ms),
        };
        let lower = pipeline(
            source,
            start.position,
            limits,
            pending_loss,
            has_data_loss,
            transport,
            markers,
            cfg.extractor.max_batches_in_flight,
            &cancel,
        )
        .await?;
        info!(position = %lower, "extractor stopped");
        Ok(())
    }
    .instrument(span)
    .await
}

/// How long a batch's acknowledgement is awaited before the extractor says
/// it is still waiting (and again after as long).
const ACK_WAIT_WARN: Duration = Duration::from_secs(30);

/// How long the acknowledgements in flight are still awaited after the
/// reader failed: an acknowledger's error (an applier gone) is the better
/// cause when there is one.
const READER_FAILED_GRACE: Duration = Duration::from_secs(5);

/// Pipelined batches: the reader reads and resolves the next batch while
/// the transport works on the ones before it, at most `window` of them; the
/// acknowledger stores the marker and frees the slot strictly in the order
/// the batches were read. A crash re-sends what was in flight, which the
/// appliers drop by position. Returns the last position made durable.
#[allow(clippy::too_many_arguments)]
async fn pipeline<S: ChangeSource + Send, T: Transport + Sync>(
    source: &mut S,
    from: SourcePosition,
    limits: BatchLimits,
    pending_loss: bool,
    has_data_loss: bool,
    transport: &T,
    markers: &dyn MarkerStore,
    window: usize,
    cancel: &CancellationToken,
) -> Result<SourcePosition> {
    let window = Semaphore::new(window.min(transport.max_in_flight()).max(1));
    // Fired by the signal, or by the acknowledger's failure: the reader
    // stops at once, even inside a read (a large transaction may take
    // minutes to arrive) and never hands over a batch after a failed one.
    let stop = cancel.child_token();
    let (queue, acks) = tokio::sync::mpsc::unbounded_channel::<Sent<'_>>();
    // The newest position the acknowledger made durable, for the reader to
    // confirm to the source before its next read.
    let durable: Mutex<Option<SourcePosition>> = Mutex::new(None);
    let reader = read_batches(
        source,
        from,
        limits,
        pending_loss,
        has_data_loss,
        transport,
        &window,
        queue,
        &durable,
        &stop,
    );
    // A reader that failed (the source lost, a marker error) does not wait
    // for acknowledgements without end (a broker away): after
    // READER_FAILED_GRACE its error is the cause, and the batches still in
    // flight are sent again at the next start.
    let reader_failed = CancellationToken::new();
    let reader = async {
        let r = reader.await;
        if r.is_err() {
            reader_failed.cancel();
        }
        r
    };
    let (read, acked) = tokio::join!(reader, async {
        let r = tokio::select! {
            r = acknowledge(markers, acks, &durable, cancel) => r,
            _ = async {
                reader_failed.cancelled().await;
                tokio::time::sleep(READER_FAILED_GRACE).await;
            } => Ok(None),
        };
        if r.is_err() {
            stop.cancel();
        }
        r
    });
    // The acknowledger's error is the cause when both failed (a reader
    // whose hand-over found the applier gone).
    let last = acked?.unwrap_or(from);
    read?;
    if let Some(p) = durable.lock().expect("durable position").take() {
        source.confirm(p);
    }
    Ok(last)
}

/// A batch read and handed over, waiting for its acknowledgement.
struct Sent<'w> {
    seq: u64,
    lower: SourcePosition,
    upper: SourcePosition,
    /// The marker to store once acknowledged.
    marker: Marker,
    transactions: usize,
    changes: usize,
    records: usize,
    newest_commit: Option<i64>,
    /// The batch carried the pending data loss.
    sent_loss: bool,
    /// `None` when nothing was sent (untracked transactions only): the
    /// marker still moves, in order.
    ack: Option<Ack>,
    /// When the hand-over began.
    t0: Instant,
    /// Its place in the window, freed once the marker is stored.
    _slot: tokio::sync::SemaphorePermit<'w>,
}

/// Reads, resolves and hands over batches while a slot of the window is
/// free, queueing each for [`acknowledge`]. Ends on an error or on
/// `cancel` (the signal, or the acknowledger's failure), also inside a read;
/// a batch read when it fires is not handed over.
#[allow(clippy::too_many_arguments)]
async fn read_batches<'w, S: ChangeSource + Send, T: Transport + Sync>(
    source: &mut S,
    from: SourcePosition,
    limits: BatchLimits,
    mut pending_loss: bool,
    has_data_loss: bool,
    transport: &T,
    window: &'w Semaphore,
    queue: tokio::sync::mpsc::UnboundedSender<Sent<'w>>,
    durable: &Mutex<Option<SourcePosition>>,
    cancel: &CancellationToken,
) -> Result<()> {
    let mut lower = from;
    let mut seq = 0u64;
    let capacity = window.available_permits();
    // Whether more was ready when the last batch closed: a backlog.
    let mut backlog = true;
    while !cancel.is_cancelled() {
        if !backlog && transport.acknowledges_applied() {
            // Live traffic: the last batch closed because nothing more was
            // ready. A batch read now would only queue behind the ones in
            // flight, and what arrives meanwhile behind it, so the next is
            // read once they are all applied and takes all of that in. A
            // backlog keeps the window full, for throughput.
            let drained = tokio::select! {
                d = window.acquire_many(capacity as u32) => d.expect("the window is never closed"),
                _ = cancel.cancelled() => break,
            };
            drop(drained);
        }
        let slot = tokio::select! {
            s = window.acquire() => s.expect("the window is never closed"),
            _ = cancel.cancelled() => break,
        };
        if let Some(p) = durable.lock().expect("durable position").take() {
            source.confirm(p);
        }
        let batch = tokio::select! {
            b = source.next_batch(lower, limits) => b?,
            _ = cancel.cancelled() => break,
        };
        let t0 = Instant::now();
        backlog = batch.more;
        let Some(upper) = batch.upper.filter(|u| *u > lower) else {
            // A wait that found nothing new, and nothing is in flight (only
            // this read's slot is taken): caught up. Otherwise the
            // acknowledger sets the lag of what it acknowledges.
            if window.available_permits() + 1 >= capacity {
                metrics::gauge!(m::SOURCE_LAG).set(0.0);
            }
            continue;
        };
        let record_count = batch.records.len();
        let newest_commit = batch.records.iter().map(|r| r.commit_time_micros).max();
        let sent_loss = pending_loss;
        // A part of a transaction in flight completes nothing past
        // `lower`: the marker, the slot and the batch's upper bound stay.
        let done = if batch.in_flight.is_some() {
            lower
        } else {
            upper
        };
        if cancel.is_cancelled() {
            // Read, not handed over: the next start reads it again.
            break;
        }
        let ack = if !batch.records.is_empty() || pending_loss {
            seq += 1;
            let ack = transport
                .submit(Batch {
                    seq,
                    lower,
                    upper: done,
                    has_data_loss: pending_loss,
                    records: batch.records,
                })
                .await?;
            Some(ack)
        } else {
            None
        };
        // Whatever loss was pending went with this batch (a batch is sent
        // whenever one is pending); the marker clears it once acknowledged.
        pending_loss = false;
        let sent = Sent {
            seq,
            lower,
            upper,
            marker: Marker {
                position: done,
                has_data_loss,
                updated_at: String::new(),
                loss_unreported: false,
                in_flight: batch.in_flight,
            },
            transactions: batch.transactions,
            changes: batch.changes,
            records: record_count,
            newest_commit,
            sent_loss,
            ack,
            t0,
            _slot: slot,
        };
        if queue.send(sent).is_err() {
            // The acknowledger is gone: it says why.
            break;
        }
        lower = done;
    }
    Ok(())
}

/// Waits for each queued batch's acknowledgement in the order they were
/// read, then stores its marker: the marker never runs ahead of a batch
/// not acknowledged. Returns the last position stored.
async fn acknowledge(
    markers: &dyn MarkerStore,
    mut acks: tokio::sync::mpsc::UnboundedReceiver<Sent<'_>>,
    durable: &Mutex<Option<SourcePosition>>,
    signal: &CancellationToken,
) -> Result<Option<SourcePosition>> {
    let mut last = None;
    while let Some(sent) = acks.recv().await {
        let Sent {
            seq,
            lower,
            upper,
            mut marker,
            transactions,
            changes,
            records,
            newest_commit,
            sent_loss,
            ack,
            t0,
            _slot,
        } = sent;
        if let Some(mut ack) = ack {
            // A broker away keeps records waiting (they never time out
            // over Kafka): said every ACK_WAIT_WARN, not silently.
            let waiting = Instant::now();
            loop {
                tokio::select! {
                    r = &mut ack => match r {
                        Ok(()) => break,
                        // After the signal, an applier may stop inside a
                        // batch (between the pages of a TRUNCATE re-check):
                        // that batch and the ones after it are not applied,
                        // and the next start sends them again. The applier
                        // reports a real failure of its own.
                        Err(e @ (TransportError::ApplierFailed { .. }
                        | TransportError::Disconnected { .. }))
                            if signal.is_cancelled() =>
                        {
                            info!(batch = seq, reason = %e,
                                "batch not applied before the stop; the next start sends it again");
                            return Ok(last);
                        }
                        Err(e) => return Err(e.into()),
                    },
                    _ = tokio::time::sleep(ACK_WAIT_WARN) => warn!(
                        batch = seq,
                        waiting_s = waiting.elapsed().as_secs(),
                        "the transport has not acknowledged this batch yet (a broker away?); waiting"
                    ),
                }
            }
            // Only a batch the transport acknowledged has a window between
            // its ack and the marker (a batch of untracked transactions
            // sends nothing).
            failpoint("extractor.after_ack_before_marker");
        }
        if marker.in_flight.is_some() {
            failpoint("extractor.after_part_ack_before_marker");
        }
        marker.updated_at = marker::now_stamp();
        markers.store(&marker)?;
        last = Some(marker.position);
        if let Some(f) = marker.in_flight {
            info!(batch = seq, end = %f.end, handed_over = f.changes, records,
                "part of a large transaction acknowledged");
            failpoint("extractor.after_part_marker");
        } else {
            *durable.lock().expect("durable position") = Some(marker.position);
        }
        metrics::counter!(m::SOURCE_CHANGES).increment(changes as u64);
        metrics::counter!(m::SOURCE_TRANSACTIONS).increment(transactions as u64);
        if records > 0 || sent_loss {
            metrics::counter!(m::EXTRACTOR_BATCHES).increment(1);
            metrics::counter!(m::EXTRACTOR_RECORDS).increment(records as u64);
            metrics::histogram!(m::EXTRACTOR_HANDOVER).record(t0.elapsed().as_secs_f64());
        }
        if sent_loss {
            metrics::counter!(m::DATA_LOSS).increment(1);
        }
        match newest_commit {
            Some(c) => metrics::gauge!(m::SOURCE_LAG).set(m::seconds_since(c)),
            // Read up to here and nothing tracked in it: caught up.
            None if marker.in_flight.is_none() => metrics::gauge!(m::SOURCE_LAG).set(0.0),
            None => {}
        }
        if transactions > 0 {
            info!(
                batch = seq,
                lower = %lower,
                upper = %upper,
                transactions,
                changes,
                records,
                ms = t0.elapsed().as_millis() as u64,
                "batch acknowledged"
            );
        }
    }
    Ok(last)
}

#[cfg(test)]
mod tests {
    //! The pipelining logic against a scripted source and transport (pure
    //! logic; the real sources and transports are covered by the
    //! integration suites).
    use std::sync::Arc;

    use skein_common::{ChangePosition, Op, PgLsn, RootKey};
    use tokio::sync::oneshot;

    use super::*;

    fn pos(n: u64) -> SourcePosition {
        SourcePosition::Pg(PgLsn(n))
    }

    /// One transaction of one record per batch, positions 1, 2, 3, …;
    /// from `stall_at` on, a read never ends (a long transaction arriving).
    #[derive(Default)]
    struct Scripted {
        confirmed: Vec<SourcePosition>,
        stall_at: Option<u64>,
        /// From here on, a read fails (the source lost).
        fail_at: Option<u64>,
        /// Below here, a batch closes with more ready (a backlog).
        full_below: Option<u64>,
    }

    impl ChangeSource for Scripted {
        fn label(&self) -> String {
            "scripted".into()
        }
        async fn prepare(
            &mut self,
            _: Option<SourcePosition>,
            _: Option<SourcePosition>,
            _: bool,
        ) -> Result<StartPoint> {
            unreachable!()
        }
        async fn start(&mut self, _: SourcePosition, _: Option<InFlight>) -> Result<()> {
            Ok(())
        }
        async fn next_batch(&mut self, lower: SourcePosition, _: BatchLimits) -> Result<ReadBatch> {
            let SourcePosition::Pg(PgLsn(l)) = lower else {
                unreachable!()
            };
            if self.stall_at.is_some_and(|s| l >= s) {
                std::future::pending::<()>().await;
            }
            if self.fail_at.is_some_and(|s| l >= s) {
                return Err(Error::Decode("the source connection was lost".into()));
            }
            let upper = pos(l + 1);
            Ok(ReadBatch {
                upper: Some(upper),
                in_flight: None,
                transactions: 1,
                changes: 1,
                more: self.full_below.is_some_and(|f| l < f),
                records: vec![ChangeRecord {
                    entity: "customer".into(),
                    root_key: RootKey(vec![Some(format!("{}", l + 1))]),
                    table: "public.customer".into(),
                    op: Op::Update,
                    position: ChangePosition {
                        commit: upper,
                        seq: 0,
                    },
                    tx_id: l + 1,
                    commit_time_micros: 0,
                }],
            })
        }
        fn confirm(&mut self, upper: SourcePosition) {
            self.confirmed.push(upper);
        }
    }

    /// Keeps every submitted batch's ack for the test to complete.
    #[derive(Clone, Default)]
    struct Held {
        acks: Arc<Mutex<Vec<(u64, Option<oneshot::Sender<Result<()>>>)>>>,
        /// The transport's own bound on batches in flight (none when 0).
        cap: usize,
        /// [`Transport::acknowledges_applied`].
        applied: bool,
    }

    impl Held {
        fn submitted(&self) -> Vec<u64> {
            self.acks.lock().unwrap().iter().map(|(s, _)| *s).collect()
        }
        /// Waits until `n` batches were submitted, then a moment more, and
        /// checks that the reader stopped there.
        async fn stops_at(&self, n: u64) {
            until(&format!("{n} batches submitted"), || {
                self.submitted().len() as u64 == n
            })
            .await;
            tokio::time::sleep(Duration::from_millis(50)).await;
            assert_eq!(
                self.submitted(),
                (1..=n).collect::<Vec<_>>(),
                "read past {n}"
            );
        }
        fn ack(&self, seq: u64, outcome: Result<()>) {
            let mut acks = self.acks.lock().unwrap();
            let (_, tx) = acks.iter_mut().find(|(s, _)| *s == seq).unwrap();
            let _ = tx.take().unwrap().send(outcome);
        }
    }

    impl Transport for Held {
        fn acknowledges_applied(&self) -> bool {
            self.applied
        }
        fn max_in_flight(&self) -> usize {
            if self.cap == 0 {
                usize::MAX
            } else {
                self.cap
            }
        }
        async fn submit(&self, batch: Batch) -> skein_transporter::Result<Ack> {
            let (tx, rx) = oneshot::channel();
            self.acks.lock().unwrap().push((batch.seq, Some(tx)));
            Ok(Box::pin(async move {
                rx.await
                    .unwrap()
                    .map_err(|e| skein_transporter::Error::ApplierFailed {
                        partition: 0,
                        message: e.to_string(),
                    })
            }))
        }
    }

    #[derive(Default)]
    struct Markers(Mutex<Vec<SourcePosition>>);

    impl MarkerStore for Markers {
        fn load(&self) -> Result<Option<Marker>> {
            Ok(None)
        }
        fn store(&self, m: &Marker) -> Result<()> {
            self.0.lock().unwrap().push(m.position);
            Ok(())
        }
        fn reset(&self, m: &Marker) -> Result<()> {
            self.store(m)
        }
    }

    const LIMITS: BatchLimits = BatchLimits {
        max_changes: 10,
        linger: Duration::ZERO,
        max_wait: Duration::from_millis(10),
    };

    async fn until(what: &str, f: impl Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(5);
        while !f() {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// The pipeline from position 0, no loss pending.
    async fn from_zero(
        source: &mut Scripted,
        transport: &Held,
        markers: &Markers,
        window: usize,
        cancel: &CancellationToken,
    ) -> Result<SourcePosition> {
        let limits = LIMITS;
        pipeline(
            source,
            pos(0),
            limits,
            false,
            false,
            transport,
            markers,
            window,
            cancel,
        )
        .await
    }

    #[tokio::test]
    async fn batches_are_read_ahead_within_the_window_and_marked_in_order() {
        let transport = Held::default();
        let markers = Markers::default();
        let cancel = CancellationToken::new();
        let mut source = Scripted::default();
        let run = from_zero(&mut source, &transport, &markers, 3, &cancel);
        let drive = async {
            // Three read ahead, no more, and nothing is marked unacknowledged.
            transport.stops_at(3).await;
            assert!(markers.0.lock().unwrap().is_empty());
            // A later ack first: the marker waits for the earlier batch.
            transport.ack(2, Ok(()));
            tokio::time::sleep(Duration::from_millis(50)).await;
            assert!(markers.0.lock().unwrap().is_empty());
            assert_eq!(transport.submitted().len(), 3, "a slot freed out of order");
            transport.ack(1, Ok(()));
            until("batches 1 and 2 marked", || {
                markers.0.lock().unwrap().len() == 2
            })
            .await;
            assert_eq!(*markers.0.lock().unwrap(), vec![pos(1), pos(2)]);
            until("two more read", || transport.submitted().len() == 5).await;
            // Stopping drains what is in flight.
            cancel.cancel();
            for s in 3..=5 {
                transport.ack(s, Ok(()));
            }
        };
        let (last, ()) = tokio::join!(run, drive);
        assert_eq!(last.unwrap(), pos(5));
        assert_eq!(
            *markers.0.lock().unwrap(),
            vec![pos(1), pos(2), pos(3), pos(4), pos(5)]
        );
        // The source releases only what is durable, the last position too.
        assert_eq!(source.confirmed.last(), Some(&pos(5)));
        assert!(source.confirmed.windows(2).all(|w| w[0] < w[1]));
    }

    /// Where an ack means "applied" (in process), a backlog fills the
    /// window, and live traffic (batches that closed because nothing more
    /// was ready) is read once every batch in flight is acknowledged.
    #[tokio::test]
    async fn live_batches_wait_for_the_window_to_drain_where_acks_mean_applied() {
        let transport = Held {
            applied: true,
            ..Held::default()
        };
        let markers = Markers::default();
        let cancel = CancellationToken::new();
        let mut source = Scripted {
            full_below: Some(2),
            ..Scripted::default()
        };
        let run = from_zero(&mut source, &transport, &markers, 3, &cancel);
        let drive = async {
            // Batches 1 and 2 are full, so 3 is read behind them; it is not.
            transport.stops_at(3).await;
            // One acknowledged, two in flight: a live batch waits.
            transport.ack(1, Ok(()));
            until("batch 1 marked", || markers.0.lock().unwrap().len() == 1).await;
            transport.stops_at(3).await;
            transport.ack(2, Ok(()));
            transport.stops_at(3).await;
            // All applied: the next is read, and only it.
            transport.ack(3, Ok(()));
            transport.stops_at(4).await;
            cancel.cancel();
            transport.ack(4, Ok(()));
        };
        let (last, ()) = tokio::join!(run, drive);
        assert_eq!(last.unwrap(), pos(4));
        assert_eq!(
            *markers.0.lock().unwrap(),
            vec![pos(1), pos(2), pos(3), pos(4)]
        );
    }

    #[tokio::test]
    async fn a_failed_ack_stops_with_its_error_and_marks_nothing_after_it() {
        let transport = Held::default();
        let markers = Markers::default();
        let cancel = CancellationToken::new();
        let mut source = Scripted::default();
        let run = from_zero(&mut source, &transport, &markers, 2, &cancel);
        let drive = async {
            until("two batches in flight", || transport.submitted().len() == 2).await;
            transport.ack(2, Ok(()));
            transport.ack(1, Err(Error::Decode("the applier could not commit".into())));
        };
        let (result, ()) =
            tokio::time::timeout(Duration::from_secs(10), async { tokio::join!(run, drive) })
                .await
                .expect("the failed ack did not stop the extractor");
        let err = result.unwrap_err().to_string();
        assert!(err.contains("could not commit"), "{err}");
        // Batch 2 was acknowledged, but batch 1 before it was not.
        assert!(markers.0.lock().unwrap().is_empty());
        assert!(source.confirmed.is_empty());
    }

    #[tokio::test]
    async fn a_failed_ack_stops_a_reader_in_the_middle_of_a_read() {
        let transport = Held::default();
        let markers = Markers::default();
        let cancel = CancellationToken::new();
        let mut source = Scripted {
            stall_at: Some(1),
            ..Scripted::default()
        };
        let run = from_zero(&mut source, &transport, &markers, 2, &cancel);
        let drive = async {
            until("one batch in flight", || transport.submitted().len() == 1).await;
            transport.ack(1, Err(Error::Decode("the applier is gone".into())));
        };
        let (result, ()) =
            tokio::time::timeout(Duration::from_secs(10), async { tokio::join!(run, drive) })
                .await
                .expect("a reader inside a read kept the extractor from stopping");
        let err = result.unwrap_err().to_string();
        assert!(err.contains("the applier is gone"), "{err}");
        assert_eq!(transport.submitted(), vec![1]);
    }

    /// Over Kafka records never time out: with the broker away an ack may
    /// never come. A failed read still stops the extractor with its error,
    /// READER_FAILED_GRACE later, instead of waiting for the broker.
    #[tokio::test]
    async fn a_failed_read_does_not_wait_for_an_ack_without_end() {
        let transport = Held::default();
        let markers = Markers::default();
        let cancel = CancellationToken::new();
        let mut source = Scripted {
            fail_at: Some(1),
            ..Scripted::default()
        };
        let t0 = Instant::now();
        let result = tokio::time::timeout(
            READER_FAILED_GRACE + Duration::from_secs(5),
            from_zero(&mut source, &transport, &markers, 2, &cancel),
        )
        .await
        .expect("a failed read waited for an ack that never came");
        let err = result.unwrap_err().to_string();
        assert!(err.contains("connection was lost"), "{err}");
        assert!(t0.elapsed() >= READER_FAILED_GRACE, "{:?}", t0.elapsed());
        assert_eq!(transport.submitted(), vec![1]);
        assert!(markers.0.lock().unwrap().is_empty());
    }

    #[tokio::test]
    async fn a_transport_that_allows_one_batch_in_flight_gets_one() {
        let transport = Held {
            cap: 1,
            ..Held::default()
        };
        let markers = Markers::default();
        let cancel = CancellationToken::new();
        let mut source = Scripted::default();
        let run = from_zero(&mut source, &transport, &markers, 4, &cancel);
        let drive = async {
            until("one batch in flight", || transport.submitted().len() == 1).await;
            tokio::time::sleep(Duration::from_millis(50)).await;
            assert_eq!(
                transport.submitted(),
                vec![1],
                "read ahead past the transport's bound"
            );
            cancel.cancel();
            transport.ack(1, Ok(()));
        };
        let (last, ()) = tokio::join!(run, drive);
        assert_eq!(last.unwrap(), pos(1));
    }
}
