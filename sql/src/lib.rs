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

    /// `(table, [column])` of every `CREATE TABLE` in `ddl`, and the index
    /// names, in either dialect (`"x"` or `[x]` quoting), sorted.
    fn shape(ddl: &str) -> (Vec<(String, Vec<String>)>, Vec<String>) {
        let name = |s: &str| -> String {
            s.trim_start()
                .trim_start_matches(['"', '['])
                .split(['"', ']'])
                .next()
                .unwrap_or_default()
                .to_string()
        };
        let (mut tables, mut indexes) = (vec![], vec![]);
        let mut open: Option<(String, Vec<String>)> = None;
        for line in ddl.lines() {
            let t = line.trim_start();
            if let Some((table, cols)) = open.as_mut() {
                if t.starts_with(");") {
                    tables.push((table.clone(), std::mem::take(cols)));
                    open = None;
                } else if t.starts_with(['"', '[']) {
                    cols.push(name(t));
                }
            } else if let Some(rest) = t.strip_prefix("CREATE TABLE ") {
                let qualified = rest.trim_start_matches("IF NOT EXISTS ");
                let table = qualified.split_once('.').map_or("", |(_, t)| t);
                open = Some((name(table), vec![]));
            } else if let Some(rest) = t.strip_prefix("CREATE INDEX ") {
                indexes.push(name(rest.trim_start_matches("IF NOT EXISTS ")));
            }
        }
        tables.sort();
        indexes.sort();
        (tables, indexes)
    }

    /// The sidecar is one schema in two dialects: every table, column and
    /// index of one is in the other (a version added to one is added to
    /// both).
    #[test]
    fn both_dialects_create_the_same_sidecar() {
        let pg = shape(&sidecar_ddl(Dialect::Postgres, "skein"));
        let ms = shape(&sidecar_ddl(Dialect::SqlServer, "skein"));
        assert!(pg.0.len() >= 9 && pg.1.len() >= 4, "{pg:?}");
        assert_eq!(pg, ms);
    }

    #[test]
    fn quoting_doubles_quotes() {
        assert_eq!(quote_ident("a\"b"), "\"a\"\"b\"");
        assert_eq!(quote_literal("it's"), "'it''s'");
    }
}
