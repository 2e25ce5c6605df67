// What the shim's .cpp files share: the per-thread storage for what they
// hand back to Rust, how they report an error into a `wrs_out`, and how a
// libtorch exception maps to a Python error class.

#pragma once

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
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

// Writes the first line of `text` (libtorch appends a C++ backtrace after
// it) into `buf`, NUL-terminated and cut to `cap` bytes: how the shim's
// C-string entry points hand a message to Rust.
inline void copy_first_line(const std::string& text, char* buf, size_t cap) {
  if (buf == nullptr || cap == 0) {
    return;
  }
  auto end = text.find('\n');
  size_t n = std::min(end == std::string::npos ? text.size() : end, cap - 1);
  std::memcpy(buf, text.data(), n);
  buf[n] = '\0';
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
