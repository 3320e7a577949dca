//! The first start's replication slot, against a real PostgreSQL and the
//! real `skein` binary. A binary of its own: its test holds a transaction
//! id open on purpose, which holds up every logical slot created in the
//! cluster meanwhile, so it must not run beside other tests' first starts.

mod common;

use common::*;

/// PostgreSQL creates a logical slot only once every transaction holding
/// a transaction id on the server has ended: a session left idle in a
/// transaction, in any database, holds skein's first start up. skein says
/// so, naming that session, instead of hanging without a word; once the
/// session ends it starts.
#[tokio::test(flavor = "multi_thread")]
async fn a_first_start_held_up_by_an_open_transaction_names_it() {
    let env = Env::new("slot_creation_wait", |y| y).await;
    let holder = connect(&env.url).await;
    holder.batch_execute("BEGIN").await.unwrap();
    let pid: i32 = holder
        .query_one("SELECT pg_backend_pid(), txid_current()", &[])
        .await
        .unwrap()
        .get(0);
    let mut run = env.spawn_all(&[]);
    run.wait_log(&env, "creating the replication slot waits for transactions")
        .await;
    let log = env.log();
    assert!(
        log.contains(&format!("pid {pid} (database skein_t_slot_creation_wait")),
        "the warning does not name the open transaction (pid {pid}):\n{log}"
    );
    holder.batch_execute("COMMIT").await.unwrap();
    env.wait_streaming(&mut run).await;
    env.step(
        &mut run,
        "INSERT INTO customer (id, name) VALUES (1, 'Ada');",
    )
    .await;
    assert_eq!(env.subjects(), vec!["customer.1"]);
    run.stop(&env);
}
