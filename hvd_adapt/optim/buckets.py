"""Which gradients travel together, and in what shape: the exchange's layout.

Parameters are grouped into buckets, as DDP groups them: in the order
backward is expected to produce their gradients (reverse registration order
until an order was observed), up to ``cap_bytes`` each, one dtype and device
per bucket. Everything that decides a collective's shape is fixed here, when
the layout is built, and the same on every rank: the buckets, their names,
and the extra slot the last bucket carries, where each rank's :class:`Control`
rides: the per-group squared norms of a measured cycle (zeros otherwise),
five flags (this rank completed its cycle; it abandoned a backward in it; it
refuses the cycle; this pass is a later one of a finished cycle; it is not:
see ``exchange.py``), one used-flag per parameter (DDP's globally-unused
map), and one slot per parameter for rank 0's observed gradient order. The
allreduce sums the slot and scales it as it scales the gradients: what comes
back is read as :class:`Agreed`. A layout is rebuilt only where every rank
rebuilds it alike: when the set of trainable parameters changes, or in the
order rank 0 observed.
"""
from typing import NamedTuple, Optional

import torch

# Default bucket caps when bucket_cap_mb is None (see exchange.py's docstring).
GPU_BUCKET_MB = 25
CPU_BUCKET_MB = 4


class Control(NamedTuple):
    """What one rank says about the accumulation cycle that ends: ``norms`` (a float64 tensor
    per group on the gradients' device, or None), whether it ``completed`` the cycle,
    ``abandoned`` a backward of it or ``refused`` it, whether this pass is a ``later`` one
    of a cycle already averaged (``Cycle.extra``), ``used`` (a bytearray: per position,
    whether it got a gradient) and ``order`` (rank 0's observed gradient order, or None)."""
    norms: Optional[torch.Tensor]
    completed: bool
    abandoned: bool
    refused: bool
    later: bool
    used: bytearray
    order: Optional[list]


class Agreed(NamedTuple):
    """Every rank's :class:`Control` summed: ``norms`` (float64, as the gradients are
    scaled), whether any rank completed, abandoned or refused the cycle, whether the
    ranks' passes differ (a later pass of one met a first pass of another: they ran
    different numbers of backward passes), per position whether any rank used it, and the
    order rank 0 proposed (None: none)."""
    norms: torch.Tensor
    anyone_completed: bool
    anyone_abandoned: bool
    anyone_refused: bool
    passes_differ: bool
    used: list
    order: Optional[list]


class Layout:
    """The trainable parameters of ``groups`` (lists of parameters, in optimizer order) and
    their buckets.

    ``params[pos]`` is the parameter at position ``pos``; ``group_of[pos]`` its group's
    index; ``buckets[b]`` the positions of bucket ``b``, ``buckets[-1]`` the one submitted
    at the end of a pass, with the extra slot; ``order`` the positions in expected
    gradient order. ``signature`` is what a change of the trainable set changes.
    """

    def __init__(self, groups, cap_bytes, order=None):
        self.signature = signature(groups)
        self.params = [p for group in groups for p in group if p.requires_grad]
        self.position = {id(p): pos for pos, p in enumerate(self.params)}
        self.group_of = [g for g, group in enumerate(groups) for p in group if p.requires_grad]
        self.num_groups = len(groups)
        count = len(self.params)
        self.order = list(order) if order is not None else list(range(count - 1, -1, -1))
        if sorted(self.order) != list(range(count)):
            raise ValueError(f"a bucket order must name each of {count} parameters once")
        self.buckets = _cut(self.params, self.order, cap_bytes)
        self.bucket_of = [0] * count
        for index, bucket in enumerate(self.buckets):
            for pos in bucket:
                self.bucket_of[pos] = index
        self.bucket_size = [len(bucket) for bucket in self.buckets]
        last = self.params[self.buckets[-1][0]] if count else None
        # float64 where the gradients are (float32 or complex128's real view), else float32.
        self.extra_dtype = torch.float64 if last is not None \
            and last.dtype in (torch.float64, torch.complex128) else torch.float32
        self.extra_device = last.device if last is not None else torch.device("cpu")

    # The extra slot: [norms per group | completed | abandoned | refused | later pass |
    # first pass | used per param | order].
    FLAGS = 5

    @property
    def extra_length(self):
        return self.num_groups + self.FLAGS + 2 * len(self.params)

    def encode(self, control):
        """The extra slot's tensor of a :class:`Control`, on the gradients' device, built
        without waiting for the device: scalars are filled in, host lists copied
        asynchronously."""
        g, count = self.num_groups, len(self.params)
        out = torch.zeros(self.extra_length, dtype=self.extra_dtype, device=self.extra_device)
        flags = (control.completed, control.abandoned, control.refused, control.later,
                 not control.later)
        for i, flag in enumerate(flags):
            out[g + i].fill_(float(flag))
        f = g + self.FLAGS
        if count:
            out[f:f + count].copy_(self._to_device(list(control.used)), non_blocking=True)
        if control.order is not None:
            # 1-based, so that 0 says "no proposal".
            out[f + count:].copy_(self._to_device([pos + 1 for pos in control.order]),
                                  non_blocking=True)
        if control.norms is not None:
            out[:g].copy_(control.norms)
        return out

    def _to_device(self, values):
        host = torch.tensor(values, dtype=self.extra_dtype)
        return host.pin_memory() if self.extra_device.type == "cuda" else host

    def agreed(self, reduced, scale):
        """The :class:`Agreed` of an allreduced extra slot. Flags are read as "any rank
        set it" (> 0), whatever the allreduce's scaling; ``scale`` undoes that scaling
        (averaging over micro-steps and, for ``hvd.Average``, replicas) for the order
        proposed, rank 0's alone, whose positions are rounded back to integers."""
        g, count = self.num_groups, len(self.params)
        values = reduced.double()
        f = g + self.FLAGS
        flags = [flag > 0 for flag in values[g:f].tolist()]
        proposal = (values[f + count:] * scale).round().long().tolist()
        return Agreed(norms=values[:g], anyone_completed=flags[0], anyone_abandoned=flags[1],
                      anyone_refused=flags[2], passes_differ=flags[3] and flags[4],
                      used=(values[f:f + count] > 0).tolist(),
                      order=[position - 1 for position in proposal]
                      if count and proposal[0] > 0 else None)


def signature(groups):
    """Which parameters of ``groups`` are trainable, and their identities."""
    return tuple((id(p), p.requires_grad) for group in groups for p in group)


def cap_bytes_for(params, bucket_cap_mb):
    cap = bucket_cap_mb
    if cap is None:
        cap = GPU_BUCKET_MB if any(p.is_cuda for p in params) else CPU_BUCKET_MB
    return int(cap * 2 ** 20)


def _cut(params, order, cap_bytes):
    """Positions in ``order``, cut into runs of at most ``cap_bytes`` of one dtype and device
    (a parameter larger than the cap is a bucket alone); never empty."""
    buckets, size = [], 0
    for pos in order:
        p = params[pos]
        nbytes = p.numel() * p.element_size()
        first = params[buckets[-1][0]] if buckets else None
        if first is None or size + nbytes > cap_bytes or first.dtype != p.dtype \
                or first.device != p.device:
            buckets.append([pos])
            size = nbytes
        else:
            buckets[-1].append(pos)
            size += nbytes
    return buckets or [[]]
