//! Commit times. `cdc.lsn_time_mapping.tran_end_time` is the server's
//! local wall-clock time, without an offset. Converted with the offset the
//! server has *now*, a change committed on the other side of the last DST
//! switch is off by the shift; converted with the server's time zone
//! (`AT TIME ZONE`, SQL Server 2016+), each time gets the offset of its own
//! day. The zone comes from `source.time_zone`, else from the server
//! (`CURRENT_TIMEZONE_ID()`, SQL Server 2022+ and Azure SQL); without
//! either, the current offset it is, with one warning at start.
//!
//! Pure: [`choose_clock`] decides from what the server answered
//! ([`ClockFacts`]); the reader asks.

use skein_common::sqlvalue::SqlValue;

/// What `SERVERPROPERTY` says (`SERVER_VERSION_SQL`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ServerVersion {
    /// `ProductMajorVersion`: 13 is SQL Server 2016, 16 is 2022 (Azure SQL
    /// Database says 12).
    pub major: Option<i64>,
    /// `EngineEdition`: 5 Azure SQL Database, 8 Azure SQL Managed Instance.
    pub edition: Option<i64>,
}

impl ServerVersion {
    /// From the row of `SERVER_VERSION_SQL`; what is missing stays unknown.
    pub fn from_row(row: &[SqlValue]) -> ServerVersion {
        let int = |i: usize| match row.get(i) {
            Some(SqlValue::Int(v)) => Some(*v),
            _ => None,
        };
        ServerVersion {
            major: int(0),
            edition: int(1),
        }
    }

    fn azure(&self) -> bool {
        matches!(self.edition, Some(5 | 8))
    }

    /// Whether the server has `AT TIME ZONE` and `sys.time_zone_info`.
    pub fn has_at_time_zone(&self) -> bool {
        self.azure() || self.major.is_some_and(|m| m >= 13)
    }

    /// Whether the server has `CURRENT_TIMEZONE_ID()` (an older one refuses
    /// the statement that names it).
    pub fn has_current_timezone_id(&self) -> bool {
        self.azure() || self.major.is_some_and(|m| m >= 16)
    }
}

/// How commit times become UTC.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CommitClock {
    /// As local times of this Windows time zone (`AT TIME ZONE`).
    Zone(String),
    /// Shifted by the server's current UTC offset.
    CurrentOffset,
}

impl CommitClock {
    /// The commit-time query for this clock (`@P3`: the zone's name).
    pub fn sql(&self) -> &'static str {
        match self {
            CommitClock::Zone(_) => skein_sql::sqlserver::LSN_TIME_SQL,
            CommitClock::CurrentOffset => skein_sql::sqlserver::LSN_TIME_CURRENT_OFFSET_SQL,
        }
    }

    /// The zone's name, `None` for the current offset.
    pub fn zone(&self) -> Option<&str> {
        match self {
            CommitClock::Zone(z) => Some(z),
            CommitClock::CurrentOffset => None,
        }
    }
}

/// What the server answered, for [`choose_clock`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClockFacts {
    /// Its version and edition.
    pub version: ServerVersion,
    /// Whether `sys.time_zone_info` holds the configured name (`None`: not
    /// asked, the server has no such view or nothing is configured).
    pub configured_known: Option<bool>,
    /// `CURRENT_TIMEZONE_ID()` (`None`: the server lacks it or said nothing).
    pub server_zone: Option<String>,
}

/// A `source.time_zone` the server cannot use: what is wrong and the fix.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClockProblem {
    /// What is wrong.
    pub message: String,
    /// What to do.
    pub fix: String,
}

/// The clock, and a warning to log once at start (or show in `skein
/// validate`) when there is one.
pub fn choose_clock(
    configured: Option<&str>,
    facts: &ClockFacts,
) -> Result<(CommitClock, Option<String>), ClockProblem> {
    let server_zone = facts
        .server_zone
        .as_deref()
        .map(str::trim)
        .filter(|z| !z.is_empty());
    let Some(tz) = configured else {
        return Ok(match server_zone {
            Some(z) => (CommitClock::Zone(z.to_string()), None),
            None => (CommitClock::CurrentOffset, Some(offset_warning(facts))),
        });
    };
    if !facts.version.has_at_time_zone() {
        return Err(ClockProblem {
            message: format!(
                "source.time_zone is `{tz}`, but this server ({}) has no AT TIME ZONE \
                 (SQL Server 2016 or later)",
                describe(&facts.version)
            ),
            fix: "remove source.time_zone: commit times are then converted with the server's \
                  current UTC offset (changes from before the last DST switch are off by the \
                  shift)"
                .into(),
        });
    }
    if facts.configured_known == Some(false) {
        let hint = server_zone
            .map(|z| format!(" (the server says it runs in `{z}`)"))
            .unwrap_or_default();
        return Err(ClockProblem {
            message: format!(
                "source.time_zone `{tz}` is not a time zone this server knows (sys.time_zone_info)"
            ),
            fix: format!(
                "set source.time_zone to the server's Windows time zone{hint}, one of\n\
                 SELECT name FROM sys.time_zone_info ORDER BY name;"
            ),
        });
    }
    let warning = server_zone
        .filter(|z| !z.eq_ignore_ascii_case(tz))
        .map(|z| {
            format!(
                "source.time_zone is `{tz}` but the server says it runs in `{z}` \
             (CURRENT_TIMEZONE_ID()): commit times are converted as `{tz}`; if the server \
             is right, they are off by the difference"
            )
        });
    Ok((CommitClock::Zone(tz.to_string()), warning))
}

fn offset_warning(facts: &ClockFacts) -> String {
    let fix = if facts.version.has_at_time_zone() {
        "set source.time_zone to the server's Windows time zone (a name from \
         `SELECT name FROM sys.time_zone_info`, e.g. `W. Europe Standard Time`) to convert \
         each with its own day's offset"
            .to_string()
    } else {
        format!(
            "this server ({}) has no AT TIME ZONE; on SQL Server 2016 or later, \
             source.time_zone fixes it",
            describe(&facts.version)
        )
    };
    format!(
        "the server's time zone is unknown, so commit times (the events' `time`) are \
         converted from server-local time with the server's current UTC offset: those of \
         changes committed before the last DST switch are off by the shift; {fix}"
    )
}

fn describe(v: &ServerVersion) -> String {
    match v.major {
        Some(m) => format!("major version {m}"),
        None => "version unknown".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `SERVER_VERSION_SQL` rows as servers return them.
    fn version(major: Option<i64>, edition: Option<i64>) -> ServerVersion {
        let cell = |v: Option<i64>| v.map(SqlValue::Int).unwrap_or(SqlValue::Null);
        ServerVersion::from_row(&[cell(major), cell(edition)])
    }

    #[test]
    fn what_each_server_has() {
        // (major, edition) -> (AT TIME ZONE, CURRENT_TIMEZONE_ID)
        for (major, edition, at, current) in [
            (Some(11), Some(3), false, false), // 2012 Enterprise
            (Some(13), Some(2), true, false),  // 2016 Standard
            (Some(15), Some(4), true, false),  // 2019 Express
            (Some(16), Some(3), true, true),   // 2022 Developer
            (Some(12), Some(5), true, true),   // Azure SQL Database
            (Some(16), Some(8), true, true),   // Managed Instance
            (None, None, false, false),        // 2008: no ProductMajorVersion
        ] {
            let v = version(major, edition);
            assert_eq!(v.has_at_time_zone(), at, "{v:?}");
            assert_eq!(v.has_current_timezone_id(), current, "{v:?}");
        }
        assert_eq!(
            ServerVersion::from_row(&[SqlValue::Text("16".into())]),
            ServerVersion::default()
        );
    }

    fn facts(v: ServerVersion, known: Option<bool>, zone: Option<&str>) -> ClockFacts {
        ClockFacts {
            version: v,
            configured_known: known,
            server_zone: zone.map(String::from),
        }
    }

    #[test]
    fn the_configured_zone_wins_when_the_server_knows_it() {
        let f = facts(version(Some(15), Some(2)), Some(true), None);
        assert_eq!(
            choose_clock(Some("W. Europe Standard Time"), &f).unwrap(),
            (CommitClock::Zone("W. Europe Standard Time".into()), None)
        );
        // The server names another zone: converted as configured, said once.
        let f = facts(
            version(Some(16), Some(3)),
            Some(true),
            Some("Pacific Standard Time"),
        );
        let (clock, warning) = choose_clock(Some("W. Europe Standard Time"), &f).unwrap();
        assert_eq!(clock.zone(), Some("W. Europe Standard Time"));
        let w = warning.unwrap();
        assert!(w.contains("Pacific Standard Time"), "{w}");
        // The same name in another case is the same zone.
        let f = facts(version(Some(16), Some(3)), Some(true), Some("utc"));
        assert_eq!(choose_clock(Some("UTC"), &f).unwrap().1, None);
    }

    #[test]
    fn an_unknown_or_unusable_configured_zone_stops_with_the_fix() {
        let f = facts(version(Some(16), Some(3)), Some(false), Some("UTC"));
        let e = choose_clock(Some("Central Europe"), &f).unwrap_err();
        assert!(e.message.contains("`Central Europe`"), "{e:?}");
        assert!(
            e.fix.contains("sys.time_zone_info") && e.fix.contains("`UTC`"),
            "{e:?}"
        );
        let f = facts(version(Some(12), Some(3)), None, None);
        let e = choose_clock(Some("UTC"), &f).unwrap_err();
        assert!(e.message.contains("2016") && e.fix.contains("remove source.time_zone"));
    }

    #[test]
    fn without_a_setting_the_server_s_zone_else_the_current_offset_with_a_warning() {
        let f = facts(
            version(Some(16), Some(3)),
            None,
            Some("Eastern Standard Time"),
        );
        assert_eq!(
            choose_clock(None, &f).unwrap(),
            (CommitClock::Zone("Eastern Standard Time".into()), None)
        );
        // 2019: no CURRENT_TIMEZONE_ID, so nothing was asked.
        let f = facts(version(Some(15), Some(2)), None, None);
        let (clock, warning) = choose_clock(None, &f).unwrap();
        assert_eq!(clock, CommitClock::CurrentOffset);
        let w = warning.unwrap();
        assert!(
            w.contains("before the last DST switch are off by the shift")
                && w.contains("source.time_zone"),
            "{w}"
        );
        // An empty answer counts as none.
        let f = facts(version(Some(16), Some(3)), None, Some(" "));
        assert_eq!(
            choose_clock(None, &f).unwrap().0,
            CommitClock::CurrentOffset
        );
        // Before 2016 the setting cannot help; the warning says so.
        let f = facts(version(Some(12), Some(3)), None, None);
        let w = choose_clock(None, &f).unwrap().1.unwrap();
        assert!(w.contains("no AT TIME ZONE") && w.contains("2016"), "{w}");
    }

    #[test]
    fn each_clock_has_its_query() {
        assert!(CommitClock::Zone("UTC".into())
            .sql()
            .contains("AT TIME ZONE @P3 AT TIME ZONE N'UTC'"));
        assert!(CommitClock::CurrentOffset
            .sql()
            .contains("SYSUTCDATETIME()"));
        assert_eq!(CommitClock::CurrentOffset.zone(), None);
    }
}
