//! The seeds' `@rpc.functions.async_execution` functions: each returns a
//! future the caller's reply waits for.

use wasmrpc_guest::{
    AnyValue, Error, FromValue, Future, MaybeFuture, Result, Tensor, Value, clear_global, global,
    lock, remote, rpc_async, set_global,
};

use crate::{Num, with_captured_future};

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
