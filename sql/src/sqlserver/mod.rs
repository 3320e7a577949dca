//! SQL Server dialect (T-SQL): CDC enablement, the catalog and CDC health
//! checks, the change and LSN queries, root lookups, hydration and the
//! sidecar DDL. Pure text, pinned by golden files; the extractor and the
//! applier run it over TDS (tiberius).
//!
//! Choices:
//! * Changes come from `cdc.fn_cdc_get_all_changes_<capture_instance>` with
//!   `N'all update old'`: the supported interface (the change table's layout
//!   is internal), and the update's before image carries the old join
//!   columns, so a child moved to another parent touches both roots.
//! * Hydration returns typed columns, not JSON: value formats are decided in
//!   Rust, identically to the PostgreSQL path, not by `FOR JSON`.
//! * The keys of a batch go into a temp table `#skein_keys` (as nTangle does
//!   with `#changes`), one hydration query per table joins it.
//!
//! Besides the statement text: [`sidecar`] (the sidecar's statements),
//! [`schema`] (`cdc.ddl_history` and the schema-change check's SQL Server
//! types), [`decode`] (TDS cells into skein's value formats, pure) and
//! [`client`] (the one TDS connection wrapper, with a rolling-back
//! transaction guard).

pub mod client;
pub mod decode;
pub mod schema;
pub mod sidecar;

use std::fmt::Write as _;

use skein_common::config::{Config, TableNode};
use skein_common::sqlvalue::SqlValue;

use crate::catalog::{Catalog, ColumnInfo};
use crate::postgres::{
    explicit_where, parent_chain_joins, path_joins_and_order, path_to, referenced_columns,
    tracked_tables,
};

pub use client::{MssqlClient, MssqlError, Transaction};

/// Sidecar schema version written by [`sidecar_ddl`] (same tables as PostgreSQL's).
pub const SIDECAR_SCHEMA_VERSION: i32 = crate::postgres::SIDECAR_SCHEMA_VERSION;

/// Quotes an identifier: `[a]]b]`.
pub fn qi(s: &str) -> String {
    format!("[{}]", s.replace(']', "]]"))
}

/// Quotes a Unicode string literal: `N'it''s'`.
pub fn ql(s: &str) -> String {
    format!("N'{}'", s.replace('\'', "''"))
}

/// The capture instance skein enables for a table: SQL Server's default
/// name, `<schema>_<table>`.
pub fn capture_instance(schema: &str, table: &str) -> String {
    format!("{schema}_{table}")
}

/// `skein sql source --dialect sqlserver`: enables CDC on the database and
/// on every tracked table, capturing only key and join columns, without net
/// changes. Idempotent: each step is skipped when already done.
pub fn source_ddl(cfg: &Config, catalog: &Catalog) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "-- skein: SQL Server CDC enablement for pipeline '{}'.\n\
         -- Needs the SQL Server Agent running (it runs the capture and cleanup jobs).\n\
         -- Only key and join columns are captured: skein reads the latest state of\n\
         -- an aggregate from the tables themselves.\n\
         IF NOT EXISTS (SELECT 1 FROM sys.databases WHERE database_id = DB_ID() AND is_cdc_enabled = 1)\n    \
         EXEC sys.sp_cdc_enable_db;",
        cfg.name.replace('\n', " ")
    );
    for t in tracked_tables(cfg, catalog) {
        let cols: Vec<String> = t.columns.iter().map(|c| qi(c)).collect();
        let _ = writeln!(
            s,
            "\nIF NOT EXISTS (SELECT 1 FROM sys.tables tb JOIN sys.schemas sc ON sc.schema_id = tb.schema_id\n    \
             WHERE sc.name = {schema} AND tb.name = {table} AND tb.is_tracked_by_cdc = 1)\n    \
             EXEC sys.sp_cdc_enable_table\n        \
             @source_schema = {schema},\n        \
             @source_name = {table},\n        \
             @role_name = NULL,\n        \
             @capture_instance = {ci},\n        \
             @supports_net_changes = 0,\n        \
             @captured_column_list = {cols};",
            schema = ql(&t.schema),
            table = ql(&t.table),
            ci = ql(&capture_instance(&t.schema, &t.table)),
            cols = ql(&cols.join(", ")),
        );
    }
    s
}

/// The highest LSN CDC has written (`upper` of the next window).
pub const MAX_LSN_SQL: &str = "SELECT sys.fn_cdc_get_max_lsn()";

/// The lowest LSN still held by each of `n` capture instances (`@P1…`),
/// one column each, in one round trip (it runs before every batch); a
/// marker below one means cleanup removed changes skein had not read.
pub fn min_lsns_sql(n: usize) -> String {
    let cols: Vec<String> = (1..=n)
        .map(|i| format!("sys.fn_cdc_get_min_lsn(@P{i})"))
        .collect();
    format!("SELECT {}", cols.join(", "))
}

/// The capture instances of a table (`@P1` schema, `@P2` table), oldest
/// first: `capture_instance, start_lsn, create_lsn`. `create_lsn` is the
/// last commit at or before the instance's `create_date`
/// (`sys.fn_cdc_map_time_to_lsn`; NULL when cleanup removed that
/// mapping): an instance whose `create_lsn` is at or after the marker was
/// created after it, so a `start_lsn` past the marker is its beginning,
/// not cleanup. (`start_lsn` itself moves with cleanup.)
pub const CAPTURE_INSTANCES_SQL: &str = "SELECT ct.capture_instance, ct.start_lsn, \
sys.fn_cdc_map_time_to_lsn(N'largest less than or equal', ct.create_date) AS create_lsn \
FROM cdc.change_tables ct \
JOIN sys.tables tb ON tb.object_id = ct.source_object_id \
JOIN sys.schemas sc ON sc.schema_id = tb.schema_id \
WHERE sc.name = @P1 AND tb.name = @P2 \
ORDER BY ct.create_date, ct.capture_instance";

/// Reads the catalog of `tables` (`(schema, table)`) with [`CATALOG_SQL`],
/// one query per table; a table that is not there is left out. The
/// extractor reads it at start and after DDL, the appliers in every batch.
pub async fn read_catalog(
    client: &mut MssqlClient,
    tables: &[(String, String)],
) -> Result<Catalog, MssqlError> {
    let mut cat = Catalog::default();
    for (schema, table) in tables {
        let rows = client
            .query(
                &format!("reading the columns of {schema}.{table}"),
                CATALOG_SQL,
                &[&schema.as_str(), &table.as_str()],
            )
            .await?;
        if rows.is_empty() {
            continue;
        }
        let mut pk: Vec<(i64, String)> = vec![];
        let mut columns = vec![];
        for r in rows {
            let text = |i: usize| r.get(i).and_then(SqlValue::to_text).unwrap_or_default();
            let name = text(0);
            if let Some(SqlValue::Int(k)) = r.get(4) {
                pk.push((*k, name.clone()));
            }
            columns.push(ColumnInfo {
                name,
                type_name: text(1),
                data_type: text(2),
                nullable: matches!(r.get(3), Some(SqlValue::Bit(true))),
            });
        }
        pk.sort();
        cat.insert(crate::catalog::TableInfo {
            schema: schema.clone(),
            table: table.clone(),
            columns,
            primary_key: pk.into_iter().map(|(_, c)| c).collect(),
            replica_identity: 'd',
        });
    }
    Ok(cat)
}

/// The columns of one table (`@P1` schema, `@P2` table) in table order:
/// `column, type_name, data_type, is_nullable, pk_ordinal`. `data_type` is
/// the full type (`decimal(10,2)`, `nvarchar(50)`, `datetime2(7)`) because
/// key texts are converted back with `TRY_CONVERT(data_type, …)`;
/// `type_name` is the base system type (alias types resolved).
pub const CATALOG_SQL: &str = "SELECT c.name, TYPE_NAME(c.system_type_id), \
CASE WHEN TYPE_NAME(c.system_type_id) IN (N'decimal', N'numeric') \
       THEN CONCAT(TYPE_NAME(c.system_type_id), N'(', c.precision, N',', c.scale, N')') \
     WHEN TYPE_NAME(c.system_type_id) IN (N'varchar', N'char', N'varbinary', N'binary') \
       THEN CONCAT(TYPE_NAME(c.system_type_id), N'(', IIF(c.max_length = -1, N'max', CAST(c.max_length AS nvarchar(10))), N')') \
     WHEN TYPE_NAME(c.system_type_id) IN (N'nvarchar', N'nchar') \
       THEN CONCAT(TYPE_NAME(c.system_type_id), N'(', IIF(c.max_length = -1, N'max', CAST(c.max_length / 2 AS nvarchar(10))), N')') \
     WHEN TYPE_NAME(c.system_type_id) IN (N'datetime2', N'time', N'datetimeoffset') \
       THEN CONCAT(TYPE_NAME(c.system_type_id), N'(', c.scale, N')') \
     ELSE TYPE_NAME(c.system_type_id) END, \
c.is_nullable, ic.key_ordinal \
FROM sys.tables t \
JOIN sys.schemas s ON s.schema_id = t.schema_id \
JOIN sys.columns c ON c.object_id = t.object_id \
LEFT JOIN sys.indexes i ON i.object_id = t.object_id AND i.is_primary_key = 1 \
LEFT JOIN sys.index_columns ic ON ic.object_id = t.object_id AND ic.index_id = i.index_id \
  AND ic.column_id = c.column_id \
WHERE s.name = @P1 AND t.name = @P2 \
ORDER BY c.column_id";

/// Whether CDC is enabled on the current database.
pub const CDC_ENABLED_SQL: &str =
    "SELECT CAST(is_cdc_enabled AS int) FROM sys.databases WHERE database_id = DB_ID()";

/// The columns a capture instance (`@P1`) captures.
pub const CAPTURED_COLUMNS_SQL: &str = "SELECT cc.column_name \
FROM cdc.captured_columns cc \
JOIN cdc.change_tables ct ON ct.object_id = cc.object_id \
WHERE ct.capture_instance = @P1";

/// Whether the database has a CDC capture job (needs read access to msdb).
pub const CAPTURE_JOB_SQL: &str =
    "SELECT COUNT(*) FROM msdb.dbo.cdc_jobs WHERE database_id = DB_ID() AND job_type = N'capture'";

/// The CDC cleanup job's retention in minutes (needs read access to
/// msdb): the job removes changes committed longer ago than that. No row:
/// no cleanup job, nothing removes changes.
pub const CLEANUP_RETENTION_SQL: &str = "SELECT CAST(retention AS bigint) FROM msdb.dbo.cdc_jobs \
WHERE database_id = DB_ID() AND job_type = N'cleanup'";

/// How many seconds ago the transaction at LSN `@P1` committed, on the
/// server's local clock on both sides, as the cleanup job compares them
/// (it removes what committed before `GETDATE()` minus the retention).
pub const CHANGE_AGE_SQL: &str = "SELECT DATEDIFF_BIG(second, m.tran_end_time, GETDATE()) \
FROM cdc.lsn_time_mapping m WHERE m.start_lsn = @P1";

/// The SQL Server Agent's state (needs VIEW SERVER STATE).
pub const AGENT_STATUS_SQL: &str = "SELECT status_desc FROM sys.dm_server_services \
WHERE servicename LIKE N'SQL Server Agent%'";

/// The most recent capture log-scan session error, if any (needs VIEW
/// DATABASE STATE).
pub const LOG_SCAN_ERRORS_SQL: &str = "SELECT TOP (1) error_count, end_time \
FROM sys.dm_cdc_log_scan_sessions WHERE error_count > 0 ORDER BY end_time DESC";

/// Commit time (UTC, µs since the Unix epoch) and transaction id of the
/// transactions that committed in `[@P1, @P2]`. `cdc.lsn_time_mapping`
/// holds server-local time (`datetime`); it is read as a time in the
/// server's Windows time zone `@P3` and converted to UTC with that zone's
/// rules for the day it names (`AT TIME ZONE`, SQL Server 2016+), so a
/// change committed before a DST switch keeps its own offset. In the hour
/// the clocks go back, a local time names two instants; `AT TIME ZONE`
/// takes the offset before the switch, the earlier one.
pub const LSN_TIME_SQL: &str = "SELECT m.start_lsn, \
DATEDIFF_BIG(microsecond, '19700101', CONVERT(datetime2(7), m.tran_end_time AT TIME ZONE @P3 AT TIME ZONE N'UTC')), \
m.tran_id \
FROM cdc.lsn_time_mapping m \
WHERE m.start_lsn >= @P1 AND m.start_lsn <= @P2";

/// [`LSN_TIME_SQL`] for a server whose time zone is unknown: shifted by
/// its *current* UTC offset, so a change committed on the other side of
/// the last DST switch is off by the shift.
pub const LSN_TIME_CURRENT_OFFSET_SQL: &str = "SELECT m.start_lsn, \
DATEDIFF_BIG(microsecond, '19700101', DATEADD(minute, DATEDIFF(minute, SYSDATETIME(), SYSUTCDATETIME()), m.tran_end_time)), \
m.tran_id \
FROM cdc.lsn_time_mapping m \
WHERE m.start_lsn >= @P1 AND m.start_lsn <= @P2";

/// The server's major version (13 is SQL Server 2016, 16 is 2022) and
/// engine edition (5 Azure SQL Database, 8 Azure SQL Managed Instance):
/// which of `AT TIME ZONE` and `CURRENT_TIMEZONE_ID()` it has.
pub const SERVER_VERSION_SQL: &str = "SELECT CAST(SERVERPROPERTY('ProductMajorVersion') AS int), \
CAST(SERVERPROPERTY('EngineEdition') AS int)";

/// The server's Windows time zone (SQL Server 2022+, Azure SQL; older
/// versions do not know the function and refuse the statement).
pub const CURRENT_TIME_ZONE_SQL: &str = "SELECT CURRENT_TIMEZONE_ID()";

/// Whether `@P1` is a time zone the server knows (SQL Server 2016+).
pub const TIME_ZONE_KNOWN_SQL: &str = "SELECT COUNT(*) FROM sys.time_zone_info WHERE name = @P1";

/// The T-SQL that fixes a failed CDC check, for error messages.
pub fn fix_capture_job() -> &'static str {
    "EXEC sys.sp_cdc_add_job @job_type = N'capture';  -- then make sure SQL Server Agent runs \
     (MSSQL_AGENT_ENABLED=true in containers)"
}

/// Changes of one capture instance in `[@P1, @P2]` (`@P1` is the marker's
/// successor, `sys.fn_cdc_increment_lsn` done in Rust), in commit order then
/// change order. `__$operation`: 1 delete, 2 insert, 3 update before,
/// 4 update after.
pub fn changes_sql(capture_instance: &str, columns: &[String]) -> String {
    let cols: Vec<String> = columns.iter().map(|c| qi(c)).collect();
    format!(
        "SELECT [__$start_lsn], [__$seqval], [__$operation], {cols}\n\
         FROM cdc.{f}(@P1, @P2, N'all update old')\n\
         ORDER BY [__$start_lsn], [__$seqval], [__$operation]",
        cols = cols.join(", "),
        f = qi(&format!("fn_cdc_get_all_changes_{capture_instance}")),
    )
}

/// One part of a transaction too large for one batch, from one capture
/// instance: the first `@P1` change rows at commit LSN `@P2` whose
/// `__$seqval` is above `@P3` (the cursor: the last `__$seqval` handed
/// over, or 0 for the first part), in change order. The extractor merges
/// the instances' rows by `__$seqval` and takes a part's worth, never
/// splitting the rows of one `__$seqval` (an update's before and after).
pub fn part_sql(capture_instance: &str, columns: &[String]) -> String {
    let cols: Vec<String> = columns.iter().map(|c| qi(c)).collect();
    format!(
        "SELECT TOP (@P1) [__$start_lsn], [__$seqval], [__$operation], {cols}\n\
         FROM cdc.{f}(@P2, @P2, N'all update old')\n\
         WHERE [__$seqval] > @P3\n\
         ORDER BY [__$seqval], [__$operation]",
        cols = cols.join(", "),
        f = qi(&format!("fn_cdc_get_all_changes_{capture_instance}")),
    )
}

/// What one capture instance holds of a transaction in flight up to the
/// cursor a restart reads on from: its changes at commit LSN `@P1` whose
/// `__$seqval` is at or below `@P2`, an update's two rows counted once.
/// Summed over the instances read now, it is what the marker says was
/// handed over, unless the config changed in between.
pub fn handed_over_sql(capture_instance: &str) -> String {
    format!(
        "SELECT COUNT_BIG(*)\n\
         FROM cdc.{f}(@P1, @P1, N'all update old')\n\
         WHERE [__$seqval] <= @P2 AND [__$operation] <> 4",
        f = qi(&format!("fn_cdc_get_all_changes_{capture_instance}")),
    )
}

/// The first `@P1` + 1 change LSNs across the given capture instances, in
/// order: enough for [`cap_window`] to close the batch at an LSN boundary.
/// Instance `i` is read in `[@P(2i+2), @P(2i+3)]`: from the marker's
/// successor, or the instance's own minimum when that is later (the
/// function refuses a start before it), up to the max LSN, or for the
/// older of two instances of one table up to just before the newer one's
/// start (the newer covers the rest). Each instance contributes at most
/// `@P1` + 1 rows itself, so sizing a batch costs the batch, not the
/// backlog behind it.
pub fn window_sql(capture_instances: &[String]) -> String {
    let unions: Vec<String> = capture_instances
        .iter()
        .enumerate()
        .map(|(i, ci)| {
            format!(
                "    SELECT b{i}.[lsn] FROM (SELECT TOP (@P1 + 1) [__$start_lsn] AS [lsn] \
                 FROM cdc.{}(@P{}, @P{}, N'all update old') ORDER BY [__$start_lsn]) b{i}",
                qi(&format!("fn_cdc_get_all_changes_{ci}")),
                2 * i + 2,
                2 * i + 3
            )
        })
        .collect();
    format!(
        "SELECT TOP (@P1 + 1) u.[lsn]\nFROM (\n{}\n) u\nORDER BY u.[lsn]",
        unions.join("\n    UNION ALL\n")
    )
}

/// Where a batch ends, given the first `cap + 1` change LSNs (sorted) of
/// the window up to `max`: all of it when it fits; else the last LSN whose
/// changes all fit; a single transaction larger than the cap is the
/// window alone (never half an LSN; the extractor reads it in parts,
/// [`part_sql`]). `None` when there is nothing.
pub fn cap_window<L: Ord + Copy>(lsns: &[L], cap: usize, max: L) -> Option<L> {
    lsns.first()?;
    let cap = cap.max(1);
    if lsns.len() <= cap {
        return Some(max);
    }
    // The first change that does not fit; its transaction is left out,
    // unless it is the only one (then it is the window alone).
    let cut = lsns[cap];
    Some(
        lsns[..cap]
            .iter()
            .rev()
            .find(|l| **l < cut)
            .copied()
            .unwrap_or(cut),
    )
}

/// Creates `#skein_keys` for a root with `n` key columns: one row per root
/// key, `ord` from 1. The values are text (as in the change records);
/// hydration converts them to the key columns' types.
pub fn keys_table_sql(n: usize) -> String {
    temp_table_sql(KEYS_TABLE, n)
}

/// Creates `#skein_lookup` for a child with `n` join columns: one row per
/// join-value tuple to resolve to its root, `ord` from 1.
pub fn lookup_table_sql(n: usize) -> String {
    temp_table_sql(LOOKUP_TABLE, n)
}

/// The temp table of hydration keys.
pub const KEYS_TABLE: &str = "#skein_keys";
/// The temp table of root lookups.
pub const LOOKUP_TABLE: &str = "#skein_lookup";

fn temp_table_sql(table: &str, n: usize) -> String {
    let cols: Vec<String> = (0..n)
        .map(|i| format!("[v{i}] nvarchar(4000) NULL"))
        .collect();
    format!(
        "IF OBJECT_ID(N'tempdb..{table}') IS NOT NULL DROP TABLE {table};\n\
         CREATE TABLE {table} ([ord] int NOT NULL PRIMARY KEY, {});",
        cols.join(", ")
    )
}

/// Root lookup of a child that does not carry its root key (deeper levels,
/// joins to non-key columns): joins the tuples in `#skein_lookup` up the
/// parent chain. Columns: `ord`, then the root key columns (typed). A tuple
/// whose parent chain is gone gives no row: the parent's own change covers
/// the root.
pub fn lookup_sql(nodes: &[TableNode], index: usize, catalog: &Catalog) -> String {
    let node = &nodes[index];
    let parent_path = path_to(nodes, node.parent.unwrap_or(0));
    let up: Vec<usize> = parent_path.iter().rev().copied().collect();
    let alias = |i: usize| format!("u{i}");
    let root_alias = alias(up.len() - 1);
    let root_key = catalog.key_columns(&nodes[0]);
    let mut select = vec!["k.[ord]".to_string()];
    for c in &root_key {
        select.push(format!("{root_alias}.{}", qi(c)));
    }
    let parent = &nodes[up[0]];
    let conds: Vec<String> = node
        .on
        .iter()
        .enumerate()
        .map(|(i, o)| {
            format!(
                "u0.{} = {}",
                qi(&o.to_column),
                key_from_text(
                    column_type(catalog, parent, &o.to_column),
                    &format!("k.[v{i}]")
                )
            )
        })
        .collect();
    let mut sql = format!(
        "SELECT {}\nFROM {LOOKUP_TABLE} k\nJOIN {}.{} u0 ON {}\n",
        select.join(", "),
        qi(&parent.schema),
        qi(&parent.table),
        conds.join(" AND ")
    );
    sql.push_str(&parent_chain_joins(nodes, &up, qi));
    sql.push_str("ORDER BY k.[ord]");
    sql
}

/// The declared type of `column` of `node` (`nvarchar(4000)` when the
/// catalog does not know it): what a key's text is converted back to.
fn column_type<'a>(catalog: &'a Catalog, node: &TableNode, column: &str) -> &'a str {
    catalog
        .node(node)
        .and_then(|t| t.column(column))
        .map(|c| c.data_type.as_str())
        .unwrap_or("nvarchar(4000)")
}

/// A key's text (`SqlValue::to_text`: ISO 8601, `T`, 100 ns digits when
/// the value has them) back in the column's type `ty`. `datetime` and
/// `smalldatetime` read at most three fractional digits from a string (a
/// longer one is no value: `TRY_CONVERT` gives NULL and the row is never
/// found), so their text goes through `datetime2(7)`, whose conversion
/// rounds to the column's own ticks: the text of a `datetime` is less
/// than 1 µs from its 1/300 s tick, so it rounds back to that tick.
pub fn key_from_text(ty: &str, text: &str) -> String {
    if ty.eq_ignore_ascii_case("datetime") || ty.eq_ignore_ascii_case("smalldatetime") {
        format!("TRY_CONVERT({ty}, TRY_CONVERT(datetime2(7), {text}))")
    } else {
        format!("TRY_CONVERT({ty}, {text})")
    }
}

/// How many root keys one `INSERT INTO #skein_keys` carries: a request
/// takes at most 2,100 parameters and a `VALUES` list at most 1,000 rows.
pub fn keys_per_insert(key_columns: usize) -> usize {
    (2_000 / (key_columns + 1)).clamp(1, 1_000)
}

/// Inserts `rows` root keys (`ord` then the key texts, as parameters
/// `@P1…`) into `#skein_keys`.
pub fn keys_insert_sql(key_columns: usize, rows: usize) -> String {
    temp_insert_sql(KEYS_TABLE, key_columns, rows)
}

/// Inserts `rows` tuples into `table` (`#skein_keys` or `#skein_lookup`).
pub fn temp_insert_sql(table: &str, key_columns: usize, rows: usize) -> String {
    let cols: Vec<String> = std::iter::once("[ord]".to_string())
        .chain((0..key_columns).map(|i| format!("[v{i}]")))
        .collect();
    let width = key_columns + 1;
    let values: Vec<String> = (0..rows)
        .map(|r| {
            let ps: Vec<String> = (1..=width)
                .map(|c| format!("@P{}", r * width + c))
                .collect();
            format!("({})", ps.join(", "))
        })
        .collect();
    format!(
        "INSERT INTO {table} ({}) VALUES {}",
        cols.join(", "),
        values.join(", ")
    )
}

/// SQL Server types the reader does not decode; the catalog check names
/// the column and the table instead of failing on the first row.
pub const UNSUPPORTED_TYPES: &[&str] = &["sql_variant", "hierarchyid", "geometry", "geography"];

/// One event column in a hydration query. `money` and `smallmoney` reach
/// the driver as floating point, so they are cast to `decimal(19,4)` (their
/// exact range and scale) to keep every digit.
pub fn select_expr(alias: &str, col: &ColumnInfo) -> String {
    match col.type_name.as_str() {
        "money" | "smallmoney" => format!(
            "CAST({alias}.{} AS decimal(19,4)) AS {}",
            qi(&col.name),
            qi(&col.name)
        ),
        _ => format!("{alias}.{}", qi(&col.name)),
    }
}

/// Hydration query of one node for the root keys in `#skein_keys`.
/// Columns: `ord`, for the root `found` (0 when the root row is gone), the
/// node's join columns (`link_*`), the columns its
/// children join to (`ref_*`), then its event columns, typed; the root's
/// rows come from a left join, so a missing root gives one row of NULLs.
/// Rows are ordered by root, then by the node's key (stable arrays).
pub fn hydrate_sql(nodes: &[TableNode], index: usize, catalog: &Catalog) -> String {
    let path = path_to(nodes, index);
    let root = &nodes[0];
    let node = &nodes[index];
    let alias = |i: usize| format!("t{i}");
    let this = alias(path.len() - 1);
    let mut select = vec!["k.[ord]".to_string()];
    if index == 0 {
        // The root is left-joined: whether it still exists.
        let first = catalog
            .key_columns(root)
            .into_iter()
            .next()
            .unwrap_or_default();
        select.push(format!(
            "CASE WHEN t0.{} IS NULL THEN 0 ELSE 1 END AS [found]",
            qi(&first)
        ));
    }
    for o in &node.on {
        select.push(format!(
            "{this}.{} AS {}",
            qi(&o.name),
            qi(&format!("link_{}", o.name))
        ));
    }
    for r in referenced_columns(nodes, index) {
        select.push(format!("{this}.{} AS {}", qi(&r), qi(&format!("ref_{r}"))));
    }
    for c in catalog.event_columns(node) {
        select.push(select_expr(&this, c));
    }
    let root_key = catalog.key_columns(root);
    let on_root: Vec<String> = root_key
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let ty = column_type(catalog, root, c);
            format!("t0.{} = {}", qi(c), key_from_text(ty, &format!("k.[v{i}]")))
        })
        .collect();
    format!(
        "SELECT {}\nFROM #skein_keys k\n{}",
        select.join(", "),
        path_joins_and_order(nodes, &path, catalog, &on_root, "k.[ord]", qi)
    )
}

/// A page of root keys for `skein explicit` (`extractor.initial_load`),
/// the twin of [`crate::postgres::explicit_keys_sql`]: the entity's root
/// key columns, typed as the change stream reads them (the caller turns
/// them into key text with [`decode::root_key`]), in key order, at most
/// `@Pn+1` of them (a `bigint` after the `n` key columns; `@P1` without
/// `after`).
///
/// `filter`, when given, is the operator's SQL condition on the root row
/// (alias `t0`, columns unqualified resolve to it). With `after` the page
/// starts after the key whose column texts are `@P1…@Pn`, each read back in
/// its column's type as hydration reads keys ([`key_from_text`]). T-SQL has
/// no row comparison, so the keyset is spelled out, `(a > @P1) OR (a = @P1
/// AND b > @P2)`; for a composite key a leading `a >= @P1` lets the
/// optimizer seek on the first column whatever it makes of the `OR`.
pub fn explicit_keys_sql(
    root: &TableNode,
    catalog: &Catalog,
    filter: Option<&str>,
    after: bool,
) -> String {
    let key = catalog.key_columns(root);
    let cols: Vec<String> = key.iter().map(|c| format!("t0.{}", qi(c))).collect();
    let keyset = after.then(|| {
        let param: Vec<String> = key
            .iter()
            .enumerate()
            .map(|(i, c)| key_from_text(column_type(catalog, root, c), &format!("@P{}", i + 1)))
            .collect();
        let alternatives: Vec<String> = (0..key.len())
            .map(|i| {
                let mut terms: Vec<String> = (0..i)
                    .map(|j| format!("{} = {}", cols[j], param[j]))
                    .collect();
                terms.push(format!("{} > {}", cols[i], param[i]));
                format!("({})", terms.join(" AND "))
            })
            .collect();
        match alternatives.as_slice() {
            [one] => one.clone(),
            _ => format!(
                "{} >= {} AND ({})",
                cols[0],
                param[0],
                alternatives.join(" OR ")
            ),
        }
    });
    format!(
        "SELECT TOP (@P{limit}) {cols}\nFROM {schema}.{table} AS t0\n{where_}ORDER BY {cols}",
        limit = if after { key.len() + 1 } else { 1 },
        cols = cols.join(", "),
        schema = qi(&root.schema),
        table = qi(&root.table),
        where_ = explicit_where(filter, keyset),
    )
}

/// `skein sql sidecar --dialect sqlserver`: the sidecar tables of the
/// PostgreSQL sidecar in T-SQL, idempotent.
pub fn sidecar_ddl(schema: &str) -> String {
    let s = qi(schema);
    let lit = ql(schema);
    let table = |name: &str, body: &str| {
        format!(
            "IF OBJECT_ID({obj}, N'U') IS NULL\nCREATE TABLE {s}.{t} (\n{body}\n);\n",
            obj = ql(&format!("{s}.{}", qi(name))),
            t = qi(name),
        )
    };
    let mut out = format!(
        "-- skein sidecar schema (T-SQL), version {v}.\n\
         IF SCHEMA_ID({lit}) IS NULL EXEC(N'CREATE SCHEMA {s_inner}');\n\n",
        v = SIDECAR_SCHEMA_VERSION,
        s_inner = s.replace('\'', "''"),
    );
    out += &table(
        "schema_version",
        "  [version]    int          NOT NULL PRIMARY KEY,\n  \
         [applied_at] datetime2(6) NOT NULL DEFAULT SYSUTCDATETIME()",
    );
    out += "\n-- The exactly-once recovery marker; moves only inside the batch transaction.\n";
    out += &table(
        "progress",
        "  [group_name]    nvarchar(200) NOT NULL,\n  \
         [topic]         nvarchar(400) NOT NULL,\n  \
         [partition]     int           NOT NULL,\n  \
         [position]      decimal(25,0) NOT NULL,\n  \
         [source_commit] nvarchar(30)  NULL,\n  \
         [source_seq]    bigint        NULL,\n  \
         [epoch]         bigint        NOT NULL DEFAULT 0,\n  \
         [updated_at]    datetime2(6)  NOT NULL DEFAULT SYSUTCDATETIME(),\n  \
         PRIMARY KEY ([group_name], [topic], [partition])",
    );
    let _ = write!(
        out,
        "-- Version 4: the fencing epoch, bumped by every ownership change and rewind.\n\
         IF COL_LENGTH({p}, N'epoch') IS NULL\n    \
         ALTER TABLE {s}.[progress] ADD [epoch] bigint NOT NULL DEFAULT 0;\n\
         -- Version 5: where a TRUNCATE re-check stands (the last key re-checked).\n\
         IF COL_LENGTH({p}, N'recheck_after') IS NULL\n    \
         ALTER TABLE {s}.[progress] ADD [recheck_after] nvarchar(max) NULL;\n",
        p = ql(&format!("{s}.[progress]")),
    );
    out += "\n-- Version 4: the partition count records are keyed by, per group and topic.\n";
    out += &table(
        "transport",
        "  [group_name] nvarchar(200) NOT NULL,\n  \
         [topic]      nvarchar(400) NOT NULL,\n  \
         [partitions] int           NOT NULL,\n  \
         [updated_at] datetime2(6)  NOT NULL DEFAULT SYSUTCDATETIME(),\n  \
         PRIMARY KEY ([group_name], [topic])",
    );
    out += "\n-- Version 4: each relay's state and last error, for `skein status`.\n";
    out += &table(
        "relay",
        "  [name]       nvarchar(200) NOT NULL PRIMARY KEY,\n  \
         [state]      nvarchar(40)  NOT NULL,\n  \
         [last_error] nvarchar(max) NULL,\n  \
         [error_at]   datetime2(6)  NULL,\n  \
         [updated_at] datetime2(6)  NOT NULL DEFAULT SYSUTCDATETIME()",
    );
    out += "\n";
    out += &table(
        "batch",
        "  [id]             bigint IDENTITY(1,1) NOT NULL PRIMARY KEY,\n  \
         [correlation_id] uniqueidentifier NOT NULL UNIQUE,\n  \
         [group_name]     nvarchar(200) NOT NULL,\n  \
         [topic]          nvarchar(400) NOT NULL,\n  \
         [partition]      int           NOT NULL,\n  \
         [lower_position] decimal(25,0) NOT NULL,\n  \
         [upper_position] decimal(25,0) NOT NULL,\n  \
         [record_count]   int           NOT NULL,\n  \
         [entity_count]   int           NOT NULL,\n  \
         [event_count]    int           NOT NULL,\n  \
         [has_data_loss]  bit           NOT NULL DEFAULT 0,\n  \
         [dead_letters]   int           NOT NULL DEFAULT 0,\n  \
         [created_at]     datetime2(6)  NOT NULL DEFAULT SYSUTCDATETIME()",
    );
    out += "\n";
    out += &table(
        "version",
        "  [entity]     nvarchar(200) NOT NULL,\n  \
         [key]        nvarchar(900) NOT NULL,\n  \
         [etag]       char(64)      NULL,\n  \
         [is_deleted] bit           NOT NULL DEFAULT 0,\n  \
         [updated_at] datetime2(6)  NOT NULL DEFAULT SYSUTCDATETIME(),\n  \
         PRIMARY KEY ([entity], [key])",
    );
    out += "\n";
    let _ = write!(
        out,
        "-- Version 7: the outbox's rows live in outbox_row; [outbox] is a view of\n\
         -- them with dequeued_at derived from the relay's cursors (below).\n\
         IF OBJECT_ID({o}, N'U') IS NOT NULL\n    \
         EXEC sp_rename {o}, N'outbox_row';\n",
        o = ql(&format!("{s}.[outbox]")),
    );
    out += &table(
        "outbox_row",
        &format!(
            "  [id]          bigint IDENTITY(1,1) NOT NULL PRIMARY KEY,\n  \
             [event_id]    uniqueidentifier NOT NULL UNIQUE,\n  \
             [batch_id]    bigint        NOT NULL REFERENCES {s}.[batch] ([id]),\n  \
             [entity]      nvarchar(200) NOT NULL,\n  \
             [key]         nvarchar(900) NOT NULL,\n  \
             [partition]   int           NOT NULL,\n  \
             [etag]        char(64)      NULL,\n  \
             [event]       nvarchar(max) NOT NULL,\n  \
             [commit_time] datetime2(6)  NOT NULL,\n  \
             [enqueued_at] datetime2(6)  NOT NULL DEFAULT SYSUTCDATETIME()"
        ),
    );
    let _ = write!(
        out,
        "IF NOT EXISTS (SELECT 1 FROM sys.indexes WHERE name = N'outbox_entity_key' AND object_id = OBJECT_ID({o}))\n    \
         CREATE INDEX [outbox_entity_key] ON {s}.[outbox_row] ([entity], [key], [id]);\n",
        o = ql(&format!("{s}.[outbox_row]")),
    );
    out += "\n-- Version 6: explicit runs (`skein explicit`, `extractor.initial_load`). A\n\
            -- run selects root keys of an entity and queues them a chunk per transaction,\n\
            -- with its cursor (the last key or index queued): a killed run resumes after\n\
            -- it. Each partition's applier takes its queued keys, publishes them in its\n\
            -- own fenced batch transaction and deletes them there: exactly once, and in\n\
            -- order with the stream of that partition.\n";
    out += &table(
        "explicit_run",
        "  [id]         bigint IDENTITY(1,1) NOT NULL PRIMARY KEY,\n  \
         [group_name] nvarchar(200) NOT NULL,\n  \
         [entity]     nvarchar(200) NOT NULL,\n  \
         [selection]  nvarchar(max) NOT NULL,\n  \
         [republish]  bit           NOT NULL DEFAULT 0,\n  \
         [initial]    bit           NOT NULL DEFAULT 0,\n  \
         [state]      nvarchar(40)  NOT NULL DEFAULT N'selecting',\n  \
         [cursor]     nvarchar(max) NULL,\n  \
         [queued]     bigint        NOT NULL DEFAULT 0,\n  \
         [created_at] datetime2(6)  NOT NULL DEFAULT SYSUTCDATETIME(),\n  \
         [updated_at] datetime2(6)  NOT NULL DEFAULT SYSUTCDATETIME()",
    );
    out += &table(
        "explicit_queue",
        &format!(
            "  [id]         bigint IDENTITY(1,1) NOT NULL PRIMARY KEY,\n  \
             [run_id]     bigint        NOT NULL REFERENCES {s}.[explicit_run] ([id]),\n  \
             [group_name] nvarchar(200) NOT NULL,\n  \
             [topic]      nvarchar(400) NOT NULL,\n  \
             [partition]  int           NOT NULL,\n  \
             [entity]     nvarchar(200) NOT NULL,\n  \
             [key]        nvarchar(900) NOT NULL,\n  \
             [republish]  bit           NOT NULL DEFAULT 0"
        ),
    );
    let _ = write!(
        out,
        "IF NOT EXISTS (SELECT 1 FROM sys.indexes WHERE name = N'explicit_queue_partition' AND object_id = OBJECT_ID({q}))\n    \
         CREATE INDEX [explicit_queue_partition] ON {s}.[explicit_queue] ([group_name], [topic], [partition], [id]);\n\
         IF NOT EXISTS (SELECT 1 FROM sys.indexes WHERE name = N'explicit_queue_run' AND object_id = OBJECT_ID({q}))\n    \
         CREATE INDEX [explicit_queue_run] ON {s}.[explicit_queue] ([run_id]);\n",
        q = ql(&format!("{s}.[explicit_queue]")),
    );
    out += "\n-- Version 7: the relay keeps one cursor per outbox partition, the last id\n\
            -- it sent, instead of rewriting every row it sends (versions 1 to 6 set\n\
            -- outbox.dequeued_at). A partition's ids grow in commit order (its batch\n\
            -- transactions take the partition's outbox lock before they write), so\n\
            -- every row above the cursor is pending and none below it is. Relayed\n\
            -- rows are deleted after `sidecar.outbox_retention_secs`, a chunk at a\n\
            -- time, by the relay.\n";
    out += &table(
        "relay_cursor",
        "  [partition]  int          NOT NULL PRIMARY KEY,\n  \
         [last_id]    bigint       NOT NULL,\n  \
         [updated_at] datetime2(6) NOT NULL DEFAULT SYSUTCDATETIME()",
    );
    // The statements that name dequeued_at run as dynamic SQL: compiled
    // only where the column exists.
    let from_v6 = format!(
        "INSERT INTO {s}.[relay_cursor] ([partition], [last_id]) \
         SELECT [partition], COALESCE(MIN(CASE WHEN [dequeued_at] IS NULL THEN [id] END) - 1, MAX([id])) \
         FROM {s}.[outbox_row] GROUP BY [partition]; \
         IF EXISTS (SELECT 1 FROM sys.indexes WHERE name = N'outbox_pending' AND object_id = OBJECT_ID({o})) \
         DROP INDEX [outbox_pending] ON {s}.[outbox_row]; \
         IF EXISTS (SELECT 1 FROM sys.indexes WHERE name = N'outbox_dequeued' AND object_id = OBJECT_ID({o})) \
         DROP INDEX [outbox_dequeued] ON {s}.[outbox_row]; \
         ALTER TABLE {s}.[outbox_row] DROP COLUMN [dequeued_at];",
        o = ql(&format!("{s}.[outbox_row]")),
    );
    let view = format!(
        "CREATE VIEW {s}.[outbox] AS \
         SELECT {cols}, CAST(NULL AS datetime2(6)) AS [dequeued_at] FROM {s}.[relay_cursor] c \
         JOIN {s}.[outbox_row] o ON o.[partition] = c.[partition] AND o.[id] > c.[last_id] \
         UNION ALL \
         SELECT {cols}, c.[updated_at] FROM {s}.[relay_cursor] c \
         JOIN {s}.[outbox_row] o ON o.[partition] = c.[partition] AND o.[id] <= c.[last_id]",
        cols = "o.[id], o.[event_id], o.[batch_id], o.[entity], o.[key], o.[partition], o.[etag], \
                o.[event], o.[commit_time], o.[enqueued_at]"
    );
    let _ = write!(
        out,
        "IF NOT EXISTS (SELECT 1 FROM sys.indexes WHERE name = N'outbox_partition_id' AND object_id = OBJECT_ID({o}))\n    \
         CREATE INDEX [outbox_partition_id] ON {s}.[outbox_row] ([partition], [id]);\n\
         IF NOT EXISTS (SELECT 1 FROM sys.indexes WHERE name = N'outbox_enqueued' AND object_id = OBJECT_ID({o}))\n    \
         CREATE INDEX [outbox_enqueued] ON {s}.[outbox_row] ([enqueued_at]);\n\
         -- From version 6: each partition's cursor stops below its first pending\n\
         -- row (a row relayed above it, out of order, is sent once more: at least\n\
         -- once, as after a crash), then dequeued_at goes.\n\
         IF COL_LENGTH({o}, N'dequeued_at') IS NOT NULL\n    \
         EXEC({from_v6});\n\
         -- The outbox as versions 1 to 6 had it, for readers: dequeued_at is null\n\
         -- above the partition's cursor, and below it the time the cursor last\n\
         -- moved (at or after the row was sent).\n\
         IF OBJECT_ID({v}, N'V') IS NULL\n    \
         EXEC({view});\n",
        o = ql(&format!("{s}.[outbox_row]")),
        v = ql(&format!("{s}.[outbox]")),
        from_v6 = ql(&from_v6),
        view = ql(&view),
    );
    out += "\n-- Version 6: global identifiers (`identifier_mapping: true`), nTangle's\n\
            -- IdentifierMapping. Written in the batch transaction of an aggregate's\n\
            -- first event, then read back for every later one (replays and explicit\n\
            -- runs included): stable. A row inserted beforehand pre-assigns the id.\n";
    out += &table(
        "identifier_mapping",
        "  [entity]     nvarchar(200) NOT NULL,\n  \
         [key]        nvarchar(900) NOT NULL,\n  \
         [global_id]  nvarchar(400) NOT NULL,\n  \
         [created_at] datetime2(6)  NOT NULL DEFAULT SYSUTCDATETIME(),\n  \
         PRIMARY KEY ([entity], [key]),\n  \
         UNIQUE ([entity], [global_id])",
    );
    let _ = write!(
        out,
        "\n-- Version 9 changes nothing here: PostgreSQL's outbox_row dropped its\n\
         -- batch_id foreign key, checked there by a trigger per row; SQL Server\n\
         -- checks it within the insert's plan.\n\
         IF NOT EXISTS (SELECT 1 FROM {s}.[schema_version] WHERE [version] = {v})\n    \
         INSERT INTO {s}.[schema_version] ([version]) VALUES ({v});\n",
        v = SIDECAR_SCHEMA_VERSION,
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_window_closes_at_an_lsn_boundary() {
        // Fits: up to max.
        assert_eq!(cap_window(&[1, 1, 2], 5, 9), Some(9));
        assert_eq!(cap_window::<u32>(&[], 5, 9), None);
        // Cap 3 over [1, 2, 2, 3]: LSN 2 has a change past the cap, so stop at 1.
        assert_eq!(cap_window(&[1, 2, 2, 3], 2, 9), Some(1));
        assert_eq!(cap_window(&[1, 2, 2, 3], 3, 9), Some(2));
        // One transaction larger than the cap is the window alone (read in parts).
        assert_eq!(cap_window(&[4, 4, 4, 4], 3, 9), Some(4));
    }

    proptest::proptest! {
        /// Whatever the LSNs, the batch never splits an LSN and never
        /// exceeds the cap unless one LSN alone does.
        #[test]
        fn windows_never_split_a_transaction(mut lsns in proptest::collection::vec(0u16..20, 1..40), cap in 1usize..10) {
            lsns.sort();
            let shown: Vec<u16> = lsns.iter().copied().take(cap + 1).collect();
            let upper = cap_window(&shown, cap, 100).unwrap();
            let taken = lsns.iter().filter(|l| **l <= upper).count();
            let next_excluded = lsns.iter().find(|l| **l > upper);
            if shown.len() > cap {
                let single = lsns.iter().filter(|l| **l == lsns[0]).count();
                proptest::prop_assert!(taken <= cap || upper == lsns[0] && taken == single);
            }
            // Every change of an included LSN is included.
            if let Some(n) = next_excluded {
                proptest::prop_assert!(*n > upper);
            }
        }
    }

    /// `datetime` / `smalldatetime` key texts carry more fractional
    /// digits than those types read from a string: through `datetime2(7)`.
    #[test]
    fn key_texts_are_converted_to_their_column_type() {
        assert_eq!(
            key_from_text("datetime", "k.[v0]"),
            "TRY_CONVERT(datetime, TRY_CONVERT(datetime2(7), k.[v0]))"
        );
        assert_eq!(
            key_from_text("smalldatetime", "k.[v1]"),
            "TRY_CONVERT(smalldatetime, TRY_CONVERT(datetime2(7), k.[v1]))"
        );
        for ty in [
            "datetime2(7)",
            "datetimeoffset(7)",
            "time(7)",
            "int",
            "nvarchar(50)",
        ] {
            assert_eq!(key_from_text(ty, "x"), format!("TRY_CONVERT({ty}, x)"));
        }
    }

    #[test]
    fn quoting() {
        assert_eq!(qi("a]b"), "[a]]b]");
        assert_eq!(ql("it's"), "N'it''s'");
        assert_eq!(capture_instance("dbo", "customer"), "dbo_customer");
    }
}
