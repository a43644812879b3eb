"""Launch real multi-process Horovod jobs from tests and collect what each rank reported,
and see whether a process is alive.

Workers call ``_report.report(obj)`` (tests/distributed/workers/_report.py),
which writes ``rank<R>.json`` into the folder named by HVD_ADAPT_TEST_OUT.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKERS = os.path.join(TESTS, "distributed", "workers")
BIN = os.path.dirname(sys.executable)
# Its sitecustomize.py spares the suite's processes torch's import of torch._dynamo
# (tests/conftest.py puts it on their PYTHONPATH; docs/layout.md says why).
SITE = os.path.join(TESTS, "support", "site")


def alive(pid):
    """Whether process ``pid`` exists and is not a zombie (a killed child not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def launch_env(out_dir, extra=None):
    env = dict(os.environ)
    # Open MPI refuses to run as root unless told twice; CI machines run as root.
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1", HVD_ADAPT_TEST_OUT=out_dir,
               PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               # Workers run by path import the test support as ``support.<module>``.
               PYTHONPATH=os.pathsep.join(p for p in (TESTS, env.get("PYTHONPATH")) if p))
    for key, value in (extra or {}).items():
        # None removes a variable the defaults above set.
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def pythonpath(env):
    """The folders ``env``'s PYTHONPATH names, in order."""
    return [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]


def torch_as_is(env):
    """``env`` without tests/support/site on its PYTHONPATH: the processes run torch as a
    user's would, for a test of what a process has imported."""
    return dict(env, PYTHONPATH=os.pathsep.join(p for p in pythonpath(env) if p != SITE))


def with_site(env):
    """``env`` with tests/support/site first on its PYTHONPATH (once)."""
    return dict(env, PYTHONPATH=os.pathsep.join([SITE] + pythonpath(torch_as_is(env))))


def horovodrun_command(np, script_args, hosts=None):
    hosts = hosts or f"localhost:{np}"
    return [os.path.join(BIN, "horovodrun"), "-np", str(np), "-H", hosts, "--gloo",
            "--network-interface", "lo", sys.executable] + list(script_args)


def mpirun_command(np, script_args):
    return [shutil.which("mpirun") or "mpirun", "-np", str(np), "--bind-to", "none",
            "--mca", "btl", "self,vader,tcp", "--mca", "btl_tcp_if_include", "lo",
            "--mca", "oob_tcp_if_include", "lo", sys.executable] + list(script_args)


class JobResult:
    def __init__(self, returncode, output, reports, out_dir):
        self.returncode = returncode
        self.output = output
        self.reports = reports
        self.out_dir = out_dir

    def check(self):
        assert self.returncode == 0, f"job failed with {self.returncode}:\n{self.output[-6000:]}"
        return self

    def case(self, name, np=2):
        """Every rank's result of case ``name``, by rank, from a job that ran several
        (``run_cases`` in the workers' ``_report.py``). Fails naming the case where a rank
        raised in it or never finished it, or where the job failed after every case."""
        cases = {rank: self.reports.get(rank, {}).get("cases", {}) for rank in range(np)}
        errors = {rank: c[name]["error"] for rank, c in cases.items() if "error" in c.get(name, {})}
        assert not errors, "".join(f"case {name!r} failed on rank {rank}:\n{error}"
                                   for rank, error in errors.items())
        missing = [rank for rank, c in cases.items() if name not in c]
        assert not missing, (f"case {name!r} did not finish on rank(s) {missing}: the job "
                             f"ended with {self.returncode}:\n{self.output[-6000:]}")
        done = all(self.reports[rank].get("done") for rank in range(np))
        assert self.returncode == 0 or not done, (
            f"every case finished, but the job ended with {self.returncode}:\n"
            f"{self.output[-6000:]}")
        return {rank: c[name]["result"] for rank, c in cases.items()}


def run_job(command, out_dir=None, timeout=180, env=None):
    """Run ``command``; return its exit code, output and the per-rank JSON reports.

    The job runs in its own process group, so a timeout kills every worker
    the launcher started, not only the launcher.
    """
    out_dir = out_dir or tempfile.mkdtemp(prefix="hvd_adapt_test_")
    log_path = os.path.join(out_dir, "output.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, env=launch_env(out_dir, env), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            returncode = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            returncode = "timeout"
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    with open(log_path) as f:
        output = f.read()
    reports = {}
    for name in sorted(os.listdir(out_dir)):
        if name.startswith("rank") and name.endswith(".json"):
            with open(os.path.join(out_dir, name)) as f:
                reports[int(name[4:-5])] = json.load(f)
    return JobResult(returncode, output, reports, out_dir)


def run_ranks(worker, np=2, launcher="gloo", args=(), timeout=180, env=None):
    """Run ``tests/distributed/workers/<worker>`` on ``np`` ranks with ``launcher``
    ("gloo": horovodrun --gloo, "mpi": mpirun, "python": one plain process)."""
    script = [os.path.join(WORKERS, worker)] + [str(a) for a in args]
    if launcher == "gloo":
        command = horovodrun_command(np, script)
    elif launcher == "mpi":
        command = mpirun_command(np, script)
    elif launcher == "python":
        command = [sys.executable] + script
    else:
        raise ValueError(f"launcher must be gloo, mpi or python, got {launcher!r}")
    return run_job(command, timeout=timeout, env=env)
