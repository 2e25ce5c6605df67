//! CUDA streams and events, and the GPU sleep kernel: what PyTorch's
//! `torch.cuda.Stream`, `torch.cuda.Event`, `torch.cuda.stream(s)`,
//! `Tensor.record_stream` and `torch.cuda._sleep` give.
//!
//! The host's device-aware futures use them to order a value's consumers
//! after the work that produced it, wherever each ran; tests use the sleep
//! kernel and side streams to make a missing synchronisation show (a read
//! that does not wait sees the value before the delayed write).
//!
//! This module owns the Rust side of `shim/cuda_stream.cpp`, which reaches
//! CUDA only through c10's device-generic stream and event interfaces. It
//! does not load CUDA: that is [`crate::cuda`]'s, and every call here fails
//! with a [`StreamError`] naming why until CUDA is loaded.
//!
//! A stream is current per thread and per device, as in libtorch: a
//! [`StreamGuard`] makes one current on the thread that made the guard and
//! is not `Send`, so an `async` block that must be `Send` cannot hold one
//! across an `.await` (which could resume on another thread).

use std::ffi::{CStr, c_char, c_void};
use std::marker::PhantomData;
use std::ptr::NonNull;

use tch::Tensor;

use crate::ffi;

/// Why a stream, event or sleep call failed: libtorch's message (the first
/// line), with what was asked.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct StreamError(String);

type Result<T> = std::result::Result<T, StreamError>;

const ERR_CAP: usize = 512;

/// Runs one shim call that writes its error into a buffer; `what` names the
/// call in the error.
fn call(what: impl FnOnce() -> String, f: impl FnOnce(*mut c_char, usize) -> i32) -> Result<()> {
    let mut buf = [0 as c_char; ERR_CAP];
    if f(buf.as_mut_ptr(), ERR_CAP) == 1 {
        return Ok(());
    }
    // SAFETY: the shim wrote a NUL-terminated string of at most ERR_CAP
    // bytes (the buffer starts zeroed, so it is terminated even if not).
    let msg = unsafe { CStr::from_ptr(buf.as_ptr()) }.to_string_lossy();
    Err(StreamError(format!("{}: {msg}", what())))
}

fn index(device: usize) -> Result<i8> {
    i8::try_from(device).map_err(|_| StreamError(format!("cuda:{device}: no such device index")))
}

/// A CUDA stream of one device: libtorch's `c10::Stream`, by its device and
/// id. Copying it copies the name of the stream, not the stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Stream {
    device: i8,
    id: i64,
}

impl Stream {
    fn get(which: i32, device: usize, what: &str) -> Result<Self> {
        let device = index(device)?;
        let mut id = 0i64;
        call(
            || format!("{what} of cuda:{device}"),
            // SAFETY: `id` and the buffer outlive the call.
            |err, cap| unsafe { ffi::wrs_cuda_stream_get(which, device, &mut id, err, cap) },
        )?;
        Ok(Stream { device, id })
    }

    /// The stream current on this thread for `device`
    /// (`torch.cuda.current_stream(device)`); the device's default stream
    /// unless a [`StreamGuard`] made another one current.
    ///
    /// # Errors
    /// CUDA is not loaded, or there is no such device.
    pub fn current(device: usize) -> Result<Self> {
        Self::get(0, device, "the current stream")
    }

    /// A stream from the device's pool (`torch.cuda.Stream(device)`): it
    /// does not wait for the default stream, nor the default stream for it.
    ///
    /// # Errors
    /// CUDA is not loaded, or there is no such device.
    pub fn from_pool(device: usize) -> Result<Self> {
        Self::get(1, device, "a pool stream")
    }

    /// The device's default stream (`torch.cuda.default_stream(device)`).
    ///
    /// # Errors
    /// CUDA is not loaded, or there is no such device.
    pub fn default_stream(device: usize) -> Result<Self> {
        Self::get(2, device, "the default stream")
    }

    /// The index of the stream's device.
    pub fn device(&self) -> usize {
        self.device as usize
    }

    /// Makes this stream current for its device on this thread until the
    /// guard drops (`with torch.cuda.stream(s):`).
    ///
    /// # Errors
    /// CUDA is not loaded.
    pub fn make_current(&self) -> Result<StreamGuard> {
        let previous = self.exchange()?;
        Ok(StreamGuard {
            previous,
            _not_send: PhantomData,
        })
    }

    fn exchange(&self) -> Result<Stream> {
        let mut previous = 0i64;
        call(
            || format!("making stream {} of cuda:{} current", self.id, self.device),
            // SAFETY: `previous` and the buffer outlive the call.
            |err, cap| unsafe {
                ffi::wrs_cuda_stream_exchange(self.device, self.id, &mut previous, err, cap)
            },
        )?;
        Ok(Stream {
            device: self.device,
            id: previous,
        })
    }

    /// Makes the work queued on this stream from now on wait for the work
    /// queued on `other` so far (`s.wait_stream(other)`), without blocking
    /// the thread.
    ///
    /// # Errors
    /// CUDA is not loaded, or recording on `other` failed.
    pub fn wait_stream(&self, other: &Stream) -> Result<()> {
        let mut event = Event::new()?;
        event.record(other)?;
        event.block(self)
    }

    /// Blocks the thread until the work queued on the stream is done.
    ///
    /// # Errors
    /// CUDA is not loaded, or a kernel on the stream failed.
    pub fn synchronize(&self) -> Result<()> {
        call(
            || format!("synchronizing stream {} of cuda:{}", self.id, self.device),
            // SAFETY: the buffer outlives the call.
            |err, cap| unsafe { ffi::wrs_cuda_stream_synchronize(self.device, self.id, err, cap) },
        )
    }

    /// Whether the work queued on the stream is done.
    ///
    /// # Errors
    /// CUDA is not loaded.
    pub fn query(&self) -> Result<bool> {
        let mut done = 0i32;
        call(
            || format!("querying stream {} of cuda:{}", self.id, self.device),
            // SAFETY: `done` and the buffer outlive the call.
            |err, cap| unsafe {
                ffi::wrs_cuda_stream_query(self.device, self.id, &mut done, err, cap)
            },
        )?;
        Ok(done == 1)
    }
}

/// A stream made current by [`Stream::make_current`]; dropping it makes
/// current again the stream that was. Not `Send`: current streams belong
/// to a thread.
#[must_use = "the stream is current only while the guard lives"]
#[derive(Debug)]
pub struct StreamGuard {
    previous: Stream,
    _not_send: PhantomData<*const ()>,
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        // Restoring a stream that was current cannot fail once CUDA is
        // loaded (it was, to make the guard).
        let _ = self.previous.exchange();
    }
}

/// A CUDA event (`torch.cuda.Event`): a point in a stream's work that
/// other streams and threads can wait for.
#[derive(Debug)]
pub struct Event {
    raw: NonNull<c_void>,
}

// SAFETY: a c10::Event is a CUDA event handle and its device; CUDA's event
// calls are thread-safe, and the one that changes the handle (`record`)
// takes `&mut self`.
unsafe impl Send for Event {}
// SAFETY: see `Send`; the `&self` methods only read the handle.
unsafe impl Sync for Event {}

impl Event {
    fn make(timing: bool) -> Result<Self> {
        let mut raw = std::ptr::null_mut();
        call(
            || "making a CUDA event".into(),
            // SAFETY: the buffer outlives the call.
            |err, cap| {
                raw = unsafe { ffi::wrs_cuda_event_new(i32::from(timing), err, cap) };
                i32::from(!raw.is_null())
            },
        )?;
        Ok(Event {
            raw: NonNull::new(raw).expect("checked above"),
        })
    }

    /// An event without timing, the cheaper kind
    /// (`torch.cuda.Event()`).
    ///
    /// # Errors
    /// CUDA is not loaded.
    pub fn new() -> Result<Self> {
        Self::make(false)
    }

    /// An event that can measure elapsed time
    /// (`torch.cuda.Event(enable_timing=True)`).
    ///
    /// # Errors
    /// CUDA is not loaded.
    pub fn with_timing() -> Result<Self> {
        Self::make(true)
    }

    /// Records the event at the end of the work queued on `stream` so far.
    ///
    /// # Errors
    /// The event was recorded on another device before.
    pub fn record(&mut self, stream: &Stream) -> Result<()> {
        call(
            || {
                format!(
                    "recording an event on stream {} of cuda:{}",
                    stream.id, stream.device
                )
            },
            // SAFETY: `raw` is a live event; the buffer outlives the call.
            |err, cap| unsafe {
                ffi::wrs_cuda_event_record(self.raw.as_ptr(), stream.device, stream.id, err, cap)
            },
        )
    }

    /// The device the event was recorded on, once it has been.
    pub fn device(&self) -> Option<usize> {
        // SAFETY: `raw` is a live event.
        let d = unsafe { ffi::wrs_cuda_event_device(self.raw.as_ptr()) };
        usize::try_from(d).ok()
    }

    /// Makes the work queued on `stream` from now on wait for the event,
    /// without blocking the thread (nothing to wait for if it was never
    /// recorded).
    ///
    /// # Errors
    /// The stream is on another device than the event.
    pub fn block(&self, stream: &Stream) -> Result<()> {
        call(
            || {
                format!(
                    "making stream {} of cuda:{} wait for an event",
                    stream.id, stream.device
                )
            },
            // SAFETY: `raw` is a live event; the buffer outlives the call.
            |err, cap| unsafe {
                ffi::wrs_cuda_event_block(self.raw.as_ptr(), stream.device, stream.id, err, cap)
            },
        )
    }

    /// Blocks the thread until the event's work is done.
    ///
    /// # Errors
    /// A kernel before the event failed.
    pub fn synchronize(&self) -> Result<()> {
        call(
            || "waiting for a CUDA event".into(),
            // SAFETY: `raw` is a live event; the buffer outlives the call.
            |err, cap| unsafe { ffi::wrs_cuda_event_synchronize(self.raw.as_ptr(), err, cap) },
        )
    }

    /// Whether the event's work is done.
    ///
    /// # Errors
    /// A kernel before the event failed.
    pub fn query(&self) -> Result<bool> {
        let mut done = 0i32;
        call(
            || "querying a CUDA event".into(),
            // SAFETY: `raw` is a live event; `done` and the buffer outlive
            // the call.
            |err, cap| unsafe { ffi::wrs_cuda_event_query(self.raw.as_ptr(), &mut done, err, cap) },
        )?;
        Ok(done == 1)
    }

    /// Milliseconds between this event and `end`, both made
    /// [`with_timing`](Self::with_timing), recorded and done.
    ///
    /// # Errors
    /// Either event has no timing, was not recorded or is not done.
    pub fn elapsed_ms(&self, end: &Event) -> Result<f64> {
        let mut ms = 0f64;
        call(
            || "measuring between two CUDA events".into(),
            // SAFETY: both events are live; `ms` and the buffer outlive the
            // call.
            |err, cap| unsafe {
                ffi::wrs_cuda_event_elapsed_ms(
                    self.raw.as_ptr(),
                    end.raw.as_ptr(),
                    &mut ms,
                    err,
                    cap,
                )
            },
        )?;
        Ok(ms)
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: `raw` came from `wrs_cuda_event_new` and is freed once.
        unsafe { ffi::wrs_cuda_event_free(self.raw.as_ptr()) }
    }
}

/// Tells libtorch's caching allocator that `tensor`'s memory is in use on
/// `stream` (`tensor.record_stream(stream)`): it is not handed out again
/// before the work queued on `stream` so far is done, even if every tensor
/// using it is dropped first.
///
/// # Errors
/// The tensor is not on a CUDA device, or CUDA is not loaded.
pub fn record_stream(tensor: &Tensor, stream: &Stream) -> Result<()> {
    call(
        || {
            format!(
                "record_stream on stream {} of cuda:{}",
                stream.id, stream.device
            )
        },
        // SAFETY: `tensor` is a live `at::Tensor` borrowed for the call.
        |err, cap| unsafe {
            ffi::wrs_cuda_record_stream(
                tensor.as_ptr().cast::<c_void>(),
                stream.device,
                stream.id,
                err,
                cap,
            )
        },
    )
}

/// Queues a kernel that spins for about `cycles` GPU clock cycles on the
/// current stream of `device` (`torch.cuda._sleep(cycles)`): work queued
/// after it on that stream starts only once it ends, while the thread goes
/// on at once.
///
/// # Errors
/// CUDA is not loaded, or there is no such device.
pub fn sleep(device: usize, cycles: i64) -> Result<()> {
    let d = index(device)?;
    call(
        || format!("torch.cuda._sleep({cycles}) on cuda:{device}"),
        // SAFETY: the buffer outlives the call.
        |err, cap| unsafe { ffi::wrs_cuda_sleep(d, cycles, err, cap) },
    )
}

/// How many cycles of [`sleep`] make a millisecond on `device`, measured
/// as PyTorch's tests measure it (`get_cycles_per_ms`): ten sleeps of a
/// million cycles timed with events, the mean of the middle six.
///
/// # Errors
/// CUDA is not loaded, or there is no such device.
pub fn cycles_per_ms(device: usize) -> Result<f64> {
    const CYCLES: i64 = 1_000_000;
    let stream = Stream::current(device)?;
    let mut rates = Vec::with_capacity(10);
    for _ in 0..10 {
        let (mut start, mut end) = (Event::with_timing()?, Event::with_timing()?);
        start.record(&stream)?;
        sleep(device, CYCLES)?;
        end.record(&stream)?;
        end.synchronize()?;
        rates.push(CYCLES as f64 / start.elapsed_ms(&end)?);
    }
    rates.sort_by(f64::total_cmp);
    Ok(rates[2..8].iter().sum::<f64>() / 6.0)
}
