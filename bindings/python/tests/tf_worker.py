"""One process of a tutti.tensorflow scenario. test_tensorflow.py starts it: alone for the
MirroredStrategy scenarios (``TUTTI_TF_DEVICES`` logical CPU devices), or as one rank of a job
as torchrun would (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Prints ``RESULT <json>``."""

import json
import os
import sys
import time

import numpy as np

import tensorflow as tf

_devices = int(os.environ.get("TUTTI_TF_DEVICES", "1"))
if _devices > 1:
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * _devices)

import keras  # noqa: E402

import tutti  # noqa: E402
import tutti.tensorflow as ttf  # noqa: E402

ALGORITHMS = ["auto", "direct", "ring", "hierarchical-copy", "reduce-to-one", "recursive-doubling", "rabenseifner"]


def data(n=96, features=6):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((n, features)).astype(np.float32)
    y = (x @ rng.standard_normal((features, 2)) + 0.1 * rng.standard_normal((n, 2))).astype(np.float32)
    return x, y


def model(seed=3, features=6):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((features,)),
        keras.layers.Dense(16, activation="tanh"),
        keras.layers.Dense(8, activation="tanh"),
        keras.layers.Dense(2),
    ])


def weights(m):
    return [np.asarray(w, np.float64).tolist() for w in m.get_weights()]


def fit_under(cross_device_ops):
    """3 epochs of model.fit under MirroredStrategy over every logical CPU device."""
    devices = [f"/cpu:{i}" for i in range(_devices)]
    strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=cross_device_ops)
    x, y = data()
    with strategy.scope():
        m = model()
        m.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.5), loss="mse")
    m.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0)
    return weights(m)


def loop_under(cross_device_ops):
    """A custom training loop: strategy.run inside tf.function, gradients all-reduced by the
    strategy's cross-device ops. Also returns the op types of the step's graph."""
    devices = [f"/cpu:{i}" for i in range(_devices)]
    strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=cross_device_ops)
    x, y = data()
    with strategy.scope():
        m = model()
        opt = keras.optimizers.SGD(0.05)
    dataset = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)).batch(16))

    def replica_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.reduce_mean((m(xb) - yb) ** 2, axis=-1)) / 16.0
        grads = tape.gradient(loss, m.trainable_variables)
        opt.apply_gradients(zip(grads, m.trainable_variables))
        return loss

    @tf.function
    def step(xb, yb):
        losses = strategy.run(replica_step, args=(xb, yb))
        return strategy.reduce("sum", losses, axis=None)

    types = set()
    for _ in range(3):
        for xb, yb in dataset:
            step(xb, yb)
    for xb, yb in dataset:
        graph = step.get_concrete_function(xb, yb).graph
        types = {op.type for op in graph.get_operations()}
        break
    return weights(m), sorted(t for t in types if t.startswith("Tutti"))


def mirrored():
    out = {"initial": weights(model()), "reference": fit_under(tf.distribute.ReductionToOneDevice())}
    for algorithm in ALGORITHMS:
        out[f"fit {algorithm}"] = fit_under(ttf.TuttiAllReduce(algorithm=algorithm))
    for packs in (0, 2):
        out[f"fit packs {packs}"] = fit_under(ttf.TuttiAllReduce(num_packs=packs))
    # Values of pack_limit bytes or more are reduced in place, the others packed: a batch of both.
    mixed = ttf.TuttiAllReduce()
    mixed.pack_limit = 100
    out["fit packs mixed"] = fit_under(mixed)
    out["loop reference"], _ = loop_under(tf.distribute.ReductionToOneDevice())
    out["loop tutti"], out["loop ops"] = loop_under(ttf.TuttiAllReduce())
    # A reduction to one device (not an all-reduce), a batch with a type tutti does not carry
    # (bool goes TensorFlow's way) and an IndexedSlices value.
    devices = [f"/cpu:{i}" for i in range(_devices)]
    strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=ttf.TuttiAllReduce())
    per = strategy.run(lambda: tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group + 1, tf.float32) * tf.ones([3]))
    ops = ttf.TuttiAllReduce()
    out["reduce to one"] = np.asarray(ops.reduce(tf.distribute.ReduceOp.SUM, per, "/cpu:0")).tolist()
    def slices():
        row = tf.reshape(tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group, tf.int64), [1])
        return tf.IndexedSlices(tf.ones([1, 2]), row, dense_shape=tf.constant([_devices, 2], tf.int64))

    sparse = strategy.run(slices)
    mixed = ops.batch_reduce(tf.distribute.ReduceOp.SUM, [(per, per), (sparse, sparse)])
    out["batch dense"] = [np.asarray(v).tolist() for v in strategy.experimental_local_results(mixed[0])]
    out["batch sparse"] = np.asarray(tf.convert_to_tensor(strategy.experimental_local_results(mixed[1])[0])).tolist()
    return out


# ----- several processes -----


def collectives():
    comm = ttf.default_comm()
    r, p = comm.rank, comm.world_size
    out = {}
    for dtype in ["float32", "int32", "float64", "bfloat16"]:
        x = tf.cast(tf.reshape(tf.range(6) + 10 * r, (2, 3)), dtype)

        @tf.function
        def f(x):
            return (ttf.all_reduce(x, op="sum"), ttf.all_reduce(x, op="max"),
                    ttf.all_gather(x), ttf.broadcast(x + 1, root=p - 1),
                    ttf.grouped_all_reduce([x, 2 * x], op="sum"))

        s, mx, g, b, (g1, g2) = f(x)
        out[dtype] = [np.asarray(tf.cast(v, tf.float64)).tolist() for v in (s, mx, g, b, g1, g2)]
    # all_gather with a first dimension that differs between ranks, eagerly.
    out["ragged"] = np.asarray(ttf.all_gather(tf.fill([r + 1, 2], float(r)))).tolist()
    # The gradient of a summed all-reduce is the all-reduce of the gradients.
    v = tf.Variable(tf.range(3, dtype=tf.float32) * (r + 1))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(ttf.all_reduce(v) * (r + 1.0))
    out["grad"] = np.asarray(tape.gradient(loss, v)).tolist()
    with ttf.DistributedGradientTape(tf.GradientTape()) as tape:
        loss = tf.reduce_sum(v * v)
    out["tape"] = np.asarray(tape.gradient(loss, v)).tolist()
    # Trailing dimensions that differ are an error on every rank, naming the other.
    try:
        ttf.all_gather(tf.zeros([2, 6]) if r == 0 else tf.zeros([2, 2, 3]))
        out["shape error"] = None
    except tf.errors.OpError as e:
        out["shape error"] = e.message
    # The optimizer wrapper takes Keras's names and refuses what is not a Keras 3 optimizer.
    out["optimizer"] = type(ttf.DistributedOptimizer("sgd")).__mro__[1].__name__
    try:
        ttf.DistributedOptimizer(42)
        out["optimizer error"] = None
    except (TypeError, ValueError) as e:
        out["optimizer error"] = str(e)
    return out


def ordered():
    """A collective of a nested function that reads a variable, next to one of the outer
    function: tf.function runs them in program order on every rank, step after step (were
    they not ordered, one rank's first would meet another's second)."""
    comm = ttf.default_comm()
    r = comm.rank
    scale = tf.Variable(1.0)

    @tf.function
    def inner(x):
        return ttf.all_reduce(x * scale)

    @tf.function
    def outer(x):
        return ttf.all_reduce(x), inner(x + 1000.0)

    wrong = 0
    for step in range(200):
        a, b = outer(tf.fill([4], float(r + step)))
        p = comm.world_size
        expect_a = sum(float(k + step) for k in range(p))
        wrong += int(not (np.all(a.numpy() == expect_a) and np.all(b.numpy() == expect_a + 1000.0 * p)))
    return wrong


def keras_mixed():
    """mixed_float16 across the job: rank 0's first batch overflows. The ranks reduce the
    scaled gradients first, so both skip that step alike, and both end with the same weights."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    comm = ttf.default_comm()
    r, p = comm.rank, comm.world_size
    x, y = data(64)
    per = 16 // p
    shard = lambda a: a.reshape(-1, p, per, a.shape[-1])[:, r].reshape(-1, a.shape[-1])  # noqa: E731
    xs, ys = shard(x), shard(y)
    if r == 0:
        ys = ys.copy()
        ys[:per] = 6e4
    m = model(seed=3 + 100 * r)
    opt = ttf.DistributedOptimizer(keras.optimizers.SGD(0.01))
    m.compile(optimizer=opt, loss="mse")
    m.fit(xs, ys, batch_size=per, epochs=1, shuffle=False, verbose=0,
          callbacks=[ttf.BroadcastVariablesCallback(root=0)])
    return {"weights": weights(m), "class": type(opt).__mro__[1].__name__,
            "finite": bool(all(np.isfinite(w).all() for w in m.get_weights()))}


def keras_job():
    """Keras across the job's processes: each rank fits its shard of every global batch with the
    distributed optimizer, starting from rank 0's weights (ranks are seeded differently)."""
    comm = ttf.default_comm()
    r, p = comm.rank, comm.world_size
    x, y = data()
    per = 16 // p
    shard = lambda a: a.reshape(-1, p, per, a.shape[-1])[:, r].reshape(-1, a.shape[-1])  # noqa: E731
    m = model(seed=3 + 100 * r)
    m.compile(optimizer=ttf.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.5)), loss="mse")
    m.fit(shard(x), shard(y), batch_size=per, epochs=3, shuffle=False, verbose=0,
          callbacks=[ttf.BroadcastVariablesCallback(root=0)])
    return weights(m)


def keras_single():
    """The reference for keras_job: one process, the whole batch."""
    x, y = data()
    m = model(seed=3)
    m.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.5), loss="mse")
    m.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0)
    return weights(m)


def peer_lost():
    """Rank 1 dies after the first step; rank 0's next step is an error naming it."""
    comm = ttf.default_comm()
    step = tf.function(lambda t: ttf.all_reduce(t))
    step(tf.ones(4))
    if comm.rank == 1:
        os._exit(0)
    start = time.monotonic()
    try:
        step(tf.ones(4))
    except tf.errors.OpError as e:
        return {"error": e.message, "seconds": time.monotonic() - start}
    return {"error": None, "seconds": time.monotonic() - start}


def closed():
    """A function traced for a communicator that was then closed fails, saying so, even once
    another communicator may sit at its address."""
    c = tutti.local_group(1)[0]
    f = tf.function(lambda x: ttf.all_reduce(x, comm=c))
    first = f(tf.ones(3)).numpy().tolist()
    c.close()
    others = [tutti.local_group(1)[0] for _ in range(4)]
    try:
        f(tf.ones(3))
        error = None
    except tf.errors.OpError as e:
        error = e.message
    again = ttf.all_reduce(tf.ones(2), comm=others[0]).numpy().tolist()
    return {"first": first, "error": error, "again": again}


if __name__ == "__main__":
    result = globals()[sys.argv[1]]()
    print("RESULT " + json.dumps(result), flush=True)
    sys.stdout.flush()
    # Leave without the interpreter's teardown (TensorFlow's threads may outlive it).
    os._exit(0)
