"""CUDA tensors on a ``cuda:N`` communicator (libtutti built with ``--features cuda``).

Skipped without torch, a CUDA GPU or a CUDA build of libtutti; with ``TUTTI_REQUIRE_GPU=1``
every such skip fails instead, so that a run on a GPU machine cannot pass without the GPU."""

import os

import numpy as np
import pytest

import tutti


def _require(why):
    if os.environ.get("TUTTI_REQUIRE_GPU", "").strip() not in ("", "0"):
        pytest.fail(f"TUTTI_REQUIRE_GPU is set but {why}")
    pytest.skip(why)


@pytest.fixture
def cuda_rank():
    try:
        import torch
    except ImportError:
        _require("torch is not installed")
    if not torch.cuda.is_available():
        _require("torch sees no CUDA GPU")
    try:
        comms = tutti.device_group(["cuda:0"], timeout=60)
    except tutti.TuttiError as e:
        if e.code == "TUTTI_ERROR_UNAVAILABLE":
            _require(f"this libtutti has no CUDA: {e.message}")
        raise
    yield torch, comms[0]
    comms[0].close()


def test_collectives_over_cuda_tensors(cuda_rank):
    torch, c = cuda_rank
    assert c.device == "cuda:0"
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int32, torch.int64):
        t = (torch.arange(1003, device="cuda") % 7).to(dtype)
        want = t.clone()
        assert c.all_reduce(t, op="sum") is not None
        torch.cuda.synchronize()
        assert torch.equal(t, want), dtype
        out = torch.empty_like(t)
        c.all_reduce(t, op="max", out=out)
        torch.cuda.synchronize()
        assert torch.equal(out, want), dtype
        g = c.all_gather(t)
        torch.cuda.synchronize()
        assert g.is_cuda and tuple(g.shape) == (1003,) and torch.equal(g, want), dtype
        c.broadcast(t, root=0)
        torch.cuda.synchronize()
        assert torch.equal(t, want), dtype


def test_calls_are_ordered_on_the_tensors_stream(cuda_rank):
    torch, c = cuda_rank
    side = torch.cuda.Stream()
    n = 1 << 24
    with torch.cuda.stream(side):
        t = torch.zeros(n, device="cuda")
        # Long work queued on the side stream before the call: the call must wait for it.
        for _ in range(20):
            t.add_(1.0)
        out = torch.empty_like(t)
        w = c.all_reduce(t, out=out, async_op=True)
        w.wait()
        out.mul_(2.0)
    side.synchronize()
    assert float(out.min()) == 40.0 and float(out.max()) == 40.0


def test_point_to_point_and_counts_per_block_over_cuda_tensors(cuda_rank):
    torch, c = cuda_rank
    side = torch.cuda.Stream()
    n = 1 << 22
    with torch.cuda.stream(side):
        t = torch.zeros(n, device="cuda")
        # Work queued on the stream before the send: the bytes moved are its result.
        for _ in range(10):
            t.add_(1.0)
        out = torch.empty_like(t)
        got = c.send_recv([("send", t, 0), ("recv", out, 0)])
    side.synchronize()
    assert got[0] is out and float(out.min()) == 10.0 and float(out.max()) == 10.0
    x = torch.arange(7, device="cuda", dtype=torch.int32)
    y = c.all_to_all_v(x, [7], [7])
    torch.cuda.synchronize()
    assert y.is_cuda and torch.equal(y, x)
    y = c.all_gather_v(x, [7])
    torch.cuda.synchronize()
    assert y.is_cuda and torch.equal(y, x)
    y = c.reduce_scatter_v(x, [7], op="max")
    torch.cuda.synchronize()
    assert y.is_cuda and torch.equal(y, x)


def test_host_memory_on_a_cuda_rank_is_refused_clearly(cuda_rank):
    torch, c = cuda_rank
    with pytest.raises((tutti.TuttiError, TypeError, ValueError)) as e:
        c.all_reduce(np.ones(16, dtype=np.float32))
    assert str(e.value)
