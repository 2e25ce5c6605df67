//! One test binary for every ported seed suite, so libtorch is linked once.
//!
//! - `dist_autograd_test`: PyTorch's `dist_autograd_test.py` (CPU tests
//!   that need no RRefs), each test named as in the seed.
//! - `rpc_test`: PyTorch's `rpc_test.py` (areas A, B, C, G, H, I, K, O, Q, R
//!   on the CPU), each test named exactly as in the seed, plus the agent's
//!   own failure tests in `rpc_test::extra`, attacks on the op policy in
//!   `rpc_test::sandbox`; its RRef tests (areas D, E, F,
//!   M) in `rpc_test::rref`, its `@async_execution` tests (area J) in
//!   `rpc_test::async_execution` (functions) and `rpc_test::async_class`
//!   (methods of a plugin class).
//! - `remote_module_test`: PyTorch's `remote_module_test.py` (CPU tests,
//!   `RemoteModule` over plugin classes).
//! - `python_plugins`: seed tests of `rpc_test` (areas B, C, D) and
//!   `dist_autograd_test` (area B) run against the seeds' functions written
//!   in Python (`plugins/python/seed-fns-py`), a Python plugin deployed to a
//!   running group, and the Python parameter-server example.

mod deploy_test;
mod dist_autograd_test;
mod folder_grants_test;
mod metrics_test;
mod plugin_test;
mod python_plugins;
mod remote_module_test;
mod rpc_test;
mod trace_test;
mod upgrade_test;
