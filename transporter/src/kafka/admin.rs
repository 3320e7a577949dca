//! Topic administration and the read-only look-ups of `skein status` and
//! `skein replay`. librdkafka's calls block: the async ones here run them
//! off the async workers.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, Instant};

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, ResourceSpecifier, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{BorrowedMessage, Message};
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use skein_common::Op;
use tracing::{info, warn};

use super::codec::decode_message;
use super::{kafka, KafkaTransportError};

/// The topic's own `max.message.bytes`, as the broker describes it; `None`
/// when the broker does not say (an error or no such entry is logged, not
/// raised: packs then close at their default size).
pub async fn topic_max_message_bytes(config: &ClientConfig, topic: &str) -> Option<usize> {
    let admin: AdminClient<DefaultClientContext> = match config.create() {
        Ok(a) => a,
        Err(e) => {
            warn!(topic, error = %e, "cannot read the topic's max.message.bytes");
            return None;
        }
    };
    let described = admin
        .describe_configs(
            &[ResourceSpecifier::Topic(topic)],
            &AdminOptions::new().request_timeout(Some(Duration::from_secs(15))),
        )
        .await;
    let value = match described.as_deref() {
        Ok([Ok(resource)]) => resource
            .get("max.message.bytes")
            .and_then(|e| e.value.clone()),
        other => {
            warn!(topic, answer = ?other.map(|r| r.len()), "the broker did not describe the topic's max.message.bytes");
            None
        }
    }?;
    match value.trim().parse::<usize>() {
        Ok(n) => Some(n),
        Err(_) => {
            warn!(
                topic,
                value, "the topic's max.message.bytes is not a number"
            );
            None
        }
    }
}

/// Creates `topic` with `partitions` partitions when it is missing, and
/// checks the partition count of an existing one; returns the count it has.
pub async fn ensure_topic(
    config: &ClientConfig,
    topic: &str,
    partitions: u32,
    replication_factor: i32,
) -> std::result::Result<u32, KafkaTransportError> {
    let admin: AdminClient<DefaultClientContext> = config
        .create()
        .map_err(kafka("creating the admin client"))?;
    // Fail fast and clearly when no broker answers.
    let brokers = config
        .get("bootstrap.servers")
        .unwrap_or_default()
        .to_string();
    tokio::task::block_in_place(|| admin.inner().fetch_metadata(None, Duration::from_secs(15)))
        .map_err(kafka(format!("no Kafka broker answered at `{brokers}`")))?;
    let results = admin
        .create_topics(
            &[NewTopic::new(
                topic,
                partitions as i32,
                TopicReplication::Fixed(replication_factor),
            )],
            &AdminOptions::new().operation_timeout(Some(Duration::from_secs(30))),
        )
        .await
        .map_err(kafka(format!("creating topic `{topic}`")))?;
    for r in results {
        match r {
            Ok(t) => info!(topic = %t, partitions, "created topic"),
            Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((t, code)) => {
                return Err(KafkaTransportError::Kafka {
                    context: format!("creating topic `{t}`"),
                    source: KafkaError::AdminOp(code),
                })
            }
        }
    }
    let actual = partition_count(&admin, topic).await?;
    if actual < partitions as usize {
        return Err(KafkaTransportError::TooFewPartitions {
            topic: topic.into(),
            actual,
            configured: partitions,
        });
    }
    if actual > partitions as usize {
        warn!(
            topic,
            actual,
            partitions,
            "topic has more partitions than configured; the extra ones stay unused"
        );
    }
    Ok(actual as u32)
}

async fn partition_count(
    admin: &AdminClient<DefaultClientContext>,
    topic: &str,
) -> std::result::Result<usize, KafkaTransportError> {
    // Metadata can lag a fresh create for a moment.
    for _ in 0..50 {
        let md = tokio::task::block_in_place(|| {
            admin
                .inner()
                .fetch_metadata(Some(topic), Duration::from_secs(10))
        })
        .map_err(kafka(format!("reading metadata of `{topic}`")))?;
        if let Some(t) = md.topics().iter().find(|t| t.name() == topic) {
            if t.error().is_none() && !t.partitions().is_empty() {
                return Ok(t.partitions().len());
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Err(KafkaTransportError::Kafka {
        context: format!("topic `{topic}` has no metadata after creation"),
        source: KafkaError::MetadataFetch(RDKafkaErrorCode::UnknownTopicOrPartition),
    })
}

/// Each partition's low and high watermark (log start, log end).
pub fn watermarks(
    config: &ClientConfig,
    topic: &str,
    partitions: u32,
) -> std::result::Result<Vec<(i64, i64)>, KafkaTransportError> {
    let c: BaseConsumer = config.create().map_err(kafka("creating a Kafka client"))?;
    (0..partitions as i32)
        .map(|p| {
            c.fetch_watermarks(topic, p, Duration::from_secs(10))
                .map_err(kafka(format!("reading the watermarks of partition {p}")))
        })
        .collect()
}

/// Where `skein replay` rewinds from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReplayFrom {
    /// This offset.
    Offset(i64),
    /// The first offset at or after this time (ms since the Unix epoch).
    Time(i64),
}

/// What a replay would do, read from Kafka without changing anything.
#[derive(Debug, Default)]
pub struct ReplayPlan {
    /// Active members of the appliers' group (`id (host)`).
    pub members: Vec<String>,
    /// Per partition to move: its current progress and the target offset.
    pub targets: BTreeMap<u32, (i64, i64)>,
    /// `(entity, canonical root key)` of every record in the rewound
    /// ranges (only when asked for: `--republish`).
    pub affected: BTreeSet<(String, String)>,
}

/// Plans a replay of `group` on `topic`: the group's members, the target
/// offset of every partition in `current` (its progress: the next offset,
/// `None` when never consumed, which is left alone), and with `republish`
/// the aggregates in the rewound ranges. Refuses to move a partition
/// forward unless `forward_with_data_loss` (the records in between are then
/// never applied). Blocking.
pub fn plan_replay(
    config: &ClientConfig,
    group: &str,
    topic: &str,
    current: &BTreeMap<u32, Option<i64>>,
    from: ReplayFrom,
    republish: bool,
    forward_with_data_loss: bool,
) -> std::result::Result<ReplayPlan, KafkaTransportError> {
    let mut c = config.clone();
    c.set("group.id", format!("{group}-replay-{}", std::process::id()))
        .set("enable.auto.commit", "false");
    let consumer: BaseConsumer = c.create().map_err(kafka("creating a Kafka client"))?;
    let groups = consumer
        .fetch_group_list(Some(group), Duration::from_secs(10))
        .map_err(kafka("describing the consumer group"))?;
    let members: Vec<String> = groups
        .groups()
        .iter()
        .flat_map(|g| {
            g.members()
                .iter()
                .map(|m| format!("{} ({})", m.id(), m.client_host()))
        })
        .collect();
    let from_offsets: HashMap<u32, i64> = match from {
        ReplayFrom::Offset(o) => current.keys().map(|p| (*p, o)).collect(),
        ReplayFrom::Time(ms) => {
            let mut tpl = TopicPartitionList::new();
            for p in current.keys() {
                tpl.add_partition_offset(topic, *p as i32, Offset::Offset(ms))
                    .map_err(kafka("looking up offsets for the time"))?;
            }
            let found = consumer
                .offsets_for_times(tpl, Duration::from_secs(10))
                .map_err(kafka("looking up offsets for the time"))?;
            let mut m = HashMap::new();
            for e in found.elements() {
                // No record at or after the time (End): nothing to replay
                // there, so that partition is left out.
                if let Offset::Offset(o) = e.offset() {
                    m.insert(e.partition() as u32, o);
                }
            }
            // Trust but verify: step over records before the time (a broker
            // answered with an earlier offset, seen with tansu when no
            // record is after the time).
            let ends: HashMap<u32, i64> = current
                .iter()
                .filter_map(|(p, o)| o.map(|o| (*p, o)))
                .collect();
            first_at_or_after(&consumer, topic, &m, &ends, ms)?
        }
    };
    let mut targets = BTreeMap::new();
    for (p, cur) in current {
        let Some(cur) = *cur else {
            continue; // never consumed: nothing to rewind
        };
        let Some(&to) = from_offsets.get(p) else {
            continue;
        };
        if to > cur && !forward_with_data_loss {
            return Err(KafkaTransportError::Refused(format!(
                "partition {p}: offset {to} is after the progress {cur}; replay only rewinds \
                 (moving forward skips records: add --continue-with-data-loss to accept that)"
            )));
        }
        if to > cur {
            // Only past what the log no longer holds: records it still has
            // are never given up.
            let (low, _) = consumer
                .fetch_watermarks(topic, *p as i32, Duration::from_secs(10))
                .map_err(kafka(format!("reading the watermarks of partition {p}")))?;
            if to > low.max(cur) {
                return Err(KafkaTransportError::Refused(format!(
                    "partition {p}: the log still holds offsets {}..{to}; moving forward gives up \
                     only records it no longer holds: use --offset {low} at most",
                    low.max(cur)
                )));
            }
        }
        if to != cur {
            targets.insert(*p, (cur, to));
        }
    }
    let mut affected = BTreeSet::new();
    if republish && !targets.is_empty() {
        let ranges: HashMap<u32, (i64, i64)> = targets
            .iter()
            .map(|(p, (cur, to))| (*p, (*to, *cur)))
            .collect();
        read_ranges(
            &consumer,
            topic,
            &ranges,
            "reading the replayed range",
            |m| {
                if let Ok(message) = decode_message(m.payload().unwrap_or_default()) {
                    // A truncate notice's key is a partition number, not an
                    // aggregate's: forgetting "its" version would delete the
                    // version row of whatever aggregate has that key.
                    for r in message.records.iter().filter(|r| r.op != Op::Truncate) {
                        affected.insert((r.entity.clone(), r.root_key.canonical()));
                    }
                }
                true
            },
        )?;
    }
    Ok(ReplayPlan {
        members,
        targets,
        affected,
    })
}

/// Reads every partition's records in `[from, end)` (`ranges`: partition →
/// `(from, end)`) and hands each to `each`, which returns `false` to stop
/// that partition early.
fn read_ranges(
    consumer: &BaseConsumer,
    topic: &str,
    ranges: &HashMap<u32, (i64, i64)>,
    what: &str,
    mut each: impl FnMut(&BorrowedMessage<'_>) -> bool,
) -> std::result::Result<(), KafkaTransportError> {
    let mut tpl = TopicPartitionList::new();
    let mut pending: HashMap<i32, i64> = HashMap::new();
    for (p, (from, end)) in ranges {
        if from < end {
            tpl.add_partition_offset(topic, *p as i32, Offset::Offset(*from))
                .map_err(kafka(what))?;
            pending.insert(*p as i32, *end);
        }
    }
    if pending.is_empty() {
        return Ok(());
    }
    consumer.assign(&tpl).map_err(kafka(what))?;
    let deadline = Instant::now() + Duration::from_secs(60);
    while !pending.is_empty() {
        if Instant::now() > deadline {
            return Err(KafkaTransportError::Refused(format!(
                "{what} timed out (partitions {:?} unfinished)",
                pending.keys()
            )));
        }
        let Some(m) = consumer.poll(Duration::from_millis(500)) else {
            continue;
        };
        let m = m.map_err(kafka(what))?;
        let (p, off) = (m.partition(), m.offset());
        let Some(end) = pending.get(&p).copied() else {
            continue;
        };
        let go_on = off < end && each(&m);
        if !go_on || off + 1 >= end {
            pending.remove(&p);
        }
    }
    consumer.unassign().map_err(kafka(what))?;
    Ok(())
}

/// For each partition, the first offset in `[from, end)` whose record's
/// timestamp is at or after `ms`; partitions with none are left out.
fn first_at_or_after(
    consumer: &BaseConsumer,
    topic: &str,
    from: &HashMap<u32, i64>,
    end: &HashMap<u32, i64>,
    ms: i64,
) -> std::result::Result<HashMap<u32, i64>, KafkaTransportError> {
    let ranges: HashMap<u32, (i64, i64)> = from
        .iter()
        .filter_map(|(p, o)| end.get(p).map(|e| (*p, (*o, *e))))
        .collect();
    let mut out = HashMap::new();
    read_ranges(consumer, topic, &ranges, "reading record timestamps", |m| {
        if m.timestamp().to_millis().is_some_and(|t| t >= ms) {
            out.insert(m.partition() as u32, m.offset());
            return false;
        }
        true
    })?;
    Ok(out)
}
