"""The torch.distributed backend ``"tutti"``: ``import tutti.torch`` registers it.

::

    import torch.distributed as dist
    import tutti.torch  # registers "tutti"

    dist.init_process_group("tutti")            # env:// (torchrun), tcp://, file://, or store=
    dist.init_process_group("cpu:tutti,cuda:nccl")
    model = torch.nn.parallel.DistributedDataParallel(model)

The ranks meet through the store torch hands the backend (no second port): each rank listens on
a port the OS picks and publishes it there, and rank 0 puts a fresh random job token there,
which every connection between the ranks then proves. Each call is a non-blocking tutti call:
the returned ``Work``'s ``wait()`` honours torch's timeout, and its ``get_future()`` completes
when the call does, so DDP overlaps the all-reduce of a bucket with the rest of the backward
pass. tutti's errors (which rank, which call, which field) reach the caller as ``TuttiError``,
a ``RuntimeError``.

The backend runs on CPU tensors. ``new_group(ranks)`` makes a tutti communicator over the
group's own store. Ops: ``SUM``, ``AVG``, ``PRODUCT``, ``MIN``, ``MAX``, ``PREMUL_SUM`` (the
input scaled, then summed), and ``BAND``, ``BOR``, ``BXOR`` on integer tensors. Besides the
reductions and gathers: ``all_to_all_single`` (with and without split sizes), ``all_to_all``,
``gather`` and ``scatter``; ``send``, ``recv``, ``isend``, ``irecv`` and ``batch_isend_irecv``
(tag 0 only: sends and receives between two ranks match in issue order; ``recv`` without a
source is refused).

Point-to-point calls are held back and run together, as one tutti group: torch's
``batch_isend_irecv`` posts its operations one by one on this backend, and user code often posts
``isend`` before ``irecv`` on every rank, which run one at a time could deadlock. The held
operations are issued, as one group that runs in the background, when one of their ``Work``
objects is waited on or asked for its future (the calling thread then waits for them), when a
collective or barrier is issued on the backend (which comes after them, without waiting for
them), or when the backend shuts down.
"""

from __future__ import annotations

import datetime
import functools
import ipaddress
import os
import queue
import secrets
import socket
import threading
import time
from typing import Any, Callable, List, Optional, Sequence, Tuple

try:
    import torch
except ImportError as e:
    raise ImportError(
        "tutti.torch is the torch.distributed backend and needs PyTorch 2.9 to 2.15: "
        "pip install torch (or pip install './bindings/python[torch]' from tutti's checkout)"
    ) from e
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as _CBackend

import tutti

__all__ = ["TESTED_TORCH", "TuttiBackend", "BACKEND_NAME"]

#: The name the backend is registered under.
BACKEND_NAME = "tutti"

#: The torch releases (major, minor) this backend is tested with: the releases from the first to
#: the last of them are taken (those between run the same code as their neighbours), others are
#: refused, saying so, unless ``TUTTI_TORCH_UNTESTED=1``.
TESTED_TORCH = ((2, 9), (2, 11), (2, 13), (2, 14), (2, 15))


def _check_torch_version() -> None:
    parts = torch.__version__.split("+")[0].split(".")
    try:
        have = (int(parts[0]), int(parts[1]))
    except (IndexError, ValueError):
        have = None
    if have is not None and TESTED_TORCH[0] <= have <= TESTED_TORCH[-1]:
        return
    if os.environ.get("TUTTI_TORCH_UNTESTED") == "1":
        return
    tested = ", ".join(f"{a}.{b}" for a, b in TESTED_TORCH)
    raise ImportError(
        f"tutti.torch is tested with torch {tested} and takes the releases between them; "
        f"this is torch {torch.__version__}. "
        "Install a tested torch, or set TUTTI_TORCH_UNTESTED=1 to try this one anyway."
    )


_check_torch_version()

# ----- the store torch hands the backend, as tutti's rendezvous store -----

_TOKEN_KEY = "tutti/token"


def _millis(td: Optional[datetime.timedelta]) -> Optional[float]:
    if td is None:
        return None
    ms = td.total_seconds() * 1000
    return ms if ms > 0 else None


class _TorchStore:
    """A torch ``Store`` as tutti's ``set`` / ``get`` (waiting, bounded) / ``add``."""

    def __init__(self, store: dist.Store):
        self.store = store

    def set(self, key: str, value: bytes) -> None:
        self.store.set(key, value)

    def get(self, key: str, timeout_s: float) -> bytes:
        # At least a millisecond: torch reads a zero timeout as "wait forever".
        bound = datetime.timedelta(seconds=max(timeout_s, 0.001))
        try:
            self.store.wait([key], bound)
        except RuntimeError as e:
            # torch's own words, "Wait timeout": a DistStoreError from TCPStore, a plain
            # RuntimeError from FileStore.
            if "timeout" in str(e).lower():
                raise TimeoutError(f"store key {key!r} was not set within {bound}") from e
            raise
        return self.store.get(key)

    def add(self, key: str, delta: int) -> int:
        return self.store.add(key, delta)


def _listen_host(store: dist.Store) -> str:
    """The address of this host that the other ranks reach: ``TUTTI_LISTEN_HOST``, else the
    local address of the route to the store's host (or ``MASTER_ADDR``), else loopback."""
    explicit = os.environ.get("TUTTI_LISTEN_HOST")
    if explicit:
        return explicit
    inner = store
    while hasattr(inner, "underlying_store"):
        inner = inner.underlying_store
    peer = getattr(inner, "host", None) or os.environ.get("MASTER_ADDR")
    if not peer:
        return "127.0.0.1"
    try:
        infos = socket.getaddrinfo(peer, None, type=socket.SOCK_DGRAM)
    except OSError:
        return "127.0.0.1"
    for family, _, _, _, addr in infos:
        if ipaddress.ip_address(addr[0].split("%")[0]).is_loopback:
            return "127.0.0.1" if family == socket.AF_INET else "::1"
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect((addr[0], 9))  # UDP: no packet is sent, the route is chosen
                return s.getsockname()[0]
        except OSError:
            continue
    return "127.0.0.1"


# ----- work -----


# Set on a thread while it completes a future: torch runs the future's callbacks there.
_completing = threading.local()


class _Waiter:
    """One thread per backend that completes the futures torch asked for (DDP's), in the
    order the calls were issued (the order they complete in). It waits inside libtutti, with
    the GIL released.

    A future's callbacks run on the thread that completes it, and a callback may wait for the
    future of a call it issues itself (PowerSGD's DDP hook does): a future asked for while a
    future is being completed gets a thread of its own, so the waiter is never waiting for
    itself."""

    def __init__(self) -> None:
        self._queue: "queue.SimpleQueue[Optional[_Work]]" = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()

    def submit(self, work: "_Work") -> None:
        if getattr(_completing, "active", False):
            threading.Thread(target=work._finish, args=(None,), name="tutti-future", daemon=True).start()
            return
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, args=(self._queue,), name="tutti-futures",
                                                daemon=True)
                self._thread.start()
            self._queue.put(work)

    @staticmethod
    def _run(q: "queue.SimpleQueue[Optional[_Work]]") -> None:
        while True:
            work = q.get()
            if work is None:
                return
            work._finish(None)

    def stop(self) -> None:
        """End the thread once the futures asked for so far are complete; a future asked for
        later starts a new one."""
        with self._lock:
            if self._thread is not None:
                self._queue.put(None)
                self._thread = None
                self._queue = queue.SimpleQueue()


class _Work(dist.Work):
    """A tutti call as torch's ``Work``. ``then`` runs once the call succeeded (copies out of
    a staging buffer), before the future completes or ``wait()`` returns."""

    def __init__(
        self,
        backend: "TuttiBackend",
        calls: Sequence[tutti.Work],
        result: Any,
        what: str,
        then: Optional[Callable[[], None]] = None,
    ) -> None:
        super().__init__()
        self._backend = backend
        self._calls = list(calls)
        self._result = result
        self._what = what
        self._then = then
        self._lock = threading.Lock()
        self._outcome: Optional[BaseException] = None
        self._done = False
        # (the future completed here, the one handed out): see get_future.
        self._future: Optional[Tuple[torch.futures.Future, torch.futures.Future]] = None

    def _finish(self, bound_s: Optional[float]) -> None:
        """Wait for the calls (up to ``bound_s``; None: their own timeout), then record the
        outcome once, run ``then`` and complete the future."""
        error: Optional[BaseException] = None
        deadline = None if bound_s is None else time.monotonic() + bound_s
        try:
            for c in self._calls:
                c.wait(None if deadline is None else max(deadline - time.monotonic(), 0.001))
        except tutti.TuttiError as e:
            if e.code == "TUTTI_ERROR_WAIT_TIMEOUT":
                reason = (
                    f"rank {self._backend.rank()}: {self._what} did not complete within "
                    f"torch's timeout of {bound_s} s"
                )
                self._backend.abort_group(reason)
                raise tutti.TuttiError(e.result, reason) from None
            error = e
        with self._lock:
            if self._done:
                return
            if error is None and self._then is not None:
                try:
                    self._then()
                except BaseException as e:  # noqa: BLE001 - handed to the waiter
                    error = e
            self._outcome, self._done = error, True
            future = self._future
        if future is not None:
            self._complete(future[0])

    def _complete(self, inner: torch.futures.Future) -> None:
        was = getattr(_completing, "active", False)
        _completing.active = True
        try:
            inner.set_result((self._outcome, self._result))
        finally:
            _completing.active = was

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        ms = _millis(timeout)
        self._finish(None if ms is None else ms / 1000)
        if self._outcome is not None:
            raise self._outcome
        return True

    def get_future(self) -> torch.futures.Future:
        """A future of the call's result (the tensors), or of its error. The error reaches C++
        (DDP's reducer) as an error: an inner future completes with (error, result) and this
        one is its ``then``, which raises the error. (``Future.set_exception`` would not do:
        C++ would see a successful future holding a Python exception object.)"""
        with self._lock:
            if self._future is not None:
                return self._future[1]
            inner: torch.futures.Future = torch.futures.Future()
            self._future = (inner, inner.then(_unwrap))
            done = self._done
        if done:
            self._complete(inner)
        else:
            self._backend._waiter.submit(self)
        return self._future[1]


class _PeerBatch:
    """Point-to-point operations held back to run as one group (see the module's docstring):
    ``("send" | "recv", tensor, peer)`` in the order torch posted them; once issued, the
    group's ``tutti.Work``, or the error that kept it from being issued."""

    def __init__(self) -> None:
        self.ops: List[Tuple[str, torch.Tensor, int]] = []
        self.ran = False
        self.work: Any = None
        self.error: Optional[BaseException] = None

    def outcome(self) -> Optional[BaseException]:
        """Wait for the issued group: its error, or None."""
        if self.error is None and self.work is not None:
            try:
                self.work.wait()  # waiting again after completion gives the same result
            except Exception as e:  # noqa: BLE001 - handed to the batch's Work objects
                return e
        return self.error


class _PeerWork(dist.Work):
    """The ``Work`` of an ``isend`` or ``irecv``: waiting on it or asking for its future runs the held operations (its own and every other one held on the backend) as one
    group first."""

    def __init__(self, backend: "TuttiBackend", batch: _PeerBatch, result: Any) -> None:
        super().__init__()
        self._backend = backend
        self._batch = batch
        self._result = result

    def _run(self) -> None:
        if not self._batch.ran:
            self._backend._run_held()

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        # Bounded by the communicator's timeout (torch's, given when the group was made).
        self._run()
        error = self._batch.outcome()
        if error is not None:
            raise error
        return True

    def is_completed(self) -> bool:
        # Seen when this object is used from Python; torch's wrapper around a Python
        # backend's Work forwards only wait() and get_future() to it.
        self._run()
        work = self._batch.work
        return work is None or work.is_completed()

    def get_future(self) -> torch.futures.Future:
        """A completed future of the received tensors (or the group's error, raised by its
        ``wait``), once the held operations have run."""
        self._run()
        inner: torch.futures.Future = torch.futures.Future()
        inner.set_result((self._batch.outcome(), self._result))
        return inner.then(_unwrap)


def _unwrap(inner: torch.futures.Future) -> Any:
    error, result = inner.value()
    if error is not None:
        raise error.with_traceback(None)
    return result


# ----- the backend -----


def _rejecting(method: Callable[..., _Work]) -> Callable[..., _Work]:
    """A call whose arguments this rank rejects (a wrong count of tensors, uneven sizes, an
    op without its factor) aborts the group before raising, as tutti's own checks do, so the
    other ranks fail at once naming this one instead of waiting out the timeout."""

    @functools.wraps(method)
    def checked(self: "TuttiBackend", *args: Any, **kwargs: Any) -> _Work:
        try:
            return method(self, *args, **kwargs)
        except (tutti.TuttiError, NotImplementedError):
            raise
        except (TypeError, ValueError, IndexError, RuntimeError) as e:
            self.abort_group(f"rank {self.rank()} rejected its arguments to {method.__name__}: {e}")
            raise

    return checked


def _one_tensor(tensors: Sequence[torch.Tensor], what: str) -> torch.Tensor:
    if len(tensors) != 1:
        raise ValueError(f"{what}: tutti takes one tensor per rank, not {len(tensors)}")
    return tensors[0]


def _flat_view(tensors: Sequence[torch.Tensor], uneven: bool = False) -> Optional[torch.Tensor]:
    """One tensor over ``tensors`` when they lie back to back in one storage (as
    ``torch.empty(n * k).chunk(n)`` makes them; with ``uneven``, tensors of different sizes as
    ``split([a, b, ...])`` makes them), else None."""
    if not tensors:
        return None
    first = tensors[0]
    if not all(t.is_contiguous() and t.dtype == first.dtype and t.device == first.device for t in tensors):
        return None
    if not uneven and any(t.numel() != first.numel() for t in tensors):
        return None
    at = first.data_ptr()
    for t in tensors:
        if t.data_ptr() != at:
            return None
        at += t.numel() * t.element_size()
    if any(t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() for t in tensors):
        return None
    flat = torch.empty(0, dtype=first.dtype, device=first.device)
    flat.set_(first.untyped_storage(), first.storage_offset(), (sum(t.numel() for t in tensors),))
    return flat


def _base_class() -> type:
    """What the backend derives from: torch's ``Backend`` where it takes a subclass written in
    Python (torch 2.14 on), else ``ProcessGroup``, which torch then uses as the whole process
    group, as it does the Python process groups of its own tests."""
    class _Probe(_CBackend):
        pass

    try:
        _Probe(0, 1)
    except TypeError:  # "No constructor defined": torch before 2.14
        return dist.ProcessGroup
    return _CBackend


_Base = _base_class()


class TuttiBackend(_Base):  # type: ignore[misc, valid-type]
    """One rank of a torch process group, over a tutti communicator. Made by torch through
    ``init_process_group("tutti")`` and ``new_group(...)``; not constructed directly."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: datetime.timedelta):
        super().__init__(rank, size)
        self._timeout_s = timeout.total_seconds() if timeout.total_seconds() > 0 else None
        token_store = _TorchStore(store)
        # One token per communicator made over this store: torch reuses a group's store
        # prefix after destroy_process_group, and a rank must not read the last job's token.
        key = f"{_TOKEN_KEY}/{store.add(f'{_TOKEN_KEY}/made/{rank}', 1)}"
        if rank == 0:
            store.set(key, secrets.token_hex(16))
        token = token_store.get(key, self._timeout_s or 300.0).decode()
        self._comm = tutti.from_store(
            rank,
            size,
            token_store,
            token,
            listen_host=_listen_host(store),
            timeout=self._timeout_s,
        )
        self._waiter = _Waiter()
        # Point-to-point operations held back until something needs them (see _run_held).
        self._held = _PeerBatch()
        self._held_lock = threading.RLock()

    # -- torch's bookkeeping --

    @property
    def supports_coalescing(self) -> bool:
        """False: torch's ``batch_isend_irecv`` then posts its operations one by one, which
        this backend holds and runs as one group. (The base class's property would ask C++,
        which asks this Python object again, without end.)"""
        return False

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        """The name torch knows this backend by: "tutti"."""
        return BACKEND_NAME

    def abort_group(self, reason: str) -> None:
        """Fail every call of this group, on every rank, with ``reason``."""
        try:
            self._comm.abort(reason)
        except (tutti.TuttiError, ValueError):
            pass

    def abort(self) -> None:
        """Abort the group (every rank's calls fail at once, naming this rank) and release it."""
        self.abort_group(f"rank {self.rank()}: torch aborted the process group")
        self.shutdown()

    def shutdown(self) -> None:
        """Release the communicator (destroy_process_group): held point-to-point operations
        run first (their errors reach their ``Work``); calls still running are waited for, up to
        the timeout."""
        try:
            self._run_held()
        except ValueError:
            pass  # closed already
        self._waiter.stop()
        try:
            self._comm.close()
        except ValueError:
            pass

    # -- helpers --

    def _issue(self, what: str, calls: Callable[[], List[tutti.Work]], result: Any,
               then: Optional[Callable[[], None]] = None) -> _Work:
        """The calls' ``Work``. A group that has already failed (a peer lost, aborted) fails
        the work, not the issuing call: DDP issues from inside the backward pass, where torch
        does not expect the backend to raise, and reports the future's error instead. Held
        point-to-point operations run first, keeping their order with the collectives."""
        self._run_held()
        try:
            issued = calls()
        except tutti.TuttiError as e:
            work = _Work(self, [], result, what, None)
            work._outcome, work._done = e, True
            return work
        return _Work(self, issued, result, what, then)

    def _reduce_args(self, tensor: torch.Tensor, opts: Any, what: str, in_place: bool):
        """The op for tutti, and the input to reduce: PREMUL_SUM scales the input by its
        factor first (in place where the call is in place, else into a copy), then sums."""
        op = opts.reduceOp  # tutti reads torch's ReduceOp itself (SUM, AVG, BAND, ...)
        if getattr(getattr(op, "op", op), "name", None) != "PREMUL_SUM":
            return op, tensor
        factor = getattr(op, "factor", None)
        if factor is None and not hasattr(op, "factor"):
            # Not this rank's argument error: every rank's torch keeps the factor alike.
            raise NotImplementedError(
                f"{what}: ReduceOp.PREMUL_SUM needs torch 2.13 or later, whose ReduceOp gives a "
                f"backend written in Python its factor; this is torch {torch.__version__}"
            )
        if factor is None:
            raise ValueError(f"{what}: ReduceOp.PREMUL_SUM without a factor")
        return "sum", tensor.mul_(factor) if in_place else tensor * factor

    # -- the collectives torch calls --

    @_rejecting
    def allreduce(self, tensors: List[torch.Tensor], opts: Any) -> _Work:
        """``dist.all_reduce``: the tensor becomes the op over every rank's, in place."""
        t = _one_tensor(tensors, "allreduce")
        op, t = self._reduce_args(t, opts, "allreduce", in_place=True)
        return self._issue("allreduce", lambda: [self._comm.all_reduce(t, op, async_op=True)], tensors)

    @_rejecting
    def allreduce_coalesced(self, tensors: List[torch.Tensor], opts: Any) -> _Work:
        """``dist.all_reduce_coalesced``: each tensor all-reduced in place, in order."""
        args = [self._reduce_args(t, opts, "allreduce_coalesced", in_place=True) for t in tensors]
        return self._issue(
            "allreduce_coalesced",
            lambda: [self._comm.all_reduce(t, op, async_op=True) for op, t in args],
            tensors,
        )

    @_rejecting
    def broadcast(self, tensors: List[torch.Tensor], opts: Any) -> _Work:
        """``dist.broadcast``: the tensor becomes the root rank's, in place."""
        t = _one_tensor(tensors, "broadcast")
        root = opts.rootRank
        return self._issue("broadcast", lambda: [self._comm.broadcast(t, root, async_op=True)], tensors)

    @_rejecting
    def reduce(self, tensors: List[torch.Tensor], opts: Any) -> _Work:
        """``dist.reduce``: the root's tensor becomes the op over every rank's; others are unchanged."""
        t = _one_tensor(tensors, "reduce")
        root = opts.rootRank
        # In place at the root only: elsewhere a PREMUL_SUM scales a copy.
        op, src = self._reduce_args(t, opts, "reduce", in_place=self.rank() == root)
        return self._issue("reduce", lambda: [self._comm.reduce(src, op, root, out=t, async_op=True)], tensors)

    def _gather_into(self, outputs: List[torch.Tensor], t: torch.Tensor, what: str,
                     staged: List[Callable[[], None]]) -> List[tutti.Work]:
        """All-gather ``t`` into the list ``outputs`` (one per rank): straight into them when
        they lie back to back, else through one staging tensor, whose copy-out is appended to
        ``staged`` (to run on completion)."""
        if len(outputs) != self.size():
            raise ValueError(f"{what}: {len(outputs)} output tensors for a group of {self.size()}")
        flat = _flat_view(outputs)
        if flat is not None:
            return [self._comm.all_gather(t, out=flat, async_op=True)]
        staging = torch.empty(t.numel() * self.size(), dtype=t.dtype, device=t.device)

        def copy_out() -> None:
            for o, part in zip(outputs, staging.chunk(self.size())):
                o.copy_(part.view_as(o))

        staged.append(copy_out)
        return [self._comm.all_gather(t, out=staging, async_op=True)]

    @_rejecting
    def allgather(self, output_tensors: List[List[torch.Tensor]], input_tensors: List[torch.Tensor],
                  opts: Any) -> _Work:
        """``dist.all_gather``: output list ``[r]`` becomes rank r's input."""
        t = _one_tensor(input_tensors, "allgather")
        staged: List[Any] = []
        return self._issue("allgather", lambda: self._gather_into(output_tensors[0], t, "allgather", staged),
                           output_tensors, lambda: [f() for f in staged])

    @_rejecting
    def allgather_coalesced(self, output_lists: List[List[torch.Tensor]], input_tensors: List[torch.Tensor],
                            opts: Any) -> _Work:
        """``dist.all_gather_coalesced``: an all-gather per input tensor."""
        staged: List[Any] = []
        return self._issue(
            "allgather_coalesced",
            lambda: [c for outs, t in zip(output_lists, input_tensors)
                     for c in self._gather_into(outs, t, "allgather_coalesced", staged)],
            output_lists,
            lambda: [f() for f in staged],
        )

    @_rejecting
    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> _Work:
        """``dist.all_gather_into_tensor``: every rank's input back to back in ``output``."""
        return self._issue(
            "_allgather_base", lambda: [self._comm.all_gather(input, out=output, async_op=True)], [output]
        )

    @_rejecting
    def all_gather_single_coalesced(self, outputs: List[torch.Tensor], inputs: List[torch.Tensor],
                                    opts: Any) -> _Work:
        """``allgather_into_tensor_coalesced`` (FSDP): one all-gather per pair."""
        return self._issue(
            "allgather_into_tensor_coalesced",
            lambda: [self._comm.all_gather(i, out=o, async_op=True) for o, i in zip(outputs, inputs)],
            outputs,
        )

    @_rejecting
    def reduce_scatter(self, output_tensors: List[torch.Tensor], input_lists: List[List[torch.Tensor]],
                       opts: Any) -> _Work:
        """``dist.reduce_scatter``: the output becomes this rank's slot of the op over every rank's list."""
        out = _one_tensor(output_tensors, "reduce_scatter")
        inputs = input_lists[0]
        if len(inputs) != self.size():
            raise ValueError(f"reduce_scatter: {len(inputs)} input tensors for a group of {self.size()}")
        uneven = [i for i, t in enumerate(inputs) if t.numel() != out.numel()]
        if uneven:
            raise ValueError(
                f"reduce_scatter: input {uneven[0]} has {inputs[uneven[0]].numel()} elements, the output "
                f"{out.numel()}; every input must match the output"
            )
        flat = _flat_view(inputs)
        if flat is None:
            flat = torch.cat([i.reshape(-1) for i in inputs])
        op, flat = self._reduce_args(flat, opts, "reduce_scatter", in_place=False)
        return self._issue(
            "reduce_scatter",
            lambda: [self._comm.reduce_scatter(flat, op, out=out, async_op=True)],
            output_tensors,
        )

    @_rejecting
    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any) -> _Work:
        """``dist.reduce_scatter_tensor``: this rank's slice of the op over every rank's ``input``."""
        op, src = self._reduce_args(input, opts, "_reduce_scatter_base", in_place=False)
        return self._issue(
            "_reduce_scatter_base",
            lambda: [self._comm.reduce_scatter(src, op, out=output, async_op=True)],
            [output],
        )

    @_rejecting
    def reduce_scatter_single_coalesced(self, outputs: List[torch.Tensor], inputs: List[torch.Tensor],
                                        opts: Any) -> _Work:
        """``reduce_scatter_tensor_coalesced`` (FSDP): one reduce-scatter per pair."""
        args = [self._reduce_args(i, opts, "reduce_scatter_tensor_coalesced", in_place=False) for i in inputs]
        return self._issue(
            "reduce_scatter_tensor_coalesced",
            lambda: [self._comm.reduce_scatter(i, op, out=o, async_op=True) for o, (op, i) in zip(outputs, args)],
            outputs,
        )

    @_rejecting
    def barrier(self, opts: Any = None) -> _Work:
        """``dist.barrier``: completes once every rank has called it."""
        return self._issue("barrier", lambda: [self._comm.barrier(async_op=True)], [])

    # -- personalized exchanges and rooted calls --

    def _split_counts(self, t: torch.Tensor, splits: Sequence[int], what: str) -> List[int]:
        """The element count of each of ``t``'s blocks: torch's split sizes count rows (the
        first dimension); none given means ``world_size`` equal blocks of rows."""
        n = self.size()
        rows = t.shape[0] if t.dim() else 1
        row = int(t.shape[1:].numel()) if t.dim() else 1  # elements per row
        if not splits:
            if rows % n:
                raise ValueError(f"all_to_all_single: the {what}'s {rows} rows do not split into {n} equal blocks")
            return [rows // n * row] * n
        if len(splits) != n:
            raise ValueError(f"all_to_all_single: {len(splits)} {what} split sizes for a group of {n}")
        if any(s < 0 for s in splits) or sum(splits) != rows:
            raise ValueError(
                f"all_to_all_single: {what} split sizes {list(splits)} do not add up to the {what}'s {rows} rows"
            )
        return [int(s) * row for s in splits]

    @_rejecting
    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: List[int],
                          input_split_sizes: List[int], opts: Any) -> _Work:
        """``dist.all_to_all_single``: block j of ``input`` (rows, by ``input_split_sizes``,
        else equal) goes to rank j; block k of ``output`` comes from rank k. Without split
        sizes it is tutti's all_to_all, with them all_to_all_v (every rank must pass split
        sizes, or none: the two are different calls)."""
        if not output_split_sizes and not input_split_sizes:
            self._split_counts(input, (), "input")  # whole rows per block, as torch's backends ask
            self._split_counts(output, (), "output")
            call = lambda: [self._comm.all_to_all(input, out=output, async_op=True)]  # noqa: E731
        else:
            send = self._split_counts(input, input_split_sizes, "input")
            recv = self._split_counts(output, output_split_sizes, "output")
            call = lambda: [self._comm.all_to_all_v(input, send, recv, out=output, async_op=True)]  # noqa: E731
        return self._issue("all_to_all_single", call, [output])

    @_rejecting
    def alltoall(self, output_tensors: List[torch.Tensor], input_tensors: List[torch.Tensor], opts: Any) -> _Work:
        """``dist.all_to_all``: ``input_tensors[j]`` goes to rank j, ``output_tensors[k]``
        comes from rank k. Always tutti's all_to_all_v (the tensors may differ in size, and a
        rank cannot know whether the others' do), straight from and into the tensors where
        they lie back to back in one storage, else through staging tensors."""
        n = self.size()
        if len(input_tensors) != n or len(output_tensors) != n:
            raise ValueError(
                f"alltoall: {len(input_tensors)} input and {len(output_tensors)} output tensors for a group of {n}"
            )
        send = [t.numel() for t in input_tensors]
        recv = [t.numel() for t in output_tensors]
        flat_in = _flat_view(input_tensors, uneven=True)
        if flat_in is None:
            flat_in = torch.cat([t.reshape(-1) for t in input_tensors])
        staged: List[Callable[[], None]] = []
        flat_out = _flat_view(output_tensors, uneven=True)
        if flat_out is None:
            flat_out = torch.empty(sum(recv), dtype=flat_in.dtype, device=flat_in.device)
            staged.append(lambda: _copy_out(flat_out, output_tensors))
        return self._issue(
            "alltoall",
            lambda: [self._comm.all_to_all_v(flat_in, send, recv, out=flat_out, async_op=True)],
            output_tensors,
            lambda: [f() for f in staged],
        )

    @_rejecting
    def gather(self, output_tensors: List[List[torch.Tensor]], input_tensors: List[torch.Tensor],
               opts: Any) -> _Work:
        """``dist.gather``: at the root, list ``[r]`` becomes rank r's input; elsewhere nothing
        is written."""
        t = _one_tensor(input_tensors, "gather")
        root = opts.rootRank
        staged: List[Callable[[], None]] = []
        if self.rank() != root:
            return self._issue("gather", lambda: [self._comm.gather(t, root, async_op=True)], output_tensors)
        outputs = _one_list(output_tensors, "gather", "output")
        _same_sizes(outputs, t, "gather", "output", self.size())
        flat = _flat_view(outputs)
        if flat is None:
            flat = torch.empty(t.numel() * self.size(), dtype=t.dtype, device=t.device)
            staged.append(lambda: _copy_out(flat, outputs))
        return self._issue(
            "gather",
            lambda: [self._comm.gather(t, root, out=flat, async_op=True)],
            output_tensors,
            lambda: [f() for f in staged],
        )

    @_rejecting
    def scatter(self, output_tensors: List[torch.Tensor], input_tensors: List[List[torch.Tensor]],
                opts: Any) -> _Work:
        """``dist.scatter``: the output becomes the root's ``scatter_list[rank]``."""
        out = _one_tensor(output_tensors, "scatter")
        root = opts.rootRank
        if self.rank() != root:
            return self._issue("scatter", lambda: [self._comm.scatter(None, root, out=out, async_op=True)],
                               output_tensors)
        inputs = _one_list(input_tensors, "scatter", "input")
        _same_sizes(inputs, out, "scatter", "input", self.size())
        flat = _flat_view(inputs)
        if flat is None:
            flat = torch.cat([i.reshape(-1) for i in inputs])
        return self._issue("scatter", lambda: [self._comm.scatter(flat, root, out=out, async_op=True)],
                           output_tensors)

    # -- point-to-point --

    def _run_held(self) -> None:
        """Issue the held point-to-point operations as one group, without waiting for it;
        its outcome goes to their ``Work`` objects. Under a lock held while it is issued, so
        that a collective issued on another thread meanwhile comes after it."""
        with self._held_lock:
            batch = self._held
            if not batch.ops:
                return
            self._held = _PeerBatch()
            try:
                batch.work = self._comm.send_recv(batch.ops, async_op=True)
            except Exception as e:  # noqa: BLE001 - handed to the batch's Work objects
                batch.error = e
            batch.ran = True

    def _hold(self, kind: str, tensors: List[torch.Tensor], peer: int, tag: int) -> _PeerWork:
        """Check ``tensors`` for ``kind`` (send or recv) now, and hold the operation."""
        t = _one_tensor(tensors, kind)
        if tag != 0:
            raise ValueError(
                f"{kind}: tag {tag}: the tutti backend matches a rank's sends and receives in the "
                "order they are posted, not by tag; pass tag=0 (the default)"
            )
        if t.device.type != "cpu":
            raise TypeError(f"{kind}: the tensor is on {t.device}; the tutti backend takes CPU tensors")
        if not 0 <= peer < self.size():
            raise ValueError(f"{kind}: peer {peer} is out of range (group size {self.size()})")
        tutti._view(t, f"{kind}'s tensor", writable=kind == "recv")  # its errors now, not when run
        with self._held_lock:
            self._held.ops.append((kind, t, peer))
            return _PeerWork(self, self._held, tensors)

    def send(self, tensors: List[torch.Tensor], dstRank: int, tag: int) -> _PeerWork:  # noqa: N803
        """``dist.send`` / ``dist.isend``: the tensor to rank ``dstRank``, held until the
        ``Work`` is waited on (see the module's docstring). ``tag`` must be 0."""
        return self._hold("send", tensors, dstRank, tag)

    def recv(self, tensors: List[torch.Tensor], srcRank: int, tag: int) -> _PeerWork:  # noqa: N803
        """``dist.recv`` / ``dist.irecv``: rank ``srcRank``'s next send into the tensor, held
        until the ``Work`` is waited on. ``tag`` must be 0."""
        return self._hold("recv", tensors, srcRank, tag)

    def recv_anysource(self, tensors: List[torch.Tensor], tag: int) -> _PeerWork:
        """Refused: tutti pairs a receive with the sender it names."""
        raise NotImplementedError(
            "recv without src: the tutti backend pairs each receive with the rank it names (a "
            "rank's sends to another match that rank's receives from it in order), so it has no "
            "receive from any source; pass src="
        )

    # -- the names torch calls where the backend is the whole process group (before 2.14) --

    if _Base is dist.ProcessGroup:
        _allgather_base = all_gather_single
        _reduce_scatter_base = reduce_scatter_single
        alltoall_base = all_to_all_single

        def allgather_into_tensor_coalesced(self, outputs: List[torch.Tensor], inputs: List[torch.Tensor],
                                            opts: Any = None) -> _Work:
            """``dist.all_gather_into_tensor`` in a coalescing block (torch passes no options)."""
            return self.all_gather_single_coalesced(outputs, inputs, opts)

        reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

        # A process group keeps its name and description in its backends, which this one has
        # none of: it keeps them itself.
        def setGroupName(self, name: str) -> None:  # noqa: N802 - torch's name
            """Set by torch when it makes the group."""
            self._group_name = name

        def getGroupName(self) -> str:  # noqa: N802 - torch's name
            """The name torch gave the group (FSDP and functional collectives read it)."""
            return getattr(self, "_group_name", "")

        def setGroupDesc(self, desc: str) -> None:  # noqa: N802 - torch's name
            """Set by torch when it makes the group."""
            self._group_desc = desc

        def getGroupDesc(self) -> str:  # noqa: N802 - torch's name
            """The description torch gave the group."""
            return getattr(self, "_group_desc", "")


def _one_list(lists: Sequence[List[torch.Tensor]], what: str, side: str) -> List[torch.Tensor]:
    if len(lists) != 1:
        raise ValueError(f"{what}: tutti takes one {side} list at the root, not {len(lists)}")
    return lists[0]


def _same_sizes(tensors: Sequence[torch.Tensor], like: torch.Tensor, what: str, side: str, n: int) -> None:
    """``n`` tensors of ``like``'s element count and dtype, or an error naming the first that is not."""
    if len(tensors) != n:
        raise ValueError(f"{what}: {len(tensors)} {side} tensors for a group of {n}")
    for i, t in enumerate(tensors):
        if t.numel() != like.numel() or t.dtype != like.dtype:
            raise ValueError(
                f"{what}: {side} {i} is {t.dtype} of {t.numel()} elements, the call's tensor "
                f"{like.dtype} of {like.numel()}; every {side} must match it"
            )


def _copy_out(flat: torch.Tensor, outputs: Sequence[torch.Tensor]) -> None:
    """Copy ``flat`` into ``outputs``, each taking as many elements as it holds, in order."""
    at = 0
    for o in outputs:
        k = o.numel()
        o.copy_(flat[at:at + k].view_as(o))
        at += k


def _create(store: dist.Store, rank: int, size: int, timeout: datetime.timedelta) -> TuttiBackend:
    return TuttiBackend(store, rank, size, timeout)


if BACKEND_NAME.upper() not in dist.Backend._plugins:
    dist.Backend.register_backend(BACKEND_NAME, _create, devices=["cpu"])
