//! The group's health as a plugin sees it: which workers this worker
//! declared failed, a future that completes when the next one fails, and
//! whether the group was restarted after a failure.
//!
//! A worker declares a peer failed when the peer sends nothing (no call, no
//! heartbeat) for the failure window (`wasmrpc worker --failure-timeout`,
//! 2 s by default). From then on calls to it fail at once with
//! "worker2 failed: no heartbeat for 2.0 s". These functions ask the
//! worker the plugin runs on (its functions `wasmrpc::failed_workers`,
//! `wasmrpc::next_worker_failure` and `wasmrpc::restart_count`), so only
//! plugins the operator loaded may call them; a deployed plugin is held to
//! its own functions.
//!
//! ```no_run
//! use wasmrpc_guest::supervision;
//! # fn main() -> wasmrpc_guest::Result<()> {
//! if supervision::restart_count()? > 0 {
//!     // The group was restarted after a failure: resume from the last
//!     // checkpoint (`wasmrpc_guest::checkpoint::latest`).
//! }
//! let failure = supervision::next_worker_failure(&[])?;
//! // ... start work; then, without blocking:
//! if failure.done()? {
//!     let f: supervision::WorkerFailure = failure.wait()?;
//!     wasmrpc_guest::log(&format!("{} failed: {}", f.worker, f.cause));
//! }
//! # Ok(())
//! # }
//! ```

use crate::convert::FromValue;
use crate::{Call, Error, Future, Result, Value, get_worker_info, rpc_sync};

/// A worker declared failed, and why ("no heartbeat for 2.0 s").
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerFailure {
    /// The failed worker's name.
    pub worker: String,
    /// Why it was declared failed.
    pub cause: String,
}

impl FromValue for WorkerFailure {
    fn from_value(value: Value) -> Result<Self> {
        let field = |pairs: &[(Value, Value)], key: &str| {
            pairs.iter().find_map(|(k, v)| match (k, v) {
                (Value::Str(k), Value::Str(v)) if k == key => Some(v.clone()),
                _ => None,
            })
        };
        if let Value::Dict(pairs) = &value
            && let (Some(worker), Some(cause)) = (field(pairs, "worker"), field(pairs, "cause"))
        {
            return Ok(WorkerFailure { worker, cause });
        }
        Err(Error::type_error(format!(
            "a worker failure is a dict with the strings \"worker\" and \"cause\", not {value:?}"
        )))
    }
}

fn me() -> Result<String> {
    Ok(get_worker_info()?.name)
}

/// How many times the group was restarted after a failure
/// (`TORCHELASTIC_RESTART_COUNT`, set by `wasmrpc launch --max-restarts`
/// and by torchrun): 0 on a first start.
///
/// # Errors
/// A `RuntimeError` if the worker refuses the call (a deployed plugin).
pub fn restart_count() -> Result<u32> {
    let n: i64 = rpc_sync(&me()?, "wasmrpc::restart_count", ())?;
    u32::try_from(n).map_err(|_| Error::runtime_error(format!("restart count {n} out of range")))
}

/// The workers this worker declared failed, in order.
///
/// # Errors
/// A `RuntimeError` if the worker refuses the call (a deployed plugin).
pub fn failed_workers() -> Result<Vec<WorkerFailure>> {
    rpc_sync(&me()?, "wasmrpc::failed_workers", ())
}

/// A future that completes with the next [`WorkerFailure`] of a worker not
/// in `known` (already failed ones included: pass those you have seen).
/// It has no timeout.
///
/// # Errors
/// A `RuntimeError` if the call cannot be made.
pub fn next_worker_failure(known: &[String]) -> Result<Future> {
    Call::new(&me()?, "wasmrpc::next_worker_failure", (known.to_vec(),))
        .timeout(0.0)
        .start()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(text: &str) -> Value {
        Value::Str(text.into())
    }

    #[test]
    fn a_failure_reads_from_its_dict_and_from_nothing_else() {
        let dict = Value::Dict(vec![
            (s("worker"), s("worker2")),
            (s("cause"), s("no heartbeat for 2.0 s")),
        ]);
        assert_eq!(
            WorkerFailure::from_value(dict).unwrap(),
            WorkerFailure {
                worker: "worker2".into(),
                cause: "no heartbeat for 2.0 s".into()
            }
        );
        for bad in [
            Value::Dict(vec![(s("worker"), s("worker2"))]),
            Value::Dict(vec![(s("worker"), Value::Int(2)), (s("cause"), s("x"))]),
            s("worker2 failed"),
        ] {
            let e = WorkerFailure::from_value(bad).unwrap_err();
            assert!(e.to_string().contains("a worker failure is a dict"), "{e}");
        }
    }
}
