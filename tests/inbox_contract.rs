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
/// [`batches`], sent by the Kafka transport with `per` records a message.
async fn sent_to_kafka(name: &str, per: usize) -> (rdkafka::ClientConfig, String, Vec<Batch>) {
    let sent = batches();
    let (kc, topic) = sent_batches(name, per, &sent).await;
    (kc, topic, sent)
}

/// A fresh topic (and its dead-letter topic) holding `sent`, sent by the
/// Kafka transport with `per` records a message.
async fn sent_batches(name: &str, per: usize, sent: &[Batch]) -> (rdkafka::ClientConfig, String) {
    let brokers = kafka_brokers_required();
    let topic = fresh_topic(name);
    let kc = client_config(&brokers, &Default::default());
    ensure_topic(&kc, &topic, PARTITIONS, 1).await.unwrap();
    ensure_topic(&kc, &format!("{topic}.dlq"), PARTITIONS, 1)
        .await
        .unwrap();
    let transport = KafkaTransport::new(&kc, &topic, PARTITIONS, per).unwrap();
    for b in sent.iter().cloned() {
        transport.send(b).await.unwrap();
    }
    (kc, topic)
}

#[tokio::test(flavor = "multi_thread")]
async fn kafka_inbox_keeps_the_contract_resumes_where_told_and_seeks() {
    // One record a message: offsets count records.
    let (kc, topic, sent) = sent_to_kafka("inbox_contract", 1).await;
    let expected = by_partition(&sent);
    // Partition 1 was applied up to offset 2 (exclusive) by an earlier
    // owner: it must resume there. Partition 0 was never applied.
    let mut inbox = customer_inbox(&kc, &topic, resume_1_at_2(), 5, Duration::from_millis(200));
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
    let (kc, topic, sent) = sent_to_kafka("inbox_zero_wait", 1000).await;
    let expected = by_partition(&sent);
    let resume: ResumeAt = Arc::new(|parts: &[u32]| Ok(parts.iter().map(|p| (*p, None)).collect()));
    let mut inbox = customer_inbox(&kc, &topic, resume, 1000, Duration::ZERO);
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

/// Partition 1 resumes at offset 2 (an earlier owner applied up to
/// there), any other at its beginning.
fn resume_1_at_2() -> ResumeAt {
    Arc::new(|parts: &[u32]| {
        Ok(parts
            .iter()
            .map(|p| (*p, if *p == 1 { Some(2) } else { None }))
            .collect())
    })
}

/// A Kafka inbox of `customer` records on `topic`, its own group.
fn customer_inbox(
    kc: &rdkafka::ClientConfig,
    topic: &str,
    resume: ResumeAt,
    max_records: usize,
    wait: Duration,
) -> KafkaInbox {
    let settings = InboxSettings {
        topic: topic.to_string(),
        group: format!("{topic}.group"),
        instance_id: None,
        entities: ["customer".to_string()].into(),
        max_records,
        wait,
    };
    KafkaInbox::new(kc, settings, resume).unwrap()
}

/// Each partition's packs, in order, as the transport sends `batches` with
/// `per` records a message: a batch's records of one partition, in their
/// order, `per` at most a pack.
fn packs_by_partition(batches: &[Batch], per: usize) -> BTreeMap<u32, Vec<Vec<ChangeRecord>>> {
    let mut out: BTreeMap<u32, Vec<Vec<ChangeRecord>>> = BTreeMap::new();
    for b in batches {
        let mut of_batch: BTreeMap<u32, Vec<ChangeRecord>> = BTreeMap::new();
        for r in &b.records {
            of_batch.entry(partition_of(r)).or_default().push(r.clone());
        }
        for (p, records) in of_batch {
            out.entry(p)
                .or_default()
                .extend(records.chunks(per).map(<[ChangeRecord]>::to_vec));
        }
    }
    out
}

/// Over Kafka a batch's records of one partition travel in packs (several
/// records a message): every delivery is whole packs, its offsets those of
/// the packs (one a pack), in order; a partition resumes and seeks at a
/// pack's offset; a round's records stay within its bound plus one pack.
#[tokio::test(flavor = "multi_thread")]
async fn kafka_inbox_delivers_whole_packs_at_their_offsets() {
    const PER: usize = 4;
    let (kc, topic, sent) = sent_to_kafka("inbox_packs", PER).await;
    let packs = packs_by_partition(&sent, PER);
    assert!(
        packs
            .values()
            .all(|p| p.len() >= 6 && p.iter().any(|k| k.len() == PER)),
        "the batches make several full packs a partition: {packs:?}"
    );
    // Partition 1 resumes at its third pack.
    let mut inbox = customer_inbox(&kc, &topic, resume_1_at_2(), 5, Duration::from_millis(200));
    let from = |p: u32, first: usize| packs[&p][first..].concat();
    let want = [(0, from(0, 0).len()), (1, from(1, 2).len())].into();
    let mut assigned = BTreeSet::new();
    let deliveries = take(&mut inbox, &mut assigned, &want).await;
    assert_eq!(records_of(&deliveries, 0), from(0, 0));
    assert_eq!(records_of(&deliveries, 1), from(1, 2));
    for d in &deliveries {
        let (first, next) = (d.lower.offset().unwrap(), d.upper.offset().unwrap());
        assert_eq!(
            d.records,
            packs[&d.partition][first as usize..next as usize].concat(),
            "a delivery of partition {} is the packs at offsets {first}..{next}",
            d.partition
        );
        assert!(d.records.len() < 5 + PER, "a round over its bound: {d:?}");
    }
    assert_eq!(
        deliveries.iter().find(|d| d.partition == 1).unwrap().lower,
        Checkpoint::Offset(2),
        "resumed where told"
    );
    inbox.seek(0, Some(Checkpoint::Offset(3))).await.unwrap();
    let again = take(&mut inbox, &mut assigned, &[(0, from(0, 3).len())].into()).await;
    assert_eq!(records_of(&again, 0), from(0, 3));
    inbox.close().await;
}

/// A batch of three records of one partition, the middle one of an entity
/// the applier does not know (its key one that hashes there), sent with
/// `per` records a message; what a `customer` inbox delivered, and the
/// dead-letter topic's one message.
async fn an_unknown_entity_sent(
    name: &str,
    per: usize,
) -> (Batch, Vec<Delivery>, rdkafka::message::OwnedMessage) {
    use rdkafka::consumer::{BaseConsumer, Consumer};

    let mut batch = batches().remove(0);
    batch.records = (0..3).map(|i| rec(7, 100, i)).collect();
    batch.records[1].entity = "invoice".into();
    batch.records[1].root_key = (0..)
        .map(|k: u32| RootKey(vec![Some(k.to_string())]))
        .find(|k| {
            let r = ChangeRecord {
                root_key: k.clone(),
                ..batch.records[1].clone()
            };
            partition_of(&r) == partition_of(&batch.records[0])
        })
        .unwrap();
    let (kc, topic) = sent_batches(name, per, std::slice::from_ref(&batch)).await;
    let p = partition_of(&batch.records[0]);
    let resume: ResumeAt = Arc::new(|parts: &[u32]| Ok(parts.iter().map(|p| (*p, None)).collect()));
    let mut inbox = customer_inbox(&kc, &topic, resume, 100, Duration::from_millis(200));
    let deliveries = take(&mut inbox, &mut BTreeSet::new(), &[(p, 2)].into()).await;
    inbox.close().await;
    let consumer: BaseConsumer = kc
        .clone()
        .set("group.id", format!("{topic}.reader"))
        .set("auto.offset.reset", "earliest")
        .create()
        .unwrap();
    consumer.subscribe(&[&format!("{topic}.dlq")]).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let m = loop {
        assert!(
            Instant::now() < deadline,
            "nothing on the dead-letter topic"
        );
        if let Some(m) = consumer.poll(Duration::from_millis(500)) {
            break m.unwrap().detach();
        }
    };
    (batch, deliveries, m)
}

fn headers_of(m: &rdkafka::message::OwnedMessage) -> BTreeMap<String, String> {
    use rdkafka::message::{Headers, Message};
    m.headers()
        .unwrap()
        .iter()
        .map(|h| {
            (
                h.key.to_string(),
                String::from_utf8_lossy(h.value.unwrap()).into(),
            )
        })
        .collect()
}

/// A pack holding a record of an entity the applier does not know: that
/// record alone goes to the dead-letter topic (in the single-record
/// format, keyed as on its own, its place in the pack in a header) and is
/// counted; the pack's other records are delivered.
#[tokio::test(flavor = "multi_thread")]
async fn an_unknown_entity_in_a_pack_is_dead_lettered_alone() {
    use rdkafka::message::Message;
    use skein_transporter::kafka::decode;

    let (batch, deliveries, m) = an_unknown_entity_sent("inbox_pack_dlq", 1000).await;
    assert_eq!(deliveries.len(), 1, "{deliveries:?}");
    let d = &deliveries[0];
    assert_eq!(
        d.records,
        [batch.records[0].clone(), batch.records[2].clone()]
    );
    assert_eq!(
        (d.lower, d.upper, d.dead_letters),
        (Checkpoint::Offset(0), Checkpoint::Offset(1), 1),
        "one pack at offset 0"
    );
    let env = decode(m.payload().unwrap()).unwrap();
    assert_eq!(env.record.as_ref(), Some(&batch.records[1]));
    assert_eq!(m.key(), Some(batch.records[1].transport_key().as_bytes()));
    let headers = headers_of(&m);
    assert_eq!(headers["skein_pack_index"], "1", "{headers:?}");
    assert_eq!(headers["skein_offset"], "0");
    assert!(
        headers["skein_error"].contains("unknown entity `invoice`"),
        "{headers:?}"
    );
}

/// One record a message: a record of an unknown entity goes to the
/// dead-letter topic as it came, with no pack index.
#[tokio::test(flavor = "multi_thread")]
async fn an_unknown_entity_alone_is_dead_lettered_as_it_came() {
    use rdkafka::message::Message;
    use skein_transporter::kafka::{encode, Envelope};

    let (batch, deliveries, m) = an_unknown_entity_sent("inbox_single_dlq", 1).await;
    let records: Vec<_> = deliveries.iter().flat_map(|d| d.records.clone()).collect();
    assert_eq!(
        records,
        [batch.records[0].clone(), batch.records[2].clone()]
    );
    assert_eq!(deliveries.iter().map(|d| d.dead_letters).sum::<i32>(), 1);
    let sent = encode(&Envelope {
        lower: batch.lower,
        upper: batch.upper,
        has_data_loss: false,
        record: Some(batch.records[1].clone()),
    });
    assert_eq!(m.payload(), Some(&sent[..]));
    assert_eq!(m.key(), Some(batch.records[1].transport_key().as_bytes()));
    let headers = headers_of(&m);
    assert!(!headers.contains_key("skein_pack_index"), "{headers:?}");
    assert_eq!(headers["skein_offset"], "1");
}
