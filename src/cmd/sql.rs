//! `skein sql source` / `skein sql sidecar`: the DDL to run by hand.

use anyhow::bail;
use skein_applier::sidecar::is_postgres_url;
use skein_common::config::{Config, SourceKind};
use skein_common::Dialect;

/// CDC enablement for the configured entities (printed, or run with
/// `apply`). `sqlserver`: the dialect asked for, which must be the source's.
pub async fn source(cfg: &Config, sqlserver: Option<bool>, apply: bool) -> anyhow::Result<()> {
    if let Some(wants) = sqlserver {
        if wants != (cfg.source.kind() == SourceKind::Sqlserver) {
            bail!(
                "the config's source is {:?}: `skein sql source` prints the statements for \
                 that source's own dialect",
                cfg.source.kind()
            );
        }
    }
    let setup = skein_extractor::admin::enable_cdc(cfg, apply).await?;
    match setup.applied {
        Some(what) => eprintln!("applied: {what}"),
        None => print!("{}", setup.ddl),
    }
    Ok(())
}

/// The sidecar schema DDL, in the asked dialect or the sidecar URL's.
pub fn sidecar(cfg: &Config, sqlserver: Option<bool>) -> anyhow::Result<()> {
    let tsql = sqlserver.unwrap_or_else(|| !is_postgres_url(cfg.sidecar_url().expose()));
    let dialect = if tsql {
        Dialect::SqlServer
    } else {
        Dialect::Postgres
    };
    print!("{}", skein_sql::sidecar_ddl(dialect, &cfg.sidecar.schema));
    Ok(())
}
