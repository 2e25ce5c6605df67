//! RRef proxies: `rref.rpc_sync().method(args)` and its async and remote
//! forms, which call a method of the value on the owner.
//!
//! As in PyTorch, a proxy call first learns the value's type
//! (`_get_type` with the proxy's timeout, cached per user RRef), then calls
//! the owner's local-invoke function with the same timeout. On the owner,
//! tensor methods resolve through libtorch's operator registry, if the
//! owner's op policy admits them (POL-1)
//! (`wasmrpc_torch_sys::call_method_values_gated`, with Python's
//! `'Tensor' object has no attribute` text for unknown methods), and an
//! object's methods are the object's ([`super::RRefObject`]: a plugin
//! object runs them one at a time).

use std::time::Duration;

use tch::Tensor;

use super::{LOCAL_INVOKE, Owned, RRef, type_name_of};
use crate::abi::{ErrorKind, Value, WorkerInfo};
use crate::agent::{Dest, Future, RpcAgent};
use crate::error::{Error, Result};
use crate::ops::PolicyGate;
use crate::value::{Args, Payload};

/// How a proxy returns its results.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RRefProxyMode {
    /// `rref.rpc_sync()`: wait for the result.
    Sync,
    /// `rref.rpc_async()`: a future of the result.
    Async,
    /// `rref.remote()`: an RRef to the result, kept on the owner.
    Remote,
}

/// Calls methods of an RRef's value on its owner (`rref.rpc_sync()`,
/// `rref.rpc_async()`, `rref.remote()`); reusable for any number of calls.
#[derive(Clone, Debug)]
pub struct RRefProxy {
    agent: RpcAgent,
    rref: RRef,
    mode: RRefProxyMode,
    timeout: Option<Duration>,
}

impl RRefProxy {
    pub(crate) fn new(
        agent: &RpcAgent,
        rref: &RRef,
        mode: RRefProxyMode,
        timeout: Option<Duration>,
    ) -> Self {
        RRefProxy {
            agent: agent.clone(),
            rref: rref.clone(),
            mode,
            timeout,
        }
    }

    /// The proxy's mode.
    pub fn mode(&self) -> RRefProxyMode {
        self.mode
    }

    fn invoke_args(&self, method: &str, args: Args) -> Args {
        // The RRef goes first, as the seeds' `_local_invoke(rref, name, ...)`.
        args.prepend([Payload::from(&self.rref), Payload::from(method)])
    }

    async fn ready(&self) -> Result<()> {
        self.rref
            .get_type_future(&self.agent, self.timeout)
            .wait()
            .await
            .map(|_| ())
    }

    /// Calls `method` on the owner and waits for its result (sync proxies);
    /// on an async proxy this waits for the future, on a remote proxy for
    /// the value on the owner.
    ///
    /// # Errors
    /// `AttributeError` "... has no attribute '...'" for unknown methods, the
    /// method's error, a timeout ("RPC ran for more than"), including while
    /// the proxy learns the value's type.
    pub async fn call(&self, method: &str, args: Args) -> Result<Payload> {
        match self.mode {
            RRefProxyMode::Sync | RRefProxyMode::Async => {
                self.call_async(method, args).wait().await
            }
            RRefProxyMode::Remote => {
                let r = self.call_remote(method, args).await?;
                r.to_here(&self.agent, self.timeout).await
            }
        }
    }

    /// Calls `method` on the owner and returns the future of its result
    /// (`rref.rpc_async().method(...)`).
    pub fn call_async(&self, method: &str, args: Args) -> Future {
        let out = Future::new();
        let this = self.clone();
        let method = method.to_string();
        let o = out.clone();
        let call = async move {
            let r = match this.ready().await {
                Ok(()) => {
                    let owner = Dest::Info(this.rref.owner());
                    let call = this.invoke_args(&method, args);
                    this.agent
                        .call(
                            owner,
                            LOCAL_INVOKE,
                            call,
                            super::remote::running_user_code(this.timeout),
                        )
                        .wait()
                        .await
                }
                Err(e) => Err(e),
            };
            let _ = o.complete(r.map_err(|e| {
                e.context_line(format!(
                    "calling {method} on the value of {} through a proxy",
                    this.rref
                ))
            }));
        };
        // The call is made in the caller's ambient state (its distributed
        // autograd context, if any), as `rpc_async` would be (DA-3).
        self.agent.spawn_inheriting(call);
        out
    }

    /// Calls `method` on the owner and keeps the result there
    /// (`rref.remote().method(...)`).
    ///
    /// # Errors
    /// A timeout or error while learning the value's type (the seeds'
    /// "times out during proxy creation"), and the errors of
    /// [`crate::Remote::remote`].
    pub async fn call_remote(&self, method: &str, args: Args) -> Result<RRef> {
        self.ready().await?;
        let call = self.invoke_args(method, args);
        super::remote::remote_inner(
            &self.agent,
            Dest::Info(self.rref.owner()),
            LOCAL_INVOKE,
            call,
            self.timeout,
        )
    }
}

/// Runs `method` on what the owner holds, for `caller`: an object's
/// method, a tensor method by name, else Python's `AttributeError`.
pub(crate) async fn invoke_local(
    agent: &RpcAgent,
    caller: &WorkerInfo,
    owned: Owned,
    method: &str,
    args: Args,
) -> Result<Payload> {
    let value = match owned {
        Owned::Object(o) => return o.call_method(agent, caller, method, args).await,
        Owned::Value(v) => v,
    };
    match &value.value {
        Value::Tensor(_) => tensor_method(agent, value, method, args),
        _ => Err(Error::new(
            ErrorKind::AttributeError,
            format!(
                "'{}' object has no attribute '{method}'",
                type_name_of(&value)
            ),
        )),
    }
}

fn tensor_method(agent: &RpcAgent, value: Payload, method: &str, args: Args) -> Result<Payload> {
    let mut call = Args::new().arg(value);
    for i in 0..args.positional.len() {
        call = call.arg(args.get(i)?);
    }
    for (k, _) in &args.kwargs {
        if let Some(v) = args.kwarg_value(k) {
            call = call.kwarg(k.clone(), v);
        }
    }
    let mut out: Vec<Tensor> = Vec::new();
    let tensors = &call.tensors;
    // POL-1: the owner's op policy admits the method's op.
    let gate = PolicyGate {
        policy: &agent.options().op_policy,
        worker: agent.name(),
    };
    // BUDGET-1: what the method allocates is charged to this call.
    let (v, refused) = agent.tensor_budget().call().run(method, || {
        wasmrpc_torch_sys::call_method_values_gated(
            method,
            &call.positional,
            &call.kwargs,
            &mut |i| tensors.get(i as usize).map(Tensor::shallow_clone),
            &mut |t| {
                out.push(t);
                (out.len() - 1) as u32
            },
            &gate,
        )
    });
    if let Some(e) = refused {
        return Err(e);
    }
    let v = v.map_err(|e| Error::new(e.kind(), e.to_string()))?;
    Ok(Payload {
        value: v,
        tensors: out,
        rrefs: Vec::new(),
    })
}
