//! [`Error`]: why loading a plugin or running a guest failed.

use wasmrpc_abi::{ErrorKind, RemoteError};

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The text PyTorch reports when an `@async_execution` function returns
/// something other than a future.
pub const ASYNC_WRONG_TYPE: &str =
    "Functions decorated with @rpc.async_function must return a torch.futures.Future object,";

/// Why loading a plugin or running a guest failed.
///
/// [`Error::kind`] gives the Python exception class a caller sees and
/// [`Error::to_remote`] the error to send over the wire.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The guest raised a typed error; kind and message are the guest's.
    #[error("{error}")]
    Raised {
        /// The plugin's name.
        plugin: String,
        /// The function or method.
        function: String,
        /// The error, verbatim.
        error: RemoteError,
    },
    /// The guest trapped (a panic, `unreachable`, an out-of-bounds access).
    #[error("plugin `{plugin}`: `{function}` trapped: {message}")]
    Trap {
        /// The plugin's name.
        plugin: String,
        /// The function or method.
        function: String,
        /// The panic message or the trap's description.
        message: String,
    },
    /// The guest ran longer than its time limit (time spent waiting on the
    /// host does not count).
    #[error(
        "plugin `{plugin}`: `{function}` ran longer than its limit of {limit_ms} ms of guest time"
    )]
    Timeout {
        /// The plugin's name.
        plugin: String,
        /// The function or method.
        function: String,
        /// The limit in milliseconds.
        limit_ms: u128,
    },
    /// The guest tried to grow its memory past the limit.
    #[error("plugin `{plugin}`: `{function}` exceeded the memory limit of {limit} bytes")]
    MemoryLimit {
        /// The plugin's name.
        plugin: String,
        /// The function or method.
        function: String,
        /// The limit in bytes.
        limit: usize,
    },
    /// The guest broke the calling convention (bad pointers, undecodable
    /// bytes, a missing export).
    #[error("plugin `{plugin}`: `{function}` broke the calling convention: {message}")]
    Abi {
        /// The plugin's name.
        plugin: String,
        /// The function or method.
        function: String,
        /// What went wrong.
        message: String,
    },
    /// The plugin has no such function, class or method.
    #[error("plugin `{plugin}` has no {what} `{name}`")]
    NotFound {
        /// The plugin's name.
        plugin: String,
        /// `"function"`, `"class"` or `"method"`.
        what: &'static str,
        /// The name asked for.
        name: String,
    },
    /// An earlier trap broke this object's instance.
    #[error("the `{class}` object of plugin `{plugin}` is broken by an earlier trap")]
    ObjectBroken {
        /// The plugin's name.
        plugin: String,
        /// The class name.
        class: String,
    },
    /// A call to run beside an object waited for it longer than it may.
    #[error(
        "`{function}` of plugin `{plugin}` waited {waited:?} to run beside its `{class}` object, \
         which stayed busy: calls beside an object queue behind its methods, one at a time, so a \
         call there that waits for another call needing the same object waits for itself"
    )]
    ObjectBusy {
        /// The plugin's name.
        plugin: String,
        /// The object's class.
        class: String,
        /// The function that was to run beside it.
        function: String,
        /// How long it waited.
        waited: std::time::Duration,
    },
    /// The bytes are not a valid plugin module.
    #[error("invalid plugin module: {0}")]
    InvalidModule(String),
    /// Another module with the same plugin name is already loaded.
    #[error("a different plugin named `{0}` is already loaded")]
    DuplicatePlugin(String),
    /// Reading a plugin folder or the module cache failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The engine could not be configured or an instance not created.
    #[error("wasm engine: {0}")]
    Engine(String),
}

impl Error {
    /// The Python exception class a caller sees.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::Raised { error, .. } => error.kind,
            Error::Timeout { .. } | Error::ObjectBusy { .. } => ErrorKind::TimeoutError,
            Error::NotFound { .. } => ErrorKind::AttributeError,
            _ => ErrorKind::RuntimeError,
        }
    }

    /// The error as it crosses the wire: a guest's own error unchanged,
    /// anything else as its kind and this error's text.
    pub fn to_remote(&self) -> RemoteError {
        match self {
            Error::Raised { error, .. } => error.clone(),
            other => RemoteError::new(other.kind(), other.to_string()),
        }
    }
}

impl From<Error> for RemoteError {
    fn from(e: Error) -> Self {
        e.to_remote()
    }
}
