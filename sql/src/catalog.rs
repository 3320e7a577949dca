//! What skein knows about the source's tables: fetched once at start-up by
//! the source adapter, then passed around as plain data.

use std::collections::BTreeMap;

use skein_common::config::TableNode;

/// One column.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ColumnInfo {
    /// Column name.
    pub name: String,
    /// Type as the server prints it, without modifiers (`integer`,
    /// `character varying`, `timestamp with time zone`) except a
    /// PostgreSQL `character(n)`'s length, which its key text is padded to;
    /// used in casts.
    pub data_type: String,
    /// Short type name (`int4`, `varchar`, `timestamptz`); decides the JSON format.
    pub type_name: String,
    /// Whether NULL is allowed.
    pub nullable: bool,
}

/// One table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TableInfo {
    /// Schema.
    pub schema: String,
    /// Table name.
    pub table: String,
    /// Columns in table order.
    pub columns: Vec<ColumnInfo>,
    /// Primary-key columns in key order (empty: no primary key).
    pub primary_key: Vec<String>,
    /// `d` default, `f` full, `i` index, `n` nothing.
    pub replica_identity: char,
}

impl TableInfo {
    /// Looks a column up.
    pub fn column(&self, name: &str) -> Option<&ColumnInfo> {
        self.columns.iter().find(|c| c.name == name)
    }
}

/// All tables skein reads, keyed by `(schema, table)`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Catalog {
    /// The tables.
    pub tables: BTreeMap<(String, String), TableInfo>,
}

impl Catalog {
    /// Adds a table.
    pub fn insert(&mut self, t: TableInfo) {
        self.tables.insert((t.schema.clone(), t.table.clone()), t);
    }

    /// Looks a table up.
    pub fn table(&self, schema: &str, table: &str) -> Option<&TableInfo> {
        self.tables.get(&(schema.to_string(), table.to_string()))
    }

    /// The table behind a node. Callers check presence with `skein validate`
    /// first; a missing table here is a bug in the caller, reported as `None`.
    pub fn node(&self, node: &TableNode) -> Option<&TableInfo> {
        self.table(&node.schema, &node.table)
    }

    /// Key columns of a node: the configured key, else the primary key.
    pub fn key_columns(&self, node: &TableNode) -> Vec<String> {
        if let Some(k) = &node.key {
            return k.clone();
        }
        self.node(node)
            .map(|t| t.primary_key.clone())
            .unwrap_or_default()
    }

    /// Columns of a node that go into the event: include list (plus key) or
    /// all columns, minus the exclude list, in table order.
    pub fn event_columns(&self, node: &TableNode) -> Vec<&ColumnInfo> {
        let Some(t) = self.node(node) else {
            return vec![];
        };
        let key = self.key_columns(node);
        t.columns
            .iter()
            .filter(|c| {
                (node.include_columns.is_empty()
                    || node.include_columns.contains(&c.name)
                    || key.contains(&c.name))
                    && !node.exclude_columns.contains(&c.name)
            })
            .collect()
    }
}
