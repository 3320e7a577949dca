//! `skein relay`: the outbox to the sink, for a deployment that runs the
//! relay apart from the appliers.

use skein_applier::relay::{run_relay, RelayScope};
use skein_common::config::Config;

use super::{make_sink, shutdown_token, sidecar};

/// Relays every partition's pending rows, then keeps relaying until a signal.
pub async fn relay(cfg: Config) -> anyhow::Result<()> {
    let cancel = shutdown_token();
    super::metrics::serve(&cfg, "relay")?;
    run_relay(
        sidecar(&cfg).await?,
        make_sink(&cfg)?,
        skein_applier::relay::RelaySettings::from_config(&cfg),
        RelayScope::All,
        "relay".into(),
        // No applier in this process wakes it: the relay polls.
        None,
        cancel,
    )
    .await?;
    Ok(())
}
