//! The pipeline's processes under faults: SIGKILL at seeded moments, broker
//! restarts that keep the data directory, batch sizes rewritten between
//! restarts, the extractor's state directory deleted now and then.

use std::collections::BTreeMap;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::topic_partition_list::{Offset, TopicPartitionList};
use rdkafka::ClientConfig;
use tokio::task::JoinHandle;

use super::check::Violations;
use super::workload::Played;
use super::Transport;
use crate::common::{root, Env};

const BATCH_CHANGES: [u64; 6] = [1, 10, 100, 500, 2_000, 10_000];
const BATCH_RECORDS: [u64; 5] = [3, 30, 200, 1_000, 10_000];
/// `transport.records_per_message` over Kafka (the tests' config says
/// 1000): each record alone, small packs, large packs; changed between
/// restarts, so a topic holds both and an applier reads packs an earlier
/// extractor wrote.
const RECORDS_PER_MESSAGE: [u64; 3] = [1, 7, 1_000];

/// What the faults did.
#[derive(Default)]
pub struct Figures {
    pub kills: BTreeMap<String, u64>,
    pub self_exits: BTreeMap<String, u64>,
    /// Processes started with `SKEIN_FAILPOINT` that aborted there.
    pub failpoint_aborts: BTreeMap<String, u64>,
    /// Appliers stalled mid-batch while a replacement took their
    /// partitions, then woken: (set up, whose commit was fenced).
    pub zombies: u64,
    pub zombies_fenced: u64,
    pub broker_restarts: u64,
    pub state_wipes: u64,
    pub rewrites: u64,
    pub batch_changes_used: Vec<u64>,
    pub batch_records_used: Vec<u64>,
    pub records_per_message_used: Vec<u64>,
}

/// One process of the pipeline.
struct Proc {
    /// `run`, `extract`, `apply-N`, `relay`.
    kind: String,
    child: Option<Child>,
    /// When a stopped process is started again.
    restart_at: Option<Instant>,
    /// The failpoint the running process was started with.
    failpoint: Option<String>,
}

/// An applier made a zombie: started with a stall before its sidecar
/// commit; once it stalls a replacement with its instance id takes its
/// partitions; when it wakes, its commit must be fenced.
struct Zombie {
    /// Index of its kind in `procs`.
    proc: usize,
    log: PathBuf,
    /// Set once it stalled (the replacement runs in `procs`).
    child: Option<Child>,
    /// Give up waiting for the stall / SIGKILL it.
    deadline: Instant,
}

/// Failpoints a restarted process may be armed with (it aborts there: a
/// crash at an exact window), by process command.
fn failpoints(command: &str) -> &'static [&'static str] {
    match command {
        "run" => &[
            "extractor.after_ack_before_marker",
            "applier.before_sidecar",
            "applier.before_commit",
            "applier.after_commit",
            "applier.after_sidecar",
            "relay.after_send_before_mark",
        ],
        "extract" => &["extractor.after_ack_before_marker"],
        "apply" => &[
            "applier.before_sidecar",
            "applier.before_commit",
            "applier.after_commit",
            "applier.after_sidecar",
        ],
        "relay" => &["relay.after_send_before_mark"],
        _ => &[],
    }
}

/// How long a zombie stalls before its sidecar commit.
const ZOMBIE_STALL_MS: u64 = 5_000;

fn command_of(kind: &str) -> &str {
    kind.split_once('-').map_or(kind, |(c, _)| c)
}

/// A fault the harness injects.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fault {
    Kill,
    BrokerRestart,
    Zombie,
}

/// The pipeline of one harness run.
pub struct Pipeline<'a> {
    env: &'a Env,
    transport: Transport,
    base_yaml: String,
    procs: Vec<Proc>,
    rng: StdRng,
    /// Draws `records_per_message` only, so that drawing it leaves the
    /// fault schedule of a seed as it was before it was varied.
    pack_rng: StdRng,
    /// Kill order: every kind once per round, shuffled.
    round: Vec<String>,
    zombie: Option<Zombie>,
    started: Instant,
    pub figures: Figures,
}

fn extractor_kind(kind: &str) -> bool {
    matches!(kind, "run" | "extract")
}

impl<'a> Pipeline<'a> {
    pub fn new(env: &'a Env, transport: Transport, seed: u64) -> Pipeline<'a> {
        let kinds: Vec<&str> = match transport {
            Transport::InProcess => vec!["run"],
            Transport::Kafka => vec!["extract", "apply-0", "apply-1", "apply-2", "relay"],
        };
        std::fs::create_dir_all(env.dir.join("logs")).unwrap();
        let mut p = Pipeline {
            env,
            transport,
            base_yaml: std::fs::read_to_string(&env.config).unwrap(),
            procs: kinds
                .iter()
                .map(|k| Proc {
                    kind: k.to_string(),
                    child: None,
                    restart_at: None,
                    failpoint: None,
                })
                .collect(),
            rng: StdRng::seed_from_u64(seed),
            pack_rng: StdRng::seed_from_u64(seed ^ 0x7061_636b),
            round: vec![],
            zombie: None,
            started: Instant::now(),
            figures: Figures::default(),
        };
        p.rewrite_config();
        p
    }

    /// A line of the fault timeline, stamped with the time since the start.
    fn note(&self, what: &str) {
        eprintln!(
            "chaos +{:6.1}s: {what}",
            self.started.elapsed().as_secs_f64()
        );
    }

    fn log_path(&self, kind: &str) -> PathBuf {
        self.env.dir.join("logs").join(format!("{kind}.log"))
    }

    /// The last lines of a process's log.
    fn tail(&self, kind: &str, lines: usize) -> String {
        let text = std::fs::read_to_string(self.log_path(kind)).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    fn tails(&self) -> String {
        self.procs
            .iter()
            .map(|p| format!("--- {} (last lines)\n{}\n", p.kind, self.tail(&p.kind, 15)))
            .collect()
    }

    /// New batch sizes for the processes started from now on: the
    /// extractor's `max_batch_changes`, over Kafka the appliers'
    /// `max_batch_records` and the extractor's `records_per_message`.
    /// Written whole and renamed into place.
    fn rewrite_config(&mut self) {
        let changes = *BATCH_CHANGES.choose(&mut self.rng).unwrap();
        let mut yaml = self.base_yaml.replace(
            "state_dir:",
            &format!("extractor: {{ max_batch_changes: {changes} }}\nstate_dir:"),
        );
        self.figures.batch_changes_used.push(changes);
        if self.transport == Transport::Kafka {
            let records = *BATCH_RECORDS.choose(&mut self.rng).unwrap();
            let pack = *RECORDS_PER_MESSAGE.choose(&mut self.pack_rng).unwrap();
            let line = "  records_per_message: 1000\n";
            assert!(
                yaml.contains(line),
                "the Kafka config no longer says `{}`: the chaos harness cannot vary it",
                line.trim()
            );
            yaml = yaml
                .replace(
                    "  relay_in_apply: false\n",
                    &format!("  relay_in_apply: false\n  max_batch_records: {records}\n"),
                )
                .replace(line, &format!("  records_per_message: {pack}\n"));
            self.figures.batch_records_used.push(records);
            self.figures.records_per_message_used.push(pack);
        }
        let tmp = self.env.config.with_extension("yaml.tmp");
        std::fs::write(&tmp, yaml).unwrap();
        std::fs::rename(&tmp, &self.env.config).unwrap();
        self.figures.rewrites += 1;
    }

    /// Starts a process of `kind`, its standard error appended to `log`.
    fn start(&self, kind: &str, failpoint: Option<&str>, log: &Path) -> Child {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .unwrap();
        let mut c = self.env.command(&[command_of(kind)]);
        if kind.contains('-') {
            // Static membership: a restarted applier takes its partitions
            // back at once (noida never expires a dead member).
            c.env("SKEIN_INSTANCE_ID", format!("{}-{kind}", self.env.name));
        }
        if let Some(f) = failpoint {
            c.env("SKEIN_FAILPOINT", f);
        }
        c.stdout(Stdio::null()).stderr(log).spawn().unwrap()
    }

    fn spawn(&mut self, i: usize, failpoint: Option<String>) {
        let kind = self.procs[i].kind.clone();
        let child = self.start(&kind, failpoint.as_deref(), &self.log_path(&kind));
        self.procs[i].child = Some(child);
        self.procs[i].restart_at = None;
        self.procs[i].failpoint = failpoint;
    }

    /// Starts every process and waits until the slot streams.
    pub async fn start_all(&mut self) {
        // As a deployment does first: `skein relay` does not create the
        // sidecar schema (`run` and `apply` do).
        self.env.skein_ok(&["sidecar", "migrate"]);
        for i in 0..self.procs.len() {
            self.spawn(i, None);
        }
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let streaming = self
                .env
                .db
                .query_opt(
                    "SELECT 1 FROM pg_replication_slots s JOIN pg_stat_replication r ON r.pid = s.active_pid \
                     WHERE s.slot_name = $1",
                    &[&self.env.slot()],
                )
                .await
                .unwrap()
                .is_some();
            if streaming {
                return;
            }
            for i in 0..self.procs.len() {
                if let Some(s) = self.procs[i].child.as_mut().unwrap().try_wait().unwrap() {
                    let kind = &self.procs[i].kind;
                    panic!(
                        "skein {kind} exited at start with {s}:\n{}",
                        self.tail(kind, 40)
                    );
                }
            }
            assert!(
                Instant::now() < deadline,
                "the pipeline did not start:\n{}",
                self.tails()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Restarts what is due, and notes (and restarts) a process that
    /// exited by itself: at the failpoint it was armed with, or not.
    fn tend(&mut self) {
        let now = Instant::now();
        for i in 0..self.procs.len() {
            if let Some(c) = self.procs[i].child.as_mut() {
                if let Some(status) = c.try_wait().unwrap() {
                    let kind = self.procs[i].kind.clone();
                    if self.procs[i].failpoint.is_some() && status.signal() == Some(6) {
                        *self.figures.failpoint_aborts.entry(kind).or_default() += 1;
                    } else {
                        self.note(&format!(
                            "skein {kind} exited by itself with {status}; restarting it. Its log ends:\n{}",
                            self.tail(&kind, 12)
                        ));
                        *self.figures.self_exits.entry(kind).or_default() += 1;
                    }
                    if self
                        .zombie
                        .as_ref()
                        .is_some_and(|z| z.proc == i && z.child.is_none())
                    {
                        // Armed as a zombie but gone before it stalled.
                        self.zombie = None;
                    }
                    self.procs[i].child = None;
                    self.procs[i].restart_at = Some(now + Duration::from_millis(500));
                }
            }
            if self.procs[i].child.is_none() && self.procs[i].restart_at.is_some_and(|t| t <= now) {
                if self.rng.gen_bool(0.5) {
                    self.rewrite_config();
                }
                // Now and then a crash at an exact window instead of a
                // random moment.
                let points = failpoints(command_of(&self.procs[i].kind));
                let failpoint = (self.rng.gen_bool(0.25) && !points.is_empty()).then(|| {
                    format!(
                        "{}:{}",
                        points.choose(&mut self.rng).unwrap(),
                        self.rng.gen_range(1..=20)
                    )
                });
                if let Some(f) = &failpoint {
                    self.note(&format!(
                        "starting skein {} armed with failpoint {f}",
                        self.procs[i].kind
                    ));
                }
                self.spawn(i, failpoint);
            }
        }
        self.tend_zombie();
    }

    /// Arms one applier as a zombie: restarted with a stall before its
    /// sidecar commit. False when no applier runs.
    fn make_zombie(&mut self) -> bool {
        let running: Vec<usize> = (0..self.procs.len())
            .filter(|i| {
                command_of(&self.procs[*i].kind) == "apply" && self.procs[*i].child.is_some()
            })
            .collect();
        let Some(&i) = running.choose(&mut self.rng) else {
            return false;
        };
        let mut c = self.procs[i].child.take().unwrap();
        let _ = c.kill();
        let _ = c.wait();
        self.figures.zombies += 1;
        let kind = self.procs[i].kind.clone();
        let log = self
            .env
            .dir
            .join("logs")
            .join(format!("{kind}.zombie-{}.log", self.figures.zombies));
        let stall = format!("applier.before_sidecar:1:sleep={ZOMBIE_STALL_MS}");
        let child = self.start(&kind, Some(&stall), &log);
        self.procs[i].child = Some(child);
        self.procs[i].failpoint = Some(stall);
        self.note(&format!(
            "zombie: restarting skein {kind} to stall {ZOMBIE_STALL_MS} ms before its first sidecar commit"
        ));
        self.zombie = Some(Zombie {
            proc: i,
            log,
            child: None,
            deadline: Instant::now() + Duration::from_secs(30),
        });
        true
    }

    /// Once the armed applier stalls, starts its replacement; once the
    /// zombie had time to wake and try its commit, kills it and notes
    /// whether that commit was fenced.
    fn tend_zombie(&mut self) {
        let Some(z) = self.zombie.as_mut() else {
            return;
        };
        let log = std::fs::read_to_string(&z.log).unwrap_or_default();
        match z.child.as_mut() {
            None => {
                if log.contains("failpoint `applier.before_sidecar` reached, stalling") {
                    let i = z.proc;
                    z.child = self.procs[i].child.take();
                    z.deadline = Instant::now() + Duration::from_millis(ZOMBIE_STALL_MS + 5_000);
                    let kind = self.procs[i].kind.clone();
                    self.note(&format!(
                        "zombie: skein {kind} stalls before its sidecar commit; starting its replacement"
                    ));
                    self.spawn(i, None);
                } else if Instant::now() > z.deadline {
                    // Nothing reached it: leave it running as it is.
                    self.zombie = None;
                }
            }
            Some(c) => {
                let exited = c.try_wait().unwrap().is_some();
                if exited || Instant::now() > z.deadline {
                    let _ = c.kill();
                    let _ = c.wait();
                    let fenced = log.contains("fenced: another applier moved");
                    if fenced {
                        self.figures.zombies_fenced += 1;
                    }
                    self.note(&format!(
                        "zombie: done, its commit {}",
                        if fenced {
                            "was fenced"
                        } else {
                            "was not fenced (did the replacement commit first?)"
                        }
                    ));
                    self.zombie = None;
                }
            }
        }
    }

    /// SIGKILLs one process, chosen so that every kind is killed once per
    /// round, and schedules its restart; sometimes deletes the
    /// extractor's state directory before it restarts. False when every
    /// process is down already.
    fn kill_one(&mut self) -> bool {
        for _ in 0..2 * self.procs.len() {
            if self.round.is_empty() {
                self.round = self.procs.iter().map(|p| p.kind.clone()).collect();
                self.round.shuffle(&mut self.rng);
            }
            let kind = self.round.pop().unwrap();
            let armed = self
                .zombie
                .as_ref()
                .filter(|z| z.child.is_none())
                .map(|z| z.proc);
            let Some(i) = self
                .procs
                .iter()
                .enumerate()
                .position(|(i, p)| p.kind == kind && p.child.is_some() && Some(i) != armed)
            else {
                continue;
            };
            let mut c = self.procs[i].child.take().unwrap();
            let _ = c.kill();
            let _ = c.wait();
            let killed = self.figures.kills.entry(kind.clone()).or_default();
            *killed += 1;
            let nth = *killed;
            // Mostly a quick restart; sometimes down long enough to leave
            // a backlog.
            let down = match self.rng.gen_range(0..10) {
                0..=5 => self.rng.gen_range(0..500),
                6..=8 => self.rng.gen_range(500..3_000),
                _ => self.rng.gen_range(3_000..8_000),
            };
            self.procs[i].restart_at = Some(Instant::now() + Duration::from_millis(down));
            if extractor_kind(&kind)
                && (self.rng.gen_bool(0.3) || (nth == 2 && self.figures.state_wipes == 0))
            {
                // The slot still exists: skein must resume from it and the
                // sidecar's progress without loss.
                // (A process killed right after its start may not have
                // created it yet.)
                match std::fs::remove_dir_all(self.env.dir.join("state")) {
                    Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                        panic!("chaos: deleting the state directory: {e}")
                    }
                    _ => {}
                }
                self.figures.state_wipes += 1;
                self.note(&format!(
                    "SIGKILL skein {kind}, deleted its state directory, restart in {down} ms"
                ));
            } else {
                self.note(&format!("SIGKILL skein {kind}, restart in {down} ms"));
            }
            return true;
        }
        false
    }

    /// Restarts the broker (noida: SIGTERM, start again on the same port
    /// and data directory) and checks that it kept the change topic's
    /// records and the group's committed offsets, and that no partition's
    /// sidecar progress is past the log end.
    ///
    /// noida-db 0.2.3 loses the records it acknowledged in about the last
    /// 100 ms before it stops (found by this harness; reproduce with
    /// `SKEIN_CHAOS_BROKER_RESTART_UNDER_LOAD=1`). So, unless that is set,
    /// the Kafka clients (extractor, appliers) are paused (SIGSTOP) half a
    /// second before the broker stops and resumed once it is back: they
    /// still meet a broker that went away and came back, but not its bug.
    async fn restart_broker(&mut self, v: &mut Violations) {
        // Knobs::from_env checked the broker is noida.
        let brokers = crate::common::kafka_brokers_required();
        let port = brokers
            .rsplit_once(':')
            .map(|(_, p)| p.to_string())
            .expect("SKEIN_TEST_KAFKA_BROKERS is host:port");
        let topic = self.env.topic();
        let under_load =
            std::env::var("SKEIN_CHAOS_BROKER_RESTART_UNDER_LOAD").as_deref() == Ok("1");
        let paused: Vec<u32> = if under_load {
            vec![]
        } else {
            self.procs
                .iter()
                .filter(|p| matches!(command_of(&p.kind), "extract" | "apply"))
                .filter_map(|p| p.child.as_ref())
                .chain(self.zombie.as_ref().and_then(|z| z.child.as_ref()))
                .map(Child::id)
                .collect()
        };
        signal(&paused, "STOP");
        if !paused.is_empty() {
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        let before = {
            let (b, t) = (brokers.clone(), topic.clone());
            tokio::task::spawn_blocking(move || kafka_offsets(&b, &t))
                .await
                .unwrap()
        };
        let out = tokio::task::spawn_blocking(move || {
            Command::new("bash")
                .arg("-c")
                .arg(format!(
                    "source scripts/lib/kafka.sh && skein_kafka_restart {port}"
                ))
                .current_dir(root())
                .stdin(Stdio::null())
                .output()
                .unwrap()
        })
        .await
        .unwrap();
        if !out.status.success() {
            signal(&paused, "CONT");
            panic!(
                "chaos: restarting the broker failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        self.figures.broker_restarts += 1;
        let after = {
            let (b, t) = (brokers.clone(), topic.clone());
            tokio::task::spawn_blocking(move || kafka_offsets(&b, &t))
                .await
                .unwrap()
        };
        let progress: Vec<(i32, String)> = self
            .env
            .db
            .query(
                "SELECT partition, position::text FROM skein.progress WHERE topic = $1",
                &[&topic],
            )
            .await
            .unwrap()
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect();
        signal(&paused, "CONT");
        match (before, after) {
            (Ok(before), Ok(after)) => {
                for (p, (b, a)) in before.iter().zip(&after).enumerate() {
                    if a.0 != b.0 || a.1 < b.1 || a.2 < b.2 {
                        v.add("broker lost data", || {
                            format!(
                                "partition {p}: (low, high, committed) {b:?} before the restart, {a:?} after"
                            )
                        });
                    }
                }
                for (p, at) in &progress {
                    let at: i64 = at.parse().unwrap();
                    let end = after.get(*p as usize).map_or(0, |a| a.1);
                    if at > end {
                        v.add("broker lost data", || {
                            format!(
                                "partition {p}: the appliers applied up to offset {at}, the log ends at {end} after the restart"
                            )
                        });
                    }
                }
                self.note(&format!(
                    "broker restarted{}; (low, high, committed) per partition before {before:?}, after {after:?}",
                    if under_load { " under load" } else { "" }
                ));
            }
            (b, a) => {
                v.add("broker lost data", || {
                    format!("offsets unreadable around a restart: before {b:?}, after {a:?}")
                });
            }
        }
    }

    /// Faults until the workload finished and every planned fault happened
    /// (`kills` SIGKILLs, `restarts` broker restarts, `zombies` zombie
    /// appliers), spread so that they land while the workload runs; more
    /// SIGKILLs while it still runs after that.
    pub async fn chaos(
        &mut self,
        workload: &JoinHandle<Played>,
        kills: u64,
        restarts: u64,
        zombies: u64,
        v: &mut Violations,
    ) {
        let mut plan: Vec<Fault> = std::iter::repeat_n(Fault::Kill, kills as usize)
            .chain(std::iter::repeat_n(Fault::BrokerRestart, restarts as usize))
            .chain(std::iter::repeat_n(Fault::Zombie, zombies as usize))
            .collect();
        plan.shuffle(&mut self.rng);
        let gap = match self.transport {
            Transport::InProcess => 2_000,
            Transport::Kafka => 3_000,
        };
        let mut next = Instant::now() + Duration::from_millis(self.rng.gen_range(gap / 4..gap));
        loop {
            self.tend();
            if Instant::now() >= next {
                let fault = match plan.pop() {
                    Some(f) => f,
                    None if !workload.is_finished() => Fault::Kill,
                    None if self.zombie.is_some() => {
                        next = Instant::now() + Duration::from_millis(200);
                        continue;
                    }
                    None => break,
                };
                let done = match fault {
                    Fault::BrokerRestart => {
                        self.restart_broker(v).await;
                        true
                    }
                    Fault::Kill => self.kill_one(),
                    // One zombie at a time.
                    Fault::Zombie => self.zombie.is_none() && self.make_zombie(),
                };
                next = if done {
                    Instant::now() + Duration::from_millis(self.rng.gen_range(gap / 3..gap * 5 / 3))
                } else {
                    // Not possible right now: try again shortly.
                    plan.push(fault);
                    Instant::now() + Duration::from_millis(200)
                };
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // Everything up again, unarmed, for the drain and a clean stop.
        for i in 0..self.procs.len() {
            if self.procs[i].failpoint.is_some() {
                if let Some(mut c) = self.procs[i].child.take() {
                    let _ = c.kill();
                    let _ = c.wait();
                }
            }
            if self.procs[i].child.is_none() {
                self.spawn(i, None);
            }
        }
    }

    /// Waits until everything committed so far is through the pipeline and
    /// relayed: the slot confirmed a probe written now, the outbox is empty
    /// and (Kafka) every partition's progress is at the log end.
    pub async fn settle(&mut self, within: Duration) {
        let probe = self.env.probe().await;
        let deadline = Instant::now() + within;
        loop {
            self.tend();
            if self.env.drained(&probe).await {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "chaos: the pipeline did not drain within {within:?}:\n{}",
                self.tails()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// SIGTERM to every process; each must exit cleanly.
    pub fn stop(&mut self) {
        for p in &self.procs {
            if let Some(c) = &p.child {
                let _ = Command::new("kill")
                    .arg("-TERM")
                    .arg(c.id().to_string())
                    .status();
            }
        }
        let mut bad = vec![];
        for p in &mut self.procs {
            if let Some(mut c) = p.child.take() {
                let status = c.wait().unwrap();
                if !status.success() {
                    bad.push(format!("{} ({status})", p.kind));
                }
            }
        }
        assert!(
            bad.is_empty(),
            "chaos: did not stop cleanly: {bad:?}\n{}",
            self.tails()
        );
    }
}

impl Drop for Pipeline<'_> {
    fn drop(&mut self) {
        for p in &mut self.procs {
            if let Some(mut c) = p.child.take() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}

/// Sends SIGSTOP / SIGCONT (`sig`) to processes.
fn signal(pids: &[u32], sig: &str) {
    for pid in pids {
        let _ = Command::new("kill")
            .arg(format!("-{sig}"))
            .arg(pid.to_string())
            .status();
    }
}

/// (low watermark, high watermark, the appliers' committed offset) of every
/// partition of the change topic; the group is named after the topic.
fn kafka_offsets(brokers: &str, topic: &str) -> Result<Vec<(i64, i64, i64)>, String> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match try_kafka_offsets(brokers, topic) {
            Ok(o) => return Ok(o),
            Err(e) if Instant::now() > deadline => return Err(e),
            Err(_) => std::thread::sleep(Duration::from_millis(500)),
        }
    }
}

fn try_kafka_offsets(brokers: &str, topic: &str) -> Result<Vec<(i64, i64, i64)>, String> {
    let c: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", topic)
        .set("enable.auto.commit", "false")
        .create()
        .map_err(|e| e.to_string())?;
    let t = Duration::from_secs(10);
    let md = c
        .fetch_metadata(Some(topic), t)
        .map_err(|e| e.to_string())?;
    let parts = md
        .topics()
        .first()
        .map(|t| t.partitions().len() as i32)
        .unwrap_or(0);
    if parts == 0 {
        return Err(format!("topic {topic} has no partitions"));
    }
    let mut tpl = TopicPartitionList::new();
    for p in 0..parts {
        tpl.add_partition(topic, p);
    }
    let committed = c.committed_offsets(tpl, t).map_err(|e| e.to_string())?;
    (0..parts)
        .map(|p| {
            let (low, high) = c.fetch_watermarks(topic, p, t).map_err(|e| e.to_string())?;
            let off = match committed.find_partition(topic, p).map(|e| e.offset()) {
                Some(Offset::Offset(o)) => o,
                _ => -1,
            };
            Ok((low, high, off))
        })
        .collect()
}
