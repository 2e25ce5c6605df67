// Tensor memory budgets (see budget.h).
//
// The allocator wraps the CPU allocator libtorch had when it was installed:
// each block is that allocator's block with a 64-byte header in front (c10
// aligns CPU memory to 64 bytes, so the data stays aligned), holding the
// wrapped block and the budget it was charged to. The data pointer is also
// the DataPtr's context and every block has the header, charged or not, so
// libtorch's `raw_allocate`/`raw_deallocate` work through `raw_deleter`.

#include "budget.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <mutex>
#include <new>
#include <utility>

struct wrs_budget {
  std::atomic<uint64_t> used{0};
  std::atomic<uint64_t> limit;
  std::atomic<int64_t> refs{1};
  // Holds a reference.
  wrs_budget* parent;

  wrs_budget(uint64_t limit_, wrs_budget* parent_)
      : limit(limit_), parent(parent_) {}
};

thread_local int64_t wrs::alloc_header_bytes = 0;

namespace {

thread_local wrs_budget* current_scope = nullptr;
thread_local bool refused = false;
thread_local wrs_budget_refusal last_refusal{};

void release(wrs_budget* b) {
  while (b != nullptr && b->refs.fetch_sub(1, std::memory_order_acq_rel) == 1) {
    wrs_budget* parent = b->parent;
    delete b;
    b = parent;
  }
}

// Charges `n` bytes to `b` and its parents. On refusal, undoes what it
// charged, records why for this thread and returns false.
bool charge(wrs_budget* b, uint64_t n) {
  uint32_t depth = 0;
  for (wrs_budget* level = b; level != nullptr; level = level->parent, ++depth) {
    uint64_t before = level->used.fetch_add(n, std::memory_order_relaxed);
    uint64_t limit = level->limit.load(std::memory_order_relaxed);
    if (before + n > limit || before + n < before) {
      for (wrs_budget* u = b; u != level->parent; u = u->parent) {
        u->used.fetch_sub(n, std::memory_order_relaxed);
      }
      refused = true;
      last_refusal = wrs_budget_refusal{n, limit, before, depth};
      return false;
    }
  }
  return true;
}

void uncharge(wrs_budget* b, uint64_t n) {
  for (wrs_budget* level = b; level != nullptr; level = level->parent) {
    level->used.fetch_sub(n, std::memory_order_relaxed);
  }
}

constexpr size_t kHeader = 64;

// Sets wrs::alloc_header_bytes while the wrapped allocator works on one of
// our blocks.
struct HeaderInFlight {
  HeaderInFlight() { wrs::alloc_header_bytes = static_cast<int64_t>(kHeader); }
  ~HeaderInFlight() { wrs::alloc_header_bytes = 0; }
  HeaderInFlight(const HeaderInFlight&) = delete;
  HeaderInFlight& operator=(const HeaderInFlight&) = delete;
};

struct Header {
  c10::DataPtr block;
  // Null when the block was allocated outside any scope.
  wrs_budget* budget;
  uint64_t bytes;
};
static_assert(sizeof(Header) <= kHeader, "the header must fit in front of the data");

void budgeted_delete(void* data) {
  if (data == nullptr) {
    return;
  }
  auto* header = reinterpret_cast<Header*>(static_cast<char*>(data) - kHeader);
  c10::DataPtr block = std::move(header->block);
  wrs_budget* budget = header->budget;
  uint64_t bytes = header->bytes;
  header->~Header();
  if (budget != nullptr) {
    uncharge(budget, bytes);
    release(budget);
  }
  // Frees the memory, header included.
  HeaderInFlight in_flight;
  block.clear();
}

struct BudgetedAllocator final : c10::Allocator {
  c10::Allocator* inner = nullptr;

  c10::DataPtr allocate(size_t n) override {
    if (n == 0) {
      return c10::DataPtr(nullptr, nullptr, &budgeted_delete,
                          c10::Device(c10::DeviceType::CPU));
    }
    wrs_budget* budget = current_scope;
    if (budget != nullptr && !charge(budget, n)) {
      TORCH_CHECK(false, "tensor memory budget of ", last_refusal.limit,
                  " bytes exceeded (asked ", n, " bytes, ", last_refusal.used,
                  " in use)");
    }
    c10::DataPtr block;
    try {
      HeaderInFlight in_flight;
      block = inner->allocate(n + kHeader);
    } catch (...) {
      if (budget != nullptr) {
        uncharge(budget, n);
      }
      throw;
    }
    char* base = static_cast<char*>(block.get());
    void* data = base + kHeader;
    if (budget != nullptr) {
      budget->refs.fetch_add(1, std::memory_order_relaxed);
    }
    new (base) Header{std::move(block), budget, n};
    return c10::DataPtr(data, data, &budgeted_delete,
                        c10::Device(c10::DeviceType::CPU));
  }

  c10::DeleterFnPtr raw_deleter() const override { return &budgeted_delete; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

BudgetedAllocator g_allocator;
std::once_flag g_installed;

}  // namespace

extern "C" {

int32_t wrs_budget_install(void) {
  try {
    std::call_once(g_installed, [] {
      g_allocator.inner = c10::GetCPUAllocator();
      // Above the default allocator's registration (priority 0).
      c10::SetCPUAllocator(&g_allocator, /*priority=*/1);
    });
    return c10::GetCPUAllocator() == &g_allocator ? 0 : 1;
  } catch (...) {
    return 2;
  }
}

wrs_budget* wrs_budget_new(uint64_t limit, wrs_budget* parent) {
  auto* budget = new (std::nothrow) wrs_budget(limit, parent);
  if (budget != nullptr && parent != nullptr) {
    parent->refs.fetch_add(1, std::memory_order_relaxed);
  }
  return budget;
}

void wrs_budget_retain(wrs_budget* budget) {
  budget->refs.fetch_add(1, std::memory_order_relaxed);
}

void wrs_budget_release(wrs_budget* budget) { release(budget); }

uint64_t wrs_budget_used(const wrs_budget* budget) {
  return budget->used.load(std::memory_order_relaxed);
}

uint64_t wrs_budget_limit(const wrs_budget* budget) {
  return budget->limit.load(std::memory_order_relaxed);
}

void wrs_budget_set_limit(wrs_budget* budget, uint64_t limit) {
  budget->limit.store(limit, std::memory_order_relaxed);
}

wrs_budget* wrs_budget_enter(wrs_budget* budget) {
  wrs_budget* previous = current_scope;
  current_scope = budget;
  refused = false;
  return previous;
}

void wrs_budget_exit(wrs_budget* previous) { current_scope = previous; }

int32_t wrs_budget_take_refusal(wrs_budget_refusal* refusal) {
  if (!refused) {
    return 0;
  }
  refused = false;
  *refusal = last_refusal;
  return 1;
}

}  // extern "C"
