//! [`Value`], the dynamically typed value of every call's arguments and result.

use alloc::string::String;
use alloc::vec::Vec;
use serde::{Deserialize, Serialize};

pub use de::MAX_VALUE_DEPTH;

/// A worker's identity: its rank (`id`) and its unique name.
///
/// Ordered and hashed by `(id, name)`, as PyTorch's `WorkerInfo` compares.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct WorkerInfo {
    /// The worker's rank in the group.
    pub id: u32,
    /// The worker's name, unique in the group.
    pub name: String,
}

/// Everything a call can take or return.
///
/// Mirrors the Python values the seed tests pass: `None`, scalars, strings,
/// bytes, containers, named records, worker infos, tensors and RRefs.
/// Tensors and RRefs are out of line: the variants hold an index into a table
/// that travels beside the value (see the crate docs).
///
/// Decoding is limited to [`MAX_VALUE_DEPTH`] levels of nesting (see
/// [`de`]); encoding is serde's derived form.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub enum Value {
    /// Python's `None`.
    None,
    /// A boolean.
    Bool(bool),
    /// A 64-bit signed integer.
    Int(i64),
    /// A 64-bit float.
    Float(f64),
    /// A UTF-8 string.
    Str(String),
    /// Raw bytes.
    Bytes(#[serde(with = "crate::raw_bytes")] Vec<u8>),
    /// A list.
    List(Vec<Value>),
    /// A tuple.
    Tuple(Vec<Value>),
    /// A dict, in insertion order; keys may be any value.
    Dict(Vec<(Value, Value)>),
    /// A named record (a Python dataclass or named tuple): its type name and
    /// its fields in order.
    Record {
        /// The record's type name.
        name: String,
        /// Field names and values, in declaration order.
        fields: Vec<(String, Value)>,
    },
    /// A worker's identity.
    WorkerInfo(WorkerInfo),
    /// A tensor: an index into the side table of tensors.
    Tensor(u32),
    /// An RRef: an index into the side table of RRefs.
    RRef(u32),
}

impl Value {
    /// The Python type name of this value, for error messages.
    pub fn type_name(&self) -> &'static str {
        match self {
            Value::None => "NoneType",
            Value::Bool(_) => "bool",
            Value::Int(_) => "int",
            Value::Float(_) => "float",
            Value::Str(_) => "str",
            Value::Bytes(_) => "bytes",
            Value::List(_) => "list",
            Value::Tuple(_) => "tuple",
            Value::Dict(_) => "dict",
            Value::Record { .. } => "record",
            Value::WorkerInfo(_) => "WorkerInfo",
            Value::Tensor(_) => "Tensor",
            Value::RRef(_) => "RRef",
        }
    }
}

impl From<i64> for Value {
    fn from(v: i64) -> Self {
        Value::Int(v)
    }
}
impl From<bool> for Value {
    fn from(v: bool) -> Self {
        Value::Bool(v)
    }
}
impl From<f64> for Value {
    fn from(v: f64) -> Self {
        Value::Float(v)
    }
}
impl From<&str> for Value {
    fn from(v: &str) -> Self {
        Value::Str(v.into())
    }
}
impl From<String> for Value {
    fn from(v: String) -> Self {
        Value::Str(v)
    }
}

/// The decoding of [`Value`]: the same wire form as serde's derive, with a
/// limit on nesting.
///
/// postcard has no recursion limit and a derived decoder recurses once per
/// level, so without one a few KiB of nested `List` tags from a peer (or a
/// guest) overflow the decoding thread's stack and abort the process. The
/// decoder carries its depth down (a [`DeserializeSeed`]) and refuses a
/// value nested deeper than [`MAX_VALUE_DEPTH`].
mod de {
    use super::{Value, WorkerInfo};
    use alloc::string::String;
    use alloc::vec::Vec;
    use core::fmt;
    use serde::de::{
        self, Deserialize, DeserializeSeed, Deserializer, EnumAccess, Error as _, MapAccess,
        SeqAccess, VariantAccess, Visitor,
    };

    /// The deepest nesting of lists, tuples, dicts and records a decoded
    /// [`Value`] may have; deeper is a decoding error.
    pub const MAX_VALUE_DEPTH: usize = 128;

    /// Preallocate at most this many elements, whatever a length prefix
    /// announces: the elements must still arrive before memory grows.
    const CAUTIOUS: usize = 1024;

    const VARIANTS: &[&str] = &[
        "None",
        "Bool",
        "Int",
        "Float",
        "Str",
        "Bytes",
        "List",
        "Tuple",
        "Dict",
        "Record",
        "WorkerInfo",
        "Tensor",
        "RRef",
    ];

    impl<'de> Deserialize<'de> for Value {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            ValueSeed(0).deserialize(d)
        }
    }

    /// A value `.0` levels below the top.
    #[derive(Clone, Copy)]
    struct ValueSeed(usize);

    impl<'de> DeserializeSeed<'de> for ValueSeed {
        type Value = Value;
        fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
            d.deserialize_enum("Value", VARIANTS, self)
        }
    }

    /// A variant's index, by number (postcard) or by name.
    struct Variant(usize);

    impl<'de> Deserialize<'de> for Variant {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            struct V;
            impl Visitor<'_> for V {
                type Value = Variant;
                fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                    f.write_str("a Value variant")
                }
                fn visit_u64<E: de::Error>(self, v: u64) -> Result<Variant, E> {
                    usize::try_from(v)
                        .ok()
                        .filter(|&i| i < VARIANTS.len())
                        .map(Variant)
                        .ok_or_else(|| E::invalid_value(de::Unexpected::Unsigned(v), &self))
                }
                fn visit_str<E: de::Error>(self, v: &str) -> Result<Variant, E> {
                    VARIANTS
                        .iter()
                        .position(|n| *n == v)
                        .map(Variant)
                        .ok_or_else(|| E::unknown_variant(v, VARIANTS))
                }
                fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<Variant, E> {
                    VARIANTS
                        .iter()
                        .position(|n| n.as_bytes() == v)
                        .map(Variant)
                        .ok_or_else(|| E::invalid_value(de::Unexpected::Bytes(v), &self))
                }
            }
            d.deserialize_identifier(V)
        }
    }

    impl<'de> Visitor<'de> for ValueSeed {
        type Value = Value;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a Value")
        }
        fn visit_enum<A: EnumAccess<'de>>(self, data: A) -> Result<Value, A::Error> {
            let (Variant(i), v) = data.variant::<Variant>()?;
            // The children of a container are one level deeper.
            let inner = self.0 + 1;
            let deeper = || {
                if inner > MAX_VALUE_DEPTH {
                    Err(A::Error::custom(format_args!(
                        "value nested deeper than {MAX_VALUE_DEPTH} levels"
                    )))
                } else {
                    Ok(ValueSeed(inner))
                }
            };
            Ok(match i {
                0 => {
                    v.unit_variant()?;
                    Value::None
                }
                1 => Value::Bool(v.newtype_variant()?),
                2 => Value::Int(v.newtype_variant()?),
                3 => Value::Float(v.newtype_variant()?),
                4 => Value::Str(v.newtype_variant()?),
                5 => Value::Bytes(v.newtype_variant_seed(BytesSeed)?),
                6 => Value::List(v.newtype_variant_seed(Values(deeper()?))?),
                7 => Value::Tuple(v.newtype_variant_seed(Values(deeper()?))?),
                8 => Value::Dict(v.newtype_variant_seed(Pairs(deeper()?))?),
                9 => v.struct_variant(&["name", "fields"], RecordVisitor(deeper()?))?,
                10 => Value::WorkerInfo(v.newtype_variant::<WorkerInfo>()?),
                11 => Value::Tensor(v.newtype_variant()?),
                _ => Value::RRef(v.newtype_variant()?),
            })
        }
    }

    /// `Value::Bytes`'s payload, as `crate::raw_bytes` reads it.
    struct BytesSeed;

    impl<'de> DeserializeSeed<'de> for BytesSeed {
        type Value = Vec<u8>;
        fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Vec<u8>, D::Error> {
            crate::raw_bytes::deserialize(d)
        }
    }

    /// A sequence of values, each read with the seed `.0`.
    struct Values(ValueSeed);

    impl<'de> DeserializeSeed<'de> for Values {
        type Value = Vec<Value>;
        fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Vec<Value>, D::Error> {
            d.deserialize_seq(self)
        }
    }

    impl<'de> Visitor<'de> for Values {
        type Value = Vec<Value>;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a sequence of values")
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<Value>, A::Error> {
            let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(CAUTIOUS));
            while let Some(v) = seq.next_element_seed(self.0)? {
                out.push(v);
            }
            Ok(out)
        }
    }

    /// A dict's `(key, value)` pairs.
    struct Pairs(ValueSeed);

    impl<'de> DeserializeSeed<'de> for Pairs {
        type Value = Vec<(Value, Value)>;
        fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
            d.deserialize_seq(self)
        }
    }

    impl<'de> Visitor<'de> for Pairs {
        type Value = Vec<(Value, Value)>;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a sequence of (key, value) pairs")
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
            let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(CAUTIOUS));
            while let Some(pair) = seq.next_element_seed(Pair(self.0))? {
                out.push(pair);
            }
            Ok(out)
        }
    }

    /// One `(key, value)` pair.
    struct Pair(ValueSeed);

    impl<'de> DeserializeSeed<'de> for Pair {
        type Value = (Value, Value);
        fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
            d.deserialize_tuple(2, self)
        }
    }

    impl<'de> Visitor<'de> for Pair {
        type Value = (Value, Value);
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a (key, value) pair")
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
            let k = seq
                .next_element_seed(self.0)?
                .ok_or_else(|| A::Error::invalid_length(0, &self))?;
            let v = seq
                .next_element_seed(self.0)?
                .ok_or_else(|| A::Error::invalid_length(1, &self))?;
            Ok((k, v))
        }
    }

    /// A record's `(field name, value)` pairs.
    struct Fields(ValueSeed);

    impl<'de> DeserializeSeed<'de> for Fields {
        type Value = Vec<(String, Value)>;
        fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
            d.deserialize_seq(self)
        }
    }

    impl<'de> Visitor<'de> for Fields {
        type Value = Vec<(String, Value)>;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a sequence of (name, value) fields")
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
            let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(CAUTIOUS));
            while let Some(field) = seq.next_element_seed(Field(self.0))? {
                out.push(field);
            }
            Ok(out)
        }
    }

    /// One `(field name, value)` pair.
    struct Field(ValueSeed);

    impl<'de> DeserializeSeed<'de> for Field {
        type Value = (String, Value);
        fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
            d.deserialize_tuple(2, self)
        }
    }

    impl<'de> Visitor<'de> for Field {
        type Value = (String, Value);
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a (name, value) field")
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
            let k = seq
                .next_element()?
                .ok_or_else(|| A::Error::invalid_length(0, &self))?;
            let v = seq
                .next_element_seed(self.0)?
                .ok_or_else(|| A::Error::invalid_length(1, &self))?;
            Ok((k, v))
        }
    }

    /// `Value::Record { name, fields }`, as a sequence (postcard) or a map.
    struct RecordVisitor(ValueSeed);

    impl<'de> Visitor<'de> for RecordVisitor {
        type Value = Value;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a record")
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
            let name = seq
                .next_element()?
                .ok_or_else(|| A::Error::invalid_length(0, &self))?;
            let fields = seq
                .next_element_seed(Fields(self.0))?
                .ok_or_else(|| A::Error::invalid_length(1, &self))?;
            Ok(Value::Record { name, fields })
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
            let (mut name, mut fields) = (None, None);
            while let Some(key) = map.next_key::<String>()? {
                match key.as_str() {
                    "name" if name.is_none() => name = Some(map.next_value()?),
                    "fields" if fields.is_none() => {
                        fields = Some(map.next_value_seed(Fields(self.0))?);
                    }
                    "name" | "fields" => return Err(A::Error::custom("duplicate record field")),
                    _ => return Err(A::Error::unknown_field(&key, &["name", "fields"])),
                }
            }
            Ok(Value::Record {
                name: name.ok_or_else(|| A::Error::missing_field("name"))?,
                fields: fields.ok_or_else(|| A::Error::missing_field("fields"))?,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloc::vec;

    #[test]
    fn round_trips_nested_values() {
        let v = Value::Dict(vec![(
            Value::Str("k".into()),
            Value::List(vec![
                Value::Int(-3),
                Value::Float(1.5),
                Value::Tensor(2),
                Value::None,
            ]),
        )]);
        let bytes = crate::encode(&v).unwrap();
        assert_eq!(crate::decode::<Value>(&bytes).unwrap(), v);
    }

    #[test]
    fn truncated_bytes_are_an_error_not_a_panic() {
        let bytes = crate::encode(&Value::Str("hello".into())).unwrap();
        for cut in 0..bytes.len() {
            assert!(crate::decode::<Value>(&bytes[..cut]).is_err());
        }
    }
}
