//! The `Sidecar` contract, run against every implementation: PostgreSQL
//! (the real server `scripts/test` starts) and SQL Server (only with
//! `SKEIN_TEST_MSSQL_URL`; ignored otherwise, never run here).
//!
//! The contract: `migrate` is idempotent; `commit` writes the batch row,
//! outbox rows, versions and progress atomically, and only when progress
//! still holds the expected value (fencing) — a fenced commit writes
//! nothing; progress reads back exactly, source positions of either
//! dialect included; the relay sends outbox rows once, in id order.

mod common;

use std::sync::{Arc, Mutex};

use common::{admin_url, connect, recreate_db};
use skein_applier::relay::{relay_once, RelayScope};
use skein_applier::sidecar::{AnySidecar, BatchCommit, OutboxRow, Sidecar, VersionRow};
use skein_applier::sink::{Sink, SinkEvent};
use skein_applier::Error;
use skein_common::config::Secret;
use skein_common::{ChangePosition, PgLsn, SourcePosition, SqlServerLsn};

/// Collects what the relay sends.
#[derive(Clone, Default)]
struct Collect(Arc<Mutex<Vec<SinkEvent>>>);

impl Sink for Collect {
    fn send(&mut self, events: &[SinkEvent]) -> skein_applier::Result<()> {
        self.0.lock().unwrap().extend_from_slice(events);
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
        expected,
        position,
        source: Some(ChangePosition {
            commit: source,
            seq: 7,
        }),
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

async fn relay_all(sidecar: &mut AnySidecar) -> Vec<String> {
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

async fn contract(mut sc: AnySidecar, source: impl Fn(u8) -> SourcePosition) {
    sc.migrate().await.unwrap();
    sc.migrate().await.unwrap();
    assert_eq!(
        sc.progress("contract", "in-process", 2).await.unwrap(),
        None
    );

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
        Err(Error::Fenced { found, .. }) => assert_eq!(found, Some(source(10).numeric())),
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

    // Exactly the events of the two committed batches, in order, once.
    let sent = relay_all(&mut sc).await;
    assert_eq!(
        sent,
        vec!["{\"n\":1}", "{\"n\":2}", "{\"n\":3}", "{\"n\":4}"]
    );
    assert!(relay_all(&mut sc).await.is_empty(), "nothing is sent twice");
    let (pending, _) = sc.pending().await.unwrap();
    assert_eq!(pending, 0);
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

async fn pg_sidecar(db: &str) -> AnySidecar {
    let admin = connect(&admin_url()).await;
    recreate_db(&admin, db).await;
    let url = format!("{}/{db}", admin_url().rsplit_once('/').unwrap().0);
    AnySidecar::connect(&Secret::new(url), "skein")
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn postgres_sidecar_keeps_the_contract() {
    contract(pg_sidecar("skein_t_contract_pg").await, pg_lsn).await;
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
    let mut master = skein_common::mssql::MssqlClient::connect(&base)
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
    let sc = AnySidecar::connect(&Secret::new(url), "skein")
        .await
        .unwrap();
    assert!(matches!(sc, AnySidecar::SqlServer(_)));
    contract(sc, ms_lsn).await;
}
