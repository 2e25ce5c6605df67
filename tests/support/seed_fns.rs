//! Native stand-ins for the `rpc_test` seed's Python user functions that
//! are not (or not yet) the seed-fns wasm plugin's, each under
//! `seed::<python name>` with the Python function's behaviour. Every other
//! Python user function the ported tests call is the plugin's
//! (`seed_fns::<name>`, registered on every test worker by
//! [`register_all`](crate::register_all)).
//!
//! Native on purpose, because the test inspects or drives the function's
//! worker-side state from Rust, which a plugin's state (host globals scoped
//! by plugin, not reachable from a test) cannot be:
//! - `set_value`: the test waits on the callee's `VALUE_FUTURE`, a Rust
//!   [`Future`] ([`ValueFuture`]);
//! - `timed_out_rpc`: blocks until the test sets the worker's
//!   [`TimedOutRpcEvent`];
//! - `_reset_count`, `_increment_count`: the leader reads its
//!   [`BarrierCount`] directly, as the seed reads `_rpc_barrier_count`.
//!
//! Native until the plugin can be them:
//! - `MyClass`, `MyClass.my_instance_method`, `MyClass.my_class_method`,
//!   `MyClass.my_static_method`: objects returned and passed by value (a
//!   record) and a class's methods as functions; the plugin's `MyClass` is
//!   a class (objects held in RRefs) and plugin classes are not registered
//!   on the agent yet;
//! - `non_cont_test`: checks strides and contiguity, which a plugin cannot
//!   see (the guest SDK reads a tensor's elements, not its layout).
//!
//! Per-worker module globals (`VALUE_FUTURE`, the barrier counter, the
//! `timed_out_rpc` event) live in the callee agent's state.

use std::sync::Mutex;
use std::sync::atomic::{AtomicI64, Ordering};

use tokio::sync::Notify;
use wasmrpc::{Args, CallContext, Error, FunctionRegistry, Future, Payload, Result, Value};

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
    r.register_native(
        "seed::timed_out_rpc",
        |ctx: CallContext, _args| async move {
            ctx.agent().state::<TimedOutRpcEvent>().wait().await;
            Ok(Payload::none())
        },
    );
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
