"""env and collective in one plain process: a world of one."""
import os
import subprocess
import sys
import textwrap

import pytest

import hvd_adapt
from hvd_adapt._runtime import collective, env


@pytest.fixture(autouse=True, scope="module")
def _init():
    hvd_adapt.init()


def test_world_of_one():
    assert (env.rank(), env.size(), env.local_rank(), env.local_size(), env.num_nodes()) == \
        (0, 1, 0, 1, 1)
    assert env.launcher() == "python"
    assert not env.is_elastic()
    assert env.initialized()


def test_init_twice_is_harmless():
    hvd_adapt.init()
    assert env.size() == 1


def test_launcher_from_environment(monkeypatch):
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    assert env.launcher() == "mpirun"
    monkeypatch.setenv("HOROVOD_RANK", "0")
    assert env.launcher() == "horovodrun"


def test_allreduce_of_one_returns_input_types():
    assert collective.allreduce(3) == 3 and isinstance(collective.allreduce(3), int)
    assert collective.allreduce(2.5) == 2.5
    assert collective.allreduce({"a": 1, "b": 0.5}) == {"a": 1, "b": 0.5}


@pytest.mark.parametrize("bad", ["x", None, True, [1], {"k": "v"}])
def test_allreduce_rejects_non_numbers(bad):
    with pytest.raises(TypeError, match="numbers"):
        collective.allreduce(bad)


def test_object_collectives_of_one():
    assert collective.broadcast_object({"x": [1, 2]}) == {"x": [1, 2]}
    assert collective.allgather_object("me") == ["me"]


def test_queries_before_init_say_so():
    code = ("from hvd_adapt import env\nassert not env.initialized()\n"
            "try:\n    env.rank()\nexcept ValueError as e:\n    print(e)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "hvd.init()" in out.stdout, out.stdout + out.stderr


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="OpenBLAS runs one thread on one core")
def test_init_keeps_scipys_blas_threads_from_spinning_after_mpis_fork():
    # scipy loaded before init (scikit-learn does it); MPI_Init of a single
    # process forks, shutting OpenBLAS's pool down, and the next BLAS call
    # started a thread that spun for 0.1 s (0.107 s of idle CPU measured).
    code = textwrap.dedent("""
        import time
        import numpy as np
        import scipy.linalg.blas as blas
        import hvd_adapt
        hvd_adapt.init()
        a = np.asfortranarray(np.random.default_rng(0).random((400, 400)))
        blas.dgemm(1.0, a, a)
        cpu = time.process_time()
        time.sleep(0.2)
        print(time.process_time() - cpu)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    idle_cpu = float(out.stdout.strip().splitlines()[-1])
    assert idle_cpu < 0.03, f"{idle_cpu:.3f} s of CPU while idle after a BLAS call"


@pytest.mark.parametrize("elastic,preset,expected", [
    ("1", None, "5"),    # peers all started (gloo.meet): a dead one is noticed in seconds
    ("1", "45", "45"),   # the user's (or horovodrun --gloo-timeout-seconds') value stands
    (None, None, None),  # outside elastic jobs all workers start together
])
def test_elastic_jobs_notice_a_dead_peer_in_seconds(elastic, preset, expected):
    """What Horovod reads in the hvd.init() that init() makes; afterwards the environment
    is as it was, so an hvd.init() of Horovod's own elastic reset (no meeting) keeps
    Horovod's default."""
    run_env = {k: v for k, v in os.environ.items()
               if k not in ("HOROVOD_ELASTIC", "HOROVOD_GLOO_TIMEOUT_SECONDS")}
    run_env.update({k: v for k, v in (("HOROVOD_ELASTIC", elastic),
                                      ("HOROVOD_GLOO_TIMEOUT_SECONDS", preset)) if v})
    code = ("import os, horovod.torch as hvd, hvd_adapt\n"
            "seen, real_init = [], hvd.init\n"
            "def init(*args, **kwargs):\n"
            "    seen.append(os.environ.get('HOROVOD_GLOO_TIMEOUT_SECONDS'))\n"
            "    return real_init(*args, **kwargs)\n"
            "hvd.init = init\n"
            "hvd_adapt.init()\n"
            "print(seen[0], os.environ.get('HOROVOD_GLOO_TIMEOUT_SECONDS'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=run_env)
    assert out.stdout.split() == [str(expected), str(preset)], out.stdout + out.stderr
