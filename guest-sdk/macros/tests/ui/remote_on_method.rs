use wasmrpc_guest::remote;

struct S;

impl S {
    #[remote]
    fn get(&self) -> i64 {
        1
    }
}

fn main() {}
