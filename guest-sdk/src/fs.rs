//! Files in the folders the worker's operator granted this plugin, and
//! tensor files there.
//!
//! A plugin reaches no file unless its operator grants it a folder, under
//! a guest path (`wasmrpc worker --grant-dir
//! my_plugin:/data=/srv/data:ro`); files are named by guest path
//! (`/data/train.csv`). The worker refuses `..`, paths outside every
//! granted folder, symlinks that lead out of one, hard-linked and special
//! files, writes to a read-only grant and writes past a grant's quota,
//! each with an error that says which.
//!
//! Tensors are saved as [safetensors] (the format `safetensors.torch`
//! reads) and loaded from safetensors, NumPy `.npy` and `.npz` files. No
//! pickle is ever loaded: a `torch.save` file is refused with how to
//! convert it. A file larger than the call's tensor memory budget is
//! refused before it is read.
//!
//! ```no_run
//! use wasmrpc_guest::{Result, Tensor, fs, remote};
//!
//! #[remote]
//! fn train_step(epoch: i64) -> Result<()> {
//!     let text = fs::read_to_string("/data/labels.csv")?;
//!     let w = Tensor::zeros(&[4, 4])?;
//!     fs::save_tensors(&format!("/ckpt/epoch-{epoch}.safetensors"), &[("w", &w)])?;
//!     let loaded = fs::load_tensors(&format!("/ckpt/epoch-{epoch}.safetensors"))?;
//!     assert_eq!(loaded[0].0, "w");
//!     Ok(())
//! }
//! ```
//!
//! [safetensors]: https://huggingface.co/docs/safetensors

use crate::host;
use crate::{Error, Result, Tensor};
use wasmrpc_abi::Value;
use wasmrpc_abi::protocol::{FileCall, HostCall};

/// Tensors by name, in a file's order.
pub type NamedTensors = Vec<(String, Tensor)>;
/// A tensor file's string metadata.
pub type Metadata = Vec<(String, String)>;

fn file(call: FileCall) -> Result<Value> {
    host::value(&HostCall::File(call))
}

fn unexpected(what: &str, got: &Value) -> Error {
    Error::runtime_error(format!(
        "the host answered a {} where {what} was expected",
        got.type_name()
    ))
}

/// The whole file at `path`.
///
/// # Errors
/// A `ValueError` for a path that is not absolute or holds `..`; a
/// `RuntimeError` for a file outside the granted folders, missing, not a
/// regular file, or larger than the call's tensor memory budget.
pub fn read(path: &str) -> Result<Vec<u8>> {
    match file(FileCall::Read(path.to_owned()))? {
        Value::Bytes(b) => Ok(b),
        other => Err(unexpected("bytes", &other)),
    }
}

/// The file at `path` as UTF-8 text.
///
/// # Errors
/// As [`read`], and a `ValueError` for text that is not UTF-8.
pub fn read_to_string(path: &str) -> Result<String> {
    String::from_utf8(read(path)?)
        .map_err(|e| Error::value_error(format!("{path} is not UTF-8 text: {e}")))
}

/// Writes `data` to the file at `path` atomically (a reader sees the old
/// file or the whole new one), making its parent folders.
///
/// # Errors
/// As [`read`], and a `RuntimeError` for a read-only grant or a write past
/// the grant's quota.
pub fn write(path: &str, data: impl Into<Vec<u8>>) -> Result<()> {
    file(FileCall::Write {
        path: path.to_owned(),
        data: data.into(),
    })
    .map(drop)
}

/// Removes the file, or the empty folder, at `path`.
///
/// # Errors
/// As [`write`], and a `RuntimeError` for a folder that is not empty.
pub fn remove(path: &str) -> Result<()> {
    file(FileCall::Remove(path.to_owned())).map(drop)
}

/// One entry of a folder ([`list`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirEntry {
    /// Its name in the folder.
    pub name: String,
    /// Whether it is a folder.
    pub is_dir: bool,
    /// Its size in bytes (0 for a folder).
    pub size: u64,
}

/// The entries of the folder at `path`, by name.
///
/// # Errors
/// As [`read`].
pub fn list(path: &str) -> Result<Vec<DirEntry>> {
    let Value::List(items) = file(FileCall::List(path.to_owned()))? else {
        return Err(Error::runtime_error(
            "the host's folder listing is not a list",
        ));
    };
    items
        .into_iter()
        .map(|item| match item {
            Value::Tuple(fields) => match fields.as_slice() {
                [Value::Str(name), Value::Bool(is_dir), Value::Int(size)] => Ok(DirEntry {
                    name: name.clone(),
                    is_dir: *is_dir,
                    size: u64::try_from(*size).unwrap_or(0),
                }),
                _ => Err(Error::runtime_error("a malformed folder entry")),
            },
            other => Err(unexpected("a folder entry", &other)),
        })
        .collect()
}

/// Whether a file or folder exists at `path` (inside a granted folder).
///
/// # Errors
/// As [`read`], except for a missing entry, which is `Ok(false)`.
pub fn exists(path: &str) -> Result<bool> {
    let trimmed = path.trim_end_matches('/');
    let (parent, name) = match trimmed.rsplit_once('/') {
        Some(("", name)) => ("/", name),
        Some((parent, name)) => (parent, name),
        None => {
            return Err(Error::value_error(format!(
                "{path:?} is not an absolute path"
            )));
        }
    };
    match list(parent) {
        Ok(entries) => Ok(entries.iter().any(|e| e.name == name)),
        Err(e) if e.message().contains("No such file") => Ok(false),
        Err(e) => Err(e),
    }
}

/// Saves named tensors (a `state_dict`) to a safetensors file at `path`,
/// atomically.
///
/// # Errors
/// As [`write`], and a `ValueError` for duplicate or empty names.
pub fn save_tensors(path: &str, tensors: &[(&str, &Tensor)]) -> Result<()> {
    save_tensors_with_metadata(path, tensors, &[])
}

/// [`save_tensors`] with string metadata in the file's header (what
/// `safetensors.torch.save_file(..., metadata=...)` writes).
///
/// # Errors
/// As [`save_tensors`].
pub fn save_tensors_with_metadata(
    path: &str,
    tensors: &[(&str, &Tensor)],
    metadata: &[(&str, &str)],
) -> Result<()> {
    file(FileCall::SaveTensors {
        path: path.to_owned(),
        tensors: tensors
            .iter()
            .map(|(name, t)| ((*name).to_owned(), t.handle()))
            .collect(),
        metadata: metadata
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect(),
    })
    .map(drop)
}

/// Every tensor of a safetensors, `.npy` or `.npz` file, by name in the
/// file's order (an `.npy` file's one tensor is named after the file).
///
/// # Errors
/// As [`read`], and a `RuntimeError` for a pickle (`torch.save`) or a file
/// that is not a valid tensor file.
pub fn load_tensors(path: &str) -> Result<NamedTensors> {
    load_tensors_with_metadata(path).map(|(tensors, _)| tensors)
}

/// [`load_tensors`] and the file's string metadata.
///
/// # Errors
/// As [`load_tensors`].
pub fn load_tensors_with_metadata(path: &str) -> Result<(NamedTensors, Metadata)> {
    let reply = file(FileCall::LoadTensors(path.to_owned()))?;
    let Value::Tuple(parts) = reply else {
        return Err(unexpected("a pair of dicts", &reply));
    };
    let mut parts = parts.into_iter();
    let (Some(Value::Dict(tensors)), Some(Value::Dict(metadata))) = (parts.next(), parts.next())
    else {
        return Err(Error::runtime_error(
            "the host's loaded tensors are malformed",
        ));
    };
    // Take ownership of every handle first, so none leaks on an error.
    let mut named = Vec::with_capacity(tensors.len());
    let mut bad = false;
    for (k, v) in tensors {
        match (k, v) {
            (Value::Str(name), Value::Tensor(h)) => named.push((name, Tensor::from_raw(h))),
            _ => bad = true,
        }
    }
    if bad {
        return Err(Error::runtime_error(
            "the host's loaded tensors are malformed",
        ));
    }
    let metadata = metadata
        .into_iter()
        .filter_map(|(k, v)| match (k, v) {
            (Value::Str(k), Value::Str(v)) => Some((k, v)),
            _ => None,
        })
        .collect();
    Ok((named, metadata))
}
