//! `skein sidecar migrate`.

use skein_applier::sidecar::Sidecar;
use skein_common::config::Config;

/// Creates or upgrades the sidecar schema (idempotent).
pub async fn migrate(cfg: Config) -> anyhow::Result<()> {
    super::sidecar(&cfg).await?.migrate().await?;
    println!("sidecar schema {} is up to date", cfg.sidecar.schema);
    Ok(())
}
