//! CloudEvents 1.0 (structured JSON) for a decision. Pure.

use chrono::{DateTime, SecondsFormat, Utc};
use serde_json::{json, Value};
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

/// Builds the CloudEvent. Frozen: golden files pin its shape.
pub fn build_event(ctx: &EventContext<'_>, key: &RootKey, d: &Decision) -> Value {
    let action = action_name(d.action, ctx.events.action_format);
    let key_text = key.to_string();
    let mut ev = json!({
        "specversion": "1.0",
        "id": ctx.id,
        "source": format!("{}/{}/{}", ctx.events.source_root.trim_end_matches('/'), ctx.entity.schema, ctx.entity.table),
        "type": format!("{}.{}.{}", ctx.events.type_root, ctx.entity.name, action),
        "subject": format!("{}.{}", ctx.entity.name, key_text),
        "time": rfc3339_micros(ctx.time_micros),
        "datacontenttype": "application/json",
        "data": d.data,
        "action": action,
        "key": key_text,
        "partitionkey": key_text,
        "correlationid": ctx.correlation_id,
    });
    if let (Some(tag), Value::Object(m)) = (&d.etag, &mut ev) {
        m.insert("etag".into(), Value::String(tag.clone()));
    }
    if let (Some(g), Value::Object(m)) = (ctx.global_id, &mut ev) {
        m.insert("globalid".into(), Value::String(g.to_string()));
    }
    ev
}

#[cfg(test)]
pub(crate) mod tests {
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
}
