//! Decoding of pgoutput (protocol version 1) row messages.
//!
//! `pgwire-replication` hands us Begin/Commit as events and every other
//! pgoutput message as raw bytes; this module turns those bytes into plain
//! data. A malformed message is an error with context, never a panic.

use bytes::{Buf, Bytes};

use crate::error::{Error, Result};
use crate::resolve::RowImage;

/// One column of a relation, as announced by a Relation message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RelColumn {
    /// Column name.
    pub name: String,
    /// Part of the replica identity.
    pub is_key: bool,
    /// Type OID (a retyped column sends another one).
    pub type_oid: u32,
}

/// A Relation message: the table behind a relation id.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Relation {
    /// Relation OID.
    pub oid: u32,
    /// Schema.
    pub schema: String,
    /// Table.
    pub table: String,
    /// Published columns, in message order.
    pub columns: Vec<RelColumn>,
}

/// One value of a tuple.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Value {
    /// SQL NULL.
    Null,
    /// An unchanged TOASTed value (not sent).
    Unchanged,
    /// Text form.
    Text(String),
}

/// A decoded row message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Message {
    /// Relation metadata (cache it).
    Relation(Relation),
    /// Insert: the new tuple.
    Insert { oid: u32, new: Vec<Value> },
    /// Update: old key/full tuple when the identity changed or is FULL, new tuple.
    Update {
        oid: u32,
        old: Option<Vec<Value>>,
        new: Vec<Value>,
    },
    /// Delete: the old key or full tuple.
    Delete { oid: u32, old: Vec<Value> },
    /// Truncate of the given relations.
    Truncate { oids: Vec<u32> },
    /// Anything skein does not need (Type, Origin, Begin/Commit duplicates).
    Other(u8),
}

fn need(buf: &Bytes, n: usize, what: &str) -> Result<()> {
    if buf.remaining() < n {
        return Err(Error::Decode(format!(
            "pgoutput message truncated while reading {what}"
        )));
    }
    Ok(())
}

fn cstr(buf: &mut Bytes, what: &str) -> Result<String> {
    let end = buf
        .iter()
        .position(|b| *b == 0)
        .ok_or_else(|| Error::Decode(format!("pgoutput: unterminated string in {what}")))?;
    let s = String::from_utf8(buf.split_to(end).to_vec())
        .map_err(|_| Error::Decode(format!("pgoutput: {what} is not UTF-8")))?;
    buf.advance(1);
    Ok(s)
}

fn tuple(buf: &mut Bytes) -> Result<Vec<Value>> {
    need(buf, 2, "tuple column count")?;
    let n = buf.get_i16();
    let mut out = Vec::with_capacity(n.max(0) as usize);
    for _ in 0..n {
        need(buf, 1, "tuple value kind")?;
        match buf.get_u8() {
            b'n' => out.push(Value::Null),
            b'u' => out.push(Value::Unchanged),
            b't' | b'b' => {
                need(buf, 4, "value length")?;
                let len = buf.get_i32();
                if len < 0 {
                    return Err(Error::Decode("pgoutput: negative value length".into()));
                }
                need(buf, len as usize, "value")?;
                let raw = buf.split_to(len as usize);
                let s = String::from_utf8(raw.to_vec())
                    .map_err(|_| Error::Decode("pgoutput: text value is not UTF-8".into()))?;
                out.push(Value::Text(s));
            }
            other => {
                return Err(Error::Decode(format!(
                    "pgoutput: unknown tuple value kind {:?}",
                    other as char
                )))
            }
        }
    }
    Ok(out)
}

/// Decodes one pgoutput message.
pub fn decode(data: &Bytes) -> Result<Message> {
    let mut buf = data.clone();
    need(&buf, 1, "message tag")?;
    let tag = buf.get_u8();
    match tag {
        b'R' => {
            need(&buf, 4, "relation id")?;
            let oid = buf.get_u32();
            let schema = cstr(&mut buf, "relation namespace")?;
            let table = cstr(&mut buf, "relation name")?;
            need(&buf, 3, "relation header")?;
            let _identity = buf.get_u8();
            let n = buf.get_i16();
            let mut columns = Vec::with_capacity(n.max(0) as usize);
            for _ in 0..n {
                need(&buf, 1, "column flags")?;
                let flags = buf.get_u8();
                let name = cstr(&mut buf, "column name")?;
                need(&buf, 8, "column type")?;
                let type_oid = buf.get_u32();
                let _typmod = buf.get_i32();
                columns.push(RelColumn {
                    name,
                    is_key: flags & 1 == 1,
                    type_oid,
                });
            }
            Ok(Message::Relation(Relation {
                oid,
                schema,
                table,
                columns,
            }))
        }
        b'I' => {
            need(&buf, 5, "insert header")?;
            let oid = buf.get_u32();
            let _n = buf.get_u8();
            Ok(Message::Insert {
                oid,
                new: tuple(&mut buf)?,
            })
        }
        b'U' => {
            need(&buf, 5, "update header")?;
            let oid = buf.get_u32();
            let mut kind = buf.get_u8();
            let mut old = None;
            if kind == b'K' || kind == b'O' {
                old = Some(tuple(&mut buf)?);
                need(&buf, 1, "update new tuple")?;
                kind = buf.get_u8();
            }
            if kind != b'N' {
                return Err(Error::Decode(format!(
                    "pgoutput: update without new tuple (got {:?})",
                    kind as char
                )));
            }
            Ok(Message::Update {
                oid,
                old,
                new: tuple(&mut buf)?,
            })
        }
        b'D' => {
            need(&buf, 5, "delete header")?;
            let oid = buf.get_u32();
            let _kind = buf.get_u8();
            Ok(Message::Delete {
                oid,
                old: tuple(&mut buf)?,
            })
        }
        b'T' => {
            need(&buf, 5, "truncate header")?;
            let n = buf.get_u32();
            let _opts = buf.get_u8();
            need(&buf, 4 * n as usize, "truncate relations")?;
            let oids = (0..n).map(|_| buf.get_u32()).collect();
            Ok(Message::Truncate { oids })
        }
        other => Ok(Message::Other(other)),
    }
}

/// Turns a tuple into a [`RowImage`] using the relation's column names.
/// Unchanged TOAST values are left out (only an update's after image has
/// them: see [`after_image`]).
pub fn image(rel: &Relation, values: &[Value]) -> RowImage {
    after_image(rel, None, values).0
}

/// The after image of an update, and the columns it leaves out.
///
/// An update that leaves a value stored out of line (TOAST) alone sends it
/// as "unchanged", not its value. The before image has it when one is sent
/// with a value there: REPLICA IDENTITY FULL (PostgreSQL flattens the old
/// tuple), or the old key, which PostgreSQL logs when a key column is
/// stored out of line. What neither has is returned by name, for the
/// caller to read from the source by key.
pub fn after_image(
    rel: &Relation,
    old: Option<&[Value]>,
    new: &[Value],
) -> (RowImage, Vec<String>) {
    let mut unknown = vec![];
    let image = rel
        .columns
        .iter()
        .zip(new)
        .enumerate()
        .filter_map(|(i, (c, v))| match v {
            Value::Null => Some((c.name.clone(), None)),
            Value::Text(s) => Some((c.name.clone(), Some(s.clone()))),
            Value::Unchanged => match old.and_then(|o| o.get(i)) {
                Some(Value::Text(s)) => Some((c.name.clone(), Some(s.clone()))),
                // A key-only before image sends NULL for every other column:
                // NULL there says nothing about this one.
                _ => {
                    unknown.push(c.name.clone());
                    None
                }
            },
        })
        .collect();
    (image, unknown)
}

#[cfg(test)]
pub(crate) mod tests {
    use bytes::{BufMut, BytesMut};

    use super::*;

    pub fn relation_bytes(oid: u32, schema: &str, table: &str, cols: &[(&str, bool)]) -> Bytes {
        let mut b = BytesMut::new();
        b.put_u8(b'R');
        b.put_u32(oid);
        b.put_slice(schema.as_bytes());
        b.put_u8(0);
        b.put_slice(table.as_bytes());
        b.put_u8(0);
        b.put_u8(b'd');
        b.put_i16(cols.len() as i16);
        for (name, key) in cols {
            b.put_u8(u8::from(*key));
            b.put_slice(name.as_bytes());
            b.put_u8(0);
            b.put_u32(23);
            b.put_i32(-1);
        }
        b.freeze()
    }

    fn put_tuple(b: &mut BytesMut, vals: &[Option<&str>]) {
        b.put_i16(vals.len() as i16);
        for v in vals {
            match v {
                None => b.put_u8(b'n'),
                Some(s) => {
                    b.put_u8(b't');
                    b.put_i32(s.len() as i32);
                    b.put_slice(s.as_bytes());
                }
            }
        }
    }

    #[test]
    fn decodes_relation_insert_update_delete() {
        let r = decode(&relation_bytes(
            7,
            "public",
            "address",
            &[("id", true), ("customer_id", false)],
        ))
        .unwrap();
        let Message::Relation(rel) = r else {
            panic!("{r:?}")
        };
        assert_eq!(rel.table, "address");
        assert!(rel.columns[0].is_key && !rel.columns[1].is_key);

        let mut b = BytesMut::new();
        b.put_u8(b'U');
        b.put_u32(7);
        b.put_u8(b'O');
        put_tuple(&mut b, &[Some("1"), Some("10")]);
        b.put_u8(b'N');
        put_tuple(&mut b, &[Some("1"), None]);
        let m = decode(&b.freeze()).unwrap();
        let Message::Update {
            oid,
            old: Some(old),
            new,
        } = m
        else {
            panic!("{m:?}")
        };
        assert_eq!(oid, 7);
        let (o, n) = (image(&rel, &old), image(&rel, &new));
        assert_eq!(o["customer_id"].as_deref(), Some("10"));
        assert_eq!(n["customer_id"], None);

        let mut b = BytesMut::new();
        b.put_u8(b'D');
        b.put_u32(7);
        b.put_u8(b'K');
        put_tuple(&mut b, &[Some("ü"), None]);
        assert_eq!(
            decode(&b.freeze()).unwrap(),
            Message::Delete {
                oid: 7,
                old: vec![Value::Text("ü".into()), Value::Null]
            }
        );
    }

    #[test]
    fn unchanged_toast_values_come_from_the_before_image_when_it_has_them() {
        let rel = Relation {
            oid: 1,
            schema: "public".into(),
            table: "note".into(),
            columns: ["id", "folder", "body"]
                .into_iter()
                .map(|n| RelColumn {
                    name: n.into(),
                    is_key: n == "id",
                    type_oid: 25,
                })
                .collect(),
        };
        let t = |s: &str| Value::Text(s.into());
        let new = [Value::Unchanged, Value::Unchanged, t("b2")];
        // REPLICA IDENTITY FULL: every value is in the before image.
        let (img, unknown) = after_image(&rel, Some(&[t("1"), t("f"), t("b1")]), &new);
        assert_eq!(img["id"].as_deref(), Some("1"));
        assert_eq!(img["folder"].as_deref(), Some("f"));
        assert_eq!(img["body"].as_deref(), Some("b2"));
        assert!(unknown.is_empty());
        // The old key only: NULL for the rest says nothing.
        let (img, unknown) = after_image(&rel, Some(&[t("1"), Value::Null, Value::Null]), &new);
        assert_eq!(img["id"].as_deref(), Some("1"));
        assert!(!img.contains_key("folder"));
        assert_eq!(unknown, ["folder"]);
        // No before image at all.
        let (img, unknown) = after_image(&rel, None, &new);
        assert_eq!(img.len(), 1);
        assert_eq!(unknown, ["id", "folder"]);
    }

    #[test]
    fn malformed_messages_are_errors_not_panics() {
        for bad in [
            &b""[..],
            b"I",
            b"I\0\0\0\x07N\0\x01t\0\0\0\x09ab",
            b"R\0\0\0\x01pub",
            b"Uxxxxx",
            b"T\xff\xff\xff\xff\0",
        ] {
            assert!(decode(&Bytes::copy_from_slice(bad)).is_err(), "{bad:?}");
        }
    }
}
