//! What the seeds' CUDA tests use to make a missing synchronisation show:
//! PyTorch's `torch.cuda._sleep`, `get_cycles_per_ms()` and
//! `FIFTY_MIL_CYCLES`, over `wasmrpc_torch_sys::cuda_stream`.
//!
//! A seed queues a sleep kernel before the work whose result it checks,
//! often on a side stream: a transfer or a read that does not wait for
//! that stream then sees the value before it is written.

use std::sync::OnceLock;

use wasmrpc::Error;
pub use wasmrpc_torch_sys::cuda_stream::{
    Event, Stream, StreamError, StreamGuard, record_stream, sleep,
};

/// `FIFTY_MIL_CYCLES` of PyTorch's RPC tests: `10 * FIFTY_MIL_CYCLES` is
/// their usual delay (about a quarter of a second on current GPUs).
pub const FIFTY_MIL_CYCLES: i64 = 50_000_000;

/// A stream, event or sleep failure as the error a callee returns.
pub fn cuda_error(e: StreamError) -> Error {
    Error::runtime(e.to_string())
}

/// `get_cycles_per_ms()` for `cuda:0`, measured once per process (as the
/// seeds' `lru_cache` does).
///
/// # Errors
/// CUDA is not loaded or has no device.
pub fn cycles_per_ms() -> wasmrpc::Result<f64> {
    static MEASURED: OnceLock<Result<f64, StreamError>> = OnceLock::new();
    MEASURED
        .get_or_init(|| wasmrpc_torch_sys::cuda_stream::cycles_per_ms(0))
        .clone()
        .map_err(cuda_error)
}

/// `torch.cuda._sleep(int(ms * get_cycles_per_ms()))` on the current
/// stream of `device`.
///
/// # Errors
/// CUDA is not loaded or has no such device.
pub fn sleep_ms(device: usize, ms: f64) -> wasmrpc::Result<()> {
    let cycles = (ms * cycles_per_ms()?) as i64;
    sleep(device, cycles).map_err(cuda_error)
}

/// `torch.cuda._sleep(cycles)` on the current stream of `device`.
///
/// # Errors
/// CUDA is not loaded or has no such device.
pub fn sleep_cycles(device: usize, cycles: i64) -> wasmrpc::Result<()> {
    sleep(device, cycles).map_err(cuda_error)
}

/// The index of `t`'s CUDA device.
///
/// # Errors
/// `t` is not on a CUDA device.
pub fn cuda_index(t: &tch::Tensor) -> wasmrpc::Result<usize> {
    match t.device() {
        tch::Device::Cuda(i) => Ok(i),
        d => Err(Error::value(format!(
            "expected a CUDA tensor, got one on {d:?}"
        ))),
    }
}
