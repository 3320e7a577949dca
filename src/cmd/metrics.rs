//! The Prometheus endpoint of the long-running commands (`run`,
//! `extract`, `apply`, `relay`): `--metrics-addr` / `metrics.addr`.
//!
//! The stages count and time what they do through the `metrics` facade
//! (names in [`skein_common::metrics`]). What only a query can tell (the
//! slot's lag in bytes, the outbox depth, the Kafka partitions' lag, the
//! explicit keys pending) is read every `metrics.refresh_ms` from the same
//! collection `skein status` prints, so both always agree.

use std::net::ToSocketAddrs;
use std::time::Duration;

use anyhow::Context;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
use serde_json::Value;
use skein_applier::sidecar::AnySidecar;
use skein_common::config::Config;
use skein_common::metrics as m;
use tracing::{info, warn};

/// Histogram buckets of the durations, in seconds: 1 ms to 5 min.
const DURATION_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
];

/// Serves `/metrics` when an address is configured, and refreshes the
/// queried gauges in the background. A port that cannot be bound is an
/// error: an operator who asked for metrics gets them or a reason.
pub fn serve(cfg: &Config, command: &'static str) -> anyhow::Result<()> {
    let Some(addr) = &cfg.metrics.addr else {
        return Ok(());
    };
    let at = addr
        .to_socket_addrs()
        .with_context(|| format!("metrics.addr `{addr}`"))?
        .next()
        .with_context(|| format!("metrics.addr `{addr}` resolves to no address"))?;
    PrometheusBuilder::new()
        .with_http_listener(at)
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), DURATION_BUCKETS)
        .context("the metrics histogram buckets")?
        .install()
        .with_context(|| format!("serving metrics on {at}"))?;
    m::describe();
    let entities: Vec<&str> = cfg.entities.iter().map(|e| e.name.as_str()).collect();
    // The pipeline-wide gauges come from the one extractor process.
    let pipeline = matches!(command, "run" | "extract");
    m::register(&entities, cfg.transport.partitions(), pipeline);
    metrics::gauge!(m::INFO, "command" => command, "version" => env!("CARGO_PKG_VERSION")).set(1.0);
    info!(addr = %at, "serving Prometheus metrics on /metrics");
    if pipeline {
        tokio::spawn(refresh(cfg.clone()));
    }
    Ok(())
}

/// Sets the queried gauges from the status at once and then every
/// `metrics.refresh_ms`, for as long as the process runs. A read that
/// fails or takes longer than the period (10 s at least) is counted and
/// said once; the gauges keep their last values, and
/// `skein_metrics_last_refresh_timestamp_seconds` tells how old they are.
async fn refresh(cfg: Config) {
    let period = Duration::from_millis(cfg.metrics.refresh_ms);
    let limit = period.max(Duration::from_secs(10));
    let mut sidecar: Option<AnySidecar> = None;
    let mut failing = false;
    loop {
        let read = async {
            let sc = match sidecar.take() {
                Some(sc) => sc,
                None => super::sidecar(&cfg).await?,
            };
            super::status::collect(&cfg, sidecar.insert(sc)).await
        };
        let status = match tokio::time::timeout(limit, read).await {
            Ok(s) => s,
            Err(_) => Err(anyhow::anyhow!("no answer within {limit:?}")),
        };
        match status {
            Ok(s) => {
                set_gauges(&s);
                metrics::gauge!(m::REFRESHED_AT).set(now_secs());
                if failing {
                    info!("metrics: the pipeline-wide gauges are refreshed again");
                    failing = false;
                }
            }
            Err(e) => {
                metrics::counter!(m::REFRESH_FAILURES).increment(1);
                // A new connection next time: this one may be what broke.
                sidecar = None;
                if !failing {
                    warn!(error = %format!("{e:#}"), "metrics: reading the lag and outbox depth failed; those gauges keep their last values until it works");
                    failing = true;
                }
            }
        }
        tokio::time::sleep(period).await;
    }
}

fn now_secs() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// The gauges a status holds.
fn set_gauges(s: &serde_json::Map<String, Value>) {
    let source = s.get("source").unwrap_or(&Value::Null);
    for (key, name, scale) in [
        ("lag_bytes", m::SOURCE_LAG_BYTES, 1.0),
        ("retained_bytes", m::SOURCE_RETAINED_BYTES, 1.0),
        ("unread_age_seconds", m::SOURCE_UNREAD_AGE, 1.0),
    ] {
        if let Some(v) = find_number(source, key) {
            metrics::gauge!(name).set(v * scale);
        }
    }
    if let Some(o) = s.get("outbox") {
        if let Some(n) = o["pending"].as_f64() {
            metrics::gauge!(m::OUTBOX_PENDING).set(n);
        }
        let oldest = o["oldest_pending_ms"].as_f64().unwrap_or(0.0);
        metrics::gauge!(m::OUTBOX_OLDEST_PENDING).set(oldest / 1000.0);
    }
    // Over Kafka: the log end minus the sidecar's progress. In process the
    // transport itself counts what it handed over (no `lag` here).
    for p in s
        .get("partitions")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        if let (Some(part), Some(lag)) = (p["partition"].as_u64(), p["lag"].as_f64()) {
            metrics::gauge!(m::TRANSPORT_LAG, "partition" => part.to_string()).set(lag.max(0.0));
        }
    }
    let pending: f64 = s
        .get("explicit")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|r| r["pending"].as_f64())
        .sum();
    metrics::gauge!(m::EXPLICIT_PENDING).set(pending);
}

/// The first number under `key` anywhere in `v` (the source's status
/// nests per dialect).
fn find_number(v: &Value, key: &str) -> Option<f64> {
    match v {
        Value::Object(o) => o
            .get(key)
            .and_then(Value::as_f64)
            .or_else(|| o.values().find_map(|x| find_number(x, key))),
        Value::Array(a) => a.iter().find_map(|x| find_number(x, key)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn find_number_reads_nested_keys_of_both_dialects() {
        let pg = serde_json::json!({ "slot": "s", "lag_bytes": 42, "retained_bytes": null });
        assert_eq!(find_number(&pg, "lag_bytes"), Some(42.0));
        assert_eq!(find_number(&pg, "retained_bytes"), None);
        let ms = serde_json::json!({ "max_lsn": "0x1", "cleanup": { "unread_age_seconds": 7 } });
        assert_eq!(find_number(&ms, "unread_age_seconds"), Some(7.0));
    }
}
