//! Identifier mapping (issue 12, nTangle's GenerateAllIdentifiers and
//! UsePreassignedIdentifiers), against a real PostgreSQL and the real
//! `skein` binary.

mod common;

use common::*;
use serde_json::Value;

fn mapped(y: String) -> String {
    y.replace(
        "    is_deleted_column: is_deleted\n",
        "    is_deleted_column: is_deleted\n    identifier_mapping: true\n    global_id_column: legacy_ref\n",
    )
}

fn of(events: &[Value], id: i32) -> Vec<&Value> {
    let s = format!("customer.{id}");
    events
        .iter()
        .filter(|e| e["subject"] == s.as_str())
        .collect()
}

/// The global identifier an event carries, asserting `data.global_id`
/// and the `globalid` extension agree.
fn gid(e: &Value) -> String {
    let g = e["globalid"]
        .as_str()
        .unwrap_or_else(|| panic!("no globalid: {e}"));
    assert_eq!(e["data"]["global_id"], g, "{e}");
    g.to_string()
}

/// Every aggregate gets a global identifier when it first publishes (a
/// UUID v7), and keeps it: through updates, a restart, an explicit
/// republish and its delete.
#[tokio::test(flavor = "multi_thread")]
async fn generate_all_identifiers() {
    let env = Env::new("ids_generate", mapped).await;
    env.exec("ALTER TABLE customer ADD COLUMN legacy_ref text")
        .await;
    let mut run = env.start().await;
    env.step(
        &mut run,
        "INSERT INTO customer (id, name) VALUES (1, 'Ada'), (2, 'Bob')",
    )
    .await;
    let events = env.events();
    let (g1, g2) = (gid(of(&events, 1)[0]), gid(of(&events, 2)[0]));
    assert_ne!(g1, g2);
    let u = uuid::Uuid::parse_str(&g1).expect("a UUID");
    assert_eq!(u.get_version_num(), 7);
    env.step(&mut run, "UPDATE customer SET name = 'Ada L' WHERE id = 1")
        .await;
    run.stop(&env);
    let mut run = env.start().await;
    env.step(
        &mut run,
        "UPDATE customer SET name = 'Ada Lovelace' WHERE id = 1",
    )
    .await;
    env.skein_ok(&["explicit", "--entity", "customer", "--republish"]);
    env.settle(&mut run).await;
    env.step(&mut run, "DELETE FROM customer WHERE id = 1")
        .await;
    let events = env.events();
    let one = of(&events, 1);
    assert_eq!(one.len(), 5, "{one:#?}");
    for e in &one {
        assert_eq!(gid(e), g1);
    }
    assert_eq!(one[4]["action"], "deleted");
    // The etag is the content's: the identifier does not change it.
    assert_eq!(one[3]["etag"], one[2]["etag"]);
    let stored: i64 = env
        .db
        .query_one(
            "SELECT count(*) FROM skein.identifier_mapping WHERE entity = 'customer'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(stored, 2);
    run.stop(&env);
}

/// Pre-assigned identifiers win: a row put in `identifier_mapping`
/// beforehand (nTangle's way), else the entity's `global_id_column`;
/// others are generated. Once assigned, a later change of the column does
/// not change the identifier.
#[tokio::test(flavor = "multi_thread")]
async fn use_preassigned_identifiers() {
    let env = Env::new("ids_preassigned", mapped).await;
    env.exec("ALTER TABLE customer ADD COLUMN legacy_ref text")
        .await;
    env.skein_ok(&["sidecar", "migrate"]);
    env.exec("INSERT INTO skein.identifier_mapping (entity, key, global_id) VALUES ('customer', '[\"1\"]', 'C1')")
        .await;
    let mut run = env.start().await;
    env.step(
        &mut run,
        "INSERT INTO customer (id, name, legacy_ref) VALUES (1, 'Ada', 'L1'), (2, 'Bob', 'L2'), (3, 'Cy', NULL)",
    )
    .await;
    env.step(
        &mut run,
        "UPDATE customer SET legacy_ref = 'L2b', name = 'Bob B' WHERE id = 2",
    )
    .await;
    let events = env.events();
    assert_eq!(gid(of(&events, 1)[0]), "C1");
    let two = of(&events, 2);
    assert_eq!(two.len(), 2);
    assert_eq!(gid(two[0]), "L2");
    assert_eq!(gid(two[1]), "L2", "assigned once: {two:#?}");
    let g3 = gid(of(&events, 3)[0]);
    assert!(uuid::Uuid::parse_str(&g3).is_ok(), "{g3}");
    run.stop(&env);
}
