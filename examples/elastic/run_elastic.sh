#!/bin/bash
# Elastic demo on one machine: 1 -> 2 -> 3 -> 2 -> 1 workers, two epochs each,
# printing the batch size hvd_adapt chose at every size.
#   examples/elastic/run_elastic.sh            (after scripts/setup.sh)
# Python: $PYTHON, else $HVD_ADAPT_VENV/bin/python (the Docker image's venv),
# else the checkout's .venv, else python3 on PATH.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
export HVD_ADAPT_DEMO_DIR=${HVD_ADAPT_DEMO_DIR:-$(mktemp -d)}
export HVD_ADAPT_DEMO_SCHEDULE=${HVD_ADAPT_DEMO_SCHEDULE:-"1 2 3 2 1"}
export HVD_ADAPT_DEMO_EPOCHS_PER_SIZE=${HVD_ADAPT_DEMO_EPOCHS_PER_SIZE:-2}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
if [ -n "${PYTHON:-}" ]; then python=$PYTHON
elif [ -n "${HVD_ADAPT_VENV:-}" ]; then python=$HVD_ADAPT_VENV/bin/python
elif [ -x "$root/.venv/bin/python" ]; then python=$root/.venv/bin/python
else python=$(command -v python3) || { echo "run_elastic.sh: no python3 found; set PYTHON" >&2; exit 1; }
fi
[ -x "$python" ] || { echo "run_elastic.sh: $python is not an executable Python" >&2; exit 1; }
horovodrun=$(dirname "$python")/horovodrun
[ -x "$horovodrun" ] || horovodrun=$(command -v horovodrun) \
    || { echo "run_elastic.sh: horovodrun not found beside $python or on PATH" >&2; exit 1; }
rm -f "$HVD_ADAPT_DEMO_DIR/progress"
"$horovodrun" -np 1 --min-np 1 --max-np 3 --network-interface lo \
    --host-discovery-script "$here/discover.sh" \
    "$python" "$here/train.py" "$@" 2>&1 | grep -E "^\[0\]<stdout>:epoch|^epoch|Traceback|Error:" | sed 's/^\[0\]<stdout>://'
