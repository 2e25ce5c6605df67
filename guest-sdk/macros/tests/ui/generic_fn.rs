use wasmrpc_guest::remote;

#[remote]
fn identity<T>(x: T) -> T {
    x
}

fn main() {}
