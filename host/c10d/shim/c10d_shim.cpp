// libtorch's c10d engines behind the C interface of `c10d_shim.h`:
// `RustStore` (a `c10d::Store` whose operations call back into Rust),
// construction of `c10d::ProcessGroupGloo` (and of `ProcessGroupNCCL`
// through the factory of libwasmrpc_c10d_nccl.so, nccl.cpp, which only this
// shim's callers load), and the collectives through the virtual
// `c10d::Backend` interface: this file needs no NCCL or CUDA symbol.
//
// The Gloo headers come from outside the torch wheel (see build.rs); the
// shim instantiates no Gloo type itself: it calls libtorch's exported
// constructors and device factories and holds Gloo objects only through
// `std::shared_ptr`, so the compiled library's Gloo is the one that runs.

#include "c10d_shim.h"

#include <gloo/config.h>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/csrc/distributed/c10d/exception.h>

#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

struct wrc_out {
  std::vector<std::string> items;
  int64_t num = 0;
};

struct wrc_backend {
  c10::intrusive_ptr<c10d::Backend> backend;
};

struct wrc_work {
  c10::intrusive_ptr<c10d::Work> work;
};

extern "C" {

wrc_out* wrc_out_new(void) { return new wrc_out(); }
void wrc_out_free(wrc_out* out) { delete out; }
void wrc_out_push(wrc_out* out, const uint8_t* ptr, size_t len) {
  out->items.emplace_back(reinterpret_cast<const char*>(ptr), len);
}
void wrc_out_set_num(wrc_out* out, int64_t num) { out->num = num; }
size_t wrc_out_len(const wrc_out* out) { return out->items.size(); }
wrc_bytes wrc_out_get(const wrc_out* out, size_t i) {
  const std::string& s = out->items.at(i);
  return wrc_bytes{reinterpret_cast<const uint8_t*>(s.data()), s.size()};
}
int64_t wrc_out_num(const wrc_out* out) { return out->num; }

}  // extern "C"

namespace {

using Millis = std::chrono::milliseconds;

// The message of the exception in flight, without c10's backtrace.
std::string current_message() {
  try {
    throw;
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown C++ exception";
  }
}

void set_error(wrc_out* err, const std::string& msg) {
  err->items.clear();
  err->items.push_back(msg);
}

// The Rust side of a store: its context and callback, released once the
// last `RustStore` sharing it is gone.
struct StoreCallbacks {
  void* ctx;
  wrc_store_call call;
  wrc_store_drop drop;
  ~StoreCallbacks() { drop(ctx); }
};

// A `c10d::Store` that forwards every operation to a Rust `Store`.
class RustStore : public c10d::Store {
 public:
  RustStore(std::shared_ptr<StoreCallbacks> cb, Millis timeout)
      : c10d::Store(timeout), cb_(std::move(cb)) {}

  c10::intrusive_ptr<c10d::Store> clone() override {
    return c10::make_intrusive<RustStore>(cb_, timeout_);
  }

  void set(const std::string& key, const std::vector<uint8_t>& value) override {
    call(WRC_STORE_SET, {bytes(key), bytes(value)});
  }

  std::vector<uint8_t> compareSet(
      const std::string& key, const std::vector<uint8_t>& expected,
      const std::vector<uint8_t>& desired) override {
    return first(call(WRC_STORE_COMPARE_SET, {bytes(key), bytes(expected), bytes(desired)}));
  }

  std::vector<uint8_t> get(const std::string& key) override {
    return first(call(WRC_STORE_GET, {bytes(key)}));
  }

  int64_t add(const std::string& key, int64_t value) override {
    return call(WRC_STORE_ADD, {bytes(key)}, value).num;
  }

  bool deleteKey(const std::string& key) override {
    return call(WRC_STORE_DELETE, {bytes(key)}).num != 0;
  }

  bool check(const std::vector<std::string>& keys) override {
    return call(WRC_STORE_CHECK, list(keys)).num != 0;
  }

  int64_t getNumKeys() override { return call(WRC_STORE_NUM_KEYS, {}).num; }

  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }

  void wait(const std::vector<std::string>& keys, const Millis& timeout) override {
    call(WRC_STORE_WAIT, list(keys), timeout.count());
  }

  void append(const std::string& key, const std::vector<uint8_t>& value) override {
    call(WRC_STORE_APPEND, {bytes(key), bytes(value)});
  }

  std::vector<std::vector<uint8_t>> multiGet(const std::vector<std::string>& keys) override {
    wrc_out out = call(WRC_STORE_MULTI_GET, list(keys));
    std::vector<std::vector<uint8_t>> values;
    values.reserve(out.items.size());
    for (const auto& s : out.items) {
      values.emplace_back(s.begin(), s.end());
    }
    return values;
  }

  void multiSet(
      const std::vector<std::string>& keys,
      const std::vector<std::vector<uint8_t>>& values) override {
    std::vector<wrc_bytes> args;
    for (size_t i = 0; i < keys.size() && i < values.size(); ++i) {
      args.push_back(bytes(keys[i]));
      args.push_back(bytes(values[i]));
    }
    call(WRC_STORE_MULTI_SET, std::move(args));
  }

  bool hasExtendedApi() const override { return true; }

 private:
  static wrc_bytes bytes(const std::string& s) {
    return wrc_bytes{reinterpret_cast<const uint8_t*>(s.data()), s.size()};
  }
  static wrc_bytes bytes(const std::vector<uint8_t>& v) {
    return wrc_bytes{v.data(), v.size()};
  }
  static std::vector<wrc_bytes> list(const std::vector<std::string>& keys) {
    std::vector<wrc_bytes> args;
    args.reserve(keys.size());
    for (const auto& k : keys) {
      args.push_back(bytes(k));
    }
    return args;
  }
  static std::vector<uint8_t> first(const wrc_out& out) {
    if (out.items.empty()) {
      return {};
    }
    return std::vector<uint8_t>(out.items[0].begin(), out.items[0].end());
  }

  wrc_out call(int32_t op, std::vector<wrc_bytes> args, int64_t num = 0) {
    wrc_out out;
    int32_t status = cb_->call(cb_->ctx, op, args.data(), args.size(), num, &out);
    if (status != WRC_OK) {
      std::string msg = out.items.empty() ? "store error" : out.items[0];
      if (status == WRC_TIMEOUT) {
        C10_THROW_ERROR(DistStoreError, msg);
      }
      C10_THROW_ERROR(DistStoreError, msg);
    }
    return out;
  }

  std::shared_ptr<StoreCallbacks> cb_;
};

std::vector<at::Tensor> tensors(const void* const* ptrs, size_t n) {
  std::vector<at::Tensor> out;
  out.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    out.push_back(*static_cast<const at::Tensor*>(ptrs[i]));
  }
  return out;
}

std::vector<std::vector<at::Tensor>> nested(
    const void* const* ptrs, size_t outer, size_t inner) {
  std::vector<std::vector<at::Tensor>> out(outer);
  for (size_t i = 0; i < outer; ++i) {
    out[i] = tensors(ptrs + i * inner, inner);
  }
  return out;
}

c10d::ReduceOp reduce_op(int32_t op) {
  return c10d::ReduceOp(static_cast<c10d::ReduceOp::RedOpType>(op));
}

// Runs `issue` (which returns a `c10::intrusive_ptr<c10d::Work>`), catching
// every exception into `err`.
template <typename F>
wrc_work* issue(wrc_out* err, F&& f) {
  try {
    auto work = f();
    if (!work) {
      set_error(err, "the backend returned no work");
      return nullptr;
    }
    return new wrc_work{std::move(work)};
  } catch (...) {
    set_error(err, current_message());
    return nullptr;
  }
}

c10::intrusive_ptr<c10d::Store> make_store(
    void* ctx, wrc_store_call call, wrc_store_drop drop, Millis timeout) {
  auto cb = std::shared_ptr<StoreCallbacks>(new StoreCallbacks{ctx, call, drop});
  return c10::make_intrusive<RustStore>(std::move(cb), timeout);
}

}  // namespace

extern "C" {

int32_t wrc_gloo_header_version(void) { return GLOO_VERSION; }

size_t wrc_gloo_sizeof_process_group(void) { return sizeof(c10d::ProcessGroupGloo); }

wrc_backend* wrc_gloo_new(
    void* ctx, wrc_store_call call, wrc_store_drop drop, int32_t rank,
    int32_t size, int64_t timeout_ms, const char* hostname, wrc_out* err) {
  c10::intrusive_ptr<c10d::Store> store;
  try {
    store = make_store(ctx, call, drop, Millis(timeout_ms));
  } catch (...) {
    drop(ctx);
    set_error(err, current_message());
    return nullptr;
  }
  try {
    auto options = c10d::ProcessGroupGloo::Options::create(Millis(timeout_ms));
    bool lazy = c10d::getDefaultGlooLazyInit();
    // As torch/csrc/distributed/c10d/init.cpp's binding: one device per
    // interface named in GLOO_SOCKET_IFNAME, else the default device.
    const char* ifnames = std::getenv("GLOO_SOCKET_IFNAME");
    if (ifnames != nullptr && *ifnames != '\0') {
      std::stringstream names(ifnames);
      std::string name;
      while (std::getline(names, name, ',')) {
        if (!name.empty()) {
          options->devices.push_back(
              c10d::ProcessGroupGloo::createDeviceForInterface(name, lazy));
        }
      }
    } else if (hostname != nullptr && *hostname != '\0') {
      options->devices.push_back(
          c10d::ProcessGroupGloo::createDeviceForHostname(hostname, lazy));
    } else {
      options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice(lazy));
    }
    auto pg = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, options);
    return new wrc_backend{std::move(pg)};
  } catch (...) {
    set_error(err, current_message());
    return nullptr;
  }
}

wrc_backend* wrc_nccl_new(
    void* ctx, wrc_store_call call, wrc_store_drop drop, int32_t rank,
    int32_t size, int64_t timeout_ms, wrc_nccl_factory factory, wrc_out* err) {
  c10::intrusive_ptr<c10d::Store> store;
  try {
    store = make_store(ctx, call, drop, Millis(timeout_ms));
  } catch (...) {
    drop(ctx);
    set_error(err, current_message());
    return nullptr;
  }
  try {
    c10::intrusive_ptr<c10d::Backend> pg;
    std::string message(4096, '\0');
    if (factory(&store, rank, size, timeout_ms, &pg, message.data(), message.size()) == 0) {
      message.resize(std::strlen(message.c_str()));
      set_error(err, message.empty() ? "ProcessGroupNCCL construction failed" : message);
      return nullptr;
    }
    if (!pg) {
      set_error(err, "the NCCL library returned no ProcessGroupNCCL");
      return nullptr;
    }
    return new wrc_backend{std::move(pg)};
  } catch (...) {
    set_error(err, current_message());
    return nullptr;
  }
}

void wrc_backend_name(wrc_backend* b, wrc_out* out) {
  try {
    out->items.push_back(b->backend->getBackendName());
  } catch (...) {
    set_error(out, current_message());
  }
}

int32_t wrc_backend_has_alltoall(wrc_backend* b) {
  // ProcessGroupGloo implements the list form of all-to-all from libtorch
  // 2.12 on; before, `&ProcessGroupGloo::alltoall` names Backend's, which
  // throws. NCCL has both forms in every release the shim compiles for.
  constexpr bool gloo_declares_alltoall = !std::is_same_v<
      decltype(&c10d::ProcessGroupGloo::alltoall),
      decltype(&c10d::Backend::alltoall)>;
  try {
    return gloo_declares_alltoall || b->backend->getBackendName() != "gloo";
  } catch (...) {
    return 0;
  }
}

void wrc_backend_shutdown(wrc_backend* b) {
  try {
    b->backend->shutdown();
  } catch (...) {
  }
}

void wrc_backend_free(wrc_backend* b) {
  try {
    delete b;
  } catch (...) {
  }
}

wrc_work* wrc_broadcast(
    wrc_backend* b, const void* const* ts, size_t n, int64_t root,
    int64_t timeout_ms, wrc_out* err) {
  return issue(err, [&] {
    auto v = tensors(ts, n);
    c10d::BroadcastOptions opts;
    opts.rootRank = root;
    opts.timeout = Millis(timeout_ms);
    return b->backend->broadcast(v, opts);
  });
}

wrc_work* wrc_allreduce(
    wrc_backend* b, const void* const* ts, size_t n, int32_t op,
    int64_t timeout_ms, wrc_out* err) {
  return issue(err, [&] {
    auto v = tensors(ts, n);
    c10d::AllreduceOptions opts;
    opts.reduceOp = reduce_op(op);
    opts.timeout = Millis(timeout_ms);
    return b->backend->allreduce(v, opts);
  });
}

wrc_work* wrc_allreduce_coalesced(
    wrc_backend* b, const void* const* ts, size_t n, int32_t op,
    int64_t timeout_ms, wrc_out* err) {
  return issue(err, [&] {
    auto v = tensors(ts, n);
    c10d::AllreduceCoalescedOptions opts;
    opts.reduceOp = reduce_op(op);
    opts.timeout = Millis(timeout_ms);
    return b->backend->allreduce_coalesced(v, opts);
  });
}

wrc_work* wrc_reduce(
    wrc_backend* b, const void* const* ts, size_t n, int64_t root, int32_t op,
    int64_t timeout_ms, wrc_out* err) {
  return issue(err, [&] {
    auto v = tensors(ts, n);
    c10d::ReduceOptions opts;
    opts.reduceOp = reduce_op(op);
    opts.rootRank = root;
    opts.timeout = Millis(timeout_ms);
    return b->backend->reduce(v, opts);
  });
}

wrc_work* wrc_allgather(
    wrc_backend* b, const void* const* outputs, size_t outer, size_t inner,
    const void* const* inputs, size_t n, int64_t timeout_ms, wrc_out* err) {
  return issue(err, [&] {
    auto outs = nested(outputs, outer, inner);
    auto ins = tensors(inputs, n);
    c10d::AllgatherOptions opts;
    opts.timeout = Millis(timeout_ms);
    return b->backend->allgather(outs, ins, opts);
  });
}

wrc_work* wrc_gather(
    wrc_backend* b, const void* const* outputs, size_t outer, size_t inner,
    const void* const* inputs, size_t n, int64_t root, int64_t timeout_ms,
    wrc_out* err) {
  return issue(err, [&] {
    auto outs = nested(outputs, outer, inner);
    auto ins = tensors(inputs, n);
    c10d::GatherOptions opts;
    opts.rootRank = root;
    opts.timeout = Millis(timeout_ms);
    return b->backend->gather(outs, ins, opts);
  });
}

wrc_work* wrc_scatter(
    wrc_backend* b, const void* const* outputs, size_t n,
    const void* const* inputs, size_t outer, size_t inner, int64_t root,
    int64_t timeout_ms, wrc_out* err) {
  return issue(err, [&] {
    auto outs = tensors(outputs, n);
    auto ins = nested(inputs, outer, inner);
    c10d::ScatterOptions opts;
    opts.rootRank = root;
    opts.timeout = Millis(timeout_ms);
    return b->backend->scatter(outs, ins, opts);
  });
}

wrc_work* wrc_reduce_scatter(
    wrc_backend* b, const void* const* outputs, size_t n,
    const void* const* inputs, size_t outer, size_t inner, int32_t op,
    int64_t timeout_ms, wrc_out* err) {
  return issue(err, [&] {
    auto outs = tensors(outputs, n);
    auto ins = nested(inputs, outer, inner);
    c10d::ReduceScatterOptions opts;
    opts.reduceOp = reduce_op(op);
    opts.timeout = Millis(timeout_ms);
    return b->backend->reduce_scatter(outs, ins, opts);
  });
}

wrc_work* wrc_alltoall_base(
    wrc_backend* b, const void* output, const void* input,
    const int64_t* output_split, size_t n_output_split,
    const int64_t* input_split, size_t n_input_split, int64_t timeout_ms,
    wrc_out* err) {
  return issue(err, [&] {
    at::Tensor out = *static_cast<const at::Tensor*>(output);
    at::Tensor in = *static_cast<const at::Tensor*>(input);
    std::vector<int64_t> os(output_split, output_split + n_output_split);
    std::vector<int64_t> is(input_split, input_split + n_input_split);
    c10d::AllToAllOptions opts;
    opts.timeout = Millis(timeout_ms);
    return b->backend->alltoall_base(out, in, os, is, opts);
  });
}

wrc_work* wrc_alltoall(
    wrc_backend* b, const void* const* outputs, size_t n_outputs,
    const void* const* inputs, size_t n_inputs, int64_t timeout_ms,
    wrc_out* err) {
  return issue(err, [&] {
    auto outs = tensors(outputs, n_outputs);
    auto ins = tensors(inputs, n_inputs);
    c10d::AllToAllOptions opts;
    opts.timeout = Millis(timeout_ms);
    return b->backend->alltoall(outs, ins, opts);
  });
}

wrc_work* wrc_barrier(wrc_backend* b, int64_t timeout_ms, wrc_out* err) {
  return issue(err, [&] {
    c10d::BarrierOptions opts;
    opts.timeout = Millis(timeout_ms);
    return b->backend->barrier(opts);
  });
}

wrc_work* wrc_send(
    wrc_backend* b, const void* const* ts, size_t n, int32_t dst, int32_t tag,
    wrc_out* err) {
  return issue(err, [&] {
    auto v = tensors(ts, n);
    return b->backend->send(v, dst, tag);
  });
}

wrc_work* wrc_recv(
    wrc_backend* b, const void* const* ts, size_t n, int32_t src, int32_t tag,
    wrc_out* err) {
  return issue(err, [&] {
    auto v = tensors(ts, n);
    return b->backend->recv(v, src, tag);
  });
}

int32_t wrc_work_wait(wrc_work* w, int64_t timeout_ms, wrc_out* err) {
  try {
    w->work->wait(Millis(timeout_ms));
    return WRC_OK;
  } catch (...) {
    std::string msg = current_message();
    set_error(err, msg);
    bool timed_out = msg.find("imed out") != std::string::npos ||
        msg.find("imeout") != std::string::npos;
    return timed_out ? WRC_TIMEOUT : WRC_ERROR;
  }
}

int32_t wrc_work_on_done(wrc_work* w, wrc_done done, void* ctx) {
  c10::intrusive_ptr<c10::ivalue::Future> fut;
  try {
    fut = w->work->getFuture();
  } catch (...) {
    return 0;
  }
  if (!fut) {
    return 0;
  }
  fut->addCallback([done, ctx](c10::ivalue::Future& f) {
    if (!f.hasError()) {
      done(ctx, WRC_OK, nullptr, 0);
      return;
    }
    std::string msg;
    try {
      std::rethrow_exception(f.exception_ptr());
    } catch (...) {
      msg = current_message();
    }
    bool timed_out = msg.find("imed out") != std::string::npos ||
        msg.find("imeout") != std::string::npos;
    done(ctx, timed_out ? WRC_TIMEOUT : WRC_ERROR, msg.data(), msg.size());
  });
  return 1;
}

void wrc_work_free(wrc_work* w) {
  try {
    delete w;
  } catch (...) {
  }
}

}  // extern "C"
