"""Reports torch's thread count before and after hvd_adapt.init() (or, with --hvd-init,
hvd.init() and an hvd_adapt.State), and the CPUs it may use."""
import os
import sys

import horovod.torch as hvd
import torch

import hvd_adapt
from _report import report

before = torch.get_num_threads()
if "--hvd-init" in sys.argv:
    hvd.init()
    hvd_adapt.State(model=torch.nn.Linear(2, 2))
else:
    hvd_adapt.init()
report({"before": before, "after": torch.get_num_threads(), "cpus": len(os.sched_getaffinity(0)),
        "local_size": hvd_adapt.env.local_size()}, hvd_adapt.env.rank())
