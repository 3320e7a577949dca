//! `skein replay`: rewinds the sidecar progress of the appliers' group so
//! the records from the given offset (or time) are consumed again.
//!
//! Without `republish` the version table still holds each aggregate's last
//! etag, so an unchanged aggregate publishes nothing again; with it the
//! stored versions of the aggregates in the replayed range are cleared and
//! each publishes once more. The stored source position is cleared too, so
//! the replayed records are not dropped as re-sends.

use std::collections::BTreeMap;

use anyhow::{bail, Context};
use skein_applier::sidecar::{Rewind, Sidecar};
use skein_common::config::Config;
use skein_transporter::kafka::{plan_replay, ReplayFrom};
use tracing::warn;

use super::{kafka, kafka_client, sidecar};

/// `--offset` or `--from-time` (RFC 3339, or milliseconds since the Unix epoch).
pub fn from(offset: Option<i64>, from_time: Option<String>) -> anyhow::Result<ReplayFrom> {
    Ok(match (offset, from_time) {
        (Some(o), _) => ReplayFrom::Offset(o),
        (None, Some(t)) => ReplayFrom::Time(parse_time_ms(&t)?),
        (None, None) => bail!("give --offset or --from-time"),
    })
}

fn parse_time_ms(s: &str) -> anyhow::Result<i64> {
    if let Ok(ms) = s.parse::<i64>() {
        return Ok(ms);
    }
    let t = chrono::DateTime::parse_from_rfc3339(s).with_context(|| {
        format!("--from-time `{s}`: use RFC 3339 (2024-05-01T12:00:00Z) or epoch milliseconds")
    })?;
    Ok(t.timestamp_millis())
}

/// The flags of `skein replay`.
pub struct How {
    /// Clear the replayed aggregates' versions so each publishes again.
    pub republish: bool,
    /// Rewind although appliers run (they are fenced and re-seek).
    pub force_while_running: bool,
    /// Allow moving a partition forward past records never applied.
    pub continue_with_data_loss: bool,
}

/// Plans the rewind from Kafka, refuses while appliers run (unless
/// forced), then rewinds in one sidecar transaction.
pub async fn replay(
    cfg: Config,
    partition: Option<u32>,
    from: ReplayFrom,
    how: How,
) -> anyhow::Result<()> {
    let How {
        republish,
        force_while_running,
        continue_with_data_loss,
    } = how;
    let k = kafka(&cfg)?;
    let (kc, topic, group) = (kafka_client(k), k.topic.clone(), k.group.clone());
    let parts: Vec<u32> = match partition {
        Some(p) if p >= k.partitions => bail!(
            "partition {p} does not exist (transport.partitions is {})",
            k.partitions
        ),
        Some(p) => vec![p],
        None => (0..k.partitions).collect(),
    };
    let mut sidecar = sidecar(&cfg).await?;
    let mut current = BTreeMap::new();
    for p in parts {
        let pr = sidecar.progress(&cfg.name, &topic, p).await?;
        current.insert(p, pr.map(|x| x.offset()));
    }
    let plan = {
        let (group, topic) = (group.clone(), topic.clone());
        tokio::task::spawn_blocking(move || {
            plan_replay(
                &kc,
                &group,
                &topic,
                &current,
                from,
                republish,
                continue_with_data_loss,
            )
        })
        .await??
    };
    if !plan.members.is_empty() && !force_while_running {
        bail!(
            "appliers of group `{group}` are active: {}. Stop them first, or add --force-while-running \
             (they are fenced at their next commit and re-seek to the rewound progress)",
            plan.members.join(", ")
        );
    }
    if plan.targets.is_empty() {
        println!("nothing to rewind: every selected partition is already at or before that point");
        return Ok(());
    }
    sidecar
        .rewind(&Rewind {
            group: cfg.name.clone(),
            topic: topic.clone(),
            partitions: plan
                .targets
                .iter()
                .map(|(p, (cur, to))| (*p as i32, *cur, *to))
                .collect(),
            forget: if republish {
                plan.affected.iter().cloned().collect()
            } else {
                vec![]
            },
        })
        .await?;
    for (p, (cur, to)) in &plan.targets {
        println!("partition {p}: progress {cur} -> {to}");
        if to > cur {
            warn!(
                partition = p,
                from = cur,
                to,
                "progress moved forward: the records in between are never applied"
            );
        }
    }
    if republish {
        println!(
            "cleared the stored versions of {} aggregate(s): they publish again",
            plan.affected.len()
        );
    } else {
        println!(
            "stored versions kept: aggregates whose state did not change publish nothing again"
        );
    }
    warn!(group = %group, topic = %topic, republish, partitions = ?plan.targets.keys().collect::<Vec<_>>(), "progress rewound");
    Ok(())
}
