//! `skein extract`: the extractor alone, producing to the Kafka change topic.

use skein_applier::run::repartition_check;
use skein_common::config::Config;
use skein_common::CheckpointKind;
use skein_extractor::{AnySource, MarkerStore, SledMarkerStore};
use skein_transporter::kafka::{ensure_topic, watermarks, KafkaTransport};

use super::{kafka, kafka_client, prepare_sidecar, shutdown_token};

/// Runs the extractor until a signal or an error.
pub async fn extract(cfg: Config) -> anyhow::Result<()> {
    let cancel = shutdown_token();
    super::metrics::serve(&cfg, "extract")?;
    let k = kafka(&cfg)?;
    let (kc, topic) = (kafka_client(k), &k.topic);
    let markers = std::sync::Arc::new(SledMarkerStore::open(&cfg.state_dir)?);
    let first_start = markers.load()?.is_none();
    let in_topic = ensure_topic(&kc, topic, k.partitions, k.replication_factor).await?;
    // Where the appliers had got to, should the marker be gone; a changed
    // partition count only once every partition is applied to its log end.
    // A sidecar that never recorded the count: the topic's is the evidence
    // (skein creates it with the configured count).
    let floor = prepare_sidecar(&cfg, topic, CheckpointKind::Offset, |known| {
        let recorded = known.recorded.unwrap_or(in_topic);
        if recorded == k.partitions {
            return Ok(vec![]);
        }
        let marks = tokio::task::block_in_place(|| watermarks(&kc, topic, in_topic))?;
        let behind: Vec<String> = marks
            .iter()
            .zip(0u32..)
            .filter_map(|(&(low, high), p)| {
                let next = known
                    .progress
                    .iter()
                    .find(|(q, _)| *q == p)
                    .map_or(low, |(_, at)| at.offset());
                (next < high)
                    .then(|| format!("partition {p} is applied up to offset {next} of {high}"))
            })
            .collect();
        repartition_check(topic, recorded, k.partitions, &behind)?;
        Ok(vec![])
    })
    .await?;
    let transport =
        KafkaTransport::for_topic(&kc, topic, k.partitions, k.records_per_message).await?;
    super::explicit::plan_initial_load(&cfg, first_start && floor.is_none()).await?;
    let mut source = AnySource::connect(&cfg).await?;
    let loading = tokio::spawn(super::explicit::initial_load(
        cfg.clone(),
        markers.clone(),
        cancel.clone(),
    ));
    let result = skein_extractor::run(
        &cfg,
        &mut source,
        &*markers,
        floor,
        &transport,
        cancel.clone(),
    )
    .await;
    cancel.cancel();
    let _ = loading.await;
    result?;
    Ok(())
}
