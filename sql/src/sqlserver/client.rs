//! The SQL Server connection: one owned TDS client whose queries decode
//! their rows into [`SqlValue`]s, so callers never see driver types, and a
//! [`Transaction`] guard that rolls back when dropped uncommitted.

use skein_common::sqlvalue::SqlValue;

use super::decode::decode_row;

/// A SQL Server error with what skein was doing when it happened.
#[derive(Debug, thiserror::Error)]
#[error("SQL Server: {context}: {source}")]
pub struct MssqlError {
    /// What was being done.
    pub context: String,
    /// The driver's error.
    #[source]
    pub source: tiberius::error::Error,
}

impl MssqlError {
    /// Connection-level failures may go away on retry, and so may a
    /// server error that says so ([`retryable_server_error`]); any other
    /// server error (permission, syntax, missing object) does not.
    pub fn is_retryable(&self) -> bool {
        match &self.source {
            tiberius::error::Error::Io { .. } | tiberius::error::Error::Routing { .. } => true,
            tiberius::error::Error::Server(e) => retryable_server_error(e.code()),
            _ => false,
        }
    }
}

/// Server error numbers a retry of the whole transaction can get past:
/// 1205, chosen as a deadlock victim (two appliers taking the range locks
/// of the identifier insert, say), whose transaction the server has rolled
/// back already.
pub fn retryable_server_error(code: u32) -> bool {
    code == 1205
}

fn ctx(context: impl Into<String>) -> impl FnOnce(tiberius::error::Error) -> MssqlError {
    let context = context.into();
    move |source| MssqlError { context, source }
}

/// Parses an ADO.NET string or a (jdbc:)sqlserver:// URL.
pub fn parse_url(url: &str) -> Result<tiberius::Config, MssqlError> {
    let t = url.trim();
    let lower = t.to_ascii_lowercase();
    let parsed = if lower.starts_with("jdbc:sqlserver://") {
        tiberius::Config::from_jdbc_string(t)
    } else if lower.starts_with("sqlserver://") {
        tiberius::Config::from_jdbc_string(&format!("jdbc:{t}"))
    } else {
        tiberius::Config::from_ado_string(t)
    };
    parsed.map_err(ctx("parsing the connection string"))
}

type Tds = tiberius::Client<tokio_util::compat::Compat<tokio::net::TcpStream>>;

/// One SQL Server connection. Owns it; every query decodes its rows into
/// [`SqlValue`]s so callers never see driver types.
pub struct MssqlClient {
    client: Tds,
    /// A [`Transaction`] was dropped uncommitted: roll back before the
    /// next request.
    abandoned: bool,
}

impl std::fmt::Debug for MssqlClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("MssqlClient")
    }
}

impl MssqlClient {
    /// Connects with an ADO.NET connection string
    /// (`server=tcp:host,1433;database=…;user=…;password=…;TrustServerCertificate=true`)
    /// or a JDBC-style URL (`sqlserver://host:1433;databaseName=…;user=…;password=…`,
    /// `jdbc:` in front optional), following one Azure-style redirect.
    pub async fn connect(url: &str) -> Result<MssqlClient, MssqlError> {
        use tokio_util::compat::TokioAsyncWriteCompatExt;
        let mut config = parse_url(url)?;
        for _ in 0..2 {
            let tcp = tokio::net::TcpStream::connect(config.get_addr())
                .await
                .map_err(|e| MssqlError {
                    context: format!("connecting to {}", config.get_addr()),
                    source: e.into(),
                })?;
            let _ = tcp.set_nodelay(true);
            match tiberius::Client::connect(config.clone(), tcp.compat_write()).await {
                Ok(client) => {
                    return Ok(MssqlClient {
                        client,
                        abandoned: false,
                    })
                }
                Err(tiberius::error::Error::Routing { host, port }) => {
                    config.host(&host);
                    config.port(port);
                }
                Err(e) => return Err(ctx("logging in")(e)),
            }
        }
        Err(MssqlError {
            context: "logging in".into(),
            source: tiberius::error::Error::Protocol("redirected more than once".into()),
        })
    }

    /// Runs a parameterised query (`@P1`, …) and decodes its first result set.
    pub async fn query(
        &mut self,
        what: &str,
        sql: &str,
        params: &[&dyn tiberius::ToSql],
    ) -> Result<Vec<Vec<SqlValue>>, MssqlError> {
        self.settle().await;
        let rows = self
            .client
            .query(sql, params)
            .await
            .map_err(ctx(what))?
            .into_first_result()
            .await
            .map_err(ctx(what))?;
        rows.iter()
            .map(|r| {
                decode_row(r).map_err(|e| MssqlError {
                    context: what.to_string(),
                    source: tiberius::error::Error::Conversion(e.to_string().into()),
                })
            })
            .collect()
    }

    /// Runs a parameterised statement, returning the rows it affected.
    pub async fn execute(
        &mut self,
        what: &str,
        sql: &str,
        params: &[&dyn tiberius::ToSql],
    ) -> Result<u64, MssqlError> {
        self.settle().await;
        Ok(self
            .client
            .execute(sql, params)
            .await
            .map_err(ctx(what))?
            .total())
    }

    /// (Re)creates a session temp table with `create_sql` and fills it with
    /// `tuples` as `(ord, v0, v1, …)` rows, `ord` from 1, by `insert_sql(rows)`
    /// statements of at most `per_statement` rows each (a request takes at
    /// most 2,100 parameters). The create runs as a plain batch, not through
    /// `sp_executesql`, so the table outlives it for the session's queries.
    pub async fn fill_temp_table(
        &mut self,
        what: &str,
        create_sql: &str,
        tuples: &[Vec<Option<String>>],
        per_statement: usize,
        insert_sql: impl Fn(usize) -> String,
    ) -> Result<(), MssqlError> {
        self.batch(what, create_sql).await?;
        for (ci, chunk) in tuples.chunks(per_statement.max(1)).enumerate() {
            let base = ci * per_statement.max(1);
            let ords: Vec<i32> = (0..chunk.len())
                .map(|i| i32::try_from(base + i + 1).unwrap_or(i32::MAX))
                .collect();
            let mut params: Vec<&dyn tiberius::ToSql> = vec![];
            for (ord, t) in ords.iter().zip(chunk) {
                params.push(ord);
                for v in t {
                    params.push(v);
                }
            }
            self.execute(what, &insert_sql(chunk.len()), &params)
                .await?;
        }
        Ok(())
    }

    /// Opens a transaction on this connection (`BEGIN TRAN`). Requests
    /// through the returned guard run inside it; dropped without
    /// [`Transaction::commit`] it is rolled back (see [`Transaction`]).
    pub async fn transaction(&mut self, what: &str) -> Result<Transaction<'_>, MssqlError> {
        self.batch(what, "BEGIN TRAN;").await?;
        Ok(Transaction {
            client: self,
            open: true,
        })
    }

    /// Rolls back the open transaction, if any. Best effort: with
    /// `XACT_ABORT` the server may have rolled back already, and a broken
    /// connection rolls back on the server when it closes.
    pub async fn rollback_quietly(&mut self) {
        self.abandoned = false;
        let _ = self
            .client
            .simple_query("IF @@TRANCOUNT > 0 ROLLBACK TRAN;")
            .await;
    }

    /// Rolls back what a dropped [`Transaction`] left open.
    async fn settle(&mut self) {
        if self.abandoned {
            self.rollback_quietly().await;
        }
    }

    /// Runs a batch without parameters (DDL, `SET`, temp tables), discarding
    /// any result.
    pub async fn batch(&mut self, what: &str, sql: &str) -> Result<(), MssqlError> {
        self.settle().await;
        self.client
            .simple_query(sql)
            .await
            .map_err(ctx(what))?
            .into_results()
            .await
            .map_err(ctx(what))?;
        Ok(())
    }
}

/// An open transaction on a [`MssqlClient`], from
/// [`MssqlClient::transaction`]; requests go through it (it derefs to the
/// client).
///
/// Dropped without [`Transaction::commit`] — an error returned with `?`, a
/// cancelled future — it is rolled back: `Drop` cannot wait for the
/// server, so the client rolls back before its next request, and a
/// connection that is dropped too is rolled back by the server as its
/// session ends. The sidecar sessions also run with `XACT_ABORT ON`, so a
/// failed statement has already doomed the transaction.
pub struct Transaction<'a> {
    client: &'a mut MssqlClient,
    open: bool,
}

impl Transaction<'_> {
    /// Commits (`COMMIT TRAN`).
    pub async fn commit(mut self, what: &str) -> Result<(), MssqlError> {
        let r = self.client.batch(what, "COMMIT TRAN;").await;
        // A failed commit leaves the transaction to the drop's rollback.
        self.open = r.is_err();
        r
    }

    /// Rolls back now instead of before the next request.
    pub async fn rollback(mut self) {
        self.open = false;
        self.client.rollback_quietly().await;
    }
}

impl std::ops::Deref for Transaction<'_> {
    type Target = MssqlClient;

    fn deref(&self) -> &MssqlClient {
        self.client
    }
}

impl std::ops::DerefMut for Transaction<'_> {
    fn deref_mut(&mut self) -> &mut MssqlClient {
        self.client
    }
}

impl Drop for Transaction<'_> {
    fn drop(&mut self) {
        if self.open {
            self.client.abandoned = true;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connection_strings_of_both_styles_parse() {
        for url in [
            "server=tcp:db.example,1433;database=crm;user=u;password=p;TrustServerCertificate=true",
            "sqlserver://db.example:1433;databaseName=crm;user=u;password=p",
            "jdbc:sqlserver://db.example:1433;databaseName=crm;user=u;password=p",
        ] {
            let c = parse_url(url).unwrap_or_else(|e| panic!("{url}: {e}"));
            assert_eq!(c.get_addr(), "db.example:1433", "{url}");
        }
    }
}

#[cfg(test)]
mod retry_tests {
    use super::retryable_server_error;

    #[test]
    fn a_deadlock_victim_is_retried_other_server_errors_are_not() {
        assert!(retryable_server_error(1205));
        // Permission denied, invalid object name, unique key violation.
        for code in [229, 208, 2627] {
            assert!(!retryable_server_error(code), "{code}");
        }
    }
}
