//! [`OpError`]: why a builtin op call failed, with the Python exception class
//! PyTorch would raise and its message.

use wasmrpc_abi::ErrorKind;

/// The text PyTorch RPC reports when no overload of a builtin accepts the
/// arguments; [`OpError::NoMatchingSchema`] messages start with it.
pub const NO_MATCHING_SCHEMA: &str =
    "Overloaded torch operator invoked from Python failed to match any schema";

/// Why a builtin op call failed.
///
/// `Display` gives the message exactly as PyTorch words it; [`OpError::kind`]
/// gives the Python exception class.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OpError {
    /// No operator is registered under the name (`RuntimeError`).
    #[error("Unknown builtin op: {name}")]
    UnknownOp {
        /// The qualified name looked up, e.g. `aten::foo`.
        name: String,
    },
    /// A tensor method that neither `aten::<name>` nor `prim::<name>`
    /// provides (`AttributeError`, worded as Python's, which the seeds'
    /// RRef-proxy tests assert: `has no attribute 'non_exist'`).
    #[error("'{type_name}' object has no attribute '{name}'")]
    UnknownMethod {
        /// Python's name for the receiver's type, e.g. `Tensor`.
        type_name: String,
        /// The method name.
        name: String,
    },
    /// No overload's schema accepts the arguments (`RuntimeError`). The
    /// message starts with [`NO_MATCHING_SCHEMA`] and then gives, for each
    /// overload tried, why it did not match and its declaration.
    #[error("{message}")]
    NoMatchingSchema {
        /// The qualified op name.
        op: String,
        /// PyTorch's text, with every schema tried.
        message: String,
    },
    /// The op ran and raised: libtorch's message, unchanged, and the class
    /// its `c10::Error` subclass maps to in Python.
    #[error("{message}")]
    Raised {
        /// The qualified op name.
        op: String,
        /// The Python exception class.
        kind: ErrorKind,
        /// libtorch's message, without its C++ backtrace.
        message: String,
    },
    /// The arguments were rejected before reaching libtorch: a Python
    /// builtin's own check (`min()` of nothing), a value no op takes (bytes,
    /// an RRef), lists nested too deep; with the class and text Python uses.
    #[error("{message}")]
    Rejected {
        /// The Python exception class (`TypeError`, `ValueError`).
        kind: ErrorKind,
        /// Python's message.
        message: String,
    },
    /// The call could not cross the shim: an output of a type we do not
    /// convert (complex, dict, object), or a broken invariant (`RuntimeError`).
    #[error("{op}: {message}")]
    Internal {
        /// The qualified op name, if known.
        op: String,
        /// What went wrong.
        message: String,
    },
}

impl OpError {
    /// The Python exception class PyTorch would raise.
    pub fn kind(&self) -> ErrorKind {
        match self {
            OpError::Raised { kind, .. } | OpError::Rejected { kind, .. } => *kind,
            OpError::UnknownMethod { .. } => ErrorKind::AttributeError,
            OpError::UnknownOp { .. }
            | OpError::NoMatchingSchema { .. }
            | OpError::Internal { .. } => ErrorKind::RuntimeError,
        }
    }

    pub(crate) fn with_op(self, name: &str) -> OpError {
        match self {
            OpError::Internal { op, message } if op.is_empty() => OpError::Internal {
                op: name.to_owned(),
                message,
            },
            other => other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_follow_python() {
        let unknown = OpError::UnknownOp {
            name: "aten::foo".into(),
        };
        assert_eq!(unknown.kind(), ErrorKind::RuntimeError);
        assert_eq!(unknown.to_string(), "Unknown builtin op: aten::foo");
        let raised = OpError::Raised {
            op: "aten::select".into(),
            kind: ErrorKind::IndexError,
            message: "index 5 is out of bounds".into(),
        };
        assert_eq!(raised.kind(), ErrorKind::IndexError);
        assert_eq!(raised.to_string(), "index 5 is out of bounds");
    }

    #[test]
    fn unknown_methods_are_attribute_errors() {
        let e = OpError::UnknownMethod {
            type_name: "Tensor".into(),
            name: "non_exist".into(),
        };
        assert_eq!(e.kind(), ErrorKind::AttributeError);
        assert_eq!(
            e.to_string(),
            "'Tensor' object has no attribute 'non_exist'"
        );
    }

    #[test]
    fn internal_errors_learn_their_op() {
        let e = OpError::Internal {
            op: String::new(),
            message: "m".into(),
        }
        .with_op("aten::x");
        assert_eq!(e.to_string(), "aten::x: m");
    }
}
