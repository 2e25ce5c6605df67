// Argument conversion for builtin ops (see `op_args.h`).

#include "op_args.h"

#include <c10/util/Exception.h>

#include <charconv>
#include <sstream>
#include <string>
#include <vector>

namespace wasmrpc_shim::ops {

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

}  // namespace wasmrpc_shim::ops
