"""scipy's BLAS at one thread: checked in fresh interpreters, where nothing has loaded it yet."""
import os
import subprocess
import sys
import textwrap


def test_scipy_is_loaded_with_one_blas_thread_and_the_environment_is_left_as_it_was():
    script = textwrap.dedent("""
        import os
        from hvd_adapt._runtime.blas import _scipy_blas, import_scipy_optimize
        import_scipy_optimize()
        print(os.environ.get("OPENBLAS_NUM_THREADS"))
        print([lib.num_threads for lib in _scipy_blas()])
    """)
    for env_value in (None, "2"):
        env = dict(os.environ)
        env.pop("OPENBLAS_NUM_THREADS", None)
        if env_value:
            env["OPENBLAS_NUM_THREADS"] = env_value
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                             check=True, env=env)
        lines = out.stdout.strip().splitlines()
        assert lines[0] == str(env_value)
        assert lines[1] == "[1]"


def test_scipys_blas_loaded_before_is_capped_without_restarting_its_threads():
    # The init path: scikit-learn loaded scipy's BLAS; capping its running
    # pool must not start threads that spin (restarting one spins ~0.1 s).
    script = textwrap.dedent("""
        import time
        import numpy as np
        import scipy.linalg.blas as blas
        from hvd_adapt._runtime.blas import _scipy_blas, cap_loaded_scipy_blas
        a = np.asfortranarray(np.random.default_rng(0).random((400, 400)))
        blas.dgemm(1.0, a, a)
        time.sleep(0.3)
        cap_loaded_scipy_blas()
        blas.dgemm(1.0, a, a)
        cpu = time.process_time()
        time.sleep(0.2)
        print(time.process_time() - cpu)
        print([lib.num_threads for lib in _scipy_blas()])
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    idle_cpu, threads = out.stdout.strip().splitlines()[-2:]
    assert threads == "[1]"
    assert float(idle_cpu) < 0.03, f"{float(idle_cpu):.3f} s of CPU while idle after the cap"
