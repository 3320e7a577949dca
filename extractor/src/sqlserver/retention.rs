//! CDC cleanup retention. SQL Server keeps nothing for skein: the cleanup
//! job (daily by default) removes every change committed longer ago than
//! its retention (`msdb.dbo.cdc_jobs`, minutes; 4320, three days, by
//! default), read or not. What skein has not read yet is safe only while
//! its oldest change is younger than that; the share of the retention that
//! age uses is the SQL Server side of PostgreSQL's slot retention
//! ([`crate::postgres::Retention`]), warned about at the same
//! `extractor.retention_warn_fraction`.
//!
//! Pure: the reader fetches the rows, [`CleanupRetention`] decides.

use skein_common::sqlvalue::SqlValue;

/// How old the oldest unread change is against the cleanup job's retention.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CleanupRetention {
    /// The cleanup job's retention (`None`: no cleanup job in this database,
    /// nothing removes changes).
    pub retention_minutes: Option<i64>,
    /// Seconds since the oldest change skein has not read committed
    /// (`None`: nothing unread).
    pub unread_age_seconds: Option<i64>,
}

impl CleanupRetention {
    /// From the rows of `CLEANUP_RETENTION_SQL` and `CHANGE_AGE_SQL` (the
    /// latter `None` when nothing is unread).
    pub fn from_rows(
        retention: &[Vec<SqlValue>],
        age: Option<&[Vec<SqlValue>]>,
    ) -> CleanupRetention {
        let first = |rows: &[Vec<SqlValue>]| match rows.first().and_then(|r| r.first()) {
            Some(SqlValue::Int(v)) => Some(*v),
            _ => None,
        };
        CleanupRetention {
            retention_minutes: first(retention),
            // An unread change whose time mapping is gone was cleaned up
            // already: as old as the retention allows, and more.
            unread_age_seconds: age.map(|rows| first(rows).unwrap_or(i64::MAX)),
        }
    }

    /// The share of the retention the oldest unread change's age uses:
    /// 0 with nothing unread, 1 when cleanup may remove it at its next run
    /// (above 1: it may already have; the next batch's validity check
    /// says). `None` without a cleanup job.
    pub fn used(&self) -> Option<f64> {
        let minutes = self.retention_minutes?;
        let Some(age) = self.unread_age_seconds else {
            return Some(0.0);
        };
        if minutes <= 0 {
            return Some(1.0);
        }
        // A commit time ahead of the server's clock (a clock set back) is new.
        Some(age.max(0) as f64 / (minutes as f64 * 60.0))
    }

    /// Whether [`used`](Self::used) reaches `fraction`.
    pub fn warns(&self, fraction: f64) -> bool {
        self.used().is_some_and(|u| u >= fraction)
    }
}

/// What the log says when the oldest unread change nears the cleanup
/// retention (`used` at or past the warning fraction).
pub fn retention_warning(r: &CleanupRetention, used: f64) -> String {
    let age = r.unread_age_seconds.unwrap_or(0);
    let minutes = r.retention_minutes.unwrap_or(0);
    format!(
        "the oldest change skein has not read committed {age} s ago: {:.1}% of the CDC cleanup \
         job's retention ({minutes} minutes). Past 100% the cleanup job removes it at its next \
         run and skein stops with a data-loss error; fix what holds skein back, or raise the \
         retention: EXEC sys.sp_cdc_change_job @job_type = N'cleanup', @retention = <minutes>;",
        used * 100.0
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(v: Option<i64>) -> Vec<Vec<SqlValue>> {
        v.map(|v| vec![vec![SqlValue::Int(v)]]).unwrap_or_default()
    }

    /// Rows as the server returns them: the default retention (4320
    /// minutes), a change 2.5 days old.
    #[test]
    fn the_share_of_the_retention_the_oldest_unread_change_uses() {
        let age = rows(Some(216_000));
        let r = CleanupRetention::from_rows(&rows(Some(4320)), Some(&age));
        assert_eq!(
            r,
            CleanupRetention {
                retention_minutes: Some(4320),
                unread_age_seconds: Some(216_000)
            }
        );
        let used = r.used().unwrap();
        assert!((used - 216_000.0 / 259_200.0).abs() < 1e-12, "{used}");
        assert!(r.warns(0.8) && !r.warns(0.9));
        let w = retention_warning(&r, used);
        assert!(
            w.contains("83.3%") && w.contains("4320 minutes") && w.contains("sp_cdc_change_job"),
            "{w}"
        );
    }

    #[test]
    fn nothing_unread_no_job_and_odd_rows() {
        // Caught up: nothing to lose.
        let r = CleanupRetention::from_rows(&rows(Some(4320)), None);
        assert_eq!(r.used(), Some(0.0));
        assert!(!r.warns(0.01));
        // No cleanup job: nothing removes changes, nothing to compare with.
        let age = rows(Some(10));
        let r = CleanupRetention::from_rows(&rows(None), Some(&age));
        assert_eq!((r.retention_minutes, r.used()), (None, None));
        // The unread change's time mapping is gone: cleaned up already.
        let r = CleanupRetention::from_rows(&rows(Some(60)), Some(&[]));
        assert!(r.used().unwrap() > 1.0);
        // A commit time ahead of the clock counts as new; retention 0 as used up.
        let age = rows(Some(-30));
        assert_eq!(
            CleanupRetention::from_rows(&rows(Some(60)), Some(&age)).used(),
            Some(0.0)
        );
        assert_eq!(
            CleanupRetention::from_rows(&rows(Some(0)), Some(&age)).used(),
            Some(1.0)
        );
        // Past the retention (cleanup has not run yet): above 1.
        let age = rows(Some(7200));
        assert_eq!(
            CleanupRetention::from_rows(&rows(Some(60)), Some(&age)).used(),
            Some(2.0)
        );
        // A NULL retention cell reads as no retention known.
        let r = CleanupRetention::from_rows(&[vec![SqlValue::Null]], None);
        assert_eq!(r.used(), None);
    }
}
