//! Component plugins: plugins built as WebAssembly components against the
//! WIT world `guest-sdk/wit/plugin.wit` (Python plugins built with
//! componentize-py), beside the core modules of Rust plugins.
//!
//! A component is one more kind of code in a [`Plugin`](crate::Plugin): it
//! is loaded, cached, pooled and limited exactly like a core module, and
//! every request of its `host` imports becomes the
//! [`HostCall`] a Rust guest would have sent, answered by the same host
//! functions ([`crate::imports::dispatch`]). This module owns what differs:
//! the bindings of the world, the conversions between its types and
//! `wasmrpc_abi`'s, the WASI context that grants nothing, and a live
//! component instance ([`ComponentWarm`]).
//!
//! # What a component may reach
//!
//! componentize-py's runtime (CPython) imports WASI 0.2. The linker
//! provides it over a context that grants nothing: no preopened folders (no
//! files), no environment, no arguments, no stdin (stdout and stderr are
//! discarded), no sockets or name lookups (every address is refused), and a
//! wall clock frozen at the Unix epoch; the monotonic clock and random bytes
//! are real. Anything else a component imports fails to link.

use crate::instance::{CallCtx, Fault, StoreData, new_store};
use crate::plugin::Target;
use std::sync::Arc;
use std::time::{Duration, Instant};
use wasmrpc_abi::protocol::{self as abi, CallArgs, HostCall, HostReply, Outcome};
use wasmrpc_abi::{ErrorKind, RemoteError, Value, WorkerInfo};
use wasmtime::Engine;
use wasmtime::component::{HasSelf, InstancePre, Linker, ResourceTable};
use wasmtime_wasi::{HostWallClock, WasiCtx, WasiCtxView, WasiView};

/// The bindings of the world `wasmrpc:plugin/plugin`.
mod bindings {
    wasmtime::component::bindgen!({
        path: "../../guest-sdk/wit",
        world: "plugin",
        imports: { default: async },
        exports: { default: async },
    });
}

use bindings::exports::wasmrpc::plugin::guest;
use bindings::wasmrpc::plugin::{host, types};

/// The WASI state of a store: a context granting nothing, and its table.
pub(crate) struct Wasi {
    ctx: WasiCtx,
    table: ResourceTable,
}

/// A wall clock that always reads the Unix epoch: a plugin gets no time of
/// day (the monotonic clock is real, for measuring durations).
struct EpochClock;

impl HostWallClock for EpochClock {
    fn resolution(&self) -> Duration {
        Duration::from_secs(1)
    }
    fn now(&self) -> Duration {
        Duration::ZERO
    }
}

impl Wasi {
    /// A context with no files, environment, arguments, stdin, sockets or
    /// time of day.
    pub(crate) fn deny_all() -> Wasi {
        let mut builder = WasiCtx::builder();
        builder
            .allow_tcp(false)
            .allow_udp(false)
            .allow_ip_name_lookup(false)
            .socket_addr_check(|_, _| Box::pin(async { false }))
            .wall_clock(EpochClock);
        Wasi {
            ctx: builder.build(),
            table: ResourceTable::new(),
        }
    }
}

impl WasiView for StoreData {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi.ctx,
            table: &mut self.wasi.table,
        }
    }
}

/// The linker of component plugins: WASI 0.2 over [`Wasi::deny_all`], and
/// the world's `host` interface.
pub(crate) fn linker(engine: &Engine) -> wasmtime::Result<Linker<StoreData>> {
    let mut linker = Linker::new(engine);
    wasmtime_wasi::p2::add_to_linker_async(&mut linker)?;
    bindings::Plugin::add_to_linker::<StoreData, HasSelf<StoreData>>(&mut linker, |d| d)?;
    Ok(linker)
}

/// Whether `bytes` start like a component (rather than a core module).
pub(crate) fn is_component(bytes: &[u8]) -> bool {
    bytes.get(..8) == Some(b"\0asm\x0d\0\x01\0".as_slice())
}

/// A live component instance, ready to run any export of its plugin.
pub(crate) struct ComponentWarm {
    store: wasmtime::Store<StoreData>,
    plugin: bindings::Plugin,
}

impl ComponentWarm {
    /// Instantiates `pre` in a new store with the given limits.
    pub(crate) async fn new(
        engine: &Engine,
        pre: &InstancePre<StoreData>,
        max_memory: usize,
        time_limit: Option<Duration>,
    ) -> wasmtime::Result<ComponentWarm> {
        let mut store = new_store(engine, max_memory, time_limit);
        let instance = pre.instantiate_async(&mut store).await?;
        let plugin = bindings::Plugin::new(&mut store, &instance)?;
        Ok(ComponentWarm { store, plugin })
    }

    /// The manifest the component describes itself with.
    pub(crate) async fn describe(&mut self) -> Result<Vec<wasmrpc_abi::manifest::Export>, Fault> {
        self.store.data_mut().begin(None);
        self.store.set_epoch_deadline(1);
        let guest = self.plugin.wasmrpc_plugin_guest();
        match guest.call_describe(&mut self.store).await {
            Ok(m) => Ok(manifest_exports(m)),
            Err(e) => Err(self.store.data_mut().fault(&e)),
        }
    }

    /// Runs `target` with `args` and returns its outcome.
    pub(crate) async fn invoke(
        &mut self,
        ctx: Arc<CallCtx>,
        target: Target<'_>,
        args: &CallArgs,
    ) -> Result<Outcome, Fault> {
        self.store.data_mut().begin(Some(ctx));
        self.store.set_epoch_deadline(1);
        let guest = self.plugin.wasmrpc_plugin_guest();
        let store = &mut self.store;
        let result = match target {
            Target::Function(name) | Target::Constructor(name) => guest
                .call_call(&mut *store, name, &call_args_to_wit(args))
                .await
                .map(Some),
            Target::Method {
                object,
                class,
                method,
            } => guest
                .call_call_method(&mut *store, object, class, method, &call_args_to_wit(args))
                .await
                .map(Some),
            Target::Drop { object, class } => guest
                .call_drop_object(&mut *store, object, class)
                .await
                .map(|()| None),
        };
        match result {
            Ok(Some(outcome)) => outcome_from_wit(outcome).map_err(Fault::Abi),
            Ok(None) => Ok(Outcome::Return(Value::None)),
            Err(e) => Err(self.store.data_mut().fault(&e)),
        }
    }

    /// The call in progress, if any (to release what it holds).
    pub(crate) fn take_ctx(&mut self) -> Option<Arc<CallCtx>> {
        self.store.data_mut().ctx.take()
    }
}

// ---- the `host` interface: each function is one `HostCall` ---------------

impl types::Host for StoreData {}

impl StoreData {
    /// Runs `call` through the same host functions as a core guest's
    /// request, counting the time as host time.
    async fn request(&mut self, call: HostCall) -> Result<HostReply, types::RemoteError> {
        let Some(ctx) = self.ctx.clone() else {
            return Err(error_to_wit(RemoteError::new(
                ErrorKind::RuntimeError,
                "a host request outside a call (from the plugin's start-up code)",
            )));
        };
        let start = Instant::now();
        let reply = crate::imports::dispatch(&ctx, call).await;
        self.host_time += start.elapsed();
        reply.map_err(error_to_wit)
    }
}

type R<T> = Result<T, types::RemoteError>;

fn unexpected(reply: HostReply) -> types::RemoteError {
    error_to_wit(RemoteError::new(
        ErrorKind::RuntimeError,
        format!("the host replied {reply:?} where the plugin expected something else"),
    ))
}

fn value_reply(reply: HostReply) -> R<types::Value> {
    match reply {
        HostReply::Value(v) => Ok(value_to_wit(&v)),
        other => Err(unexpected(other)),
    }
}

fn handle_reply(reply: HostReply) -> R<u32> {
    match reply {
        HostReply::Handle(h) => Ok(h),
        other => Err(unexpected(other)),
    }
}

fn unit_reply(reply: HostReply) -> R<()> {
    match reply {
        HostReply::Unit => Ok(()),
        other => Err(unexpected(other)),
    }
}

fn bool_reply(reply: HostReply) -> R<bool> {
    match reply {
        HostReply::Bool(b) => Ok(b),
        other => Err(unexpected(other)),
    }
}

fn worker_reply(reply: HostReply) -> R<types::WorkerInfo> {
    match reply {
        HostReply::Worker(w) => Ok(types::WorkerInfo {
            id: w.id,
            name: w.name,
        }),
        other => Err(unexpected(other)),
    }
}

/// A guest's value or arguments that do not form a tree.
fn bad_value(e: String) -> types::RemoteError {
    error_to_wit(RemoteError::new(ErrorKind::ValueError, e))
}

impl host::Host for StoreData {
    async fn op(&mut self, name: String, args: types::CallArgs) -> R<types::Value> {
        let args = call_args_from_wit(args).map_err(bad_value)?;
        value_reply(self.request(HostCall::Op { name, args }).await?)
    }

    async fn tensor_new(&mut self, dtype: types::Dtype, shape: Vec<i64>, data: Vec<u8>) -> R<u32> {
        let dtype = dtype_from_wit(dtype);
        handle_reply(
            self.request(HostCall::TensorNew { dtype, shape, data })
                .await?,
        )
    }

    async fn tensor_info(&mut self, tensor: u32) -> R<types::TensorMeta> {
        match self.request(HostCall::TensorMeta(tensor)).await? {
            HostReply::Meta(m) => Ok(meta_to_wit(m)),
            other => Err(unexpected(other)),
        }
    }

    async fn tensor_read(&mut self, tensor: u32) -> R<(types::TensorMeta, Vec<u8>)> {
        match self.request(HostCall::TensorData(tensor)).await? {
            HostReply::Data(m, data) => Ok((meta_to_wit(m), data)),
            other => Err(unexpected(other)),
        }
    }

    async fn dup(&mut self, kind: types::HandleKind, handle: u32) -> R<u32> {
        handle_reply(
            self.request(HostCall::Dup(kind_from_wit(kind), handle))
                .await?,
        )
    }

    async fn drop_handle(&mut self, kind: types::HandleKind, handle: u32) -> R<()> {
        unit_reply(
            self.request(HostCall::Drop(kind_from_wit(kind), handle))
                .await?,
        )
    }

    async fn rpc_sync(
        &mut self,
        to: String,
        function: String,
        args: types::CallArgs,
        timeout: Option<f64>,
    ) -> R<types::Value> {
        let args = call_args_from_wit(args).map_err(bad_value)?;
        let call = HostCall::Rpc {
            mode: abi::RpcMode::Sync,
            to,
            function,
            args,
            timeout,
        };
        value_reply(self.request(call).await?)
    }

    async fn rpc_handle(
        &mut self,
        mode: types::RpcMode,
        to: String,
        function: String,
        args: types::CallArgs,
        timeout: Option<f64>,
    ) -> R<u32> {
        let args = call_args_from_wit(args).map_err(bad_value)?;
        let call = HostCall::Rpc {
            mode: mode_from_wit(mode),
            to,
            function,
            args,
            timeout,
        };
        handle_reply(self.request(call).await?)
    }

    async fn rref_to_here(&mut self, rref: u32) -> R<types::Value> {
        value_reply(self.request(HostCall::RRefToHere(rref)).await?)
    }

    async fn rref_owner(&mut self, rref: u32) -> R<types::WorkerInfo> {
        worker_reply(self.request(HostCall::RRefOwner(rref)).await?)
    }

    async fn rref_new(&mut self, value: types::Value) -> R<u32> {
        let value = value_from_wit(&value).map_err(bad_value)?;
        handle_reply(self.request(HostCall::RRefNew(value)).await?)
    }

    async fn rref_call_sync(
        &mut self,
        rref: u32,
        method: String,
        args: types::CallArgs,
        timeout: Option<f64>,
    ) -> R<types::Value> {
        let args = call_args_from_wit(args).map_err(bad_value)?;
        let call = HostCall::RRefProxyCall {
            rref,
            mode: abi::RpcMode::Sync,
            method,
            args,
            timeout,
        };
        value_reply(self.request(call).await?)
    }

    async fn rref_call_handle(
        &mut self,
        rref: u32,
        mode: types::RpcMode,
        method: String,
        args: types::CallArgs,
        timeout: Option<f64>,
    ) -> R<u32> {
        let args = call_args_from_wit(args).map_err(bad_value)?;
        let call = HostCall::RRefProxyCall {
            rref,
            mode: mode_from_wit(mode),
            method,
            args,
            timeout,
        };
        handle_reply(self.request(call).await?)
    }

    async fn rref_is_owner(&mut self, rref: u32) -> R<bool> {
        bool_reply(self.request(HostCall::RRefIsOwner(rref)).await?)
    }

    async fn rref_confirmed(&mut self, rref: u32) -> R<bool> {
        bool_reply(self.request(HostCall::RRefConfirmed(rref)).await?)
    }

    async fn future_new(&mut self) -> R<u32> {
        handle_reply(self.request(HostCall::FutureNew).await?)
    }

    async fn future_set(
        &mut self,
        fut: u32,
        outcome: Result<types::Value, types::RemoteError>,
    ) -> R<()> {
        let result = match outcome {
            Ok(v) => Ok(value_from_wit(&v).map_err(bad_value)?),
            Err(e) => Err(error_from_wit(e)),
        };
        unit_reply(
            self.request(HostCall::FutureSet {
                future: fut,
                result,
            })
            .await?,
        )
    }

    async fn future_wait(&mut self, fut: u32) -> R<types::Value> {
        value_reply(self.request(HostCall::FutureWait(fut)).await?)
    }

    async fn future_done(&mut self, fut: u32) -> R<bool> {
        bool_reply(self.request(HostCall::FutureDone(fut)).await?)
    }

    async fn future_then(
        &mut self,
        fut: u32,
        function: String,
        extra: Vec<types::Value>,
    ) -> R<u32> {
        let extra = extra
            .iter()
            .map(value_from_wit)
            .collect::<Result<Vec<_>, _>>()
            .map_err(bad_value)?;
        let call = HostCall::FutureThen {
            future: fut,
            function,
            extra,
        };
        handle_reply(self.request(call).await?)
    }

    async fn future_shared(&mut self, key: String, take: bool) -> R<u32> {
        handle_reply(self.request(HostCall::FutureShared { key, take }).await?)
    }

    async fn progress(&mut self, bar: String, position: u64, total: u64, message: String) -> R<()> {
        let report = abi::Progress {
            bar,
            position,
            total,
            message,
        };
        unit_reply(self.request(HostCall::Progress(report)).await?)
    }

    async fn record_function_enter(&mut self, name: String) -> R<u32> {
        handle_reply(self.request(HostCall::RecordFunctionEnter(name)).await?)
    }

    async fn record_function_exit(&mut self, range: u32) -> R<()> {
        unit_reply(self.request(HostCall::RecordFunctionExit(range)).await?)
    }

    async fn get_worker_info(&mut self, name: Option<String>) -> R<types::WorkerInfo> {
        worker_reply(self.request(HostCall::WorkerInfo(name)).await?)
    }

    async fn global_get(&mut self, key: String) -> R<types::Value> {
        value_reply(self.request(HostCall::GlobalGet(key)).await?)
    }

    async fn global_set(&mut self, key: String, value: types::Value) -> R<()> {
        let value = value_from_wit(&value).map_err(bad_value)?;
        unit_reply(self.request(HostCall::GlobalSet(key, value)).await?)
    }

    async fn lock(&mut self, key: String) -> R<()> {
        unit_reply(self.request(HostCall::Lock(key)).await?)
    }

    async fn unlock(&mut self, key: String) -> R<()> {
        unit_reply(self.request(HostCall::Unlock(key)).await?)
    }

    async fn sleep(&mut self, seconds: f64) -> R<()> {
        unit_reply(self.request(HostCall::Sleep(seconds)).await?)
    }

    async fn log(&mut self, level: types::LogLevel, message: String) -> R<()> {
        let level = match level {
            types::LogLevel::Error => abi::LogLevel::Error,
            types::LogLevel::Warn => abi::LogLevel::Warn,
            types::LogLevel::Info => abi::LogLevel::Info,
            types::LogLevel::Debug => abi::LogLevel::Debug,
        };
        unit_reply(self.request(HostCall::Log(level, message)).await?)
    }

    async fn autograd(&mut self, call: types::AutogradCall) -> R<types::Value> {
        use types::AutogradCall as W;
        let call = match call {
            W::SetRequiresGrad((t, flag)) => abi::AutogradCall::SetRequiresGrad(t, flag),
            W::Grad(t) => abi::AutogradCall::Grad(t),
            W::Backward(t) => abi::AutogradCall::Backward(t),
            W::SetGradEnabled(flag) => abi::AutogradCall::SetGradEnabled(flag),
            W::Identity(t) => abi::AutogradCall::Identity(t),
            W::ContextNew => abi::AutogradCall::ContextNew,
            W::ContextRelease(id) => abi::AutogradCall::ContextRelease(id),
            W::CurrentContext => abi::AutogradCall::CurrentContext,
            W::DistBackward((context_id, roots, retain_graph)) => abi::AutogradCall::DistBackward {
                context_id,
                roots,
                retain_graph,
            },
            W::GetGradients(id) => abi::AutogradCall::GetGradients(id),
            W::OptimizerNew((config, params)) => abi::AutogradCall::OptimizerNew {
                config: value_from_wit(&config).map_err(bad_value)?,
                params,
            },
            W::OptimizerStep((optimizer, context_id)) => abi::AutogradCall::OptimizerStep {
                optimizer,
                context_id,
            },
            W::OptimizerDrop(id) => abi::AutogradCall::OptimizerDrop(id),
        };
        value_reply(self.request(HostCall::Autograd(call)).await?)
    }
}

// ---- conversions between the world's types and `wasmrpc_abi`'s -----------

/// Flattens `value` into nodes, root first.
pub(crate) fn value_to_wit(value: &Value) -> types::Value {
    let mut nodes = Vec::new();
    push_node(value, &mut nodes);
    nodes
}

/// Appends `value`'s node (and, after it, its children's) and returns its
/// index.
fn push_node(value: &Value, nodes: &mut Vec<types::Node>) -> u32 {
    use types::Node as N;
    let at = nodes.len();
    nodes.push(N::None);
    let node = match value {
        Value::None => N::None,
        Value::Bool(b) => N::Boolean(*b),
        Value::Int(i) => N::Int(*i),
        Value::Float(f) => N::Float(*f),
        Value::Str(s) => N::Str(s.clone()),
        Value::Bytes(b) => N::Bytes(b.clone()),
        Value::List(items) => N::List(items.iter().map(|v| push_node(v, nodes)).collect()),
        Value::Tuple(items) => N::Tuple(items.iter().map(|v| push_node(v, nodes)).collect()),
        Value::Dict(items) => N::Dict(
            items
                .iter()
                .map(|(k, v)| (push_node(k, nodes), push_node(v, nodes)))
                .collect(),
        ),
        Value::Record { name, fields } => N::Record(types::RecordNode {
            name: name.clone(),
            fields: fields
                .iter()
                .map(|(k, v)| (k.clone(), push_node(v, nodes)))
                .collect(),
        }),
        Value::WorkerInfo(w) => N::Worker(types::WorkerInfo {
            id: w.id,
            name: w.name.clone(),
        }),
        Value::Tensor(h) => N::Tensor(*h),
        Value::RRef(h) => N::Rref(*h),
    };
    nodes[at] = node;
    // A value has far fewer than 4G nodes: its encoding would not fit.
    u32::try_from(at).unwrap_or(u32::MAX)
}

/// Rebuilds a value from its nodes. Children must come after their parent
/// (so the nodes form a tree, never a cycle) and nesting is limited as
/// decoding limits it.
pub(crate) fn value_from_wit(nodes: &types::Value) -> Result<Value, String> {
    if nodes.is_empty() {
        return Err("a value with no nodes".to_owned());
    }
    node(nodes, 0, 0)
}

fn node(nodes: &[types::Node], at: usize, depth: usize) -> Result<Value, String> {
    use types::Node as N;
    if depth > wasmrpc_abi::MAX_VALUE_DEPTH {
        return Err(format!(
            "a value nested deeper than {} levels",
            wasmrpc_abi::MAX_VALUE_DEPTH
        ));
    }
    let child = |i: u32| -> Result<Value, String> {
        let i = i as usize;
        if i <= at || i >= nodes.len() {
            return Err(format!("node {at} names node {i}, not a later node"));
        }
        node(nodes, i, depth + 1)
    };
    Ok(match &nodes[at] {
        N::None => Value::None,
        N::Boolean(b) => Value::Bool(*b),
        N::Int(i) => Value::Int(*i),
        N::Float(f) => Value::Float(*f),
        N::Str(s) => Value::Str(s.clone()),
        N::Bytes(b) => Value::Bytes(b.clone()),
        N::List(items) => Value::List(items.iter().map(|&i| child(i)).collect::<Result<_, _>>()?),
        N::Tuple(items) => Value::Tuple(items.iter().map(|&i| child(i)).collect::<Result<_, _>>()?),
        N::Dict(items) => Value::Dict(
            items
                .iter()
                .map(|&(k, v)| Ok((child(k)?, child(v)?)))
                .collect::<Result<_, String>>()?,
        ),
        N::Record(r) => Value::Record {
            name: r.name.clone(),
            fields: r
                .fields
                .iter()
                .map(|(k, v)| Ok((k.clone(), child(*v)?)))
                .collect::<Result<_, String>>()?,
        },
        N::Worker(w) => Value::WorkerInfo(WorkerInfo {
            id: w.id,
            name: w.name.clone(),
        }),
        N::Tensor(h) => Value::Tensor(*h),
        N::Rref(h) => Value::RRef(*h),
    })
}

fn call_args_to_wit(args: &CallArgs) -> types::CallArgs {
    types::CallArgs {
        args: args.args.iter().map(value_to_wit).collect(),
        kwargs: args
            .kwargs
            .iter()
            .map(|(k, v)| (k.clone(), value_to_wit(v)))
            .collect(),
    }
}

fn call_args_from_wit(args: types::CallArgs) -> Result<CallArgs, String> {
    Ok(CallArgs {
        args: args
            .args
            .iter()
            .map(value_from_wit)
            .collect::<Result<_, _>>()?,
        kwargs: args
            .kwargs
            .iter()
            .map(|(k, v)| Ok((k.clone(), value_from_wit(v)?)))
            .collect::<Result<_, String>>()?,
    })
}

const KINDS: [(types::ErrorKind, ErrorKind); 10] = [
    (types::ErrorKind::RuntimeError, ErrorKind::RuntimeError),
    (types::ErrorKind::ValueError, ErrorKind::ValueError),
    (types::ErrorKind::TypeError, ErrorKind::TypeError),
    (types::ErrorKind::TimeoutError, ErrorKind::TimeoutError),
    (types::ErrorKind::KeyError, ErrorKind::KeyError),
    (types::ErrorKind::IndexError, ErrorKind::IndexError),
    (types::ErrorKind::AttributeError, ErrorKind::AttributeError),
    (
        types::ErrorKind::NotImplementedError,
        ErrorKind::NotImplementedError,
    ),
    (types::ErrorKind::AssertionError, ErrorKind::AssertionError),
    (
        types::ErrorKind::ConnectionError,
        ErrorKind::ConnectionError,
    ),
];

fn error_to_wit(e: RemoteError) -> types::RemoteError {
    let kind = KINDS
        .iter()
        .find(|(_, k)| *k == e.kind)
        .map_or(types::ErrorKind::RuntimeError, |(w, _)| *w);
    types::RemoteError {
        kind,
        message: e.message,
    }
}

fn error_from_wit(e: types::RemoteError) -> RemoteError {
    let kind = KINDS
        .iter()
        .find(|(w, _)| *w == e.kind)
        .map_or(ErrorKind::RuntimeError, |(_, k)| *k);
    RemoteError::new(kind, e.message)
}

const DTYPES: [(types::Dtype, abi::DType); 10] = [
    (types::Dtype::Float32, abi::DType::Float32),
    (types::Dtype::Float64, abi::DType::Float64),
    (types::Dtype::Float16, abi::DType::Float16),
    (types::Dtype::Bfloat16, abi::DType::BFloat16),
    (types::Dtype::Int64, abi::DType::Int64),
    (types::Dtype::Int32, abi::DType::Int32),
    (types::Dtype::Int16, abi::DType::Int16),
    (types::Dtype::Int8, abi::DType::Int8),
    (types::Dtype::Uint8, abi::DType::UInt8),
    (types::Dtype::Boolean, abi::DType::Bool),
];

fn dtype_from_wit(d: types::Dtype) -> abi::DType {
    DTYPES
        .iter()
        .find(|(w, _)| *w == d)
        .map_or(abi::DType::Float32, |(_, a)| *a)
}

fn meta_to_wit(m: abi::TensorMeta) -> types::TensorMeta {
    let dtype = DTYPES
        .iter()
        .find(|(_, a)| *a == m.dtype)
        .map_or(types::Dtype::Float32, |(w, _)| *w);
    types::TensorMeta {
        dtype,
        shape: m.shape,
        requires_grad: m.requires_grad,
    }
}

fn kind_from_wit(k: types::HandleKind) -> abi::HandleKind {
    match k {
        types::HandleKind::Tensor => abi::HandleKind::Tensor,
        types::HandleKind::Rref => abi::HandleKind::RRef,
        types::HandleKind::Future => abi::HandleKind::Future,
    }
}

fn mode_from_wit(m: types::RpcMode) -> abi::RpcMode {
    match m {
        types::RpcMode::Sync => abi::RpcMode::Sync,
        types::RpcMode::Async => abi::RpcMode::Async,
        types::RpcMode::Remote => abi::RpcMode::Remote,
    }
}

fn outcome_from_wit(o: guest::Outcome) -> Result<Outcome, String> {
    Ok(match o {
        guest::Outcome::Returned(v) => Outcome::Return(value_from_wit(&v)?),
        guest::Outcome::Raised(e) => Outcome::Raise(error_from_wit(e)),
        guest::Outcome::Future(f) => Outcome::Future(f),
        guest::Outcome::Object(id) => Outcome::Object(id),
    })
}

fn manifest_exports(m: guest::Manifest) -> Vec<wasmrpc_abi::manifest::Export> {
    m.exports
        .into_iter()
        .map(|e| wasmrpc_abi::manifest::Export {
            name: e.name,
            kind: match e.kind {
                guest::ExportKind::Function => abi::ExportKind::Function,
                guest::ExportKind::AsyncFunction => abi::ExportKind::AsyncFunction,
                guest::ExportKind::Constructor => abi::ExportKind::Constructor,
                guest::ExportKind::Method => abi::ExportKind::Method,
                guest::ExportKind::AsyncMethod => abi::ExportKind::AsyncMethod,
            },
            class: e.class,
            params: e.params,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_round_trip_through_nodes() {
        let v = Value::Tuple(vec![
            Value::Int(1),
            Value::List(vec![Value::Str("a".into()), Value::Tensor(3)]),
            Value::Dict(vec![(Value::Str("k".into()), Value::RRef(2))]),
            Value::Record {
                name: "P".into(),
                fields: vec![("x".into(), Value::Float(0.5))],
            },
            Value::WorkerInfo(WorkerInfo {
                id: 1,
                name: "worker1".into(),
            }),
            Value::None,
            Value::Bytes(vec![1, 2]),
            Value::Bool(true),
        ]);
        assert_eq!(value_from_wit(&value_to_wit(&v)), Ok(v));
    }

    #[test]
    fn nodes_that_are_not_a_tree_are_refused() {
        use types::Node as N;
        assert!(value_from_wit(&vec![]).is_err());
        // A list naming itself, and one naming an earlier node.
        assert!(value_from_wit(&vec![N::List(vec![0])]).is_err());
        assert!(value_from_wit(&vec![N::Int(1), N::List(vec![0])]).is_ok());
        assert!(value_from_wit(&vec![N::List(vec![1]), N::List(vec![0])]).is_err());
        // Past the end.
        assert!(value_from_wit(&vec![N::Tuple(vec![5])]).is_err());
        // Too deep.
        let deep: Vec<N> = (0..200u32)
            .map(|i| N::List(vec![i + 1]))
            .chain([N::None])
            .collect();
        assert!(value_from_wit(&deep).unwrap_err().contains("deeper"));
    }

    #[test]
    fn every_error_kind_maps_both_ways() {
        for kind in ErrorKind::ALL {
            let e = RemoteError::new(kind, "m");
            assert_eq!(error_from_wit(error_to_wit(e.clone())), e);
        }
    }
}

#[cfg(test)]
mod python_component {
    /// What componentize-py's runtime (CPython) imports: WASI 0.2's io,
    /// clocks, random, cli, filesystem and sockets (linked over a context
    /// that grants nothing), and the plugin world. Anything new here must
    /// be looked at before the linker grants it.
    #[test]
    fn a_python_component_imports_only_wasi_and_the_plugin_world() {
        let engine = wasmtime::Engine::default();
        let bytes = std::fs::read(wasmrpc_plugins::SEED_FNS_PY).expect("the Python plugin");
        let component = wasmtime::component::Component::new(&engine, &bytes).expect("compiles");
        let allowed = [
            "wasi:io/",
            "wasi:clocks/monotonic-clock@",
            "wasi:clocks/wall-clock@",
            "wasi:random/",
            "wasi:cli/",
            "wasi:filesystem/",
            "wasi:sockets/",
            "wasmrpc:plugin/types@",
            "wasmrpc:plugin/host@",
        ];
        let imports: Vec<String> = component
            .component_type()
            .imports(&engine)
            .map(|(name, _)| name.to_owned())
            .collect();
        assert!(
            imports
                .iter()
                .any(|i| i.starts_with("wasmrpc:plugin/host@"))
        );
        for import in &imports {
            assert!(
                allowed.iter().any(|a| import.starts_with(a)),
                "the Python component imports {import}"
            );
        }
    }
}
