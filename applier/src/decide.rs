//! Consolidation and versioning: pure decisions over plain data
//! (nTangle's semantics).

use serde_json::{Map, Value};
use skein_common::json::etag;
use skein_common::{ChangePosition, ChangeRecord, Op, RootKey};

/// All changes of one aggregate in one batch, folded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Consolidated {
    /// Entity name.
    pub entity: String,
    /// Root key.
    pub key: RootKey,
    /// The first operation in position order.
    pub first_op: Op,
    /// Whether any operation inserted the root row.
    pub has_insert: bool,
    /// Whether any operation was a delete of the root, or a TRUNCATE that
    /// may have removed it (a root gone now is then deleted: no delete
    /// follows a TRUNCATE).
    pub has_delete: bool,
    /// Position of the last change.
    pub last_position: ChangePosition,
    /// Latest commit time among the changes (µs since the Unix epoch).
    pub commit_time_micros: i64,
    /// How many records were folded.
    pub records: usize,
    /// An explicit key (`skein explicit`), not a change: decided by
    /// [`decide_explicit`]; `Some(true)` republishes.
    pub explicit: Option<bool>,
}

impl Consolidated {
    /// A queued explicit key ([`crate::explicit`]): no change behind it;
    /// `at` orders it in its batch, `now_micros` is its event time.
    pub fn explicit(
        entity: &str,
        key: RootKey,
        republish: bool,
        at: ChangePosition,
        now_micros: i64,
    ) -> Consolidated {
        Consolidated {
            entity: entity.to_string(),
            key,
            first_op: Op::Update,
            has_insert: false,
            has_delete: true,
            last_position: at,
            commit_time_micros: now_micros,
            records: 1,
            explicit: Some(republish),
        }
    }
}

/// Folds records per (entity, root key), keeping first-seen order.
/// Records must be in position order (the transport guarantees it per key).
pub fn consolidate(records: &[ChangeRecord]) -> Vec<Consolidated> {
    let mut out: Vec<Consolidated> = vec![];
    let mut index: crate::FastMap<(&str, &RootKey), usize> = Default::default();
    for r in records {
        match index.get(&(r.entity.as_str(), &r.root_key)) {
            Some(i) => {
                let c = &mut out[*i];
                c.has_delete |= matches!(r.op, Op::Delete | Op::Truncate);
                c.has_insert |= r.op == Op::Insert;
                c.last_position = c.last_position.max(r.position);
                c.commit_time_micros = c.commit_time_micros.max(r.commit_time_micros);
                c.records += 1;
            }
            None => {
                index.insert((r.entity.as_str(), &r.root_key), out.len());
                out.push(Consolidated {
                    entity: r.entity.clone(),
                    key: r.root_key.clone(),
                    first_op: r.op,
                    has_insert: r.op == Op::Insert,
                    has_delete: matches!(r.op, Op::Delete | Op::Truncate),
                    last_position: r.position,
                    commit_time_micros: r.commit_time_micros,
                    records: 1,
                    explicit: None,
                });
            }
        }
    }
    out
}

/// The aggregate as the source holds it now.
#[derive(Clone, Debug, PartialEq)]
pub enum Current {
    /// The root row does not exist.
    Missing,
    /// The root row exists, but an `inner` lookup join of it found no row:
    /// as the entity is configured, there is no such aggregate. No delete
    /// is on its way for it (lookups are not captured).
    Excluded,
    /// The root exists.
    Present {
        /// Entity JSON (root columns, children nested).
        data: Value,
        /// Entity JSON with `exclude_columns_from_etag` removed, the hash
        /// input; `None` where nothing is excluded: `data` is the input.
        etag_input: Option<Value>,
        /// The logical-delete column is true.
        is_deleted: bool,
    },
}

/// The etag of a present aggregate: of its hash input where excluded
/// columns made one apart, else of its data.
fn present_etag(data: &Value, etag_input: Option<&Value>) -> String {
    etag(etag_input.unwrap_or(data))
}

/// The version row stored for an aggregate.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stored {
    /// Last published etag (`None` after a delete).
    pub etag: Option<String>,
    /// Last published event was a delete.
    pub is_deleted: bool,
}

/// Event action.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// A new aggregate (or re-created after a delete).
    Created,
    /// A changed aggregate.
    Updated,
    /// A removed (or logically deleted) aggregate.
    Deleted,
}

/// What to publish for one aggregate.
#[derive(Clone, Debug, PartialEq)]
pub struct Decision {
    /// The action.
    pub action: Action,
    /// Event data.
    pub data: Value,
    /// Version hash; `None` for deletes.
    pub etag: Option<String>,
}

/// What a delete event carries besides the key.
#[derive(Clone, Debug, Default)]
pub struct DeletePayload {
    /// The key as typed JSON (`{"id": 5}`), built from the root key.
    pub key_data: Map<String, Value>,
    /// Root columns kept on a logical delete.
    pub include_columns_on_delete: Vec<String>,
}

/// Decides the event for one consolidated aggregate, or `None` for no event.
///
/// * gone (or logically deleted) and a delete in the batch, or logically
///   deleted → **delete**, unless the stored version is already a delete;
/// * gone without a delete in this batch → nothing (the delete is on its way);
/// * excluded by an `inner` lookup → **delete** where a live version exists
///   (it left the entity's set; no delete of the root will come), else nothing;
/// * present → the first op decides create/update (create, too, when the
///   stored version is a delete); an etag equal to the stored one → nothing.
///
/// The data of an aggregate published as present moves from `current`
/// into the decision (it is not copied): `current` holds `Value::Null` there
/// afterwards.
pub fn decide(
    c: &Consolidated,
    current: &mut Current,
    stored: Option<&Stored>,
    delete: &DeletePayload,
) -> Option<Decision> {
    let already_deleted = stored.is_some_and(|s| s.is_deleted);
    match current {
        Current::Missing | Current::Excluded => {
            let publish = match current {
                // Unless it is in this batch, the root's delete is on its
                // way; sent even where no version was stored.
                Current::Missing => c.has_delete,
                // Left the set: only consumers that have it need to hear.
                _ => stored.is_some(),
            };
            if !publish || already_deleted {
                return None;
            }
            Some(Decision {
                action: Action::Deleted,
                data: Value::Object(delete.key_data.clone()),
                etag: None,
            })
        }
        Current::Present {
            data,
            is_deleted: true,
            ..
        } => {
            if already_deleted {
                return None;
            }
            let mut payload = delete.key_data.clone();
            if let Value::Object(row) = data {
                for col in &delete.include_columns_on_delete {
                    if let Some(v) = row.get(col) {
                        payload.insert(col.clone(), v.clone());
                    }
                }
            }
            Some(Decision {
                action: Action::Deleted,
                data: Value::Object(payload),
                etag: None,
            })
        }
        Current::Present {
            data,
            etag_input,
            is_deleted: false,
        } => {
            let tag = present_etag(data, etag_input.as_ref());
            if let Some(s) = stored {
                if !s.is_deleted && s.etag.as_deref() == Some(tag.as_str()) {
                    return None;
                }
            }
            // Create wins: the root was inserted in this batch and no
            // consumer has seen it (a child change of the same transaction
            // may come first, resolved to the root by a lookup).
            let unseen = stored.is_none() && c.has_insert;
            let action = if c.first_op == Op::Insert || already_deleted || unseen {
                Action::Created
            } else {
                Action::Updated
            };
            Some(Decision {
                action,
                data: std::mem::take(data),
                etag: Some(tag),
            })
        }
    }
}

/// An explicit key as [`decide`] sees it: an update that may be a delete.
fn as_change() -> Consolidated {
    let at = ChangePosition {
        commit: skein_common::PgLsn(0).into(),
        seq: 0,
    };
    Consolidated::explicit("", RootKey(vec![]), false, at, 0)
}

/// Decides the event for an explicit key, nTangle's Explicit semantics:
///
/// * gone (or logically deleted) → **delete** where a live version exists;
///   nothing where none does (never published) or the last was a delete,
///   unless `republish` and a version exists (the delete is sent again);
/// * present with no version, or after a delete → **create**;
/// * present and published → **update** when the etag changed, or always
///   with `republish`.
///
/// As [`decide`], the data of a present aggregate moves into the decision.
pub fn decide_explicit(
    current: &mut Current,
    stored: Option<&Stored>,
    delete: &DeletePayload,
    republish: bool,
) -> Option<Decision> {
    let gone = match current {
        Current::Missing | Current::Excluded => true,
        Current::Present { is_deleted, .. } => *is_deleted,
    };
    if gone {
        let stored = stored?;
        if stored.is_deleted && !republish {
            return None;
        }
        let forced = Stored {
            etag: stored.etag.clone(),
            is_deleted: false,
        };
        return decide(&as_change(), current, Some(&forced), delete);
    }
    // Never published: a create.
    let mut c = as_change();
    if stored.is_none() {
        c.first_op = Op::Insert;
    }
    match (decide(&c, current, stored, delete), stored) {
        (Some(d), _) => Some(d),
        // Unchanged: only a republish sends it, as an update.
        (None, Some(_)) if republish => {
            let Current::Present {
                data, etag_input, ..
            } = current
            else {
                return None;
            };
            let tag = present_etag(data, etag_input.as_ref());
            Some(Decision {
                action: Action::Updated,
                data: std::mem::take(data),
                etag: Some(tag),
            })
        }
        (None, _) => None,
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;
    use skein_common::PgLsn;

    use super::*;

    fn rec(key: &str, op: Op, seq: u64) -> ChangeRecord {
        ChangeRecord {
            entity: "customer".into(),
            root_key: RootKey(vec![Some(key.into())]),
            table: "public.customer".into(),
            op,
            position: ChangePosition {
                commit: PgLsn(10).into(),
                seq,
            },
            tx_id: 1,
            commit_time_micros: seq as i64,
        }
    }

    fn present(v: Value) -> Current {
        Current::Present {
            data: v,
            etag_input: None,
            is_deleted: false,
        }
    }

    /// [`decide`] on a copy of `cur`, which stays as it is.
    fn decide_ref(
        c: &Consolidated,
        cur: &Current,
        st: Option<&Stored>,
        p: &DeletePayload,
    ) -> Option<Decision> {
        decide(c, &mut cur.clone(), st, p)
    }

    /// [`decide_explicit`] on a copy of `cur`.
    fn explicit_ref(
        cur: &Current,
        st: Option<&Stored>,
        p: &DeletePayload,
        republish: bool,
    ) -> Option<Decision> {
        decide_explicit(&mut cur.clone(), st, p, republish)
    }

    fn payload() -> DeletePayload {
        let mut key_data = Map::new();
        key_data.insert("id".into(), json!(1));
        DeletePayload {
            key_data,
            include_columns_on_delete: vec!["name".into()],
        }
    }

    fn one(ops: &[Op]) -> Consolidated {
        let recs: Vec<_> = ops
            .iter()
            .enumerate()
            .map(|(i, op)| rec("1", *op, i as u64))
            .collect();
        let c = consolidate(&recs);
        assert_eq!(c.len(), 1);
        c[0].clone()
    }

    #[test]
    fn consolidation_keeps_first_op_and_any_delete() {
        let recs = vec![
            rec("1", Op::Insert, 0),
            rec("2", Op::Update, 1),
            rec("1", Op::Delete, 2),
        ];
        let c = consolidate(&recs);
        assert_eq!(c.len(), 2);
        assert_eq!(
            (c[0].first_op, c[0].has_delete, c[0].records),
            (Op::Insert, true, 2)
        );
        assert_eq!(c[0].last_position.seq, 2);
        assert_eq!((c[1].first_op, c[1].has_delete), (Op::Update, false));
    }

    /// Create wins: a child change resolved to a root inserted later in
    /// the same batch (the lookup saw the new root) is still a create when
    /// nothing was published; with a live version it stays an update.
    #[test]
    fn a_root_inserted_after_its_child_is_a_create_when_never_published() {
        let c = one(&[Op::Update, Op::Insert]);
        assert!(c.has_insert);
        let now = present(json!({"id": 1, "name": "a"}));
        let d = decide_ref(&c, &now, None, &payload()).unwrap();
        assert_eq!(d.action, Action::Created);
        let live = Stored {
            etag: Some("other".into()),
            is_deleted: false,
        };
        let d = decide_ref(&c, &now, Some(&live), &payload()).unwrap();
        assert_eq!(d.action, Action::Updated);
        let d = decide_ref(&one(&[Op::Update]), &now, None, &payload()).unwrap();
        assert_eq!(d.action, Action::Updated, "no insert seen: an update");
    }

    /// A TRUNCATE re-check: gone → deleted (no delete follows a TRUNCATE),
    /// present → the etag decides, re-inserted after it → not a create of
    /// something published and not deleted.
    #[test]
    fn a_truncate_recheck_deletes_what_is_gone_and_keeps_what_is_unchanged() {
        let stored = Stored {
            etag: Some(etag(&json!({"id": 1}))),
            is_deleted: false,
        };
        let gone = decide_ref(
            &one(&[Op::Truncate]),
            &Current::Missing,
            Some(&stored),
            &payload(),
        );
        assert_eq!(gone.unwrap().action, Action::Deleted);
        let same = present(json!({"id": 1}));
        assert_eq!(
            decide_ref(
                &one(&[Op::Truncate, Op::Insert]),
                &same,
                Some(&stored),
                &payload()
            ),
            None
        );
        let changed = decide_ref(
            &one(&[Op::Truncate, Op::Insert]),
            &present(json!({"id": 1, "n": 2})),
            Some(&stored),
            &payload(),
        );
        assert_eq!(changed.unwrap().action, Action::Updated);
    }

    #[test]
    fn update_then_delete_publishes_delete() {
        let d = decide_ref(
            &one(&[Op::Update, Op::Delete]),
            &Current::Missing,
            None,
            &payload(),
        )
        .unwrap();
        assert_eq!(d.action, Action::Deleted);
        assert_eq!(d.data, json!({"id": 1}));
        assert_eq!(d.etag, None);
    }

    #[test]
    fn create_update_then_delete_publishes_one_delete() {
        let d = decide_ref(
            &one(&[Op::Insert, Op::Update, Op::Delete]),
            &Current::Missing,
            None,
            &payload(),
        );
        assert_eq!(d.unwrap().action, Action::Deleted);
    }

    #[test]
    fn create_update_with_upcoming_delete_publishes_nothing() {
        assert_eq!(
            decide_ref(
                &one(&[Op::Insert, Op::Update]),
                &Current::Missing,
                None,
                &payload()
            ),
            None
        );
    }

    #[test]
    fn multiple_changes_publish_one_create() {
        let d = decide_ref(
            &one(&[Op::Insert, Op::Update, Op::Update]),
            &present(json!({"id": 1})),
            None,
            &payload(),
        )
        .unwrap();
        assert_eq!(d.action, Action::Created);
        assert!(d.etag.is_some());
    }

    #[test]
    fn same_version_publishes_nothing_and_changed_version_updates() {
        let cur = present(json!({"id": 1, "name": "a"}));
        let Current::Present { data, .. } = &cur else {
            unreachable!()
        };
        let stored = Stored {
            etag: Some(etag(data)),
            is_deleted: false,
        };
        assert_eq!(
            decide_ref(&one(&[Op::Update]), &cur, Some(&stored), &payload()),
            None
        );
        let changed = present(json!({"id": 1, "name": "b"}));
        let d = decide_ref(&one(&[Op::Update]), &changed, Some(&stored), &payload()).unwrap();
        assert_eq!(d.action, Action::Updated);
    }

    #[test]
    fn recreate_after_delete_is_a_create_and_repeated_delete_is_silent() {
        let stored = Stored {
            etag: None,
            is_deleted: true,
        };
        let d = decide_ref(
            &one(&[Op::Update]),
            &present(json!({"id": 1})),
            Some(&stored),
            &payload(),
        )
        .unwrap();
        assert_eq!(d.action, Action::Created);
        assert_eq!(
            decide_ref(
                &one(&[Op::Delete]),
                &Current::Missing,
                Some(&stored),
                &payload()
            ),
            None
        );
    }

    /// A root an `inner` lookup excludes: a delete for those that have it
    /// (no delete of the root is coming), nothing for those that never did.
    #[test]
    fn an_excluded_aggregate_is_deleted_once_where_it_was_published() {
        let live = Stored {
            etag: Some("e".into()),
            is_deleted: false,
        };
        let gone = Stored {
            etag: None,
            is_deleted: true,
        };
        let act = |ops: &[Op], st: Option<&Stored>| {
            decide_ref(&one(ops), &Current::Excluded, st, &payload()).map(|d| (d.action, d.data))
        };
        assert_eq!(
            act(&[Op::Update], Some(&live)),
            Some((Action::Deleted, json!({"id": 1})))
        );
        assert_eq!(act(&[Op::Insert], None), None);
        assert_eq!(act(&[Op::Update, Op::Delete], None), None);
        assert_eq!(act(&[Op::Update], Some(&gone)), None);
    }

    #[test]
    fn logical_delete_keeps_key_and_included_columns() {
        let cur = Current::Present {
            data: json!({"id": 1, "name": "a", "email": "x"}),
            etag_input: Some(json!({})),
            is_deleted: true,
        };
        let d = decide_ref(&one(&[Op::Update]), &cur, None, &payload()).unwrap();
        assert_eq!(d.action, Action::Deleted);
        assert_eq!(d.data, json!({"id": 1, "name": "a"}));
    }

    /// nTangle's Explicit semantics, case by case.
    #[test]
    fn explicit_keys_follow_ntangle_semantics() {
        let v = json!({"id": 1, "name": "a"});
        let live = Stored {
            etag: Some(etag(&v)),
            is_deleted: false,
        };
        let other = Stored {
            etag: Some("other".into()),
            is_deleted: false,
        };
        let gone = Stored {
            etag: None,
            is_deleted: true,
        };
        let p = payload();
        let act = |cur: &Current, st: Option<&Stored>, rep: bool| {
            explicit_ref(cur, st, &p, rep).map(|d| d.action)
        };
        let logically_deleted = Current::Present {
            data: v.clone(),
            etag_input: None,
            is_deleted: true,
        };
        // Present.
        assert_eq!(act(&present(v.clone()), None, false), Some(Action::Created));
        assert_eq!(
            act(&present(v.clone()), Some(&gone), false),
            Some(Action::Created)
        );
        assert_eq!(act(&present(v.clone()), Some(&live), false), None);
        assert_eq!(
            act(&present(v.clone()), Some(&live), true),
            Some(Action::Updated)
        );
        assert_eq!(
            act(&present(v.clone()), Some(&other), false),
            Some(Action::Updated)
        );
        assert_eq!(act(&present(v.clone()), None, true), Some(Action::Created));
        // Gone: a delete only where a live version exists (or, republished,
        // any version).
        for cur in [&Current::Missing, &Current::Excluded, &logically_deleted] {
            assert_eq!(act(cur, None, false), None);
            assert_eq!(act(cur, None, true), None);
            assert_eq!(act(cur, Some(&live), false), Some(Action::Deleted));
            assert_eq!(act(cur, Some(&gone), false), None);
            assert_eq!(act(cur, Some(&gone), true), Some(Action::Deleted));
        }
        // A republish carries the same etag; a delete none.
        let d = explicit_ref(&present(v.clone()), Some(&live), &p, true).unwrap();
        assert_eq!(d.etag, live.etag);
        let d = explicit_ref(&Current::Missing, Some(&live), &p, false).unwrap();
        assert_eq!((d.etag, d.data), (None, json!({"id": 1})));
    }
}
