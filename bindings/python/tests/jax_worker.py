"""One rank of a tutti.jax scenario (test_jax.py starts them as torchrun would: RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Prints ``RESULT <json>`` at the end."""

import json
import os
import sys

# One GPU per process where the test asks (before JAX or libtutti look at the GPUs).
if os.environ.get("TEST_GPU_PER_RANK"):
    os.environ["CUDA_VISIBLE_DEVICES"] = os.environ["LOCAL_RANK"]

import numpy as np

import jax
import jax.numpy as jnp

import tutti.jax as tj


def collectives():
    comm = tj.default_comm()
    r, p = comm.rank, comm.world_size
    out = {}
    for dtype in ["float32", "int32", "bfloat16", "float64"]:
        if dtype == "float64" and not jax.config.jax_enable_x64:
            continue
        x = (jnp.arange(6) + 10 * r).astype(dtype).reshape(2, 3)

        @jax.jit
        def f(x):
            return (tj.all_reduce(x, op="sum"), tj.all_reduce(x, op="max"), tj.all_gather(x),
                    tj.reduce_scatter(jnp.concatenate([x] * p), op="sum"),
                    tj.broadcast(x + 1, root=p - 1))

        out[dtype] = [np.asarray(v, np.float64).tolist() for v in f(x)]
    return out


def ordered():
    """Independent collectives of one program, and one whose result is unused: XLA keeps each
    and runs them in program order. Rank 0 runs them jitted, the others eagerly: a dropped or
    reordered call would be a mismatch between the ranks."""
    comm = tj.default_comm()
    r = comm.rank
    a, b = jnp.full(3, r + 1.0), jnp.arange(5) + r

    def program(a, b):
        tj.all_reduce(a * 100)  # unused
        s = tj.all_reduce(a)
        g = tj.all_gather(b)
        m = tj.all_reduce(b, op="min")
        return s, g, m

    run = jax.jit(program) if r == 0 else program
    s, g, m = run(a, b)
    return [np.asarray(v).tolist() for v in (s, g, m)]


def grad():
    comm = tj.default_comm()
    x = jnp.arange(3.0) * (comm.rank + 1)
    g = jax.jit(jax.grad(lambda v: (tj.all_reduce(v) ** 2).sum()))(x)
    return np.asarray(g).tolist()


def vmapped():
    comm = tj.default_comm()
    r = comm.rank
    x = jnp.arange(3.0)[None, :] + 10.0 * jnp.arange(2.0)[:, None] + 100 * r
    gathered = jax.jit(jax.vmap(tj.all_gather))(x)
    y = (jnp.arange(4.0)[None, :] + jnp.arange(2.0)[:, None]) * (r + 1)
    scattered = jax.jit(jax.vmap(tj.reduce_scatter))(y)
    return [np.asarray(gathered).tolist(), np.asarray(scattered).tolist()]


def train():
    """Data-parallel least squares: each rank its shard of the batch, gradients averaged
    across ranks inside the jitted step."""
    comm = tj.default_comm()
    r, p = comm.rank, comm.world_size
    rng = np.random.default_rng(0)
    X = rng.standard_normal((64, 4)).astype(np.float32)
    y = X @ np.array([1.0, -2.0, 3.0, 0.5], np.float32)
    shard = slice(r * 64 // p, (r + 1) * 64 // p)
    Xs, ys = jnp.asarray(X[shard]), jnp.asarray(y[shard])

    @jax.jit
    def step(w):
        g = jax.grad(lambda w: ((Xs @ w - ys) ** 2).mean())(w)
        return w - 0.1 * tj.all_reduce(g, op="mean")

    w = jnp.zeros(4, jnp.float32)
    for _ in range(50):
        w = step(w)
    return np.asarray(w).tolist()


def mismatch():
    comm = tj.default_comm()
    x = jnp.ones(4 + comm.rank, jnp.float32)
    try:
        jax.jit(lambda v: tj.all_reduce(v))(x).block_until_ready()
    except Exception as e:  # noqa: BLE001 - JAX's runtime error carries tutti's message
        return str(e)
    return "no error"


def closed():
    """A function jitted for a communicator that was then closed fails, saying so, even once
    another communicator may sit at its address."""
    import tutti

    c = tutti.local_group(1)[0]
    f = jax.jit(lambda x: tj.all_reduce(x, comm=c))
    first = np.asarray(f(jnp.ones(3))).tolist()
    c.close()
    others = [tutti.local_group(1)[0] for _ in range(4)]
    try:
        f(jnp.ones(3)).block_until_ready()
        error = None
    except Exception as e:  # noqa: BLE001 - JAX's runtime error carries the glue's message
        error = str(e)
    again = np.asarray(jax.jit(lambda x: tj.all_reduce(x, comm=others[0]))(jnp.ones(2))).tolist()
    return {"first": first, "error": error, "again": again}


def loop():
    """100 jitted steps, each running the four collectives on the last step's result: every
    step's values are right, and memory and open handles do not grow with the steps."""
    comm = tj.default_comm()
    r, p = comm.rank, comm.world_size

    @jax.jit
    def step(v):
        s = tj.all_reduce(v) / p  # the mean of the ranks' values
        g = tj.all_gather(v[:2])
        b = tj.broadcast(v[:2], root=p - 1)
        rs = tj.reduce_scatter(jnp.tile(v[:2], p))
        return s + 1.0, g.sum() + b.sum() + rs.sum()

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def fds():
        return len(os.listdir("/proc/self/fd"))

    v = jnp.zeros(1 << 16, jnp.float32) + r
    sizes, handles, wrong = [], [], 0
    for k in range(100):
        v, side = step(v)
        # The input of step k: r on rank r at k = 0, then c = (p - 1) / 2 + k on every rank.
        if k == 0:
            side_want = 2 * p * (p - 1) + 2 * (p - 1)
        else:
            c = (p - 1) / 2 + k
            side_want = (4 * p + 2) * c
        if abs(float(v[0]) - ((p - 1) / 2 + k + 1)) > 1e-3 or abs(float(side) - side_want) > 1e-2:
            wrong += 1
        if k in (20, 99):
            sizes.append(rss())
            handles.append(fds())
    return {"wrong": wrong, "rss_growth": sizes[1] - sizes[0], "fd_growth": handles[1] - handles[0],
            "last": float(v[-1])}


def gpu():
    """On JAX's CUDA platform, over the job's cuda:0 communicator: each collective reads what
    the program's kernels wrote just before it on XLA's stream, and the kernels after it read
    its result (16 MiB, long enough that an unordered read would see memory not yet written)."""
    import tutti

    try:
        if not jax.devices("cuda"):
            raise RuntimeError("no CUDA device")
    except Exception as e:  # noqa: BLE001 - JAX says so by RuntimeError or AssertionError
        return {"skip": f"JAX has no CUDA GPU: {e}"}
    if not any(d.kind == "gpu" for d in tutti.devices()):
        return {"skip": "this libtutti sees no GPU (a build without --features cuda?)"}
    comm = tj.default_comm()
    r, p = comm.rank, comm.world_size
    n = 1 << 22
    x = jnp.arange(n, dtype=jnp.float32) / n

    @jax.jit
    def collectives(x):
        y = jnp.sin(x) * 2 + r
        head = y[:8]
        return (tj.all_reduce(y) * 3, tj.all_reduce(y.astype(jnp.bfloat16), op="max"),
                tj.all_reduce(jnp.arange(n, dtype=jnp.int32) % 1000 - r, op="min"), tj.all_gather(head),
                tj.broadcast(head + 1, root=p - 1), tj.reduce_scatter(jnp.tile(head, p)))

    ys = [np.sin(np.arange(n, dtype=np.float32) / n).astype(np.float32) * 2 + k for k in range(p)]
    want = [sum(ys) * 3, max(ys), np.arange(n, dtype=np.int32) % 1000 - (p - 1),
            np.stack([y[:8] for y in ys]), ys[p - 1][:8] + 1, sum(y[:8] for y in ys)]
    got = [np.asarray(v) for v in collectives(x)]
    errors = [float(np.max(np.abs(g.astype(np.float64) - w.astype(np.float64)))) for g, w in zip(got, want)]
    shapes = [list(g.shape) for g in got]

    # 100 steps, each on the last one's result, its input donated (in place on the GPU).
    step = jax.jit(lambda v: tj.all_reduce(v) / p + 1, donate_argnums=0)
    v = jnp.zeros(1 << 20, jnp.float32) + r
    for _ in range(100):
        v = step(v)
    loop = np.asarray(v)
    loop_error = float(np.max(np.abs(loop - ((p - 1) / 2 + 100))))

    # A communicator on the host cannot take the GPU's buffers: said when the function is traced.
    host = tutti.local_group(1)[0]
    try:
        jax.jit(lambda v: tj.all_reduce(v, comm=host))(x).block_until_ready()
        host_error = None
    except ValueError as e:
        host_error = str(e)
    return {"device": comm.device, "errors": errors, "shapes": shapes, "loop_error": loop_error,
            "host_error": host_error}


if __name__ == "__main__":
    result = globals()[sys.argv[1]]()
    print("RESULT " + json.dumps(result), flush=True)
