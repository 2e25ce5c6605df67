//! A live instance of a plugin: its store, the guest memory glue (copying
//! call arguments in and outcomes out), and the per-call state the host
//! imports and the limits read.
//!
//! This is the only module with `unsafe`-adjacent work on guest memory; all
//! accesses go through wasmtime's bounds-checked `Memory::read`/`write` and
//! `data().get(..)`, so a guest's bad pointer is an error, never a panic.

use crate::host::GuestHost;
use crate::plugin::Target;
use crate::{Plugin, Runtime};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use wasmrpc_abi::protocol::{
    CallArgs, EXPORT_INPUT_BUFFER, EXPORT_MEMORY, ExportKind, Outcome, drop_export_name,
    export_name, unpack,
};
use wasmtime::{
    Engine, Instance, InstancePre, Memory, ResourceLimiter, Store, TypedFunc, UpdateDeadline,
};

/// What one call in progress needs from the host imports.
pub(crate) struct CallCtx {
    /// The worker's side of every request.
    pub(crate) host: Arc<dyn GuestHost>,
    /// The plugin being run (for `then` callbacks).
    pub(crate) plugin: Arc<Plugin>,
    /// The runtime (for `then` callbacks).
    pub(crate) runtime: Runtime,
    /// Locks the call holds; released when it ends.
    pub(crate) locks: Mutex<Vec<String>>,
    /// The calls waiting for this instance, which a wait of the guest may
    /// serve (a single-instance plugin's instance only).
    pub(crate) inbox: Option<Arc<crate::visit::Inbox>>,
    /// Set while the guest runs a visit: its requests go to the visitor's
    /// task (VIS-2).
    pub(crate) route: Option<tokio::sync::mpsc::UnboundedSender<crate::visit::Routed>>,
}

impl CallCtx {
    pub(crate) fn new(
        host: Arc<dyn GuestHost>,
        plugin: Arc<Plugin>,
        runtime: Runtime,
    ) -> Arc<Self> {
        Self::serving(host, plugin, runtime, None)
    }

    /// A call of an instance whose waits serve the calls waiting in
    /// `inbox` ([`crate::visit`]).
    pub(crate) fn serving(
        host: Arc<dyn GuestHost>,
        plugin: Arc<Plugin>,
        runtime: Runtime,
        inbox: Option<Arc<crate::visit::Inbox>>,
    ) -> Arc<Self> {
        Arc::new(CallCtx {
            host,
            plugin,
            runtime,
            locks: Mutex::new(Vec::new()),
            inbox,
            route: None,
        })
    }
}

/// Memory limits of one store; records when a guest hit them.
pub(crate) struct Limiter {
    max_memory: usize,
    denied: bool,
}

impl ResourceLimiter for Limiter {
    fn memory_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        if desired > self.max_memory {
            self.denied = true;
            return Err(wasmtime::Error::msg("memory limit exceeded"));
        }
        Ok(true)
    }

    fn table_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        Ok(desired <= 1 << 20)
    }
}

/// The data of every store.
pub(crate) struct StoreData {
    limiter: Limiter,
    /// The encoded reply of the last host call, until `take_reply`.
    pub(crate) reply: Vec<u8>,
    /// The call in progress.
    pub(crate) ctx: Option<Arc<CallCtx>>,
    call_start: Instant,
    /// Time the current call spent waiting on the host.
    pub(crate) host_time: Duration,
    time_limit: Option<Duration>,
    timed_out: bool,
    /// The panic message the guest reported before trapping.
    pub(crate) panic: Option<String>,
    /// WASI for component plugins: a context that grants nothing.
    pub(crate) wasi: crate::component::Wasi,
    /// The visits the guest is running, innermost last ([`crate::visit`]).
    pub(crate) visits: Vec<crate::visit::ActiveVisit>,
}

impl StoreData {
    /// Resets the per-call state before guest code runs for `ctx`.
    pub(crate) fn begin(&mut self, ctx: Option<Arc<CallCtx>>) {
        self.ctx = ctx;
        self.visits.clear();
        self.call_start = Instant::now();
        self.host_time = Duration::ZERO;
        self.timed_out = false;
        self.panic = None;
        self.limiter.denied = false;
    }

    /// What made guest code fail with `error`: a limit, a reported panic,
    /// or a trap.
    pub(crate) fn fault(&mut self, error: &wasmtime::Error) -> Fault {
        if self.timed_out {
            return Fault::Timeout(self.time_limit.unwrap_or_default());
        }
        if self.limiter.denied {
            return Fault::Memory(self.limiter.max_memory);
        }
        if let Some(panic) = self.panic.take() {
            return Fault::Trap(format!("guest panicked: {panic}"));
        }
        match error.downcast_ref::<wasmtime::Trap>() {
            Some(trap) => Fault::Trap(trap.to_string()),
            None => Fault::Trap(format!("{error:#}")),
        }
    }
}

/// A store with the runtime's limits: memory through the limiter, guest
/// time through epoch interruption (a busy guest yields at every tick).
pub(crate) fn new_store(
    engine: &Engine,
    max_memory: usize,
    time_limit: Option<Duration>,
) -> Store<StoreData> {
    let data = StoreData {
        limiter: Limiter {
            max_memory,
            denied: false,
        },
        reply: Vec::new(),
        ctx: None,
        call_start: Instant::now(),
        host_time: Duration::ZERO,
        time_limit,
        timed_out: false,
        panic: None,
        visits: Vec::new(),
        wasi: crate::component::Wasi::deny_all(),
    };
    let mut store = Store::new(engine, data);
    store.limiter(|d| &mut d.limiter);
    store.epoch_deadline_callback(|mut ctx| {
        let d = ctx.data_mut();
        match d.time_limit {
            Some(limit) if d.call_start.elapsed().saturating_sub(d.host_time) > limit => {
                d.timed_out = true;
                Err(wasmtime::Error::msg("guest time limit exceeded"))
            }
            // Yield at every tick, so a busy guest shares its thread.
            _ => Ok(UpdateDeadline::Yield(1)),
        }
    });
    store.set_epoch_deadline(1);
    store
}

/// How a call into an instance failed; the caller adds plugin and function.
#[derive(Debug)]
pub(crate) enum Fault {
    Trap(String),
    Timeout(Duration),
    Memory(usize),
    Abi(String),
}

impl Fault {
    pub(crate) fn into_error(self, plugin: &str, function: &str) -> crate::Error {
        let (plugin, function) = (plugin.to_owned(), function.to_owned());
        match self {
            Fault::Trap(message) => crate::Error::Trap {
                plugin,
                function,
                message,
            },
            Fault::Timeout(limit) => crate::Error::Timeout {
                plugin,
                function,
                limit_ms: limit.as_millis(),
            },
            Fault::Memory(limit) => crate::Error::MemoryLimit {
                plugin,
                function,
                limit,
            },
            Fault::Abi(message) => crate::Error::Abi {
                plugin,
                function,
                message,
            },
        }
    }
}

fn encode(args: &CallArgs) -> Result<Vec<u8>, Fault> {
    wasmrpc_abi::encode(args).map_err(|e| Fault::Abi(format!("cannot encode the arguments: {e}")))
}

/// Releases the locks a finished call still holds.
pub(crate) async fn release_locks(ctx: Option<Arc<CallCtx>>) {
    let Some(ctx) = ctx else { return };
    let held = std::mem::take(&mut *ctx.locks.lock().unwrap_or_else(|p| p.into_inner()));
    for key in held.iter().rev() {
        // The host may have released it already; nothing to add.
        let _ = ctx.host.unlock(key).await;
    }
}

/// A live core-module instance, ready to run any export of its plugin.
pub(crate) struct CoreWarm {
    store: Store<StoreData>,
    instance: Instance,
    memory: Memory,
    input_buffer: TypedFunc<u32, u32>,
    /// The guest's input buffer: address and length.
    input: Option<(u32, u32)>,
    exports: HashMap<String, TypedFunc<(u32, u32), u64>>,
}

impl CoreWarm {
    /// Instantiates `pre` in a new store with the given limits.
    pub(crate) async fn new(
        engine: &Engine,
        pre: &InstancePre<StoreData>,
        max_memory: usize,
        time_limit: Option<Duration>,
    ) -> wasmtime::Result<CoreWarm> {
        let mut store = new_store(engine, max_memory, time_limit);
        let instance = pre.instantiate_async(&mut store).await?;
        let memory = instance
            .get_memory(&mut store, EXPORT_MEMORY)
            .ok_or_else(|| {
                wasmtime::Error::msg(format!("the module exports no `{EXPORT_MEMORY}`"))
            })?;
        let input_buffer = instance
            .get_typed_func::<u32, u32>(&mut store, EXPORT_INPUT_BUFFER)
            .map_err(|e| wasmtime::Error::msg(format!("export `{EXPORT_INPUT_BUFFER}`: {e}")))?;
        Ok(CoreWarm {
            store,
            instance,
            memory,
            input_buffer,
            input: None,
            exports: HashMap::new(),
        })
    }

    /// Runs `target` with `args` (encoded into the input buffer) and
    /// returns the decoded outcome.
    pub(crate) async fn invoke(
        &mut self,
        ctx: Arc<CallCtx>,
        target: Target<'_>,
        args: &CallArgs,
    ) -> Result<Outcome, Fault> {
        let (export, object, input) = match target {
            Target::Function(name) => (
                export_name(ExportKind::Function, None, name),
                0,
                encode(args)?,
            ),
            Target::Constructor(class) => (
                export_name(ExportKind::Constructor, Some(class), class),
                0,
                encode(args)?,
            ),
            Target::Method {
                object,
                class,
                method,
            } => (
                export_name(ExportKind::Method, Some(class), method),
                object,
                encode(args)?,
            ),
            Target::Drop { object, class } => (drop_export_name(class), object, Vec::new()),
        };
        self.invoke_inner(ctx, &export, object, &input).await
    }

    /// The call in progress, if any (to release what it holds).
    pub(crate) fn take_ctx(&mut self) -> Option<Arc<CallCtx>> {
        self.store.data_mut().ctx.take()
    }

    async fn invoke_inner(
        &mut self,
        ctx: Arc<CallCtx>,
        export: &str,
        object: u32,
        input: &[u8],
    ) -> Result<Outcome, Fault> {
        self.store.data_mut().begin(Some(ctx));
        self.store.set_epoch_deadline(1);

        let len = u32::try_from(input.len())
            .map_err(|_| Fault::Abi("arguments larger than 4 GiB".to_owned()))?;
        let ptr = match self.input {
            Some((ptr, cap)) if cap >= len => ptr,
            _ => {
                let f = self.input_buffer.clone();
                let ptr = f
                    .call_async(&mut self.store, len)
                    .await
                    .map_err(|e| self.fault(&e))?;
                self.input = Some((ptr, len));
                ptr
            }
        };
        self.memory
            .write(&mut self.store, ptr as usize, input)
            .map_err(|_| Fault::Abi("the input buffer is out of bounds".to_owned()))?;

        let func = match self.exports.get(export) {
            Some(f) => f.clone(),
            None => {
                let f = self
                    .instance
                    .get_typed_func::<(u32, u32), u64>(&mut self.store, export)
                    .map_err(|e| Fault::Abi(format!("export `{export}`: {e}")))?;
                self.exports.insert(export.to_owned(), f.clone());
                f
            }
        };
        let packed = func
            .call_async(&mut self.store, (object, len))
            .await
            .map_err(|e| self.fault(&e))?;
        let (ptr, len) = unpack(packed);
        let bytes = (ptr as usize)
            .checked_add(len as usize)
            .and_then(|end| self.memory.data(&self.store).get(ptr as usize..end))
            .ok_or_else(|| Fault::Abi("the outcome is out of bounds".to_owned()))?;
        wasmrpc_abi::decode::<Outcome>(bytes)
            .map_err(|e| Fault::Abi(format!("the outcome does not decode: {e}")))
    }

    fn fault(&mut self, error: &wasmtime::Error) -> Fault {
        self.store.data_mut().fault(error)
    }
}
