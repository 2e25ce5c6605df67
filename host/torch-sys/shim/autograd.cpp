// Autograd through the shim (see ops.h): a tensor's grad_fn and the graph
// of nodes behind it, `torch.autograd.grad` and `backward`, assigning
// `.grad`, and tensor hooks.
//
// Every entry point catches every exception: nothing propagates into Rust.

#include "ops.h"

#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>

#include "common.h"

#include <string>
#include <type_traits>
#include <utility>
#include <vector>

struct wrs_node {
  // libtorch 2.13 holds autograd nodes in `c10::intrusive_ptr`, earlier
  // releases in `std::shared_ptr`: take whatever `grad_fn()` returns, so the
  // shim builds against the libtorch a GPU image ships (`cargo xtask
  // gpu-bundle`) as well as against the one tch expects.
  std::remove_cvref_t<decltype(std::declval<const at::Tensor&>().grad_fn())> node;
};

namespace {

using wasmrpc_shim::BadInput;
using wasmrpc_shim::error_class;
using wasmrpc_shim::set_error;
using wasmrpc_shim::tls;
using wasmrpc_shim::Tls;

// The tensors behind an array of `at::Tensor*`.
torch::autograd::variable_list tensor_list(const void* const* ptrs, size_t n) {
  torch::autograd::variable_list list;
  list.reserve(n);
  for (size_t k = 0; k < n; ++k) {
    if (ptrs[k] == nullptr) {
      throw BadInput("null tensor pointer");
    }
    list.push_back(*static_cast<const at::Tensor*>(ptrs[k]));
  }
  return list;
}

// Runs a call into libtorch's autograd engine: an exception it throws
// becomes `out`'s error (WRS_ERR_OP, with libtorch's text and class).
template <typename F>
int32_t run_engine_call(wrs_out* out, F&& body) {
  try {
    return body();
  } catch (const c10::Error& e) {
    set_error(out, e.what_without_backtrace(), error_class(e));
    return WRS_ERR_OP;
  } catch (const std::exception& e) {
    set_error(out, e.what(), WRS_CLASS_RUNTIME);
    return WRS_ERR_OP;
  } catch (...) {
    set_error(out, "unknown C++ exception", WRS_CLASS_RUNTIME);
    return WRS_ERR_INTERNAL;
  }
}

// The node that made `tensor` (a `const at::Tensor*`), or null for a
// leaf, an undefined tensor or a null pointer (the pointer type
// grad_fn() returns, which differs between libtorch releases).
auto grad_fn_of(const void* tensor)
    -> std::remove_cvref_t<decltype(std::declval<const at::Tensor&>().grad_fn())> {
  const auto* t = static_cast<const at::Tensor*>(tensor);
  if (t == nullptr || !t->defined()) {
    return {};
  }
  return t->grad_fn();
}

}  // namespace

extern "C" {

int32_t wrs_grad_fn_name(const void* tensor, wrs_str* name) {
  try {
    const auto fn = grad_fn_of(tensor);
    if (!fn) {
      return 0;
    }
    Tls& s = tls();
    s.text = fn->name();
    name->ptr = s.text.data();
    name->len = s.text.size();
    return 1;
  } catch (...) {
    return -1;
  }
}

int32_t wrs_tensor_grad_fn(const void* tensor, wrs_node** node) {
  try {
    const auto fn = grad_fn_of(tensor);
    if (!fn) {
      return 0;
    }
    *node = new wrs_node{fn};
    return 1;
  } catch (...) {
    return -1;
  }
}

void wrs_node_free(wrs_node* node) {
  delete node;
}

int32_t wrs_node_name(const wrs_node* node, wrs_str* name) {
  try {
    Tls& s = tls();
    s.text = node->node->name();
    name->ptr = s.text.data();
    name->len = s.text.size();
    return WRS_OK;
  } catch (...) {
    return WRS_ERR_INTERNAL;
  }
}

uintptr_t wrs_node_id(const wrs_node* node) {
  return reinterpret_cast<uintptr_t>(node->node.get());
}

size_t wrs_node_num_next(const wrs_node* node) {
  return node->node->next_edges().size();
}

int32_t wrs_node_next(const wrs_node* node, size_t index, wrs_node** next, uint32_t* input_nr) {
  try {
    const auto& edges = node->node->next_edges();
    if (index >= edges.size()) {
      return WRS_ERR_INTERNAL;
    }
    const auto& edge = edges[index];
    *next = edge.function ? new wrs_node{edge.function} : nullptr;
    *input_nr = edge.input_nr;
    return WRS_OK;
  } catch (...) {
    return WRS_ERR_INTERNAL;
  }
}

int32_t wrs_node_variable(const wrs_node* node, void** tensor) {
  try {
    auto* acc = dynamic_cast<torch::autograd::AccumulateGrad*>(node->node.get());
    if (acc == nullptr || !acc->variable.defined()) {
      return 0;
    }
    *tensor = new at::Tensor(acc->variable);
    return 1;
  } catch (...) {
    return -1;
  }
}

int32_t wrs_autograd_grad(const void* const* outputs, size_t n_outputs,
                          const void* const* grad_outputs, size_t n_grad_outputs,
                          const void* const* inputs, size_t n_inputs, int32_t retain_graph,
                          int32_t create_graph, int32_t allow_unused, void** results,
                          wrs_out* out) {
  return run_engine_call(out, [&] {
    auto grads = torch::autograd::grad(
        tensor_list(outputs, n_outputs), tensor_list(inputs, n_inputs),
        tensor_list(grad_outputs, n_grad_outputs),
        retain_graph < 0 ? std::nullopt : std::optional<bool>(retain_graph != 0),
        create_graph != 0, allow_unused != 0);
    if (grads.size() != n_inputs) {
      set_error(out, "autograd returned a gradient count that does not match the inputs",
                WRS_CLASS_RUNTIME);
      return WRS_ERR_INTERNAL;
    }
    for (size_t k = 0; k < n_inputs; ++k) {
      results[k] = grads[k].defined() ? new at::Tensor(std::move(grads[k])) : nullptr;
    }
    return WRS_OK;
  });
}

int32_t wrs_tensor_set_grad(void* tensor, const void* grad, wrs_out* out) {
  return run_engine_call(out, [&] {
    auto& t = *static_cast<at::Tensor*>(tensor);
    if (grad == nullptr) {
      t.mutable_grad().reset();
      return WRS_OK;
    }
    const auto& g = *static_cast<const at::Tensor*>(grad);
    // The texts of PyTorch's `Tensor.grad` setter (python_variable.cpp).
    if (g.scalar_type() != t.scalar_type()) {
      set_error(out, "assigned grad has data of a different type", WRS_CLASS_RUNTIME);
      return WRS_ERR_INTERNAL;
    }
    if (g.device() != t.device()) {
      set_error(out, "assigned grad has data located on a different device", WRS_CLASS_RUNTIME);
      return WRS_ERR_INTERNAL;
    }
    if (g.sizes() != t.sizes()) {
      set_error(out, "assigned grad has data of a different size", WRS_CLASS_RUNTIME);
      return WRS_ERR_INTERNAL;
    }
    t.mutable_grad() = g;
    return WRS_OK;
  });
}

int32_t wrs_autograd_backward(const void* const* roots, size_t n_roots, int32_t retain_graph,
                              wrs_out* out) {
  return run_engine_call(out, [&] {
    torch::autograd::backward(tensor_list(roots, n_roots), {},
                              std::optional<bool>(retain_graph != 0), false);
    return WRS_OK;
  });
}

namespace {

// A Rust hook, shared by the copies libtorch makes of the std::function;
// the last one frees the Rust closure.
struct RustHook {
  wrs_hook_fn call;
  void* ctx;
  wrs_hook_drop drop;
  RustHook(wrs_hook_fn c, void* x, wrs_hook_drop d) : call(c), ctx(x), drop(d) {}
  RustHook(const RustHook&) = delete;
  RustHook& operator=(const RustHook&) = delete;
  ~RustHook() { drop(ctx); }
};

}  // namespace

int32_t wrs_tensor_register_hook(const void* tensor, wrs_hook_fn hook, void* ctx,
                                 wrs_hook_drop drop, uint32_t* index, wrs_out* out) {
  // Owned from here on, so an exception below still frees the closure.
  auto rust = std::make_shared<RustHook>(hook, ctx, drop);
  return run_engine_call(out, [&] {
    const auto& t = *static_cast<const at::Tensor*>(tensor);
    unsigned pos = t.register_hook([rust](const at::Tensor& grad) -> at::Tensor {
      const uint8_t* err = nullptr;
      size_t err_len = 0;
      void* mapped = rust->call(rust->ctx, &grad, &err, &err_len);
      if (mapped == nullptr) {
        throw std::runtime_error(err == nullptr ? std::string("a tensor hook failed")
                                                : std::string(reinterpret_cast<const char*>(err),
                                                              err_len));
      }
      auto* owned = static_cast<at::Tensor*>(mapped);
      at::Tensor result = std::move(*owned);
      delete owned;
      return result;
    });
    *index = static_cast<uint32_t>(pos);
    return WRS_OK;
  });
}

int32_t wrs_tensor_remove_hook(const void* tensor, uint32_t index, wrs_out* out) {
  return run_engine_call(out, [&] {
    static_cast<const at::Tensor*>(tensor)->remove_hook(index);
    return WRS_OK;
  });
}

}  // extern "C"
