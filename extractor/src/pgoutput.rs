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
            "truncated while reading {what} ({n} bytes needed, {} left)",
            buf.remaining()
        )));
    }
    Ok(())
}

/// A count field, refused when negative or when the rest of the message
/// cannot hold that many items of at least `min_item` bytes, so that a
/// corrupt count never sizes an allocation.
fn count(buf: &mut Bytes, what: &str, min_item: usize) -> Result<usize> {
    need(buf, 2, what)?;
    let n = buf.get_i16();
    let n = usize::try_from(n).map_err(|_| Error::Decode(format!("negative {what} {n}")))?;
    if n.saturating_mul(min_item) > buf.remaining() {
        return Err(Error::Decode(format!(
            "{what} {n} does not fit in the {} bytes left",
            buf.remaining()
        )));
    }
    Ok(n)
}

fn cstr(buf: &mut Bytes, what: &str) -> Result<String> {
    let end = buf
        .iter()
        .position(|b| *b == 0)
        .ok_or_else(|| Error::Decode(format!("unterminated string in {what}")))?;
    let s = String::from_utf8(buf.split_to(end).to_vec())
        .map_err(|_| Error::Decode(format!("{what} is not UTF-8")))?;
    buf.advance(1);
    Ok(s)
}

fn tuple(buf: &mut Bytes) -> Result<Vec<Value>> {
    // Every value takes at least its kind byte.
    let n = count(buf, "tuple column count", 1)?;
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        need(buf, 1, "tuple value kind")?;
        match buf.get_u8() {
            b'n' => out.push(Value::Null),
            b'u' => out.push(Value::Unchanged),
            b't' | b'b' => {
                need(buf, 4, "value length")?;
                let len = buf.get_i32();
                let len = usize::try_from(len)
                    .map_err(|_| Error::Decode(format!("column {i}: negative value length")))?;
                need(buf, len, "value")?;
                let raw = buf.split_to(len);
                let s = String::from_utf8(raw.to_vec())
                    .map_err(|_| Error::Decode(format!("column {i}: text value is not UTF-8")))?;
                out.push(Value::Text(s));
            }
            other => {
                return Err(Error::Decode(format!(
                    "column {i}: unknown tuple value kind {:?}",
                    other as char
                )))
            }
        }
    }
    Ok(out)
}

/// Decodes one pgoutput message. An error names the message kind and the
/// byte offset where decoding stopped.
pub fn decode(data: &Bytes) -> Result<Message> {
    let mut buf = data.clone();
    need(&buf, 1, "message tag").map_err(|e| context(e, "pgoutput", 0))?;
    let tag = buf.get_u8();
    let kind = match tag {
        b'R' => "Relation",
        b'I' => "Insert",
        b'U' => "Update",
        b'D' => "Delete",
        b'T' => "Truncate",
        _ => "pgoutput",
    };
    decode_body(tag, &mut buf).map_err(|e| context(e, kind, data.len() - buf.remaining()))
}

fn context(e: Error, kind: &str, offset: usize) -> Error {
    match e {
        Error::Decode(m) => Error::Decode(format!("pgoutput {kind} message, byte {offset}: {m}")),
        other => other,
    }
}

fn decode_body(tag: u8, buf: &mut Bytes) -> Result<Message> {
    match tag {
        b'R' => {
            need(buf, 4, "relation id")?;
            let oid = buf.get_u32();
            let schema = cstr(buf, "relation namespace")?;
            let table = cstr(buf, "relation name")?;
            need(buf, 1, "replica identity")?;
            let _identity = buf.get_u8();
            // A column is at least flags, an empty name and type oid + typmod.
            let n = count(buf, "relation column count", 10)?;
            let mut columns = Vec::with_capacity(n);
            for _ in 0..n {
                need(buf, 1, "column flags")?;
                let flags = buf.get_u8();
                let name = cstr(buf, "column name")?;
                need(buf, 8, "column type")?;
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
            need(buf, 5, "insert header")?;
            let oid = buf.get_u32();
            let _n = buf.get_u8();
            Ok(Message::Insert {
                oid,
                new: tuple(buf)?,
            })
        }
        b'U' => {
            need(buf, 5, "update header")?;
            let oid = buf.get_u32();
            let mut kind = buf.get_u8();
            let mut old = None;
            if kind == b'K' || kind == b'O' {
                old = Some(tuple(buf)?);
                need(buf, 1, "update new tuple")?;
                kind = buf.get_u8();
            }
            if kind != b'N' {
                return Err(Error::Decode(format!(
                    "update without new tuple (got {:?})",
                    kind as char
                )));
            }
            Ok(Message::Update {
                oid,
                old,
                new: tuple(buf)?,
            })
        }
        b'D' => {
            need(buf, 5, "delete header")?;
            let oid = buf.get_u32();
            let _kind = buf.get_u8();
            Ok(Message::Delete {
                oid,
                old: tuple(buf)?,
            })
        }
        b'T' => {
            need(buf, 5, "truncate header")?;
            let n = buf.get_u32() as usize;
            let _opts = buf.get_u8();
            need(buf, n.saturating_mul(4), "truncate relations")?;
            let oids = (0..n).map(|_| buf.get_u32()).collect();
            Ok(Message::Truncate { oids })
        }
        other => Ok(Message::Other(other)),
    }
}

/// Turns a tuple into a [`RowImage`] using the relation's column names.
/// Unchanged TOAST values are left out (only an update's after image has
/// them: see [`after_image`]).
pub fn image(rel: &Relation, values: Vec<Value>) -> RowImage {
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
///
/// The values of `new` move into the image: this runs for every row change.
pub fn after_image(
    rel: &Relation,
    old: Option<&[Value]>,
    new: Vec<Value>,
) -> (RowImage, Vec<String>) {
    let mut unknown = vec![];
    // Sized by the relation: a tuple longer than it (from the wire) is cut
    // to its columns by the zip below.
    let cap = new.len().min(rel.columns.len());
    let mut image = RowImage::with_capacity_and_hasher(cap, Default::default());
    for (i, (c, v)) in rel.columns.iter().zip(new).enumerate() {
        let value = match v {
            Value::Null => None,
            Value::Text(s) => Some(s),
            Value::Unchanged => match old.and_then(|o| o.get(i)) {
                Some(Value::Text(s)) => Some(s.clone()),
                // A key-only before image sends NULL for every other column:
                // NULL there says nothing about this one.
                _ => {
                    unknown.push(c.name.clone());
                    continue;
                }
            },
        };
        image.insert(c.name.clone(), value);
    }
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
        let (o, n) = (image(&rel, old.clone()), image(&rel, new.clone()));
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
        let (img, unknown) = after_image(&rel, Some(&[t("1"), t("f"), t("b1")]), new.to_vec());
        assert_eq!(img["id"].as_deref(), Some("1"));
        assert_eq!(img["folder"].as_deref(), Some("f"));
        assert_eq!(img["body"].as_deref(), Some("b2"));
        assert!(unknown.is_empty());
        // The old key only: NULL for the rest says nothing.
        let (img, unknown) = after_image(
            &rel,
            Some(&[t("1"), Value::Null, Value::Null]),
            new.to_vec(),
        );
        assert_eq!(img["id"].as_deref(), Some("1"));
        assert!(!img.contains_key("folder"));
        assert_eq!(unknown, ["folder"]);
        // No before image at all.
        let (img, unknown) = after_image(&rel, None, new.to_vec());
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

    /// Fuzz properties (see [`skein_common::fuzz`]): no bytes make the
    /// decoder or the image building panic, hang or allocate out of
    /// proportion; what the encoder below writes decodes to itself.
    mod fuzz {
        use proptest::prelude::*;
        use skein_common::fuzz::{arbitrary_bytes, check, config, mutated};

        use super::*;

        /// pgoutput as PostgreSQL writes it (the subset skein decodes).
        pub fn encode(m: &Message) -> Bytes {
            let mut b = BytesMut::new();
            let tuple = |b: &mut BytesMut, vals: &[Value]| {
                b.put_i16(vals.len() as i16);
                for v in vals {
                    match v {
                        Value::Null => b.put_u8(b'n'),
                        Value::Unchanged => b.put_u8(b'u'),
                        Value::Text(s) => {
                            b.put_u8(b't');
                            b.put_i32(s.len() as i32);
                            b.put_slice(s.as_bytes());
                        }
                    }
                }
            };
            match m {
                Message::Relation(r) => {
                    let cols: Vec<_> = r
                        .columns
                        .iter()
                        .map(|c| (c.name.as_str(), c.is_key))
                        .collect();
                    return relation_bytes(r.oid, &r.schema, &r.table, &cols);
                }
                Message::Insert { oid, new } => {
                    b.put_u8(b'I');
                    b.put_u32(*oid);
                    b.put_u8(b'N');
                    tuple(&mut b, new);
                }
                Message::Update { oid, old, new } => {
                    b.put_u8(b'U');
                    b.put_u32(*oid);
                    if let Some(old) = old {
                        b.put_u8(b'O');
                        tuple(&mut b, old);
                    }
                    b.put_u8(b'N');
                    tuple(&mut b, new);
                }
                Message::Delete { oid, old } => {
                    b.put_u8(b'D');
                    b.put_u32(*oid);
                    b.put_u8(b'K');
                    tuple(&mut b, old);
                }
                Message::Truncate { oids } => {
                    b.put_u8(b'T');
                    b.put_u32(oids.len() as u32);
                    b.put_u8(0);
                    for o in oids {
                        b.put_u32(*o);
                    }
                }
                Message::Other(t) => b.put_u8(*t),
            }
            b.freeze()
        }

        fn name() -> impl Strategy<Value = String> {
            "[a-zü_]{0,8}"
        }

        fn values() -> impl Strategy<Value = Vec<Value>> {
            prop::collection::vec(
                prop_oneof![
                    Just(Value::Null),
                    Just(Value::Unchanged),
                    "[ -~ü✓]{0,12}".prop_map(Value::Text),
                ],
                0..6,
            )
        }

        fn message() -> impl Strategy<Value = Message> {
            prop_oneof![
                (
                    any::<u32>(),
                    name(),
                    name(),
                    prop::collection::vec((name(), any::<bool>()), 0..6)
                )
                    .prop_map(|(oid, schema, table, cols)| {
                        Message::Relation(Relation {
                            oid,
                            schema,
                            table,
                            columns: cols
                                .into_iter()
                                .map(|(name, is_key)| RelColumn {
                                    name,
                                    is_key,
                                    // What `relation_bytes` writes.
                                    type_oid: 23,
                                })
                                .collect(),
                        })
                    }),
                (any::<u32>(), values()).prop_map(|(oid, new)| Message::Insert { oid, new }),
                (any::<u32>(), prop::option::of(values()), values())
                    .prop_map(|(oid, old, new)| Message::Update { oid, old, new }),
                (any::<u32>(), values()).prop_map(|(oid, old)| Message::Delete { oid, old }),
                prop::collection::vec(any::<u32>(), 0..5)
                    .prop_map(|oids| Message::Truncate { oids }),
                prop::sample::select(&b"BCOYM"[..]).prop_map(Message::Other),
            ]
        }

        const TOKENS: &[&[u8]] = &[
            b"R", b"I", b"U", b"D", b"T", b"N", b"K", b"O", b"n", b"u", b"t", b"b", b"\0",
        ];

        /// Decodes, and builds images the way the extractor does for every
        /// relation in the same input.
        fn run(bytes: &[u8]) {
            check("pgoutput", bytes.len(), || {
                let m = decode(&Bytes::copy_from_slice(bytes));
                let rel = Relation {
                    oid: 1,
                    schema: "s".into(),
                    table: "t".into(),
                    columns: ["a", "b", "c"]
                        .map(|n| RelColumn {
                            name: n.into(),
                            is_key: n == "a",
                            type_oid: 25,
                        })
                        .into(),
                };
                match m {
                    Ok(Message::Insert { new, .. }) => drop(image(&rel, new)),
                    Ok(Message::Update { old, new, .. }) => {
                        drop(after_image(&rel, old.as_deref(), new))
                    }
                    Ok(Message::Delete { old, .. }) => drop(image(&rel, old)),
                    Ok(Message::Relation(r)) => drop(image(&r, vec![Value::Null; 4])),
                    _ => {}
                }
            });
        }

        proptest! {
            #![proptest_config(config())]

            #[test]
            fn arbitrary_bytes_are_ok_or_an_error(b in arbitrary_bytes(64)) {
                run(&b);
            }

            #[test]
            fn mutated_messages_are_ok_or_an_error(
                b in mutated(message().prop_map(|m| encode(&m).to_vec()), TOKENS)
            ) {
                run(&b);
            }

            #[test]
            fn messages_round_trip(m in message()) {
                prop_assert_eq!(decode(&encode(&m)).unwrap(), m);
            }
        }

        /// Regression: a column count of 32,767 with nothing after it used
        /// to reserve room for 32,767 columns (~1 MiB) before reading one.
        #[test]
        fn a_huge_column_count_is_refused_before_allocating() {
            for bad in [&b"I\0\0\0\x07N\x7f\xff"[..], b"R\0\0\0\x01s\0t\0d\x7f\xffx"] {
                let e = check("pgoutput", bad.len(), || {
                    decode(&Bytes::copy_from_slice(bad)).unwrap_err()
                });
                assert!(e.to_string().contains("does not fit"), "{e}");
            }
        }

        /// Regression: a negative column count read as an empty tuple.
        #[test]
        fn a_negative_column_count_is_an_error() {
            let e = decode(&Bytes::from_static(b"D\0\0\0\x07K\xff\xff")).unwrap_err();
            assert!(e.to_string().contains("negative tuple column count"), "{e}");
        }

        #[test]
        fn errors_name_the_message_and_the_offset() {
            let e = decode(&Bytes::from_static(b"I\0\0\0\x07N\0\x01t\0\0\0\x09ab")).unwrap_err();
            let e = e.to_string();
            assert!(e.contains("Insert message, byte 13"), "{e}");
            assert!(e.contains("value"), "{e}");
        }
    }
}
