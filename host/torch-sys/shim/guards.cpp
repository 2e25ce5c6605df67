// See guards.h. Each guard names the op, the overload's parameters it
// reads, and why libtorch 2.13 crashes without it.

#include "guards.h"

#include "ops.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace wasmrpc_guards {
namespace {

constexpr int64_t kMin = std::numeric_limits<int64_t>::min();

// The index of the parameter named `name`, if the schema has one.
std::optional<size_t> param(const c10::FunctionSchema& schema, const char* name) {
  const auto& args = schema.arguments();
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i].name() == name) {
      return i;
    }
  }
  return std::nullopt;
}

// TorchScript's int overloads compute `a % b` on int64 (`remainder.int`,
// `remainder.Scalar` on two ints: `(b + a % b) % b`; `gcd.int`: Euclid's
// loop): x86 raises SIGFPE for a divisor of 0 and for INT64_MIN % -1.
std::optional<std::string> int_modulo(const c10::FunctionSchema& schema,
                                      const torch::jit::Stack& stack) {
  if (stack.size() < 2 || !stack[0].isInt() || !stack[1].isInt()) {
    return std::nullopt;
  }
  int64_t a = stack[0].toInt();
  int64_t b = stack[1].toInt();
  const auto& name = schema.name();
  if (name == "aten::remainder") {
    if (b == 0) {
      return c10::str("ZeroDivisionError: integer modulo by zero: remainder(", a, ", 0)");
    }
    if (b == -1 && a == kMin) {
      return c10::str("remainder(", a, ", -1) overflows int64");
    }
  }
  if (name == "aten::gcd" && ((a == kMin && b == -1) || (a == -1 && b == kMin))) {
    return c10::str("gcd(", a, ", ", b, ") overflows int64");
  }
  return std::nullopt;
}

// Whether an int32 or int64 `t` holds its type's smallest value: the one
// number whose negation, and whose division by -1, overflows.
bool holds_smallest(const at::Tensor& t) {
  if (!t.defined() || t.is_sparse()) {
    return false;
  }
  if (t.scalar_type() == at::kInt) {
    return t.eq(std::numeric_limits<int32_t>::min()).any().item<bool>();
  }
  if (t.scalar_type() == at::kLong) {
    return t.eq(kMin).any().item<bool>();
  }
  return false;
}

// `aten::lcm` on int32 or int64 tensors computes `a / gcd(a, b) * b` with
// a gcd that can come out -1 for the smallest value: SIGFPE.
std::optional<std::string> lcm(const c10::FunctionSchema& schema,
                               const torch::jit::Stack& stack) {
  if (schema.name() != "aten::lcm" && schema.name() != "aten::lcm_") {
    return std::nullopt;
  }
  for (size_t i = 0; i < std::min<size_t>(stack.size(), 2); ++i) {
    if (stack[i].isTensor() && holds_smallest(stack[i].toTensor())) {
      return c10::str(schema.name(), "(): the smallest ",
                      c10::toString(stack[i].toTensor().scalar_type()),
                      " has no absolute value in its type");
    }
  }
  return std::nullopt;
}

// `aten::range` into an integer dtype checks its step as a double and then
// divides by it as the integer type: a step of 0.5 becomes 0, SIGFPE.
// `aten::arange` raises ValueError "step must be nonzero" for the same
// step; so does this.
std::optional<std::string> range(const c10::FunctionSchema& schema,
                                 const torch::jit::Stack& stack) {
  if (schema.name() != "aten::range") {
    return std::nullopt;
  }
  auto step_at = param(schema, "step");
  if (!step_at || *step_at >= stack.size() || !stack[*step_at].isScalar()) {
    return std::nullopt;
  }
  std::optional<at::ScalarType> dtype;
  if (auto out = param(schema, "out"); out && *out < stack.size() && stack[*out].isTensor()) {
    dtype = stack[*out].toTensor().scalar_type();
  } else if (auto d = param(schema, "dtype"); d && *d < stack.size() && stack[*d].isInt()) {
    dtype = static_cast<at::ScalarType>(stack[*d].toInt());
  }
  if (!dtype || !at::isIntegralType(*dtype, /*includeBool=*/true)) {
    return std::nullopt;
  }
  auto step = stack[*step_at].toScalar();
  double as_double = step.toDouble();
  if (std::isfinite(as_double) && static_cast<int64_t>(as_double) == 0) {
    return c10::str("step must be nonzero (", as_double, " is 0 as ", c10::toString(*dtype),
                    ")");
  }
  return std::nullopt;
}

// `aten::div` and `aten::divide` with `rounding_mode='trunc'` on int32 or
// int64 divide in C++: the type's smallest value divided by -1 raises
// SIGFPE (floor rounding and the other integer ops check for it).
std::optional<std::string> trunc_division(const c10::FunctionSchema& schema,
                                          const torch::jit::Stack& stack) {
  const auto& name = schema.name();
  if (name != "aten::div" && name != "aten::div_" && name != "aten::divide" &&
      name != "aten::divide_") {
    return std::nullopt;
  }
  auto mode = param(schema, "rounding_mode");
  auto other_at = param(schema, "other");
  if (!mode || !other_at || *mode >= stack.size() || *other_at >= stack.size() ||
      stack.empty()) {
    return std::nullopt;
  }
  const auto& rounding = stack[*mode];
  if (!rounding.isString() || rounding.toStringRef() != "trunc" || !stack[0].isTensor()) {
    return std::nullopt;
  }
  const at::Tensor& self = stack[0].toTensor();
  const auto& other = stack[*other_at];
  if (!self.defined() || self.is_sparse()) {
    return std::nullopt;
  }
  at::ScalarType common;
  bool divisor_minus_one = false;
  if (other.isTensor()) {
    const at::Tensor& divisor = other.toTensor();
    if (!divisor.defined() || divisor.is_sparse()) {
      return std::nullopt;
    }
    common = at::result_type(self, divisor);
    if (common == at::kInt || common == at::kLong) {
      divisor_minus_one = divisor.eq(-1).any().item<bool>();
    }
  } else if (other.isScalar()) {
    auto scalar = other.toScalar();
    common = at::result_type(self, scalar);
    divisor_minus_one = scalar.isIntegral(false) && scalar.toLong() == -1;
  } else {
    return std::nullopt;
  }
  if ((common != at::kInt && common != at::kLong) || !divisor_minus_one) {
    return std::nullopt;
  }
  int64_t smallest = common == at::kInt ? std::numeric_limits<int32_t>::min() : kMin;
  if (self.eq(smallest).any().item<bool>()) {
    return c10::str(name, "(): the smallest ", c10::toString(common),
                    " divided by -1 with rounding_mode='trunc' overflows");
  }
  return std::nullopt;
}

// `aten::max_pool1d` loops over the whole pooling window for every output
// element and checks too little of it: a window of 2^40 on a 3-long input
// does not return, and INT64_MAX is a SIGSEGV. PyTorch's own rule is that
// the window fits in the padded input (else "Invalid computed output
// size"); here it is checked first, with the padding no longer than the
// input, so a kernel's work is bounded by its input.
std::optional<std::string> max_pool1d(const c10::FunctionSchema& schema,
                                      const torch::jit::Stack& stack) {
  if (schema.name() != "aten::max_pool1d" && schema.name() != "aten::max_pool1d_with_indices") {
    return std::nullopt;
  }
  if (stack.size() < 5 || !stack[0].isTensor()) {
    return std::nullopt;
  }
  const at::Tensor& self = stack[0].toTensor();
  if (!self.defined() || self.dim() < 1) {
    return std::nullopt;
  }
  auto first = [&](size_t i, int64_t fallback) -> int64_t {
    if (!stack[i].isIntList()) {
      return fallback;
    }
    auto list = stack[i].toIntList();
    return list.empty() ? fallback : list.get(0);
  };
  int64_t length = self.size(-1);
  int64_t kernel = first(1, 1);
  int64_t padding = first(3, 0);
  int64_t dilation = first(4, 1);
  if (kernel <= 0 || dilation <= 0 || padding < 0) {
    // libtorch checks these itself.
    return std::nullopt;
  }
  if (padding > length) {
    return c10::str("max_pool1d(): padding ", padding, " is longer than the input (", length,
                    ")");
  }
  __int128 window = static_cast<__int128>(dilation) * (kernel - 1) + 1;
  __int128 padded = static_cast<__int128>(length) + 2 * static_cast<__int128>(padding);
  if (window > padded) {
    return c10::str("max_pool1d(): the pooling window (kernel_size ", kernel, ", dilation ",
                    dilation, ") is longer than the padded input (", static_cast<int64_t>(padded),
                    ")");
  }
  return std::nullopt;
}

// Outputs a caller may ask for beyond what its tensor holds: each is a
// tensor object (no storage), which the tensor memory budget does not see.
constexpr int64_t kMaxExtraOutputs = 65536;

// `aten::combinations` builds a vector of `r` copies of its input before
// anything is allocated for the result: r = 2^31 is 16 GiB of handles
// outside the tensor memory budget and minutes of work, for a result that
// is empty whenever r exceeds the input without replacement.
std::optional<std::string> combinations(const c10::FunctionSchema& schema,
                                        const torch::jit::Stack& stack) {
  if (schema.name() != "aten::combinations" || stack.size() < 2 || !stack[0].isTensor() ||
      !stack[1].isInt()) {
    return std::nullopt;
  }
  int64_t r = stack[1].toInt();
  int64_t n = stack[0].toTensor().defined() ? stack[0].toTensor().numel() : 0;
  if (r > std::max(n, int64_t{64})) {
    return c10::str("combinations(): r (", r, ") is larger than the input (", n,
                    " elements) and than 64");
  }
  return std::nullopt;
}

// `aten::tensor_split` with a number of sections makes that many tensors,
// empty ones past the dimension's length: 2^31 of them never return.
std::optional<std::string> tensor_split(const c10::FunctionSchema& schema,
                                        const torch::jit::Stack& stack) {
  if (schema.name() != "aten::tensor_split" || stack.size() < 3 || !stack[0].isTensor() ||
      !stack[1].isInt() || !stack[2].isInt()) {
    return std::nullopt;
  }
  const at::Tensor& self = stack[0].toTensor();
  int64_t sections = stack[1].toInt();
  int64_t dim = stack[2].toInt();
  if (!self.defined() || self.dim() == 0 || dim < -self.dim() || dim >= self.dim()) {
    // libtorch reports these itself.
    return std::nullopt;
  }
  int64_t length = self.size(dim < 0 ? dim + self.dim() : dim);
  if (sections > std::max(length, kMaxExtraOutputs)) {
    return c10::str("tensor_split(): ", sections, " sections of a dimension of length ", length,
                    ": at most ", kMaxExtraOutputs,
                    " sections, or as many as the dimension is long");
  }
  return std::nullopt;
}

}  // namespace

std::optional<Refusal> unsafe_arguments(const c10::FunctionSchema& schema,
                                        const torch::jit::Stack& stack) {
  if (auto why = range(schema, stack)) {
    return Refusal{std::move(*why), WRS_CLASS_VALUE};
  }
  for (auto guard : {int_modulo, trunc_division, lcm, max_pool1d, combinations, tensor_split}) {
    if (auto why = guard(schema, stack)) {
      return Refusal{std::move(*why), WRS_CLASS_RUNTIME};
    }
  }
  return std::nullopt;
}

}  // namespace wasmrpc_guards
