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
#include <chrono>
#include <map>
#include <mutex>
#include <new>
#include <thread>
#include <utility>
#include <vector>

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
  // The block's size class when it may be recycled (it was asked for in an
  // overwrite scope), else 0.
  uint64_t recycle_class;
};
static_assert(sizeof(Header) <= kHeader, "the header must fit in front of the data");

// ---- Recycled blocks (see budget.h, "Recycling") ----

thread_local bool overwrite_scope = false;

// Blocks smaller than this are left to the wrapped allocator (malloc keeps
// small blocks itself; what costs is the page faults of big fresh ones).
constexpr uint64_t kRecycleMin = 1 << 20;
// An idle block is freed after this long.
constexpr auto kIdleLife = std::chrono::seconds(5);

// The size class of an `n`-byte request: `n` rounded up to a quarter of
// its power of two, so a class wastes at most a quarter of the block.
uint64_t size_class(uint64_t n) {
  int top = 63 - __builtin_clzll(n);
  uint64_t step = uint64_t{1} << (top - 2);
  return (n + step - 1) & ~(step - 1);
}

struct IdleBlock {
  c10::DataPtr block;
  std::chrono::steady_clock::time_point since;
};

struct RecyclePool {
  std::mutex mutex;
  std::map<uint64_t, std::vector<IdleBlock>> idle;
  uint64_t idle_bytes = 0;
  uint64_t limit = uint64_t{1} << 30;
  uint64_t reused = 0;
  bool trimmer_started = false;

  // An idle block of class `cls`, or an empty DataPtr.
  c10::DataPtr take(uint64_t cls) {
    std::lock_guard<std::mutex> lock(mutex);
    auto it = idle.find(cls);
    if (it == idle.end() || it->second.empty()) {
      return c10::DataPtr();
    }
    c10::DataPtr block = std::move(it->second.back().block);
    it->second.pop_back();
    idle_bytes -= cls;
    reused += 1;
    return block;
  }

  // Keeps `block` of class `cls` for reuse, or hands it back when the pool
  // is full (the caller frees it).
  c10::DataPtr give(uint64_t cls, c10::DataPtr block) {
    std::lock_guard<std::mutex> lock(mutex);
    if (idle_bytes + cls > limit) {
      return block;
    }
    // Called from a deleter, which must not throw: a block that cannot be
    // kept is freed.
    try {
      idle[cls].push_back(IdleBlock{std::move(block), std::chrono::steady_clock::now()});
    } catch (...) {
      return block;
    }
    idle_bytes += cls;
    if (!trimmer_started) {
      trimmer_started = start_trimmer();
    }
    return c10::DataPtr();
  }

  // Frees blocks idle for at least `life` (all of them for zero); returns
  // them to the caller, who frees them outside the lock.
  std::vector<c10::DataPtr> expire(std::chrono::steady_clock::duration life) {
    auto now = std::chrono::steady_clock::now();
    std::vector<c10::DataPtr> old;
    std::lock_guard<std::mutex> lock(mutex);
    for (auto& [cls, blocks] : idle) {
      size_t kept = 0;
      for (size_t i = 0; i < blocks.size(); ++i) {
        if (now - blocks[i].since >= life) {
          old.push_back(std::move(blocks[i].block));
          idle_bytes -= cls;
        } else {
          if (kept != i) {
            blocks[kept] = std::move(blocks[i]);
          }
          ++kept;
        }
      }
      blocks.resize(kept);
    }
    return old;
  }

  // Starts a detached thread that frees blocks once they have been idle
  // for kIdleLife, so an idle worker gives its memory back. False when no
  // thread can be made now (the next block kept tries again).
  bool start_trimmer();
};

// Leaked on purpose: blocks may be freed by static destructors of other
// libraries after this file's would have run.
RecyclePool& pool() {
  static RecyclePool* p = new RecyclePool();
  return *p;
}

void free_blocks(std::vector<c10::DataPtr> blocks);

bool RecyclePool::start_trimmer() {
  // Called from a deleter, which must not throw.
  try {
    std::thread([] {
      for (;;) {
        std::this_thread::sleep_for(std::chrono::seconds(1));
        try {
          free_blocks(pool().expire(kIdleLife));
        } catch (...) {
          // Out of memory for the list: try again in a second.
        }
      }
    }).detach();
    return true;
  } catch (...) {
    return false;
  }
}

void budgeted_delete(void* data) {
  if (data == nullptr) {
    return;
  }
  auto* header = reinterpret_cast<Header*>(static_cast<char*>(data) - kHeader);
  c10::DataPtr block = std::move(header->block);
  wrs_budget* budget = header->budget;
  uint64_t bytes = header->bytes;
  uint64_t recycle_class = header->recycle_class;
  header->~Header();
  if (budget != nullptr) {
    uncharge(budget, bytes);
    release(budget);
  }
  if (recycle_class != 0) {
    block = pool().give(recycle_class, std::move(block));
    if (!block) {
      return;
    }
  }
  // Frees the memory, header included.
  HeaderInFlight in_flight;
  block.clear();
}

void free_blocks(std::vector<c10::DataPtr> blocks) {
  HeaderInFlight in_flight;
  blocks.clear();
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
    uint64_t recycle_class = 0;
    try {
      if (overwrite_scope && n >= kRecycleMin) {
        recycle_class = size_class(n);
        block = pool().take(recycle_class);
      }
      if (!block) {
        HeaderInFlight in_flight;
        block = inner->allocate((recycle_class != 0 ? recycle_class : n) + kHeader);
      }
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
    new (base) Header{std::move(block), budget, n, recycle_class};
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

bool wrs_overwrite_enter(void) {
  bool previous = overwrite_scope;
  overwrite_scope = true;
  return previous;
}

void wrs_overwrite_exit(bool previous) { overwrite_scope = previous; }

void wrs_recycle_stats(wrs_recycle_stats_t* stats) {
  RecyclePool& p = pool();
  std::lock_guard<std::mutex> lock(p.mutex);
  stats->idle_bytes = p.idle_bytes;
  stats->limit = p.limit;
  stats->reused = p.reused;
}

void wrs_recycle_set_limit(uint64_t limit) {
  {
    RecyclePool& p = pool();
    std::lock_guard<std::mutex> lock(p.mutex);
    p.limit = limit;
    // Oldest first would be fairer; the largest first frees the most with
    // the fewest calls, and a smaller limit is set rarely (tests, start-up).
    for (auto it = p.idle.rbegin(); it != p.idle.rend() && p.idle_bytes > limit; ++it) {
      while (!it->second.empty() && p.idle_bytes > limit) {
        // Freed here, under the lock, rather than collected: no allocation
        // that could throw through the C boundary.
        HeaderInFlight in_flight;
        it->second.back().block.clear();
        it->second.pop_back();
        p.idle_bytes -= it->first;
      }
    }
  }
}

void wrs_recycle_trim(void) {
  try {
    free_blocks(pool().expire(std::chrono::steady_clock::duration::zero()));
  } catch (...) {
    // Out of memory for the list of blocks to free: they stay idle and the
    // trimmer frees them later.
  }
}

int32_t wrs_budget_take_refusal(wrs_budget_refusal* refusal) {
  if (!refused) {
    return 0;
  }
  refused = false;
  *refusal = last_refusal;
  return 1;
}

}  // extern "C"
