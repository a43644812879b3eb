"""``horovodrun`` with host discovery polled every 0.2 s instead of every second.

Horovod's own elastic tests lower the same module constant; a test that
waits for a resize then waits less. Everything else is the real launcher.

Nothing but ``sys`` is imported at the top: Horovod's driver runs each
discovery poll through ``safe_shell_exec``, whose middleman is a
``multiprocessing`` *spawn* child, and a spawn child runs this file's top
level again (as ``__mp_main__``). Importing the launcher there made each poll
cost about 0.2 s of CPU instead of 0.07 s (about two polls a second at 0.2 s
apart: a third of a core for every elastic test's whole life, measured with
process accounting). Polling less often (0.5 s) cost more than it saved: the
jobs train on while they wait for a resize to be noticed (test_elastic.py:
118 s and 152 CPU-s against 98 s and 128 CPU-s).
"""
import sys

if __name__ == "__main__":
    import horovod.runner.elastic.driver as driver
    from horovod.runner.launch import run_commandline

    driver.DISCOVER_HOSTS_FREQUENCY_SECS = 0.2
    sys.exit(run_commandline())
