"""Each rank reports what env and collective computed for rank-dependent inputs."""
import time

import hvd_adapt
from hvd_adapt._runtime import collective, env

from _report import report


def barrier_cpu_seconds(wait=1.0):
    """CPU seconds this thread spends in a barrier that the last rank joins ``wait`` s late."""
    collective.barrier()
    if env.rank() == env.size() - 1:
        time.sleep(wait)
    started = time.thread_time()
    collective.barrier()
    return time.thread_time() - started


def host_check_outside_elastic():
    """Only rank 0 checks for host updates: were it a collective here, the next one would hang."""
    state = hvd_adapt.State(count=0)
    if env.rank() == 0:
        for _ in range(3):
            state.check_host_updates()
    return collective.allreduce(1)


hvd_adapt.init()
r, n = env.rank(), env.size()
report({
    "rank": r, "size": n, "local_rank": env.local_rank(), "local_size": env.local_size(),
    "num_nodes": env.num_nodes(), "launcher": env.launcher(),
    "sum_int": collective.allreduce(r + 1),
    "sum_float": collective.allreduce(0.5 * r),
    "sum_dict": collective.allreduce({"a": r, "b": 1.5, f"only{r}": 1}),
    "bcast": collective.broadcast_object({"from": r} if r == n - 1 else None, root_rank=n - 1),
    "gather": collective.allgather_object(r * 10),
    "gather_sizes": collective.allgather_object("x" * (100 * r)),
    "barrier_cpu_s": barrier_cpu_seconds(),
    "after_host_check": host_check_outside_elastic(),
}, r)
