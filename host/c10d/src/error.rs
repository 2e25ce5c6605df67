//! The crate's [`Error`] type.
//!
//! Every failure names where it happened (rank, group, collective, peer) so a
//! caller can tell which worker and which operation broke; the kinds map to
//! the Python exceptions PyTorch raises ([`Error::python_kind`]).

use std::time::Duration;

/// Why a process-group call failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The caller passed something invalid (PyTorch's `ValueError`), such
    /// as tensors of different dtypes, a rank outside a group or an
    /// unregistered group.
    #[error("{0}")]
    InvalidArgument(String),
    /// A state or usage error (PyTorch's `RuntimeError`), such as calling a
    /// collective before `init_process_group`.
    #[error("{0}")]
    Runtime(String),
    /// The backend does not implement this operation.
    #[error("backend {backend} does not support {op}")]
    Unsupported {
        /// The backend's name.
        backend: String,
        /// The operation.
        op: String,
    },
    /// A collective or point-to-point operation outlived the group timeout.
    #[error(
        "Timeout after {timeout:?}: rank {rank} of group {group} waiting in {op} for rank {peer}"
    )]
    Timeout {
        /// This worker's rank in the group.
        rank: usize,
        /// The group's name.
        group: String,
        /// The operation.
        op: String,
        /// The group rank that did not deliver.
        peer: usize,
        /// The timeout that passed.
        timeout: Duration,
    },
    /// The connection to a peer failed or closed while an operation needed it.
    #[error("rank {rank} of group {group}: {op} with rank {peer} failed: {detail}")]
    Peer {
        /// This worker's rank in the group.
        rank: usize,
        /// The group's name.
        group: String,
        /// The operation (or "connect" while the group is formed).
        op: String,
        /// The peer's group rank.
        peer: usize,
        /// What went wrong.
        detail: String,
    },
    /// One of libtorch's engines (`gloo`, `nccl`) failed an operation; the
    /// detail is libtorch's own message (PyTorch's text).
    #[error("rank {rank} of group {group}: {op} on {backend}: {detail}")]
    Backend {
        /// The engine's name.
        backend: String,
        /// This worker's rank in the group.
        rank: usize,
        /// The group's name.
        group: String,
        /// The operation (`"init"` while the group is formed).
        op: String,
        /// libtorch's message.
        detail: String,
    },
    /// A tensor operation inside a collective failed.
    #[error("rank {rank} of group {group}: {op}: {source}")]
    Tensor {
        /// This worker's rank in the group.
        rank: usize,
        /// The group's name.
        group: String,
        /// The operation.
        op: String,
        /// libtorch's error.
        #[source]
        source: tch::TchError,
    },
    /// The store failed (rendezvous, address exchange).
    #[error(transparent)]
    Store(#[from] wasmrpc_store::Error),
}

impl Error {
    /// The Python exception class PyTorch raises for this failure.
    pub fn python_kind(&self) -> &'static str {
        match self {
            Error::InvalidArgument(_) => "ValueError",
            Error::Runtime(_) | Error::Tensor { .. } => "RuntimeError",
            Error::Unsupported { .. } => "RuntimeError",
            Error::Timeout { .. } | Error::Peer { .. } | Error::Backend { .. } => {
                "DistBackendError"
            }
            Error::Store(e) => e.python_kind(),
        }
    }
}

/// The result of a process-group call.
pub type Result<T, E = Error> = std::result::Result<T, E>;
