//! The relay: outbox → sink, at least once with a stable event id.

use std::time::Duration;

use skein_common::failpoint::failpoint;
use tokio_util::sync::CancellationToken;
use tracing::{info, info_span, Instrument};

use crate::error::{db, Result};
use skein_common::sqlvalue::SqlValue;
use skein_sql::sqlserver::sidecar as sc;

use crate::mssql_sidecar::MssqlSidecar;
use crate::sidecar::{AnySidecar, PgSidecar};
use crate::sink::{Sink, SinkEvent};

/// Which outbox rows a relay takes.
#[derive(Clone, Debug, Default)]
pub enum RelayScope {
    /// Every partition, skipping rows another relay holds (run one such relay).
    #[default]
    All,
    /// Only the partitions this process owns (`skein apply`). Rows are locked
    /// without skipping, so a relay that takes a partition over waits for
    /// the previous owner's send to finish and keeps per-aggregate order.
    Partitions(std::sync::Arc<std::sync::Mutex<Vec<i32>>>),
}

/// Sends at most `limit` pending outbox rows in id order and marks them
/// dequeued in the same transaction, after the sink has them. Returns how
/// many were sent.
pub async fn relay_once(
    sidecar: &mut AnySidecar,
    sink: &mut dyn Sink,
    limit: i64,
    scope: &RelayScope,
) -> Result<usize> {
    match sidecar {
        AnySidecar::Postgres(s) => relay_once_pg(s, sink, limit, scope).await,
        AnySidecar::SqlServer(s) => relay_once_mssql(s, sink, limit, scope).await,
    }
}

async fn relay_once_pg(
    sidecar: &mut PgSidecar,
    sink: &mut dyn Sink,
    limit: i64,
    scope: &RelayScope,
) -> Result<usize> {
    let q = sidecar.schema_ident().to_string();
    let client = sidecar.client();
    let tx = client
        .transaction()
        .await
        .map_err(db("beginning the relay transaction"))?;
    let rows = match scope {
        RelayScope::All => {
            tx.query(
                &format!(
                    "SELECT id, entity, event FROM {q}.\"outbox\" WHERE dequeued_at IS NULL \
                     ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED"
                ),
                &[&limit],
            )
            .await
        }
        RelayScope::Partitions(owned) => {
            let owned: Vec<i32> = owned.lock().map(|o| o.clone()).unwrap_or_default();
            if owned.is_empty() {
                return Ok(0);
            }
            tx.query(
                &format!(
                    "SELECT id, entity, event FROM {q}.\"outbox\" WHERE dequeued_at IS NULL \
                     AND partition = ANY($2) ORDER BY id LIMIT $1 FOR UPDATE"
                ),
                &[&limit, &owned],
            )
            .await
        }
    }
    .map_err(db("reading the outbox"))?;
    if rows.is_empty() {
        return Ok(0);
    }
    let ids: Vec<i64> = rows.iter().map(|r| r.get(0)).collect();
    let events: Vec<SinkEvent> = rows
        .iter()
        .map(|r| SinkEvent {
            entity: r.get(1),
            event: r.get(2),
        })
        .collect();
    // A sink may block (file sync, broker acknowledgement).
    tokio::task::block_in_place(|| sink.send(&events))?;
    failpoint("relay.after_send_before_mark");
    tx.execute(
        &format!("UPDATE {q}.\"outbox\" SET dequeued_at = clock_timestamp() WHERE id = ANY($1)"),
        &[&ids],
    )
    .await
    .map_err(db("marking outbox rows dequeued"))?;
    tx.commit()
        .await
        .map_err(db("committing the relay transaction"))?;
    Ok(ids.len())
}

/// [`relay_once`] on SQL Server: `UPDLOCK, READPAST` is PostgreSQL's
/// `FOR UPDATE SKIP LOCKED`; a partition-scoped relay waits instead of
/// skipping, as on PostgreSQL.
async fn relay_once_mssql(
    sidecar: &mut MssqlSidecar,
    sink: &mut dyn Sink,
    limit: i64,
    scope: &RelayScope,
) -> Result<usize> {
    let schema = sidecar.schema().to_string();
    let select = match scope {
        RelayScope::All => sc::relay_select_sql(&schema, None),
        RelayScope::Partitions(owned) => {
            let owned: Vec<i32> = owned.lock().map(|o| o.clone()).unwrap_or_default();
            if owned.is_empty() {
                return Ok(0);
            }
            sc::relay_select_sql(&schema, Some(&owned))
        }
    };
    let client = sidecar.client();
    client.begin("beginning the relay transaction").await?;
    let result = async {
        let rows = client
            .query("reading the outbox", &select, &[&limit])
            .await?;
        if rows.is_empty() {
            return Ok(vec![]);
        }
        let mut ids = Vec::with_capacity(rows.len());
        let mut events = Vec::with_capacity(rows.len());
        for r in rows {
            let (
                Some(SqlValue::Int(id)),
                Some(SqlValue::Text(entity)),
                Some(SqlValue::Text(event)),
            ) = (r.first(), r.get(1), r.get(2))
            else {
                return Err(crate::Error::Data(format!("unexpected outbox row {r:?}")));
            };
            ids.push(*id);
            events.push(SinkEvent {
                entity: entity.clone(),
                event: event.clone(),
            });
        }
        tokio::task::block_in_place(|| sink.send(&events))?;
        failpoint("relay.after_send_before_mark");
        client
            .execute(
                "marking outbox rows dequeued",
                &sc::relay_mark_sql(&schema, &ids),
                &[],
            )
            .await?;
        Ok(ids)
    }
    .await;
    match result {
        Ok(ids) => {
            client.commit("committing the relay transaction").await?;
            Ok(ids.len())
        }
        Err(e) => {
            client.rollback_quietly().await;
            Err(e)
        }
    }
}

/// Relays until cancelled, then drains what is pending once more.
pub async fn run_relay(
    mut sidecar: AnySidecar,
    mut sink: Box<dyn Sink>,
    limit: i64,
    scope: RelayScope,
    cancel: CancellationToken,
) -> Result<()> {
    async move {
        let mut total = 0usize;
        loop {
            let n = relay_once(&mut sidecar, sink.as_mut(), limit, &scope).await?;
            total += n;
            if n > 0 {
                tracing::debug!(sent = n, "relayed");
                continue;
            }
            if cancel.is_cancelled() {
                break;
            }
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(50)) => {}
                _ = cancel.cancelled() => {}
            }
        }
        info!(sent = total, "relay stopped");
        Ok(())
    }
    .instrument(info_span!("relay"))
    .await
}
