//! safetensors: an 8-byte little-endian header length, a JSON header
//! mapping names to `{dtype, shape, data_offsets}` (and an optional
//! `__metadata__` string map), then the data.
//!
//! The `safetensors` crate parses the file and serializes it. Its 0.3
//! reader is not trusted alone: it adds the last data offset to the header
//! length unchecked (an overflow panic with overflow checks on, for a
//! crafted offset near `usize::MAX`). So the header is first checked here,
//! as plain JSON: header length within the file, every range within the
//! data section, contiguous and covering it, every length equal to
//! `numel * size`. Only then is it handed to the crate, and what the crate
//! parsed must agree with what was checked.

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet, HashMap};

use safetensors::SafeTensors;
use safetensors::tensor::{Dtype, View};
use serde_json::Value;

use crate::error::SAFETENSORS_DTYPES;
use crate::{DType, FileError, Format, Metadata, TensorBytes, Tensors};

/// The JSON key of the free-form string map.
const METADATA_KEY: &str = "__metadata__";

fn malformed(file: &str, reason: impl Into<String>) -> FileError {
    FileError::Malformed {
        file: file.to_owned(),
        format: Format::SafeTensors,
        reason: reason.into(),
    }
}

/// The longest header read: the `safetensors` crate's own limit. The
/// header is parsed twice (here and by the crate) into maps several times
/// its size, so it is bounded before either parse.
const MAX_HEADER_LEN: u64 = 100_000_000;

/// Maps a header's dtype string; `None` for those this crate does not read.
fn dtype_from_name(name: &str) -> Option<DType> {
    Some(match name {
        "F32" => DType::Float32,
        "F64" => DType::Float64,
        "F16" => DType::Float16,
        "BF16" => DType::BFloat16,
        "I64" => DType::Int64,
        "I32" => DType::Int32,
        "I16" => DType::Int16,
        "I8" => DType::Int8,
        "U8" => DType::UInt8,
        "BOOL" => DType::Bool,
        _ => return None,
    })
}

fn dtype_to_crate(dtype: DType) -> Dtype {
    match dtype {
        DType::Float32 => Dtype::F32,
        DType::Float64 => Dtype::F64,
        DType::Float16 => Dtype::F16,
        DType::BFloat16 => Dtype::BF16,
        DType::Int64 => Dtype::I64,
        DType::Int32 => Dtype::I32,
        DType::Int16 => Dtype::I16,
        DType::Int8 => Dtype::I8,
        DType::UInt8 => Dtype::U8,
        DType::Bool => Dtype::BOOL,
    }
}

/// One tensor's entry in the header, as checked here.
struct Entry {
    name: String,
    dtype: DType,
    shape: Vec<u64>,
    start: usize,
    end: usize,
}

/// Reads a whole safetensors file.
pub(crate) fn read(file: &str, bytes: &[u8], limit: u64) -> Result<(Tensors, Metadata), FileError> {
    let Some((length, rest)) = bytes.split_first_chunk::<8>() else {
        return Err(malformed(
            file,
            format!(
                "it is {} bytes long, too short for the 8-byte header length",
                bytes.len()
            ),
        ));
    };
    let header_len = u64::from_le_bytes(*length);
    if header_len > rest.len() as u64 {
        return Err(malformed(
            file,
            format!(
                "its header length says {header_len} bytes but only {} bytes follow",
                rest.len()
            ),
        ));
    }
    if header_len > MAX_HEADER_LEN {
        return Err(malformed(
            file,
            format!("its header length {header_len} is over the {MAX_HEADER_LEN} bytes allowed"),
        ));
    }
    let (header, data) = rest.split_at(header_len as usize);
    let entries = check_header(file, header, data.len())?;

    // The checks above hold, so the crate's arithmetic cannot overflow.
    let parsed = SafeTensors::read_metadata(bytes)
        .map_err(|error| malformed(file, format!("the safetensors parser refused it ({error})")))?
        .1;
    let infos = parsed.tensors();
    let agrees = infos.len() == entries.len()
        && entries.iter().all(|entry| {
            infos.get(&entry.name).is_some_and(|info| {
                info.dtype == dtype_to_crate(entry.dtype)
                    && info
                        .shape
                        .iter()
                        .map(|&dim| dim as u64)
                        .eq(entry.shape.iter().copied())
                    && info.data_offsets == (entry.start, entry.end)
            })
        });
    if !agrees {
        return Err(malformed(
            file,
            "its header reads differently to the safetensors parser and to wasmrpc's checks \
             (a repeated name?)",
        ));
    }
    let metadata: Metadata = parsed
        .metadata()
        .as_ref()
        .map(|map| map.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
        .unwrap_or_default();

    // The ranges tile the data section, so its length is the total.
    if data.len() as u64 > limit {
        return Err(FileError::LimitExceeded {
            file: file.to_owned(),
            limit,
        });
    }
    let mut tensors = Vec::with_capacity(entries.len());
    for entry in entries {
        let bytes = data.get(entry.start..entry.end).ok_or_else(|| {
            malformed(
                file,
                format!("tensor \"{}\" lies outside the data", entry.name),
            )
        })?;
        crate::check_bools(entry.dtype, bytes)
            .map_err(|reason| malformed(file, format!("in tensor \"{}\", {reason}", entry.name)))?;
        let tensor = TensorBytes {
            dtype: entry.dtype,
            shape: crate::shape_i64(&entry.shape),
            data: bytes.to_vec(),
        };
        tensors.push((entry.name, tensor));
    }
    Ok((tensors, metadata))
}

/// Checks the header as JSON and returns its tensors in data order.
fn check_header(file: &str, header: &[u8], data_len: usize) -> Result<Vec<Entry>, FileError> {
    let text = std::str::from_utf8(header).map_err(|error| {
        malformed(
            file,
            format!(
                "its header is not UTF-8 text (bad byte at offset {})",
                8 + error.valid_up_to()
            ),
        )
    })?;
    // serde_json bounds nesting (128 levels), so this cannot overflow the
    // stack.
    let value: Value = serde_json::from_str(text)
        .map_err(|error| malformed(file, format!("its header is not JSON ({error})")))?;
    let Value::Object(map) = value else {
        return Err(malformed(file, "its header is not a JSON object"));
    };
    let mut entries = Vec::with_capacity(map.len());
    for (name, info) in &map {
        if name == METADATA_KEY {
            let valid = info
                .as_object()
                .is_some_and(|metadata| metadata.values().all(Value::is_string));
            if !valid {
                return Err(malformed(
                    file,
                    "its __metadata__ is not a map of strings to strings",
                ));
            }
            continue;
        }
        entries.push(check_entry(file, name, info, data_len)?);
    }
    // The file's order is the order of the data; zero-length tensors may
    // share an offset, so the name breaks ties.
    entries.sort_by(|a, b| (a.start, a.end, &a.name).cmp(&(b.start, b.end, &b.name)));
    let mut next = 0;
    for entry in &entries {
        if entry.start != next {
            let problem = if entry.start < next {
                "overlaps the tensor before it"
            } else {
                "leaves a gap before it"
            };
            return Err(malformed(
                file,
                format!(
                    "tensor \"{}\" starts at data offset {}, which {problem} (the data before it ends at {next})",
                    entry.name, entry.start
                ),
            ));
        }
        next = entry.end;
    }
    if next != data_len {
        return Err(malformed(
            file,
            format!(
                "its tensors cover {next} bytes of data but the data section is {data_len} bytes"
            ),
        ));
    }
    Ok(entries)
}

/// Checks one tensor's header entry against the data section's length.
fn check_entry(file: &str, name: &str, info: &Value, data_len: usize) -> Result<Entry, FileError> {
    let bad = |what: &str| malformed(file, format!("tensor \"{name}\" {what}"));
    let dtype_text = info
        .get("dtype")
        .and_then(Value::as_str)
        .ok_or_else(|| bad("has no dtype string"))?;
    let dtype = dtype_from_name(dtype_text).ok_or_else(|| FileError::Unsupported {
        file: file.to_owned(),
        what: format!("the dtype {dtype_text} for tensor \"{name}\""),
        supported: SAFETENSORS_DTYPES,
    })?;
    let shape = info
        .get("shape")
        .and_then(Value::as_array)
        .ok_or_else(|| bad("has no shape list"))?
        .iter()
        .map(|dim| {
            dim.as_u64()
                .ok_or_else(|| bad(&format!("has the dimension {dim}, which is not a size")))
        })
        .collect::<Result<Vec<u64>, _>>()?;
    let offsets = info
        .get("data_offsets")
        .and_then(Value::as_array)
        .ok_or_else(|| bad("has no data_offsets list"))?;
    let [start, end] = offsets.as_slice() else {
        return Err(bad("has data_offsets that are not two numbers"));
    };
    let (Some(start), Some(end)) = (start.as_u64(), end.as_u64()) else {
        return Err(bad("has data_offsets that are not two sizes"));
    };
    if start > end || end > data_len as u64 {
        return Err(bad(&format!(
            "has data_offsets [{start}, {end}], outside the {data_len} bytes of data"
        )));
    }
    let expected =
        crate::data_len(dtype, &shape).map_err(|reason| bad(&format!("is refused: {reason}")))?;
    if end - start != expected as u64 {
        return Err(bad(&format!(
            "has {} bytes of data at [{start}, {end}], but its shape {shape:?} of {} needs {expected}",
            end - start,
            dtype_text,
        )));
    }
    // Both fit in usize: they are at most `data_len`.
    Ok(Entry {
        name: name.to_owned(),
        dtype,
        shape,
        start: start as usize,
        end: end as usize,
    })
}

/// A tensor handed to the crate's serializer.
struct Tensor<'a> {
    dtype: Dtype,
    shape: Vec<usize>,
    data: &'a [u8],
}

impl View for &Tensor<'_> {
    fn dtype(&self) -> Dtype {
        self.dtype
    }

    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(self.data)
    }

    fn data_len(&self) -> usize {
        self.data.len()
    }
}

/// Writes a safetensors file, after checking every tensor.
pub(crate) fn write(
    file: &str,
    tensors: &[(String, TensorBytes)],
    metadata: &BTreeMap<String, String>,
) -> Result<Vec<u8>, FileError> {
    let invalid = |reason: String| FileError::InvalidTensor {
        file: file.to_owned(),
        reason,
    };
    let mut names = BTreeSet::new();
    let mut views = Vec::with_capacity(tensors.len());
    for (name, tensor) in tensors {
        if name.is_empty() {
            return Err(invalid("a tensor has an empty name".into()));
        }
        if name == METADATA_KEY {
            return Err(invalid(format!(
                "a tensor is named \"{METADATA_KEY}\", which safetensors keeps for metadata"
            )));
        }
        if !names.insert(name.as_str()) {
            return Err(invalid(format!("two tensors are named \"{name}\"")));
        }
        let shape = tensor
            .shape
            .iter()
            .map(|&dim| u64::try_from(dim))
            .collect::<Result<Vec<u64>, _>>()
            .map_err(|_| {
                invalid(format!(
                    "tensor \"{name}\" has the shape {:?}, with a negative dimension",
                    tensor.shape
                ))
            })?;
        let expected = crate::data_len(tensor.dtype, &shape)
            .map_err(|reason| invalid(format!("tensor \"{name}\" is refused: {reason}")))?;
        if tensor.data.len() != expected {
            return Err(invalid(format!(
                "tensor \"{name}\" has {} bytes of data, but its shape {:?} of {} needs {expected}",
                tensor.data.len(),
                tensor.shape,
                crate::dtype_name(tensor.dtype),
            )));
        }
        crate::check_bools(tensor.dtype, &tensor.data)
            .map_err(|reason| invalid(format!("in tensor \"{name}\", {reason}")))?;
        let shape = shape.iter().map(|&dim| dim as usize).collect();
        views.push((
            name.as_str(),
            Tensor {
                dtype: dtype_to_crate(tensor.dtype),
                shape,
                data: &tensor.data,
            },
        ));
    }
    if views.is_empty() && !metadata.is_empty() {
        return Ok(metadata_only(metadata));
    }
    let metadata: Option<HashMap<String, String>> = if metadata.is_empty() {
        None
    } else {
        Some(
            metadata
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
        )
    };
    safetensors::serialize(views.iter().map(|(name, view)| (*name, view)), &metadata)
        .map_err(|error| invalid(format!("the safetensors serializer failed ({error})")))
}

/// A file with metadata and no tensors. The `safetensors` 0.3 serializer
/// writes invalid JSON for it (`{},"__metadata__":{...}}`: it announces a
/// map of as many entries as tensors, zero, then adds the metadata), so
/// this one header is written here, padded to 8 bytes with spaces as the
/// serializer pads.
fn metadata_only(metadata: &BTreeMap<String, String>) -> Vec<u8> {
    let mut header = serde_json::json!({ METADATA_KEY: metadata })
        .to_string()
        .into_bytes();
    header.resize(header.len().next_multiple_of(8), b' ');
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(&header);
    bytes
}
