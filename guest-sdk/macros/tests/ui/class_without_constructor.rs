use wasmrpc_guest::remote_class;

struct Counter {
    n: i64,
}

#[remote_class]
impl Counter {
    fn get(&self) -> i64 {
        self.n
    }
}

fn main() {}
