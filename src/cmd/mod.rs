//! One module per subcommand: each builds its parts from the typed config
//! and calls the libraries. What several share (signals, the sink, the
//! Kafka client settings) is here.

pub mod apply;
pub mod extract;
pub mod marker;
pub mod relay;
pub mod replay;
pub mod run;
pub mod sidecar;
pub mod sql;
pub mod status;
pub mod validate;

use anyhow::{bail, Context};
use rdkafka::config::ClientConfig;
use skein_applier::sidecar::AnySidecar;
use skein_applier::sink::{FileSink, KafkaSink, Sink, StdoutSink};
use skein_common::config::{Config, SinkKind, TransportKind};
use tokio_util::sync::CancellationToken;
use tracing::{error, info};

/// The configured sink.
pub fn make_sink(cfg: &Config) -> anyhow::Result<Box<dyn Sink>> {
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

/// A connection to the configured sidecar.
pub async fn sidecar(cfg: &Config) -> anyhow::Result<AnySidecar> {
    Ok(AnySidecar::connect(cfg.sidecar_url(), &cfg.sidecar.schema).await?)
}

/// The Kafka client settings and change topic of a Kafka transport config.
pub fn kafka_transport(cfg: &Config) -> anyhow::Result<(ClientConfig, String)> {
    if cfg.transport.kind != TransportKind::Kafka {
        bail!("this command needs `transport.kind: kafka`");
    }
    let brokers = cfg
        .transport
        .brokers
        .as_deref()
        .context("transport.brokers")?;
    let topic = cfg.transport.topic.clone().context("transport.topic")?;
    Ok((
        skein_transporter::kafka::client_config(brokers, &cfg.transport.kafka_properties),
        topic,
    ))
}

/// A token cancelled by SIGTERM or SIGINT. The handlers are installed
/// before this returns, so a signal during start-up also stops cleanly.
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
        info!("shutting down");
        c.cancel();
    });
    cancel
}
