#!/usr/bin/env bash
# On a GPU machine: set up in GPU mode (CUDA torch, Horovod with NCCL), run the
# tests marked gpu, and the overhead benchmark on CUDA (its arguments: this
# script's). Prints a summary line.
#   scripts/gpu_check.sh [--model mlp-8m,transformer-24]
# On a GPU image with no package index (setup.sh's offline settings):
#   HVD_ADAPT_SYSTEM_TORCH=1 HVD_ADAPT_WITHOUT_MPI=1 HVD_ADAPT_HOROVOD_SDIST=horovod-0.28.1.tar.gz \
#       scripts/gpu_check.sh
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export HVD_ADAPT_GPU=${HVD_ADAPT_GPU:-1}
"$root/scripts/setup.sh"
python="${HVD_ADAPT_VENV:-$root/.venv}/bin/python"
cd "$root"
"$python" -c 'import torch, horovod.torch as hvd; print("cuda devices:", torch.cuda.device_count(), "nccl_built:", hvd.nccl_built())'
"$python" -m pytest -m gpu -p no:cacheprovider tests
gpus=$("$python" -c 'import torch; print(torch.cuda.device_count())')
procs=1
[ "$gpus" -ge 2 ] && procs=1,2
"$python" benchmarks/overhead.py --device cuda --procs "$procs" "$@"
