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

#include <optional>
#include <string>

namespace wasmrpc_guards {

// Why running `schema` on `stack` would crash or hang the process, as the
// error's text (a RuntimeError), or nullopt if the guards see no harm.
std::optional<std::string> unsafe_arguments(const c10::FunctionSchema& schema,
                                            const torch::jit::Stack& stack);

}  // namespace wasmrpc_guards
