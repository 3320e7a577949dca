//! The extractor side over Kafka.

use std::time::Duration;

use rdkafka::config::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::producer::future_producer::OwnedDeliveryResult;
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord, Producer};
use rdkafka::util::Timeout;

use super::codec::{BatchHead, PackBuf};
use super::{kafka, KafkaTransportError};
use crate::{Batch, Error, Result, Transport};

/// `config` made into an idempotent, `acks=all` producer's: every producer
/// skein creates (change records, dead letters, the Kafka sink). `linger.ms`
/// stays librdkafka's (5 ms), or what the user set.
pub fn reliable_producer_config(config: &ClientConfig) -> ClientConfig {
    let mut c = config.clone();
    c.set("enable.idempotence", "true").set("acks", "all");
    c
}

/// [`reliable_producer_config`], and no record of a partition ever fails
/// alone: `enable.gapless.guarantee` turns an error that would fail one
/// record (a record the broker rejects) into a fatal error after which no
/// record is written, `message.timeout.ms: 0` keeps records from timing
/// out, and retries never run out (librdkafka's default): the guarantee
/// covers neither of those (librdkafka's INTRODUCTION.md, "Gap-less" and
/// "Message timeout considerations"; it calls the guarantee experimental).
///
/// A record that failed while a later one of its partition was written
/// would leave a gap the appliers cannot see: the later record moves the
/// partition's progress, and the failed one, re-sent from the marker after
/// the extractor's restart, falls below it and is dropped as applied. With
/// no gap, a failed acknowledgement means that nothing after the failed
/// record was written either, so re-sending from the first unacknowledged
/// batch is safe, with any number of batches in flight. A broker away for
/// long keeps the records waiting (the extractor's lag says so; a stop
/// ends within its deadline); `skein validate` refuses properties that
/// would undo this.
pub fn gapless_producer_config(config: &ClientConfig) -> ClientConfig {
    let mut c = reliable_producer_config(config);
    c.set("enable.gapless.guarantee", "true")
        .set("message.timeout.ms", "0");
    // Aliases and limits that would let a record fail alone after
    // transient errors: librdkafka's defaults (retry without end) instead.
    for key in ["delivery.timeout.ms", "retries", "message.send.max.retries"] {
        c.remove(key);
    }
    c
}

/// How often a pending acknowledgement looks for the producer's fatal
/// error.
const FATAL_CHECK: Duration = Duration::from_secs(1);

/// Most bytes of records a pack holds (unless a single record is larger):
/// far below the message size brokers and librdkafka accept by default
/// (about 1 MB). A producer whose `message.max.bytes`, or a topic whose
/// `max.message.bytes`, is lower packs at most half of that.
pub const MAX_PACK_BYTES: usize = 256 * 1024;

/// librdkafka's default `batch.size`: most bytes of one record batch.
const LIBRDKAFKA_BATCH_SIZE: usize = 1_000_000;

/// A librdkafka property of `config` read as a size.
fn size_property(config: &ClientConfig, name: &str) -> Option<usize> {
    config
        .get(name)
        .and_then(|v| v.trim().parse::<usize>().ok())
}

/// The bytes of records a pack closes at under `config` for a topic whose
/// `max.message.bytes` is `topic_limit`: [`MAX_PACK_BYTES`], or half the
/// producer's `message.max.bytes` or half the topic's limit when less.
fn pack_bytes(config: &ClientConfig, topic_limit: Option<usize>) -> usize {
    [size_property(config, "message.max.bytes"), topic_limit]
        .into_iter()
        .flatten()
        .map(|m| (m / 2).clamp(1, MAX_PACK_BYTES))
        .fold(MAX_PACK_BYTES, usize::min)
}

/// The extractor side over Kafka.
pub struct KafkaTransport {
    producer: FutureProducer,
    topic: String,
    partitions: u32,
    records_per_message: usize,
    pack_bytes: usize,
}

impl KafkaTransport {
    /// An idempotent, `acks=all`, gapless producer for `topic`, whose
    /// records never time out (see [`gapless_producer_config`]). A message
    /// carries up to `records_per_message` records of one batch and
    /// partition (a pack, format 4); 1 writes each record alone (formats 2
    /// and 3), which appliers before packs read.
    pub fn new(
        config: &ClientConfig,
        topic: &str,
        partitions: u32,
        records_per_message: usize,
    ) -> std::result::Result<KafkaTransport, KafkaTransportError> {
        KafkaTransport::with_topic_limit(config, topic, partitions, records_per_message, None)
    }

    /// [`KafkaTransport::new`] fitted to the topic's own
    /// `max.message.bytes` (read from the broker), which bounds a record
    /// batch, not only a message: when it is below librdkafka's
    /// `batch.size` (1,000,000 by default) the producer's batches are made
    /// no larger, and packs close at half of it. A topic an operator set
    /// lower would otherwise reject full batches and large packs, at every
    /// start from the same marker. A single record larger than the limit
    /// is still rejected (a record is never split).
    pub async fn for_topic(
        config: &ClientConfig,
        topic: &str,
        partitions: u32,
        records_per_message: usize,
    ) -> std::result::Result<KafkaTransport, KafkaTransportError> {
        let limit = super::admin::topic_max_message_bytes(config, topic).await;
        KafkaTransport::with_topic_limit(config, topic, partitions, records_per_message, limit)
    }

    /// [`KafkaTransport::new`] for a topic whose `max.message.bytes` is
    /// `topic_limit` (see [`KafkaTransport::for_topic`]).
    fn with_topic_limit(
        config: &ClientConfig,
        topic: &str,
        partitions: u32,
        records_per_message: usize,
        topic_limit: Option<usize>,
    ) -> std::result::Result<KafkaTransport, KafkaTransportError> {
        let mut c = gapless_producer_config(config);
        c.set("max.in.flight.requests.per.connection", "5");
        if let Some(limit) = topic_limit {
            if limit < size_property(&c, "batch.size").unwrap_or(LIBRDKAFKA_BATCH_SIZE) {
                tracing::info!(
                    topic,
                    max_message_bytes = limit,
                    "the producer's batches and packs fit the topic's max.message.bytes"
                );
                c.set("batch.size", limit.to_string());
            }
        }
        Ok(KafkaTransport {
            producer: c.create().map_err(kafka("creating the producer"))?,
            topic: topic.into(),
            partitions,
            records_per_message: records_per_message.max(1),
            pack_bytes: pack_bytes(&c, topic_limit),
        })
    }

    async fn produce(&self, partition: u32, key: &str, payload: &[u8]) -> Result<DeliveryFuture> {
        let mut record = FutureRecord::to(&self.topic)
            .partition(partition as i32)
            .key(key)
            .payload(payload);
        loop {
            match self.producer.send_result(record) {
                Ok(f) => return Ok(f),
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), r)) => {
                    record = r;
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                Err((e, _)) => {
                    return Err(Error::Broker {
                        message: format!("enqueuing to `{}`: {e}", self.topic),
                    })
                }
            }
        }
    }
}

impl Transport for KafkaTransport {
    /// Produces every record, each partition's in packs of up to
    /// `records_per_message` in their order (and, after a loss, a notice to
    /// every partition first); the ack waits until the broker acknowledged
    /// all of them.
    async fn submit(&self, batch: Batch) -> Result<crate::Ack> {
        let mut pending = Vec::with_capacity(batch.records.len());
        // What every record of the batch shares, encoded once.
        let head = BatchHead::new(batch.lower, batch.upper, batch.has_data_loss);
        if batch.has_data_loss {
            let notice = head.encode(None);
            for p in 0..self.partitions {
                pending.push(self.produce(p, "", &notice).await?);
            }
        }
        if self.records_per_message == 1 {
            for r in &batch.records {
                let key = r.transport_key();
                let partition = r.partition(self.partitions);
                let payload = head.encode(Some(r));
                pending.push(self.produce(partition, &key, &payload).await?);
            }
        } else {
            // A pack's key is empty, like a notice's: its records have
            // theirs inside, and the partition is chosen, not hashed.
            let mut packs: Vec<PackBuf> =
                (0..self.partitions).map(|_| PackBuf::default()).collect();
            for r in &batch.records {
                let partition = r.partition(self.partitions);
                let buf = &mut packs[partition as usize];
                // A pack's records stay within `pack_bytes` (one record
                // larger than that travels alone).
                if !buf.push_within(r, self.pack_bytes) {
                    let payload = head.pack(buf);
                    pending.push(self.produce(partition, "", &payload).await?);
                    buf.push(r);
                }
                if buf.len() >= self.records_per_message || buf.bytes() >= self.pack_bytes {
                    let payload = head.pack(buf);
                    pending.push(self.produce(partition, "", &payload).await?);
                }
            }
            for (partition, buf) in packs.iter_mut().enumerate() {
                if !buf.is_empty() {
                    let payload = head.pack(buf);
                    pending.push(self.produce(partition as u32, "", &payload).await?);
                }
            }
        }
        let topic = self.topic.clone();
        let producer = self.producer.clone();
        Ok(Box::pin(async move {
            delivered(pending, &topic, || producer.client().fatal_error()).await
        }))
    }
}

/// Awaits `pending` in order. A fatal error fails the records still
/// queued, but a record already sent and then queued again (its
/// connection lost) is neither sent again nor failed: it never resolves,
/// as records never time out. So `fatal` (the producer's fatal error) is
/// looked at every [`FATAL_CHECK`], and a fatal error fails the wait.
async fn delivered<F, E>(
    pending: Vec<F>,
    topic: &str,
    fatal: impl Fn() -> Option<(RDKafkaErrorCode, String)>,
) -> Result<()>
where
    F: std::future::Future<Output = std::result::Result<OwnedDeliveryResult, E>> + Unpin,
{
    // One timer for the whole wait, not one per record: a batch is
    // thousands of records, most delivered by the time they are awaited,
    // and a sleep per record is a timer registered and cancelled per
    // record.
    let mut check =
        tokio::time::interval_at(tokio::time::Instant::now() + FATAL_CHECK, FATAL_CHECK);
    check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    for mut f in pending {
        let delivered = loop {
            tokio::select! {
                // A delivered record first: an overdue tick must not fail
                // a batch whose records all arrived.
                biased;
                d = &mut f => break d,
                _ = check.tick() => {
                    if let Some((code, reason)) = fatal() {
                        return Err(Error::Broker {
                            message: format!(
                                "the producer of `{topic}` failed ({code:?}: {reason}); no \
                                 record after the failed one is written, the extractor \
                                 starts again from its marker"
                            ),
                        });
                    }
                }
            }
        };
        match delivered {
            Ok(Ok(_)) => {}
            Ok(Err((e, _))) => {
                return Err(Error::Broker {
                    message: format!("delivery to `{topic}` failed: {e}"),
                })
            }
            Err(_) => {
                return Err(Error::Broker {
                    message: "the producer was dropped before delivery".into(),
                })
            }
        }
    }
    Ok(())
}

impl Drop for KafkaTransport {
    fn drop(&mut self) {
        let _ = self.producer.flush(Timeout::After(Duration::from_secs(10)));
    }
}

#[cfg(test)]
mod tests {

    //! The wait for deliveries (pure logic: the producer itself is tested
    //! against real brokers in tests/kafka.rs).
    use std::sync::atomic::{AtomicBool, Ordering};

    use super::*;

    /// Packs stay well inside the message size the producer allows.
    #[test]
    fn packs_close_at_half_a_lower_message_max_bytes() {
        let mut c = ClientConfig::new();
        assert_eq!(pack_bytes(&c, None), MAX_PACK_BYTES);
        c.set("message.max.bytes", "100000");
        assert_eq!(pack_bytes(&c, None), 50_000);
        c.set("message.max.bytes", "10000000");
        assert_eq!(pack_bytes(&c, None), MAX_PACK_BYTES);
        // The topic's own limit, when lower, the same way.
        assert_eq!(pack_bytes(&c, Some(2_000)), 1_000);
        c.set("message.max.bytes", "1000");
        assert_eq!(pack_bytes(&c, Some(2_000)), 500);
        assert_eq!(pack_bytes(&c, Some(10_000_000)), 500);
    }

    /// Records delivered are delivered, even when the fatal check fell due
    /// meanwhile and a fatal error came after them (a later batch's
    /// record failed): the batch is durable and must not be sent again.
    #[tokio::test(start_paused = true)]
    async fn a_due_fatal_check_does_not_fail_delivered_records() {
        let failed = AtomicBool::new(false);
        let ok = || {
            Ok(Ok(rdkafka::producer::future_producer::Delivery {
                partition: 0,
                offset: 0,
                timestamp: rdkafka::Timestamp::NotAvailable,
            }))
        };
        type Delivered = std::result::Result<OwnedDeliveryResult, ()>;
        let (first, first_rx) = tokio::sync::oneshot::channel::<Delivered>();
        let mut pending: Vec<std::pin::Pin<Box<dyn std::future::Future<Output = Delivered>>>> =
            vec![Box::pin(async move { first_rx.await.unwrap() })];
        for _ in 0..20 {
            pending.push(Box::pin(std::future::ready(ok())));
        }
        let wait = delivered(pending, "changes", || {
            failed.load(Ordering::SeqCst).then(|| {
                (
                    RDKafkaErrorCode::OutOfOrderSequenceNumber,
                    "gapless guarantee".to_string(),
                )
            })
        });
        tokio::pin!(wait);
        let polled = std::future::poll_fn(|cx| {
            std::task::Poll::Ready(std::future::Future::poll(wait.as_mut(), cx))
        })
        .await;
        assert!(polled.is_pending());
        // The check falls due while nothing polls the wait; then the first
        // record is delivered, and a fatal error follows.
        tokio::time::advance(FATAL_CHECK + FATAL_CHECK / 2).await;
        first.send(ok()).unwrap();
        failed.store(true, Ordering::SeqCst);
        let waited = wait.await;
        assert!(waited.is_ok(), "{waited:?}");
    }

    /// A record that never resolves (sent, then queued again after a fatal
    /// error): the wait ends with the fatal error once there is one.
    #[tokio::test]
    async fn a_fatal_error_ends_the_wait_for_a_record_that_never_resolves() {
        let failed = AtomicBool::new(false);
        let never = std::future::pending::<std::result::Result<OwnedDeliveryResult, ()>>();
        let wait = delivered(vec![Box::pin(never)], "changes", || {
            failed.load(Ordering::SeqCst).then(|| {
                (
                    RDKafkaErrorCode::OutOfOrderSequenceNumber,
                    "gapless guarantee".to_string(),
                )
            })
        });
        tokio::pin!(wait);
        // No fatal error: it waits (past more than one check).
        assert!(
            tokio::time::timeout(FATAL_CHECK * 2 + FATAL_CHECK / 2, &mut wait)
                .await
                .is_err(),
            "the wait ended without a delivery or a fatal error"
        );
        failed.store(true, Ordering::SeqCst);
        let err = tokio::time::timeout(FATAL_CHECK * 2, &mut wait)
            .await
            .expect("the fatal error did not end the wait")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("gapless guarantee") && err.contains("`changes`"),
            "{err}"
        );
    }
}
