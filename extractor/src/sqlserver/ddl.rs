//! Following schema changes through `cdc.ddl_history`. Each batch asks, in
//! one query, for DDL committed in its window on the tables of the capture
//! instances it reads; only when there is some is the catalog read again
//! and checked against the config — the check PostgreSQL runs
//! ([`skein_sql::sqlserver::schema::check_schema_change`]) — before
//! anything of the batch is resolved. A column the config names dropped,
//! or one a key, join or logical delete relies on retyped, stops the
//! pipeline there; anything else (a new column, a dropped column nobody
//! names) is logged and followed.
//!
//! Pure: [`ddl_row`] decodes the rows, [`schema_step`] decides.

use skein_common::config::Config;
use skein_common::position::SqlServerLsn;
use skein_common::sqlvalue::SqlValue;
use skein_sql::postgres::describe_change;
use skein_sql::Catalog;

use super::lsn_of;
use crate::error::{Error, Result};

/// One row of `ddl_history_sql`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DdlRow {
    /// The capture instance of the table the statement changed.
    pub capture_instance: String,
    /// The LSN of the statement's commit.
    pub ddl_lsn: SqlServerLsn,
    /// The statement.
    pub ddl_command: String,
}

/// Decodes one row: `capture_instance, ddl_lsn, ddl_command`.
pub fn ddl_row(row: &[SqlValue]) -> Result<DdlRow> {
    let text = |i: usize, what: &str| {
        row.get(i)
            .and_then(SqlValue::to_text)
            .ok_or_else(|| Error::Decode(format!("cdc.ddl_history: {what} is missing")))
    };
    let lsn = row
        .get(1)
        .ok_or_else(|| Error::Decode("cdc.ddl_history: ddl_lsn is missing".into()))?;
    Ok(DdlRow {
        capture_instance: text(0, "capture_instance")?,
        ddl_lsn: lsn_of(lsn, "cdc.ddl_history ddl_lsn")?,
        ddl_command: text(2, "ddl_command").unwrap_or_default(),
    })
}

/// What a batch whose window holds DDL does, the catalog read again.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SchemaStep {
    /// Nothing skein reads changed (an index, a constraint, or a catalog
    /// already read after the statement, at start-up).
    Unchanged,
    /// Go on with the new catalog; what changed, for the log.
    Follow(Vec<String>),
    /// Stop before the batch is resolved.
    Stop {
        /// What changed that the config cannot follow, with the DDL.
        message: String,
        /// What to do.
        fix: String,
    },
}

/// Decides from the catalog the batch's plans were built on (`old`), the
/// one read now (`new`) and the DDL in the window (`ddl`, not empty).
pub fn schema_step(cfg: &Config, old: &Catalog, new: &Catalog, ddl: &[DdlRow]) -> SchemaStep {
    let problems = skein_sql::sqlserver::schema::check_schema_change(cfg, old, new);
    if !problems.is_empty() {
        let (message, fix) = skein_sql::sqlserver::schema::schema_stop(&problems);
        return SchemaStep::Stop {
            message: format!("{message} (cdc.ddl_history: {})", describe_ddl(ddl)),
            fix,
        };
    }
    if new == old {
        SchemaStep::Unchanged
    } else {
        SchemaStep::Follow(describe_change(old, new))
    }
}

/// The statements, each with its instance and LSN, shortened for a log
/// line or an error (one per statement: a table with two capture
/// instances has each of its statements twice in the history).
pub fn describe_ddl(ddl: &[DdlRow]) -> String {
    let mut seen: Vec<(SqlServerLsn, &str)> = vec![];
    let mut out = vec![];
    for d in ddl {
        let command = d.ddl_command.trim();
        if seen.contains(&(d.ddl_lsn, command)) {
            continue;
        }
        seen.push((d.ddl_lsn, command));
        let short: String = command.chars().take(200).collect();
        let more = if short.len() < command.len() {
            "…"
        } else {
            ""
        };
        out.push(format!(
            "`{}{more}` on {} at {}",
            short.split_whitespace().collect::<Vec<_>>().join(" "),
            d.capture_instance,
            d.ddl_lsn
        ));
    }
    out.join("; ")
}

#[cfg(test)]
mod tests {
    use skein_sql::{ColumnInfo, TableInfo};

    use super::*;
    use crate::sqlserver::tests::lsn;

    /// Rows as `ddl_history_sql` returns them.
    fn recorded(instance: &str, at: u64, command: &str) -> Vec<SqlValue> {
        vec![
            SqlValue::Text(instance.into()),
            SqlValue::Binary(lsn(at).0.to_vec()),
            SqlValue::Text(command.into()),
        ]
    }

    fn col(name: &str, type_name: &str, data_type: &str) -> ColumnInfo {
        ColumnInfo {
            name: name.into(),
            type_name: type_name.into(),
            data_type: data_type.into(),
            nullable: true,
        }
    }

    fn catalog(customer: &[(&str, &str, &str)]) -> Catalog {
        let mut c = Catalog::default();
        c.insert(TableInfo {
            schema: "dbo".into(),
            table: "customer".into(),
            columns: customer.iter().map(|(n, t, d)| col(n, t, d)).collect(),
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
    include_columns_on_delete: [name]
"#,
            "t",
        )
        .unwrap()
    }

    const BEFORE: [(&str, &str, &str); 3] = [
        ("id", "int", "int"),
        ("name", "nvarchar", "nvarchar(50)"),
        ("is_deleted", "bit", "bit"),
    ];

    #[test]
    fn rows_decode_and_broken_ones_are_errors() {
        let r = ddl_row(&recorded(
            "dbo_customer",
            7,
            "ALTER TABLE dbo.customer ADD tier int",
        ))
        .unwrap();
        assert_eq!(r.capture_instance, "dbo_customer");
        assert_eq!(r.ddl_lsn, lsn(7));
        assert!(ddl_row(&[]).is_err());
        assert!(ddl_row(&[SqlValue::Text("x".into()), SqlValue::Int(1)]).is_err());
        // A NULL command still names where it happened.
        let r = ddl_row(&[
            SqlValue::Text("dbo_customer".into()),
            SqlValue::Binary(lsn(8).0.to_vec()),
            SqlValue::Null,
        ])
        .unwrap();
        assert_eq!(r.ddl_command, "");
    }

    #[test]
    fn a_dropped_named_column_stops_naming_table_column_ddl_and_fix() {
        let ddl = vec![ddl_row(&recorded(
            "dbo_customer",
            42,
            "ALTER TABLE dbo.customer DROP COLUMN is_deleted",
        ))
        .unwrap()];
        let now = catalog(&BEFORE[..2]);
        let SchemaStep::Stop { message, fix } = schema_step(&cfg(), &catalog(&BEFORE), &now, &ddl)
        else {
            panic!("a stop")
        };
        assert!(
            message.contains("column `is_deleted` of dbo.customer (entity `customer`, is_deleted_column) does not exist"),
            "{message}"
        );
        assert!(
            message.contains("`ALTER TABLE dbo.customer DROP COLUMN is_deleted` on dbo_customer at 0x0000000000000000002A"),
            "{message}"
        );
        assert!(
            fix.contains("take `is_deleted` out of `is_deleted_column` of entity `customer`"),
            "{fix}"
        );
        assert!(fix.contains("nothing is lost"), "{fix}");
    }

    #[test]
    fn a_retyped_key_stops_and_a_new_column_is_followed() {
        let old = catalog(&BEFORE);
        let ddl = vec![ddl_row(&recorded(
            "dbo_customer",
            43,
            "ALTER TABLE dbo.customer ALTER COLUMN id decimal(10,2) NOT NULL",
        ))
        .unwrap()];
        let retyped = catalog(&[("id", "decimal", "decimal(10,2)"), BEFORE[1], BEFORE[2]]);
        assert!(matches!(
            schema_step(&cfg(), &old, &retyped, &ddl),
            SchemaStep::Stop { message, .. } if message.contains("`id`") && message.contains("decimal(10,2)")
        ));
        // A new column, and one the config does not name dropped: followed.
        let ddl = vec![
            ddl_row(&recorded(
                "dbo_customer",
                44,
                "ALTER TABLE dbo.customer ADD tier nvarchar(20) NULL",
            ))
            .unwrap(),
            ddl_row(&recorded(
                "dbo_customer_v2",
                44,
                "ALTER TABLE dbo.customer ADD tier nvarchar(20) NULL",
            ))
            .unwrap(),
        ];
        let wider = catalog(&[
            BEFORE[0],
            BEFORE[1],
            BEFORE[2],
            ("tier", "nvarchar", "nvarchar(20)"),
        ]);
        assert_eq!(
            schema_step(&cfg(), &old, &wider, &ddl),
            SchemaStep::Follow(vec!["dbo.customer: +tier nvarchar(20)".into()])
        );
        // The statement is told once, though both instances recorded it.
        assert_eq!(describe_ddl(&ddl).matches("ADD tier").count(), 1);
        // DDL that changes nothing skein reads (an index), or a catalog read
        // after the statement already (a restart): unchanged.
        assert_eq!(schema_step(&cfg(), &old, &old, &ddl), SchemaStep::Unchanged);
    }
}
