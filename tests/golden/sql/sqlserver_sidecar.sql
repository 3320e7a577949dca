-- skein sidecar schema (T-SQL), version 9.
IF SCHEMA_ID(N'skein') IS NULL EXEC(N'CREATE SCHEMA [skein]');

IF OBJECT_ID(N'[skein].[schema_version]', N'U') IS NULL
CREATE TABLE [skein].[schema_version] (
  [version]    int          NOT NULL PRIMARY KEY,
  [applied_at] datetime2(6) NOT NULL DEFAULT SYSUTCDATETIME()
);

-- The exactly-once recovery marker; moves only inside the batch transaction.
IF OBJECT_ID(N'[skein].[progress]', N'U') IS NULL
CREATE TABLE [skein].[progress] (
  [group_name]    nvarchar(200) NOT NULL,
  [topic]         nvarchar(400) NOT NULL,
  [partition]     int           NOT NULL,
  [position]      decimal(25,0) NOT NULL,
  [source_commit] nvarchar(30)  NULL,
  [source_seq]    bigint        NULL,
  [epoch]         bigint        NOT NULL DEFAULT 0,
  [updated_at]    datetime2(6)  NOT NULL DEFAULT SYSUTCDATETIME(),
  PRIMARY KEY ([group_name], [topic], [partition])
);
-- Version 4: the fencing epoch, bumped by every ownership change and rewind.
IF COL_LENGTH(N'[skein].[progress]', N'epoch') IS NULL
    ALTER TABLE [skein].[progress] ADD [epoch] bigint NOT NULL DEFAULT 0;
-- Version 5: where a TRUNCATE re-check stands (the last key re-checked).
IF COL_LENGTH(N'[skein].[progress]', N'recheck_after') IS NULL
    ALTER TABLE [skein].[progress] ADD [recheck_after] nvarchar(max) NULL;

-- Version 4: the partition count records are keyed by, per group and topic.
IF OBJECT_ID(N'[skein].[transport]', N'U') IS NULL
CREATE TABLE [skein].[transport] (
  [group_name] nvarchar(200) NOT NULL,
  [topic]      nvarchar(400) NOT NULL,
  [partitions] int           NOT NULL,
  [updated_at] datetime2(6)  NOT NULL DEFAULT SYSUTCDATETIME(),
  PRIMARY KEY ([group_name], [topic])
);

-- Version 4: each relay's state and last error, for `skein status`.
IF OBJECT_ID(N'[skein].[relay]', N'U') IS NULL
CREATE TABLE [skein].[relay] (
  [name]       nvarchar(200) NOT NULL PRIMARY KEY,
  [state]      nvarchar(40)  NOT NULL,
  [last_error] nvarchar(max) NULL,
  [error_at]   datetime2(6)  NULL,
  [updated_at] datetime2(6)  NOT NULL DEFAULT SYSUTCDATETIME()
);

IF OBJECT_ID(N'[skein].[batch]', N'U') IS NULL
CREATE TABLE [skein].[batch] (
  [id]             bigint IDENTITY(1,1) NOT NULL PRIMARY KEY,
  [correlation_id] uniqueidentifier NOT NULL UNIQUE,
  [group_name]     nvarchar(200) NOT NULL,
  [topic]          nvarchar(400) NOT NULL,
  [partition]      int           NOT NULL,
  [lower_position] decimal(25,0) NOT NULL,
  [upper_position] decimal(25,0) NOT NULL,
  [record_count]   int           NOT NULL,
  [entity_count]   int           NOT NULL,
  [event_count]    int           NOT NULL,
  [has_data_loss]  bit           NOT NULL DEFAULT 0,
  [dead_letters]   int           NOT NULL DEFAULT 0,
  [created_at]     datetime2(6)  NOT NULL DEFAULT SYSUTCDATETIME()
);

IF OBJECT_ID(N'[skein].[version]', N'U') IS NULL
CREATE TABLE [skein].[version] (
  [entity]     nvarchar(200) NOT NULL,
  [key]        nvarchar(900) NOT NULL,
  [etag]       char(64)      NULL,
  [is_deleted] bit           NOT NULL DEFAULT 0,
  [updated_at] datetime2(6)  NOT NULL DEFAULT SYSUTCDATETIME(),
  PRIMARY KEY ([entity], [key])
);

-- Version 7: the outbox's rows live in outbox_row; [outbox] is a view of
-- them with dequeued_at derived from the relay's cursors (below).
IF OBJECT_ID(N'[skein].[outbox]', N'U') IS NOT NULL
    EXEC sp_rename N'[skein].[outbox]', N'outbox_row';
IF OBJECT_ID(N'[skein].[outbox_row]', N'U') IS NULL
CREATE TABLE [skein].[outbox_row] (
  [id]          bigint IDENTITY(1,1) NOT NULL PRIMARY KEY,
  [event_id]    uniqueidentifier NOT NULL UNIQUE,
  [batch_id]    bigint        NOT NULL REFERENCES [skein].[batch] ([id]),
  [entity]      nvarchar(200) NOT NULL,
  [key]         nvarchar(900) NOT NULL,
  [partition]   int           NOT NULL,
  [etag]        char(64)      NULL,
  [event]       nvarchar(max) NOT NULL,
  [commit_time] datetime2(6)  NOT NULL,
  [enqueued_at] datetime2(6)  NOT NULL DEFAULT SYSUTCDATETIME()
);
IF NOT EXISTS (SELECT 1 FROM sys.indexes WHERE name = N'outbox_entity_key' AND object_id = OBJECT_ID(N'[skein].[outbox_row]'))
    CREATE INDEX [outbox_entity_key] ON [skein].[outbox_row] ([entity], [key], [id]);

-- Version 6: explicit runs (`skein explicit`, `extractor.initial_load`). A
-- run selects root keys of an entity and queues them a chunk per transaction,
-- with its cursor (the last key or index queued): a killed run resumes after
-- it. Each partition's applier takes its queued keys, publishes them in its
-- own fenced batch transaction and deletes them there: exactly once, and in
-- order with the stream of that partition.
IF OBJECT_ID(N'[skein].[explicit_run]', N'U') IS NULL
CREATE TABLE [skein].[explicit_run] (
  [id]         bigint IDENTITY(1,1) NOT NULL PRIMARY KEY,
  [group_name] nvarchar(200) NOT NULL,
  [entity]     nvarchar(200) NOT NULL,
  [selection]  nvarchar(max) NOT NULL,
  [republish]  bit           NOT NULL DEFAULT 0,
  [initial]    bit           NOT NULL DEFAULT 0,
  [state]      nvarchar(40)  NOT NULL DEFAULT N'selecting',
  [cursor]     nvarchar(max) NULL,
  [queued]     bigint        NOT NULL DEFAULT 0,
  [created_at] datetime2(6)  NOT NULL DEFAULT SYSUTCDATETIME(),
  [updated_at] datetime2(6)  NOT NULL DEFAULT SYSUTCDATETIME()
);
IF OBJECT_ID(N'[skein].[explicit_queue]', N'U') IS NULL
CREATE TABLE [skein].[explicit_queue] (
  [id]         bigint IDENTITY(1,1) NOT NULL PRIMARY KEY,
  [run_id]     bigint        NOT NULL REFERENCES [skein].[explicit_run] ([id]),
  [group_name] nvarchar(200) NOT NULL,
  [topic]      nvarchar(400) NOT NULL,
  [partition]  int           NOT NULL,
  [entity]     nvarchar(200) NOT NULL,
  [key]        nvarchar(900) NOT NULL,
  [republish]  bit           NOT NULL DEFAULT 0
);
IF NOT EXISTS (SELECT 1 FROM sys.indexes WHERE name = N'explicit_queue_partition' AND object_id = OBJECT_ID(N'[skein].[explicit_queue]'))
    CREATE INDEX [explicit_queue_partition] ON [skein].[explicit_queue] ([group_name], [topic], [partition], [id]);
IF NOT EXISTS (SELECT 1 FROM sys.indexes WHERE name = N'explicit_queue_run' AND object_id = OBJECT_ID(N'[skein].[explicit_queue]'))
    CREATE INDEX [explicit_queue_run] ON [skein].[explicit_queue] ([run_id]);

-- Version 7: the relay keeps one cursor per outbox partition, the last id
-- it sent, instead of rewriting every row it sends (versions 1 to 6 set
-- outbox.dequeued_at). A partition's ids grow in commit order (its batch
-- transactions take the partition's outbox lock before they write), so
-- every row above the cursor is pending and none below it is. Relayed
-- rows are deleted after `sidecar.outbox_retention_secs`, a chunk at a
-- time, by the relay.
IF OBJECT_ID(N'[skein].[relay_cursor]', N'U') IS NULL
CREATE TABLE [skein].[relay_cursor] (
  [partition]  int          NOT NULL PRIMARY KEY,
  [last_id]    bigint       NOT NULL,
  [updated_at] datetime2(6) NOT NULL DEFAULT SYSUTCDATETIME()
);
IF NOT EXISTS (SELECT 1 FROM sys.indexes WHERE name = N'outbox_partition_id' AND object_id = OBJECT_ID(N'[skein].[outbox_row]'))
    CREATE INDEX [outbox_partition_id] ON [skein].[outbox_row] ([partition], [id]);
IF NOT EXISTS (SELECT 1 FROM sys.indexes WHERE name = N'outbox_enqueued' AND object_id = OBJECT_ID(N'[skein].[outbox_row]'))
    CREATE INDEX [outbox_enqueued] ON [skein].[outbox_row] ([enqueued_at]);
-- From version 6: each partition's cursor stops below its first pending
-- row (a row relayed above it, out of order, is sent once more: at least
-- once, as after a crash), then dequeued_at goes.
IF COL_LENGTH(N'[skein].[outbox_row]', N'dequeued_at') IS NOT NULL
    EXEC(N'INSERT INTO [skein].[relay_cursor] ([partition], [last_id]) SELECT [partition], COALESCE(MIN(CASE WHEN [dequeued_at] IS NULL THEN [id] END) - 1, MAX([id])) FROM [skein].[outbox_row] GROUP BY [partition]; IF EXISTS (SELECT 1 FROM sys.indexes WHERE name = N''outbox_pending'' AND object_id = OBJECT_ID(N''[skein].[outbox_row]'')) DROP INDEX [outbox_pending] ON [skein].[outbox_row]; IF EXISTS (SELECT 1 FROM sys.indexes WHERE name = N''outbox_dequeued'' AND object_id = OBJECT_ID(N''[skein].[outbox_row]'')) DROP INDEX [outbox_dequeued] ON [skein].[outbox_row]; ALTER TABLE [skein].[outbox_row] DROP COLUMN [dequeued_at];');
-- The outbox as versions 1 to 6 had it, for readers: dequeued_at is null
-- above the partition's cursor, and below it the time the cursor last
-- moved (at or after the row was sent).
IF OBJECT_ID(N'[skein].[outbox]', N'V') IS NULL
    EXEC(N'CREATE VIEW [skein].[outbox] AS SELECT o.[id], o.[event_id], o.[batch_id], o.[entity], o.[key], o.[partition], o.[etag], o.[event], o.[commit_time], o.[enqueued_at], CAST(NULL AS datetime2(6)) AS [dequeued_at] FROM [skein].[relay_cursor] c JOIN [skein].[outbox_row] o ON o.[partition] = c.[partition] AND o.[id] > c.[last_id] UNION ALL SELECT o.[id], o.[event_id], o.[batch_id], o.[entity], o.[key], o.[partition], o.[etag], o.[event], o.[commit_time], o.[enqueued_at], c.[updated_at] FROM [skein].[relay_cursor] c JOIN [skein].[outbox_row] o ON o.[partition] = c.[partition] AND o.[id] <= c.[last_id]');

-- Version 6: global identifiers (`identifier_mapping: true`), nTangle's
-- IdentifierMapping. Written in the batch transaction of an aggregate's
-- first event, then read back for every later one (replays and explicit
-- runs included): stable. A row inserted beforehand pre-assigns the id.
IF OBJECT_ID(N'[skein].[identifier_mapping]', N'U') IS NULL
CREATE TABLE [skein].[identifier_mapping] (
  [entity]     nvarchar(200) NOT NULL,
  [key]        nvarchar(900) NOT NULL,
  [global_id]  nvarchar(400) NOT NULL,
  [created_at] datetime2(6)  NOT NULL DEFAULT SYSUTCDATETIME(),
  PRIMARY KEY ([entity], [key]),
  UNIQUE ([entity], [global_id])
);

-- Version 9 changes nothing here: PostgreSQL's outbox_row dropped its
-- batch_id foreign key, checked there by a trigger per row; SQL Server
-- checks it within the insert's plan.
IF NOT EXISTS (SELECT 1 FROM [skein].[schema_version] WHERE [version] = 9)
    INSERT INTO [skein].[schema_version] ([version]) VALUES (9);
