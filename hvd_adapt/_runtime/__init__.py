"""Process plumbing under the public API.

- :mod:`.env`: ``init``, where this process runs (rank, sizes, launcher);
- :mod:`.collective`: object collectives, optimizer-state and tensor broadcasts over Horovod,
  and ``wait``, the one wait for a Horovod operation (it sleeps where Horovod's spins);
- :mod:`.gloo`: what a Gloo world needs before ``hvd.init()`` (every worker started, a
  reachable host address);
- :mod:`.liveness`: the one rule for when an elastic worker is ended, and the evidence;
- :mod:`.watchdog`: the process beside each elastic Gloo worker that gathers that evidence;
- :mod:`.rendezvous`: horovodrun's key-value store as workers reach it;
- :mod:`.handover`: a standby's side of its hand-over (what ``init()`` waits in);
- :mod:`.parent_death`: processes that die with their parent;
- :mod:`.script_end`: the line a worker leaves for ``hvd-adapt-run`` when its script ends;
- :mod:`.threads` and :mod:`.blas`: torch's CPU threads shared on a node, scipy's BLAS at one;
- :mod:`.private_files`: every file in a shared place, created checked;
- :mod:`.horovod_internals`: every private name of Horovod's we use (its launcher's too);
- :mod:`.context`: the one process-wide context.

Nothing here is imported by ``import hvd_adapt``; each module loads what it
needs (torch, Horovod) only when it is itself imported.
"""
