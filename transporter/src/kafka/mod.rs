//! The Kafka transport: Avro-encoded change records on one topic,
//! partitioned by the same frozen hash of entity + canonical root key as
//! the in-process transport, so one aggregate's changes stay in one
//! partition, in order. A batch's records of one partition travel in packs
//! (several records a message, [`codec::FORMAT_V4`]).
//!
//! * [`codec`]: the frozen record format;
//! * [`producer`]: the extractor side ([`KafkaTransport`]), idempotent with
//!   `acks=all`; `send` returns only when the broker acknowledged every
//!   record of the batch, so the extractor's marker never runs ahead of the log;
//! * [`consumer`]: the applier side ([`KafkaInbox`]): a consumer-group member
//!   that starts each assigned partition at the sidecar's progress;
//! * [`admin`]: topics, watermarks, group membership and the offset look-ups
//!   of `skein replay` / `skein status`.

pub mod admin;
pub mod codec;
pub mod consumer;
pub mod producer;

use std::collections::BTreeMap;

use rdkafka::config::ClientConfig;
use rdkafka::error::KafkaError;
use skein_common::config::Secret;

pub use admin::{ensure_topic, plan_replay, watermarks, ReplayFrom, ReplayPlan};
pub use codec::{
    decode, decode_message, encode, Envelope, Message, FORMAT_V1, FORMAT_V2, FORMAT_V4,
    SCHEMA_JSON, SCHEMA_V1_JSON, SCHEMA_V4_JSON,
};
pub use consumer::{InboxSettings, KafkaInbox, ResumeAt};
pub use producer::{reliable_producer_config, KafkaTransport, MAX_PACK_BYTES};

/// The dead-letter topic of a change topic: records an applier cannot
/// decode go there, with the reason in a header, instead of stopping it.
pub fn dlq_topic(topic: &str) -> String {
    format!("{topic}.dlq")
}

/// A librdkafka client configuration: bootstrap servers plus the user's
/// pass-through properties (which win).
pub fn client_config(brokers: &str, properties: &BTreeMap<String, Secret>) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", brokers);
    for (k, v) in properties {
        c.set(k, v.expose());
    }
    c
}

/// Kafka transport failures.
#[derive(Debug, thiserror::Error)]
pub enum KafkaTransportError {
    /// A client, admin or delivery error from librdkafka.
    #[error("kafka: {context}")]
    Kafka {
        context: String,
        #[source]
        source: KafkaError,
    },
    /// The change topic exists with fewer partitions than configured.
    #[error(
        "topic `{topic}` has {actual} partitions but transport.partitions is {configured}: \
         records would be keyed to partitions that do not exist. Add partitions \
         (kafka-topics --alter --partitions {configured}) or lower transport.partitions"
    )]
    TooFewPartitions {
        topic: String,
        actual: usize,
        configured: u32,
    },
    /// An administrative request was refused, with what to do instead.
    #[error("{0}")]
    Refused(String),
}

pub(crate) fn kafka(context: impl Into<String>) -> impl FnOnce(KafkaError) -> KafkaTransportError {
    let context = context.into();
    move |source| KafkaTransportError::Kafka { context, source }
}
