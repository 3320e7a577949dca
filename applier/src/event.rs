//! CloudEvents 1.0 (structured JSON) for a decision. Pure.

use chrono::{DateTime, SecondsFormat, Utc};
use serde::Serialize;
use serde_json::Value;
use skein_common::config::{ActionFormat, EntityConfig, EventsConfig};
use skein_common::RootKey;

use crate::decide::{Action, Decision};

/// The spelling of an action.
pub fn action_name(a: Action, format: ActionFormat) -> &'static str {
    match (a, format) {
        (Action::Created, ActionFormat::PastTense) => "created",
        (Action::Updated, ActionFormat::PastTense) => "updated",
        (Action::Deleted, ActionFormat::PastTense) => "deleted",
        (Action::Created, ActionFormat::PresentTense) => "create",
        (Action::Updated, ActionFormat::PresentTense) => "update",
        (Action::Deleted, ActionFormat::PresentTense) => "delete",
    }
}

/// Microseconds since the Unix epoch as RFC 3339 UTC with microseconds.
pub fn rfc3339_micros(micros: i64) -> String {
    DateTime::<Utc>::from_timestamp_micros(micros)
        .unwrap_or_default()
        .to_rfc3339_opts(SecondsFormat::Micros, true)
}

/// Everything an event needs besides the decision.
pub struct EventContext<'a> {
    /// Naming.
    pub events: &'a EventsConfig,
    /// The entity.
    pub entity: &'a EntityConfig,
    /// Event id (fixed when the outbox row is written).
    pub id: &'a str,
    /// The batch's correlation id.
    pub correlation_id: &'a str,
    /// Source commit time of the latest change (µs since the Unix epoch).
    pub time_micros: i64,
    /// The aggregate's global identifier (`identifier_mapping`): the
    /// `globalid` extension.
    pub global_id: Option<&'a str>,
}

/// The CloudEvent of a decision, borrowed: its fields in the order
/// serde_json's (sorted) maps print them, so the text is the same as that
/// of the [`Value`] [`build_event`] gives, without copying `data` into one.
#[derive(Serialize)]
struct EventRef<'a> {
    action: &'static str,
    correlationid: &'a str,
    data: &'a Value,
    datacontenttype: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    etag: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    globalid: Option<&'a str>,
    id: &'a str,
    key: &'a str,
    partitionkey: &'a str,
    source: String,
    specversion: &'static str,
    subject: String,
    time: String,
    #[serde(rename = "type")]
    kind: String,
}

/// Runs `f` on the event of `d`. Frozen: golden files pin its shape.
fn with_event<R>(
    ctx: &EventContext<'_>,
    key: &RootKey,
    d: &Decision,
    f: impl FnOnce(&EventRef<'_>) -> R,
) -> R {
    let action = action_name(d.action, ctx.events.action_format);
    let key_text = key.to_string();
    f(&EventRef {
        action,
        correlationid: ctx.correlation_id,
        data: &d.data,
        datacontenttype: "application/json",
        etag: d.etag.as_deref(),
        globalid: ctx.global_id,
        id: ctx.id,
        key: &key_text,
        partitionkey: &key_text,
        source: format!(
            "{}/{}/{}",
            ctx.events.source_root.trim_end_matches('/'),
            ctx.entity.schema,
            ctx.entity.table
        ),
        specversion: "1.0",
        subject: format!("{}.{}", ctx.entity.name, key_text),
        time: rfc3339_micros(ctx.time_micros),
        kind: format!("{}.{}.{}", ctx.events.type_root, ctx.entity.name, action),
    })
}

/// Builds the CloudEvent as JSON text: what the outbox stores.
pub fn event_text(ctx: &EventContext<'_>, key: &RootKey, d: &Decision) -> String {
    with_event(ctx, key, d, |e| {
        serde_json::to_string(e).expect("an event of JSON values serialises")
    })
}

/// Builds the CloudEvent as a [`Value`].
pub fn build_event(ctx: &EventContext<'_>, key: &RootKey, d: &Decision) -> Value {
    with_event(ctx, key, d, |e| {
        serde_json::to_value(e).expect("an event of JSON values serialises")
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use serde_json::json;
    use skein_common::Config;

    use super::*;

    /// The event of `d` for the `customer` entity of a minimal config,
    /// as the applier builds it (tests of what reads events use it too).
    pub(crate) fn customer_event(key: &RootKey, d: &Decision, time_micros: i64) -> Value {
        let cfg = Config::from_yaml(
            "source: { kind: postgres, url: x }\nevents: { source_root: /contoso/crm/, type_root: contoso }\nentities: [{ name: customer, table: customer }]\n",
            "t",
        )
        .unwrap();
        let ctx = EventContext {
            events: &cfg.events,
            entity: &cfg.entities[0],
            id: "00000000-0000-0000-0000-000000000001",
            correlation_id: "c",
            time_micros,
            global_id: None,
        };
        build_event(&ctx, key, d)
    }

    #[test]
    fn event_has_the_cloudevents_shape() {
        let key = RootKey(vec![Some("1".into()), Some("a".into())]);
        let d = Decision {
            action: Action::Updated,
            data: json!({"id": 1}),
            etag: Some("e".into()),
        };
        let ev = customer_event(&key, &d, 1_700_000_000_123_456);
        assert_eq!(ev["source"], "/contoso/crm/public/customer");
        assert_eq!(ev["type"], "contoso.customer.updated");
        assert_eq!(ev["subject"], "customer.1,a");
        assert_eq!(ev["time"], "2023-11-14T22:13:20.123456Z");
        assert_eq!(ev["etag"], "e");
        let del = Decision {
            action: Action::Deleted,
            data: json!({"id": 1}),
            etag: None,
        };
        assert!(customer_event(&key, &del, 0).get("etag").is_none());
    }

    /// The outbox text is the text of the event as a JSON value, field for
    /// field and byte for byte, with and without etag and global id.
    #[test]
    fn event_text_is_the_text_of_the_event_value() {
        let cfg = Config::from_yaml(
            "source: { kind: postgres, url: x }\nevents: { source_root: /c/, type_root: c }\nentities: [{ name: customer, table: customer }]\n",
            "t",
        )
        .unwrap();
        let key = RootKey(vec![Some("7".into())]);
        for (etag, global_id) in [(Some("e"), Some("g")), (None, None), (Some("e"), None)] {
            let ctx = EventContext {
                events: &cfg.events,
                entity: &cfg.entities[0],
                id: "i",
                correlation_id: "c",
                time_micros: 1_700_000_000_123_456,
                global_id,
            };
            let d = Decision {
                action: Action::Updated,
                data: json!({"z": [{"b": 1, "a": null}], "id": 7, "é": "ü"}),
                etag: etag.map(str::to_string),
            };
            // The shape as it was first built, with json!.
            let mut want = json!({
                "specversion": "1.0",
                "id": "i",
                "source": "/c/public/customer",
                "type": "c.customer.updated",
                "subject": "customer.7",
                "time": "2023-11-14T22:13:20.123456Z",
                "datacontenttype": "application/json",
                "data": d.data,
                "action": "updated",
                "key": "7",
                "partitionkey": "7",
                "correlationid": "c",
            });
            if let Some(t) = etag {
                want["etag"] = json!(t);
            }
            if let Some(g) = global_id {
                want["globalid"] = json!(g);
            }
            assert_eq!(event_text(&ctx, &key, &d), want.to_string());
            assert_eq!(build_event(&ctx, &key, &d), want);
        }
    }
}
