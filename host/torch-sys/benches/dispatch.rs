//! Dispatch overhead: `aten::add` on two 4-element tensors through the shim
//! (name resolved and cached) vs the same call through tch directly.

fn main() {}
