//! [`Future`]: the result of an asynchronous call, usable from async and
//! blocking code, with callbacks (`torch.futures.Future`).

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Condvar, Mutex};

use tokio::sync::Notify;

use crate::error::{Error, FUTURE_COMPLETED_TWICE, Result};
use crate::value::Payload;

mod streams;
use streams::DeviceEvents;

type Callback = Box<dyn FnOnce(&Future) + Send>;

struct State {
    result: Option<Result<Payload>>,
    callbacks: Vec<Callback>,
    /// Threads blocked in [`Future::wait_blocking`]: completing signals the
    /// condition variable only when there are some, since a signal is a
    /// system call even when nobody waits (std's futex `Condvar`), and most
    /// futures are awaited.
    blocked: usize,
}

struct Inner {
    /// The CUDA devices a device-aware future's value may live on
    /// ([`Future::with_devices`]); empty: any.
    devices: Vec<crate::device::Device>,
    /// What a device-aware future's completion recorded on the streams
    /// that made its value; set before the value is published.
    events: std::sync::OnceLock<DeviceEvents>,
    state: Mutex<State>,
    cond: Condvar,
    notify: Notify,
}

/// A value that will be set once: an RPC's result, or a future a user
/// completes by hand.
///
/// Cloning shares the future. [`wait`](Self::wait) may be called any number
/// of times and returns the same value or the same error each time (errors
/// are sticky). Awaiting a `Future` (it implements `IntoFuture`) is
/// `wait().await`.
#[derive(Clone)]
pub struct Future {
    inner: Arc<Inner>,
}

/// PyTorch's refusal of a future sent as a value.
pub const FUTURE_PICKLE: &str = "Can not pickle torch.futures.Future";

/// A future is a call in progress on this process, never a value: it is
/// not a [`Payload`] (an argument or a result cannot hold one, which the
/// compiler checks), and serde, the counterpart of Python's pickler, is
/// refused with PyTorch's text.
impl serde::Serialize for Future {
    fn serialize<S: serde::Serializer>(&self, _: S) -> std::result::Result<S::Ok, S::Error> {
        Err(serde::ser::Error::custom(FUTURE_PICKLE))
    }
}

impl std::fmt::Debug for Future {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Future")
            .field("done", &self.done())
            .finish()
    }
}

impl Default for Future {
    fn default() -> Self {
        Self::new()
    }
}

fn lock(m: &Mutex<State>) -> std::sync::MutexGuard<'_, State> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn clone_result(r: &Result<Payload>) -> Result<Payload> {
    match r {
        Ok(p) => Ok(p.clone()),
        Err(e) => Err(e.clone()),
    }
}

/// Runs `wait`, which blocks its thread. On a worker thread of a
/// multi-threaded tokio runtime, the worker's tasks go to another thread
/// first (`block_in_place`): among them may be what completes the wait,
/// such as the flush that writes a call's request (TR-10), and the task a
/// worker will run next is one no other worker takes.
fn block_here<T>(wait: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current() {
        Ok(h) if h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(wait)
        }
        _ => wait(),
    }
}

fn run_guarded(f: impl FnOnce() -> Result<Payload>) -> Result<Payload> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(panic) => {
            let msg = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "callback panicked".into());
            Err(Error::runtime(msg))
        }
    }
}

fn as_runtime(e: Error) -> Error {
    if e.kind() == crate::abi::ErrorKind::RuntimeError {
        return e;
    }
    let mut out = Error::runtime(e.message());
    for line in e.context() {
        out = out.context_line(line.clone());
    }
    out
}

impl Future {
    /// A future that is not completed yet.
    pub fn new() -> Self {
        Self::on_devices(Vec::new())
    }

    fn on_devices(devices: Vec<crate::device::Device>) -> Self {
        Future {
            inner: Arc::new(Inner {
                devices,
                events: std::sync::OnceLock::new(),
                state: Mutex::new(State {
                    result: None,
                    callbacks: Vec::new(),
                    blocked: 0,
                }),
                cond: Condvar::new(),
                notify: Notify::new(),
            }),
        }
    }

    /// A device-aware future (`torch.futures.Future(devices=...)`): its
    /// value may hold tensors on these CUDA devices (indices, `"cuda:N"` or
    /// devices) and on the CPU; a value with a tensor on another device
    /// completes it with an error instead.
    ///
    /// wasmrpc runs every CUDA op on the current stream (tch exposes no
    /// streams), so the value needs no stream synchronization beyond that.
    ///
    /// # Errors
    /// `ValueError` "Expected devices to have indices, got cpu" for a
    /// device without index, and for an index past this process's CUDA
    /// device count; `torch.device` parse errors.
    pub fn with_devices<D: Into<crate::device::DeviceSpec>>(
        devices: impl IntoIterator<Item = D>,
    ) -> Result<Self> {
        let mut parsed = Vec::new();
        for d in devices {
            let d = crate::device::parse_device(d)?;
            if !d.is_cuda() {
                return Err(Error::value(format!(
                    "Expected devices to have indices, got {d}"
                )));
            }
            let count = crate::device::cuda_device_count();
            if matches!(d, crate::device::Device::Cuda(i) if i >= count) {
                return Err(Error::value(format!(
                    "Expected devices within the device count, got {d} with {count} CUDA devices"
                )));
            }
            if !parsed.contains(&d) {
                parsed.push(d);
            }
        }
        Ok(Self::on_devices(parsed))
    }

    /// The devices of a device-aware future (empty for others).
    pub fn devices(&self) -> &[crate::device::Device] {
        &self.inner.devices
    }

    /// PyTorch's check in `markCompleted`: a device-aware future's value
    /// must live on its devices (or the CPU).
    fn check_devices(&self, p: &Payload) -> Result<()> {
        if self.inner.devices.is_empty() {
            return Ok(());
        }
        let mut bad = Vec::new();
        for t in &p.tensors {
            let d = crate::device::Device::from_tch(t.device())?;
            if d.is_cuda() && !self.inner.devices.contains(&d) && !bad.contains(&d) {
                bad.push(d);
            }
        }
        if bad.is_empty() {
            return Ok(());
        }
        let show = |v: &[crate::device::Device]| {
            v.iter()
                .map(|d| d.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        };
        Err(Error::value(format!(
            "The result contained tensors residing on device(s) {} which are not among the expected device(s) {}",
            show(&bad),
            show(&self.inner.devices)
        )))
    }

    /// A future already completed with `result`.
    pub fn ready(result: Result<Payload>) -> Self {
        let f = Self::new();
        let _ = f.complete(result);
        f
    }

    /// Whether two handles are the same future object (Python's `is`).
    pub fn ptr_eq(&self, other: &Future) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// Whether the future has a value or an error.
    pub fn done(&self) -> bool {
        lock(&self.inner.state).result.is_some()
    }

    /// How it completed, if it has: `Ok` or the error's kind (without
    /// copying the value).
    pub fn outcome(&self) -> Option<std::result::Result<(), crate::abi::ErrorKind>> {
        lock(&self.inner.state)
            .result
            .as_ref()
            .map(|r| r.as_ref().map(|_| ()).map_err(Error::kind))
    }

    /// The result, if completed.
    pub fn try_value(&self) -> Option<Result<Payload>> {
        lock(&self.inner.state).result.as_ref().map(clone_result)
    }

    /// Waits for the result.
    ///
    /// # Errors
    /// The error the future was completed with (every time).
    pub async fn wait(&self) -> Result<Payload> {
        loop {
            let notified = self.inner.notify.notified();
            if let Some(r) = self.try_value() {
                return self.on_current_streams(r);
            }
            notified.await;
        }
    }

    /// Waits for the result, blocking the thread. Do not call it on a thread
    /// of a single-threaded runtime that must complete the future.
    ///
    /// # Errors
    /// The error the future was completed with (every time).
    pub fn wait_blocking(&self) -> Result<Payload> {
        let r = block_here(|| {
            let mut st = lock(&self.inner.state);
            loop {
                if let Some(r) = st.result.as_ref() {
                    return clone_result(r);
                }
                st.blocked += 1;
                st = self.inner.cond.wait(st).unwrap_or_else(|p| p.into_inner());
                st.blocked -= 1;
            }
        });
        self.on_current_streams(r)
    }

    /// `r`, this future's value, made safe to read from this thread's
    /// current CUDA streams: for a device-aware future they wait for the
    /// work that made it ([`streams`]); anything else as it is.
    fn on_current_streams(&self, r: Result<Payload>) -> Result<Payload> {
        match (self.inner.events.get(), r) {
            (Some(events), Ok(p)) => events.wait_on_current_streams(&p).map(|()| p),
            (_, r) => r,
        }
    }

    /// Completes the future with `value`.
    ///
    /// # Errors
    /// `RuntimeError` "Future can only be marked completed once" if it is
    /// already completed.
    pub fn set_result(&self, value: impl Into<Payload>) -> Result<()> {
        self.complete(Ok(value.into()))
    }

    /// Completes the future with an error.
    ///
    /// # Errors
    /// `RuntimeError` "Future can only be marked completed once" if it is
    /// already completed.
    pub fn set_error(&self, error: Error) -> Result<()> {
        self.complete(Err(error))
    }

    /// Completes the future with `result`.
    ///
    /// # Errors
    /// `RuntimeError` "Future can only be marked completed once" if it is
    /// already completed.
    pub fn complete(&self, result: Result<Payload>) -> Result<()> {
        let result = match result {
            Ok(p) => self.check_devices(&p).and_then(|()| self.record_events(p)),
            Err(e) => Err(e),
        };
        let (callbacks, blocked) = {
            let mut st = lock(&self.inner.state);
            if st.result.is_some() {
                return Err(Error::runtime(FUTURE_COMPLETED_TWICE));
            }
            st.result = Some(result);
            (std::mem::take(&mut st.callbacks), st.blocked)
        };
        // A thread that blocks after the lock above sees the result before
        // it waits.
        if blocked > 0 {
            self.inner.cond.notify_all();
        }
        self.inner.notify.notify_waiters();
        for cb in callbacks {
            cb(self);
        }
        Ok(())
    }

    /// For a device-aware future, records where the work that made `p`
    /// ends on each of its CUDA devices ([`streams`]); once, since a
    /// future completes once.
    fn record_events(&self, p: Payload) -> Result<Payload> {
        if self.inner.devices.is_empty() || self.done() {
            return Ok(p);
        }
        let events = DeviceEvents::record(&p)?;
        let _ = self.inner.events.set(events);
        Ok(p)
    }

    /// Runs `cb` once the future completes (at once if it already has), on
    /// the thread that completes it.
    pub fn add_done_callback(&self, cb: impl FnOnce(&Future) + Send + 'static) {
        {
            let mut st = lock(&self.inner.state);
            if st.result.is_none() {
                st.callbacks.push(Box::new(cb));
                return;
            }
        }
        cb(self);
    }

    /// A child future completed with `cb(parent)` once this one completes.
    /// An error (or a panic) in `cb` fails the child, not the parent; as in
    /// `torch.futures`, it arrives as a `RuntimeError` with the callback's
    /// message.
    pub fn then(&self, cb: impl FnOnce(&Future) -> Result<Payload> + Send + 'static) -> Future {
        // Children keep the parent's devices, as `torch.futures` does.
        let child = Future::on_devices(self.inner.devices.clone());
        let c = child.clone();
        self.add_done_callback(move |parent| {
            if parent.inner.devices.is_empty() {
                let _ = c.complete(run_guarded(|| cb(parent)).map_err(as_runtime));
                return;
            }
            // A device-aware parent's callback runs on fresh streams that
            // waited for its value; the child records its events there.
            let guards = streams::callback_streams(&parent.inner.devices);
            let run = guards.and_then(|_guards| {
                if let Some(Ok(value)) = parent.try_value() {
                    parent.on_current_streams(Ok(value))?;
                }
                let _ = c.complete(run_guarded(|| cb(parent)).map_err(as_runtime));
                Ok(())
            });
            if let Err(e) = run {
                let _ = c.complete(Err(e));
            }
        });
        child
    }

    /// Like [`then`](Self::then) for a callback that must wait on other
    /// futures: `cb(parent)` runs as a task on the current tokio runtime.
    /// It reads a device-aware parent's value with `wait()`, which makes
    /// the current streams of the thread it runs on wait for the value.
    ///
    /// # Panics
    /// Panics if called outside a tokio runtime.
    pub fn then_async<F, Fut>(&self, cb: F) -> Future
    where
        F: FnOnce(Future) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = Result<Payload>> + Send + 'static,
    {
        // Children keep the parent's devices, as `torch.futures` does.
        let child = Future::on_devices(self.inner.devices.clone());
        let c = child.clone();
        let handle = tokio::runtime::Handle::current();
        self.add_done_callback(move |parent| {
            let parent = parent.clone();
            handle.spawn(async move {
                let r = match tokio::spawn(cb(parent)).await {
                    Ok(r) => r.map_err(as_runtime),
                    Err(e) => Err(Error::runtime(format!("callback failed: {e}"))),
                };
                let _ = c.complete(r);
            });
        });
        child
    }
}

impl std::future::IntoFuture for Future {
    type Output = Result<Payload>;
    type IntoFuture = std::pin::Pin<Box<dyn std::future::Future<Output = Result<Payload>> + Send>>;

    fn into_future(self) -> Self::IntoFuture {
        Box::pin(async move { self.wait().await })
    }
}

/// Waits for every future and returns their values in order; fails as soon
/// as any of them fails, without waiting for the rest
/// (`torch.futures.wait_all`).
///
/// # Errors
/// The first error among the futures, in completion order.
pub async fn wait_all(futures: &[Future]) -> Result<Vec<Payload>> {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    for (i, f) in futures.iter().enumerate() {
        let tx = tx.clone();
        f.add_done_callback(move |_| {
            let _ = tx.send(i);
        });
    }
    drop(tx);
    let mut left = futures.len();
    while left > 0 {
        let Some(i) = rx.recv().await else { break };
        if let Some(Err(e)) = futures[i].try_value() {
            return Err(e);
        }
        left -= 1;
    }
    futures
        .iter()
        .map(|f| {
            f.try_value().map_or_else(
                || Err(Error::runtime("future vanished")),
                |r| f.on_current_streams(r),
            )
        })
        .collect()
}

/// [`wait_all`] for blocking code.
///
/// # Errors
/// The first error among the futures, in completion order.
pub fn wait_all_blocking(futures: &[Future]) -> Result<Vec<Payload>> {
    let (tx, rx) = std::sync::mpsc::channel();
    for (i, f) in futures.iter().enumerate() {
        let tx = tx.clone();
        f.add_done_callback(move |_| {
            let _ = tx.send(i);
        });
    }
    drop(tx);
    let failed = block_here(|| {
        for _ in 0..futures.len() {
            let Ok(i) = rx.recv() else { break };
            if let Some(Err(e)) = futures[i].try_value() {
                return Some(e);
            }
        }
        None
    });
    if let Some(e) = failed {
        return Err(e);
    }
    futures
        .iter()
        .map(|f| {
            f.try_value().map_or_else(
                || Err(Error::runtime("future vanished")),
                |r| f.on_current_streams(r),
            )
        })
        .collect()
}

/// Waits for every future, successful or not, and returns every result in
/// order (`torch.futures.collect_all`).
pub async fn collect_all(futures: &[Future]) -> Vec<Result<Payload>> {
    let mut out = Vec::with_capacity(futures.len());
    for f in futures {
        out.push(f.wait().await);
    }
    out
}

tokio::task_local! {
    static COLLECTED: Arc<Mutex<Vec<Future>>>;
}

/// Runs `body` collecting every future that `rpc_async` creates in this task,
/// then waits for all of them (`rpc._wait_all()`).
///
/// Only futures created by the same task are collected; tasks spawned by the
/// body are not. The collection ends with the scope.
///
/// # Errors
/// The first error of the collected futures; otherwise the body's error.
pub async fn wait_all_scope<T, F>(body: F) -> Result<T>
where
    F: std::future::Future<Output = Result<T>>,
{
    let list = Arc::new(Mutex::new(Vec::new()));
    let r = COLLECTED.scope(list.clone(), body).await;
    let futures: Vec<Future> = std::mem::take(&mut *list.lock().unwrap_or_else(|p| p.into_inner()));
    wait_all(&futures).await?;
    r
}

/// The futures collected so far by the enclosing [`wait_all_scope`], or
/// `None` outside one.
pub fn collected_futures() -> Option<Vec<Future>> {
    COLLECTED
        .try_with(|l| l.lock().unwrap_or_else(|p| p.into_inner()).clone())
        .ok()
}

/// Adds `f` to the enclosing [`wait_all_scope`], if any.
pub(crate) fn collect(f: &Future) {
    let _ = COLLECTED.try_with(|l| l.lock().unwrap_or_else(|p| p.into_inner()).push(f.clone()));
}

#[cfg(test)]
mod tests;
