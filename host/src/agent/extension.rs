//! [`Extension`]: how a feature plugs into the agent.
//!
//! The agent owns connections, calls, the pending table, serving and
//! shutdown, and knows no feature. Features (RRefs, distributed autograd,
//! the profiler, plugin deployment, the distributed optimizer) are
//! extensions, given to the agent when it is made (`init_rpc` passes
//! `crate::extensions()`), and reach calls only through this trait:
//!
//! | hook | when | e.g. |
//! |---|---|---|
//! | [`register`](Extension::register) | the agent is made | RRef owner functions |
//! | [`on_call`](Extension::on_call) | a call leaves | the autograd envelope, the profiling key |
//! | [`on_serve`](Extension::on_serve) | a call is served | the autograd context, a profiling range |
//! | [`on_reply`](Extension::on_reply) | a call's response arrives | recv records, the callee's events |
//! | [`message_kinds`](Extension::message_kinds), [`serve_request`](Extension::serve_request) | a request of the feature's kind arrives | RRef forks, gradients, deployment |
//! | [`handles`](Extension::handles) | values with RRefs cross the wire | fork records |
//! | [`shutdown`](Extension::shutdown), [`stopped`](Extension::stopped) | graceful shutdown, after stop | deleting users, the leak check |
//! | [`debug_info`](Extension::debug_info) | `get_debug_info` | `rref.*`, `num_autograd_contexts` |
//! | [`inherit`](Extension::inherit) | a feature spawns a task for the current one ([`RpcAgent::spawn_inheriting`]) | the current autograd context |
//!
//! Every hook has a default that does nothing, so an agent with no
//! extension is a plain RPC agent: it calls and serves functions.
//!
//! Invariants:
//! - EXT-1: hooks run in the order the extensions were given, and a call's
//!   [`ServeScope`]s wrap the function in that order (the first innermost).
//! - EXT-2: a field is read only by the extension that wrote it (fields are
//!   named after [`Extension::name`]).

use std::collections::BTreeMap;
use std::sync::Arc;

use futures::future::BoxFuture;
use tch::Tensor;

use super::message::Field;
use super::{FunctionRegistry, Future, RpcAgent};
use crate::abi::{Value, WorkerInfo};
use crate::error::Result;
use crate::transport::MessageKind;
use crate::value::{Args, Handle, Payload};

/// How a call was made: PyTorch's `RpcExecMode` for the calls users make,
/// or one of the agent's and its features' own calls.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum CallKind {
    /// `rpc_sync`.
    Sync,
    /// `rpc_async` (collected by an enclosing `wait_all_scope`).
    #[default]
    Async,
    /// `remote`.
    Remote,
    /// The agent's or a feature's own call: not counted as a user call.
    Internal,
}

impl CallKind {
    /// The kind as metrics and traces name it: `sync`, `async`, `remote`
    /// or `internal`.
    pub fn name(self) -> &'static str {
        match self {
            CallKind::Sync => "sync",
            CallKind::Async => "async",
            CallKind::Remote => "remote",
            CallKind::Internal => "internal",
        }
    }
}

/// A call about to leave, as extensions see it ([`Extension::on_call`]).
pub struct OutgoingCall<'a> {
    /// The calling agent.
    pub agent: &'a RpcAgent,
    /// The destination.
    pub to: &'a WorkerInfo,
    /// The function called.
    pub function: &'a str,
    /// How the call was made.
    pub kind: CallKind,
    /// Whether it carries a user's values: a call to a user's function, or
    /// a feature's own call marked so ([`CallOptions::user_values`](super::CallOptions)).
    pub user_values: bool,
    /// The call's tensors.
    pub tensors: &'a [Tensor],
    /// Fields given explicitly with the call ([`CallOptions::fields`](super::CallOptions)).
    pub fields: &'a [Field],
}

/// What an extension does for one outgoing call.
pub trait CallScope: Send {
    /// The field to send with the call, whose request id is `id`.
    fn field(&mut self, id: u64) -> Option<Vec<u8>>;
    /// The call's future, once the call is on its way.
    fn sent(self: Box<Self>, _call: &Future) {}
}

/// A call about to be served, as extensions see it ([`Extension::on_serve`]).
pub struct IncomingCall<'a> {
    /// The serving agent.
    pub agent: &'a RpcAgent,
    /// The caller.
    pub caller: &'a WorkerInfo,
    /// The function called.
    pub function: &'a str,
    /// The function the call runs: `function`, or the one a carrier of
    /// another names ([`RpcFunction::runs`](super::RpcFunction::runs):
    /// `remote()` runs the function its arguments name).
    pub runs: &'a str,
    /// Its arguments.
    pub args: &'a Args,
    /// The field this extension's peer sent with the call, if any.
    pub field: Option<&'a [u8]>,
}

/// The function of a served call, as a future.
pub type Run = BoxFuture<'static, Result<Payload>>;

/// What an extension does for one served call.
pub trait ServeScope: Send {
    /// Wraps the function's run (to run it in a context, to time it).
    fn wrap(&mut self, run: Run) -> Run {
        run
    }
    /// The field to send with the response.
    fn reply_field(self: Box<Self>, _result: &Result<Payload>) -> Option<Vec<u8>> {
        None
    }
}

/// A response that arrived, as extensions see it ([`Extension::on_reply`]).
pub struct IncomingReply<'a> {
    /// The agent that made the call.
    pub agent: &'a RpcAgent,
    /// The request id.
    pub id: u64,
    /// Whether the call succeeded.
    pub ok: bool,
    /// The response's tensors.
    pub tensors: &'a [Tensor],
    /// The field this extension's peer sent with the response.
    pub field: &'a [u8],
}

/// A request of a kind an extension serves.
pub struct Request {
    /// Its kind (one of [`Extension::message_kinds`]).
    pub kind: MessageKind,
    /// The extension's encoding of it.
    pub body: Vec<u8>,
    /// The tensors it carries.
    pub tensors: Vec<Tensor>,
    /// The worker that sent it.
    pub from: WorkerInfo,
}

impl Request {
    /// The body decoded as a `T`, whose own kind (`kind_of`) must be the
    /// request's: a feature's requests are enums with one variant per kind.
    ///
    /// # Errors
    /// Malformed bytes ("malformed KIND request: ..."), or a body of another
    /// kind.
    pub fn decode<T: serde::de::DeserializeOwned>(
        &self,
        kind_of: impl Fn(&T) -> MessageKind,
    ) -> Result<T> {
        let kind = self.kind;
        let message: T = crate::abi::decode(&self.body)
            .map_err(|e| crate::error::Error::runtime(format!("malformed {kind} request: {e}")))?;
        let carried = kind_of(&message);
        if carried != kind {
            return Err(crate::error::Error::runtime(format!(
                "a {kind} request carried a {carried} message"
            )));
        }
        Ok(message)
    }
}

/// How values with RRefs (`Value::RRef(i)` into a payload's handle table)
/// cross the wire: what the RRef feature provides.
pub trait HandleCodec: Send + Sync {
    /// `value` as it travels to `to`: each handle replaced by its wire form.
    ///
    /// # Errors
    /// A handle that cannot be sent.
    fn encode(
        &self,
        agent: &RpcAgent,
        to: &WorkerInfo,
        value: Value,
        handles: &[Handle],
    ) -> Result<Value>;
    /// A received `value` with each wire form replaced by a handle appended
    /// to `handles`.
    ///
    /// # Errors
    /// A malformed wire form.
    fn decode(&self, agent: &RpcAgent, value: Value, handles: &mut Vec<Handle>) -> Result<Value>;
    /// Completes when the received `handles` may be used by the function
    /// called with them (RREF-7).
    fn ready(&self, agent: &RpcAgent, handles: &[Handle]) -> Option<BoxFuture<'static, ()>>;
}

/// A feature of the agent. See the module docs for when each hook runs.
pub trait Extension: Send + Sync + 'static {
    /// The feature's name: it names the fields the feature writes.
    fn name(&self) -> &'static str;

    /// Registers the feature's own functions (names under
    /// [`INTERNAL_PREFIX`](super::INTERNAL_PREFIX)).
    fn register(&self, _functions: &FunctionRegistry) {}

    /// A call is leaving: what the feature adds to it.
    fn on_call(&self, _call: &OutgoingCall<'_>) -> Option<Box<dyn CallScope>> {
        None
    }

    /// A call is about to be served: what the feature does around it.
    fn on_serve(&self, _call: &IncomingCall<'_>) -> Option<Box<dyn ServeScope>> {
        None
    }

    /// A response carrying this feature's field arrived.
    fn on_reply(&self, _reply: &IncomingReply<'_>) {}

    /// The kinds of request the feature serves.
    fn message_kinds(&self) -> &'static [MessageKind] {
        &[]
    }

    /// Serves a request of one of [`message_kinds`](Self::message_kinds).
    /// Called on the connection's reader, so requests of one connection are
    /// seen in order; the future it returns runs as its own task and its
    /// result is the response.
    fn serve_request(&self, _agent: &RpcAgent, request: Request) -> Run {
        let kind = request.kind;
        Box::pin(async move {
            Err(crate::error::Error::runtime(format!(
                "{kind} requests are not served"
            )))
        })
    }

    /// How RRefs cross the wire, for the feature that owns them.
    fn handles(&self) -> Option<&dyn HandleCodec> {
        None
    }

    /// A step of graceful shutdown of a static group, after the all-gather
    /// and before the join.
    fn shutdown(&self, _agent: &RpcAgent) -> Option<BoxFuture<'static, Result<()>>> {
        None
    }

    /// Worker `failed` (its rank and name) was declared failed (FAIL-5 in
    /// `agent::failures`): the feature releases what it holds for it (the
    /// forks it held, the contexts it made) and fails what waits on it.
    fn worker_failed(&self, _agent: &RpcAgent, _failed: &crate::abi::WorkerInfo, _cause: &str) {}

    /// The agent has stopped: a last check (leaks), whose error
    /// `shutdown` returns.
    fn stopped(&self, _agent: &RpcAgent) -> Result<()> {
        Ok(())
    }

    /// Entries the feature adds to `get_debug_info`.
    fn debug_info(&self, _agent: &RpcAgent) -> BTreeMap<String, String> {
        BTreeMap::new()
    }

    /// The current task's ambient state this feature keeps (distributed
    /// autograd's current context), for a task spawned on its behalf to
    /// run in ([`RpcAgent::spawn_inheriting`]); called on the spawning
    /// task.
    fn inherit(&self) -> Option<Inherit> {
        None
    }
}

/// A task's ambient state, taken along by a task spawned for it: wraps the
/// new task's future so it runs in that state ([`Extension::inherit`]).
pub type Inherit = Box<dyn FnOnce(BoxFuture<'static, ()>) -> BoxFuture<'static, ()> + Send>;

impl RpcAgent {
    /// Spawns `task` on the agent's runtime in the current task's ambient
    /// state, as every feature keeps it ([`Extension::inherit`]): a call a
    /// feature makes later, for the current task, is made as if the task
    /// made it (in its distributed autograd context), without the feature
    /// naming the others.
    pub fn spawn_inheriting(
        &self,
        task: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> tokio::task::JoinHandle<()> {
        let mut task: BoxFuture<'static, ()> = Box::pin(task);
        for inherit in self.inner.extensions.iter().filter_map(|e| e.inherit()) {
            task = inherit(task);
        }
        self.inner.runtime.spawn(task)
    }
}

/// The extensions of one agent, in order (EXT-1).
#[derive(Clone, Default)]
pub struct Extensions(pub(crate) Vec<Arc<dyn Extension>>);

impl Extensions {
    /// No extension: a plain RPC agent.
    pub fn none() -> Self {
        Self::default()
    }

    /// Adds `extension` after those already given.
    #[must_use]
    pub fn with(mut self, extension: Arc<dyn Extension>) -> Self {
        self.0.push(extension);
        self
    }

    /// The extensions, in order.
    pub fn iter(&self) -> impl Iterator<Item = &Arc<dyn Extension>> {
        self.0.iter()
    }

    /// The codec of the extension that owns RRefs, if one does.
    pub(crate) fn handles(&self) -> Option<&dyn HandleCodec> {
        self.0.iter().find_map(|e| e.handles())
    }

    /// The extension serving requests named `kind`, with the kind.
    pub(crate) fn server_of(&self, kind: &str) -> Option<(&Arc<dyn Extension>, MessageKind)> {
        self.0.iter().find_map(|e| {
            e.message_kinds()
                .iter()
                .find(|k| k.name() == kind)
                .map(|k| (e, *k))
        })
    }
}

impl std::fmt::Debug for Extensions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.0.iter().map(|e| e.name()))
            .finish()
    }
}
