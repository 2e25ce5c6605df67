//! Why a file was refused, in sentences a plugin author can act on.

use crate::Format;

/// The dtypes a safetensors file may use, for messages.
pub(crate) const SAFETENSORS_DTYPES: &str =
    "it reads the safetensors dtypes F32, F64, F16, BF16, I64, I32, I16, I8, U8 and BOOL";

/// The dtypes a `.npy` array may have, for messages.
pub(crate) const NPY_DTYPES: &str = "it reads the numpy dtypes f2, f4, f8, i1, i2, i4, i8, u1 and b1 \
     (bool), little- or big-endian";

/// Why a file was refused.
///
/// Every `Display` text is a full sentence that starts with the file name
/// given to the function (a guest path such as `/data/x.npy`) and says what
/// is wrong: the texts reach plugin authors unchanged.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FileError {
    /// The file is a Python pickle: a `torch.save` archive, a raw pickle
    /// stream, or a pickle-ish extension (`.pt`, `.pth`, `.pkl`, `.ckpt`,
    /// `.bin`) on contents this crate does not read.
    #[error(
        "{file} is a Python pickle (as torch.save writes), and wasmrpc never loads pickles: \
         unpickling runs whatever code the file's author chose. Convert it once where torch \
         runs, with safetensors.torch.save_file(torch.load(\"{file}\", weights_only=True), \
         \"{file}.safetensors\"), and load the .safetensors file instead."
    )]
    Pickle {
        /// The file, as the caller named it.
        file: String,
    },

    /// A `.npy` array (alone or inside a `.npz`) of numpy's object dtype,
    /// which numpy stores as a pickle.
    #[error(
        "{file} holds a numpy object array (descr {descr}), which numpy stores as a Python \
         pickle, and wasmrpc never loads pickles: unpickling runs whatever code the file's \
         author chose. Convert it once where numpy runs: load it with numpy.load(..., \
         allow_pickle=True) only if you trust it, turn it into a numeric array, and save that \
         with numpy.save or safetensors.numpy.save_file."
    )]
    ObjectArray {
        /// The file (for a `.npz`, the archive and the member).
        file: String,
        /// The array's descr as the header spells it, such as `|O`.
        descr: String,
    },

    /// The contents are none of the formats this crate reads.
    #[error(
        "{file} is in a format wasmrpc does not read: it reads safetensors files, numpy .npy \
         files and numpy .npz archives."
    )]
    UnknownFormat {
        /// The file, as the caller named it.
        file: String,
    },

    /// A well-formed file that uses something this crate does not read:
    /// a dtype, an encrypted or compressed zip member, a non-`.npy` member.
    #[error("{file} uses {what}, which wasmrpc does not read; {supported}.")]
    Unsupported {
        /// The file (for a `.npz`, the archive and the member).
        file: String,
        /// What it uses, naming the tensor where there is one.
        what: String,
        /// What is read instead.
        supported: &'static str,
    },

    /// The file breaks its format's rules: lengths that disagree, offsets
    /// past the end, a header that does not parse.
    #[error("{file} is not a valid {format} file: {reason}.")]
    Malformed {
        /// The file (for a `.npz`, the archive and the member).
        file: String,
        /// The format it was read as.
        format: Format,
        /// What is wrong, as a clause.
        reason: String,
    },

    /// Reading the file would produce more tensor data than allowed.
    #[error(
        "{file} holds more than {limit} bytes of tensor data, the most this load may produce; \
         load a smaller file or split it."
    )]
    LimitExceeded {
        /// The file, as the caller named it.
        file: String,
        /// The limit in bytes.
        limit: u64,
    },

    /// `write_safetensors` was given tensors it cannot write.
    #[error("{file} cannot be written: {reason}.")]
    InvalidTensor {
        /// The file to be written, as the caller named it.
        file: String,
        /// What is wrong with the arguments, as a clause.
        reason: String,
    },
}

impl FileError {
    /// Whether the caller should change what it passes (Python's
    /// `ValueError`): a pickle, an unknown format, an unsupported dtype or
    /// bad arguments to a write. `false` means the file itself is damaged
    /// or too large for the budget (Python's `RuntimeError`).
    pub fn is_value_error(&self) -> bool {
        match self {
            FileError::Pickle { .. }
            | FileError::ObjectArray { .. }
            | FileError::UnknownFormat { .. }
            | FileError::Unsupported { .. }
            | FileError::InvalidTensor { .. } => true,
            FileError::Malformed { .. } | FileError::LimitExceeded { .. } => false,
        }
    }
}
