//! Raising Python exceptions from a plugin: [`Error`] carries an
//! [`ErrorKind`] and a message, and keeps both across the wire.

use core::fmt;
use wasmrpc_abi::{ErrorKind, RemoteError};

/// An error a plugin function raises, or one the host raised back at it.
///
/// The caller of the function sees the same kind and message, verbatim:
/// `Err(Error::value_error("Expected error"))` reaches a PyTorch-style caller
/// as `ValueError: Expected error`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error {
    kind: ErrorKind,
    message: String,
}

/// `Result` with [`Error`] as its default error.
pub type Result<T, E = Error> = core::result::Result<T, E>;

impl Error {
    /// An error of `kind` with `message`.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Error {
            kind,
            message: message.into(),
        }
    }
    /// A `RuntimeError`.
    pub fn runtime_error(message: impl Into<String>) -> Self {
        Error::new(ErrorKind::RuntimeError, message)
    }
    /// A `ValueError`.
    pub fn value_error(message: impl Into<String>) -> Self {
        Error::new(ErrorKind::ValueError, message)
    }
    /// A `TypeError`.
    pub fn type_error(message: impl Into<String>) -> Self {
        Error::new(ErrorKind::TypeError, message)
    }
    /// A `KeyError`.
    pub fn key_error(message: impl Into<String>) -> Self {
        Error::new(ErrorKind::KeyError, message)
    }
    /// An `IndexError`.
    pub fn index_error(message: impl Into<String>) -> Self {
        Error::new(ErrorKind::IndexError, message)
    }
    /// An `AssertionError`.
    pub fn assertion_error(message: impl Into<String>) -> Self {
        Error::new(ErrorKind::AssertionError, message)
    }
    /// An exception of the class named `class` (`raise CustomException(...)`):
    /// a class of [`ErrorKind`] keeps its kind; any other reaches the caller
    /// as the `RuntimeError` PyTorch raises when it cannot rebuild a remote
    /// exception, naming the class and the message
    /// ([`RemoteError::exception`]).
    ///
    /// ```
    /// use wasmrpc_guest::{Error, ErrorKind};
    /// let e = Error::exception("CustomException", "foo");
    /// assert_eq!(e.kind(), ErrorKind::RuntimeError);
    /// assert!(e.message().contains("Original exception on remote side was CustomException: foo"));
    /// assert_eq!(Error::exception("KeyError", "k").kind(), ErrorKind::KeyError);
    /// ```
    pub fn exception(class: &str, message: impl Into<String>) -> Self {
        RemoteError::exception(class, message).into()
    }
    /// The exception class.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }
    /// The message.
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.kind, self.message)
    }
}

impl From<RemoteError> for Error {
    fn from(e: RemoteError) -> Self {
        Error {
            kind: e.kind,
            message: e.message,
        }
    }
}

impl From<Error> for RemoteError {
    fn from(e: Error) -> Self {
        RemoteError {
            kind: e.kind,
            message: e.message,
        }
    }
}

/// Raises `Err(Error::new(kind, format!(...)))` from the current function.
///
/// ```
/// use wasmrpc_guest::{raise, ErrorKind, Result};
/// fn check(n: i64) -> Result<i64> {
///     if n < 0 {
///         raise!(ValueError, "negative: {n}");
///     }
///     Ok(n)
/// }
/// assert_eq!(check(-1).unwrap_err().kind(), ErrorKind::ValueError);
/// ```
#[macro_export]
macro_rules! raise {
    ($kind:ident, $($fmt:tt)+) => {
        return ::core::result::Result::Err($crate::Error::new(
            $crate::ErrorKind::$kind,
            ::std::format!($($fmt)+),
        ).into())
    };
}
