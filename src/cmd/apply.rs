//! `skein apply`: one member of the appliers' Kafka consumer group (start 1
//! or N), relaying the outbox rows of the partitions it owns.

use std::sync::Arc;
use std::time::Duration;

use skein_applier::relay::{run_relay, RelayScope, RelayWake};
use skein_applier::run::{resume_from_sidecar, Owned};
use skein_applier::sidecar::Sidecar;
use skein_common::config::Config;
use skein_transporter::kafka::{dlq_topic, ensure_topic, InboxSettings, KafkaInbox};
use tokio_util::sync::CancellationToken;

use super::{kafka, kafka_client, make_sink, relay_failure, shutdown_token, sidecar, watch_relay};

/// Runs the applier until a signal or an error.
pub async fn apply(cfg: Config, instance_id: Option<String>) -> anyhow::Result<()> {
    let cancel = shutdown_token();
    super::metrics::serve(&cfg, "apply")?;
    let k = kafka(&cfg)?;
    let (kc, topic) = (kafka_client(k), k.topic.clone());
    let mut sc = sidecar(&cfg).await?;
    sc.migrate().await?;
    skein_applier::identifiers::carry_over(&cfg, &mut sc).await?;
    drop(sc);
    let catalog = skein_extractor::load_catalog(&cfg).await?;
    skein_applier::check_identifier_mapping(&cfg, &catalog).await?;
    for t in [topic.clone(), dlq_topic(&topic)] {
        ensure_topic(&kc, &t, k.partitions, k.replication_factor).await?;
    }
    let owned: Owned = Arc::default();
    let wake = RelayWake::default();
    let relay_cancel = CancellationToken::new();
    let mut relay = if k.relay_in_apply {
        Some(tokio::spawn(run_relay(
            sidecar(&cfg).await?,
            make_sink(&cfg)?,
            skein_applier::relay::RelaySettings::from_config(&cfg),
            RelayScope::Partitions(owned.clone()),
            format!(
                "apply {}",
                instance_id
                    .clone()
                    .unwrap_or_else(|| format!("pid {}", std::process::id()))
            ),
            Some(wake.clone()),
            relay_cancel.clone(),
        )))
    } else {
        None
    };
    let settings = InboxSettings {
        topic: topic.clone(),
        group: k.group.clone(),
        instance_id,
        entities: cfg.entities.iter().map(|e| e.name.clone()).collect(),
        max_records: k.max_batch_records,
        wait: Duration::from_millis(k.batch_wait_ms),
    };
    let resume = resume_from_sidecar(&cfg, &topic, tokio::runtime::Handle::current());
    let mut inbox = KafkaInbox::new(&kc, settings, resume)?;
    let applying = skein_applier::run(
        &cfg,
        &catalog,
        &mut inbox,
        Some(owned),
        wake,
        cancel.clone(),
        cancel.clone(),
    );
    let (result, relay_died) = match relay.as_mut() {
        Some(relay) => watch_relay(applying, relay, &cancel).await,
        None => (applying.await, None),
    };
    inbox.close().await;
    if let Some(ended) = relay_died {
        return Err(relay_failure(ended));
    }
    relay_cancel.cancel();
    if let Some(r) = relay {
        r.await??;
    }
    Ok(result?)
}
