// Schema matching for builtin ops (see `op_match.h`).

#include "op_match.h"

#include <c10/util/Exception.h>

#include <string>
#include <vector>

namespace wasmrpc_shim::ops {

using wasmrpc_shim::set_error;

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

}  // namespace wasmrpc_shim::ops
