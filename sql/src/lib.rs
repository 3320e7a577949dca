//! # skein-sql
//!
//! Every dialect fact. Every SQL statement skein runs or prints, rendered
//! by pure functions from the entity config and a [`Catalog`] (the source's
//! tables, columns, types and primary keys): the extractor fetches the
//! catalog, this crate decides the text, golden files under `tests/golden/`
//! pin it. Every identifier is quoted with [`quote_ident`]. Beside the text,
//! [`sqlserver::decode`] turns TDS cells into skein's value formats and
//! [`sqlserver::client`] is the one thin SQL Server connection wrapper (the
//! PostgreSQL client is `tokio-postgres` itself).
//!
//! Value formats in event JSON are decided here too (see
//! [`postgres::json_expr`]), because they are part of the frozen version hash.

pub mod catalog;
pub mod postgres;
pub mod sqlserver;

pub use catalog::{Catalog, ColumnInfo, TableInfo};
use skein_common::Dialect;

/// The sidecar schema's DDL in `dialect` (`skein sql sidecar`).
pub fn sidecar_ddl(dialect: Dialect, schema: &str) -> String {
    match dialect {
        Dialect::Postgres => postgres::sidecar_ddl(schema),
        Dialect::SqlServer => sqlserver::sidecar_ddl(schema),
    }
}

/// Quotes an identifier for PostgreSQL (and ANSI SQL): `"a""b"`.
pub fn quote_ident(s: &str) -> String {
    format!("\"{}\"", s.replace('"', "\"\""))
}

/// Quotes a string literal: `'it''s'`.
pub fn quote_literal(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoting_doubles_quotes() {
        assert_eq!(quote_ident("a\"b"), "\"a\"\"b\"");
        assert_eq!(quote_literal("it's"), "'it''s'");
    }
}
