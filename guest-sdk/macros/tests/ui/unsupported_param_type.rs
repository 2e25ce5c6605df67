use wasmrpc_guest::remote;

struct Opaque;

#[remote]
fn f(x: Opaque) -> i64 {
    let _ = x;
    1
}

fn main() {}
