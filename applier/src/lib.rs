//! # skein-applier
//!
//! Turns change records into entity events, exactly once into the outbox:
//!
//! 1. drop records at or before the partition's committed progress;
//! 2. [`decide::consolidate`] per (entity, root key);
//! 3. [`hydrate`] the latest state from the source, one query per table;
//! 4. version: SHA-256 of the canonical JSON, unchanged → no event;
//! 5. build CloudEvents ([`event`]);
//! 6. one [`sidecar`] transaction: outbox + versions + batch row + progress,
//!    the latter only if it still holds the value this applier started from.
//!
//! The [`relay`] then moves outbox rows to a [`sink`], at least once with a
//! stable event id.

pub mod decide;
pub mod error;
pub mod event;
pub mod hydrate;
pub mod relay;
pub mod sidecar;
pub mod sink;

use std::collections::HashMap;
use std::time::Instant;

use skein_common::config::Config;
use skein_common::{ChangeRecord, SourcePosition};
use skein_sql::Catalog;
use tracing::info;

use decide::{consolidate, decide, Action};
pub use error::{Error, Result};
use event::{build_event, EventContext};
use hydrate::EntityHydrator;
pub use hydrate::Source;
use sidecar::{BatchCommit, OutboxRow, Progress, Sidecar, VersionRow};
use skein_common::failpoint::failpoint;

/// Opens a PostgreSQL connection (`what`: "source", "sidecar"); its
/// connection task is spawned and ends when the client is dropped.
pub(crate) async fn connect_postgres(
    url: &str,
    what: &'static str,
) -> Result<tokio_postgres::Client> {
    let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .map_err(error::db(format!("connecting to the {what}")))?;
    tokio::spawn(async move {
        if let Err(e) = conn.await {
            tracing::debug!(error = %e, "{what} connection closed");
        }
    });
    Ok(client)
}

/// Progress topic name used by the in-process transport.
pub const IN_PROCESS_TOPIC: &str = "in-process";

/// What one applied batch did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Applied {
    /// Records after dropping already-applied positions.
    pub records: usize,
    /// Aggregates touched.
    pub entities: usize,
    /// Events written to the outbox.
    pub events: usize,
    /// The sidecar batch id, when a transaction was committed.
    pub batch_id: Option<i64>,
}

/// What the applier's progress counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProgressKind {
    /// In-process: progress is the source upper bound of the last batch.
    Source,
    /// Kafka: progress is the next offset; re-sent records (an extractor that
    /// crashed between broker ack and marker write) are dropped by their
    /// source position.
    Offset,
}

/// A batch as the applier sees it, whatever the transport.
pub struct Input<'a> {
    /// Exclusive lower bound (for the batch row; Kafka: the first offset).
    /// In-process positions are [`SourcePosition::numeric`].
    pub lower: i128,
    /// The progress to commit (in-process: the source upper bound; Kafka: next offset).
    pub upper: i128,
    /// Source reported lost changes.
    pub has_data_loss: bool,
    /// Records in position order.
    pub records: &'a [ChangeRecord],
    /// Records of this batch sent to the dead-letter topic.
    pub dead_letters: i32,
    /// What `lower`/`upper` count.
    pub kind: ProgressKind,
}

/// One partition's applier.
pub struct Applier<S: Sidecar> {
    cfg: Config,
    source: Source,
    sidecar: S,
    hydrators: HashMap<String, EntityHydrator>,
    topic: String,
    partition: u32,
    progress: Option<Option<Progress>>,
}

impl<S: Sidecar> Applier<S> {
    /// Creates an applier for one partition, reading state through `source`.
    pub fn new(
        cfg: &Config,
        catalog: &Catalog,
        source: Source,
        sidecar: S,
        topic: &str,
        partition: u32,
    ) -> Self {
        let hydrators = cfg
            .entities
            .iter()
            .map(|e| {
                (
                    e.name.clone(),
                    EntityHydrator::new(e, catalog, source.dialect()),
                )
            })
            .collect();
        Applier {
            cfg: cfg.clone(),
            source,
            sidecar,
            hydrators,
            topic: topic.to_string(),
            partition,
            progress: None,
        }
    }

    /// The partition.
    pub fn partition(&self) -> u32 {
        self.partition
    }

    /// The committed progress (read from the sidecar once, then tracked).
    pub async fn progress(&mut self) -> Result<Option<Progress>> {
        if let Some(p) = self.progress {
            return Ok(p);
        }
        let p = self
            .sidecar
            .progress(&self.cfg.name, &self.topic, self.partition)
            .await?;
        self.progress = Some(p);
        Ok(p)
    }

    /// The progress this applier believes is committed, if it has read it.
    pub fn cached_progress(&self) -> Option<Option<Progress>> {
        self.progress
    }

    /// Forgets the cached progress (after a fence or a reassignment).
    pub fn reset_progress(&mut self) {
        self.progress = None;
    }

    /// Applies one batch. Records at or before the stored progress are
    /// dropped; if nothing is left, nothing is written (in-process) or only
    /// progress moves (Kafka, so the offset reaches the log end).
    pub async fn apply(&mut self, input: Input<'_>) -> Result<Applied> {
        let started = Instant::now();
        let expected = self.progress().await?;
        let floor = expected.map(|p| p.position).unwrap_or(i128::MIN);
        if input.upper <= floor {
            return Ok(Applied::default());
        }
        let applied_source = expected.and_then(|p| p.source);
        // A record re-sent by an extractor that crashed before writing its
        // marker is at or before what was applied, or (when the original is
        // in this same batch) an exact repeat of one here: one source
        // change resolves to at most one record per (entity, root).
        let mut seen = std::collections::HashSet::new();
        let records: Vec<ChangeRecord> = input
            .records
            .iter()
            .filter(|r| match input.kind {
                ProgressKind::Source => r.position.commit.numeric() > floor,
                ProgressKind::Offset => applied_source.is_none_or(|s| r.position > s),
            })
            .filter(|r| seen.insert((r.position, &r.entity, &r.root_key)))
            .cloned()
            .collect();
        let dropped = input.records.len() - records.len();
        if records.is_empty()
            && !input.has_data_loss
            && input.dead_letters == 0
            && (input.kind == ProgressKind::Source || input.records.is_empty())
        {
            return Ok(Applied::default());
        }
        let source_after = records.iter().map(|r| r.position).max().max(applied_source);
        let correlation_id = uuid::Uuid::now_v7().to_string();
        let consolidated = consolidate(&records);

        // Hydrate and load versions per entity, batched.
        let mut by_entity: HashMap<&str, Vec<usize>> = HashMap::new();
        for (i, c) in consolidated.iter().enumerate() {
            by_entity.entry(c.entity.as_str()).or_default().push(i);
        }
        let mut outbox = vec![];
        let mut versions = vec![];
        for (entity, idxs) in by_entity {
            let Some(h) = self.hydrators.get(entity) else {
                return Err(Error::Data(format!("record for unknown entity `{entity}`")));
            };
            let keys: Vec<_> = idxs.iter().map(|i| consolidated[*i].key.clone()).collect();
            let current = h.hydrate(&mut self.source, &keys).await?;
            let canon: Vec<String> = keys.iter().map(|k| k.canonical()).collect();
            let stored = self.sidecar.versions(entity, &canon).await?;
            for ((i, cur), ck) in idxs.iter().zip(&current).zip(&canon) {
                let c = &consolidated[*i];
                let Some(d) = decide(c, cur, stored.get(ck), &h.delete_payload(&c.key)) else {
                    continue;
                };
                let id = uuid::Uuid::now_v7().to_string();
                let ev = build_event(
                    &EventContext {
                        events: &self.cfg.events,
                        entity: h.entity(),
                        id: &id,
                        correlation_id: &correlation_id,
                        time_micros: c.commit_time_micros,
                    },
                    &c.key,
                    &d,
                );
                outbox.push((
                    c.last_position,
                    OutboxRow {
                        event_id: id,
                        entity: entity.to_string(),
                        key: ck.clone(),
                        etag: d.etag.clone(),
                        event: ev.to_string(),
                        commit_time_micros: c.commit_time_micros,
                    },
                ));
                versions.push(VersionRow {
                    entity: entity.to_string(),
                    key: ck.clone(),
                    etag: d.etag.clone(),
                    is_deleted: d.action == Action::Deleted,
                });
            }
        }
        // Outbox ids follow source order of each aggregate's last change.
        outbox.sort_by_key(|(pos, _)| *pos);
        let outbox: Vec<OutboxRow> = outbox.into_iter().map(|(_, o)| o).collect();
        let commit = BatchCommit {
            group: self.cfg.name.clone(),
            topic: self.topic.clone(),
            partition: self.partition,
            expected: expected.map(|p| p.position),
            position: input.upper,
            source: source_after,
            dead_letters: input.dead_letters,
            lower: input.lower,
            upper: input.upper,
            correlation_id,
            record_count: records.len() as i32,
            entity_count: consolidated.len() as i32,
            has_data_loss: input.has_data_loss,
            outbox,
            versions,
        };
        failpoint("applier.before_sidecar");
        let result = self.sidecar.commit(&commit).await;
        let batch_id = match result {
            Ok(id) => id,
            Err(e) => {
                // Unknown outcome or fenced: read progress again next time.
                self.progress = None;
                return Err(e);
            }
        };
        failpoint("applier.after_sidecar");
        self.progress = Some(Some(Progress {
            position: input.upper,
            source: source_after,
        }));
        let applied = Applied {
            records: records.len(),
            entities: consolidated.len(),
            events: commit.outbox.len(),
            batch_id: Some(batch_id),
        };
        let upper = match input.kind {
            ProgressKind::Source => {
                SourcePosition::describe_numeric(self.cfg.source.kind.dialect(), input.upper)
            }
            ProgressKind::Offset => format!("offset {}", input.upper),
        };
        info!(
            partition = self.partition,
            batch_id,
            upper = %upper,
            records = applied.records,
            duplicates = dropped,
            dead_letters = input.dead_letters,
            entities = applied.entities,
            events = applied.events,
            ms = started.elapsed().as_millis() as u64,
            "batch committed"
        );
        Ok(applied)
    }
}
