//! The caller's side of the agent: every way to call a peer ends in
//! [`RpcAgent::call`] (functions) or [`RpcAgent::request`] (a feature's
//! requests), and both in `send`, which owns the pending table: a call
//! is pending from the moment it is sent until it ends once (AG-3), with
//! its response, its timeout, the failure of its connection, or shutdown.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tch::Tensor;

use super::extension::{CallKind, CallScope, OutgoingCall};
use super::message::{CALL, Field, Fields, Message};
use super::{CallContext, Dest, Future, INTERNAL_PREFIX, Pending, RpcAgent, future, registry};
use crate::abi::{Value, WorkerInfo};
use crate::device::MapDirection;
use crate::error::{Error, Result, rpc_timeout_message, unknown_function_message};
use crate::transport::{MessageKind, OutFrame};
use crate::value::{Args, Payload};

/// Options of one call ([`RpcAgent::call`]).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CallOptions {
    /// The call's timeout: `None` for the agent's default, zero for none.
    pub timeout: Option<Duration>,
    /// How the call is made (what the profiler records, whether it counts
    /// as a user call and is collected by `wait_all_scope`).
    pub kind: CallKind,
    /// Fields sent with the call as given, instead of what the features
    /// named by them would add (a feature forwarding a call it serves).
    pub fields: Fields,
    /// A feature's own call that carries a user's values (`remote()`'s
    /// creation, `to_here`, an RRef proxy's method): features that follow
    /// user values from call to call treat it as a user call
    /// ([`OutgoingCall::user_values`](super::OutgoingCall)).
    pub user_values: bool,
}

impl CallOptions {
    /// A call of `kind` with the default timeout.
    pub fn new(kind: CallKind) -> Self {
        CallOptions {
            kind,
            ..Default::default()
        }
    }

    /// With its own timeout; zero means none.
    #[must_use]
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// Marks a feature's own call as carrying a user's values
    /// ([`user_values`](Self::user_values)).
    #[must_use]
    pub fn carrying_user_values(mut self) -> Self {
        self.user_values = true;
        self
    }
}

/// A call's positional and keyword values.
type CallValues = (Vec<Value>, Vec<(String, Value)>);

/// The error of a call whose frame could not be sent.
fn send_failure(e: Error, function: &str, peer: &str) -> Error {
    e.context_line(format!("sending a call of {function} to worker {peer}"))
}

/// What is sent: a call of a function, or a feature's request.
pub(super) struct Outgoing<'a> {
    /// The function, or `"a request"`.
    pub(super) what: &'a str,
    /// The frame's kind.
    pub(super) kind: MessageKind,
    /// The message, given its request id.
    pub(super) build: Box<dyn FnOnce(u64) -> Message + 'a>,
    /// Its tensors.
    pub(super) tensors: &'a [Tensor],
    /// Whether it is a user call (AG-5's counts).
    pub(super) user: bool,
    /// Which device map its tensors follow.
    pub(super) direction: MapDirection,
}

impl RpcAgent {
    /// Calls `function` on `to` and returns at once (`rpc_async`), with the
    /// default timeout as it is now.
    ///
    /// Argument tensors are not copied before they are sent: keep them
    /// unchanged until the future completes. Errors (unknown destination,
    /// agent shut down, remote failure, timeout) complete the future.
    pub fn rpc_async(&self, to: impl Into<Dest>, function: &str, args: Args) -> Future {
        self.call(to, function, args, CallOptions::new(CallKind::Async))
    }

    /// [`rpc_async`](Self::rpc_async) with its own timeout; zero means none.
    pub fn rpc_async_with_timeout(
        &self,
        to: impl Into<Dest>,
        function: &str,
        args: Args,
        timeout: Duration,
    ) -> Future {
        let options = CallOptions::new(CallKind::Async).timeout(timeout);
        self.call(to, function, args, options)
    }

    /// Calls `function` on `to` and waits for its result (`rpc_sync`).
    ///
    /// # Errors
    /// The callee's error with its kind and message, a timeout ("RPC ran for
    /// more than ..."), a failed connection (naming the worker), or the
    /// destination errors of [`resolve`](Self::resolve).
    pub async fn rpc_sync(
        &self,
        to: impl Into<Dest>,
        function: &str,
        args: Args,
    ) -> Result<Payload> {
        self.call(to, function, args, CallOptions::new(CallKind::Sync))
            .wait()
            .await
    }

    /// [`rpc_sync`](Self::rpc_sync) with its own timeout; zero means none.
    ///
    /// # Errors
    /// As [`rpc_sync`](Self::rpc_sync).
    pub async fn rpc_sync_with_timeout(
        &self,
        to: impl Into<Dest>,
        function: &str,
        args: Args,
        timeout: Duration,
    ) -> Result<Payload> {
        let options = CallOptions::new(CallKind::Sync).timeout(timeout);
        self.call(to, function, args, options).wait().await
    }

    /// Runs the registered `function` on this worker, in the calling task,
    /// with nothing serialized: what a call from this worker to itself does
    /// once it has arrived (the caller is this worker). For embedders that
    /// run a plugin's function where they are, and for measuring a
    /// function's own cost apart from the network.
    ///
    /// # Errors
    /// "... is not registered on worker ..." for an unknown name, else the
    /// function's error (a panic becomes a `RuntimeError`).
    pub async fn call_local(&self, function: &str, args: Args) -> Result<Payload> {
        let f = self
            .registry()
            .get(function)
            .ok_or_else(|| Error::runtime(unknown_function_message(function, self.name())))?;
        let ctx = CallContext::new(
            self.clone(),
            self.info().clone(),
            function.to_string(),
            Arc::default(),
        );
        registry::call_guarded(f, ctx, args).await
    }

    /// Calls `function` on `to`: what every public way of calling a
    /// function comes down to. The features add what they add to the call
    /// ([`Extension::on_call`](super::Extension::on_call)); RRefs among the
    /// arguments are forked toward `to`.
    pub fn call(
        &self,
        to: impl Into<Dest>,
        function: &str,
        args: Args,
        options: CallOptions,
    ) -> Future {
        // Calls to the agent's own functions are never user calls, whoever
        // makes them: both ends must agree for the join's counts (AG-5).
        let user = options.kind != CallKind::Internal && !function.starts_with(INTERNAL_PREFIX);
        let collect = user && options.kind == CallKind::Async;
        let failed = |e: Error| {
            let fut = Future::new();
            if collect {
                future::collect(&fut);
            }
            let _ = fut.set_error(e);
            fut
        };
        let to = to.into();
        if let Err(e) = self.require_running() {
            // PyTorch serializes a call's arguments before it sends: a
            // deleted RRef among them fails as its fork does, whatever the
            // agent's state ("Cannot call fork an UserRRef after deletion.").
            if !args.rrefs.is_empty()
                && let Ok(dest) = self.resolve(to)
                && let Err(fork) = self.values_to_wire(
                    &dest,
                    args.positional.clone(),
                    args.kwargs.clone(),
                    &args.rrefs,
                )
            {
                return failed(fork.context_line(format!("sending RRefs to call {function}")));
            }
            return failed(e);
        }
        let dest = match self.resolve(to) {
            Ok(d) => d,
            Err(e) => return failed(e),
        };
        let Args {
            positional,
            kwargs,
            tensors,
            rrefs,
        } = args;
        let (positional, kwargs) = if rrefs.is_empty() {
            (positional, kwargs)
        } else {
            match self.values_to_wire(&dest, positional, kwargs, &rrefs) {
                Ok(pk) => pk,
                Err(e) => {
                    return failed(e.context_line(format!("sending RRefs to call {function}")));
                }
            }
        };
        let outgoing = OutgoingCall {
            agent: self,
            to: &dest,
            function,
            kind: options.kind,
            user_values: options.user_values || !function.starts_with(INTERNAL_PREFIX),
            tensors: &tensors,
            fields: &options.fields,
        };
        let mut scopes: Vec<(&'static str, Box<dyn CallScope>)> = self
            .inner
            .extensions
            .iter()
            .filter(|e| super::message::field(&options.fields, e.name()).is_none())
            .filter_map(|e| e.on_call(&outgoing).map(|s| (e.name(), s)))
            .collect();
        let given = options.fields;
        let build = |id| {
            let mut fields = given;
            for (feature, scope) in &mut scopes {
                if let Some(bytes) = scope.field(id) {
                    fields.push(Field {
                        feature: feature.to_string(),
                        bytes,
                    });
                }
            }
            Message::Call {
                id,
                function: function.to_string(),
                args: positional,
                kwargs,
                fields,
            }
        };
        let fut = self.send(
            &dest,
            Outgoing {
                what: function,
                kind: CALL,
                build: Box::new(build),
                tensors: &tensors,
                user,
                direction: MapDirection::Request,
            },
            options.timeout,
            collect,
        );
        for (_, scope) in scopes {
            scope.sent(&fut);
        }
        fut
    }

    /// Forks the RRefs of a call's arguments toward `to` (the
    /// [`HandleCodec`](super::HandleCodec) of the feature that owns RRefs).
    fn values_to_wire(
        &self,
        to: &WorkerInfo,
        positional: Vec<Value>,
        kwargs: Vec<(String, Value)>,
        handles: &[crate::value::Handle],
    ) -> Result<CallValues> {
        let codec = self
            .inner
            .extensions
            .handles()
            .ok_or_else(no_rref_feature)?;
        let positional = positional
            .into_iter()
            .map(|v| codec.encode(self, to, v, handles))
            .collect::<Result<Vec<_>>>()?;
        let kwargs = kwargs
            .into_iter()
            .map(|(k, v)| Ok((k, codec.encode(self, to, v, handles)?)))
            .collect::<Result<Vec<_>>>()?;
        Ok((positional, kwargs))
    }

    /// Sends a request of `kind` (a feature's: RRef forks, gradients,
    /// deployment) with `body`, the feature's encoding, and returns the
    /// future of its response. A worker where no feature serves `kind`
    /// answers with a `NotImplementedError`. `timeout`: `None` for the
    /// default, zero for none.
    pub fn request(
        &self,
        to: impl Into<Dest>,
        kind: MessageKind,
        body: Vec<u8>,
        tensors: &[Tensor],
        timeout: Option<Duration>,
    ) -> Future {
        self.request_mapped(to, kind, body, tensors, timeout, MapDirection::Request)
    }

    /// [`request`](Self::request) whose tensors travel with the map
    /// `direction` names: gradients sent back toward the caller of a
    /// request use the inverse of that caller's map (`crate::dist_autograd`).
    pub(crate) fn request_mapped(
        &self,
        to: impl Into<Dest>,
        kind: MessageKind,
        body: Vec<u8>,
        tensors: &[Tensor],
        timeout: Option<Duration>,
        direction: MapDirection,
    ) -> Future {
        let dest = match self.require_running().and_then(|()| self.resolve(to)) {
            Ok(d) => d,
            Err(e) => {
                let fut = Future::new();
                let _ = fut.set_error(e);
                return fut;
            }
        };
        let build = move |id| Message::Request {
            id,
            kind: kind.name().to_string(),
            body,
        };
        self.send(
            &dest,
            Outgoing {
                what: "a request",
                kind,
                build: Box::new(build),
                tensors,
                user: false,
                direction,
            },
            timeout,
            false,
        )
    }

    /// Sends `out` to `dest` and tracks it in the pending table until it
    /// ends (AG-3).
    fn send(
        &self,
        dest: &WorkerInfo,
        out: Outgoing<'_>,
        timeout: Option<Duration>,
        collect: bool,
    ) -> Future {
        let fut = Future::new();
        if collect {
            future::collect(&fut);
        }
        let function = out.what;
        // FAIL-1: nothing is sent to a worker declared failed.
        if let Some(failure) = self.failure_of(&dest.name) {
            let _ = fut.set_error(Error::runtime(failure.to_string()));
            return fut;
        }
        let timeout = timeout.unwrap_or_else(|| self.get_rpc_timeout());
        let inner = &self.inner;
        let id = inner.next_id.fetch_add(1, Ordering::Relaxed);
        let devices = crate::device::devices_for(self, &dest.name, out.direction, out.tensors);
        let frame = match devices
            .and_then(|d| OutFrame::encode((out.build)(id).encode()?, out.kind, out.tensors, &d))
        {
            Ok(f) => f,
            Err(e) => {
                let _ = fut.set_error(
                    e.context_line(format!("encoding a call of {function} to {}", dest.name)),
                );
                return fut;
            }
        };
        // A peer already connected: the frame is sent from here (TR-5),
        // with no task to spawn; the pending entry knows its connection
        // before the frame leaves, so a close fails it.
        let deadline =
            (!timeout.is_zero()).then(|| (tokio::time::Instant::now() + timeout, timeout));
        let open = self
            .transport()
            .ok()
            .and_then(|t| t.open_connection(&dest.name).map(|c| (t, c)));
        {
            let mut pending = inner.pending.lock().unwrap_or_else(|p| p.into_inner());
            // AG-3: the stop marks the agent stopped before it fails what is
            // pending, under this lock; a call that got past
            // `require_running` while the agent was stopping and comes here
            // after that sweep would otherwise stay pending forever.
            if !self.is_running() {
                drop(pending);
                let _ = fut.set_error(
                    Error::not_initialized()
                        .context_line(format!("calling {function} on worker {}", dest.name)),
                );
                return fut;
            }
            pending.insert(
                id,
                Pending {
                    future: fut.clone(),
                    peer: dest.name.clone(),
                    function: function.to_string(),
                    conn: open.as_ref().map_or(0, |(_, c)| c.id),
                    work: open.as_ref().map(|(_, c)| c.start_work()),
                    user: out.user,
                    deadline,
                },
            );
        }
        if let Some((at, _)) = deadline {
            inner.deadlines.insert(at, id);
        }
        if out.user {
            inner.user_sent.fetch_add(1, Ordering::AcqRel);
            inner.user_pending.fetch_add(1, Ordering::AcqRel);
        }
        let frame = match open {
            Some((transport, conn)) => match transport.send_now(&conn, frame) {
                Ok(Ok(())) => None,
                Ok(Err(e)) => {
                    self.finish(id, Err(send_failure(e, function, &dest.name)));
                    None
                }
                Err(frame) => Some(frame),
            },
            None => Some(frame),
        };
        if let Some(frame) = frame {
            // Dialing, or faults to apply: the send runs as its own task, to
            // completion even if the call times out first (the message still
            // reaches the callee, as in PyTorch).
            let sender = self.clone();
            let sent_function = function.to_string();
            let peer = dest.name.clone();
            inner.runtime.spawn(async move {
                if let Err(e) = sender.send_call(id, &peer, &sent_function, frame).await {
                    sender.finish(id, Err(send_failure(e, &sent_function, &peer)));
                }
            });
        }
        fut
    }

    async fn send_call(&self, id: u64, peer: &str, function: &str, frame: OutFrame) -> Result<()> {
        let transport = self.transport()?;
        let addr = self.member_by_name(peer)?.addr;
        let conn = transport.connection(peer, addr).await?;
        {
            let mut pending = self.inner.pending.lock().unwrap_or_else(|p| p.into_inner());
            match pending.get_mut(&id) {
                Some(p) => {
                    p.conn = conn.id;
                    p.work = Some(conn.start_work());
                }
                None => return Ok(()),
            }
        }
        if conn.is_closed() {
            return Err(Error::runtime(format!(
                "connection to worker {peer} closed before the call was sent"
            )));
        }
        transport.send_on(&conn, frame, Some(function)).await
    }

    /// The function of pending call `id`, if it is still pending.
    pub(super) fn pending_function(&self, id: u64) -> Option<String> {
        self.inner
            .pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&id)
            .map(|p| p.function.clone())
    }

    /// Ends pending call `id` (AG-3: only the first end counts).
    pub(super) fn finish(&self, id: u64, result: Result<Payload>) {
        let p = self
            .inner
            .pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&id);
        if let Some(p) = p {
            if let Some((at, _)) = p.deadline {
                self.inner.deadlines.remove(at, id);
            }
            if p.user {
                self.inner.user_pending.fetch_sub(1, Ordering::AcqRel);
                self.inner.quiet.notify_waiters();
            }
            // TR-10: the call's work ends before its caller hears of it, so
            // the caller's next call is not taken for one made while this
            // one is in progress.
            drop(p.work);
            let _ = p.future.complete(result);
        }
    }

    /// The sweeper's side of `deadlines`: call `id` ran out of time.
    pub(super) fn expire(&self, id: u64) {
        let error = {
            let pending = self.inner.pending.lock().unwrap_or_else(|p| p.into_inner());
            pending.get(&id).and_then(|p| {
                let (_, timeout) = p.deadline?;
                Some(
                    Error::runtime(rpc_timeout_message(timeout.as_millis()))
                        .context_line(format!("calling {} on worker {}", p.function, p.peer)),
                )
            })
        };
        if let Some(e) = error {
            self.finish(id, Err(e));
        }
    }

    /// Ends every pending call `pred` selects with its `error`.
    pub(super) fn fail_pending_where(
        &self,
        pred: impl Fn(&Pending) -> bool,
        error: impl Fn(&Pending) -> Error,
    ) {
        let ids: Vec<u64> = self
            .inner
            .pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter(|(_, p)| pred(p))
            .map(|(id, _)| *id)
            .collect();
        for id in ids {
            let e = self
                .inner
                .pending
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .get(&id)
                .map(&error);
            if let Some(e) = e {
                self.finish(id, Err(e));
            }
        }
    }
}

/// The error of sending RRefs from an agent without the RRef feature.
pub(super) fn no_rref_feature() -> Error {
    Error::runtime(
        "this agent has no extension that sends RRefs: start it with the RRef feature (wasmrpc::init_rpc gives every feature)",
    )
}
