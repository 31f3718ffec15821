"""What tutti.jax and tutti.tensorflow share: compiling their C++ glue against the installed
framework on first use, the job's communicator that their collectives use by default, and the
slots by which compiled programs name communicators.

A compiled program (a jitted function, a TensorFlow graph) names a communicator by a slot: a
number given to it once and never again, which each loaded glue library maps to the
communicator's handle. Closing the communicator clears its slot in every glue (waiting for the
calls in flight, up to its timeout, then aborting it), so a program compiled for it fails,
saying the communicator is closed, instead of reaching another communicator allocated at the
same address later."""

import ctypes
import hashlib
import itertools
import os
import pathlib
import shutil
import subprocess
import tempfile
import threading

import tutti

# Re-entrant: a communicator freed by the garbage collector while this thread holds it closes
# (and runs this module's hook) on this very thread.
_lock = threading.RLock()
_joining = threading.Lock()  # held while the job's communicator is joined, apart from _lock
_default = None  # the job's communicator (comm=None)
_GLUE_HEADER = pathlib.Path(__file__).with_name("_glue.h")
_slots = {}  # id of a communicator's lifetime -> its slot
_by_slot = {}  # slot -> the communicator, kept alive until it is closed
_numbers = itertools.count(1)
_glues = []  # each loaded glue library's (set_comm, close_comm)
_kept = {}  # other handles a graph names (TuttiAllReduce's replica groups), kept for good


# Where the package's install put the glue it compiled against the frameworks installed then
# (``pip install --no-build-isolation``; see setup.py): used where its key still matches.
PREBUILT = pathlib.Path(__file__).with_name("_prebuilt")


def compile_library(what, source, stem, cache_env, cache_name, flags, link_flags=(), key_extra=b"", into=None):
    """``source`` compiled into a shared library, once per source, flags and ``key_extra`` (the
    framework's version): the one the package's install built (``PREBUILT``) where its key
    matches, else cached in ``$cache_env`` or ``~/.cache/tutti/<cache_name>``; ``into`` (a
    directory) compiles it there instead, as the install does."""
    text = source.read_bytes() + _GLUE_HEADER.read_bytes()
    key = hashlib.sha256(text + key_extra + "\0".join([*flags, *link_flags]).encode()).hexdigest()[:16]
    name = f"{stem}-{key}.so"
    if into is None and (PREBUILT / name).is_file():
        return PREBUILT / name
    own = pathlib.Path.home() / ".cache" / "tutti"
    cached = pathlib.Path(os.environ.get(cache_env) or own / cache_name) / name
    cache = pathlib.Path(into) if into else cached.parent
    lib = cache / name
    if lib.exists():
        return lib
    if into is not None and cached.is_file():
        # Built for this very key already: the same bytes, without compiling again.
        cache.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(cached, lib)
        os.chmod(lib, 0o755)
        return lib
    if into is None and not os.environ.get(cache_env):
        # ~/.cache/tutti also holds the per-user job secret, which tutti refuses to read from a
        # directory others may read: made here first, it is made private, as tutti makes it.
        own.parent.mkdir(parents=True, exist_ok=True)
        own.mkdir(mode=0o700, exist_ok=True)
    cache.mkdir(parents=True, exist_ok=True)
    cxx = os.environ.get("CXX", "c++")
    # Several ranks may compile at once: each into its own file, renamed into place.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
    os.close(fd)
    include = ["-I", str(_GLUE_HEADER.parent)]
    cmd = [cxx, "-std=c++17", "-O2", "-shared", "-fPIC", *include, *flags, str(source), "-o", tmp, *link_flags]
    limit = float(os.environ.get("TUTTI_COMPILE_TIMEOUT", "900"))
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=limit)
    except FileNotFoundError:
        os.unlink(tmp)
        raise RuntimeError(
            f"{what} compiles its C++ glue on first use and needs a C++ compiler: {cxx} "
            "was not found (install g++ or clang++, or set CXX)"
        ) from None
    except subprocess.TimeoutExpired:
        os.unlink(tmp)
        raise RuntimeError(
            f"{what}: compiling its C++ glue took more than {limit:g} s (TUTTI_COMPILE_TIMEOUT) and was "
            f"stopped: {' '.join(cmd)}"
        ) from None
    if done.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(f"{what}: compiling its C++ glue failed ({' '.join(cmd)}):\n{done.stderr}")
    os.chmod(tmp, 0o755)
    os.replace(tmp, lib)
    return lib


def function_address(f):
    """A libtutti function's address, to hand to glue that calls it."""
    return ctypes.cast(f, ctypes.c_void_p)


def default_comm():
    """The job's communicator (``tutti.from_env()``), joined on first use and kept open."""
    global _default
    with _joining:
        if _default is None:
            _default = tutti.from_env()
        return _default


def _address(comm):
    h = comm._h.h
    return int(h.value if isinstance(h, ctypes.c_void_p) else h)


def add_glue(set_comm, close_comm):
    """A loaded glue library's ``set_comm(slot, handle)`` and ``close_comm(slot, wait_ms) ->
    calls left`` (its ctypes functions): told every communicator's slot, now and from now on."""
    set_comm.argtypes = [ctypes.c_uint64, ctypes.c_void_p]
    set_comm.restype = None
    close_comm.argtypes = [ctypes.c_uint64, ctypes.c_int64]
    close_comm.restype = ctypes.c_int
    with _lock:
        _glues.append((set_comm, close_comm))
        for slot, comm in _by_slot.items():
            set_comm(slot, _address(comm))


def handle(comm, what, devices=("cpu",)):
    """``comm`` (None: the job's communicator), checked to be an open communicator on one of
    ``devices`` ("cpu", "cuda"), and its slot (see the module documentation); the communicator
    is kept alive until it is closed."""
    comm = default_comm() if comm is None else comm
    if not isinstance(comm, tutti.Communicator):
        raise TypeError(f"comm must be a tutti.Communicator or None, not {type(comm).__name__}")
    if not comm._h.h:
        raise ValueError("this communicator is closed")
    if not comm.device.startswith(tuple(devices)):
        kinds = " and ".join(d.upper() for d in devices)
        raise ValueError(f"{what} runs on {kinds} communicators; this one is on {comm.device}")
    with _lock:
        slot = _slots.get(id(comm._h))
        if slot is None:
            # Refused while it closes (another thread may be closing it now), and registered
            # whole or not at all.
            if getattr(comm._h, "glue_closing", False) or not comm._h.h:
                raise ValueError("this communicator is closed")
            address = _address(comm)
            slot = next(_numbers)
            for set_comm, _ in _glues:
                set_comm(slot, address)
            _slots[id(comm._h)] = slot
            _by_slot[slot] = comm
    return comm, slot


def slot_device(slot):
    """The device of the communicator of ``slot`` ("cpu", "cuda:0", ...), or None once closed."""
    with _lock:
        comm = _by_slot.get(slot)
        return None if comm is None else comm.device


def _closing(comm):
    """Before ``comm`` is closed: no new slot is given to it, its slot goes from every glue, and
    its calls in flight are waited for (up to its timeout, then it is aborted, which ends them;
    should any still be inside, TimeoutError, and the handle stays allocated)."""
    life = comm._h
    with _lock:
        life.glue_closing = True
        slot = _slots.pop(id(life), None)
        _by_slot.pop(slot, None)
        glues = list(_glues)
    if slot is None:
        return
    wait_ms = int(comm._timeout * 1000)
    for _, close_comm in glues:
        if close_comm(slot, wait_ms) > 0:
            comm.abort("closed while a compiled program's collective was in flight")
            if close_comm(slot, wait_ms) > 0:
                raise TimeoutError(
                    "a compiled program's collective was still inside this communicator after its "
                    "timeout and an abort: it is left open rather than freed under it"
                )


tutti._close_hooks.append(_closing)


def check_dtype(name, is_integer, what, op=None):
    """Refuse, here where the communicator stays usable, a dtype tutti does not carry and a
    bitwise op on floats (rather than by every rank's call)."""
    if name not in tutti.DTYPES:
        raise TypeError(f"{what}: dtype {name} is not one tutti reduces (expected one of {', '.join(tutti.DTYPES)})")
    if op in {tutti.OPS[k] for k in ("band", "bor", "bxor")} and not is_integer:
        raise TypeError(f"{what}: bitwise ops are for integer types, not {name}")


def keep(obj):
    """Keep ``obj`` (a handle whose address a graph holds) alive for good."""
    with _lock:
        _kept[id(obj)] = obj
