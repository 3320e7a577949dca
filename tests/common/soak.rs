//! Workloads and checks shared by the soak tests: random changes on the
//! quickstart schema, and the exactly-once and final-state checks against
//! the tables.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use tokio_postgres::Client;

use super::{connect, Env};

pub const AGGREGATES: i32 = 250;

/// `name` from the environment (a number), or `default`; anything else is an error.
pub fn env_num(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .map(|v| {
            v.parse()
                .unwrap_or_else(|_| panic!("{name}={v} is not a number"))
        })
        .unwrap_or(default)
}

/// The seed of a soak: `SKEIN_SOAK_SEED` to replay one, else a fresh one.
pub fn soak_seed() -> u64 {
    env_num(
        "SKEIN_SOAK_SEED",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64,
    )
}
const ADDRESS_IDS: i32 = 1200;
const KINDS: [&str; 4] = ["phone", "mail", "fax", "pager"];
const CITIES: [&str; 6] = ["London", "Paris", "Zürich", "Lisboa", "Kraków", "Oslo"];

/// Plays random transactions of 1–6 statements from `gen` until at least
/// `target` rows changed; returns the number of changed rows. `pace` spreads
/// them over some seconds so kills land while the workload runs.
pub async fn play_workload(
    url: &str,
    seed: u64,
    target: u64,
    gen: fn(&mut StdRng) -> (&'static str, Vec<Param>),
    pace: bool,
) -> u64 {
    let mut db = connect(url).await;
    let mut rng = StdRng::seed_from_u64(seed);
    let mut changes = 0u64;
    let mut txs = 0u64;
    while changes < target {
        let tx = db.transaction().await.unwrap();
        for _ in 0..rng.gen_range(1..=6) {
            let (sql, params) = gen(&mut rng);
            let refs: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> = params
                .iter()
                .map(|p| p.as_ref() as &(dyn tokio_postgres::types::ToSql + Sync))
                .collect();
            changes += tx
                .execute(sql, &refs)
                .await
                .unwrap_or_else(|e| panic!("{sql}: {e}"));
        }
        tx.commit().await.unwrap();
        txs += 1;
        if pace && txs.is_multiple_of(40) {
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }
    changes
}

pub type Param = Box<dyn tokio_postgres::types::ToSql + Sync + Send>;

/// Any change, including deletes, moves and key updates, over `aggregates` customers.
pub fn random_statement(rng: &mut StdRng, aggregates: i32) -> (&'static str, Vec<Param>) {
    let c = rng.gen_range(1..=aggregates);
    let a = rng.gen_range(1..=ADDRESS_IDS);
    let city = CITIES[rng.gen_range(0..CITIES.len())].to_string();
    let kind = KINDS[rng.gen_range(0..KINDS.len())].to_string();
    let n: i32 = rng.gen_range(1..=3);
    match rng.gen_range(0..100) {
        0..=19 => (
            "INSERT INTO customer (id, name, email, credit_limit) VALUES ($1, $2, $3, $4::text::numeric)
             ON CONFLICT (id) DO UPDATE SET name = EXCLUDED.name, email = EXCLUDED.email,
               credit_limit = EXCLUDED.credit_limit",
            vec![
                Box::new(c),
                Box::new(format!("customer {c} #{}", rng.gen_range(0..5))),
                Box::new(rng.gen_bool(0.5).then(|| format!("c{c}@example.com"))),
                Box::new(
                    rng.gen_bool(0.7)
                        .then(|| format!("{}.{:02}", rng.gen_range(0..10_000), rng.gen_range(0..100))),
                ),
            ],
        ),
        20..=24 => (
            "UPDATE customer SET row_version = row_version + 1 WHERE id = $1",
            vec![Box::new(c)],
        ),
        25..=27 => ("UPDATE customer SET name = name WHERE id = $1", vec![Box::new(c)]),
        28..=31 => (
            "UPDATE customer SET is_deleted = NOT is_deleted WHERE id = $1",
            vec![Box::new(c)],
        ),
        32..=34 => ("DELETE FROM customer WHERE id = $1", vec![Box::new(c)]),
        35 => (
            // Root primary-key update onto a free id.
            "UPDATE customer SET id = $2 WHERE id = $1 AND NOT EXISTS (SELECT 1 FROM customer WHERE id = $2)",
            vec![Box::new(c), Box::new(rng.gen_range(1..=aggregates))],
        ),
        36..=53 => (
            "INSERT INTO address (id, customer_id, kind, city) VALUES ($1, $2, $3, $4)
             ON CONFLICT (id) DO UPDATE SET city = EXCLUDED.city, kind = EXCLUDED.kind",
            vec![Box::new(a), Box::new(c), Box::new(kind), Box::new(city)],
        ),
        54..=58 => (
            // A child moved to another root.
            "UPDATE address SET customer_id = $2 WHERE id = $1",
            vec![Box::new(a), Box::new(c)],
        ),
        59 => (
            "UPDATE address SET customer_id = NULL WHERE id = $1",
            vec![Box::new(a)],
        ),
        60..=64 => ("DELETE FROM address WHERE id = $1", vec![Box::new(a)]),
        65..=77 => (
            // A grandchild: its root is found through its address.
            "INSERT INTO address_line (address_id, line_no, text) VALUES ($1, $2, $3)
             ON CONFLICT (address_id, line_no) DO UPDATE SET text = EXCLUDED.text",
            vec![
                Box::new(a),
                Box::new(n),
                Box::new(format!("{} {city} Street", rng.gen_range(1..200))),
            ],
        ),
        78..=81 => (
            "DELETE FROM address_line WHERE address_id = $1 AND line_no = $2",
            vec![Box::new(a), Box::new(n)],
        ),
        82..=95 => (
            "INSERT INTO contact (customer_id, kind, value) VALUES ($1, $2, $3)
             ON CONFLICT (customer_id, kind) DO UPDATE SET value = EXCLUDED.value",
            vec![
                Box::new(c),
                Box::new(kind),
                Box::new(format!("+{}", rng.gen_range(1000..9999))),
            ],
        ),
        _ => (
            "DELETE FROM contact WHERE customer_id = $1 AND kind = $2",
            vec![Box::new(c), Box::new(kind)],
        ),
    }
}

/// The exactly-once checks against the outbox, the file sink and the
/// tables. `unique_etags`: no (aggregate, etag) may appear twice at all (for
/// workloads whose states never repeat), not only twice in a row.
/// `sink`: the events as the sink got them (default: the file sink).
pub async fn check(env: &Env, ctx: &str, sink: Option<Vec<Value>>, unique_etags: bool) -> usize {
    let outbox = env.outbox().await;
    let file = sink.unwrap_or_else(|| env.events());
    assert!(!outbox.is_empty(), "no events {ctx}");

    // Every outbox event id is unique.
    let mut ids = HashSet::new();
    for e in &outbox {
        assert!(
            ids.insert(e["id"].as_str().unwrap()),
            "duplicate event id {} {ctx}",
            e["id"]
        );
    }
    // Every file event is in the outbox, and nothing in the outbox is missing
    // from the file (the relay drained it). The file may repeat an event the
    // relay sent just before a kill: consumers deduplicate by id.
    let file_ids: HashSet<&str> = file.iter().map(|e| e["id"].as_str().unwrap()).collect();
    for id in &file_ids {
        assert!(
            ids.contains(id),
            "file event {id} is not in the outbox {ctx}"
        );
    }
    for id in &ids {
        assert!(
            file_ids.contains(id),
            "outbox event {id} never reached the file {ctx}"
        );
    }

    // Per aggregate: the order in the file (first sightings) is the outbox order,
    // and no two consecutive events carry the same etag.
    let mut by_subject: BTreeMap<&str, Vec<&Value>> = BTreeMap::new();
    for e in &outbox {
        by_subject
            .entry(e["subject"].as_str().unwrap())
            .or_default()
            .push(e);
    }
    let mut seen = HashSet::new();
    let mut file_order: HashMap<&str, Vec<&str>> = HashMap::new();
    for e in &file {
        let id = e["id"].as_str().unwrap();
        if seen.insert(id) {
            file_order
                .entry(e["subject"].as_str().unwrap())
                .or_default()
                .push(id);
        }
    }
    for (subject, events) in &by_subject {
        let outbox_order: Vec<&str> = events.iter().map(|e| e["id"].as_str().unwrap()).collect();
        assert_eq!(
            file_order.get(subject).cloned().unwrap_or_default(),
            outbox_order,
            "{subject}: file order differs from outbox order {ctx}"
        );
        if unique_etags {
            let mut etags = HashSet::new();
            for e in events.iter().filter(|e| !e["etag"].is_null()) {
                assert!(
                    etags.insert(e["etag"].as_str().unwrap()),
                    "{subject}: etag {} published twice {ctx}",
                    e["etag"]
                );
            }
        }
        for w in events.windows(2) {
            assert_ne!(
                w[0]["etag"], w[1]["etag"],
                "{subject}: two consecutive events with the same etag {ctx}: {} then {}",
                w[0], w[1]
            );
        }
    }

    // The last event of every aggregate is its final state, recomputed here
    // from the tables (not with skein's hydration query).
    let want = final_state(&env.db).await;
    let mut subjects: HashSet<String> = by_subject.keys().map(|s| s.to_string()).collect();
    subjects.extend(want.keys().map(|id| format!("customer.{id}")));
    let mut live = 0;
    for subject in subjects {
        let last = by_subject.get(subject.as_str()).and_then(|v| v.last());
        let id: i32 = subject.trim_start_matches("customer.").parse().unwrap();
        match want.get(&id) {
            Some(data) => {
                live += 1;
                let last = last
                    .unwrap_or_else(|| panic!("{subject} exists but was never published {ctx}"));
                assert_ne!(
                    last["action"], "deleted",
                    "{subject} exists but its last event is a delete {ctx}"
                );
                // row_version is excluded from the etag, so a change to it
                // alone publishes nothing: compare without it.
                assert_eq!(
                    without_row_version(&last["data"]),
                    without_row_version(data),
                    "{subject}: last event is not the final state {ctx}"
                );
            }
            None => {
                if let Some(last) = last {
                    assert_eq!(
                        last["action"], "deleted",
                        "{subject} is gone (or logically deleted) but its last event is not a delete {ctx}"
                    );
                }
            }
        }
    }
    eprintln!(
        "soak: {} events ({} lines in the file), {live} live aggregates checked {ctx}",
        outbox.len(),
        file.len()
    );
    assert!(
        live >= 100,
        "too few live aggregates ({live}) to mean much {ctx}"
    );
    live
}

fn without_row_version(v: &Value) -> Value {
    let mut v = v.clone();
    if let Value::Object(m) = &mut v {
        m.remove("row_version");
    }
    v
}

/// Each live (present, not logically deleted) customer as its event JSON,
/// built from plain queries and the documented value formats.
pub async fn final_state(db: &Client) -> HashMap<i32, Value> {
    let lines = db
        .query(
            "SELECT address_id, line_no, text FROM address_line ORDER BY address_id, line_no",
            &[],
        )
        .await
        .unwrap();
    let mut lines_of: HashMap<i32, Vec<Value>> = HashMap::new();
    for r in lines {
        let a: i32 = r.get(0);
        let n: i32 = r.get(1);
        let t: String = r.get(2);
        lines_of
            .entry(a)
            .or_default()
            .push(json!({ "address_id": a, "line_no": n, "text": t }));
    }
    let mut addresses_of: HashMap<i32, Vec<Value>> = HashMap::new();
    for r in db
        .query(
            "SELECT id, customer_id, kind, city FROM address WHERE customer_id IS NOT NULL ORDER BY id",
            &[],
        )
        .await
        .unwrap()
    {
        let id: i32 = r.get(0);
        let c: i32 = r.get(1);
        let kind: String = r.get(2);
        let city: String = r.get(3);
        addresses_of.entry(c).or_default().push(json!({
            "id": id, "customer_id": c, "kind": kind, "city": city,
            "lines": lines_of.get(&id).cloned().unwrap_or_default(),
        }));
    }
    let mut contacts_of: HashMap<i32, Vec<Value>> = HashMap::new();
    for r in db
        .query(
            "SELECT customer_id, kind, value FROM contact ORDER BY customer_id, kind",
            &[],
        )
        .await
        .unwrap()
    {
        let c: i32 = r.get(0);
        let kind: String = r.get(1);
        let value: String = r.get(2);
        contacts_of
            .entry(c)
            .or_default()
            .push(json!({ "customer_id": c, "kind": kind, "value": value }));
    }
    let mut out = HashMap::new();
    for r in db
        .query(
            "SELECT id, name, email, credit_limit::text, row_version,
                    to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"')
             FROM customer WHERE NOT is_deleted",
            &[],
        )
        .await
        .unwrap()
    {
        let id: i32 = r.get(0);
        let name: String = r.get(1);
        let email: Option<String> = r.get(2);
        let credit: Option<String> = r.get(3);
        let row_version: i32 = r.get(4);
        let created: String = r.get(5);
        out.insert(
            id,
            json!({
                "id": id, "name": name, "email": email, "credit_limit": credit,
                "is_deleted": false, "row_version": row_version, "created_at": created,
                "addresses": addresses_of.remove(&id).unwrap_or_default(),
                "contacts": contacts_of.remove(&id).unwrap_or_default(),
            }),
        );
    }
    out
}

/// Changes whose aggregate states never repeat: upserts and updates with
/// fresh random values, children that never move or go away, and no-op
/// `row_version` bumps. Address `a` of customer `c` is `c * 4 + k`.
pub fn monotonic_statement(rng: &mut StdRng, aggregates: i32) -> (&'static str, Vec<Param>) {
    let c = rng.gen_range(1..=aggregates);
    let a = c * 4 + rng.gen_range(0..4);
    let fresh = format!("{:016x}", rng.gen::<u64>());
    match rng.gen_range(0..100) {
        0..=24 => (
            "INSERT INTO customer (id, name) VALUES ($1, $2) ON CONFLICT (id) DO UPDATE SET name = EXCLUDED.name",
            vec![Box::new(c), Box::new(fresh)],
        ),
        25..=29 => (
            "UPDATE customer SET row_version = row_version + 1 WHERE id = $1",
            vec![Box::new(c)],
        ),
        30..=54 => (
            "INSERT INTO address (id, customer_id, kind, city) VALUES ($1, $2, 'home', $3)
             ON CONFLICT (id) DO UPDATE SET city = EXCLUDED.city",
            vec![Box::new(a), Box::new(c), Box::new(fresh)],
        ),
        55..=77 => (
            "INSERT INTO address_line (address_id, line_no, text) VALUES ($1, $2, $3)
             ON CONFLICT (address_id, line_no) DO UPDATE SET text = EXCLUDED.text",
            vec![Box::new(a), Box::new(rng.gen_range(1..=3i32)), Box::new(fresh)],
        ),
        _ => (
            "INSERT INTO contact (customer_id, kind, value) VALUES ($1, $2, $3)
             ON CONFLICT (customer_id, kind) DO UPDATE SET value = EXCLUDED.value",
            vec![
                Box::new(c),
                Box::new(KINDS[rng.gen_range(0..KINDS.len())].to_string()),
                Box::new(fresh),
            ],
        ),
    }
}
