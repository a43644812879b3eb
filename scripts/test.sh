#!/usr/bin/env bash
# The whole test suite: sets the environment up first (seconds when it is in
# place), then runs pytest with real multi-process Horovod jobs.
#   scripts/test.sh                 # everything
#   scripts/test.sh tests/swap      # one area: tests/<package>/ mirrors hvd_adapt/<package>/
#   scripts/test.sh -m "not elastic" tests/goodput/test_goodput.py   # pytest arguments pass through
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$root/scripts/setup.sh"
cd "$root"
set +e
"${HVD_ADAPT_VENV:-$root/.venv}/bin/python" -m pytest "$@"
status=$?
set -e
if [ "$status" -eq 5 ]; then
    echo "test.sh: pytest collected no tests; that is a failure" >&2
    exit 1
fi
exit "$status"
