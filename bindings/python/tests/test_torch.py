"""The torch.distributed backend "tutti" (tutti.torch), in jobs of separate processes started as
torchrun starts them (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), and tensors in tutti's own
API. Skipped where torch is not installed, unless TUTTI_REQUIRE_TORCH=1 (CI), which fails."""

import json
import os
import pathlib
import socket
import subprocess
import sys
import threading

import numpy as np
import pytest

try:
    import torch
except ImportError:
    if os.environ.get("TUTTI_REQUIRE_TORCH") == "1":
        raise
    pytest.skip("torch is not installed (TUTTI_REQUIRE_TORCH=1 makes this a failure)", allow_module_level=True)

import tutti

WORKER = pathlib.Path(__file__).with_name("torch_worker.py")
PACKAGE = str(pathlib.Path(__file__).resolve().parents[1])


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(scenario, world, backend="tutti", timeout=120, env=None, expect_dead=()):
    """Start ``world`` ranks of ``scenario``; each rank's RESULT (None for a rank that died as
    expected)."""
    port = free_port()
    procs = []
    for rank in range(world):
        e = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        e["PYTHONPATH"] = PACKAGE + os.pathsep + e.get("PYTHONPATH", "")
        e.update(env or {})
        procs.append(subprocess.Popen([sys.executable, str(WORKER), scenario, backend], env=e,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    try:
        for rank, p in enumerate(procs):
            out, err = p.communicate(timeout=timeout)
            if rank in expect_dead:
                results.append(None)
                continue
            lines = [l for l in out.splitlines() if l.startswith("RESULT ")]
            assert p.returncode == 0 and lines, f"rank {rank} of {scenario} failed ({p.returncode}):\n{out}\n{err}"
            results.append(json.loads(lines[-1][len("RESULT "):]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return results


# ----- tensors in tutti's own API -----


def threads(comms, fn):
    out = [None] * len(comms)
    errors = []

    def body(i):
        try:
            out[i] = fn(comms[i])
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    ts = [threading.Thread(target=body, args=(i,)) for i in range(len(comms))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    if errors:
        raise errors[0]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16,
                                   torch.int32, torch.int64, torch.int8, torch.uint8])
@pytest.mark.parametrize("kind", ["torch", "numpy", "dlpack"])
def test_every_collective_takes_tensors_without_copies(dtype, kind):
    comms = tutti.local_group(2, timeout=30)
    n = 6

    def make(rank, n=n):
        t = (torch.arange(n) % 5 + rank + 1).to(dtype)
        if kind == "torch":
            return t
        if kind == "dlpack":
            return _DLPackOnly(t)
        if dtype == torch.bfloat16:  # numpy has no bfloat16 of its own
            ml_dtypes = pytest.importorskip("ml_dtypes")
            a = t.float().numpy().astype(ml_dtypes.bfloat16)
        else:
            a = t.numpy()
        return a

    def as_torch(x):
        x = getattr(x, "a", x)
        if isinstance(x, torch.Tensor):
            return x
        a = np.asarray(x)
        if a.dtype.name == "bfloat16":
            return torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16)
        return torch.from_numpy(a)

    want = sum((torch.arange(n) % 5 + r + 1).double() for r in range(2)).to(dtype)

    def body(c):
        x = make(c.rank)
        y = c.all_reduce(x, op="sum")  # in place
        assert y is x
        assert torch.equal(as_torch(x), want)
        x = make(c.rank)
        out = make(0) if kind != "dlpack" else make(0).a
        c.all_reduce(x, op="max", out=out, async_op=True).wait()
        assert torch.equal(as_torch(out), torch.stack([make_t(r) for r in range(2)]).max(0).values)
        assert torch.equal(as_torch(x), make_t(c.rank)), "out of place wrote its input"
        g = c.all_gather(make(c.rank), async_op=True).wait()
        # Outputs are of the input's kind; an object seen through DLPack gets numpy's (torch's
        # where numpy cannot see it: bfloat16).
        assert type(g) is {"numpy": np.ndarray, "torch": torch.Tensor}.get(kind, type(g))
        assert torch.equal(as_torch(g), torch.cat([make_t(r) for r in range(2)]))
        s = c.reduce_scatter(make(c.rank), op="sum")
        assert torch.equal(as_torch(s), want.chunk(2)[c.rank])
        b = make(c.rank)
        c.broadcast(b, root=1)
        assert torch.equal(as_torch(b), make_t(1))
        r = c.reduce(make(c.rank), op="sum", root=0)
        assert (r is None) == (c.rank != 0)
        if r is not None:
            assert torch.equal(as_torch(r), want)

    def make_t(rank):
        return (torch.arange(n) % 5 + rank + 1).to(dtype)

    try:
        threads(comms, body)
    finally:
        for c in comms:
            c.close()


class _DLPackOnly:
    """An array seen only through __dlpack__ (as jax and cupy arrays are)."""

    def __init__(self, a):
        self.a = a

    def __dlpack__(self, **kw):
        return self.a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self.a.__dlpack_device__()


def test_ops_by_the_names_frameworks_use():
    import torch.distributed as dist

    comms = tutti.local_group(2, timeout=30)
    try:
        for op, want in [("avg", 1.5), ("mean", 1.5), ("SUM", 3.0), (dist.ReduceOp.AVG, 1.5),
                         (dist.ReduceOp.PRODUCT, 2.0), (dist.ReduceOp(dist.ReduceOp.MIN), 1.0)]:
            got = threads(comms, lambda c: c.all_reduce(torch.full((3,), float(c.rank + 1)), op=op))
            assert got[0].tolist() == [want] * 3, op
        assert tutti._op(dist.ReduceOp.BAND) == tutti.OPS["band"]
        with pytest.raises(ValueError, match="unknown op"):
            tutti._op("median")
    finally:
        for c in comms:
            c.close()


def test_wrong_tensors_are_named():
    comms = tutti.local_group(2, timeout=30)
    try:
        c = comms[0]
        with pytest.raises(ValueError, match="not contiguous"):
            c.all_reduce(torch.zeros(4, 4)[:, 1])
        with pytest.raises(TypeError, match="complex64"):
            c.all_reduce(torch.zeros(4, dtype=torch.complex64))
        with pytest.raises(TypeError, match="sparse"):
            c.all_reduce(torch.zeros(4).to_sparse())
        with pytest.raises(TypeError, match="CUDA tensor|cuda"):
            c._on_tensor_stream([tutti._View(None, 0, 0, 0, "cuda", ())])
        with pytest.raises(ValueError, match="must match the call"):
            c.all_gather(torch.zeros(4), out=torch.zeros(5))
    finally:
        for c in comms:
            c.close()


# ----- the backend, in separate processes -----


def test_every_collective_and_dtype_through_torch_distributed():
    r = run("collectives", 2)
    assert r[0]["checked"] > 100


def test_every_collective_three_ranks():
    run("collectives", 3)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_all_to_all_gather_and_scatter_through_torch_distributed(world):
    r = run("alltoall", world)
    assert all(x["checked"] == 8 + 2 * world for x in r), r


@pytest.mark.parametrize("world", [2, 3])
def test_send_recv_and_batch_isend_irecv_through_torch_distributed(world):
    r = run("p2p", world)
    for x in r:
        assert x["checked"] == (3 * (world - 1) if x is r[0] else 3) + 4, x
        assert "tag 3" in x["refused"]["tag"] and "pass tag=0" in x["refused"]["tag"], x
        assert "recv without src" in x["refused"]["anysource"], x


def test_split_sizes_that_do_not_add_up_are_refused_and_release_the_others():
    r = run("alltoall_reject", 2, env={"TEST_TIMEOUT": "60"})
    assert "input split sizes [3, 3] do not add up to the input's 4 rows" in r[0]["error"], r[0]["error"]
    assert "rank 0" in r[1]["error"], r[1]["error"]
    assert r[1]["seconds"] < 30, r[1]


@pytest.mark.parametrize("world", [2, 3])
def test_ddp_weights_are_those_of_gloo(world):
    tutti_ = run("ddp", world)
    gloo = run("ddp", world, backend="gloo")
    assert len({x["digest"] for x in tutti_}) == 1, "the tutti ranks' weights differ"
    if world == 2:
        # a + b is one rounding whatever the algorithm: bit for bit.
        assert tutti_[0]["digest"] == gloo[0]["digest"]
    else:
        # Three addends round differently grouped: Gloo's ring sums each segment starting at
        # another rank, tutti in one order for every element. The same to float32's precision.
        a, b = np.array(tutti_[0]["params"]), np.array(gloo[0]["params"])
        assert a.shape == b.shape
        assert np.allclose(a, b, rtol=1e-5, atol=1e-6), np.abs(a - b).max()


@pytest.mark.parametrize("method", ["tcp", "file", "store"])
def test_init_methods(method, tmp_path):
    env = {"TEST_INIT": method, "TEST_FILE": str(tmp_path / "rendezvous")}
    r = run("ddp", 2, env=env)
    assert r[0]["digest"] == r[1]["digest"]


def test_fsdp_parameters_are_those_of_gloo():
    tutti_ = run("fsdp", 2)
    gloo = run("fsdp", 2, backend="gloo")
    assert tutti_[0]["sharded"] == "DTensor"
    assert tutti_[0]["digest"] == gloo[0]["digest"] == tutti_[1]["digest"]


def test_a_killed_rank_is_named_by_the_others_within_the_timeout():
    r = run("kill", 3, env={"TEST_TIMEOUT": "30"}, expect_dead=(1,))
    for rank in (0, 2):
        assert "rank 1" in r[rank]["error"], r[rank]["error"]
        assert r[rank]["seconds"] < 30, r[rank]


def test_a_mismatched_call_names_both_ranks():
    r = run("mismatch", 2, env={"TEST_TIMEOUT": "30"})
    for x in r:
        assert "rank 0" in x["error"] and "rank 1" in x["error"], x["error"]


def test_a_rank_that_rejects_its_tensor_does_not_leave_the_others_waiting():
    r = run("bad_input", 2, env={"TEST_TIMEOUT": "60"})
    assert "torch.bool" in r[0]["error"], r[0]["error"]
    assert "rank 0" in r[1]["error"], r[1]["error"]
    assert r[1]["seconds"] < 30, r[1]


def test_a_collective_inside_a_future_callback_completes():
    r = run("nested", 2, env={"TEST_TIMEOUT": "30"}, timeout=60)
    assert r[0]["value"] == r[1]["value"] == [4.0] * 4


def test_arguments_the_backend_rejects_release_the_other_ranks():
    r = run("reject", 2, env={"TEST_TIMEOUT": "60"})
    assert "3 input tensors for a group of 2" in r[0]["error"], r[0]["error"]
    assert "rank 0" in r[1]["error"], r[1]["error"]
    assert r[1]["seconds"] < 30, r[1]


def test_a_group_made_again_over_the_same_store():
    r = run("reinit", 2, env={"TEST_TIMEOUT": "30"})
    assert r[0]["sums"] == r[1]["sums"] == [[3.0] * 3] * 3


def test_new_group_of_two_of_three_ranks():
    r = run("new_group", 3)
    assert r[0]["group"] == r[1]["group"] == [3.0] * 8
    assert r[2]["group"] is None
    assert all(x["world"] == [3.0] * 3 for x in r)


def test_cpu_tutti_cuda_nccl():
    r = run("mixed", 2)
    assert r[0]["value"] == [3.0] * 5
    assert "tutti" in r[0]["backend"]


@pytest.mark.parametrize("version,taken", [("1.0.0", False), ("2.8.0", False), ("2.12.0+cpu", True),
                                           ("2.15.0", True), ("2.16.0", False)])
def test_untested_torch_is_refused_saying_so(version, taken):
    """Releases from the first tested to the last are taken; others are refused, naming them."""
    code = (
        f"import torch; torch.__version__ = '{version}'\n"
        "try:\n    import tutti.torch\n    print('taken')\nexcept ImportError as e:\n    print(e)\n"
    )
    env = dict(os.environ, PYTHONPATH=PACKAGE)
    env.pop("TUTTI_TORCH_UNTESTED", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    if taken:
        assert out.stdout.strip() == "taken", out
    else:
        assert "tested with torch" in out.stdout and version in out.stdout, out


def test_the_backends_public_names_have_docstrings():
    import inspect

    import tutti.torch as tt

    for name in tt.__all__:
        obj = getattr(tt, name)
        if inspect.isclass(obj):
            assert obj.__doc__, name
            for m, f in vars(obj).items():
                if not m.startswith("_") and callable(f):
                    assert f.__doc__, f"{name}.{m} has no docstring"


def test_the_strategies_take_and_give_torch_tensors():
    """tutti.distribute takes torch tensors wherever it takes arrays (through DLPack, detached
    where they require grad) and gives torch tensors back for them, on their device: reduce,
    gather, a replica's all_reduce, variables, distributed datasets, compute_average_loss (which
    keeps the loss on its graph)."""
    import tutti.distribute as td

    s = td.MirroredStrategy(["cpu:0", "cpu:1"])
    per = td.PerReplica([torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])])
    total = s.reduce("SUM", per, axis=None)
    assert isinstance(total, torch.Tensor) and total.tolist() == [4.0, 6.0]
    mean = s.reduce("MEAN", per, axis=0)
    assert isinstance(mean, torch.Tensor) and mean.item() == 2.5
    rows = s.gather(per, axis=0)
    assert isinstance(rows, torch.Tensor) and rows.tolist() == [1.0, 2.0, 3.0, 4.0]

    def step(x):
        ctx = td.get_replica_context()
        return ctx.all_reduce("SUM", x * (ctx.replica_id_in_sync_group + 1))

    out = s.run(step, args=(per,))
    for t in s.experimental_local_results(out):
        assert isinstance(t, torch.Tensor) and t.tolist() == [7.0, 10.0]

    with s.scope():
        v = td.Variable(torch.ones(2, requires_grad=True), aggregation="sum")
    v.assign_add(torch.tensor([1.0, 2.0]))
    assert v.numpy().tolist() == [2.0, 3.0]

    batches = [(torch.arange(8.0).reshape(4, 2), torch.tensor([0, 1, 2, 3]))]
    seen = []
    for batch in s.experimental_distribute_dataset(batches):
        for xr, yr in s.experimental_local_results(batch):
            assert isinstance(xr, torch.Tensor) and xr.shape == (2, 2), xr
            assert isinstance(yr, torch.Tensor)
            seen.extend(yr.tolist())
    assert sorted(seen) == [0, 1, 2, 3]

    # bfloat16 (numpy has none), a transposed view, a 0-d tensor.
    halves = td.PerReplica([torch.tensor([1.5, 2.0], dtype=torch.bfloat16),
                            torch.tensor([0.5, 1.0], dtype=torch.bfloat16)])
    total = s.reduce("SUM", halves, axis=None)
    assert total.dtype == torch.bfloat16 and total.tolist() == [2.0, 3.0]
    grid = torch.arange(6.0).reshape(2, 3)
    out = s.run(lambda: td.get_replica_context().all_reduce("SUM", grid.t()))
    for t in s.experimental_local_results(out):
        assert t.shape == (3, 2) and t.tolist() == (2 * grid.t()).tolist()
    out = s.run(lambda: td.get_replica_context().all_reduce("MEAN", torch.tensor(4.0)))
    for t in s.experimental_local_results(out):
        assert isinstance(t, torch.Tensor) and t.shape == () and t.item() == 4.0

    losses = torch.tensor([1.0, 2.0], requires_grad=True)
    loss = td.compute_average_loss(losses, global_batch_size=4)
    assert isinstance(loss, torch.Tensor) and loss.item() == 0.75
    loss.backward()
    assert losses.grad.tolist() == [0.25, 0.25]
    s.close()
