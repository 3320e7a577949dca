//! The catalog reads of `skein validate`, `skein status` and
//! `skein marker reset --latest` on a PostgreSQL source.

/// The server's `wal_level` (logical decoding needs `logical`).
pub const WAL_LEVEL: &str = "SHOW wal_level";

/// One row when publication `$1` exists.
pub const PUBLICATION_EXISTS: &str = "SELECT 1 FROM pg_catalog.pg_publication WHERE pubname = $1";

/// The columns publication `$1` carries of table `$2`.`$3` (no row: the
/// table is not published).
pub const PUBLISHED_COLUMNS: &str =
    "SELECT coalesce(attnames::text[], '{}') FROM pg_catalog.pg_publication_tables \
     WHERE pubname = $1 AND schemaname = $2 AND tablename = $3";

/// Slot `$1`'s `wal_status` (`lost`: invalidated).
pub const SLOT_WAL_STATUS: &str =
    "SELECT coalesce(wal_status, '') FROM pg_catalog.pg_replication_slots WHERE slot_name = $1";

/// Slot `$1`: confirmed position, WAL end, lag in bytes, active, wal_status,
/// then [`SLOT_RETENTION`]'s two columns.
pub const SLOT_STATUS: &str = "SELECT confirmed_flush_lsn::text, pg_current_wal_lsn()::text, \
     (pg_current_wal_lsn() - confirmed_flush_lsn)::int8, active, coalesce(wal_status, ''), \
     (pg_current_wal_lsn() - restart_lsn)::int8, safe_wal_size \
     FROM pg_catalog.pg_replication_slots WHERE slot_name = $1";

/// Slot `$1`: the WAL it holds back (bytes from its restart position to the
/// WAL end), and how much more the server lets it hold before invalidating
/// it (`safe_wal_size`; NULL when `max_slot_wal_keep_size` is -1: no limit
/// but the disk).
pub const SLOT_RETENTION: &str =
    "SELECT (pg_current_wal_lsn() - restart_lsn)::int8, safe_wal_size \
     FROM pg_catalog.pg_replication_slots WHERE slot_name = $1";

/// The server's current WAL end.
pub const CURRENT_WAL_LSN: &str = "SELECT pg_current_wal_lsn()::text";

/// `EXISTS (…)`: relation `$rel` has a valid, non-partial btree index whose
/// leading key columns are the names in the array `$3` (see [`INDEXED_BY`]).
macro_rules! indexed_by {
    ($rel:literal) => {
        concat!(
            "EXISTS (SELECT 1 FROM pg_catalog.pg_index i \
             JOIN pg_catalog.pg_class ic ON ic.oid = i.indexrelid \
             JOIN pg_catalog.pg_am am ON am.oid = ic.relam \
             WHERE i.indrelid = ",
            $rel,
            " AND i.indisvalid AND i.indpred IS NULL AND am.amname = 'btree' \
             AND i.indnkeyatts >= cardinality($3::text[]) \
             AND (SELECT coalesce(array_agg(a.attname::text), '{}') \
                  FROM unnest((i.indkey::int2[])[0:cardinality($3::text[]) - 1]) AS k(attnum) \
                  JOIN pg_catalog.pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum) \
                 @> $3::text[])"
        )
    };
}

/// Whether hydration can read a join's rows from table `$1`.`$2` by an
/// index: the table has a valid btree index, not partial, whose leading
/// columns are the columns in the array `$3`, in any order, or it is
/// partitioned and every leaf partition has one (an index created on each
/// partition instead of on the parent serves the probes as well). A
/// partial index serves only its predicate's rows; GIN, GiST and BRIN do
/// not serve these probes. False for a table that does not exist.
pub const INDEXED_BY: &str = concat!(
    "SELECT coalesce((SELECT ",
    indexed_by!("c.oid"),
    " OR (c.relkind = 'p' AND NOT EXISTS (SELECT 1 FROM pg_catalog.pg_partition_tree(c.oid) AS p \
     WHERE p.isleaf AND NOT ",
    indexed_by!("p.relid"),
    ")) FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace \
     WHERE n.nspname = $1 AND c.relname = $2), false)"
);
