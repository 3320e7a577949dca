//! Generated SQL is frozen: golden files under `tests/golden/sql/`
//! (`UPDATE_GOLDEN=1` rewrites them; review the diff).

use std::path::PathBuf;

use skein_common::config::{expand_env, Source};
use skein_common::Config;
use skein_sql::postgres::{hydrate_sql, resolve_sql, row_columns_sql, sidecar_ddl, source_ddl};
use skein_sql::sqlserver;
use skein_sql::{Catalog, ColumnInfo, TableInfo};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn quickstart() -> (Config, Catalog) {
    let text = std::fs::read_to_string(root().join("examples/quickstart/skein.yaml")).unwrap();
    let text = expand_env(&text, "skein.yaml", |_| Some("postgres://u@h/db".into())).unwrap();
    let cfg = Config::from_yaml(&text, "skein.yaml").unwrap();
    let col = |name: &str, data_type: &str, type_name: &str| ColumnInfo {
        name: name.into(),
        data_type: data_type.into(),
        type_name: type_name.into(),
        nullable: true,
    };
    let int = |n: &str| col(n, "integer", "int4");
    let text_col = |n: &str| col(n, "text", "text");
    let mut cat = Catalog::default();
    let mut add = |table: &str, pk: &[&str], columns: Vec<ColumnInfo>| {
        cat.insert(TableInfo {
            schema: "public".into(),
            table: table.into(),
            columns,
            primary_key: pk.iter().map(|s| s.to_string()).collect(),
            replica_identity: 'd',
        })
    };
    add(
        "customer",
        &["id"],
        vec![
            int("id"),
            text_col("name"),
            text_col("email"),
            col("credit_limit", "numeric", "numeric"),
            col("is_deleted", "boolean", "bool"),
            int("row_version"),
            col("created_at", "timestamp with time zone", "timestamptz"),
        ],
    );
    add(
        "address",
        &["id"],
        vec![
            int("id"),
            int("customer_id"),
            text_col("kind"),
            text_col("city"),
        ],
    );
    add(
        "address_line",
        &["address_id", "line_no"],
        vec![int("address_id"), int("line_no"), text_col("text")],
    );
    add(
        "contact",
        &["customer_id", "kind"],
        vec![int("customer_id"), text_col("kind"), text_col("value")],
    );
    (cfg, cat)
}

fn check(name: &str, text: &str) {
    let path = root().join("tests/golden/sql").join(name);
    if std::env::var("UPDATE_GOLDEN").is_ok() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, text).unwrap();
        return;
    }
    let want = std::fs::read_to_string(&path).unwrap_or_else(|_| {
        panic!(
            "missing {}; run with UPDATE_GOLDEN=1 and review",
            path.display()
        )
    });
    assert_eq!(
        text,
        want,
        "{} changed: generated SQL is frozen",
        path.display()
    );
}

#[test]
fn postgres_source_ddl_is_frozen() {
    let (cfg, cat) = quickstart();
    let Source::Postgres(pg) = &cfg.source else {
        panic!("the quickstart reads PostgreSQL")
    };
    check(
        "postgres_source_quickstart.sql",
        &source_ddl(&cfg, pg, &cat),
    );
}

#[test]
fn postgres_sidecar_ddl_is_frozen() {
    check("postgres_sidecar.sql", &sidecar_ddl("skein"));
}

#[test]
fn postgres_hydration_and_lookup_queries_are_frozen() {
    let (cfg, cat) = quickstart();
    let e = &cfg.entities[0];
    let nodes = e.nodes();
    let mut out = String::new();
    for (i, n) in nodes.iter().enumerate() {
        out.push_str(&format!(
            "-- hydrate {} ({})\n{};\n\n",
            n.name,
            n.qualified(),
            hydrate_sql(e, &nodes, i, &cat)
        ));
    }
    out.push_str(&format!(
        "-- resolve roots of lines (grandchild)\n{};\n",
        resolve_sql(&nodes, 2, &cat)
    ));
    out.push_str(&format!(
        "\n-- unchanged TOAST values of contact, by key\n{};\n",
        row_columns_sql(
            cat.table("public", "contact").unwrap(),
            &["customer_id".into()]
        )
    ));
    for (what, filter, after) in [
        ("all, first page", None, false),
        ("all, after a key", None, true),
        ("--where, after a key", Some("region = 'EU'"), true),
    ] {
        out.push_str(&format!(
            "\n-- explicit: root keys, {what}\n{};\n",
            skein_sql::postgres::explicit_keys_sql(&nodes[0], &cat, filter, after)
        ));
    }
    out.push_str(&format!(
        "\n-- explicit: given keys as the source prints them\n{};\n",
        skein_sql::postgres::normalize_keys_sql(&nodes[0], &cat)
    ));
    check("postgres_queries_quickstart.sql", &out);
}

/// One fixture table: `(table, primary key, [(column, type)])`.
type FixtureTable<'a> = (&'a str, &'a [&'a str], &'a [(&'a str, &'a str)]);

/// A catalog of SQL Server tables.
fn mssql_catalog(schema: &str, tables: &[FixtureTable]) -> Catalog {
    let mut cat = Catalog::default();
    for (table, pk, cols) in tables {
        cat.insert(TableInfo {
            schema: schema.into(),
            table: (*table).into(),
            columns: cols
                .iter()
                .map(|(n, t)| ColumnInfo {
                    name: (*n).into(),
                    data_type: (*t).into(),
                    type_name: t.split('(').next().unwrap().into(),
                    nullable: true,
                })
                .collect(),
            primary_key: pk.iter().map(|s| s.to_string()).collect(),
            replica_identity: 'd',
        });
    }
    cat
}

/// The quickstart entities on SQL Server (schema `dbo`).
fn quickstart_mssql() -> (Config, Catalog) {
    let text = std::fs::read_to_string(root().join("examples/quickstart/skein.yaml"))
        .unwrap()
        .replace("kind: postgres", "kind: sqlserver")
        .replace(
            "sidecar:\n",
            "sidecar:\n  url: postgres://skein@sidecar/skein\n",
        )
        .replace("    schema: public\n", "    schema: dbo\n");
    let text = expand_env(&text, "skein.yaml", |_| {
        Some("server=tcp:h,1433;database=crm;user=u;password=p".into())
    })
    .unwrap();
    let cfg = Config::from_yaml(&text, "skein.yaml").unwrap();
    let cat = mssql_catalog(
        "dbo",
        &[
            (
                "customer",
                &["id"],
                &[
                    ("id", "int"),
                    ("name", "nvarchar(200)"),
                    ("email", "nvarchar(320)"),
                    ("credit_limit", "decimal(12,2)"),
                    ("is_deleted", "bit"),
                    ("row_version", "int"),
                    ("created_at", "datetimeoffset(7)"),
                ],
            ),
            (
                "address",
                &["id"],
                &[
                    ("id", "int"),
                    ("customer_id", "int"),
                    ("kind", "nvarchar(20)"),
                    ("city", "nvarchar(100)"),
                ],
            ),
            (
                "address_line",
                &["address_id", "line_no"],
                &[
                    ("address_id", "int"),
                    ("line_no", "int"),
                    ("text", "nvarchar(200)"),
                ],
            ),
            (
                "contact",
                &["customer_id", "kind"],
                &[
                    ("customer_id", "int"),
                    ("kind", "nvarchar(20)"),
                    ("value", "nvarchar(200)"),
                ],
            ),
        ],
    );
    (cfg, cat)
}

/// Three levels, a composite root key and a one-to-one join.
fn orders_mssql() -> (Config, Catalog) {
    let cfg = Config::from_yaml(
        r#"
name: orders
source: { kind: sqlserver, url: "server=tcp:h,1433;database=shop" }
sidecar: { url: "postgres://skein@sidecar/skein" }
entities:
  - name: order
    schema: sales
    table: order
    exclude_columns_from_etag: [row_version]
    joins:
      - { name: lines, table: order_line, schema: sales,
          on: [{ name: tenant_id, to_column: tenant_id }, { name: order_no, to_column: order_no }] }
      - { name: discounts, table: line_discount, schema: sales, join_to: lines,
          on: [{ name: tenant_id, to_column: tenant_id }, { name: order_no, to_column: order_no },
               { name: line_no, to_column: line_no }] }
      - { name: shipping, table: order_shipping, schema: sales, cardinality: one_to_one,
          on: [{ name: tenant_id, to_column: tenant_id }, { name: order_no, to_column: order_no }] }
"#,
        "orders.yaml",
    )
    .unwrap();
    let cat = mssql_catalog(
        "sales",
        &[
            (
                "order",
                &["tenant_id", "order_no"],
                &[
                    ("tenant_id", "uniqueidentifier"),
                    ("order_no", "bigint"),
                    ("placed_at", "datetime2(7)"),
                    ("total", "money"),
                    ("note", "nvarchar(max)"),
                    ("row_version", "rowversion"),
                ],
            ),
            (
                "order_line",
                &["tenant_id", "order_no", "line_no"],
                &[
                    ("tenant_id", "uniqueidentifier"),
                    ("order_no", "bigint"),
                    ("line_no", "smallint"),
                    ("sku", "varchar(40)"),
                    ("qty", "decimal(9,3)"),
                ],
            ),
            (
                "line_discount",
                &["discount_id"],
                &[
                    ("discount_id", "int"),
                    ("tenant_id", "uniqueidentifier"),
                    ("order_no", "bigint"),
                    ("line_no", "smallint"),
                    ("percent", "decimal(5,2)"),
                ],
            ),
            (
                "order_shipping",
                &["tenant_id", "order_no"],
                &[
                    ("tenant_id", "uniqueidentifier"),
                    ("order_no", "bigint"),
                    ("ship_on", "date"),
                    ("label", "varbinary(max)"),
                ],
            ),
        ],
    );
    (cfg, cat)
}

fn mssql_all(cfg: &Config, cat: &Catalog) -> String {
    let mut out = format!(
        "-- skein sql source --dialect sqlserver\n{}\n",
        sqlserver::source_ddl(cfg, cat)
    );
    let tracked = skein_sql::postgres::tracked_tables(cfg, cat);
    let cis: Vec<String> = tracked
        .iter()
        .map(|t| sqlserver::capture_instance(&t.schema, &t.table))
        .collect();
    out.push_str(&format!(
        "-- validity intervals of the capture instances\n{};\n\n",
        sqlserver::min_lsns_sql(cis.len())
    ));
    out.push_str(&format!(
        "-- the batch cap\n{};\n\n",
        sqlserver::window_sql(&cis)
    ));
    out.push_str(&format!(
        "-- DDL in the batch's window\n{};\n\n",
        sqlserver::schema::ddl_history_sql(cis.len())
    ));
    for t in &tracked {
        let cols: Vec<String> = t.columns.iter().cloned().collect();
        out.push_str(&format!(
            "-- changes of {}.{}\n{};\n\n",
            t.schema,
            t.table,
            sqlserver::changes_sql(&sqlserver::capture_instance(&t.schema, &t.table), &cols)
        ));
        out.push_str(&format!(
            "-- a part of a large transaction, from {}.{}\n{};\n\n",
            t.schema,
            t.table,
            sqlserver::part_sql(&sqlserver::capture_instance(&t.schema, &t.table), &cols)
        ));
        out.push_str(&format!(
            "-- what a restart finds handed over of a large transaction, from {}.{}\n{};\n\n",
            t.schema,
            t.table,
            sqlserver::handed_over_sql(&sqlserver::capture_instance(&t.schema, &t.table))
        ));
    }
    for e in &cfg.entities {
        let nodes = e.nodes();
        let key_count = cat.key_columns(&nodes[0]).len();
        for (i, n) in nodes.iter().enumerate().skip(1) {
            if skein_sql::postgres::direct_root_mapping(&nodes, i, cat).is_none() {
                out.push_str(&format!(
                    "-- root lookup of {} ({})\n{}\n{};\n{};\n\n",
                    n.name,
                    n.qualified(),
                    sqlserver::lookup_table_sql(n.on.len()),
                    sqlserver::temp_insert_sql(sqlserver::LOOKUP_TABLE, n.on.len(), 1),
                    sqlserver::lookup_sql(&nodes, i, cat)
                ));
            }
        }
        out.push_str(&format!(
            "-- the batch's root keys\n{}\n\n",
            sqlserver::keys_table_sql(key_count)
        ));
        out.push_str(&format!(
            "-- two root keys into it ({} per statement at most)\n{};\n\n",
            sqlserver::keys_per_insert(key_count),
            sqlserver::keys_insert_sql(key_count, 2)
        ));
        for (i, n) in nodes.iter().enumerate() {
            out.push_str(&format!(
                "-- hydrate {} ({})\n{};\n\n",
                n.name,
                n.qualified(),
                sqlserver::hydrate_sql(&nodes, i, cat)
            ));
        }
        for (what, filter, after) in [
            ("all, first page", None, false),
            ("all, after a key", None, true),
            ("--where, after a key", Some("region = N'EU'"), true),
        ] {
            out.push_str(&format!(
                "-- explicit: root keys, {what}\n{};\n\n",
                sqlserver::explicit_keys_sql(&nodes[0], cat, filter, after)
            ));
        }
    }
    out
}

#[test]
fn sqlserver_quickstart_tsql_is_frozen() {
    let (cfg, cat) = quickstart_mssql();
    check("sqlserver_quickstart.sql", &mssql_all(&cfg, &cat));
}

#[test]
fn sqlserver_three_levels_composite_key_one_to_one_tsql_is_frozen() {
    let (cfg, cat) = orders_mssql();
    check("sqlserver_orders.sql", &mssql_all(&cfg, &cat));
}

#[test]
fn sqlserver_sidecar_ddl_is_frozen() {
    check("sqlserver_sidecar.sql", &sqlserver::sidecar_ddl("skein"));
}

/// The SQL Server statements that do not depend on the entities.
#[test]
fn sqlserver_source_statements_are_frozen() {
    let text = [
        ("upper bound of a window", sqlserver::MAX_LSN_SQL),
        (
            "capture instances of a table",
            sqlserver::CAPTURE_INSTANCES_SQL,
        ),
        ("catalog of a table", sqlserver::CATALOG_SQL),
        ("CDC enabled on the database", sqlserver::CDC_ENABLED_SQL),
        (
            "columns a capture instance holds",
            sqlserver::CAPTURED_COLUMNS_SQL,
        ),
        ("the capture job", sqlserver::CAPTURE_JOB_SQL),
        (
            "the cleanup job's retention",
            sqlserver::CLEANUP_RETENTION_SQL,
        ),
        ("how long ago a change committed", sqlserver::CHANGE_AGE_SQL),
        ("the agent", sqlserver::AGENT_STATUS_SQL),
        ("capture errors", sqlserver::LOG_SCAN_ERRORS_SQL),
        ("commit times", sqlserver::LSN_TIME_SQL),
        (
            "commit times, the time zone unknown",
            sqlserver::LSN_TIME_CURRENT_OFFSET_SQL,
        ),
        ("server version and edition", sqlserver::SERVER_VERSION_SQL),
        ("the server's time zone", sqlserver::CURRENT_TIME_ZONE_SQL),
        ("a configured time zone", sqlserver::TIME_ZONE_KNOWN_SQL),
    ]
    .iter()
    .map(|(what, sql)| format!("-- {what}\n{sql};\n"))
    .collect::<Vec<_>>()
    .join("\n");
    check("sqlserver_source_statements.sql", &text);
}

#[test]
fn sqlserver_sidecar_statements_are_frozen() {
    use sqlserver::sidecar as sc;
    let s = "skein";
    // The DDL inside `migrate` is sqlserver_sidecar.sql: pinned there, named here.
    let ddl = sqlserver::sidecar_ddl(s);
    let migrate = sc::migrate_sql(s);
    assert_eq!(migrate.matches(ddl.as_str()).count(), 1, "{migrate}");
    let text = [
        (
            "migrate",
            migrate.replace(&ddl, "-- (the DDL of sqlserver_sidecar.sql)"),
        ),
        ("progress of a partition", sc::progress_sql(s)),
        ("an applier takes a partition", sc::claim_progress_sql(s)),
        ("progress of every partition", sc::progress_all_sql(s)),
        (
            "forget partitions' progress (re-keying)",
            sc::forget_progress_sql(s),
        ),
        ("partition count of a topic", sc::partitions_sql(s)),
        ("record the partition count", sc::record_partitions_sql(s)),
        ("batch transaction 1a: fence", sc::advance_progress_sql(s)),
        (
            "batch transaction 1b: first progress",
            sc::first_progress_sql(s),
        ),
        ("batch transaction 2: batch row", sc::batch_insert_sql(s)),
        (
            "batch transaction 3a: the partition's outbox lock and relay cursor",
            sc::outbox_lock_sql(s),
        ),
        (
            "batch transaction 3: two outbox rows",
            sc::outbox_insert_sql(s, 2),
        ),
        (
            "batch transaction 4: two versions",
            sc::versions_merge_sql(s, 2),
        ),
        ("versions of three keys", sc::versions_sql(s, 3)),
        ("truncate: the keys to re-check", sc::published_keys_sql(s)),
        (
            "the newest schema version applied",
            sc::schema_version_sql(s),
        ),
        ("pending outbox", sc::pending_sql(s)),
        ("relay, all partitions", sc::relay_select_sql(s, None)),
        (
            "relay, owned partitions",
            sc::relay_select_sql(s, Some(&[0, 3])),
        ),
        (
            "relay: move the cursors of partitions 0 and 3",
            sc::relay_mark_sql(s, &[(0, 41), (3, 42)]),
        ),
        ("relay lease, all partitions", sc::relay_lease_sql(true)),
        ("relay lease, owned partitions", sc::relay_lease_sql(false)),
        ("relay: report its state", sc::relay_report_sql(s)),
        ("status: relay states", sc::relay_states_sql(s)),
        ("replay: rewind a partition", sc::rewind_sql(s)),
        (
            "replay --republish: forget two versions",
            sc::forget_versions_sql(s, 2),
        ),
        (
            "explicit: the unfinished run to resume",
            sc::explicit_find_sql(s),
        ),
        ("explicit: a new run", sc::explicit_insert_sql(s)),
        (
            "explicit chunk 1: move the cursor",
            sc::explicit_advance_sql(s),
        ),
        (
            "explicit chunk 2: queue two keys",
            sc::explicit_enqueue_sql(s, 2),
        ),
        (
            "explicit: a partition's queued keys",
            sc::explicit_pending_sql(s),
        ),
        (
            "batch transaction 1c: explicit keys before the first progress, lock",
            sc::lock_absent_progress_sql(s),
        ),
        (
            "batch transaction 5: explicit keys off the queue",
            sc::explicit_done_sql(s, &[41, 42]),
        ),
        ("status: explicit runs", sc::explicit_runs_sql(s)),
        ("explicit: one run", sc::explicit_run_sql(s)),
        ("global identifiers of 2 keys", sc::identifiers_sql(s, 2)),
        (
            "relay: purge relayed rows past their retention",
            sc::purge_outbox_sql(s),
        ),
        (
            "new global identifiers (2 rows), before the batch transaction",
            sc::identifiers_insert_sql(s, 2),
        ),
        (
            "keys holding 2 global identifiers",
            sc::identifier_holders_sql(s, 2),
        ),
        (
            "start-up: identifiers of an entity-name namespace at odds with its table's",
            sc::identifier_conflicts_sql(s),
        ),
        (
            "start-up: identifiers moved to the table's namespace, 1 of 2",
            sc::identifiers_move_sql(s)[0].clone(),
        ),
        (
            "start-up: identifiers moved to the table's namespace, 2 of 2",
            sc::identifiers_move_sql(s)[1].clone(),
        ),
    ]
    .iter()
    .map(|(what, sql)| format!("-- {what}\n{sql};\n"))
    .collect::<Vec<_>>()
    .join("\n");
    check("sqlserver_sidecar_statements.sql", &text);
}

#[test]
fn postgres_sidecar_statements_are_frozen() {
    use skein_sql::postgres::sidecar as sc;
    let s = "skein";
    // The DDL inside `migrate` is postgres_sidecar.sql: pinned there, named here.
    let ddl = sidecar_ddl(s);
    let migrate = sc::migrate_sql(s);
    assert_eq!(migrate.matches(ddl.as_str()).count(), 1, "{migrate}");
    let text = [
        (
            "migrate",
            migrate.replace(&ddl, "-- (the DDL of postgres_sidecar.sql)"),
        ),
        ("progress of a partition", sc::progress_sql(s)),
        ("an applier takes a partition", sc::claim_progress_sql(s)),
        ("progress of every partition", sc::progress_all_sql(s)),
        (
            "forget partitions' progress (re-keying)",
            sc::forget_progress_sql(s),
        ),
        ("partition count of a topic", sc::partitions_sql(s)),
        ("record the partition count", sc::record_partitions_sql(s)),
        ("batch transaction 1a: fence", sc::advance_progress_sql(s)),
        (
            "batch transaction 1b: first progress",
            sc::first_progress_sql(s),
        ),
        (
            "batch transaction, fenced: the position found",
            sc::fenced_position_sql(s),
        ),
        ("batch transaction 2: batch row", sc::batch_insert_sql(s)),
        (
            "batch transaction 3a: the partition's outbox lock ($1 = 'skein.outbox.skein')",
            sc::outbox_lock_sql().to_string(),
        ),
        (
            "batch transaction 3a: the partition's relay cursor",
            sc::relay_cursor_ensure_sql(s),
        ),
        ("batch transaction 3: outbox rows", sc::outbox_insert_sql(s)),
        ("batch transaction 4: versions", sc::versions_upsert_sql(s)),
        ("versions of some keys", sc::versions_sql(s)),
        ("truncate: the keys to re-check", sc::published_keys_sql(s)),
        (
            "the newest schema version applied",
            sc::schema_version_sql(s),
        ),
        ("pending outbox", sc::pending_sql(s)),
        (
            "relay: lock the cursors with rows above them, all partitions ($1 null) \
             or owned ones ($2 = 'skein.outbox.skein')",
            sc::relay_lock_sql(s),
        ),
        (
            "relay: the rows above the cursors the round takes ($1 as above; $2 rows)",
            sc::relay_select_sql(s),
        ),
        ("relay: move the cursors", sc::relay_mark_sql(s)),
        (
            "relay lease, all partitions ($1 = 'skein.relay.skein')",
            sc::relay_lease_sql(true).to_string(),
        ),
        (
            "relay lease, owned partitions",
            sc::relay_lease_sql(false).to_string(),
        ),
        (
            "relay lease holders",
            sc::relay_lease_holders_sql().to_string(),
        ),
        ("relay: report its state", sc::relay_report_sql(s)),
        ("status: relay states", sc::relay_states_sql(s)),
        ("replay: rewind a partition", sc::rewind_sql(s)),
        (
            "replay --republish: forget versions",
            sc::forget_versions_sql(s),
        ),
        (
            "explicit: the unfinished run to resume",
            sc::explicit_find_sql(s),
        ),
        ("explicit: a new run", sc::explicit_insert_sql(s)),
        (
            "explicit chunk 1: move the cursor",
            sc::explicit_advance_sql(s),
        ),
        ("explicit chunk 2: queue keys", sc::explicit_enqueue_sql(s)),
        (
            "explicit: a partition's queued keys",
            sc::explicit_pending_sql(s),
        ),
        (
            "batch transaction 1c: explicit keys before the first progress, lock",
            sc::lock_absent_progress_sql(s)[0].clone(),
        ),
        (
            "batch transaction 1c: explicit keys before the first progress, unlock",
            sc::lock_absent_progress_sql(s)[1].clone(),
        ),
        (
            "batch transaction 6: explicit keys off the queue",
            sc::explicit_done_sql(s),
        ),
        ("status: explicit runs", sc::explicit_runs_sql(s)),
        ("explicit: one run", sc::explicit_run_sql(s)),
        ("global identifiers of some keys", sc::identifiers_sql(s)),
        (
            "relay: purge relayed rows past their retention",
            sc::purge_outbox_sql(s),
        ),
        (
            "new global identifiers, before the batch transaction",
            sc::identifiers_insert_sql(s),
        ),
        (
            "keys holding global identifiers",
            sc::identifier_holders_sql(s),
        ),
        (
            "start-up: identifiers of an entity-name namespace at odds with its table's",
            sc::identifier_conflicts_sql(s),
        ),
        (
            "start-up: identifiers moved to the table's namespace, 1 of 2",
            sc::identifiers_move_sql(s)[0].clone(),
        ),
        (
            "start-up: identifiers moved to the table's namespace, 2 of 2",
            sc::identifiers_move_sql(s)[1].clone(),
        ),
    ]
    .iter()
    .map(|(what, sql)| format!("-- {what}\n{sql};\n"))
    .collect::<Vec<_>>()
    .join("\n");
    check("postgres_sidecar_statements.sql", &text);
}
