-- migrate
BEGIN TRAN;
EXEC sp_getapplock @Resource = N'skein.sidecar.migrate', @LockMode = 'Exclusive', @LockOwner = 'Transaction', @LockTimeout = 60000;
-- skein sidecar schema (T-SQL), version 3.
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
  [updated_at]    datetime2(6)  NOT NULL DEFAULT SYSUTCDATETIME(),
  PRIMARY KEY ([group_name], [topic], [partition])
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

IF OBJECT_ID(N'[skein].[outbox]', N'U') IS NULL
CREATE TABLE [skein].[outbox] (
  [id]          bigint IDENTITY(1,1) NOT NULL PRIMARY KEY,
  [event_id]    uniqueidentifier NOT NULL UNIQUE,
  [batch_id]    bigint        NOT NULL REFERENCES [skein].[batch] ([id]),
  [entity]      nvarchar(200) NOT NULL,
  [key]         nvarchar(900) NOT NULL,
  [partition]   int           NOT NULL,
  [etag]        char(64)      NULL,
  [event]       nvarchar(max) NOT NULL,
  [commit_time] datetime2(6)  NOT NULL,
  [enqueued_at] datetime2(6)  NOT NULL DEFAULT SYSUTCDATETIME(),
  [dequeued_at] datetime2(6)  NULL
);
IF NOT EXISTS (SELECT 1 FROM sys.indexes WHERE name = N'outbox_pending' AND object_id = OBJECT_ID(N'[skein].[outbox]'))
    CREATE INDEX [outbox_pending] ON [skein].[outbox] ([id]) WHERE [dequeued_at] IS NULL;
IF NOT EXISTS (SELECT 1 FROM sys.indexes WHERE name = N'outbox_entity_key' AND object_id = OBJECT_ID(N'[skein].[outbox]'))
    CREATE INDEX [outbox_entity_key] ON [skein].[outbox] ([entity], [key], [id]);

IF NOT EXISTS (SELECT 1 FROM [skein].[schema_version] WHERE [version] = 3)
    INSERT INTO [skein].[schema_version] ([version]) VALUES (3);

COMMIT TRAN;;

-- progress of a partition
SELECT CAST([position] AS nvarchar(40)), [source_commit], [source_seq] FROM [skein].[progress] WHERE [group_name] = @P1 AND [topic] = @P2 AND [partition] = @P3;

-- batch transaction 1a: fence
UPDATE [skein].[progress] SET [position] = CAST(@P4 AS decimal(25,0)), [source_commit] = @P6, [source_seq] = @P7, [updated_at] = SYSUTCDATETIME() WHERE [group_name] = @P1 AND [topic] = @P2 AND [partition] = @P3 AND [position] = CAST(@P5 AS decimal(25,0));

-- batch transaction 1b: first progress
INSERT INTO [skein].[progress] ([group_name], [topic], [partition], [position], [source_commit], [source_seq]) SELECT @P1, @P2, @P3, CAST(@P4 AS decimal(25,0)), @P5, @P6 WHERE NOT EXISTS (SELECT 1 FROM [skein].[progress] WITH (UPDLOCK, HOLDLOCK) WHERE [group_name] = @P1 AND [topic] = @P2 AND [partition] = @P3);

-- batch transaction 2: batch row
INSERT INTO [skein].[batch] ([correlation_id], [group_name], [topic], [partition], [lower_position], [upper_position], [record_count], [entity_count], [event_count], [has_data_loss], [dead_letters]) OUTPUT INSERTED.[id] VALUES (CAST(@P1 AS uniqueidentifier), @P2, @P3, @P4, CAST(@P5 AS decimal(25,0)), CAST(@P6 AS decimal(25,0)), @P7, @P8, @P9, @P10, @P11);

-- batch transaction 3: two outbox rows
INSERT INTO [skein].[outbox] ([event_id], [batch_id], [entity], [key], [partition], [etag], [event], [commit_time]) SELECT CAST(v.id AS uniqueidentifier), @P1, v.entity, v.[key], @P2, v.etag, v.event, DATEADD(microsecond, CAST(v.t % 1000000 AS int), DATEADD(second, CAST((v.t / 1000000) % 86400 AS int), DATEADD(day, CAST(v.t / 86400000000 AS int), CAST('1970-01-01' AS datetime2(6))))) FROM (VALUES (@P3, @P4, @P5, @P6, @P7, @P8, @P9), (@P10, @P11, @P12, @P13, @P14, @P15, @P16)) AS v(ord, id, entity, [key], etag, event, t) ORDER BY v.ord;

-- batch transaction 4: two versions
MERGE [skein].[version] WITH (HOLDLOCK) AS t USING (VALUES (@P1, @P2, @P3, @P4), (@P5, @P6, @P7, @P8)) AS s(entity, [key], etag, is_deleted) ON t.[entity] = s.entity AND t.[key] = s.[key] WHEN MATCHED THEN UPDATE SET [etag] = s.etag, [is_deleted] = s.is_deleted, [updated_at] = SYSUTCDATETIME() WHEN NOT MATCHED THEN INSERT ([entity], [key], [etag], [is_deleted]) VALUES (s.entity, s.[key], s.etag, s.is_deleted);;

-- versions of three keys
SELECT [key], [etag], CAST([is_deleted] AS int) FROM [skein].[version] WHERE [entity] = @P1 AND [key] IN (@P2, @P3, @P4);

-- pending outbox
SELECT CAST(COUNT(*) AS bigint), COALESCE(DATEDIFF_BIG(millisecond, MIN([enqueued_at]), SYSUTCDATETIME()), 0) FROM [skein].[outbox] WHERE [dequeued_at] IS NULL;

-- relay, all partitions
SELECT TOP (@P1) [id], [entity], [event] FROM [skein].[outbox] WITH (UPDLOCK, READPAST, ROWLOCK) WHERE [dequeued_at] IS NULL ORDER BY [id];

-- relay, owned partitions
SELECT TOP (@P1) [id], [entity], [event] FROM [skein].[outbox] WITH (UPDLOCK, ROWLOCK) WHERE [dequeued_at] IS NULL AND [partition] IN (0, 3) ORDER BY [id];

-- relay: mark dequeued
UPDATE [skein].[outbox] SET [dequeued_at] = SYSUTCDATETIME() WHERE [id] IN (41, 42);

-- replay: rewind a partition
UPDATE [skein].[progress] SET [position] = @P5, [source_commit] = NULL, [source_seq] = NULL, [updated_at] = SYSUTCDATETIME() WHERE [group_name] = @P1 AND [topic] = @P2 AND [partition] = @P3 AND [position] = @P4;

-- replay --republish: forget two versions
DELETE FROM [skein].[version] WHERE [entity] = @P1 AND [key] IN (@P2, @P3);
