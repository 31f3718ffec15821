"""tutti.tensorflow: cross-device ops for MirroredStrategy on logical CPU devices, and ops across
the processes of a job (started as torchrun starts them) under Keras and tf.function. Skipped
where TensorFlow is not installed, unless TUTTI_REQUIRE_TF=1 (CI), which fails."""

import json
import os
import pathlib
import socket
import subprocess
import sys

import numpy as np
import pytest

try:
    import tensorflow  # noqa: F401
except ImportError:
    if os.environ.get("TUTTI_REQUIRE_TF") == "1":
        raise
    pytest.skip("tensorflow is not installed (TUTTI_REQUIRE_TF=1 makes this a failure)", allow_module_level=True)

WORKER = pathlib.Path(__file__).with_name("tf_worker.py")
PACKAGE = str(pathlib.Path(__file__).resolve().parents[1])
ALGORITHMS = ["auto", "direct", "ring", "hierarchical-copy", "reduce-to-one", "recursive-doubling", "rabenseifner"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What describes a job to the ops' communicator: none is inherited from the test's own.
JOB_VARIABLES = ("TF_CONFIG", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TUTTI_RANK",
                 "TUTTI_WORLD_SIZE", "TUTTI_MASTER_ADDR", "TUTTI_LOCAL_RANK")


def launched(launcher, rank, world, port, workers):
    """The variables a job of ``world`` ranks started by ``launcher`` gives rank ``rank``:
    torchrun's, ``tutti launch``'s, or TensorFlow's ``TF_CONFIG`` (``workers``: the tasks'
    addresses)."""
    if launcher == "tf_config":
        return {"TF_CONFIG": json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": rank}})}
    if launcher == "tutti":
        return {"TUTTI_RANK": str(rank), "TUTTI_WORLD_SIZE": str(world), "TUTTI_MASTER_ADDR": f"127.0.0.1:{port}"}
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port)}


def run(scenario, world=1, timeout=300, env=None, check=True, launcher="torchrun"):
    """Every process's RESULT of ``scenario`` (``world`` ranks of one job started by
    ``launcher``: see ``launched``)."""
    port = free_port()
    workers = [f"127.0.0.1:{free_port()}" for _ in range(world)]
    procs = []
    for rank in range(world):
        e = {k: v for k, v in os.environ.items() if k not in JOB_VARIABLES}
        e.update(launched(launcher, rank, world, port, workers), TUTTI_TIMEOUT="60", TF_CPP_MIN_LOG_LEVEL="2")
        e["PYTHONPATH"] = PACKAGE + os.pathsep + e.get("PYTHONPATH", "")
        e.update(env or {})
        procs.append(subprocess.Popen([sys.executable, str(WORKER), scenario], env=e,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    try:
        for rank, p in enumerate(procs):
            out, err = p.communicate(timeout=timeout)
            lines = [l for l in out.splitlines() if l.startswith("RESULT ")]
            if check:
                assert p.returncode == 0 and lines, f"rank {rank} of {scenario} failed ({p.returncode}):\n{out}\n{err}"
            results.append(json.loads(lines[-1][len("RESULT "):]) if lines else None)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return results


def close(a, b, tol):
    return all(np.allclose(np.array(x), np.array(y), rtol=0, atol=tol) for x, y in zip(a, b))


@pytest.mark.parametrize("devices", [2, 4])
def test_mirrored_strategy_with_tutti_trains_as_reduction_to_one_device(devices):
    (r,) = run("mirrored", env={"TUTTI_TF_DEVICES": str(devices)})
    reference = r["reference"]
    # model.fit: every algorithm and packing gives TensorFlow's weights.
    for name in [f"fit {a}" for a in ALGORITHMS] + ["fit packs 0", "fit packs 2", "fit packs mixed"]:
        assert close(r[name], reference, 1e-5), name
    # The weights moved: the comparison is not between two untrained models.
    assert not close(r["fit auto"], r["initial"], 1e-2)
    # A custom loop (strategy.run inside tf.function) reduces through tutti's op.
    assert close(r["loop tutti"], r["loop reference"], 1e-5)
    assert r["loop ops"] == ["TuttiReplicasAllReduce"]
    # A reduction to one device, and a batch mixing dense and sparse values.
    total = devices * (devices + 1) / 2
    assert r["reduce to one"] == [total] * 3
    assert r["batch dense"] == [[total] * 3] * devices
    assert r["batch sparse"] == [[1.0, 1.0]] * devices


@pytest.mark.parametrize("world", [2, 3])
def test_ops_across_processes_inside_tf_function(world):
    results = run("collectives", world)
    for dtype in ["float32", "int32", "float64", "bfloat16"]:
        xs = [(np.arange(6) + 10 * r).reshape(2, 3).astype(np.float64) for r in range(world)]
        total = sum(xs)
        for r, res in enumerate(results):
            s, mx, g, b, g1, g2 = (np.array(v) for v in res[dtype])
            assert (s == total).all(), (dtype, r, s)
            assert (mx == xs[-1]).all(), (dtype, r, mx)
            assert (g == np.concatenate(xs)).all(), (dtype, r, g)
            assert (b == xs[-1] + 1).all(), (dtype, r, b)
            assert (g1 == total).all() and (g2 == 2 * total).all(), (dtype, r)
    ragged = np.concatenate([np.full((r + 1, 2), float(r)) for r in range(world)])
    scale = sum(range(1, world + 1))
    for r, res in enumerate(results):
        assert (np.array(res["ragged"]) == ragged).all(), r
        # d/dv of sum_r (r + 1) * sum(all_reduce(v)) on every rank: the sum of the (r + 1).
        assert res["grad"] == [float(scale)] * 3, r
        # The tape averages 2 v over the ranks: v = arange(3) * (r + 1).
        assert np.allclose(res["tape"], 2 * np.arange(3) * scale / world), r
        other = 1 if r == 0 else 0
        assert res["shape error"] and f"rank {other}'s" in res["shape error"], res["shape error"]
        assert res["optimizer"] == "SGD", res["optimizer"]
        assert "Keras" in res["optimizer error"] or "optimizer" in res["optimizer error"], res["optimizer error"]


def test_collectives_of_nested_functions_run_in_program_order():
    assert run("ordered", 2) == [0, 0]


@pytest.mark.parametrize("launcher", ["tf_config", "tutti"])
def test_the_ops_join_the_job_that_tf_config_or_tutti_launch_describe(launcher):
    """The ops' communicator joins the job from TF_CONFIG (as MultiWorkerMirroredStrategy's
    workers are started) or from tutti launch's variables, as from torchrun's."""
    assert run("ordered", 2, launcher=launcher) == [0, 0]


def test_mixed_precision_ranks_skip_an_overflowing_step_alike():
    ranks = run("keras_mixed", 2)
    assert [r["class"] for r in ranks] == ["LossScaleOptimizer"] * 2
    assert all(r["finite"] for r in ranks)
    assert close(ranks[0]["weights"], ranks[1]["weights"], 0), "the ranks' weights differ"


def test_keras_across_two_processes_matches_one_process_on_the_whole_batch():
    ranks = run("keras_job", 2)
    (single,) = run("keras_single")
    assert close(ranks[0], ranks[1], 0), "the ranks' weights differ"
    assert close(ranks[0], single, 1e-5)


def test_a_lost_peer_is_an_error_naming_it_within_the_timeout():
    r0, _ = run("peer_lost", 2, env={"TUTTI_TIMEOUT": "10"}, check=False)
    assert r0 is not None and r0["error"], r0
    assert "rank 1" in r0["error"], r0["error"]
    assert r0["seconds"] < 30, r0


def test_a_function_traced_for_a_closed_communicator_fails_saying_so():
    (r,) = run("closed")
    assert r["first"] == [1.0] * 3 and r["again"] == [1.0] * 2
    assert r["error"] and "closed" in r["error"], r["error"]


def test_the_op_library_builds_ahead_of_time(tmp_path):
    env = dict(os.environ, TUTTI_TF_CACHE=str(tmp_path), TF_CPP_MIN_LOG_LEVEL="2")
    env["PYTHONPATH"] = PACKAGE + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, "-m", "tutti.tensorflow", "build"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    built = pathlib.Path(done.stdout.strip().splitlines()[-1])
    assert built.parent == tmp_path and built.is_file()
