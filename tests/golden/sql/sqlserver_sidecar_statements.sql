-- migrate
BEGIN TRAN;
EXEC sp_getapplock @Resource = N'skein.sidecar.migrate', @LockMode = 'Exclusive', @LockOwner = 'Transaction', @LockTimeout = 60000;
-- (the DDL of sqlserver_sidecar.sql)
COMMIT TRAN;;

-- progress of a partition
SELECT CAST([position] AS nvarchar(40)), [source_commit], [source_seq], [epoch], [recheck_after] FROM [skein].[progress] WHERE [group_name] = @P1 AND [topic] = @P2 AND [partition] = @P3;

-- an applier takes a partition
UPDATE [skein].[progress] SET [epoch] = [epoch] + 1 OUTPUT CAST(inserted.[position] AS nvarchar(40)), inserted.[source_commit], inserted.[source_seq], inserted.[epoch], inserted.[recheck_after] WHERE [group_name] = @P1 AND [topic] = @P2 AND [partition] = @P3;

-- progress of every partition
SELECT [partition], CAST([position] AS nvarchar(40)), [source_commit], [source_seq], [epoch], [recheck_after] FROM [skein].[progress] WHERE [group_name] = @P1 AND [topic] = @P2 ORDER BY [partition];

-- forget partitions' progress (re-keying)
DELETE FROM [skein].[progress] WHERE [group_name] = @P1 AND [topic] = @P2 AND [partition] = @P3;

-- partition count of a topic
SELECT [partitions] FROM [skein].[transport] WHERE [group_name] = @P1 AND [topic] = @P2;

-- record the partition count
SET XACT_ABORT ON; BEGIN TRAN; UPDATE [skein].[transport] WITH (UPDLOCK, HOLDLOCK) SET [partitions] = @P3, [updated_at] = SYSUTCDATETIME() WHERE [group_name] = @P1 AND [topic] = @P2; IF @@ROWCOUNT = 0 INSERT INTO [skein].[transport] ([group_name], [topic], [partitions]) VALUES (@P1, @P2, @P3); COMMIT TRAN;;

-- batch transaction 1a: fence
UPDATE [skein].[progress] SET [position] = CAST(@P4 AS decimal(25,0)), [source_commit] = @P6, [source_seq] = @P7, [recheck_after] = @P9, [updated_at] = SYSUTCDATETIME() WHERE [group_name] = @P1 AND [topic] = @P2 AND [partition] = @P3 AND [position] = CAST(@P5 AS decimal(25,0)) AND [epoch] = @P8;

-- batch transaction 1b: first progress
INSERT INTO [skein].[progress] ([group_name], [topic], [partition], [position], [source_commit], [source_seq], [recheck_after]) SELECT @P1, @P2, @P3, CAST(@P4 AS decimal(25,0)), @P5, @P6, @P7 WHERE NOT EXISTS (SELECT 1 FROM [skein].[progress] WITH (UPDLOCK, HOLDLOCK) WHERE [group_name] = @P1 AND [topic] = @P2 AND [partition] = @P3);

-- batch transaction 2: batch row
INSERT INTO [skein].[batch] ([correlation_id], [group_name], [topic], [partition], [lower_position], [upper_position], [record_count], [entity_count], [event_count], [has_data_loss], [dead_letters]) OUTPUT INSERTED.[id] VALUES (CAST(@P1 AS uniqueidentifier), @P2, @P3, @P4, CAST(@P5 AS decimal(25,0)), CAST(@P6 AS decimal(25,0)), @P7, @P8, @P9, @P10, @P11);

-- batch transaction 3a: the partition's outbox lock and relay cursor
DECLARE @r int; EXEC @r = sys.sp_getapplock @Resource = @P2, @LockMode = 'Exclusive', @LockOwner = 'Transaction'; IF @r < 0 THROW 50000, N'the partition''s outbox lock was not granted', 1; IF NOT EXISTS (SELECT 1 FROM [skein].[relay_cursor] WHERE [partition] = @P1) INSERT INTO [skein].[relay_cursor] ([partition], [last_id]) VALUES (@P1, 0); SELECT (SELECT MAX([id]) FROM [skein].[outbox_row] WHERE [partition] = @P1), (SELECT [last_id] FROM [skein].[relay_cursor] WHERE [partition] = @P1);;

-- batch transaction 3: two outbox rows
INSERT INTO [skein].[outbox_row] ([event_id], [batch_id], [entity], [key], [partition], [etag], [event], [commit_time]) OUTPUT INSERTED.[id] SELECT CAST(v.id AS uniqueidentifier), @P1, v.entity, v.[key], @P2, v.etag, v.event, DATEADD(microsecond, CAST(v.t % 1000000 AS int), DATEADD(second, CAST((v.t / 1000000) % 86400 AS int), DATEADD(day, CAST(v.t / 86400000000 AS int), CAST('1970-01-01' AS datetime2(6))))) FROM (VALUES (@P3, @P4, @P5, @P6, @P7, @P8, @P9), (@P10, @P11, @P12, @P13, @P14, @P15, @P16)) AS v(ord, id, entity, [key], etag, event, t) ORDER BY v.ord;

-- batch transaction 4: two versions
MERGE [skein].[version] WITH (HOLDLOCK) AS t USING (VALUES (@P1, @P2, @P3, @P4), (@P5, @P6, @P7, @P8)) AS s(entity, [key], etag, is_deleted) ON t.[entity] = s.entity AND t.[key] = s.[key] WHEN MATCHED THEN UPDATE SET [etag] = s.etag, [is_deleted] = s.is_deleted, [updated_at] = SYSUTCDATETIME() WHEN NOT MATCHED THEN INSERT ([entity], [key], [etag], [is_deleted]) VALUES (s.entity, s.[key], s.etag, s.is_deleted);;

-- versions of three keys
SELECT [key], [etag], CAST([is_deleted] AS int) FROM [skein].[version] WHERE [entity] = @P1 AND [key] IN (@P2, @P3, @P4);

-- truncate: the keys to re-check
SELECT TOP (@P3) [key] FROM [skein].[version] WHERE [entity] = @P1 AND [is_deleted] = 0 AND (@P2 IS NULL OR [key] > @P2) ORDER BY [key] OPTION (RECOMPILE);

-- the newest schema version applied
SELECT MAX([version]) FROM [skein].[schema_version];

-- pending outbox
SELECT CAST(COUNT(*) AS bigint), COALESCE(DATEDIFF_BIG(millisecond, MIN(o.[enqueued_at]), SYSUTCDATETIME()), 0) FROM [skein].[relay_cursor] c JOIN [skein].[outbox_row] o ON o.[partition] = c.[partition] AND o.[id] > c.[last_id];

-- relay, all partitions
SELECT TOP (@P1) o.[id], o.[entity], o.[event], o.[partition] FROM [skein].[relay_cursor] c WITH (UPDLOCK, ROWLOCK) CROSS APPLY (SELECT TOP (@P1) [id], [entity], [event], [partition] FROM [skein].[outbox_row] WHERE [partition] = c.[partition] AND [id] > c.[last_id] ORDER BY [id]) o ORDER BY o.[id];

-- relay, owned partitions
SELECT TOP (@P1) o.[id], o.[entity], o.[event], o.[partition] FROM [skein].[relay_cursor] c WITH (UPDLOCK, ROWLOCK) CROSS APPLY (SELECT TOP (@P1) [id], [entity], [event], [partition] FROM [skein].[outbox_row] WHERE [partition] = c.[partition] AND [id] > c.[last_id] ORDER BY [id]) o WHERE c.[partition] IN (0, 3) ORDER BY o.[id];

-- relay: move the cursors of partitions 0 and 3
UPDATE c SET [last_id] = v.[last_id], [updated_at] = SYSUTCDATETIME() FROM [skein].[relay_cursor] c JOIN (VALUES (0, 41), (3, 42)) AS v([partition], [last_id]) ON c.[partition] = v.[partition];

-- relay lease, all partitions
DECLARE @r int; EXEC @r = sys.sp_getapplock @Resource = @P1, @LockMode = 'Exclusive', @LockOwner = 'Session', @LockTimeout = 0; SELECT CAST(@r AS bigint);

-- relay lease, owned partitions
DECLARE @r int; EXEC @r = sys.sp_getapplock @Resource = @P1, @LockMode = 'Shared', @LockOwner = 'Session', @LockTimeout = 0; SELECT CAST(@r AS bigint);

-- relay: report its state
SET XACT_ABORT ON; BEGIN TRAN; UPDATE [skein].[relay] WITH (UPDLOCK, HOLDLOCK) SET [state] = @P2, [last_error] = COALESCE(@P3, [last_error]), [error_at] = CASE WHEN @P3 IS NULL THEN [error_at] ELSE SYSUTCDATETIME() END, [updated_at] = SYSUTCDATETIME() WHERE [name] = @P1; IF @@ROWCOUNT = 0 INSERT INTO [skein].[relay] ([name], [state], [last_error], [error_at]) VALUES (@P1, @P2, @P3, CASE WHEN @P3 IS NULL THEN NULL ELSE SYSUTCDATETIME() END); COMMIT TRAN;;

-- status: relay states
SELECT [name], [state], [last_error], CONVERT(nvarchar(19), [error_at], 126) + N'Z', CONVERT(nvarchar(19), [updated_at], 126) + N'Z' FROM [skein].[relay] ORDER BY [name];

-- replay: rewind a partition
UPDATE [skein].[progress] SET [position] = @P5, [source_commit] = NULL, [source_seq] = NULL, [recheck_after] = NULL, [epoch] = [epoch] + 1, [updated_at] = SYSUTCDATETIME() WHERE [group_name] = @P1 AND [topic] = @P2 AND [partition] = @P3 AND [position] = @P4;

-- replay --republish: forget two versions
DELETE FROM [skein].[version] WHERE [entity] = @P1 AND [key] IN (@P2, @P3);

-- explicit: the unfinished run to resume
SELECT TOP (1) [id], [cursor], [queued] FROM [skein].[explicit_run] WHERE [group_name] = @P1 AND [entity] = @P2 AND [selection] = @P3 AND [republish] = @P4 AND [initial] = @P5 AND [state] = N'selecting' ORDER BY [id];

-- explicit: a new run
INSERT INTO [skein].[explicit_run] ([group_name], [entity], [selection], [republish], [initial]) OUTPUT INSERTED.[id] VALUES (@P1, @P2, @P3, @P4, @P5);

-- explicit chunk 1: move the cursor
UPDATE [skein].[explicit_run] SET [cursor] = @P3, [queued] = [queued] + @P4, [state] = @P5, [updated_at] = SYSUTCDATETIME() WHERE [id] = @P1 AND ([cursor] = @P2 OR ([cursor] IS NULL AND @P2 IS NULL)) AND [state] = N'selecting';

-- explicit chunk 2: queue two keys
INSERT INTO [skein].[explicit_queue] ([run_id], [group_name], [topic], [partition], [entity], [key], [republish]) SELECT @P1, @P2, @P3, v.p, @P4, v.k, @P5 FROM (VALUES (0, @P6, @P7), (1, @P8, @P9)) AS v(ord, p, k) ORDER BY v.ord;

-- explicit: a partition's queued keys
SELECT TOP (@P4) [id], [entity], [key], [republish] FROM [skein].[explicit_queue] WHERE [group_name] = @P1 AND [topic] = @P2 AND ([partition] = @P3 OR ([partition] >= @P5 AND [partition] % @P5 = @P3)) ORDER BY [id];

-- batch transaction 1c: explicit keys before the first progress, lock
SELECT 1 FROM [skein].[progress] WITH (UPDLOCK, HOLDLOCK) WHERE [group_name] = @P1 AND [topic] = @P2 AND [partition] = @P3;

-- batch transaction 5: explicit keys off the queue
DELETE FROM [skein].[explicit_queue] WHERE [id] IN (41, 42);

-- status: explicit runs
SELECT r.[id], r.[entity], r.[selection], r.[republish], r.[initial], r.[state], r.[cursor], r.[queued], (SELECT CAST(COUNT(*) AS bigint) FROM [skein].[explicit_queue] q WHERE q.[run_id] = r.[id]), CONVERT(nvarchar(19), r.[created_at], 126) + N'Z', CONVERT(nvarchar(19), r.[updated_at], 126) + N'Z' FROM [skein].[explicit_run] r WHERE r.[group_name] = @P1 AND (r.[state] = N'selecting' OR EXISTS (SELECT 1 FROM [skein].[explicit_queue] q WHERE q.[run_id] = r.[id]) OR r.[id] IN (SELECT TOP (@P2) [id] FROM [skein].[explicit_run] WHERE [group_name] = @P1 ORDER BY [id] DESC)) ORDER BY r.[id] DESC;

-- explicit: one run
SELECT r.[id], r.[entity], r.[selection], r.[republish], r.[initial], r.[state], r.[cursor], r.[queued], (SELECT CAST(COUNT(*) AS bigint) FROM [skein].[explicit_queue] q WHERE q.[run_id] = r.[id]), CONVERT(nvarchar(19), r.[created_at], 126) + N'Z', CONVERT(nvarchar(19), r.[updated_at], 126) + N'Z' FROM [skein].[explicit_run] r WHERE r.[id] = @P1;

-- global identifiers of 2 keys
SELECT [key], [global_id] FROM [skein].[identifier_mapping] WHERE [entity] = @P1 AND [key] IN (@P2, @P3);

-- relay: purge relayed rows past their retention
DELETE TOP (@P2) o FROM [skein].[outbox_row] o WITH (READPAST) JOIN [skein].[relay_cursor] c ON c.[partition] = o.[partition] AND o.[id] <= c.[last_id] WHERE o.[enqueued_at] < DATEADD(second, -@P1, SYSUTCDATETIME());

-- new global identifiers (2 rows), before the batch transaction
INSERT INTO [skein].[identifier_mapping] ([entity], [key], [global_id]) SELECT v.e, v.k, v.g FROM (VALUES (@P1, @P2, @P3), (@P4, @P5, @P6)) AS v(e, k, g) WHERE NOT EXISTS (SELECT 1 FROM [skein].[identifier_mapping] t WITH (UPDLOCK, HOLDLOCK) WHERE t.[entity] = v.e AND (t.[key] = v.k OR t.[global_id] = v.g)) ORDER BY v.e, v.k;

-- keys holding 2 global identifiers
SELECT [global_id], [key] FROM [skein].[identifier_mapping] WHERE [entity] = @P1 AND [global_id] IN (@P2, @P3);

-- start-up: identifiers of an entity-name namespace at odds with its table's
SELECT o.[key], o.[global_id], n.[key], n.[global_id] FROM [skein].[identifier_mapping] o JOIN [skein].[identifier_mapping] n ON n.[entity] = @P2 AND n.[key] = o.[key] WHERE o.[entity] = @P1 AND n.[global_id] <> o.[global_id] UNION ALL SELECT o.[key], o.[global_id], n.[key], n.[global_id] FROM [skein].[identifier_mapping] o JOIN [skein].[identifier_mapping] n ON n.[entity] = @P2 AND n.[global_id] = o.[global_id] WHERE o.[entity] = @P1 AND n.[key] <> o.[key];

-- start-up: identifiers moved to the table's namespace, 1 of 2
DELETE FROM [skein].[identifier_mapping] WHERE [entity] = @P2 AND [key] IN (SELECT [key] FROM [skein].[identifier_mapping] WHERE [entity] = @P1);

-- start-up: identifiers moved to the table's namespace, 2 of 2
UPDATE [skein].[identifier_mapping] SET [entity] = @P2 WHERE [entity] = @P1;
