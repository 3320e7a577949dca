//! `skein`: entity-level change events, exactly once.
//!
//! Thin binary: parses the command line, loads the config and hands it to
//! the subcommand's module in [`cmd`], which builds the parts from the
//! libraries and runs them. Every subcommand takes `--config` (env
//! `SKEIN_CONFIG`).

mod cmd;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use skein_common::config::Config;

#[derive(Parser)]
#[command(
    name = "skein",
    version,
    about = "Entity-level change events from CDC, published exactly once"
)]
struct Cli {
    /// The YAML configuration file.
    #[arg(
        long,
        short,
        global = true,
        env = "SKEIN_CONFIG",
        default_value = "skein.yaml"
    )]
    config: PathBuf,
    /// Serve Prometheus metrics on `HOST:PORT` (`/metrics`) while `run`,
    /// `extract`, `apply` or `relay` runs; overrides `metrics.addr`.
    #[arg(long, global = true, env = "SKEIN_METRICS_ADDR")]
    metrics_addr: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run everything in one process: extractor, in-process transport, appliers and relay.
    Run,
    /// Relay pending outbox rows to the configured sink, then keep relaying.
    Relay,
    /// The extractor alone, producing change records to the Kafka transport topic.
    Extract,
    /// One applier of the Kafka consumer group (start 1 or N), relaying its partitions' outbox.
    Apply {
        /// Static group membership (`group.instance.id`): a restarted applier
        /// with the same id takes its partitions back at once, without a
        /// rebalance. Give every applier its own, stable id.
        #[arg(long, env = "SKEIN_INSTANCE_ID")]
        instance_id: Option<String>,
    },
    /// Rewind the appliers' progress (Kafka) so records are consumed again.
    Replay {
        /// Only this partition (default: every partition).
        #[arg(long)]
        partition: Option<u32>,
        /// Rewind to this offset.
        #[arg(
            long,
            conflicts_with = "from_time",
            required_unless_present = "from_time"
        )]
        offset: Option<i64>,
        /// Rewind to the first record at or after this time (RFC 3339 or epoch ms).
        #[arg(long)]
        from_time: Option<String>,
        /// Clear the stored versions of the replayed aggregates so each publishes again.
        #[arg(long)]
        republish: bool,
        /// Rewind even though appliers of the group are running.
        #[arg(long)]
        force_while_running: bool,
        /// Allow moving a partition forward, past records it never applied
        /// (after retention deleted them: `skein apply` says when). Those
        /// changes are lost to the outbox.
        #[arg(long)]
        continue_with_data_loss: bool,
    },
    /// Publish aggregates on demand through the outbox (nTangle's explicit
    /// execution): every aggregate of an entity, some keys, or roots matching
    /// a condition. A key not found publishes a delete where a version exists;
    /// unchanged aggregates publish nothing unless --republish. The keys are
    /// queued in the sidecar and published by the running pipeline's
    /// appliers; the same command again resumes an unfinished run.
    Explicit(cmd::explicit::Args),
    /// Lag per stage as JSON: slot vs WAL end, progress vs log end per partition, outbox depth.
    Status,
    /// Print SQL to run by hand.
    Sql {
        #[command(subcommand)]
        what: SqlWhat,
    },
    /// Manage the sidecar schema.
    Sidecar {
        #[command(subcommand)]
        what: SidecarWhat,
    },
    /// Check the config and the source: tables, columns, publication, slot, wal_level.
    Validate,
    /// Inspect or move the extractor marker.
    Marker {
        #[command(subcommand)]
        what: MarkerWhat,
    },
}

#[derive(Subcommand)]
enum SqlWhat {
    /// CDC enablement for the configured entities: publication and replica
    /// identity (PostgreSQL), or CDC on the database and a capture instance
    /// per tracked table (SQL Server). Idempotent.
    Source {
        /// The dialect to print; must match the config's source.
        #[arg(long, value_enum)]
        dialect: Option<Dialect>,
        /// Run the statements against the source instead of printing them
        /// (needs the rights they need: sysadmin to enable CDC on SQL Server).
        #[arg(long)]
        apply: bool,
    },
    /// The sidecar schema DDL.
    Sidecar {
        #[arg(long, value_enum)]
        dialect: Option<Dialect>,
    },
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Dialect {
    Postgres,
    Sqlserver,
}

#[derive(Subcommand)]
enum SidecarWhat {
    /// Create or upgrade the sidecar schema (idempotent).
    Migrate,
}

#[derive(Subcommand)]
enum MarkerWhat {
    /// Print the stored marker.
    Show,
    /// Move the marker (refused while a pipeline holds the state directory).
    Reset {
        /// The position to read after: a PostgreSQL LSN like `0/16B3748`, or a
        /// SQL Server LSN like `0x0000002A000001F00003`.
        #[arg(long, conflicts_with = "latest")]
        to: Option<String>,
        /// The source's current position (skips everything not yet read).
        #[arg(long)]
        latest: bool,
        /// Record that changes were skipped.
        #[arg(long)]
        continue_with_data_loss: bool,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("SKEIN_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    match try_main(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", report(&e));
            ExitCode::FAILURE
        }
    }
}

/// The error and its causes, each once: most of skein's errors already
/// show their cause, which `{:#}` would print again.
fn report(e: &anyhow::Error) -> String {
    let mut out = e.to_string();
    for cause in e.chain().skip(1) {
        let c = cause.to_string();
        if !out.contains(&c) {
            out.push_str(": ");
            out.push_str(&c);
        }
    }
    out
}

fn try_main(cli: Cli) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let mut cfg = Config::load(&cli.config)?;
    if let Some(a) = cli.metrics_addr.filter(|a| !a.is_empty()) {
        cfg.metrics.addr = Some(a);
    }
    let result = rt.block_on(async move {
        match cli.command {
            Command::Run => cmd::run::run(cfg).await,
            Command::Relay => cmd::relay::relay(cfg).await,
            Command::Extract => cmd::extract::extract(cfg).await,
            Command::Apply { instance_id } => {
                cmd::apply::apply(cfg, instance_id.filter(|i| !i.is_empty())).await
            }
            Command::Status => cmd::status::status(cfg).await,
            Command::Explicit(args) => cmd::explicit::explicit(cfg, args).await,
            Command::Replay {
                partition,
                offset,
                from_time,
                republish,
                force_while_running,
                continue_with_data_loss,
            } => {
                let from = cmd::replay::from(offset, from_time)?;
                let how = cmd::replay::How {
                    republish,
                    force_while_running,
                    continue_with_data_loss,
                };
                cmd::replay::replay(cfg, partition, from, how).await
            }
            Command::Sql { what } => match what {
                SqlWhat::Source { dialect, apply } => {
                    cmd::sql::source(&cfg, dialect.map(|d| d == Dialect::Sqlserver), apply).await
                }
                SqlWhat::Sidecar { dialect } => {
                    cmd::sql::sidecar(&cfg, dialect.map(|d| d == Dialect::Sqlserver))
                }
            },
            Command::Sidecar {
                what: SidecarWhat::Migrate,
            } => cmd::sidecar::migrate(cfg).await,
            Command::Validate => cmd::validate::validate(&cfg).await,
            Command::Marker { what } => match what {
                MarkerWhat::Show => cmd::marker::show(&cfg),
                MarkerWhat::Reset {
                    to,
                    latest,
                    continue_with_data_loss,
                } => cmd::marker::reset(&cfg, to, latest, continue_with_data_loss).await,
            },
        }
    });
    // A blocking task left behind (a Kafka client's close that waits for an
    // unreachable broker, see `KafkaInbox::close`) must not hold the exit:
    // dropping the runtime would wait for it without limit.
    rt.shutdown_timeout(std::time::Duration::from_secs(1));
    result
}
