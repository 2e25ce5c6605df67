//! The seed suites' user functions and classes (`rpc_test.py`, Appendix A of
//! its seed inventory), written with the guest SDK.
//!
//! Names and error texts are the seeds' own, so a ported test reads like the
//! original. The last section holds functions that misbehave on purpose
//! (trap, spin, exhaust memory) for the wasm runtime's own tests.

use wasmrpc_guest::{
    AnyValue, Error, ErrorKind, FromValue, Future, IntoValue, MaybeFuture, RRef, Result, Tensor,
    ToValue, Value, clear_global, get_worker_info, global, lock, log, remote, remote_class,
    rpc_async, rpc_sync, set_global, sleep,
};

/// A Python number or tensor: what the seeds add with `+`.
#[derive(Debug)]
pub enum Num {
    /// An `int`.
    Int(i64),
    /// A `float`.
    Float(f64),
    /// A tensor.
    Tensor(Tensor),
}

impl FromValue for Num {
    fn from_value(value: Value) -> Result<Self> {
        match value {
            Value::Int(i) => Ok(Num::Int(i)),
            Value::Float(f) => Ok(Num::Float(f)),
            Value::Tensor(h) => Ok(Num::Tensor(Tensor::from_raw(h))),
            other => Err(Error::type_error(format!(
                "unsupported operand type for +: '{}'",
                other.type_name()
            ))),
        }
    }
}

impl IntoValue for Num {
    fn into_value(self) -> Value {
        match self {
            Num::Int(i) => Value::Int(i),
            Num::Float(f) => Value::Float(f),
            Num::Tensor(t) => t.into_value(),
        }
    }
}

impl ToValue for Num {
    fn to_value(&self) -> Value {
        match self {
            Num::Int(i) => Value::Int(*i),
            Num::Float(f) => Value::Float(*f),
            Num::Tensor(t) => t.to_value(),
        }
    }
}

impl Num {
    /// `self + other` with Python's rules: a tensor absorbs a scalar, an int
    /// and a float make a float.
    ///
    /// # Errors
    /// The host's error for tensors that do not broadcast.
    pub fn add(&self, other: &Num) -> Result<Num> {
        Ok(match (self, other) {
            (Num::Int(a), Num::Int(b)) => Num::Int(a.wrapping_add(*b)),
            (Num::Int(a), Num::Float(b)) | (Num::Float(b), Num::Int(a)) => {
                Num::Float(*a as f64 + b)
            }
            (Num::Float(a), Num::Float(b)) => Num::Float(a + b),
            (Num::Tensor(t), other) => Num::Tensor(t.add(other.scalar_or_tensor())?),
            (scalar, Num::Tensor(t)) => Num::Tensor(t.add(scalar.scalar_or_tensor())?),
        })
    }

    fn scalar_or_tensor(&self) -> &dyn wasmrpc_guest::Operand {
        match self {
            Num::Int(i) => i,
            Num::Float(f) => f,
            Num::Tensor(t) => t,
        }
    }
}

// ---------------------------------------------------------------------------
// Module-level UDFs.

/// `my_function(a, b, c)`: `a + b + c`.
#[remote]
fn my_function(a: Num, b: Num, c: Num) -> Result<Num> {
    a.add(&b)?.add(&c)
}

/// `my_tensor_function(a, b)`: `a + b`.
#[remote]
fn my_tensor_function(a: Tensor, b: Tensor) -> Result<Tensor> {
    a.add(&b)
}

/// `identity(a)`.
#[remote]
fn identity(a: Value) -> Value {
    a
}

/// `no_result()`: prints "do nothing" and returns `None`.
#[remote]
fn no_result() {
    log("do nothing");
}

/// `light_rpc()`: returns 0.
#[remote]
fn light_rpc() -> i64 {
    0
}

/// `heavy_rpc(t)`: 99 in-place `*= i` and `/= i + 1`, then 0.
#[remote]
fn heavy_rpc(tensor: Tensor) -> Result<i64> {
    for i in 1..100i64 {
        tensor.mul_(i)?;
        tensor.div_(i + 1)?;
    }
    Ok(0)
}

/// `raise_func()`: raises `ValueError("Expected error")`.
#[remote]
fn raise_func() -> Result<()> {
    Err(Error::value_error("Expected error"))
}

/// `custom_raise_func()`: raises `CustomException(True, "foo")`, an
/// exception class of the plugin's own, which no caller can rebuild.
#[remote]
fn custom_raise_func() -> Result<()> {
    Err(Error::exception("CustomException", "foo"))
}

/// `raise_func_escape()`: a `ValueError` whose message has real newlines.
#[remote]
fn raise_func_escape() -> Result<()> {
    Err(Error::value_error(
        "\nFirst line of error \n next line of error \n last line of error",
    ))
}

/// `raise_or_inc(value)`: raises `ValueError("Expected error")` for a
/// tensor of two elements, else `value + 1`.
#[remote]
fn raise_or_inc(value: Tensor) -> Result<Tensor> {
    if value.numel()? == 2 {
        return Err(Error::value_error("Expected error"));
    }
    value.add(1i64)
}

/// `foo_add()`: `torch.ones(1) + torch.ones(1)`.
#[remote]
fn foo_add() -> Result<Tensor> {
    Tensor::ones(&[1])?.add(&Tensor::ones(&[1])?)
}

/// `multi_layer_nested_async_rpc(dst, world_size, ttl)`: while `ttl > 0`,
/// fires `rpc_async` of itself at `worker{dst}` with the next rank and
/// `ttl - 1`, without waiting for it; returns 0.
#[remote]
fn multi_layer_nested_async_rpc(dst: i64, world_size: i64, ttl: i64) -> Result<i64> {
    if ttl > 0 {
        let next = (dst + 1) % world_size;
        // Fire and forget: dropping the handle does not cancel the call.
        drop(rpc_async(
            &format!("worker{dst}"),
            "multi_layer_nested_async_rpc",
            (next, world_size, ttl - 1),
        )?);
    }
    Ok(0)
}

/// Attribute `name` of a record (a Python object or named tuple), owning
/// its handles; the other fields are released.
fn attribute(object: AnyValue, name: &str) -> Result<AnyValue> {
    match object.into_inner() {
        Value::Record { name: ty, fields } => {
            let mut found = None;
            for (field, value) in fields {
                let value = AnyValue::from_value(value)?;
                if field == name && found.is_none() {
                    found = Some(value);
                }
            }
            found.ok_or_else(|| {
                Error::new(
                    ErrorKind::AttributeError,
                    format!("'{ty}' object has no attribute '{name}'"),
                )
            })
        }
        other => {
            let ty = other.type_name();
            drop(AnyValue::from_value(other)?);
            Err(Error::new(
                ErrorKind::AttributeError,
                format!("'{ty}' object has no attribute '{name}'"),
            ))
        }
    }
}

/// `my_complex_tensor_function(list_input, tensor_class_input, dict_input)`:
/// `res = list_input[0]`, plus every tensor of `list_input` and every
/// value of `dict_input`; returns `(res, tensors[0], tensors[1],
/// tensors[2])` of `tensor_class_input.tensors`.
#[remote]
fn my_complex_tensor_function(
    list_input: Vec<Tensor>,
    tensor_class_input: AnyValue,
    dict_input: AnyValue,
) -> Result<(Tensor, AnyValue, AnyValue, AnyValue)> {
    let mut res = list_input
        .first()
        .ok_or_else(|| Error::index_error("list index out of range"))?
        .add(0i64)?;
    for t in &list_input {
        res = res.add(t)?;
    }
    match dict_input.into_inner() {
        Value::Dict(pairs) => {
            for (key, value) in pairs {
                drop(AnyValue::from_value(key)?);
                res = res.add(&Tensor::from_value(value)?)?;
            }
        }
        other => {
            let ty = other.type_name();
            drop(AnyValue::from_value(other)?);
            return Err(Error::new(
                ErrorKind::AttributeError,
                format!("'{ty}' object has no attribute 'items'"),
            ));
        }
    }
    let tensors = attribute(tensor_class_input, "tensors")?;
    let mut items = Vec::<AnyValue>::from_value(tensors.into_inner())?.into_iter();
    let mut next = || {
        items
            .next()
            .ok_or_else(|| Error::index_error("list index out of range"))
    };
    Ok((res, next()?, next()?, next()?))
}

/// A future the calling function made, named in a `then` callback's
/// arguments by its handle, as a Python closure captures it. A callback
/// runs with the handle table of the call that chained it (host invariant
/// PL-1), so the handle is valid there; it stays that call's, released when
/// the call and its callbacks are over.
fn with_captured_future<R>(handle: i64, f: impl FnOnce(&Future) -> Result<R>) -> Result<R> {
    let handle = u32::try_from(handle)
        .map_err(|_| Error::value_error(format!("{handle} is not a future handle")))?;
    let future = Future::from_raw(handle);
    let result = f(&future);
    // Borrowed, not owned: the creating call releases it.
    let _ = future.into_raw();
    result
}

/// The `then` callback that completes a captured future with `value + z`.
#[remote]
fn _set_future_to_sum(value: Num, out: i64, z: Num) -> Result<()> {
    let sum = value.add(&z)?;
    with_captured_future(out, |f| f.set_result(&sum))
}

/// The `then` callback that completes a captured future with `value`.
#[remote]
fn _set_future(value: AnyValue, out: i64) -> Result<()> {
    with_captured_future(out, |f| f.set_result(&value))
}

/// `add_use_future_cb(to, x, y, z)`: a nested `rpc_async(to, add, (x, y))`
/// whose callback sets a future with `+ z`; the call blocks on it.
#[remote]
fn add_use_future_cb(to: String, x: Num, y: Num, z: Num) -> Result<Num> {
    let out = Future::new()?;
    let handle = i64::from(out.handle());
    drop(rpc_async(&to, "aten::add", (x, y))?.then("_set_future_to_sum", (handle, z))?);
    out.wait()
}

/// `add_use_future_set_result(to, x, y, z)`: as `add_use_future_cb`, with
/// the callback calling `set_result` on a `torch.futures.Future`.
#[remote]
fn add_use_future_set_result(to: String, x: Num, y: Num, z: Num) -> Result<Num> {
    let out = Future::new()?;
    let handle = i64::from(out.handle());
    drop(rpc_async(&to, "aten::add", (x, y))?.then("_set_future_to_sum", (handle, z))?);
    out.wait()
}

/// The first callback of `add_use_future_nested_cb`: a second
/// `rpc_async(to, add, (value, z))` whose callback sets the captured future.
#[remote]
fn _add_use_future_nested_step(value: Num, to: String, z: Num, out: i64) -> Result<()> {
    drop(rpc_async(&to, "aten::add", (value, z))?.then("_set_future", (out,))?);
    Ok(())
}

/// `add_use_future_nested_cb(to, x, y, z)`: a callback issues a second
/// `rpc_async` whose callback sets the future the call blocks on.
#[remote]
fn add_use_future_nested_cb(to: String, x: Num, y: Num, z: Num) -> Result<Num> {
    let out = Future::new()?;
    let handle = i64::from(out.handle());
    let first = rpc_async(&to, "aten::add", (x, y))?;
    drop(first.then("_add_use_future_nested_step", (&to, z, handle))?);
    out.wait()
}

/// `nested_rpc(dst)`: calls back `rpc_sync(dst, torch.add, (ones(2, 2), 1))`.
#[remote]
fn nested_rpc(dst: String) -> Result<Tensor> {
    rpc_sync(&dst, "aten::add", (Tensor::ones(&[2, 2])?, 1i64))
}

/// Like `nested_rpc`, but calls a plugin function: `my_function(n, 1, 2)`
/// on `dst`, so the host re-enters the runtime.
#[remote]
fn nested_udf(dst: String, n: i64) -> Result<i64> {
    rpc_sync(&dst, "my_function", (n, 1i64, 2i64))
}

/// `call_str(dst, function, arg)`: `function(arg)` called by name on `dst`
/// from inside this plugin, with a string result (how the deployment tests
/// reach a plugin deployed after this one was loaded).
#[remote]
fn call_str(dst: String, function: String, arg: String) -> Result<String> {
    rpc_sync(&dst, &function, (arg,))
}

/// `add_rref_to_value(rref, value)`: `rref.to_here() + value`.
#[remote]
fn add_rref_to_value(rref: RRef, value: Num) -> Result<Num> {
    rref.to_here::<Num>()?.add(&value)
}

/// `my_rref_function(rref_a, rref_b)`: `rref_a.to_here() + rref_b.to_here()`.
#[remote]
fn my_rref_function(rref_a: RRef, rref_b: RRef) -> Result<Num> {
    rref_a.to_here::<Num>()?.add(&rref_b.to_here::<Num>()?)
}

/// `my_container_sum(a)`: the sum of a list of tensors or numbers.
#[remote]
fn my_container_sum(a: Vec<Num>) -> Result<Num> {
    let mut items = a.into_iter();
    let Some(mut total) = items.next() else {
        return Ok(Num::Int(0));
    };
    for item in items {
        total = total.add(&item)?;
    }
    Ok(total)
}

/// `nested_remote(dst)`: `remote(dst, add, (ones(2, 2), 3)).to_here()`.
#[remote]
fn nested_remote(dst: String) -> Result<Tensor> {
    wasmrpc_guest::remote(&dst, "aten::add", (Tensor::ones(&[2, 2])?, 3i64))?.to_here()
}

/// `rpc_return_rref(dst)`: `remote(dst, add, (ones(2, 2), 1))`, returned as
/// an RRef.
#[remote]
fn rpc_return_rref(dst: String) -> Result<RRef> {
    wasmrpc_guest::remote(&dst, "aten::add", (Tensor::ones(&[2, 2])?, 1i64))
}

/// `nested_rref(dst)`: two RRefs owned by `dst`, `ones + 1` and `ones + 2`.
#[remote]
fn nested_rref(dst: String) -> Result<(RRef, RRef)> {
    let one = wasmrpc_guest::remote(&dst, "aten::add", (Tensor::ones(&[2, 2])?, 1i64))?;
    let two = wasmrpc_guest::remote(&dst, "aten::add", (Tensor::ones(&[2, 2])?, 2i64))?;
    Ok((one, two))
}

/// `my_sleep_func(seconds=1)`.
#[remote]
fn my_sleep_func(seconds: Option<f64>) -> Result<()> {
    sleep(seconds.unwrap_or(1.0))
}

/// `slow_add(x, y)`: sleeps one second, then `x + y`.
#[remote]
fn slow_add(x: Num, y: Num) -> Result<Num> {
    sleep(1.0)?;
    x.add(&y)
}

/// `udf_with_torch_ops(device=-1, use_record_function=False)`: the ops the
/// profiling seeds expect among a callee's events (`EXPECTED_REMOTE_EVENTS`),
/// inside a `record_function("##forward##")` range when asked. Plugins run
/// on the CPU: a device other than -1 is an error.
#[remote]
fn udf_with_torch_ops(device: Option<i64>, use_record_function: Option<bool>) -> Result<()> {
    let device = device.unwrap_or(-1);
    if device != -1 {
        return Err(Error::runtime_error(format!(
            "udf_with_torch_ops: plugins run on the CPU, not on CUDA device {device}"
        )));
    }
    let _range = use_record_function
        .unwrap_or(false)
        .then(|| wasmrpc_guest::profiler::RecordFunction::enter("##forward##"));
    let (t1, t2) = (Tensor::ones(&[1])?, Tensor::ones(&[1])?);
    let t = t1.add(&t2)?;
    let t = t.mul(&t)?;
    let t = t.relu()?;
    t.sigmoid()?;
    Ok(())
}

/// `RpcTest.return_callee_id()`: this worker's id.
#[remote]
fn return_callee_id() -> Result<u32> {
    Ok(get_worker_info()?.id)
}

/// `set_value(v)`: sets the worker-global value the seeds keep in
/// `VALUE_FUTURE`.
#[remote]
fn set_value(value: AnyValue) -> Result<()> {
    set_global("VALUE_FUTURE", value)
}

/// Reads back what `set_value` stored (`VALUE_FUTURE.wait()`).
#[remote]
fn get_value() -> Result<Option<Value>> {
    global::<Value>("VALUE_FUTURE")
}

/// `_increment_count()`: the barrier counter, under a worker-wide lock. The
/// read and the write are a host call apart, so a missing lock loses counts.
#[remote]
fn _increment_count() -> Result<i64> {
    let _guard = lock("count")?;
    let count = global::<i64>("count")?.unwrap_or(0);
    sleep(0.001)?;
    set_global("count", count + 1)?;
    Ok(count + 1)
}

/// `_reset_count()`.
#[remote]
fn _reset_count() -> Result<()> {
    set_global("count", 0i64)
}

// ---------------------------------------------------------------------------
// `@rpc.functions.async_execution` functions.

/// `async_add(to, x, y)`: returns the future of `rpc_async(to, add, (x, y))`.
#[remote(async_execution)]
fn async_add(to: String, x: Num, y: Num) -> Result<Future> {
    rpc_async(&to, "aten::add", (x, y))
}

/// `slow_async_add(to, x, y, device="cpu")`: returns the future of
/// `rpc_async(to, slow_add, (x, y))`. Plugins run on the CPU: another
/// device is an error.
#[remote(async_execution)]
fn slow_async_add(to: String, x: Num, y: Num, device: Option<String>) -> Result<Future> {
    if let Some(d) = device.filter(|d| d != "cpu") {
        return Err(Error::runtime_error(format!(
            "slow_async_add: plugins run on the CPU, not on {d}"
        )));
    }
    rpc_async(&to, "slow_add", (x, y))
}

/// `async_add_chained(to, x, y, z)`: `rpc_async(to, add, (x, y)).then(+ z)`.
#[remote(async_execution)]
fn async_add_chained(to: String, x: Num, y: Num, z: Num) -> Result<Future> {
    rpc_async(&to, "aten::add", (x, y))?.then("_add_then", (z,))
}

/// `async_add_chained_multi(to, x, num, step)`: `rpc_async(to, add, (x, 0))`
/// followed by `num` chained `then(+ step)` callbacks.
#[remote(async_execution)]
fn async_add_chained_multi(to: String, x: Num, num: i64, step: Num) -> Result<Future> {
    let mut fut = rpc_async(&to, "aten::add", (x, 0i64))?;
    for _ in 0..num {
        fut = fut.then("_add_then", (&step,))?;
    }
    Ok(fut)
}

/// The `then` callback of `async_add_chained`: `value + z`, typed at run
/// time as Python's `+` is: anything but numbers and tensors fails with
/// Python's "unsupported operand type(s) for +: 'A' and 'B'" `TypeError`.
#[remote]
fn _add_then(value: AnyValue, z: AnyValue) -> Result<Num> {
    let is_num =
        |v: &AnyValue| matches!(v.get(), Value::Int(_) | Value::Float(_) | Value::Tensor(_));
    if !is_num(&value) || !is_num(&z) {
        // The values (and the handles in them) are released on drop.
        return Err(Error::type_error(format!(
            "unsupported operand type(s) for +: '{}' and '{}'",
            value.get().type_name(),
            z.get().type_name()
        )));
    }
    let a = Num::from_value(value.into_inner())?;
    a.add(&Num::from_value(z.into_inner())?)
}

/// `test_callback_wrong_arg_type`'s `fut0.then(lambda x: x + 1)` on
/// `rpc_async(to, torch.add, (ones(2, 2), 1))`, where the callback is given
/// what it cannot add to (a `str`; in the seed, the future itself): the
/// returned future fails with the callback's error as a `RuntimeError`.
#[remote(async_execution)]
fn callback_wrong_arg_type(to: String) -> Result<Future> {
    rpc_async(&to, "aten::add", (Tensor::ones(&[2, 2])?, 1i64))?.then("_add_then", ("1",))
}

/// `async_add_nested(to, x, y, z)`: an async function calling another one,
/// `rpc_async(to, async_add, (to, x, y)).then(+ z)`.
#[remote(async_execution)]
fn async_add_nested(to: String, x: Num, y: Num, z: Num) -> Result<Future> {
    rpc_async(&to, "async_add", (&to, x, y))?.then("_add_then", (z,))
}

/// `async_add_with_future_ctor(to, x, y, z)`: builds a `Future()` and
/// completes it from a `then` callback on `rpc_async(to, add, (x, y))`.
#[remote(async_execution)]
fn async_add_with_future_ctor(to: String, x: Num, y: Num, z: Num) -> Result<Future> {
    let fut = Future::new()?;
    let handle = i64::from(fut.handle());
    drop(rpc_async(&to, "aten::add", (x, y))?.then("_set_future_to_sum", (handle, z))?);
    Ok(fut)
}

/// `async_add_multi_fanout(to, x, num, step)`: `num` concurrent
/// `rpc_async` adds (`x + step`, then `0 + step`), summed by callbacks that
/// share a count and a running sum under a worker-wide lock (the seed's
/// `Lock` and `state` dict, here per-worker globals under a key of this
/// call); the one that counts the last completes the returned future.
#[remote(async_execution)]
fn async_add_multi_fanout(to: String, x: Tensor, num: i64, step: Num) -> Result<Future> {
    let ret_future = Future::new()?;
    let zeros = Tensor::call("aten::zeros_like", (&x,))?;
    if num <= 0 {
        // No callback would ever run (the seed would hang).
        ret_future.set_result(&zeros)?;
        return Ok(ret_future);
    }
    let key = {
        let _guard = lock("fanout")?;
        let id = global::<i64>("fanout.next")?.unwrap_or(0);
        set_global("fanout.next", id + 1)?;
        format!("fanout.{id}")
    };
    set_global(&format!("{key}.cnt"), 0i64)?;
    set_global(&format!("{key}.ret"), &zeros)?;
    let futs = (0..num)
        .map(|i| {
            if i == 0 {
                rpc_async(&to, "aten::add", (&x, &step))
            } else {
                rpc_async(&to, "aten::add", (0i64, &step))
            }
        })
        .collect::<Result<Vec<_>>>()?;
    let handle = i64::from(ret_future.handle());
    for fut in &futs {
        drop(fut.then("_fanout_inc_and_set", (&key, num, handle))?);
    }
    Ok(ret_future)
}

/// The fan-in callback of `async_add_multi_fanout` (the seed's
/// `inc_and_set`): under the call's lock, counts one more result and adds
/// it to the sum; the last one completes the captured future and clears the
/// call's globals.
#[remote]
fn _fanout_inc_and_set(value: Num, key: String, num: i64, ret_future: i64) -> Result<()> {
    let _guard = lock(&key)?;
    let (cnt_key, ret_key) = (format!("{key}.cnt"), format!("{key}.ret"));
    let cnt = global::<i64>(&cnt_key)?.unwrap_or(0) + 1;
    let ret = global::<Num>(&ret_key)?
        .ok_or_else(|| Error::runtime_error(format!("the fan-in state {key} is gone")))?
        .add(&value)?;
    if cnt >= num {
        clear_global(&cnt_key)?;
        clear_global(&ret_key)?;
        with_captured_future(ret_future, |f| f.set_result(&ret))
    } else {
        set_global(&cnt_key, cnt)?;
        set_global(&ret_key, &ret)
    }
}

/// `async_raise_func()`: raises before returning a future.
#[remote(async_execution)]
fn async_raise_func() -> Result<Future> {
    Err(Error::runtime_error("Expected error"))
}

/// `async_wrong_type()`: returns `torch.zeros(2, 2)` instead of a future,
/// which the host refuses (`MaybeFuture` leaves the check to run time, as
/// Python does).
#[remote(async_execution)]
fn async_wrong_type() -> Result<MaybeFuture> {
    Ok(MaybeFuture::value(Tensor::zeros(&[2, 2])?))
}

// ---------------------------------------------------------------------------
// Classes.

/// A second handle to a number (a tensor's handle is duplicated).
fn dup_num(n: &Num) -> Result<Num> {
    Ok(match n {
        Num::Int(i) => Num::Int(*i),
        Num::Float(f) => Num::Float(*f),
        Num::Tensor(t) => Num::Tensor(t.try_clone()?),
    })
}

/// `MyClass(a, delay=False)`: `a` is a number or a tensor.
pub struct MyClass {
    a: Num,
}

#[remote_class]
impl MyClass {
    /// `MyClass(a, delay=False)`: with `delay`, the constructor sleeps a
    /// second.
    #[constructor]
    fn new(a: Num, delay: Option<bool>) -> Result<MyClass> {
        if delay.unwrap_or(false) {
            sleep(1.0)?;
        }
        Ok(MyClass { a })
    }

    /// `self.a + my_instance_arg`.
    fn my_instance_method(&self, my_instance_arg: Num) -> Result<Num> {
        self.a.add(&my_instance_arg)
    }

    /// `@classmethod my_class_method(cls, d, e)`: `d + e`.
    fn my_class_method(d: Num, e: Num) -> Result<Num> {
        d.add(&e)
    }

    /// `@staticmethod my_static_method(f)`: `f > 10`.
    fn my_static_method(f: i64) -> bool {
        f > 10
    }

    /// `self.a += increment`.
    fn increment_value(&mut self, increment: Num) -> Result<()> {
        self.a = self.a.add(&increment)?;
        Ok(())
    }

    /// `self.a`.
    fn get_value(&self) -> Result<Num> {
        dup_num(&self.a)
    }

    /// `my_slow_method(t)`: sleeps 5 s (the seed's), then `self.a + t`.
    fn my_slow_method(&self, my_tensor_arg: Tensor) -> Result<Num> {
        sleep(5.0)?;
        self.a.add(&Num::Tensor(my_tensor_arg))
    }

    /// Reads `a`, sleeps `seconds` (the guest is suspended), then writes
    /// `a + by`: two overlapping calls would lose an update.
    fn slow_increment(&mut self, by: i64, seconds: f64) -> Result<Num> {
        let before = dup_num(&self.a)?;
        sleep(seconds)?;
        self.a = before.add(&Num::Int(by))?;
        dup_num(&self.a)
    }

    /// `self.a + rref.to_here()`: an RRef argument of a method.
    fn add_from_rref(&self, rref: RRef) -> Result<Num> {
        self.a.add(&rref.to_here::<Num>()?)
    }

    /// A method that panics, to check that a broken object reports it.
    fn explode(&self) -> i64 {
        match &self.a {
            Num::Int(a) => panic!("MyClass exploded with a = {a}"),
            Num::Float(a) => panic!("MyClass exploded with a = {a}"),
            Num::Tensor(_) => panic!("MyClass exploded with a tensor"),
        }
    }

    /// `@async_execution bound_async_add(to, x, y)`: `rpc_async(add) + a`.
    #[async_execution]
    fn bound_async_add(&self, to: String, x: Tensor, y: Tensor) -> Result<Future> {
        rpc_async(&to, "aten::add", (x, y))?.then("_add_then", (dup_num(&self.a)?,))
    }
}

/// A class that holds a tensor, so destroying it must release the handle.
pub struct TensorWrapper {
    tensor: Tensor,
}

#[remote_class]
impl TensorWrapper {
    /// `TensorWrapper(t)`.
    #[constructor]
    fn new(t: Tensor) -> TensorWrapper {
        TensorWrapper { tensor: t }
    }

    /// `self.t += v`.
    fn increase(&mut self, v: f64) -> Result<()> {
        self.tensor = self.tensor.add(v)?;
        Ok(())
    }

    /// `self.t.sum()`.
    fn sum(&self) -> Result<Tensor> {
        self.tensor.sum()
    }
}

/// `AsyncExecutionClass()`: `async_execution` static, class and bound
/// methods. Called by name, the static and class methods are
/// `seed_fns::AsyncExecutionClass.static_async_add` and
/// `seed_fns::AsyncExecutionClass.class_async_add`.
pub struct AsyncExecutionClass;

#[remote_class]
impl AsyncExecutionClass {
    /// `AsyncExecutionClass()`.
    #[constructor]
    fn new() -> AsyncExecutionClass {
        AsyncExecutionClass
    }

    /// `@staticmethod @async_execution static_async_add(to, x, y, z)`:
    /// `rpc_async(to, add, (x, y)).then(+ z)`.
    #[async_execution]
    fn static_async_add(to: String, x: Tensor, y: Num, z: Num) -> Result<Future> {
        rpc_async(&to, "aten::add", (x, y))?.then("_add_then", (z,))
    }

    /// `@classmethod @async_execution class_async_add(cls, to, x, y, z)`:
    /// returns a `Future()` it completes by hand with `add(x, y) + z`.
    #[async_execution]
    fn class_async_add(to: String, x: Tensor, y: Num, z: Num) -> Result<Future> {
        let done = Future::new()?;
        let sum: Tensor = rpc_async(&to, "aten::add", (x, y))?.wait()?;
        done.set_result(Num::Tensor(sum).add(&z)?)?;
        Ok(done)
    }

    /// `@async_execution bound_async_add(self, to, x, y, z)`:
    /// `rpc_async(to, add, (x, y)).then(+ z)`.
    #[async_execution]
    fn bound_async_add(&self, to: String, x: Tensor, y: Num, z: Num) -> Result<Future> {
        rpc_async(&to, "aten::add", (x, y))?.then("_add_then", (z,))
    }
}

/// `Tracked(key)`: an object whose destructor counts itself in the
/// per-worker global `key`, so tests can see when its owner disposed of it.
pub struct Tracked {
    key: String,
}

#[remote_class]
impl Tracked {
    /// `Tracked(key)`.
    #[constructor]
    fn new(key: String) -> Tracked {
        Tracked { key }
    }

    /// The key it counts itself in.
    fn key(&self) -> String {
        self.key.clone()
    }

    /// `@staticmethod disposed(key)`: how many `Tracked(key)` objects this
    /// worker disposed of.
    fn disposed(key: String) -> Result<i64> {
        Ok(global::<i64>(&key)?.unwrap_or(0))
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        let n = global::<i64>(&self.key).ok().flatten().unwrap_or(0);
        let _ = set_global(&self.key, n + 1);
    }
}

/// `MyModule(first_arg, first_kwarg=-1)` of `remote_module_test.py`: one
/// parameter, `ones(1)`; `forward(tensor, number, word="default")` returns
/// `(word, number, tensor)`. `word` takes any value, as in Python
/// (`test_input_moved_to_cuda_device` passes a tensor).
pub struct MyModule {
    param1: Tensor,
    training: bool,
}

#[remote_class]
impl MyModule {
    /// `MyModule(first_arg, first_kwarg=-1)`.
    #[constructor]
    fn new(first_arg: i64, first_kwarg: Option<i64>) -> Result<MyModule> {
        let _ = (first_arg, first_kwarg);
        Ok(MyModule {
            param1: Tensor::ones(&[1])?,
            training: true,
        })
    }

    /// `forward(tensor, number, word="default")`: the arguments reversed.
    fn forward(
        &self,
        tensor: Tensor,
        number: i64,
        word: Option<AnyValue>,
    ) -> Result<(AnyValue, i64, Tensor)> {
        let word = match word {
            Some(w) => w,
            None => AnyValue::from_value(Value::Str("default".to_owned()))?,
        };
        Ok((word, number, tensor))
    }

    /// `parameters(recurse=True)`: `[param1]`.
    fn parameters(&self, recurse: Option<bool>) -> Result<Vec<Tensor>> {
        let _ = recurse;
        Ok(vec![self.param1.try_clone()?])
    }

    /// `train(mode=True)`.
    fn train(&mut self, mode: Option<bool>) {
        self.training = mode.unwrap_or(true);
    }

    /// `training`.
    fn training(&self) -> bool {
        self.training
    }

    /// What copying the module out of its owner takes (`to_here()` of its
    /// RRef), as pickling a module copies its `__dict__`: `{"training":
    /// bool, "_parameters": {"param1": tensor}}`.
    fn __getstate__(&self) -> Result<Value> {
        Ok(Value::Dict(vec![
            (Value::from("training"), Value::Bool(self.training)),
            (
                Value::from("_parameters"),
                Value::Dict(vec![(
                    Value::from("param1"),
                    self.param1.try_clone()?.into_value(),
                )]),
            ),
        ]))
    }
}

/// `BadModule(first_arg, first_kwarg=-1)`: constructs, but is not a
/// module (no `forward`).
pub struct BadModule;

#[remote_class]
impl BadModule {
    /// `BadModule(first_arg, first_kwarg=-1)`.
    #[constructor]
    fn new(first_arg: i64, first_kwarg: Option<i64>) -> BadModule {
        let _ = (first_arg, first_kwarg);
        BadModule
    }
}

/// Creates `MyClass(a)` on `dst` from inside a plugin and drives it
/// through its proxies: `increment_value(1)` (sync), `my_instance_method(10)`
/// (async), `get_value()` (remote). Returns `(owner name, (is_owner,
/// confirmed_by_owner), a + 1 + 10, a + 1)`.
#[remote]
fn drive_my_class(dst: String, a: i64) -> Result<(String, (bool, bool), i64, i64)> {
    let obj = remote(&dst, "MyClass", (a,))?;
    obj.rpc_sync().call::<()>("increment_value", (1,))?;
    let sum: i64 = obj.rpc_async().call("my_instance_method", (10,))?.wait()?;
    let value: i64 = obj
        .remote()
        .timeout(30.0)
        .call("get_value", ())?
        .to_here()?;
    Ok((
        obj.owner_name()?,
        (obj.is_owner()?, obj.confirmed_by_owner()?),
        sum,
        value,
    ))
}

// ---------------------------------------------------------------------------
// Misbehaving guests, for the runtime's own tests.

/// Panics with a message: the instance traps.
#[remote]
fn panic_func(message: String) -> i64 {
    panic!("{message}")
}

/// Takes the worker-wide lock `key`, then panics while holding it: the
/// runtime must release the lock when the call ends.
#[remote]
fn lock_then_panic(key: String) -> Result<()> {
    let _guard = lock(&key)?;
    panic!("panicking while holding lock {key}")
}

/// Never returns: only the runtime's time limit stops it.
#[remote]
fn spin_forever() -> i64 {
    let mut x: i64 = 0;
    loop {
        x = core::hint::black_box(x.wrapping_add(1));
    }
}

/// Allocates `megabytes` MiB and touches them.
#[remote]
fn allocate(megabytes: usize) -> usize {
    let v = vec![1u8; megabytes * 1024 * 1024];
    core::hint::black_box(&v)
        .iter()
        .map(|b| usize::from(*b))
        .sum()
}

/// Makes `count` float tensors of `elements` zeros in the host and holds
/// them all until it returns: the host's per-call tensor memory budget
/// bounds what one plugin call can make the worker allocate. Returns the
/// elements made.
#[remote]
fn allocate_tensors(count: i64, elements: i64) -> Result<i64> {
    let mut held = Vec::new();
    for _ in 0..count {
        held.push(Tensor::zeros(&[elements])?);
    }
    Ok(count * elements)
}

/// A float tensor of `elements` ones built from the plugin's own bytes
/// (`Tensor::from_slice`), which the host copies into a tensor it owns.
#[remote]
fn tensor_from_bytes(elements: i64) -> Result<Tensor> {
    let n = usize::try_from(elements).map_err(|_| Error::value_error("negative length"))?;
    Tensor::from_slice(&[elements], &vec![1.0f32; n])
}

/// Returns its bytes unchanged: the benchmark's echo.
#[remote]
fn echo(data: Value) -> Value {
    data
}

/// `run_op(name, args)`: the host op `name` run on `args` from inside this
/// plugin (`Tensor::op`; a bare name is a tensor method), its result
/// returned as is. The sandbox tests (`rpc_test::sandbox`) name ops the
/// worker's op policy refuses through it, as a hostile plugin would.
#[remote]
fn run_op(name: String, args: Vec<Value>) -> Result<Value> {
    Tensor::op(&name, args, &[])
}
