//! The applier loop, written once for every transport: rounds from an
//! [`Inbox`], one [`Applier`] per partition, the partitions of a round
//! applied concurrently on the tokio runtime.
//!
//! One concurrency model: async tasks. The transports' blocking waits
//! (crossbeam channels, librdkafka's poll) run on tokio's blocking pool
//! inside the inboxes, so the loop itself never blocks a worker and holds
//! no lock across an await.

use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use skein_common::config::Config;
use skein_common::{Checkpoint, CheckpointKind};
use skein_sql::Catalog;
use skein_transporter::kafka::ResumeAt;
use skein_transporter::{Delivery, Inbox, Membership};
use tokio_util::sync::CancellationToken;
use tracing::{error, info, info_span, warn, Instrument};

use crate::apply::Applier;
use crate::error::{Error, Result};
use crate::hydrate::Source;
use crate::relay::RelayWake;
use crate::sidecar::{AnySidecar, Progress, Sidecar};

/// How often an idle applier checks that its partitions' progress was not
/// moved by someone else (`skein replay --force-while-running`).
const PROGRESS_CHECK: Duration = Duration::from_secs(2);

/// How often an applier looks for queued explicit keys of its partitions
/// when the last look found none.
const EXPLICIT_POLL: Duration = Duration::from_millis(500);

/// What the loop does when a delivery could not be applied.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AfterFailure {
    /// Another applier moved the progress: nothing was written. Read the
    /// progress again and seek the partition there; this process goes on.
    Reseek,
    /// The stop came between two committed steps of the delivery: it is
    /// refused to the inbox as not applied, which is no failure (the loop
    /// is stopping anyway); the next owner resumes from the progress.
    Interrupted,
    /// Anything else: report the failure to the inbox and stop; a restart
    /// resumes from the sidecar's progress.
    Stop,
}

/// The fence decision, pure: only a fence is survived in place, and only
/// the stop's interruption is no failure.
pub fn after_failure(e: &Error) -> AfterFailure {
    match e {
        Error::Fenced { .. } => AfterFailure::Reseek,
        Error::Interrupted { .. } => AfterFailure::Interrupted,
        _ => AfterFailure::Stop,
    }
}

/// Whether the stored progress moved away from what the applier believed
/// (`None`: it has not read it since its last reset; nothing to compare).
pub fn moved_under_us(believed: &Option<Option<Progress>>, stored: &Option<Progress>) -> bool {
    believed.as_ref().is_some_and(|b| b != stored)
}

/// The partitions this process owns, shared with a partition-scoped relay.
pub type Owned = Arc<Mutex<Vec<i32>>>;

/// Start-up check of the identifier mappings ([`crate::identifiers::check`])
/// over `catalog` and the catalog of the tables mappings reference, read
/// from the source: refused before anything is applied, since a mapping
/// the catalog shows to be wrong would mint identifiers no row ever has.
pub async fn check_identifier_mapping(cfg: &Config, catalog: &Catalog) -> Result<()> {
    let referenced = crate::identifiers::Plan::referenced_tables(cfg);
    if referenced.is_empty() {
        return Ok(());
    }
    let mut full = Source::connect(cfg).await?.catalog_of(&referenced).await?;
    for t in catalog.tables.values() {
        full.insert(t.clone());
    }
    crate::identifiers::check(cfg, &full)
}

/// Most records held for partitions whose apply is running
/// ([`Inbox::delivers_while_applying`]) before the loop stops asking the
/// inbox for more until an apply finishes.
const HELD_LIMIT: usize = 50_000;

/// How long one apply may run before the loop stops asking the inbox for
/// more until it is back. Over Kafka a member that does not poll leaves
/// its group after `max.poll.interval.ms`, so a hung apply (a sidecar or
/// source that stopped answering) still gives its partitions to another
/// applier, as when every apply waited for the round.
const STALLED: Duration = Duration::from_secs(10);

/// What a partition's task does.
enum Work {
    /// Applies a delivery.
    Delivery(Delivery),
    /// Publishes a page of the partition's queued explicit keys
    /// ([`Applier::explicit_once`]).
    Explicit,
}

/// What a partition's task gives back.
struct Finished {
    partition: u32,
    /// The delivery's progress to acknowledge; `None` for explicit keys.
    upper: Option<Checkpoint>,
    applier: Applier<AnySidecar>,
    result: Result<crate::apply::Applied>,
}

/// The partitions' appliers, their running applies and what waits for
/// them. Nothing here touches the inbox: what it owes the inbox
/// (acknowledgements, seeks) is queued and handed over when no `next` is
/// in flight.
struct Lanes {
    /// Appliers with no apply running.
    idle: HashMap<u32, Applier<AnySidecar>>,
    tasks: tokio::task::JoinSet<Finished>,
    /// The partition of each running task (a panicked task names none),
    /// and when it started.
    running: HashMap<tokio::task::Id, (u32, Instant)>,
    /// Deliveries of partitions whose apply is running, in order.
    held: HashMap<u32, VecDeque<Delivery>>,
    held_records: usize,
    /// Partitions assigned or revoked while their apply ran: their applier
    /// forgets what it knew when the apply is back.
    retake: HashSet<u32>,
    /// Fenced partitions to seek to their stored progress; their
    /// deliveries are refused until then.
    reseek: BTreeSet<u32>,
    /// Outcomes owed to the inbox, in order.
    acks: Vec<(u32, std::result::Result<Checkpoint, String>)>,
    /// When each partition looks at its explicit queue next (now, when
    /// absent).
    explicit_due: HashMap<u32, Instant>,
    /// The failure that stops the loop; nothing new starts after it.
    fatal: Option<Error>,
    /// The loop is stopping: nothing new starts.
    stopping: bool,
    /// Told when a task committed outbox rows.
    wake: RelayWake,
}

impl Lanes {
    fn new(wake: RelayWake) -> Lanes {
        Lanes {
            idle: HashMap::new(),
            tasks: tokio::task::JoinSet::new(),
            running: HashMap::new(),
            held: HashMap::new(),
            held_records: 0,
            retake: HashSet::new(),
            reseek: BTreeSet::new(),
            acks: vec![],
            explicit_due: HashMap::new(),
            fatal: None,
            stopping: false,
            wake,
        }
    }

    fn busy(&self, p: u32) -> bool {
        self.running.values().any(|(r, _)| *r == p)
    }

    /// Whether a task has run longer than [`STALLED`].
    fn stalled(&self) -> bool {
        self.running.values().any(|(_, t)| t.elapsed() > STALLED)
    }

    fn spawn(&mut self, p: u32, work: Work, mut a: Applier<AnySidecar>) {
        let wake = self.wake.clone();
        let task = self.tasks.spawn(
            async move {
                let (upper, result) = match work {
                    Work::Delivery(d) => (Some(d.upper), a.apply(&d).await),
                    Work::Explicit => (None, a.explicit_once().await),
                };
                // A failed apply may have committed events in an earlier
                // step (a TRUNCATE's re-check pages): a needless look
                // costs the relay one query.
                let written = match &result {
                    Ok(applied) => applied.events > 0,
                    Err(_) => true,
                };
                if written {
                    wake.outbox_written();
                }
                Finished {
                    partition: p,
                    upper,
                    applier: a,
                    result,
                }
            }
            .instrument(info_span!("partition", partition = p)),
        );
        self.running.insert(task.id(), (p, Instant::now()));
    }

    fn explicit_due(&self, p: u32) -> bool {
        self.explicit_due
            .get(&p)
            .is_none_or(|t| *t <= Instant::now())
    }

    /// Starts the partition's next work on its idle applier `a`, if any:
    /// deliveries and explicit pages take turns (`after_explicit`: the
    /// last work was an explicit page), so neither starves the other.
    /// Gives `a` back when there is nothing to do.
    fn start_next(
        &mut self,
        p: u32,
        a: Applier<AnySidecar>,
        after_explicit: bool,
        mine: bool,
    ) -> Option<Applier<AnySidecar>> {
        if self.fatal.is_some() || self.stopping || self.reseek.contains(&p) {
            return Some(a);
        }
        let explicit = mine && self.explicit_due(p);
        if explicit && (!after_explicit || !self.held.contains_key(&p)) {
            self.spawn(p, Work::Explicit, a);
            return None;
        }
        match self.unhold(p) {
            Some(d) => {
                self.spawn(p, Work::Delivery(d), a);
                None
            }
            None => Some(a),
        }
    }

    /// Queues `d` behind its partition's running apply; contiguous
    /// deliveries become one, up to `merge_limit` records, applied together
    /// when the partition is free.
    fn hold(&mut self, d: Delivery, merge_limit: usize) {
        self.held_records += d.records.len();
        let q = self.held.entry(d.partition).or_default();
        match q.back_mut() {
            Some(last)
                if last.upper == d.lower && last.records.len() + d.records.len() <= merge_limit =>
            {
                last.records.extend(d.records);
                last.upper = d.upper;
                last.has_data_loss |= d.has_data_loss;
                last.dead_letters += d.dead_letters;
            }
            _ => q.push_back(d),
        }
    }

    /// The next held delivery of `p`, if any.
    fn unhold(&mut self, p: u32) -> Option<Delivery> {
        let q = self.held.get_mut(&p)?;
        let d = q.pop_front();
        if q.is_empty() {
            self.held.remove(&p);
        }
        if let Some(d) = &d {
            self.held_records -= d.records.len();
        }
        d
    }

    /// Refuses what is held for `p` (a revocation, a fence, a stop).
    fn drop_held(&mut self, p: u32, why: &str) {
        while let Some(d) = self.unhold(p) {
            self.acks.push((d.partition, Err(why.to_string())));
        }
    }

    /// Acts on a finished task: a delivery's outcome is queued for the
    /// inbox, and the partition's applier takes its next work or is idle
    /// again. `mine`: the partitions owned now.
    fn finished(
        &mut self,
        joined: std::result::Result<(tokio::task::Id, Finished), tokio::task::JoinError>,
        mine: &BTreeSet<u32>,
    ) {
        let f = match joined {
            Ok((id, f)) => {
                self.running.remove(&id);
                f
            }
            Err(e) => {
                // A panicked task: its partition is not acknowledged, which
                // stops the extractor (in-process) or leaves the records
                // for a restart (Kafka).
                if let Some((p, _)) = self.running.remove(&e.id()) {
                    self.drop_held(p, "not applied: the partition's apply task failed");
                }
                self.fatal
                    .get_or_insert(Error::Data(format!("an apply task failed: {e}")));
                return;
            }
        };
        let Finished {
            partition: p,
            upper,
            applier: mut a,
            result,
        } = f;
        if self.retake.remove(&p) {
            a.taken_over();
        }
        let explicit = upper.is_none();
        match result {
            Ok(done) => match upper {
                Some(upper) => self.acks.push((p, Ok(upper))),
                // Keys were queued: look again at once; none: after a while.
                None => {
                    let wait = if done.records > 0 {
                        Duration::ZERO
                    } else {
                        EXPLICIT_POLL
                    };
                    self.explicit_due.insert(p, Instant::now() + wait);
                }
            },
            Err(e) => match after_failure(&e) {
                AfterFailure::Reseek => {
                    if explicit {
                        warn!(partition = p, error = %e, "fenced while publishing explicit keys: another applier moved this partition's progress; nothing was written, re-seeking");
                    } else {
                        warn!(partition = p, error = %e, "fenced: another applier moved this partition's progress; nothing was written, re-seeking");
                        self.acks.push((p, Err(e.to_string())));
                    }
                    a.fenced();
                    self.drop_held(p, "not applied: the partition is re-seeked after a fence");
                    self.reseek.insert(p);
                }
                AfterFailure::Interrupted => {
                    // Nothing after it may be applied (the re-check's
                    // progress must stay): the loop stops taking work.
                    info!(partition = p, "{e}");
                    if !explicit {
                        self.acks.push((p, Err(e.to_string())));
                    }
                    self.drop_held(p, "not applied: the applier is stopping");
                    self.stopping = true;
                }
                AfterFailure::Stop => {
                    if explicit {
                        error!(partition = p, error = %e, "publishing explicit keys failed");
                    } else {
                        error!(partition = p, error = %e, "batch failed");
                        self.acks.push((p, Err(e.to_string())));
                    }
                    self.drop_held(p, "not applied: an earlier batch of the partition failed");
                    self.fatal.get_or_insert(e);
                }
            },
        }
        if let Some(a) = self.start_next(p, a, explicit, mine.contains(&p)) {
            self.idle.insert(p, a);
        }
    }

    /// A failure or the stop's interruption ends the loop: nothing new
    /// starts.
    fn ending(&self) -> bool {
        self.fatal.is_some() || self.stopping
    }

    /// Waits for every running apply (no batch is abandoned
    /// mid-transaction) and refuses what is held.
    async fn settle(&mut self, mine: &BTreeSet<u32>) {
        self.stopping = true;
        while let Some(j) = self.tasks.join_next_with_id().await {
            self.finished(j, mine);
        }
        let held: Vec<u32> = self.held.keys().copied().collect();
        for p in held {
            self.drop_held(p, "not applied: the applier is stopping");
        }
    }

    /// Hands the queued outcomes to the inbox; the first failure to do so
    /// stops the loop.
    async fn acknowledge<I: Inbox>(&mut self, inbox: &mut I, mine: &BTreeSet<u32>) {
        for (p, outcome) in std::mem::take(&mut self.acks) {
            // A partition revoked meanwhile is another member's now: its
            // (advisory) offset is not this one's to move.
            if !mine.contains(&p) {
                continue;
            }
            let failed = outcome.is_err();
            if let Err(e) = inbox.committed(p, outcome).await {
                if !failed {
                    error!(partition = p, error = %e, "acknowledging a batch failed");
                    self.fatal.get_or_insert(e.into());
                }
            }
        }
    }
}

/// Runs the appliers of every partition the inbox assigns until the inbox
/// closes (in-process: the extractor is gone) or `cancel` fires (Kafka).
/// `interrupt` is the stop signal: a delivery applied in several committed
/// steps (a TRUNCATE re-check's pages) ends after the step under way
/// instead of running to its end first (in-process, where `cancel` never
/// fires, as over Kafka).
///
/// Per round: membership changes first (ownership for the relay, cached
/// progress forgotten), then every delivery applied concurrently, each
/// acknowledged to the inbox after its sidecar transaction. Where the
/// inbox delivers while applying ([`Inbox::delivers_while_applying`],
/// Kafka), a partition's apply does not wait for the others of its round:
/// the loop asks for the next round while applies run, starts a delivery
/// at once when its partition is free and holds it behind the running
/// apply otherwise. A fenced partition is re-seeked to the stored
/// progress; any other failure waits for the running applies, is reported
/// to the inbox and stops the loop with the error.
pub async fn run<I: Inbox>(
    cfg: &Config,
    catalog: &Catalog,
    inbox: &mut I,
    owned: Option<Owned>,
    wake: RelayWake,
    cancel: CancellationToken,
    interrupt: CancellationToken,
) -> Result<()> {
    let topic = inbox.topic().to_string();
    let kind = inbox.checkpoint_kind();
    let overlap = inbox.delivers_while_applying();
    let span = info_span!("applier", topic = %topic);
    async move {
        let mut lanes = Lanes::new(wake);
        let mut last_check = Instant::now();
        // The partitions this loop was given: their explicit queues are its.
        let mut mine: BTreeSet<u32> = BTreeSet::new();
        loop {
            // Tasks done while the inbox was waited on (explicit pages on an
            // idle stream, say) free their partitions.
            while let Some(j) = lanes.tasks.try_join_next_with_id() {
                lanes.finished(j, &mine);
            }
            // No `next` is in flight here: what the inbox is owed goes first.
            lanes.acknowledge(inbox, &mine).await;
            for p in std::mem::take(&mut lanes.reseek) {
                if let (true, Some(a)) = (mine.contains(&p), lanes.idle.get_mut(&p)) {
                    if let Err(e) = reseek(a, p, inbox).await {
                        lanes.fatal.get_or_insert(e);
                    }
                }
            }
            if lanes.ending() {
                break;
            }
            // Owned partitions with no task running look at their explicit
            // queues when due (a running one does when it is done).
            for &p in &mine {
                if lanes.busy(p) || !lanes.explicit_due(p) || lanes.held.contains_key(&p) {
                    continue;
                }
                let a = match lanes.idle.remove(&p) {
                    Some(a) => a,
                    None => match connect(cfg, catalog, &topic, p, kind).await {
                        Ok(mut a) => {
                            a.interrupted_by(interrupt.clone());
                            a
                        }
                        Err(e) => {
                            error!(partition = p, error = %e, "the applier could not start");
                            lanes.fatal.get_or_insert(e);
                            break;
                        }
                    },
                };
                if let Some(a) = lanes.start_next(p, a, false, true) {
                    lanes.idle.insert(p, a);
                }
            }
            if lanes.ending() {
                break;
            }
            let round = if overlap {
                let next = inbox.next();
                tokio::pin!(next);
                loop {
                    // After a failure or an interruption nothing new is
                    // taken: the loop stops. (A poll dropped mid-way keeps
                    // its records.)
                    if lanes.ending() {
                        break None;
                    }
                    let hold_on = !lanes.tasks.is_empty()
                        && (lanes.held_records >= HELD_LIMIT || lanes.stalled());
                    tokio::select! {
                        biased;
                        _ = cancel.cancelled() => break None,
                        Some(j) = lanes.tasks.join_next_with_id(), if !lanes.tasks.is_empty() => lanes.finished(j, &mine),
                        r = &mut next, if !hold_on => break Some(r),
                    }
                }
            } else {
                tokio::select! {
                    r = inbox.next() => Some(r),
                    _ = cancel.cancelled() => None,
                }
            };
            let round = match round {
                // Cancelled, or (above) a task failed.
                None => break,
                Some(Ok(r)) => r,
                Some(Err(e)) => {
                    lanes.fatal.get_or_insert(e.into());
                    break;
                }
            };
            for m in &round.membership {
                let (Membership::Assigned(ps) | Membership::Revoked(ps)) = m;
                for p in ps {
                    match m {
                        Membership::Assigned(_) => {
                            mine.insert(*p);
                        }
                        Membership::Revoked(_) => {
                            mine.remove(p);
                            lanes.drop_held(*p, "not applied: the partition was revoked");
                            lanes.reseek.remove(p);
                        }
                    }
                    // Whoever held the partition meanwhile may have moved
                    // it; taking it again claims it (a new epoch).
                    if let Some(a) = lanes.idle.get_mut(p) {
                        a.taken_over();
                    } else if lanes.busy(*p) {
                        lanes.retake.insert(*p);
                    }
                }
                if let Some(o) = &owned {
                    let mut o = o.lock().map_err(|_| Error::Data("ownership lock poisoned".into()))?;
                    match m {
                        Membership::Assigned(ps) => {
                            for p in ps {
                                if !o.contains(&(*p as i32)) {
                                    o.push(*p as i32);
                                }
                            }
                            // What a previous owner left unsent goes out now,
                            // not at the relay's next poll.
                            lanes.wake.outbox_written();
                        }
                        Membership::Revoked(ps) => o.retain(|p| !ps.contains(&(*p as u32))),
                    }
                }
            }
            if round.deliveries.is_empty() {
                if round.closed {
                    break;
                }
                if last_check.elapsed() > PROGRESS_CHECK {
                    last_check = Instant::now();
                    recheck_progress(&mut lanes.idle, inbox).await;
                }
                continue;
            }
            // Every partition of the round gets its applier first: a
            // partition that cannot start fails the whole round, each
            // delivery acknowledged with the reason, before anything is applied.
            let mut failed_start = None;
            for d in &round.deliveries {
                let p = d.partition;
                if lanes.idle.contains_key(&p) || lanes.busy(p) || failed_start.is_some() {
                    continue;
                }
                match connect(cfg, catalog, &topic, p, kind).await {
                    Ok(mut a) => {
                        a.interrupted_by(interrupt.clone());
                        lanes.idle.insert(p, a);
                    }
                    Err(e) => failed_start = Some((p, e)),
                }
            }
            if let Some((p, e)) = failed_start {
                error!(partition = p, error = %e, "the applier could not start");
                let reason = format!("the applier of partition {p} could not start: {e}");
                for d in &round.deliveries {
                    lanes.acks.push((d.partition, Err(reason.clone())));
                }
                lanes.fatal.get_or_insert(e);
                break;
            }
            let merge_limit = cfg.extractor.max_batch_changes.max(1);
            for d in round.deliveries {
                let p = d.partition;
                if lanes.ending() {
                    lanes.acks.push((p, Err("not applied: the applier is stopping".into())));
                } else if lanes.reseek.contains(&p) {
                    // Read before the seek to the stored progress: the
                    // inbox delivers the partition again from there.
                    lanes.acks.push((p, Err("not applied: the partition is re-seeked after a fence".into())));
                } else if lanes.busy(p) || lanes.held.contains_key(&p) {
                    lanes.hold(d, merge_limit);
                } else {
                    let a = lanes.idle.remove(&p).expect("connected above");
                    lanes.spawn(p, Work::Delivery(d), a);
                }
            }
            if !overlap {
                // One round at a time: every apply is back (and
                // acknowledged at once) before the next round is asked for.
                while let Some(j) = lanes.tasks.join_next_with_id().await {
                    lanes.finished(j, &mine);
                    lanes.acknowledge(inbox, &mine).await;
                }
            }
        }
        lanes.settle(&mine).await;
        lanes.acknowledge(inbox, &mine).await;
        if let Some(e) = lanes.fatal {
            return Err(e);
        }
        info!("applier stopping");
        Ok(())
    }
    .instrument(span)
    .await
}

/// Moves the inbox of partition `p` to the applier's stored progress.
async fn reseek<I: Inbox>(a: &mut Applier<AnySidecar>, p: u32, inbox: &mut I) -> Result<()> {
    let at: Option<Checkpoint> = a.checkpoint().await?;
    inbox.seek(p, at).await?;
    Ok(())
}

/// Re-reads the stored progress of every partition whose applier has it
/// cached; where it moved (a replay rewound it), seeks the inbox there.
/// Idle housekeeping: a failure is logged and tried again at the next
/// check, and the next batch meets (and reports) a lasting one.
async fn recheck_progress<I: Inbox>(
    appliers: &mut HashMap<u32, Applier<AnySidecar>>,
    inbox: &mut I,
) {
    for (p, a) in appliers.iter_mut() {
        let believed = a.cached_progress();
        if believed.is_none() {
            continue;
        }
        a.reset_progress();
        let stored = match a.progress().await {
            Ok(s) => s,
            Err(e) => {
                warn!(partition = p, error = %e, "re-reading progress while idle failed; trying again later");
                continue;
            }
        };
        if moved_under_us(&believed, &stored) {
            warn!(partition = p, believed = ?believed.flatten().map(|x| x.position), now = ?stored.map(|x| x.position), "progress moved under this applier (a replay?); re-seeking");
            if let Err(e) = reseek(a, *p, inbox).await {
                warn!(partition = p, error = %e, "re-seeking while idle failed; trying again later");
                a.reset_progress();
            }
        }
    }
}

/// An applier for one partition with its own source and sidecar connections.
pub async fn connect(
    cfg: &Config,
    catalog: &Catalog,
    topic: &str,
    partition: u32,
    kind: CheckpointKind,
) -> Result<Applier<AnySidecar>> {
    let source = Source::connect(cfg).await?;
    let sidecar = AnySidecar::connect(cfg.sidecar_url(), &cfg.sidecar.schema).await?;
    Applier::new(cfg, catalog, source, sidecar, topic, partition, kind)
}

/// What the sidecar knows of this pipeline's partitions on a topic when the
/// extractor starts: the partition count records were last keyed by, and
/// the progress of every partition that has committed.
#[derive(Clone, Debug, Default)]
pub struct TopicProgress {
    /// [`Sidecar::partitions`].
    pub recorded: Option<u32>,
    /// `(partition, progress)` of every partition that has committed.
    pub progress: Vec<(u32, Progress)>,
}

impl TopicProgress {
    /// Reads it for `cfg.name` on `topic`.
    pub async fn read<S: Sidecar>(sidecar: &mut S, cfg: &Config, topic: &str) -> Result<Self> {
        Ok(TopicProgress {
            recorded: sidecar.partitions(&cfg.name, topic).await?,
            progress: sidecar.progress_all(&cfg.name, topic).await?,
        })
    }

    /// Where the sidecar says the pipeline had applied to: the highest
    /// source position among the partitions' progress (in-process: the
    /// batch upper bound; Kafka: the last source change applied). `None`
    /// when nothing was applied. The extractor consults it when its marker
    /// is gone.
    pub fn floor(&self, kind: CheckpointKind) -> Result<Option<skein_common::SourcePosition>> {
        let mut floor = None;
        for (p, progress) in &self.progress {
            let at = match kind {
                CheckpointKind::Source(d) => Some(
                    skein_common::SourcePosition::from_numeric(d, progress.position).map_err(
                        |e| Error::Data(format!("stored progress of partition {p}: {e}")),
                    )?,
                ),
                CheckpointKind::Offset => progress.source.map(|s| s.commit),
            };
            floor = floor.max(at);
        }
        Ok(floor)
    }
}

/// In-process, records keyed by a new partition count (or by a count the
/// sidecar does not know: one from before version 4) can land in a
/// partition whose progress already covers them, and would be dropped as
/// applied. The source re-sends everything after `resume` (the marker;
/// `None` when it is gone, and the source resumes where it can), so the
/// partitions that committed past it must forget their progress: their
/// records are then applied again, and aggregates whose state did not
/// change publish nothing (the version table). Returns those partitions.
pub fn rekey_in_process(known: &TopicProgress, resume: Option<i128>) -> Vec<u32> {
    known
        .progress
        .iter()
        // A part of a large transaction moves no position, only the last
        // source change: one past the restart point counts as well.
        .filter(|(_, at)| {
            resume.is_none_or(|r| {
                at.position > r || at.source.is_some_and(|s| s.commit.numeric() > r)
            })
        })
        .map(|(p, _)| *p)
        .collect()
}

/// Over Kafka, whether the extractor may key records by `configured`
/// partitions on `topic` when they were last keyed by `recorded` (the
/// topic's partition count when the sidecar does not know): a different
/// count moves aggregates between partitions, so an aggregate's unapplied
/// records in its old partition would be committed out of order with its
/// new ones by another applier. `behind` describes each partition that
/// still holds unapplied records. An error names them and what to do.
pub fn repartition_check(
    topic: &str,
    recorded: u32,
    configured: u32,
    behind: &[String],
) -> Result<()> {
    if recorded == configured || behind.is_empty() {
        return Ok(());
    }
    Err(Error::Data(format!(
        "transport.partitions changed from {recorded} to {configured} on `{topic}` while records \
         keyed by {recorded} partitions are not applied yet ({}); re-keying them now would \
         reorder an aggregate's changes. Start once more with `partitions: {recorded}` until \
         the appliers have caught up (`skein status`), stop it, then change the count",
        behind.join("; ")
    )))
}

/// Where a Kafka partition resumes when it is assigned: the next offset
/// from the sidecar's progress of `cfg.name` on `topic` (the sidecar, not
/// Kafka's committed offset, is the truth). Blocking: the consumer calls it
/// from its rebalance callback on a polling thread, and it runs the
/// sidecar query on `rt`. The connection is opened on first use and
/// dropped after an error.
pub fn resume_from_sidecar(cfg: &Config, topic: &str, rt: tokio::runtime::Handle) -> ResumeAt {
    let cfg = cfg.clone();
    let topic = topic.to_string();
    let sidecar: Mutex<Option<AnySidecar>> = Mutex::new(None);
    Arc::new(move |parts: &[u32]| {
        let mut guard = sidecar
            .lock()
            .map_err(|_| "the sidecar lock is poisoned".to_string())?;
        if guard.is_none() {
            let sc = rt
                .block_on(AnySidecar::connect(cfg.sidecar_url(), &cfg.sidecar.schema))
                .map_err(|e| e.to_string())?;
            *guard = Some(sc);
        }
        let sc = guard.as_mut().expect("connected above");
        let mut out = HashMap::new();
        for p in parts {
            match rt.block_on(sc.progress(&cfg.name, &topic, *p)) {
                Ok(pr) => {
                    out.insert(*p, pr.map(|x| x.offset()));
                }
                Err(e) => {
                    *guard = None;
                    return Err(e.to_string());
                }
            }
        }
        Ok(out)
    })
}

#[cfg(test)]
mod tests {
    use skein_common::{ChangePosition, PgLsn};

    use super::*;

    #[test]
    fn a_fence_reseeks_and_any_other_failure_stops() {
        let fenced = Error::Fenced {
            partition: 1,
            expected: Some(crate::sidecar::Fence {
                position: 5,
                epoch: 1,
            }),
            found: Some(crate::sidecar::Fence {
                position: 5,
                epoch: 2,
            }),
        };
        assert_eq!(after_failure(&fenced), AfterFailure::Reseek);
        assert_eq!(
            after_failure(&Error::Data("bad row".into())),
            AfterFailure::Stop
        );
        let sink = Error::Sink {
            message: "full".into(),
            source: None,
        };
        assert_eq!(after_failure(&sink), AfterFailure::Stop);
        let gone = Error::Transport(skein_transporter::Error::Disconnected { partition: 0 });
        assert_eq!(after_failure(&gone), AfterFailure::Stop);
    }

    #[test]
    fn a_kafka_partition_count_changes_only_with_nothing_left_to_apply() {
        let behind = vec!["partition 1 is applied up to offset 3 of 9".to_string()];
        assert!(repartition_check("t", 4, 4, &behind).is_ok(), "unchanged");
        assert!(repartition_check("t", 4, 2, &[]).is_ok(), "drained");
        let err = repartition_check("t", 4, 2, &behind)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("from 4 to 2")
                && err.contains("partition 1")
                && err.contains("partitions: 4"),
            "{err}"
        );
    }

    #[test]
    fn in_process_rekeying_forgets_the_partitions_past_the_restart_point() {
        let at = |position| Progress {
            position,
            source: None,
            recheck_after: None,
            epoch: 0,
        };
        let known = TopicProgress {
            recorded: Some(2),
            progress: vec![(0, at(120)), (1, at(100)), (3, at(90))],
        };
        assert_eq!(rekey_in_process(&known, Some(100)), vec![0]);
        assert_eq!(rekey_in_process(&known, Some(120)), Vec::<u32>::new());
        assert_eq!(
            rekey_in_process(&known, None),
            vec![0, 1, 3],
            "no marker: the source may resume anywhere before"
        );
    }

    #[test]
    fn progress_moved_only_when_it_differs_from_what_was_read() {
        let at = |position, epoch| Progress {
            position,
            source: Some(ChangePosition {
                commit: PgLsn(7).into(),
                seq: 0,
            }),
            recheck_after: None,
            epoch,
        };
        let p = |position| at(position, 0);
        assert!(
            !moved_under_us(&None, &Some(p(5))),
            "never read: nothing to compare"
        );
        assert!(!moved_under_us(&Some(Some(p(5))), &Some(p(5))));
        assert!(
            moved_under_us(&Some(Some(p(5))), &Some(p(2))),
            "rewound by a replay"
        );
        assert!(
            moved_under_us(&Some(None), &Some(p(2))),
            "another applier committed first"
        );
        assert!(moved_under_us(&Some(Some(p(5))), &None), "progress deleted");
        assert!(
            moved_under_us(&Some(Some(p(5))), &Some(at(5, 1))),
            "rewound and re-applied to the same position (ABA), or claimed"
        );
    }
}
