//! [`Error`] and [`Result`]: every failure of the host library, with the
//! Python exception class it maps to and the exact texts the seeds assert.
//!
//! An [`Error`] is a [`Kind`](ErrorKind) plus a message, and a list of context
//! lines saying where it happened (which worker, which function, which
//! timeout). Only the kind and the message cross the wire: a remote failure
//! arrives with the kind and the message the callee raised, unchanged, and the
//! caller adds its own context.
//!
//! The `pub const` texts below are copied verbatim from the seed inventories;
//! tests match on them, so they must not be reworded.

use std::fmt;

use wasmrpc_abi::{ErrorKind, RemoteError, WorkerInfo};

/// The result of a host operation.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Raised by every API when no agent is running (`_require_initialized`).
pub const NOT_INITIALIZED: &str =
    "RPC has not been initialized. Call torch.distributed.rpc.init_rpc first.";
/// Raised when the process-wide current agent is needed but not set.
pub const CURRENT_AGENT_NOT_SET: &str =
    "Current RPC agent is not set! Did you initialize the RPC framework";
/// The prefix of every RPC timeout error (the seeds' `get_timeout_error_regex`).
pub const RPC_TIMEOUT_PREFIX: &str = "RPC ran for more than";
/// Raised by `Future::set_result` / `set_error` on a completed future.
pub const FUTURE_COMPLETED_TWICE: &str = "Future can only be marked completed once";
/// Raised when static and dynamic members meet in one group.
pub const MIXED_MEMBERSHIP: &str =
    "RPC group mixes statically and dynamically initialized members which is not supported.";
/// The seeds' text for `init_rpc` without a rank (file:// and tcp://).
pub const RANK_PARAMETER_MISSING: &str = "rank parameter missing";
/// Raised by `init_rpc` without a rank with `env://` and no `RANK` variable.
pub const RANK_ENV_MISSING: &str = "Error initializing torch.distributed using env:// rendezvous: environment variable RANK expected, but not set";
/// Distributed autograd: the prefix of an unknown context id's error.
pub const UNKNOWN_AUTOGRAD_CONTEXT: &str = "Could not find autograd context with id: ";
/// Distributed autograd: a context opened inside another.
pub const ALREADY_HAVE_AUTOGRAD_CONTEXT: &str =
    "Already have an autograd context id for this thread.";
/// Distributed autograd: `_current_context()` outside any context.
pub const NO_CURRENT_AUTOGRAD_CONTEXT: &str = "Current thread doesn't have a valid autograd context. Please wrap your code using: `with torch.distributed.autograd.context() as context_id` to generate a valid context";
/// Distributed autograd: `backward` with no roots.
pub const NO_TENSORS_FOR_GRADIENT: &str = "No tensors provided for gradient computation.";
/// Distributed autograd: a root that does not require grad.
pub const ROOT_REQUIRES_GRAD_NOT_SET: &str = "requires_grad not set on root";
/// Distributed autograd: a root that is not a scalar.
pub const ROOT_NOT_SCALAR: &str = "Tensor is not a scalar, all roots need to be scalar";
/// Distributed autograd: a root with no gradient function (a leaf).
pub const ROOT_NO_GRAD_FN: &str = "Tensor does not have a valid gradient function.";
/// The prefix a worker puts on the error of a request it failed to serve.
pub const ERROR_ON_NODE_PREFIX: &str = "Error on Node ";

/// The text for an unknown distributed autograd context id.
pub fn unknown_autograd_context_message(id: i64) -> String {
    format!("{UNKNOWN_AUTOGRAD_CONTEXT}{id}")
}

/// `e` as worker `rank` reports it to the peer whose request failed:
/// "Error on Node {rank}: {message}", same kind.
pub fn error_on_node(rank: u32, e: &Error) -> Error {
    Error::new(
        e.kind(),
        format!("{ERROR_ON_NODE_PREFIX}{rank}: {}", e.message()),
    )
}

/// The longest worker name plus one (`MAX_NAME_LEN`).
pub const MAX_NAME_LEN: usize = 128;

/// The text of an RPC timeout, `ms` being the timeout in milliseconds.
pub fn rpc_timeout_message(ms: u128) -> String {
    format!("{RPC_TIMEOUT_PREFIX} set timeout ({ms} ms) and will now be marked with an error")
}

/// The `ValueError` text for `init_rpc` without a rank under `init_method`
/// (anything but `env://`).
pub fn rank_parameter_missing_message(init_method: &str) -> String {
    let scheme = init_method.split("://").next().unwrap_or(init_method);
    format!(
        "Error initializing torch.distributed using {scheme}:// rendezvous: {RANK_PARAMETER_MISSING}"
    )
}

/// The text for an invalid worker name (`WorkerInfo`'s check).
pub fn invalid_worker_name_message(name: &str) -> String {
    format!(
        "Worker name must match ^[A-Za-z0-9-_:]*$, and must be non-empty and shorter than {MAX_NAME_LEN} chars, but got {name}"
    )
}

/// The text for two workers claiming the same name.
pub fn name_not_unique_message(name: &str, a: u32, b: u32) -> String {
    format!("RPC worker name {name} is not unique. Workers {a} and {b} share the same name.")
}

/// The text for a worker that initialises twice in the same group.
pub fn already_initialized_message(name: &str, rank: u32) -> String {
    format!("RPC worker {name} (rank {rank}) is already initialized in this group")
}

/// The text for an unknown destination name.
pub fn unknown_worker_name_message(name: &str) -> String {
    format!("name:{name}, could not find destination")
}

/// The text for an unknown destination rank.
pub fn unknown_worker_id_message(id: i64) -> String {
    format!("Unknown destination worker id {id}: could not find destination")
}

/// The text for a destination that is neither a name, a rank nor a
/// `WorkerInfo` (a `ValueError`).
pub fn cannot_get_worker_info_message(to: &str) -> String {
    format!("Cannot get WorkerInfo from name {to}")
}

/// The leader's `_all_gather` error when followers fail to acknowledge.
pub fn all_gather_followers_timeout_message(
    followers: &[String],
    seconds: f64,
    first: &Error,
) -> String {
    let names: Vec<String> = followers.iter().map(|n| format!("'{n}'")).collect();
    format!(
        "Followers [{}] timed out in _all_gather after {seconds:.2} seconds. The first exception is {}",
        names.join(", "),
        first.message()
    )
}

/// `_gather_to_leader`'s check that the reporter belongs to the group.
pub fn not_expected_by_leader_message(worker: &str) -> String {
    format!("{worker} is not expected by leader.")
}

/// `_gather_to_leader`'s check against double reports (trailing space kept).
pub fn reported_twice_message(worker: &str, sequence_id: &str) -> String {
    format!("{worker} reported intent sequence id {sequence_id} twice. ")
}

/// `_broadcast_to_followers`' check against double broadcasts.
pub fn signal_set_twice_message(sequence_id: &str) -> String {
    format!("Termination signal sequence id {sequence_id} got set twice.")
}

/// The callee's answer for a function that is not registered there.
pub fn unknown_function_message(function: &str, worker: &str) -> String {
    format!(
        "function {function} is not registered on worker {worker}: the RPC pickler does not serialize functions, so the callee must register it by name"
    )
}

/// A host failure: its Python exception class, its message and where it
/// happened.
///
/// `Display` prints the kind, the message and the context lines;
/// [`message`](Self::message) is the message alone, exactly as raised.
#[derive(Clone, PartialEq, Eq)]
pub struct Error {
    kind: ErrorKind,
    message: String,
    context: Vec<String>,
}

impl Error {
    /// An error of `kind` with `message`.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Error {
            kind,
            message: message.into(),
            context: Vec::new(),
        }
    }

    /// A `RuntimeError`.
    pub fn runtime(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::RuntimeError, message)
    }

    /// A `ValueError`.
    pub fn value(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::ValueError, message)
    }

    /// A `TypeError`.
    pub fn type_error(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::TypeError, message)
    }

    /// The `RuntimeError` every API raises when no agent runs.
    pub fn not_initialized() -> Self {
        Self::runtime(NOT_INITIALIZED)
    }

    /// The Python exception class.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// The message, exactly as raised (without context).
    pub fn message(&self) -> &str {
        &self.message
    }

    /// Where the error happened, innermost first.
    pub fn context(&self) -> &[String] {
        &self.context
    }

    /// Adds a line of context (e.g. "rpc to worker1 calling seed::add").
    #[must_use]
    pub fn context_line(mut self, line: impl Into<String>) -> Self {
        self.context.push(line.into());
        self
    }

    /// The form that crosses the wire: kind and message.
    pub fn to_remote(&self) -> RemoteError {
        RemoteError::new(self.kind, self.message.clone())
    }

    /// Tells whether the message contains `needle`.
    pub fn contains(&self, needle: &str) -> bool {
        self.message.contains(needle)
    }
}

impl From<RemoteError> for Error {
    fn from(e: RemoteError) -> Self {
        Error::new(e.kind, e.message)
    }
}

impl From<tch::TchError> for Error {
    fn from(e: tch::TchError) -> Self {
        Error::runtime(e.to_string())
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.kind, self.message)?;
        for line in &self.context {
            write!(f, "\n  while {line}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl std::error::Error for Error {}

/// Adds context to the error of a `Result`.
pub trait ResultExt<T> {
    /// Adds `line` (computed only on error) to the error's context.
    ///
    /// # Errors
    /// Returns the original error with the added line.
    fn with_context<S: Into<String>>(self, line: impl FnOnce() -> S) -> Result<T>;
}

impl<T, E: Into<Error>> ResultExt<T> for std::result::Result<T, E> {
    fn with_context<S: Into<String>>(self, line: impl FnOnce() -> S) -> Result<T> {
        self.map_err(|e| e.into().context_line(line()))
    }
}

/// Raised by `to_here` on a user RRef that graceful shutdown deleted.
pub const RREF_TO_HERE_AFTER_DELETION: &str = "Cannot call to_here() on it after deletion.";
/// Raised when a user RRef that graceful shutdown deleted is forked (sent).
pub const RREF_FORK_AFTER_DELETION: &str = "Cannot call fork an UserRRef after deletion.";
/// Raised by `to_here` when the `remote()` that created the RRef timed out.
pub const RREF_CREATION_TIMED_OUT: &str = "RRef creation via rpc.remote() timed out, and it is possible that the RRef on the owner node has not yet been created.";
/// The start of each line of the leak report graceful shutdown raises.
pub const LEAKING_RREF: &str = "Leaking RRef";

/// The seeds' text for `local_value()` called on a user RRef.
pub fn local_value_not_on_owner_message(
    rref_id: &str,
    fork_id: &str,
    user: &WorkerInfo,
    owner: &WorkerInfo,
) -> String {
    format!(
        "For UserRRef(rref_id={rref_id}, fork_id={fork_id}), can't call localValue() on user {}. Call it on owner {}",
        worker_info_str(user),
        worker_info_str(owner)
    )
}

/// `WorkerInfo(id=1, name=worker1)`, as PyTorch prints a worker.
pub fn worker_info_str(w: &WorkerInfo) -> String {
    format!("WorkerInfo(id={}, name={})", w.id, w.name)
}

/// One line of the leak report: `Leaking RRef {rref} with fork Id {fork}`.
pub fn leaking_rref_message(rref_id: &str, fork_id: &str) -> String {
    format!("{LEAKING_RREF} {rref_id} with fork Id {fork_id}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seed_texts_are_verbatim() {
        assert_eq!(
            NOT_INITIALIZED,
            "RPC has not been initialized. Call torch.distributed.rpc.init_rpc first."
        );
        assert!(rpc_timeout_message(100).starts_with("RPC ran for more than"));
        assert_eq!(
            rpc_timeout_message(100),
            "RPC ran for more than set timeout (100 ms) and will now be marked with an error"
        );
        let bad = invalid_worker_name_message("abc*");
        for needle in [
            "Worker name must match",
            "must be non-empty",
            "shorter than 128",
        ] {
            assert!(bad.contains(needle), "{bad}");
        }
        assert!(name_not_unique_message("w", 0, 1).contains("is not unique"));
        assert!(already_initialized_message("w", 0).contains("is already initialized"));
        assert!(unknown_worker_name_message("x").contains("could not find destination"));
        assert!(RANK_ENV_MISSING.contains("environment variable RANK expected"));
        assert!(RANK_PARAMETER_MISSING.contains("rank parameter missing"));
        assert_eq!(
            reported_twice_message("w", "s0"),
            "w reported intent sequence id s0 twice. "
        );
    }

    #[test]
    fn all_gather_message_uses_python_list_repr() {
        let e = Error::runtime("boom");
        let m =
            all_gather_followers_timeout_message(&["worker1".into(), "worker2".into()], 0.1, &e);
        assert_eq!(
            m,
            "Followers ['worker1', 'worker2'] timed out in _all_gather after 0.10 seconds. The first exception is boom"
        );
    }

    #[test]
    fn context_is_kept_out_of_the_message() {
        let e = Error::value("Expected error").context_line("rpc to worker1");
        assert_eq!(e.message(), "Expected error");
        assert_eq!(e.kind(), ErrorKind::ValueError);
        assert_eq!(e.to_remote().message, "Expected error");
        assert!(e.to_string().contains("rpc to worker1"));
    }

    #[test]
    fn rref_texts_match_the_seeds() {
        let user = WorkerInfo {
            id: 0,
            name: "worker0".into(),
        };
        let owner = WorkerInfo {
            id: 1,
            name: "worker1".into(),
        };
        let a = "GloballyUniqueId(created_on=0, local_id=0)";
        let b = "GloballyUniqueId(created_on=0, local_id=1)";
        assert_eq!(
            local_value_not_on_owner_message(a, b, &user, &owner),
            "For UserRRef(rref_id=GloballyUniqueId(created_on=0, local_id=0), fork_id=GloballyUniqueId(created_on=0, local_id=1)), can't call localValue() on user WorkerInfo(id=0, name=worker0). Call it on owner WorkerInfo(id=1, name=worker1)"
        );
        assert!(leaking_rref_message(a, b).starts_with("Leaking RRef "));
        assert!(RREF_CREATION_TIMED_OUT.starts_with("RRef creation"));
    }
}
