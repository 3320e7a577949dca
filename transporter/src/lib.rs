//! # skein-transporter
//!
//! Carries [`ChangeRecord`]s from the extractor to the appliers, keyed by
//! entity + root key so every change of one aggregate lands in one
//! partition, in source order.
//!
//! Two boundaries, one per side:
//!
//! * [`Transport`] (extractor side): `send(batch)` resolves when every
//!   record is durably accepted;
//! * [`Inbox`] (applier side): rounds of per-partition [`Delivery`]s in
//!   order, partition assignment and revocation, `committed` after the
//!   sidecar transaction, `seek` after a fence.
//!
//! The embedded default is [`InProcess`] / [`InProcessInbox`]: one bounded
//! crossbeam channel per partition, acknowledged end to end. The
//! distributed one is [`kafka::KafkaTransport`] / [`kafka::KafkaInbox`].

pub mod in_process;
pub mod kafka;

use std::future::Future;

use skein_common::{ChangeRecord, Checkpoint, CheckpointKind, SourcePosition};

pub use in_process::{split, InProcess, InProcessInbox};

/// The progress "topic" of the in-process transport (the sidecar keys
/// progress by group, topic and partition).
pub const IN_PROCESS_TOPIC: &str = "in-process";

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Transport failures.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An applier stopped (its receiving side is gone).
    #[error("partition {partition}: the applier is gone")]
    Disconnected { partition: u32 },
    /// An applier reported that it could not commit its slice.
    #[error("partition {partition}: the applier failed: {message}")]
    ApplierFailed { partition: u32, message: String },
    /// The Kafka broker did not take or acknowledge a record.
    #[error("kafka: {message}")]
    Broker { message: String },
    /// The Kafka consumer failed (subscribe, rebalance, seek).
    #[error("kafka consumer: {message}")]
    Consumer { message: String },
    /// The change topic no longer holds records an applier has not applied
    /// (deleted by retention, or the topic was recreated).
    #[error(
        "data loss: topic `{topic}` no longer holds the records after the applied progress: \
         {message}. Changes in that range were not applied: the aggregates they touched \
         publish again only when they change again"
    )]
    DataLoss { topic: String, message: String },
}

impl Error {
    /// A gone or failed applier, a broker that refused a record or a
    /// consumer that lost its assignment is not fixed by trying again in
    /// place: the caller stops and a restart resumes from durable state.
    pub fn is_retryable(&self) -> bool {
        false
    }
}

/// One extractor batch: whole transactions in `(lower, upper]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Batch {
    /// Extractor batch sequence number (for logs).
    pub seq: u64,
    /// Exclusive lower bound (the marker the batch started from).
    pub lower: SourcePosition,
    /// Inclusive upper bound (commit end of the last transaction). A part
    /// of a transaction too large for one batch, not its last, completes
    /// nothing: its `upper` is its `lower`, and its records lie past it
    /// (appliers order them by their positions).
    pub upper: SourcePosition,
    /// The source reported lost changes before this batch.
    pub has_data_loss: bool,
    /// The records, in source order.
    pub records: Vec<ChangeRecord>,
}

/// A batch's acknowledgement, awaited apart from its hand-over so that
/// several batches can be in flight.
pub type Ack = std::pin::Pin<Box<dyn Future<Output = Result<()>> + Send + 'static>>;

/// The extractor side of a transport.
///
/// Contract: `submit` hands over one batch, after every batch submitted
/// before it, and resolves once the batch is queued (waiting for room when
/// the transport is full), giving its [`Ack`]. The ack resolves only when
/// the batch is acknowledged — for the in-process transport, committed by
/// every partition's applier; over Kafka, written by the broker. Records of
/// one key keep their order, across batches too. Acks may complete out of
/// order; the caller acts on them in submission order. A failed ack (or
/// `submit`) may have been partly applied, and so may the batches
/// submitted after it; resending from the first unacknowledged batch is
/// safe because appliers drop positions they already committed — provided
/// a transport never loses a record alone: once a record of a partition
/// failed, no later record of that partition may be delivered (the
/// in-process partitions stop; the Kafka producer is gapless).
pub trait Transport {
    /// Queues a batch and returns its acknowledgement.
    fn submit(&self, batch: Batch) -> impl Future<Output = Result<Ack>> + Send;

    /// How many batches this transport may have unacknowledged at once,
    /// whatever the config says.
    fn max_in_flight(&self) -> usize {
        usize::MAX
    }

    /// Whether an acknowledgement means the appliers committed the batch
    /// (in process), not only that the transport holds it (Kafka). Then a
    /// batch handed over while others are in flight waits behind them, and
    /// the extractor reads live traffic only once the window has drained
    /// (see `skein_extractor`'s pipeline).
    fn acknowledges_applied(&self) -> bool {
        false
    }

    /// Sends a batch and waits for its acknowledgement.
    fn send(&self, batch: Batch) -> impl Future<Output = Result<()>> + Send
    where
        Self: Sync,
    {
        async move { self.submit(batch).await?.await }
    }
}

/// One partition's records handed to the applier, in order, with the
/// progress to commit once they are applied.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Delivery {
    /// The partition.
    pub partition: u32,
    /// Exclusive lower bound, for the batch row: the extractor batch's
    /// lower position (in-process) or the first offset (Kafka).
    pub lower: Checkpoint,
    /// The progress to commit once applied: the batch's upper position
    /// (in-process) or the next offset (Kafka).
    pub upper: Checkpoint,
    /// The source reported lost changes before these records.
    pub has_data_loss: bool,
    /// The records, in source order.
    pub records: Vec<ChangeRecord>,
    /// Records of this range that could not be decoded and went to the
    /// dead-letter topic instead (counted in the batch row).
    pub dead_letters: i32,
}

/// A change of the partitions this applier owns.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Membership {
    /// These partitions are now this applier's; their consumption starts at
    /// the sidecar's progress (the inbox asked for it on assignment).
    Assigned(Vec<u32>),
    /// These partitions are no longer this applier's; nothing of theirs is
    /// delivered any more, and what was buffered was dropped.
    Revoked(Vec<u32>),
}

/// What one [`Inbox::next`] gave.
#[derive(Debug, Default)]
pub struct Round {
    /// Assignment changes, to act on before the deliveries.
    pub membership: Vec<Membership>,
    /// At most one delivery per partition, every one of an owned partition.
    pub deliveries: Vec<Delivery>,
    /// The sending side is gone and nothing more will come: stop.
    pub closed: bool,
}

/// The applier side of a transport.
///
/// Contract:
/// * **Order.** Each partition's records arrive in the order they were
///   sent; a round holds at most one [`Delivery`] per partition, and a
///   partition's next delivery follows the previous one without a gap
///   unless [`Inbox::seek`] moved it.
/// * **Acknowledgement.** After the applier's sidecar transaction for a
///   delivery committed (or found nothing new), it calls
///   [`Inbox::committed`] with `Ok(upper)`; after a failure, with
///   `Err(reason)`. In-process this is the extractor's end-to-end
///   acknowledgement; over Kafka it commits the consumer offset, which is
///   advisory (lag tools only): the sidecar's progress is the truth.
/// * **Redelivery.** A delivery may repeat records already applied (an
///   extractor that crashed before its marker, a rebalance, a seek); the
///   applier drops them by its stored progress, so the inbox need not.
/// * **Fencing.** When the sidecar refuses a commit because another
///   applier moved the progress, the applier calls [`Inbox::seek`] with the
///   stored progress and consumption resumes there.
pub trait Inbox: Send {
    /// The topic the sidecar keys this transport's progress by.
    fn topic(&self) -> &str;
    /// What this transport's checkpoints count.
    fn checkpoint_kind(&self) -> CheckpointKind;
    /// Waits for the next round (up to the transport's batch wait); an
    /// empty round means idle.
    fn next(&mut self) -> impl Future<Output = Result<Round>> + Send;
    /// Whether the applier may ask for the next round while deliveries it
    /// was given are still being applied (and acknowledge them after that
    /// round): a partition's next delivery may then come before the
    /// previous one was acknowledged, and the applier holds it until then.
    /// Kafka: yes, its acknowledgement is advisory and its rounds are what
    /// the consumer fetched. In process: no, an acknowledgement is what
    /// frees the extractor, and `next` waits only on partitions with
    /// nothing unacknowledged.
    fn delivers_while_applying(&self) -> bool {
        false
    }
    /// The outcome of applying the partition's last delivery.
    fn committed(
        &mut self,
        partition: u32,
        outcome: std::result::Result<Checkpoint, String>,
    ) -> impl Future<Output = Result<()>> + Send;
    /// Moves the partition's consumption to just after `to` (its start when
    /// `None`), dropping anything buffered for it.
    fn seek(
        &mut self,
        partition: u32,
        to: Option<Checkpoint>,
    ) -> impl Future<Output = Result<()>> + Send;
}
