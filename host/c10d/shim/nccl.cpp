// `c10d::ProcessGroupNCCL`'s construction, alone in a shared library of
// its own (libwasmrpc_c10d_nccl.so, see build.rs), so that only a process
// that asks for an NCCL group maps libtorch_cuda.so, CUDA's runtime and
// NCCL. The engine opens it (src/engine/nccl.rs) after
// wasmrpc_torch_sys::cuda::load has loaded libtorch's CUDA side, and hands
// it the group's store; what it returns is driven through the virtual
// `c10d::Backend` interface by the main shim (c10d_shim.cpp), which needs
// no NCCL symbol.
//
// The entry point catches every exception: nothing propagates out.

#include "c10d_shim.h"

#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <exception>
#include <string>

namespace {

void copy_text(const std::string& text, char* buf, size_t cap) {
  if (buf == nullptr || cap == 0) {
    return;
  }
  size_t n = std::min(text.size(), cap - 1);
  std::memcpy(buf, text.data(), n);
  buf[n] = '\0';
}

}  // namespace

extern "C" __attribute__((visibility("default"))) int32_t wrc_nccl_construct(
    const void* store, int32_t rank, int32_t size, int64_t timeout_ms,
    void* backend, char* err, size_t cap) {
  try {
    const auto& s = *static_cast<const c10::intrusive_ptr<c10d::Store>*>(store);
    auto options = c10d::ProcessGroupNCCL::Options::create();
    options->timeout = std::chrono::milliseconds(timeout_ms);
    *static_cast<c10::intrusive_ptr<c10d::Backend>*>(backend) =
        c10::make_intrusive<c10d::ProcessGroupNCCL>(s, rank, size, options);
    return 1;
  } catch (const c10::Error& e) {
    copy_text(e.what_without_backtrace(), err, cap);
  } catch (const std::exception& e) {
    copy_text(e.what(), err, cap);
  } catch (...) {
    copy_text("unknown C++ exception", err, cap);
  }
  return 0;
}
