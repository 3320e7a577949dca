//! Which aggregates a batch need not read again: a partition owner's
//! memory of the snapshot it last decided each aggregate in.
//!
//! An applier reads an aggregate's state *now*, not as of the change that
//! brought it. In a backlog, the snapshot of batch n already sees changes
//! that reach the applier in batches n+1, n+2, …: reading those aggregates
//! again finds the state already published (same etag, no event) and costs
//! a hydration for nothing. That was most of the applier's time on a
//! backlog (bench/README).
//!
//! The rule: an aggregate decided in snapshot S (its event written, or
//! found unchanged, in a committed batch) is **covered** by S for a later
//! batch when every record of it in that batch comes from a source
//! transaction S sees. Its published state then already holds each of
//! those changes, and every change S does not see brings a record of its
//! own later (the extractor resolves every captured change to its roots),
//! which is not covered and reads the aggregate again. So skipping a
//! covered aggregate publishes the same last state as reading it; it may
//! only leave out an intermediate state that was never read.
//!
//! Not covered, whatever the records:
//! * an aggregate whose root was gone with no delete in its batch (the
//!   delete is on its way and must still publish: [`coverable`]);
//! * anything after the catalog changed, a TRUNCATE, a fence or a change
//!   of owner: the caller [clears](Coverage::clear) the memory;
//! * a snapshot older than [`MAX_AGE`]: record ids are the stream's
//!   32-bit ids, compared modulo 2^32, which is exact only while the ids
//!   compared are within 2^31 of each other;
//! * SQL Server (no snapshot spans a batch's reads there): nothing is ever
//!   remembered.
//!
//! Memory is bounded: past [`MAX_KEYS`] aggregates the memory starts over.

use std::sync::Arc;
use std::time::{Duration, Instant};

use skein_common::{ChangeRecord, RootKey};

use crate::decide::{Consolidated, Current};
use crate::FastMap;

/// A snapshot is trusted this long after it was taken.
pub const MAX_AGE: Duration = Duration::from_secs(600);

/// Aggregates remembered per partition at most.
pub const MAX_KEYS: usize = 50_000;

/// A PostgreSQL snapshot (`pg_current_snapshot()`), on 32-bit ids.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Snapshot {
    xmin: u32,
    xmax: u32,
    /// In progress when it was taken, sorted.
    xip: Vec<u32>,
    taken: Instant,
}

/// `a` comes before `b`, modulo 2^32 (PostgreSQL's `TransactionIdPrecedes`
/// for normal ids).
fn precedes(a: u32, b: u32) -> bool {
    (a.wrapping_sub(b) as i32) < 0
}

impl Snapshot {
    /// Parses `pg_snapshot` text, `xmin:xmax:xip,xip,…` (64-bit ids).
    pub fn parse(text: &str, taken: Instant) -> Option<Snapshot> {
        let mut parts = text.trim().split(':');
        let xmin: u64 = parts.next()?.parse().ok()?;
        let xmax: u64 = parts.next()?.parse().ok()?;
        let xip = parts.next()?;
        if parts.next().is_some() {
            return None;
        }
        let mut xip: Vec<u32> = if xip.is_empty() {
            vec![]
        } else {
            xip.split(',')
                .map(|x| x.parse::<u64>().ok().map(|x| x as u32))
                .collect::<Option<_>>()?
        };
        xip.sort_unstable();
        Some(Snapshot {
            xmin: xmin as u32,
            xmax: xmax as u32,
            xip,
            taken,
        })
    }

    /// Whether the snapshot sees committed transaction `xid` (a stream id:
    /// its low 32 bits count). Ids 0-2 are not transactions: never seen.
    pub fn sees(&self, xid: u64) -> bool {
        let x = xid as u32;
        if x < 3 {
            return false;
        }
        if precedes(x, self.xmin) {
            return true;
        }
        if !precedes(x, self.xmax) {
            return false;
        }
        self.xip.binary_search(&x).is_err()
    }
}

/// Whether an aggregate decided as `current` in its batch is covered by
/// that batch's snapshot afterwards: not when its root was gone with no
/// delete in the batch (nothing was published; the delete is on its way).
pub fn coverable(c: &Consolidated, current: &Current) -> bool {
    !matches!(current, Current::Missing) || c.has_delete
}

/// The memory: per aggregate, the snapshot it was last decided in.
#[derive(Debug, Default)]
pub struct Coverage {
    /// Long-lived and keyed by the source's keys: std's SipHash.
    by_key: std::collections::HashMap<(String, RootKey), Arc<Snapshot>>,
}

impl Coverage {
    /// Forgets everything.
    pub fn clear(&mut self) {
        self.by_key.clear();
    }

    /// Aggregates remembered.
    pub fn len(&self) -> usize {
        self.by_key.len()
    }

    /// Whether nothing is remembered.
    pub fn is_empty(&self) -> bool {
        self.by_key.is_empty()
    }

    /// The aggregates of `records` that are covered, as of `now`: every
    /// one of their records comes from a transaction the snapshot they
    /// were last decided in sees.
    pub fn covered<'r>(
        &self,
        records: &'r [ChangeRecord],
        now: Instant,
    ) -> std::collections::HashSet<(&'r str, &'r RootKey)> {
        let mut state: FastMap<(&str, &RootKey), Option<&Snapshot>> = FastMap::default();
        if self.by_key.is_empty() {
            return Default::default();
        }
        for r in records {
            let k = (r.entity.as_str(), &r.root_key);
            let s = state.entry(k).or_insert_with(|| {
                self.by_key
                    .get(&(r.entity.clone(), r.root_key.clone()))
                    .map(|s| s.as_ref())
                    .filter(|s| now.saturating_duration_since(s.taken) < MAX_AGE)
            });
            if s.is_some_and(|s| !s.sees(r.tx_id)) {
                *s = None;
            }
        }
        state
            .into_iter()
            .filter_map(|(k, s)| s.map(|_| k))
            .collect()
    }

    /// Records what a committed batch decided in `snapshot`: each
    /// aggregate covered (`true`) is remembered with it, the others are
    /// forgotten.
    pub fn decided(
        &mut self,
        snapshot: &Arc<Snapshot>,
        aggregates: impl IntoIterator<Item = (String, RootKey, bool)>,
    ) {
        for (entity, key, covered) in aggregates {
            if covered {
                if self.by_key.len() >= MAX_KEYS {
                    self.by_key.clear();
                }
                self.by_key.insert((entity, key), snapshot.clone());
            } else {
                self.by_key.remove(&(entity, key));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use skein_common::record::Op;
    use skein_common::{ChangePosition, PgLsn};

    use super::*;

    fn snap(text: &str) -> Snapshot {
        Snapshot::parse(text, Instant::now()).unwrap()
    }

    fn rec(key: &str, xid: u64) -> ChangeRecord {
        ChangeRecord {
            entity: "customer".into(),
            root_key: RootKey(vec![Some(key.into())]),
            table: "customer".into(),
            op: Op::Update,
            position: ChangePosition {
                commit: PgLsn(xid).into(),
                seq: 0,
            },
            tx_id: xid,
            commit_time_micros: 0,
        }
    }

    fn key(k: &str) -> RootKey {
        RootKey(vec![Some(k.into())])
    }

    #[test]
    fn a_snapshot_sees_what_completed_before_it_and_nothing_in_progress() {
        let s = snap("100:110:102,105");
        assert!(s.sees(3));
        assert!(s.sees(99));
        assert!(s.sees(100));
        assert!(s.sees(101));
        assert!(!s.sees(102));
        assert!(s.sees(103));
        assert!(!s.sees(105));
        assert!(s.sees(109));
        assert!(!s.sees(110));
        assert!(!s.sees(111));
        assert!(!s.sees(0));
        assert!(!s.sees(2));
    }

    #[test]
    fn ids_compare_modulo_two_to_the_thirty_second_across_an_epoch() {
        let e1 = 1u64 << 32;
        // Epoch 1 began 5 ids ago; the stream's ids are 32-bit.
        let s = snap(&format!("{}:{}:", e1 + 5, e1 + 8));
        // 4294967290 is from the epoch before: long completed.
        assert!(s.sees(4_294_967_290));
        assert!(s.sees(4));
        assert!(!s.sees(8));
        assert!(!s.sees(9));
        // A 64-bit id keeps only its low 32 bits.
        assert!(s.sees(e1 + 6));
        assert!(!s.sees(e1 + 9));
    }

    #[test]
    fn bad_snapshot_text_is_none() {
        for t in ["", "1", "1:2", "1:2:x", "a:2:", "1:2:3:4"] {
            assert_eq!(Snapshot::parse(t, Instant::now()), None, "{t}");
        }
        assert!(Snapshot::parse("1:2:", Instant::now()).is_some());
    }

    #[test]
    fn an_aggregate_is_covered_only_when_every_record_of_it_is_seen() {
        let mut c = Coverage::default();
        let s = Arc::new(snap("100:110:105"));
        c.decided(
            &s,
            [
                ("customer".into(), key("1"), true),
                ("customer".into(), key("2"), true),
                ("customer".into(), key("3"), true),
            ],
        );
        let records = [
            rec("1", 101),
            rec("1", 104),
            rec("2", 103),
            rec("2", 105), // in progress at the snapshot
            rec("3", 111), // after it
            rec("4", 90),  // never decided
        ];
        let got = c.covered(&records, Instant::now());
        assert_eq!(got.len(), 1);
        assert!(got.contains(&("customer", &key("1"))));
    }

    #[test]
    fn an_aggregate_decided_not_covered_is_forgotten() {
        let mut c = Coverage::default();
        let s = Arc::new(snap("100:110:"));
        c.decided(&s, [("customer".into(), key("1"), true)]);
        c.decided(&s, [("customer".into(), key("1"), false)]);
        assert!(c.covered(&[rec("1", 101)], Instant::now()).is_empty());
    }

    #[test]
    fn an_old_snapshot_covers_nothing() {
        let mut c = Coverage::default();
        let s = Arc::new(snap("100:110:"));
        c.decided(&s, [("customer".into(), key("1"), true)]);
        let later = Instant::now() + MAX_AGE;
        assert!(c.covered(&[rec("1", 101)], later).is_empty());
        assert_eq!(c.covered(&[rec("1", 101)], Instant::now()).len(), 1);
    }

    #[test]
    fn a_root_gone_without_its_delete_is_not_coverable() {
        let mut cons = crate::decide::consolidate(&[rec("1", 101)]).remove(0);
        assert!(!coverable(&cons, &Current::Missing));
        assert!(coverable(&cons, &Current::Excluded));
        cons.has_delete = true;
        assert!(coverable(&cons, &Current::Missing));
    }

    #[test]
    fn memory_is_bounded() {
        let mut c = Coverage::default();
        let s = Arc::new(snap("100:110:"));
        c.decided(
            &s,
            (0..MAX_KEYS + 5).map(|i| ("customer".to_string(), key(&i.to_string()), true)),
        );
        assert!(c.len() <= MAX_KEYS);
        assert!(!c.is_empty());
    }
}
