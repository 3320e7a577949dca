//! `entities:`: an aggregate's root table and its joined children.

use serde::{Deserialize, Serialize};

/// One aggregate: a root table and its joins.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct EntityConfig {
    /// Entity name (event type segment, transport key prefix).
    pub name: String,
    /// Root table schema.
    #[serde(default = "default_schema")]
    pub schema: String,
    /// Root table.
    pub table: String,
    /// Key columns; defaults to the table's primary key (read from the source).
    pub key: Option<Vec<String>>,
    /// Only these columns (plus the key) go into the event; empty = all.
    #[serde(default)]
    pub include_columns: Vec<String>,
    /// These columns never go into the event.
    #[serde(default)]
    pub exclude_columns: Vec<String>,
    /// Columns left out of the version hash (e.g. a row version).
    #[serde(default)]
    pub exclude_columns_from_etag: Vec<String>,
    /// A boolean column meaning "logically deleted".
    pub is_deleted_column: Option<String>,
    /// Columns kept in the payload of a delete event besides the key.
    #[serde(default)]
    pub include_columns_on_delete: Vec<String>,
    /// Global identifier mapping (nTangle's): each root key is mapped to a
    /// global identifier kept in the sidecar's `identifier_mapping` table
    /// (a UUID v7 made when the aggregate first publishes, unless one is
    /// pre-assigned there or by `global_id_column`); events carry it as
    /// `data.global_id` and the `globalid` extension.
    #[serde(default)]
    pub identifier_mapping: bool,
    /// A root column whose value is the aggregate's pre-assigned global
    /// identifier, taken when the aggregate first publishes (then kept in
    /// the mapping, whatever the column holds later). Needs
    /// `identifier_mapping: true`.
    pub global_id_column: Option<String>,
    /// Root columns that reference another table's row, each mapped to
    /// that row's global identifier (nTangle's `mappings`): the event
    /// carries `global_<column>` beside the column.
    #[serde(default)]
    pub mappings: Vec<ColumnMapping>,
    /// Child tables, any depth.
    #[serde(default)]
    pub joins: Vec<JoinConfig>,
}

fn default_schema() -> String {
    "public".into()
}

/// How many child rows a join yields.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Cardinality {
    /// An array of child objects.
    #[default]
    OneToMany,
    /// One child object or `null`.
    OneToOne,
}

/// Whether a join is tracked by CDC, and what a missing row does.
///
/// nTangle's vocabulary (`type: Cdc|Inner|Left`): a `cdc` join's table is
/// captured; `inner` and `left` are lookups, read when the aggregate is
/// hydrated but never captured, so a change of a lookup table alone
/// publishes nothing (the next change of its aggregate carries it).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum JoinType {
    /// Tracked: a change of this table changes its root. Its rows are the
    /// parent's children when they exist (`[]` / `null` when none do).
    #[default]
    Cdc,
    /// A lookup that must match: a parent row with no matching row is
    /// left out, as SQL's inner join leaves it out: a child row drops out
    /// of its parent's array (or becomes `null`), and a root that does not
    /// match is no aggregate (a consumer that had it gets a delete).
    Inner,
    /// A lookup that may match: the parent is kept, the join is `null`
    /// (`one_to_one`) or `[]` (`one_to_many`) when no row matches.
    Left,
}

/// One join column pair.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct JoinOn {
    /// Column of this (child) table.
    pub name: String,
    /// Column of the table joined to.
    pub to_column: String,
}

/// A child table of an entity.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct JoinConfig {
    /// Property name in the entity JSON.
    pub name: String,
    /// Schema; defaults to the entity's schema.
    pub schema: Option<String>,
    /// Table.
    pub table: String,
    /// The parent: the root table, or another join's name or table; defaults to the root.
    pub join_to: Option<String>,
    /// Join columns (child column → parent column).
    pub on: Vec<JoinOn>,
    /// `one_to_many` (array) or `one_to_one` (object or null).
    #[serde(default)]
    pub cardinality: Cardinality,
    /// `cdc` (tracked), `inner` or `left` (lookups, hydration only; see
    /// [`JoinType`]).
    #[serde(default, rename = "type")]
    pub join_type: JoinType,
    /// Key columns; default the table's primary key. Orders child arrays.
    pub key: Option<Vec<String>>,
    /// Only these columns go into the event; empty = all.
    #[serde(default)]
    pub include_columns: Vec<String>,
    /// These columns never go into the event.
    #[serde(default)]
    pub exclude_columns: Vec<String>,
    /// Columns left out of the version hash.
    #[serde(default)]
    pub exclude_columns_from_etag: Vec<String>,
    /// Each child row's key is mapped to a global identifier, carried as
    /// its `global_id` (nTangle's join `identifierMapping`).
    #[serde(default)]
    pub identifier_mapping: bool,
    /// Columns of this table that reference another table's row, each
    /// mapped to that row's global identifier (`global_<column>`).
    #[serde(default)]
    pub mappings: Vec<ColumnMapping>,
}

/// A column that holds the key of a row of another (or the same) table,
/// mapped to that row's global identifier (nTangle's `JoinMapping` /
/// `TableMapping`).
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ColumnMapping {
    /// The referencing column.
    pub name: String,
    /// The referenced table's schema; defaults to the entity's.
    pub schema: Option<String>,
    /// The referenced table (its key is one column: the referencing one's value).
    pub table: String,
}

/// One table of an entity with its parent resolved: the tree that the
/// resolver, the hydrator and the SQL generator walk.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TableNode {
    /// Index in [`EntityConfig::nodes`]; 0 is the root.
    pub index: usize,
    /// Parent node index (`None` for the root).
    pub parent: Option<usize>,
    /// Depth: 0 root, 1 direct child, 2 grandchild…
    pub depth: usize,
    /// JSON property name (the entity name for the root).
    pub name: String,
    /// Schema.
    pub schema: String,
    /// Table.
    pub table: String,
    /// Join columns to the parent (empty for the root).
    pub on: Vec<JoinOn>,
    /// Cardinality below the parent.
    pub cardinality: Cardinality,
    /// `cdc` (captured) or a lookup (`inner`, `left`); the root is `cdc`.
    pub join_type: JoinType,
    /// Configured key columns, if any.
    pub key: Option<Vec<String>>,
    /// Include list (empty = all).
    pub include_columns: Vec<String>,
    /// Exclude list.
    pub exclude_columns: Vec<String>,
    /// Excluded from the etag.
    pub exclude_columns_from_etag: Vec<String>,
    /// Whether each row's key maps to a global identifier.
    pub identifier_mapping: bool,
    /// Referencing columns mapped to the referenced rows' identifiers,
    /// with the referenced table's schema resolved.
    pub mappings: Vec<ColumnMapping>,
}

impl TableNode {
    /// `schema.table`.
    pub fn qualified(&self) -> String {
        format!("{}.{}", self.schema, self.table)
    }

    /// Whether changes of this table are captured (a `cdc` join or the root).
    pub fn tracked(&self) -> bool {
        self.join_type == JoinType::Cdc
    }
}

impl EntityConfig {
    /// The entity's tables, root first, each with its parent resolved.
    /// Assumes [`Config::validate`] passed (unresolvable parents map to the root).
    pub fn nodes(&self) -> Vec<TableNode> {
        let mut nodes = vec![TableNode {
            index: 0,
            parent: None,
            depth: 0,
            name: self.name.clone(),
            schema: self.schema.clone(),
            table: self.table.clone(),
            on: vec![],
            cardinality: Cardinality::OneToOne,
            join_type: JoinType::Cdc,
            key: self.key.clone(),
            include_columns: self.include_columns.clone(),
            exclude_columns: self.exclude_columns.clone(),
            exclude_columns_from_etag: self.exclude_columns_from_etag.clone(),
            identifier_mapping: self.identifier_mapping,
            mappings: self.resolved_mappings(&self.mappings),
        }];
        for (i, j) in self.joins.iter().enumerate() {
            let parent = self.resolve_parent(i).unwrap_or(0);
            let depth = nodes[parent].depth + 1;
            nodes.push(TableNode {
                index: i + 1,
                parent: Some(parent),
                depth,
                name: j.name.clone(),
                schema: j.schema.clone().unwrap_or_else(|| self.schema.clone()),
                table: j.table.clone(),
                on: j.on.clone(),
                cardinality: j.cardinality,
                join_type: j.join_type,
                key: j.key.clone(),
                include_columns: j.include_columns.clone(),
                exclude_columns: j.exclude_columns.clone(),
                exclude_columns_from_etag: j.exclude_columns_from_etag.clone(),
                identifier_mapping: j.identifier_mapping,
                mappings: self.resolved_mappings(&j.mappings),
            });
        }
        nodes
    }

    /// `mappings` with each referenced table's schema filled in.
    fn resolved_mappings(&self, mappings: &[ColumnMapping]) -> Vec<ColumnMapping> {
        mappings
            .iter()
            .map(|m| ColumnMapping {
                schema: Some(m.schema.clone().unwrap_or_else(|| self.schema.clone())),
                ..m.clone()
            })
            .collect()
    }

    /// Node index of join `i`'s parent; joins may only refer to the root or
    /// to joins declared before them.
    pub(crate) fn resolve_parent(&self, i: usize) -> Option<usize> {
        let j = &self.joins[i];
        let target = match &j.join_to {
            None => return Some(0),
            Some(t) => t,
        };
        if *target == self.table || *target == self.name {
            return Some(0);
        }
        self.joins[..i]
            .iter()
            .rposition(|p| p.name == *target || p.table == *target)
            .map(|p| p + 1)
    }
}
