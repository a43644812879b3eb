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
#
# On a machine that has a CUDA torch already and no package index (a GPU
# image), three more settings build on what is there instead:
#   HVD_ADAPT_SYSTEM_TORCH=1        the venv sees the base Python's packages
#                                   (--system-site-packages); its torch, of any
#                                   version, is used, and nothing present is installed
#   HVD_ADAPT_HOROVOD_SDIST=<file>  build Horovod from this sdist (no download)
#   HVD_ADAPT_WITHOUT_MPI=1         Horovod with Gloo only: no Open MPI, no mpi4py
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${HVD_ADAPT_VENV:-$ROOT/.venv}
CACHE=${HVD_ADAPT_CACHE:-$HOME/.cache/hvd_adapt}
PYTHON=${PYTHON:-python3}
TORCH_VERSION=2.13.0
HOROVOD_VERSION=0.28.1
SYSTEM_TORCH=${HVD_ADAPT_SYSTEM_TORCH:-0}
WITHOUT_MPI=${HVD_ADAPT_WITHOUT_MPI:-0}

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
      echo "$BUILD_FLAVOUR ${HVD_ADAPT_DEPS_ONLY:-0} $SYSTEM_TORCH $WITHOUT_MPI"; } \
        | sha256sum | cut -d' ' -f1
}

check_env() {
    "$VENV/bin/python" - "$TORCH_VERSION" "$HOROVOD_VERSION" "$GPU" "${HVD_ADAPT_DEPS_ONLY:-0}" \
            "$SYSTEM_TORCH" "$WITHOUT_MPI" <<'PY'
import sys
torch_version, horovod_version, gpu, deps_only, system_torch, without_mpi = sys.argv[1:]
problems = []
try:
    import torch
    if torch.__version__.split("+")[0] != torch_version and system_torch != "1":
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
    if not hvd.mpi_built() and without_mpi != "1":
        problems.append("horovod was built without MPI")
    if gpu == "1" and not hvd.nccl_built():
        problems.append("horovod was built without NCCL (GPU mode)")
    if gpu == "1" and not torch.version.cuda:
        problems.append(f"torch {torch.__version__} is not a CUDA build (GPU mode)")
except ImportError as e:
    problems.append(f"horovod.torch does not import: {e}")
modules = ["numpy", "scipy", "threadpoolctl", "pytest", "xdist", "jsonschema", "kubernetes_validate"] + (["mpi4py"] if without_mpi != "1" else [])
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

if [ "$WITHOUT_MPI" = 1 ]; then
    for tool in g++ cmake; do
        command -v "$tool" >/dev/null || install_debs "$tool"
    done
    command -v make >/dev/null || command -v ninja >/dev/null || install_debs make
else
    install_debs libopenmpi-dev openmpi-bin g++ make cmake
fi
# The tests' multi-host bed (tests/cluster: network namespaces, one sshd per
# host) needs root, an sshd and ip; elsewhere those tests skip.
if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
    install_debs openssh-server openssh-client iproute2
fi

if [ ! -x "$VENV/bin/python" ]; then
    log "creating virtual environment $VENV"
    VENV_ARGS=()
    [ "$SYSTEM_TORCH" = 1 ] && VENV_ARGS=(--system-site-packages)
    "$PYTHON" -m venv "${VENV_ARGS[@]}" "$VENV" \
        || die "cannot create a venv with $PYTHON (on Debian: apt-get install python3-venv)"
fi
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
# Installs what does not import yet (the only way to install offline).
missing() {
    for module in "$@"; do
        "$VENV/bin/python" -c "import $module" 2>/dev/null || echo "$module"
    done
}

if [ "$SYSTEM_TORCH" = 1 ]; then
    log "using the torch of $PYTHON's packages"
    NEEDED=$(missing numpy scipy threadpoolctl cloudpickle psutil yaml packaging)
    [ -z "$NEEDED" ] || "${PIP[@]}" $(echo "$NEEDED" | sed 's/^yaml$/pyyaml/')
else
    log "installing torch $TORCH_VERSION and build requirements"
    "${PIP[@]}" --upgrade pip setuptools wheel
    # HVD_ADAPT_TORCH_INDEX names an index with CPU builds of torch, for machines
    # without a torch wheel on disk (Docker images), where PyPI's build is CUDA's.
    TORCH_INDEX=()
    [ -n "${HVD_ADAPT_TORCH_INDEX:-}" ] && TORCH_INDEX=(--extra-index-url "$HVD_ADAPT_TORCH_INDEX")
    "${PIP[@]}" "${TORCH_INDEX[@]}" "torch==$TORCH_VERSION" numpy scipy threadpoolctl cloudpickle psutil pyyaml packaging
fi
INSTALLED_TORCH=$("$VENV/bin/python" -c 'import torch; print(torch.__version__, torch.version.cuda or "")') \
    || die "torch does not import in $VENV"
case "$SYSTEM_TORCH $INSTALLED_TORCH" in
    "1 "*|"0 $TORCH_VERSION"*) ;;
    *) die "torch $INSTALLED_TORCH is installed in $VENV, expected $TORCH_VERSION; remove $VENV and rerun" ;;
esac
TORCH_KEY=$(echo "$INSTALLED_TORCH" | cut -d' ' -f1)
if [ "$GPU" = 1 ] && [ -z "$(echo "$INSTALLED_TORCH" | cut -s -d' ' -f2)" ]; then
    die "GPU mode, but torch in $VENV is a CPU build ($INSTALLED_TORCH); remove $VENV, or set HVD_ADAPT_TORCH_INDEX to an index with CUDA builds"
fi
if [ "$WITHOUT_MPI" != 1 ]; then
    # A source build links mpi4py against the Open MPI that mpirun starts.
    "${PIP[@]}" --no-binary mpi4py mpi4py
fi

HVD_OK=$("$VENV/bin/python" - "$HOROVOD_VERSION" "$GPU" "$WITHOUT_MPI" <<'PY' 2>/dev/null || true
import sys, horovod, horovod.torch as hvd
print(int(horovod.__version__ == sys.argv[1] and hvd.gloo_built()
          and (hvd.mpi_built() or sys.argv[3] == "1") and (sys.argv[2] != "1" or hvd.nccl_built())))
PY
)
# Where NCCL comes from in GPU mode: HOROVOD_NCCL_HOME, else torch's nvidia-nccl wheel.
nccl_home() {
    if [ -n "${HOROVOD_NCCL_HOME:-}" ]; then echo "$HOROVOD_NCCL_HOME"; return; fi
    local home
    # The folder of torch's nvidia-nccl wheel that holds include/nccl.h and lib/libnccl.so.2
    # (its place differs between the CUDA 12 and 13 wheels).
    home=$("$VENV/bin/python" - <<'PY' 2>/dev/null
import glob, os, nvidia
for root in nvidia.__path__:
    for header in sorted(glob.glob(os.path.join(root, "**", "include", "nccl.h"), recursive=True)):
        home = os.path.dirname(os.path.dirname(header))
        if glob.glob(os.path.join(home, "lib", "libnccl.so*")):
            print(home)
            raise SystemExit
raise SystemExit(1)
PY
) || die "GPU mode needs NCCL: torch's nvidia-nccl wheel is missing; install it or set HOROVOD_NCCL_HOME"
    # Horovod's CMake looks for libnccl.so; the wheel ships libnccl.so.2 only.
    [ -e "$home/lib/libnccl.so" ] || ln -s libnccl.so.2 "$home/lib/libnccl.so"
    echo "$home"
}
if [ "$HVD_OK" != "1" ]; then
    # CPU builds keep the key they always had, so existing caches stay valid.
    KEY="py$PYVER-torch$TORCH_KEY-horovod$HOROVOD_VERSION"
    [ "$GPU" = 1 ] && KEY="$KEY-$BUILD_FLAVOUR"
    [ "$WITHOUT_MPI" = 1 ] && KEY="$KEY-gloo-only"
    WHEEL_DIR="$CACHE/$KEY"
    WHEEL=$(ls "$WHEEL_DIR"/horovod-*.whl 2>/dev/null | head -n1 || true)
    if [ -z "$WHEEL" ]; then
        log "building Horovod $HOROVOD_VERSION ($BUILD_FLAVOUR) from source (4 to 10 minutes on 2 cores)"
        WORK=$(mktemp -d)
        trap 'rm -rf "$WORK"' EXIT
        if [ -n "${HVD_ADAPT_HOROVOD_SDIST:-}" ]; then
            cp "$HVD_ADAPT_HOROVOD_SDIST" "$WORK/" || die "cannot read $HVD_ADAPT_HOROVOD_SDIST"
        else
            "$VENV/bin/python" -m pip download -q --no-deps --no-binary :all: -d "$WORK" "horovod==$HOROVOD_VERSION" \
                || die "cannot download the horovod $HOROVOD_VERSION sdist from the package index"
        fi
        tar -xzf "$WORK"/horovod-*.tar.gz -C "$WORK"
        SRC="$WORK/horovod-$HOROVOD_VERSION"
        # torch 2.x headers need C++17; Horovod 0.28.1 asks CMake for C++14.
        sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' \
            "$SRC/CMakeLists.txt" "$SRC/horovod/torch/CMakeLists.txt"
        # CUDA 13's nvcc no longer compiles C++11, Horovod's choice for its kernels.
        sed -i 's/set(CMAKE_CUDA_STANDARD 11)/set(CMAKE_CUDA_STANDARD 17)/' \
            "$SRC/horovod/common/ops/cuda/CMakeLists.txt"
        grep -q 'CMAKE_CXX_STANDARD 17' "$SRC/horovod/torch/CMakeLists.txt" \
            || die "the C++17 fix did not apply to $SRC/horovod/torch/CMakeLists.txt"
        mkdir -p "$WHEEL_DIR"
        if [ "$GPU" = 1 ]; then
            command -v nvcc >/dev/null \
                || die "GPU mode builds Horovod's CUDA kernels with nvcc: install the CUDA toolkit (nvidia/cuda devel images have it)"
            NCCL_HOME=$(nccl_home)
        fi
        (
            export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 \
                   HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
                   MAKEFLAGS="-j$(nproc)"
            if [ "$WITHOUT_MPI" = 1 ]; then
                export HOROVOD_WITHOUT_MPI=1
            else
                export HOROVOD_WITH_MPI=1
            fi
            command -v make >/dev/null || export CMAKE_GENERATOR=Ninja
            # CMake 4 refuses Gloo's cmake_minimum_required (< 3.5) without this.
            export CMAKE_POLICY_VERSION_MINIMUM=3.5
            # GCC 13's headers no longer include <string>, <cstdint>, <stdexcept>
            # and others through each other, which Horovod 0.28.1's sources rely on.
            export CXXFLAGS="${CXXFLAGS:-} -include string -include cstdint -include stdexcept -include cstring -include limits -include memory -include functional -include algorithm"
            if [ "$GPU" = 1 ]; then
                export HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_NCCL_HOME="$NCCL_HOME" \
                       HOROVOD_NCCL_LINK=SHARED
                # Kernels for this machine's GPUs only (all of nvcc's take long).
                CC_LIST=$("$VENV/bin/python" -c 'import torch; print(",".join(sorted({"%d%d" % torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})))' 2>/dev/null || true)
                [ -n "${HOROVOD_BUILD_CUDA_CC_LIST:-}" ] || [ -z "$CC_LIST" ] \
                    || export HOROVOD_BUILD_CUDA_CC_LIST="$CC_LIST"
            else
                unset HOROVOD_GPU_OPERATIONS HOROVOD_GPU_ALLREDUCE HOROVOD_GPU_BROADCAST
            fi
            "$VENV/bin/python" -m pip wheel -q --no-build-isolation --no-deps -w "$WORK/wheel" "$SRC" \
                > "$WORK/build.log" 2>&1
        ) || { mkdir -p "$CACHE"; cp "$WORK/build.log" "$CACHE/horovod-build.log"
               grep -A12 "CMake Error" "$WORK/build.log" >&2 || true
               tail -n 40 "$WORK/build.log" >&2
               die "the Horovod build failed (log above; all of it in $CACHE/horovod-build.log)"; }
        mv "$WORK"/wheel/horovod-*.whl "$WHEEL_DIR/"
        WHEEL=$(ls "$WHEEL_DIR"/horovod-*.whl | head -n1)
        log "cached $WHEEL"
    else
        log "using cached Horovod wheel $WHEEL"
    fi
    "${PIP[@]}" --force-reinstall --no-deps "$WHEEL"
fi

if [ "$SYSTEM_TORCH" = 1 ]; then
    NEEDED=$(missing pytest xdist sklearn tqdm jsonschema kubernetes_validate)
    [ -z "$NEEDED" ] || "${PIP[@]}" $(echo "$NEEDED" | sed 's/^sklearn$/scikit-learn/; s/^xdist$/pytest-xdist/; s/_/-/g')
    [ "${HVD_ADAPT_DEPS_ONLY:-0}" = 1 ] \
        || "${PIP[@]}" --no-build-isolation --no-deps -e "$ROOT"
elif [ "${HVD_ADAPT_DEPS_ONLY:-0}" = 1 ]; then
    "${PIP[@]}" pytest pytest-xdist scikit-learn tqdm tensorboard jsonschema kubernetes-validate
else
    log "installing hvd_adapt (editable) with the dev extras"
    "${PIP[@]}" --no-build-isolation -e "$ROOT[dev]"
fi

check_env || die "the environment in $VENV is incomplete (see above)"
stamp_inputs > "$VENV/.hvd_adapt_stamp"
log "done: activate with 'source $VENV/bin/activate'"
