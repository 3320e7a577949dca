//! `skein explicit` and `extractor.initial_load` (issue 12), against a
//! real PostgreSQL and the real `skein` binary, over the transport
//! `SKEIN_TEST_TRANSPORT` names.

mod common;

use std::collections::HashMap;
use std::time::{Duration, Instant};

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
    // The key as the source prints it, whatever was typed (from the review:
    // `01` once published a `customer.01` of its own).
    explicit(&env, &["--keys", "01, +1"]);
    env.settle(&mut run).await;
    assert_eq!(env.events().len(), 2, "{:?}", env.subjects());
    let bad = env.skein(&["explicit", "--entity", "customer", "--keys", "x"]);
    assert!(!bad.status.success());
    assert!(
        String::from_utf8_lossy(&bad.stderr).contains("as keys of public.customer"),
        "{}",
        String::from_utf8_lossy(&bad.stderr)
    );
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

/// The explicit run of `skein status` with this id.
fn run_status(env: &Env, id: i64) -> Value {
    let status: Value = serde_json::from_str(&env.skein_ok(&["status"])).unwrap();
    status["explicit"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["id"] == id)
        .cloned()
        .unwrap_or_else(|| panic!("run {id} not in {status}"))
}

/// Waits until explicit run `id` is finished (every key published).
async fn wait_finished(env: &Env, run: &mut Running, id: i64) {
    let t0 = Instant::now();
    loop {
        run.check_alive(env);
        let r = run_status(env, id);
        if r["finished"] == true {
            return;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "{r}\n{}",
            env.log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn small_batches(y: String) -> String {
    y + "extractor:\n  max_batch_changes: 5\n"
}

/// Killed halfway, twice: the command after its second chunk (the run
/// resumes after its cursor when the same command runs again), and the
/// pipeline after its second explicit batch (the queue keeps what is not
/// published). Every aggregate is published once per run, never twice.
#[tokio::test(flavor = "multi_thread")]
async fn an_explicit_run_killed_halfway_resumes_where_it_stopped() {
    let env = Env::new("explicit_resume", small_batches).await;
    customers(&env, 1..=50, "Ada").await;
    let mut run = env.start().await;

    // The command dies after queueing two chunks of ten.
    let out = env
        .command(&["explicit", "--entity", "customer", "--chunk", "10"])
        .env("SKEIN_FAILPOINT", "explicit.after_chunk:2")
        .output()
        .unwrap();
    assert!(!out.status.success(), "the failpoint did not fire");
    let r = run_status(&env, 1);
    assert_eq!(
        (r["state"].as_str(), r["queued"].as_i64()),
        (Some("selecting"), Some(20)),
        "{r}"
    );
    // What was queued is published meanwhile; the run is not finished.
    let t0 = Instant::now();
    while run_status(&env, 1)["pending"] != 0 {
        assert!(t0.elapsed() < Duration::from_secs(60));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(run_status(&env, 1)["finished"], false);
    // Published is in the outbox; the relay sends it on its own poll (over
    // Kafka, the appliers' relays): wait for the sink to hold it.
    let t0 = Instant::now();
    while env.events().len() < 20 {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "{} of 20 published events reached the sink",
            env.events().len()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(env.events().len(), 20);
    let out = env
        .command(&["explicit", "--entity", "customer", "--chunk", "10"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("resuming the unfinished explicit run"),
        "{err}"
    );
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("explicit run 1: 50 keys queued"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    env.settle(&mut run).await;
    let events = env.events();
    for id in 1..=50 {
        assert_eq!(of(&events, id).len(), 1, "customer.{id}: {events:#?}");
    }

    // The pipeline dies after its second explicit batch (pages of five).
    run.stop(&env);
    let run = env
        .start_with(&[("SKEIN_FAILPOINT", "applier.after_sidecar:2")])
        .await;
    env.skein_ok(&[
        "explicit",
        "--entity",
        "customer",
        "--republish",
        "--no-wait",
    ]);
    let status = run.wait_exit(Duration::from_secs(60));
    assert!(!status.success());
    let r = run_status(&env, 2);
    assert_eq!(r["queued"], 50, "{r}");
    // Two pages of five at least; each partition commits its own pages,
    // and commits of other partitions already under way when the second
    // one aborts the process land too (a CI run saw four pages).
    let pending = r["pending"].as_i64().unwrap();
    assert!(
        (30..=40).contains(&pending) && pending % 5 == 0,
        "two to four pages of five were published: {r}"
    );
    let mut run = env.start().await;
    wait_finished(&env, &mut run, 2).await;
    env.settle(&mut run).await;
    let events = env.events();
    for id in 1..=50 {
        let mine = of(&events, id);
        assert_eq!(mine.len(), 2, "customer.{id}: {mine:#?}");
        assert_eq!(mine[1]["action"], "updated");
    }
    run.stop(&env);
}

/// The current state of every customer: name and address cities, sorted.
async fn state(env: &Env) -> HashMap<i32, (String, Vec<String>)> {
    let mut out: HashMap<i32, (String, Vec<String>)> = HashMap::new();
    for r in env
        .db
        .query("SELECT id, name FROM customer", &[])
        .await
        .unwrap()
    {
        out.insert(r.get(0), (r.get(1), vec![]));
    }
    for r in env
        .db
        .query("SELECT customer_id, city FROM address ORDER BY city", &[])
        .await
        .unwrap()
    {
        let id: Option<i32> = r.get(0);
        if let Some(c) = id.and_then(|i| out.get_mut(&i)) {
            c.1.push(r.get(1));
        }
    }
    out
}

/// The newest workload statement an event's state shows (0: none).
fn counter(e: &Value) -> u64 {
    let of = |s: &str, prefixes: &[&str]| -> u64 {
        prefixes
            .iter()
            .find_map(|p| s.strip_prefix(p).and_then(|n| n.parse().ok()))
            .unwrap_or(0)
    };
    let name = of(
        e["data"]["name"].as_str().unwrap_or(""),
        &["New", "Re", "N"],
    );
    let cities = e["data"]["addresses"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|x| of(x["city"].as_str().unwrap_or(""), &["C"]))
                .max()
                .unwrap_or(0)
        })
        .unwrap_or(0);
    name.max(cities)
}

/// An explicit run beside a live workload that keeps changing the same
/// aggregates: when both are done, every aggregate's last event is its
/// state (a stale state never overwrites a newer event), and a further
/// explicit run finds nothing to publish.
#[tokio::test(flavor = "multi_thread")]
async fn an_explicit_run_beside_a_live_workload_ends_with_every_last_event_equal_to_state() {
    let env = Env::new("explicit_live", |y| {
        y + "extractor:\n  max_batch_changes: 20\n"
    })
    .await;
    customers(&env, 1..=300, "Ada").await;
    env.exec("INSERT INTO address SELECT g, g, 'home', 'City' || g FROM generate_series(1, 300) g")
        .await;
    let mut run = env.start().await;
    let url = env.url.clone();
    let workload = tokio::spawn(async move {
        let db = connect(&url).await;
        let t0 = Instant::now();
        let mut i: i32 = 0;
        while t0.elapsed() < Duration::from_secs(8) {
            i += 1;
            let id = (i * 37) % 330 + 1;
            let sql = match i % 5 {
                0 => format!("UPDATE address SET city = 'C{i}' WHERE customer_id = {id}"),
                1 => format!("DELETE FROM address WHERE customer_id = {id}; DELETE FROM customer WHERE id = {id}"),
                2 => format!("INSERT INTO customer (id, name) VALUES ({id}, 'New{i}') ON CONFLICT (id) DO UPDATE SET name = 'Re{i}'"),
                _ => format!("UPDATE customer SET name = 'N{i}' WHERE id = {id}"),
            };
            db.batch_execute(&format!("BEGIN; {sql}; COMMIT;"))
                .await
                .unwrap();
        }
        i
    });
    // Republish everything, in small chunks and pages, while it runs.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let out = env
        .command(&[
            "explicit",
            "--entity",
            "customer",
            "--republish",
            "--chunk",
            "15",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let statements = workload.await.unwrap();
    assert!(statements > 100, "the workload ran {statements} statements");
    env.settle(&mut run).await;

    let state = state(&env).await;
    let events = env.events();
    let mut last: HashMap<i32, &Value> = HashMap::new();
    for e in &events {
        let id: i32 = e["key"].as_str().unwrap().parse().unwrap();
        last.insert(id, e);
    }
    for id in 1..=330 {
        match (state.get(&id), last.get(&id)) {
            (Some((name, cities)), Some(e)) => {
                assert_ne!(e["action"], "deleted", "customer.{id} exists: {e}");
                assert_eq!(e["data"]["name"], name.as_str(), "customer.{id}: {e}");
                let got: Vec<&str> = e["data"]["addresses"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|a| a["city"].as_str().unwrap())
                    .collect();
                assert_eq!(got, *cities, "customer.{id}: {e}");
            }
            (Some(s), None) => panic!("customer.{id} ({s:?}) was never published"),
            (None, Some(e)) => assert_eq!(e["action"], "deleted", "customer.{id} is gone: {e}"),
            (None, None) => {}
        }
    }
    // No event carries an older state than the one before it: every
    // workload statement writes its counter into the names and cities, so
    // the newest counter an aggregate's events show never goes down (a
    // stale event in the middle would, even when a later one repairs it).
    for id in 1..=330 {
        let mut newest = 0;
        for e in of(&events, id) {
            if e["action"] == "deleted" {
                continue;
            }
            let n = counter(e);
            assert!(
                n >= newest,
                "customer.{id}: an event of statement {n} after one of {newest}: {e}"
            );
            newest = n;
        }
    }
    // Versions are the state: nothing more to publish.
    let before = events.len();
    explicit(&env, &[]);
    env.settle(&mut run).await;
    assert_eq!(env.events().len(), before);
    run.stop(&env);
}

/// `extractor.initial_load: true`: the very first start publishes every
/// aggregate that already exists (100,000 of them), beside the stream,
/// each once; a change made during the load ends as its last event.
#[tokio::test(flavor = "multi_thread")]
async fn the_initial_load_publishes_every_existing_aggregate_once() {
    let env = Env::new("explicit_initial", |y| {
        y + "extractor:\n  initial_load: true\n"
    })
    .await;
    customers(&env, 1..=100_000, "Ada").await;
    let mut run = env.start().await;
    env.exec("UPDATE customer SET name = 'Changed' WHERE id IN (7, 99999); INSERT INTO customer (id, name) VALUES (100001, 'Late')")
        .await;
    let t0 = Instant::now();
    loop {
        run.check_alive(&env);
        let status: Value = serde_json::from_str(&env.skein_ok(&["status"])).unwrap();
        let runs = status["explicit"].as_array().unwrap();
        if runs.len() == 1 && runs[0]["finished"] == true {
            assert_eq!(runs[0]["initial"], true, "{status}");
            // 100,001 when the load's selection came after the late insert.
            let queued = runs[0]["queued"].as_i64().unwrap();
            assert!((100_000..=100_001).contains(&queued), "{status}");
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(600), "{status}");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    env.settle_within(&mut run, Duration::from_secs(300)).await;
    let events = env.events();
    let mut per: HashMap<String, Vec<&Value>> = HashMap::new();
    for e in &events {
        per.entry(e["key"].as_str().unwrap().to_string())
            .or_default()
            .push(e);
    }
    assert_eq!(per.len(), 100_001);
    for (k, es) in &per {
        let changed = ["7", "99999"].contains(&k.as_str());
        // A changed one may publish twice (the load's read and the change's),
        // never with the same content; its last event is the change.
        assert!(es.len() == 1 || changed && es.len() == 2, "{k}: {es:#?}");
        // (The stream may reach a changed one first: an update of an
        // aggregate never published is an `updated`, as ever.)
        assert!(changed || es[0]["action"] == "created", "{k}: {es:#?}");
        if changed {
            assert_eq!(es.last().unwrap()["data"]["name"], "Changed");
        }
    }
    // A restart is no first start: nothing is loaded again.
    run.stop(&env);
    let mut run = env.start().await;
    env.settle(&mut run).await;
    assert_eq!(env.events().len(), events.len());
    let status: Value = serde_json::from_str(&env.skein_ok(&["status"])).unwrap();
    assert_eq!(status["explicit"].as_array().unwrap().len(), 1, "{status}");
    run.stop(&env);
}

/// From the review: an explicit batch on a partition that never committed
/// (no progress row) leaves no progress behind; the stream's first commit
/// after it is no fence, and the pipeline goes on.
#[tokio::test(flavor = "multi_thread")]
async fn an_explicit_batch_before_a_partition_s_first_commit_leaves_no_progress_behind() {
    let env = Env::new("explicit_first", same).await;
    customers(&env, 1..=8, "Ada").await;
    let mut run = env.start().await;
    explicit(&env, &["--keys", "1,2,3,4,5,6,7,8"]);
    env.exec("UPDATE customer SET name = 'Changed' || id").await;
    env.settle(&mut run).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    run.check_alive(&env);
    let events = env.events();
    for id in 1..=8 {
        let mine = of(&events, id);
        assert_eq!(mine.len(), 2, "customer.{id}: {mine:#?}");
        assert_eq!(mine[1]["data"]["name"], format!("Changed{id}"));
    }
    assert!(!env.log().contains("fenced"), "{}", env.log());
    run.stop(&env);
}

/// From the review: keys queued, then `transport.partitions` changed
/// before they were published: each is moved to the partition that now
/// owns its aggregate and published there, none stranded.
#[tokio::test(flavor = "multi_thread")]
async fn keys_queued_before_a_partition_count_change_are_published_by_their_new_owner() {
    let env = Env::new("explicit_repartition", same).await;
    if env.is_kafka() {
        // Over Kafka the partition count is the topic's; not changed here.
        return;
    }
    customers(&env, 1..=8, "Ada").await;
    let run = env.start().await;
    run.stop(&env);
    env.skein_ok(&["explicit", "--entity", "customer", "--no-wait"]);
    let yaml = std::fs::read_to_string(&env.config).unwrap();
    std::fs::write(&env.config, yaml.replace("partitions: 4", "partitions: 3")).unwrap();
    let mut run = env.start().await;
    wait_finished(&env, &mut run, 1).await;
    env.settle(&mut run).await;
    let events = env.events();
    for id in 1..=8 {
        assert_eq!(of(&events, id).len(), 1, "customer.{id}: {events:#?}");
    }
    run.stop(&env);
}

/// From the review: keys queued for an entity that is then removed from
/// the config are dropped with a warning; the pipeline goes on and the
/// run ends.
#[tokio::test(flavor = "multi_thread")]
async fn keys_of_an_entity_no_longer_configured_are_dropped_not_a_wedge() {
    let env = Env::new("explicit_gone_entity", same).await;
    customers(&env, 1..=3, "Ada").await;
    let run = env.start().await;
    run.stop(&env);
    env.skein_ok(&["explicit", "--entity", "customer", "--no-wait"]);
    let yaml = std::fs::read_to_string(&env.config).unwrap();
    std::fs::write(
        &env.config,
        yaml.replace("  - name: customer\n", "  - name: client\n"),
    )
    .unwrap();
    let mut run = env.start().await;
    wait_finished(&env, &mut run, 1).await;
    env.step(&mut run, "UPDATE customer SET name = 'x' WHERE id = 1")
        .await;
    run.check_alive(&env);
    assert!(
        env.log().contains("no longer in the config is dropped"),
        "{}",
        env.log()
    );
    assert_eq!(env.subject_actions(), ["client.1 updated"]);
    run.stop(&env);
}
