//! `skein status`: lag per stage, as JSON (stable keys, for scripts and
//! tests).
//!
//! * `source`: what the source reports (see `skein_extractor::admin::status`);
//! * `partitions`: per partition the sidecar progress and, for Kafka, the
//!   log end and the lag between them;
//! * `outbox`: rows not yet relayed and the age of the oldest;
//! * `relay_lease`: how many relays hold the sidecar's relay lease (one of
//!   every partition, or any number of partition relays; others stand by);
//! * `relays`: each relay's last reported state (`standing by`, `running`,
//!   `retrying`, `stopped`), last error with its time, and `updated_at`
//!   (a running relay refreshes it every 10 s). A relay killed without a
//!   chance to report keeps its last state: an old `updated_at`, or no
//!   holder in `relay_lease`, says it is not running;
//! * `explicit`: explicit runs (`skein explicit`, the initial load), every
//!   unfinished one and the last five others: keys queued, still pending,
//!   published, and whether all are.

use skein_applier::sidecar::{AnySidecar, Sidecar};
use skein_common::config::{Config, Transport};
use skein_common::SourcePosition;
use skein_transporter::IN_PROCESS_TOPIC;

use super::{kafka_client, sidecar};

/// Prints the status.
pub async fn status(cfg: Config) -> anyhow::Result<()> {
    let out = collect(&cfg, &mut sidecar(&cfg).await?).await?;
    println!("{}", serde_json::to_string_pretty(&out)?);
    Ok(())
}

/// The status as a JSON object (also what the metrics' gauges are read
/// from, so both always agree).
pub async fn collect(
    cfg: &Config,
    sidecar: &mut AnySidecar,
) -> anyhow::Result<serde_json::Map<String, serde_json::Value>> {
    let mut out = serde_json::Map::new();
    let (topic, ends) = match &cfg.transport {
        Transport::InProcess(_) => (IN_PROCESS_TOPIC.to_string(), None),
        Transport::Kafka(k) => {
            let (kc, topic) = (kafka_client(k), k.topic.clone());
            let (t, n) = (topic.clone(), k.partitions);
            let ends = tokio::task::spawn_blocking(move || {
                skein_transporter::kafka::watermarks(&kc, &t, n)
            })
            .await??;
            (topic, Some(ends))
        }
    };
    let mut parts = vec![];
    let mut total_lag = 0i64;
    // The lowest source position applied (in-process): where what the
    // source must still keep for the pipeline begins.
    let mut applied: Option<Option<SourcePosition>> = None;
    for p in 0..cfg.transport.partitions() {
        let pr = sidecar.progress(&cfg.name, &topic, p).await?;
        if ends.is_none() {
            let at = match &pr {
                Some(x) => Some(SourcePosition::from_numeric(
                    cfg.source.dialect(),
                    x.position,
                )?),
                None => None,
            };
            applied = Some(match applied {
                None => at,
                Some(low) => low.min(at),
            });
        }
        let progress: serde_json::Value = match (&pr, &ends) {
            (None, _) => serde_json::Value::Null,
            (Some(x), Some(_)) => x.offset().into(),
            (Some(x), None) => {
                SourcePosition::describe_numeric(cfg.source.dialect(), x.position).into()
            }
        };
        let mut v = serde_json::json!({ "partition": p, "progress": progress });
        if let Some(k) = pr.as_ref().and_then(|x| x.recheck_after.as_ref()) {
            // A TRUNCATE re-check under way: the last key it re-checked.
            v["truncate_recheck_after"] = k.clone().into();
        }
        if let Some(ends) = &ends {
            let (low, high) = ends[p as usize];
            // No progress yet: everything from the log start is pending.
            let lag = high - pr.as_ref().map(|x| x.offset()).unwrap_or(low);
            total_lag += lag.max(0);
            v["log_start"] = low.into();
            v["log_end"] = high.into();
            v["lag"] = lag.into();
        }
        parts.push(v);
    }
    let applied = match ends {
        Some(_) => skein_extractor::admin::Applied::Offsets,
        None => skein_extractor::admin::Applied::Source(applied.flatten()),
    };
    out.insert(
        "source".into(),
        skein_extractor::admin::status(cfg, applied).await?,
    );
    out.insert("topic".into(), topic.into());
    out.insert("partitions".into(), parts.into());
    if ends.is_some() {
        out.insert("transport_lag".into(), total_lag.into());
    }
    let (pending, oldest_ms) = sidecar.pending().await?;
    out.insert(
        "outbox".into(),
        serde_json::json!({ "pending": pending, "oldest_pending_ms": oldest_ms }),
    );
    // Who relays: one relay of every partition (exclusive) or appliers
    // relaying their partitions (shared); others stand by.
    out.insert(
        "relay_lease".into(),
        match sidecar.relay_lease_holders().await? {
            Some((exclusive, shared)) => {
                serde_json::json!({ "all_partitions": exclusive, "partition_relays": shared })
            }
            None => serde_json::Value::Null,
        },
    );
    out.insert(
        "relays".into(),
        serde_json::to_value(sidecar.relay_states().await?)?,
    );
    // Explicit runs: every unfinished one and the last five others, with
    // how many of their keys the appliers published.
    let runs: Vec<serde_json::Value> = sidecar
        .explicit_runs(&cfg.name, 5)
        .await?
        .into_iter()
        .map(|r| {
            let mut v = serde_json::to_value(&r).unwrap_or_default();
            v["published"] = (r.queued - r.pending).into();
            v["finished"] = r.finished().into();
            v
        })
        .collect();
    out.insert("explicit".into(), runs.into());
    Ok(out)
}
