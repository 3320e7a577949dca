//! # skein-applier
//!
//! Turns change records into entity events, exactly once into the outbox:
//!
//! 1. drop records at or before the partition's committed progress;
//! 2. [`decide::consolidate`] per (entity, root key);
//! 3. [`hydrate`] the latest state from the source, one query per table;
//! 4. version: SHA-256 of the canonical JSON, unchanged → no event;
//! 5. build CloudEvents ([`event`]);
//! 6. one [`sidecar`] transaction: outbox + versions + batch row + progress,
//!    the latter only if it still holds the value this applier started from.
//!
//! [`run`] is the one applier loop of every transport: it takes rounds of
//! deliveries from an [`Inbox`](skein_transporter::Inbox), applies each
//! partition's with its [`Applier`] ([`apply`]; the already-applied filter
//! is [`fresh`]), acknowledges them, and re-seeks a fenced partition.
//!
//! The [`relay`] then moves outbox rows to a [`sink`], at least once with a
//! stable event id.

pub mod apply;
pub mod coverage;
pub mod decide;
pub mod error;
pub mod event;
pub mod explicit;
pub mod fresh;
pub mod hydrate;
pub mod identifiers;
pub mod known;
pub mod relay;
pub mod run;
pub mod sidecar;
pub mod sink;

/// The hash map of a batch's per-record work (its coverage check, its
/// consolidation): foldhash, seeded per process, several times SipHash's
/// speed on the short keys these maps hold. Only for maps a batch builds
/// and drops: foldhash claims little resistance to keys chosen to collide,
/// and the keys are the source's, so maps that live on keep std's SipHash.
pub(crate) type FastMap<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;

/// The hash set beside [`FastMap`], for the same kind of use.
pub(crate) type FastSet<T> = std::collections::HashSet<T, foldhash::fast::RandomState>;

pub use apply::{Applied, Applier};
pub use error::{Error, Result};
pub use hydrate::Source;
pub use run::{check_identifier_mapping, run};

/// Opens a PostgreSQL connection (`what`: "source", "sidecar") with TLS as
/// the URL's `sslmode` / `sslrootcert` say; its connection task is spawned
/// and ends when the client is dropped.
pub(crate) async fn connect_postgres(
    url: &str,
    what: &'static str,
) -> Result<tokio_postgres::Client> {
    let connect_err = |source| Error::Connect { what, source };
    skein_sql::postgres::client::PgUrl::parse(url)
        .map_err(connect_err)?
        .connect(what)
        .await
        .map_err(connect_err)
}

/// The prepared statements of one PostgreSQL connection, by their text:
/// a statement the applier runs in every batch (hydration, versions, the
/// batch commit) is parsed and analysed by the server once per
/// connection, not once per batch, and each execution is one round trip
/// instead of two. Statements are the connection's: a new connection
/// starts a new cache. Every statement here returns columns of fixed types
/// (hydration builds its rows' JSON in the query), so a schema change
/// re-plans them on the server and never changes what they return.
#[derive(Default)]
pub struct Statements(std::collections::HashMap<String, tokio_postgres::Statement>);

/// More distinct texts than any config gives (a statement per table and
/// per sidecar step): past it the cache starts again rather than grow.
const MAX_STATEMENTS: usize = 512;

impl Statements {
    /// The prepared statement of `sql` on `client`'s connection.
    pub async fn get<C: tokio_postgres::GenericClient + Sync>(
        &mut self,
        client: &C,
        sql: &str,
    ) -> std::result::Result<tokio_postgres::Statement, tokio_postgres::Error> {
        if let Some(s) = self.0.get(sql) {
            return Ok(s.clone());
        }
        let s = client.prepare(sql).await?;
        if self.0.len() >= MAX_STATEMENTS {
            self.0.clear();
        }
        self.0.insert(sql.to_string(), s.clone());
        Ok(s)
    }

    /// [`Statements::get`], an error naming `what` was being done.
    pub async fn prepared<C: tokio_postgres::GenericClient + Sync>(
        &mut self,
        client: &C,
        sql: &str,
        what: &'static str,
    ) -> Result<tokio_postgres::Statement> {
        self.get(client, sql).await.map_err(error::db(what))
    }

    /// Runs `sql` prepared; an error names `what` was being done.
    pub async fn execute<C: tokio_postgres::GenericClient + Sync>(
        &mut self,
        client: &C,
        sql: &str,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
        what: &'static str,
    ) -> Result<u64> {
        let s = self.prepared(client, sql, what).await?;
        client.execute(&s, params).await.map_err(error::db(what))
    }

    /// Runs `sql` prepared for its one row; an error names `what` was
    /// being done.
    pub async fn query_one<C: tokio_postgres::GenericClient + Sync>(
        &mut self,
        client: &C,
        sql: &str,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
        what: &'static str,
    ) -> Result<tokio_postgres::Row> {
        let s = self.prepared(client, sql, what).await?;
        client.query_one(&s, params).await.map_err(error::db(what))
    }

    /// Runs `sql` prepared for its rows; an error names `what` was being
    /// done.
    pub async fn query<C: tokio_postgres::GenericClient + Sync>(
        &mut self,
        client: &C,
        sql: &str,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
        what: &'static str,
    ) -> Result<Vec<tokio_postgres::Row>> {
        let s = self.prepared(client, sql, what).await?;
        client.query(&s, params).await.map_err(error::db(what))
    }
}
