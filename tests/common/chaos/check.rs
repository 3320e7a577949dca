//! The chaos checker: the outbox and the file sink against the tables and
//! the workload's history, after the pipeline drained. It counts every
//! violation (with a few examples of each) instead of stopping at the first.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::io::BufRead;
use std::path::Path;

use serde_json::{json, Map, Value};
use tokio_postgres::Client;

/// Counters of violations, with up to [`EXAMPLES`] examples each.
#[derive(Default)]
pub struct Violations {
    pub counts: BTreeMap<&'static str, u64>,
    pub examples: BTreeMap<&'static str, Vec<String>>,
}

const EXAMPLES: usize = 5;

impl Violations {
    pub fn add(&mut self, kind: &'static str, detail: impl FnOnce() -> String) {
        let n = self.counts.entry(kind).or_default();
        *n += 1;
        let ex = self.examples.entry(kind).or_default();
        if ex.len() < EXAMPLES {
            ex.push(detail());
        }
    }

    pub fn get(&self, kind: &str) -> u64 {
        self.counts.get(kind).copied().unwrap_or(0)
    }

    pub fn total(&self) -> u64 {
        self.counts.values().sum()
    }
}

/// Every kind of violation the checker counts (printed even when zero).
pub const KINDS: [&str; 14] = [
    "duplicate outbox ids",
    "lost events (outbox, not in the sink)",
    "unknown events (sink, not in the outbox)",
    "corrupt sink lines",
    "sink order violations",
    "order violations (rev not increasing)",
    "action order violations",
    "repeated etags",
    "states that never existed (unknown rev)",
    "invariant violations",
    "lost aggregates",
    "wrong final states",
    "broker lost data",
    "silent data loss",
];

/// What the checker saw besides the violations.
#[derive(Default)]
pub struct Seen {
    pub events: u64,
    pub events_by_action: BTreeMap<String, u64>,
    pub sink_lines: u64,
    pub sink_duplicates: u64,
    pub subjects_with_events: u64,
    pub live_aggregates: u64,
    pub deleted_aggregates: u64,
}

impl fmt::Display for Seen {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "  events (outbox)            {} {:?}",
            self.events, self.events_by_action
        )?;
        writeln!(f, "  sink lines                 {}", self.sink_lines)?;
        writeln!(f, "  sink duplicates (allowed)  {}", self.sink_duplicates)?;
        writeln!(
            f,
            "  aggregates with events     {}",
            self.subjects_with_events
        )?;
        write!(
            f,
            "  final aggregates           {} live, {} logically deleted",
            self.live_aggregates, self.deleted_aggregates
        )
    }
}

/// An amount (`"12.34"`, the JSON form of `numeric(…, 2)`) in cents.
fn cents(v: &Value) -> Option<i64> {
    let s = v.as_str()?;
    let (int, frac) = s.split_once('.')?;
    if frac.len() != 2 {
        return None;
    }
    Some(int.parse::<i64>().ok()? * 100 + frac.parse::<i64>().ok()?)
}

fn arr(v: &Value) -> &[Value] {
    v.as_array().map(Vec::as_slice).unwrap_or(&[])
}

/// An invoice's own invariants (as a root or inside an account).
fn invoice_invariants(inv: &Value, out: &mut Vec<String>) {
    let lines = arr(&inv["lines"]);
    if !inv["lines"].is_array() {
        out.push("invoice without a lines array".into());
    }
    let mut sum = 0;
    for l in lines {
        match cents(&l["amount"]) {
            Some(c) => sum += c,
            None => out.push(format!("line amount {} is not an amount", l["amount"])),
        }
        if l["series"] != inv["series"] || l["invoice_no"] != inv["invoice_no"] {
            out.push(format!(
                "line {}/{} of another invoice inside {}/{}",
                l["series"], l["invoice_no"], inv["series"], inv["invoice_no"]
            ));
        }
    }
    if cents(&inv["total"]) != Some(sum) {
        out.push(format!(
            "invoice {}/{}: total {} but its lines sum to {sum} cents",
            inv["series"], inv["invoice_no"], inv["total"]
        ));
    }
    if inv["line_count"].as_u64() != Some(lines.len() as u64) {
        out.push(format!(
            "invoice {}/{}: line_count {} but {} lines",
            inv["series"],
            inv["invoice_no"],
            inv["line_count"],
            lines.len()
        ));
    }
}

/// The invariants the workload keeps in every commit, on an event's data.
pub fn invariants(entity: &str, data: &Value) -> Vec<String> {
    let mut out = vec![];
    match entity {
        "invoice" => invoice_invariants(data, &mut out),
        "account" => {
            let invoices = arr(&data["invoices"]);
            if !data["invoices"].is_array() {
                out.push("account without an invoices array".into());
            }
            let (mut total, mut lines) = (0, 0);
            for inv in invoices {
                invoice_invariants(inv, &mut out);
                total += cents(&inv["total"]).unwrap_or(0);
                lines += inv["line_count"].as_i64().unwrap_or(0);
                if inv["region"] != data["region"] || inv["acct_no"] != data["acct_no"] {
                    out.push(format!(
                        "invoice {}/{} of {}/{} inside account {}/{}",
                        inv["series"],
                        inv["invoice_no"],
                        inv["region"],
                        inv["acct_no"],
                        data["region"],
                        data["acct_no"]
                    ));
                }
                if inv["rev"].as_i64() > data["rev"].as_i64() {
                    out.push(format!(
                        "invoice {}/{} has rev {} above its account's {}",
                        inv["series"], inv["invoice_no"], inv["rev"], data["rev"]
                    ));
                }
            }
            if cents(&data["total"]) != Some(total) {
                out.push(format!(
                    "total {} but its invoices sum to {total} cents",
                    data["total"]
                ));
            }
            if data["line_count"].as_i64() != Some(lines) {
                out.push(format!(
                    "line_count {} but its invoices hold {lines}",
                    data["line_count"]
                ));
            }
            if data["invoice_count"].as_u64() != Some(invoices.len() as u64) {
                out.push(format!(
                    "invoice_count {} but {} invoices",
                    data["invoice_count"],
                    invoices.len()
                ));
            }
        }
        other => out.push(format!("unknown entity {other}")),
    }
    out
}

/// The key part of a subject as the event's data shows it.
fn data_key(entity: &str, data: &Value) -> String {
    let text = |v: &Value| match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    match entity {
        "account" => format!("{},{}", text(&data["region"]), text(&data["acct_no"])),
        _ => format!("{},{}", text(&data["series"]), text(&data["invoice_no"])),
    }
}

/// What an aggregate is in the tables at the end.
pub enum Final {
    Live(Value),
    LogicallyDeleted,
}

/// Every aggregate in the tables, as its event data, built with plain
/// queries and the documented value formats (not skein's hydration).
pub async fn final_state(db: &Client) -> HashMap<String, Final> {
    let mut lines_of: HashMap<(String, i32), Vec<Value>> = HashMap::new();
    for r in db
        .query(
            "SELECT series, invoice_no, line_no, sku, amount::text FROM invoice_line
             ORDER BY series, invoice_no, line_no",
            &[],
        )
        .await
        .unwrap()
    {
        let (s, n): (String, i32) = (r.get(0), r.get(1));
        lines_of.entry((s.clone(), n)).or_default().push(json!({
            "series": s, "invoice_no": n, "line_no": r.get::<_, i32>(2),
            "sku": r.get::<_, String>(3), "amount": r.get::<_, String>(4),
        }));
    }
    let mut out = HashMap::new();
    let mut invoices_of: HashMap<(String, i32), Vec<Value>> = HashMap::new();
    for r in db
        .query(
            "SELECT series, invoice_no, region, acct_no, memo, is_deleted, rev, total::text, line_count
             FROM invoice ORDER BY series, invoice_no",
            &[],
        )
        .await
        .unwrap()
    {
        let (s, n): (String, i32) = (r.get(0), r.get(1));
        let (region, acct): (String, i32) = (r.get(2), r.get(3));
        let is_deleted: bool = r.get(5);
        let inv = json!({
            "series": s, "invoice_no": n, "region": region, "acct_no": acct,
            "memo": r.get::<_, String>(4), "is_deleted": is_deleted, "rev": r.get::<_, i64>(6),
            "total": r.get::<_, String>(7), "line_count": r.get::<_, i32>(8),
            "lines": lines_of.remove(&(s.clone(), n)).unwrap_or_default(),
        });
        invoices_of
            .entry((region, acct))
            .or_default()
            .push(inv.clone());
        let subject = format!("invoice.{s},{n}");
        out.insert(
            subject,
            if is_deleted {
                Final::LogicallyDeleted
            } else {
                Final::Live(inv)
            },
        );
    }
    for r in db
        .query(
            "SELECT region, acct_no, name, status, is_deleted, rev, total::text, line_count,
                    invoice_count, row_version
             FROM account",
            &[],
        )
        .await
        .unwrap()
    {
        let (region, acct): (String, i32) = (r.get(0), r.get(1));
        let is_deleted: bool = r.get(4);
        let subject = format!("account.{region},{acct}");
        let data = json!({
            "region": region, "acct_no": acct, "name": r.get::<_, String>(2),
            "status": r.get::<_, String>(3), "is_deleted": is_deleted, "rev": r.get::<_, i64>(5),
            "total": r.get::<_, String>(6), "line_count": r.get::<_, i32>(7),
            "invoice_count": r.get::<_, i32>(8), "row_version": r.get::<_, i32>(9),
            "invoices": invoices_of.remove(&(region.clone(), acct)).unwrap_or_default(),
        });
        out.insert(
            subject,
            if is_deleted {
                Final::LogicallyDeleted
            } else {
                Final::Live(data)
            },
        );
    }
    out
}

/// `row_version` is left out of the etag, so a change to it alone publishes
/// nothing: final states compare without it.
fn without_row_version(v: &Value) -> Value {
    let mut v = v.clone();
    if let Value::Object(m) = &mut v {
        m.remove("row_version");
    }
    v
}

/// The last event of an aggregate, and what its sequence looked like.
struct Track {
    index: u32,
    action: String,
    etag: Option<String>,
    rev: Option<i64>,
    data: Value,
}

/// One outbox event, as much as the checks need.
struct Ev<'a> {
    id: &'a str,
    subject: &'a str,
    entity: &'a str,
    action: &'a str,
    etag: Option<&'a str>,
    data: &'a Value,
}

fn parse_event(e: &Value) -> Option<Ev<'_>> {
    let subject = e["subject"].as_str()?;
    Some(Ev {
        id: e["id"].as_str()?,
        subject,
        entity: subject.split_once('.')?.0,
        action: e["action"].as_str()?,
        etag: e["etag"].as_str(),
        data: &e["data"],
    })
}

/// Checks the outbox (read in id order, in pages), the sink file and the
/// tables; `history` is every rev the workload gave each aggregate.
pub async fn check(
    db: &Client,
    sink: &Path,
    history: &HashMap<String, Vec<i64>>,
    v: &mut Violations,
) -> Seen {
    let mut seen = Seen::default();
    // Outbox id → (subject number, index in the subject's sequence).
    let mut by_id: HashMap<String, (u32, u32)> = HashMap::new();
    let mut subjects: HashMap<String, u32> = HashMap::new();
    let mut tracks: Vec<Track> = vec![];
    let mut last_row = i64::MIN;
    loop {
        let rows = db
            .query(
                "SELECT id, event FROM skein.outbox WHERE id > $1 ORDER BY id LIMIT 5000",
                &[&last_row],
            )
            .await
            .unwrap();
        let Some(last) = rows.last() else { break };
        last_row = last.get(0);
        for r in &rows {
            let text: &str = r.get(1);
            let e: Value = serde_json::from_str(text).expect("outbox event is JSON");
            let Some(ev) = parse_event(&e) else {
                v.add("invariant violations", || format!("malformed event {text}"));
                continue;
            };
            seen.events += 1;
            *seen
                .events_by_action
                .entry(ev.action.to_string())
                .or_default() += 1;
            let n = subjects.len() as u32;
            let sn = *subjects.entry(ev.subject.to_string()).or_insert(n);
            if sn == n {
                tracks.push(Track {
                    index: 0,
                    action: String::new(),
                    etag: None,
                    rev: None,
                    data: Value::Null,
                });
            }
            let t = &mut tracks[sn as usize];
            if by_id.insert(ev.id.to_string(), (sn, t.index)).is_some() {
                v.add("duplicate outbox ids", || ev.id.to_string());
            }
            check_event(&ev, t, history.get(ev.subject), v);
            t.index += 1;
            t.action = ev.action.to_string();
            t.etag = ev.etag.map(str::to_string);
            if let Some(rev) = ev.data["rev"].as_i64() {
                t.rev = Some(rev);
            }
            t.data = ev.data.clone();
        }
    }
    seen.subjects_with_events = subjects.len() as u64;

    // The sink: every outbox event once (after deduplication by id), each
    // aggregate's first sightings in outbox order.
    let mut sink_seen: HashSet<String> = HashSet::new();
    let mut sink_next: HashMap<u32, u32> = HashMap::new();
    if let Ok(f) = std::fs::File::open(sink) {
        for line in std::io::BufReader::new(f).lines() {
            let line = line.unwrap();
            seen.sink_lines += 1;
            let Ok(e) = serde_json::from_str::<Value>(&line) else {
                v.add("corrupt sink lines", || line.chars().take(200).collect());
                continue;
            };
            let id = e["id"].as_str().unwrap_or_default().to_string();
            if !sink_seen.insert(id.clone()) {
                seen.sink_duplicates += 1;
                continue;
            }
            let Some((sn, idx)) = by_id.get(&id) else {
                v.add("unknown events (sink, not in the outbox)", || id.clone());
                continue;
            };
            let next = sink_next.entry(*sn).or_insert(0);
            if *idx < *next {
                v.add("sink order violations", || {
                    format!("{}: event {id} (#{idx}) after #{}", e["subject"], *next - 1)
                });
            } else {
                *next = idx + 1;
            }
        }
    }
    for id in by_id.keys() {
        if !sink_seen.contains(id) {
            v.add("lost events (outbox, not in the sink)", || id.clone());
        }
    }

    // Final states: each aggregate's last event against the tables.
    let finals = final_state(db).await;
    let mut all: HashSet<&str> = finals.keys().map(String::as_str).collect();
    all.extend(subjects.keys().map(String::as_str));
    all.extend(history.keys().map(String::as_str));
    for subject in all {
        let last = subjects.get(subject).map(|sn| &tracks[*sn as usize]);
        match (finals.get(subject), last) {
            (Some(_), None) => v.add("lost aggregates", || {
                format!("{subject} is in the tables but was never published")
            }),
            (None, None) => v.add("lost aggregates", || {
                format!(
                    "{subject} existed (workload revs {:?}) but was never published",
                    history.get(subject)
                )
            }),
            (Some(Final::Live(want)), Some(t)) => {
                seen.live_aggregates += 1;
                if t.action == "deleted" {
                    v.add("wrong final states", || {
                        format!("{subject} exists but its last event is a delete")
                    });
                } else if without_row_version(&t.data) != without_row_version(want) {
                    v.add("wrong final states", || {
                        format!(
                            "{subject}: last event (rev {:?}) {} but the tables hold {}",
                            t.rev, t.data, want
                        )
                    });
                }
            }
            (Some(Final::LogicallyDeleted), Some(t)) => {
                seen.deleted_aggregates += 1;
                if t.action != "deleted" {
                    v.add("wrong final states", || {
                        format!(
                            "{subject} is logically deleted but its last event is {}",
                            t.action
                        )
                    });
                }
            }
            (None, Some(t)) => {
                if t.action != "deleted" {
                    v.add("wrong final states", || {
                        format!("{subject} is gone but its last event is {}", t.action)
                    });
                }
            }
        }
    }
    seen
}

/// The checks of one event against the one before it of the same aggregate.
fn check_event(ev: &Ev<'_>, prev: &Track, history: Option<&Vec<i64>>, v: &mut Violations) {
    let subject = ev.subject;
    let key = subject.split_once('.').map(|s| s.1).unwrap_or_default();
    if data_key(ev.entity, ev.data) != key {
        v.add("invariant violations", || {
            format!("{subject}: event data of another key: {}", ev.data)
        });
    }
    let rev = ev.data["rev"].as_i64();
    if ev.action != "deleted" {
        for problem in invariants(ev.entity, ev.data) {
            v.add("invariant violations", || {
                format!("{subject} ({} {}): {problem}", ev.action, ev.id)
            });
        }
        if rev.is_none() {
            v.add("invariant violations", || {
                format!("{subject}: event without rev: {}", ev.data)
            });
        }
    } else {
        // A delete carries the key, plus `rev` on a logical delete.
        let extra: Vec<&String> = ev
            .data
            .as_object()
            .map(Map::keys)
            .into_iter()
            .flatten()
            .filter(|k| {
                !matches!(
                    k.as_str(),
                    "region" | "acct_no" | "series" | "invoice_no" | "rev"
                )
            })
            .collect();
        if !extra.is_empty() {
            v.add("invariant violations", || {
                format!("{subject}: delete event carries {extra:?}")
            });
        }
    }
    if let Some(rev) = rev {
        if history.is_none_or(|h| h.binary_search(&rev).is_err()) {
            v.add("states that never existed (unknown rev)", || {
                format!(
                    "{subject}: event {} with rev {rev}, never given to it",
                    ev.id
                )
            });
        }
        if let Some(before) = prev.rev.filter(|b| *b >= rev) {
            v.add("order violations (rev not increasing)", || {
                format!("{subject}: rev {rev} (event {}) after rev {before}", ev.id)
            });
        }
    }
    if prev.index > 0 {
        if prev.action == "deleted" && ev.action == "deleted" {
            v.add("repeated etags", || {
                format!("{subject}: two deletes in a row (event {})", ev.id)
            });
        } else if ev.etag.is_some() && ev.etag == prev.etag.as_deref() {
            v.add("repeated etags", || {
                format!(
                    "{subject}: etag {:?} twice in a row (event {})",
                    ev.etag, ev.id
                )
            });
        }
        if prev.action == "deleted" && ev.action == "updated" {
            v.add("action order violations", || {
                format!("{subject}: updated right after deleted (event {})", ev.id)
            });
        }
    }
}
