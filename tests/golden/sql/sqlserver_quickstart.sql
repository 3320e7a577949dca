-- skein sql source --dialect sqlserver
-- skein: SQL Server CDC enablement for pipeline 'quickstart'.
-- Needs the SQL Server Agent running (it runs the capture and cleanup jobs).
-- Only key and join columns are captured: skein reads the latest state of
-- an aggregate from the tables themselves.
IF NOT EXISTS (SELECT 1 FROM sys.databases WHERE database_id = DB_ID() AND is_cdc_enabled = 1)
    EXEC sys.sp_cdc_enable_db;

IF NOT EXISTS (SELECT 1 FROM sys.tables tb JOIN sys.schemas sc ON sc.schema_id = tb.schema_id
    WHERE sc.name = N'dbo' AND tb.name = N'customer' AND tb.is_tracked_by_cdc = 1)
    EXEC sys.sp_cdc_enable_table
        @source_schema = N'dbo',
        @source_name = N'customer',
        @role_name = NULL,
        @capture_instance = N'dbo_customer',
        @supports_net_changes = 0,
        @captured_column_list = N'[id]';

IF NOT EXISTS (SELECT 1 FROM sys.tables tb JOIN sys.schemas sc ON sc.schema_id = tb.schema_id
    WHERE sc.name = N'dbo' AND tb.name = N'address' AND tb.is_tracked_by_cdc = 1)
    EXEC sys.sp_cdc_enable_table
        @source_schema = N'dbo',
        @source_name = N'address',
        @role_name = NULL,
        @capture_instance = N'dbo_address',
        @supports_net_changes = 0,
        @captured_column_list = N'[customer_id], [id]';

IF NOT EXISTS (SELECT 1 FROM sys.tables tb JOIN sys.schemas sc ON sc.schema_id = tb.schema_id
    WHERE sc.name = N'dbo' AND tb.name = N'address_line' AND tb.is_tracked_by_cdc = 1)
    EXEC sys.sp_cdc_enable_table
        @source_schema = N'dbo',
        @source_name = N'address_line',
        @role_name = NULL,
        @capture_instance = N'dbo_address_line',
        @supports_net_changes = 0,
        @captured_column_list = N'[address_id], [line_no]';

IF NOT EXISTS (SELECT 1 FROM sys.tables tb JOIN sys.schemas sc ON sc.schema_id = tb.schema_id
    WHERE sc.name = N'dbo' AND tb.name = N'contact' AND tb.is_tracked_by_cdc = 1)
    EXEC sys.sp_cdc_enable_table
        @source_schema = N'dbo',
        @source_name = N'contact',
        @role_name = NULL,
        @capture_instance = N'dbo_contact',
        @supports_net_changes = 0,
        @captured_column_list = N'[customer_id], [kind]';

-- validity intervals of the capture instances
SELECT sys.fn_cdc_get_min_lsn(@P1), sys.fn_cdc_get_min_lsn(@P2), sys.fn_cdc_get_min_lsn(@P3), sys.fn_cdc_get_min_lsn(@P4);

-- the batch cap
SELECT TOP (@P1 + 1) u.[lsn]
FROM (
    SELECT b0.[lsn] FROM (SELECT TOP (@P1 + 1) [__$start_lsn] AS [lsn] FROM cdc.[fn_cdc_get_all_changes_dbo_customer](@P2, @P3, N'all update old') ORDER BY [__$start_lsn]) b0
    UNION ALL
    SELECT b1.[lsn] FROM (SELECT TOP (@P1 + 1) [__$start_lsn] AS [lsn] FROM cdc.[fn_cdc_get_all_changes_dbo_address](@P4, @P5, N'all update old') ORDER BY [__$start_lsn]) b1
    UNION ALL
    SELECT b2.[lsn] FROM (SELECT TOP (@P1 + 1) [__$start_lsn] AS [lsn] FROM cdc.[fn_cdc_get_all_changes_dbo_address_line](@P6, @P7, N'all update old') ORDER BY [__$start_lsn]) b2
    UNION ALL
    SELECT b3.[lsn] FROM (SELECT TOP (@P1 + 1) [__$start_lsn] AS [lsn] FROM cdc.[fn_cdc_get_all_changes_dbo_contact](@P8, @P9, N'all update old') ORDER BY [__$start_lsn]) b3
) u
ORDER BY u.[lsn];

-- DDL in the batch's window
SELECT ct.capture_instance, h.ddl_lsn, h.ddl_command
FROM cdc.ddl_history h
JOIN cdc.change_tables ct ON ct.object_id = h.object_id
WHERE h.ddl_lsn > @P1 AND h.ddl_lsn <= @P2 AND ct.capture_instance IN (@P3, @P4, @P5, @P6)
ORDER BY h.ddl_lsn, ct.capture_instance;

-- changes of dbo.customer
SELECT [__$start_lsn], [__$seqval], [__$operation], [id]
FROM cdc.[fn_cdc_get_all_changes_dbo_customer](@P1, @P2, N'all update old')
ORDER BY [__$start_lsn], [__$seqval], [__$operation];

-- a part of a large transaction, from dbo.customer
SELECT TOP (@P1) [__$start_lsn], [__$seqval], [__$operation], [id]
FROM cdc.[fn_cdc_get_all_changes_dbo_customer](@P2, @P2, N'all update old')
WHERE [__$seqval] > @P3
ORDER BY [__$seqval], [__$operation];

-- what a restart finds handed over of a large transaction, from dbo.customer
SELECT COUNT_BIG(*)
FROM cdc.[fn_cdc_get_all_changes_dbo_customer](@P1, @P1, N'all update old')
WHERE [__$seqval] <= @P2 AND [__$operation] <> 4;

-- changes of dbo.address
SELECT [__$start_lsn], [__$seqval], [__$operation], [customer_id], [id]
FROM cdc.[fn_cdc_get_all_changes_dbo_address](@P1, @P2, N'all update old')
ORDER BY [__$start_lsn], [__$seqval], [__$operation];

-- a part of a large transaction, from dbo.address
SELECT TOP (@P1) [__$start_lsn], [__$seqval], [__$operation], [customer_id], [id]
FROM cdc.[fn_cdc_get_all_changes_dbo_address](@P2, @P2, N'all update old')
WHERE [__$seqval] > @P3
ORDER BY [__$seqval], [__$operation];

-- what a restart finds handed over of a large transaction, from dbo.address
SELECT COUNT_BIG(*)
FROM cdc.[fn_cdc_get_all_changes_dbo_address](@P1, @P1, N'all update old')
WHERE [__$seqval] <= @P2 AND [__$operation] <> 4;

-- changes of dbo.address_line
SELECT [__$start_lsn], [__$seqval], [__$operation], [address_id], [line_no]
FROM cdc.[fn_cdc_get_all_changes_dbo_address_line](@P1, @P2, N'all update old')
ORDER BY [__$start_lsn], [__$seqval], [__$operation];

-- a part of a large transaction, from dbo.address_line
SELECT TOP (@P1) [__$start_lsn], [__$seqval], [__$operation], [address_id], [line_no]
FROM cdc.[fn_cdc_get_all_changes_dbo_address_line](@P2, @P2, N'all update old')
WHERE [__$seqval] > @P3
ORDER BY [__$seqval], [__$operation];

-- what a restart finds handed over of a large transaction, from dbo.address_line
SELECT COUNT_BIG(*)
FROM cdc.[fn_cdc_get_all_changes_dbo_address_line](@P1, @P1, N'all update old')
WHERE [__$seqval] <= @P2 AND [__$operation] <> 4;

-- changes of dbo.contact
SELECT [__$start_lsn], [__$seqval], [__$operation], [customer_id], [kind]
FROM cdc.[fn_cdc_get_all_changes_dbo_contact](@P1, @P2, N'all update old')
ORDER BY [__$start_lsn], [__$seqval], [__$operation];

-- a part of a large transaction, from dbo.contact
SELECT TOP (@P1) [__$start_lsn], [__$seqval], [__$operation], [customer_id], [kind]
FROM cdc.[fn_cdc_get_all_changes_dbo_contact](@P2, @P2, N'all update old')
WHERE [__$seqval] > @P3
ORDER BY [__$seqval], [__$operation];

-- what a restart finds handed over of a large transaction, from dbo.contact
SELECT COUNT_BIG(*)
FROM cdc.[fn_cdc_get_all_changes_dbo_contact](@P1, @P1, N'all update old')
WHERE [__$seqval] <= @P2 AND [__$operation] <> 4;

-- root lookup of lines (dbo.address_line)
IF OBJECT_ID(N'tempdb..#skein_lookup') IS NOT NULL DROP TABLE #skein_lookup;
CREATE TABLE #skein_lookup ([ord] int NOT NULL PRIMARY KEY, [v0] nvarchar(4000) NULL);
INSERT INTO #skein_lookup ([ord], [v0]) VALUES (@P1, @P2);
SELECT k.[ord], u1.[id]
FROM #skein_lookup k
JOIN [dbo].[address] u0 ON u0.[id] = TRY_CONVERT(int, k.[v0])
JOIN [dbo].[customer] u1 ON u0.[customer_id] = u1.[id]
ORDER BY k.[ord];

-- the batch's root keys
IF OBJECT_ID(N'tempdb..#skein_keys') IS NOT NULL DROP TABLE #skein_keys;
CREATE TABLE #skein_keys ([ord] int NOT NULL PRIMARY KEY, [v0] nvarchar(4000) NULL);

-- two root keys into it (1000 per statement at most)
INSERT INTO #skein_keys ([ord], [v0]) VALUES (@P1, @P2), (@P3, @P4);

-- hydrate customer (dbo.customer)
SELECT k.[ord], CASE WHEN t0.[id] IS NULL THEN 0 ELSE 1 END AS [found], t0.[id] AS [ref_id], t0.[id], t0.[name], t0.[email], t0.[credit_limit], t0.[is_deleted], t0.[row_version], t0.[created_at]
FROM #skein_keys k
LEFT JOIN [dbo].[customer] t0 ON t0.[id] = TRY_CONVERT(int, k.[v0])
ORDER BY k.[ord];

-- hydrate addresses (dbo.address)
SELECT k.[ord], t1.[customer_id] AS [link_customer_id], t1.[id] AS [ref_id], t1.[id], t1.[customer_id], t1.[kind], t1.[city]
FROM #skein_keys k
JOIN [dbo].[customer] t0 ON t0.[id] = TRY_CONVERT(int, k.[v0])
JOIN [dbo].[address] t1 ON t1.[customer_id] = t0.[id]
ORDER BY k.[ord], t1.[id];

-- hydrate lines (dbo.address_line)
SELECT k.[ord], t2.[address_id] AS [link_address_id], t2.[address_id], t2.[line_no], t2.[text]
FROM #skein_keys k
JOIN [dbo].[customer] t0 ON t0.[id] = TRY_CONVERT(int, k.[v0])
JOIN [dbo].[address] t1 ON t1.[customer_id] = t0.[id]
JOIN [dbo].[address_line] t2 ON t2.[address_id] = t1.[id]
ORDER BY k.[ord], t2.[address_id], t2.[line_no];

-- hydrate contacts (dbo.contact)
SELECT k.[ord], t1.[customer_id] AS [link_customer_id], t1.[customer_id], t1.[kind], t1.[value]
FROM #skein_keys k
JOIN [dbo].[customer] t0 ON t0.[id] = TRY_CONVERT(int, k.[v0])
JOIN [dbo].[contact] t1 ON t1.[customer_id] = t0.[id]
ORDER BY k.[ord], t1.[customer_id], t1.[kind];

-- explicit: root keys, all, first page
SELECT TOP (@P1) t0.[id]
FROM [dbo].[customer] AS t0
ORDER BY t0.[id];

-- explicit: root keys, all, after a key
SELECT TOP (@P2) t0.[id]
FROM [dbo].[customer] AS t0
WHERE (t0.[id] > TRY_CONVERT(int, @P1))
ORDER BY t0.[id];

-- explicit: root keys, --where, after a key
SELECT TOP (@P2) t0.[id]
FROM [dbo].[customer] AS t0
WHERE (region = N'EU') AND (t0.[id] > TRY_CONVERT(int, @P1))
ORDER BY t0.[id];

