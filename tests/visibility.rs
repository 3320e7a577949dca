//! A transaction the change stream carries before other sessions can see it.
//!
//! PostgreSQL decodes a commit once its WAL record is flushed; other
//! sessions see the transaction only a moment later, when the committing
//! backend leaves the process array. Under load that moment can be long
//! (the chaos harness met it on a busy machine: an account created in one
//! transaction was hydrated as missing and never published), and a commit
//! waiting for a synchronous standby stretches it for as long as the
//! standby is away. This test makes the gap as long as it likes with
//! `synchronous_standby_names` naming a standby that never comes.
//!
//! `synchronous_standby_names` is server-wide, so this is its own test
//! binary (cargo runs test binaries one after another) and every commit on
//! the server waits while it is set; a guard resets it even on panic.

mod common;

use std::time::Duration;

use common::*;

/// Sets `synchronous_standby_names` for the server; resets it on drop.
struct SyncStandby {
    admin: String,
}

impl SyncStandby {
    async fn wait_for(admin: &str, name: &str) -> SyncStandby {
        let c = connect(admin).await;
        c.batch_execute(&format!(
            "ALTER SYSTEM SET synchronous_standby_names = '{name}'"
        ))
        .await
        .unwrap();
        c.batch_execute("SELECT pg_reload_conf()").await.unwrap();
        // The reload reaches every backend at its next command.
        tokio::time::sleep(Duration::from_millis(300)).await;
        SyncStandby {
            admin: admin.to_string(),
        }
    }
}

impl Drop for SyncStandby {
    fn drop(&mut self) {
        let admin = self.admin.clone();
        // Drop is synchronous: reset on a runtime of its own.
        std::thread::spawn(move || {
            let rt = tokio::runtime::Runtime::new().unwrap();
            rt.block_on(async {
                let c = connect(&admin).await;
                c.batch_execute("ALTER SYSTEM RESET synchronous_standby_names")
                    .await
                    .unwrap();
                c.batch_execute("SELECT pg_reload_conf()").await.unwrap();
            });
        })
        .join()
        .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_commit_decoded_before_it_is_visible_is_still_published() {
    let env = Env::new("invisible_commit", |y| y).await;
    let mut run = env.start().await;
    env.settle(&mut run).await;

    let guard = SyncStandby::wait_for(&admin_url(), "skein_never_connects").await;
    // This commit is flushed (the stream carries it) but waits for the
    // standby before other sessions can see it.
    let writer = connect(&env.url).await;
    let pid: i32 = writer
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    let insert = tokio::spawn(async move {
        writer
            .batch_execute("INSERT INTO customer (id, name, email) VALUES (1, 'Ada', 'a@x')")
            .await
    });
    // Long enough for the extractor to send it and an applier to hydrate.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        !insert.is_finished(),
        "the insert should still wait for the standby"
    );
    // Cancelling the wait makes the (locally committed) row visible.
    let admin = connect(&admin_url()).await;
    admin
        .execute("SELECT pg_cancel_backend($1)", &[&pid])
        .await
        .unwrap();
    insert.await.unwrap().unwrap();
    drop(guard);

    env.settle(&mut run).await;
    run.stop(&env);
    assert_eq!(
        env.subject_actions(),
        ["customer.1 created"],
        "{}",
        env.log()
    );
    assert_exactly_once(&env).await;
}
