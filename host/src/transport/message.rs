//! [`Message`]: everything workers say to each other, as data.

use serde::{Deserialize, Serialize};

use crate::abi::{RemoteError, Value};

/// The distributed-autograd envelope carried by calls and responses made
/// inside an autograd context.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct AutogradEnvelope {
    /// The distributed autograd context.
    pub context_id: i64,
    /// The send/recv pair this message belongs to.
    pub message_id: i64,
    /// The sender's rank.
    pub from_worker: u32,
}

/// A range a callee profiled while serving a call made inside the
/// caller's profiling scope (`crate::profiler`), sent back with the
/// response. Times are microseconds since the callee received the call.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProfiledEvent {
    /// The event's name on the callee (its function, a nested RPC's key,
    /// ...), without the caller's key.
    pub name: String,
    /// The rank it ran on.
    pub worker: u32,
    /// Start.
    pub start_us: u64,
    /// End.
    pub end_us: u64,
}

/// An RRef or fork id: the worker that created it and a local counter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct GloballyUniqueId {
    /// The rank that created the id.
    pub created_on: u32,
    /// A counter local to that worker.
    pub local_id: u64,
}

impl std::fmt::Display for GloballyUniqueId {
    /// PyTorch's form: `GloballyUniqueId(created_on=0, local_id=1)`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "GloballyUniqueId(created_on={}, local_id={})",
            self.created_on, self.local_id
        )
    }
}

/// A wire message. Tensors are in the frame's table, referred to by index
/// from the `Value`s.
///
/// Every request carries an `id`; its reply carries the same `id`. Kinds this
/// worker does not handle yet are answered with a `NotImplementedError`
/// response rather than dropped.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Message {
    /// Run a registered function.
    Call {
        /// Request id, unique per sender.
        id: u64,
        /// The function's qualified name in the callee's registry.
        function: String,
        /// Positional arguments.
        args: Vec<Value>,
        /// Keyword arguments.
        kwargs: Vec<(String, Value)>,
        /// Set when the call is made inside a distributed autograd context.
        autograd: Option<AutogradEnvelope>,
        /// The caller's RPC profiling key, set when the call is made inside
        /// a profiling scope: the callee profiles the call and returns its
        /// events with the response.
        profiling: Option<String>,
    },
    /// The result of a request.
    Response {
        /// The request's id.
        id: u64,
        /// The value, or the error with its kind and message.
        result: Result<Value, RemoteError>,
        /// Set when the reply carries autograd information.
        autograd: Option<AutogradEnvelope>,
        /// The callee's events for a call that asked for profiling.
        profiled: Option<Vec<ProfiledEvent>>,
    },
    /// A user forked an RRef to a new user: the new user asks the owner to
    /// count its fork (`RREF_FORK_REQUEST`); answered with `RRefAck`.
    RRefFork {
        /// Request id.
        id: u64,
        /// The RRef.
        rref_id: GloballyUniqueId,
        /// The new fork.
        fork_id: GloballyUniqueId,
    },
    /// The owner knows a fork: its user tells the parent that sent it
    /// (`RREF_CHILD_ACCEPT`); answered with `RRefAck`.
    RRefChildAccept {
        /// Request id.
        id: u64,
        /// The fork being accepted.
        fork_id: GloballyUniqueId,
    },
    /// A user RRef was deleted: its fork leaves the owner's count
    /// (`RREF_USER_DELETE`); answered with `RRefAck`.
    RRefUserDelete {
        /// Request id.
        id: u64,
        /// The RRef.
        rref_id: GloballyUniqueId,
        /// The user's fork.
        fork_id: GloballyUniqueId,
    },
    /// Acknowledges an RRef message.
    RRefAck {
        /// The acknowledged request's id.
        id: u64,
    },
    /// Reserved: gradients flowing back to a sender during distributed
    /// backward.
    PropagateGradients {
        /// Request id.
        id: u64,
        /// Which send function the gradients are for.
        envelope: AutogradEnvelope,
        /// The gradients (tensors in the frame's table).
        grads: Vec<Value>,
        /// Whether to keep the graph.
        retain_graph: bool,
    },
    /// Reserved: release a distributed autograd context.
    CleanupAutogradContext {
        /// Request id.
        id: u64,
        /// The context.
        context_id: i64,
    },
    /// Reserved: turn remote profiling on or off, or collect events.
    ProfilingRequest {
        /// Request id.
        id: u64,
        /// Whether profiling is enabled.
        enabled: bool,
    },
    /// Reserved: profiling events collected on the callee.
    ProfilingResponse {
        /// The request's id.
        id: u64,
        /// The events.
        events: Vec<Value>,
    },
    /// Install a wasm plugin on the receiving worker and register its
    /// functions (`crate::plugin::deploy`); answered with a `Response`.
    DeployPlugin {
        /// Request id.
        id: u64,
        /// The plugin's name (from its manifest), for messages.
        name: String,
        /// The sha256 of `wasm`: the plugin's identity (content-addressed).
        sha256: [u8; 32],
        /// The module's bytes.
        wasm: Vec<u8>,
    },
}

/// The kind of a [`Message`], for fault injection and logs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum MessageKind {
    /// [`Message::Call`].
    Call,
    /// [`Message::Response`].
    Response,
    /// [`Message::RRefFork`].
    RRefFork,
    /// [`Message::RRefChildAccept`].
    RRefChildAccept,
    /// [`Message::RRefUserDelete`].
    RRefUserDelete,
    /// [`Message::RRefAck`].
    RRefAck,
    /// [`Message::PropagateGradients`].
    PropagateGradients,
    /// [`Message::CleanupAutogradContext`].
    CleanupAutogradContext,
    /// [`Message::ProfilingRequest`].
    ProfilingRequest,
    /// [`Message::ProfilingResponse`].
    ProfilingResponse,
    /// [`Message::DeployPlugin`].
    DeployPlugin,
}

impl Message {
    /// The message's kind.
    pub fn kind(&self) -> MessageKind {
        match self {
            Message::Call { .. } => MessageKind::Call,
            Message::Response { .. } => MessageKind::Response,
            Message::RRefFork { .. } => MessageKind::RRefFork,
            Message::RRefChildAccept { .. } => MessageKind::RRefChildAccept,
            Message::RRefUserDelete { .. } => MessageKind::RRefUserDelete,
            Message::RRefAck { .. } => MessageKind::RRefAck,
            Message::PropagateGradients { .. } => MessageKind::PropagateGradients,
            Message::CleanupAutogradContext { .. } => MessageKind::CleanupAutogradContext,
            Message::ProfilingRequest { .. } => MessageKind::ProfilingRequest,
            Message::ProfilingResponse { .. } => MessageKind::ProfilingResponse,
            Message::DeployPlugin { .. } => MessageKind::DeployPlugin,
        }
    }

    /// The request id, or the id of the request this message answers.
    pub fn id(&self) -> u64 {
        match self {
            Message::Call { id, .. }
            | Message::Response { id, .. }
            | Message::RRefFork { id, .. }
            | Message::RRefChildAccept { id, .. }
            | Message::RRefUserDelete { id, .. }
            | Message::RRefAck { id }
            | Message::PropagateGradients { id, .. }
            | Message::CleanupAutogradContext { id, .. }
            | Message::ProfilingRequest { id, .. }
            | Message::ProfilingResponse { id, .. }
            | Message::DeployPlugin { id, .. } => *id,
        }
    }

    /// Whether the message answers a request (rather than asking).
    pub fn is_reply(&self) -> bool {
        matches!(
            self,
            Message::Response { .. } | Message::RRefAck { .. } | Message::ProfilingResponse { .. }
        )
    }
}
