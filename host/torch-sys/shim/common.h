// What the shim's .cpp files share: the per-thread storage for what they
// hand back to Rust, how they report an error into a `wrs_out`, and how a
// libtorch exception maps to a Python error class.

#pragma once

#include <c10/util/Exception.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "ops.h"

namespace wasmrpc_shim {

// Per-thread storage for what the shim hands back to Rust: valid until the
// next call on the same thread.
struct Tls {
  std::vector<wrs_value> nodes;
  std::string arena;  // bytes of output strings
  std::string err;
  std::string text;
};

inline Tls& tls() {
  thread_local Tls t;
  return t;
}

inline void set_error(wrs_out* out, std::string msg, int32_t cls) {
  Tls& t = tls();
  t.err = std::move(msg);
  if (out != nullptr) {
    out->nodes = nullptr;
    out->n_nodes = 0;
    out->n_outputs = 0;
    out->err = t.err.data();
    out->err_len = t.err.size();
    out->err_class = cls;
  }
}

// A malformed input from Rust (not a libtorch error).
struct BadInput : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The Python error class of a libtorch exception.
inline int32_t error_class(const c10::Error& e) {
  if (dynamic_cast<const c10::IndexError*>(&e) != nullptr) {
    return WRS_CLASS_INDEX;
  }
  if (dynamic_cast<const c10::ValueError*>(&e) != nullptr) {
    return WRS_CLASS_VALUE;
  }
  if (dynamic_cast<const c10::TypeError*>(&e) != nullptr) {
    return WRS_CLASS_TYPE;
  }
  if (dynamic_cast<const c10::NotImplementedError*>(&e) != nullptr) {
    return WRS_CLASS_NOT_IMPLEMENTED;
  }
  return WRS_CLASS_RUNTIME;
}

}  // namespace wasmrpc_shim
