//! The sidecar on PostgreSQL ([`skein_sql::postgres::sidecar_ddl`]): the
//! one-transaction batch commit with fencing, replay's rewind and the
//! relay's claim-send-mark, each in a `tokio_postgres` transaction that rolls
//! back when dropped on an error path. Statement text is in
//! [`skein_sql::postgres::sidecar`].

use std::collections::HashMap;

use skein_common::config::Secret;
use skein_common::failpoint::failpoint;
use skein_sql::postgres::sidecar as sc;

use super::{
    parse_numeric, source_position, BatchCommit, ExplicitChunk, ExplicitItem, ExplicitRun,
    ExplicitRunStatus, Fence, IdentifierRow, NewRun, Progress, RelayState, Rewind, Sidecar,
};
use crate::connect_postgres;
use crate::decide::Stored;
use crate::error::{db, Error, Result};
use crate::sink::{Sink, SinkEvent};

/// PostgreSQL sidecar. Owns its connection.
pub struct PgSidecar {
    client: tokio_postgres::Client,
    schema: String,
    /// The statements of every batch (versions, the commit's) and of the
    /// relay's rounds, prepared once.
    statements: Box<crate::Statements>,
}

impl PgSidecar {
    /// Connects.
    pub async fn connect(url: &Secret, schema: &str) -> Result<PgSidecar> {
        let client = connect_postgres(url.expose(), "sidecar").await?;
        Ok(PgSidecar {
            client,
            schema: schema.to_string(),
            statements: Box::default(),
        })
    }

    /// The schema name.
    pub fn schema(&self) -> &str {
        &self.schema
    }
}

impl PgSidecar {
    /// Begins a transaction, handed out with the schema's name and the
    /// prepared statements (the sidecar's other parts, borrowed beside it).
    async fn begin(
        &mut self,
        what: &'static str,
    ) -> Result<(
        tokio_postgres::Transaction<'_>,
        &str,
        &mut crate::Statements,
    )> {
        let PgSidecar {
            client,
            schema,
            statements,
        } = self;
        // READ COMMITTED whatever the role's or database's default: the
        // relay and the batch read the cursors and the outbox's floor after
        // taking their locks, each statement seeing what the previous
        // holder committed; a transaction-wide snapshot would predate it.
        let tx = client
            .build_transaction()
            .isolation_level(tokio_postgres::IsolationLevel::ReadCommitted)
            .start()
            .await
            .map_err(db(what))?;
        Ok((tx, schema.as_str(), statements))
    }

    /// One relay round, one transaction: the cursors of the partitions it
    /// takes are locked (at most [`sc::RELAY_PARTITIONS_PER_ROUND`], see
    /// [`Sidecar::relay_once`]); the rows above them are read, sent, and
    /// each partition's cursor moved to the last one it sent. Returns how
    /// many were sent and whether it took as many partitions as a round may.
    async fn relay_round(
        &mut self,
        limit: i64,
        partitions: Option<&[i32]>,
        sink: &mut dyn Sink,
    ) -> Result<(usize, bool)> {
        let (tx, s, statements) = self.begin("beginning the relay transaction").await?;
        // Prepared once per connection, like the batch's statements: a relay
        // woken by every batch commit runs many small rounds. Both
        // statements go out in one round trip, the lock first. The
        // session runs the select once the locks are granted (a session's
        // statements run in turn) and, READ COMMITTED, it sees the cursors
        // as a previous owner's round left them; its rows of a partition
        // the lock statement did not take (written or relayed in between)
        // wait for the next round.
        let (lock_what, what) = ("locking the relay cursors", "reading the outbox");
        let lock = statements
            .prepared(&tx, &sc::relay_lock_sql(s), lock_what)
            .await?;
        let select = statements
            .prepared(&tx, &sc::relay_select_sql(s), what)
            .await?;
        let lock_name = sc::outbox_lock_name(s);
        let lock_params: [&(dyn tokio_postgres::types::ToSql + Sync); 2] =
            [&partitions, &lock_name];
        let select_params: [&(dyn tokio_postgres::types::ToSql + Sync); 2] = [&partitions, &limit];
        // `biased`: polled in this order, so the lock is sent first.
        let (locked, rows) = tokio::join!(
            biased;
            tx.query(&lock, &lock_params),
            tx.query(&select, &select_params),
        );
        let locked: Vec<i32> = locked
            .map_err(db(lock_what))?
            .iter()
            .map(|r| r.try_get(0))
            .collect::<std::result::Result<_, _>>()
            .map_err(db(lock_what))?;
        let rows = rows.map_err(db(what))?;
        let capped = locked.len() >= sc::RELAY_PARTITIONS_PER_ROUND as usize;
        if locked.is_empty() || rows.is_empty() {
            return Ok((0, capped));
        }
        // `try_get`: a column of another type (a hand-altered outbox) is an
        // error naming the row, not a panic in the relay.
        let mut cursors: Vec<(i32, i64)> = vec![];
        let mut events = Vec::with_capacity(rows.len());
        for r in &rows {
            let partition: i32 = r
                .try_get(0)
                .map_err(db("reading an outbox row's partition"))?;
            if !locked.contains(&partition) {
                continue;
            }
            let e = SinkEvent {
                outbox_id: r.try_get(1).map_err(db("reading an outbox row's id"))?,
                entity: r.try_get(2).map_err(db("reading an outbox row's entity"))?,
                event: r.try_get(3).map_err(db("reading an outbox row's event"))?,
            };
            super::advance_cursor(&mut cursors, partition, e.outbox_id);
            events.push(e);
        }
        if events.is_empty() {
            return Ok((0, capped));
        }
        let ids: Vec<i64> = events.iter().map(|e| e.outbox_id).collect();
        super::send_claimed(sink, &ids, &events)?;
        failpoint("relay.after_send_before_mark");
        let (parts, last): (Vec<i32>, Vec<i64>) = cursors.into_iter().unzip();
        statements
            .execute(
                &tx,
                &sc::relay_mark_sql(s),
                &[&parts, &last],
                "moving the relay cursors",
            )
            .await?;
        tx.commit()
            .await
            .map_err(db("committing the relay transaction"))?;
        Ok((ids.len(), capped))
    }

    /// The one progress row `sql` returns for `$1` group, `$2` topic, `$3`
    /// partition: position (text), source_commit, source_seq, epoch.
    async fn progress_row(
        &self,
        sql: &str,
        what: &'static str,
        group: &str,
        topic: &str,
        partition: u32,
    ) -> Result<Option<Progress>> {
        let row = self
            .client
            .query_opt(sql, &[&group, &topic, &(partition as i32)])
            .await
            .map_err(db(what))?;
        row.map(|r| progress_from(&r, 0)).transpose()
    }
}

/// Rows per statement of a batch commit, and bytes of their largest
/// column: far below PostgreSQL's 1 GB parameter limit, large enough that
/// a batch of the default size is one statement.
const PART_ROWS: usize = 10_000;
const PART_BYTES: usize = 64 << 20;

/// `rows` in consecutive runs of at most [`PART_ROWS`] rows whose `size`
/// adds up to at most [`PART_BYTES`] (a single larger row is a run alone).
fn bounded_parts<T>(rows: &[T], size: impl Fn(&T) -> usize) -> Vec<&[T]> {
    let mut parts = vec![];
    let (mut start, mut bytes) = (0, 0);
    for (i, r) in rows.iter().enumerate() {
        let n = size(r);
        if i > start && (i - start == PART_ROWS || bytes + n > PART_BYTES) {
            parts.push(&rows[start..i]);
            (start, bytes) = (i, 0);
        }
        bytes += n;
    }
    if start < rows.len() {
        parts.push(&rows[start..]);
    }
    parts
}

/// The progress in a row's columns `at..`: position (text), source_commit,
/// source_seq, epoch.
fn progress_from(r: &tokio_postgres::Row, at: usize) -> Result<Progress> {
    Ok(Progress {
        position: parse_numeric(&r.get::<_, String>(at))?,
        source: source_position(r.get(at + 1), r.get(at + 2))?,
        epoch: r.get(at + 3),
        recheck_after: r.get(at + 4),
    })
}

impl Sidecar for PgSidecar {
    async fn migrate(&mut self) -> Result<()> {
        // Already at this version: no DDL. Its `ALTER TABLE … IF NOT EXISTS`
        // takes an ACCESS EXCLUSIVE lock even when there is nothing to do;
        // queued behind another applier's open batch transaction, it would
        // hold up every reader of `progress` until that batch ends.
        let at: Option<i32> = self
            .client
            .query_one(&sc::schema_version_sql(&self.schema), &[])
            .await
            .ok()
            .and_then(|r| r.get(0));
        if at >= Some(skein_sql::postgres::SIDECAR_SCHEMA_VERSION) {
            return super::check_schema_version(at, &self.schema);
        }
        // One transaction under an advisory lock (see `migrate_sql`).
        self.client
            .batch_execute(&sc::migrate_sql(&self.schema))
            .await
            .map_err(db("creating the sidecar schema"))?;
        let found: Option<i32> = self
            .client
            .query_one(&sc::schema_version_sql(&self.schema), &[])
            .await
            .map_err(db("reading the sidecar schema version"))?
            .get(0);
        super::check_schema_version(found, &self.schema)
    }

    async fn progress(
        &mut self,
        group: &str,
        topic: &str,
        partition: u32,
    ) -> Result<Option<Progress>> {
        let sql = sc::progress_sql(&self.schema);
        self.progress_row(&sql, "reading progress", group, topic, partition)
            .await
    }

    async fn claim(
        &mut self,
        group: &str,
        topic: &str,
        partition: u32,
    ) -> Result<Option<Progress>> {
        let sql = sc::claim_progress_sql(&self.schema);
        self.progress_row(
            &sql,
            "claiming the partition's progress",
            group,
            topic,
            partition,
        )
        .await
    }

    async fn progress_all(&mut self, group: &str, topic: &str) -> Result<Vec<(u32, Progress)>> {
        let rows = self
            .client
            .query(&sc::progress_all_sql(&self.schema), &[&group, &topic])
            .await
            .map_err(db("reading every partition's progress"))?;
        rows.iter()
            .map(|r| Ok((r.get::<_, i32>(0).max(0) as u32, progress_from(r, 1)?)))
            .collect()
    }

    async fn forget_progress(
        &mut self,
        group: &str,
        topic: &str,
        partitions: &[u32],
    ) -> Result<()> {
        let ps: Vec<i32> = partitions.iter().map(|p| *p as i32).collect();
        self.client
            .execute(
                &sc::forget_progress_sql(&self.schema),
                &[&group, &topic, &ps],
            )
            .await
            .map_err(db("forgetting partitions' progress"))?;
        Ok(())
    }

    async fn partitions(&mut self, group: &str, topic: &str) -> Result<Option<u32>> {
        let row = self
            .client
            .query_opt(&sc::partitions_sql(&self.schema), &[&group, &topic])
            .await
            .map_err(db("reading the recorded partition count"))?;
        Ok(row.map(|r| r.get::<_, i32>(0).max(0) as u32))
    }

    async fn record_partitions(&mut self, group: &str, topic: &str, n: u32) -> Result<()> {
        self.client
            .execute(
                &sc::record_partitions_sql(&self.schema),
                &[&group, &topic, &(n as i32)],
            )
            .await
            .map_err(db("recording the partition count"))?;
        Ok(())
    }

    async fn versions(&mut self, entity: &str, keys: &[String]) -> Result<HashMap<String, Stored>> {
        let rows = self
            .statements
            .query(
                &self.client,
                &sc::versions_sql(&self.schema),
                &[&entity, &keys],
                "reading versions",
            )
            .await?;
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

    async fn published_keys(
        &mut self,
        entity: &str,
        after: Option<&str>,
        limit: i64,
    ) -> Result<Vec<String>> {
        let rows = self
            .client
            .query(
                &sc::published_keys_sql(&self.schema),
                &[&entity, &after, &limit],
            )
            .await
            .map_err(db("reading the published keys to re-check"))?;
        Ok(rows.iter().map(|r| r.get(0)).collect())
    }

    /// Read top to bottom: fence, batch row, outbox, versions, commit.
    async fn commit(&mut self, b: &BatchCommit) -> Result<i64> {
        let (tx, s, statements) = self.begin("beginning the batch transaction").await?;
        let partition = b.partition as i32;

        let src_commit: Option<String> = b.source.map(|p| p.commit.to_string());
        // Positions go over the wire as text: tokio-postgres has no numeric.
        let position = b.position.to_string();
        let expected_text = b.expected.map(|e| e.position.to_string());
        let expected_epoch = b.expected.map(|e| e.epoch);
        let (lower, upper) = (b.lower.to_string(), b.upper.to_string());
        let src_seq: Option<i64> = b.source.map(|p| i64::try_from(p.seq).unwrap_or(i64::MAX));
        let what_advance = "advancing progress";
        let what_batch = "inserting the batch row";
        let advance = statements
            .prepared(&tx, &sc::advance_progress_sql(s), what_advance)
            .await?;
        let batch_insert = statements
            .prepared(&tx, &sc::batch_insert_sql(s), what_batch)
            .await?;
        let outbox_insert = statements
            .prepared(&tx, &sc::outbox_insert_sql(s), "inserting outbox rows")
            .await?;
        let versions_upsert = statements
            .prepared(&tx, &sc::versions_upsert_sql(s), "upserting versions")
            .await?;
        let what_lock = "locking the partition's outbox";
        let what_cursor = "creating the partition's relay cursor";
        let outbox_lock = statements
            .prepared(&tx, sc::outbox_lock_sql(), what_lock)
            .await?;
        let cursor_ensure = statements
            .prepared(&tx, &sc::relay_cursor_ensure_sql(s), what_cursor)
            .await?;
        let what_floor = "reading the partition's highest outbox id";
        let outbox_floor = statements
            .prepared(&tx, &sc::outbox_floor_sql(s), what_floor)
            .await?;
        let lock_name = sc::outbox_lock_name(s);
        // Statements are pipelined where no answer feeds the next one:
        // tokio-postgres sends each as its future is first polled. Nothing
        // is committed before every answer was read and checked.
        //
        // 1. Fence: move progress only from where this applier started. An
        // explicit batch before the partition's first commit locks the
        // absent row instead (see `lock_absent_progress_sql`).
        let explicit_first = !b.explicit.is_empty() && expected_text.is_none();
        let fence = async {
            match &expected_text {
                None if explicit_first => {
                    let [insert, delete] = sc::lock_absent_progress_sql(s);
                    let n = tx
                        .execute(&insert, &[&b.group, &b.topic, &partition])
                        .await
                        .map_err(db("locking the partition's absent progress"))?;
                    if n == 1 {
                        tx.execute(&delete, &[&b.group, &b.topic, &partition])
                            .await
                            .map_err(db("locking the partition's absent progress"))?;
                    }
                    Ok(n)
                }
                Some(expected) => tx
                    .execute(
                        &advance,
                        &[
                            &b.group,
                            &b.topic,
                            &partition,
                            &position,
                            &expected,
                            &src_commit,
                            &src_seq,
                            &expected_epoch,
                            &b.recheck_after,
                        ],
                    )
                    .await
                    .map_err(db(what_advance)),
                None => tx
                    .execute(
                        &sc::first_progress_sql(s),
                        &[
                            &b.group,
                            &b.topic,
                            &partition,
                            &position,
                            &src_commit,
                            &src_seq,
                            &b.recheck_after,
                        ],
                    )
                    .await
                    .map_err(db("creating progress")),
            }
        };
        // 2. The batch row, beside the fence (a fenced batch rolls it back):
        // its correlation id is in every event of the batch.
        let batch_row = async {
            tx.query_one(
                &batch_insert,
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
            .map_err(db(what_batch))
        };
        // 3a. Before the partition's outbox ids are drawn: its outbox lock
        // (its ids grow in commit order, see `outbox_lock_sql`), its relay
        // cursor, so the relay sees these rows once they commit, and the
        // highest id it has, which every new id must pass.
        let outbox_ready = async {
            if b.outbox.is_empty() {
                return Ok(None);
            }
            let (lock_params, partition_param): (
                [&(dyn tokio_postgres::types::ToSql + Sync); 2],
                [&(dyn tokio_postgres::types::ToSql + Sync); 1],
            ) = ([&lock_name, &partition], [&partition]);
            // `biased`: polled, so sent, in this order: the cursor and the
            // floor are read under the lock.
            let (locked, cursor, floor) = tokio::join!(
                biased;
                tx.execute(&outbox_lock, &lock_params),
                tx.execute(&cursor_ensure, &partition_param),
                tx.query_one(&outbox_floor, &partition_param),
            );
            locked.map_err(db(what_lock))?;
            cursor.map_err(db(what_cursor))?;
            let floor: Option<i64> = floor.map_err(db(what_floor))?.get(0);
            Ok::<_, Error>(Some(floor.unwrap_or(0)))
        };
        let (moved, batch_row, ready) = tokio::join!(fence, batch_row, outbox_ready);
        if moved? != 1 {
            let found = tx
                .query_opt(
                    &sc::fenced_position_sql(s),
                    &[&b.group, &b.topic, &partition],
                )
                .await
                .map_err(db("reading progress after a fence"))?
                .map(|r| {
                    Ok::<_, Error>(Fence {
                        position: parse_numeric(&r.get::<_, String>(0))?,
                        epoch: r.get(1),
                    })
                })
                .transpose()?;
            // Dropping `tx` rolls back.
            return Err(Error::Fenced {
                partition: b.partition,
                expected: b.expected,
                found,
            });
        }
        let batch_id: i64 = batch_row?.get(0);
        let floor = ready?;

        // 3. Outbox rows, in decision order (ids keep per-aggregate order),
        // and 4. versions, in statements of bounded size: one array
        // parameter of a large batch's events could pass PostgreSQL's 1 GB
        // limit. Each part's columns are built first, then every part is
        // sent pipelined.
        type OutboxColumns<'a> = (
            Vec<&'a str>,
            Vec<&'a str>,
            Vec<&'a str>,
            Vec<Option<&'a str>>,
            Vec<&'a str>,
            Vec<i64>,
        );
        let outbox: Vec<OutboxColumns> = bounded_parts(&b.outbox, |o| o.event.len())
            .into_iter()
            .map(|part| {
                (
                    part.iter().map(|o| o.event_id.as_str()).collect(),
                    part.iter().map(|o| o.entity.as_str()).collect(),
                    part.iter().map(|o| o.key.as_str()).collect(),
                    part.iter().map(|o| o.etag.as_deref()).collect(),
                    part.iter().map(|o| o.event.as_str()).collect(),
                    part.iter().map(|o| o.commit_time_micros).collect(),
                )
            })
            .collect();
        type VersionColumns<'a> = (Vec<&'a str>, Vec<&'a str>, Vec<Option<&'a str>>, Vec<bool>);
        let versions: Vec<VersionColumns> = bounded_parts(&b.versions, |v| v.key.len())
            .into_iter()
            .map(|part| {
                (
                    part.iter().map(|v| v.entity.as_str()).collect(),
                    part.iter().map(|v| v.key.as_str()).collect(),
                    part.iter().map(|v| v.etag.as_deref()).collect(),
                    part.iter().map(|v| v.is_deleted).collect(),
                )
            })
            .collect();
        type Write<'a, T> =
            std::pin::Pin<Box<dyn std::future::Future<Output = Result<T>> + Send + 'a>>;
        let mut inserts: Vec<Write<Option<i64>>> = vec![];
        let mut writes: Vec<Write<u64>> = vec![];
        // The futures borrow the transaction; it is committed (moved) below.
        let on = &tx;
        let (outbox_insert, versions_upsert) = (&outbox_insert, &versions_upsert);
        for (ids, entities, keys, etags, events, times) in &outbox {
            inserts.push(Box::pin(async move {
                on.query_one(
                    outbox_insert,
                    &[
                        &batch_id, &partition, ids, entities, keys, etags, events, times,
                    ],
                )
                .await
                .map(|r| r.get(0))
                .map_err(db("inserting outbox rows"))
            }));
        }
        for (entities, keys, etags, deleted) in &versions {
            writes.push(Box::pin(async move {
                on.execute(versions_upsert, &[entities, keys, etags, deleted])
                    .await
                    .map_err(db("upserting versions"))
            }));
        }
        // 5. Explicit keys published by this batch leave the queue.
        let explicit_at = writes.len();
        if !b.explicit.is_empty() {
            let sql = sc::explicit_done_sql(s);
            writes.push(Box::pin(async move {
                on.execute(&sql, &[&b.explicit])
                    .await
                    .map_err(db("taking explicit keys off the queue"))
            }));
        }
        let (drawn, written) = futures_util::future::try_join(
            futures_util::future::try_join_all(inserts),
            futures_util::future::try_join_all(writes),
        )
        .await?;
        let drawn = drawn.into_iter().flatten().min();
        if let (Some(drawn), Some(floor)) = (drawn, floor) {
            super::check_outbox_order(b.partition, drawn, floor)?;
        }
        if let Some(&taken) = written.get(explicit_at) {
            if taken != b.explicit.len() as u64 {
                return Err(b.fenced_by_rows());
            }
        }

        failpoint("applier.before_commit");
        // 7. Commit: everything above becomes visible at once, or none of it.
        tx.commit().await.map_err(db("committing the batch"))?;
        failpoint("applier.after_commit");
        Ok(batch_id)
    }

    async fn pending(&mut self) -> Result<(i64, i64)> {
        let row = self
            .client
            .query_one(&sc::pending_sql(&self.schema), &[])
            .await
            .map_err(db("counting pending outbox rows"))?;
        Ok((row.get(0), row.get(1)))
    }

    async fn rewind(&mut self, r: &Rewind) -> Result<()> {
        let (tx, s, _) = self.begin("beginning the replay transaction").await?;
        for (p, cur, to) in &r.partitions {
            let n = tx
                .execute(&sc::rewind_sql(s), &[&r.group, &r.topic, p, cur, to])
                .await
                .map_err(db("rewinding progress"))?;
            if n != 1 {
                // Dropping `tx` rolls back.
                return Err(Rewind::moved(*p));
            }
        }
        for (entity, keys) in &r.forget_by_entity() {
            tx.execute(&sc::forget_versions_sql(s), &[entity, keys])
                .await
                .map_err(db("forgetting versions"))?;
        }
        tx.commit().await.map_err(db("committing the replay"))
    }

    /// Rounds of [`PgSidecar::relay_round`] while the last one took as many
    /// partitions as a round may (more may be pending beyond them) and the
    /// limit allows: a caller that takes a round short of its limit as
    /// "everything visible was sent" stays right past 64 partitions.
    async fn relay_once(
        &mut self,
        limit: i64,
        partitions: Option<&[i32]>,
        sink: &mut dyn Sink,
    ) -> Result<usize> {
        if partitions.is_some_and(<[i32]>::is_empty) {
            return Ok(0);
        }
        let (mut sent, mut left) = (0usize, limit);
        loop {
            let (n, capped) = self.relay_round(left, partitions, sink).await?;
            sent += n;
            left -= i64::try_from(n).unwrap_or(i64::MAX);
            if !capped || n == 0 || left <= 0 {
                return Ok(sent);
            }
        }
    }

    async fn relay_lease(&mut self, exclusive: bool) -> Result<bool> {
        let name = sc::relay_lease_name(&self.schema);
        let row = self
            .client
            .query_one(sc::relay_lease_sql(exclusive), &[&name])
            .await
            .map_err(db("taking the relay lease"))?;
        Ok(row.get(0))
    }

    async fn relay_lease_holders(&mut self) -> Result<Option<(i64, i64)>> {
        let name = sc::relay_lease_name(&self.schema);
        let row = self
            .client
            .query_one(sc::relay_lease_holders_sql(), &[&name])
            .await
            .map_err(db("reading the relay lease"))?;
        Ok(Some((row.get(0), row.get(1))))
    }

    async fn relay_report(&mut self, name: &str, state: &str, error: Option<&str>) -> Result<()> {
        self.client
            .execute(
                &sc::relay_report_sql(&self.schema),
                &[&name, &state, &error],
            )
            .await
            .map_err(db("reporting the relay's state"))?;
        Ok(())
    }

    async fn relay_states(&mut self) -> Result<Vec<RelayState>> {
        let rows = self
            .client
            .query(&sc::relay_states_sql(&self.schema), &[])
            .await
            .map_err(db("reading the relays' states"))?;
        Ok(rows
            .iter()
            .map(|r| RelayState {
                name: r.get(0),
                state: r.get(1),
                last_error: r.get(2),
                error_at: r.get(3),
                updated_at: r.get(4),
            })
            .collect())
    }

    async fn purge_outbox(&mut self, older_than_secs: i64, limit: i64) -> Result<u64> {
        let secs = older_than_secs as f64;
        self.client
            .execute(&sc::purge_outbox_sql(&self.schema), &[&secs, &limit])
            .await
            .map_err(db("deleting relayed outbox rows past their retention"))
    }

    async fn identifiers(
        &mut self,
        entity: &str,
        keys: &[String],
    ) -> Result<HashMap<String, String>> {
        let rows = self
            .client
            .query(&sc::identifiers_sql(&self.schema), &[&entity, &keys])
            .await
            .map_err(db("reading global identifiers"))?;
        Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
    }

    async fn insert_identifiers(&mut self, rows: &[IdentifierRow]) -> Result<u64> {
        let mut n = 0;
        for part in rows.chunks(PART_ROWS) {
            let entities: Vec<&str> = part.iter().map(|i| i.entity.as_str()).collect();
            let keys: Vec<&str> = part.iter().map(|i| i.key.as_str()).collect();
            let ids: Vec<&str> = part.iter().map(|i| i.global_id.as_str()).collect();
            n += self
                .client
                .execute(
                    &sc::identifiers_insert_sql(&self.schema),
                    &[&entities, &keys, &ids],
                )
                .await
                .map_err(db("inserting global identifiers"))?;
        }
        Ok(n)
    }

    async fn move_identifiers(&mut self, moves: &[(String, String)]) -> Result<u64> {
        let (tx, s, _) = self.begin("beginning the identifier carry-over").await?;
        let conflicts = sc::identifier_conflicts_sql(s);
        for (from, other, between) in crate::identifiers::carry_over_checks(moves) {
            let rows = tx
                .query(&conflicts, &[&from, &other])
                .await
                .map_err(db("reading identifiers at odds"))?;
            let rows: Vec<_> = rows
                .iter()
                .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
                .collect();
            crate::identifiers::judge_carry_over(from, other, between, &rows)?;
        }
        let [delete, update] = sc::identifiers_move_sql(s);
        let mut moved = 0;
        for (from, to) in moves {
            tx.execute(&delete, &[from, to])
                .await
                .map_err(db("replacing carried-over identifiers"))?;
            moved += tx
                .execute(&update, &[from, to])
                .await
                .map_err(db("carrying identifiers over"))?;
        }
        tx.commit()
            .await
            .map_err(db("committing the identifier carry-over"))?;
        Ok(moved)
    }

    async fn identifier_holders(
        &mut self,
        entity: &str,
        ids: &[String],
    ) -> Result<HashMap<String, String>> {
        let rows = self
            .client
            .query(&sc::identifier_holders_sql(&self.schema), &[&entity, &ids])
            .await
            .map_err(db("reading the keys of global identifiers"))?;
        Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
    }

    async fn explicit_start(&mut self, run: &NewRun) -> Result<ExplicitRun> {
        let s = self.schema.as_str();
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 5] = [
            &run.group,
            &run.entity,
            &run.selection,
            &run.republish,
            &run.initial,
        ];
        let found = self
            .client
            .query_opt(&sc::explicit_find_sql(s), &params)
            .await
            .map_err(db("looking for an unfinished explicit run"))?;
        if let Some(r) = found {
            return Ok(ExplicitRun {
                id: r.get(0),
                cursor: r.get(1),
                queued: r.get(2),
                resumed: true,
            });
        }
        let id: i64 = self
            .client
            .query_one(&sc::explicit_insert_sql(s), &params)
            .await
            .map_err(db("creating an explicit run"))?
            .get(0);
        Ok(ExplicitRun::created(id))
    }

    async fn explicit_enqueue(&mut self, c: &ExplicitChunk) -> Result<()> {
        let (tx, s, _) = self.begin("beginning an explicit chunk").await?;
        let state = c.state();
        let moved = tx
            .execute(
                &sc::explicit_advance_sql(s),
                &[&c.run, &c.from, &c.to, &(c.keys.len() as i64), &state],
            )
            .await
            .map_err(db("moving the explicit run's cursor"))?;
        if moved != 1 {
            return Err(c.cursor_moved());
        }
        let partitions: Vec<i32> = c.keys.iter().map(|(p, _)| *p as i32).collect();
        let keys: Vec<&str> = c.keys.iter().map(|(_, k)| k.as_str()).collect();
        tx.execute(
            &sc::explicit_enqueue_sql(s),
            &[
                &c.run,
                &c.group,
                &c.topic,
                &c.entity,
                &c.republish,
                &partitions,
                &keys,
            ],
        )
        .await
        .map_err(db("queueing explicit keys"))?;
        failpoint("explicit.before_chunk_commit");
        tx.commit()
            .await
            .map_err(db("committing an explicit chunk"))
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
                &sc::explicit_pending_sql(&self.schema),
                &[
                    &group,
                    &topic,
                    &(partition as i32),
                    &limit,
                    &(partitions.max(1) as i32),
                ],
            )
            .await
            .map_err(db("reading queued explicit keys"))?;
        Ok(rows
            .iter()
            .map(|r| ExplicitItem {
                id: r.get(0),
                entity: r.get(1),
                key: r.get(2),
                republish: r.get(3),
            })
            .collect())
    }

    async fn explicit_runs(&mut self, group: &str, recent: i64) -> Result<Vec<ExplicitRunStatus>> {
        let rows = self
            .client
            .query(&sc::explicit_runs_sql(&self.schema), &[&group, &recent])
            .await
            .map_err(db("reading explicit runs"))?;
        Ok(rows.iter().map(run_status).collect())
    }

    async fn explicit_requeue(&mut self, moves: &[(i64, u32)]) -> Result<()> {
        let ids: Vec<i64> = moves.iter().map(|m| m.0).collect();
        let parts: Vec<i32> = moves.iter().map(|m| m.1 as i32).collect();
        self.client
            .execute(&sc::explicit_requeue_sql(&self.schema), &[&ids, &parts])
            .await
            .map_err(db("moving queued explicit keys to their partitions"))?;
        Ok(())
    }

    async fn explicit_run(&mut self, id: i64) -> Result<Option<ExplicitRunStatus>> {
        let row = self
            .client
            .query_opt(&sc::explicit_run_sql(&self.schema), &[&id])
            .await
            .map_err(db("reading an explicit run"))?;
        Ok(row.as_ref().map(run_status))
    }
}

/// An explicit run as `explicit_run_select` reads it.
fn run_status(r: &tokio_postgres::Row) -> ExplicitRunStatus {
    ExplicitRunStatus {
        id: r.get(0),
        entity: r.get(1),
        selection: r.get(2),
        republish: r.get(3),
        initial: r.get(4),
        state: r.get(5),
        cursor: r.get(6),
        queued: r.get(7),
        pending: r.get(8),
        created_at: r.get(9),
        updated_at: r.get(10),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn commit_statements_are_bounded_in_rows_and_bytes() {
        let sizes: Vec<usize> = vec![1; 25_000];
        let parts = bounded_parts(&sizes, |s| *s);
        assert_eq!(
            parts.iter().map(|p| p.len()).collect::<Vec<_>>(),
            [10_000, 10_000, 5_000]
        );
        let big = PART_BYTES / 2 + 1;
        let sizes = vec![big, big, 3, PART_BYTES * 2, 1];
        let parts = bounded_parts(&sizes, |s| *s);
        assert_eq!(
            parts.iter().map(|p| p.len()).collect::<Vec<_>>(),
            [1, 2, 1, 1]
        );
        assert!(bounded_parts(&Vec::<usize>::new(), |s| *s).is_empty());
        // Order and content are kept.
        let flat: Vec<usize> = parts.concat();
        assert_eq!(flat, sizes);
    }
}
