#!/usr/bin/env bash
# Installs everything hvd_adapt needs into a virtual environment:
# Debian's Open MPI, torch 2.13.0, Horovod 0.28.1 built from source with the
# C++17 fix (Gloo + MPI + PyTorch, and NCCL on GPU machines), mpi4py, and
# hvd_adapt itself (editable).
#
# GPU mode: on a machine where nvidia-smi lists a GPU (or with
# HVD_ADAPT_GPU=1, e.g. to build a GPU image; HVD_ADAPT_GPU=0 forces the CPU build) torch is PyPI's CUDA
# build and Horovod is built with HOROVOD_GPU_OPERATIONS=NCCL against the
# NCCL that torch's wheels bring (nvidia-nccl-cu12), or HOROVOD_NCCL_HOME if
# set. That build needs the CUDA toolkit (nvcc), as in nvidia/cuda "devel"
# images.
#
# Idempotent: a second run with everything in place takes seconds. The built
# Horovod wheel is cached outside the repo, keyed by Python and torch version
# and the build flags (CPU or CUDA+NCCL).
#
#   scripts/setup.sh              # venv in .venv
#   HVD_ADAPT_VENV=/opt/venv scripts/setup.sh
#   HVD_ADAPT_TORCH_INDEX=<index with torch wheels> scripts/setup.sh
#   HVD_ADAPT_DEPS_ONLY=1 scripts/setup.sh   # everything but hvd_adapt (Docker layers)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${HVD_ADAPT_VENV:-$ROOT/.venv}
CACHE=${HVD_ADAPT_CACHE:-$HOME/.cache/hvd_adapt}
PYTHON=${PYTHON:-python3}
TORCH_VERSION=2.13.0
HOROVOD_VERSION=0.28.1

log() { echo "[setup] $*" >&2; }

# CPU or GPU build: asked for, or what the machine has.
case "${HVD_ADAPT_GPU:-auto}" in
    1) GPU=1 ;;
    0) GPU=0 ;;
    # A GPU that nvidia-smi lists; the CUDA toolkit alone (nvcc) is no GPU.
    auto) if command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
              GPU=1; else GPU=0; fi ;;
    *) echo "[setup] ERROR: HVD_ADAPT_GPU must be 0, 1 or auto, got '$HVD_ADAPT_GPU'" >&2; exit 1 ;;
esac
BUILD_FLAVOUR=$([ "$GPU" = 1 ] && echo cuda-nccl || echo cpu)
die() { echo "[setup] ERROR: $*" >&2; exit 1; }

install_debs() {
    local missing=()
    for pkg in "$@"; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    command -v apt-get >/dev/null || die "missing system packages: ${missing[*]}; install them with your package manager"
    local sudo=""
    if [ "$(id -u)" -ne 0 ]; then
        command -v sudo >/dev/null || die "missing system packages: ${missing[*]}; run as root or install them: apt-get install -y ${missing[*]}"
        sudo=sudo
    fi
    log "installing system packages: ${missing[*]}"
    $sudo apt-get update -qq || die "apt-get update failed; cannot install ${missing[*]}"
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null \
        || die "apt-get install ${missing[*]} failed"
}

# The stamp records what the last successful run installed; when nothing it
# covers has changed and the environment still checks out, there is no work.
stamp_inputs() {
    { cat "$ROOT/pyproject.toml" "$ROOT/setup.cfg" "${BASH_SOURCE[0]}" 2>/dev/null
      echo "$BUILD_FLAVOUR ${HVD_ADAPT_DEPS_ONLY:-0}"; } | sha256sum | cut -d' ' -f1
}

check_env() {
    "$VENV/bin/python" - "$TORCH_VERSION" "$HOROVOD_VERSION" "$GPU" "${HVD_ADAPT_DEPS_ONLY:-0}" <<'PY'
import sys
torch_version, horovod_version, gpu, deps_only = sys.argv[1:]
problems = []
try:
    import torch
    if torch.__version__.split("+")[0] != torch_version:
        problems.append(f"torch is {torch.__version__}, expected {torch_version}")
except ImportError as e:
    problems.append(f"torch does not import: {e}")
try:
    import horovod
    import horovod.torch as hvd
    if horovod.__version__ != horovod_version:
        problems.append(f"horovod is {horovod.__version__}, expected {horovod_version}")
    if not hvd.gloo_built():
        problems.append("horovod was built without Gloo")
    if not hvd.mpi_built():
        problems.append("horovod was built without MPI")
    if gpu == "1" and not hvd.nccl_built():
        problems.append("horovod was built without NCCL (GPU mode)")
    if gpu == "1" and not torch.version.cuda:
        problems.append(f"torch {torch.__version__} is not a CUDA build (GPU mode)")
except ImportError as e:
    problems.append(f"horovod.torch does not import: {e}")
modules = ["mpi4py", "numpy", "scipy", "threadpoolctl", "pytest"]
if deps_only != "1":
    modules.append("hvd_adapt")
for mod in modules:
    try:
        __import__(mod)
    except ImportError as e:
        problems.append(f"{mod} does not import: {e}")
if problems:
    print("\n".join(problems), file=sys.stderr)
    sys.exit(1)
PY
}

if [ -x "$VENV/bin/python" ] && [ -f "$VENV/.hvd_adapt_stamp" ] \
        && [ "$(cat "$VENV/.hvd_adapt_stamp")" = "$(stamp_inputs)" ] && check_env 2>/dev/null; then
    log "environment in $VENV is up to date"
    exit 0
fi

command -v "$PYTHON" >/dev/null || die "$PYTHON not found; set PYTHON=/path/to/python3.11"
PYVER=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
if [ "$PYVER" != "3.11" ]; then
    log "warning: Python $PYVER; torch $TORCH_VERSION CPU is only known to install offline for Python 3.11"
fi

install_debs libopenmpi-dev openmpi-bin g++ make cmake

if [ ! -x "$VENV/bin/python" ]; then
    log "creating virtual environment $VENV"
    "$PYTHON" -m venv "$VENV" || die "cannot create a venv with $PYTHON (on Debian: apt-get install python3-venv)"
fi
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)

log "installing torch $TORCH_VERSION and build requirements"
"${PIP[@]}" --upgrade pip setuptools wheel
# HVD_ADAPT_TORCH_INDEX names an index with CPU builds of torch, for machines
# without a torch wheel on disk (Docker images), where PyPI's build is CUDA's.
TORCH_INDEX=()
[ -n "${HVD_ADAPT_TORCH_INDEX:-}" ] && TORCH_INDEX=(--extra-index-url "$HVD_ADAPT_TORCH_INDEX")
"${PIP[@]}" "${TORCH_INDEX[@]}" "torch==$TORCH_VERSION" numpy scipy threadpoolctl cloudpickle psutil pyyaml packaging
INSTALLED_TORCH=$("$VENV/bin/python" -c 'import torch; print(torch.__version__, torch.version.cuda or "")')
case "$INSTALLED_TORCH" in
    "$TORCH_VERSION"*) ;;
    *) die "torch $INSTALLED_TORCH is installed in $VENV, expected $TORCH_VERSION; remove $VENV and rerun" ;;
esac
if [ "$GPU" = 1 ] && [ -z "$(echo "$INSTALLED_TORCH" | cut -s -d' ' -f2)" ]; then
    die "GPU mode, but torch in $VENV is a CPU build ($INSTALLED_TORCH); remove $VENV, or set HVD_ADAPT_TORCH_INDEX to an index with CUDA builds"
fi
# A source build links mpi4py against the Open MPI that mpirun starts.
"${PIP[@]}" --no-binary mpi4py mpi4py

HVD_OK=$("$VENV/bin/python" - "$HOROVOD_VERSION" "$GPU" <<'PY' 2>/dev/null || true
import sys, horovod, horovod.torch as hvd
print(int(horovod.__version__ == sys.argv[1] and hvd.gloo_built() and hvd.mpi_built()
          and (sys.argv[2] != "1" or hvd.nccl_built())))
PY
)
# Where NCCL comes from in GPU mode: HOROVOD_NCCL_HOME, else torch's nvidia-nccl wheel.
nccl_home() {
    if [ -n "${HOROVOD_NCCL_HOME:-}" ]; then echo "$HOROVOD_NCCL_HOME"; return; fi
    local home
    home=$("$VENV/bin/python" -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__))' 2>/dev/null) \
        || die "GPU mode needs NCCL: torch's nvidia-nccl wheel is missing; install it or set HOROVOD_NCCL_HOME"
    # Horovod's CMake looks for libnccl.so; the wheel ships libnccl.so.2 only.
    [ -e "$home/lib/libnccl.so" ] || ln -s libnccl.so.2 "$home/lib/libnccl.so"
    echo "$home"
}
if [ "$HVD_OK" != "1" ]; then
    # CPU builds keep the key they always had, so existing caches stay valid.
    KEY="py$PYVER-torch$TORCH_VERSION-horovod$HOROVOD_VERSION"
    [ "$GPU" = 1 ] && KEY="$KEY-$BUILD_FLAVOUR"
    WHEEL_DIR="$CACHE/$KEY"
    WHEEL=$(ls "$WHEEL_DIR"/horovod-*.whl 2>/dev/null | head -n1 || true)
    if [ -z "$WHEEL" ]; then
        log "building Horovod $HOROVOD_VERSION ($BUILD_FLAVOUR) from source (4 to 10 minutes on 2 cores)"
        WORK=$(mktemp -d)
        trap 'rm -rf "$WORK"' EXIT
        "$VENV/bin/python" -m pip download -q --no-deps --no-binary :all: -d "$WORK" "horovod==$HOROVOD_VERSION" \
            || die "cannot download the horovod $HOROVOD_VERSION sdist from the package index"
        tar -xzf "$WORK"/horovod-*.tar.gz -C "$WORK"
        SRC="$WORK/horovod-$HOROVOD_VERSION"
        # torch 2.x headers need C++17; Horovod 0.28.1 asks CMake for C++14.
        sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' \
            "$SRC/CMakeLists.txt" "$SRC/horovod/torch/CMakeLists.txt"
        grep -q 'CMAKE_CXX_STANDARD 17' "$SRC/horovod/torch/CMakeLists.txt" \
            || die "the C++17 fix did not apply to $SRC/horovod/torch/CMakeLists.txt"
        mkdir -p "$WHEEL_DIR"
        if [ "$GPU" = 1 ]; then
            command -v nvcc >/dev/null \
                || die "GPU mode builds Horovod's CUDA kernels with nvcc: install the CUDA toolkit (nvidia/cuda devel images have it)"
            NCCL_HOME=$(nccl_home)
        fi
        (
            export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1 \
                   HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
                   MAKEFLAGS="-j$(nproc)"
            if [ "$GPU" = 1 ]; then
                export HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_NCCL_HOME="$NCCL_HOME" \
                       HOROVOD_NCCL_LINK=SHARED
            else
                unset HOROVOD_GPU_OPERATIONS HOROVOD_GPU_ALLREDUCE HOROVOD_GPU_BROADCAST
            fi
            "$VENV/bin/python" -m pip wheel -q --no-build-isolation --no-deps -w "$WORK/wheel" "$SRC" \
                > "$WORK/build.log" 2>&1
        ) || { tail -n 40 "$WORK/build.log" >&2; die "the Horovod build failed (log above)"; }
        mv "$WORK"/wheel/horovod-*.whl "$WHEEL_DIR/"
        WHEEL=$(ls "$WHEEL_DIR"/horovod-*.whl | head -n1)
        log "cached $WHEEL"
    else
        log "using cached Horovod wheel $WHEEL"
    fi
    "${PIP[@]}" --force-reinstall --no-deps "$WHEEL"
fi

if [ "${HVD_ADAPT_DEPS_ONLY:-0}" = 1 ]; then
    "${PIP[@]}" pytest scikit-learn tqdm tensorboard
else
    log "installing hvd_adapt (editable) with the dev extras"
    "${PIP[@]}" --no-build-isolation -e "$ROOT[dev]"
fi

check_env || die "the environment in $VENV is incomplete (see above)"
stamp_inputs > "$VENV/.hvd_adapt_stamp"
log "done: activate with 'source $VENV/bin/activate'"
