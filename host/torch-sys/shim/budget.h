// Tensor memory budgets: a CPU allocator that charges every allocation made
// inside a budget scope to that budget and to each of its parents, and
// refuses one that would take any of them over its limit.
//
// A budget is reference-counted: `wrs_budget_new` returns one reference, each
// live allocation charged to it holds one, and a child holds one on its
// parent. Scopes are per thread (`wrs_budget_enter`/`wrs_budget_exit`);
// allocations outside any scope are not charged.

#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct wrs_budget wrs_budget;

// Why the last charged allocation on this thread was refused.
typedef struct wrs_budget_refusal {
  // The bytes the allocation asked for.
  uint64_t asked;
  // The limit of the budget that refused it.
  uint64_t limit;
  // What that budget had in use before the allocation.
  uint64_t used;
  // 0 when the scope's own budget refused it, 1 for its parent, and so on.
  uint32_t depth;
} wrs_budget_refusal;

// Installs the budgeting CPU allocator in front of libtorch's current one.
// Idempotent; returns 0 on success.
int32_t wrs_budget_install(void);
// A new budget of `limit` bytes under `parent` (may be null); one reference.
wrs_budget* wrs_budget_new(uint64_t limit, wrs_budget* parent);
void wrs_budget_retain(wrs_budget* budget);
void wrs_budget_release(wrs_budget* budget);
uint64_t wrs_budget_used(const wrs_budget* budget);
uint64_t wrs_budget_limit(const wrs_budget* budget);
void wrs_budget_set_limit(wrs_budget* budget, uint64_t limit);
// Makes `budget` (may be null: no budget) this thread's scope and returns
// the previous one, to give back to wrs_budget_exit. Clears the thread's
// last refusal.
wrs_budget* wrs_budget_enter(wrs_budget* budget);
void wrs_budget_exit(wrs_budget* previous);
// Takes this thread's last refusal: 1 and fills `refusal` if there was one
// since the last wrs_budget_enter, 0 otherwise.
int32_t wrs_budget_take_refusal(wrs_budget_refusal* refusal);

// Recycling. Allocations of at least 1 MiB made on a thread inside an
// overwrite scope come from a pool of blocks that earlier such allocations
// freed, whose pages are already faulted in; the bytes of such a block are
// whatever its last tensor left there, so the scope is for callers that
// write every byte before anything reads it (a frame's tensors being
// received). Budgets charge and release such blocks as any other. Idle
// blocks are freed after 5 s, and the pool keeps at most its limit
// (1 GiB unless set) idle.
bool wrs_overwrite_enter(void);
void wrs_overwrite_exit(bool previous);
typedef struct wrs_recycle_stats_t {
  // Bytes held idle by the pool.
  uint64_t idle_bytes;
  // The most it holds idle.
  uint64_t limit;
  // Allocations served from an idle block, since the process started.
  uint64_t reused;
} wrs_recycle_stats_t;
void wrs_recycle_stats(wrs_recycle_stats_t* stats);
void wrs_recycle_set_limit(uint64_t limit);
// Frees every idle block now.
void wrs_recycle_trim(void);

#ifdef __cplusplus
}
#endif

#ifdef __cplusplus
namespace wrs {
// The header bytes the budget allocator adds to the block it is asking the
// wrapped allocator for, or giving back, on this thread (0 otherwise).
// That allocator reports the whole block to the profiler; the op profiler
// (ops.cpp) subtracts the header, so an op's memory is what the op asked
// for, as PyTorch reports it.
extern thread_local int64_t alloc_header_bytes;
}  // namespace wrs
#endif
