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
/// Default time the extractor waits for more changes once the stream is quiet.
pub const DEFAULT_BATCH_LINGER_MS: u64 = 50;
/// Default longest time a batch stays open.
pub const DEFAULT_MAX_BATCH_WAIT_MS: u64 = 200;
/// Default number of outbox rows the relay sends per transaction.
pub const DEFAULT_RELAY_BATCH: i64 = 500;
/// Default state directory (sled marker).
pub const DEFAULT_STATE_DIR: &str = ".skein";
/// Default CloudEvents `source` prefix.
pub const DEFAULT_SOURCE_ROOT: &str = "/skein";
/// Default CloudEvents `type` prefix.
pub const DEFAULT_TYPE_ROOT: &str = "skein";

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

/// The whole configuration file.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
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
    /// The aggregates to publish.
    pub entities: Vec<EntityConfig>,
}

fn default_name() -> String {
    DEFAULT_NAME.into()
}
fn default_state_dir() -> PathBuf {
    PathBuf::from(DEFAULT_STATE_DIR)
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

/// `sidecar:`
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct SidecarConfig {
    /// Connection URL; defaults to the source URL (sidecar schema in the source database).
    pub url: Option<Secret>,
    /// Schema of the sidecar tables.
    #[serde(default = "default_sidecar_schema")]
    pub schema: String,
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
        }
    }
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
    /// Kafka: most records an applier takes into one batch per partition.
    #[serde(default = "default_max_batch_records")]
    pub max_batch_records: usize,
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
fn default_batch_wait_ms() -> u64 {
    DEFAULT_BATCH_LINGER_MS
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
}

fn default_relay_batch() -> i64 {
    DEFAULT_RELAY_BATCH
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
        }
    }
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

impl Default for ExtractorConfig {
    fn default() -> Self {
        ExtractorConfig {
            max_batch_changes: DEFAULT_MAX_BATCH_CHANGES,
            continue_with_data_loss: false,
            batch_linger_ms: DEFAULT_BATCH_LINGER_MS,
            max_batch_wait_ms: DEFAULT_MAX_BATCH_WAIT_MS,
        }
    }
}

/// One aggregate: a root table and its joins.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct EntityConfig {
    /// Entity name (event type segment, transport key prefix).
    pub name: String,
    /// Root table schema.
    #[serde(default = "default_schema")]
    pub schema: String,
    /// Root table.
    pub table: String,
    /// Key columns; defaults to the table's primary key (read from the source).
    pub key: Option<Vec<String>>,
    /// Only these columns (plus the key) go into the event; empty = all.
    #[serde(default)]
    pub include_columns: Vec<String>,
    /// These columns never go into the event.
    #[serde(default)]
    pub exclude_columns: Vec<String>,
    /// Columns left out of the version hash (e.g. a row version).
    #[serde(default)]
    pub exclude_columns_from_etag: Vec<String>,
    /// A boolean column meaning "logically deleted".
    pub is_deleted_column: Option<String>,
    /// Columns kept in the payload of a delete event besides the key.
    #[serde(default)]
    pub include_columns_on_delete: Vec<String>,
    /// Global identifier mapping (not implemented yet: `true` is rejected).
    #[serde(default)]
    pub identifier_mapping: bool,
    /// Child tables, any depth.
    #[serde(default)]
    pub joins: Vec<JoinConfig>,
}

fn default_schema() -> String {
    "public".into()
}

/// How many child rows a join yields.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Cardinality {
    /// An array of child objects.
    #[default]
    OneToMany,
    /// One child object or `null`.
    OneToOne,
}

/// Whether a join is tracked by CDC.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum JoinType {
    /// Tracked: a change of this table changes its root.
    #[default]
    Cdc,
    /// Read when hydrating, not tracked; only rows that exist.
    Inner,
    /// Read when hydrating, not tracked.
    Left,
}

/// One join column pair.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct JoinOn {
    /// Column of this (child) table.
    pub name: String,
    /// Column of the table joined to.
    pub to_column: String,
}

/// A child table of an entity.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct JoinConfig {
    /// Property name in the entity JSON.
    pub name: String,
    /// Schema; defaults to the entity's schema.
    pub schema: Option<String>,
    /// Table.
    pub table: String,
    /// The parent: the root table, or another join's name or table; defaults to the root.
    pub join_to: Option<String>,
    /// Join columns (child column → parent column).
    pub on: Vec<JoinOn>,
    /// `one_to_many` (array) or `one_to_one` (object or null).
    #[serde(default)]
    pub cardinality: Cardinality,
    /// `cdc` (tracked), `inner` or `left` (hydration only).
    #[serde(default, rename = "type")]
    pub join_type: JoinType,
    /// Key columns; default the table's primary key. Orders child arrays.
    pub key: Option<Vec<String>>,
    /// Only these columns go into the event; empty = all.
    #[serde(default)]
    pub include_columns: Vec<String>,
    /// These columns never go into the event.
    #[serde(default)]
    pub exclude_columns: Vec<String>,
    /// Columns left out of the version hash.
    #[serde(default)]
    pub exclude_columns_from_etag: Vec<String>,
}

/// One table of an entity with its parent resolved: the tree that the
/// resolver, the hydrator and the SQL generator walk.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TableNode {
    /// Index in [`EntityConfig::nodes`]; 0 is the root.
    pub index: usize,
    /// Parent node index (`None` for the root).
    pub parent: Option<usize>,
    /// Depth: 0 root, 1 direct child, 2 grandchild…
    pub depth: usize,
    /// JSON property name (the entity name for the root).
    pub name: String,
    /// Schema.
    pub schema: String,
    /// Table.
    pub table: String,
    /// Join columns to the parent (empty for the root).
    pub on: Vec<JoinOn>,
    /// Cardinality below the parent.
    pub cardinality: Cardinality,
    /// Whether changes of this table are captured.
    pub tracked: bool,
    /// Configured key columns, if any.
    pub key: Option<Vec<String>>,
    /// Include list (empty = all).
    pub include_columns: Vec<String>,
    /// Exclude list.
    pub exclude_columns: Vec<String>,
    /// Excluded from the etag.
    pub exclude_columns_from_etag: Vec<String>,
}

impl TableNode {
    /// `schema.table`.
    pub fn qualified(&self) -> String {
        format!("{}.{}", self.schema, self.table)
    }
}

impl EntityConfig {
    /// The entity's tables, root first, each with its parent resolved.
    /// Assumes [`Config::validate`] passed (unresolvable parents map to the root).
    pub fn nodes(&self) -> Vec<TableNode> {
        let mut nodes = vec![TableNode {
            index: 0,
            parent: None,
            depth: 0,
            name: self.name.clone(),
            schema: self.schema.clone(),
            table: self.table.clone(),
            on: vec![],
            cardinality: Cardinality::OneToOne,
            tracked: true,
            key: self.key.clone(),
            include_columns: self.include_columns.clone(),
            exclude_columns: self.exclude_columns.clone(),
            exclude_columns_from_etag: self.exclude_columns_from_etag.clone(),
        }];
        for (i, j) in self.joins.iter().enumerate() {
            let parent = self.resolve_parent(i).unwrap_or(0);
            let depth = nodes[parent].depth + 1;
            nodes.push(TableNode {
                index: i + 1,
                parent: Some(parent),
                depth,
                name: j.name.clone(),
                schema: j.schema.clone().unwrap_or_else(|| self.schema.clone()),
                table: j.table.clone(),
                on: j.on.clone(),
                cardinality: j.cardinality,
                tracked: j.join_type == JoinType::Cdc,
                key: j.key.clone(),
                include_columns: j.include_columns.clone(),
                exclude_columns: j.exclude_columns.clone(),
                exclude_columns_from_etag: j.exclude_columns_from_etag.clone(),
            });
        }
        nodes
    }

    /// Node index of join `i`'s parent; joins may only refer to the root or
    /// to joins declared before them.
    fn resolve_parent(&self, i: usize) -> Option<usize> {
        let j = &self.joins[i];
        let target = match &j.join_to {
            None => return Some(0),
            Some(t) => t,
        };
        if *target == self.table || *target == self.name {
            return Some(0);
        }
        self.joins[..i]
            .iter()
            .rposition(|p| p.name == *target || p.table == *target)
            .map(|p| p + 1)
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

    /// Parses YAML text (`file` names it in errors), then validates it.
    pub fn from_yaml(text: &str, file: &str) -> Result<Config> {
        let cfg: Config = serde_yaml_ng::from_str(text).map_err(|e| Error::ConfigSyntax {
            file: file.into(),
            message: e.to_string(),
        })?;
        cfg.validate_with(text, file)?;
        Ok(cfg)
    }

    /// Checks what needs no I/O. Line numbers are only known when the YAML
    /// text is at hand, so this names the field path alone.
    pub fn validate(&self) -> Result<()> {
        self.validate_with("", "config")
    }

    fn validate_with(&self, text: &str, file: &str) -> Result<()> {
        let err = |path: &[PathStep], message: String| Error::ConfigInvalid {
            file: file.into(),
            field: render_path(path),
            line: locate_line(text, path),
            message,
        };
        use PathStep::{Idx, Key};
        if !is_identifier(&self.name) {
            return Err(err(
                &[Key("name")],
                "use letters, digits, `_`, `-` or `.` only".into(),
            ));
        }
        if self.source.kind == SourceKind::Postgres {
            for (field, v) in [
                ("slot", &self.source.slot),
                ("publication", &self.source.publication),
            ] {
                if !is_identifier(v) || v.contains(['-', '.']) {
                    return Err(err(
                        &[Key("source"), Key(field)],
                        format!("`{v}` must be a plain identifier (letters, digits, `_`)"),
                    ));
                }
            }
        }
        if self.source.kind == SourceKind::Sqlserver && self.source.poll_interval_ms == 0 {
            return Err(err(
                &[Key("source"), Key("poll_interval_ms")],
                "must be at least 1".into(),
            ));
        }
        if self.transport.partitions == 0 || self.transport.partitions > 1024 {
            return Err(err(
                &[Key("transport"), Key("partitions")],
                "must be between 1 and 1024".into(),
            ));
        }
        if self.transport.channel_capacity == 0 {
            return Err(err(
                &[Key("transport"), Key("channel_capacity")],
                "must be at least 1".into(),
            ));
        }
        if self.transport.kind == TransportKind::Kafka
            && (self.transport.brokers.is_none() || self.transport.topic.is_none())
        {
            return Err(err(
                &[Key("transport"), Key("kind")],
                "kind `kafka` needs `brokers` and `topic`".into(),
            ));
        }
        if self.sink.kind == SinkKind::File && self.sink.path.is_none() {
            return Err(err(
                &[Key("sink"), Key("path")],
                "sink kind `file` needs `path`".into(),
            ));
        }
        if self.sink.kind == SinkKind::Kafka && self.sink.topic_prefix.is_none() {
            return Err(err(
                &[Key("sink"), Key("topic_prefix")],
                "sink kind `kafka` needs `topic_prefix`".into(),
            ));
        }
        if self.transport.kind == TransportKind::Kafka && self.transport.max_batch_records == 0 {
            return Err(err(
                &[Key("transport"), Key("max_batch_records")],
                "must be at least 1".into(),
            ));
        }
        if self.sink.kind == SinkKind::Kafka && self.sink.brokers.is_none() {
            return Err(err(
                &[Key("sink"), Key("brokers")],
                "sink kind `kafka` needs `brokers`".into(),
            ));
        }
        if self.sink.relay_batch < 1 {
            return Err(err(
                &[Key("sink"), Key("relay_batch")],
                "must be at least 1".into(),
            ));
        }
        if self.extractor.max_batch_changes == 0 {
            return Err(err(
                &[Key("extractor"), Key("max_batch_changes")],
                "must be at least 1".into(),
            ));
        }
        if self.entities.is_empty() {
            return Err(err(
                &[Key("entities")],
                "configure at least one entity".into(),
            ));
        }
        for (ei, e) in self.entities.iter().enumerate() {
            let at = |rest: &[PathStep]| {
                let mut p = vec![Key("entities"), Idx(ei)];
                p.extend_from_slice(rest);
                p
            };
            if !is_identifier(&e.name) {
                return Err(err(
                    &at(&[Key("name")]),
                    "use letters, digits, `_`, `-` or `.` only".into(),
                ));
            }
            if self.entities[..ei].iter().any(|o| o.name == e.name) {
                return Err(err(
                    &at(&[Key("name")]),
                    format!("entity `{}` is configured twice", e.name),
                ));
            }
            if e.identifier_mapping {
                return Err(err(
                    &at(&[Key("identifier_mapping")]),
                    "identifier mapping is not implemented yet; set it to false".into(),
                ));
            }
            if matches!(&e.key, Some(k) if k.is_empty()) {
                return Err(err(
                    &at(&[Key("key")]),
                    "must name at least one column".into(),
                ));
            }
            if !e.include_columns.is_empty() && !e.exclude_columns.is_empty() {
                return Err(err(
                    &at(&[Key("exclude_columns")]),
                    "use include_columns or exclude_columns, not both".into(),
                ));
            }
            let mut seen_names = vec![e.name.as_str()];
            for (ji, j) in e.joins.iter().enumerate() {
                let jat = |f: &'static str| at(&[Key("joins"), Idx(ji), Key(f)]);
                if seen_names.contains(&j.name.as_str()) {
                    return Err(err(
                        &jat("name"),
                        format!(
                            "join name `{}` is used twice in entity `{}`",
                            j.name, e.name
                        ),
                    ));
                }
                seen_names.push(&j.name);
                if e.resolve_parent(ji).is_none() {
                    return Err(err(
                        &jat("join_to"),
                        format!(
                            "`{}` is neither the root table `{}` nor a join declared above this one",
                            j.join_to.as_deref().unwrap_or_default(),
                            e.table
                        ),
                    ));
                }
                if j.on.is_empty() {
                    return Err(err(
                        &jat("on"),
                        "a join needs at least one column pair".into(),
                    ));
                }
                if !j.include_columns.is_empty() && !j.exclude_columns.is_empty() {
                    return Err(err(
                        &jat("exclude_columns"),
                        "use include_columns or exclude_columns, not both".into(),
                    ));
                }
            }
        }
        Ok(())
    }

    /// The Kafka consumer group of the appliers: `transport.group` or `skein-<name>`.
    pub fn consumer_group(&self) -> String {
        self.transport
            .group
            .clone()
            .unwrap_or_else(|| format!("skein-{}", self.name))
    }

    /// The sidecar URL (the source's when not configured).
    pub fn sidecar_url(&self) -> &Secret {
        self.sidecar.url.as_ref().unwrap_or(&self.source.url)
    }

    /// Looks an entity up by name.
    pub fn entity(&self, name: &str) -> Option<&EntityConfig> {
        self.entities.iter().find(|e| e.name == name)
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

fn is_identifier(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
}

/// One step of a field path.
#[derive(Clone, Copy, Debug)]
enum PathStep {
    Key(&'static str),
    Idx(usize),
}

fn render_path(path: &[PathStep]) -> String {
    let mut s = String::new();
    for step in path {
        match step {
            PathStep::Key(k) => {
                if !s.is_empty() {
                    s.push('.');
                }
                s.push_str(k);
            }
            PathStep::Idx(i) => s.push_str(&format!("[{i}]")),
        }
    }
    s
}

/// Finds the 1-based line of a field in block-style YAML by indentation.
/// Flow mappings (`{ a: 1 }`) resolve to the line they are on. Returns
/// `None` when the field is not written in the file (e.g. a default).
fn locate_line(text: &str, path: &[PathStep]) -> Option<usize> {
    let lines: Vec<&str> = text.lines().collect();
    // (line index, column of the node's first key)
    let mut start = 0usize;
    let mut end = lines.len();
    let mut found: Option<usize> = None;
    let significant = |l: &str| {
        let t = l.trim_start();
        !t.is_empty() && !t.starts_with('#')
    };
    let indent = |l: &str| l.len() - l.trim_start().len();
    for step in path {
        let body: Vec<usize> = (start..end).filter(|i| significant(lines[*i])).collect();
        match step {
            PathStep::Key(k) => {
                // Keys of this mapping sit at the smallest key column in range.
                let key_col = |l: &str| {
                    let t = l.trim_start();
                    let dash = t
                        .strip_prefix("- ")
                        .map(|r| r.len() - r.trim_start().len() + 2);
                    indent(l) + dash.unwrap_or(0)
                };
                if let Some(f) = found {
                    if lines[f].contains('{') && lines[f].contains(&format!("{k}:")) {
                        return Some(f + 1);
                    }
                }
                let col = body.iter().map(|i| key_col(lines[*i])).min()?;
                let hit = body.iter().copied().find(|i| {
                    let l = lines[*i];
                    key_col(l) == col
                        && l[col..].starts_with(k)
                        && l[col + k.len()..].trim_start().starts_with(':')
                })?;
                let next = body
                    .iter()
                    .copied()
                    .find(|i| *i > hit && key_col(lines[*i]) <= col)
                    .unwrap_or(end);
                found = Some(hit);
                start = hit;
                end = next;
            }
            PathStep::Idx(n) => {
                let items: Vec<usize> = body
                    .iter()
                    .copied()
                    .filter(|i| lines[*i].trim_start().starts_with("- ") || lines[*i].trim() == "-")
                    .collect();
                let col = items.iter().map(|i| indent(lines[*i])).min()?;
                let items: Vec<usize> = items
                    .into_iter()
                    .filter(|i| indent(lines[*i]) == col)
                    .collect();
                let hit = *items.get(*n)?;
                let next = items.get(n + 1).copied().unwrap_or(end);
                found = Some(hit);
                start = hit;
                end = next;
            }
        }
    }
    found.map(|f| f + 1)
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
        assert_eq!(c.transport.partitions, DEFAULT_PARTITIONS);
        assert!(
            !format!("{c:?}").contains("secret"),
            "Debug must hide secrets"
        );
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
        assert_eq!(c.consumer_group(), format!("skein-{}", c.name));
        assert_eq!(
            c.transport.kafka_properties["sasl.password"].expose(),
            "hunter2"
        );
        assert!(
            !format!("{c:?}").contains("hunter2"),
            "Debug must hide secrets"
        );
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
    fn identifier_mapping_is_refused_until_implemented() {
        let bad = SAMPLE.replace(
            "is_deleted_column: is_deleted",
            "is_deleted_column: is_deleted\n    identifier_mapping: true",
        );
        let e = Config::from_yaml(&bad, "t.yaml").unwrap_err().to_string();
        assert!(e.contains("identifier_mapping"), "{e}");
    }
}
