"""Processes that die with their parent, in one place: Linux's ``PR_SET_PDEATHSIG``, for the
standby's script (killed with its supervisor), a worker's watchdog (killed with its
worker) and ``hvd-adapt-run``'s horovodrun (stopped with it); and the other direction,
``PR_SET_CHILD_SUBREAPER``, for a supervisor whose child's orphans must come to it."""
import ctypes
import signal

PR_SET_PDEATHSIG = 1    # linux/prctl.h
PR_SET_CHILD_SUBREAPER = 36


def _prctl():
    return ctypes.CDLL(None, use_errno=True).prctl


def death_signal_setter(sig=signal.SIGKILL):
    """A function that asks the kernel to send ``sig`` to the process that calls it when that
    process's parent dies (raising OSError where the kernel refuses). ``prctl`` is looked up
    here, before any fork, so that a ``preexec_fn`` that calls the function loads nothing
    in the forked child."""
    prctl = _prctl()

    def set_death_signal():
        if prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    return set_death_signal


def become_subreaper():
    """Make this process the parent of its descendants' orphans (instead of init), so that
    it can find and wait for every process its child left behind."""
    if _prctl()(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")
