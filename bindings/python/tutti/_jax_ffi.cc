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

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

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
}

namespace {

tutti_all_reduce_fn all_reduce_fn = nullptr;
tutti_broadcast_fn broadcast_fn = nullptr;
tutti_all_gather_fn all_gather_fn = nullptr;
tutti_reduce_scatter_fn reduce_scatter_fn = nullptr;
tutti_last_error_fn last_error_fn = nullptr;

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

// The communicator of a slot, in use while this lives.
class Use {
 public:
  explicit Use(uint64_t slot) : slot_(slot), comm_(tutti_glue::slots().Enter(slot)) {}
  ~Use() {
    if (comm_ != nullptr) tutti_glue::slots().Leave(slot_);
  }
  Use(const Use &) = delete;
  Use &operator=(const Use &) = delete;
  void *comm() const { return comm_; }

 private:
  uint64_t slot_;
  void *comm_;
};

ffi::Error closed(const char *what) {
  return ffi::Error(ffi::ErrorCode::kFailedPrecondition, tutti_glue::Closed(what));
}

ffi::Error dtype_of(const char *what, ffi::AnyBuffer x, uint32_t *dtype) {
  if (!tutti_dtype(x.element_type(), dtype)) {
    return ffi::Error::InvalidArgument(std::string("tutti ") + what +
                                       ": this element type is not one tutti reduces");
  }
  return ffi::Error::Success();
}

ffi::Error AllReduce(ffi::Token, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                     ffi::Result<ffi::Token>, uint64_t comm, int32_t op) {
  if (!all_reduce_fn) return unbound();
  uint32_t dtype;
  if (ffi::Error e = dtype_of("all_reduce", x, &dtype); e.failure()) return e;
  Use use(comm);
  if (use.comm() == nullptr) return closed("all_reduce");
  uint32_t r = all_reduce_fn(use.comm(), x.element_count(), dtype,
                             static_cast<uint32_t>(op), x.untyped_data(), y->untyped_data());
  return r == 0 ? ffi::Error::Success() : failed("all_reduce", r);
}

ffi::Error Broadcast(ffi::Token, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                     ffi::Result<ffi::Token>, uint64_t comm, int64_t root) {
  if (!broadcast_fn) return unbound();
  uint32_t dtype;
  if (ffi::Error e = dtype_of("broadcast", x, &dtype); e.failure()) return e;
  if (y->untyped_data() != x.untyped_data()) {
    std::memcpy(y->untyped_data(), x.untyped_data(), x.size_bytes());
  }
  if (root < 0) return ffi::Error::InvalidArgument("tutti broadcast: the root is negative");
  Use use(comm);
  if (use.comm() == nullptr) return closed("broadcast");
  uint32_t r = broadcast_fn(use.comm(), x.element_count(), dtype,
                            static_cast<size_t>(root), y->untyped_data());
  return r == 0 ? ffi::Error::Success() : failed("broadcast", r);
}

ffi::Error AllGather(ffi::Token, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                     ffi::Result<ffi::Token>, uint64_t comm) {
  if (!all_gather_fn) return unbound();
  uint32_t dtype;
  if (ffi::Error e = dtype_of("all_gather", x, &dtype); e.failure()) return e;
  Use use(comm);
  if (use.comm() == nullptr) return closed("all_gather");
  uint32_t r = all_gather_fn(use.comm(), x.element_count(), dtype,
                             x.untyped_data(), y->untyped_data());
  return r == 0 ? ffi::Error::Success() : failed("all_gather", r);
}

ffi::Error ReduceScatter(ffi::Token, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> y,
                         ffi::Result<ffi::Token>, uint64_t comm, int32_t op) {
  if (!reduce_scatter_fn) return unbound();
  uint32_t dtype;
  if (ffi::Error e = dtype_of("reduce_scatter", x, &dtype); e.failure()) return e;
  Use use(comm);
  if (use.comm() == nullptr) return closed("reduce_scatter");
  uint32_t r = reduce_scatter_fn(use.comm(), y->element_count(), dtype,
                                 static_cast<uint32_t>(op), x.untyped_data(), y->untyped_data());
  return r == 0 ? ffi::Error::Success() : failed("reduce_scatter", r);
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

// The communicator of `slot` (tutti.jax gives each communicator one, never reused).
extern "C" void tutti_jax_set_comm(uint64_t slot, void *comm) {
  tutti_glue::slots().Set(slot, comm);
}

// Forget `slot`; wait up to `wait_ms` for its calls in flight; how many are left.
extern "C" int tutti_jax_close_comm(uint64_t slot, int64_t wait_ms) {
  return tutti_glue::slots().Close(slot, wait_ms);
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
