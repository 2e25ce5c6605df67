//! The guest-host protocol: the names of the wasm imports and exports, and
//! the requests a guest sends through them.
//!
//! This module owns the calling convention between a plugin and the host's
//! wasm runtime. It leaves what a request *does* to the host (the runtime in
//! `wasmrpc-wasm` and the agent behind it) and the safe guest API to
//! `wasmrpc-guest`.
//!
//! # Calling convention
//!
//! - **Host to guest.** For each call the host writes an encoded [`CallArgs`]
//!   into the guest's input buffer (found with [`EXPORT_INPUT_BUFFER`]) and
//!   calls the function's export (see [`export_name`]) with the length, plus
//!   the object id for a method. The export returns a packed `(ptr, len)`
//!   ([`pack`]) of an encoded [`Outcome`] in guest memory, valid until the
//!   next call into the instance.
//! - **Guest to host.** The guest encodes a [`HostCall`] and calls the import
//!   [`IMPORT_CALL`] with its pointer and length. The host runs it (possibly
//!   waiting on the network: the import is async on the host, so a waiting
//!   guest holds no thread) and keeps the encoded `Result<HostReply,
//!   RemoteError>`; the import returns its length. The guest allocates that
//!   many bytes and calls [`IMPORT_TAKE_REPLY`] to have the host copy it in.

use crate::{RemoteError, Value, WorkerInfo};
use alloc::string::String;
use alloc::vec::Vec;
use serde::{Deserialize, Serialize};

/// The wasm import module every host function lives in.
pub const IMPORT_MODULE: &str = "wasmrpc";
/// Import `call(ptr: i32, len: i32) -> i32`: run the encoded [`HostCall`]
/// at `ptr..ptr+len`; returns the length of the encoded reply.
pub const IMPORT_CALL: &str = "call";
/// Import `take_reply(ptr: i32)`: copy the pending reply of the last
/// [`IMPORT_CALL`] to `ptr` (which must have room for its length).
pub const IMPORT_TAKE_REPLY: &str = "take_reply";

/// Export `wasmrpc_input_buffer(len: i32) -> i32`: make the guest's input
/// buffer at least `len` bytes long and return its address. The address stays
/// valid until the next call of this export with a larger `len`.
pub const EXPORT_INPUT_BUFFER: &str = "wasmrpc_input_buffer";
/// The guest's exported linear memory.
pub const EXPORT_MEMORY: &str = "memory";

/// The name of the wasm custom section holding the plugin manifest.
pub const MANIFEST_SECTION: &str = "wasmrpc-manifest";

/// The version of this protocol; a plugin built against another version is
/// refused at load time.
pub const ABI_VERSION: u32 = 1;

/// What kind of export a manifest entry describes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ExportKind {
    /// A stateless function: returns its result.
    Function,
    /// An `@async_execution` function: returns a future handle, and the call
    /// completes when that future does.
    AsyncFunction,
    /// The constructor of a class: creates an object, returns its id.
    Constructor,
    /// A method of a class, called on an object.
    Method,
    /// An `@async_execution` method: returns a future handle, and the call
    /// completes when that future does.
    AsyncMethod,
}

/// The wasm export name of an entry.
///
/// Functions are `wasmrpc:fn:NAME`, constructors `wasmrpc:new:CLASS`,
/// methods `wasmrpc:method:CLASS.NAME`, and every class also exports its
/// destructor `wasmrpc:drop:CLASS`.
pub fn export_name(kind: ExportKind, class: Option<&str>, name: &str) -> String {
    let class = class.unwrap_or("");
    match kind {
        ExportKind::Function | ExportKind::AsyncFunction => alloc::format!("wasmrpc:fn:{name}"),
        ExportKind::Constructor => alloc::format!("wasmrpc:new:{class}"),
        ExportKind::Method | ExportKind::AsyncMethod => {
            alloc::format!("wasmrpc:method:{class}.{name}")
        }
    }
}

/// The export that drops an object of `class`.
///
/// Every export has the signature `(object: i32, len: i32) -> i64`: `object`
/// is the object id for methods and destructors (0 otherwise), `len` the
/// length of the encoded [`CallArgs`] in the input buffer (0 for
/// destructors), and the result a packed `(ptr, len)` of an encoded
/// [`Outcome`].
pub fn drop_export_name(class: &str) -> String {
    alloc::format!("wasmrpc:drop:{class}")
}

/// Packs a guest `(ptr, len)` into the `i64` an export returns.
pub fn pack(ptr: u32, len: u32) -> u64 {
    (u64::from(ptr) << 32) | u64::from(len)
}

/// Splits a value made by [`pack`] into `(ptr, len)`.
pub fn unpack(packed: u64) -> (u32, u32) {
    // Truncation is the point: the high and low halves.
    ((packed >> 32) as u32, packed as u32)
}

/// The arguments of one call: positional, then keyword arguments.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CallArgs {
    /// Positional arguments, in order.
    pub args: Vec<Value>,
    /// Keyword arguments, by parameter name.
    pub kwargs: Vec<(String, Value)>,
}

/// What a guest export returns.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Outcome {
    /// The call returned a value. Handles in it now belong to the host.
    Return(Value),
    /// The call raised an error (a typed Python exception).
    Raise(RemoteError),
    /// An `@async_execution` call returned this future handle; the call
    /// completes when it does. The handle now belongs to the host.
    Future(u32),
    /// A constructor created the object with this id in its instance.
    Object(u32),
}

/// The element type of a tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum DType {
    /// `torch.float32`.
    Float32,
    /// `torch.float64`.
    Float64,
    /// `torch.float16`.
    Float16,
    /// `torch.bfloat16`.
    BFloat16,
    /// `torch.int64`.
    Int64,
    /// `torch.int32`.
    Int32,
    /// `torch.int16`.
    Int16,
    /// `torch.int8`.
    Int8,
    /// `torch.uint8`.
    UInt8,
    /// `torch.bool`.
    Bool,
}

impl DType {
    /// The size of one element in bytes.
    pub fn size(self) -> usize {
        match self {
            DType::Float64 | DType::Int64 => 8,
            DType::Float32 | DType::Int32 => 4,
            DType::Float16 | DType::BFloat16 | DType::Int16 => 2,
            DType::Int8 | DType::UInt8 | DType::Bool => 1,
        }
    }
}

/// A tensor's type and shape.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorMeta {
    /// The element type.
    pub dtype: DType,
    /// The sizes of each dimension.
    pub shape: Vec<i64>,
    /// Whether autograd records operations on it.
    pub requires_grad: bool,
}

/// Which table a handle indexes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum HandleKind {
    /// A tensor ([`Value::Tensor`]).
    Tensor,
    /// An RRef ([`Value::RRef`]).
    RRef,
    /// A future.
    Future,
}

/// How an RPC is made from inside a guest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum RpcMode {
    /// `rpc_sync`: wait for the result.
    Sync,
    /// `rpc_async`: return a future handle at once.
    Async,
    /// `remote`: return an RRef handle at once.
    Remote,
}

/// A progress report ([`HostCall::Progress`]): `position` of `total` steps
/// of the task `bar` (e.g. `"epoch"`, `"batch"`) are done. The worker turns
/// it into a structured log event; `wasmrpc launch` draws one progress bar
/// per worker and `bar` from them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Progress {
    /// The task's name; one bar per name and worker.
    pub bar: String,
    /// Steps done.
    pub position: u64,
    /// Steps in all (0: unknown).
    pub total: u64,
    /// A short status, e.g. the last loss.
    pub message: String,
}

/// Log levels of [`HostCall::Log`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum LogLevel {
    /// Errors.
    Error,
    /// Warnings.
    Warn,
    /// Information, e.g. a seed's `print`.
    Info,
    /// Debugging detail.
    Debug,
}

/// A request from a guest to the host.
///
/// **Requests borrow, outcomes move.** Every handle a request names or
/// carries inside a value stays the guest's (only [`HostCall::Drop`]
/// releases one); a host that keeps such a value (a global, a future's
/// result, an RRef) resolves the handles to the objects first. Handles the
/// host sends back (in replies and call arguments) are new and owned by the
/// guest; handles in an [`Outcome`] move to the host.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum HostCall {
    /// Run an aten op by its schema name (`"aten::add"`) on values that may
    /// hold tensor handles. Replies [`HostReply::Value`].
    Op {
        /// The schema name, e.g. `aten::add`.
        name: String,
        /// Positional and keyword arguments.
        args: CallArgs,
    },
    /// Create a tensor from raw little-endian bytes. Replies
    /// [`HostReply::Handle`].
    TensorNew {
        /// The element type.
        dtype: DType,
        /// The shape; the product of its sizes times the element size must
        /// equal `data.len()`.
        shape: Vec<i64>,
        /// The elements, contiguous, little-endian.
        #[serde(with = "crate::raw_bytes")]
        data: Vec<u8>,
    },
    /// Read a tensor's type and shape. Replies [`HostReply::Meta`].
    TensorMeta(u32),
    /// Read a tensor's elements, contiguous and little-endian. Replies
    /// [`HostReply::Data`].
    TensorData(u32),
    /// Make a second handle to the same object. Replies
    /// [`HostReply::Handle`].
    Dup(HandleKind, u32),
    /// Release a handle. Replies [`HostReply::Unit`].
    Drop(HandleKind, u32),
    /// Call `function` on worker `to` (an aten op name or a plugin function
    /// name). Replies [`HostReply::Value`] for [`RpcMode::Sync`], a future
    /// [`HostReply::Handle`] for [`RpcMode::Async`] and an RRef
    /// [`HostReply::Handle`] for [`RpcMode::Remote`].
    Rpc {
        /// The mode of the call.
        mode: RpcMode,
        /// The destination worker's name.
        to: String,
        /// The function's registered name.
        function: String,
        /// Its arguments.
        args: CallArgs,
        /// A timeout in seconds; `None` for the agent's default.
        timeout: Option<f64>,
    },
    /// Fetch an RRef's value (`to_here`). Replies [`HostReply::Value`].
    RRefToHere(u32),
    /// The RRef's owner. Replies [`HostReply::Worker`].
    RRefOwner(u32),
    /// Create a local (owner) RRef holding a value. Replies
    /// [`HostReply::Handle`].
    RRefNew(Value),
    // RRef proxies and RRef state (plugin classes).
    /// Call `method` on the value of an RRef, on its owner, through a
    /// proxy (`rref.rpc_sync().method(...)` and its async and remote
    /// forms). Replies as [`HostCall::Rpc`] does for the same mode.
    RRefProxyCall {
        /// The RRef's handle.
        rref: u32,
        /// The proxy's mode.
        mode: RpcMode,
        /// The method's name.
        method: String,
        /// Its arguments.
        args: CallArgs,
        /// A timeout in seconds; `None` for the agent's default.
        timeout: Option<f64>,
    },
    /// Whether this worker owns the RRef (`is_owner()`). Replies
    /// [`HostReply::Bool`].
    RRefIsOwner(u32),
    /// Whether the owner has confirmed this user RRef
    /// (`confirmed_by_owner()`). Replies [`HostReply::Bool`].
    RRefConfirmed(u32),
    /// Create an unset future. Replies [`HostReply::Handle`].
    FutureNew,
    /// Complete a future. Replies [`HostReply::Unit`].
    FutureSet {
        /// The future's handle.
        future: u32,
        /// The value or the error to complete it with.
        result: Result<Value, RemoteError>,
    },
    /// Wait for a future. Replies [`HostReply::Value`] or its error.
    FutureWait(u32),
    /// Whether a future is complete. Replies [`HostReply::Bool`].
    FutureDone(u32),
    /// Chain a callback: when `future` completes with a value `v`, the host
    /// calls the plugin's own function `function(v, *extra)` and completes
    /// the returned future with its result; an error skips the call and
    /// passes through. Replies a future [`HostReply::Handle`].
    FutureThen {
        /// The future to wait on.
        future: u32,
        /// The name of a function of the same plugin.
        function: String,
        /// Arguments passed after the value.
        extra: Vec<Value>,
    },
    /// The worker-wide future named `key` (one per plugin and worker),
    /// created unset on first use, so one call can complete what others
    /// wait on (PyTorch's future kept in an object attribute). With `take`,
    /// the name is forgotten afterwards and the next use creates a new
    /// future. Replies a future [`HostReply::Handle`].
    FutureShared {
        /// The future's name.
        key: String,
        /// Forget the name after handing out this handle.
        take: bool,
    },
    /// Identity of a worker: `None` for this one. Replies
    /// [`HostReply::Worker`].
    WorkerInfo(Option<String>),
    /// Read a per-worker global. Replies [`HostReply::Value`] (`None` when
    /// unset).
    GlobalGet(String),
    /// Write a per-worker global; `Value::None` clears it. Replies
    /// [`HostReply::Unit`].
    GlobalSet(String, Value),
    /// Acquire a per-worker named lock, waiting as long as it takes.
    /// Replies [`HostReply::Unit`].
    Lock(String),
    /// Release a lock taken with [`HostCall::Lock`]. Replies
    /// [`HostReply::Unit`].
    Unlock(String),
    /// Sleep for a number of seconds without holding a thread. Replies
    /// [`HostReply::Unit`].
    Sleep(f64),
    /// Log a line. Replies [`HostReply::Unit`].
    Log(LogLevel, String),
    // --- Progress reports (issue 10: the demo's progress bars) ---
    /// Report the progress of a long task. Replies [`HostReply::Unit`].
    Progress(Progress),
    // --- end of progress reports ---
    /// The guest panicked with this message and is about to trap; the
    /// runtime attaches the message to the trap's error. Replies
    /// [`HostReply::Unit`].
    Panicked(String),
    /// Local autograd, distributed autograd or the distributed optimizer
    /// ([`AutogradCall`]). Replies [`HostReply::Value`].
    Autograd(AutogradCall),
    // --- Profiling ranges (`record_function`) ---
    /// Open a user range named by the string in the caller's profiling
    /// scope (PyTorch's `record_function`). Replies [`HostReply::Handle`]:
    /// the range, to close with [`HostCall::RecordFunctionExit`]; 0 when
    /// nothing profiles the call (closing 0 does nothing).
    RecordFunctionEnter(String),
    /// Close a range opened with [`HostCall::RecordFunctionEnter`].
    /// Replies [`HostReply::Unit`].
    RecordFunctionExit(u32),
    // --- end of profiling ranges ---
    /// A file in a folder the operator granted the plugin ([`FileCall`]).
    /// Replies [`HostReply::Value`].
    File(FileCall),
    /// The object an RRef holds, when it lives in the calling instance: the
    /// owner runs a function beside the object an argument's RRef holds
    /// (same plugin, same worker), and this is how the guest finds it for
    /// `rref.local_value()`. Replies [`HostReply::Value`]: the object's id
    /// as an `Int` (the one its constructor's outcome named), else `None`.
    RRefLocalObject(u32),
    /// Asks the owner-side `remote()` the running function serves to keep
    /// the guest's object `object` of class `class` (a single-instance
    /// plugin's function returning one of its objects) instead of a copy.
    /// Replies [`HostReply::Bool`]: whether it will (`false` outside such
    /// a `remote()`, where the value is copied as usual).
    KeepObject {
        /// The object's id in the instance.
        object: u32,
        /// Its class, one the plugin exports.
        class: String,
    },
    /// `rref.to_here()` as a future: the fetch runs while the guest does
    /// other work (a single-instance plugin's wait serves other calls
    /// meanwhile). Replies [`HostReply::Handle`]: the future.
    RRefFetch(u32),
    /// `RRef(obj)` of the guest's object `object` of class `class`, made in
    /// place: an RRef this worker owns that holds the object itself, in
    /// its instance (a single-instance plugin's; elsewhere refused with
    /// `TypeError`). Replies [`HostReply::Handle`]: the RRef.
    RRefOfObject {
        /// The object's id in the instance.
        object: u32,
        /// Its class, one the plugin exports.
        class: String,
    },
}

/// File requests of a guest, in the folders its operator granted it on its
/// worker (`--grant-dir`), by guest path (`/data/train.csv`). Each replies
/// [`HostReply::Value`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum FileCall {
    /// A whole file's bytes: `Value::Bytes`.
    Read(String),
    /// Writes a whole file atomically (readers see the old file or the
    /// whole new one), making its parent folders: `Value::None`.
    Write {
        /// The file's guest path.
        path: String,
        /// Its new contents.
        #[serde(with = "crate::raw_bytes")]
        data: Vec<u8>,
    },
    /// A folder's entries by name: a `Value::List` of `(name, is_dir,
    /// size)` tuples.
    List(String),
    /// Removes a file or an empty folder: `Value::None`.
    Remove(String),
    /// Saves tensors to a safetensors file (atomically, as `Write`):
    /// `Value::None`.
    SaveTensors {
        /// The file's guest path.
        path: String,
        /// `(name, tensor handle)` pairs, in order.
        tensors: Vec<(String, u32)>,
        /// String metadata stored in the file's header.
        metadata: Vec<(String, String)>,
    },
    /// Loads every tensor of a safetensors, `.npy` or `.npz` file (never a
    /// pickle): a `Value::Tuple` of a `Dict` of name to new tensor handle,
    /// in the file's order, and a `Dict` of the file's string metadata.
    LoadTensors(String),
}

/// Autograd requests of a guest: local autograd on tensor handles,
/// distributed autograd contexts and the distributed optimizer. Each one
/// replies [`HostReply::Value`] (`Value::None` when there is nothing to
/// return).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum AutogradCall {
    /// `tensor.requires_grad_(flag)`, in place.
    SetRequiresGrad(u32, bool),
    /// `tensor.grad`: a new tensor handle, or `None`.
    Grad(u32),
    /// `tensor.backward()` with local autograd (fills `.grad` of leaves).
    Backward(u32),
    /// Turns gradient recording of this call's later ops on or off
    /// (`torch.no_grad()`); replies the previous setting as a `Bool`.
    SetGradEnabled(bool),
    /// An opaque identity of the tensor behind a handle: equal for two
    /// handles to the same tensor object (the key of
    /// [`GetGradients`](Self::GetGradients)). Replies an `Int`.
    Identity(u32),
    /// Opens a distributed autograd context, current for this call's later
    /// RPCs (`dist_autograd.context()`). Replies its id as an `Int`.
    ContextNew,
    /// Leaves and releases the context opened by
    /// [`ContextNew`](Self::ContextNew).
    ContextRelease(i64),
    /// The current context's id, or `None`.
    CurrentContext,
    /// `dist_autograd.backward(context_id, roots, retain_graph)`.
    DistBackward {
        /// The context.
        context_id: i64,
        /// Scalar roots, by tensor handle.
        roots: Vec<u32>,
        /// Keep the graph for another pass.
        retain_graph: bool,
    },
    /// `dist_autograd.get_gradients(context_id)`: a list of
    /// `(identity, tensor, gradient)` tuples with new handles.
    GetGradients(i64),
    /// Creates a distributed optimizer over parameter RRefs (handles);
    /// `config` is `("sgd", lr, momentum, dampening, weight_decay,
    /// nesterov)` or `("adam", lr, beta1, beta2, eps, weight_decay)`.
    /// Replies its id as an `Int`; it lives until
    /// [`OptimizerDrop`](Self::OptimizerDrop) or the end of the call.
    OptimizerNew {
        /// The local optimizers' kind and hyperparameters.
        config: Value,
        /// RRef handles of the parameters.
        params: Vec<u32>,
    },
    /// Steps an optimizer with a context's gradients.
    OptimizerStep {
        /// The optimizer's id.
        optimizer: i64,
        /// The context whose gradients to apply.
        context_id: i64,
    },
    /// Releases an optimizer and its owners' state.
    OptimizerDrop(i64),
    /// `tensor.grad = grad` (the second handle), or `tensor.grad = None`;
    /// checked as PyTorch checks it (dtype, size, device).
    SetGrad(u32, Option<u32>),
    /// An optimizer's state on every owner (momentum buffers, Adam's
    /// moments), as a dict of owner name to its per-parameter list, with
    /// new tensor handles (`DistributedOptimizer.state_dict()`).
    OptimizerState(i64),
    /// Replaces every owner's state with what `state` (from
    /// [`OptimizerState`](Self::OptimizerState)) holds for it.
    OptimizerLoadState {
        /// The optimizer's id.
        optimizer: i64,
        /// The state, as `OptimizerState` gave it.
        state: Value,
    },
}

/// The host's answer to a [`HostCall`]; it travels as `Result<HostReply,
/// RemoteError>`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum HostReply {
    /// Nothing to return.
    Unit,
    /// A value; its handles belong to the guest.
    Value(Value),
    /// A new handle, owned by the guest.
    Handle(u32),
    /// A tensor's type and shape.
    Meta(TensorMeta),
    /// A tensor's type, shape and elements.
    Data(TensorMeta, #[serde(with = "crate::raw_bytes")] Vec<u8>),
    /// A worker's identity.
    Worker(WorkerInfo),
    /// A flag.
    Bool(bool),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pack_round_trips() {
        for (p, l) in [(0, 0), (1, 2), (u32::MAX, 7), (65536, u32::MAX)] {
            assert_eq!(unpack(pack(p, l)), (p, l));
        }
    }

    #[test]
    fn export_names_are_distinct_per_kind() {
        assert_eq!(export_name(ExportKind::Function, None, "f"), "wasmrpc:fn:f");
        assert_eq!(
            export_name(ExportKind::AsyncFunction, None, "f"),
            "wasmrpc:fn:f"
        );
        assert_eq!(
            export_name(ExportKind::Constructor, Some("C"), "C"),
            "wasmrpc:new:C"
        );
        assert_eq!(
            export_name(ExportKind::Method, Some("C"), "m"),
            "wasmrpc:method:C.m"
        );
        assert_eq!(drop_export_name("C"), "wasmrpc:drop:C");
    }
}
