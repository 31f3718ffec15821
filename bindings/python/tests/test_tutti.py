"""The Python bindings: collectives over numpy arrays through libtutti, values checked."""

import concurrent.futures
import ctypes
import os
import pathlib
import re
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import tutti

REPO = pathlib.Path(__file__).resolve().parents[3]

DTYPES = [np.float32, np.float64, np.float16, np.int8, np.uint8, np.int32, np.uint32, np.int64, np.uint64]
ALGORITHMS = ["auto", "direct", "ring", "hierarchical-copy", "hierarchical-copy:4", "reduce-to-one", "reduce-to-one:2"]


def test_version_matches_the_header():
    header = (REPO / "include" / "tutti.h").read_text()
    want = re.search(r'#define TUTTI_VERSION_STRING "([^"]+)"', header).group(1)
    assert tutti.version() == want


def test_devices_start_with_the_host_cpu():
    devs = tutti.devices()
    assert devs[0].kind == "cpu" and devs[0].spec == "cpu:0" and devs[0].name


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["sum", "prod", "min", "max", "mean"])
def test_all_reduce_every_dtype_and_op(dtype, op):
    n = 4
    arrays = [((np.arange(1001) % 5 + 1) * (r + 1)).astype(dtype) for r in range(n)]
    if np.issubdtype(dtype, np.integer):
        # Integers wrap in their own type; MEAN divides the wrapped sum, truncating.
        ufunc = {"sum": np.add, "mean": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}[op]
        acc = arrays[0].copy()
        for a in arrays[1:]:
            acc = ufunc(acc, a)
        want = acc.astype(np.float64)
        if op == "mean":
            want = np.trunc(want / n)
    else:
        wide = [a.astype(np.float64) for a in arrays]
        want = {
            "sum": sum(wide),
            "prod": np.prod(wide, axis=0),
            "min": np.min(wide, axis=0),
            "max": np.max(wide, axis=0),
            "mean": sum(wide) / n,
        }[op]
    out = tutti.all_reduce(arrays, op=op, timeout=60)
    for a in out:
        np.testing.assert_allclose(a.astype(np.float64), want, rtol=1e-3)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_all_reduce_every_algorithm(algorithm):
    grads = [np.full((3, 257), r, dtype=np.float32) for r in range(4)]
    with tutti.Replicas(4, timeout=60, algorithm=algorithm) as r:
        r.all_reduce(grads, op="mean")
        r.all_reduce(grads, op="sum")
    for g in grads:
        assert g.shape == (3, 257)
        np.testing.assert_array_equal(g, np.full((3, 257), 6.0, dtype=np.float32))


def test_broadcast():
    arrays = [np.full(10, r, dtype=np.int64) for r in range(3)]
    tutti.broadcast(arrays, root=2)
    for a in arrays:
        np.testing.assert_array_equal(a, np.full(10, 2))


def test_all_gather_concatenates_along_the_first_axis():
    arrays = [np.full((2, 3), r, dtype=np.float64) for r in range(4)]
    outs = tutti.all_gather(arrays)
    assert len(outs) == 4
    want = np.concatenate(arrays)
    for o in outs:
        assert o.shape == (8, 3)
        np.testing.assert_array_equal(o, want)


def test_reduce_and_reduce_scatter():
    arrays = [np.arange(8, dtype=np.int32) * (r + 1) for r in range(4)]
    np.testing.assert_array_equal(tutti.reduce(arrays, op="max"), np.arange(8) * 4)
    slices = tutti.reduce_scatter(arrays, op="sum")
    total = np.arange(8) * 10
    for i, s in enumerate(slices):
        np.testing.assert_array_equal(s, total[2 * i : 2 * i + 2])


def test_replicas_reuse_and_abort():
    with tutti.Replicas(2, timeout=60) as r:
        a = [np.ones(4, dtype=np.float32), np.ones(4, dtype=np.float32)]
        for _ in range(10):
            r.all_reduce(a)
        assert a[0][0] == 2.0**10
        r.abort("done early")
        with pytest.raises(tutti.TuttiError) as e:
            r.all_reduce(a)
        assert e.value.code == "TUTTI_ERROR_ABORTED" and "done early" in e.value.message


def test_errors_say_what_was_wrong():
    with pytest.raises(ValueError, match="every replica's array must match"):
        tutti.all_reduce([np.zeros(3, np.float32), np.zeros(4, np.float32)])
    with pytest.raises(TypeError, match="complex64"):
        tutti.all_reduce([np.zeros(3, np.complex64)] * 2)
    with pytest.raises(ValueError, match="not C-contiguous"):
        tutti.all_reduce([np.zeros((4, 4), np.float32)[:, 1], np.zeros(4, np.float32)])
    with pytest.raises(ValueError, match="read-only"):
        ro = np.zeros(3, np.float32)
        ro.flags.writeable = False
        tutti.all_reduce([ro, np.zeros(3, np.float32)])
    with pytest.raises(ValueError, match="unknown op"):
        tutti.all_reduce([np.zeros(3, np.float32)] * 2, op="median")
    with pytest.raises(ValueError, match="unknown algorithm"):
        tutti.Replicas(2, algorithm="tree")
    # Numbers too large for the C fields are refused, not wrapped (reduce-to-one:4294967297
    # was root 1, a timeout of 2**64 ms was the default).
    with pytest.raises(ValueError, match="4294967297 is out of range"):
        tutti.Replicas(2, algorithm="reduce-to-one:4294967297")
    with pytest.raises(ValueError, match="longer than tutti allows"):
        tutti.Replicas(2, timeout=2**64 / 1000)
    with pytest.raises(ValueError, match="longer than tutti allows"):
        tutti.Replicas(2, timeout=float("inf"))
    with pytest.raises(tutti.TuttiError, match="longer"):
        tutti.Replicas(2, timeout=365 * 86400)
    # The C library's own checks come back as TuttiError with its message.
    with tutti.Replicas(3) as r:
        with pytest.raises(tutti.TuttiError) as e:
            r.all_reduce([np.zeros(3, np.float32), np.zeros(3, np.float32)])
        assert e.value.code == "TUTTI_ERROR_INVALID_ARGUMENT"
        assert "num_buffers is 2 but there are 3 replicas" in e.value.message
        with pytest.raises(tutti.TuttiError, match="root 5 is out of range"):
            r.broadcast([np.zeros(3, np.float32) for _ in range(3)], root=5)
    with pytest.raises(tutti.TuttiError, match="at least one rank"):
        tutti.Replicas(0)
    with pytest.raises(tutti.TuttiError, match="root 7 is out of range"):
        tutti.Replicas(2, algorithm="reduce-to-one:7")
    # Arguments are named as the arguments they are, not as environment variables.
    with pytest.raises(tutti.TuttiError, match="rank 3 is out of range for world_size 2"):
        tutti.join(3, 2, "127.0.0.1:1")
    # A rank that cannot reach the rendezvous in time gets a timeout, not an argument error.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(tutti.TuttiError) as e:
        tutti.join(1, 2, f"127.0.0.1:{port}", timeout=1)
    assert e.value.code == "TUTTI_ERROR_TIMEOUT" and "not reachable within" in e.value.message


def run_ranks(comms, fn):
    errors = []

    def body(c):
        try:
            fn(c)
        except BaseException as e:  # reported below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=body, args=(c,)) for c in comms]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]


def test_a_rank_that_rejects_its_own_arguments_does_not_leave_the_others_waiting():
    # A long timeout: the peer must fail because the group was aborted, not by waiting.
    comms = tutti.local_group(2, timeout=120)
    seen = {}

    def rank(c):
        started = time.monotonic()
        if c.rank == 1:
            with pytest.raises(ValueError, match="out must match") as e:
                c.all_reduce(np.ones(4, np.float32), out=np.ones(3, np.float32))
            assert "the group is aborted" in str(e.value)
        else:
            with pytest.raises(tutti.TuttiError) as e:
                c.all_reduce(np.ones(4, np.float32))
            assert e.value.code == "TUTTI_ERROR_ABORTED", e.value
            assert "rank 1 rejected its arguments to all_reduce" in e.value.message
        seen[c.rank] = time.monotonic() - started

    run_ranks(comms, rank)
    assert max(seen.values()) < 30, seen
    for c in comms:
        c.close()
    # A negative root is refused as it is, not wrapped into a huge one.
    with tutti.Replicas(2) as r, pytest.raises(ValueError, match="root -1 is out of range"):
        r.broadcast([np.zeros(3, np.float32)] * 2, root=-1)


def test_a_communicator_per_thread():
    comms = tutti.local_group(4, timeout=60, algorithm="ring")
    assert [c.rank for c in comms] == [0, 1, 2, 3] and comms[0].world_size == 4
    results = {}

    def rank(c):
        x = np.full(100, c.rank + 1, dtype=np.float32)
        c.all_reduce(x, op="mean")
        g = c.all_gather(np.array([c.rank], dtype=np.int64))
        b = c.broadcast(np.full(3, c.rank, dtype=np.uint8), root=3)
        s = c.reduce_scatter(np.ones(8, dtype=np.int32))
        r = c.reduce(np.ones(2, dtype=np.float64), op="sum", root=1)
        c.barrier()
        results[c.rank] = (x[0], list(g), list(b), list(s), r)

    run_ranks(comms, rank)
    for r in range(4):
        x, g, b, s, red = results[r]
        assert x == 2.5 and g == [0, 1, 2, 3] and b == [3, 3, 3] and s == [4, 4]
        assert (red is not None) == (r == 1)
    np.testing.assert_array_equal(results[1][4], [4.0, 4.0])

    # Ranks that disagree all get a mismatch naming the field.
    def mismatch(c):
        with pytest.raises(tutti.TuttiError) as e:
            c.all_reduce(np.zeros(10 + c.rank, dtype=np.float32))
        assert e.value.code == "TUTTI_ERROR_MISMATCH" and "count" in e.value.message

    run_ranks(comms, mismatch)
    for c in comms:
        c.close()


def test_non_blocking_calls_return_work_handles():
    comms = tutti.local_group(2, timeout=60)
    results = {}

    def rank(c):
        # Every collective in flight at once, waited newest first.
        works = [c.all_reduce(np.full(1000, k + c.rank, dtype=np.float32), async_op=True) for k in range(8)]
        works.append(c.broadcast(np.full(3, c.rank, dtype=np.int32), root=1, async_op=True))
        works.append(c.all_gather(np.array([c.rank, c.rank], dtype=np.int64), async_op=True))
        works.append(c.reduce_scatter(np.arange(4, dtype=np.float64), async_op=True))
        works.append(c.reduce(np.ones(2, dtype=np.int32), root=0, async_op=True))
        works.append(c.barrier(async_op=True))
        results[c.rank] = [w.wait() for w in reversed(works)][::-1]
        assert all(w.is_completed() for w in works)

    run_ranks(comms, rank)
    for r in range(2):
        got = results[r]
        for k in range(8):
            np.testing.assert_array_equal(got[k], np.full(1000, 2 * k + 1, dtype=np.float32))
        assert list(got[8]) == [1, 1, 1] and list(got[9]) == [0, 0, 1, 1]
        assert list(got[10]) == ([0.0, 2.0] if r == 0 else [4.0, 6.0])
        assert (got[11] is not None) == (r == 0) and got[12] is None
    np.testing.assert_array_equal(results[0][11], [2, 2])

    # A bounded wait times out while the peer is away; the call completes afterwards.
    a, b = comms
    w = a.all_reduce(np.ones(4), async_op=True)
    with pytest.raises(tutti.TuttiError) as e:
        w.wait(timeout=0.02)
    assert e.value.code == "TUTTI_ERROR_WAIT_TIMEOUT" and not w.is_completed()
    b.all_reduce(np.ones(4))
    np.testing.assert_array_equal(w.wait(), [2.0] * 4)
    with pytest.raises(ValueError):
        w.wait(timeout=0)
    for c in comms:
        c.close()


def test_zero_length_arrays_of_every_width():
    # count 0 with whatever address numpy gives an empty array (issue 12, item 5).
    comms = tutti.local_group(2, timeout=60)
    out = {}

    def rank(c):
        got = []
        for dtype in (np.float32, np.float64, np.int64, np.uint8):
            e = np.empty(0, dtype=dtype)
            got.append(c.all_reduce(e).size)
            got.append(c.broadcast(np.empty(0, dtype=dtype), root=1).size)
            got.append(c.all_gather(e).size)
            got.append(c.reduce_scatter(e).size)
            r = c.reduce(e, root=0)
            got.append(None if r is None else r.size)
        out[c.rank] = got

    run_ranks(comms, rank)
    assert out[0] == [0, 0, 0, 0, 0] * 4
    assert out[1] == [0, 0, 0, 0, None] * 4
    for c in comms:
        c.close()


def test_device_groups():
    comms = tutti.device_group(["cpu:0", "cpu:1"], timeout=60)
    out = {}

    def rank(c):
        out[c.rank] = c.all_reduce(np.full(5, c.rank + 1.0), async_op=True).wait()

    run_ranks(comms, rank)
    np.testing.assert_array_equal(out[0], [3.0] * 5)
    with pytest.raises(tutti.TuttiError) as e:
        comms[1].set_cuda_stream(0)
    assert e.value.code == "TUTTI_ERROR_INVALID_ARGUMENT" and "rank 1 is on cpu:1" in e.value.message
    comms[1].set_cuda_stream(None)
    with pytest.raises(tutti.TuttiError) as e:
        tutti.device_group(["cpu:0", "cpu:0"])
    assert e.value.code == "TUTTI_ERROR_INVALID_ARGUMENT" and "listed twice" in e.value.message
    try:
        xla = tutti.local_group(2, device="xla")
    except tutti.TuttiError as e:
        # A build without XLA, or no PJRT plugin: a clean "not available".
        assert e.code == "TUTTI_ERROR_UNAVAILABLE" and "XLA" in e.message
    else:
        run_ranks(xla, rank)
        np.testing.assert_array_equal(out[1], [3.0] * 5)


def test_xla_device_groups_split_and_send():
    """On XLA devices (a libtutti built with xla, a PJRT plugin): a group splits into groups over
    its members' devices, each running its calls there, and ranks send and receive."""
    try:
        comms = tutti.device_group(["xla:0", "xla:1", "xla:2", "xla:3"], timeout=60)
    except tutti.TuttiError as e:
        if os.environ.get("TUTTI_REQUIRE_XLA") == "1":
            raise
        assert e.code == "TUTTI_ERROR_UNAVAILABLE" and "XLA" in e.message
        pytest.skip(f"no XLA devices: {e.message}")
    out = {}

    def rank(c):
        half = c.split(c.rank % 2, key=-c.rank)
        s = half.all_reduce(np.full(3, float(c.rank)))
        got = np.zeros(2, np.int32)
        other = 1 - half.rank
        half.send_recv([("send", np.full(2, c.rank, np.int32), other), ("recv", got, other)])
        none = c.split(None if c.rank == 0 else 5)
        if none is not None:
            none.close()
        half.close()
        out[c.rank] = (half.rank, s.tolist(), got.tolist(), none is None)

    run_ranks(comms, rank)
    assert out == {
        0: (1, [2.0] * 3, [2, 2], True),
        1: (1, [4.0] * 3, [3, 3], False),
        2: (0, [2.0] * 3, [0, 0], False),
        3: (0, [4.0] * 3, [1, 1], False),
    }


def test_abort_wakes_a_blocked_rank_and_timeouts_fire():
    a, b = tutti.local_group(2, timeout=120)
    caught = []

    def blocked():
        try:
            a.all_reduce(np.zeros(4, dtype=np.float32))
        except tutti.TuttiError as e:
            caught.append(e)

    t = threading.Thread(target=blocked)
    t.start()
    time.sleep(0.1)
    b.abort("stop")
    t.join(30)
    assert not t.is_alive() and caught[0].code == "TUTTI_ERROR_ABORTED"

    c, _d = tutti.local_group(2, timeout=0.2)
    start = time.monotonic()
    with pytest.raises(tutti.TuttiError) as e:
        c.barrier()
    assert e.value.code == "TUTTI_ERROR_TIMEOUT" and "rank 1" in e.value.message
    assert time.monotonic() - start < 30


RANK_SCRIPT = """
import sys
import numpy as np
import tutti
rank, world, addr, transport = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
comm = tutti.join(rank, world, addr, timeout=60, transport=transport)
x = np.arange(6, dtype=np.float64) * (rank + 1)
comm.all_reduce(x, op="sum")
g = comm.all_gather(np.array([rank * 10], dtype=np.int32))
print("result", x.tolist(), g.tolist())
if transport == "shm":
    # Shared arrays of 512 KiB: the all-reduces run through the mappings (even with more ranks
    # than cores).
    a = comm.shared_array((512, 256), dtype=np.float32)
    out = comm.shared_array((512, 256), dtype=np.float32)
    a[:] = rank + 1
    comm.all_reduce(a, op="sum", out=out)
    w = comm.all_reduce(a, op="max", async_op=True).wait()
    print("shared", float(out[0, 0]), float(out[-1, -1]), float(w[3, 3]), float(a.sum()))
    try:
        comm.close()
    except ValueError as e:
        print("close refused:", "still alive" in str(e))
    del a, out, w
    comm.close()
else:
    try:
        comm.shared_array(16)
    except tutti.TuttiError as e:
        print("shared refused:", "shared memory of this host" in e.message)
"""


def _three_ranks(script, transport):
    """``script`` run as ranks 0..2 of a job meeting on a free loopback port: the processes
    and their (stdout, stderr)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=str(pathlib.Path(tutti.__file__).resolve().parents[1]))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(r), "3", f"127.0.0.1:{port}", transport],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for r in range(3)
    ]
    return procs, [p.communicate(timeout=120) for p in procs]


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_separate_processes_join_one_job(transport):
    procs, outs = _three_ranks(RANK_SCRIPT, transport)
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
        assert "result [0.0, 6.0, 12.0, 18.0, 24.0, 30.0] [0, 10, 20]" in out, out
        if transport == "shm":
            assert "shared 6.0 6.0 3.0 393216.0" in out and "close refused: True" in out, out
        else:
            assert "shared refused: True" in out, out


SHRINK_SCRIPT = r"""
import os, signal, sys
import numpy as np
import tutti
rank, world, master, transport = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
comm = tutti.join(rank, world, master, timeout=30, transport=transport)
comm.barrier()
if rank == 2:
    os.kill(os.getpid(), signal.SIGKILL)
try:
    while True:
        comm.all_reduce(np.ones(1 << 16, dtype=np.float32))
except tutti.TuttiError as e:
    print("lost:", e.code)
new = comm.shrink()
print("shrank", new.rank, new.world_size, float(new.all_reduce(np.array([new.rank + 1.0]))[0]))
new.close()
comm.close()
"""


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_survivors_of_a_killed_process_shrink(transport, monkeypatch):
    # Each rank's log of the shrink (whom it found alive, gone and silent) goes with a failure.
    monkeypatch.setenv("TUTTI_LOG", "info")
    procs, outs = _three_ranks(SHRINK_SCRIPT, transport)
    logs = "\n".join(f"rank {r}:\n{err}" for r, (_, err) in enumerate(outs))
    assert procs[2].returncode == -9
    for r, (p, (out, err)) in enumerate(zip(procs[:2], outs)):
        assert p.returncode == 0, logs
        assert "lost: TUTTI_ERROR_" in out, out
        assert f"shrank {r} 2 3.0" in out, out


def test_joining_without_a_cluster_says_what_to_set(monkeypatch):
    for v in ["TUTTI_RANK", "TF_CONFIG", "RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"]:
        monkeypatch.delenv(v, raising=False)
    with pytest.raises(tutti.TuttiError, match="no cluster in the environment"):
        tutti.from_env()
    with pytest.raises(tutti.TuttiError, match="port 0"):
        tutti.join(0, 2, "127.0.0.1:0")
    with pytest.raises(ValueError, match="unknown transport"):
        tutti.join(0, 2, "127.0.0.1:1", transport="udp")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_from_env_joins_where_tutti_device_says(monkeypatch):
    """TUTTI_DEVICE places the rank (cuda: a GPU rank), or is an error naming it: never a
    rank on host memory labelled as another device."""
    for v in ["TF_CONFIG", "RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"]:
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv("TUTTI_RANK", "0")
    monkeypatch.setenv("TUTTI_WORLD_SIZE", "1")
    for device, error in [("bogus", "TUTTI_DEVICE=bogus"), ("cuda:x", "TUTTI_DEVICE=cuda:x"),
                          ("xla:0", "XLA devices form groups within one process")]:
        monkeypatch.setenv("TUTTI_MASTER_ADDR", f"127.0.0.1:{_free_port()}")
        monkeypatch.setenv("TUTTI_DEVICE", device)
        with pytest.raises(tutti.TuttiError, match=error):
            tutti.from_env(timeout=10)
    for device in ["cpu", "CPU:0"]:
        monkeypatch.setenv("TUTTI_DEVICE", device)
        monkeypatch.setenv("TUTTI_MASTER_ADDR", f"127.0.0.1:{_free_port()}")
        with tutti.from_env(timeout=10) as c:
            assert c.device == "cpu"
            assert c.all_reduce(np.ones(3, np.float32)).tolist() == [1.0] * 3
    if not any(d.kind == "gpu" for d in tutti.devices()):
        # A build without CUDA, or no GPU: unavailable, saying so.
        monkeypatch.setenv("TUTTI_DEVICE", "cuda:0")
        monkeypatch.setenv("TUTTI_MASTER_ADDR", f"127.0.0.1:{_free_port()}")
        with pytest.raises(tutti.TuttiError) as e:
            tutti.from_env(timeout=10)
        assert e.value.code == "TUTTI_ERROR_UNAVAILABLE", e.value


def test_a_watchdog_aborts_and_closes_while_ranks_are_inside_calls():
    """Close from another thread while calls are inside: they are waited for (the abort makes
    them leave at once), later calls raise a clear error, and closing twice (or from two
    threads at once) is harmless."""
    for _ in range(20):
        comms = tutti.local_group(2, timeout=60)
        errors, started = [], threading.Barrier(3)

        def rank(c):
            started.wait()
            x = np.ones(1 << 12, dtype=np.float32)
            try:
                while True:
                    c.all_reduce(x)
                    c.all_reduce(x, async_op=True).wait()
            except (tutti.TuttiError, ValueError) as e:
                errors.append(e)

        threads = [threading.Thread(target=rank, args=(c,)) for c in comms]
        for t in threads:
            t.start()
        started.wait()
        time.sleep(0.01)
        comms[0].abort("watchdog")
        closers = [threading.Thread(target=c.close) for c in comms for _ in range(2)]
        for t in closers:
            t.start()
        for t in closers + threads:
            t.join(60)
            assert not t.is_alive()
        assert len(errors) == 2
        for e in errors:
            assert (isinstance(e, tutti.TuttiError) and e.code == "TUTTI_ERROR_ABORTED") or (
                "closed" in str(e)
            ), e
        for c in comms:
            c.close()
            with pytest.raises(ValueError, match="communicator is closed"):
                c.all_reduce(np.ones(4, dtype=np.float32))


def test_replicas_closed_by_a_watchdog_during_a_call():
    for _ in range(10):
        r = tutti.Replicas(2, timeout=60)
        a = [np.ones(1 << 12, dtype=np.float32) for _ in range(2)]
        caught = []

        def loop():
            try:
                while True:
                    r.all_reduce(a)
            except (tutti.TuttiError, ValueError) as e:
                caught.append(e)

        t = threading.Thread(target=loop)
        t.start()
        time.sleep(0.01)
        r.abort("watchdog")
        both = [threading.Thread(target=r.close) for _ in range(2)]
        for c in both:
            c.start()
        for c in both + [t]:
            c.join(60)
            assert not c.is_alive()
        assert caught
        r.close()
        with pytest.raises(ValueError, match="replicas is closed"):
            r.all_reduce(a)


def test_the_package_version_is_the_librarys():
    assert tutti.__version__ == tutti.version()


class _DictStore:
    """A store in this process's memory, for ranks on threads."""

    def __init__(self):
        self.values = {}
        self.cv = threading.Condition()
        self.fail_set = False

    def set(self, key, value):
        if self.fail_set:
            raise OSError("the store is gone")
        with self.cv:
            self.values[key] = bytes(value)
            self.cv.notify_all()

    def get(self, key, timeout_s):
        with self.cv:
            if not self.cv.wait_for(lambda: key in self.values, timeout_s):
                raise TimeoutError(key)
            return self.values[key]

    def add(self, key, delta):
        with self.cv:
            v = int(self.values.get(key, b"0")) + delta
            self.values[key] = str(v).encode()
            self.cv.notify_all()
            return v


def test_ranks_meet_through_the_callers_store():
    store = _DictStore()
    token = "0123456789abcdef0123"
    comms = [None] * 3

    def rank(r):
        comms[r] = tutti.from_store(r, 3, store, token, timeout=30)
        x = np.full(5, r + 1, np.float32)
        comms[r].all_reduce(x)
        return x

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        out = list(pool.map(rank, range(3)))
    for x in out:
        assert x.tolist() == [6.0] * 5
    for c in comms:
        c.close()


def test_compression_carries_f32_over_tcp_as_bf16():
    """compression="bf16": an f32 all-reduce between processes over TCP travels as bfloat16 and
    sums in f32: every rank ends with the same values, each one a bfloat16, close to the sum;
    an unknown name is refused."""
    store = _DictStore()
    token = "0123456789abcdef0123"
    rng = np.random.default_rng(3)
    xs = [rng.uniform(-1, 1, 70001).astype(np.float32) for _ in range(3)]
    comms = [None] * 3

    def rank(r):
        comms[r] = tutti.from_store(r, 3, store, token, timeout=30, transport="tcp",
                                    algorithm="ring", compression="bf16")
        return comms[r].all_reduce(xs[r].copy())

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        out = list(pool.map(rank, range(3)))
    for c in comms:
        c.close()
    exact = sum(x.astype(np.float64) for x in xs)
    magnitude = sum(np.abs(x.astype(np.float64)) for x in xs)
    for got in out:
        assert got.tobytes() == out[0].tobytes()
        # A bfloat16 is an f32 whose low 16 bits are zero.
        assert not (got.view(np.uint32) & 0xFFFF).any()
        assert (np.abs(got - exact) <= magnitude * 2.0 ** -8 * 4).all()
    with pytest.raises(ValueError, match="unknown compression 'int8'"):
        tutti.join(0, 1, "127.0.0.1:1", compression="int8")


def test_a_store_that_fails_is_named_with_its_error():
    store = _DictStore()
    store.fail_set = True
    with pytest.raises(tutti.TuttiError, match="store callback 'set' failed") as e:
        tutti.from_store(0, 1, store, "0123456789abcdef0123", timeout=5)
    assert isinstance(e.value.__cause__, OSError)
    with pytest.raises(tutti.TuttiError, match="16"):
        tutti.from_store(0, 1, _DictStore(), "short", timeout=5)


def test_every_public_name_has_a_docstring_and_a_type_hint():
    import ast
    import inspect

    stub = ast.parse((pathlib.Path(tutti.__file__).with_name("__init__.pyi")).read_text())
    hinted = {n.name for n in stub.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    hinted |= {t.id for n in stub.body if isinstance(n, ast.AnnAssign) for t in [n.target]}
    for name in tutti.__all__:
        obj = getattr(tutti, name)
        assert name in hinted, f"{name} has no type hint in __init__.pyi"
        if inspect.isfunction(obj) or inspect.isclass(obj):
            assert obj.__doc__, f"{name} has no docstring"
        if inspect.isclass(obj):
            for m, f in vars(obj).items():
                if not m.startswith("_") and callable(f):
                    assert f.__doc__, f"{name}.{m} has no docstring"


def test_groups_close_as_context_managers():
    with tutti.local_group(2) as g:
        assert isinstance(g, list) and len(g) == 2
    for c in g:
        with pytest.raises(ValueError):
            c.barrier()


# ----- all_to_all(_v), gather, scatter, all_gather_v, reduce_scatter_v -----


def _of_kind(kind, a):
    """``a`` (a numpy array) as a numpy array or a torch tensor."""
    if kind == "torch":
        return pytest.importorskip("torch").from_numpy(a)
    return a


def _numpy(x):
    assert type(x).__module__.split(".")[0] in ("numpy", "torch"), type(x)
    return x.numpy() if hasattr(x, "numpy") and not isinstance(x, np.ndarray) else x


def _element(src, dst, i):
    """Element ``i`` of what rank ``src`` sends rank ``dst``: every value says where it came from."""
    return 1000 * src + 10 * dst + i


def _block(src, dst, n):
    return [_element(src, dst, i) for i in range(n)]


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_personalized_rooted_and_uneven_collectives(world, kind):
    comms = tutti.local_group(world, timeout=60)
    # Uneven counts with zeros: rank i sends rank j (i + 2j) % 3 elements.
    pair = [[(i + 2 * j) % 3 for j in range(world)] for i in range(world)]
    counts = [r % 3 for r in range(world)]  # rank 0's is 0, as is every third one's
    total = sum(counts)

    def rank(c):
        r, n = c.rank, world
        kind_of = (lambda x: type(x)) if kind == "numpy" else (lambda x: type(x).__module__)
        want_type = kind_of(_of_kind(kind, np.zeros(1)))
        # all_to_all: 3 elements a block (and 0), blocking, non-blocking and into out.
        send = np.array([_element(r, j, i) for j in range(n) for i in range(3)], dtype=np.int64)
        want = [_element(k, r, i) for k in range(n) for i in range(3)]
        got = c.all_to_all(_of_kind(kind, send))
        assert kind_of(got) == want_type and list(_numpy(got)) == want
        out = _of_kind(kind, np.zeros(3 * n, np.int64))
        assert c.all_to_all(_of_kind(kind, send), out=out, async_op=True).wait() is out
        assert list(_numpy(out)) == want
        assert _numpy(c.all_to_all(_of_kind(kind, np.zeros(0, np.float32)))).size == 0
        # The output has the input's shape: here one row (a block) per rank.
        got = c.all_to_all(_of_kind(kind, send.astype(np.float32).reshape(n, 3)))
        assert tuple(got.shape) == (n, 3) and list(_numpy(got).ravel()) == want
        # all_to_all_v: the blocks as long as `pair` says, zeros included.
        send = np.array([v for j in range(n) for v in _block(r, j, pair[r][j])], dtype=np.int32)
        recv_counts = [pair[k][r] for k in range(n)]
        want = [v for k in range(n) for v in _block(k, r, pair[k][r])]
        got = c.all_to_all_v(_of_kind(kind, send), pair[r], recv_counts)
        assert kind_of(got) == want_type and list(_numpy(got)) == want
        out = _of_kind(kind, np.full(sum(recv_counts), -1, np.int32))
        w = c.all_to_all_v(_of_kind(kind, send), np.array(pair[r]), tuple(recv_counts), out=out, async_op=True)
        assert w.wait() is out and list(_numpy(out)) == want
        # gather and scatter onto and from every root, the roots' outputs new or given.
        mine = np.array([[_element(r, 0, 0), _element(r, 0, 1)]], dtype=np.float64)  # shape (1, 2)
        for root in range(n):
            got = c.gather(_of_kind(kind, mine), root=root)
            if r == root:
                assert tuple(got.shape) == (n, 2)
                assert _numpy(got).ravel().tolist() == [v for k in range(n) for v in _block(k, 0, 2)]
            else:
                assert got is None
            out = _of_kind(kind, np.zeros(2 * n, np.float64))
            got = c.gather(_of_kind(kind, mine), root=root, out=out, async_op=True).wait()
            assert (got is out) == (r == root) and (got is None) == (r != root)
            assert _numpy(out).tolist() == ([v for k in range(n) for v in _block(k, 0, 2)] if r == root else [0] * 2 * n)
        for root in range(n):
            whole = np.array([v for k in range(n) for v in _block(root, k, 2)], dtype=np.uint32)
            if r == root:
                got = c.scatter(_of_kind(kind, whole.reshape(n, 2)), root=root)
                assert tuple(got.shape) == (1, 2)
            elif (r + root) % 2:
                got = c.scatter(None, root=root, out=_of_kind(kind, np.zeros(2, np.uint32)))
            else:
                # count=, the dtype and kind from an array that is not read off the root.
                got = c.scatter(_of_kind(kind, np.zeros(0, np.uint32)), root=root, count=2)
                assert tuple(got.shape) == (2,)
            assert kind_of(got) == want_type and _numpy(got).ravel().tolist() == _block(root, r, 2)
            out = _of_kind(kind, np.zeros(2, np.uint32))
            src = _of_kind(kind, whole) if r == root else None
            assert c.scatter(src, root, out=out, async_op=True).wait() is out
            assert _numpy(out).tolist() == _block(root, r, 2)
        # all_gather_v: rank k contributes counts[k] elements, zeros included.
        got = c.all_gather_v(_of_kind(kind, np.array(_block(r, 0, counts[r]), np.int64)), counts)
        assert kind_of(got) == want_type
        assert _numpy(got).tolist() == [v for k in range(n) for v in _block(k, 0, counts[k])]
        out = _of_kind(kind, np.zeros(total, np.int64))
        assert c.all_gather_v(_of_kind(kind, np.array(_block(r, 0, counts[r]), np.int64)), counts, out=out,
                              async_op=True).wait() is out
        assert _numpy(out).tolist() == [v for k in range(n) for v in _block(k, 0, counts[k])]
        # reduce_scatter_v: rank k's input is (k + 1) × 0..total; rank r keeps its counts[r].
        start = sum(counts[:r])
        scale = n * (n + 1) // 2
        got = c.reduce_scatter_v(_of_kind(kind, np.arange(total, dtype=np.float32) * (r + 1)), counts)
        assert kind_of(got) == want_type
        assert _numpy(got).tolist() == [scale * float(i) for i in range(start, start + counts[r])]
        out = _of_kind(kind, np.zeros(counts[r], np.int32))
        w = c.reduce_scatter_v(_of_kind(kind, np.arange(total, dtype=np.int32) + r), counts, op="max", out=out,
                               async_op=True)
        assert w.wait() is out and _numpy(out).tolist() == [i + n - 1 for i in range(start, start + counts[r])]

    try:
        run_ranks(comms, rank)
    finally:
        comms.close()


def _alone(call, error, match):
    """``call`` on a group of one rank raises ``error`` matching ``match``."""
    with tutti.local_group(1, timeout=30) as (c,):
        with pytest.raises(error, match=match):
            call(c)


def test_new_collectives_say_what_was_wrong():
    f32 = lambda n: np.zeros(n, np.float32)  # noqa: E731
    _alone(lambda c: c.all_to_all(f32(4), out=f32(3)), ValueError, "out must match")
    _alone(lambda c: c.all_to_all_v(f32(3), [2], [3]), ValueError, "send_counts sum to 2 but array holds 3")
    _alone(lambda c: c.all_to_all_v(f32(3), [3, 0], [3]), ValueError, "send_counts has 2 entries but the group has 1")
    _alone(lambda c: c.all_to_all_v(f32(3), [3], []), ValueError, "recv_counts has 0 entries but the group has 1")
    _alone(lambda c: c.all_to_all_v(f32(3), [-3], [3]), ValueError, r"send_counts\[0\] -3 is out of range")
    _alone(lambda c: c.all_to_all_v(f32(3), 3, [3]), TypeError, "send_counts must be a sequence of 1 integers")
    _alone(lambda c: c.all_to_all_v(f32(3), [3.0], [3]), TypeError, r"send_counts\[0\] must be an integer")
    _alone(lambda c: c.all_to_all_v(f32(3), [3], [3], out=f32(2)), ValueError, "out must match")
    _alone(lambda c: c.gather(f32(3), out=f32(4)), ValueError, "out must match")
    _alone(lambda c: c.gather(f32(3), root=-1), ValueError, "root -1 is out of range")
    _alone(lambda c: c.scatter(None), ValueError, "rank 0 is the root, so it must pass the array")
    _alone(lambda c: c.scatter(f32(3), count=2), ValueError, "count is 2 but the root's 3 elements make blocks of 3")
    _alone(lambda c: c.scatter(f32(3), out=f32(2)), ValueError, "out must match")
    _alone(lambda c: c.all_gather_v(f32(3), [2]), ValueError, r"counts\[0\] is 2 but this rank's array holds 3")
    _alone(lambda c: c.reduce_scatter_v(f32(3), [4]), ValueError, "counts sum to 4 but array holds 3")
    _alone(lambda c: c.reduce_scatter_v(f32(3), [3], op="median"), ValueError, "unknown op")
    # The library's own checks: no all-to-all in place; a root past the group.
    a = f32(4)
    _alone(lambda c: c.all_to_all(a, out=a), tutti.TuttiError, "cannot run in place")
    _alone(lambda c: c.gather(f32(2), root=5), tutti.TuttiError, "root 5 is out of range")
    # Lengths that do not split into one block per rank.
    with tutti.local_group(2, timeout=30) as comms:
        with pytest.raises(ValueError, match="all_to_all: 3 elements do not split into 2 equal blocks"):
            comms[0].all_to_all(f32(3))
    with tutti.local_group(2, timeout=30) as comms:
        with pytest.raises(ValueError, match="scatter: 3 elements do not split into 2 equal blocks"):
            comms[0].scatter(f32(3), root=0)


def test_a_rank_without_a_receive_length_releases_the_root():
    # Off the root, scatter's length comes from out= or count=: without either the rank is
    # refused, and the root, waiting for it, fails at once naming it (the timeout is long).
    with tutti.local_group(3, timeout=120) as comms:
        started = time.monotonic()

        def rank(c):
            if c.rank == 2:
                with pytest.raises(ValueError, match=r"rank 2 is not the root \(0\), so its receive length comes from out= or count="):
                    c.scatter(None, root=0)
            elif c.rank == 1:
                with pytest.raises(ValueError, match="with count= and no out=, pass array="):
                    c.scatter(None, root=0, count=2)
            else:
                with pytest.raises(tutti.TuttiError) as e:
                    c.scatter(np.zeros(6, np.float32), root=0)
                assert e.value.code == "TUTTI_ERROR_ABORTED", e.value
                assert re.search(r"rank [12] rejected its arguments to scatter", e.value.message), e.value.message

        run_ranks(comms, rank)
        assert time.monotonic() - started < 30


def test_counts_that_disagree_name_the_ranks():
    def mismatch(comms, call, code, *names):
        def rank(c):
            with pytest.raises(tutti.TuttiError) as e:
                call(c)
            assert e.value.code == code, e.value
            for name in names:
                assert name in e.value.message, e.value.message
        run_ranks(comms, rank)

    f32 = lambda n: np.ones(n, np.float32)  # noqa: E731
    # Every rank passes counts of its own: the one that differs is named by every rank.
    with tutti.local_group(3, timeout=60) as comms:
        mismatch(comms, lambda c: c.all_gather_v(f32(1), [1, 1, 2] if c.rank == 1 else [1, 1, 1]),
                 "TUTTI_ERROR_MISMATCH", "rank 1")
    with tutti.local_group(3, timeout=60) as comms:
        mismatch(comms, lambda c: c.reduce_scatter_v(f32(3), [1, 0, 2] if c.rank == 2 else [1, 1, 1]),
                 "TUTTI_ERROR_MISMATCH", "rank 2", "counts")
    with tutti.local_group(3, timeout=60) as comms:
        mismatch(comms, lambda c: c.gather(f32(2 if c.rank == 0 else 1), root=1), "TUTTI_ERROR_MISMATCH", "rank 0")
    with tutti.local_group(3, timeout=60) as comms:
        mismatch(comms, lambda c: c.scatter(f32(6), root=0) if c.rank == 0 else c.scatter(None, 0, out=f32(3)),
                 "TUTTI_ERROR_MISMATCH", "count")
    # all_to_all_v: rank 0 expects 2 elements from rank 1, which sends it 1.
    with tutti.local_group(2, timeout=60) as comms:
        def rank(c):
            recv = [1, 2] if c.rank == 0 else [1, 1]
            with pytest.raises(tutti.TuttiError) as e:
                c.all_to_all_v(f32(2), [1, 1], recv)
            assert "rank 0" in e.value.message and "rank 1" in e.value.message, e.value.message
        run_ranks(comms, rank)


def test_deterministic_groups_sum_in_rank_order():
    """deterministic=True: every rank gets the bits of ((x0 + x1) + x2) + x3, whatever the
    algorithm; a value other than True, False or None is refused."""
    rng = np.random.default_rng(7)
    xs = [(rng.standard_normal(4099) * 2.0 ** rng.integers(-12, 12, 4099)).astype(np.float32)
          for _ in range(4)]
    want = xs[0].copy()
    for x in xs[1:]:
        want = want + x
    for algorithm in ["auto", "ring", "direct", "reduce-to-one"]:
        got = {}
        with tutti.local_group(4, algorithm=algorithm, deterministic=True) as comms:
            run_ranks(comms, lambda c: got.__setitem__(c.rank, c.all_reduce(xs[c.rank].copy())))
        assert len(got) == 4
        for g in got.values():
            assert g.tobytes() == want.tobytes(), algorithm
    with pytest.raises(ValueError, match="deterministic must be True, False or None"):
        tutti.local_group(2, deterministic="yes")


def test_log_p_algorithms_by_name():
    """recursive-doubling, rabenseifner and hosts (on one host: the ring within it) are
    all-reduce algorithms a group can be made with."""
    xs = [np.arange(1001, dtype=np.float32) * (r + 1) for r in range(5)]
    for algorithm in ["recursive-doubling", "rabenseifner", "hosts"]:
        got = {}
        with tutti.local_group(5, algorithm=algorithm) as comms:
            run_ranks(comms, lambda c: got.__setitem__(c.rank, c.all_reduce(xs[c.rank].copy())))
        for g in got.values():
            assert (g == np.arange(1001, dtype=np.float32) * 15).all(), algorithm


def test_split_groups_by_color_ordered_by_key():
    """split(color, key): the ranks of one color form a group ranked by key; None gets None;
    each group's all-reduce sums its own ranks; a split of a split works the same."""
    got = {}

    def body(c):
        sub = c.split(None if c.rank == 3 else c.rank % 2, key=-c.rank)
        if sub is None:
            got[c.rank] = None
            return
        with sub:
            total = sub.all_reduce(np.array([c.rank], dtype=np.int64))
            again = sub.split(0)
            with again:
                got[c.rank] = (sub.rank, sub.world_size, int(total[0]), again.world_size)

    with tutti.local_group(5) as comms:
        run_ranks(comms, body)
    # evens {0, 2, 4} ranked 4, 2, 0; odds {1} (3 has no color).
    assert got == {0: (2, 3, 6, 3), 1: (0, 1, 1, 1), 2: (1, 3, 6, 3), 3: None, 4: (0, 3, 6, 3)}
    with tutti.local_group(1) as comms:
        with pytest.raises(TypeError, match="color must be an int or None"):
            comms[0].split("red")


def test_shrink_of_threads_is_unavailable_saying_why():
    """shrink() goes on without lost processes; threads of one process fail together."""
    with tutti.local_group(2) as comms:
        with pytest.raises(tutti.TuttiError, match="group of threads") as e:
            comms[0].shrink()
        assert e.value.code == "TUTTI_ERROR_UNAVAILABLE"


# ----- point-to-point: send, recv, send_recv -----


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("recv_first", [False, True])
def test_send_recv_ring_in_one_group(n, recv_first):
    # 1 MiB each way: more than a socket buffer, every rank sending before it receives.
    comms = tutti.local_group(n, timeout=60)
    size = 256 * 1024

    def rank(c):
        nxt, prev = (c.rank + 1) % n, (c.rank - 1) % n
        out = np.arange(size, dtype=np.float32) + 1000 * c.rank
        got = np.zeros(size, dtype=np.float32)
        ops = [("send", out, nxt), ("recv", got, prev)]
        received = c.send_recv(ops[::-1] if recv_first else ops)
        assert len(received) == 1 and received[0] is got
        np.testing.assert_array_equal(got, np.arange(size, dtype=np.float32) + 1000 * prev)

    run_ranks(comms, rank)
    comms.close()


def test_send_recv_async_returns_a_work_and_keeps_order_with_collectives():
    # The ring's group is issued and returns at once; an all-reduce issued after it completes
    # after it; wait() returns the received arrays.
    n, size = 3, 256 * 1024
    comms = tutti.local_group(n, timeout=60)

    def rank(c):
        nxt, prev = (c.rank + 1) % n, (c.rank - 1) % n
        got = np.zeros(size, dtype=np.float32)
        w = c.send_recv([("send", np.full(size, c.rank, np.float32), nxt), ("recv", got, prev)],
                        async_op=True)
        s = c.all_reduce(np.ones(1), async_op=True)
        assert s.wait()[0] == n
        assert w.is_completed()
        received = w.wait()
        assert len(received) == 1 and received[0] is got
        assert (got == prev).all()
        # Nothing to send or receive: complete at once.
        empty = c.send_recv([], async_op=True)
        assert empty.is_completed() and empty.wait() == []

    run_ranks(comms, rank)
    # A group's own error reaches its Work; the communicator stays usable.
    w = comms[0].send_recv([("send", np.arange(3.0), 0)], async_op=True)
    with pytest.raises(tutti.TuttiError, match="sends to itself"):
        w.wait()
    run_ranks(comms, lambda c: c.barrier())
    comms.close()


@pytest.mark.parametrize("dtype", [np.float64, np.int8, np.uint64, np.float16])
@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_send_and_recv_blocking_pairs(dtype, kind):
    comms = tutti.local_group(3, timeout=60)

    def rank(c):
        mine = _of_kind(kind, (np.arange(10) + 10 * c.rank).astype(dtype))
        if c.rank == 0:
            for k in (1, 2):
                assert c.send(mine, k) is None
                got = _of_kind(kind, np.zeros(10, dtype=dtype))
                assert c.recv(got, k) is got
                np.testing.assert_array_equal(np.asarray(got), (np.arange(10) + 10 * k).astype(dtype))
        else:
            got = _of_kind(kind, np.zeros(10, dtype=dtype))
            c.recv(got, 0)
            np.testing.assert_array_equal(np.asarray(got), np.arange(10).astype(dtype))
            c.send(mine, 0)
        # Point-to-point keeps its order with the collectives.
        assert c.all_reduce(np.ones(2, dtype=np.float32))[0] == 3

    run_ranks(comms, rank)
    comms.close()


def test_send_and_recv_async_sends_first():
    comms = tutti.local_group(3, timeout=60)

    def rank(c):
        nxt, prev = (c.rank + 1) % 3, (c.rank - 1) % 3
        out = np.full(100, c.rank, dtype=np.int64)
        got = np.full(100, -1, dtype=np.int64)
        s = c.send(out, nxt, async_op=True)
        r = c.recv(got, prev, async_op=True)
        assert s.wait() is None
        assert r.wait() is got
        assert (got == prev).all()

    run_ranks(comms, rank)
    comms.close()


def test_send_count_mismatch_names_both_ranks_and_aborts():
    comms = tutti.local_group(2, timeout=60)
    seen = {}

    def rank(c):
        if c.rank == 0:
            c.send(np.ones(5, dtype=np.float32), 1)
            with pytest.raises(tutti.TuttiError) as e:
                c.barrier()
            seen[0] = e.value
        else:
            with pytest.raises(tutti.TuttiError) as e:
                c.recv(np.zeros(4, dtype=np.float32), 0)
            seen[1] = e.value

    run_ranks(comms, rank)
    assert seen[1].code == "TUTTI_ERROR_INVALID_ARGUMENT"
    assert "rank 0 sent 5 f32 where rank 1 receives 4 f32" in seen[1].message
    assert seen[0].code == "TUTTI_ERROR_ABORTED"
    comms.close()


def test_send_argument_errors_leave_the_communicator_usable():
    comms = tutti.local_group(2, timeout=60)
    c = comms[0]
    with pytest.raises(ValueError, match="peer 2 is out of range"):
        c.send(np.ones(3), 2)
    with pytest.raises(TypeError, match="peer must be an integer"):
        c.recv(np.ones(3), "1")
    ro = np.ones(3)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        c.recv(ro, 1)
    with pytest.raises(ValueError, match="neither 'send' nor 'recv'"):
        c.send_recv([("put", np.ones(3), 1)])
    with pytest.raises(TypeError, match=r"ops\[0\] must be a \(kind, array, peer\)"):
        c.send_recv([np.ones(3)])
    # A send to itself needs its receive in the same group; with it, it is a copy.
    with pytest.raises(tutti.TuttiError, match="sends to itself") as e:
        c.send(np.ones(3), 0)
    assert e.value.code == "TUTTI_ERROR_INVALID_ARGUMENT"
    got = np.zeros(3)
    c.send_recv([("send", np.arange(3.0), 0), ("recv", got, 0)])
    assert list(got) == [0.0, 1.0, 2.0]
    with pytest.raises(tutti.TuttiError, match="rank 0 of 2.*sends to itself"):
        c.send_recv([("send", np.arange(3.0), 0)])
    # Still usable: both ranks all-reduce.
    run_ranks(comms, lambda c: c.all_reduce(np.ones(1)))
    # The group of send_recv is closed even after an error: a collective runs afterwards.
    w = comms[0].all_reduce(np.ones(1), async_op=True)
    assert comms[1].all_reduce(np.ones(1))[0] == 2
    assert w.wait()[0] == 2
    comms.close()


def test_send_recv_refuse_cuda_tensors_on_cpu_ranks(monkeypatch):
    # No GPU needed: every argument is seen as a CUDA tensor's view.
    comms = tutti.local_group(2, timeout=60)
    monkeypatch.setattr(tutti, "_view", lambda a, what, writable=False: tutti._View(a, 8, 1, 0, "cuda", (1,)))
    for call in (lambda: comms[0].send(object(), 1), lambda: comms[0].recv(object(), 1, async_op=True),
                 lambda: comms[0].send_recv([("send", object(), 1), ("recv", object(), 1)])):
        with pytest.raises(TypeError, match="CUDA tensor was passed to a communicator on cpu"):
            call()
    monkeypatch.undo()
    # Nothing was issued or aborted: the ranks still exchange.
    got = np.zeros(2)
    run_ranks(comms, lambda c: c.send(np.ones(2), 1) if c.rank == 0 else c.recv(got, 0))
    assert list(got) == [1.0, 1.0]
    comms.close()


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, np.int32, np.uint8])
def test_premul_sum_scales_each_ranks_array_by_its_own_factor(dtype):
    comms = tutti.local_group(3, timeout=60)
    out = {}

    def rank(c):
        a = (np.arange(6) % 4).astype(dtype)
        f = c.rank + 1
        in_place = a.copy()
        c.all_reduce_premul_sum(in_place, f)
        into = np.zeros_like(a)
        c.all_reduce_premul_sum(a, f, out=into)
        part = c.reduce_scatter_premul_sum(a, f)
        # Without waiting: the calls run in issue order, each reading its input when it starts.
        chained = a.copy()
        first = c.all_reduce(chained, async_op=True)
        second = c.all_reduce_premul_sum(chained, f, async_op=True)
        part_async = c.reduce_scatter_premul_sum(a, f, async_op=True)
        first.wait()
        second.wait()
        out[c.rank] = (in_place, into, part, chained, part_async.wait())

    run_ranks(comms, rank)
    want = ((np.arange(6) % 4) * 6).astype(dtype)
    for r in range(3):
        in_place, into, part, chained, part_async = out[r]
        np.testing.assert_array_equal(in_place, want)
        np.testing.assert_array_equal(into, want)
        np.testing.assert_array_equal(part, want[2 * r : 2 * r + 2])
        np.testing.assert_array_equal(part_async, part)
        # The sum over ranks (3 copies) first, then each rank's copy scaled by r + 1 and summed.
        np.testing.assert_array_equal(chained, ((np.arange(6) % 4) * 3 * 6).astype(dtype))


def test_premul_sum_refuses_a_fraction_on_integers_on_every_rank():
    comms = tutti.local_group(2, timeout=60)
    errors = {}

    def rank(c):
        a = np.full(4, 5, dtype=np.int32)
        try:
            c.all_reduce_premul_sum(a, 0.5 if c.rank == 1 else 2)
        except tutti.TuttiError as e:
            errors[c.rank] = (e.code, e.message, a.copy())

    run_ranks(comms, rank)
    assert errors[1][0] == "TUTTI_ERROR_INVALID_ARGUMENT" and "0.5 is not a whole number" in errors[1][1]
    assert errors[0][0] == "TUTTI_ERROR_PEER_REJECTED"
    for r in range(2):
        np.testing.assert_array_equal(errors[r][2], [5] * 4)


def test_framework_glue_compiles_once_and_within_its_time(tmp_path, monkeypatch):
    """The C++ glue of tutti.jax and tutti.tensorflow: compiled into the cache once, and a
    compiler that outlives TUTTI_COMPILE_TIMEOUT is stopped with an error saying so."""
    from tutti import _ext

    src = tmp_path / "glue.cc"
    src.write_text('#include "_glue.h"\nextern "C" int glue_answer() { return 42; }\n')
    monkeypatch.setenv("TUTTI_TEST_GLUE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("TUTTI_COMPILE_TIMEOUT", "0.001")
    with pytest.raises(RuntimeError, match="TUTTI_COMPILE_TIMEOUT"):
        _ext.compile_library("test glue", src, "glue", "TUTTI_TEST_GLUE_CACHE", "test-glue", [])
    assert not list((tmp_path / "cache").glob("*.so"))
    monkeypatch.delenv("TUTTI_COMPILE_TIMEOUT")
    lib = _ext.compile_library("test glue", src, "glue", "TUTTI_TEST_GLUE_CACHE", "test-glue", [])
    assert ctypes.CDLL(str(lib)).glue_answer() == 42
    assert _ext.compile_library("test glue", src, "glue", "TUTTI_TEST_GLUE_CACHE", "test-glue", []) == lib


def test_glue_the_install_built_is_used_where_its_key_matches(tmp_path, monkeypatch):
    """The package's install compiles the glue into the package (``into``, as setup.py does:
    from the cache where it holds the same build); a job then loads that library without a
    compiler, and compiles its own where the key differs (another framework version)."""
    from tutti import _ext

    src = tmp_path / "glue.cc"
    src.write_text('#include "_glue.h"\nextern "C" int glue_answer() { return 5; }\n')
    monkeypatch.setenv("TUTTI_TEST_GLUE_CACHE", str(tmp_path / "cache"))
    prebuilt = tmp_path / "prebuilt"
    built = _ext.compile_library("test glue", src, "glue", "TUTTI_TEST_GLUE_CACHE", "test-glue", [], into=prebuilt)
    assert built.parent == prebuilt and ctypes.CDLL(str(built)).glue_answer() == 5
    assert not (tmp_path / "cache").exists(), "the install's build went into the cache"
    monkeypatch.setattr(_ext, "PREBUILT", prebuilt)
    monkeypatch.setenv("CXX", "false")
    assert _ext.compile_library("test glue", src, "glue", "TUTTI_TEST_GLUE_CACHE", "test-glue", []) == built
    # Another framework version: a key the install did not build, compiled (and failing here,
    # where the compiler is `false`) instead of loading a library built for another ABI.
    with pytest.raises(RuntimeError, match="compiling its C\\+\\+ glue failed"):
        _ext.compile_library("test glue", src, "glue", "TUTTI_TEST_GLUE_CACHE", "test-glue", [], key_extra=b"2.99")
    monkeypatch.delenv("CXX")
    cached = _ext.compile_library("test glue", src, "glue", "TUTTI_TEST_GLUE_CACHE", "test-glue", [],
                                  key_extra=b"2.99")
    assert cached.parent == tmp_path / "cache"
    # An install that finds the cache holding its build copies it, compiling nothing.
    monkeypatch.setenv("CXX", "false")
    again = _ext.compile_library("test glue", src, "glue", "TUTTI_TEST_GLUE_CACHE", "test-glue", [],
                                 key_extra=b"2.99", into=tmp_path / "second")
    assert again.parent == tmp_path / "second" and again.read_bytes() == cached.read_bytes()


def test_the_glue_cache_keeps_the_secrets_directory_private(tmp_path, monkeypatch):
    """Compiled into the default cache (~/.cache/tutti/...) before any job ran, the glue leaves
    ~/.cache/tutti private: it also holds the per-user job secret, which tutti refuses to read
    from a directory others may read, so a job that joins afterwards still starts."""
    from tutti import _ext

    src = tmp_path / "glue.cc"
    src.write_text('extern "C" int glue_answer() { return 7; }\n')
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("TUTTI_TEST_GLUE_CACHE", raising=False)
    lib = _ext.compile_library("test glue", src, "glue", "TUTTI_TEST_GLUE_CACHE", "test-glue", [])
    assert lib.parent == home / ".cache" / "tutti" / "test-glue"
    assert (home / ".cache" / "tutti").stat().st_mode & 0o077 == 0
    # A job on the per-user secret (no TUTTI_JOB_TOKEN, no XDG_RUNTIME_DIR) joins afterwards.
    env = {k: v for k, v in os.environ.items() if k not in ("TUTTI_JOB_TOKEN", "XDG_RUNTIME_DIR")}
    env.update(HOME=str(home), TUTTI_RANK="0", TUTTI_WORLD_SIZE="1", TUTTI_MASTER_ADDR=f"127.0.0.1:{_free_port()}",
               PYTHONPATH=str(pathlib.Path(tutti.__file__).resolve().parents[1]))
    code = "import numpy as np, tutti; print(tutti.from_env(timeout=30).all_reduce(np.ones(2, np.float32)).tolist())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "[1.0, 1.0]" in out.stdout, out.stderr
    assert (home / ".cache" / "tutti" / "secret").exists()


def test_the_type_stubs_name_every_public_method():
    """A type checker sees every public method of the classes the package exports."""
    import ast
    import pathlib

    tree = ast.parse(pathlib.Path(tutti.__file__).with_suffix(".pyi").read_text())
    for cls in ("Communicator", "Work"):
        stub = {n.name for c in tree.body if isinstance(c, ast.ClassDef) and c.name == cls
                for n in c.body if isinstance(n, ast.FunctionDef)}
        public = {m for m in dir(getattr(tutti, cls)) if not m.startswith("_")
                  and callable(getattr(getattr(tutti, cls), m))}
        assert public <= stub, f"{cls}: {sorted(public - stub)} not in __init__.pyi"
