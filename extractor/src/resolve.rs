//! Root-key resolution from change images: pure decisions, no I/O.
//!
//! * root-table change → its key (before image for deletes); a key update is
//!   a delete of the old key plus an insert of the new one;
//! * direct child joined on the root key → the join columns of the before
//!   *and* after images (a child moved to another parent touches two roots);
//! * anything else (deeper children, joins to non-key columns) → a
//!   [`Lookup`] that the source answers with one batched query per table.

use std::collections::HashMap;

use skein_common::config::TableNode;
use skein_common::{ChangePosition, ChangeRecord, Op, RootKey, SourcePosition};
use skein_sql::postgres::direct_root_mapping;
use skein_sql::Catalog;

use crate::error::{Error, Result};

/// The tables of one entity, with what resolution needs precomputed.
#[derive(Clone, Debug)]
pub struct EntityPlan {
    /// Entity name.
    pub entity: String,
    /// The entity's nodes (root first).
    pub nodes: Vec<TableNode>,
    /// Root key columns.
    pub root_key: Vec<String>,
    /// Per node: how join columns map to the root key when they do directly.
    pub direct: Vec<Option<Vec<usize>>>,
}

impl EntityPlan {
    /// Builds the plan of one entity from the config tree and the catalog.
    pub fn new(entity: &str, nodes: Vec<TableNode>, catalog: &Catalog) -> EntityPlan {
        let root_key = catalog.key_columns(&nodes[0]);
        let direct = (0..nodes.len())
            .map(|i| {
                if i == 0 {
                    None
                } else {
                    direct_root_mapping(&nodes, i, catalog)
                }
            })
            .collect();
        EntityPlan {
            entity: entity.to_string(),
            nodes,
            root_key,
            direct,
        }
    }
}

/// What a change resolves to before any lookup.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Resolved {
    /// The root key(s) are known: `(op from the root's view, key)`.
    Roots(Vec<(Op, RootKey)>),
    /// The join values must be looked up through the parent chain.
    Lookup {
        /// Node index within the entity.
        node: usize,
        /// Distinct join-column value tuples (before and after images).
        values: Vec<Vec<Option<String>>>,
    },
}

/// A row image, whichever the dialect: column name → the value as text
/// (`None` = NULL), as the source's change stream gives it (pgoutput's text
/// format, or SQL Server CDC cells decoded to the same formats). Only key
/// and join columns are needed.
pub type RowImage = std::collections::HashMap<String, Option<String>, foldhash::fast::RandomState>;

fn take<'a>(
    img: &RowImage,
    cols: impl IntoIterator<Item = &'a str>,
    n: &TableNode,
) -> Result<Vec<Option<String>>> {
    cols.into_iter()
        .map(|c| {
            img.get(c).cloned().ok_or_else(|| {
                Error::Decode(format!(
                    "the change of {} does not carry column `{c}`: run `skein sql source` \
                     and apply what it prints (REPLICA IDENTITY and publication on PostgreSQL, \
                     the capture instance's column list on SQL Server)",
                    n.qualified()
                ))
            })
        })
        .collect()
}

/// Resolves one change of `node` in `plan`.
///
/// `old` is the before image (deletes, key-changing updates, FULL identity),
/// `new` the after image (inserts, updates).
pub fn resolve(
    plan: &EntityPlan,
    node: usize,
    op: Op,
    old: Option<&RowImage>,
    new: Option<&RowImage>,
) -> Result<Resolved> {
    let n = &plan.nodes[node];
    let root_key = || plan.root_key.iter().map(String::as_str);
    if node == 0 {
        let new_key = new.map(|i| take(i, root_key(), n)).transpose()?;
        // pgoutput sends the old key on update only when it changed.
        let old_key = old.map(|i| take(i, root_key(), n)).transpose()?;
        let mut out = vec![];
        match op {
            Op::Delete => {
                let k = old_key.or(new_key).ok_or_else(|| {
                    Error::Decode(format!(
                        "delete of {} without a before image",
                        n.qualified()
                    ))
                })?;
                out.push((Op::Delete, RootKey(k)));
            }
            Op::Insert => out.push((Op::Insert, RootKey(new_key.unwrap_or_default()))),
            Op::Truncate => {
                return Err(Error::Decode(format!(
                    "a TRUNCATE of {} names no rows: it is resolved per batch, not per row",
                    n.qualified()
                )))
            }
            Op::Update => {
                let nk = new_key.unwrap_or_default();
                match old_key {
                    Some(ok) if ok != nk => {
                        out.push((Op::Delete, RootKey(ok)));
                        out.push((Op::Insert, RootKey(nk)));
                    }
                    _ => out.push((Op::Update, RootKey(nk))),
                }
            }
        }
        return Ok(Resolved::Roots(out));
    }
    let mut tuples: Vec<Vec<Option<String>>> = vec![];
    for img in [old, new].into_iter().flatten() {
        let t = take(img, n.on.iter().map(|o| o.name.as_str()), n)?;
        // A NULL join column belongs to no parent.
        if t.iter().any(Option::is_none) || tuples.contains(&t) {
            continue;
        }
        tuples.push(t);
    }
    match &plan.direct[node] {
        Some(map) => Ok(Resolved::Roots(
            tuples
                .into_iter()
                .map(|t| {
                    (
                        Op::Update,
                        RootKey(map.iter().map(|i| t[*i].clone()).collect()),
                    )
                })
                .collect(),
        )),
        None if tuples.is_empty() => Ok(Resolved::Roots(vec![])),
        None => Ok(Resolved::Lookup {
            node,
            values: tuples,
        }),
    }
}

/// One captured row change inside a transaction, before resolution.
/// Serializable: a large transaction's changes wait on disk for their part.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct RawChange {
    /// `(schema, table)`.
    pub table: (String, String),
    /// Operation on the row itself.
    pub op: Op,
    /// Before image, when sent.
    pub old: Option<RowImage>,
    /// After image, when sent.
    pub new: Option<RowImage>,
}

/// What a change record says about its transaction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TxMeta {
    /// Commit position.
    pub position: SourcePosition,
    /// Source transaction id.
    pub tx_id: u64,
    /// Commit time, microseconds since the Unix epoch.
    pub commit_time_micros: i64,
}

/// Which (entity plan, node) pairs each tracked table feeds.
pub type TableIndex = HashMap<(String, String), Vec<(usize, usize)>>;

/// Whether a change counts in its transaction's record numbering: a change
/// of a table some entity reads.
pub fn is_tracked(by_table: &TableIndex, change: &RawChange) -> bool {
    by_table.contains_key(&change.table)
}

/// How many of `changes` are tracked ([`is_tracked`]), as the count a
/// part of a large transaction numbers on from (saturating).
pub fn count_tracked<'a>(
    by_table: &TableIndex,
    changes: impl IntoIterator<Item = &'a RawChange>,
) -> u32 {
    let n = changes
        .into_iter()
        .filter(|c| is_tracked(by_table, c))
        .count();
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// Builds the [`TableIndex`] of a set of plans.
pub fn table_index(plans: &[EntityPlan]) -> TableIndex {
    let mut by_table: TableIndex = HashMap::new();
    for (pi, p) in plans.iter().enumerate() {
        for n in p.nodes.iter().filter(|n| n.tracked()) {
            by_table
                .entry((n.schema.clone(), n.table.clone()))
                .or_default()
                .push((pi, n.index));
        }
    }
    by_table
}

/// Root keys the source must look up: one batched query per group.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LookupGroup {
    /// Entity plan.
    pub plan: usize,
    /// Node within the plan.
    pub node: usize,
    /// Join-column values, one tuple per lookup; an answer refers to a
    /// tuple by its 1-based position here.
    pub values: Vec<Vec<Option<String>>>,
    slots: Vec<usize>,
    /// The candidate number (within its change) of each tuple.
    cands: Vec<u32>,
}

/// One change being resolved: (transaction index, change index, table,
/// resolved (plan, op, key, candidate)s).
type Slot = (usize, u32, String, Vec<(usize, Op, RootKey, u32)>);

/// Bits of a record's `seq` that number the candidates of one change (the
/// root keys and lookup tuples its images give, in order).
const CANDIDATE_BITS: u32 = 12;
/// Bits of a record's `seq` that rank the roots one candidate resolved to
/// (more than one only through a join on non-unique columns).
const RANK_BITS: u32 = 12;

/// A record's `seq`: the change's index in its transaction, then the
/// candidate within the change, then the rank within the candidate. Taken
/// from the change images only, never from what a lookup answered, so a
/// batch read again after a crash numbers every record it had before the
/// same, whatever rows the lookups find now. Below 2^56: fits the sidecar's
/// `int8` and the change topic's `long`.
fn record_seq(change: u32, candidate: u32, rank: usize) -> Result<u64> {
    if candidate >= 1 << CANDIDATE_BITS || rank >= 1 << RANK_BITS {
        return Err(Error::Decode(format!(
            "change {change} of a transaction resolves to too many roots (candidate {candidate}, rank {rank}); \
             skein numbers at most {} candidates of {} roots each per change",
            1u32 << CANDIDATE_BITS,
            1u32 << RANK_BITS
        )));
    }
    Ok((u64::from(change) << (CANDIDATE_BITS + RANK_BITS))
        | (u64::from(candidate) << RANK_BITS)
        | rank as u64)
}

/// A batch being resolved: what the images gave, and what waits for a
/// lookup. Dialect-free: the source only runs the lookups.
#[derive(Debug, Default)]
pub struct BatchResolution {
    slots: Vec<Slot>,
    groups: Vec<LookupGroup>,
}

impl BatchResolution {
    /// Resolves what the images allow. `txs` are the batch's transactions
    /// in commit order, each its changes in order. A TRUNCATE
    /// ([`Op::Truncate`], no images) resolves to one truncate notice per
    /// entity of the table and partition (`partitions` of the transport):
    /// it names no rows, so every partition's applier re-checks what it
    /// published.
    pub fn new<'a>(
        plans: &[EntityPlan],
        by_table: &TableIndex,
        partitions: u32,
        txs: impl IntoIterator<Item = &'a [RawChange]>,
    ) -> Result<BatchResolution> {
        Self::new_from(plans, by_table, partitions, txs.into_iter().map(|t| (t, 0)))
    }

    /// [`BatchResolution::new`] where a transaction may be a later part of
    /// one too large for one batch: each comes with how many tracked
    /// changes ([`is_tracked`]) of it came before, so its records number
    /// on from the earlier parts'.
    pub fn new_from<'a>(
        plans: &[EntityPlan],
        by_table: &TableIndex,
        partitions: u32,
        txs: impl IntoIterator<Item = (&'a [RawChange], u32)>,
    ) -> Result<BatchResolution> {
        let mut out = BatchResolution::default();
        let mut group_of: HashMap<(usize, usize), usize> = HashMap::new();
        for (ti, (changes, before)) in txs.into_iter().enumerate() {
            // Counts the tracked changes of the transaction only.
            let mut seq = before;
            for ch in changes {
                let Some(targets) = by_table.get(&ch.table) else {
                    // Not tracked ([`is_tracked`]).
                    continue;
                };
                // Numbers every root key and lookup tuple of the change.
                let mut cand = 0u32;
                let table = format!("{}.{}", ch.table.0, ch.table.1);
                if ch.op == Op::Truncate {
                    // One notice per entity, however many of its nodes
                    // read the table (candidates are numbered, and bounded).
                    let mut entities: Vec<usize> = targets.iter().map(|(pi, _)| *pi).collect();
                    entities.sort_unstable();
                    entities.dedup();
                    let notices = entities
                        .iter()
                        .flat_map(|pi| {
                            (0..partitions).map(move |p| (*pi, RootKey(vec![Some(p.to_string())])))
                        })
                        .map(|(pi, key)| {
                            cand += 1;
                            (pi, Op::Truncate, key, cand - 1)
                        })
                        .collect();
                    out.slots.push((ti, seq, table, notices));
                    seq += 1;
                    continue;
                }
                // The last target takes the name; the others a copy.
                let names = std::iter::repeat_n(table, targets.len());
                for ((pi, node), table) in targets.iter().zip(names) {
                    let res = resolve(&plans[*pi], *node, ch.op, ch.old.as_ref(), ch.new.as_ref())?;
                    let slot = out.slots.len();
                    match res {
                        Resolved::Roots(keys) => out.slots.push((
                            ti,
                            seq,
                            table,
                            keys.into_iter()
                                .map(|(op, k)| {
                                    cand += 1;
                                    (*pi, op, k, cand - 1)
                                })
                                .collect(),
                        )),
                        Resolved::Lookup { node, values } => {
                            out.slots.push((ti, seq, table, vec![]));
                            let g = *group_of.entry((*pi, node)).or_insert_with(|| {
                                out.groups.push(LookupGroup {
                                    plan: *pi,
                                    node,
                                    values: vec![],
                                    slots: vec![],
                                    cands: vec![],
                                });
                                out.groups.len() - 1
                            });
                            for v in values {
                                out.groups[g].values.push(v);
                                out.groups[g].slots.push(slot);
                                out.groups[g].cands.push(cand);
                                cand += 1;
                            }
                        }
                    }
                }
                seq += 1;
            }
        }
        Ok(out)
    }

    /// The lookups to run (children whose root is not in their columns).
    pub fn lookups(&self) -> &[LookupGroup] {
        &self.groups
    }

    /// Records the answer of lookup group `group`: `(ordinal, root key)`
    /// rows, the ordinal 1-based into its `values`. Tuples without an
    /// answer (the parent is gone) resolve to nothing.
    pub fn answer(&mut self, group: usize, rows: Vec<(i64, RootKey)>) -> Result<()> {
        let g = &self.groups[group];
        let plan = g.plan;
        for (ord, key) in rows {
            let (slot, cand) = usize::try_from(ord - 1)
                .ok()
                .and_then(|i| g.slots.get(i).zip(g.cands.get(i)))
                .map(|(s, c)| (*s, *c))
                .ok_or_else(|| Error::Decode(format!("root lookup answered unknown row {ord}")))?;
            self.slots[slot].3.push((plan, Op::Update, key, cand));
        }
        Ok(())
    }

    /// The change records, in source order; a key with a NULL column or a
    /// repeat within one change is left out.
    ///
    /// Every record of a transaction gets its own `seq` ([`record_seq`]),
    /// increasing in output order: one change can touch several roots (a
    /// root key update is a delete and a create, a moved child touches two
    /// parents, a table can be in two entities), and an applier that drops
    /// what is at or before its last applied position must not take the
    /// second root's record for the first's.
    pub fn finish(self, plans: &[EntityPlan], txs: &[TxMeta]) -> Result<Vec<ChangeRecord>> {
        let mut out = vec![];
        // The records of one change, gathered from its slots, then numbered.
        let mut change: Vec<(u32, ChangeRecord)> = vec![];
        let mut current: Option<(usize, u32)> = None;
        for (ti, ci, table, keys) in self.slots {
            if current != Some((ti, ci)) {
                if let Some((_, prev)) = current {
                    flush_change(prev, &mut change, &mut out)?;
                }
                current = Some((ti, ci));
            }
            let tx = &txs[ti];
            let mut seen: Vec<(usize, Op, RootKey)> = vec![];
            for (pi, op, key, cand) in keys {
                if key.has_null()
                    || seen
                        .iter()
                        .any(|(p, o, k)| (*p, *o) == (pi, op) && *k == key)
                {
                    continue;
                }
                seen.push((pi, op, key.clone()));
                change.push((
                    cand,
                    ChangeRecord {
                        entity: plans[pi].entity.clone(),
                        root_key: key,
                        table: table.clone(),
                        op,
                        // Numbered by `flush_change`.
                        position: ChangePosition {
                            commit: tx.position,
                            seq: 0,
                        },
                        tx_id: tx.tx_id,
                        commit_time_micros: tx.commit_time_micros,
                    },
                ));
            }
        }
        if let Some((_, last)) = current {
            flush_change(last, &mut change, &mut out)?;
        }
        Ok(out)
    }
}

/// Numbers the records of change `ci` by candidate, then by root key within
/// a candidate, and appends them in that order.
fn flush_change(
    ci: u32,
    change: &mut Vec<(u32, ChangeRecord)>,
    out: &mut Vec<ChangeRecord>,
) -> Result<()> {
    change.sort_by(|(ca, a), (cb, b)| {
        ca.cmp(cb)
            .then_with(|| a.root_key.canonical().cmp(&b.root_key.canonical()))
            .then_with(|| a.entity.cmp(&b.entity))
    });
    let mut rank = 0usize;
    let mut last_cand = None;
    for (cand, mut r) in change.drain(..) {
        rank = if last_cand == Some(cand) { rank + 1 } else { 0 };
        last_cand = Some(cand);
        r.position.seq = record_seq(ci, cand, rank)?;
        out.push(r);
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use skein_common::Config;
    use skein_sql::{ColumnInfo, TableInfo};

    use super::*;

    /// customer ← address ← address_line (a lookup), on `public`; also
    /// for the sources' tests.
    pub(crate) fn plan() -> EntityPlan {
        let cfg = Config::from_yaml(
            r#"
source: { kind: postgres, url: "postgres://x/y" }
entities:
  - name: customer
    table: customer
    joins:
      - { name: addresses, table: address, on: [{ name: customer_id, to_column: id }] }
      - { name: lines, table: address_line, join_to: addresses, on: [{ name: address_id, to_column: id }] }
"#,
            "t",
        )
        .unwrap();
        let mut cat = Catalog::default();
        for (t, pk, cols) in [
            ("customer", vec!["id"], vec!["id", "name"]),
            ("address", vec!["id"], vec!["id", "customer_id"]),
            (
                "address_line",
                vec!["address_id", "line_no"],
                vec!["address_id", "line_no"],
            ),
        ] {
            cat.insert(TableInfo {
                schema: "public".into(),
                table: t.into(),
                columns: cols
                    .iter()
                    .map(|c| ColumnInfo {
                        name: c.to_string(),
                        data_type: "integer".into(),
                        type_name: "int4".into(),
                        nullable: true,
                    })
                    .collect(),
                primary_key: pk.iter().map(|s| s.to_string()).collect(),
                replica_identity: 'd',
            });
        }
        EntityPlan::new("customer", cfg.entities[0].nodes(), &cat)
    }

    fn img(pairs: &[(&str, Option<&str>)]) -> RowImage {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.map(str::to_string)))
            .collect()
    }

    fn key(s: &str) -> RootKey {
        RootKey(vec![Some(s.into())])
    }

    #[test]
    fn root_changes_resolve_to_their_key() {
        let p = plan();
        let new = img(&[("id", Some("1"))]);
        assert_eq!(
            resolve(&p, 0, Op::Update, None, Some(&new)).unwrap(),
            Resolved::Roots(vec![(Op::Update, key("1"))])
        );
        assert_eq!(
            resolve(&p, 0, Op::Delete, Some(&new), None).unwrap(),
            Resolved::Roots(vec![(Op::Delete, key("1"))])
        );
    }

    #[test]
    fn root_key_update_is_delete_plus_insert() {
        let p = plan();
        let old = img(&[("id", Some("1"))]);
        let new = img(&[("id", Some("2"))]);
        assert_eq!(
            resolve(&p, 0, Op::Update, Some(&old), Some(&new)).unwrap(),
            Resolved::Roots(vec![(Op::Delete, key("1")), (Op::Insert, key("2"))])
        );
    }

    #[test]
    fn moved_child_touches_both_roots_and_null_join_touches_none() {
        let p = plan();
        let old = img(&[("id", Some("9")), ("customer_id", Some("1"))]);
        let new = img(&[("id", Some("9")), ("customer_id", Some("2"))]);
        assert_eq!(
            resolve(&p, 1, Op::Update, Some(&old), Some(&new)).unwrap(),
            Resolved::Roots(vec![(Op::Update, key("1")), (Op::Update, key("2"))])
        );
        let orphan = img(&[("id", Some("9")), ("customer_id", None)]);
        assert_eq!(
            resolve(&p, 1, Op::Insert, None, Some(&orphan)).unwrap(),
            Resolved::Roots(vec![])
        );
    }

    /// A TRUNCATE resolves, in its place, to one notice per partition, each
    /// routed to the partition it names and numbered after the change
    /// before it.
    #[test]
    fn a_truncate_is_a_notice_to_every_partition_in_its_place() {
        let p = vec![plan()];
        let idx = table_index(&p);
        let t = |n: &str| ("public".to_string(), n.to_string());
        let change = |table: &str, op: Op, id: Option<&str>| RawChange {
            table: t(table),
            op,
            old: None,
            new: id.map(|i| img(&[("id", Some(i))])),
        };
        let tx = vec![
            change("customer", Op::Insert, Some("1")),
            change("address_line", Op::Truncate, None),
            change("customer", Op::Insert, Some("2")),
        ];
        let meta = TxMeta {
            position: skein_common::PgLsn(100).into(),
            tx_id: 7,
            commit_time_micros: 0,
        };
        let r = BatchResolution::new(&p, &idx, 3, [tx.as_slice()]).unwrap();
        let recs = r.finish(&p, &[meta]).unwrap();
        let ops: Vec<(Op, String)> = recs
            .iter()
            .map(|r| (r.op, r.root_key.to_string()))
            .collect();
        assert_eq!(
            ops,
            [
                (Op::Insert, "1".into()),
                (Op::Truncate, "0".into()),
                (Op::Truncate, "1".into()),
                (Op::Truncate, "2".into()),
                (Op::Insert, "2".into()),
            ]
        );
        assert!(recs.windows(2).all(|w| w[0].position < w[1].position));
        for (i, n) in recs[1..4].iter().enumerate() {
            assert_eq!(n.partition(3), i as u32);
            assert_eq!(n.table, "public.address_line");
        }
    }

    #[test]
    fn a_batch_resolves_in_source_order_with_lookups_answered() {
        let p = vec![plan()];
        let idx = table_index(&p);
        let t = |n: &str| ("public".to_string(), n.to_string());
        let tx1 = vec![
            RawChange {
                table: t("address_line"),
                op: Op::Insert,
                old: None,
                new: Some(img(&[("address_id", Some("9")), ("line_no", Some("1"))])),
            },
            RawChange {
                table: t("customer"),
                op: Op::Update,
                old: None,
                new: Some(img(&[("id", Some("1"))])),
            },
            RawChange {
                table: t("not_tracked"),
                op: Op::Update,
                old: None,
                new: None,
            },
        ];
        let tx2 = vec![RawChange {
            table: t("address_line"),
            op: Op::Delete,
            old: Some(img(&[("address_id", Some("8")), ("line_no", Some("1"))])),
            new: None,
        }];
        let mut r = BatchResolution::new(&p, &idx, 4, [tx1.as_slice(), tx2.as_slice()]).unwrap();
        assert_eq!(r.lookups().len(), 1);
        assert_eq!(
            r.lookups()[0].values,
            vec![vec![Some("9".into())], vec![Some("8".into())]]
        );
        // Address 8 is gone: only the first tuple has an answer.
        r.answer(0, vec![(1, key("5"))]).unwrap();
        assert!(r.answer(0, vec![(3, key("5"))]).is_err());
        let meta = |c: u64| TxMeta {
            position: skein_common::PgLsn(c).into(),
            tx_id: c,
            commit_time_micros: 0,
        };
        let recs = r.finish(&p, &[meta(10), meta(20)]).unwrap();
        let got: Vec<(String, u64, RootKey)> = recs
            .iter()
            .map(|r| (r.table.clone(), r.position.seq, r.root_key.clone()))
            .collect();
        assert_eq!(
            got,
            vec![
                (
                    "public.address_line".into(),
                    record_seq(0, 0, 0).unwrap(),
                    key("5")
                ),
                (
                    "public.customer".into(),
                    record_seq(1, 0, 0).unwrap(),
                    key("1")
                ),
            ]
        );
    }

    #[test]
    fn every_record_of_a_transaction_has_its_own_increasing_seq() {
        // A key update (two roots), a moved address (two roots), a change
        // that resolves to nothing (NULL join), then a plain update.
        let p = vec![plan()];
        let idx = table_index(&p);
        let t = |n: &str| ("public".to_string(), n.to_string());
        let tx = vec![
            RawChange {
                table: t("customer"),
                op: Op::Update,
                old: Some(img(&[("id", Some("1"))])),
                new: Some(img(&[("id", Some("99"))])),
            },
            RawChange {
                table: t("address"),
                op: Op::Update,
                old: Some(img(&[("id", Some("20")), ("customer_id", Some("2"))])),
                new: Some(img(&[("id", Some("20")), ("customer_id", Some("3"))])),
            },
            RawChange {
                table: t("address"),
                op: Op::Insert,
                old: None,
                new: Some(img(&[("id", Some("21")), ("customer_id", None)])),
            },
            RawChange {
                table: t("customer"),
                op: Op::Update,
                old: None,
                new: Some(img(&[("id", Some("4"))])),
            },
        ];
        let r = BatchResolution::new(&p, &idx, 4, [tx.as_slice(), tx[3..].as_ref()]).unwrap();
        let meta = |c: u64| TxMeta {
            position: skein_common::PgLsn(c).into(),
            tx_id: c,
            commit_time_micros: 0,
        };
        let recs = r.finish(&p, &[meta(10), meta(20)]).unwrap();
        let seq = |change, cand| record_seq(change, cand, 0).unwrap();
        let got: Vec<(u64, u64, RootKey)> = recs
            .iter()
            .map(|r| {
                (
                    r.position.commit.numeric() as u64,
                    r.position.seq,
                    r.root_key.clone(),
                )
            })
            .collect();
        assert_eq!(
            got,
            vec![
                (10, seq(0, 0), key("1")),
                (10, seq(0, 1), key("99")),
                (10, seq(1, 0), key("2")),
                (10, seq(1, 1), key("3")),
                // Change 2 (the NULL-join insert) gave no record.
                (10, seq(3, 0), key("4")),
                // The next transaction starts again from change 0.
                (20, seq(0, 0), key("4")),
            ]
        );
        // Positions are unique and increasing: an applier's "at or before
        // what I applied" never swallows a sibling record.
        assert!(recs.windows(2).all(|w| w[0].position < w[1].position));
    }

    #[test]
    fn a_record_s_seq_does_not_depend_on_what_lookups_answer() {
        // A line moved between addresses (two lookups), then a customer
        // update. Read once with both parents found, once (after a crash,
        // the old address deleted meanwhile) with one: the customer's
        // record keeps its seq, so an applier that applied the first two
        // records of the first read does not drop it as applied.
        let p = vec![plan()];
        let idx = table_index(&p);
        let t = |n: &str| ("public".to_string(), n.to_string());
        let tx = vec![
            RawChange {
                table: t("address_line"),
                op: Op::Update,
                old: Some(img(&[("address_id", Some("20")), ("line_no", Some("1"))])),
                new: Some(img(&[("address_id", Some("21")), ("line_no", Some("1"))])),
            },
            RawChange {
                table: t("customer"),
                op: Op::Update,
                old: None,
                new: Some(img(&[("id", Some("5"))])),
            },
        ];
        let meta = [TxMeta {
            position: skein_common::PgLsn(10).into(),
            tx_id: 10,
            commit_time_micros: 0,
        }];
        let read = |answers: Vec<(i64, RootKey)>| {
            let mut r = BatchResolution::new(&p, &idx, 4, [tx.as_slice()]).unwrap();
            r.answer(0, answers).unwrap();
            r.finish(&p, &meta).unwrap()
        };
        let first = read(vec![(1, key("2")), (2, key("3"))]);
        let again = read(vec![(2, key("3"))]);
        let pos = |recs: &[ChangeRecord], k: &str| {
            recs.iter().find(|r| r.root_key == key(k)).unwrap().position
        };
        assert_eq!(pos(&first, "5"), pos(&again, "5"));
        assert_eq!(pos(&first, "3"), pos(&again, "3"));
        assert!(pos(&first, "2") < pos(&first, "3") && pos(&first, "3") < pos(&first, "5"));
        // Answers arriving in another order number the same.
        let swapped = read(vec![(2, key("3")), (1, key("2"))]);
        assert_eq!(first, swapped);
    }

    #[test]
    fn grandchild_needs_a_lookup_and_missing_columns_are_errors() {
        let p = plan();
        let new = img(&[("address_id", Some("9")), ("line_no", Some("1"))]);
        assert_eq!(
            resolve(&p, 2, Op::Insert, None, Some(&new)).unwrap(),
            Resolved::Lookup {
                node: 2,
                values: vec![vec![Some("9".into())]]
            }
        );
        let partial = img(&[("id", Some("9"))]);
        let e = resolve(&p, 1, Op::Delete, Some(&partial), None).unwrap_err();
        assert!(e.to_string().contains("REPLICA IDENTITY"), "{e}");
    }
}
