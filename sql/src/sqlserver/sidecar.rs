//! The sidecar's statements on SQL Server, in the order the batch
//! transaction runs them; `schema` is quoted here. Parameters are `@P1…`
//! as each function says.

use super::{qi, sidecar_ddl};

/// `sidecar migrate`: the DDL under an exclusive application lock, so
/// appliers starting together do not race on `IF … CREATE TABLE`.
pub fn migrate_sql(schema: &str) -> String {
    format!(
        "BEGIN TRAN;\nEXEC sp_getapplock @Resource = N'skein.sidecar.migrate', \
         @LockMode = 'Exclusive', @LockOwner = 'Transaction', @LockTimeout = 60000;\n{}\nCOMMIT TRAN;",
        sidecar_ddl(schema)
    )
}

/// A partition's progress: `@P1` group, `@P2` topic, `@P3` partition.
/// Columns: position (text), source_commit, source_seq, epoch,
/// recheck_after.
pub fn progress_sql(schema: &str) -> String {
    format!(
        "SELECT CAST([position] AS nvarchar(40)), [source_commit], [source_seq], [epoch], [recheck_after] \
         FROM {}.[progress] WHERE [group_name] = @P1 AND [topic] = @P2 AND [partition] = @P3",
        qi(schema)
    )
}

/// Every partition's progress of `@P1` group on `@P2` topic, by
/// partition. Columns: partition, then as [`progress_sql`].
pub fn progress_all_sql(schema: &str) -> String {
    format!(
        "SELECT [partition], CAST([position] AS nvarchar(40)), [source_commit], [source_seq], [epoch], \
         [recheck_after] \
         FROM {}.[progress] WHERE [group_name] = @P1 AND [topic] = @P2 ORDER BY [partition]",
        qi(schema)
    )
}

/// Forgets the progress of partition `@P3` of `@P1` group on `@P2` topic:
/// its records are applied again (re-keying in-process).
pub fn forget_progress_sql(schema: &str) -> String {
    format!(
        "DELETE FROM {}.[progress] WHERE [group_name] = @P1 AND [topic] = @P2 AND [partition] = @P3",
        qi(schema)
    )
}

/// An applier takes a partition: bumps its epoch (`@P1` group, `@P2`
/// topic, `@P3` partition), fencing every applier that read it before.
/// Columns as [`progress_sql`]; no row before the partition's first commit.
pub fn claim_progress_sql(schema: &str) -> String {
    format!(
        "UPDATE {}.[progress] SET [epoch] = [epoch] + 1 \
         OUTPUT CAST(inserted.[position] AS nvarchar(40)), inserted.[source_commit], \
         inserted.[source_seq], inserted.[epoch], inserted.[recheck_after] \
         WHERE [group_name] = @P1 AND [topic] = @P2 AND [partition] = @P3",
        qi(schema)
    )
}

/// The partition count records of `@P1` group on `@P2` topic are keyed by.
pub fn partitions_sql(schema: &str) -> String {
    format!(
        "SELECT [partitions] FROM {}.[transport] WHERE [group_name] = @P1 AND [topic] = @P2",
        qi(schema)
    )
}

/// Records `@P3` as the partition count of `@P1` group on `@P2` topic.
pub fn record_partitions_sql(schema: &str) -> String {
    let q = qi(schema);
    format!(
        "SET XACT_ABORT ON; BEGIN TRAN; \
         UPDATE {q}.[transport] WITH (UPDLOCK, HOLDLOCK) SET [partitions] = @P3, \
         [updated_at] = SYSUTCDATETIME() WHERE [group_name] = @P1 AND [topic] = @P2; \
         IF @@ROWCOUNT = 0 INSERT INTO {q}.[transport] ([group_name], [topic], [partitions]) \
         VALUES (@P1, @P2, @P3); COMMIT TRAN;"
    )
}

/// A relay's state `@P2` (and, when `@P3` is not null, its last error)
/// under its name `@P1`.
pub fn relay_report_sql(schema: &str) -> String {
    let q = qi(schema);
    format!(
        "SET XACT_ABORT ON; BEGIN TRAN; \
         UPDATE {q}.[relay] WITH (UPDLOCK, HOLDLOCK) SET [state] = @P2, \
         [last_error] = COALESCE(@P3, [last_error]), \
         [error_at] = CASE WHEN @P3 IS NULL THEN [error_at] ELSE SYSUTCDATETIME() END, \
         [updated_at] = SYSUTCDATETIME() WHERE [name] = @P1; \
         IF @@ROWCOUNT = 0 INSERT INTO {q}.[relay] ([name], [state], [last_error], [error_at]) \
         VALUES (@P1, @P2, @P3, CASE WHEN @P3 IS NULL THEN NULL ELSE SYSUTCDATETIME() END); \
         COMMIT TRAN;"
    )
}

/// Every relay's state. Columns: name, state, last_error, error_at and
/// updated_at (ISO 8601 texts).
pub fn relay_states_sql(schema: &str) -> String {
    format!(
        "SELECT [name], [state], [last_error], \
         CONVERT(nvarchar(19), [error_at], 126) + N'Z', CONVERT(nvarchar(19), [updated_at], 126) + N'Z' \
         FROM {}.[relay] ORDER BY [name]",
        qi(schema)
    )
}

/// Fence: moves progress from `@P5` at epoch `@P8` to `@P4` (decimal
/// texts), with the last source change `@P6`/`@P7` and the TRUNCATE
/// re-check cursor `@P9`; affects 0 rows when progress moved or another
/// applier took the partition.
pub fn advance_progress_sql(schema: &str) -> String {
    format!(
        "UPDATE {}.[progress] SET [position] = CAST(@P4 AS decimal(25,0)), \
         [source_commit] = @P6, [source_seq] = @P7, [recheck_after] = @P9, \
         [updated_at] = SYSUTCDATETIME() \
         WHERE [group_name] = @P1 AND [topic] = @P2 AND [partition] = @P3 \
         AND [position] = CAST(@P5 AS decimal(25,0)) AND [epoch] = @P8",
        qi(schema)
    )
}

/// A partition's first progress (`@P4` position, `@P5`/`@P6` source,
/// `@P7` re-check cursor);
/// the range lock (UPDLOCK, HOLDLOCK) keeps two first commits from both
/// inserting: the second affects 0 rows.
pub fn first_progress_sql(schema: &str) -> String {
    let q = qi(schema);
    format!(
        "INSERT INTO {q}.[progress] ([group_name], [topic], [partition], [position], \
         [source_commit], [source_seq], [recheck_after]) \
         SELECT @P1, @P2, @P3, CAST(@P4 AS decimal(25,0)), @P5, @P6, @P7 \
         WHERE NOT EXISTS (SELECT 1 FROM {q}.[progress] WITH (UPDLOCK, HOLDLOCK) \
         WHERE [group_name] = @P1 AND [topic] = @P2 AND [partition] = @P3)"
    )
}

/// The batch row, returning its id. `@P1` correlation id, `@P2` group,
/// `@P3` topic, `@P4` partition, `@P5`/`@P6` bounds (decimal texts),
/// `@P7` records, `@P8` entities, `@P9` events, `@P10` data loss,
/// `@P11` dead letters.
pub fn batch_insert_sql(schema: &str) -> String {
    format!(
        "INSERT INTO {}.[batch] ([correlation_id], [group_name], [topic], [partition], \
         [lower_position], [upper_position], [record_count], [entity_count], [event_count], \
         [has_data_loss], [dead_letters]) OUTPUT INSERTED.[id] \
         VALUES (CAST(@P1 AS uniqueidentifier), @P2, @P3, @P4, CAST(@P5 AS decimal(25,0)), \
         CAST(@P6 AS decimal(25,0)), @P7, @P8, @P9, @P10, @P11)",
        qi(schema)
    )
}

/// Parameters per outbox row in [`outbox_insert_sql`].
pub const OUTBOX_PARAMS: usize = 7;

/// `rows` outbox rows: `@P1` batch id, `@P2` partition, then per row
/// ordinal, event id, entity, key, etag, event, commit time (µs since
/// the Unix epoch). Identity values follow the `ORDER BY` of an
/// `INSERT … SELECT` (not a `VALUES` list's order), so ids keep
/// per-aggregate order.
pub fn outbox_insert_sql(schema: &str, rows: usize) -> String {
    let values: Vec<String> = (0..rows)
        .map(|r| {
            let ps: Vec<String> = (0..OUTBOX_PARAMS)
                .map(|c| format!("@P{}", 3 + r * OUTBOX_PARAMS + c))
                .collect();
            format!("({})", ps.join(", "))
        })
        .collect();
    format!(
        "INSERT INTO {}.[outbox_row] ([event_id], [batch_id], [entity], [key], [partition], [etag], \
         [event], [commit_time]) OUTPUT INSERTED.[id] \
         SELECT CAST(v.id AS uniqueidentifier), @P1, v.entity, v.[key], @P2, v.etag, v.event, \
         DATEADD(microsecond, CAST(v.t % 1000000 AS int), \
         DATEADD(second, CAST((v.t / 1000000) % 86400 AS int), \
         DATEADD(day, CAST(v.t / 86400000000 AS int), CAST('1970-01-01' AS datetime2(6))))) \
         FROM (VALUES {}) AS v(ord, id, entity, [key], etag, event, t) ORDER BY v.ord",
        qi(schema),
        values.join(", ")
    )
}

/// Parameters per version row in [`versions_merge_sql`].
pub const VERSION_PARAMS: usize = 4;

/// Upserts `rows` versions: per row entity, key, etag, is_deleted.
pub fn versions_merge_sql(schema: &str, rows: usize) -> String {
    let values: Vec<String> = (0..rows)
        .map(|r| {
            let p = r * VERSION_PARAMS;
            format!("(@P{}, @P{}, @P{}, @P{})", p + 1, p + 2, p + 3, p + 4)
        })
        .collect();
    format!(
        "MERGE {}.[version] WITH (HOLDLOCK) AS t \
         USING (VALUES {}) AS s(entity, [key], etag, is_deleted) \
         ON t.[entity] = s.entity AND t.[key] = s.[key] \
         WHEN MATCHED THEN UPDATE SET [etag] = s.etag, [is_deleted] = s.is_deleted, \
         [updated_at] = SYSUTCDATETIME() \
         WHEN NOT MATCHED THEN INSERT ([entity], [key], [etag], [is_deleted]) \
         VALUES (s.entity, s.[key], s.etag, s.is_deleted);",
        qi(schema),
        values.join(", ")
    )
}

/// Stored versions of `keys` keys of entity `@P1` (keys from `@P2`).
pub fn versions_sql(schema: &str, keys: usize) -> String {
    let list: Vec<String> = (0..keys).map(|i| format!("@P{}", i + 2)).collect();
    format!(
        "SELECT [key], [etag], CAST([is_deleted] AS int) FROM {}.[version] \
         WHERE [entity] = @P1 AND [key] IN ({})",
        qi(schema),
        list.join(", ")
    )
}

/// The newest schema version applied to the sidecar. Column: version.
pub fn schema_version_sql(schema: &str) -> String {
    format!("SELECT MAX([version]) FROM {}.[schema_version]", qi(schema))
}

/// Keys of entity `@P1` whose last event was not a delete, after key
/// `@P2` (from the first when NULL), in key order, at most `@P3`: a page
/// of what a TRUNCATE re-checks (SQL Server itself refuses TRUNCATE on CDC
/// tables; the sidecar may still serve a PostgreSQL source). Recompiled
/// each time: one cached plan for `@P2 IS NULL OR [key] > @P2` would seek
/// the entity and filter the keys, reading from the first key every page.
pub fn published_keys_sql(schema: &str) -> String {
    format!(
        "SELECT TOP (@P3) [key] FROM {}.[version] WHERE [entity] = @P1 AND [is_deleted] = 0 \
         AND (@P2 IS NULL OR [key] > @P2) ORDER BY [key] OPTION (RECOMPILE)",
        qi(schema)
    )
}

/// Pending outbox rows (above their partition's relay cursor) and the age
/// of the oldest (ms).
pub fn pending_sql(schema: &str) -> String {
    let s = qi(schema);
    format!(
        "SELECT CAST(COUNT(*) AS bigint), \
         COALESCE(DATEDIFF_BIG(millisecond, MIN(o.[enqueued_at]), SYSUTCDATETIME()), 0) \
         FROM {s}.[relay_cursor] c JOIN {s}.[outbox_row] o \
         ON o.[partition] = c.[partition] AND o.[id] > c.[last_id]"
    )
}

/// Locks outbox partition `@P1` of the schema until the transaction ends
/// (an application lock named as the PostgreSQL dialect's
/// `outbox_lock_name` plus `.` and the partition): its outbox ids are drawn
/// under it, so a partition's ids grow in commit order, and creates the
/// partition's relay cursor if it has none (see the PostgreSQL dialect's
/// `outbox_lock_sql` and `relay_cursor_ensure_sql`). `@P2` is the lock's
/// name. Returns the highest id the partition holds and its cursor's
/// (nulls when none): every id the batch draws must be above both (see
/// the PostgreSQL dialect's `outbox_floor_sql`).
pub fn outbox_lock_sql(schema: &str) -> String {
    let s = qi(schema);
    format!(
        "DECLARE @r int; EXEC @r = sys.sp_getapplock @Resource = @P2, @LockMode = 'Exclusive', \
         @LockOwner = 'Transaction'; \
         IF @r < 0 THROW 50000, N'the partition''s outbox lock was not granted', 1; \
         IF NOT EXISTS (SELECT 1 FROM {s}.[relay_cursor] WHERE [partition] = @P1) \
         INSERT INTO {s}.[relay_cursor] ([partition], [last_id]) VALUES (@P1, 0); \
         SELECT (SELECT MAX([id]) FROM {s}.[outbox_row] WHERE [partition] = @P1), \
         (SELECT [last_id] FROM {s}.[relay_cursor] WHERE [partition] = @P1);"
    )
}

/// At most `@P1` pending rows of every partition, or of `partitions` (a
/// relay inside `skein apply`), in id order, with the cursors of those
/// partitions locked (`UPDLOCK`): a relay that takes a partition over
/// waits for the previous owner's round to end, keeping per-aggregate
/// order. No `READPAST`: a row skipped while its partition's cursor moves
/// past it would never be sent. Columns: id, entity, event, partition.
pub fn relay_select_sql(schema: &str, partitions: Option<&[i32]>) -> String {
    let s = qi(schema);
    let filter = match partitions {
        None => String::new(),
        Some(ps) => {
            let list: Vec<String> = ps.iter().map(i32::to_string).collect();
            format!(" WHERE c.[partition] IN ({})", list.join(", "))
        }
    };
    format!(
        "SELECT TOP (@P1) o.[id], o.[entity], o.[event], o.[partition] \
         FROM {s}.[relay_cursor] c WITH (UPDLOCK, ROWLOCK) CROSS APPLY \
         (SELECT TOP (@P1) [id], [entity], [event], [partition] FROM {s}.[outbox_row] \
         WHERE [partition] = c.[partition] AND [id] > c.[last_id] ORDER BY [id]) o{filter} \
         ORDER BY o.[id]"
    )
}

/// `skein replay`: moves a partition's progress (`@P1` group, `@P2`
/// topic, `@P3` partition) from offset `@P4` back to `@P5`, forgetting
/// the last source change and bumping the epoch; affects 0 rows when
/// progress moved meanwhile.
pub fn rewind_sql(schema: &str) -> String {
    format!(
        "UPDATE {}.[progress] SET [position] = @P5, [source_commit] = NULL, [source_seq] = NULL, \
         [recheck_after] = NULL, [epoch] = [epoch] + 1, [updated_at] = SYSUTCDATETIME() \
         WHERE [group_name] = @P1 AND [topic] = @P2 AND [partition] = @P3 AND [position] = @P4",
        qi(schema)
    )
}

/// `skein replay --republish`: forgets the stored versions of `keys`
/// keys of entity `@P1` (keys from `@P2`), so they publish again.
pub fn forget_versions_sql(schema: &str, keys: usize) -> String {
    let list: Vec<String> = (0..keys).map(|i| format!("@P{}", i + 2)).collect();
    format!(
        "DELETE FROM {}.[version] WHERE [entity] = @P1 AND [key] IN ({})",
        qi(schema),
        list.join(", ")
    )
}

/// Takes the relay lease `@P1` (the PostgreSQL dialect's `relay_lease_name`)
/// for this session if free: an application lock owned by the session,
/// exclusive for the relay of every partition, shared for the relays of
/// owned partitions. Returns `sp_getapplock`'s code: 0 or 1 granted,
/// negative not.
pub fn relay_lease_sql(exclusive: bool) -> String {
    let mode = if exclusive { "Exclusive" } else { "Shared" };
    format!(
        "DECLARE @r int; EXEC @r = sys.sp_getapplock @Resource = @P1, @LockMode = '{mode}', \
         @LockOwner = 'Session', @LockTimeout = 0; SELECT CAST(@r AS bigint)"
    )
}

/// Moves the relay cursors of a round's partitions to the last id each
/// sent (`(partition, id)` numbers read from the outbox): one row per
/// partition, not one per event.
pub fn relay_mark_sql(schema: &str, cursors: &[(i32, i64)]) -> String {
    let list: Vec<String> = cursors
        .iter()
        .map(|(p, id)| format!("({p}, {id})"))
        .collect();
    format!(
        "UPDATE c SET [last_id] = v.[last_id], [updated_at] = SYSUTCDATETIME() \
         FROM {}.[relay_cursor] c JOIN (VALUES {}) AS v([partition], [last_id]) \
         ON c.[partition] = v.[partition]",
        qi(schema),
        list.join(", ")
    )
}

/// The unfinished explicit run of `@P1` group, `@P2` entity, `@P3`
/// selection (its JSON text), `@P4` republish, `@P5` initial load, if any:
/// the one a repeated command resumes. Columns: id, cursor, queued.
pub fn explicit_find_sql(schema: &str) -> String {
    format!(
        "SELECT TOP (1) [id], [cursor], [queued] FROM {}.[explicit_run] WHERE [group_name] = @P1 \
         AND [entity] = @P2 AND [selection] = @P3 AND [republish] = @P4 AND [initial] = @P5 \
         AND [state] = N'selecting' ORDER BY [id]",
        qi(schema)
    )
}

/// A new explicit run (`@P1`…`@P5` as [`explicit_find_sql`]), returning its id.
pub fn explicit_insert_sql(schema: &str) -> String {
    format!(
        "INSERT INTO {}.[explicit_run] ([group_name], [entity], [selection], [republish], [initial]) \
         OUTPUT INSERTED.[id] VALUES (@P1, @P2, @P3, @P4, @P5)",
        qi(schema)
    )
}

/// Moves run `@P1`'s cursor from `@P2` to `@P3`, adds `@P4` to what it
/// queued and sets its state `@P5`; affects 0 rows when the cursor moved
/// meanwhile (another process runs it) or the run ended. The cursor
/// compare treats NULL as equal to NULL (PostgreSQL's `IS NOT DISTINCT
/// FROM`): a run's first chunk starts from no cursor.
pub fn explicit_advance_sql(schema: &str) -> String {
    format!(
        "UPDATE {}.[explicit_run] SET [cursor] = @P3, [queued] = [queued] + @P4, [state] = @P5, \
         [updated_at] = SYSUTCDATETIME() WHERE [id] = @P1 \
         AND ([cursor] = @P2 OR ([cursor] IS NULL AND @P2 IS NULL)) AND [state] = N'selecting'",
        qi(schema)
    )
}

/// Parameters per key in [`explicit_enqueue_sql`] (after the five shared ones).
pub const EXPLICIT_QUEUE_PARAMS: usize = 2;

/// Queues `rows` keys of run `@P1` (`@P2` group, `@P3` topic, `@P4`
/// entity, `@P5` republish), then per key its partition and canonical
/// key, in the given order: identity values follow the `ORDER BY` of an
/// `INSERT … SELECT` (as in [`outbox_insert_sql`]), so ids keep the
/// selection's order. The ordinals are the statement's own numbers, not
/// parameters.
pub fn explicit_enqueue_sql(schema: &str, rows: usize) -> String {
    let values: Vec<String> = (0..rows)
        .map(|r| {
            let p = 6 + r * EXPLICIT_QUEUE_PARAMS;
            format!("({r}, @P{p}, @P{})", p + 1)
        })
        .collect();
    format!(
        "INSERT INTO {}.[explicit_queue] ([run_id], [group_name], [topic], [partition], [entity], \
         [key], [republish]) \
         SELECT @P1, @P2, @P3, v.p, @P4, v.k, @P5 FROM (VALUES {}) AS v(ord, p, k) ORDER BY v.ord",
        qi(schema),
        values.join(", ")
    )
}

/// At most `@P4` queued keys of partition `@P3` of `@P1` group on `@P2`
/// topic, oldest first. Columns: id, entity, key, republish.
pub fn explicit_pending_sql(schema: &str) -> String {
    format!(
        "SELECT TOP (@P4) [id], [entity], [key], [republish] FROM {}.[explicit_queue] \
         WHERE [group_name] = @P1 AND [topic] = @P2 \
         AND ([partition] = @P3 OR ([partition] >= @P5 AND [partition] % @P5 = @P3)) ORDER BY [id]",
        qi(schema)
    )
}

/// Takes the queued keys `ids` (numbers read from the queue, as in
/// [`relay_mark_sql`]) off the queue, inside the batch transaction that
/// published them; fewer rows than ids means another applier did.
pub fn explicit_done_sql(schema: &str, ids: &[i64]) -> String {
    let list: Vec<String> = ids.iter().map(i64::to_string).collect();
    format!(
        "DELETE FROM {}.[explicit_queue] WHERE [id] IN ({})",
        qi(schema),
        list.join(", ")
    )
}

/// Moves queued keys to other partitions, `(id, partition)` pairs (numbers
/// written into the statement, as [`explicit_done_sql`]): keys queued under
/// another partition count than the appliers' now.
pub fn explicit_requeue_sql(schema: &str, moves: &[(i64, u32)]) -> String {
    let values: Vec<String> = moves.iter().map(|(id, p)| format!("({id}, {p})")).collect();
    format!(
        "UPDATE q SET q.[partition] = v.p FROM {}.[explicit_queue] q \
         JOIN (VALUES {}) AS v(id, p) ON q.[id] = v.id",
        qi(schema),
        values.join(", ")
    )
}

/// A partition with no progress row yet has nothing to lock: an explicit
/// batch reads its absent row (`@P1` group, `@P2` topic, `@P3` partition)
/// under `UPDLOCK, HOLDLOCK` instead, a key-range lock held to the end of
/// the transaction, so a concurrent first commit of the stream (whose
/// [`first_progress_sql`] asks for the same range) waits for it; a row
/// found means one committed first, and the batch is fenced. (PostgreSQL
/// has no range locks outside serializable transactions and inserts and
/// deletes the row instead.) The range reaches to the next stored key, so
/// the batch also holds back a progress update of the partition stored
/// after it until it commits. Columns: one row when progress exists.
pub fn lock_absent_progress_sql(schema: &str) -> String {
    format!(
        "SELECT 1 FROM {}.[progress] WITH (UPDLOCK, HOLDLOCK) \
         WHERE [group_name] = @P1 AND [topic] = @P2 AND [partition] = @P3",
        qi(schema)
    )
}

/// What [`explicit_runs_sql`] and [`explicit_run_sql`] read of a run.
/// Columns: id, entity, selection, republish, initial, state, cursor,
/// queued, pending (keys still queued), created_at and updated_at (ISO 8601
/// texts, as [`relay_states_sql`] writes them).
fn explicit_run_select(s: &str) -> String {
    format!(
        "SELECT r.[id], r.[entity], r.[selection], r.[republish], r.[initial], r.[state], \
         r.[cursor], r.[queued], \
         (SELECT CAST(COUNT(*) AS bigint) FROM {s}.[explicit_queue] q WHERE q.[run_id] = r.[id]), \
         CONVERT(nvarchar(19), r.[created_at], 126) + N'Z', \
         CONVERT(nvarchar(19), r.[updated_at], 126) + N'Z' \
         FROM {s}.[explicit_run] r"
    )
}

/// The explicit runs of `@P1` group: every unfinished one and the last
/// `@P2` others, newest first. Columns as [`explicit_run_select`].
pub fn explicit_runs_sql(schema: &str) -> String {
    let s = qi(schema);
    format!(
        "{} WHERE r.[group_name] = @P1 AND (r.[state] = N'selecting' \
         OR EXISTS (SELECT 1 FROM {s}.[explicit_queue] q WHERE q.[run_id] = r.[id]) \
         OR r.[id] IN (SELECT TOP (@P2) [id] FROM {s}.[explicit_run] WHERE [group_name] = @P1 \
         ORDER BY [id] DESC)) \
         ORDER BY r.[id] DESC",
        explicit_run_select(&s)
    )
}

/// Explicit run `@P1`. Columns as [`explicit_run_select`].
pub fn explicit_run_sql(schema: &str) -> String {
    format!("{} WHERE r.[id] = @P1", explicit_run_select(&qi(schema)))
}

/// Parameters per row of [`identifiers_insert_sql`].
pub const IDENTIFIER_PARAMS: usize = 3;

/// The global identifiers of `keys` keys of entity `@P1` (keys from
/// `@P2`). Columns: key, global_id.
pub fn identifiers_sql(schema: &str, keys: usize) -> String {
    let list: Vec<String> = (0..keys).map(|i| format!("@P{}", i + 2)).collect();
    format!(
        "SELECT [key], [global_id] FROM {}.[identifier_mapping] WHERE [entity] = @P1 AND [key] IN ({})",
        qi(schema),
        list.join(", ")
    )
}

/// New global identifiers, `rows` rows of (namespace, key, global_id). A
/// row that conflicts with a stored one (its key has an identifier, or its
/// identifier is another key's) is not inserted; the caller reads what is
/// stored. The range locks make two appliers inserting the same key wait
/// for each other instead of failing on the unique key; the rows go in key
/// order (as PostgreSQL's), so two appliers take those locks in one order
/// and a deadlock between them (1205, retried) stays rare.
pub fn identifiers_insert_sql(schema: &str, rows: usize) -> String {
    let values: Vec<String> = (0..rows)
        .map(|r| {
            let p = r * IDENTIFIER_PARAMS;
            format!("(@P{}, @P{}, @P{})", p + 1, p + 2, p + 3)
        })
        .collect();
    let s = qi(schema);
    format!(
        "INSERT INTO {s}.[identifier_mapping] ([entity], [key], [global_id]) \
         SELECT v.e, v.k, v.g FROM (VALUES {}) AS v(e, k, g) \
         WHERE NOT EXISTS (SELECT 1 FROM {s}.[identifier_mapping] t WITH (UPDLOCK, HOLDLOCK) \
         WHERE t.[entity] = v.e AND (t.[key] = v.k OR t.[global_id] = v.g)) \
         ORDER BY v.e, v.k",
        values.join(", ")
    )
}

/// The keys of namespace `@P1` holding `ids` global ids (from `@P2`).
/// Columns: global_id, key.
pub fn identifier_holders_sql(schema: &str, ids: usize) -> String {
    let list: Vec<String> = (0..ids).map(|i| format!("@P{}", i + 2)).collect();
    format!(
        "SELECT [global_id], [key] FROM {}.[identifier_mapping] WHERE [entity] = @P1 AND [global_id] IN ({})",
        qi(schema),
        list.join(", ")
    )
}

/// The rows of namespace `@P1` at odds with those of namespace `@P2`: the
/// same key with another global id, or the same global id on another key.
/// Columns: key and global_id of `@P1`'s row, then of `@P2`'s.
pub fn identifier_conflicts_sql(schema: &str) -> String {
    let s = qi(schema);
    format!(
        "SELECT o.[key], o.[global_id], n.[key], n.[global_id] FROM {s}.[identifier_mapping] o \
         JOIN {s}.[identifier_mapping] n ON n.[entity] = @P2 AND n.[key] = o.[key] \
         WHERE o.[entity] = @P1 AND n.[global_id] <> o.[global_id] \
         UNION ALL SELECT o.[key], o.[global_id], n.[key], n.[global_id] FROM {s}.[identifier_mapping] o \
         JOIN {s}.[identifier_mapping] n ON n.[entity] = @P2 AND n.[global_id] = o.[global_id] \
         WHERE o.[entity] = @P1 AND n.[key] <> o.[key]"
    )
}

/// Moves the rows of namespace `@P1` to namespace `@P2` (in one
/// transaction, after [`identifier_conflicts_sql`]): first deletes
/// `@P2`'s rows of the keys `@P1` has, then renames `@P1`'s.
pub fn identifiers_move_sql(schema: &str) -> [String; 2] {
    let s = qi(schema);
    [
        format!(
            "DELETE FROM {s}.[identifier_mapping] WHERE [entity] = @P2 AND [key] IN \
             (SELECT [key] FROM {s}.[identifier_mapping] WHERE [entity] = @P1)"
        ),
        format!("UPDATE {s}.[identifier_mapping] SET [entity] = @P2 WHERE [entity] = @P1"),
    ]
}

/// Deletes at most `@P2` relayed outbox rows (at or below their
/// partition's cursor) written more than `@P1` seconds ago (a chunk of the
/// retention purge), skipping rows another transaction holds (`READPAST`).
pub fn purge_outbox_sql(schema: &str) -> String {
    let s = qi(schema);
    format!(
        "DELETE TOP (@P2) o FROM {s}.[outbox_row] o WITH (READPAST) \
         JOIN {s}.[relay_cursor] c ON c.[partition] = o.[partition] AND o.[id] <= c.[last_id] \
         WHERE o.[enqueued_at] < DATEADD(second, -@P1, SYSUTCDATETIME())"
    )
}
