"""f32 all-reduce from JAX across processes: a jitted tutti.jax.all_reduce and tutti's numpy
path, or JAX's own multi-process CPU collectives (gloo, psum under shard_map). Medians of 30
calls per size, printed by rank 0. Run each under tutti launch, in turn:

    tutti launch -n 2 -- python scripts/jax_bench.py tutti
    tutti launch -n 2 -- python scripts/jax_bench.py gloo --port 29877

On GPUs (one per process, TUTTI_DEVICE=cuda), what a jitted all-reduce costs beside a jitted
kernel over the same donated buffer, alone and with JAX's own ordered effect (an ordered
``jax.debug.callback``), per call waited for and per call in a stream of 100:

    JAX_PLATFORMS=cuda,cpu TUTTI_DEVICE=cuda tutti launch -n 1 -- python scripts/jax_bench.py gpu
"""

import argparse
import os
import time

import numpy as np

import jax
import jax.numpy as jnp

SIZES = [1 << 10, 1 << 16, 1 << 20, 1 << 24]  # bytes


def median_us(fn, x, iters=30):
    fn(x).block_until_ready()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn(x).block_until_ready()
        times.append(time.perf_counter() - t)
    return np.median(times) * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["tutti", "gloo", "gpu"])
    ap.add_argument("--port", type=int, default=29877, help="jax.distributed's coordinator port (gloo)")
    a = ap.parse_args()
    rank, world = int(os.environ["TUTTI_RANK"]), int(os.environ["TUTTI_WORLD_SIZE"])
    if a.mode == "gpu":
        import tutti.jax as tj

        comm = tj.default_comm()
        kernel = jax.jit(lambda x: x * 1.0 + 1.0, donate_argnums=0)

        def ordered_callback(x):
            # JAX's own ordered effect, for what ordering alone costs a dispatch.
            jax.debug.callback(lambda: None, ordered=True)
            return x * 1.0 + 1.0

        ordered = jax.jit(ordered_callback, donate_argnums=0)
        reduce = jax.jit(lambda x: tj.all_reduce(x), donate_argnums=0)
        for size in SIZES:
            row = []
            for fn in (kernel, ordered, reduce):
                x = fn(jnp.zeros(size // 4, jnp.float32)).block_until_ready()
                waited, streamed = [], []
                for _ in range(30):
                    t = time.perf_counter()
                    x = fn(x).block_until_ready()
                    waited.append(time.perf_counter() - t)
                for _ in range(5):
                    t = time.perf_counter()
                    for _ in range(100):
                        x = fn(x)
                    x.block_until_ready()
                    streamed.append((time.perf_counter() - t) / 100)
                row += [np.median(waited) * 1e6, np.median(streamed) * 1e6]
            if rank == 0:
                print(f"{size:>10} B  {comm.device} x{world} (waited, streamed): kernel {row[0]:6.1f} "
                      f"{row[1]:6.1f} us | kernel + ordered jax.debug.callback {row[2]:6.1f} {row[3]:6.1f} us "
                      f"| tutti.jax all_reduce {row[4]:6.1f} {row[5]:6.1f} us", flush=True)
    elif a.mode == "tutti":
        import tutti.jax as tj

        comm = tj.default_comm()
        step = jax.jit(lambda x: tj.all_reduce(x))
        # The input given up to the call (donated): the all-reduce runs in its buffer, in place.
        donated = jax.jit(lambda x: tj.all_reduce(x), donate_argnums=0)
        for size in SIZES:
            jitted = median_us(step, jnp.ones(size // 4, jnp.float32))
            x = donated(jnp.zeros(size // 4, jnp.float32)).block_until_ready()
            times = []
            for _ in range(30):
                t = time.perf_counter()
                x = donated(x).block_until_ready()
                times.append(time.perf_counter() - t)
            in_place = np.median(times) * 1e6
            host = np.ones(size // 4, np.float32)
            times = []
            for _ in range(30):
                t = time.perf_counter()
                comm.all_reduce(host)
                times.append(time.perf_counter() - t)
            if rank == 0:
                print(f"{size:>10} B  tutti.jax (jit) {jitted:9.1f} us  donated {in_place:9.1f} us  "
                      f"tutti numpy {np.median(times) * 1e6:9.1f} us", flush=True)
    else:
        from jax.experimental.shard_map import shard_map
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=f"127.0.0.1:{a.port}", num_processes=world, process_id=rank)
        mesh = Mesh(np.array(jax.devices()), ("i",))
        step = jax.jit(shard_map(lambda x: jax.lax.psum(x, "i"), mesh=mesh, in_specs=P("i"), out_specs=P("i")))
        for size in SIZES:
            x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("i")), np.ones(size // 4, np.float32))
            t = median_us(step, x)
            if rank == 0:
                print(f"{size:>10} B  JAX gloo psum {t:9.1f} us", flush=True)


if __name__ == "__main__":
    main()
