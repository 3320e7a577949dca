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
            "SELECT count(*) FROM skein.identifier_mapping WHERE entity = 'public.customer'",
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
    env.exec("INSERT INTO skein.identifier_mapping (entity, key, global_id) VALUES ('public.customer', '[\"1\"]', 'C1')")
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

const CONTACT: Files = Files {
    schema: "tests/fixtures/identifiers_schema.sql",
    yaml: "tests/fixtures/identifiers.yaml",
};

/// nTangle's ContactTest data: contact 1 lives at address 11, whose
/// alternate is address 88; contact 1's alternate is contact 2.
const CONTACT_DATA: &str = "
    INSERT INTO address (address_id, street1, alternate_address_id) VALUES (11, 'Side', 88), (88, 'Main', NULL);
    INSERT INTO contact (contact_id, name, phone, address_id, alternate_contact_id) VALUES (1, 'Name1', '123', 11, 2);
    INSERT INTO contact (contact_id, name, phone) VALUES (2, 'Name2', '456'), (3, 'Name3', '789');";

/// The contact event of `id`, the last one.
fn contact(events: &[Value], id: i32) -> &Value {
    let s = format!("contact.{id}");
    events
        .iter()
        .rev()
        .find(|e| e["subject"] == s.as_str())
        .unwrap_or_else(|| panic!("no event of {s}: {events:#?}"))
}

/// The four identifiers nTangle's ContactTest checks, as strings.
fn contact_ids(e: &Value) -> [String; 4] {
    let d = &e["data"];
    let s = |v: &Value| {
        v.as_str()
            .unwrap_or_else(|| panic!("not a global id: {v} in {e:#}"))
            .to_string()
    };
    [
        s(&d["global_id"]),
        s(&d["global_alternate_contact_id"]),
        s(&d["address"]["global_id"]),
        s(&d["address"]["global_alternate_address_id"]),
    ]
}

/// GenerateAllIdentifiers on joins (nTangle's ContactTest): the contact's
/// key, its reference to another contact, its address's key and the
/// address's reference to another address each get a global identifier,
/// generated once and reused when the address changes. The reference to
/// contact 2 is contact 2's own identifier (one mapping per table row),
/// and the etag does not depend on them.
#[tokio::test(flavor = "multi_thread")]
async fn generate_all_identifiers_on_joins_and_references() {
    let env = Env::with_files("ids_joins", &CONTACT, TransportChoice::FromEnv, |y| y).await;
    let mut run = env.start().await;
    env.step(&mut run, CONTACT_DATA).await;
    let events = env.events();
    // The address (inserted first) resolves to contact 1 inserted after
    // it in the same transaction: create wins.
    assert_eq!(contact(&events, 1)["action"], "created");
    let first = contact_ids(contact(&events, 1));
    for g in &first {
        assert_eq!(
            uuid::Uuid::parse_str(g).map(|u| u.get_version_num()).ok(),
            Some(7),
            "{g}"
        );
    }
    let unique: std::collections::BTreeSet<&String> = first.iter().collect();
    assert_eq!(unique.len(), 4, "{first:?}");
    assert_eq!(
        first[1],
        gid(contact(&events, 2)),
        "contact 1's reference maps to contact 2's own identifier"
    );
    assert!(
        contact(&events, 2)["data"]["global_alternate_contact_id"].is_null(),
        "a NULL reference maps to null"
    );
    assert!(contact(&events, 2)["data"]["address"].is_null());
    let etag = contact(&events, 1)["etag"].clone();

    env.step(
        &mut run,
        "UPDATE address SET street1 = '1st' WHERE address_id = 11",
    )
    .await;
    let events = env.events();
    let e = contact(&events, 1);
    assert_eq!(e["data"]["address"]["street1"], "1st");
    assert_eq!(contact_ids(e), first, "reused, not generated again");
    assert_ne!(e["etag"], etag);
    run.stop(&env);

    // The same identifiers after a restart and an explicit republish.
    let mut run = env.start().await;
    env.skein_ok(&[
        "explicit",
        "--entity",
        "contact",
        "--keys",
        "1",
        "--republish",
    ]);
    env.settle(&mut run).await;
    let events = env.events();
    assert_eq!(contact_ids(contact(&events, 1)), first);
    run.stop(&env);
}

/// UsePreassignedIdentifiers on joins (nTangle's ContactTest): rows put in
/// `identifier_mapping` beforehand win, for the root and for any other
/// table row (each under its `schema.table`); the rest are generated.
#[tokio::test(flavor = "multi_thread")]
async fn use_preassigned_identifiers_on_joins_and_references() {
    let env = Env::with_files("ids_joins_pre", &CONTACT, TransportChoice::FromEnv, |y| y).await;
    env.skein_ok(&["sidecar", "migrate"]);
    env.exec(
        "INSERT INTO skein.identifier_mapping (entity, key, global_id) VALUES
           ('public.contact', '[\"1\"]', 'C1'), ('public.contact', '[\"2\"]', 'C2'),
           ('public.address', '[\"88\"]', 'C88')",
    )
    .await;
    let mut run = env.start().await;
    env.step(&mut run, CONTACT_DATA).await;
    let events = env.events();
    let [c1, alt, addr, alt_addr] = contact_ids(contact(&events, 1));
    assert_eq!(c1, "C1");
    assert_eq!(alt, "C2");
    assert_eq!(alt_addr, "C88");
    assert!(uuid::Uuid::parse_str(&addr).is_ok(), "{addr}");
    assert_eq!(gid(contact(&events, 2)), "C2");
    run.stop(&env);
}

/// Ids an earlier version stored under the entity's name (its root's
/// rows) are carried over to the table's namespace at start-up and kept:
/// the root's own and a reference's alike. Where the table's namespace
/// had another id for the row (assigned to references before the entity
/// existed), the entity's, published as `data.global_id`, wins. Once done,
/// a restart changes nothing.
#[tokio::test(flavor = "multi_thread")]
async fn ids_stored_under_the_entity_name_are_carried_over() {
    let env = Env::with_files("ids_carry_over", &CONTACT, TransportChoice::FromEnv, |y| y).await;
    env.skein_ok(&["sidecar", "migrate"]);
    env.exec(
        "INSERT INTO skein.identifier_mapping (entity, key, global_id) VALUES
           ('contact', '[\"1\"]', 'C1'), ('contact', '[\"2\"]', 'C2'),
           ('public.contact', '[\"1\"]', 'REF1')",
    )
    .await;
    let mut run = env.start().await;
    env.step(&mut run, CONTACT_DATA).await;
    let events = env.events();
    let [c1, alt, ..] = contact_ids(contact(&events, 1));
    assert_eq!((c1.as_str(), alt.as_str()), ("C1", "C2"));
    assert_eq!(gid(contact(&events, 2)), "C2");
    run.stop(&env);
    let count = |ns: &'static str| {
        let db = &env.db;
        async move {
            db.query_one(
                "SELECT count(*) FROM skein.identifier_mapping WHERE entity = $1",
                &[&ns],
            )
            .await
            .unwrap()
            .get::<_, i64>(0)
        }
    };
    assert_eq!(count("contact").await, 0);
    let mut run = env.start().await;
    env.step(
        &mut run,
        "UPDATE contact SET name = 'again' WHERE contact_id = 1",
    )
    .await;
    let events = env.events();
    let [c1, alt, ..] = contact_ids(contact(&events, 1));
    assert_eq!((c1.as_str(), alt.as_str()), ("C1", "C2"));
    run.stop(&env);
    let kept: String = env
        .db
        .query_one(
            "SELECT global_id FROM skein.identifier_mapping \
             WHERE entity = 'public.contact' AND key = '[\"1\"]'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(kept, "C1");
}

/// A pre-assigned identifier already given to another row is an error
/// that names both, not an event with a wrong or duplicate identifier.
#[tokio::test(flavor = "multi_thread")]
async fn a_global_id_column_value_already_taken_stops_with_both_keys() {
    let env = Env::new("ids_taken", mapped).await;
    env.exec("ALTER TABLE customer ADD COLUMN legacy_ref text")
        .await;
    env.skein_ok(&["sidecar", "migrate"]);
    env.exec("INSERT INTO skein.identifier_mapping (entity, key, global_id) VALUES ('public.customer', '[\"9\"]', 'L1')")
        .await;
    let run = env.start().await;
    env.exec("INSERT INTO customer (id, name, legacy_ref) VALUES (1, 'Ada', 'L1')")
        .await;
    let status = run.wait_exit(std::time::Duration::from_secs(30));
    assert!(!status.success());
    let log = env.log();
    assert!(
        log.contains("L1") && log.contains("[\"9\"]") && log.contains("[\"1\"]"),
        "{log}"
    );
    assert!(env.events().is_empty());
}

// ---------------------------------------------------------------------
// Review (branch review-12): red tests for findings.
// ---------------------------------------------------------------------

/// The events of a contact whose subject, trailing blanks trimmed, is
/// `contact.<id>` (a character(n) key may print padded).
fn contact_events<'a>(events: &'a [Value], id: &str) -> Vec<&'a Value> {
    let s = format!("contact.{id}");
    events
        .iter()
        .filter(|e| e["subject"].as_str().map(str::trim_end) == Some(s.as_str()))
        .collect()
}

/// Review: `global_id_column` is a pre-assigned id ("else the value of
/// global_id_column in the first event"), but a reference to the row
/// (contact 1's alternate_contact_id) that is assigned first generates a
/// UUID for it, which then wins over the row's own pre-assigned value.
#[tokio::test(flavor = "multi_thread")]
async fn review_a_global_id_column_wins_over_a_reference_assigned_first() {
    let env = Env::with_files(
        "rv_ids_ref_first",
        &CONTACT,
        TransportChoice::FromEnv,
        |y| {
            y.replacen(
                "    identifier_mapping: true\n    mappings:",
                "    identifier_mapping: true\n    global_id_column: legacy_ref\n    mappings:",
                1,
            )
        },
    )
    .await;
    env.exec("ALTER TABLE contact ADD COLUMN legacy_ref text")
        .await;
    let mut run = env.start().await;
    env.step(
        &mut run,
        "INSERT INTO contact (contact_id, name, alternate_contact_id) VALUES (1, 'Name1', 2)",
    )
    .await;
    env.step(
        &mut run,
        "INSERT INTO contact (contact_id, name, legacy_ref) VALUES (2, 'Name2', 'L2')",
    )
    .await;
    // One batch: the reference reads contact 4's column from the source,
    // and its proposal agrees with contact 4's own.
    env.step(
        &mut run,
        "INSERT INTO contact (contact_id, name, alternate_contact_id, legacy_ref) \
         VALUES (3, 'Name3', 4, NULL), (4, 'Name4', NULL, 'L4')",
    )
    .await;
    let events = env.events();
    let two = gid(contact(&events, 2));
    let one = contact_events(&events, "1")[0]["data"].clone();
    let three = contact(&events, 3)["data"].clone();
    let four = gid(contact(&events, 4));
    run.stop(&env);
    assert_eq!(
        two, "L2",
        "contact 2's global_id_column value is its pre-assigned id"
    );
    assert!(
        one["global_alternate_contact_id"].is_null(),
        "a reference to a row not there yet has no id yet: {one}"
    );
    assert_eq!(four, "L4");
    assert_eq!(three["global_alternate_contact_id"], "L4", "{three}");
}

/// Review: a character(n) key prints padded in pgoutput (`"2   "`, the
/// root key and so the root's identifier key) but trimmed in the
/// hydrated JSON (`::text`), which is what a reference is keyed by: the
/// one row gets two global identifiers.
#[tokio::test(flavor = "multi_thread")]
async fn review_a_reference_to_a_char_key_is_that_rows_own_identifier() {
    const CHAR: Files = Files {
        schema: "tests/fixtures/identifiers_char_schema.sql",
        yaml: "tests/fixtures/identifiers.yaml",
    };
    let env = Env::with_files("rv_ids_char", &CHAR, TransportChoice::FromEnv, |y| y).await;
    let mut run = env.start().await;
    env.step(
        &mut run,
        "INSERT INTO contact (contact_id, name) VALUES ('2', 'Name2')",
    )
    .await;
    env.step(
        &mut run,
        "INSERT INTO contact (contact_id, name, alternate_contact_id) VALUES ('1', 'Name1', '2')",
    )
    .await;
    let events = env.events();
    let two = gid(contact_events(&events, "2")[0]);
    let one = contact_events(&events, "1")[0].clone();
    let stored: Vec<(String, String)> = pairs(
        &env.db,
        "SELECT key, global_id FROM skein.identifier_mapping ORDER BY key",
    )
    .await;
    run.stop(&env);
    assert_eq!(
        one["data"]["global_alternate_contact_id"], two,
        "one row, one identifier; stored: {stored:?}"
    );
}

/// Review: `skein explicit --keys` normalises a key by casting it to the
/// column's type and back to text, which trims a character(n) value;
/// the streamed key is pgoutput's padded text. The explicit run then
/// publishes another aggregate (its own version row, a "created", a new
/// global identifier) instead of republishing the streamed one.
#[tokio::test(flavor = "multi_thread")]
async fn review_an_explicit_char_key_is_the_streamed_aggregate() {
    const CHAR: Files = Files {
        schema: "tests/fixtures/identifiers_char_schema.sql",
        yaml: "tests/fixtures/identifiers.yaml",
    };
    let env = Env::with_files(
        "rv_ids_char_explicit",
        &CHAR,
        TransportChoice::FromEnv,
        |y| y,
    )
    .await;
    let mut run = env.start().await;
    env.step(
        &mut run,
        "INSERT INTO contact (contact_id, name) VALUES ('2', 'Name2')",
    )
    .await;
    env.skein_ok(&[
        "explicit",
        "--entity",
        "contact",
        "--keys",
        "2",
        "--republish",
    ]);
    env.settle(&mut run).await;
    let events = env.events();
    let two = contact_events(&events, "2");
    let versions: Vec<String> = env
        .db
        .query("SELECT key FROM skein.version ORDER BY key", &[])
        .await
        .map(|rows| rows.iter().map(|r| r.get(0)).collect())
        .unwrap_or_default();
    run.stop(&env);
    assert_eq!(two.len(), 2, "{two:#?}");
    assert_eq!(
        two[0]["subject"], two[1]["subject"],
        "one aggregate; versions: {versions:?}"
    );
    assert_eq!(gid(two[0]), gid(two[1]), "one identifier");
    assert_eq!(
        two[1]["action"], "updated",
        "a republish of a published one"
    );
}

/// Review: a mapping's namespace depends on the rest of the config
/// (`schema.table`, or the name of an entity that maps the table as its
/// root). Adding such an entity later moves the table's rows to another
/// namespace: every reference and mapped join row gets a new identifier,
/// though "it never changes".
#[tokio::test(flavor = "multi_thread")]
async fn review_adding_an_entity_keeps_the_identifiers_already_published() {
    let env = Env::with_files(
        "rv_ids_namespace",
        &CONTACT,
        TransportChoice::FromEnv,
        |y| y,
    )
    .await;
    let mut run = env.start().await;
    env.step(&mut run, CONTACT_DATA).await;
    let events = env.events();
    let first = contact_ids(contact(&events, 1));
    run.stop(&env);
    let yaml = std::fs::read_to_string(&env.config).unwrap();
    let yaml =
        format!("{yaml}  - name: address\n    table: address\n    identifier_mapping: true\n");
    std::fs::write(&env.config, yaml).unwrap();
    let mut run = env.start().await;
    env.step(
        &mut run,
        "UPDATE address SET street1 = '1st' WHERE address_id = 11",
    )
    .await;
    let events = env.events();
    let now = contact_ids(contact(&events, 1));
    run.stop(&env);
    assert_eq!(now, first, "published identifiers keep their values");
}

/// Review: the README says "a referenced table must have a one-column
/// key", but a mapping to a table that does not exist (a typo) or has a
/// composite key is accepted and silently mints identifiers no row of
/// the table ever has. Expected: the applier refuses to start, as it does
/// for a mapped column that is not in the event.
#[tokio::test(flavor = "multi_thread")]
async fn review_a_mapping_to_a_missing_table_is_refused() {
    let env = Env::with_files("rv_ids_no_table", &CONTACT, TransportChoice::FromEnv, |y| {
        y.replace(
            "{ name: alternate_contact_id, table: contact }",
            "{ name: alternate_contact_id, table: contacts }",
        )
    })
    .await;
    let refused = env.refused_within("run", std::time::Duration::from_secs(20));
    assert!(
        refused.as_deref().is_some_and(|m| m.contains("contacts")),
        "a mapping to a table that does not exist was accepted: {refused:?}"
    );
}
