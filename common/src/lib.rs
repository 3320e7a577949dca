//! # skein-common
//!
//! The vocabulary every skein stage shares:
//!
//! * [`config`]: the YAML model with its no-I/O validation;
//! * [`position`]: typed, totally ordered source positions ([`PgLsn`],
//!   [`SqlServerLsn`]) and the per-change [`ChangePosition`];
//! * [`record`]: the [`ChangeRecord`] the transporter carries, the
//!   [`RootKey`] of an aggregate and the frozen partitioning function;
//! * [`checkpoint`]: an applier's typed progress ([`Checkpoint`]: a source
//!   position or a transport offset);
//! * [`json`]: canonical JSON and the SHA-256 version hash (etag).
//!
//! Nothing here does I/O except [`Config::load`] reading its file.

pub mod checkpoint;
pub mod config;
pub mod error;
pub mod failpoint;
#[cfg(any(test, feature = "fuzz"))]
pub mod fuzz;
pub mod json;
pub mod metrics;
pub mod position;
pub mod record;
pub mod sqlvalue;

pub use checkpoint::{Checkpoint, CheckpointKind};
pub use config::Config;
pub use error::{Error, Result};
pub use position::{ChangePosition, Dialect, PgLsn, SourcePosition, SqlServerLsn};
pub use record::{ChangeRecord, Op, RootKey};

/// mimalloc instead of the system allocator, in the skein binary (feature
/// `mimalloc`): the appliers build and drop many small JSON values on
/// several threads at once, and glibc's malloc spent a quarter of the
/// pipeline's CPU time in `malloc`/`free` and chunk consolidation (perf,
/// bench/run, issue 13). A build that links the fuzz helpers (tests) keeps
/// their counting allocator: a program has one.
#[cfg(all(feature = "mimalloc", not(feature = "fuzz"), not(test)))]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;
