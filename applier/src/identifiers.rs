//! Identifier mapping below the root (nTangle's join `identifierMapping`
//! and its `mappings`): a joined row's key, or a column referencing a row
//! of some table, maps to that row's global identifier in the sidecar's
//! `identifier_mapping` table.
//!
//! One table row has one identifier, whatever refers to it: rows are kept
//! under a namespace per table ([`namespace`]), `schema.table`, the root's
//! own identifier included (so a reference to a contact carries the
//! contact's own `global_id`, and adding an entity changes no id). Keys
//! are canonical root-key text (`["11"]`).
//!
//! The event gets `global_id` on each mapped row and `global_<column>`
//! beside each mapped column (null where the column is). Neither is part
//! of the etag: both follow from keys that are.

use std::collections::{HashMap, HashSet};

use serde_json::{Map, Value};
use skein_common::config::{Config, EntityConfig};
use skein_common::RootKey;
use skein_sql::Catalog;

use crate::error::{Error, Result};
use crate::sidecar::{IdentifierRow, Sidecar};

/// The `identifier_mapping` namespace of `schema.table`'s rows:
/// `schema.table`, whatever the config (one row, one id: an entity added
/// later on the table keeps the ids its rows were published with).
pub fn namespace(schema: &str, table: &str) -> String {
    format!("{schema}.{table}")
}

/// A row of one namespace at odds with one of another: key and global id
/// of the first, then of the second.
pub type Conflict = (String, String, String, String);

/// The namespace moves of [`carry_over`]: each mapping entity's former
/// namespace (its name) to its root table's.
pub fn carry_over_moves(cfg: &Config) -> Vec<(String, String)> {
    cfg.entities
        .iter()
        .filter(|e| e.identifier_mapping)
        .map(|e| (e.name.clone(), namespace(&e.schema, &e.table)))
        .filter(|(from, to)| from != to)
        .collect()
}

/// The namespace pairs whose conflicts [`judge_carry_over`] decides on
/// before `moves` are made: each move's `from` with its `to`, and with the
/// `from` of each earlier move into the same `to` (`true`: two entities).
pub fn carry_over_checks(moves: &[(String, String)]) -> Vec<(&str, &str, bool)> {
    let mut out = vec![];
    for (i, (from, to)) in moves.iter().enumerate() {
        out.push((from.as_str(), to.as_str(), false));
        for (other, _) in moves[..i].iter().filter(|(_, t)| t == to) {
            out.push((from.as_str(), other.as_str(), true));
        }
    }
    out
}

/// Decides on the `conflicts` of namespace `from`'s rows with `to`'s
/// before `from`'s move to `to` ([`carry_over`]). `between_entities`: `to`
/// is another entity's former namespace. Returns how many of `to`'s rows
/// the move replaces with `from`'s (same key, another id).
///
/// An entity's id of a row is the one its events carry as `data.global_id`,
/// and the one every reference to the row carried since the entity was
/// added (an earlier version keyed references to a root table by the
/// entity's name): it wins over an id stored under `schema.table` before
/// the entity existed, which only older events carry. Two entities of one
/// table with different ids for a row, or one id on two rows, leave no id
/// to keep without contradicting published ones: an error.
pub fn judge_carry_over(
    from: &str,
    to: &str,
    between_entities: bool,
    conflicts: &[Conflict],
) -> Result<u64> {
    let mut replaced = 0;
    for (k1, g1, k2, g2) in conflicts {
        if k1 == k2 && !between_entities {
            tracing::warn!(
                key = %k1, kept = %g1, dropped = %g2,
                "identifier mapping: `{to}` had another id for a row of entity `{from}` (assigned \
                 to references before the entity mapped its rows); the entity's is kept"
            );
            replaced += 1;
            continue;
        }
        let why = if k1 == k2 {
            format!(
                "entities `{from}` and `{to}`, rooted on one table, published different global \
                 ids for key {k1} (`{g1}`, `{g2}`), and a row now has one identifier"
            )
        } else {
            format!(
                "global id `{g1}` of key {k1} (namespace `{from}`) is key {k2}'s in namespace \
                 `{to}`, and an identifier names one row"
            )
        };
        return Err(Error::Data(format!(
            "identifier mapping: cannot carry the ids of namespace `{from}` over to the table's \
             namespace: {why}. Delete the row to give up from the sidecar's identifier_mapping, \
             then restart"
        )));
    }
    Ok(replaced)
}

/// Start-up carry-over of ids an earlier version stored under a mapping
/// entity's name (its root's rows) to the table's namespace, where they
/// are now looked up (see [`namespace`]), in one transaction; idempotent.
pub async fn carry_over<S: Sidecar>(cfg: &Config, sidecar: &mut S) -> Result<()> {
    let moves = carry_over_moves(cfg);
    if moves.is_empty() {
        return Ok(());
    }
    let moved = sidecar.move_identifiers(&moves).await?;
    if moved > 0 {
        tracing::info!(
            moved,
            "identifier mapping: ids stored under entity names carried over to their tables' \
             namespaces"
        );
    }
    Ok(())
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
    own: Option<(String, Vec<String>, Vec<Pad>)>,
    /// Referencing columns, the namespace of the rows they reference and
    /// the referenced key's text form.
    refs: Vec<(String, String, Pad)>,
}

/// An entity's mapping plan; empty when it maps nothing below the root.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    nodes: Vec<NodePlan>,
}

/// One identifier an event needs: a namespace and a canonical key.
pub type Wanted = (String, String);

/// How a key column's JSON value becomes the text the change stream
/// sends for it: as it is, or (a `character(n)`) padded to `n` characters.
type Pad = Option<usize>;

/// Key column types whose JSON value prints as the stream's text of the
/// key (PostgreSQL, then SQL Server type names); `bpchar` once padded.
const MATCHABLE_KEY_TYPES: &[&str] = &[
    "int2",
    "int4",
    "int8",
    "text",
    "varchar",
    "uuid",
    "numeric",
    "bool",
    "bpchar",
    "tinyint",
    "smallint",
    "int",
    "bigint",
    "nvarchar",
    "uniqueidentifier",
    "decimal",
];

/// The text form of key column `col` of `schema.table` (`what` names it
/// in the error): an error when its type's JSON value cannot be matched to
/// the stream's key text.
fn pad_of(
    catalog: &Catalog,
    entity: &str,
    what: &str,
    schema: &str,
    table: &str,
    col: &str,
) -> Result<Pad> {
    let Some(c) = catalog.table(schema, table).and_then(|t| t.column(col)) else {
        return Ok(None);
    };
    let width = c
        .data_type
        .strip_prefix("character(")
        .and_then(|r| r.strip_suffix(')'))
        .and_then(|n| n.parse().ok());
    if !MATCHABLE_KEY_TYPES.contains(&c.type_name.as_str())
        || (c.type_name == "bpchar" && width.is_none())
    {
        return Err(Error::Schema {
            message: format!(
                "entity `{entity}`: {what} `{col}` of `{schema}.{table}` is of type `{}`, whose \
                 value cannot be matched to a key reliably (identifier mapping supports integer, \
                 text, varchar, character(n), uuid, numeric and boolean keys)",
                c.data_type
            ),
            fix: "map a column of a supported type, or take identifier_mapping / the mapping \
                  off"
            .into(),
        });
    }
    Ok(width)
}

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
            let refused = |field: String, message: String, fix: &str| Error::Schema {
                message: format!(
                    "entity `{}`, table `{}`, {field}: {message}",
                    entity.name,
                    n.qualified()
                ),
                fix: fix.into(),
            };
            let maps_own = n.identifier_mapping || (n.index == 0 && entity.identifier_mapping);
            if maps_own && shown.iter().any(|c| c == "global_id") {
                return Err(refused(
                    "identifier_mapping".into(),
                    "the table has a column `global_id`, which the mapped identifier would \
                     overwrite in the event"
                        .into(),
                    "exclude the column (exclude_columns) or rename it",
                ));
            }
            if n.index > 0 && n.identifier_mapping {
                let key = catalog.key_columns(n);
                let rooted = rooted_key(cfg, catalog, &n.schema, &n.table);
                if let Some(referenced) = rooted.filter(|r| *r != key) {
                    return Err(refused(
                        "identifier_mapping".into(),
                        format!(
                            "the join's key {key:?} is not the key {referenced:?} its table's \
                             rows are mapped by (the key of the entity rooted on it)"
                        ),
                        "give the join the same `key:` as the entity of its table, or none",
                    ));
                }
                if let Some(c) = key.iter().find(|c| !shown.contains(c)) {
                    return Err(missing(c, "the key column of identifier_mapping"));
                }
                let pads = key
                    .iter()
                    .map(|c| {
                        let what = "the key column of a mapped join";
                        pad_of(catalog, &entity.name, what, &n.schema, &n.table, c)
                    })
                    .collect::<Result<_>>()?;
                plans[n.index].own = Some((namespace(&n.schema, &n.table), key, pads));
            }
            for m in &n.mappings {
                if !shown.contains(&m.name) {
                    return Err(missing(&m.name, "the mapped column"));
                }
                let field = format!("mappings `{}`", m.name);
                let global = format!("global_{}", m.name);
                if shown.contains(&global) {
                    return Err(refused(
                        field,
                        format!(
                            "the table has a column `{global}`, which the mapped identifier \
                             would overwrite in the event"
                        ),
                        "exclude the column (exclude_columns) or rename it",
                    ));
                }
                let schema = m.schema.as_deref().unwrap_or(&n.schema);
                let what = "the mapped column";
                pad_of(catalog, &entity.name, what, &n.schema, &n.table, &m.name)?;
                let referenced = referenced_key(cfg, catalog, schema, &m.table);
                // A table outside the catalog read is checked by [`check`].
                let known = catalog.table(schema, &m.table).is_some();
                let [k] = referenced.as_slice() else {
                    if !known {
                        plans[n.index].refs.push((
                            m.name.clone(),
                            namespace(schema, &m.table),
                            None,
                        ));
                        continue;
                    }
                    return Err(refused(
                        field,
                        format!(
                            "the referenced table `{schema}.{}` has the key {referenced:?}; a \
                             mapped column can only name a row of a table with a one-column key",
                            m.table
                        ),
                        "take the mapping off, or map a column referencing a one-column key",
                    ));
                };
                let pad = pad_of(catalog, &entity.name, "the key", schema, &m.table, k)?;
                plans[n.index]
                    .refs
                    .push((m.name.clone(), namespace(schema, &m.table), pad));
            }
        }
        let any = plans.iter().any(|p| p.own.is_some() || !p.refs.is_empty());
        Ok(Plan {
            nodes: if any { plans } else { vec![] },
        })
    }

    /// The tables mappings reference (to be read into the catalog
    /// [`check`] is given).
    pub fn referenced_tables(cfg: &Config) -> Vec<(String, String)> {
        let mut out: Vec<(String, String)> = cfg
            .entities
            .iter()
            .flat_map(|e| e.nodes())
            .flat_map(|n| {
                let schema = n.schema.clone();
                n.mappings
                    .iter()
                    .map(move |m| (m.schema.clone().unwrap_or(schema.clone()), m.table.clone()))
                    .collect::<Vec<_>>()
            })
            .collect();
        out.sort();
        out.dedup();
        out
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
                if let Some((ns, cols, pads)) = &plan.own {
                    if let Some(k) = key_of(row, cols, pads) {
                        out.push((ns.clone(), k));
                    }
                }
                for (col, ns, pad) in &plan.refs {
                    if let Some(k) = key_of(row, std::slice::from_ref(col), &[*pad]) {
                        out.push((ns.clone(), k));
                    }
                }
            });
        }
        out
    }

    /// Puts the identifiers into the event `data`: `global_id` on each
    /// mapped row, `global_<column>` beside each mapped column. A wanted
    /// identifier absent from `ids` is null when `dangling` has it (a
    /// reference to a row not in the source, whose own pre-assigned id is
    /// not known yet), else an error (it was to be assigned).
    pub fn apply(
        &self,
        data: &mut Value,
        ids: &HashMap<Wanted, String>,
        dangling: &HashSet<Wanted>,
    ) -> Result<()> {
        let mut failed = None;
        if let (false, Value::Object(root)) = (self.is_empty(), data) {
            self.visit_mut(0, root, &mut |plan, row| {
                let mut get = |ns: &str, k: Option<String>| match k {
                    None => Value::Null,
                    Some(k) => match ids.get(&(ns.to_string(), k.clone())) {
                        Some(g) => Value::String(g.clone()),
                        None if dangling.contains(&(ns.to_string(), k.clone())) => Value::Null,
                        None => {
                            failed = Some(format!("{ns} {k}"));
                            Value::Null
                        }
                    },
                };
                if let Some((ns, cols, pads)) = &plan.own {
                    let v = get(ns, key_of(row, cols, pads));
                    row.insert("global_id".into(), v);
                }
                for (col, ns, pad) in &plan.refs {
                    let v = get(ns, key_of(row, std::slice::from_ref(col), &[*pad]));
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

/// Start-up check of every entity's identifier mapping over `catalog`,
/// which holds the tables mappings reference besides the config's: a
/// mapping to a table that does not exist, or to one whose key is not one
/// column, a mapped join keyed otherwise than its table's entity, a key
/// type that cannot be matched, a `global_*` column of the source the
/// identifier would overwrite: each an error naming the field to fix.
pub fn check(cfg: &Config, catalog: &Catalog) -> Result<()> {
    for e in &cfg.entities {
        for n in e.nodes() {
            for m in &n.mappings {
                let schema = m.schema.as_deref().unwrap_or(&n.schema);
                if catalog.table(schema, &m.table).is_none() {
                    return Err(Error::Schema {
                        message: format!(
                            "entity `{}`, table `{}`, mappings `{}`: `table: {}` names no table \
                             `{schema}.{}`",
                            e.name,
                            n.qualified(),
                            m.name,
                            m.table,
                            m.table
                        ),
                        fix: "name an existing table in `table:` (and `schema:` when it is not \
                              the entity's)"
                            .into(),
                    });
                }
            }
        }
        Plan::new(cfg, e, catalog)?;
    }
    Ok(())
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

/// The key columns of `schema.table`'s rows as a reference names them:
/// the key of an entity whose root the table is, else its primary key.
fn referenced_key(cfg: &Config, catalog: &Catalog, schema: &str, table: &str) -> Vec<String> {
    rooted_key(cfg, catalog, schema, table)
        .or_else(|| catalog.table(schema, table).map(|t| t.primary_key.clone()))
        .unwrap_or_default()
}

/// The key of the (first) entity whose root is `schema.table`, if any.
fn rooted_key(cfg: &Config, catalog: &Catalog, schema: &str, table: &str) -> Option<Vec<String>> {
    cfg.entities
        .iter()
        .find(|e| e.schema == schema && e.table == table)
        .map(|e| catalog.key_columns(&e.nodes()[0]))
}

/// The canonical key of a row's `cols` (the text the change stream sends
/// for a root key of that table: a `character(n)` value, which the event
/// JSON prints trimmed, padded to its `pads` width); `None` when one is
/// null or absent.
fn key_of(row: &Map<String, Value>, cols: &[String], pads: &[Pad]) -> Option<String> {
    let mut parts = vec![];
    for (i, c) in cols.iter().enumerate() {
        let mut text = match row.get(c)? {
            Value::Null => return None,
            Value::String(s) => s.clone(),
            Value::Bool(b) => if *b { "t" } else { "f" }.to_string(),
            other => other.to_string(),
        };
        if let Some(Some(n)) = pads.get(i) {
            let len = text.chars().count();
            text.extend(std::iter::repeat_n(' ', n.saturating_sub(len)));
        }
        parts.push(Some(text));
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
    // A pre-assigned proposal first: the dedup keeps it.
    wanted.sort_by(|a, b| {
        (&a.entity, &a.key, !a.preassigned).cmp(&(&b.entity, &b.key, !b.preassigned))
    });
    wanted.dedup_by(|a, b| a.entity == b.entity && a.key == b.key);
    let mut ids = HashMap::new();
    read_stored(sidecar, rows_of(&wanted), &mut ids).await?;
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
    read_stored(sidecar, rows_of(&missing), &mut ids).await?;
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
/// Adds to `ids` the stored identifier of each `(namespace, key)` that has
/// one: a read per namespace.
pub async fn read_stored<'a, S: Sidecar>(
    sidecar: &mut S,
    keys: impl IntoIterator<Item = (&'a str, &'a str)>,
    ids: &mut HashMap<Wanted, String>,
) -> Result<()> {
    let mut by_ns: HashMap<&str, Vec<String>> = HashMap::new();
    for (ns, key) in keys {
        by_ns.entry(ns).or_default().push(key.to_string());
    }
    for (ns, keys) in by_ns {
        for (k, g) in sidecar.identifiers(ns, &keys).await? {
            ids.insert((ns.to_string(), k), g);
        }
    }
    Ok(())
}

/// The `(namespace, key)` of each row.
fn rows_of(rows: &[IdentifierRow]) -> impl Iterator<Item = (&str, &str)> {
    rows.iter().map(|r| (r.entity.as_str(), r.key.as_str()))
}

fn taken(ns: &str, global_id: &str, key: &str, holder: &str) -> Error {
    Error::Data(format!(
        "identifier mapping of `{ns}`: global identifier `{global_id}` (pre-assigned to key {key}) \
         is already the identifier of key {holder}; each identifier names one row. Correct the \
         pre-assigned value (global_id_column or the identifier_mapping row), then restart"
    ))
}

#[cfg(test)]
mod tests {
    use serde_json::json;
    use skein_sql::{ColumnInfo, TableInfo};

    use super::*;

    /// `contact (contact_id <key_type>, alternate_contact_id <key_type>,
    /// address_id int4)` and `address (address_id int4)`, with `extra`
    /// columns on contact and `extra_tables`.
    pub(super) fn catalog(
        key: (&str, &str),
        extra: &[&str],
        extra_tables: &[TableInfo],
    ) -> Catalog {
        let col = |name: &str, (data_type, type_name): (&str, &str)| ColumnInfo {
            name: name.into(),
            data_type: data_type.into(),
            type_name: type_name.into(),
            nullable: true,
        };
        let mut columns = vec![
            col("contact_id", key),
            col("alternate_contact_id", key),
            col("address_id", ("integer", "int4")),
        ];
        columns.extend(extra.iter().map(|c| col(c, ("text", "text"))));
        let mut cat = Catalog::default();
        cat.insert(TableInfo {
            schema: "public".into(),
            table: "contact".into(),
            columns,
            primary_key: vec!["contact_id".into()],
            replica_identity: 'd',
        });
        cat.insert(TableInfo {
            schema: "public".into(),
            table: "address".into(),
            columns: vec![col("address_id", ("integer", "int4"))],
            primary_key: vec!["address_id".into()],
            replica_identity: 'd',
        });
        for t in extra_tables {
            cat.insert(t.clone());
        }
        cat
    }

    /// A config of one `contact` entity: `entity` is its YAML tail.
    pub(super) fn config(entity: &str) -> Config {
        Config::from_yaml(
            &format!(
                "source: {{ kind: postgres, url: x }}\nevents: {{ source_root: /s, type_root: t }}\n\
                 entities:\n  - name: contact\n    table: contact\n    identifier_mapping: true\n{entity}"
            ),
            "t",
        )
        .unwrap()
    }

    const REF: &str = "    mappings: [{ name: alternate_contact_id, table: contact }]\n";

    fn plan(cfg: &Config, cat: &Catalog) -> Result<Plan> {
        Plan::new(cfg, &cfg.entities[0], cat)
    }

    #[test]
    fn the_carry_over_keeps_the_entitys_id_and_refuses_contradictions() {
        let moves = [
            ("a".to_string(), "public.t".to_string()),
            ("b".to_string(), "public.t".to_string()),
        ];
        assert_eq!(
            carry_over_checks(&moves),
            vec![
                ("a", "public.t", false),
                ("b", "public.t", false),
                ("b", "a", true)
            ]
        );
        let c = |k1: &str, g1: &str, k2: &str, g2: &str| {
            vec![(k1.into(), g1.into(), k2.into(), g2.into())]
        };
        let same_key = c("[\"1\"]", "E", "[\"1\"]", "R");
        assert_eq!(
            judge_carry_over("a", "public.t", false, &same_key).unwrap(),
            1
        );
        let e = judge_carry_over("b", "a", true, &same_key)
            .unwrap_err()
            .to_string();
        assert!(e.contains("`E`") && e.contains("`R`"), "{e}");
        let same_id = c("[\"1\"]", "E", "[\"2\"]", "E");
        let e = judge_carry_over("a", "public.t", false, &same_id)
            .unwrap_err()
            .to_string();
        assert!(e.contains("[\"2\"]"), "{e}");
    }

    #[test]
    fn a_char_key_reference_is_padded_as_the_stream_sends_it() {
        let cfg = config(REF);
        let p = plan(&cfg, &catalog(("character(4)", "bpchar"), &[], &[])).unwrap();
        let data = json!({"contact_id": "1", "alternate_contact_id": "2"});
        assert_eq!(
            p.wanted(&data),
            vec![(namespace("public", "contact"), r#"["2   "]"#.to_string())]
        );
    }

    fn refused(cfg: &Config, cat: &Catalog) -> String {
        plan(cfg, cat).unwrap_err().to_string()
    }

    #[test]
    fn a_mapping_to_a_missing_or_composite_key_table_is_refused() {
        let cat = catalog(("integer", "int4"), &[], &[]);
        let cfg = config(&REF.replace("table: contact", "table: contacts"));
        let e = check(&cfg, &cat).unwrap_err().to_string();
        assert!(
            e.contains("mappings `alternate_contact_id`") && e.contains("contacts"),
            "{e}"
        );
        let pair = TableInfo {
            schema: "public".into(),
            table: "pair".into(),
            columns: vec![],
            primary_key: vec!["a".into(), "b".into()],
            replica_identity: 'd',
        };
        let cat = catalog(("integer", "int4"), &[], &[pair]);
        let e = refused(&config(&REF.replace("table: contact", "table: pair")), &cat);
        assert!(
            e.contains("one-column key") && e.contains("public.pair"),
            "{e}"
        );
    }

    #[test]
    fn a_mapped_join_keyed_otherwise_than_its_tables_entity_is_refused() {
        let cfg = Config::from_yaml(
            "source: { kind: postgres, url: x }\nevents: { source_root: /s, type_root: t }\n\
             entities:\n  - name: address\n    table: address\n    identifier_mapping: true\n\
             \x20 - name: contact\n    table: contact\n    joins:\n      - name: address\n\
             \x20       table: address\n        key: [street]\n        identifier_mapping: true\n\
             \x20       on: [{ name: address_id, to_column: address_id }]\n",
            "t",
        )
        .unwrap();
        let cat = catalog(("integer", "int4"), &[], &[]);
        let e = Plan::new(&cfg, &cfg.entities[1], &cat)
            .unwrap_err()
            .to_string();
        assert!(e.contains("[\"street\"]") && e.contains("`key:`"), "{e}");
    }

    #[test]
    fn a_global_column_of_the_source_is_not_overwritten() {
        let e = refused(
            &config(""),
            &catalog(("integer", "int4"), &["global_id"], &[]),
        );
        assert!(e.contains("`global_id`"), "{e}");
        let cat = catalog(("integer", "int4"), &["global_alternate_contact_id"], &[]);
        let e = refused(&config(REF), &cat);
        assert!(e.contains("`global_alternate_contact_id`"), "{e}");
    }

    #[test]
    fn a_key_type_that_cannot_be_matched_is_refused() {
        let cfg = config(REF);
        for ty in [
            ("double precision", "float8"),
            ("timestamp with time zone", "timestamptz"),
            ("bytea", "bytea"),
        ] {
            let e = plan(&cfg, &catalog(ty, &[], &[])).unwrap_err().to_string();
            assert!(
                e.contains("alternate_contact_id") && e.contains(ty.0),
                "{e}"
            );
        }
    }
}
