//! The sidecar's statements on PostgreSQL, in the order the batch
//! transaction runs them, then the relay's and `skein replay`'s; `schema` is
//! quoted here. Parameters are `$1…` as each function says. Positions travel
//! as text (`$n::text::numeric`): tokio-postgres has no `numeric` type.
//!
//! The SQL Server twins are in [`crate::sqlserver::sidecar`]; both are pinned
//! by golden files (`tests/golden/sql/*_sidecar_statements.sql`).

use super::sidecar_ddl;
use crate::quote_ident as qi;

/// `sidecar migrate`: the DDL in one transaction under an advisory lock, so
/// appliers starting together do not race on `CREATE SCHEMA IF NOT EXISTS`;
/// `IF NOT EXISTS` notices are silenced (noise on every start).
pub fn migrate_sql(schema: &str) -> String {
    format!(
        "BEGIN;\nSET LOCAL client_min_messages TO warning;\n\
         SELECT pg_advisory_xact_lock(hashtext('skein.sidecar.migrate'));\n{}\nCOMMIT;",
        sidecar_ddl(schema)
    )
}

/// A partition's progress: `$1` group, `$2` topic, `$3` partition.
/// Columns: position (text), source_commit, source_seq, epoch.
pub fn progress_sql(schema: &str) -> String {
    format!(
        "SELECT position::text, source_commit, source_seq, epoch, recheck_after FROM {}.\"progress\" \
         WHERE group_name = $1 AND topic = $2 AND partition = $3",
        qi(schema)
    )
}

/// Every partition's progress of `$1` group on `$2` topic, by partition.
/// Columns: partition, then as [`progress_sql`].
pub fn progress_all_sql(schema: &str) -> String {
    format!(
        "SELECT partition, position::text, source_commit, source_seq, epoch, recheck_after FROM {}.\"progress\" \
         WHERE group_name = $1 AND topic = $2 ORDER BY partition",
        qi(schema)
    )
}

/// Forgets the progress of the partitions in the array `$3` of `$1` group
/// on `$2` topic: their records are applied again (re-keying in-process).
pub fn forget_progress_sql(schema: &str) -> String {
    format!(
        "DELETE FROM {}.\"progress\" WHERE group_name = $1 AND topic = $2 AND partition = ANY($3)",
        qi(schema)
    )
}

/// An applier takes a partition: bumps its epoch (`$1` group, `$2` topic,
/// `$3` partition), fencing every applier that read it before. Columns as
/// [`progress_sql`]; no row before the partition's first commit.
pub fn claim_progress_sql(schema: &str) -> String {
    format!(
        "UPDATE {}.\"progress\" SET epoch = epoch + 1 \
         WHERE group_name = $1 AND topic = $2 AND partition = $3 \
         RETURNING position::text, source_commit, source_seq, epoch, recheck_after",
        qi(schema)
    )
}

/// The partition count records of `$1` group on `$2` topic are keyed by.
pub fn partitions_sql(schema: &str) -> String {
    format!(
        "SELECT partitions FROM {}.\"transport\" WHERE group_name = $1 AND topic = $2",
        qi(schema)
    )
}

/// Records `$3` as the partition count of `$1` group on `$2` topic.
pub fn record_partitions_sql(schema: &str) -> String {
    format!(
        "INSERT INTO {}.\"transport\" (group_name, topic, partitions) VALUES ($1, $2, $3) \
         ON CONFLICT (group_name, topic) DO UPDATE SET partitions = EXCLUDED.partitions, \
         updated_at = now()",
        qi(schema)
    )
}

/// Stored versions of entity `$1` for the keys in the array `$2`.
/// Columns: key, etag, is_deleted.
///
/// One primary-key probe per key, whatever the planner thinks: with
/// `key = ANY($2)`, or a plain join with the array, it chose to scan the
/// whole table for a few dozen keys once the table held a few thousand
/// rows (9.6 ms a batch under load in bench/run's live phase, 40 % of the
/// sidecar's time, against 0.5 ms probing). `OFFSET 0` keeps the lateral
/// subquery from being flattened into a join the planner may hash.
pub fn versions_sql(schema: &str) -> String {
    format!(
        "SELECT v.key, v.etag, v.is_deleted FROM unnest($2::text[]) AS k(key) \
         CROSS JOIN LATERAL (SELECT key, etag, is_deleted FROM {}.\"version\" \
         WHERE entity = $1 AND key = k.key OFFSET 0) v",
        qi(schema)
    )
}

/// The newest schema version applied to the sidecar. Column: version.
pub fn schema_version_sql(schema: &str) -> String {
    format!("SELECT max(version) FROM {}.\"schema_version\"", qi(schema))
}

/// Keys of entity `$1` whose last event was not a delete, after key `$2`
/// (from the first when NULL), in key order, at most `$3`: a page of what
/// a TRUNCATE re-checks. Column: key.
pub fn published_keys_sql(schema: &str) -> String {
    format!(
        "SELECT key FROM {}.\"version\" WHERE entity = $1 AND NOT is_deleted \
         AND ($2::text IS NULL OR key > $2) ORDER BY key LIMIT $3",
        qi(schema)
    )
}

/// Fence: moves progress from `$5` at epoch `$8` to `$4` (decimal texts),
/// with the last source change `$6`/`$7` and the TRUNCATE re-check cursor
/// `$9`; affects 0 rows when progress moved or another applier took the
/// partition (the epoch changed).
pub fn advance_progress_sql(schema: &str) -> String {
    format!(
        "UPDATE {}.\"progress\" SET position = $4::text::numeric, source_commit = $6, \
         source_seq = $7, recheck_after = $9, updated_at = now() \
         WHERE group_name = $1 AND topic = $2 AND partition = $3 \
         AND position = $5::text::numeric AND epoch = $8",
        qi(schema)
    )
}

/// A partition's first progress (`$4` position, `$5`/`$6` source, `$7`
/// re-check cursor); the primary key makes a second first commit affect
/// 0 rows.
pub fn first_progress_sql(schema: &str) -> String {
    format!(
        "INSERT INTO {}.\"progress\" (group_name, topic, partition, position, source_commit, source_seq, recheck_after) \
         VALUES ($1, $2, $3, $4::text::numeric, $5, $6, $7) ON CONFLICT DO NOTHING",
        qi(schema)
    )
}

/// The position and epoch a fenced commit found (`$1` group, `$2` topic,
/// `$3` partition), read inside the failed transaction for the error message.
pub fn fenced_position_sql(schema: &str) -> String {
    format!(
        "SELECT position::text, epoch FROM {}.\"progress\" WHERE group_name = $1 AND topic = $2 AND partition = $3",
        qi(schema)
    )
}

/// The batch row, returning its id. `$1` correlation id, `$2` group, `$3`
/// topic, `$4` partition, `$5`/`$6` bounds (decimal texts), `$7` records,
/// `$8` entities, `$9` events, `$10` data loss, `$11` dead letters.
pub fn batch_insert_sql(schema: &str) -> String {
    format!(
        "INSERT INTO {}.\"batch\" (correlation_id, group_name, topic, partition, lower_position, \
         upper_position, record_count, entity_count, event_count, has_data_loss, dead_letters) \
         VALUES ($1::text::uuid, $2, $3, $4, $5::text::numeric, $6::text::numeric, $7, $8, $9, $10, $11) \
         RETURNING id",
        qi(schema)
    )
}

/// Outbox rows from parallel arrays: `$1` batch id, `$2` partition, then
/// event ids, entities, keys, etags, events (text arrays) and commit times
/// (µs since the Unix epoch, `int8[]`). Ids follow the arrays' order
/// (`WITH ORDINALITY … ORDER BY`), so they keep per-aggregate order.
/// Returns the smallest id drawn (checked against [`outbox_floor_sql`]).
pub fn outbox_insert_sql(schema: &str) -> String {
    format!(
        "WITH i AS (INSERT INTO {}.\"outbox_row\" (event_id, batch_id, entity, key, partition, etag, event, commit_time) \
         SELECT u.id::uuid, $1, u.entity, u.key, $2, u.etag, u.event, \
                'epoch'::timestamptz + u.t * interval '1 microsecond' \
         FROM unnest($3::text[], $4::text[], $5::text[], $6::text[], $7::text[], $8::int8[]) \
              WITH ORDINALITY AS u(id, entity, key, etag, event, t, ord) \
         ORDER BY u.ord RETURNING id) SELECT min(id) FROM i",
        qi(schema)
    )
}

/// The highest outbox id partition `$1` holds or its relay cursor names
/// (null when neither exists), read under the partition's outbox lock:
/// every id the batch draws must be above it, or the relay would take the
/// new rows as sent (a sequence reset or set to cache values). The row
/// comparisons keep the scan on the partition's end of
/// `outbox_partition_id`.
pub fn outbox_floor_sql(schema: &str) -> String {
    let s = qi(schema);
    format!(
        "SELECT greatest((SELECT id FROM {s}.\"outbox_row\" WHERE (partition, id) >= ($1, 0) \
         AND (partition, id) <= ($1, 9223372036854775807) ORDER BY partition DESC, id DESC LIMIT 1), \
         (SELECT last_id FROM {s}.\"relay_cursor\" WHERE partition = $1))"
    )
}

/// Upserts versions from parallel arrays: entities, keys, etags (text
/// arrays), is_deleted (`bool[]`).
pub fn versions_upsert_sql(schema: &str) -> String {
    format!(
        "INSERT INTO {}.\"version\" (entity, key, etag, is_deleted) \
         SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::bool[]) \
         ON CONFLICT (entity, key) DO UPDATE SET etag = EXCLUDED.etag, \
           is_deleted = EXCLUDED.is_deleted, updated_at = now()",
        qi(schema)
    )
}

/// The rows of cursor `c`'s partition above it, as conditions on
/// `outbox_row`: row comparisons, so the planner reads them from the
/// partition's range of `outbox_partition_id`. With `partition = …` and
/// `id > …` it walks the primary key from the cursor on, through every
/// partition's rows: for an idle partition, all the outbox since.
const ABOVE_CURSOR: &str = "(partition, id) > (c.partition, c.last_id) \
     AND (partition, id) <= (c.partition, 9223372036854775807)";

/// Pending outbox rows (above their partition's relay cursor) and the age
/// of the oldest (ms), both `int8`. Each cursor's rows are read by index
/// (`OFFSET 0`: not planned as one join of the whole table).
pub fn pending_sql(schema: &str) -> String {
    let s = qi(schema);
    format!(
        "SELECT count(*), coalesce(extract(epoch FROM now() - min(o.enqueued_at)) * 1000, 0)::int8 \
         FROM {s}.\"relay_cursor\" c CROSS JOIN LATERAL (SELECT enqueued_at FROM {s}.\"outbox_row\" \
         WHERE {ABOVE_CURSOR} OFFSET 0) o"
    )
}

/// The name of the lock a batch transaction takes before it writes outbox
/// rows of a partition (`$1` of [`outbox_lock_sql`]).
pub fn outbox_lock_name(schema: &str) -> String {
    format!("skein.outbox.{schema}")
}

/// Locks outbox partition `$2` (under the name `$1`,
/// [`outbox_lock_name`]) until the transaction ends. Its outbox ids are
/// drawn under the lock, so a partition's ids grow in commit order: what
/// lets the relay keep one cursor per partition. (A pipeline's own batches
/// of a partition are already serialised by its progress row; the lock
/// covers writers of other groups or topics sharing the outbox.)
pub fn outbox_lock_sql() -> &'static str {
    "SELECT pg_advisory_xact_lock(hashtext($1), $2)"
}

/// Creates the relay cursor of partition `$1` if it has none, before the
/// partition's first outbox rows commit (in the same transaction, under
/// the partition's outbox lock, so no other writer races it). A plain
/// read, not `ON CONFLICT`: it never waits for a relay's cursor update.
pub fn relay_cursor_ensure_sql(schema: &str) -> String {
    let s = qi(schema);
    format!(
        "INSERT INTO {s}.\"relay_cursor\" (partition, last_id) SELECT $1, 0 \
         WHERE NOT EXISTS (SELECT 1 FROM {s}.\"relay_cursor\" WHERE partition = $1)"
    )
}

/// Most partitions a relay round locks and sends from: advisory locks take
/// slots of the server's shared lock table (`max_locks_per_transaction` ×
/// connections), and an outbox may have up to 1024 partitions. The
/// partitions whose oldest pending row is oldest go first, so none
/// starves.
pub const RELAY_PARTITIONS_PER_ROUND: i64 = 64;

/// The relay cursors of every partition (`$1` null) or of the partitions in
/// the array `$1` that have rows above them, at most
/// [`RELAY_PARTITIONS_PER_ROUND`], those whose oldest pending row is oldest
/// first: a subquery of [`relay_lock_sql`] and [`relay_select_sql`], with
/// columns `partition`, `last_id`.
fn relay_round_cursors(s: &str) -> String {
    format!(
        "SELECT partition, last_id FROM \
         (SELECT c.partition, c.last_id, (SELECT id FROM {s}.\"outbox_row\" WHERE {ABOVE_CURSOR} \
         ORDER BY partition, id LIMIT 1) AS first \
         FROM {s}.\"relay_cursor\" c WHERE ($1::int4[] IS NULL OR c.partition = ANY($1)) OFFSET 0) f \
         WHERE f.first IS NOT NULL ORDER BY f.first LIMIT {RELAY_PARTITIONS_PER_ROUND}"
    )
}

/// Locks, until the transaction ends, the relay cursors a round takes
/// ([`relay_round_cursors`]), in partition order, and returns their
/// partitions. `$2` is the outbox lock's name ([`outbox_lock_name`]): a
/// cursor's lock is `(hashtext($2), -1 - partition)`, beside the
/// partition's outbox lock `(hashtext($2), partition)` and never equal to
/// any outbox lock (partitions are not negative). A relay that takes a
/// partition over waits here for the previous owner's round to end,
/// keeping per-aggregate order. Advisory locks, not `FOR UPDATE`: a row
/// lock gives the transaction an id, which it would keep while the sink is
/// sent to, and every logical slot created in the cluster meanwhile waits
/// for such transactions to end. An idle round locks nothing.
pub fn relay_lock_sql(schema: &str) -> String {
    let s = qi(schema);
    let cursors = relay_round_cursors(&s);
    format!(
        "SELECT p.partition, pg_advisory_xact_lock(hashtext($2), -1 - p.partition)::text \
         FROM (SELECT partition FROM ({cursors}) a ORDER BY partition OFFSET 0) p"
    )
}

/// At most `$2` rows above the cursors a round takes
/// ([`relay_round_cursors`], `$1` as there), in id order. Sent in the same
/// round trip as [`relay_lock_sql`], after it: the session runs it once
/// the locks are granted, so (READ COMMITTED) it reads the cursors as a
/// previous owner's round left them. The relay sends only the rows of the
/// partitions the lock statement locked (the two choose the same
/// partitions unless rows were relayed or written in between). A
/// partition's rows above its cursor, taken in id order, are a prefix of
/// what it has pending. Columns: partition, id, entity, event.
pub fn relay_select_sql(schema: &str) -> String {
    let s = qi(schema);
    let cursors = relay_round_cursors(&s);
    format!(
        "SELECT o.partition, o.id, o.entity, o.event FROM ({cursors}) c CROSS JOIN LATERAL \
         (SELECT partition, id, entity, event FROM {s}.\"outbox_row\" \
         WHERE {ABOVE_CURSOR} ORDER BY partition, id LIMIT $2) o \
         ORDER BY o.id LIMIT $2"
    )
}

/// The relay lease of a sidecar schema (`$1` of [`relay_lease_sql`]): one
/// per sidecar, so relays of one outbox never interleave out of order.
pub fn relay_lease_name(schema: &str) -> String {
    format!("skein.relay.{schema}")
}

/// Takes the relay lease `$1` ([`relay_lease_name`]) for this session if
/// free: a session advisory lock, exclusive for the relay of every
/// partition (it takes every cursor, so it relays alone), shared for the
/// relays of owned partitions (they wait on each other's cursors). Returns
/// whether it was granted; it is held until the session ends.
pub fn relay_lease_sql(exclusive: bool) -> &'static str {
    if exclusive {
        "SELECT pg_try_advisory_lock(hashtext($1))"
    } else {
        "SELECT pg_try_advisory_lock_shared(hashtext($1))"
    }
}

/// How many sessions hold the relay lease `$1` in this database (advisory
/// locks are per database), exclusively and shared (`skein status`).
pub fn relay_lease_holders_sql() -> &'static str {
    "SELECT count(*) FILTER (WHERE mode = 'ExclusiveLock'), count(*) FILTER (WHERE mode = 'ShareLock') \
     FROM pg_catalog.pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 1 \
     AND database = (SELECT oid FROM pg_catalog.pg_database WHERE datname = current_database()) \
     AND ((classid::int8 << 32) | objid::int8) = hashtext($1)::int8"
}

/// A relay's state `$2` (and, when `$3` is not null, its last error) under
/// its name `$1`.
pub fn relay_report_sql(schema: &str) -> String {
    let s = qi(schema);
    format!(
        "INSERT INTO {s}.\"relay\" (name, state, last_error, error_at) \
         VALUES ($1, $2, $3, CASE WHEN $3::text IS NULL THEN NULL ELSE now() END) \
         ON CONFLICT (name) DO UPDATE SET state = EXCLUDED.state, \
         last_error = coalesce(EXCLUDED.last_error, {s}.\"relay\".last_error), \
         error_at = coalesce(EXCLUDED.error_at, {s}.\"relay\".error_at), updated_at = now()"
    )
}

/// Every relay's state. Columns: name, state, last_error, error_at and
/// updated_at (ISO 8601 texts).
pub fn relay_states_sql(schema: &str) -> String {
    format!(
        "SELECT name, state, last_error, \
         to_char(error_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"'), \
         to_char(updated_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"') \
         FROM {}.\"relay\" ORDER BY name",
        qi(schema)
    )
}

/// Moves the relay cursors of the partitions in the array `$1` to the ids
/// in the array `$2` (the last row each sent): one row per partition, not
/// one per event.
pub fn relay_mark_sql(schema: &str) -> String {
    format!(
        "UPDATE {}.\"relay_cursor\" c SET last_id = u.last_id, updated_at = now() \
         FROM unnest($1::int4[], $2::int8[]) AS u(partition, last_id) WHERE c.partition = u.partition",
        qi(schema)
    )
}

/// `skein replay`: moves a partition's progress (`$1` group, `$2` topic,
/// `$3` partition) from offset `$4` back to `$5`, forgetting the last source
/// change and bumping the epoch (an applier that read the old progress is
/// fenced even once the position is back where it read it); affects 0 rows
/// when progress moved meanwhile.
pub fn rewind_sql(schema: &str) -> String {
    format!(
        "UPDATE {}.\"progress\" SET position = $5::int8, source_commit = NULL, \
         source_seq = NULL, recheck_after = NULL, epoch = epoch + 1, updated_at = now() \
         WHERE group_name = $1 AND topic = $2 AND partition = $3 AND position = $4::int8",
        qi(schema)
    )
}

/// `skein replay --republish`: forgets the stored versions of entity `$1`
/// for the keys in the array `$2`, so they publish again.
pub fn forget_versions_sql(schema: &str) -> String {
    format!(
        "DELETE FROM {}.\"version\" WHERE entity = $1 AND key = ANY($2)",
        qi(schema)
    )
}

/// The unfinished explicit run of `$1` group, `$2` entity, `$3` selection
/// (its JSON text), `$4` republish, `$5` initial load, if any: the one a
/// repeated command resumes. Columns: id, cursor, queued.
pub fn explicit_find_sql(schema: &str) -> String {
    format!(
        "SELECT id, \"cursor\", queued FROM {}.\"explicit_run\" WHERE group_name = $1 AND entity = $2 \
         AND selection = $3 AND republish = $4 AND initial = $5 AND state = 'selecting' ORDER BY id LIMIT 1",
        qi(schema)
    )
}

/// A new explicit run (`$1`…`$5` as [`explicit_find_sql`]), returning its id.
pub fn explicit_insert_sql(schema: &str) -> String {
    format!(
        "INSERT INTO {}.\"explicit_run\" (group_name, entity, selection, republish, initial) \
         VALUES ($1, $2, $3, $4, $5) RETURNING id",
        qi(schema)
    )
}

/// Moves run `$1`'s cursor from `$2` to `$3`, adds `$4` to what it queued
/// and sets its state `$5`; affects 0 rows when the cursor moved meanwhile
/// (another process runs it) or the run ended.
pub fn explicit_advance_sql(schema: &str) -> String {
    format!(
        "UPDATE {}.\"explicit_run\" SET \"cursor\" = $3, queued = queued + $4, state = $5, \
         updated_at = now() WHERE id = $1 AND \"cursor\" IS NOT DISTINCT FROM $2 AND state = 'selecting'",
        qi(schema)
    )
}

/// Queues keys of run `$1` (`$2` group, `$3` topic, `$4` entity, `$5`
/// republish) from the parallel arrays `$6` partitions and `$7` canonical
/// keys, in array order.
pub fn explicit_enqueue_sql(schema: &str) -> String {
    format!(
        "INSERT INTO {}.\"explicit_queue\" (run_id, group_name, topic, partition, entity, key, republish) \
         SELECT $1, $2, $3, u.p, $4, u.k, $5 FROM unnest($6::int4[], $7::text[]) WITH ORDINALITY AS u(p, k, ord) \
         ORDER BY u.ord",
        qi(schema)
    )
}

/// At most `$4` queued keys of partition `$3` of `$1` group on `$2` topic,
/// oldest first, and of the partitions `$5` (the partition count now) no
/// longer has that fall to it (`p % $5`): keys queued under a larger count,
/// which its applier moves to their partitions. Columns: id, entity, key,
/// republish.
pub fn explicit_pending_sql(schema: &str) -> String {
    format!(
        "SELECT id, entity, key, republish FROM {}.\"explicit_queue\" \
         WHERE group_name = $1 AND topic = $2 \
         AND (partition = $3 OR (partition >= $5 AND partition % $5 = $3)) ORDER BY id LIMIT $4",
        qi(schema)
    )
}

/// Moves queued keys (ids `$1`) to the partitions `$2` (parallel arrays):
/// keys queued under another partition count than the appliers' now.
pub fn explicit_requeue_sql(schema: &str) -> String {
    let s = qi(schema);
    format!(
        "UPDATE {s}.\"explicit_queue\" q SET partition = u.p \
         FROM unnest($1::int8[], $2::int4[]) AS u(id, p) WHERE q.id = u.id"
    )
}

/// Takes the queued keys in the array `$1` off the queue, inside the batch
/// transaction that published them; fewer rows than ids means another
/// applier did.
pub fn explicit_done_sql(schema: &str) -> String {
    format!(
        "DELETE FROM {}.\"explicit_queue\" WHERE id = ANY($1)",
        qi(schema)
    )
}

/// A partition with no progress row yet has nothing to lock: an explicit
/// batch inserts the first row and deletes it again in its transaction
/// (`$1` group, `$2` topic, `$3` partition), so a concurrent first commit
/// of the stream waits for it, and it is fenced (0 rows) by one that
/// committed first.
pub fn lock_absent_progress_sql(schema: &str) -> [String; 2] {
    let s = qi(schema);
    [
        format!(
            "INSERT INTO {s}.\"progress\" (group_name, topic, partition, position) \
             VALUES ($1, $2, $3, 0) ON CONFLICT DO NOTHING"
        ),
        format!(
            "DELETE FROM {s}.\"progress\" WHERE group_name = $1 AND topic = $2 AND partition = $3"
        ),
    ]
}

/// What [`explicit_runs_sql`] and [`explicit_run_sql`] read of a run.
/// Columns: id, entity, selection, republish, initial, state, cursor,
/// queued, pending (keys still queued), created_at and updated_at (ISO 8601
/// texts).
fn explicit_run_select(s: &str) -> String {
    format!(
        "SELECT r.id, r.entity, r.selection, r.republish, r.initial, r.state, r.\"cursor\", r.queued, \
         (SELECT count(*) FROM {s}.\"explicit_queue\" q WHERE q.run_id = r.id), \
         to_char(r.created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"'), \
         to_char(r.updated_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"') \
         FROM {s}.\"explicit_run\" r"
    )
}

/// The explicit runs of `$1` group: every unfinished one and the last `$2`
/// others, newest first. Columns as [`explicit_run_select`].
pub fn explicit_runs_sql(schema: &str) -> String {
    let s = qi(schema);
    format!(
        "{} WHERE r.group_name = $1 AND (r.state = 'selecting' \
         OR EXISTS (SELECT 1 FROM {s}.\"explicit_queue\" q WHERE q.run_id = r.id) \
         OR r.id IN (SELECT id FROM {s}.\"explicit_run\" WHERE group_name = $1 ORDER BY id DESC LIMIT $2)) \
         ORDER BY r.id DESC",
        explicit_run_select(&s)
    )
}

/// Explicit run `$1`. Columns as [`explicit_run_select`].
pub fn explicit_run_sql(schema: &str) -> String {
    format!("{} WHERE r.id = $1", explicit_run_select(&qi(schema)))
}

/// The global identifiers of entity `$1` for the keys in the array `$2`
/// (a probe per key: see [`versions_sql`]). Columns: key, global_id.
pub fn identifiers_sql(schema: &str) -> String {
    format!(
        "SELECT m.key, m.global_id FROM unnest($2::text[]) AS k(key) \
         CROSS JOIN LATERAL (SELECT key, global_id FROM {}.\"identifier_mapping\" \
         WHERE entity = $1 AND key = k.key OFFSET 0) m",
        qi(schema)
    )
}

/// New global identifiers from parallel arrays `$1` namespaces, `$2`
/// keys, `$3` ids, in key order (concurrent inserts take the unique
/// index's locks in one order). A row that conflicts with a stored one
/// (its key has an identifier, or its identifier is another key's) is not
/// inserted; the caller reads what is stored.
pub fn identifiers_insert_sql(schema: &str) -> String {
    format!(
        "INSERT INTO {}.\"identifier_mapping\" (entity, key, global_id) \
         SELECT * FROM unnest($1::text[], $2::text[], $3::text[]) ORDER BY 1, 2 ON CONFLICT DO NOTHING",
        qi(schema)
    )
}

/// The keys of namespace `$1` holding the global ids in the array `$2`.
/// Columns: global_id, key.
pub fn identifier_holders_sql(schema: &str) -> String {
    format!(
        "SELECT global_id, key FROM {}.\"identifier_mapping\" WHERE entity = $1 AND global_id = ANY($2)",
        qi(schema)
    )
}

/// The rows of namespace `$1` at odds with those of namespace `$2`: the
/// same key with another global id, or the same global id on another key.
/// Columns: key and global_id of `$1`'s row, then of `$2`'s.
pub fn identifier_conflicts_sql(schema: &str) -> String {
    let s = qi(schema);
    format!(
        "SELECT o.key, o.global_id, n.key, n.global_id FROM {s}.\"identifier_mapping\" o \
         JOIN {s}.\"identifier_mapping\" n ON n.entity = $2 AND n.key = o.key \
         WHERE o.entity = $1 AND n.global_id <> o.global_id \
         UNION ALL SELECT o.key, o.global_id, n.key, n.global_id FROM {s}.\"identifier_mapping\" o \
         JOIN {s}.\"identifier_mapping\" n ON n.entity = $2 AND n.global_id = o.global_id \
         WHERE o.entity = $1 AND n.key <> o.key"
    )
}

/// Moves the rows of namespace `$1` to namespace `$2` (in one
/// transaction, after [`identifier_conflicts_sql`]): first deletes `$2`'s
/// rows of the keys `$1` has, then renames `$1`'s.
pub fn identifiers_move_sql(schema: &str) -> [String; 2] {
    let s = qi(schema);
    [
        format!(
            "DELETE FROM {s}.\"identifier_mapping\" WHERE entity = $2 AND key IN \
             (SELECT key FROM {s}.\"identifier_mapping\" WHERE entity = $1)"
        ),
        format!("UPDATE {s}.\"identifier_mapping\" SET entity = $2 WHERE entity = $1"),
    ]
}

/// Deletes at most `$2` relayed outbox rows (at or below their partition's
/// cursor) written more than `$1` seconds ago (a chunk of the retention
/// purge), skipping rows another transaction holds; returns how many it
/// deleted.
pub fn purge_outbox_sql(schema: &str) -> String {
    let s = qi(schema);
    format!(
        "DELETE FROM {s}.\"outbox_row\" WHERE id IN (SELECT o.id FROM {s}.\"outbox_row\" o \
         JOIN {s}.\"relay_cursor\" c ON c.partition = o.partition AND o.id <= c.last_id \
         WHERE o.enqueued_at < now() - $1 * interval '1 second' LIMIT $2 FOR UPDATE OF o SKIP LOCKED)"
    )
}
