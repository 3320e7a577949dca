//! `skein extract`: the extractor alone, producing to the Kafka change topic.

use skein_common::config::Config;
use skein_common::CheckpointKind;
use skein_extractor::{AnySource, SledMarkerStore};
use skein_transporter::kafka::{ensure_topic, KafkaTransport};

use super::{kafka, kafka_client, migrated_floor, shutdown_token};

/// Runs the extractor until a signal or an error.
pub async fn extract(cfg: Config) -> anyhow::Result<()> {
    let cancel = shutdown_token();
    let k = kafka(&cfg)?;
    let (kc, topic) = (kafka_client(k), &k.topic);
    let markers = SledMarkerStore::open(&cfg.state_dir)?;
    // Where the appliers had got to, should the marker be gone.
    let floor = migrated_floor(&cfg, topic, CheckpointKind::Offset).await?;
    ensure_topic(&kc, topic, k.partitions, k.replication_factor).await?;
    let transport = KafkaTransport::new(&kc, topic, k.partitions)?;
    let mut source = AnySource::connect(&cfg).await?;
    skein_extractor::run(&cfg, &mut source, &markers, floor, &transport, cancel).await?;
    Ok(())
}
