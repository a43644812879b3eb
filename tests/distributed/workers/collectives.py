"""Each rank reports what env and collective computed for rank-dependent inputs."""
import time

import torch

import hvd_adapt
from hvd_adapt._runtime import collective, env

from _report import report


LATE_SECONDS = 0.6


def cpu_waiting_for_a_late_rank(call):
    """CPU seconds this thread spends in ``call()`` (a collective) that the last rank joins
    LATE_SECONDS late (Horovod's own blocking wait would keep a core busy meanwhile)."""
    collective.allreduce(0, name="align")
    if env.rank() == env.size() - 1:
        time.sleep(LATE_SECONDS)
    started = time.thread_time()
    call()
    return time.thread_time() - started


def a_step():
    model = torch.nn.Linear(4, 1)
    optimizer = hvd_adapt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    collective.broadcast_tensors(list(model.state_dict().items()))

    def step():
        if env.rank() == env.size() - 1:
            time.sleep(LATE_SECONDS)
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
    return step


def cpu_in_every_wait():
    """Every kind of wait hvd_adapt has, each with a rank that comes late."""
    step = a_step()
    waits = {
        "allreduce": lambda: collective.allreduce(1),
        "allreduce_dict": lambda: collective.allreduce({"a": 1}),
        "broadcast_object": lambda: collective.broadcast_object({"x": 1}),
        "gather_ints": lambda: collective.gather_ints([1], name="gather_ints"),
        "max_ints": lambda: collective.max_ints([1], name="max_ints"),
        "broadcast_tensors": lambda: collective.broadcast_tensors([("t", torch.zeros(3))]),
        "flag": lambda: collective.flag_of(collective.start_broadcast_flag(True, "flag")),
    }
    spent = {name: cpu_waiting_for_a_late_rank(call) for name, call in waits.items()}
    collective.allreduce(0, name="align")
    started = time.thread_time()
    step()
    spent["optimizer_step"] = time.thread_time() - started
    return spent


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
    "wait_cpu_s": cpu_in_every_wait(),
    "after_host_check": host_check_outside_elastic(),
}, r)
