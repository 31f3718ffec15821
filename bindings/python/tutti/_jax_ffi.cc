// XLA FFI handlers that run tutti's collectives inside jitted JAX programs (tutti.jax).
//
// Compiled by tutti.jax on first use against the installed jaxlib's FFI headers
// (jax.ffi.include_dir()), into a cache keyed by this source and the jaxlib version. The
// handlers call libtutti through function pointers that tutti.jax hands over (tutti_jax_bind)
// from the library the Python package already loaded, so the communicator handles they are
// given belong to that library: no second copy of libtutti, no link-time path.
//
// Every handler takes an ordering token and returns one (tutti.jax threads them through an
// ordered effect, so XLA runs the collectives of a program in program order on every rank),
// and the communicator's slot (an integer attribute; tutti.jax sets and clears the slots, see
// _glue.h). A failed call is an error naming the collective with libtutti's own message; JAX
// raises it, as it does a call on a communicator that was closed.
//
// On GPUs (XLA's CUDA platform) the same handlers take the stream XLA runs the program on, and
// issue tutti's call on it (tutti_comm_set_cuda_stream): the collective's GPU work waits for the
// work XLA queued there before it, and XLA's later work waits for it, with no host wait in
// between. The call's work handle goes to a thread that waits for it and releases it; should
// that work fail, the next call of the process reports its error. No CUDA header or library
// is needed to compile this: streams are opaque pointers, and the one driver function used (a
// device copy, where XLA gave a broadcast an output apart from its input) is looked up in the
// driver XLA already loaded.

#include <dlfcn.h>

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>

#include "xla/ffi/api/ffi.h"

#include "_glue.h"

namespace ffi = xla::ffi;

extern "C" {
typedef uint32_t (*tutti_all_reduce_fn)(void *, size_t, uint32_t, uint32_t, const void *, void *);
typedef uint32_t (*tutti_broadcast_fn)(void *, size_t, uint32_t, size_t, void *);
typedef uint32_t (*tutti_all_gather_fn)(void *, size_t, uint32_t, const void *, void *);
typedef uint32_t (*tutti_reduce_scatter_fn)(void *, size_t, uint32_t, uint32_t, const void *,
                                            void *);
typedef size_t (*tutti_last_error_fn)(char *, size_t);
typedef uint32_t (*tutti_set_stream_fn)(void *, void *);
typedef uint32_t (*tutti_unset_stream_fn)(void *);
typedef uint32_t (*tutti_all_reduce_async_fn)(void *, size_t, uint32_t, uint32_t, const void *,
                                              void *, void **);
typedef uint32_t (*tutti_broadcast_async_fn)(void *, size_t, uint32_t, size_t, void *, void **);
typedef uint32_t (*tutti_all_gather_async_fn)(void *, size_t, uint32_t, const void *, void *,
                                              void **);
typedef uint32_t (*tutti_reduce_scatter_async_fn)(void *, size_t, uint32_t, uint32_t,
                                                  const void *, void *, void **);
typedef uint32_t (*tutti_work_wait_fn)(void *, uint64_t);
typedef void (*tutti_work_destroy_fn)(void *);
typedef uint32_t (*tutti_comm_abort_fn)(void *, const char *);
// The CUDA driver's cuMemcpyDtoDAsync (CUdeviceptr is 64 bits wide).
typedef int (*cu_memcpy_dtod_async_fn)(uint64_t, uint64_t, size_t, void *);
}

namespace {

tutti_all_reduce_fn all_reduce_fn = nullptr;
tutti_broadcast_fn broadcast_fn = nullptr;
tutti_all_gather_fn all_gather_fn = nullptr;
tutti_reduce_scatter_fn reduce_scatter_fn = nullptr;
tutti_last_error_fn last_error_fn = nullptr;
tutti_set_stream_fn set_stream_fn = nullptr;
tutti_unset_stream_fn unset_stream_fn = nullptr;
tutti_all_reduce_async_fn all_reduce_async_fn = nullptr;
tutti_broadcast_async_fn broadcast_async_fn = nullptr;
tutti_all_gather_async_fn all_gather_async_fn = nullptr;
tutti_reduce_scatter_async_fn reduce_scatter_async_fn = nullptr;
tutti_work_wait_fn work_wait_fn = nullptr;
tutti_work_destroy_fn work_destroy_fn = nullptr;
tutti_comm_abort_fn abort_fn = nullptr;

// The C API's dtype numbers (tutti_dtype).
bool tutti_dtype(ffi::DataType t, uint32_t *out) {
  switch (t) {
    case ffi::DataType::F32: *out = 0; return true;
    case ffi::DataType::F64: *out = 1; return true;
    case ffi::DataType::F16: *out = 2; return true;
    case ffi::DataType::BF16: *out = 3; return true;
    case ffi::DataType::S8: *out = 4; return true;
    case ffi::DataType::U8: *out = 5; return true;
    case ffi::DataType::S32: *out = 6; return true;
    case ffi::DataType::U32: *out = 7; return true;
    case ffi::DataType::S64: *out = 8; return true;
    case ffi::DataType::U64: *out = 9; return true;
    default: return false;
  }
}

ffi::Error unbound() {
  return ffi::Error::Internal("tutti.jax: the handlers were not bound to libtutti");
}

// libtutti's message for the calling thread's last failure, with the collective's name.
ffi::Error failed(const char *what, uint32_t code) {
  return ffi::Error::Internal(tutti_glue::Failure(last_error_fn, what, code));
}

// The communicator of a slot, in use while this lives (or, for a call on a GPU stream, until
// the reaper has released the call's work: Keep hands the use over).
class Use {
 public:
  explicit Use(uint64_t slot) : slot_(slot), comm_(tutti_glue::slots().Enter(slot)) {}
  ~Use() {
    if (comm_ != nullptr) tutti_glue::slots().Leave(slot_);
  }
  Use(const Use &) = delete;
  Use &operator=(const Use &) = delete;
  void *comm() const { return comm_; }
  void Keep() { comm_ = nullptr; }

 private:
  uint64_t slot_;
  void *comm_;
};

ffi::Error closed(const char *what) {
  return ffi::Error(ffi::ErrorCode::kFailedPrecondition, tutti_glue::Closed(what));
}

// Waits for the calls issued on GPU streams, in issue order, and releases their work handles
// and their slots' uses. A failed one's message is kept for its communicator's next call.
class Reaper {
 public:
  // False where the thread or the queue could not be had (the caller then waits itself).
  bool Push(void *work, uint64_t slot, const char *what) {
    try {
      std::lock_guard<std::mutex> guard(mu_);
      if (!started_) {
        std::thread([this] { Loop(); }).detach();
        started_ = true;
      }
      queue_.push_back({work, slot, what});
    } catch (...) {
      return false;
    }
    cv_.notify_one();
    return true;
  }

  // The error of a call on `slot` that failed after its handler returned, once.
  std::string TakeError(uint64_t slot) {
    std::lock_guard<std::mutex> guard(mu_);
    auto it = errors_.find(slot);
    if (it == errors_.end()) return std::string();
    std::string e = std::move(it->second);
    errors_.erase(it);
    return e;
  }

  // Wait for `work` and release it and the use of `slot`; its error, if it failed.
  static std::string Finish(void *work, uint64_t slot, const char *what) {
    // Bounded: a call is bounded by its communicator's timeout once it starts.
    uint32_t r = work_wait_fn(work, 0);
    std::string message = r == 0 ? std::string() : tutti_glue::Failure(last_error_fn, what, r);
    work_destroy_fn(work);
    tutti_glue::slots().Leave(slot);
    return message;
  }

 private:
  struct Item {
    void *work;
    uint64_t slot;
    const char *what;
  };

  void Loop() {
    for (;;) {
      Item item;
      {
        std::unique_lock<std::mutex> guard(mu_);
        cv_.wait(guard, [&] { return !queue_.empty(); });
        item = queue_.front();
        queue_.pop_front();
      }
      // Kept before the use is left: a communicator closed after its last call's Leave finds
      // no error of that call left behind (tutti_jax_close_comm clears them).
      uint32_t r = work_wait_fn(item.work, 0);
      if (r != 0) {
        std::string message = tutti_glue::Failure(last_error_fn, item.what, r);
        std::lock_guard<std::mutex> guard(mu_);
        errors_.emplace(item.slot, std::move(message));
      }
      work_destroy_fn(item.work);
      tutti_glue::slots().Leave(item.slot);
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Item> queue_;
  std::unordered_map<uint64_t, std::string> errors_;
  bool started_ = false;
};

Reaper &reaper() {
  static Reaper *r = new Reaper();  // never destroyed: its thread outlives static teardown
  return *r;
}

// One lock per communicator's slot: setting its stream, the call and unsetting it go together.
std::mutex &stream_mu(uint64_t slot) {
  static std::mutex *table = new std::mutex();
  static auto *locks = new std::unordered_map<uint64_t, std::unique_ptr<std::mutex>>();
  std::lock_guard<std::mutex> guard(*table);
  std::unique_ptr<std::mutex> &m = (*locks)[slot];
  if (!m) m.reset(new std::mutex());
  return *m;
}

// Run one collective on the communicator of `slot`: on the host (`stream` null: `blocking`),
// or on a GPU stream (`async`, its work handed to the reaper).
template <typename Blocking, typename Async>
ffi::Error Run(const char *what, uint64_t slot, void *stream, Blocking blocking, Async async) {
  if (!all_reduce_fn) return unbound();
  if (stream != nullptr && !set_stream_fn) {
    return ffi::Error::Internal("tutti.jax: the GPU handlers were not bound to libtutti");
  }
  Use use(slot);
  if (use.comm() == nullptr) return closed(what);
  if (stream == nullptr) {
    uint32_t r = blocking(use.comm());
    return r == 0 ? ffi::Error::Success() : failed(what, r);
  }
  std::string earlier = reaper().TakeError(slot);
  if (!earlier.empty()) return ffi::Error::Internal(earlier + " (an earlier call, on the GPU)");
  std::lock_guard<std::mutex> guard(stream_mu(slot));
  uint32_t r = set_stream_fn(use.comm(), stream);
  if (r != 0) return failed(what, r);
  void *work = nullptr;
  r = async(use.comm(), &work);
  // Read this thread's message before another call of libtutti replaces it.
  ffi::Error error = r == 0 ? ffi::Error::Success() : failed(what, r);
  if (unset_stream_fn(use.comm()) != 0) {
    // Another thread's collective runs on this communicator (outside the compiled programs,
    // against tutti.jax's rule): XLA's stream would stay set for later calls, which may outlive
    // it. Abort the communicator rather than leave it so.
    std::string why = tutti_glue::Failure(last_error_fn, std::string(what) + ": unsetting XLA's stream", 1);
    abort_fn(use.comm(), why.c_str());
    if (r == 0) error = ffi::Error::Internal(why);
  }
  if (r == 0) {
    use.Keep();
    if (!reaper().Push(work, slot, what)) {
      std::string late = Reaper::Finish(work, slot, what);
      if (!late.empty() && error.success()) error = ffi::Error::Internal(late);
    }
  }
  return error;
}

ffi::Error dtype_of(const char *what, ffi::AnyBuffer x, uint32_t *dtype) {
  if (!tutti_dtype(x.element_type(), dtype)) {
    return ffi::Error::InvalidArgument(std::string("tutti ") + what +
                                       ": this element type is not one tutti reduces");
  }
  return ffi::Error::Success();
}

ffi::Error AllReduceOn(void *stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                       uint64_t comm, int32_t op) {
  uint32_t dtype;
  if (ffi::Error e = dtype_of("all_reduce", x, &dtype); e.failure()) return e;
  size_t n = x.element_count();
  uint32_t o = static_cast<uint32_t>(op);
  const void *in = x.untyped_data();
  void *out = y->untyped_data();
  return Run(
      "all_reduce", comm, stream, [&](void *c) { return all_reduce_fn(c, n, dtype, o, in, out); },
      [&](void *c, void **w) { return all_reduce_async_fn(c, n, dtype, o, in, out, w); });
}

// A broadcast is in place: its input is first copied to its output where XLA gave them apart.
ffi::Error BroadcastOn(void *stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                       uint64_t comm, int64_t root) {
  uint32_t dtype;
  if (ffi::Error e = dtype_of("broadcast", x, &dtype); e.failure()) return e;
  if (root < 0) return ffi::Error::InvalidArgument("tutti broadcast: the root is negative");
  void *out = y->untyped_data();
  if (out != x.untyped_data() && x.size_bytes() > 0) {
    if (stream == nullptr) {
      std::memcpy(out, x.untyped_data(), x.size_bytes());
    } else {
      // The driver XLA loaded (RTLD_NOLOAD: found, never loaded here).
      void *driver = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
      auto copy = driver == nullptr ? nullptr
                                    : reinterpret_cast<cu_memcpy_dtod_async_fn>(
                                          dlsym(driver, "cuMemcpyDtoDAsync_v2"));
      if (driver != nullptr) dlclose(driver);  // XLA's own reference keeps it loaded
      if (copy == nullptr) {
        return ffi::Error::Internal(
            "tutti broadcast: the CUDA driver's cuMemcpyDtoDAsync_v2 was not found in the "
            "process");
      }
      int r = copy(reinterpret_cast<uint64_t>(out), reinterpret_cast<uint64_t>(x.untyped_data()),
                   x.size_bytes(), stream);
      if (r != 0) {
        return ffi::Error::Internal("tutti broadcast: copying the input on the GPU failed "
                                    "(CUDA error " + std::to_string(r) + ")");
      }
    }
  }
  size_t n = x.element_count();
  size_t rt = static_cast<size_t>(root);
  return Run(
      "broadcast", comm, stream, [&](void *c) { return broadcast_fn(c, n, dtype, rt, out); },
      [&](void *c, void **w) { return broadcast_async_fn(c, n, dtype, rt, out, w); });
}

ffi::Error AllGatherOn(void *stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                       uint64_t comm) {
  uint32_t dtype;
  if (ffi::Error e = dtype_of("all_gather", x, &dtype); e.failure()) return e;
  size_t n = x.element_count();
  const void *in = x.untyped_data();
  void *out = y->untyped_data();
  return Run(
      "all_gather", comm, stream, [&](void *c) { return all_gather_fn(c, n, dtype, in, out); },
      [&](void *c, void **w) { return all_gather_async_fn(c, n, dtype, in, out, w); });
}

ffi::Error ReduceScatterOn(void *stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                           uint64_t comm, int32_t op) {
  uint32_t dtype;
  if (ffi::Error e = dtype_of("reduce_scatter", x, &dtype); e.failure()) return e;
  size_t n = y->element_count();
  uint32_t o = static_cast<uint32_t>(op);
  const void *in = x.untyped_data();
  void *out = y->untyped_data();
  return Run(
      "reduce_scatter", comm, stream,
      [&](void *c) { return reduce_scatter_fn(c, n, dtype, o, in, out); },
      [&](void *c, void **w) { return reduce_scatter_async_fn(c, n, dtype, o, in, out, w); });
}

// The handlers, on the host and on XLA's GPU stream.
ffi::Error AllReduce(ffi::Token, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                     ffi::Result<ffi::Token>, uint64_t comm, int32_t op) {
  return AllReduceOn(nullptr, x, y, comm, op);
}
ffi::Error AllReduceGpu(void *stream, ffi::Token, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                        ffi::Result<ffi::Token>, uint64_t comm, int32_t op) {
  return AllReduceOn(stream, x, y, comm, op);
}
ffi::Error Broadcast(ffi::Token, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                     ffi::Result<ffi::Token>, uint64_t comm, int64_t root) {
  return BroadcastOn(nullptr, x, y, comm, root);
}
ffi::Error BroadcastGpu(void *stream, ffi::Token, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                        ffi::Result<ffi::Token>, uint64_t comm, int64_t root) {
  return BroadcastOn(stream, x, y, comm, root);
}
ffi::Error AllGather(ffi::Token, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                     ffi::Result<ffi::Token>, uint64_t comm) {
  return AllGatherOn(nullptr, x, y, comm);
}
ffi::Error AllGatherGpu(void *stream, ffi::Token, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                        ffi::Result<ffi::Token>, uint64_t comm) {
  return AllGatherOn(stream, x, y, comm);
}
ffi::Error ReduceScatter(ffi::Token, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                         ffi::Result<ffi::Token>, uint64_t comm, int32_t op) {
  return ReduceScatterOn(nullptr, x, y, comm, op);
}
ffi::Error ReduceScatterGpu(void *stream, ffi::Token, ffi::AnyBuffer x,
                            ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::Token>, uint64_t comm,
                            int32_t op) {
  return ReduceScatterOn(stream, x, y, comm, op);
}

}  // namespace

extern "C" int tutti_jax_bind(void *all_reduce, void *broadcast, void *all_gather,
                              void *reduce_scatter, void *last_error) {
  if (!all_reduce || !broadcast || !all_gather || !reduce_scatter || !last_error) return 1;
  all_reduce_fn = reinterpret_cast<tutti_all_reduce_fn>(all_reduce);
  broadcast_fn = reinterpret_cast<tutti_broadcast_fn>(broadcast);
  all_gather_fn = reinterpret_cast<tutti_all_gather_fn>(all_gather);
  reduce_scatter_fn = reinterpret_cast<tutti_reduce_scatter_fn>(reduce_scatter);
  last_error_fn = reinterpret_cast<tutti_last_error_fn>(last_error);
  return 0;
}

// The calls on GPU streams: libtutti's stream setters, _async calls and work handles.
extern "C" int tutti_jax_bind_gpu(void *set_stream, void *unset_stream, void *all_reduce,
                                  void *broadcast, void *all_gather, void *reduce_scatter,
                                  void *work_wait, void *work_destroy, void *abort) {
  if (!set_stream || !unset_stream || !all_reduce || !broadcast || !all_gather ||
      !reduce_scatter || !work_wait || !work_destroy || !abort) {
    return 1;
  }
  abort_fn = reinterpret_cast<tutti_comm_abort_fn>(abort);
  set_stream_fn = reinterpret_cast<tutti_set_stream_fn>(set_stream);
  unset_stream_fn = reinterpret_cast<tutti_unset_stream_fn>(unset_stream);
  all_reduce_async_fn = reinterpret_cast<tutti_all_reduce_async_fn>(all_reduce);
  broadcast_async_fn = reinterpret_cast<tutti_broadcast_async_fn>(broadcast);
  all_gather_async_fn = reinterpret_cast<tutti_all_gather_async_fn>(all_gather);
  reduce_scatter_async_fn = reinterpret_cast<tutti_reduce_scatter_async_fn>(reduce_scatter);
  work_wait_fn = reinterpret_cast<tutti_work_wait_fn>(work_wait);
  work_destroy_fn = reinterpret_cast<tutti_work_destroy_fn>(work_destroy);
  return 0;
}

// The communicator of `slot` (tutti.jax gives each communicator one, never reused).
extern "C" void tutti_jax_set_comm(uint64_t slot, void *comm) {
  tutti_glue::slots().Set(slot, comm);
}

// Forget `slot`; wait up to `wait_ms` for its calls in flight; how many are left. The errors of
// its calls on GPU streams that no call reported go with it.
extern "C" int tutti_jax_close_comm(uint64_t slot, int64_t wait_ms) {
  int left = tutti_glue::slots().Close(slot, wait_ms);
  reaper().TakeError(slot);
  return left;
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(tutti_jax_all_reduce, AllReduce,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Token>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Token>()
                                  .Attr<uint64_t>("comm")
                                  .Attr<int32_t>("op"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(tutti_jax_broadcast, Broadcast,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Token>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Token>()
                                  .Attr<uint64_t>("comm")
                                  .Attr<int64_t>("root"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(tutti_jax_all_gather, AllGather,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Token>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Token>()
                                  .Attr<uint64_t>("comm"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(tutti_jax_reduce_scatter, ReduceScatter,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Token>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Token>()
                                  .Attr<uint64_t>("comm")
                                  .Attr<int32_t>("op"));

// The same, on XLA's CUDA platform: the stream XLA runs the program on comes first.
XLA_FFI_DEFINE_HANDLER_SYMBOL(tutti_jax_all_reduce_gpu, AllReduceGpu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<void *>>()
                                  .Arg<ffi::Token>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Token>()
                                  .Attr<uint64_t>("comm")
                                  .Attr<int32_t>("op"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(tutti_jax_broadcast_gpu, BroadcastGpu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<void *>>()
                                  .Arg<ffi::Token>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Token>()
                                  .Attr<uint64_t>("comm")
                                  .Attr<int64_t>("root"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(tutti_jax_all_gather_gpu, AllGatherGpu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<void *>>()
                                  .Arg<ffi::Token>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Token>()
                                  .Attr<uint64_t>("comm"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(tutti_jax_reduce_scatter_gpu, ReduceScatterGpu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<void *>>()
                                  .Arg<ffi::Token>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Token>()
                                  .Attr<uint64_t>("comm")
                                  .Attr<int32_t>("op"));
