wasmrpc_guest::permissions!(files = ["/etc/passwd"]);

wasmrpc_guest::permissions!(ops = "aten::from_file");

wasmrpc_guest::permissions!(calls = ["hello::*", "two words"]);

wasmrpc_guest::permissions!(ops = ["aten::add"], ops = ["aten::mul"]);

fn main() {}
