//! The `Inbox` contract (transporter's applier side), run against every
//! implementation: the in-process channels and a real Kafka-protocol
//! broker (`SKEIN_TEST_KAFKA_BROKERS`, started by `scripts/test`).
//!
//! What every inbox promises: a partition's records arrive in the order
//! they were sent, every one of them; a round holds at most one delivery
//! per partition, only of assigned partitions, and the next delivery of a
//! partition starts where the previous one ended. Over Kafka also: an
//! assigned partition starts at what the applier says (the sidecar's
//! progress), and `seek` moves it back.

mod common;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{fresh_topic, kafka_brokers_required};
use skein_common::record::partition_for;
use skein_common::{ChangePosition, ChangeRecord, Checkpoint, Dialect, Op, PgLsn, RootKey};
use skein_transporter::kafka::{
    client_config, ensure_topic, InboxSettings, KafkaInbox, KafkaTransport, ResumeAt,
};
use skein_transporter::{Batch, Delivery, InProcess, Inbox, Membership, Transport};

const PARTITIONS: u32 = 2;

fn rec(key: u32, commit: u64, seq: u64) -> ChangeRecord {
    ChangeRecord {
        entity: "customer".into(),
        root_key: RootKey(vec![Some(key.to_string())]),
        table: "public.customer".into(),
        op: Op::Update,
        position: ChangePosition {
            commit: PgLsn(commit).into(),
            seq,
        },
        tx_id: commit,
        commit_time_micros: 0,
    }
}

/// Three batches of changes over 12 aggregates, several per aggregate.
fn batches() -> Vec<Batch> {
    (0..3u64)
        .map(|b| {
            let records = (0..24u32)
                .map(|i| rec(i % 12, 100 * (b + 1), u64::from(i)))
                .collect();
            Batch {
                seq: b + 1,
                lower: PgLsn(100 * b).into(),
                upper: PgLsn(100 * (b + 1)).into(),
                has_data_loss: false,
                records,
            }
        })
        .collect()
}

fn partition_of(r: &ChangeRecord) -> u32 {
    partition_for(&r.transport_key(), PARTITIONS)
}

/// Each partition's records, in the order they were sent.
fn by_partition(batches: &[Batch]) -> BTreeMap<u32, Vec<ChangeRecord>> {
    let mut out: BTreeMap<u32, Vec<ChangeRecord>> = BTreeMap::new();
    for r in batches.iter().flat_map(|b| &b.records) {
        out.entry(partition_of(r)).or_default().push(r.clone());
    }
    out
}

/// Takes rounds until `want` records per partition arrived, acknowledging
/// each delivery, and checks the contract on the way (`assigned`: the
/// partitions owned, kept across calls). Returns the deliveries.
async fn take<I: Inbox>(
    inbox: &mut I,
    assigned: &mut BTreeSet<u32>,
    want: &BTreeMap<u32, usize>,
) -> Vec<Delivery> {
    let mut got: BTreeMap<u32, usize> = BTreeMap::new();
    let mut out = vec![];
    let mut next_lower: HashMap<u32, Checkpoint> = HashMap::new();
    let deadline = Instant::now() + Duration::from_secs(90);
    while want
        .iter()
        .any(|(p, n)| got.get(p).copied().unwrap_or(0) < *n)
    {
        assert!(
            Instant::now() < deadline,
            "timed out: got {got:?}, want {want:?}"
        );
        let round = inbox.next().await.expect("next round");
        for m in &round.membership {
            match m {
                Membership::Assigned(ps) => assigned.extend(ps.iter().copied()),
                Membership::Revoked(ps) => {
                    for p in ps {
                        assigned.remove(p);
                        next_lower.remove(p);
                    }
                }
            }
        }
        let mut in_round = BTreeSet::new();
        for d in round.deliveries {
            assert!(
                in_round.insert(d.partition),
                "two deliveries of partition {} in one round",
                d.partition
            );
            assert!(
                assigned.contains(&d.partition),
                "a delivery of unassigned partition {}",
                d.partition
            );
            assert!(d.lower.numeric() < d.upper.numeric(), "empty range {d:?}");
            if let (Some(prev), Checkpoint::Offset(_)) = (next_lower.get(&d.partition), d.lower) {
                assert_eq!(
                    *prev, d.lower,
                    "partition {}: a gap or an overlap between deliveries",
                    d.partition
                );
            }
            next_lower.insert(d.partition, d.upper);
            *got.entry(d.partition).or_default() += d.records.len();
            inbox
                .committed(d.partition, Ok(d.upper))
                .await
                .expect("committed");
            out.push(d);
        }
    }
    out
}

fn records_of(deliveries: &[Delivery], p: u32) -> Vec<ChangeRecord> {
    deliveries
        .iter()
        .filter(|d| d.partition == p)
        .flat_map(|d| d.records.clone())
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn in_process_inbox_keeps_the_contract() {
    let (transport, mut inbox) = InProcess::new(PARTITIONS, 1, Dialect::Postgres);
    let sent = batches();
    let expected = by_partition(&sent);
    let sender = {
        let sent = sent.clone();
        // In-process `send` resolves only when every partition acknowledged.
        tokio::spawn(async move {
            for b in sent {
                transport.send(b).await.expect("send");
            }
        })
    };
    let want = expected.iter().map(|(p, r)| (*p, r.len())).collect();
    let deliveries = take(&mut inbox, &mut BTreeSet::new(), &want).await;
    sender.await.unwrap();
    for (p, records) in &expected {
        assert_eq!(&records_of(&deliveries, *p), records, "partition {p}");
    }
    // In-process checkpoints are the extractor batch's bounds.
    for d in &deliveries {
        let b = sent
            .iter()
            .find(|b| Checkpoint::Source(b.upper) == d.upper)
            .expect("a batch's upper bound");
        assert_eq!(d.lower, Checkpoint::Source(b.lower));
    }
    // The sender is gone: the inbox closes.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let r = inbox.next().await.unwrap();
        assert!(r.deliveries.is_empty());
        if r.closed {
            break;
        }
        assert!(Instant::now() < deadline, "the inbox did not close");
    }
}

/// A fresh topic (and its dead-letter topic) on the test broker holding
/// [`batches`], sent by the Kafka transport.
async fn sent_to_kafka(name: &str) -> (rdkafka::ClientConfig, String, Vec<Batch>) {
    let brokers = kafka_brokers_required();
    let topic = fresh_topic(name);
    let kc = client_config(&brokers, &Default::default());
    ensure_topic(&kc, &topic, PARTITIONS, 1).await.unwrap();
    ensure_topic(&kc, &format!("{topic}.dlq"), PARTITIONS, 1)
        .await
        .unwrap();
    let sent = batches();
    let transport = KafkaTransport::new(&kc, &topic, PARTITIONS).unwrap();
    for b in sent.clone() {
        transport.send(b).await.unwrap();
    }
    (kc, topic, sent)
}

#[tokio::test(flavor = "multi_thread")]
async fn kafka_inbox_keeps_the_contract_resumes_where_told_and_seeks() {
    let (kc, topic, sent) = sent_to_kafka("inbox_contract").await;
    let expected = by_partition(&sent);
    // Partition 1 was applied up to offset 2 (exclusive) by an earlier
    // owner: it must resume there. Partition 0 was never applied.
    let resume: ResumeAt = Arc::new(|parts: &[u32]| {
        Ok(parts
            .iter()
            .map(|p| (*p, if *p == 1 { Some(2) } else { None }))
            .collect())
    });
    let settings = InboxSettings {
        topic: topic.clone(),
        group: format!("{topic}.group"),
        instance_id: None,
        entities: ["customer".to_string()].into(),
        max_records: 5,
        wait: Duration::from_millis(200),
    };
    let mut inbox = KafkaInbox::new(&kc, settings, resume).unwrap();
    let mut want: BTreeMap<u32, usize> = expected.iter().map(|(p, r)| (*p, r.len())).collect();
    *want.get_mut(&1).unwrap() -= 2;
    let mut assigned = BTreeSet::new();
    let deliveries = take(&mut inbox, &mut assigned, &want).await;
    assert_eq!(assigned, [0, 1].into());
    assert_eq!(records_of(&deliveries, 0), expected[&0]);
    assert_eq!(records_of(&deliveries, 1), expected[&1][2..].to_vec());
    let first_of_1 = deliveries.iter().find(|d| d.partition == 1).unwrap();
    assert_eq!(
        first_of_1.lower,
        Checkpoint::Offset(2),
        "resumed where told"
    );
    // Max records per round is respected.
    assert!(deliveries.iter().all(|d| d.records.len() <= 5));

    // After a fence the applier seeks back: partition 0 is delivered again
    // from offset 3.
    inbox.seek(0, Some(Checkpoint::Offset(3))).await.unwrap();
    let again = take(
        &mut inbox,
        &mut assigned,
        &[(0, expected[&0].len() - 3)].into(),
    )
    .await;
    let again_0 = records_of(&again, 0);
    assert_eq!(again_0, expected[&0][3..].to_vec());
    assert_eq!(
        again.iter().find(|d| d.partition == 0).unwrap().lower,
        Checkpoint::Offset(3)
    );
    inbox.close().await;
}

/// `transport.batch_wait_ms: 0` ("apply what is there") still polls:
/// librdkafka serves the group's assignment only inside a poll, so an
/// inbox that never polled with a zero wait got no partition, ever, and
/// its applier looped without sleeping (found running bench/kafka, whose
/// config took the extractor's linger default, 0, as this wait).
#[tokio::test(flavor = "multi_thread")]
async fn a_kafka_inbox_with_a_zero_wait_is_assigned_and_delivers() {
    let (kc, topic, sent) = sent_to_kafka("inbox_zero_wait").await;
    let expected = by_partition(&sent);
    let resume: ResumeAt = Arc::new(|parts: &[u32]| Ok(parts.iter().map(|p| (*p, None)).collect()));
    let settings = InboxSettings {
        topic: topic.clone(),
        group: format!("{topic}.group"),
        instance_id: None,
        entities: ["customer".to_string()].into(),
        max_records: 1000,
        wait: Duration::ZERO,
    };
    let mut inbox = KafkaInbox::new(&kc, settings, resume).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let (mut assigned, mut got): (BTreeSet<u32>, BTreeMap<u32, Vec<ChangeRecord>>) =
        Default::default();
    let (mut rounds, mut empty) = (0u32, 0u32);
    while got.values().map(Vec::len).sum::<usize>() < sent.iter().map(|b| b.records.len()).sum() {
        assert!(
            Instant::now() < deadline,
            "after 30 s with a zero wait: assigned {assigned:?}, {rounds} rounds, records {:?}",
            got.iter().map(|(p, r)| (*p, r.len())).collect::<Vec<_>>()
        );
        let round = inbox.next().await.unwrap();
        rounds += 1;
        for m in &round.membership {
            if let Membership::Assigned(ps) = m {
                assigned.extend(ps.iter().copied());
            }
        }
        empty += u32::from(round.deliveries.is_empty() && round.membership.is_empty());
        for d in &round.deliveries {
            got.entry(d.partition)
                .or_default()
                .extend(d.records.iter().cloned());
            inbox.committed(d.partition, Ok(d.upper)).await.unwrap();
        }
    }
    assert_eq!(assigned, [0, 1].into());
    assert_eq!(got, expected);
    // An idle round waits for records instead of returning at once.
    let t = Instant::now();
    let idle = inbox.next().await.unwrap();
    assert!(idle.deliveries.is_empty());
    assert!(
        t.elapsed() >= Duration::from_millis(50),
        "an empty round returned after {:?} ({empty} empty rounds before)",
        t.elapsed()
    );
    inbox.close().await;
}
