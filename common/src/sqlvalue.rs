//! Values read from SQL Server (CDC rows and hydration) and their event
//! JSON. The formats are the PostgreSQL path's (README, "Value formats"),
//! so an aggregate's etag does not depend on the source dialect:
//!
//! | SQL Server type | JSON |
//! |---|---|
//! | tinyint, smallint, int, bigint, real, float | number |
//! | bit | `true` / `false` |
//! | decimal, numeric, money, smallmoney | string holding the exact decimal at the column's scale, e.g. `"12.3400"` |
//! | datetimeoffset | string in UTC with microseconds: `"2024-02-29T21:59:59.123456Z"` |
//! | datetime2, datetime, smalldatetime | `"2024-02-29T21:59:59.123456"` |
//! | date | `"2024-02-29"` |
//! | time | `"21:59:59.123456"` |
//! | uniqueidentifier | lower-case hyphenated string |
//! | binary, varbinary, image, rowversion | standard base64, no line breaks |
//! | char, varchar, nchar, nvarchar, text, ntext, xml | the string |
//!
//! SQL Server keeps time to 100 ns; events carry microseconds (the
//! PostgreSQL precision), truncated. A key's text ([`SqlValue::to_text`])
//! is exact instead: hydration converts it back to the column's type and
//! compares, so a `datetime2(7)` key truncated to `.123456` would never
//! find its row `.1234567`. It has microseconds when they are exact (the
//! event's form) and 100 ns digits only when the value has them.

use base64::Engine as _;
use chrono::{DateTime, FixedOffset, NaiveDate, NaiveDateTime, NaiveTime, Timelike, Utc};
use serde_json::Value;

/// One column value as the SQL Server driver hands it over.
#[derive(Clone, Debug, PartialEq)]
pub enum SqlValue {
    /// SQL NULL.
    Null,
    /// tinyint, smallint, int, bigint.
    Int(i64),
    /// real, float.
    Float(f64),
    /// decimal, numeric, money (scale 4), smallmoney: `unscaled / 10^scale`.
    Decimal { unscaled: i128, scale: u8 },
    /// bit.
    Bit(bool),
    /// Character and XML types.
    Text(String),
    /// datetime2, datetime, smalldatetime.
    DateTime(NaiveDateTime),
    /// datetimeoffset.
    DateTimeOffset(DateTime<FixedOffset>),
    /// date.
    Date(NaiveDate),
    /// time.
    Time(NaiveTime),
    /// uniqueidentifier, in RFC 4122 byte order.
    Guid([u8; 16]),
    /// binary, varbinary, image, rowversion.
    Binary(Vec<u8>),
}

fn micros_time(t: &NaiveTime) -> String {
    format!(
        "{:02}:{:02}:{:02}.{:06}",
        t.hour(),
        t.minute(),
        t.second(),
        t.nanosecond().min(999_999_999) / 1_000
    )
}

/// A key's time of day: microseconds when exact, else 100 ns (the
/// finest SQL Server time; finer is not decoded).
fn exact_time(t: &NaiveTime) -> String {
    let nanos = t.nanosecond().min(999_999_999);
    if nanos.is_multiple_of(1_000) {
        return micros_time(t);
    }
    format!(
        "{:02}:{:02}:{:02}.{:07}",
        t.hour(),
        t.minute(),
        t.second(),
        nanos / 100
    )
}

fn decimal_text(unscaled: i128, scale: u8) -> String {
    let neg = unscaled < 0;
    let digits = unscaled.unsigned_abs().to_string();
    let scale = scale as usize;
    let body = if scale == 0 {
        digits
    } else if digits.len() > scale {
        format!(
            "{}.{}",
            &digits[..digits.len() - scale],
            &digits[digits.len() - scale..]
        )
    } else {
        format!("0.{}{digits}", "0".repeat(scale - digits.len()))
    };
    if neg {
        format!("-{body}")
    } else {
        body
    }
}

fn guid_text(b: &[u8; 16]) -> String {
    let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &h[..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..]
    )
}

impl SqlValue {
    /// The value in event JSON (the table above).
    pub fn to_json(&self) -> Value {
        match self {
            SqlValue::Null => Value::Null,
            SqlValue::Int(i) => Value::from(*i),
            SqlValue::Float(f) => serde_json::Number::from_f64(*f)
                .map(Value::Number)
                .unwrap_or(Value::Null),
            SqlValue::Bit(b) => Value::Bool(*b),
            SqlValue::Text(_)
            | SqlValue::Decimal { .. }
            | SqlValue::DateTime(_)
            | SqlValue::DateTimeOffset(_)
            | SqlValue::Date(_)
            | SqlValue::Time(_)
            | SqlValue::Guid(_)
            | SqlValue::Binary(_) => Value::String(self.text_with(micros_time).unwrap_or_default()),
        }
    }

    /// The value as text: what a root key holds (`None` for NULL). Numbers
    /// in their plain decimal form, `1`/`0` for bit, the JSON string for
    /// everything else, but times exact to 100 ns (the module's doc says
    /// why).
    pub fn to_text(&self) -> Option<String> {
        self.text_with(exact_time)
    }

    fn text_with(&self, time: fn(&NaiveTime) -> String) -> Option<String> {
        Some(match self {
            SqlValue::Null => return None,
            SqlValue::Int(i) => i.to_string(),
            SqlValue::Float(f) => f.to_string(),
            SqlValue::Decimal { unscaled, scale } => decimal_text(*unscaled, *scale),
            SqlValue::Bit(b) => if *b { "1" } else { "0" }.to_string(),
            SqlValue::Text(s) => s.clone(),
            SqlValue::DateTime(t) => format!("{}T{}", t.date(), time(&t.time())),
            SqlValue::DateTimeOffset(t) => {
                let u = t.with_timezone(&Utc).naive_utc();
                format!("{}T{}Z", u.date(), time(&u.time()))
            }
            SqlValue::Date(d) => d.to_string(),
            SqlValue::Time(t) => time(t),
            SqlValue::Guid(g) => guid_text(g),
            SqlValue::Binary(b) => base64::engine::general_purpose::STANDARD.encode(b),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn every_type_has_the_postgres_format() {
        let dt = NaiveDate::from_ymd_opt(2024, 2, 29)
            .unwrap()
            .and_hms_nano_opt(21, 59, 59, 123_456_789)
            .unwrap();
        let cases: Vec<(SqlValue, Value)> = vec![
            (SqlValue::Null, Value::Null),
            (SqlValue::Int(-42), json!(-42)),
            (SqlValue::Int(i64::MAX), json!(i64::MAX)),
            (SqlValue::Float(1.5), json!(1.5)),
            (SqlValue::Bit(true), json!(true)),
            (
                SqlValue::Decimal {
                    unscaled: 123_400,
                    scale: 4,
                },
                json!("12.3400"),
            ),
            (
                SqlValue::Decimal {
                    unscaled: -5,
                    scale: 2,
                },
                json!("-0.05"),
            ),
            (
                SqlValue::Decimal {
                    unscaled: 7,
                    scale: 0,
                },
                json!("7"),
            ),
            (SqlValue::Text("Zürich ✓".into()), json!("Zürich ✓")),
            (SqlValue::DateTime(dt), json!("2024-02-29T21:59:59.123456")),
            (
                SqlValue::DateTimeOffset(
                    dt.and_local_timezone(FixedOffset::east_opt(2 * 3600).unwrap())
                        .unwrap(),
                ),
                json!("2024-02-29T19:59:59.123456Z"),
            ),
            (SqlValue::Date(dt.date()), json!("2024-02-29")),
            (SqlValue::Time(dt.time()), json!("21:59:59.123456")),
            (
                SqlValue::Guid([
                    0x6F, 0x96, 0x19, 0xFF, 0x8B, 0x86, 0xD0, 0x11, 0xB4, 0x2D, 0x00, 0xC0, 0x4F,
                    0xC9, 0x64, 0xFF,
                ]),
                json!("6f9619ff-8b86-d011-b42d-00c04fc964ff"),
            ),
            (
                SqlValue::Binary(vec![0, 1, 2, 253, 254, 255]),
                json!("AAEC/f7/"),
            ),
            (
                SqlValue::Binary(vec![0, 0, 0, 0, 0, 0, 0x07, 0xD1]),
                json!("AAAAAAAAB9E="),
            ),
        ];
        for (v, want) in cases {
            assert_eq!(v.to_json(), want, "{v:?}");
        }
    }

    #[test]
    fn key_text_is_plain() {
        assert_eq!(SqlValue::Int(7).to_text().as_deref(), Some("7"));
        assert_eq!(SqlValue::Bit(false).to_text().as_deref(), Some("0"));
        assert_eq!(SqlValue::Null.to_text(), None);
    }

    fn at(nanos: u32) -> NaiveDateTime {
        NaiveDate::from_ymd_opt(2024, 2, 29)
            .unwrap()
            .and_hms_nano_opt(21, 59, 59, nanos)
            .unwrap()
    }

    /// A key's text reads back as the same value (hydration converts it to
    /// the column's type and compares with `=`); the event keeps
    /// microseconds.
    #[test]
    fn time_keys_are_exact_and_events_keep_microseconds() {
        let dt = SqlValue::DateTime(at(123_456_700));
        assert_eq!(dt.to_text().unwrap(), "2024-02-29T21:59:59.1234567");
        assert_eq!(dt.to_json(), json!("2024-02-29T21:59:59.123456"));
        // Exact microseconds keep the event's form (keys stored before).
        let dt = SqlValue::DateTime(at(123_456_000));
        assert_eq!(dt.to_text().unwrap(), "2024-02-29T21:59:59.123456");
        let off = FixedOffset::east_opt(-5 * 3600).unwrap();
        let dto = SqlValue::DateTimeOffset(at(100).and_local_timezone(off).unwrap());
        assert_eq!(dto.to_text().unwrap(), "2024-03-01T02:59:59.0000001Z");
        assert_eq!(dto.to_json(), json!("2024-03-01T02:59:59.000000Z"));
        let t = SqlValue::Time(at(999_999_900).time());
        assert_eq!(t.to_text().unwrap(), "21:59:59.9999999");
    }

    /// Every 100 ns value of a second: the key text parses back to it.
    #[test]
    fn every_hundred_nanoseconds_round_trips_through_the_key_text() {
        for step in (0..10_000_000u32).step_by(997) {
            let v = at(step * 100);
            let text = SqlValue::DateTime(v).to_text().unwrap();
            let back = NaiveDateTime::parse_from_str(&text, "%Y-%m-%dT%H:%M:%S%.f").unwrap();
            assert_eq!(back, v, "{text}");
        }
    }
}
