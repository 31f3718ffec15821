"""tf.distribute's strategies from Python, over tutti's own (libtutti's C strategy API).

The names and habits of TensorFlow's distributed-training guides, on numpy arrays::

    import numpy as np, tutti.distribute as td

    strategy = td.MirroredStrategy(["cpu:0", "cpu:1"])      # two replicas on logical CPUs
    with strategy.scope():
        def step(x):
            ctx = td.get_replica_context()
            g = x * (ctx.replica_id_in_sync_group + 1)
            return ctx.all_reduce(td.ReduceOp.SUM, g)        # every replica's g, summed
        per_replica = strategy.run(step, args=(np.ones(3, np.float32),))
        total = strategy.reduce(td.ReduceOp.MEAN, per_replica, axis=None)

* Strategies: ``MirroredStrategy(devices=None, cross_device_ops=None)``,
  ``OneDeviceStrategy(device)``, ``CentralStorageStrategy(compute_devices=None)``,
  ``MultiWorkerMirroredStrategy(cluster_resolver=None, communication_options=None)`` (the job
  of ``tutti launch``, torchrun or ``TF_CONFIG``, or of a resolver's cluster; one worker on the
  local devices where none is described), and ``get_strategy()`` (the default strategy outside
  any scope: one replica, the caller). Devices are named as in TensorFlow: the host's logical
  CPUs (``"cpu:N"``, ``"/cpu:N"``, ``"/job:localhost/replica:0/task:0/device:CPU:N"``), GPUs
  (``"/gpu:N"``, ``"GPU:N"``; an ``UNAVAILABLE`` error naming one that is not there) and XLA
  devices (``"xla:N"``, ``"TPU:N"``: the PJRT plugin's, the replicas reducing there with a
  libtutti built with ``--features xla``); ``devices=None`` is every GPU, else the CPU, as in
  TensorFlow.
* Cross-device ops: ``NcclAllReduce()``, ``HierarchicalCopyAllReduce(num_packs=1)``,
  ``ReductionToOneDevice()`` (onto the first device).
* On a strategy: ``scope()``, ``run(fn, args=(), kwargs=None)`` (``fn`` once per local replica,
  in parallel, each on a thread of its own (one replica: the caller's); ``PerReplica`` arguments give each replica its own value;
  the result is a ``PerReplica``, or the value itself with one replica),
  ``reduce(reduce_op, value, axis=None)``, ``experimental_local_results(value)``,
  ``num_replicas_in_sync``.
* Inside ``run``: ``get_replica_context()`` with ``replica_id_in_sync_group``,
  ``num_replicas_in_sync`` and ``all_reduce(reduce_op, value)`` across every replica in sync
  (every worker's too).
* ``Variable(initial_value, aggregation=...)``: the strategy's kind of variable, starting from
  the chief's value on every worker, updated alike on every copy (see ``Variable``).
* Clusters: ``cluster_resolver.TFConfigClusterResolver()`` (``cluster_spec()``, ``task_type``,
  ``task_id``, ``master()``, ``num_accelerators()``), ``SimpleClusterResolver``, ``ClusterSpec``;
  ``strategy.cluster_resolver`` on a multi-worker strategy.
* Training: ``compute_average_loss(per_example_loss, global_batch_size=None)``,
  ``optimizers.SGD(learning_rate, momentum=0, nesterov=False)`` and ``optimizers.Adam(...)``
  (``learning_rate`` a number or a schedule of the step count, settable between steps)
  whose ``apply_gradients`` inside ``run`` sums the gradients across every replica, and
  ``metrics.Mean``, ``Sum`` and ``SparseCategoricalAccuracy`` read across replicas (sync on read).
* Input: ``experimental_distribute_dataset(dataset, options=None)`` (global batches split
  across every replica; ``InputOptions(auto_shard_policy=AUTO|FILE|DATA|OFF)``, ``FileDataset``
  for FILE), ``distribute_datasets_from_function(dataset_fn)`` (``InputContext``),
  ``experimental_distribute_values_from_function(value_fn)`` (``ValueContext``), and
  ``gather(value, axis)``.
* ``Checkpoint(**objects)`` and ``CheckpointManager(checkpoint, directory, max_to_keep=5)``,
  as ``tf.train``'s: ``manager.save()`` (the chief writes), ``manager.restore_or_initialize()``
  (the chief reads, every worker receives), ``latest_checkpoint``, ``checkpoints``; tutti's
  versioned file format, the same files Rust and C read and write.

A replica whose function raises makes ``run`` raise that exception (its siblings' collectives
fail at once instead of waiting for the timeout), and the strategy stays usable.
"""

import contextlib
import ctypes
import json
import os
import queue
import re
import sys
import threading
import warnings

import numpy as np

import tutti
from tutti import _check, _library

__all__ = [
    "ReduceOp",
    "CrossDeviceOps",
    "NcclAllReduce",
    "HierarchicalCopyAllReduce",
    "ReductionToOneDevice",
    "CommunicationImplementation",
    "CommunicationOptions",
    "PerReplica",
    "ReplicaContext",
    "DeviceTensor",
    "VariableAggregation",
    "Variable",
    "DeviceVariable",
    "Checkpoint",
    "CheckpointManager",
    "SidecarEvaluator",
    "checkpoints_iterator",
    "ClusterSpec",
    "SimpleClusterResolver",
    "TFConfigClusterResolver",
    "cluster_resolver",
    "compute_average_loss",
    "optimizers",
    "metrics",
    "AutoShardPolicy",
    "InputOptions",
    "InputContext",
    "ValueContext",
    "FileDataset",
    "DistributedDataset",
    "Strategy",
    "MirroredStrategy",
    "OneDeviceStrategy",
    "CentralStorageStrategy",
    "MultiWorkerMirroredStrategy",
    "TPUStrategy",
    "tpu",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
    "get_replica_context",
]

# tutti_strategy_kind and tutti_cross_device_ops (include/tutti.h).
_DEFAULT, _ONE_DEVICE, _MIRRORED, _CENTRAL_STORAGE, _MULTI_WORKER, _TPU = range(6)
_REPLICA_FN = ctypes.CFUNCTYPE(ctypes.c_uint32, ctypes.c_void_p, ctypes.c_void_p)
_FAILED = 7  # TUTTI_ERROR_SYSTEM: what a replica whose function raised returns

_PROTOTYPES = {
    "tutti_strategy_create": (ctypes.c_uint32, [ctypes.c_uint32, ctypes.c_size_t, ctypes.c_uint32,
                                                ctypes.POINTER(ctypes.c_void_p)]),
    "tutti_strategy_destroy": (None, [ctypes.c_void_p]),
    "tutti_tpu_initialize": (ctypes.c_uint32, [ctypes.POINTER(ctypes.c_size_t)] * 3),
    "tutti_strategy_num_replicas": (ctypes.c_uint32, [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t),
                                                      ctypes.POINTER(ctypes.c_size_t)]),
    "tutti_strategy_run": (ctypes.c_uint32, [ctypes.c_void_p, _REPLICA_FN, ctypes.c_void_p]),
    "tutti_strategy_shrink": (ctypes.c_uint32, [ctypes.c_void_p]),
    "tutti_replica_set_error": (ctypes.c_uint32, [ctypes.c_void_p, ctypes.c_char_p]),
    "tutti_strategy_reduce": (ctypes.c_uint32, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint32,
                                                ctypes.c_uint32, ctypes.POINTER(ctypes.c_void_p),
                                                ctypes.c_void_p]),
    "tutti_replica_id": (ctypes.c_uint32, [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t),
                                           ctypes.POINTER(ctypes.c_size_t)]),
    "tutti_replica_all_reduce": (ctypes.c_uint32, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint32,
                                                   ctypes.c_uint32, ctypes.c_void_p]),
    "tutti_replica_broadcast": (ctypes.c_uint32, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint32,
                                                  ctypes.c_size_t, ctypes.c_void_p]),
    "tutti_replica_place": (ctypes.c_uint32, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint32, ctypes.c_void_p,
                                              ctypes.POINTER(ctypes.c_void_p)]),
    "tutti_tensor_from_host": (ctypes.c_uint32, [ctypes.c_size_t, ctypes.c_uint32, ctypes.c_void_p,
                                                 ctypes.POINTER(ctypes.c_void_p)]),
    "tutti_strategy_place": (ctypes.c_uint32, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_uint32,
                                               ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)]),
    "tutti_replica_all_reduce_tensor": (ctypes.c_uint32, [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_void_p]),
    "tutti_tensor_info": (ctypes.c_uint32, [ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint32),
                                            ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_uint32)]),
    "tutti_tensor_read": (ctypes.c_uint32, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint32, ctypes.c_void_p]),
    "tutti_tensor_destroy": (None, [ctypes.c_void_p]),
    "tutti_strategy_device_variable": (ctypes.c_uint32, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint32,
                                                         ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)]),
    "tutti_device_variable_update_in": (ctypes.c_uint32, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint32,
                                                          ctypes.c_uint32, ctypes.c_void_p]),
    "tutti_device_variable_update": (ctypes.c_uint32, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint32,
                                                       ctypes.c_uint32, ctypes.c_size_t, ctypes.c_uint32,
                                                       ctypes.POINTER(ctypes.c_void_p)]),
    "tutti_device_variable_read": (ctypes.c_uint32, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t,
                                                     ctypes.c_uint32, ctypes.c_void_p]),
    "tutti_device_variable_destroy": (None, [ctypes.c_void_p]),
    "tutti_optimizer_create": (ctypes.c_uint32, [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)]),
    "tutti_optimizer_destroy": (None, [ctypes.c_void_p]),
    "tutti_optimizer_set_learning_rate": (ctypes.c_uint32, [ctypes.c_void_p, ctypes.c_float]),
    "tutti_optimizer_apply_device_gradients": (ctypes.c_uint32, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                                                 ctypes.POINTER(ctypes.c_void_p),
                                                                 ctypes.POINTER(ctypes.c_void_p)]),
    "tutti_optimizer_save": (ctypes.c_uint32, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t,
                                               ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_void_p)]),
    "tutti_optimizer_restore": (ctypes.c_uint32, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t,
                                                  ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_void_p)]),
    "tutti_checkpoint_create": (ctypes.c_uint32, [ctypes.c_uint64, ctypes.POINTER(ctypes.c_void_p)]),
    "tutti_checkpoint_destroy": (None, [ctypes.c_void_p]),
    "tutti_checkpoint_step": (ctypes.c_uint32, [ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint64)]),
    "tutti_checkpoint_insert": (ctypes.c_uint32, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_uint32,
                                                  ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t),
                                                  ctypes.c_void_p]),
    "tutti_checkpoint_variable": (ctypes.c_uint32, [ctypes.c_void_p, ctypes.c_char_p,
                                                    ctypes.POINTER(ctypes.c_uint32),
                                                    ctypes.POINTER(ctypes.c_size_t),
                                                    ctypes.POINTER(ctypes.c_size_t), ctypes.c_size_t]),
    "tutti_checkpoint_read": (ctypes.c_uint32, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_uint32,
                                                ctypes.c_size_t, ctypes.c_void_p]),
    "tutti_checkpoint_save": (ctypes.c_uint32, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t,
                                                ctypes.c_void_p]),
    "tutti_checkpoint_restore": (ctypes.c_uint32, [ctypes.c_void_p, ctypes.c_char_p,
                                                   ctypes.POINTER(ctypes.c_void_p)]),
}
_CROSS_DEVICE_OP_FN = ctypes.CFUNCTYPE(ctypes.c_uint32, ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint32,
                                       ctypes.c_size_t, ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t)


class _CrossDeviceOpsConfig(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("kind", ctypes.c_uint32), ("num_packs", ctypes.c_size_t),
                ("group_size", ctypes.c_size_t), ("reduce_to_device", ctypes.c_size_t), ("name", ctypes.c_char_p),
                ("all_reduce", _CROSS_DEVICE_OP_FN), ("user_data", ctypes.c_void_p)]


_PROTOTYPES["tutti_strategy_create_mirrored"] = (ctypes.c_uint32, [ctypes.c_size_t, ctypes.POINTER(_CrossDeviceOpsConfig),
                                                                   ctypes.POINTER(ctypes.c_void_p)])
_PROTOTYPES["tutti_strategy_create_on_devices"] = (
    ctypes.c_uint32,
    [ctypes.c_uint32, ctypes.POINTER(ctypes.c_char_p), ctypes.c_size_t, ctypes.POINTER(_CrossDeviceOpsConfig),
     ctypes.POINTER(ctypes.c_void_p)])
_bound = None
_bind_lock = threading.Lock()


def _lib():
    global _bound
    with _bind_lock:
        if _bound is None:
            lib = _library()
            for name, (restype, argtypes) in _PROTOTYPES.items():
                f = getattr(lib, name)
                f.restype, f.argtypes = restype, argtypes
            _bound = lib
    return _bound


class ReduceOp:
    """How values of the replicas combine: ``SUM`` or ``MEAN`` (TensorFlow's names; the strings
    "SUM"/"MEAN", any case, and ``tf.distribute.ReduceOp`` values are taken too)."""

    SUM = "SUM"
    MEAN = "MEAN"


def _reduce_op(op):
    name = getattr(op, "value", op)  # tf.distribute.ReduceOp.SUM.value == "SUM"
    key = str(name).upper().rpartition(".")[2]
    if key not in ("SUM", "MEAN"):
        raise ValueError(f"reduce_op {op!r} is neither SUM nor MEAN")
    return key


class CrossDeviceOps:
    """How a ``MirroredStrategy`` combines its replicas' values (TensorFlow's cross-device ops).
    A subclass of the caller's implements ``reduce_implementation(reduce_op, per_replica_value,
    destinations=None, options=None)``: given a ``PerReplica`` of the local replicas' numpy
    values, it returns the combined value (``reduce_op`` is ``"SUM"`` or ``"MEAN"``; values are
    floating-point: other ops and integers run on tutti's algorithms), which every replica then
    holds. It runs on one replica's thread
    while the others wait, for the replica context's ``all_reduce`` (and what is built on it:
    variables' aggregation, optimizers) and ``strategy.reduce``; what it raises, ``run`` raises."""

    _code = None  # the caller's own

    def reduce_implementation(self, reduce_op, per_replica_value, destinations=None, options=None):
        raise NotImplementedError(f"{type(self).__name__}: a CrossDeviceOps of your own implements "
                                  "reduce_implementation(reduce_op, per_replica_value, ...)")

    def _config(self):
        """(kind, num_packs, group_size, reduce_to_device) of tutti_cross_device_ops_config."""
        return self._code, 0, 0, 0


class NcclAllReduce(CrossDeviceOps):
    """NCCL's all-reduce across GPUs (where replicas are not GPUs, tutti says so, at warning
    level, and uses its own algorithms)."""

    _code = 1

    def __init__(self, num_packs=1):
        if num_packs != 1:
            raise ValueError(f"num_packs={num_packs}: NCCL reduces each batch as one pack (num_packs=1)")


class HierarchicalCopyAllReduce(CrossDeviceOps):
    """Reduce onto group leaders (groups of ``group_size`` replicas), across leaders, and back
    (TensorFlow's hierarchical copy); a batch of values fused into ``num_packs`` packs."""

    _code = 2

    def __init__(self, num_packs=1, group_size=2):
        if int(num_packs) < 0 or int(group_size) < 1:
            raise ValueError(f"HierarchicalCopyAllReduce: num_packs {num_packs} (0 or more), group_size "
                             f"{group_size} (1 or more)")
        self.num_packs, self.group_size = int(num_packs), int(group_size)

    def _config(self):
        return self._code, self.num_packs, self.group_size, 0


class ReductionToOneDevice(CrossDeviceOps):
    """Reduce onto one device (``reduce_to_device``, one of the strategy's; default: the
    first), then copy the result to every replica."""

    _code = 3

    def __init__(self, reduce_to_device=None, accumulation_fn=None):
        if accumulation_fn is not None:
            raise ValueError("ReductionToOneDevice: tutti's strategies accumulate with their own kernels "
                             "(accumulation_fn must be None)")
        self.reduce_to_device = reduce_to_device

    def _config(self):
        return self._code, 0, 0, 0


class CommunicationImplementation:
    """The collectives a ``MultiWorkerMirroredStrategy`` runs across workers."""

    AUTO = "AUTO"
    RING = "RING"
    NCCL = "NCCL"


class CommunicationOptions:
    """Options of the collectives across workers. ``implementation``: ``AUTO`` (tutti chooses by
    the devices, as TensorFlow's AUTO does), ``RING`` (the ring over TCP) or ``NCCL`` (NCCL where
    every local device is a GPU and NCCL loads; elsewhere the ring, said once in tutti's log at
    warn level with the reason). TensorFlow's enum values and their names are taken too."""

    _CODES = {"AUTO": 0, "RING": 1, "NCCL": 2}

    def __init__(self, bytes_per_pack=0, timeout_seconds=None, implementation=CommunicationImplementation.AUTO):
        name = str(getattr(implementation, "name", None) or getattr(implementation, "value", implementation))
        name = name.upper().rpartition(".")[2]
        if name not in self._CODES:
            raise ValueError(f"implementation={implementation!r}: one of AUTO, RING, NCCL")
        try:
            packs = int(bytes_per_pack)
            ok = packs == bytes_per_pack and 0 <= packs < 2**63
        except (TypeError, ValueError, OverflowError):
            ok = False
        if not ok:
            raise ValueError(f"bytes_per_pack={bytes_per_pack!r}: a non-negative integer (0: tutti's default)")
        if timeout_seconds is not None:
            try:
                ok = 0 < float(timeout_seconds) <= 30 * 86400
            except (TypeError, ValueError):
                ok = False
            if not ok:
                raise ValueError(f"timeout_seconds={timeout_seconds!r}: seconds, positive and at most 30 days, or "
                                 "None for the configured one (TUTTI_TIMEOUT); tutti bounds every wait, so 0 "
                                 "does not disable it")
        self.bytes_per_pack = packs
        self.timeout_seconds = timeout_seconds
        self.implementation = getattr(CommunicationImplementation, name)


class PerReplica:
    """One value per local replica (``values``), as ``run`` returns them."""

    def __init__(self, values):
        self.values = tuple(values)

    def __repr__(self):
        return f"PerReplica({list(self.values)!r})"


_state = threading.local()  # .stack: the scopes entered on this thread; .replica: run's context


def _stack():
    s = getattr(_state, "stack", None)
    if s is None:
        s = _state.stack = []
    return s


_DEVICE_KINDS = {0: "cpu", 1: "gpu", 2: "xla"}


class DeviceTensor:
    """A value in a replica's device memory: a PJRT buffer under ``TPUStrategy``, host memory
    for CPU replicas. ``ReplicaContext.place`` makes one; ``ReplicaContext.all_reduce`` reduces it
    where it lies (on XLA devices one compiled program, nothing copied through host memory);
    ``numpy()`` copies it to the host. A tensor belongs to the replica that placed it."""

    def __init__(self, *args, **kwargs):
        raise TypeError("DeviceTensor: made by ReplicaContext.place, not directly")

    @classmethod
    def _wrap(cls, handle, shape, dtype):
        t = object.__new__(cls)
        t._h, t.shape, t.dtype = ctypes.c_void_p(handle), tuple(shape), np.dtype(dtype)
        return t

    @property
    def device_kind(self):
        """``"xla"`` for a tensor on an XLA device, ``"cpu"`` for host memory."""
        kind = ctypes.c_uint32()
        _check(_lib().tutti_tensor_info(self._h, None, None, ctypes.byref(kind)))
        return _DEVICE_KINDS.get(kind.value, f"kind {kind.value}")

    def numpy(self):
        """Its elements, copied to a new array of its shape and dtype."""
        out = np.empty(self.shape, self.dtype)
        _check(_lib().tutti_tensor_read(self._h, out.size, tutti.DTYPES[self.dtype.name],
                                        out.ctypes.data_as(ctypes.c_void_p)))
        return out

    def __repr__(self):
        return f"DeviceTensor(shape={self.shape}, dtype={self.dtype.name}, on {self.device_kind})"

    def __del__(self):
        h, self._h = getattr(self, "_h", None), None
        if h is not None and h.value and _bound is not None:
            _bound.tutti_tensor_destroy(h)


class ReplicaContext:
    """What a replica's function sees inside ``run``."""

    def __init__(self, strategy, ctx, replica_id, local=0, run=None):
        self._strategy, self._ctx, self._id, self._local = strategy, ctx, replica_id, local
        # The run's count of steps per optimizer, shared by its replicas (a dict and its lock),
        # and this replica's steps per optimizer in the run (see Optimizer._step_number).
        self._run, self._taken = run, {}

    @property
    def strategy(self):
        """The strategy running this replica."""
        return self._strategy

    @property
    def replica_id_in_sync_group(self):
        """This replica's index among every replica in sync (every worker's)."""
        return self._id

    @property
    def num_replicas_in_sync(self):
        """How many replicas run in sync across the job."""
        return self._strategy.num_replicas_in_sync

    def place(self, value):
        """``value`` (an array, or a tensor with ``__dlpack__``) in this replica's device memory,
        as a ``DeviceTensor``."""
        a = np.ascontiguousarray(_array(value))
        _check_dtype(a.dtype, "place")
        h = ctypes.c_void_p()
        data, code = a.ctypes.data_as(ctypes.c_void_p), tutti.DTYPES[a.dtype.name]
        if self._ctx is None:  # the default strategy's one replica: host memory
            _check(_lib().tutti_tensor_from_host(a.size, code, data, ctypes.byref(h)))
        else:
            _check(_lib().tutti_replica_place(self._ctx, a.size, code, data, ctypes.byref(h)))
        return DeviceTensor._wrap(h.value, a.shape, a.dtype)

    def all_reduce(self, reduce_op, value):
        """``value`` (an array, a number, or a tensor with ``__dlpack__``) combined across every
        replica in sync; every replica must call it, in the same order, with the same shape and
        dtype. A new array (a new torch tensor on ``value``'s device for a torch tensor); a
        ``DeviceTensor`` is reduced in place, where it lies, and returned."""
        op = tutti.OPS["sum" if _reduce_op(reduce_op) == "SUM" else "mean"]
        if isinstance(value, DeviceTensor):
            if self._ctx is not None:
                _check(_lib().tutti_replica_all_reduce_tensor(self._ctx, op, value._h))
            return value
        scalar = np.isscalar(value)
        a = np.array(_array(value), copy=True, order="C")
        _check_dtype(a.dtype, "all_reduce")
        if self._ctx is None:  # the default strategy's one replica
            out = a
        else:
            _check(_lib().tutti_replica_all_reduce(self._ctx, a.size, tutti.DTYPES[a.dtype.name], op,
                                                   a.ctypes.data_as(ctypes.c_void_p)))
            out = a
        return out[()] if scalar else _like(out, value)

    def all_gather(self, value, axis):
        """TensorFlow's ``ReplicaContext.all_gather``: every replica's ``value`` (an array, or a
        tensor with ``__dlpack__``) concatenated along ``axis`` in replica order, every worker's,
        on every replica; the values may differ in length along ``axis`` only (an uneven last
        batch). Every replica calls it, in the same order. A value that cannot be gathered
        (``axis`` out of range, a dtype tutti does not move, a shape or dtype that differs from
        replica 0's) raises ``ValueError`` on every replica."""
        a = np.require(_array(value), requirements="C")
        problem = None
        if a.ndim == 0 or not -a.ndim <= axis < a.ndim:
            problem = f"all_gather: axis {axis} is out of range for a value of shape {a.shape}"
        elif a.dtype.name not in tutti.DTYPES or not a.dtype.isnative:
            problem = f"all_gather: dtype {a.dtype} is not one tutti moves (expected one of {', '.join(tutti.DTYPES)})"
        if problem:
            a, axis = np.zeros(1, np.uint8), 0  # only to take part: every replica raises
        return _like(self._gather_along(a, axis % a.ndim, problem, "all_gather", "replica"), value)

    def _gather_along(self, part, axis, problem, name, who):
        """Every replica's ``part`` concatenated along ``axis`` in replica order. ``problem``:
        why this replica's value was refused; then every replica raises (never a collective the
        others do not make). ``name`` and ``who`` (``worker``, ``replica``): for the errors."""
        if self.all_reduce("SUM", np.int32(problem is not None)):
            raise ValueError(problem or f"{name}: another {who}'s values were refused (its error says why)")
        what = f"{name}: the values differ between {who}s"
        code = tutti.DTYPES[part.dtype.name]
        _agree(self, np.array([part.ndim, code], np.int64), what,
               lambda h: f"have {h[0]} dimensions of {_dtype_name(h[1])}")
        _agree(self, np.array(_besides(part, axis), np.int64), what,
               lambda d: f"are {tuple(int(x) for x in d)} besides axis {axis}")
        lengths = np.zeros(self.num_replicas_in_sync, np.int64)
        lengths[self.replica_id_in_sync_group] = part.shape[axis]
        lengths = self.all_reduce("SUM", lengths)
        rows = self._gather_rows(np.ascontiguousarray(np.moveaxis(part, axis, 0)), lengths)
        return np.moveaxis(rows, 0, axis)

    def _gather_rows(self, part, lengths):
        """Every replica's ``part`` (rows along axis 0; replica r's has ``lengths[r]``),
        concatenated in replica order: the bits exactly, by a bitwise OR over zeros."""
        out = np.zeros((int(lengths.sum()),) + part.shape[1:], part.dtype)
        at = int(lengths[: self._id].sum())
        out[at : at + len(part)] = part
        if self._ctx is not None and out.nbytes:
            raw = out.view(np.uint8).reshape(-1)
            _check(_lib().tutti_replica_all_reduce(self._ctx, raw.size, tutti.DTYPES["uint8"], tutti.OPS["bor"],
                                                   raw.ctypes.data_as(ctypes.c_void_p)))
        return out

    def _broadcast(self, value, root=0):
        """Replica ``root``'s ``value`` (an index in sync) on every replica: a new array."""
        a = np.array(value, copy=True, order="C")
        _check_dtype(a.dtype, "broadcast")
        if self._ctx is not None:
            _check(_lib().tutti_replica_broadcast(self._ctx, a.size, tutti.DTYPES[a.dtype.name], root,
                                                  a.ctypes.data_as(ctypes.c_void_p)))
        return a


def _agree(ctx, mine, what, describe):
    """Every replica's ``mine`` (an int64 header) is replica 0's, else ``what`` is raised on
    every replica (each learns of it): never a collective that the others do not make."""
    theirs = ctx._broadcast(mine, 0)
    differs = not np.array_equal(theirs, mine)
    if ctx.all_reduce("SUM", np.int32(differs)):
        raise ValueError(
            f"{what}: the chief's {describe(theirs)}" + (f", this worker's {describe(mine)}" if differs else "")
        )


def _besides(a, axis):
    """``a``'s shape without ``axis``."""
    return a.shape[:axis] + a.shape[axis + 1 :]


def _is_tensor(value):
    """Whether ``value`` is another framework's tensor (a torch tensor, or anything else that
    exports DLPack with a shape), kept as it is where a batch is sliced."""
    return hasattr(value, "__dlpack__") and hasattr(value, "shape") and not isinstance(value, np.ndarray)


def _array(value):
    """``value`` as a numpy array: numpy's own as it is, a ``DeviceTensor``'s elements, another
    framework's tensor through DLPack (a torch tensor on the CPU without a copy, one on a GPU
    copied to the host, one that requires grad detached first), anything else as numpy takes
    it."""
    if isinstance(value, np.ndarray):
        return value
    if isinstance(value, DeviceTensor):
        return value.numpy()
    if hasattr(value, "__dlpack__") and not np.isscalar(value):
        t = value.detach() if callable(getattr(value, "detach", None)) else value
        on = t.__dlpack_device__()[0] if hasattr(t, "__dlpack_device__") else 1
        if on != 1 and callable(getattr(t, "cpu", None)):  # 1: DLPack's kDLCPU
            t = t.cpu()
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16:
            # numpy has no bfloat16: its bits, as ml_dtypes' (an error naming it without).
            import ml_dtypes

            return t.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        from_dlpack = getattr(np, "from_dlpack", None)  # numpy 1.23 and later
        if from_dlpack is not None:
            try:
                return from_dlpack(t)
            except (TypeError, BufferError, RuntimeError, ValueError):
                pass  # a dtype DLPack cannot carry to numpy: numpy's own conversion says why
        return np.asarray(t)
    return np.asarray(value)


def _like(result, given):
    """``result`` (a new numpy array) in ``given``'s kind: a torch tensor on ``given``'s device
    where ``given`` is one, else as it is."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(given, torch.Tensor) and isinstance(result, np.ndarray):
        a = np.require(result, requirements="C")
        if a.dtype.name == "bfloat16":
            return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16).to(given.device)
        return torch.from_numpy(a).to(given.device)
    return result


def _check_dtype(dtype, what):
    if dtype.name not in tutti.DTYPES:
        raise TypeError(f"{what}: dtype {dtype} is not one tutti reduces (expected one of {', '.join(tutti.DTYPES)})")
    if not dtype.isnative:
        raise TypeError(f"{what}: dtype {dtype} is not in native byte order")


def _lock_wait():
    """How long a cross-replica call waits for another thread's: the library's timeout."""
    return tutti._default_timeout() or 300.0


_KINDS = {"cpu": "cpu", "gpu": "gpu", "cuda": "gpu", "xla": "xla", "tpu": "xla"}


def _device_spec(device):
    """``(kind, N)`` of a device name (``"cpu:0"``, ``"GPU:1"``, ``"xla:0"``, TensorFlow's
    ``"/gpu:0"`` and ``"/job:localhost/replica:0/task:0/device:CPU:0"``), else an error naming it."""
    m = re.fullmatch(r"(?:.*/)?(?:device:)?([a-z]+)(?::(\d+))?", str(device).strip().lower())
    if not m or m.group(1) not in _KINDS:
        raise ValueError(
            f"device {device!r}: expected a CPU, GPU or XLA device ('cpu:N', 'gpu:N', 'xla:N', or "
            "TensorFlow's '/device:GPU:N'); devices=None uses every GPU (else the CPU)"
        )
    return _KINDS[m.group(1)], int(m.group(2) or 0)


def _device_index(device):
    """The N of a CPU device name, else an error naming it."""
    kind, index = _device_spec(device)
    if kind != "cpu":
        raise ValueError(f"device {device!r}: expected a CPU device ('cpu:N')")
    return index


def _replicas(devices, what):
    """The device names of ``devices`` (``None``: the default devices), checked."""
    if devices is None:
        return None
    devices = [devices] if isinstance(devices, str) else list(devices)
    if not devices:
        raise ValueError(f"{what}: devices is empty")
    specs = [_device_spec(d) for d in devices]
    if len(set(specs)) != len(specs):
        raise ValueError(f"{what}: devices {devices} name a device twice")
    return [str(d).strip() for d in devices]  # as the caller spelt them, for the errors


class ClusterSpec:
    """TensorFlow's ``tf.train.ClusterSpec``: each job's task addresses, a list (task i at
    index i) or a dict ``{index: address}`` (sparse)."""

    def __init__(self, cluster):
        if isinstance(cluster, ClusterSpec):
            cluster = cluster.as_dict()
        self._jobs = {}
        for job, tasks in dict(cluster).items():
            if isinstance(tasks, dict):
                self._jobs[str(job)] = {int(i): str(a) for i, a in tasks.items()}
            else:
                self._jobs[str(job)] = dict(enumerate(str(a) for a in tasks))

    def __bool__(self):
        return bool(self._jobs)

    @property
    def jobs(self):
        """The job names."""
        return list(self._jobs)

    def _job(self, job_name):
        if job_name not in self._jobs:
            raise ValueError(f"ClusterSpec: no such job {job_name!r} (jobs: {', '.join(self._jobs) or 'none'})")
        return self._jobs[job_name]

    def as_dict(self):
        """``{job: [address, ...]}``, or ``{job: {index: address}}`` for a sparse job."""
        out = {}
        for job, tasks in self._jobs.items():
            dense = sorted(tasks) == list(range(len(tasks)))
            out[job] = [tasks[i] for i in range(len(tasks))] if dense else dict(tasks)
        return out

    def num_tasks(self, job_name):
        """How many tasks ``job_name`` has."""
        return len(self._job(job_name))

    def task_indices(self, job_name):
        """The indices of ``job_name``'s tasks, in order."""
        return sorted(self._job(job_name))

    def task_address(self, job_name, task_index):
        """The address of task ``task_index`` of ``job_name``."""
        tasks = self._job(job_name)
        if task_index not in tasks:
            raise ValueError(f"ClusterSpec: job {job_name!r} has no task {task_index}")
        return tasks[task_index]

    def job_tasks(self, job_name):
        """The addresses of ``job_name``'s tasks, by index (None where a sparse job has none)."""
        tasks = self._job(job_name)
        return [tasks.get(i) for i in range(max(tasks) + 1)] if tasks else []

    def __eq__(self, other):
        return isinstance(other, ClusterSpec) and self._jobs == other._jobs

    def __repr__(self):
        return f"ClusterSpec({self.as_dict()!r})"


class SimpleClusterResolver:
    """TensorFlow's ``SimpleClusterResolver``: a cluster spec, a master and this task, as given
    (TensorFlow's argument order)."""

    def __init__(self, cluster_spec, master="", task_type=None, task_id=None, environment="",
                 num_accelerators=None, rpc_layer=None):
        self._spec = ClusterSpec(cluster_spec)
        self._master = master
        self.task_type, self.task_id = task_type, task_id
        self.environment, self.rpc_layer = environment, rpc_layer
        self._accelerators = num_accelerators

    def cluster_spec(self):
        """The cluster."""
        return self._spec

    def master(self, task_type=None, task_id=None, rpc_layer=None):
        """The address of task ``task_type``:``task_id`` where both are given (prefixed with
        ``rpc_layer://`` where there is one), else the master given."""
        if task_type is None or task_id is None:
            return self._master
        address = self._spec.task_address(task_type, task_id)
        layer = rpc_layer or self.rpc_layer
        return f"{layer}://{address}" if layer else address

    def num_accelerators(self, task_type=None, task_id=None, config_proto=None):
        """Accelerators by kind: those given, else ``{"GPU": n}`` where tutti sees GPUs, else
        ``{}``."""
        if self._accelerators is not None:
            return dict(self._accelerators)
        gpus = sum(1 for d in tutti.devices() if d.kind == "gpu")
        return {"GPU": gpus} if gpus else {}


class TFConfigClusterResolver(SimpleClusterResolver):
    """TensorFlow's ``TFConfigClusterResolver``: the cluster and this task from the ``TF_CONFIG``
    environment variable (``{"cluster": {...}, "task": {"type", "index"}, "rpc_layer",
    "environment"}``), each overridable by the arguments; no TF_CONFIG is an empty cluster."""

    def __init__(self, task_type=None, task_id=None, rpc_layer=None, environment=None):
        text = os.environ.get("TF_CONFIG", "")
        try:
            config = json.loads(text) if text.strip() else {}
        except ValueError as e:
            raise ValueError(f"TF_CONFIG is not valid JSON: {e}") from None
        task = config.get("task", {}) or {}
        super().__init__(
            config.get("cluster", {}) or {},
            "",
            task.get("type") if task_type is None else task_type,
            int(task.get("index", 0)) if task_id is None else int(task_id),
            config.get("environment", "") if environment is None else environment,
            None,
            config.get("rpc_layer") if rpc_layer is None else rpc_layer,
        )
        self._overridden = any(x is not None for x in (task_type, task_id, rpc_layer, environment))

    def master(self, task_type=None, task_id=None, rpc_layer=None):
        """TensorFlow's: the address of task ``task_type``:``task_id`` (default: this task),
        prefixed with ``rpc_layer://`` where there is one; "" where the cluster does not have
        it."""
        task_type = self.task_type if task_type is None else task_type
        task_id = self.task_id if task_id is None else task_id
        if task_type is None or task_id is None or task_type not in self._spec.jobs:
            return ""
        return super().master(task_type, task_id, rpc_layer)


cluster_resolver = None  # the namespace, set below (a module of TensorFlow's)


class AutoShardPolicy:
    """How ``experimental_distribute_dataset`` shares a dataset among the workers (TensorFlow's
    ``tf.data.experimental.AutoShardPolicy``): ``FILE``, each worker reads its share of a
    ``FileDataset``'s files (``files[worker::workers]``), batched to its share of the global
    batch; ``DATA``, every worker reads every global batch and keeps its replicas' rows; ``OFF``,
    no sharding: every worker reads every element, in batches of its share of the global batch
    (each global batch makes as many steps as there are workers); ``AUTO`` (the default), FILE where the dataset has at least as many
    files as there are workers, else DATA with a warning. Within a worker the batch is split
    across the local replicas. Under FILE, workers whose files hold different numbers of
    examples get different numbers of batches, and a step's collectives then wait for a worker
    that has run out (as in TensorFlow): give the workers even files, or repeat the dataset and
    bound the steps."""

    AUTO = "AUTO"
    FILE = "FILE"
    DATA = "DATA"
    OFF = "OFF"


def _policy(p):
    key = str(getattr(p, "name", p)).upper().rpartition(".")[2]
    if key not in ("AUTO", "FILE", "DATA", "OFF"):
        raise ValueError(f"auto_shard_policy {p!r} is not AUTO, FILE, DATA or OFF")
    return key


class InputOptions:
    """Options of ``experimental_distribute_dataset`` and ``distribute_datasets_from_function``:
    ``auto_shard_policy`` (TensorFlow sets it on the dataset's options; here it is given with
    the call); ``experimental_fetch_to_device``: each replica's batch placed on its device as
    ``DeviceTensor``s (PJRT buffers under ``TPUStrategy``, host memory for CPU replicas) by a
    thread of its own, up to ``experimental_per_replica_buffer_size`` steps ahead, so that the
    uploads overlap the steps. Unlike TensorFlow's, it is off unless asked for: a replica
    function over numpy arrays reads host arrays, not device buffers."""

    def __init__(self, auto_shard_policy=AutoShardPolicy.AUTO, experimental_fetch_to_device=None,
                 experimental_per_replica_buffer_size=1):
        self.auto_shard_policy = _policy(auto_shard_policy)
        self.experimental_fetch_to_device = bool(experimental_fetch_to_device)
        n = int(experimental_per_replica_buffer_size)
        if n < 1:
            raise ValueError(f"InputOptions: experimental_per_replica_buffer_size {n} must be at least 1")
        self.experimental_per_replica_buffer_size = n


class InputContext:
    """What ``distribute_datasets_from_function`` hands the dataset function: the number of
    input pipelines (workers), this one's id, and the replicas in sync."""

    def __init__(self, num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=1):
        self.num_input_pipelines = num_input_pipelines
        self.input_pipeline_id = input_pipeline_id
        self.num_replicas_in_sync = num_replicas_in_sync

    def get_per_replica_batch_size(self, global_batch_size):
        """The global batch over the replicas in sync; it must divide evenly."""
        if global_batch_size % self.num_replicas_in_sync:
            raise ValueError(
                f"the global batch size ({global_batch_size}) is not divisible by the number of replicas in "
                f"sync ({self.num_replicas_in_sync})"
            )
        return global_batch_size // self.num_replicas_in_sync


class ValueContext:
    """What ``experimental_distribute_values_from_function`` hands the value function."""

    def __init__(self, replica_id_in_sync_group=0, num_replicas_in_sync=1):
        self.replica_id_in_sync_group = replica_id_in_sync_group
        self.num_replicas_in_sync = num_replicas_in_sync


def _rows(batch):
    """The rows of a batch (its leaves' first dimension, which must agree)."""
    leaves = _leaves(batch)
    if not leaves:
        raise ValueError("a batch needs at least one array")
    n = {len(x) for x in leaves}
    if len(n) != 1:
        raise ValueError(f"a batch's arrays differ in rows: {sorted(n)}")
    return n.pop()


def _leaves(batch):
    if isinstance(batch, dict):
        return [x for v in batch.values() for x in _leaves(v)]
    if isinstance(batch, (tuple, list)):
        return [x for v in batch for x in _leaves(v)]
    a = batch if _is_tensor(batch) else np.asarray(batch)
    if a.ndim == 0:
        raise ValueError("a batch's arrays need a first dimension (rows)")
    return [a]


def _take(batch, start, stop):
    """Rows ``start:stop`` of every array of a batch, in its structure."""
    if isinstance(batch, dict):
        return {k: _take(v, start, stop) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return _rebuild(batch, [_take(v, start, stop) for v in batch])
    # Another framework's tensor is sliced as it is (a view, on its device).
    return (batch if _is_tensor(batch) else np.asarray(batch))[start:stop]


def _map_leaves(batch, f):
    """``f`` of every array of a batch, in its structure."""
    if isinstance(batch, dict):
        return {k: _map_leaves(v, f) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return _rebuild(batch, [_map_leaves(v, f) for v in batch])
    return f(batch)


def _ahead(items, depth):
    """``items`` made by a thread of their own, at most ``depth`` of them ahead of the caller;
    an exception reaches the caller in its place and ends them. Once the caller stops taking
    (the generator closed), the thread stops after the item in hand."""
    made, slots, stop = queue.Queue(), threading.Semaphore(depth), threading.Event()
    end = object()

    def produce():
        try:
            while True:
                while not slots.acquire(timeout=0.05):
                    if stop.is_set():
                        return
                if stop.is_set():
                    return
                item = next(items, end)
                made.put((item, None))
                if item is end:
                    return
        except BaseException as e:  # noqa: B036 - handed to the caller, in its place
            made.put((end, e))

    threading.Thread(target=produce, name="tutti-input", daemon=True).start()
    try:
        while True:
            item, error = made.get()
            slots.release()
            if error is not None:
                raise error
            if item is end:
                return
            yield item
    finally:
        stop.set()


def _rebuild(like, items):
    """A tuple, list or named tuple of ``like``'s kind holding ``items``."""
    return type(like)(*items) if hasattr(like, "_fields") else type(like)(items)


def _stack_examples(examples):
    """Examples (arrays, or tuples, lists or dicts of them) stacked into a batch."""
    first = examples[0]
    if isinstance(first, dict):
        return {k: _stack_examples([e[k] for e in examples]) for k in first}
    if isinstance(first, (tuple, list)):
        return _rebuild(first, [_stack_examples([e[i] for e in examples]) for i in range(len(first))])
    return np.stack([np.asarray(e) for e in examples])


def _part(n, parts, i):
    """Rows of part ``i`` of ``n`` cut into ``parts`` contiguous pieces, the first ``n % parts``
    one row longer (tutti's ``partition``)."""
    base, extra = divmod(n, parts)
    start = i * base + min(i, extra)
    return start, start + base + (i < extra)


class FileDataset:
    """A dataset read from files: ``read_fn(path)`` yields a file's examples (an array, or a
    tuple, list or dict of arrays, each one example), which are batched in order into global
    batches of ``batch_size`` rows (the last may be short). Under FILE sharding each worker
    reads only its files."""

    def __init__(self, files, read_fn, batch_size):
        self.files = [str(f) for f in files]
        if int(batch_size) < 1:
            raise ValueError(f"FileDataset: batch_size {batch_size} must be at least 1")
        self.read_fn, self.batch_size = read_fn, int(batch_size)

    def _batches(self, files, batch_size):
        pending = []
        for f in files:
            for example in self.read_fn(f):
                pending.append(example)
                if len(pending) == batch_size:
                    yield _stack_examples(pending)
                    pending = []
        if pending:
            yield _stack_examples(pending)

    def __iter__(self):
        return self._batches(self.files, self.batch_size)


class DistributedDataset:
    """What ``experimental_distribute_dataset`` and ``distribute_datasets_from_function``
    return: iterate it for per-replica batches (a ``PerReplica``, or the batch itself with one
    local replica), to pass to ``strategy.run``. A replica may get no rows of an uneven last
    batch (an empty slice)."""

    def __init__(self, strategy, dataset, policy, worker, workers, options=None):
        self._strategy, self._dataset, self._policy = strategy, dataset, policy
        self._worker, self._workers = worker, workers
        self._options = options or InputOptions()

    def _local(self, batch, n, first, total):
        """This worker's replicas' rows of a batch of ``n`` rows cut into ``total`` parts,
        the worker's starting at part ``first``."""
        local = self._strategy._local
        values = [_take(batch, *_part(n, total, first + i)) for i in range(local)]
        return values[0] if local == 1 else PerReplica(values)

    def __iter__(self):
        if not self._options.experimental_fetch_to_device:
            return self._steps()
        return _ahead(self._placed(self._steps()), self._options.experimental_per_replica_buffer_size)

    def _placed(self, steps):
        """Each step's per-replica batches, every array on its replica's device."""
        strategy = self._strategy
        for step in steps:
            values = step.values if isinstance(step, PerReplica) else (step,)
            placed = [_map_leaves(v, lambda a, i=i: strategy._place_on(i, a)) for i, v in enumerate(values)]
            yield PerReplica(placed) if isinstance(step, PerReplica) else placed[0]

    def _steps(self):
        local, total = self._strategy._local, self._strategy._total
        if self._policy is None:  # from a function: each replica takes the pipeline's next batch
            it = iter(self._dataset)
            while True:
                got = [b for _, b in zip(range(local), it)]
                if not got:
                    return
                short = len(got) < local
                _rows(got[-1])
                # A short final group: the missing replicas get no rows.
                got += [_take(got[-1], 0, 0)] * (local - len(got))
                yield got[0] if local == 1 else PerReplica(got)
                if short:
                    return
        elif self._policy == AutoShardPolicy.FILE:
            mine = self._dataset.files[self._worker :: self._workers]
            start, stop = _part(self._dataset.batch_size, self._workers, self._worker)
            for batch in self._dataset._batches(mine, stop - start):
                yield self._local(batch, _rows(batch), 0, local)
        elif self._policy == AutoShardPolicy.DATA:
            for batch in self._dataset:
                yield self._local(batch, _rows(batch), self._worker * local, total)
        else:  # OFF: each global batch in one piece per worker, each a step here
            for batch in self._dataset:
                n = _rows(batch)
                for k in range(self._workers):
                    piece = _take(batch, *_part(n, self._workers, k))
                    yield self._local(piece, _rows(piece), 0, local)


class Strategy:
    """A strategy: replicas and how their values combine. Made by its subclasses."""

    # The most bytes of gradients an optimizer sums in one collective (CommunicationOptions'
    # bytes_per_pack; tutti's default as its Rust strategies').
    _bytes_per_pack = 32 << 20

    def __init__(self, kind, num_local_replicas=0, cross_device_ops=None, devices=None, _create=None):
        if cross_device_ops is not None and not isinstance(cross_device_ops, CrossDeviceOps):
            raise TypeError(f"cross_device_ops must be a tutti.distribute.CrossDeviceOps, not {type(cross_device_ops).__name__}")
        self._ops = cross_device_ops
        self._op_error = None
        h = ctypes.c_void_p()
        if _create is not None:
            _create(h)
        elif devices is not None:
            config = None
            if cross_device_ops is not None:
                config, self._op_callback = self._ops_config(cross_device_ops, devices)
            names = (ctypes.c_char_p * len(devices))(*[d.encode() for d in devices])
            _check(_lib().tutti_strategy_create_on_devices(
                kind, names, len(devices), ctypes.byref(config) if config is not None else None, ctypes.byref(h)))
        elif kind == _MIRRORED and cross_device_ops is not None:
            config, self._op_callback = self._ops_config(cross_device_ops, devices)
            _check(_lib().tutti_strategy_create_mirrored(num_local_replicas, ctypes.byref(config), ctypes.byref(h)))
        else:
            _check(_lib().tutti_strategy_create(kind, num_local_replicas, 0, ctypes.byref(h)))
        self._h = h
        self._kind = kind
        self._lock = threading.Lock()  # one run or reduce at a time
        self._placing = threading.Lock()  # an input thread's placement, which close waits for
        self._shrunk = False  # TF_CONFIG no longer says who this worker is
        total, local = ctypes.c_size_t(), ctypes.c_size_t()
        _check(_lib().tutti_strategy_num_replicas(h, ctypes.byref(total), ctypes.byref(local)))
        self._total, self._local = total.value, local.value

    def _ops_config(self, ops, devices):
        """The tutti_cross_device_ops_config of ``ops``, and the callback to keep alive."""
        kind, packs, group, to = ops._config()
        callback = None
        if kind is None:
            if type(ops).reduce_implementation is CrossDeviceOps.reduce_implementation:
                raise TypeError(f"{type(ops).__name__}: a CrossDeviceOps of your own implements "
                                "reduce_implementation(reduce_op, per_replica_value, ...)")
            import weakref
            me = weakref.ref(self)  # the strategy owns the callback: no cycle back to it

            def call(*args):
                s = me()
                return _FAILED if s is None else s._custom_all_reduce(*args)

            kind, callback = 5, _CROSS_DEVICE_OP_FN(call)
        if isinstance(ops, ReductionToOneDevice) and ops.reduce_to_device is not None:
            want = _device_spec(ops.reduce_to_device)
            if devices:
                listed = [_device_spec(d) for d in devices]
            else:  # the default devices: every GPU, else the CPU
                listed = [("gpu", d.index) for d in tutti.devices() if d.kind == "gpu"] or [
                    ("cpu", i) for i in range(want[1] + 1)]
            if want not in listed:
                raise ValueError(f"ReductionToOneDevice: {ops.reduce_to_device!r} is not one of the strategy's "
                                 f"devices {devices}")
            to = listed.index(want)
        config = _CrossDeviceOpsConfig(ctypes.sizeof(_CrossDeviceOpsConfig), kind, packs, group, to,
                                       type(ops).__name__.encode(), callback or _CROSS_DEVICE_OP_FN(), None)
        return config, callback

    def _custom_all_reduce(self, _user, op, dtype, count, values, num_values):
        """tutti_cross_device_op_fn over the caller's ``reduce_implementation``."""
        try:
            names = {v: k.upper() for k, v in tutti.OPS.items()}
            dt = np.dtype(_dtype_name(dtype))
            arrays = [np.ctypeslib.as_array(ctypes.cast(values[i], ctypes.POINTER(ctypes.c_uint8)),
                                            (count * dt.itemsize,)).view(dt) for i in range(num_values)]
            out = self._ops.reduce_implementation(names.get(op, str(op)), PerReplica([a.copy() for a in arrays]))
            out = np.asarray(out)
            if out.size != count:
                raise ValueError(f"{type(self._ops).__name__}.reduce_implementation returned {out.size} values "
                                 f"for {count}")
            for a in arrays:
                a[...] = out.reshape(-1).astype(dt)
            return 0
        except BaseException as e:  # noqa: BLE001 - raised again by run
            import traceback
            # The traceback keeps this frame's locals: drop the views of the replicas' buffers
            # (freed after the call), and the frames the op ran in.
            arrays = a = None  # noqa: F841
            traceback.clear_frames(e.__traceback__)
            self._op_error = e
            return _FAILED

    @property
    def num_replicas_in_sync(self):
        """How many replicas run in sync across the job (every worker's)."""
        return self._total

    @property
    def num_local_replicas(self):
        """How many replicas this process runs."""
        return self._local

    @contextlib.contextmanager
    def scope(self):
        """Make this the current strategy (``get_strategy()``) inside the ``with`` block."""
        stack = _stack()
        if stack and stack[-1] is not self:
            raise ValueError("Mixing different tf.distribute.Strategy objects: a scope of another strategy is open")
        stack.append(self)
        try:
            yield self
        finally:
            stack.pop()

    def run(self, fn, args=(), kwargs=None):
        """``fn(*args, **kwargs)`` once per local replica, in parallel; ``PerReplica``
        arguments give each replica its own value. Their results as a ``PerReplica`` (the
        value itself with one local replica)."""
        if getattr(_state, "replica", None) is not None:
            raise RuntimeError("strategy.run inside a replica function: call run from the cross-replica context")
        kwargs = kwargs or {}
        n = self._local
        results, errors = [None] * n, [None] * n
        run_steps = ({}, threading.Lock())

        def pick(v, i):
            if isinstance(v, PerReplica):
                if len(v.values) != n:
                    raise ValueError(f"a PerReplica of {len(v.values)} values for {n} local replicas")
                return v.values[i]
            return v

        def step(ctx, _user):
            replica, local = ctypes.c_size_t(), ctypes.c_size_t()
            try:
                _check(_lib().tutti_replica_id(ctx, ctypes.byref(replica), ctypes.byref(local)))
                # One local replica runs on the caller's own thread: its state comes back after.
                saved = getattr(_state, "replica", None), _stack()
                _state.replica = ReplicaContext(self, ctx, replica.value, local.value, run_steps)
                _state.stack = [self]
                try:
                    a = [pick(v, local.value) for v in args]
                    kw = {k: pick(v, local.value) for k, v in kwargs.items()}
                    results[local.value] = fn(*a, **kw)
                finally:
                    _state.replica, _state.stack = saved
                return 0
            except BaseException as e:  # noqa: BLE001 - handed to the caller of run
                errors[local.value if local.value < n else 0] = e
                # What the run's error (and, across workers, the other workers) says. Nothing may
                # escape the callback: ctypes would print it and count the step as done.
                try:
                    message = f"{type(e).__name__}: {e}"
                except BaseException:  # noqa: BLE001 - an exception whose str() fails
                    message = type(e).__name__
                try:
                    _lib().tutti_replica_set_error(ctx, message.encode("utf-8", "replace"))
                except BaseException:  # noqa: BLE001 - the step still fails, unexplained
                    pass
                return _FAILED

        callback = _REPLICA_FN(step)
        with self._cross_replica("run"):
            self._op_error = None
            result = _lib().tutti_strategy_run(self._handle(), callback, None)
            op_error, self._op_error = self._op_error, None
        raised = [e for e in errors if e is not None]
        if op_error is not None:
            raise op_error  # the caller's cross-device op raised it, on some replica's thread
        if raised:
            # The replica whose own function raised, rather than a sibling woken by it.
            own = [e for e in raised if not isinstance(e, tutti.TuttiError)]
            raise (own or raised)[0]
        _check(result)
        return results[0] if n == 1 else PerReplica(results)

    def experimental_local_results(self, value):
        """The values of this process's replicas, as a tuple."""
        return value.values if isinstance(value, PerReplica) else (value,)

    def reduce(self, reduce_op, value, axis=None):
        """``value`` combined across every replica in sync: a ``PerReplica`` (or one value the
        same on every replica) reduced with ``SUM`` or ``MEAN``; with ``axis``, each replica's
        value is reduced along that axis first (``MEAN`` then averages over every element along
        it, across the replicas)."""
        op = _reduce_op(reduce_op)
        if getattr(_state, "replica", None) is not None:
            raise RuntimeError("strategy.reduce inside a replica function: use the replica context's all_reduce")
        given = self.experimental_local_results(value)
        reduced = self._reduce_along(op, value, [_array(v) for v in given], axis)
        return _like(reduced, given[0]) if given else reduced

    def _reduce_along(self, op, value, parts, axis):
        if not isinstance(value, PerReplica):
            parts = parts * self._local
        if len(parts) != self._local:
            raise ValueError(f"reduce: {len(parts)} values for {self._local} local replicas")
        if axis is None:
            return self._reduce(op, parts)
        # Each replica's part first, along the axis: the parts may differ in length there (an
        # uneven last batch), not in what is left.
        summed = [np.asarray(np.sum(p, axis=axis, dtype=p.dtype)) for p in parts]
        total = self._reduce("SUM", summed)
        if op == "SUM":
            return total
        axes = np.atleast_1d(axis).tolist()
        # A count: integers (never a cross-device op of the caller's, which takes floats).
        along = self._reduce("SUM", [np.asarray(np.prod([p.shape[a] for a in axes]), np.int64) for p in parts])
        mean = total / along
        return np.asarray(mean.astype(total.dtype) if total.dtype.kind == "f" else mean)

    @property
    def cluster_resolver(self):
        """The cluster this strategy's workers form, as TensorFlow's strategies report it: under
        ``TF_CONFIG`` a ``TFConfigClusterResolver``; under another launcher a
        ``SimpleClusterResolver`` of ``worker`` tasks (their addresses unknown here: "") with
        this worker's ``task_id`` (so too after ``shrink``); ``None`` for a strategy of one
        worker's replicas."""
        if self._kind != _MULTI_WORKER:
            return None
        tutti_job = "TUTTI_RANK" in os.environ or "TUTTI_WORLD_SIZE" in os.environ  # the runtime's order
        # After a shrink TF_CONFIG no longer says who this worker is.
        if not tutti_job and not self._shrunk and os.environ.get("TF_CONFIG", "").strip():
            return TFConfigClusterResolver()
        worker, workers = self._worker()  # learnt when the strategy was made: no collective here
        return SimpleClusterResolver({"worker": [""] * workers}, task_type="worker", task_id=worker)

    def gather(self, value, axis):
        """``value`` (a ``PerReplica``, or one value the same on every replica) concatenated
        along ``axis`` across every replica in sync, in replica order (every worker's): the
        replicas' values may differ in length along ``axis`` only (an uneven last batch)."""
        if getattr(_state, "replica", None) is not None:
            raise RuntimeError("strategy.gather inside a replica function: call it from the cross-replica context")
        given = self.experimental_local_results(value)
        return _like(self._gather(value, [np.require(_array(v), requirements="C") for v in given], axis),
                     given[0] if given else None)

    def _gather(self, value, parts, axis):
        if not isinstance(value, PerReplica):
            parts = parts * self._local
        first = parts[0] if parts else np.zeros(0)
        problem = None
        if len(parts) != self._local:
            problem = f"gather: {len(parts)} values for {self._local} local replicas"
        elif first.ndim == 0 or not -first.ndim <= axis < first.ndim:
            problem = f"gather: axis {axis} is out of range for values of shape {first.shape}"
        else:
            axis %= first.ndim
            if any(p.ndim != first.ndim or p.dtype != first.dtype or _besides(p, axis) != _besides(first, axis)
                   for p in parts):
                problem = (
                    f"gather: the replicas' values differ other than in length along axis {axis}: "
                    + ", ".join(f"{p.shape} {p.dtype}" for p in parts)
                )
            elif first.dtype.name not in tutti.DTYPES or not first.dtype.isnative:
                problem = f"gather: dtype {first.dtype} is not one tutti moves (expected one of {', '.join(tutti.DTYPES)})"
        if self._total == self._local:
            if problem:
                raise ValueError(problem)
            return np.concatenate(parts, axis=axis)
        if problem:
            # Only to tell every worker, below: this worker's values are not gathered.
            parts, axis = [np.zeros(1, np.uint8)] * self._local, 0

        def step(part):
            return get_replica_context()._gather_along(part, axis, problem, "gather", "worker")

        out = self.run(step, args=(PerReplica(parts),))
        return np.ascontiguousarray(self.experimental_local_results(out)[0])

    def _worker(self):
        """This worker's index and the number of workers (replicas are numbered worker by
        worker: this worker's first replica id over its local count)."""
        if self._total == self._local:
            return 0, 1
        if getattr(self, "_worker_index", None) is None:
            ids = self.run(lambda: get_replica_context().replica_id_in_sync_group)
            self._worker_index = min(self.experimental_local_results(ids)) // self._local
        return self._worker_index, self._total // self._local

    def experimental_distribute_values_from_function(self, value_fn):
        """``value_fn(ValueContext)`` for each local replica, as a ``PerReplica`` (the value
        itself with one local replica)."""
        worker, _ = self._worker()
        values = [value_fn(ValueContext(worker * self._local + i, self._total)) for i in range(self._local)]
        return values[0] if self._local == 1 else PerReplica(values)

    def experimental_distribute_dataset(self, dataset, options=None):
        """``dataset`` (an iterable of global batches: numpy arrays, or tuples, lists or dicts
        of them, rows first; or a ``FileDataset``) split across every replica in sync, as a
        ``DistributedDataset`` whose elements are per-replica batches. How the workers share
        it follows ``options.auto_shard_policy`` (see ``AutoShardPolicy``)."""
        worker, workers = self._worker()
        options = options or InputOptions()
        if options.experimental_fetch_to_device:
            self._handle()  # a strategy that places nothing says why, now
        policy = _policy(options.auto_shard_policy)
        if policy == AutoShardPolicy.AUTO:
            files = isinstance(dataset, FileDataset) and len(dataset.files) >= workers
            policy = AutoShardPolicy.FILE if files else AutoShardPolicy.DATA
            if not files and workers > 1:
                warnings.warn(
                    "experimental_distribute_dataset: AUTO sharding found no files to shard (a FileDataset "
                    f"with at least {workers} files): sharding by DATA, every worker reads every element and "
                    "keeps its share",
                    stacklevel=2,
                )
        if policy == AutoShardPolicy.FILE:
            if not isinstance(dataset, FileDataset):
                raise ValueError("experimental_distribute_dataset: FILE sharding needs a tutti.distribute.FileDataset")
            if len(dataset.files) < workers:
                raise ValueError(
                    f"experimental_distribute_dataset: FILE sharding of {len(dataset.files)} files over {workers} "
                    "workers leaves a worker none; use DATA or more files"
                )
            if dataset.batch_size < workers:
                raise ValueError(
                    f"experimental_distribute_dataset: a global batch of {dataset.batch_size} rows cannot be "
                    f"shared by FILE among {workers} workers"
                )
            if len(dataset.files) % workers:
                warnings.warn(
                    f"experimental_distribute_dataset: {len(dataset.files)} files sharded by FILE over {workers} "
                    "workers, some reading one more: workers whose files hold more examples run more steps, "
                    "and a step then waits for the others",
                    stacklevel=2,
                )
        return DistributedDataset(self, dataset, policy, worker, workers, options)

    def distribute_datasets_from_function(self, dataset_fn, options=None):
        """``dataset_fn(InputContext)`` once on this worker (its input pipeline), an iterable of
        per-replica batches; each step hands the next one to each local replica, as a
        ``DistributedDataset``. Shard inside ``dataset_fn`` by ``input_pipeline_id``; size the
        batches with ``get_per_replica_batch_size``."""
        worker, workers = self._worker()
        if options is not None and options.experimental_fetch_to_device:
            self._handle()  # a strategy that places nothing says why, now
        ctx = InputContext(workers, worker, self._total)
        return DistributedDataset(self, dataset_fn(ctx), None, worker, workers, options)

    def _reduce(self, op, parts):
        parts = [np.require(p, requirements="C") for p in parts]  # 0-d stays 0-d
        first = parts[0]
        if any(p.shape != first.shape or p.dtype != first.dtype for p in parts):
            raise ValueError(
                "reduce: the replicas' values differ in shape or dtype: "
                + ", ".join(f"{p.shape} {p.dtype}" for p in parts)
            )
        _check_dtype(first.dtype, "reduce")
        out = np.empty_like(first)
        ptrs = (ctypes.c_void_p * len(parts))(*[p.ctypes.data for p in parts])
        code = tutti.OPS["sum" if op == "SUM" else "mean"]
        with self._cross_replica("reduce"):
            self._op_error = None
            result = _lib().tutti_strategy_reduce(self._handle(), out.size, tutti.DTYPES[first.dtype.name], code,
                                                  ptrs, out.ctypes.data_as(ctypes.c_void_p))
            op_error, self._op_error = self._op_error, None
        if op_error is not None:
            raise op_error  # the caller's cross-device op raised it
        _check(result)
        return out

    @contextlib.contextmanager
    def _cross_replica(self, what):
        """Hold the strategy for a call of the cross-replica context (one at a time); from a
        replica function, or while another thread's call holds it, an error rather than a wait
        that would never end."""
        if getattr(_state, "replica", None) is not None:
            raise RuntimeError(f"strategy.{what} inside a replica function: call it from the cross-replica context")
        if not self._lock.acquire(timeout=_lock_wait()):
            raise RuntimeError(f"strategy.{what}: another thread's run or reduce holds this strategy")
        try:
            yield
        finally:
            self._lock.release()

    def _handle(self):
        if not self._h:
            raise ValueError("this strategy is closed")
        return self._h

    def close(self):
        """Stop the replicas and release the strategy (also when it is garbage)."""
        with self._cross_replica("close"), self._placing:
            h, self._h = self._h, None
            if h:
                _lib().tutti_strategy_destroy(h)

    def _place_on(self, replica, value):
        """``value`` (an array) on local replica ``replica``'s device, as a ``DeviceTensor``,
        from any thread (an input pipeline's, while a step runs)."""
        a = np.ascontiguousarray(_array(value))
        _check_dtype(a.dtype, "place")
        h = ctypes.c_void_p()
        with self._placing:
            _check(_lib().tutti_strategy_place(self._handle(), replica, a.size, tutti.DTYPES[a.dtype.name],
                                               a.ctypes.data_as(ctypes.c_void_p), ctypes.byref(h)))
        return DeviceTensor._wrap(h.value, a.shape, a.dtype)

    def __del__(self):
        if sys.is_finalizing():
            return  # the library may be gone; the process ends anyway
        try:
            self.close()
        except Exception:  # noqa: BLE001 - never raise from a finalizer
            pass


class MirroredStrategy(Strategy):
    """A replica per device of this process, values combined by ``cross_device_ops``."""

    def __init__(self, devices=None, cross_device_ops=None):
        super().__init__(_MIRRORED, 0, cross_device_ops, _replicas(devices, "MirroredStrategy"))


class OneDeviceStrategy(Strategy):
    """One replica, on ``device``."""

    def __init__(self, device="cpu:0"):
        super().__init__(_ONE_DEVICE, 1, devices=_replicas([device], "OneDeviceStrategy"))


class CentralStorageStrategy(Strategy):
    """A replica per device, variables kept once on the CPU."""

    def __init__(self, compute_devices=None, parameter_device=None):
        if parameter_device is not None:
            _device_index(parameter_device)
        super().__init__(_CENTRAL_STORAGE, 0, devices=_replicas(compute_devices, "CentralStorageStrategy"))


class MultiWorkerMirroredStrategy(Strategy):
    """Replicas on the local devices of every worker of the job in the environment (``tutti
    launch``, torchrun, mpirun, srun, ``TF_CONFIG``), or of the cluster ``cluster_resolver``
    gives (any resolver naming this task: ``SimpleClusterResolver``, ``TFConfigClusterResolver``
    with ``task_type`` and ``task_id``); one worker where none is described. Its collectives
    across workers are as ``communication_options`` says (``CommunicationOptions``: the
    implementation, ``bytes_per_pack``, the packs an optimizer's gradients are summed in, and
    ``timeout_seconds``, the timeout of every wait of the strategy's collectives and of the
    workers' joining). ``devices`` (tutti's addition, as ``MirroredStrategy`` takes them) names
    each worker's local devices (``"xla:0"``, ``"gpu:1"``, ...); ``None``: every GPU, else the
    CPU, as TensorFlow's."""

    def __init__(self, cluster_resolver=None, communication_options=None, devices=None):
        if communication_options is not None and not isinstance(communication_options, CommunicationOptions):
            raise TypeError("communication_options must be a tutti.distribute.CommunicationOptions")
        options = communication_options or CommunicationOptions()
        tf_config = None  # the environment's cluster
        if cluster_resolver is not None and not (
            type(cluster_resolver) is TFConfigClusterResolver and not cluster_resolver._overridden
        ):
            spec = cluster_resolver.cluster_spec()
            if cluster_resolver.task_type is None or cluster_resolver.task_id is None:
                raise ValueError("MultiWorkerMirroredStrategy: the cluster_resolver names no task of this "
                                 "process (task_type and task_id)")
            tf_config = _tf_config(spec, cluster_resolver.task_type, cluster_resolver.task_id).encode()
        code = CommunicationOptions._CODES[options.implementation]
        # Milliseconds, at least one: 0 would mean the configured timeout.
        timeout_ms = 0 if options.timeout_seconds is None else max(1, round(float(options.timeout_seconds) * 1000))

        devices = _replicas(devices, "MultiWorkerMirroredStrategy")

        def create(h):
            if devices is None:
                _check(_lib().tutti_strategy_create_multi_worker_with_options(
                    tf_config, code, options.bytes_per_pack, timeout_ms, 0, ctypes.byref(h)))
            else:
                names = (ctypes.c_char_p * len(devices))(*[d.encode() for d in devices])
                _check(_lib().tutti_strategy_create_multi_worker_on_devices(
                    tf_config, code, options.bytes_per_pack, timeout_ms, names, len(devices), ctypes.byref(h)))

        super().__init__(_MULTI_WORKER, 0, _create=create)
        if options.bytes_per_pack:
            self._bytes_per_pack = options.bytes_per_pack
        self._worker()  # every worker makes the strategy: learn this one's index now, together

    def shrink(self):
        """Go on without restarting, after a ``run`` (or ``reduce``, or a variable's update)
        failed across workers and ended the workers' communicator: with the workers still alive
        after one was lost, or with the same workers after a mismatch or a worker's rejected
        call. Every surviving worker calls it; they are renumbered in their old order (the
        lowest is the chief), and ``num_replicas_in_sync`` and ``cluster_resolver`` follow.

        Then take the variables from the chief (``Variable(v.numpy())`` under this strategy
        makes one from the chief's value; or ``manager.restore_or_initialize()``), since the
        failed step may have completed on some workers only, and distribute the dataset again
        for the new number of replicas."""
        with self._cross_replica("shrink"), self._placing:  # no input thread places meanwhile
            _check(_lib().tutti_strategy_shrink(self._handle()))
            total, local = ctypes.c_size_t(), ctypes.c_size_t()
            _check(_lib().tutti_strategy_num_replicas(self._h, ctypes.byref(total), ctypes.byref(local)))
            self._total, self._local = total.value, local.value
            self._worker_index = None
            self._shrunk = True
        self._worker()


class VariableAggregation:
    """How the replicas' updates of a ``Variable`` combine inside ``run`` (TensorFlow's names)."""

    NONE = "NONE"
    SUM = "SUM"
    MEAN = "MEAN"
    ONLY_FIRST_REPLICA = "ONLY_FIRST_REPLICA"


def _aggregation(a):
    key = str(getattr(a, "value", a) if a is not None else "NONE").upper().rpartition(".")[2]
    if key not in ("NONE", "SUM", "MEAN", "ONLY_FIRST_REPLICA"):
        raise ValueError(f"aggregation {a!r} is not NONE, SUM, MEAN or ONLY_FIRST_REPLICA")
    return key


class _Assignable:
    """What ``Variable`` and ``DeviceVariable`` share: TensorFlow's ``assign*`` and reads over
    their ``_update(value, how)`` and ``numpy()``, and the checks of an update."""

    _kind = "Variable"  # as errors name it

    def read_value(self):
        """As ``numpy()``."""
        return self.numpy()

    value = read_value

    def __array__(self, dtype=None, copy=None):
        return self.numpy() if dtype is None else self.numpy().astype(dtype)

    def assign(self, value):
        """Set the variable (see the class documentation); returns it."""
        return self._update(value, "set")

    def assign_add(self, delta):
        """Add to the variable (see the class documentation); returns it."""
        return self._update(delta, "add")

    def assign_sub(self, delta):
        """Subtract from the variable (see the class documentation); returns it."""
        return self._update(delta, "sub")

    def _host(self, value):
        """``value`` as an update of this variable: an array of its dtype and shape."""
        given = _array(value)
        if not np.can_cast(given.dtype, self.dtype, "same_kind"):
            raise TypeError(f"{self._kind}.assign: an update of {given.dtype} does not fit a variable of {self.dtype}")
        u = np.require(given.astype(self.dtype), requirements="C")  # 0-d stays 0-d
        if u.shape != self.shape:
            raise ValueError(f"{self._kind}.assign: the update has shape {u.shape}, the variable {self.shape}")
        return u

    def _replica(self):
        """The running replica's context, if this is a replica of this variable's strategy; an
        error inside another strategy's run."""
        replica = getattr(_state, "replica", None)
        if replica is None or replica._ctx is None:
            return None
        if replica.strategy is not self._strategy:
            raise ValueError(f"{self._kind}: used inside the run of a strategy other than the one it was made under")
        return replica


class Variable(_Assignable):
    """A variable of the current strategy (``get_strategy()`` when it is made): under a
    ``MirroredStrategy`` or ``MultiWorkerMirroredStrategy`` one copy per local replica, under
    ``CentralStorageStrategy`` one copy, elsewhere one plain copy. Every worker starts from the
    chief's ``initial_value`` (worker 0's, broadcast when the variable is made, as TensorFlow,
    Horovod's broadcast and DDP do), so workers seeded differently train alike; a shape or dtype
    that differs from the chief's is an error.

    Inside ``run``, ``assign``, ``assign_add`` and ``assign_sub`` combine every replica's update
    by ``aggregation`` (``SUM``, ``MEAN``, ``ONLY_FIRST_REPLICA``; ``NONE`` refuses updates
    there) and apply the result to every copy alike; outside ``run`` the value given is applied
    to every copy. ``numpy()`` / ``read_value()`` give this replica's copy inside ``run``, the
    variable's value outside."""

    def __new__(cls, *args, **kwargs):
        # Made with an initial value (not copied or unpickled) under a ParameterServerStrategy.
        if cls is Variable and (args or kwargs) and isinstance(get_strategy(), ParameterServerStrategy):
            return object.__new__(_PsVariable)
        return object.__new__(cls)

    def __init__(self, initial_value, aggregation=VariableAggregation.NONE, dtype=None, name=None):
        self.name = name
        self.aggregation = _aggregation(aggregation)
        value = np.array(_array(initial_value), dtype=dtype, copy=True, order="C")
        _check_dtype(value.dtype, "Variable")
        if getattr(_state, "replica", None) is not None:
            raise RuntimeError("Variable: make variables in the cross-replica context (under scope(), not inside run)")
        strategy = get_strategy()
        self._strategy = strategy
        self._central = strategy._kind == _CENTRAL_STORAGE
        self._lock = threading.Lock()
        if strategy._total > strategy._local:
            value = self._chiefs(strategy, value)
        copies = 1 if self._central else strategy._local
        self._values = [value.copy() for _ in range(copies)]

    @staticmethod
    def _chiefs(strategy, value):
        """``value`` as the chief holds it, broadcast from replica 0 once every replica agrees
        with the chief's rank, size and dtype, then its shape: a difference is an error on every
        replica (each learns of it), never a collective that the others do not make."""
        header = np.array([value.ndim, value.size, tutti.DTYPES[value.dtype.name]], np.int64)
        what = "Variable: the initial value differs between workers"

        def step():
            ctx = get_replica_context()
            _agree(ctx, header, what, lambda h: f"has {h[0]} dimensions, {h[1]} elements of {_dtype_name(h[2])}")
            _agree(ctx, np.array(value.shape, np.int64), what, lambda d: f"shape {tuple(int(x) for x in d)}")
            return ctx._broadcast(value, 0)

        return strategy.experimental_local_results(strategy.run(step))[0]

    def _index(self):
        replica = self._replica()
        return 0 if replica is None or self._central else replica._local

    def numpy(self):
        """This replica's copy inside ``run``, else the variable's value (a new array)."""
        return self._values[self._index()].copy()

    @property
    def shape(self):
        return self._values[0].shape

    @property
    def dtype(self):
        return self._values[0].dtype

    def _update(self, value, how):
        u = self._host(value)
        replica = self._replica()
        if replica is not None:
            if self.aggregation == "MEAN" and self.dtype.kind != "f":
                raise ValueError(
                    f"Variable: MEAN aggregation of a {self.dtype} variable would truncate; use a float "
                    "variable or SUM"
                )
            if self.aggregation == "NONE":
                raise ValueError(
                    "Variable: an update inside run needs an aggregation (SUM, MEAN or ONLY_FIRST_REPLICA); "
                    "this variable has NONE"
                )
            if self.aggregation == "ONLY_FIRST_REPLICA":
                u = replica._broadcast(u, 0)
            else:
                u = replica.all_reduce(self.aggregation, u)
        self._apply_combined(replica, lambda i: u, how)
        return self

    def _apply_combined(self, replica, update_of, how):
        """Apply ``update_of(i)`` to copy ``i``, the replicas' updates already combined: inside
        ``run`` each replica to its own copy (central storage: the first local replica to the
        one copy, every replica waiting for it before reading on); outside, to every copy."""
        if replica is None:
            for i in range(len(self._values)):
                self._apply(i, update_of(i), how)
        elif self._central:
            if replica._local == 0:
                self._apply(0, update_of(0), how)
            replica.all_reduce("SUM", np.zeros(1, np.float32))
        else:
            self._apply(replica._local, update_of(replica._local), how)

    def _apply(self, i, u, how):
        with self._lock:
            v = self._values[i]
            if how == "set":
                v[...] = u
            elif how == "add":
                v += u
            else:
                v -= u

    def __repr__(self):
        return f"<tutti.distribute.Variable {self.name or ''} shape={self.shape} dtype={self.dtype} value={self.numpy()!r}>"


# tutti_assign and tutti_aggregation (include/tutti.h).
_ASSIGN = {"set": 0, "add": 1, "sub": 2}
_AGGREGATION = {"ONLY_FIRST_REPLICA": 0, "SUM": 1, "MEAN": 2}


class DeviceVariable(_Assignable):
    """A mirrored variable whose copies live in the replicas' device memory: a PJRT buffer per
    replica under ``TPUStrategy``, host memory for CPU replicas. Made under the current strategy
    (``get_strategy()``), from the chief's ``initial_value`` on every worker.

    Inside ``run``, ``assign``, ``assign_add`` and ``assign_sub`` take each replica's update (a
    ``DeviceTensor`` from ``ReplicaContext.place``, or an array, placed first), combine the
    replicas' updates by ``aggregation`` (``SUM``, ``MEAN``, ``ONLY_FIRST_REPLICA``; ``NONE``
    refuses updates there) and apply the result to every copy; on XLA devices that is one
    compiled program over the replicas' buffers, nothing copied through host memory. Outside
    ``run`` the value given is applied to every copy: across workers a collective that every
    worker makes, the chief's value applied on all.
    ``numpy()`` copies this replica's copy to the host inside ``run``, the value outside."""

    _kind = "DeviceVariable"

    def __init__(self, initial_value, aggregation=VariableAggregation.NONE, dtype=None, name=None):
        self.name = name
        self.aggregation = _aggregation(aggregation)
        value = np.array(_array(initial_value), dtype=dtype, copy=True, order="C")
        _check_dtype(value.dtype, "DeviceVariable")
        if getattr(_state, "replica", None) is not None:
            raise RuntimeError("DeviceVariable: make variables in the cross-replica context (under scope(), not "
                               "inside run)")
        if self.aggregation == "MEAN" and value.dtype.kind != "f":
            raise ValueError(f"DeviceVariable: MEAN aggregation of a {value.dtype} variable would truncate; use a "
                             "float variable or SUM")
        self._strategy = get_strategy()
        if self._strategy._total > self._strategy._local:
            # The chief's shape too (libtutti checks its length and dtype).
            value = Variable._chiefs(self._strategy, value)
        self.shape, self.dtype = value.shape, value.dtype
        h = ctypes.c_void_p()
        with self._strategy._cross_replica("DeviceVariable"):
            _check(_lib().tutti_strategy_device_variable(self._strategy._handle(), value.size,
                                                         tutti.DTYPES[value.dtype.name],
                                                         value.ctypes.data_as(ctypes.c_void_p), ctypes.byref(h)))
        self._h = h

    def read(self, replica=0):
        """Local replica ``replica``'s copy, copied to a new array."""
        out = np.empty(self.shape, self.dtype)
        _check(_lib().tutti_device_variable_read(self._h, replica, out.size, tutti.DTYPES[self.dtype.name],
                                                 out.ctypes.data_as(ctypes.c_void_p)))
        return out

    def numpy(self):
        """This replica's copy inside ``run``, else the variable's value (a new array)."""
        replica = self._replica()
        return self.read(0 if replica is None else replica._local)

    def _update(self, value, how):
        replica = self._replica()
        if replica is None:
            u = self._host(value)
            ptrs = (ctypes.c_void_p * self._strategy._local)(*[u.ctypes.data] * self._strategy._local)
            with self._strategy._cross_replica("DeviceVariable.assign"):
                _check(_lib().tutti_device_variable_update(self._strategy._handle(), self._h, _ASSIGN[how],
                                                           _AGGREGATION["ONLY_FIRST_REPLICA"], u.size,
                                                           tutti.DTYPES[self.dtype.name], ptrs))
            return self
        if self.aggregation == "NONE":
            raise ValueError("DeviceVariable: an update inside run needs an aggregation (SUM, MEAN or "
                             "ONLY_FIRST_REPLICA); this variable has NONE")
        if isinstance(value, DeviceTensor):
            if value.shape != self.shape or value.dtype != self.dtype:
                raise ValueError(f"DeviceVariable.assign: the update is {value!r}; the variable has shape "
                                 f"{self.shape} and dtype {self.dtype}")
            t = value
        else:
            t = replica.place(self._host(value))
        _check(_lib().tutti_device_variable_update_in(replica._ctx, self._h, _ASSIGN[how],
                                                      _AGGREGATION[self.aggregation], t._h))
        return self

    def __repr__(self):
        return f"<tutti.distribute.DeviceVariable {self.name or ''} shape={self.shape} dtype={self.dtype}>"

    def __del__(self):
        h, self._h = getattr(self, "_h", None), None
        if h is not None and h.value and _bound is not None:
            _bound.tutti_device_variable_destroy(h)


class Checkpoint:
    """TensorFlow's ``tf.train.Checkpoint``: the named objects to save and restore together,
    each a ``Variable``, a ``DeviceVariable``, a numpy array (restored in place) or an
    ``Optimizer``, in tutti's versioned checkpoint format (the README's "Checkpoints"). An
    optimizer is saved as its
    ``iterations`` and its state for each float ``Variable`` of the checkpoint (its slots, on
    the ps tasks under a ``ParameterServerStrategy``), named ``<optimizer>/<variable>/<slot>``
    (``momentum``; Adam's ``m``, ``v`` and ``t``), so that training resumes as if it had never
    stopped; restored from a checkpoint that holds none of an optimizer's state, it starts
    afresh, with a warning. Save and restore through a ``CheckpointManager``. ``step`` is the
    step of the checkpoint last saved or restored (0 before)."""

    def __init__(self, **objects):
        for name, obj in objects.items():
            if not isinstance(obj, (Variable, DeviceVariable, np.ndarray, Optimizer)):
                raise TypeError(
                    f"Checkpoint: {name} is a {type(obj).__name__}; checkpoint Variables, DeviceVariables, "
                    "numpy arrays and Optimizers"
                )
        self._objects = objects
        self.step = 0

    def _strategy(self):
        """The strategy the variables were made under (whose chief writes and reads)."""
        for obj in self._objects.values():
            if isinstance(obj, (Variable, DeviceVariable)):
                return obj._strategy
        return get_strategy()

    def _build(self, step):
        h = ctypes.c_void_p()
        _check(_lib().tutti_checkpoint_create(step, ctypes.byref(h)))
        try:
            for name, value in self._entries():
                # np.require keeps a 0-d value 0-d (np.ascontiguousarray makes it 1-d).
                value = np.require(value, requirements="C")
                _check_dtype(value.dtype, f"Checkpoint: {name}")
                shape = (ctypes.c_size_t * max(value.ndim, 1))(*value.shape)
                _check(_lib().tutti_checkpoint_insert(h, name.encode(), tutti.DTYPES[value.dtype.name],
                                                      value.ndim, shape, value.ctypes.data_as(ctypes.c_void_p)))
            self._save_device_state(h)
        except BaseException:
            _lib().tutti_checkpoint_destroy(h)
            raise
        return h

    def _optimized(self):
        """(optimizer name, optimizer, [(variable name, variable)]): each optimizer of the
        checkpoint with the float variables whose state it keeps."""
        variables = [(n, v) for n, v in self._objects.items() if isinstance(v, Variable) and v.dtype.kind == "f"]
        return [(n, o, variables) for n, o in self._objects.items() if isinstance(o, Optimizer)]

    def _device_groups(self):
        """The checkpoint's float ``DeviceVariable``s, (name, variable) in groups of one dtype."""
        groups = {}
        for n, v in self._objects.items():
            if isinstance(v, DeviceVariable) and v.dtype.kind == "f":
                groups.setdefault(v.dtype, []).append((n, v))
        return list(groups.values())

    @staticmethod
    def _device_call(call, h, oname, opt, group):
        """libtutti's optimizer of ``opt`` saving to (or restoring from) the checkpoint at ``h``
        its state of the ``DeviceVariable``s of ``group``, under ``oname``."""
        names = (ctypes.c_char_p * len(group))(*[n.encode() for n, _ in group])
        handles = (ctypes.c_void_p * len(group))(*[v._h.value for _, v in group])
        _check(call(opt._device_handle(opt.learning_rate), h, oname.encode(), len(group), names, handles))

    def _save_device_state(self, h):
        """Each optimizer's state of the checkpoint's ``DeviceVariable``s (one that stepped or
        restored some: libtutti keeps it), in the names and format of the other variables'."""
        for oname, opt in self._objects.items():
            if isinstance(opt, Optimizer) and opt._device is not None:
                for group in self._device_groups():
                    self._device_call(_lib().tutti_optimizer_save, h, oname, opt, group)

    def _device_restores(self, h, optimized):
        """(optimizer name, optimizer, group) of each restore of ``DeviceVariable`` state the
        checkpoint at ``h`` holds, every entry checked first (present for every variable of the
        group, of the variable's size and the slots' dtype, a count of steps): a refusal leaves
        everything as it was. A group of which the checkpoint holds no state (saved before the
        variables were DeviceVariables, say) starts afresh, with a warning."""
        plan = []
        for oname, opt, _ in optimized:
            if not opt._slot_names and not opt._counts_steps:
                continue  # plain SGD keeps no state but the iterations, restored with the others
            for group in self._device_groups():
                def entry(name):
                    code, ndim = ctypes.c_uint32(), ctypes.c_size_t()
                    if _lib().tutti_checkpoint_variable(h, name.encode(), ctypes.byref(code), ctypes.byref(ndim),
                                                        None, 0) != 0:
                        return None
                    dims = (ctypes.c_size_t * max(ndim.value, 1))()
                    _check(_lib().tutti_checkpoint_variable(h, name.encode(), None, None, dims, ndim.value))
                    return _dtype_name(code.value), int(np.prod([dims[i] for i in range(ndim.value)]))
                held = [entry(f"{oname}/{n}/{opt._slot_names[0] if opt._slot_names else 't'}") for n, _ in group]
                if all(e is None for e in held):
                    warnings.warn(f"Checkpoint: no state of optimizer {oname!r} for DeviceVariables "
                                  f"{', '.join(n for n, _ in group)}; it starts afresh", stacklevel=4)
                    continue
                for n, v in group:
                    for slot in opt._slot_names:
                        name, want = f"{oname}/{n}/{slot}", (opt._slot_dtype(v).name, int(np.prod(v.shape)))
                        if entry(name) != want:
                            raise ValueError(f"Checkpoint: {name} is {entry(name) or 'missing'}; here it is "
                                             f"{want[0]} of {want[1]} elements")
                    if opt._counts_steps:
                        name = f"{oname}/{n}/t"
                        if entry(name) != ("int64", 1):
                            raise ValueError(f"Checkpoint: {name} is {entry(name) or 'missing'}, not a count of steps")
                        t = np.zeros(1, np.int64)
                        _check(_lib().tutti_checkpoint_read(h, name.encode(), tutti.DTYPES["int64"], 1,
                                                            t.ctypes.data_as(ctypes.c_void_p)))
                        if not 0 <= int(t[0]) < 2**31:
                            raise ValueError(f"Checkpoint: {name} is {int(t[0])}, not a count of steps")
                plan.append((oname, opt, group))
        return plan

    def _entries(self):
        """(name, value) of everything saved: the variables and arrays, then each optimizer's
        iterations and state."""
        for name, obj in self._objects.items():
            if not isinstance(obj, Optimizer):
                yield name, obj.numpy() if isinstance(obj, (Variable, DeviceVariable)) else obj
        for oname, opt, variables in self._optimized():
            yield f"{oname}/iterations", np.array(opt.iterations, np.int64)
            for vname, var in variables:
                slots, steps = opt._state(var)
                for slot, x in zip(opt._slot_names, slots):
                    yield f"{oname}/{vname}/{slot}", x
                if opt._counts_steps:
                    yield f"{oname}/{vname}/t", np.array(steps, np.int64)

    def _load(self, h):
        """Every object's value from the checkpoint at ``h``, checked, then assigned: an object
        the checkpoint lacks or holds at another shape or dtype is an error and nothing is
        assigned."""
        values = {}
        wanted = [(n, o.shape, o.dtype) for n, o in self._objects.items() if not isinstance(o, Optimizer)]
        optimized = []
        for oname, opt, variables in self._optimized():
            code, ndim = ctypes.c_uint32(), ctypes.c_size_t()
            if _lib().tutti_checkpoint_variable(h, f"{oname}/iterations".encode(), ctypes.byref(code),
                                                ctypes.byref(ndim), None, 0) != 0:
                # Saved without this optimizer (before optimizers were saved, say): it starts
                # afresh, as TensorFlow's does when a checkpoint lacks its slots.
                warnings.warn(f"Checkpoint: no state of optimizer {oname!r} in the checkpoint; it starts afresh",
                              stacklevel=3)
                continue
            optimized.append((oname, opt, variables))
            wanted.append((f"{oname}/iterations", (), np.int64))
            for vname, var in variables:
                wanted += [(f"{oname}/{vname}/{slot}", var.shape, opt._slot_dtype(var)) for slot in opt._slot_names]
                if opt._counts_steps:
                    wanted.append((f"{oname}/{vname}/t", (), np.int64))
        for name, want_shape, want_dtype in wanted:
            obj = self._objects.get(name)
            if isinstance(obj, np.ndarray) and not obj.flags.writeable:
                raise ValueError(f"Checkpoint: {name} is a read-only array; restore needs to write into it")
            code, ndim = ctypes.c_uint32(), ctypes.c_size_t()
            _check(_lib().tutti_checkpoint_variable(h, name.encode(), ctypes.byref(code), ctypes.byref(ndim), None, 0))
            dims = (ctypes.c_size_t * max(ndim.value, 1))()
            _check(_lib().tutti_checkpoint_variable(h, name.encode(), None, None, dims, ndim.value))
            shape = tuple(dims[i] for i in range(ndim.value))
            saved = _dtype_name(code.value)
            if shape != tuple(want_shape) or saved != np.dtype(want_dtype).name:
                raise ValueError(
                    f"Checkpoint: {name} was saved as {saved} of shape {shape}; here it is "
                    f"{np.dtype(want_dtype).name} of shape {tuple(want_shape)}"
                )
            out = np.empty(shape, np.dtype(want_dtype).newbyteorder("="))  # the file's order
            _check(_lib().tutti_checkpoint_read(h, name.encode(), code.value, out.size,
                                                out.ctypes.data_as(ctypes.c_void_p)))
            values[name] = out
        for oname, opt, variables in optimized:
            counts = [(f"{oname}/iterations", 2**63)] + [(f"{oname}/{v}/t", 2**31) for v, _ in variables]
            for name, most in counts[:len(counts) if opt._counts_steps else 1]:
                if not 0 <= int(values[name]) < most:
                    raise ValueError(f"Checkpoint: {name} is {int(values[name])}, not a count of steps")
        device_restores = self._device_restores(h, optimized)
        # The optimizers first: under a ParameterServerStrategy the ps tasks check their state
        # again, and a refusal there then leaves the variables as they were. (A ps task lost
        # part-way leaves what it had set.)
        for oname, opt, group in device_restores:
            self._device_call(_lib().tutti_optimizer_restore, h, oname, opt, group)
        for oname, opt, variables in optimized:
            for vname, var in variables:
                slots = [values[f"{oname}/{vname}/{slot}"] for slot in opt._slot_names]
                steps = int(values[f"{oname}/{vname}/t"]) if opt._counts_steps else 0
                opt._set_state(var, slots, steps)
            opt.iterations = int(values[f"{oname}/iterations"])
        for name, obj in self._objects.items():
            if isinstance(obj, (Variable, DeviceVariable)):
                obj.assign(values[name])
            elif isinstance(obj, np.ndarray):
                obj[...] = values[name]
        step = ctypes.c_uint64()
        _check(_lib().tutti_checkpoint_step(h, ctypes.byref(step)))
        self.step = step.value


def _checkpoints_in(directory):
    """(step, path) of each checkpoint in ``directory``, by step."""
    found = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    for n in names:
        # Only the names written: the step in ASCII decimal, no sign or leading zeros.
        m = re.fullmatch(r"ckpt-(0|[1-9][0-9]*)\.tutti", n, re.ASCII)
        if m and int(m.group(1)) < 2**64:
            found.append((int(m.group(1)), os.path.join(directory, n)))
    return sorted(found)


def checkpoints_iterator(checkpoint_dir, min_interval_secs=0, timeout=None, timeout_fn=None):
    """TensorFlow's ``tf.train.checkpoints_iterator``: the path of each new checkpoint of
    ``checkpoint_dir`` (the latest whenever it is newer, by step, than the last yielded), at
    least ``min_interval_secs`` apart. After ``timeout`` seconds without one, it ends, unless
    ``timeout_fn()`` returns false (then it waits again)."""
    import time
    last, since = None, time.monotonic()
    while True:
        found = _checkpoints_in(checkpoint_dir)
        if found and (last is None or found[-1][0] > last):
            last = found[-1][0]
            yielded = time.monotonic()
            yield found[-1][1]
            time.sleep(max(0.0, min_interval_secs - (time.monotonic() - yielded)))
            since = time.monotonic()
            continue
        if timeout is not None and time.monotonic() - since >= timeout:
            if timeout_fn is None or timeout_fn():
                return
            since = time.monotonic()
        time.sleep(0.05)


class SidecarEvaluator:
    """TensorFlow's ``SidecarEvaluator`` for the ``evaluator`` task of a TF_CONFIG job: beside
    the training, restores each new checkpoint the chief saves in ``checkpoint_dir`` into
    ``checkpoint``'s objects and calls ``evaluate(step)``. ``start()`` returns the number of
    evaluations once ``max_evaluations`` are done or a checkpoint of ``last_step`` or later was
    evaluated; waiting ``timeout`` seconds (default ``TUTTI_TIMEOUT``, else 300) for a new one is
    then a ``TimeoutError``, and the end where neither bound is given."""

    def __init__(self, checkpoint, checkpoint_dir, evaluate, max_evaluations=None, last_step=None, timeout=None):
        if not isinstance(checkpoint, Checkpoint):
            raise TypeError("SidecarEvaluator: checkpoint must be a tutti.distribute.Checkpoint")
        self._manager = CheckpointManager(checkpoint, checkpoint_dir)
        self._evaluate, self._max, self._last_step = evaluate, max_evaluations, last_step
        self._timeout = float(timeout if timeout is not None else os.environ.get("TUTTI_TIMEOUT", 300))

    def start(self):
        """Evaluate the checkpoints as they come (see the class documentation)."""
        count, last = 0, None
        if self._max is not None and self._max <= 0:
            return 0
        for path in checkpoints_iterator(self._manager.directory, timeout=self._timeout):
            try:
                step = self._manager.restore_or_initialize()  # the latest: perhaps newer still
            except tutti.TuttiError:
                if os.path.exists(path) and self._manager.latest_checkpoint == path:
                    raise
                continue  # removed by the chief's manager meanwhile: a newer one is there
            if step is None or (last is not None and step <= last):
                continue
            self._evaluate(step)
            count, last = count + 1, step
            if (self._max is not None and count >= self._max) or (
                    self._last_step is not None and step >= self._last_step):
                return count
        if self._max is None and self._last_step is None:
            return count
        raise TimeoutError(f"SidecarEvaluator: no new checkpoint in {self._manager.directory} within "
                           f"{self._timeout} s (evaluated: {'step ' + str(last) if last is not None else 'none yet'}); "
                           "is the chief still training and saving there?")


def _writer(strategy):
    """The strategy whose chief writes and reads checkpoints: none (this process alone) under a
    ParameterServerStrategy, whose coordinator alone holds the variables."""
    return None if isinstance(strategy, ParameterServerStrategy) else strategy._handle()


class CheckpointManager:
    """TensorFlow's ``tf.train.CheckpointManager``: ``checkpoint`` saved in ``directory`` as
    ``ckpt-<step>.tutti``, the last ``max_to_keep`` by step kept; with ``checkpoint_interval``
    (and a ``step_counter``), at most one save every that many steps. Under a multi-worker strategy
    every worker calls ``save`` and ``restore_or_initialize``: the chief writes (every worker
    raises its error if it could not) and the chief reads (every worker receives what it read,
    so the workers need no shared file system)."""

    def __init__(self, checkpoint, directory, max_to_keep=5, checkpoint_interval=None, step_counter=None):
        if not isinstance(checkpoint, Checkpoint):
            raise TypeError("CheckpointManager: checkpoint must be a tutti.distribute.Checkpoint")
        if max_to_keep is None or int(max_to_keep) < 1:
            raise ValueError(f"CheckpointManager: max_to_keep {max_to_keep!r}: keep at least 1")
        if checkpoint_interval is not None:
            if int(checkpoint_interval) < 1:
                raise ValueError(f"CheckpointManager: checkpoint_interval {checkpoint_interval!r}: at least 1 step")
            if step_counter is None:
                raise ValueError("CheckpointManager: step_counter must be provided if checkpoint_interval is")
        self._checkpoint = checkpoint
        self.directory = str(directory)
        self._max = int(max_to_keep)
        self._interval = None if checkpoint_interval is None else int(checkpoint_interval)
        self._step_counter = step_counter
        self._last_saved = None  # the step this manager last saved at, for the interval

    @property
    def checkpoint_interval(self):
        """Steps between saves (``save`` skips a save that comes sooner), or None."""
        return self._interval

    def _step_now(self):
        """The step counter's value: a ``Variable``, an array, a number or a callable of one."""
        c = self._step_counter
        c = c() if callable(c) and not hasattr(c, "numpy") else c
        return int(np.asarray(c.numpy() if hasattr(c, "numpy") else c).reshape(-1)[0])

    @property
    def checkpoints(self):
        """The checkpoints in the directory, oldest (lowest step) first."""
        return [p for _, p in _checkpoints_in(self.directory)]

    @property
    def latest_checkpoint(self):
        """The latest checkpoint's path (highest step), or None."""
        c = self.checkpoints
        return c[-1] if c else None

    def save(self, checkpoint_number=None, check_interval=True):
        """Save every object of the checkpoint at step ``checkpoint_number`` (default: the step
        counter's value under a ``checkpoint_interval``, else one past the checkpoint's ``step``); returns
        the path written (by the chief). With a ``checkpoint_interval``, a save fewer steps of
        the step counter after the last one this manager saved is skipped (returns None) unless
        ``check_interval`` is False: call it every step, on every worker."""
        now = None
        if self._interval is not None:
            now = self._step_now()
            if check_interval and self._last_saved is not None and now < self._last_saved + self._interval:
                return None
            if checkpoint_number is None:
                checkpoint_number = now
        step = self._checkpoint.step + 1 if checkpoint_number is None else int(checkpoint_number)
        if not 0 <= step < 2**64:
            raise ValueError(f"CheckpointManager.save: checkpoint_number {step} is not a step (0 to 2**64 - 1)")
        strategy = self._checkpoint._strategy()
        h = self._checkpoint._build(step)
        try:
            with strategy._cross_replica("save"):
                _check(_lib().tutti_checkpoint_save(_writer(strategy), self.directory.encode(), self._max, h))
        finally:
            _lib().tutti_checkpoint_destroy(h)
        self._checkpoint.step = step
        if now is not None:
            self._last_saved = now  # counted once saved: a failed save does not use the interval up
        return os.path.join(self.directory, f"ckpt-{step}.tutti")

    def restore_or_initialize(self):
        """Restore the latest checkpoint into the objects and return its step; where there is
        none, leave them as they are and return None."""
        strategy = self._checkpoint._strategy()
        h = ctypes.c_void_p()
        with strategy._cross_replica("restore"):
            _check(_lib().tutti_checkpoint_restore(_writer(strategy), self.directory.encode(), ctypes.byref(h)))
        if not h.value:
            return None
        try:
            self._checkpoint._load(h)
        finally:
            _lib().tutti_checkpoint_destroy(h)
        return self._checkpoint.step


def compute_average_loss(per_example_loss, global_batch_size=None):
    """TensorFlow's ``tf.nn.compute_average_loss``: the sum of this replica's per-example losses
    over the global batch size, so that the gradients summed across replicas are those of the
    global batch's mean loss. Without ``global_batch_size``, this replica's examples times the
    replicas in sync (right only where every replica has as many: pass it for an uneven last
    batch); a size of 0 gives 0. Inside a scope but outside ``run``, ``global_batch_size`` is
    required, as in TensorFlow. A torch tensor's loss stays a torch tensor, on its graph (its
    gradients flow back through it)."""
    torch = sys.modules.get("torch")
    native = torch is not None and isinstance(per_example_loss, torch.Tensor)
    losses = per_example_loss if native else np.asarray(per_example_loss)
    if global_batch_size is None:
        replica = get_replica_context()
        if replica is None:
            raise ValueError("compute_average_loss: pass global_batch_size in the cross-replica context")
        global_batch_size = (losses.shape[0] if losses.ndim else 1) * replica.num_replicas_in_sync
    if global_batch_size < 0:
        raise ValueError(f"compute_average_loss: global_batch_size {global_batch_size} is negative")
    if native:
        total = losses.sum(dtype=None if losses.is_floating_point() else torch.float64)
    else:
        total = losses.sum(dtype=losses.dtype if losses.dtype.kind == "f" else np.float64)
    return total / global_batch_size if global_batch_size else total * 0


class Optimizer:
    """A strategy-aware optimizer (Keras's habits): ``apply_gradients([(grad, variable), ...])``
    inside ``run`` sums each gradient across every replica in sync (compute the loss with
    ``compute_average_loss`` so the sum is the global batch's gradient), then takes the same step
    on every copy of each ``Variable``; outside ``run`` it applies the gradients as given. Each
    copy keeps its own slots (momentum, moments), updated alike, so the copies stay identical.

    ``learning_rate`` is a number or a schedule: a callable of the steps taken (``iterations``)
    returning the step's rate, as Keras calls a ``LearningRateSchedule`` (Keras's own schedules
    serve). Setting ``optimizer.learning_rate`` between steps takes effect at the next step, on
    ``DeviceVariable``s' devices too; reading it gives the rate the next step takes. Under
    ``ParameterServerStrategy`` each worker's copy of the optimizer counts its own steps."""

    def __init__(self, learning_rate):
        self.iterations = 0
        self.learning_rate = learning_rate
        self._slots = {}
        self._lock = threading.Lock()
        import secrets
        # The key of its slots on the ps tasks: made here, so every copy sent to a worker has it.
        self._ps_slots = secrets.randbits(63)
        self._device = None  # libtutti's optimizer, for DeviceVariables: made at first use

    def __getstate__(self):
        # A copy sent to a worker with a scheduled function: everything but the lock and the
        # state of its DeviceVariables (this process's).
        return {k: v for k, v in self.__dict__.items() if k not in ("_lock", "_device", "_device_rule")}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._device = None

    @property
    def learning_rate(self):
        """The learning rate the next step takes: the number set, or the schedule's at
        ``iterations``. Set a number or a schedule (see the class documentation)."""
        return self._rate_at(self.iterations)

    @learning_rate.setter
    def learning_rate(self, value):
        if not callable(value):
            value = _rate_checked(value, f"{type(self).__name__}: learning_rate")
        self._learning_rate = value

    def _step_number(self, replica):
        """The number of the step ``replica`` (the running replica's context, or None) takes now,
        counted as taken: the optimizer's steps when the run's replicas first stepped with it,
        plus those this replica has taken with it since. The same on every replica of a step
        however far apart they run (one may begin its next step before replica 0 has counted
        the last)."""
        if replica is None or replica._run is None:
            return self.iterations
        steps, lock = replica._run
        with lock:  # the first replica of the run sees the count before any has added to it
            base = steps.setdefault(self, self.iterations)
        k = replica._taken.get(self, 0)
        replica._taken[self] = k + 1
        return base + k

    def _rate_at(self, step):
        """The learning rate of step ``step``, checked finite and not negative."""
        rate = self._learning_rate
        if not callable(rate):
            return rate
        return _rate_checked(rate(step), f"{type(self).__name__}: step {step}: the schedule's learning_rate")

    def _device_handle(self, lr):
        """libtutti's optimizer of the same rule, which steps DeviceVariables on their devices
        and keeps their slots there, at learning rate ``lr`` from its next step."""
        try:
            rule = self._ps_update(lr)
        except TypeError:
            raise TypeError(f"apply_gradients: {type(self).__name__} cannot step a DeviceVariable (SGD, with or "
                            "without momentum, and Adam can)") from None
        fields = tuple(getattr(rule, f) for f, _ in _PsUpdate._fields_ if f not in ("slots", "learning_rate"))
        with self._lock:
            if self._device is None:
                h = ctypes.c_void_p()
                _check(_lib().tutti_optimizer_create(ctypes.byref(rule), ctypes.byref(h)))
                self._device, self._device_rule = h, fields
            elif fields != self._device_rule:
                raise ValueError(f"{type(self).__name__}: a hyper-parameter other than the learning rate changed "
                                 "after it first stepped a DeviceVariable, whose steps keep the rule they began "
                                 "with; make a new optimizer (carry its state over with a Checkpoint)")
            # Every replica of the step sets the same rate, before any of them takes it.
            _check(_lib().tutti_optimizer_set_learning_rate(self._device, ctypes.c_float(lr)))
            return self._device

    def __del__(self):
        h, self._device = getattr(self, "_device", None), None
        if h is not None and h.value and _bound is not None:
            _bound.tutti_optimizer_destroy(h)

    def _slot(self, var, i, name):
        key = (var, i, name)  # the variable itself: an id could be reused by a later one
        with self._lock:
            if key not in self._slots:
                self._slots[key] = np.zeros(var.shape, self._slot_dtype(var))
            return self._slots[key]

    def apply_gradients(self, grads_and_vars):
        """Apply the gradients (see the class documentation); returns the iteration count."""
        pairs = [(g, v) for g, v in grads_and_vars if g is not None]  # Keras skips a None gradient
        lr = self._rate_at(self._step_number(getattr(_state, "replica", None)))
        # The DeviceVariables' checked first: a refusal leaves every variable as it was.
        on_devices = self._device_groups([(g, v) for g, v in pairs if isinstance(v, DeviceVariable)], lr)
        pairs = [(g, v) for g, v in pairs if not isinstance(v, DeviceVariable)]
        for g, v in pairs:
            if not isinstance(v, Variable):
                raise TypeError(f"apply_gradients: {type(v).__name__} is not a tutti.distribute.Variable")
            replica = v._replica()  # an error inside another strategy's run
        replica = getattr(_state, "replica", None)
        if replica is not None and replica._ctx is None:
            replica = None  # the default strategy's one replica: nothing to combine
        for g, v in pairs:
            if v.dtype.kind != "f":
                raise TypeError(f"apply_gradients: variable {v.name or ''} is {v.dtype}; optimizers step float variables")
            if np.shape(g) != v.shape:
                raise ValueError(f"apply_gradients: a gradient of shape {np.shape(g)} for a variable of shape {v.shape}")
        if replica is not None:
            sums = _summed_in_packs(replica, [np.asarray(g, v.dtype) for g, v in pairs])
            pairs = [(g, v) for g, (_, v) in zip(sums, pairs)]
        for g, v in pairs:
            g = np.asarray(g, v.dtype)
            if isinstance(v, _PsVariable):
                v._push(g, self._ps_update(lr))  # stepped on the ps tasks, with the slots kept there
                continue
            # In the slots' arithmetic (float32 for a float16 variable, as on the ps tasks and
            # in Rust), the copy rounded to its dtype once, after the step.
            g = g.astype(self._slot_dtype(v), copy=False)
            v._apply_combined(replica, lambda i, g=g, v=v: self._step(v, i, g, lr), "sub")
        if on_devices:
            device_replica, groups = on_devices
            h = self._device_handle(lr)
            for group in groups:  # one call per dtype, in the same order on every replica
                n = len(group)
                grads = (ctypes.c_void_p * n)(*[t._h.value for t, _ in group])
                variables = (ctypes.c_void_p * n)(*[v._h.value for _, v in group])
                _check(_lib().tutti_optimizer_apply_device_gradients(device_replica._ctx, h, n, grads, variables))
        with self._lock:
            if replica is None or replica._local == 0:
                self.iterations += 1
            return self.iterations

    def _device_groups(self, pairs, lr):
        """``DeviceVariable``s' gradients checked for a step inside ``run``: each a
        ``DeviceTensor`` (summed in place) or an array (placed on the replica's device), grouped
        by dtype for libtutti's optimizer, which sums each where it lies and steps each copy on its
        device with its slots there (one compiled program on an XLA device). ``None`` for none;
        else the replica and the groups."""
        if not pairs:
            return None
        replica = None
        for _, v in pairs:
            replica = v._replica()  # an error inside another strategy's run
        if replica is None:
            raise ValueError("apply_gradients: DeviceVariables step inside strategy.run, where each replica has "
                             "its gradient")
        self._device_handle(lr)  # an optimizer libtutti cannot run, or whose rule changed: an error now
        groups = {}
        for g, v in pairs:
            if v.dtype.kind != "f":
                raise TypeError(f"apply_gradients: variable {v.name or ''} is {v.dtype}; optimizers step float "
                                "variables")
            if isinstance(g, DeviceTensor):
                if g.shape != v.shape or g.dtype != v.dtype:
                    raise ValueError(f"apply_gradients: the gradient {g!r} for a variable of shape {v.shape} and "
                                     f"dtype {v.dtype}")
                t = g
            else:
                t = replica.place(v._host(g))
            groups.setdefault(v.dtype, []).append((t, v))
        return replica, list(groups.values())

    def _step(self, var, i, g, lr):
        """What copy ``i`` of ``var`` loses this step, at learning rate ``lr``, from the combined
        gradient ``g``."""
        raise NotImplementedError

    # The names of the slots it keeps per variable, as a checkpoint names them, and whether it
    # counts each variable's steps (Adam's ``t``).
    _slot_names = ()
    _counts_steps = False

    def _state(self, var):
        """Its state for ``var`` as a checkpoint keeps it: each slot (zeros before the first
        step) and the steps taken. A mirrored variable's copies are alike: the first stands for
        all."""
        names = self._slot_names
        if not names and not self._counts_steps:
            return [], 0
        if isinstance(var, _PsVariable):
            return var._strategy._read_slots(var._ps_index, self._ps_update(self.learning_rate), len(names), var.shape,
                                             var.dtype == np.float64)
        with self._lock:
            slots = [self._slots.get((var, 0, n)) for n in names]
            steps = getattr(self, "_steps", {}).get((var, 0), 0)
        return [np.zeros(var.shape, self._slot_dtype(var)) if x is None else x.copy() for x in slots], steps

    def _slot_dtype(self, var):
        """The dtype of its slots for ``var``, the arithmetic of its steps: float64 for a float64
        variable, else float32 (a float16 variable's too, as on the ps tasks and in Rust, so
        that a checkpoint's optimizer state reads alike everywhere)."""
        return np.dtype(np.float64 if var.dtype == np.float64 else np.float32)

    def _set_state(self, var, slots, steps):
        """Take ``slots`` and ``steps`` (checked by the caller) as its state for ``var``."""
        if not self._slot_names and not self._counts_steps:
            return
        if isinstance(var, _PsVariable):
            var._strategy._assign_slots(var._ps_index, self._ps_update(self.learning_rate), slots, steps,
                                        var.dtype == np.float64)
            return
        with self._lock:
            for i in range(len(var._values)):
                for n, x in zip(self._slot_names, slots):
                    self._slots[(var, i, n)] = np.array(x, self._slot_dtype(var))
                if self._counts_steps:
                    self._steps[(var, i)] = int(steps)

    def _ps_update(self, lr):
        """The rule at learning rate ``lr`` the ps tasks step a ``ParameterServerStrategy`` variable by, keyed by this
        optimizer (its copies on the workers share the key, and so the slots)."""
        raise TypeError(f"apply_gradients: {type(self).__name__} has no update rule the ps tasks run "
                        "(SGD, with or without momentum, and Adam have)")


def _rate_checked(value, what):
    """``value`` as a learning rate (a float); an error naming it as ``what`` where it is not a
    number, or negative or not finite (0 is one: a warm-up's first step may take it)."""
    try:
        rate = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{what} {value!r} is not a number") from None
    if not 0 <= rate < float("inf"):
        raise ValueError(f"{what} {rate} must be finite and not negative")
    return rate


def _summed_in_packs(replica, arrays):
    """``arrays`` each summed across the replicas in sync, those next to each other of one dtype
    in one collective of at most the strategy's ``bytes_per_pack`` (an array larger than that
    alone): fewer, larger collectives, as TensorFlow packs them. Every replica packs alike."""
    most = max(1, replica._strategy._bytes_per_pack)
    packs, out = [], [None] * len(arrays)
    for i, a in enumerate(arrays):
        last = packs[-1] if packs else None
        if last and last[0] == a.dtype and last[1] + a.nbytes <= most:
            last[2].append(i)
            last[1] += a.nbytes
        else:
            packs.append([a.dtype, a.nbytes, [i]])
    for dtype, _, members in packs:
        if len(members) == 1:
            out[members[0]] = replica.all_reduce("SUM", arrays[members[0]])
            continue
        flat = replica.all_reduce("SUM", np.concatenate([arrays[i].ravel() for i in members]))
        at = 0
        for i in members:
            n = arrays[i].size
            out[i] = flat[at : at + n].reshape(arrays[i].shape)
            at += n
    return out


class SGD(Optimizer):
    """Keras's SGD: ``w -= lr * g``; with ``momentum``, ``v = momentum * v - lr * g; w += v``
    (``nesterov``: ``w += momentum * v - lr * g``)."""

    def __init__(self, learning_rate=0.01, momentum=0.0, nesterov=False):
        super().__init__(learning_rate)
        self.momentum, self.nesterov = float(momentum), bool(nesterov)
        if not 0.0 <= self.momentum <= 1.0:
            raise ValueError(f"SGD: momentum {momentum} must be in [0, 1]")
        self._slot_names = ("momentum",) if self.momentum else ()

    def _ps_update(self, lr):
        return _PsUpdate(rule=0, learning_rate=lr, momentum=self.momentum, nesterov=int(self.nesterov),
                         slots=self._ps_slots)

    def _step(self, var, i, g, lr):
        if not self.momentum:
            return lr * g
        v = self._slot(var, i, "momentum")
        v[...] = self.momentum * v - lr * g
        return -(self.momentum * v - lr * g) if self.nesterov else -v


class Adam(Optimizer):
    """Keras's Adam: moments ``m``, ``v`` per copy, the step ``lr * sqrt(1 - b2^t) / (1 - b1^t) *
    m / (sqrt(v) + epsilon)``."""

    def __init__(self, learning_rate=0.001, beta_1=0.9, beta_2=0.999, epsilon=1e-7):
        super().__init__(learning_rate)
        self.beta_1, self.beta_2, self.epsilon = float(beta_1), float(beta_2), float(epsilon)
        for name, beta in (("beta_1", self.beta_1), ("beta_2", self.beta_2)):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"Adam: {name} {beta} must be in [0, 1)")
        if not 0.0 < self.epsilon < float("inf"):
            raise ValueError(f"Adam: epsilon {epsilon} must be positive and finite")
        self._steps = {}

    _slot_names = ("m", "v")
    _counts_steps = True

    def _ps_update(self, lr):
        return _PsUpdate(rule=1, learning_rate=lr, beta_1=self.beta_1, beta_2=self.beta_2,
                         epsilon=self.epsilon, slots=self._ps_slots)

    def _step(self, var, i, g, lr):
        m, v = self._slot(var, i, "m"), self._slot(var, i, "v")
        with self._lock:  # the copy's own step count
            step = self._steps[(var, i)] = self._steps.get((var, i), 0) + 1
        m[...] = self.beta_1 * m + (1 - self.beta_1) * g
        v[...] = self.beta_2 * v + (1 - self.beta_2) * g * g
        lr = lr * np.sqrt(1 - self.beta_2**step) / (1 - self.beta_1**step)
        return (lr * m / (np.sqrt(v) + self.epsilon)).astype(m.dtype, copy=False)


class Metric:
    """A metric whose value is read across replicas (TensorFlow's sync on read): each local
    replica accumulates its own state inside ``run`` (or the first outside it), and ``result()``,
    in the cross-replica context, sums the states of every replica in sync, every worker's."""

    _width = 2  # total, count

    def __init__(self, name=None):
        self.name = name
        self._strategy = get_strategy()
        self._lock = threading.Lock()
        self.reset_state()

    def _index(self):
        replica = getattr(_state, "replica", None)
        if replica is None or replica._ctx is None:
            return 0
        if replica.strategy is not self._strategy:
            raise ValueError("Metric: updated inside the run of a strategy other than the one it was made under")
        return replica._local

    def _add(self, *values):
        i = self._index()
        with self._lock:
            self._states[i] += np.asarray(values, np.float64)

    def reset_state(self):
        """Back to no observations."""
        self._states = [np.zeros(self._width, np.float64) for _ in range(self._strategy._local)]

    def result(self):
        """The metric over every replica's observations: outside ``run``, and, being a reduce
        across workers, on every worker."""
        if getattr(_state, "replica", None) is not None:
            raise RuntimeError("Metric.result inside a replica function: read metrics in the cross-replica context")
        states = self._states
        total = self._strategy.reduce("SUM", PerReplica(states) if len(states) > 1 else states[0])
        return self._finish(total)

    def _finish(self, total):
        return np.float64(total[0] / total[1]) if total[1] else np.float64(0.0)


class Mean(Metric):
    """The (weighted) mean of every value observed."""

    def update_state(self, values, sample_weight=None):
        v = np.asarray(values, np.float64)
        w = np.ones_like(v) if sample_weight is None else np.broadcast_to(np.asarray(sample_weight, np.float64), v.shape)
        self._add((v * w).sum(), w.sum())


class Sum(Metric):
    """The sum of every value observed."""

    def update_state(self, values):
        self._add(np.asarray(values, np.float64).sum(), 0.0)

    def _finish(self, total):
        return np.float64(total[0])


class SparseCategoricalAccuracy(Metric):
    """How often the largest of ``y_pred``'s last axis is at the label ``y_true``."""

    def update_state(self, y_true, y_pred):
        labels = np.asarray(y_true).reshape(-1)
        if not len(labels):
            return  # a replica's empty share of a short last batch
        guess = np.asarray(y_pred).reshape(len(labels), -1).argmax(axis=-1)
        self._add(float((guess == labels).sum()), float(len(labels)))


class _Namespace:
    def __init__(self, **members):
        self.__dict__.update(members)


optimizers = _Namespace(Optimizer=Optimizer, SGD=SGD, Adam=Adam)
class TPUClusterResolver(SimpleClusterResolver):
    """TensorFlow's ``TPUClusterResolver``: which TPU. ``None``, ``""``, ``"local"`` are this
    host's, reached through its PJRT plugin (libtpu on a TPU VM; else the plugin
    ``TUTTI_PJRT_PLUGIN`` names, with ``TUTTI_PJRT_OPTIONS``). A remote TPU (a name a cloud API
    resolves, ``grpc://host:port``) is refused, saying why: run on the TPU VM itself."""

    def __init__(self, tpu=None, zone=None, project=None, job_name="worker", coordinator_name=None,
                 coordinator_address=None, credentials="default", service=None, discovery_url=None):
        t = (tpu or "").strip() if isinstance(tpu, (str, type(None))) else str(tpu)
        if t not in ("", "local", "localhost"):
            raise ValueError(f"TPU {t!r} not available: tutti reaches TPUs through this host's PJRT plugin "
                             "(libtpu on a TPU VM), not over the network: run on the TPU VM with tpu='' "
                             "(or 'local')")
        super().__init__({}, "local", job_name, 0)

    def master(self, task_type=None, task_id=None, rpc_layer=None):
        return "local"


class Topology:
    """TensorFlow's ``tf.tpu.experimental.Topology``, as ``initialize_tpu_system`` found it."""

    def __init__(self, num_cores, num_tasks, num_tpus_per_task):
        self.num_cores, self.num_tasks, self.num_tpus_per_task = num_cores, num_tasks, num_tpus_per_task

    def __repr__(self):
        return (f"Topology(num_cores={self.num_cores}, num_tasks={self.num_tasks}, "
                f"num_tpus_per_task={self.num_tpus_per_task})")


def initialize_tpu_system(cluster_resolver=None):
    """TensorFlow's ``tf.tpu.experimental.initialize_tpu_system``: open this host's TPU (or PJRT
    plugin) devices and return their ``Topology``; initializing again warns that it loses what
    the devices hold. A ``TuttiError`` (``TUTTI_ERROR_UNAVAILABLE``) where there is no plugin, or
    the library was built without XLA."""
    if cluster_resolver is not None and not isinstance(cluster_resolver, TPUClusterResolver):
        raise TypeError("initialize_tpu_system takes a TPUClusterResolver")
    cores, tasks, per = ctypes.c_size_t(), ctypes.c_size_t(), ctypes.c_size_t()
    _check(_lib().tutti_tpu_initialize(ctypes.byref(cores), ctypes.byref(tasks), ctypes.byref(per)))
    return Topology(cores.value, tasks.value, per.value)


class TPUStrategy(Strategy):
    """TensorFlow's ``TPUStrategy``: a replica per device of this host's TPU (or PJRT plugin),
    the replica context's collectives compiled as XLA programs on every device at once."""

    def __init__(self, tpu_cluster_resolver=None, experimental_device_assignment=None,
                 experimental_spmd_xla_partitioning=False):
        if tpu_cluster_resolver is not None and not isinstance(tpu_cluster_resolver, TPUClusterResolver):
            raise TypeError("TPUStrategy takes a TPUClusterResolver")
        if experimental_device_assignment is not None or experimental_spmd_xla_partitioning:
            raise ValueError("TPUStrategy: tutti runs a replica on every device (no device assignment or SPMD "
                             "partitioning)")
        super().__init__(_TPU, 0)


cluster_resolver = _Namespace(  # noqa: F811 - TensorFlow's module of the same name
    ClusterSpec=ClusterSpec, SimpleClusterResolver=SimpleClusterResolver, TFConfigClusterResolver=TFConfigClusterResolver,
    TPUClusterResolver=TPUClusterResolver,
)
tpu = _Namespace(experimental=_Namespace(initialize_tpu_system=initialize_tpu_system, Topology=Topology))
metrics = _Namespace(Metric=Metric, Mean=Mean, Sum=Sum, SparseCategoricalAccuracy=SparseCategoricalAccuracy)


def _dtype_name(code):
    return {v: k for k, v in tutti.DTYPES.items()}.get(int(code), f"dtype {code}")


_default = None
_default_lock = threading.Lock()


def get_strategy():
    """The strategy of the innermost open scope (or of the running replica), else the default
    strategy: one object, one replica, the caller."""
    stack = _stack()
    if stack:
        return stack[-1]
    global _default
    with _default_lock:
        if _default is None:
            _default = Strategy(_DEFAULT)
        return _default


def has_strategy():
    """Whether a strategy other than the default is current."""
    stack = _stack()
    return bool(stack) and stack[-1] is not _default


def in_cross_replica_context():
    """Whether this is the cross-replica context: inside a scope, not inside ``run``."""
    return bool(_stack()) and getattr(_state, "replica", None) is None


def get_replica_context():
    """The running replica's context inside ``run``; ``None`` in a cross-replica context; outside
    any scope, the default strategy's one replica."""
    replica = getattr(_state, "replica", None)
    if replica is not None:
        return replica
    if _stack():
        return None
    return ReplicaContext(get_strategy(), None, 0)


# ----- ParameterServerStrategy -----
#
# Every task runs the same script. Workers and ps tasks serve (``Server(...).join()``); the chief
# makes the strategy, its variables (held on the ps tasks, in shards) and a ``ClusterCoordinator``
# that schedules functions on the workers. A scheduled function travels to a worker by value
# (cloudpickle), over connections that proved the job's token; there it reads the variables as
# pulled for its step, and its ``assign_sub`` (an optimizer's step) goes back to the ps tasks as
# that step's update. Its return value comes back as the ``RemoteValue``.

_PS_STEP_FN = ctypes.CFUNCTYPE(ctypes.c_uint32, ctypes.c_void_p, ctypes.c_void_p)
_size_p = ctypes.POINTER(ctypes.c_size_t)
_PROTOTYPES.update({
    "tutti_ps_strategy_create": (ctypes.c_uint32, [ctypes.c_char_p, ctypes.c_uint32, ctypes.c_size_t,
                                                   ctypes.c_uint64, ctypes.POINTER(ctypes.c_void_p)]),
    "tutti_ps_strategy_destroy": (None, [ctypes.c_void_p]),
    "tutti_ps_run_role": (ctypes.c_uint32, [ctypes.c_void_p, _PS_STEP_FN, ctypes.c_void_p,
                                            ctypes.POINTER(ctypes.c_void_p)]),
    "tutti_ps_step_info": (ctypes.c_uint32, [ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint64), _size_p,
                                             _size_p, _size_p]),
    "tutti_ps_step_variable": (ctypes.c_uint32, [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_uint32),
                                                 ctypes.POINTER(ctypes.c_void_p), _size_p]),
    "tutti_ps_step_payload": (ctypes.c_uint32, [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), _size_p]),
    "tutti_ps_step_set_gradient": (ctypes.c_uint32, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint32,
                                                     ctypes.c_void_p, ctypes.c_size_t]),
    "tutti_ps_step_push": (ctypes.c_uint32, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint32, ctypes.c_void_p,
                                             ctypes.c_size_t, ctypes.c_void_p]),
    "tutti_ps_step_set_output": (ctypes.c_uint32, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]),
    "tutti_ps_step_set_error": (ctypes.c_uint32, [ctypes.c_void_p, ctypes.c_char_p]),
    "tutti_ps_coordinator_num_workers": (ctypes.c_uint32, [ctypes.c_void_p, _size_p]),
    "tutti_ps_coordinator_create_variable": (ctypes.c_uint32, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_uint32,
                                                               ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t,
                                                               ctypes.c_void_p, _size_p, _size_p]),
    "tutti_ps_coordinator_read_variable": (ctypes.c_uint32, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint32,
                                                             ctypes.c_void_p, ctypes.c_size_t]),
    "tutti_ps_coordinator_assign_variable": (ctypes.c_uint32, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint32,
                                                               ctypes.c_void_p, ctypes.c_size_t]),
    "tutti_strategy_create_multi_worker_with_options": (ctypes.c_uint32, [ctypes.c_char_p, ctypes.c_uint32,
                                                                          ctypes.c_size_t, ctypes.c_uint64,
                                                                          ctypes.c_size_t,
                                                                          ctypes.POINTER(ctypes.c_void_p)]),
    "tutti_strategy_create_multi_worker_on_devices": (ctypes.c_uint32, [ctypes.c_char_p, ctypes.c_uint32,
                                                                        ctypes.c_size_t, ctypes.c_uint64,
                                                                        ctypes.POINTER(ctypes.c_char_p),
                                                                        ctypes.c_size_t,
                                                                        ctypes.POINTER(ctypes.c_void_p)]),
    "tutti_strategy_create_multi_worker": (ctypes.c_uint32, [ctypes.c_char_p, ctypes.c_uint32, ctypes.c_size_t,
                                                             ctypes.POINTER(ctypes.c_void_p)]),
    "tutti_ps_coordinator_push": (ctypes.c_uint32, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint32,
                                                    ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]),
    "tutti_ps_coordinator_read_slots": (ctypes.c_uint32, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
                                                          ctypes.c_uint32, ctypes.c_void_p, ctypes.c_void_p,
                                                          ctypes.c_size_t, ctypes.POINTER(ctypes.c_uint32),
                                                          ctypes.POINTER(ctypes.c_uint32)]),
    "tutti_ps_coordinator_assign_slots": (ctypes.c_uint32, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p,
                                                            ctypes.c_uint32, ctypes.c_void_p, ctypes.c_void_p,
                                                            ctypes.c_size_t, ctypes.c_uint32]),
    "tutti_ps_coordinator_schedule": (ctypes.c_uint32, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                                        ctypes.POINTER(ctypes.c_void_p)]),
    "tutti_ps_coordinator_join": (ctypes.c_uint32, [ctypes.c_void_p]),
    "tutti_ps_coordinator_fetch": (ctypes.c_uint32, [ctypes.c_void_p, ctypes.c_void_p,
                                                     ctypes.POINTER(ctypes.c_float), ctypes.c_void_p,
                                                     ctypes.c_size_t, _size_p]),
    "tutti_ps_remote_value_destroy": (None, [ctypes.c_void_p]),
    "tutti_ps_coordinator_shutdown": (ctypes.c_uint32, [ctypes.c_void_p]),
})
__all__ += ["ParameterServerStrategy", "ClusterCoordinator", "RemoteValue", "Server", "experimental",
            "coordinator"]


def _pickler():
    try:
        import cloudpickle
    except ImportError:
        raise ImportError("ParameterServerStrategy sends scheduled functions to the workers with cloudpickle: "
                          "pip install cloudpickle (a dependency of the tutti package)") from None
    return cloudpickle


def _tf_config(spec, task_type, task_id):
    """The TF_CONFIG text of ``task_type``:``task_id`` in the cluster ``spec``."""
    cluster = spec.as_dict() if isinstance(spec, ClusterSpec) else ClusterSpec(spec).as_dict()
    return json.dumps({"cluster": cluster, "task": {"type": task_type, "index": int(task_id)}})


class FixedShardsPartitioner:
    """TensorFlow's: ``num_shards`` shards (no more than the first dimension)."""

    def __init__(self, num_shards):
        if int(num_shards) < 1:
            raise ValueError(f"FixedShardsPartitioner: num_shards {num_shards} must be at least 1")
        self._num_shards = int(num_shards)

    def __call__(self, shape, dtype, axis=0):
        return _partitions(shape, axis, max(1, min(self._num_shards, shape[axis])))


class MinSizePartitioner:
    """TensorFlow's: shards of at least ``min_shard_bytes``, at most ``max_shards``."""

    def __init__(self, min_shard_bytes=256 << 10, max_shards=1, bytes_per_string=16):
        if int(min_shard_bytes) < 1 or int(max_shards) < 1:
            raise ValueError("MinSizePartitioner: min_shard_bytes and max_shards must be at least 1")
        self._min, self._max = int(min_shard_bytes), int(max_shards)

    def __call__(self, shape, dtype, axis=0):
        total = int(np.prod(shape)) * np.dtype(dtype).itemsize
        return _partitions(shape, axis, max(1, min(self._max, shape[axis], total // self._min)))


class MaxSizePartitioner:
    """TensorFlow's: as few shards as keep each within ``max_shard_bytes``, at most
    ``max_shards`` (when given)."""

    def __init__(self, max_shard_bytes, max_shards=None, bytes_per_string=16):
        if int(max_shard_bytes) < 1 or (max_shards is not None and int(max_shards) < 1):
            raise ValueError("MaxSizePartitioner: max_shard_bytes and max_shards must be at least 1")
        self._max_bytes, self._max = int(max_shard_bytes), max_shards

    def __call__(self, shape, dtype, axis=0):
        row = int(np.prod(shape[axis + 1:])) * np.dtype(dtype).itemsize
        rows_per_shard = max(1, self._max_bytes // max(row, 1))
        n = -(-shape[axis] // rows_per_shard)
        if self._max is not None:
            n = min(n, int(self._max))
        return _partitions(shape, axis, max(1, n))  # 1 for an empty axis too


def _partitions(shape, axis, n):
    out = [1] * len(shape)
    out[axis] = n
    return out


experimental = _Namespace(partitioners=_Namespace(FixedShardsPartitioner=FixedShardsPartitioner,
                                                  MinSizePartitioner=MinSizePartitioner,
                                                  MaxSizePartitioner=MaxSizePartitioner),
                          ParameterServerStrategy=None, coordinator=None)

_ps_state = threading.local()  # .step: the step a worker is running on this thread
# The dtypes parameter-server variables hold, by their tutti_dtype codes (numpy has no bfloat16).
_PS_DTYPES = {np.dtype(np.float32): 0, np.dtype(np.float64): 1, np.dtype(np.float16): 2}


class _PsUpdate(ctypes.Structure):
    """``tutti_ps_update``: how the ps tasks step a variable (rule 0: SGD, 1: Adam)."""
    _fields_ = [("struct_size", ctypes.c_size_t), ("rule", ctypes.c_uint32), ("learning_rate", ctypes.c_float),
                ("momentum", ctypes.c_float), ("nesterov", ctypes.c_uint32), ("beta_1", ctypes.c_float),
                ("beta_2", ctypes.c_float), ("epsilon", ctypes.c_float), ("reserved", ctypes.c_uint32),
                ("slots", ctypes.c_uint64)]

    def __init__(self, **fields):
        super().__init__(struct_size=ctypes.sizeof(_PsUpdate), **fields)

_ps_iterators = {}  # a worker's iterators of per-worker datasets, by id
_ps_iterators_lock = threading.Lock()


class _PsStep:
    """A step running on a worker: its variables as pulled, and the updates it makes."""

    def __init__(self, handle):
        self._h = handle
        number, worker, workers, nvars = ctypes.c_uint64(), ctypes.c_size_t(), ctypes.c_size_t(), ctypes.c_size_t()
        _check(_lib().tutti_ps_step_info(handle, ctypes.byref(number), ctypes.byref(worker), ctypes.byref(workers),
                                         ctypes.byref(nvars)))
        self.step, self.worker, self.num_workers = number.value, worker.value, workers.value
        self._nvars = nvars.value
        self.updates = {}  # index -> what this step's assign* took from it (the variable's dtype)
        self.pushes = []  # (index, gradient, _PsUpdate) of apply_gradients

    def value(self, index, shape, dtype):
        if index >= self._nvars:
            raise ValueError(f"variable {index}: the job has {self._nvars} (made after this worker joined?)")
        code, ptr, n = ctypes.c_uint32(), ctypes.c_void_p(), ctypes.c_size_t()
        _check(_lib().tutti_ps_step_variable(self._h, index, ctypes.byref(code), ctypes.byref(ptr),
                                             ctypes.byref(n)))
        if code.value != _PS_DTYPES[np.dtype(dtype)]:
            raise TypeError(f"variable {index}: the ps tasks hold dtype code {code.value}, not {dtype}")
        nbytes = n.value * np.dtype(dtype).itemsize
        if nbytes == 0:
            return np.zeros(shape, dtype)
        held = (ctypes.c_char * nbytes).from_address(ptr.value)  # valid while the step runs
        return np.frombuffer(held, dtype).reshape(shape).copy()

    def subtract(self, index, delta):
        """What this step takes from variable ``index``, summed over its updates."""
        self.updates[index] = self.updates.get(index, 0) + np.asarray(delta)

    def push(self, index, gradient, update):
        """A gradient the ps tasks step variable ``index`` by with ``update`` (a ``_PsUpdate``)."""
        self.pushes.append((index, gradient, update))


def _ps_run_step(handle, _user):
    """A worker's step: run the scheduled function on this step's variables, send its updates
    and its return value back; an exception becomes the step's error (the worker stays)."""
    import traceback
    try:
        step = _PsStep(handle)
        ptr, n = ctypes.c_void_p(), ctypes.c_size_t()
        _check(_lib().tutti_ps_step_payload(handle, ctypes.byref(ptr), ctypes.byref(n)))
        if n.value == 0:
            raise ValueError("a step without a scheduled function (the coordinator is not tutti.distribute's)")
        # Set before unpickling: a per-worker iterator is made there, for this worker.
        _ps_state.step = step
        try:
            fn, args, kwargs = _pickler().loads(ctypes.string_at(ptr, n.value))
            result = fn(*args, **kwargs)
        finally:
            _ps_state.step = None
        for index, delta in step.updates.items():
            g = np.ascontiguousarray(delta).reshape(-1)
            _check(_lib().tutti_ps_step_set_gradient(handle, index, _PS_DTYPES[g.dtype],
                                                     g.ctypes.data_as(ctypes.c_void_p), g.size))
        for index, gradient, update in step.pushes:
            g = np.ascontiguousarray(gradient).reshape(-1)
            _check(_lib().tutti_ps_step_push(handle, index, _PS_DTYPES[g.dtype], g.ctypes.data_as(ctypes.c_void_p),
                                             g.size, ctypes.byref(update)))
        out = _pickler().dumps(_fetched(result))
        _check(_lib().tutti_ps_step_set_output(handle, out, len(out)))
        return 0
    except BaseException as e:  # noqa: BLE001 - the step's error, sent to the coordinator
        text = "".join(traceback.format_exception(type(e), e, e.__traceback__))
        _lib().tutti_ps_step_set_error(handle, text.encode("utf-8", "replace"))
        return _FAILED


def _fetched(value):
    """A step's return value as the coordinator gets it: variables read, structures kept."""
    if isinstance(value, Variable):
        return value.numpy()
    if isinstance(value, (list, tuple)):
        return type(value)(_fetched(v) for v in value)
    if isinstance(value, dict):
        return {k: _fetched(v) for k, v in value.items()}
    return value


def _ps_role(tf_config, partitioner=0, value=1):
    """Create this task's parameter-server strategy and take its role: the coordinator's handle
    on the chief (and the strategy's), ``None`` once a ps task's or worker's job is over."""
    s = ctypes.c_void_p()
    _check(_lib().tutti_ps_strategy_create(tf_config.encode(), partitioner, value, 0, ctypes.byref(s)))
    callback = _PS_STEP_FN(_ps_run_step)
    coordinator = ctypes.c_void_p()
    try:
        _check(_lib().tutti_ps_run_role(s, callback, None, ctypes.byref(coordinator)))
    finally:
        _lib().tutti_ps_strategy_destroy(s)
    return coordinator if coordinator.value else None


class Server:
    """TensorFlow's ``tf.distribute.Server`` for the ``worker`` and ``ps`` tasks of a
    ``ParameterServerStrategy`` job: ``join()`` serves (a worker runs the functions the
    coordinator schedules; a ps task holds variables' shards) until the coordinator shuts the job
    down, and returns then. A lost ps task ends it with a ``TuttiError`` naming that task."""

    def __init__(self, server_or_cluster_def, job_name=None, task_index=None, protocol=None, config=None,
                 start=True):
        if job_name not in ("worker", "ps"):
            raise ValueError(f"Server: job_name {job_name!r}: tutti serves the 'worker' and 'ps' tasks "
                             "(the chief makes a ParameterServerStrategy)")
        self._tf_config = _tf_config(server_or_cluster_def, job_name, task_index or 0)

    def join(self):
        """Serve until the coordinator shuts the job down."""
        _ps_role(self._tf_config)


class ParameterServerStrategy(Strategy):
    """TensorFlow's ``ParameterServerStrategy`` on the chief (the coordinator): ``Variable``s made
    under ``scope()`` live on the ps tasks, in shards (``variable_partitioner``: one of
    ``experimental.partitioners`` or any ``(shape, dtype) -> shards per axis`` callable; ``None``:
    one shard). A ``ClusterCoordinator`` schedules functions on the workers, which run
    ``Server(...).join()``; the job ends when the strategy is closed (also at exit). Variables are
    float32, float64 or float16. An optimizer's ``apply_gradients`` (``SGD``, with or without
    momentum, and ``Adam``) runs on the ps tasks, which keep its slots beside each shard (Adam
    counts its steps per shard); a scheduled function sees those steps from its next run on. A
    scheduled function carries a copy of what it uses: an optimizer's ``iterations`` counts on
    that copy, not on the chief's."""

    def __init__(self, cluster_resolver=None, variable_partitioner=None):
        resolver = cluster_resolver if cluster_resolver is not None else TFConfigClusterResolver()
        if resolver.task_type != "chief":
            raise ValueError(f"ParameterServerStrategy: made on the chief (this task is {resolver.task_type!r}); "
                             "workers and ps tasks run tutti.distribute.Server(...).join()")
        if variable_partitioner is not None and not callable(variable_partitioner):
            raise TypeError("variable_partitioner must be a partitioner (a callable of shape and dtype)")
        self._resolver = resolver
        self._partitioner = variable_partitioner
        self._kind = "ps"
        self._total = self._local = 1
        self._lock = threading.Lock()
        self._h = None  # no tutti_strategy: the coordinator's handle is _coordinator's
        self._calls = threading.Condition()
        self._in_flight = 0
        self._coordinator = _ps_role(_tf_config(resolver.cluster_spec(), "chief", resolver.task_id or 0))
        self._variables = 0
        import atexit
        import weakref
        ref = weakref.ref(self)
        atexit.register(lambda: ref() is not None and ref().close())

    @property
    def cluster_resolver(self):
        return self._resolver

    def _handle(self):
        raise ValueError("not available under ParameterServerStrategy: its replicas are the functions the "
                         "ClusterCoordinator schedules on the workers")

    @contextlib.contextmanager
    def _coordinator_handle(self):
        """The coordinator's handle, for one call: ``close`` waits for the calls in flight."""
        with self._calls:
            if not self._coordinator:
                raise ValueError("this ParameterServerStrategy is closed")
            self._in_flight += 1
        try:
            yield self._coordinator
        finally:
            with self._calls:
                self._in_flight -= 1
                self._calls.notify_all()

    @property
    def num_workers(self):
        """The workers in the job now."""
        n = ctypes.c_size_t()
        with self._coordinator_handle() as h:
            _check(_lib().tutti_ps_coordinator_num_workers(h, ctypes.byref(n)))
        return n.value

    def run(self, fn, args=(), kwargs=None):
        if getattr(_ps_state, "step", None) is None:
            raise RuntimeError("ParameterServerStrategy.run runs inside a function scheduled with "
                               "ClusterCoordinator.schedule, on a worker")
        return fn(*args, **(kwargs or {}))

    def reduce(self, reduce_op, value, axis=None):
        op = _reduce_op(reduce_op)
        if axis is None:
            return value
        v = _array(value)
        out = np.sum(v, axis=axis) if op == "SUM" else np.mean(v, axis=axis).astype(v.dtype)
        return _like(np.asarray(out), value)

    def experimental_local_results(self, value):
        return tuple(value.values) if isinstance(value, PerReplica) else (value,)

    def __reduce__(self):
        # A scheduled function that uses the strategy uses the worker's side of it.
        return (_worker_strategy, ())

    def _create_variable(self, name, value):
        shards = 0
        if self._partitioner is not None and value.ndim > 0:
            parts = list(self._partitioner(value.shape, value.dtype))
            if len(parts) != value.ndim or any(int(p) < 1 for p in parts) or sum(int(p) > 1 for p in parts) > 1:
                raise ValueError(f"variable_partitioner gave {parts} for shape {value.shape}: one count per "
                                 "axis, at least 1, more than 1 on one axis at most")
            shards = int(np.prod(parts))
        shards = min(shards, value.size) if shards else (1 if self._partitioner is None else 0)
        index, n = ctypes.c_size_t(), ctypes.c_size_t()
        with self._lock, self._coordinator_handle() as h:
            # No rule of its own: a step's assign* deltas are subtracted as they come.
            _check(_lib().tutti_ps_coordinator_create_variable(
                h, (name or f"Variable:{self._variables}").encode(), _PS_DTYPES[value.dtype],
                value.ctypes.data_as(ctypes.c_void_p), value.size, shards, None, ctypes.byref(index),
                ctypes.byref(n)))
            self._variables += 1
        return index.value, n.value

    def _assign_variable(self, index, value, dtype):
        v = np.ascontiguousarray(value, dtype)
        with self._coordinator_handle() as h:
            _check(_lib().tutti_ps_coordinator_assign_variable(h, index, _PS_DTYPES[v.dtype],
                                                               v.ctypes.data_as(ctypes.c_void_p), v.size))

    def _push_variable(self, index, gradient, update):
        """Step variable ``index`` on the ps tasks by ``gradient`` with ``update`` (``None``:
        subtract it), as a step's push does."""
        g = np.ascontiguousarray(gradient)
        with self._coordinator_handle() as h:
            _check(_lib().tutti_ps_coordinator_push(h, index, _PS_DTYPES[g.dtype], g.ctypes.data_as(ctypes.c_void_p),
                                                    g.size, None if update is None else ctypes.byref(update)))

    def _read_slots(self, index, update, n, shape, wide):
        """The state ``update`` keeps on the ps tasks for variable ``index`` (of ``shape``):
        its ``n`` slots (float32; float64 for a float64 variable) and steps taken."""
        slots = [np.empty(shape, np.float64 if wide else np.float32) for _ in range(n)]
        ptrs = [s.ctypes.data_as(ctypes.c_void_p) for s in slots] + [None] * (2 - len(slots))
        steps = ctypes.c_uint32()
        with self._coordinator_handle() as h:
            _check(_lib().tutti_ps_coordinator_read_slots(h, index, ctypes.byref(update),
                                                          _PS_DTYPES[np.dtype(np.float64 if wide else np.float32)],
                                                          ptrs[0], ptrs[1], int(np.prod(shape)), ctypes.byref(steps),
                                                          None))
        return slots, steps.value

    def _assign_slots(self, index, update, slots, steps, wide):
        dtype = np.dtype(np.float64 if wide else np.float32)
        slots = [np.ascontiguousarray(x, dtype) for x in slots]
        ptrs = [x.ctypes.data_as(ctypes.c_void_p) for x in slots] + [None] * (2 - len(slots))
        count = slots[0].size if slots else 0
        with self._coordinator_handle() as h:
            _check(_lib().tutti_ps_coordinator_assign_slots(h, index, ctypes.byref(update), _PS_DTYPES[dtype],
                                                            ptrs[0], ptrs[1], count, steps))

    def _read_variable(self, index, shape, dtype):
        out = np.empty(shape, dtype)
        with self._coordinator_handle() as h:
            _check(_lib().tutti_ps_coordinator_read_variable(h, index, _PS_DTYPES[out.dtype],
                                                             out.ctypes.data_as(ctypes.c_void_p), out.size))
        return out

    def close(self):
        """Shut the job down (every worker's and ps task's ``join()`` returns), once the calls
        other threads are making have returned."""
        with self._calls:
            h, self._coordinator = self._coordinator, None
            while self._in_flight:
                self._calls.wait()
        if h:
            _check(_lib().tutti_ps_coordinator_shutdown(h))


class _WorkerStrategy:
    """The strategy as a scheduled function sees it on a worker: one replica, the worker."""

    num_replicas_in_sync = 1
    run = ParameterServerStrategy.run
    reduce = ParameterServerStrategy.reduce
    experimental_local_results = ParameterServerStrategy.experimental_local_results

    def scope(self):
        return contextlib.nullcontext(self)


def _worker_strategy():
    return _WorkerStrategy()


def _ps_variable(index, shape, name, dtype="float32"):
    v = object.__new__(_PsVariable)
    v.name, v.aggregation, v._strategy, v._ps_index, v._shape = name, "SUM", None, index, tuple(shape)
    v.num_shards, v._dtype = None, np.dtype(dtype)
    return v


class _PsVariable(Variable):
    """A ``Variable`` made under a ``ParameterServerStrategy``: held on the ps tasks; a
    scheduled function reads it as pulled for its step and updates it with ``assign_sub``
    (``assign_add``, and ``assign`` as the difference from that value), sent back with the step,
    or with an optimizer's ``apply_gradients``, which the ps tasks run;
    on the coordinator ``assign`` sets it on the ps tasks (a ``Checkpoint`` restores so: use it
    while no ``join`` runs, as steps pushed meanwhile may be overwritten; a restore that fails
    part-way may have set some shards), while ``assign_add``, ``assign_sub`` and an optimizer's
    ``apply_gradients`` step it there as the workers' steps do, losing none of theirs."""

    def __init__(self, initial_value, aggregation=VariableAggregation.NONE, dtype=None, name=None):
        value = np.array(_array(initial_value), dtype=dtype, copy=True, order="C")
        if value.dtype not in _PS_DTYPES:
            raise TypeError(f"ParameterServerStrategy holds float32, float64 and float16 variables; this one is "
                            f"{value.dtype} (pass dtype=np.float32)")
        self.name, self.aggregation = name, _aggregation(aggregation)
        self._strategy = get_strategy()
        self._shape, self._dtype = value.shape, value.dtype
        self._ps_index, self.num_shards = self._strategy._create_variable(name, value)

    def __reduce__(self):
        return (_ps_variable, (self._ps_index, self._shape, self.name, self._dtype.str))

    def _step(self, what):
        step = getattr(_ps_state, "step", None)
        if step is None:
            raise RuntimeError(f"Variable.{what} under ParameterServerStrategy: update variables inside a function "
                               "scheduled with ClusterCoordinator.schedule")
        return step

    def _replica(self):
        return None

    def numpy(self):
        step = getattr(_ps_state, "step", None)
        if step is not None:
            pulled = step.value(self._ps_index, self._shape, self._dtype)
            return (pulled - step.updates.get(self._ps_index, 0)).astype(self._dtype)
        if self._strategy is None:
            raise RuntimeError("Variable: read on a worker outside a scheduled function")
        return self._strategy._read_variable(self._ps_index, self._shape, self._dtype)

    @property
    def shape(self):
        return self._shape

    @property
    def dtype(self):
        return self._dtype

    def _push(self, gradient, update):
        if gradient.shape != self._shape:
            raise ValueError(f"Variable: a gradient of shape {gradient.shape} for a variable of shape {self._shape}")
        gradient = np.asarray(gradient, self._dtype)
        if getattr(_ps_state, "step", None) is None and self._strategy is not None:
            self._strategy._push_variable(self._ps_index, gradient, update)  # on the coordinator
            return
        self._step("apply_gradients").push(self._ps_index, gradient, update)

    def _apply_combined(self, replica, update_of, how):
        u = np.asarray(update_of(0), self._dtype)
        if u.shape != self._shape:
            raise ValueError(f"Variable: an update of shape {u.shape} for a variable of shape {self._shape}")
        if getattr(_ps_state, "step", None) is None and self._strategy is not None:
            # On the coordinator: assign sets the value on the ps tasks (a restored checkpoint;
            # steps running meanwhile may push onto the old value or the new); assign_add and
            # assign_sub step it there, as the steps' pushes do, losing none of theirs.
            if how == "set":
                self._strategy._assign_variable(self._ps_index, u, self._dtype)
            else:
                self._strategy._push_variable(self._ps_index, -u if how == "add" else u, None)
            return
        step = self._step("assign" if how == "set" else f"assign_{how}")
        if how == "set":
            u = self.numpy() - u
        elif how == "add":
            u = -u
        step.subtract(self._ps_index, u)

    def __repr__(self):
        return f"<tutti.distribute.Variable {self.name or ''} shape={self.shape} dtype={self._dtype} on ps tasks>"


class RemoteValue:
    """TensorFlow's ``RemoteValue``: what a scheduled function returned, once it has run."""

    def __init__(self, coordinator, handle):
        self._coordinator, self._h = coordinator, handle

    def fetch(self):
        """The function's return value (running what is scheduled, if it has not run); its
        error (``TuttiError``, code ``TUTTI_ERROR_STEP_FAILED``) if it raised."""
        return self._coordinator._fetch(self)

    def get(self):
        """As ``fetch()``."""
        return self.fetch()

    def __del__(self):
        h, self._h = getattr(self, "_h", None), None
        if h and not sys.is_finalizing():
            _lib().tutti_ps_remote_value_destroy(h)


class _PerWorkerIterator:
    """An iterator of a per-worker dataset: each worker iterates its own copy."""

    def __init__(self, key, dataset_fn):
        self._key, self._fn = key, dataset_fn

    def __reduce__(self):
        return (_worker_iterator, (self._key, self._fn))

    def __next__(self):
        raise RuntimeError("a per-worker iterator is read inside a scheduled function, on a worker")


def _worker_iterator(key, dataset_fn):
    step = getattr(_ps_state, "step", None)
    with _ps_iterators_lock:
        if key not in _ps_iterators:
            import inspect
            try:
                takes_context = len(inspect.signature(dataset_fn).parameters) > 0
            except (TypeError, ValueError):
                takes_context = False
            workers, worker = (step.num_workers, step.worker) if step is not None else (1, 0)
            ctx = InputContext(num_input_pipelines=workers, input_pipeline_id=worker)
            _ps_iterators[key] = _LockedIterator(iter(dataset_fn(ctx) if takes_context else dataset_fn()))
        return _ps_iterators[key]


class _LockedIterator:
    """A worker's iterator of a per-worker dataset, read by one step at a time (a worker may run
    two steps at once after it rejoins, and a generator read by two threads raises)."""

    def __init__(self, it):
        self._it, self._lock = it, threading.Lock()

    def __iter__(self):
        return self

    def __next__(self):
        with self._lock:
            return next(self._it)


class _PerWorkerDataset:
    def __init__(self, dataset_fn):
        self._fn = dataset_fn

    def __iter__(self):
        import uuid
        return _PerWorkerIterator(uuid.uuid4().hex, self._fn)  # each iter() starts over, on each worker


class ClusterCoordinator:
    """TensorFlow's ``ClusterCoordinator`` over a ``ParameterServerStrategy``: ``schedule(fn,
    args, kwargs)`` queues ``fn`` for a worker and returns a ``RemoteValue`` at once; queued
    functions run, each on whichever worker is free, at ``join()`` (or a ``fetch``). A function
    that raises makes ``join`` raise its error (the worker stays; functions it stopped are not run
    and say so when fetched). A lost worker's function runs on another (at least once), and a
    worker that comes back rejoins."""

    def __init__(self, strategy):
        if not isinstance(strategy, ParameterServerStrategy):
            raise TypeError("ClusterCoordinator takes a ParameterServerStrategy")
        self.strategy = strategy

    def schedule(self, fn, args=None, kwargs=None):
        """Queue ``fn(*args, **kwargs)`` for a worker; its ``RemoteValue``, at once."""
        payload = _pickler().dumps((fn, tuple(args or ()), dict(kwargs or {})))
        v = ctypes.c_void_p()
        with self.strategy._coordinator_handle() as h:
            _check(_lib().tutti_ps_coordinator_schedule(h, payload, len(payload), ctypes.byref(v)))
        return RemoteValue(self, v)

    def join(self):
        """Run everything scheduled and wait for it."""
        with self.strategy._coordinator_handle() as h:
            _check(_lib().tutti_ps_coordinator_join(h))

    def done(self):
        """Whether everything scheduled has run (running it first: tutti runs at join)."""
        self.join()
        return True

    def fetch(self, val):
        """``val``'s values: a ``RemoteValue`` fetched, structures of them fetched inside."""
        if isinstance(val, RemoteValue):
            return val.fetch()
        if isinstance(val, (list, tuple)):
            return type(val)(self.fetch(v) for v in val)
        if isinstance(val, dict):
            return {k: self.fetch(v) for k, v in val.items()}
        return val

    def _fetch(self, value):
        lib = _lib()
        n = ctypes.c_size_t()
        with self.strategy._coordinator_handle() as h:
            _check(lib.tutti_ps_coordinator_fetch(h, value._h, None, None, 0, ctypes.byref(n)))
            buf = ctypes.create_string_buffer(max(n.value, 1))
            _check(lib.tutti_ps_coordinator_fetch(h, value._h, None, buf, n.value, ctypes.byref(n)))
        import pickle
        return pickle.loads(buf.raw[:n.value])

    def create_per_worker_dataset(self, dataset_fn):
        """A dataset each worker makes for itself with ``dataset_fn()`` (or
        ``dataset_fn(input_context)``) the first time a scheduled function reads it; iterate it
        (``iter(...)``) and pass the iterator to the functions you schedule."""
        return _PerWorkerDataset(dataset_fn)


experimental.ParameterServerStrategy = ParameterServerStrategy
experimental.coordinator = _Namespace(ClusterCoordinator=ClusterCoordinator, RemoteValue=RemoteValue)
coordinator = experimental.coordinator
# Where TensorFlow's guides (and code written against older TensorFlow) still find them:
# tf.distribute.experimental.MultiWorkerMirroredStrategy, CentralStorageStrategy, TPUStrategy,
# CommunicationOptions and CommunicationImplementation.
experimental.MultiWorkerMirroredStrategy = MultiWorkerMirroredStrategy
experimental.CentralStorageStrategy = CentralStorageStrategy
experimental.TPUStrategy = TPUStrategy
experimental.CommunicationOptions = CommunicationOptions
experimental.CommunicationImplementation = CommunicationImplementation
