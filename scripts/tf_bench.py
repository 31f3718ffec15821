"""Keras step times with tutti.tensorflow against TensorFlow's own cross-device and multi-worker
paths, on a model of 4.2 M parameters (four 1024-wide dense layers), SGD, batch 64 (``--batch``).

One process, 2 logical CPU devices under MirroredStrategy: TuttiAllReduce against
ReductionToOneDevice and HierarchicalCopyAllReduce, interleaved (each round fits every one for
the same steps, starting with the next one each round; medians over rounds):

    python scripts/tf_bench.py mirrored [--devices 2] [--rounds 8] [--steps 10] [--batch 64]

Two processes, each with a batch of 64: the same model and custom training loop with the
gradients averaged by tutti.tensorflow, by MultiWorkerMirroredStrategy (RING collectives,
TF_CONFIG on localhost), or not at all (each process on its own), as jobs run in turn, round
after round (Keras 3's model.fit under MultiWorkerMirroredStrategy fails here, so every mode
runs the same custom loop):

    python scripts/tf_bench.py processes [--rounds 3] [--steps 20] [--batch 64]
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import time

import numpy as np

WIDTH, LAYERS = 1024, 4
BATCH = 64  # per process (--batch)


def _model(keras):
    keras.utils.set_random_seed(1)
    layers = [keras.Input((WIDTH,))] + [keras.layers.Dense(WIDTH, activation="relu") for _ in range(LAYERS - 1)]
    return keras.Sequential(layers + [keras.layers.Dense(WIDTH)])


def _data(n):
    rng = np.random.default_rng(0)
    return rng.standard_normal((n, WIDTH)).astype(np.float32), rng.standard_normal((n, WIDTH)).astype(np.float32)


def _step_ms(model, x, y, steps, batch):
    """ms per step of model.fit over ``steps`` batches (after the caller's warm-up)."""
    t = time.perf_counter()
    model.fit(x[: steps * batch], y[: steps * batch], batch_size=batch, epochs=1, shuffle=False, verbose=0)
    return (time.perf_counter() - t) * 1e3 / steps


def mirrored(a):
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * a.devices)
    import keras
    import tutti.tensorflow as ttf

    devices = [f"/cpu:{i}" for i in range(a.devices)]
    kinds = {
        "TuttiAllReduce": lambda: ttf.TuttiAllReduce(),
        "TuttiAllReduce(num_packs=0)": lambda: ttf.TuttiAllReduce(num_packs=0),
        "ReductionToOneDevice": lambda: tf.distribute.ReductionToOneDevice(),
        "HierarchicalCopyAllReduce": lambda: tf.distribute.HierarchicalCopyAllReduce(),
    }
    x, y = _data(a.steps * BATCH)
    models = {}
    for name, make in kinds.items():
        strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=make())
        with strategy.scope():
            m = _model(keras)
            m.compile(optimizer=keras.optimizers.SGD(1e-4), loss="mse")
        _step_ms(m, x, y, 2, BATCH)  # trace and warm up
        models[name] = m
    params = models["TuttiAllReduce"].count_params()
    times = {name: [] for name in kinds}
    names = list(models)
    for r in range(a.rounds):
        # Each round starts with the next kind, so none always runs first.
        for name in names[r % len(names):] + names[: r % len(names)]:
            times[name].append(_step_ms(models[name], x, y, a.steps, BATCH))
    print(f"MirroredStrategy, {a.devices} logical CPU devices, {params / 1e6:.1f} M parameters, batch {BATCH}: "
          f"ms per step, median and best of {a.rounds} interleaved rounds of {a.steps} steps")
    base, best = np.median(times["TuttiAllReduce"]), min(times["TuttiAllReduce"])
    for name, t in times.items():
        rounds = " ".join(f"{v:.0f}" for v in t)
        print(f"  {name:<28} median {np.median(t):6.1f} ms (tutti / this: {base / np.median(t):.2f})  "
              f"best {min(t):6.1f} ms (tutti / this: {best / min(t):.2f})  rounds: {rounds}")


def worker(a):
    """One rank of a ``processes`` job: prints its median step time. Every mode runs the same
    custom loop (one jitted step: forward, backward, apply), the gradients averaged across the
    workers by tutti (DistributedOptimizer: one grouped all-reduce), by MultiWorkerMirroredStrategy (RING, inside
    ``apply_gradients`` in the replica context), or not at all."""
    rank = int(os.environ["RANK"])
    import tensorflow as tf

    strategy = None
    if a.mode == "mwms":
        strategy = tf.distribute.MultiWorkerMirroredStrategy(
            communication_options=tf.distribute.experimental.CommunicationOptions(
                implementation=tf.distribute.experimental.CommunicationImplementation.RING))
    import keras

    x, y = _data(BATCH)
    x, y = tf.constant(x), tf.constant(y)
    if strategy is not None:
        with strategy.scope():
            m = _model(keras)
            optimizer = keras.optimizers.SGD(1e-4)
    else:
        m = _model(keras)
        optimizer = keras.optimizers.SGD(1e-4)
    if a.mode == "tutti":
        import tutti.tensorflow as ttf

        optimizer = ttf.DistributedOptimizer(optimizer)

    def replica_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((m(xb) - yb) ** 2)
        grads = tape.gradient(loss, m.trainable_variables)
        optimizer.apply_gradients(zip(grads, m.trainable_variables))
        return loss

    @tf.function
    def step(xb, yb):
        if strategy is not None:
            return strategy.run(replica_step, args=(xb, yb))
        return replica_step(xb, yb)

    for _ in range(3):
        step(x, y)
    times = []
    for _ in range(a.steps):
        t = time.perf_counter()
        float(step(x, y) if strategy is None else strategy.experimental_local_results(step(x, y))[0])
        times.append(time.perf_counter() - t)
    if rank == 0:
        print("RESULT " + json.dumps(float(np.median(times) * 1e3)), flush=True)
    sys.stdout.flush()
    os._exit(0)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def processes(a):
    results = {"tutti": [], "mwms": [], "none": []}
    for _ in range(a.rounds):
        for mode in results:
            ports = [_free_port(), _free_port()]
            procs = []
            for rank in range(2):
                env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                           MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports[0]), TF_CPP_MIN_LOG_LEVEL="2")
                if mode == "mwms":
                    env["TF_CONFIG"] = json.dumps({
                        "cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
                        "task": {"type": "worker", "index": rank},
                    })
                procs.append(subprocess.Popen(
                    [sys.executable, __file__, "worker", "--mode", mode, "--steps", str(a.steps), "--batch", str(BATCH)],
                    env=env, stdout=subprocess.PIPE, text=True))
            outs = [p.communicate(timeout=900)[0] for p in procs]
            line = [l for l in outs[0].splitlines() if l.startswith("RESULT ")]
            if not line:
                sys.exit(f"the {mode} job failed:\n{outs[0]}")
            results[mode].append(json.loads(line[0][7:]))
    print(f"Keras across 2 processes, {WIDTH * WIDTH * LAYERS / 1e6:.1f} M parameters, batch {BATCH} per process: "
          f"median ms per step of rank 0, {a.rounds} jobs of each, {a.steps} steps each, in turn")
    tutti_ms = np.median(results["tutti"])
    names = {"tutti": "tutti DistributedOptimizer", "mwms": "MultiWorkerMirrored RING", "none": "no communication"}
    for mode, t in results.items():
        print(f"  {names[mode]:<28} {np.median(t):8.1f} ms   (this / tutti: {np.median(t) / tutti_ms:.2f})")


def main():
    global BATCH
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["mirrored", "processes", "worker"])
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--rounds", type=int, help="rounds (mirrored: 8) or jobs of each mode (processes: 3)")
    ap.add_argument("--steps", type=int, help="steps a round or job times (mirrored: 10, processes: 20)")
    ap.add_argument("--mode", choices=["tutti", "mwms", "none"], default="tutti")
    ap.add_argument("--batch", type=int, default=BATCH, help="examples per step and process")
    a = ap.parse_args()
    BATCH = a.batch
    defaults = {"mirrored": (8, 10), "processes": (3, 20), "worker": (1, 20)}[a.what]
    a.rounds = a.rounds or defaults[0]
    a.steps = a.steps or defaults[1]
    {"mirrored": mirrored, "processes": processes, "worker": worker}[a.what](a)


if __name__ == "__main__":
    main()
