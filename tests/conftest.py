import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

# Worker scripts run a job when imported: --doctest-modules must not import them.
collect_ignore_glob = ["distributed/workers/*.py", "hvdrun_fast_discovery.py"]
