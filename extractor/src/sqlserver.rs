//! SQL Server CDC.
//!
//! Pure logic first — pairing the rows of `cdc.fn_cdc_get_all_changes_*`
//! into changes, the LSN window of a batch, the validity-interval (data
//! loss) check, the choice of capture instance — then [`MssqlSource`],
//! which runs the queries of `skein_sql::sqlserver` over TDS.
//!
//! Reading: each batch asks `sys.fn_cdc_get_max_lsn()`, checks every
//! capture instance's `sys.fn_cdc_get_min_lsn` against the marker, sizes
//! the window `(lower, upper]` at an LSN boundary, reads each capture
//! instance's changes in it with `N'all update old'` (the before image of
//! an update carries the old join columns), merges them by
//! `(__$start_lsn, __$seqval)` and resolves them to root keys. A
//! transaction (one commit LSN) of more change rows than a batch holds is
//! the window alone and is handed over in parts: each part pages every
//! capture instance after the last `__$seqval` handed over ([`cut_part`],
//! [`PartCursor`]), and the marker of a part that is not the last stores
//! that `__$seqval`, so a restart reads on from it. Nothing is
//! held open between batches, and there is nothing to acknowledge to the
//! server: CDC cleanup follows its own retention, which is why the
//! validity check runs on every batch, and why the age of the oldest
//! unread change is compared with that retention every 30 s
//! ([`retention`]).

pub mod clock;
pub mod ddl;
pub mod retention;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use skein_common::config::{Config, SqlServerSource};
use skein_common::position::SqlServerLsn;
use skein_common::sqlvalue::SqlValue;
use skein_common::{ChangeRecord, Op, SourcePosition};
use skein_sql::sqlserver::MssqlClient;
use skein_sql::Catalog;
use tracing::{debug, info, warn};

use self::clock::{ClockFacts, CommitClock, ServerVersion};
use self::ddl::{ddl_row, describe_ddl, schema_step, SchemaStep};
use self::retention::{retention_warning, CleanupRetention};
use crate::error::{Error, Result};
use crate::resolve::RowImage;
use crate::resolve::{count_tracked, BatchResolution, EntityPlan, RawChange, TableIndex, TxMeta};
use crate::{BatchLimits, ChangeSource, InFlight, ReadBatch, StartPoint};

/// One row of `fn_cdc_get_all_changes_<ci>(…, N'all update old')`.
#[derive(Clone, Debug, PartialEq)]
pub struct CdcRow {
    /// `__$start_lsn`: the commit LSN of the transaction.
    pub start_lsn: SqlServerLsn,
    /// `__$seqval`: orders the changes inside the transaction.
    pub seqval: SqlServerLsn,
    /// `__$operation`: 1 delete, 2 insert, 3 update (before), 4 update (after).
    pub operation: i32,
    /// The captured columns, in the query's column order.
    pub values: Vec<SqlValue>,
}

/// What happened to the row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CdcOp {
    /// Operation 2.
    Insert,
    /// Operation 1.
    Delete,
    /// Operations 3 + 4.
    Update,
}

/// One change, with the images the operation has.
#[derive(Clone, Debug, PartialEq)]
pub struct CdcChange {
    /// Commit LSN.
    pub start_lsn: SqlServerLsn,
    /// Order inside the transaction.
    pub seqval: SqlServerLsn,
    /// The operation.
    pub op: CdcOp,
    /// Before image (delete, update).
    pub before: Option<Vec<SqlValue>>,
    /// After image (insert, update).
    pub after: Option<Vec<SqlValue>>,
}

/// Rows that cannot be turned into changes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CdcError {
    /// An `__$operation` outside 1–4.
    #[error("unknown __$operation {operation} at LSN {lsn}")]
    UnknownOperation { operation: i32, lsn: String },
    /// An update's before image without its after image, or the reverse.
    #[error("update at LSN {lsn} seqval {seqval} is missing its {missing} image")]
    UnpairedUpdate {
        lsn: String,
        seqval: String,
        missing: &'static str,
    },
    /// More rows share one `__$seqval` than a part holds (never seen: an
    /// update is two).
    #[error(
        "more than {rows} change rows share __$seqval {seqval} at LSN {lsn}: raise \
         extractor.max_batch_changes"
    )]
    OversizedChange {
        lsn: String,
        seqval: String,
        rows: usize,
    },
}

/// One row of a change query: `__$start_lsn`, `__$seqval`,
/// `__$operation`, then the captured columns. `instance` names the capture
/// instance in errors.
pub fn cdc_row(instance: &str, mut r: Vec<SqlValue>) -> Result<CdcRow> {
    if r.len() < 3 {
        return Err(Error::Decode(format!(
            "{instance}: a change row has {} columns, expected at least 3 \
             (__$start_lsn, __$seqval, __$operation)",
            r.len()
        )));
    }
    let values = r.split_off(3);
    let at = |e: Error| match e {
        Error::Decode(m) => Error::Decode(format!("{instance}: {m}")),
        other => other,
    };
    let operation = int_of(&r[2], "__$operation").map_err(at)?;
    Ok(CdcRow {
        start_lsn: lsn_of(&r[0], "__$start_lsn").map_err(at)?,
        seqval: lsn_of(&r[1], "__$seqval").map_err(at)?,
        operation: i32::try_from(operation).map_err(|_| {
            Error::Decode(format!("{instance}: __$operation {operation} out of range"))
        })?,
        values,
    })
}

/// Pairs rows (ordered by LSN, seqval, operation, as the change query
/// returns them) into changes: 3 then 4 with the same LSN and seqval make
/// one update.
pub fn pair(rows: Vec<CdcRow>) -> Result<Vec<CdcChange>, CdcError> {
    let mut out = Vec::with_capacity(rows.len());
    let mut it = rows.into_iter().peekable();
    while let Some(r) = it.next() {
        let change = |op, before, after| CdcChange {
            start_lsn: r.start_lsn,
            seqval: r.seqval,
            op,
            before,
            after,
        };
        match r.operation {
            1 => out.push(change(CdcOp::Delete, Some(r.values.clone()), None)),
            2 => out.push(change(CdcOp::Insert, None, Some(r.values.clone()))),
            3 => {
                let after = match it.peek() {
                    Some(n)
                        if n.operation == 4
                            && n.start_lsn == r.start_lsn
                            && n.seqval == r.seqval =>
                    {
                        it.next().map(|n| n.values)
                    }
                    _ => None,
                };
                let Some(after) = after else {
                    return Err(CdcError::UnpairedUpdate {
                        lsn: r.start_lsn.to_string(),
                        seqval: r.seqval.to_string(),
                        missing: "after",
                    });
                };
                out.push(change(CdcOp::Update, Some(r.values.clone()), Some(after)));
            }
            4 => {
                return Err(CdcError::UnpairedUpdate {
                    lsn: r.start_lsn.to_string(),
                    seqval: r.seqval.to_string(),
                    missing: "before",
                })
            }
            operation => {
                return Err(CdcError::UnknownOperation {
                    operation,
                    lsn: r.start_lsn.to_string(),
                })
            }
        }
    }
    Ok(out)
}

/// Cleanup removed changes skein has not read: the lowest LSN a capture
/// instance still holds is past what follows the marker.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "data loss: the marker is at {marker} but capture instance {capture_instance} only holds \
     changes from {min_lsn} (CDC cleanup removed the rest). Set \
     extractor.continue_with_data_loss: true to go on from there, or re-snapshot"
)]
pub struct DataLoss {
    /// The stored marker.
    pub marker: SqlServerLsn,
    /// `sys.fn_cdc_get_min_lsn` of the capture instance.
    pub min_lsn: SqlServerLsn,
    /// The capture instance.
    pub capture_instance: String,
}

/// The next batch window `(marker, upper]`: `upper` is `max_lsn` when the
/// changes after the marker fit in `cap`, else the last LSN whose changes
/// all fit ([`skein_sql::sqlserver::cap_window`]); `None` when nothing is
/// new. `first_lsns` are the first `cap + 1` change LSNs after the marker.
pub fn next_window(
    marker: SqlServerLsn,
    max_lsn: SqlServerLsn,
    first_lsns: &[SqlServerLsn],
    cap: usize,
) -> Option<SqlServerLsn> {
    if max_lsn <= marker {
        return None;
    }
    skein_sql::sqlserver::cap_window(first_lsns, cap, max_lsn)
}

/// What CDC says about one capture instance, for [`plan_reads`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InstanceFacts {
    /// Capture instance name.
    pub name: String,
    /// `sys.fn_cdc_get_min_lsn`: the lowest LSN it still holds (its
    /// `start_lsn`, moved forward by cleanup).
    pub min_lsn: SqlServerLsn,
    /// The last commit at or before its creation (`None`: unknown, the
    /// time mapping was cleaned up).
    pub create_lsn: Option<SqlServerLsn>,
}

/// Why an instance is read from where it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Coverage {
    /// It holds everything after the marker: read from the marker.
    FromMarker,
    /// Created after the marker (a table added to the config, the second
    /// instance of a schema change): read from its own start. For the
    /// newer of two instances of one table, what lies below its start is
    /// the older one's.
    FromOwnStart,
    /// The older of two instances whose range (up to the newer one's
    /// start) is all at or before the marker: nothing left to read.
    Finished,
    /// It existed at the marker, and cleanup removed changes after the
    /// marker skein had not read.
    Loss,
    /// A loss already accepted (`continue_with_data_loss`): read what is left.
    AcceptedLoss,
}

/// Where one instance is read in the next batch: `[from, until)`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InstanceRead {
    /// Why.
    pub coverage: Coverage,
    /// First LSN read from it.
    pub from: SqlServerLsn,
    /// First LSN *not* read from it: the newer instance's start (`None`:
    /// the newest of its table, read up to the window's end).
    pub until: Option<SqlServerLsn>,
}

/// Decides, for each instance of each tracked table (`tables`: each
/// table's instances, oldest first), where the batch after `marker` reads
/// it. Two instances of one table split the LSNs at the newer one's start:
/// the older covers what is below it, the newer the rest — no LSN from
/// both, none from neither. Cleanup moves every instance's start to the
/// same low-water mark at most, so the split stays gap-free after cleanup.
/// `accepted`: the highest minimum of a loss accepted with
/// `continue_with_data_loss` (or, on a first start, every minimum: the
/// capture instances' whole content is the start); an instance cleaned up
/// past that is a new loss.
pub fn plan_reads(
    marker: SqlServerLsn,
    tables: &[Vec<InstanceFacts>],
    accepted: Option<SqlServerLsn>,
) -> Vec<Vec<InstanceRead>> {
    let need = marker.increment();
    tables
        .iter()
        .map(|instances| {
            instances
                .iter()
                .enumerate()
                .map(|(k, inst)| {
                    let until = instances.get(k + 1).map(|n| n.min_lsn);
                    let read = |coverage, from| InstanceRead {
                        coverage,
                        from,
                        until,
                    };
                    if until.is_some_and(|u| u <= need) {
                        read(Coverage::Finished, need)
                    } else if inst.min_lsn <= need {
                        read(Coverage::FromMarker, need)
                    } else if k > 0 || inst.create_lsn.is_some_and(|c| c >= marker) {
                        // The older instance covers what lies below a newer
                        // one's start (and reports its own loss).
                        read(Coverage::FromOwnStart, inst.min_lsn)
                    } else if accepted.is_some_and(|a| inst.min_lsn <= a) {
                        read(Coverage::AcceptedLoss, inst.min_lsn)
                    } else {
                        read(Coverage::Loss, inst.min_lsn)
                    }
                })
                .collect()
        })
        .collect()
}

/// The first loss in a plan, as the error it is.
pub fn first_loss(
    marker: SqlServerLsn,
    names: &[Vec<InstanceFacts>],
    plan: &[Vec<InstanceRead>],
) -> Option<DataLoss> {
    names.iter().zip(plan).find_map(|(facts, reads)| {
        facts.iter().zip(reads).find_map(|(f, r)| {
            (r.coverage == Coverage::Loss).then(|| DataLoss {
                marker,
                min_lsn: f.min_lsn,
                capture_instance: f.name.clone(),
            })
        })
    })
}

/// The LSN range `[from, to]` of one instance in a window ending at
/// `upper`, `None` when it has nothing to give there.
pub fn instance_range(
    read: &InstanceRead,
    upper: SqlServerLsn,
) -> Option<(SqlServerLsn, SqlServerLsn)> {
    let to = match read.until {
        Some(u) => upper.min(u.decrement()),
        None => upper,
    };
    (read.coverage != Coverage::Finished && read.coverage != Coverage::Loss && read.from <= to)
        .then_some((read.from, to))
}

// ---------------------------------------------------------------------------
// A transaction larger than one batch, in parts.
// ---------------------------------------------------------------------------

/// The commit LSN of the window's first transaction when it alone holds
/// more than `cap` change rows (`first_lsns`: the first `cap + 1` change
/// LSNs after the marker, [`next_window`]): it is handed over in parts.
pub fn large_transaction(first_lsns: &[SqlServerLsn], cap: usize) -> Option<SqlServerLsn> {
    let cap = cap.max(1);
    let first = *first_lsns.first()?;
    (first_lsns.get(cap) == Some(&first)).then_some(first)
}

/// How many change rows a part holds at most: `max_changes`, but never
/// less than an update's two rows.
pub fn part_rows(max_changes: usize) -> usize {
    max_changes.max(2)
}

/// Where a transaction handed over in parts stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PartCursor {
    /// The marker the parts are read after (every batch's lower bound).
    pub lower: SqlServerLsn,
    /// The transaction's commit LSN: every part's records carry it.
    pub lsn: SqlServerLsn,
    /// The last `__$seqval` handed over (`None`: nothing yet). Every row
    /// at or below it, in every capture instance, is handed over.
    pub after: Option<SqlServerLsn>,
    /// Changes handed over.
    pub changes: u64,
    /// Of those, the tracked ones ([`crate::resolve::is_tracked`]): the
    /// next part's records number on from here.
    pub tracked: u32,
    /// Whether this process has followed the DDL committed in the window
    /// `(lower, lsn]` ([`MssqlSource::follow_ddl`]). The window is the
    /// same for every part, so `cdc.ddl_history` is read with the first
    /// (the window's sizing reads it) and after a restart (the catalog read
    /// at connect time may predate that DDL), not again for each part.
    pub ddl_followed: bool,
}

impl PartCursor {
    /// The first part of the transaction at `lsn`, found by sizing the
    /// window `(lower, lsn]`, whose DDL is followed with that.
    pub fn first(lower: SqlServerLsn, lsn: SqlServerLsn) -> PartCursor {
        PartCursor {
            lower,
            lsn,
            after: None,
            changes: 0,
            tracked: 0,
            ddl_followed: true,
        }
    }

    /// What the marker stores after a part that is not the last.
    pub fn in_flight(&self) -> InFlight {
        InFlight {
            commit: self.lsn.into(),
            end: self.lsn.into(),
            changes: self.changes,
            tracked: Some(self.tracked),
            seqval: self.after,
        }
    }

    /// The cursor a marker's `in_flight` stands for, after the marker at
    /// `from`. `Err`: a marker this source did not write (why).
    pub fn resume(from: SourcePosition, f: &InFlight) -> std::result::Result<PartCursor, String> {
        let (Ok(lsn), Some(after), Some(tracked)) = (f.end.sqlserver(), f.seqval, f.tracked) else {
            return Err(format!(
                "the marker holds part of a transaction ending at {}, written by another kind of \
                 source (it names no SQL Server __$seqval)",
                f.end
            ));
        };
        let lower = from.sqlserver().map_err(|e| e.to_string())?;
        if lsn <= lower {
            return Err(format!(
                "the marker holds part of a transaction at {lsn}, not after its position {lower}"
            ));
        }
        Ok(PartCursor {
            lower,
            lsn,
            after: Some(after),
            changes: f.changes,
            tracked,
            ddl_followed: false,
        })
    }

    /// The cursor after a part of `changes` changes, `tracked` of them
    /// tracked, the last at `__$seqval` `last` (a part is read only after
    /// the window's DDL was followed).
    pub fn after_part(
        &self,
        last: Option<SqlServerLsn>,
        changes: usize,
        tracked: u32,
    ) -> PartCursor {
        PartCursor {
            after: last.or(self.after),
            changes: self.changes + changes as u64,
            tracked: self.tracked.saturating_add(tracked),
            ddl_followed: true,
            ..*self
        }
    }
}

/// What one capture instance read now holds of the window `(lower, lsn]`
/// of a transaction in flight, asked at a restart ([`check_in_flight`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AtResume {
    /// The capture instance.
    pub name: String,
    /// Its first change after the marker, up to the transaction's commit
    /// LSN (`None`: none).
    pub first: Option<SqlServerLsn>,
    /// Its changes of the transaction up to the stored `__$seqval`, an
    /// update counted once (as [`PartCursor::changes`] counts them).
    pub handed: u64,
}

/// Refuses a transaction in flight past `max`, the end of what CDC holds
/// (`sys.fn_cdc_get_max_lsn()`): the change functions refuse a range
/// beyond it, so reading on would fail the same way on every restart.
/// The database is not the one the marker was written for, or was
/// restored from a backup older than the transaction.
pub fn in_flight_past_max(p: &PartCursor, max: SqlServerLsn) -> Result<()> {
    if p.lsn <= max {
        return Ok(());
    }
    // Never forward: nothing is skipped that the database holds.
    let to = p.lower.min(max);
    Err(Error::NotReady {
        message: format!(
            "the marker holds part of the transaction at {} (handed over up to __$seqval {}), \
             but CDC in this database ends at {max} (sys.fn_cdc_get_max_lsn()): it is not the \
             database the marker was written for, or it was restored from a backup older than \
             that transaction",
            p.lsn,
            describe_cursor(p)
        ),
        fix: format!(
            "if state_dir belongs to another database, give this source its own state_dir. \
             Otherwise forget the transaction in flight and read on from what this database \
             holds:\n  skein marker reset --to {to}\n(events already published for changes past \
             {max} are not undone)"
        ),
    })
}

/// Refuses to read on after the stored `__$seqval` when that would skip
/// changes of the capture instances read now (`now`, each with what it
/// holds of the window, [`AtResume`]): the config changed (a table
/// added whose capture instance was there, `source.capture_instances`)
/// while the transaction was handed over in parts. The parts never size
/// the window again, so an instance not read before would lose its
/// changes between the marker and the transaction, and those of the
/// transaction up to the cursor. Either shows here: a change before the
/// transaction, or more changes of it up to the cursor than were handed
/// over. (Fewer is a table no longer read: its records stay counted in
/// [`PartCursor::tracked`], and reading on is right.)
///
/// Reading the transaction again from its start instead would not be
/// lossless: the appliers that applied a part have stored a source
/// position past the changes before it, and drop them as re-sent.
pub fn check_in_flight(p: &PartCursor, now: &[AtResume]) -> Result<()> {
    let before = now
        .iter()
        .filter_map(|a| a.first.filter(|f| *f < p.lsn).map(|f| (a, f)))
        .min_by_key(|(_, f)| *f);
    let held: u64 = now.iter().map(|a| a.handed).sum();
    let message = match before {
        Some((a, first)) => format!(
            "capture instance `{}` has changes at {first}, after the marker at {} and before the \
             transaction in flight at {} (handed over up to __$seqval {})",
            a.name,
            p.lower,
            p.lsn,
            describe_cursor(p)
        ),
        None if held > p.changes => format!(
            "the capture instances read now hold {held} changes of the transaction in flight at \
             {} up to the stored __$seqval {} ({}), but {} were handed over",
            p.lsn,
            describe_cursor(p),
            now.iter()
                .map(|a| format!("{}: {}", a.name, a.handed))
                .collect::<Vec<_>>()
                .join(", "),
            p.changes
        ),
        None => return Ok(()),
    };
    Err(Error::NotReady {
        message: format!(
            "{message}: the config (a table added, or source.capture_instances) changed while that \
             transaction was handed over in parts, and reading on after that __$seqval would \
             skip the changes of capture instances not read before"
        ),
        fix: format!(
            "start once more with the previous config until `skein marker show` shows nothing in \
             flight, then with this one (the changes up to {lsn} of a table read only now are then \
             not read, as for a table added after them). Or read the transaction again from its \
             start with this config:\n  skein marker reset --to {lower}\n(appliers that applied \
             part of it drop changes positioned before what they applied, so some of those \
             changes may still not be published)",
            lsn = p.lsn,
            lower = p.lower,
        ),
    })
}

/// The stored `__$seqval` of a cursor, for messages.
fn describe_cursor(p: &PartCursor) -> String {
    p.after.map_or_else(|| "none".into(), |s| s.to_string())
}

/// Whether an instance read as `read` gives changes at `lsn` (two
/// instances of one table never both do, [`plan_reads`]).
pub fn covers(read: &InstanceRead, lsn: SqlServerLsn) -> bool {
    instance_range(read, lsn).is_some_and(|(_, to)| to == lsn)
}

/// Merges the rows of one more capture instance (`ii`; instances are
/// merged in instance order, each instance's rows in change order) into
/// those kept for a part, keeping the first `keep`. The order is the one
/// [`merge_changes`] gives a transaction's changes:
/// `__$seqval`, then instance, then the instance's own row order.
pub fn merge_part_rows(kept: &mut Vec<(usize, CdcRow)>, ii: usize, rows: Vec<CdcRow>, keep: usize) {
    kept.extend(rows.into_iter().map(|r| (ii, r)));
    // Stable: equal keys keep the instance's row order.
    kept.sort_by_key(|(i, r)| (r.seqval, *i));
    kept.truncate(keep);
}

/// One part cut from the rows merged for it.
#[derive(Clone, Debug, PartialEq)]
pub struct Part {
    /// Its changes, paired, with their instance index, in order.
    pub changes: Vec<(usize, CdcChange)>,
    /// Whether it ends the transaction.
    pub last: bool,
}

/// Cuts one part of at most `n` rows from the first `n + 1` rows after
/// the cursor, merged ([`merge_part_rows`]): all of them when there are no
/// more than `n` (the transaction's last part); else the rows up to the
/// last `__$seqval` whose rows all fit. The rows of one `__$seqval` — an
/// update's before and after image — never go to two parts, so the
/// part's last `__$seqval` is a cursor every instance can be read after.
pub fn cut_part(mut rows: Vec<(usize, CdcRow)>, n: usize) -> Result<Part, CdcError> {
    let last = rows.len() <= n;
    if !last {
        let cut = rows[n].1.seqval;
        let keep = rows[..n]
            .iter()
            .rposition(|(_, r)| r.seqval != cut)
            .map_or(0, |i| i + 1);
        if keep == 0 {
            return Err(CdcError::OversizedChange {
                lsn: rows[0].1.start_lsn.to_string(),
                seqval: cut.to_string(),
                rows: n,
            });
        }
        rows.truncate(keep);
    }
    // Pairs each instance's run of rows (a `__$seqval`'s rows are together).
    let mut changes = Vec::with_capacity(rows.len());
    let mut it = rows.into_iter().peekable();
    while let Some((ii, r)) = it.next() {
        let mut run = vec![r];
        while let Some((_, n)) = it.next_if(|(i, _)| *i == ii) {
            run.push(n);
        }
        changes.extend(pair(run)?.into_iter().map(|c| (ii, c)));
    }
    Ok(Part { changes, last })
}

// ---------------------------------------------------------------------------
// The reader: runs the queries of `skein_sql::sqlserver` over TDS.
// ---------------------------------------------------------------------------

/// The capture instance read for one tracked table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Instance {
    /// Source schema.
    pub schema: String,
    /// Source table.
    pub table: String,
    /// Capture instance name.
    pub name: String,
    /// The key and join columns read from it, in query order.
    pub columns: Vec<String>,
    /// The last commit at or before its creation ([`InstanceFacts`]).
    pub create_lsn: Option<SqlServerLsn>,
}

/// The capture instances read for a table (`found`: oldest first): the
/// configured one alone, or every instance (SQL Server allows two, during
/// a schema change), followed across the switch by [`plan_reads`]. Returns
/// the names, oldest first, and a note when there are two.
pub fn choose_instances(
    qualified: &str,
    configured: Option<&str>,
    found: &[String],
) -> std::result::Result<(Vec<String>, Option<String>), String> {
    match configured {
        Some(name) if found.iter().any(|f| f == name) => Ok((vec![name.to_string()], None)),
        Some(name) => Err(format!(
            "capture instance `{name}` configured for {qualified} does not exist (found: {})",
            if found.is_empty() {
                "none".to_string()
            } else {
                found.join(", ")
            }
        )),
        None => match found {
            [] => Err(format!("{qualified} has no CDC capture instance")),
            [_] => Ok((found.to_vec(), None)),
            [.., newest] => Ok((
                found.to_vec(),
                Some(format!(
                    "{qualified} has {} capture instances ({}): reading the older up to the \
                     start of the newer, `{newest}`, and the newer from there. Drop the old one \
                     once `skein status` shows the marker past the newer one's start",
                    found.len(),
                    found.join(", ")
                )),
            )),
        },
    }
}

/// The SQL Server change source.
pub struct MssqlSource {
    client: MssqlClient,
    /// The config, to read the catalog again and check it.
    cfg: Config,
    catalog: Catalog,
    plans: Vec<EntityPlan>,
    by_table: TableIndex,
    tracked: Vec<(String, String, Vec<String>)>,
    configured: std::collections::BTreeMap<String, String>,
    instances: Vec<Instance>,
    poll: Duration,
    database: String,
    fix: String,
    /// The highest minimum LSN whose loss was accepted (or, after a first
    /// start, the instances' content taken as the start) ([`plan_reads`]).
    accepted_loss: Option<SqlServerLsn>,
    /// `source.time_zone`.
    time_zone: Option<String>,
    /// How commit times become UTC, decided by `prepare`.
    clock: CommitClock,
    /// `extractor.retention_warn_fraction`.
    retention_warn_fraction: f64,
    /// When the cleanup retention was last checked.
    retention_checked: Option<Instant>,
    /// msdb could not be read (said once): no more retention checks.
    msdb_unreadable: bool,
    /// A transaction larger than one batch whose parts are being handed
    /// over: the next batch after `lower` is its next part.
    part: Option<PartCursor>,
}

fn lsn_of(v: &SqlValue, what: &str) -> Result<SqlServerLsn> {
    match v {
        SqlValue::Binary(b) => {
            SqlServerLsn::from_slice(b).map_err(|e| Error::Decode(format!("{what}: {e}")))
        }
        SqlValue::Null => Ok(SqlServerLsn::ZERO),
        other => Err(Error::Decode(format!(
            "{what}: expected binary(10), got {other:?}"
        ))),
    }
}

fn int_of(v: &SqlValue, what: &str) -> Result<i64> {
    match v {
        SqlValue::Int(i) => Ok(*i),
        other => Err(Error::Decode(format!(
            "{what}: expected an integer, got {other:?}"
        ))),
    }
}

/// Reads the catalog of every table the entities name; a missing table is
/// left out (the catalog check names it).
pub async fn load_catalog(client: &mut MssqlClient, cfg: &Config) -> Result<Catalog> {
    Ok(skein_sql::sqlserver::read_catalog(client, &cfg.tables()).await?)
}

/// Event columns of types the reader does not decode.
pub fn unsupported_columns(cfg: &Config, catalog: &Catalog) -> Vec<String> {
    let mut out = vec![];
    for e in &cfg.entities {
        for n in e.nodes() {
            for c in catalog.event_columns(&n) {
                if skein_sql::sqlserver::UNSUPPORTED_TYPES.contains(&c.type_name.as_str()) {
                    out.push(format!("{}.{} ({})", n.qualified(), c.name, c.type_name));
                }
            }
        }
    }
    out
}

impl MssqlSource {
    /// Connects, reads the catalog and builds the resolution plans.
    pub async fn connect(cfg: &Config, source: &SqlServerSource) -> Result<MssqlSource> {
        let mut client = MssqlClient::connect(source.url.expose()).await?;
        let catalog = load_catalog(&mut client, cfg).await?;
        let (plans, by_table) = crate::plans_for(cfg, &catalog)?;
        let unsupported = unsupported_columns(cfg, &catalog);
        if !unsupported.is_empty() {
            return Err(Error::NotReady {
                message: format!(
                    "columns of types skein does not decode: {}",
                    unsupported.join(", ")
                ),
                fix: "leave them out with `exclude_columns` (or `include_columns`)".into(),
            });
        }
        let tracked = skein_sql::postgres::tracked_tables(cfg, &catalog)
            .into_iter()
            .map(|t| (t.schema, t.table, t.columns.into_iter().collect()))
            .collect();
        let database = client
            .query("reading the database name", "SELECT DB_NAME()", &[])
            .await?
            .first()
            .and_then(|r| r.first())
            .and_then(SqlValue::to_text)
            .unwrap_or_default();
        Ok(MssqlSource {
            fix: skein_sql::sqlserver::source_ddl(cfg, &catalog),
            client,
            cfg: cfg.clone(),
            catalog,
            plans,
            by_table,
            tracked,
            configured: source.capture_instances.clone(),
            instances: vec![],
            poll: Duration::from_millis(source.poll_interval_ms),
            database,
            accepted_loss: None,
            time_zone: source.time_zone.clone(),
            clock: CommitClock::CurrentOffset,
            retention_warn_fraction: cfg.extractor.retention_warn_fraction,
            retention_checked: None,
            msdb_unreadable: false,
            part: None,
        })
    }

    /// The catalog read at connect time.
    pub fn catalog(&self) -> &Catalog {
        &self.catalog
    }

    /// The capture instances chosen by [`ChangeSource::prepare`].
    pub fn instances(&self) -> &[Instance] {
        &self.instances
    }

    fn not_ready(&self, message: String) -> Error {
        Error::NotReady {
            message,
            fix: format!(
                "run the output of `skein sql source` against the source database:\n{}",
                self.fix
            ),
        }
    }

    /// CDC on the database, a capture instance per tracked table holding
    /// the needed columns, the capture job and the agent.
    async fn check_cdc(&mut self) -> Result<()> {
        let enabled = self
            .client
            .query("checking CDC", skein_sql::sqlserver::CDC_ENABLED_SQL, &[])
            .await?;
        if !matches!(
            enabled.first().and_then(|r| r.first()),
            Some(SqlValue::Int(1))
        ) {
            return Err(self.not_ready(format!(
                "CDC is not enabled on database `{}`",
                self.database
            )));
        }
        let mut instances = vec![];
        for (schema, table, columns) in self.tracked.clone() {
            let qualified = format!("{schema}.{table}");
            let rows = self
                .client
                .query(
                    &format!("listing the capture instances of {qualified}"),
                    skein_sql::sqlserver::CAPTURE_INSTANCES_SQL,
                    &[&schema.as_str(), &table.as_str()],
                )
                .await?;
            let mut found = vec![];
            let mut created = HashMap::new();
            for r in &rows {
                let Some(name) = r.first().and_then(SqlValue::to_text) else {
                    continue;
                };
                let create = match r.get(2) {
                    Some(SqlValue::Null) | None => None,
                    Some(v) => Some(lsn_of(v, "create LSN")?),
                };
                created.insert(name.clone(), create);
                found.push(name);
            }
            let (names, warning) = choose_instances(
                &qualified,
                self.configured.get(&qualified).map(String::as_str),
                &found,
            )
            .map_err(|m| self.not_ready(m))?;
            if let Some(w) = warning {
                warn!("{w}");
            }
            for name in names {
                let captured: Vec<String> = self
                    .client
                    .query(
                        &format!("reading the columns of capture instance {name}"),
                        skein_sql::sqlserver::CAPTURED_COLUMNS_SQL,
                        &[&name.as_str()],
                    )
                    .await?
                    .iter()
                    .filter_map(|r| r.first().and_then(SqlValue::to_text))
                    .collect();
                let missing: Vec<&String> =
                    columns.iter().filter(|c| !captured.contains(c)).collect();
                if !missing.is_empty() {
                    return Err(Error::NotReady {
                        message: format!(
                            "capture instance `{name}` of {qualified} does not capture {}",
                            missing
                                .iter()
                                .map(|c| format!("`{c}`"))
                                .collect::<Vec<_>>()
                                .join(", ")
                        ),
                        fix: format!(
                        "create a second capture instance with the key and join columns, e.g.\n\
                         EXEC sys.sp_cdc_enable_table @source_schema = {}, @source_name = {}, \
                         @role_name = NULL, @capture_instance = {}, @supports_net_changes = 0, \
                         @captured_column_list = {};\n\
                         then set source.capture_instances.\"{qualified}\" to it",
                        skein_sql::sqlserver::ql(&schema),
                        skein_sql::sqlserver::ql(&table),
                        skein_sql::sqlserver::ql(&format!("{name}_skein")),
                        skein_sql::sqlserver::ql(
                            &columns
                                .iter()
                                .map(|c| skein_sql::sqlserver::qi(c))
                                .collect::<Vec<_>>()
                                .join(", ")
                        ),
                    ),
                    });
                }
                instances.push(Instance {
                    schema: schema.clone(),
                    table: table.clone(),
                    create_lsn: created.get(&name).copied().flatten(),
                    name,
                    columns: columns.clone(),
                });
            }
        }
        self.instances = instances;
        // The capture job and the agent: reported when visible; without the
        // permission to look, a warning.
        match self
            .client
            .query(
                "checking the CDC capture job",
                skein_sql::sqlserver::CAPTURE_JOB_SQL,
                &[],
            )
            .await
        {
            Ok(rows) if matches!(rows.first().and_then(|r| r.first()), Some(SqlValue::Int(0))) => {
                return Err(Error::NotReady {
                    message: format!("database `{}` has no CDC capture job", self.database),
                    fix: skein_sql::sqlserver::fix_capture_job().into(),
                });
            }
            Ok(_) => {}
            Err(e) => {
                warn!(error = %e, "cannot check the CDC capture job (needs read access to msdb)")
            }
        }
        match self
            .client
            .query(
                "checking SQL Server Agent",
                skein_sql::sqlserver::AGENT_STATUS_SQL,
                &[],
            )
            .await
        {
            Ok(rows) => {
                if let Some(state) = rows
                    .first()
                    .and_then(|r| r.first())
                    .and_then(SqlValue::to_text)
                {
                    if state != "Running" {
                        return Err(Error::NotReady {
                            message: format!(
                                "SQL Server Agent is `{state}`: CDC captures nothing without it"
                            ),
                            fix: "start SQL Server Agent (containers: MSSQL_AGENT_ENABLED=true)"
                                .into(),
                        });
                    }
                }
            }
            Err(e) => warn!(error = %e, "cannot check SQL Server Agent (needs VIEW SERVER STATE)"),
        }
        match self
            .client
            .query(
                "checking capture errors",
                skein_sql::sqlserver::LOG_SCAN_ERRORS_SQL,
                &[],
            )
            .await
        {
            Ok(rows) if !rows.is_empty() => warn!(
                "the CDC capture job reported errors (sys.dm_cdc_log_scan_sessions); \
                 see sys.dm_cdc_errors"
            ),
            Ok(_) => {}
            Err(e) => warn!(error = %e, "cannot read sys.dm_cdc_log_scan_sessions"),
        }
        Ok(())
    }

    /// What `skein validate` checks: CDC on the database, the capture
    /// instances and their columns, the capture job and the agent, that
    /// every capture instance is readable, and `source.time_zone`. Returns
    /// what is worth knowing without a fix (the commit-time warning).
    pub async fn check(&mut self) -> Result<Vec<String>> {
        self.check_cdc().await?;
        self.min_lsns().await?;
        let (_, warning) = self.choose_clock().await?;
        Ok(warning.into_iter().collect())
    }

    /// Decides how commit times become UTC ([`clock`]): asks the server
    /// what it has and checks `source.time_zone` against it.
    async fn choose_clock(&mut self) -> Result<(CommitClock, Option<String>)> {
        use skein_sql::sqlserver::{
            CURRENT_TIME_ZONE_SQL, SERVER_VERSION_SQL, TIME_ZONE_KNOWN_SQL,
        };
        let rows = self
            .client
            .query("reading the server version", SERVER_VERSION_SQL, &[])
            .await?;
        let version = ServerVersion::from_row(rows.first().map(Vec::as_slice).unwrap_or_default());
        let server_zone = if version.has_current_timezone_id() {
            match self
                .client
                .query("reading the server's time zone", CURRENT_TIME_ZONE_SQL, &[])
                .await
            {
                Ok(rows) => rows
                    .first()
                    .and_then(|r| r.first())
                    .and_then(SqlValue::to_text),
                Err(e) if e.is_retryable() => return Err(e.into()),
                // A server without the function after all: as if it had none.
                Err(e) => {
                    debug!(error = %e, "CURRENT_TIMEZONE_ID() is not available");
                    None
                }
            }
        } else {
            None
        };
        let configured_known = match &self.time_zone {
            Some(tz) if version.has_at_time_zone() => {
                let rows = self
                    .client
                    .query(
                        "looking source.time_zone up in sys.time_zone_info",
                        TIME_ZONE_KNOWN_SQL,
                        &[&tz.as_str()],
                    )
                    .await?;
                Some(
                    matches!(rows.first().and_then(|r| r.first()), Some(SqlValue::Int(n)) if *n > 0),
                )
            }
            _ => None,
        };
        let facts = ClockFacts {
            version,
            configured_known,
            server_zone,
        };
        clock::choose_clock(self.time_zone.as_deref(), &facts).map_err(|p| Error::NotReady {
            message: p.message,
            fix: p.fix,
        })
    }

    /// For `skein status`: the highest LSN CDC has written and each capture
    /// instance's lowest (what cleanup has not removed yet).
    pub async fn validity_interval(
        &mut self,
    ) -> Result<(SqlServerLsn, Vec<(String, SqlServerLsn)>)> {
        self.check_cdc().await?;
        let mins = self.min_lsns().await?;
        Ok((self.max_lsn().await?, mins))
    }

    /// The highest LSN CDC has written (`skein marker reset --latest`).
    pub async fn current_max_lsn(&mut self) -> Result<SqlServerLsn> {
        self.max_lsn().await
    }

    async fn min_lsns(&mut self) -> Result<Vec<(String, SqlServerLsn)>> {
        if self.instances.is_empty() {
            return Ok(vec![]);
        }
        let names: Vec<&str> = self.instances.iter().map(|i| i.name.as_str()).collect();
        let params: Vec<&dyn tiberius::ToSql> =
            names.iter().map(|n| n as &dyn tiberius::ToSql).collect();
        let rows = self
            .client
            .query(
                "reading the validity intervals",
                &skein_sql::sqlserver::min_lsns_sql(names.len()),
                &params,
            )
            .await?;
        let row = rows.first().map(Vec::as_slice).unwrap_or_default();
        let mut out = Vec::with_capacity(names.len());
        for (i, name) in names.iter().enumerate() {
            let min = lsn_of(row.get(i).unwrap_or(&SqlValue::Null), "min LSN")?;
            if min == SqlServerLsn::ZERO {
                return Err(self.not_ready(format!(
                    "capture instance `{name}` is not readable (sys.fn_cdc_get_min_lsn returned 0): \
                     it does not exist or the login may not read it"
                )));
            }
            out.push((name.to_string(), min));
        }
        Ok(out)
    }

    /// The first `cap + 1` change LSNs, in order, that the instances give
    /// in their ranges up to `max` (`reads` in instance order): what sizes
    /// a batch, and the oldest of them is the oldest change not read yet.
    async fn first_change_lsns(
        &mut self,
        reads: &[InstanceRead],
        max: SqlServerLsn,
        cap: usize,
    ) -> Result<Vec<SqlServerLsn>> {
        // Instances with nothing up to `max` stay out of the window query.
        type Bounds = Vec<(Vec<u8>, Vec<u8>)>;
        let (names, bounds): (Vec<String>, Bounds) = self
            .instances
            .iter()
            .zip(reads)
            .filter_map(|(i, r)| {
                instance_range(r, max).map(|(f, t)| (i.name.clone(), (f.0.to_vec(), t.0.to_vec())))
            })
            .unzip();
        if names.is_empty() {
            return Ok(vec![]);
        }
        let cap = i32::try_from(cap).unwrap_or(i32::MAX - 1);
        let mut params: Vec<&dyn tiberius::ToSql> = vec![&cap];
        for (f, t) in &bounds {
            params.push(f);
            params.push(t);
        }
        self.client
            .query(
                "sizing the batch",
                &skein_sql::sqlserver::window_sql(&names),
                &params,
            )
            .await?
            .iter()
            .map(|r| lsn_of(r.first().unwrap_or(&SqlValue::Null), "window LSN"))
            .collect()
    }

    /// For `skein status`: the oldest change of a tracked table after
    /// `after` (`None`: from the start of what CDC holds), whatever
    /// cleanup removed meanwhile (the extractor reports losses).
    pub async fn first_unread(
        &mut self,
        after: Option<SqlServerLsn>,
    ) -> Result<Option<SqlServerLsn>> {
        let mins = self.min_lsns().await?;
        let max = self.max_lsn().await?;
        let after = after.unwrap_or(SqlServerLsn::ZERO);
        if max <= after {
            return Ok(None);
        }
        let tables = facts_by_table(&self.instances, &mins);
        let all_held = mins.iter().map(|(_, m)| *m).max();
        let reads: Vec<InstanceRead> = plan_reads(after, &tables, all_held)
            .into_iter()
            .flatten()
            .collect();
        Ok(self
            .first_change_lsns(&reads, max, 0)
            .await?
            .first()
            .copied())
    }

    /// The CDC cleanup job's retention against the age of `first_unread`,
    /// the oldest change not read yet (`None`: nothing unread).
    /// `Ok(Err(reason))` when msdb cannot be read (permissions).
    pub async fn cleanup_retention(
        &mut self,
        first_unread: Option<SqlServerLsn>,
    ) -> Result<std::result::Result<CleanupRetention, String>> {
        let retention = match self
            .client
            .query(
                "reading the CDC cleanup job's retention",
                skein_sql::sqlserver::CLEANUP_RETENTION_SQL,
                &[],
            )
            .await
        {
            Ok(rows) => rows,
            Err(e) if e.is_retryable() => return Err(e.into()),
            Err(e) => return Ok(Err(e.to_string())),
        };
        let age = match first_unread {
            Some(lsn) => Some(
                self.client
                    .query(
                        "reading when the oldest unread change committed",
                        skein_sql::sqlserver::CHANGE_AGE_SQL,
                        &[&lsn.0.to_vec()],
                    )
                    .await?,
            ),
            None => None,
        };
        Ok(Ok(CleanupRetention::from_rows(&retention, age.as_deref())))
    }

    /// Warns when the oldest unread change (`first_unread`) is older than
    /// `retention_warn_fraction` of the cleanup job's retention: the moment
    /// an operator can still act before cleanup removes it. At start, then
    /// every 30 s; when msdb cannot be read, says so once and stops asking.
    async fn check_retention(&mut self, first_unread: Option<SqlServerLsn>) -> Result<()> {
        if self.msdb_unreadable
            || self
                .retention_checked
                .is_some_and(|t| t.elapsed() < crate::postgres::RETENTION_CHECK_EVERY)
        {
            return Ok(());
        }
        self.retention_checked = Some(Instant::now());
        match self.cleanup_retention(first_unread).await? {
            Ok(r) => {
                if let Some(used) = r.used().filter(|u| *u >= self.retention_warn_fraction) {
                    warn!(
                        first_unread = %first_unread.unwrap_or(SqlServerLsn::ZERO),
                        "{}",
                        retention_warning(&r, used)
                    );
                }
            }
            Err(reason) => {
                self.msdb_unreadable = true;
                warn!(
                    error = %reason,
                    "cannot read the CDC cleanup job's retention (msdb.dbo.cdc_jobs; the login \
                     needs read access to msdb): skein will not warn before cleanup removes \
                     changes it has not read"
                );
            }
        }
        Ok(())
    }

    /// Looks for DDL committed in `(lower, upper]` on the tables of the
    /// capture instances read (one query). When there is some, reads the
    /// catalog again and checks it against the config ([`ddl`]): a change
    /// the config cannot follow stops here, before the batch is resolved
    /// (its marker stays, so after the fix it is read again); anything
    /// else is logged and the resolution plans follow the new catalog.
    async fn follow_ddl(&mut self, lower: SqlServerLsn, upper: SqlServerLsn) -> Result<()> {
        if self.instances.is_empty() {
            return Ok(());
        }
        let (from, to) = (lower.0.to_vec(), upper.0.to_vec());
        let names: Vec<&str> = self.instances.iter().map(|i| i.name.as_str()).collect();
        let mut params: Vec<&dyn tiberius::ToSql> = vec![&from, &to];
        params.extend(names.iter().map(|n| n as &dyn tiberius::ToSql));
        let rows = self
            .client
            .query(
                "reading cdc.ddl_history",
                &skein_sql::sqlserver::schema::ddl_history_sql(names.len()),
                &params,
            )
            .await?;
        if rows.is_empty() {
            return Ok(());
        }
        let ddl = rows
            .iter()
            .map(|r| ddl_row(r))
            .collect::<Result<Vec<_>>>()?;
        let now = load_catalog(&mut self.client, &self.cfg).await?;
        match schema_step(&self.cfg, &self.catalog, &now, &ddl) {
            SchemaStep::Stop { message, fix } => Err(Error::NotReady { message, fix }),
            SchemaStep::Unchanged => {
                info!(ddl = %describe_ddl(&ddl), "DDL on a tracked table changes nothing skein reads");
                Ok(())
            }
            SchemaStep::Follow(changes) => {
                let (plans, by_table) = crate::plans_for(&self.cfg, &now)?;
                info!(ddl = %describe_ddl(&ddl), changes = ?changes,
                    "the source's schema changed; resolution follows it");
                self.fix = skein_sql::sqlserver::source_ddl(&self.cfg, &now);
                (self.plans, self.by_table, self.catalog) = (plans, by_table, now);
                Ok(())
            }
        }
    }

    async fn max_lsn(&mut self) -> Result<SqlServerLsn> {
        let rows = self
            .client
            .query(
                "reading the max LSN",
                skein_sql::sqlserver::MAX_LSN_SQL,
                &[],
            )
            .await?;
        lsn_of(
            rows.first()
                .and_then(|r| r.first())
                .unwrap_or(&SqlValue::Null),
            "max LSN",
        )
    }

    /// Reads the changes of every instance in its range (`ranges`, in
    /// instance order; `None`: nothing to read from it), paired and merged
    /// in commit, then change order, with their instance index.
    async fn read_changes(
        &mut self,
        ranges: &[Option<(SqlServerLsn, SqlServerLsn)>],
    ) -> Result<Vec<(usize, CdcChange)>> {
        let mut all = vec![];
        for (ii, inst) in self.instances.clone().iter().enumerate() {
            let Some((from, upper)) = ranges[ii] else {
                continue;
            };
            let sql = skein_sql::sqlserver::changes_sql(&inst.name, &inst.columns);
            let rows = self
                .client
                .query(
                    &format!("reading the changes of {}", inst.name),
                    &sql,
                    &[&from.0.to_vec(), &upper.0.to_vec()],
                )
                .await?;
            let cdc = rows
                .into_iter()
                .map(|r| cdc_row(&inst.name, r))
                .collect::<Result<Vec<_>>>()?;
            let changes = pair(cdc).map_err(|e| Error::Decode(format!("{}: {e}", inst.name)))?;
            all.extend(changes.into_iter().map(|c| (ii, c)));
        }
        Ok(merge_changes(all))
    }

    /// Reads the next part of the transaction at `p.lsn`: at most `n` rows
    /// after the cursor, from every instance that covers it (`reads`, in
    /// instance order), merged as [`MssqlSource::read_changes`] merges them.
    /// Each instance gives at most `n + 1` rows, and what is kept of them
    /// is `n + 1` rows: memory holds about two parts' rows, whatever the
    /// transaction's size.
    async fn read_part(
        &mut self,
        reads: &[InstanceRead],
        p: &PartCursor,
        n: usize,
    ) -> Result<Part> {
        let top = i32::try_from(n + 1).unwrap_or(i32::MAX);
        let (lsn, after) = (
            p.lsn.0.to_vec(),
            p.after.unwrap_or(SqlServerLsn::ZERO).0.to_vec(),
        );
        let mut kept = Vec::new();
        for (ii, inst) in self.instances.clone().iter().enumerate() {
            if !covers(&reads[ii], p.lsn) {
                continue;
            }
            let rows = self
                .client
                .query(
                    &format!("reading a part of a large transaction from {}", inst.name),
                    &skein_sql::sqlserver::part_sql(&inst.name, &inst.columns),
                    &[&top, &lsn, &after],
                )
                .await?
                .into_iter()
                .map(|r| cdc_row(&inst.name, r))
                .collect::<Result<Vec<_>>>()?;
            merge_part_rows(&mut kept, ii, rows, n + 1);
        }
        cut_part(kept, n).map_err(|e| Error::Decode(e.to_string()))
    }

    /// Hands over the next part of a transaction larger than one batch.
    /// Every record carries the transaction's commit LSN and numbers on
    /// from the earlier parts; a part that is not the last says in
    /// `in_flight` how far it got, and the next batch after `p.lower`
    /// reads on from there.
    async fn part_batch(
        &mut self,
        p: PartCursor,
        reads: &[InstanceRead],
        limits: BatchLimits,
    ) -> Result<ReadBatch> {
        let part = self
            .read_part(reads, &p, part_rows(limits.max_changes))
            .await?;
        let txs = transactions(&self.instances, &part.changes);
        let tracked = count_tracked(&self.by_table, txs.iter().flat_map(|(_, c)| c));
        let times = self.commit_times(p.lsn, p.lsn).await?;
        let records = self.resolve(&txs, &times, p.tracked).await?;
        let next = p.after_part(
            part.changes.last().map(|(_, c)| c.seqval),
            part.changes.len(),
            tracked,
        );
        self.part = (!part.last).then_some(next);
        Ok(ReadBatch {
            upper: Some(p.lsn.into()),
            transactions: usize::from(part.last),
            changes: part.changes.len(),
            // A part: what follows the large transaction is read on.
            more: true,
            records,
            in_flight: (!part.last).then(|| next.in_flight()),
        })
    }

    /// Before a restart reads on after the stored `__$seqval`: the
    /// transaction is within what CDC holds ([`in_flight_past_max`]), and
    /// the capture instances read now hold nothing after the marker that
    /// reading on would skip ([`check_in_flight`]). Two queries per
    /// instance, once per start.
    async fn check_resume(&mut self, p: &PartCursor) -> Result<()> {
        in_flight_past_max(p, self.max_lsn().await?)?;
        let reads = self.plan(p.lower).await?;
        let (lsn, after) = (
            p.lsn.0.to_vec(),
            p.after.unwrap_or(SqlServerLsn::ZERO).0.to_vec(),
        );
        let mut now = Vec::with_capacity(reads.len());
        for (ii, inst) in self.instances.clone().iter().enumerate() {
            // This instance alone, in its range up to the transaction.
            let alone: Vec<InstanceRead> = reads
                .iter()
                .enumerate()
                .map(|(j, r)| InstanceRead {
                    coverage: if j == ii {
                        r.coverage
                    } else {
                        Coverage::Finished
                    },
                    ..r.clone()
                })
                .collect();
            let first = self
                .first_change_lsns(&alone, p.lsn, 0)
                .await?
                .first()
                .copied();
            let handed = if covers(&reads[ii], p.lsn) {
                let rows = self
                    .client
                    .query(
                        &format!(
                            "counting what {} holds of the transaction in flight",
                            inst.name
                        ),
                        &skein_sql::sqlserver::handed_over_sql(&inst.name),
                        &[&lsn, &after],
                    )
                    .await?;
                let n = int_of(
                    rows.first()
                        .and_then(|r| r.first())
                        .unwrap_or(&SqlValue::Null),
                    "COUNT_BIG(*)",
                )?;
                u64::try_from(n).unwrap_or(0)
            } else {
                0
            };
            now.push(AtResume {
                name: inst.name.clone(),
                first,
                handed,
            });
        }
        check_in_flight(p, &now)
    }

    /// Where each instance is read in the batch after `lower`, every
    /// instance in order; cleanup may have run since the last batch, so a
    /// loss stops here.
    async fn plan(&mut self, lower: SqlServerLsn) -> Result<Vec<InstanceRead>> {
        let mins = self.min_lsns().await?;
        let tables = facts_by_table(&self.instances, &mins);
        let plan = plan_reads(lower, &tables, self.accepted_loss);
        if let Some(loss) = first_loss(lower, &tables, &plan) {
            return Err(Error::DataLoss {
                marker: loss.marker.to_string(),
                available: format!(
                    "{} (capture instance {}; CDC cleanup removed the rest while skein ran)",
                    loss.min_lsn, loss.capture_instance
                ),
            });
        }
        Ok(plan.into_iter().flatten().collect())
    }

    async fn commit_times(
        &mut self,
        from: SqlServerLsn,
        upper: SqlServerLsn,
    ) -> Result<HashMap<SqlServerLsn, (i64, u64)>> {
        let (from, upper) = (from.0.to_vec(), upper.0.to_vec());
        let zone = self.clock.zone().map(str::to_string);
        let mut params: Vec<&dyn tiberius::ToSql> = vec![&from, &upper];
        if let Some(z) = &zone {
            params.push(z);
        }
        let rows = self
            .client
            .query("reading commit times", self.clock.sql(), &params)
            .await?;
        let mut out = HashMap::new();
        for r in rows {
            let lsn = lsn_of(r.first().unwrap_or(&SqlValue::Null), "start_lsn")?;
            let micros = r
                .get(1)
                .map(|v| int_of(v, "tran_end_time"))
                .transpose()?
                .unwrap_or(0);
            let tx_id = match r.get(2) {
                Some(SqlValue::Binary(b)) => tx_id_of(b),
                _ => 0,
            };
            out.insert(lsn, (micros, tx_id));
        }
        Ok(out)
    }

    /// Resolves `txs` to records; `before`: how many tracked changes of
    /// the first transaction earlier parts handed over (0 but for a part).
    async fn resolve(
        &mut self,
        txs: &[(SqlServerLsn, Vec<RawChange>)],
        times: &HashMap<SqlServerLsn, (i64, u64)>,
        before: u32,
    ) -> Result<Vec<ChangeRecord>> {
        // SQL Server refuses TRUNCATE on a table with CDC enabled: no
        // truncate notices, whatever the partition count.
        let mut res = BatchResolution::new_from(
            &self.plans,
            &self.by_table,
            1,
            txs.iter()
                .enumerate()
                .map(|(i, (_, c))| (c.as_slice(), if i == 0 { before } else { 0 })),
        )?;
        for gi in 0..res.lookups().len() {
            let g = res.lookups()[gi].clone();
            let plan = &self.plans[g.plan];
            let node = &plan.nodes[g.node];
            let width = node.on.len();
            let what = format!("resolving roots of {}", node.qualified());
            let lookup = skein_sql::sqlserver::lookup_sql(&plan.nodes, g.node, &self.catalog);
            self.client
                .fill_temp_table(
                    &what,
                    &skein_sql::sqlserver::lookup_table_sql(width),
                    &g.values,
                    skein_sql::sqlserver::keys_per_insert(width),
                    |rows| {
                        skein_sql::sqlserver::temp_insert_sql(
                            skein_sql::sqlserver::LOOKUP_TABLE,
                            width,
                            rows,
                        )
                    },
                )
                .await?;
            let rows = self.client.query(&what, &lookup, &[]).await?;
            let answers = rows
                .iter()
                .map(|r| {
                    let ord = int_of(r.first().unwrap_or(&SqlValue::Null), "ord")?;
                    Ok((ord, skein_sql::sqlserver::decode::root_key(&r[1..])))
                })
                .collect::<Result<Vec<_>>>()?;
            res.answer(gi, answers)?;
        }
        let meta: Vec<TxMeta> = txs
            .iter()
            .map(|(lsn, _)| {
                let (micros, tx_id) = times.get(lsn).copied().unwrap_or((0, 0));
                TxMeta {
                    position: (*lsn).into(),
                    tx_id,
                    commit_time_micros: micros,
                }
            })
            .collect();
        res.finish(&self.plans, &meta)
    }
}

/// The instances' facts grouped by table, oldest first (`instances` lists
/// each table's instances together, oldest first; `mins` in the same
/// order), for [`plan_reads`].
pub fn facts_by_table(
    instances: &[Instance],
    mins: &[(String, SqlServerLsn)],
) -> Vec<Vec<InstanceFacts>> {
    let mut out: Vec<Vec<InstanceFacts>> = vec![];
    let mut last: Option<(&str, &str)> = None;
    for (inst, (_, min)) in instances.iter().zip(mins) {
        let facts = InstanceFacts {
            name: inst.name.clone(),
            min_lsn: *min,
            create_lsn: inst.create_lsn,
        };
        let table = (inst.schema.as_str(), inst.table.as_str());
        match out.last_mut() {
            Some(group) if last == Some(table) => group.push(facts),
            _ => out.push(vec![facts]),
        }
        last = Some(table);
    }
    out
}

/// The low 8 bytes of `tran_id` (binary(10)), as the record's transaction id.
pub fn tx_id_of(tran_id: &[u8]) -> u64 {
    tran_id
        .iter()
        .rev()
        .take(8)
        .rev()
        .fold(0u64, |acc, b| (acc << 8) | u64::from(*b))
}

/// Turns one paired change into the images resolution reads (column texts).
pub fn raw_change(inst: &Instance, c: &CdcChange) -> RawChange {
    let image = |vals: &Option<Vec<SqlValue>>| -> Option<RowImage> {
        vals.as_ref().map(|v| {
            inst.columns
                .iter()
                .cloned()
                .zip(v.iter().map(SqlValue::to_text))
                .collect()
        })
    };
    RawChange {
        table: (inst.schema.clone(), inst.table.clone()),
        op: match c.op {
            CdcOp::Insert => Op::Insert,
            CdcOp::Update => Op::Update,
            CdcOp::Delete => Op::Delete,
        },
        old: image(&c.before),
        new: image(&c.after),
    }
}

/// Merges the paired changes of every instance (concatenated in instance
/// order) in commit, then change order: `(__$start_lsn, __$seqval)`, then
/// instance, then the instance's own order.
pub fn merge_changes(mut all: Vec<(usize, CdcChange)>) -> Vec<(usize, CdcChange)> {
    // Stable: changes of one instance keep their order on equal keys.
    all.sort_by_key(|a| (a.1.start_lsn, a.1.seqval));
    all
}

/// Groups merged changes into transactions by commit LSN.
pub fn transactions(
    instances: &[Instance],
    changes: &[(usize, CdcChange)],
) -> Vec<(SqlServerLsn, Vec<RawChange>)> {
    let mut out: Vec<(SqlServerLsn, Vec<RawChange>)> = vec![];
    for (ii, c) in changes {
        let raw = raw_change(&instances[*ii], c);
        match out.last_mut() {
            Some((lsn, v)) if *lsn == c.start_lsn => v.push(raw),
            _ => out.push((c.start_lsn, vec![raw])),
        }
    }
    out
}

impl ChangeSource for MssqlSource {
    fn label(&self) -> String {
        self.database.clone()
    }

    async fn prepare(
        &mut self,
        marker: Option<SourcePosition>,
        floor: Option<SourcePosition>,
        continue_with_data_loss: bool,
    ) -> Result<StartPoint> {
        // A lost state directory: resume from the sidecar's progress, so a
        // capture instance cleaned up past it is reported as data loss.
        let marker = crate::marker_in(marker.or(floor), SourcePosition::sqlserver)?;
        self.check_cdc().await?;
        let (clock, warning) = self.choose_clock().await?;
        match (&warning, clock.zone()) {
            (Some(w), _) => warn!("{w}"),
            (None, Some(zone)) => {
                info!(time_zone = zone, "commit times are read in this time zone")
            }
            (None, None) => {}
        }
        self.clock = clock;
        let mins = self.min_lsns().await?;
        let Some(m) = marker else {
            // First start: everything the capture instances still hold.
            let first = mins
                .iter()
                .map(|(_, l)| *l)
                .min()
                .unwrap_or(SqlServerLsn::ZERO);
            // Everything each instance holds is the start, not a loss.
            self.accepted_loss = mins.iter().map(|(_, l)| *l).max();
            return Ok(StartPoint {
                position: first.decrement().into(),
                data_loss: false,
            });
        };
        let tables = facts_by_table(&self.instances, &mins);
        let plan = plan_reads(m, &tables, None);
        for (facts, reads) in tables.iter().zip(&plan) {
            if let (Some(f), Some(r)) = (facts.first(), reads.first()) {
                if r.coverage == Coverage::FromOwnStart {
                    // CDC cannot tell a table newly under capture from one
                    // whose older instance was dropped unread.
                    warn!(
                        capture_instance = %f.name,
                        start = %f.min_lsn,
                        marker = %m,
                        "capture instance created after the marker: reading it from its own \
                         start. If an older capture instance of this table was dropped before \
                         skein read up to that start, the changes in between are lost"
                    );
                }
            }
        }
        match first_loss(m, &tables, &plan) {
            None => Ok(StartPoint {
                position: m.into(),
                data_loss: false,
            }),
            Some(loss) if continue_with_data_loss => {
                // The marker stays: only the instances cleanup emptied are
                // read from what is left; the others still hold everything
                // after the marker, and it is read.
                let accepted = tables
                    .iter()
                    .zip(&plan)
                    .flat_map(|(f, r)| f.iter().zip(r))
                    .filter(|(_, r)| r.coverage == Coverage::Loss)
                    .map(|(f, _)| f.min_lsn)
                    .max();
                self.accepted_loss = accepted;
                warn!(error = %loss, "continuing with data loss");
                Ok(StartPoint {
                    position: m.into(),
                    data_loss: true,
                })
            }
            Some(loss) => Err(Error::DataLoss {
                marker: loss.marker.to_string(),
                available: format!(
                    "{} (capture instance {}; CDC cleanup removed the rest)",
                    loss.min_lsn, loss.capture_instance
                ),
            }),
        }
    }

    async fn start(&mut self, from: SourcePosition, in_flight: Option<InFlight>) -> Result<()> {
        self.part = None;
        // Nothing is held open between batches: each one is a set of
        // queries.
        let Some(f) = in_flight else {
            return Ok(());
        };
        // A transaction handed over in part: read on after the last
        // `__$seqval` handed over, none of what was handed over again,
        // once the server and the config are seen to allow it.
        let p = PartCursor::resume(from, &f).map_err(|message| Error::NotReady {
            message,
            fix: "give this source its own state_dir".into(),
        })?;
        self.check_resume(&p).await?;
        self.part = Some(p);
        Ok(())
    }

    async fn next_batch(
        &mut self,
        lower: SourcePosition,
        limits: BatchLimits,
    ) -> Result<ReadBatch> {
        let lower = lower
            .sqlserver()
            .map_err(|e| Error::Decode(e.to_string()))?;
        if let Some(p) = self.part.filter(|p| p.lower == lower) {
            // The next part of the transaction in flight: no waiting, no
            // sizing; the window is still `(lower, p.lsn]`. Cleanup may
            // have run since the last part; DDL in the window was
            // followed already, unless this process just started.
            let reads = self.plan(lower).await?;
            self.check_retention(Some(p.lsn)).await?;
            if !p.ddl_followed {
                self.follow_ddl(lower, p.lsn).await?;
            }
            return self.part_batch(p, &reads, limits).await;
        }
        self.part = None;
        let deadline = tokio::time::Instant::now() + limits.max_wait.max(self.poll);
        let max = loop {
            let max = self.max_lsn().await?;
            if max > lower {
                break max;
            }
            let now = tokio::time::Instant::now();
            if now >= deadline {
                // Nothing unread: only msdb's readability to find out.
                self.check_retention(None).await?;
                return Ok(ReadBatch::default());
            }
            tokio::time::sleep(self.poll.min(deadline - now)).await;
        };
        let reads = self.plan(lower).await?;
        let from = lower.increment();
        let lsns = self
            .first_change_lsns(&reads, max, limits.max_changes.max(1))
            .await?;
        self.check_retention(lsns.first().copied()).await?;
        let window = next_window(lower, max, &lsns, limits.max_changes);
        // DDL committed in the window is looked at before anything of it
        // is resolved, even when the window holds no change.
        self.follow_ddl(lower, window.unwrap_or(max)).await?;
        let Some(upper) = window else {
            // Nothing for tracked tables up to `max`: move past it.
            return Ok(ReadBatch {
                upper: Some(max.into()),
                ..ReadBatch::default()
            });
        };
        if let Some(lsn) = large_transaction(&lsns, limits.max_changes) {
            info!(lsn = %lsn, max_batch_changes = limits.max_changes,
                "a transaction of more change rows than a batch holds: handing it over in parts");
            return self
                .part_batch(PartCursor::first(lower, lsn), &reads, limits)
                .await;
        }
        let ranges: Vec<Option<(SqlServerLsn, SqlServerLsn)>> =
            reads.iter().map(|r| instance_range(r, upper)).collect();
        let changes = self.read_changes(&ranges).await?;
        let txs = transactions(&self.instances, &changes);
        let times = self.commit_times(from, upper).await?;
        let records = self.resolve(&txs, &times, 0).await?;
        Ok(ReadBatch {
            upper: Some(upper.into()),
            transactions: txs.len(),
            changes: changes.len(),
            // The window stopped short of what CDC holds: a backlog. (Its
            // changes can be far fewer than `max_changes`: the window
            // counts change rows, two per update, and ends at the last
            // transaction that fits.)
            more: upper < max,
            records,
            in_flight: None,
        })
    }

    fn confirm(&mut self, _upper: SourcePosition) {
        // CDC keeps changes for its retention period whatever skein read;
        // the validity check catches what cleanup removed.
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// LSN `n` (shortened LSNs in recorded situations).
    pub(super) fn lsn(n: u64) -> SqlServerLsn {
        let mut b = [0u8; 10];
        b[2..].copy_from_slice(&n.to_be_bytes());
        SqlServerLsn(b)
    }

    fn row(l: u64, seq: u64, op: i32, v: i64) -> CdcRow {
        CdcRow {
            start_lsn: lsn(l),
            seqval: lsn(seq),
            operation: op,
            values: vec![SqlValue::Int(v), SqlValue::Null],
        }
    }

    #[test]
    fn operations_map_and_updates_pair() {
        let got = pair(vec![
            row(10, 1, 2, 1),
            row(10, 2, 3, 1),
            row(10, 2, 4, 2),
            row(11, 1, 1, 2),
        ])
        .unwrap();
        let ops: Vec<CdcOp> = got.iter().map(|c| c.op).collect();
        assert_eq!(ops, [CdcOp::Insert, CdcOp::Update, CdcOp::Delete]);
        assert_eq!(got[1].before.as_ref().unwrap()[0], SqlValue::Int(1));
        assert_eq!(got[1].after.as_ref().unwrap()[0], SqlValue::Int(2));
        assert_eq!(got[1].after.as_ref().unwrap()[1], SqlValue::Null);
        assert!(got[0].before.is_none() && got[2].after.is_none());
    }

    #[test]
    fn broken_rows_are_errors() {
        assert!(matches!(
            pair(vec![row(10, 1, 3, 1)]),
            Err(CdcError::UnpairedUpdate {
                missing: "after",
                ..
            })
        ));
        assert!(matches!(
            pair(vec![row(10, 1, 4, 1)]),
            Err(CdcError::UnpairedUpdate {
                missing: "before",
                ..
            })
        ));
        assert!(matches!(
            pair(vec![row(10, 1, 3, 1), row(10, 2, 4, 1)]),
            Err(CdcError::UnpairedUpdate { .. })
        ));
        assert!(matches!(
            pair(vec![row(10, 1, 5, 1)]),
            Err(CdcError::UnknownOperation { operation: 5, .. })
        ));
    }

    /// An in-memory capture instance that behaves like SQL Server's: changes
    /// at increasing LSNs, a max LSN, and a cleanup job that raises the min.
    struct MemoryCdc {
        changes: Vec<SqlServerLsn>,
        min: SqlServerLsn,
    }

    impl MemoryCdc {
        fn max_lsn(&self) -> SqlServerLsn {
            self.changes.last().copied().unwrap_or(self.min)
        }
        fn first_after(&self, marker: SqlServerLsn, n: usize) -> Vec<SqlServerLsn> {
            self.changes
                .iter()
                .copied()
                .filter(|l| *l > marker)
                .take(n)
                .collect()
        }
        fn cleanup(&mut self, below: SqlServerLsn) {
            self.changes.retain(|l| *l >= below);
            self.min = below;
        }
    }

    #[test]
    fn windows_cover_every_change_once_and_cleanup_is_data_loss() {
        // Transactions at LSN 2 (3 changes), 3 (1), 5 (4), 8 (2).
        let mut src = MemoryCdc {
            changes: [2, 2, 2, 3, 5, 5, 5, 5, 8, 8]
                .iter()
                .map(|n| lsn(*n))
                .collect(),
            min: lsn(1),
        };
        let mut marker = lsn(1);
        let mut seen: Vec<SqlServerLsn> = vec![];
        while let Some(upper) = next_window(marker, src.max_lsn(), &src.first_after(marker, 4), 3) {
            assert_eq!(single(marker, src.min), None);
            seen.extend(src.changes.iter().filter(|l| **l > marker && **l <= upper));
            assert!(upper > marker);
            marker = upper;
        }
        assert_eq!(seen.len(), 10, "every change exactly once");
        assert_eq!(marker, lsn(8));
        // Nothing new: no window.
        assert_eq!(next_window(marker, src.max_lsn(), &[], 3), None);
        // Cleanup up to the marker's successor keeps everything needed.
        src.cleanup(lsn(9));
        assert_eq!(single(marker, src.min), None);
        // Cleanup past it: changes may be gone.
        src.changes.extend([lsn(12), lsn(13)]);
        src.cleanup(lsn(13));
        let e = single(marker, src.min).unwrap();
        assert_eq!(e.min_lsn, lsn(13));
        assert!(e.to_string().contains("continue_with_data_loss"), "{e}");
    }
    /// The loss [`plan_reads`] finds for one instance that existed at the marker.
    fn single(marker: SqlServerLsn, min: SqlServerLsn) -> Option<DataLoss> {
        let t = vec![vec![facts("dbo_t", min, None)]];
        first_loss(marker, &t, &plan_reads(marker, &t, None))
    }

    fn facts(name: &str, min: SqlServerLsn, create: Option<u64>) -> InstanceFacts {
        InstanceFacts {
            name: name.into(),
            min_lsn: min,
            create_lsn: create.map(lsn),
        }
    }

    #[test]
    fn the_configured_or_every_capture_instance_is_read() {
        let found = vec!["dbo_customer".to_string(), "dbo_customer_v2".to_string()];
        let (names, warning) = choose_instances("dbo.customer", None, &found).unwrap();
        assert_eq!(names, found);
        assert!(warning.unwrap().contains("2 capture instances"));
        let (names, warning) =
            choose_instances("dbo.customer", Some("dbo_customer"), &found).unwrap();
        assert_eq!((names, warning), (vec!["dbo_customer".to_string()], None));
        let e = choose_instances("dbo.customer", Some("nope"), &found).unwrap_err();
        assert!(e.contains("`nope`") && e.contains("dbo_customer_v2"), "{e}");
        assert!(choose_instances("dbo.customer", None, &[])
            .unwrap_err()
            .contains("no CDC capture instance"));
        assert_eq!(
            choose_instances("dbo.customer", None, &found[1..]).unwrap(),
            (vec!["dbo_customer_v2".to_string()], None)
        );
    }

    /// Recorded situations (LSNs shortened): the marker at 10.
    #[test]
    fn each_instance_is_read_from_the_marker_its_start_or_is_a_loss() {
        let m = lsn(10);
        let plan = |t: Vec<Vec<InstanceFacts>>, acc: Option<u64>| {
            plan_reads(m, &t, acc.map(lsn))
                .into_iter()
                .flatten()
                .map(|r| (r.coverage, r.from, r.until))
                .collect::<Vec<_>>()
        };
        // Holds the marker's successor: from the marker (11).
        assert_eq!(
            plan(vec![vec![facts("a", lsn(11), None)]], None),
            [(Coverage::FromMarker, lsn(11), None)]
        );
        // A table added later: created at 30 (after the marker), starts at 31.
        assert_eq!(
            plan(vec![vec![facts("b", lsn(31), Some(30))]], None),
            [(Coverage::FromOwnStart, lsn(31), None)]
        );
        // Created by the last commit the marker holds: still after it.
        assert_eq!(
            plan(vec![vec![facts("b", lsn(31), Some(10))]], None)[0].0,
            Coverage::FromOwnStart
        );
        // Existed before the marker (created at 5, or unknown), cleaned to 12: loss.
        for create in [Some(5), Some(9), None] {
            assert_eq!(
                plan(vec![vec![facts("c", lsn(12), create)]], None)[0].0,
                Coverage::Loss
            );
        }
        // Accepted: read what is left; cleaned further: a loss again.
        assert_eq!(
            plan(vec![vec![facts("c", lsn(12), None)]], Some(12))[0],
            (Coverage::AcceptedLoss, lsn(12), None)
        );
        assert_eq!(
            plan(vec![vec![facts("c", lsn(13), None)]], Some(12))[0].0,
            Coverage::Loss
        );
        // A loss on one table leaves the others at the marker.
        let p = plan(
            vec![
                vec![facts("c", lsn(12), None)],
                vec![facts("a", lsn(3), None)],
            ],
            Some(12),
        );
        assert_eq!(p[1], (Coverage::FromMarker, lsn(11), None));
        // Two instances of one table, the new one starting at 40: the old
        // up to 39, the new from 40.
        assert_eq!(
            plan(
                vec![vec![
                    facts("old", lsn(3), Some(1)),
                    facts("new", lsn(40), Some(39))
                ]],
                None
            ),
            [
                (Coverage::FromMarker, lsn(11), Some(lsn(40))),
                (Coverage::FromOwnStart, lsn(40), None)
            ]
        );
        // The marker past the switch: the old one is done. At the switch
        // exactly (marker 39 = the last LSN the old one covers): done too.
        let two = |min_old, min_new| {
            vec![vec![
                facts("old", lsn(min_old), Some(1)),
                facts("new", lsn(min_new), None),
            ]]
        };
        assert_eq!(plan(two(3, 8), None)[0].0, Coverage::Finished);
        assert_eq!(
            plan(two(3, 8), None)[1],
            (Coverage::FromMarker, lsn(11), None)
        );
        assert_eq!(plan(two(3, 11), None)[0].0, Coverage::Finished);
        assert_eq!(
            plan(two(3, 12), None)[0],
            (Coverage::FromMarker, lsn(11), Some(lsn(12)))
        );
        // Cleanup emptied the old one below the new one's start: the old
        // one's loss is reported (the new one cannot cover it).
        let p = plan(two(20, 40), None);
        assert_eq!(p[0].0, Coverage::Loss);
        assert_eq!(p[1].0, Coverage::FromOwnStart);
    }

    proptest::proptest! {
        /// Two instances of one table: the old one holds every change from
        /// its creation, the new one every change from its start `s` on,
        /// both until cleanup (one low-water mark for both). Whatever the
        /// batches, the cleanup and the switch point: without a reported
        /// loss every change is read exactly once; a loss is reported only
        /// when cleanup passed the marker's successor below the switch.
        #[test]
        fn two_instances_are_followed_without_gap_or_repeat(
            changes in proptest::collection::btree_set(2u64..200, 1..60),
            s in 2u64..200,
            caps in proptest::collection::vec(1u64..40, 1..30),
            clean_at in 0usize..30,
            clean_to in 0u64..200,
        ) {
            let changes: Vec<u64> = changes.into_iter().collect();
            let mut low = 1u64;
            let mut marker = 1u64;
            let mut seen: Vec<u64> = vec![];
            let mut lost = false;
            for (i, cap) in caps.iter().enumerate() {
                if i == clean_at {
                    low = low.max(clean_to);
                }
                let tables = vec![vec![
                    facts("old", lsn(low), Some(0)),
                    facts("new", lsn(s.max(low)), Some(s - 1)),
                ]];
                let plan = plan_reads(lsn(marker), &tables, None);
                if first_loss(lsn(marker), &tables, &plan).is_some() {
                    // Only when cleanup passed what follows the marker (CDC
                    // cannot tell whether a change was there: conservative)
                    // on the instance still covering it.
                    proptest::prop_assert!(low > marker + 1 && marker + 1 < s.max(low));
                    lost = true;
                    break;
                }
                let upper = marker + cap;
                for (k, r) in plan[0].iter().enumerate() {
                    if let Some((f, t)) = instance_range(r, lsn(upper)) {
                        // What instance k holds in [f, t].
                        let from_k = if k == 0 { low } else { s.max(low) };
                        seen.extend(changes.iter().copied().filter(|c| {
                            lsn(*c) >= f && lsn(*c) <= t && *c >= from_k
                        }));
                    }
                }
                marker = upper;
            }
            if !lost {
                let mut want: Vec<u64> = changes.iter().copied().filter(|c| *c <= marker).collect();
                want.sort();
                let mut got = seen.clone();
                got.sort();
                proptest::prop_assert_eq!(&got, &want, "no repeat, no gap");
            }
        }
    }

    #[test]
    fn changes_become_images_grouped_by_transaction() {
        let inst = |t: &str| Instance {
            schema: "dbo".into(),
            table: t.into(),
            name: format!("dbo_{t}"),
            columns: vec!["id".into(), "customer_id".into()],
            create_lsn: None,
        };
        let instances = vec![inst("customer"), inst("address")];
        let ch = |l: u64, seq: u64, op, before: Option<i64>, after: Option<i64>| CdcChange {
            start_lsn: lsn(l),
            seqval: lsn(seq),
            op,
            before: before.map(|v| vec![SqlValue::Int(v), SqlValue::Int(1)]),
            after: after.map(|v| vec![SqlValue::Int(v), SqlValue::Null]),
        };
        let merged = vec![
            (0, ch(10, 1, CdcOp::Insert, None, Some(1))),
            (1, ch(10, 2, CdcOp::Update, Some(7), Some(7))),
            (1, ch(11, 1, CdcOp::Delete, Some(8), None)),
        ];
        let txs = transactions(&instances, &merged);
        assert_eq!(txs.len(), 2);
        assert_eq!(txs[0].0, lsn(10));
        assert_eq!(txs[0].1.len(), 2);
        let upd = &txs[0].1[1];
        assert_eq!(upd.table, ("dbo".to_string(), "address".to_string()));
        assert_eq!(upd.op, Op::Update);
        let old = upd.old.as_ref().unwrap();
        assert_eq!(old["customer_id"].as_deref(), Some("1"));
        // NULL stays NULL (it joins to no parent).
        assert_eq!(upd.new.as_ref().unwrap()["customer_id"], None);
        assert_eq!(txs[1].1[0].op, Op::Delete);
        assert!(txs[1].1[0].new.is_none());
    }

    /// What `part_sql` returns from one recorded capture instance: its
    /// first `top` rows at `at` after `__$seqval` `after`, by seqval then
    /// operation.
    fn part_query(
        rows: &[CdcRow],
        at: SqlServerLsn,
        after: SqlServerLsn,
        top: usize,
    ) -> Vec<CdcRow> {
        let mut out: Vec<CdcRow> = rows
            .iter()
            .filter(|r| r.start_lsn == at && r.seqval > after)
            .cloned()
            .collect();
        out.sort_by_key(|r| (r.seqval, r.operation));
        out.truncate(top);
        out
    }

    /// One part as `read_part` reads it, from recorded instances.
    fn read_part(instances: &[Vec<CdcRow>], p: &PartCursor, n: usize) -> Part {
        let mut kept = vec![];
        for (ii, rows) in instances.iter().enumerate() {
            let got = part_query(rows, p.lsn, p.after.unwrap_or(SqlServerLsn::ZERO), n + 1);
            merge_part_rows(&mut kept, ii, got, n + 1);
        }
        cut_part(kept, n).unwrap()
    }

    /// Every part of the transaction at `at` from `from`, with the
    /// cursor after each; `resume` passes each cursor through the marker
    /// (JSON, as stored) and back, as a restart would.
    fn all_parts(
        instances: &[Vec<CdcRow>],
        from: PartCursor,
        n: usize,
        resume: bool,
    ) -> Vec<(Part, PartCursor)> {
        let mut p = from;
        let mut out = vec![];
        loop {
            let part = read_part(instances, &p, n);
            let next = p.after_part(
                part.changes.last().map(|(_, c)| c.seqval),
                part.changes.len(),
                part.changes.len() as u32,
            );
            let last = part.last;
            out.push((part, next));
            if last {
                return out;
            }
            p = if resume {
                let json = serde_json::to_string(&next.in_flight()).unwrap();
                let f: InFlight = serde_json::from_str(&json).unwrap();
                PartCursor::resume(lsn(1).into(), &f).unwrap()
            } else {
                next
            };
            assert!(out.len() < 1000, "no progress");
        }
    }

    /// The whole transaction as `read_changes` merges it.
    fn whole(instances: &[Vec<CdcRow>]) -> Vec<(usize, CdcChange)> {
        let all = instances
            .iter()
            .enumerate()
            .flat_map(|(ii, rows)| {
                let mut rows = rows.clone();
                rows.sort_by_key(|r| (r.start_lsn, r.seqval, r.operation));
                pair(rows).unwrap().into_iter().map(move |c| (ii, c))
            })
            .collect();
        merge_changes(all)
    }

    /// A recorded transaction at LSN 5 over two capture instances
    /// (customer, address): inserts, updates (two rows at one seqval) and
    /// deletes interleaved by seqval, with a row at LSN 6 that is not
    /// its. 11 changes, 14 rows.
    fn recorded() -> Vec<Vec<CdcRow>> {
        vec![
            vec![
                row(5, 1, 2, 1),
                row(5, 2, 3, 1),
                row(5, 2, 4, 1),
                row(5, 5, 2, 2),
                row(5, 6, 3, 2),
                row(5, 6, 4, 2),
                row(5, 9, 1, 1),
                row(6, 1, 2, 7),
            ],
            vec![
                row(5, 3, 2, 10),
                row(5, 4, 3, 10),
                row(5, 4, 4, 10),
                row(5, 7, 2, 11),
                row(5, 8, 2, 12),
                row(5, 10, 1, 10),
                row(5, 11, 1, 11),
            ],
        ]
    }

    #[test]
    fn a_transaction_larger_than_the_cap_is_found_by_its_first_lsns() {
        let l = |v: &[u64]| v.iter().map(|n| lsn(*n)).collect::<Vec<_>>();
        assert_eq!(large_transaction(&l(&[4, 4, 4, 4]), 3), Some(lsn(4)));
        // Exactly the cap, or a second transaction inside it: whole.
        assert_eq!(large_transaction(&l(&[4, 4, 4]), 3), None);
        assert_eq!(large_transaction(&l(&[4, 4, 4, 5]), 3), None);
        assert_eq!(large_transaction(&l(&[3, 4, 4, 4]), 3), None);
        assert_eq!(large_transaction(&[], 3), None);
        // An update alone is two rows: a cap of 1 pages it, in parts of 2.
        assert_eq!(large_transaction(&l(&[4, 4]), 1), Some(lsn(4)));
        assert_eq!(part_rows(1), 2);
        // The window the reader already computes ends at that LSN.
        assert_eq!(
            next_window(lsn(1), lsn(9), &l(&[4, 4, 4, 4]), 3),
            Some(lsn(4))
        );
    }

    #[test]
    fn parts_page_the_transaction_in_order_and_keep_updates_whole() {
        let instances = recorded();
        let want = whole(&instances)
            .into_iter()
            .filter(|(_, c)| c.start_lsn == lsn(5))
            .collect::<Vec<_>>();
        assert_eq!(want.len(), 11);
        for n in 2..=15 {
            for resume in [false, true] {
                let parts = all_parts(&instances, PartCursor::first(lsn(1), lsn(5)), n, resume);
                let got: Vec<(usize, CdcChange)> =
                    parts.iter().flat_map(|(p, _)| p.changes.clone()).collect();
                assert_eq!(
                    got, want,
                    "n = {n}, resume = {resume}: no gap, no repeat, same order"
                );
                for (p, _) in &parts {
                    let rows: usize = p
                        .changes
                        .iter()
                        .map(|(_, c)| if c.op == CdcOp::Update { 2 } else { 1 })
                        .sum();
                    assert!(rows <= n && rows > 0, "n = {n}: a part of {rows} rows");
                }
                let (last, end) = parts.last().unwrap();
                assert!(last.last && parts[..parts.len() - 1].iter().all(|(p, _)| !p.last));
                assert_eq!(end.changes, 11);
                assert_eq!(end.tracked, 11);
            }
        }
        // 14 rows in parts of 4: an update never straddles two parts, so
        // parts end early where one would.
        let parts = all_parts(&instances, PartCursor::first(lsn(1), lsn(5)), 4, false);
        let sizes: Vec<usize> = parts.iter().map(|(p, _)| p.changes.len()).collect();
        // seqval 1 (i), 2 (u), 3 (i) | 4 (u), 5 (i) — 6's update would
        // straddle — | 6 (u), 7, 8 | 9, 10, 11.
        assert_eq!(sizes, [3, 2, 3, 3]);
        let cursors: Vec<Option<SqlServerLsn>> = parts.iter().map(|(_, c)| c.after).collect();
        assert_eq!(
            cursors,
            [Some(lsn(3)), Some(lsn(5)), Some(lsn(8)), Some(lsn(11))]
        );
    }

    /// `cdc.ddl_history` (and the catalog, when it holds DDL) is read once
    /// for a transaction handed over in parts, and once more per restart
    /// in it, not once per part: the window `(lower, lsn]` is the same for
    /// all of them. Counted as `next_batch` reads it: the window's sizing
    /// before the first part, then the part branch when the cursor has not
    /// followed the window's DDL.
    #[test]
    fn ddl_history_is_read_once_per_transaction_and_once_per_restart() {
        let instances = recorded();
        for n in [2, 3, 4] {
            for restarts in [vec![], vec![1], vec![1, 2]] {
                let mut ddl_reads = 1;
                let mut p = PartCursor::first(lsn(1), lsn(5));
                let mut parts = 0;
                loop {
                    if !p.ddl_followed {
                        ddl_reads += 1;
                    }
                    let part = read_part(&instances, &p, n);
                    parts += 1;
                    let next = p.after_part(
                        part.changes.last().map(|(_, c)| c.seqval),
                        part.changes.len(),
                        part.changes.len() as u32,
                    );
                    if part.last {
                        break;
                    }
                    p = if restarts.contains(&parts) {
                        PartCursor::resume(lsn(1).into(), &next.in_flight()).unwrap()
                    } else {
                        next
                    };
                }
                assert!(parts >= 4, "n = {n}: {parts} parts");
                assert_eq!(
                    ddl_reads,
                    1 + restarts.len(),
                    "n = {n}: {parts} parts, restarts after parts {restarts:?}"
                );
            }
        }
    }

    #[test]
    fn the_rows_of_one_seqval_stay_together_across_instances() {
        // Two instances with a row at one seqval each (never seen on a real
        // server, where a log record belongs to one table): the cursor is
        // the seqval, so a part takes both or neither.
        let instances = vec![
            vec![row(5, 1, 2, 1), row(5, 2, 2, 2)],
            vec![row(5, 2, 2, 10), row(5, 3, 2, 11)],
        ];
        let parts = all_parts(&instances, PartCursor::first(lsn(1), lsn(5)), 2, true);
        let sizes: Vec<usize> = parts.iter().map(|(p, _)| p.changes.len()).collect();
        assert_eq!(sizes, [1, 2, 1]);
        assert_eq!(parts[1].0.changes[0].0, 0, "instance order on a tie");
        // More rows at one seqval than a part holds is an error, not a split.
        let big = vec![
            vec![row(5, 1, 2, 1)],
            vec![row(5, 1, 2, 2)],
            vec![row(5, 1, 2, 3)],
        ];
        let mut kept = vec![];
        for (ii, rows) in big.into_iter().enumerate() {
            merge_part_rows(&mut kept, ii, rows, 3);
        }
        assert!(matches!(
            cut_part(kept, 2),
            Err(CdcError::OversizedChange { rows: 2, .. })
        ));
    }

    #[test]
    fn a_marker_in_flight_resumes_only_what_this_source_wrote() {
        let p = PartCursor {
            lower: lsn(1),
            lsn: lsn(5),
            after: Some(lsn(8)),
            changes: 7,
            tracked: 6,
            ddl_followed: false,
        };
        let f = p.in_flight();
        assert_eq!((f.commit, f.end), (lsn(5).into(), lsn(5).into()));
        assert_eq!(PartCursor::resume(lsn(1).into(), &f), Ok(p));
        // PostgreSQL's: no seqval (and a PostgreSQL position).
        let pg = InFlight {
            commit: skein_common::PgLsn(20).into(),
            end: skein_common::PgLsn(30).into(),
            changes: 3,
            tracked: Some(3),
            seqval: None,
        };
        let e = PartCursor::resume(skein_common::PgLsn(10).into(), &pg).unwrap_err();
        assert!(e.contains("another kind of source"), "{e}");
        assert!(PartCursor::resume(lsn(1).into(), &InFlight { seqval: None, ..f }).is_err());
        // Not after the marker's position.
        assert!(PartCursor::resume(lsn(5).into(), &f).is_err());
    }

    /// What a restart asks recorded instances (name, rows) about the
    /// window of the transaction in flight `p`, as `check_resume` asks
    /// the server.
    fn at_resume(instances: &[(&str, Vec<CdcRow>)], p: &PartCursor) -> Vec<AtResume> {
        instances
            .iter()
            .map(|(name, rows)| AtResume {
                name: name.to_string(),
                first: rows
                    .iter()
                    .map(|r| r.start_lsn)
                    .filter(|l| *l > p.lower && *l <= p.lsn)
                    .min(),
                handed: rows
                    .iter()
                    .filter(|r| {
                        r.start_lsn == p.lsn && Some(r.seqval) <= p.after && r.operation != 4
                    })
                    .count() as u64,
            })
            .collect()
    }

    fn by_position(changes: impl IntoIterator<Item = CdcChange>) -> Vec<CdcChange> {
        let mut v: Vec<CdcChange> = changes.into_iter().collect();
        v.sort_by_key(|c| (c.start_lsn, c.seqval));
        v
    }

    /// A restart while a transaction is in flight, with the config changed
    /// meanwhile: the recorded transaction at 5 was handed over in part
    /// with the customer instance alone, and the restart reads the address
    /// instance too (a table added to an entity, its capture instance
    /// already there). Reading on after the stored `__$seqval` must hand
    /// over every change the instances read now hold after the marker,
    /// exactly once; where it would not, the restart stops and says what
    /// and how to go on. It never stops when the config is unchanged.
    #[test]
    fn a_restart_in_flight_reads_on_only_when_nothing_would_be_skipped() {
        let rows = recorded();
        let customer = ("dbo_customer", rows[0].clone());
        let address = ("dbo_address", rows[1].clone());
        // The address instance with a transaction at 3, between the
        // marker (1) and the transaction in flight.
        let mut earlier = address.clone();
        earlier.1.insert(0, row(3, 1, 2, 20));
        let configs = [
            ("unchanged", vec![customer.clone()], false),
            ("address added", vec![customer.clone(), address], true),
            (
                "address added, with a change before",
                vec![customer, earlier],
                true,
            ),
        ];
        let mut stops = vec![0; configs.len()];
        for n in 2..=6 {
            let old = [rows[0].clone()];
            let parts = all_parts(&old, PartCursor::first(lsn(1), lsn(5)), n, false);
            // A restart after part k, each one that is not the last.
            for k in 0..parts.len() - 1 {
                let handed = parts[..=k]
                    .iter()
                    .flat_map(|(p, _)| p.changes.iter().map(|(_, c)| c.clone()));
                let at = PartCursor::resume(lsn(1).into(), &parts[k].1.in_flight()).unwrap();
                for (ci, (what, now, changed)) in configs.iter().enumerate() {
                    let case = format!("{what}, parts of {n}, restart after part {k}");
                    match check_in_flight(&at, &at_resume(now, &at)) {
                        Err(e) => {
                            let e = e.to_string();
                            assert!(changed, "{case}: stopped: {e}");
                            assert!(
                                e.contains("dbo_address")
                                    && e.contains("0x00000000000000000005")
                                    && e.contains("skein marker reset --to 0x00000000000000000001"),
                                "{case}: {e}"
                            );
                            stops[ci] += 1;
                        }
                        Ok(()) => {
                            let now: Vec<Vec<CdcRow>> =
                                now.iter().map(|(_, r)| r.clone()).collect();
                            let rest = all_parts(&now, at, n, false);
                            let got =
                                by_position(handed.clone().chain(
                                    rest.iter().flat_map(|(p, _)| {
                                        p.changes.iter().map(|(_, c)| c.clone())
                                    }),
                                ));
                            let want = by_position(
                                whole(&now)
                                    .into_iter()
                                    .map(|(_, c)| c)
                                    .filter(|c| c.start_lsn > lsn(1) && c.start_lsn <= lsn(5)),
                            );
                            assert_eq!(got, want, "{case}: nothing skipped, nothing twice");
                        }
                    }
                }
            }
        }
        // The added instance stops some restarts (its rows at or below
        // the cursor), not all; a change before the transaction, all.
        assert_eq!(stops[0], 0);
        assert!(stops[1] > 0, "{stops:?}");
        assert!(stops[2] > stops[1], "{stops:?}");
    }

    /// A transaction in flight past what CDC holds now (a database
    /// restored from a backup older than it) would fail the change
    /// functions' argument check on every restart: it stops once, with
    /// the LSNs and the reset that goes on.
    #[test]
    fn a_transaction_in_flight_past_the_max_lsn_stops_with_the_reset() {
        let rows = recorded();
        let parts = all_parts(&rows, PartCursor::first(lsn(1), lsn(5)), 4, false);
        let at = PartCursor::resume(lsn(1).into(), &parts[0].1.in_flight()).unwrap();
        let max = rows.iter().flatten().map(|r| r.start_lsn).max().unwrap();
        assert!(in_flight_past_max(&at, max).is_ok());
        assert!(in_flight_past_max(&at, lsn(5)).is_ok());
        let e = in_flight_past_max(&at, lsn(4)).unwrap_err().to_string();
        assert!(
            e.contains("0x00000000000000000005")
                && e.contains("ends at 0x00000000000000000004")
                && e.contains("skein marker reset --to 0x00000000000000000001"),
            "{e}"
        );
        // The marker past that end too: the reset goes back to it.
        let behind = PartCursor {
            lower: lsn(3),
            ..at
        };
        let e = in_flight_past_max(&behind, lsn(2)).unwrap_err().to_string();
        assert!(
            e.contains("skein marker reset --to 0x00000000000000000002\n"),
            "{e}"
        );
    }

    /// Records of a transaction resolved in parts, each numbered on from
    /// the tracked changes before it, are the records of the transaction
    /// resolved whole: same positions, same order.
    #[test]
    fn records_of_parts_number_on_as_the_whole_transaction() {
        let plans = vec![crate::resolve::tests::plan()];
        let by_table = crate::resolve::table_index(&plans);
        let inst = |t: &str, cols: [&str; 2]| Instance {
            schema: "public".into(),
            table: t.into(),
            name: format!("dbo_{t}"),
            columns: cols.iter().map(|c| c.to_string()).collect(),
            create_lsn: None,
        };
        // Rows hold (value, NULL): an address with customer_id NULL joins
        // no root; give addresses their customer through the first column.
        let instances = vec![
            inst("customer", ["id", "name"]),
            inst("address", ["customer_id", "id"]),
        ];
        let meta = [TxMeta {
            position: lsn(5).into(),
            tx_id: 9,
            commit_time_micros: 1,
        }];
        let records = |txs: &[(SqlServerLsn, Vec<RawChange>)], before: u32| {
            BatchResolution::new_from(
                &plans,
                &by_table,
                1,
                txs.iter().map(|(_, c)| (c.as_slice(), before)),
            )
            .unwrap()
            .finish(&plans, &meta)
            .unwrap()
        };
        let rows = recorded();
        let want = records(&transactions(&instances, &whole(&rows)[..11]), 0);
        assert_eq!(want.len(), 11);
        for n in [2, 3, 4, 7] {
            let mut got = vec![];
            for (part, next) in all_parts(&rows, PartCursor::first(lsn(1), lsn(5)), n, true) {
                let txs = transactions(&instances, &part.changes);
                let tracked = count_tracked(&by_table, txs.iter().flat_map(|(_, c)| c));
                got.extend(records(&txs, next.tracked - tracked));
            }
            assert_eq!(got, want, "n = {n}");
        }
    }

    /// An explicit run reads root keys from the table itself
    /// (`skein_sql::sqlserver::explicit_keys_sql`) and turns them into text
    /// with `decode::root_key`: for the same stored values that is the key
    /// the change stream resolves from a CDC row, so the explicit event
    /// lands in the aggregate's partition and version row. Recorded TDS
    /// cells of the usual key types, one composite key.
    #[test]
    fn explicit_key_pages_give_the_stream_root_keys() {
        use std::borrow::Cow;
        use tiberius::numeric::Numeric;
        use tiberius::time::{Date, DateTime, DateTime2, Time};
        use tiberius::ColumnData;

        let key: [(&str, &str, ColumnData<'static>); 7] = [
            ("id", "int", ColumnData::I32(Some(42))),
            ("big", "bigint", ColumnData::I64(Some(-9_000_000_000))),
            (
                "code",
                "nvarchar(20)",
                ColumnData::String(Some(Cow::Borrowed("Zürich-7 ✓"))),
            ),
            (
                "tenant",
                "uniqueidentifier",
                ColumnData::Guid(Some(
                    tiberius::Uuid::parse_str("6f9619ff-8b86-d011-b42d-00c04fc964ff").unwrap(),
                )),
            ),
            // 2024-02-29T21:59:59.1234567: day 738,944 after 0001-01-01.
            (
                "at",
                "datetime2(7)",
                ColumnData::DateTime2(Some(DateTime2::new(
                    Date::new(738_944),
                    Time::new(791_991_234_567, 7),
                ))),
            ),
            // 2024-02-29T21:59:59 + 299/300 s: day 45,349 after 1900-01-01.
            (
                "legacy_at",
                "datetime",
                ColumnData::DateTime(Some(DateTime::new(
                    45_349,
                    (21 * 3600 + 59 * 60 + 59) * 300 + 299,
                ))),
            ),
            (
                "amount",
                "decimal(10,4)",
                ColumnData::Numeric(Some(Numeric::new_with_scale(123_400, 4))),
            ),
        ];
        let names: Vec<String> = key.iter().map(|(n, _, _)| n.to_string()).collect();
        let cells: Vec<SqlValue> = key
            .iter()
            .map(|(n, _, c)| skein_sql::sqlserver::decode::decode(n, c).unwrap())
            .collect();

        let cfg = skein_common::config::Config::from_yaml(
            "source: { kind: sqlserver, url: \"server=tcp:x,1433;database=y\" }\n\
             entities:\n  - { name: ticket, schema: dbo, table: ticket }\n",
            "t",
        )
        .unwrap();
        let mut cat = skein_sql::Catalog::default();
        cat.insert(skein_sql::catalog::TableInfo {
            schema: "dbo".into(),
            table: "ticket".into(),
            columns: key
                .iter()
                .map(|(n, ty, _)| skein_sql::catalog::ColumnInfo {
                    name: n.to_string(),
                    data_type: ty.to_string(),
                    type_name: ty.split('(').next().unwrap_or(ty).to_string(),
                    nullable: false,
                })
                .collect(),
            primary_key: names.clone(),
            replica_identity: 'd',
        });
        let plans = vec![EntityPlan::new("ticket", cfg.entities[0].nodes(), &cat)];
        let by_table = crate::resolve::table_index(&plans);
        let instances = vec![Instance {
            schema: "dbo".into(),
            table: "ticket".into(),
            name: "dbo_ticket".into(),
            columns: names,
            create_lsn: None,
        }];
        let change = CdcChange {
            start_lsn: lsn(5),
            seqval: lsn(1),
            op: CdcOp::Insert,
            before: None,
            after: Some(cells.clone()),
        };
        let txs = transactions(&instances, &[(0, change)]);
        let meta = [TxMeta {
            position: lsn(5).into(),
            tx_id: 1,
            commit_time_micros: 0,
        }];
        let records = BatchResolution::new(&plans, &by_table, 4, [txs[0].1.as_slice()])
            .unwrap()
            .finish(&plans, &meta)
            .unwrap();
        assert_eq!(records.len(), 1);
        let explicit = skein_sql::sqlserver::decode::root_key(&cells);
        assert_eq!(explicit, records[0].root_key);
        assert_eq!(
            explicit.0,
            [
                "42",
                "-9000000000",
                "Zürich-7 ✓",
                "6f9619ff-8b86-d011-b42d-00c04fc964ff",
                "2024-02-29T21:59:59.1234567",
                "2024-02-29T21:59:59.9966666",
                "12.3400",
            ]
            .map(|s| Some(s.to_string()))
        );
    }

    #[test]
    fn transaction_ids_take_the_low_eight_bytes() {
        assert_eq!(tx_id_of(&[0, 0, 0, 0, 0, 0, 0, 0, 0x01, 0x02]), 0x0102);
        assert_eq!(tx_id_of(&[0xFF, 0xFF, 0, 0, 0, 0, 0, 0, 0, 1]), 1);
        assert_eq!(tx_id_of(&[]), 0);
    }

    /// Fuzz properties (see [`skein_common::fuzz`]): no change rows, as
    /// the driver hands them over or as a broken capture could order
    /// them, make row decoding, pairing or grouping panic, hang or
    /// allocate out of proportion; pairing undoes what the change query's
    /// row order does to a change list.
    mod fuzz {
        use proptest::prelude::*;
        use proptest::sample::Index;
        use skein_common::fuzz::{check, config};

        use super::*;

        fn cell() -> impl Strategy<Value = SqlValue> {
            prop_oneof![
                Just(SqlValue::Null),
                (-2i64..8).prop_map(SqlValue::Int),
                any::<i64>().prop_map(SqlValue::Int),
                prop::collection::vec(any::<u8>(), 0..12).prop_map(SqlValue::Binary),
                any::<[u8; 10]>().prop_map(|b| SqlValue::Binary(b.to_vec())),
                "[a-z]{0,4}".prop_map(SqlValue::Text),
            ]
        }

        fn instance() -> Instance {
            Instance {
                schema: "dbo".into(),
                table: "t".into(),
                name: "dbo_t".into(),
                columns: vec!["id".into(), "parent_id".into()],
                create_lsn: None,
            }
        }

        /// Decodes rows, pairs and groups them as a batch read does.
        fn run(rows: Vec<Vec<SqlValue>>) {
            let size: usize = rows.iter().map(|r| 16 * (r.len() + 1)).sum();
            check("CDC rows", size, || {
                let Ok(rows) = rows
                    .into_iter()
                    .map(|r| cdc_row("dbo_t", r))
                    .collect::<Result<Vec<_>>>()
                else {
                    return;
                };
                if let Ok(changes) = pair(rows) {
                    let changes: Vec<_> = changes.into_iter().map(|c| (0, c)).collect();
                    let _ = transactions(&[instance()], &changes);
                }
            });
        }

        fn change() -> impl Strategy<Value = CdcChange> {
            let image = || prop::collection::vec(cell(), 0..3);
            (0u64..4, 0u64..4, 0..3, image(), image()).prop_map(|(l, q, op, b, a)| {
                let (op, before, after) = match op {
                    0 => (CdcOp::Insert, None, Some(a)),
                    1 => (CdcOp::Delete, Some(b), None),
                    _ => (CdcOp::Update, Some(b), Some(a)),
                };
                CdcChange {
                    start_lsn: lsn(l),
                    seqval: lsn(q),
                    op,
                    before,
                    after,
                }
            })
        }

        /// The rows the change query returns for `changes`.
        fn unpair(changes: &[CdcChange]) -> Vec<Vec<SqlValue>> {
            let row = |c: &CdcChange, op: i64, v: &Option<Vec<SqlValue>>| {
                let mut r = vec![
                    SqlValue::Binary(c.start_lsn.0.to_vec()),
                    SqlValue::Binary(c.seqval.0.to_vec()),
                    SqlValue::Int(op),
                ];
                r.extend(v.clone().unwrap_or_default());
                r
            };
            changes
                .iter()
                .flat_map(|c| match c.op {
                    CdcOp::Insert => vec![row(c, 2, &c.after)],
                    CdcOp::Delete => vec![row(c, 1, &c.before)],
                    CdcOp::Update => vec![row(c, 3, &c.before), row(c, 4, &c.after)],
                })
                .collect()
        }

        /// One edit of a valid row list: what a reordered, cut or corrupt
        /// result set looks like.
        #[derive(Clone, Debug)]
        enum Edit {
            Remove(Index),
            Duplicate(Index),
            Swap(Index),
            Cell(Index, Index, SqlValue),
            Truncate(Index, Index),
        }

        fn edit() -> impl Strategy<Value = Edit> {
            prop_oneof![
                any::<Index>().prop_map(Edit::Remove),
                any::<Index>().prop_map(Edit::Duplicate),
                any::<Index>().prop_map(Edit::Swap),
                (any::<Index>(), any::<Index>(), cell()).prop_map(|(r, c, v)| Edit::Cell(r, c, v)),
                (any::<Index>(), any::<Index>()).prop_map(|(r, n)| Edit::Truncate(r, n)),
            ]
        }

        fn apply(rows: &mut Vec<Vec<SqlValue>>, edits: &[Edit]) {
            for e in edits {
                let n = rows.len();
                if n == 0 {
                    return;
                }
                match e {
                    Edit::Remove(i) => {
                        rows.remove(i.index(n));
                    }
                    Edit::Duplicate(i) => {
                        let r = rows[i.index(n)].clone();
                        rows.insert(i.index(n), r);
                    }
                    Edit::Swap(i) => rows.swap(i.index(n), (i.index(n) + 1) % n),
                    Edit::Cell(r, c, v) => {
                        let row = &mut rows[r.index(n)];
                        if !row.is_empty() {
                            let c = c.index(row.len());
                            row[c] = v.clone();
                        }
                    }
                    Edit::Truncate(r, k) => {
                        let row = &mut rows[r.index(n)];
                        row.truncate(k.index(row.len() + 1));
                    }
                }
            }
        }

        fn sorted(mut c: Vec<CdcChange>) -> Vec<CdcChange> {
            c.sort_by_key(|c| (c.start_lsn, c.seqval));
            c.dedup_by_key(|c| (c.start_lsn, c.seqval));
            c
        }

        proptest! {
            #![proptest_config(config())]

            #[test]
            fn arbitrary_rows_are_paired_or_an_error(
                rows in prop::collection::vec(prop::collection::vec(cell(), 0..6), 0..8)
            ) {
                run(rows);
            }

            #[test]
            fn edited_change_lists_are_paired_or_an_error(
                changes in prop::collection::vec(change(), 0..6),
                edits in prop::collection::vec(edit(), 1..4),
            ) {
                let mut rows = unpair(&sorted(changes));
                apply(&mut rows, &edits);
                run(rows);
            }

            #[test]
            fn pairing_undoes_the_row_order(changes in prop::collection::vec(change(), 0..6)) {
                let changes = sorted(changes);
                let rows = unpair(&changes)
                    .into_iter()
                    .map(|r| cdc_row("dbo_t", r))
                    .collect::<Result<Vec<_>>>()
                    .unwrap();
                prop_assert_eq!(pair(rows).unwrap(), changes);
            }
        }

        #[test]
        fn row_errors_name_the_instance_and_the_column() {
            let e = cdc_row("dbo_t", vec![SqlValue::Null])
                .unwrap_err()
                .to_string();
            assert!(e.contains("dbo_t") && e.contains("1 columns"), "{e}");
            let e = cdc_row(
                "dbo_t",
                vec![
                    SqlValue::Binary(vec![1, 2]),
                    SqlValue::Null,
                    SqlValue::Int(2),
                ],
            )
            .unwrap_err()
            .to_string();
            assert!(e.contains("dbo_t: __$start_lsn"), "{e}");
            let e = cdc_row(
                "dbo_t",
                vec![SqlValue::Null, SqlValue::Null, SqlValue::Int(1 << 40)],
            )
            .unwrap_err()
            .to_string();
            assert!(e.contains("dbo_t: __$operation 1099511627776"), "{e}");
        }
    }
}
