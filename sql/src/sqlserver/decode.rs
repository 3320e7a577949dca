//! Decoding what the SQL Server driver (`tiberius`) hands over into
//! [`SqlValue`], the one place where TDS types meet skein's value formats.
//!
//! Pure: it takes a decoded cell and returns a value, so every SQL Server
//! type is unit-tested here without a server. Two types need help from the
//! query instead: `money`/`smallmoney` arrive from the driver as `f64`
//! (inexact), so generated queries cast them to `decimal(19,4)` first; and
//! `sql_variant`, `hierarchyid`, `geometry`/`geography` are not decoded
//! (the catalog check rejects them with the column's name).

use chrono::{Duration, FixedOffset, NaiveDate, NaiveDateTime, NaiveTime, TimeZone};
use tiberius::ColumnData;

use skein_common::sqlvalue::SqlValue;
use skein_common::RootKey;

/// A cell that cannot be represented.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("column {column}: {message}")]
pub struct DecodeError {
    /// Column name (or index) the cell came from.
    pub column: String,
    /// What was wrong.
    pub message: String,
}

fn base_1900() -> NaiveDate {
    NaiveDate::from_ymd_opt(1900, 1, 1).expect("valid date")
}

fn date_from_days(days: u32) -> Option<NaiveDate> {
    NaiveDate::from_ymd_opt(1, 1, 1)?.checked_add_signed(Duration::days(i64::from(days)))
}

fn time_from_increments(increments: u64, scale: u8) -> Option<NaiveTime> {
    if scale > 7 {
        return None;
    }
    // 10^-scale seconds per increment; at most 7 digits, so nanoseconds are exact.
    let nanos_per = 10u64.pow(9 - u32::from(scale));
    let total = increments.checked_mul(nanos_per)?;
    let secs = u32::try_from(total / 1_000_000_000).ok()?;
    NaiveTime::from_num_seconds_from_midnight_opt(secs, (total % 1_000_000_000) as u32)
}

/// Decodes one cell. `column` names it in errors.
pub fn decode(column: &str, cell: &ColumnData<'_>) -> Result<SqlValue, DecodeError> {
    let bad = |message: String| DecodeError {
        column: column.to_string(),
        message,
    };
    macro_rules! opt {
        ($o:expr, $f:expr) => {
            match $o {
                None => SqlValue::Null,
                Some(v) => $f(v),
            }
        };
    }
    Ok(match cell {
        ColumnData::U8(v) => opt!(v, |x: &u8| SqlValue::Int(i64::from(*x))),
        ColumnData::I16(v) => opt!(v, |x: &i16| SqlValue::Int(i64::from(*x))),
        ColumnData::I32(v) => opt!(v, |x: &i32| SqlValue::Int(i64::from(*x))),
        ColumnData::I64(v) => opt!(v, |x: &i64| SqlValue::Int(*x)),
        // `real`: the shortest decimal that reads back as the same f32, so
        // 1.1 stays 1.1 rather than 1.100000023841858.
        ColumnData::F32(v) => opt!(v, |x: &f32| SqlValue::Float(
            x.to_string().parse::<f64>().unwrap_or(f64::from(*x))
        )),
        ColumnData::F64(v) => opt!(v, |x: &f64| SqlValue::Float(*x)),
        ColumnData::Bit(v) => opt!(v, |x: &bool| SqlValue::Bit(*x)),
        ColumnData::String(v) => opt!(v, |x: &std::borrow::Cow<'_, str>| SqlValue::Text(
            x.to_string()
        )),
        // The driver already swapped SQL Server's mixed-endian GUID bytes
        // into RFC 4122 order.
        ColumnData::Guid(v) => opt!(v, |x: &tiberius::Uuid| SqlValue::Guid(*x.as_bytes())),
        ColumnData::Binary(v) => opt!(v, |x: &std::borrow::Cow<'_, [u8]>| SqlValue::Binary(
            x.to_vec()
        )),
        ColumnData::Numeric(v) => opt!(v, |x: &tiberius::numeric::Numeric| {
            SqlValue::Decimal {
                unscaled: x.value(),
                scale: x.scale(),
            }
        }),
        ColumnData::Xml(v) => opt!(v, |x: &std::borrow::Cow<'_, tiberius::xml::XmlData>| {
            SqlValue::Text(x.to_string())
        }),
        ColumnData::DateTime(None)
        | ColumnData::SmallDateTime(None)
        | ColumnData::Date(None)
        | ColumnData::Time(None)
        | ColumnData::DateTime2(None)
        | ColumnData::DateTimeOffset(None) => SqlValue::Null,
        // datetime: days since 1900-01-01 and 1/300 s ticks.
        ColumnData::DateTime(Some(d)) => {
            let nanos = i64::from(d.seconds_fragments()) * 1_000_000_000 / 300;
            let t = base_1900()
                .and_hms_opt(0, 0, 0)
                .and_then(|b| b.checked_add_signed(Duration::days(i64::from(d.days()))))
                .and_then(|b| b.checked_add_signed(Duration::nanoseconds(nanos)))
                .ok_or_else(|| bad(format!("datetime out of range: {d:?}")))?;
            SqlValue::DateTime(t)
        }
        // smalldatetime: days since 1900-01-01 and minutes.
        ColumnData::SmallDateTime(Some(d)) => {
            let t = base_1900()
                .and_hms_opt(0, 0, 0)
                .and_then(|b| b.checked_add_signed(Duration::days(i64::from(d.days()))))
                .and_then(|b| {
                    b.checked_add_signed(Duration::minutes(i64::from(d.seconds_fragments())))
                })
                .ok_or_else(|| bad(format!("smalldatetime out of range: {d:?}")))?;
            SqlValue::DateTime(t)
        }
        ColumnData::Date(Some(d)) => SqlValue::Date(
            date_from_days(d.days()).ok_or_else(|| bad(format!("date out of range: {d:?}")))?,
        ),
        ColumnData::Time(Some(t)) => SqlValue::Time(
            time_from_increments(t.increments(), t.scale())
                .ok_or_else(|| bad(format!("time out of range: {t:?}")))?,
        ),
        ColumnData::DateTime2(Some(dt)) => SqlValue::DateTime(
            datetime2(dt).ok_or_else(|| bad(format!("datetime2 out of range: {dt:?}")))?,
        ),
        // datetimeoffset: the date and time are UTC on the wire; the offset
        // (minutes) is what the value was written with.
        ColumnData::DateTimeOffset(Some(dto)) => {
            let utc = datetime2(&dto.datetime2())
                .ok_or_else(|| bad(format!("datetimeoffset out of range: {dto:?}")))?;
            let tz = FixedOffset::east_opt(i32::from(dto.offset()) * 60)
                .ok_or_else(|| bad(format!("bad offset {} minutes", dto.offset())))?;
            SqlValue::DateTimeOffset(tz.from_utc_datetime(&utc))
        }
    })
}

fn datetime2(dt: &tiberius::time::DateTime2) -> Option<NaiveDateTime> {
    let date = date_from_days(dt.date().days())?;
    let time = time_from_increments(dt.time().increments(), dt.time().scale())?;
    Some(date.and_time(time))
}

/// A root key as the change stream writes it: each key column's decoded
/// value as [`SqlValue::to_text`] renders it, NULL as `None`. The
/// extractor turns CDC images and root lookups into keys this way, and an
/// explicit run's key pages ([`super::explicit_keys_sql`]) go through it
/// too, so a key queued by an explicit run is the key the stream sends for
/// the same row (one partition, one version row).
pub fn root_key(cells: &[SqlValue]) -> RootKey {
    RootKey(cells.iter().map(SqlValue::to_text).collect())
}

/// Decodes every cell of a row, in column order.
pub fn decode_row(row: &tiberius::Row) -> Result<Vec<SqlValue>, DecodeError> {
    row.cells().map(|(c, v)| decode(c.name(), v)).collect()
}

#[cfg(test)]
mod tests {
    use std::borrow::Cow;

    use serde_json::{json, Value};
    use tiberius::numeric::Numeric;
    use tiberius::time::{Date, DateTime, DateTime2, DateTimeOffset, SmallDateTime, Time};
    use tiberius::xml::XmlData;
    use tiberius::Uuid;

    use super::*;

    fn json_of(cell: ColumnData<'_>) -> Value {
        decode("c", &cell).unwrap().to_json()
    }

    // 2024-02-29 is day 738,944 after 0001-01-01 and day 45,349 after 1900-01-01.
    const DAYS_0001: u32 = 738_944;
    const DAYS_1900: i32 = 45_349;

    #[test]
    fn integers_bit_and_floats() {
        assert_eq!(json_of(ColumnData::U8(Some(255))), json!(255));
        assert_eq!(json_of(ColumnData::I16(Some(-32768))), json!(-32768));
        assert_eq!(json_of(ColumnData::I32(Some(42))), json!(42));
        assert_eq!(json_of(ColumnData::I64(Some(i64::MIN))), json!(i64::MIN));
        assert_eq!(json_of(ColumnData::Bit(Some(true))), json!(true));
        assert_eq!(json_of(ColumnData::Bit(Some(false))), json!(false));
        assert_eq!(json_of(ColumnData::F32(Some(1.1))), json!(1.1));
        assert_eq!(json_of(ColumnData::F64(Some(-2.5e-3))), json!(-0.0025));
    }

    #[test]
    fn decimal_numeric_and_money_keep_their_scale() {
        // decimal(10,4) 12.34 arrives as 123400 at scale 4.
        let n = Numeric::new_with_scale(123_400, 4);
        assert_eq!(json_of(ColumnData::Numeric(Some(n))), json!("12.3400"));
        let n = Numeric::new_with_scale(-5, 2);
        assert_eq!(json_of(ColumnData::Numeric(Some(n))), json!("-0.05"));
        // numeric(38,0) at its limit stays exact.
        let big = 10i128.pow(38) - 1;
        let n = Numeric::new_with_scale(big, 0);
        assert_eq!(
            json_of(ColumnData::Numeric(Some(n))),
            json!(big.to_string())
        );
        // money is cast to decimal(19,4) by the queries: the same path.
        let n = Numeric::new_with_scale(9_223_372_036_854_775_807, 4);
        assert_eq!(
            json_of(ColumnData::Numeric(Some(n))),
            json!("922337203685477.5807")
        );
    }

    #[test]
    fn character_types_and_xml() {
        for s in ["", "plain", "Zürich ✓ 漢字"] {
            assert_eq!(
                json_of(ColumnData::String(Some(Cow::Borrowed(s)))),
                json!(s)
            );
        }
        let x = XmlData::new("<a b=\"1\"/>");
        assert_eq!(
            json_of(ColumnData::Xml(Some(Cow::Owned(x)))),
            json!("<a b=\"1\"/>")
        );
    }

    #[test]
    fn dates_and_times() {
        let date = Date::new(DAYS_0001);
        assert_eq!(json_of(ColumnData::Date(Some(date))), json!("2024-02-29"));
        // time(7): 21:59:59.1234567 → microseconds, truncated.
        let t7 = Time::new(791_991_234_567, 7);
        assert_eq!(
            json_of(ColumnData::Time(Some(t7))),
            json!("21:59:59.123456")
        );
        // time(0).
        let t0 = Time::new(79_199, 0);
        assert_eq!(
            json_of(ColumnData::Time(Some(t0))),
            json!("21:59:59.000000")
        );
        assert_eq!(
            json_of(ColumnData::DateTime2(Some(DateTime2::new(date, t7)))),
            json!("2024-02-29T21:59:59.123456")
        );
        // datetimeoffset: wire value is UTC, offset +02:00; the event says UTC.
        let dto = DateTimeOffset::new(DateTime2::new(date, t7), 120);
        assert_eq!(
            json_of(ColumnData::DateTimeOffset(Some(dto))),
            json!("2024-02-29T21:59:59.123456Z")
        );
        let SqlValue::DateTimeOffset(v) =
            decode("c", &ColumnData::DateTimeOffset(Some(dto))).unwrap()
        else {
            panic!()
        };
        assert_eq!(v.offset().local_minus_utc(), 7200);
        // datetime: 1/300 s ticks; 21:59:59 + 299 ticks = .996666… s.
        let ticks = (21 * 3600 + 59 * 60 + 59) * 300 + 299;
        let dt = DateTime::new(DAYS_1900, ticks);
        assert_eq!(
            json_of(ColumnData::DateTime(Some(dt))),
            json!("2024-02-29T21:59:59.996666")
        );
        let sdt = SmallDateTime::new(DAYS_1900 as u16, 21 * 60 + 59);
        assert_eq!(
            json_of(ColumnData::SmallDateTime(Some(sdt))),
            json!("2024-02-29T21:59:00.000000")
        );
        // Out-of-range input is an error naming the column, not a panic.
        let e = decode("born", &ColumnData::Time(Some(Time::new(u64::MAX, 7)))).unwrap_err();
        assert_eq!(e.column, "born");
    }

    /// What hydration and lookups do with a key's text
    /// (`super::super::key_from_text`): read it as `datetime2(7)` (ISO 8601,
    /// 100 ns), and for `datetime` round that to the nearest 1/300 s tick.
    fn as_datetime2(text: &str) -> NaiveDateTime {
        let t = text.trim_end_matches('Z');
        NaiveDateTime::parse_from_str(t, "%Y-%m-%dT%H:%M:%S%.f").unwrap()
    }

    fn text_of(cell: ColumnData<'_>) -> String {
        decode("c", &cell).unwrap().to_text().unwrap()
    }

    /// A key decoded from a CDC row, rendered as text, converted back the
    /// way hydration converts it, is the value the row holds: every
    /// `datetime` tick of a second, `datetime2(7)`, `datetimeoffset(7)` at
    /// an offset and `time(7)` with 100 ns digits. (Before, the text kept
    /// microseconds: `.1234567` came back as `.1234560`, and `datetime`'s
    /// six digits were no `datetime` at all, so such roots were never
    /// found.)
    #[test]
    fn time_keys_from_cdc_rows_read_back_as_hydration_reads_them() {
        let second = (21 * 3600 + 59 * 60 + 59) * 300;
        for tick in 0..300 {
            let text = text_of(ColumnData::DateTime(Some(DateTime::new(
                DAYS_1900,
                second + tick,
            ))));
            let back = as_datetime2(&text);
            let nanos = i64::from(back.and_utc().timestamp_subsec_nanos());
            // Nearest 1/300 s tick.
            let round = (nanos * 300 + 500_000_000) / 1_000_000_000;
            assert_eq!(round, i64::from(tick), "{text}");
            assert!(text.starts_with("2024-02-29T21:59:59."), "{text}");
        }
        let d = Date::new(DAYS_0001);
        for inc in [0u64, 1, 9, 10, 1_234_567, 9_999_999, 791_991_234_567] {
            let t = Time::new(inc, 7);
            let v = datetime2(&DateTime2::new(d, t)).unwrap();
            assert_eq!(
                as_datetime2(&text_of(ColumnData::DateTime2(Some(DateTime2::new(d, t))))),
                v
            );
            let dto = DateTimeOffset::new(DateTime2::new(d, t), -300);
            assert_eq!(
                as_datetime2(&text_of(ColumnData::DateTimeOffset(Some(dto)))),
                v
            );
            let time = text_of(ColumnData::Time(Some(t)));
            assert_eq!(
                NaiveTime::parse_from_str(&time, "%H:%M:%S%.f").unwrap(),
                v.time()
            );
        }
    }

    #[test]
    fn guid_binary_and_rowversion() {
        let u = Uuid::parse_str("6f9619ff-8b86-d011-b42d-00c04fc964ff").unwrap();
        assert_eq!(
            json_of(ColumnData::Guid(Some(u))),
            json!("6f9619ff-8b86-d011-b42d-00c04fc964ff")
        );
        let b: &[u8] = &[0, 1, 2, 253, 254, 255];
        assert_eq!(
            json_of(ColumnData::Binary(Some(Cow::Borrowed(b)))),
            json!("AAEC/f7/")
        );
        // rowversion is binary(8).
        let rv: &[u8] = &[0, 0, 0, 0, 0, 0, 0x07, 0xD1];
        assert_eq!(
            json_of(ColumnData::Binary(Some(Cow::Borrowed(rv)))),
            json!("AAAAAAAAB9E=")
        );
    }

    #[test]
    fn every_null_is_null() {
        let nulls = [
            ColumnData::U8(None),
            ColumnData::I16(None),
            ColumnData::I32(None),
            ColumnData::I64(None),
            ColumnData::F32(None),
            ColumnData::F64(None),
            ColumnData::Bit(None),
            ColumnData::String(None),
            ColumnData::Guid(None),
            ColumnData::Binary(None),
            ColumnData::Numeric(None),
            ColumnData::Xml(None),
            ColumnData::DateTime(None),
            ColumnData::SmallDateTime(None),
            ColumnData::Time(None),
            ColumnData::Date(None),
            ColumnData::DateTime2(None),
            ColumnData::DateTimeOffset(None),
        ];
        for n in nulls {
            assert_eq!(decode("c", &n).unwrap(), SqlValue::Null, "{n:?}");
            assert_eq!(decode("c", &n).unwrap().to_text(), None);
        }
    }

    /// Fuzz properties (see [`skein_common::fuzz`]): no cell the driver
    /// can hand over (any value of each TDS type's fields, not only the
    /// ones SQL Server produces) makes decoding, or the text and JSON built
    /// from the value, panic or hang.
    mod fuzz {
        use proptest::prelude::*;
        use skein_common::fuzz::{check, config};

        use super::*;

        /// Days fit in the 3 bytes of TDS `date`.
        fn days() -> impl Strategy<Value = u32> {
            prop_oneof![0u32..1 << 24, Just((1 << 24) - 1), Just(3_652_058), Just(0)]
        }

        fn time() -> impl Strategy<Value = Time> {
            (any::<u64>(), prop_oneof![0u8..=7, any::<u8>()]).prop_map(|(i, s)| Time::new(i, s))
        }

        fn datetime2() -> impl Strategy<Value = DateTime2> {
            (days(), time()).prop_map(|(d, t)| DateTime2::new(Date::new(d), t))
        }

        fn cell() -> impl Strategy<Value = ColumnData<'static>> {
            prop_oneof![
                prop::option::of(any::<u8>()).prop_map(ColumnData::U8),
                prop::option::of(any::<i16>()).prop_map(ColumnData::I16),
                prop::option::of(any::<i32>()).prop_map(ColumnData::I32),
                prop::option::of(any::<i64>()).prop_map(ColumnData::I64),
                prop::option::of(any::<f32>()).prop_map(ColumnData::F32),
                prop::option::of(any::<f64>()).prop_map(ColumnData::F64),
                prop::option::of(any::<bool>()).prop_map(ColumnData::Bit),
                prop::option::of(any::<String>())
                    .prop_map(|s| ColumnData::String(s.map(Cow::Owned))),
                prop::option::of(any::<[u8; 16]>())
                    .prop_map(|b| ColumnData::Guid(b.map(Uuid::from_bytes))),
                prop::option::of(prop::collection::vec(any::<u8>(), 0..64))
                    .prop_map(|b| ColumnData::Binary(b.map(Cow::Owned))),
                prop::option::of((any::<i128>(), 0u8..=Numeric::MAX_NUMERIC_SCALE)).prop_map(|n| {
                    ColumnData::Numeric(n.map(|(v, s)| Numeric::new_with_scale(v, s)))
                }),
                prop::option::of(any::<String>())
                    .prop_map(|s| ColumnData::Xml(s.map(|s| Cow::Owned(XmlData::new(s))))),
                prop::option::of((any::<i32>(), any::<u32>()))
                    .prop_map(|d| ColumnData::DateTime(d.map(|(a, b)| DateTime::new(a, b)))),
                prop::option::of((any::<u16>(), any::<u16>())).prop_map(|d| {
                    ColumnData::SmallDateTime(d.map(|(a, b)| SmallDateTime::new(a, b)))
                }),
                prop::option::of(days()).prop_map(|d| ColumnData::Date(d.map(Date::new))),
                prop::option::of(time()).prop_map(ColumnData::Time),
                prop::option::of(datetime2()).prop_map(ColumnData::DateTime2),
                prop::option::of((datetime2(), any::<i16>())).prop_map(|d| {
                    ColumnData::DateTimeOffset(d.map(|(dt, o)| DateTimeOffset::new(dt, o)))
                }),
            ]
        }

        proptest! {
            #![proptest_config(config())]

            #[test]
            fn every_cell_decodes_or_is_an_error_naming_its_column(c in cell()) {
                let size = format!("{c:?}").len();
                check("TDS cell", size, || match decode("col", &c) {
                    Ok(v) => {
                        let _ = (v.to_text(), v.to_json());
                    }
                    Err(e) => assert_eq!(e.column, "col"),
                });
            }

            #[test]
            fn text_and_ints_decode_to_themselves(s in any::<String>(), i in any::<i64>()) {
                prop_assert_eq!(
                    decode("c", &ColumnData::String(Some(Cow::Borrowed(&s)))).unwrap(),
                    SqlValue::Text(s)
                );
                prop_assert_eq!(decode("c", &ColumnData::I64(Some(i))).unwrap(), SqlValue::Int(i));
            }
        }
    }
}
