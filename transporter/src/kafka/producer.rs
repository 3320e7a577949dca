//! The extractor side over Kafka.

use std::time::Duration;

use rdkafka::config::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::producer::{DeliveryFuture, FutureProducer, FutureRecord, Producer};
use rdkafka::util::Timeout;

use super::codec::BatchHead;
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

/// The extractor side over Kafka.
pub struct KafkaTransport {
    producer: FutureProducer,
    topic: String,
    partitions: u32,
}

impl KafkaTransport {
    /// An idempotent, `acks=all` producer for `topic`.
    pub fn new(
        config: &ClientConfig,
        topic: &str,
        partitions: u32,
    ) -> std::result::Result<KafkaTransport, KafkaTransportError> {
        let mut c = reliable_producer_config(config);
        c.set("max.in.flight.requests.per.connection", "5");
        if c.get("message.timeout.ms").is_none() {
            c.set("message.timeout.ms", "120000");
        }
        Ok(KafkaTransport {
            producer: c.create().map_err(kafka("creating the producer"))?,
            topic: topic.into(),
            partitions,
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
    /// One: batches over Kafka are not pipelined. A batch whose delivery
    /// fails (a leader gone past `message.timeout.ms`) while a later batch
    /// is written would leave a gap no applier sees: the later records move
    /// the partition's progress, and the failed ones, re-sent after the
    /// restart, fall below it and are dropped as applied. Until the
    /// appliers detect such a gap, a batch is produced only after the one
    /// before it was acknowledged.
    fn max_in_flight(&self) -> usize {
        1
    }

    /// Produces every record (and, after a loss, a notice to every
    /// partition); the ack waits until the broker acknowledged all of them.
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
        for r in &batch.records {
            let key = r.transport_key();
            let partition = r.partition(self.partitions);
            let payload = head.encode(Some(r));
            pending.push(self.produce(partition, &key, &payload).await?);
        }
        let topic = self.topic.clone();
        Ok(Box::pin(async move {
            for f in pending {
                match f.await {
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
        }))
    }
}

impl Drop for KafkaTransport {
    fn drop(&mut self) {
        let _ = self.producer.flush(Timeout::After(Duration::from_secs(10)));
    }
}
