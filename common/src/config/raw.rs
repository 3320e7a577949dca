//! The serde layer: the file's shape, every field optional where the
//! file may leave it out, unknown fields refused. [`RawConfig::validate`]
//! (in `validate.rs`) turns it into the typed [`Config`](super::Config).

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::*;

/// The whole configuration file.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RawConfig {
    /// Name of this pipeline: the progress group and the Kafka consumer group suffix.
    #[serde(default = "default_name")]
    pub name: String,
    /// Where changes come from.
    pub source: SourceConfig,
    /// Where batches, versions, progress and the outbox live.
    #[serde(default)]
    pub sidecar: SidecarConfig,
    /// How change records travel from extractor to appliers.
    #[serde(default)]
    pub transport: TransportConfig,
    /// Where the relay sends events.
    #[serde(default)]
    pub sink: SinkConfig,
    /// CloudEvent naming.
    #[serde(default)]
    pub events: EventsConfig,
    /// Directory of the extractor's sled marker and its lock.
    #[serde(default = "default_state_dir")]
    pub state_dir: PathBuf,
    /// Extractor tuning and data-loss policy.
    #[serde(default)]
    pub extractor: ExtractorConfig,
    /// The Prometheus endpoint.
    #[serde(default)]
    pub metrics: MetricsConfig,
    /// The aggregates to publish.
    pub entities: Vec<EntityConfig>,
}

fn default_name() -> String {
    DEFAULT_NAME.into()
}
fn default_state_dir() -> PathBuf {
    PathBuf::from(DEFAULT_STATE_DIR)
}

/// `source:`
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct SourceConfig {
    /// `postgres` or `sqlserver`.
    pub kind: SourceKind,
    /// Connection URL (`postgres://user:pass@host:port/db`).
    pub url: Secret,
    /// PostgreSQL replication slot.
    #[serde(default = "default_slot")]
    pub slot: String,
    /// PostgreSQL publication.
    #[serde(default = "default_publication")]
    pub publication: String,
    /// SQL Server: the capture instance to read per table (`schema.table`:
    /// name). Without an entry the table's newest capture instance is read,
    /// with a warning when it has two (a schema change in progress).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub capture_instances: BTreeMap<String, String>,
    /// SQL Server: how often to ask for a new maximum LSN while idle.
    #[serde(default = "default_poll_interval_ms")]
    pub poll_interval_ms: u64,
    /// SQL Server: the server's Windows time zone (a name in
    /// `sys.time_zone_info`, e.g. `W. Europe Standard Time`), to turn the
    /// server-local commit times of `cdc.lsn_time_mapping` into UTC across
    /// DST switches. Without it: `CURRENT_TIMEZONE_ID()` where the server
    /// has it, else the server's current UTC offset (with a warning).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time_zone: Option<String>,
}

fn default_poll_interval_ms() -> u64 {
    DEFAULT_POLL_INTERVAL_MS
}

fn default_slot() -> String {
    DEFAULT_SLOT.into()
}
fn default_publication() -> String {
    DEFAULT_PUBLICATION.into()
}

/// Transport kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
pub enum TransportKind {
    /// Bounded in-process channels (the embedded default).
    #[default]
    #[serde(rename = "in-process")]
    InProcess,
    /// A Kafka topic.
    #[serde(rename = "kafka")]
    Kafka,
}

/// `transport:`
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct TransportConfig {
    /// `in-process` or `kafka`.
    #[serde(default)]
    pub kind: TransportKind,
    /// Number of partitions (appliers in-process; topic partitions for Kafka).
    #[serde(default = "default_partitions")]
    pub partitions: u32,
    /// In-process: batches buffered per partition before the extractor waits.
    #[serde(default = "default_channel_capacity")]
    pub channel_capacity: usize,
    /// Kafka bootstrap servers.
    pub brokers: Option<String>,
    /// Kafka topic of change records.
    pub topic: Option<String>,
    /// Kafka: replication factor when skein creates the topic.
    #[serde(default = "default_replication_factor")]
    pub replication_factor: i32,
    /// Kafka: consumer group of the appliers (default `skein-<name>`).
    pub group: Option<String>,
    /// Kafka: most records an applier takes into one round, over its
    /// partitions (a pack that crosses it is taken whole).
    #[serde(default = "default_max_batch_records")]
    pub max_batch_records: usize,
    /// Kafka: most change records one message carries: the records of one
    /// batch bound for one partition travel together. 1 (the default):
    /// each alone, the format appliers before packs read.
    #[serde(default = "default_records_per_message")]
    pub records_per_message: usize,
    /// Kafka: how long an applier collects records before applying them.
    #[serde(default = "default_batch_wait_ms")]
    pub batch_wait_ms: u64,
    /// Kafka: `skein apply` also relays the outbox rows of its partitions.
    #[serde(default = "default_true")]
    pub relay_in_apply: bool,
    /// Any librdkafka property (`security.protocol`, `sasl.*`, `ssl.*`, …),
    /// passed through to the producer and consumers. Never logged.
    #[serde(default)]
    pub kafka_properties: BTreeMap<String, Secret>,
}

fn default_replication_factor() -> i32 {
    1
}
fn default_max_batch_records() -> usize {
    DEFAULT_MAX_BATCH_CHANGES
}
fn default_records_per_message() -> usize {
    DEFAULT_RECORDS_PER_MESSAGE
}
fn default_batch_wait_ms() -> u64 {
    DEFAULT_KAFKA_BATCH_WAIT_MS
}
fn default_true() -> bool {
    true
}

fn default_partitions() -> u32 {
    DEFAULT_PARTITIONS
}
fn default_channel_capacity() -> usize {
    DEFAULT_CHANNEL_CAPACITY
}

impl Default for TransportConfig {
    fn default() -> Self {
        TransportConfig {
            kind: TransportKind::InProcess,
            partitions: DEFAULT_PARTITIONS,
            channel_capacity: DEFAULT_CHANNEL_CAPACITY,
            brokers: None,
            topic: None,
            replication_factor: default_replication_factor(),
            group: None,
            max_batch_records: default_max_batch_records(),
            records_per_message: default_records_per_message(),
            batch_wait_ms: default_batch_wait_ms(),
            relay_in_apply: true,
            kafka_properties: BTreeMap::new(),
        }
    }
}

/// Sink kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SinkKind {
    /// One CloudEvent JSON per line on standard output.
    #[default]
    Stdout,
    /// JSON Lines file.
    File,
    /// Kafka topic per entity.
    Kafka,
}

/// `sink:`
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct SinkConfig {
    /// `stdout`, `file` or `kafka`.
    #[serde(default)]
    pub kind: SinkKind,
    /// File sink: the JSON Lines file (appended to).
    pub path: Option<PathBuf>,
    /// File sink: also print every event on standard output.
    #[serde(default)]
    pub also_stdout: bool,
    /// Kafka sink brokers.
    pub brokers: Option<String>,
    /// Kafka sink topic prefix: events go to `{topic_prefix}.{entity}`.
    pub topic_prefix: Option<String>,
    /// Kafka sink: CloudEvents `structured` (the event JSON as the value) or
    /// `binary` (`data` as the value, attributes as `ce_*` headers).
    #[serde(default)]
    pub mode: EventMode,
    /// Kafka sink: librdkafka properties, as for the transport. Never logged.
    #[serde(default)]
    pub kafka_properties: BTreeMap<String, Secret>,
    /// Outbox rows per relay transaction.
    #[serde(default = "default_relay_batch")]
    pub relay_batch: i64,
    /// How long an idle relay waits before it looks for new outbox rows.
    #[serde(default = "default_relay_poll_ms")]
    pub relay_poll_ms: u64,
    /// An event the sink rejects for good: `stop` (default) or `dead_letter`.
    #[serde(default)]
    pub on_reject: OnReject,
}

fn default_relay_batch() -> i64 {
    DEFAULT_RELAY_BATCH
}

fn default_relay_poll_ms() -> u64 {
    super::DEFAULT_RELAY_POLL_MS
}

impl Default for SinkConfig {
    fn default() -> Self {
        SinkConfig {
            kind: SinkKind::Stdout,
            path: None,
            also_stdout: false,
            brokers: None,
            topic_prefix: None,
            mode: EventMode::Structured,
            kafka_properties: BTreeMap::new(),
            relay_batch: DEFAULT_RELAY_BATCH,
            relay_poll_ms: super::DEFAULT_RELAY_POLL_MS,
            on_reject: OnReject::Stop,
        }
    }
}
