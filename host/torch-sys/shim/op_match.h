// Matching a call to the overloads of a builtin op, the way PyTorch RPC
// matches Python arguments (`createStackForSchema`, `getOpWithStack`), and
// the outputs of a call as a value tree.
//
// Internal to the shim: `ops.cpp` uses it.

#pragma once

#include <ATen/core/stack.h>
#include <c10/util/SmallVector.h>
#include <torch/csrc/jit/runtime/operator.h>

#include <memory>
#include <string_view>

#include "op_args.h"

namespace wasmrpc_shim::ops {

using torch::jit::Stack;

struct Overload {
  std::shared_ptr<torch::jit::Operator> op;
  // Calling an Operation is not const, but it only invokes the wrapped
  // function, which libtorch runs from many threads at once.
  mutable torch::jit::Operation operation;
};

}  // namespace wasmrpc_shim::ops

// The op handle the C API hands out: a name and its callable overloads.
struct wrs_op {
  std::string name;
  std::vector<wasmrpc_shim::ops::Overload> overloads;
};

namespace wasmrpc_shim::ops {

struct CallArgs {
  const Nodes& nodes;
  const c10::SmallVector<size_t, 8>& args;    // node index of each positional
  const c10::SmallVector<size_t, 8>& kwargs;  // node index of each keyword value
  const wrs_str* kw_names;
  bool method_varargs;
};

struct Split {
  c10::SmallVector<size_t, 8> args;
  c10::SmallVector<size_t, 8> kwargs;
};

// Node indices of the top-level positional and keyword values.
Split split_top_level(const Nodes& nodes, size_t n_args, size_t n_kwargs);

// Finds the overload that accepts the call and fills its stack; on failure
// sets PyTorch's "failed to match any schema" error and returns nullptr.
const Overload* match(const wrs_op* op, const CallArgs& call, Stack& stack, wrs_out* out);

// Writes the call's outputs (`stack`) into `out` as a value tree: tensors
// as owned handles, strings in the thread's arena.
void emit_outputs(const Stack& stack, wrs_out* out);

}  // namespace wasmrpc_shim::ops
