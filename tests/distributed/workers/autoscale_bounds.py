"""Autoscaling bounds in a real world of three: impossible settings refused on every rank,
possible ones kept while the loader hands out a pass."""
import torch

import hvd_adapt
from _report import report

hvd_adapt.init()
data = torch.utils.data.TensorDataset(torch.arange(50))
seen = {}
loader = hvd_adapt.AdaptiveDataLoader(data, batch_size=8)
try:
    loader.autoscale_batch_size(8, local_bsz_bounds=(4, 8))
    seen["refused"] = None
except ValueError as e:
    seen["refused"] = str(e)
loader = hvd_adapt.AdaptiveDataLoader(data, batch_size=10)
loader.autoscale_batch_size(10, local_bsz_bounds=(1, 8), gradient_accumulation=True,
                            decide_every=2)
batches = []
for (x,) in loader:
    batches.append({"indices": x.tolist(), "padded": loader.num_padded,
                    "batch_size": loader.current_batch_size, "local": loader.current_local_bsz,
                    "accum": loader.accumulation_steps})
seen["batches"] = batches
report(seen, hvd_adapt.env.rank())
