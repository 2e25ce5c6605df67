// Autograd through the shim (see ops.h): a tensor's grad_fn and the graph
// of nodes behind it, `torch.autograd.grad` and `backward`, assigning
// `.grad`, and tensor hooks.
//
// Every entry point catches every exception: nothing propagates into Rust.

#include "ops.h"

#include <c10/util/Exception.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/anomaly_mode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/variable.h>

#include "common.h"

#include <atomic>
#include <optional>
#include <sstream>
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

namespace {

// Gradients `grad` computed without libtorch's engine on this thread (see
// `one_node_grad`), counted for `wrs_autograd_engine_bypasses`.
thread_local uint64_t engine_bypasses = 0;

// Off: every `grad` goes through the engine (`wrs_autograd_set_engine_bypass`).
std::atomic<bool> bypass_enabled{true};

// Whether `node` has hooks the engine would run (user code, or the
// engine's own bookkeeping for `retain_grad`).
bool has_hooks(torch::autograd::Node& node) {
  return !node.pre_hooks().empty() || !node.tensor_pre_hooks().empty() ||
         !node.retains_grad_hooks().empty() || !node.post_hooks().empty();
}

// `torch.autograd.grad` of one output whose node's every needed edge
// leads straight to one of `inputs`, run as libtorch's engine runs it but
// without the engine: the seed checked against the root edge
// (`validate_outputs`), the node called with grad mode off, its gradients
// checked and reduced to their edges' shapes (`validate_outputs` again),
// each input's gradient taken at its edge. The engine's fixed cost (its
// graph task, thread-local state, ready queue: about 8 µs warm and 14 µs
// cold on the 2-core VM, against 2.3-5.5 µs for a 16x16 matmul's backward)
// is most of a small distributed backward's pass.
//
// Returns nullopt, having run nothing, whenever the engine would do more
// than that: several outputs, a graph kept only when asked (`retain_graph`
// must be true) or built for higher-order gradients, anomaly mode,
// RecordFunction callbacks (the profiler), a node that is not one of
// libtorch's own (a custom function may ask the engine for its graph
// task), any hook on the node or on an input's node, tensors off the CPU
// or not strided, an edge that leads further than an input, two edges
// into one input (the engine would sum them), one input given twice, the
// output among the inputs, an input whose gradient the
// engine would refuse (unused without `allow_unused`, or not requiring
// grad: the engine words those errors). A node that throws throws as
// under the engine (saved tensors freed, shapes that do not match).
std::optional<torch::autograd::variable_list> one_node_grad(
    const torch::autograd::variable_list& outputs, const torch::autograd::variable_list& seeds,
    const torch::autograd::variable_list& inputs, int32_t retain_graph, int32_t create_graph,
    int32_t allow_unused) {
  using torch::autograd::Edge;
  if (!bypass_enabled.load(std::memory_order_relaxed) || outputs.size() != 1 ||
      seeds.size() != 1 || retain_graph != 1 || create_graph != 0 ||
      torch::autograd::AnomalyMode::is_enabled() || at::hasCallbacks()) {
    return std::nullopt;
  }
  const auto& output = outputs[0];
  const auto& seed = seeds[0];
  auto cpu_strided = [](const at::Tensor& t) {
    return t.defined() && t.is_cpu() && t.layout() == at::kStrided;
  };
  // A seed of another shape or dtype gets libtorch's own error (or
  // conversion) from `torch::autograd::grad`, before its engine.
  if (!cpu_strided(output) || !cpu_strided(seed) || !output.requires_grad() ||
      seed.sizes() != output.sizes() || seed.scalar_type() != output.scalar_type()) {
    return std::nullopt;
  }
  auto fn = output.grad_fn();
  if (!fn || dynamic_cast<torch::autograd::TraceableFunction*>(fn.get()) == nullptr ||
      has_hooks(*fn) || fn->stream().has_value()) {
    return std::nullopt;
  }
  // Each input's edge: where the engine would capture its gradient.
  std::vector<torch::autograd::Node*> input_nodes(inputs.size(), nullptr);
  std::vector<uint32_t> input_nrs(inputs.size(), 0);
  for (size_t j = 0; j < inputs.size(); ++j) {
    const auto& input = inputs[j];
    if (!cpu_strided(input) || !input.requires_grad()) {
      return std::nullopt;
    }
    auto node = input.grad_fn();
    if (!node) {
      node = torch::autograd::impl::try_get_grad_accumulator(input);
    }
    if (node) {
      // An input that is the output itself gets the seed from the engine.
      if (has_hooks(*node) || node.get() == fn.get()) {
        return std::nullopt;
      }
      input_nodes[j] = node.get();
      input_nrs[j] = input.output_nr();
      // The same tensor twice: the engine gives each its gradient.
      for (size_t i = 0; i < j; ++i) {
        if (input_nodes[i] == input_nodes[j] && input_nrs[i] == input_nrs[j]) {
          return std::nullopt;
        }
      }
    } else if (allow_unused == 0) {
      return std::nullopt;
    }
  }
  // Each of the node's edges leads to one input, or to a leaf's
  // accumulator the engine would not run, or nowhere.
  const auto& edges = fn->next_edges();
  std::vector<std::optional<size_t>> edge_input(edges.size());
  std::vector<bool> taken(inputs.size(), false);
  for (size_t k = 0; k < edges.size(); ++k) {
    const auto& edge = edges[k];
    if (!edge.is_valid()) {
      continue;
    }
    for (size_t j = 0; j < inputs.size(); ++j) {
      if (input_nodes[j] == edge.function.get() && input_nrs[j] == edge.input_nr) {
        if (taken[j]) {
          return std::nullopt;
        }
        taken[j] = true;
        edge_input[k] = j;
        break;
      }
    }
    if (!edge_input[k].has_value() &&
        dynamic_cast<torch::autograd::AccumulateGrad*>(edge.function.get()) == nullptr) {
      return std::nullopt;
    }
  }
  if (allow_unused == 0) {
    for (size_t j = 0; j < inputs.size(); ++j) {
      if (!taken[j]) {
        return std::nullopt;
      }
    }
  }
  // The engine's root check: the seed against the output's edge.
  const uint32_t output_nr = output.output_nr();
  torch::autograd::variable_list root_grads{seed};
  torch::autograd::validate_outputs(torch::autograd::edge_list{Edge(fn, output_nr)}, root_grads,
                                    [](const std::string& msg) { return msg; });
  torch::autograd::variable_list buffer(fn->num_inputs());
  buffer.at(output_nr) = std::move(root_grads[0]);
  torch::autograd::variable_list grads;
  {
    at::AutoGradMode grad_mode(false);
    grads = (*fn)(std::move(buffer));
  }
  torch::autograd::validate_outputs(edges, grads, [&](const std::string& msg) {
    std::ostringstream ss;
    ss << "Function " << fn->name() << " returned an " << msg;
    return ss.str();
  });
  torch::autograd::variable_list results(inputs.size());
  for (size_t k = 0; k < edges.size(); ++k) {
    if (edge_input[k].has_value()) {
      results[*edge_input[k]] = std::move(grads[k]);
    }
  }
  ++engine_bypasses;
  return results;
}

}  // namespace

uint64_t wrs_autograd_engine_bypasses() {
  return engine_bypasses;
}

void wrs_autograd_set_engine_bypass(int32_t enabled) {
  bypass_enabled.store(enabled != 0, std::memory_order_relaxed);
}

int32_t wrs_autograd_grad(const void* const* outputs, size_t n_outputs,
                          const void* const* grad_outputs, size_t n_grad_outputs,
                          const void* const* inputs, size_t n_inputs, int32_t retain_graph,
                          int32_t create_graph, int32_t allow_unused, void** results,
                          wrs_out* out) {
  return run_engine_call(out, [&] {
    auto output_list = tensor_list(outputs, n_outputs);
    auto input_list = tensor_list(inputs, n_inputs);
    auto seed_list = tensor_list(grad_outputs, n_grad_outputs);
    auto fast = one_node_grad(output_list, seed_list, input_list, retain_graph, create_graph,
                              allow_unused);
    auto grads = fast.has_value()
                     ? std::move(*fast)
                     : torch::autograd::grad(
                           output_list, input_list, seed_list,
                           retain_graph < 0 ? std::nullopt
                                            : std::optional<bool>(retain_graph != 0),
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
