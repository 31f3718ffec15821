#!/usr/bin/env python3
"""DDP step times over the torch.distributed backends "tutti" and "gloo", and the same step with
no communication, interleaved in one run (this machine is shared and noisy).

    python scripts/ddp_bench.py                      # 2 processes, the 4.3 M and 19.7 M MLPs
    python scripts/ddp_bench.py --rounds 5 --steps 10 --sizes 19.7M
    python scripts/ddp_bench.py --profile            # plus a profile of one tutti step
    python scripts/ddp_bench.py --bucket-view        # DDP(gradient_as_bucket_view=True)

Each process runs with one thread (torch.set_num_threads(1)) and a batch of 32. Both process
groups live in the same processes (the default group is tutti's, gloo's is a new_group), and
the three variants of the step take turns in blocks of --steps steps, --rounds times, in a
rotating order. Prints each variant's median step time and the ratios; needs torch and the
tutti package (pip install ./bindings/python).
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

# Layer widths of the two MLPs of the PyTorch issue: 4.3 M and 19.7 M parameters.
MODELS = {
    "4.3M": [1024, 2048, 1024, 128],
    "19.7M": [2048, 4224, 2560, 128],
}


def worker(args):
    import torch
    import torch.distributed as dist

    import tutti.torch  # noqa: F401 - registers "tutti"

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group("tutti")
    gloo = dist.new_group(backend="gloo")
    out = {}
    for size in args.sizes.split(","):
        widths = MODELS[size]

        def build():
            torch.manual_seed(0)
            layers = []
            for a, b in zip(widths, widths[1:]):
                layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
            return torch.nn.Sequential(*layers[:-1])

        variants = {
            "none": build(),
            "tutti": torch.nn.parallel.DistributedDataParallel(build(), gradient_as_bucket_view=args.bucket_view),
            "gloo": torch.nn.parallel.DistributedDataParallel(
                build(), process_group=gloo, gradient_as_bucket_view=args.bucket_view
            ),
        }
        params = sum(p.numel() for p in variants["none"].parameters())
        opts = {k: torch.optim.SGD(m.parameters(), lr=1e-4) for k, m in variants.items()}
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(32, widths[0], generator=g)
        y = torch.randn(32, widths[-1], generator=g)

        def step(name):
            opts[name].zero_grad(set_to_none=False)
            torch.nn.functional.mse_loss(variants[name](x), y).backward()
            opts[name].step()

        for name in variants:  # warm up: buckets built, buffers allocated
            for _ in range(3):
                step(name)
        times = {k: [] for k in variants}
        order = list(variants)
        for r in range(args.rounds):
            for name in order[r % 3:] + order[: r % 3]:
                dist.barrier(group=gloo)
                for _ in range(args.steps):
                    t0 = time.perf_counter()
                    step(name)
                    times[name].append(time.perf_counter() - t0)
        out[size] = {"params": params, "ms": {k: 1000 * statistics.median(v) for k, v in times.items()},
                     "spread_ms": {k: [1000 * min(v), 1000 * max(v)] for k, v in times.items()}}
        if args.profile and size == args.sizes.split(",")[-1]:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU]) as prof:
                step("tutti")
            if rank == 0:
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12), file=sys.stderr)
    dist.destroy_process_group()
    if rank == 0:
        print("RESULT " + json.dumps(out), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="4.3M,19.7M", help="which MLPs: 4.3M, 19.7M (comma-separated)")
    p.add_argument("--steps", type=int, default=10, help="steps per block")
    p.add_argument("--rounds", type=int, default=3, help="blocks per variant")
    p.add_argument("--profile", action="store_true", help="profile one tutti step of the last size")
    p.add_argument("--bucket-view", action="store_true",
                   help="DDP(gradient_as_bucket_view=True): gradients live in DDP's buckets, no copies")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        cmd = [sys.executable, __file__, "--worker", "--sizes", args.sizes, "--steps", str(args.steps),
               "--rounds", str(args.rounds)] + (["--profile"] if args.profile else []) \
            + (["--bucket-view"] if args.bucket_view else [])
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True))
    outs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        sys.exit("a rank failed: " + " ".join(str(p.returncode) for p in procs))
    result = json.loads(next(l for l in outs[0].splitlines() if l.startswith("RESULT "))[7:])
    print(f"{'model':>8} {'params':>11} {'none ms':>9} {'gloo ms':>9} {'tutti ms':>9} "
          f"{'tutti/none':>11} {'gloo/tutti':>11}")
    for size, r in result.items():
        ms = r["ms"]
        print(f"{size:>8} {r['params']:>11,} {ms['none']:>9.1f} {ms['gloo']:>9.1f} {ms['tutti']:>9.1f} "
              f"{ms['tutti'] / ms['none']:>10.2f}x {ms['gloo'] / ms['tutti']:>10.2f}x")


if __name__ == "__main__":
    main()
