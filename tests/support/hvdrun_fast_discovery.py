"""``horovodrun`` with host discovery polled every 0.2 s instead of every second.

Horovod's own elastic tests lower the same module constant; a test that
waits for a resize then waits less. Everything else is the real launcher.

Nothing but ``sys`` is imported at the top: Horovod's driver runs each
discovery poll through ``safe_shell_exec``, whose middleman is a
``multiprocessing`` *spawn* child, and a spawn child runs this file's top
level again (as ``__mp_main__``). Importing the launcher there cost each poll
about 0.15 s of CPU, five polls a second: a third of a core for every
elastic test's whole life.
"""
import sys

if __name__ == "__main__":
    import horovod.runner.elastic.driver as driver
    from horovod.runner.launch import run_commandline

    driver.DISCOVER_HOSTS_FREQUENCY_SECS = 0.2
    sys.exit(run_commandline())
