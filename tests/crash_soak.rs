//! Crash soak: the real `skein run` under a seeded random workload on the
//! quickstart schema, SIGKILLed at random moments and restarted, then checked
//! against the database's final state.
//!
//! `SKEIN_SOAK_SEED=<u64>` replays a seed (the seed fixes the workload and the
//! kill delays; where in the pipeline a kill lands still depends on timing).
//! `SKEIN_SOAK_CHANGES` and `SKEIN_SOAK_KILLS` raise the defaults.

mod common;

use std::time::{Duration, Instant};

use common::soak::{check, env_num, play_workload, random_statement, soak_seed, AGGREGATES};
use common::*;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

#[tokio::test(flavor = "multi_thread")]
async fn sigkill_soak_keeps_events_exactly_once_and_final_state_right() {
    let seed = soak_seed();
    let target_changes = env_num("SKEIN_SOAK_CHANGES", 20_000);
    let min_kills = env_num("SKEIN_SOAK_KILLS", 12);
    // Printed first so a failure can be replayed; also in every assertion.
    eprintln!("crash soak seed: SKEIN_SOAK_SEED={seed}");
    let ctx = format!("(SKEIN_SOAK_SEED={seed})");

    // Small batches so a backlog spans many batches and kills land between them.
    let env = Env::new("crash_soak", |y| {
        y.replace(
            "state_dir:",
            "extractor: { max_batch_changes: 500 }\nstate_dir:",
        )
    })
    .await;
    let mut rng = StdRng::seed_from_u64(seed);
    let workload_seed: u64 = rng.gen();

    let mut run = env.start().await;
    let url = env.url.clone();
    let workload = tokio::spawn(async move {
        play_workload(
            &url,
            workload_seed,
            target_changes,
            |r| random_statement(r, AGGREGATES),
            true,
        )
        .await
    });

    let mut kills = 0u64;
    while !workload.is_finished() || kills < min_kills {
        tokio::time::sleep(Duration::from_millis(rng.gen_range(200..1500))).await;
        run.check_alive(&env);
        run.kill();
        kills += 1;
        // Sometimes restart at once, sometimes leave a backlog to catch up on.
        tokio::time::sleep(Duration::from_millis(rng.gen_range(0..600))).await;
        run = env.start().await;
    }
    let changes = workload.await.unwrap();
    eprintln!("crash soak: {changes} changes, {kills} SIGKILLs {ctx}");
    assert!(changes >= target_changes, "{ctx}");
    assert!(kills >= min_kills, "{ctx}");

    let started = Instant::now();
    env.settle_within(&mut run, Duration::from_secs(300)).await;
    eprintln!("crash soak: drained in {:?} {ctx}", started.elapsed());
    run.stop(&env);

    check(&env, &ctx, None, false).await;
}
