"""Reports torch's thread count before and after hvd_adapt.init(), and the CPUs it may use."""
import os

import torch

import hvd_adapt
from _report import report

before = torch.get_num_threads()
hvd_adapt.init()
report({"before": before, "after": torch.get_num_threads(), "cpus": len(os.sched_getaffinity(0)),
        "local_size": hvd_adapt.env.local_size()}, hvd_adapt.env.rank())
