//! The owner-side functions of the RRef protocol, in the agent's internal
//! registry: `remote()`'s creation, `to_here`'s fetch, `_get_type`, the
//! proxies' method calls, and the context's debug info for peers.

use tch::Tensor;

use super::context::context;
use super::object::keeping_objects;
use super::{DEBUG_INFO, FETCH, LOCAL_INVOKE, REMOTE, RRefId, TYPEOF, id_from_value, malformed};
use crate::abi::Value;
use crate::agent::FunctionRegistry;
use crate::error::{Error, Result, unknown_function_message};
use crate::value::{Args, Payload};

fn header_id(args: &Args, i: usize) -> Result<RRefId> {
    args.positional
        .get(i)
        .ok_or_else(|| malformed(format!("missing argument {i}")))
        .and_then(id_from_value)
}

fn rest(args: &Args, from: usize) -> Args {
    Args {
        positional: args.positional.get(from..).unwrap_or_default().to_vec(),
        kwargs: args.kwargs.clone(),
        tensors: args.tensors.iter().map(Tensor::shallow_clone).collect(),
        rrefs: args.rrefs.clone(),
    }
}

/// Registers the owner-side functions in the agent's internal registry.
pub(crate) fn register(r: &FunctionRegistry) {
    r.register_native(DEBUG_INFO, |ctx, _args: Args| async move {
        let info = context(ctx.agent()).debug_info();
        Ok(Payload::dict(
            info.into_iter()
                .map(|(k, v)| (Payload::from(k), Payload::from(v))),
        ))
    });
    // Positional 2 is the function it runs (`remote_inner`'s header).
    r.register_carrier(REMOTE, 2, |ctx, args: Args| async move {
        let agent = ctx.agent().clone();
        let rref_id = header_id(&args, 0)?;
        let fork_id = header_id(&args, 1)?;
        let function = match args.positional.get(2) {
            Some(Value::Str(s)) => s.clone(),
            _ => return Err(malformed("remote() without a function name")),
        };
        let rctx = context(&agent);
        let state = rctx.get_or_create_owner(&agent, rref_id);
        if fork_id != rref_id {
            // RREF-1: counted before the creator can delete it.
            rctx.add_fork(&state, fork_id);
        }
        let user_args = rest(&args, 3);
        let (result, object) = match agent.lookup_function(&function) {
            Some(f) => {
                let call = crate::agent::CallContext::new(
                    agent.clone(),
                    ctx.caller().clone(),
                    function.clone(),
                    ctx.fields().clone(),
                );
                // OBJ-1: the one place a function may make an object.
                keeping_objects(crate::agent::call_guarded(f, call, user_args)).await
            }
            None => (
                Err(Error::runtime(unknown_function_message(
                    &function,
                    agent.name(),
                ))),
                None,
            ),
        };
        state.complete(result, object);
        rctx.forget_if_unforked(rref_id);
        Ok(Payload::none())
    });
    r.register_native(FETCH, |ctx, args: Args| async move {
        let agent = ctx.agent().clone();
        let id = header_id(&args, 0)?;
        let state = context(&agent).get_or_create_owner(&agent, id);
        // OBJ-2: an object is not copied to the user, only its state.
        state.payload("to_here()", &agent, ctx.caller()).await
    });
    r.register_native(TYPEOF, |ctx, args: Args| async move {
        let agent = ctx.agent().clone();
        let id = header_id(&args, 0)?;
        let state = context(&agent).get_or_create_owner(&agent, id);
        Ok(Payload::from(state.owned().await?.type_name()))
    });
    r.register_native(LOCAL_INVOKE, |ctx, args: Args| async move {
        let agent = ctx.agent().clone();
        let rref = args.get(0)?.as_rref()?;
        let method = args.get(1)?.as_str()?.to_string();
        let state = rref.owner_state().ok_or_else(|| {
            Error::runtime(format!(
                "proxy call of {method} on {rref}: worker {} does not own it",
                agent.name()
            ))
        })?;
        let owned = state.owned().await?;
        super::proxy::invoke_local(&agent, ctx.caller(), owned, &method, rest(&args, 2)).await
    });
}
