use wasmrpc_guest::remote_class;

struct Counter {
    n: i64,
}

#[remote_class]
impl Counter {
    #[constructor]
    fn new(n: i64) -> Counter {
        Counter { n }
    }
    #[constructor]
    fn zero() -> Counter {
        Counter { n: 0 }
    }
    fn get(&self) -> i64 {
        self.n
    }
}

fn main() {}
