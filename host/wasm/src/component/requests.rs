//! The world's `host` interface on the store's data: each function is the
//! [`HostCall`] a Rust guest would send, answered by the same host
//! functions ([`crate::imports::dispatch`]).

use super::bindings::wasmrpc::plugin::{host, types};
use super::convert::{
    call_args_from_wit, call_args_to_wit, dtype_from_wit, error_from_wit, error_to_wit,
    kind_from_wit, meta_to_wit, mode_from_wit, value_from_wit, value_to_wit,
};
use crate::instance::StoreData;
use crate::visit::VisitTarget;
use std::time::Instant;
use wasmrpc_abi::protocol::{self as abi, HostCall, HostReply};
use wasmrpc_abi::{ErrorKind, RemoteError};
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

    async fn rref_local_object(&mut self, rref: u32) -> R<Option<u32>> {
        match self.request(HostCall::RRefLocalObject(rref)).await? {
            HostReply::Value(wasmrpc_abi::Value::None) => Ok(None),
            HostReply::Value(wasmrpc_abi::Value::Int(id)) => match u32::try_from(id) {
                Ok(id) => Ok(Some(id)),
                Err(_) => Err(unexpected(HostReply::Value(wasmrpc_abi::Value::Int(id)))),
            },
            other => Err(unexpected(other)),
        }
    }

    async fn keep_object(&mut self, object: u32, class: String) -> R<bool> {
        bool_reply(self.request(HostCall::KeepObject { object, class }).await?)
    }

    async fn rref_fetch(&mut self, rref: u32) -> R<u32> {
        handle_reply(self.request(HostCall::RRefFetch(rref)).await?)
    }

    async fn rref_of_object(&mut self, object: u32, class: String) -> R<u32> {
        handle_reply(
            self.request(HostCall::RRefOfObject { object, class })
                .await?,
        )
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

    async fn future_wait_serving(&mut self, fut: u32) -> R<types::Wake> {
        let Some(ctx) = self.ctx.clone() else {
            return Err(error_to_wit(RemoteError::new(
                ErrorKind::RuntimeError,
                "a host request outside a call (from the plugin's start-up code)",
            )));
        };
        let Some(inbox) = ctx.inbox.clone() else {
            return value_reply(self.request(HostCall::FutureWait(fut)).await?)
                .map(types::Wake::Done);
        };
        let start = Instant::now();
        // The wait is dropped when a visit comes first: waiting on a future
        // is idempotent, and the guest waits again once it has run it.
        let wait = crate::imports::dispatch(&ctx, HostCall::FutureWait(fut));
        let woken = tokio::select! {
            biased;
            reply = wait => Ok(reply),
            visit = inbox.next() => Err(visit),
        };
        self.host_time += start.elapsed();
        match woken {
            Ok(reply) => value_reply(reply.map_err(error_to_wit)?).map(types::Wake::Done),
            Err(mut visit) => {
                let routed = visit.routed_ctx(&ctx);
                visit.saved_ctx = self.ctx.replace(routed);
                let record = types::Visit {
                    id: u32::try_from(self.visits.len()).unwrap_or(u32::MAX),
                    object: match &visit.visit.target {
                        VisitTarget::Function(_) | VisitTarget::Constructor(_) => None,
                        VisitTarget::Method { object, .. } => Some(*object),
                    },
                    class: match &visit.visit.target {
                        VisitTarget::Function(_) | VisitTarget::Constructor(_) => String::new(),
                        VisitTarget::Method { class, .. } => class.clone(),
                    },
                    name: match &visit.visit.target {
                        VisitTarget::Function(name) | VisitTarget::Constructor(name) => {
                            name.clone()
                        }
                        VisitTarget::Method { method, .. } => method.clone(),
                    },
                    args: call_args_to_wit(&visit.visit.args),
                };
                self.visits.push(visit);
                Ok(types::Wake::Visit(record))
            }
        }
    }

    async fn visit_done(&mut self, id: u32, outcome: types::VisitOutcome) -> R<()> {
        let innermost = self.visits.len().checked_sub(1);
        if innermost.and_then(|i| u32::try_from(i).ok()) != Some(id) {
            return Err(error_to_wit(RemoteError::new(
                ErrorKind::RuntimeError,
                format!(
                    "visit-done for visit {id}, while {} visits run (the innermost ends first)",
                    self.visits.len()
                ),
            )));
        }
        let Some(mut visit) = self.visits.pop() else {
            unreachable!("checked above");
        };
        self.ctx = visit.saved_ctx.take();
        // The visit's guest time is its own, not the waiting call's.
        self.host_time += visit.started.elapsed();
        let outcome = match outcome {
            types::VisitOutcome::Returned(v) => match value_from_wit(&v) {
                Ok(v) => abi::Outcome::Return(v),
                Err(e) => abi::Outcome::Raise(RemoteError::new(ErrorKind::RuntimeError, e)),
            },
            types::VisitOutcome::Raised(e) => abi::Outcome::Raise(error_from_wit(e)),
            types::VisitOutcome::Future(f) => abi::Outcome::Future(f),
            types::VisitOutcome::Object(id) => abi::Outcome::Object(id),
        };
        visit.finish(outcome);
        Ok(())
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

    async fn set_grad(&mut self, tensor: u32, grad: Option<u32>) -> R<()> {
        let call = HostCall::Autograd(abi::AutogradCall::SetGrad(tensor, grad));
        value_reply(self.request(call).await?).map(drop)
    }

    async fn optimizer_state(&mut self, optimizer: i64) -> R<types::Value> {
        let call = HostCall::Autograd(abi::AutogradCall::OptimizerState(optimizer));
        value_reply(self.request(call).await?)
    }

    async fn optimizer_load_state(&mut self, optimizer: i64, state: types::Value) -> R<()> {
        let state = value_from_wit(&state).map_err(bad_value)?;
        let call = HostCall::Autograd(abi::AutogradCall::OptimizerLoadState { optimizer, state });
        value_reply(self.request(call).await?).map(drop)
    }

    async fn write_file(&mut self, path: String, data: Vec<u8>) -> R<()> {
        let call = HostCall::File(abi::FileCall::Write { path, data });
        value_reply(self.request(call).await?).map(drop)
    }

    async fn save_tensors(
        &mut self,
        path: String,
        tensors: Vec<(String, u32)>,
        metadata: Vec<(String, String)>,
    ) -> R<()> {
        let call = HostCall::File(abi::FileCall::SaveTensors {
            path,
            tensors,
            metadata,
        });
        value_reply(self.request(call).await?).map(drop)
    }

    async fn load_tensors(
        &mut self,
        path: String,
    ) -> R<(Vec<(String, u32)>, Vec<(String, String)>)> {
        let reply = self
            .request(HostCall::File(abi::FileCall::LoadTensors(path)))
            .await?;
        let malformed = || {
            error_to_wit(RemoteError::new(
                ErrorKind::RuntimeError,
                "the host's loaded tensors are malformed",
            ))
        };
        let HostReply::Value(wasmrpc_abi::Value::Tuple(parts)) = reply else {
            return Err(malformed());
        };
        let mut parts = parts.into_iter();
        let (Some(wasmrpc_abi::Value::Dict(tensors)), Some(wasmrpc_abi::Value::Dict(metadata))) =
            (parts.next(), parts.next())
        else {
            return Err(malformed());
        };
        let tensors = tensors
            .into_iter()
            .map(|(k, v)| match (k, v) {
                (wasmrpc_abi::Value::Str(name), wasmrpc_abi::Value::Tensor(h)) => Ok((name, h)),
                _ => Err(malformed()),
            })
            .collect::<R<Vec<_>>>()?;
        let metadata = metadata
            .into_iter()
            .filter_map(|(k, v)| match (k, v) {
                (wasmrpc_abi::Value::Str(k), wasmrpc_abi::Value::Str(v)) => Some((k, v)),
                _ => None,
            })
            .collect();
        Ok((tensors, metadata))
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
