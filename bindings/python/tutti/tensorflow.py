"""tutti's collectives as TensorFlow ops: cross-device ops for ``tf.distribute.MirroredStrategy``,
and all-reduce, all-gather and broadcast across the processes of a job for Keras and custom
training loops.

One process, several devices (``MirroredStrategy``)::

    import tensorflow as tf, tutti.tensorflow as ttf

    strategy = tf.distribute.MirroredStrategy(cross_device_ops=ttf.TuttiAllReduce())
    with strategy.scope():
        model = ...; model.compile(...)
    model.fit(dataset, epochs=3)

Several processes (``tutti launch -n 2 -- python train.py``, torchrun, ``TF_CONFIG``)::

    model.compile(optimizer=ttf.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss=...)
    model.fit(x_shard, y_shard, callbacks=[ttf.BroadcastVariablesCallback(root=0)])

Every collective is a TensorFlow op (a custom-op library, see below), so it runs inside
``tf.function`` and ``model.fit``. The ops are asynchronous kernels: each hands its call to a
thread that belongs to its communicator (or replica group), which runs the calls in the order
the kernels started. Each op of a communicator also takes the communicator's ordering resource
(a handle it never reads), so ``tf.function``'s automatic control dependencies start them in
program order, through nested functions and conditionals too: every rank issues the same
collectives in the same order, as tutti's checked calls require (a rank whose program differs
gets tutti's mismatch error naming both ranks). An op's output reuses its input's buffer where
TensorFlow allows, so an all-reduce runs in place, without a copy.

Across processes, ``comm=None`` is the job's communicator, joined once from the environment
(``tutti.from_env()``: ``tutti launch``, torchrun, mpirun, srun or ``TF_CONFIG``). Why not
``MultiWorkerMirroredStrategy``: its collectives are TensorFlow's own (RING or NCCL) and cannot
be replaced, its workers all build one cluster through ``TF_CONFIG`` and TensorFlow's gRPC
server, and a lost worker stops every worker with no hint of which. These ops need neither: each
process is an ordinary single-device TensorFlow program, the gradients are averaged by one tutti
call per step, and a lost peer is an error naming its rank within the communicator's timeout.

The op library is compiled against the installed TensorFlow (``tf.sysconfig``'s compile and
link flags) with the system C++ compiler (``CXX``, else ``c++``), keyed by its source and
TensorFlow's version and flags: TensorFlow's C++ ABI changes between versions, so a library built
against one TensorFlow does not load in another. The package's install compiles it where
TensorFlow is importable there (``pip install --no-build-isolation``, as Horovod's ops are built;
``TUTTI_WITH_TENSORFLOW=1`` makes a failure fail the install, ``=0`` skips it); where that
library's key no longer matches (TensorFlow changed since) or there is none, it is compiled on
first use into ``~/.cache/tutti/tf-ops`` (``TUTTI_TF_CACHE``). ``python -m tutti.tensorflow
build`` compiles it ahead of time (for an image or a machine whose jobs should not compile).

On CPU: the ops have CPU kernels, and the replicas of ``TuttiAllReduce`` live in host memory
(TensorFlow's CPU devices, including the logical devices that
``tf.config.set_logical_device_configuration`` makes).
"""

import pathlib
import sys
import threading


import tensorflow as tf

import tutti
from tutti import _ext

from tensorflow.python.distribute import cross_device_ops as _cdo
from tensorflow.python.distribute import cross_device_utils as _cdu
from tensorflow.python.distribute import distribute_utils as _du
from tensorflow.python.distribute import values as _values
from tensorflow.python.util import nest as _nest

__all__ = [
    "TuttiAllReduce",
    "all_reduce",
    "grouped_all_reduce",
    "all_gather",
    "broadcast",
    "broadcast_variables",
    "DistributedGradientTape",
    "DistributedOptimizer",
    "BroadcastVariablesCallback",
    "default_comm",
    "build",
]

_SOURCE = pathlib.Path(__file__).with_name("_tf_ops.cc")
_lock = threading.Lock()
_module = None  # the loaded op library's Python wrappers


def _flags():
    compile_flags = list(tf.sysconfig.get_compile_flags())
    link_flags = list(tf.sysconfig.get_link_flags())
    # Where libtensorflow_framework lives, so the library loads wherever it is opened from.
    link_flags += [f"-Wl,-rpath,{f[2:]}" for f in link_flags if f.startswith("-L")]
    return ["-Wno-deprecated-declarations", *compile_flags], link_flags


def build(into=None):
    """Compile the op library for the installed TensorFlow (if not built yet); its path. ``into``
    (a directory): compile it there, as the package's install does."""
    flags, link_flags = _flags()
    return _ext.compile_library(
        "tutti.tensorflow", _SOURCE, "tutti_tf_ops", "TUTTI_TF_CACHE", "tf-ops",
        flags, link_flags, key_extra=tf.__version__.encode(), into=into,
    )


def _ops():
    """The op library: compiled, loaded, bound to the loaded libtutti, once."""
    global _module
    with _lock:
        if _module is not None:
            return _module
        import ctypes

        path = str(build())
        module = tf.load_op_library(path)
        glue = ctypes.CDLL(path)
        lib = tutti._library()
        addr = _ext.function_address
        glue.TuttiTfBind.argtypes = [ctypes.c_void_p] * 9
        glue.TuttiTfBind.restype = ctypes.c_int
        if glue.TuttiTfBind(
            addr(lib.tutti_all_reduce),
            addr(lib.tutti_broadcast),
            addr(lib.tutti_all_gather),
            addr(lib.tutti_all_gather_v),
            addr(lib.tutti_comm_world_size),
            addr(lib.tutti_comm_abort),
            addr(lib.tutti_replicas_all_reduce),
            addr(lib.tutti_replicas_reduce),
            addr(lib.tutti_last_error),
        ) != 0:
            raise RuntimeError("tutti.tensorflow: binding the ops to libtutti failed")
        _ext.add_glue(glue.TuttiTfSetComm, glue.TuttiTfCloseComm)
        _module = module
        return module


def default_comm():
    """The job's communicator (``tutti.from_env()``), joined on first use and kept open."""
    return _ext.default_comm()


_orders = {}  # communicator slot -> its ordering resource


def _comm(comm):
    """The communicator's slot (tutti/_ext.py) and its ordering resource: a resource handle that
    every op of the communicator takes (and never reads), so that tf.function's automatic control
    dependencies run them in program order, through nested functions and conditionals too."""
    _ops()  # the glue knows every slot once loaded
    _, h = _ext.handle(comm, "tutti.tensorflow")
    with _lock:
        order = _orders.get(h)
        if order is None:
            with tf.init_scope():
                order = tf.raw_ops.VarHandleOp(dtype=tf.int32, shape=[], shared_name=f"tutti_order_{h}")
            _orders[h] = order
    return h, order


def _op(op):
    """tf.distribute.ReduceOp, a tutti op name or the C API's number: the C API's number."""
    if isinstance(op, int) and not isinstance(op, bool) and op in tutti.OPS.values():
        return op
    if isinstance(op, tf.distribute.ReduceOp):
        op = op.value
    return tutti._op(op)


def _supported(dtype):
    return tf.as_dtype(dtype).name in tutti.DTYPES


def _check_dtype(x, what, op=None):
    dtype = tf.as_dtype(x.dtype)
    _ext.check_dtype(dtype.name, dtype.is_integer, f"tutti.tensorflow.{what}", op)


# ----- several processes: the job's communicator -----


def all_reduce(tensor, op="sum", comm=None, name=None):
    """Every rank's ``tensor`` combined element by element with ``op`` ("sum", "avg"/"mean",
    "prod", "min", "max", on integers "band", "bor", "bxor", or a ``tf.distribute.ReduceOp``),
    on every rank. Differentiable for sum and mean (the gradient is the same all-reduce of the
    incoming gradients, as Horovod's)."""
    code = _op(op)
    h, order = _comm(comm)
    tensor = tf.convert_to_tensor(tensor)
    _check_dtype(tensor, "all_reduce", code)
    return _ops().tutti_all_reduce(tensor, order, comm=h, reduce_op=code, name=name)


def grouped_all_reduce(tensors, op="sum", comm=None, name=None):
    """``all_reduce`` of every tensor in the list, as one op (one call per tensor, in order)."""
    code = _op(op)
    h, order = _comm(comm)
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if not tensors:
        return []
    for t in tensors:
        _check_dtype(t, "grouped_all_reduce", code)
    return _ops().tutti_batch_all_reduce(tensors, order, comm=h, reduce_op=code, name=name)


def all_gather(tensor, comm=None, name=None):
    """Every rank's ``tensor`` concatenated along the first axis, in rank order. The first
    dimension may differ between ranks; the others may not (an error naming the rank)."""
    h, order = _comm(comm)
    tensor = tf.convert_to_tensor(tensor)
    _check_dtype(tensor, "all_gather")
    if tensor.shape.rank == 0:
        raise ValueError("tutti.tensorflow.all_gather: a scalar has no first axis to concatenate along")
    return _ops().tutti_all_gather(tensor, order, comm=h, name=name)


def broadcast(tensor, root=0, comm=None, name=None):
    """The ``root`` rank's ``tensor`` on every rank."""
    _check_root(root, comm, "broadcast")
    h, order = _comm(comm)
    tensor = tf.convert_to_tensor(tensor)
    _check_dtype(tensor, "broadcast")
    return _ops().tutti_broadcast([tensor], order, comm=h, root=int(root), name=name)[0]


def broadcast_variables(variables, root=0, comm=None):
    """Assign the ``root`` rank's value to each variable on every rank (one op for them all).
    Variables of a type tutti does not carry (strings, booleans) are left as they are."""
    _check_root(root, comm, "broadcast_variables")
    h, order = _comm(comm)
    variables = [v for v in variables if _supported(v.dtype)]
    if not variables:
        return
    values = _ops().tutti_broadcast([tf.convert_to_tensor(v) for v in variables], order, comm=h, root=int(root))
    for v, x in zip(variables, values):
        v.assign(x)


def _check_root(root, comm, what):
    c, _ = _ext.handle(comm, "tutti.tensorflow")
    if not 0 <= int(root) < c.world_size:
        raise ValueError(f"tutti.tensorflow.{what}: root {root} is out of range for a world of {c.world_size} ranks")


@tf.RegisterGradient("TuttiAllReduce")
def _all_reduce_grad(op, grad):
    code = op.get_attr("reduce_op")
    if code not in (tutti.OPS["sum"], tutti.OPS["mean"]):
        raise LookupError("tutti.tensorflow.all_reduce is differentiable only with op sum or mean")
    # The ordering resource has no gradient.
    h = op.get_attr("comm")
    order = _orders.get(h, op.inputs[1])
    return _ops().tutti_all_reduce(grad, order, comm=h, reduce_op=code), None


def _reduce_gradients(grads, op, comm):
    """Gradients (None, dense or IndexedSlices) with every dense one all-reduced by one op.
    IndexedSlices are made dense first: the ranks' indices differ, a sum of dense tensors does
    not."""
    grads = [None if g is None else tf.convert_to_tensor(g) for g in grads]
    at = [i for i, g in enumerate(grads) if g is not None]
    if not at:
        return grads
    reduced = grouped_all_reduce([grads[i] for i in at], op=op, comm=comm)
    out = list(grads)
    for i, r in zip(at, reduced):
        out[i] = r
    return out


class DistributedGradientTape:
    """A ``tf.GradientTape`` whose ``gradient`` averages (``op="mean"``) or sums the gradients
    across the ranks of the job, in one op: every rank applies the same gradients."""

    def __init__(self, tape, op="mean", comm=None):
        self._tape = tape
        self._op = _op(op)
        self._comm = comm

    def gradient(self, target, sources, output_gradients=None, unconnected_gradients=tf.UnconnectedGradients.NONE):
        grads = self._tape.gradient(target, sources, output_gradients, unconnected_gradients)
        flat = _nest.flatten(grads, expand_composites=False)
        return _nest.pack_sequence_as(grads, _reduce_gradients(flat, self._op, self._comm))

    def __enter__(self):
        self._tape.__enter__()
        return self

    def __exit__(self, *exc):
        return self._tape.__exit__(*exc)

    def __getattr__(self, name):
        return getattr(self._tape, name)


def DistributedOptimizer(optimizer, op="mean", comm=None):
    """A Keras optimizer like ``optimizer`` (a new one, of its class and configuration; a name
    such as ``"sgd"`` is Keras's) that averages (``op="mean"``) or sums the gradients across the
    ranks of the job before it applies them: one op per step, inside ``model.fit``'s
    ``tf.function``. Under the ``mixed_float16`` policy the optimizer is a
    ``LossScaleOptimizer`` first, so the ranks reduce the scaled gradients before any of them
    decides to skip a step: every rank sees the same gradients and decides alike. Pass
    ``jit_compile=False`` to ``model.compile`` where Keras would compile the step with XLA (on
    GPUs): XLA cannot compile a custom op."""
    import keras

    code = _op(op)
    optimizer = keras.optimizers.get(optimizer)
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(
            "tutti.tensorflow.DistributedOptimizer takes a Keras 3 optimizer, not "
            f"{type(optimizer).__module__}.{type(optimizer).__name__}"
        )
    scaled = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
    if keras.mixed_precision.global_policy().name == "mixed_float16" and not scaled:
        # What model.compile would do, done first: the all-reduce then runs before the
        # loss-scale optimizer's check of the gradients, not inside the branch it picks.
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    base = type(optimizer)

    def apply(self, grads, trainable_variables=None):
        return base.apply(self, _reduce_gradients(list(grads), code, comm), trainable_variables)

    cls = type(base.__name__, (base,), {"apply": apply, "__module__": base.__module__})
    return cls.from_config(optimizer.get_config())


def _seed_state(v):
    """Whether ``v`` is a Keras random seed generator's state."""
    return "seed_generator_state" in (getattr(v, "path", None) or getattr(v, "name", ""))


def _keras_callback():
    try:
        import keras

        return keras.callbacks.Callback
    except ImportError:  # pragma: no cover - TensorFlow without Keras
        return tf.keras.callbacks.Callback


class BroadcastVariablesCallback(_keras_callback()):
    """A Keras callback that starts every rank from the ``root`` rank's weights: the model's and
    the optimizer's variables are broadcast when training begins (and the optimizer's again
    after the first batch, where Keras builds them only then). The states of the model's random
    seed generators (dropout, noise layers) are left to each rank, so that ranks do not all draw
    the same masks."""

    def __init__(self, root=0, comm=None):
        super().__init__()
        self._root = root
        self._comm = comm
        self._optimizer_done = False

    def _optimizer_variables(self):
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is None or not getattr(optimizer, "built", True):
            return None
        return list(optimizer.variables)

    def on_train_begin(self, logs=None):
        variables = [v for v in self.model.variables if not _seed_state(v)]
        extra = self._optimizer_variables()
        if extra is not None:
            variables += extra
            self._optimizer_done = True
        broadcast_variables(variables, self._root, self._comm)

    def on_train_batch_end(self, batch, logs=None):
        if not self._optimizer_done:
            extra = self._optimizer_variables() or []
            broadcast_variables(extra, self._root, self._comm)
            self._optimizer_done = True


# ----- one process, several devices: MirroredStrategy's cross-device ops -----


def _reduce_op_name(reduce_op):
    if reduce_op == tf.distribute.ReduceOp.SUM:
        return "sum"
    if reduce_op == tf.distribute.ReduceOp.MEAN:
        return "mean"
    raise ValueError(f"reduce_op must be tf.distribute.ReduceOp.SUM or MEAN, not {reduce_op!r}")


class TuttiAllReduce(_cdo.CrossDeviceOps):
    """``tf.distribute.CrossDeviceOps`` that all-reduce the replicas' values with tutti::

        tf.distribute.MirroredStrategy(cross_device_ops=tutti.tensorflow.TuttiAllReduce())

    ``algorithm``: any tutti algorithm by name ("auto", "direct", "ring", "hierarchical-copy[:N]",
    "reduce-to-one[:ROOT]", "recursive-doubling", "rabenseifner"). ``num_packs``: as TensorFlow's
    ``NcclAllReduce``, the values of a batch are concatenated into this many packs before they
    are reduced (0: each value on its own), except values of ``pack_limit`` bytes (1 MiB) or
    more, which are reduced in place. ``timeout``: seconds a reduction may wait.

    Every replica's values go to one op, which reduces them in place in their host buffers
    through a tutti replica group (threads of this process, one per replica). A reduction to
    other devices than the values' (``strategy.reduce`` to the host) is a tutti reduce followed
    by copies. Sparse values (``IndexedSlices``) and types tutti does not carry go through
    TensorFlow's ``ReductionToOneDevice``; ``broadcast`` and ``gather`` are copies and one
    concatenation, as on CPU devices nothing moves fewer bytes.
    """

    #: Values of this many bytes or more are reduced in place, never packed: a concatenation
    #: copies them, which costs more than the call it saves.
    pack_limit = 1 << 20

    def __init__(self, algorithm="auto", num_packs=1, timeout=None):
        tutti._algorithm(algorithm)  # an unknown name is an error here, not at the first step
        if int(num_packs) < 0:
            raise ValueError(f"num_packs must be 0 or more, not {num_packs}")
        super().__init__()
        self._algorithm = algorithm
        self._num_packs = int(num_packs)
        self._timeout = timeout
        self._groups = {}
        self._simple = _cdo.ReductionToOneDevice()

    def __deepcopy__(self, memo):
        # tf.distribute deep-copies strategies' settings; the replica groups are shared.
        return self

    def _group(self, n):
        """The address of this object's replica group of ``n`` replicas, made on first use."""
        with _lock:
            group = self._groups.get(n)
            if group is None:
                group = tutti.Replicas(n, timeout=self._timeout, algorithm=self._algorithm)
                self._groups[n] = group
                _ext.keep(group)
        h = group._h.h
        return int(h.value if hasattr(h, "value") else h)

    def reduce_implementation(self, reduce_op, per_replica_value, destinations, options):
        if isinstance(per_replica_value, _values.DistributedValues) and _cdo._devices_match(
            per_replica_value, destinations, self._canonicalize_devices
        ):
            return self._batch_all_reduce(reduce_op, [per_replica_value])[0]
        values = per_replica_value.values
        if any(isinstance(v, tf.IndexedSlices) or not _supported(v.dtype) for v in values):
            return self._simple.reduce(reduce_op, per_replica_value, destinations, options)
        if _cdo.check_destinations(destinations):
            devices = _cdo.get_devices_from(destinations, self._canonicalize_devices)
        else:
            devices = _cdo.get_devices_from(per_replica_value, self._canonicalize_devices)
        with tf.device(devices[0]):
            reduced = _ops().tutti_replicas_reduce(
                list(values), replicas=self._group(len(values)), reduce_op=tutti._op(_reduce_op_name(reduce_op))
            )
        return self.broadcast(reduced, destinations)

    def batch_reduce_implementation(self, reduce_op, value_destination_pairs, options):
        if _cdo._all_devices_match(value_destination_pairs, self._canonicalize_devices):
            return self._batch_all_reduce(reduce_op, [v for v, _ in value_destination_pairs])
        return [self.reduce_implementation(reduce_op, v, d, options) for v, d in value_destination_pairs]

    def broadcast_implementation(self, tensor, destinations):
        return _cdo.simple_broadcast(tensor, destinations, always_mirrored=True,
                                     canonicalize_devices=self._canonicalize_devices)

    def _gather_implementation(self, per_replica_value, destinations, axis, options):
        return self._simple._gather(per_replica_value, destinations, axis, options)

    def _batch_all_reduce(self, reduce_op, per_replica_values):
        dense, dense_at, sparse, sparse_at = _cdu.split_by_sparsity(per_replica_values)
        # Types tutti does not carry go TensorFlow's way, as sparse values do.
        other = [i for i, v in enumerate(dense) if not _supported(v.values[0].dtype)]
        if other:
            sparse = sparse + [dense[i] for i in other]
            sparse_at = sparse_at + [dense_at[i] for i in other]
            dense = [v for i, v in enumerate(dense) if i not in other]
            dense_at = [x for i, x in enumerate(dense_at) if i not in other]
        dense_results = self._reduce_dense(reduce_op, dense) if dense else []
        sparse_results = self._simple.batch_reduce(reduce_op, zip(sparse, sparse)) if sparse else []
        return _cdu.stitch_values(((dense_results, dense_at), (sparse_results, sparse_at)))

    def _reduce_dense(self, reduce_op, dense):
        code = tutti._op(_reduce_op_name(reduce_op))
        devices = dense[0]._devices
        n = len(devices)
        # Values of pack_limit bytes or more are reduced where they are; the others are packed.
        small = [j for j, v in enumerate(dense) if _nbytes(v.values[0]) < self.pack_limit]
        large = [j for j, v in enumerate(dense) if _nbytes(v.values[0]) >= self.pack_limit]
        if small:
            grouped = _cdo._group_value_by_device([dense[j] for j in small])  # per device: [(value, None)]
            # Packs are concatenations, which need one type.
            one_type = len({dense[j].values[0].dtype for j in small}) == 1
            packs, packer = _cdo._pack_tensors(grouped, self._num_packs if one_type else 0)
            packs = [[t for t, _ in device] for device in packs]
        else:
            packs, packer = [[] for _ in devices], None
        per_device = [packs[i] + [dense[j].values[i] for j in large] for i in range(n)]
        k = len(per_device[0])
        with tf.device(devices[0]):
            out = _ops().tutti_replicas_all_reduce(
                [t for device in per_device for t in device],
                replicas=self._group(n), num_replicas=n, reduce_op=code,
            )
        # Each replica's results on its own device (in host memory: no copy).
        mine = []
        for i, device in enumerate(devices):
            with tf.device(device):
                mine.append([tf.identity(out[i * k + c]) for c in range(k)])
        p = len(packs[0])
        unpacked = _cdo._unpack_tensors([[(t, None) for t in m[:p]] for m in mine], packer) if small else None
        results = [[None] * len(dense) for _ in devices]
        for i in range(n):
            for j, t in zip(large, mine[i][p:]):
                results[i][j] = t
            for j, (t, _) in zip(small, unpacked[i] if small else []):
                results[i][j] = t
        return [_du.regroup([results[i][j] for i in range(n)], wrap_class=_values.Mirrored) for j in range(len(dense))]


def _nbytes(t):
    """A value's size in bytes, 0 where its shape is not known when the graph is built."""
    count = t.shape.num_elements()
    return 0 if count is None else count * t.dtype.size


def _main(argv):
    if argv[1:] == ["build"]:
        print(build())
        return 0
    print("usage: python -m tutti.tensorflow build   (compile the op library for this TensorFlow)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv))
