"""Processes that die with their parent, in one place: Linux's ``PR_SET_PDEATHSIG``, for the
standby's script (killed with its supervisor) and a worker's watchdog (killed with its
worker)."""
import ctypes
import signal

PR_SET_PDEATHSIG = 1    # linux/prctl.h


def death_signal_setter():
    """A function that asks the kernel to SIGKILL the process that calls it when that
    process's parent dies (raising OSError where the kernel refuses). ``prctl`` is looked up
    here, before any fork, so that a ``preexec_fn`` that calls the function loads nothing
    in the forked child."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def set_death_signal():
        if prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    return set_death_signal
