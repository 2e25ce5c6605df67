//! The `wasmrpc` command: runs workers and the tools around them.

fn main() -> anyhow::Result<()> {
    anyhow::bail!("the wasmrpc command has no subcommands yet")
}
