//! Helpers shared by the integration tests: a timeout around every async
//! test, and finding PyTorch's Python.

#![allow(dead_code, reason = "each test crate uses a different subset")]

use std::future::Future;
use std::path::PathBuf;
use std::time::Duration;

/// Runs `fut` and fails the test if it takes longer than `limit`.
pub(crate) async fn timed<T>(limit: Duration, fut: impl Future<Output = T>) -> T {
    match tokio::time::timeout(limit, fut).await {
        Ok(out) => out,
        Err(_) => panic!("test timed out after {limit:?}"),
    }
}

/// `$WASMRPC_ENV/venv/bin/<tool>` if it exists; otherwise prints the skip
/// line and returns `None`.
pub(crate) fn torch_tool(tool: &str) -> Option<PathBuf> {
    let env = std::env::var_os("WASMRPC_ENV").map(PathBuf::from);
    let path = env
        .clone()
        .unwrap_or_else(|| PathBuf::from(".wasmrpc-env"))
        .join("venv/bin")
        .join(tool);
    if path.exists() {
        Some(path)
    } else {
        println!("wasmrpc-skip: torch python not found at {}", path.display());
        None
    }
}

/// The venv's Python, if torch is installed there.
pub(crate) fn torch_python() -> Option<PathBuf> {
    torch_tool("python")
}

/// A script kept next to the tests.
pub(crate) fn script(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests")
        .join(name)
}
