// Builtin ops by schema name through libtorch's JIT operator registry: the
// C API (`ops.h`) for name resolution, schemas, matching and the call. What
// the call is made of lives beside it: the arguments' conversion to IValues
// in `op_args.cpp`, schema matching in `op_match.cpp`, the outputs' value
// tree in `op_emit.cpp`.
//
// Every entry point catches every exception: nothing propagates into Rust.

#include "ops.h"

#include <ATen/core/function_schema.h>
#include <c10/util/Exception.h>
#include <torch/csrc/jit/runtime/operator.h>

#include "common.h"
#include "guards.h"
#include "op_match.h"

#include <algorithm>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace {

using namespace wasmrpc_shim::ops;
using wasmrpc_shim::error_class;
using wasmrpc_shim::set_error;
using wasmrpc_shim::tls;
using wasmrpc_shim::Tls;

// `Operator::op_` is private, but a call by name must know whether a
// JIT-only operator builds its Operation from a graph node (an
// `OperationCreator`): those dereference the node, and there is none here.
// Naming a private member in an explicit instantiation is allowed, which is
// how this reads it without changing its access.
struct OperatorVariantTag {
  friend constexpr auto operator_variant(OperatorVariantTag);
};
template <auto Member>
struct ReadOperatorVariant {
  friend constexpr auto operator_variant(OperatorVariantTag) {
    return Member;
  }
};
template struct ReadOperatorVariant<&torch::jit::Operator::op_>;

// True if `op` is a JIT-only operator whose Operation needs a graph node.
bool needs_graph_node(const torch::jit::Operator& op) {
  const auto& variant = op.*operator_variant(OperatorVariantTag{});
  if (variant.index() == 0) {
    return false;  // a c10 operator: boxed calls need no node
  }
  return std::get<1>(variant).op_.index() != 0;  // an OperationCreator
}

int32_t call_impl(const wrs_op* op, const wrs_value* raw_nodes, size_t n_nodes, size_t n_args,
                  const wrs_str* kw_names, size_t n_kwargs, bool method_varargs, wrs_out* out) {
  Nodes nodes{raw_nodes, n_nodes};
  Split top = split_top_level(nodes, n_args, n_kwargs);
  CallArgs call{nodes, top.args, top.kwargs, kw_names, method_varargs};
  Stack stack;
  const Overload* found = match(op, call, stack, out);
  if (found == nullptr) {
    return WRS_ERR_SCHEMA;
  }

  try {
    if (auto refusal = wasmrpc_guards::unsafe_arguments(found->op->schema(), stack)) {
      set_error(out, std::move(refusal->message), refusal->error_class);
      return WRS_ERR_OP;
    }
    found->operation(stack);
  } catch (const c10::Error& e) {
    set_error(out, e.what_without_backtrace(), error_class(e));
    return WRS_ERR_OP;
  } catch (const std::exception& e) {
    set_error(out, e.what(), WRS_CLASS_RUNTIME);
    return WRS_ERR_OP;
  }

  emit_outputs(stack, out);
  return WRS_OK;
}

}  // namespace

extern "C" {

int32_t wrs_op_resolve(const char* name, size_t name_len, wrs_op** op, wrs_out* out) {
  // JIT-only operators parse their schema lazily, without a lock, on first
  // use; resolving one name at a time (and touching every schema here)
  // keeps that first parse off the concurrent call path.
  static std::mutex resolve_mutex;
  std::lock_guard<std::mutex> guard(resolve_mutex);
  try {
    std::string qualified(name, name_len);
    std::vector<std::shared_ptr<torch::jit::Operator>> found;
    if (qualified.find("::") != std::string::npos) {
      auto symbol = c10::Symbol::fromQualString(qualified);
      found = torch::jit::getAllOperatorsFor(symbol);
    }
    auto handle = std::make_unique<wrs_op>();
    handle->name = qualified;
    // PyTorch RPC's `matchBuiltinOp` prefers c10 ops (they go through the
    // dispatcher), then tries the JIT-only ones. Operators that build their
    // operation from a graph node, and vararg ones (which read their input
    // count from the stack the interpreter pushes), cannot be called by name.
    for (int pass = 0; pass < 2; ++pass) {
      for (const auto& o : found) {
        if (o->isC10Op() != (pass == 0) || o->schema().is_vararg() || needs_graph_node(*o)) {
          continue;
        }
        handle->overloads.push_back(Overload{o, o->getOperation()});
      }
    }
    if (handle->overloads.empty()) {
      set_error(out, "Unknown builtin op: " + qualified, WRS_CLASS_RUNTIME);
      return WRS_ERR_UNKNOWN_OP;
    }
    *op = handle.release();
    return WRS_OK;
  } catch (const c10::Error& e) {
    set_error(out, e.what_without_backtrace(), WRS_CLASS_RUNTIME);
    return WRS_ERR_INTERNAL;
  } catch (const std::exception& e) {
    set_error(out, e.what(), WRS_CLASS_RUNTIME);
    return WRS_ERR_INTERNAL;
  } catch (...) {
    set_error(out, "unknown C++ exception", WRS_CLASS_RUNTIME);
    return WRS_ERR_INTERNAL;
  }
}

int32_t wrs_all_op_names(wrs_str* names) {
  try {
    std::vector<std::string> all;
    for (const auto& op : torch::jit::getAllOperators()) {
      all.push_back(op->schema().name());
    }
    std::sort(all.begin(), all.end());
    all.erase(std::unique(all.begin(), all.end()), all.end());
    Tls& t = tls();
    t.text.clear();
    for (const auto& name : all) {
      t.text += name;
      t.text += '\n';
    }
    names->ptr = t.text.data();
    names->len = t.text.size();
    return WRS_OK;
  } catch (...) {
    return WRS_ERR_INTERNAL;
  }
}

void wrs_op_free(wrs_op* op) {
  delete op;
}

size_t wrs_op_num_overloads(const wrs_op* op) {
  return op->overloads.size();
}

int32_t wrs_op_schema(const wrs_op* op, size_t index, wrs_str* schema) {
  try {
    if (index >= op->overloads.size()) {
      return WRS_ERR_INTERNAL;
    }
    Tls& t = tls();
    t.text = c10::toString(op->overloads[index].op->schema());
    schema->ptr = t.text.data();
    schema->len = t.text.size();
    return WRS_OK;
  } catch (...) {
    return WRS_ERR_INTERNAL;
  }
}

int32_t wrs_op_call(const wrs_op* op, const wrs_value* nodes, size_t n_nodes, size_t n_args,
                    const wrs_str* kw_names, size_t n_kwargs, int32_t method_varargs,
                    wrs_out* out) {
  try {
    return call_impl(op, nodes, n_nodes, n_args, kw_names, n_kwargs, method_varargs != 0, out);
  } catch (const c10::Error& e) {
    set_error(out, e.what_without_backtrace(), error_class(e));
    return WRS_ERR_INTERNAL;
  } catch (const std::exception& e) {
    set_error(out, e.what(), WRS_CLASS_RUNTIME);
    return WRS_ERR_INTERNAL;
  } catch (...) {
    set_error(out, "unknown C++ exception", WRS_CLASS_RUNTIME);
    return WRS_ERR_INTERNAL;
  }
}

int32_t wrs_op_match(const wrs_op* op, const wrs_value* nodes, size_t n_nodes, size_t n_args,
                     const wrs_str* kw_names, size_t n_kwargs, int32_t method_varargs,
                     size_t* index, wrs_out* out) {
  try {
    Nodes view{nodes, n_nodes};
    Split top = split_top_level(view, n_args, n_kwargs);
    CallArgs call{view, top.args, top.kwargs, kw_names, method_varargs != 0};
    Stack stack;
    const Overload* found = match(op, call, stack, out);
    if (found == nullptr) {
      return WRS_ERR_SCHEMA;
    }
    *index = static_cast<size_t>(found - op->overloads.data());
    return WRS_OK;
  } catch (const std::exception& e) {
    set_error(out, e.what(), WRS_CLASS_RUNTIME);
    return WRS_ERR_INTERNAL;
  } catch (...) {
    set_error(out, "unknown C++ exception", WRS_CLASS_RUNTIME);
    return WRS_ERR_INTERNAL;
  }
}

}  // extern "C"

