//! The seed tests that are not ported, each with its reason (STYLE.md: one
//! skip table). `rpc_test::seed_coverage` checks it against
//! `../shared/seed-tests.tsv`: every seed test of the ported areas is either
//! a test of the same name or listed here.

/// `rpc_test` seed tests of areas A to M, O, P, Q, R that have no Rust
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
    // Area L (wasmrpc::profiler): what the profiler does not record yet.
    (
        "test_profiler_rpc_record_shapes",
        "events carry no input shapes yet",
    ),
    (
        "test_profiler_rpc_memory",
        "events carry no memory figures yet",
    ),
    (
        "test_profiler_export_trace",
        "asserts the ops udf_with_torch_ops runs: ops inside a plugin function are not recorded yet (the export itself: rpc_test::profiling::profile_exports_a_chrome_trace)",
    ),
    (
        "test_profiler_remote_events_profiled",
        "asserts the ops udf_with_torch_ops runs: ops inside a plugin function are not recorded yet",
    ),
    (
        "test_profiler_remote_events_profiled_single_threaded",
        "asserts the ops udf_with_torch_ops runs: ops inside a plugin function are not recorded yet",
    ),
    (
        "test_rpc_profiling_async_function",
        "asserts the nested RPC of the plugin's slow_async_add: RPCs made from a plugin are not recorded yet",
    ),
    (
        "test_rpc_profiling_async_function_single_threaded",
        "asserts the nested RPC of the plugin's slow_async_add: RPCs made from a plugin are not recorded yet",
    ),
    (
        "test_rpc_profiling_remote_record_function",
        "record_function inside a plugin function is not recorded yet",
    ),
    (
        "test_profiler_with_remote_udf",
        "its remote-to-self part: a call to self brings no callee events yet",
    ),
    (
        "test_profiler_with_remote_udf_single_threaded",
        "its remote-to-self part: a call to self brings no callee events yet",
    ),
    (
        "test_profiler_with_remote_builtin",
        "its remote-to-self part: a call to self brings no callee events yet",
    ),
    (
        "test_profiler_with_remote_builtin_single_threaded",
        "its remote-to-self part: a call to self brings no callee events yet",
    ),
    (
        "test_server_process_global_profiler",
        "no server-side process-global profiler yet",
    ),
    (
        "test_profiler_remote_cuda",
        "needs a GPU (CUDA kernel times) and ops inside a plugin function recorded",
    ),
    (
        "test_profiler_with_script_async_rpc",
        "python-only: TorchScript",
    ),
    (
        "test_profiler_with_script_async_rpc_single_threaded",
        "python-only: TorchScript",
    ),
    (
        "test_profiler_with_script_sync_rpc",
        "python-only: TorchScript",
    ),
    (
        "test_profiler_with_script_sync_rpc_single_threaded",
        "python-only: TorchScript",
    ),
    (
        "test_profiler_with_script_remote_rpc",
        "python-only: TorchScript",
    ),
    (
        "test_profiler_with_script_remote_rpc_single_threaded",
        "python-only: TorchScript",
    ),
    (
        "test_async_record_function_double_end_callbacks",
        "python-only: record_function end-callback bookkeeping",
    ),
    (
        "test_async_record_function_legacy",
        "python-only: legacy torch.ops.profiler record_function ops",
    ),
    (
        "test_async_record_function_cbs_jit_call",
        "python-only: TorchScript",
    ),
];
