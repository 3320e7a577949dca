//! The applier side over Kafka: one member of the appliers' consumer group.
//!
//! On assignment the rebalance callback asks the applier where each
//! partition resumes ([`ResumeAt`], read from the sidecar) and assigns the
//! partition at that offset: the sidecar, not Kafka's committed offset, is
//! the truth; the Kafka offset is committed after the sidecar, for lag tools
//! only. Rebalance callbacks run inside `poll`, which the applier loop calls
//! while applies run ([`Inbox::delivers_while_applying`]): a revoked
//! partition's apply may still commit after the revocation. The sidecar
//! fences it if the new owner claimed the partition first; otherwise the new
//! owner, placed at the progress it read on assignment, drops the records
//! that commit covered. What the inbox holds for a revoked partition is
//! dropped unapplied. Records that cannot be decoded go to the dead-letter
//! topic ([`super::dlq_topic`]) with the reason in a header.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext, RebalanceProtocol};
use rdkafka::error::RDKafkaErrorCode;
use rdkafka::message::{Header, Message, OwnedHeaders, OwnedMessage};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use rdkafka::types::RDKafkaRespErr;
use rdkafka::ClientContext;
use skein_common::{ChangeRecord, Checkpoint, CheckpointKind};
use tracing::{error, info, warn};

use super::codec::{decode_message, encode, Envelope, Message as Records};
use super::{dlq_topic, reliable_producer_config};
use crate::{Delivery, Error, Inbox, Membership, Result, Round};

/// Where each newly assigned partition resumes: the next offset to consume
/// from the sidecar's progress, `None` for a partition never applied (it
/// starts at the log's beginning). Called from the rebalance callback, on
/// the polling thread: it may block.
pub type ResumeAt =
    Arc<dyn Fn(&[u32]) -> std::result::Result<HashMap<u32, Option<i64>>, String> + Send + Sync>;

/// What the [`KafkaInbox`] needs besides the client configuration.
pub struct InboxSettings {
    /// The change topic.
    pub topic: String,
    /// The consumer group of the appliers.
    pub group: String,
    /// Static membership (`group.instance.id`), when given.
    pub instance_id: Option<String>,
    /// Entities this applier knows; a record of another goes to the
    /// dead-letter topic.
    pub entities: HashSet<String>,
    /// Most records one round takes, over its partitions (a pack that
    /// crosses it is taken whole).
    pub max_records: usize,
    /// Longest a round collects records.
    pub wait: Duration,
}

struct InboxContext {
    topic: String,
    resume: ResumeAt,
    membership: Mutex<Vec<Membership>>,
    failed: Mutex<Option<String>>,
    /// Where each partition was last placed (assignment or seek), to say
    /// which offset the log no longer holds.
    placed: Mutex<HashMap<u32, Option<i64>>>,
}

impl InboxContext {
    fn push(&self, m: Membership) {
        if let Ok(mut v) = self.membership.lock() {
            v.push(m);
        }
    }

    fn take(&self) -> Vec<Membership> {
        self.membership
            .lock()
            .map(|mut v| std::mem::take(&mut *v))
            .unwrap_or_default()
    }

    fn placed_at(&self, p: u32, next: Option<i64>) {
        if let Ok(mut m) = self.placed.lock() {
            m.insert(p, next);
        }
    }

    fn placed(&self, p: u32) -> Option<i64> {
        self.placed
            .lock()
            .ok()
            .and_then(|m| m.get(&p).copied().flatten())
    }

    fn fail(&self, message: String) {
        error!(error = %message, "rebalance failed");
        if let Ok(mut f) = self.failed.lock() {
            f.get_or_insert(message);
        }
    }
}

/// Where a partition resumes: its committed progress, or the beginning
/// when it has none.
fn start_offset(next: Option<i64>) -> Offset {
    next.map(Offset::Offset).unwrap_or(Offset::Beginning)
}

impl ClientContext for InboxContext {}

impl ConsumerContext for InboxContext {
    /// Assigns each partition at its sidecar progress (or the beginning when
    /// it has none), so consumption resumes exactly after the last committed
    /// batch whatever Kafka's committed offset says.
    fn rebalance(
        &self,
        consumer: &BaseConsumer<Self>,
        err: RDKafkaRespErr,
        tpl: &mut TopicPartitionList,
    ) {
        let cooperative = matches!(
            consumer.rebalance_protocol(),
            RebalanceProtocol::Cooperative
        );
        let parts: Vec<u32> = tpl
            .elements()
            .iter()
            .filter(|e| e.topic() == self.topic)
            .map(|e| e.partition() as u32)
            .collect();
        match err {
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__ASSIGN_PARTITIONS => {
                match (self.resume)(&parts) {
                    Ok(progress) => {
                        for (p, next) in &progress {
                            self.placed_at(*p, *next);
                            if let Err(e) = tpl.set_partition_offset(
                                &self.topic,
                                *p as i32,
                                start_offset(*next),
                            ) {
                                self.fail(format!("setting the start of partition {p}: {e}"));
                            }
                        }
                        info!(partitions = ?parts, progress = ?progress.iter().collect::<BTreeMap<_, _>>(), "partitions assigned");
                    }
                    Err(e) => self.fail(format!("reading progress on assignment: {e}")),
                }
                let r = if cooperative {
                    consumer.incremental_assign(tpl)
                } else {
                    consumer.assign(tpl)
                };
                if let Err(e) = r {
                    self.fail(format!("assigning partitions: {e}"));
                }
                self.push(Membership::Assigned(parts));
            }
            RDKafkaRespErr::RD_KAFKA_RESP_ERR__REVOKE_PARTITIONS => {
                info!(partitions = ?parts, "partitions revoked");
                self.push(Membership::Revoked(parts));
                let r = if cooperative {
                    consumer.incremental_unassign(tpl)
                } else {
                    consumer.unassign()
                };
                if let Err(e) = r {
                    warn!(error = %e, "unassigning partitions");
                }
            }
            other => {
                warn!(error = ?other, "rebalance error; dropping the assignment");
                self.push(Membership::Revoked(parts));
                let _ = consumer.unassign();
            }
        }
    }
}

/// One partition's records collected in a round.
#[derive(Debug, Default, PartialEq, Eq)]
struct PartBuf {
    first: i64,
    next: i64,
    records: Vec<ChangeRecord>,
    has_data_loss: bool,
    dead_letters: i32,
}

/// How long [`KafkaInbox::close`] waits for the consumer to leave its group.
pub const CLOSE_LIMIT: Duration = Duration::from_secs(10);

/// The rebalance bookkeeping of the inbox, pure: which partitions are owned,
/// and what one round collected for each.
#[derive(Debug, Default)]
pub(crate) struct Buffers {
    owned: BTreeSet<u32>,
    bufs: BTreeMap<u32, PartBuf>,
    /// Partitions whose seek failed, with where they must go (the next
    /// offset; `None`: the beginning). Nothing of theirs is taken until the
    /// seek succeeds or a new assignment sets their position: taking
    /// records from the old position could skip some.
    unseeked: BTreeMap<u32, Option<i64>>,
}

impl Buffers {
    /// Acts on an assignment change: what was buffered for the partition
    /// (before a revocation, or under a previous assignment) is dropped, so
    /// nothing from an old owner's range is applied.
    pub(crate) fn membership(&mut self, m: &Membership) {
        match m {
            Membership::Assigned(ps) => {
                for p in ps {
                    self.owned.insert(*p);
                    self.bufs.remove(p);
                    // The assignment starts the partition at the sidecar's
                    // progress: no seek is owed any more.
                    self.unseeked.remove(p);
                }
            }
            Membership::Revoked(ps) => {
                for p in ps {
                    self.owned.remove(p);
                    self.bufs.remove(p);
                    self.unseeked.remove(p);
                }
            }
        }
    }

    /// Whether the record at `offset` of `p` is taken: the partition is
    /// owned, and the offset follows what this round already holds (a
    /// record fetched before a seek is not taken twice).
    pub(crate) fn offer(&mut self, p: u32, offset: i64) -> bool {
        if !self.owned.contains(&p) || self.unseeked.contains_key(&p) {
            return false;
        }
        let buf = self.bufs.entry(p).or_insert_with(|| PartBuf {
            first: offset,
            next: offset,
            ..PartBuf::default()
        });
        if offset < buf.next {
            return false;
        }
        buf.next = offset + 1;
        true
    }

    fn buf(&mut self, p: u32) -> Option<&mut PartBuf> {
        self.bufs.get_mut(&p)
    }

    /// Forgets what the round holds for `p` (after a seek).
    pub(crate) fn forget(&mut self, p: u32) {
        self.bufs.remove(&p);
    }

    /// A seek of `p` to `next` failed: hold the partition until it succeeds.
    pub(crate) fn seek_failed(&mut self, p: u32, next: Option<i64>) {
        self.bufs.remove(&p);
        self.unseeked.insert(p, next);
    }

    /// The seek of `p` went through.
    pub(crate) fn seeked(&mut self, p: u32) {
        self.unseeked.remove(&p);
    }

    /// The seeks still owed.
    pub(crate) fn owed_seeks(&self) -> Vec<(u32, Option<i64>)> {
        self.unseeked.iter().map(|(p, n)| (*p, *n)).collect()
    }

    /// The round's deliveries, one per partition, in partition order.
    pub(crate) fn take(&mut self) -> Vec<Delivery> {
        std::mem::take(&mut self.bufs)
            .into_iter()
            .map(|(p, b)| Delivery {
                partition: p,
                lower: Checkpoint::Offset(b.first),
                upper: Checkpoint::Offset(b.next),
                has_data_loss: b.has_data_loss,
                records: b.records,
                dead_letters: b.dead_letters,
            })
            .collect()
    }

    /// The partitions owned now.
    pub(crate) fn owned(&self) -> Vec<u32> {
        self.owned.iter().copied().collect()
    }
}

/// What one blocking poll phase gave, in order.
enum Polled {
    Membership(Membership),
    /// A message, and what it decoded to (or why it did not).
    Message(OwnedMessage, std::result::Result<Records, String>),
    /// A partition's offset is outside the log (`auto.offset.reset=error`).
    OutOfRange(String),
}

/// One member of the appliers' consumer group, as an [`Inbox`].
pub struct KafkaInbox {
    consumer: Arc<BaseConsumer<InboxContext>>,
    topic: String,
    dlq: FutureProducer,
    dlq_topic: String,
    entities: HashSet<String>,
    max_records: usize,
    wait: Duration,
    buffers: Buffers,
    /// The poll in flight: kept when `next` is dropped mid-poll (a
    /// cancelled select), so its records are not lost to the next call.
    inflight: Option<tokio::task::JoinHandle<Vec<Polled>>>,
}

impl KafkaInbox {
    /// Joins the group and subscribes to the change topic. `resume` tells
    /// where an assigned partition starts (see [`ResumeAt`]).
    pub fn new(
        config: &ClientConfig,
        settings: InboxSettings,
        resume: ResumeAt,
    ) -> Result<KafkaInbox> {
        let consumer_error = |what: &str| {
            let what = what.to_string();
            move |e: rdkafka::error::KafkaError| Error::Consumer {
                message: format!("{what}: {e}"),
            }
        };
        let mut c = config.clone();
        c.set("group.id", &settings.group)
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            // A partition is always assigned at an explicit offset (the
            // sidecar's progress, or the beginning when it has none). When
            // the log no longer holds that offset (retention, a recreated
            // topic) librdkafka must not jump elsewhere silently: the
            // error surfaces and `next` reports data loss.
            .set("auto.offset.reset", "error");
        if let Some(id) = &settings.instance_id {
            c.set("group.instance.id", id);
        }
        let ctx = InboxContext {
            topic: settings.topic.clone(),
            resume,
            membership: Mutex::new(vec![]),
            failed: Mutex::new(None),
            placed: Mutex::new(HashMap::new()),
        };
        let consumer: BaseConsumer<InboxContext> = c
            .create_with_context(ctx)
            .map_err(consumer_error("creating the Kafka consumer"))?;
        consumer
            .subscribe(&[&settings.topic])
            .map_err(consumer_error("subscribing to the change topic"))?;
        let dlq: FutureProducer = reliable_producer_config(config)
            .create()
            .map_err(consumer_error("creating the dead-letter producer"))?;
        info!(group = %settings.group, topic = %settings.topic, "applier joined the group");
        Ok(KafkaInbox {
            consumer: Arc::new(consumer),
            dlq_topic: dlq_topic(&settings.topic),
            topic: settings.topic,
            dlq,
            entities: settings.entities,
            max_records: settings.max_records.max(1),
            wait: settings.wait,
            buffers: Buffers::default(),
            inflight: None,
        })
    }

    /// Leaves the group, waiting at most [`CLOSE_LIMIT`]. librdkafka's
    /// close blocks until the group knows (and runs the revocation
    /// callback), so it runs off the async workers; with the coordinator
    /// out of reach it may never return (rust-rdkafka #597, #611), and a
    /// stopping applier must not hang on it. Leaving without telling the
    /// group loses nothing: offsets live in the sidecar, and the group's
    /// session timeout hands the partitions over.
    pub async fn close(mut self) {
        let inflight = self.inflight.take();
        let leave = async move {
            if let Some(poll) = inflight {
                let _ = poll.await;
            }
            // The consumer and the dead-letter producer: both may block.
            let _ = tokio::task::spawn_blocking(move || drop(self)).await;
        };
        if tokio::time::timeout(CLOSE_LIMIT, leave).await.is_err() {
            warn!(
                limit = ?CLOSE_LIMIT,
                "the consumer did not leave its group in time (is the broker reachable?); \
                 stopping without it: the group hands the partitions over after its session timeout"
            );
        }
    }

    /// Polls for up to `wait` or `max` records, off the async workers
    /// (librdkafka's poll blocks and runs the rebalance callback).
    async fn poll(&mut self) -> Result<Vec<Polled>> {
        let poll = match self.inflight.as_mut() {
            Some(poll) => poll,
            None => {
                let consumer = self.consumer.clone();
                let (wait, max) = (self.wait, self.max_records);
                self.inflight.insert(tokio::task::spawn_blocking(move || {
                    poll_phase(&consumer, wait, max)
                }))
            }
        };
        let polled = poll.await;
        self.inflight = None;
        polled.map_err(|e| Error::Consumer {
            message: format!("the polling task failed: {e}"),
        })
    }

    /// Seeks off the async workers (librdkafka's seek blocks).
    async fn seek_now(&self, partition: u32, next: Option<i64>) -> Result<()> {
        let consumer = self.consumer.clone();
        let topic = self.topic.clone();
        tokio::task::spawn_blocking(move || {
            consumer.seek(
                &topic,
                partition as i32,
                start_offset(next),
                Duration::from_secs(10),
            )
        })
        .await
        .map_err(|e| Error::Consumer {
            message: format!("the seek task failed: {e}"),
        })?
        .map_err(|e| Error::Consumer {
            message: format!("seeking partition {partition} to {next:?}: {e}"),
        })
    }

    /// The data-loss error for an offset the log no longer holds: which
    /// owned partition stands where, against the log's start and end.
    async fn out_of_range(&self, reason: &str) -> Error {
        let consumer = self.consumer.clone();
        let topic = self.topic.clone();
        let owned = self.buffers.owned();
        let report = tokio::task::spawn_blocking(move || {
            let positions = consumer.position().ok();
            owned
                .iter()
                .map(|p| {
                    // After the error librdkafka's position is invalid:
                    // fall back to where the partition was placed.
                    let at = positions
                        .as_ref()
                        .and_then(|tpl| tpl.find_partition(&topic, *p as i32))
                        .and_then(|e| e.offset().to_raw())
                        .filter(|o| *o >= 0)
                        .or_else(|| consumer.context().placed(*p));
                    let marks = consumer
                        .fetch_watermarks(&topic, *p as i32, Duration::from_secs(10))
                        .ok();
                    (*p, at, marks)
                })
                .collect::<Vec<_>>()
        })
        .await
        .unwrap_or_default();
        let lost: Vec<String> = report
            .iter()
            .filter(|(_, at, marks)| match (at, marks) {
                (Some(at), Some((low, high))) => at < low || at > high,
                _ => true,
            })
            .map(|(p, at, marks)| {
                let (low, high) = marks
                    .map(|(l, h)| (l.to_string(), h.to_string()))
                    .unwrap_or(("?".into(), "?".into()));
                let behind = matches!((at, marks), (Some(a), Some((l, _))) if a < l);
                let at = at.map(|a| a.to_string()).unwrap_or_else(|| "?".into());
                if behind {
                    format!(
                        "partition {p}: progress at offset {at}, but retention deleted the log \
                         up to {low}. To accept the loss: `skein replay --partition {p} \
                         --offset {low} --continue-with-data-loss`"
                    )
                } else {
                    format!(
                        "partition {p}: progress at offset {at}, the log holds {low}..{high} \
                         (was the topic recreated?). To read it from its start: `skein replay \
                         --partition {p} --offset {low}`"
                    )
                }
            })
            .collect();
        Error::DataLoss {
            topic: self.topic.clone(),
            message: format!("{reason}; {}", lost.join("; ")),
        }
    }

    /// Sends a message that cannot be applied to the dead-letter topic,
    /// with the reason and where it came from in headers: `key` and
    /// `payload` are the message's own, or (`index`: its place in a pack)
    /// one record of a pack, encoded alone. Counted in its partition's
    /// round as one dead letter.
    async fn dead_letter(
        &mut self,
        m: &OwnedMessage,
        index: Option<usize>,
        key: Option<&[u8]>,
        payload: Option<&[u8]>,
        problem: &str,
    ) -> Result<()> {
        let (p, off) = (m.partition(), m.offset());
        warn!(partition = p, offset = off, index, error = %problem, topic = %self.dlq_topic, "record sent to the dead-letter topic");
        let (ps, os) = (p.to_string(), off.to_string());
        let is = index.map(|i| i.to_string());
        let mut headers = OwnedHeaders::new()
            .insert(Header {
                key: "skein_error",
                value: Some(problem.as_bytes()),
            })
            .insert(Header {
                key: "skein_topic",
                value: Some(self.topic.as_bytes()),
            })
            .insert(Header {
                key: "skein_partition",
                value: Some(ps.as_bytes()),
            })
            .insert(Header {
                key: "skein_offset",
                value: Some(os.as_bytes()),
            });
        if let Some(is) = &is {
            headers = headers.insert(Header {
                key: "skein_pack_index",
                value: Some(is.as_bytes()),
            });
        }
        let mut rec = FutureRecord::to(&self.dlq_topic)
            .partition(p)
            .headers(headers);
        if let Some(k) = key {
            rec = rec.key(k);
        }
        if let Some(v) = payload {
            rec = rec.payload(v);
        }
        self.dlq
            .send(rec, Duration::from_secs(30))
            .await
            .map_err(|(e, _)| Error::Broker {
                message: format!("sending to the dead-letter topic: {e}"),
            })?;
        if let Some(buf) = self.buffers.buf(p as u32) {
            buf.dead_letters += 1;
        }
        Ok(())
    }
}

/// How long a poll with nothing taken yet waits for a first record.
const IDLE_POLL: Duration = Duration::from_millis(100);

/// Polls for up to `wait` or `max` records (librdkafka's poll blocks and
/// runs the rebalance callback), returning messages, decoded, and
/// membership changes in the order they happened. A pack counts its
/// records, and is taken whole: a phase ends with at most `max` records
/// plus a pack's less one.
///
/// It always polls, also with a zero `wait` ("apply what is there"):
/// librdkafka serves the group's assignment only inside a poll. With
/// nothing taken yet it waits up to [`IDLE_POLL`] (or `wait`, if longer)
/// for a first record, so an idle applier sleeps in librdkafka instead of
/// going round at once; after one it takes more until `wait` is over, and
/// at least what is ready now.
fn poll_phase(consumer: &BaseConsumer<InboxContext>, wait: Duration, max: usize) -> Vec<Polled> {
    let start = Instant::now();
    let deadline = start + wait;
    let idle_deadline = start + wait.max(IDLE_POLL);
    let mut out = vec![];
    let mut taken = 0usize;
    while taken < max {
        let until = if taken == 0 { idle_deadline } else { deadline };
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() && taken == 0 {
            break;
        }
        // After a record, a zero budget still takes what is ready now
        // (a poll of zero returns nothing when nothing is).
        let polled = consumer.poll(left);
        out.extend(
            consumer
                .context()
                .take()
                .into_iter()
                .map(Polled::Membership),
        );
        match polled {
            None => break,
            Some(Err(e)) if e.rdkafka_error_code() == Some(RDKafkaErrorCode::AutoOffsetReset) => {
                out.push(Polled::OutOfRange(e.to_string()));
                break;
            }
            Some(Err(e)) => warn!(error = %e, "consumer error"),
            Some(Ok(m)) => {
                let decoded = match m.payload() {
                    None => Err("a record without a value".to_string()),
                    Some(bytes) => decode_message(bytes),
                };
                taken += decoded.as_ref().map_or(1, |d| d.records.len().max(1));
                out.push(Polled::Message(m.detach(), decoded));
            }
        }
    }
    out
}

impl Inbox for KafkaInbox {
    fn topic(&self) -> &str {
        &self.topic
    }

    fn checkpoint_kind(&self) -> CheckpointKind {
        CheckpointKind::Offset
    }

    /// Yes: a poll dropped mid-way keeps its records for the next call, and
    /// offset commits are advisory.
    fn delivers_while_applying(&self) -> bool {
        true
    }

    async fn next(&mut self) -> Result<Round> {
        for (p, next) in self.buffers.owed_seeks() {
            match self.seek_now(p, next).await {
                Ok(()) => {
                    info!(partition = p, next = ?next, "owed seek done");
                    self.buffers.seeked(p);
                }
                Err(e) => {
                    warn!(partition = p, error = %e, "seek still failing; the partition waits")
                }
            }
        }
        let polled = self.poll().await?;
        if let Some(f) = self
            .consumer
            .context()
            .failed
            .lock()
            .ok()
            .and_then(|f| f.clone())
        {
            return Err(Error::Consumer { message: f });
        }
        let mut round = Round::default();
        for item in polled {
            let (m, decoded) = match item {
                Polled::Membership(m) => {
                    self.buffers.membership(&m);
                    round.membership.push(m);
                    continue;
                }
                Polled::Message(m, decoded) => (m, decoded),
                Polled::OutOfRange(reason) => return Err(self.out_of_range(&reason).await),
            };
            let p = m.partition() as u32;
            if !self.buffers.offer(p, m.offset()) {
                continue;
            }
            let decoded = match decoded {
                Ok(d) => d,
                Err(problem) => {
                    self.dead_letter(&m, None, m.key(), m.payload(), &problem)
                        .await?;
                    continue;
                }
            };
            let buf = self.buffers.buf(p).expect("offered above");
            buf.has_data_loss |= decoded.has_data_loss;
            let mut unknown = vec![];
            for (i, r) in decoded.records.into_iter().enumerate() {
                if self.entities.contains(&r.entity) {
                    buf.records.push(r);
                } else {
                    unknown.push((i, r));
                }
            }
            // A record of an entity this applier does not know goes to the
            // dead-letter topic alone: a single-record message as it came,
            // a pack's record in the single-record format, keyed as it
            // would be on its own (the rest of its pack is applied).
            for (i, r) in unknown {
                let problem = format!("unknown entity `{}`", r.entity);
                if !decoded.pack {
                    self.dead_letter(&m, None, m.key(), m.payload(), &problem)
                        .await?;
                    continue;
                }
                let key = r.transport_key();
                let alone = encode(&Envelope {
                    lower: decoded.lower,
                    upper: decoded.upper,
                    has_data_loss: decoded.has_data_loss,
                    record: Some(r),
                });
                self.dead_letter(&m, Some(i), Some(key.as_bytes()), Some(&alone), &problem)
                    .await?;
            }
        }
        round.deliveries = self.buffers.take();
        Ok(round)
    }

    /// Commits the consumer offset (advisory: lag tools read it; the
    /// sidecar's progress is what an applier resumes from).
    async fn committed(
        &mut self,
        partition: u32,
        outcome: std::result::Result<Checkpoint, String>,
    ) -> Result<()> {
        let Ok(Checkpoint::Offset(next)) = outcome else {
            return Ok(());
        };
        let mut tpl = TopicPartitionList::new();
        if let Err(e) =
            tpl.add_partition_offset(&self.topic, partition as i32, Offset::Offset(next))
        {
            warn!(error = %e, "committing Kafka offsets (advisory) failed");
            return Ok(());
        }
        if let Err(e) = self.consumer.commit(&tpl, CommitMode::Async) {
            warn!(error = %e, "committing Kafka offsets (advisory) failed");
        }
        Ok(())
    }

    /// Seeks the partition to `to` (its beginning when `None`). A seek
    /// librdkafka refuses now (a partition whose fetch is stopping, say) is
    /// owed: the partition delivers nothing until it succeeds or a new
    /// assignment places it, since consuming on from the old offset could
    /// skip the records between the stored progress and there.
    async fn seek(&mut self, partition: u32, to: Option<Checkpoint>) -> Result<()> {
        self.buffers.forget(partition);
        let next = match to {
            None => None,
            Some(Checkpoint::Offset(o)) => Some(o),
            Some(other) => {
                return Err(Error::Consumer {
                    message: format!("cannot seek partition {partition} to {other}: not an offset"),
                })
            }
        };
        self.consumer.context().placed_at(partition, next);
        if let Err(e) = self.seek_now(partition, next).await {
            warn!(partition, error = %e, "seek failed; the partition waits until it succeeds or is reassigned");
            self.buffers.seek_failed(partition, next);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn deliveries(b: &mut Buffers) -> Vec<(u32, i64, i64)> {
        b.take()
            .into_iter()
            .map(|d| {
                (
                    d.partition,
                    d.lower.offset().unwrap(),
                    d.upper.offset().unwrap(),
                )
            })
            .collect()
    }

    #[test]
    fn only_owned_partitions_are_taken() {
        let mut b = Buffers::default();
        assert!(!b.offer(0, 5), "nothing is owned before an assignment");
        b.membership(&Membership::Assigned(vec![0, 2]));
        assert!(b.offer(0, 5));
        assert!(!b.offer(1, 7));
        assert!(b.offer(2, 9));
        assert_eq!(deliveries(&mut b), vec![(0, 5, 6), (2, 9, 10)]);
        assert_eq!(b.owned(), vec![0, 2]);
    }

    #[test]
    fn a_revocation_drops_what_the_round_held() {
        let mut b = Buffers::default();
        b.membership(&Membership::Assigned(vec![0, 1]));
        assert!(b.offer(0, 10) && b.offer(0, 11) && b.offer(1, 3));
        b.membership(&Membership::Revoked(vec![0]));
        assert!(!b.offer(0, 12), "a revoked partition takes nothing more");
        assert_eq!(deliveries(&mut b), vec![(1, 3, 4)]);
        // Assigned again (perhaps at another offset): starts afresh.
        b.membership(&Membership::Assigned(vec![0]));
        assert!(b.offer(0, 4));
        assert_eq!(deliveries(&mut b), vec![(0, 4, 5)]);
    }

    #[test]
    fn a_reassignment_mid_round_drops_the_old_range() {
        let mut b = Buffers::default();
        b.membership(&Membership::Assigned(vec![3]));
        assert!(b.offer(3, 100));
        // Revoked and assigned back in the same poll phase: the sidecar
        // said where to resume, so the earlier records must not be kept.
        b.membership(&Membership::Revoked(vec![3]));
        b.membership(&Membership::Assigned(vec![3]));
        assert!(b.offer(3, 90));
        assert_eq!(deliveries(&mut b), vec![(3, 90, 91)]);
    }

    #[test]
    fn a_partition_owing_a_seek_takes_nothing_until_seeked_or_reassigned() {
        let mut b = Buffers::default();
        b.membership(&Membership::Assigned(vec![0, 1]));
        assert!(b.offer(0, 10));
        b.seek_failed(0, Some(4));
        assert_eq!(b.owed_seeks(), vec![(0, Some(4))]);
        assert!(
            !b.offer(0, 11),
            "records from the old position would skip 4..10"
        );
        assert!(b.offer(1, 3), "other partitions go on");
        assert_eq!(deliveries(&mut b), vec![(1, 3, 4)]);
        b.seeked(0);
        assert!(b.offer(0, 4));
        assert_eq!(deliveries(&mut b), vec![(0, 4, 5)]);
        // A reassignment places the partition at the sidecar's progress:
        // the owed seek is void.
        b.seek_failed(1, None);
        b.membership(&Membership::Revoked(vec![1]));
        b.membership(&Membership::Assigned(vec![1]));
        assert!(b.owed_seeks().is_empty());
        assert!(b.offer(1, 0));
    }

    #[test]
    fn a_record_before_the_round_s_next_offset_is_not_taken_twice() {
        let mut b = Buffers::default();
        b.membership(&Membership::Assigned(vec![0]));
        assert!(b.offer(0, 1) && b.offer(0, 2));
        assert!(!b.offer(0, 2));
        assert!(!b.offer(0, 0));
        assert!(
            b.offer(0, 5),
            "a gap (compaction, control records) is taken"
        );
        assert_eq!(deliveries(&mut b), vec![(0, 1, 6)]);
        b.forget(0);
        assert!(deliveries(&mut b).is_empty());
    }
}
