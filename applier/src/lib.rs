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
pub mod decide;
pub mod error;
pub mod event;
pub mod explicit;
pub mod fresh;
pub mod hydrate;
pub mod identifiers;
pub mod relay;
pub mod run;
pub mod sidecar;
pub mod sink;

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
