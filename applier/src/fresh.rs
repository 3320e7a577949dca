//! Which delivered records are new: the already-applied filter, pure.
//!
//! A partition's committed progress is the exactly-once recovery marker.
//! Records arrive again after an extractor crashed between the transport's
//! acknowledgement and its marker write (the whole batch is re-sent), after
//! a rebalance or a replay; this decides, from the stored progress alone,
//! what of a delivery is applied and what is dropped.

use std::borrow::Cow;

use skein_common::{ChangePosition, ChangeRecord, Checkpoint, Op};
use skein_transporter::Delivery;

use crate::sidecar::Progress;
use crate::FastSet;

/// What to do with one delivery.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Fresh<'a> {
    /// The delivery ends at or before the committed progress: it was
    /// applied already. Nothing is written.
    Applied,
    /// Nothing new and nothing to record: nothing is written, and the
    /// delivery counts as committed.
    Nothing,
    /// Commit a batch: `records` (maybe none, when only the progress,
    /// a data-loss notice or dead letters must be recorded).
    Apply {
        /// The new records, in delivery order: the delivery's own when
        /// every one is new (the common case, no copy).
        records: Cow<'a, [ChangeRecord]>,
        /// How many delivered records were dropped as already applied or
        /// repeated.
        dropped: usize,
        /// The last source change applied in the partition after this batch.
        source_after: Option<ChangePosition>,
    },
}

/// Decides what of `d` is new given the partition's committed progress.
///
/// * A delivery whose `upper` is at or before the progress was applied
///   (in-process: when it has no record the rules below take as new).
/// * In-process ([`Checkpoint::Source`]) a record is new when its commit
///   position is after the progress (batches hold whole transactions) and
///   its change position after the last source change applied: a part of
///   a transaction too large for one batch does not move the progress
///   (its `upper` is its `lower`), only the last source change.
/// * Over Kafka ([`Checkpoint::Offset`]) offsets say nothing about source
///   order, so a record is new when its change position is after the last
///   source change applied ([`Progress::source`]): an extractor that
///   re-sent a batch produced it again at a later offset.
/// * Within the delivery, a record repeating an earlier one (same change
///   position, entity and root) is dropped: one source change resolves to at
///   most one record per aggregate.
/// * Over Kafka a delivery with no new record still commits when it moved
///   the offset (so the progress reaches the log end); in-process an empty
///   slice writes nothing.
pub fn fresh<'a>(d: &'a Delivery, committed: Option<&Progress>) -> Fresh<'a> {
    let floor = committed.map(|p| p.position);
    let by_offset = matches!(d.upper, Checkpoint::Offset(_));
    let upper = d.upper.numeric();
    // Over Kafka an offset at or before the progress was consumed. In-process
    // the records decide: a part of a large transaction has its lower
    // bound as upper, and may come from a source restarted behind the
    // progress (a lost state directory) with records past it.
    if by_offset && floor.is_some_and(|f| upper <= f) {
        return Fresh::Applied;
    }
    let applied_source = committed.and_then(|p| p.source);
    // Repeats are found by hash, in a set this delivery builds and drops.
    let mut seen = FastSet::with_capacity_and_hasher(d.records.len(), Default::default());
    let keep: Vec<bool> = d
        .records
        .iter()
        .map(|r| {
            // A truncate notice whose re-check is under way (it stands
            // at the notice, with a cursor) is taken again, to resume.
            let resumed = r.op == Op::Truncate
                && committed
                    .is_some_and(|p| p.recheck_after.is_some() && p.source == Some(r.position));
            let after_source = resumed || applied_source.is_none_or(|s| r.position > s);
            let new = if by_offset {
                after_source
            } else {
                after_source && floor.is_none_or(|f| r.position.commit.numeric() > f)
            };
            new && seen.insert((r.position, &r.entity, &r.root_key))
        })
        .collect();
    let records: Cow<[ChangeRecord]> = match keep.iter().all(|k| *k) {
        true => Cow::Borrowed(&d.records),
        false => Cow::Owned(
            d.records
                .iter()
                .zip(&keep)
                .filter(|(_, k)| **k)
                .map(|(r, _)| r.clone())
                .collect(),
        ),
    };
    if !by_offset && floor.is_some_and(|f| upper <= f) && records.is_empty() {
        // Sent again (an extractor that crashed before its marker): its
        // data-loss notice and dead letters were recorded with it.
        return Fresh::Applied;
    }
    let dropped = d.records.len() - records.len();
    if records.is_empty()
        && !d.has_data_loss
        && d.dead_letters == 0
        && (!by_offset || d.records.is_empty())
    {
        return Fresh::Nothing;
    }
    let source_after = records.iter().map(|r| r.position).max().max(applied_source);
    Fresh::Apply {
        records,
        dropped,
        source_after,
    }
}

#[cfg(test)]
mod tests {
    use skein_common::{Op, PgLsn, RootKey, SourcePosition};

    use super::*;

    fn pos(commit: u64, seq: u64) -> ChangePosition {
        ChangePosition {
            commit: PgLsn(commit).into(),
            seq,
        }
    }

    fn rec(key: &str, commit: u64, seq: u64) -> ChangeRecord {
        ChangeRecord {
            entity: "customer".into(),
            root_key: RootKey(vec![Some(key.into())]),
            table: "public.customer".into(),
            op: Op::Update,
            position: pos(commit, seq),
            tx_id: commit,
            commit_time_micros: 0,
        }
    }

    fn src(lower: u64, upper: u64, records: Vec<ChangeRecord>) -> Delivery {
        let c = |v| Checkpoint::Source(SourcePosition::Pg(PgLsn(v)));
        Delivery {
            partition: 0,
            lower: c(lower),
            upper: c(upper),
            has_data_loss: false,
            records,
            dead_letters: 0,
        }
    }

    fn off(first: i64, next: i64, records: Vec<ChangeRecord>) -> Delivery {
        Delivery {
            partition: 0,
            lower: Checkpoint::Offset(first),
            upper: Checkpoint::Offset(next),
            has_data_loss: false,
            records,
            dead_letters: 0,
        }
    }

    fn progress(position: i128, source: Option<ChangePosition>) -> Progress {
        Progress {
            position,
            source,
            recheck_after: None,
            epoch: 0,
        }
    }

    fn keys(f: &Fresh) -> Vec<(u64, u64)> {
        match f {
            Fresh::Apply { records, .. } => records
                .iter()
                .map(|r| (r.position.commit.numeric() as u64, r.position.seq))
                .collect(),
            other => panic!("expected records, got {other:?}"),
        }
    }

    #[test]
    fn first_delivery_applies_everything() {
        let d = src(0, 20, vec![rec("1", 10, 0), rec("2", 20, 0)]);
        assert_eq!(keys(&fresh(&d, None)), vec![(10, 0), (20, 0)]);
        let d = off(0, 2, vec![rec("1", 10, 0), rec("2", 20, 0)]);
        assert_eq!(keys(&fresh(&d, None)), vec![(10, 0), (20, 0)]);
    }

    #[test]
    fn in_process_a_resent_batch_is_applied_already() {
        let d = src(10, 20, vec![rec("1", 20, 0)]);
        assert_eq!(fresh(&d, Some(&progress(20, None))), Fresh::Applied);
        assert_eq!(fresh(&d, Some(&progress(30, None))), Fresh::Applied);
    }

    #[test]
    fn in_process_a_widened_resend_applies_only_what_is_after_the_progress() {
        // The extractor crashed after batch (10, 20] was applied, then read
        // (10, 40] at once: the records up to 20 are dropped by position.
        let d = src(
            10,
            40,
            vec![
                rec("1", 15, 0),
                rec("1", 20, 1),
                rec("2", 30, 0),
                rec("3", 40, 0),
            ],
        );
        let f = fresh(&d, Some(&progress(20, None)));
        assert_eq!(keys(&f), vec![(30, 0), (40, 0)]);
        assert!(
            matches!(f, Fresh::Apply { dropped: 2, source_after: Some(p), .. } if p == pos(40, 0))
        );
    }

    #[test]
    fn in_process_the_parts_of_a_large_transaction_apply_once_each() {
        // Transaction ending at 50 after the marker at 10, in three parts:
        // the first two complete nothing (upper == lower == 10).
        let part1 = src(10, 10, vec![rec("1", 50, 0), rec("2", 50, 1)]);
        let part2 = src(10, 10, vec![rec("3", 50, 2), rec("4", 50, 3)]);
        let last = src(10, 50, vec![rec("5", 50, 4)]);
        let before = progress(10, Some(pos(10, 7)));
        assert_eq!(keys(&fresh(&part1, Some(&before))), vec![(50, 0), (50, 1)]);
        let after1 = progress(10, Some(pos(50, 1)));
        // Part 1 sent again (an extractor crash before its marker): applied.
        assert_eq!(fresh(&part1, Some(&after1)), Fresh::Applied);
        assert_eq!(keys(&fresh(&part2, Some(&after1))), vec![(50, 2), (50, 3)]);
        let after2 = progress(10, Some(pos(50, 3)));
        assert_eq!(keys(&fresh(&last, Some(&after2))), vec![(50, 4)]);
        // The whole transaction sent again as one batch (a marker that lost
        // its part): only what no part applied.
        let whole = src(
            10,
            50,
            vec![rec("1", 50, 0), rec("3", 50, 2), rec("5", 50, 4)],
        );
        assert_eq!(keys(&fresh(&whole, Some(&after2))), vec![(50, 4)]);
        // After the last part, everything of it is applied.
        let done = progress(50, Some(pos(50, 4)));
        assert_eq!(fresh(&whole, Some(&done)), Fresh::Applied);
        assert_eq!(fresh(&part2, Some(&done)), Fresh::Applied);
    }

    #[test]
    fn a_truncate_notice_whose_recheck_is_under_way_is_taken_again() {
        let mut notice = rec("0", 50, 3);
        notice.op = Op::Truncate;
        let d = off(5, 8, vec![rec("1", 50, 2), notice.clone(), rec("2", 50, 4)]);
        let mut at = progress(5, Some(pos(50, 3)));
        // The notice applied: only what follows it.
        assert_eq!(keys(&fresh(&d, Some(&at))), vec![(50, 4)]);
        // Under way: the notice again, to resume, and what follows.
        at.recheck_after = Some("[\"7\"]".into());
        assert_eq!(keys(&fresh(&d, Some(&at))), vec![(50, 3), (50, 4)]);
        // Not another record at that position.
        let d = off(5, 8, vec![rec("1", 50, 3)]);
        assert!(
            matches!(fresh(&d, Some(&at)), Fresh::Apply { ref records, .. } if records.is_empty())
        );
    }

    #[test]
    fn in_process_a_resent_data_loss_notice_is_not_recorded_twice() {
        let mut d = src(10, 20, vec![]);
        d.has_data_loss = true;
        assert_eq!(fresh(&d, Some(&progress(20, None))), Fresh::Applied);
    }

    #[test]
    fn in_process_an_empty_slice_writes_nothing() {
        assert_eq!(fresh(&src(10, 20, vec![]), None), Fresh::Nothing);
        assert_eq!(
            fresh(&src(10, 20, vec![]), Some(&progress(10, None))),
            Fresh::Nothing
        );
    }

    #[test]
    fn a_data_loss_notice_is_recorded_even_without_records() {
        let mut d = src(10, 20, vec![]);
        d.has_data_loss = true;
        assert!(matches!(fresh(&d, None), Fresh::Apply { ref records, .. } if records.is_empty()));
    }

    #[test]
    fn over_kafka_records_resent_at_later_offsets_are_dropped_by_source_position() {
        // Offsets 0..3 applied up to source change (20, 1); the extractor
        // re-sent its batch at offsets 3..6.
        let applied = progress(3, Some(pos(20, 1)));
        let d = off(
            3,
            6,
            vec![rec("1", 20, 0), rec("1", 20, 1), rec("2", 30, 0)],
        );
        let f = fresh(&d, Some(&applied));
        assert_eq!(keys(&f), vec![(30, 0)]);
        assert!(matches!(f, Fresh::Apply { dropped: 2, .. }));
    }

    #[test]
    fn over_kafka_a_delivery_of_only_duplicates_still_moves_the_offset() {
        let applied = progress(3, Some(pos(20, 1)));
        let d = off(3, 5, vec![rec("1", 20, 0), rec("1", 20, 1)]);
        let f = fresh(&d, Some(&applied));
        assert!(
            matches!(f, Fresh::Apply { ref records, dropped: 2, source_after: Some(p) } if records.is_empty() && p == pos(20, 1)),
            "{f:?}"
        );
    }

    #[test]
    fn over_kafka_offsets_at_or_before_the_progress_were_applied() {
        let d = off(0, 3, vec![rec("1", 10, 0)]);
        assert_eq!(
            fresh(&d, Some(&progress(3, Some(pos(10, 0))))),
            Fresh::Applied
        );
    }

    #[test]
    fn over_kafka_dead_letters_alone_are_recorded() {
        let mut d = off(7, 8, vec![]);
        d.dead_letters = 1;
        assert!(matches!(fresh(&d, None), Fresh::Apply { ref records, .. } if records.is_empty()));
    }

    #[test]
    fn a_record_repeated_inside_one_delivery_is_applied_once() {
        // The original and the re-send in the same Kafka round.
        let d = off(
            0,
            4,
            vec![
                rec("1", 10, 0),
                rec("2", 10, 1),
                rec("1", 10, 0),
                rec("2", 10, 1),
            ],
        );
        let f = fresh(&d, None);
        assert_eq!(keys(&f), vec![(10, 0), (10, 1)]);
        // Same change position but another aggregate (a child moved between
        // roots) is not a repeat.
        let d = src(0, 10, vec![rec("1", 10, 0), rec("2", 10, 0)]);
        assert_eq!(keys(&fresh(&d, None)), vec![(10, 0), (10, 0)]);
    }

    /// `transport.partitions` changed after a crash that left a part
    /// applied in some partitions and not others: a part moves no progress
    /// position, so only the partitions' last source changes tell that
    /// they are past the marker; those must be forgotten, or a re-sent
    /// record that lands in one of them is dropped, though its old
    /// partition never applied it.
    #[test]
    fn in_process_a_rekeyed_resent_part_is_not_dropped_where_it_was_never_applied() {
        use crate::run::{rekey_in_process, TopicProgress};
        // Marker at 10, transaction ending at 50. Part 1 (seq 0..=1)
        // applied by both old partitions; part 2 (seq 2..=3) applied by old
        // partition 0 only (seq 3), then the crash, before the marker.
        let known = TopicProgress {
            recorded: Some(2),
            progress: vec![
                (0, progress(10, Some(pos(50, 3)))),
                (1, progress(10, Some(pos(50, 1)))),
            ],
        };
        let forgotten = rekey_in_process(&known, Some(10));
        assert_eq!(forgotten, vec![0, 1]);
        // Restart with 3 partitions: part 2 is sent again, and the record
        // at seq 2 (old partition 1, never applied) now falls in partition 0.
        let resent = src(10, 10, vec![rec("x", 50, 2)]);
        assert_eq!(keys(&fresh(&resent, None)), vec![(50, 2)]);
    }

    /// A part whose lower is before a partition's progress (the extractor
    /// restarted from the slot's confirmed position, behind the sidecar,
    /// after its state directory was lost) is judged by its records, which
    /// lie past both the progress and the last source change.
    #[test]
    fn in_process_a_part_below_the_progress_with_new_records_is_not_dropped() {
        let part = src(8, 8, vec![rec("5", 50, 4)]);
        let at = progress(10, Some(pos(10, 7)));
        assert_eq!(keys(&fresh(&part, Some(&at))), vec![(50, 4)]);
        // What it has that was applied is still dropped.
        let part = src(8, 8, vec![rec("4", 10, 7), rec("5", 50, 4)]);
        assert_eq!(keys(&fresh(&part, Some(&at))), vec![(50, 4)]);
        let old = src(8, 8, vec![rec("4", 10, 7)]);
        assert_eq!(fresh(&old, Some(&at)), Fresh::Applied);
    }
}
