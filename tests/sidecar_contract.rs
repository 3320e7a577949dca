//! The `Sidecar` contract, run against every implementation: PostgreSQL
//! (the real server `scripts/test` starts) and SQL Server (only with
//! `SKEIN_TEST_MSSQL_URL`; ignored otherwise, never run here).
//!
//! The contract: `migrate` is idempotent; `commit` writes the batch row,
//! outbox rows, versions and progress atomically, and only when progress
//! still holds the expected value (fencing) — a fenced commit writes
//! nothing; progress reads back exactly, source positions of either
//! dialect included; the relay sends outbox rows once, in id order;
//! `pending` counts what is not relayed; `rewind` moves progress back and
//! forgets versions atomically, or changes nothing when progress moved.
//!
//! Against PostgreSQL also: relays with moving partition ownership, while
//! batches are committed, deliver every event exactly once and, per
//! aggregate key, in outbox id order.

mod common;

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{admin_url, connect, pairs, recreate_db};
use skein_applier::relay::{purge, relay_once, run_relay, RelayScope, RelaySettings, RelayWake};
use skein_applier::sidecar::{
    AnySidecar, BatchCommit, ExplicitChunk, Fence, NewRun, OutboxRow, PgSidecar, Rewind, Sidecar,
    VersionRow,
};
use skein_applier::sink::{Sink, SinkEvent};
use skein_applier::Error;
use skein_common::config::Secret;
use skein_common::{ChangePosition, PgLsn, SourcePosition, SqlServerLsn};
use tokio_util::sync::CancellationToken;

/// Collects what the relay sends.
#[derive(Clone, Default)]
struct Collect(Arc<Mutex<Vec<SinkEvent>>>);

impl Sink for Collect {
    fn send(&mut self, events: &[SinkEvent]) -> skein_applier::Result<()> {
        self.0.lock().unwrap().extend_from_slice(events);
        Ok(())
    }
}

/// One log for several relays, in the order their sends completed, each
/// event tagged with the relay that sent it. A send takes `.2` (a slow
/// broker): the relay holds its rows that long, so another relay would
/// overtake it if it skipped them.
#[derive(Clone)]
struct Tagged(
    &'static str,
    Arc<Mutex<Vec<(&'static str, SinkEvent)>>>,
    Duration,
);

impl Sink for Tagged {
    fn send(&mut self, events: &[SinkEvent]) -> skein_applier::Result<()> {
        std::thread::sleep(self.2);
        let mut log = self.1.lock().unwrap();
        log.extend(events.iter().map(|e| (self.0, e.clone())));
        Ok(())
    }
}

fn outbox_row(n: u32, key: &str) -> OutboxRow {
    OutboxRow {
        event_id: format!("0190a4c2-0000-7000-8000-{n:012}"),
        entity: "customer".into(),
        key: key.into(),
        etag: Some(format!("{n:064}")),
        event: format!("{{\"n\":{n}}}"),
        commit_time_micros: 1_709_243_999_123_456 + i64::from(n),
    }
}

fn batch(
    expected: Option<i128>,
    position: i128,
    source: SourcePosition,
    first_event: u32,
    correlation: u32,
) -> BatchCommit {
    BatchCommit {
        group: "contract".into(),
        topic: "in-process".into(),
        partition: 2,
        expected: expected.map(at_epoch_0),
        position,
        source: Some(ChangePosition {
            commit: source,
            seq: 7,
        }),
        recheck_after: None,
        dead_letters: 0,
        lower: expected.unwrap_or(0),
        upper: position,
        correlation_id: format!("0190a4c2-0000-7000-9000-{correlation:012}"),
        record_count: 3,
        entity_count: 2,
        has_data_loss: false,
        outbox: vec![
            outbox_row(first_event, "[\"1\"]"),
            outbox_row(first_event + 1, "[\"2\"]"),
        ],
        explicit: vec![],
        versions: vec![
            VersionRow {
                entity: "customer".into(),
                key: "[\"1\"]".into(),
                etag: Some(format!("{first_event:064}")),
                is_deleted: false,
            },
            VersionRow {
                entity: "customer".into(),
                key: "[\"2\"]".into(),
                etag: None,
                is_deleted: true,
            },
        ],
    }
}

async fn relay_all<S: Sidecar>(sidecar: &mut S) -> Vec<String> {
    let sink = Collect::default();
    let mut s = sink.clone();
    while relay_once(sidecar, &mut s, 1, &RelayScope::All)
        .await
        .unwrap()
        > 0
    {}
    let sent = sink
        .0
        .lock()
        .unwrap()
        .iter()
        .map(|e| e.event.clone())
        .collect();
    sent
}

async fn contract<S: Sidecar>(mut sc: S, source: impl Fn(u8) -> SourcePosition) {
    sc.migrate().await.unwrap();
    sc.migrate().await.unwrap();
    assert_eq!(
        sc.progress("contract", "in-process", 2).await.unwrap(),
        None
    );

    // The partition count records are keyed by.
    assert_eq!(sc.partitions("contract", "in-process").await.unwrap(), None);
    sc.record_partitions("contract", "in-process", 4)
        .await
        .unwrap();
    sc.record_partitions("contract", "in-process", 2)
        .await
        .unwrap();
    assert_eq!(
        sc.partitions("contract", "in-process").await.unwrap(),
        Some(2)
    );
    assert_eq!(sc.partitions("contract", "orders").await.unwrap(), None);

    // A relay's state keeps its last error until the next one.
    sc.relay_report("relay", "running", None).await.unwrap();
    sc.relay_report("relay", "retrying", Some("broker away"))
        .await
        .unwrap();
    sc.relay_report("relay", "running", None).await.unwrap();
    let states = sc.relay_states().await.unwrap();
    assert_eq!(states.len(), 1, "{states:?}");
    assert_eq!(
        (states[0].name.as_str(), states[0].state.as_str()),
        ("relay", "running")
    );
    assert_eq!(states[0].last_error.as_deref(), Some("broker away"));
    assert!(states[0].error_at.is_some() && !states[0].updated_at.is_empty());

    // First commit: no progress row yet.
    let first = batch(None, source(10).numeric(), source(10), 1, 1);
    sc.commit(&first).await.unwrap();
    let p = sc
        .progress("contract", "in-process", 2)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(p.position, source(10).numeric());
    assert_eq!(p.source.unwrap().commit, source(10));
    assert_eq!(p.source.unwrap().seq, 7);

    // A second "first" commit and a commit from a stale position are
    // fenced and write nothing.
    let again = batch(None, source(11).numeric(), source(11), 100, 2);
    assert!(matches!(sc.commit(&again).await, Err(Error::Fenced { .. })));
    let stale = batch(
        Some(source(9).numeric()),
        source(12).numeric(),
        source(12),
        200,
        3,
    );
    match sc.commit(&stale).await {
        Err(Error::Fenced { found, .. }) => {
            assert_eq!(found, Some(at_epoch_0(source(10).numeric())))
        }
        other => panic!("expected a fence, got {other:?}"),
    }

    // From the right position it moves on.
    let next = batch(
        Some(source(10).numeric()),
        source(20).numeric(),
        source(20),
        3,
        4,
    );
    sc.commit(&next).await.unwrap();
    let p = sc
        .progress("contract", "in-process", 2)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(p.position, source(20).numeric());

    let versions = sc
        .versions(
            "customer",
            &["[\"1\"]".into(), "[\"2\"]".into(), "[\"9\"]".into()],
        )
        .await
        .unwrap();
    assert_eq!(versions.len(), 2);
    assert_eq!(versions["[\"1\"]"].etag, Some(format!("{:064}", 3)));
    assert!(versions["[\"2\"]"].is_deleted && versions["[\"2\"]"].etag.is_none());

    // Published keys come in pages, in key order, deleted ones left out.
    let mut more = batch(
        Some(source(20).numeric()),
        source(20).numeric(),
        source(20),
        50,
        90,
    );
    more.outbox.clear();
    more.versions = ["[\"3\"]", "[\"5\"]", "[\"4\"]", "[\"6\"]"]
        .iter()
        .map(|k| VersionRow {
            entity: "customer".into(),
            key: k.to_string(),
            etag: Some(format!("{:064}", 9)),
            is_deleted: *k == "[\"6\"]",
        })
        .collect();
    // A TRUNCATE re-check under way: the cursor moves with the progress,
    // position unchanged.
    more.recheck_after = Some("[\"3\"]".into());
    sc.commit(&more).await.unwrap();
    let p = sc
        .progress("contract", "in-process", 2)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(p.position, source(20).numeric());
    assert_eq!(p.recheck_after.as_deref(), Some("[\"3\"]"));
    let mut keys = vec![];
    let mut after: Option<String> = None;
    loop {
        let got = sc
            .published_keys("customer", after.as_deref(), 2)
            .await
            .unwrap();
        assert!(got.len() <= 2, "{got:?}");
        keys.extend(got.iter().cloned());
        if got.len() < 2 {
            break;
        }
        after = got.last().cloned();
    }
    assert_eq!(keys, ["[\"1\"]", "[\"3\"]", "[\"4\"]", "[\"5\"]"]);
    let mut done = batch(
        Some(source(20).numeric()),
        source(20).numeric(),
        source(20),
        60,
        91,
    );
    (done.outbox, done.versions) = (vec![], vec![]);
    sc.commit(&done).await.unwrap();
    let p = sc.progress("contract", "in-process", 2).await.unwrap();
    assert_eq!(p.unwrap().recheck_after, None, "the re-check ended");

    // Exactly the events of the two committed batches, in order, once.
    let sent = relay_all(&mut sc).await;
    assert_eq!(
        sent,
        vec!["{\"n\":1}", "{\"n\":2}", "{\"n\":3}", "{\"n\":4}"]
    );
    assert!(relay_all(&mut sc).await.is_empty(), "nothing is sent twice");
    let (pending, _) = sc.pending().await.unwrap();
    assert_eq!(pending, 0);

    // Kafka-mode progress (offsets) on two partitions of another topic.
    let offsets = |partition: u32, offset: i128, first_event: u32, correlation: u32| BatchCommit {
        topic: "orders".into(),
        partition,
        ..batch(None, offset, source(30), first_event, correlation)
    };
    sc.commit(&offsets(0, 10, 10, 5)).await.unwrap();
    sc.commit(&offsets(1, 7, 20, 6)).await.unwrap();
    let (pending, oldest_ms) = sc.pending().await.unwrap();
    assert_eq!(pending, 4, "two batches of two events, not yet relayed");
    assert!(oldest_ms >= 0, "{oldest_ms}");

    let offset = |p: Option<skein_applier::sidecar::Progress>| p.map(|p| p.offset());
    let forget = vec![("customer".to_string(), "[\"1\"]".to_string())];
    // Partition 1 is no longer at 99: the whole rewind changes nothing.
    let stale = Rewind {
        group: "contract".into(),
        topic: "orders".into(),
        partitions: vec![(0, 10, 4), (1, 99, 0)],
        forget: forget.clone(),
    };
    assert!(
        sc.rewind(&stale).await.is_err(),
        "a moved partition aborts the rewind"
    );
    let p0 = sc.progress("contract", "orders", 0).await.unwrap();
    assert_eq!(offset(p0.clone()), Some(10), "nothing rewound");
    assert!(p0.unwrap().source.is_some());
    let kept = sc
        .versions("customer", &forget_keys(&forget))
        .await
        .unwrap();
    assert_eq!(kept.len(), 1, "nothing forgotten");

    let before_rewind = sc.progress("contract", "orders", 0).await.unwrap().unwrap();
    let rewind = Rewind {
        partitions: vec![(0, 10, 4), (1, 7, 0)],
        ..stale
    };
    sc.rewind(&rewind).await.unwrap();
    let p0 = sc.progress("contract", "orders", 0).await.unwrap().unwrap();
    assert_eq!(
        (p0.offset(), p0.source),
        (4, None),
        "back to 4, source forgotten"
    );
    let p1 = sc.progress("contract", "orders", 1).await.unwrap();
    assert_eq!(offset(p1), Some(0));
    let p2 = sc.progress("contract", "in-process", 2).await.unwrap();
    assert_eq!(
        p2.map(|p| p.position),
        Some(source(20).numeric()),
        "other topics untouched"
    );
    let versions = sc
        .versions("customer", &["[\"1\"]".into(), "[\"2\"]".into()])
        .await
        .unwrap();
    assert!(
        !versions.contains_key("[\"1\"]"),
        "forgotten: publishes again"
    );
    assert!(versions.contains_key("[\"2\"]"));
    // A rewound partition is fenced for an applier that still expects 10.
    let zombie = BatchCommit {
        expected: Some(before_rewind.fence()),
        ..offsets(0, 12, 30, 7)
    };
    assert!(matches!(
        sc.commit(&zombie).await,
        Err(Error::Fenced { .. })
    ));
    // ABA: another applier re-applies 4 → 10, so progress is 10 again. The
    // zombie that read 10 before the rewind is still fenced.
    assert_eq!(
        p0.epoch,
        before_rewind.epoch + 1,
        "a rewind bumps the epoch"
    );
    let reapplied = BatchCommit {
        expected: Some(p0.fence()),
        ..offsets(0, 10, 40, 8)
    };
    sc.commit(&reapplied).await.unwrap();
    assert!(
        matches!(sc.commit(&zombie).await, Err(Error::Fenced { .. })),
        "a zombie whose progress a rewind wrote back is fenced"
    );

    // Taking a partition over: the new owner's claim fences the old owner
    // even though the position did not move.
    let old_owner = sc.progress("contract", "orders", 0).await.unwrap().unwrap();
    let new_owner = sc.claim("contract", "orders", 0).await.unwrap().unwrap();
    assert_eq!(
        (new_owner.position, new_owner.epoch),
        (old_owner.position, old_owner.epoch + 1)
    );
    let stale_owner = BatchCommit {
        expected: Some(old_owner.fence()),
        ..offsets(0, 11, 50, 9)
    };
    match sc.commit(&stale_owner).await {
        Err(Error::Fenced { found, .. }) => assert_eq!(found, Some(new_owner.fence())),
        other => panic!("the old owner must be fenced, got {other:?}"),
    }
    assert_eq!(
        sc.claim("contract", "never-committed", 0).await.unwrap(),
        None,
        "nothing to claim before the first commit"
    );

    // Rewinding does not touch the outbox: the four events are still due once.
    let sent = relay_all(&mut sc).await;
    assert_eq!(
        sent,
        vec![
            "{\"n\":10}",
            "{\"n\":11}",
            "{\"n\":20}",
            "{\"n\":21}",
            "{\"n\":40}",
            "{\"n\":41}"
        ]
    );
    assert_eq!(sc.pending().await.unwrap(), (0, 0));
}

fn at_epoch_0(position: i128) -> Fence {
    Fence { position, epoch: 0 }
}

fn forget_keys(forget: &[(String, String)]) -> Vec<String> {
    forget.iter().map(|(_, k)| k.clone()).collect()
}

fn pg_lsn(b: u8) -> SourcePosition {
    // High enough that the numeric form does not fit 32 bits.
    PgLsn((u64::from(b) << 32) | 0x42).into()
}

fn ms_lsn(b: u8) -> SourcePosition {
    // The top byte set: needs all 80 bits.
    let mut l = [0u8; 10];
    l[0] = 0xF0;
    l[9] = b;
    SqlServerLsn(l).into()
}

fn settings(batch: i64) -> RelaySettings {
    RelaySettings {
        batch,
        poll: Duration::from_millis(50),
        retention: Duration::from_secs(7 * 24 * 3600),
    }
}

/// The retention purge deletes relayed rows past their retention, a chunk
/// at a time, and never a pending one.
#[tokio::test(flavor = "multi_thread")]
async fn postgres_sidecar_purges_only_relayed_rows_past_their_retention() {
    let url = pg_db("skein_t_contract_purge").await;
    let mut sc = PgSidecar::connect(&url, "skein").await.unwrap();
    sc.migrate().await.unwrap();
    sc.commit(&batch(None, 10, pg_lsn(1), 1, 1)).await.unwrap();
    relay_all(&mut sc).await;
    sc.commit(&batch(Some(10), 20, pg_lsn(2), 3, 2))
        .await
        .unwrap();
    let cancel = CancellationToken::new();
    // Within the retention: nothing goes.
    let kept = purge(&mut sc, Duration::from_secs(3600), &cancel)
        .await
        .unwrap();
    assert_eq!(kept, 0);
    // Past it: the two relayed rows go, the two pending stay.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let gone = purge(&mut sc, Duration::from_secs(1), &cancel)
        .await
        .unwrap();
    assert_eq!(gone, 2);
    assert_eq!(sc.pending().await.unwrap().0, 2);
    assert_eq!(relay_all(&mut sc).await.len(), 2);
}

/// A batch draws its outbox ids under its partition's outbox lock, so a
/// partition's ids grow in commit order even between writers of other
/// groups or topics sharing the outbox (the relay's cursor relies on it):
/// held elsewhere, the lock holds the commit back until it is released.
#[tokio::test(flavor = "multi_thread")]
async fn a_batch_writes_its_outbox_rows_under_the_partitions_lock() {
    let (url, mut sc) = sidecar_with_batches("skein_t_contract_outbox_lock", 0).await;
    let mut other = connect(url.expose()).await;
    let tx = other.transaction().await.unwrap();
    tx.execute(
        "SELECT pg_advisory_xact_lock(hashtext('skein.outbox.skein'), 2)",
        &[],
    )
    .await
    .unwrap();
    let commit = tokio::spawn(async move {
        sc.commit(&batch(None, 10, pg_lsn(1), 1, 1))
            .await
            .map(|_| sc)
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !commit.is_finished(),
        "the batch committed while another writer held its partition's outbox lock"
    );
    let drawn: Option<i64> = tx
        .query_one(
            "SELECT pg_sequence_last_value('skein.outbox_row_id_seq')",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        drawn, None,
        "outbox ids were drawn before the lock was granted"
    );
    tx.rollback().await.unwrap();
    let mut sc = tokio::time::timeout(Duration::from_secs(10), commit)
        .await
        .expect("the batch commits once the lock is free")
        .unwrap()
        .unwrap();
    assert_eq!(sc.pending().await.unwrap().0, 2);
    assert_eq!(relay_all(&mut sc).await.len(), 2);
}

/// A relay with nothing to send (it polls every `sink.relay_poll_ms`)
/// locks no cursor: its round writes nothing and holds no transaction id,
/// which would also hold up every logical slot being created meanwhile.
/// The cursor row's `xmax` would name each idle round's transaction
/// otherwise.
#[tokio::test(flavor = "multi_thread")]
async fn an_idle_relay_round_locks_no_cursor() {
    let (url, mut sc) = sidecar_with_batches("skein_t_contract_idle_relay", 1).await;
    assert_eq!(relay_all(&mut sc).await.len(), 2);
    let db = connect(url.expose()).await;
    let locker = "SELECT partition, xmax::text FROM skein.relay_cursor ORDER BY partition";
    // (The round that moved the cursor may have left its own, committed,
    // transaction there.)
    let before: Vec<(i32, String)> = pairs(&db, locker).await;
    assert_eq!(before.len(), 1);
    for _ in 0..3 {
        assert_eq!(
            relay_once(&mut sc, &mut Collect::default(), 10, &RelayScope::All)
                .await
                .unwrap(),
            0
        );
    }
    assert_eq!(pairs::<i32, String>(&db, locker).await, before);
}

/// A sink that holds each send until the test lets it go, and says when
/// a send has begun.
struct Held {
    began: std::sync::mpsc::Sender<()>,
    go: std::sync::mpsc::Receiver<()>,
}

impl Sink for Held {
    fn send(&mut self, _: &[SinkEvent]) -> skein_applier::Result<()> {
        self.began.send(()).unwrap();
        self.go.recv().unwrap();
        Ok(())
    }
}

/// Starts a relay round of every partition on `sc` whose sink holds its
/// send; returns once the send began, with the round and the sender that
/// lets the send go on.
async fn hold_a_relay_round(
    mut sc: PgSidecar,
) -> (
    tokio::task::JoinHandle<skein_applier::Result<usize>>,
    std::sync::mpsc::Sender<()>,
) {
    let (began_tx, began) = std::sync::mpsc::channel();
    let (go, go_rx) = std::sync::mpsc::channel();
    let round = tokio::spawn(async move {
        let mut sink = Held {
            began: began_tx,
            go: go_rx,
        };
        relay_once(&mut sc, &mut sink, 10, &RelayScope::All).await
    });
    tokio::task::spawn_blocking(move || began.recv().unwrap())
        .await
        .unwrap();
    (round, go)
}

/// While the relay waits on its sink (a slow broker, an outage it sits
/// out) its transaction holds no transaction id. One that did would hold
/// up every logical replication slot created in the cluster meanwhile
/// (PostgreSQL waits for the transactions running when a slot is created
/// to end): with the sidecar beside the source, an extractor's first start
/// would hang, silently, for as long as the sink does.
#[tokio::test(flavor = "multi_thread")]
async fn a_relay_waiting_on_its_sink_holds_up_no_slot_creation() {
    let (url, sc) = sidecar_with_batches("skein_t_contract_relay_xid", 1).await;
    let (relay, go) = hold_a_relay_round(sc).await;
    let db = connect(url.expose()).await;
    db.batch_execute("SET statement_timeout = '10s'")
        .await
        .unwrap();
    let created = db
        .query_one(
            "SELECT lsn::text FROM pg_create_logical_replication_slot('skein_t_contract_relay_xid', 'pgoutput')",
            &[],
        )
        .await;
    go.send(()).unwrap();
    assert_eq!(relay.await.unwrap().unwrap(), 2, "the held round went on");
    let dropped = db
        .execute(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots \
             WHERE slot_name = 'skein_t_contract_relay_xid'",
            &[],
        )
        .await;
    assert!(
        created.is_ok(),
        "creating a slot waited for the relay's transaction: {created:?}"
    );
    dropped.unwrap();
}

/// A relay round locks at most 64 partitions' cursors (advisory locks take
/// slots of the server's shared lock table), those whose oldest pending
/// row is oldest, so none starves; `relay_once` goes on with further
/// rounds while one took 64, so its caller still sees a step short of its
/// limit only when nothing more was visible.
#[tokio::test(flavor = "multi_thread")]
async fn a_relay_round_takes_the_64_partitions_waiting_longest() {
    let url = pg_db("skein_t_contract_relay_wide").await;
    let mut sc = PgSidecar::connect(&url, "skein").await.unwrap();
    sc.migrate().await.unwrap();
    // Partition p's rows are events 2p+1 and 2p+2; the last partitions
    // are written first, so the oldest rows are not the lowest partitions.
    for p in (0..70u32).rev() {
        let mut b = batch(None, 10, pg_lsn(1), 2 * p + 1, p + 1);
        b.partition = p;
        sc.commit(&b).await.unwrap();
    }
    let db = connect(url.expose()).await;
    let mut locked: Vec<i32> = db
        .query(
            &skein_sql::postgres::sidecar::relay_lock_sql("skein"),
            &[&None::<Vec<i32>>, &"skein.outbox.skein"],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    locked.sort_unstable();
    assert_eq!(locked, (6..70).collect::<Vec<_>>());
    let sent = relay_once(&mut sc, &mut Collect::default(), 1000, &RelayScope::All)
        .await
        .unwrap();
    assert_eq!(sent, 140, "the step went on past the first 64 partitions");
    let sent = relay_once(&mut sc, &mut Collect::default(), 1000, &RelayScope::All)
        .await
        .unwrap();
    assert_eq!(sent, 0);
}

/// With more partitions pending than a round takes, a round still fills
/// its limit from the partitions it took: their rows are read, not the
/// oldest rows of every partition (which the relay would then have to
/// leave, sending a short round and idling until the next wake).
#[tokio::test(flavor = "multi_thread")]
async fn a_relay_round_past_64_partitions_fills_its_limit() {
    let url = pg_db("skein_t_contract_relay_full").await;
    let mut sc = PgSidecar::connect(&url, "skein").await.unwrap();
    sc.migrate().await.unwrap();
    // Two passes over partitions 69 to 0, one row each: ids 1-70 are the
    // first rows (partition 69 first), ids 71-140 the second ones.
    for pass in 0..2u32 {
        for p in (0..70u32).rev() {
            let n = 1000 * (pass + 1) + p;
            let mut b = batch(
                (pass == 1).then_some(10),
                10 * i128::from(pass + 1),
                pg_lsn(u8::try_from(pass).unwrap() + 1),
                n,
                n,
            );
            b.partition = p;
            b.outbox.truncate(1);
            sc.commit(&b).await.unwrap();
        }
    }
    // The round takes partitions 69 to 6 (oldest first rows): 128 rows.
    // Read by id over every partition, the first 100 held only 94 of them.
    let sink = Collect::default();
    let sent = relay_once(&mut sc, &mut sink.clone(), 100, &RelayScope::All)
        .await
        .unwrap();
    assert_eq!(
        sent, 100,
        "a round of 64 partitions with 128 rows pending sent {sent}"
    );
}

/// A relay that takes a partition over waits for the previous owner's
/// round, then reads the cursor that round moved: it sends nothing twice,
/// also where the database's default isolation is REPEATABLE READ (a
/// transaction-wide snapshot, taken before the wait, would still show the
/// rows as pending).
#[tokio::test(flavor = "multi_thread")]
async fn a_relay_taking_a_partition_over_sends_nothing_twice() {
    let (url, _) = sidecar_with_batches("skein_t_contract_relay_takeover", 1).await;
    connect(url.expose())
        .await
        .batch_execute(
            "ALTER DATABASE skein_t_contract_relay_takeover \
             SET default_transaction_isolation = 'repeatable read'",
        )
        .await
        .unwrap();
    let first = PgSidecar::connect(&url, "skein").await.unwrap();
    let mut second = PgSidecar::connect(&url, "skein").await.unwrap();
    let (held, go) = hold_a_relay_round(first).await;
    let late = Collect::default();
    let mut late_sink = late.clone();
    let taker =
        tokio::spawn(
            async move { relay_once(&mut second, &mut late_sink, 10, &RelayScope::All).await },
        );
    // The taker's round is under way, waiting for the held one's lock.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !taker.is_finished(),
        "the taker did not wait for the round in progress"
    );
    go.send(()).unwrap();
    assert_eq!(held.await.unwrap().unwrap(), 2);
    let sent = taker.await.unwrap();
    assert_eq!(
        (sent.as_ref().ok(), late.0.lock().unwrap().len()),
        (Some(&0), 0),
        "the taker sent again what the previous round sent: {sent:?}"
    );
}

/// The relay takes every row at or below its partition's cursor as sent,
/// so a batch whose ids do not pass the partition's highest (its id
/// sequence reset, or caching values per session) is refused whole with
/// an error that says so, instead of writing rows the relay would skip.
#[tokio::test(flavor = "multi_thread")]
async fn a_batch_whose_outbox_ids_go_back_is_refused() {
    let (url, mut sc) = sidecar_with_batches("skein_t_contract_outbox_order", 1).await;
    assert_eq!(relay_all(&mut sc).await.len(), 2);
    // The relayed rows past their retention go: ids 1 and 2 are free
    // again, and only the cursor (2) remembers them.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let cancel = CancellationToken::new();
    assert_eq!(purge(&mut sc, Duration::ZERO, &cancel).await.unwrap(), 2);
    let db = connect(url.expose()).await;
    db.batch_execute("ALTER SEQUENCE skein.outbox_row_id_seq RESTART WITH 1")
        .await
        .unwrap();
    let e = sc
        .commit(&batch(Some(10), 20, pg_lsn(2), 3, 2))
        .await
        .unwrap_err();
    assert!(
        matches!(
            e,
            Error::OutboxOrder {
                partition: 2,
                drawn: 1,
                floor: 2
            }
        ),
        "{e}"
    );
    assert_eq!(sc.pending().await.unwrap().0, 0, "nothing was written");
    let progress = sc
        .progress("contract", "in-process", 2)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(progress.position, 10, "the progress did not move");
    // Past the highest id again, batches go on.
    db.batch_execute("ALTER SEQUENCE skein.outbox_row_id_seq RESTART WITH 100")
        .await
        .unwrap();
    sc.commit(&batch(Some(10), 20, pg_lsn(2), 3, 2))
        .await
        .unwrap();
    assert_eq!(relay_all(&mut sc).await, vec!["{\"n\":3}", "{\"n\":4}"]);
}

/// A version 6 sidecar marked each relayed row `dequeued_at`; version 7
/// keeps one cursor per partition. The upgrade stops each partition's
/// cursor below its first pending row: the pending rows are sent (and a
/// row relayed after a pending one, out of order, once more: at least
/// once), nothing relayed before them goes again, and later batches are
/// relayed past the cursor.
#[tokio::test(flavor = "multi_thread")]
async fn a_version_6_outbox_keeps_its_pending_rows_across_the_upgrade() {
    let (url, _) = sidecar_with_batches("skein_t_contract_v6_outbox", 3).await;
    // Back to version 6's shape: ids 1 to 4 in partition 2 (3 pending, 4
    // relayed before it), 5 and 6 moved to partition 1, both relayed.
    let db = connect(url.expose()).await;
    db.batch_execute(
        "DROP VIEW skein.outbox; DROP TABLE skein.relay_cursor;
         DROP INDEX skein.outbox_partition_id; DROP INDEX skein.outbox_enqueued;
         ALTER TABLE skein.outbox_row RENAME TO outbox;
         ALTER TABLE skein.outbox ADD COLUMN dequeued_at timestamptz;
         CREATE INDEX outbox_pending ON skein.outbox (id) WHERE dequeued_at IS NULL;
         CREATE INDEX outbox_dequeued ON skein.outbox (dequeued_at) WHERE dequeued_at IS NOT NULL;
         UPDATE skein.outbox SET partition = 1 WHERE id IN (5, 6);
         UPDATE skein.outbox SET dequeued_at = now() WHERE id IN (1, 2, 4, 5, 6);
         DELETE FROM skein.schema_version WHERE version > 6;",
    )
    .await
    .unwrap();
    let mut sc = PgSidecar::connect(&url, "skein").await.unwrap();
    sc.migrate().await.unwrap();
    assert_eq!(sc.pending().await.unwrap().0, 2);
    assert_eq!(relay_all(&mut sc).await, vec!["{\"n\":3}", "{\"n\":4}"]);
    assert_eq!(sc.pending().await.unwrap().0, 0);
    sc.commit(&batch(Some(30), 40, pg_lsn(4), 7, 7))
        .await
        .unwrap();
    assert_eq!(relay_all(&mut sc).await, vec!["{\"n\":7}", "{\"n\":8}"]);
    // The rows moved to outbox_row; the outbox is a view that still says
    // which rows are relayed.
    let rows: Vec<(i64, bool)> = pairs(
        &db,
        "SELECT id, dequeued_at IS NULL FROM skein.outbox ORDER BY id",
    )
    .await;
    assert_eq!(rows, (1..=8).map(|i| (i, false)).collect::<Vec<_>>());
    let columns: i64 = db
        .query_one(
            "SELECT count(*) FROM information_schema.columns WHERE table_schema = 'skein' \
             AND table_name = 'outbox_row' AND column_name = 'dequeued_at'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(columns, 0, "the upgrade drops dequeued_at from the rows");
}

/// A relay round that took `sink.relay_batch` rows may have left more
/// behind, so the relay looks again at once, without a wake-up or a poll
/// (an hour here): three batches of two rows go out in rounds of two,
/// relaying every partition or only owned ones.
#[tokio::test(flavor = "multi_thread")]
async fn a_full_relay_round_looks_again_at_once() {
    for (db, scope) in [
        ("skein_t_contract_full_all", RelayScope::All),
        (
            "skein_t_contract_full_owned",
            RelayScope::Partitions(Arc::new(Mutex::new(vec![2]))),
        ),
    ] {
        let (url, mut sc) = sidecar_with_batches(db, 3).await;
        let (log, cancel, relay) = spawn_relay(
            &url,
            Duration::ZERO,
            RelaySettings {
                poll: Duration::from_secs(3600),
                ..settings(2)
            },
            scope,
            // Woken by appliers, of which there are none here.
            Some(RelayWake::default()),
        )
        .await;
        let waits = format!("{db}: the relay waits for its poll after a full round");
        relayed_within_20s(&log, 6, &waits).await;
        cancel.cancel();
        relay.await.unwrap().unwrap();
        assert_eq!(sc.pending().await.unwrap().0, 0, "{db}");
    }
}

/// A relay nobody wakes (`skein relay`) looks again at once after a round
/// that sent rows, even one that was not full: rows committed while it
/// sent go out then, not at its next poll (an hour here).
#[tokio::test(flavor = "multi_thread")]
async fn a_relay_nobody_wakes_looks_again_after_a_round_with_rows() {
    let (url, mut sc) = sidecar_with_batches("skein_t_contract_unwoken", 1).await;
    let (log, cancel, relay) = spawn_relay(
        &url,
        Duration::from_millis(1500),
        RelaySettings {
            poll: Duration::from_secs(3600),
            ..settings(500)
        },
        RelayScope::All,
        None,
    )
    .await;
    // The first round is sending the first batch's two rows (1.5 s).
    tokio::time::sleep(Duration::from_millis(500)).await;
    sc.commit(&batch(Some(10), 20, pg_lsn(2), 3, 2))
        .await
        .unwrap();
    relayed_within_20s(
        &log,
        4,
        "the relay waits for its poll after a round with rows",
    )
    .await;
    cancel.cancel();
    relay.await.unwrap().unwrap();
    assert_eq!(sc.pending().await.unwrap().0, 0);
}

/// A stopping relay sends what is pending for a few seconds, not all of
/// it: a stop with a long backlog of sends (a slow sink) ends cleanly,
/// before the process's stop deadline (15 s), and what was not sent stays
/// pending for the next start.
#[tokio::test(flavor = "multi_thread")]
async fn a_stopping_relay_leaves_a_long_backlog_pending() {
    // 40 rows, one per send, 0.5 s a send: 20 s to send them all.
    let (url, mut sc) = sidecar_with_batches("skein_t_contract_stop_drain", 20).await;
    let (log, cancel, relay) = spawn_relay(
        &url,
        Duration::from_millis(500),
        settings(1),
        RelayScope::All,
        None,
    )
    .await;
    while log.lock().unwrap().is_empty() {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let t0 = std::time::Instant::now();
    cancel.cancel();
    relay.await.unwrap().unwrap();
    let took = t0.elapsed();
    assert!(
        took < Duration::from_secs(8),
        "the relay took {took:?} to stop"
    );
    let sent = log.lock().unwrap().len() as i64;
    let (pending, _) = sc.pending().await.unwrap();
    assert!(pending > 0, "a backlog is left pending ({sent} sent)");
    assert_eq!(sent + pending, 40, "sent {sent}, pending {pending}");
}

/// A fresh database; its URL.
/// A migrated sidecar in a new database `db` holding `n` committed
/// batches of two events each (partition 2), and its URL.
async fn sidecar_with_batches(db: &str, n: u32) -> (Secret, PgSidecar) {
    let url = pg_db(db).await;
    let mut sc = PgSidecar::connect(&url, "skein").await.unwrap();
    sc.migrate().await.unwrap();
    let mut expected = None;
    for i in 0..n {
        let position = i128::from(i + 1) * 10;
        sc.commit(&batch(
            expected,
            position,
            pg_lsn(u8::try_from(i).unwrap() + 1),
            2 * i + 1,
            i + 1,
        ))
        .await
        .unwrap();
        expected = Some(position);
    }
    (url, sc)
}

type SentLog = Arc<Mutex<Vec<(&'static str, SinkEvent)>>>;

/// Waits until `log` holds `n` events; after 20 s fails, saying `why`.
async fn relayed_within_20s(log: &SentLog, n: usize, why: &str) {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while log.lock().unwrap().len() < n {
        assert!(
            std::time::Instant::now() < deadline,
            "{} of {n} rows relayed: {why}",
            log.lock().unwrap().len()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A running relay of the sidecar at `url` whose sink takes `per_send`
/// a send and logs what it got; cancel the token to stop it.
async fn spawn_relay(
    url: &Secret,
    per_send: Duration,
    settings: RelaySettings,
    scope: RelayScope,
    wake: Option<RelayWake>,
) -> (
    SentLog,
    CancellationToken,
    tokio::task::JoinHandle<skein_applier::Result<()>>,
) {
    let log: SentLog = Arc::default();
    let cancel = CancellationToken::new();
    let relay = tokio::spawn(run_relay(
        PgSidecar::connect(url, "skein").await.unwrap(),
        Box::new(Tagged("r", log.clone(), per_send)),
        settings,
        scope,
        "test relay".into(),
        wake,
        cancel.clone(),
    ));
    (log, cancel, relay)
}

async fn pg_db(db: &str) -> Secret {
    let admin = connect(&admin_url()).await;
    recreate_db(&admin, db).await;
    Secret::new(format!("{}/{db}", admin_url().rsplit_once('/').unwrap().0))
}

async fn pg_sidecar(db: &str) -> AnySidecar {
    AnySidecar::connect(&pg_db(db).await, "skein")
        .await
        .unwrap()
}

/// The explicit-run part of the contract: a run is found again until it
/// is finished; a chunk moves the cursor and queues its keys atomically,
/// or (cursor moved) does nothing; a batch of explicit keys takes them off
/// the queue in its transaction, fenced like any batch, without creating
/// or moving progress; the same keys cannot be taken twice.
async fn explicit_contract<S: Sidecar>(mut sc: S) {
    sc.migrate().await.unwrap();
    let new = NewRun {
        group: "contract".into(),
        entity: "customer".into(),
        selection: "\"all\"".into(),
        republish: false,
        initial: false,
    };
    let run = sc.explicit_start(&new).await.unwrap();
    assert!(!run.resumed);
    assert_eq!((run.cursor.clone(), run.queued), (None, 0));
    assert_eq!(sc.explicit_start(&new).await.unwrap().id, run.id);
    assert!(sc.explicit_start(&new).await.unwrap().resumed);
    let chunk = |from: Option<&str>, to: &str, keys: &[(u32, &str)], done: bool| ExplicitChunk {
        run: run.id,
        group: "contract".into(),
        topic: "in-process".into(),
        entity: "customer".into(),
        republish: false,
        from: from.map(String::from),
        to: Some(to.into()),
        keys: keys.iter().map(|(p, k)| (*p, k.to_string())).collect(),
        done,
    };
    sc.explicit_enqueue(&chunk(
        None,
        "[\"2\"]",
        &[(0, "[\"1\"]"), (1, "[\"2\"]")],
        false,
    ))
    .await
    .unwrap();
    // A second process with the old cursor: refused, nothing queued.
    let e = sc
        .explicit_enqueue(&chunk(None, "[\"9\"]", &[(0, "[\"9\"]")], true))
        .await
        .unwrap_err();
    assert!(e.to_string().contains("cursor moved"), "{e}");
    let resumed = sc.explicit_start(&new).await.unwrap();
    assert_eq!(
        (resumed.cursor.as_deref(), resumed.queued),
        (Some("[\"2\"]"), 2)
    );
    sc.explicit_enqueue(&chunk(Some("[\"2\"]"), "[\"3\"]", &[(0, "[\"3\"]")], true))
        .await
        .unwrap();
    let st = sc.explicit_run(run.id).await.unwrap().unwrap();
    assert_eq!((st.state.as_str(), st.queued, st.pending), ("queued", 3, 3));
    assert!(!st.finished());
    let p0 = sc
        .explicit_pending("contract", "in-process", 0, 4, 10)
        .await
        .unwrap();
    let keys: Vec<&str> = p0.iter().map(|i| i.key.as_str()).collect();
    assert_eq!(keys, ["[\"1\"]", "[\"3\"]"]);
    let p1 = sc
        .explicit_pending("contract", "in-process", 1, 4, 10)
        .await
        .unwrap();
    assert_eq!(p1.len(), 1);
    assert!(sc
        .explicit_pending("contract", "other-topic", 0, 4, 10)
        .await
        .unwrap()
        .is_empty());

    // Partition 0 has no progress yet: the explicit batch neither needs nor
    // creates one.
    let explicit_batch = |partition: u32, expected: Option<Fence>, ids: Vec<i64>, n: u32| {
        let position = expected.map_or(0, |f| f.position);
        BatchCommit {
            group: "contract".into(),
            topic: "in-process".into(),
            partition,
            expected,
            position,
            source: None,
            recheck_after: None,
            dead_letters: 0,
            lower: position,
            upper: position,
            correlation_id: format!("0190a4c2-0000-7000-9000-{:012}", 900 + n),
            record_count: ids.len() as i32,
            entity_count: ids.len() as i32,
            has_data_loss: false,
            outbox: vec![outbox_row(900 + n, "[\"1\"]")],
            versions: vec![],
            explicit: ids,
        }
    };
    let ids0: Vec<i64> = p0.iter().map(|i| i.id).collect();
    let (before, _) = sc.pending().await.unwrap();
    sc.commit(&explicit_batch(0, None, ids0.clone(), 1))
        .await
        .unwrap();
    assert_eq!(
        sc.progress("contract", "in-process", 0).await.unwrap(),
        None
    );
    assert!(sc
        .explicit_pending("contract", "in-process", 0, 4, 10)
        .await
        .unwrap()
        .is_empty());
    // Taken twice: fenced, nothing written.
    let twice = sc.commit(&explicit_batch(0, None, ids0, 2)).await;
    assert!(matches!(twice, Err(Error::Fenced { .. })), "{twice:?}");
    assert_eq!(sc.pending().await.unwrap().0, before + 1);

    // Partition 1 has progress: an explicit batch is fenced on it and
    // leaves it where it is.
    let mut first = batch(None, 40, pg_lsn(4), 950, 950);
    first.partition = 1;
    sc.commit(&first).await.unwrap();
    let at = sc
        .progress("contract", "in-process", 1)
        .await
        .unwrap()
        .unwrap();
    let ids1: Vec<i64> = p1.iter().map(|i| i.id).collect();
    let stale = sc
        .commit(&explicit_batch(1, Some(at_epoch_0(39)), ids1.clone(), 3))
        .await;
    assert!(matches!(stale, Err(Error::Fenced { .. })), "{stale:?}");
    let mut b = explicit_batch(1, Some(at.fence()), ids1, 4);
    b.source = at.source;
    sc.commit(&b).await.unwrap();
    assert_eq!(
        sc.progress("contract", "in-process", 1).await.unwrap(),
        Some(at)
    );
    let st = sc.explicit_run(run.id).await.unwrap().unwrap();
    assert_eq!((st.queued, st.pending), (3, 0));
    assert!(st.finished());
    // Finished: the same selection starts a new run.
    let again = sc.explicit_start(&new).await.unwrap();
    assert!(!again.resumed && again.id != run.id);
    let runs = sc.explicit_runs("contract", 5).await.unwrap();
    assert_eq!(
        runs.iter().map(|r| r.id).collect::<Vec<_>>(),
        [again.id, run.id]
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn postgres_sidecar_keeps_the_contract() {
    let url = pg_db("skein_t_contract_pg").await;
    let sc = PgSidecar::connect(&url, "skein").await.unwrap();
    contract(sc, pg_lsn).await;
    let url = pg_db("skein_t_contract_pg_explicit").await;
    explicit_contract(PgSidecar::connect(&url, "skein").await.unwrap()).await;
}

/// An applier starting while another holds a batch transaction open (a
/// paused process): its migrate of a current sidecar runs no DDL, so it
/// neither waits for that batch nor holds up readers of the progress
/// behind its lock (the CI deadlock of stop 19: the chaos harness's read
/// waited behind a migrate's ALTER TABLE, which waited for a paused
/// applier).
#[tokio::test(flavor = "multi_thread")]
async fn migrating_a_current_sidecar_takes_no_lock_behind_an_open_batch() {
    let url = pg_db("skein_t_contract_migrate_lock").await;
    let mut a = PgSidecar::connect(&url, "skein").await.unwrap();
    a.migrate().await.unwrap();
    a.commit(&batch(None, 10, pg_lsn(1), 1, 1)).await.unwrap();
    let open = connect(url.expose()).await;
    open.batch_execute("BEGIN; UPDATE skein.progress SET updated_at = now() WHERE partition = 2")
        .await
        .unwrap();
    let mut b = PgSidecar::connect(&url, "skein").await.unwrap();
    tokio::time::timeout(Duration::from_secs(5), b.migrate())
        .await
        .expect("migrate waited for the open batch transaction")
        .unwrap();
    let mut c = PgSidecar::connect(&url, "skein").await.unwrap();
    let p = tokio::time::timeout(
        Duration::from_secs(5),
        c.progress("contract", "in-process", 2),
    )
    .await
    .expect("reading progress was held up")
    .unwrap();
    assert!(p.is_some());
    open.batch_execute("ROLLBACK").await.unwrap();
}

/// A sidecar a newer skein migrated is refused with what to do: its rows
/// may mean more than this version knows (a TRUNCATE re-check cursor).
#[tokio::test(flavor = "multi_thread")]
async fn postgres_sidecar_of_a_newer_skein_is_refused() {
    let url = pg_db("skein_t_contract_newer").await;
    let mut sc = PgSidecar::connect(&url, "skein").await.unwrap();
    sc.migrate().await.unwrap();
    let db = connect(url.expose()).await;
    db.execute(
        "INSERT INTO skein.schema_version (version) VALUES (99)",
        &[],
    )
    .await
    .unwrap();
    match sc.migrate().await {
        Err(Error::Schema { message, fix }) => {
            assert!(message.contains("version 99"), "{message}");
            assert!(fix.contains("upgrade all"), "{fix}");
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
}

/// SQL Server positions (80 bits) in a PostgreSQL sidecar: the sidecar of a
/// SQL Server source may run on PostgreSQL.
#[tokio::test(flavor = "multi_thread")]
async fn postgres_sidecar_stores_sql_server_positions() {
    contract(pg_sidecar("skein_t_contract_pg_ms").await, ms_lsn).await;
}

#[tokio::test(flavor = "multi_thread")]
#[ignore = "needs SQL Server: set SKEIN_TEST_MSSQL_URL, run scripts/test-mssql"]
async fn sqlserver_sidecar_keeps_the_contract() {
    let base = std::env::var("SKEIN_TEST_MSSQL_URL")
        .expect("SKEIN_TEST_MSSQL_URL is not set: this test needs a SQL Server");
    let mut master = skein_sql::sqlserver::MssqlClient::connect(&base)
        .await
        .unwrap();
    master
        .batch(
            "recreate",
            "IF DB_ID(N'skein_t_contract') IS NOT NULL BEGIN \
               ALTER DATABASE [skein_t_contract] SET SINGLE_USER WITH ROLLBACK IMMEDIATE; \
               DROP DATABASE [skein_t_contract]; END; \
             CREATE DATABASE [skein_t_contract];",
        )
        .await
        .unwrap();
    let url = format!("{};database=skein_t_contract", base.trim_end_matches(';'));
    let sc = AnySidecar::connect(&Secret::new(url.clone()), "skein")
        .await
        .unwrap();
    assert!(matches!(sc, AnySidecar::SqlServer(_)));
    contract(sc, ms_lsn).await;
    let mut db = skein_sql::sqlserver::MssqlClient::connect(&url)
        .await
        .unwrap();
    db.batch("a fresh schema", "EXEC(N'CREATE SCHEMA [skein_explicit]')")
        .await
        .unwrap();
    let sc = AnySidecar::connect(&Secret::new(url), "skein_explicit")
        .await
        .unwrap();
    explicit_contract(sc).await;
}

/// Per aggregate key, the event numbers in outbox id order (the order the
/// batches were committed and, within one, the order of its outbox rows).
type PerKey = BTreeMap<String, Vec<u32>>;

fn parse_event(e: &SinkEvent) -> (String, u32) {
    let v: serde_json::Value = serde_json::from_str(&e.event).unwrap();
    (
        v["key"].as_str().unwrap().to_string(),
        u32::try_from(v["n"].as_u64().unwrap()).unwrap(),
    )
}

/// Commits 48 batches over 4 partitions (2 keys each, several events per
/// key per batch) while two partition-scoped relays run and partitions move
/// between them, with an overlap where both own the same ones (no skipping:
/// the second waits for the first's send). Partition 1 ends up owned by
/// nobody and an all-partitions relay drains it afterwards. Every event
/// arrives exactly once and, per key, in commit order.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_relays_deliver_each_event_once_in_order_per_key() {
    const PARTITIONS: u32 = 4;
    const BATCHES: u32 = 48;
    let url = pg_db("skein_t_contract_pg_relay").await;
    let mut writer = PgSidecar::connect(&url, "skein").await.unwrap();
    writer.migrate().await.unwrap();

    let log: Arc<Mutex<Vec<(&'static str, SinkEvent)>>> = Arc::default();
    let owned_a: Arc<Mutex<Vec<i32>>> = Arc::new(Mutex::new(vec![0, 1, 2, 3]));
    let owned_b: Arc<Mutex<Vec<i32>>> = Arc::default();
    let (cancel_a, cancel_b) = (CancellationToken::new(), CancellationToken::new());
    // One relay on the bare PostgreSQL sidecar, one on the configured one:
    // `run_relay` takes any `Sidecar`.
    let relay_a = tokio::spawn(run_relay(
        PgSidecar::connect(&url, "skein").await.unwrap(),
        Box::new(Tagged("a", log.clone(), Duration::from_millis(15))),
        settings(3),
        RelayScope::Partitions(owned_a.clone()),
        "apply a".into(),
        None,
        cancel_a.clone(),
    ));
    let relay_b = tokio::spawn(run_relay(
        AnySidecar::connect(&url, "skein").await.unwrap(),
        Box::new(Tagged("b", log.clone(), Duration::ZERO)),
        settings(2),
        RelayScope::Partitions(owned_b.clone()),
        "apply b".into(),
        None,
        cancel_b.clone(),
    ));

    let mut expected = PerKey::new();
    let mut progress: HashMap<u32, i128> = HashMap::new();
    let mut n = 0u32;
    for i in 0..BATCHES {
        match i {
            // Partitions 2 and 3 move to B: B owns them first (both do for
            // a while), then A lets go.
            12 => owned_b.lock().unwrap().extend([2, 3]),
            18 => owned_a.lock().unwrap().retain(|p| *p < 2),
            // Partition 0 moves to B at once; partition 1 is left unowned.
            30 => {
                owned_b.lock().unwrap().push(0);
                owned_a.lock().unwrap().clear();
            }
            _ => {}
        }
        let partition = i % PARTITIONS;
        let expected_pos = progress.get(&partition).copied();
        let position = expected_pos.unwrap_or(0) + 1;
        // Keys `partition` and `partition + 4` live in this partition;
        // the batch interleaves their events.
        let mut outbox = vec![];
        for j in 0..5 {
            n += 1;
            let key = format!("k{}", partition + PARTITIONS * ((i / PARTITIONS + j) % 2));
            expected.entry(key.clone()).or_default().push(n);
            outbox.push(OutboxRow {
                event_id: format!("0190a4c2-0000-7000-8000-{n:012}"),
                entity: "customer".into(),
                key: key.clone(),
                etag: None,
                event: serde_json::json!({ "key": key, "n": n }).to_string(),
                commit_time_micros: 1_709_243_999_123_456,
            });
        }
        let b = BatchCommit {
            group: "relay".into(),
            topic: "orders".into(),
            partition,
            expected: expected_pos.map(at_epoch_0),
            position,
            source: None,
            recheck_after: None,
            dead_letters: 0,
            lower: expected_pos.unwrap_or(0),
            upper: position,
            correlation_id: format!("0190a4c2-0000-7000-9000-{i:012}"),
            record_count: 5,
            entity_count: 2,
            has_data_loss: false,
            outbox,
            versions: vec![],
            explicit: vec![],
        };
        writer.commit(&b).await.unwrap();
        progress.insert(partition, position);
        tokio::time::sleep(Duration::from_millis(7)).await;
    }

    // Both scoped relays drain what they own, then stop.
    cancel_a.cancel();
    cancel_b.cancel();
    relay_a.await.unwrap().unwrap();
    relay_b.await.unwrap().unwrap();
    let (left, _) = writer.pending().await.unwrap();
    assert!(left > 0, "partition 1's last batches are owned by nobody");
    let scoped = log.lock().unwrap().len();
    assert_eq!(
        scoped as i64 + left,
        i64::from(n),
        "sent + pending = committed"
    );

    // The one all-partitions relay takes the rest.
    let mut s = Tagged("all", log.clone(), Duration::ZERO);
    while relay_once(&mut writer, &mut s, 4, &RelayScope::All)
        .await
        .unwrap()
        > 0
    {}
    assert_eq!(writer.pending().await.unwrap(), (0, 0));

    let mut got = PerKey::new();
    let mut by_relay: BTreeMap<&str, usize> = BTreeMap::new();
    for (relay, e) in log.lock().unwrap().iter() {
        let (key, n) = parse_event(e);
        got.entry(key).or_default().push(n);
        *by_relay.entry(relay).or_default() += 1;
    }
    assert_eq!(by_relay.len(), 3, "each relay sent some: {by_relay:?}");
    let total: usize = got.values().map(Vec::len).sum();
    assert_eq!(total, n as usize, "every event exactly once");
    assert_eq!(got, expected, "per key, events arrive in outbox id order");
}

/// The relay lease: one relay of every partition at a time, alone; relays
/// of owned partitions together; a lease is freed when its connection
/// closes (a crashed relay does not block the next one).
async fn lease_contract<S: Sidecar>(mut a: S, b: &mut S, c: &mut S) {
    assert!(a.relay_lease(true).await.unwrap(), "a free lease");
    assert!(
        !b.relay_lease(true).await.unwrap(),
        "a second all-partitions relay stands by"
    );
    assert!(
        !b.relay_lease(false).await.unwrap(),
        "partition relays stand by too"
    );
    drop(a);
    // The server notices the closed session shortly.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !b.relay_lease(false).await.unwrap() {
        assert!(
            std::time::Instant::now() < deadline,
            "the lease was not freed"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert!(
        c.relay_lease(false).await.unwrap(),
        "partition relays share it"
    );
    assert!(!c.relay_lease(true).await.unwrap());
}

#[tokio::test(flavor = "multi_thread")]
async fn postgres_relay_lease_keeps_one_all_partitions_relay() {
    let url = pg_db("skein_t_contract_lease").await;
    let connect = || PgSidecar::connect(&url, "skein");
    let (a, mut b, mut c) = (
        connect().await.unwrap(),
        connect().await.unwrap(),
        connect().await.unwrap(),
    );
    // Who holds it can be read (for `skein status`): before, nobody.
    assert_eq!(c.relay_lease_holders().await.unwrap(), Some((0, 0)));
    lease_contract(a, &mut b, &mut c).await;
    assert_eq!(c.relay_lease_holders().await.unwrap(), Some((0, 2)));
}

/// A batch whose writes fail part-way (PostgreSQL refuses an outbox row;
/// the statements after it were already sent, pipelined) writes nothing,
/// names the statement that failed, and leaves the connection fit for the
/// next batch.
#[tokio::test(flavor = "multi_thread")]
async fn a_batch_failing_mid_pipeline_writes_nothing_and_the_next_one_commits() {
    let url = pg_db("skein_t_contract_pipeline").await;
    let mut sc = PgSidecar::connect(&url, "skein").await.unwrap();
    sc.migrate().await.unwrap();
    let first = batch(None, pg_lsn(10).numeric(), pg_lsn(10), 1, 1);
    sc.commit(&first).await.unwrap();
    // Pending outbox rows (the second figure is an age).
    let before = sc.pending().await.unwrap().0;

    let mut bad = batch(
        Some(pg_lsn(10).numeric()),
        pg_lsn(11).numeric(),
        pg_lsn(11),
        10,
        2,
    );
    bad.outbox[0].event = "{\"n\":\"\u{0}\"}".into();
    let err = sc.commit(&bad).await.expect_err("a NUL in text is refused");
    assert!(!matches!(err, Error::Fenced { .. }), "{err}");
    assert!(err.to_string().contains("inserting outbox rows"), "{err}");
    assert_eq!(sc.pending().await.unwrap().0, before);
    let p = sc
        .progress("contract", "in-process", 2)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(p.position, pg_lsn(10).numeric());

    let good = batch(
        Some(pg_lsn(10).numeric()),
        pg_lsn(11).numeric(),
        pg_lsn(11),
        10,
        3,
    );
    sc.commit(&good).await.unwrap();
    let p = sc
        .progress("contract", "in-process", 2)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(p.position, pg_lsn(11).numeric());
    assert_eq!(sc.pending().await.unwrap().0, before + 2);
}
