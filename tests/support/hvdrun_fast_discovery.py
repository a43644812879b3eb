"""``horovodrun`` with host discovery polled every 0.5 s instead of every second.

Horovod's own elastic tests lower the same module constant; a test that
waits for a resize then waits less. Everything else is the real launcher.

Nothing but ``sys`` is imported at the top: Horovod's driver runs each
discovery poll through ``safe_shell_exec``, whose middleman is a
``multiprocessing`` *spawn* child, and a spawn child runs this file's top
level again (as ``__mp_main__``): importing the launcher there made every poll
start Horovod's launcher modules again. Each poll costs about 0.08 CPU-s (that
middleman is a fresh interpreter), so how often it polls is a trade: every
0.2 s, ``tests/distributed/test_elastic.py`` took 118 CPU-s; every 0.5 s, 106
CPU-s in the same wall time; every second, 104 CPU-s and 5 s longer (the jobs
train on while they wait for a resize to be noticed).
"""
import sys

if __name__ == "__main__":
    import horovod.runner.elastic.driver as driver
    from horovod.runner.launch import run_commandline

    driver.DISCOVER_HOSTS_FREQUENCY_SECS = 0.5
    sys.exit(run_commandline())
