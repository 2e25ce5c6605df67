use wasmrpc_guest::remote;

#[remote]
fn length(s: &str) -> usize {
    s.len()
}

fn main() {}
