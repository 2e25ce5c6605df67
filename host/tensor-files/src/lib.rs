//! Tensor files to and from bytes: safetensors, numpy `.npy` and numpy
//! `.npz`, read into `(name, dtype, shape, little-endian C-order bytes)`,
//! and safetensors written back.
//!
//! # What this crate owns
//!
//! - Recognising a format from a file's first bytes and its name
//!   ([`detect`]), and refusing Python pickles everywhere (`torch.save`
//!   archives, raw pickle streams, numpy object arrays) with advice on how
//!   to convert them once where torch runs.
//! - Parsing each format into [`TensorBytes`] ([`read`],
//!   [`read_with_metadata`]), converting big-endian and Fortran-ordered
//!   `.npy` arrays to little-endian C order on the way.
//! - Writing safetensors files ([`write_safetensors`]).
//!
//! Plugins are hostile, so every input is assumed to be crafted by an
//! attacker: nothing here panics, allocates more than the input and the
//! caller's `limit` allow, or loops without bound. Lengths, offsets and
//! shapes are checked with checked arithmetic, and a `.npz` member is
//! inflated only up to the bytes its header declares and the limit allows.
//!
//! # What this crate must not do
//!
//! - Open files. The host opens them through capability-safe folder
//!   grants, checks their size against a memory budget, and passes the
//!   bytes here; file names given here are only for messages and for
//!   naming tensors.
//! - Know about libtorch. The host makes tensors from [`TensorBytes`];
//!   this crate stays pure Rust so it builds and is tested without torch.
//! - Load pickles, ever, in any form.

use std::collections::BTreeMap;

pub use wasmrpc_abi::protocol::DType;

mod error;
mod npy;
mod npz;
mod safetensors_file;

pub use error::FileError;

/// One tensor's contents: element type, shape, and the elements contiguous
/// in C order, little-endian.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorBytes {
    /// The element type.
    pub dtype: DType,
    /// The size of each dimension; empty for a 0-d tensor.
    pub shape: Vec<i64>,
    /// The elements, `dtype.size()` bytes each, C order, little-endian.
    pub data: Vec<u8>,
}

/// A file's tensors, named, in the file's order.
pub type Tensors = Vec<(String, TensorBytes)>;

/// A safetensors file's `__metadata__`: free-form strings by key.
pub type Metadata = BTreeMap<String, String>;

/// The formats this crate reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Format {
    /// A safetensors file: an 8-byte header length, a JSON header, data.
    SafeTensors,
    /// A numpy `.npy` file (format versions 1.0, 2.0 and 3.0).
    Npy,
    /// A numpy `.npz` archive: a zip of `.npy` members, stored or deflated.
    Npz,
}

impl std::fmt::Display for Format {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Format::SafeTensors => "safetensors",
            Format::Npy => ".npy",
            Format::Npz => ".npz",
        })
    }
}

/// torch's name for a dtype (`"float32"`, `"bool"`, ...), for messages.
pub fn dtype_name(dtype: DType) -> &'static str {
    match dtype {
        DType::Float32 => "float32",
        DType::Float64 => "float64",
        DType::Float16 => "float16",
        DType::BFloat16 => "bfloat16",
        DType::Int64 => "int64",
        DType::Int32 => "int32",
        DType::Int16 => "int16",
        DType::Int8 => "int8",
        DType::UInt8 => "uint8",
        DType::Bool => "bool",
    }
}

/// The first bytes of a `.npy` file.
const NPY_MAGIC: &[u8] = b"\x93NUMPY";

/// Extensions under which PyTorch checkpoints (pickles) usually travel.
const PICKLE_EXTENSIONS: [&str; 5] = ["pt", "pth", "pkl", "ckpt", "bin"];

/// Recognises a file's format from its first bytes (`head`: at least 16
/// when the file has them, more is fine) and its name's extension.
///
/// The contents decide first: the `.npy` magic, a zip's signature (read as
/// `.npz`; [`read`] refuses `torch.save` archives, which are zips too), a
/// pickle stream's opening (`0x80` and protocol 2 to 5, refused), and a
/// safetensors header opening (`{` after the 8-byte length). Otherwise
/// the extension decides, so that a damaged `x.safetensors` gets a
/// safetensors-specific error rather than "unknown format"; a pickle-ish
/// extension (`.pt`, `.pth`, `.pkl`, `.ckpt`, `.bin`) is refused as a
/// pickle.
pub fn detect(file: &str, head: &[u8]) -> Result<Format, FileError> {
    if head.starts_with(NPY_MAGIC) {
        return Ok(Format::Npy);
    }
    // A local file header, or the end record of an empty archive.
    if head.starts_with(b"PK\x03\x04") || head.starts_with(b"PK\x05\x06") {
        return Ok(Format::Npz);
    }
    // PROTO opcode and protocol 2..=5: every pickle Python 3 writes.
    if let [0x80, 2..=5, ..] = head {
        return Err(FileError::Pickle {
            file: file.to_owned(),
        });
    }
    if head.get(8) == Some(&b'{') {
        return Ok(Format::SafeTensors);
    }
    let extension = extension(file);
    match extension.as_str() {
        "safetensors" => Ok(Format::SafeTensors),
        "npy" => Ok(Format::Npy),
        "npz" => Ok(Format::Npz),
        _ if is_pickle_extension(&extension) => Err(FileError::Pickle {
            file: file.to_owned(),
        }),
        _ => Err(FileError::UnknownFormat {
            file: file.to_owned(),
        }),
    }
}

/// Reads every tensor of a file's bytes, the format detected by [`detect`].
///
/// A `.npy` yields one tensor named after the file's stem (`"x"` for
/// `/data/x.npy`); a `.npz` one per member, named without `.npy` as
/// `numpy.load` does, in the archive's order; a safetensors file its
/// tensors in the order of their data offsets. `limit` bounds the total
/// bytes of tensor data produced, decompressed `.npz` members included: an
/// archive that would inflate past it is refused without inflating the
/// rest.
pub fn read(file: &str, bytes: &[u8], limit: u64) -> Result<Tensors, FileError> {
    read_with_metadata(file, bytes, limit).map(|(tensors, _)| tensors)
}

/// [`read`], also returning a safetensors file's `__metadata__` string map
/// (empty when it has none; always empty for the other formats).
pub fn read_with_metadata(
    file: &str,
    bytes: &[u8],
    limit: u64,
) -> Result<(Tensors, Metadata), FileError> {
    match detect(file, bytes)? {
        Format::SafeTensors => safetensors_file::read(file, bytes, limit),
        Format::Npy => {
            let mut reader = bytes;
            let header = npy::read_header(file, &mut reader)?;
            if header.data_len as u64 > limit {
                return Err(FileError::LimitExceeded {
                    file: file.to_owned(),
                    limit,
                });
            }
            let tensor = npy::read_data(file, &mut reader, &header)?;
            Ok((vec![(stem(file).to_owned(), tensor)], BTreeMap::new()))
        }
        Format::Npz => {
            let tensors = npz::read(file, bytes, limit, is_pickle_extension(&extension(file)))?;
            Ok((tensors, BTreeMap::new()))
        }
    }
}

/// Writes a safetensors file (through the `safetensors` crate's
/// serializer) holding `tensors` and, when not empty, `metadata` as its
/// `__metadata__`.
///
/// Refuses empty, duplicate or reserved (`__metadata__`) names, negative
/// dimensions, shapes too large for a tensor, data whose length is not
/// `numel * dtype.size()`, and bools other than 0 and 1. The serializer
/// orders the file by element size (largest first), then by name; [`read`]
/// gives that order back.
pub fn write_safetensors(
    file: &str,
    tensors: &[(String, TensorBytes)],
    metadata: &BTreeMap<String, String>,
) -> Result<Vec<u8>, FileError> {
    safetensors_file::write(file, tensors, metadata)
}

/// The last component of a guest path.
fn file_name(file: &str) -> &str {
    file.rsplit('/').next().unwrap_or(file)
}

/// The file name's extension, lower-cased; empty when it has none.
fn extension(file: &str) -> String {
    let name = file_name(file);
    match name.rfind('.') {
        Some(dot) if dot > 0 => name[dot + 1..].to_ascii_lowercase(),
        _ => String::new(),
    }
}

/// The file name without its extension: what `numpy` users call an array
/// saved as `/data/x.npy` ("x").
fn stem(file: &str) -> &str {
    let name = file_name(file);
    match name.rfind('.') {
        Some(dot) if dot > 0 => &name[..dot],
        _ => name,
    }
}

fn is_pickle_extension(extension: &str) -> bool {
    PICKLE_EXTENSIONS.contains(&extension)
}

/// The number of data bytes of a tensor of `dtype` and `shape`.
///
/// Refuses dimensions above `i64::MAX` and shapes whose element count
/// (zeros aside) times the element size exceeds `i64::MAX`, which is what
/// libtorch can hold; zeros are skipped in that product so that the
/// answer does not depend on where a zero dimension sits. The error is a
/// clause for a message.
pub(crate) fn data_len(dtype: DType, shape: &[u64]) -> Result<usize, String> {
    let too_large = || format!("the shape {shape:?} has more elements than a tensor can hold");
    let mut nonzero_bytes = dtype.size() as u64;
    let mut has_zero = false;
    for &dim in shape {
        if dim > i64::MAX as u64 {
            return Err(too_large());
        }
        if dim == 0 {
            has_zero = true;
        } else {
            nonzero_bytes = nonzero_bytes.checked_mul(dim).ok_or_else(too_large)?;
        }
    }
    if nonzero_bytes > i64::MAX as u64 {
        return Err(too_large());
    }
    if has_zero {
        return Ok(0);
    }
    usize::try_from(nonzero_bytes).map_err(|_| too_large())
}

/// Checks that every byte of a bool tensor is 0 or 1: libtorch assumes so,
/// and a crafted 2 would make comparisons and reductions disagree.
pub(crate) fn check_bools(dtype: DType, data: &[u8]) -> Result<(), String> {
    if dtype != DType::Bool {
        return Ok(());
    }
    match data.iter().position(|&byte| byte > 1) {
        Some(index) => Err(format!(
            "bool element {index} is the byte {:#04x}, but a bool must be 0 or 1",
            data[index]
        )),
        None => Ok(()),
    }
}

/// A shape of `u64` dimensions as `i64`s; [`data_len`] has checked that
/// every dimension fits.
pub(crate) fn shape_i64(shape: &[u64]) -> Vec<i64> {
    shape
        .iter()
        .map(|&dim| i64::try_from(dim).unwrap_or(i64::MAX))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_come_from_the_last_component() {
        assert_eq!(stem("/data/x.npy"), "x");
        assert_eq!(stem("/data/x.tar.npy"), "x.tar");
        assert_eq!(stem("/data/.npy"), ".npy");
        assert_eq!(stem("x"), "x");
        assert_eq!(extension("/a.b/C.NPZ"), "npz");
        assert_eq!(extension("/a.b/c"), "");
    }

    #[test]
    fn data_len_checks_every_dimension() {
        assert_eq!(data_len(DType::Float32, &[]), Ok(4));
        assert_eq!(data_len(DType::Float32, &[2, 3]), Ok(24));
        assert_eq!(data_len(DType::Float32, &[0, 3]), Ok(0));
        assert_eq!(data_len(DType::Float32, &[1 << 40, 1 << 40, 0]).ok(), None);
        assert_eq!(data_len(DType::Float32, &[0, 1 << 40, 1 << 40]).ok(), None);
        assert_eq!(data_len(DType::UInt8, &[u64::MAX]).ok(), None);
        assert_eq!(data_len(DType::Float64, &[1 << 60]).ok(), None);
    }
}
