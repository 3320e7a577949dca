-- upper bound of a window
SELECT sys.fn_cdc_get_max_lsn();

-- capture instances of a table
SELECT ct.capture_instance, ct.start_lsn, sys.fn_cdc_map_time_to_lsn(N'largest less than or equal', ct.create_date) AS create_lsn FROM cdc.change_tables ct JOIN sys.tables tb ON tb.object_id = ct.source_object_id JOIN sys.schemas sc ON sc.schema_id = tb.schema_id WHERE sc.name = @P1 AND tb.name = @P2 ORDER BY ct.create_date, ct.capture_instance;

-- catalog of a table
SELECT c.name, TYPE_NAME(c.system_type_id), CASE WHEN TYPE_NAME(c.system_type_id) IN (N'decimal', N'numeric') THEN CONCAT(TYPE_NAME(c.system_type_id), N'(', c.precision, N',', c.scale, N')') WHEN TYPE_NAME(c.system_type_id) IN (N'varchar', N'char', N'varbinary', N'binary') THEN CONCAT(TYPE_NAME(c.system_type_id), N'(', IIF(c.max_length = -1, N'max', CAST(c.max_length AS nvarchar(10))), N')') WHEN TYPE_NAME(c.system_type_id) IN (N'nvarchar', N'nchar') THEN CONCAT(TYPE_NAME(c.system_type_id), N'(', IIF(c.max_length = -1, N'max', CAST(c.max_length / 2 AS nvarchar(10))), N')') WHEN TYPE_NAME(c.system_type_id) IN (N'datetime2', N'time', N'datetimeoffset') THEN CONCAT(TYPE_NAME(c.system_type_id), N'(', c.scale, N')') ELSE TYPE_NAME(c.system_type_id) END, c.is_nullable, ic.key_ordinal FROM sys.tables t JOIN sys.schemas s ON s.schema_id = t.schema_id JOIN sys.columns c ON c.object_id = t.object_id LEFT JOIN sys.indexes i ON i.object_id = t.object_id AND i.is_primary_key = 1 LEFT JOIN sys.index_columns ic ON ic.object_id = t.object_id AND ic.index_id = i.index_id AND ic.column_id = c.column_id WHERE s.name = @P1 AND t.name = @P2 ORDER BY c.column_id;

-- CDC enabled on the database
SELECT CAST(is_cdc_enabled AS int) FROM sys.databases WHERE database_id = DB_ID();

-- columns a capture instance holds
SELECT cc.column_name FROM cdc.captured_columns cc JOIN cdc.change_tables ct ON ct.object_id = cc.object_id WHERE ct.capture_instance = @P1;

-- the capture job
SELECT COUNT(*) FROM msdb.dbo.cdc_jobs WHERE database_id = DB_ID() AND job_type = N'capture';

-- the cleanup job's retention
SELECT CAST(retention AS bigint) FROM msdb.dbo.cdc_jobs WHERE database_id = DB_ID() AND job_type = N'cleanup';

-- how long ago a change committed
SELECT DATEDIFF_BIG(second, m.tran_end_time, GETDATE()) FROM cdc.lsn_time_mapping m WHERE m.start_lsn = @P1;

-- the agent
SELECT status_desc FROM sys.dm_server_services WHERE servicename LIKE N'SQL Server Agent%';

-- capture errors
SELECT TOP (1) error_count, end_time FROM sys.dm_cdc_log_scan_sessions WHERE error_count > 0 ORDER BY end_time DESC;

-- commit times
SELECT m.start_lsn, DATEDIFF_BIG(microsecond, '19700101', CONVERT(datetime2(7), m.tran_end_time AT TIME ZONE @P3 AT TIME ZONE N'UTC')), m.tran_id FROM cdc.lsn_time_mapping m WHERE m.start_lsn >= @P1 AND m.start_lsn <= @P2;

-- commit times, the time zone unknown
SELECT m.start_lsn, DATEDIFF_BIG(microsecond, '19700101', DATEADD(minute, DATEDIFF(minute, SYSDATETIME(), SYSUTCDATETIME()), m.tran_end_time)), m.tran_id FROM cdc.lsn_time_mapping m WHERE m.start_lsn >= @P1 AND m.start_lsn <= @P2;

-- server version and edition
SELECT CAST(SERVERPROPERTY('ProductMajorVersion') AS int), CAST(SERVERPROPERTY('EngineEdition') AS int);

-- the server's time zone
SELECT CURRENT_TIMEZONE_ID();

-- a configured time zone
SELECT COUNT(*) FROM sys.time_zone_info WHERE name = @P1;
