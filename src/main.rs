//! `skein`: entity-level change events, exactly once.
//!
//! Thin binary: parses the command line, loads the config, wires the
//! library crates together. Every subcommand takes `--config` (env
//! `SKEIN_CONFIG`).

mod distributed;

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context};
use clap::{Parser, Subcommand, ValueEnum};
use skein_applier::relay::{run_relay, RelayScope};
use skein_applier::sidecar::{AnySidecar, Sidecar};
use skein_applier::sink::{FileSink, KafkaSink, Sink, StdoutSink};
use skein_applier::{Applier, Input, ProgressKind, Source, IN_PROCESS_TOPIC};
use skein_common::config::{Config, SinkKind, SourceKind, TransportKind};
use skein_common::{PgLsn, SourcePosition};
use skein_extractor::marker::now_stamp;
use skein_extractor::{AnySource, Marker, MarkerStore, SledMarkerStore};
use skein_transporter::{InProcess, PartitionReceiver, Recv};
use tokio_util::sync::CancellationToken;
use tracing::{error, info};

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
    },
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

#[derive(Clone, Copy, ValueEnum)]
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
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn try_main(cli: Cli) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let cfg = Config::load(&cli.config)?;
    rt.block_on(async move {
        match cli.command {
            Command::Run => run(cfg).await,
            Command::Relay => relay(cfg).await,
            Command::Extract => distributed::extract(cfg).await,
            Command::Apply { instance_id } => {
                distributed::apply(cfg, instance_id.filter(|i| !i.is_empty())).await
            }
            Command::Status => distributed::status(cfg).await,
            Command::Replay {
                partition,
                offset,
                from_time,
                republish,
                force_while_running,
            } => {
                let from = match (offset, from_time) {
                    (Some(o), _) => distributed::ReplayFrom::Offset(o),
                    (None, Some(t)) => {
                        distributed::ReplayFrom::Time(distributed::parse_time_ms(&t)?)
                    }
                    (None, None) => bail!("give --offset or --from-time"),
                };
                distributed::replay(cfg, partition, from, republish, force_while_running).await
            }
            Command::Sql { what } => sql(&cfg, what).await,
            Command::Sidecar {
                what: SidecarWhat::Migrate,
            } => {
                let mut sc = AnySidecar::connect(cfg.sidecar_url(), &cfg.sidecar.schema).await?;
                sc.migrate().await?;
                println!("sidecar schema {} is up to date", cfg.sidecar.schema);
                Ok(())
            }
            Command::Validate => validate(&cfg).await,
            Command::Marker { what } => marker(&cfg, what).await,
        }
    })
}

async fn sql(cfg: &Config, what: SqlWhat) -> anyhow::Result<()> {
    match what {
        SqlWhat::Sidecar { dialect } => {
            let tsql = match dialect {
                Some(d) => matches!(d, Dialect::Sqlserver),
                None => !skein_applier::sidecar::is_postgres_url(cfg.sidecar_url().expose()),
            };
            if tsql {
                print!("{}", skein_sql::sqlserver::sidecar_ddl(&cfg.sidecar.schema));
            } else {
                print!("{}", skein_sql::postgres::sidecar_ddl(&cfg.sidecar.schema));
            }
        }
        SqlWhat::Source { dialect, apply } => {
            let wants_tsql = matches!(dialect, Some(Dialect::Sqlserver));
            if wants_tsql != (cfg.source.kind == SourceKind::Sqlserver) && dialect.is_some() {
                bail!(
                    "the config's source is {:?}: `skein sql source` prints the statements for \
                     that source's own dialect",
                    cfg.source.kind
                );
            }
            if cfg.source.kind == SourceKind::Sqlserver {
                let mut client =
                    skein_common::mssql::MssqlClient::connect(cfg.source.url.expose()).await?;
                let catalog = skein_extractor::sqlserver::load_catalog(&mut client, cfg).await?;
                refuse_catalog_problems(cfg, &catalog)?;
                let ddl = skein_sql::sqlserver::source_ddl(cfg, &catalog);
                if apply {
                    client.batch("enabling CDC", &ddl).await?;
                    eprintln!(
                        "applied: CDC enablement for {} table(s)",
                        skein_sql::postgres::tracked_tables(cfg, &catalog).len()
                    );
                } else {
                    print!("{ddl}");
                }
                return Ok(());
            }
            let client = skein_extractor::postgres::connect(&cfg.source.url, "source").await?;
            let catalog = skein_extractor::postgres::load_catalog(&client, cfg).await?;
            refuse_catalog_problems(cfg, &catalog)?;
            let ddl = skein_sql::postgres::source_ddl(cfg, &catalog);
            if apply {
                client.batch_execute(&ddl).await?;
                eprintln!("applied: publication and replica identities");
            } else {
                print!("{ddl}");
            }
        }
    }
    Ok(())
}

/// Prints every table or column the config names that the source lacks,
/// and fails when there is any.
fn refuse_catalog_problems(cfg: &Config, catalog: &skein_sql::Catalog) -> anyhow::Result<()> {
    let problems = skein_sql::postgres::check_catalog(cfg, catalog);
    for p in &problems {
        eprintln!("error: {p}");
    }
    if !problems.is_empty() {
        bail!(
            "{} problem(s) in the config against the source",
            problems.len()
        );
    }
    Ok(())
}

async fn validate(cfg: &Config) -> anyhow::Result<()> {
    if cfg.source.kind == SourceKind::Sqlserver {
        // Connecting checks tables, columns and types; `check` the CDC set-up.
        let mut source = skein_extractor::MssqlSource::connect(cfg).await?;
        source.check().await?;
        println!(
            "ok: CDC is enabled, every tracked table has a readable capture instance with its \
             key and join columns{}",
            source
                .instances()
                .iter()
                .map(|i| format!("\n  {}.{} <- {}", i.schema, i.table, i.name))
                .collect::<String>()
        );
        return Ok(());
    }
    let client = skein_extractor::postgres::connect(&cfg.source.url, "source").await?;
    let mut problems: Vec<String> = vec![];
    let wal: String = client.query_one("SHOW wal_level", &[]).await?.get(0);
    if wal != "logical" {
        problems.push(format!(
            "wal_level is `{wal}`, logical decoding needs `logical`.\nFix: ALTER SYSTEM SET wal_level = logical; -- then restart PostgreSQL"
        ));
    }
    let catalog = skein_extractor::postgres::load_catalog(&client, cfg).await?;
    let catalog_problems = skein_sql::postgres::check_catalog(cfg, &catalog);
    for p in &catalog_problems {
        problems.push(p.to_string());
    }
    // The publication's fix is generated from the catalog: with tables or
    // columns missing it would be wrong, so those come first.
    let check_publication = catalog_problems.is_empty();
    if !check_publication {
        println!("note: the publication and replica identities are checked once the tables and columns above are fixed");
    }
    let ddl = skein_sql::postgres::source_ddl(cfg, &catalog);
    let pubrow = client
        .query_opt(
            "SELECT 1 FROM pg_catalog.pg_publication WHERE pubname = $1",
            &[&cfg.source.publication],
        )
        .await?;
    if !check_publication {
        // reported above
    } else if pubrow.is_none() {
        problems.push(format!(
            "publication `{}` does not exist.\nFix (from `skein sql source`):\n{ddl}",
            cfg.source.publication
        ));
    } else {
        // Every tracked table must be published with the columns skein needs.
        for t in skein_sql::postgres::tracked_tables(cfg, &catalog) {
            let row = client
                .query_opt(
                    "SELECT coalesce(attnames::text[], '{}') FROM pg_catalog.pg_publication_tables \
                     WHERE pubname = $1 AND schemaname = $2 AND tablename = $3",
                    &[&cfg.source.publication, &t.schema, &t.table],
                )
                .await?;
            match row {
                None => problems.push(format!(
                    "{}.{} is not in publication `{}`.\nFix (from `skein sql source`):\n{ddl}",
                    t.schema, t.table, cfg.source.publication
                )),
                Some(r) => {
                    let cols: Vec<String> = r.get(0);
                    let missing: Vec<&String> =
                        t.columns.iter().filter(|c| !cols.contains(c)).collect();
                    if !missing.is_empty() {
                        problems.push(format!(
                            "publication `{}` does not carry {:?} of {}.{}.\nFix (from `skein sql source`):\n{ddl}",
                            cfg.source.publication, missing, t.schema, t.table
                        ));
                    }
                }
            }
            if t.needs_full_identity {
                if let Some(info) = catalog.table(&t.schema, &t.table) {
                    if info.replica_identity != 'f' {
                        problems.push(format!(
                            "{}.{}: deletes would not carry the join columns {:?} (replica identity is not FULL).\nFix: ALTER TABLE \"{}\".\"{}\" REPLICA IDENTITY FULL;",
                            t.schema, t.table, t.columns, t.schema, t.table
                        ));
                    }
                }
            }
        }
    }
    let slot = client
        .query_opt(
            "SELECT coalesce(wal_status, '') FROM pg_catalog.pg_replication_slots WHERE slot_name = $1",
            &[&cfg.source.slot],
        )
        .await?;
    match slot {
        None => println!(
            "note: replication slot `{}` does not exist yet; `skein run` creates it on first start",
            cfg.source.slot
        ),
        Some(r) if r.get::<_, String>(0) == "lost" => problems.push(format!(
            "replication slot `{}` was invalidated: changes were lost.\nFix: SELECT pg_drop_replication_slot('{}'); then `skein marker reset --latest --continue-with-data-loss`",
            cfg.source.slot, cfg.source.slot
        )),
        Some(_) => {}
    }
    if problems.is_empty() {
        println!("ok: config and source are ready");
        return Ok(());
    }
    for p in &problems {
        println!("problem: {p}\n");
    }
    bail!("{} problem(s) found", problems.len())
}

async fn marker(cfg: &Config, what: MarkerWhat) -> anyhow::Result<()> {
    let store = SledMarkerStore::open(&cfg.state_dir)?;
    match what {
        MarkerWhat::Show => match store.load()? {
            None => println!("no marker yet (the pipeline has not started)"),
            Some(m) => println!(
                "position {}  has_data_loss {}  updated_at {}",
                m.position, m.has_data_loss, m.updated_at
            ),
        },
        MarkerWhat::Reset {
            to,
            latest,
            continue_with_data_loss,
        } => {
            let old = store.load()?;
            let position: SourcePosition = match (to, latest, cfg.source.kind) {
                (Some(t), false, _) => {
                    let p: SourcePosition = t.parse()?;
                    if p.dialect() != cfg.source.kind.dialect() {
                        bail!(
                            "{t} is not a position of this source ({:?})",
                            cfg.source.kind
                        );
                    }
                    p
                }
                (None, true, SourceKind::Postgres) => {
                    let client =
                        skein_extractor::postgres::connect(&cfg.source.url, "source").await?;
                    let s: String = client
                        .query_one("SELECT pg_current_wal_lsn()::text", &[])
                        .await?
                        .get(0);
                    s.parse::<PgLsn>()?.into()
                }
                (None, true, SourceKind::Sqlserver) => {
                    let mut s = skein_extractor::MssqlSource::connect(cfg).await?;
                    s.current_max_lsn().await?.into()
                }
                _ => bail!("say where to: --to POSITION or --latest"),
            };
            let skips = old.as_ref().is_some_and(|m| position > m.position);
            if skips && !continue_with_data_loss {
                bail!(
                    "moving the marker forward from {} to {position} skips changes; add --continue-with-data-loss to accept that",
                    old.map(|m| m.position.to_string()).unwrap_or_default()
                );
            }
            let m = Marker {
                position,
                has_data_loss: old.as_ref().is_some_and(|m| m.has_data_loss) || skips,
                updated_at: now_stamp(),
            };
            store.reset(&m)?;
            tracing::warn!(from = ?old.map(|m| m.position.to_string()), to = %position, "marker reset");
            println!("marker set to {position}");
        }
    }
    Ok(())
}

pub(crate) fn make_sink(cfg: &Config) -> anyhow::Result<Box<dyn Sink>> {
    Ok(match cfg.sink.kind {
        SinkKind::Stdout => Box::new(StdoutSink),
        SinkKind::File => {
            let path = cfg.sink.path.clone().context("sink.path")?;
            Box::new(FileSink::open(&path, cfg.sink.also_stdout)?)
        }
        SinkKind::Kafka => Box::new(KafkaSink::new(
            cfg.sink.brokers.as_deref().context("sink.brokers")?,
            &cfg.sink.kafka_properties,
            cfg.sink
                .topic_prefix
                .as_deref()
                .context("sink.topic_prefix")?,
            cfg.sink.mode,
        )?),
    })
}

async fn relay(cfg: Config) -> anyhow::Result<()> {
    let cancel = shutdown_token();
    let sidecar = AnySidecar::connect(cfg.sidecar_url(), &cfg.sidecar.schema).await?;
    let sink = make_sink(&cfg)?;
    run_relay(sidecar, sink, cfg.sink.relay_batch, RelayScope::All, cancel).await?;
    Ok(())
}

/// A token cancelled by SIGTERM or SIGINT. The handlers are installed
/// before this returns, so a signal during start-up also stops cleanly.
pub(crate) fn shutdown_token() -> CancellationToken {
    use tokio::signal::unix::{signal, SignalKind};
    let cancel = CancellationToken::new();
    let term = signal(SignalKind::terminate());
    let int = signal(SignalKind::interrupt());
    let c = cancel.clone();
    tokio::spawn(async move {
        let (Ok(mut term), Ok(mut int)) = (term, int) else {
            error!("cannot install signal handlers");
            return;
        };
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        info!("shutting down");
        c.cancel();
    });
    cancel
}

async fn run(cfg: Config) -> anyhow::Result<()> {
    let cancel = shutdown_token();
    if cfg.transport.kind != TransportKind::InProcess {
        bail!("`skein run` uses the in-process transport; set `transport.kind: in-process`");
    }
    let markers = SledMarkerStore::open(&cfg.state_dir)?;
    let mut sidecar = AnySidecar::connect(cfg.sidecar_url(), &cfg.sidecar.schema).await?;
    sidecar.migrate().await?;
    let mut source = AnySource::connect(&cfg).await?;
    let catalog = source.catalog().clone();
    let (transport, receivers) =
        InProcess::new(cfg.transport.partitions, cfg.transport.channel_capacity);

    let mut appliers = vec![];
    for rx in receivers {
        let cfg = cfg.clone();
        let catalog = catalog.clone();
        appliers.push(
            std::thread::Builder::new()
                .name(format!("applier-{}", rx.partition))
                .spawn(move || applier_thread(cfg, catalog, rx))?,
        );
    }
    let relay_cancel = CancellationToken::new();
    let relay = tokio::spawn(run_relay(
        AnySidecar::connect(cfg.sidecar_url(), &cfg.sidecar.schema).await?,
        make_sink(&cfg)?,
        cfg.sink.relay_batch,
        RelayScope::All,
        relay_cancel.clone(),
    ));
    let result = skein_extractor::run(&cfg, &mut source, &markers, &transport, cancel).await;
    // Stop in order: no more batches → appliers drain and exit → relay drains.
    drop(transport);
    for a in appliers {
        let _ = a.join();
    }
    relay_cancel.cancel();
    let relayed = relay.await;
    result?;
    relayed??;
    Ok(())
}

fn applier_thread(cfg: Config, catalog: skein_sql::Catalog, rx: PartitionReceiver) {
    let partition = rx.partition;
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            error!(partition, error = %e, "cannot start the applier runtime");
            return;
        }
    };
    rt.block_on(async move {
        let setup = async {
            let source = Source::connect(&cfg).await?;
            let sidecar = AnySidecar::connect(cfg.sidecar_url(), &cfg.sidecar.schema).await?;
            anyhow::Ok(Applier::new(
                &cfg,
                &catalog,
                source,
                sidecar,
                IN_PROCESS_TOPIC,
                partition,
            ))
        };
        let mut applier = match setup.await {
            Ok(a) => Some(a),
            Err(e) => {
                error!(partition, error = %format!("{e:#}"), "applier could not start");
                None
            }
        };
        let span = tracing::info_span!("applier", partition);
        let _enter = span.enter();
        loop {
            let slice = match rx.recv_timeout(std::time::Duration::from_millis(200)) {
                Recv::Slice(s) => s,
                Recv::Idle => continue,
                Recv::Closed => break,
            };
            let Some(a) = applier.as_mut() else {
                slice.ack(Err(format!(
                    "applier for partition {partition} did not start"
                )));
                continue;
            };
            let b = &slice.batch;
            let res = a
                .apply(Input {
                    lower: b.lower.numeric(),
                    upper: b.upper.numeric(),
                    has_data_loss: b.has_data_loss,
                    records: &b.records,
                    dead_letters: 0,
                    kind: ProgressKind::Source,
                })
                .await;
            match res {
                Ok(_) => slice.ack(Ok(())),
                Err(e) => {
                    error!(partition, error = %e, "batch failed");
                    slice.ack(Err(e.to_string()));
                }
            }
        }
    });
}
