//! Crash injection for tests: `SKEIN_FAILPOINT=<name>` makes the process
//! abort (like a SIGKILL: no destructors, no flushing) when it reaches the
//! named point. `SKEIN_FAILPOINT=<name>:<n>` aborts on the n-th time.
//! Costs one environment read per call when unset; the points sit on batch
//! boundaries, not per row.

use std::sync::atomic::{AtomicU64, Ordering};

static HITS: AtomicU64 = AtomicU64::new(0);

/// Aborts the process if `SKEIN_FAILPOINT` names this point.
pub fn failpoint(name: &str) {
    let Ok(spec) = std::env::var("SKEIN_FAILPOINT") else {
        return;
    };
    let (point, nth) = match spec.split_once(':') {
        Some((p, n)) => (p.to_string(), n.parse::<u64>().unwrap_or(1)),
        None => (spec, 1),
    };
    if point != name {
        return;
    }
    if HITS.fetch_add(1, Ordering::SeqCst) + 1 >= nth {
        eprintln!("skein: failpoint `{name}` reached, aborting");
        std::process::abort();
    }
}
