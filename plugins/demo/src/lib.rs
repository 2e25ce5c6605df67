//! A first plugin to read: a driver spreads a computation over every
//! worker of a local cluster (`cargo xtask demo` ran it before it ran the
//! parameter server example; try it with `wasmrpc launch --nproc 3
//! --plugins <demo.wasm> --entry demo::run -- 3 1000000`).
//!
//! `run` is the driver: on worker0 it splits the sum of k² for k in 1..=n
//! into one slice per worker, sends each slice to its worker with
//! `rpc_async`, waits for every future, and checks the total against the
//! closed form n(n+1)(2n+1)/6. Each worker computes its slice with aten ops
//! that run in its host (`arange`, `mul`, `sum`), and asks the next worker
//! who it is, so every call also makes a nested call.

use wasmrpc_guest::{Error, Future, Result, Tensor, get_worker_info, remote, rpc_async, rpc_sync};

/// The sum of k² for k in `start..end`, computed with host tensor ops on
/// int64, so it is exact.
#[remote]
fn sum_of_squares(start: i64, end: i64) -> Result<i64> {
    let k = Tensor::call("aten::arange", (start, end))?;
    let total = k.mul(&k)?.sum()?;
    total
        .to_vec::<i64>()?
        .first()
        .copied()
        .ok_or_else(|| Error::runtime_error("aten::sum returned an empty tensor"))
}

/// This worker's name.
#[remote]
fn whoami() -> Result<String> {
    Ok(get_worker_info()?.name)
}

/// One worker's share of the demo: its slice's sum, and the name the next
/// worker gives when asked (a nested call from inside a call).
#[remote]
fn share(start: i64, end: i64, next: String) -> Result<(String, i64, String)> {
    let me = get_worker_info()?.name;
    let partial = sum_of_squares(start, end)?;
    let neighbour: String = rpc_sync(&next, "demo::whoami", ())?;
    Ok((me, partial, neighbour))
}

/// The driver: spreads 1..=n over `world_size` workers and reports.
#[remote]
fn run(world_size: i64, n: i64) -> Result<String> {
    if world_size < 1 || n < 1 {
        return Err(Error::value_error(format!(
            "run needs world_size >= 1 and n >= 1, got world_size={world_size}, n={n}"
        )));
    }
    let chunk = (n + world_size - 1) / world_size;
    let mut calls: Vec<(i64, i64, Future)> = Vec::new();
    for rank in 0..world_size {
        let start = 1 + rank * chunk;
        let end = (start + chunk).min(n + 1);
        let next = format!("worker{}", (rank + 1) % world_size);
        let future = rpc_async(&format!("worker{rank}"), "demo::share", (start, end, next))?;
        calls.push((start, end, future));
    }
    let mut report = String::new();
    let mut total: i64 = 0;
    for (start, end, future) in calls {
        let (who, partial, neighbour): (String, i64, String) = future.wait()?;
        total += partial;
        report.push_str(&format!(
            "\n  {who}: sum of k^2 for k in {start}..={} = {partial} (its neighbour answered as {neighbour})",
            end - 1
        ));
    }
    let expected = n * (n + 1) * (2 * n + 1) / 6;
    let verdict = if total == expected {
        "matches"
    } else {
        "DOES NOT match"
    };
    Ok(format!(
        "{world_size} workers summed k^2 for k in 1..={n}: {total}, which {verdict} n(n+1)(2n+1)/6 = {expected}{report}"
    ))
}
