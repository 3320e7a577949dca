//! Schema changes while the pipeline runs (issue 11), against a real
//! PostgreSQL and the real `skein` binary, on the transport
//! `SKEIN_TEST_TRANSPORT` names: over Kafka the appliers are separate
//! processes that never see the change stream's Relation messages.

mod common;

use std::time::Duration;

use common::*;
use serde_json::{json, Value};

const SEED: &str = "BEGIN;
 INSERT INTO customer (id, name, email) VALUES (1, 'Ada', 'a@x');
 INSERT INTO address (id, customer_id, kind, city) VALUES (10, 1, 'home', 'London');
 INSERT INTO address_line VALUES (10, 1, 'Baker St');
 COMMIT;";

/// The quickstart pipeline, started, with customer 1 published.
async fn seeded(name: &str, failpoint: Option<&str>) -> (Env, Running) {
    let env = Env::new(name, |y| y).await;
    let mut run = match failpoint {
        Some(f) => env.start_with(&[("SKEIN_FAILPOINT", f)]).await,
        None => env.start().await,
    };
    env.step(&mut run, SEED).await;
    (env, run)
}

fn last_data(env: &Env) -> Value {
    let events = env.events();
    events.last().expect("an event")["data"].clone()
}

/// A column added to a root and to a child table while `skein run` runs
/// shows in the next event of an aggregate, without a restart.
#[tokio::test(flavor = "multi_thread")]
async fn added_columns_show_in_the_next_event_without_a_restart() {
    let (env, mut run) = seeded("schema_add", None).await;
    env.step(
        &mut run,
        "ALTER TABLE customer ADD COLUMN tier text DEFAULT 'gold';
         ALTER TABLE address ADD COLUMN zip text;",
    )
    .await;
    env.step(&mut run, "UPDATE address SET zip = 'NW1' WHERE id = 10;")
        .await;
    run.stop(&env);
    let data = last_data(&env);
    assert_eq!(data["tier"], "gold", "{data}");
    assert_eq!(data["addresses"][0]["zip"], "NW1", "{data}");
    assert_eq!(data["addresses"][0]["lines"][0]["text"], "Baker St");
    assert_exactly_once(&env).await;
}

/// A column the config does not name, dropped while running (also just
/// after a change that is still on its way): the pipeline goes on and the
/// later events lack it.
#[tokio::test(flavor = "multi_thread")]
async fn a_dropped_column_the_config_does_not_name_leaves_the_events() {
    let (env, mut run) = seeded("schema_drop", None).await;
    // The update is read after the drop.
    env.step(
        &mut run,
        "UPDATE customer SET name = 'Ada L.' WHERE id = 1;
         ALTER TABLE customer DROP COLUMN email;
         ALTER TABLE address DROP COLUMN city;",
    )
    .await;
    env.step(&mut run, "UPDATE address SET kind = 'work' WHERE id = 10;")
        .await;
    run.stop(&env);
    let events = env.events();
    let datas: Vec<&Value> = events.iter().map(|e| &e["data"]).collect();
    assert_eq!(datas[0]["email"], "a@x");
    let last = datas.last().unwrap();
    assert_eq!(last["name"], "Ada L.", "{last}");
    assert_eq!(last["addresses"][0]["kind"], "work", "{last}");
    assert!(last.get("email").is_none(), "{last}");
    assert!(last["addresses"][0].get("city").is_none(), "{last}");
    assert_exactly_once(&env).await;
}

/// A column the config names, dropped or retyped to another value format
/// while running: the pipeline stops (non-zero exit) naming the table, the
/// column, the config field that names it and what to do.
#[tokio::test(flavor = "multi_thread")]
async fn a_dropped_or_retyped_column_the_config_names_stops_naming_it() {
    let cases = [
        (
            "is_del",
            "ALTER TABLE customer DROP COLUMN is_deleted",
            "public.customer",
            "is_deleted",
            "is_deleted_column",
        ),
        (
            "on_del",
            "ALTER TABLE customer DROP COLUMN name",
            "public.customer",
            "name",
            "include_columns_on_delete",
        ),
        (
            "etag",
            "ALTER TABLE customer DROP COLUMN row_version",
            "public.customer",
            "row_version",
            "exclude_columns_from_etag",
        ),
        (
            // The publication depends on a join column: only CASCADE drops
            // it, and that takes the table out of the publication too.
            "join",
            "ALTER TABLE address DROP COLUMN customer_id CASCADE",
            "public.address",
            "customer_id",
            "on.name",
        ),
        (
            "retype",
            "ALTER TABLE customer ALTER COLUMN is_deleted DROP DEFAULT,
               ALTER COLUMN is_deleted TYPE text USING is_deleted::text",
            "public.customer",
            "is_deleted",
            "is_deleted_column",
        ),
        (
            // Published without a column list (REPLICA IDENTITY FULL), so
            // PostgreSQL lets it be retyped, and the change below reaches
            // the extractor with a changed Relation message: it stops there.
            "join_retype",
            "ALTER TABLE address ALTER COLUMN customer_id TYPE text;
             UPDATE address SET kind = 'work' WHERE id = 10;",
            "public.address",
            "customer_id",
            "on.name",
        ),
        (
            // The extractor resolves a grandchild through its parent's
            // join column, which is gone (and no Relation message says so:
            // the parent left the publication).
            "lookup",
            "ALTER TABLE address DROP COLUMN customer_id CASCADE;
             INSERT INTO address_line VALUES (10, 2, 'Upper Flat');",
            "public.address",
            "customer_id",
            "on.name",
        ),
    ];
    for (name, ddl, table, column, field) in cases {
        let (env, run) = seeded(&format!("schema_named_{name}"), None).await;
        env.exec(ddl).await;
        env.exec("UPDATE customer SET email = 'b@x' WHERE id = 1;")
            .await;
        let status = run.wait_exit(Duration::from_secs(60));
        assert!(!status.success(), "{name}: {status}");
        let log = env.log();
        for want in [
            table,
            &format!("`{column}`"),
            field,
            "entity `customer`",
            "skein validate",
        ] {
            assert!(log.contains(want), "{name}: no {want:?} in:\n{log}");
        }
        assert!(
            !env.events().iter().any(|e| e["data"]["email"] == "b@x"),
            "{name}: published past the change"
        );
        if name == "is_del" {
            // The fix the message names: take the column out of the
            // config. The change that met the drop is published then.
            let yaml = std::fs::read_to_string(&env.config).unwrap();
            std::fs::write(
                &env.config,
                yaml.replace("    is_deleted_column: is_deleted\n", ""),
            )
            .unwrap();
            let mut run = env.start().await;
            env.settle(&mut run).await;
            run.stop(&env);
            let data = last_data(&env);
            assert_eq!(data["email"], "b@x", "{data}");
            assert!(data.get("is_deleted").is_none(), "{data}");
            assert_exactly_once(&env).await;
        }
    }
}

/// An ALTER that rewrites a child table (a volatile default), committed
/// after a change was extracted and while the applier hydrates it, between
/// its reads of the root and of the child: the event still shows the
/// state that existed (the child's rows are there, nothing crashes), and
/// the next event has the new column.
#[tokio::test(flavor = "multi_thread")]
async fn an_alter_while_a_batch_is_hydrated_publishes_a_state_that_existed() {
    let (env, mut run) = seeded(
        "schema_midbatch",
        Some("applier.hydrate.between_tables:2:sleep=3000"),
    )
    .await;
    env.exec("UPDATE customer SET name = 'Ada L.' WHERE id = 1;")
        .await;
    run.wait_log(&env, "stalling 3000 ms").await;
    env.exec(
        "ALTER TABLE address ADD COLUMN zip text DEFAULT md5(random()::text);
         ALTER TABLE address_line ADD COLUMN note text DEFAULT 'n';",
    )
    .await;
    env.settle(&mut run).await;
    env.step(&mut run, "UPDATE address SET kind = 'work' WHERE id = 10;")
        .await;
    run.stop(&env);
    let events = env.events();
    let datas: Vec<&Value> = events.iter().map(|e| &e["data"]).collect();
    assert_eq!(datas.len(), 3, "{datas:#?}");
    assert_eq!(datas[1]["name"], "Ada L.");
    assert_eq!(
        datas[1]["addresses"][0]["lines"],
        json!([{"address_id": 10, "line_no": 1, "text": "Baker St"}]),
        "{}",
        datas[1]
    );
    let a = &datas[2]["addresses"][0];
    assert_eq!(a["kind"], "work");
    assert!(a["zip"].is_string(), "{a}");
    assert_eq!(a["lines"][0]["note"], "n", "{a}");
    assert_exactly_once(&env).await;
}

/// A DDL transaction that alters two tables in another order than the
/// applier locks them (the child first, then, once the applier waits on the
/// child, the root) deadlocks with the batch's snapshot; PostgreSQL breaks
/// the cycle by failing one side. The pipeline neither stops nor loses the
/// change, and the DDL goes through.
#[tokio::test(flavor = "multi_thread")]
async fn a_ddl_transaction_that_deadlocks_with_a_batch_does_not_stop_it() {
    let (env, mut run) = seeded("schema_deadlock", None).await;
    let ddl = connect(&env.url).await;
    ddl.batch_execute("BEGIN; ALTER TABLE address ADD COLUMN zip text DEFAULT 'Z';")
        .await
        .unwrap();
    env.exec("UPDATE customer SET name = 'Ada L.' WHERE id = 1;")
        .await;
    // Until the applier waits on `address` (holding `customer`).
    env.wait_count(
        &mut run,
        "SELECT count(*) FROM pg_locks WHERE NOT granted AND relation = 'address'::regclass",
    )
    .await;
    let done = ddl
        .batch_execute("ALTER TABLE customer ADD COLUMN tier text DEFAULT 'gold'; COMMIT;")
        .await;
    env.settle(&mut run).await;
    env.step(&mut run, "UPDATE customer SET email = 'c@x' WHERE id = 1;")
        .await;
    run.stop(&env);
    let data = last_data(&env);
    assert_eq!(data["name"], "Ada L.", "{data}");
    if done.is_ok() {
        assert_eq!(data["tier"], "gold", "{data}");
        assert_eq!(data["addresses"][0]["zip"], "Z", "{data}");
    }
    assert_exactly_once(&env).await;
}

/// A column added while the appliers work through a backlog whose later
/// records an earlier snapshot already saw (so those aggregates are not
/// read again: `covered=` in the log): the catalog is still read in that
/// batch, the change is noticed, and the aggregates are read after all,
/// so their next event has the new column, as without the shortcut.
#[tokio::test(flavor = "multi_thread")]
async fn a_column_added_behind_covered_records_still_shows() {
    let env = Env::stopped_with_batches_of("schema_covered", 1).await;
    // Separate transactions: separate batches. The first batch's snapshot
    // sees the update too.
    env.exec("INSERT INTO customer (id, name) VALUES (1, 'Ada')")
        .await;
    env.exec("UPDATE customer SET name = 'Ada L.' WHERE id = 1")
        .await;
    // Stalled right after the first batch's commit, before the update's.
    let mut run = env
        .start_with(&[("SKEIN_FAILPOINT", "applier.after_sidecar:1:sleep=3000")])
        .await;
    run.wait_log(&env, "stalling 3000 ms").await;
    env.exec("ALTER TABLE customer ADD COLUMN tier text DEFAULT 'gold'")
        .await;
    env.settle(&mut run).await;
    run.stop(&env);
    let events = env.events();
    let datas: Vec<&Value> = events.iter().map(|e| &e["data"]).collect();
    assert_eq!(datas.len(), 2, "{datas:#?}\n{}", env.log());
    assert_eq!(datas[0]["name"], "Ada L.", "{}", datas[0]);
    assert!(datas[0].get("tier").is_none(), "{}", datas[0]);
    assert_eq!(datas[1]["tier"], "gold", "{}", datas[1]);
    assert_exactly_once(&env).await;
}

/// A batch whose snapshot failed to open (a table of the config gone) left
/// its transaction open and aborted on the applier's source connection.
/// The next batch ends it before it prepares anything there: a statement
/// prepared in an aborted transaction fails, and would have failed every
/// batch after it (here, the snapshot text's query, first asked for by the
/// second batch).
#[tokio::test]
async fn a_snapshot_a_failed_batch_left_open_is_ended_before_the_next() {
    use skein_applier::hydrate::Source;
    let env = Env::new("left_open", |y| y).await;
    let yaml = std::fs::read_to_string(&env.config)
        .unwrap()
        .replace("${SKEIN_SOURCE_URL}", &env.url)
        .replace("${SKEIN_OUT_DIR}", &env.dir.display().to_string());
    let cfg = skein_common::config::Config::from_yaml(&yaml, "skein.yaml").unwrap();
    let mut source = Source::connect(&cfg).await.unwrap();
    env.exec("ALTER TABLE contact RENAME TO contact_away").await;
    let failed = source.begin_snapshot(&[], 1, &cfg.tables(), false).await;
    assert!(
        failed
            .as_ref()
            .is_err_and(|e| e.to_string().contains("is gone")),
        "{:?}",
        failed.err()
    );
    env.exec("ALTER TABLE contact_away RENAME TO contact").await;
    let opened = source
        .begin_snapshot(&[], 1, &cfg.tables(), true)
        .await
        .expect("the next batch's snapshot opens");
    let catalog = opened.catalog.unwrap().expect("a PostgreSQL catalog");
    assert!(catalog.tables.keys().any(|(_, t)| t == "contact"));
    assert!(opened.snapshot.unwrap().is_some(), "the snapshot's text");
    source.end_snapshot().await.unwrap();
}
