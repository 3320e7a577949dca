//! Schema changes on SQL Server: the T-SQL that finds them
//! (`cdc.ddl_history`) and what a SQL Server type means for the check
//! PostgreSQL runs too ([`crate::postgres::check_schema_change_by`]: the
//! same rules, this dialect's types and fixes).
//!
//! CDC records each DDL statement on a table under capture in
//! `cdc.ddl_history`, once per capture instance, with the LSN of its
//! commit. Its capture instances go on: a dropped column reads as NULL in
//! later change rows, a retyped captured column is retyped in the change
//! table too, and a column added later is never captured by an instance
//! created before. So nothing fails when a key or join column goes: the
//! change rows just lose it, which is why the extractor looks.

use skein_common::config::Config;

use super::{qi, ql};
use crate::catalog::{Catalog, ColumnInfo};
use crate::postgres::{check_schema_change_by, schema_stop_then, SqlError, ValueFormat};

/// DDL committed in `(@P1, @P2]` on the tables of the capture instances
/// `@P3…` (`n` of them): `capture_instance, ddl_lsn, ddl_command`, in
/// commit order. One row per capture instance of the table.
pub fn ddl_history_sql(n: usize) -> String {
    let names: Vec<String> = (3..3 + n).map(|i| format!("@P{i}")).collect();
    format!(
        "SELECT ct.capture_instance, h.ddl_lsn, h.ddl_command\n\
         FROM cdc.ddl_history h\n\
         JOIN cdc.change_tables ct ON ct.object_id = h.object_id\n\
         WHERE h.ddl_lsn > @P1 AND h.ddl_lsn <= @P2 AND ct.capture_instance IN ({})\n\
         ORDER BY h.ddl_lsn, ct.capture_instance",
        names.join(", ")
    )
}

/// The value format of a SQL Server base type (`TYPE_NAME(system_type_id)`),
/// as the README's table gives them.
pub fn value_format(type_name: &str) -> ValueFormat {
    match type_name {
        "tinyint" | "smallint" | "int" | "bigint" | "real" | "float" => ValueFormat::Number,
        "bit" => ValueFormat::Bool,
        "decimal" | "numeric" | "money" | "smallmoney" => ValueFormat::Decimal,
        "datetimeoffset" => ValueFormat::TimestampTz,
        "datetime2" | "datetime" | "smalldatetime" => ValueFormat::Timestamp,
        "date" => ValueFormat::Date,
        // `rowversion` is `timestamp` to TYPE_NAME.
        "binary" | "varbinary" | "image" | "timestamp" => ValueFormat::Bytes,
        _ => ValueFormat::Text,
    }
}

/// What a column's values look like as text: the value format, and for an
/// exact decimal its scale (`decimal(10,2)` gives `1.00`, `decimal(12,4)`
/// `1.0000`: another key). `money` is read as `decimal(19,4)`.
pub fn text_form(c: &ColumnInfo) -> (ValueFormat, Option<u32>) {
    let format = value_format(&c.type_name);
    let scale = match c.type_name.as_str() {
        "money" | "smallmoney" => Some(4),
        "decimal" | "numeric" => c
            .data_type
            .rsplit_once(',')
            .and_then(|(_, s)| s.trim_end_matches(')').trim().parse().ok()),
        _ => None,
    };
    (format, scale)
}

/// [`crate::postgres::check_schema_change`] for SQL Server's types.
pub fn check_schema_change(cfg: &Config, old: &Catalog, new: &Catalog) -> Vec<SqlError> {
    check_schema_change_by(cfg, old, new, text_form)
}

/// What to do about a problem, in T-SQL where PostgreSQL's fix names
/// PostgreSQL syntax, and with what CDC needs when a captured column (a key
/// or a join column) comes back.
pub fn fix(problem: &SqlError) -> String {
    match problem {
        SqlError::MissingColumn {
            entity,
            schema,
            table,
            column,
            field,
        } if matches!(*field, "key" | "on.name") => format!(
            "take `{column}` out of `{field}` of entity `{entity}` in the config, or add column \
             `{column}` to {schema}.{table} again and capture it: a capture instance never \
             captures a column added after it was created, so create another one with the key \
             and join columns, EXEC sys.sp_cdc_enable_table @source_schema = {s}, @source_name \
             = {t}, @role_name = NULL, @capture_instance = {ci}, @supports_net_changes = 0, \
             @captured_column_list = N'<the key and join columns>'; (skein follows both \
             instances across the switch; drop the old one once the marker is past the new \
             one's start)",
            s = ql(schema),
            t = ql(table),
            ci = ql(&format!("{schema}_{table}_v2")),
        ),
        SqlError::RetypedColumn {
            schema,
            table,
            column,
            from,
            ..
        } => format!(
            "ALTER TABLE {}.{} ALTER COLUMN {} {from}; (with its NULL or NOT NULL as before) or, \
             if the new type is meant and its values keep their text form, start skein again \
             (it takes the catalog as it finds it at start-up)",
            qi(schema),
            qi(table),
            qi(column),
        ),
        other => other.fix(),
    }
}

/// The message and the fix a SQL Server pipeline stops with when the
/// source's schema changed under it (`problems` from
/// [`check_schema_change`], not empty).
pub fn schema_stop(problems: &[SqlError]) -> (String, String) {
    schema_stop_then(
        problems.iter().map(ToString::to_string).collect(),
        problems.iter().map(fix).collect(),
        "run `skein validate`",
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalog::TableInfo;

    fn col(name: &str, type_name: &str, data_type: &str) -> ColumnInfo {
        ColumnInfo {
            name: name.into(),
            type_name: type_name.into(),
            data_type: data_type.into(),
            nullable: true,
        }
    }

    fn catalog(customer: Vec<ColumnInfo>) -> Catalog {
        let mut c = Catalog::default();
        c.insert(TableInfo {
            schema: "dbo".into(),
            table: "customer".into(),
            columns: customer,
            primary_key: vec!["id".into()],
            replica_identity: 'd',
        });
        c.insert(TableInfo {
            schema: "dbo".into(),
            table: "address".into(),
            columns: vec![col("id", "int", "int"), col("customer_id", "int", "int")],
            primary_key: vec!["id".into()],
            replica_identity: 'd',
        });
        c
    }

    fn cfg() -> Config {
        Config::from_yaml(
            r#"
source: { kind: sqlserver, url: x }
entities:
  - name: customer
    schema: dbo
    table: customer
    is_deleted_column: is_deleted
    joins:
      - { name: addresses, schema: dbo, table: address, on: [{ name: customer_id, to_column: id }] }
"#,
            "t",
        )
        .unwrap()
    }

    #[test]
    fn sql_server_types_keep_or_change_their_text_form() {
        let old = catalog(vec![
            col("id", "int", "int"),
            col("is_deleted", "bit", "bit"),
            col("name", "nvarchar", "nvarchar(50)"),
        ]);
        // int -> bigint, nvarchar(50) -> nvarchar(max), a new column: fine.
        let wider = catalog(vec![
            col("id", "bigint", "bigint"),
            col("is_deleted", "bit", "bit"),
            col("name", "nvarchar", "nvarchar(max)"),
            col("tier", "nvarchar", "nvarchar(20)"),
        ]);
        assert_eq!(check_schema_change(&cfg(), &old, &wider), vec![]);
        // int -> decimal: `1` would become `1.00`. PostgreSQL's reading of
        // the names would not see it (both are "text" to it).
        let decimal = catalog(vec![
            col("id", "decimal", "decimal(10,2)"),
            col("is_deleted", "bit", "bit"),
        ]);
        let errors = check_schema_change(&cfg(), &old, &decimal);
        assert!(
            matches!(&errors[..], [SqlError::RetypedColumn { column, .. }] if column == "id"),
            "{errors:?}"
        );
        assert_eq!(
            crate::postgres::check_schema_change(&cfg(), &old, &decimal),
            vec![]
        );
        // A decimal key's scale is part of its text.
        let scale = |s: &str| {
            catalog(vec![
                col("id", "decimal", &format!("decimal({s})")),
                col("is_deleted", "bit", "bit"),
            ])
        };
        assert_eq!(
            check_schema_change(&cfg(), &scale("10,2"), &scale("18,2")),
            vec![]
        );
        assert_eq!(
            check_schema_change(&cfg(), &scale("10,2"), &scale("12,4")).len(),
            1
        );
        assert_eq!(
            text_form(&col("m", "money", "money")),
            text_form(&col("d", "decimal", "decimal(19,4)"))
        );
        assert_eq!(value_format("timestamp"), ValueFormat::Bytes);
        assert_eq!(value_format("uniqueidentifier"), ValueFormat::Text);
    }

    #[test]
    fn the_stop_names_the_table_the_column_and_the_t_sql_fix() {
        let old = catalog(vec![
            col("id", "int", "int"),
            col("is_deleted", "bit", "bit"),
        ]);
        let new = catalog(vec![
            col("id", "int", "int"),
            col("is_deleted", "nvarchar", "nvarchar(5)"),
        ]);
        let (message, fix) = schema_stop(&check_schema_change(&cfg(), &old, &new));
        assert!(
            message.contains("column `is_deleted` of dbo.customer (entity `customer`, is_deleted_column) changed type from bit to nvarchar(5)"),
            "{message}"
        );
        assert!(
            fix.contains("ALTER TABLE [dbo].[customer] ALTER COLUMN [is_deleted] bit;"),
            "{fix}"
        );
        assert!(fix.contains("then run `skein validate` and start skein again"));
        assert!(!fix.contains("publication"), "{fix}");
        // A join column gone: coming back needs a new capture instance.
        let mut gone = catalog(vec![
            col("id", "int", "int"),
            col("is_deleted", "bit", "bit"),
        ]);
        gone.tables
            .get_mut(&("dbo".into(), "address".into()))
            .unwrap()
            .columns
            .retain(|c| c.name != "customer_id");
        let (message, fix) = schema_stop(&check_schema_change(&cfg(), &old, &gone));
        assert!(
            message.contains("column `customer_id` of dbo.address"),
            "{message}"
        );
        assert!(
            fix.contains("take `customer_id` out of `on.name`")
                && fix.contains("@capture_instance = N'dbo_address_v2'"),
            "{fix}"
        );
    }

    #[test]
    fn the_ddl_query_takes_one_parameter_per_instance() {
        let q = ddl_history_sql(2);
        assert!(q.contains("IN (@P3, @P4)"), "{q}");
        assert!(q.contains("h.ddl_lsn > @P1 AND h.ddl_lsn <= @P2"), "{q}");
    }
}
