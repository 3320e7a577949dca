//! Root-key resolution from change images: pure decisions, no I/O.
//!
//! * root-table change → its key (before image for deletes); a key update is
//!   a delete of the old key plus an insert of the new one;
//! * direct child joined on the root key → the join columns of the before
//!   *and* after images (a child moved to another parent touches two roots);
//! * anything else (deeper children, joins to non-key columns) → a
//!   [`Lookup`] that the source answers with one batched query per table.

use skein_common::config::TableNode;
use skein_common::{Op, RootKey};
use skein_sql::postgres::direct_root_mapping;
use skein_sql::Catalog;

use crate::error::{Error, Result};
use crate::pgoutput::Image;

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

fn take(img: &Image, cols: &[String], table: &str) -> Result<Vec<Option<String>>> {
    cols.iter()
        .map(|c| {
            img.get(c).cloned().ok_or_else(|| {
                Error::Decode(format!(
                    "the change of {table} does not carry column `{c}`: run `skein sql source` \
                     and apply its REPLICA IDENTITY / publication statements"
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
    old: Option<&Image>,
    new: Option<&Image>,
) -> Result<Resolved> {
    let n = &plan.nodes[node];
    let table = n.qualified();
    if node == 0 {
        let new_key = new.map(|i| take(i, &plan.root_key, &table)).transpose()?;
        // pgoutput sends the old key on update only when it changed.
        let old_key = old.map(|i| take(i, &plan.root_key, &table)).transpose()?;
        let mut out = vec![];
        match op {
            Op::Delete => {
                let k = old_key.or(new_key).ok_or_else(|| {
                    Error::Decode(format!("delete of {table} without a before image"))
                })?;
                out.push((Op::Delete, RootKey(k)));
            }
            Op::Insert => out.push((Op::Insert, RootKey(new_key.unwrap_or_default()))),
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
    let join_cols: Vec<String> = n.on.iter().map(|o| o.name.clone()).collect();
    let mut tuples: Vec<Vec<Option<String>>> = vec![];
    for img in [old, new].into_iter().flatten() {
        let t = take(img, &join_cols, &table)?;
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

#[cfg(test)]
mod tests {
    use skein_common::Config;
    use skein_sql::{ColumnInfo, TableInfo};

    use super::*;

    fn plan() -> EntityPlan {
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

    fn img(pairs: &[(&str, Option<&str>)]) -> Image {
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
