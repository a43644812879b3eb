"""Probing the largest atomic batch that fits in memory (AdaptDL lacks this: its issue #40)."""


def _is_oom(error):
    return isinstance(error, MemoryError) or "out of memory" in str(error).lower()


def probe_max_local_bsz(step, start=1, limit=4096, safety=0.9):
    """Largest batch size ``b`` in [start, limit] for which ``step(b)`` runs without OOM.

    ``step(b)`` should run one forward and backward pass at batch size b.
    Doubling finds a failing size, bisection the edge; the result is scaled
    by ``safety`` to leave room for fragmentation. Pass it as the upper bound
    of ``local_bsz_bounds``. Errors other than out-of-memory propagate.

    A step that runs out of memory above 300 samples:

    >>> def step(b):
    ...     if b > 300:
    ...         raise RuntimeError("CUDA out of memory")
    >>> probe_max_local_bsz(step, safety=1.0)
    300

    Then ``loader.autoscale_batch_size(4096, local_bsz_bounds=(16, hi))``.
    """
    if start < 1 or limit < start:
        raise ValueError(f"need 1 <= start <= limit, got start={start!r}, limit={limit!r}")
    if not 0 < safety <= 1:
        raise ValueError(f"safety must be in (0, 1], got {safety!r}")

    def fits(b):
        try:
            step(b)
            return True
        except (RuntimeError, MemoryError) as e:
            if not _is_oom(e):
                raise
            _release_cached_memory()
            return False

    if not fits(start):
        raise RuntimeError(f"even batch size {start} runs out of memory")
    good, bad = start, None
    while bad is None and good < limit:
        trial = min(good * 2, limit)
        if fits(trial):
            good = trial
        else:
            bad = trial
    while bad is not None and bad - good > 1:
        mid = (good + bad) // 2
        if fits(mid):
            good = mid
        else:
            bad = mid
    return max(start, int(good * safety))


def _release_cached_memory():
    import torch
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
