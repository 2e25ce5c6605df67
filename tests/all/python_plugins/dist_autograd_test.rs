//! `dist_autograd_test.py`'s area B on the Python plugin: the graphs that
//! RPCs to Python functions record, and distributed backward through them.
//! The test bodies are `dist_autograd_test`'s, given the Python function's
//! name (`seed_fns_py::my_py_add`, ...) instead of the native stand-in's.

use wasmrpc::FunctionRegistry;
use wasmrpc::testing::{Cluster, ClusterBuilder};
use wasmrpc_tests::{WORLD_SIZE, dist_with, python_seed_fns_plugin};

use crate::dist_autograd_test::{
    MODES, grad_only_on_return_value_impl, nested_python_udf_impl, test_graph,
    test_graph_for_py_nested_call_impl, test_graph_for_py_nested_call_itself_impl, udf_two_args,
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

#[test]
fn test_graph_for_py_nested_remote_call_itself() {
    dist_with(cluster(), |w| {
        test_graph_for_py_nested_call_itself_impl(w, "seed_fns_py::my_py_nested_call", false, true)
    });
}

// The sparse variants: COO tensors built by the test, added by the Python
// function through the host's ops.

#[test]
fn test_graph_for_python_call_sparse() {
    dist_with(cluster(), |w| {
        test_graph(w, "seed_fns_py::my_py_add", true, false)
    });
}

#[test]
fn test_graph_for_python_remote_call_sparse() {
    dist_with(cluster(), |w| {
        test_graph(w, "seed_fns_py::my_py_add", true, true)
    });
}

#[test]
fn test_graph_for_py_nested_call_sparse() {
    dist_with(cluster(), |w| {
        test_graph_for_py_nested_call_impl(w, "seed_fns_py::my_py_nested_call", true, false)
    });
}

#[test]
fn test_graph_for_py_nested_remote_call_sparse() {
    dist_with(cluster(), |w| {
        test_graph_for_py_nested_call_impl(w, "seed_fns_py::my_py_nested_call", true, true)
    });
}

#[test]
fn test_graph_for_py_nested_call_itself_sparse() {
    dist_with(cluster(), |w| {
        test_graph_for_py_nested_call_itself_impl(w, "seed_fns_py::my_py_nested_call", true, false)
    });
}

#[test]
fn test_graph_for_py_nested_remote_call_itself_sparse() {
    dist_with(cluster(), |w| {
        test_graph_for_py_nested_call_itself_impl(w, "seed_fns_py::my_py_nested_call", true, true)
    });
}

#[test]
fn test_backward_simple_python_udf_sparse() {
    dist_with(cluster(), |w| {
        udf_two_args(w, "seed_fns_py::my_py_add", MODES, true)
    });
}

#[test]
fn test_backwards_nested_python_udf_sparse() {
    dist_with(cluster(), |w| {
        nested_python_udf_impl(w, "seed_fns_py::_nested_python_udf", true)
    });
}

/// The Python plugin keeps the seed's module-level `requires_grad_tensor`
/// as a worker global (`requires_grad_tensor()` in its `app.py`), read here
/// with [`wasmrpc::plugin_global`].
fn grad_only_on_return_value(remote: bool) {
    dist_with(cluster(), move |w| {
        grad_only_on_return_value_impl(w, "seed_fns_py::ret_requires_grad", remote, |a| {
            wasmrpc::plugin_global(a, "seed_fns_py", "requires_grad_tensor")
                .and_then(|p| p.as_tensor().ok())
        })
    });
}

#[test]
fn test_grad_only_on_return_value() {
    grad_only_on_return_value(false);
}

#[test]
fn test_grad_only_on_return_value_remote() {
    grad_only_on_return_value(true);
}
