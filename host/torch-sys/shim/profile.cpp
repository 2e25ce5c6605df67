// Op profiling (see ops.h): a window per thread in which libtorch's
// RecordFunction callbacks record every op that runs, with its shapes and
// the CPU memory it allocates when asked.
//
// Every entry point catches every exception: nothing propagates into Rust.

#include "ops.h"

#include "budget.h"

#include <ATen/record_function.h>
#include <c10/core/Allocator.h>
#include <c10/util/ThreadLocalDebugInfo.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace {

struct ProfiledOp {
  std::string name;
  int64_t start_ns;
  int64_t end_ns;
  // With WRS_PROFILE_SHAPES: each input's rank, and the dims of all.
  std::vector<int64_t> ranks;
  std::vector<int64_t> dims;
  int64_t cpu_memory_bytes = 0;
};

// Receives libtorch's memory reports (`c10::reportMemoryUsageToProfiler`,
// which the CPU allocator calls for every block it hands out or takes
// back) while a window with WRS_PROFILE_MEMORY is open on this thread: it
// sits in the thread's PROFILER_STATE debug info slot, where PyTorch's
// profiler puts its own.
struct MemoryReporter final : c10::MemoryReportingInfoBase {
  void reportMemoryUsage(void* ptr, int64_t alloc_size, size_t total_allocated,
                         size_t total_reserved, c10::Device device) override;
  bool memoryProfilingEnabled() const override { return true; }
};

struct ProfileWindow {
  std::chrono::steady_clock::time_point epoch;
  std::vector<ProfiledOp> ops;
  // The ops that started and have not ended, outermost first: a memory
  // report counts for all of them, as PyTorch's profiler adds an
  // allocation to every op range open on its thread.
  std::vector<size_t> open;
  std::vector<wrs_op_event> views;
  std::optional<at::CallbackHandle> handle;
  uint32_t options = 0;
  bool reporter_pushed = false;
};

thread_local ProfileWindow tl_profile;

int64_t profile_now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now() - tl_profile.epoch)
      .count();
}

void MemoryReporter::reportMemoryUsage(void*, int64_t alloc_size, size_t, size_t,
                                       c10::Device device) {
  if (device.type() != c10::DeviceType::CPU || !tl_profile.handle.has_value()) {
    return;
  }
  // A block of the budget allocator (budget.cpp) carries its header.
  int64_t header = wrs::alloc_header_bytes;
  int64_t bytes = alloc_size >= 0 ? std::max<int64_t>(alloc_size - header, 0)
                                  : std::min<int64_t>(alloc_size + header, 0);
  for (size_t i : tl_profile.open) {
    tl_profile.ops[i].cpu_memory_bytes += bytes;
  }
}

struct OpIndex : at::ObserverContext {
  explicit OpIndex(size_t i) : index(i) {}
  size_t index;
};

// PyTorch's `input_shapes`: a tensor's sizes; nothing for anything else
// (scalars, lists, undefined tensors).
void record_shapes(const at::RecordFunction& fn, ProfiledOp& op) {
  for (const c10::IValue& input : fn.inputs()) {
    if (input.isTensor() && input.toTensor().defined()) {
      auto sizes = input.toTensor().sizes();
      op.ranks.push_back(static_cast<int64_t>(sizes.size()));
      op.dims.insert(op.dims.end(), sizes.begin(), sizes.end());
    } else {
      op.ranks.push_back(0);
    }
  }
}

std::unique_ptr<at::ObserverContext> on_op_start(const at::RecordFunction& fn) {
  ProfiledOp op{fn.name(), profile_now_ns(), -1};
  if ((tl_profile.options & WRS_PROFILE_SHAPES) != 0) {
    record_shapes(fn, op);
  }
  tl_profile.ops.push_back(std::move(op));
  size_t index = tl_profile.ops.size() - 1;
  tl_profile.open.push_back(index);
  return std::make_unique<OpIndex>(index);
}

void on_op_end(const at::RecordFunction&, at::ObserverContext* ctx) {
  auto* index = static_cast<OpIndex*>(ctx);
  if (index != nullptr && index->index < tl_profile.ops.size()) {
    tl_profile.ops[index->index].end_ns = profile_now_ns();
    auto& open = tl_profile.open;
    open.erase(std::remove(open.begin(), open.end(), index->index), open.end());
  }
}

}  // namespace

extern "C" {

int32_t wrs_profile_start(uint32_t options) {
  if (tl_profile.handle.has_value()) {
    return -1;
  }
  try {
    tl_profile.ops.clear();
    tl_profile.open.clear();
    tl_profile.views.clear();
    tl_profile.options = options;
    tl_profile.epoch = std::chrono::steady_clock::now();
    if ((options & WRS_PROFILE_MEMORY) != 0) {
      c10::ThreadLocalDebugInfo::_push(c10::DebugInfoKind::PROFILER_STATE,
                                       std::make_shared<MemoryReporter>());
      tl_profile.reporter_pushed = true;
    }
    tl_profile.handle = at::addThreadLocalCallback(
        at::RecordFunctionCallback(on_op_start, on_op_end)
            .needsInputs((options & WRS_PROFILE_SHAPES) != 0)
            .scopes({at::RecordScope::FUNCTION}));
    return 0;
  } catch (...) {
    if (tl_profile.reporter_pushed) {
      tl_profile.reporter_pushed = false;
      try {
        c10::ThreadLocalDebugInfo::_pop(c10::DebugInfoKind::PROFILER_STATE);
      } catch (...) {
      }
    }
    return -2;
  }
}

size_t wrs_profile_stop(const wrs_op_event** events) {
  if (tl_profile.handle.has_value()) {
    at::removeCallback(*tl_profile.handle);
    tl_profile.handle.reset();
  }
  if (tl_profile.reporter_pushed) {
    tl_profile.reporter_pushed = false;
    try {
      c10::ThreadLocalDebugInfo::_pop(c10::DebugInfoKind::PROFILER_STATE);
    } catch (...) {
      // Another PROFILER_STATE was pushed on top of ours and not popped:
      // leave the slot to its owner.
    }
  }
  auto end = profile_now_ns();
  tl_profile.open.clear();
  tl_profile.views.clear();
  for (auto& op : tl_profile.ops) {
    if (op.end_ns < 0) {
      op.end_ns = end;
    }
    tl_profile.views.push_back(wrs_op_event{op.name.data(), op.name.size(), op.start_ns,
                                            op.end_ns, op.ranks.data(), op.dims.data(),
                                            op.ranks.size(), op.cpu_memory_bytes});
  }
  *events = tl_profile.views.data();
  return tl_profile.views.size();
}

}  // extern "C"
