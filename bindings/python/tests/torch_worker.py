"""One rank of a torch.distributed job for tests/test_torch.py: ``python torch_worker.py
SCENARIO BACKEND`` with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set (as torchrun sets
them). Prints one JSON line prefixed ``RESULT `` on success; raises (exit code 1) on failure."""

import datetime
import hashlib
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import tutti.torch  # noqa: F401 - registers "tutti"

torch.set_num_threads(1)
RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
TIMEOUT = datetime.timedelta(seconds=float(os.environ.get("TEST_TIMEOUT", "60")))


def init(backend, method="env"):
    if method == "env":
        dist.init_process_group(backend, timeout=TIMEOUT)
    elif method == "tcp":
        addr = f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        dist.init_process_group(backend, init_method=addr, rank=RANK, world_size=WORLD, timeout=TIMEOUT)
    elif method == "file":
        dist.init_process_group(
            backend, init_method="file://" + os.environ["TEST_FILE"], rank=RANK, world_size=WORLD, timeout=TIMEOUT
        )
    elif method == "store":
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), WORLD, RANK == 0, timeout=TIMEOUT
        )
        dist.init_process_group(backend, store=store, rank=RANK, world_size=WORLD, timeout=TIMEOUT)
    else:
        raise ValueError(method)


def result(**values):
    print("RESULT " + json.dumps(values), flush=True)


def value(rank, n, dtype):
    """Rank ``rank``'s input: small integers, exact in every dtype."""
    return (torch.arange(n, dtype=torch.float64) % 5 + rank + 1).to(dtype)


DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64,
          torch.int8, torch.uint8]


def expect_equal(got, want, what):
    if not torch.equal(got, want):
        raise AssertionError(f"rank {RANK}: {what}: got {got.tolist()}, want {want.tolist()}")


def scenario_collectives(backend):
    init(backend)
    n = 6 * WORLD
    every = [value(r, n, torch.float64) for r in range(WORLD)]
    reduced = {
        dist.ReduceOp.SUM: sum(every),
        dist.ReduceOp.PRODUCT: torch.stack(every).prod(0),
        dist.ReduceOp.MIN: torch.stack(every).min(0).values,
        dist.ReduceOp.MAX: torch.stack(every).max(0).values,
    }
    checked = 0
    for dtype in DTYPES:
        for op, want in reduced.items():
            for async_op in (False, True):
                t = value(RANK, n, dtype)
                w = dist.all_reduce(t, op=op, async_op=async_op)
                if async_op:
                    w.wait()
                expect_equal(t, want.to(dtype), f"all_reduce {op} {dtype} async={async_op}")
                checked += 1
        if dtype.is_floating_point:
            t = value(RANK, n, dtype)
            dist.all_reduce(t, op=dist.ReduceOp.AVG)
            expect_equal(t, (sum(every) / WORLD).to(dtype), f"all_reduce AVG {dtype}")
        # broadcast from the last rank
        t = value(RANK, n, dtype)
        dist.broadcast(t, src=WORLD - 1)
        expect_equal(t, every[WORLD - 1].to(dtype), f"broadcast {dtype}")
        # all_gather into a list, and into one tensor
        outs = [torch.zeros(n, dtype=dtype) for _ in range(WORLD)]
        dist.all_gather(outs, value(RANK, n, dtype))
        for r in range(WORLD):
            expect_equal(outs[r], every[r].to(dtype), f"all_gather {dtype} [{r}]")
        big = torch.zeros(n * WORLD, dtype=dtype)
        w = dist.all_gather_into_tensor(big, value(RANK, n, dtype), async_op=True)
        w.wait()
        expect_equal(big, torch.cat(every).to(dtype), f"all_gather_into_tensor {dtype}")
        # reduce_scatter: a list of inputs, and one tensor
        out = torch.zeros(n // WORLD, dtype=dtype)
        ins = list(value(RANK, n, dtype).chunk(WORLD))
        dist.reduce_scatter(out, ins)
        expect_equal(out, sum(every).to(dtype).chunk(WORLD)[RANK], f"reduce_scatter {dtype}")
        ins = [value(RANK, n // WORLD, dtype) + i for i in range(WORLD)]  # not back to back
        dist.reduce_scatter(out, ins)
        want = sum(value(r, n // WORLD, torch.float64) + RANK for r in range(WORLD))
        expect_equal(out, want.to(dtype), f"reduce_scatter (separate inputs) {dtype}")
        out = torch.zeros(n // WORLD, dtype=dtype)
        dist.reduce_scatter_tensor(out, value(RANK, n, dtype))
        expect_equal(out, sum(every).to(dtype).chunk(WORLD)[RANK], f"reduce_scatter_tensor {dtype}")
        # reduce to rank 0
        t = value(RANK, n, dtype)
        dist.reduce(t, dst=0)
        if RANK == 0:
            expect_equal(t, sum(every).to(dtype), f"reduce {dtype}")
        checked += 6
    if hasattr(dist.ReduceOp, "factor"):
        # PREMUL_SUM: each input scaled, then summed.
        t = value(RANK, n, torch.float32)
        dist.all_reduce(t, op=dist._make_nccl_premul_sum(2.0))
        expect_equal(t, (2 * sum(every)).to(torch.float32), "all_reduce PREMUL_SUM")
        # PREMUL_SUM to a root leaves the other ranks' tensors as they were.
        t = value(RANK, n, torch.float32)
        dist.reduce(t, dst=0, op=dist._make_nccl_premul_sum(3.0))
        mine = value(RANK, n, torch.float32)
        expect_equal(t, (3 * sum(every)).to(torch.float32) if RANK == 0 else mine, "reduce PREMUL_SUM")
    else:
        # Before torch 2.13 a backend in Python never sees the factor: refused on every rank
        # alike, and the group goes on.
        try:
            dist.all_reduce(value(RANK, n, torch.float32), op=dist._make_nccl_premul_sum(2.0))
            raise AssertionError("PREMUL_SUM without its factor was not refused")
        except NotImplementedError as e:
            assert "needs torch 2.13" in str(e), e
    # Futures complete with the tensors.
    t = value(RANK, n, torch.float32)
    fut = dist.all_reduce(t, async_op=True).get_future()
    got = fut.wait()
    expect_equal(got[0], sum(every).to(torch.float32), "all_reduce future")
    dist.barrier()
    # The bitwise ops, on the integer types.
    bits = [torch.tensor([0b1100, 0b1010, 7, 255], dtype=torch.int64) + r for r in range(WORLD)]
    for op, fold in ((dist.ReduceOp.BAND, torch.bitwise_and), (dist.ReduceOp.BOR, torch.bitwise_or),
                     (dist.ReduceOp.BXOR, torch.bitwise_xor)):
        for dtype in (torch.int32, torch.int64, torch.uint8):
            want = bits[0].to(dtype)
            for b in bits[1:]:
                want = fold(want, b.to(dtype))
            t = bits[RANK].to(dtype).clone()  # .to() of the same dtype is the tensor itself
            dist.all_reduce(t, op=op)
            expect_equal(t, want, f"all_reduce {op} {dtype}")
            checked += 1
    dist.destroy_process_group()
    result(checked=checked)


def scenario_alltoall(backend):
    """all_to_all_single (even, uneven with zeros, rows of several elements), all_to_all (list
    form, back to back and separate tensors), gather and scatter from every root; every value
    says which rank sent it to which."""
    init(backend)
    n = WORLD
    checked = 0

    def block(src, dst, k, dtype=torch.float32, row=1):
        return (torch.arange(k * row, dtype=torch.float64) + 1000 * src + 10 * dst).to(dtype)

    for dtype in (torch.float32, torch.int64, torch.bfloat16, torch.uint8):
        # Even: 3 elements a block, no split sizes.
        inp = torch.cat([block(RANK, j, 3, dtype) for j in range(n)])
        out = torch.zeros(3 * n, dtype=dtype)
        dist.all_to_all_single(out, inp)
        expect_equal(out, torch.cat([block(k, RANK, 3, dtype) for k in range(n)]), f"all_to_all_single {dtype}")
        checked += 1
    # Uneven, zeros included: rank i sends rank j (i + 2j) % 3 rows of 2 elements.
    rows = [[(i + 2 * j) % 3 for j in range(n)] for i in range(n)]
    send_rows, recv_rows = rows[RANK], [rows[k][RANK] for k in range(n)]
    inp = torch.cat([block(RANK, j, rows[RANK][j], row=2) for j in range(n)]).reshape(-1, 2)
    out = torch.full((sum(recv_rows), 2), -1.0)
    w = dist.all_to_all_single(out, inp, recv_rows, send_rows, async_op=True)
    w.wait()
    want = torch.cat([block(k, RANK, rows[k][RANK], row=2) for k in range(n)]).reshape(-1, 2)
    expect_equal(out, want, "all_to_all_single uneven")
    # Split sizes on one side only: equal blocks of rows on the other.
    inp = torch.cat([block(RANK, j, 2, row=2) for j in range(n)]).reshape(-1, 2)
    out = torch.zeros(2 * n, 2)
    dist.all_to_all_single(out, inp, [2] * n, None)
    expect_equal(out, torch.cat([block(k, RANK, 2, row=2) for k in range(n)]).reshape(-1, 2),
                 "all_to_all_single with output split sizes only")
    checked += 2
    # The list form: separate tensors of different sizes, then views of one tensor.
    ins = [block(RANK, j, rows[RANK][j], torch.int32) for j in range(n)]
    outs = [torch.full((rows[k][RANK],), -1, dtype=torch.int32) for k in range(n)]
    dist.all_to_all(outs, ins)
    for k in range(n):
        expect_equal(outs[k], block(k, RANK, rows[k][RANK], torch.int32), f"all_to_all [{k}]")
    whole_in = torch.cat([block(RANK, j, rows[RANK][j]) for j in range(n)])
    whole_out = torch.zeros(sum(recv_rows))
    outs = list(whole_out.split(recv_rows))
    fut = dist.all_to_all(outs, list(whole_in.split(send_rows)), async_op=True).get_future()
    fut.wait()
    expect_equal(whole_out, torch.cat([block(k, RANK, rows[k][RANK]) for k in range(n)]), "all_to_all (views)")
    checked += 2
    # gather and scatter, every root; the gather list separate tensors or views of one.
    for root in range(n):
        mine = block(RANK, root, 4, torch.float64)
        gl = None
        if RANK == root:
            gl = [torch.zeros(4, dtype=torch.float64) for _ in range(n)] if root % 2 else \
                list(torch.zeros(4 * n, dtype=torch.float64).chunk(n))
        dist.gather(mine, gl, dst=root)
        if RANK == root:
            for k in range(n):
                expect_equal(gl[k], block(k, root, 4, torch.float64), f"gather to {root} [{k}]")
        sl = None
        if RANK == root:
            sl = [block(root, k, 3, torch.int64) for k in range(n)] if root % 2 else \
                list(torch.cat([block(root, k, 3, torch.int64) for k in range(n)]).chunk(n))
        out = torch.zeros(3, dtype=torch.int64)
        w = dist.scatter(out, sl, src=root, async_op=True)
        w.wait()
        expect_equal(out, block(root, RANK, 3, torch.int64), f"scatter from {root}")
        checked += 2
    dist.destroy_process_group()
    result(checked=checked)


def scenario_p2p(backend):
    """dist.send / dist.recv pairs, and batch_isend_irecv rings of 1 MiB where every rank posts
    its send first; held operations run by a wait, by a collective, by shutdown; refused tags
    and receives from any source."""
    init(backend)
    n = WORLD
    nxt, prev = (RANK + 1) % n, (RANK - 1) % n
    checked = 0

    def mine(rank, k, dtype=torch.float32):
        return (torch.arange(k, dtype=torch.float64) % 1000 + 1000 * rank).to(dtype)

    # Blocking pairs: rank 0 with every other rank, both ways.
    for dtype in (torch.float32, torch.int64, torch.bfloat16):
        if RANK == 0:
            for k in range(1, n):
                dist.send(mine(0, 7, dtype), dst=k)
                got = torch.zeros(7, dtype=dtype)
                assert dist.recv(got, src=k) == k
                expect_equal(got, mine(k, 7, dtype), f"recv {dtype} from {k}")
                checked += 1
        else:
            got = torch.zeros(7, dtype=dtype)
            dist.recv(got, src=0)
            expect_equal(got, mine(0, 7, dtype), f"recv {dtype} from 0")
            dist.send(mine(RANK, 7, dtype), dst=0)
            checked += 1
    # A ring: every rank sends first, 1 MiB, more than a socket buffer.
    size = 256 * 1024
    for order in ("send first", "recv first"):
        out, got = mine(RANK, size), torch.zeros(size)
        ops = [dist.P2POp(dist.isend, out, nxt), dist.P2POp(dist.irecv, got, prev)]
        works = dist.batch_isend_irecv(ops if order == "send first" else ops[::-1])
        for w in works:
            w.wait()
        expect_equal(got, mine(prev, size), f"batch_isend_irecv ring, {order}")
        checked += 1
    # isend then irecv, waiting only on the receive; then held operations run by a collective.
    out, got = mine(RANK, 100, torch.int32), torch.zeros(100, dtype=torch.int32)
    s = dist.isend(out, nxt)
    dist.irecv(got, prev).wait()
    expect_equal(got, mine(prev, 100, torch.int32), "isend, irecv, wait on the receive")
    s.wait()  # ran already, with the receive
    got = torch.zeros(100, dtype=torch.int32)
    s, r = dist.isend(out, nxt), dist.irecv(got, prev)
    total = torch.ones(1)
    dist.all_reduce(total)
    assert total.item() == n
    expect_equal(got, mine(prev, 100, torch.int32), "held operations run by a collective")
    s.wait(), r.wait()
    checked += 2
    # Refused: a tag, a receive from any source; the group goes on.
    refused = {}
    try:
        dist.send(torch.zeros(1), dst=nxt, tag=3)
    except Exception as e:  # noqa: BLE001
        refused["tag"] = str(e)
    try:
        dist.recv(torch.zeros(1))
    except Exception as e:  # noqa: BLE001
        refused["anysource"] = str(e)
    dist.barrier()
    # Held until the group is destroyed: shutdown runs them (the peer's are run the same way).
    dist.isend(mine(RANK, 5), nxt)
    dist.irecv(torch.zeros(5), prev)
    dist.destroy_process_group()
    result(checked=checked, refused=refused)


def scenario_alltoall_reject(backend):
    """Split sizes that do not add up to the tensor: the rank is refused, the others released."""
    init(backend)
    started = time.monotonic()
    inp = torch.zeros(2 * WORLD)
    splits = [2] * WORLD if RANK else [3] * WORLD
    try:
        dist.all_to_all_single(torch.zeros(2 * WORLD), inp, [2] * WORLD, splits)
    except Exception as e:  # noqa: BLE001
        result(error=str(e), seconds=time.monotonic() - started)
        os._exit(0)
    raise AssertionError("an all_to_all_single with wrong split sizes succeeded")


def mlp(seed, width):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(32, width), torch.nn.ReLU(), torch.nn.Linear(width, width), torch.nn.ReLU(),
        torch.nn.Linear(width, 4),
    )


def digest(params):
    h = hashlib.sha256()
    for p in params:
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def batches(steps, seed):
    g = torch.Generator().manual_seed(seed * 1000 + RANK)
    return [(torch.randn(16, 32, generator=g), torch.randn(16, 4, generator=g)) for _ in range(steps)]


def scenario_ddp(backend):
    init(backend, os.environ.get("TEST_INIT", "env"))
    model = torch.nn.parallel.DistributedDataParallel(mlp(7, 64), bucket_cap_mb=0.01)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for x, y in batches(20, 3):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    dist.destroy_process_group()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    result(digest=digest(model.parameters()), params=flat.tolist())


def scenario_fsdp(backend):
    from torch.distributed.fsdp import fully_shard

    init(backend)
    model = mlp(11, 32)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for x, y in batches(10, 5):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    full = [p.full_tensor() for p in model.parameters()]
    dist.destroy_process_group()
    result(digest=digest(full), sharded=type(next(model.parameters())).__name__)


def scenario_kill(backend):
    init(backend)
    model = torch.nn.parallel.DistributedDataParallel(mlp(7, 64))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    started = None
    try:
        for step, (x, y) in enumerate(batches(1000, 3)):
            if step == 5 and RANK == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            if step == 5:
                started = time.monotonic()
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    except Exception as e:  # noqa: BLE001
        result(error=str(e), seconds=time.monotonic() - started)
        os._exit(0)
    raise AssertionError("training went on without rank 1")


def scenario_mismatch(backend):
    init(backend)
    t = torch.ones(4 + RANK)
    try:
        dist.all_reduce(t)
    except Exception as e:  # noqa: BLE001
        result(error=str(e))
        os._exit(0)
    raise AssertionError("a mismatched all_reduce succeeded")


def scenario_bad_input(backend):
    init(backend)
    t = torch.ones(4, dtype=torch.bool if RANK == 0 else torch.float32)
    started = time.monotonic()
    try:
        dist.all_reduce(t)
    except Exception as e:  # noqa: BLE001
        result(error=str(e), seconds=time.monotonic() - started)
        os._exit(0)
    raise AssertionError("an all_reduce of complex64 succeeded")


def scenario_new_group(backend):
    init(backend)
    group = dist.new_group([0, 1])
    if RANK in (0, 1):
        t = torch.full((8,), float(RANK + 1))
        dist.all_reduce(t, group=group)
        got = t.tolist()
    else:
        got = None
    t = torch.full((3,), float(RANK))
    dist.all_reduce(t)  # the default group still works, with the third rank
    dist.destroy_process_group()
    result(group=got, world=t.tolist())


def scenario_nested(backend):
    """A future's callback that issues a collective and waits for its future (PowerSGD's DDP
    hook does): it must not wait for itself."""
    init(backend)

    def then(fut):
        u = torch.ones(4)
        dist.all_reduce(u, async_op=True).get_future().wait()
        return fut.value()[0] + u

    t = torch.ones(4)
    got = dist.all_reduce(t, async_op=True).get_future().then(then).wait()
    dist.destroy_process_group()
    result(value=got.tolist())


def scenario_reject(backend):
    """A rank whose arguments the backend itself rejects releases the others at once."""
    init(backend)
    started = time.monotonic()
    inputs = [torch.ones(4) for _ in range(WORLD + (1 if RANK == 0 else 0))]
    try:
        dist.reduce_scatter(torch.zeros(4), inputs)
    except Exception as e:  # noqa: BLE001
        result(error=str(e), seconds=time.monotonic() - started)
        os._exit(0)
    raise AssertionError("a reduce_scatter with a wrong count of inputs succeeded")


def scenario_reinit(backend):
    """init / all_reduce / destroy, three times over one store, rank 0 starting late."""
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), WORLD, RANK == 0,
                          timeout=TIMEOUT)
    sums = []
    for _ in range(3):
        if RANK == 0:
            time.sleep(1)
        dist.init_process_group(backend, store=store, rank=RANK, world_size=WORLD, timeout=TIMEOUT)
        t = torch.full((3,), float(RANK + 1))
        dist.all_reduce(t)
        sums.append(t.tolist())
        dist.destroy_process_group()
    result(sums=sums)


def scenario_mixed(backend):
    """ "cpu:tutti,cuda:nccl": CPU tensors go to tutti."""
    # NCCL needs a GPU to be made at all; gloo stands in for it on a host without one.
    init("cpu:tutti,cuda:nccl" if torch.cuda.is_available() else "cpu:tutti,cuda:gloo")
    t = torch.full((5,), float(RANK + 1))
    dist.all_reduce(t)
    name = dist.get_backend()
    dist.destroy_process_group()
    result(value=t.tolist(), backend=name)


if __name__ == "__main__":
    globals()["scenario_" + sys.argv[1]](sys.argv[2])
    # The scenario printed its result and destroyed its group: leave without the
    # interpreter's teardown, where torch's own static destructors have been seen to abort
    # ("terminate called without an active exception") after the result, once in many runs.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
