// Lets tch 0.26's C API (torch-sys's `libtch/torch_api_generated.cpp`,
// generated from libtorch 2.13's op list) compile against an older
// libtorch's headers, for `cargo xtask gpu-bundle`, which builds the test
// binaries against the libtorch a GPU machine's PyTorch ships.
//
// The bundle build force-includes this file into every C++ file that `cc`
// compiles (`CXXFLAGS=-include ...`). Against libtorch 2.13 and in every
// file that does not see libtorch's headers it declares nothing. Against
// libtorch 2.11 it declares the ops tch 0.26 binds that 2.11 does not have;
// calling one throws, which tch's `PROTECT` turns into a Rust error naming
// the op, so a missing op can never be mistaken for a working one. wasmrpc
// itself calls none of them.
#pragma once

#if defined(__cplusplus) && __has_include(<torch/version.h>)
#include <torch/version.h>

#if TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR == 11
#include <stdexcept>
#include <string>
#include <tuple>

#include <ATen/core/Tensor.h>

namespace torch {
namespace wasmrpc_compat {
[[noreturn]] inline void missing_op(const char* op) {
  throw std::runtime_error(
      std::string("aten::") + op + " is not in libtorch " TORCH_VERSION
      " (tch 0.26 binds it; this build targets an older libtorch)");
}
using TensorPair = std::tuple<at::Tensor, at::Tensor>;
}  // namespace wasmrpc_compat

#define WASMRPC_MISSING_OP(ret, name)                 \
  template <typename... Args>                         \
  ret name(Args&&...) {                               \
    ::torch::wasmrpc_compat::missing_op(#name);       \
  }

// New in libtorch 2.12 and 2.13.
WASMRPC_MISSING_OP(at::Tensor, _flash_attention_forward_no_dropout_inplace)
WASMRPC_MISSING_OP(at::Tensor, _philox_key_fold_in)
WASMRPC_MISSING_OP(at::Tensor, _philox_key_split)
WASMRPC_MISSING_OP(at::Tensor, _philox_normal)
WASMRPC_MISSING_OP(at::Tensor, _philox_normal_)
WASMRPC_MISSING_OP(at::Tensor, _philox_normal_out)
WASMRPC_MISSING_OP(at::Tensor, _philox_uniform)
WASMRPC_MISSING_OP(at::Tensor, _philox_uniform_)
WASMRPC_MISSING_OP(at::Tensor, _philox_uniform_out)
WASMRPC_MISSING_OP(at::Tensor, _upsample_lanczos2d_aa)
WASMRPC_MISSING_OP(at::Tensor, _upsample_lanczos2d_aa_backward)
WASMRPC_MISSING_OP(at::Tensor, _upsample_lanczos2d_aa_backward_out)
WASMRPC_MISSING_OP(at::Tensor, _upsample_lanczos2d_aa_out)
// 2.13 added a parameter (`enable_gqa`); this overload takes the 2.13 call.
// Declaring it in `torch` hides the 2.11 function from `torch::` lookups,
// which only this MPS-only op's binding makes.
WASMRPC_MISSING_OP(wasmrpc_compat::TensorPair, _scaled_dot_product_attention_math_for_mps)

#undef WASMRPC_MISSING_OP
}  // namespace torch

#endif
#endif
