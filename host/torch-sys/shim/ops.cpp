// Builtin ops by schema name through libtorch's JIT operator registry: name
// resolution, schema matching the way PyTorch RPC matches Python arguments
// (`torch/csrc/jit/python/pybind_utils.h`: `createStackForSchema`,
// `toIValue`, `getOpWithStack`), the call, and the conversion of outputs.
//
// Every entry point catches every exception: nothing propagates into Rust.

#include "ops.h"

#include <ATen/core/function_schema.h>
#include <ATen/core/ivalue.h>
#include <ATen/core/jit_type.h>
#include <c10/util/Exception.h>
#include <c10/util/SmallVector.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/jit/runtime/operator.h>

#include <ATen/record_function.h>
#include <c10/core/Allocator.h>
#include <c10/util/ThreadLocalDebugInfo.h>

#include "budget.h"
#include "common.h"
#include "guards.h"

#include <algorithm>
#include <chrono>
#include <charconv>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

namespace {

using c10::IValue;
using c10::TypeKind;
using c10::TypePtr;
using torch::jit::Stack;
using wasmrpc_shim::BadInput;
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

struct Overload {
  std::shared_ptr<torch::jit::Operator> op;
  // Calling an Operation is not const, but it only invokes the wrapped
  // function, which libtorch runs from many threads at once.
  mutable torch::jit::Operation operation;
};

}  // namespace


struct wrs_op {
  std::string name;
  std::vector<Overload> overloads;
};


namespace {

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

std::string py_float_repr(double f) {
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof(buf), f);
  std::string s(buf, res.ptr);
  if (s.find_first_of(".eni") == std::string::npos) {
    s += ".0";
  }
  return s;
}

std::string device_repr(int64_t type, uint32_t index_plus_one) {
  std::string name = c10::DeviceTypeName(static_cast<c10::DeviceType>(type), true);
  if (index_plus_one == 0) {
    return "device(type='" + name + "')";
  }
  return "device(type='" + name + "', index=" + std::to_string(index_plus_one - 1) + ")";
}

// Python's name for the type of a value, as `friendlyTypeName` prints it.
const char* friendly_type_name(const wrs_value& node) {
  switch (node.tag) {
    case WRS_NONE:
      return "NoneType";
    case WRS_BOOL:
      return "bool";
    case WRS_INT:
      return "int";
    case WRS_FLOAT:
      return "float";
    case WRS_STR:
      return "str";
    case WRS_TENSOR:
      return "Tensor";
    case WRS_LIST:
      return "list";
    case WRS_TUPLE:
      return "tuple";
    case WRS_DTYPE:
      return "dtype";
    case WRS_DEVICE:
      return "device";
    default:
      return "unknown";
  }
}

// A short Python-like repr of a value, for error texts.
std::string repr(const Nodes& nodes, size_t i) {
  const auto& node = nodes.at(i);
  switch (node.tag) {
    case WRS_NONE:
      return "None";
    case WRS_BOOL:
      return node.i != 0 ? "True" : "False";
    case WRS_INT:
      return std::to_string(node.i);
    case WRS_FLOAT:
      return py_float_repr(node.f);
    case WRS_STR:
      return "'" + std::string(static_cast<const char*>(node.p), node.len) + "'";
    case WRS_TENSOR: {
      const auto* t = static_cast<const at::Tensor*>(node.p);
      if (t == nullptr || !t->defined()) {
        return "tensor(undefined)";
      }
      std::ostringstream ss;
      ss << "tensor(size=" << t->sizes() << ", dtype=" << t->scalar_type();
      if (t->is_sparse()) {
        ss << ", layout=sparse_coo";
      }
      ss << ")";
      return ss.str();
    }
    case WRS_LIST:
    case WRS_TUPLE: {
      bool list = node.tag == WRS_LIST;
      std::string s = list ? "[" : "(";
      auto kids = nodes.child_indices(i);
      for (size_t k = 0; k < kids.size(); ++k) {
        if (k > 0) {
          s += ", ";
        }
        s += repr(nodes, kids[k]);
      }
      if (!list && kids.size() == 1) {
        s += ",";
      }
      s += list ? "]" : ")";
      return s;
    }
    case WRS_DTYPE:
      return std::string("torch.") +
          c10::toString(static_cast<c10::ScalarType>(node.i));
    case WRS_DEVICE:
      return device_repr(node.i, node.len);
    default:
      return "<unknown>";
  }
}

bool is_sequence(const wrs_value& node) {
  return node.tag == WRS_LIST || node.tag == WRS_TUPLE;
}

bool is_int_like(const wrs_value& node) {
  return node.tag == WRS_INT || node.tag == WRS_BOOL;
}

bool is_number(const wrs_value& node) {
  return node.tag == WRS_INT || node.tag == WRS_BOOL || node.tag == WRS_FLOAT;
}

double as_double(const wrs_value& node) {
  return node.tag == WRS_FLOAT ? node.f : static_cast<double>(node.i);
}

const at::Tensor& tensor_of(const wrs_value& node) {
  if (node.p == nullptr) {
    throw BadInput("malformed value tree: null tensor pointer");
  }
  return *static_cast<const at::Tensor*>(node.p);
}

c10::Device device_of(const wrs_value& node) {
  auto index = node.len == 0 ? static_cast<c10::DeviceIndex>(-1)
                             : static_cast<c10::DeviceIndex>(node.len - 1);
  return c10::Device(static_cast<c10::DeviceType>(node.i), index);
}

// The libtorch enums a caller names by integer code: on the wire a dtype,
// a layout and a memory format are their codes, as TorchScript passes them.
enum class EnumArg { ScalarType, Layout, MemoryFormat };

// What is wrong with `code` as an `kind`, or "" if libtorch defines it.
// Kernels cast these codes unchecked (`static_cast<ScalarType>(i)`) and
// index tables with them, so a code libtorch does not define reads out of
// bounds: `aten::to(t, -1)` is a SIGSEGV on libtorch 2.13, from Python's
// `torch.ops.aten.to` too. `ScalarType::Undefined` is refused as well: it
// is no dtype a caller can ask for (ops given it fail on internal asserts).
std::string enum_code_problem(EnumArg kind, int64_t code) {
  int64_t limit = 0;
  const char* what = "";
  switch (kind) {
    case EnumArg::ScalarType:
      limit = static_cast<int64_t>(c10::ScalarType::Undefined);
      what = "dtype (torch.dtype)";
      break;
    case EnumArg::Layout:
      limit = static_cast<int64_t>(c10::Layout::NumOptions);
      what = "layout (torch.layout)";
      break;
    case EnumArg::MemoryFormat:
      limit = static_cast<int64_t>(c10::MemoryFormat::NumOptions);
      what = "memory format (torch.memory_format)";
      break;
  }
  if (code >= 0 && code < limit) {
    return {};
  }
  return c10::str(code, " is not the code of a ", what, ": libtorch defines codes 0 to ",
                  limit - 1);
}

// The enum an `int` parameter stands for, by its name: TorchScript's own
// overloads take some enums as plain ints (`aten::to.prim_dtype(Tensor(a)
// self, int? dtype=None, ...)`) and cast them just as unchecked.
std::optional<EnumArg> enum_of_int_param(const c10::Argument& param) {
  auto type = param.real_type();
  if (type->kind() == TypeKind::OptionalType) {
    type = type->expectRef<c10::OptionalType>().getElementType();
  }
  if (type->kind() != TypeKind::IntType) {
    return std::nullopt;
  }
  const auto& name = param.name();
  if (name == "dtype" || name == "out_dtype" || name == "scalar_type") {
    return EnumArg::ScalarType;
  }
  if (name == "layout") {
    return EnumArg::Layout;
  }
  if (name == "memory_format") {
    return EnumArg::MemoryFormat;
  }
  return std::nullopt;
}

bool infer(const Nodes& nodes, size_t i, IValue& out, std::string* why);

// Converts the value at `i` to an IValue of `type`, mirroring pybind_utils'
// `toIValue` for the kinds of values that cross our boundary. On failure
// returns false and, if `why` is set, stores the cast error details.
bool to_ivalue(const Nodes& nodes, size_t i, const TypePtr& type,
               std::optional<int32_t> N, IValue& out, std::string* why) {
  const auto& node = nodes.at(i);
  auto fail = [&](const std::string& what) {
    if (why != nullptr) {
      *why = what;
    }
    return false;
  };
  auto cannot_cast = [&](const char* to) {
    if (why != nullptr) {
      *why = "Unable to cast " + repr(nodes, i) + " to " + to;
    }
    return false;
  };
  switch (type->kind()) {
    case TypeKind::TensorType:
      // An undefined tensor is Python's None: it fits `Tensor?` only, as
      // kernels are not written to receive one.
      if (node.tag != WRS_TENSOR || !tensor_of(node).defined()) {
        return cannot_cast("Tensor");
      }
      out = tensor_of(node);
      return true;
    case TypeKind::FloatType:
    case TypeKind::SymFloatType:
      if (!is_number(node)) {
        return cannot_cast("float");
      }
      out = as_double(node);
      return true;
    case TypeKind::ComplexType:
      if (!is_number(node)) {
        return cannot_cast("complex");
      }
      out = c10::complex<double>(as_double(node), 0.0);
      return true;
    case TypeKind::IntType:
      if (is_int_like(node) || node.tag == WRS_DTYPE) {
        out = node.i;
        return true;
      }
      return cannot_cast("int");
    case TypeKind::SymIntType:
      if (is_int_like(node)) {
        out = node.i;
        return true;
      }
      return cannot_cast("SymInt");
    case TypeKind::ScalarTypeType:
      if (node.tag == WRS_DTYPE || node.tag == WRS_INT) {
        auto problem = enum_code_problem(EnumArg::ScalarType, node.i);
        if (!problem.empty()) {
          return fail("Unable to cast " + repr(nodes, i) + " to ScalarType: " + problem);
        }
        out = node.i;
        return true;
      }
      return cannot_cast("ScalarType");
    case TypeKind::LayoutType:
    case TypeKind::MemoryFormatType:
      if (node.tag == WRS_INT) {
        auto kind = type->kind() == TypeKind::LayoutType ? EnumArg::Layout
                                                         : EnumArg::MemoryFormat;
        auto problem = enum_code_problem(kind, node.i);
        if (!problem.empty()) {
          return fail("Unable to cast " + repr(nodes, i) + " to " + type->str() + ": " +
                      problem);
        }
        out = node.i;
        return true;
      }
      return cannot_cast(type->str().c_str());
    case TypeKind::NoneType:
      if (node.tag != WRS_NONE) {
        return fail("Cannot cast " + repr(nodes, i) + " to None");
      }
      out = IValue();
      return true;
    case TypeKind::BoolType:
    case TypeKind::SymBoolType:
      if (node.tag != WRS_BOOL) {
        return cannot_cast("bool");
      }
      out = node.i != 0;
      return true;
    case TypeKind::StringType:
      if (node.tag != WRS_STR) {
        return cannot_cast("str");
      }
      out = std::string(static_cast<const char*>(node.p), node.len);
      return true;
    case TypeKind::DeviceObjType:
      if (node.tag == WRS_DEVICE) {
        out = device_of(node);
        return true;
      }
      if (node.tag == WRS_STR) {
        try {
          out = c10::Device(std::string(static_cast<const char*>(node.p), node.len));
          return true;
        } catch (const std::exception& e) {
          return fail(e.what());
        }
      }
      return cannot_cast("Device");
    case TypeKind::NumberType:
      if (is_int_like(node) || node.tag == WRS_DTYPE) {
        out = node.i;
        return true;
      }
      if (node.tag == WRS_FLOAT) {
        out = node.f;
        return true;
      }
      return fail("Cannot cast " + repr(nodes, i) + " to " + type->repr_str());
    case TypeKind::OptionalType:
      if (node.tag == WRS_NONE || (node.tag == WRS_TENSOR && !tensor_of(node).defined())) {
        out = IValue();
        return true;
      }
      return to_ivalue(nodes, i, type->expectRef<c10::OptionalType>().getElementType(),
                       N, out, why);
    case TypeKind::TupleType: {
      const auto& elems = type->expectRef<c10::TupleType>().elements();
      if (!is_sequence(node)) {
        return cannot_cast("tuple");
      }
      if (elems.size() != node.len) {
        return fail("Object " + repr(nodes, i) +
                    " had a different number of elements than type " + type->repr_str());
      }
      auto kids = nodes.child_indices(i);
      std::vector<IValue> values;
      values.reserve(kids.size());
      for (size_t k = 0; k < kids.size(); ++k) {
        IValue v;
        if (!to_ivalue(nodes, kids[k], elems[k], std::nullopt, v, why)) {
          return false;
        }
        values.push_back(std::move(v));
      }
      out = c10::ivalue::Tuple::create(std::move(values));
      return true;
    }
    case TypeKind::ListType: {
      const auto& elem_type = type->expectRef<c10::ListType>().getElementType();
      auto ek = elem_type->kind();
      // A single int (or float) broadcasts to a fixed-size list: `int[2]`.
      // SymInt lists hold concrete ints here, which is what IValue's own
      // SymInt-list constructors decay them to.
      if (N && (ek == TypeKind::IntType || ek == TypeKind::SymIntType) && node.tag == WRS_INT) {
        c10::List<int64_t> repeated;
        repeated.reserve(*N);
        for (int32_t k = 0; k < *N; ++k) {
          repeated.push_back(node.i);
        }
        out = std::move(repeated);
        return true;
      }
      if (N && ek == TypeKind::FloatType && node.tag == WRS_FLOAT) {
        c10::List<double> repeated;
        repeated.reserve(*N);
        for (int32_t k = 0; k < *N; ++k) {
          repeated.push_back(node.f);
        }
        out = std::move(repeated);
        return true;
      }
      if (!is_sequence(node)) {
        return cannot_cast(type->repr_str().c_str());
      }
      auto kids = nodes.child_indices(i);
      switch (ek) {
        case TypeKind::IntType:
        case TypeKind::SymIntType: {
          c10::List<int64_t> list;
          list.reserve(kids.size());
          for (auto k : kids) {
            const auto& e = nodes.at(k);
            if (!is_int_like(e)) {
              return fail("Unable to cast " + repr(nodes, k) + " to int");
            }
            list.push_back(e.i);
          }
          out = std::move(list);
          return true;
        }
        case TypeKind::FloatType: {
          c10::List<double> list;
          list.reserve(kids.size());
          for (auto k : kids) {
            const auto& e = nodes.at(k);
            if (!is_number(e)) {
              return fail("Unable to cast " + repr(nodes, k) + " to float");
            }
            list.push_back(as_double(e));
          }
          out = std::move(list);
          return true;
        }
        case TypeKind::BoolType: {
          c10::List<bool> list;
          list.reserve(kids.size());
          for (auto k : kids) {
            const auto& e = nodes.at(k);
            if (e.tag != WRS_BOOL) {
              return fail("Unable to cast " + repr(nodes, k) + " to bool");
            }
            list.push_back(e.i != 0);
          }
          out = std::move(list);
          return true;
        }
        case TypeKind::TensorType: {
          c10::List<at::Tensor> list;
          list.reserve(kids.size());
          for (auto k : kids) {
            const auto& e = nodes.at(k);
            if (e.tag != WRS_TENSOR || !tensor_of(e).defined()) {
              return fail("Unable to cast " + repr(nodes, k) + " to Tensor");
            }
            list.push_back(tensor_of(e));
          }
          out = std::move(list);
          return true;
        }
        default: {
          c10::impl::GenericList list(elem_type);
          list.reserve(kids.size());
          for (auto k : kids) {
            IValue v;
            if (!to_ivalue(nodes, k, elem_type, std::nullopt, v, why)) {
              return false;
            }
            list.push_back(std::move(v));
          }
          out = std::move(list);
          return true;
        }
      }
    }
    case TypeKind::UnionType:
    case TypeKind::AnyType: {
      IValue v;
      if (!infer(nodes, i, v, why)) {
        return false;
      }
      if (type->kind() == TypeKind::UnionType && !v.type()->isSubtypeOf(*type)) {
        return fail("Expected a member of " + type->annotation_str() +
                    " but instead found type " + v.type()->annotation_str());
      }
      out = std::move(v);
      return true;
    }
    default:
      return fail("toIValue() cannot handle converting to type: " + type->repr_str());
  }
}

// The IValue a value denotes without a schema type (`toTypeInferredIValue`).
bool infer(const Nodes& nodes, size_t i, IValue& out, std::string* why) {
  const auto& node = nodes.at(i);
  switch (node.tag) {
    case WRS_NONE:
      out = IValue();
      return true;
    case WRS_BOOL:
      out = node.i != 0;
      return true;
    case WRS_INT:
    case WRS_DTYPE:
      out = node.i;
      return true;
    case WRS_FLOAT:
      out = node.f;
      return true;
    case WRS_STR:
      out = std::string(static_cast<const char*>(node.p), node.len);
      return true;
    case WRS_TENSOR:
      out = tensor_of(node);
      return true;
    case WRS_DEVICE:
      out = device_of(node);
      return true;
    case WRS_TUPLE: {
      std::vector<IValue> values;
      for (auto k : nodes.child_indices(i)) {
        IValue v;
        if (!infer(nodes, k, v, why)) {
          return false;
        }
        values.push_back(std::move(v));
      }
      out = c10::ivalue::Tuple::create(std::move(values));
      return true;
    }
    case WRS_LIST: {
      auto kids = nodes.child_indices(i);
      TypePtr elem_type = c10::TensorType::get();
      if (!kids.empty()) {
        IValue first;
        if (!infer(nodes, kids[0], first, why)) {
          return false;
        }
        elem_type = first.type();
      }
      return to_ivalue(nodes, i, c10::ListType::create(elem_type), std::nullopt, out, why);
    }
    default:
      if (why != nullptr) {
        *why = "unknown value tag";
      }
      return false;
  }
}

struct CallArgs {
  const Nodes& nodes;
  const c10::SmallVector<size_t, 8>& args;    // node index of each positional
  const c10::SmallVector<size_t, 8>& kwargs;  // node index of each keyword value
  const wrs_str* kw_names;
  bool method_varargs;
};

std::string_view kw_name(const CallArgs& call, size_t k) {
  return std::string_view(call.kw_names[k].ptr, call.kw_names[k].len);
}

std::string mismatch(const c10::FunctionSchema& schema, size_t pos, const Nodes& nodes,
                     size_t node, const std::string& details) {
  const auto& argument = schema.arguments().at(pos);
  return c10::str(
      schema.formatTypeMismatchMsg(argument, friendly_type_name(nodes.at(node)), pos,
                                   repr(nodes, node)),
      "\nCast error details: ", details);
}

// Whether `v`, converted for parameter `pos`, is a code libtorch defines
// when the parameter is an `int` standing for an enum (`enum_of_int_param`);
// if not, `why` (if set) receives the mismatch naming the parameter.
bool int_enum_ok(const c10::FunctionSchema& schema, size_t pos, const IValue& v,
                 const Nodes& nodes, size_t node, std::string* why) {
  auto kind = enum_of_int_param(schema.arguments().at(pos));
  if (!kind || !v.isInt()) {
    return true;
  }
  auto problem = enum_code_problem(*kind, v.toInt());
  if (problem.empty()) {
    return true;
  }
  if (why != nullptr) {
    *why = mismatch(schema, pos, nodes, node, "Unable to cast " + repr(nodes, node) + ": " + problem);
  }
  return false;
}

// Builds the stack for `schema` from the call's arguments, as
// `createStackForSchema` does. Returns false if the schema does not accept
// them; `why` (if set) receives PyTorch's text for the mismatch.
bool create_stack(const c10::FunctionSchema& schema, const CallArgs& call, Stack& stack,
                  std::string* why) {
  const auto& params = schema.arguments();
  const Nodes& nodes = call.nodes;
  size_t n_args = call.args.size();
  size_t n_kwargs = call.kwargs.size();

  // Python methods with one `int[]` parameter take it as varargs:
  // `t.view(2, 3)` is `t.view([2, 3])`.
  bool pack = false;
  if (call.method_varargs && n_args >= 2 && nodes.at(call.args[1]).tag == WRS_INT) {
    size_t positional = 0;
    while (positional < params.size() && !params[positional].kwarg_only()) {
      ++positional;
    }
    if (positional == 2) {
      const auto& t = params[1].real_type();
      if (t->kind() == TypeKind::ListType) {
        auto ek = t->expectRef<c10::ListType>().getElementType()->kind();
        pack = ek == TypeKind::IntType || ek == TypeKind::SymIntType;
      }
    }
  }
  size_t effective_args = pack ? 2 : n_args;

  size_t all_arguments = effective_args + n_kwargs;
  if (all_arguments > params.size()) {
    if (why != nullptr) {
      *why = c10::str(schema.name(), "() expected at most ", params.size(),
                      " argument(s) but received ", all_arguments,
                      " argument(s). Declaration: ", schema);
    }
    return false;
  }
  stack.clear();
  stack.reserve(params.size());

  for (size_t pos = 0; pos < effective_args; ++pos) {
    if (params[pos].kwarg_only()) {
      if (why != nullptr) {
        *why = c10::str(schema.name(), "() takes ", pos, " positional argument(s) but ",
                        effective_args, " was/were given.  Declaration: ", schema);
      }
      return false;
    }
    if (pack && pos == 1) {
      c10::List<int64_t> ints;
      for (size_t k = 1; k < n_args; ++k) {
        const auto& e = nodes.at(call.args[k]);
        if (e.tag != WRS_INT) {
          if (why != nullptr) {
            *why = mismatch(schema, 1, nodes, call.args[k],
                            "Unable to cast " + repr(nodes, call.args[k]) + " to int");
          }
          return false;
        }
        ints.push_back(e.i);
      }
      stack.emplace_back(std::move(ints));
      continue;
    }
    IValue v;
    std::string details;
    if (!to_ivalue(nodes, call.args[pos], params[pos].real_type(), params[pos].N(), v,
                   why != nullptr ? &details : nullptr)) {
      if (why != nullptr) {
        *why = mismatch(schema, pos, nodes, call.args[pos], details);
      }
      return false;
    }
    if (!int_enum_ok(schema, pos, v, nodes, call.args[pos], why)) {
      return false;
    }
    stack.push_back(std::move(v));
  }

  size_t consumed_kwargs = 0;
  for (size_t pos = stack.size(); pos < params.size(); ++pos) {
    const auto& param = params[pos];
    size_t found = n_kwargs;
    for (size_t k = 0; k < n_kwargs; ++k) {
      if (kw_name(call, k) == param.name()) {
        found = k;
        break;
      }
    }
    if (found < n_kwargs) {
      IValue v;
      std::string details;
      if (!to_ivalue(nodes, call.kwargs[found], param.real_type(), param.N(), v,
                     why != nullptr ? &details : nullptr)) {
        if (why != nullptr) {
          *why = mismatch(schema, pos, nodes, call.kwargs[found], details);
        }
        return false;
      }
      if (!int_enum_ok(schema, pos, v, nodes, call.kwargs[found], why)) {
        return false;
      }
      stack.push_back(std::move(v));
      consumed_kwargs += 1;
    } else if (param.default_value()) {
      stack.push_back(*param.default_value());
    } else {
      if (why != nullptr) {
        *why = c10::str(schema.name(), "() is missing value for argument '", param.name(),
                        "'. Declaration: ", schema);
      }
      return false;
    }
  }

  if (consumed_kwargs != n_kwargs) {
    if (why != nullptr) {
      std::vector<std::string> names;
      names.reserve(n_kwargs);
      for (size_t k = 0; k < n_kwargs; ++k) {
        names.emplace_back(kw_name(call, k));
      }
      *why = schema.findErrorInKwargs(names);
    }
    return false;
  }
  return true;
}

struct Unsupported : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Appends `v` and its subtree to `nodes`. Tensors become owned
// `at::Tensor*` recorded in `owned`; strings go to the arena, and their
// node holds the arena offset in `i` until the arena stops growing.
void emit(const IValue& v, std::vector<wrs_value>& nodes,
          c10::SmallVectorImpl<at::Tensor*>& owned, std::string& arena) {
  wrs_value node{};
  if (v.isNone()) {
    node.tag = WRS_NONE;
  } else if (v.isTensor()) {
    const auto& t = v.toTensor();
    if (t.defined()) {
      node.tag = WRS_TENSOR;
      auto* p = new at::Tensor(t);
      owned.push_back(p);
      node.p = p;
    } else {
      node.tag = WRS_NONE;
    }
  } else if (v.isBool()) {
    node.tag = WRS_BOOL;
    node.i = v.toBool() ? 1 : 0;
  } else if (v.isInt()) {
    node.tag = WRS_INT;
    node.i = v.toInt();
  } else if (v.isSymInt()) {
    auto concrete = v.toSymInt().maybe_as_int();
    if (!concrete) {
      throw Unsupported("unsupported output: symbolic int");
    }
    node.tag = WRS_INT;
    node.i = *concrete;
  } else if (v.isDouble()) {
    node.tag = WRS_FLOAT;
    node.f = v.toDouble();
  } else if (v.isString()) {
    const auto& s = v.toStringRef();
    node.tag = WRS_STR;
    node.len = static_cast<uint32_t>(s.size());
    node.i = static_cast<int64_t>(arena.size());
    arena.append(s);
  } else if (v.isDevice()) {
    auto d = v.toDevice();
    node.tag = WRS_DEVICE;
    node.i = static_cast<int64_t>(d.type());
    node.len = d.has_index() ? static_cast<uint32_t>(d.index()) + 1 : 0;
  } else if (v.isList()) {
    auto elems = v.toListRef();
    node.tag = WRS_LIST;
    node.len = static_cast<uint32_t>(elems.size());
    nodes.push_back(node);
    for (const auto& e : elems) {
      emit(e, nodes, owned, arena);
    }
    return;
  } else if (v.isTuple()) {
    const auto& elems = v.toTupleRef().elements();
    node.tag = WRS_TUPLE;
    node.len = static_cast<uint32_t>(elems.size());
    nodes.push_back(node);
    for (const auto& e : elems) {
      emit(e, nodes, owned, arena);
    }
    return;
  } else {
    throw Unsupported(c10::str("unsupported output of type ", v.tagKind()));
  }
  nodes.push_back(node);
}

// Finds the overload that accepts the call and fills its stack; on failure
// sets PyTorch's "failed to match any schema" error and returns nullptr.
const Overload* match(const wrs_op* op, const CallArgs& call, Stack& stack, wrs_out* out) {
  // First pass without error texts: formatting a schema costs more than
  // matching one, and the hot path usually matches.
  for (const auto& overload : op->overloads) {
    if (create_stack(overload.op->schema(), call, stack, nullptr)) {
      return &overload;
    }
  }
  std::string msg =
      "Overloaded torch operator invoked from Python failed to match any schema:\n";
  for (const auto& overload : op->overloads) {
    std::string why;
    Stack scratch;
    if (!create_stack(overload.op->schema(), call, scratch, &why)) {
      msg += why;
      msg += "\n\n";
    }
  }
  set_error(out, std::move(msg), WRS_CLASS_RUNTIME);
  return nullptr;
}

struct Split {
  c10::SmallVector<size_t, 8> args;
  c10::SmallVector<size_t, 8> kwargs;
};

// Node indices of the top-level positional and keyword values.
Split split_top_level(const Nodes& nodes, size_t n_args, size_t n_kwargs) {
  Split s;
  size_t i = 0;
  for (size_t k = 0; k < n_args; ++k) {
    s.args.push_back(i);
    i = nodes.skip(i);
  }
  for (size_t k = 0; k < n_kwargs; ++k) {
    s.kwargs.push_back(i);
    i = nodes.skip(i);
  }
  if (i != nodes.n) {
    throw BadInput("malformed value tree: node count does not match the arguments");
  }
  return s;
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

  Tls& t = tls();
  t.nodes.clear();
  t.arena.clear();
  c10::SmallVector<at::Tensor*, 4> owned;
  try {
    for (const auto& v : stack) {
      emit(v, t.nodes, owned, t.arena);
    }
  } catch (...) {
    for (auto* p : owned) {
      delete p;
    }
    throw;
  }
  for (auto& node : t.nodes) {
    if (node.tag == WRS_STR) {
      node.p = t.arena.data() + node.i;
      node.i = 0;
    }
  }
  out->nodes = t.nodes.data();
  out->n_nodes = t.nodes.size();
  out->n_outputs = stack.size();
  out->err = nullptr;
  out->err_len = 0;
  out->err_class = 0;
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
