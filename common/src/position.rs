//! Typed, totally ordered source positions.
//!
//! A position is never a raw `Vec<u8>` or string in a signature: PostgreSQL
//! positions are [`PgLsn`] (a 64-bit WAL byte offset shown as `0/16B3748`),
//! SQL Server positions are [`SqlServerLsn`] (10 bytes compared big-endian,
//! shown as `0x0000002A000001F00003`). Both order exactly like the server
//! orders them, so `(lower, upper]` batch windows can be compared directly.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// A PostgreSQL write-ahead-log position.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(into = "String", try_from = "String")]
pub struct PgLsn(pub u64);

impl PgLsn {
    /// The zero position: "before everything".
    pub const ZERO: PgLsn = PgLsn(0);

    /// The position as the raw 64-bit WAL offset.
    pub fn as_u64(self) -> u64 {
        self.0
    }

    /// The position as a signed integer for storage in a `bigint` column.
    /// WAL offsets stay far below `i64::MAX` (8 EiB of WAL), so this is exact;
    /// larger values saturate rather than wrap so ordering is kept.
    pub fn as_i64(self) -> i64 {
        i64::try_from(self.0).unwrap_or(i64::MAX)
    }

    /// Inverse of [`PgLsn::as_i64`]; negative values (never stored) map to zero.
    pub fn from_i64(v: i64) -> PgLsn {
        PgLsn(u64::try_from(v).unwrap_or(0))
    }
}

impl fmt::Display for PgLsn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:X}/{:X}", self.0 >> 32, self.0 & 0xFFFF_FFFF)
    }
}

impl FromStr for PgLsn {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        let bad = || Error::Position(format!("`{s}` is not a PostgreSQL LSN like `0/16B3748`"));
        let (hi, lo) = s.trim().split_once('/').ok_or_else(bad)?;
        if hi.is_empty() || lo.is_empty() || hi.len() > 8 || lo.len() > 8 {
            return Err(bad());
        }
        let hi = u64::from_str_radix(hi, 16).map_err(|_| bad())?;
        let lo = u64::from_str_radix(lo, 16).map_err(|_| bad())?;
        Ok(PgLsn((hi << 32) | lo))
    }
}

impl From<PgLsn> for String {
    fn from(l: PgLsn) -> String {
        l.to_string()
    }
}

impl TryFrom<String> for PgLsn {
    type Error = Error;
    fn try_from(s: String) -> Result<Self> {
        s.parse()
    }
}

/// A SQL Server log sequence number: 10 bytes, ordered big-endian
/// (virtual log file : log block : slot), displayed as SQL Server shows it.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(into = "String", try_from = "String")]
pub struct SqlServerLsn(pub [u8; 10]);

impl SqlServerLsn {
    /// The zero LSN (`0x00000000000000000000`).
    pub const ZERO: SqlServerLsn = SqlServerLsn([0; 10]);

    /// Builds an LSN from the bytes a `binary(10)` column returns.
    pub fn from_slice(bytes: &[u8]) -> Result<Self> {
        let arr: [u8; 10] = bytes.try_into().map_err(|_| {
            Error::Position(format!(
                "a SQL Server LSN has 10 bytes, got {} (0x{})",
                bytes.len(),
                hex::encode_upper(bytes)
            ))
        })?;
        Ok(SqlServerLsn(arr))
    }

    /// The next LSN in byte order (what `sys.fn_cdc_increment_lsn` returns).
    /// Saturates at the maximum LSN.
    pub fn increment(self) -> SqlServerLsn {
        let mut b = self.0;
        for i in (0..10).rev() {
            if b[i] == 0xFF {
                b[i] = 0;
            } else {
                b[i] += 1;
                return SqlServerLsn(b);
            }
        }
        SqlServerLsn([0xFF; 10])
    }
}

impl SqlServerLsn {
    /// The previous LSN in byte order (saturates at zero): the exclusive
    /// lower bound that makes `lsn` the first position read.
    pub fn decrement(self) -> SqlServerLsn {
        let mut b = self.0;
        for i in (0..10).rev() {
            if b[i] == 0 {
                b[i] = 0xFF;
            } else {
                b[i] -= 1;
                return SqlServerLsn(b);
            }
        }
        SqlServerLsn::ZERO
    }
}

impl fmt::Display for SqlServerLsn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "0x{}", hex::encode_upper(self.0))
    }
}

impl FromStr for SqlServerLsn {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        let t = s.trim();
        let t = t
            .strip_prefix("0x")
            .or_else(|| t.strip_prefix("0X"))
            .unwrap_or(t);
        let bytes = hex::decode(t).map_err(|_| {
            Error::Position(format!(
                "`{s}` is not a SQL Server LSN like `0x0000002A000001F00003`"
            ))
        })?;
        SqlServerLsn::from_slice(&bytes)
    }
}

impl From<SqlServerLsn> for String {
    fn from(l: SqlServerLsn) -> String {
        l.to_string()
    }
}

impl TryFrom<String> for SqlServerLsn {
    type Error = Error;
    fn try_from(s: String) -> Result<Self> {
        s.parse()
    }
}

/// The source dialect a position belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dialect {
    /// PostgreSQL: [`PgLsn`].
    Postgres,
    /// SQL Server: [`SqlServerLsn`].
    SqlServer,
}

/// A position in the source's change order, whichever the dialect: what
/// batches, change records, markers and the sidecar carry.
///
/// One pipeline reads one source, so positions of two dialects never meet
/// in practice; a state directory or sidecar written by the other dialect
/// is refused where it is read. (Were they compared, every PostgreSQL
/// position sorts first.) Serialized as its display form, which tells the
/// dialects apart: `0/16B3748` or `0x0000002A000001F00003`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(into = "String", try_from = "String")]
pub enum SourcePosition {
    /// A PostgreSQL LSN.
    Pg(PgLsn),
    /// A SQL Server LSN.
    SqlServer(SqlServerLsn),
}

impl SourcePosition {
    /// The dialect.
    pub fn dialect(self) -> Dialect {
        match self {
            SourcePosition::Pg(_) => Dialect::Postgres,
            SourcePosition::SqlServer(_) => Dialect::SqlServer,
        }
    }

    /// The position as a non-negative number that orders like the source
    /// (64 bits for PostgreSQL, 80 for SQL Server), for `numeric` columns.
    pub fn numeric(self) -> i128 {
        match self {
            SourcePosition::Pg(l) => i128::from(l.0),
            SourcePosition::SqlServer(l) => {
                l.0.iter().fold(0i128, |acc, b| (acc << 8) | i128::from(*b))
            }
        }
    }

    /// Inverse of [`SourcePosition::numeric`] for a known dialect.
    pub fn from_numeric(dialect: Dialect, v: i128) -> Result<SourcePosition> {
        let bad = || Error::Position(format!("{v} is not a {dialect:?} position"));
        match dialect {
            Dialect::Postgres => Ok(SourcePosition::Pg(PgLsn(
                u64::try_from(v).map_err(|_| bad())?,
            ))),
            Dialect::SqlServer => {
                if !(0..1i128 << 80).contains(&v) {
                    return Err(bad());
                }
                let bytes = v.to_be_bytes();
                let mut b = [0u8; 10];
                b.copy_from_slice(&bytes[6..]);
                Ok(SourcePosition::SqlServer(SqlServerLsn(b)))
            }
        }
    }

    /// A stored numeric position shown as the source shows it; the number
    /// itself when it is not a position of `dialect` (logs and status only).
    pub fn describe_numeric(dialect: Dialect, v: i128) -> String {
        SourcePosition::from_numeric(dialect, v)
            .map(|p| p.to_string())
            .unwrap_or_else(|_| v.to_string())
    }

    /// The PostgreSQL LSN, or an error naming what was found instead.
    pub fn pg(self) -> Result<PgLsn> {
        match self {
            SourcePosition::Pg(l) => Ok(l),
            other => Err(Error::Position(format!(
                "{other} is a SQL Server position, but the source is PostgreSQL"
            ))),
        }
    }

    /// The SQL Server LSN, or an error naming what was found instead.
    pub fn sqlserver(self) -> Result<SqlServerLsn> {
        match self {
            SourcePosition::SqlServer(l) => Ok(l),
            other => Err(Error::Position(format!(
                "{other} is a PostgreSQL position, but the source is SQL Server"
            ))),
        }
    }
}

impl From<PgLsn> for SourcePosition {
    fn from(l: PgLsn) -> Self {
        SourcePosition::Pg(l)
    }
}

impl From<SqlServerLsn> for SourcePosition {
    fn from(l: SqlServerLsn) -> Self {
        SourcePosition::SqlServer(l)
    }
}

impl fmt::Display for SourcePosition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SourcePosition::Pg(l) => l.fmt(f),
            SourcePosition::SqlServer(l) => l.fmt(f),
        }
    }
}

impl FromStr for SourcePosition {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        if s.contains('/') {
            s.parse().map(SourcePosition::Pg)
        } else {
            s.parse().map(SourcePosition::SqlServer)
        }
    }
}

impl From<SourcePosition> for String {
    fn from(l: SourcePosition) -> String {
        l.to_string()
    }
}

impl TryFrom<String> for SourcePosition {
    type Error = Error;
    fn try_from(s: String) -> Result<Self> {
        s.parse()
    }
}

/// The position of one change record inside the source's order: the commit
/// position of its transaction, then its sequence inside that transaction.
///
/// Every record of one transaction shares `commit`, so "drop what is at or
/// before the stored position" never splits a transaction. `seq` is unique
/// per record (not per source change: one change touching two roots gives
/// two records, two numbers), so the records of one partition are strictly
/// increasing and an applier can tell each from the ones it applied.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct ChangePosition {
    /// Commit (end) position of the transaction, as stored for the marker.
    pub commit: SourcePosition,
    /// Order of the record within its transaction: the source change's
    /// index, then the record within the change, in bits (see the
    /// extractor's resolver); never below the change index earlier versions
    /// stored. Below 2^63.
    pub seq: u64,
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn pg_lsn_display_matches_postgres() {
        assert_eq!(PgLsn(0x16B3748).to_string(), "0/16B3748");
        assert_eq!(PgLsn((0x2A << 32) | 0x10).to_string(), "2A/10");
        assert_eq!("0/16B3748".parse::<PgLsn>().unwrap(), PgLsn(0x16B3748));
        assert!("16B3748".parse::<PgLsn>().is_err());
        assert!("0/".parse::<PgLsn>().is_err());
        assert!("x/1".parse::<PgLsn>().is_err());
    }

    #[test]
    fn positions_of_the_other_dialect_are_refused() {
        let ms: SourcePosition = "0x0000002A000001F00003".parse().unwrap();
        assert_eq!(ms.dialect(), Dialect::SqlServer);
        assert!(ms
            .pg()
            .unwrap_err()
            .to_string()
            .contains("SQL Server position"));
        let pg: SourcePosition = "0/16B3748".parse().unwrap();
        assert_eq!(pg.pg().unwrap(), PgLsn(0x16B3748));
        assert!(pg.sqlserver().is_err());
        assert!(SourcePosition::from_numeric(Dialect::Postgres, -1).is_err());
        assert!(SourcePosition::from_numeric(Dialect::SqlServer, 1i128 << 80).is_err());
        assert_eq!(
            SourcePosition::describe_numeric(Dialect::Postgres, 0x16B3748),
            "0/16B3748"
        );
        assert_eq!(
            SourcePosition::describe_numeric(Dialect::Postgres, -1),
            "-1"
        );
        // serde keeps the PostgreSQL marker format of earlier releases.
        assert_eq!(serde_json::to_string(&pg).unwrap(), "\"0/16B3748\"");
    }

    #[test]
    fn sqlserver_lsn_display_matches_sql_server() {
        let l: SqlServerLsn = "0x0000002A000001F00003".parse().unwrap();
        assert_eq!(l.0, [0, 0, 0, 0x2A, 0, 0, 1, 0xF0, 0, 3]);
        assert_eq!(l.to_string(), "0x0000002A000001F00003");
        assert!(SqlServerLsn::from_slice(&[1, 2, 3]).is_err());
        assert_eq!(
            SqlServerLsn([0xFF; 10]).increment(),
            SqlServerLsn([0xFF; 10])
        );
        let mut b = [0u8; 10];
        b[9] = 0xFF;
        let mut c = [0u8; 10];
        c[8] = 1;
        assert_eq!(SqlServerLsn(b).increment(), SqlServerLsn(c));
    }

    proptest! {
        #[test]
        fn pg_lsn_round_trips_and_orders(a: u64, b: u64) {
            let la = PgLsn(a);
            prop_assert_eq!(la.to_string().parse::<PgLsn>().unwrap(), la);
            prop_assert_eq!(PgLsn(a).cmp(&PgLsn(b)), a.cmp(&b));
            if a < i64::MAX as u64 {
                prop_assert_eq!(PgLsn::from_i64(la.as_i64()), la);
            }
        }

        #[test]
        fn sqlserver_lsn_round_trips_and_orders(a: [u8; 10], b: [u8; 10]) {
            let la = SqlServerLsn(a);
            prop_assert_eq!(la.to_string().parse::<SqlServerLsn>().unwrap(), la);
            // Byte-wise big-endian order is numeric order of the 80-bit value.
            let num = |x: [u8; 10]| x.iter().fold(0u128, |acc, v| (acc << 8) | u128::from(*v));
            prop_assert_eq!(SqlServerLsn(a).cmp(&SqlServerLsn(b)), num(a).cmp(&num(b)));
        }

        #[test]
        fn source_positions_round_trip_through_text_and_numbers(a: u64, b: [u8; 10], c: [u8; 10]) {
            let pg = SourcePosition::Pg(PgLsn(a));
            let ms = SourcePosition::SqlServer(SqlServerLsn(b));
            for p in [pg, ms] {
                prop_assert_eq!(p.to_string().parse::<SourcePosition>().unwrap(), p);
                prop_assert_eq!(SourcePosition::from_numeric(p.dialect(), p.numeric()).unwrap(), p);
                prop_assert!(p.numeric() >= 0);
            }
            let mc = SourcePosition::SqlServer(SqlServerLsn(c));
            prop_assert_eq!(ms.cmp(&mc), ms.numeric().cmp(&mc.numeric()));
        }

        #[test]
        fn sqlserver_lsn_increment_is_monotonic(a: [u8; 10]) {
            let l = SqlServerLsn(a);
            let n = l.increment();
            if a != [0xFF; 10] {
                prop_assert!(n > l);
                prop_assert_eq!(n.decrement(), l);
            } else {
                prop_assert_eq!(n, l);
            }
            if a != [0; 10] {
                prop_assert!(l.decrement() < l);
                prop_assert_eq!(l.decrement().increment(), l);
            } else {
                prop_assert_eq!(l.decrement(), l);
            }
        }
    }
}
