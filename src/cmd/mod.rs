//! One module per subcommand: each builds its parts from the typed config
//! and calls the libraries. What several share (signals, the sink, the
//! Kafka client settings) is here.

pub mod apply;
pub mod explicit;
pub mod extract;
pub mod marker;
pub mod metrics;
pub mod relay;
pub mod replay;
pub mod run;
pub mod sidecar;
pub mod sql;
pub mod status;
pub mod validate;

use anyhow::bail;
use rdkafka::config::ClientConfig;
use skein_applier::run::TopicProgress;
use skein_applier::sidecar::{AnySidecar, Sidecar};
use skein_applier::sink::{DeadLettering, FileSink, KafkaSink, Sink, StdoutSink};
use skein_common::config::{self, Config, KafkaTransport, Transport};
use skein_common::{CheckpointKind, SourcePosition};
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

/// The configured sink; with `sink.on_reject: dead_letter`, events it
/// rejects go to its dead letter.
pub fn make_sink(cfg: &Config) -> anyhow::Result<Box<dyn Sink>> {
    let sink: Box<dyn Sink> = match &cfg.sink {
        config::Sink::Stdout => Box::new(StdoutSink),
        config::Sink::File { path, also_stdout } => Box::new(FileSink::open(path, *also_stdout)?),
        config::Sink::Kafka {
            brokers,
            topic_prefix,
            mode,
            kafka_properties,
        } => Box::new(KafkaSink::new(
            brokers,
            kafka_properties,
            topic_prefix,
            *mode,
        )?),
    };
    Ok(match cfg.on_reject {
        config::OnReject::Stop => sink,
        config::OnReject::DeadLetter => Box::new(DeadLettering(sink)),
    })
}

/// A connection to the configured sidecar.
pub async fn sidecar(cfg: &Config) -> anyhow::Result<AnySidecar> {
    Ok(AnySidecar::connect(cfg.sidecar_url(), &cfg.sidecar.schema).await?)
}

/// Creates or upgrades the sidecar schema and returns where the sidecar
/// says the pipeline had applied to on `topic` (the extractor's fallback
/// when its marker is gone). When `transport.partitions` differs from the
/// count records were last keyed by (or that count is unknown), `rekey`
/// decides first: it refuses (an error), or names partitions whose progress
/// to forget; then the new count is recorded.
pub async fn prepare_sidecar(
    cfg: &Config,
    topic: &str,
    kind: CheckpointKind,
    rekey: impl FnOnce(&TopicProgress) -> anyhow::Result<Vec<u32>>,
) -> anyhow::Result<Option<SourcePosition>> {
    let mut sc = sidecar(cfg).await?;
    sc.migrate().await?;
    skein_applier::identifiers::carry_over(cfg, &mut sc).await?;
    let known = TopicProgress::read(&mut sc, cfg, topic).await?;
    let floor = known.floor(kind)?;
    let configured = cfg.transport.partitions();
    if known.recorded != Some(configured) {
        let forget = rekey(&known)?;
        if !forget.is_empty() {
            warn!(
                topic,
                from = ?known.recorded,
                to = configured,
                partitions = ?forget,
                "transport.partitions changed (or the sidecar did not record it): forgetting the \
                 progress of partitions that committed past the restart point; their records are \
                 applied again and unchanged aggregates publish nothing"
            );
            sc.forget_progress(&cfg.name, topic, &forget).await?;
        }
        sc.record_partitions(&cfg.name, topic, configured).await?;
        if let Some(from) = known.recorded {
            info!(topic, from, to = configured, "transport.partitions changed");
        }
    }
    Ok(floor)
}

/// The Kafka transport of the config, for the commands that need one.
pub fn kafka(cfg: &Config) -> anyhow::Result<&KafkaTransport> {
    match &cfg.transport {
        Transport::Kafka(k) => Ok(k),
        Transport::InProcess(_) => bail!("this command needs `transport.kind: kafka`"),
    }
}

/// The librdkafka client settings of a Kafka transport.
pub fn kafka_client(k: &KafkaTransport) -> ClientConfig {
    skein_transporter::kafka::client_config(&k.brokers, &k.kafka_properties)
}

/// The relay task of `skein run` / `skein apply`.
pub type RelayTask = tokio::task::JoinHandle<skein_applier::Result<()>>;

/// Runs `work` (the extractor, or the applier loop) while watching the
/// relay: a relay that ends before it is told to (a sink that refuses an
/// event, a panic) cancels `cancel`, so the pipeline stops instead of going
/// on without publishing, and is returned to be reported first.
pub async fn watch_relay<T>(
    work: impl std::future::Future<Output = T>,
    relay: &mut RelayTask,
    cancel: &CancellationToken,
) -> (
    T,
    Option<Result<skein_applier::Result<()>, tokio::task::JoinError>>,
) {
    tokio::pin!(work);
    tokio::select! {
        done = &mut work => (done, None),
        ended = &mut *relay => {
            error!("the relay stopped; stopping the pipeline");
            cancel.cancel();
            (work.await, Some(ended))
        }
    }
}

/// The error of a relay that ended before it was told to.
pub fn relay_failure(
    ended: Result<skein_applier::Result<()>, tokio::task::JoinError>,
) -> anyhow::Error {
    match ended {
        Ok(Ok(())) => {
            anyhow::anyhow!("the relay stopped unexpectedly; outbox rows are no longer sent")
        }
        Ok(Err(e)) => anyhow::Error::from(e).context("the relay stopped"),
        Err(e) => anyhow::Error::from(e).context("the relay task failed"),
    }
}

/// How long a stop may take after SIGTERM or SIGINT before the process
/// exits without finishing it. A clean stop ends the batch at hand and
/// leaves the consumer group; a broker or database out of reach can hold
/// either forever (librdkafka's close, a sink flush), and a process that
/// only SIGKILL stops is a wedge. Exiting at the deadline is a crash as far
/// as the data goes, which every stage recovers from: an open sidecar
/// transaction rolls back, the marker and the slot stay where they were.
/// Under Kubernetes' default 30 s grace period.
pub const STOP_DEADLINE: std::time::Duration = std::time::Duration::from_secs(15);

/// A token cancelled by SIGTERM or SIGINT. The handlers are installed
/// before this returns, so a signal during start-up also stops cleanly.
/// A second signal, or [`STOP_DEADLINE`] after the first, ends the process
/// at once (exit status 1).
pub fn shutdown_token() -> CancellationToken {
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
        info!(deadline = ?STOP_DEADLINE, "shutting down (a second signal stops at once)");
        c.cancel();
        let why = tokio::select! {
            _ = term.recv() => "a second signal came",
            _ = int.recv() => "a second signal came",
            _ = tokio::time::sleep(STOP_DEADLINE) => "the stop took longer than its deadline",
        };
        error!(
            deadline = ?STOP_DEADLINE,
            "{why}: exiting without a clean stop; nothing is lost, the next start \
             goes on from the last committed batch (a broker or database out of reach, or a \
             batch that takes longer than that?)"
        );
        std::process::exit(1);
    });
    cancel
}
