//! The catalog read every PostgreSQL role makes through its own
//! `tokio-postgres` connection (extractor at start and on a changed Relation
//! message; appliers in every batch's snapshot).

use std::collections::HashMap;

use crate::catalog::{Catalog, ColumnInfo, TableInfo};

/// Reads the catalog of `tables` (`(schema, table)`, each once) with
/// `query`: [`super::CATALOG_QUERY`], as text or prepared from it; a table
/// that does not exist is simply absent.
/// Inside a transaction it reads the catalog as that snapshot sees it.
pub async fn read_catalog<Q>(
    client: &tokio_postgres::Client,
    query: &Q,
    tables: &[(String, String)],
) -> Result<Catalog, tokio_postgres::Error>
where
    Q: tokio_postgres::ToStatement + ?Sized,
{
    let (schemas, names): (Vec<&str>, Vec<&str>) =
        tables.iter().map(|(s, t)| (s.as_str(), t.as_str())).unzip();
    let rows = client.query(query, &[&schemas, &names]).await?;
    let mut cat = Catalog::default();
    let mut pks: HashMap<(String, String), Vec<(i32, String)>> = HashMap::new();
    for r in rows {
        let schema: String = r.get(0);
        let table: String = r.get(1);
        let col = ColumnInfo {
            name: r.get(2),
            data_type: r.get(3),
            type_name: r.get(4),
            nullable: r.get(5),
        };
        let pk_pos: Option<i32> = r.get(6);
        let ident: String = r.get(7);
        if let Some(p) = pk_pos {
            pks.entry((schema.clone(), table.clone()))
                .or_default()
                .push((p, col.name.clone()));
        }
        let key = (schema.clone(), table.clone());
        let t = cat.tables.entry(key).or_insert_with(|| TableInfo {
            schema,
            table,
            columns: vec![],
            primary_key: vec![],
            replica_identity: ident.chars().next().unwrap_or('d'),
        });
        t.columns.push(col);
    }
    for (k, mut cols) in pks {
        cols.sort();
        if let Some(t) = cat.tables.get_mut(&k) {
            t.primary_key = cols.into_iter().map(|(_, c)| c).collect();
        }
    }
    Ok(cat)
}
