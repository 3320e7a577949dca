//! The distributed deployment against a real Kafka-protocol broker
//! (`SKEIN_TEST_KAFKA_BROKERS`, started by `scripts/test`) and the real
//! PostgreSQL: scale-out, zombie fencing, replay, dead letters, the Kafka
//! sink. The pipeline scenarios over Kafka are tests/pipeline.rs with
//! `SKEIN_TEST_TRANSPORT=kafka`.

mod common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use common::soak::{check, monotonic_statement, play_workload, soak_seed};
use common::*;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message};
use rdkafka::producer::{BaseRecord, DefaultProducerContext, Producer, ThreadedProducer};
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use rdkafka::ClientConfig;
use serde_json::Value;

/// A Kafka message as read back.
#[derive(Debug, Clone)]
struct Msg {
    partition: i32,
    key: Option<String>,
    headers: HashMap<String, String>,
    value: Vec<u8>,
}

/// Every message of `topic` (all partitions, from the beginning), in
/// (partition, offset) order. Reads at least up to each partition's high
/// watermark as it was when the read began (a busy machine can pause a
/// broker longer than any idle window), then stops once nothing arrived
/// for 2 s.
fn read_topic(topic: &str) -> Vec<Msg> {
    read_topic_at(&kafka_brokers_required(), topic)
}

/// [`read_topic`] on the broker at `brokers`.
fn read_topic_at(brokers: &str, topic: &str) -> Vec<Msg> {
    let c: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set(
            "group.id",
            format!("skein-test-reader-{}", std::process::id()),
        )
        .set("enable.auto.commit", "false")
        .create()
        .unwrap();
    let md = c
        .fetch_metadata(Some(topic), Duration::from_secs(10))
        .unwrap();
    let parts = md.topics()[0].partitions().len() as i32;
    let mut tpl = TopicPartitionList::new();
    for p in 0..parts {
        tpl.add_partition_offset(topic, p, Offset::Beginning)
            .unwrap();
    }
    c.assign(&tpl).unwrap();
    let mut ends: HashMap<i32, i64> = (0..parts)
        .map(|p| {
            let (_, high) = c
                .fetch_watermarks(topic, p, Duration::from_secs(10))
                .unwrap();
            (p, high)
        })
        .filter(|(_, high)| *high > 0)
        .collect();
    let mut out: Vec<(i32, i64, Msg)> = vec![];
    let mut idle_since = Instant::now();
    let deadline = Instant::now() + Duration::from_secs(120);
    while !ends.is_empty() || idle_since.elapsed() < Duration::from_secs(2) {
        assert!(
            Instant::now() < deadline,
            "reading {topic}: partitions {ends:?} not read to their end"
        );
        match c.poll(Duration::from_millis(200)) {
            Some(Ok(m)) => {
                let headers = m
                    .headers()
                    .map(|h| {
                        h.iter()
                            .map(|x| {
                                (
                                    x.key.to_string(),
                                    String::from_utf8_lossy(x.value.unwrap_or_default()).into(),
                                )
                            })
                            .collect()
                    })
                    .unwrap_or_default();
                if ends
                    .get(&m.partition())
                    .is_some_and(|e| m.offset() + 1 >= *e)
                {
                    ends.remove(&m.partition());
                }
                out.push((
                    m.partition(),
                    m.offset(),
                    Msg {
                        partition: m.partition(),
                        key: m.key().map(|k| String::from_utf8_lossy(k).into()),
                        headers,
                        value: m.payload().unwrap_or_default().to_vec(),
                    },
                ));
                idle_since = Instant::now();
            }
            Some(Err(e)) => panic!("reading {topic}: {e}"),
            None => {}
        }
    }
    out.sort_by_key(|(p, o, _)| (*p, *o));
    out.into_iter().map(|(_, _, m)| m).collect()
}

fn produce_raw(topic: &str, partition: i32, key: &str, value: &[u8]) {
    let p: ThreadedProducer<DefaultProducerContext> = ClientConfig::new()
        .set("bootstrap.servers", kafka_brokers_required())
        .create()
        .unwrap();
    p.send(
        BaseRecord::to(topic)
            .partition(partition)
            .key(key)
            .payload(value),
    )
    .map_err(|(e, _)| e)
    .unwrap();
    p.flush(Duration::from_secs(10)).unwrap();
}

fn status(env: &Env) -> Value {
    serde_json::from_str(&env.skein_ok(&["status"])).unwrap()
}

fn kafka_sink(y: String, prefix: &str, mode: &str) -> String {
    let brokers = kafka_brokers_required();
    let start = y.find("sink:").unwrap();
    let end = y[start..].find("events:").unwrap() + start;
    format!(
        "{}sink:\n  kind: kafka\n  brokers: {brokers}\n  topic_prefix: {prefix}\n  mode: {mode}\n{}",
        &y[..start],
        &y[end..]
    )
}

/// 3 appliers over 6 partitions, 50,000 changes over 1,000 aggregates; one
/// applier is SIGKILLed midway and a replacement (its static member id)
/// started. Events go to the Kafka sink.
#[tokio::test(flavor = "multi_thread")]
async fn scale_out_over_six_partitions() {
    let seed = soak_seed();
    eprintln!("scale-out seed: SKEIN_SOAK_SEED={seed}");
    let ctx = format!("(SKEIN_SOAK_SEED={seed})");
    let prefix = fresh_topic("scale_out_events");
    let env = Env::new_kafka("scale_out", |y| {
        kafka_sink(y, &prefix, "structured")
            .replace("  partitions: 4\n", "  partitions: 6\n")
            .replace(
                "state_dir:",
                "extractor: { max_batch_changes: 2000 }\nstate_dir:",
            )
    })
    .await;
    let mut run = Running { children: vec![] };
    env.spawn_into(&mut run, "extract", &[]);
    for i in 0..3 {
        env.spawn_into(
            &mut run,
            "apply",
            &[("SKEIN_INSTANCE_ID", &format!("scale-out-{i}"))],
        );
    }
    env.wait_streaming(&mut run).await;
    let url = env.url.clone();
    let workload = tokio::spawn(async move {
        play_workload(&url, seed, 50_000, |r| monotonic_statement(r, 1000), false).await
    });
    // Midway: kill applier 1 (children[2]) and start its replacement.
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(60) {
        let n: i64 = env
            .db
            .query_one("SELECT count(*) FROM skein.outbox", &[])
            .await
            .unwrap()
            .get(0);
        if n > 3000 || workload.is_finished() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    run.check_alive(&env);
    run.kill_one(2);
    tokio::time::sleep(Duration::from_millis(500)).await;
    env.spawn_into(&mut run, "apply", &[("SKEIN_INSTANCE_ID", "scale-out-1")]);
    let changes = workload.await.unwrap();
    assert!(changes >= 50_000, "{ctx}");
    env.settle_within(&mut run, Duration::from_secs(600)).await;
    run.stop(&env);

    // The work was spread: assignments smaller than all six partitions.
    let log = env.log();
    let split = log
        .lines()
        .filter(|l| l.contains("partitions assigned"))
        .filter(|l| {
            let list = l
                .split("partitions=[")
                .nth(1)
                .unwrap_or("")
                .split(']')
                .next()
                .unwrap_or("");
            !list.is_empty() && list.split(',').count() < 6
        })
        .count();
    assert!(
        split >= 3,
        "appliers never shared the partitions {ctx}:\n{log}"
    );

    // Sidecar progress is the log end of every partition.
    let st = status(&env);
    for p in st["partitions"].as_array().unwrap() {
        assert_eq!(
            p["progress"], p["log_end"],
            "partition not caught up {ctx}: {st}"
        );
    }
    assert!(st["partitions"]
        .as_array()
        .unwrap()
        .iter()
        .all(|p| p["log_end"].as_i64() > Some(0)));

    // Events from the sink topic, per-aggregate order = offset order.
    let sink: Vec<Value> = read_topic(&format!("{prefix}.customer"))
        .iter()
        .map(|m| serde_json::from_slice(&m.value).unwrap())
        .collect();
    let live = check(&env, &ctx, Some(sink), true).await;
    eprintln!("scale-out: {changes} changes, {live} live aggregates {ctx}");
}

/// An applier paused mid-batch (before its sidecar transaction) loses its
/// partition to another; when it wakes, its commit is fenced and writes
/// nothing.
#[tokio::test(flavor = "multi_thread")]
async fn zombie_applier_is_fenced() {
    // Its apply of Bob stalls mid-batch (as by a long GC). When a second
    // applier joins, the group's assignor (range, members in the order of
    // their instance ids) gives the one partition to the newcomer,
    // `a-taker`, while `z-zombie`'s apply is still running.
    zombie("zombie", ("z-zombie", "a-taker"), 25_000, 25).await;
}

/// The same with a hung apply and nobody joining: the loop stops polling
/// once an apply has run for 10 s, so the member leaves its group after
/// max.poll.interval.ms (10 s here) and the partition moves to the other
/// applier, as when every apply held up the whole loop.
#[tokio::test(flavor = "multi_thread")]
async fn a_hung_apply_gives_its_partition_up() {
    // Dynamic membership: a member that leaves is not waited for.
    zombie("hung", ("", ""), 45_000, 40).await;
}

/// One partition, one applier (instance `id`) whose second batch, Bob's,
/// hits `applier.before_sidecar` with `action` (`sleep=<ms>`,
/// `error=<ms>`): returns once Ada is published and Bob's batch is there.
async fn ada_then_bob(name: &str, id: &str, action: &str) -> (Env, Running) {
    let failpoint = format!("applier.before_sidecar:2:{action}");
    let env = Env::new_kafka(name, |y| {
        y.replace("  partitions: 4\n", "  partitions: 1\n")
    })
    .await;
    let mut run = Running { children: vec![] };
    env.spawn_into(&mut run, "extract", &[]);
    env.spawn_into(
        &mut run,
        "apply",
        &[("SKEIN_INSTANCE_ID", id), ("SKEIN_FAILPOINT", &failpoint)],
    );
    env.wait_streaming(&mut run).await;
    env.step(
        &mut run,
        "INSERT INTO customer (id, name) VALUES (1, 'Ada');",
    )
    .await;
    env.exec("INSERT INTO customer (id, name) VALUES (2, 'Bob');")
        .await;
    run.wait_log(&env, "failpoint `applier.before_sidecar` reached")
        .await;
    (env, run)
}

/// While a batch stalls before its sidecar transaction (a process paused
/// mid-batch), its snapshot has ended: the COMMIT goes out as soon as
/// everything is read, not with the sidecar transaction, so the source's
/// tables hold no lock of skein's while it stalls.
#[tokio::test(flavor = "multi_thread")]
async fn a_batch_stalled_before_its_sidecar_transaction_holds_no_source_lock() {
    let (env, run) = ada_then_bob("stall_locks", "stall-locks-1", "sleep=6000").await;
    let t0 = Instant::now();
    loop {
        let held: i64 = env
            .db
            .query_one(
                "SELECT count(*) FROM pg_locks
                  WHERE relation = 'customer'::regclass AND pid <> pg_backend_pid()",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        if held == 0 {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(2),
            "the stalled batch still holds the source's tables:\n{}",
            env.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    env.exec("INSERT INTO customer (id, name) VALUES (3, 'Cy');")
        .await;
    three_published_once(&env, run).await;
}

/// Settles, stops, and checks Ada, Bob and Cy were each published once.
async fn three_published_once(env: &Env, mut run: Running) {
    env.settle(&mut run).await;
    run.stop(env);
    assert_eq!(
        env.outbox_subjects().await,
        ["customer.1", "customer.2", "customer.3"]
    );
    assert_exactly_once(env).await;
}

async fn zombie(name: &str, ids: (&str, &str), stall_ms: u64, takeover_s: u64) {
    let (env, mut run) = ada_then_bob(name, ids.0, &format!("sleep={stall_ms}")).await;
    // The stall began when its failpoint was logged; the fence can only
    // show once it ends, however fast the takeover was.
    let stall_ends = Instant::now() + Duration::from_millis(stall_ms);
    env.spawn_into(&mut run, "apply", &[("SKEIN_INSTANCE_ID", ids.1)]);
    // The second applier takes the partition over and commits Bob first.
    let t0 = Instant::now();
    loop {
        let n: i64 = env
            .db
            .query_one(
                "SELECT count(*) FROM skein.outbox WHERE key = '[\"2\"]'",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        if n > 0 {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(takeover_s),
            "no takeover:\n{}",
            env.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The stalled apply goes on and is fenced.
    while !env.log().contains("fenced: another applier moved") {
        assert!(
            Instant::now() < stall_ends + Duration::from_secs(30),
            "no fence:\n{}",
            env.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    env.exec("INSERT INTO customer (id, name) VALUES (3, 'Cy');")
        .await;
    three_published_once(&env, run).await;
}

/// A batch that fails stops its applier before anything after it is
/// applied: records of the partition taken meanwhile (the loop takes more
/// while applies run) are not started, so the progress stays before the
/// failed batch and a restart applies it.
#[tokio::test(flavor = "multi_thread")]
async fn a_failed_batch_stops_the_applier_before_the_records_after_it() {
    let (env, mut run) = ada_then_bob("failstop", "failstop-1", "error=3000").await;
    // Taken while Bob's batch is failing.
    env.exec("INSERT INTO customer (id, name) VALUES (3, 'Cy');")
        .await;
    let t0 = Instant::now();
    let status = loop {
        let (_, apply) = run.children.iter_mut().find(|(w, _)| w == "apply").unwrap();
        if let Some(s) = apply.try_wait().unwrap() {
            break s;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the applier did not stop after a failed batch:\n{}",
            env.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(!status.success(), "{}", env.log());
    assert_eq!(
        env.outbox_keys().await,
        ["[\"1\"]"],
        "nothing after the failed batch: {}",
        env.log()
    );
    run.children.retain(|(w, _)| w != "apply");
    env.spawn_into(&mut run, "apply", &[("SKEIN_INSTANCE_ID", "failstop-1")]);
    three_published_once(&env, run).await;
}

/// A partition whose apply stalls does not hold back the others: the loop
/// goes on taking records while an apply runs, and applies each partition
/// as soon as it is free. (Before, a round waited for its slowest
/// partition, and nothing was taken until it was back.)
#[tokio::test(flavor = "multi_thread")]
async fn a_stalled_partition_does_not_hold_back_the_others() {
    let env = Env::new_kafka("stalled", |y| y).await;
    let mut run = Running { children: vec![] };
    env.spawn_into(&mut run, "extract", &[]);
    env.spawn_into(
        &mut run,
        "apply",
        &[("SKEIN_FAILPOINT", "applier.before_sidecar:1:sleep=30000")],
    );
    env.wait_streaming(&mut run).await;
    env.exec("INSERT INTO customer (id, name) VALUES (1, 'Ada');")
        .await;
    run.wait_log(&env, "failpoint `applier.before_sidecar` reached, stalling")
        .await;
    // Eight more aggregates: over four partitions, some fall beside Ada's.
    for id in 2..=9 {
        env.exec(&format!(
            "INSERT INTO customer (id, name) VALUES ({id}, 'c{id}');"
        ))
        .await;
    }
    let t0 = Instant::now();
    let others = loop {
        let keys = env.outbox_keys().await;
        if !keys.is_empty() {
            break keys;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "nothing was applied while one partition's apply stalled:\n{}",
            env.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    // Still stalled: Ada is not there yet, the others went past her.
    assert!(
        !env.log()
            .contains("failpoint `applier.before_sidecar` resumes"),
        "the stall ended before the others were applied: the test proves nothing"
    );
    assert!(!others.contains(&"[\"1\"]".to_string()), "{others:?}");
    env.settle(&mut run).await;
    run.stop(&env);
    let mut subjects = env.outbox_subjects().await;
    subjects.sort();
    assert_eq!(
        subjects,
        (1..=9).map(|i| format!("customer.{i}")).collect::<Vec<_>>()
    );
    assert_exactly_once(&env).await;
}

/// Replay re-consumes from an offset or a time. Unchanged aggregates
/// publish nothing; `--republish` publishes each affected one once.
#[tokio::test(flavor = "multi_thread")]
async fn replay_from_offset_and_time() {
    let env = Env::new_kafka("replay", same).await;
    // Dynamic members leave the group on a clean stop (static ones stay
    // until their session times out), so replay sees no active appliers.
    let dynamic = [("SKEIN_INSTANCE_ID", "")];
    let mut run = env.start_with(&dynamic).await;
    env.step(
        &mut run,
        "INSERT INTO customer (id, name) SELECT g, 'c' || g FROM generate_series(1, 5) g;",
    )
    .await;
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let mid = chrono_now_ms();
    tokio::time::sleep(Duration::from_millis(100)).await;
    env.step(
        &mut run,
        "UPDATE customer SET name = name || '!' WHERE id <= 3;",
    )
    .await;

    // Refused while appliers run, unless forced.
    let out = env.skein(&["replay", "--offset", "0"]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--force-while-running"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let before = env.outbox().await.len();
    assert_eq!(before, 8);
    env.skein_ok(&["replay", "--offset", "0", "--force-while-running"]);
    // The running applier notices (fenced at its next commit, or its idle
    // progress check sees the rewind first), re-seeks, re-consumes: nothing
    // new but customer 6.
    env.exec("INSERT INTO customer (id, name) VALUES (6, 'c6');")
        .await;
    env.settle(&mut run).await;
    let log = env.log();
    assert!(
        log.contains("fenced") || log.contains("progress moved under this applier"),
        "{log}"
    );
    run.stop(&env);
    assert_eq!(
        env.outbox().await.len(),
        before + 1,
        "a forced replay republished"
    );

    // Stopped: from offset 0, without --republish: 0 new events.
    let text = env.skein_ok(&["replay", "--offset", "0"]);
    assert!(
        text.contains("-> 0") && text.contains("stored versions kept"),
        "{text}"
    );
    let mut run = env.start_with(&dynamic).await;
    env.settle(&mut run).await;
    run.stop(&env);
    assert_eq!(
        env.outbox().await.len(),
        before + 1,
        "a replay without --republish published"
    );

    // From the time between the inserts and the updates, with --republish:
    // one event per aggregate in the replayed range (customers 1-3, 6).
    let text = env.skein_ok(&["replay", "--from-time", &mid.to_string(), "--republish"]);
    assert!(
        text.contains("cleared the stored versions of 4 aggregate(s)"),
        "{text}\n{}",
        env.log()
    );
    let mut run = env.start_with(&dynamic).await;
    env.settle(&mut run).await;
    run.stop(&env);
    let outbox = env.outbox().await;
    let mut again: Vec<&str> = outbox[before + 1..]
        .iter()
        .map(|e| e["subject"].as_str().unwrap())
        .collect();
    again.sort();
    assert_eq!(
        again,
        ["customer.1", "customer.2", "customer.3", "customer.6"]
    );
    let ids: std::collections::HashSet<&str> =
        outbox.iter().map(|e| e["id"].as_str().unwrap()).collect();
    assert_eq!(ids.len(), outbox.len(), "event ids must stay unique");
}

fn chrono_now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

fn same(y: String) -> String {
    y
}

/// A record that is not a skein change lands in `<topic>.dlq` with the
/// error in its headers, is counted in the batch row, and the partition
/// goes on.
#[tokio::test(flavor = "multi_thread")]
async fn dead_letter_record_lands_in_dlq_and_processing_continues() {
    let env = Env::new_kafka("dlq", same).await;
    let mut run = env.start().await;
    let topic = env.topic();
    produce_raw(&topic, 0, "garbage", b"this is not avro");
    env.step(
        &mut run,
        "INSERT INTO customer (id, name) VALUES (1, 'Ada');",
    )
    .await;
    run.stop(&env);
    let dlq = read_topic(&format!("{topic}.dlq"));
    assert_eq!(dlq.len(), 1, "{dlq:?}");
    assert_eq!(dlq[0].value, b"this is not avro");
    assert_eq!(dlq[0].key.as_deref(), Some("garbage"));
    assert_eq!(dlq[0].partition, 0);
    assert!(
        dlq[0].headers["skein_error"].contains("format byte"),
        "{:?}",
        dlq[0].headers
    );
    assert_eq!(dlq[0].headers["skein_offset"], "0");
    let dead: i64 = env
        .db
        .query_one(
            "SELECT coalesce(sum(dead_letters), 0)::int8 FROM skein.batch",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(dead, 1);
    let subjects: Vec<Value> = env.events().iter().map(|e| e["subject"].clone()).collect();
    assert_eq!(subjects, ["customer.1"]);
}

/// The relay dies between the broker's acknowledgement and marking the row
/// dequeued: the event is sent again with the same `ce_id`, never a new one.
/// Binary mode: `data` is the value, attributes are `ce_` headers.
#[tokio::test(flavor = "multi_thread")]
async fn relay_resends_with_the_same_id_after_a_crash() {
    let prefix = fresh_topic("relay_events");
    let env = Env::new_kafka("relay_kafka", |y| kafka_sink(y, &prefix, "binary")).await;
    let mut run = env
        .restart_after_a_crash_before_the_mark("INSERT INTO customer (id, name) VALUES (1, 'Ada');")
        .await;
    env.settle(&mut run).await;
    run.stop(&env);
    let outbox = env.outbox().await;
    assert_eq!(outbox.len(), 1);
    let id = outbox[0]["id"].as_str().unwrap();
    let sent = read_topic(&format!("{prefix}.customer"));
    assert_eq!(sent.len(), 2, "sent, crashed, sent again: {sent:?}");
    for m in &sent {
        assert_eq!(m.headers["ce_id"], id);
        assert_eq!(m.headers["ce_type"], "contoso.customer.created");
        assert_eq!(m.headers["ce_subject"], "customer.1");
        assert_eq!(m.headers["content-type"], "application/json");
        assert_eq!(m.key.as_deref(), Some("1"));
        let data: Value = serde_json::from_slice(&m.value).unwrap();
        assert_eq!(data, outbox[0]["data"]);
    }
}

/// A change topic with fewer partitions than configured is reported, never
/// used: records would be keyed to partitions that do not exist.
#[tokio::test(flavor = "multi_thread")]
async fn topic_with_too_few_partitions_is_refused() {
    let env = Env::new_kafka("few_partitions", |y| {
        y.replace("  partitions: 4\n", "  partitions: 2\n")
    })
    .await;
    let run = env.start().await;
    run.stop(&env);
    let yaml = std::fs::read_to_string(&env.config)
        .unwrap()
        .replace("  partitions: 2\n", "  partitions: 4\n");
    std::fs::write(&env.config, yaml).unwrap();
    for cmd in ["extract", "apply"] {
        let out = env.skein(&[cmd]);
        assert!(
            !out.status.success(),
            "{cmd} used a 2-partition topic for 4"
        );
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("has 2 partitions but transport.partitions is 4"),
            "{cmd}: {err}"
        );
    }
}

/// One source change that touches two roots gives two records at the same
/// source position: a root key update (delete of the old key, create of the
/// new) and a child moved to another parent. Over Kafka with one partition
/// and one record per applier batch (so one record a message), the second
/// record must not be dropped as "already applied" (issue 10, defect 1).
#[tokio::test(flavor = "multi_thread")]
async fn records_sharing_a_source_change_are_all_applied() {
    let env = Env::new_kafka("shared_change", |y| {
        let y = y
            .replace(
                "  partitions: 4\n",
                "  partitions: 1\n  max_batch_records: 1\n",
            )
            .replace(
                "  records_per_message: 1000\n",
                "  records_per_message: 1\n",
            );
        assert!(y.contains("  records_per_message: 1\n"), "{y}");
        y
    })
    .await;
    let mut run = env.start().await;
    env.step(
        &mut run,
        "INSERT INTO customer (id, name) VALUES (1, 'Ada'), (2, 'Grace'), (3, 'Edsger');
         INSERT INTO address (id, customer_id, kind, city) VALUES (20, 2, 'work', 'Arlington');",
    )
    .await;
    env.step(&mut run, "UPDATE customer SET id = 99 WHERE id = 1;")
        .await;
    env.step(
        &mut run,
        "UPDATE address SET customer_id = 3 WHERE id = 20;",
    )
    .await;
    run.stop(&env);
    let events: Vec<(String, String)> = env
        .events()
        .iter()
        .map(|e| {
            (
                e["subject"].as_str().unwrap().to_string(),
                e["action"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    let has = |s: &str, a: &str| events.iter().any(|(es, ea)| es == s && ea == a);
    assert!(has("customer.1", "deleted"), "{events:?}");
    assert!(
        has("customer.99", "created"),
        "the new key's create: {events:?}"
    );
    // The move republishes both customers: 2 without the address, 3 with it.
    let updates_of = |s: &str| {
        events
            .iter()
            .filter(|(es, ea)| es == s && ea == "updated")
            .count()
    };
    assert!(
        updates_of("customer.2") >= 1,
        "the old parent's update: {events:?}"
    );
    assert_eq!(
        updates_of("customer.3"),
        1,
        "the new parent's update: {events:?}"
    );
    assert_exactly_once(&env).await;
}

/// The change topic no longer holds the offset an applier's progress
/// points at (the topic was recreated, or retention deleted the records):
/// the applier stops with a data-loss error naming the partition, instead
/// of treating the log's records as already applied and dropping every
/// new change silently (issue 10, defect 2).
#[tokio::test(flavor = "multi_thread")]
async fn an_offset_the_log_no_longer_holds_is_data_loss() {
    let env = Env::new_kafka("log_gap", |y| {
        y.replace("  partitions: 4\n", "  partitions: 1\n")
    })
    .await;
    let mut run = env.start().await;
    env.step(
        &mut run,
        "INSERT INTO customer (id, name) VALUES (1, 'Ada'), (2, 'Grace');",
    )
    .await;
    run.stop(&env);
    // As if the topic had been recreated: the progress is past its end.
    env.exec("UPDATE skein.progress SET position = position + 1000;")
        .await;
    // Not `start`: the applier stops on its first fetch, which may come
    // before the extractor streams.
    let run = env.spawn_all(&[]);
    env.exec("INSERT INTO customer (id, name) VALUES (3, 'Edsger');")
        .await;
    let status = run.wait_exit(Duration::from_secs(30));
    let log = env.log();
    assert!(!status.success(), "{log}");
    assert!(
        log.contains("data loss") && log.contains("partition 0") && log.contains("skein replay"),
        "the applier must stop naming the partition and the way on:\n{log}"
    );
    // The way on it names works: read the log from its start again.
    env.skein_ok(&[
        "replay",
        "--partition",
        "0",
        "--offset",
        "0",
        "--force-while-running",
    ]);
    let mut run = env.start().await;
    env.settle(&mut run).await;
    run.stop(&env);
    let subjects = env.subject_actions();
    assert_eq!(
        subjects,
        [
            "customer.1 created",
            "customer.2 created",
            "customer.3 created"
        ]
    );
}

/// `skein replay` moves a partition forward only past records the log no
/// longer holds, and only when told to give them up
/// (`--continue-with-data-loss`, the way on a data-loss error after
/// retention names): a record the log still holds is never skipped, flag or
/// not. (Retention itself cannot be triggered on the brokers here, so the
/// accepted move is not exercised.)
#[tokio::test(flavor = "multi_thread")]
async fn replay_never_gives_up_records_the_log_still_holds() {
    let env = Env::new_kafka("forward_loss", |y| {
        y.replace("  partitions: 4\n", "  partitions: 1\n")
    })
    .await;
    let dynamic = [("SKEIN_INSTANCE_ID", "")];
    let mut run = env.start_with(&dynamic).await;
    env.step(
        &mut run,
        "INSERT INTO customer (id, name) VALUES (1, 'Ada');",
    )
    .await;
    run.stop(&env);
    // Offset 1: a change the appliers have not applied yet.
    let mut only_extract = Running { children: vec![] };
    env.spawn_into(&mut only_extract, "extract", &[]);
    env.exec("INSERT INTO customer (id, name) VALUES (2, 'Grace');")
        .await;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while status(&env)["partitions"][0]["log_end"].as_i64() != Some(2) {
        assert!(std::time::Instant::now() < deadline, "{}", env.log());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    only_extract.stop(&env);
    let out = env.skein(&["replay", "--partition", "0", "--offset", "2"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--continue-with-data-loss"), "{err}");
    let out = env.skein(&[
        "replay",
        "--partition",
        "0",
        "--offset",
        "2",
        "--continue-with-data-loss",
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("still holds offsets 1..2"), "{err}");
    assert_eq!(status(&env)["partitions"][0]["progress"], 1);
    let mut run = env.start_with(&dynamic).await;
    env.settle(&mut run).await;
    run.stop(&env);
    let subjects = env.subjects();
    assert_eq!(subjects, ["customer.1", "customer.2"]);
}

/// `skein run` (itself: the sink's `kind: kafka` would make the harness
/// start `extract` + `apply`) with a Kafka sink whose producer takes at
/// most 1,000 bytes (plus `sink_extra` in the sink section), after a
/// customer too large for it was inserted. Returns the sink's topic prefix.
async fn publish_an_event_too_large(name: &str, sink_extra: &str) -> (Env, Running, String) {
    let prefix = fresh_topic(&format!("{name}_events"));
    let env = Env::new(name, |y| {
        kafka_sink(y, &prefix, "structured").replace(
            "  topic_prefix:",
            &format!("{sink_extra}  kafka_properties: {{ message.max.bytes: \"1000\" }}\n  topic_prefix:"),
        )
    })
    .await;
    let mut run = Running { children: vec![] };
    env.spawn_into(&mut run, "run", &[]);
    env.wait_streaming(&mut run).await;
    env.exec(&format!(
        "INSERT INTO customer (id, name) VALUES (1, '{}');",
        "x".repeat(2000)
    ))
    .await;
    (env, run, prefix)
}

/// A relay that cannot deliver (an event larger than the sink producer's
/// `message.max.bytes`) stops the pipeline with an error naming the outbox
/// rows, instead of dying quietly while extraction and applying go on
/// (issue 10, defect 4, the part that makes a dead relay visible).
#[tokio::test(flavor = "multi_thread")]
async fn a_relay_that_cannot_deliver_stops_the_pipeline() {
    let (env, run, _) = publish_an_event_too_large("dead_relay", "").await;
    let status = run.wait_exit(Duration::from_secs(60));
    let log = env.log();
    assert!(!status.success(), "{log}");
    assert!(
        log.contains("relay")
            && log.contains("rejected outbox row 1 ")
            && log.contains("sink.on_reject"),
        "the error must say the relay stopped, which outbox row and what to do:\n{log}"
    );
    let status: Value = serde_json::from_str(&env.skein_ok(&["status"])).unwrap();
    let relay = &status["relays"][0];
    assert_eq!(relay["state"], "stopped", "{status}");
    assert!(
        relay["last_error"]
            .as_str()
            .unwrap()
            .contains("outbox row 1"),
        "{status}"
    );
}

/// With `sink.on_reject: dead_letter` an event the broker will never take
/// goes to `<prefix>.dlq` with its outbox id and the error, and the events
/// after it are delivered.
#[tokio::test(flavor = "multi_thread")]
async fn a_rejected_event_goes_to_the_dead_letter_and_the_relay_goes_on() {
    let (env, mut run, prefix) =
        publish_an_event_too_large("dlq_relay", "  on_reject: dead_letter\n").await;
    env.step(
        &mut run,
        "INSERT INTO customer (id, name) VALUES (2, 'Bob');",
    )
    .await;
    run.stop(&env);
    let big: i64 = env
        .db
        .query_one("SELECT id FROM skein.outbox WHERE key = '[\"1\"]'", &[])
        .await
        .unwrap()
        .get(0);
    let dlq = read_topic(&format!("{prefix}.dlq"));
    assert_eq!(dlq.len(), 1, "{dlq:?}");
    let record: Value = serde_json::from_slice(&dlq[0].value).unwrap();
    assert_eq!(record["outbox_id"], big, "{record}");
    assert_eq!(record["entity"], "customer");
    assert!(
        record["error"].as_str().unwrap().contains("too large"),
        "{record}"
    );
    let events = read_topic(&format!("{prefix}.customer"));
    let keys: Vec<_> = events.iter().map(|m| m.key.clone().unwrap()).collect();
    assert_eq!(
        keys,
        vec!["2"],
        "the event after the rejected one is delivered"
    );
}

/// A sink broker that is away longer than librdkafka's delivery timeout
/// is retried with backoff: `skein run` keeps running, `skein status` says
/// `retrying` with the error, and the event arrives once the broker is up.
#[tokio::test(flavor = "multi_thread")]
async fn a_sink_outage_is_retried_until_the_broker_is_back() {
    // A port nothing listens on yet; the broker is started there later.
    // The OS picks it (bind to 0), so no other test or leftover broker
    // can hold it; the listener is closed again before skein starts.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free local port")
        .port();
    let brokers = format!("127.0.0.1:{port}");
    let prefix = fresh_topic("outage_events");
    let env = Env::new("sink_outage", |y| {
        kafka_sink(y, &prefix, "structured")
            .replace(
                &format!("brokers: {}", kafka_brokers_required()),
                &format!("brokers: {brokers}"),
            )
            .replace(
                "  topic_prefix:",
                "  kafka_properties: { message.timeout.ms: \"2000\" }\n  topic_prefix:",
            )
    })
    .await;
    let mut run = Running { children: vec![] };
    env.spawn_into(&mut run, "run", &[]);
    env.wait_streaming(&mut run).await;
    env.exec("INSERT INTO customer (id, name) VALUES (1, 'Ada');")
        .await;
    let t0 = Instant::now();
    loop {
        run.check_alive(&env);
        let status: Value = serde_json::from_str(&env.skein_ok(&["status"])).unwrap();
        if status["relays"][0]["state"] == "retrying" {
            assert!(
                status["relays"][0]["last_error"]
                    .as_str()
                    .unwrap()
                    .contains("outbox rows 1..=1"),
                "{status}"
            );
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "{status}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Longer than the delivery timeout: the relay keeps retrying.
    tokio::time::sleep(Duration::from_secs(5)).await;
    run.check_alive(&env);
    let stop_broker = start_broker("noida", port);
    env.settle_within(&mut run, Duration::from_secs(90)).await;
    run.stop(&env);
    let events = read_topic_at(&brokers, &format!("{prefix}.customer"));
    assert_eq!(events.len(), 1, "{events:?}");
    let status: Value = serde_json::from_str(&env.skein_ok(&["status"])).unwrap();
    assert_eq!(status["relays"][0]["state"], "stopped", "{status}");
    assert!(
        status["relays"][0]["last_error"].is_string(),
        "the last error is kept: {status}"
    );
    drop(stop_broker);
}

/// Stops the broker on `port` when dropped (also when the test fails).
fn scopeguard(port: u16) -> impl Drop {
    struct Stop(u16);
    impl Drop for Stop {
        fn drop(&mut self) {
            if let Ok(pid) = std::fs::read_to_string(format!("/tmp/skein-kafka-{}/pid", self.0)) {
                let _ = std::process::Command::new("kill").arg(pid.trim()).status();
            }
        }
    }
    Stop(port)
}

/// Changing `transport.partitions` re-keys aggregates. With records still
/// unapplied in the change topic, one aggregate would have old records in
/// one partition and new ones in another, committed by different appliers
/// in any order: `skein extract` refuses. Once every partition is applied
/// to its log end, the change is accepted and nothing is lost.
#[tokio::test(flavor = "multi_thread")]
async fn changing_partitions_with_a_backlog_is_refused() {
    let env = Env::new_kafka("kafka_repartition", |y| y).await;
    let mut run = env.start().await;
    env.step(
        &mut run,
        "INSERT INTO customer (id, name) VALUES (1, 'Ada');",
    )
    .await;
    // The appliers stop; the extractor produces a backlog they do not apply.
    run.kill_one(1);
    let acked = |log: &str| log.matches("batch acknowledged").count();
    let before = acked(&env.log());
    env.exec("INSERT INTO customer (id, name) SELECT i, 'c' || i FROM generate_series(2, 41) i;")
        .await;
    let t0 = Instant::now();
    while acked(&env.log()) == before {
        assert!(t0.elapsed() < Duration::from_secs(30), "{}", env.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    run.stop(&env);

    let yaml = std::fs::read_to_string(&env.config).unwrap();
    let two = yaml.replace("  partitions: 4\n", "  partitions: 2\n");
    assert_ne!(yaml, two);
    std::fs::write(&env.config, &two).unwrap();
    match env.refused_within("extract", Duration::from_secs(20)) {
        Some(err) => assert!(
            err.contains("transport.partitions changed from 4 to 2") && err.contains("offset"),
            "{err}"
        ),
        None => panic!("skein extract re-keyed a topic whose partitions hold unapplied records"),
    }
    // A sidecar from before version 4 never recorded the count: the
    // topic's four partitions are the evidence, and it is refused too.
    env.exec("DELETE FROM skein.transport").await;
    let err = env.refused_within("extract", Duration::from_secs(20));
    assert!(
        err.as_deref()
            .is_some_and(|e| e.contains("changed from 4 to 2")),
        "{err:?}"
    );
    // Drained at four partitions, then two: accepted, nothing lost.
    std::fs::write(&env.config, &yaml).unwrap();
    let mut run = env.start().await;
    env.settle(&mut run).await;
    run.stop(&env);
    std::fs::write(&env.config, &two).unwrap();
    let mut run = env.start().await;
    env.step(&mut run, "UPDATE customer SET name = 'last' WHERE id = 1;")
        .await;
    run.stop(&env);
    let subjects = env.subjects();
    for id in 1..=41 {
        assert!(
            subjects.contains(&format!("customer.{id}")),
            "customer {id} lost"
        );
    }
    assert_eq!(subjects.len(), 42);
    assert_exactly_once(&env).await;
}

/// `replay --republish` forgets the versions of the aggregates in the
/// replayed range, and never of the key a truncate notice carries (its
/// partition number): a customer whose key equals it keeps its version,
/// so a later TRUNCATE still re-checks it and publishes its delete.
#[tokio::test(flavor = "multi_thread")]
async fn replay_republish_leaves_truncate_notices_alone() {
    let env = Env::new_kafka("replay_truncate", same).await;
    let dynamic = [("SKEIN_INSTANCE_ID", "")];
    let mut run = env.start_with(&dynamic).await;
    env.step(
        &mut run,
        "INSERT INTO customer (id, name) SELECT g, 'c' || g FROM generate_series(0, 5) g;",
    )
    .await;
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let mid = chrono_now_ms();
    tokio::time::sleep(Duration::from_millis(100)).await;
    // A child table: notices to every partition, no aggregate changes.
    env.step(&mut run, "TRUNCATE contact").await;
    run.stop(&env);
    assert_eq!(env.outbox().await.len(), 6);
    let text = env.skein_ok(&["replay", "--from-time", &mid.to_string(), "--republish"]);
    assert!(
        text.contains("cleared the stored versions of 0 aggregate(s)"),
        "only notices were replayed: {text}"
    );
    let mut run = env.start_with(&dynamic).await;
    env.settle(&mut run).await;
    env.step(
        &mut run,
        "TRUNCATE customer, address, address_line, contact",
    )
    .await;
    run.stop(&env);
    let mut deleted: Vec<String> = env
        .outbox()
        .await
        .iter()
        .filter(|e| e["action"] == "deleted")
        .map(|e| e["subject"].as_str().unwrap().to_string())
        .collect();
    deleted.sort();
    let want: Vec<String> = (0..=5).map(|i| format!("customer.{i}")).collect();
    assert_eq!(deleted, want);
    assert_exactly_once(&env).await;
}

/// Starts a private broker of the suite's kind (`SKEIN_TEST_KAFKA_BROKER`,
/// noida by default) on a port the OS picked, for a test that stops it.
/// Returns its address and a guard that stops it when dropped.
fn private_broker() -> (String, impl Drop) {
    let kind = std::env::var("SKEIN_TEST_KAFKA_BROKER").unwrap_or_else(|_| "noida".into());
    let port = free_port();
    (format!("127.0.0.1:{port}"), start_broker(&kind, port))
}

/// Starts a broker of `kind` on 127.0.0.1:`port` (an empty one) and
/// returns a guard that stops it when dropped.
fn start_broker(kind: &str, port: u16) -> impl Drop {
    kafka_sh(&format!("skein_kafka_start {kind} {port}"));
    scopeguard(port)
}

/// A port nothing listens on: the OS picks it (bind to 0), so no other
/// test or leftover broker holds it; the listener is closed at once.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free local port")
        .port()
}

/// With its broker gone, `skein extract` and `skein apply` still stop on
/// one SIGTERM, within 20 s: a process an operator cannot stop without
/// SIGKILL is a wedge (an applier once ignored SIGTERM for 18 minutes with
/// its broker stopped), and Kubernetes sends SIGKILL 30 s after SIGTERM by
/// default. Here the change topic's broker goes.
#[tokio::test(flavor = "multi_thread")]
async fn the_pipeline_stops_on_sigterm_while_its_change_broker_is_down() {
    stops_on_sigterm_with_a_broker_down(Down::Changes).await;
}

/// [`the_pipeline_stops_on_sigterm_while_its_change_broker_is_down`], with
/// the Kafka sink's broker gone and an event waiting for it.
#[tokio::test(flavor = "multi_thread")]
async fn the_pipeline_stops_on_sigterm_while_its_sink_broker_is_down() {
    stops_on_sigterm_with_a_broker_down(Down::Sink).await;
}

#[derive(Clone, Copy, PartialEq)]
enum Down {
    Changes,
    Sink,
}

async fn stops_on_sigterm_with_a_broker_down(down: Down) {
    let (private, stop_broker) = private_broker();
    let shared = kafka_brokers_required();
    let (changes, sink) = match down {
        Down::Changes => (private.clone(), shared),
        Down::Sink => (shared, private.clone()),
    };
    let prefix = fresh_topic("term_events");
    let name = match down {
        Down::Changes => "term_changes_down",
        Down::Sink => "term_sink_down",
    };
    let env = Env::with_files(
        name,
        &Files::QUICKSTART,
        TransportChoice::Kafka(changes),
        |y| {
            kafka_sink(y, &prefix, "structured").replace(
                &format!("brokers: {}\n  topic_prefix", kafka_brokers_required()),
                &format!("brokers: {sink}\n  topic_prefix"),
            )
        },
    )
    .await;
    let mut run = env.start().await;
    env.step(
        &mut run,
        "INSERT INTO customer (id, name) VALUES (1, 'Ada');",
    )
    .await;
    drop(stop_broker);
    // Gone for good before the next change (tansu takes a moment to stop).
    let t0 = Instant::now();
    while std::net::TcpStream::connect(&private).is_ok() {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the broker at {private} did not stop"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // A change the pipeline cannot hand over (Changes) or publish (Sink),
    // while the clients find the broker gone.
    env.exec("INSERT INTO customer (id, name) VALUES (2, 'Bob');")
        .await;
    if down == Down::Sink {
        let t0 = Instant::now();
        while env.outbox().await.len() < 2 {
            run.check_alive(&env);
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "customer 2 was not applied"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    tokio::time::sleep(Duration::from_secs(5)).await;
    run.check_alive(&env);
    let t0 = Instant::now();
    for (_, c) in &run.children {
        let _ = std::process::Command::new("kill")
            .arg("-TERM")
            .arg(c.id().to_string())
            .status();
    }
    let mut exits = vec![];
    for (what, c) in &mut run.children {
        loop {
            if let Some(status) = c.try_wait().unwrap() {
                exits.push(format!("{what}: {status} after {:?}", t0.elapsed()));
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "skein {what} did not exit within 20 s of SIGTERM with its broker down \
                 (exited so far: {exits:?}):\n{}",
                env.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    eprintln!("exits: {exits:?}");
    if down == Down::Sink {
        // The exit abandoned the send, not the event: customer 2's row is
        // still pending for the next relay.
        let pending: i64 = env
            .db
            .query_one(
                "SELECT count(*) FROM skein.outbox WHERE dequeued_at IS NULL \
                 AND event::jsonb->>'subject' = 'customer.2'",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(pending, 1, "customer 2's event is pending after the stop");
    }
}

/// Runs `script` (bash, with scripts/lib/kafka.sh sourced) and asserts it
/// succeeded.
fn kafka_sh(script: &str) {
    let out = std::process::Command::new("bash")
        .arg("-c")
        .arg(format!(
            "SKEIN_KAFKA_KEEP=1 source scripts/lib/kafka.sh && {script}"
        ))
        .current_dir(root())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{script}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A batch of one change record of aggregate `key` (one partition: all
/// land in partition 0), at positions `100 * key`; its key `pad`ded to
/// make the record larger.
fn one_record_batch(key: u64, pad: usize) -> skein_transporter::Batch {
    use skein_common::{ChangePosition, ChangeRecord, Op, PgLsn, RootKey};
    skein_transporter::Batch {
        seq: key,
        lower: PgLsn(100 * (key - 1)).into(),
        upper: PgLsn(100 * key).into(),
        has_data_loss: false,
        records: vec![ChangeRecord {
            entity: "customer".into(),
            root_key: RootKey(vec![Some(format!("{key}{}", " ".repeat(pad)))]),
            table: "public.customer".into(),
            op: Op::Update,
            position: ChangePosition {
                commit: PgLsn(100 * key).into(),
                seq: 0,
            },
            tx_id: key,
            commit_time_micros: 0,
        }],
    }
}

/// The keys of the change records partition 0 of `topic` holds, in order
/// (those inside packs too): polled until `want` came or `wait` passed.
fn keys_of_partition_0(brokers: &str, topic: &str, want: usize, wait: Duration) -> Vec<String> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", format!("{topic}.check"))
        .set("enable.auto.commit", "false")
        .create()
        .unwrap();
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(topic, 0, Offset::Beginning)
        .unwrap();
    consumer.assign(&tpl).unwrap();
    let mut keys = vec![];
    let t0 = Instant::now();
    while t0.elapsed() < wait && keys.len() < want {
        if let Some(Ok(m)) = consumer.poll(Duration::from_millis(200)) {
            let message = skein_transporter::kafka::decode_message(m.payload().unwrap_or_default())
                .expect("a change message");
            keys.extend(message.records.iter().map(|r| r.transport_key()));
        }
    }
    keys
}

/// A change broker away for a while: the change records handed over before
/// and during the outage all reach their partition, in order, once it is
/// back. librdkafka's idempotent producer otherwise lets a record time out
/// while a later record of the same partition is written: a gap the
/// appliers cannot see, since the later record moves the partition's
/// progress and the failed one, re-sent from the extractor's marker, falls
/// below it and is dropped as applied. noida, whatever
/// `SKEIN_TEST_KAFKA_BROKER` says: it keeps its data across a restart.
#[tokio::test(flavor = "multi_thread")]
async fn a_change_broker_outage_leaves_no_gap_in_a_partition() {
    a_change_broker_outage_leaves_no_gap(1).await;
}

/// [`a_change_broker_outage_leaves_no_gap_in_a_partition`] with packs.
#[tokio::test(flavor = "multi_thread")]
async fn a_change_broker_outage_leaves_no_gap_in_a_partition_of_packs() {
    a_change_broker_outage_leaves_no_gap(1000).await;
}

/// A broker outage while batches are in flight, `per` records a message.
async fn a_change_broker_outage_leaves_no_gap(per: usize) {
    use skein_transporter::kafka::{client_config, ensure_topic, KafkaTransport};
    use skein_transporter::Transport;

    let port = free_port();
    let _broker = start_broker("noida", port);
    let brokers = format!("127.0.0.1:{port}");
    let topic = fresh_topic("gapless");
    // Reconnect soon after the broker is back.
    let props = [("reconnect.backoff.max.ms", "200")]
        .into_iter()
        .map(|(k, v)| (k.to_string(), skein_common::config::Secret::new(v)))
        .collect();
    let kc = client_config(&brokers, &props);
    ensure_topic(&kc, &topic, 1, 1).await.unwrap();
    let transport = KafkaTransport::new(&kc, &topic, 1, per).unwrap();
    transport.send(one_record_batch(1, 0)).await.unwrap();
    kafka_sh(&format!("skein_kafka_stop {port}"));
    // Two batches in flight while the broker is away, handed over 4 s
    // apart: a record that can time out would fail alone, before the other.
    let first = transport.submit(one_record_batch(2, 0)).await.unwrap();
    tokio::time::sleep(Duration::from_secs(4)).await;
    let second = transport.submit(one_record_batch(3, 0)).await.unwrap();
    tokio::time::sleep(Duration::from_secs(2)).await;
    kafka_sh(&format!("skein_kafka_launch noida {port} >/dev/null"));
    let (first, second) = tokio::time::timeout(Duration::from_secs(60), async {
        (first.await, second.await)
    })
    .await
    .expect("both batches acknowledged within 60 s of the broker's return");
    let keys = keys_of_partition_0(&brokers, &topic, 3, Duration::from_secs(10));
    let expected: Vec<String> = (1..=3)
        .map(|k| one_record_batch(k, 0).records[0].transport_key())
        .collect();
    assert_eq!(
        keys, expected,
        "partition 0 after the outage (acks: {first:?}, {second:?})"
    );
    first.expect("the batch handed over first is acknowledged");
    second.expect("the batch handed over second is acknowledged");
}

/// A change record the broker rejects (larger than the topic's
/// `max.message.bytes`) fails every record handed over after it: none of
/// them is written behind the gap (the extractor then stops with the
/// rejection and, restarted, sends from its marker again). Without
/// `enable.gapless.guarantee` the next record was written.
#[tokio::test(flavor = "multi_thread")]
async fn a_rejected_change_record_fails_the_records_after_it() {
    a_rejected_change_message_fails_the_ones_after_it(1).await;
}

/// [`a_rejected_change_record_fails_the_records_after_it`] with packs.
#[tokio::test(flavor = "multi_thread")]
async fn a_rejected_pack_fails_the_packs_after_it() {
    a_rejected_change_message_fails_the_ones_after_it(1000).await;
}

/// A noida-db broker of its own (tansu does not enforce
/// `max.message.bytes`) and a one-partition topic named after `name`
/// whose `max.message.bytes` is `limit`: the broker's guard, its
/// address, the topic and a client config for it.
async fn noida_topic_limited_to(
    name: &str,
    limit: usize,
) -> (impl Drop, String, String, rdkafka::config::ClientConfig) {
    use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    use rdkafka::client::DefaultClientContext;
    use skein_transporter::kafka::client_config;

    let port = free_port();
    let broker = start_broker("noida", port);
    let brokers = format!("127.0.0.1:{port}");
    let topic = fresh_topic(name);
    let kc = client_config(&brokers, &Default::default());
    let admin: AdminClient<DefaultClientContext> = kc.create().unwrap();
    let created = admin
        .create_topics(
            &[NewTopic::new(&topic, 1, TopicReplication::Fixed(1))
                .set("max.message.bytes", &limit.to_string())],
            &AdminOptions::new(),
        )
        .await
        .unwrap();
    assert!(created.iter().all(|r| r.is_ok()), "{created:?}");
    (broker, brokers, topic, kc)
}

/// A message the broker rejects, `per` records a message.
async fn a_rejected_change_message_fails_the_ones_after_it(per: usize) {
    use skein_transporter::kafka::KafkaTransport;
    use skein_transporter::Transport;

    let (_broker, brokers, topic, kc) = noida_topic_limited_to("rejected_change", 400).await;
    let transport = KafkaTransport::new(&kc, &topic, 1, per).unwrap();
    transport.send(one_record_batch(1, 0)).await.unwrap();
    // Too large for the broker; the next one, in its own request, is not.
    let rejected = transport.submit(one_record_batch(2, 2000)).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let next = match transport.submit(one_record_batch(3, 0)).await {
        Ok(ack) => ack.await,
        Err(e) => Err(e),
    };
    let rejected = rejected.await;
    assert!(rejected.is_err(), "the oversized record was acknowledged");
    assert!(
        next.is_err(),
        "the record after the rejected one was acknowledged"
    );
    let keys = keys_of_partition_0(&brokers, &topic, 2, Duration::from_secs(3));
    assert_eq!(
        keys,
        vec![one_record_batch(1, 0).records[0].transport_key()],
        "partition 0 holds nothing after the rejected record"
    );
}

/// A topic whose own `max.message.bytes` is low (here 2,000 bytes) takes
/// every message that fits: the producer's record batches are made no
/// larger (the limit bounds a whole batch, and librdkafka's `batch.size`
/// is 1,000,000) and packs close at half of it. Otherwise the broker
/// rejected full batches and large packs, and the extractor stopped at the
/// same batch at every start. Each record fits; twenty in one pack do not.
#[tokio::test(flavor = "multi_thread")]
async fn packs_fit_the_topics_max_message_bytes() {
    use skein_transporter::kafka::KafkaTransport;
    use skein_transporter::Transport;

    let (_broker, brokers, topic, kc) = noida_topic_limited_to("pack_limit", 2000).await;
    let transport = KafkaTransport::for_topic(&kc, &topic, 1, 1000)
        .await
        .unwrap();
    // Sends batch `seq` of the records keyed `keys`, each padded by `pad`;
    // returns their keys.
    let send = async |seq: u64, keys: std::ops::RangeInclusive<u64>, pad: usize| {
        let mut batch = one_record_batch(seq, 0);
        batch.records = keys
            .map(|k| {
                let mut r = one_record_batch(k, pad).records.remove(0);
                r.position.commit = batch.upper;
                r.position.seq = k;
                r
            })
            .collect();
        let keys: Vec<String> = batch.records.iter().map(|r| r.transport_key()).collect();
        let acked = tokio::time::timeout(Duration::from_secs(30), transport.send(batch))
            .await
            .expect("acknowledged or failed within 30 s");
        assert!(acked.is_ok(), "a pack over the topic's limit: {acked:?}");
        keys
    };
    let expected = send(1, 1..=20, 150).await;
    // Records of just under half the limit (1,000 bytes): one fits, two
    // do not. A pack that closed only once its records reached 1,000
    // bytes took two, about 2,000 bytes and its framing: over the limit.
    let size = |pad: usize| {
        let mut p = skein_transporter::kafka::codec::PackBuf::default();
        p.push(&one_record_batch(21, pad).records[0]);
        p.bytes()
    };
    let pad = (0..2000).find(|&pad| size(pad) >= 990).unwrap();
    assert!(
        size(pad) < 1000,
        "no pad gives a record of 990 to 999 bytes"
    );
    let expected_big = send(2, 21..=26, pad).await;
    let all = keys_of_partition_0(&brokers, &topic, 26, Duration::from_secs(10));
    assert_eq!(all[..20], expected[..]);
    assert_eq!(all[20..], expected_big[..]);
}

/// The harness's "caught up" check ([`Env::kafka_caught_up`]) sees a record
/// past a partition's progress inside a record batch of several: tansu
/// reports the high watermark of such a log as the start of its last batch
/// plus one, so a lag measured against it says 0 while the last records of
/// the batch are still to apply (a settle that returned early once made a
/// pipeline scenario miss its last event over tansu).
#[test]
fn the_caught_up_check_sees_records_the_high_watermark_may_hide() {
    let brokers = kafka_brokers_required();
    let topic = fresh_topic("hidden_records");
    let producer: ThreadedProducer<DefaultProducerContext> = ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .set("linger.ms", "50")
        .create()
        .unwrap();
    for i in 0..3 {
        producer
            .send(
                BaseRecord::to(&topic)
                    .partition(0)
                    .key("k")
                    .payload(&format!("{i}")),
            )
            .unwrap();
    }
    producer.flush(Duration::from_secs(20)).unwrap();
    // Offsets 0..=2: two applied, one to go; all three applied.
    assert!(fetchable_past(&brokers, &topic, &[(0, Some(2))]));
    assert!(fetchable_past(&brokers, &topic, &[(0, None)]));
    assert!(!fetchable_past(&brokers, &topic, &[(0, Some(3))]));
}
