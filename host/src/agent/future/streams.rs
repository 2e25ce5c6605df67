//! What makes a device-aware [`Future`](super::Future) safe to read from
//! any CUDA stream: PyTorch's `CUDAFuture` (`ivalue::Future` with devices).
//!
//! The work that makes a value and the work that reads it may be queued on
//! different streams, which CUDA does not order. So, as in PyTorch:
//!
//! - completing such a future records an event on the current stream of
//!   each CUDA device its value's tensors are on ([`DeviceEvents::record`],
//!   `markCompleted`);
//! - whoever waits makes its own current streams wait for those events,
//!   without blocking its thread, and tells libtorch's caching allocator
//!   the tensors are used there ([`DeviceEvents::wait_on_current_streams`],
//!   `synchronizeWithCurrentStreams`);
//! - a `then` callback runs with a fresh stream of each of the future's
//!   devices made current, after they waited ([`callback_streams`],
//!   `wrapCallback`), so the child records its own events on them.
//!
//! Futures without devices, the CPU's and the RPC agent's, skip all of it.
//! This module must not decide which futures are device-aware: that is the
//! future's own ([`Future::with_devices`](super::Future::with_devices)).

use wasmrpc_torch_sys::cuda_stream::{Event, Stream, StreamGuard, record_stream};

use crate::device::Device;
use crate::error::{Error, Result};
use crate::value::Payload;

/// The events a device-aware future's completion recorded, one per CUDA
/// device its value's tensors are on.
pub(super) struct DeviceEvents(Vec<Event>);

fn stream_error(what: &str) -> impl FnOnce(wasmrpc_torch_sys::cuda_stream::StreamError) -> Error {
    move |e| Error::runtime(format!("{what}: {e}"))
}

/// The CUDA devices `value`'s tensors are on, in the order first seen.
fn cuda_devices(value: &Payload) -> Vec<usize> {
    let mut devices = Vec::new();
    for t in &value.tensors {
        if let tch::Device::Cuda(i) = t.device()
            && !devices.contains(&i)
        {
            devices.push(i);
        }
    }
    devices
}

impl DeviceEvents {
    /// Records an event on the current stream of every CUDA device that
    /// `value`'s tensors are on (none for a value on the CPU).
    pub(super) fn record(value: &Payload) -> Result<Self> {
        let what = "completing a device-aware future";
        let mut events = Vec::new();
        for device in cuda_devices(value) {
            let stream = Stream::current(device).map_err(stream_error(what))?;
            let mut event = Event::new().map_err(stream_error(what))?;
            event.record(&stream).map_err(stream_error(what))?;
            events.push(event);
        }
        Ok(DeviceEvents(events))
    }

    /// Makes this thread's current streams wait for the events, and keeps
    /// `value`'s CUDA tensors' memory from being reused before the work
    /// queued on those streams so far is done.
    pub(super) fn wait_on_current_streams(&self, value: &Payload) -> Result<()> {
        let what = "waiting for a device-aware future";
        for event in &self.0 {
            let Some(device) = event.device() else {
                continue;
            };
            let stream = Stream::current(device).map_err(stream_error(what))?;
            event.block(&stream).map_err(stream_error(what))?;
        }
        for t in &value.tensors {
            if let tch::Device::Cuda(i) = t.device() {
                let stream = Stream::current(i).map_err(stream_error(what))?;
                record_stream(t, &stream).map_err(stream_error(what))?;
            }
        }
        Ok(())
    }
}

/// A stream from the pool of each of `devices`, made current on this
/// thread until the guards drop: where a device-aware future's callback
/// runs.
pub(super) fn callback_streams(devices: &[Device]) -> Result<Vec<StreamGuard>> {
    let what = "running a device-aware future's callback";
    let mut guards = Vec::with_capacity(devices.len());
    for d in devices {
        if let Device::Cuda(i) = *d {
            let stream = Stream::from_pool(i as usize).map_err(stream_error(what))?;
            guards.push(stream.make_current().map_err(stream_error(what))?);
        }
    }
    Ok(guards)
}
