//! The seed tests that are not ported, each with its reason (STYLE.md: one
//! skip table). `rpc_test::seed_coverage` checks it against
//! `../shared/seed-tests.tsv`: every seed test of the ported areas is either
//! a test of the same name or listed here.

/// `rpc_test` seed tests of areas A to K, M, O, Q, R that have no Rust
/// test yet, and why.
pub const RPC_TEST: &[(&str, &str)] = &[
    ("test_disable_gil_profiling", "python-only: there is no GIL"),
    (
        "test_pg_init_no_rpc_init",
        "needs RRefs (RRef(param) without an agent); DDP part python-only",
    ),
    // One backend, no backend registry.
    (
        "test_register_rpc_backend_and_set_and_start_rpc_backend",
        "no backend registry: one backend",
    ),
    (
        "test_cannot_infer_backend_from_options",
        "no backend registry: one backend",
    ),
    (
        "test_infer_backend_from_options",
        "no backend registry: one backend",
    ),
    // Rejected by the type system in Rust.
    (
        "test_callback_wrong_arg_type",
        "a Future cannot be added to a number: rejected at compile time",
    ),
    (
        "test_pickle_future",
        "a Future cannot be put in a Payload: rejected at compile time",
    ),
    (
        "test_return_future",
        "a function cannot return a Future as its value: rejected at compile time",
    ),
    (
        "test_return_future_async",
        "a function cannot return a Future as its value: rejected at compile time",
    ),
    (
        "test_return_future_remote",
        "a function cannot return a Future as its value: rejected at compile time",
    ),
    // Elsewhere.
    (
        "test_custom_exception_throw_during_reconstruction",
        "needs plugin-raised exception classes outside ErrorKind (wasm runtime)",
    ),
    (
        "test_dynamic_rpc_existing_rank_can_communicate_with_new_rank_cuda",
        "needs 2 GPUs",
    ),
    // Python-only.
    ("test_wrong_types", "python-only: argument type checks"),
    (
        "test_stress_heavy_rpc_torchscript",
        "python-only: TorchScript",
    ),
    ("test_callback_none", "python-only: then(None)"),
    (
        "test_wait_all_exit_early_script_function",
        "python-only: TorchScript",
    ),
    ("test_py_nested_pickle", "python-only: pickler hooks"),
    ("test_use_rpc_pickler", "python-only: pickler override"),
    (
        "test_rref_py_pickle_not_supported",
        "python-only: torch.save of an RRef",
    ),
    (
        "test_mismatched_type_for_options",
        "python-only: options type check",
    ),
    (
        "test_tensorpipe_options_throw_on_timedelta_timeout",
        "python-only: timedelta",
    ),
];
