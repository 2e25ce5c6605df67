//! Paths of the plugins under `plugins/`, built for `wasm32-unknown-unknown`
//! by this crate's build script.
//!
//! Each plugin crate `plugins/<name>/` gets a constant `<NAME>` (e.g.
//! [`SEED_FNS`]) holding the absolute path of its `.wasm` file, and
//! [`PLUGINS`] lists them all. [`foreach_plugin!`] calls a macro once per
//! plugin, so a test module can require one test per plugin:
//!
//! ```
//! macro_rules! assert_tested {
//!     ($name:ident) => {
//!         #[allow(dead_code, reason = "only its existence is checked")]
//!         const _: fn() = $name;
//!     };
//! }
//! fn autograd_fns() {}
//! fn demo() {}
//! fn rl() {}
//! fn param_server() {}
//! fn pipeline() {}
//! fn hello() {}
//! fn probe() {}
//! fn seed_fns() {}
//! wasmrpc_plugins::foreach_plugin!(assert_tested);
//! ```
//!
//! The build script runs a nested `cargo build --release --target
//! wasm32-unknown-unknown -p <each plugin>` on the root workspace with the
//! target directory `<target>/wasm-plugins`, and reruns when anything under
//! `plugins/` or `guest-sdk/` changes.

include!(concat!(env!("OUT_DIR"), "/plugins.rs"));
