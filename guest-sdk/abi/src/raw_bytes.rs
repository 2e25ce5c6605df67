//! Serde glue that encodes a `Vec<u8>` as one byte string instead of a
//! sequence of `u8`s.
//!
//! With postcard the bytes on the wire are the same either way (a varint
//! length, then the bytes), but a byte string is copied with one `memcpy`
//! where a sequence is pushed byte by byte: for a 1 MiB payload, the
//! difference between microseconds and milliseconds.

use alloc::vec::Vec;
use core::fmt;
use serde::de::{Deserializer, SeqAccess, Visitor};
use serde::ser::Serializer;

/// Serializes `bytes` as a byte string.
///
/// # Errors
/// The serializer's error.
pub fn serialize<S: Serializer>(bytes: &[u8], serializer: S) -> Result<S::Ok, S::Error> {
    serializer.serialize_bytes(bytes)
}

struct BytesVisitor;

impl<'de> Visitor<'de> for BytesVisitor {
    type Value = Vec<u8>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("bytes")
    }

    fn visit_bytes<E: serde::de::Error>(self, v: &[u8]) -> Result<Vec<u8>, E> {
        Ok(v.to_vec())
    }

    fn visit_byte_buf<E: serde::de::Error>(self, v: Vec<u8>) -> Result<Vec<u8>, E> {
        Ok(v)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<u8>, A::Error> {
        let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1 << 20));
        while let Some(b) = seq.next_element()? {
            out.push(b);
        }
        Ok(out)
    }
}

/// Deserializes a byte string (or a sequence of `u8`s).
///
/// # Errors
/// The deserializer's error for anything else.
pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Vec<u8>, D::Error> {
    deserializer.deserialize_byte_buf(BytesVisitor)
}

#[cfg(test)]
mod tests {
    use alloc::vec;
    use alloc::vec::Vec;
    use serde::{Deserialize, Serialize};

    #[derive(Serialize, Deserialize, PartialEq, Debug)]
    struct Fast(#[serde(with = "super")] Vec<u8>);
    #[derive(Serialize, Deserialize, PartialEq, Debug)]
    struct Plain(Vec<u8>);

    #[test]
    fn the_wire_form_is_the_same_as_a_sequence() {
        for data in [vec![], vec![0u8, 1, 255], vec![7u8; 300]] {
            let fast = crate::encode(&Fast(data.clone())).unwrap();
            let plain = crate::encode(&Plain(data.clone())).unwrap();
            assert_eq!(fast, plain);
            assert_eq!(crate::decode::<Fast>(&plain).unwrap(), Fast(data.clone()));
            assert_eq!(crate::decode::<Plain>(&fast).unwrap(), Plain(data));
        }
    }
}
