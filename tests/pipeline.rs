//! nTangle's scenarios, adapted, against a real PostgreSQL and the real
//! `skein` binary (in-process transport). Each test has its own database,
//! slot and working directory, so they run in parallel.
//!
//! Batches are time-based, so a scenario that needs changes in *one* batch
//! puts them in one transaction; one that needs them in *separate* batches
//! waits for the pipeline to settle in between.

mod common;

use std::time::Duration;

use common::*;

fn same(y: String) -> String {
    y
}

#[tokio::test(flavor = "multi_thread")]
async fn no_changes_publishes_nothing() {
    let env = Env::new("no_changes", same).await;
    let mut run = env.start().await;
    env.settle(&mut run).await;
    // A transaction that touches nothing tracked.
    env.step(
        &mut run,
        "CREATE TABLE unrelated (id int); INSERT INTO unrelated VALUES (1);",
    )
    .await;
    run.stop(&env);
    assert!(env.events().is_empty(), "{:?}", env.events());
}

#[tokio::test(flavor = "multi_thread")]
async fn multiple_changes_in_one_batch_publish_one_create() {
    let env = Env::new("multiple_changes", same).await;
    let mut run = env.start().await;
    env.exec(
        "BEGIN;
         INSERT INTO customer (id, name, email) VALUES (1, 'Ada', 'a@x');
         UPDATE customer SET name = 'Ada L.' WHERE id = 1;
         INSERT INTO address (id, customer_id, kind, city) VALUES (10, 1, 'home', 'London');
         INSERT INTO contact VALUES (1, 'phone', '1'), (1, 'mail', 'a@x');
         COMMIT;",
    )
    .await;
    env.settle(&mut run).await;
    run.stop(&env);
    assert_golden("multiple_changes", &env.events());
    assert_exactly_once(&env).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn update_then_delete_and_create_update_then_delete() {
    let env = Env::new("update_then_delete", same).await;
    let mut run = env.start().await;
    env.step(
        &mut run,
        "INSERT INTO customer (id, name) VALUES (1, 'Ada');",
    )
    .await;
    // UpdateThenDelete: the stored version exists.
    env.exec("BEGIN; UPDATE customer SET name = 'x' WHERE id = 1; DELETE FROM customer WHERE id = 1; COMMIT;")
        .await;
    // CreateUpdateThenDelete: never published before, the delete still is.
    env.exec(
        "BEGIN; INSERT INTO customer (id, name) VALUES (2, 'Bob'); UPDATE customer SET name = 'B' WHERE id = 2;
         DELETE FROM customer WHERE id = 2; COMMIT;",
    )
    .await;
    env.settle(&mut run).await;
    run.stop(&env);
    assert_golden("update_then_delete", &env.events());
    assert_exactly_once(&env).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn create_update_with_upcoming_delete_publishes_only_the_delete() {
    let env = Env::stopped_with_batches_of("upcoming_delete", 2).await;
    // While stopped: batch 1 will hold insert+update, batch 2 the delete.
    env.exec("BEGIN; INSERT INTO customer (id, name) VALUES (1, 'Ada'); UPDATE customer SET name = 'A' WHERE id = 1; COMMIT;")
        .await;
    env.exec("DELETE FROM customer WHERE id = 1;").await;
    let mut run = env.start().await;
    env.settle(&mut run).await;
    run.stop(&env);
    assert_golden("upcoming_delete", &env.events());
    let batches = extractor_batches(&env).await;
    assert_eq!(
        batches, 2,
        "the cap must split the backlog into two batches"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn same_version_and_excluded_row_version_publish_nothing() {
    let env = Env::new("same_version", same).await;
    let mut run = env.start().await;
    env.step(&mut run, "INSERT INTO customer (id, name) VALUES (1, 'Ada'); INSERT INTO address VALUES (10, 1, 'home', 'London');").await;
    env.exec("UPDATE customer SET name = name WHERE id = 1;")
        .await;
    env.exec("UPDATE customer SET row_version = row_version + 1 WHERE id = 1;")
        .await;
    env.step(
        &mut run,
        "UPDATE address SET city = 'London' WHERE id = 10;",
    )
    .await;
    env.step(&mut run, "UPDATE address SET city = 'Paris' WHERE id = 10;")
        .await;
    run.stop(&env);
    assert_golden("same_version", &env.events());
    assert_exactly_once(&env).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn logical_delete_publishes_delete_then_create_on_undelete() {
    let env = Env::new("logical_delete", same).await;
    let mut run = env.start().await;
    env.step(
        &mut run,
        "INSERT INTO customer (id, name, email) VALUES (1, 'Ada', 'a@x');",
    )
    .await;
    env.step(
        &mut run,
        "UPDATE customer SET is_deleted = true WHERE id = 1;",
    )
    .await;
    env.step(&mut run, "UPDATE customer SET email = 'b@x' WHERE id = 1;")
        .await; // still deleted: nothing
    env.step(
        &mut run,
        "UPDATE customer SET is_deleted = false WHERE id = 1;",
    )
    .await;
    run.stop(&env);
    assert_golden("logical_delete", &env.events());
    assert_exactly_once(&env).await;
}

/// Children whose root does not exist (no foreign key holds them) are
/// never published: a deleted root stays deleted while its children
/// change, a child of a root not yet created publishes nothing, and both
/// show once their root exists.
#[tokio::test(flavor = "multi_thread")]
async fn children_of_a_missing_root_publish_nothing_until_it_exists() {
    let env = Env::new("orphans", same).await;
    let mut run = env.start().await;
    let steps = [
        "INSERT INTO customer (id, name) VALUES (1, 'Ada');",
        "INSERT INTO address VALUES (10, 1, 'home', 'London');",
        "INSERT INTO address_line VALUES (10, 1, 'line one');",
        "INSERT INTO contact VALUES (1, 'email', 'a@x');",
        "DELETE FROM customer WHERE id = 1;",
        "UPDATE address SET city = 'Paris' WHERE id = 10;",
        "UPDATE address_line SET text = 'line 1' WHERE address_id = 10;",
        "INSERT INTO contact VALUES (7, 'phone', '+1');",
        "INSERT INTO customer (id, name) VALUES (7, 'Grace');",
        "INSERT INTO customer (id, name) VALUES (1, 'Ada again');",
    ];
    for s in steps {
        env.step(&mut run, s).await;
    }
    run.stop(&env);
    assert_golden("orphans", &env.events());
    assert_exactly_once(&env).await;
}

/// The quickstart workload one statement at a time: grandchild change, a
/// child moved between roots, a root key update, NULL join columns.
#[tokio::test(flavor = "multi_thread")]
async fn children_grandchildren_moves_and_key_updates() {
    let env = Env::new("relations", same).await;
    let mut run = env.start().await;
    let steps = [
        "INSERT INTO customer (id, name) VALUES (1, 'Ada'), (2, 'Grace');",
        "INSERT INTO address VALUES (10, 1, 'home', 'London');",
        "INSERT INTO address_line VALUES (10, 1, 'line one');",
        "UPDATE address_line SET text = 'line 1' WHERE address_id = 10;",
        "UPDATE address SET customer_id = 2 WHERE id = 10;",
        "UPDATE address SET customer_id = NULL WHERE id = 10;",
        "INSERT INTO address_line VALUES (10, 2, 'orphan line');",
        "UPDATE customer SET id = 3 WHERE id = 1;",
        "DELETE FROM address WHERE id = 10;",
    ];
    for s in steps {
        env.step(&mut run, s).await;
    }
    run.stop(&env);
    assert_golden("relations", &env.events());
    assert_exactly_once(&env).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn column_types_round_trip_with_stable_formats() {
    let env = typed_env().await;
    let mut run = env.start().await;
    env.exec(
        "INSERT INTO typed VALUES (1, 'k-ü', 9007199254740993, 12345.678900, 'héllo \"wörld\" ✓', true,
           '2024-02-29T23:59:59.123456+02:00', '2024-02-29', 'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11',
           '\\x00ff10', '{\"b\": [1, 2], \"a\": null}', NULL, 1.5);",
    )
    .await;
    env.settle(&mut run).await;
    env.step(&mut run, "DELETE FROM typed;").await;
    run.stop(&env);
    assert_golden("types", &env.events());
}

/// Columns whose JSON is the same text built as `json` or as `jsonb`
/// (no float, no json column): the hydration query builds their object as
/// `json`, cheaper than `jsonb`, and the events and etags must stay those
/// the `jsonb` query gave (the golden was recorded with it): a change there
/// would publish every such aggregate again after an upgrade.
#[tokio::test(flavor = "multi_thread")]
async fn json_safe_column_types_keep_their_events_and_etags() {
    let admin = connect(&admin_url()).await;
    recreate_db(&admin, "skein_t_safe_types").await;
    let url = format!(
        "{}/skein_t_safe_types",
        admin_url().rsplit_once('/').unwrap().0
    );
    let db = connect(&url).await;
    db.batch_execute(
        "CREATE TYPE mood AS ENUM ('calm', 'wild');
         CREATE DOMAIN score AS int CHECK (VALUE >= 0);
         CREATE DOMAIN yes AS boolean;
         CREATE TABLE safe (id int PRIMARY KEY, small smallint, big bigint, neg bigint, amount numeric(20,6),
           note text, label varchar(20), fixed char(5), flag boolean, at timestamptz, local timestamp,
           day date, uid uuid, raw bytea, feeling mood, tags int[], missing text, points score,
           agreed yes, span interval, odd numeric, never timestamptz, cash money);",
    )
    .await
    .unwrap();
    drop(db);
    let env = Env::new_in_existing("safe_types", |y| {
        let start = y.find("entities:").unwrap();
        format!(
            "{}entities:\n  - name: safe\n    table: safe\n",
            &y[..start]
        )
    })
    .await;
    let mut run = env.start().await;
    env.exec(
        "INSERT INTO safe VALUES (1, -32768, 9223372036854775807, -9223372036854775808, -0.000100,
           E'tab\\there \"q\" back\\\\slash \\u00e9 ctl\\x01 nl\\n✓', 'v ü', 'ab', false,
           '1999-12-31T23:59:59.999999-05:30', '2024-02-29 12:00:00', '0001-01-01',
           '00000000-0000-0000-0000-000000000000', '\\x', 'wild', '{1,NULL,3}', NULL, 2147483647,
           true, '1 year 2 mons -3 days 04:05:06.7', 'NaN', 'infinity', 12.5);
         INSERT INTO safe (id) VALUES (2);",
    )
    .await;
    env.settle(&mut run).await;
    run.stop(&env);
    assert_golden("safe_types", &env.events());
}

/// Env for the typed table (composite key, every supported type), created
/// before `sql source` runs.
async fn typed_env() -> Env {
    {
        let admin = connect(&admin_url()).await;
        recreate_db(&admin, "skein_t_types").await;
        let url = format!("{}/skein_t_types", admin_url().rsplit_once('/').unwrap().0);
        let db = connect(&url).await;
        db.batch_execute(
            "CREATE TABLE typed (id int, code text, big bigint, amount numeric(20,6), note text, flag boolean,
               at timestamptz, day date, uid uuid, raw bytea, doc jsonb, missing text, ratio double precision,
               PRIMARY KEY (id, code));",
        )
        .await
        .unwrap();
        drop(db);
        Env::new_in_existing("types", |y| {
            let start = y.find("entities:").unwrap();
            format!(
                "{}entities:\n  - name: typed\n    table: typed\n",
                &y[..start]
            )
        })
        .await
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn max_batch_changes_splits_a_backlog_and_every_entity_ends_correct() {
    let env = Env::new("max_query_size", |y| {
        y.replace(
            "state_dir:",
            "extractor: { max_batch_changes: 7 }\nstate_dir:",
        )
    })
    .await;
    let run = env.start().await;
    run.stop(&env);
    for i in 1..=40 {
        env.exec(&format!(
            "INSERT INTO customer (id, name) VALUES ({i}, 'c{i}'); UPDATE customer SET name = 'c{i}!' WHERE id = {i};"
        ))
        .await;
    }
    let mut run = env.start().await;
    env.settle(&mut run).await;
    run.stop(&env);
    let batches = extractor_batches(&env).await;
    assert!(
        batches >= 10,
        "80 changes with a cap of 7 need at least 10 batches, got {batches}"
    );
    let events = env.events();
    for i in 1..=40 {
        let last = events
            .iter()
            .rev()
            .find(|e| e["subject"] == format!("customer.{i}"))
            .unwrap();
        assert_eq!(last["data"]["name"], format!("c{i}!"));
    }
    assert_exactly_once(&env).await;
}

/// Extractor batches that carried records: in-process the sidecar's batch
/// rows carry their source bounds; over Kafka the rows count offsets (and an
/// applier may take two extractor batches at once), so count the extractor's
/// own log lines.
async fn extractor_batches(env: &Env) -> i64 {
    if env.is_kafka() {
        env.log()
            .lines()
            .filter(|l| l.contains("batch acknowledged") && !l.contains(" records=0 "))
            .count() as i64
    } else {
        env.db
            .query_one(
                "SELECT count(DISTINCT upper_position) FROM skein.batch",
                &[],
            )
            .await
            .unwrap()
            .get(0)
    }
}

/// Publishes customer 1, stops, drops the slot (the loss) and commits
/// customer 2, which no slot captures.
async fn publish_then_lose_a_change(env: &Env) {
    let mut run = env.start().await;
    env.step(
        &mut run,
        "INSERT INTO customer (id, name) VALUES (1, 'Ada');",
    )
    .await;
    run.stop(env);
    env.drop_slot().await;
    env.exec("INSERT INTO customer (id, name) VALUES (2, 'lost');")
        .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn data_loss_stops_with_a_clear_error() {
    let env = Env::new("data_loss_stop", same).await;
    publish_then_lose_a_change(&env).await;
    let out = env.skein(&[env.extractor_command()]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("data loss") && err.contains("continue_with_data_loss"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn data_loss_continue_records_it_and_goes_on() {
    let env = Env::new("data_loss_continue", |y| {
        y.replace(
            "state_dir:",
            "extractor: { continue_with_data_loss: true }\nstate_dir:",
        )
    })
    .await;
    publish_then_lose_a_change(&env).await;
    let mut run = env.start().await;
    env.step(
        &mut run,
        "INSERT INTO customer (id, name) VALUES (3, 'after');",
    )
    .await;
    run.stop(&env);
    let subjects = env.subjects();
    assert_eq!(subjects, vec!["customer.1", "customer.3"]);
    // Every partition records the loss in its row of the first batch after
    // it: in-process all rows share that batch's upper bound; over Kafka
    // every partition got a loss notice.
    let lossy: i64 = env
        .db
        .query_one(
            if env.is_kafka() {
                "SELECT count(DISTINCT partition) / 4 FROM skein.batch WHERE has_data_loss"
            } else {
                "SELECT count(DISTINCT upper_position) FROM skein.batch WHERE has_data_loss"
            },
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        lossy, 1,
        "exactly the first batch after the loss records it"
    );
    let shown = env.skein(&["marker", "show"]);
    assert!(String::from_utf8_lossy(&shown.stdout).contains("has_data_loss true"));
}

#[tokio::test(flavor = "multi_thread")]
async fn retry_when_incomplete_publishes_each_event_once() {
    let env = Env::new("retry_incomplete", same).await;
    let mut run = env.start().await;
    env.step(
        &mut run,
        "INSERT INTO customer (id, name) VALUES (1, 'Ada');",
    )
    .await;
    run.stop(&env);
    // Crash inside the sidecar transaction, then between commit and marker.
    for point in [
        "applier.before_commit",
        "applier.after_commit",
        "extractor.after_ack_before_marker",
    ] {
        let run = env.start_with(&[("SKEIN_FAILPOINT", point)]).await;
        env.exec(&format!(
            "UPDATE customer SET name = 'Ada {point}' WHERE id = 1;"
        ))
        .await;
        let status = run.wait_exit(Duration::from_secs(30));
        assert!(
            !status.success(),
            "{point}: the failpoint must abort the process"
        );
        let mut run = env.start().await;
        env.settle(&mut run).await;
        run.stop(&env);
    }
    assert_golden("retry_incomplete", &env.events());
    assert_exactly_once(&env).await;
    if env.is_kafka() {
        // The extractor re-sent the batch it had not marked; the applier
        // dropped those records by source position (not just by etag).
        let log = env.log();
        assert!(
            log.split("duplicates=")
                .skip(1)
                .any(|rest| rest.starts_with(|c: char| c.is_ascii_digit() && c != '0')),
            "no batch dropped re-sent records:\n{log}"
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn marker_reset_is_refused_while_running() {
    let env = Env::new("marker_lock", same).await;
    let run = env.start().await;
    let out = env.skein(&["marker", "reset", "--to", "0/1"]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("locked"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    run.stop(&env);
    let out = env.skein(&["marker", "show"]);
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("position "));
}

#[tokio::test(flavor = "multi_thread")]
async fn unknown_config_field_names_field_and_line() {
    let env = Env::new("bad_config", same).await;
    let yaml = std::fs::read_to_string(&env.config)
        .unwrap()
        .replace("  partitions: 4", "  partitions: 4\n  partitons: 5");
    std::fs::write(&env.config, yaml).unwrap();
    let out = env.skein(&["validate"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("partitons") && err.contains("line 14"),
        "{err}"
    );
}

/// An applier whose partition cannot start (here: its sidecar connection
/// is refused by the role's connection limit) stops the pipeline with that
/// reason, not only with the extractor's "the applier is gone".
#[tokio::test(flavor = "multi_thread")]
async fn an_applier_that_cannot_start_says_why() {
    let name = "applier_cannot_start";
    let role = "skein_t_conn_limited";
    let admin = connect(&admin_url()).await;
    let exists = admin
        .query_opt("SELECT 1 FROM pg_roles WHERE rolname = $1", &[&role])
        .await
        .unwrap()
        .is_some();
    if !exists {
        // Not a superuser: the connection limit does not bind superusers.
        let _ = admin
            .batch_execute(&format!("CREATE ROLE {role} LOGIN"))
            .await;
    }
    // The migrate, the relay and one applier fit; the second applier
    // (4 partitions) does not.
    admin
        .batch_execute(&format!("ALTER ROLE {role} CONNECTION LIMIT 3"))
        .await
        .unwrap();
    let base = admin_url();
    let (scheme_user, host) = base.rsplit_once('/').unwrap().0.split_once('@').unwrap();
    let scheme = scheme_user.split("//").next().unwrap();
    let sidecar_url = format!("{scheme}//{role}@{host}/skein_t_{name}");
    let env = Env::new(name, |y| {
        y.replace(
            "sidecar:\n  schema: skein",
            &format!("sidecar:\n  url: {sidecar_url}\n  schema: skein"),
        )
    })
    .await;
    env.exec(&format!(
        "GRANT CONNECT, CREATE ON DATABASE skein_t_{name} TO {role};"
    ))
    .await;
    let mut children: Vec<std::process::Child> = env
        .processes()
        .iter()
        .map(|p| {
            let log = std::fs::File::create(env.dir.join(format!("{p}.err"))).unwrap();
            env.command(&[p])
                .stdout(std::process::Stdio::null())
                .stderr(log)
                .spawn()
                .unwrap()
        })
        .collect();
    // The applier is the last process (`run`, or `apply` beside `extract`).
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let mut id = 0;
    let status = loop {
        if let Some(s) = children.last_mut().unwrap().try_wait().unwrap() {
            break s;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the applier did not stop"
        );
        id += 1;
        // Until the slot exists rows are not seen: keep writing.
        env.exec(&format!(
            "INSERT INTO customer (id, name) VALUES ({id}, 'c{id}');"
        ))
        .await;
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    let applier = env.processes().last().unwrap();
    let err = std::fs::read_to_string(env.dir.join(format!("{applier}.err"))).unwrap();
    for mut c in children {
        let _ = c.kill();
        let _ = c.wait();
    }
    assert!(!status.success(), "{err}");
    assert!(
        err.contains("could not start") && err.contains("too many connections"),
        "the error must name the cause:\n{err}"
    );
}

/// Every event is a state that existed: an aggregate's tables are read in
/// one snapshot, so a transaction committed while a batch is being
/// hydrated shows in all of its tables or in none (issue 10, defect 5).
/// The applier is stalled between reading the root and its children while
/// a transaction changes both; the invariant is that the customer's name
/// always equals its address line's text.
#[tokio::test(flavor = "multi_thread")]
async fn hydration_reads_one_snapshot() {
    let env = Env::new("snapshot", same).await;
    let stall = [(
        "SKEIN_FAILPOINT",
        "applier.hydrate.between_tables:1:sleep=4000",
    )];
    let mut run = env.start_with(&stall).await;
    env.exec(
        "BEGIN;
         INSERT INTO customer (id, name) VALUES (1, 'v1');
         INSERT INTO address (id, customer_id, kind, city) VALUES (10, 1, 'home', 'Oslo');
         INSERT INTO address_line (address_id, line_no, text) VALUES (10, 1, 'v1');
         COMMIT;",
    )
    .await;
    // Wait until the applier stalls mid-hydration, then change both tables.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while !env
        .log()
        .contains("applier.hydrate.between_tables` reached")
    {
        assert!(std::time::Instant::now() < deadline, "{}", env.log());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    env.exec(
        "BEGIN;
         UPDATE customer SET name = 'v2' WHERE id = 1;
         UPDATE address_line SET text = 'v2' WHERE address_id = 10;
         COMMIT;",
    )
    .await;
    env.settle(&mut run).await;
    run.stop(&env);
    let events = env.events();
    assert!(!events.is_empty());
    for e in &events {
        let d = &e["data"];
        let line = &d["addresses"][0]["lines"][0]["text"];
        assert_eq!(
            &d["name"], line,
            "an event shows a state that never existed: {d}"
        );
    }
}

/// `skein marker reset` past unread changes with `--continue-with-data-loss`
/// records the loss in the sidecar too (a batch row with `has_data_loss`),
/// not only in the marker, even when the pipeline starts only later (as
/// after a crash right after the reset) (issue 10, defect 9).
#[tokio::test(flavor = "multi_thread")]
async fn marker_reset_past_changes_records_the_loss_in_the_sidecar() {
    let env = Env::new("reset_loss", same).await;
    let mut run = env.start().await;
    env.step(
        &mut run,
        "INSERT INTO customer (id, name) VALUES (1, 'Ada');",
    )
    .await;
    run.stop(&env);
    env.exec("INSERT INTO customer (id, name) VALUES (2, 'skipped');")
        .await;
    let out = env.skein(&["marker", "reset", "--latest"]);
    assert!(!out.status.success(), "a forward reset needs the flag");
    env.skein_ok(&["marker", "reset", "--latest", "--continue-with-data-loss"]);
    let mut run = env.start().await;
    env.step(
        &mut run,
        "INSERT INTO customer (id, name) VALUES (3, 'after');",
    )
    .await;
    run.stop(&env);
    let subjects = env.subjects();
    assert_eq!(subjects, vec!["customer.1", "customer.3"]);
    let lossy: i64 = env
        .db
        .query_one("SELECT count(*) FROM skein.batch WHERE has_data_loss", &[])
        .await
        .unwrap()
        .get(0);
    assert!(lossy >= 1, "the skipped range is recorded in the sidecar");
}

/// An applier that commits events, from the stream or an explicit run,
/// wakes its process's relay: they are sent at once, not after
/// `sink.relay_poll_ms` (an hour here), which an idle relay otherwise
/// waits before it looks again.
#[tokio::test(flavor = "multi_thread")]
async fn committed_events_wake_the_relay() {
    let env = Env::new("relay_wake", relay_polls_hourly).await;
    // Before the first start: not in the stream, for an explicit run.
    env.exec("INSERT INTO customer (id, name) VALUES (2, 'Bob');")
        .await;
    let mut run = env.start().await;
    // Each step waits (60 s at most) until its event is relayed; the
    // relay is idle before each.
    env.step(
        &mut run,
        "INSERT INTO customer (id, name) VALUES (1, 'Ada');",
    )
    .await;
    env.step(&mut run, "UPDATE customer SET name = 'Ada L' WHERE id = 1;")
        .await;
    // An explicit page's events wake it too.
    env.skein_ok(&["explicit", "--entity", "customer", "--keys", "2"]);
    env.settle(&mut run).await;
    run.stop(&env);
    assert_eq!(
        env.subject_actions(),
        [
            "customer.1 created",
            "customer.1 updated",
            "customer.2 created"
        ]
    );
    assert_exactly_once(&env).await;
}

/// The file sink's relay looks for new outbox rows only once an hour.
fn relay_polls_hourly(y: String) -> String {
    let path = "  path: ${SKEIN_OUT_DIR}/events.jsonl\n";
    assert!(y.contains(path), "{y}");
    y.replace(path, &format!("{path}  relay_poll_ms: 3600000\n"))
}

/// Events committed while the relay is busy sending others still wake it:
/// the wake-up is kept for its next idle wait. A relay goes idle after a
/// round that was not full, so a lost wake-up would leave them pending
/// until the next poll (an hour here).
#[tokio::test(flavor = "multi_thread")]
async fn events_committed_while_the_relay_sends_wake_it_again() {
    let env = Env::new("relay_busy_wake", relay_polls_hourly).await;
    // The relay's first round stalls after its send, before its mark,
    // long enough for Bob's event to pass the pipeline on a loaded machine.
    let mut run = env
        .start_with(&[(
            "SKEIN_FAILPOINT",
            "relay.after_send_before_mark:1:sleep=12000",
        )])
        .await;
    env.exec("INSERT INTO customer (id, name) VALUES (1, 'Ada');")
        .await;
    run.wait_log(&env, "failpoint `relay.after_send_before_mark` reached")
        .await;
    env.exec("INSERT INTO customer (id, name) VALUES (2, 'Bob');")
        .await;
    env.wait_count(
        &mut run,
        "SELECT count(*) FROM skein.outbox WHERE key LIKE '%2%'",
    )
    .await;
    // Bob's event was committed while Ada's round was still open: the log,
    // read before the outbox, says the relay had not resumed, and her row
    // is not marked yet.
    let log = env.log();
    let ada_pending: i64 = env
        .db
        .query_one(
            "SELECT count(*) FROM skein.outbox WHERE key LIKE '%1%' AND dequeued_at IS NULL",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(
        !log.contains("failpoint `relay.after_send_before_mark` resumes") && ada_pending == 1,
        "the relay resumed before Bob's event was committed; the test proves nothing:\n{log}"
    );
    env.settle(&mut run).await;
    run.stop(&env);
    assert_eq!(
        env.subject_actions(),
        ["customer.1 created", "customer.2 created"]
    );
    assert_exactly_once(&env).await;
}

/// An event a killed process sent but did not move the relay's cursor past goes out again
/// as soon as the pipeline is back: over Kafka, when the applier takes its
/// partitions again (its relay has none before), not at the relay's next
/// poll (an hour here).
#[tokio::test(flavor = "multi_thread")]
async fn an_unmarked_event_goes_out_again_when_the_pipeline_is_back() {
    let env = Env::new("relay_takeover", relay_polls_hourly).await;
    let mut run = env
        .restart_after_a_crash_before_the_mark("INSERT INTO customer (id, name) VALUES (1, 'Ada');")
        .await;
    env.settle(&mut run).await;
    run.stop(&env);
    assert_eq!(env.sent_events().len(), 2, "sent, killed, sent again");
    assert_eq!(env.subject_actions(), ["customer.1 created"]);
    assert_exactly_once(&env).await;
}

/// A batch's snapshot, which locks the source's tables (ACCESS SHARE),
/// ends before its sidecar transaction is answered: a sidecar that waits
/// (here for progress rows another session holds) keeps no lock on the
/// source, so DDL there does not queue behind skein.
#[tokio::test(flavor = "multi_thread")]
async fn a_waiting_sidecar_transaction_holds_no_source_lock() {
    let env = Env::new("sidecar_wait", same).await;
    let mut run = env.start().await;
    env.step(
        &mut run,
        "INSERT INTO customer (id, name) VALUES (1, 'Ada');",
    )
    .await;
    let holder = connect(&env.url).await;
    let holder_pid: i32 = holder
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    holder
        .batch_execute("BEGIN; SELECT * FROM skein.progress FOR UPDATE")
        .await
        .unwrap();
    env.exec("UPDATE customer SET name = 'Ada L' WHERE id = 1;")
        .await;
    // The batch's sidecar transaction waits for the held rows.
    env.wait_count(
        &mut run,
        &format!(
            "SELECT count(*) FROM pg_stat_activity WHERE {holder_pid} = ANY(pg_blocking_pids(pid))"
        ),
    )
    .await;
    let locker = connect(&env.url).await;
    locker
        .batch_execute(
            "SET lock_timeout = '5s'; BEGIN;
             LOCK TABLE customer, address, address_line, contact IN ACCESS EXCLUSIVE MODE;
             ROLLBACK",
        )
        .await
        .unwrap_or_else(|e| {
            panic!("the source's tables stay locked while the sidecar waits: {e:?}")
        });
    holder.batch_execute("ROLLBACK").await.unwrap();
    env.settle(&mut run).await;
    run.stop(&env);
    assert_eq!(
        env.subject_actions(),
        ["customer.1 created", "customer.1 updated"]
    );
    assert_exactly_once(&env).await;
}

/// A `skein relay` started beside the pipeline's own relay stands by
/// instead of relaying the same outbox out of order (issue 10, defect 7);
/// `skein status` shows who holds the relay lease.
#[tokio::test(flavor = "multi_thread")]
async fn a_second_relay_stands_by() {
    let env = Env::new("second_relay", same).await;
    let mut run = env.start().await;
    env.spawn_into(&mut run, "relay", &[]);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !env.log().contains("standing by") {
        run.check_alive(&env);
        assert!(std::time::Instant::now() < deadline, "{}", env.log());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for i in 1..=20 {
        env.exec(&format!(
            "INSERT INTO customer (id, name) VALUES ({i}, 'c{i}'); UPDATE customer SET name = 'd{i}' WHERE id = {i};"
        ))
        .await;
    }
    env.settle(&mut run).await;
    let st: serde_json::Value = serde_json::from_str(&env.skein_ok(&["status"])).unwrap();
    // Whoever came first relays: the one relay of every partition alone,
    // or (over Kafka) the appliers' partition relays together.
    let lease = &st["relay_lease"];
    let (all, parts) = (
        lease["all_partitions"].as_i64().unwrap(),
        lease["partition_relays"].as_i64().unwrap(),
    );
    assert!(
        (all == 1 && parts == 0) || (all == 0 && parts >= 1 && env.is_kafka()),
        "{st}"
    );
    run.stop(&env);
    assert_exactly_once(&env).await;
}

/// The state directory is lost (a container on a new disk) and the slot
/// was dropped: the sidecar's progress shows the pipeline ran, so starting
/// afresh from a new slot would skip what happened in between. It stops
/// with a data-loss error instead (issue 10, defect 3).
#[tokio::test(flavor = "multi_thread")]
async fn a_lost_state_dir_and_slot_is_data_loss() {
    let env = Env::new("lost_state", same).await;
    let mut run = env.start().await;
    env.step(
        &mut run,
        "INSERT INTO customer (id, name) VALUES (1, 'Ada');",
    )
    .await;
    run.stop(&env);
    env.drop_slot().await;
    env.exec("INSERT INTO customer (id, name) VALUES (2, 'lost');")
        .await;
    std::fs::remove_dir_all(env.dir.join("state")).unwrap();
    let mut run = Running { children: vec![] };
    env.spawn_into(&mut run, env.extractor_command(), &[]);
    // Before the fix it started afresh and ran on: give it a while.
    let status = run.wait_exit(Duration::from_secs(20));
    let err = env.log();
    assert!(!status.success(), "{err}");
    assert!(
        err.contains("data loss") && err.contains("sidecar's progress"),
        "{err}"
    );
}

/// Ids (at `partitions` partitions) of customers that land in partition 0
/// and in partition 1 respectively: `ones` of the first, `many` of the second.
fn customers_in_two_partitions(ones: usize, many: usize) -> (Vec<i32>, Vec<i32>) {
    use skein_common::record::{partition_for, transport_key, RootKey};
    let part = |id: i32| {
        partition_for(
            &transport_key("customer", &RootKey(vec![Some(id.to_string())])),
            2,
        )
    };
    let zero: Vec<i32> = (1..).filter(|i| part(*i) == 0).take(ones).collect();
    let one: Vec<i32> = (1..).filter(|i| part(*i) == 1).take(many).collect();
    (zero, one)
}

/// One batch over two partitions; the process dies right after the first
/// (small) partition committed, the second (large) one did not. `meanwhile`
/// runs before the restart with one partition: every aggregate re-keys into
/// partition 0, whose progress already covers the batch, so the other half
/// would be dropped as "applied" unless skein forgets that progress. Every
/// customer must be published, each once (unchanged ones are not re-sent).
async fn rekey_after_a_half_applied_batch(name: &str, meanwhile: &str) {
    let env = Env::new(name, |y| {
        y.replace("  partitions: 4\n", "  partitions: 2\n").replace(
            "state_dir:",
            "extractor: { max_batch_changes: 100000, batch_linger_ms: 500 }\nstate_dir:",
        )
    })
    .await;
    if env.is_kafka() {
        // Over Kafka the change topic holds the backlog; see tests/kafka.rs.
        return;
    }
    let (small, large) = customers_in_two_partitions(1, 1500);
    let all: Vec<i32> = small.iter().chain(&large).copied().collect();
    let values: Vec<String> = all.iter().map(|i| format!("({i}, 'c{i}')")).collect();
    let run = env
        .start_with(&[("SKEIN_FAILPOINT", "applier.after_commit")])
        .await;
    env.exec(&format!(
        "INSERT INTO customer (id, name) VALUES {};",
        values.join(", ")
    ))
    .await;
    assert!(!run.wait_exit(Duration::from_secs(60)).success());
    let committed: Vec<i32> = env
        .db
        .query("SELECT partition FROM skein.progress", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(committed, vec![0], "only the small partition committed");
    match meanwhile {
        "" => {}
        "lose the state directory" => std::fs::remove_dir_all(env.dir.join("state")).unwrap(),
        "forget the recorded count" => env.exec("DELETE FROM skein.transport").await,
        other => panic!("{other}?"),
    }
    let yaml = std::fs::read_to_string(&env.config).unwrap();
    std::fs::write(
        &env.config,
        yaml.replace("  partitions: 2\n", "  partitions: 1\n"),
    )
    .unwrap();
    let mut run = env.start().await;
    env.settle(&mut run).await;
    env.step(&mut run, "UPDATE customer SET name = 'last' WHERE id = 1;")
        .await;
    run.stop(&env);
    let subjects = env.subjects();
    let lost: Vec<&i32> = all
        .iter()
        .filter(|id| !subjects.contains(&format!("customer.{id}")))
        .collect();
    assert!(
        lost.is_empty(),
        "{meanwhile:?}: {} of {} customers never published",
        lost.len(),
        all.len()
    );
    assert_eq!(subjects.len(), all.len() + 1, "{meanwhile:?}: each once");
    assert_exactly_once(&env).await;
    let recorded: i32 = env
        .db
        .query_one("SELECT partitions FROM skein.transport", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(recorded, 1);
}

/// Before the fix: "1500 of 1501 customers never published".
#[tokio::test(flavor = "multi_thread")]
async fn rekeying_after_a_half_applied_batch_loses_nothing() {
    rekey_after_a_half_applied_batch("rekey", "").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn rekeying_with_a_lost_state_directory_loses_nothing() {
    rekey_after_a_half_applied_batch("rekey_lost_state", "lose the state directory").await;
}

/// A sidecar from before version 4 does not know the old count.
#[tokio::test(flavor = "multi_thread")]
async fn rekeying_an_upgraded_sidecar_loses_nothing() {
    rekey_after_a_half_applied_batch("rekey_upgraded", "forget the recorded count").await;
}

/// A table in two entities (`invoice`: a child of `account`, the root of
/// `invoice`) with a composite key. The catalog once listed such a table's
/// columns once per entity, so its key came out twice (`invoice.A,A,1,1`)
/// and its events were never matched to the aggregate (found by the chaos
/// harness).
#[tokio::test(flavor = "multi_thread")]
async fn a_table_in_two_entities_keeps_its_key() {
    let files = Files {
        schema: "tests/fixtures/chaos_schema.sql",
        yaml: "tests/fixtures/chaos.yaml",
    };
    let env = Env::with_files(
        "table_in_two_entities",
        &files,
        TransportChoice::FromEnv,
        same,
    )
    .await;
    let mut run = env.start().await;
    env.exec(
        "BEGIN;
         INSERT INTO account (region, acct_no, name, rev, total, line_count, invoice_count)
           VALUES ('EU', 7, 'Ada', 1, 12.50, 1, 1);
         INSERT INTO invoice (series, invoice_no, region, acct_no, memo, rev, total, line_count)
           VALUES ('A', 1, 'EU', 7, 'm', 1, 12.50, 1);
         INSERT INTO invoice_line VALUES ('A', 1, 1, 'sku', 12.50);
         COMMIT;",
    )
    .await;
    env.settle(&mut run).await;
    run.stop(&env);
    let mut subjects = env.subject_actions();
    subjects.sort();
    assert_eq!(
        subjects,
        ["account.EU,7 created", "invoice.A,1 created"],
        "{:#?}",
        env.events()
    );
    let invoice = env
        .events()
        .into_iter()
        .find(|e| e["subject"] == "invoice.A,1")
        .unwrap();
    assert_eq!(invoice["data"]["lines"][0]["sku"], "sku");
    assert_exactly_once(&env).await;
}

/// Sums the `covered=` counts of the appliers' `batch committed` lines:
/// aggregates a batch did not read again because the snapshot they were
/// last decided in already saw all their records.
fn covered_in_log(env: &Env) -> usize {
    env.log()
        .lines()
        .filter(|l| l.contains("batch committed"))
        .filter_map(|l| l.split(" covered=").nth(1))
        .filter_map(|v| v.split(' ').next()?.parse::<usize>().ok())
        .sum()
}

/// A backlog of one-change batches on the same aggregates: the first
/// batch's snapshot already sees every later change, so later batches do
/// not read those aggregates again (`covered=` in the log), and every
/// aggregate still ends with one event of its last state.
#[tokio::test(flavor = "multi_thread")]
async fn a_backlog_does_not_read_again_what_an_earlier_snapshot_saw() {
    let env = Env::stopped_with_batches_of("coverage_backlog", 1).await;
    for i in 1..=3 {
        env.exec(&format!(
            "INSERT INTO customer (id, name) VALUES ({i}, 'c{i}')"
        ))
        .await;
    }
    for round in 1..=5 {
        for i in 1..=3 {
            env.exec(&format!(
                "UPDATE customer SET name = 'c{i}.{round}' WHERE id = {i}"
            ))
            .await;
        }
    }
    let mut run = env.start().await;
    env.settle(&mut run).await;
    run.stop(&env);
    let events = env.events();
    for i in 1..=3 {
        let mine: Vec<&serde_json::Value> = events
            .iter()
            .filter(|e| e["subject"] == format!("customer.{i}"))
            .collect();
        assert_eq!(mine.len(), 1, "one event per aggregate: {mine:?}");
        assert_eq!(mine[0]["data"]["name"], format!("c{i}.5"));
        assert_eq!(mine[0]["action"], "created");
    }
    let covered = covered_in_log(&env);
    assert!(
        covered >= 10,
        "18 changes to 3 aggregates: at least 10 later records are covered, got {covered}:\n{}",
        env.log()
    );
    assert_exactly_once(&env).await;
}

/// The root is gone when a batch reads it, but its delete comes in a later
/// batch: nothing is published then, and the aggregate is not remembered
/// as decided, so the delete's own batch reads it and publishes the
/// delete, although that snapshot saw the delete too.
#[tokio::test(flavor = "multi_thread")]
async fn a_root_gone_before_its_delete_arrives_still_publishes_the_delete() {
    let env = Env::new("coverage_delete", |y| {
        y.replace(
            "state_dir:",
            "extractor: { max_batch_changes: 1 }\nstate_dir:",
        )
    })
    .await;
    let mut run = env.start().await;
    env.step(
        &mut run,
        "INSERT INTO customer (id, name) VALUES (2, 'Bob');
         INSERT INTO address (id, customer_id, kind, city) VALUES (20, 2, 'home', 'Oslo');",
    )
    .await;
    run.stop(&env);
    // Separate transactions: separate batches, read once both committed.
    env.exec("UPDATE customer SET name = 'Bobby' WHERE id = 2")
        .await;
    env.exec("UPDATE address SET city = 'Bergen' WHERE id = 20")
        .await;
    env.exec("DELETE FROM address WHERE id = 20").await;
    env.exec("DELETE FROM customer WHERE id = 2").await;
    let mut run = env.start().await;
    env.settle(&mut run).await;
    run.stop(&env);
    assert_eq!(
        env.subject_actions(),
        ["customer.2 created", "customer.2 deleted"],
        "{}",
        env.log()
    );
    assert_exactly_once(&env).await;
}
