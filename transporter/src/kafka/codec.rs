//! The change topic's record format: a format byte, then an Avro datum of
//! the [`Envelope`]. Both schemas are stored formats, frozen: v1 is still
//! decoded so appliers can be upgraded before extractors.

use std::collections::BTreeMap;
use std::sync::LazyLock;

use apache_avro::types::Value;
use apache_avro::Schema;
use skein_common::position::ChangePosition;
use skein_common::record::{Op, RootKey};
use skein_common::{ChangeRecord, PgLsn, SourcePosition};

/// Format byte of the first encoding: positions as PostgreSQL LSNs in
/// `long`s. Still decoded, so appliers can be upgraded before extractors.
pub const FORMAT_V1: u8 = 1;
/// Format byte of the current encoding: positions as the source shows them
/// (strings), which holds SQL Server's 80-bit LSNs as well.
pub const FORMAT_V2: u8 = 2;

/// Format byte of a truncate notice: v2's schema with one more `op`
/// symbol. Only a record with that op is written in it, so an applier that
/// knows v2 only still reads every other record.
pub const FORMAT_V3: u8 = 3;

/// The Avro schema behind [`FORMAT_V2`], what [`encode`] writes for every
/// record but a truncate notice.
pub const SCHEMA_JSON: &str = r#"{
  "type": "record", "name": "ChangeEnvelope", "namespace": "skein",
  "doc": "One change resolved to its aggregate root, or (record = null) a notice that the source lost changes before the batch (lower, upper].",
  "fields": [
    {"name": "lower", "type": "string", "doc": "extractor batch: exclusive lower source position, as the source shows it (0/16B3748 or 0x0000002A000001F00003)"},
    {"name": "upper", "type": "string", "doc": "extractor batch: inclusive upper source position"},
    {"name": "has_data_loss", "type": "boolean"},
    {"name": "record", "type": ["null", {
      "type": "record", "name": "ChangeRecord",
      "fields": [
        {"name": "entity", "type": "string"},
        {"name": "root_key", "type": {"type": "array", "items": ["null", "string"]}},
        {"name": "table", "type": "string"},
        {"name": "op", "type": {"type": "enum", "name": "Op", "symbols": ["insert", "update", "delete"]}},
        {"name": "commit", "type": "string", "doc": "commit position of the source transaction"},
        {"name": "seq", "type": "long", "doc": "order of the change inside its transaction"},
        {"name": "tx_id", "type": "long"},
        {"name": "commit_time_micros", "type": "long"}
      ]
    }]}
  ]
}"#;

/// The Avro schema behind [`FORMAT_V3`]: v2 with the `truncate` op.
pub const SCHEMA_V3_JSON: &str = r#"{
  "type": "record", "name": "ChangeEnvelope", "namespace": "skein",
  "doc": "One change resolved to its aggregate root, or (record = null) a notice that the source lost changes before the batch (lower, upper].",
  "fields": [
    {"name": "lower", "type": "string", "doc": "extractor batch: exclusive lower source position, as the source shows it (0/16B3748 or 0x0000002A000001F00003)"},
    {"name": "upper", "type": "string", "doc": "extractor batch: inclusive upper source position"},
    {"name": "has_data_loss", "type": "boolean"},
    {"name": "record", "type": ["null", {
      "type": "record", "name": "ChangeRecord",
      "fields": [
        {"name": "entity", "type": "string"},
        {"name": "root_key", "type": {"type": "array", "items": ["null", "string"]}},
        {"name": "table", "type": "string"},
        {"name": "op", "type": {"type": "enum", "name": "Op", "symbols": ["insert", "update", "delete", "truncate"]}},
        {"name": "commit", "type": "string", "doc": "commit position of the source transaction"},
        {"name": "seq", "type": "long", "doc": "order of the change inside its transaction"},
        {"name": "tx_id", "type": "long"},
        {"name": "commit_time_micros", "type": "long"}
      ]
    }]}
  ]
}"#;

/// The Avro schema behind [`FORMAT_V1`] (frozen; decode only).
pub const SCHEMA_V1_JSON: &str = r#"{
  "type": "record", "name": "ChangeEnvelope", "namespace": "skein",
  "doc": "One change resolved to its aggregate root, or (record = null) a notice that the source lost changes before the batch (lower, upper].",
  "fields": [
    {"name": "lower", "type": "long", "doc": "extractor batch: exclusive lower source position"},
    {"name": "upper", "type": "long", "doc": "extractor batch: inclusive upper source position"},
    {"name": "has_data_loss", "type": "boolean"},
    {"name": "record", "type": ["null", {
      "type": "record", "name": "ChangeRecord",
      "fields": [
        {"name": "entity", "type": "string"},
        {"name": "root_key", "type": {"type": "array", "items": ["null", "string"]}},
        {"name": "table", "type": "string"},
        {"name": "op", "type": {"type": "enum", "name": "Op", "symbols": ["insert", "update", "delete"]}},
        {"name": "commit", "type": "long", "doc": "commit position of the source transaction"},
        {"name": "seq", "type": "long", "doc": "order of the change inside its transaction"},
        {"name": "tx_id", "type": "long"},
        {"name": "commit_time_micros", "type": "long"}
      ]
    }]}
  ]
}"#;

static SCHEMA: LazyLock<Schema> =
    LazyLock::new(|| Schema::parse_str(SCHEMA_JSON).expect("the change schema is valid Avro"));
static SCHEMA_V3: LazyLock<Schema> =
    LazyLock::new(|| Schema::parse_str(SCHEMA_V3_JSON).expect("the v3 schema is valid Avro"));
static SCHEMA_V1: LazyLock<Schema> =
    LazyLock::new(|| Schema::parse_str(SCHEMA_V1_JSON).expect("the v1 schema is valid Avro"));

/// What travels on the change topic.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Envelope {
    /// The extractor batch the record belongs to.
    pub lower: SourcePosition,
    /// See `lower`.
    pub upper: SourcePosition,
    /// The source reported lost changes before this batch.
    pub has_data_loss: bool,
    /// The change; `None` for a data-loss notice.
    pub record: Option<ChangeRecord>,
}

/// Encodes an envelope: [`FORMAT_V2`] then the Avro datum.
pub fn encode(e: &Envelope) -> Vec<u8> {
    let truncate = e.record.as_ref().is_some_and(|r| r.op == Op::Truncate);
    let record = match &e.record {
        None => Value::Union(0, Box::new(Value::Null)),
        Some(r) => Value::Union(
            1,
            Box::new(Value::Record(vec![
                ("entity".into(), Value::String(r.entity.clone())),
                (
                    "root_key".into(),
                    Value::Array(
                        r.root_key
                            .0
                            .iter()
                            .map(|v| match v {
                                None => Value::Union(0, Box::new(Value::Null)),
                                Some(s) => Value::Union(1, Box::new(Value::String(s.clone()))),
                            })
                            .collect(),
                    ),
                ),
                ("table".into(), Value::String(r.table.clone())),
                (
                    "op".into(),
                    match r.op {
                        Op::Insert => Value::Enum(0, "insert".into()),
                        Op::Update => Value::Enum(1, "update".into()),
                        Op::Delete => Value::Enum(2, "delete".into()),
                        Op::Truncate => Value::Enum(3, "truncate".into()),
                    },
                ),
                (
                    "commit".into(),
                    Value::String(r.position.commit.to_string()),
                ),
                (
                    "seq".into(),
                    Value::Long(i64::try_from(r.position.seq).unwrap_or(i64::MAX)),
                ),
                ("tx_id".into(), Value::Long(r.tx_id as i64)),
                (
                    "commit_time_micros".into(),
                    Value::Long(r.commit_time_micros),
                ),
            ])),
        ),
    };
    let value = Value::Record(vec![
        ("lower".into(), Value::String(e.lower.to_string())),
        ("upper".into(), Value::String(e.upper.to_string())),
        ("has_data_loss".into(), Value::Boolean(e.has_data_loss)),
        ("record".into(), record),
    ]);
    let (format, schema) = if truncate {
        (FORMAT_V3, &*SCHEMA_V3)
    } else {
        (FORMAT_V2, &*SCHEMA)
    };
    let mut out = vec![format];
    out.extend(
        apache_avro::to_avro_datum(schema, value).expect("an envelope always matches its schema"),
    );
    out
}

/// Decodes what [`encode`] wrote; anything else is an error naming why.
pub fn decode(bytes: &[u8]) -> std::result::Result<Envelope, String> {
    let Some((&format, mut body)) = bytes.split_first() else {
        return Err("empty message".into());
    };
    let schema: &Schema = match format {
        FORMAT_V1 => &SCHEMA_V1,
        FORMAT_V2 => &SCHEMA,
        FORMAT_V3 => &SCHEMA_V3,
        _ => return Err(format!("unknown format byte {format}")),
    };
    let value = apache_avro::from_avro_datum(schema, &mut body, None)
        .map_err(|e| format!("not a skein change record: {e}"))?;
    if !body.is_empty() {
        return Err(format!("{} trailing bytes after the record", body.len()));
    }
    let fields = record_fields(value)?;
    let lower = position_field(&fields, "lower")?;
    let upper = position_field(&fields, "upper")?;
    let has_data_loss = matches!(fields.get("has_data_loss"), Some(Value::Boolean(true)));
    let record = match fields.get("record") {
        Some(Value::Union(_, inner)) => match inner.as_ref() {
            Value::Null => None,
            v => Some(decode_record(v.clone())?),
        },
        other => return Err(format!("field `record`: unexpected {other:?}")),
    };
    Ok(Envelope {
        lower,
        upper,
        has_data_loss,
        record,
    })
}

fn record_fields(v: Value) -> std::result::Result<BTreeMap<String, Value>, String> {
    match v {
        Value::Record(f) => Ok(f.into_iter().collect()),
        other => Err(format!("expected a record, got {other:?}")),
    }
}

fn long_field(f: &BTreeMap<String, Value>, k: &str) -> std::result::Result<i64, String> {
    match f.get(k) {
        Some(Value::Long(v)) => Ok(*v),
        other => Err(format!("field `{k}`: expected a long, got {other:?}")),
    }
}

/// A position: a PostgreSQL LSN `long` (v1) or the display form (v2).
fn position_field(
    f: &BTreeMap<String, Value>,
    k: &str,
) -> std::result::Result<SourcePosition, String> {
    match f.get(k) {
        Some(Value::Long(v)) => Ok(SourcePosition::Pg(PgLsn::from_i64(*v))),
        Some(Value::String(s)) => s.parse().map_err(|e| format!("field `{k}`: {e}")),
        other => Err(format!("field `{k}`: expected a position, got {other:?}")),
    }
}

fn decode_record(v: Value) -> std::result::Result<ChangeRecord, String> {
    let f = record_fields(v)?;
    let string = |k: &str| match f.get(k) {
        Some(Value::String(s)) => Ok(s.clone()),
        other => Err(format!("field `{k}`: expected a string, got {other:?}")),
    };
    let long = |k: &str| long_field(&f, k);
    let root_key = match f.get("root_key") {
        Some(Value::Array(items)) => items
            .iter()
            .map(|i| match i {
                Value::Union(_, b) => match b.as_ref() {
                    Value::Null => Ok(None),
                    Value::String(s) => Ok(Some(s.clone())),
                    o => Err(format!("root_key item: unexpected {o:?}")),
                },
                o => Err(format!("root_key item: unexpected {o:?}")),
            })
            .collect::<std::result::Result<Vec<_>, _>>()?,
        other => return Err(format!("field `root_key`: unexpected {other:?}")),
    };
    let op = match f.get("op") {
        Some(Value::Enum(_, s)) if s == "insert" => Op::Insert,
        Some(Value::Enum(_, s)) if s == "update" => Op::Update,
        Some(Value::Enum(_, s)) if s == "delete" => Op::Delete,
        Some(Value::Enum(_, s)) if s == "truncate" => Op::Truncate,
        other => return Err(format!("field `op`: unexpected {other:?}")),
    };
    let seq = u64::try_from(long("seq")?).map_err(|_| "field `seq` out of range".to_string())?;
    Ok(ChangeRecord {
        entity: string("entity")?,
        root_key: RootKey(root_key),
        table: string("table")?,
        op,
        position: ChangePosition {
            commit: position_field(&f, "commit")?,
            seq,
        },
        tx_id: long("tx_id")? as u64,
        commit_time_micros: long("commit_time_micros")?,
    })
}

#[cfg(test)]
mod tests {
    use skein_common::SqlServerLsn;

    use super::*;

    fn rec(key: Vec<Option<&str>>) -> ChangeRecord {
        ChangeRecord {
            entity: "customer".into(),
            root_key: RootKey(key.into_iter().map(|k| k.map(String::from)).collect()),
            table: "public.address".into(),
            op: Op::Delete,
            position: ChangePosition {
                commit: PgLsn(0x1_0000_0042).into(),
                seq: 7,
            },
            tx_id: 912,
            commit_time_micros: 1_700_000_000_123_456,
        }
    }

    /// A truncate notice is the only record written in format 3; every other
    /// record stays in format 2, which an applier that predates notices reads.
    #[test]
    fn truncate_notices_travel_in_format_3_and_nothing_else_does() {
        let notice = ChangeRecord::truncate_notice(
            "customer",
            "public.address",
            3,
            ChangePosition {
                commit: PgLsn(77).into(),
                seq: 1,
            },
            5,
            6,
        );
        let env = |r: ChangeRecord| Envelope {
            lower: PgLsn(10).into(),
            upper: PgLsn(80).into(),
            has_data_loss: false,
            record: Some(r),
        };
        let bytes = encode(&env(notice.clone()));
        assert_eq!(bytes[0], FORMAT_V3);
        assert_eq!(decode(&bytes).unwrap(), env(notice));
        let plain = encode(&env(rec(vec![Some("1")])));
        assert_eq!(plain[0], FORMAT_V2);
        // Format 3 is format 2 with one more op: a v2 record reads the same.
        let mut as_v3 = plain.clone();
        as_v3[0] = FORMAT_V3;
        assert_eq!(decode(&as_v3).unwrap(), decode(&plain).unwrap());
    }

    #[test]
    fn envelopes_round_trip() {
        for record in [
            None,
            Some(rec(vec![Some("1")])),
            Some(rec(vec![Some("ü,1"), None])),
        ] {
            let e = Envelope {
                lower: PgLsn(10).into(),
                upper: PgLsn(0x1_0000_0042).into(),
                has_data_loss: record.is_none(),
                record: record.clone(),
            };
            assert_eq!(decode(&encode(&e)).unwrap(), e);
            // SQL Server positions (80 bits) travel too.
            let lsn = |b: u8| SourcePosition::SqlServer(SqlServerLsn([b; 10]));
            let e = Envelope {
                lower: lsn(0x10),
                upper: lsn(0xFE),
                has_data_loss: false,
                record: record.map(|r| ChangeRecord {
                    position: ChangePosition {
                        commit: lsn(0xFE),
                        seq: 3,
                    },
                    ..r
                }),
            };
            assert_eq!(decode(&encode(&e)).unwrap(), e);
        }
    }

    #[test]
    fn format_v1_records_are_still_read() {
        // A v1 datum as the previous release's encoder wrote it.
        let r = rec(vec![Some("1")]);
        let value = Value::Record(vec![
            ("lower".into(), Value::Long(10)),
            ("upper".into(), Value::Long(0x1_0000_0042)),
            ("has_data_loss".into(), Value::Boolean(false)),
            (
                "record".into(),
                Value::Union(
                    1,
                    Box::new(Value::Record(vec![
                        ("entity".into(), Value::String(r.entity.clone())),
                        (
                            "root_key".into(),
                            Value::Array(vec![Value::Union(
                                1,
                                Box::new(Value::String("1".into())),
                            )]),
                        ),
                        ("table".into(), Value::String(r.table.clone())),
                        ("op".into(), Value::Enum(2, "delete".into())),
                        ("commit".into(), Value::Long(0x1_0000_0042)),
                        ("seq".into(), Value::Long(7)),
                        ("tx_id".into(), Value::Long(912)),
                        (
                            "commit_time_micros".into(),
                            Value::Long(r.commit_time_micros),
                        ),
                    ])),
                ),
            ),
        ]);
        let mut bytes = vec![FORMAT_V1];
        bytes.extend(apache_avro::to_avro_datum(&SCHEMA_V1, value).unwrap());
        let e = decode(&bytes).unwrap();
        assert_eq!(e.upper, SourcePosition::Pg(PgLsn(0x1_0000_0042)));
        assert_eq!(e.record, Some(r));
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        assert!(decode(b"").is_err());
        assert!(decode(b"\x09abc").unwrap_err().contains("format byte"));
        assert!(decode(b"\x01\xff\xff").is_err());
        let mut ok = encode(&Envelope {
            lower: PgLsn(1).into(),
            upper: PgLsn(2).into(),
            has_data_loss: false,
            record: Some(rec(vec![Some("1")])),
        });
        ok.push(0);
        assert!(decode(&ok).unwrap_err().contains("trailing"));
    }
}
