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

/// The position of one change inside the source's order: the commit position
/// of its transaction, then its sequence inside that transaction.
///
/// Every change of one transaction shares `commit`, so "drop what is at or
/// before the stored position" never splits a transaction.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct ChangePosition {
    /// Commit (end) position of the transaction, as stored for the marker.
    pub commit: PgLsn,
    /// Order of the change within its transaction, from 0.
    pub seq: u32,
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
        fn sqlserver_lsn_increment_is_monotonic(a: [u8; 10]) {
            let l = SqlServerLsn(a);
            let n = l.increment();
            if a != [0xFF; 10] {
                prop_assert!(n > l);
            } else {
                prop_assert_eq!(n, l);
            }
        }
    }
}
