-- skein sql source --dialect sqlserver
-- skein: SQL Server CDC enablement for pipeline 'orders'.
-- Needs the SQL Server Agent running (it runs the capture and cleanup jobs).
-- Only key and join columns are captured: skein reads the latest state of
-- an aggregate from the tables themselves.
IF NOT EXISTS (SELECT 1 FROM sys.databases WHERE database_id = DB_ID() AND is_cdc_enabled = 1)
    EXEC sys.sp_cdc_enable_db;

IF NOT EXISTS (SELECT 1 FROM sys.tables tb JOIN sys.schemas sc ON sc.schema_id = tb.schema_id
    WHERE sc.name = N'sales' AND tb.name = N'order' AND tb.is_tracked_by_cdc = 1)
    EXEC sys.sp_cdc_enable_table
        @source_schema = N'sales',
        @source_name = N'order',
        @role_name = NULL,
        @capture_instance = N'sales_order',
        @supports_net_changes = 0,
        @captured_column_list = N'[order_no], [tenant_id]';

IF NOT EXISTS (SELECT 1 FROM sys.tables tb JOIN sys.schemas sc ON sc.schema_id = tb.schema_id
    WHERE sc.name = N'sales' AND tb.name = N'order_line' AND tb.is_tracked_by_cdc = 1)
    EXEC sys.sp_cdc_enable_table
        @source_schema = N'sales',
        @source_name = N'order_line',
        @role_name = NULL,
        @capture_instance = N'sales_order_line',
        @supports_net_changes = 0,
        @captured_column_list = N'[line_no], [order_no], [tenant_id]';

IF NOT EXISTS (SELECT 1 FROM sys.tables tb JOIN sys.schemas sc ON sc.schema_id = tb.schema_id
    WHERE sc.name = N'sales' AND tb.name = N'line_discount' AND tb.is_tracked_by_cdc = 1)
    EXEC sys.sp_cdc_enable_table
        @source_schema = N'sales',
        @source_name = N'line_discount',
        @role_name = NULL,
        @capture_instance = N'sales_line_discount',
        @supports_net_changes = 0,
        @captured_column_list = N'[discount_id], [line_no], [order_no], [tenant_id]';

IF NOT EXISTS (SELECT 1 FROM sys.tables tb JOIN sys.schemas sc ON sc.schema_id = tb.schema_id
    WHERE sc.name = N'sales' AND tb.name = N'order_shipping' AND tb.is_tracked_by_cdc = 1)
    EXEC sys.sp_cdc_enable_table
        @source_schema = N'sales',
        @source_name = N'order_shipping',
        @role_name = NULL,
        @capture_instance = N'sales_order_shipping',
        @supports_net_changes = 0,
        @captured_column_list = N'[order_no], [tenant_id]';

-- validity intervals of the capture instances
SELECT sys.fn_cdc_get_min_lsn(@P1), sys.fn_cdc_get_min_lsn(@P2), sys.fn_cdc_get_min_lsn(@P3), sys.fn_cdc_get_min_lsn(@P4);

-- the batch cap
SELECT TOP (@P1 + 1) u.[lsn]
FROM (
    SELECT b0.[lsn] FROM (SELECT TOP (@P1 + 1) [__$start_lsn] AS [lsn] FROM cdc.[fn_cdc_get_all_changes_sales_order](@P2, @P3, N'all update old') ORDER BY [__$start_lsn]) b0
    UNION ALL
    SELECT b1.[lsn] FROM (SELECT TOP (@P1 + 1) [__$start_lsn] AS [lsn] FROM cdc.[fn_cdc_get_all_changes_sales_order_line](@P4, @P5, N'all update old') ORDER BY [__$start_lsn]) b1
    UNION ALL
    SELECT b2.[lsn] FROM (SELECT TOP (@P1 + 1) [__$start_lsn] AS [lsn] FROM cdc.[fn_cdc_get_all_changes_sales_line_discount](@P6, @P7, N'all update old') ORDER BY [__$start_lsn]) b2
    UNION ALL
    SELECT b3.[lsn] FROM (SELECT TOP (@P1 + 1) [__$start_lsn] AS [lsn] FROM cdc.[fn_cdc_get_all_changes_sales_order_shipping](@P8, @P9, N'all update old') ORDER BY [__$start_lsn]) b3
) u
ORDER BY u.[lsn];

-- DDL in the batch's window
SELECT ct.capture_instance, h.ddl_lsn, h.ddl_command
FROM cdc.ddl_history h
JOIN cdc.change_tables ct ON ct.object_id = h.object_id
WHERE h.ddl_lsn > @P1 AND h.ddl_lsn <= @P2 AND ct.capture_instance IN (@P3, @P4, @P5, @P6)
ORDER BY h.ddl_lsn, ct.capture_instance;

-- changes of sales.order
SELECT [__$start_lsn], [__$seqval], [__$operation], [order_no], [tenant_id]
FROM cdc.[fn_cdc_get_all_changes_sales_order](@P1, @P2, N'all update old')
ORDER BY [__$start_lsn], [__$seqval], [__$operation];

-- a part of a large transaction, from sales.order
SELECT TOP (@P1) [__$start_lsn], [__$seqval], [__$operation], [order_no], [tenant_id]
FROM cdc.[fn_cdc_get_all_changes_sales_order](@P2, @P2, N'all update old')
WHERE [__$seqval] > @P3
ORDER BY [__$seqval], [__$operation];

-- what a restart finds handed over of a large transaction, from sales.order
SELECT COUNT_BIG(*)
FROM cdc.[fn_cdc_get_all_changes_sales_order](@P1, @P1, N'all update old')
WHERE [__$seqval] <= @P2 AND [__$operation] <> 4;

-- changes of sales.order_line
SELECT [__$start_lsn], [__$seqval], [__$operation], [line_no], [order_no], [tenant_id]
FROM cdc.[fn_cdc_get_all_changes_sales_order_line](@P1, @P2, N'all update old')
ORDER BY [__$start_lsn], [__$seqval], [__$operation];

-- a part of a large transaction, from sales.order_line
SELECT TOP (@P1) [__$start_lsn], [__$seqval], [__$operation], [line_no], [order_no], [tenant_id]
FROM cdc.[fn_cdc_get_all_changes_sales_order_line](@P2, @P2, N'all update old')
WHERE [__$seqval] > @P3
ORDER BY [__$seqval], [__$operation];

-- what a restart finds handed over of a large transaction, from sales.order_line
SELECT COUNT_BIG(*)
FROM cdc.[fn_cdc_get_all_changes_sales_order_line](@P1, @P1, N'all update old')
WHERE [__$seqval] <= @P2 AND [__$operation] <> 4;

-- changes of sales.line_discount
SELECT [__$start_lsn], [__$seqval], [__$operation], [discount_id], [line_no], [order_no], [tenant_id]
FROM cdc.[fn_cdc_get_all_changes_sales_line_discount](@P1, @P2, N'all update old')
ORDER BY [__$start_lsn], [__$seqval], [__$operation];

-- a part of a large transaction, from sales.line_discount
SELECT TOP (@P1) [__$start_lsn], [__$seqval], [__$operation], [discount_id], [line_no], [order_no], [tenant_id]
FROM cdc.[fn_cdc_get_all_changes_sales_line_discount](@P2, @P2, N'all update old')
WHERE [__$seqval] > @P3
ORDER BY [__$seqval], [__$operation];

-- what a restart finds handed over of a large transaction, from sales.line_discount
SELECT COUNT_BIG(*)
FROM cdc.[fn_cdc_get_all_changes_sales_line_discount](@P1, @P1, N'all update old')
WHERE [__$seqval] <= @P2 AND [__$operation] <> 4;

-- changes of sales.order_shipping
SELECT [__$start_lsn], [__$seqval], [__$operation], [order_no], [tenant_id]
FROM cdc.[fn_cdc_get_all_changes_sales_order_shipping](@P1, @P2, N'all update old')
ORDER BY [__$start_lsn], [__$seqval], [__$operation];

-- a part of a large transaction, from sales.order_shipping
SELECT TOP (@P1) [__$start_lsn], [__$seqval], [__$operation], [order_no], [tenant_id]
FROM cdc.[fn_cdc_get_all_changes_sales_order_shipping](@P2, @P2, N'all update old')
WHERE [__$seqval] > @P3
ORDER BY [__$seqval], [__$operation];

-- what a restart finds handed over of a large transaction, from sales.order_shipping
SELECT COUNT_BIG(*)
FROM cdc.[fn_cdc_get_all_changes_sales_order_shipping](@P1, @P1, N'all update old')
WHERE [__$seqval] <= @P2 AND [__$operation] <> 4;

-- root lookup of discounts (sales.line_discount)
IF OBJECT_ID(N'tempdb..#skein_lookup') IS NOT NULL DROP TABLE #skein_lookup;
CREATE TABLE #skein_lookup ([ord] int NOT NULL PRIMARY KEY, [v0] nvarchar(4000) NULL, [v1] nvarchar(4000) NULL, [v2] nvarchar(4000) NULL);
INSERT INTO #skein_lookup ([ord], [v0], [v1], [v2]) VALUES (@P1, @P2, @P3, @P4);
SELECT k.[ord], u1.[tenant_id], u1.[order_no]
FROM #skein_lookup k
JOIN [sales].[order_line] u0 ON u0.[tenant_id] = TRY_CONVERT(uniqueidentifier, k.[v0]) AND u0.[order_no] = TRY_CONVERT(bigint, k.[v1]) AND u0.[line_no] = TRY_CONVERT(smallint, k.[v2])
JOIN [sales].[order] u1 ON u0.[tenant_id] = u1.[tenant_id] AND u0.[order_no] = u1.[order_no]
ORDER BY k.[ord];

-- the batch's root keys
IF OBJECT_ID(N'tempdb..#skein_keys') IS NOT NULL DROP TABLE #skein_keys;
CREATE TABLE #skein_keys ([ord] int NOT NULL PRIMARY KEY, [v0] nvarchar(4000) NULL, [v1] nvarchar(4000) NULL);

-- two root keys into it (666 per statement at most)
INSERT INTO #skein_keys ([ord], [v0], [v1]) VALUES (@P1, @P2, @P3), (@P4, @P5, @P6);

-- hydrate order (sales.order)
SELECT k.[ord], CASE WHEN t0.[tenant_id] IS NULL THEN 0 ELSE 1 END AS [found], t0.[order_no] AS [ref_order_no], t0.[tenant_id] AS [ref_tenant_id], t0.[tenant_id], t0.[order_no], t0.[placed_at], CAST(t0.[total] AS decimal(19,4)) AS [total], t0.[note], t0.[row_version]
FROM #skein_keys k
LEFT JOIN [sales].[order] t0 ON t0.[tenant_id] = TRY_CONVERT(uniqueidentifier, k.[v0]) AND t0.[order_no] = TRY_CONVERT(bigint, k.[v1])
ORDER BY k.[ord];

-- hydrate lines (sales.order_line)
SELECT k.[ord], t1.[tenant_id] AS [link_tenant_id], t1.[order_no] AS [link_order_no], t1.[line_no] AS [ref_line_no], t1.[order_no] AS [ref_order_no], t1.[tenant_id] AS [ref_tenant_id], t1.[tenant_id], t1.[order_no], t1.[line_no], t1.[sku], t1.[qty]
FROM #skein_keys k
JOIN [sales].[order] t0 ON t0.[tenant_id] = TRY_CONVERT(uniqueidentifier, k.[v0]) AND t0.[order_no] = TRY_CONVERT(bigint, k.[v1])
JOIN [sales].[order_line] t1 ON t1.[tenant_id] = t0.[tenant_id] AND t1.[order_no] = t0.[order_no]
ORDER BY k.[ord], t1.[tenant_id], t1.[order_no], t1.[line_no];

-- hydrate discounts (sales.line_discount)
SELECT k.[ord], t2.[tenant_id] AS [link_tenant_id], t2.[order_no] AS [link_order_no], t2.[line_no] AS [link_line_no], t2.[discount_id], t2.[tenant_id], t2.[order_no], t2.[line_no], t2.[percent]
FROM #skein_keys k
JOIN [sales].[order] t0 ON t0.[tenant_id] = TRY_CONVERT(uniqueidentifier, k.[v0]) AND t0.[order_no] = TRY_CONVERT(bigint, k.[v1])
JOIN [sales].[order_line] t1 ON t1.[tenant_id] = t0.[tenant_id] AND t1.[order_no] = t0.[order_no]
JOIN [sales].[line_discount] t2 ON t2.[tenant_id] = t1.[tenant_id] AND t2.[order_no] = t1.[order_no] AND t2.[line_no] = t1.[line_no]
ORDER BY k.[ord], t2.[discount_id];

-- hydrate shipping (sales.order_shipping)
SELECT k.[ord], t1.[tenant_id] AS [link_tenant_id], t1.[order_no] AS [link_order_no], t1.[tenant_id], t1.[order_no], t1.[ship_on], t1.[label]
FROM #skein_keys k
JOIN [sales].[order] t0 ON t0.[tenant_id] = TRY_CONVERT(uniqueidentifier, k.[v0]) AND t0.[order_no] = TRY_CONVERT(bigint, k.[v1])
JOIN [sales].[order_shipping] t1 ON t1.[tenant_id] = t0.[tenant_id] AND t1.[order_no] = t0.[order_no]
ORDER BY k.[ord], t1.[tenant_id], t1.[order_no];

-- explicit: root keys, all, first page
SELECT TOP (@P1) t0.[tenant_id], t0.[order_no]
FROM [sales].[order] AS t0
ORDER BY t0.[tenant_id], t0.[order_no];

-- explicit: root keys, all, after a key
SELECT TOP (@P3) t0.[tenant_id], t0.[order_no]
FROM [sales].[order] AS t0
WHERE t0.[tenant_id] >= TRY_CONVERT(uniqueidentifier, @P1) AND ((t0.[tenant_id] > TRY_CONVERT(uniqueidentifier, @P1)) OR (t0.[tenant_id] = TRY_CONVERT(uniqueidentifier, @P1) AND t0.[order_no] > TRY_CONVERT(bigint, @P2)))
ORDER BY t0.[tenant_id], t0.[order_no];

-- explicit: root keys, --where, after a key
SELECT TOP (@P3) t0.[tenant_id], t0.[order_no]
FROM [sales].[order] AS t0
WHERE (region = N'EU') AND t0.[tenant_id] >= TRY_CONVERT(uniqueidentifier, @P1) AND ((t0.[tenant_id] > TRY_CONVERT(uniqueidentifier, @P1)) OR (t0.[tenant_id] = TRY_CONVERT(uniqueidentifier, @P1) AND t0.[order_no] > TRY_CONVERT(bigint, @P2)))
ORDER BY t0.[tenant_id], t0.[order_no];

