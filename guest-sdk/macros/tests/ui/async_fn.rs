use wasmrpc_guest::remote;

#[remote]
async fn slow(x: i64) -> i64 {
    x
}

fn main() {}
