"""Which parameter is which on every rank: parameters are matched by name, as Horovod
matches its allreduces by name.

A group built from a Python ``set`` of names (string hashing differs per
process) lists the same parameters in another order on each rank: averaged by
position, same-shaped ones would be averaged with the wrong partners, and
different shapes would wait for each other forever. So one collective
gathers every rank's ``(group, name, shape, dtype)`` list: a different set
raises on every rank, naming the first difference; a different order is
mapped onto rank 0's. Names come from ``named_parameters``; a parameter
without one is named by its place ("group 0, parameter 3"), which still
turns a mismatch of shapes into an error instead of a hang.
"""
from .._runtime import collective


def describe(groups, names):
    """``[(group, name, shape, dtype)]`` for the parameters of ``groups`` (lists), in order."""
    return [(g, names.get(p, f"group {g}, parameter {i}"), tuple(p.shape), str(p.dtype))
            for g, group in enumerate(groups) for i, p in enumerate(group)]


def check_unique(groups, names):
    """Refuse a parameter listed twice (torch only warns): its gradient would be stepped
    twice, and averaged by two hooks."""
    seen = set()
    for g, group in enumerate(groups):
        for i, p in enumerate(group):
            if id(p) in seen:
                name = names.get(p, f"group {g}, parameter {i}, shape {tuple(p.shape)}")
                raise ValueError(
                    f"parameter {name} appears twice in the optimizer's parameter groups: "
                    "list each parameter once (torch.optim only warns, and steps it twice)")
            seen.add(id(p))


class Matching:
    """Rank 0's order of the parameters, where this rank's differs."""

    def __init__(self):
        self._index = None      # id(param) -> place in rank 0's order, or None: same order

    def agree(self, groups, names):
        """Collective: compare every rank's :func:`describe` list; raise ``ValueError`` on
        every rank where the sets differ, else adopt rank 0's order."""
        mine = describe(groups, names)
        every = collective.allgather_object(mine, name="hvd_adapt.optim.parameters")
        root = every[0]
        for rank, theirs in enumerate(every):
            if sorted(theirs) != sorted(root) or len(set(theirs)) != len(theirs):
                raise ValueError(_first_difference(rank, theirs, root))
        if mine == root:
            self._index = None
            return
        place = {entry: i for i, entry in enumerate(root)}
        flat = [p for group in groups for p in group]
        self._index = {id(p): place[entry] for p, entry in zip(flat, mine)}

    def order(self, params):
        """``params`` (one group's) in rank 0's order; parameters added since go last."""
        if self._index is None:
            return params
        index = self._index
        return sorted(params, key=lambda p: index.get(id(p), len(index)))


def _first_difference(rank, theirs, root):
    def show(entry):
        group, name, shape, dtype = entry
        return f"{name} (group {group}, shape {shape}, {dtype})"

    missing = [e for e in root if e not in theirs]
    extra = [e for e in theirs if e not in root]
    if extra:
        what = f"rank {rank} has {show(extra[0])}, which rank 0 has not"
    elif missing:
        what = f"rank {rank} lacks {show(missing[0])}, which rank 0 has"
    else:
        what = f"rank {rank} names a parameter twice"
    return ("the optimizer's parameters differ between ranks (matched by name, shape and "
            f"dtype): {what}. Every rank must build the same model and groups; pass "
            "named_parameters=model.named_parameters() so that their order may differ")
