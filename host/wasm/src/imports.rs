//! The host functions a guest imports from the `wasmrpc` module: decoding a
//! [`HostCall`], running it against the call's [`GuestHost`], and handing
//! the encoded reply back.
//!
//! Requests the runtime answers itself: `Panicked` (kept for the trap's
//! error), `Lock`/`Unlock` bookkeeping (locks a call still holds are released
//! when it ends), `Sleep` argument checks, and `FutureThen`, which runs a
//! function of the same plugin on a pooled instance when the future
//! completes.

use crate::host::{GuestHost, HostResult, runtime_error};
use crate::instance::{CallCtx, StoreData};
use std::sync::Arc;
use std::time::{Duration, Instant};
use wasmrpc_abi::protocol::{
    CallArgs, EXPORT_MEMORY, HandleKind, HostCall, HostReply, IMPORT_CALL, IMPORT_MODULE,
    IMPORT_TAKE_REPLY, RpcMode,
};
use wasmrpc_abi::{ErrorKind, RemoteError, Value};
use wasmtime::{Caller, Extern, Linker, Memory};

fn memory(caller: &mut Caller<'_, StoreData>) -> wasmtime::Result<Memory> {
    caller
        .get_export(EXPORT_MEMORY)
        .and_then(Extern::into_memory)
        .ok_or_else(|| wasmtime::Error::msg("the guest exports no memory"))
}

/// Defines `wasmrpc.call` and `wasmrpc.take_reply` in `linker`.
pub(crate) fn define(linker: &mut Linker<StoreData>) -> wasmtime::Result<()> {
    linker.func_wrap_async(
        IMPORT_MODULE,
        IMPORT_CALL,
        |mut caller: Caller<'_, StoreData>, (ptr, len): (u32, u32)| {
            Box::new(async move {
                let mem = memory(&mut caller)?;
                let request = (ptr as usize)
                    .checked_add(len as usize)
                    .and_then(|end| mem.data(&caller).get(ptr as usize..end))
                    .map(<[u8]>::to_vec)
                    .ok_or_else(|| wasmtime::Error::msg("host request out of bounds"))?;
                let reply = match wasmrpc_abi::decode::<HostCall>(&request) {
                    Err(e) => Err(runtime_error(format!("malformed host request: {e}"))),
                    Ok(HostCall::Panicked(message)) => {
                        caller.data_mut().panic = Some(message);
                        Ok(HostReply::Unit)
                    }
                    Ok(call) => {
                        let ctx =
                            caller.data().ctx.clone().ok_or_else(|| {
                                wasmtime::Error::msg("host request outside a call")
                            })?;
                        let start = Instant::now();
                        let reply = dispatch(&ctx, call).await;
                        caller.data_mut().host_time += start.elapsed();
                        reply
                    }
                };
                let bytes = wasmrpc_abi::encode(&reply).map_err(wasmtime::Error::msg)?;
                let n = u32::try_from(bytes.len())
                    .map_err(|_| wasmtime::Error::msg("reply larger than 4 GiB"))?;
                caller.data_mut().reply = bytes;
                Ok(n)
            })
        },
    )?;
    linker.func_wrap(
        IMPORT_MODULE,
        IMPORT_TAKE_REPLY,
        |mut caller: Caller<'_, StoreData>, ptr: u32| -> wasmtime::Result<()> {
            let reply = std::mem::take(&mut caller.data_mut().reply);
            let mem = memory(&mut caller)?;
            mem.write(&mut caller, ptr as usize, &reply)
                .map_err(|_| wasmtime::Error::msg("reply buffer out of bounds"))
        },
    )?;
    Ok(())
}

/// Runs one request against the call's host.
pub(crate) async fn dispatch(ctx: &Arc<CallCtx>, call: HostCall) -> HostResult<HostReply> {
    if let Some(route) = &ctx.route {
        // VIS-2: a visit's request runs in its visitor's task.
        let (reply, replied) = tokio::sync::oneshot::channel();
        if route.send((call, reply)).is_err() {
            return Err(runtime_error("the call this visit ran for has gone"));
        }
        return replied
            .await
            .unwrap_or_else(|_| Err(runtime_error("the call this visit ran for has gone")));
    }
    let host = &ctx.host;
    Ok(match call {
        HostCall::Op { name, args } => HostReply::Value(host.op(&name, args).await?),
        HostCall::TensorNew { dtype, shape, data } => {
            let numel = shape.iter().try_fold(1usize, |n, &d| {
                usize::try_from(d).ok().and_then(|d| n.checked_mul(d))
            });
            if numel.and_then(|n| n.checked_mul(dtype.size())) != Some(data.len()) {
                return Err(RemoteError::new(
                    ErrorKind::ValueError,
                    format!(
                        "{} bytes do not make a {dtype:?} tensor of shape {shape:?}",
                        data.len()
                    ),
                ));
            }
            HostReply::Handle(host.tensor_new(dtype, shape, data).await?)
        }
        HostCall::TensorMeta(t) => HostReply::Meta(host.tensor_meta(t).await?),
        HostCall::TensorData(t) => {
            let (meta, data) = host.tensor_data(t).await?;
            HostReply::Data(meta, data)
        }
        HostCall::Dup(kind, h) => HostReply::Handle(host.dup(kind, h).await?),
        HostCall::Drop(kind, h) => {
            host.drop_handle(kind, h).await?;
            HostReply::Unit
        }
        HostCall::Rpc {
            mode,
            to,
            function,
            args,
            timeout,
        } => match mode {
            RpcMode::Sync => HostReply::Value(host.rpc_sync(&to, &function, args, timeout).await?),
            RpcMode::Async => {
                HostReply::Handle(host.rpc_async(&to, &function, args, timeout).await?)
            }
            RpcMode::Remote => HostReply::Handle(host.remote(&to, &function, args, timeout).await?),
        },
        HostCall::RRefToHere(r) => HostReply::Value(host.rref_to_here(r).await?),
        HostCall::RRefOwner(r) => HostReply::Worker(host.rref_owner(r).await?),
        HostCall::RRefNew(v) => HostReply::Handle(host.rref_new(v).await?),
        HostCall::RRefProxyCall {
            rref,
            mode,
            method,
            args,
            timeout,
        } => match mode {
            RpcMode::Sync => {
                HostReply::Value(host.rref_rpc_sync(rref, &method, args, timeout).await?)
            }
            RpcMode::Async => {
                HostReply::Handle(host.rref_rpc_async(rref, &method, args, timeout).await?)
            }
            RpcMode::Remote => {
                HostReply::Handle(host.rref_remote(rref, &method, args, timeout).await?)
            }
        },
        HostCall::RRefIsOwner(r) => HostReply::Bool(host.rref_is_owner(r).await?),
        HostCall::KeepObject { object, class } => {
            HostReply::Bool(host.keep_object(object, &class).await?)
        }
        HostCall::RRefFetch(r) => HostReply::Handle(host.rref_fetch(r).await?),
        HostCall::RRefOfObject { object, class } => {
            HostReply::Handle(host.rref_of_object(object, &class).await?)
        }
        HostCall::RRefLocalObject(r) => HostReply::Value(match host.rref_local_object(r).await? {
            Some(id) => Value::Int(i64::from(id)),
            None => Value::None,
        }),
        HostCall::RRefConfirmed(r) => HostReply::Bool(host.rref_confirmed_by_owner(r).await?),
        HostCall::FutureNew => HostReply::Handle(host.future_new().await?),
        HostCall::FutureSet { future, result } => {
            host.future_set(future, result).await?;
            HostReply::Unit
        }
        HostCall::FutureWait(f) => HostReply::Value(host.future_wait(f).await?),
        HostCall::FutureDone(f) => HostReply::Bool(host.future_done(f).await?),
        HostCall::FutureThen {
            future,
            function,
            extra,
        } => HostReply::Handle(then(ctx, future, function, extra).await?),
        HostCall::FutureShared { key, take } => {
            HostReply::Handle(host.future_shared(&key, take).await?)
        }
        HostCall::WorkerInfo(name) => HostReply::Worker(host.worker_info(name.as_deref()).await?),
        HostCall::GlobalGet(key) => HostReply::Value(host.global_get(&key).await?),
        HostCall::GlobalSet(key, value) => {
            host.global_set(&key, value).await?;
            HostReply::Unit
        }
        HostCall::Lock(key) => {
            host.lock(&key).await?;
            ctx.locks
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(key);
            HostReply::Unit
        }
        HostCall::Unlock(key) => {
            let held = {
                let mut locks = ctx.locks.lock().unwrap_or_else(|p| p.into_inner());
                locks
                    .iter()
                    .rposition(|k| *k == key)
                    .map(|i| locks.remove(i))
            };
            if held.is_none() {
                return Err(runtime_error(format!(
                    "lock `{key}` is not held by this call"
                )));
            }
            host.unlock(&key).await?;
            HostReply::Unit
        }
        HostCall::Sleep(seconds) => {
            if !(seconds.is_finite() && seconds >= 0.0) {
                return Err(RemoteError::new(
                    ErrorKind::ValueError,
                    "sleep length must be non-negative",
                ));
            }
            host.sleep(Duration::from_secs_f64(seconds.min(1e9)))
                .await?;
            HostReply::Unit
        }
        HostCall::Log(level, message) => {
            host.log(level, &message).await?;
            HostReply::Unit
        }
        HostCall::Progress(report) => {
            host.progress(report).await?;
            HostReply::Unit
        }
        HostCall::Panicked(_) => HostReply::Unit,
        HostCall::Autograd(call) => HostReply::Value(host.autograd(call).await?),
        HostCall::File(call) => HostReply::Value(host.file(call).await?),
        HostCall::RecordFunctionEnter(name) => {
            HostReply::Handle(host.record_function_enter(&name).await?)
        }
        HostCall::RecordFunctionExit(range) => {
            host.record_function_exit(range).await?;
            HostReply::Unit
        }
    })
}

/// Gives every handle in `value` a second handle, so that a value borrowed
/// from a request can outlive it.
async fn dup_value(host: &Arc<dyn GuestHost>, value: &Value) -> HostResult<Value> {
    Ok(match value {
        Value::Tensor(h) => Value::Tensor(host.dup(HandleKind::Tensor, *h).await?),
        Value::RRef(h) => Value::RRef(host.dup(HandleKind::RRef, *h).await?),
        Value::List(items) => Value::List(Box::pin(dup_all(host, items)).await?),
        Value::Tuple(items) => Value::Tuple(Box::pin(dup_all(host, items)).await?),
        Value::Dict(pairs) => {
            let mut out = Vec::with_capacity(pairs.len());
            for (k, v) in pairs {
                out.push((
                    Box::pin(dup_value(host, k)).await?,
                    Box::pin(dup_value(host, v)).await?,
                ));
            }
            Value::Dict(out)
        }
        Value::Record { name, fields } => {
            let mut out = Vec::with_capacity(fields.len());
            for (k, v) in fields {
                out.push((k.clone(), Box::pin(dup_value(host, v)).await?));
            }
            Value::Record {
                name: name.clone(),
                fields: out,
            }
        }
        other => other.clone(),
    })
}

async fn dup_all(host: &Arc<dyn GuestHost>, items: &[Value]) -> HostResult<Vec<Value>> {
    let mut out = Vec::with_capacity(items.len());
    for v in items {
        out.push(dup_value(host, v).await?);
    }
    Ok(out)
}

/// Releases every handle in `value`.
pub(crate) async fn release(host: &Arc<dyn GuestHost>, value: &Value) {
    match value {
        Value::Tensor(h) => {
            let _ = host.drop_handle(HandleKind::Tensor, *h).await;
        }
        Value::RRef(h) => {
            let _ = host.drop_handle(HandleKind::RRef, *h).await;
        }
        Value::List(items) | Value::Tuple(items) => {
            for v in items {
                Box::pin(release(host, v)).await;
            }
        }
        Value::Dict(pairs) => {
            for (k, v) in pairs {
                Box::pin(release(host, k)).await;
                Box::pin(release(host, v)).await;
            }
        }
        Value::Record { fields, .. } => {
            for (_, v) in fields {
                Box::pin(release(host, v)).await;
            }
        }
        _ => {}
    }
}

/// `FutureThen`: a new future that completes with `function(v, *extra)`
/// once `future` completes with `v` (a `RuntimeError` with the callback's
/// message if it fails), or with `future`'s error.
///
/// The callback runs with the chaining call's own [`GuestHost`], so every
/// handle that call holds is valid in it: a guest passes a future it made
/// (by its handle) to a callback that completes it, as a Python closure
/// captures one (the seeds' `Future()` set from a `then` callback, and the
/// lock-protected fan-in of `async_add_multi_fanout`).
async fn then(
    ctx: &Arc<CallCtx>,
    future: u32,
    function: String,
    extra: Vec<Value>,
) -> HostResult<u32> {
    let host = ctx.host.clone();
    if ctx.plugin.manifest().function(&function).is_none() {
        return Err(RemoteError::new(
            ErrorKind::AttributeError,
            format!(
                "plugin `{}` has no function `{function}`",
                ctx.plugin.name()
            ),
        ));
    }
    // The guest owns `future`, `extra` and the returned handle, and may drop
    // them as soon as this request returns: the task works on its own.
    let source = host.dup(HandleKind::Future, future).await?;
    let extra = dup_all(&host, &extra).await?;
    let result = host.future_new().await?;
    let target = host.dup(HandleKind::Future, result).await?;
    let (plugin, runtime) = (ctx.plugin.clone(), ctx.runtime.clone());
    tokio::spawn(async move {
        let value = host.future_wait(source).await;
        let _ = host.drop_handle(HandleKind::Future, source).await;
        let outcome = match value {
            Ok(v) => {
                let mut args = vec![v];
                args.extend(extra);
                let args = CallArgs {
                    args,
                    kwargs: Vec::new(),
                };
                // An error the callback raises becomes a `RuntimeError`
                // with its message, as in the host's `Future::then` and
                // `torch.futures` (the parent's own error, below, passes
                // through unchanged).
                runtime
                    .call(&plugin, &function, args, host.clone())
                    .await
                    .map_err(|e| {
                        let e = RemoteError::from(e);
                        RemoteError::new(ErrorKind::RuntimeError, e.message)
                    })
            }
            Err(e) => {
                for v in &extra {
                    release(&host, v).await;
                }
                Err(e)
            }
        };
        // `future_set` borrows the value's handles; the task owns them.
        let owned = outcome.as_ref().ok().cloned();
        if let Err(e) = host.future_set(target, outcome).await {
            tracing::warn!("cannot complete a `then` future: {e}");
        }
        if let Some(v) = owned {
            release(&host, &v).await;
        }
        let _ = host.drop_handle(HandleKind::Future, target).await;
    });
    Ok(result)
}
