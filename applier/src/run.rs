//! The applier loop, written once for every transport: rounds from an
//! [`Inbox`], one [`Applier`] per partition, the partitions of a round
//! applied concurrently on the tokio runtime.
//!
//! One concurrency model: async tasks. The transports' blocking waits
//! (crossbeam channels, librdkafka's poll) run on tokio's blocking pool
//! inside the inboxes, so the loop itself never blocks a worker and holds
//! no lock across an await.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use skein_common::config::Config;
use skein_common::{Checkpoint, CheckpointKind};
use skein_sql::Catalog;
use skein_transporter::kafka::ResumeAt;
use skein_transporter::{Inbox, Membership};
use tokio_util::sync::CancellationToken;
use tracing::{error, info, info_span, warn, Instrument};

use crate::apply::Applier;
use crate::error::{Error, Result};
use crate::hydrate::Source;
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
    /// Anything else: report the failure to the inbox and stop; a restart
    /// resumes from the sidecar's progress.
    Stop,
}

/// The fence decision, pure: only a fence is survived in place.
pub fn after_failure(e: &Error) -> AfterFailure {
    match e {
        Error::Fenced { .. } => AfterFailure::Reseek,
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

/// Runs the appliers of every partition the inbox assigns until the inbox
/// closes (in-process: the extractor is gone) or `cancel` fires (Kafka).
///
/// Per round: membership changes first (ownership for the relay, cached
/// progress forgotten), then every delivery applied concurrently, each
/// acknowledged to the inbox after its sidecar transaction. A fenced
/// partition is re-seeked to the stored progress; any other failure is
/// reported to the inbox and stops the loop with the error.
pub async fn run<I: Inbox>(
    cfg: &Config,
    catalog: &Catalog,
    inbox: &mut I,
    owned: Option<Owned>,
    cancel: CancellationToken,
) -> Result<()> {
    let topic = inbox.topic().to_string();
    let kind = inbox.checkpoint_kind();
    let span = info_span!("applier", topic = %topic);
    async move {
        let mut appliers: HashMap<u32, Applier<AnySidecar>> = HashMap::new();
        let mut last_check = Instant::now();
        // The partitions this loop was given: their explicit queues are its.
        let mut mine: BTreeSet<u32> = BTreeSet::new();
        let mut last_explicit: Option<Instant> = None;
        let mut explicit_busy = false;
        loop {
            if explicit_busy || last_explicit.is_none_or(|t| t.elapsed() > EXPLICIT_POLL) {
                last_explicit = Some(Instant::now());
                explicit_busy = explicit_pass(cfg, catalog, &topic, kind, &mine, &mut appliers, inbox).await?;
            }
            let round = tokio::select! {
                r = inbox.next() => r?,
                _ = cancel.cancelled() => break,
            };
            for m in &round.membership {
                match m {
                    Membership::Assigned(ps) => mine.extend(ps.iter().copied()),
                    Membership::Revoked(ps) => {
                        for p in ps {
                            mine.remove(p);
                        }
                    }
                }
                let (Membership::Assigned(ps) | Membership::Revoked(ps)) = m;
                for p in ps {
                    // Whoever held the partition meanwhile may have moved
                    // it; taking it again claims it (a new epoch).
                    if let Some(a) = appliers.get_mut(p) {
                        a.taken_over();
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
                    recheck_progress(&mut appliers, inbox).await;
                }
                continue;
            }
            // Every partition of the round gets its applier first: a
            // partition that cannot start fails the whole round, each
            // delivery acknowledged with the reason, before anything is applied.
            let mut ready = Vec::with_capacity(round.deliveries.len());
            let mut failed_start = None;
            for d in &round.deliveries {
                let p = d.partition;
                if appliers.contains_key(&p) || failed_start.is_some() {
                    continue;
                }
                match connect(cfg, catalog, &topic, p, kind).await {
                    Ok(a) => {
                        appliers.insert(p, a);
                    }
                    Err(e) => failed_start = Some((p, e)),
                }
            }
            if let Some((p, e)) = failed_start {
                error!(partition = p, error = %e, "the applier could not start");
                let reason = format!("the applier of partition {p} could not start: {e}");
                for d in &round.deliveries {
                    inbox.committed(d.partition, Err(reason.clone())).await?;
                }
                return Err(e);
            }
            for d in round.deliveries {
                let a = appliers.remove(&d.partition).expect("connected above");
                ready.push((d, a));
            }
            let mut tasks = tokio::task::JoinSet::new();
            for (d, mut a) in ready {
                let p = d.partition;
                tasks.spawn(
                    async move {
                        let r = a.apply(&d).await;
                        (d.partition, d.upper, a, r)
                    }
                    .instrument(info_span!("partition", partition = p)),
                );
            }
            // Join every task before acting on a failure: no batch of the
            // round is abandoned mid-transaction, every one is acknowledged.
            let mut fatal: Option<Error> = None;
            while let Some(joined) = tasks.join_next().await {
                let (p, upper, mut a, r) = match joined {
                    Ok(done) => done,
                    Err(e) => {
                        // A panicked task: its partition is not acknowledged,
                        // which stops the extractor (in-process) or leaves
                        // the records for a restart (Kafka).
                        fatal.get_or_insert(Error::Data(format!("an apply task failed: {e}")));
                        continue;
                    }
                };
                let outcome = match r {
                    Ok(_) => inbox.committed(p, Ok(upper)).await.map_err(Error::from),
                    Err(e) => match after_failure(&e) {
                        AfterFailure::Reseek => {
                            warn!(partition = p, error = %e, "fenced: another applier moved this partition's progress; nothing was written, re-seeking");
                            a.fenced();
                            match inbox.committed(p, Err(e.to_string())).await {
                                Ok(()) => reseek(&mut a, p, inbox).await,
                                Err(e) => Err(e.into()),
                            }
                        }
                        AfterFailure::Stop => {
                            let _ = inbox.committed(p, Err(e.to_string())).await;
                            Err(e)
                        }
                    },
                };
                if let Err(e) = outcome {
                    error!(partition = p, error = %e, "batch failed");
                    fatal.get_or_insert(e);
                }
                appliers.insert(p, a);
            }
            if let Some(e) = fatal {
                return Err(e);
            }
        }
        info!("applier stopping");
        Ok(())
    }
    .instrument(span)
    .await
}

/// Publishes a page of each owned partition's queued explicit keys
/// ([`Applier::explicit_once`]), one partition after the other, between
/// rounds: serialised with the partition's deliveries. Returns whether any
/// partition had some (look again at once). A fence re-seeks the
/// partition, as for a delivery; any other failure stops the loop.
async fn explicit_pass<I: Inbox>(
    cfg: &Config,
    catalog: &Catalog,
    topic: &str,
    kind: CheckpointKind,
    mine: &BTreeSet<u32>,
    appliers: &mut HashMap<u32, Applier<AnySidecar>>,
    inbox: &mut I,
) -> Result<bool> {
    let mut busy = false;
    for &p in mine {
        if let std::collections::hash_map::Entry::Vacant(v) = appliers.entry(p) {
            match connect(cfg, catalog, topic, p, kind).await {
                Ok(a) => v.insert(a),
                Err(e) => {
                    error!(partition = p, error = %e, "the applier could not start");
                    return Err(e);
                }
            };
        }
        let a = appliers.get_mut(&p).expect("connected above");
        match a
            .explicit_once()
            .instrument(info_span!("partition", partition = p))
            .await
        {
            Ok(done) => busy |= done.records > 0,
            Err(e) if after_failure(&e) == AfterFailure::Reseek => {
                warn!(partition = p, error = %e, "fenced while publishing explicit keys: another applier moved this partition's progress; nothing was written, re-seeking");
                a.fenced();
                reseek(a, p, inbox).await?;
            }
            Err(e) => {
                error!(partition = p, error = %e, "publishing explicit keys failed");
                return Err(e);
            }
        }
    }
    Ok(busy)
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
