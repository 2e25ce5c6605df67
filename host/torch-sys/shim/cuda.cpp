// libtorch's CUDA side as src/cuda.rs loads it: where libtorch_cpu.so lives
// (libtorch_cuda.so is its neighbour), and whether the CUDA hooks are
// registered and in effect. Nothing here links a CUDA library.
//
// Every entry point catches every exception: nothing propagates into Rust.

#include "common.h"

#include <ATen/detail/CUDAHooksInterface.h>

#include <dlfcn.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <string>

using wasmrpc_shim::copy_first_line;

extern "C" {

int32_t wrs_libtorch_cpu_path(char* buf, size_t cap) {
  try {
    // A function libtorch_cpu.so defines: the object dladdr names is the
    // library the process loaded, wherever the loader found it.
    Dl_info info{};
    auto* fn = reinterpret_cast<void*>(&at::detail::getCUDAHooks);
    if (dladdr(fn, &info) == 0 || info.dli_fname == nullptr) {
      copy_first_line("dladdr found no library for at::detail::getCUDAHooks", buf, cap);
      return 0;
    }
    copy_first_line(info.dli_fname, buf, cap);
    return 1;
  } catch (const std::exception& e) {
    copy_first_line(e.what(), buf, cap);
    return 0;
  } catch (...) {
    copy_first_line("unknown C++ exception", buf, cap);
    return 0;
  }
}

int32_t wrs_cuda_hooks_registered(void) {
  try {
    return at::CUDAHooksRegistry()->Has("CUDAHooks") ? 1 : 0;
  } catch (...) {
    return 0;
  }
}

int32_t wrs_cuda_hooks_in_effect(char* buf, size_t cap) {
  try {
    // The placeholder hooks throw "Cannot query CUDART version without
    // ATen_cuda library"; CUDA's answer with the version they were built
    // with, without touching a device or the driver.
    long version = at::detail::getCUDAHooks().versionCUDART();
    copy_first_line(std::to_string(version), buf, cap);
    return 1;
  } catch (const std::exception& e) {
    copy_first_line(e.what(), buf, cap);
    return 0;
  } catch (...) {
    copy_first_line("unknown C++ exception", buf, cap);
    return 0;
  }
}

}  // extern "C"
