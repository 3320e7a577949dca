//! Upgrading a sidecar in place, against the real PostgreSQL: a version 2
//! sidecar (PostgreSQL LSNs in `bigint`, as the previous release wrote it,
//! kept in `tests/fixtures/sidecar_v2.sql`) becomes version 3 (`numeric`
//! positions, `source_commit` in display form) and then version 4 (the
//! fencing `epoch`, 0 for existing rows) with its progress intact, on to
//! the current version (version 9: no foreign key from the outbox to its
//! batch), and a pipeline then resumes from that progress.

mod common;

use common::*;

#[tokio::test(flavor = "multi_thread")]
async fn a_version_2_sidecar_is_upgraded_in_place() {
    let env = Env::new("sidecar_v2", |y| y).await;
    env.exec(&std::fs::read_to_string(root().join("tests/fixtures/sidecar_v2.sql")).unwrap())
        .await;
    env.exec(
        "INSERT INTO skein.progress (group_name, topic, partition, position, source_commit, source_seq)
         VALUES ('quickstart', 'in-process', 0, 4294967362, 4294967362, 3),
                ('quickstart', 'orders', 1, 17, NULL, NULL);
         INSERT INTO skein.batch (correlation_id, group_name, topic, partition, lower_position,
           upper_position, record_count, entity_count, event_count)
         VALUES ('0190a4c2-0000-7000-8000-000000000001', 'quickstart', 'in-process', 0, 10, 4294967362, 1, 1, 1);",
    )
    .await;
    // Twice: the second run must change nothing.
    for _ in 0..2 {
        env.skein_ok(&["sidecar", "migrate"]);
    }
    let types: Vec<(String, String)> = pairs(
        &env.db,
        "SELECT table_name || '.' || column_name, data_type FROM information_schema.columns
         WHERE table_schema = 'skein' AND column_name IN ('position', 'source_commit', 'lower_position', 'upper_position', 'epoch')
         ORDER BY 1",
    )
    .await;
    assert_eq!(
        types,
        vec![
            ("batch.lower_position".into(), "numeric".into()),
            ("batch.upper_position".into(), "numeric".into()),
            ("progress.epoch".into(), "bigint".into()),
            ("progress.position".into(), "numeric".into()),
            ("progress.source_commit".into(), "text".into()),
        ]
    );
    let rows: Vec<(String, Option<String>, Option<i64>, i64)> = env
        .db
        .query(
            "SELECT position::text, source_commit, source_seq, epoch FROM skein.progress ORDER BY topic",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
        .collect();
    assert_eq!(
        rows,
        vec![
            ("4294967362".into(), Some("1/42".into()), Some(3), 0),
            ("17".into(), None, None, 0),
        ]
    );
    // Version 9: the outbox's rows reference their batch by no foreign key
    // (version 2 named it after the table's old name, `outbox`).
    let keys: Vec<(String, String)> = pairs(
        &env.db,
        "SELECT conname::text, pg_get_constraintdef(oid) FROM pg_constraint
         WHERE contype = 'f' AND conrelid = 'skein.outbox_row'::regclass",
    )
    .await;
    assert_eq!(keys, vec![], "the outbox keeps no foreign key");
    let versions: Vec<i32> = env
        .db
        .query("SELECT version FROM skein.schema_version ORDER BY 1", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(
        versions,
        vec![2, skein_sql::postgres::SIDECAR_SCHEMA_VERSION],
        "the version reached is recorded"
    );
}

/// A sidecar created at version 7 or 8 named the outbox's foreign key
/// after `outbox_row` (version 2's is named after `outbox`, above):
/// version 9 drops it too.
#[tokio::test(flavor = "multi_thread")]
async fn a_version_8_sidecar_loses_its_outbox_foreign_key() {
    let env = Env::new("sidecar_v8_key", |y| y).await;
    env.skein_ok(&["sidecar", "migrate"]);
    env.exec(
        "ALTER TABLE skein.outbox_row ADD FOREIGN KEY (batch_id) REFERENCES skein.batch (id);
         DELETE FROM skein.schema_version WHERE version > 8;",
    )
    .await;
    let outbox_keys = "SELECT conname::text, pg_get_constraintdef(oid) FROM pg_constraint
         WHERE contype = 'f' AND conrelid = 'skein.outbox_row'::regclass";
    let before: Vec<(String, String)> = pairs(&env.db, outbox_keys).await;
    assert_eq!(
        before.iter().map(|k| k.0.as_str()).collect::<Vec<_>>(),
        ["outbox_row_batch_id_fkey"],
        "the key as versions 7 and 8 created it"
    );
    env.skein_ok(&["sidecar", "migrate"]);
    let after: Vec<(String, String)> = pairs(&env.db, outbox_keys).await;
    assert_eq!(after, vec![], "version 9 drops it");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_pipeline_resumes_across_the_upgrade() {
    let env = Env::new("sidecar_upgrade_run", |y| y).await;
    // Publish under version 4, then put the sidecar back to version 2's
    // types (as the previous release left it) and let `skein run` upgrade it.
    let mut run = env.start().await;
    env.step(
        &mut run,
        "INSERT INTO customer (id, name) VALUES (1, 'Ada');",
    )
    .await;
    run.stop(&env);
    env.exec(
        "ALTER TABLE skein.progress ALTER COLUMN position TYPE bigint,
           ALTER COLUMN source_commit TYPE bigint USING NULL;
         ALTER TABLE skein.batch ALTER COLUMN lower_position TYPE bigint,
           ALTER COLUMN upper_position TYPE bigint;
         ALTER TABLE skein.progress DROP COLUMN epoch;
         DELETE FROM skein.schema_version WHERE version > 2;",
    )
    .await;
    let mut run = env.start().await;
    env.step(
        &mut run,
        "UPDATE customer SET name = 'Ada L.' WHERE id = 1;",
    )
    .await;
    run.stop(&env);
    let names: Vec<String> = env
        .events()
        .iter()
        .map(|e| e["data"]["name"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(names, vec!["Ada", "Ada L."], "nothing lost, nothing twice");
    assert_exactly_once(&env).await;
}
