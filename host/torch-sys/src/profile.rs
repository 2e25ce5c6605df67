//! The aten ops libtorch runs on this thread during a closure, nested ops
//! included (what PyTorch's profiler lists: `aten::relu` and the
//! `aten::clamp_min` it calls), for the host's RPC profiler. Recording
//! uses a thread-local RecordFunction callback that exists only while
//! [`record_ops`] runs, so ops outside it cost nothing extra. On request
//! ([`RecordOptions`]) it also records each op's input shapes and the CPU
//! memory it allocated, as PyTorch's `record_shapes` and `profile_memory`.

use crate::ffi;

/// What [`record_ops`] records besides each op's name and times.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RecordOptions {
    /// Each op's input shapes ([`OpEvent::input_shapes`]), read from the
    /// RecordFunction's inputs, which libtorch then keeps for the callback
    /// (PyTorch's `record_shapes`).
    pub shapes: bool,
    /// Each op's CPU memory ([`OpEvent::cpu_memory_usage`]), from the
    /// memory reports of libtorch's CPU allocator (PyTorch's
    /// `profile_memory`).
    pub memory: bool,
}

/// One aten op: its name (`aten::add`) and when it ran, in nanoseconds
/// since [`record_ops`] began, with what [`RecordOptions`] asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpEvent {
    /// The op's name.
    pub name: String,
    /// Start.
    pub start_ns: u64,
    /// End.
    pub end_ns: u64,
    /// The shape of each input the op got, in order: a tensor's sizes, and
    /// `[]` for anything else (a scalar, a list, an undefined tensor), as
    /// PyTorch's `input_shapes` (`aten::add(ones(100), ones(100))` has
    /// `[[100], [100], []]`, the last its `alpha`). Empty unless
    /// [`RecordOptions::shapes`].
    pub input_shapes: Vec<Vec<i64>>,
    /// Bytes the CPU allocator handed out minus bytes it took back while
    /// the op ran, its nested ops included (PyTorch's `cpu_memory_usage`).
    /// 0 unless [`RecordOptions::memory`].
    pub cpu_memory_usage: i64,
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
        raw.iter().map(op_event).collect()
    }
}

/// Copies one of the shim's events.
fn op_event(e: &ffi::RawOpEvent) -> OpEvent {
    let name = if e.name.is_null() {
        String::new()
    } else {
        // SAFETY: `name_len` bytes at `name`, owned by the shim for as long
        // as the window's events are valid (`Window::stop`).
        let bytes = unsafe { std::slice::from_raw_parts(e.name, e.name_len) };
        String::from_utf8_lossy(bytes).into_owned()
    };
    let mut input_shapes = Vec::with_capacity(e.n_inputs);
    if e.n_inputs > 0 && !e.ranks.is_null() {
        // SAFETY: the shim gives `n_inputs` ranks, and as many dims as the
        // ranks add up to, valid as the name is.
        let ranks = unsafe { std::slice::from_raw_parts(e.ranks, e.n_inputs) };
        let total: usize = ranks.iter().map(|r| usize::try_from(*r).unwrap_or(0)).sum();
        let dims: &[i64] = if total == 0 || e.dims.is_null() {
            &[]
        } else {
            // SAFETY: as above.
            unsafe { std::slice::from_raw_parts(e.dims, total) }
        };
        let mut at = 0;
        for r in ranks {
            let r = usize::try_from(*r).unwrap_or(0);
            input_shapes.push(dims[at..at + r].to_vec());
            at += r;
        }
    }
    OpEvent {
        name,
        start_ns: u64::try_from(e.start_ns).unwrap_or(0),
        end_ns: u64::try_from(e.end_ns).unwrap_or(0),
        input_shapes,
        cpu_memory_usage: e.cpu_memory_bytes,
    }
}

impl Drop for Window {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Runs `f` on this thread and returns its output with every aten op it
/// ran, in the order they started, with what `options` asks for. Inside
/// another `record_ops` on the same thread, the outer one gets the ops and
/// this one returns none.
pub fn record_ops<R>(options: RecordOptions, f: impl FnOnce() -> R) -> (R, Vec<OpEvent>) {
    let mut bits = 0;
    if options.shapes {
        bits |= ffi::WRS_PROFILE_SHAPES;
    }
    if options.memory {
        bits |= ffi::WRS_PROFILE_MEMORY;
    }
    // SAFETY: no pointers; installs a thread-local callback (and memory
    // reporter) until `wrs_profile_stop`.
    let open = unsafe { ffi::wrs_profile_start(bits) } == 0;
    let mut window = Window { open };
    let out = f();
    let events = window.stop();
    (out, events)
}
