use wasmrpc_guest::remote;

#[remote]
fn sum((a, b): (i64, i64)) -> i64 {
    a + b
}

fn main() {}
