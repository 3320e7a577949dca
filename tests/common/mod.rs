//! Test harness: a fresh database per test on the real PostgreSQL started by
//! `scripts/test` (`SKEIN_TEST_PG_URL`), and the real `skein` binary.
//! A missing service fails the test; it never passes silently.

#![allow(dead_code)]

pub mod soak;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use tokio_postgres::{Client, NoTls};

pub const BIN: &str = env!("CARGO_BIN_EXE_skein");

pub fn admin_url() -> String {
    std::env::var("SKEIN_TEST_PG_URL").expect(
        "SKEIN_TEST_PG_URL is not set: run the tests with `scripts/test`, which starts PostgreSQL",
    )
}

/// The transport the pipeline tests run over: `SKEIN_TEST_TRANSPORT=kafka`
/// (with `SKEIN_TEST_KAFKA_BROKERS`, both set by `scripts/test`) or the
/// in-process default.
pub fn kafka_brokers() -> Option<String> {
    match std::env::var("SKEIN_TEST_TRANSPORT").as_deref() {
        Ok("kafka") => Some(std::env::var("SKEIN_TEST_KAFKA_BROKERS").expect(
            "SKEIN_TEST_KAFKA_BROKERS is not set: run the tests with `scripts/test`, which starts a broker",
        )),
        Ok("in-process") | Err(_) => None,
        Ok(other) => panic!("SKEIN_TEST_TRANSPORT={other}: use kafka or in-process"),
    }
}

/// The broker of the Kafka tests; they fail without one.
pub fn kafka_brokers_required() -> String {
    std::env::var("SKEIN_TEST_KAFKA_BROKERS").expect(
        "SKEIN_TEST_KAFKA_BROKERS is not set: run the tests with `scripts/test`, which starts a broker",
    )
}

/// Rewrites the quickstart transport section for Kafka, keeping `partitions`
/// on its line. `topic` should be unique: the broker outlives test runs. It
/// names the consumer group too, so parallel tests do not share one.
pub fn kafka_transport_yaml(yaml: &str, brokers: &str, topic: &str) -> String {
    if yaml.contains("transport:\n  kind: kafka\n") {
        return yaml.to_string();
    }
    yaml.replace("  kind: in-process\n", "  kind: kafka\n").replacen(
        "  partitions: 4\n",
        &format!(
            "  partitions: 4\n  brokers: {brokers}\n  topic: {topic}\n  group: {topic}\n  batch_wait_ms: 20\n  \
             records_per_message: 1000\n  \
             kafka_properties: {{ session.timeout.ms: \"6000\", heartbeat.interval.ms: \"500\", max.poll.interval.ms: \"10000\" }}\n"
        ),
        1,
    )
}

/// A topic name no earlier run used.
pub fn fresh_topic(name: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("skein_t_{name}.{nanos}")
}

pub async fn connect(url: &str) -> Client {
    let (c, conn) = tokio_postgres::connect(url, NoTls)
        .await
        .unwrap_or_else(|e| panic!("cannot connect to {url}: {e}"));
    tokio::spawn(async move {
        let _ = conn.await;
    });
    c
}

/// The two columns of every row `sql` returns.
pub async fn pairs<A, B>(db: &Client, sql: &str) -> Vec<(A, B)>
where
    A: for<'a> tokio_postgres::types::FromSql<'a>,
    B: for<'a> tokio_postgres::types::FromSql<'a>,
{
    db.query(sql, &[])
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e:?}"))
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect()
}

/// Panics when a test of this binary already took database `db_name`:
/// the tests of a binary run at once, and two on one database (and one
/// slot, one run folder) fail each other at random.
fn claim_db_name(db_name: &str) {
    static TAKEN: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
    let mut taken = TAKEN.lock().unwrap_or_else(|e| e.into_inner());
    assert!(
        !taken.iter().any(|t| t == db_name),
        "two tests of this binary use database {db_name}: give one of them another name"
    );
    taken.push(db_name.to_string());
}

/// The URL of test database `skein_t_<name>` on the server of `admin_url`.
fn test_db_url(admin_url: &str, name: &str) -> String {
    format!("{}/skein_t_{name}", admin_url.rsplit_once('/').unwrap().0)
}

/// Drops (with its slots) and creates a database.
pub async fn recreate_db(admin: &Client, db_name: &str) {
    claim_db_name(db_name);
    for sql in [
        format!("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE database = '{db_name}'"),
        format!("DROP DATABASE IF EXISTS {db_name} WITH (FORCE)"),
        format!("CREATE DATABASE {db_name}"),
    ] {
        admin.simple_query(&sql).await.unwrap_or_else(|e| panic!("{sql}: {e:?}"));
    }
}

/// The schema and the config an [`Env`] starts from (paths under the
/// repository).
pub struct Files {
    /// SQL creating the source tables.
    pub schema: &'static str,
    /// The skein YAML.
    pub yaml: &'static str,
}

impl Files {
    /// The quickstart's tables and config.
    pub const QUICKSTART: Files = Files {
        schema: "examples/quickstart/schema.sql",
        yaml: "examples/quickstart/skein.yaml",
    };
}

/// The transport of an [`Env`].
pub enum TransportChoice {
    /// As `SKEIN_TEST_TRANSPORT` says ([`kafka_brokers`]).
    FromEnv,
    /// In-process, whatever the environment says.
    InProcess,
    /// Kafka on these brokers, with a fresh topic.
    Kafka(String),
}

/// A fresh database with the quickstart schema, plus a working directory.
pub struct Env {
    pub name: String,
    pub url: String,
    pub dir: PathBuf,
    pub db: Client,
    pub config: PathBuf,
}

impl Env {
    /// Creates database `skein_t_<name>` and a config from the quickstart's,
    /// with `edit` applied to the YAML text.
    pub async fn new(name: &str, edit: impl Fn(String) -> String) -> Env {
        Env::new_at(&admin_url(), name, edit).await
    }

    /// [`Env::new`] with batches of at most `changes` changes, started once
    /// (so its slot exists) and stopped: what is written next is a backlog
    /// the next start reads in batches of that size. Over Kafka an applier
    /// takes at most `changes` records per delivery too, so it sees the
    /// batches one by one as in process, instead of the whole backlog.
    pub async fn stopped_with_batches_of(name: &str, changes: usize) -> Env {
        let env = Env::new(name, |y| {
            y.replace(
                "state_dir:",
                &format!("extractor: {{ max_batch_changes: {changes} }}\nstate_dir:"),
            )
            .replace(
                "  batch_wait_ms: 20\n",
                &format!("  batch_wait_ms: 20\n  max_batch_records: {changes}\n"),
            )
        })
        .await;
        env.start().await.stop(&env);
        env
    }

    /// [`Env::new`] over the Kafka transport (`SKEIN_TEST_KAFKA_BROKERS`),
    /// whatever `SKEIN_TEST_TRANSPORT` says.
    pub async fn new_kafka(name: &str, edit: impl Fn(String) -> String) -> Env {
        let brokers = kafka_brokers_required();
        let topic = fresh_topic(name);
        Env::new(name, move |y| {
            edit(kafka_transport_yaml(&y, &brokers, &topic))
        })
        .await
    }

    /// The change topic of a Kafka env.
    pub fn topic(&self) -> String {
        self.kafka_setting("topic")
    }

    /// A `transport:` setting of a Kafka env's config.
    fn kafka_setting(&self, key: &str) -> String {
        let yaml = std::fs::read_to_string(&self.config).unwrap();
        let prefix = format!("  {key}: ");
        yaml.lines()
            .find_map(|l| l.strip_prefix(prefix.as_str()))
            .expect("a Kafka config")
            .trim()
            .to_string()
    }

    /// [`Env::new`] on the server of `admin_url`.
    pub async fn new_at(admin_url: &str, name: &str, edit: impl Fn(String) -> String) -> Env {
        Env::create(
            admin_url,
            name,
            &Files::QUICKSTART,
            TransportChoice::FromEnv,
            edit,
        )
        .await
    }

    /// A fresh database `skein_t_<name>` with the tables of `files.schema`
    /// and a config from `files.yaml` (paths under the repository; the
    /// YAML's `skein_quickstart` names become `skein_<name>`), over
    /// `transport`, with `edit` applied to the YAML text.
    pub async fn with_files(
        name: &str,
        files: &Files,
        transport: TransportChoice,
        edit: impl Fn(String) -> String,
    ) -> Env {
        Env::create(&admin_url(), name, files, transport, edit).await
    }

    async fn create(
        admin_url: &str,
        name: &str,
        files: &Files,
        transport: TransportChoice,
        edit: impl Fn(String) -> String,
    ) -> Env {
        let admin = connect(admin_url).await;
        recreate_db(&admin, &format!("skein_t_{name}")).await;
        let db = connect(&test_db_url(admin_url, name)).await;
        db.batch_execute(&std::fs::read_to_string(root().join(files.schema)).unwrap())
            .await
            .unwrap();
        Env::existing_with(admin_url, name, files, transport, edit).await
    }

    /// Like [`Env::new`] on a database `skein_t_<name>` the caller created.
    pub async fn new_in_existing(name: &str, edit: impl Fn(String) -> String) -> Env {
        Env::existing_with(
            &admin_url(),
            name,
            &Files::QUICKSTART,
            TransportChoice::FromEnv,
            edit,
        )
        .await
    }

    async fn existing_with(
        admin_url: &str,
        name: &str,
        files: &Files,
        transport: TransportChoice,
        edit: impl Fn(String) -> String,
    ) -> Env {
        let url = test_db_url(admin_url, name);
        let db = connect(&url).await;
        let dir = root().join("target/test-runs").join(name);
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let yaml = std::fs::read_to_string(root().join(files.yaml))
            .unwrap()
            .replace("skein_quickstart", &format!("skein_{name}"))
            .replace("also_stdout: true", "also_stdout: false");
        let brokers = match transport {
            TransportChoice::FromEnv => kafka_brokers(),
            TransportChoice::InProcess => None,
            TransportChoice::Kafka(b) => Some(b),
        };
        let yaml = match brokers {
            Some(b) => kafka_transport_yaml(&yaml, &b, &fresh_topic(name)),
            None => yaml,
        };
        let config = dir.join("skein.yaml");
        std::fs::write(&config, edit(yaml)).unwrap();
        let env = Env {
            name: name.into(),
            url,
            dir,
            db,
            config,
        };
        let out = env.skein(&["sql", "source"]);
        assert!(
            out.status.success(),
            "sql source: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        env.db
            .batch_execute(&String::from_utf8(out.stdout).unwrap())
            .await
            .unwrap();
        env
    }

    /// The processes of the pipeline: `run`, or `extract` + `apply` over Kafka.
    pub fn processes(&self) -> &'static [&'static str] {
        if self.is_kafka() {
            &["extract", "apply"]
        } else {
            &["run"]
        }
    }

    /// The process that holds the slot and the marker.
    pub fn extractor_command(&self) -> &'static str {
        self.processes()[0]
    }

    pub fn is_kafka(&self) -> bool {
        std::fs::read_to_string(&self.config)
            .map(|y| y.contains("transport:\n  kind: kafka\n"))
            .unwrap_or(false)
    }

    pub fn slot(&self) -> String {
        format!("skein_{}", self.name)
    }

    pub fn command(&self, args: &[&str]) -> Command {
        let mut c = Command::new(BIN);
        c.args(args)
            .arg("--config")
            .arg(&self.config)
            .env("SKEIN_SOURCE_URL", &self.url)
            .env("SKEIN_OUT_DIR", &self.dir)
            .env_remove("SKEIN_FAILPOINT")
            .env_remove("SKEIN_METRICS_ADDR")
            .env_remove("SKEIN_INSTANCE_ID");
        c
    }

    pub fn skein(&self, args: &[&str]) -> std::process::Output {
        self.command(args).output().unwrap()
    }

    /// Runs `skein <args>`, asserts success, returns its standard output.
    pub fn skein_ok(&self, args: &[&str]) -> String {
        let out = self.skein(args);
        assert!(
            out.status.success(),
            "skein {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    }

    /// Starts `skein run` and waits until its slot is streaming.
    pub async fn start(&self) -> Running {
        self.start_with(&[]).await
    }

    pub async fn start_with(&self, env: &[(&str, &str)]) -> Running {
        let mut r = self.spawn_all(env);
        self.wait_streaming(&mut r).await;
        r
    }

    /// Starts the pipeline's processes as [`Env::start_with`] does, without
    /// waiting for anything (for a process that may stop at once).
    pub fn spawn_all(&self, env: &[(&str, &str)]) -> Running {
        let mut r = Running { children: vec![] };
        for p in self.processes() {
            // Appliers use static membership: a restarted one takes its
            // partitions back at once (noida-db never expires a member that
            // died without leaving; see scripts/lib/kafka.sh).
            let id = format!("{}-{p}-0", self.name);
            let mut env: Vec<(&str, &str)> = env.to_vec();
            if !env.iter().any(|(k, _)| *k == "SKEIN_INSTANCE_ID") {
                env.push(("SKEIN_INSTANCE_ID", &id));
            }
            r.children.push((p.to_string(), self.spawn(p, &env)));
        }
        r
    }

    /// Starts one more `skein <what>` process into `r` (a second applier).
    pub fn spawn_into(&self, r: &mut Running, what: &str, env: &[(&str, &str)]) {
        r.children.push((what.to_string(), self.spawn(what, env)));
    }

    fn spawn(&self, what: &str, env: &[(&str, &str)]) -> Child {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("skein.log"))
            .unwrap();
        let mut cmd = self.command(&[what]);
        for (k, v) in env {
            cmd.env(k, v);
        }
        cmd.stdout(Stdio::null()).stderr(log).spawn().unwrap()
    }

    pub async fn wait_streaming(&self, r: &mut Running) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let row = self
                .db
                .query_opt(
                    // A walsender streaming the slot, not just "active": the slot is also
                    // active while its creating backend waits for consistency, and
                    // changes committed before that are not decoded.
                    "SELECT 1 FROM pg_replication_slots s JOIN pg_stat_replication r ON r.pid = s.active_pid \
                     WHERE s.slot_name = $1",
                    &[&self.slot()],
                )
                .await
                .unwrap();
            if row.is_some() {
                break;
            }
            r.check_alive(self);
            assert!(
                Instant::now() < deadline,
                "skein did not start: {}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        r.check_alive(self);
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("skein.log")).unwrap_or_default()
    }

    /// `skein <cmd>` that should refuse to start: its stderr once it exited
    /// within `within`, or `None` if it was still running (then killed).
    pub fn refused_within(&self, cmd: &str, within: Duration) -> Option<String> {
        let mut child = self
            .command(&[cmd])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if let Some(status) = child.try_wait().unwrap() {
                let mut err = String::new();
                std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err).unwrap();
                assert!(!status.success(), "skein {cmd} exited cleanly: {err}");
                return Some(err);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = child.kill();
        let _ = child.wait();
        None
    }

    /// Waits until everything committed so far is through the pipeline and relayed.
    pub async fn settle(&self, running: &mut Running) {
        self.settle_within(running, Duration::from_secs(60)).await
    }

    /// [`Env::settle`] with a deadline for a long backlog.
    pub async fn settle_within(&self, running: &mut Running, within: Duration) {
        let probe = self.probe().await;
        let deadline = Instant::now() + within;
        loop {
            running.check_alive(self);
            if self.drained(&probe).await {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "pipeline did not settle: {}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Writes a probe into the WAL now; [`Env::drained`] tells when the
    /// pipeline is past it.
    pub async fn probe(&self) -> String {
        self.db
            .query_one(
                "SELECT pg_logical_emit_message(true, 'skein.probe', '')::text",
                &[],
            )
            .await
            .unwrap()
            .get(0)
    }

    /// Whether everything committed before `probe` is through the pipeline
    /// and relayed: the slot confirmed it, the outbox is empty and (Kafka)
    /// every partition's progress is at the log end.
    pub async fn drained(&self, probe: &str) -> bool {
        let done: Option<bool> = self
            .db
            .query_one(
                "SELECT (SELECT confirmed_flush_lsn >= $1::text::pg_lsn FROM pg_replication_slots WHERE slot_name = $2)
                   AND NOT EXISTS (SELECT 1 FROM skein.outbox WHERE dequeued_at IS NULL)",
                &[&probe, &self.slot()],
            )
            .await
            .unwrap()
            .get(0);
        done == Some(true) && (!self.is_kafka() || self.kafka_caught_up())
    }

    /// Kafka: every partition's sidecar progress is at the log end
    /// (`skein status`).
    pub fn kafka_caught_up(&self) -> bool {
        let out = self.skein(&["status"]);
        if !out.status.success() {
            return false;
        }
        let v: Value = match serde_json::from_slice(&out.stdout) {
            Ok(v) => v,
            Err(_) => return false,
        };
        if v["transport_lag"] != 0 || v["outbox"]["pending"] != 0 {
            return false;
        }
        // The lag is measured against the high watermark, which tansu
        // reports as the start of the last record batch + 1: with a batch
        // of several records half applied it says 0. Nothing past each
        // partition's progress may be fetchable.
        let progress: Vec<(i32, Option<i64>)> = v["partitions"]
            .as_array()
            .map(|ps| {
                ps.iter()
                    .map(|p| {
                        (
                            p["partition"].as_i64().unwrap() as i32,
                            p["progress"].as_i64(),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default();
        !fetchable_past(&self.brokers(), &self.topic(), &progress)
    }

    /// The brokers of a Kafka env.
    pub fn brokers(&self) -> String {
        self.kafka_setting("brokers")
    }

    /// Drops the slot once no walsender holds it any more (a stopped
    /// pipeline's walsender may take a moment to exit).
    pub async fn drop_slot(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let r = self
                .db
                .simple_query(&format!(
                    "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = '{}' AND NOT active",
                    self.slot()
                ))
                .await;
            let gone = self
                .db
                .query_opt(
                    "SELECT 1 FROM pg_replication_slots WHERE slot_name = $1",
                    &[&self.slot()],
                )
                .await
                .unwrap()
                .is_none();
            if r.is_ok() && gone {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "slot {} stayed in use",
                self.slot()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Runs `sql` in a pipeline whose relay aborts the process between a
    /// send and its mark (a failpoint), then starts the pipeline again:
    /// the event was sent once and is still pending.
    pub async fn restart_after_a_crash_before_the_mark(&self, sql: &str) -> Running {
        let run = self
            .start_with(&[("SKEIN_FAILPOINT", "relay.after_send_before_mark")])
            .await;
        self.exec(sql).await;
        let status = run.wait_exit(Duration::from_secs(30));
        assert!(!status.success(), "the failpoint must abort the relay");
        self.start().await
    }

    /// Runs `sql` and waits until the pipeline has published its effect,
    /// so the next step lands in a later batch.
    pub async fn step(&self, running: &mut Running, sql: &str) {
        self.exec(sql).await;
        self.settle(running).await;
    }

    /// Polls `count_sql` (a `count(*)`) until it is above zero, while
    /// `running` stays alive, for at most 30 s.
    pub async fn wait_count(&self, running: &mut Running, count_sql: &str) {
        self.poll_30s(running, &format!("still none: {count_sql}"), async || {
            let n: i64 = self.db.query_one(count_sql, &[]).await.unwrap().get(0);
            n > 0
        })
        .await
    }

    /// Polls `done` every 20 ms until it holds, checking that `running`'s
    /// processes are alive; after 30 s fails with `what` and the log.
    async fn poll_30s(
        &self,
        running: &mut Running,
        what: &str,
        mut done: impl AsyncFnMut() -> bool,
    ) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !done().await {
            running.check_alive(self);
            assert!(Instant::now() < deadline, "{what}\n{}", self.log());
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub async fn exec(&self, sql: &str) {
        self.db
            .batch_execute(sql)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e}"));
    }

    /// Events in the file sink.
    /// The events a receiver of the sink file sees ([`received`]).
    pub fn events(&self) -> Vec<Value> {
        received(self.sent_events())
    }

    /// Every line of the sink file, resends included.
    pub fn sent_events(&self) -> Vec<Value> {
        std::fs::read_to_string(self.dir.join("events.jsonl"))
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }

    /// Events in the outbox, in id order.
    /// The `subject` of every event in the sink file, in order.
    pub fn subjects(&self) -> Vec<String> {
        self.events()
            .iter()
            .map(|e| e["subject"].as_str().unwrap().to_string())
            .collect()
    }

    /// `"<subject> <action>"` of every event in the sink file, in order.
    pub fn subject_actions(&self) -> Vec<String> {
        self.events()
            .iter()
            .map(|e| {
                format!(
                    "{} {}",
                    e["subject"].as_str().unwrap(),
                    e["action"].as_str().unwrap()
                )
            })
            .collect()
    }

    /// The `subject` of every outbox event, in outbox order.
    pub async fn outbox_subjects(&self) -> Vec<String> {
        self.outbox()
            .await
            .iter()
            .map(|e| e["subject"].as_str().unwrap().to_string())
            .collect()
    }

    /// The `key` column of every outbox row, in outbox order.
    pub async fn outbox_keys(&self) -> Vec<String> {
        self.db
            .query("SELECT key FROM skein.outbox ORDER BY id", &[])
            .await
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect()
    }

    pub async fn outbox(&self) -> Vec<Value> {
        self.db
            .query("SELECT event FROM skein.outbox ORDER BY id", &[])
            .await
            .unwrap()
            .iter()
            .map(|r| serde_json::from_str(r.get::<_, &str>(0)).unwrap())
            .collect()
    }
}

/// The pipeline's processes. Dropping it (a failed test) kills them.
pub struct Running {
    /// (command, process)
    pub children: Vec<(String, Child)>,
}

impl Drop for Running {
    fn drop(&mut self) {
        for (_, c) in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Running {
    /// Waits until the log holds `text` (30 s at most), checking the
    /// processes are alive.
    pub async fn wait_log(&mut self, env: &Env, text: &str) {
        let what = format!("no `{text}` in the log:");
        env.poll_30s(self, &what, async || env.log().contains(text))
            .await
    }

    pub fn check_alive(&mut self, env: &Env) {
        for (what, c) in &mut self.children {
            if let Some(status) = c.try_wait().unwrap() {
                panic!("skein {what} exited early with {status}:\n{}", env.log());
            }
        }
    }

    /// SIGTERM and wait; asserts a clean exit of every process.
    pub fn stop(mut self, env: &Env) {
        for (_, c) in &self.children {
            unsafe_kill(c.id(), "TERM");
        }
        for (what, c) in &mut self.children {
            let status = c.wait().unwrap();
            assert!(
                status.success(),
                "skein {what} did not stop cleanly ({status}):\n{}",
                env.log()
            );
        }
    }

    /// SIGKILL and wait (what dropping does).
    pub fn kill(self) {}

    /// SIGKILLs the `i`-th process only and forgets it.
    pub fn kill_one(&mut self, i: usize) {
        let (_, mut c) = self.children.remove(i);
        let _ = c.kill();
        let _ = c.wait();
    }

    /// Waits for one process to exit by itself (e.g. at a failpoint), kills
    /// the others (on drop), and returns that exit status.
    pub fn wait_exit(mut self, within: Duration) -> std::process::ExitStatus {
        let deadline = Instant::now() + within;
        loop {
            for (_, c) in &mut self.children {
                if let Some(s) = c.try_wait().unwrap() {
                    return s;
                }
            }
            if Instant::now() > deadline {
                panic!("no process exited within {within:?}");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

fn unsafe_kill(pid: u32, sig: &str) {
    let _ = Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .status();
}

pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).to_path_buf()
}

/// What a receiver of `sent` sees: each event id once, at its first
/// occurrence. The relay is at least once (DESIGN.md: a crash between a
/// send and its mark sends the row again, with the same id), so a process
/// killed while its relay is mid-send leaves an event twice in the sink.
/// An event repeated under a *different* id stays, and fails the checks.
pub fn received(sent: Vec<Value>) -> Vec<Value> {
    let mut seen = std::collections::HashSet::new();
    sent.into_iter()
        .filter(|e| seen.insert(e["id"].as_str().expect("an event id").to_string()))
        .collect()
}

/// The stable part of an event (drops id, time and correlation id).
pub fn stable(ev: &Value) -> Value {
    let mut e = ev.clone();
    if let Value::Object(m) = &mut e {
        for k in ["id", "time", "correlationid"] {
            assert!(m.remove(k).is_some(), "event lacks `{k}`: {ev}");
        }
    }
    e
}

/// Compares events with `tests/golden/events/<name>.json`; `UPDATE_GOLDEN=1` rewrites it.
/// Order is guaranteed per aggregate only (partitions commit independently),
/// so events are grouped by subject, keeping each aggregate's own order.
pub fn assert_golden(name: &str, events: &[Value]) {
    let mut got: Vec<Value> = events.iter().map(stable).collect();
    got.sort_by(|a, b| a["subject"].as_str().cmp(&b["subject"].as_str()));
    let text = serde_json::to_string_pretty(&got).unwrap() + "\n";
    let path = root()
        .join("tests/golden/events")
        .join(format!("{name}.json"));
    if std::env::var("UPDATE_GOLDEN").is_ok() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, &text).unwrap();
        return;
    }
    let want = std::fs::read_to_string(&path).unwrap_or_else(|_| {
        panic!(
            "missing golden file {}; run with UPDATE_GOLDEN=1 and review it",
            path.display()
        )
    });
    assert_eq!(text, want, "events differ from {}", path.display());
}

/// The one event of `subject` among `events` (fails when there is not
/// exactly one).
pub fn only_event<'a>(events: &'a [Value], subject: &str) -> &'a Value {
    let mine: Vec<&Value> = events.iter().filter(|e| e["subject"] == subject).collect();
    assert_eq!(mine.len(), 1, "{subject}: {mine:?}");
    mine[0]
}

/// How many changes each acknowledged part of a large transaction had
/// handed over, in the order of `log` (the last part of a transaction
/// logs no such line).
pub fn acked_parts(log: &str) -> Vec<u64> {
    log.lines()
        .filter(|l| l.contains("part of a large transaction acknowledged"))
        .filter_map(|l| {
            l.split("handed_over=")
                .nth(1)?
                .split(' ')
                .next()?
                .parse()
                .ok()
        })
        .collect()
}

/// Exactly-once checks that hold for every run: unique ids in the outbox,
/// every file event in the outbox, no aggregate published twice in a row
/// with the same etag (a delete has none, so two deletes in a row count).
pub async fn assert_exactly_once(env: &Env) {
    assert_exactly_once_in(&env.outbox().await, &env.events());
}

/// [`assert_exactly_once`] over given outbox (id order) and file events.
pub fn assert_exactly_once_in(outbox: &[Value], events: &[Value]) {
    let mut ids = std::collections::HashSet::new();
    for e in outbox {
        assert!(
            ids.insert(e["id"].as_str().unwrap().to_string()),
            "duplicate event id {}",
            e["id"]
        );
    }
    for e in events {
        assert!(
            ids.contains(e["id"].as_str().unwrap()),
            "file event {} is not in the outbox",
            e["id"]
        );
    }
    let mut last: std::collections::HashMap<String, Value> = Default::default();
    for e in outbox {
        let subject = e["subject"].as_str().unwrap().to_string();
        if let Some(prev) = last.get(&subject) {
            assert!(
                prev["etag"] != e["etag"],
                "{subject} published twice with the same content: {prev} then {e}"
            );
        }
        last.insert(subject, e.clone());
    }
}

/// Whether a record at or past `progress` (the next offset to apply, `None`:
/// the log start) is fetchable in any of the listed partitions: read until
/// each partition reports its end. Not able to tell within 10 s counts as
/// fetchable.
pub fn fetchable_past(brokers: &str, topic: &str, progress: &[(i32, Option<i64>)]) -> bool {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    use rdkafka::error::KafkaError;
    use rdkafka::{ClientConfig, Offset, TopicPartitionList};
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", format!("{topic}.check"))
        .set("enable.auto.commit", "false")
        .set("enable.partition.eof", "true")
        .set("fetch.wait.max.ms", "10")
        .create()
        .unwrap();
    let mut tpl = TopicPartitionList::new();
    for (p, next) in progress {
        let at = next.map(Offset::Offset).unwrap_or(Offset::Beginning);
        tpl.add_partition_offset(topic, *p, at).unwrap();
    }
    consumer.assign(&tpl).unwrap();
    let mut at_end = std::collections::BTreeSet::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while at_end.len() < progress.len() {
        if Instant::now() > deadline {
            return true;
        }
        match consumer.poll(Duration::from_millis(100)) {
            Some(Ok(_)) => return true,
            Some(Err(KafkaError::PartitionEOF(p))) => {
                at_end.insert(p);
            }
            Some(Err(_)) | None => {}
        }
    }
    false
}
