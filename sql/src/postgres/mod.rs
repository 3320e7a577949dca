//! PostgreSQL dialect: CDC enablement, sidecar DDL, catalog, resolution and
//! hydration queries. The sidecar's statements are in [`sidecar`]; the
//! catalog reads of validate and status in [`admin`].

pub mod admin;
pub mod catalog;
pub mod client;
pub mod schema;
pub mod sidecar;

use std::collections::BTreeSet;
use std::fmt::Write as _;

use skein_common::config::{Config, EntityConfig, PostgresSource, TableNode};

pub use self::schema::{
    check_schema_change, check_schema_change_by, describe_change, named_columns, schema_stop,
    schema_stop_then, schema_stop_with, value_format, ValueFormat,
};

use crate::catalog::{Catalog, ColumnInfo, TableInfo};
use crate::{quote_ident as qi, quote_literal as ql};

/// Sidecar schema version written by [`sidecar_ddl`].
pub const SIDECAR_SCHEMA_VERSION: i32 = 9;

/// Most columns put into one `json(b)_build_object` call (PostgreSQL allows
/// 100 arguments, i.e. 50 pairs); wider rows are built in chunks joined by `||`.
const JSON_CHUNK: usize = 40;

/// A problem that stops SQL from being generated.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SqlError {
    /// A configured table is not in the source.
    #[error("table {schema}.{table} (entity `{entity}`) does not exist in the source")]
    MissingTable {
        entity: String,
        schema: String,
        table: String,
    },
    /// A configured column is not in its table.
    #[error("column `{column}` of {schema}.{table} (entity `{entity}`, {field}) does not exist")]
    MissingColumn {
        entity: String,
        schema: String,
        table: String,
        column: String,
        field: &'static str,
    },
    /// A column a key, a join or the logical delete relies on changed its
    /// value format under a running pipeline.
    #[error(
        "column `{column}` of {schema}.{table} (entity `{entity}`, {field}) changed type from \
         {from} to {to}, which gives its values another form"
    )]
    RetypedColumn {
        entity: String,
        schema: String,
        table: String,
        column: String,
        field: &'static str,
        from: String,
        to: String,
    },
    /// The primary key a node's key comes from changed under a running pipeline.
    #[error(
        "the primary key of {schema}.{table} (entity `{entity}`, key) changed from {from:?} to {to:?}"
    )]
    KeyChanged {
        entity: String,
        schema: String,
        table: String,
        from: Vec<String>,
        to: Vec<String>,
    },
    /// A table has neither a configured key nor a primary key.
    #[error("{schema}.{table} (entity `{entity}`) has no primary key: add one or set `key:` in the config")]
    NoKey {
        entity: String,
        schema: String,
        table: String,
    },
}

/// Checks that every configured table and column exists in the catalog.
pub fn check_catalog(cfg: &Config, catalog: &Catalog) -> Vec<SqlError> {
    let mut errors = vec![];
    for e in &cfg.entities {
        let nodes = e.nodes();
        for n in &nodes {
            let Some(t) = catalog.node(n) else {
                errors.push(SqlError::MissingTable {
                    entity: e.name.clone(),
                    schema: n.schema.clone(),
                    table: n.table.clone(),
                });
                continue;
            };
            let want = named_columns(e, &nodes, n);
            for (c, field) in want {
                if t.column(c).is_none() {
                    errors.push(SqlError::MissingColumn {
                        entity: e.name.clone(),
                        schema: n.schema.clone(),
                        table: n.table.clone(),
                        column: c.to_string(),
                        field,
                    });
                }
            }
            if catalog.key_columns(n).is_empty() {
                errors.push(SqlError::NoKey {
                    entity: e.name.clone(),
                    schema: n.schema.clone(),
                    table: n.table.clone(),
                });
            }
        }
    }
    errors
}

/// What CDC needs from one tracked table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TrackedTable {
    /// Schema.
    pub schema: String,
    /// Table.
    pub table: String,
    /// Columns the change stream must carry (key and join columns), sorted.
    pub columns: BTreeSet<String>,
    /// Whether deletes/updates need `REPLICA IDENTITY FULL` to carry the join
    /// columns (they are not all in the primary key).
    pub needs_full_identity: bool,
}

/// Every table tracked by any entity, with the columns CDC must carry.
pub fn tracked_tables(cfg: &Config, catalog: &Catalog) -> Vec<TrackedTable> {
    let mut out: Vec<TrackedTable> = vec![];
    for e in &cfg.entities {
        for n in e.nodes().iter().filter(|n| n.tracked()) {
            let key = catalog.key_columns(n);
            let pk: BTreeSet<String> = catalog
                .node(n)
                .map(|t| t.primary_key.iter().cloned().collect())
                .unwrap_or_default();
            let mut cols: BTreeSet<String> = key.iter().cloned().collect();
            cols.extend(n.on.iter().map(|o| o.name.clone()));
            let needs_full = pk.is_empty() || !cols.iter().all(|c| pk.contains(c));
            if let Some(t) = out
                .iter_mut()
                .find(|t| t.schema == n.schema && t.table == n.table)
            {
                t.columns.extend(cols);
                t.needs_full_identity |= needs_full;
            } else {
                out.push(TrackedTable {
                    schema: n.schema.clone(),
                    table: n.table.clone(),
                    columns: cols,
                    needs_full_identity: needs_full,
                });
            }
        }
    }
    out
}

/// `skein sql source` for PostgreSQL: replica identities and the publication,
/// idempotent (safe to run again after a config change).
pub fn source_ddl(cfg: &Config, source: &PostgresSource, catalog: &Catalog) -> String {
    let tables = tracked_tables(cfg, catalog);
    let mut s = String::new();
    let _ = writeln!(
        s,
        "-- skein: PostgreSQL CDC enablement for pipeline {}.\n\
         -- Needs wal_level = logical (ALTER SYSTEM SET wal_level = logical; then restart).\n\
         -- The publication carries only key and join columns: skein reads the\n\
         -- latest state of an aggregate from the tables themselves.",
        ql(&cfg.name)
    );
    for t in &tables {
        if t.needs_full_identity {
            let _ = writeln!(
                s,
                "\n-- {}.{}: deletes must carry {} which the primary key does not hold.\n\
                 ALTER TABLE {}.{} REPLICA IDENTITY FULL;",
                t.schema,
                t.table,
                t.columns.iter().cloned().collect::<Vec<_>>().join(", "),
                qi(&t.schema),
                qi(&t.table)
            );
        }
    }
    let pubname = &source.publication;
    let _ = writeln!(
        s,
        "\nDO $$\nBEGIN\n  IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_publication WHERE pubname = {}) THEN\n    CREATE PUBLICATION {};\n  END IF;\nEND\n$$;",
        ql(pubname),
        qi(pubname)
    );
    let list: Vec<String> = tables
        .iter()
        .map(|t| {
            if t.needs_full_identity {
                // With REPLICA IDENTITY FULL every column is part of the
                // identity, and PostgreSQL requires a column list to contain
                // the identity: publish the whole row.
                format!("{}.{}", qi(&t.schema), qi(&t.table))
            } else {
                format!(
                    "{}.{} ({})",
                    qi(&t.schema),
                    qi(&t.table),
                    t.columns
                        .iter()
                        .map(|c| qi(c))
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            }
        })
        .collect();
    // TRUNCATE names no rows: with `on_truncate: recheck` (the default) the
    // appliers re-check what they published; with `stop` it is not
    // published (skein stops if one arrives anyway). Left out with
    // `recheck`, a TRUNCATE would pass unseen and its aggregates go stale.
    let publish = match cfg.extractor.on_truncate {
        skein_common::config::OnTruncate::Recheck => "insert, update, delete, truncate",
        skein_common::config::OnTruncate::Stop => "insert, update, delete",
    };
    let _ = writeln!(
        s,
        "ALTER PUBLICATION {} SET (publish = '{publish}');",
        qi(pubname)
    );
    let _ = writeln!(
        s,
        "ALTER PUBLICATION {} SET TABLE\n  {};",
        qi(pubname),
        list.join(",\n  ")
    );
    let _ = writeln!(
        s,
        "\n-- The replication slot is created by `skein run` / `skein extract` on first start;\n\
         -- to create it yourself:\n\
         -- SELECT pg_create_logical_replication_slot({}, 'pgoutput');",
        ql(&source.slot)
    );
    s
}

/// `skein sql sidecar` for PostgreSQL. Idempotent; applied by `skein sidecar migrate`.
pub fn sidecar_ddl(schema: &str) -> String {
    let s = qi(schema);
    let lit = ql(schema);
    format!(
        r#"-- skein sidecar schema, version {v}.
CREATE SCHEMA IF NOT EXISTS {s};

CREATE TABLE IF NOT EXISTS {s}."schema_version" (
  "version"    integer     PRIMARY KEY,
  "applied_at" timestamptz NOT NULL DEFAULT now()
);

-- The exactly-once recovery marker: the last source position (in-process) or
-- the next Kafka offset each partition consumes, plus the last source change
-- applied (re-sent records at or before it are dropped). Moves only inside the
-- batch transaction. Source positions are numbers that order like the source
-- (80 bits for a SQL Server LSN, hence numeric); source_commit is the display
-- form (0/16B3748 or 0x0000002A000001F00003).
CREATE TABLE IF NOT EXISTS {s}."progress" (
  "group_name"    text        NOT NULL,
  "topic"         text        NOT NULL,
  "partition"     integer     NOT NULL,
  "position"      numeric(25,0) NOT NULL,
  "source_commit" text,
  "source_seq"    bigint,
  "epoch"         bigint      NOT NULL DEFAULT 0,
  "updated_at"    timestamptz NOT NULL DEFAULT now(),
  PRIMARY KEY ("group_name", "topic", "partition")
);
ALTER TABLE {s}."progress" ADD COLUMN IF NOT EXISTS "source_commit" text;
ALTER TABLE {s}."progress" ADD COLUMN IF NOT EXISTS "source_seq" bigint;
-- Version 4: the fencing epoch. Every ownership change (an applier taking
-- the partition) and every rewind (`skein replay`) adds one; a batch commits
-- only if both position and epoch are still what its applier read, so a
-- position written back by a rewind does not let a stale applier through.
ALTER TABLE {s}."progress" ADD COLUMN IF NOT EXISTS "epoch" bigint NOT NULL DEFAULT 0;
-- Version 5: where a TRUNCATE re-check stands. A TRUNCATE re-checks every
-- aggregate of its entity the partition published, a page of keys per batch
-- transaction; while one is under way, source_* is the truncate notice and
-- this the last key re-checked (NULL otherwise).
ALTER TABLE {s}."progress" ADD COLUMN IF NOT EXISTS "recheck_after" text;

-- Version 4: the partition count the extractor keys records by, per group
-- and topic. A different count re-keys aggregates between partitions, so
-- the extractor changes it only when no partition holds unapplied records.
CREATE TABLE IF NOT EXISTS {s}."transport" (
  "group_name" text        NOT NULL,
  "topic"      text        NOT NULL,
  "partitions" integer     NOT NULL,
  "updated_at" timestamptz NOT NULL DEFAULT now(),
  PRIMARY KEY ("group_name", "topic")
);

-- Version 4: each relay's state and last error, for `skein status`.
CREATE TABLE IF NOT EXISTS {s}."relay" (
  "name"       text        PRIMARY KEY,
  "state"      text        NOT NULL,
  "last_error" text,
  "error_at"   timestamptz,
  "updated_at" timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE IF NOT EXISTS {s}."batch" (
  "id"             bigserial   PRIMARY KEY,
  "correlation_id" uuid        NOT NULL UNIQUE,
  "group_name"     text        NOT NULL,
  "topic"          text        NOT NULL,
  "partition"      integer     NOT NULL,
  "lower_position" numeric(25,0) NOT NULL,
  "upper_position" numeric(25,0) NOT NULL,
  "record_count"   integer     NOT NULL,
  "entity_count"   integer     NOT NULL,
  "event_count"    integer     NOT NULL,
  "has_data_loss"  boolean     NOT NULL DEFAULT false,
  "dead_letters"   integer     NOT NULL DEFAULT 0,
  "created_at"     timestamptz NOT NULL DEFAULT now()
);
-- Undecodable records sent to the dead-letter topic by this batch.
ALTER TABLE {s}."batch" ADD COLUMN IF NOT EXISTS "dead_letters" integer NOT NULL DEFAULT 0;

-- Version 3: positions wide enough for SQL Server LSNs. A version 2 sidecar
-- held PostgreSQL LSNs in bigint; they keep their value and order.
DO $$
BEGIN
  IF (SELECT data_type FROM information_schema.columns WHERE table_schema = {lit}
      AND table_name = 'progress' AND column_name = 'source_commit') = 'bigint' THEN
    ALTER TABLE {s}."progress"
      ALTER COLUMN "position" TYPE numeric(25,0),
      ALTER COLUMN "source_commit" TYPE text
        USING upper(to_hex("source_commit" >> 32)) || '/' || upper(to_hex("source_commit" & 4294967295));
    ALTER TABLE {s}."batch"
      ALTER COLUMN "lower_position" TYPE numeric(25,0),
      ALTER COLUMN "upper_position" TYPE numeric(25,0);
  END IF;
END $$;

CREATE TABLE IF NOT EXISTS {s}."version" (
  "entity"     text        NOT NULL,
  "key"        text        NOT NULL,
  "etag"       text,
  "is_deleted" boolean     NOT NULL DEFAULT false,
  "updated_at" timestamptz NOT NULL DEFAULT now(),
  PRIMARY KEY ("entity", "key")
);

-- Version 7: the outbox's rows live in outbox_row; "outbox" is a view of
-- them with dequeued_at derived from the relay's cursors (below).
DO $$
BEGIN
  IF EXISTS (SELECT 1 FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
             WHERE n.nspname = {lit} AND c.relname = 'outbox' AND c.relkind = 'r') THEN
    ALTER TABLE {s}."outbox" RENAME TO "outbox_row";
  END IF;
END $$;
CREATE TABLE IF NOT EXISTS {s}."outbox_row" (
  "id"          bigserial   PRIMARY KEY,
  "event_id"    uuid        NOT NULL UNIQUE,
  "batch_id"    bigint      NOT NULL,
  "entity"      text        NOT NULL,
  "key"         text        NOT NULL,
  "partition"   integer     NOT NULL,
  "etag"        text,
  "event"       text        NOT NULL,
  "commit_time" timestamptz NOT NULL,
  "enqueued_at" timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX IF NOT EXISTS "outbox_entity_key" ON {s}."outbox_row" ("entity", "key", "id");

-- Version 6: explicit runs (`skein explicit`, `extractor.initial_load`). A
-- run selects root keys of an entity and queues them a chunk per transaction,
-- with its cursor (the last key or index queued): a killed run resumes after
-- it. Each partition's applier takes its queued keys, publishes them in its
-- own fenced batch transaction and deletes them there: exactly once, and in
-- order with the stream of that partition.
CREATE TABLE IF NOT EXISTS {s}."explicit_run" (
  "id"         bigserial   PRIMARY KEY,
  "group_name" text        NOT NULL,
  "entity"     text        NOT NULL,
  "selection"  text        NOT NULL,
  "republish"  boolean     NOT NULL DEFAULT false,
  "initial"    boolean     NOT NULL DEFAULT false,
  "state"      text        NOT NULL DEFAULT 'selecting',
  "cursor"     text,
  "queued"     bigint      NOT NULL DEFAULT 0,
  "created_at" timestamptz NOT NULL DEFAULT now(),
  "updated_at" timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS {s}."explicit_queue" (
  "id"         bigserial   PRIMARY KEY,
  "run_id"     bigint      NOT NULL REFERENCES {s}."explicit_run" ("id"),
  "group_name" text        NOT NULL,
  "topic"      text        NOT NULL,
  "partition"  integer     NOT NULL,
  "entity"     text        NOT NULL,
  "key"        text        NOT NULL,
  "republish"  boolean     NOT NULL DEFAULT false
);
CREATE INDEX IF NOT EXISTS "explicit_queue_partition" ON {s}."explicit_queue" ("group_name", "topic", "partition", "id");
CREATE INDEX IF NOT EXISTS "explicit_queue_run" ON {s}."explicit_queue" ("run_id");

-- Version 7: the relay keeps one cursor per outbox partition, the last id
-- it sent, instead of rewriting every row it sends (versions 1 to 6 set
-- outbox.dequeued_at: a new row version and four index entries per event).
-- A partition's ids grow in commit order (its batch transactions take the
-- partition's outbox lock before they write), so every row above the
-- cursor is pending and none below it is. Relayed rows are deleted after
-- `sidecar.outbox_retention_secs`, a chunk at a time, by the relay.
CREATE TABLE IF NOT EXISTS {s}."relay_cursor" (
  "partition"  integer     PRIMARY KEY,
  "last_id"    bigint      NOT NULL,
  "updated_at" timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS "outbox_partition_id" ON {s}."outbox_row" ("partition", "id");
CREATE INDEX IF NOT EXISTS "outbox_enqueued" ON {s}."outbox_row" ("enqueued_at");
-- From version 6: each partition's cursor stops below its first pending
-- row (a row relayed above it, out of order, is sent once more: at least
-- once, as after a crash), then dequeued_at goes.
DO $$
BEGIN
  IF EXISTS (SELECT 1 FROM information_schema.columns WHERE table_schema = {lit}
             AND table_name = 'outbox_row' AND column_name = 'dequeued_at') THEN
    INSERT INTO {s}."relay_cursor" ("partition", "last_id")
      SELECT "partition", coalesce(min("id") FILTER (WHERE "dequeued_at" IS NULL) - 1, max("id"))
      FROM {s}."outbox_row" GROUP BY "partition"
      ON CONFLICT DO NOTHING;
    DROP INDEX IF EXISTS {s}."outbox_pending";
    DROP INDEX IF EXISTS {s}."outbox_dequeued";
    ALTER TABLE {s}."outbox_row" DROP COLUMN "dequeued_at";
  END IF;
END $$;
-- The outbox as versions 1 to 6 had it, for readers: dequeued_at is null
-- above the partition's cursor, and below it the time the cursor last
-- moved (at or after the row was sent). `WHERE dequeued_at IS NULL` reads
-- only the rows above the cursors, by index (`OFFSET 0` keeps the planner
-- from joining the whole table to the cursors).
CREATE OR REPLACE VIEW {s}."outbox" AS
  SELECT o."id", o."event_id", o."batch_id", o."entity", o."key", o."partition", o."etag",
         o."event", o."commit_time", o."enqueued_at", NULL::timestamptz AS "dequeued_at"
  FROM {s}."relay_cursor" c CROSS JOIN LATERAL
    (SELECT * FROM {s}."outbox_row"
     WHERE ("partition", "id") > (c."partition", c."last_id")
       AND ("partition", "id") <= (c."partition", 9223372036854775807) OFFSET 0) o
  UNION ALL
  SELECT o."id", o."event_id", o."batch_id", o."entity", o."key", o."partition", o."etag",
         o."event", o."commit_time", o."enqueued_at", c."updated_at"
  FROM {s}."relay_cursor" c JOIN {s}."outbox_row" o
    ON o."partition" = c."partition" AND o."id" <= c."last_id";

-- Version 6: global identifiers (`identifier_mapping: true`), nTangle's
-- IdentifierMapping. Written in the batch transaction of an aggregate's
-- first event, then read back for every later one (replays and explicit
-- runs included): stable. A row inserted beforehand pre-assigns the id.
CREATE TABLE IF NOT EXISTS {s}."identifier_mapping" (
  "entity"     text        NOT NULL,
  "key"        text        NOT NULL,
  "global_id"  text        NOT NULL,
  "created_at" timestamptz NOT NULL DEFAULT now(),
  PRIMARY KEY ("entity", "key"),
  UNIQUE ("entity", "global_id")
);

-- Version 8 changes no table: the relay locks the cursors it moves with
-- advisory locks instead of FOR UPDATE (it holds no transaction id while it
-- sends). A version-7 relay and a version-8 one do not exclude each other,
-- so every process of a pipeline is upgraded together; one of version 7
-- started after this migration refuses the sidecar.
-- Version 9: an outbox row's batch_id is no foreign key any more. A batch's
-- outbox rows are written in the transaction that inserts its batch row,
-- and batch rows are never deleted, so the key checked nothing; its check
-- ran once per event (a trigger and a key-share lock of the batch row), a
-- third of the outbox insert's cost.
ALTER TABLE {s}."outbox_row" DROP CONSTRAINT IF EXISTS "outbox_row_batch_id_fkey";
ALTER TABLE {s}."outbox_row" DROP CONSTRAINT IF EXISTS "outbox_batch_id_fkey";
INSERT INTO {s}."schema_version" ("version") VALUES ({v}) ON CONFLICT DO NOTHING;
"#,
        v = SIDECAR_SCHEMA_VERSION
    )
}

/// Reads the catalog of the given tables: `$1` schemas, `$2` tables (text
/// arrays, pairwise). Returns one row per column, in column order:
/// `schema, table, column, data_type, type_name, nullable, pk_position, replica_identity`.
pub const CATALOG_QUERY: &str = r#"
SELECT n.nspname::text, c.relname::text, a.attname::text,
       -- character(n) keeps its length: the stream's text of a key is padded to it.
       pg_catalog.format_type(a.atttypid, CASE WHEN t.typname = 'bpchar' THEN a.atttypmod END) AS data_type,
       CASE WHEN t.typtype = 'd' THEN bt.typname ELSE t.typname END::text AS type_name,
       NOT a.attnotnull AS nullable,
       array_position(pk.conkey, a.attnum)::int4 AS pk_position,
       c.relreplident::text
FROM unnest($1::text[], $2::text[]) AS w(s, t)
JOIN pg_catalog.pg_namespace n ON n.nspname = w.s
JOIN pg_catalog.pg_class c ON c.relnamespace = n.oid AND c.relname = w.t AND c.relkind IN ('r', 'p')
JOIN pg_catalog.pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
JOIN pg_catalog.pg_type t ON t.oid = a.atttypid
LEFT JOIN pg_catalog.pg_type bt ON bt.oid = t.typbasetype
LEFT JOIN pg_catalog.pg_constraint pk ON pk.conrelid = c.oid AND pk.contype = 'p'
ORDER BY n.nspname, c.relname, a.attnum"#;

/// The JSON expression of one column value: the frozen value formats.
///
/// | type | JSON |
/// |---|---|
/// | smallint, integer, bigint, real, double precision | number |
/// | boolean | `true` / `false` |
/// | numeric, money | string with the exact decimal (`"12.50"`) |
/// | timestamptz | string, UTC, microseconds: `"2024-01-02T03:04:05.000006Z"` |
/// | timestamp | string, microseconds, no zone: `"2024-01-02T03:04:05.000006"` |
/// | date | `"2024-01-02"` |
/// | uuid | lower-case hyphenated string |
/// | bytea | standard base64 string, no line breaks |
/// | json, jsonb | the JSON value itself |
/// | text, varchar, char, anything else | the PostgreSQL text form as a string |
pub fn json_expr(alias: &str, col: &ColumnInfo) -> String {
    let c = format!("{alias}.{}", qi(&col.name));
    match col.type_name.as_str() {
        "int2" | "int4" | "int8" | "float4" | "float8" | "bool" | "json" | "jsonb" => c,
        "numeric" => format!("({c})::text"),
        "money" => format!("({c})::numeric::text"),
        "timestamptz" => {
            format!("to_char(({c}) AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"')")
        }
        "timestamp" => format!("to_char({c}, 'YYYY-MM-DD\"T\"HH24:MI:SS.US')"),
        "date" => format!("to_char({c}, 'YYYY-MM-DD')"),
        "bytea" => format!("translate(encode({c}, 'base64'), E'\\n', '')"),
        _ => format!("({c})::text"),
    }
}

/// Whether a column's JSON ([`json_expr`]) is the same text whether the
/// object holding it is built as `json` or as `jsonb`: everything but
/// floats (`jsonb` holds them as `numeric`, printed with other digits) and
/// json values (`jsonb` normalises them).
fn same_as_json(col: &ColumnInfo) -> bool {
    !matches!(
        col.type_name.as_str(),
        "float4" | "float8" | "json" | "jsonb"
    )
}

/// JSON object of the given columns. `json_build_object` when one call
/// holds them all and every one is [`same_as_json`]: it writes its
/// arguments out as they come, where `jsonb_build_object` builds a binary
/// value first, and the hydration queries run per row of every batch.
/// Otherwise `jsonb` (chunked for wide tables, joined with `||`). Once
/// parsed (keys sorted), both give the same value, so the same events
/// and etags (`json_safe_column_types_keep_their_events_and_etags`).
fn json_object(alias: &str, cols: &[&ColumnInfo]) -> String {
    if cols.is_empty() {
        return "'{}'::jsonb".into();
    }
    // `'name', value` pairs of one call.
    let call = |function: &str, cols: &[&ColumnInfo]| {
        let args: Vec<String> = cols
            .iter()
            .map(|c| format!("{}, {}", ql(&c.name), json_expr(alias, c)))
            .collect();
        format!("{function}({})", args.join(", "))
    };
    if cols.len() <= JSON_CHUNK && cols.iter().all(|c| same_as_json(c)) {
        return call("json_build_object", cols);
    }
    cols.chunks(JSON_CHUNK)
        .map(|chunk| call("jsonb_build_object", chunk))
        .collect::<Vec<_>>()
        .join(" || ")
}

fn text_array(alias: &str, cols: &[String]) -> String {
    if cols.is_empty() {
        return "'[]'".into();
    }
    let items: Vec<String> = cols
        .iter()
        .map(|c| format!("{alias}.{}::text", qi(c)))
        .collect();
    format!("json_build_array({})::text", items.join(", "))
}

fn cast_type<'a>(catalog: &'a Catalog, node: &TableNode, col: &str) -> &'a str {
    catalog
        .node(node)
        .and_then(|t| t.column(col))
        .map(|c| c.data_type.as_str())
        .unwrap_or("text")
}

/// `unnest($1::text[], …) WITH ORDINALITY AS k(v0, …, ord)`.
fn unnest_keys(n: usize) -> String {
    let params: Vec<String> = (1..=n).map(|i| format!("${i}::text[]")).collect();
    let names: Vec<String> = (0..n).map(|i| format!("v{i}")).collect();
    format!(
        "unnest({}) WITH ORDINALITY AS k({}, ord)",
        params.join(", "),
        names.join(", ")
    )
}

/// Path from the root down to `index`: node indices, root first.
pub fn path_to(nodes: &[TableNode], index: usize) -> Vec<usize> {
    let mut path = vec![index];
    let mut cur = index;
    while let Some(p) = nodes[cur].parent {
        path.push(p);
        cur = p;
    }
    path.reverse();
    path
}

/// Columns of `node` that its children join to (`to_column`s), sorted.
pub fn referenced_columns(nodes: &[TableNode], index: usize) -> Vec<String> {
    let set: BTreeSet<String> = nodes
        .iter()
        .filter(|c| c.parent == Some(index))
        .flat_map(|c| c.on.iter().map(|o| o.to_column.clone()))
        .collect();
    set.into_iter().collect()
}

/// A page of root keys for `skein explicit` (`extractor.initial_load`):
/// the keys of the entity's root, each column as the text the source
/// prints (what the change stream and hydration use), in key order, at
/// most `$n+1` of them (`$n+1` is an `int8` after the `n` key columns).
///
/// `filter`, when given, is the operator's SQL condition on the root row
/// (alias `t0`, columns unqualified resolve to it). With `after` the page
/// starts after the key whose column texts are `$1…$n` (a row comparison
/// in the columns' own types, so the key index serves it).
pub fn explicit_keys_sql(
    root: &TableNode,
    catalog: &Catalog,
    filter: Option<&str>,
    after: bool,
) -> String {
    let key = catalog.key_columns(root);
    let cols: Vec<String> = key.iter().map(|c| format!("t0.{}::text", qi(c))).collect();
    let keyset = after.then(|| {
        let lhs: Vec<String> = key.iter().map(|c| format!("t0.{}", qi(c))).collect();
        let rhs: Vec<String> = key
            .iter()
            .enumerate()
            .map(|(i, c)| format!("${}::text::{}", i + 1, cast_type(catalog, root, c)))
            .collect();
        format!("({}) > ({})", lhs.join(", "), rhs.join(", "))
    });
    let order: Vec<String> = key.iter().map(|c| format!("t0.{}", qi(c))).collect();
    format!(
        "SELECT {cols}\nFROM {schema}.{table} AS t0\n{where_}ORDER BY {order}\nLIMIT ${limit}",
        cols = cols.join(", "),
        schema = qi(&root.schema),
        table = qi(&root.table),
        where_ = explicit_where(filter, keyset),
        order = order.join(", "),
        limit = if after { key.len() + 1 } else { 1 },
    )
}

/// The `WHERE` line of an explicit key page (either dialect): the
/// operator's `filter` in parentheses, then the `keyset` condition, or
/// nothing when there is neither.
pub(crate) fn explicit_where(filter: Option<&str>, keyset: Option<String>) -> String {
    let conds: Vec<String> = filter
        .map(|f| format!("({f})"))
        .into_iter()
        .chain(keyset)
        .collect();
    if conds.is_empty() {
        String::new()
    } else {
        format!("WHERE {}\n", conds.join(" AND "))
    }
}

/// Given root keys (`skein explicit --keys`) in the text the source
/// prints: each column cast to its type and back (`01` → `1`), in the
/// given order; a value that does not cast is an error. Parameters: one
/// `text[]` per key column, pairwise.
pub fn normalize_keys_sql(root: &TableNode, catalog: &Catalog) -> String {
    let key = catalog.key_columns(root);
    let cols: Vec<String> = key
        .iter()
        .enumerate()
        .map(|(i, c)| {
            // `::text` trims a character(n) value; `concat` prints it as
            // the stream does, padded.
            let ty = cast_type(catalog, root, c);
            if ty.starts_with("character(") {
                format!("concat(k.v{i}::{ty})")
            } else {
                format!("k.v{i}::{ty}::text")
            }
        })
        .collect();
    format!(
        "SELECT {} FROM {} ORDER BY k.ord",
        cols.join(", "),
        unnest_keys(key.len())
    )
}

/// Taken first in a batch's hydration snapshot, before the snapshot
/// itself: `ACCESS SHARE` locks on `tables`, so no `ALTER TABLE` of them
/// commits until the snapshot ends.
pub fn lock_tables_sql(tables: &[(String, String)]) -> String {
    let list: Vec<String> = tables
        .iter()
        .map(|(s, t)| format!("{}.{}", qi(s), qi(t)))
        .collect();
    format!("LOCK TABLE {} IN ACCESS SHARE MODE", list.join(", "))
}

/// Hydration query of one node of an entity for a batch of root keys.
///
/// Parameters: one `text[]` per root key column (the root keys, pairwise).
/// Columns: `ord bigint` (1-based index into the key arrays), `link text`
/// (JSON array of this row's join-column values, `[]` for the root), `refs
/// text` (JSON object of the columns children join to), `data text` (the
/// row's event JSON; NULL when the root does not exist), `is_deleted bool`
/// (the logical-delete column, root only). Rows are ordered by root, then
/// by the node's key so arrays are stable (the etag depends on it).
pub fn hydrate_sql(
    entity: &EntityConfig,
    nodes: &[TableNode],
    index: usize,
    catalog: &Catalog,
) -> String {
    let path = path_to(nodes, index);
    let root = &nodes[0];
    let root_key = catalog.key_columns(root);
    let node = &nodes[index];
    let alias = |i: usize| format!("t{i}");
    let this = alias(path.len() - 1);
    let cols = catalog.event_columns(node);
    let data = json_object(&this, &cols);
    let data = if index == 0 {
        let first = root_key.first().map(String::as_str).unwrap_or("");
        format!(
            "CASE WHEN t0.{} IS NULL THEN NULL ELSE ({data})::text END",
            qi(first)
        )
    } else {
        format!("({data})::text")
    };
    let is_deleted = match (&entity.is_deleted_column, index) {
        (Some(col), 0) => format!("COALESCE((t0.{})::boolean, false)", qi(col)),
        _ => "false".into(),
    };
    let link_cols: Vec<String> = node.on.iter().map(|o| o.name.clone()).collect();
    let mut sql = format!(
        "SELECT k.ord, {link} AS link, {refs} AS refs, {data} AS data, {is_deleted} AS is_deleted\nFROM {keys}\n",
        link = text_array(&this, &link_cols),
        refs = refs_object(&this, &referenced_columns(nodes, index)),
        keys = unnest_keys(root_key.len()),
    );
    let on_root: Vec<String> = root_key
        .iter()
        .enumerate()
        .map(|(i, c)| format!("t0.{} = k.v{i}::{}", qi(c), cast_type(catalog, root, c)))
        .collect();
    sql.push_str(&path_joins_and_order(
        nodes, &path, catalog, &on_root, "k.ord", qi,
    ));
    sql
}

/// The joins from the root down to a node (`t0` … `tN`, the root left
/// joined when the node is the root) and the `ORDER BY` (root ordinal, then
/// the node's key), shared by both dialects; `quote` quotes identifiers.
pub(crate) fn path_joins_and_order(
    nodes: &[TableNode],
    path: &[usize],
    catalog: &Catalog,
    on_root: &[String],
    ord: &str,
    quote: fn(&str) -> String,
) -> String {
    let alias = |i: usize| format!("t{i}");
    let root = &nodes[0];
    let index = *path.last().expect("a path holds at least the root");
    let mut sql = String::new();
    let _ = writeln!(
        sql,
        "{} {}.{} t0 ON {}",
        if index == 0 { "LEFT JOIN" } else { "JOIN" },
        quote(&root.schema),
        quote(&root.table),
        on_root.join(" AND ")
    );
    for (depth, ni) in path.iter().enumerate().skip(1) {
        let n = &nodes[*ni];
        let conds: Vec<String> =
            n.on.iter()
                .map(|o| {
                    format!(
                        "{}.{} = {}.{}",
                        alias(depth),
                        quote(&o.name),
                        alias(depth - 1),
                        quote(&o.to_column)
                    )
                })
                .collect();
        let _ = writeln!(
            sql,
            "JOIN {}.{} {} ON {}",
            quote(&n.schema),
            quote(&n.table),
            alias(depth),
            conds.join(" AND ")
        );
    }
    let this = alias(path.len() - 1);
    let mut order = vec![ord.to_string()];
    if index != 0 {
        order.extend(
            catalog
                .key_columns(&nodes[index])
                .iter()
                .map(|c| format!("{this}.{}", quote(c))),
        );
    }
    let _ = write!(sql, "ORDER BY {}", order.join(", "));
    sql
}

fn refs_object(alias: &str, cols: &[String]) -> String {
    if cols.is_empty() {
        return "'{}'".into();
    }
    let args: Vec<String> = cols
        .iter()
        .map(|c| format!("{}, {alias}.{}::text", ql(c), qi(c)))
        .collect();
    format!("json_build_object({})::text", args.join(", "))
}

/// Root-key lookup for changes of a child node whose join columns do not
/// give the root key directly (grandchildren, or joins to non-key columns).
///
/// Parameters: one `text[]` per join column of the node (`on[].name` values
/// from the change images, pairwise). Columns: `ord bigint`, `root_key text`
/// (JSON array of the root key as text). A change whose parent chain no
/// longer exists yields no row: it is dropped, the parent's own change
/// covers the root.
pub fn resolve_sql(nodes: &[TableNode], index: usize, catalog: &Catalog) -> String {
    let node = &nodes[index];
    let parent_path = path_to(nodes, node.parent.unwrap_or(0)); // root … parent
    let root_key = catalog.key_columns(&nodes[0]);
    // Aliases from the parent upwards: u0 = parent, u1 = grandparent, … root last.
    let up: Vec<usize> = parent_path.iter().rev().copied().collect();
    let alias = |i: usize| format!("u{i}");
    let root_alias = alias(up.len() - 1);
    let mut sql = format!(
        "SELECT k.ord, {} AS root_key\nFROM {}\n",
        text_array(&root_alias, &root_key),
        unnest_keys(node.on.len())
    );
    let parent = &nodes[up[0]];
    let conds: Vec<String> = node
        .on
        .iter()
        .enumerate()
        .map(|(i, o)| {
            format!(
                "u0.{} = k.v{i}::{}",
                qi(&o.to_column),
                cast_type(catalog, parent, &o.to_column)
            )
        })
        .collect();
    let _ = writeln!(
        sql,
        "JOIN {}.{} u0 ON {}",
        qi(&parent.schema),
        qi(&parent.table),
        conds.join(" AND ")
    );
    sql.push_str(&parent_chain_joins(nodes, &up, qi));
    let _ = write!(sql, "ORDER BY k.ord");
    sql
}

/// Reads columns `cols` of rows of `table` by primary key, for updates that
/// sent them as unchanged TOAST values without a before image: `$1…$n` are
/// text arrays of the key columns (in key order); each row answers with
/// its 1-based ordinal into them and the values as a JSON array of text.
pub fn row_columns_sql(table: &TableInfo, cols: &[String]) -> String {
    let conds: Vec<String> = table
        .primary_key
        .iter()
        .enumerate()
        .map(|(i, k)| {
            let ty = table
                .column(k)
                .map(|c| c.data_type.as_str())
                .unwrap_or("text");
            format!("t.{} = k.v{i}::{ty}", qi(k))
        })
        .collect();
    format!(
        "SELECT k.ord, {} AS vals\nFROM {}\nJOIN {}.{} t ON {}\nORDER BY k.ord",
        text_array("t", cols),
        unnest_keys(table.primary_key.len()),
        qi(&table.schema),
        qi(&table.table),
        conds.join(" AND ")
    )
}

/// The joins from a node's parent up to the root for root lookups: `u0` is
/// the parent (joined by the caller), `u1` its parent, … the root last.
/// `up` lists node indices from the parent upwards; `quote` quotes
/// identifiers in the dialect.
pub(crate) fn parent_chain_joins(
    nodes: &[TableNode],
    up: &[usize],
    quote: fn(&str) -> String,
) -> String {
    let alias = |i: usize| format!("u{i}");
    let mut sql = String::new();
    for i in 1..up.len() {
        let child = &nodes[up[i - 1]];
        let n = &nodes[up[i]];
        let conds: Vec<String> = child
            .on
            .iter()
            .map(|o| {
                format!(
                    "{}.{} = {}.{}",
                    alias(i - 1),
                    quote(&o.name),
                    alias(i),
                    quote(&o.to_column)
                )
            })
            .collect();
        let _ = writeln!(
            sql,
            "JOIN {}.{} {} ON {}",
            quote(&n.schema),
            quote(&n.table),
            alias(i),
            conds.join(" AND ")
        );
    }
    sql
}

/// Whether a child node's join columns map onto the root key directly
/// (parent is the root and `to_column`s are exactly the root key), so no
/// lookup is needed. Returns, per root key column, the index into `on`.
pub fn direct_root_mapping(
    nodes: &[TableNode],
    index: usize,
    catalog: &Catalog,
) -> Option<Vec<usize>> {
    let node = &nodes[index];
    if node.parent != Some(0) {
        return None;
    }
    let root_key = catalog.key_columns(&nodes[0]);
    if root_key.len() != node.on.len() {
        return None;
    }
    root_key
        .iter()
        .map(|k| node.on.iter().position(|o| &o.to_column == k))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn col(name: &str, type_name: &str) -> ColumnInfo {
        ColumnInfo {
            name: name.into(),
            data_type: type_name.into(),
            type_name: type_name.into(),
            nullable: true,
        }
    }

    #[test]
    fn rows_are_built_as_json_where_it_reads_the_same_as_jsonb() {
        let (id, note, ratio, doc) = (
            col("id", "int4"),
            col("note", "text"),
            col("ratio", "float8"),
            col("doc", "jsonb"),
        );
        let json = json_object("t0", &[&id, &note]);
        assert!(json.starts_with("json_build_object("), "{json}");
        for other in [&ratio, &doc] {
            let sql = json_object("t0", &[&id, other]);
            assert!(sql.starts_with("jsonb_build_object("), "{sql}");
        }
        let wide: Vec<ColumnInfo> = (0..=JSON_CHUNK)
            .map(|i| col(&format!("c{i}"), "int4"))
            .collect();
        let wide: Vec<&ColumnInfo> = wide.iter().collect();
        let sql = json_object("t0", &wide);
        assert!(
            sql.starts_with("jsonb_build_object(") && sql.contains(" || jsonb_build_object("),
            "{sql}"
        );
    }
}
