#!/usr/bin/env bash
# Install everything, then train the main example (digits) in one process.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$root/scripts/setup.sh"
exec "${HVD_ADAPT_VENV:-$root/.venv}/bin/python" "$root/examples/digits/train.py" "$@"
