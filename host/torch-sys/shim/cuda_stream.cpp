// CUDA streams, events and the GPU sleep kernel for src/cuda_stream.rs.
//
// Everything goes through c10's device-generic interfaces (c10::Stream,
// c10::Event, the DeviceGuardImplInterface of DeviceType::CUDA), which live
// in libc10.so: libc10_cuda.so registers CUDA's implementation of them when
// src/cuda.rs loads libtorch_cuda.so. Nothing here links a CUDA library; the
// sleep kernel (at::cuda::sleep, libtorch_cuda.so's) is found at run time.
//
// A stream crosses into Rust as its device index and c10 stream id (the
// device type is always CUDA), an event as an owned c10::Event*.
//
// Every entry point catches every exception: nothing propagates into Rust.
// On failure it returns 0 and writes libtorch's message (its first line)
// into `err`.

#include "common.h"

#include <ATen/Tensor.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <dlfcn.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <exception>
#include <string>

using wasmrpc_shim::copy_first_line;

namespace {

const c10::impl::DeviceGuardImplInterface* cuda_impl() {
  // Throws "PyTorch is not linked with support for cuda devices" until
  // libc10_cuda.so has registered CUDA's implementation.
  return c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
}

c10::Device cuda_device(int8_t index) {
  return c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(index));
}

c10::Stream unpack(int8_t device, int64_t id) {
  return c10::Stream::unpack3(
      static_cast<c10::StreamId>(id), static_cast<c10::DeviceIndex>(device),
      c10::DeviceType::CUDA);
}

template <typename F>
int32_t guarded(char* err, size_t cap, F&& f) {
  try {
    f();
    return 1;
  } catch (const std::exception& e) {
    copy_first_line(e.what(), err, cap);
    return 0;
  } catch (...) {
    copy_first_line("unknown C++ exception", err, cap);
    return 0;
  }
}

using SleepFn = void (*)(int64_t);

// at::cuda::sleep(int64_t), from the libtorch_cuda.so src/cuda.rs loaded
// with RTLD_GLOBAL.
SleepFn sleep_kernel() {
  static SleepFn fn = reinterpret_cast<SleepFn>(dlsym(RTLD_DEFAULT, "_ZN2at4cuda5sleepEl"));
  return fn;
}

}  // namespace

extern "C" {

// which: 0 the device's current stream on this thread, 1 a stream from the
// device's pool (what torch.cuda.Stream() gives), 2 its default stream.
int32_t wrs_cuda_stream_get(int32_t which, int8_t device, int64_t* id, char* err, size_t cap) {
  return guarded(err, cap, [&] {
    const auto* impl = cuda_impl();
    c10::Device d = cuda_device(device);
    c10::Stream s = which == 0   ? impl->getStream(d)
                    : which == 1 ? impl->getStreamFromGlobalPool(d, false)
                                 : impl->getDefaultStream(d);
    *id = static_cast<int64_t>(s.id());
  });
}

// Makes the stream current for its device on this thread; `previous` is the
// stream that was.
int32_t wrs_cuda_stream_exchange(int8_t device, int64_t id, int64_t* previous, char* err,
                                 size_t cap) {
  return guarded(err, cap, [&] {
    c10::Stream old = cuda_impl()->exchangeStream(unpack(device, id));
    *previous = static_cast<int64_t>(old.id());
  });
}

int32_t wrs_cuda_stream_synchronize(int8_t device, int64_t id, char* err, size_t cap) {
  return guarded(err, cap, [&] { cuda_impl()->synchronizeStream(unpack(device, id)); });
}

int32_t wrs_cuda_stream_query(int8_t device, int64_t id, int32_t* done, char* err, size_t cap) {
  return guarded(err, cap, [&] { *done = cuda_impl()->queryStream(unpack(device, id)) ? 1 : 0; });
}

// A new event (timing: whether elapsed times can be measured with it); null
// on failure.
void* wrs_cuda_event_new(int32_t timing, char* err, size_t cap) {
  c10::Event* out = nullptr;
  guarded(err, cap, [&] {
    cuda_impl();  // fails here, not at the first record, without CUDA
    out = new c10::Event(c10::DeviceType::CUDA, timing != 0 ? c10::EventFlag::BACKEND_DEFAULT
                                                            : c10::EventFlag::PYTORCH_DEFAULT);
  });
  return out;
}

void wrs_cuda_event_free(void* event) {
  try {
    delete static_cast<c10::Event*>(event);
  } catch (...) {
  }
}

int32_t wrs_cuda_event_record(void* event, int8_t device, int64_t id, char* err, size_t cap) {
  return guarded(err, cap, [&] { static_cast<c10::Event*>(event)->record(unpack(device, id)); });
}

// The device the event was last recorded on (-1 before its first record).
int8_t wrs_cuda_event_device(void* event) {
  return static_cast<int8_t>(static_cast<c10::Event*>(event)->device_index());
}

int32_t wrs_cuda_event_block(void* event, int8_t device, int64_t id, char* err, size_t cap) {
  return guarded(err, cap, [&] { static_cast<c10::Event*>(event)->block(unpack(device, id)); });
}

int32_t wrs_cuda_event_synchronize(void* event, char* err, size_t cap) {
  return guarded(err, cap, [&] { static_cast<c10::Event*>(event)->synchronize(); });
}

int32_t wrs_cuda_event_query(void* event, int32_t* done, char* err, size_t cap) {
  return guarded(err, cap, [&] { *done = static_cast<c10::Event*>(event)->query() ? 1 : 0; });
}

int32_t wrs_cuda_event_elapsed_ms(void* start, void* end, double* ms, char* err, size_t cap) {
  return guarded(err, cap, [&] {
    *ms = static_cast<c10::Event*>(start)->elapsedTime(*static_cast<c10::Event*>(end));
  });
}

// Tells the caching allocator that `tensor`'s storage is used on the stream
// (Tensor.record_stream): its memory is not reused until the stream's work
// queued so far is done.
int32_t wrs_cuda_record_stream(const void* tensor, int8_t device, int64_t id, char* err,
                               size_t cap) {
  return guarded(err, cap, [&] {
    const auto& t = *static_cast<const at::Tensor*>(tensor);
    if (!t.device().is_cuda()) {
      throw std::invalid_argument("record_stream of a tensor on " + t.device().str() +
                                  ", not on a CUDA device");
    }
    c10::Stream stream = unpack(device, id);
    // A sparse tensor has no storage of its own: its indices and values do.
    if (t.is_sparse()) {
      cuda_impl()->recordDataPtrOnStream(t._indices().storage().data_ptr(), stream);
      cuda_impl()->recordDataPtrOnStream(t._values().storage().data_ptr(), stream);
    } else {
      cuda_impl()->recordDataPtrOnStream(t.storage().data_ptr(), stream);
    }
  });
}

// Spins the device's current stream for about `cycles` GPU clock cycles
// (torch.cuda._sleep).
int32_t wrs_cuda_sleep(int8_t device, int64_t cycles, char* err, size_t cap) {
  return guarded(err, cap, [&] {
    SleepFn fn = sleep_kernel();
    if (fn == nullptr) {
      throw std::runtime_error(
          "at::cuda::sleep is not loaded: libtorch_cuda.so is not in this process");
    }
    c10::DeviceGuard guard(cuda_device(device));
    fn(cycles);
  });
}

}  // extern "C"
