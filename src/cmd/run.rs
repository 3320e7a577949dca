//! `skein run`: extractor, in-process transport, appliers and relay in one
//! process (the embedded default).

use anyhow::bail;
use skein_applier::relay::{run_relay, RelayScope, RelayWake};
use skein_applier::run::rekey_in_process;
use skein_common::config::{Config, Transport};
use skein_common::CheckpointKind;
use skein_extractor::{AnySource, MarkerStore, SledMarkerStore};
use skein_transporter::InProcess;
use skein_transporter::IN_PROCESS_TOPIC;
use tokio_util::sync::CancellationToken;

use super::{make_sink, prepare_sidecar, relay_failure, shutdown_token, sidecar, watch_relay};

/// Runs until SIGTERM/SIGINT or an error; stops in order: the extractor
/// ends → the inbox closes and the appliers drain → the relay drains.
pub async fn run(cfg: Config) -> anyhow::Result<()> {
    let cancel = shutdown_token();
    super::metrics::serve(&cfg, "run")?;
    let Transport::InProcess(t) = &cfg.transport else {
        bail!("`skein run` uses the in-process transport; set `transport.kind: in-process`");
    };
    let markers = std::sync::Arc::new(SledMarkerStore::open(&cfg.state_dir)?);
    let kind = CheckpointKind::Source(cfg.source.dialect());
    // Re-keyed records must not land in a partition whose progress already
    // covers them: see `rekey_in_process`.
    let marker = markers.load()?.map(|m| m.position.numeric());
    let floor = prepare_sidecar(&cfg, IN_PROCESS_TOPIC, kind, |known| {
        Ok(rekey_in_process(known, marker))
    })
    .await?;
    super::explicit::plan_initial_load(&cfg, marker.is_none() && floor.is_none()).await?;
    let mut source = AnySource::connect(&cfg).await?;
    let catalog = source.catalog().clone();
    skein_applier::check_identifier_mapping(&cfg, &catalog).await?;
    let (transport, mut inbox) =
        InProcess::new(t.partitions, t.channel_capacity, cfg.source.dialect());
    let wake = RelayWake::default();
    let appliers = {
        let (cfg, wake, interrupt) = (cfg.clone(), wake.clone(), cancel.clone());
        // The in-process appliers stop when the extractor's side closes,
        // not on the signal: what was sent is applied first, but for the
        // rest of a TRUNCATE re-check (the signal interrupts it between
        // pages; the extractor sends its batch again at the next start).
        tokio::spawn(async move {
            skein_applier::run(
                &cfg,
                &catalog,
                &mut inbox,
                None,
                wake,
                CancellationToken::new(),
                interrupt,
            )
            .await
        })
    };
    let relay_cancel = CancellationToken::new();
    let mut relay = tokio::spawn(run_relay(
        sidecar(&cfg).await?,
        make_sink(&cfg)?,
        skein_applier::relay::RelaySettings::from_config(&cfg),
        RelayScope::All,
        "relay".into(),
        Some(wake),
        relay_cancel.clone(),
    ));
    let loading = tokio::spawn(super::explicit::initial_load(
        cfg.clone(),
        markers.clone(),
        cancel.clone(),
    ));
    let extraction = skein_extractor::run(
        &cfg,
        &mut source,
        &*markers,
        floor,
        &transport,
        cancel.clone(),
    );
    let (result, relay_died) = watch_relay(extraction, &mut relay, &cancel).await;
    cancel.cancel();
    let _ = loading.await;
    drop(transport);
    let applied = appliers.await;
    if let Some(ended) = relay_died {
        // The relay is the cause of the stop: report it first.
        return Err(relay_failure(ended));
    }
    relay_cancel.cancel();
    let relayed = relay.await;
    // An applier that failed is the cause of the extractor's "applier
    // failed / gone": report it first.
    applied??;
    result?;
    relayed??;
    Ok(())
}
