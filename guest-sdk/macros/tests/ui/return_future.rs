// `test_return_future`: a plain (not `async_execution`) function cannot
// return a `Future`, which PyTorch refuses at run time with "Can not pickle
// torch.futures.Future".
use wasmrpc_guest::{remote, Future, Result};

#[remote]
fn return_future() -> Result<Future> {
    Future::new()
}

fn main() {}
