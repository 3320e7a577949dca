//! `skein marker show` / `skein marker reset`: the extractor's marker.

use anyhow::bail;
use skein_common::config::Config;
use skein_common::SourcePosition;
use skein_extractor::marker::now_stamp;
use skein_extractor::{Marker, MarkerStore, SledMarkerStore};

/// Prints the stored marker.
pub fn show(cfg: &Config) -> anyhow::Result<()> {
    let store = SledMarkerStore::open(&cfg.state_dir)?;
    match store.load()? {
        None => println!("no marker yet (the pipeline has not started)"),
        Some(m) => {
            println!(
                "position {}  has_data_loss {}  updated_at {}",
                m.position, m.has_data_loss, m.updated_at
            );
            if let Some(f) = m.in_flight {
                println!(
                    "in flight: {} changes of the transaction ending at {} are handed over{}",
                    f.changes,
                    f.end,
                    f.seqval
                        .map(|s| format!(" (up to __$seqval {s})"))
                        .unwrap_or_default()
                );
            }
        }
    }
    Ok(())
}

/// Moves the marker to `to` or the source's end (`latest`); moving it
/// forward skips changes and needs `continue_with_data_loss`, which is
/// recorded in the marker.
pub async fn reset(
    cfg: &Config,
    to: Option<String>,
    latest: bool,
    continue_with_data_loss: bool,
) -> anyhow::Result<()> {
    let store = SledMarkerStore::open(&cfg.state_dir)?;
    let old = store.load()?;
    let position: SourcePosition = match (to, latest) {
        (Some(t), false) => {
            let p: SourcePosition = t.parse()?;
            if p.dialect() != cfg.source.dialect() {
                bail!(
                    "{t} is not a position of this source ({:?})",
                    cfg.source.kind()
                );
            }
            p
        }
        (None, true) => skein_extractor::admin::head(cfg).await?,
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
        // The sidecar learns of the skipped changes from the next batch.
        loss_unreported: old.as_ref().is_some_and(|m| m.loss_unreported) || skips,
        // A transaction in flight is read again whole (appliers drop what
        // they applied of it by position).
        in_flight: None,
    };
    store.reset(&m)?;
    tracing::warn!(from = ?old.map(|m| m.position.to_string()), to = %position, "marker reset");
    println!("marker set to {position}");
    Ok(())
}
