"""The guides' custom training loop under tutti.distribute: the Rust example's linear regression
(examples/train.rs: the same data, steps and learning rate), written as TensorFlow's
distributed-training guide writes it: a strategy, variables made under its scope, a distributed
dataset, a step run on every replica, gradients summed by the optimizer, a loss reduced across
replicas, a metric read across them, and checkpoints.

    python bindings/python/examples/train.py --strategy mirrored --replicas 4 --steps 100 --json
    tutti launch -n 2 -- python bindings/python/examples/train.py --strategy multi-worker --json
    tutti launch --workers 2 --ps 1 -- python bindings/python/examples/train.py --strategy parameter-server --json
    TUTTI_PJRT_PLUGIN=.../xla_cpu_pjrt.so TUTTI_PJRT_OPTIONS=cpu_device_count=4 \
        python bindings/python/examples/train.py --strategy tpu --json
    TUTTI_PJRT_PLUGIN=.../xla_cpu_pjrt.so \
        python bindings/python/examples/train.py --strategy mirrored --device xla --replicas 4 --json
    python bindings/python/examples/train.py --steps 50 --checkpoint-dir /tmp/ck
    python bindings/python/examples/train.py --steps 50 --checkpoint-dir /tmp/ck --resume

With ``--json`` the last line is the Rust example's: ``{"strategy", "replicas", "steps",
"loss", "weights", "reference_weights", "device", "restored_step"}``; the weights are those
of ``cargo run --example train`` with the same flags, to float rounding (under
``parameter-server``, whose workers step the variables asynchronously, near the full batch's, as
the Rust example's are).

``tpu`` is TPUStrategy over every device of the PJRT plugin found (a TPU host's, or the CPU
plugin's), set up as the guides do (a ``TPUClusterResolver``, ``initialize_tpu_system``);
``--replicas`` does not apply. ``parameter-server`` runs as every task of a TF_CONFIG job: the
workers and ps tasks serve, and the chief's ``ClusterCoordinator`` schedules, for each step, one
function per worker on its share of the batch (the Rust example's shares, in turn), whose
optimizer steps the variables on the ps tasks.
"""

import argparse
import json

import numpy as np

import tutti.distribute as td

SAMPLES, FEATURES, LR = 96, 6, 0.1


def data():
    """The Rust example's data set: rows of features then target, y = x.w + b +
    noise, from the same xorshift generator, summed in the same order in f32."""
    seed = 0x9E3779B97F4A7C15
    mask = (1 << 64) - 1

    def next_value():
        nonlocal seed
        seed ^= (seed << 13) & mask
        seed ^= seed >> 7
        seed ^= (seed << 17) & mask
        return np.float32(seed >> 40) / np.float32(1 << 24) * np.float32(2.0) - np.float32(1.0)

    w_true = [np.float32(0.5 + i * 0.25) for i in range(FEATURES)]
    rows = []
    for _ in range(SAMPLES):
        x = [next_value() for _ in range(FEATURES)]
        y = np.float32(0.0)
        for a, b in zip(x, w_true):
            y = np.float32(y + a * b)
        y = np.float32(y - np.float32(0.75) + np.float32(0.01) * next_value())
        rows.append(x + [y])
    return np.array(rows, np.float32)


def reference(steps, rows):
    """Single-device training on the full batch, as the Rust example's reference."""
    w = np.zeros(FEATURES + 1, np.float32)
    for _ in range(steps):
        x, y = rows[:, :FEATURES], rows[:, FEATURES]
        err = x @ w[:FEATURES] + w[FEATURES] - y
        g = np.concatenate([2 * x.T @ err, [2 * err.sum()]]).astype(np.float32)
        w -= np.float32(LR) * g / np.float32(SAMPLES)
    return w


def tpu_strategy():
    """TPUStrategy as the guides set it up, over the PJRT plugin's devices."""
    resolver = td.cluster_resolver.TPUClusterResolver(tpu="")
    td.tpu.experimental.initialize_tpu_system(resolver)
    return td.TPUStrategy(resolver)


def make_strategy(name, replicas, device="cpu"):
    devices = [f"{device}:{i}" for i in range(replicas)]
    return {
        "default": lambda: td.get_strategy(),
        "one-device": lambda: td.OneDeviceStrategy(devices[0]),
        "mirrored": lambda: td.MirroredStrategy(devices),
        "central-storage": lambda: td.CentralStorageStrategy(devices),
        "multi-worker": lambda: td.MultiWorkerMirroredStrategy(devices=None if device == "cpu" else devices),
        "tpu": tpu_strategy,
        "parameter-server": lambda: td.ParameterServerStrategy(td.cluster_resolver.TFConfigClusterResolver()),
    }[name]()


def share(n, parts, i):
    """Rows of the i-th of ``parts`` shares of ``n`` (the Rust example's ``tutti::partition``)."""
    base, extra = divmod(n, parts)
    start = i * base + min(i, extra)
    return slice(start, start + base + (1 if i < extra else 0))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--strategy", default="mirrored",
                   choices=["default", "one-device", "mirrored", "central-storage", "multi-worker", "tpu",
                            "parameter-server"])
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--device", default="cpu", choices=["cpu", "xla"],
                   help="the replicas' devices (xla: a libtutti built with xla and a PJRT plugin)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--checkpoint-dir")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.resume and not args.checkpoint_dir:
        p.error("--resume needs --checkpoint-dir")

    if args.strategy == "parameter-server":
        resolver = td.cluster_resolver.TFConfigClusterResolver()
        if resolver.task_type in ("worker", "ps"):
            # Workers run the functions the chief schedules; ps tasks hold the variables.
            td.Server(resolver.cluster_spec(), job_name=resolver.task_type, task_index=resolver.task_id,
                      start=True).join()
            return
    if args.device == "xla" and args.strategy in ("default", "parameter-server"):
        p.error(f"--device xla: --strategy {args.strategy} keeps its variables in host memory; on XLA devices "
                "run mirrored, one-device, central-storage, multi-worker or tpu")
    strategy = make_strategy(args.strategy, args.replicas, args.device)
    rows = data()
    with strategy.scope():
        weights = td.Variable(np.zeros(FEATURES, np.float32), name="weights")
        bias = td.Variable(np.zeros((), np.float32), name="bias")
        optimizer = td.optimizers.SGD(LR)
        mse = td.metrics.Mean()
        step_count = np.zeros((), np.int64)
        ckpt = td.Checkpoint(weights=weights, bias=bias, step=step_count)
        manager = td.CheckpointManager(ckpt, args.checkpoint_dir, max_to_keep=3) if args.checkpoint_dir else None
        restored = manager.restore_or_initialize() if (manager and args.resume) else None
        if args.resume and restored is None:
            raise SystemExit(f"train.py: --resume: no checkpoint in {args.checkpoint_dir}")
        # The whole data set is the global batch, split across every replica in sync (under
        # parameter-server, across the workers' scheduled functions below).
        ps = args.strategy == "parameter-server"
        dataset = [] if ps else strategy.experimental_distribute_dataset([(rows[:, :FEATURES], rows[:, FEATURES])])

        def train_step(batch):
            x, y = batch
            err = x @ weights.numpy() + bias.numpy() - y
            mse.update_state(err * err)
            loss = td.compute_average_loss(err * err, global_batch_size=SAMPLES)
            optimizer.apply_gradients([
                (2 * x.T @ err / np.float32(SAMPLES), weights),
                (np.float32(2 * err.sum() / SAMPLES), bias),
            ])
            return loss

        loss = 0.0
        if ps:
            coordinator = td.coordinator.ClusterCoordinator(strategy)
            workers = strategy.num_workers

            def shard_step(k):
                # The step's share k of the batch; the learning rate applies per share, as the
                # Rust example's workers step.
                part = rows[share(SAMPLES, workers, k)]
                x, y, n = part[:, :FEATURES], part[:, FEATURES], np.float32(max(len(part), 1))
                err = x @ weights.numpy() + bias.numpy() - y
                optimizer.apply_gradients([(2 * x.T @ err / n, weights), (np.float32(2 * err.sum() / n), bias)])
                return np.float32((err * err).sum() / n)

            values = []
            for _ in range(args.steps):
                values += [coordinator.schedule(shard_step, args=(k,)) for k in range(workers)]
                step_count += 1
            coordinator.join()
            for v in values:
                mse.update_state(v.fetch())
            loss = float(values[-1].fetch()) if values else 0.0
        for _ in range(0 if ps else args.steps):
            for batch in dataset:
                per_replica = strategy.run(train_step, args=(batch,))
                loss = float(strategy.reduce("SUM", per_replica, axis=None))
            step_count += 1
        if manager:
            manager.save(checkpoint_number=int(step_count))

    w = np.concatenate([weights.numpy(), [bias.numpy()]])
    ref = reference(int(step_count), rows)
    if args.json:
        print(json.dumps({
            "strategy": args.strategy, "replicas": strategy.num_workers if ps else strategy.num_replicas_in_sync,
            "steps": args.steps,
            "loss": loss, "weights": w.tolist(), "reference_weights": ref.tolist(),
            "device": "xla" if args.strategy == "tpu" else args.device, "restored_step": restored,
            "mse": float(mse.result()),
        }))
    else:
        replicas = strategy.num_workers if ps else strategy.num_replicas_in_sync
        print(f"{args.strategy} with {replicas} replicas, {args.steps} steps: loss {loss:.6f}")
        print("weights  ", w.tolist())
        print("reference", ref.tolist())


if __name__ == "__main__":
    main()
