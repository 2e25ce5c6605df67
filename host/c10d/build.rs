//! Embeds an rpath to libtorch's folder in every binary of this package, so
//! they find `libtorch_cpu.so` at run time without `LD_LIBRARY_PATH`.

fn main() {
    // torch-sys (links = "tch") publishes the folder it linked against.
    if let Ok(lib) = std::env::var("DEP_TCH_LIBTORCH_LIB") {
        // Resolve the set-up's links, so binaries keep working if the
        // checkout moves.
        let lib = std::fs::canonicalize(&lib)
            .map(|p| p.display().to_string())
            .unwrap_or(lib);
        println!("cargo:rustc-link-arg=-Wl,-rpath,{lib}");
    }
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
}
