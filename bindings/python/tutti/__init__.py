"""tutti from Python: collectives over numpy arrays through libtutti's C API (ctypes).

Two forms, as in the C API:

* ``Replicas`` (and the module-level ``all_reduce``, ``broadcast``, ``all_gather``, ``reduce``,
  ``reduce_scatter``): one caller holds every replica's array and makes one call::

      import numpy as np, tutti
      grads = [np.full(1000, r, dtype=np.float32) for r in range(4)]
      tutti.all_reduce(grads, op="mean")          # in place: every array is now 1.5

* ``local_group(n)``: one ``Communicator`` per rank, each used from its own thread (ctypes
  releases the GIL during the call, so the ranks run in parallel).

* ``join(rank, world_size, "host:port")`` or ``from_env()``: this process's ``Communicator`` in
  a job of separate processes (tutti launch, torchrun, mpirun, srun, TF_CONFIG).

Arrays are numpy arrays, torch tensors (CPU; CUDA ones on a ``cuda:N`` communicator, on the
tensor's current stream), or anything with ``__array_interface__`` or ``__dlpack__``, used in
place without a copy; bfloat16 comes from torch or ``ml_dtypes``. Outputs a call makes are of
the input's kind (a torch tensor for a torch tensor, else a numpy array). ``import tutti.torch``
registers the torch.distributed backend ``"tutti"``; ``tutti.distribute`` has tf.distribute's
strategies (``MirroredStrategy``, ``MultiWorkerMirroredStrategy``, ...).

libtutti is found through ``TUTTI_LIBRARY`` (a path to libtutti.so), else the copy installed
inside this package (``pip install ./bindings/python``), else in this repository's
``target/release`` or ``target/debug``, else on the system's library path.

Errors from tutti raise ``TuttiError`` with ``code`` (a ``TUTTI_*`` name) and the message of
``tutti_last_error``: what failed, on which rank, and why.
"""

import ctypes
import ctypes.util
import functools
import os
import pathlib
import sys
import threading
import weakref
from dataclasses import dataclass

import numpy as np

from ._version import __version__

__all__ = [
    "__version__",
    "TuttiError",
    "Device",
    "Replicas",
    "Communicator",
    "Group",
    "local_group",
    "device_group",
    "Work",
    "join",
    "from_env",
    "from_store",
    "devices",
    "version",
    "all_reduce",
    "broadcast",
    "all_gather",
    "reduce",
    "reduce_scatter",
    "library_path",
]

# ----- the library -----

RESULT_NAMES = {
    0: "TUTTI_SUCCESS",
    1: "TUTTI_ERROR_INVALID_ARGUMENT",
    2: "TUTTI_ERROR_MISMATCH",
    3: "TUTTI_ERROR_PEER_REJECTED",
    4: "TUTTI_ERROR_TIMEOUT",
    5: "TUTTI_ERROR_ABORTED",
    6: "TUTTI_ERROR_UNAVAILABLE",
    7: "TUTTI_ERROR_SYSTEM",
    8: "TUTTI_ERROR_INTERNAL",
    9: "TUTTI_ERROR_PEER_LOST",
    10: "TUTTI_ERROR_WAIT_TIMEOUT",
    11: "TUTTI_ERROR_TASK_LOST",
    12: "TUTTI_ERROR_STEP_FAILED",
}

DTYPES = {
    "float32": 0,
    "float64": 1,
    "float16": 2,
    "bfloat16": 3,  # ml_dtypes.bfloat16, where installed
    "int8": 4,
    "uint8": 5,
    "int32": 6,
    "uint32": 7,
    "int64": 8,
    "uint64": 9,
}

OPS = {"sum": 0, "prod": 1, "min": 2, "max": 3, "mean": 4, "band": 5, "bor": 6, "bxor": 7}

# The names frameworks give the same ops (torch's ReduceOp: AVG, PRODUCT).
_OP_ALIASES = {"avg": "mean", "average": "mean", "product": "prod"}

_TORCH_DTYPES = {
    "torch.float32": 0,
    "torch.float64": 1,
    "torch.float16": 2,
    "torch.bfloat16": 3,
    "torch.int8": 4,
    "torch.uint8": 5,
    "torch.int32": 6,
    "torch.uint32": 7,
    "torch.int64": 8,
    "torch.uint64": 9,
}

TRANSPORTS = {"auto": 0, "tcp": 1, "shm": 2, "mpi": 3}

ALGORITHMS = {
    "auto": 0,
    "direct": 1,
    "ring": 2,
    "hierarchical-copy": 3,
    "reduce-to-one": 4,
    "recursive-doubling": 5,
    "rabenseifner": 6,
    "mpi": 7,
    "hosts": 8,
}


class _Config(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("timeout_ms", ctypes.c_uint64),
        ("chunk_bytes", ctypes.c_size_t),
        ("algorithm", ctypes.c_uint32),
        ("algorithm_arg", ctypes.c_uint32),
        ("transport", ctypes.c_uint32),
        ("deterministic", ctypes.c_uint32),
        ("compression", ctypes.c_uint32),
        ("reserved", ctypes.c_uint32),
    ]


class _DeviceInfo(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("index", ctypes.c_size_t),
        ("physical_index", ctypes.c_size_t),
        ("memory_bytes", ctypes.c_uint64),
        ("kind", ctypes.c_uint32),
        ("name", ctypes.c_char * 256),
        ("spec", ctypes.c_char * 64),
    ]


def library_path():
    """The libtutti.so this module loads (or would load)."""
    env = os.environ.get("TUTTI_LIBRARY")
    if env:
        return env
    here = pathlib.Path(__file__).resolve().parent
    # An installed package (pip install ./bindings/python) carries its own build.
    packaged = sorted(here.glob("libtutti*.so"))
    if packaged:
        return str(packaged[0])
    repo = here.parents[2]
    candidates = [repo / "target" / p / "libtutti.so" for p in ("release", "debug")]
    found = [c for c in candidates if c.exists()]
    if found:
        return str(max(found, key=lambda c: c.stat().st_mtime))
    system = ctypes.util.find_library("tutti")
    if system:
        return system
    raise OSError(
        "libtutti.so not found: build it with `cargo build -p tutti-ffi` "
        "or set TUTTI_LIBRARY to its path"
    )


_lib = None

_c = ctypes
_size = ctypes.c_size_t
_u32 = ctypes.c_uint32
_ptr = ctypes.c_void_p
_pp = ctypes.POINTER(ctypes.c_void_p)
_sizes = ctypes.POINTER(ctypes.c_size_t)

_PROTOTYPES = {
    "tutti_version_string": (ctypes.c_char_p, []),
    "tutti_result_string": (ctypes.c_char_p, [_u32]),
    "tutti_last_error": (_size, [ctypes.c_char_p, _size]),
    "tutti_device_count": (_u32, [ctypes.POINTER(_size)]),
    "tutti_device_get": (_u32, [_size, ctypes.POINTER(_DeviceInfo)]),
    "tutti_comm_create_group": (_u32, [_size, ctypes.POINTER(_Config), _pp]),
    "tutti_comm_create_devices": (_u32, [_size, ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(_Config), _pp]),
    "tutti_comm_create_from_env": (_u32, [ctypes.POINTER(_Config), _pp]),
    "tutti_comm_create_rank": (_u32, [_size, _size, ctypes.c_char_p, ctypes.POINTER(_Config), _pp]),
    "tutti_comm_destroy": (None, [_ptr]),
    "tutti_comm_rank": (_u32, [_ptr, ctypes.POINTER(_size)]),
    "tutti_comm_device": (_u32, [_ptr, ctypes.POINTER(_u32), ctypes.POINTER(_size)]),
    "tutti_comm_world_size": (_u32, [_ptr, ctypes.POINTER(_size)]),
    "tutti_comm_timeout_ms": (_u32, [_ptr, ctypes.POINTER(ctypes.c_uint64)]),
    "tutti_comm_split": (_u32, [_ptr, ctypes.c_int64, ctypes.c_int64, _pp]),
    "tutti_comm_shrink": (_u32, [_ptr, _pp]),
    "tutti_comm_abort": (_u32, [_ptr, ctypes.c_char_p]),
    "tutti_comm_set_cuda_stream": (_u32, [_ptr, _ptr]),
    "tutti_comm_unset_cuda_stream": (_u32, [_ptr]),
    "tutti_all_reduce": (_u32, [_ptr, _size, _u32, _u32, _ptr, _ptr]),
    "tutti_broadcast": (_u32, [_ptr, _size, _u32, _size, _ptr]),
    "tutti_all_gather": (_u32, [_ptr, _size, _u32, _ptr, _ptr]),
    "tutti_reduce_scatter": (_u32, [_ptr, _size, _u32, _u32, _ptr, _ptr]),
    "tutti_all_reduce_premul_sum": (_u32, [_ptr, _size, _u32, ctypes.c_double, _ptr, _ptr]),
    "tutti_reduce_scatter_premul_sum": (_u32, [_ptr, _size, _u32, ctypes.c_double, _ptr, _ptr]),
    "tutti_all_reduce_premul_sum_async": (_u32, [_ptr, _size, _u32, ctypes.c_double, _ptr, _ptr, _pp]),
    "tutti_reduce_scatter_premul_sum_async": (_u32, [_ptr, _size, _u32, ctypes.c_double, _ptr, _ptr, _pp]),
    "tutti_reduce": (_u32, [_ptr, _size, _u32, _u32, _size, _ptr, _ptr]),
    "tutti_barrier": (_u32, [_ptr]),
    "tutti_mem_alloc": (_u32, [_ptr, _size, _pp]),
    "tutti_mem_free": (_u32, [_ptr, _ptr]),
    "tutti_all_reduce_async": (_u32, [_ptr, _size, _u32, _u32, _ptr, _ptr, _pp]),
    "tutti_broadcast_async": (_u32, [_ptr, _size, _u32, _size, _ptr, _pp]),
    "tutti_all_gather_async": (_u32, [_ptr, _size, _u32, _ptr, _ptr, _pp]),
    "tutti_reduce_scatter_async": (_u32, [_ptr, _size, _u32, _u32, _ptr, _ptr, _pp]),
    "tutti_reduce_async": (_u32, [_ptr, _size, _u32, _u32, _size, _ptr, _ptr, _pp]),
    "tutti_barrier_async": (_u32, [_ptr, _pp]),
    "tutti_all_to_all": (_u32, [_ptr, _size, _u32, _ptr, _ptr]),
    "tutti_all_to_all_v": (_u32, [_ptr, _sizes, _sizes, _u32, _ptr, _ptr]),
    "tutti_gather": (_u32, [_ptr, _size, _u32, _size, _ptr, _ptr]),
    "tutti_scatter": (_u32, [_ptr, _size, _u32, _size, _ptr, _ptr]),
    "tutti_all_gather_v": (_u32, [_ptr, _sizes, _u32, _ptr, _ptr]),
    "tutti_reduce_scatter_v": (_u32, [_ptr, _sizes, _u32, _u32, _ptr, _ptr]),
    "tutti_all_to_all_async": (_u32, [_ptr, _size, _u32, _ptr, _ptr, _pp]),
    "tutti_all_to_all_v_async": (_u32, [_ptr, _sizes, _sizes, _u32, _ptr, _ptr, _pp]),
    "tutti_gather_async": (_u32, [_ptr, _size, _u32, _size, _ptr, _ptr, _pp]),
    "tutti_scatter_async": (_u32, [_ptr, _size, _u32, _size, _ptr, _ptr, _pp]),
    "tutti_all_gather_v_async": (_u32, [_ptr, _sizes, _u32, _ptr, _ptr, _pp]),
    "tutti_reduce_scatter_v_async": (_u32, [_ptr, _sizes, _u32, _u32, _ptr, _ptr, _pp]),
    "tutti_send": (_u32, [_ptr, _size, _u32, _ptr, _size]),
    "tutti_recv": (_u32, [_ptr, _size, _u32, _ptr, _size]),
    "tutti_send_async": (_u32, [_ptr, _size, _u32, _ptr, _size, _pp]),
    "tutti_recv_async": (_u32, [_ptr, _size, _u32, _ptr, _size, _pp]),
    "tutti_group_start": (_u32, []),
    "tutti_group_end": (_u32, []),
    "tutti_group_end_async": (_u32, [_pp]),
    "tutti_work_wait": (_u32, [_ptr, ctypes.c_uint64]),
    "tutti_work_test": (_u32, [_ptr, ctypes.POINTER(ctypes.c_bool)]),
    "tutti_work_destroy": (None, [_ptr]),
    "tutti_replicas_create": (_u32, [_size, ctypes.POINTER(_Config), _pp]),
    "tutti_replicas_destroy": (None, [_ptr]),
    "tutti_replicas_abort": (_u32, [_ptr, ctypes.c_char_p]),
    "tutti_replicas_all_reduce": (_u32, [_ptr, _size, _u32, _u32, _size, _pp]),
    "tutti_replicas_broadcast": (_u32, [_ptr, _size, _u32, _size, _size, _pp]),
    "tutti_replicas_all_gather": (_u32, [_ptr, _size, _u32, _size, _pp, _pp]),
    "tutti_replicas_reduce_scatter": (_u32, [_ptr, _size, _u32, _u32, _size, _pp, _pp]),
    "tutti_replicas_reduce": (_u32, [_ptr, _size, _u32, _u32, _size, _pp, _ptr]),
}

# tutti_comm_create_store: the caller's key-value store as callbacks (include/tutti.h's
# tutti_store). Each returns 0 on success; get returns _STORE_TIMEOUT when the key was not set
# within timeout_ms. Called only during the create call, on the calling thread.
_STORE_TIMEOUT = 1
_StoreSet = ctypes.CFUNCTYPE(ctypes.c_int, _ptr, ctypes.c_char_p, ctypes.POINTER(ctypes.c_uint8), _size)
_StoreGet = ctypes.CFUNCTYPE(
    ctypes.c_int, _ptr, ctypes.c_char_p, ctypes.c_uint64, ctypes.POINTER(ctypes.c_uint8), _size, ctypes.POINTER(_size)
)
_StoreAdd = ctypes.CFUNCTYPE(ctypes.c_int, _ptr, ctypes.c_char_p, ctypes.c_int64, ctypes.POINTER(ctypes.c_int64))


class _Store(ctypes.Structure):
    _fields_ = [
        ("struct_size", _size),
        ("ctx", _ptr),
        ("set", _StoreSet),
        ("get", _StoreGet),
        ("add", _StoreAdd),
    ]


_PROTOTYPES["tutti_comm_create_store"] = (
    _u32,
    [_size, _size, ctypes.POINTER(_Store), ctypes.c_char_p, ctypes.c_char_p, ctypes.POINTER(_Config), _pp],
)


def _library():
    global _lib
    if _lib is None:
        lib = ctypes.CDLL(library_path())
        for name, (restype, argtypes) in _PROTOTYPES.items():
            f = getattr(lib, name)
            f.restype = restype
            f.argtypes = argtypes
        _lib = lib
    return _lib


class TuttiError(RuntimeError):
    """A failed tutti call: ``code`` is the ``TUTTI_*`` name, ``message`` says what and why."""

    def __init__(self, result, message):
        self.result = result
        self.code = RESULT_NAMES.get(result, f"unknown result {result}")
        self.message = message
        super().__init__(f"{self.code}: {message}")


def _check(result):
    if result != 0:
        lib = _library()
        n = lib.tutti_last_error(None, 0)
        buf = ctypes.create_string_buffer(n + 1)
        lib.tutti_last_error(buf, n + 1)
        raise TuttiError(result, buf.value.decode("utf-8", "replace"))


class _Closed(ValueError):
    """A call on a closed communicator, replicas or work handle."""


class _Lifetime:
    """A C handle and the calls inside it: ``close`` waits for them (bounded, then aborting the
    group, which makes them leave at once) before the handle is destroyed, and calls made from
    then on raise ``_Closed`` instead of reaching freed memory. A second close does nothing."""

    def __init__(self, handle, what):
        self._cv = threading.Condition()
        self.h = handle
        self._calls = 0
        self._what = what

    def __bool__(self):
        return bool(self.h)

    def use(self):
        return _Inside(self)

    def enter(self):
        with self._cv:
            if not self.h:
                raise _Closed(f"this {self._what} is closed")
            self._calls += 1
            return self.h

    def leave(self):
        with self._cv:
            self._calls -= 1
            if self._calls == 0:
                self._cv.notify_all()

    def close(self, destroy, abort, bound):
        """Destroy the handle once no call is inside; ``bound`` seconds (None: no bound) each
        before and after ``abort``. Raises TimeoutError, leaving the handle allocated, if calls
        are still inside after both."""
        with self._cv:
            h, self.h = self.h, None
            if not h:
                return
            if not self._cv.wait_for(lambda: self._calls == 0, bound):
                abort(h, f"{self._what} closed while {self._calls} call(s) were inside".encode())
                if not self._cv.wait_for(lambda: self._calls == 0, bound):
                    raise TimeoutError(
                        f"{self._calls} call(s) were still inside this {self._what} after its "
                        "timeout and an abort: it is left open rather than freed under them"
                    )
        destroy(h)


class _Inside:
    """``with lifetime.use() as h``: the call is counted inside the handle while it runs."""

    __slots__ = ("_life",)

    def __init__(self, life):
        self._life = life

    def __enter__(self):
        return self._life.enter()

    def __exit__(self, *exc):
        self._life.leave()


def _default_timeout():
    """The timeout of a config that sets none (TUTTI_TIMEOUT, else 300 s), in seconds."""
    try:
        return float(os.environ.get("TUTTI_TIMEOUT", "300"))
    except ValueError:
        return 300.0


def version():
    """The library's version, "MAJOR.MINOR.PATCH"."""
    return _library().tutti_version_string().decode()


@dataclass(frozen=True)
class Device:
    """One device this build of libtutti can see."""

    kind: str
    index: int
    physical_index: int
    memory_bytes: int
    name: str
    spec: str


def devices():
    """Every device this build of libtutti can see (the host CPU first)."""
    lib = _library()
    n = ctypes.c_size_t()
    _check(lib.tutti_device_count(ctypes.byref(n)))
    out = []
    for i in range(n.value):
        info = _DeviceInfo()
        info.struct_size = ctypes.sizeof(_DeviceInfo)
        _check(lib.tutti_device_get(i, ctypes.byref(info)))
        out.append(
            Device(
                kind={0: "cpu", 1: "gpu", 2: "xla"}.get(info.kind, str(info.kind)),
                index=info.index,
                physical_index=info.physical_index,
                memory_bytes=info.memory_bytes,
                name=info.name.decode("utf-8", "replace"),
                spec=info.spec.decode(),
            )
        )
    return out


# ----- arguments -----


# How f32 all-reduce and reduce-scatter travel between hosts (tutti_config.compression).
COMPRESSIONS = {None: 0, "none": 1, "bf16": 2, "f16": 3}


def _config(timeout=None, algorithm="auto", chunk_bytes=None, transport="auto", deterministic=None,
            compression=None):
    c = _Config()
    c.struct_size = ctypes.sizeof(_Config)
    if timeout is not None:
        if not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, not {timeout!r}")
        ms = round(timeout * 1000) if timeout != float("inf") else 2**64
        # ctypes would wrap a number too large for the field silently: refuse it instead (the
        # library itself refuses more than 30 days).
        if ms >= 2**64:
            raise ValueError(f"timeout {timeout!r} s is longer than tutti allows (30 days)")
        c.timeout_ms = max(1, ms)
    chunk = int(chunk_bytes or 0)
    if not 0 <= chunk < 2**64:
        raise ValueError(f"chunk_bytes {chunk_bytes!r} is out of range")
    c.chunk_bytes = chunk
    c.algorithm, c.algorithm_arg = _algorithm(algorithm)
    if transport not in TRANSPORTS:
        raise ValueError(f"unknown transport {transport!r} (expected auto, tcp, shm or mpi)")
    c.transport = TRANSPORTS[transport]
    # None: the TUTTI_DETERMINISTIC environment variable (off when unset).
    if deterministic is not None and not isinstance(deterministic, bool):
        raise ValueError(f"deterministic must be True, False or None, not {deterministic!r}")
    c.deterministic = {None: 0, True: 1, False: 2}[deterministic]
    # None: the TUTTI_COMPRESSION environment variable (none when unset).
    if isinstance(compression, str):
        compression = compression.lower()
    if compression not in COMPRESSIONS:
        raise ValueError(f"unknown compression {compression!r} (expected None, 'none', 'bf16' or 'f16')")
    c.compression = COMPRESSIONS[compression]
    return c


def _algorithm(name):
    base, _, arg = str(name).partition(":")
    if base not in ALGORITHMS:
        raise ValueError(
            f"unknown algorithm {name!r} (expected auto, direct, ring, "
            "hierarchical-copy[:GROUP], reduce-to-one[:ROOT], recursive-doubling, rabenseifner, hosts or mpi)"
        )
    if not arg:
        return ALGORITHMS[base], 0
    if base not in ("hierarchical-copy", "reduce-to-one") or not arg.isdigit():
        raise ValueError(f"algorithm {name!r}: only hierarchical-copy and reduce-to-one take a number")
    if int(arg) >= 2**32:
        # The C field is 32 bits: 4294967297 would become 1 silently.
        raise ValueError(f"algorithm {name!r}: {arg} is out of range")
    return ALGORITHMS[base], int(arg)


def _op(op):
    """An op by name ("sum", "avg"/"mean", "prod", "min", "max", and on integer types "band",
    "bor", "bxor"; any case), or torch's ``ReduceOp`` (``ReduceOp.SUM``, ...): its number in
    the C API."""
    inner = getattr(op, "op", None)  # torch's ReduceOp object wraps a RedOpType
    named = getattr(inner if inner is not None else op, "name", None)
    key = str(named if isinstance(named, str) else op).lower()
    key = key.rpartition(".")[2]  # "ReduceOp.SUM", "RedOpType.SUM"
    key = _OP_ALIASES.get(key, key)
    try:
        return OPS[key]
    except KeyError:
        raise ValueError(
            f"unknown op {op!r} (expected sum, avg/mean, prod, min, max, band, bor or bxor)"
        ) from None


def _dtype(a):
    name = a.dtype.name
    if name not in DTYPES:
        raise TypeError(
            f"dtype {a.dtype} is not one tutti reduces (expected one of {', '.join(DTYPES)})"
        )
    if not a.dtype.isnative:
        raise TypeError(f"array of dtype {a.dtype} is not in native byte order")
    return DTYPES[name]


def _array(a, what, writable=False):
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{what} is a {type(a).__name__}, not a numpy array")
    if not a.flags.c_contiguous:
        raise ValueError(f"{what} is not C-contiguous; pass np.ascontiguousarray(...)")
    if not a.flags.aligned:
        raise ValueError(f"{what} is not aligned to its element size")
    if writable and not a.flags.writeable:
        raise ValueError(f"{what} is read-only but tutti writes to it")
    return a


class _View:
    """An argument as the C API takes it: the object (kept alive while a call uses it), its
    address, element count and dtype code, and where its memory is ("cpu" or "cuda")."""

    __slots__ = ("obj", "given", "ptr", "count", "dtype", "device", "shape")

    def __init__(self, obj, ptr, count, dtype, device, shape, given=None):
        self.obj, self.ptr, self.count, self.dtype = obj, ptr, count, dtype
        self.device, self.shape = device, tuple(shape)
        # What the caller passed (an in-place call returns it), when ``obj`` is a view of it.
        self.given = obj if given is None else given

    def empty(self, shape):
        """A new, uninitialised output of this argument's kind and dtype."""
        if _is_torch(self.obj):
            import torch

            return torch.empty(shape, dtype=self.obj.dtype, device=self.obj.device)
        return np.empty(shape, dtype=self.obj.dtype)


def _is_torch(a):
    return type(a).__module__.startswith("torch") and hasattr(a, "data_ptr")


def _view(a, what, writable=False):
    """``a`` used in place: a numpy array, a torch tensor, or anything with
    ``__array_interface__`` or ``__dlpack__`` (seen through numpy, without a copy)."""
    if _is_torch(a):
        import torch

        if a.layout != torch.strided:
            raise TypeError(f"{what} is a {a.layout} tensor; tutti takes dense (strided) tensors")
        if not a.is_contiguous():
            raise ValueError(f"{what} is not contiguous; pass tensor.contiguous()")
        if a.is_conj() or a.is_neg():
            raise ValueError(f"{what} has a lazy conjugate or negation; pass tensor.resolve_conj()")
        code = _TORCH_DTYPES.get(str(a.dtype))
        if code is None:
            raise TypeError(
                f"{what} has dtype {a.dtype}, which tutti does not reduce "
                f"(expected one of {', '.join(t[6:] for t in _TORCH_DTYPES)})"
            )
        if a.device.type not in ("cpu", "cuda"):
            raise TypeError(f"{what} is on {a.device}; tutti takes CPU and CUDA tensors")
        return _View(a, a.data_ptr(), a.numel(), code, a.device.type, a.shape)
    given = a
    if not isinstance(a, np.ndarray):
        if hasattr(a, "__array_interface__") or hasattr(a, "__array_struct__"):
            a = np.asarray(a)
        elif hasattr(a, "__dlpack__"):
            try:
                a = np.from_dlpack(a)
            except (BufferError, TypeError, RuntimeError) as e:
                # numpy has no bfloat16: torch, where loaded, sees such a capsule.
                torch = sys.modules.get("torch")
                if torch is None:
                    raise TypeError(f"{what}: numpy cannot see its DLPack capsule ({e})") from None
                try:
                    t = torch.from_dlpack(a)
                except (BufferError, TypeError, RuntimeError) as e2:
                    raise TypeError(f"{what}: neither numpy nor torch can see its DLPack capsule ({e2})") from None
                v = _view(t, what, writable)
                v.given = given
                return v
        else:
            raise TypeError(
                f"{what} is a {type(a).__name__}: expected a numpy array, a torch tensor, or "
                "an object with __array_interface__ or __dlpack__"
            )
    _array(a, what, writable)
    return _View(a, a.ctypes.data, a.size, _dtype(a), "cpu", a.shape, given)


def _check_out(src, out, what, count):
    """``out`` must have ``src``'s dtype and ``count`` elements."""
    if out.dtype != src.dtype or out.count != count:
        raise ValueError(
            f"{what} must match the call: it holds {out.count} elements of {out.obj.dtype}, "
            f"the call writes {count} of {src.obj.dtype}"
        )


def _same(arrays, what, writable):
    arrays = list(arrays)
    if not arrays:
        raise ValueError(f"{what}: no arrays given")
    views = [_view(a, f"{what}[{i}]", writable) for i, a in enumerate(arrays)]
    first = views[0]
    for i, v in enumerate(views[1:], 1):
        if v.device != "cpu":
            raise TypeError(f"{what}[{i}] is on {v.device}; replicas take host memory")
        if v.dtype != first.dtype or v.shape != first.shape:
            raise ValueError(
                f"{what}[{i}] is {v.obj.dtype}{list(v.shape)} but {what}[0] is "
                f"{first.obj.dtype}{list(first.shape)}; every replica's array must match"
            )
    return views, first.dtype, first.count


def _pointers(views):
    return (ctypes.c_void_p * len(views))(*[v.ptr for v in views])


def _gathered_shape(v, n):
    """The shape of ``n`` arrays of ``v``'s shape concatenated along the first axis."""
    return (n * v.shape[0],) + v.shape[1:] if v.shape else (n,)


# ----- the one-call form -----


class Replicas:
    """A group of replicas driven by one caller holding every replica's array.

    ``Replicas(n, timeout=None, algorithm="auto", chunk_bytes=None, deterministic=None)``; use it as a context
    manager or call ``close()``. One call at a time; ``abort()`` from any thread.
    """

    def __init__(self, n, timeout=None, algorithm="auto", chunk_bytes=None, deterministic=None):
        lib = _library()
        config = _config(timeout, algorithm, chunk_bytes, deterministic=deterministic)
        handle = ctypes.c_void_p()
        _check(lib.tutti_replicas_create(n, ctypes.byref(config), ctypes.byref(handle)))
        self._h = _Lifetime(handle, "replicas")
        self._timeout = config.timeout_ms / 1000 if config.timeout_ms else _default_timeout()
        self.n = n

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        self.close()

    def close(self):
        """Release the replicas; a call running on another thread is waited for (up to the
        timeout, then it is aborted). Calls from then on raise ValueError; closing again does
        nothing."""
        life = getattr(self, "_h", None)
        if life and _lib is not None:  # at interpreter exit the library may already be gone
            life.close(_lib.tutti_replicas_destroy, _lib.tutti_replicas_abort, self._timeout)

    def abort(self, reason=None):
        """Fail the running call and every later one."""
        with self._h.use() as h:
            _check(_library().tutti_replicas_abort(h, reason.encode() if reason else None))

    def all_reduce(self, arrays, op="sum"):
        """Every array becomes the element-wise op over all of them, in place; returns them."""
        views, dtype, count = _same(arrays, "arrays", writable=True)
        with self._h.use() as h:
            _check(
                _library().tutti_replicas_all_reduce(
                    h, count, dtype, _op(op), len(views), _pointers(views)
                )
            )
        return [v.given for v in views]

    def broadcast(self, arrays, root=0):
        """Every array becomes ``arrays[root]``, in place; returns them."""
        views, dtype, count = _same(arrays, "arrays", writable=True)
        root = _index(root, "root")
        with self._h.use() as h:
            _check(
                _library().tutti_replicas_broadcast(
                    h, count, dtype, root, len(views), _pointers(views)
                )
            )
        return [v.given for v in views]

    def all_gather(self, arrays):
        """For each replica, a new array: every input concatenated along the first axis."""
        views, dtype, count = _same(arrays, "arrays", writable=False)
        shape = _gathered_shape(views[0], len(views))
        outs = [_view(views[0].empty(shape), "out") for _ in views]
        with self._h.use() as h:
            _check(
                _library().tutti_replicas_all_gather(
                    h, count, dtype, len(views), _pointers(views), _pointers(outs)
                )
            )
        return [o.obj for o in outs]

    def reduce_scatter(self, arrays, op="sum"):
        """For replica i, slice i (of ``len(arrays)`` equal slices of the flattened arrays) of
        the element-wise op over all of them."""
        views, dtype, total = _same(arrays, "arrays", writable=False)
        if total % len(views):
            raise ValueError(
                f"reduce_scatter: {total} elements do not split into {len(views)} equal slices"
            )
        count = total // len(views)
        outs = [_view(views[0].empty((count,)), "out") for _ in views]
        with self._h.use() as h:
            _check(
                _library().tutti_replicas_reduce_scatter(
                    h, count, dtype, _op(op), len(views), _pointers(views), _pointers(outs)
                )
            )
        return [o.obj for o in outs]

    def reduce(self, arrays, op="sum"):
        """A new array: the element-wise op over every array."""
        views, dtype, count = _same(arrays, "arrays", writable=False)
        out = _view(views[0].empty(views[0].shape), "out")
        with self._h.use() as h:
            _check(
                _library().tutti_replicas_reduce(
                    h, count, dtype, _op(op), len(views), _pointers(views), out.ptr
                )
            )
        return out.obj


def all_reduce(arrays, op="sum", **config):
    """All-reduce a list of per-replica arrays in place (one replica per array); returns them."""
    arrays = list(arrays)
    with Replicas(len(arrays), **config) as r:
        return r.all_reduce(arrays, op)


def broadcast(arrays, root=0, **config):
    """Copy ``arrays[root]`` into every other array, in place; returns them."""
    arrays = list(arrays)
    with Replicas(len(arrays), **config) as r:
        return r.broadcast(arrays, root)


def all_gather(arrays, **config):
    """For each array, a new array holding every array concatenated along the first axis."""
    arrays = list(arrays)
    with Replicas(len(arrays), **config) as r:
        return r.all_gather(arrays)


def reduce(arrays, op="sum", **config):
    """A new array: the element-wise op over every array."""
    arrays = list(arrays)
    with Replicas(len(arrays), **config) as r:
        return r.reduce(arrays, op)


def reduce_scatter(arrays, op="sum", **config):
    """For each replica i, slice i of the element-wise op over every array."""
    arrays = list(arrays)
    with Replicas(len(arrays), **config) as r:
        return r.reduce_scatter(arrays, op)


# ----- one communicator per rank -----


class Work:
    """The handle of a collective made with ``async_op=True``: ``wait()`` returns what the
    blocking call would have returned, or raises its error. Calls complete in the order they
    were issued on their communicator; the arrays stay referenced until the call completes."""

    def __init__(self, handle, result, keep):
        self._h = _Lifetime(handle, "work handle")
        self._result = result
        self._keep = keep

    def wait(self, timeout=None):
        """Wait for the call and return its result. ``timeout`` (seconds) bounds this wait: past
        it a ``TuttiError`` with code ``TUTTI_ERROR_WAIT_TIMEOUT`` is raised (not ``TUTTI_ERROR_TIMEOUT``,
        which means the group is aborted): nothing failed and the call goes on; None
        waits until the call completes (every call is bounded by the communicator's timeout)."""
        if timeout is None:
            ms = 0
        else:
            if not timeout > 0:
                raise ValueError(f"timeout {timeout!r}: must be a positive number of seconds")
            ms = max(1, min(int(timeout * 1000), 2**64 - 1))
        with self._h.use() as h:
            _check(_library().tutti_work_wait(h, ms))
        return self._result

    def is_completed(self):
        """True once the call has completed (successfully or not); never blocks."""
        done = ctypes.c_bool()
        with self._h.use() as h:
            _check(_library().tutti_work_test(h, ctypes.byref(done)))
        return done.value

    def __del__(self):
        life = getattr(self, "_h", None)
        if life and _lib is not None:
            # Waits for a call still running (bounded by the timeout) before the arrays go.
            life.close(_lib.tutti_work_destroy, lambda h, reason: None, None)
        self._keep = None


class _Done:
    """The ``Work`` of an asynchronous call that had nothing to do (an empty ``send_recv``):
    complete from the start."""

    def __init__(self, result):
        self._result = result

    def wait(self, timeout=None):
        """The result, at once."""
        return self._result

    def is_completed(self):
        """True."""
        return True


def _collective(method):
    """A collective whose arguments this rank rejects before calling the library (a wrong
    array, dtype, size or root) aborts the group, as the C API does, so that the other ranks'
    calls fail at once naming this rank instead of waiting out the timeout."""

    @functools.wraps(method)
    def checked(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except (TypeError, ValueError) as e:
            if isinstance(e, _Closed):
                raise
            name = method.__name__
            try:
                with self._h.use() as h:
                    _library().tutti_comm_abort(
                        h, f"rank {self.rank} rejected its arguments to {name}: {e}".encode()
                    )
            except _Closed:
                raise e from None
            raise type(e)(
                f"{e} (the group is aborted so that the other ranks do not wait for this one)"
            ) from e

    return checked


# Called with a communicator just before it is closed: tutti.jax and tutti.tensorflow clear
# the slot by which their compiled programs name it (tutti/_ext.py).
_close_hooks = []


class Communicator:
    """One rank's handle on a group. Every collective takes ``async_op``: True returns a
    ``Work`` at once (``work.wait()`` gives the result), as torch.distributed does. Calls from
    several threads run in the order they were issued. ``abort()`` may be called from any
    thread."""

    def __init__(self, handle, device="cpu"):
        self._h = _Lifetime(handle, "communicator")
        #: Where this rank's buffers live: "cpu", or "cuda:N" / "cuda" for a GPU rank.
        self.device = device
        self._shared = weakref.WeakSet()
        lib = _library()
        v = ctypes.c_size_t()
        _check(lib.tutti_comm_rank(handle, ctypes.byref(v)))
        self.rank = v.value
        _check(lib.tutti_comm_world_size(handle, ctypes.byref(v)))
        self.world_size = v.value
        ms = ctypes.c_uint64()
        _check(lib.tutti_comm_timeout_ms(handle, ctypes.byref(ms)))
        self._timeout = ms.value / 1000

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        self.close()

    def close(self):
        """Release the communicator. Arrays from ``shared_array`` must be gone first (they keep
        the communicator alive; an explicit close while one lives is a ValueError). Calls
        running on other threads are waited for, up to the timeout, then aborted (a watchdog
        may call ``abort()`` then ``close()``); calls from then on raise ValueError, and closing
        again does nothing."""
        life = getattr(self, "_h", None)
        if life and len(getattr(self, "_shared", ())):
            raise ValueError(
                f"{len(self._shared)} shared arrays of this communicator are still alive: delete them first"
            )
        if life and _lib is not None:  # at interpreter exit the library may already be gone
            if not sys.is_finalizing():  # at interpreter exit no program runs any more
                for hook in list(_close_hooks):
                    hook(self)
            life.close(_lib.tutti_comm_destroy, _lib.tutti_comm_abort, self._timeout)

    def shared_array(self, shape, dtype=np.float32):
        """A zeroed numpy array in shared memory (``tutti_mem_alloc``): every process of the
        group maps it, and collectives whose arrays are shared arrays on every rank (64 KiB or
        more) run without a copy between the processes. Collective: every rank calls it in the
        same order, with the same shape and dtype. The memory is released when the array (and
        every view of it) is gone."""
        dtype = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64))
        owner = _SharedMemory(self, count * dtype.itemsize)
        buf = (ctypes.c_char * max(owner.nbytes, 1)).from_address(owner.ptr)
        buf._owner = owner  # the memory lives as long as the array's base does
        self._shared.add(owner)
        return np.frombuffer(buf, dtype=dtype, count=count).reshape(shape)

    def split(self, color, key=0):
        """Split the group as MPI_Comm_split does (collective: every rank calls it): the ranks
        passing the same ``color`` (an int, 0 or more) form a new ``Communicator``, ranked by
        ``key``, then by rank; a rank passing ``None`` (or a negative color) gets ``None``. The
        new communicator has this one's settings and connections of its own."""
        if color is not None and not isinstance(color, int):
            raise TypeError(f"color must be an int or None, not {type(color).__name__}")
        if not isinstance(key, int):
            raise TypeError(f"key must be an int, not {type(key).__name__}")
        c = -1 if color is None or color < 0 else color
        if c >= 2**32 or not -(2**63) <= key < 2**63:
            raise ValueError(f"color {color} or key {key} is out of range")
        out = ctypes.c_void_p()
        with self._h.use() as h:
            _check(_library().tutti_comm_split(h, c, key, ctypes.byref(out)))
        return Communicator(out, self.device) if out.value else None

    def shrink(self):
        """After a rank was lost (a call raised ``TuttiError`` with code
        ``TUTTI_ERROR_PEER_LOST``, or aborted because of one): a new ``Communicator`` of the
        ranks still alive, renumbered in this one's rank order, with this one's settings. Every
        surviving rank calls it; this one is aborted first, and the survivors agree on who they
        are within the timeout (a rank too late for the others gets an error). Restore the
        training's state from the new rank 0 (broadcast the weights, the optimizer's state and
        the step) and repeat the step that failed. With no rank lost, it re-forms the group
        after a rank's rejection of its own arguments or a mismatch aborted this one: every
        rank calls it and gets a communicator of all of them. Processes over tcp and shm
        only."""
        out = ctypes.c_void_p()
        with self._h.use() as h:
            _check(_library().tutti_comm_shrink(h, ctypes.byref(out)))
        return Communicator(out, self.device)

    def abort(self, reason=None):
        """Fail the calls running on every rank of the group, and every later one, with
        ``reason``; callable from any thread (a watchdog's)."""
        with self._h.use() as h:
            _check(_library().tutti_comm_abort(h, reason.encode() if reason else None))

    def set_cuda_stream(self, stream):
        """Order later calls of this ``cuda:N`` rank on ``stream`` as NCCL does (a raw
        ``cudaStream_t`` as an int, e.g. ``torch.cuda.current_stream().cuda_stream``; 0 is the
        legacy default stream): each call's GPU work comes after the work queued there before
        it, and the work queued there after it comes after the call's. ``None``: no stream.
        See the README, "CUDA streams"."""
        lib = _library()
        with self._h.use() as h:
            if stream is None:
                _check(lib.tutti_comm_unset_cuda_stream(h))
            else:
                _check(lib.tutti_comm_set_cuda_stream(h, ctypes.c_void_p(int(stream))))

    def _call(self, name, args, result, keep, async_op):
        lib = _library()
        if any(getattr(v, "device", "cpu") == "cuda" for v in keep):
            self._on_tensor_stream(keep)
        with self._h.use() as h:
            if not async_op:
                _check(getattr(lib, name)(h, *args))
                return result
            work = ctypes.c_void_p()
            _check(getattr(lib, name + "_async")(h, *args, ctypes.byref(work)))
        return Work(work, result, tuple(x for v in keep for x in (v.obj, v.given)))

    def _on_tensor_stream(self, views):
        """CUDA tensors: this must be a ``cuda:N`` rank, and the call is ordered on the
        tensor's current stream, as torch's own collectives are."""
        if not self.device.startswith("cuda"):
            raise TypeError(
                f"a CUDA tensor was passed to a communicator on {self.device}: make it with "
                "TUTTI_DEVICE=cuda (from_env), or pass CPU tensors"
            )
        import torch

        cuda = next(v.obj for v in views if v.device == "cuda")
        self.set_cuda_stream(torch.cuda.current_stream(cuda.device).cuda_stream)

    @_collective
    def all_reduce(self, array, op="sum", out=None, async_op=False):
        """In place, or into ``out``; returns the result (a ``Work`` with ``async_op``)."""
        src = _view(array, "array", writable=out is None)
        dst = src if out is None else _view(out, "out", writable=True)
        _check_out(src, dst, "out", src.count)
        args = (src.count, src.dtype, _op(op), src.ptr, dst.ptr)
        return self._call("tutti_all_reduce", args, dst.given, (src, dst), async_op)

    @_collective
    def all_reduce_premul_sum(self, array, factor, out=None, async_op=False):
        """The sum over ranks of each rank's array scaled by its own ``factor`` (NCCL's
        pre-multiplied sum), in place or into ``out``; integer arrays take whole factors.
        Host memory; returns the result (a ``Work`` with ``async_op``)."""
        src = _view(array, "array", writable=out is None)
        dst = src if out is None else _view(out, "out", writable=True)
        _check_out(src, dst, "out", src.count)
        args = (src.count, src.dtype, float(factor), src.ptr, dst.ptr)
        return self._call("tutti_all_reduce_premul_sum", args, dst.given, (src, dst), async_op)

    @_collective
    def broadcast(self, array, root=0, async_op=False):
        """``array`` becomes the root's, in place; returns it."""
        v = _view(array, "array", writable=True)
        root = _index(root, "root")
        args = (v.count, v.dtype, root, v.ptr)
        return self._call("tutti_broadcast", args, v.given, (v,), async_op)

    @_collective
    def all_gather(self, array, out=None, async_op=False):
        """Every rank's array concatenated along the first axis: into ``out`` (of
        ``world_size`` times the elements), else a new array of the input's kind."""
        src = _view(array, "array")
        if out is None:
            out = src.empty(_gathered_shape(src, self.world_size))
        dst = _view(out, "out", writable=True)
        _check_out(src, dst, "out", src.count * self.world_size)
        args = (src.count, src.dtype, src.ptr, dst.ptr)
        return self._call("tutti_all_gather", args, dst.given, (src, dst), async_op)

    @_collective
    def reduce_scatter(self, array, op="sum", out=None, async_op=False):
        """This rank's slice of the element-wise op over every rank's (flattened) array: into
        ``out`` (of 1/world_size of the elements), else a new 1-D array."""
        src = _view(array, "array")
        if src.count % self.world_size:
            raise ValueError(f"{src.count} elements do not split into {self.world_size} equal slices")
        count = src.count // self.world_size
        dst = _view(src.empty((count,)) if out is None else out, "out", writable=True)
        _check_out(src, dst, "out", count)
        args = (count, src.dtype, _op(op), src.ptr, dst.ptr)
        return self._call("tutti_reduce_scatter", args, dst.given, (src, dst), async_op)

    @_collective
    def reduce_scatter_premul_sum(self, array, factor, out=None, async_op=False):
        """This rank's slice of the sum over ranks of each rank's array scaled by its own
        ``factor`` (see ``all_reduce_premul_sum``). Host memory; a ``Work`` with ``async_op``."""
        src = _view(array, "array")
        if src.count % self.world_size:
            raise ValueError(f"{src.count} elements do not split into {self.world_size} equal slices")
        count = src.count // self.world_size
        dst = _view(src.empty((count,)) if out is None else out, "out", writable=True)
        _check_out(src, dst, "out", count)
        args = (count, src.dtype, float(factor), src.ptr, dst.ptr)
        return self._call("tutti_reduce_scatter_premul_sum", args, dst.given, (src, dst), async_op)

    @_collective
    def reduce(self, array, op="sum", root=0, out=None, async_op=False):
        """At the root, the reduction: into ``out`` (which may be ``array`` itself), else a new
        array; None elsewhere (``out`` is left untouched there)."""
        src = _view(array, "array")
        root = _index(root, "root")
        dst = None
        if self.rank == root:
            dst = _view(src.empty(src.shape) if out is None else out, "out", writable=True)
            _check_out(src, dst, "out", src.count)
        args = (src.count, src.dtype, _op(op), root, src.ptr, None if dst is None else dst.ptr)
        keep = (src,) if dst is None else (src, dst)
        return self._call("tutti_reduce", args, None if dst is None else dst.given, keep, async_op)

    @_collective
    def all_to_all(self, array, out=None, async_op=False):
        """Personalized exchange: ``array``'s elements in ``world_size`` equal blocks, block j
        going to rank j; ``out`` (as many elements; else a new array of the input's shape and
        kind) holds rank k's block for this rank at block k. Not in place: ``out`` must not
        overlap ``array``. Every rank passes the same number of elements."""
        src = _view(array, "array")
        n = self.world_size
        if src.count % n:
            raise ValueError(f"all_to_all: {src.count} elements do not split into {n} equal blocks")
        dst = _view(src.empty(src.shape) if out is None else out, "out", writable=True)
        _check_out(src, dst, "out", src.count)
        args = (src.count // n, src.dtype, src.ptr, dst.ptr)
        return self._call("tutti_all_to_all", args, dst.given, (src, dst), async_op)

    @_collective
    def all_to_all_v(self, array, send_counts, recv_counts, out=None, async_op=False):
        """All-to-all with a count per block: the first ``send_counts[0]`` elements of
        ``array`` (flattened) go to rank 0, the next ``send_counts[1]`` to rank 1, and so on;
        ``out`` (the sum of ``recv_counts`` elements; else a new 1-D array) holds
        ``recv_counts[k]`` elements from each rank k, in rank order. Both lists have
        ``world_size`` entries, ``send_counts`` summing to ``array``'s length; rank i's
        ``send_counts[j]`` must equal rank j's ``recv_counts[i]`` (else a ``TuttiError``
        naming both ranks). Not in place."""
        src = _view(array, "array")
        send = _counts(send_counts, "send_counts", self.world_size)
        recv = _counts(recv_counts, "recv_counts", self.world_size)
        if sum(send) != src.count:
            raise ValueError(f"all_to_all_v: send_counts sum to {sum(send)} but array holds {src.count} elements")
        total = sum(recv)
        dst = _view(src.empty((total,)) if out is None else out, "out", writable=True)
        _check_out(src, dst, "out", total)
        args = (send, recv, src.dtype, src.ptr, dst.ptr)
        return self._call("tutti_all_to_all_v", args, dst.given, (src, dst), async_op)

    @_collective
    def gather(self, array, root=0, out=None, async_op=False):
        """At the root, every rank's array concatenated along the first axis (in rank order):
        into ``out`` (``world_size`` times the elements), else a new array of the input's kind;
        None elsewhere (``out`` is left untouched there). Every rank passes as many elements."""
        src = _view(array, "array")
        root = _index(root, "root")
        dst = None
        if self.rank == root:
            if out is None:
                out = src.empty(_gathered_shape(src, self.world_size))
            dst = _view(out, "out", writable=True)
            _check_out(src, dst, "out", src.count * self.world_size)
        args = (src.count, src.dtype, root, src.ptr, None if dst is None else dst.ptr)
        keep = (src,) if dst is None else (src, dst)
        return self._call("tutti_gather", args, None if dst is None else dst.given, keep, async_op)

    @_collective
    def scatter(self, array=None, root=0, out=None, count=None, async_op=False):
        """Every rank receives its block of the root's ``array`` (``world_size`` equal blocks
        of its elements, block r for rank r): into ``out``, else a new array of ``array``'s
        kind and dtype; returns it.

        At the root ``array`` is required and sets the block length (``count``, if given,
        must agree). Off the root ``array`` is not read (None is fine): the block length is
        ``out``'s length, else ``count``; with ``count`` and no ``out``, ``array`` (any
        length) gives the new output's kind and dtype. Every rank's length, dtype and root
        must agree (else a ``TuttiError`` naming the ranks)."""
        root = _index(root, "root")
        n = self.world_size
        if count is not None:
            count = _index(count, "count")
        src = None if array is None else _view(array, "array")
        dst = None if out is None else _view(out, "out", writable=True)
        if self.rank == root:
            if src is None:
                raise ValueError(f"scatter: rank {self.rank} is the root, so it must pass the array to scatter")
            if src.count % n:
                raise ValueError(f"scatter: {src.count} elements do not split into {n} equal blocks")
            block = src.count // n
            if count is not None and count != block:
                raise ValueError(f"scatter: count is {count} but the root's {src.count} elements make blocks of {block}")
            if dst is None:
                shape = (src.shape[0] // n,) + src.shape[1:] if src.shape and src.shape[0] % n == 0 else (block,)
                dst = _view(src.empty(shape), "out", writable=True)
            _check_out(src, dst, "out", block)
        else:
            if dst is not None:
                block = dst.count
                if count is not None and count != block:
                    raise ValueError(f"scatter: count is {count} but out holds {block} elements")
            elif count is None:
                raise ValueError(
                    f"scatter: rank {self.rank} is not the root ({root}), so its receive length comes "
                    "from out= or count=; pass one of them"
                )
            elif src is None:
                raise ValueError(
                    f"scatter: rank {self.rank} is not the root ({root}): with count= and no out=, pass "
                    "array= (not read here) for the output's dtype and kind, or pass out="
                )
            else:
                block = count
                dst = _view(src.empty((count,)), "out", writable=True)
        dtype = dst.dtype
        args = (block, dtype, root, src.ptr if self.rank == root else None, dst.ptr)
        keep = (src, dst) if self.rank == root else (dst,)
        return self._call("tutti_scatter", args, dst.given, keep, async_op)

    @_collective
    def all_gather_v(self, array, counts, out=None, async_op=False):
        """All-gather with a count per rank: ``out`` (the sum of ``counts`` elements; else a
        new 1-D array of the input's kind) becomes every rank's array in rank order, rank r's
        ``counts[r]`` elements long. ``counts`` has ``world_size`` entries, this rank's being
        ``array``'s length, and is the same on every rank (else a ``TuttiError`` naming the
        ranks)."""
        src = _view(array, "array")
        counts = _counts(counts, "counts", self.world_size)
        if counts[self.rank] != src.count:
            raise ValueError(
                f"all_gather_v: counts[{self.rank}] is {counts[self.rank]} but this rank's array holds "
                f"{src.count} elements"
            )
        total = sum(counts)
        dst = _view(src.empty((total,)) if out is None else out, "out", writable=True)
        _check_out(src, dst, "out", total)
        args = (counts, src.dtype, src.ptr, dst.ptr)
        return self._call("tutti_all_gather_v", args, dst.given, (src, dst), async_op)

    @_collective
    def reduce_scatter_v(self, array, counts, op="sum", out=None, async_op=False):
        """Reduce-scatter with a count per rank: ``out`` (``counts[rank]`` elements; else a new
        1-D array of the input's kind) becomes this rank's block of the element-wise op over
        every rank's (flattened) array, whose length is the sum of ``counts``. ``counts`` has
        ``world_size`` entries and is the same on every rank (else a ``TuttiError`` naming the
        ranks)."""
        src = _view(array, "array")
        counts = _counts(counts, "counts", self.world_size)
        if sum(counts) != src.count:
            raise ValueError(f"reduce_scatter_v: counts sum to {sum(counts)} but array holds {src.count} elements")
        mine = counts[self.rank]
        dst = _view(src.empty((mine,)) if out is None else out, "out", writable=True)
        _check_out(src, dst, "out", mine)
        args = (counts, src.dtype, _op(op), src.ptr, dst.ptr)
        return self._call("tutti_reduce_scatter_v", args, dst.given, (src, dst), async_op)

    def barrier(self, async_op=False):
        """Return once every rank has called it."""
        return self._call("tutti_barrier", (), None, (), async_op)

    # ----- point-to-point -----

    def _peer(self, peer):
        peer = _index(peer, "peer")
        if peer >= self.world_size:
            raise ValueError(f"peer {peer} is out of range (world size {self.world_size})")
        return peer

    def send(self, array, peer, async_op=False):
        """Send ``array`` to rank ``peer``, which receives it with ``recv`` (or in a
        ``send_recv`` group). A rank's sends to a peer match that peer's receives from it in
        issue order; both name the same element count and dtype, or the receive raises naming
        both ranks and the group is aborted (the sender's next call fails). Returns None once
        the data is handed over (a ``Work`` with ``async_op``). Only the two ranks take part;
        the call keeps its order with this communicator's collectives. Wrong arguments (an
        array tutti cannot take, a peer out of range) raise at once and leave the communicator
        usable. A send to this rank itself needs its receive in the same ``send_recv``."""
        v = _view(array, "array")
        args = (v.count, v.dtype, v.ptr, self._peer(peer))
        return self._call("tutti_send", args, None, (v,), async_op)

    def recv(self, array, peer, async_op=False):
        """Receive rank ``peer``'s next send to this rank into ``array``, in place (its element
        count and dtype must be the send's); returns ``array`` (a ``Work`` whose ``wait()``
        returns it, with ``async_op``). See ``send``."""
        v = _view(array, "array", writable=True)
        args = (v.count, v.dtype, v.ptr, self._peer(peer))
        return self._call("tutti_recv", args, v.given, (v,), async_op)

    def send_recv(self, ops, async_op=False):
        """Run sends and receives as one group (``tutti_group_start`` / ``tutti_group_end`` on
        the calling thread, as torch's ``batch_isend_irecv`` and NCCL's grouped calls): every
        operation is under way at once, so a ring (each rank sends to the next and receives from
        the previous) or two ranks that both send first cannot deadlock; each peer's operations
        in one direction keep their order. ``ops`` is a list of ``("send", array, peer)`` and
        ``("recv", array, peer)``; receives fill their arrays in place. Returns the received
        arrays, in the order of the ``"recv"`` operations; with ``async_op``, at once, a
        ``Work`` whose ``wait()`` returns them (``tutti_group_end_async``: the group is issued,
        the arrays stay referenced until it completes)."""
        if isinstance(ops, (str, bytes)) or not hasattr(ops, "__iter__"):
            raise TypeError(f"ops must be a list of (kind, array, peer), not {type(ops).__name__}")
        calls, keep, received = [], [], []
        for i, op in enumerate(ops):
            if not isinstance(op, (tuple, list)) or len(op) != 3:
                raise TypeError(f"ops[{i}] must be a (kind, array, peer) tuple, not {op!r}")
            kind, array, peer = op
            if kind not in ("send", "recv"):
                raise ValueError(f"ops[{i}]: kind {kind!r} is neither 'send' nor 'recv'")
            v = _view(array, f"ops[{i}]'s array", writable=kind == "recv")
            calls.append((f"tutti_{kind}", (v.count, v.dtype, v.ptr, self._peer(peer))))
            keep.append(v)
            if kind == "recv":
                received.append(v.given)
        if any(v.device == "cuda" for v in keep):
            self._on_tensor_stream(keep)
        lib = _library()
        work = ctypes.c_void_p()
        with self._h.use() as h:
            _check(lib.tutti_group_start())
            recorded = False
            try:
                for name, args in calls:
                    _check(getattr(lib, name)(h, *args))
                recorded = True
            finally:
                if not recorded:
                    # Part of the group was recorded: running it alone would leave the peers'
                    # operations unmatched. Abort the group, so that they fail at once.
                    lib.tutti_comm_abort(
                        h, f"rank {self.rank}: send_recv could not record its operations".encode()
                    )
                if recorded and async_op:
                    ended = lib.tutti_group_end_async(ctypes.byref(work))
                else:
                    ended = lib.tutti_group_end()
            _check(ended)
        if not async_op:
            return received
        if not work.value:  # nothing was recorded: nothing to wait for
            return _Done(received)
        return Work(work, received, tuple(x for v in keep for x in (v.obj, v.given)))


class _SharedMemory:
    """One ``tutti_mem_alloc`` allocation, released when the last array over it goes."""

    def __init__(self, comm, nbytes):
        ptr = ctypes.c_void_p()
        with comm._h.use() as h:
            _check(_library().tutti_mem_alloc(h, nbytes, ctypes.byref(ptr)))
        self.comm, self.ptr, self.nbytes = comm, ptr.value, nbytes

    def __del__(self):
        life = getattr(getattr(self, "comm", None), "_h", None)
        if life and _lib is not None:
            try:
                with life.use() as h:
                    # Unmapped once the calls issued before it have completed.
                    _lib.tutti_mem_free(h, self.ptr)
            except _Closed:
                pass


def _index(value, name):
    """A non-negative integer that fits a size_t, or a ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer, not {type(value).__name__}")
    if not 0 <= int(value) < 2**64:
        raise ValueError(f"{name} {value} is out of range")
    return int(value)


def _counts(counts, name, n):
    """A list of ``n`` element counts as the C API's ``size_t`` array, or an error naming it."""
    if isinstance(counts, (str, bytes)) or not hasattr(counts, "__len__"):
        raise TypeError(f"{name} must be a sequence of {n} integers, not {type(counts).__name__}")
    if len(counts) != n:
        raise ValueError(f"{name} has {len(counts)} entries but the group has {n} ranks")
    values = [_index(c, f"{name}[{i}]") for i, c in enumerate(counts)]
    return (ctypes.c_size_t * max(n, 1))(*values)


class Group(list):
    """The communicators of an in-process group, rank 0 first (a list): hand each to its own
    thread. As a context manager, or with ``close()``, it closes every one of them."""

    def close(self):
        """Close every communicator of the group (see ``Communicator.close``)."""
        for c in self:
            c.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def local_group(n, timeout=None, algorithm="auto", chunk_bytes=None, device="cpu", deterministic=None):
    """An in-process group of ``n`` ranks: a ``Group`` (a list) of ``Communicator``, rank 0
    first; hand each to its own thread. ``device`` is the kind of device the ranks are on: "cpu" (host memory),
    or "xla" for ranks "xla:0" … "xla:n-1" (see ``device_group``)."""
    if device != "cpu":
        return device_group([f"{device}:{i}" for i in range(n)], timeout, algorithm, chunk_bytes,
                            deterministic)
    lib = _library()
    config = _config(timeout, algorithm, chunk_bytes, deterministic=deterministic)
    handles = (ctypes.c_void_p * max(n, 1))()
    _check(lib.tutti_comm_create_group(n, ctypes.byref(config), handles))
    return Group(Communicator(ctypes.c_void_p(h)) for h in handles[:n])


def device_group(devices, timeout=None, algorithm="auto", chunk_bytes=None, deterministic=None):
    """A group whose rank r is on ``devices[r]`` ("cpu:0", "xla:2", ...): a list of
    ``Communicator``, one per thread. Arrays are numpy arrays in host memory on every device
    (XLA ranks stage them to their devices). A device kind this build lacks raises a
    ``TuttiError`` with code ``TUTTI_ERROR_UNAVAILABLE``."""
    devices = list(devices)
    lib = _library()
    config = _config(timeout, algorithm, chunk_bytes, deterministic=deterministic)
    specs = (ctypes.c_char_p * max(len(devices), 1))(*[str(d).encode() for d in devices])
    handles = (ctypes.c_void_p * max(len(devices), 1))()
    _check(lib.tutti_comm_create_devices(len(devices), specs, ctypes.byref(config), handles))
    return Group(Communicator(ctypes.c_void_p(h), str(d)) for h, d in zip(handles[: len(devices)], devices))


def join(rank, world_size, master_addr, timeout=None, algorithm="auto", chunk_bytes=None, transport="auto",
         deterministic=None, compression=None):
    """Join a job of separate processes as ``rank`` of ``world_size``, meeting the others at
    ``master_addr`` ("host:port", served by rank 0); ``TUTTI_JOB_TOKEN``, when set, is the
    secret every connection proves. Blocks until every rank has joined. ``compression``
    ("bf16" or "f16"; None: ``TUTTI_COMPRESSION``) carries f32 all-reduce and reduce-scatter
    between hosts as 16-bit floats, reducing in f32."""
    lib = _library()
    config = _config(timeout, algorithm, chunk_bytes, transport, deterministic, compression)
    handle = ctypes.c_void_p()
    _check(lib.tutti_comm_create_rank(rank, world_size, master_addr.encode(), ctypes.byref(config), ctypes.byref(handle)))
    return Communicator(handle)


class _StoreCallbacks:
    """A Python store (``set(key, bytes)``, ``get(key, timeout_s) -> bytes`` waiting for the
    key, ``add(key, delta) -> int``) as ``tutti_store``'s callbacks. An exception in one is
    kept (the first) and the callback reports failure; ``from_store`` raises it with tutti's
    error."""

    def __init__(self, store):
        self.store = store
        self.error = None
        self.set = _StoreSet(self._set)
        self.get = _StoreGet(self._get)
        self.add = _StoreAdd(self._add)

    def _fail(self, e):
        if self.error is None:
            self.error = e
        return 2

    def _set(self, ctx, key, value, length):
        try:
            self.store.set(key.decode(), ctypes.string_at(value, length))
            return 0
        except BaseException as e:  # noqa: BLE001 - reported through tutti's error
            return self._fail(e)

    def _get(self, ctx, key, timeout_ms, buf, cap, length):
        try:
            value = bytes(self.store.get(key.decode(), timeout_ms / 1000))
        except TimeoutError:
            return _STORE_TIMEOUT
        except BaseException as e:  # noqa: BLE001
            return self._fail(e)
        length[0] = len(value)
        ctypes.memmove(buf, value, min(len(value), cap))
        return 0

    def _add(self, ctx, key, delta, value):
        try:
            value[0] = int(self.store.add(key.decode(), delta))
            return 0
        except BaseException as e:  # noqa: BLE001
            return self._fail(e)

    def struct(self):
        s = _Store()
        s.struct_size = ctypes.sizeof(_Store)
        s.ctx = None
        s.set, s.get, s.add = self.set, self.get, self.add
        return s


def from_store(rank, world_size, store, token, listen_host=None, timeout=None, algorithm="auto",
               chunk_bytes=None, transport="auto", deterministic=None, compression=None):
    """Join a job of separate processes as ``rank`` of ``world_size``, the ranks meeting
    through ``store``, a key-value store of the caller's: an object with ``set(key, value:
    bytes)``, ``get(key, timeout_s) -> bytes`` (waiting for the key; ``TimeoutError`` past the
    bound) and ``add(key, delta) -> int`` (torch.distributed's backend uses the store torch hands
    it). Each rank listens on ``listen_host`` (None: 127.0.0.1) at a port the OS picks and
    publishes it there; every connection proves ``token``, the job's secret (at least 16
    bytes, the same on every rank). Blocks until every rank has joined. ``compression`` as for
    ``join``."""
    lib = _library()
    config = _config(timeout, algorithm, chunk_bytes, transport, deterministic, compression)
    callbacks = _StoreCallbacks(store)
    s = callbacks.struct()
    handle = ctypes.c_void_p()
    result = lib.tutti_comm_create_store(
        rank,
        world_size,
        ctypes.byref(s),
        str(token).encode(),
        None if listen_host is None else str(listen_host).encode(),
        ctypes.byref(config),
        ctypes.byref(handle),
    )
    if result != 0 and callbacks.error is not None:
        if not isinstance(callbacks.error, Exception):
            raise callbacks.error  # KeyboardInterrupt, SystemExit: as they were
        try:
            _check(result)
        except TuttiError as e:
            raise e from callbacks.error
    _check(result)
    return Communicator(handle)


def from_env(timeout=None, algorithm="auto", chunk_bytes=None, transport="auto", deterministic=None,
             compression=None):
    """Join the job this process's environment describes (tutti launch, torchrun, mpirun, srun,
    TF_CONFIG, or TUTTI_RANK, TUTTI_WORLD_SIZE and TUTTI_MASTER_ADDR). ``compression`` as for
    ``join``."""
    lib = _library()
    config = _config(timeout, algorithm, chunk_bytes, transport, deterministic, compression)
    handle = ctypes.c_void_p()
    _check(lib.tutti_comm_create_from_env(ctypes.byref(config), ctypes.byref(handle)))
    # Where TUTTI_DEVICE placed the rank, as the library resolved it ("gpu", "cuda", "CUDA:1"
    # alike), labelled as torch names devices.
    kind, index = _u32(), _size()
    try:
        _check(lib.tutti_comm_device(handle, ctypes.byref(kind), ctypes.byref(index)))
    except BaseException:
        lib.tutti_comm_destroy(handle)
        raise
    device = {1: f"cuda:{index.value}", 2: f"xla:{index.value}"}.get(kind.value, "cpu")
    return Communicator(handle, device)
