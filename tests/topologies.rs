//! Joins and topologies (issue 12, item 3), against a real PostgreSQL and
//! the real `skein` binary, in-process or over Kafka as
//! `SKEIN_TEST_TRANSPORT` says: `left` and `inner` lookup joins, two
//! entities in one config, a table shared by two entities, `one_to_one`
//! joins, include/exclude columns and a join's `key:`. Tables:
//! `tests/fixtures/topologies_schema.sql`; each test writes its own
//! `entities:` over the quickstart's config.

mod common;

use common::*;
use serde_json::{json, Value};

const FILES: Files = Files {
    schema: "tests/fixtures/topologies_schema.sql",
    yaml: "examples/quickstart/skein.yaml",
};

/// A fresh env whose config holds `entities` (YAML, each line indented
/// as under `entities:`).
async fn env_with(name: &str, entities: &'static str) -> Env {
    Env::with_files(name, &FILES, TransportChoice::FromEnv, move |y| {
        let start = y.find("entities:\n").expect("the quickstart has entities");
        format!("{}entities:\n{entities}", &y[..start])
    })
    .await
}

/// Runs the pipeline over `steps` (each in its own batch) and returns
/// the events published.
async fn publish(env: &Env, steps: &[&str]) -> Vec<Value> {
    let mut run = env.start().await;
    for sql in steps {
        env.step(&mut run, sql).await;
    }
    run.stop(env);
    env.events()
}

/// The events match golden file `name`, and were published exactly once.
async fn golden_once(env: &Env, name: &str, events: &[Value]) {
    assert_golden(name, events);
    assert_exactly_once(env).await;
}

/// The actions published for `subject`, in order.
fn actions(events: &[Value], subject: &str) -> Vec<String> {
    events
        .iter()
        .filter(|e| e["subject"] == subject)
        .map(|e| e["action"].as_str().unwrap().to_string())
        .collect()
}

/// The data of the last event of `subject`.
fn last_data(events: &[Value], subject: &str) -> Value {
    events
        .iter()
        .rev()
        .find(|e| e["subject"] == subject)
        .unwrap_or_else(|| panic!("no event for {subject}: {events:#?}"))["data"]
        .clone()
}

const LOOKUPS: &str = "  - name: customer
    table: customer
    joins:
      - { name: tier, table: tier, type: TYPE, cardinality: one_to_one,
          on: [{ name: code, to_column: tier_code }] }
      - { name: addresses, table: address, on: [{ name: customer_id, to_column: id }] }
      - { name: region, table: region, join_to: addresses, type: TYPE, cardinality: one_to_one,
          on: [{ name: id, to_column: region_id }] }
";

/// The lookup rows: tier `gold`, region 1.
const LOOKUP_ROWS: &str = "INSERT INTO tier VALUES ('gold', 'Gold', 10); \
                           INSERT INTO region VALUES (1, 'North');";

/// `type: left`: a parent whose lookup finds no row is kept, the join
/// `null`; a lookup table's own change publishes nothing (it is not
/// captured), the next change of the aggregate carries it.
#[tokio::test(flavor = "multi_thread")]
async fn a_left_lookup_keeps_the_parent_without_a_row() {
    let yaml: &'static str = LOOKUPS.replace("TYPE", "left").leak();
    let env = env_with("topo_left", yaml).await;
    let mut run = env.start().await;
    env.step(&mut run, LOOKUP_ROWS).await;
    env.step(
        &mut run,
        "INSERT INTO customer (id, name, tier_code) VALUES (1, 'Ada', 'gold'), (2, 'Bob', 'none'), (3, 'Cy', NULL)",
    )
    .await;
    env.step(
        &mut run,
        "INSERT INTO address VALUES (10, 1, 'London', 1), (11, 1, 'Leeds', 9)",
    )
    .await;
    let before = env.events().len();
    env.step(
        &mut run,
        "UPDATE tier SET label = 'Gold+' WHERE code = 'gold'",
    )
    .await;
    assert_eq!(
        env.events().len(),
        before,
        "a lookup change alone publishes nothing"
    );
    env.step(&mut run, "UPDATE customer SET name = 'Ada L' WHERE id = 1")
        .await;
    run.stop(&env);
    let events = env.events();
    for (who, want) in [("customer.1", 3), ("customer.2", 1), ("customer.3", 1)] {
        assert_eq!(actions(&events, who).len(), want, "{who}: {events:#?}");
    }
    assert_eq!(last_data(&events, "customer.2")["tier"], Value::Null);
    assert_eq!(last_data(&events, "customer.3")["tier"], Value::Null);
    let ada = last_data(&events, "customer.1");
    assert_eq!(ada["tier"]["label"], "Gold+");
    assert_eq!(
        ada["addresses"][0]["region"],
        json!({"id": 1, "name": "North"})
    );
    assert_eq!(ada["addresses"][1]["id"], 11);
    assert_eq!(ada["addresses"][1]["region"], Value::Null);
    golden_once(&env, "topologies_left_lookup", &events).await;
}

/// `type: inner`: a parent whose lookup finds no row is left out. A child
/// row drops out of its parent's array; a root is no aggregate: never
/// published, deleted once it no longer matches (no delete of its root
/// would come), published once it matches.
#[tokio::test(flavor = "multi_thread")]
async fn an_inner_lookup_leaves_out_the_parent_without_a_row() {
    let yaml: &'static str = LOOKUPS.replace("TYPE", "inner").leak();
    let env = env_with("topo_inner", yaml).await;
    let mut run = env.start().await;
    env.step(&mut run, LOOKUP_ROWS).await;
    env.step(
        &mut run,
        "INSERT INTO customer (id, name, tier_code) VALUES (1, 'Ada', 'gold'), (2, 'Bob', 'none'), (3, 'Cy', NULL)",
    )
    .await;
    assert_eq!(env.subjects(), ["customer.1"]);
    env.step(
        &mut run,
        "INSERT INTO address VALUES (10, 1, 'London', 1), (11, 1, 'Leeds', 9)",
    )
    .await;
    let ada = last_data(&env.events(), "customer.1");
    assert_eq!(ada["addresses"].as_array().unwrap().len(), 1, "{ada}");
    assert_eq!(ada["addresses"][0]["id"], 10);
    env.step(
        &mut run,
        "DELETE FROM tier WHERE code = 'gold'; INSERT INTO tier VALUES ('none', 'None', 0)",
    )
    .await;
    env.step(
        &mut run,
        "UPDATE customer SET email = 'x@example.com' WHERE id IN (1, 2, 3)",
    )
    .await;
    run.stop(&env);
    let events = env.events();
    assert_eq!(
        actions(&events, "customer.1"),
        ["created", "updated", "deleted"]
    );
    // Its first change decides the action, as for any aggregate first
    // seen on an update (DESIGN.md, consolidation).
    assert_eq!(actions(&events, "customer.2"), ["updated"]);
    assert_eq!(actions(&events, "customer.3"), Vec::<String>::new());
    assert_eq!(last_data(&events, "customer.1"), json!({"id": 1}));
    golden_once(&env, "topologies_inner_lookup", &events).await;
}

/// Two unrelated entities in one config: one transaction touching both
/// publishes one event of each, each with its own type and source.
#[tokio::test(flavor = "multi_thread")]
async fn two_entities_in_one_config_publish_independently() {
    let env = env_with(
        "topo_two",
        "  - name: customer
    table: customer
    joins:
      - { name: contacts, table: contact, on: [{ name: customer_id, to_column: id }] }
  - name: product
    table: product
",
    )
    .await;
    let events = publish(
        &env,
        &[
            "INSERT INTO customer (id, name) VALUES (1, 'Ada'); INSERT INTO product VALUES ('p-1', 'Kettle')",
            "UPDATE product SET title = 'Kettle 2' WHERE sku = 'p-1'; INSERT INTO contact VALUES (1, 'email', 'ada@example.com')",
            "DELETE FROM product WHERE sku = 'p-1'",
        ],
    )
    .await;
    assert_eq!(actions(&events, "customer.1"), ["created", "updated"]);
    assert_eq!(
        actions(&events, "product.p-1"),
        ["created", "updated", "deleted"]
    );
    let product = events
        .iter()
        .find(|e| e["subject"] == "product.p-1")
        .unwrap();
    assert_eq!(product["type"], "contoso.product.created");
    assert_eq!(product["source"], "/contoso/crm/public/product");
    golden_once(&env, "topologies_two_entities", &events).await;
}

/// `customer` is the root of one entity and a `one_to_one` child of
/// `order`, `orders` the other way round: one change of either table
/// publishes both entities.
#[tokio::test(flavor = "multi_thread")]
async fn a_table_shared_by_two_entities_publishes_both() {
    let env = env_with(
        "topo_shared",
        "  - name: customer
    table: customer
    joins:
      - { name: orders, table: orders, on: [{ name: customer_id, to_column: id }] }
  - name: order
    table: orders
    joins:
      - { name: customer, table: customer, cardinality: one_to_one,
          on: [{ name: id, to_column: customer_id }] }
",
    )
    .await;
    let events = publish(
        &env,
        &[
            "INSERT INTO customer (id, name) VALUES (1, 'Ada')",
            "INSERT INTO orders VALUES (100, 1, 9.50), (101, 1, 20.00)",
            "UPDATE customer SET name = 'Ada L' WHERE id = 1",
            "UPDATE orders SET total = 21.00 WHERE id = 101",
            "DELETE FROM customer WHERE id = 1",
        ],
    )
    .await;
    assert_eq!(
        actions(&events, "customer.1"),
        ["created", "updated", "updated", "updated", "deleted"]
    );
    assert_eq!(
        actions(&events, "order.100"),
        ["created", "updated", "updated"]
    );
    assert_eq!(
        actions(&events, "order.101"),
        ["created", "updated", "updated", "updated"]
    );
    assert_eq!(last_data(&events, "order.101")["customer"], Value::Null);
    golden_once(&env, "topologies_shared_table", &events).await;
}

/// A `one_to_one` join is its row as an object, or `null` when there is
/// none (before it is inserted, after it is deleted).
#[tokio::test(flavor = "multi_thread")]
async fn a_one_to_one_join_is_an_object_or_null() {
    let env = env_with(
        "topo_one_to_one",
        "  - name: customer
    table: customer
    joins:
      - { name: profile, table: profile, cardinality: one_to_one,
          on: [{ name: customer_id, to_column: id }] }
",
    )
    .await;
    let mut run = env.start().await;
    let mut profiles = vec![];
    for sql in [
        "INSERT INTO customer (id, name) VALUES (1, 'Ada')",
        "INSERT INTO profile VALUES (1, 'first programmer')",
        "UPDATE profile SET bio = 'analyst' WHERE customer_id = 1",
        "DELETE FROM profile WHERE customer_id = 1",
    ] {
        env.step(&mut run, sql).await;
        profiles.push(last_data(&env.events(), "customer.1")["profile"].clone());
    }
    run.stop(&env);
    assert_eq!(
        profiles,
        [
            Value::Null,
            json!({"customer_id": 1, "bio": "first programmer"}),
            json!({"customer_id": 1, "bio": "analyst"}),
            Value::Null
        ]
    );
    golden_once(&env, "topologies_one_to_one", &env.events()).await;
}

/// `include_columns` (plus the key) and `exclude_columns` on the root and
/// on joins, a lookup's included; an excluded column a child joins to
/// (`address.id`) still joins.
#[tokio::test(flavor = "multi_thread")]
async fn include_and_exclude_columns_on_root_and_joins() {
    let env = env_with(
        "topo_columns",
        "  - name: customer
    table: customer
    exclude_columns: [secret, tier_code]
    joins:
      - { name: tier, table: tier, type: left, cardinality: one_to_one, include_columns: [label],
          on: [{ name: code, to_column: tier_code }] }
      - { name: addresses, table: address, exclude_columns: [id, customer_id, region_id],
          on: [{ name: customer_id, to_column: id }] }
      - { name: lines, table: address_line, join_to: addresses, include_columns: [text],
          on: [{ name: address_id, to_column: id }] }
  - name: card
    table: customer
    include_columns: [email]
",
    )
    .await;
    let events = publish(
        &env,
        &[
            LOOKUP_ROWS,
            "INSERT INTO customer VALUES (1, 'Ada', 'ada@example.com', 'gold', 'hunter2');
             INSERT INTO address VALUES (10, 1, 'London', 1);
             INSERT INTO address_line VALUES (10, 1, 'line one')",
        ],
    )
    .await;
    assert_eq!(
        last_data(&events, "customer.1"),
        json!({
            "id": 1, "name": "Ada", "email": "ada@example.com",
            "tier": {"code": "gold", "label": "Gold"},
            "addresses": [{"city": "London",
                           "lines": [{"address_id": 10, "line_no": 1, "text": "line one"}]}]
        })
    );
    assert_eq!(
        last_data(&events, "card.1"),
        json!({"id": 1, "email": "ada@example.com"})
    );
    golden_once(&env, "topologies_columns", &events).await;
}

/// A join's `key:` replaces its primary key: it orders the child array
/// (the etag depends on that order) and is always in the event, whatever
/// `include_columns` says. The same table joined twice, once per key.
#[tokio::test(flavor = "multi_thread")]
async fn a_join_key_orders_and_identifies_its_rows() {
    let env = env_with(
        "topo_join_key",
        "  - name: customer
    table: customer
    include_columns: [name]
    joins:
      - { name: by_value, table: contact, key: [value], include_columns: [kind],
          on: [{ name: customer_id, to_column: id }] }
      - { name: by_kind, table: contact, include_columns: [value],
          on: [{ name: customer_id, to_column: id }] }
",
    )
    .await;
    let mut run = env.start().await;
    env.step(
        &mut run,
        "INSERT INTO customer (id, name) VALUES (1, 'Ada')",
    )
    .await;
    env.step(
        &mut run,
        "INSERT INTO contact VALUES (1, 'a', 'zed'), (1, 'b', 'amy'), (1, 'c', 'max')",
    )
    .await;
    let by_value = |d: &Value| -> Vec<String> {
        d["by_value"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| {
                format!(
                    "{}={}",
                    c["kind"].as_str().unwrap(),
                    c["value"].as_str().unwrap()
                )
            })
            .collect()
    };
    let ada = last_data(&env.events(), "customer.1");
    assert_eq!(by_value(&ada), ["b=amy", "c=max", "a=zed"]);
    assert_eq!(
        ada["by_kind"],
        json!([
            {"customer_id": 1, "kind": "a", "value": "zed"},
            {"customer_id": 1, "kind": "b", "value": "amy"},
            {"customer_id": 1, "kind": "c", "value": "max"}
        ])
    );
    env.step(
        &mut run,
        "UPDATE contact SET value = 'abe' WHERE kind = 'a'",
    )
    .await;
    run.stop(&env);
    let events = env.events();
    assert_eq!(
        by_value(&last_data(&events, "customer.1")),
        ["a=abe", "b=amy", "c=max"]
    );
    golden_once(&env, "topologies_join_key", &events).await;
}
