//! A plugin that reaches past what a deployed plugin may do by default, for
//! the least-privilege tests (`tests/all/deploy_test.rs`): deployed, it runs
//! the worker's op families and calls its own functions and builtin ops;
//! it declares one more op (`aten::from_file`, which a worker serves only
//! if its operator allows it) and one function of another plugin
//! (`seed_fns::identity`). Its functions run or call whatever they are
//! told, so the tests can try everything else too. Its file functions do
//! the same with paths, for the folder grant tests.
//!
//! POLICY_TEST_NAMES_DENIED_OPS: the op it declares is one the default op
//! policy refuses, on purpose.

use wasmrpc_guest::{Error, RRef, Result, Tensor, Value, fs, permissions, remote, rpc_sync};

permissions!(ops = ["aten::from_file"], calls = ["seed_fns::identity"]);

/// `relay(dst, function, args)`: `function(*args)` on worker `dst`, by
/// `rpc_sync`.
#[remote]
fn relay(dst: String, function: String, args: Vec<Value>) -> Result<Value> {
    rpc_sync(&dst, &function, args)
}

/// `relay_remote(dst, function, args)`: `function(*args)` on worker `dst`,
/// by `remote`, fetched back.
#[remote]
fn relay_remote(dst: String, function: String, args: Vec<Value>) -> Result<Value> {
    let rref: RRef = wasmrpc_guest::remote(&dst, &function, args)?;
    rref.to_here()
}

/// `run_op(name, args)`: the host op `name` on `args` (a bare name is a
/// tensor method), its result returned as is.
#[remote]
fn run_op(name: String, args: Vec<Value>) -> Result<Value> {
    Tensor::op(&name, args, &[])
}

/// `run_op_kw(name, args, kwargs)`: [`run_op`] with keyword arguments, given
/// as a dict of names to values (the op fuzzer's calls through a plugin).
#[remote]
fn run_op_kw(name: String, args: Vec<Value>, kwargs: Value) -> Result<Value> {
    let Value::Dict(items) = kwargs else {
        return Err(wasmrpc_guest::Error::type_error(
            "run_op_kw takes its keyword arguments as a dict",
        ));
    };
    let mut named = Vec::with_capacity(items.len());
    for (key, value) in items {
        let Value::Str(key) = key else {
            return Err(wasmrpc_guest::Error::type_error(
                "keyword argument names must be strings",
            ));
        };
        named.push((key, value));
    }
    let kwargs: Vec<(&str, Value)> = named.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
    Tensor::op(&name, args, &kwargs)
}

// ---- Files: the folder grant tests (`tests/all/folder_grants_test.rs`)
// call these with whatever paths an attacker would try.

/// `read_file(path)`: the bytes of a file in a granted folder.
#[remote]
fn read_file(path: String) -> Result<Value> {
    Ok(Value::Bytes(fs::read(&path)?))
}

/// `write_file(path, data)`: writes `data` (bytes or a string) to a file in
/// a granted folder.
#[remote]
fn write_file(path: String, data: Value) -> Result<()> {
    match data {
        Value::Bytes(b) => fs::write(&path, b),
        Value::Str(s) => fs::write(&path, s),
        other => Err(Error::type_error(format!(
            "write_file takes bytes or a string, not {}",
            other.type_name()
        ))),
    }
}

/// `list_dir(path)`: the names in a granted folder (folders end in `/`).
#[remote]
fn list_dir(path: String) -> Result<Vec<String>> {
    Ok(fs::list(&path)?
        .into_iter()
        .map(|e| {
            if e.is_dir {
                format!("{}/", e.name)
            } else {
                e.name
            }
        })
        .collect())
}

/// `remove_file(path)`: removes a file in a granted folder.
#[remote]
fn remove_file(path: String) -> Result<()> {
    fs::remove(&path)
}

/// `save_tensors(path, tensors)`: saves `(name, tensor)` pairs to a
/// safetensors file.
#[remote]
fn save_tensors(path: String, tensors: Vec<(String, Tensor)>) -> Result<()> {
    let named: Vec<(&str, &Tensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    fs::save_tensors(&path, &named)
}

/// `load_tensors(path)`: every tensor of a tensor file, as `(name,
/// tensor)` pairs in the file's order.
#[remote]
fn load_tensors(path: String) -> Result<Vec<(String, Tensor)>> {
    fs::load_tensors(&path)
}

/// The group's health as a plugin sees it (`wasmrpc_guest::supervision`):
/// waits for the next failure of a worker not in `known`, then answers
/// `(restart count, [(worker, cause), ...] declared so far, (worker, cause)
/// of that failure)`.
#[remote]
fn supervision(known: Vec<String>) -> Result<Value> {
    use wasmrpc_guest::supervision::{self, WorkerFailure};
    let next: WorkerFailure = supervision::next_worker_failure(&known)?.wait()?;
    let pair = |f: &WorkerFailure| {
        Value::Tuple(vec![
            Value::Str(f.worker.clone()),
            Value::Str(f.cause.clone()),
        ])
    };
    let failed = supervision::failed_workers()?;
    Ok(Value::Tuple(vec![
        Value::Int(i64::from(supervision::restart_count()?)),
        Value::List(failed.iter().map(pair).collect()),
        pair(&next),
    ]))
}
