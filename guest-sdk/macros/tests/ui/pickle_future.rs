// `test_pickle_future`: a `Future` cannot be an argument of `rpc_sync`,
// `rpc_async` or `remote`, which PyTorch refuses at call time with "Can not
// pickle torch.futures.Future".
use wasmrpc_guest::{remote, rpc_async, rpc_sync, Future, Result, Tensor};

#[remote]
fn pickle_future(to: String) -> Result<Tensor> {
    let fut = Future::new()?;
    drop(rpc_async(&to, "seed_fns::identity", (&fut,))?);
    drop(remote(&to, "seed_fns::identity", (&fut,))?);
    rpc_sync(&to, "seed_fns::identity", (fut,))
}

fn main() {}
