//! The YAML configuration model (nTangle's vocabulary in snake_case).
//!
//! Every struct denies unknown fields; defaults are named constants; the
//! config is loaded once and passed in, never global. [`Config::validate`]
//! checks what can be checked without I/O; `skein validate` adds the checks
//! that need the source.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Default consumer-group / progress name.
pub const DEFAULT_NAME: &str = "skein";
/// Default replication slot and publication name.
pub const DEFAULT_SLOT: &str = "skein";
/// Default publication name.
pub const DEFAULT_PUBLICATION: &str = "skein";
/// Default sidecar schema.
pub const DEFAULT_SIDECAR_SCHEMA: &str = "skein";
/// Default number of in-process partitions.
pub const DEFAULT_PARTITIONS: u32 = 4;
/// SQL Server: idle polling interval for `sys.fn_cdc_get_max_lsn()`.
pub const DEFAULT_POLL_INTERVAL_MS: u64 = 500;
/// Default bound of each in-process partition channel (batches in flight).
pub const DEFAULT_CHANNEL_CAPACITY: usize = 2;
/// Default cap of changes per extractor batch.
pub const DEFAULT_MAX_BATCH_CHANGES: usize = 10_000;
/// Default time the extractor waits for more changes once the stream is
/// quiet (0: a batch closes when nothing more is ready).
pub const DEFAULT_BATCH_LINGER_MS: u64 = 0;
/// Default `transport.batch_wait_ms` (Kafka): how long an applier gathers
/// records once the first arrived. Its own value: it was the extractor's
/// linger until that became 0, and 0 left appliers unassigned (fixed since;
/// 0 now means "what is ready").
pub const DEFAULT_KAFKA_BATCH_WAIT_MS: u64 = 20;
/// Default `transport.records_per_message` (Kafka): most change records
/// one message carries. 1 (each record alone) until packs are a release
/// old: an applier from before packs dead-letters a pack whole, so an
/// extractor that packed by default after an upgrade would lose every
/// change such an applier reads. Set it once every applier reads packs
/// (new pipelines: from the start; the Kafka example sets 1000).
pub const DEFAULT_RECORDS_PER_MESSAGE: usize = 1;
/// Default longest time a batch stays open.
pub const DEFAULT_MAX_BATCH_WAIT_MS: u64 = 200;
/// Default `extractor.max_batches_in_flight`: the batch being applied and
/// the next, read meanwhile (in process, while a backlog is read; a live
/// batch is read once those in flight are applied). More only queue: with natural batching each
/// is what was ready when a slot freed, so a deeper queue adds a round of
/// the appliers to every change's latency and gains no throughput
/// (bench/run: 4 gave p50 310 ms live and 9.3 s for the backlog, 2 gave
/// 170 ms and 7.2 s).
pub const DEFAULT_MAX_BATCHES_IN_FLIGHT: usize = 2;
/// Default `extractor.retention_warn_fraction`.
pub const DEFAULT_RETENTION_WARN_FRACTION: f64 = 0.8;
/// Default number of outbox rows the relay sends per transaction.
pub const DEFAULT_RELAY_BATCH: i64 = 500;
/// `sink.relay_poll_ms` by default.
pub const DEFAULT_RELAY_POLL_MS: u64 = 50;
/// `metrics.refresh_ms` by default.
pub const DEFAULT_METRICS_REFRESH_MS: u64 = 5_000;
/// `sidecar.outbox_retention_secs` by default: 7 days.
pub const DEFAULT_OUTBOX_RETENTION_SECS: u64 = 7 * 24 * 3600;
/// Default state directory (sled marker).
pub const DEFAULT_STATE_DIR: &str = ".skein";
/// Default CloudEvents `source` prefix.
pub const DEFAULT_SOURCE_ROOT: &str = "/skein";
/// Default CloudEvents `type` prefix.
pub const DEFAULT_TYPE_ROOT: &str = "skein";

mod entity;
mod raw;
mod validate;

pub use entity::{Cardinality, EntityConfig, JoinConfig, JoinOn, JoinType, TableNode};
use raw::RawConfig;
pub use raw::{SinkKind, TransportKind};

/// A validated configuration: the typed model every stage reads. What
/// validation checked is in the types (a Kafka transport has its brokers
/// and topic, a file sink its path), so call sites never check it again.
#[derive(Clone, Debug)]
pub struct Config {
    /// Name of this pipeline: the progress group and the Kafka consumer group suffix.
    pub name: String,
    /// Where changes come from.
    pub source: Source,
    /// Where batches, versions, progress and the outbox live.
    pub sidecar: SidecarConfig,
    /// How change records travel from extractor to appliers.
    pub transport: Transport,
    /// Where the relay sends events.
    pub sink: Sink,
    /// Outbox rows per relay transaction (`sink.relay_batch`).
    pub relay_batch: i64,
    /// How long an idle relay waits before it looks again (`sink.relay_poll_ms`).
    pub relay_poll_ms: u64,
    /// `sink.on_reject`.
    pub on_reject: OnReject,
    /// CloudEvent naming.
    pub events: EventsConfig,
    /// Directory of the extractor's sled marker and its lock.
    pub state_dir: PathBuf,
    /// Extractor tuning and data-loss policy.
    pub extractor: ExtractorConfig,
    /// The Prometheus endpoint.
    pub metrics: MetricsConfig,
    /// The aggregates to publish.
    pub entities: Vec<EntityConfig>,
}

/// `source:`, by kind.
#[derive(Clone, Debug)]
pub enum Source {
    /// PostgreSQL logical decoding (pgoutput).
    Postgres(PostgresSource),
    /// SQL Server CDC capture instances.
    SqlServer(SqlServerSource),
}

/// `source: { kind: postgres, … }`
#[derive(Clone, Debug)]
pub struct PostgresSource {
    /// Connection URL (`postgres://user:pass@host:port/db`).
    pub url: Secret,
    /// The replication slot (a plain identifier).
    pub slot: String,
    /// The publication (a plain identifier).
    pub publication: String,
}

/// `source: { kind: sqlserver, … }`
#[derive(Clone, Debug)]
pub struct SqlServerSource {
    /// An ADO.NET connection string or a `(jdbc:)sqlserver://` URL.
    pub url: Secret,
    /// The capture instance to read per table (`schema.table`: name).
    pub capture_instances: BTreeMap<String, String>,
    /// How often to ask for a new maximum LSN while idle (at least 1 ms).
    pub poll_interval_ms: u64,
    /// The server's Windows time zone name (`source.time_zone`), checked
    /// against `sys.time_zone_info` at start; `None`: ask the server.
    pub time_zone: Option<String>,
}

impl Source {
    /// The kind, as the file names it.
    pub fn kind(&self) -> SourceKind {
        match self {
            Source::Postgres(_) => SourceKind::Postgres,
            Source::SqlServer(_) => SourceKind::Sqlserver,
        }
    }

    /// The dialect of this source's positions.
    pub fn dialect(&self) -> crate::position::Dialect {
        self.kind().dialect()
    }

    /// The connection URL.
    pub fn url(&self) -> &Secret {
        match self {
            Source::Postgres(s) => &s.url,
            Source::SqlServer(s) => &s.url,
        }
    }
}

/// `transport:`, by kind.
#[derive(Clone, Debug)]
pub enum Transport {
    /// Bounded in-process channels (the embedded default).
    InProcess(InProcessTransport),
    /// A Kafka topic.
    Kafka(KafkaTransport),
}

/// `transport: { kind: in-process, … }`
#[derive(Clone, Debug)]
pub struct InProcessTransport {
    /// Number of partitions (1 to 1024).
    pub partitions: u32,
    /// Batches buffered per partition before the extractor waits (at least 1).
    pub channel_capacity: usize,
}

/// `transport: { kind: kafka, … }`
#[derive(Clone, Debug)]
pub struct KafkaTransport {
    /// Number of topic partitions (1 to 1024).
    pub partitions: u32,
    /// Bootstrap servers.
    pub brokers: String,
    /// The change topic.
    pub topic: String,
    /// Replication factor when skein creates the topic.
    pub replication_factor: i32,
    /// The appliers' consumer group: `transport.group` or `skein-<name>`.
    pub group: String,
    /// Most records an applier takes into one round, over its partitions
    /// (at least 1; a pack that crosses it is taken whole).
    pub max_batch_records: usize,
    /// Most records one message of the change topic carries (at least 1;
    /// 1: each record alone, as before packs).
    pub records_per_message: usize,
    /// How long an applier collects records before applying them.
    pub batch_wait_ms: u64,
    /// `skein apply` also relays the outbox rows of its partitions.
    pub relay_in_apply: bool,
    /// librdkafka properties passed through. Never logged.
    pub kafka_properties: BTreeMap<String, Secret>,
}

impl Transport {
    /// Number of partitions.
    pub fn partitions(&self) -> u32 {
        match self {
            Transport::InProcess(t) => t.partitions,
            Transport::Kafka(t) => t.partitions,
        }
    }
}

/// `sink:`, by kind.
#[derive(Clone, Debug)]
pub enum Sink {
    /// One CloudEvent JSON per line on standard output.
    Stdout,
    /// A JSON Lines file (appended to).
    File {
        /// The file.
        path: PathBuf,
        /// Also print every event on standard output.
        also_stdout: bool,
    },
    /// A Kafka topic per entity: `{topic_prefix}.{entity}`.
    Kafka {
        /// Bootstrap servers.
        brokers: String,
        /// Topic prefix.
        topic_prefix: String,
        /// CloudEvents `structured` or `binary` mode.
        mode: EventMode,
        /// librdkafka properties passed through. Never logged.
        kafka_properties: BTreeMap<String, Secret>,
    },
}

/// A string that must never be printed (connection URLs carry passwords).
#[derive(Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    /// Wraps a secret value.
    pub fn new(s: impl Into<String>) -> Self {
        Secret(s.into())
    }
    /// The secret itself, for the one place that needs it (the driver).
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(***)")
    }
}

/// Kind of source database.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SourceKind {
    /// PostgreSQL logical decoding (pgoutput).
    Postgres,
    /// SQL Server CDC capture instances.
    Sqlserver,
}

impl SourceKind {
    /// The dialect of this source's positions.
    pub fn dialect(self) -> crate::position::Dialect {
        match self {
            SourceKind::Postgres => crate::position::Dialect::Postgres,
            SourceKind::Sqlserver => crate::position::Dialect::SqlServer,
        }
    }
}

/// `metrics:` (the Prometheus endpoint of `run`, `extract`, `apply` and
/// `relay`).
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct MetricsConfig {
    /// `HOST:PORT` to serve `/metrics` on (Prometheus text format); none:
    /// no endpoint. `--metrics-addr` overrides it.
    pub addr: Option<String>,
    /// How often the gauges read from the source, the sidecar and the
    /// broker (lag, outbox depth, explicit keys pending) are refreshed.
    #[serde(default = "default_metrics_refresh_ms")]
    pub refresh_ms: u64,
}

fn default_metrics_refresh_ms() -> u64 {
    DEFAULT_METRICS_REFRESH_MS
}

impl Default for MetricsConfig {
    fn default() -> Self {
        MetricsConfig {
            addr: None,
            refresh_ms: DEFAULT_METRICS_REFRESH_MS,
        }
    }
}

/// `sidecar:`
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct SidecarConfig {
    /// Connection URL; defaults to the source URL (sidecar schema in the source database).
    pub url: Option<Secret>,
    /// Schema of the sidecar tables.
    #[serde(default = "default_sidecar_schema")]
    pub schema: String,
    /// How long an outbox row is kept after it was written, once relayed
    /// (at or below its partition's relay cursor), before the relay
    /// deletes it, in bounded chunks; 0 deletes it at the next purge.
    #[serde(default = "default_outbox_retention")]
    pub outbox_retention_secs: u64,
}

fn default_outbox_retention() -> u64 {
    DEFAULT_OUTBOX_RETENTION_SECS
}

fn default_sidecar_schema() -> String {
    DEFAULT_SIDECAR_SCHEMA.into()
}

impl Default for SidecarConfig {
    /// Without a `sidecar:` section: schema `skein` in the source database.
    fn default() -> Self {
        SidecarConfig {
            url: None,
            schema: default_sidecar_schema(),
            outbox_retention_secs: DEFAULT_OUTBOX_RETENTION_SECS,
        }
    }
}

/// What the relay does with an event the sink rejects for good (too large
/// for the broker, refused by it): `sink.on_reject`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OnReject {
    /// Stop the relay (and `skein run` / `skein apply`) with an error naming
    /// the outbox row; nothing is skipped.
    #[default]
    Stop,
    /// Record it in the sink's dead letter (a file sink: `<path>.dlq`; a
    /// Kafka sink: topic `<topic_prefix>.dlq`) with its outbox id and the
    /// error, and go on with the next events.
    DeadLetter,
}

/// CloudEvents Kafka protocol binding content mode.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EventMode {
    /// The whole event as JSON in the message value.
    #[default]
    Structured,
    /// `data` as the value, the other attributes as `ce_` headers.
    Binary,
}

/// How the `action` is spelled in event types.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ActionFormat {
    /// `created`, `updated`, `deleted`.
    #[default]
    PastTense,
    /// `create`, `update`, `delete`.
    PresentTense,
}

/// `events:`
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct EventsConfig {
    /// CloudEvents `source` prefix: `{source_root}/{schema}/{table}`.
    #[serde(default = "default_source_root")]
    pub source_root: String,
    /// CloudEvents `type` prefix: `{type_root}.{entity}.{action}`.
    #[serde(default = "default_type_root")]
    pub type_root: String,
    /// Spelling of actions.
    #[serde(default)]
    pub action_format: ActionFormat,
}

fn default_source_root() -> String {
    DEFAULT_SOURCE_ROOT.into()
}
fn default_type_root() -> String {
    DEFAULT_TYPE_ROOT.into()
}

impl Default for EventsConfig {
    fn default() -> Self {
        EventsConfig {
            source_root: DEFAULT_SOURCE_ROOT.into(),
            type_root: DEFAULT_TYPE_ROOT.into(),
            action_format: ActionFormat::PastTense,
        }
    }
}

/// `extractor:`
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ExtractorConfig {
    /// A batch closes at the first transaction boundary at or past this many changes.
    #[serde(default = "default_max_batch_changes")]
    pub max_batch_changes: usize,
    /// On data loss, record it and go on from what the source still has.
    #[serde(default)]
    pub continue_with_data_loss: bool,
    /// How long a quiet stream is waited on before a batch closes.
    #[serde(default = "default_linger")]
    pub batch_linger_ms: u64,
    /// Longest time a batch stays open.
    #[serde(default = "default_max_wait")]
    pub max_batch_wait_ms: u64,
    /// How many batches may be handed over and not yet acknowledged: the
    /// extractor reads the next while the appliers work on these (in
    /// process, while a backlog is read; live batches wait until those in
    /// flight are applied). A crash re-sends at most these.
    #[serde(default = "default_in_flight")]
    pub max_batches_in_flight: usize,
    /// The share of what the source keeps for skein (PostgreSQL: the
    /// slot's WAL up to `max_slot_wal_keep_size`; SQL Server: the CDC
    /// cleanup job's retention, against the age of the oldest unread
    /// change) above which lag is warned about, in the log and `skein status`.
    #[serde(default = "default_retention_warn")]
    pub retention_warn_fraction: f64,
    /// What a TRUNCATE of a tracked table does (PostgreSQL; SQL Server
    /// refuses TRUNCATE on a table with CDC enabled).
    #[serde(default)]
    pub on_truncate: OnTruncate,
    /// On the very first start (no marker yet: a new slot, or a new CDC
    /// start point), publish every aggregate of every entity that already
    /// exists: an explicit run per entity (`skein explicit`), started
    /// beside the stream and resumed by the next start if cut short.
    #[serde(default)]
    pub initial_load: bool,
}

/// `extractor.on_truncate`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OnTruncate {
    /// Re-check every aggregate of the entity that skein published: each
    /// partition's applier hydrates them again after everything before the
    /// TRUNCATE; a root that is gone gets its deleted event.
    #[default]
    Recheck,
    /// Stop at the truncating transaction, naming its position and the
    /// `skein marker reset` that skips it.
    Stop,
}

fn default_max_batch_changes() -> usize {
    DEFAULT_MAX_BATCH_CHANGES
}
fn default_linger() -> u64 {
    DEFAULT_BATCH_LINGER_MS
}
fn default_max_wait() -> u64 {
    DEFAULT_MAX_BATCH_WAIT_MS
}
fn default_in_flight() -> usize {
    DEFAULT_MAX_BATCHES_IN_FLIGHT
}
fn default_retention_warn() -> f64 {
    DEFAULT_RETENTION_WARN_FRACTION
}

impl Default for ExtractorConfig {
    fn default() -> Self {
        ExtractorConfig {
            max_batch_changes: DEFAULT_MAX_BATCH_CHANGES,
            continue_with_data_loss: false,
            batch_linger_ms: DEFAULT_BATCH_LINGER_MS,
            max_batch_wait_ms: DEFAULT_MAX_BATCH_WAIT_MS,
            max_batches_in_flight: DEFAULT_MAX_BATCHES_IN_FLIGHT,
            retention_warn_fraction: DEFAULT_RETENTION_WARN_FRACTION,
            on_truncate: OnTruncate::default(),
            initial_load: false,
        }
    }
}

impl Config {
    /// Reads and parses a YAML file, then validates it.
    pub fn load(path: &Path) -> Result<Config> {
        let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
            file: path.display().to_string(),
            source,
        })?;
        let file = path.display().to_string();
        let text = expand_env(&text, &file, |name| std::env::var(name).ok())?;
        Config::from_yaml(&text, &file)
    }

    /// Parses YAML text (`file` names it in errors), then validates it into
    /// the typed model.
    pub fn from_yaml(text: &str, file: &str) -> Result<Config> {
        let raw: RawConfig = serde_yaml_ng::from_str(text).map_err(|e| Error::ConfigSyntax {
            file: file.into(),
            message: e.to_string(),
        })?;
        raw.validate(text, file)
    }

    /// The sidecar URL (the source's when not configured).
    pub fn sidecar_url(&self) -> &Secret {
        self.sidecar.url.as_ref().unwrap_or(self.source.url())
    }

    /// Looks an entity up by name.
    pub fn entity(&self, name: &str) -> Option<&EntityConfig> {
        self.entities.iter().find(|e| e.name == name)
    }

    /// Every table the entities name, each once (a table may be in two
    /// entities, or twice in one), as `(schema, table)` in first-seen order.
    pub fn tables(&self) -> Vec<(String, String)> {
        let mut seen = std::collections::HashSet::new();
        self.entities
            .iter()
            .flat_map(|e| e.nodes())
            .map(|n| (n.schema, n.table))
            .filter(|t| seen.insert(t.clone()))
            .collect()
    }
}

/// Replaces `${NAME}` with the environment variable `NAME` (so secrets and
/// per-machine URLs stay out of the file). An unset variable is an error
/// naming it and its line; `$${` writes a literal `${`.
pub fn expand_env(
    text: &str,
    file: &str,
    lookup: impl Fn(&str) -> Option<String>,
) -> Result<String> {
    let mut out = String::with_capacity(text.len());
    for (no, line) in text.split_inclusive('\n').enumerate() {
        let mut rest = line;
        while let Some(i) = rest.find("${") {
            if rest[..i].ends_with('$') {
                out.push_str(&rest[..i - 1]);
                out.push_str("${");
                rest = &rest[i + 2..];
                continue;
            }
            out.push_str(&rest[..i]);
            let end = rest[i..].find('}').ok_or_else(|| Error::ConfigInvalid {
                file: file.into(),
                field: "${…}".into(),
                line: Some(no + 1),
                message: "unterminated `${`".into(),
            })?;
            let name = &rest[i + 2..i + end];
            let value = lookup(name).ok_or_else(|| Error::ConfigInvalid {
                file: file.into(),
                field: format!("${{{name}}}"),
                line: Some(no + 1),
                message: format!("environment variable `{name}` is not set"),
            })?;
            out.push_str(&value);
            rest = &rest[i + end + 1..];
        }
        out.push_str(rest);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = r#"
source: { kind: postgres, url: "postgres://u:secret@h/db" }
sidecar: { schema: skein }
entities:
  - name: customer
    table: customer
    exclude_columns_from_etag: [row_version]
    is_deleted_column: is_deleted
    joins:
      - { name: addresses, table: address, join_to: customer,
          on: [{ name: customer_id, to_column: id }] }
      - name: lines
        table: address_line
        join_to: addresses
        on: [{ name: address_id, to_column: id }]
"#;

    #[test]
    fn sample_parses_and_resolves_the_tree() {
        let c = Config::from_yaml(SAMPLE, "t.yaml").unwrap();
        let nodes = c.entities[0].nodes();
        assert_eq!(nodes.len(), 3);
        assert_eq!(nodes[1].parent, Some(0));
        assert_eq!(nodes[2].parent, Some(1));
        assert_eq!(nodes[2].depth, 2);
        assert_eq!(c.transport.partitions(), DEFAULT_PARTITIONS);
        assert!(matches!(c.transport, Transport::InProcess(_)));
        assert!(matches!(c.source, Source::Postgres(_)));
        assert!(
            !format!("{c:?}").contains("secret"),
            "Debug must hide secrets"
        );
    }

    #[test]
    fn validation_types_what_it_checked() {
        let with = |section: &str| {
            Config::from_yaml(
                &SAMPLE.replace("entities:", &format!("{section}\nentities:")),
                "t.yaml",
            )
        };
        let c = with("sink: { kind: file, path: out.jsonl }").unwrap();
        assert!(
            matches!(&c.sink, Sink::File { path, also_stdout: false } if path == Path::new("out.jsonl"))
        );
        let c =
            with("sink: { kind: kafka, brokers: b, topic_prefix: ev, relay_batch: 7 }").unwrap();
        assert!(
            matches!(&c.sink, Sink::Kafka { brokers, topic_prefix, .. } if brokers == "b" && topic_prefix == "ev")
        );
        assert_eq!(c.relay_batch, 7);
        assert_eq!(c.relay_poll_ms, DEFAULT_RELAY_POLL_MS);
        assert_eq!(
            c.sidecar.outbox_retention_secs,
            DEFAULT_OUTBOX_RETENTION_SECS
        );
        let c = with("sink: { kind: stdout, relay_poll_ms: 5 }").unwrap();
        assert_eq!(c.relay_poll_ms, 5);
        let c = Config::from_yaml(
            &SAMPLE.replace(
                "sidecar: { schema: skein }",
                "sidecar: { schema: skein, outbox_retention_secs: 0 }",
            ),
            "t.yaml",
        )
        .unwrap();
        assert_eq!(c.sidecar.outbox_retention_secs, 0);
        assert!(with("sink: { kind: stdout, relay_poll_ms: 0 }").is_err());
        assert_eq!(
            c.metrics,
            MetricsConfig::default(),
            "no endpoint by default"
        );
        let m = with("metrics: { addr: \"0.0.0.0:9187\", refresh_ms: 100 }").unwrap();
        assert_eq!(m.metrics.addr.as_deref(), Some("0.0.0.0:9187"));
        assert_eq!(m.metrics.refresh_ms, 100);
        for bad in [
            "metrics: { addr: \"9187\" }",
            "metrics: { addr: \":9187\" }",
            "metrics: { addr: \"h:99999\" }",
            "metrics: { refresh_ms: 0 }",
        ] {
            let e = with(bad).unwrap_err().to_string();
            assert!(e.contains("metrics."), "{bad}: {e}");
        }
        assert_eq!(c.on_reject, OnReject::Stop, "the default stops");
        let c = with("sink: { kind: kafka, brokers: b, topic_prefix: ev, on_reject: dead_letter }")
            .unwrap();
        assert_eq!(c.on_reject, OnReject::DeadLetter);
        let e = with("sink: { kind: kafka, brokers: b, topic_prefix: ev, on_reject: skip }")
            .unwrap_err()
            .to_string();
        assert!(e.contains("on_reject") || e.contains("skip"), "{e}");
        let c = with("transport: { kind: kafka, brokers: b, topic: t, group: g }").unwrap();
        assert!(matches!(&c.transport, Transport::Kafka(k) if k.group == "g"));
        let c = with("transport: { kind: kafka, brokers: b, topic: t, records_per_message: 1 }")
            .unwrap();
        assert!(matches!(&c.transport, Transport::Kafka(k) if k.records_per_message == 1));
        let e = with("transport: { kind: kafka, brokers: b, topic: t, records_per_message: 0 }")
            .unwrap_err()
            .to_string();
        assert!(e.contains("transport.records_per_message"), "{e}");
        // What the types cannot hold is refused, naming the field.
        let e = with("sink: { kind: file }").unwrap_err().to_string();
        assert!(e.contains("sink.path"), "{e}");
        let e = with("transport: { kind: kafka, brokers: b }")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("transport.kind") && e.contains("needs `brokers` and `topic`"),
            "{e}"
        );
        let e = with("sink: { kind: kafka, topic_prefix: ev }")
            .unwrap_err()
            .to_string();
        assert!(e.contains("sink.brokers"), "{e}");
    }

    #[test]
    fn defaults_apply_without_sections_and_kafka_secrets_stay_hidden() {
        let c = Config::from_yaml(
            &SAMPLE.replace("sidecar: { schema: skein }\n", "").replace(
                "entities:",
                "transport: { kind: kafka, brokers: b, topic: t,\n  kafka_properties: { sasl.password: hunter2 } }\nentities:",
            ),
            "t.yaml",
        )
        .unwrap();
        assert_eq!(c.sidecar.schema, DEFAULT_SIDECAR_SCHEMA);
        let Transport::Kafka(k) = &c.transport else {
            panic!("a kafka transport: {:?}", c.transport)
        };
        assert_eq!(k.group, format!("skein-{}", c.name));
        assert_eq!((k.brokers.as_str(), k.topic.as_str()), ("b", "t"));
        assert_eq!(k.records_per_message, DEFAULT_RECORDS_PER_MESSAGE);
        assert_eq!(k.kafka_properties["sasl.password"].expose(), "hunter2");
        assert!(
            !format!("{c:?}").contains("hunter2"),
            "Debug must hide secrets"
        );
    }

    #[test]
    fn kafka_properties_that_would_let_a_change_record_fail_alone_are_refused() {
        let with_props = |props: &str| {
            Config::from_yaml(
                &SAMPLE.replace(
                    "entities:",
                    &format!(
                        "transport: {{ kind: kafka, brokers: b, topic: t,\n  kafka_properties: {{ {props} }} }}\nentities:"
                    ),
                ),
                "t.yaml",
            )
        };
        for props in [
            "message.timeout.ms: \"120000\"",
            "delivery.timeout.ms: \"300000\"",
            "enable.gapless.guarantee: \"false\"",
            "enable.idempotence: \"false\"",
            "retries: \"3\"",
            "message.send.max.retries: \"10\"",
        ] {
            let e = with_props(props).unwrap_err().to_string();
            let prop = props.split(':').next().unwrap();
            assert!(
                e.contains(&format!("transport.kafka_properties.{prop}")) && e.contains("gap"),
                "{props}: {e}"
            );
        }
        // Their own values, or none, are fine.
        with_props("message.timeout.ms: \"0\", enable.gapless.guarantee: \"true\"").unwrap();
        with_props("linger.ms: \"20\"").unwrap();
    }

    #[test]
    fn unknown_field_names_field_and_line() {
        let bad = SAMPLE.replace(
            "    table: customer\n",
            "    table: customer\n    tabel: x\n",
        );
        let e = Config::from_yaml(&bad, "t.yaml").unwrap_err().to_string();
        assert!(e.contains("tabel"), "{e}");
        assert!(e.contains("line 7"), "{e}");
    }

    #[test]
    fn wrong_type_names_field_and_line() {
        let bad = SAMPLE.replace("sidecar: { schema: skein }", "sidecar: { schema: [1] }");
        let e = Config::from_yaml(&bad, "t.yaml").unwrap_err().to_string();
        assert!(e.contains("sidecar"), "{e}");
        assert!(e.contains("line 3"), "{e}");
    }

    #[test]
    fn retention_warn_fraction_is_a_share() {
        let with = |f: &str| {
            SAMPLE.replace(
                "sidecar: { schema: skein }",
                &format!(
                    "sidecar: {{ schema: skein }}\nextractor: {{ retention_warn_fraction: {f} }}"
                ),
            )
        };
        let ok = Config::from_yaml(&with("0.5"), "t.yaml").unwrap();
        assert_eq!(ok.extractor.retention_warn_fraction, 0.5);
        for bad in ["0", "1.5", "-0.1", ".nan"] {
            let e = Config::from_yaml(&with(bad), "t.yaml")
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("extractor.retention_warn_fraction"),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn time_zone_is_a_sql_server_setting_with_a_plausible_name() {
        let with = |kind: &str, tz: &str| {
            Config::from_yaml(
                &SAMPLE.replace(
                    "source: { kind: postgres, url: \"postgres://u:secret@h/db\" }",
                    &format!("source: {{ kind: {kind}, url: x, time_zone: {tz} }}"),
                ),
                "t.yaml",
            )
        };
        let c = with("sqlserver", "\"W. Europe Standard Time\"").unwrap();
        assert!(
            matches!(&c.source, Source::SqlServer(s) if s.time_zone.as_deref() == Some("W. Europe Standard Time"))
        );
        let c =
            Config::from_yaml(&SAMPLE.replace("kind: postgres", "kind: sqlserver"), "t").unwrap();
        assert!(matches!(&c.source, Source::SqlServer(s) if s.time_zone.is_none()));
        let e = with("postgres", "UTC").unwrap_err().to_string();
        assert!(
            e.contains("source.time_zone")
                && e.contains("only a SQL Server source")
                && e.contains(":2:"),
            "{e}"
        );
        let e = with("sqlserver", "Europe/Berlin").unwrap_err().to_string();
        assert!(
            e.contains("IANA") && e.contains("W. Europe Standard Time"),
            "{e}"
        );
        for bad in ["\"\"", "\" UTC\"", "\"a\\tb\"", &"x".repeat(129)] {
            let e = with("sqlserver", bad).unwrap_err().to_string();
            assert!(e.contains("source.time_zone"), "{bad}: {e}");
        }
        // Unknown fields next to it are still refused.
        let e = Config::from_yaml(
            &SAMPLE.replace(
                "source: { kind: postgres, url: \"postgres://u:secret@h/db\" }",
                "source: { kind: sqlserver, url: x, timezone: UTC }",
            ),
            "t.yaml",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("timezone"), "{e}");
    }

    #[test]
    fn bad_join_to_names_field_and_line() {
        let bad = SAMPLE.replace("join_to: addresses", "join_to: nowhere");
        let e = Config::from_yaml(&bad, "t.yaml").unwrap_err().to_string();
        assert!(e.contains("entities[0].joins[1].join_to"), "{e}");
        assert!(e.starts_with("t.yaml:14:"), "{e}");
        let bad = SAMPLE.replace("join_to: customer", "join_to: lines");
        let e = Config::from_yaml(&bad, "t.yaml").unwrap_err().to_string();
        assert!(e.starts_with("t.yaml:10:"), "{e}");
    }

    #[test]
    fn join_types_reach_the_tree_and_only_cdc_joins_are_tracked() {
        let c = Config::from_yaml(
            &SAMPLE.replace(
                "join_to: addresses\n",
                "join_to: addresses\n        type: left\n",
            ),
            "t.yaml",
        )
        .unwrap();
        let nodes = c.entities[0].nodes();
        let types: Vec<(JoinType, bool)> =
            nodes.iter().map(|n| (n.join_type, n.tracked())).collect();
        assert_eq!(
            types,
            [
                (JoinType::Cdc, true),
                (JoinType::Cdc, true),
                (JoinType::Left, false)
            ]
        );
        let c = Config::from_yaml(
            &SAMPLE.replace(
                "join_to: addresses\n",
                "join_to: addresses\n        type: inner\n",
            ),
            "t.yaml",
        )
        .unwrap();
        assert_eq!(c.entities[0].nodes()[2].join_type, JoinType::Inner);
        let bad = SAMPLE.replace(
            "join_to: addresses\n",
            "join_to: addresses\n        key: []\n",
        );
        let e = Config::from_yaml(&bad, "t.yaml").unwrap_err().to_string();
        assert!(e.contains("entities[0].joins[1].key"), "{e}");
    }

    #[test]
    fn env_references_expand_and_missing_ones_name_the_line() {
        let look = |n: &str| (n == "PG").then(|| "postgres://h/db".to_string());
        assert_eq!(
            expand_env("a: ${PG}/x\nb: $${PG}\n", "f", look).unwrap(),
            "a: postgres://h/db/x\nb: ${PG}\n"
        );
        let e = expand_env("a: 1\nb: ${NOPE}\n", "f", look)
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("f:2:") && e.contains("NOPE"), "{e}");
    }

    #[test]
    fn a_global_id_column_needs_identifier_mapping() {
        let with = |extra: &str| {
            Config::from_yaml(
                &SAMPLE.replace(
                    "is_deleted_column: is_deleted",
                    &format!("is_deleted_column: is_deleted\n    {extra}"),
                ),
                "t.yaml",
            )
        };
        let e = with("global_id_column: gid").unwrap_err().to_string();
        assert!(e.contains("identifier_mapping: true"), "{e}");
        let c = with("identifier_mapping: true\n    global_id_column: gid").unwrap();
        assert!(c.entities[0].identifier_mapping);
        assert_eq!(c.entities[0].global_id_column.as_deref(), Some("gid"));
    }

    /// Fuzz properties (see [`crate::fuzz`]): no YAML text makes parsing
    /// and validation panic, hang or allocate out of proportion.
    mod fuzz {
        use proptest::prelude::*;

        use super::*;
        use crate::fuzz::{arbitrary_bytes, check, config, mutated};

        /// Valid configs to mutate: the unit-test sample and the examples.
        const VALID: &[&str] = &[
            SAMPLE,
            include_str!("../../../examples/quickstart/skein.yaml"),
            include_str!("../../../examples/kafka/skein.yaml"),
            include_str!("../../../examples/sqlserver/skein.yaml"),
        ];

        /// YAML and skein vocabulary the mutations insert.
        const TOKENS: &[&[u8]] = &[
            b"\n",
            b"  ",
            b"- ",
            b": ",
            b"{",
            b"}",
            b"[",
            b"]",
            b",",
            b"#",
            b"'",
            b"\"",
            b"&a ",
            b"*a",
            b"<<: *a\n",
            b"!!str ",
            b"!!binary ",
            b"? ",
            b"|\n",
            b">-\n",
            b"~",
            b"-1",
            b"0",
            b"99999999999999999999999",
            b"1e400",
            b".nan",
            b"\t",
            b"${X}",
            b"$${",
            b"${",
            b"\xef\xbb\xbf",
            b"\r\n",
            b"---\n",
            b"...\n",
            b"entities:",
            b"joins:",
            b"join_to: ",
            b"on: ",
            b"name: ",
            b"table: ",
            b"partitions: ",
            b"kind: kafka",
            b"kind: sqlserver",
            b"sink: ",
            b"transport: ",
            b"source: ",
            b"retention_warn_fraction: ",
            b"time_zone: ",
        ];

        fn parse(text: &str) {
            check("config", text.len(), || {
                let expanded = expand_env(text, "f.yaml", |n| (n == "X").then(|| "x".into()));
                let _ = expanded.map(|t| Config::from_yaml(&t, "f.yaml"));
            });
        }

        fn valid() -> impl Strategy<Value = Vec<u8>> {
            prop::sample::select(VALID).prop_map(|s| s.as_bytes().to_vec())
        }

        proptest! {
            #![proptest_config(config())]

            #[test]
            fn arbitrary_text_is_ok_or_an_error(b in arbitrary_bytes(512)) {
                parse(&String::from_utf8_lossy(&b));
            }

            #[test]
            fn mutated_configs_are_ok_or_an_error(b in mutated(valid(), TOKENS)) {
                parse(&String::from_utf8_lossy(&b));
            }
        }

        #[test]
        fn the_examples_are_valid_configs() {
            for v in VALID {
                let t = expand_env(v, "f.yaml", |_| Some("x".into())).unwrap();
                Config::from_yaml(&t, "f.yaml").unwrap();
            }
        }

        #[test]
        fn alias_expansion_bomb_is_an_error() {
            let mut text = String::from("a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n");
            for i in 1..12 {
                let p = i - 1;
                text.push_str(&format!(
                    "a{i}: &a{i} [*a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}, *a{p}]\n"
                ));
            }
            check("config", text.len(), || {
                assert!(Config::from_yaml(&text, "f.yaml").is_err());
            });
        }
    }
}
