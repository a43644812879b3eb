"""``horovodrun`` with host discovery polled every 0.2 s instead of every second.

Horovod's own elastic tests lower the same module constant; a test that
waits for a resize then waits less. Everything else is the real launcher.
"""
import sys

import horovod.runner.elastic.driver as driver
from horovod.runner.launch import run_commandline

driver.DISCOVER_HOSTS_FREQUENCY_SECS = 0.2

if __name__ == "__main__":
    sys.exit(run_commandline())
