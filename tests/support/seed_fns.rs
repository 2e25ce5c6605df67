//! Native stand-ins for the `rpc_test` seed's Python user functions, each
//! under `seed::<python name>` with the Python function's behaviour.
//! Per-worker module globals (`VALUE_FUTURE`, the barrier counter, the
//! `timed_out_rpc` event) live in the callee agent's state.

use std::sync::Mutex;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use tokio::sync::Notify;
use wasmrpc::{
    Args, CallContext, Dest, Error, FunctionRegistry, Future, Payload, Result, Value, args,
};

use crate::aten;

/// The seed's global `VALUE_FUTURE`, per worker.
#[derive(Default)]
pub struct ValueFuture(pub Mutex<Option<Future>>);

impl ValueFuture {
    /// The worker's future, created on first use.
    pub fn get(&self) -> Future {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_or_insert_with(Future::new)
            .clone()
    }
}

/// The seed's `_rpc_barrier_count`, per worker.
#[derive(Default)]
pub struct BarrierCount(pub AtomicI64);

/// The seed's `RpcTest.timed_out_rpc_event`, per worker.
#[derive(Default)]
pub struct TimedOutRpcEvent {
    set: std::sync::atomic::AtomicBool,
    notify: Notify,
}

impl TimedOutRpcEvent {
    /// Sets the event, releasing every waiter.
    pub fn set(&self) {
        self.set.store(true, Ordering::Release);
        self.notify.notify_waiters();
    }

    async fn wait(&self) {
        loop {
            let n = self.notify.notified();
            if self.set.load(Ordering::Acquire) {
                return;
            }
            n.await;
        }
    }
}

fn dest(p: &Payload) -> Dest {
    Dest::from(&p.value)
}

async fn my_function(_ctx: CallContext, args: Args) -> Result<Payload> {
    args.check_arity("my_function", 3, 3, &["a", "b", "c"])?;
    let (a, b, c) = (
        args.param(0, "a")?,
        args.param(1, "b")?,
        args.param(2, "c")?,
    );
    aten::add(&aten::add(&a, &b)?, &c)
}

async fn heavy_rpc(_ctx: CallContext, args: Args) -> Result<Payload> {
    let mut t = args.get(0)?.as_tensor()?;
    for i in 1..100i64 {
        let _ = t.f_mul_scalar_(i)?;
        let _ = t.f_div_scalar_(i + 1)?;
    }
    Ok(0.into())
}

async fn nested_rpc(ctx: CallContext, args: Args) -> Result<Payload> {
    let dst = args.get(0)?;
    ctx.agent()
        .rpc_sync(dest(&dst), "aten::add", args![crate::ones(&[2, 2]), 1])
        .await
}

async fn multi_layer_nested_async_rpc(ctx: CallContext, args: Args) -> Result<Payload> {
    let (dst, ws, ttl) = (
        args.get(0)?.as_int()?,
        args.get(1)?.as_int()?,
        args.get(2)?.as_int()?,
    );
    if ttl > 0 {
        let next = (dst + 1) % ws;
        // Fire and forget: the future is dropped, the call goes on.
        let _ = ctx.agent().rpc_async(
            format!("worker{dst}"),
            "seed::multi_layer_nested_async_rpc",
            args![next, ws, ttl - 1],
        );
    }
    Ok(0.into())
}

async fn my_complex_tensor_function(_ctx: CallContext, args: Args) -> Result<Payload> {
    let list = args.get(0)?.items()?;
    let record = args.get(1)?;
    let dict = args.get(2)?.entries()?;
    let mut res = list
        .first()
        .ok_or_else(|| Error::runtime("empty list"))?
        .as_tensor()?;
    for t in &list {
        let t = t.as_tensor()?;
        let _ = res.f_add_(&t)?;
    }
    for (_, v) in &dict {
        let _ = res.f_add_(&v.as_tensor()?)?;
    }
    let tensors = match &record.value {
        Value::Record { fields, .. } => fields
            .iter()
            .find(|(n, _)| n == "tensors")
            .map(|(_, v)| record.sub(v.clone())),
        _ => None,
    }
    .ok_or_else(|| {
        Error::new(
            wasmrpc::ErrorKind::AttributeError,
            "object has no attribute 'tensors'",
        )
    })?
    .items()?;
    let pick = |i: usize| {
        tensors
            .get(i)
            .cloned()
            .ok_or_else(|| Error::new(wasmrpc::ErrorKind::IndexError, "list index out of range"))
    };
    Ok(Payload::tuple(vec![
        res.into(),
        pick(0)?,
        pick(1)?,
        pick(2)?,
    ]))
}

async fn add_use_future_cb(ctx: CallContext, args: Args) -> Result<Payload> {
    let (to, x, y, z) = (args.get(0)?, args.get(1)?, args.get(2)?, args.get(3)?);
    let out = Future::new();
    let o = out.clone();
    let fut = ctx.agent().rpc_async(dest(&to), "aten::add", args![x, y]);
    let _ = fut.then(move |f| {
        let r = aten::add(&f.wait_blocking()?, &z);
        let _ = o.complete(r);
        Ok(Payload::none())
    });
    out.wait().await
}

async fn add_use_future_set_result(ctx: CallContext, args: Args) -> Result<Payload> {
    let (to, x, y, z) = (args.get(0)?, args.get(1)?, args.get(2)?, args.get(3)?);
    let out = Future::new();
    let o = out.clone();
    let fut = ctx.agent().rpc_async(dest(&to), "aten::add", args![x, y]);
    let _ = fut.then(move |f| {
        o.set_result(aten::add(&f.wait_blocking()?, &z)?)?;
        Ok(Payload::none())
    });
    out.wait().await
}

async fn add_use_future_nested_cb(ctx: CallContext, args: Args) -> Result<Payload> {
    let (to, x, y, z) = (args.get(0)?, args.get(1)?, args.get(2)?, args.get(3)?);
    let out = Future::new();
    let o = out.clone();
    let agent = ctx.agent().clone();
    let to2 = dest(&to);
    let fut1 = ctx.agent().rpc_async(dest(&to), "aten::add", args![x, y]);
    let _ = fut1.then(move |f1| {
        let fut2 = agent.rpc_async(to2, "aten::add", args![f1.wait_blocking()?, z]);
        let _ = fut2.then(move |f2| {
            o.set_result(f2.wait_blocking()?)?;
            Ok(Payload::none())
        });
        Ok(Payload::none())
    });
    out.wait().await
}

fn record_field(p: &Payload, field: &str) -> Result<Payload> {
    match &p.value {
        Value::Record { fields, .. } => fields
            .iter()
            .find(|(n, _)| n == field)
            .map(|(_, v)| p.sub(v.clone()))
            .ok_or_else(|| {
                Error::new(
                    wasmrpc::ErrorKind::AttributeError,
                    format!("object has no attribute '{field}'"),
                )
            }),
        _ => Err(Error::type_error(format!(
            "expected an object, got {}",
            p.value.type_name()
        ))),
    }
}

/// Registers every `seed::` function.
pub fn register(r: &FunctionRegistry) {
    r.register_native("seed::my_function", my_function);
    r.register_native("seed::my_tensor_function", |_ctx, args: Args| async move {
        args.check_arity("my_tensor_function", 2, 2, &["a", "b"])?;
        aten::add(&args.param(0, "a")?, &args.param(1, "b")?)
    });
    r.register_native(
        "seed::my_complex_tensor_function",
        my_complex_tensor_function,
    );
    r.register_native("seed::identity", |_ctx, args: Args| async move {
        args.check_arity("identity", 1, 1, &["a"])?;
        args.param(0, "a")
    });
    r.register_native("seed::no_result", |_ctx, args: Args| async move {
        args.check_arity("no_result", 0, 0, &[])?;
        println!("do nothing");
        Ok(Payload::none())
    });
    r.register_native("seed::raise_func", |_ctx, _args| async move {
        Err::<Payload, _>(Error::value("Expected error"))
    });
    r.register_native("seed::raise_func_escape", |_ctx, _args| async move {
        Err::<Payload, _>(Error::value(
            "\nFirst line of error \n next line of error \n last line of error",
        ))
    });
    r.register_native("seed::raise_or_inc", |_ctx, args: Args| async move {
        let t = args.get(0)?.as_tensor()?;
        if t.numel() == 2 {
            return Err(Error::value("Expected error"));
        }
        Ok(t.f_add_scalar(1)?.into())
    });
    r.register_native("seed::nested_rpc", nested_rpc);
    r.register_native("seed::light_rpc", |_ctx, _args| async move {
        Ok(Payload::from(0))
    });
    r.register_native("seed::heavy_rpc", heavy_rpc);
    r.register_native(
        "seed::multi_layer_nested_async_rpc",
        multi_layer_nested_async_rpc,
    );
    r.register_native("seed::my_sleep_func", |_ctx, args: Args| async move {
        let seconds = match args.param(0, "seconds") {
            Ok(s) => s.as_float()?,
            Err(_) => 1.0,
        };
        tokio::time::sleep(Duration::from_secs_f64(seconds)).await;
        Ok(Payload::none())
    });
    r.register_native(
        "seed::set_value",
        |ctx: CallContext, args: Args| async move {
            ctx.agent()
                .state::<ValueFuture>()
                .get()
                .set_result(args.get(0)?)?;
            Ok(Payload::none())
        },
    );
    r.register_native("seed::foo_add", |_ctx, _args| async move {
        Ok(crate::ones(&[1]).f_add(&crate::ones(&[1]))?.into())
    });
    r.register_native(
        "seed::return_callee_id",
        |ctx: CallContext, _args| async move { Ok(Payload::from(ctx.agent().info().id)) },
    );
    r.register_native("seed::slow_add", |_ctx, args: Args| async move {
        tokio::time::sleep(Duration::from_secs(1)).await;
        aten::add(&args.get(0)?, &args.get(1)?)
    });
    r.register_native(
        "seed::timed_out_rpc",
        |ctx: CallContext, _args| async move {
            ctx.agent().state::<TimedOutRpcEvent>().wait().await;
            Ok(Payload::none())
        },
    );
    r.register_native("seed::add_use_future_cb", add_use_future_cb);
    r.register_native("seed::add_use_future_set_result", add_use_future_set_result);
    r.register_native("seed::add_use_future_nested_cb", add_use_future_nested_cb);
    r.register_native("seed::_reset_count", |ctx: CallContext, _args| async move {
        ctx.agent()
            .state::<BarrierCount>()
            .0
            .store(0, Ordering::SeqCst);
        Ok(Payload::none())
    });
    r.register_native(
        "seed::_increment_count",
        |ctx: CallContext, _args| async move {
            ctx.agent()
                .state::<BarrierCount>()
                .0
                .fetch_add(1, Ordering::SeqCst);
            Ok(Payload::none())
        },
    );
    r.register_native("seed::non_cont_test", |_ctx, args: Args| async move {
        let (view, cont) = (args.get(0)?.as_tensor()?, args.get(1)?.as_tensor()?);
        if view.is_contiguous() {
            return Err(Error::runtime("t_view is contiguous!"));
        }
        if !cont.is_contiguous() {
            return Err(Error::runtime("t_cont is not contiguous!"));
        }
        if !view.equal(&cont) {
            return Err(Error::runtime("t_view is not equal to t_cont!"));
        }
        Ok(view.into())
    });
    // `MyClass`: objects travel by value as records.
    r.register_native("seed::MyClass", |_ctx, args: Args| async move {
        let a = args.param(0, "a")?;
        let value = Value::Record {
            name: "MyClass".into(),
            fields: vec![("a".into(), a.value.clone())],
        };
        Ok(a.sub(value))
    });
    r.register_native("seed::MyClass.my_instance_method", |_ctx, args: Args| async move {
        aten::add(&record_field(&args.get(0)?, "a")?, &args.get(1)?)
    });
    r.register_native(
        "seed::MyClass.my_class_method",
        |_ctx, args: Args| async move { aten::add(&args.get(0)?, &args.get(1)?) },
    );
    r.register_native(
        "seed::MyClass.my_static_method",
        |_ctx, args: Args| async move { Ok(Payload::from(args.get(0)?.as_float()? > 10.0)) },
    );
}
