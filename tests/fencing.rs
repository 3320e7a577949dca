//! Two appliers of one partition against the real sidecar and source,
//! driven step by step: what the fence lets through when a fenced applier
//! carries on beside the partition's new owner.

mod common;

use common::*;
use skein_applier::run::connect;
use skein_common::config::expand_env;
use skein_common::record::{partition_for, transport_key, Op};
use skein_common::{
    ChangePosition, ChangeRecord, Checkpoint, CheckpointKind, Config, Dialect, PgLsn, RootKey,
    SourcePosition,
};
use skein_transporter::Delivery;

/// The env's config as the binary reads it.
fn config(env: &Env) -> Config {
    let text = std::fs::read_to_string(&env.config).unwrap();
    let text = expand_env(&text, "skein.yaml", |n| match n {
        "SKEIN_SOURCE_URL" => Some(env.url.clone()),
        "SKEIN_OUT_DIR" => Some(env.dir.display().to_string()),
        _ => std::env::var(n).ok(),
    })
    .unwrap();
    Config::from_yaml(&text, "skein.yaml").unwrap()
}

/// Runs `sql` in one source transaction; returns its transaction id.
async fn change(env: &Env, sql: &str) -> u64 {
    env.db.batch_execute("BEGIN").await.unwrap();
    env.db.batch_execute(sql).await.unwrap();
    let xid: i64 = env
        .db
        .query_one("SELECT txid_current()", &[])
        .await
        .unwrap()
        .get(0);
    env.db.batch_execute("COMMIT").await.unwrap();
    xid as u64
}

/// An in-process delivery `n` of one update record of customer `id`.
fn delivery(partition: u32, n: u64, id: &str, xid: u64) -> Delivery {
    let at = |n: u64| Checkpoint::Source(SourcePosition::Pg(PgLsn(n)));
    Delivery {
        partition,
        lower: at(n * 100 - 100),
        upper: at(n * 100),
        has_data_loss: false,
        records: vec![ChangeRecord {
            entity: "customer".into(),
            root_key: RootKey(vec![Some(id.into())]),
            table: "customer".into(),
            op: Op::Update,
            position: ChangePosition {
                commit: PgLsn(n * 100).into(),
                seq: 0,
            },
            tx_id: xid,
            commit_time_micros: 0,
        }],
        dead_letters: 0,
    }
}

/// Applies `d` as `skein_applier::run` does: a fence re-seeks (the
/// delivery comes again from the stored progress; here, the same one).
async fn apply_as_the_run_loop(
    a: &mut skein_applier::apply::Applier<skein_applier::sidecar::AnySidecar>,
    d: &Delivery,
) {
    for _ in 0..2 {
        match a.apply(d).await {
            Ok(_) => return,
            Err(skein_applier::Error::Fenced { .. }) => {
                a.fenced();
                a.checkpoint().await.unwrap();
            }
            Err(e) => panic!("{e}"),
        }
    }
    panic!("fenced twice in a row");
}

/// An applier fenced by the partition's new owner must not carry on beside
/// it on what it remembers: the owner may publish without moving the
/// position (an explicit run), and a stored version the fenced one never
/// saw would make it take a real change for no change.
///
/// A publishes customer 1 as E1; B takes the partition (a rolling restart,
/// a zombie's successor); A's next commit is fenced, it re-seeks and
/// applies on; B publishes E2 by an explicit run; the source goes back to
/// E1 and A applies that change. Consumers must end on E1, the source's
/// state.
#[tokio::test(flavor = "multi_thread")]
async fn a_fenced_applier_does_not_carry_on_beside_the_new_owner() {
    let env = Env::new("fenced_beside", |y| y).await;
    env.skein_ok(&["sidecar", "migrate"]);
    let cfg = config(&env);
    let catalog = skein_extractor::load_catalog(&cfg).await.unwrap();
    let key = RootKey(vec![Some("1".into())]);
    let p = partition_for(&transport_key("customer", &key), cfg.transport.partitions());
    let kind = CheckpointKind::Source(Dialect::Postgres);
    let topic = "in-process";

    let mut a = connect(&cfg, &catalog, topic, p, kind).await.unwrap();
    let x = change(&env, "INSERT INTO customer (id, name) VALUES (1, 'E1')").await;
    let done = a.apply(&delivery(p, 1, "1", x)).await.unwrap();
    assert_eq!(done.events, 1);

    // B takes the partition over.
    let mut b = connect(&cfg, &catalog, topic, p, kind).await.unwrap();
    b.progress().await.unwrap();

    // A's next commit is fenced; it re-seeks, as the run loop does.
    let x = change(&env, "UPDATE customer SET email = NULL WHERE id = 1").await;
    let fenced = a.apply(&delivery(p, 2, "1", x)).await;
    assert!(
        matches!(fenced, Err(skein_applier::Error::Fenced { .. })),
        "{fenced:?}"
    );
    a.fenced();
    a.checkpoint().await.unwrap();
    // A goes on applying the partition's records (it has its stored
    // version in mind again after this).
    let x = change(&env, "UPDATE customer SET email = NULL WHERE id = 1").await;
    apply_as_the_run_loop(&mut a, &delivery(p, 3, "1", x)).await;

    // B publishes E2 by an explicit run (the position does not move).
    change(&env, "UPDATE customer SET name = 'E2' WHERE id = 1").await;
    env.skein_ok(&[
        "explicit",
        "--entity",
        "customer",
        "--keys",
        "1",
        "--no-wait",
    ]);
    // Fenced or not, whatever B committed is in the outbox below.
    // B was fenced by A's commit meanwhile: it re-seeks and publishes.
    let mut published = false;
    for _ in 0..2 {
        match b.explicit_once().await {
            Ok(done) => {
                published = done.events == 1;
                break;
            }
            Err(skein_applier::Error::Fenced { .. }) => {
                b.fenced();
                b.checkpoint().await.unwrap();
            }
            Err(e) => panic!("{e}"),
        }
    }
    assert!(published, "B published E2");

    // Back to E1: A applies that change.
    let x = change(&env, "UPDATE customer SET name = 'E1' WHERE id = 1").await;
    apply_as_the_run_loop(&mut a, &delivery(p, 4, "1", x)).await;

    let outbox = env.outbox().await;
    let last = outbox
        .iter()
        .rev()
        .find(|e| e["subject"] == "customer.1")
        .expect("an event of customer 1");
    assert_eq!(
        last["data"]["name"], "E1",
        "consumers' last state of customer 1 is not the source's: {outbox:#?}"
    );
}
