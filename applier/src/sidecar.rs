//! The sidecar: batches, versions, progress and the outbox, written in one
//! transaction per batch.

use std::collections::HashMap;

use crate::connect_postgres;
use skein_common::config::Secret;
use skein_common::failpoint::failpoint;
use skein_common::position::ChangePosition;
use skein_sql::postgres::sidecar_ddl;
use skein_sql::quote_ident;

use crate::decide::Stored;
use crate::error::{db, Error, Result};

/// One outbox row to insert.
#[derive(Clone, Debug)]
pub struct OutboxRow {
    /// CloudEvent id (UUID text).
    pub event_id: String,
    /// Entity name.
    pub entity: String,
    /// Canonical root key.
    pub key: String,
    /// Etag, `None` for deletes.
    pub etag: Option<String>,
    /// The CloudEvent JSON exactly as it will be sent.
    pub event: String,
    /// Source commit time (µs since the Unix epoch).
    pub commit_time_micros: i64,
}

/// One version row to upsert.
#[derive(Clone, Debug)]
pub struct VersionRow {
    /// Entity name.
    pub entity: String,
    /// Canonical root key.
    pub key: String,
    /// Etag (`None` when deleted).
    pub etag: Option<String>,
    /// Deleted.
    pub is_deleted: bool,
}

/// Everything one batch commits.
#[derive(Clone, Debug)]
pub struct BatchCommit {
    /// Progress group.
    pub group: String,
    /// Progress topic (`in-process` or the Kafka topic).
    pub topic: String,
    /// Partition.
    pub partition: u32,
    /// The progress this applier started from (`None`: no row yet).
    pub expected: Option<i128>,
    /// The new progress.
    pub position: i128,
    /// The last source change applied in this partition, after this batch.
    pub source: Option<ChangePosition>,
    /// Records sent to the dead-letter topic in this batch.
    pub dead_letters: i32,
    /// Batch bounds (for the batch row).
    pub lower: i128,
    /// Batch bounds (for the batch row).
    pub upper: i128,
    /// Correlation id (UUID text).
    pub correlation_id: String,
    /// Records applied.
    pub record_count: i32,
    /// Aggregates touched.
    pub entity_count: i32,
    /// The source reported lost changes.
    pub has_data_loss: bool,
    /// Events.
    pub outbox: Vec<OutboxRow>,
    /// Versions.
    pub versions: Vec<VersionRow>,
}

/// A partition's committed progress.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Progress {
    /// In-process: the source upper bound ([`SourcePosition::numeric`]);
    /// Kafka: the next offset to consume.
    ///
    /// [`SourcePosition::numeric`]: skein_common::SourcePosition::numeric
    pub position: i128,
    /// The last source change applied (Kafka drops re-sent records by it).
    pub source: Option<ChangePosition>,
}

impl Progress {
    /// The position as a Kafka offset (what it is in the Kafka mode).
    pub fn offset(&self) -> i64 {
        i64::try_from(self.position).unwrap_or(i64::MAX)
    }
}

/// The last source change applied, from `progress.source_commit` (display
/// form) and `progress.source_seq`.
pub fn source_position(commit: Option<String>, seq: Option<i64>) -> Result<Option<ChangePosition>> {
    let Some((c, s)) = commit.zip(seq) else {
        return Ok(None);
    };
    Ok(Some(ChangePosition {
        commit: c
            .parse()
            .map_err(|e| Error::Data(format!("progress.source_commit: {e}")))?,
        seq: u32::try_from(s)
            .map_err(|_| Error::Data(format!("progress.source_seq {s} out of range")))?,
    }))
}

/// A `numeric(25,0)` position read back as text.
pub fn parse_numeric(s: &str) -> Result<i128> {
    s.parse()
        .map_err(|_| Error::Data(format!("sidecar position `{s}` is not an integer")))
}

/// The sidecar store.
///
/// Contract: [`Sidecar::commit`] writes outbox rows, versions, the batch row
/// and the new progress atomically, and only if progress still equals
/// `expected` (fencing); otherwise nothing is written and
/// [`Error::Fenced`] is returned. Committed progress is the exactly-once
/// recovery marker: a record at or before it is never applied again.
pub trait Sidecar {
    /// Creates or upgrades the schema (idempotent).
    fn migrate(&mut self) -> impl std::future::Future<Output = Result<()>> + Send;
    /// The stored progress of a partition.
    fn progress(
        &mut self,
        group: &str,
        topic: &str,
        partition: u32,
    ) -> impl std::future::Future<Output = Result<Option<Progress>>> + Send;
    /// Stored versions of the given keys of an entity.
    fn versions(
        &mut self,
        entity: &str,
        keys: &[String],
    ) -> impl std::future::Future<Output = Result<HashMap<String, Stored>>> + Send;
    /// The one batch transaction.
    fn commit(
        &mut self,
        batch: &BatchCommit,
    ) -> impl std::future::Future<Output = Result<i64>> + Send;
}

/// PostgreSQL sidecar. Owns its connection.
pub struct PgSidecar {
    client: tokio_postgres::Client,
    schema: String,
    q: String,
}

impl PgSidecar {
    /// Connects.
    pub async fn connect(url: &Secret, schema: &str) -> Result<PgSidecar> {
        let client = connect_postgres(url.expose(), "sidecar").await?;
        Ok(PgSidecar {
            client,
            schema: schema.to_string(),
            q: quote_ident(schema),
        })
    }

    /// The connection (relay and status use it).
    pub fn client(&mut self) -> &mut tokio_postgres::Client {
        &mut self.client
    }

    /// The quoted schema.
    pub fn schema_ident(&self) -> &str {
        &self.q
    }

    /// The schema name.
    pub fn schema(&self) -> &str {
        &self.schema
    }
}

impl Sidecar for PgSidecar {
    async fn migrate(&mut self) -> Result<()> {
        // One transaction under an advisory lock: appliers starting together
        // would otherwise race on CREATE SCHEMA IF NOT EXISTS. `IF NOT
        // EXISTS` notices are noise on every start.
        self.client
            .batch_execute(&format!(
                "BEGIN;\nSET LOCAL client_min_messages TO warning;\n\
                 SELECT pg_advisory_xact_lock(hashtext('skein.sidecar.migrate'));\n{}\nCOMMIT;",
                sidecar_ddl(&self.schema)
            ))
            .await
            .map_err(db("creating the sidecar schema"))
    }

    async fn progress(
        &mut self,
        group: &str,
        topic: &str,
        partition: u32,
    ) -> Result<Option<Progress>> {
        let row = self
            .client
            .query_opt(
                &format!(
                    "SELECT position::text, source_commit, source_seq FROM {}.\"progress\" \
                     WHERE group_name = $1 AND topic = $2 AND partition = $3",
                    self.q
                ),
                &[&group, &topic, &(partition as i32)],
            )
            .await
            .map_err(db("reading progress"))?;
        let Some(r) = row else { return Ok(None) };
        Ok(Some(Progress {
            position: parse_numeric(&r.get::<_, String>(0))?,
            source: source_position(r.get(1), r.get(2))?,
        }))
    }

    async fn versions(&mut self, entity: &str, keys: &[String]) -> Result<HashMap<String, Stored>> {
        let rows = self
            .client
            .query(
                &format!(
                    "SELECT key, etag, is_deleted FROM {}.\"version\" WHERE entity = $1 AND key = ANY($2)",
                    self.q
                ),
                &[&entity, &keys],
            )
            .await
            .map_err(db("reading versions"))?;
        Ok(rows
            .into_iter()
            .map(|r| {
                (
                    r.get(0),
                    Stored {
                        etag: r.get(1),
                        is_deleted: r.get(2),
                    },
                )
            })
            .collect())
    }

    /// Read top to bottom: fence, batch row, outbox, versions, commit.
    async fn commit(&mut self, b: &BatchCommit) -> Result<i64> {
        let q = self.q.clone();
        let tx = self
            .client
            .transaction()
            .await
            .map_err(db("beginning the batch transaction"))?;
        let partition = b.partition as i32;

        let src_commit: Option<String> = b.source.map(|p| p.commit.to_string());
        // Positions go over the wire as text: tokio-postgres has no numeric.
        let position = b.position.to_string();
        let expected_text = b.expected.map(|e| e.to_string());
        let (lower, upper) = (b.lower.to_string(), b.upper.to_string());
        let src_seq: Option<i64> = b.source.map(|p| i64::from(p.seq));
        // 1. Fence: move progress only from where this applier started.
        let moved = match &expected_text {
            Some(expected) => tx
                .execute(
                    &format!(
                        "UPDATE {q}.\"progress\" SET position = $4::text::numeric, source_commit = $6, \
                         source_seq = $7, updated_at = now() \
                         WHERE group_name = $1 AND topic = $2 AND partition = $3 \
                         AND position = $5::text::numeric"
                    ),
                    &[&b.group, &b.topic, &partition, &position, &expected, &src_commit, &src_seq],
                )
                .await
                .map_err(db("advancing progress"))?,
            None => tx
                .execute(
                    &format!(
                        "INSERT INTO {q}.\"progress\" (group_name, topic, partition, position, source_commit, source_seq) \
                         VALUES ($1, $2, $3, $4::text::numeric, $5, $6) ON CONFLICT DO NOTHING"
                    ),
                    &[&b.group, &b.topic, &partition, &position, &src_commit, &src_seq],
                )
                .await
                .map_err(db("creating progress"))?,
        };
        if moved != 1 {
            let found = tx
                .query_opt(
                    &format!(
                        "SELECT position::text FROM {q}.\"progress\" WHERE group_name = $1 AND topic = $2 AND partition = $3"
                    ),
                    &[&b.group, &b.topic, &partition],
                )
                .await
                .map_err(db("reading progress after a fence"))?
                .map(|r| parse_numeric(&r.get::<_, String>(0)))
                .transpose()?;
            // Dropping `tx` rolls back.
            return Err(Error::Fenced {
                partition: b.partition,
                expected: b.expected,
                found,
            });
        }

        // 2. The batch row: its correlation id is in every event of the batch.
        let batch_id: i64 = tx
            .query_one(
                &format!(
                    "INSERT INTO {q}.\"batch\" (correlation_id, group_name, topic, partition, lower_position, \
                     upper_position, record_count, entity_count, event_count, has_data_loss, dead_letters) \
                     VALUES ($1::text::uuid, $2, $3, $4, $5::text::numeric, $6::text::numeric, $7, $8, $9, $10, $11) \
                     RETURNING id"
                ),
                &[
                    &b.correlation_id,
                    &b.group,
                    &b.topic,
                    &partition,
                    &lower,
                    &upper,
                    &b.record_count,
                    &b.entity_count,
                    &(b.outbox.len() as i32),
                    &b.has_data_loss,
                    &b.dead_letters,
                ],
            )
            .await
            .map_err(db("inserting the batch row"))?
            .get(0);

        // 3. Outbox rows, in decision order (ids keep per-aggregate order).
        if !b.outbox.is_empty() {
            let ids: Vec<&str> = b.outbox.iter().map(|o| o.event_id.as_str()).collect();
            let entities: Vec<&str> = b.outbox.iter().map(|o| o.entity.as_str()).collect();
            let keys: Vec<&str> = b.outbox.iter().map(|o| o.key.as_str()).collect();
            let etags: Vec<Option<&str>> = b.outbox.iter().map(|o| o.etag.as_deref()).collect();
            let events: Vec<&str> = b.outbox.iter().map(|o| o.event.as_str()).collect();
            let times: Vec<i64> = b.outbox.iter().map(|o| o.commit_time_micros).collect();
            tx.execute(
                &format!(
                    "INSERT INTO {q}.\"outbox\" (event_id, batch_id, entity, key, partition, etag, event, commit_time) \
                     SELECT u.id::uuid, $1, u.entity, u.key, $2, u.etag, u.event, \
                            'epoch'::timestamptz + u.t * interval '1 microsecond' \
                     FROM unnest($3::text[], $4::text[], $5::text[], $6::text[], $7::text[], $8::int8[]) \
                          WITH ORDINALITY AS u(id, entity, key, etag, event, t, ord) \
                     ORDER BY u.ord"
                ),
                &[&batch_id, &partition, &ids, &entities, &keys, &etags, &events, &times],
            )
            .await
            .map_err(db("inserting outbox rows"))?;
        }

        // 4. Versions.
        if !b.versions.is_empty() {
            let entities: Vec<&str> = b.versions.iter().map(|v| v.entity.as_str()).collect();
            let keys: Vec<&str> = b.versions.iter().map(|v| v.key.as_str()).collect();
            let etags: Vec<Option<&str>> = b.versions.iter().map(|v| v.etag.as_deref()).collect();
            let deleted: Vec<bool> = b.versions.iter().map(|v| v.is_deleted).collect();
            tx.execute(
                &format!(
                    "INSERT INTO {q}.\"version\" (entity, key, etag, is_deleted) \
                     SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::bool[]) \
                     ON CONFLICT (entity, key) DO UPDATE SET etag = EXCLUDED.etag, \
                       is_deleted = EXCLUDED.is_deleted, updated_at = now()"
                ),
                &[&entities, &keys, &etags, &deleted],
            )
            .await
            .map_err(db("upserting versions"))?;
        }

        failpoint("applier.before_commit");
        // 5. Commit: everything above becomes visible at once, or none of it.
        tx.commit().await.map_err(db("committing the batch"))?;
        failpoint("applier.after_commit");
        Ok(batch_id)
    }
}

/// Whether a sidecar URL points at PostgreSQL (`postgres://`,
/// `postgresql://`); anything else is SQL Server (an ADO.NET string,
/// `sqlserver://…` or `jdbc:sqlserver://…`).
pub fn is_postgres_url(url: &str) -> bool {
    let u = url.trim_start().to_ascii_lowercase();
    u.starts_with("postgres://") || u.starts_with("postgresql://")
}

/// What `skein replay` changes, in one transaction.
#[derive(Clone, Debug, Default)]
pub struct Rewind {
    /// Progress group.
    pub group: String,
    /// The Kafka topic.
    pub topic: String,
    /// Per partition: its current offset and the offset to go back to.
    pub partitions: Vec<(i32, i64, i64)>,
    /// `(entity, canonical key)`s whose stored versions are forgotten
    /// (`--republish`), so each publishes once more.
    pub forget: Vec<(String, String)>,
}

/// The configured sidecar, whichever database it runs on.
pub enum AnySidecar {
    /// PostgreSQL.
    Postgres(PgSidecar),
    /// SQL Server (boxed: the TDS client carries its buffers).
    SqlServer(Box<crate::mssql_sidecar::MssqlSidecar>),
}

impl AnySidecar {
    /// Connects to `url` (see [`is_postgres_url`]).
    pub async fn connect(url: &Secret, schema: &str) -> Result<AnySidecar> {
        Ok(if is_postgres_url(url.expose()) {
            AnySidecar::Postgres(PgSidecar::connect(url, schema).await?)
        } else {
            AnySidecar::SqlServer(Box::new(
                crate::mssql_sidecar::MssqlSidecar::connect(url, schema).await?,
            ))
        })
    }

    /// Pending outbox rows and the age of the oldest, in milliseconds.
    pub async fn pending(&mut self) -> Result<(i64, i64)> {
        match self {
            AnySidecar::Postgres(s) => {
                let q = s.schema_ident().to_string();
                let row = s
                    .client()
                    .query_one(
                        &format!(
                            "SELECT count(*), coalesce(extract(epoch FROM now() - min(enqueued_at)) * 1000, 0)::int8 \
                             FROM {q}.\"outbox\" WHERE dequeued_at IS NULL"
                        ),
                        &[],
                    )
                    .await
                    .map_err(db("counting pending outbox rows"))?;
                Ok((row.get(0), row.get(1)))
            }
            AnySidecar::SqlServer(s) => s.pending().await,
        }
    }
}

impl AnySidecar {
    /// Applies a [`Rewind`] atomically. A partition whose progress is no
    /// longer its current offset (an applier committed meanwhile) aborts it
    /// all with an error: nothing is changed.
    pub async fn rewind(&mut self, r: &Rewind) -> Result<()> {
        let moved = |p: i32| {
            Error::Data(format!(
                "partition {p}: progress moved while replaying (an applier committed); run again"
            ))
        };
        let mut by_entity: std::collections::BTreeMap<&str, Vec<&str>> = Default::default();
        for (e, k) in &r.forget {
            by_entity.entry(e).or_default().push(k);
        }
        match self {
            AnySidecar::Postgres(s) => {
                let q = s.schema_ident().to_string();
                let tx = s
                    .client()
                    .transaction()
                    .await
                    .map_err(db("beginning the replay transaction"))?;
                for (p, cur, to) in &r.partitions {
                    let n = tx
                        .execute(
                            &format!(
                                "UPDATE {q}.\"progress\" SET position = $5::int8, source_commit = NULL, \
                                 source_seq = NULL, updated_at = now() \
                                 WHERE group_name = $1 AND topic = $2 AND partition = $3 AND position = $4::int8"
                            ),
                            &[&r.group, &r.topic, p, cur, to],
                        )
                        .await
                        .map_err(db("rewinding progress"))?;
                    if n != 1 {
                        return Err(moved(*p));
                    }
                }
                for (entity, keys) in &by_entity {
                    tx.execute(
                        &format!("DELETE FROM {q}.\"version\" WHERE entity = $1 AND key = ANY($2)"),
                        &[entity, keys],
                    )
                    .await
                    .map_err(db("forgetting versions"))?;
                }
                tx.commit().await.map_err(db("committing the replay"))
            }
            AnySidecar::SqlServer(s) => {
                use skein_sql::sqlserver::sidecar as sc;
                let schema = s.schema().to_string();
                let client = s.client();
                client.begin("beginning the replay transaction").await?;
                let result: Result<()> = async {
                    for (p, cur, to) in &r.partitions {
                        let n = client
                            .execute(
                                "rewinding progress",
                                &sc::rewind_sql(&schema),
                                &[&r.group.as_str(), &r.topic.as_str(), p, cur, to],
                            )
                            .await?;
                        if n != 1 {
                            return Err(moved(*p));
                        }
                    }
                    for (entity, keys) in &by_entity {
                        for chunk in keys.chunks(1_000) {
                            let mut params: Vec<&dyn tiberius::ToSql> = vec![entity];
                            for k in chunk {
                                params.push(k);
                            }
                            client
                                .execute(
                                    "forgetting versions",
                                    &sc::forget_versions_sql(&schema, chunk.len()),
                                    &params,
                                )
                                .await?;
                        }
                    }
                    Ok(())
                }
                .await;
                match result {
                    Ok(()) => Ok(client.commit("committing the replay").await?),
                    Err(e) => {
                        client.rollback_quietly().await;
                        Err(e)
                    }
                }
            }
        }
    }
}

impl Sidecar for AnySidecar {
    async fn migrate(&mut self) -> Result<()> {
        match self {
            AnySidecar::Postgres(s) => s.migrate().await,
            AnySidecar::SqlServer(s) => s.migrate().await,
        }
    }

    async fn progress(
        &mut self,
        group: &str,
        topic: &str,
        partition: u32,
    ) -> Result<Option<Progress>> {
        match self {
            AnySidecar::Postgres(s) => s.progress(group, topic, partition).await,
            AnySidecar::SqlServer(s) => s.progress(group, topic, partition).await,
        }
    }

    async fn versions(&mut self, entity: &str, keys: &[String]) -> Result<HashMap<String, Stored>> {
        match self {
            AnySidecar::Postgres(s) => s.versions(entity, keys).await,
            AnySidecar::SqlServer(s) => s.versions(entity, keys).await,
        }
    }

    async fn commit(&mut self, batch: &BatchCommit) -> Result<i64> {
        match self {
            AnySidecar::Postgres(s) => s.commit(batch).await,
            AnySidecar::SqlServer(s) => s.commit(batch).await,
        }
    }
}
