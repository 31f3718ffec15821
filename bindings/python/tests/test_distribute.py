"""tutti.distribute: tf.distribute's strategies from Python, over libtutti's strategies."""

import json
import os
import pathlib
import socket
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import tutti
import tutti.distribute as td

PACKAGE = str(pathlib.Path(__file__).resolve().parents[1])


def cpus(n):
    return [f"cpu:{i}" for i in range(n)]


@pytest.mark.parametrize("n", [1, 2, 4])
def test_run_gives_each_replica_its_value_and_all_reduce_combines_them(n):
    s = td.MirroredStrategy(cpus(n))
    assert s.num_replicas_in_sync == n
    per = td.PerReplica([np.full(3, float(i + 1), np.float32) for i in range(n)])

    def step(x, scale):
        ctx = td.get_replica_context()
        assert td.get_strategy() is s and not td.in_cross_replica_context()
        mine = x * scale + ctx.replica_id_in_sync_group
        return ctx.all_reduce(td.ReduceOp.SUM, mine), ctx.all_reduce("mean", mine)

    with s.scope():
        out = s.run(step, args=(per,), kwargs={"scale": 2.0})
    results = s.experimental_local_results(out)
    assert len(results) == n
    mine = [np.full(3, 2.0 * (i + 1) + i, np.float32) for i in range(n)]
    for total, mean in results:
        np.testing.assert_allclose(total, sum(mine))
        np.testing.assert_allclose(mean, sum(mine) / n, rtol=1e-6)


def test_values_placed_on_the_replicas_devices_reduce_where_they_lie():
    s = td.MirroredStrategy(cpus(3))

    def step():
        ctx = td.get_replica_context()
        i = ctx.replica_id_in_sync_group
        t = ctx.place(np.arange(6, dtype=np.int32).reshape(2, 3) * (i + 1))
        assert t.device_kind == "cpu" and t.shape == (2, 3) and t.dtype == np.int32
        assert ctx.all_reduce("SUM", t) is t
        m = ctx.all_reduce(td.ReduceOp.MEAN, ctx.place(np.full(2, float(i), np.float64)))
        return t.numpy(), m.numpy()

    for total, mean in s.experimental_local_results(s.run(step)):
        np.testing.assert_array_equal(total, np.arange(6, dtype=np.int32).reshape(2, 3) * 6)
        assert total.dtype == np.int32
        np.testing.assert_array_equal(mean, [1.0, 1.0])
    # The default strategy's one replica keeps its value.
    one = td.get_strategy().run(lambda: td.get_replica_context().all_reduce(
        "SUM", td.get_replica_context().place(np.array([1.5, 2.5], np.float32))).numpy())
    np.testing.assert_array_equal(one, [1.5, 2.5])
    assert "DeviceTensor(shape=(2,), dtype=float32, on cpu)" == repr(s.run(
        lambda: td.get_replica_context().place(np.zeros(2, np.float32))).values[0])
    with pytest.raises(TypeError, match="ReplicaContext.place"):
        td.DeviceTensor(1, (2,), np.float32)
    # One tensor handed to every replica: an error that says so, not a race.
    shared = td.get_replica_context().place(np.ones(1 << 16, np.float32))
    with pytest.raises(Exception, match="in use by another call|belongs to one replica|aborted"):
        for _ in range(20):
            s.run(lambda: td.get_replica_context().all_reduce("SUM", shared))


def test_device_variables_update_where_their_copies_lie(tmp_path):
    s = td.MirroredStrategy(cpus(3))
    with s.scope():
        w = td.DeviceVariable(np.array([[10.0, 10.0], [0.0, 1.0]], np.float32), aggregation="MEAN", name="w")
        n = td.DeviceVariable(np.zeros(2, np.int64), aggregation=td.VariableAggregation.SUM)
        fixed = td.DeviceVariable([1.0, 2.0])
    assert w.shape == (2, 2) and w.dtype == np.float32 and "DeviceVariable w" in repr(w)

    def step():
        ctx = td.get_replica_context()
        i = ctx.replica_id_in_sync_group
        w.assign_sub(ctx.place(np.full((2, 2), float(i), np.float32)))  # a tensor on the device
        n.assign_add(np.array([i, 1]))  # an array, placed first
        with pytest.raises(ValueError, match="has NONE"):
            fixed.assign(np.zeros(2))
        return w.numpy(), n.numpy()

    for got_w, got_n in s.experimental_local_results(s.run(step)):
        np.testing.assert_array_equal(got_w, [[9.0, 9.0], [-1.0, 0.0]])  # less the mean of 0, 1, 2
        np.testing.assert_array_equal(got_n, [3, 3])
    assert all((w.read(r) == w.numpy()).all() for r in range(3))
    # Outside run, the value given goes to every copy.
    w.assign([[1, 2], [3, 4]])
    np.testing.assert_array_equal(np.asarray(w), [[1, 2], [3, 4]])
    np.testing.assert_array_equal(w.read(2), [[1, 2], [3, 4]])
    with pytest.raises(ValueError, match="shape"):
        w.assign(np.zeros(3))
    with pytest.raises(TypeError, match="does not fit"):
        n.assign_add(np.ones(2, np.float32))
    with pytest.raises(ValueError, match="truncate"):
        with s.scope():
            td.DeviceVariable(np.zeros(2, np.int32), aggregation="MEAN")
    with pytest.raises(RuntimeError, match="cross-replica context"):
        s.run(lambda: td.DeviceVariable([1.0]))
    with pytest.raises(tutti.TuttiError, match="no replica 3"):
        w.read(3)

    def wrong(ctx_tensor_shape):
        ctx = td.get_replica_context()
        w.assign_add(ctx.place(np.zeros(ctx_tensor_shape, np.float32)))

    with pytest.raises(ValueError, match="the variable has shape"):
        s.run(wrong, args=((4,),))
    # Saved and restored as a Variable is.
    ckpt = td.Checkpoint(w=w, n=n)
    td.CheckpointManager(ckpt, str(tmp_path)).save()
    w.assign(np.zeros((2, 2)))
    n.assign([7, 7])
    assert td.CheckpointManager(td.Checkpoint(w=w, n=n), str(tmp_path)).restore_or_initialize() == 1
    np.testing.assert_array_equal(w.numpy(), [[1, 2], [3, 4]])
    np.testing.assert_array_equal(n.read(1), [3, 3])


@pytest.mark.parametrize("make", [lambda: td.optimizers.SGD(0.1, momentum=0.9), lambda: td.optimizers.Adam(0.05)])
def test_optimizers_step_device_variables_as_they_step_variables(tmp_path, make):
    s = td.MirroredStrategy(cpus(3))
    init = np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3)
    with s.scope():
        dv, hv = td.DeviceVariable(init), td.Variable(init)
    dev_opt, host_opt = make(), make()

    def grad(k):
        i = td.get_replica_context().replica_id_in_sync_group
        return np.full((2, 3), 0.1 * (i + 1), np.float32) + np.float32(k) * init

    def step(k, opt, var, tensor):
        g = grad(k)
        opt.apply_gradients([(td.get_replica_context().place(g) if tensor else g, var)])

    for k in range(3):
        s.run(step, args=(k, dev_opt, dv, k % 2 == 0))  # a DeviceTensor, or an array placed
        s.run(step, args=(k, host_opt, hv, False))
    np.testing.assert_allclose(dv.numpy(), hv.numpy(), rtol=1e-5, atol=1e-6)
    assert dev_opt.iterations == 3
    # Saved with its optimizer; restored into new ones, it steps on as before.
    manager = td.CheckpointManager(td.Checkpoint(w=dv, opt=dev_opt), str(tmp_path))
    manager.save()
    with s.scope():
        dv2 = td.DeviceVariable(np.zeros_like(init))
    opt2 = make()
    assert td.CheckpointManager(td.Checkpoint(w=dv2, opt=opt2), str(tmp_path)).restore_or_initialize() == 1
    assert opt2.iterations == 3
    np.testing.assert_array_equal(dv2.numpy(), dv.numpy())
    s.run(step, args=(3, opt2, dv2, True))
    s.run(step, args=(3, host_opt, hv, False))
    np.testing.assert_allclose(dv2.numpy(), hv.numpy(), rtol=1e-5, atol=1e-6)
    # A learning rate changed between steps, or a schedule, reaches the devices.
    for o in (opt2, host_opt):
        o.learning_rate *= 2
    s.run(step, args=(4, opt2, dv2, True))
    s.run(step, args=(4, host_opt, hv, False))
    np.testing.assert_allclose(dv2.numpy(), hv.numpy(), rtol=1e-5, atol=1e-6)
    for o in (opt2, host_opt):
        o.learning_rate = lambda step: 0.05 / (1 + step)
    assert opt2.iterations == 5 and opt2.learning_rate == pytest.approx(0.05 / 6)
    for k in (5, 6):
        s.run(step, args=(k, opt2, dv2, k == 5))
        s.run(step, args=(k, host_opt, hv, False))
    np.testing.assert_allclose(dv2.numpy(), hv.numpy(), rtol=1e-5, atol=1e-6)
    # Another hyper-parameter changed would not reach the devices: an error.
    if isinstance(opt2, td.optimizers.SGD):
        opt2.momentum = 0.5
    else:
        opt2.beta_1 = 0.5
    with pytest.raises(ValueError, match="other than the learning rate changed"):
        s.run(step, args=(7, opt2, dv2, True))
    # An optimizer that never stepped a DeviceVariable saves none of its state; restoring that
    # starts the slots afresh, with a warning.
    td.CheckpointManager(td.Checkpoint(w=dv2, opt=make()), str(tmp_path / "fresh")).save()
    with pytest.warns(UserWarning, match="starts afresh"):
        td.CheckpointManager(td.Checkpoint(w=dv2, opt=make()), str(tmp_path / "fresh")).restore_or_initialize()
    with pytest.raises(ValueError, match="inside strategy.run"):
        dev_opt.apply_gradients([(np.zeros((2, 3), np.float32), dv)])
    with pytest.raises(ValueError, match="for a variable of shape"):
        s.run(lambda: dev_opt.apply_gradients([(td.get_replica_context().place(np.zeros(6, np.float32)), dv)]))


def test_a_learning_rate_schedule_steps_each_step_at_its_rate():
    s = td.MirroredStrategy(cpus(3))
    with s.scope():
        w = td.Variable(np.ones(3, np.float32))

    class Halving:  # as a Keras LearningRateSchedule: called with the steps taken
        def __call__(self, step):
            return np.float32(0.1 * 0.5**step)

    opt = td.optimizers.SGD(Halving())
    assert opt.learning_rate == pytest.approx(0.1)

    def step(times=1):
        for _ in range(times):
            if td.get_replica_context().replica_id_in_sync_group == 2:
                time.sleep(0.002)  # a replica behind the others
            opt.apply_gradients([(np.ones(3, np.float32), w)])  # summed over 3 replicas: 3

    s.run(step)
    s.run(step, args=(2,))  # two steps in one run: every replica takes each at its rate
    assert opt.iterations == 3 and opt.learning_rate == pytest.approx(0.0125)
    np.testing.assert_allclose(w.numpy(), 1 - 3 * (0.1 + 0.05 + 0.025), rtol=1e-6)
    copies = s.experimental_local_results(s.run(lambda: w.numpy()))
    assert len(copies) == 3 and all((c == w.numpy()).all() for c in copies)
    # A rate of 0 (a warm-up's first) steps nothing; one that is not finite fails its step,
    # naming it, before anything moves.
    opt.learning_rate = lambda step: 0.0 if step == 3 else float("nan")
    s.run(step)
    np.testing.assert_allclose(w.numpy(), 1 - 3 * 0.175, rtol=1e-6)
    with pytest.raises(ValueError, match="SGD: step 4: the schedule's learning_rate nan must be finite"):
        s.run(step)
    assert opt.iterations == 4
    np.testing.assert_allclose(w.numpy(), 1 - 3 * 0.175, rtol=1e-6)
    with pytest.raises(ValueError, match="SGD: learning_rate -1.0 must be finite and not negative"):
        opt.learning_rate = -1
    with pytest.raises(TypeError, match="is not a number"):
        td.optimizers.Adam("fast")
    opt.learning_rate = 0.2
    s.run(step)
    np.testing.assert_allclose(w.numpy(), 1 - 3 * 0.375, rtol=1e-6)


def test_reduce_with_and_without_an_axis():
    s = td.MirroredStrategy(cpus(3))
    values = [np.arange(6, dtype=np.float64).reshape(2, 3) * (i + 1) for i in range(3)]
    per = td.PerReplica(values)
    np.testing.assert_allclose(s.reduce("SUM", per), sum(values))
    np.testing.assert_allclose(s.reduce(td.ReduceOp.MEAN, per), sum(values) / 3)
    np.testing.assert_allclose(s.reduce("SUM", per, axis=0), sum(v.sum(axis=0) for v in values))
    # MEAN along an axis averages every element along it, across the replicas.
    np.testing.assert_allclose(s.reduce("MEAN", per, axis=0), np.concatenate(values).mean(axis=0))
    scalar = s.reduce("SUM", per, axis=(0, 1))
    assert np.shape(scalar) == () and float(scalar) == sum(v.sum() for v in values)
    np.testing.assert_allclose(s.reduce("MEAN", per, axis=(0, 1)), np.concatenate(values).mean())
    # A value that is not per replica is the same on every replica.
    np.testing.assert_allclose(s.reduce("SUM", np.ones(2)), [3.0, 3.0])
    np.testing.assert_allclose(s.reduce("MEAN", np.ones(2)), [1.0, 1.0])


def linear_regression(strategy, steps=30):
    """The guides' custom training loop: the global batch split across the replicas, each
    replica's gradient summed across replicas and divided by the global batch size."""
    rng = np.random.default_rng(0)
    X = rng.standard_normal((48, 4)).astype(np.float32)
    y = X @ np.array([1.0, -2.0, 3.0, 0.5], np.float32)
    n = strategy.num_local_replicas
    shards = td.PerReplica([(X[i::n], y[i::n]) for i in range(n)])
    w = np.zeros(4, np.float32)

    def step(shard, w):
        xs, ys = shard
        ctx = td.get_replica_context()
        grad = 2 * xs.T @ (xs @ w - ys)  # summed over this replica's examples
        return ctx.all_reduce(td.ReduceOp.SUM, grad) / len(X)

    with strategy.scope():
        for _ in range(steps):
            grads = strategy.experimental_local_results(strategy.run(step, args=(shards, w)))
            for g in grads[1:]:
                np.testing.assert_array_equal(g, grads[0])
            w = w - 0.05 * grads[0]
    ref = np.zeros(4, np.float32)
    for _ in range(steps):
        ref = ref - 0.05 * (2 * X.T @ (X @ ref - y) / len(X))
    return w, ref


@pytest.mark.parametrize(
    "make",
    [
        lambda: td.MirroredStrategy(cpus(4)),
        lambda: td.MirroredStrategy(cpus(2), cross_device_ops=td.HierarchicalCopyAllReduce()),
        lambda: td.MirroredStrategy(cpus(3), cross_device_ops=td.ReductionToOneDevice()),
        lambda: td.OneDeviceStrategy("/cpu:0"),
        lambda: td.CentralStorageStrategy(cpus(2)),
        lambda: td.MultiWorkerMirroredStrategy(),
    ],
)
def test_a_custom_training_loop_ends_with_the_full_batch_weights(make):
    w, ref = linear_regression(make())
    np.testing.assert_allclose(w, ref, rtol=1e-5, atol=1e-5)


def test_a_raising_replica_raises_from_run_and_the_strategy_goes_on():
    s = td.MirroredStrategy(cpus(3))

    def step():
        ctx = td.get_replica_context()
        if ctx.replica_id_in_sync_group == 1:
            raise KeyError("replica 1 failed")
        return ctx.all_reduce("SUM", np.ones(2))

    with pytest.raises(KeyError, match="replica 1 failed"):
        s.run(step)
    out = s.run(lambda: td.get_replica_context().all_reduce("SUM", 1.0))
    assert s.experimental_local_results(out) == (3.0, 3.0, 3.0)


# Nothing escapes the replica's callback into ctypes (which would print it and go on).
@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_a_replica_raising_an_exception_that_cannot_be_printed_still_fails_the_run():
    class Unprintable(Exception):
        def __str__(self):
            raise RuntimeError("no message")

    s = td.MirroredStrategy(cpus(2))

    def step():
        if td.get_replica_context().replica_id_in_sync_group == 0:
            raise Unprintable()
        # Waits for replica 0, which must be known to have failed.
        return td.get_replica_context().all_reduce("SUM", 1.0)

    with pytest.raises(Unprintable):
        s.run(step)
    out = s.run(lambda: td.get_replica_context().all_reduce("SUM", 1.0))
    assert s.experimental_local_results(out) == (2.0, 2.0)


def test_devices_are_named_as_in_tensorflow_and_others_are_errors_naming_them():
    s = td.MirroredStrategy(["/job:localhost/replica:0/task:0/device:CPU:0", "/cpu:1", "CPU:2"],
                            cross_device_ops=td.ReductionToOneDevice("/device:CPU:2"))
    out = s.run(lambda: td.get_replica_context().all_reduce("SUM", 1.0))
    assert s.experimental_local_results(out) == (3.0, 3.0, 3.0)
    assert td.OneDeviceStrategy("cpu:1").num_replicas_in_sync == 1
    assert td.CentralStorageStrategy(["cpu:0", "cpu:1"]).num_replicas_in_sync == 2
    with pytest.raises(ValueError, match="'npu:0': expected a CPU, GPU or XLA device"):
        td.MirroredStrategy(["npu:0"])
    with pytest.raises(ValueError, match="name a device twice"):
        td.MirroredStrategy(["cpu:0", "/device:CPU:0"])
    with pytest.raises(ValueError, match="is not one of the strategy's devices"):
        td.MirroredStrategy(["cpu:0"], cross_device_ops=td.ReductionToOneDevice("gpu:0"))
    # A GPU that is not there, or XLA devices in a library without them: UNAVAILABLE, saying so.
    for devices, names in [(["/gpu:0"], "/gpu:0"), (["xla:0", "xla:1"], "XLA")]:
        try:
            s = td.MirroredStrategy(devices)
        except tutti.TuttiError as e:
            assert e.code == "TUTTI_ERROR_UNAVAILABLE" and names in str(e), e
        else:
            out = s.run(lambda: td.get_replica_context().all_reduce("SUM", 1.0))
            assert s.experimental_local_results(out) == (float(len(devices)),) * len(devices)
    with pytest.raises(tutti.TuttiError, match="mix XLA devices with others"):
        td.MirroredStrategy(["cpu:0", "xla:0"])


def test_scopes_and_the_default_strategy():
    default = td.get_strategy()
    assert default is td.get_strategy() and not td.has_strategy()
    assert default.num_replicas_in_sync == 1
    assert td.get_replica_context().all_reduce("SUM", np.arange(3)).tolist() == [0, 1, 2]
    a, b = td.MirroredStrategy(cpus(2)), td.MirroredStrategy(cpus(2))
    with a.scope():
        assert td.get_strategy() is a and td.has_strategy() and td.in_cross_replica_context()
        assert td.get_replica_context() is None
        with a.scope():
            pass
        with pytest.raises(ValueError, match="Mixing different"):
            with b.scope():
                pass
        with pytest.raises(RuntimeError, match="inside a replica function"):
            a.run(lambda: a.run(lambda: None))
    assert td.get_strategy() is default


def test_the_guides_experimental_names_are_there():
    """TensorFlow's guides write tf.distribute.experimental.MultiWorkerMirroredStrategy,
    CentralStorageStrategy, TPUStrategy and CommunicationOptions: the same classes here."""
    x = td.experimental
    assert x.MultiWorkerMirroredStrategy is td.MultiWorkerMirroredStrategy
    assert x.CentralStorageStrategy is td.CentralStorageStrategy
    assert x.TPUStrategy is td.TPUStrategy
    assert x.ParameterServerStrategy is td.ParameterServerStrategy
    assert x.coordinator.ClusterCoordinator is td.ClusterCoordinator
    options = x.CommunicationOptions(implementation=x.CommunicationImplementation.NCCL)
    assert options.implementation == td.CommunicationImplementation.NCCL
    s = x.CentralStorageStrategy(cpus(2))
    assert s.num_replicas_in_sync == 2
    s.close()


def test_wrong_arguments_name_what_is_wrong():
    with pytest.raises(ValueError, match="twice"):
        td.MirroredStrategy(["cpu:0", "/cpu:0"])
    with pytest.raises(ValueError, match="num_packs"):
        td.HierarchicalCopyAllReduce(num_packs=-1)
    with pytest.raises(ValueError, match="num_packs"):
        td.NcclAllReduce(num_packs=2)
    with pytest.raises(ValueError, match="one of AUTO, RING, NCCL"):
        td.CommunicationOptions(implementation="GLOO")
    s = td.MirroredStrategy(cpus(2))
    with pytest.raises(ValueError, match="neither SUM nor MEAN"):
        s.reduce("MAX", td.PerReplica([np.ones(1)] * 2))
    with pytest.raises(ValueError, match="3 values for 2 local replicas"):
        s.run(lambda x: x, args=(td.PerReplica([1, 2, 3]),))
    with pytest.raises(ValueError, match="differ in shape or dtype"):
        s.reduce("SUM", td.PerReplica([np.ones(2), np.ones(3)]))
    s.close()
    with pytest.raises(ValueError, match="closed"):
        s.reduce("SUM", td.PerReplica([np.ones(2)] * 2))


WORKER = textwrap.dedent(
    """
    import json, numpy as np, tutti.distribute as td
    s = td.MultiWorkerMirroredStrategy()
    with s.scope():
        out = s.run(lambda: (td.get_replica_context().replica_id_in_sync_group,
                             td.get_replica_context().all_reduce("SUM", np.float32(1.0) + td.get_replica_context().replica_id_in_sync_group)))
    rid, total = s.experimental_local_results(out)[0]
    mean = s.reduce("MEAN", np.full(2, float(rid)))
    print("RESULT " + json.dumps({"sync": s.num_replicas_in_sync, "id": int(rid), "total": float(total),
                                 "mean": mean.tolist()}), flush=True)
    """
)


def run_workers(code, world):
    """Every worker's RESULT of ``code`` run by ``world`` processes of one job."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = []
    for rank in range(world):
        env = dict(os.environ, TUTTI_RANK=str(rank), TUTTI_WORLD_SIZE=str(world), TUTTI_MASTER_ADDR=f"127.0.0.1:{port}",
                   TUTTI_TIMEOUT="60")
        env["PYTHONPATH"] = PACKAGE + os.pathsep + env.get("PYTHONPATH", "")
        env.pop("TF_CONFIG", None)
        procs.append(subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    return _results(procs, 120)


def _results(procs, timeout):
    """Each process's last RESULT line, in order; each must succeed within ``timeout`` (the
    others are killed if one does not)."""
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
            assert p.returncode == 0 and lines, err
            results.append(json.loads(lines[-1][len("RESULT "):]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return results


RESOLVED_WORKER = textwrap.dedent(
    """
    import json, os, numpy as np, tutti.distribute as td
    cluster = json.loads(os.environ["CLUSTER"])
    resolver = td.cluster_resolver.SimpleClusterResolver(
        td.ClusterSpec(cluster), task_type="worker", task_id=int(os.environ["INDEX"]))
    options = td.CommunicationOptions(implementation=os.environ["IMPLEMENTATION"], bytes_per_pack=1024,
                                      timeout_seconds=6)
    s = td.MultiWorkerMirroredStrategy(cluster_resolver=resolver, communication_options=options)
    total = s.reduce("SUM", s.run(lambda: np.full(2, s.cluster_resolver.task_id + 1.0, np.float32)), axis=None)
    waited = None
    if os.environ["IMPLEMENTATION"] == "RING":
        # The options' timeout binds, not TUTTI_TIMEOUT's 60 s: worker 1 stays away from the next
        # reduce, and worker 0's gives up within 6 s.
        import time
        if s.cluster_resolver.task_id == 1:
            time.sleep(15)
        else:
            t = time.monotonic()
            try:
                s.reduce("SUM", s.run(lambda: np.ones(2, np.float32)), axis=None)
            except Exception as e:
                waited = [round(time.monotonic() - t, 1), type(e).__name__, "timed out" in str(e)]
    print("RESULT " + json.dumps({"id": s.cluster_resolver.task_id, "sync": s.num_replicas_in_sync,
                                  "total": total.tolist(), "waited": waited}), flush=True)
    """
)


@pytest.mark.parametrize("implementation", ["RING", "NCCL"])
def test_multi_worker_mirrored_strategy_from_a_resolver_with_communication_options(implementation):
    """The cluster from a resolver of the caller's (no TF_CONFIG, no launcher), the collectives
    across workers as the options say: RING, or NCCL, which runs the ring where the devices are
    CPUs (and says so in the log)."""
    ports = []
    for _ in range(2):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            ports.append(sock.getsockname()[1])
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    procs = []
    for i in range(2):
        env = dict(os.environ, CLUSTER=json.dumps(cluster), INDEX=str(i), IMPLEMENTATION=implementation,
                   TUTTI_TIMEOUT="60")
        env["PYTHONPATH"] = PACKAGE + os.pathsep + env.get("PYTHONPATH", "")
        for k in ("TF_CONFIG", "TUTTI_RANK", "TUTTI_WORLD_SIZE", "TUTTI_MASTER_ADDR"):
            env.pop(k, None)
        procs.append(subprocess.Popen([sys.executable, "-c", RESOLVED_WORKER], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    results = _results(procs, 120)
    assert [r["id"] for r in results] == [0, 1]
    for r in results:
        assert r["sync"] == 2 and r["total"] == [3.0, 3.0], r
    if implementation == "RING":
        seconds, kind, timed_out = results[0]["waited"]
        assert 5 < seconds < 12 and timed_out, results[0]
    # Options no strategy could run with are refused where they are made.
    for bad, match in [(dict(timeout_seconds=0), "tutti bounds every wait"), (dict(bytes_per_pack=-1), "non-negative"),
                       (dict(timeout_seconds=1e20), "at most 30 days"), (dict(timeout_seconds="abc"), "timeout_seconds"),
                       (dict(bytes_per_pack=None), "bytes_per_pack"), (dict(bytes_per_pack=2**64), "non-negative")]:
        with pytest.raises(ValueError, match=match):
            td.CommunicationOptions(**bad)


def test_multi_worker_mirrored_strategy_across_processes():
    results = run_workers(WORKER, 2)
    assert sorted(r["id"] for r in results) == [0, 1]
    for r in results:
        assert r["sync"] == 2 and r["total"] == 3.0 and r["mean"] == [0.5, 0.5], r


@pytest.mark.parametrize("make", [lambda: td.OneDeviceStrategy(), lambda: td.MirroredStrategy(cpus(2))])
def test_run_leaves_the_callers_scope_as_it_was(make):
    """One local replica runs on the caller's own thread: its scope is the same after."""
    s = make()
    with s.scope():
        s.run(lambda: td.get_replica_context().all_reduce("SUM", 1.0))
        assert td.get_strategy() is s and td.has_strategy() and td.in_cross_replica_context()
    assert not td.has_strategy()


def test_cross_replica_calls_inside_a_replica_function_are_errors_not_hangs():
    s = td.MirroredStrategy(cpus(2))
    for call in [lambda: s.reduce("SUM", np.ones(2)), s.close]:
        with pytest.raises(RuntimeError, match="inside a replica function"):
            s.run(call)
    assert s.reduce("SUM", np.ones(2)).tolist() == [2.0, 2.0]


def test_reduce_along_an_axis_takes_uneven_batches_and_keeps_the_dtype():
    s = td.MirroredStrategy(cpus(2))
    a, b = np.arange(6, dtype=np.int32).reshape(2, 3), np.arange(9, dtype=np.int32).reshape(3, 3)
    total = s.reduce("SUM", td.PerReplica([a, b]), axis=0)
    assert total.dtype == np.int32 and total.tolist() == (a.sum(0) + b.sum(0)).tolist()
    f = [x.astype(np.float32) for x in (a, b)]
    mean = s.reduce("MEAN", td.PerReplica(f), axis=0)
    assert mean.dtype == np.float32
    np.testing.assert_allclose(mean, np.concatenate(f).mean(axis=0))
    with pytest.raises(TypeError, match="byte order"):
        s.reduce("SUM", td.PerReplica([np.ones(2, ">f4")] * 2))


def test_variables_of_each_strategy_train_to_the_full_batch_weights():
    """The guides' loop with a strategy's variable: each replica's gradient summed across
    replicas into the update, every copy kept alike."""
    rng = np.random.default_rng(1)
    X = rng.standard_normal((24, 3)).astype(np.float32)
    y = X @ np.array([0.5, -1.0, 2.0], np.float32)
    ref = np.zeros(3, np.float32)
    for _ in range(20):
        ref = ref - 0.05 * (2 * X.T @ (X @ ref - y) / len(X))
    for s in [td.MirroredStrategy(cpus(3)), td.CentralStorageStrategy(cpus(2)), td.OneDeviceStrategy()]:
        n = s.num_local_replicas
        shards = td.PerReplica([(X[i::n], y[i::n]) for i in range(n)])
        with s.scope():
            w = td.Variable(np.zeros(3, np.float32), aggregation=td.VariableAggregation.SUM)

            def step(shard):
                xs, ys = shard
                grad = 2 * xs.T @ (xs @ w.numpy() - ys) / len(X)
                w.assign_sub(0.05 * grad)
                return w.numpy()

            for _ in range(20):
                copies = s.experimental_local_results(s.run(step, args=(shards,)))
                for c in copies[1:]:
                    np.testing.assert_array_equal(c, copies[0])
        np.testing.assert_allclose(w.numpy(), ref, rtol=1e-5, atol=1e-5)


def test_variable_updates_follow_their_aggregation():
    s = td.MirroredStrategy(cpus(2))
    with s.scope():
        mean = td.Variable(np.zeros(2), aggregation="mean")
        first = td.Variable(np.zeros(2), aggregation=td.VariableAggregation.ONLY_FIRST_REPLICA)
        plain = td.Variable(np.zeros(2))

        def step():
            r = td.get_replica_context().replica_id_in_sync_group
            mean.assign_add(np.full(2, r + 1.0))
            first.assign(np.full(2, 10.0 + r))
            with pytest.raises(ValueError, match="needs an aggregation"):
                plain.assign(np.ones(2))

        s.run(step)
        copies = s.experimental_local_results(s.run(lambda: (mean.numpy(), first.numpy())))
        assert [(m.tolist(), f.tolist()) for m, f in copies] == [([1.5, 1.5], [10.0, 10.0])] * 2
        plain.assign(np.full(2, 7.0))  # the cross-replica context: every copy
        got = s.experimental_local_results(s.run(lambda: plain.numpy()))
        assert [g.tolist() for g in got] == [[7.0, 7.0]] * 2
        counts = td.Variable(np.zeros(2, np.int32), aggregation="mean")
        with pytest.raises(ValueError, match="would truncate"):
            s.run(lambda: counts.assign_add(np.ones(2, np.int32)))
        with pytest.raises(TypeError, match="does not fit"):
            counts.assign(np.full(2, 0.5))
        empty = td.Variable(np.zeros((0, 3), np.float32), aggregation="sum")
        s.run(lambda: empty.assign_add(np.zeros((0, 3), np.float32)))
        assert empty.shape == (0, 3)
    other = td.MirroredStrategy(cpus(2))
    with pytest.raises(ValueError, match="other than the one it was made under"):
        other.run(lambda: mean.assign_add(np.ones(2)))
    outside = td.Variable([1, 2, 3])
    assert outside.assign_add([1, 1, 1]).numpy().tolist() == [2, 3, 4]
    assert s.reduce("SUM", td.PerReplica([np.zeros(0, np.float32)] * 2)).shape == (0,)


VARIABLE_WORKER = textwrap.dedent(
    """
    import json, os, numpy as np, tutti.distribute as td
    rank = int(os.environ["TUTTI_RANK"])
    s = td.MultiWorkerMirroredStrategy()
    with s.scope():
        v = td.Variable(np.full(3, 10.0 * (rank + 1), np.float32), aggregation="mean")
        start = v.numpy().tolist()
        s.run(lambda: v.assign_add(np.full(3, float(td.get_replica_context().replica_id_in_sync_group))))
        after = v.numpy().tolist()
        errors = []
        for bad in [np.zeros(2 + rank, np.float32), np.zeros(3, [np.float32, np.int32][rank]),
                    np.zeros((1,) * 8 + ((2, 3) if rank == 0 else (3, 2)), np.float32)]:
            try:
                td.Variable(bad)
                errors.append(None)
            except ValueError as e:
                errors.append(str(e))
        scalar = td.Variable(np.float64(rank + 5)).numpy().tolist()
        # A device variable too: the chief's value and shape, updates combined across workers.
        d = td.DeviceVariable(np.full((2, 2), 10.0 * (rank + 1), np.float32), aggregation="sum")
        d_start = d.numpy().tolist()
        s.run(lambda: d.assign_sub(td.get_replica_context().place(np.ones((2, 2), np.float32))))
        d.assign_add(np.full((2, 2), 100.0 * (rank + 1), np.float32))  # every worker; the chief's value
        d_after = d.numpy().tolist()
        try:
            td.DeviceVariable(np.zeros((2, 3) if rank == 0 else (3, 2), np.float32))
            d_error = None
        except ValueError as e:
            d_error = str(e)
    print("RESULT " + json.dumps({"start": start, "after": after, "errors": errors, "scalar": scalar,
                                  "d_start": d_start, "d_after": d_after, "d_error": d_error}), flush=True)
    """
)


SHRINKING_WORKER = textwrap.dedent(
    """
    import json, time, numpy as np, tutti.distribute as td
    s = td.MultiWorkerMirroredStrategy()
    me = s.cluster_resolver.task_id
    with s.scope():
        v = td.Variable(np.array([1.0, 2.0], np.float32), aggregation="SUM")

    def step(n):
        g = td.get_replica_context().all_reduce("SUM", np.ones(n, np.float32))
        v.assign_sub(0.1 * g[:2])

    errors = []
    t = time.monotonic()
    try:
        s.run(step, args=(3 if me == 1 else 2,))  # worker 1's all-reduce is of another length
    except Exception as e:
        errors.append([type(e).__name__, str(e), round(time.monotonic() - t, 1)])
    try:
        s.run(step, args=(2,))  # the workers' communicator is gone
    except Exception as e:
        errors.append([type(e).__name__, str(e), 0])
    s.shrink()
    with s.scope():
        v = td.Variable(v.numpy(), aggregation="SUM")
    s.run(step, args=(2,))
    print("RESULT " + json.dumps({"id": s.cluster_resolver.task_id, "sync": s.num_replicas_in_sync,
                                  "errors": errors, "value": v.numpy().tolist()}), flush=True)
    """
)


def test_workers_go_on_after_a_mismatch_through_shrink():
    """A call across workers that differs between them ends the workers' communicator (under
    the default check); ``shrink`` on both goes on with both, their variable alike."""
    w0, w1 = run_workers(SHRINKING_WORKER, 2)
    for w in (w0, w1):
        (kind, first, took), (_, second, _) = w["errors"]
        assert "count" in first and took < 30, w  # named at once, not at the 60 s timeout
        assert "abort" in second.lower(), w
        assert w["sync"] == 2 and w["value"] == w0["value"], (w0, w1)
    # The one step after the shrink, from [1, 2]: each of the 2 replicas subtracts 0.1 x their
    # all-reduced gradient (2), and the variable sums the replicas' updates (aggregation SUM).
    assert w0["value"] == pytest.approx([0.6, 1.6]), w0


def test_a_replica_gathers_every_replicas_value():
    """TensorFlow's ``ReplicaContext.all_gather``: every replica's value along the axis, in
    replica order, of lengths that may differ there; a value that cannot be gathered raises on
    every replica; the default strategy's one replica gets its own."""
    s = td.MirroredStrategy(cpus(3))

    def rows():
        ctx = td.get_replica_context()
        r = ctx.replica_id_in_sync_group
        return ctx.all_gather(np.full((r + 1, 2), r, np.int32), axis=0), ctx.all_gather(np.full((2, r + 1), r), -1)

    out = s.run(rows)
    want_rows = np.concatenate([np.full((r + 1, 2), r, np.int32) for r in range(3)])
    want_cols = np.concatenate([np.full((2, r + 1), r) for r in range(3)], axis=1)
    for got_rows, got_cols in s.experimental_local_results(out):
        np.testing.assert_array_equal(got_rows, want_rows)
        np.testing.assert_array_equal(got_cols, want_cols)

    def differs():
        ctx = td.get_replica_context()
        return ctx.all_gather(np.zeros((2, 3 if ctx.replica_id_in_sync_group == 1 else 2)), axis=0)

    with pytest.raises(ValueError, match="differ between replicas"):
        s.run(differs)

    def bad_axis():
        ctx = td.get_replica_context()
        return ctx.all_gather(np.zeros(2), axis=3 if ctx.replica_id_in_sync_group == 2 else 0)

    with pytest.raises(ValueError, match="axis 3 is out of range|another replica's values were refused"):
        s.run(bad_axis)
    one = td.get_strategy().run(lambda: td.get_replica_context().all_gather(np.arange(3), 0))
    assert one.tolist() == [0, 1, 2]
    s.close()


def test_workers_start_every_variable_from_the_chiefs_value():
    results = run_workers(VARIABLE_WORKER, 2)
    for r in results:
        assert r["start"] == [10.0] * 3 and r["after"] == [10.5] * 3 and r["scalar"] == 5.0, r
        assert all(e and "differs between workers" in e for e in r["errors"]), r
        assert r["d_start"] == [[10.0] * 2] * 2 and r["d_after"] == [[108.0] * 2] * 2, r
        assert r["d_error"] and "shape (3, 2)" in results[1]["d_error"], r
    size, dtype, shape = results[1]["errors"]
    assert "this worker's has 1 dimensions, 3 elements of float32" in size, size
    assert "chief's has 1 dimensions, 2 elements of float32" in size, size
    assert "this worker's has 1 dimensions, 3 elements of int32" in dtype, dtype
    assert "this worker's shape (1, 1, 1, 1, 1, 1, 1, 1, 3, 2)" in shape, shape


SEEDED_WORKER = textwrap.dedent(
    """
    import json, os
    import numpy as np
    import tutti.distribute as td

    rank = int(os.environ["TUTTI_RANK"])
    own = np.random.default_rng(100 + rank).standard_normal(3).astype(np.float32)  # seeded apart
    x = np.random.default_rng(7).standard_normal((16, 3)).astype(np.float32)
    y = (x @ np.array([0.5, -1.0, 2.0], np.float32) + 0.25).astype(np.float32)
    s = td.MultiWorkerMirroredStrategy()
    with s.scope():
        w = td.Variable(own, aggregation="SUM")
        opt = td.optimizers.SGD(0.1)
    start = w.numpy().tolist()
    xs, ys = x[rank::2], y[rank::2]  # this worker's half of the batch

    def step():
        err = xs @ w.numpy() - ys
        opt.apply_gradients([(2 * xs.T @ err / len(x), w)])

    for _ in range(10):
        s.run(step)
    print("RESULT " + json.dumps({"own": own.tolist(), "start": start, "end": w.numpy().tolist()}), flush=True)
    """
)


def test_workers_seeded_differently_train_identically():
    """Two workers whose initial values differ (each seeded apart) start from the chief's and,
    stepping on their halves of the batch, end with the same bits: the full batch's descent
    from the chief's value."""
    chief, other = run_workers(SEEDED_WORKER, 2)
    assert chief["own"] != other["own"]
    assert chief["start"] == other["start"] == chief["own"]
    assert chief["end"] == other["end"]
    x = np.random.default_rng(7).standard_normal((16, 3)).astype(np.float32)
    y = (x @ np.array([0.5, -1.0, 2.0], np.float32) + 0.25).astype(np.float32)
    w = np.array(chief["own"], np.float32)
    for _ in range(10):
        w -= np.float32(0.1) * (2 * x.T @ (x @ w - y) / len(x)).astype(np.float32)
    np.testing.assert_allclose(chief["end"], w, rtol=1e-5, atol=1e-6)


def test_a_checkpoint_manager_saves_once_every_interval(tmp_path):
    """TensorFlow's checkpoint_interval and step_counter: save is called every step and writes
    every 3rd, numbered by the step counter, the last 2 kept; check_interval=False forces one."""
    s = td.MirroredStrategy(cpus(2))
    with s.scope():
        w = td.Variable(np.zeros(2, np.float32), aggregation="SUM")
    step = np.zeros((), np.int64)
    manager = td.CheckpointManager(td.Checkpoint(w=w), tmp_path, max_to_keep=2, checkpoint_interval=3,
                                   step_counter=lambda: step)
    assert manager.checkpoint_interval == 3
    written = []
    for k in range(1, 12):
        step[...] = k
        w.assign(np.full(2, float(k), np.float32))
        if manager.save() is not None:
            written.append(k)
    assert written == [1, 4, 7, 10]
    assert [pathlib.Path(p).name for p in manager.checkpoints] == ["ckpt-7.tutti", "ckpt-10.tutti"]
    assert manager.save(check_interval=False) == str(tmp_path / "ckpt-11.tutti")
    assert manager.save() is None  # step 11 again: the interval counts from the forced save
    restored = td.Variable(np.zeros(2, np.float32), aggregation="SUM")
    assert td.CheckpointManager(td.Checkpoint(w=restored), tmp_path).restore_or_initialize() == 11
    assert restored.numpy().tolist() == [11.0, 11.0]
    with pytest.raises(ValueError, match="step_counter must be provided"):
        td.CheckpointManager(td.Checkpoint(w=w), tmp_path, checkpoint_interval=2)
    with pytest.raises(ValueError, match="at least 1 step"):
        td.CheckpointManager(td.Checkpoint(w=w), tmp_path, checkpoint_interval=0, step_counter=lambda: 0)
    s.close()


def test_a_checkpoint_restores_variables_and_arrays_as_saved(tmp_path):
    s = td.MirroredStrategy(cpus(2))
    with s.scope():
        w = td.Variable(np.arange(6, dtype=np.float32).reshape(2, 3), aggregation="SUM")
        counts = np.array([1, 2, 3], np.int64)
        ckpt = td.Checkpoint(weights=w, counts=counts)
        manager = td.CheckpointManager(ckpt, tmp_path, max_to_keep=2)
        assert manager.restore_or_initialize() is None and manager.latest_checkpoint is None
        for step in (10, 20, 30):
            w.assign(np.full((2, 3), float(step), np.float32))
            counts[...] = step
            path = manager.save(checkpoint_number=step)
        assert path == str(tmp_path / "ckpt-30.tutti") and manager.latest_checkpoint == path
        assert [pathlib.Path(p).name for p in manager.checkpoints] == ["ckpt-20.tutti", "ckpt-30.tutti"]
        assert manager.save() == str(tmp_path / "ckpt-31.tutti")  # one past the last step

        # A fresh job's objects, restored: every copy of the variable, the array in place.
        w2 = td.Variable(np.zeros((2, 3), np.float32), aggregation="SUM")
        counts2 = np.zeros(3, np.int64)
        restored = td.Checkpoint(weights=w2, counts=counts2)
        assert td.CheckpointManager(restored, tmp_path).restore_or_initialize() == 31
        assert restored.step == 31 and counts2.tolist() == [30, 30, 30]
        copies = s.experimental_local_results(s.run(lambda: w2.numpy()))
        assert all((c == 30.0).all() for c in copies) and len(copies) == 2

        # Another shape, a missing name, the wrong kind of object: errors, nothing assigned.
        other = np.zeros(4, np.float32)
        with pytest.raises(ValueError, match="weights was saved as float32 of shape \\(2, 3\\)"):
            td.CheckpointManager(td.Checkpoint(counts=counts2, weights=other), tmp_path).restore_or_initialize()
        with pytest.raises(tutti.TuttiError, match="no such variable"):
            td.CheckpointManager(td.Checkpoint(bias=other), tmp_path).restore_or_initialize()
        with pytest.raises(TypeError, match="numpy arrays"):
            td.Checkpoint(x=[1, 2])
        with pytest.raises(ValueError, match="max_to_keep"):
            td.CheckpointManager(ckpt, tmp_path, max_to_keep=0)
        frozen = np.zeros(3, np.int64)
        frozen.flags.writeable = False
        with pytest.raises(ValueError, match="read-only"):
            td.CheckpointManager(td.Checkpoint(counts=frozen), tmp_path).restore_or_initialize()
        with pytest.raises(ValueError, match="not a step"):
            manager.save(checkpoint_number=2**64)
        # An earlier step than the latest there is refused: keeping the last by step would
        # drop it.
        with pytest.raises(tutti.TuttiError, match="holds a later one"):
            manager.save(checkpoint_number=5)
        # A big-endian array restores the values, not their bytes swapped.
        swapped = np.zeros(3, ">i8")
        td.CheckpointManager(td.Checkpoint(counts=swapped), tmp_path).restore_or_initialize()
        assert swapped.tolist() == [30, 30, 30]
    (tmp_path / "ckpt-99.tutti").write_bytes(b"TUTTICKP" + bytes(100))
    with pytest.raises(tutti.TuttiError, match="ckpt-99.tutti.*version"):
        manager.restore_or_initialize()


CHECKPOINT_WORKER = textwrap.dedent(
    """
    import json, os, sys, numpy as np, tutti.distribute as td
    rank = int(os.environ["TUTTI_RANK"])
    directory = os.environ["CKPT_DIRS"].split(os.pathsep)[rank]  # no shared file system
    s = td.MultiWorkerMirroredStrategy()
    with s.scope():
        w = td.Variable(np.full(3, 100.0 * (rank + 1), np.float32), aggregation="MEAN")
        ckpt = td.Checkpoint(w=w)
        manager = td.CheckpointManager(ckpt, directory, max_to_keep=3)
        first = manager.restore_or_initialize()
        s.run(lambda: w.assign_add(np.full(3, td.get_replica_context().replica_id_in_sync_group, np.float32)))
        manager.save()
    print("RESULT " + json.dumps({"first": first, "w": w.numpy().tolist(), "files": sorted(os.listdir(directory)) if os.path.isdir(directory) else None}),
          flush=True)
    """
)


def test_workers_save_through_the_chief_and_restore_its_checkpoint(tmp_path):
    dirs = [tmp_path / "chief", tmp_path / "worker"]
    os.environ["CKPT_DIRS"] = os.pathsep.join(map(str, dirs))
    try:
        first = run_workers(CHECKPOINT_WORKER, 2)
        second = run_workers(CHECKPOINT_WORKER, 2)
    finally:
        del os.environ["CKPT_DIRS"]
    # Both start from the chief's 100 and add the mean of the replica ids (0.5); the chief alone
    # writes, and the second job restores the chief's checkpoint on both workers.
    for r in first:
        assert r["first"] is None and r["w"] == [100.5] * 3, r
    for r in second:
        assert r["first"] == 1 and r["w"] == [101.0] * 3, r
    assert first[0]["files"] == ["ckpt-1.tutti"] and second[0]["files"] == ["ckpt-1.tutti", "ckpt-2.tutti"]
    assert first[1]["files"] is None and second[1]["files"] is None  # no directory made there


def _ids(batches):
    """The example ids of per-replica batches (features: a column of ids), per local replica."""
    out = []
    for b in batches:
        values = b.values if isinstance(b, td.PerReplica) else (b,)
        out.append([v[0][:, 0].astype(int).tolist() for v in values])
    return out


def _examples(n):
    """Examples (features, label) whose first feature is the example's id."""
    return [(np.array([i, i * 0.5], np.float32), np.int64(i % 3)) for i in range(n)]


def test_gather_concatenates_uneven_values_in_replica_order():
    s = td.MirroredStrategy(cpus(3))
    parts = [np.arange(k * 2, dtype=np.int32).reshape(k, 2) + 100 * k for k in (1, 3, 0)]
    out = s.gather(td.PerReplica(parts), axis=0)
    assert out.tolist() == np.concatenate(parts).tolist()
    assert s.gather(td.PerReplica([p.T for p in parts]), axis=-1).shape == (2, 4)
    with pytest.raises(ValueError, match="differ other than in length"):
        s.gather(td.PerReplica([np.zeros((1, 2)), np.zeros((1, 3)), np.zeros((1, 2))]), axis=0)
    with pytest.raises(ValueError, match="axis 2 is out of range"):
        s.gather(np.zeros((2, 2)), axis=2)


def test_values_from_a_function_and_datasets_split_across_the_replicas():
    s = td.MirroredStrategy(cpus(2))
    v = s.experimental_distribute_values_from_function(lambda c: (c.replica_id_in_sync_group, c.num_replicas_in_sync))
    assert v.values == ((0, 2), (1, 2))
    global_batches = [_stack(_examples(25)[i : i + 8]) for i in range(0, 25, 8)]
    for policy in ["AUTO", "DATA", "OFF"]:
        seen = _ids(s.experimental_distribute_dataset(global_batches, td.InputOptions(policy)))
        # 8 rows: 4 and 4; the last batch of 1: 1 and none.
        assert [[len(r) for r in step] for step in seen] == [[4, 4]] * 3 + [[1, 0]], policy
        assert sorted(i for step in seen for r in step for i in r) == list(range(25)), policy
    files = FILES(5)
    seen = _ids(s.experimental_distribute_dataset(td.FileDataset(files, read_file, 8), td.InputOptions("FILE")))
    assert sorted(i for step in seen for r in step for i in r) == list(range(25))
    with pytest.raises(ValueError, match="needs a tutti.distribute.FileDataset"):
        s.experimental_distribute_dataset(global_batches, td.InputOptions("FILE"))

    def dataset_fn(ctx):
        assert (ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync) == (1, 0, 2)
        per_replica = ctx.get_per_replica_batch_size(8)
        ex = _examples(25)[ctx.input_pipeline_id :: ctx.num_input_pipelines]
        return [_stack(ex[i : i + per_replica]) for i in range(0, len(ex), per_replica)]

    seen = _ids(s.distribute_datasets_from_function(dataset_fn))
    assert [[len(r) for r in step] for step in seen] == [[4, 4]] * 3 + [[1, 0]]
    assert sorted(i for step in seen for r in step for i in r) == list(range(25))
    with pytest.raises(ValueError, match="not divisible"):
        td.InputContext(1, 0, 3).get_per_replica_batch_size(8)
    with s.scope():
        for batch in s.experimental_distribute_dataset(global_batches):
            total = s.reduce("SUM", s.run(lambda b: np.float32(len(b[0])), args=(batch,)))
        assert total == 1.0  # the last step's rows


def test_datasets_fetch_to_the_replicas_devices_ahead_of_the_steps():
    s = td.MirroredStrategy(cpus(2))
    global_batches = [_stack(_examples(25)[i : i + 8]) for i in range(0, 25, 8)]
    plain = list(s.experimental_distribute_dataset(global_batches))
    options = td.InputOptions(experimental_fetch_to_device=True, experimental_per_replica_buffer_size=2)
    placed = list(s.experimental_distribute_dataset(global_batches, options))
    assert len(placed) == len(plain) == 4
    for host, dev in zip(plain, placed):
        for h, d in zip(host.values, dev.values):
            assert isinstance(d, tuple) and all(isinstance(t, td.DeviceTensor) for t in d)
            assert d[0].device_kind == "cpu" and d[0].shape == h[0].shape
            np.testing.assert_array_equal(d[0].numpy(), h[0])
            np.testing.assert_array_equal(d[1].numpy(), h[1])

    # A replica function takes its batch where it lies.
    def rows(batch):
        x, _ = batch
        return td.get_replica_context().all_reduce("SUM", x).numpy()

    sums = s.experimental_local_results(s.run(rows, args=(placed[0],)))
    np.testing.assert_array_equal(sums[0], plain[0].values[0][0] + plain[0].values[1][0])

    # At most the buffer ahead: after one step is taken, that one and 2 more read.
    pulled = []

    def counted():
        for b in global_batches:
            pulled.append(1)
            yield b

    it = iter(s.experimental_distribute_dataset(counted(), options))
    next(it)

    def settle(want):
        deadline = time.monotonic() + 20
        while len(pulled) < want and time.monotonic() < deadline:
            time.sleep(0.005)
        time.sleep(0.05)
        assert len(pulled) == want

    settle(3)
    assert len(list(it)) == 3
    # An error reaches the caller in its place, after the steps before it.

    def failing():
        yield global_batches[0]
        raise OSError("disk on fire")

    it = iter(s.experimental_distribute_dataset(failing(), options))
    next(it)
    with pytest.raises(OSError, match="disk on fire"):
        next(it)
    with pytest.raises(ValueError, match="at least 1"):
        td.InputOptions(experimental_per_replica_buffer_size=0)
    # From a function too; and a closed strategy is an error, not a crash.
    ds = s.distribute_datasets_from_function(lambda ctx: [global_batches[0][0][:4]] * 2, options)
    (step,) = list(ds)
    assert [t.shape for t in step.values] == [(4, 2), (4, 2)]
    it = iter(s.experimental_distribute_dataset(global_batches, options))
    s.close()
    with pytest.raises(ValueError, match="closed"):
        next(it)


def _stack(examples):
    return (np.stack([e[0] for e in examples]), np.stack([e[1] for e in examples]))


def FILES(n):  # noqa: N802 - a table of file names
    return [f"part-{k}" for k in range(n)]


def read_file(name):
    """File part-k holds examples 5k .. 5k+4."""
    k = int(name.rpartition("-")[2])
    return _examples(25)[5 * k : 5 * k + 5]


INPUT_WORKER = textwrap.dedent(
    """
    import json, os, numpy as np, tutti.distribute as td, warnings
    s = td.MultiWorkerMirroredStrategy()
    examples = [(np.array([i, i * 0.5], np.float32), np.int64(i % 3)) for i in range(25)]
    stack = lambda ex: (np.stack([e[0] for e in ex]), np.stack([e[1] for e in ex]))
    batches = [stack(examples[i : i + 8]) for i in range(0, 25, 8)]
    read = lambda name: examples[5 * int(name[5:]) : 5 * int(name[5:]) + 5]
    ids = lambda ds: sorted(int(i) for b in ds for i in b[0][:, 0])
    seen = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        seen["AUTO_DATA"] = ids(s.experimental_distribute_dataset(batches))
    seen["warned"] = any("sharding by DATA" in str(w.message) for w in caught)
    for p in ["DATA", "OFF"]:
        seen[p] = ids(s.experimental_distribute_dataset(batches, td.InputOptions(p)))
    files = td.FileDataset([f"part-{k}" for k in range(5)], read, 8)
    seen["FILE"] = ids(s.experimental_distribute_dataset(files, td.InputOptions("FILE")))
    seen["AUTO_FILE"] = ids(s.experimental_distribute_dataset(files))
    def fn(ctx):
        mine = examples[ctx.input_pipeline_id :: ctx.num_input_pipelines]
        k = ctx.get_per_replica_batch_size(8)
        return [stack(mine[i : i + k]) for i in range(0, len(mine), k)]
    seen["FUNCTION"] = ids(s.distribute_datasets_from_function(fn))
    rank = s.experimental_distribute_values_from_function(lambda c: c.replica_id_in_sync_group)
    # Uneven parts along axis 1: worker 0 has 1 column, worker 1 has 2.
    part = np.full((2, rank + 1), rank + 1.5, np.float64)
    seen["gather"] = s.gather(part, axis=1).tolist()
    seen["rank"] = rank
    # Values the workers disagree on: an error on both, not a wait for the timeout.
    seen["refused"] = []
    for mine, axis in [(np.zeros((2, 2)) if rank == 0 else np.zeros(3), 1),
                       (np.zeros((2, 2)) if rank == 0 else np.zeros((2, 2, 1)), 0)]:
        try:
            s.gather(mine, axis=axis)
            seen["refused"].append(None)
        except ValueError as e:
            seen["refused"].append(str(e))
    seen["after"] = s.gather(part, axis=1).tolist()  # and the strategy goes on
    r = s.cluster_resolver
    seen["resolver"] = [r.task_type, r.task_id, r.cluster_spec().num_tasks("worker")]
    print("RESULT " + json.dumps(seen), flush=True)
    """
)


def test_every_auto_shard_policy_sees_every_example_once_across_workers():
    results = run_workers(INPUT_WORKER, 2)
    for policy in ["AUTO_DATA", "DATA", "FILE", "AUTO_FILE", "FUNCTION"]:
        together = sorted(results[0][policy] + results[1][policy])
        assert together == list(range(25)), (policy, results[0][policy], results[1][policy])
        assert results[0][policy] and results[1][policy], policy  # both workers had a share
    for r in results:
        assert r["OFF"] == list(range(25)), r  # OFF: every worker reads everything
        assert r["warned"], r
        assert r["gather"] == r["after"] == [[1.5, 2.5, 2.5], [1.5, 2.5, 2.5]], r
        assert all(r["refused"]), r
        assert "differ between workers" in r["refused"][1], r
    assert sorted(r["resolver"] for r in results) == [["worker", 0, 2], ["worker", 1, 2]]
    assert "axis 1 is out of range" in results[1]["refused"][0]
    assert "another worker's values were refused" in results[0]["refused"][0]
    assert sorted(r["rank"] for r in results) == [0, 1]


def _regression(n=24, features=3, seed=7):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, features)).astype(np.float32)
    y = (x @ np.array([0.5, -1.0, 2.0], np.float32)[:features] + 0.25).astype(np.float32)
    return x, y


def _numpy_reference(opt_name, steps, x, y):
    """The same optimizer in numpy on the whole batch, one replica."""
    w, b = np.zeros(x.shape[1], np.float32), np.zeros((), np.float32)
    state = {}
    for t in range(1, steps + 1):
        err = x @ w + b - y
        grads = [2 * x.T @ err / len(x), np.float32(2 * err.sum() / len(x))]
        for k, (p, g) in enumerate(zip((w, b), grads)):
            if opt_name == "sgd":
                p -= np.float32(0.05) * g
            elif opt_name == "momentum":
                v = state.setdefault(k, np.zeros_like(p))
                v[...] = 0.9 * v - 0.05 * g
                p += v
            else:
                m, s2 = state.setdefault((k, "m"), np.zeros_like(p)), state.setdefault((k, "v"), np.zeros_like(p))
                m[...] = 0.9 * m + 0.1 * g
                s2[...] = 0.999 * s2 + 0.001 * g * g
                lr = 0.05 * np.sqrt(1 - 0.999**t) / (1 - 0.9**t)
                p -= (lr * m / (np.sqrt(s2) + 1e-7)).astype(np.float32)
    return w, b


@pytest.mark.parametrize("opt_name", ["sgd", "momentum", "adam"])
@pytest.mark.parametrize("make", [lambda: td.MirroredStrategy(cpus(3)), lambda: td.CentralStorageStrategy(cpus(2)),
                                  lambda: td.get_strategy()])
def test_optimizers_step_every_copy_with_the_global_batchs_gradient(opt_name, make):
    s = make()
    x, y = _regression()
    make_opt = {"sgd": lambda: td.optimizers.SGD(0.05), "momentum": lambda: td.optimizers.SGD(0.05, momentum=0.9),
                "adam": lambda: td.optimizers.Adam(0.05)}[opt_name]
    with s.scope():
        w = td.Variable(np.zeros(3, np.float32), name="w")
        b = td.Variable(np.zeros((), np.float32), name="b")
        opt = make_opt()
        loss_metric = td.metrics.Mean()
        batches = s.experimental_distribute_dataset([(x, y)], td.InputOptions("OFF"))
        (batch,) = list(batches)

        def step(batch):
            xs, ys = batch
            err = xs @ w.numpy() + b.numpy() - ys
            per_example = err**2
            loss_metric.update_state(per_example)
            loss = td.compute_average_loss(per_example, global_batch_size=len(x))
            n = len(x)
            opt.apply_gradients([(2 * xs.T @ err / n, w), (np.float32(2 * err.sum() / n), b)])
            return loss

        for _ in range(20):
            losses = s.run(step, args=(batch,))
        total_loss = s.reduce("SUM", losses)
    ref_w, ref_b = _numpy_reference(opt_name, 20, x, y)
    np.testing.assert_allclose(w.numpy(), ref_w, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(b.numpy(), ref_b, rtol=1e-4, atol=1e-5)
    assert opt.iterations == 20
    copies = s.experimental_local_results(s.run(lambda: w.numpy()))
    assert all(np.array_equal(c, copies[0]) for c in copies)
    # The metric read across replicas: the mean squared error over all 20 steps' examples.
    assert float(loss_metric.result()) > float(total_loss) > 0
    loss_metric.reset_state()
    assert float(loss_metric.result()) == 0.0


@pytest.mark.parametrize("pack", [1, 16, 32 << 20])
def test_gradients_are_summed_in_packs_of_bytes_per_pack(pack):
    """apply_gradients sums neighbouring gradients of one dtype in one collective of at most
    bytes_per_pack (one larger alone): any pack size gives every variable its own sum."""
    s = td.MirroredStrategy(cpus(2))
    s._bytes_per_pack = pack
    shapes = [(3,), (), (2, 2), (5,), (1,)]
    dtypes = [np.float32, np.float32, np.float64, np.float64, np.float32]
    with s.scope():
        vs = [td.Variable(np.zeros(sh, dt)) for sh, dt in zip(shapes, dtypes)]
        opt = td.optimizers.SGD(1.0)

    def step():
        r = td.get_replica_context().replica_id_in_sync_group
        opt.apply_gradients([(np.full(sh, (k + 1) * (r + 1), dt), v)
                             for k, (sh, dt, v) in enumerate(zip(shapes, dtypes, vs))])

    s.run(step)
    for k, (v, dt) in enumerate(zip(vs, dtypes)):
        assert v.numpy().dtype == dt
        np.testing.assert_array_equal(v.numpy(), np.full(shapes[k], -3.0 * (k + 1), dt))


@pytest.mark.parametrize("opt_name", ["momentum", "adam"])
def test_an_optimizers_state_is_saved_and_restored_with_the_variables(opt_name, tmp_path):
    """tf.train.Checkpoint(optimizer=...): 10 steps, save, new variables and optimizer restored
    from it, 10 more land where 20 uninterrupted steps do; without the optimizer they do not."""
    s = td.MirroredStrategy(cpus(3))
    x, y = _regression()
    make_opt = {"momentum": lambda: td.optimizers.SGD(0.05, momentum=0.9), "adam": lambda: td.optimizers.Adam(0.05)}

    def fresh():
        with s.scope():
            return td.Variable(np.zeros(3, np.float32), name="w"), make_opt[opt_name]()

    def train(w, opt, steps):
        def step():
            err = x @ w.numpy() - y
            opt.apply_gradients([(2 * x.T @ err / len(x) / 3, w)])
        for _ in range(steps):
            s.run(step)
        return w.numpy()

    reference = train(*fresh(), 20)
    w, opt = fresh()
    train(w, opt, 10)
    td.CheckpointManager(td.Checkpoint(w=w, optimizer=opt), tmp_path).save()

    def resume(with_optimizer):
        w, opt = fresh()
        objects = {"w": w, "optimizer": opt} if with_optimizer else {"w": w}
        assert td.CheckpointManager(td.Checkpoint(**objects), tmp_path).restore_or_initialize() == 1
        if with_optimizer:
            assert opt.iterations == 10
        return train(w, opt, 10)

    np.testing.assert_array_equal(resume(True), reference)
    assert not np.array_equal(resume(False), reference)
    # A checkpoint that holds none of the optimizer's state (saved without it): the variables are
    # restored and the optimizer starts afresh, with a warning, as TensorFlow's does.
    td.CheckpointManager(td.Checkpoint(w=w), tmp_path / "plain").save()
    w2, opt2 = fresh()
    with pytest.warns(UserWarning, match="no state of optimizer 'optimizer'"):
        td.CheckpointManager(td.Checkpoint(w=w2, optimizer=opt2), tmp_path / "plain").restore_or_initialize()
    np.testing.assert_array_equal(w2.numpy(), w.numpy())
    assert opt2.iterations == 0
    # Another optimizer's state is not this one's: an error naming the slot, nothing restored.
    w, _ = fresh()
    other = td.optimizers.Adam(0.05) if opt_name == "momentum" else td.optimizers.SGD(0.05, momentum=0.9)
    with pytest.raises(tutti.TuttiError, match="optimizer/w/"):
        td.CheckpointManager(td.Checkpoint(w=w, optimizer=other), tmp_path).restore_or_initialize()
    assert not w.numpy().any()
    # Hyper-parameters no rule could run with are refused where the optimizer is made.
    for bad, match in [(lambda: td.optimizers.SGD(0.1, momentum=1.5), "momentum 1.5"),
                       (lambda: td.optimizers.Adam(0.1, beta_2=1.0), "beta_2 1.0"),
                       (lambda: td.optimizers.Adam(float("inf")), "learning_rate inf")]:
        with pytest.raises(ValueError, match=match):
            bad()


def test_a_float16_variables_optimizer_steps_in_float32(tmp_path):
    """As on the ps tasks and in Rust: a float16 variable's slots are float32, each step is taken
    in float32 and the copy rounded to float16 once, and a checkpoint holds float32 slots."""
    s = td.MirroredStrategy(cpus(2))
    with s.scope():
        h = td.Variable(np.array([1.0, -2.0, 0.5], np.float16), name="h")
        opt = td.optimizers.Adam(0.01)
    grads = [np.array([0.1, -0.3, 0.2], np.float16), np.array([0.05, 0.0, -0.7], np.float16)]

    def step():
        opt.apply_gradients([(grads[td.get_replica_context().replica_id_in_sync_group], h)])

    w, m, v = h.numpy().copy(), np.zeros(3, np.float32), np.zeros(3, np.float32)
    g = (grads[0] + grads[1]).astype(np.float32)
    for t in range(1, 8):
        s.run(step)
        m = 0.9 * m + (1 - 0.9) * g
        v = 0.999 * v + (1 - 0.999) * g * g
        lr = 0.01 * np.sqrt(1 - 0.999**t) / (1 - 0.9**t)
        w = (w.astype(np.float32) - (lr * m / (np.sqrt(v) + 1e-7)).astype(np.float32)).astype(np.float16)
        np.testing.assert_array_equal(h.numpy(), w, err_msg=f"step {t}")
    assert h.numpy().dtype == np.float16
    td.CheckpointManager(td.Checkpoint(h=h, opt=opt), tmp_path).save()
    slots = {"opt/h/m": np.zeros(3, np.float32), "opt/h/v": np.zeros(3, np.float32)}
    td.CheckpointManager(td.Checkpoint(**slots), tmp_path).restore_or_initialize()
    np.testing.assert_array_equal(slots["opt/h/m"], m)
    np.testing.assert_array_equal(slots["opt/h/v"], v)


def test_metrics_read_across_replicas():
    s = td.MirroredStrategy(cpus(2))
    with s.scope():
        acc, total = td.metrics.SparseCategoricalAccuracy(), td.metrics.Sum()

        def step(i):
            # Replica 0 gets 2 of 2 right, replica 1 gets 1 of 2.
            pred = np.array([[0.9, 0.1], [0.2, 0.8]]) if i == 0 else np.array([[0.9, 0.1], [0.9, 0.1]])
            acc.update_state(np.array([0, 1]), pred)
            total.update_state(np.array([i + 1.0]))

        s.run(step, args=(td.PerReplica([0, 1]),))
    assert float(acc.result()) == 0.75 and float(total.result()) == 3.0
    with pytest.raises(RuntimeError, match="cross-replica context"):
        s.run(acc.result)
    with pytest.raises(TypeError, match="float variables"):
        td.optimizers.SGD(0.1).apply_gradients([(np.ones(2), td.Variable(np.zeros(2, np.int32)))])


TRAIN_WORKER = textwrap.dedent(
    """
    import json, numpy as np, tutti.distribute as td
    rng = np.random.default_rng(7)
    x = rng.standard_normal((24, 3)).astype(np.float32)
    y = (x @ np.array([0.5, -1.0, 2.0], np.float32) + 0.25).astype(np.float32)
    s = td.MultiWorkerMirroredStrategy()
    with s.scope():
        w = td.Variable(np.zeros(3, np.float32))
        b = td.Variable(np.zeros((), np.float32))
        opt = td.optimizers.Adam(0.05)
        mse = td.metrics.Mean()
        (batch,) = list(s.experimental_distribute_dataset([(x, y)], td.InputOptions("DATA")))
        def step(batch):
            xs, ys = batch
            err = xs @ w.numpy() + b.numpy() - ys
            mse.update_state(err**2)
            opt.apply_gradients([(2 * xs.T @ err / 24, w), (np.float32(2 * err.sum() / 24), b)])
        for _ in range(20):
            s.run(step, args=(batch,))
    print("RESULT " + json.dumps({"w": w.numpy().tolist(), "b": float(b.numpy()), "mse": float(mse.result()),
                                 "rows": len(batch[0])}), flush=True)
    """
)


def test_workers_train_with_an_optimizer_to_the_one_replica_weights():
    results = run_workers(TRAIN_WORKER, 2)
    x, y = _regression()
    ref_w, ref_b = _numpy_reference("adam", 20, x, y)
    assert [r["rows"] for r in results] == [12, 12]
    assert results[0]["w"] == results[1]["w"] and results[0]["b"] == results[1]["b"]
    assert results[0]["mse"] == results[1]["mse"] > 0  # read across both workers
    np.testing.assert_allclose(results[0]["w"], ref_w, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(results[0]["b"], ref_b, rtol=1e-4, atol=1e-5)


def test_tf_config_cluster_resolver_reads_the_environment(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    empty = td.cluster_resolver.TFConfigClusterResolver()
    assert empty.cluster_spec().as_dict() == {} and empty.task_type is None and empty.master() == ""
    config = {"cluster": {"chief": ["host0:2222"], "worker": ["host1:2222", "host2:2222"], "ps": ["host3:2222"]},
              "task": {"type": "worker", "index": 1}, "rpc_layer": "grpc"}
    monkeypatch.setenv("TF_CONFIG", json.dumps(config))
    r = td.cluster_resolver.TFConfigClusterResolver()
    assert (r.task_type, r.task_id, r.rpc_layer) == ("worker", 1, "grpc")
    assert r.cluster_spec() == td.ClusterSpec(config["cluster"]) and r.cluster_spec().num_tasks("worker") == 2
    assert r.master() == "grpc://host2:2222" and r.master("ps", 0, rpc_layer="http") == "http://host3:2222"
    assert td.cluster_resolver.TFConfigClusterResolver(task_type="chief", task_id=0).master() == "grpc://host0:2222"
    with pytest.raises(ValueError, match="no such job 'evaluator'"):
        r.cluster_spec().num_tasks("evaluator")
    assert isinstance(r.num_accelerators(), dict)
    assert td.MirroredStrategy(cpus(2)).cluster_resolver is None
    monkeypatch.setenv("TF_CONFIG", "{not json")
    with pytest.raises(ValueError, match="TF_CONFIG is not valid JSON"):
        td.cluster_resolver.TFConfigClusterResolver()
    with pytest.raises(ValueError, match="names no task of this process"):
        td.MultiWorkerMirroredStrategy(cluster_resolver=td.SimpleClusterResolver({}))


def test_resolvers_and_training_pieces_take_edge_cases_as_tensorflow_does():
    spec = td.ClusterSpec({"worker": {0: "a:1", 2: "c:3"}, "ps": ["p:1"]})
    assert spec.task_indices("worker") == [0, 2] and spec.job_tasks("worker") == ["a:1", None, "c:3"]
    assert spec.task_address("worker", 2) == "c:3" and spec.as_dict()["worker"] == {0: "a:1", 2: "c:3"}
    assert not td.ClusterSpec({}) and spec
    r = td.SimpleClusterResolver(spec, "grpc://m:1", "worker", 2, rpc_layer="grpc")
    assert r.master() == "grpc://m:1" and r.master("ps", 0) == "grpc://p:1"
    with pytest.raises(ValueError, match="has no task 1"):
        r.master("worker", 1)
    # A replica's empty share of a short last batch: a loss of 0 and no observation.
    assert td.compute_average_loss(np.zeros(0, np.float32), global_batch_size=0) == 0
    with td.MirroredStrategy(cpus(2)).scope():
        with pytest.raises(ValueError, match="pass global_batch_size"):
            td.compute_average_loss(np.ones(3))
    acc = td.metrics.SparseCategoricalAccuracy()
    acc.update_state(np.zeros(0, np.int64), np.zeros((0, 3)))
    assert float(acc.result()) == 0.0
    opt = td.optimizers.SGD(0.5)
    v = td.Variable(np.ones(2, np.float32))
    opt.apply_gradients([(None, v), (np.ones(2, np.float32), v)])  # a None gradient is skipped
    assert v.numpy().tolist() == [0.5, 0.5] and opt.iterations == 1


EXAMPLE = str(pathlib.Path(PACKAGE) / "examples" / "train.py")


def _example(*args):
    env = dict(os.environ, PYTHONPATH=PACKAGE + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for k in ("TF_CONFIG", "TUTTI_RANK", "TUTTI_WORLD_SIZE"):
        env.pop(k, None)
    out = subprocess.run([sys.executable, EXAMPLE, "--json", *args], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("strategy", ["default", "one-device", "mirrored", "central-storage"])
def test_the_guides_custom_loop_trains_to_the_reference_and_resumes(strategy, tmp_path):
    whole = _example("--strategy", strategy, "--replicas", "3", "--steps", "40")
    np.testing.assert_allclose(whole["weights"], whole["reference_weights"], atol=1e-5)
    assert whole["restored_step"] is None and whole["mse"] > 0
    ck = str(tmp_path)
    _example("--strategy", strategy, "--replicas", "3", "--steps", "20", "--checkpoint-dir", ck)
    resumed = _example("--strategy", strategy, "--replicas", "3", "--steps", "20", "--checkpoint-dir", ck, "--resume")
    assert resumed["restored_step"] == 20
    assert resumed["weights"] == whole["weights"] and resumed["reference_weights"] == whole["reference_weights"]


@pytest.mark.parametrize("strategy", ["default", "mirrored", "central-storage"])
def test_the_guides_custom_loop_matches_the_rust_examples_weights(strategy):
    """The Python loop and the Rust example (``cargo run --example train``, built beside the
    libtutti under test: ``cargo test`` builds it) train the same model to the same weights."""
    lib = os.environ.get("TUTTI_LIBRARY")
    exe = pathlib.Path(lib).parent / "examples" / "train" if lib else None
    if exe is None or not exe.is_file():
        assert os.environ.get("TUTTI_REQUIRE_PYTHON") != "1", f"the Rust example is not built at {exe}"
        pytest.skip(f"the Rust example is not built beside the library ({exe})")
    args = ["--strategy", strategy, "--replicas", "3", "--steps", "40"]
    out = subprocess.run([str(exe), *args, "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rust = json.loads(out.stdout.strip().splitlines()[-1])
    python = _example(*args)
    assert rust["strategy"] == python["strategy"] and rust["replicas"] == python["replicas"]
    np.testing.assert_allclose(python["weights"], rust["weights"], atol=1e-5)
    np.testing.assert_allclose(python["reference_weights"], rust["reference_weights"], atol=1e-6)


def test_the_guides_custom_loop_across_workers():
    code = textwrap.dedent(
        f"""
        import contextlib, io, runpy, sys
        sys.argv = [{EXAMPLE!r}, "--strategy", "multi-worker", "--steps", "40", "--json"]
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            runpy.run_path({EXAMPLE!r}, run_name="__main__")
        print("RESULT " + out.getvalue().strip().splitlines()[-1], flush=True)
        """
    )
    results = run_workers(code, 2)
    assert results[0]["weights"] == results[1]["weights"] and results[0]["replicas"] == 2
    np.testing.assert_allclose(results[0]["weights"], results[0]["reference_weights"], atol=1e-5)


@pytest.mark.parametrize("strategy", ["one-device", "mirrored", "central-storage", "multi-worker"])
def test_the_guides_custom_loop_on_xla_devices(strategy):
    """The example's loop with its replicas on XLA devices (``--device xla``, 4 of the PJRT
    plugin's): the full batch's weights. Without XLA the example says UNAVAILABLE and the test is
    skipped (TUTTI_REQUIRE_XLA=1: it fails)."""
    env = dict(os.environ, PYTHONPATH=PACKAGE + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for k in ("TF_CONFIG", "TUTTI_RANK", "TUTTI_WORLD_SIZE", "TUTTI_PJRT_OPTIONS"):
        env.pop(k, None)
    args = ["--strategy", strategy, "--device", "xla", "--replicas", "4", "--steps", "40", "--json"]
    out = subprocess.run([sys.executable, EXAMPLE, *args], env=env, capture_output=True, text=True, timeout=300)
    if out.returncode != 0 and "TUTTI_ERROR_UNAVAILABLE" in out.stderr and os.environ.get("TUTTI_REQUIRE_XLA") != "1":
        pytest.skip("no XLA here: " + out.stderr.strip().splitlines()[-1])
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["device"] == "xla" and r["replicas"] == (1 if strategy == "one-device" else 4), r
    np.testing.assert_allclose(r["weights"], r["reference_weights"], atol=1e-5)


def test_the_guides_custom_loop_under_tpu_strategy(tmp_path, monkeypatch):
    """The example's loop under TPUStrategy, set up as the guides do, over the PJRT plugin's
    devices (TUTTI_PJRT_PLUGIN; the CPU plugin's four here): the full batch's weights, and a
    checkpoint that resumes. Where the library has no XLA or no plugin is found, the example
    fails saying UNAVAILABLE, and the test is skipped (TUTTI_REQUIRE_XLA=1: it fails)."""
    monkeypatch.setenv("TUTTI_PJRT_OPTIONS", os.environ.get("TUTTI_PJRT_OPTIONS", "cpu_device_count=4"))
    env = dict(os.environ, PYTHONPATH=PACKAGE + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for k in ("TF_CONFIG", "TUTTI_RANK", "TUTTI_WORLD_SIZE"):
        env.pop(k, None)
    probe = subprocess.run([sys.executable, EXAMPLE, "--json", "--strategy", "tpu", "--steps", "40"], env=env,
                           capture_output=True, text=True, timeout=300)
    required = os.environ.get("TUTTI_REQUIRE_XLA") == "1"
    if probe.returncode != 0 and "TUTTI_ERROR_UNAVAILABLE" in probe.stderr and not required:
        pytest.skip("no XLA here: " + probe.stderr.strip().splitlines()[-1])
    assert probe.returncode == 0, probe.stderr
    whole = json.loads(probe.stdout.strip().splitlines()[-1])
    assert whole["device"] == "xla" and whole["replicas"] == 4, whole
    np.testing.assert_allclose(whole["weights"], whole["reference_weights"], atol=1e-5)
    ck = str(tmp_path)
    _example("--strategy", "tpu", "--steps", "20", "--checkpoint-dir", ck)
    resumed = _example("--strategy", "tpu", "--steps", "20", "--checkpoint-dir", ck, "--resume")
    assert resumed["restored_step"] == 20
    np.testing.assert_allclose(resumed["weights"], whole["weights"], atol=1e-6)


def _ps_example(*args, timeout=180):
    """The example under parameter servers: a ps task, two workers and the chief, each a process
    of the example with its TF_CONFIG; the chief's JSON line (the others print nothing)."""
    pytest.importorskip("cloudpickle")
    socks = [socket.socket() for _ in range(4)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    addr = [f"127.0.0.1:{s.getsockname()[1]}" for s in socks]
    for s in socks:
        s.close()
    cluster = {"chief": [addr[0]], "worker": addr[1:3], "ps": [addr[3]]}
    procs = []
    for ty, i in [("chief", 0), ("worker", 0), ("worker", 1), ("ps", 0)]:
        env = dict(os.environ, TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": ty, "index": i}}),
                   TUTTI_TIMEOUT="60", TUTTI_JOB_TOKEN="ps-example-test-token")
        env["PYTHONPATH"] = PACKAGE + os.pathsep + env.get("PYTHONPATH", "")
        for k in ("TUTTI_RANK", "TUTTI_WORLD_SIZE"):
            env.pop(k, None)
        procs.append(subprocess.Popen([sys.executable, EXAMPLE, "--strategy", "parameter-server", "--json", *args],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = []
    try:
        for p in procs:  # the chief first: it ends the job
            out, err = p.communicate(timeout=timeout)
            assert p.returncode == 0, err
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    assert all(not o.strip() for o in outs[1:]), outs
    return json.loads(outs[0].strip().splitlines()[-1])


def test_the_guides_custom_loop_under_parameter_servers(tmp_path):
    """The example's loop under ParameterServerStrategy, as the Rust example trains it: each step
    one scheduled function per worker on its share of the batch, stepping the variables on the ps
    task asynchronously, so the weights come near the full batch's, not to its bits; a checkpoint
    the chief wrote resumes in a new job."""
    whole = _ps_example("--steps", "100")
    assert whole["replicas"] == 2 and whole["device"] == "cpu" and whole["restored_step"] is None, whole
    assert whole["loss"] < 1e-3 and 0 < whole["mse"], whole
    np.testing.assert_allclose(whole["weights"], whole["reference_weights"], atol=0.05)
    ck = str(tmp_path)
    first = _ps_example("--steps", "50", "--checkpoint-dir", ck)
    resumed = _ps_example("--steps", "50", "--checkpoint-dir", ck, "--resume")
    assert resumed["restored_step"] == 50 and first["restored_step"] is None, resumed
    assert resumed["reference_weights"] == whole["reference_weights"]
    np.testing.assert_allclose(resumed["weights"], whole["reference_weights"], atol=0.05)


PS_JOB = textwrap.dedent(
    """
    import json, os, numpy as np, tutti, tutti.distribute as td

    resolver = td.cluster_resolver.TFConfigClusterResolver()
    if resolver.task_type in ("worker", "ps"):
        td.Server(resolver.cluster_spec(), job_name=resolver.task_type, task_index=resolver.task_id,
                  protocol=resolver.rpc_layer or "grpc", start=True).join()
        print("RESULT " + json.dumps({"task": resolver.task_type}), flush=True)
        raise SystemExit(0)

    partitioners = td.experimental.partitioners
    strategy = td.ParameterServerStrategy(resolver, variable_partitioner=partitioners.FixedShardsPartitioner(3))
    with strategy.scope():
        w = td.Variable(np.zeros((6, 1), np.float32), name="w")
        b = td.Variable(np.zeros((), np.float32), name="b")
    assert td.get_strategy() is not strategy
    shards = {"fixed": w.num_shards, "scalar": b.num_shards,
              "max_size": partitioners.MaxSizePartitioner(max_shard_bytes=8)((6, 1), np.float32),
              "min_size": partitioners.MinSizePartitioner(min_shard_bytes=8, max_shards=4)((6, 1), np.float32)}
    true_w = np.arange(6, dtype=np.float32).reshape(6, 1) / 6
    optimizer = td.optimizers.SGD(0.1)

    def dataset_fn(input_context):
        rng = np.random.default_rng(input_context.input_pipeline_id)
        while True:
            x = rng.standard_normal((32, 6)).astype(np.float32)
            yield x, x @ true_w + 0.5

    coordinator = td.coordinator.ClusterCoordinator(strategy)
    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

    def step_fn(iterator):
        def replica_fn(x, y):
            err = x @ w.numpy() + b.numpy() - y
            optimizer.apply_gradients([(2 * x.T @ err / len(x), w), (np.float32(2 * np.mean(err)), b)])
            return np.float32(np.mean(err ** 2))
        x, y = next(iterator)
        return strategy.reduce("SUM", strategy.run(replica_fn, args=(x, y)), axis=None)

    losses = [coordinator.schedule(step_fn, args=(iterator,)) for _ in range(150)]
    coordinator.join()

    def raises(n):
        if n == 3:
            raise ValueError("a bad batch at 3")
        return n

    values = [coordinator.schedule(raises, args=(n,)) for n in range(6)]
    try:
        coordinator.join()
        raised = None
    except tutti.TuttiError as e:
        raised = [e.code, str(e)]
    try:
        values[3].fetch()
        fetched = None
    except tutti.TuttiError as e:
        fetched = e.code
    after = coordinator.schedule(lambda: "still here")
    # Optimizers with slots run on the ps tasks, for float64 and float16 variables too.
    with strategy.scope():
        v64 = td.Variable(np.zeros(3), name="v64")
        h16 = td.Variable(np.zeros(2, np.float16), name="h16")
    adam, heavy = td.optimizers.Adam(0.1), td.optimizers.SGD(0.1, momentum=0.9)

    def slots_on_ps():
        adam.apply_gradients([(np.ones(3), v64)])
        heavy.apply_gradients([(np.ones(2, np.float16), h16)])

    for _ in range(4):
        coordinator.schedule(slots_on_ps)
    coordinator.join()
    ps_steps = {"v64": v64.numpy().tolist(), "v64_dtype": str(v64.numpy().dtype),
                "h16": h16.numpy().astype(float).tolist(), "h16_dtype": str(h16.dtype)}
    # On the chief too, with the same slots: the momentum goes on.
    heavy.apply_gradients([(np.ones(2, np.float16), h16)])
    ps_steps["h16_after"] = h16.numpy().astype(float).tolist()
    def pipelines(input_context):
        while True:
            yield input_context.input_pipeline_id, input_context.num_input_pipelines

    ids = iter(coordinator.create_per_worker_dataset(pipelines))

    def pipeline(ids):
        import time
        time.sleep(0.05)  # 20 of them: each worker surely takes one
        return next(ids)

    seen = sorted({tuple(v.fetch()) for v in [coordinator.schedule(pipeline, args=(ids,)) for _ in range(20)]})
    # The coordinator saves the ps tasks' variables and restores them (in place, by assign).
    import tempfile
    directory = tempfile.mkdtemp()
    manager = td.CheckpointManager(td.Checkpoint(w=w, b=b), directory)
    saved, saved_b = w.numpy(), float(b.numpy())
    manager.save(checkpoint_number=150)
    w.assign(np.zeros((6, 1), np.float32))
    b.assign_add(np.float32(1.0))
    zeroed = float(np.abs(w.numpy()).sum())
    restored = manager.restore_or_initialize()
    checkpoint = [restored, zeroed, bool((w.numpy() == saved).all()), float(b.numpy()) == saved_b]
    # The optimizers' slots on the ps tasks go into the checkpoint too: restored, the next step
    # is the one that followed the save.
    opt_manager = td.CheckpointManager(td.Checkpoint(v64=v64, h16=h16, adam=adam, heavy=heavy), tempfile.mkdtemp())
    opt_manager.save(checkpoint_number=1)
    saved_state = adam._state(v64)

    def chief_step():
        adam.apply_gradients([(np.ones(3), v64)])
        heavy.apply_gradients([(np.ones(2, np.float16), h16)])
        return [v64.numpy().tolist(), h16.numpy().astype(float).tolist()]

    one_more = chief_step()
    chief_step()
    opt_manager.restore_or_initialize()
    state = adam._state(v64)
    optimizer_checkpoint = {
        "same_state": state[1] == saved_state[1] and all(np.array_equal(a, b) for a, b in zip(state[0], saved_state[0])),
        "t": state[1], "resumed": chief_step() == one_more, "iterations": adam.iterations}
    print("RESULT " + json.dumps({
        "seen": seen, "checkpoint": checkpoint,
        "shards": shards, "first": float(losses[0].fetch()), "last": float(losses[-1].fetch()),
        "w": w.numpy().ravel().tolist(), "b": float(b.numpy()), "raised": raised, "fetched": fetched,
        "after": after.fetch(), "workers": strategy.num_workers, "ps_steps": ps_steps,
        "optimizer_checkpoint": optimizer_checkpoint}), flush=True)
    """
)


def test_parameter_server_strategy_trains_through_the_cluster_coordinator():
    """The guide's parameter-server training: workers and a ps task serve, the chief's
    coordinator schedules steps over per-worker datasets; a step that raises fails join with its
    message, and the workers stay."""
    pytest.importorskip("cloudpickle")
    ports = []
    socks = []
    for _ in range(4):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    addr = [f"127.0.0.1:{p}" for p in ports]
    cluster = {"chief": [addr[0]], "worker": addr[1:3], "ps": [addr[3]]}
    tasks = [("ps", 0), ("worker", 0), ("worker", 1), ("chief", 0)]
    procs = []
    for ty, i in tasks:
        env = dict(os.environ, TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": ty, "index": i}}),
                   TUTTI_TIMEOUT="60", TUTTI_JOB_TOKEN="ps-python-test-token")
        env["PYTHONPATH"] = PACKAGE + os.pathsep + env.get("PYTHONPATH", "")
        for k in ("TUTTI_RANK", "TUTTI_WORLD_SIZE"):
            env.pop(k, None)
        procs.append(subprocess.Popen([sys.executable, "-c", PS_JOB], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    results = _results(procs[::-1], 150)  # the chief first: it ends the job
    chief = results[0]
    assert [r.get("task") for r in results[1:]] == ["worker", "worker", "ps"]
    assert chief["shards"] == {"fixed": 3, "scalar": 1, "max_size": [3, 1], "min_size": [3, 1]}, chief
    assert chief["last"] < 1e-4 < chief["first"], chief
    np.testing.assert_allclose(chief["w"], np.arange(6) / 6, atol=1e-3)
    assert abs(chief["b"] - 0.5) < 1e-3
    code, message = chief["raised"]
    assert code == "TUTTI_ERROR_STEP_FAILED" and "ValueError: a bad batch at 3" in message, message
    assert chief["fetched"] == "TUTTI_ERROR_STEP_FAILED"
    assert chief["after"] == "still here" and chief["workers"] == 2
    # Adam's step on a constant gradient is its learning rate; momentum's sum of -0.1, -0.19, ...
    ps_steps = chief["ps_steps"]
    assert ps_steps["v64_dtype"] == "float64" and ps_steps["h16_dtype"] == "float16", ps_steps
    np.testing.assert_allclose(ps_steps["v64"], [-0.4] * 3, atol=1e-4)
    np.testing.assert_allclose(ps_steps["h16"], [-0.9049] * 2, atol=3e-3)
    np.testing.assert_allclose(ps_steps["h16_after"], [-0.9049 - 0.40951] * 2, atol=3e-3)
    # Each worker made its own pipeline of the per-worker dataset.
    assert chief["seen"] == [[0, 2], [1, 2]], chief["seen"]
    assert chief["checkpoint"] == [150, 0.0, True, True], chief["checkpoint"]
    # Adam took 4 steps on v64 before the save, and its copy on the chief none: 1 after the restore.
    assert chief["optimizer_checkpoint"] == {"same_state": True, "t": 4, "resumed": True, "iterations": 1}, chief


def test_a_sidecar_evaluator_follows_the_checkpoints(tmp_path):
    """The evaluator task's loop: each new checkpoint restored and evaluated, in step order, up
    to the training's last; no new one within the timeout is an error with a bound set."""
    import threading
    import time

    w = np.zeros(3, np.float32)

    def trainer():
        own = np.zeros(3, np.float32)
        manager = td.CheckpointManager(td.Checkpoint(w=own), tmp_path, max_to_keep=2)
        for step in (10, 20, 30, 40):
            time.sleep(0.15)
            own[...] = step
            manager.save(checkpoint_number=step)

    t = threading.Thread(target=trainer)
    t.start()
    seen = []

    def evaluate(step):
        assert (w == step).all(), (w, step)
        seen.append(step)

    n = td.SidecarEvaluator(td.Checkpoint(w=w), tmp_path, evaluate, last_step=40, timeout=30).start()
    t.join()
    assert n == len(seen) and seen[-1] == 40 and seen == sorted(set(seen)), seen
    with pytest.raises(TimeoutError, match="evaluated: step 40"):
        td.SidecarEvaluator(td.Checkpoint(w=w), tmp_path, evaluate, max_evaluations=2, timeout=0.3).start()
    assert [p.endswith("ckpt-40.tutti") for p in td.checkpoints_iterator(tmp_path, timeout=0.2)] == [True]


def test_cross_device_ops_of_your_own_and_their_settings():
    """A CrossDeviceOps subclass combines the replicas' values in all_reduce, in variables'
    aggregation and in strategy.reduce; what it raises, run raises. HierarchicalCopyAllReduce's
    num_packs and group_size and ReductionToOneDevice's reduce_to_device are taken."""

    class Median(td.CrossDeviceOps):
        def __init__(self):
            self.calls, self.fail = [], False

        def reduce_implementation(self, reduce_op, per_replica_value, destinations=None, options=None):
            self.calls.append(reduce_op)
            if self.fail:
                raise ArithmeticError("Median gave up")
            return np.median(np.stack(per_replica_value.values), axis=0)

    ops = Median()
    s = td.MirroredStrategy(cpus(3), cross_device_ops=ops)
    with s.scope():
        v = td.Variable(np.zeros(2, np.float32), aggregation="SUM")

        def step():
            ctx = td.get_replica_context()
            i = ctx.replica_id_in_sync_group
            x = ctx.all_reduce("SUM", np.array([i, 10.0 * i * i], np.float32))
            v.assign_add(np.array([1.0, i], np.float32))
            return x

        out = s.experimental_local_results(s.run(step))
    for x in out:
        np.testing.assert_array_equal(x, [1.0, 10.0])  # the medians of (0, 1, 2) and (0, 10, 40)
    np.testing.assert_array_equal(v.numpy(), [1.0, 1.0])
    assert ops.calls == ["SUM", "SUM"]
    np.testing.assert_array_equal(s.reduce("SUM", td.PerReplica([np.float32(i) for i in (5, 1, 3)])), 3.0)
    # gather's bookkeeping (integer lengths, bit-exact rows) is not the op's.
    calls = len(ops.calls)
    got = s.gather(td.PerReplica([np.full((i + 1, 2), i, np.float32) for i in range(3)]), axis=0)
    np.testing.assert_array_equal(got[:, 0], [0, 1, 1, 2, 2, 2])
    assert len(ops.calls) == calls
    ops.fail = True
    with pytest.raises(ArithmeticError, match="Median gave up"):
        s.run(step)
    with pytest.raises(ArithmeticError, match="Median gave up"):
        s.reduce("SUM", td.PerReplica([np.float32(i) for i in (5, 1, 3)]))
    ops.fail = False
    assert s.experimental_local_results(s.run(lambda: td.get_replica_context().all_reduce("MEAN", np.float32(3))))[0] == 3.0

    class Reentrant(td.CrossDeviceOps):
        def reduce_implementation(self, reduce_op, per_replica_value, destinations=None, options=None):
            return td.get_replica_context().all_reduce("SUM", per_replica_value.values[0])

    s = td.MirroredStrategy(cpus(2), cross_device_ops=Reentrant())
    with pytest.raises(tutti.TuttiError, match="it called an all-reduce of the strategy"):
        s.run(lambda: td.get_replica_context().all_reduce("SUM", np.float32(1)))

    class Nothing(td.CrossDeviceOps):
        pass

    with pytest.raises(TypeError, match="reduce_implementation"):
        td.MirroredStrategy(cpus(2), cross_device_ops=Nothing())
    for ops in (td.HierarchicalCopyAllReduce(num_packs=2, group_size=3), td.ReductionToOneDevice("cpu:1")):
        s = td.MirroredStrategy(cpus(4), cross_device_ops=ops)
        out = s.run(lambda: td.get_replica_context().all_reduce("SUM", np.float32(td.get_replica_context().replica_id_in_sync_group)))
        assert s.experimental_local_results(out) == (6.0,) * 4
    with pytest.raises(ValueError, match="is not one of the strategy's devices"):
        td.MirroredStrategy(cpus(2), cross_device_ops=td.ReductionToOneDevice("cpu:3"))


def test_tpu_setup_as_the_guides_write_it():
    """TPUClusterResolver of this host (a remote TPU refused, saying why), initialize_tpu_system's
    topology and TPUStrategy over its devices; where the library has no XLA or there is no
    plugin, an UNAVAILABLE error saying so (never a crash)."""
    with pytest.raises(ValueError, match="run on the TPU VM"):
        td.cluster_resolver.TPUClusterResolver(tpu="grpc://10.1.2.3:8470")
    resolver = td.cluster_resolver.TPUClusterResolver(tpu="")
    assert resolver.master() == "local" and resolver.task_type == "worker"
    try:
        topology = td.tpu.experimental.initialize_tpu_system(resolver)
    except tutti.TuttiError as e:
        assert e.code == "TUTTI_ERROR_UNAVAILABLE" and ("xla feature" in str(e) or "plugin" in str(e)), e
        with pytest.raises(tutti.TuttiError, match="not available"):
            td.TPUStrategy(resolver)
        return
    assert topology.num_cores == topology.num_tasks * topology.num_tpus_per_task > 0, topology
    s = td.TPUStrategy(resolver)
    assert s.num_replicas_in_sync == topology.num_cores
    out = s.run(lambda: td.get_replica_context().all_reduce("SUM", np.float32(1)))
    assert s.experimental_local_results(out) == (float(topology.num_cores),) * topology.num_cores
    # A variable whose copies stay on the devices, updated there.
    with s.scope():
        w = td.DeviceVariable(np.ones(3, np.float32), aggregation="SUM")

    def step():
        ctx = td.get_replica_context()
        t = ctx.place(np.full(3, 2.0, np.float32))
        assert t.device_kind == "xla"
        w.assign_add(t)
        return w.numpy()

    for got in s.experimental_local_results(s.run(step)):
        np.testing.assert_array_equal(got, np.full(3, 1.0 + 2.0 * topology.num_cores, np.float32))
    # An optimizer steps it there, its slots beside the copies: Adam's first step moves each
    # weight by the learning rate.
    opt, before = td.optimizers.Adam(0.01), w.numpy()

    def opt_step():
        opt.apply_gradients([(td.get_replica_context().place(np.ones(3, np.float32)), w)])
        return w.numpy()

    for got in s.experimental_local_results(s.run(opt_step)):
        np.testing.assert_allclose(got, before - 0.01, rtol=1e-5)


def test_a_per_worker_iterator_is_read_by_one_step_at_a_time():
    """Two steps on one worker (after it rejoined) read its per-worker iterator in turn: a
    generator read by two threads at once would raise."""
    import threading
    import time

    def slow():
        for i in range(6):
            time.sleep(0.05)
            yield i

    it = td._worker_iterator("test-one-at-a-time", slow)
    got, errors = [], []

    def read():
        try:
            for _ in range(3):
                got.append(next(it))
        except Exception as e:  # noqa: BLE001 - collected for the assertion
            errors.append(e)

    threads = [threading.Thread(target=read) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and sorted(got) == list(range(6)), (errors, got)
