use wasmrpc_guest::remote;

#[remote(asynchronous)]
fn f() -> i64 {
    1
}

fn main() {}
