//! One test binary for every ported seed suite, so libtorch is linked once.
//!
//! - `dist_autograd_test`: PyTorch's `dist_autograd_test.py` (CPU tests
//!   that need no RRefs), each test named as in the seed.
//! - `rpc_test`: PyTorch's `rpc_test.py` (areas A, B, C, G, H, I, K, O, Q, R
//!   on the CPU), each test named exactly as in the seed, plus the agent's
//!   own failure tests in `rpc_test::extra`; its RRef tests (areas D, E, F,
//!   M) in `rpc_test::rref`, its `@async_execution` function tests (area J)
//!   in `rpc_test::async_execution`.

mod deploy_test;
mod dist_autograd_test;
mod plugin_test;
mod rpc_test;
