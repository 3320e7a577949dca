//! The chaos harness (issue 10): a seeded workload on
//! `tests/fixtures/chaos_schema.sql` while the pipeline's processes are
//! SIGKILLed at seeded random moments, the broker is restarted, batch sizes
//! change between restarts and the extractor's state directory is now and
//! then deleted; then, once the pipeline drained, every event is checked
//! (see [`check`]) and the figures are printed.
//!
//! Included by `tests/chaos.rs` only (`#[path]`), so the other test
//! binaries do not compile it. Knobs (environment):
//! `SKEIN_CHAOS_SEED`, `SKEIN_CHAOS_CHANGES`, `SKEIN_CHAOS_KILLS`,
//! `SKEIN_CHAOS_BROKER_RESTARTS`, `SKEIN_CHAOS_ZOMBIES` (Kafka: appliers
//! stalled before their commit while a replacement takes their
//! partitions), `SKEIN_CHAOS_AGGREGATES`,
//! `SKEIN_CHAOS_BIG_TX` (rows of the one large transaction),
//! `SKEIN_CHAOS_SECONDS` (spread the workload over at least this long).

pub mod check;
pub mod faults;
pub mod workload;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::common::soak::env_num;
use crate::common::{connect, kafka_brokers_required, Env, Files, TransportChoice};
use check::{Violations, KINDS};
use faults::Pipeline;
use workload::Plan;

/// The harness's schema and config.
pub const FILES: Files = Files {
    schema: "tests/fixtures/chaos_schema.sql",
    yaml: "tests/fixtures/chaos.yaml",
};

/// Which deployment the harness runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transport {
    /// `skein run`.
    InProcess,
    /// `skein extract` + 3 × `skein apply` + `skein relay` over Kafka.
    Kafka,
}

/// The sizes of a run, from the environment or the short defaults.
#[derive(Clone, Debug)]
pub struct Knobs {
    pub seed: u64,
    pub changes: u64,
    pub kills: u64,
    pub broker_restarts: u64,
    pub zombies: u64,
    pub aggregates: u64,
    pub big_tx: u64,
    pub seconds: u64,
    /// Milliseconds between the hot writer's transactions (0: none).
    pub hot_ms: u64,
}

impl Knobs {
    pub fn from_env(t: Transport) -> Knobs {
        let seed = env_num(
            "SKEIN_CHAOS_SEED",
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64,
        );
        let changes = env_num("SKEIN_CHAOS_CHANGES", 5_000);
        let kills = env_num("SKEIN_CHAOS_KILLS", 8);
        let broker_restarts = match t {
            Transport::InProcess => 0,
            Transport::Kafka => broker_restarts(),
        };
        // A zombie needs a second applier process for its partitions: Kafka only.
        let zombies = match t {
            Transport::InProcess => 0,
            Transport::Kafka => env_num("SKEIN_CHAOS_ZOMBIES", 2),
        };
        // A fault every few seconds: a restarted Kafka process needs longer
        // to be back at work than `skein run`.
        let per_fault = match t {
            Transport::InProcess => 2,
            Transport::Kafka => 3,
        };
        Knobs {
            seed,
            changes,
            kills,
            broker_restarts,
            zombies,
            aggregates: env_num("SKEIN_CHAOS_AGGREGATES", changes.max(100)),
            big_tx: env_num("SKEIN_CHAOS_BIG_TX", (changes / 5).clamp(100, 25_000)),
            seconds: env_num(
                "SKEIN_CHAOS_SECONDS",
                (kills + broker_restarts + zombies) * per_fault,
            ),
            hot_ms: env_num("SKEIN_CHAOS_HOT_MS", 20),
        }
    }
}

/// Broker restarts: only noida-db keeps its data across one (tansu is
/// memory-only), and only `scripts/lib/kafka.sh` knows how to restart it.
fn broker_restarts() -> u64 {
    let n = env_num("SKEIN_CHAOS_BROKER_RESTARTS", 2);
    if n == 0 {
        return 0;
    }
    match std::env::var("SKEIN_TEST_KAFKA_BROKER").as_deref() {
        Ok("noida") => n,
        Ok(other) => {
            eprintln!(
                "chaos: NOTE: no broker restarts on `{other}` (SKEIN_TEST_KAFKA_BROKER): only noida-db keeps its \
                 data across a restart"
            );
            0
        }
        Err(_) => panic!(
            "chaos: broker restarts need SKEIN_TEST_KAFKA_BROKER=noida (the broker of SKEIN_TEST_KAFKA_BROKERS, \
             started by scripts/lib/kafka.sh); set SKEIN_CHAOS_BROKER_RESTARTS=0 to run without them"
        ),
    }
}

/// Runs the harness on `t` and panics, after printing the figures, on any
/// violation.
pub async fn run(t: Transport) {
    let k = Knobs::from_env(t);
    let replay = format!(
        "SKEIN_CHAOS_SEED={} SKEIN_CHAOS_CHANGES={} SKEIN_CHAOS_KILLS={} SKEIN_CHAOS_BROKER_RESTARTS={} \
         SKEIN_CHAOS_ZOMBIES={} SKEIN_CHAOS_AGGREGATES={} SKEIN_CHAOS_BIG_TX={} SKEIN_CHAOS_SECONDS={} SKEIN_CHAOS_HOT_MS={}",
        k.seed,
        k.changes,
        k.kills,
        k.broker_restarts,
        k.zombies,
        k.aggregates,
        k.big_tx,
        k.seconds,
        k.hot_ms
    );
    eprintln!("chaos {t:?}: {replay}");
    let started = Instant::now();
    let (name, choice) = match t {
        Transport::InProcess => ("chaos_in_process", TransportChoice::InProcess),
        Transport::Kafka => (
            "chaos_kafka",
            TransportChoice::Kafka(kafka_brokers_required()),
        ),
    };
    let env = Env::with_files(name, &FILES, choice, |y| match t {
        Transport::InProcess => y,
        // Three appliers over six partitions; the relay is its own process.
        Transport::Kafka => y.replace(
            "  partitions: 4\n",
            "  partitions: 6\n  relay_in_apply: false\n",
        ),
    })
    .await;
    let mut rng = StdRng::seed_from_u64(k.seed);
    let plan = Plan {
        seed: rng.gen(),
        changes: k.changes,
        aggregates: k.aggregates,
        big_tx: k.big_tx,
        duration: Duration::from_secs(k.seconds),
        hot_every: Duration::from_millis(k.hot_ms),
    };
    let mut pipeline = Pipeline::new(&env, t, rng.gen());
    pipeline.start_all().await;

    let db = connect(&env.url).await;
    let hot_db = connect(&env.url).await;
    let workload = tokio::spawn(async move {
        let stop = Arc::new(AtomicBool::new(false));
        let hot = (!plan.hot_every.is_zero())
            .then(|| tokio::spawn(workload::play_hot(hot_db, plan.clone(), stop.clone())));
        let mut played = workload::play(&db, &plan).await;
        stop.store(true, Ordering::Relaxed);
        if let Some(hot) = hot {
            played.merge_hot(hot.await.unwrap());
        }
        played
    });
    let mut violations = Violations::default();
    pipeline
        .chaos(
            &workload,
            k.kills,
            k.broker_restarts,
            k.zombies,
            &mut violations,
        )
        .await;
    let played = workload.await.unwrap();
    let workload_done = started.elapsed();
    eprintln!(
        "chaos {t:?}: workload done: {} changes in {} transactions, {:.1} s ({:.0} changes/s)",
        played.changes,
        played.txs,
        played.elapsed.as_secs_f64(),
        played.changes as f64 / played.elapsed.as_secs_f64()
    );
    let drain_from = Instant::now();
    pipeline
        .settle(Duration::from_secs(120 + k.changes / 200))
        .await;
    let drained = drain_from.elapsed();
    pipeline.stop();

    let seen = check::check(
        &env.db,
        &env.dir.join("events.jsonl"),
        &played.history,
        &mut violations,
    )
    .await;
    let loss_detected = data_loss_is_never_silent(&env, t, k.seed, &mut violations).await;

    // The figures.
    let mut touches: Vec<usize> = played.history.values().map(Vec::len).collect();
    touches.sort_unstable();
    let pct = |p: f64| {
        touches
            .get(((touches.len() as f64 - 1.0) * p) as usize)
            .copied()
            .unwrap_or(0)
    };
    let few = touches.iter().filter(|n| **n <= 3).count();
    let mut report = format!("\n== chaos {t:?} figures ({replay})\n");
    let f = &pipeline.figures;
    report += &format!(
        "  changes                    {} in {} transactions (large one: {} rows; hot writer: {} in {})\n",
        played.changes, played.txs, played.big_tx_rows, played.hot_changes, played.hot_txs
    );
    report += &format!(
        "  aggregates touched         {} (touches per aggregate: median {}, p90 {}, max {}; {:.0}% touched at most 3 times)\n",
        touches.len(),
        pct(0.5),
        pct(0.9),
        pct(1.0),
        100.0 * few as f64 / touches.len().max(1) as f64
    );
    report += &format!(
        "  SIGKILLs                   {} {:?}\n",
        f.kills.values().sum::<u64>(),
        f.kills
    );
    report += &format!("  broker restarts            {}\n", f.broker_restarts);
    report += &format!("  data loss at the end       {loss_detected}\n");
    report += &format!(
        "  zombie appliers            {} (commit fenced: {})\n",
        f.zombies, f.zombies_fenced
    );
    report += &format!(
        "  failpoint aborts           {} {:?}\n",
        f.failpoint_aborts.values().sum::<u64>(),
        f.failpoint_aborts
    );
    report += &format!("  state dir deletions        {}\n", f.state_wipes);
    report += &format!(
        "  config rewrites            {} (drawn for whichever process started next: \
         max_batch_changes {:?}, max_batch_records {:?}, records_per_message {:?})\n",
        f.rewrites, f.batch_changes_used, f.batch_records_used, f.records_per_message_used
    );
    report += &format!(
        "  processes that exited by themselves (restarted) {} {:?}\n",
        f.self_exits.values().sum::<u64>(),
        f.self_exits
    );
    report += &format!("{seen}\n");
    report += &format!(
        "  wall time                  {:.1} s (workload {:.1} s, drain {:.1} s, total to check {:.1} s)\n",
        started.elapsed().as_secs_f64(),
        workload_done.as_secs_f64(),
        drained.as_secs_f64(),
        (workload_done + drained).as_secs_f64()
    );
    report += "  violations:\n";
    for kind in KINDS {
        report += &format!("    {kind:<42} {}\n", violations.get(kind));
    }
    for (kind, n) in &violations.counts {
        if !KINDS.contains(kind) {
            report += &format!("    {kind:<42} {n}\n");
        }
    }
    let examples: BTreeMap<_, _> = violations.examples.iter().collect();
    for (kind, ex) in examples {
        report += &format!("  e.g. {kind}:\n");
        for e in ex {
            report += &format!("    {}\n", e.chars().take(1500).collect::<String>());
        }
    }
    eprintln!("{report}");
    std::fs::write(env.dir.join("report.txt"), &report).unwrap();
    assert!(
        violations.total() == 0,
        "chaos {t:?}: {} violations; replay with {replay}{}",
        violations.total(),
        report
    );
}

/// The last fault, once the checks above are done: with the pipeline down,
/// the slot is dropped (and, for odd seeds, the extractor's state directory
/// deleted too) and the source changes. The extractor must refuse to start
/// with a `data loss` error; in-process, `continue_with_data_loss: true`
/// must then go on and record the loss in a sidecar batch row. Returns
/// what happened, for the figures.
async fn data_loss_is_never_silent(
    env: &Env,
    t: Transport,
    seed: u64,
    v: &mut Violations,
) -> String {
    const KIND: &str = "silent data loss";
    env.drop_slot().await;
    let lost_state = seed % 2 == 1;
    if lost_state {
        let _ = std::fs::remove_dir_all(env.dir.join("state"));
    }
    env.exec(
        "INSERT INTO account (region, acct_no, name, rev) VALUES ('EU', -1, 'changed while the slot was gone', 0)",
    )
    .await;
    let cmd = env.extractor_command();
    let what = format!(
        "slot dropped{}",
        if lost_state {
            " and state directory deleted"
        } else {
            ""
        }
    );
    match env.refused_within(cmd, Duration::from_secs(90)) {
        Some(err) if err.contains("data loss") => {}
        Some(err) => {
            v.add(KIND, || {
                format!("{what}: skein {cmd} refused, but not as data loss: {err}")
            });
            return format!("{what}: refused without saying data loss");
        }
        None => {
            v.add(KIND, || {
                format!("{what}: skein {cmd} started as if nothing was lost")
            });
            return format!("{what}: NOT detected");
        }
    }
    if t == Transport::Kafka {
        return format!("{what}: refused with a data loss error");
    }
    // Going on must leave the loss on record in the sidecar.
    let yaml = std::fs::read_to_string(&env.config).unwrap();
    let yaml = if yaml.contains("extractor: {") {
        yaml.replacen(
            "extractor: {",
            "extractor: { continue_with_data_loss: true,",
            1,
        )
    } else {
        yaml.replacen(
            "state_dir:",
            "extractor: { continue_with_data_loss: true }\nstate_dir:",
            1,
        )
    };
    std::fs::write(&env.config, yaml).unwrap();
    let log = std::fs::File::create(env.dir.join("logs").join("run.data-loss.log")).unwrap();
    let mut run = env.command(&["run"]).stderr(log).spawn().unwrap();
    let deadline = Instant::now() + Duration::from_secs(90);
    let recorded = loop {
        let n: i64 = env
            .db
            .query_one("SELECT count(*) FROM skein.batch WHERE has_data_loss", &[])
            .await
            .unwrap()
            .get(0);
        if n > 0 || Instant::now() > deadline {
            break n > 0;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let _ = run.kill();
    let _ = run.wait();
    if !recorded {
        v.add(KIND, || {
            format!("{what}: with continue_with_data_loss no batch row has has_data_loss")
        });
        return format!("{what}: refused, but going on did not record it");
    }
    format!("{what}: refused, then recorded in a batch row")
}
