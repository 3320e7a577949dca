//! Prometheus metrics (issue 12): each process of the pipeline serves
//! `/metrics`; the tests scrape them while it runs, against a real
//! PostgreSQL (and Kafka with `SKEIN_TEST_TRANSPORT=kafka`), and read the
//! text with two real implementations of the format: Prometheus' own
//! `promtool check metrics` (which also lints the naming conventions) and
//! the Python `prometheus_client` text parser. Both are installed by
//! `scripts/lib/prometheus.sh`; a test without them fails.

mod common;

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use serde::Deserialize;

/// A port nobody listens on right now.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The `/metrics` text of the process listening on `port`.
fn scrape(port: u16) -> String {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port))
        .unwrap_or_else(|e| panic!("no metrics endpoint on {port}: {e}"));
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    // HTTP/1.0: the answer is not chunked and the server closes.
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let (head, body) = out.split_once("\r\n\r\n").expect("an HTTP answer");
    assert!(
        head.starts_with("HTTP/1.0 200") || head.starts_with("HTTP/1.1 200"),
        "{head}"
    );
    body.to_string()
}

#[derive(Debug, Deserialize)]
struct Family {
    name: String,
    #[serde(rename = "type")]
    kind: String,
    help: String,
    samples: Vec<Sample>,
}

#[derive(Debug, Deserialize)]
struct Sample {
    name: String,
    labels: BTreeMap<String, String>,
    value: f64,
}

/// The Python that Debian's python3-prometheus-client is installed for
/// (a `python3` earlier on PATH may be another one).
const PYTHON: &str = "/usr/bin/python3";

/// `text` read by promtool (which must find no problem) and by Python's
/// `prometheus_client` parser (its families).
fn parse(text: &str) -> Vec<Family> {
    let lint = run_with_stdin("promtool", &["check", "metrics"], text);
    assert!(
        lint.status.success(),
        "promtool check metrics found problems:\n{}{}\n--- text:\n{text}",
        String::from_utf8_lossy(&lint.stdout),
        String::from_utf8_lossy(&lint.stderr)
    );
    let parsed = run_with_stdin(
        PYTHON,
        &[
            "-c",
            r#"
import json, sys
from prometheus_client.parser import text_string_to_metric_families
print(json.dumps([
    {"name": f.name, "type": f.type, "help": f.documentation,
     "samples": [{"name": s.name, "labels": s.labels, "value": s.value} for s in f.samples]}
    for f in text_string_to_metric_families(sys.stdin.read())]))
"#,
        ],
        text,
    );
    assert!(
        parsed.status.success(),
        "prometheus_client could not parse the metrics:\n{}\n--- text:\n{text}",
        String::from_utf8_lossy(&parsed.stderr)
    );
    serde_json::from_slice(&parsed.stdout).unwrap()
}

fn run_with_stdin(cmd: &str, args: &[&str], input: &str) -> std::process::Output {
    let mut c = Command::new(cmd)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| {
            panic!("`{cmd}` is needed to check the metrics (scripts/lib/prometheus.sh installs it): {e}")
        });
    c.stdin.take().unwrap().write_all(input.as_bytes()).unwrap();
    c.wait_with_output().unwrap()
}

/// The parsed scrapes of every process, by command.
struct Scrapes(Vec<(String, Vec<Family>)>);

impl Scrapes {
    fn take(ports: &[(String, u16)]) -> Scrapes {
        Scrapes(
            ports
                .iter()
                .map(|(what, port)| (what.clone(), parse(&scrape(*port))))
                .collect(),
        )
    }

    /// The sum of sample `name` with these labels over every process.
    fn sum(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.samples(name, labels).iter().map(|s| s.value).sum()
    }

    fn samples(&self, name: &str, labels: &[(&str, &str)]) -> Vec<&Sample> {
        self.0
            .iter()
            .flat_map(|(_, f)| f.iter())
            .flat_map(|f| f.samples.iter())
            .filter(|s| {
                s.name == name
                    && labels
                        .iter()
                        .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
            })
            .collect()
    }

    /// `what` serves each family with its type and a help text.
    fn assert_families(&self, what: &str, families: &[(&str, &str)]) {
        for (name, kind) in families {
            let f = self
                .family(what, name)
                .unwrap_or_else(|| panic!("{what} serves no {name}"));
            assert_eq!(f.kind, *kind, "{name}");
            assert!(!f.help.is_empty(), "{name} has no help text");
        }
    }

    /// The family of `name` in the scrape of `what`.
    fn family(&self, what: &str, name: &str) -> Option<&Family> {
        self.0
            .iter()
            .find(|(w, _)| w == what)
            .and_then(|(_, f)| f.iter().find(|f| f.name == name))
    }
}

/// Starts the pipeline's processes, each serving metrics on its own port.
async fn start_with_metrics(env: &Env) -> (Running, Vec<(String, u16)>) {
    let mut run = Running { children: vec![] };
    let mut ports = vec![];
    for p in env.processes() {
        let port = free_port();
        let addr = format!("127.0.0.1:{port}");
        let id = format!("{}-{p}-0", env.name);
        env.spawn_into(
            &mut run,
            p,
            &[("SKEIN_METRICS_ADDR", &addr), ("SKEIN_INSTANCE_ID", &id)],
        );
        ports.push((p.to_string(), port));
    }
    env.wait_streaming(&mut run).await;
    (run, ports)
}

/// The config with gauges refreshed every 200 ms.
fn quick_refresh(y: String) -> String {
    format!("{y}\nmetrics:\n  refresh_ms: 200\n")
}

/// Scrapes until `done` holds or 20 s passed; the last scrape either way.
async fn scrape_until(ports: &[(String, u16)], done: impl Fn(&Scrapes) -> bool) -> Scrapes {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let s = Scrapes::take(ports);
        if done(&s) || Instant::now() > deadline {
            return s;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The counters agree with what the pipeline did (events in the sink,
/// unchanged aggregates, records, batches), every metric the issue lists
/// is there with help text and the right type, and the text passes
/// promtool's lint and parses with prometheus_client.
#[tokio::test(flavor = "multi_thread")]
async fn metrics_are_scraped_while_running_and_count_what_the_pipeline_did() {
    let env = Env::new("metrics", quick_refresh).await;
    let (mut run, ports) = start_with_metrics(&env).await;

    // Before any change: every series is there, at 0.
    let first = Scrapes::take(&ports);
    assert_eq!(first.sum("skein_data_loss_events_total", &[]), 0.0);
    assert_eq!(
        first
            .samples("skein_events_published_total", &[("entity", "customer")])
            .len(),
        ports.len(),
        "every process shows the entity's counter from the start"
    );

    env.step(
        &mut run,
        "INSERT INTO customer (id, name) VALUES (1, 'Ada'), (2, 'Bob'), (3, 'Cy');
         INSERT INTO address (id, customer_id, kind, city) VALUES (10, 1, 'home', 'Oslo');",
    )
    .await;
    // Only the excluded-from-etag column: an unchanged aggregate, no event.
    env.step(
        &mut run,
        "UPDATE customer SET row_version = row_version + 1 WHERE id = 1",
    )
    .await;
    env.step(&mut run, "UPDATE customer SET name = 'Bob B' WHERE id = 2")
        .await;
    let events = env.events().len() as f64;
    assert!(events >= 4.0, "{events} events");

    let s = scrape_until(&ports, |s| {
        s.sum("skein_relay_sent_total", &[]) >= events
            && s.samples("skein_outbox_pending", &[])
                .iter()
                .all(|x| x.value == 0.0)
            && s.samples("skein_transport_lag_records", &[])
                .iter()
                .all(|x| x.value == 0.0)
    })
    .await;
    assert_eq!(
        s.sum("skein_events_published_total", &[("entity", "customer")]),
        events,
        "events published = events in the sink"
    );
    assert_eq!(s.sum("skein_relay_sent_total", &[]), events);
    assert_eq!(s.sum("skein_relay_failures_total", &[]), 0.0);
    assert!(
        s.sum("skein_events_unchanged_total", &[("entity", "customer")]) >= 1.0,
        "the row_version update is counted unchanged"
    );
    let extracted = s.sum("skein_extractor_records_total", &[]);
    assert!(extracted >= 6.0, "{extracted} records extracted");
    assert_eq!(
        s.sum("skein_applier_records_total", &[]),
        extracted,
        "every record sent was applied"
    );
    assert_eq!(s.sum("skein_applier_duplicates_total", &[]), 0.0);
    assert!(s.sum("skein_source_changes_total", &[]) >= extracted);
    assert!(s.sum("skein_source_transactions_total", &[]) >= 3.0);
    assert!(s.sum("skein_extractor_batches_total", &[]) >= 3.0);
    let batches = s.sum("skein_applier_batches_total", &[]);
    assert!(batches >= 3.0);
    assert_eq!(
        s.sum("skein_applier_batch_duration_seconds_count", &[]),
        batches,
        "one duration per committed batch"
    );
    assert_eq!(s.sum("skein_event_latency_seconds_count", &[]), events);
    assert_eq!(
        s.sum("skein_event_latency_seconds_bucket", &[("le", "+Inf")]),
        events
    );
    assert_eq!(s.sum("skein_dead_letters_total", &[]), 0.0);
    assert_eq!(s.sum("skein_data_loss_events_total", &[]), 0.0);
    // Every partition's transport lag, settled at 0.
    for p in 0..4 {
        let lag = s.samples(
            "skein_transport_lag_records",
            &[("partition", &p.to_string())],
        );
        assert!(!lag.is_empty(), "no transport lag for partition {p}");
        assert!(lag.iter().all(|x| x.value == 0.0), "{lag:?}");
    }
    // The slot's lag in bytes (from the same query `skein status` runs)
    // and the source lag in ms, caught up.
    let x = env.extractor_command();
    assert!(!s.samples("skein_source_lag_bytes", &[]).is_empty());
    let lag = s.family(x, "skein_source_lag_seconds").expect("source lag");
    assert!(lag.samples[0].value < 60.0, "{lag:?}");

    // The pipeline-wide gauges come from one process only (the
    // extractor's), so sums over a pipeline's processes are right.
    for g in [
        "skein_outbox_pending",
        "skein_source_lag_bytes",
        "skein_explicit_pending_keys",
        "skein_metrics_last_refresh_timestamp_seconds",
    ] {
        let n = s.samples(g, &[]).len();
        assert_eq!(n, 1, "{g} is served by {n} processes");
    }
    assert_eq!(
        s.samples("skein_transport_lag_records", &[("partition", "0")])
            .len(),
        1
    );
    assert!(s
        .family(x, "skein_metrics_last_refresh_timestamp_seconds")
        .is_some());

    // An explicit run of an unchanged aggregate: counted under its own
    // trigger, not as records read from the source.
    env.skein_ok(&["explicit", "--entity", "customer", "--keys", "3"]);
    let after = scrape_until(&ports, |s| {
        s.sum("skein_events_unchanged_total", &[("trigger", "explicit")]) >= 1.0
    })
    .await;
    assert_eq!(
        after.sum("skein_events_unchanged_total", &[("trigger", "explicit")]),
        1.0
    );
    assert!(after.sum("skein_applier_batches_total", &[("trigger", "explicit")]) >= 1.0);
    assert_eq!(after.sum("skein_applier_records_total", &[]), extracted);
    assert_eq!(after.sum("skein_event_latency_seconds_count", &[]), events);

    // Types and help texts as Prometheus users expect them.
    s.assert_families(
        x,
        &[
            ("skein_source_changes", "counter"),
            ("skein_source_transactions", "counter"),
            ("skein_extractor_records", "counter"),
            ("skein_extractor_batches", "counter"),
            ("skein_data_loss_events", "counter"),
            ("skein_source_lag_seconds", "gauge"),
            ("skein_source_lag_bytes", "gauge"),
            ("skein_extractor_handover_duration_seconds", "histogram"),
            ("skein_transport_lag_records", "gauge"),
            ("skein_outbox_pending", "gauge"),
            ("skein_outbox_oldest_pending_seconds", "gauge"),
            ("skein_explicit_pending_keys", "gauge"),
            ("skein_metrics_refresh_failures", "counter"),
            ("skein_info", "gauge"),
        ],
    );
    let a = *env.processes().last().unwrap();
    s.assert_families(
        a,
        &[
            ("skein_applier_records", "counter"),
            ("skein_applier_batches", "counter"),
            ("skein_applier_duplicates", "counter"),
            ("skein_events_published", "counter"),
            ("skein_events_unchanged", "counter"),
            ("skein_applier_batch_duration_seconds", "histogram"),
            ("skein_event_latency_seconds", "histogram"),
            ("skein_relay_sent", "counter"),
            ("skein_relay_failures", "counter"),
            ("skein_dead_letters", "counter"),
        ],
    );
    run.stop(&env);
}

/// The outbox gauge shows rows waiting while the sink cannot take them,
/// and the relay's failures climb: a Kafka sink whose broker is not there
/// (a port nothing listens on), with a 2 s delivery timeout.
#[tokio::test(flavor = "multi_thread")]
async fn a_relay_that_cannot_send_shows_pending_rows_and_failures() {
    let dead = free_port();
    let env = Env::new("metrics_stuck", |y| {
        quick_refresh(y).replace(
            "sink:\n  kind: file\n  path: ${SKEIN_OUT_DIR}/events.jsonl\n  also_stdout: false\n",
            &format!(
                "sink:\n  kind: kafka\n  brokers: 127.0.0.1:{dead}\n  \
                 kafka_properties: {{ message.timeout.ms: \"2000\" }}\n  topic_prefix: metrics_stuck\n"
            ),
        )
    })
    .await;
    assert!(std::fs::read_to_string(&env.config)
        .unwrap()
        .contains("kind: kafka\n  brokers: 127.0.0.1"));
    let (mut run, ports) = start_with_metrics(&env).await;
    env.exec("INSERT INTO customer (id, name) VALUES (1, 'Ada'), (2, 'Bob')")
        .await;
    let s = scrape_until(&ports, |s| {
        s.sum("skein_outbox_pending", &[]) >= 2.0 && s.sum("skein_relay_failures_total", &[]) >= 1.0
    })
    .await;
    run.check_alive(&env);
    assert!(
        s.sum("skein_outbox_pending", &[]) >= 2.0,
        "the unsent events are pending: {:?}",
        s.samples("skein_outbox_pending", &[])
    );
    assert!(s.sum("skein_relay_failures_total", &[]) >= 1.0);
    assert_eq!(s.sum("skein_relay_sent_total", &[]), 0.0);
    assert!(s.sum("skein_outbox_oldest_pending_seconds", &[]) > 0.0);
    assert_eq!(s.sum("skein_events_published_total", &[]), 2.0);
    drop(run);
}

/// An address that cannot be served stops the process with the reason.
#[tokio::test(flavor = "multi_thread")]
async fn a_metrics_port_in_use_is_a_clear_error() {
    let env = Env::new("metrics_busy", |y| y).await;
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let what = env.processes()[0];
    let out = env
        .command(&["--metrics-addr", &addr, what])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(&format!("serving metrics on {addr}")), "{err}");
}
