// Included by the build scripts that compile C++ against libtorch
// (torch-sys's shim, c10d's shim, the Python bridge).

/// Whether this run is for `cargo clippy`, which only checks: nothing is
/// linked, so the C++ need not be compiled. Clippy is the workspace's rustc
/// wrapper, and a wrapper makes Cargo run a build script again instead of
/// reusing the build's run: without this, every lint pass compiled the C++
/// files against torch's headers again (minutes on 2 cores).
fn only_checking() -> bool {
    std::env::var_os("RUSTC_WORKSPACE_WRAPPER").is_some_and(|wrapper| {
        std::path::Path::new(&wrapper)
            .file_stem()
            .is_some_and(|name| name == "clippy-driver")
    })
}
