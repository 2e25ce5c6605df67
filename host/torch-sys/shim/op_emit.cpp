// The outputs of a builtin op call as a value tree (see `op_match.h`).

#include "op_match.h"

#include <c10/util/Exception.h>

#include <stdexcept>
#include <string>
#include <vector>

namespace wasmrpc_shim::ops {

using wasmrpc_shim::Tls;
using wasmrpc_shim::tls;

namespace {

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
}  // namespace

void emit_outputs(const Stack& stack, wrs_out* out) {
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
}

}  // namespace wasmrpc_shim::ops
