"""What tutti.jax and tutti.tensorflow share: compiling their C++ glue against the installed
framework on first use, and the job's communicator that their collectives use by default."""

import ctypes
import hashlib
import os
import pathlib
import subprocess
import tempfile
import threading

import tutti

_lock = threading.Lock()
_default = None  # the job's communicator (comm=None)
# Every communicator a framework's graph or program named, kept alive: a compiled function holds
# its address, which must not be freed and reused by another communicator while it may run.
_named = {}


def compile_library(what, source, stem, cache_env, cache_name, flags, link_flags=(), key_extra=b""):
    """``source`` compiled into a shared library, once per source, flags and ``key_extra`` (the
    framework's version), cached in ``$cache_env`` or ``~/.cache/tutti/<cache_name>``."""
    text = source.read_bytes()
    key = hashlib.sha256(text + key_extra + "\0".join([*flags, *link_flags]).encode()).hexdigest()[:16]
    cache = pathlib.Path(os.environ.get(cache_env) or pathlib.Path.home() / ".cache" / "tutti" / cache_name)
    lib = cache / f"{stem}-{key}.so"
    if lib.exists():
        return lib
    cache.mkdir(parents=True, exist_ok=True)
    cxx = os.environ.get("CXX", "c++")
    # Several ranks may compile at once: each into its own file, renamed into place.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
    os.close(fd)
    cmd = [cxx, "-std=c++17", "-O2", "-shared", "-fPIC", *flags, str(source), "-o", tmp, *link_flags]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True)
    except FileNotFoundError:
        os.unlink(tmp)
        raise RuntimeError(
            f"{what} compiles its C++ glue on first use and needs a C++ compiler: {cxx} "
            "was not found (install g++ or clang++, or set CXX)"
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
    with _lock:
        if _default is None:
            _default = tutti.from_env()
        return _default


def handle(comm, what):
    """``comm`` (None: the job's communicator), checked to be an open CPU communicator, and its
    address, which is kept valid for as long as the process lives."""
    comm = default_comm() if comm is None else comm
    if not isinstance(comm, tutti.Communicator):
        raise TypeError(f"comm must be a tutti.Communicator or None, not {type(comm).__name__}")
    h = comm._h.h
    if not h:
        raise ValueError("this communicator is closed")
    if not comm.device.startswith("cpu"):
        raise ValueError(f"{what} runs on CPU communicators; this one is on {comm.device}")
    address = int(h.value if isinstance(h, ctypes.c_void_p) else h)
    with _lock:
        _named[address] = comm
    return comm, address


def keep(obj, address):
    """Keep ``obj`` (a communicator or replicas whose address a graph holds) alive."""
    with _lock:
        _named[address] = obj
