"""tutti's collectives inside ``jax.jit``: ``all_reduce``, ``all_gather``, ``reduce_scatter`` and
``broadcast`` over the ranks of a job of processes, as XLA custom calls (XLA's FFI), each rank
one process with its own JAX::

    import jax, jax.numpy as jnp, tutti.jax as tj

    @jax.jit
    def step(grads):
        return tj.all_reduce(grads, op="mean")      # every rank's grads, averaged

    print(step(jnp.ones(4) * jax.process_index()))

Run under ``tutti launch -n 2 -- python train.py`` (or torchrun, mpirun, srun, TF_CONFIG):
``comm=None`` is the job's communicator, joined once from the environment (``tutti.from_env()``)
the first time a collective is traced. Pass ``comm=`` (a ``tutti.Communicator`` of the job,
e.g. from ``tutti.join`` or a ``split``) to use another. Once that communicator is closed, the
functions compiled for it fail, saying so (they name it by a number never given again, not by
its address).

How: each function binds a JAX primitive with an ordered effect, lowered to an XLA custom call
(``jax.ffi``) whose handler runs libtutti's collective on the arrays' own buffers (host or GPU
memory), without a copy (``all_reduce`` and ``broadcast`` write over their input's buffer where
XLA can give it up: an intermediate, or an argument donated with ``donate_argnums``). The
ordered effect threads a token through every tutti call of a program, so XLA neither drops,
merges nor reorders them: every rank runs its collectives in program order, as tutti's
checked calls require (a rank whose program differs gets tutti's mismatch error naming both
ranks, raised by JAX). The handlers are compiled against the installed jaxlib's FFI headers
(``jax.ffi.include_dir()``) with the system C++ compiler (``CXX``, else ``c++``), keyed by the
source and jaxlib's version: by the package's install where jax is importable there (``pip
install --no-build-isolation``; ``TUTTI_WITH_JAX=1`` makes a failure fail the install, ``=0``
skips it), else on first use into ``~/.cache/tutti/jax-ffi`` (``TUTTI_JAX_CACHE``);
``tutti.jax.build()`` compiles them ahead of time.

On JAX's ``cpu`` platform with a CPU communicator, and on its ``cuda`` platform with a
communicator of GPU ranks (one GPU per process, e.g. ``CUDA_VISIBLE_DEVICES=<local rank>`` and
``TUTTI_DEVICE=cuda:0`` when joining; a libtutti built with CUDA): there the handlers issue
NCCL's calls on the stream XLA runs the program on, ordered after the kernels before them and
before the kernels after them, without a host wait (a failure of that GPU work is raised by the
next tutti.jax call on that communicator). A program whose platform differs from its
communicator's device is refused when it is lowered.

``all_reduce`` with ``op="sum"`` is differentiable, with
mpi4jax's convention: its tangent is the all-reduce of the tangents, and its transpose hands
each rank's cotangent back unchanged (no communication), so ``jax.grad`` of a loss computed
from an all-reduced value gives each rank the gradient of that loss with respect to its own
input. The others are not differentiable. Under ``jax.vmap`` the batch travels as one call.

JAX runs compiled code asynchronously: before calling the same communicator's own methods
(``tutti.Communicator.all_reduce`` and so on) outside JAX, wait for the compiled functions that
use it (``block_until_ready()``), or every rank may not issue its calls in the same order.
"""

import ctypes
import pathlib
import threading

import numpy as np

import jax
import jax.numpy as jnp
from jax.interpreters import ad, batching, mlir

import tutti
from tutti import _ext

if not hasattr(jax, "ffi"):
    raise ImportError(f"tutti.jax needs jax 0.4.31 or newer (jax.ffi); this is jax {jax.__version__}")

# jax's primitives, effects and abstract values (jax.extend where it has them).
from jax._src import core as _core
from jax._src import dispatch as _dispatch
from jax._src import effects as _effects

__all__ = ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "default_comm", "build"]

_SOURCE = pathlib.Path(__file__).with_name("_jax_ffi.cc")
_TARGETS = {
    "all_reduce": "tutti_jax_all_reduce",
    "broadcast": "tutti_jax_broadcast",
    "all_gather": "tutti_jax_all_gather",
    "reduce_scatter": "tutti_jax_reduce_scatter",
}


class _TuttiEffect(_effects.Effect):
    """tutti's collectives: ordered among themselves, kept even when their result is unused."""

    def __str__(self):
        return "tutti"


_EFFECT = _TuttiEffect()
_effects.lowerable_effects.add_type(_TuttiEffect)
_effects.control_flow_allowed_effects.add_type(_TuttiEffect)
_effects.ordered_effects.add_type(_TuttiEffect)
_effects.custom_derivatives_allowed_effects.add_type(_TuttiEffect)
_effects.remat_allowed_effects.add_type(_TuttiEffect)

_lock = threading.Lock()
_handlers = None  # the compiled library, once registered


def build(into=None):
    """The handlers' shared library: compiled once per source and jaxlib (the package's install
    compiles it where jax is importable there), then cached; its path. ``into`` (a directory):
    compile it there, as the install does."""
    import jaxlib

    include = jax.ffi.include_dir()
    return _ext.compile_library(
        "tutti.jax", _SOURCE, "tutti_jax_ffi", "TUTTI_JAX_CACHE", "jax-ffi",
        ["-isystem", include], link_flags=["-ldl", "-pthread"], key_extra=jaxlib.__version__.encode(),
        into=into,
    )


def _register():
    """Compile, bind to the loaded libtutti and register the handlers with XLA, once."""
    global _handlers
    with _lock:
        if _handlers is not None:
            return
        lib = ctypes.CDLL(str(build()))
        tutti_lib = tutti._library()
        addr = _ext.function_address
        lib.tutti_jax_bind.argtypes = [ctypes.c_void_p] * 5
        lib.tutti_jax_bind.restype = ctypes.c_int
        if lib.tutti_jax_bind(
            addr(tutti_lib.tutti_all_reduce),
            addr(tutti_lib.tutti_broadcast),
            addr(tutti_lib.tutti_all_gather),
            addr(tutti_lib.tutti_reduce_scatter),
            addr(tutti_lib.tutti_last_error),
        ) != 0:
            raise RuntimeError("tutti.jax: binding the XLA handlers to libtutti failed")
        _ext.add_glue(lib.tutti_jax_set_comm, lib.tutti_jax_close_comm)
        for target in _TARGETS.values():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, target)), platform="cpu")
        if _has_gpu():
            lib.tutti_jax_bind_gpu.argtypes = [ctypes.c_void_p] * 9
            lib.tutti_jax_bind_gpu.restype = ctypes.c_int
            if lib.tutti_jax_bind_gpu(
                addr(tutti_lib.tutti_comm_set_cuda_stream),
                addr(tutti_lib.tutti_comm_unset_cuda_stream),
                addr(tutti_lib.tutti_all_reduce_async),
                addr(tutti_lib.tutti_broadcast_async),
                addr(tutti_lib.tutti_all_gather_async),
                addr(tutti_lib.tutti_reduce_scatter_async),
                addr(tutti_lib.tutti_work_wait),
                addr(tutti_lib.tutti_work_destroy),
                addr(tutti_lib.tutti_comm_abort),
            ) != 0:
                raise RuntimeError("tutti.jax: binding the GPU handlers to libtutti failed")
            for target in _TARGETS.values():
                capsule = jax.ffi.pycapsule(getattr(lib, target + "_gpu"))
                jax.ffi.register_ffi_target(target, capsule, platform="CUDA")
        _handlers = lib


def _has_gpu():
    """Whether this JAX runs on CUDA GPUs."""
    try:
        return bool(jax.devices("cuda"))
    except Exception:  # noqa: BLE001 - no CUDA backend: RuntimeError, or AssertionError
        return False


def default_comm():
    """The job's communicator (``tutti.from_env()``), joined on first use and kept open."""
    return _ext.default_comm()


def _comm(comm):
    return _ext.handle(comm, "tutti.jax", devices=("cpu", "cuda"))


# ----- the primitive: one for every collective, its kind a parameter -----

_p = _core.Primitive("tutti_collective")


def _out_aval(x, *, kind, world, **_):
    if kind == "all_gather":
        return _core.ShapedArray((world,) + tuple(x.shape), x.dtype)
    if kind == "reduce_scatter":
        return _core.ShapedArray((x.shape[0] // world,) + tuple(x.shape[1:]), x.dtype)
    return _core.ShapedArray(x.shape, x.dtype)


def _abstract_eval(x, **params):
    return _out_aval(x, **params), {_EFFECT}


_p.def_effectful_abstract_eval(_abstract_eval)


def _impl(x, **params):
    # Outside jit: the one-primitive program, compiled once per parameters and cached.
    return _dispatch.apply_primitive(_p, x, **params)


_p.def_impl(_impl)


def _lowering(ctx, x, *, kind, comm, op, root, world):
    # The communicator's buffers must be where the program's are: host memory for the cpu
    # platform, the GPU for cuda (a communicator closed meanwhile fails when called, saying so).
    platform = ctx.module_context.platforms[0]
    device = _ext.slot_device(comm)
    want = "cuda" if platform == "cuda" else "cpu"
    if device is not None and not device.startswith(want):
        how = (
            "join the job with TUTTI_DEVICE=cuda (each process's local-rank GPU) or cuda:N, or pass "
            "comm= a communicator made so"
            if want == "cuda"
            else "pass comm= a CPU communicator"
        )
        raise ValueError(
            f"tutti.jax.{kind}: this program runs on {platform}, but its communicator's buffers are "
            f"on {device}: {how}"
        )
    token = ctx.tokens_in.get(_EFFECT)
    sub = ctx.replace(
        avals_in=[_core.abstract_token, *ctx.avals_in],
        avals_out=[*ctx.avals_out, _core.abstract_token],
    )
    attrs = {"comm": np.uint64(comm)}
    if kind in ("all_reduce", "reduce_scatter"):
        attrs["op"] = np.int32(op)
    if kind == "broadcast":
        attrs["root"] = np.int64(root)
    # An all-reduce or a broadcast writes its result over its input (operand 1, after the token):
    # in place, where XLA can give up the input's buffer, without a copy.
    aliases = {1: 0} if kind in ("all_reduce", "broadcast") else None
    out, token = jax.ffi.ffi_lowering(_TARGETS[kind], has_side_effect=True, operand_output_aliases=aliases)(
        sub, token, x, **attrs
    )
    ctx.set_tokens_out(ctx.tokens_in.update_tokens(mlir.TokenSet({_EFFECT: token})))
    return [out]


mlir.register_lowering(_p, _lowering, platform="cpu")
mlir.register_lowering(_p, _lowering, platform="cuda")


def _batch(args, dims, **params):
    # The whole batch in one call. An all-reduce or a broadcast is element by element: the batch
    # axis stays where it is. all_gather adds a leading axis (the batch's moves one place on);
    # reduce_scatter cuts the leading axis, so the batch goes second and stays there.
    (x,), (d,) = args, dims
    kind = params["kind"]
    if kind in ("all_reduce", "broadcast"):
        return _p.bind(x, **params), d
    if kind == "all_gather":
        return _p.bind(x, **params), d + 1
    x = jnp.moveaxis(x, d, 1)
    return _p.bind(x, **params), 1


batching.primitive_batchers[_p] = _batch


def _jvp(primals, tangents, **params):
    (x,), (t,) = primals, tangents
    if params["kind"] != "all_reduce" or params["op"] != tutti.OPS["sum"]:
        raise NotImplementedError(
            f"tutti.jax.{params['kind']} is differentiable only as all_reduce with op='sum'"
        )
    return _p.bind(x, **params), _p.bind(ad.instantiate_zeros(t), **params)


def _transpose(ct, x, **params):
    # mpi4jax's convention: each rank's cotangent comes back as it is (see the module docs).
    if type(ct) is ad.Zero:
        return (ad.Zero(x.aval),)
    return (ct,)


ad.primitive_jvps[_p] = _jvp
ad.primitive_transposes[_p] = _transpose


def _bind(x, kind, comm, op=0, root=0):
    _register()
    comm, slot = _comm(comm)
    x = jnp.asarray(x)
    name = np.dtype(x.dtype).name
    op = op if kind in ("all_reduce", "reduce_scatter") else None
    _ext.check_dtype(name, np.issubdtype(np.dtype(x.dtype), np.integer), f"tutti.jax.{kind}", op)
    return _p.bind(x, kind=kind, comm=slot, op=op or 0, root=root, world=comm.world_size)


# ----- the API -----


def all_reduce(x, op="sum", comm=None):
    """Every rank's ``x`` combined element by element with ``op`` ("sum", "avg"/"mean", "prod",
    "min", "max", and on integers "band", "bor", "bxor"), on every rank."""
    return _bind(x, "all_reduce", comm, op=tutti._op(op))


def all_gather(x, comm=None):
    """Every rank's ``x``, in rank order along a new leading axis: shape ``(world_size, *x.shape)``."""
    return _bind(x, "all_gather", comm)


def reduce_scatter(x, op="sum", comm=None):
    """This rank's slice of the leading axis of the element-wise ``op`` of every rank's ``x``:
    ``x.shape[0]`` must be a multiple of the world size; rank r gets rows ``r*n .. (r+1)*n``
    of the reduction, ``n = x.shape[0] // world_size``."""
    c, _ = _comm(comm)
    x = jnp.asarray(x)
    if x.ndim == 0 or x.shape[0] % c.world_size != 0:
        raise ValueError(
            f"tutti.jax.reduce_scatter: the leading axis ({x.shape[0] if x.ndim else 'none'}) "
            f"must be a multiple of the world size ({c.world_size})"
        )
    return _bind(x, "reduce_scatter", comm, op=tutti._op(op))


def broadcast(x, root=0, comm=None):
    """The ``root`` rank's ``x`` on every rank."""
    c, _ = _comm(comm)
    if not 0 <= int(root) < c.world_size:
        raise ValueError(f"tutti.jax.broadcast: root {root} is out of range for a world of {c.world_size} ranks")
    return _bind(x, "broadcast", comm, root=int(root))

