//! Crash injection for tests: `SKEIN_FAILPOINT=<name>` makes the process
//! abort (like a SIGKILL: no destructors, no flushing) when it reaches the
//! named point. `SKEIN_FAILPOINT=<name>:<n>` aborts on the n-th time.
//! `SKEIN_FAILPOINT=<name>:<n>:sleep=<ms>` instead stalls the calling step
//! that long on the n-th time (a batch held up midway, as by a stuck call
//! or a slow disk, while the process's other tasks go on: a heartbeat, a
//! consumer's polling, other partitions), then carries on; `*` for `<n>`
//! acts every time (a slow step: `<name>:*:sleep=<ms>`). `SKEIN_FAILPOINT=<name>:<n>:error=<ms>`
//! stalls that long and then fails the step (a point checked with
//! [`failpoint_result`]; [`failpoint`] carries on).
//! Costs one environment read per call when unset; the points sit on batch
//! boundaries, not per row.

use std::sync::atomic::{AtomicU64, Ordering};

static HITS: AtomicU64 = AtomicU64::new(0);

/// What a failpoint does when it fires.
#[derive(Debug, PartialEq, Eq)]
enum Action {
    Abort,
    Sleep(u64),
    Error(u64),
}

fn parse(spec: &str) -> (&str, u64, Action) {
    let mut parts = spec.split(':');
    let point = parts.next().unwrap_or("");
    // 0: every time.
    let nth = match parts.next() {
        Some("*") => 0,
        n => n.and_then(|n| n.parse().ok()).unwrap_or(1),
    };
    let action = match parts.next().and_then(|a| a.split_once('=')) {
        Some(("sleep", ms)) => Action::Sleep(ms.parse().unwrap_or(0)),
        Some(("error", ms)) => Action::Error(ms.parse().unwrap_or(0)),
        _ => Action::Abort,
    };
    (point, nth, action)
}

/// Aborts (or stalls) the process if `SKEIN_FAILPOINT` names this point.
pub fn failpoint(name: &str) {
    let _ = failpoint_result(name);
}

/// [`failpoint`], and an `error=` action fails the step: `Err` with a
/// message naming the point.
pub fn failpoint_result(name: &str) -> Result<(), String> {
    let Ok(spec) = std::env::var("SKEIN_FAILPOINT") else {
        return Ok(());
    };
    let (point, nth, action) = parse(&spec);
    if point != name {
        return Ok(());
    }
    if HITS.fetch_add(1, Ordering::SeqCst) + 1 != nth && nth != 0 {
        return Ok(());
    }
    match action {
        Action::Abort => {
            eprintln!("skein: failpoint `{name}` reached, aborting");
            std::process::abort();
        }
        Action::Sleep(ms) => {
            eprintln!("skein: failpoint `{name}` reached, stalling {ms} ms");
            stall(ms);
            eprintln!("skein: failpoint `{name}` resumes");
        }
        Action::Error(ms) => {
            eprintln!("skein: failpoint `{name}` reached, failing in {ms} ms");
            stall(ms);
            return Err(format!("failpoint `{name}`"));
        }
    }
    Ok(())
}

/// Stalls the calling thread `ms` milliseconds: the step that reached the
/// failpoint is paused, and only it. On a tokio worker, the worker's queued
/// tasks (its LIFO slot too, which no other worker steals from) move to
/// another thread first, as a paused step would not hold them up.
fn stall(ms: u64) {
    let pause = || std::thread::sleep(std::time::Duration::from_millis(ms));
    match tokio::runtime::Handle::try_current() {
        Ok(handle) if handle.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(pause)
        }
        // Off a runtime, or on a current-thread one, where the thread is all
        // there is (and `block_in_place` would panic).
        _ => pause(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse() {
        assert_eq!(parse("a.b"), ("a.b", 1, Action::Abort));
        assert_eq!(parse("a.b:3"), ("a.b", 3, Action::Abort));
        assert_eq!(parse("a.b:2:sleep=500"), ("a.b", 2, Action::Sleep(500)));
        assert_eq!(parse("a.b:2:error=70"), ("a.b", 2, Action::Error(70)));
        assert_eq!(parse("a.b:*:sleep=5"), ("a.b", 0, Action::Sleep(5)));
    }

    /// A task stalled at a failpoint pauses that task, not the tasks queued
    /// behind it on the same worker: a task it has just spawned sits in the
    /// worker's LIFO slot, which no other worker steals from.
    #[test]
    fn a_stall_pauses_only_its_own_task() {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let (stalled_until, other_ran_at) = runtime.block_on(async {
            tokio::spawn(async {
                let other = tokio::spawn(async { std::time::Instant::now() });
                stall(3_000);
                let stalled_until = std::time::Instant::now();
                (stalled_until, other.await.unwrap())
            })
            .await
            .unwrap()
        });
        assert!(
            other_ran_at < stalled_until,
            "the task spawned before the stall waited for it to end"
        );
    }
}
