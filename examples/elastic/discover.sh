#!/bin/bash
# Host discovery for the elastic demo: this machine, with as many slots as the
# demo's schedule asks for at the epoch the job has reached.
#   HVD_ADAPT_DEMO_DIR              where the job writes its progress (epoch)
#   HVD_ADAPT_DEMO_SCHEDULE         replicas per phase, e.g. "1 2 3 2 1"
#   HVD_ADAPT_DEMO_EPOCHS_PER_SIZE  epochs each phase lasts
dir=${HVD_ADAPT_DEMO_DIR:-/tmp/hvd_adapt_demo}
read -r -a schedule <<< "${HVD_ADAPT_DEMO_SCHEDULE:-1 2 3 2 1}"
per=${HVD_ADAPT_DEMO_EPOCHS_PER_SIZE:-2}
epoch=$(cat "$dir/progress" 2>/dev/null || echo 0)
i=$(( epoch / per ))
if (( i >= ${#schedule[@]} )); then i=$(( ${#schedule[@]} - 1 )); fi
echo "localhost:${schedule[$i]}"
