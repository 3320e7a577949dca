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
    _one: tokio::sync::MutexGuard<'static, ()>,
}

/// One test at a time sets it: the setting is the server's.
static STANDBY: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

impl SyncStandby {
    async fn wait_for(admin: &str, name: &str) -> SyncStandby {
        let one = STANDBY.lock().await;
        let c = connect(admin).await;
        c.batch_execute(&format!(
            "ALTER SYSTEM SET synchronous_standby_names = '{name}'"
        ))
        .await
        .unwrap();
        c.batch_execute("SELECT pg_reload_conf()").await.unwrap();
        settled(admin, name).await;
        SyncStandby {
            admin: admin.to_string(),
            _one: one,
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
                settled(&admin, "").await;
            });
        })
        .join()
        .unwrap();
    }
}

/// Waits until the server's `synchronous_standby_names` is `value` (a new
/// session sees it once the postmaster reloaded) and a moment more: the
/// reload is signalled to every backend, and one takes it before its next
/// command (one it has already read still runs with the old value).
async fn settled(admin: &str, value: &str) {
    let t0 = std::time::Instant::now();
    loop {
        let now: String = connect(admin)
            .await
            .query_one("SHOW synchronous_standby_names", &[])
            .await
            .unwrap()
            .get(0);
        if now == value {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "synchronous_standby_names is still `{now}`, 10 s after the reload"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
}

/// Runs `sql` on a connection of its own, in the background: with a
/// [`SyncStandby`] set, its commit waits. Returns the backend's pid (for
/// [`cancel_wait`]) and the task.
async fn waiting(
    url: &str,
    sql: &'static str,
) -> (
    i32,
    tokio::task::JoinHandle<Result<(), tokio_postgres::Error>>,
) {
    let writer = connect(url).await;
    let pid: i32 = writer
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    (
        pid,
        tokio::spawn(async move { writer.batch_execute(sql).await }),
    )
}

/// Cancels backend `pid`'s wait for the standby: its commit, already
/// local, becomes visible.
async fn cancel_wait(pid: i32) {
    let admin = connect(&admin_url()).await;
    admin
        .execute("SELECT pg_cancel_backend($1)", &[&pid])
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_commit_decoded_before_it_is_visible_is_still_published() {
    let env = Env::new("invisible_commit", |y| y).await;
    let mut run = env.start().await;
    env.settle(&mut run).await;

    let guard = SyncStandby::wait_for(&admin_url(), "skein_never_connects").await;
    // This commit is flushed (the stream carries it) but waits for the
    // standby before other sessions can see it.
    let (pid, insert) = waiting(
        &env.url,
        "INSERT INTO customer (id, name, email) VALUES (1, 'Ada', 'a@x')",
    )
    .await;
    // Long enough for the extractor to send it and an applier to hydrate.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        !insert.is_finished(),
        "the insert should still wait for the standby"
    );
    // Cancelling the wait makes the (locally committed) row visible.
    cancel_wait(pid).await;
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

/// Which ids the check waits for, against a given snapshot and next id.
async fn unseen(snapshot: &str, next: &str, xids: &[i64]) -> Vec<i64> {
    let c = connect(&admin_url()).await;
    c.query_one(
        skein_applier::hydrate::UNSEEN_XIDS_SQL,
        &[&xids.to_vec(), &Some(snapshot), &Some(next)],
    )
    .await
    .unwrap()
    .get(0)
}

/// The 32-bit ids of the stream are widened against the next id to be
/// assigned, not the snapshot's xmax (the last completed id + 1): past the
/// first epoch, an id streamed but not yet visible can be above xmax, and
/// widening it against xmax put it in the previous epoch, "visible", so the
/// batch was hydrated without it. An id that widens below 0 is not of this
/// cluster's history and is never waited for.
#[tokio::test(flavor = "multi_thread")]
async fn stream_ids_are_widened_against_the_next_id() {
    let e1 = 1i64 << 32;
    // Epoch 1, ids up to 2^32+99 completed, 2^32+100 and +101 running (the
    // next to assign is +102); 2^32+50 committed long ago.
    let snap = format!("{}:{}:", e1 + 100, e1 + 100);
    let next = (e1 + 102).to_string();
    assert_eq!(unseen(&snap, &next, &[50, 100, 101]).await, [100, 101]);
    // Just past an epoch boundary: 4294967290 is from the epoch before.
    let snap = format!("{}:{}:", e1 + 5, e1 + 5);
    let next = (e1 + 6).to_string();
    assert_eq!(
        unseen(&snap, &next, &[4_294_967_290, 3, 5]).await,
        [5],
        "an id of the previous epoch is seen; +5 is running"
    );
    // Epoch 0: an id above the next one cannot be of this cluster.
    assert_eq!(
        unseen("100:100:", "102", &[3_000_000_000, 101]).await,
        [101]
    );
}

/// A snapshot taken while a commit waits for a synchronous standby counts
/// that transaction as running, though its commit is decoded and a later
/// commit may be visible: it is no clean cut of the commit order, and the
/// appliers must not remember it to skip later records
/// (`skein_applier::coverage`). No SQL function tells such a commit from
/// a running one (`pg_xact_status` says "in progress", checked here), so
/// no snapshot is trusted while synchronous replication is configured;
/// once it is not, snapshots are clean again.
#[tokio::test(flavor = "multi_thread")]
async fn a_snapshot_with_a_commit_waiting_for_a_standby_is_not_clean() {
    let env = Env::new("snapshot_holes", |y| y).await;
    let reader = connect(&env.url).await;
    let clean = || async {
        reader
            .batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
            .await
            .unwrap();
        let row = reader
            .query_one(skein_applier::hydrate::CLEAN_SNAPSHOT_SQL, &[])
            .await
            .unwrap();
        reader.batch_execute("COMMIT").await.unwrap();
        let (snap, holes): (String, bool) = (row.get(0), row.get(1));
        (snap, !holes)
    };
    assert!(clean().await.1, "a quiet server's snapshot is clean");

    let guard = SyncStandby::wait_for(&admin_url(), "skein_never_connects").await;
    let (pid, waiting) = waiting(
        &env.url,
        "INSERT INTO customer (id, name) VALUES (1, 'Ada')",
    )
    .await;
    // A later commit that does not wait: visible at once.
    let local = connect(&env.url).await;
    local
        .batch_execute(
            "SET synchronous_commit = local; INSERT INTO customer (id, name) VALUES (2, 'Bob')",
        )
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !waiting.is_finished(),
        "the insert should wait for the standby"
    );
    let (snap, is_clean) = clean().await;
    assert!(
        !is_clean,
        "snapshot {snap} sees customer 2 but not customer 1, committed before it"
    );
    // Why the check cannot be finer: the commit log's own answer.
    let xip: Vec<String> = local
        .query_one(
            "SELECT array_agg(pg_xact_status(x)) FROM pg_snapshot_xip($1::text::pg_snapshot) x",
            &[&snap],
        )
        .await
        .unwrap()
        .get(0);
    assert!(
        xip.iter().all(|s| s == "in progress"),
        "pg_xact_status of {snap}'s running ids: {xip:?}"
    );

    cancel_wait(pid).await;
    waiting.await.unwrap().unwrap();
    drop(guard);
    assert!(clean().await.1, "clean again once the commit is visible");
}
