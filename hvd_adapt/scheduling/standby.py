"""``hvd-adapt-worker``: warm standby workers; a new worker boots while the job trains, and
joins in a moment.

Horovod's elastic driver starts a new worker only once every survivor waits
in the reset's rendezvous, so the survivors wait for its whole start-up (a
container, ``import torch``, the script up to ``init()``): seconds, 8-40 on
a cluster. A standby does that start-up before the host is offered:

1. ``hvd-adapt-worker --standby --standby-dir DIR -- python train.py ...``
   on the new host (its pod's command, or started by hand) runs the script,
   which boots as usual and blocks in :func:`hvd_adapt.init` (see
   ``_runtime/handover.py``); then the standby's supervisor
   (``standby_supervisor.py``) writes ``DIR/<host>/<pid>.json``
   and keeps its modification time fresh (a heartbeat) while it waits.
2. ``hvd-adapt-discover --standby-dir DIR`` offers a new host only once it
   has such a file whose heartbeat it has seen beat (:mod:`.ready`), so the
   survivors train on until the worker is ready.
3. Horovod launches ``hvd-adapt-worker --standby-dir DIR -- python train.py ...``
   for the slot: this launch stub (``launch_stub.py``: standard library only,
   milliseconds to start) claims the standby (an atomic rename of its file),
   passes it the slot's environment, working directory and standard streams
   over a Unix socket, forwards signals to it and exits with its exit code.
   Where no standby is ready, or anything about the claim fails, it runs the
   command itself (a cold start).

The standby's supervisor, not the script, holds the socket: it sees the
script's exit status, and when the stub dies (Horovod's SIGKILL five
seconds after a SIGTERM) it kills the script in turn; the script is killed
by the kernel when its supervisor dies (``PR_SET_PDEATHSIG``), so no worker
outlives its slot either way. The supervisor serves one slot; start another
for the next join.

Trust: the stub hands its slot only to a standby of its own user. The
folder ``DIR/<host>`` must belong to that user and be writable by no one
else (the supervisor creates it so; the stub starts cold on any other), the
ready file must be a regular file of that user, its socket too, and the
process listening on the socket must be that user's and the very pid the
ready file names (``SO_PEERCRED``). ``DIR`` itself may be shared (a volume,
``/tmp``).
"""
import argparse
import logging
import os
import socket
import sys

from .launch_stub import hand_over, warn
from .standby_supervisor import Supervisor


def parser():
    """``hvd-adapt-worker``'s command line."""
    p = argparse.ArgumentParser(
        prog="hvd-adapt-worker",
        description="Warm standby workers for horovodrun --elastic (see hvd_adapt.scheduling."
                    "standby). Put it before the training command in horovodrun's command "
                    "line; run it with --standby on a host to boot a worker ahead of its join.")
    p.add_argument("--standby", action="store_true",
                   help="boot COMMAND as a standby and wait for a slot")
    p.add_argument("--standby-dir", required=True,
                   help="folder of the ready files (shared with hvd-adapt-discover)")
    p.add_argument("--pass-env", action="append", default=[], metavar="NAME",
                   help="also hand the standby this variable of the slot's environment "
                        "(repeatable; HOROVOD_*, HVD_ADAPT_*, NCCL_*, GLOO_*, OMPI_*, PMIX_*, "
                        "CUDA_VISIBLE_DEVICES and PYTHONUNBUFFERED always go)")
    p.add_argument("--host", default=None,
                   help="the host name as the discovery lists it (default: "
                        "$HOROVOD_HOSTNAME, else this machine's name)")
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="the training command, after --")
    return p


def parse(p, argv=None):
    """``hvd-adapt-worker``'s arguments from ``argv``, and the training command after ``--``."""
    args = p.parse_args(argv)
    return args, args.command[1:] if args.command[:1] == ["--"] else args.command


def main(argv=None):
    """``hvd-adapt-worker``: run a standby (``--standby``), or launch a slot through one."""
    p = parser()
    args, command = parse(p, argv)
    if not command:
        p.error("the training command is missing (give it after --)")
    host = args.host or os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname()
    if args.standby:
        logging.basicConfig(format="%(asctime)s %(name)s: %(message)s", level=logging.INFO)
        return Supervisor(command, args.standby_dir, host).run()
    code = hand_over(args.standby_dir, host, command, args.pass_env)
    if code is not None:
        return code
    warn(f"no standby ready on {host}; starting cold")
    try:
        os.execvp(command[0], command)
    except OSError as e:
        sys.stderr.write(f"hvd-adapt-worker: cannot run {command[0]!r}: {e}\n")
        return 127


if __name__ == "__main__":
    sys.exit(main())
