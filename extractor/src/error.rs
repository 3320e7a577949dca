//! Errors of `skein-extractor`.

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What can stop the extractor.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The source no longer holds the changes after the marker.
    #[error(
        "data loss: the marker is at {marker} but the source only has changes from {available}. \
         Changes in between are gone. Either re-publish affected entities with `skein explicit` and \
         move on with `skein marker reset --latest --continue-with-data-loss`, or set \
         `extractor.continue_with_data_loss: true` to record the loss and continue"
    )]
    DataLoss { marker: String, available: String },
    /// A change message could not be decoded or lacks a needed column.
    #[error("{0}")]
    Decode(String),
    /// The state directory could not be used.
    #[error("state directory {dir}: {message}")]
    State { dir: String, message: String },
    /// Another process holds the state directory.
    #[error(
        "state directory {dir} is locked by another skein process (a running `skein run` or \
         `skein extract`); stop it first"
    )]
    StateLocked { dir: String },
    /// A query against the source failed.
    #[error("source query failed ({context}): {source}")]
    Source {
        context: String,
        #[source]
        source: tokio_postgres::Error,
    },
    /// A connection to the source could not be opened.
    #[error("connecting to the {what}: {source}")]
    Connect {
        what: &'static str,
        #[source]
        source: skein_sql::postgres::client::ConnectError,
    },
    /// The replication stream failed.
    #[error("replication stream failed: {source}")]
    Replication {
        #[source]
        source: pgwire_replication::PgWireError,
    },
    /// The source is not set up for CDC.
    #[error("{message}\nFix:\n{fix}")]
    NotReady { message: String, fix: String },
    /// A SQL Server query failed.
    #[error(transparent)]
    SqlServer(#[from] skein_sql::sqlserver::MssqlError),
    /// The transport could not deliver a batch.
    #[error(transparent)]
    Transport(#[from] skein_transporter::Error),
}

impl Error {
    /// Whether retrying the same step later may succeed (connection trouble);
    /// data loss, decode and setup errors need a person.
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::Source { source, .. } => source.is_closed() || source.as_db_error().is_none(),
            Error::Connect { source, .. } => source.is_retryable(),
            Error::Replication { source } => source.is_transient() || source.is_io(),
            Error::Transport(e) => e.is_retryable(),
            Error::SqlServer(e) => e.is_retryable(),
            _ => false,
        }
    }
}

pub(crate) fn src(context: impl Into<String>) -> impl FnOnce(tokio_postgres::Error) -> Error {
    let context = context.into();
    move |source| Error::Source { context, source }
}
