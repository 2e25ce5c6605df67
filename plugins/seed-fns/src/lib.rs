//! The seed suites' user functions and classes (`rpc_test.py`, Appendix A of
//! its seed inventory), written with the guest SDK.
//!
//! Names and error texts are the seeds' own, so a ported test reads like the
//! original. The last section holds functions that misbehave on purpose
//! (trap, spin, exhaust memory) for the wasm runtime's own tests.

use wasmrpc_guest::{
    AnyValue, Error, ErrorKind, FromValue, Future, IntoValue, RRef, Result, Tensor, ToValue, Value,
    get_worker_info, global, lock, log, remote, rpc_async, rpc_sync, set_global, sleep,
};

mod async_fns;
mod classes;

pub use classes::{AsyncExecutionClass, BadModule, MyClass, MyModule, TensorWrapper, Tracked};

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
