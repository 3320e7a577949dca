//! Errors of `skein-applier`.

use crate::sidecar::Fence;

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What can stop an applier or the relay.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A query against the source or the sidecar failed.
    #[error("{context}: {source}")]
    Db {
        context: String,
        #[source]
        source: tokio_postgres::Error,
    },
    /// A PostgreSQL connection could not be opened.
    #[error("connecting to the {what}: {source}")]
    Connect {
        what: &'static str,
        #[source]
        source: skein_sql::postgres::client::ConnectError,
    },
    /// Another applier moved this partition's progress: this one is a zombie
    /// and wrote nothing.
    #[error(
        "partition {partition}: progress is {} while this applier expected {}; \
         the batch was rolled back (another applier took the partition, or a replay rewound it)",
        show(found),
        show(expected)
    )]
    Fenced {
        partition: u32,
        expected: Option<Fence>,
        found: Option<Fence>,
    },
    /// The stop came between two committed steps of one delivery (the
    /// pages of a TRUNCATE re-check): the rest is not applied, and the
    /// partition's next owner resumes after the last committed step.
    #[error(
        "partition {partition}: stopped between the pages of a TRUNCATE re-check; \
         it resumes after the last key re-checked"
    )]
    Interrupted { partition: u32 },
    /// A batch drew outbox ids at or below ones its partition already had
    /// (the outbox's id sequence was reset, or set to cache values): the
    /// relay, which keeps the last id it sent per partition, would take
    /// the new rows as sent. Nothing was written.
    #[error(
        "partition {partition}: the batch's first outbox id {drawn} is not above the partition's \
         {floor}; the batch was rolled back. The outbox's id sequence must only grow, one value \
         at a time per session (no CACHE above 1, no reset): set it past {floor} and restart"
    )]
    OutboxOrder {
        partition: u32,
        drawn: i64,
        floor: i64,
    },
    /// The source's schema changed under the running pipeline in a way the
    /// config cannot follow (a column it names dropped or retyped).
    #[error("{message}\nFix:\n{fix}")]
    Schema { message: String, fix: String },
    /// A row from the source could not be turned into JSON.
    #[error("{0}")]
    Data(String),
    /// A SQL Server query failed.
    #[error(transparent)]
    SqlServer(#[from] skein_sql::sqlserver::MssqlError),
    /// The transport failed to deliver or to acknowledge.
    #[error(transparent)]
    Transport(#[from] skein_transporter::Error),
    /// The sink will never take these events (every other event of the
    /// send was delivered).
    #[error("the sink rejected {}; {hint}", rejected_list(rejected))]
    SinkRejected {
        rejected: Vec<crate::sink::Rejected>,
        hint: &'static str,
    },
    /// The sink could not take the events (worth retrying).
    #[error("sink: {message}")]
    Sink {
        message: String,
        #[source]
        source: Option<std::io::Error>,
    },
}

impl Error {
    /// Connection trouble may pass; fencing, bad data and sink errors need a
    /// restart or a person.
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::Db { source, .. } => source.is_closed() || source.as_db_error().is_none(),
            Error::Connect { source, .. } => source.is_retryable(),
            Error::SqlServer(e) => e.is_retryable(),
            Error::Transport(e) => e.is_retryable(),
            _ => false,
        }
    }
}

pub(crate) fn db(context: impl Into<String>) -> impl FnOnce(tokio_postgres::Error) -> Error {
    let context = context.into();
    move |source| Error::Db { context, source }
}

/// A fence in an error message: `none` before the first commit.
fn show(f: &Option<Fence>) -> String {
    f.map_or_else(|| "none".into(), |f| f.to_string())
}

fn rejected_list(r: &[crate::sink::Rejected]) -> String {
    r.iter()
        .map(|r| format!("outbox row {} ({}): {}", r.outbox_id, r.entity, r.reason))
        .collect::<Vec<_>>()
        .join("; ")
}
