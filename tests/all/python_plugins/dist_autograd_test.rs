//! `dist_autograd_test.py`'s area B on the Python plugin: the graphs that
//! RPCs to Python functions record, and distributed backward through them.
//! The test bodies are `dist_autograd_test`'s, given the Python function's
//! name (`seed_fns_py::my_py_add`, ...) instead of the native stand-in's.

use wasmrpc::FunctionRegistry;
use wasmrpc::testing::{Cluster, ClusterBuilder};
use wasmrpc_tests::{WORLD_SIZE, dist_with, python_seed_fns_plugin};

use crate::dist_autograd_test::{
    MODES, nested_python_udf_impl, test_graph, test_graph_for_py_nested_call_impl,
    test_graph_for_py_nested_call_itself_impl, udf_two_args,
};

/// The dist-autograd suite's workers (its native helpers, e.g.
/// `seed::_set_rpc_done`), serving the Python plugin too.
fn cluster() -> ClusterBuilder {
    Cluster::builder(WORLD_SIZE).functions(|r: &FunctionRegistry| {
        crate::dist_autograd_test::fns::register(r);
        let (host, plugin) = python_seed_fns_plugin();
        host.register(plugin, r);
    })
}

#[test]
fn test_graph_for_python_call() {
    dist_with(cluster(), |w| {
        test_graph(w, "seed_fns_py::my_py_add", false, false)
    });
}

#[test]
fn test_graph_for_python_remote_call() {
    dist_with(cluster(), |w| {
        test_graph(w, "seed_fns_py::my_py_add", false, true)
    });
}

#[test]
fn test_graph_for_py_nested_call() {
    dist_with(cluster(), |w| {
        test_graph_for_py_nested_call_impl(w, "seed_fns_py::my_py_nested_call", false, false)
    });
}

#[test]
fn test_graph_for_py_nested_remote_call() {
    dist_with(cluster(), |w| {
        test_graph_for_py_nested_call_impl(w, "seed_fns_py::my_py_nested_call", false, true)
    });
}

#[test]
fn test_graph_for_py_nested_call_itself() {
    dist_with(cluster(), |w| {
        test_graph_for_py_nested_call_itself_impl(w, "seed_fns_py::my_py_nested_call", false, false)
    });
}

#[test]
fn test_backward_simple_python_udf() {
    dist_with(cluster(), |w| {
        udf_two_args(w, "seed_fns_py::my_py_add", MODES, false)
    });
}

#[test]
fn test_backwards_nested_python_udf() {
    dist_with(cluster(), |w| {
        nested_python_udf_impl(w, "seed_fns_py::_nested_python_udf", false)
    });
}
