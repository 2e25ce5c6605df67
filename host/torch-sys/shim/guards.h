// Preconditions that libtorch's kernels do not check and whose violation
// kills the process (SIGSEGV, SIGFPE) or never returns: checked on the
// matched overload's stack before it runs, so a caller gets an error
// instead. Enum codes are checked earlier, where values are converted
// (ops.cpp). Every guard here is a crash the op fuzzer
// (host/tests/op_fuzz.rs) found or one of its kind, with a regression test
// in host/torch-sys/tests/ops.rs.

#pragma once

#include <ATen/core/function_schema.h>
#include <ATen/core/stack.h>

#include <cstdint>
#include <optional>
#include <string>

namespace wasmrpc_guards {

// Why an op's arguments are refused: the error's text and its Python
// class (a `wrs_error_class`).
struct Refusal {
  std::string message;
  int32_t error_class;
};

// Why running `schema` on `stack` would crash or hang the process, or
// nullopt if the guards see no harm.
std::optional<Refusal> unsafe_arguments(const c10::FunctionSchema& schema,
                                        const torch::jit::Stack& stack);

}  // namespace wasmrpc_guards
