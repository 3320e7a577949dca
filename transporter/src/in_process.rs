//! The embedded default transport: one bounded crossbeam channel per
//! partition, the same key hashing as Kafka.
//!
//! Acknowledgement is end to end: [`Transport::send`] resolves only when
//! every partition's applier has committed its slice to the sidecar (or
//! found nothing new in it), so the extractor's marker never runs ahead of
//! the sidecar. The applier side is an [`Inbox`] ([`InProcessInbox`]).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use skein_common::metrics as m;
use skein_common::Checkpoint;

use crate::{
    Batch, Delivery, Error, Inbox, Membership, Result, Round, Transport, IN_PROCESS_TOPIC,
};
use skein_common::{CheckpointKind, Dialect};

/// What an applier answers for one slice.
type Ack = std::result::Result<(), String>;

/// One partition's part of a batch, with the way to acknowledge it.
#[derive(Debug)]
struct Slice {
    /// The batch, holding only this partition's records.
    batch: Batch,
    ack: tokio::sync::oneshot::Sender<Ack>,
}

impl Slice {
    /// Acknowledges the slice: `Ok` once it is durably committed (or was
    /// already), `Err` when it could not be.
    fn ack(self, result: Ack) {
        // The extractor may have stopped waiting (shutdown): nothing to do then.
        let _ = self.ack.send(result);
    }
}

/// Bounded in-process channels, one per partition.
#[derive(Clone)]
pub struct InProcess {
    senders: Vec<crossbeam_channel::Sender<Slice>>,
}

impl InProcess {
    /// Creates `partitions` channels holding at most `capacity` slices
    /// each, and the applier side that reads them.
    pub fn new(partitions: u32, capacity: usize, dialect: Dialect) -> (InProcess, InProcessInbox) {
        let mut senders = vec![];
        let mut receivers = vec![];
        for p in 0..partitions.max(1) {
            metrics::gauge!(m::TRANSPORT_QUEUE_CAPACITY, "partition" => p.to_string())
                .set(capacity.max(1) as f64);
            metrics::gauge!(m::TRANSPORT_LAG, "partition" => p.to_string()).set(0.0);
            let (tx, rx) = crossbeam_channel::bounded(capacity.max(1));
            senders.push(tx);
            receivers.push(rx);
        }
        let inbox = InProcessInbox {
            receivers,
            open: (0..partitions.max(1)).collect(),
            unacked: HashMap::new(),
            failed: HashMap::new(),
            announced: false,
            dialect,
        };
        (InProcess { senders }, inbox)
    }

    /// Number of partitions.
    pub fn partitions(&self) -> u32 {
        self.senders.len() as u32
    }
}

/// Splits a batch into per-partition batches by the frozen key hash; the
/// records move, they are not copied.
pub fn split(mut batch: Batch, partitions: u32) -> Vec<Batch> {
    let records = std::mem::take(&mut batch.records);
    let mut parts: Vec<Batch> = (0..partitions)
        .map(|_| Batch {
            records: Vec::with_capacity(records.len() / partitions.max(1) as usize + 1),
            ..batch.clone_header()
        })
        .collect();
    for r in records {
        let p = r.partition(partitions) as usize;
        parts[p].records.push(r);
    }
    parts
}

impl Batch {
    fn clone_header(&self) -> Batch {
        Batch {
            seq: self.seq,
            lower: self.lower,
            upper: self.upper,
            has_data_loss: self.has_data_loss,
            records: vec![],
        }
    }
}

impl Transport for InProcess {
    /// A partition acknowledges a slice once its applier committed it.
    fn acknowledges_applied(&self) -> bool {
        true
    }

    async fn submit(&self, batch: Batch) -> Result<crate::Ack> {
        let parts = split(batch, self.partitions());
        // Sent and not yet acknowledged, whatever way this ends.
        let lag = InFlight::new(&parts);
        let mut waits = vec![];
        for (p, part) in parts.into_iter().enumerate() {
            let partition = p as u32;
            let (tx, rx) = tokio::sync::oneshot::channel();
            let slice = Slice {
                batch: part,
                ack: tx,
            };
            // Bounded: when an applier is behind, wait (off the async
            // workers) for room instead of buffering without limit.
            let sender = self.senders[p].clone();
            tokio::task::spawn_blocking(move || sender.send(slice))
                .await
                .map_err(|_| Error::Disconnected { partition })?
                .map_err(|_| Error::Disconnected { partition })?;
            waits.push((partition, rx));
        }
        Ok(Box::pin(async move {
            let _lag = lag;
            for (partition, rx) in waits {
                match rx.await {
                    Ok(Ok(())) => {}
                    Ok(Err(message)) => return Err(Error::ApplierFailed { partition, message }),
                    Err(_) => return Err(Error::Disconnected { partition }),
                }
            }
            Ok(())
        }))
    }
}

/// A batch's records counted in each partition's transport lag until it
/// is dropped (acknowledged, failed or given up).
struct InFlight(Vec<(metrics::Gauge, f64)>);

impl InFlight {
    fn new(parts: &[Batch]) -> InFlight {
        InFlight(
            parts
                .iter()
                .enumerate()
                .filter(|(_, b)| !b.records.is_empty())
                .map(|(p, b)| {
                    let g = metrics::gauge!(m::TRANSPORT_LAG, "partition" => p.to_string());
                    let n = b.records.len() as f64;
                    g.increment(n);
                    (g, n)
                })
                .collect(),
        )
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        for (g, n) in &self.0 {
            g.decrement(*n);
        }
    }
}

/// The applier side of the in-process transport: every partition's
/// channel, read as one [`Inbox`].
///
/// The extractor sends one slice to every partition per batch (several
/// batches may be in flight, each partition's slices queued in order), so a
/// round gathers at most one slice per open partition (or what arrived
/// within [`GATHER`] of the first) and the applier applies them
/// concurrently. A partition delivers its next slice only after the last
/// one was acknowledged, and none after one failed.
pub struct InProcessInbox {
    receivers: Vec<crossbeam_channel::Receiver<Slice>>,
    /// Partitions whose sender is still there.
    open: std::collections::BTreeSet<u32>,
    /// Delivered slices waiting for [`Inbox::committed`].
    unacked: HashMap<u32, Slice>,
    /// Partitions whose last slice failed, with the reason: with batches
    /// in flight, later slices of that partition are refused, never
    /// applied. Applying one would move the partition's progress past the
    /// failed batch, which the extractor re-sends, and its records would
    /// then be dropped as already applied.
    failed: HashMap<u32, String>,
    /// Whether the one [`Membership::Assigned`] (all partitions) was given.
    announced: bool,
    dialect: Dialect,
}

/// An applier that stops (a failure before any delivery, say) drops its
/// inbox: the slices still queued in the channels answer "disconnected"
/// so the extractor stops with the applier instead of waiting for them.
/// (A channel keeps its queued slices while a sender lives, and with them
/// the acknowledgement the extractor waits on.)
impl Drop for InProcessInbox {
    fn drop(&mut self) {
        for r in &self.receivers {
            while r.try_recv().is_ok() {}
        }
    }
}

/// How long a round waits for the other partitions' slices of a batch once
/// the first arrived.
const GATHER: Duration = Duration::from_millis(50);
/// How long an empty round waits.
const IDLE: Duration = Duration::from_millis(200);

/// What one blocking wait over the channels gave.
enum Got {
    Slice(u32, Slice),
    Closed(u32),
    Nothing,
}

/// Waits up to `timeout` for a slice on any of `partitions`.
fn wait_any(
    receivers: &[crossbeam_channel::Receiver<Slice>],
    partitions: &[u32],
    timeout: Duration,
) -> Got {
    if partitions.is_empty() {
        return Got::Nothing;
    }
    let mut sel = crossbeam_channel::Select::new();
    for p in partitions {
        sel.recv(&receivers[*p as usize]);
    }
    match sel.select_timeout(timeout) {
        Err(_) => Got::Nothing,
        Ok(op) => {
            let p = partitions[op.index()];
            match op.recv(&receivers[p as usize]) {
                Ok(s) => Got::Slice(p, s),
                Err(_) => Got::Closed(p),
            }
        }
    }
}

impl InProcessInbox {
    /// Partitions that may deliver: open, and not waiting for an ack.
    fn ready(&self) -> Vec<u32> {
        self.open
            .iter()
            .copied()
            .filter(|p| !self.unacked.contains_key(p))
            .collect()
    }

    /// Waits up to `timeout` for a slice of a ready partition; the
    /// channels block, so off the async workers.
    async fn wait(&self, timeout: Duration) -> Result<Got> {
        let receivers = self.receivers.clone();
        let ready = self.ready();
        tokio::task::spawn_blocking(move || wait_any(&receivers, &ready, timeout))
            .await
            .map_err(|e| Error::Consumer {
                message: format!("waiting on the in-process channels: {e}"),
            })
    }

    fn take(&mut self, got: Got, round: &mut Round) {
        match got {
            Got::Slice(p, slice) if self.failed.contains_key(&p) => {
                let reason = &self.failed[&p];
                slice.ack(Err(format!(
                    "not applied: an earlier batch of partition {p} failed ({reason})"
                )));
            }
            Got::Slice(p, mut slice) => {
                // The slice stays only for its acknowledgement: its records
                // move to the delivery instead of being copied.
                let b = &mut slice.batch;
                round.deliveries.push(Delivery {
                    partition: p,
                    lower: Checkpoint::Source(b.lower),
                    upper: Checkpoint::Source(b.upper),
                    has_data_loss: b.has_data_loss,
                    records: std::mem::take(&mut b.records),
                    dead_letters: 0,
                });
                self.unacked.insert(p, slice);
            }
            Got::Closed(p) => {
                self.open.remove(&p);
            }
            Got::Nothing => {}
        }
    }
}

impl Inbox for InProcessInbox {
    fn topic(&self) -> &str {
        IN_PROCESS_TOPIC
    }

    fn checkpoint_kind(&self) -> CheckpointKind {
        CheckpointKind::Source(self.dialect)
    }

    async fn next(&mut self) -> Result<Round> {
        let mut round = Round::default();
        if !self.announced {
            self.announced = true;
            round
                .membership
                .push(Membership::Assigned(self.open.iter().copied().collect()));
        }
        let first = self.wait(IDLE).await?;
        let got_one = matches!(first, Got::Slice(..));
        self.take(first, &mut round);
        if got_one {
            let deadline = Instant::now() + GATHER;
            loop {
                let left = deadline.saturating_duration_since(Instant::now());
                if self.ready().is_empty() || left.is_zero() {
                    break;
                }
                let got = self.wait(left).await?;
                if matches!(got, Got::Nothing) {
                    break;
                }
                self.take(got, &mut round);
            }
        }
        round.closed = self.open.is_empty() && self.unacked.is_empty();
        Ok(round)
    }

    async fn committed(
        &mut self,
        partition: u32,
        outcome: std::result::Result<Checkpoint, String>,
    ) -> Result<()> {
        if let Err(reason) = &outcome {
            self.failed.insert(partition, reason.clone());
        }
        if let Some(slice) = self.unacked.remove(&partition) {
            slice.ack(outcome.map(|_| ()));
        }
        Ok(())
    }

    /// Nothing to move: the extractor re-sends from its marker, and the
    /// applier drops what its progress already covers.
    async fn seek(&mut self, _partition: u32, _to: Option<Checkpoint>) -> Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use skein_common::{ChangePosition, ChangeRecord, Op, PgLsn, RootKey, SourcePosition};

    use super::*;

    fn rec(key: &str, seq: u64) -> ChangeRecord {
        ChangeRecord {
            entity: "customer".into(),
            root_key: RootKey(vec![Some(key.into())]),
            table: "public.customer".into(),
            op: Op::Update,
            position: ChangePosition {
                commit: PgLsn(100).into(),
                seq,
            },
            tx_id: 1,
            commit_time_micros: 0,
        }
    }

    #[test]
    fn split_keeps_one_key_in_one_partition_in_order() {
        let records: Vec<_> = (0..200).map(|i| rec(&(i % 20).to_string(), i)).collect();
        let b = Batch {
            seq: 1,
            lower: PgLsn(1).into(),
            upper: PgLsn(100).into(),
            has_data_loss: false,
            records,
        };
        let parts = split(b, 4);
        assert_eq!(parts.iter().map(|p| p.records.len()).sum::<usize>(), 200);
        for p in &parts {
            assert_eq!(p.upper, SourcePosition::Pg(PgLsn(100)));
            for k in 0..20 {
                let seqs: Vec<u64> = p
                    .records
                    .iter()
                    .filter(|r| r.root_key.0[0].as_deref() == Some(&k.to_string()))
                    .map(|r| r.position.seq)
                    .collect();
                assert!(seqs.windows(2).all(|w| w[0] < w[1]));
            }
        }
        for k in 0..20 {
            let holders = parts
                .iter()
                .filter(|p| {
                    p.records
                        .iter()
                        .any(|r| r.root_key.0[0].as_deref() == Some(&k.to_string()))
                })
                .count();
            assert_eq!(holders, 1);
        }
    }

    #[tokio::test]
    async fn send_waits_for_every_partition_and_reports_failures() {
        let (t, mut inbox) = InProcess::new(2, 1, Dialect::Postgres);
        let appliers = tokio::spawn(async move {
            let mut delivered = vec![];
            while delivered.len() < 2 {
                let round = inbox.next().await.unwrap();
                delivered.extend(round.deliveries.iter().map(|d| d.partition));
            }
            delivered.sort();
            assert_eq!(delivered, vec![0, 1]);
            inbox
                .committed(0, Ok(Checkpoint::Source(PgLsn(2).into())))
                .await
                .unwrap();
            inbox.committed(1, Err("boom".into())).await.unwrap();
            inbox
        });
        let b = one_record(1, 0);
        let e = t.send(b).await.unwrap_err();
        assert!(
            matches!(e, Error::ApplierFailed { partition: 1, .. }),
            "{e}"
        );
        appliers.await.unwrap();
    }

    #[tokio::test]
    async fn a_dropped_inbox_fails_the_slices_it_never_took() {
        let (t, inbox) = InProcess::new(1, 4, Dialect::Postgres);
        let b = one_record(1, 0);
        // Queued in the channel, never taken by the applier.
        let ack = t.submit(b).await.unwrap();
        drop(inbox);
        let e = tokio::time::timeout(Duration::from_secs(5), ack)
            .await
            .expect("the extractor must not wait for an applier that is gone")
            .unwrap_err();
        assert!(matches!(e, Error::Disconnected { partition: 0 }), "{e}");
    }

    #[tokio::test]
    async fn inbox_assigns_every_partition_then_closes_with_the_sender() {
        let (t, mut inbox) = InProcess::new(3, 1, Dialect::Postgres);
        let first = inbox.next().await.unwrap();
        assert_eq!(first.membership, vec![Membership::Assigned(vec![0, 1, 2])]);
        assert!(first.deliveries.is_empty() && !first.closed);
        assert_eq!(inbox.topic(), IN_PROCESS_TOPIC);
        drop(t);
        let mut closed = false;
        for _ in 0..10 {
            let r = inbox.next().await.unwrap();
            assert!(r.membership.is_empty() && r.deliveries.is_empty());
            if r.closed {
                closed = true;
                break;
            }
        }
        assert!(closed, "the inbox never saw the sender go");
    }

    /// Batch `(u, u + 1]` holding one record of key 1.
    fn one_record(u: u64, seq: u64) -> Batch {
        Batch {
            seq: u,
            lower: PgLsn(u).into(),
            upper: PgLsn(u + 1).into(),
            has_data_loss: false,
            records: vec![rec("1", seq)],
        }
    }

    #[tokio::test]
    async fn a_partition_delivers_again_only_after_its_ack() {
        let (t, mut inbox) = InProcess::new(1, 4, Dialect::Postgres);
        let batch = |u| one_record(u, 0);
        let sender = tokio::spawn(async move {
            t.send(batch(1)).await.unwrap();
            t.send(batch(2)).await.unwrap();
        });
        let mut uppers = vec![];
        while uppers.len() < 2 {
            let r = inbox.next().await.unwrap();
            assert!(r.deliveries.len() <= 1);
            for d in r.deliveries {
                assert_eq!(
                    d.lower,
                    Checkpoint::Source(PgLsn(uppers.len() as u64 + 1).into())
                );
                uppers.push(d.upper);
                // Not acknowledged yet: the next round delivers nothing.
                if uppers.len() == 1 {
                    let idle = inbox.next().await.unwrap();
                    assert!(idle.deliveries.is_empty());
                }
                inbox.committed(0, Ok(d.upper)).await.unwrap();
            }
        }
        sender.await.unwrap();
        assert_eq!(
            uppers,
            vec![
                Checkpoint::Source(PgLsn(2).into()),
                Checkpoint::Source(PgLsn(3).into())
            ]
        );
    }

    /// Pipelined batches queue behind a failed one: a partition whose slice
    /// failed (a fenced or failed commit) must not apply the next, or its
    /// progress would cover the failed batch the extractor re-sends.
    #[tokio::test]
    async fn after_a_failed_slice_the_partition_applies_nothing_more() {
        let (t, mut inbox) = InProcess::new(1, 4, Dialect::Postgres);
        let batch = |u| one_record(u, u);
        let first = t.submit(batch(1)).await.unwrap();
        let second = t.submit(batch(2)).await.unwrap();
        let mut delivered = vec![];
        while delivered.is_empty() {
            delivered = inbox.next().await.unwrap().deliveries;
        }
        assert_eq!(delivered[0].upper, Checkpoint::Source(PgLsn(2).into()));
        inbox.committed(0, Err("fenced".into())).await.unwrap();
        for _ in 0..3 {
            let r = inbox.next().await.unwrap();
            assert!(
                r.deliveries.is_empty(),
                "a slice after the failed one was delivered: {:?}",
                r.deliveries
            );
        }
        assert!(first.await.is_err());
        let e = second.await.unwrap_err();
        assert!(e.to_string().contains("earlier batch"), "{e}");
    }
}
