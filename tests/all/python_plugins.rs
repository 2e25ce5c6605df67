//! The seed tests run against the Python plugin: the seeds' helper
//! functions written in Python (`plugins/python/seed-fns-py/app.py`, close to
//! `rpc_test.py`'s and `dist_autograd_test.py`'s text), built into a
//! component with componentize-py and served by every worker as
//! `seed_fns_py::<name>` beside the Rust `seed_fns` plugin. Each test keeps
//! its seed's name and asserts what the seed asserts; the Rust-plugin
//! versions of the same tests are in `rpc_test` and `dist_autograd_test`.
//!
//! - [`rpc_test`]: areas B (Python UDFs, errors), C (nested calls, stress)
//!   and D (RRefs, `remote`, classes through RRef proxies).
//! - [`dist_autograd_test`]: area B (graphs of RPCs to Python functions,
//!   distributed backward through them).
//! - [`deploy`]: a Python plugin deployed to a running group.
//! - [`param_server`]: the Python parameter-server example
//!   (`plugins/python/ps-trainer-py`) trains its model.
//! - [`files`]: a Python plugin's files in its granted folders
//!   (`plugins/python/files-py`), and what a grant never gives.
//! - [`function_refs`]: registered functions passed as RPC arguments, by
//!   reference to their names.
//! - [`torch_api`]: the kit's `torch`, `nn`, `optim` and indexing on the
//!   wasm path (`plugins/python/torch-api-py`), against libtorch.
//! - [`pytorch_parity`]: one model file (the parameter server tutorial's
//!   CNN and loop, an LSTM) trained in a plugin and under PyTorch, to the
//!   same losses (`plugins/python/digits-py`).

mod deploy;
mod dist_autograd_test;
mod files;
mod function_refs;
mod param_server;
mod pytorch_parity;
mod rpc_test;
mod single_instance;
mod torch_api;
