"""Process plumbing under the public API: where this process runs, collectives over
Python objects, CPU threads, scipy's BLAS, and the one process-wide context.

Nothing here is imported by ``import hvd_adapt``; each module loads what it
needs (torch, Horovod) only when it is itself imported.
"""
