//! Progress reports of long tasks (epochs, batches, rounds): each report
//! becomes a structured event of the worker, which `wasmrpc launch` draws
//! as a progress bar (or prints as a line when its output is not a
//! terminal).
//!
//! ```no_run
//! use wasmrpc_guest::progress;
//! # fn train_one(_: u64) {}
//! let epochs = 10;
//! for epoch in 1..=epochs {
//!     train_one(epoch);
//!     progress::report("epoch", epoch, epochs, &format!("loss {:.3}", 0.1));
//! }
//! ```

use crate::host;
use wasmrpc_abi::protocol::{HostCall, Progress};

/// Reports that `position` of `total` steps of the task `bar` are done
/// (`total` 0: unknown), with a short status `message`. One bar per worker
/// and `bar`; a report with `position == total` completes it.
///
/// Reporting is best-effort: a host that cannot show it drops it.
pub fn report(bar: &str, position: u64, total: u64, message: &str) {
    let _ = host::unit(&HostCall::Progress(Progress {
        bar: bar.to_owned(),
        position,
        total,
        message: message.to_owned(),
    }));
}
