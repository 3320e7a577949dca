//! The sidecar on SQL Server: the same tables as PostgreSQL's
//! ([`skein_sql::sqlserver::sidecar_ddl`]) and the same one-transaction
//! batch commit with fencing, in T-SQL.
//!
//! The connection runs with `SET XACT_ABORT ON`, so any failed statement
//! dooms the open transaction; [`MssqlSidecar::commit`] rolls back
//! explicitly on every error path, and a dropped connection is rolled back
//! by the server.

use std::collections::HashMap;

use skein_common::config::Secret;
use skein_common::failpoint::failpoint;
use skein_common::mssql::MssqlClient;
use skein_common::sqlvalue::SqlValue;
use skein_sql::sqlserver::{qi, sidecar_ddl};

use crate::decide::Stored;
use crate::error::{Error, Result};
use crate::sidecar::{
    parse_numeric, source_position, BatchCommit, OutboxRow, Progress, Sidecar, VersionRow,
};

/// Most parameters one request carries (SQL Server allows 2,100).
const MAX_PARAMS: usize = 2_000;

/// SQL Server sidecar. Owns its connection.
pub struct MssqlSidecar {
    client: MssqlClient,
    schema: String,
    q: String,
}

fn text(v: Option<&SqlValue>) -> Option<String> {
    v.and_then(SqlValue::to_text)
}

impl MssqlSidecar {
    /// Connects (`url`: an ADO.NET string or `jdbc:sqlserver://…`).
    pub async fn connect(url: &Secret, schema: &str) -> Result<MssqlSidecar> {
        let mut client = MssqlClient::connect(url.expose()).await?;
        client
            .batch("configuring the sidecar session", "SET XACT_ABORT ON;")
            .await?;
        Ok(MssqlSidecar {
            client,
            schema: schema.to_string(),
            q: qi(schema),
        })
    }

    /// The connection (relay and status use it).
    pub fn client(&mut self) -> &mut MssqlClient {
        &mut self.client
    }

    /// The quoted schema.
    pub fn schema_ident(&self) -> &str {
        &self.q
    }

    async fn rollback(&mut self) {
        // Best effort: with XACT_ABORT the server may have rolled back already.
        let _ = self
            .client
            .batch("rolling back", "IF @@TRANCOUNT > 0 ROLLBACK TRAN;")
            .await;
    }

    async fn commit_in_tx(&mut self, b: &BatchCommit) -> Result<i64> {
        let q = self.q.clone();
        let partition = b.partition as i32;
        let position = b.position.to_string();
        let src_commit: Option<String> = b.source.map(|p| p.commit.to_string());
        let src_seq: Option<i64> = b.source.map(|p| i64::from(p.seq));

        // 1. Fence: move progress only from where this applier started.
        let moved = match b.expected {
            Some(expected) => {
                let expected = expected.to_string();
                self.client
                    .execute(
                        "advancing progress",
                        &format!(
                            "UPDATE {q}.[progress] SET [position] = CAST(@P4 AS decimal(25,0)), \
                             [source_commit] = @P6, [source_seq] = @P7, [updated_at] = SYSUTCDATETIME() \
                             WHERE [group_name] = @P1 AND [topic] = @P2 AND [partition] = @P3 \
                             AND [position] = CAST(@P5 AS decimal(25,0))"
                        ),
                        &[
                            &b.group.as_str(),
                            &b.topic.as_str(),
                            &partition,
                            &position.as_str(),
                            &expected.as_str(),
                            &src_commit,
                            &src_seq,
                        ],
                    )
                    .await?
            }
            None => {
                // The range lock (UPDLOCK, HOLDLOCK) keeps two first
                // commits from both inserting.
                self.client
                    .execute(
                        "creating progress",
                        &format!(
                            "INSERT INTO {q}.[progress] ([group_name], [topic], [partition], [position], \
                             [source_commit], [source_seq]) \
                             SELECT @P1, @P2, @P3, CAST(@P4 AS decimal(25,0)), @P5, @P6 \
                             WHERE NOT EXISTS (SELECT 1 FROM {q}.[progress] WITH (UPDLOCK, HOLDLOCK) \
                             WHERE [group_name] = @P1 AND [topic] = @P2 AND [partition] = @P3)"
                        ),
                        &[
                            &b.group.as_str(),
                            &b.topic.as_str(),
                            &partition,
                            &position.as_str(),
                            &src_commit,
                            &src_seq,
                        ],
                    )
                    .await?
            }
        };
        if moved != 1 {
            let found = self.read_position(&b.group, &b.topic, partition).await?;
            return Err(Error::Fenced {
                partition: b.partition,
                expected: b.expected,
                found,
            });
        }

        // 2. The batch row: its correlation id is in every event of the batch.
        let rows = self
            .client
            .query(
                "inserting the batch row",
                &format!(
                    "INSERT INTO {q}.[batch] ([correlation_id], [group_name], [topic], [partition], \
                     [lower_position], [upper_position], [record_count], [entity_count], [event_count], \
                     [has_data_loss], [dead_letters]) OUTPUT INSERTED.[id] \
                     VALUES (CAST(@P1 AS uniqueidentifier), @P2, @P3, @P4, CAST(@P5 AS decimal(25,0)), \
                     CAST(@P6 AS decimal(25,0)), @P7, @P8, @P9, @P10, @P11)"
                ),
                &[
                    &b.correlation_id.as_str(),
                    &b.group.as_str(),
                    &b.topic.as_str(),
                    &partition,
                    &b.lower.to_string().as_str(),
                    &b.upper.to_string().as_str(),
                    &b.record_count,
                    &b.entity_count,
                    &(b.outbox.len() as i32),
                    &b.has_data_loss,
                    &b.dead_letters,
                ],
            )
            .await?;
        let batch_id = match rows.first().and_then(|r| r.first()) {
            Some(SqlValue::Int(id)) => *id,
            other => return Err(Error::Data(format!("batch id: {other:?}"))),
        };

        // 3. Outbox rows. Identity values follow the ORDER BY of an
        // INSERT … SELECT (not the order of a VALUES list), so ids keep
        // per-aggregate order.
        for (ci, chunk) in b.outbox.chunks(MAX_PARAMS / 7).enumerate() {
            self.insert_outbox(batch_id, partition, ci * (MAX_PARAMS / 7), chunk)
                .await?;
        }

        // 4. Versions.
        for chunk in b.versions.chunks(MAX_PARAMS / 4) {
            self.upsert_versions(chunk).await?;
        }

        failpoint("applier.before_commit");
        // 5. Commit: everything above becomes visible at once, or none of it.
        self.client
            .batch("committing the batch", "COMMIT TRAN;")
            .await?;
        Ok(batch_id)
    }

    async fn insert_outbox(
        &mut self,
        batch_id: i64,
        partition: i32,
        first_ord: usize,
        rows: &[OutboxRow],
    ) -> Result<()> {
        let q = &self.q;
        let ords: Vec<i32> = (0..rows.len())
            .map(|i| i32::try_from(first_ord + i).unwrap_or(i32::MAX))
            .collect();
        let mut values = Vec::with_capacity(rows.len());
        let mut params: Vec<&dyn tiberius::ToSql> = Vec::with_capacity(rows.len() * 7);
        for (i, (o, ord)) in rows.iter().zip(&ords).enumerate() {
            let p = i * 7;
            values.push(format!(
                "(@P{}, @P{}, @P{}, @P{}, @P{}, @P{}, @P{})",
                p + 1,
                p + 2,
                p + 3,
                p + 4,
                p + 5,
                p + 6,
                p + 7
            ));
            params.push(ord);
            params.push(&o.event_id);
            params.push(&o.entity);
            params.push(&o.key);
            params.push(&o.etag);
            params.push(&o.event);
            params.push(&o.commit_time_micros);
        }
        let sql = format!(
            "INSERT INTO {q}.[outbox] ([event_id], [batch_id], [entity], [key], [partition], [etag], \
             [event], [commit_time]) \
             SELECT CAST(v.id AS uniqueidentifier), {batch_id}, v.entity, v.[key], {partition}, v.etag, \
             v.event, DATEADD(microsecond, CAST(v.t % 1000000 AS int), \
             DATEADD(second, CAST((v.t / 1000000) % 86400 AS int), \
             DATEADD(day, CAST(v.t / 86400000000 AS int), CAST('1970-01-01' AS datetime2(6))))) \
             FROM (VALUES {}) AS v(ord, id, entity, [key], etag, event, t) ORDER BY v.ord",
            values.join(", ")
        );
        self.client
            .execute("inserting outbox rows", &sql, &params)
            .await?;
        Ok(())
    }

    async fn upsert_versions(&mut self, rows: &[VersionRow]) -> Result<()> {
        let q = &self.q;
        let mut values = Vec::with_capacity(rows.len());
        let mut params: Vec<&dyn tiberius::ToSql> = Vec::with_capacity(rows.len() * 4);
        for (i, v) in rows.iter().enumerate() {
            let p = i * 4;
            values.push(format!(
                "(@P{}, @P{}, @P{}, @P{})",
                p + 1,
                p + 2,
                p + 3,
                p + 4
            ));
            params.push(&v.entity);
            params.push(&v.key);
            params.push(&v.etag);
            params.push(&v.is_deleted);
        }
        let sql = format!(
            "MERGE {q}.[version] WITH (HOLDLOCK) AS t \
             USING (VALUES {}) AS s(entity, [key], etag, is_deleted) \
             ON t.[entity] = s.entity AND t.[key] = s.[key] \
             WHEN MATCHED THEN UPDATE SET [etag] = s.etag, [is_deleted] = s.is_deleted, \
               [updated_at] = SYSUTCDATETIME() \
             WHEN NOT MATCHED THEN INSERT ([entity], [key], [etag], [is_deleted]) \
               VALUES (s.entity, s.[key], s.etag, s.is_deleted);",
            values.join(", ")
        );
        self.client
            .execute("upserting versions", &sql, &params)
            .await?;
        Ok(())
    }

    async fn read_position(
        &mut self,
        group: &str,
        topic: &str,
        partition: i32,
    ) -> Result<Option<i128>> {
        let rows = self
            .client
            .query(
                "reading progress",
                &format!(
                    "SELECT CAST([position] AS nvarchar(40)) FROM {}.[progress] \
                     WHERE [group_name] = @P1 AND [topic] = @P2 AND [partition] = @P3",
                    self.q
                ),
                &[&group, &topic, &partition],
            )
            .await?;
        rows.first()
            .and_then(|r| text(r.first()))
            .map(|s| parse_numeric(&s))
            .transpose()
    }

    /// Pending outbox rows and the age of the oldest, in milliseconds.
    pub async fn pending(&mut self) -> Result<(i64, i64)> {
        let rows = self
            .client
            .query(
                "counting pending outbox rows",
                &format!(
                    "SELECT CAST(COUNT(*) AS bigint), \
                     COALESCE(DATEDIFF_BIG(millisecond, MIN([enqueued_at]), SYSUTCDATETIME()), 0) \
                     FROM {}.[outbox] WHERE [dequeued_at] IS NULL",
                    self.q
                ),
                &[],
            )
            .await?;
        let int = |i: usize| match rows.first().and_then(|r| r.get(i)) {
            Some(SqlValue::Int(v)) => *v,
            _ => 0,
        };
        Ok((int(0), int(1)))
    }
}

impl Sidecar for MssqlSidecar {
    /// Creates or upgrades the schema, serialised by an application lock
    /// (appliers starting together would race on `IF … CREATE TABLE`).
    async fn migrate(&mut self) -> Result<()> {
        let sql = format!(
            "BEGIN TRAN;\nEXEC sp_getapplock @Resource = N'skein.sidecar.migrate', \
             @LockMode = 'Exclusive', @LockOwner = 'Transaction', @LockTimeout = 60000;\n{}\nCOMMIT TRAN;",
            sidecar_ddl(&self.schema)
        );
        let r = self.client.batch("creating the sidecar schema", &sql).await;
        if r.is_err() {
            self.rollback().await;
        }
        Ok(r?)
    }

    async fn progress(
        &mut self,
        group: &str,
        topic: &str,
        partition: u32,
    ) -> Result<Option<Progress>> {
        let rows = self
            .client
            .query(
                "reading progress",
                &format!(
                    "SELECT CAST([position] AS nvarchar(40)), [source_commit], [source_seq] \
                     FROM {}.[progress] WHERE [group_name] = @P1 AND [topic] = @P2 AND [partition] = @P3",
                    self.q
                ),
                &[&group, &topic, &(partition as i32)],
            )
            .await?;
        let Some(r) = rows.first() else {
            return Ok(None);
        };
        let position = parse_numeric(&text(r.first()).unwrap_or_default())?;
        let seq = match r.get(2) {
            Some(SqlValue::Int(s)) => Some(*s),
            _ => None,
        };
        Ok(Some(Progress {
            position,
            source: source_position(text(r.get(1)), seq)?,
        }))
    }

    async fn versions(&mut self, entity: &str, keys: &[String]) -> Result<HashMap<String, Stored>> {
        let mut out = HashMap::new();
        for chunk in keys.chunks(MAX_PARAMS - 1) {
            let list: Vec<String> = (0..chunk.len()).map(|i| format!("@P{}", i + 2)).collect();
            let mut params: Vec<&dyn tiberius::ToSql> = vec![&entity];
            for k in chunk {
                params.push(k);
            }
            let rows = self
                .client
                .query(
                    "reading versions",
                    &format!(
                        "SELECT [key], [etag], CAST([is_deleted] AS int) FROM {}.[version] \
                         WHERE [entity] = @P1 AND [key] IN ({})",
                        self.q,
                        list.join(", ")
                    ),
                    &params,
                )
                .await?;
            for r in rows {
                out.insert(
                    text(r.first()).unwrap_or_default(),
                    Stored {
                        etag: text(r.get(1)),
                        is_deleted: matches!(r.get(2), Some(SqlValue::Int(1))),
                    },
                );
            }
        }
        Ok(out)
    }

    /// Read top to bottom: `BEGIN TRAN`, then [`MssqlSidecar::commit_in_tx`]
    /// (fence, batch row, outbox, versions, `COMMIT`), rolled back on any error.
    async fn commit(&mut self, b: &BatchCommit) -> Result<i64> {
        self.client
            .batch("beginning the batch transaction", "BEGIN TRAN;")
            .await?;
        match self.commit_in_tx(b).await {
            Ok(id) => {
                failpoint("applier.after_commit");
                Ok(id)
            }
            Err(e) => {
                self.rollback().await;
                Err(e)
            }
        }
    }
}
