//! Hydration: the latest state of a batch of aggregates, one query per table
//! of the entity per batch (never one per key), nested into entity JSON.
//!
//! The applier reads through [`Source`], whatever the dialect. PostgreSQL
//! builds each row's JSON in the query (formats fixed on every connection
//! by [`skein_sql::postgres::client::SESSION_FORMATS`]); SQL Server returns typed columns that
//! [`SqlValue`] turns into the same JSON formats, so an aggregate's etag does
//! not depend on where it lives.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use tracing::warn;

use crate::connect_postgres;
use serde_json::{Map, Value};
use skein_common::config::{self, Cardinality, Config, EntityConfig, JoinType, TableNode};
use skein_common::failpoint::failpoint;
use skein_common::sqlvalue::SqlValue;
use skein_common::{Dialect, RootKey};
use skein_sql::postgres::catalog::read_catalog;
use skein_sql::postgres::{hydrate_sql, lock_tables_sql, referenced_columns, schema_stop_with};
use skein_sql::sqlserver::MssqlClient;
use skein_sql::{sqlserver, Catalog};
use tokio_postgres::error::SqlState;

use crate::decide::{Current, DeletePayload};
use crate::error::{db, Error, Result};

/// The source database as the applier sees it: something that answers
/// "the latest state of these aggregates".
pub enum Source {
    /// PostgreSQL (its session formats fixed as on every connection,
    /// [`skein_sql::postgres::client::SESSION_FORMATS`]); `in_snapshot` while a
    /// batch's read-only snapshot transaction is open.
    Postgres {
        /// The connection.
        client: tokio_postgres::Client,
        /// A snapshot transaction is open.
        in_snapshot: bool,
        /// Every table of the config, `(schema, table)`: locked in each
        /// snapshot, their catalog read in it.
        tables: Vec<(String, String)>,
        /// The statements every batch runs, prepared once.
        statements: Box<crate::Statements>,
    },
    /// SQL Server (boxed: the TDS client carries its buffers).
    SqlServer(Box<MssqlClient>),
}

/// Opens the snapshot a batch's hydration reads in.
pub const BEGIN_SNAPSHOT: &str = "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY";

/// Up to this many keys a batch's hydration queries run on the generic
/// plans of their prepared statements; above it each is planned for its
/// keys. A generic plan counts an array parameter's `unnest` as 100 rows
/// and joins by index, which is right for a few keys and saves planning
/// the queries in every small batch (the live case: more than half of a
/// small batch's time on a 2-core machine); a custom plan sees the array's
/// length and joins a backlog batch's thousands of keys by hash, in half
/// the time.
pub const GENERIC_PLAN_KEYS: usize = 100;

/// The plan choice of a snapshot hydrating `keys` root keys
/// ([`GENERIC_PLAN_KEYS`]), for the snapshot's transaction only.
pub fn plan_mode_sql(keys: usize) -> &'static str {
    if keys <= GENERIC_PLAN_KEYS {
        "SET LOCAL plan_cache_mode = force_generic_plan"
    } else {
        "SET LOCAL plan_cache_mode = force_custom_plan"
    }
}

/// How long a batch waits for its source transactions to become visible
/// before it fails (and is retried by a restart).
const VISIBILITY_WAIT: Duration = Duration::from_secs(60);

/// Of the 32-bit transaction ids `$1` (from the change stream, all
/// committed), those the snapshot does not see yet. The snapshot is the
/// transaction's (`$2`, as `pg_snapshot` text, replaces it in tests).
///
/// A 32-bit id is widened to the `xid8` of the epoch that puts it at or
/// below the next id to be assigned (`$3` replaces it in tests): not below
/// the snapshot's `xmax`, which is only the last *completed* id + 1, while
/// a transaction already streamed but not yet visible can be above it.
/// `age(xid)` gives the next id without assigning one (the transaction is
/// read-only). An id that would widen below 0 is not of this cluster's
/// history (records from before a restore): it counts as seen, never
/// waited for.
pub const UNSEEN_XIDS_SQL: &str = "\
WITH s AS (SELECT coalesce($2::text::pg_snapshot, pg_current_snapshot()) AS snap),
m AS (SELECT snap, pg_snapshot_xmax(snap)::text::numeric AS xmax FROM s),
n AS (SELECT snap, coalesce($3::text::numeric, xmax + age((xmax % 4294967296)::text::xid)) AS nxt FROM m),
w AS (SELECT snap, v, floor(nxt / 4294967296) * 4294967296 + v AS c, nxt FROM n, unnest($1::int8[]) AS v),
x AS (SELECT snap, v, CASE WHEN c > nxt THEN c - 4294967296 ELSE c END AS full_id FROM w)
SELECT coalesce(array_agg(v ORDER BY v), '{}') FROM x
WHERE full_id >= 0 AND NOT pg_visible_in_snapshot(full_id::text::xid8, snap)";

/// The open snapshot's text, and whether it cannot be trusted as a cut of
/// the commit order ([`Opened::snapshot`]): on a hot standby, or while
/// synchronous replication is configured. A commit waiting for a
/// synchronous standby is decoded and in the commit log, but other
/// sessions count it as running until the standby answers, however long
/// that takes, while later commits that do not wait (`synchronous_commit`
/// is per session) are visible. `pg_xact_status` cannot tell such a
/// commit from a running transaction (it asks the process array first).
pub const CLEAN_SNAPSHOT_SQL: &str = "\
SELECT s::text, pg_is_in_recovery() OR current_setting('synchronous_standby_names') <> ''
FROM pg_current_snapshot() AS s";

/// What [`Source::begin_snapshot`] read in the snapshot it opened. An
/// error here leaves the snapshot open: end it before returning it.
pub struct Opened {
    /// The catalog of the config's tables as the snapshot sees it
    /// ([`Source::catalog`]).
    pub catalog: Result<Option<Catalog>>,
    /// The snapshot as `pg_snapshot` text (`xmin:xmax:xip,…`), for
    /// [`crate::coverage`], when asked for and when it can be taken for a
    /// cut of the commit order: `None` while synchronous replication is
    /// configured (a commit waiting for the standby stays invisible while
    /// later ones are visible, so the snapshot may see a change whose
    /// effect on an aggregate depends on one it does not see), on a hot
    /// standby (whose snapshots list no running ids), and on SQL Server,
    /// where no snapshot spans a batch's reads ([`CLEAN_SNAPSHOT_SQL`]).
    pub snapshot: Result<Option<String>>,
    /// No later than the snapshot was taken.
    pub taken: Instant,
}

impl Source {
    /// Connects to the configured source for reading state.
    pub async fn connect(cfg: &Config) -> Result<Source> {
        match &cfg.source {
            config::Source::Postgres(pg) => {
                let client = connect_postgres(pg.url.expose(), "source").await?;
                Ok(Source::Postgres {
                    client,
                    in_snapshot: false,
                    tables: cfg.tables(),
                    statements: Box::default(),
                })
            }
            config::Source::SqlServer(ms) => Ok(Source::SqlServer(Box::new(
                MssqlClient::connect(ms.url.expose()).await?,
            ))),
        }
    }

    /// A page of the entity's root keys, in key order, for an explicit run
    /// ([`crate::explicit`]): at most `limit`, after `after` (from the first
    /// when `None`), those matching the operator's `filter` on the root when
    /// given, each key the text the change stream sends for the same row.
    ///
    /// What the filter's SQL writes does not stay. PostgreSQL reads the
    /// page in a `READ ONLY` transaction. SQL Server has no read-only
    /// transactions: it reads the page in a transaction that is always
    /// rolled back. (T-SQL runs several statements in one request, so a
    /// filter text that ends that transaction itself, `1=1; COMMIT; …`,
    /// escapes it; the filter is the operator's SQL, trusted as the config
    /// is.)
    pub async fn root_keys(
        &mut self,
        root: &TableNode,
        catalog: &Catalog,
        filter: Option<&str>,
        after: Option<&RootKey>,
        limit: i64,
    ) -> Result<Vec<RootKey>> {
        match self {
            Source::Postgres { client, .. } => {
                let sql =
                    skein_sql::postgres::explicit_keys_sql(root, catalog, filter, after.is_some());
                let mut params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> = vec![];
                if let Some(k) = after {
                    for v in &k.0 {
                        params.push(v);
                    }
                }
                params.push(&limit);
                let tx = client
                    .build_transaction()
                    .read_only(true)
                    .start()
                    .await
                    .map_err(db("beginning the explicit key read"))?;
                let rows = tx
                    .query(sql.as_str(), &params)
                    .await
                    .map_err(db(format!("selecting keys of {}", root.qualified())))?;
                tx.commit()
                    .await
                    .map_err(db("ending the explicit key read"))?;
                Ok(rows
                    .iter()
                    .map(|r| RootKey((0..r.len()).map(|i| r.get(i)).collect()))
                    .collect())
            }
            Source::SqlServer(client) => {
                let sql = sqlserver::explicit_keys_sql(root, catalog, filter, after.is_some());
                let mut params: Vec<&dyn tiberius::ToSql> = vec![];
                if let Some(k) = after {
                    for v in &k.0 {
                        params.push(v);
                    }
                }
                params.push(&limit);
                let mut tx = client
                    .transaction("beginning the explicit key read")
                    .await?;
                let rows = tx
                    .query(
                        &format!("selecting keys of {}", root.qualified()),
                        &sql,
                        &params,
                    )
                    .await;
                // Whatever the filter did, none of it stays.
                tx.rollback().await;
                Ok(rows?
                    .iter()
                    .map(|r| sqlserver::decode::root_key(r))
                    .collect())
            }
        }
    }

    /// Given root keys as the source prints them (`01` → `1`, what the
    /// stream and the version table use), so one aggregate is one key
    /// whatever the operator typed; a value that is no value of the key
    /// column's type is an error. SQL Server: as given (not normalised).
    pub async fn normalize_keys(
        &mut self,
        root: &TableNode,
        catalog: &Catalog,
        keys: &[RootKey],
    ) -> Result<Vec<RootKey>> {
        match self {
            Source::Postgres { client, .. } => {
                let arrays = key_arrays(keys, catalog.key_columns(root).len());
                let params = as_params(&arrays);
                let rows = client
                    .query(
                        &skein_sql::postgres::normalize_keys_sql(root, catalog),
                        &params,
                    )
                    .await
                    .map_err(db(format!(
                        "reading the given keys as keys of {}",
                        root.qualified()
                    )))?;
                Ok(rows
                    .iter()
                    .map(|r| RootKey((0..r.len()).map(|i| r.get(i)).collect()))
                    .collect())
            }
            Source::SqlServer(_) => Ok(keys.to_vec()),
        }
    }

    /// The dialect.
    pub fn dialect(&self) -> Dialect {
        match self {
            Source::Postgres { .. } => Dialect::Postgres,
            Source::SqlServer(_) => Dialect::SqlServer,
        }
    }

    /// Starts the one snapshot a batch's hydration reads: PostgreSQL,
    /// a `REPEATABLE READ READ ONLY` transaction (one a batch that failed
    /// midway may have left open, or whose COMMIT it sent without reading
    /// the reply, is rolled back first, never read on: a no-op then) that first
    /// takes `ACCESS SHARE` locks on every table of the config, then a
    /// snapshot that sees every source transaction in `xids` (the batch's).
    /// The locks come before the snapshot, so no `ALTER TABLE` of those
    /// tables commits while the batch reads them (it waits for the
    /// snapshot to end): the catalog read in the snapshot
    /// ([`Opened::catalog`]) is the one every hydration query runs against, and a table
    /// rewrite (which older snapshots see as empty) cannot land between
    /// two tables' reads. The
    /// change stream carries a commit once its WAL is flushed, a moment
    /// before other sessions see it (longer under load, or while the
    /// commit waits for a synchronous standby): hydrating then would read
    /// the state before it and publish nothing for it, so the snapshot is
    /// taken again, after a pause, until it sees them all. SQL Server:
    /// nothing yet — each table is read by its own statement at the
    /// database's isolation level (the README says what that gives).
    ///
    /// `keys`, the number of root keys the snapshot will hydrate, chooses
    /// how its queries are planned ([`plan_mode_sql`]).
    ///
    /// What every batch reads before hydrating goes out with the opening
    /// statements in one pipelined round trip, in this order: the
    /// transaction and its locks, the visibility check of `xids` (the
    /// statement that takes the snapshot), the catalog of the config's
    /// tables as the snapshot sees it (PostgreSQL reads its own table
    /// list; `tables` is SQL Server's), and, when `with_snapshot`, the
    /// snapshot's text ([`Opened::snapshot`]). When the transaction or the
    /// check fails, or the check finds a transaction not visible yet, the
    /// reads behind them have run but their answers are dropped (a try
    /// taken again reads them again). SQL Server: the catalog of `tables`,
    /// read on its own (no snapshot spans a batch's reads there).
    ///
    /// An error opening the snapshot is returned; an error of the reads
    /// in it is in [`Opened`], so the caller ends the snapshot first.
    pub async fn begin_snapshot(
        &mut self,
        xids: &[u64],
        keys: usize,
        tables: &[(String, String)],
        with_snapshot: bool,
    ) -> Result<Opened> {
        match self {
            Source::Postgres {
                client,
                in_snapshot,
                tables,
                statements,
            } => {
                let xids: Vec<i64> = xids.iter().map(|x| *x as i64).collect();
                let lock = format!("{}; {}", plan_mode_sql(keys), lock_tables_sql(tables));
                if *in_snapshot {
                    // Left open (aborted, perhaps) by a batch that failed:
                    // a statement prepared in it would fail too.
                    client
                        .batch_execute("ROLLBACK")
                        .await
                        .map_err(db("ending a snapshot a failed batch left open"))?;
                    *in_snapshot = false;
                }
                // Prepared once per connection (the first batch only).
                let check = "checking the snapshot sees the batch's transactions";
                let unseen_sql = statements.prepared(client, UNSEEN_XIDS_SQL, check).await?;
                let catalog_what = "reading the catalog in the hydration snapshot";
                let catalog_sql = statements
                    .prepared(client, skein_sql::postgres::CATALOG_QUERY, catalog_what)
                    .await?;
                let snapshot_what = "reading the hydration snapshot";
                let snapshot_sql = match with_snapshot {
                    true => Some(
                        statements
                            .prepared(client, CLEAN_SNAPSHOT_SQL, snapshot_what)
                            .await?,
                    ),
                    false => None,
                };
                let started = Instant::now();
                let mut pause = Duration::from_millis(5);
                loop {
                    let sql = if *in_snapshot {
                        format!("ROLLBACK; {BEGIN_SNAPSHOT}; {lock}")
                    } else {
                        format!("{BEGIN_SNAPSHOT}; {lock}")
                    };
                    let taken = Instant::now();
                    let client = &*client;
                    // Each request is sent when first polled, and `join4`
                    // polls them in this order: they run in this order.
                    let (opened, unseen, catalog, snapshot) = futures_util::future::join4(
                        client.batch_execute(&sql),
                        async {
                            match xids.is_empty() {
                                true => Ok(None),
                                false => client
                                    .query_one(
                                        &unseen_sql,
                                        &[&xids, &None::<String>, &None::<String>],
                                    )
                                    .await
                                    .map(Some),
                            }
                        },
                        read_catalog(client, &catalog_sql, tables),
                        async {
                            match &snapshot_sql {
                                Some(s) => client.query_one(s, &[]).await.map(Some),
                                None => Ok(None),
                            }
                        },
                    )
                    .await;
                    // Even a failed LOCK leaves the transaction open (aborted).
                    *in_snapshot = true;
                    if let Err(e) = &opened {
                        // Taking the locks waited on a DDL transaction that
                        // then waited on them (it altered two of the tables
                        // in another order): PostgreSQL broke the cycle
                        // here; nothing was read, so take them again.
                        if e.code() == Some(&SqlState::T_R_DEADLOCK_DETECTED)
                            && started.elapsed() < VISIBILITY_WAIT
                        {
                            warn!(error = %e, "locking the source tables met a schema change; trying again");
                            tokio::time::sleep(pause).await;
                            pause = (pause * 2).min(Duration::from_secs(1));
                            continue;
                        }
                    }
                    opened.map_err(|e| match e.code() {
                        Some(&SqlState::UNDEFINED_TABLE) => {
                            let (message, fix) = schema_stop_with(
                                vec![format!("a table of the config is gone ({e})")],
                                vec!["create the table again, or take it out of the config".into()],
                            );
                            Error::Schema { message, fix }
                        }
                        _ => db("opening the hydration snapshot")(e),
                    })?;
                    let unseen: Vec<i64> = match unseen.map_err(db(check))? {
                        Some(row) => row.get(0),
                        None => vec![],
                    };
                    if unseen.is_empty() {
                        return Ok(Opened {
                            catalog: catalog.map(Some).map_err(db(catalog_what)),
                            snapshot: snapshot.map_err(db(snapshot_what)).map(|row| {
                                row.and_then(|row| {
                                    let untrusted: bool = row.get(1);
                                    (!untrusted).then(|| row.get(0))
                                })
                            }),
                            taken,
                        });
                    }
                    let waited = started.elapsed();
                    if waited >= VISIBILITY_WAIT {
                        return Err(Error::Data(format!(
                            "source transactions {unseen:?} are in the change stream but still not \
                             visible to other sessions after {waited:?} (a commit waiting for a \
                             synchronous standby that is away?); the batch is not applied"
                        )));
                    }
                    // Not read on: the next try takes a new snapshot.
                    client
                        .batch_execute("ROLLBACK")
                        .await
                        .map_err(db("closing a snapshot taken too early"))?;
                    *in_snapshot = false;
                    if pause >= Duration::from_millis(200) {
                        warn!(xids = ?unseen, waited_ms = waited.as_millis() as u64,
                            "waiting for committed source transactions to become visible");
                    }
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_secs(1));
                }
            }
            Source::SqlServer(client) => Ok(Opened {
                catalog: skein_sql::sqlserver::read_catalog(client, tables)
                    .await
                    .map(Some)
                    .map_err(Error::from),
                snapshot: Ok(None),
                taken: Instant::now(),
            }),
        }
    }

    /// The catalog of the config's tables now (PostgreSQL, from its own
    /// table list; SQL Server, of `tables`), outside a batch: `skein
    /// explicit` checks its keys against it. A batch reads the catalog in
    /// its snapshot ([`Source::begin_snapshot`]). Always `Some` today.
    pub async fn catalog(&mut self, tables: &[(String, String)]) -> Result<Option<Catalog>> {
        match self {
            Source::Postgres {
                client,
                tables,
                statements,
                ..
            } => {
                let what = "reading the catalog in the hydration snapshot";
                let query = statements
                    .prepared(client, skein_sql::postgres::CATALOG_QUERY, what)
                    .await?;
                read_catalog(client, &query, tables)
                    .await
                    .map(Some)
                    .map_err(db(what))
            }
            Source::SqlServer(client) => Ok(Some(
                skein_sql::sqlserver::read_catalog(client, tables).await?,
            )),
        }
    }

    /// The catalog of the given `tables`, outside any snapshot (for
    /// start-up checks of tables the config names but does not read).
    pub async fn catalog_of(&mut self, tables: &[(String, String)]) -> Result<Catalog> {
        match self {
            Source::Postgres { client, .. } => {
                read_catalog(client, skein_sql::postgres::CATALOG_QUERY, tables)
                    .await
                    .map_err(db("reading the catalog of the mapped tables"))
            }
            Source::SqlServer(client) => {
                Ok(skein_sql::sqlserver::read_catalog(client, tables).await?)
            }
        }
    }

    /// Ends the batch's snapshot (it only read: committing releases it).
    pub async fn end_snapshot(&mut self) -> Result<()> {
        match self {
            Source::Postgres {
                client,
                in_snapshot,
                ..
            } => {
                client
                    .batch_execute("COMMIT")
                    .await
                    .map_err(db("closing the hydration snapshot"))?;
                *in_snapshot = false;
                Ok(())
            }
            Source::SqlServer(_) => Ok(()),
        }
    }
}

/// Precomputed queries and shapes for one entity.
#[derive(Clone, Debug)]
pub struct EntityHydrator {
    entity: EntityConfig,
    nodes: Vec<TableNode>,
    sql: Vec<String>,
    dialect: Dialect,
    /// SQL Server: per node, the names of the referenced (`ref_*`) and
    /// event columns, in query order.
    shapes: Vec<(Vec<String>, Vec<String>)>,
    root_key: Vec<String>,
    root_key_types: Vec<String>,
    /// Per node: it or a node below it excludes columns from the etag, so
    /// its rows carry a hash input apart from their data.
    etag_apart: Vec<bool>,
}

/// Per node of `nodes`: whether it or a node below it has
/// `exclude_columns_from_etag` (a child's index is above its parent's).
fn etag_apart(nodes: &[TableNode]) -> Vec<bool> {
    let mut apart: Vec<bool> = nodes
        .iter()
        .map(|n| !n.exclude_columns_from_etag.is_empty())
        .collect();
    for i in (1..nodes.len()).rev() {
        if apart[i] {
            apart[nodes[i].parent.unwrap_or(0)] = true;
        }
    }
    apart
}

/// A row's hash input when it is kept apart from its data: the data
/// without the node's `exclude_columns_from_etag`.
fn etag_part(apart: bool, data: &Value, exclude: &[String]) -> Option<Value> {
    if !apart {
        return None;
    }
    let mut input = data.clone();
    if let Value::Object(m) = &mut input {
        for c in exclude {
            m.remove(c);
        }
    }
    Some(input)
}

/// One hydrated row of a node.
struct Row {
    ord: i64,
    link: Vec<Option<String>>,
    refs: HashMap<String, Option<String>>,
    data: Value,
    /// The hash input where it is not `data` ([`etag_part`]).
    etag_input: Option<Value>,
    is_deleted: bool,
    /// An `inner` lookup join of this row found no row: it is left out.
    excluded: bool,
}

impl EntityHydrator {
    /// Renders the entity's queries once.
    pub fn new(entity: &EntityConfig, catalog: &Catalog, dialect: Dialect) -> EntityHydrator {
        let nodes = entity.nodes();
        let sql = (0..nodes.len())
            .map(|i| match dialect {
                Dialect::Postgres => hydrate_sql(entity, &nodes, i, catalog),
                Dialect::SqlServer => sqlserver::hydrate_sql(&nodes, i, catalog),
            })
            .collect();
        let shapes = (0..nodes.len())
            .map(|i| {
                (
                    referenced_columns(&nodes, i),
                    catalog
                        .event_columns(&nodes[i])
                        .iter()
                        .map(|c| c.name.clone())
                        .collect(),
                )
            })
            .collect();
        let root_key = catalog.key_columns(&nodes[0]);
        let root_key_types = root_key
            .iter()
            .map(|c| {
                catalog
                    .node(&nodes[0])
                    .and_then(|t| t.column(c))
                    .map(|c| c.type_name.clone())
                    .unwrap_or_default()
            })
            .collect();
        EntityHydrator {
            entity: entity.clone(),
            etag_apart: etag_apart(&nodes),
            nodes,
            sql,
            dialect,
            shapes,
            root_key,
            root_key_types,
        }
    }

    /// The entity config.
    pub fn entity(&self) -> &EntityConfig {
        &self.entity
    }

    /// The SQL run for each node (root first), for logs and golden tests.
    pub fn queries(&self) -> &[String] {
        &self.sql
    }

    /// What a delete of `key` carries: the key as typed JSON plus the
    /// configured `include_columns_on_delete`.
    pub fn delete_payload(&self, key: &RootKey) -> DeletePayload {
        let mut key_data = Map::new();
        for ((col, ty), v) in self.root_key.iter().zip(&self.root_key_types).zip(&key.0) {
            key_data.insert(col.clone(), typed_key_value(ty, v.as_deref()));
        }
        DeletePayload {
            key_data,
            include_columns_on_delete: self.entity.include_columns_on_delete.clone(),
        }
    }

    /// Reads the current state of every key, in the order given.
    pub async fn hydrate(&self, source: &mut Source, keys: &[RootKey]) -> Result<Vec<Current>> {
        if keys.is_empty() {
            return Ok(vec![]);
        }
        if source.dialect() != self.dialect {
            return Err(Error::Data(format!(
                "entity `{}` was prepared for {:?} but the source is {:?}",
                self.entity.name,
                self.dialect,
                source.dialect()
            )));
        }
        match source {
            Source::Postgres {
                client, statements, ..
            } => self.hydrate_pg(client, statements, keys).await,
            Source::SqlServer(client) => self.hydrate_mssql(client, keys).await,
        }
    }

    async fn hydrate_mssql(
        &self,
        client: &mut MssqlClient,
        keys: &[RootKey],
    ) -> Result<Vec<Current>> {
        let width = self.root_key.len();
        let what = format!("hydrating {}", self.entity.name);
        let tuples: Vec<Vec<Option<String>>> = keys
            .iter()
            .map(|k| (0..width).map(|c| k.0.get(c).cloned().flatten()).collect())
            .collect();
        client
            .fill_temp_table(
                &what,
                &sqlserver::keys_table_sql(width),
                &tuples,
                sqlserver::keys_per_insert(width),
                |rows| sqlserver::keys_insert_sql(width, rows),
            )
            .await?;
        let mut per_node: Vec<Vec<Row>> = Vec::with_capacity(self.nodes.len());
        for (i, sql) in self.sql.iter().enumerate() {
            if i == 1 {
                failpoint("applier.hydrate.between_tables");
            }
            let node = &self.nodes[i];
            let rows = client
                .query(&format!("hydrating {}", node.qualified()), sql, &[])
                .await?;
            let (refs, cols) = &self.shapes[i];
            let out = rows
                .into_iter()
                .map(|r| self.mssql_row(i, refs, cols, r))
                .collect::<Result<Vec<_>>>()?;
            per_node.push(out);
        }
        Ok(assemble(&self.nodes, per_node, keys.len()))
    }

    /// One SQL Server hydration row: `ord`, (root: `found`), `link_*`,
    /// `ref_*`, then the event columns.
    fn mssql_row(
        &self,
        i: usize,
        refs: &[String],
        cols: &[String],
        r: Vec<SqlValue>,
    ) -> Result<Row> {
        let node = &self.nodes[i];
        let fixed = 1 + usize::from(i == 0) + node.on.len() + refs.len();
        if r.len() != fixed + cols.len() {
            return Err(Error::Data(format!(
                "{}: expected {} columns from the hydration query, got {}",
                node.qualified(),
                fixed + cols.len(),
                r.len()
            )));
        }
        let ord = match &r[0] {
            SqlValue::Int(o) => *o,
            other => return Err(Error::Data(format!("hydration ord: {other:?}"))),
        };
        let mut at = 1;
        let found = if i == 0 {
            at += 1;
            matches!(r[1], SqlValue::Int(1))
        } else {
            true
        };
        let link = r[at..at + node.on.len()]
            .iter()
            .map(SqlValue::to_text)
            .collect();
        at += node.on.len();
        let ref_map = refs
            .iter()
            .zip(&r[at..at + refs.len()])
            .map(|(n, v)| (n.clone(), v.to_text()))
            .collect();
        at += refs.len();
        let (data, etag_input, is_deleted) = if found {
            let mut m = Map::new();
            for (n, v) in cols.iter().zip(&r[at..]) {
                m.insert(n.clone(), v.to_json());
            }
            let is_deleted = match (i, &self.entity.is_deleted_column) {
                (0, Some(c)) => truthy(m.get(c)),
                _ => false,
            };
            let data = Value::Object(m);
            let etag_input = etag_part(self.etag_apart[i], &data, &node.exclude_columns_from_etag);
            (data, etag_input, is_deleted)
        } else {
            (Value::Null, None, false)
        };
        Ok(Row {
            ord,
            link,
            refs: ref_map,
            data,
            etag_input,
            is_deleted,
            excluded: false,
        })
    }

    async fn hydrate_pg(
        &self,
        client: &tokio_postgres::Client,
        statements: &mut crate::Statements,
        keys: &[RootKey],
    ) -> Result<Vec<Current>> {
        let arrays = key_arrays(keys, self.root_key.len());
        let params = as_params(&arrays);
        // The context is built only on a failure: this runs per table per
        // batch.
        let what = |i: usize| format!("hydrating {}", self.nodes[i].qualified());
        let mut queries = Vec::with_capacity(self.sql.len());
        for (i, sql) in self.sql.iter().enumerate() {
            queries.push(
                statements
                    .get(client, sql)
                    .await
                    .map_err(|e| db(what(i))(e))?,
            );
        }
        // Every table in one pipelined round trip: tokio-postgres sends each
        // query as its future is first polled, so they are all on the wire
        // before the first answer is read. The snapshot was taken before
        // (the catalog read is the transaction's first statement or later).
        if queries.len() > 1 {
            // Tests stall here to commit a change between the snapshot and
            // the tables' reads.
            failpoint("applier.hydrate.between_tables");
        }
        let answers =
            futures_util::future::try_join_all(queries.iter().enumerate().map(|(i, q)| {
                let params = &params;
                async move { client.query(q, params).await.map_err(|e| db(what(i))(e)) }
            }))
            .await?;
        let mut per_node: Vec<Vec<Row>> = Vec::with_capacity(self.nodes.len());
        for (i, rows) in answers.into_iter().enumerate() {
            let mut out = Vec::with_capacity(rows.len());
            for r in rows {
                // Borrowed from the row, and read straight into their
                // types: this runs for every row of every hydrated table.
                let link: &str = r.get(1);
                let refs: &str = r.get(2);
                let data: Option<&str> = r.get(3);
                let bad = |what: &str, e: serde_json::Error| {
                    Error::Data(format!(
                        "{}: bad {what} JSON from the source: {e}",
                        self.nodes[i].qualified()
                    ))
                };
                let link: Vec<Option<String>> =
                    serde_json::from_str(link).map_err(|e| bad("link", e))?;
                let refs: HashMap<String, Option<String>> =
                    serde_json::from_str(refs).map_err(|e| bad("refs", e))?;
                let data = match data {
                    Some(d) => serde_json::from_str::<Value>(d).map_err(|e| bad("row", e))?,
                    None => Value::Null,
                };
                let etag_input = etag_part(
                    self.etag_apart[i],
                    &data,
                    &self.nodes[i].exclude_columns_from_etag,
                );
                out.push(Row {
                    ord: r.get(0),
                    link,
                    refs,
                    data,
                    etag_input,
                    is_deleted: r.get(4),
                    excluded: false,
                });
            }
            per_node.push(out);
        }
        Ok(assemble(&self.nodes, per_node, keys.len()))
    }
}

/// Root keys as one text array per key column (the `$1…` of the
/// PostgreSQL queries that unnest keys pairwise).
fn key_arrays(keys: &[RootKey], columns: usize) -> Vec<Vec<Option<String>>> {
    (0..columns)
        .map(|c| keys.iter().map(|k| k.0.get(c).cloned().flatten()).collect())
        .collect()
}

/// [`key_arrays`] as query parameters.
fn as_params(arrays: &[Vec<Option<String>>]) -> Vec<&(dyn tokio_postgres::types::ToSql + Sync)> {
    arrays
        .iter()
        .map(|a| a as &(dyn tokio_postgres::types::ToSql + Sync))
        .collect()
}

/// Nests child rows under their parents, deepest first (a child's index is
/// above its parent's, so a row is complete, or left out, before it is
/// nested). Every join puts what matched under its name: an array
/// (`one_to_many`) or the first row or `null` (`one_to_one`); where an
/// `inner` join matched nothing, the parent row is left out as SQL's inner
/// join leaves it out: a child drops out of its parent, a root is
/// [`Current::Excluded`].
fn assemble(nodes: &[TableNode], mut per_node: Vec<Vec<Row>>, key_count: usize) -> Vec<Current> {
    // (root ordinal, join values): a parent row's link to its children.
    type Link = (i64, Vec<Option<String>>);
    for i in (1..nodes.len()).rev() {
        let child = &nodes[i];
        let parent = child.parent.unwrap_or(0);
        let rows = std::mem::take(&mut per_node[i]);
        // link → that parent's children as (data, etag input apart)
        let mut by_link: HashMap<Link, Vec<(Value, Option<Value>)>> = HashMap::new();
        for r in rows.into_iter().filter(|r| !r.excluded) {
            by_link
                .entry((r.ord, r.link))
                .or_default()
                .push((r.data, r.etag_input));
        }
        let ref_cols: Vec<&str> = child.on.iter().map(|o| o.to_column.as_str()).collect();
        let link_of = |prow: &Row| -> Option<Link> {
            if prow.data.is_null() || prow.excluded {
                return None;
            }
            let values = ref_cols
                .iter()
                .map(|c| prow.refs.get(*c).cloned().flatten())
                .collect();
            Some((prow.ord, values))
        };
        // How many parents take each link's rows: a lookup row can serve
        // several (two addresses in one region). The last of them takes the
        // rows; the others take a copy.
        let mut takers: HashMap<Link, usize> = HashMap::new();
        for prow in &per_node[parent] {
            if let Some(l) = link_of(prow) {
                *takers.entry(l).or_default() += 1;
            }
        }
        for prow in per_node[parent].iter_mut() {
            let Some(link) = link_of(prow) else {
                continue;
            };
            let left = takers.get_mut(&link).expect("counted above");
            *left -= 1;
            let kids = if *left == 0 {
                by_link.remove(&link)
            } else {
                by_link.get(&link).cloned()
            }
            .unwrap_or_default();
            if kids.is_empty() && child.join_type == JoinType::Inner {
                prow.excluded = true;
                continue;
            }
            // A parent keeps its hash input apart when a node below it
            // does ([`etag_apart`]); a child with none apart gives its data.
            let apart = prow.etag_input.is_some();
            let mut etags = Vec::with_capacity(if apart { kids.len() } else { 0 });
            let mut data = Vec::with_capacity(kids.len());
            for (d, e) in kids {
                if apart {
                    etags.push(e.unwrap_or_else(|| d.clone()));
                }
                data.push(d);
            }
            let nest = |values: Vec<Value>| match child.cardinality {
                Cardinality::OneToMany => Value::Array(values),
                Cardinality::OneToOne => values.into_iter().next().unwrap_or(Value::Null),
            };
            if let Value::Object(m) = &mut prow.data {
                m.insert(child.name.clone(), nest(data));
            }
            if let Some(Value::Object(m)) = &mut prow.etag_input {
                m.insert(child.name.clone(), nest(etags));
            }
        }
    }
    let mut out = vec![Current::Missing; key_count];
    for r in std::mem::take(&mut per_node[0]) {
        let idx = (r.ord - 1) as usize;
        if idx < key_count && r.excluded {
            out[idx] = Current::Excluded;
        } else if idx < key_count && !r.data.is_null() {
            out[idx] = Current::Present {
                data: r.data,
                etag_input: r.etag_input,
                is_deleted: r.is_deleted,
            };
        }
    }
    out
}

/// A logical-delete column's value: true, a non-zero number or `"1"`/`"true"`.
fn truthy(v: Option<&Value>) -> bool {
    match v {
        Some(Value::Bool(b)) => *b,
        Some(Value::Number(n)) => n.as_f64().is_some_and(|f| f != 0.0),
        Some(Value::String(s)) => s == "1" || s.eq_ignore_ascii_case("true"),
        _ => false,
    }
}

/// A key column's text as the JSON value the hydration query would give
/// (numbers and booleans typed, everything else a string). Type names are
/// PostgreSQL's (`int4`) or SQL Server's (`int`).
pub fn typed_key_value(type_name: &str, text: Option<&str>) -> Value {
    let Some(t) = text else { return Value::Null };
    match type_name {
        "bit" => Value::Bool(t == "1" || t.eq_ignore_ascii_case("true")),
        "tinyint" | "smallint" | "int" | "bigint" | "int2" | "int4" | "int8" => t
            .parse::<i64>()
            .map(Value::from)
            .unwrap_or_else(|_| Value::String(t.into())),
        "bool" => Value::Bool(t == "t" || t == "true"),
        _ => Value::String(t.into()),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;
    use skein_common::Config;

    use super::*;

    /// A hydrated row of an existing table row.
    fn row(ord: i64, link: &[&str], refs: &[(&str, &str)], data: Value) -> Row {
        Row {
            ord,
            link: link.iter().map(|s| Some(s.to_string())).collect(),
            refs: refs
                .iter()
                .map(|(k, v)| (k.to_string(), Some(v.to_string())))
                .collect(),
            etag_input: None,
            data,
            is_deleted: false,
            excluded: false,
        }
    }

    /// The tables of entity `customer` (root `customer`) with `joins`
    /// (YAML list items).
    fn customer_nodes(joins: &str) -> Vec<TableNode> {
        let text = format!(
            "source: {{ kind: postgres, url: x }}\nentities:\n  - name: customer\n    table: customer\n    joins:\n{joins}"
        );
        Config::from_yaml(&text, "t").unwrap().entities[0].nodes()
    }

    #[test]
    fn assemble_nests_three_levels_in_order() {
        let nodes = customer_nodes(
            r#"
      - { name: addresses, table: address, on: [{ name: customer_id, to_column: id }] }
      - { name: lines, table: address_line, join_to: addresses, on: [{ name: address_id, to_column: id }] }
      - { name: profile, table: profile, cardinality: one_to_one, on: [{ name: customer_id, to_column: id }] }
"#,
        );
        let per_node = vec![
            vec![
                row(1, &[], &[("id", "1")], json!({"id": 1})),
                row(2, &[], &[], Value::Null),
            ],
            vec![
                row(1, &["1"], &[("id", "10")], json!({"id": 10})),
                row(1, &["1"], &[("id", "11")], json!({"id": 11})),
            ],
            vec![row(1, &["11"], &[], json!({"n": 1}))],
            vec![],
        ];
        let out = assemble(&nodes, per_node, 2);
        let Current::Present { data, .. } = &out[0] else {
            panic!("{out:?}")
        };
        assert_eq!(
            data,
            &json!({"id": 1, "profile": null, "addresses": [{"id": 10, "lines": []}, {"id": 11, "lines": [{"n": 1}]}]})
        );
        assert_eq!(out[1], Current::Missing);
    }

    /// `inner` leaves a parent without a matching row out (a child drops
    /// out of its array, a root is excluded); `left` keeps it with `null`.
    #[test]
    fn inner_lookups_leave_unmatched_parents_out_and_left_lookups_keep_them() {
        let nodes = customer_nodes(
            r#"
      - { name: addresses, table: address, on: [{ name: customer_id, to_column: id }] }
      - { name: region, table: region, join_to: addresses, type: inner, cardinality: one_to_one,
          on: [{ name: id, to_column: region_id }] }
      - { name: tier, table: tier, type: left, cardinality: one_to_one, on: [{ name: code, to_column: tier_code }] }
      - { name: vip, table: vip, type: inner, on: [{ name: customer_id, to_column: id }] }
"#,
        );
        let root_refs = |id| [("id", id), ("tier_code", "none")];
        let per_node = vec![
            vec![
                row(1, &[], &root_refs("1"), json!({"id": 1})),
                row(2, &[], &root_refs("2"), json!({"id": 2})),
            ],
            vec![
                row(1, &["1"], &[("region_id", "7")], json!({"id": 10})),
                row(1, &["1"], &[("region_id", "8")], json!({"id": 11})),
                row(2, &["2"], &[("region_id", "7")], json!({"id": 20})),
            ],
            vec![
                row(1, &["7"], &[], json!({"name": "north"})),
                row(2, &["7"], &[], json!({"name": "north"})),
            ],
            vec![],
            vec![row(1, &["1"], &[], json!({"since": 2020}))],
        ];
        let out = assemble(&nodes, per_node, 3);
        let Current::Present { data, .. } = &out[0] else {
            panic!("{out:?}")
        };
        assert_eq!(
            data,
            &json!({"id": 1, "addresses": [{"id": 10, "region": {"name": "north"}}],
                    "tier": null, "vip": [{"since": 2020}]})
        );
        assert_eq!(out[1], Current::Excluded, "no vip row: {out:?}");
        assert_eq!(out[2], Current::Missing);
    }

    /// A lookup row two parents share is nested under both (taken by the
    /// last, copied for the others).
    #[test]
    fn a_lookup_row_shared_by_two_parents_is_nested_under_both() {
        let nodes = customer_nodes(
            r#"
      - { name: addresses, table: address, on: [{ name: customer_id, to_column: id }] }
      - { name: region, table: region, join_to: addresses, cardinality: one_to_one,
          on: [{ name: id, to_column: region_id }] }
"#,
        );
        let per_node = vec![
            vec![row(1, &[], &[("id", "1")], json!({"id": 1}))],
            vec![
                row(1, &["1"], &[("region_id", "7")], json!({"id": 10})),
                row(1, &["1"], &[("region_id", "7")], json!({"id": 11})),
                row(1, &["1"], &[("region_id", "8")], json!({"id": 12})),
            ],
            vec![row(1, &["7"], &[], json!({"name": "north"}))],
        ];
        let out = assemble(&nodes, per_node, 1);
        let Current::Present { data, .. } = &out[0] else {
            panic!("{out:?}")
        };
        assert_eq!(
            data,
            &json!({"id": 1, "addresses": [
                {"id": 10, "region": {"name": "north"}},
                {"id": 11, "region": {"name": "north"}},
                {"id": 12, "region": null}]})
        );
    }

    /// Only the nodes on the way to one that excludes columns from the
    /// etag keep a hash input apart from their data; a child without one
    /// gives its data as its input.
    #[test]
    fn the_hash_input_differs_from_the_data_only_where_columns_are_excluded() {
        let nodes = customer_nodes(
            r#"
      - { name: addresses, table: address, on: [{ name: customer_id, to_column: id }] }
      - { name: contacts, table: contact, exclude_columns_from_etag: [seen], on: [{ name: customer_id, to_column: id }] }
"#,
        );
        assert_eq!(etag_apart(&nodes), vec![true, false, true]);
        let apart = |r: Row, input: Value| Row {
            etag_input: Some(input),
            ..r
        };
        let per_node = vec![
            vec![apart(
                row(1, &[], &[("id", "1")], json!({"id": 1})),
                json!({"id": 1}),
            )],
            vec![row(1, &["1"], &[], json!({"id": 10}))],
            vec![apart(
                row(1, &["1"], &[], json!({"id": 20, "seen": 5})),
                json!({"id": 20}),
            )],
        ];
        let out = assemble(&nodes, per_node, 1);
        let Current::Present {
            data, etag_input, ..
        } = &out[0]
        else {
            panic!("{out:?}")
        };
        assert_eq!(
            data,
            &json!({"id": 1, "addresses": [{"id": 10}], "contacts": [{"id": 20, "seen": 5}]})
        );
        assert_eq!(
            etag_input,
            &Some(json!({"id": 1, "addresses": [{"id": 10}], "contacts": [{"id": 20}]}))
        );
        let plain = customer_nodes(
            "      - { name: addresses, table: address, on: [{ name: customer_id, to_column: id }] }\n",
        );
        assert_eq!(etag_apart(&plain), vec![false, false]);
    }

    #[test]
    fn small_batches_run_generic_plans_and_large_ones_their_own() {
        assert!(plan_mode_sql(1).ends_with("force_generic_plan"));
        assert!(plan_mode_sql(GENERIC_PLAN_KEYS).ends_with("force_generic_plan"));
        assert!(plan_mode_sql(GENERIC_PLAN_KEYS + 1).ends_with("force_custom_plan"));
    }

    #[test]
    fn key_values_are_typed_like_hydrated_values() {
        assert_eq!(typed_key_value("int4", Some("5")), json!(5));
        assert_eq!(typed_key_value("bool", Some("t")), json!(true));
        assert_eq!(typed_key_value("uuid", Some("a-b")), json!("a-b"));
        assert_eq!(typed_key_value("text", None), Value::Null);
        assert_eq!(typed_key_value("bigint", Some("-5")), json!(-5));
        assert_eq!(typed_key_value("bit", Some("1")), json!(true));
        assert_eq!(
            typed_key_value("uniqueidentifier", Some("a-b")),
            json!("a-b")
        );
        assert!(truthy(Some(&json!(1))) && truthy(Some(&json!(true))) && !truthy(Some(&json!(0))));
        assert!(!truthy(None) && !truthy(Some(&Value::Null)));
    }
}
