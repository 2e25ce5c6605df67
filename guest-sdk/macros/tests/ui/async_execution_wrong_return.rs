use wasmrpc_guest::{remote, Tensor, Result};

#[remote(async_execution)]
fn async_wrong_type(x: Tensor) -> Result<Tensor> {
    Ok(x)
}

fn main() {}
