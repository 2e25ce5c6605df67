//! Paths of the plugins under `plugins/`, built for `wasm32-unknown-unknown`
//! by this crate's build script.
