//! Who hears of the aten ops builtin calls run: a profiling scope, which
//! lives in a feature (`crate::profiler`) that the core does not name. The
//! feature implements [`OpListener`] and tells the core, once, how to find
//! the listener of the current task ([`listen_for_ops`]); a builtin call
//! asks for one and, when there is one, records the ops on the thread they
//! run on ([`profiled`]).

use std::sync::{Arc, OnceLock};
use std::time::Instant;

use wasmrpc_torch_sys::{OpEvent, RecordOptions};

/// A listener for the aten ops a call runs.
pub(crate) trait OpListener: Send + Sync {
    /// What to record besides names and times.
    fn record_options(&self) -> RecordOptions;
    /// The ops a call ran, recorded from `start`.
    fn ops_ran(&self, start: Instant, ops: Vec<OpEvent>);
}

/// How to find the current task's listener.
type Lookup = fn() -> Option<Arc<dyn OpListener>>;

static LOOKUP: OnceLock<Lookup> = OnceLock::new();

/// Sets how builtin calls find the current task's listener. The first call
/// wins; the profiler makes it when it opens a scope.
pub(crate) fn listen_for_ops(lookup: Lookup) {
    let _ = LOOKUP.set(lookup);
}

/// The current task's listener, if any.
pub(super) fn op_listener() -> Option<Arc<dyn OpListener>> {
    LOOKUP.get().and_then(|lookup| lookup())
}

/// Runs `f`, with libtorch's ops recorded as `options` asks when there
/// are options (a profiling scope): its output, and when recorded, when
/// the recording began and the ops.
pub(crate) fn profiled<T>(
    options: Option<RecordOptions>,
    f: impl FnOnce() -> T,
) -> (T, Option<(Instant, Vec<OpEvent>)>) {
    match options {
        Some(options) => {
            let start = Instant::now();
            let (out, ops) = wasmrpc_torch_sys::record_ops(options, f);
            (out, Some((start, ops)))
        }
        None => (f(), None),
    }
}
