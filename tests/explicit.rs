//! `skein explicit` and `extractor.initial_load` (issue 12), against a
//! real PostgreSQL and the real `skein` binary, over the transport
//! `SKEIN_TEST_TRANSPORT` names.

mod common;

use common::*;
use serde_json::Value;

fn same(y: String) -> String {
    y
}

/// `skein explicit` with `args`, run to its end (it waits until the
/// appliers published every key); returns its standard output.
fn explicit(env: &Env, args: &[&str]) -> String {
    let mut all = vec!["explicit", "--entity", "customer"];
    all.extend_from_slice(args);
    env.skein_ok(&all)
}

/// The `customer.N` subject's events, in order.
fn of(events: &[Value], id: i32) -> Vec<&Value> {
    let s = format!("customer.{id}");
    events
        .iter()
        .filter(|e| e["subject"] == s.as_str())
        .collect()
}

/// `"<subject> <action>"` of the sink's events from the `from`-th on,
/// sorted: partitions publish independently, so only per-aggregate order
/// holds across them.
fn actions_from(env: &Env, from: usize) -> Vec<String> {
    let mut a = env.subject_actions().split_off(from);
    a.sort();
    a
}

async fn customers(env: &Env, ids: std::ops::RangeInclusive<i32>, name: &str) {
    env.exec(&format!(
        "INSERT INTO customer (id, name) SELECT g, '{name}' || g FROM generate_series({}, {}) g",
        ids.start(),
        ids.end()
    ))
    .await;
}

/// Aggregates that existed before skein started publish nothing until
/// they change; `skein explicit` publishes them by key, by filter or all
/// of them, with nTangle's Explicit semantics: a key with no version is a
/// create, an unchanged one publishes nothing unless `--republish`, and a
/// key whose root is gone is a delete where a version exists.
#[tokio::test(flavor = "multi_thread")]
async fn explicit_publishes_by_key_filter_and_entity_with_ntangle_semantics() {
    let env = Env::new("explicit_semantics", same).await;
    customers(&env, 1..=6, "Ada").await;
    env.exec("UPDATE customer SET name = 'Bob' || id WHERE id IN (4, 5)")
        .await;
    env.exec("INSERT INTO address VALUES (10, 1, 'home', 'Oslo')")
        .await;
    let mut run = env.start().await;
    env.settle(&mut run).await;
    assert!(env.events().is_empty(), "{:?}", env.subjects());

    // By key: creates, with the children; a key that does not exist (99)
    // and never published publishes nothing.
    let out = explicit(&env, &["--keys", "1,2,99"]);
    assert!(out.contains("3 keys queued, all published"), "{out}");
    env.settle(&mut run).await;
    let events = env.events();
    assert_eq!(
        actions_from(&env, 0),
        ["customer.1 created", "customer.2 created"],
        "{events:#?}"
    );
    assert_eq!(of(&events, 1)[0]["data"]["addresses"][0]["city"], "Oslo");

    // Again: unchanged, nothing; with --republish, the same content again.
    explicit(&env, &["--keys", "1"]);
    env.settle(&mut run).await;
    assert_eq!(env.events().len(), 2);
    explicit(&env, &["--keys", "1", "--republish"]);
    env.settle(&mut run).await;
    let events = env.events();
    let one = of(&events, 1);
    assert_eq!(one.len(), 2, "{one:#?}");
    assert_eq!(one[1]["action"], "updated");
    assert_eq!(one[0]["etag"], one[1]["etag"]);

    // By filter on the root.
    explicit(&env, &["--where", "name LIKE 'Bob%'"]);
    env.settle(&mut run).await;
    assert_eq!(
        actions_from(&env, 3),
        ["customer.4 created", "customer.5 created"]
    );

    // All of the entity: the ones not yet published (3, 6) are created.
    explicit(&env, &[]);
    env.settle(&mut run).await;
    assert_eq!(
        actions_from(&env, 5),
        ["customer.3 created", "customer.6 created"]
    );

    // A root deleted while its change was skipped (a marker reset past it):
    // the stream never says; an explicit run of its key publishes the
    // delete, once.
    run.stop(&env);
    env.exec("DELETE FROM customer WHERE id = 2").await;
    env.skein_ok(&["marker", "reset", "--latest", "--continue-with-data-loss"]);
    let mut run = env.start().await;
    env.settle(&mut run).await;
    assert!(of(&env.events(), 2).len() == 1, "the delete was skipped");
    explicit(&env, &["--keys", "2"]);
    explicit(&env, &["--keys", "2"]);
    env.settle(&mut run).await;
    let events = env.events();
    let two = of(&events, 2);
    assert_eq!(two.len(), 2, "{two:#?}");
    assert_eq!(two[1]["action"], "deleted");
    assert_eq!(two[1]["data"], serde_json::json!({"id": 2}));
    // Exactly once, but for the one republish asked for (customer.1).
    let not_one = |v: Vec<Value>| -> Vec<Value> {
        v.into_iter()
            .filter(|e| e["subject"] != "customer.1")
            .collect()
    };
    assert_exactly_once_in(&not_one(env.outbox().await), &not_one(env.events()));

    // What `skein status` says of the last run.
    let status: Value = serde_json::from_str(&env.skein_ok(&["status"])).unwrap();
    let last = &status["explicit"][0];
    assert_eq!(last["queued"], 1, "{status}");
    assert_eq!(last["pending"], 0, "{status}");
    assert_eq!(last["finished"], true, "{status}");
    run.stop(&env);
}
