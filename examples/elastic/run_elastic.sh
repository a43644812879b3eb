#!/bin/bash
# Elastic demo on one machine: 1 -> 2 -> 3 -> 2 -> 1 workers, two epochs each,
# printing the batch size hvd_adapt chose at every size.
#   examples/elastic/run_elastic.sh            (after scripts/setup.sh)
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
export HVD_ADAPT_DEMO_DIR=${HVD_ADAPT_DEMO_DIR:-$(mktemp -d)}
export HVD_ADAPT_DEMO_SCHEDULE=${HVD_ADAPT_DEMO_SCHEDULE:-"1 2 3 2 1"}
export HVD_ADAPT_DEMO_EPOCHS_PER_SIZE=${HVD_ADAPT_DEMO_EPOCHS_PER_SIZE:-2}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
python=${PYTHON:-$root/.venv/bin/python}
horovodrun=$(dirname "$python")/horovodrun
rm -f "$HVD_ADAPT_DEMO_DIR/progress"
"$horovodrun" -np 1 --min-np 1 --max-np 3 --network-interface lo \
    --host-discovery-script "$here/discover.sh" \
    "$python" "$here/train.py" "$@" 2>&1 | grep -E "^\[0\]<stdout>:epoch|^epoch|Traceback|Error:" | sed 's/^\[0\]<stdout>://'
