//! The sidecar: batches, versions, progress and the outbox, written in one
//! transaction per batch, and the outbox the relay drains.
//!
//! [`Sidecar`] is the boundary: the applier, the relay and `skein replay`
//! call only its methods, and each implementation owns its transactions.
//! One module per database: [`postgres`] ([`PgSidecar`]) and [`sqlserver`]
//! ([`MssqlSidecar`]); their statement text lives in `skein_sql`
//! (`postgres::sidecar`, `sqlserver::sidecar`), pinned by golden files.
//! [`AnySidecar`] is whichever the configuration names, and only delegates.

pub mod postgres;
pub mod sqlserver;

use std::collections::{BTreeMap, HashMap};
use std::future::Future;

use skein_common::config::Secret;
use skein_common::position::ChangePosition;

use crate::decide::Stored;
use crate::error::{Error, Result};
use crate::sink::Sink;

pub use postgres::PgSidecar;
pub use sqlserver::MssqlSidecar;

/// One outbox row to insert.
#[derive(Clone, Debug)]
pub struct OutboxRow {
    /// CloudEvent id (UUID text).
    pub event_id: String,
    /// Entity name.
    pub entity: String,
    /// Canonical root key.
    pub key: String,
    /// Etag, `None` for deletes.
    pub etag: Option<String>,
    /// The CloudEvent JSON exactly as it will be sent.
    pub event: String,
    /// Source commit time (µs since the Unix epoch).
    pub commit_time_micros: i64,
}

/// One version row to upsert.
#[derive(Clone, Debug)]
pub struct VersionRow {
    /// Entity name.
    pub entity: String,
    /// Canonical root key.
    pub key: String,
    /// Etag (`None` when deleted).
    pub etag: Option<String>,
    /// Deleted.
    pub is_deleted: bool,
}

/// A global identifier to assign to a table row (see
/// [`crate::identifiers`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IdentifierRow {
    /// The namespace: the row's table (see
    /// [`crate::identifiers::namespace`]).
    pub entity: String,
    /// Canonical key.
    pub key: String,
    /// The global identifier.
    pub global_id: String,
    /// Whether `global_id` is pre-assigned (a `global_id_column` value),
    /// not generated: of two proposals for one key, it wins.
    pub preassigned: bool,
}

/// Everything one batch commits.
#[derive(Clone, Debug)]
pub struct BatchCommit {
    /// Progress group.
    pub group: String,
    /// Progress topic (`in-process` or the Kafka topic).
    pub topic: String,
    /// Partition.
    pub partition: u32,
    /// The progress this applier started from, position and epoch
    /// (`None`: no row yet).
    pub expected: Option<Fence>,
    /// The new progress.
    pub position: i128,
    /// The last source change applied in this partition, after this batch.
    pub source: Option<ChangePosition>,
    /// [`Progress::recheck_after`] after this batch.
    pub recheck_after: Option<String>,
    /// Records sent to the dead-letter topic in this batch.
    pub dead_letters: i32,
    /// Batch bounds (for the batch row).
    pub lower: i128,
    /// Batch bounds (for the batch row).
    pub upper: i128,
    /// Correlation id (UUID text).
    pub correlation_id: String,
    /// Records applied.
    pub record_count: i32,
    /// Aggregates touched.
    pub entity_count: i32,
    /// The source reported lost changes.
    pub has_data_loss: bool,
    /// Events.
    pub outbox: Vec<OutboxRow>,
    /// Versions.
    pub versions: Vec<VersionRow>,
    /// Queued explicit keys ([`Sidecar::explicit_pending`]) this batch
    /// published: taken off the queue in the same transaction. A batch of
    /// explicit keys leaves the progress as it is (`position`, `source` and
    /// `recheck_after` are the expected ones) but is fenced like any other;
    /// before the partition's first commit it locks the absent progress row
    /// instead of creating it. Fewer queued rows than ids: another applier
    /// took them, [`Error::Fenced`].
    pub explicit: Vec<i64>,
}

/// A new explicit run, or the unfinished identical one to resume
/// ([`Sidecar::explicit_start`]).
#[derive(Clone, Debug)]
pub struct NewRun {
    /// Progress group.
    pub group: String,
    /// Entity name.
    pub entity: String,
    /// What it selects, as stored JSON text ([`crate::explicit::Selection`]).
    pub selection: String,
    /// Publish even when the etag is unchanged.
    pub republish: bool,
    /// Started by `extractor.initial_load`.
    pub initial: bool,
}

/// An explicit run as [`Sidecar::explicit_start`] found or created it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExplicitRun {
    /// Run id.
    pub id: i64,
    /// The last key (canonical) or key-list index queued; `None` before the first chunk.
    pub cursor: Option<String>,
    /// Keys queued so far.
    pub queued: i64,
    /// An unfinished run was found and is resumed.
    pub resumed: bool,
}

/// One chunk of an explicit run, queued in one transaction with the run's
/// cursor ([`Sidecar::explicit_enqueue`]).
#[derive(Clone, Debug)]
pub struct ExplicitChunk {
    /// Run id.
    pub run: i64,
    /// Progress group.
    pub group: String,
    /// Progress topic the appliers key their work by.
    pub topic: String,
    /// Entity name.
    pub entity: String,
    /// Publish even when the etag is unchanged.
    pub republish: bool,
    /// The cursor the chunk starts after (what the run's cursor must be).
    pub from: Option<String>,
    /// The cursor after the chunk.
    pub to: Option<String>,
    /// `(partition, canonical key)` in selection order.
    pub keys: Vec<(u32, String)>,
    /// The selection is exhausted: the run's state becomes `queued`.
    pub done: bool,
}

/// A queued explicit key ([`Sidecar::explicit_pending`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExplicitItem {
    /// Queue row id.
    pub id: i64,
    /// Entity name.
    pub entity: String,
    /// Canonical root key.
    pub key: String,
    /// Publish even when the etag is unchanged.
    pub republish: bool,
}

/// An explicit run for `skein status` and `skein explicit`'s progress.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct ExplicitRunStatus {
    /// Run id.
    pub id: i64,
    /// Entity name.
    pub entity: String,
    /// What it selects (stored JSON text).
    pub selection: String,
    /// Publish even when the etag is unchanged.
    pub republish: bool,
    /// Started by `extractor.initial_load`.
    pub initial: bool,
    /// `selecting` (keys still being queued), `queued` (all keys queued).
    pub state: String,
    /// The last key or index queued.
    pub cursor: Option<String>,
    /// Keys queued.
    pub queued: i64,
    /// Keys queued and not yet published by their partition's applier.
    pub pending: i64,
    /// When the run started (UTC, ISO 8601).
    pub created_at: String,
    /// When its cursor last moved.
    pub updated_at: String,
}

impl ExplicitRunStatus {
    /// Every key selected, queued and published.
    pub fn finished(&self) -> bool {
        self.state != "selecting" && self.pending == 0
    }
}

/// A partition's committed progress.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Progress {
    /// In-process: the source upper bound ([`SourcePosition::numeric`]);
    /// Kafka: the next offset to consume.
    ///
    /// [`SourcePosition::numeric`]: skein_common::SourcePosition::numeric
    pub position: i128,
    /// The last source change applied (Kafka drops re-sent records by it).
    pub source: Option<ChangePosition>,
    /// While a TRUNCATE re-check is under way (`source` is its notice):
    /// the last canonical key re-checked. The re-check resumes after it.
    pub recheck_after: Option<String>,
    /// Bumped by every ownership change ([`Sidecar::claim`]) and rewind
    /// ([`Sidecar::rewind`]); a commit needs the epoch it read.
    pub epoch: i64,
}

/// What a batch commit is fenced on: the progress position and epoch its
/// applier read. Position alone is not enough: a rewind can write back a
/// position a stale applier read before it (ABA); the epoch it bumped is new.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fence {
    /// [`Progress::position`].
    pub position: i128,
    /// [`Progress::epoch`].
    pub epoch: i64,
}

impl std::fmt::Display for Fence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} (epoch {})", self.position, self.epoch)
    }
}

impl Progress {
    /// The fence a commit from this progress carries.
    pub fn fence(&self) -> Fence {
        Fence {
            position: self.position,
            epoch: self.epoch,
        }
    }

    /// The position as a Kafka offset (what it is in the Kafka mode).
    pub fn offset(&self) -> i64 {
        i64::try_from(self.position).unwrap_or(i64::MAX)
    }
}

/// The last source change applied, from `progress.source_commit` (display
/// form) and `progress.source_seq`.
pub fn source_position(commit: Option<String>, seq: Option<i64>) -> Result<Option<ChangePosition>> {
    let Some((c, s)) = commit.zip(seq) else {
        return Ok(None);
    };
    Ok(Some(ChangePosition {
        commit: c
            .parse()
            .map_err(|e| Error::Data(format!("progress.source_commit: {e}")))?,
        seq: u64::try_from(s)
            .map_err(|_| Error::Data(format!("progress.source_seq {s} out of range")))?,
    }))
}

/// Refuses a sidecar that a newer skein migrated: its rows may mean more
/// than this version knows (a TRUNCATE re-check cursor, say), and acting
/// on them half-understood can lose events.
pub fn check_schema_version(found: Option<i32>, schema: &str) -> Result<()> {
    let ours = skein_sql::postgres::SIDECAR_SCHEMA_VERSION;
    match found {
        Some(v) if v > ours => Err(Error::Schema {
            message: format!(
                "the sidecar schema `{schema}` is at version {v}, newer than this skein's {ours}: \
                 a newer skein migrated it"
            ),
            fix: "run the same (newest) skein version for every process of this pipeline \
                  (upgrade all appliers and extractors together)"
                .into(),
        }),
        _ => Ok(()),
    }
}

/// A `numeric(25,0)` position read back as text.
pub fn parse_numeric(s: &str) -> Result<i128> {
    s.parse()
        .map_err(|_| Error::Data(format!("sidecar position `{s}` is not an integer")))
}

/// The sidecar store.
///
/// Contract, for every implementation:
///
/// - **One fenced transaction per batch.** [`Sidecar::commit`] writes the
///   batch row, outbox rows, versions and the new progress atomically, and
///   only if progress (position and epoch) still equals
///   [`BatchCommit::expected`]; otherwise
///   nothing is written and [`Error::Fenced`] is returned. Committed progress
///   is the exactly-once recovery marker: a record at or before it is never
///   applied again.
/// - **Order.** Outbox ids increase with commit order and, within a batch,
///   with the order of [`BatchCommit::outbox`]; [`Sidecar::relay_once`]
///   hands rows to the sink in id order. Together: per aggregate key, events
///   leave in the order they were committed.
/// - **No half-written state.** Every method runs its own transaction (the
///   caller never sees one) and rolls it back on any error.
/// - **Retry.** Reads, `migrate`, `relay_once` and `rewind` may simply be
///   retried. A failed `commit` may have an unknown outcome (the connection
///   dropped during `COMMIT`): read [`Sidecar::progress`] again before
///   building the next batch, as [`crate::Applier`] does. A fence is final
///   for this applier: another one owns the partition.
pub trait Sidecar {
    /// Creates or upgrades the schema to the current version. Idempotent
    /// and serialised between processes (an advisory / application lock),
    /// so every applier calls it at start.
    fn migrate(&mut self) -> impl Future<Output = Result<()>> + Send;

    /// The committed progress of a partition; `None` before its first
    /// commit. Reads committed data only.
    fn progress(
        &mut self,
        group: &str,
        topic: &str,
        partition: u32,
    ) -> impl Future<Output = Result<Option<Progress>>> + Send;

    /// An applier takes a partition: bumps its epoch and returns the
    /// progress with the new epoch, so every applier that read it before
    /// is fenced from now on. `None` (nothing bumped) before the first
    /// commit: the first commit's insert is fenced by the row itself.
    fn claim(
        &mut self,
        group: &str,
        topic: &str,
        partition: u32,
    ) -> impl Future<Output = Result<Option<Progress>>> + Send;

    /// Every partition's committed progress on `topic`, by partition.
    fn progress_all(
        &mut self,
        group: &str,
        topic: &str,
    ) -> impl Future<Output = Result<Vec<(u32, Progress)>>> + Send;

    /// Forgets the progress of `partitions`, in one transaction: their
    /// records are applied again when re-sent (unchanged aggregates publish
    /// nothing). For re-keying in-process, see [`crate::run::rekey`].
    fn forget_progress(
        &mut self,
        group: &str,
        topic: &str,
        partitions: &[u32],
    ) -> impl Future<Output = Result<()>> + Send;

    /// The partition count the records of `group` on `topic` are keyed by,
    /// as last recorded; `None` before the first record.
    fn partitions(
        &mut self,
        group: &str,
        topic: &str,
    ) -> impl Future<Output = Result<Option<u32>>> + Send;

    /// Records the partition count of `group` on `topic` (see
    /// [`crate::run::repartition_check`]).
    fn record_partitions(
        &mut self,
        group: &str,
        topic: &str,
        partitions: u32,
    ) -> impl Future<Output = Result<()>> + Send;

    /// Stored versions of the given canonical keys of an entity; a key that
    /// never published (or was forgotten by a replay) is absent.
    fn versions(
        &mut self,
        entity: &str,
        keys: &[String],
    ) -> impl Future<Output = Result<HashMap<String, Stored>>> + Send;

    /// Stored global identifiers of the given canonical keys of an entity
    /// (`identifier_mapping`); a key with none is absent.
    fn identifiers(
        &mut self,
        entity: &str,
        keys: &[String],
    ) -> impl Future<Output = Result<HashMap<String, String>>> + Send;

    /// Inserts global identifiers, each unless it conflicts with a stored
    /// row (its key has one, or its identifier is another key's of the
    /// namespace), committed at once, outside any batch transaction (an
    /// identifier assigned to an event that is then not committed is kept
    /// and used by the retry). Returns how many it inserted. Concurrent
    /// inserts of one key wait for each other; the caller reads the
    /// winner with [`Sidecar::identifiers`].
    fn insert_identifiers(
        &mut self,
        rows: &[IdentifierRow],
    ) -> impl Future<Output = Result<u64>> + Send;

    /// In one transaction: for each `(from, to)` of `moves`, the rows of
    /// namespace `from` at odds with `to`'s, and with those of an earlier
    /// move's `from` into the same `to`, are judged
    /// ([`crate::identifiers::judge_carry_over`]; an error rolls back);
    /// then `from`'s rows move to `to`, replacing `to`'s of the same keys.
    /// Returns how many rows moved.
    fn move_identifiers(
        &mut self,
        moves: &[(String, String)],
    ) -> impl Future<Output = Result<u64>> + Send;

    /// The keys of namespace `entity` that hold the given global ids (an
    /// id no key holds is absent).
    fn identifier_holders(
        &mut self,
        entity: &str,
        ids: &[String],
    ) -> impl Future<Output = Result<HashMap<String, String>>> + Send;

    /// The canonical keys of an entity whose last event was not a delete:
    /// every aggregate a TRUNCATE may have changed. Read by the partition's
    /// applier before its batch transaction; the keys of its partition are
    /// written only by it (fenced), so none can appear meanwhile.
    ///
    /// A page: the keys after `after` (from the first when `None`), in
    /// key order, at most `limit`.
    fn published_keys(
        &mut self,
        entity: &str,
        after: Option<&str>,
        limit: i64,
    ) -> impl Future<Output = Result<Vec<String>>> + Send;

    /// The one batch transaction, read top to bottom in each implementation:
    /// fence (move progress from `expected` to `position`, or create it when
    /// `expected` is `None`), batch row, outbox rows in the given order,
    /// versions, commit. All of it or none of it. Returns the batch id.
    ///
    /// Fencing: when progress is not `expected` (another applier committed,
    /// or a first progress row already exists), nothing is written and
    /// [`Error::Fenced`] carries the position found. Failpoints
    /// `applier.before_commit` / `applier.after_commit` bracket the commit.
    fn commit(&mut self, batch: &BatchCommit) -> impl Future<Output = Result<i64>> + Send;

    /// Pending outbox rows (above their partition's relay cursor) and the
    /// age of the oldest in
    /// milliseconds (0 when none). Read-only.
    fn pending(&mut self) -> impl Future<Output = Result<(i64, i64)>> + Send;

    /// Applies a [`Rewind`] in one transaction: each listed partition's
    /// progress moves from its current offset to the target and forgets its
    /// last source change; the listed versions are deleted. If any
    /// partition's progress is no longer its stated current offset (an
    /// applier committed meanwhile), nothing changes and an error says to
    /// run again.
    fn rewind(&mut self, rewind: &Rewind) -> impl Future<Output = Result<()>> + Send;

    /// One relay step, one transaction (PostgreSQL: one for each round of
    /// at most 64 partitions, further rounds following while the last took
    /// 64 and the limit allows): claims at most `limit` pending
    /// outbox rows in id order, hands them to `sink` in that order (inside
    /// [`tokio::task::block_in_place`]: a sink may block on a file sync or a
    /// broker acknowledgement), moves each partition's relay cursor to the
    /// last row it sent and commits. Returns how many were sent; 0 when
    /// nothing is pending.
    ///
    /// `partitions`: `None` takes every partition — the one relay of a
    /// deployment; `Some(owned)` only those. Either locks the cursors it
    /// takes for the round, so a relay that takes a partition over sends
    /// after the previous owner's round ended and per-aggregate order
    /// holds; `Some(&[])` claims nothing. While the sink is sent to, the
    /// round's transaction holds no transaction id (PostgreSQL: advisory
    /// locks, not row locks), so a slow sink holds up no logical slot
    /// being created in the cluster. Every row above a cursor is
    /// pending: [`Sidecar::commit`] draws a partition's outbox ids under
    /// the partition's outbox lock, so they grow in commit order.
    ///
    /// At least once: when the sink fails, or the process dies after the
    /// sink has the events but before the cursor moves (failpoint
    /// `relay.after_send_before_mark`), the rows stay pending and are sent
    /// again with the same event ids. Safe to retry.
    fn relay_once(
        &mut self,
        limit: i64,
        partitions: Option<&[i32]>,
        sink: &mut dyn Sink,
    ) -> impl Future<Output = Result<usize>> + Send;

    /// Takes this connection's relay lease if it is free and returns
    /// whether it did; held until the connection closes (a crashed relay
    /// frees it). `exclusive` for the relay of every partition, which skips
    /// rows others hold and so must relay alone; shared for the relays of
    /// owned partitions, which wait on each other's rows and may run
    /// together. So a `skein relay` never runs beside another one, nor
    /// beside appliers that relay: one of them stands by.
    fn relay_lease(&mut self, exclusive: bool) -> impl Future<Output = Result<bool>> + Send;

    /// How many sessions hold the relay lease, exclusively and shared
    /// (`skein status`); `None` where the dialect does not tell.
    fn relay_lease_holders(&mut self) -> impl Future<Output = Result<Option<(i64, i64)>>> + Send;

    /// Records relay `name`'s state and, when given, its last error (kept
    /// until the next error) for `skein status`.
    fn relay_report(
        &mut self,
        name: &str,
        state: &str,
        error: Option<&str>,
    ) -> impl Future<Output = Result<()>> + Send;

    /// Every relay's last reported state.
    fn relay_states(&mut self) -> impl Future<Output = Result<Vec<RelayState>>> + Send;

    /// Deletes at most `limit` outbox rows relayed more than
    /// `older_than_secs` seconds ago, in one transaction; returns how many.
    /// Pending rows are never touched.
    fn purge_outbox(
        &mut self,
        older_than_secs: i64,
        limit: i64,
    ) -> impl Future<Output = Result<u64>> + Send;

    /// Finds the unfinished run identical to `run` (same group, entity,
    /// selection, republish and initial) to resume it, or creates one.
    fn explicit_start(&mut self, run: &NewRun) -> impl Future<Output = Result<ExplicitRun>> + Send;

    /// Queues a chunk and moves its run's cursor, in one transaction; if
    /// the cursor is no longer `chunk.from` (another process runs the run)
    /// nothing is written and an error says so.
    fn explicit_enqueue(
        &mut self,
        chunk: &ExplicitChunk,
    ) -> impl Future<Output = Result<()>> + Send;

    /// At most `limit` queued explicit keys of a partition, oldest first.
    fn explicit_pending(
        &mut self,
        group: &str,
        topic: &str,
        partition: u32,
        partitions: u32,
        limit: i64,
    ) -> impl Future<Output = Result<Vec<ExplicitItem>>> + Send;

    /// Moves queued explicit keys to other partitions (`(id, partition)`).
    fn explicit_requeue(&mut self, moves: &[(i64, u32)])
        -> impl Future<Output = Result<()>> + Send;

    /// Explicit run `id`, if it exists.
    fn explicit_run(
        &mut self,
        id: i64,
    ) -> impl Future<Output = Result<Option<ExplicitRunStatus>>> + Send;

    /// The explicit runs of `group`: every unfinished one and the last
    /// `recent` others, newest first.
    fn explicit_runs(
        &mut self,
        group: &str,
        recent: i64,
    ) -> impl Future<Output = Result<Vec<ExplicitRunStatus>>> + Send;
}

/// A relay's last reported state ([`Sidecar::relay_report`]).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct RelayState {
    /// `relay` (one relay of every partition) or `apply <instance>`.
    pub name: String,
    /// `standing by`, `running`, `retrying` or `stopped`.
    pub state: String,
    /// The last error and when it happened (UTC, ISO 8601).
    pub last_error: Option<String>,
    /// When the last error happened.
    pub error_at: Option<String>,
    /// When the state was reported.
    pub updated_at: String,
}

/// The outbox ids a batch drew must all be above `floor`, the highest its
/// partition had (rows or cursor), or the relay would take them as sent.
pub(crate) fn check_outbox_order(partition: u32, drawn: i64, floor: i64) -> Result<()> {
    if drawn > floor {
        Ok(())
    } else {
        Err(Error::OutboxOrder {
            partition,
            drawn,
            floor,
        })
    }
}

/// Records that a relay round sends outbox row `id` of `partition`: each
/// partition's cursor moves to the highest id it sent (rows come in id
/// order, but the rule does not depend on it).
pub(crate) fn advance_cursor(cursors: &mut Vec<(i32, i64)>, partition: i32, id: i64) {
    match cursors.iter_mut().find(|(p, _)| *p == partition) {
        Some((_, last)) => *last = (*last).max(id),
        None => cursors.push((partition, id)),
    }
}

/// Hands the rows a relay step claimed to the sink (which may block: file
/// sync, broker acknowledgement). A failure names the outbox rows that were
/// not delivered, so the operator can find them.
pub(crate) fn send_claimed(
    sink: &mut dyn Sink,
    ids: &[i64],
    events: &[crate::sink::SinkEvent],
) -> Result<()> {
    tokio::task::block_in_place(|| sink.send(events)).map_err(|e| match e {
        Error::Sink { message, source } => Error::Sink {
            message: format!(
                "outbox rows {}..={} ({} events) not delivered: {message}",
                ids.first().copied().unwrap_or_default(),
                ids.last().copied().unwrap_or_default(),
                ids.len()
            ),
            source,
        },
        other => other,
    })
}

/// Whether a sidecar URL points at PostgreSQL (`postgres://`,
/// `postgresql://`); anything else is SQL Server (an ADO.NET string,
/// `sqlserver://…` or `jdbc:sqlserver://…`).
pub fn is_postgres_url(url: &str) -> bool {
    let u = url.trim_start().to_ascii_lowercase();
    u.starts_with("postgres://") || u.starts_with("postgresql://")
}

/// What `skein replay` changes, in one transaction.
#[derive(Clone, Debug, Default)]
pub struct Rewind {
    /// Progress group.
    pub group: String,
    /// The Kafka topic.
    pub topic: String,
    /// Per partition: its current offset and the offset to go back to.
    pub partitions: Vec<(i32, i64, i64)>,
    /// `(entity, canonical key)`s whose stored versions are forgotten
    /// (`--republish`), so each publishes once more.
    pub forget: Vec<(String, String)>,
}

impl BatchCommit {
    /// The error of a batch whose rows another applier wrote first (it
    /// owned the partition meanwhile): fewer queued explicit keys taken off
    /// the queue than it published. This one is fenced and builds the batch again; its
    /// progress was not moved either way.
    pub(crate) fn fenced_by_rows(&self) -> Error {
        Error::Fenced {
            partition: self.partition,
            expected: self.expected,
            found: self.expected,
        }
    }
}

impl ExplicitRun {
    /// A run just created: nothing queued yet.
    pub(crate) fn created(id: i64) -> ExplicitRun {
        ExplicitRun {
            id,
            cursor: None,
            queued: 0,
            resumed: false,
        }
    }
}

impl ExplicitChunk {
    /// The run's state after this chunk: `queued` once the selection is
    /// exhausted, else still `selecting`.
    pub(crate) fn state(&self) -> &'static str {
        if self.done {
            "queued"
        } else {
            "selecting"
        }
    }

    /// The error of a chunk whose run's cursor is no longer `from`.
    pub(crate) fn cursor_moved(&self) -> Error {
        Error::Data(format!(
            "explicit run {}: its cursor moved meanwhile (another `skein explicit` or \
             `skein run` is running it); nothing of this chunk was queued",
            self.run
        ))
    }
}

impl Rewind {
    /// The error that aborts a rewind when partition `p` moved meanwhile.
    pub(crate) fn moved(p: i32) -> Error {
        Error::Data(format!(
            "partition {p}: progress moved while replaying (an applier committed); run again"
        ))
    }

    /// The keys to forget, per entity (one statement per entity).
    pub(crate) fn forget_by_entity(&self) -> BTreeMap<&str, Vec<&str>> {
        let mut by_entity: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        for (e, k) in &self.forget {
            by_entity.entry(e).or_default().push(k);
        }
        by_entity
    }
}

/// The configured sidecar, whichever database it runs on.
pub enum AnySidecar {
    /// PostgreSQL.
    Postgres(PgSidecar),
    /// SQL Server (boxed: the TDS client carries its buffers).
    SqlServer(Box<MssqlSidecar>),
}

impl AnySidecar {
    /// Connects to `url` (see [`is_postgres_url`]).
    pub async fn connect(url: &Secret, schema: &str) -> Result<AnySidecar> {
        Ok(if is_postgres_url(url.expose()) {
            AnySidecar::Postgres(PgSidecar::connect(url, schema).await?)
        } else {
            AnySidecar::SqlServer(Box::new(MssqlSidecar::connect(url, schema).await?))
        })
    }
}

/// `delegate!(self, s => s.method(..).await)`: the one place that matches
/// on the dialect, so each [`AnySidecar`] method is a single line.
macro_rules! delegate {
    ($self:ident, $s:ident => $call:expr) => {
        match $self {
            AnySidecar::Postgres($s) => $call,
            AnySidecar::SqlServer($s) => $call,
        }
    };
}

impl Sidecar for AnySidecar {
    async fn migrate(&mut self) -> Result<()> {
        delegate!(self, s => s.migrate().await)
    }

    async fn progress(
        &mut self,
        group: &str,
        topic: &str,
        partition: u32,
    ) -> Result<Option<Progress>> {
        delegate!(self, s => s.progress(group, topic, partition).await)
    }

    async fn claim(
        &mut self,
        group: &str,
        topic: &str,
        partition: u32,
    ) -> Result<Option<Progress>> {
        delegate!(self, s => s.claim(group, topic, partition).await)
    }

    async fn partitions(&mut self, group: &str, topic: &str) -> Result<Option<u32>> {
        delegate!(self, s => s.partitions(group, topic).await)
    }

    async fn progress_all(&mut self, group: &str, topic: &str) -> Result<Vec<(u32, Progress)>> {
        delegate!(self, s => s.progress_all(group, topic).await)
    }

    async fn forget_progress(
        &mut self,
        group: &str,
        topic: &str,
        partitions: &[u32],
    ) -> Result<()> {
        delegate!(self, s => s.forget_progress(group, topic, partitions).await)
    }

    async fn record_partitions(&mut self, group: &str, topic: &str, n: u32) -> Result<()> {
        delegate!(self, s => s.record_partitions(group, topic, n).await)
    }

    async fn versions(&mut self, entity: &str, keys: &[String]) -> Result<HashMap<String, Stored>> {
        delegate!(self, s => s.versions(entity, keys).await)
    }

    async fn identifiers(
        &mut self,
        entity: &str,
        keys: &[String],
    ) -> Result<HashMap<String, String>> {
        delegate!(self, s => s.identifiers(entity, keys).await)
    }

    async fn insert_identifiers(&mut self, rows: &[IdentifierRow]) -> Result<u64> {
        delegate!(self, s => s.insert_identifiers(rows).await)
    }

    async fn move_identifiers(&mut self, moves: &[(String, String)]) -> Result<u64> {
        delegate!(self, s => s.move_identifiers(moves).await)
    }

    async fn identifier_holders(
        &mut self,
        entity: &str,
        ids: &[String],
    ) -> Result<HashMap<String, String>> {
        delegate!(self, s => s.identifier_holders(entity, ids).await)
    }

    async fn published_keys(
        &mut self,
        entity: &str,
        after: Option<&str>,
        limit: i64,
    ) -> Result<Vec<String>> {
        delegate!(self, s => s.published_keys(entity, after, limit).await)
    }

    async fn commit(&mut self, batch: &BatchCommit) -> Result<i64> {
        delegate!(self, s => s.commit(batch).await)
    }

    async fn pending(&mut self) -> Result<(i64, i64)> {
        delegate!(self, s => s.pending().await)
    }

    async fn rewind(&mut self, rewind: &Rewind) -> Result<()> {
        delegate!(self, s => s.rewind(rewind).await)
    }

    async fn relay_once(
        &mut self,
        limit: i64,
        partitions: Option<&[i32]>,
        sink: &mut dyn Sink,
    ) -> Result<usize> {
        delegate!(self, s => s.relay_once(limit, partitions, sink).await)
    }

    async fn relay_lease(&mut self, exclusive: bool) -> Result<bool> {
        delegate!(self, s => s.relay_lease(exclusive).await)
    }

    async fn relay_lease_holders(&mut self) -> Result<Option<(i64, i64)>> {
        delegate!(self, s => s.relay_lease_holders().await)
    }

    async fn relay_report(&mut self, name: &str, state: &str, error: Option<&str>) -> Result<()> {
        delegate!(self, s => s.relay_report(name, state, error).await)
    }

    async fn relay_states(&mut self) -> Result<Vec<RelayState>> {
        delegate!(self, s => s.relay_states().await)
    }

    async fn purge_outbox(&mut self, older_than_secs: i64, limit: i64) -> Result<u64> {
        delegate!(self, s => s.purge_outbox(older_than_secs, limit).await)
    }

    async fn explicit_start(&mut self, run: &NewRun) -> Result<ExplicitRun> {
        delegate!(self, s => s.explicit_start(run).await)
    }

    async fn explicit_enqueue(&mut self, chunk: &ExplicitChunk) -> Result<()> {
        delegate!(self, s => s.explicit_enqueue(chunk).await)
    }

    async fn explicit_pending(
        &mut self,
        group: &str,
        topic: &str,
        partition: u32,
        partitions: u32,
        limit: i64,
    ) -> Result<Vec<ExplicitItem>> {
        delegate!(self, s => s.explicit_pending(group, topic, partition, partitions, limit).await)
    }

    async fn explicit_runs(&mut self, group: &str, recent: i64) -> Result<Vec<ExplicitRunStatus>> {
        delegate!(self, s => s.explicit_runs(group, recent).await)
    }

    async fn explicit_requeue(&mut self, moves: &[(i64, u32)]) -> Result<()> {
        delegate!(self, s => s.explicit_requeue(moves).await)
    }

    async fn explicit_run(&mut self, id: i64) -> Result<Option<ExplicitRunStatus>> {
        delegate!(self, s => s.explicit_run(id).await)
    }
}

#[cfg(test)]
mod tests {
    use super::{advance_cursor, check_outbox_order};

    #[test]
    fn new_outbox_ids_must_pass_the_partitions_highest() {
        assert!(check_outbox_order(2, 11, 10).is_ok());
        assert!(check_outbox_order(2, 1, 0).is_ok());
        let e = check_outbox_order(2, 10, 10).unwrap_err().to_string();
        assert!(e.contains("partition 2") && e.contains("10"), "{e}");
        assert!(check_outbox_order(2, 5, 10).is_err());
    }

    #[test]
    fn a_relay_round_moves_each_partition_to_the_last_id_it_sent() {
        let mut c = vec![];
        for (p, id) in [(1, 10), (0, 11), (1, 12), (0, 9), (2, 14)] {
            advance_cursor(&mut c, p, id);
        }
        assert_eq!(c, vec![(1, 12), (0, 11), (2, 14)]);
    }
}
