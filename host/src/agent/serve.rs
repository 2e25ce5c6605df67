//! The callee's side of the agent: what arrives on a connection. Calls run
//! as their own tasks (AG-1) once rendezvous is done (AG-7), inside what
//! the features wrap them in ([`ServeScope`]); responses end their pending
//! calls; a feature's requests go to the feature that serves their kind.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use futures::FutureExt;
use tch::Tensor;

use super::extension::{IncomingCall, IncomingReply, Request, ServeScope};
use super::message::{Field, Fields, Message, RESPONSE, field};
use super::{AgentInner, CallContext, INTERNAL_PREFIX, RpcAgent, registry};
use crate::abi::{ErrorKind, Value, WorkerInfo};
use crate::device::MapDirection;
use crate::error::{Error, Result, unknown_function_message};
use crate::transport::{Connection, Handler, OutFrame};
use crate::value::{Args, Handle, Payload};

impl RpcAgent {
    /// Marks rendezvous as done: calls that arrived early may run.
    pub(crate) fn set_ready(&self) {
        self.inner.ready.store(true, Ordering::Release);
        self.inner.ready_notify.notify_waiters();
    }

    async fn wait_ready(&self) {
        loop {
            let notified = self.inner.ready_notify.notified();
            if self.inner.ready.load(Ordering::Acquire) {
                return;
            }
            notified.await;
        }
    }

    /// Serves a call: runs the function as its own task (AG-1) and answers.
    fn serve_call(
        &self,
        conn: &Arc<Connection>,
        id: u64,
        function: String,
        (args, kwargs): (Vec<Value>, Vec<(String, Value)>),
        fields: Fields,
        tensors: Vec<Tensor>,
    ) {
        let internal = function.starts_with(INTERNAL_PREFIX);
        let inner = &self.inner;
        inner.active.fetch_add(1, Ordering::AcqRel);
        if !internal {
            inner.user_received.fetch_add(1, Ordering::AcqRel);
            inner.user_active.fetch_add(1, Ordering::AcqRel);
        }
        let this = self.clone();
        // TR-10: counted from here, on the reader, so that the responses to
        // a batch of requests read at once leave together.
        let work = conn.start_work();
        let conn = conn.clone();
        inner.runtime.spawn(async move {
            // AG-7: a call can arrive before this worker's `init_rpc` has
            // learnt the group; functions run once it has.
            this.wait_ready().await;
            let caller = WorkerInfo {
                id: conn.peer_rank,
                name: conn.peer.clone(),
            };
            let fields = Arc::new(fields);
            let (result, reply_fields) = this.run_call(&caller, &function, (args, kwargs), &fields, tensors).await;
            if let Err(e) = &result
                && let Some(held_back) = this.inner.warn_limit.admit(&conn.peer)
            {
                let note = super::warn_limit::held_back_note(held_back);
                tracing::warn!(worker = %this.name(), caller = %conn.peer, function = %function, "function raised {}: {}{note}", e.kind(), e.message());
            }
            this.respond(&conn, id, result, reply_fields).await;
            drop(work);
            // AG-4: the response is queued; stop counting the task.
            if !internal {
                this.inner.user_active.fetch_sub(1, Ordering::AcqRel);
            }
            this.inner.active.fetch_sub(1, Ordering::AcqRel);
            this.inner.quiet.notify_waiters();
        });
    }

    /// Runs a received call's function inside what the features wrap it
    /// in; returns its result and the fields of its response.
    async fn run_call(
        &self,
        caller: &WorkerInfo,
        function: &str,
        (positional, kwargs): (Vec<Value>, Vec<(String, Value)>),
        fields: &Arc<Fields>,
        tensors: Vec<Tensor>,
    ) -> (Result<Payload>, Fields) {
        let args = match self.values_from_wire(positional, kwargs, tensors) {
            Ok(a) => a,
            Err(e) => {
                let e = e.context_line(format!("receiving RRefs from worker {}", caller.name));
                return (Err(e), Vec::new());
            }
        };
        if let Some(codec) = self.inner.extensions.handles()
            && let Some(ready) = codec.ready(self, &args.rrefs)
        {
            // RREF-7: run the function once its argument RRefs are confirmed.
            ready.await;
        }
        let Some(f) = self.lookup_function(function) else {
            self.inner
                .unknown_function_calls
                .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
            let e = Error::runtime(unknown_function_message(function, self.name()));
            return (Err(e), Vec::new());
        };
        let runs = f.runs(&args).unwrap_or(function);
        let mut scopes: Vec<(&'static str, Box<dyn ServeScope>)> = self
            .inner
            .extensions
            .iter()
            .filter_map(|e| {
                let incoming = IncomingCall {
                    agent: self,
                    caller,
                    function,
                    runs,
                    args: &args,
                    field: field(fields, e.name()),
                };
                e.on_serve(&incoming).map(|s| (e.name(), s))
            })
            .collect();
        let ctx = CallContext::new(
            self.clone(),
            caller.clone(),
            function.to_string(),
            fields.clone(),
        );
        let mut run = registry::call_guarded(f, ctx, args).boxed();
        for (_, scope) in &mut scopes {
            run = scope.wrap(run);
        }
        let result = run.await;
        let reply_fields = scopes
            .into_iter()
            .filter_map(|(feature, scope)| {
                scope.reply_field(&result).map(|bytes| Field {
                    feature: feature.to_string(),
                    bytes,
                })
            })
            .collect();
        (result, reply_fields)
    }

    /// Turns a received call's wire values into values with RRef handles.
    fn values_from_wire(
        &self,
        positional: Vec<Value>,
        kwargs: Vec<(String, Value)>,
        tensors: Vec<Tensor>,
    ) -> Result<Args> {
        let mut rrefs = Vec::new();
        let (positional, kwargs) = match self.inner.extensions.handles() {
            None => (positional, kwargs),
            Some(codec) => {
                let positional = positional
                    .into_iter()
                    .map(|v| codec.decode(self, v, &mut rrefs))
                    .collect::<Result<Vec<_>>>()?;
                let kwargs = kwargs
                    .into_iter()
                    .map(|(k, v)| Ok((k, codec.decode(self, v, &mut rrefs)?)))
                    .collect::<Result<Vec<_>>>()?;
                (positional, kwargs)
            }
        };
        Ok(Args {
            positional,
            kwargs,
            tensors,
            rrefs,
        })
    }

    /// A response arrived: the features read their fields, then its call
    /// ends.
    fn on_response(
        &self,
        conn: &Arc<Connection>,
        id: u64,
        result: std::result::Result<Value, crate::abi::RemoteError>,
        fields: Fields,
        tensors: Vec<Tensor>,
    ) {
        for f in &fields {
            if let Some(e) = self.inner.extensions.iter().find(|e| e.name() == f.feature) {
                e.on_reply(&IncomingReply {
                    agent: self,
                    id,
                    ok: result.is_ok(),
                    tensors: &tensors,
                    field: &f.bytes,
                });
            }
        }
        let Some(function) = self.pending_function(id) else {
            return;
        };
        let peer = &conn.peer;
        let r = match result {
            Ok(value) => {
                let mut rrefs: Vec<Handle> = Vec::new();
                let value = match self.inner.extensions.handles() {
                    Some(codec) => codec.decode(self, value, &mut rrefs),
                    None => Ok(value),
                };
                value
                    .map(|value| Payload {
                        value,
                        tensors,
                        rrefs,
                    })
                    .map_err(|e| {
                        e.context_line(format!(
                            "receiving the RRefs of the result of {function} from worker {peer}"
                        ))
                    })
            }
            Err(e) => {
                Err(Error::from(e).context_line(format!("calling {function} on worker {peer}")))
            }
        };
        self.finish(id, r);
    }

    /// A request of a feature's kind arrived: the feature serves it (it
    /// sees it here, on the reader, in order) and its result is answered
    /// from a task of its own (AG-1), counted as active until the answer
    /// is queued (AG-4).
    fn on_request(
        &self,
        conn: &Arc<Connection>,
        id: u64,
        kind: String,
        body: Vec<u8>,
        tensors: Vec<Tensor>,
    ) {
        let work = match self.inner.extensions.server_of(&kind) {
            Some((extension, kind)) => {
                let from = WorkerInfo {
                    id: conn.peer_rank,
                    name: conn.peer.clone(),
                };
                extension.serve_request(
                    self,
                    Request {
                        kind,
                        body,
                        tensors,
                        from,
                    },
                )
            }
            None => {
                let e = Error::new(
                    ErrorKind::NotImplementedError,
                    format!(
                        "message kind {kind} is not handled by worker {}",
                        self.name()
                    ),
                );
                futures::future::ready(Err(e)).boxed()
            }
        };
        let (agent, conn) = (self.clone(), conn.clone());
        self.inner.active.fetch_add(1, Ordering::AcqRel);
        let in_progress = conn.start_work();
        self.inner.runtime.spawn(async move {
            let r = work.await;
            agent.respond(&conn, id, r, Vec::new()).await;
            drop(in_progress);
            agent.inner.active.fetch_sub(1, Ordering::AcqRel);
            agent.inner.quiet.notify_waiters();
        });
    }

    /// Answers request `id` on `conn` with `result` and `fields`.
    pub(super) async fn respond(
        &self,
        conn: &Arc<Connection>,
        id: u64,
        result: Result<Payload>,
        fields: Fields,
    ) {
        let Ok(transport) = self.transport() else {
            return;
        };
        let result = match result {
            Ok(p) if !p.rrefs.is_empty() => {
                let to = WorkerInfo {
                    id: conn.peer_rank,
                    name: conn.peer.clone(),
                };
                self.inner
                    .extensions
                    .handles()
                    .ok_or_else(super::call::no_rref_feature)
                    .and_then(|codec| codec.encode(self, &to, p.value, &p.rrefs))
                    .map(|value| Payload {
                        value,
                        tensors: p.tensors,
                        rrefs: Vec::new(),
                    })
                    .map_err(|e| e.context_line("sending the RRefs of a result"))
            }
            other => other,
        };
        let (result, tensors) = match result {
            Ok(p) => (Ok(p.value), p.tensors),
            Err(e) => (Err(e.to_remote()), Vec::new()),
        };
        let devices =
            crate::device::devices_for(self, &conn.peer, MapDirection::Response, &tensors);
        let message = Message::Response { id, result, fields };
        let sent = match devices
            .and_then(|d| OutFrame::encode(message.encode()?, RESPONSE, &tensors, &d))
        {
            Ok(frame) => transport.send_on(conn, frame, None).await,
            Err(e) => Err(e.context_line("encoding the result")),
        };
        // A result that cannot be sent (too large, injected fault, ...) is
        // replaced by an error saying why, so the caller does not wait for
        // its timeout.
        if let Err(e) = sent {
            let e = e.context_line(format!("sending the result to worker {}", conn.peer));
            let message = Message::Response {
                id,
                result: Err(crate::abi::RemoteError::new(e.kind(), format!("{e}"))),
                fields: Vec::new(),
            };
            let retry = match message
                .encode()
                .and_then(|bytes| OutFrame::encode(bytes, RESPONSE, &[], &[]))
            {
                Ok(frame) => transport.send_on(conn, frame, None).await,
                Err(e) => Err(e),
            };
            if let Err(e) = retry {
                tracing::warn!(worker = %self.name(), peer = %conn.peer, "could not send a response: {e}");
            }
        }
    }
}

/// The transport's handler: forwards to the agent while it exists.
pub(crate) struct AgentHandler {
    pub(crate) agent: std::sync::Weak<AgentInner>,
}

impl Handler for AgentHandler {
    fn on_frame(
        &self,
        conn: &Arc<Connection>,
        message: Vec<u8>,
        tensors: Vec<Tensor>,
    ) -> std::result::Result<(), String> {
        let message = Message::decode(&message)?;
        let Some(inner) = self.agent.upgrade() else {
            return Ok(());
        };
        let agent = RpcAgent::from_inner(inner);
        match message {
            Message::Call {
                id,
                function,
                args,
                kwargs,
                fields,
            } => agent.serve_call(conn, id, function, (args, kwargs), fields, tensors),
            Message::Response { id, result, fields } => {
                agent.on_response(conn, id, result, fields, tensors)
            }
            Message::Request { id, kind, body } => agent.on_request(conn, id, kind, body, tensors),
        }
        Ok(())
    }

    fn on_over_budget(
        &self,
        conn: &Arc<Connection>,
        message: Vec<u8>,
        refusal: wasmrpc_torch_sys::BudgetRefusal,
    ) {
        let Some(inner) = self.agent.upgrade() else {
            return;
        };
        let agent = RpcAgent::from_inner(inner);
        let message = match Message::decode(&message) {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(peer = %conn.peer, "dropping a frame over the tensor memory budget: {e}");
                return;
            }
        };
        let what = format!("{} from worker {}", message.describe(), conn.peer);
        let error = crate::tensor::budget::refusal_error(agent.name(), &what, refusal, false);
        if let Some(held_back) = agent.inner.warn_limit.admit(&conn.peer) {
            let note = super::warn_limit::held_back_note(held_back);
            tracing::warn!(peer = %conn.peer, "{error}{note}");
        }
        let id = message.id();
        match message {
            // The reply to one of this worker's requests: its call fails.
            Message::Response { .. } => agent.finish(id, Err(error)),
            // A request: its sender gets the error as the answer.
            Message::Call { .. } | Message::Request { .. } => {
                let conn = conn.clone();
                agent.inner.runtime.clone().spawn(async move {
                    agent.respond(&conn, id, Err(error), Vec::new()).await;
                });
            }
        }
    }

    fn on_silent(&self, conn: &Arc<Connection>, cause: &str) {
        if let Some(inner) = self.agent.upgrade() {
            RpcAgent::from_inner(inner).declare_failed(&conn.peer, cause);
        }
    }

    fn on_close(&self, conn: &Arc<Connection>, reason: &str) {
        let Some(inner) = self.agent.upgrade() else {
            return;
        };
        let agent = RpcAgent::from_inner(inner);
        let id = conn.id;
        let peer = conn.peer.clone();
        let waiting = std::sync::atomic::AtomicUsize::new(0);
        agent.fail_pending_where(
            |p| p.conn == id,
            |p| {
                waiting.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                Error::runtime(format!(
                    "connection to worker {peer} closed while a call of {} was pending: {reason}",
                    p.function
                ))
            },
        );
        // A peer gone with calls waiting on it failed (`failures`); one
        // that closes an idle connection is leaving or shutting down. Once
        // this worker's own shutdown began, peers that finished theirs
        // close connections too: no failure, unless an all-gather of this
        // worker still expects a message from it (AG-8).
        let running =
            agent.inner.state.load(std::sync::atomic::Ordering::Acquire) == super::RUNNING;
        let expected =
            (waiting.into_inner() > 0 && running) || agent.inner.gather.is_awaited(&peer);
        if expected && let Some(cause) = peer_gone(&peer, reason) {
            agent.declare_failed(&peer, &cause);
        }
    }
}

/// The cause of a failure, when the connection's close came from the
/// peer's side (it closed the connection, or the connection broke under
/// it), without the worker's name, which the failure's text puts first.
/// A close this worker decided (a bad frame from the peer, its own
/// shutdown) is no sign that the peer is gone: `None`.
fn peer_gone(peer: &str, reason: &str) -> Option<String> {
    if reason == format!("worker {peer} closed the connection") {
        return Some("it closed the connection".to_string());
    }
    reason
        .strip_prefix(&format!("connection to worker {peer} failed: "))
        .map(|error| format!("connection lost: {error}"))
}
