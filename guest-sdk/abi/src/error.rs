//! Error kinds that survive the wire, named after the Python exception classes
//! PyTorch RPC reports.

use alloc::string::String;
use core::fmt;
use serde::{Deserialize, Serialize};

/// The class of an error, as PyTorch's Python API would raise it.
///
/// A remote failure keeps its kind across the wire, so a caller can tell a
/// `ValueError` raised by a plugin from a `TimeoutError` raised by the agent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ErrorKind {
    /// `RuntimeError`: the default for failures of the framework itself.
    RuntimeError,
    /// `ValueError`: a bad value from the caller.
    ValueError,
    /// `TypeError`: a value of the wrong type.
    TypeError,
    /// `TimeoutError`: a deadline passed.
    TimeoutError,
    /// `KeyError`: a missing key.
    KeyError,
    /// `IndexError`: an index out of range.
    IndexError,
    /// `AttributeError`: an unknown method or attribute.
    AttributeError,
    /// `NotImplementedError`: an operation this worker does not offer.
    NotImplementedError,
    /// `AssertionError`: a failed assertion in user code.
    AssertionError,
    /// `ConnectionError`: the network failed underneath a call.
    ConnectionError,
}

impl ErrorKind {
    /// Every kind, in declaration order.
    pub const ALL: [ErrorKind; 10] = [
        ErrorKind::RuntimeError,
        ErrorKind::ValueError,
        ErrorKind::TypeError,
        ErrorKind::TimeoutError,
        ErrorKind::KeyError,
        ErrorKind::IndexError,
        ErrorKind::AttributeError,
        ErrorKind::NotImplementedError,
        ErrorKind::AssertionError,
        ErrorKind::ConnectionError,
    ];

    /// The kind whose Python class is named `name`, if any.
    pub fn from_python_name(name: &str) -> Option<ErrorKind> {
        ErrorKind::ALL.into_iter().find(|k| k.python_name() == name)
    }

    /// The Python class name, e.g. `"ValueError"`.
    pub fn python_name(self) -> &'static str {
        match self {
            ErrorKind::RuntimeError => "RuntimeError",
            ErrorKind::ValueError => "ValueError",
            ErrorKind::TypeError => "TypeError",
            ErrorKind::TimeoutError => "TimeoutError",
            ErrorKind::KeyError => "KeyError",
            ErrorKind::IndexError => "IndexError",
            ErrorKind::AttributeError => "AttributeError",
            ErrorKind::NotImplementedError => "NotImplementedError",
            ErrorKind::AssertionError => "AssertionError",
            ErrorKind::ConnectionError => "ConnectionError",
        }
    }
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.python_name())
    }
}

/// An error as it crosses the wire or the guest boundary: its kind and its
/// message, unchanged.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoteError {
    /// The exception class.
    pub kind: ErrorKind,
    /// The message, verbatim.
    pub message: String,
}

impl RemoteError {
    /// Builds an error of `kind` with `message`.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        RemoteError {
            kind,
            message: message.into(),
        }
    }
}

impl RemoteError {
    /// An exception of the class named `class` raised with `message`, as it
    /// crosses the wire. Errors travel as an [`ErrorKind`] and a message,
    /// never as objects, so only the classes of [`ErrorKind::ALL`] can be
    /// rebuilt by the receiver: such a class keeps its kind; any other (a
    /// plugin's own `CustomException`) becomes the `RuntimeError` PyTorch
    /// raises when it cannot reconstruct a remote exception, which names the
    /// original class and message: "Failed to create original exception
    /// type. Error msg was ... Original exception on remote side was
    /// CustomException: foo".
    pub fn exception(class: &str, message: impl Into<String>) -> Self {
        let message = message.into();
        match ErrorKind::from_python_name(class) {
            Some(kind) => RemoteError::new(kind, message),
            None => {
                let mut known = String::new();
                for (i, k) in ErrorKind::ALL.iter().enumerate() {
                    if i > 0 {
                        known.push_str(", ");
                    }
                    known.push_str(k.python_name());
                }
                RemoteError::new(
                    ErrorKind::RuntimeError,
                    alloc::format!(
                        "Failed to create original exception type. Error msg was {class} is not \
                         an exception class RPC can rebuild (one of {known}). Original exception \
                         on remote side was {class}: {message}"
                    ),
                )
            }
        }
    }
}

impl fmt::Display for RemoteError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.kind, self.message)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exception_classes_outside_error_kind_are_not_rebuilt() {
        for kind in ErrorKind::ALL {
            let e = RemoteError::exception(kind.python_name(), "m");
            assert_eq!((e.kind, e.message.as_str()), (kind, "m"));
        }
        let e = RemoteError::exception("CustomException", "foo");
        assert_eq!(e.kind, ErrorKind::RuntimeError);
        assert!(e.message.starts_with(
            "Failed to create original exception type. Error msg was CustomException is not"
        ));
        assert!(
            e.message
                .ends_with("Original exception on remote side was CustomException: foo")
        );
    }
}
