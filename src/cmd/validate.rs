//! `skein validate`: the config against the source; what is wrong, with the
//! SQL that fixes it.

use anyhow::bail;
use skein_common::config::Config;

/// Prints the problems found (and notes); fails when there is any.
pub async fn validate(cfg: &Config) -> anyhow::Result<()> {
    let v = skein_extractor::admin::validate(cfg).await?;
    for n in &v.notes {
        println!("note: {n}");
    }
    if v.problems.is_empty() {
        println!("ok: {}", v.ok);
        return Ok(());
    }
    for p in &v.problems {
        println!("problem: {p}\n");
    }
    bail!("{} problem(s) found", v.problems.len())
}
