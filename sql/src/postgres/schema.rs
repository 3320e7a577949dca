//! Schema changes under a running pipeline: what a catalog read again means
//! for the config. Pure: the callers fetch the catalogs (the extractor on a
//! changed Relation message, each applier in every batch's snapshot) and
//! act on the answer.
//!
//! A column the config does not name may come and go: the hydration
//! queries are rendered again from the new catalog. A column the config
//! names must stay, and one a key, a join or the logical delete relies on
//! must keep its value format ([`ValueFormat`]): keys and join values
//! travel as text, so `1` becoming `1.00` would make every aggregate look
//! new. Either stops the pipeline with [`schema_stop`]'s message.

use skein_common::config::{Config, EntityConfig, TableNode};

use super::{check_catalog, SqlError};
use crate::catalog::{Catalog, ColumnInfo};

/// The form a column's values take in event JSON and in change records
/// (the classes of [`super::json_expr`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ValueFormat {
    /// smallint, integer, bigint, real, double precision.
    Number,
    /// boolean.
    Bool,
    /// json, jsonb.
    Json,
    /// numeric, money: the exact decimal as a string.
    Decimal,
    /// timestamptz, UTC.
    TimestampTz,
    /// timestamp without zone.
    Timestamp,
    /// date.
    Date,
    /// bytea, base64.
    Bytes,
    /// The PostgreSQL text form (text, varchar, uuid, anything else).
    Text,
}

/// The value format of a short type name (`int4`, `timestamptz`).
pub fn value_format(type_name: &str) -> ValueFormat {
    match type_name {
        "int2" | "int4" | "int8" | "float4" | "float8" => ValueFormat::Number,
        "bool" => ValueFormat::Bool,
        "json" | "jsonb" => ValueFormat::Json,
        "numeric" | "money" => ValueFormat::Decimal,
        "timestamptz" => ValueFormat::TimestampTz,
        "timestamp" => ValueFormat::Timestamp,
        "date" => ValueFormat::Date,
        "bytea" => ValueFormat::Bytes,
        _ => ValueFormat::Text,
    }
}

/// The columns of node `n` of entity `e` that the config names, each with
/// the field that names it.
pub fn named_columns<'a>(
    e: &'a EntityConfig,
    nodes: &'a [TableNode],
    n: &'a TableNode,
) -> Vec<(&'a str, &'static str)> {
    let mut want: Vec<(&str, &'static str)> = vec![];
    for c in &n.include_columns {
        want.push((c, "include_columns"));
    }
    for c in &n.exclude_columns {
        want.push((c, "exclude_columns"));
    }
    for c in &n.exclude_columns_from_etag {
        want.push((c, "exclude_columns_from_etag"));
    }
    for c in n.key.iter().flatten() {
        want.push((c, "key"));
    }
    for on in &n.on {
        want.push((&on.name, "on.name"));
    }
    for m in &n.mappings {
        want.push((&m.name, "mappings.name"));
    }
    for child in nodes.iter().filter(|c| c.parent == Some(n.index)) {
        for on in &child.on {
            want.push((&on.to_column, "on.to_column"));
        }
    }
    if n.index == 0 {
        if let Some(d) = &e.is_deleted_column {
            want.push((d, "is_deleted_column"));
        }
        for c in &e.include_columns_on_delete {
            want.push((c, "include_columns_on_delete"));
        }
    }
    want
}

/// Fields whose columns must keep their value format.
const FORMAT_MATTERS: [&str; 4] = ["key", "on.name", "on.to_column", "is_deleted_column"];

/// What stops a running pipeline when the catalog changed from `old` to
/// `new`: everything [`check_catalog`] finds in `new`, a column a key, join
/// or logical delete relies on whose [`ValueFormat`] changed, and a
/// primary key (of a node without a configured `key`) that changed.
/// Empty: go on with `new`.
pub fn check_schema_change(cfg: &Config, old: &Catalog, new: &Catalog) -> Vec<SqlError> {
    check_schema_change_by(cfg, old, new, |c| value_format(&c.type_name))
}

/// [`check_schema_change`] with the dialect's own reading of a column's
/// type: `text_form(column)` is what its values look like as text (keys
/// and join values travel as text); a column a key, join or logical delete
/// relies on whose text form differs between `old` and `new` is retyped.
/// The rest of the check is the same for every dialect.
pub fn check_schema_change_by<F: PartialEq>(
    cfg: &Config,
    old: &Catalog,
    new: &Catalog,
    text_form: impl Fn(&ColumnInfo) -> F,
) -> Vec<SqlError> {
    let mut errors = check_catalog(cfg, new);
    for e in &cfg.entities {
        let nodes = e.nodes();
        for n in &nodes {
            let (Some(was), Some(now)) = (old.node(n), new.node(n)) else {
                continue;
            };
            let (key_was, key_now) = (old.key_columns(n), new.key_columns(n));
            if n.key.is_none() && key_was != key_now && !key_now.is_empty() {
                errors.push(SqlError::KeyChanged {
                    entity: e.name.clone(),
                    schema: n.schema.clone(),
                    table: n.table.clone(),
                    from: key_was.clone(),
                    to: key_now,
                });
            }
            let mut relied_on: Vec<(&str, &'static str)> = named_columns(e, &nodes, n)
                .into_iter()
                .filter(|(_, f)| FORMAT_MATTERS.contains(f))
                .collect();
            relied_on.extend(key_was.iter().map(|c| (c.as_str(), "key")));
            let mut seen = std::collections::HashSet::new();
            for (c, field) in relied_on {
                let (Some(a), Some(b)) = (was.column(c), now.column(c)) else {
                    continue;
                };
                if seen.insert(c) && text_form(a) != text_form(b) {
                    errors.push(SqlError::RetypedColumn {
                        entity: e.name.clone(),
                        schema: n.schema.clone(),
                        table: n.table.clone(),
                        column: c.to_string(),
                        field,
                        from: a.data_type.clone(),
                        to: b.data_type.clone(),
                    });
                }
            }
        }
    }
    errors.dedup();
    errors
}

impl SqlError {
    /// What to do about it, in the config's or the source's terms.
    pub fn fix(&self) -> String {
        match self {
            SqlError::MissingTable {
                entity,
                schema,
                table,
            } => format!("create {schema}.{table} again, or take it out of entity `{entity}`"),
            SqlError::MissingColumn {
                entity,
                schema,
                table,
                column,
                field,
            } => format!(
                "add column `{column}` to {schema}.{table} again, or take `{column}` out of \
                 `{field}` of entity `{entity}` in the config"
            ),
            SqlError::RetypedColumn {
                schema,
                table,
                column,
                from,
                ..
            } => format!(
                "ALTER TABLE {schema}.{table} ALTER COLUMN {column} TYPE {from}; or, if the new \
                 type is meant and its values keep their text form, start skein again (it takes \
                 the catalog as it finds it at start-up)"
            ),
            SqlError::KeyChanged { schema, table, .. } => format!(
                "restore the primary key of {schema}.{table}, or set `key:` for it in the config"
            ),
            SqlError::NoKey { schema, table, .. } => {
                format!("add a primary key to {schema}.{table}, or set `key:` for it in the config")
            }
        }
    }
}

/// The message and the fix a pipeline stops with when the source's schema
/// changed under it (`problems` from [`check_schema_change`], not empty).
pub fn schema_stop(problems: &[SqlError]) -> (String, String) {
    schema_stop_with(
        problems.iter().map(ToString::to_string).collect(),
        problems.iter().map(SqlError::fix).collect(),
    )
}

/// [`schema_stop`] for problems found otherwise (a table gone before its
/// catalog could be read): what is wrong, and what to do about each.
pub fn schema_stop_with(problems: Vec<String>, fixes: Vec<String>) -> (String, String) {
    schema_stop_then(
        problems,
        fixes,
        "run `skein validate` (and the output of `skein sql source` when a table left the \
         publication, as a DROP COLUMN ... CASCADE makes it)",
    )
}

/// The stop of [`schema_stop_with`] in any dialect: `then` is what to run
/// after the fixes, before starting skein again.
pub fn schema_stop_then(
    problems: Vec<String>,
    mut fixes: Vec<String>,
    then: &str,
) -> (String, String) {
    let message = format!(
        "the source's schema changed under the running pipeline: {}",
        problems.join("; ")
    );
    fixes.dedup();
    let fix = format!(
        "{};\nthen {then} and start skein again. The batch that met the change was not \
         applied: it is read again, nothing is lost.",
        fixes.join(";\n")
    );
    (message, fix)
}

/// What changed between two catalogs, for the log: `schema.table` with its
/// added (`+col type`), dropped (`-col`) and retyped (`~col type`) columns.
pub fn describe_change(old: &Catalog, new: &Catalog) -> Vec<String> {
    let mut out = vec![];
    for (k, now) in &new.tables {
        let Some(was) = old.tables.get(k) else {
            out.push(format!("{}.{}: new", k.0, k.1));
            continue;
        };
        let mut parts = vec![];
        for c in &now.columns {
            match was.column(&c.name) {
                None => parts.push(format!("+{} {}", c.name, c.data_type)),
                Some(w) if w.data_type != c.data_type => {
                    parts.push(format!("~{} {}", c.name, c.data_type))
                }
                Some(_) => {}
            }
        }
        for c in was.columns.iter().filter(|c| now.column(&c.name).is_none()) {
            parts.push(format!("-{}", c.name));
        }
        if !parts.is_empty() {
            out.push(format!("{}.{}: {}", k.0, k.1, parts.join(" ")));
        }
    }
    for k in old.tables.keys().filter(|k| !new.tables.contains_key(*k)) {
        out.push(format!("{}.{}: gone", k.0, k.1));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalog::TableInfo;

    fn col(name: &str, ty: &str) -> ColumnInfo {
        ColumnInfo {
            name: name.into(),
            data_type: ty.into(),
            type_name: ty.into(),
            nullable: true,
        }
    }

    fn catalog(customer: &[(&str, &str)], address: &[(&str, &str)]) -> Catalog {
        let mut c = Catalog::default();
        for (t, cols, pk) in [("customer", customer, "id"), ("address", address, "id")] {
            c.insert(TableInfo {
                schema: "public".into(),
                table: t.into(),
                columns: cols.iter().map(|(n, ty)| col(n, ty)).collect(),
                primary_key: vec![pk.into()],
                replica_identity: 'f',
            });
        }
        c
    }

    fn cfg() -> Config {
        Config::from_yaml(
            r#"
source: { kind: postgres, url: x }
entities:
  - name: customer
    table: customer
    is_deleted_column: is_deleted
    include_columns_on_delete: [name]
    joins:
      - { name: addresses, table: address, on: [{ name: customer_id, to_column: id }] }
"#,
            "t",
        )
        .unwrap()
    }

    const CUSTOMER: [(&str, &str); 4] = [
        ("id", "int4"),
        ("name", "text"),
        ("email", "text"),
        ("is_deleted", "bool"),
    ];
    const ADDRESS: [(&str, &str); 3] = [("id", "int4"), ("customer_id", "int4"), ("city", "text")];

    #[test]
    fn columns_the_config_does_not_name_may_come_and_go() {
        let old = catalog(&CUSTOMER, &ADDRESS);
        let new = catalog(
            &[
                ("id", "int8"),
                ("name", "varchar"),
                ("is_deleted", "bool"),
                ("tier", "text"),
            ],
            &[("id", "int4"), ("customer_id", "int4")],
        );
        assert_eq!(check_schema_change(&cfg(), &old, &new), vec![]);
        assert_eq!(
            describe_change(&old, &new),
            vec![
                "public.address: -city",
                "public.customer: ~id int8 ~name varchar +tier text -email"
            ]
        );
    }

    #[test]
    fn a_named_column_dropped_or_reformatted_stops_naming_the_field() {
        let old = catalog(&CUSTOMER, &ADDRESS);
        let new = catalog(
            &[("id", "int4"), ("email", "text"), ("is_deleted", "text")],
            &[("id", "numeric"), ("customer_id", "int4")],
        );
        let errors = check_schema_change(&cfg(), &old, &new);
        let texts: Vec<String> = errors.iter().map(ToString::to_string).collect();
        assert_eq!(
            texts,
            vec![
                "column `name` of public.customer (entity `customer`, include_columns_on_delete) does not exist",
                "column `is_deleted` of public.customer (entity `customer`, is_deleted_column) changed type from bool to text, which gives its values another form",
                "column `id` of public.address (entity `customer`, key) changed type from int4 to numeric, which gives its values another form",
            ]
        );
        let (message, fix) = schema_stop(&errors);
        assert!(message
            .starts_with("the source's schema changed under the running pipeline: column `name`"));
        assert!(fix.contains("take `name` out of `include_columns_on_delete` of entity `customer`"));
        assert!(fix.contains("ALTER TABLE public.customer ALTER COLUMN is_deleted TYPE bool"));
        assert!(fix.contains("skein validate"));
    }

    #[test]
    fn a_changed_primary_key_stops() {
        let old = catalog(&CUSTOMER, &ADDRESS);
        let mut new = old.clone();
        new.tables
            .get_mut(&("public".into(), "address".into()))
            .unwrap()
            .primary_key = vec!["id".into(), "customer_id".into()];
        let errors = check_schema_change(&cfg(), &old, &new);
        assert!(
            matches!(&errors[..], [SqlError::KeyChanged { table, .. }] if table == "address"),
            "{errors:?}"
        );
    }

    #[test]
    fn formats_follow_the_json_classes() {
        assert_eq!(value_format("int4"), value_format("int8"));
        assert_eq!(value_format("varchar"), value_format("uuid"));
        assert_ne!(value_format("int4"), value_format("numeric"));
        assert_ne!(value_format("bool"), value_format("text"));
    }
}
