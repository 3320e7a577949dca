//! Identifier mapping below the root (nTangle's join `identifierMapping`
//! and its `mappings`): a joined row's key, or a column referencing a row
//! of some table, maps to that row's global identifier in the sidecar's
//! `identifier_mapping` table.
//!
//! One table row has one identifier, whatever refers to it: rows are kept
//! under a namespace per table ([`namespace`]): the name of the entity the
//! table is the root of (where that entity maps its identifiers, so a
//! reference to a contact carries the contact's own `global_id`), else
//! `schema.table`. Keys are canonical root-key text (`["11"]`).
//!
//! The event gets `global_id` on each mapped row and `global_<column>`
//! beside each mapped column (null where the column is). Neither is part
//! of the etag: both follow from keys that are.

use std::collections::HashMap;

use serde_json::{Map, Value};
use skein_common::config::{Config, EntityConfig};
use skein_common::RootKey;
use skein_sql::Catalog;

use crate::error::{Error, Result};
use crate::sidecar::{IdentifierRow, Sidecar};

/// The `identifier_mapping` namespace of `schema.table`'s rows.
pub fn namespace(cfg: &Config, schema: &str, table: &str) -> String {
    cfg.entities
        .iter()
        .find(|e| e.identifier_mapping && e.schema == schema && e.table == table)
        .map_or_else(|| format!("{schema}.{table}"), |e| e.name.clone())
}

/// What one node of an entity maps.
#[derive(Clone, Debug, PartialEq)]
struct NodePlan {
    /// Property name under the parent (unused for the root).
    name: String,
    /// Child nodes.
    children: Vec<usize>,
    /// The row's own key: its namespace and key columns (joins only; the
    /// root's is the entity's `identifier_mapping`, handled with the event).
    own: Option<(String, Vec<String>)>,
    /// Referencing columns and the namespace of the rows they reference.
    refs: Vec<(String, String)>,
}

/// An entity's mapping plan; empty when it maps nothing below the root.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    nodes: Vec<NodePlan>,
}

/// One identifier an event needs: a namespace and a canonical key.
pub type Wanted = (String, String);

impl Plan {
    /// The plan of `entity` over `catalog`. A mapped join whose key
    /// columns, or a mapped column, is not in the event is an error.
    pub fn new(cfg: &Config, entity: &EntityConfig, catalog: &Catalog) -> Result<Plan> {
        let nodes = entity.nodes();
        let mut plans: Vec<NodePlan> = nodes
            .iter()
            .map(|n| NodePlan {
                name: n.name.clone(),
                children: vec![],
                own: None,
                refs: vec![],
            })
            .collect();
        for n in &nodes {
            if let Some(p) = n.parent {
                plans[p].children.push(n.index);
            }
            let shown: Vec<String> = catalog
                .event_columns(n)
                .iter()
                .map(|c| c.name.clone())
                .collect();
            let missing = |c: &str, what: &str| Error::Schema {
                message: format!(
                    "entity `{}`, table `{}`: {what} `{c}` is not in the event (include it, \
                     or take it off exclude_columns)",
                    entity.name,
                    n.qualified()
                ),
                fix: "change the entity's columns in the config".into(),
            };
            if n.index > 0 && n.identifier_mapping {
                let key = catalog.key_columns(n);
                if let Some(c) = key.iter().find(|c| !shown.contains(c)) {
                    return Err(missing(c, "the key column of identifier_mapping"));
                }
                plans[n.index].own = Some((namespace(cfg, &n.schema, &n.table), key));
            }
            for m in &n.mappings {
                if !shown.contains(&m.name) {
                    return Err(missing(&m.name, "the mapped column"));
                }
                let schema = m.schema.as_deref().unwrap_or(&n.schema);
                plans[n.index]
                    .refs
                    .push((m.name.clone(), namespace(cfg, schema, &m.table)));
            }
        }
        let any = plans.iter().any(|p| p.own.is_some() || !p.refs.is_empty());
        Ok(Plan {
            nodes: if any { plans } else { vec![] },
        })
    }

    /// Whether the entity maps anything below its root key.
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// The identifiers the event `data` needs.
    pub fn wanted(&self, data: &Value) -> Vec<Wanted> {
        let mut out = vec![];
        if let (false, Value::Object(root)) = (self.is_empty(), data) {
            self.visit(0, root, &mut |plan, row| {
                if let Some((ns, cols)) = &plan.own {
                    if let Some(k) = key_of(row, cols) {
                        out.push((ns.clone(), k));
                    }
                }
                for (col, ns) in &plan.refs {
                    if let Some(k) = key_of(row, std::slice::from_ref(col)) {
                        out.push((ns.clone(), k));
                    }
                }
            });
        }
        out
    }

    /// Puts the identifiers into the event `data`: `global_id` on each
    /// mapped row, `global_<column>` beside each mapped column. A wanted
    /// identifier absent from `ids` is an error (it was to be assigned).
    pub fn apply(&self, data: &mut Value, ids: &HashMap<Wanted, String>) -> Result<()> {
        let mut failed = None;
        if let (false, Value::Object(root)) = (self.is_empty(), data) {
            self.visit_mut(0, root, &mut |plan, row| {
                let mut get = |ns: &str, k: Option<String>| match k {
                    None => Value::Null,
                    Some(k) => match ids.get(&(ns.to_string(), k.clone())) {
                        Some(g) => Value::String(g.clone()),
                        None => {
                            failed = Some(format!("{ns} {k}"));
                            Value::Null
                        }
                    },
                };
                if let Some((ns, cols)) = &plan.own {
                    let v = get(ns, key_of(row, cols));
                    row.insert("global_id".into(), v);
                }
                for (col, ns) in &plan.refs {
                    let v = get(ns, key_of(row, std::slice::from_ref(col)));
                    row.insert(format!("global_{col}"), v);
                }
            });
        }
        match failed {
            None => Ok(()),
            Some(what) => Err(Error::Data(format!(
                "no global identifier was assigned to {what}"
            ))),
        }
    }

    fn visit(
        &self,
        node: usize,
        row: &Map<String, Value>,
        f: &mut impl FnMut(&NodePlan, &Map<String, Value>),
    ) {
        let plan = &self.nodes[node];
        f(plan, row);
        for &c in &plan.children {
            for child in rows(row.get(&self.nodes[c].name)) {
                self.visit(c, child, f);
            }
        }
    }

    fn visit_mut(
        &self,
        node: usize,
        row: &mut Map<String, Value>,
        f: &mut impl FnMut(&NodePlan, &mut Map<String, Value>),
    ) {
        let plan = &self.nodes[node];
        f(plan, row);
        for &c in &plan.children {
            match row.get_mut(&self.nodes[c].name) {
                Some(Value::Object(m)) => self.visit_mut(c, m, f),
                Some(Value::Array(a)) => {
                    for v in a {
                        if let Value::Object(m) = v {
                            self.visit_mut(c, m, f);
                        }
                    }
                }
                _ => {}
            }
        }
    }
}

/// The rows under a child property: an object (one-to-one), an array's
/// objects (one-to-many), or none.
fn rows(v: Option<&Value>) -> Vec<&Map<String, Value>> {
    match v {
        Some(Value::Object(m)) => vec![m],
        Some(Value::Array(a)) => a.iter().filter_map(Value::as_object).collect(),
        _ => vec![],
    }
}

/// The canonical key of a row's `cols` (the text a root key of that table
/// would have); `None` when one is null or absent.
fn key_of(row: &Map<String, Value>, cols: &[String]) -> Option<String> {
    let mut parts = vec![];
    for c in cols {
        parts.push(Some(match row.get(c)? {
            Value::Null => return None,
            Value::String(s) => s.clone(),
            Value::Bool(b) => if *b { "t" } else { "f" }.to_string(),
            other => other.to_string(),
        }));
    }
    Some(RootKey(parts).canonical())
}

/// The global identifier of every row in `wanted`: the stored one, else
/// the one proposed there, inserted (see [`Sidecar::insert_identifiers`]).
/// An applier that lost a race for a key gets the winner's. A proposed
/// identifier that is another key's already (a pre-assigned value given
/// twice) is an error naming both keys: no event may carry it.
pub async fn assign<S: Sidecar>(
    sidecar: &mut S,
    mut wanted: Vec<IdentifierRow>,
) -> Result<HashMap<Wanted, String>> {
    wanted.sort_by(|a, b| (&a.entity, &a.key).cmp(&(&b.entity, &b.key)));
    wanted.dedup_by(|a, b| a.entity == b.entity && a.key == b.key);
    let mut ids = HashMap::new();
    read(sidecar, &wanted, &mut ids).await?;
    let missing: Vec<IdentifierRow> = wanted
        .into_iter()
        .filter(|w| !ids.contains_key(&(w.entity.clone(), w.key.clone())))
        .collect();
    if missing.is_empty() {
        return Ok(ids);
    }
    let mut proposed: HashMap<(&str, &str), &str> = HashMap::new();
    for m in &missing {
        if let Some(other) = proposed.insert((&m.entity, &m.global_id), &m.key) {
            return Err(taken(&m.entity, &m.global_id, &m.key, other));
        }
    }
    sidecar.insert_identifiers(&missing).await?;
    read(sidecar, &missing, &mut ids).await?;
    for m in &missing {
        if !ids.contains_key(&(m.entity.clone(), m.key.clone())) {
            let holders = sidecar
                .identifier_holders(&m.entity, std::slice::from_ref(&m.global_id))
                .await?;
            let holder = holders
                .get(&m.global_id)
                .map_or("another key", String::as_str);
            return Err(taken(&m.entity, &m.global_id, &m.key, holder));
        }
    }
    Ok(ids)
}

/// The stored identifiers of `rows`, per namespace, into `ids`.
async fn read<S: Sidecar>(
    sidecar: &mut S,
    rows: &[IdentifierRow],
    ids: &mut HashMap<Wanted, String>,
) -> Result<()> {
    let mut by_ns: HashMap<&str, Vec<String>> = HashMap::new();
    for r in rows {
        by_ns.entry(&r.entity).or_default().push(r.key.clone());
    }
    for (ns, keys) in by_ns {
        for (k, g) in sidecar.identifiers(ns, &keys).await? {
            ids.insert((ns.to_string(), k), g);
        }
    }
    Ok(())
}

fn taken(ns: &str, global_id: &str, key: &str, holder: &str) -> Error {
    Error::Data(format!(
        "identifier mapping of `{ns}`: global identifier `{global_id}` (pre-assigned to key {key}) \
         is already the identifier of key {holder}; each identifier names one row. Correct the \
         pre-assigned value (global_id_column or the identifier_mapping row), then restart"
    ))
}
