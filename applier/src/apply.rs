//! One partition's applier: a delivery in, one fenced sidecar transaction
//! out.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::FutureExt;
use skein_common::config::Config;
use skein_common::failpoint::{failpoint, failpoint_result};
use skein_common::record::{partition_for, transport_key, Op};
use skein_common::{ChangeRecord, Checkpoint, CheckpointKind, Dialect, RootKey};
use skein_sql::postgres::{check_schema_change, describe_change, schema_stop};
use skein_sql::Catalog;
use skein_transporter::Delivery;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::coverage::{coverable, Coverage, Snapshot};
use crate::decide::{consolidate, decide, decide_explicit, Action, Consolidated, Current};
use crate::error::{Error, Result};
use crate::event::{event_text, EventContext};
use crate::fresh::{fresh, Fresh};
use crate::hydrate::{EntityHydrator, Source};
use crate::identifiers::{namespace, Plan, Wanted};
use crate::known::KnownVersions;
use crate::sidecar::{BatchCommit, IdentifierRow, OutboxRow, Progress, Sidecar, VersionRow};
use serde_json::Value;

/// Reads the latest state of each entity's aggregates, in order.
async fn hydrate_all(
    hydrators: &HashMap<String, EntityHydrator>,
    source: &mut Source,
    by_entity: &[(&str, Vec<usize>, Vec<RootKey>)],
) -> Result<Vec<Vec<Current>>> {
    let mut out = Vec::with_capacity(by_entity.len());
    for (entity, _, keys) in by_entity {
        let Some(h) = hydrators.get(*entity) else {
            return Err(Error::Data(format!("record for unknown entity `{entity}`")));
        };
        out.push(h.hydrate(source, keys).await?);
    }
    Ok(out)
}

/// Every entity's hydrator, rendered from `catalog`.
/// Each entity's identifier mapping below the root.
fn plans(cfg: &Config, catalog: &Catalog) -> Result<HashMap<String, Plan>> {
    cfg.entities
        .iter()
        .map(|e| Ok((e.name.clone(), Plan::new(cfg, e, catalog)?)))
        .collect()
}

/// Per namespace of a table that is the root of a mapping entity with a
/// `global_id_column` (the first such entity): a hydrator of the root row
/// alone, and the column. References into the table read the column's
/// value through it: the row's pre-assigned id.
type IdSources = HashMap<String, (EntityHydrator, String)>;

fn id_sources(cfg: &Config, catalog: &Catalog, source: &Source) -> IdSources {
    let mut out = IdSources::new();
    for e in cfg.entities.iter().filter(|e| e.identifier_mapping) {
        let Some(col) = e.global_id_column.clone() else {
            continue;
        };
        out.entry(namespace(&e.schema, &e.table))
            .or_insert_with(|| {
                let mut root = e.clone();
                root.joins.clear();
                (EntityHydrator::new(&root, catalog, source.dialect()), col)
            });
    }
    out
}

/// The pre-assigned id of the rows the `hydrated` aggregates reference in
/// a namespace of `sources`, read in the batch's snapshot, one query per
/// namespace: `Some` value of the column, or `None` where the row has
/// none (one is generated). A row the source does not have is absent: its
/// id is the stored one if any, else none yet.
async fn referenced_preassigned(
    plans: &HashMap<String, Plan>,
    sources: &IdSources,
    source: &mut Source,
    by_entity: &[(&str, Vec<usize>, Vec<RootKey>)],
    hydrated: &[Vec<Current>],
) -> Result<HashMap<Wanted, Option<String>>> {
    let mut by_ns: HashMap<&str, Vec<String>> = HashMap::new();
    for ((entity, _, _), current) in by_entity.iter().zip(hydrated) {
        let Some(plan) = plans.get(*entity) else {
            continue;
        };
        for c in current {
            if let Current::Present { data, .. } = c {
                for (ns, key) in plan.wanted(data) {
                    if let Some((ns, _)) = sources.get_key_value(&ns) {
                        by_ns.entry(ns.as_str()).or_default().push(key);
                    }
                }
            }
        }
    }
    let mut out = HashMap::new();
    for (ns, mut keys) in by_ns {
        keys.sort();
        keys.dedup();
        let (keys, roots): (Vec<String>, Vec<RootKey>) = keys
            .into_iter()
            .filter_map(|k| RootKey::from_canonical(&k).map(|r| (k, r)))
            .unzip();
        let (h, col) = &sources[ns];
        for (k, c) in keys.into_iter().zip(h.hydrate(source, &roots).await?) {
            if let Current::Present { data, .. } = c {
                let value = data.get(col).and_then(preassigned);
                out.insert((ns.to_string(), k), value);
            }
        }
    }
    Ok(out)
}

/// A `global_id_column` value as an id: none when null or empty.
fn preassigned(v: &Value) -> Option<String> {
    match v {
        Value::Null => None,
        Value::String(s) if s.is_empty() => None,
        Value::String(s) => Some(s.clone()),
        other => Some(other.to_string()),
    }
}

fn hydrators(cfg: &Config, catalog: &Catalog, source: &Source) -> HashMap<String, EntityHydrator> {
    cfg.entities
        .iter()
        .map(|e| {
            (
                e.name.clone(),
                EntityHydrator::new(e, catalog, source.dialect()),
            )
        })
        .collect()
}

/// How one batch transaction of a delivery moves the progress.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Step {
    /// The new progress position.
    position: i128,
    /// The last source change applied after it.
    source: Option<skein_common::ChangePosition>,
    /// The TRUNCATE re-check cursor after it.
    recheck_after: Option<String>,
    /// Records of the delivery dropped as applied (for the log).
    dropped: usize,
    /// The delivery's last step: carries its dead letters and loss notice.
    last: bool,
}

/// The global identifier of an aggregate's event (`identifier_mapping`),
/// and whether it is new (to be stored with the event): the stored one;
/// else, for an event that is not a delete, the value of the pre-assigned
/// `column` in the event's data when it has one, or a new UUID v7. A delete
/// of an aggregate that never had one gets none.
pub fn global_id(
    stored: Option<&String>,
    d: &crate::decide::Decision,
    column: Option<&str>,
) -> (Option<String>, bool) {
    if let Some(g) = stored {
        return (Some(g.clone()), false);
    }
    if d.action == Action::Deleted {
        return (None, false);
    }
    let preassigned = column.and_then(|c| d.data.get(c)).and_then(preassigned);
    (
        Some(preassigned.unwrap_or_else(|| uuid::Uuid::now_v7().to_string())),
        true,
    )
}

/// What a batch transaction carries besides its aggregates.
struct BatchMeta {
    /// Batch bounds (the batch row).
    lower: i128,
    upper: i128,
    /// The upper bound as the log shows it.
    upper_text: String,
    dead_letters: i32,
    has_data_loss: bool,
    /// Records (or queued explicit keys) applied.
    records: usize,
    /// Source transactions the hydration snapshot must see.
    xids: Vec<u64>,
    /// Queued explicit keys the batch takes off the queue.
    explicit: Vec<i64>,
    /// What the batch applies (a metrics label).
    trigger: Trigger,
    /// Aggregates not read again: the snapshot they were last decided in
    /// covers them ([`crate::coverage`]). Read after all if the catalog
    /// changed.
    covered: Vec<Consolidated>,
    /// Whether what the batch decides is remembered for coverage (change
    /// batches on PostgreSQL).
    remember: bool,
}

/// What a batch transaction applies: source changes, a TRUNCATE's
/// re-check of published keys, or explicit keys. Metrics keep them apart:
/// only changes are records read from the source, and only their events
/// have a source commit time to measure latency from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Trigger {
    Change,
    TruncateRecheck,
    Explicit,
}

impl Trigger {
    fn label(self) -> &'static str {
        match self {
            Trigger::Change => "change",
            Trigger::TruncateRecheck => "truncate_recheck",
            Trigger::Explicit => "explicit",
        }
    }
}

/// What one applied batch did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Applied {
    /// Records after dropping already-applied positions.
    pub records: usize,
    /// Aggregates touched.
    pub entities: usize,
    /// Events written to the outbox.
    pub events: usize,
    /// The sidecar batch id, when a transaction was committed (the last,
    /// when a delivery took several).
    pub batch_id: Option<i64>,
}

impl Applied {
    /// Adds what another step of the same delivery did.
    fn add(&mut self, other: Applied) {
        self.records += other.records;
        self.entities += other.entities;
        self.events += other.events;
        self.batch_id = other.batch_id.or(self.batch_id);
    }
}

/// One partition's applier.
pub struct Applier<S: Sidecar> {
    cfg: Config,
    source: Source,
    sidecar: S,
    /// The catalog `hydrators` were rendered from.
    catalog: Catalog,
    hydrators: HashMap<String, EntityHydrator>,
    /// Each entity's identifier mapping below the root, over `catalog`.
    plans: HashMap<String, Plan>,
    /// Where references read pre-assigned ids, over `catalog`.
    id_sources: IdSources,
    topic: String,
    partition: u32,
    kind: CheckpointKind,
    progress: Option<Option<Progress>>,
    /// Whether this applier has claimed the partition (bumped its epoch)
    /// since it last took it.
    claimed: bool,
    /// The snapshot each aggregate was last decided in, while this
    /// applier owns the partition.
    coverage: Coverage,
    /// The stored versions this owner read or wrote.
    known: KnownVersions,
    /// The stop: a delivery of several steps (a TRUNCATE re-check) ends
    /// after the step under way ([`Error::Interrupted`]).
    interrupt: CancellationToken,
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
        kind: CheckpointKind,
    ) -> Result<Self> {
        let hydrators = hydrators(cfg, catalog, &source);
        let id_sources = id_sources(cfg, catalog, &source);
        Ok(Applier {
            id_sources,
            cfg: cfg.clone(),
            source,
            sidecar,
            catalog: catalog.clone(),
            plans: plans(cfg, catalog)?,
            hydrators,
            topic: topic.to_string(),
            partition,
            kind,
            progress: None,
            claimed: false,
            coverage: Coverage::default(),
            known: KnownVersions::default(),
            interrupt: CancellationToken::new(),
        })
    }

    /// Once `interrupt` fires, a delivery of several committed steps (a
    /// TRUNCATE re-check's pages) stops after the step under way.
    pub fn interrupted_by(&mut self, interrupt: CancellationToken) {
        self.interrupt = interrupt;
    }

    /// Renders the hydration queries again when the catalog the open
    /// snapshot sees differs from the one they were rendered from: a column
    /// the config does not name may come (it shows in the aggregates' next
    /// events, so their etags change) or go. A change the config cannot
    /// follow ([`check_schema_change`]) stops the applier with
    /// [`Error::Schema`], before anything of the batch is written.
    ///
    /// Read in every batch's snapshot, not on the extractor's Relation
    /// messages: an applier over Kafka never sees those, and only the
    /// snapshot's own catalog is the one its queries run against.
    ///
    /// `now`: the catalog as the batch's snapshot sees it
    /// ([`Source::begin_snapshot`]). Returns whether it changed.
    fn follow_schema(&mut self, now: Option<Catalog>) -> Result<bool> {
        let Some(now) = now else {
            return Ok(false);
        };
        if now == self.catalog {
            return Ok(false);
        }
        // Each dialect's own type rules and fixes.
        let stop = match self.source.dialect() {
            Dialect::Postgres => {
                let problems = check_schema_change(&self.cfg, &self.catalog, &now);
                (!problems.is_empty()).then(|| schema_stop(&problems))
            }
            Dialect::SqlServer => {
                use skein_sql::sqlserver::schema as ms;
                let problems = ms::check_schema_change(&self.cfg, &self.catalog, &now);
                (!problems.is_empty()).then(|| ms::schema_stop(&problems))
            }
        };
        if let Some((message, fix)) = stop {
            return Err(Error::Schema { message, fix });
        }
        info!(
            partition = self.partition,
            changes = ?describe_change(&self.catalog, &now),
            "the source's schema changed; hydration follows it"
        );
        self.plans = plans(&self.cfg, &now)?;
        self.hydrators = hydrators(&self.cfg, &now, &self.source);
        self.id_sources = id_sources(&self.cfg, &now, &self.source);
        self.catalog = now;
        // What was decided under the old catalog covers nothing.
        self.coverage.clear();
        Ok(true)
    }

    /// The partition.
    pub fn partition(&self) -> u32 {
        self.partition
    }

    /// The committed progress (read from the sidecar once, then tracked).
    /// The first read after taking the partition claims it: the epoch is
    /// bumped, so an applier that held it before is fenced.
    pub async fn progress(&mut self) -> Result<Option<Progress>> {
        if let Some(p) = &self.progress {
            return Ok(p.clone());
        }
        let (group, topic, p) = (&self.cfg.name, &self.topic, self.partition);
        let p = if self.claimed {
            self.sidecar.progress(group, topic, p).await?
        } else {
            let claimed = self.sidecar.claim(group, topic, p).await?;
            self.claimed = true;
            claimed
        };
        self.progress = Some(p.clone());
        Ok(p)
    }

    /// The committed progress as a checkpoint (where the transport resumes).
    pub async fn checkpoint(&mut self) -> Result<Option<Checkpoint>> {
        let kind = self.kind;
        self.progress()
            .await?
            .map(|p| {
                Checkpoint::from_numeric(kind, p.position)
                    .map_err(|e| Error::Data(format!("stored progress: {e}")))
            })
            .transpose()
    }

    /// The progress this applier believes is committed, if it has read it.
    pub fn cached_progress(&self) -> Option<Option<Progress>> {
        self.progress.clone()
    }

    /// Forgets the cached progress (after a fence, or idle to look
    /// again), and what it decided: another writer may have moved on.
    pub fn reset_progress(&mut self) {
        self.progress = None;
        self.forget();
    }

    /// After a fence: another applier took the partition. The next read of
    /// the progress claims it again (a new epoch) rather than adopting the
    /// other's: an applier that carried on under the other's epoch would
    /// not be fenced by its commits that leave the position where it is
    /// (explicit keys, TRUNCATE re-check pages), and would decide on
    /// stored versions it no longer knows. Two appliers that both go on
    /// fence each other in turn until one stops (over Kafka, the revoked
    /// one); each commit is still made from the stored progress.
    pub fn fenced(&mut self) {
        self.taken_over();
    }

    /// Forgets what this owner remembers of its aggregates (coverage and
    /// stored versions): another writer may have moved on, or a commit's
    /// outcome is unknown.
    fn forget(&mut self) {
        self.coverage.clear();
        self.known.clear();
    }

    /// The partition changed hands (assigned or revoked): forget the
    /// progress and claim the partition again at the next read.
    pub fn taken_over(&mut self) {
        self.progress = None;
        self.claimed = false;
        self.forget();
    }

    /// Applies one delivery: drops what the committed progress covers
    /// ([`fresh`]), consolidates, hydrates, versions and commits the batch
    /// in one fenced sidecar transaction. Returns what it did; a delivery
    /// with nothing new writes nothing.
    ///
    /// A delivery with truncate notices is committed in steps, each its
    /// own fenced transaction: the records before a notice; then the
    /// notice's re-check, a page of published keys per step (see
    /// [`Applier::recheck`]); then what follows. Every step but the last
    /// leaves the progress position where it was and moves only the last
    /// source change (and the re-check cursor), so a crash in between
    /// resumes at the next step: memory and transaction size are a page,
    /// whatever the entity's size.
    pub async fn apply(&mut self, d: &Delivery) -> Result<Applied> {
        let expected = self.progress().await?;
        let (records, dropped, source_after) = match fresh(d, expected.as_ref()) {
            Fresh::Applied | Fresh::Nothing => return Ok(Applied::default()),
            Fresh::Apply {
                records,
                dropped,
                source_after,
            } => (records, dropped, source_after),
        };
        let last = Step {
            // Never back: an in-process part below the progress (see
            // `fresh`) leaves it where it is.
            position: d
                .upper
                .numeric()
                .max(expected.as_ref().map_or(i128::MIN, |p| p.position)),
            source: source_after,
            // A delivery that ends before the notice of a re-check under
            // way (over Kafka, a shorter delivery from the same position)
            // keeps the cursor: the next one resumes it.
            recheck_after: expected
                .as_ref()
                .filter(|p| {
                    p.source == source_after
                        && !records
                            .iter()
                            .any(|r| r.op == Op::Truncate && Some(r.position) == p.source)
                })
                .and_then(|p| p.recheck_after.clone()),
            dropped,
            last: true,
        };
        if !records.iter().any(|r| r.op == Op::Truncate) {
            return self.commit_step(d, &records, last, Trigger::Change).await;
        }
        let mut total = Applied::default();
        let mut before: Vec<ChangeRecord> = vec![];
        let mut records = records.into_owned().into_iter().peekable();
        while let Some(r) = records.next() {
            if r.op != Op::Truncate {
                before.push(r);
                continue;
            }
            // `TRUNCATE customer, address, contact` is a notice per table:
            // the last of a run of one entity's re-checks them all (state
            // is read as it is now).
            if records
                .peek()
                .is_some_and(|n| n.op == Op::Truncate && n.entity == r.entity)
            {
                continue;
            }
            if !before.is_empty() {
                let step = self.intermediate(d, before.last().map(|b| b.position), None);
                total.add(self.commit_step(d, &before, step, Trigger::Change).await?);
                before.clear();
            }
            total.add(self.recheck(d, &r).await?);
        }
        total.add(self.commit_step(d, &before, last, Trigger::Change).await?);
        Ok(total)
    }

    /// A step that is not a delivery's last: the position stays where the
    /// committed progress is, the last source change moves to `source`.
    ///
    /// Before the partition's first commit the position is the delivery's
    /// lower bound: in-process the batch's lower position (everything of
    /// this partition at or before it is applied: there was nothing), over
    /// Kafka its first offset (where consumption started).
    fn intermediate(
        &self,
        d: &Delivery,
        source: Option<skein_common::ChangePosition>,
        recheck_after: Option<String>,
    ) -> Step {
        let at = self.progress.clone().flatten();
        Step {
            position: at.as_ref().map_or(d.lower.numeric(), |p| p.position),
            source: source.max(at.and_then(|p| p.source)),
            recheck_after,
            dropped: 0,
            last: false,
        }
    }

    /// Re-checks, after a TRUNCATE, every aggregate of the notice's entity
    /// that this partition published and did not delete: one
    /// [`Op::Truncate`] record per aggregate, at the notice's position;
    /// consolidation then re-checks each ([`crate::decide`]: gone →
    /// deleted, present → updated when its etag changed). Every earlier
    /// record of the partition is committed before, so no published
    /// aggregate is missed.
    ///
    /// Keys come in pages of `extractor.max_batch_changes` in key order,
    /// each page a step; the progress records the notice and the last key
    /// of the page, and a re-check found under way (a crash, a fence, a new
    /// owner) resumes after it.
    async fn recheck(&mut self, d: &Delivery, notice: &ChangeRecord) -> Result<Applied> {
        let partitions = self.cfg.transport.partitions();
        let page = i64::try_from(self.cfg.extractor.max_batch_changes.max(1)).unwrap_or(i64::MAX);
        // The re-check decides aggregates no record names.
        self.forget();
        let at = self.progress().await?;
        let mut after = at
            .filter(|p| p.source == Some(notice.position))
            .and_then(|p| p.recheck_after);
        if after.is_none() {
            info!(
                partition = self.partition,
                entity = %notice.entity,
                table = %notice.table,
                "a TRUNCATE: re-checking the aggregates this partition published"
            );
        } else {
            info!(partition = self.partition, entity = %notice.entity, after = ?after,
                "resuming a TRUNCATE re-check");
        }
        let mut total = Applied::default();
        loop {
            let keys = self
                .sidecar
                .published_keys(&notice.entity, after.as_deref(), page)
                .await?;
            let done = (keys.len() as i64) < page;
            let mut mine = Vec::with_capacity(keys.len());
            for k in &keys {
                let key = RootKey::from_canonical(k)
                    .ok_or_else(|| Error::Data(format!("stored version key `{k}` is not a key")))?;
                if partition_for(&transport_key(&notice.entity, &key), partitions) == self.partition
                {
                    mine.push(ChangeRecord {
                        root_key: key,
                        ..notice.clone()
                    });
                }
            }
            after = if done { None } else { keys.last().cloned() };
            if mine.is_empty() && !done {
                // Nothing of this partition's: no transaction for it (a
                // crash reads such pages again, which costs no hydration).
                continue;
            }
            let step = self.intermediate(d, Some(notice.position), after.clone());
            total.add(
                self.commit_step(d, &mine, step, Trigger::TruncateRecheck)
                    .await?,
            );
            if done {
                return Ok(total);
            }
            failpoint("applier.after_recheck_page");
            if self.interrupt.is_cancelled() {
                info!(partition = self.partition, entity = %notice.entity, after = ?after,
                    "stopping a TRUNCATE re-check between pages; it resumes after the last key re-checked");
                return Err(Error::Interrupted {
                    partition: self.partition,
                });
            }
        }
    }

    /// Consolidates, hydrates, versions and commits `records` as one batch
    /// transaction, moving the progress as `step` says.
    async fn commit_step(
        &mut self,
        d: &Delivery,
        records: &[ChangeRecord],
        step: Step,
        trigger: Trigger,
    ) -> Result<Applied> {
        let remember = trigger == Trigger::Change && self.source.dialect() == Dialect::Postgres;
        let covered = if remember {
            self.coverage.covered(records, Instant::now())
        } else {
            Default::default()
        };
        let is_covered = |r: &ChangeRecord| covered.contains(&(r.entity.as_str(), &r.root_key));
        // Normal PostgreSQL ids only (0-2 are special), of the records read.
        let mut xids: Vec<u64> = records
            .iter()
            .filter(|r| !is_covered(r))
            .map(|r| r.tx_id)
            .filter(|x| *x >= 3)
            .collect();
        xids.sort_unstable();
        xids.dedup();
        let (covered, consolidated): (Vec<Consolidated>, Vec<Consolidated>) = consolidate(records)
            .into_iter()
            .partition(|c| covered.contains(&(c.entity.as_str(), &c.key)));
        let batch = BatchMeta {
            lower: d.lower.numeric(),
            upper: d.upper.numeric(),
            upper_text: d.upper.to_string(),
            // A delivery's dead letters and loss notice go with its last step.
            dead_letters: if step.last { d.dead_letters } else { 0 },
            has_data_loss: step.last && d.has_data_loss,
            records: records.len(),
            xids,
            explicit: vec![],
            trigger,
            covered,
            remember,
        };
        self.commit_aggregates(consolidated, batch, step).await
    }

    /// Publishes what the explicit queue holds for this partition
    /// ([`crate::explicit`]): at most a page of keys, in one batch
    /// transaction that takes them off the queue. The progress stays where
    /// it is (the stream's records are untouched) but the commit is fenced
    /// like the stream's, so it is serialised with them: every event of an
    /// aggregate is written by its partition's one applier, each from state
    /// read after the previous one was committed, so none can carry an
    /// older state than the event before it.
    ///
    /// Returns what it did; nothing queued writes nothing.
    pub async fn explicit_once(&mut self) -> Result<Applied> {
        let page = i64::try_from(self.cfg.extractor.max_batch_changes.max(1)).unwrap_or(i64::MAX);
        let expected = self.progress().await?;
        let items = self
            .sidecar
            .explicit_pending(
                &self.cfg.name,
                &self.topic,
                self.partition,
                self.cfg.transport.partitions(),
                page,
            )
            .await?;
        if items.is_empty() {
            return Ok(Applied::default());
        }
        // Keys queued under another partition count (`transport.partitions`
        // changed since) belong to another partition's applier now: moved
        // there, not published here, so each aggregate keeps one writer.
        let partitions = self.cfg.transport.partitions();
        let (items, moved): (Vec<_>, Vec<_>) = items.into_iter().partition(|it| {
            RootKey::from_canonical(&it.key).is_none_or(|k| {
                partition_for(&transport_key(&it.entity, &k), partitions) == self.partition
            })
        });
        if !moved.is_empty() {
            let moves: Vec<(i64, u32)> = moved
                .iter()
                .filter_map(|it| {
                    let k = RootKey::from_canonical(&it.key)?;
                    Some((
                        it.id,
                        partition_for(&transport_key(&it.entity, &k), partitions),
                    ))
                })
                .collect();
            info!(
                partition = self.partition,
                keys = moves.len(),
                "explicit keys queued under another partition count: moved to their partitions"
            );
            self.sidecar.explicit_requeue(&moves).await?;
            if items.is_empty() {
                return Ok(Applied {
                    records: moves.len(),
                    ..Applied::default()
                });
            }
        }
        let now = chrono::Utc::now().timestamp_micros();
        let at = expected
            .as_ref()
            .and_then(|p| p.source)
            .unwrap_or(skein_common::ChangePosition {
                commit: skein_common::PgLsn(0).into(),
                seq: 0,
            });
        // One aggregate queued twice (two runs) is published once, with a
        // republish if either asked for one.
        let mut consolidated: Vec<crate::decide::Consolidated> = vec![];
        let mut index: HashMap<(String, String), usize> = HashMap::new();
        for it in &items {
            let key = RootKey::from_canonical(&it.key).ok_or_else(|| {
                Error::Data(format!("queued explicit key `{}` is not a key", it.key))
            })?;
            // An entity no longer in the config: nothing to publish it as;
            // the key leaves the queue with the batch.
            if !self.hydrators.contains_key(&it.entity) {
                warn!(partition = self.partition, entity = %it.entity, key = %it.key,
                    "a queued explicit key of an entity no longer in the config is dropped");
                continue;
            }
            match index.get(&(it.entity.clone(), it.key.clone())) {
                Some(i) => {
                    let c = &mut consolidated[*i];
                    c.explicit = Some(c.explicit == Some(true) || it.republish);
                    c.records += 1;
                }
                None => {
                    index.insert((it.entity.clone(), it.key.clone()), consolidated.len());
                    consolidated.push(crate::decide::Consolidated::explicit(
                        &it.entity,
                        key,
                        it.republish,
                        at,
                        now,
                    ));
                }
            }
        }
        let position = expected.as_ref().map_or(0, |p| p.position);
        let step = Step {
            position,
            source: expected.as_ref().and_then(|p| p.source),
            recheck_after: expected.as_ref().and_then(|p| p.recheck_after.clone()),
            dropped: 0,
            last: true,
        };
        let batch = BatchMeta {
            lower: position,
            upper: position,
            upper_text: "explicit".into(),
            dead_letters: 0,
            has_data_loss: false,
            records: items.len(),
            xids: vec![],
            explicit: items.iter().map(|i| i.id).collect(),
            trigger: Trigger::Explicit,
            covered: vec![],
            remember: false,
        };
        self.commit_aggregates(consolidated, batch, step).await
    }

    /// Hydrates, versions and commits consolidated aggregates as one batch
    /// transaction, moving the progress as `step` says.
    async fn commit_aggregates(
        &mut self,
        mut consolidated: Vec<Consolidated>,
        mut batch: BatchMeta,
        step: Step,
    ) -> Result<Applied> {
        let started = Instant::now();
        let expected = self.progress().await?;
        let dropped = step.dropped;
        let correlation_id = uuid::Uuid::now_v7().to_string();

        // Every aggregate of the batch is read in one snapshot of the
        // source: a transaction committed meanwhile shows in all of an
        // aggregate's tables or in none, so every event is a state that
        // existed. Its COMMIT goes out as soon as everything is read,
        // before the sidecar is touched (its reply comes with the sidecar
        // transaction's; a read error ends it before returning). A batch
        // whose aggregates are all covered reads only the catalog (a
        // change of it reads them after all).
        let mut snapshot: Option<Arc<Snapshot>> = None;
        let mut t_open = Duration::ZERO;
        let opened = !consolidated.is_empty() || !batch.covered.is_empty();
        let read = if !opened {
            None
        } else {
            // The catalog and the snapshot's text come with the opening.
            let o = self
                .source
                .begin_snapshot(
                    &batch.xids,
                    consolidated.len(),
                    &self.cfg.tables(),
                    batch.remember,
                )
                .await?;
            t_open = started.elapsed();
            let read = match o.catalog.and_then(|now| self.follow_schema(now)) {
                Ok(changed) => {
                    // Covered under the old catalog: read them now (this
                    // snapshot sees all their covering one saw).
                    if changed {
                        consolidated.append(&mut batch.covered);
                    }
                    o.snapshot.map(|text| {
                        snapshot = text
                            .and_then(|t| Snapshot::parse(&t, o.taken))
                            .map(Arc::new);
                    })
                }
                Err(e) => Err(e),
            };
            Some(read)
        };

        // Hydrate and load versions per entity, batched.
        let mut by_entity: HashMap<&str, Vec<usize>> = HashMap::new();
        for (i, c) in consolidated.iter().enumerate() {
            by_entity.entry(c.entity.as_str()).or_default().push(i);
        }
        // Per entity: the consolidated indexes and their root keys.
        let by_entity: Vec<(&str, Vec<usize>, Vec<RootKey>)> = by_entity
            .into_iter()
            .map(|(entity, idxs)| {
                let keys = idxs.iter().map(|i| consolidated[*i].key.clone()).collect();
                (entity, idxs, keys)
            })
            .collect();
        let t_schema = started.elapsed();
        let read = match read {
            None => Ok(vec![]),
            Some(Ok(())) if by_entity.is_empty() => Ok(vec![]),
            Some(Ok(())) => hydrate_all(&self.hydrators, &mut self.source, &by_entity).await,
            Some(Err(e)) => Err(e),
        };
        let t_hydrated = started.elapsed();
        // The pre-assigned ids of referenced rows, in the same snapshot.
        let read = match read {
            Ok(h) => referenced_preassigned(
                &self.plans,
                &self.id_sources,
                &mut self.source,
                &by_entity,
                &h,
            )
            .await
            .map(|p| (h, p)),
            Err(e) => Err(e),
        };
        // Everything is read: the snapshot's COMMIT goes out now, before
        // anything else (the source's tables' locks go with it, whatever
        // the sidecar does next), and its reply is awaited with the
        // sidecar transaction, so its round trip overlaps the decisions.
        // (tokio-postgres queues a request when its future is first
        // polled, and its connection task writes it: the yield lets that
        // task run now rather than at this batch's next wait. A batch that
        // fails before the sidecar transaction drops the reply: the
        // snapshot counts as open, and the next batch's ROLLBACK of it is
        // a no-op.)
        let source = &mut self.source;
        let mut ending = Box::pin(async move {
            if opened {
                source.end_snapshot().await
            } else {
                Ok(())
            }
        });
        let early = ending.as_mut().now_or_never();
        if early.is_none() {
            tokio::task::yield_now().await;
        }
        let ended = async move {
            match early {
                Some(ended) => ended,
                None => ending.await,
            }
        };
        let (hydrated, referenced) = match read {
            Ok(read) => read,
            // The cause; ending the snapshot after it can only fail for
            // the same reason (a lost connection).
            Err(e) => {
                let _ = ended.await;
                return Err(e);
            }
        };
        let t_read = started.elapsed();
        let mut outbox = vec![];
        let mut versions = vec![];
        // Per entity: events, aggregates with nothing new to publish, and
        // aggregates covered (not read).
        let mut tally: HashMap<&str, (u64, u64, u64)> = HashMap::new();
        // Decided first: the global identifiers the events need are
        // assigned (committed apart, see `identifiers::assign`) before any
        // event is built.
        for c in &batch.covered {
            tally.entry(c.entity.as_str()).or_default().2 += 1;
        }
        let mut decided = vec![];
        // Per aggregate read: whether its snapshot covers it afterwards.
        let mut remembered: Vec<(String, RootKey, bool)> = vec![];
        // Stored versions read from the sidecar.
        let mut learned: Vec<(String, String, Option<crate::decide::Stored>)> = vec![];
        let mut wanted = vec![];
        let mut dangling: HashSet<Wanted> = HashSet::new();
        for ((entity, idxs, keys), current) in by_entity.into_iter().zip(hydrated) {
            let Some(h) = self.hydrators.get(entity) else {
                return Err(Error::Data(format!("record for unknown entity `{entity}`")));
            };
            let canon: Vec<String> = keys.iter().map(|k| k.canonical()).collect();
            let (mut stored, unknown) = self.known.split(entity, &canon);
            if !unknown.is_empty() {
                let mut read = self.sidecar.versions(entity, &unknown).await?;
                for k in unknown {
                    let v = read.remove(&k);
                    learned.push((entity.to_string(), k.clone(), v.clone()));
                    stored.insert(k, v);
                }
            }
            let mapped = h.entity().identifier_mapping;
            let root_ns = crate::identifiers::namespace(&h.entity().schema, &h.entity().table);
            let global = if mapped {
                self.sidecar.identifiers(&root_ns, &canon).await?
            } else {
                HashMap::new()
            };
            let plan = self.plans.get(entity);
            for ((i, mut cur), ck) in idxs.iter().zip(current).zip(&canon) {
                let c = &consolidated[*i];
                if snapshot.is_some() {
                    remembered.push((c.entity.clone(), c.key.clone(), coverable(c, &cur)));
                }
                let delete = h.delete_payload(&c.key);
                let d = match c.explicit {
                    Some(republish) => decide_explicit(
                        &mut cur,
                        stored.get(ck).and_then(Option::as_ref),
                        &delete,
                        republish,
                    ),
                    None => decide(
                        c,
                        &mut cur,
                        stored.get(ck).and_then(Option::as_ref),
                        &delete,
                    ),
                };
                let Some(d) = d else {
                    tally.entry(entity).or_default().1 += 1;
                    continue;
                };
                tally.entry(entity).or_default().0 += 1;
                let root = if mapped {
                    let (gid, new) =
                        global_id(global.get(ck), &d, h.entity().global_id_column.as_deref());
                    if let (Some(g), true) = (&gid, new) {
                        let column = h.entity().global_id_column.as_deref();
                        wanted.push(IdentifierRow {
                            entity: root_ns.clone(),
                            key: ck.clone(),
                            global_id: g.clone(),
                            preassigned: column.and_then(|c| d.data.get(c)).and_then(preassigned)
                                == Some(g.clone()),
                        });
                    }
                    gid
                } else {
                    None
                };
                if let (Some(plan), false) = (plan, d.action == Action::Deleted) {
                    for (ns, key) in plan.wanted(&d.data) {
                        // A row of a table with a `global_id_column`: its
                        // value, read from the source; none yet for a row
                        // the source does not have (the stored id, if any).
                        let pre = match referenced.get(&(ns.clone(), key.clone())) {
                            _ if !self.id_sources.contains_key(&ns) => None,
                            Some(pre) => pre.clone(),
                            None => {
                                dangling.insert((ns, key));
                                continue;
                            }
                        };
                        wanted.push(IdentifierRow {
                            entity: ns,
                            key,
                            preassigned: pre.is_some(),
                            global_id: pre.unwrap_or_else(|| uuid::Uuid::now_v7().to_string()),
                        });
                    }
                }
                decided.push((entity, *i, ck.clone(), d, root));
            }
        }
        let t_decided = started.elapsed();
        let mut ids = crate::identifiers::assign(&mut self.sidecar, wanted).await?;
        crate::identifiers::read_stored(
            &mut self.sidecar,
            dangling.iter().map(|(ns, key)| (ns.as_str(), key.as_str())),
            &mut ids,
        )
        .await?;
        for (entity, i, ck, mut d, root) in decided {
            let (Some(h), c) = (self.hydrators.get(entity), &consolidated[i]) else {
                continue;
            };
            // A root identifier assigned now may be another applier's,
            // which won the race for it.
            let ns = crate::identifiers::namespace(&h.entity().schema, &h.entity().table);
            let gid = root.map(|g| ids.get(&(ns, ck.clone())).cloned().unwrap_or(g));
            if let (Some(g), Value::Object(m)) = (&gid, &mut d.data) {
                m.insert("global_id".into(), Value::String(g.clone()));
            }
            if let (Some(plan), false) = (self.plans.get(entity), d.action == Action::Deleted) {
                plan.apply(&mut d.data, &ids, &dangling)?;
            }
            let id = uuid::Uuid::now_v7().to_string();
            let event = event_text(
                &EventContext {
                    events: &self.cfg.events,
                    entity: h.entity(),
                    id: &id,
                    correlation_id: &correlation_id,
                    time_micros: c.commit_time_micros,
                    global_id: gid.as_deref(),
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
                    event,
                    commit_time_micros: c.commit_time_micros,
                },
            ));
            versions.push(VersionRow {
                entity: entity.to_string(),
                key: ck,
                etag: d.etag.clone(),
                is_deleted: d.action == Action::Deleted,
            });
        }
        // Outbox ids follow source order of each aggregate's last change.
        outbox.sort_by_key(|(pos, _)| *pos);
        let outbox: Vec<OutboxRow> = outbox.into_iter().map(|(_, o)| o).collect();
        let commit = BatchCommit {
            group: self.cfg.name.clone(),
            topic: self.topic.clone(),
            partition: self.partition,
            expected: expected.as_ref().map(|p| p.fence()),
            position: step.position,
            source: step.source,
            recheck_after: step.recheck_after.clone(),
            dead_letters: batch.dead_letters,
            lower: batch.lower,
            upper: batch.upper,
            correlation_id,
            record_count: batch.records as i32,
            entity_count: (consolidated.len() + batch.covered.len()) as i32,
            has_data_loss: batch.has_data_loss,
            outbox,
            versions,
            explicit: batch.explicit,
        };
        failpoint_result("applier.before_sidecar").map_err(Error::Data)?;
        let t_built = started.elapsed();
        let (result, ended) = tokio::join!(self.sidecar.commit(&commit), ended);
        if let Err(e) = ended {
            // The reads stand (a read-only snapshot that answered them);
            // the next batch finds out about the connection.
            warn!(error = %e, "ending the hydration snapshot failed");
        }
        // Where a batch's time went (bench/README: SKEIN_LOG=...=debug):
        // opening the snapshot (with its catalog and snapshot text, one
        // round trip), comparing the catalog, the tables' reads, the
        // whole snapshot (read), versions and decisions, identifiers and
        // events, the sidecar transaction.
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        tracing::debug!(
            open_ms = ms(t_open),
            schema_ms = ms(t_schema - t_open),
            hydrate_ms = ms(t_hydrated - t_schema),
            read_ms = ms(t_read),
            decide_ms = ms(t_decided - t_read),
            built_ms = ms(t_built - t_decided),
            commit_ms = ms(started.elapsed() - t_built),
            "batch phases"
        );
        let batch_id = match result {
            Ok(id) => id,
            Err(e) => {
                // Unknown outcome or fenced: read progress again next
                // time, and the versions.
                self.progress = None;
                self.forget();
                return Err(e);
            }
        };
        failpoint("applier.after_sidecar");
        if let Some(s) = &snapshot {
            self.coverage.decided(s, remembered);
        }
        self.known.record(learned);
        self.known.record(commit.versions.iter().map(|v| {
            (
                v.entity.clone(),
                v.key.clone(),
                Some(crate::decide::Stored {
                    etag: v.etag.clone(),
                    is_deleted: v.is_deleted,
                }),
            )
        }));
        record_metrics(&commit, batch.trigger, &tally, dropped, started.elapsed());
        // An explicit batch before the partition's first commit wrote no
        // progress row (it only locked the absent one): there is none.
        let explicit_first = expected.is_none() && !commit.explicit.is_empty();
        self.progress = Some((!explicit_first).then(|| Progress {
            position: step.position,
            source: step.source,
            recheck_after: step.recheck_after,
            // A commit keeps the epoch; a first commit writes epoch 0.
            epoch: expected.map_or(0, |p| p.epoch),
        }));
        let applied = Applied {
            records: batch.records,
            entities: consolidated.len() + batch.covered.len(),
            events: commit.outbox.len(),
            batch_id: Some(batch_id),
        };
        info!(
            partition = self.partition,
            batch_id,
            upper = %batch.upper_text,
            records = applied.records,
            duplicates = dropped,
            dead_letters = commit.dead_letters,
            entities = applied.entities,
            covered = batch.covered.len(),
            events = applied.events,
            ms = started.elapsed().as_millis() as u64,
            "batch committed"
        );
        Ok(applied)
    }
}

/// Counts a committed batch (never one that may still roll back).
fn record_metrics(
    commit: &BatchCommit,
    trigger: Trigger,
    tally: &HashMap<&str, (u64, u64, u64)>,
    dropped: usize,
    took: std::time::Duration,
) {
    use skein_common::metrics as m;
    let partition = commit.partition.to_string();
    let t = trigger.label();
    metrics::counter!(m::APPLIER_BATCHES, "partition" => partition.clone(), "trigger" => t)
        .increment(1);
    if trigger == Trigger::Change {
        metrics::counter!(m::APPLIER_RECORDS, "partition" => partition.clone())
            .increment(commit.record_count.max(0) as u64);
    }
    if dropped > 0 {
        metrics::counter!(m::APPLIER_DUPLICATES, "partition" => partition)
            .increment(dropped as u64);
    }
    if commit.dead_letters > 0 {
        metrics::counter!(m::DEAD_LETTERS, "stage" => "transport")
            .increment(commit.dead_letters as u64);
    }
    for (entity, (published, unchanged, covered)) in tally {
        let entity = entity.to_string();
        if *published > 0 {
            metrics::counter!(m::EVENTS_PUBLISHED, "entity" => entity.clone(), "trigger" => t)
                .increment(*published);
        }
        if *unchanged > 0 {
            metrics::counter!(m::EVENTS_UNCHANGED, "entity" => entity.clone(), "trigger" => t)
                .increment(*unchanged);
        }
        if *covered > 0 {
            metrics::counter!(m::AGGREGATES_COVERED, "entity" => entity).increment(*covered);
        }
    }
    metrics::histogram!(m::APPLIER_BATCH_DURATION, "trigger" => t).record(took.as_secs_f64());
    if trigger == Trigger::Change {
        let latency = metrics::histogram!(m::EVENT_LATENCY);
        for o in &commit.outbox {
            latency.record(m::seconds_since(o.commit_time_micros));
        }
    }
}
