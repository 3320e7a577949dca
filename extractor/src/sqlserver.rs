//! SQL Server CDC, the parts that are pure logic: pairing the rows of
//! `cdc.fn_cdc_get_all_changes_*` into changes, the LSN window of a batch
//! and the validity-interval (data loss) check. The reader that runs the
//! queries of `skein_sql::sqlserver` over TDS is not built yet.

use skein_common::position::SqlServerLsn;
use skein_common::sqlvalue::SqlValue;

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

/// Checks every capture instance's validity interval against the marker.
/// Conservative: a minimum past the marker's successor may have dropped
/// changes, so it is a loss.
pub fn check_validity(
    marker: SqlServerLsn,
    min_lsns: &[(String, SqlServerLsn)],
) -> Result<(), DataLoss> {
    match min_lsns.iter().find(|(_, min)| *min > marker.increment()) {
        Some((ci, min)) => Err(DataLoss {
            marker,
            min_lsn: *min,
            capture_instance: ci.clone(),
        }),
        None => Ok(()),
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn lsn(n: u64) -> SqlServerLsn {
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
            check_validity(marker, &[("dbo_t".into(), src.min)]).unwrap();
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
        assert!(check_validity(marker, &[("dbo_t".into(), src.min)]).is_ok());
        // Cleanup past it: changes may be gone.
        src.changes.extend([lsn(12), lsn(13)]);
        src.cleanup(lsn(13));
        let e = check_validity(marker, &[("dbo_t".into(), src.min)]).unwrap_err();
        assert_eq!(e.min_lsn, lsn(13));
        assert!(e.to_string().contains("continue_with_data_loss"), "{e}");
    }
}
