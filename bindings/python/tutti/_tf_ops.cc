// TensorFlow ops that run tutti's collectives (tutti.tensorflow), as graph ops that run inside
// tf.function and Keras' model.fit.
//
// Compiled by tutti.tensorflow on first use (or by `python -m tutti.tensorflow build`) against the
// installed TensorFlow (tf.sysconfig's compile and link flags), into a cache keyed by this source
// and the TensorFlow version. The kernels call libtutti through function pointers that
// tutti.tensorflow hands over (TuttiTfBind) from the library the Python package already loaded,
// so the handles they are given belong to that library: no second copy of libtutti.
//
// Two families:
// - TuttiReplicas*: the replicas of one process (MirroredStrategy's devices), every replica's
//   tensors in one op, reduced by a tutti_replicas group over their host buffers.
// - TuttiAllReduce, TuttiBatchAllReduce, TuttiBroadcast, TuttiAllGather: the processes of a job,
//   one op per process over its tutti_comm.
//
// Every kernel is asynchronous: it checks its inputs, allocates its outputs (forwarding an input
// buffer where TensorFlow allows, so an all-reduce runs in place) and hands the call to a worker
// thread that belongs to the handle. The worker runs calls in the order the kernels were started.
// The job's ops take the communicator's ordering resource as their last input (never read):
// tf.function's automatic control dependencies chain every op that uses one resource in program
// order, also through the function calls and conditionals that capture it, so every rank starts
// its collectives in the order its program states them, as tutti's checked calls ask. A failed
// call is an error naming the collective with libtutti's own message.

#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

#include "_glue.h"

using tensorflow::AsyncOpKernel;
using tensorflow::DataType;
using tensorflow::DataTypeVector;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;
using tensorflow::TensorShape;
using tensorflow::shape_inference::InferenceContext;

extern "C" {
typedef uint32_t (*all_reduce_fn)(void *, size_t, uint32_t, uint32_t, const void *, void *);
typedef uint32_t (*broadcast_fn)(void *, size_t, uint32_t, size_t, void *);
typedef uint32_t (*all_gather_fn)(void *, size_t, uint32_t, const void *, void *);
typedef uint32_t (*all_gather_v_fn)(void *, const size_t *, uint32_t, const void *, void *);
typedef uint32_t (*world_size_fn)(const void *, size_t *);
typedef uint32_t (*abort_fn)(const void *, const char *);
typedef uint32_t (*replicas_all_reduce_fn)(void *, size_t, uint32_t, uint32_t, size_t,
                                           void *const *);
typedef uint32_t (*replicas_reduce_fn)(void *, size_t, uint32_t, uint32_t, size_t,
                                       const void *const *, void *);
typedef size_t (*last_error_fn)(char *, size_t);
}

namespace {

struct Library {
  all_reduce_fn all_reduce = nullptr;
  broadcast_fn broadcast = nullptr;
  all_gather_fn all_gather = nullptr;
  all_gather_v_fn all_gather_v = nullptr;
  world_size_fn world_size = nullptr;
  abort_fn abort = nullptr;
  replicas_all_reduce_fn replicas_all_reduce = nullptr;
  replicas_reduce_fn replicas_reduce = nullptr;
  last_error_fn last_error = nullptr;
};

Library lib;

// The C API's dtype numbers (tutti_dtype).
bool tutti_dtype(DataType t, uint32_t *out) {
  switch (t) {
    case tensorflow::DT_FLOAT: *out = 0; return true;
    case tensorflow::DT_DOUBLE: *out = 1; return true;
    case tensorflow::DT_HALF: *out = 2; return true;
    case tensorflow::DT_BFLOAT16: *out = 3; return true;
    case tensorflow::DT_INT8: *out = 4; return true;
    case tensorflow::DT_UINT8: *out = 5; return true;
    case tensorflow::DT_INT32: *out = 6; return true;
    case tensorflow::DT_UINT32: *out = 7; return true;
    case tensorflow::DT_INT64: *out = 8; return true;
    case tensorflow::DT_UINT64: *out = 9; return true;
    default: return false;
  }
}

// libtutti's message for the calling thread's last failure, with the collective's name.
absl::Status failed(const std::string &what, uint32_t code) {
  return absl::InternalError(tutti_glue::Failure(lib.last_error, what, code));
}

// One thread per communicator or replica group (by address), running the calls handed to it in
// the order they were handed over. Workers live as long as the process (an address may be reused
// by a later communicator, which then shares the worker: calls stay in order, and a process that
// opens many communicators one after another keeps few threads).
class Worker {
 public:
  Worker() { std::thread([this] { Run(); }).detach(); }

  void Push(std::function<void()> work) {
    {
      std::lock_guard<std::mutex> guard(mu_);
      queue_.push_back(std::move(work));
    }
    cv_.notify_one();
  }

 private:
  void Run() {
    for (;;) {
      std::function<void()> work;
      {
        std::unique_lock<std::mutex> guard(mu_);
        cv_.wait(guard, [this] { return !queue_.empty(); });
        work = std::move(queue_.front());
        queue_.pop_front();
      }
      work();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
};

Worker *WorkerFor(const void *handle) {
  static std::mutex mu;
  static auto *workers = new std::unordered_map<const void *, Worker *>();
  std::lock_guard<std::mutex> guard(mu);
  Worker *&w = (*workers)[handle];
  if (w == nullptr) w = new Worker();
  return w;
}

absl::Status Bound() {
  if (lib.all_reduce == nullptr) {
    return absl::FailedPreconditionError("tutti.tensorflow: the ops were not bound to libtutti");
  }
  return absl::OkStatus();
}

absl::Status DtypeOf(const std::string &what, DataType t, uint32_t *out) {
  if (!tutti_dtype(t, out)) {
    return absl::InvalidArgumentError("tutti " + what + ": " + tensorflow::DataTypeString(t) +
                                      " is not a type tutti reduces");
  }
  return absl::OkStatus();
}

// Output `i` holds input `i`'s values: the input's buffer where TensorFlow lets the op reuse it,
// else a copy.
absl::Status InPlaceOutput(OpKernelContext *ctx, int i, Tensor **out) {
  const Tensor &in = ctx->input(i);
  int forwarded = -1;
  TF_RETURN_IF_ERROR(ctx->forward_input_or_allocate_output({i}, i, in.shape(), out, &forwarded));
  if (forwarded < 0 && in.TotalBytes() > 0) {
    std::memcpy((*out)->data(), in.data(), in.TotalBytes());
  }
  return absl::OkStatus();
}

// ----- the replicas of one process -----

class ReplicasAllReduceOp : public AsyncOpKernel {
 public:
  explicit ReplicasAllReduceOp(OpKernelConstruction *c) : AsyncOpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("replicas", &replicas_));
    OP_REQUIRES_OK(c, c->GetAttr("num_replicas", &n_));
    OP_REQUIRES_OK(c, c->GetAttr("reduce_op", &op_));
  }

  void ComputeAsync(OpKernelContext *ctx, DoneCallback done) override {
    OP_REQUIRES_OK_ASYNC(ctx, Bound(), done);
    const int total = ctx->num_inputs();
    OP_REQUIRES_ASYNC(ctx, n_ > 0 && total % n_ == 0,
                      absl::InvalidArgumentError(
                          "tutti all_reduce across replicas: " + std::to_string(total) +
                          " tensors are not the same number for each of " +
                          std::to_string(n_) + " replicas"),
                      done);
    const int k = total / n_;
    std::vector<uint32_t> dtypes(k);
    std::vector<Tensor *> outs(total);
    for (int j = 0; j < k; ++j) {
      OP_REQUIRES_OK_ASYNC(
          ctx, DtypeOf("all_reduce across replicas", ctx->input(j).dtype(), &dtypes[j]), done);
      for (int r = 1; r < n_; ++r) {
        const Tensor &a = ctx->input(j), &b = ctx->input(r * k + j);
        OP_REQUIRES_ASYNC(
            ctx, a.dtype() == b.dtype() && a.NumElements() == b.NumElements(),
            absl::InvalidArgumentError(
                "tutti all_reduce across replicas: value " + std::to_string(j) + " of replica " +
                std::to_string(r) + " is " + tensorflow::DataTypeString(b.dtype()) + " " +
                b.shape().DebugString() + ", replica 0's is " +
                tensorflow::DataTypeString(a.dtype()) + " " + a.shape().DebugString()),
            done);
      }
    }
    for (int i = 0; i < total; ++i) {
      OP_REQUIRES_OK_ASYNC(ctx, InPlaceOutput(ctx, i, &outs[i]), done);
    }
    void *replicas = reinterpret_cast<void *>(replicas_);
    const int n = n_, op = op_;
    WorkerFor(replicas)->Push([ctx, done, outs, dtypes, replicas, n, k, op] {
      std::vector<void *> buffers(n);
      for (int j = 0; j < k; ++j) {
        for (int r = 0; r < n; ++r) buffers[r] = outs[r * k + j]->data();
        uint32_t code = lib.replicas_all_reduce(replicas, outs[j]->NumElements(), dtypes[j],
                                                static_cast<uint32_t>(op), n, buffers.data());
        if (code != 0) {
          ctx->SetStatus(failed("all_reduce across replicas", code));
          break;
        }
      }
      done();
    });
  }

 private:
  int64_t replicas_ = 0;
  int n_ = 0;
  int op_ = 0;
};

class ReplicasReduceOp : public AsyncOpKernel {
 public:
  explicit ReplicasReduceOp(OpKernelConstruction *c) : AsyncOpKernel(c) {
    OP_REQUIRES_OK(c, c->GetAttr("replicas", &replicas_));
    OP_REQUIRES_OK(c, c->GetAttr("reduce_op", &op_));
  }

  void ComputeAsync(OpKernelContext *ctx, DoneCallback done) override {
    OP_REQUIRES_OK_ASYNC(ctx, Bound(), done);
    const int n = ctx->num_inputs();
    uint32_t dtype;
    OP_REQUIRES_OK_ASYNC(ctx, DtypeOf("reduce across replicas", ctx->input(0).dtype(), &dtype),
                         done);
    for (int r = 1; r < n; ++r) {
      OP_REQUIRES_ASYNC(
          ctx, ctx->input(r).NumElements() == ctx->input(0).NumElements(),
          absl::InvalidArgumentError("tutti reduce across replicas: replica " +
                                     std::to_string(r) + "'s value is " +
                                     ctx->input(r).shape().DebugString() + ", replica 0's is " +
                                     ctx->input(0).shape().DebugString()),
          done);
    }
    Tensor *out = nullptr;
    OP_REQUIRES_OK_ASYNC(ctx, ctx->allocate_output(0, ctx->input(0).shape(), &out), done);
    std::vector<const void *> inputs(n);
    for (int r = 0; r < n; ++r) inputs[r] = ctx->input(r).data();
    void *replicas = reinterpret_cast<void *>(replicas_);
    const int op = op_;
    WorkerFor(replicas)->Push([ctx, done, out, inputs, replicas, n, dtype, op] {
      uint32_t code = lib.replicas_reduce(replicas, out->NumElements(), dtype,
                                          static_cast<uint32_t>(op), n, inputs.data(),
                                          out->data());
      if (code != 0) ctx->SetStatus(failed("reduce across replicas", code));
      done();
    });
  }

 private:
  int64_t replicas_ = 0;
  int op_ = 0;
};

// ----- the processes of a job -----

// TuttiAllReduce (one tensor) and TuttiBatchAllReduce (a list): each tensor in place, in order.
class AllReduceOp : public AsyncOpKernel {
 public:
  explicit AllReduceOp(OpKernelConstruction *c) : AsyncOpKernel(c) {
    int64_t slot = 0;
    OP_REQUIRES_OK(c, c->GetAttr("comm", &slot));
    slot_ = static_cast<uint64_t>(slot);
    OP_REQUIRES_OK(c, c->GetAttr("reduce_op", &op_));
  }

  void ComputeAsync(OpKernelContext *ctx, DoneCallback done) override {
    OP_REQUIRES_OK_ASYNC(ctx, Bound(), done);
    const int k = ctx->num_inputs() - 1;  // the last: the ordering resource
    std::vector<uint32_t> dtypes(k);
    std::vector<Tensor *> outs(k);
    for (int j = 0; j < k; ++j) {
      OP_REQUIRES_OK_ASYNC(ctx, DtypeOf("all_reduce", ctx->input(j).dtype(), &dtypes[j]), done);
      OP_REQUIRES_OK_ASYNC(ctx, InPlaceOutput(ctx, j, &outs[j]), done);
    }
    void *comm = tutti_glue::slots().Enter(slot_);
    OP_REQUIRES_ASYNC(ctx, comm != nullptr,
                      absl::FailedPreconditionError(tutti_glue::Closed("all_reduce")), done);
    const int op = op_;
    const uint64_t slot = slot_;
    WorkerFor(comm)->Push([ctx, done, outs, dtypes, comm, k, op, slot] {
      for (int j = 0; j < k; ++j) {
        void *data = outs[j]->data();
        uint32_t code = lib.all_reduce(comm, outs[j]->NumElements(), dtypes[j],
                                       static_cast<uint32_t>(op), data, data);
        if (code != 0) {
          ctx->SetStatus(failed("all_reduce", code));
          break;
        }
      }
      tutti_glue::slots().Leave(slot);
      done();
    });
  }

 private:
  uint64_t slot_ = 0;  // the communicator's slot (tutti_glue::Slots)
  int op_ = 0;
};

class BroadcastOp : public AsyncOpKernel {
 public:
  explicit BroadcastOp(OpKernelConstruction *c) : AsyncOpKernel(c) {
    int64_t slot = 0;
    OP_REQUIRES_OK(c, c->GetAttr("comm", &slot));
    slot_ = static_cast<uint64_t>(slot);
    OP_REQUIRES_OK(c, c->GetAttr("root", &root_));
  }

  void ComputeAsync(OpKernelContext *ctx, DoneCallback done) override {
    OP_REQUIRES_OK_ASYNC(ctx, Bound(), done);
    const int k = ctx->num_inputs() - 1;  // the last: the ordering resource
    std::vector<uint32_t> dtypes(k);
    std::vector<Tensor *> outs(k);
    for (int j = 0; j < k; ++j) {
      OP_REQUIRES_OK_ASYNC(ctx, DtypeOf("broadcast", ctx->input(j).dtype(), &dtypes[j]), done);
      OP_REQUIRES_OK_ASYNC(ctx, InPlaceOutput(ctx, j, &outs[j]), done);
    }
    void *comm = tutti_glue::slots().Enter(slot_);
    OP_REQUIRES_ASYNC(ctx, comm != nullptr,
                      absl::FailedPreconditionError(tutti_glue::Closed("broadcast")), done);
    const size_t root = static_cast<size_t>(root_);
    const uint64_t slot = slot_;
    WorkerFor(comm)->Push([ctx, done, outs, dtypes, comm, k, root, slot] {
      for (int j = 0; j < k; ++j) {
        uint32_t code = lib.broadcast(comm, outs[j]->NumElements(), dtypes[j], root,
                                      outs[j]->data());
        if (code != 0) {
          ctx->SetStatus(failed("broadcast", code));
          break;
        }
      }
      tutti_glue::slots().Leave(slot);
      done();
    });
  }

 private:
  uint64_t slot_ = 0;  // the communicator's slot (tutti_glue::Slots)
  int64_t root_ = 0;
};

// Every rank's tensor concatenated along the first axis, in rank order; the first dimension may
// differ between ranks (the rest may not). The ranks first all-gather their shapes, so the op
// allocates its output once the call is under way: it runs whole on the worker.
class AllGatherOp : public AsyncOpKernel {
 public:
  explicit AllGatherOp(OpKernelConstruction *c) : AsyncOpKernel(c) {
    int64_t slot = 0;
    OP_REQUIRES_OK(c, c->GetAttr("comm", &slot));
    slot_ = static_cast<uint64_t>(slot);
  }

  void ComputeAsync(OpKernelContext *ctx, DoneCallback done) override {
    OP_REQUIRES_OK_ASYNC(ctx, Bound(), done);
    const Tensor &in = ctx->input(0);
    uint32_t dtype;
    OP_REQUIRES_OK_ASYNC(ctx, DtypeOf("all_gather", in.dtype(), &dtype), done);
    OP_REQUIRES_ASYNC(ctx, in.dims() >= 1,
                      absl::InvalidArgumentError(
                          "tutti all_gather: a scalar has no first axis to concatenate along"),
                      done);
    void *comm = tutti_glue::slots().Enter(slot_);
    OP_REQUIRES_ASYNC(ctx, comm != nullptr,
                      absl::FailedPreconditionError(tutti_glue::Closed("all_gather")), done);
    const uint64_t slot = slot_;
    WorkerFor(comm)->Push([ctx, done, comm, dtype, slot] {
      size_t world = 0;
      uint32_t code = lib.world_size(comm, &world);
      if (code != 0) {
        ctx->SetStatus(failed("all_gather", code));
      } else {
        Gather(ctx, comm, world, dtype);
      }
      tutti_glue::slots().Leave(slot);
      done();
    });
  }

 private:
  static void Gather(OpKernelContext *ctx, void *comm, size_t world, uint32_t dtype) {
    const Tensor &in = ctx->input(0);
    const int dims = in.dims();
    // Every rank's number of dimensions and first dimension, then (alike everywhere) the rest.
    std::vector<uint64_t> mine = {static_cast<uint64_t>(dims),
                                  static_cast<uint64_t>(in.dim_size(0))};
    std::vector<uint64_t> heads(2 * world);
    uint32_t code = lib.all_gather(comm, 2, 9, mine.data(), heads.data());
    if (code != 0) return ctx->SetStatus(failed("all_gather", code));
    for (size_t r = 0; r < world; ++r) {
      if (heads[2 * r] != static_cast<uint64_t>(dims)) {
        return ctx->SetStatus(Refuse("rank " + std::to_string(r) + "'s tensor has " +
                                               std::to_string(heads[2 * r]) +
                                               " dimensions, this rank's " +
                                               std::to_string(dims)));
      }
    }
    std::vector<uint64_t> rest(dims - 1), all_rest((dims - 1) * world);
    for (int d = 1; d < dims; ++d) rest[d - 1] = static_cast<uint64_t>(in.dim_size(d));
    if (dims > 1) {
      code = lib.all_gather(comm, dims - 1, 9, rest.data(), all_rest.data());
      if (code != 0) return ctx->SetStatus(failed("all_gather", code));
    }
    for (size_t r = 0; r < world; ++r) {
      for (int d = 1; d < dims; ++d) {
        if (all_rest[r * (dims - 1) + d - 1] != rest[d - 1]) {
          return ctx->SetStatus(Refuse(
              "rank " + std::to_string(r) + "'s dimension " + std::to_string(d) + " is " +
                        std::to_string(all_rest[r * (dims - 1) + d - 1]) + ", this rank's " +
                        std::to_string(rest[d - 1]) +
                        " (only the first dimension may differ between ranks)"));
        }
      }
    }
    const uint64_t row = in.dim_size(0) > 0 ? in.NumElements() / in.dim_size(0) : [&] {
      uint64_t n = 1;
      for (uint64_t v : rest) n *= v;
      return n;
    }();
    std::vector<size_t> counts(world);
    int64_t total = 0;
    for (size_t r = 0; r < world; ++r) {
      counts[r] = heads[2 * r + 1] * row;
      total += static_cast<int64_t>(heads[2 * r + 1]);
    }
    TensorShape shape = in.shape();
    shape.set_dim(0, total);
    Tensor *out = nullptr;
    absl::Status s = ctx->allocate_output(0, shape, &out);
    if (!s.ok()) {
      // Every other rank is in the all_gather_v now: abort, so that they fail at once.
      lib.abort(comm, "tutti all_gather: a rank could not allocate its output");
      return ctx->SetStatus(s);
    }
    code = lib.all_gather_v(comm, counts.data(), dtype, in.data(), out->data());
    if (code != 0) ctx->SetStatus(failed("all_gather", code));
  }

  // A disagreement every rank finds alike, after the same calls: no rank waits on another.
  static absl::Status Refuse(const std::string &why) {
    return absl::InvalidArgumentError("tutti all_gather: " + why);
  }

  uint64_t slot_ = 0;  // the communicator's slot (tutti_glue::Slots)
};

}  // namespace

extern "C" int TuttiTfBind(void *all_reduce, void *broadcast, void *all_gather,
                           void *all_gather_v, void *world_size, void *abort,
                           void *replicas_all_reduce, void *replicas_reduce, void *last_error) {
  if (!all_reduce || !broadcast || !all_gather || !all_gather_v || !world_size || !abort ||
      !replicas_all_reduce || !replicas_reduce || !last_error) {
    return 1;
  }
  lib.abort = reinterpret_cast<abort_fn>(abort);
  lib.broadcast = reinterpret_cast<broadcast_fn>(broadcast);
  lib.all_gather = reinterpret_cast<all_gather_fn>(all_gather);
  lib.all_gather_v = reinterpret_cast<all_gather_v_fn>(all_gather_v);
  lib.world_size = reinterpret_cast<world_size_fn>(world_size);
  lib.replicas_all_reduce = reinterpret_cast<replicas_all_reduce_fn>(replicas_all_reduce);
  lib.replicas_reduce = reinterpret_cast<replicas_reduce_fn>(replicas_reduce);
  lib.last_error = reinterpret_cast<last_error_fn>(last_error);
  lib.all_reduce = reinterpret_cast<all_reduce_fn>(all_reduce);  // last: Bound() checks it
  return 0;
}

// The communicator of `slot` (tutti.tensorflow gives each communicator one, never reused).
extern "C" void TuttiTfSetComm(uint64_t slot, void *comm) { tutti_glue::slots().Set(slot, comm); }

// Forget `slot`; wait up to `wait_ms` for its calls in flight; how many are left.
extern "C" int TuttiTfCloseComm(uint64_t slot, int64_t wait_ms) {
  return tutti_glue::slots().Close(slot, wait_ms);
}

#define TUTTI_TYPES "{float, double, half, bfloat16, int8, uint8, int32, uint32, int64, uint64}"

static absl::Status SameShapes(InferenceContext *c) {
  for (int i = 0; i < c->num_outputs(); ++i) c->set_output(i, c->input(i));
  return absl::OkStatus();
}

REGISTER_OP("TuttiReplicasAllReduce")
    .Input("tensors: T")
    .Output("reduced: T")
    .Attr("T: list(" TUTTI_TYPES ")")
    .Attr("replicas: int")
    .Attr("num_replicas: int >= 1")
    .Attr("reduce_op: int")
    .SetIsStateful()
    .SetShapeFn(SameShapes);

REGISTER_OP("TuttiReplicasReduce")
    .Input("tensors: N * T")
    .Output("reduced: T")
    .Attr("T: " TUTTI_TYPES)
    .Attr("N: int >= 1")
    .Attr("replicas: int")
    .Attr("reduce_op: int")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext *c) {
      c->set_output(0, c->input(0));
      return absl::OkStatus();
    });

REGISTER_OP("TuttiAllReduce")
    .Input("tensor: T")
    .Input("order: resource")
    .Output("reduced: T")
    .Attr("T: " TUTTI_TYPES)
    .Attr("comm: int")
    .Attr("reduce_op: int")
    .SetIsStateful()
    .SetShapeFn(SameShapes);

REGISTER_OP("TuttiBatchAllReduce")
    .Input("tensors: T")
    .Input("order: resource")
    .Output("reduced: T")
    .Attr("T: list(" TUTTI_TYPES ")")
    .Attr("comm: int")
    .Attr("reduce_op: int")
    .SetIsStateful()
    .SetShapeFn(SameShapes);

REGISTER_OP("TuttiBroadcast")
    .Input("tensors: T")
    .Input("order: resource")
    .Output("broadcast: T")
    .Attr("T: list(" TUTTI_TYPES ")")
    .Attr("comm: int")
    .Attr("root: int >= 0")
    .SetIsStateful()
    .SetShapeFn(SameShapes);

REGISTER_OP("TuttiAllGather")
    .Input("tensor: T")
    .Input("order: resource")
    .Output("gathered: T")
    .Attr("T: " TUTTI_TYPES)
    .Attr("comm: int")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext *c) {
      tensorflow::shape_inference::ShapeHandle out;
      TF_RETURN_IF_ERROR(c->WithRankAtLeast(c->input(0), 1, &out));
      TF_RETURN_IF_ERROR(c->ReplaceDim(out, 0, c->UnknownDim(), &out));
      c->set_output(0, out);
      return absl::OkStatus();
    });

REGISTER_KERNEL_BUILDER(Name("TuttiReplicasAllReduce").Device(tensorflow::DEVICE_CPU),
                        ReplicasAllReduceOp);
REGISTER_KERNEL_BUILDER(Name("TuttiReplicasReduce").Device(tensorflow::DEVICE_CPU),
                        ReplicasReduceOp);
REGISTER_KERNEL_BUILDER(Name("TuttiAllReduce").Device(tensorflow::DEVICE_CPU), AllReduceOp);
REGISTER_KERNEL_BUILDER(Name("TuttiBatchAllReduce").Device(tensorflow::DEVICE_CPU), AllReduceOp);
REGISTER_KERNEL_BUILDER(Name("TuttiBroadcast").Device(tensorflow::DEVICE_CPU), BroadcastOp);
REGISTER_KERNEL_BUILDER(Name("TuttiAllGather").Device(tensorflow::DEVICE_CPU), AllGatherOp);
