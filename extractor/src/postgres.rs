//! PostgreSQL source: the logical replication protocol (pgoutput) for the
//! change stream, an ordinary connection for the catalog, the slot and
//! root-key lookups.

use std::collections::{BTreeMap, HashMap};
use std::str::FromStr;
use std::time::{Duration, Instant};

use pgwire_replication::{Lsn, ReplicationClient, ReplicationEvent};
use skein_common::config::{Config, OnTruncate, PostgresSource, Secret};
use skein_common::{ChangeRecord, Op, PgLsn, RootKey, SourcePosition};
use skein_sql::postgres::client::PgUrl;
use skein_sql::postgres::{check_schema_change, describe_change, resolve_sql, schema_stop};
use skein_sql::Catalog;
use tokio_postgres::error::SqlState;
use tracing::{info, warn};

use crate::error::{src, Error, Result};
use crate::pgoutput::{self, Message, Relation};
pub use crate::resolve::RawChange;
use crate::resolve::{count_tracked, BatchResolution, EntityPlan, TableIndex, TxMeta};
use crate::spill::{self, SpillReader, SpillWriter, Spilled};
use crate::{BatchLimits, ChangeSource, InFlight, ReadBatch, StartPoint};

/// How long the slot's creation may wait before a warning names the
/// transactions it waits for, and how often the warning comes back.
pub const SLOT_WAIT_FIRST_WARNING: Duration = Duration::from_secs(5);
pub const SLOT_WAIT_WARNING_EVERY: Duration = Duration::from_secs(30);

/// What a new logical slot waits for, oldest first, a line each: sessions
/// holding a transaction id, and prepared transactions (which no session
/// holds). A session this role may not see in full (another role's,
/// without `pg_read_all_stats`) shows `?` for what is hidden, and comes
/// first.
const SLOT_CREATION_BLOCKERS: &str = "SELECT line FROM (\
     SELECT xact_start AS since, format('pid %s (database %s, user %s, %s for %s s: %s)', pid, \
       coalesce(datname::text, '?'), coalesce(usename::text, '?'), coalesce(state, '?'), \
       coalesce(extract(epoch FROM now() - xact_start)::int8::text, '?'), \
       coalesce(left(regexp_replace(query, '\\s+', ' ', 'g'), 120), '?')) AS line \
     FROM pg_catalog.pg_stat_activity WHERE backend_xid IS NOT NULL \
     UNION ALL \
     SELECT prepared, format('prepared transaction %L (database %s, owner %s, prepared %s s ago: \
       COMMIT PREPARED or ROLLBACK PREPARED ends it)', gid, database, owner, \
       extract(epoch FROM now() - prepared)::int8) \
     FROM pg_catalog.pg_prepared_xacts) b ORDER BY since NULLS FIRST LIMIT 5";

/// How long reading what a slot's creation waits for may take: the
/// creation is not watched meanwhile.
const SLOT_WAIT_READ_TIMEOUT: Duration = Duration::from_secs(5);

/// Microseconds between the Unix epoch and PostgreSQL's epoch (2000-01-01).
const PG_EPOCH_OFFSET_MICROS: i64 = 946_684_800_000_000;

/// Opens an ordinary connection; the connection task is spawned and ends
/// when the client is dropped.
/// TLS as the URL's `sslmode` / `sslrootcert` say ([`PgUrl`]).
pub async fn connect(url: &Secret, what: &'static str) -> Result<tokio_postgres::Client> {
    let connect_err = |source| Error::Connect { what, source };
    PgUrl::parse(url.expose())
        .map_err(connect_err)?
        .connect(what)
        .await
        .map_err(connect_err)
}

/// Reads the catalog of every table of every entity.
pub async fn load_catalog(client: &tokio_postgres::Client, cfg: &Config) -> Result<Catalog> {
    // Each table once: a table in two entities would otherwise list its
    // columns (and key) twice.
    use skein_sql::postgres::{catalog::read_catalog, CATALOG_QUERY};
    read_catalog(client, CATALOG_QUERY, &cfg.tables())
        .await
        .map_err(src("reading the catalog"))
}

/// One committed transaction, or a part of one.
#[derive(Clone, Debug)]
pub struct Tx {
    /// Transaction id.
    pub xid: u32,
    /// Start of the commit record (the Begin message's final LSN): tells
    /// the transaction before its end is known.
    pub commit_lsn: PgLsn,
    /// End of the commit record: the transaction's position.
    pub end_lsn: PgLsn,
    /// Commit time, microseconds since the Unix epoch.
    pub commit_time_micros: i64,
    /// Row changes in order.
    pub changes: Vec<RawChange>,
    /// Updates whose after image lacks unchanged TOASTed values the before
    /// image did not have: `(index into changes, column names)`.
    pub unchanged: Vec<(usize, Vec<String>)>,
    /// Tables the transaction truncated (`schema.table`).
    pub truncated: Vec<String>,
    /// Changes of the transaction before `changes[0]` that are not here:
    /// handed over in earlier parts, or before a restart.
    pub before: u64,
    /// How many of those are tracked ([`crate::resolve::is_tracked`]): this part's records
    /// number on from theirs.
    pub before_tracked: u32,
}

impl Tx {
    /// A transaction begun at `commit_lsn`, no change yet.
    fn begin(xid: u32, commit_lsn: PgLsn, commit_time_micros: i64) -> Tx {
        Tx {
            xid,
            commit_lsn,
            end_lsn: PgLsn::ZERO,
            commit_time_micros,
            changes: vec![],
            unchanged: vec![],
            truncated: vec![],
            before: 0,
            before_tracked: 0,
        }
    }

    /// Takes the changes out, each with its unchanged TOAST columns.
    fn take_changes(&mut self) -> impl Iterator<Item = Spilled> {
        let mut unchanged: HashMap<usize, Vec<String>> = self.unchanged.drain(..).collect();
        std::mem::take(&mut self.changes)
            .into_iter()
            .enumerate()
            .map(move |(i, change)| Spilled {
                change,
                unchanged: unchanged.remove(&i),
            })
    }
}

impl Arriving {
    /// Takes in the open transaction's newest changes: skips what the
    /// marker says was handed over of it before a restart, and spills its
    /// changes to disk once they fill a batch.
    fn absorb(&mut self, tx: &mut Tx, by_table: &TableIndex, max_changes: usize) -> Result<()> {
        if let Some(r) = self.resume.filter(|r| r.commit == tx.commit_lsn.into()) {
            let skip = usize::try_from(r.changes.saturating_sub(tx.before))
                .unwrap_or(usize::MAX)
                .min(tx.changes.len());
            if skip > 0 {
                tx.before_tracked = tx
                    .before_tracked
                    .saturating_add(count_tracked(by_table, &tx.changes[..skip]));
                tx.before += skip as u64;
                if let (true, Some(t)) = (tx.before == r.changes, r.tracked) {
                    // As numbered when they were handed over, whatever the
                    // config says now.
                    tx.before_tracked = t;
                }
                tx.changes.drain(..skip);
                tx.unchanged.retain_mut(|(i, _)| {
                    let keep = *i >= skip;
                    *i = i.wrapping_sub(skip);
                    keep
                });
            }
        }
        if tx.changes.len() < max_changes.max(1) {
            return Ok(());
        }
        let w = match &mut self.spill {
            Some(w) => w,
            None => {
                let dir = self.spill_dir.as_ref().ok_or_else(|| {
                    Error::Decode("a large transaction arrived before the stream started".into())
                })?;
                info!(
                    xid = tx.xid,
                    "a transaction larger than one batch is arriving; spilling it to disk"
                );
                self.spill.insert(SpillWriter::create(
                    dir,
                    &format!("tx-{}-{:X}", tx.xid, tx.commit_lsn.as_u64()),
                )?)
            }
        };
        w.write(tx.take_changes())
    }

    /// Checks a committed transaction against the one the marker had in
    /// flight: the stream must send it again whole, as before.
    fn resumed(&mut self, tx: &Tx) -> Result<()> {
        let Some(r) = self.resume.filter(|r| r.commit == tx.commit_lsn.into()) else {
            return Ok(());
        };
        self.resume = None;
        if r.end != tx.end_lsn.into() || tx.before < r.changes {
            return Err(Error::Decode(format!(
                "the transaction in flight at the last stop (commit {}, end {}, {} changes handed \
                 over) came back ending at {} with {} changes: the source sent it differently",
                r.commit,
                r.end,
                r.changes,
                tx.end_lsn,
                tx.before + tx.changes.len() as u64
            )));
        }
        Ok(())
    }
}

/// A committed transaction too large for one batch, handed over a part per
/// batch from its spill file.
#[derive(Debug)]
struct Draining {
    /// The transaction, without changes.
    tx: Tx,
    reader: SpillReader,
}

/// Whole transactions in `(lower, upper]`.
#[derive(Clone, Debug)]
pub struct SourceBatch {
    /// Exclusive lower bound.
    pub lower: PgLsn,
    /// Inclusive upper bound; equal to `lower` when nothing happened.
    pub upper: PgLsn,
    /// The transactions.
    pub txs: Vec<Tx>,
    /// More was ready when it closed: it reached `max_changes`, a large
    /// transaction follows it, or it is a part of one ([`ReadBatch::more`]).
    pub more: bool,
}

impl SourceBatch {
    /// Number of row changes.
    pub fn change_count(&self) -> usize {
        self.txs.iter().map(|t| t.changes.len()).sum()
    }
}

/// How much of what the server keeps for a slot its lag uses.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Retention {
    /// WAL the slot holds back: from its restart position to the WAL end.
    pub retained_bytes: i64,
    /// How much more WAL the server lets the slot hold before invalidating
    /// it (`None`: `max_slot_wal_keep_size` is -1, no limit but the disk).
    pub safe_wal_size: Option<i64>,
}

impl Retention {
    /// The share of the server's limit in use (0..=1), `None` without a limit.
    pub fn used(&self) -> Option<f64> {
        let safe = self.safe_wal_size?;
        let held = self.retained_bytes.max(0) as f64;
        if safe <= 0 {
            return Some(1.0);
        }
        Some(held / (held + safe as f64))
    }

    /// Reads slot `slot`'s retention (`None`: no such slot).
    pub async fn read(client: &tokio_postgres::Client, slot: &str) -> Result<Option<Retention>> {
        let row = client
            .query_opt(skein_sql::postgres::admin::SLOT_RETENTION, &[&slot])
            .await
            .map_err(src("reading the replication slot's retention"))?;
        Ok(row.map(|r| Retention {
            retained_bytes: r.get::<_, Option<i64>>(0).unwrap_or(0),
            safe_wal_size: r.get(1),
        }))
    }
}

/// How often the extractor compares its lag with what the source keeps
/// (the slot's retention; on SQL Server, the CDC cleanup job's).
pub(crate) const RETENTION_CHECK_EVERY: Duration = Duration::from_secs(30);

/// The PostgreSQL change source.
pub struct PgSource {
    client: tokio_postgres::Client,
    /// The config, to read the catalog again and check it.
    cfg: Config,
    catalog: Catalog,
    /// A Relation message announced a table whose columns differ from what
    /// the plans were built for: read the catalog again before resolving.
    schema_changed: bool,
    url: Secret,
    slot: String,
    publication: String,
    plans: Vec<EntityPlan>,
    by_table: TableIndex,
    stream: Option<ReplicationClient>,
    relations: HashMap<u32, Relation>,
    /// A transaction still open when the previous batch closed on time.
    open_tx: Option<Tx>,
    /// Highest position known to hold nothing more for us (keepalive while idle).
    idle_upper: PgLsn,
    /// When the retention was last checked.
    retention_checked: Option<Instant>,
    /// The open transaction, when it is large.
    large: Arriving,
    /// A large committed transaction being handed over in parts.
    draining: Option<Draining>,
}

/// What becomes of the open transaction's changes as they arrive.
#[derive(Debug, Default)]
struct Arriving {
    /// Where large transactions are spilled (`state_dir/spill`), prepared
    /// by `start`: only the extractor, which holds the state directory's
    /// lock, uses it.
    spill_dir: Option<std::path::PathBuf>,
    /// The open transaction's changes past one batch, on disk.
    spill: Option<SpillWriter>,
    /// From the marker: the transaction in flight at the last stop, and
    /// how many of its changes to skip when the stream sends it again.
    resume: Option<InFlight>,
}

impl PgSource {
    /// Connects the query connection and builds the resolution plans.
    pub async fn connect(cfg: &Config, source: &PostgresSource) -> Result<PgSource> {
        let client = connect(&source.url, "source").await?;
        let catalog = load_catalog(&client, cfg).await?;
        let (plans, by_table) = crate::plans_for(cfg, &catalog)?;
        Ok(PgSource {
            client,
            cfg: cfg.clone(),
            catalog,
            schema_changed: false,
            url: source.url.clone(),
            slot: source.slot.clone(),
            publication: source.publication.clone(),
            plans,
            by_table,
            stream: None,
            relations: HashMap::new(),
            open_tx: None,
            idle_upper: PgLsn::ZERO,
            retention_checked: None,
            large: Arriving::default(),
            draining: None,
        })
    }

    /// Warns when the slot's lag uses more than `retention_warn_fraction`
    /// of what the server keeps for it: the moment an operator can still
    /// act (raise `max_slot_wal_keep_size`, or fix what holds skein back)
    /// before PostgreSQL invalidates the slot. At start, then every 30 s.
    async fn check_retention(&mut self) -> Result<()> {
        if self
            .retention_checked
            .is_some_and(|t| t.elapsed() < RETENTION_CHECK_EVERY)
        {
            return Ok(());
        }
        self.retention_checked = Some(Instant::now());
        let Some(r) = Retention::read(&self.client, &self.slot).await? else {
            return Ok(());
        };
        if let Some(used) = r
            .used()
            .filter(|u| *u >= self.cfg.extractor.retention_warn_fraction)
        {
            warn!(
                slot = %self.slot,
                retained_bytes = r.retained_bytes,
                safe_wal_size = r.safe_wal_size,
                "lag uses {:.1}% of what the source keeps for the slot (max_slot_wal_keep_size); \
                 past 100% PostgreSQL invalidates the slot and changes are lost",
                used * 100.0
            );
        }
        Ok(())
    }

    /// The query connection (for callers that need the same source).
    pub fn client(&self) -> &tokio_postgres::Client {
        &self.client
    }

    /// Checks the slot against the marker and decides where to start.
    ///
    /// * no marker, no slot → create the slot, start at its consistent point;
    /// * no marker, slot → start at the slot's confirmed position;
    /// * marker, slot missing / invalidated / confirmed past the marker →
    ///   [`Error::DataLoss`], or with `continue_with_data_loss` start at what
    ///   the source has and report the loss.
    pub async fn prepare_slot(
        &mut self,
        marker: Option<PgLsn>,
        floor: Option<PgLsn>,
        continue_with_data_loss: bool,
    ) -> Result<StartPoint> {
        let publication = self
            .client
            .query_opt(
                "SELECT pubtruncate FROM pg_catalog.pg_publication WHERE pubname = $1",
                &[&self.publication],
            )
            .await
            .map_err(src("checking the publication"))?;
        let Some(publication) = publication else {
            return Err(Error::NotReady {
                message: format!("publication `{}` does not exist", self.publication),
                fix: "run the output of `skein sql source` against the source database".into(),
            });
        };
        let publishes_truncate: bool = publication.get(0);
        if !publishes_truncate && self.cfg.extractor.on_truncate == OnTruncate::Recheck {
            // A publication made before `recheck` existed: a TRUNCATE would
            // pass unseen and its aggregates keep their last event.
            warn!(
                publication = %self.publication,
                "extractor.on_truncate is `recheck` but the publication leaves TRUNCATE out, so a \
                 TRUNCATE is not seen and its aggregates keep their last event. Fix: \
                 ALTER PUBLICATION \"{}\" SET (publish = 'insert, update, delete, truncate'); \
                 (or run `skein sql source` again), or set `extractor.on_truncate: stop`",
                self.publication
            );
        }
        let slot = self
            .client
            .query_opt(
                "SELECT confirmed_flush_lsn::text, coalesce(wal_status, '') FROM pg_catalog.pg_replication_slots \
                 WHERE slot_name = $1 AND database = current_database()",
                &[&self.slot],
            )
            .await
            .map_err(src("reading the replication slot"))?;
        let slot_state: Option<(Option<PgLsn>, String)> = match slot {
            None => None,
            Some(r) => {
                let lsn: Option<String> = r.get(0);
                let lsn = lsn
                    .map(|s| PgLsn::from_str(&s))
                    .transpose()
                    .map_err(|e| Error::Decode(e.to_string()))?;
                Some((lsn, r.get(1)))
            }
        };
        let (available, lost_reason) = match &slot_state {
            None => (None, Some(format!("slot `{}` does not exist", self.slot))),
            Some((_, status)) if status == "lost" => (
                None,
                Some(format!(
                    "slot `{}` was invalidated (wal_status lost)",
                    self.slot
                )),
            ),
            Some((lsn, _)) => (*lsn, None),
        };
        match (marker, available, lost_reason) {
            (None, Some(at), None) => Ok(StartPoint {
                position: at.into(),
                data_loss: false,
            }),
            (None, _, reason) => {
                // No marker and no usable slot. A first start, unless the
                // sidecar shows the pipeline applied changes before: then
                // the state directory was lost with the slot, and whatever
                // came after that point is gone.
                if let (Some(f), Some(reason)) = (floor, &reason) {
                    if !continue_with_data_loss {
                        return Err(Error::DataLoss {
                            marker: format!(
                                "{f} (the sidecar's progress: the state directory is empty)"
                            ),
                            available: reason.clone(),
                        });
                    }
                }
                if slot_state.is_some() {
                    self.drop_slot().await?;
                }
                let at = self.create_slot().await?;
                info!(slot = %self.slot, position = %at, "created replication slot");
                let data_loss = floor.is_some() && reason.is_some();
                if data_loss {
                    warn!(floor = ?floor.map(|f| f.to_string()), position = %at, "data loss: the state directory and the slot were lost; continuing from the new slot");
                }
                Ok(StartPoint {
                    position: at.into(),
                    data_loss,
                })
            }
            (Some(m), Some(at), None) if at <= m => Ok(StartPoint {
                position: m.into(),
                data_loss: false,
            }),
            (Some(m), available, reason) => {
                let what = reason.unwrap_or_else(|| format!("{}", available.unwrap_or_default()));
                if !continue_with_data_loss {
                    return Err(Error::DataLoss {
                        marker: m.to_string(),
                        available: what,
                    });
                }
                let at = match available {
                    Some(at) => at,
                    None => {
                        if slot_state.is_some() {
                            self.drop_slot().await?;
                        }
                        self.create_slot().await?
                    }
                };
                warn!(marker = %m, available = %what, position = %at, "data loss: continuing from what the source holds");
                Ok(StartPoint {
                    position: at.into(),
                    data_loss: true,
                })
            }
        }
    }

    /// Waits until no session streams from the slot. A process killed a
    /// moment ago may still hold it until PostgreSQL notices its
    /// connection is gone; a slot held for longer belongs to another live
    /// extractor, and starting beside it is an error.
    async fn wait_for_the_slot(&self) -> Result<()> {
        const PATIENCE: Duration = Duration::from_secs(30);
        let started = std::time::Instant::now();
        loop {
            let holder: Option<i32> = self
                .client
                .query_opt(
                    "SELECT active_pid FROM pg_catalog.pg_replication_slots \
                     WHERE slot_name = $1 AND database = current_database() AND active",
                    &[&self.slot],
                )
                .await
                .map_err(src("reading the replication slot"))?
                .and_then(|r| r.get(0));
            let Some(pid) = holder else { return Ok(()) };
            if started.elapsed() > PATIENCE {
                return Err(Error::NotReady {
                    message: format!(
                        "replication slot `{}` has been in use by backend {pid} for {}s",
                        self.slot,
                        PATIENCE.as_secs()
                    ),
                    fix: "stop the other extractor of this pipeline (only one may run), or \
                          terminate that backend if it is left over"
                        .into(),
                });
            }
            if started.elapsed() < Duration::from_millis(200) {
                info!(slot = %self.slot, pid, "the slot is still held (a process stopped just now?); waiting for it");
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Creates the slot. PostgreSQL first waits for every transaction that
    /// holds a transaction id on the server (any database) to end, then for
    /// its next record of running transactions (up to 15 s later): a session
    /// left idle in a transaction holds the creation up for as long as it
    /// stays so. Past [`SLOT_WAIT_FIRST_WARNING`], and every
    /// [`SLOT_WAIT_WARNING_EVERY`] after, a warning names those
    /// transactions (read on a second connection), instead of a start that
    /// hangs without a word.
    async fn create_slot(&self) -> Result<PgLsn> {
        info!(slot = %self.slot, "creating the replication slot");
        let started = Instant::now();
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 1] = [&self.slot];
        let create = self.client.query_one(
            "SELECT lsn::text FROM pg_catalog.pg_create_logical_replication_slot($1, 'pgoutput')",
            &params,
        );
        tokio::pin!(create);
        let mut next_warning = started + SLOT_WAIT_FIRST_WARNING;
        let mut watch: Option<tokio_postgres::Client> = None;
        let row = loop {
            tokio::select! {
                row = &mut create => break row.map_err(src("creating the replication slot"))?,
                () = tokio::time::sleep_until(next_warning.into()) => {
                    let blockers = tokio::time::timeout(
                        SLOT_WAIT_READ_TIMEOUT,
                        self.slot_creation_blockers(&mut watch),
                    )
                    .await
                    .unwrap_or_else(|_| {
                        format!("(could not read them within {} s)", SLOT_WAIT_READ_TIMEOUT.as_secs())
                    });
                    next_warning = Instant::now() + SLOT_WAIT_WARNING_EVERY;
                    warn!(
                        slot = %self.slot,
                        waited_s = started.elapsed().as_secs(),
                        holding_it_up = %blockers,
                        "creating the replication slot waits for transactions in progress on the server to end \
                         (PostgreSQL's rule for a new logical slot); end or commit them to let skein start"
                    );
                }
            }
        };
        let s: String = row.get(0);
        s.parse()
            .map_err(|e: skein_common::Error| Error::Decode(e.to_string()))
    }

    /// The transactions holding a transaction id on the server now, oldest
    /// first, and the prepared ones, as one line for a warning; read on
    /// `watch`, a connection of its own (opened on first use: the source
    /// connection is busy creating the slot). A failure to read them is
    /// said in the line, not raised: the creation goes on either way.
    async fn slot_creation_blockers(&self, watch: &mut Option<tokio_postgres::Client>) -> String {
        let client = match watch {
            Some(c) => c,
            None => match connect(&self.url, "source (watching the slot's creation)").await {
                Ok(c) => watch.insert(c),
                Err(e) => return format!("(could not read them: {e})"),
            },
        };
        match client.query(SLOT_CREATION_BLOCKERS, &[]).await {
            Ok(rows) if rows.is_empty() => {
                "none visible to this role (they may have ended: the slot then waits for \
                 PostgreSQL's next record of running transactions)"
                    .into()
            }
            Ok(rows) => rows
                .iter()
                .map(|r| {
                    r.try_get::<_, String>(0)
                        .unwrap_or_else(|e| format!("({e})"))
                })
                .collect::<Vec<_>>()
                .join("; "),
            Err(e) => format!("(could not read them: {e})"),
        }
    }

    async fn drop_slot(&self) -> Result<()> {
        self.client
            .execute(
                "SELECT pg_catalog.pg_drop_replication_slot($1)",
                &[&self.slot],
            )
            .await
            .map_err(src("dropping the invalidated replication slot"))?;
        Ok(())
    }

    /// Starts the replication stream after `start` (a transaction whose
    /// commit ends at or before `start` is not sent again).
    pub async fn start_stream(&mut self, start: PgLsn) -> Result<()> {
        self.wait_for_the_slot().await?;
        let replication = |source| Error::Connect {
            what: "source (replication)",
            source,
        };
        let cfg = PgUrl::parse(self.url.expose())
            .map_err(replication)?
            .replication_config(&self.slot, &self.publication)
            .await
            .map_err(replication)?
            .with_start_lsn(Lsn(start.as_u64()))
            .with_ack_lsn(Lsn(start.as_u64()))
            .with_status_interval(Duration::from_secs(1))
            .with_wakeup_interval(Duration::from_secs(1));
        let client = ReplicationClient::connect(cfg)
            .await
            .map_err(|source| Error::Replication { source })?;
        self.stream = Some(client);
        self.idle_upper = start;
        Ok(())
    }

    /// Reports `upper` to the slot as durably consumed. Call only after the
    /// marker holding `upper` is persisted.
    pub fn confirm_lsn(&self, upper: PgLsn) {
        if let Some(s) = &self.stream {
            s.update_applied_lsn(Lsn(upper.as_u64()));
        }
    }

    /// Reads whole transactions after `lower`: closes at the first commit at
    /// or past `max_changes`, when the stream has been quiet for `linger`
    /// after at least one transaction, or after `max_wait`.
    pub async fn read_transactions(
        &mut self,
        lower: PgLsn,
        max_changes: usize,
        linger: Duration,
        max_wait: Duration,
    ) -> Result<SourceBatch> {
        let stream = self
            .stream
            .as_mut()
            .ok_or_else(|| Error::Decode("the replication stream is not started".into()))?;
        let started = Instant::now();
        let mut txs: Vec<Tx> = vec![];
        let mut count = 0usize;
        let mut current: Option<Tx> = self.open_tx.take();
        loop {
            let waited = started.elapsed();
            let budget = if current.is_some() && txs.is_empty() {
                // A transaction is arriving: a batch never ends inside one.
                Duration::from_millis(100)
            } else if txs.is_empty() || current.is_some() {
                max_wait.saturating_sub(waited)
            } else {
                linger.min(max_wait.saturating_sub(waited))
            };
            if budget.is_zero() && current.is_none() && (txs.is_empty() || waited >= max_wait) {
                break;
            }
            // A zero budget after a transaction (no linger) still takes
            // what is ready now: a batch closes when nothing more is.
            let budget = if txs.is_empty() || current.is_some() {
                budget.max(Duration::from_millis(1))
            } else {
                budget
            };
            let ev = match tokio::time::timeout(budget, stream.recv()).await {
                Err(_) if current.is_some() && txs.is_empty() => continue,
                Err(_) => break,
                Ok(r) => r.map_err(|source| Error::Replication { source })?,
            };
            let Some(ev) = ev else {
                return Err(Error::Decode("the replication stream ended".into()));
            };
            match ev {
                ReplicationEvent::Begin {
                    final_lsn,
                    xid,
                    commit_time_micros,
                } => {
                    self.large.spill = None;
                    current = Some(Tx::begin(
                        xid,
                        PgLsn(final_lsn.0),
                        commit_time_micros + PG_EPOCH_OFFSET_MICROS,
                    ));
                }
                ReplicationEvent::Commit {
                    end_lsn,
                    commit_time_micros,
                    ..
                } => {
                    let mut tx = current
                        .take()
                        .ok_or_else(|| Error::Decode("pgoutput: commit without begin".into()))?;
                    tx.end_lsn = PgLsn(end_lsn.0);
                    tx.commit_time_micros = commit_time_micros + PG_EPOCH_OFFSET_MICROS;
                    count += tx.changes.len();
                    self.large.resumed(&tx)?;
                    let spilled = self.large.spill.take();
                    if tx.end_lsn > lower {
                        if !tx.truncated.is_empty()
                            && self.cfg.extractor.on_truncate == OnTruncate::Stop
                        {
                            let spilled_rows = spilled.as_ref().map_or(0, SpillWriter::count);
                            return Err(truncate_stop(&tx, spilled_rows));
                        }
                        if let Some(mut w) = spilled {
                            // Handed over in parts, after the transactions
                            // before it.
                            w.write(tx.take_changes())?;
                            info!(xid = tx.xid, end = %tx.end_lsn, changes = tx.before + w.count(),
                                "a large transaction committed; handing it over in parts");
                            self.draining = Some(Draining {
                                tx,
                                reader: w.finish()?,
                            });
                            break;
                        }
                        txs.push(tx);
                    }
                    if count >= max_changes {
                        break;
                    }
                }
                ReplicationEvent::XLogData { data, .. } => {
                    let msg = pgoutput::decode(&data)?;
                    if let Message::Relation(r) = &msg {
                        self.schema_changed |=
                            relation_changed(self.relations.get(&r.oid), r, &self.catalog);
                    }
                    handle(&mut self.relations, msg, current.as_mut())?;
                    if let Some(tx) = current.as_mut() {
                        self.large.absorb(tx, &self.by_table, max_changes)?;
                    }
                }
                ReplicationEvent::KeepAlive { wal_end, .. } if current.is_none() => {
                    self.idle_upper = self.idle_upper.max(PgLsn(wal_end.0));
                }
                ReplicationEvent::KeepAlive { .. } => {}
                ReplicationEvent::StoppedAt { .. } | ReplicationEvent::Message { .. } => {}
                #[allow(unreachable_patterns)]
                _ => {}
            }
        }
        self.open_tx = current;
        let mut upper = txs.last().map(|t| t.end_lsn).unwrap_or(lower);
        // A keepalive seen while no transaction was open says nothing more
        // for us committed before it: the marker may move there, which lets
        // the slot release WAL on an otherwise quiet publication.
        // Not while a large transaction is handed over, nor before the one
        // in flight at the last stop came back: the marker would forget
        // what was handed over of it.
        if self.open_tx.is_none()
            && self.draining.is_none()
            && self.large.resume.is_none()
            && self.idle_upper > upper
        {
            upper = self.idle_upper;
        }
        Ok(SourceBatch {
            lower,
            upper: upper.max(lower),
            txs,
            more: count >= max_changes || self.draining.is_some(),
        })
    }

    /// The next part of the large transaction being handed over.
    fn next_part(
        &mut self,
        lower: PgLsn,
        max_changes: usize,
    ) -> Result<Option<(SourceBatch, Option<InFlight>)>> {
        let Some(d) = self.draining.as_mut() else {
            return Ok(None);
        };
        let part = d.reader.read(max_changes.max(1))?;
        let mut tx = Tx {
            changes: vec![],
            unchanged: vec![],
            truncated: vec![],
            ..d.tx.clone()
        };
        for (i, c) in part.into_iter().enumerate() {
            if let Some(u) = c.unchanged {
                tx.unchanged.push((i, u));
            }
            tx.changes.push(c.change);
        }
        d.tx.before += tx.changes.len() as u64;
        d.tx.before_tracked =
            d.tx.before_tracked
                .saturating_add(count_tracked(&self.by_table, &tx.changes));
        let in_flight = (d.reader.remaining() > 0).then(|| InFlight {
            commit: d.tx.commit_lsn.into(),
            end: d.tx.end_lsn.into(),
            changes: d.tx.before,
            tracked: Some(d.tx.before_tracked),
            seqval: None,
        });
        if in_flight.is_none() {
            self.draining = None;
        }
        let upper = tx.end_lsn;
        Ok(Some((
            SourceBatch {
                lower,
                upper,
                txs: vec![tx],
                more: true,
            },
            in_flight,
        )))
    }

    /// Fills in, from the source by primary key, the key and join columns
    /// that updates sent as unchanged TOAST values with no before image to
    /// take them from (a table without REPLICA IDENTITY FULL, against what
    /// `skein sql source` prints).
    ///
    /// The value is read as the row is now. The update left it alone, and
    /// a later change that alters it is in the stream with its own images.
    /// A row deleted since resolves to no aggregate here (logged): its
    /// delete, later in the stream, is what touches its parent.
    pub async fn read_unchanged(&self, batch: &mut SourceBatch) -> Result<()> {
        // Per table: the columns to read, and the changes that need them.
        type Want = (Vec<String>, Vec<(usize, usize)>);
        let mut want: BTreeMap<(String, String), Want> = BTreeMap::new();
        for (ti, tx) in batch.txs.iter().enumerate() {
            for (ci, unknown) in &tx.unchanged {
                let ch = &tx.changes[*ci];
                let Some(targets) = self.by_table.get(&ch.table) else {
                    continue;
                };
                let needed: Vec<String> = targets
                    .iter()
                    .flat_map(|(pi, node)| {
                        let p = &self.plans[*pi];
                        if *node == 0 {
                            p.root_key.clone()
                        } else {
                            p.nodes[*node].on.iter().map(|o| o.name.clone()).collect()
                        }
                    })
                    .filter(|c| unknown.contains(c))
                    .collect();
                if needed.is_empty() {
                    continue;
                }
                let w = want.entry(ch.table.clone()).or_default();
                for c in needed {
                    if !w.0.contains(&c) {
                        w.0.push(c);
                    }
                }
                w.1.push((ti, *ci));
            }
        }
        for ((schema, table), (cols, at)) in want {
            let info = self
                .catalog
                .table(&schema, &table)
                .ok_or_else(|| Error::Decode(format!("{schema}.{table} is not in the catalog")))?;
            let key = &info.primary_key;
            let key_unknown: Vec<&String> = at
                .iter()
                .flat_map(|(ti, ci)| {
                    let img = batch.txs[*ti].changes[*ci].new.as_ref();
                    key.iter()
                        .filter(move |k| img.is_none_or(|i| !i.contains_key(*k)))
                })
                .collect();
            if key.is_empty() || !key_unknown.is_empty() {
                return Err(Error::NotReady {
                    message: format!(
                        "an update of {schema}.{table} sent its key {key:?} as unchanged TOAST \
                         values without the old key: skein cannot tell which row changed"
                    ),
                    fix: format!(
                        "ALTER TABLE \"{schema}\".\"{table}\" REPLICA IDENTITY FULL; \
                         (for changes already in the WAL: `skein marker` past them, then \
                         `skein explicit` for the affected entities)"
                    ),
                });
            }
            let arrays: Vec<Vec<Option<String>>> = key
                .iter()
                .map(|k| {
                    at.iter()
                        .map(|(ti, ci)| {
                            batch.txs[*ti].changes[*ci]
                                .new
                                .as_ref()
                                .and_then(|i| i.get(k).cloned().flatten())
                        })
                        .collect()
                })
                .collect();
            let params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> = arrays
                .iter()
                .map(|a| a as &(dyn tokio_postgres::types::ToSql + Sync))
                .collect();
            let sql = skein_sql::postgres::row_columns_sql(info, &cols);
            let rows = match self.client.query(&sql, &params).await {
                Ok(rows) => rows,
                Err(e) => {
                    let what = format!("reading unchanged TOAST values of {schema}.{table}");
                    return Err(self.explain(src(what)(e)).await);
                }
            };
            let mut found = vec![false; at.len()];
            for r in rows {
                let ord: i64 = r.get(0);
                let vals: Vec<Option<String>> = serde_json::from_str(r.get::<_, &str>(1))
                    .map_err(|e| Error::Decode(format!("unchanged TOAST values: {e}")))?;
                let i = usize::try_from(ord - 1)
                    .ok()
                    .filter(|i| *i < at.len() && vals.len() == cols.len())
                    .ok_or_else(|| Error::Decode(format!("bad TOAST lookup row {ord}")))?;
                found[i] = true;
                let (ti, ci) = at[i];
                if let Some(img) = batch.txs[ti].changes[ci].new.as_mut() {
                    img.extend(cols.iter().cloned().zip(vals));
                }
            }
            for (ti, ci) in at.iter().zip(&found).filter(|(_, f)| !**f).map(|(a, _)| a) {
                warn!(
                    table = %format!("{schema}.{table}"),
                    columns = ?cols,
                    "an update sent unchanged TOAST values and its row is gone: it resolves \
                     to no aggregate (its delete, later in the stream, does)"
                );
                if let Some(img) = batch.txs[*ti].changes[*ci].new.as_mut() {
                    img.extend(cols.iter().map(|c| (c.clone(), None)));
                }
            }
        }
        Ok(())
    }

    /// Resolves every change of a batch to change records, in source order,
    /// with one lookup query per (entity, table) for children whose root is
    /// not in their own columns.
    pub async fn resolve(&self, batch: &SourceBatch) -> Result<Vec<ChangeRecord>> {
        let mut res = BatchResolution::new_from(
            &self.plans,
            &self.by_table,
            self.cfg.transport.partitions(),
            batch
                .txs
                .iter()
                .map(|t| (t.changes.as_slice(), t.before_tracked)),
        )?;
        for gi in 0..res.lookups().len() {
            let g = &res.lookups()[gi];
            let plan = &self.plans[g.plan];
            let sql = resolve_sql(&plan.nodes, g.node, &self.catalog);
            let width = plan.nodes[g.node].on.len();
            let arrays: Vec<Vec<Option<String>>> = (0..width)
                .map(|c| g.values.iter().map(|v| v[c].clone()).collect())
                .collect();
            let params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> = arrays
                .iter()
                .map(|a| a as &(dyn tokio_postgres::types::ToSql + Sync))
                .collect();
            let rows = match self.client.query(&sql, &params).await {
                Ok(rows) => rows,
                Err(e) => {
                    let what = format!("resolving roots of {}", plan.nodes[g.node].qualified());
                    return Err(self.explain(src(what)(e)).await);
                }
            };
            let answers = rows
                .iter()
                .map(|r| {
                    let key: String = r.get(1);
                    RootKey::from_canonical(&key)
                        .map(|k| (r.get::<_, i64>(0), k))
                        .ok_or_else(|| Error::Decode(format!("bad root key from lookup: {key}")))
                })
                .collect::<Result<Vec<_>>>()?;
            res.answer(gi, answers)?;
        }
        let meta: Vec<TxMeta> = batch
            .txs
            .iter()
            .map(|t| TxMeta {
                position: t.end_lsn.into(),
                tx_id: u64::from(t.xid),
                commit_time_micros: t.commit_time_micros,
            })
            .collect();
        res.finish(&self.plans, &meta)
    }

    /// Reads the catalog again after a Relation message announced a
    /// changed table, checks the config against it and rebuilds the
    /// resolution plans from it. The key and join columns the plans use
    /// are what the publication carries, so a change the config cannot
    /// follow stops here, before the batch is resolved; the appliers check
    /// the whole config in their own snapshots (over Kafka they never see
    /// Relation messages).
    async fn follow_schema(&mut self) -> Result<()> {
        let now = load_catalog(&self.client, &self.cfg).await?;
        let problems = check_schema_change(&self.cfg, &self.catalog, &now);
        if !problems.is_empty() {
            let (message, fix) = schema_stop(&problems);
            return Err(Error::NotReady { message, fix });
        }
        let (plans, by_table) = crate::plans_for(&self.cfg, &now)?;
        if now != self.catalog {
            info!(changes = ?describe_change(&self.catalog, &now),
                "the source's schema changed; resolution follows it");
        }
        (self.plans, self.by_table, self.catalog) = (plans, by_table, now);
        self.schema_changed = false;
        Ok(())
    }

    /// A lookup that met a table or column that is not there (or an
    /// operator for a type that changed): the schema changed with no
    /// Relation message to say so (a table that left the publication with
    /// a `DROP COLUMN ... CASCADE`). When the catalog read now shows a
    /// change the config cannot follow, that is the error; otherwise `e`.
    async fn explain(&self, e: Error) -> Error {
        let Error::Source { source, .. } = &e else {
            return e;
        };
        let schema_like = [
            SqlState::UNDEFINED_COLUMN,
            SqlState::UNDEFINED_TABLE,
            SqlState::UNDEFINED_FUNCTION,
        ];
        if !source.code().is_some_and(|c| schema_like.contains(c)) {
            return e;
        }
        let Ok(now) = load_catalog(&self.client, &self.cfg).await else {
            return e;
        };
        let problems = check_schema_change(&self.cfg, &self.catalog, &now);
        if problems.is_empty() {
            return e;
        }
        let (message, fix) = schema_stop(&problems);
        Error::NotReady {
            message: format!("{message} ({e})"),
            fix,
        }
    }

    /// The catalog the plans are built from (read at connect time, again
    /// after a schema change).
    pub fn catalog(&self) -> &Catalog {
        &self.catalog
    }
}

impl ChangeSource for PgSource {
    fn label(&self) -> String {
        self.slot.clone()
    }

    async fn prepare(
        &mut self,
        marker: Option<SourcePosition>,
        floor: Option<SourcePosition>,
        continue_with_data_loss: bool,
    ) -> Result<StartPoint> {
        let marker = crate::marker_in(marker, SourcePosition::pg)?;
        let floor = if marker.is_none() {
            crate::marker_in(floor, SourcePosition::pg)?
        } else {
            None
        };
        self.prepare_slot(marker, floor, continue_with_data_loss)
            .await
    }

    async fn start(&mut self, from: SourcePosition, in_flight: Option<InFlight>) -> Result<()> {
        if let Some(f) = in_flight {
            f.commit
                .pg()
                .and(f.end.pg())
                .map_err(|e| Error::Decode(format!("the marker's transaction in flight: {e}")))?;
        }
        (self.open_tx, self.draining) = (None, None);
        self.large = Arriving {
            spill_dir: Some(spill::prepare_dir(&self.cfg.state_dir)?),
            spill: None,
            resume: in_flight,
        };
        self.start_stream(from.pg().map_err(|e| Error::Decode(e.to_string()))?)
            .await
    }

    async fn next_batch(
        &mut self,
        lower: SourcePosition,
        limits: BatchLimits,
    ) -> Result<ReadBatch> {
        let lower = lower.pg().map_err(|e| Error::Decode(e.to_string()))?;
        self.check_retention().await?;
        let mut in_flight = None;
        let mut batch = match self.next_part(lower, limits.max_changes)? {
            Some((part, f)) => {
                in_flight = f;
                part
            }
            None => {
                let batch = self
                    .read_transactions(lower, limits.max_changes, limits.linger, limits.max_wait)
                    .await?;
                if !batch.txs.is_empty() {
                    // A large transaction that committed after these is
                    // handed over from the next batch on.
                    batch
                } else if let Some((part, f)) = self.next_part(lower, limits.max_changes)? {
                    // A large transaction committed first thing.
                    in_flight = f;
                    part
                } else {
                    batch
                }
            }
        };
        if batch.upper <= lower {
            return Ok(ReadBatch::default());
        }
        if self.schema_changed {
            self.follow_schema().await?;
        }
        self.read_unchanged(&mut batch).await?;
        let records = self.resolve(&batch).await?;
        Ok(ReadBatch {
            upper: Some(batch.upper.into()),
            // A part that is not the last completes no transaction.
            transactions: if in_flight.is_some() {
                0
            } else {
                batch.txs.len()
            },
            changes: batch.change_count(),
            more: batch.more,
            records,
            in_flight,
        })
    }

    fn confirm(&mut self, upper: SourcePosition) {
        if let SourcePosition::Pg(l) = upper {
            self.confirm_lsn(l);
        }
    }
}

/// The error a transaction with a TRUNCATE stops the pipeline with: it
/// names no rows, so no aggregate can be resolved from it.
/// `spilled`: the transaction's changes written to disk (a large one).
fn truncate_stop(tx: &Tx, spilled: u64) -> Error {
    let rows = tx.before + spilled + tx.changes.len() as u64;
    // Each truncated table is one change of its own.
    let rows = rows.saturating_sub(tx.truncated.len() as u64);
    Error::NotReady {
        message: format!(
            "TRUNCATE of {} in transaction {} at position {}: a TRUNCATE names no rows, so skein \
             cannot tell which aggregates it removed",
            tx.truncated.join(", "),
            tx.xid,
            tx.end_lsn
        ),
        fix: format!(
            "skip the transaction (all of it: {} row changes besides the TRUNCATE) and record the loss, \
             with the pipeline stopped and the same --config:\n\
             skein marker reset --to {} --continue-with-data-loss\n\
             The aggregates of the truncated tables keep their last event until they change again. \
             To re-check them instead, set `extractor.on_truncate: recheck` (the default) \
             before the TRUNCATE reaches the stream; to keep TRUNCATE out of the stream, \
             publish only 'insert, update, delete' (what `skein sql source` prints with \
             `on_truncate: stop`).",
            rows,
            tx.end_lsn
        ),
    }
}

/// Whether a Relation message announces a table other than the one the
/// resolution plans were built for: its columns differ from its previous
/// announcement in this stream (added, dropped, retyped, key flags), or, at
/// its first announcement, it carries a column the catalog lacks.
fn relation_changed(previous: Option<&Relation>, now: &Relation, catalog: &Catalog) -> bool {
    match previous {
        Some(p) => p.columns != now.columns,
        None => catalog
            .table(&now.schema, &now.table)
            .is_some_and(|t| now.columns.iter().any(|c| t.column(&c.name).is_none())),
    }
}

/// Applies one decoded message to the relation cache or the open transaction.
fn handle(
    relations: &mut HashMap<u32, Relation>,
    msg: Message,
    mut tx: Option<&mut Tx>,
) -> Result<()> {
    {
        // Borrowed, not cloned: the relation is looked up for every row
        // change, and only read.
        fn rel(relations: &HashMap<u32, Relation>, oid: u32) -> Result<&Relation> {
            relations.get(&oid).ok_or_else(|| {
                Error::Decode(format!("pgoutput: change for unknown relation {oid}"))
            })
        }
        let change = match msg {
            Message::Relation(r) => {
                relations.insert(r.oid, r);
                return Ok(());
            }
            Message::Insert { oid, new } => {
                let r = rel(relations, oid)?;
                RawChange {
                    table: (r.schema.clone(), r.table.clone()),
                    op: Op::Insert,
                    old: None,
                    new: Some(pgoutput::image(r, new)),
                }
            }
            Message::Update { oid, old, new } => {
                let r = rel(relations, oid)?;
                let (after, unknown) = pgoutput::after_image(r, old.as_deref(), new);
                if let (Some(tx), false) = (tx.as_deref_mut(), unknown.is_empty()) {
                    tx.unchanged.push((tx.changes.len(), unknown));
                }
                RawChange {
                    table: (r.schema.clone(), r.table.clone()),
                    op: Op::Update,
                    old: old.map(|o| pgoutput::image(r, o)),
                    new: Some(after),
                }
            }
            Message::Delete { oid, old } => {
                let r = rel(relations, oid)?;
                RawChange {
                    table: (r.schema.clone(), r.table.clone()),
                    op: Op::Delete,
                    old: Some(pgoutput::image(r, old)),
                    new: None,
                }
            }
            Message::Truncate { oids } => {
                let tx = tx.ok_or_else(|| {
                    Error::Decode("pgoutput: TRUNCATE outside a transaction".into())
                })?;
                // `on_truncate: stop` stops at the commit, where the
                // transaction's position is known; `recheck` resolves each
                // truncated table in its place among the row changes.
                for o in &oids {
                    match relations.get(o) {
                        Some(r) => {
                            tx.truncated.push(format!("{}.{}", r.schema, r.table));
                            tx.changes.push(RawChange {
                                table: (r.schema.clone(), r.table.clone()),
                                op: Op::Truncate,
                                old: None,
                                new: None,
                            });
                        }
                        None => tx.truncated.push(format!("relation {o}")),
                    }
                }
                return Ok(());
            }
            Message::Other(_) => return Ok(()),
        };
        match tx {
            Some(tx) => {
                tx.changes.push(change);
                Ok(())
            }
            None => Err(Error::Decode(
                "pgoutput: row change outside a transaction".into(),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use skein_sql::{ColumnInfo, TableInfo};

    use super::*;
    use crate::pgoutput::RelColumn;

    fn change(table: &str) -> RawChange {
        RawChange {
            table: ("public".into(), table.into()),
            op: Op::Insert,
            old: None,
            new: Some(Default::default()),
        }
    }

    #[test]
    fn a_resumed_transaction_numbers_on_from_what_the_marker_says() {
        let by_table: TableIndex = [(("public".to_string(), "customer".to_string()), vec![(0, 0)])]
            .into_iter()
            .collect();
        let mut arriving = Arriving {
            resume: Some(InFlight {
                commit: PgLsn(100).into(),
                end: PgLsn(120).into(),
                changes: 3,
                // Numbered under a config that tracked more than this one.
                tracked: Some(9),
                seqval: None,
            }),
            ..Arriving::default()
        };
        let mut tx = Tx::begin(7, PgLsn(100), 0);
        for t in ["customer", "audit", "customer", "customer"] {
            tx.changes.push(change(t));
            if t == "audit" {
                tx.unchanged.push((tx.changes.len() - 1, vec!["x".into()]));
            }
            arriving.absorb(&mut tx, &by_table, 1000).unwrap();
        }
        assert_eq!((tx.before, tx.before_tracked), (3, 9));
        assert_eq!(tx.changes.len(), 1, "the fourth change is kept");
        assert!(
            tx.unchanged.is_empty(),
            "the skipped change's TOAST note went with it"
        );
        tx.end_lsn = PgLsn(120);
        arriving.resumed(&tx).unwrap();
        assert!(arriving.resume.is_none());
        // Without the stored count, the tracked changes skipped are counted.
        let mut arriving = Arriving {
            resume: Some(InFlight {
                commit: PgLsn(100).into(),
                end: PgLsn(120).into(),
                changes: 3,
                tracked: None,
                seqval: None,
            }),
            ..Arriving::default()
        };
        let mut tx = Tx::begin(7, PgLsn(100), 0);
        for t in ["customer", "audit", "customer"] {
            tx.changes.push(change(t));
            arriving.absorb(&mut tx, &by_table, 1000).unwrap();
        }
        assert_eq!((tx.before, tx.before_tracked), (3, 2));
        // A transaction that comes back different is an error, not a guess.
        tx.end_lsn = PgLsn(121);
        assert!(arriving.resumed(&tx).is_err());
    }

    fn rel(cols: &[(&str, u32)]) -> Relation {
        Relation {
            oid: 7,
            schema: "public".into(),
            table: "address".into(),
            columns: cols
                .iter()
                .map(|(n, t)| RelColumn {
                    name: (*n).into(),
                    is_key: *n == "id",
                    type_oid: *t,
                })
                .collect(),
        }
    }

    #[test]
    fn a_relation_is_changed_when_its_columns_differ_from_what_the_plans_know() {
        let mut catalog = Catalog::default();
        catalog.insert(TableInfo {
            schema: "public".into(),
            table: "address".into(),
            columns: ["id", "customer_id"]
                .into_iter()
                .map(|n| ColumnInfo {
                    name: n.into(),
                    data_type: "integer".into(),
                    type_name: "int4".into(),
                    nullable: false,
                })
                .collect(),
            primary_key: vec!["id".into()],
            replica_identity: 'f',
        });
        let first = rel(&[("id", 23), ("customer_id", 23)]);
        // The first announcement: only a column the catalog lacks counts.
        assert!(!relation_changed(None, &first, &catalog));
        let added = rel(&[("id", 23), ("customer_id", 23), ("zip", 25)]);
        assert!(relation_changed(None, &added, &catalog));
        // Announced again (after any invalidation): only a difference counts.
        assert!(!relation_changed(Some(&first), &first, &catalog));
        assert!(relation_changed(Some(&first), &added, &catalog));
        assert!(relation_changed(
            Some(&first),
            &rel(&[("id", 23), ("customer_id", 25)]),
            &catalog
        ));
        assert!(relation_changed(
            Some(&first),
            &rel(&[("id", 23)]),
            &catalog
        ));
    }
}
