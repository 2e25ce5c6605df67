// The arguments of a builtin op call, as the host sends them: a read-only
// view of the value tree (`Nodes`), and their conversion to libtorch's
// IValues the way PyTorch converts Python arguments (`toIValue`,
// `toTypeInferredIValue` in `torch/csrc/jit/python/pybind_utils.h`), with
// the Python reprs and type names its error texts quote.
//
// Internal to the shim: `ops.cpp` and `op_match.cpp` use it.

#pragma once

#include <ATen/core/function_schema.h>
#include <ATen/core/ivalue.h>
#include <ATen/core/jit_type.h>
#include <c10/util/SmallVector.h>

#include <cstdint>
#include <optional>
#include <string>

#include "common.h"
#include "ops.h"

namespace wasmrpc_shim::ops {

using c10::IValue;
using c10::TypeKind;
using c10::TypePtr;
using wasmrpc_shim::BadInput;

// A read-only view of the input node array.
struct Nodes {
  const wrs_value* v;
  size_t n;

  const wrs_value& at(size_t i) const {
    if (i >= n) {
      throw BadInput("malformed value tree: node index out of range");
    }
    return v[i];
  }

  static size_t children(const wrs_value& node) {
    return (node.tag == WRS_LIST || node.tag == WRS_TUPLE) ? node.len : 0;
  }

  // Index just past the subtree rooted at `i`.
  size_t skip(size_t i) const {
    size_t pending = 1;
    while (pending > 0) {
      pending += children(at(i));
      pending -= 1;
      i += 1;
    }
    return i;
  }

  // Indices of the direct children of the list or tuple at `i`.
  c10::SmallVector<size_t, 8> child_indices(size_t i) const {
    c10::SmallVector<size_t, 8> out;
    const auto& node = at(i);
    size_t j = i + 1;
    for (uint32_t k = 0; k < node.len; ++k) {
      out.push_back(j);
      j = skip(j);
    }
    return out;
  }
};

// The Python type name of a value, as `formatTypeMismatchMsg` quotes it.
const char* friendly_type_name(const wrs_value& node);

// The Python repr of the value at `i`.
std::string repr(const Nodes& nodes, size_t i);

// The enums libtorch's schemas declare as `int`.
enum class EnumArg { ScalarType, Layout, MemoryFormat };

// Why `code` is no value of enum `kind` (empty if it is one).
std::string enum_code_problem(EnumArg kind, int64_t code);

// The enum an `int` parameter stands for, by its name (`dtype`, ...).
std::optional<EnumArg> enum_of_int_param(const c10::Argument& param);

// Converts the value at `i` to an IValue of `type` (`toIValue`); on
// failure returns false and, if `why` is set, stores the cast error.
bool to_ivalue(const Nodes& nodes, size_t i, const TypePtr& type,
               std::optional<int32_t> N, IValue& out, std::string* why);

// The IValue a value denotes without a schema type (`toTypeInferredIValue`).
bool infer(const Nodes& nodes, size_t i, IValue& out, std::string* why);

}  // namespace wasmrpc_shim::ops
