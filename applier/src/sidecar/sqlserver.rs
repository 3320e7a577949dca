//! The sidecar on SQL Server: the same tables as PostgreSQL's
//! ([`skein_sql::sqlserver::sidecar_ddl`]) and the same one-transaction
//! batch commit with fencing, rewind and relay step, in T-SQL. Statement
//! text is in [`skein_sql::sqlserver::sidecar`].
//!
//! The connection runs with `SET XACT_ABORT ON`, so any failed statement
//! dooms the open transaction; every transaction here (commit, rewind, relay
//! step) is a [`Transaction`](skein_sql::sqlserver::Transaction) guard that
//! rolls back when an error drops it, and a dropped connection is rolled
//! back by the server.

use std::collections::HashMap;

use skein_common::config::Secret;
use skein_common::failpoint::failpoint;
use skein_common::sqlvalue::SqlValue;
use skein_sql::sqlserver::sidecar as sc;
use skein_sql::sqlserver::MssqlClient;

use super::{
    parse_numeric, source_position, BatchCommit, ExplicitChunk, ExplicitItem, ExplicitRun,
    ExplicitRunStatus, IdentifierRow, NewRun, OutboxRow, Progress, RelayState, Rewind, Sidecar,
    VersionRow,
};
use crate::decide::Stored;
use crate::error::{Error, Result};
use crate::sink::{Sink, SinkEvent};

/// Most parameters one request carries (SQL Server allows 2,100).
const MAX_PARAMS: usize = 2_000;

/// Most ids one statement lists (numbers in the text, not parameters): a
/// very long `IN` list costs the optimizer more than a second statement.
const MAX_IDS: usize = 1_000;

/// SQL Server sidecar. Owns its connection.
pub struct MssqlSidecar {
    client: MssqlClient,
    schema: String,
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
        })
    }

    /// The schema name.
    pub fn schema(&self) -> &str {
        &self.schema
    }
}

/// The stored progress of a partition.
async fn read_progress(
    c: &mut MssqlClient,
    schema: &str,
    group: &str,
    topic: &str,
    partition: u32,
) -> Result<Option<Progress>> {
    let sql = sc::progress_sql(schema);
    progress_query(c, "reading progress", &sql, group, topic, partition).await
}

/// The one progress row `sql` returns for `@P1` group, `@P2` topic, `@P3`
/// partition (a read, or a claim that bumps the epoch).
async fn progress_query(
    c: &mut MssqlClient,
    what: &str,
    sql: &str,
    group: &str,
    topic: &str,
    partition: u32,
) -> Result<Option<Progress>> {
    let rows = c
        .query(what, sql, &[&group, &topic, &(partition as i32)])
        .await?;
    rows.first().map(|r| progress_row(r)).transpose()
}

/// A progress row: position (text), source_commit, source_seq, epoch.
/// One outbox row as the relay query reads it back (`id`, `entity`,
/// `event`), for the sink.
pub(crate) fn outbox_event(r: &[SqlValue]) -> Result<SinkEvent> {
    match r {
        [SqlValue::Int(id), SqlValue::Text(entity), SqlValue::Text(event), ..] => Ok(SinkEvent {
            outbox_id: *id,
            entity: entity.clone(),
            event: event.clone(),
        }),
        _ => Err(Error::Data(format!(
            "an outbox row read back is not (id bigint, entity text, event text): {}",
            describe(r)
        ))),
    }
}

/// The partition of relayed outbox row `id` (its fourth column).
fn outbox_partition(r: &[SqlValue], id: i64) -> Result<i32> {
    match r.get(3) {
        Some(SqlValue::Int(p)) => {
            i32::try_from(*p).map_err(|_| Error::Data(format!("outbox row {id}: partition {p}")))
        }
        other => Err(Error::Data(format!("outbox row {id}: partition {other:?}"))),
    }
}

/// The types of a row's cells and the outbox id if there is one, never
/// the values (an event is a payload, not for logs).
fn describe(r: &[SqlValue]) -> String {
    let kinds: Vec<String> = r
        .iter()
        .map(|v| {
            match v {
                SqlValue::Int(i) => return format!("int {i}"),
                SqlValue::Null => "null",
                SqlValue::Float(_) => "float",
                SqlValue::Decimal { .. } => "decimal",
                SqlValue::Bit(_) => "bit",
                SqlValue::Text(_) => "text",
                SqlValue::DateTime(_) => "datetime",
                SqlValue::DateTimeOffset(_) => "datetimeoffset",
                SqlValue::Date(_) => "date",
                SqlValue::Time(_) => "time",
                SqlValue::Guid(_) => "uniqueidentifier",
                SqlValue::Binary(_) => "binary",
            }
            .to_string()
        })
        .collect();
    format!("({})", kinds.join(", "))
}

fn progress_row(r: &[SqlValue]) -> Result<Progress> {
    let int = |i: usize| match r.get(i) {
        Some(SqlValue::Int(s)) => Some(*s),
        _ => None,
    };
    Ok(Progress {
        position: parse_numeric(&text(r.first()).unwrap_or_default())?,
        source: source_position(text(r.get(1)), int(2))?,
        epoch: int(3).unwrap_or(0),
        recheck_after: text(r.get(4)),
    })
}

/// Fence, batch row, outbox, versions: the body of the batch transaction
/// on `c` (the caller begins and commits it).
async fn commit_in_tx(c: &mut MssqlClient, schema: &str, b: &BatchCommit) -> Result<i64> {
    let partition = b.partition as i32;
    let position = b.position.to_string();
    let src_commit: Option<String> = b.source.map(|p| p.commit.to_string());
    let src_seq: Option<i64> = b.source.map(|p| i64::try_from(p.seq).unwrap_or(i64::MAX));

    // 1. Fence: move progress only from where this applier started. An
    // explicit batch before the partition's first commit locks the absent
    // row instead (see `lock_absent_progress_sql`): no row, go on.
    let explicit_first = !b.explicit.is_empty() && b.expected.is_none();
    let moved = match b.expected {
        None if explicit_first => {
            let found = c
                .query(
                    "locking the partition's absent progress",
                    &sc::lock_absent_progress_sql(schema),
                    &[&b.group.as_str(), &b.topic.as_str(), &partition],
                )
                .await?;
            u64::from(found.is_empty())
        }
        Some(fence) => {
            let expected = fence.position.to_string();
            c.execute(
                "advancing progress",
                &sc::advance_progress_sql(schema),
                &[
                    &b.group.as_str(),
                    &b.topic.as_str(),
                    &partition,
                    &position.as_str(),
                    &expected.as_str(),
                    &src_commit,
                    &src_seq,
                    &fence.epoch,
                    &b.recheck_after,
                ],
            )
            .await?
        }
        None => {
            // The range lock (UPDLOCK, HOLDLOCK) keeps two first
            // commits from both inserting.
            c.execute(
                "creating progress",
                &sc::first_progress_sql(schema),
                &[
                    &b.group.as_str(),
                    &b.topic.as_str(),
                    &partition,
                    &position.as_str(),
                    &src_commit,
                    &src_seq,
                    &b.recheck_after,
                ],
            )
            .await?
        }
    };
    if moved != 1 {
        let found = read_progress(c, schema, &b.group, &b.topic, b.partition)
            .await?
            .map(|p| p.fence());
        return Err(Error::Fenced {
            partition: b.partition,
            expected: b.expected,
            found,
        });
    }

    // 2. The batch row: its correlation id is in every event of the batch.
    let rows = c
        .query(
            "inserting the batch row",
            &sc::batch_insert_sql(schema),
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

    // 3. Before the partition's outbox ids are drawn: its outbox lock (its
    // ids grow in commit order) and its relay cursor.
    // Every id drawn must pass the highest the partition had.
    let mut floor = 0;
    if !b.outbox.is_empty() {
        let name = format!(
            "{}.{partition}",
            skein_sql::postgres::sidecar::outbox_lock_name(schema)
        );
        let rows = c
            .query(
                "locking the partition's outbox",
                &sc::outbox_lock_sql(schema),
                &[&partition, &name.as_str()],
            )
            .await?;
        for v in rows.first().into_iter().flatten() {
            if let SqlValue::Int(id) = v {
                floor = floor.max(*id);
            }
        }
    }
    // Outbox rows. Identity values follow the ORDER BY of an
    // INSERT … SELECT (not the order of a VALUES list), so ids keep
    // per-aggregate order.
    let per = (MAX_PARAMS - 2) / sc::OUTBOX_PARAMS;
    let mut drawn: Option<i64> = None;
    for (ci, chunk) in b.outbox.chunks(per).enumerate() {
        let first = insert_outbox(c, schema, batch_id, partition, ci * per, chunk).await?;
        drawn = drawn.into_iter().chain(first).min();
    }
    if let Some(drawn) = drawn {
        super::check_outbox_order(b.partition, drawn, floor)?;
    }

    // 4. Versions.
    for chunk in b.versions.chunks(MAX_PARAMS / sc::VERSION_PARAMS) {
        upsert_versions(c, schema, chunk).await?;
    }

    // 5. Explicit keys published by this batch leave the queue.
    if !b.explicit.is_empty() {
        let mut taken = 0;
        for ids in b.explicit.chunks(MAX_IDS) {
            taken += c
                .execute(
                    "taking explicit keys off the queue",
                    &sc::explicit_done_sql(schema, ids),
                    &[],
                )
                .await?;
        }
        if taken != b.explicit.len() as u64 {
            return Err(b.fenced_by_rows());
        }
    }

    failpoint("applier.before_commit");
    Ok(batch_id)
}

async fn insert_outbox(
    c: &mut MssqlClient,
    schema: &str,
    batch_id: i64,
    partition: i32,
    first_ord: usize,
    rows: &[OutboxRow],
) -> Result<Option<i64>> {
    let ords: Vec<i32> = (0..rows.len())
        .map(|i| i32::try_from(first_ord + i).unwrap_or(i32::MAX))
        .collect();
    let mut params: Vec<&dyn tiberius::ToSql> =
        Vec::with_capacity(2 + rows.len() * sc::OUTBOX_PARAMS);
    params.push(&batch_id);
    params.push(&partition);
    for (o, ord) in rows.iter().zip(&ords) {
        params.push(ord);
        params.push(&o.event_id);
        params.push(&o.entity);
        params.push(&o.key);
        params.push(&o.etag);
        params.push(&o.event);
        params.push(&o.commit_time_micros);
    }
    // The ids drawn come back (`OUTPUT`): the smallest is checked.
    let ids = c
        .query(
            "inserting outbox rows",
            &sc::outbox_insert_sql(schema, rows.len()),
            &params,
        )
        .await?;
    Ok(ids
        .iter()
        .filter_map(|r| match r.first() {
            Some(SqlValue::Int(id)) => Some(*id),
            _ => None,
        })
        .min())
}

async fn upsert_versions(c: &mut MssqlClient, schema: &str, rows: &[VersionRow]) -> Result<()> {
    let mut params: Vec<&dyn tiberius::ToSql> = Vec::with_capacity(rows.len() * sc::VERSION_PARAMS);
    for v in rows {
        params.push(&v.entity);
        params.push(&v.key);
        params.push(&v.etag);
        params.push(&v.is_deleted);
    }
    c.execute(
        "upserting versions",
        &sc::versions_merge_sql(schema, rows.len()),
        &params,
    )
    .await?;
    Ok(())
}

impl MssqlSidecar {
    /// The rows `sql(schema, n)` returns for entity `@P1` and `n` keys
    /// from `@P2`, in chunks that fit the parameter limit.
    async fn rows_by_key(
        &mut self,
        what: &str,
        sql: fn(&str, usize) -> String,
        entity: &str,
        keys: &[String],
    ) -> Result<Vec<Vec<SqlValue>>> {
        let mut out = vec![];
        for chunk in keys.chunks(MAX_PARAMS - 1) {
            let mut params: Vec<&dyn tiberius::ToSql> = vec![&entity];
            for k in chunk {
                params.push(k);
            }
            out.extend(
                self.client
                    .query(what, &sql(&self.schema, chunk.len()), &params)
                    .await?,
            );
        }
        Ok(out)
    }
}

impl Sidecar for MssqlSidecar {
    /// Creates or upgrades the schema, serialised by an application lock
    /// (appliers starting together would race on `IF … CREATE TABLE`).
    async fn migrate(&mut self) -> Result<()> {
        // Already at this version: no DDL (see the PostgreSQL sidecar: DDL
        // queued behind an open batch transaction holds up its readers).
        if let Ok(rows) = self
            .client
            .query(
                "reading the sidecar schema version",
                &sc::schema_version_sql(&self.schema),
                &[],
            )
            .await
        {
            let at = match rows.first().and_then(|r| r.first()) {
                Some(SqlValue::Int(v)) => i32::try_from(*v).ok(),
                _ => None,
            };
            if at >= Some(skein_sql::sqlserver::SIDECAR_SCHEMA_VERSION) {
                return super::check_schema_version(at, &self.schema);
            }
        }
        let sql = sc::migrate_sql(&self.schema);
        let r = self.client.batch("creating the sidecar schema", &sql).await;
        if r.is_err() {
            self.client.rollback_quietly().await;
        }
        r?;
        let rows = self
            .client
            .query(
                "reading the sidecar schema version",
                &sc::schema_version_sql(&self.schema),
                &[],
            )
            .await?;
        let found = match rows.first().and_then(|r| r.first()) {
            Some(SqlValue::Int(v)) => i32::try_from(*v).ok(),
            _ => None,
        };
        super::check_schema_version(found, &self.schema)
    }

    async fn progress(
        &mut self,
        group: &str,
        topic: &str,
        partition: u32,
    ) -> Result<Option<Progress>> {
        read_progress(&mut self.client, &self.schema, group, topic, partition).await
    }

    async fn claim(
        &mut self,
        group: &str,
        topic: &str,
        partition: u32,
    ) -> Result<Option<Progress>> {
        let sql = sc::claim_progress_sql(&self.schema);
        let what = "claiming the partition's progress";
        progress_query(&mut self.client, what, &sql, group, topic, partition).await
    }

    async fn progress_all(&mut self, group: &str, topic: &str) -> Result<Vec<(u32, Progress)>> {
        let rows = self
            .client
            .query(
                "reading every partition's progress",
                &sc::progress_all_sql(&self.schema),
                &[&group, &topic],
            )
            .await?;
        rows.iter()
            .map(|r| {
                let p = match r.first() {
                    Some(SqlValue::Int(p)) => (*p).max(0) as u32,
                    other => return Err(Error::Data(format!("progress.partition: {other:?}"))),
                };
                Ok((p, progress_row(&r[1..])?))
            })
            .collect()
    }

    async fn forget_progress(
        &mut self,
        group: &str,
        topic: &str,
        partitions: &[u32],
    ) -> Result<()> {
        let sql = sc::forget_progress_sql(&self.schema);
        let mut tx = self
            .client
            .transaction("beginning to forget partitions' progress")
            .await?;
        for p in partitions {
            tx.execute(
                "forgetting a partition's progress",
                &sql,
                &[&group, &topic, &(*p as i32)],
            )
            .await?;
        }
        tx.commit("committing the forgotten progress").await?;
        Ok(())
    }

    async fn partitions(&mut self, group: &str, topic: &str) -> Result<Option<u32>> {
        let rows = self
            .client
            .query(
                "reading the recorded partition count",
                &sc::partitions_sql(&self.schema),
                &[&group, &topic],
            )
            .await?;
        Ok(rows.first().and_then(|r| match r.first() {
            Some(SqlValue::Int(n)) => Some((*n).max(0) as u32),
            _ => None,
        }))
    }

    async fn record_partitions(&mut self, group: &str, topic: &str, n: u32) -> Result<()> {
        self.client
            .execute(
                "recording the partition count",
                &sc::record_partitions_sql(&self.schema),
                &[&group, &topic, &(n as i32)],
            )
            .await?;
        Ok(())
    }

    async fn purge_outbox(&mut self, older_than_secs: i64, limit: i64) -> Result<u64> {
        Ok(self
            .client
            .execute(
                "deleting relayed outbox rows past their retention",
                &sc::purge_outbox_sql(&self.schema),
                &[&older_than_secs, &limit],
            )
            .await?)
    }

    async fn identifiers(
        &mut self,
        entity: &str,
        keys: &[String],
    ) -> Result<HashMap<String, String>> {
        let rows = self
            .rows_by_key(
                "reading global identifiers",
                sc::identifiers_sql,
                entity,
                keys,
            )
            .await?;
        Ok(rows
            .into_iter()
            .filter_map(|r| Some((text(r.first())?, text(r.get(1))?)))
            .collect())
    }

    async fn insert_identifiers(&mut self, rows: &[IdentifierRow]) -> Result<u64> {
        let mut n = 0;
        for part in rows.chunks(MAX_PARAMS / sc::IDENTIFIER_PARAMS) {
            let mut params: Vec<&dyn tiberius::ToSql> = Vec::with_capacity(part.len() * 3);
            for r in part {
                params.push(&r.entity);
                params.push(&r.key);
                params.push(&r.global_id);
            }
            n += self
                .client
                .execute(
                    "inserting global identifiers",
                    &sc::identifiers_insert_sql(&self.schema, part.len()),
                    &params,
                )
                .await?;
        }
        Ok(n)
    }

    async fn move_identifiers(&mut self, moves: &[(String, String)]) -> Result<u64> {
        let s = self.schema.as_str();
        let mut tx = self
            .client
            .transaction("beginning the identifier carry-over")
            .await?;
        let conflicts = sc::identifier_conflicts_sql(s);
        for (from, other, between) in crate::identifiers::carry_over_checks(moves) {
            let rows = tx
                .query("reading identifiers at odds", &conflicts, &[&from, &other])
                .await?;
            let rows: Vec<_> = rows
                .iter()
                .filter_map(|r| {
                    let t = |i: usize| text(r.get(i));
                    Some((t(0)?, t(1)?, t(2)?, t(3)?))
                })
                .collect();
            crate::identifiers::judge_carry_over(from, other, between, &rows)?;
        }
        let [delete, update] = sc::identifiers_move_sql(s);
        let mut moved = 0;
        for (from, to) in moves {
            tx.execute("replacing carried-over identifiers", &delete, &[from, to])
                .await?;
            moved += tx
                .execute("carrying identifiers over", &update, &[from, to])
                .await?;
        }
        tx.commit("committing the identifier carry-over").await?;
        Ok(moved)
    }

    async fn identifier_holders(
        &mut self,
        entity: &str,
        ids: &[String],
    ) -> Result<HashMap<String, String>> {
        let rows = self
            .rows_by_key(
                "reading the keys of global identifiers",
                sc::identifier_holders_sql,
                entity,
                ids,
            )
            .await?;
        Ok(rows
            .into_iter()
            .filter_map(|r| Some((text(r.first())?, text(r.get(1))?)))
            .collect())
    }

    async fn versions(&mut self, entity: &str, keys: &[String]) -> Result<HashMap<String, Stored>> {
        let rows = self
            .rows_by_key("reading versions", sc::versions_sql, entity, keys)
            .await?;
        Ok(rows
            .into_iter()
            .map(|r| {
                (
                    text(r.first()).unwrap_or_default(),
                    Stored {
                        etag: text(r.get(1)),
                        is_deleted: matches!(r.get(2), Some(SqlValue::Int(1))),
                    },
                )
            })
            .collect())
    }

    async fn published_keys(
        &mut self,
        entity: &str,
        after: Option<&str>,
        limit: i64,
    ) -> Result<Vec<String>> {
        let rows = self
            .client
            .query(
                "reading the published keys to re-check",
                &sc::published_keys_sql(&self.schema),
                &[&entity, &after, &limit],
            )
            .await?;
        Ok(rows.iter().filter_map(|r| text(r.first())).collect())
    }

    /// Read top to bottom: `BEGIN TRAN`, then [`commit_in_tx`] (fence, batch
    /// row, outbox, versions, explicit keys), `COMMIT`; an error drops the
    /// transaction guard, which rolls it back.
    async fn commit(&mut self, b: &BatchCommit) -> Result<i64> {
        let mut tx = self
            .client
            .transaction("beginning the batch transaction")
            .await?;
        let id = commit_in_tx(&mut tx, &self.schema, b).await?;
        // Commit: everything above becomes visible at once, or none of it.
        tx.commit("committing the batch").await?;
        failpoint("applier.after_commit");
        Ok(id)
    }

    async fn pending(&mut self) -> Result<(i64, i64)> {
        let rows = self
            .client
            .query(
                "counting pending outbox rows",
                &sc::pending_sql(&self.schema),
                &[],
            )
            .await?;
        let int = |i: usize| match rows.first().and_then(|r| r.get(i)) {
            Some(SqlValue::Int(v)) => *v,
            _ => 0,
        };
        Ok((int(0), int(1)))
    }

    async fn rewind(&mut self, r: &Rewind) -> Result<()> {
        let by_entity = r.forget_by_entity();
        let schema = self.schema.as_str();
        let mut tx = self
            .client
            .transaction("beginning the replay transaction")
            .await?;
        for (p, cur, to) in &r.partitions {
            let n = tx
                .execute(
                    "rewinding progress",
                    &sc::rewind_sql(schema),
                    &[&r.group.as_str(), &r.topic.as_str(), p, cur, to],
                )
                .await?;
            if n != 1 {
                return Err(Rewind::moved(*p));
            }
        }
        for (entity, keys) in &by_entity {
            for chunk in keys.chunks(1_000) {
                let mut params: Vec<&dyn tiberius::ToSql> = vec![entity];
                for k in chunk {
                    params.push(k);
                }
                tx.execute(
                    "forgetting versions",
                    &sc::forget_versions_sql(schema, chunk.len()),
                    &params,
                )
                .await?;
            }
        }
        Ok(tx.commit("committing the replay").await?)
    }

    /// The cursors of the partitions taken are locked for the round (see
    /// [`sc::relay_select_sql`]); each moves to the last row it sent.
    async fn relay_once(
        &mut self,
        limit: i64,
        partitions: Option<&[i32]>,
        sink: &mut dyn Sink,
    ) -> Result<usize> {
        if partitions.is_some_and(<[i32]>::is_empty) {
            return Ok(0);
        }
        let schema = self.schema.as_str();
        let select = sc::relay_select_sql(schema, partitions);
        let mut tx = self
            .client
            .transaction("beginning the relay transaction")
            .await?;
        let rows = tx.query("reading the outbox", &select, &[&limit]).await?;
        if rows.is_empty() {
            tx.rollback().await;
            return Ok(0);
        }
        let mut cursors: Vec<(i32, i64)> = vec![];
        let events = rows
            .iter()
            .map(|r| {
                let e = outbox_event(r)?;
                super::advance_cursor(&mut cursors, outbox_partition(r, e.outbox_id)?, e.outbox_id);
                Ok(e)
            })
            .collect::<Result<Vec<_>>>()?;
        let ids: Vec<i64> = events.iter().map(|e| e.outbox_id).collect();
        super::send_claimed(sink, &ids, &events)?;
        failpoint("relay.after_send_before_mark");
        tx.execute(
            "moving the relay cursors",
            &sc::relay_mark_sql(schema, &cursors),
            &[],
        )
        .await?;
        tx.commit("committing the relay transaction").await?;
        Ok(ids.len())
    }

    async fn relay_lease(&mut self, exclusive: bool) -> Result<bool> {
        let name = skein_sql::postgres::sidecar::relay_lease_name(&self.schema);
        let rows = self
            .client
            .query(
                "taking the relay lease",
                &sc::relay_lease_sql(exclusive),
                &[&name.as_str()],
            )
            .await?;
        Ok(matches!(rows.first().and_then(|r| r.first()), Some(SqlValue::Int(code)) if *code >= 0))
    }

    /// Not read on SQL Server yet (`sys.dm_tran_locks` would tell).
    async fn relay_lease_holders(&mut self) -> Result<Option<(i64, i64)>> {
        Ok(None)
    }

    async fn relay_report(&mut self, name: &str, state: &str, error: Option<&str>) -> Result<()> {
        self.client
            .execute(
                "reporting the relay's state",
                &sc::relay_report_sql(&self.schema),
                &[&name, &state, &error],
            )
            .await?;
        Ok(())
    }

    async fn relay_states(&mut self) -> Result<Vec<RelayState>> {
        let rows = self
            .client
            .query(
                "reading the relays' states",
                &sc::relay_states_sql(&self.schema),
                &[],
            )
            .await?;
        Ok(rows
            .iter()
            .map(|r| RelayState {
                name: text(r.first()).unwrap_or_default(),
                state: text(r.get(1)).unwrap_or_default(),
                last_error: text(r.get(2)),
                error_at: text(r.get(3)),
                updated_at: text(r.get(4)).unwrap_or_default(),
            })
            .collect())
    }

    async fn explicit_start(&mut self, run: &NewRun) -> Result<ExplicitRun> {
        let s = self.schema.as_str();
        let params: [&dyn tiberius::ToSql; 5] = [
            &run.group,
            &run.entity,
            &run.selection,
            &run.republish,
            &run.initial,
        ];
        let found = self
            .client
            .query(
                "looking for an unfinished explicit run",
                &sc::explicit_find_sql(s),
                &params,
            )
            .await?;
        if let Some(r) = found.first() {
            return Ok(ExplicitRun {
                id: int_at(r, 0, "explicit_run.id")?,
                cursor: text(r.get(1)),
                queued: int_at(r, 2, "explicit_run.queued")?,
                resumed: true,
            });
        }
        let rows = self
            .client
            .query(
                "creating an explicit run",
                &sc::explicit_insert_sql(s),
                &params,
            )
            .await?;
        let id = match rows.first() {
            Some(r) => int_at(r, 0, "explicit_run.id")?,
            None => return Err(Error::Data("a new explicit run returned no id".into())),
        };
        Ok(ExplicitRun::created(id))
    }

    async fn explicit_enqueue(&mut self, c: &ExplicitChunk) -> Result<()> {
        let s = self.schema.as_str();
        let mut tx = self
            .client
            .transaction("beginning an explicit chunk")
            .await?;
        let state = c.state();
        let moved = tx
            .execute(
                "moving the explicit run's cursor",
                &sc::explicit_advance_sql(s),
                &[&c.run, &c.from, &c.to, &(c.keys.len() as i64), &state],
            )
            .await?;
        if moved != 1 {
            // Dropping `tx` rolls back.
            return Err(c.cursor_moved());
        }
        let partitions: Vec<i32> = c.keys.iter().map(|(p, _)| *p as i32).collect();
        let per = (MAX_PARAMS - 5) / sc::EXPLICIT_QUEUE_PARAMS;
        for (ps, keys) in partitions.chunks(per).zip(c.keys.chunks(per)) {
            let mut params: Vec<&dyn tiberius::ToSql> =
                vec![&c.run, &c.group, &c.topic, &c.entity, &c.republish];
            for (p, (_, k)) in ps.iter().zip(keys) {
                params.push(p);
                params.push(k);
            }
            tx.execute(
                "queueing explicit keys",
                &sc::explicit_enqueue_sql(s, keys.len()),
                &params,
            )
            .await?;
        }
        failpoint("explicit.before_chunk_commit");
        Ok(tx.commit("committing an explicit chunk").await?)
    }

    async fn explicit_pending(
        &mut self,
        group: &str,
        topic: &str,
        partition: u32,
        partitions: u32,
        limit: i64,
    ) -> Result<Vec<ExplicitItem>> {
        let rows = self
            .client
            .query(
                "reading queued explicit keys",
                &sc::explicit_pending_sql(&self.schema),
                &[
                    &group,
                    &topic,
                    &(partition as i32),
                    &limit,
                    &(partitions.max(1) as i32),
                ],
            )
            .await?;
        rows.iter()
            .map(|r| {
                Ok(ExplicitItem {
                    id: int_at(r, 0, "explicit_queue.id")?,
                    entity: text(r.get(1)).unwrap_or_default(),
                    key: text(r.get(2)).unwrap_or_default(),
                    republish: bit_at(r, 3),
                })
            })
            .collect()
    }

    async fn explicit_runs(&mut self, group: &str, recent: i64) -> Result<Vec<ExplicitRunStatus>> {
        let rows = self
            .client
            .query(
                "reading explicit runs",
                &sc::explicit_runs_sql(&self.schema),
                &[&group, &recent],
            )
            .await?;
        rows.iter().map(|r| run_status(r)).collect()
    }

    async fn explicit_requeue(&mut self, moves: &[(i64, u32)]) -> Result<()> {
        for chunk in moves.chunks(MAX_IDS) {
            self.client
                .execute(
                    "moving queued explicit keys to their partitions",
                    &sc::explicit_requeue_sql(&self.schema, chunk),
                    &[],
                )
                .await?;
        }
        Ok(())
    }

    async fn explicit_run(&mut self, id: i64) -> Result<Option<ExplicitRunStatus>> {
        let rows = self
            .client
            .query(
                "reading an explicit run",
                &sc::explicit_run_sql(&self.schema),
                &[&id],
            )
            .await?;
        rows.first().map(|r| run_status(r)).transpose()
    }
}

/// Column `i` of a row read back, a `bigint`/`int` the statement guarantees
/// (`what` names it in the error).
fn int_at(r: &[SqlValue], i: usize, what: &str) -> Result<i64> {
    match r.get(i) {
        Some(SqlValue::Int(v)) => Ok(*v),
        other => Err(Error::Data(format!(
            "{what}: expected an integer, read {}",
            describe(other.map(std::slice::from_ref).unwrap_or_default())
        ))),
    }
}

/// Column `i`, a `bit`.
fn bit_at(r: &[SqlValue], i: usize) -> bool {
    matches!(r.get(i), Some(SqlValue::Bit(true)))
}

/// An explicit run as `explicit_run_select` reads it.
fn run_status(r: &[SqlValue]) -> Result<ExplicitRunStatus> {
    Ok(ExplicitRunStatus {
        id: int_at(r, 0, "explicit_run.id")?,
        entity: text(r.get(1)).unwrap_or_default(),
        selection: text(r.get(2)).unwrap_or_default(),
        republish: bit_at(r, 3),
        initial: bit_at(r, 4),
        state: text(r.get(5)).unwrap_or_default(),
        cursor: text(r.get(6)),
        queued: int_at(r, 7, "explicit_run.queued")?,
        pending: int_at(r, 8, "explicit_run pending count")?,
        created_at: text(r.get(9)).unwrap_or_default(),
        updated_at: text(r.get(10)).unwrap_or_default(),
    })
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use skein_common::fuzz::{check, config};

    use super::*;

    fn cell() -> impl Strategy<Value = SqlValue> {
        prop_oneof![
            Just(SqlValue::Null),
            any::<i64>().prop_map(SqlValue::Int),
            any::<String>().prop_map(SqlValue::Text),
            any::<f64>().prop_map(SqlValue::Float),
            prop::collection::vec(any::<u8>(), 0..8).prop_map(SqlValue::Binary),
            any::<bool>().prop_map(SqlValue::Bit),
        ]
    }

    proptest! {
        #![proptest_config(config())]

        /// Fuzz (see [`skein_common::fuzz`]): any row read back is an
        /// event or an error, never a panic.
        #[test]
        fn any_outbox_row_is_an_event_or_an_error(r in prop::collection::vec(cell(), 0..5)) {
            let size = format!("{r:?}").len();
            check("outbox row", size, || drop(outbox_event(&r)));
        }

        #[test]
        fn outbox_rows_read_back_as_written(id in any::<i64>(), entity in ".{0,8}", event in ".{0,32}") {
            let r = [SqlValue::Int(id), SqlValue::Text(entity.clone()), SqlValue::Text(event.clone())];
            prop_assert_eq!(outbox_event(&r).unwrap(), SinkEvent { outbox_id: id, entity, event });
        }
    }

    /// A row of `explicit_run_select` as SQL Server returns it (the bits
    /// as `bit`, the count as `bigint`, the times as text).
    #[test]
    fn an_explicit_run_reads_back_from_its_row() {
        let t = |s: &str| SqlValue::Text(s.into());
        let row = [
            SqlValue::Int(7),
            t("customer"),
            t("\"all\""),
            SqlValue::Bit(false),
            SqlValue::Bit(true),
            t("queued"),
            SqlValue::Null,
            SqlValue::Int(3),
            SqlValue::Int(1),
            t("2026-01-02T03:04:05Z"),
            t("2026-01-02T03:04:06Z"),
        ];
        let st = run_status(&row).unwrap();
        assert_eq!(
            st,
            ExplicitRunStatus {
                id: 7,
                entity: "customer".into(),
                selection: "\"all\"".into(),
                republish: false,
                initial: true,
                state: "queued".into(),
                cursor: None,
                queued: 3,
                pending: 1,
                created_at: "2026-01-02T03:04:05Z".into(),
                updated_at: "2026-01-02T03:04:06Z".into(),
            }
        );
        assert!(!st.finished());
        let e = run_status(&[t("secret")]).unwrap_err().to_string();
        assert!(e.contains("explicit_run.id") && e.contains("(text)"), "{e}");
        assert!(!e.contains("secret"), "{e}");
    }

    #[test]
    fn a_bad_outbox_row_names_its_types_not_its_values() {
        let e = outbox_event(&[
            SqlValue::Int(7),
            SqlValue::Null,
            SqlValue::Text("secret".into()),
        ])
        .unwrap_err()
        .to_string();
        assert!(e.contains("(int 7, null, text)"), "{e}");
        assert!(!e.contains("secret"), "{e}");
    }
}
