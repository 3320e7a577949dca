//! Where an applier stands in its partition.
//!
//! The transport decides what an applier's progress counts: the in-process
//! transport hands over whole extractor batches, so progress is the source
//! position of the last batch's upper bound; Kafka hands over a log, so
//! progress is the next offset to consume. The sidecar stores either as one
//! `numeric` column; [`Checkpoint`] is the typed form the code passes
//! around, so an offset is never compared with a source position.

use std::fmt;

use crate::error::Result;
use crate::position::{Dialect, SourcePosition};

/// What a partition's progress counts (decided by the transport).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CheckpointKind {
    /// The source position of the last applied batch's upper bound.
    Source(Dialect),
    /// The next transport offset to consume (Kafka).
    Offset,
}

/// A partition's progress, typed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Checkpoint {
    /// In-process: every change at or before this source position is applied.
    Source(SourcePosition),
    /// Kafka: every record before this offset is applied.
    Offset(i64),
}

impl Checkpoint {
    /// What the checkpoint counts.
    pub fn kind(self) -> CheckpointKind {
        match self {
            Checkpoint::Source(p) => CheckpointKind::Source(p.dialect()),
            Checkpoint::Offset(_) => CheckpointKind::Offset,
        }
    }

    /// The stored form (the sidecar's `numeric(25,0)` columns): an offset
    /// as itself, a source position as [`SourcePosition::numeric`]. Both
    /// order like the checkpoints they come from.
    pub fn numeric(self) -> i128 {
        match self {
            Checkpoint::Source(p) => p.numeric(),
            Checkpoint::Offset(o) => i128::from(o),
        }
    }

    /// Reads a stored checkpoint back, knowing what it counts.
    pub fn from_numeric(kind: CheckpointKind, v: i128) -> Result<Checkpoint> {
        match kind {
            CheckpointKind::Source(d) => {
                Ok(Checkpoint::Source(SourcePosition::from_numeric(d, v)?))
            }
            CheckpointKind::Offset => i64::try_from(v)
                .map(Checkpoint::Offset)
                .map_err(|_| crate::Error::Position(format!("{v} is not a transport offset"))),
        }
    }

    /// The offset, when this is one.
    pub fn offset(self) -> Option<i64> {
        match self {
            Checkpoint::Offset(o) => Some(o),
            Checkpoint::Source(_) => None,
        }
    }
}

impl fmt::Display for Checkpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Checkpoint::Source(p) => write!(f, "{p}"),
            Checkpoint::Offset(o) => write!(f, "offset {o}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::position::{PgLsn, SqlServerLsn};

    proptest! {
        #[test]
        fn stored_form_round_trips_and_orders(a in any::<u64>(), b in any::<u64>(), o in any::<i64>(), x in any::<[u8; 10]>(), y in any::<[u8; 10]>()) {
            let pg = |v| Checkpoint::Source(SourcePosition::Pg(PgLsn(v)));
            let ms = |v| Checkpoint::Source(SourcePosition::SqlServer(SqlServerLsn(v)));
            for c in [pg(a), ms(x), Checkpoint::Offset(o)] {
                prop_assert_eq!(Checkpoint::from_numeric(c.kind(), c.numeric()).unwrap(), c);
            }
            prop_assert_eq!(a.cmp(&b), pg(a).numeric().cmp(&pg(b).numeric()));
            prop_assert_eq!(x.cmp(&y), ms(x).numeric().cmp(&ms(y).numeric()));
        }
    }

    #[test]
    fn a_stored_value_of_the_wrong_kind_is_an_error() {
        assert!(Checkpoint::from_numeric(CheckpointKind::Offset, i128::MAX).is_err());
        assert!(Checkpoint::from_numeric(CheckpointKind::Source(Dialect::Postgres), -1).is_err());
        assert!(
            Checkpoint::from_numeric(CheckpointKind::Source(Dialect::SqlServer), 1 << 80).is_err()
        );
    }
}
