//! Native stand-ins for the `rpc_test` seed's Python functions that use
//! RRefs (`add_rref_to_value`, `my_rref_function`, `nested_rref`,
//! `rref_forward_chain`, ...), under `seed::<python name>`, the seeds'
//! sparse builders (`nested_rpc_sparse`, `nested_remote_sparse`,
//! `nested_rref_sparse`: they build sparse tensors, which the guest SDK
//! cannot), and a mutable
//! `MyClass` (the seeds' class held in RRefs: `increment_value`,
//! `get_value`), whose instances live in the creating worker's state.
//!
//! [`register`] adds them on top of [`crate::register_all`]; its `MyClass`
//! replaces the immutable record of `seed_fns` with one that also has an
//! `id` into the worker's object table.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;
use wasmrpc::prelude::*;

use wasmrpc::testing::worker_name;
use wasmrpc::{Args, CallContext, Error, FunctionRegistry, Payload, RRef, Result, Value, args};

use crate::{aten, ones};

/// The seed's `global_rref`, per worker.
#[derive(Default)]
pub struct GlobalRRef(pub Mutex<Option<RRef>>);

/// The instances of `MyClass` created on a worker: id → value.
#[derive(Default)]
pub struct MyClassTable {
    next: AtomicI64,
    values: Mutex<HashMap<i64, i64>>,
}

/// A `MyClass(a)` instance on `ctx`'s worker.
pub fn new_my_class(ctx: &CallContext, a: i64) -> Payload {
    let table = ctx.agent().state::<MyClassTable>();
    let id = table.next.fetch_add(1, Ordering::AcqRel);
    table
        .values
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(id, a);
    Payload::from_value(Value::Record {
        name: "MyClass".into(),
        fields: vec![("a".into(), Value::Int(a)), ("id".into(), Value::Int(id))],
    })
}

fn object_id(p: &Payload) -> Result<i64> {
    match &p.value {
        Value::Record { name, fields } if name == "MyClass" => fields
            .iter()
            .find(|(k, _)| k == "id")
            .and_then(|(_, v)| match v {
                Value::Int(i) => Some(*i),
                _ => None,
            })
            .ok_or_else(|| Error::type_error("MyClass without an id")),
        v => Err(Error::type_error(format!(
            "expected MyClass, got {}",
            v.type_name()
        ))),
    }
}

fn with_value<T>(ctx: &CallContext, obj: &Payload, f: impl FnOnce(&mut i64) -> T) -> Result<T> {
    let id = object_id(obj)?;
    let table = ctx.agent().state::<MyClassTable>();
    let mut values = table.values.lock().unwrap_or_else(|p| p.into_inner());
    let v = values.get_mut(&id).ok_or_else(|| {
        Error::runtime(format!(
            "MyClass instance {id} does not live on {}",
            ctx.agent().name()
        ))
    })?;
    Ok(f(v))
}

async fn to_here(ctx: &CallContext, p: Payload) -> Result<Payload> {
    let r = p.as_rref()?;
    drop(p);
    r.to_here(ctx.agent(), None).await
}

async fn rref_forward_chain(ctx: CallContext, args: Args) -> Result<Payload> {
    let dst = args.get(0)?.as_int()?;
    let world_size = args.get(1)?.as_int()?;
    let rref = args.get(2)?;
    let ttl = args.get(3)?.as_int()?;
    if ttl > 0 {
        let current = worker_name(u32::try_from(dst).map_err(|_| Error::value("bad rank"))?);
        let next = (dst + 1) % world_size;
        let ret = ctx.agent().remote(
            current,
            "seed::rref_forward_chain",
            args![next, world_size, rref, ttl - 1],
        )?;
        Ok(Payload::list(vec![Payload::from(ret)]))
    } else {
        to_here(&ctx, rref).await
    }
}

/// The seeds' `build_sparse_tensor()`: COO indices `[[0,1,1],[2,0,2]]`,
/// values `[3,4,5]`, size `(2,3)`, not coalesced.
pub fn build_sparse_tensor() -> tch::Tensor {
    let i = tch::Tensor::from_slice2(&[[0i64, 1, 1], [2, 0, 2]]);
    let v = tch::Tensor::from_slice(&[3f32, 4., 5.]);
    tch::Tensor::sparse_coo_tensor_indices_size(
        &i,
        &v,
        [2, 3],
        (tch::Kind::Float, tch::Device::Cpu),
        false,
    )
}

/// Registers the RRef seed functions.
pub fn register(r: &FunctionRegistry) {
    r.register_native(
        "seed::add_rref_to_value",
        |ctx: CallContext, args: Args| async move {
            let v = to_here(&ctx, args.get(0)?).await?;
            aten::add(&v, &args.get(1)?)
        },
    );
    r.register_native(
        "seed::my_rref_function",
        |ctx: CallContext, args: Args| async move {
            let a = to_here(&ctx, args.get(0)?).await?;
            let b = to_here(&ctx, args.get(1)?).await?;
            aten::add(&a, &b)
        },
    );
    r.register_native(
        "seed::nested_rref",
        |ctx: CallContext, args: Args| async move {
            let dst = args.get(0)?.as_str()?.to_string();
            let a = ctx
                .agent()
                .remote(dst.as_str(), "aten::add", args![ones(&[2, 2]), 1])?;
            let b = ctx
                .agent()
                .remote(dst.as_str(), "aten::add", args![ones(&[2, 2]), 2])?;
            Ok(Payload::tuple(vec![a.into(), b.into()]))
        },
    );
    r.register_native(
        "seed::rpc_return_rref",
        |ctx: CallContext, args: Args| async move {
            let dst = args.get(0)?.as_str()?.to_string();
            let r = ctx
                .agent()
                .remote(dst.as_str(), "aten::add", args![ones(&[2, 2]), 1])?;
            Ok(r.into())
        },
    );
    r.register_native("seed::rref_forward_chain", rref_forward_chain);
    r.register_native(
        "seed::nested_remote",
        |ctx: CallContext, args: Args| async move {
            let dst = args.get(0)?.as_str()?.to_string();
            let r = ctx
                .agent()
                .remote(dst.as_str(), "aten::add", args![ones(&[2, 2]), 3])?;
            to_here(&ctx, Payload::from(r)).await
        },
    );
    r.register_native(
        "seed::nested_remote_sparse",
        |ctx: CallContext, args: Args| async move {
            let dst = args.get(0)?.as_str()?.to_string();
            let r = ctx.agent().remote(
                dst.as_str(),
                "aten::add",
                args![build_sparse_tensor(), build_sparse_tensor()],
            )?;
            to_here(&ctx, Payload::from(r)).await
        },
    );
    r.register_native(
        "seed::nested_rpc_sparse",
        |ctx: CallContext, args: Args| async move {
            let dst = args.get(0)?.as_str()?.to_string();
            ctx.agent()
                .rpc_sync(
                    dst.as_str(),
                    "aten::add",
                    args![build_sparse_tensor(), build_sparse_tensor()],
                )
                .await
        },
    );
    r.register_native(
        "seed::nested_rref_sparse",
        |ctx: CallContext, args: Args| async move {
            let dst = args.get(0)?.as_str()?.to_string();
            let pair = || args![build_sparse_tensor(), build_sparse_tensor()];
            let a = ctx.agent().remote(dst.as_str(), "aten::add", pair())?;
            let b = ctx.agent().remote(dst.as_str(), "aten::add", pair())?;
            Ok(Payload::tuple(vec![a.into(), b.into()]))
        },
    );
    r.register_native(
        "seed::check_rref_confirmed",
        |_ctx, args: Args| async move {
            Ok(Payload::from(args.get(0)?.as_rref()?.confirmed_by_owner()))
        },
    );
    r.register_native(
        "seed::set_global_rref",
        |ctx: CallContext, args: Args| async move {
            let rref = args.get(0)?.as_rref()?;
            *ctx.agent()
                .state::<GlobalRRef>()
                .0
                .lock()
                .unwrap_or_else(|p| p.into_inner()) = Some(rref);
            Ok(Payload::none())
        },
    );
    r.register_native(
        "seed::clear_global_rref",
        |ctx: CallContext, _args| async move {
            let old = ctx
                .agent()
                .state::<GlobalRRef>()
                .0
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take();
            drop(old);
            Ok(Payload::none())
        },
    );
    r.register_native(
        "seed::get_rref_list",
        |ctx: CallContext, args: Args| async move {
            let values = args.get(0)?.items()?;
            let mut out = Vec::new();
            for v in values {
                let obj = new_my_class(&ctx, v.as_int()?);
                out.push(Payload::from(RRef::new(ctx.agent(), obj)));
            }
            Ok(Payload::list(out))
        },
    );
    r.register_native(
        "seed::_call_method_on_rref",
        |ctx: CallContext, args: Args| async move {
            let method = args.get(0)?.as_str()?.to_string();
            let obj = args.get(1)?.as_rref()?.local_value(ctx.agent()).await?;
            let mut call = Args::new().arg(obj);
            for i in 2..args.len() {
                call = call.arg(args.get(i)?);
            }
            let f = ctx
                .agent()
                .registry()
                .get(&method)
                .ok_or_else(|| Error::runtime(format!("no method {method}")))?;
            f.call(ctx.clone(), call).await
        },
    );
    r.register_native("seed::MyClass", |ctx: CallContext, args: Args| async move {
        let a = args.param(0, "a")?;
        if args.len() > 1 && args.get(1)?.as_bool()? {
            // The seeds' `MyClass(a, delay=True)`: a slow constructor.
            tokio::time::sleep(Duration::from_secs(2)).await;
        }
        match a.as_int() {
            Ok(i) => Ok(new_my_class(&ctx, i)),
            Err(_) => Ok(a.sub(Value::Record {
                name: "MyClass".into(),
                fields: vec![("a".into(), a.value.clone())],
            })),
        }
    });
    r.register_native(
        "seed::MyClass.increment_value",
        |ctx: CallContext, args: Args| async move {
            let by = args.get(1)?.as_int()?;
            with_value(&ctx, &args.get(0)?, |v| *v += by)?;
            Ok(Payload::none())
        },
    );
    r.register_native(
        "seed::MyClass.get_value",
        |ctx: CallContext, args: Args| async move {
            Ok(Payload::from(with_value(&ctx, &args.get(0)?, |v| *v)?))
        },
    );
    r.register_native("seed::_slow_add", |_ctx, args: Args| async move {
        tokio::time::sleep(Duration::from_secs(1)).await;
        aten::add(&args.get(0)?, &args.get(1)?)
    });
}
