//! The aten ops libtorch runs on this thread during a closure, nested ops
//! included (what PyTorch's profiler lists: `aten::relu` and the
//! `aten::clamp_min` it calls), for the host's RPC profiler. Recording
//! uses a thread-local RecordFunction callback that exists only while
//! [`record_ops`] runs, so ops outside it cost nothing extra.

use crate::ffi;

/// One aten op: its name (`aten::add`) and when it ran, in nanoseconds
/// since [`record_ops`] began.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpEvent {
    /// The op's name.
    pub name: String,
    /// Start.
    pub start_ns: u64,
    /// End.
    pub end_ns: u64,
}

/// Closes the window on drop, so a panic in the closure leaves no callback
/// installed on the thread.
struct Window {
    open: bool,
}

impl Window {
    fn stop(&mut self) -> Vec<OpEvent> {
        if !self.open {
            return Vec::new();
        }
        self.open = false;
        let mut events: *const ffi::RawOpEvent = std::ptr::null();
        // SAFETY: `events` is a valid out-pointer; the shim returns how many
        // events it points at, in thread-local storage valid until the next
        // `wrs_profile_start` on this thread, which cannot run before the
        // copy below finishes.
        let n = unsafe { ffi::wrs_profile_stop(&raw mut events) };
        if n == 0 || events.is_null() {
            return Vec::new();
        }
        // SAFETY: as above: `n` initialized events.
        let raw = unsafe { std::slice::from_raw_parts(events, n) };
        raw.iter()
            .map(|e| {
                let name = if e.name.is_null() {
                    String::new()
                } else {
                    // SAFETY: `name_len` bytes at `name`, owned by the shim
                    // for as long as `raw` is valid.
                    let bytes = unsafe { std::slice::from_raw_parts(e.name, e.name_len) };
                    String::from_utf8_lossy(bytes).into_owned()
                };
                OpEvent {
                    name,
                    start_ns: u64::try_from(e.start_ns).unwrap_or(0),
                    end_ns: u64::try_from(e.end_ns).unwrap_or(0),
                }
            })
            .collect()
    }
}

impl Drop for Window {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Runs `f` on this thread and returns its output with every aten op it
/// ran, in the order they started. Inside another `record_ops` on the same
/// thread, the outer one gets the ops and this one returns none.
pub fn record_ops<R>(f: impl FnOnce() -> R) -> (R, Vec<OpEvent>) {
    // SAFETY: no arguments; installs a thread-local callback.
    let open = unsafe { ffi::wrs_profile_start() } == 0;
    let mut window = Window { open };
    let out = f();
    let events = window.stop();
    (out, events)
}
