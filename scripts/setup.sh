#!/usr/bin/env bash
# scripts/setup.sh — one-command install of hvdtrain and a working Horovod on today's frameworks.
#
# What it does (each step prints what it did; a failing step names itself and how to fix it):
#   1. apt:     installs Open MPI (openmpi-bin, libopenmpi-dev), build tools, ssh client, iproute2,
#               openssh-server (sshd for the multi-host tests' namespace hosts; not started), and Slurm with munge
#               (slurmctld, slurmd, slurm-client, munge: the tests' private Slurm cluster, tests/support/slurm.py, runs its
#               own daemons) — only the ones missing. Needs root (or sudo). In a container (no init) the packages'
#               scripts start no service: invoke-rc.d cannot tell the runlevel, or Docker's policy-rc.d denies it.
#   2. venv:    creates ./.venv (Python 3.11) unless it exists.
#   3. pip:     installs hvdtrain (editable) with torch==2.13.0 and the pinned versions in scripts/constraints.txt.
#   4. horovod: downloads the horovod==0.28.1 sdist from PyPI, checks its sha256, applies
#               scripts/patches/horovod-0.28.1.patch (C++17 for torch >= 2.1; drop XLA ops for TF >= 2.19;
#               gloo's interface for process sets; the standard includes GCC 13 needs) and
#               builds it with PyTorch ops and the Gloo and MPI controllers. Skipped when the stamp in
#               .venv/hvdtrain-horovod.stamp matches (same Horovod, patch, torch, build flags) and Horovod imports.
#               The wheel is kept in ~/.cache/hvdtrain-wheels/<key> (HVDTRAIN_WHEEL_CACHE), the key a hash over every
#               build input (sdist, patch, this script's build steps, torch/TF, Python, compiler, Open MPI, CUDA):
#               a new venv on the same machine installs it instead of compiling again (CI's clean clones).
#   5. check:   runs `hvdtrain doctor`.
#
# scripts/setup.sh --gpu: the GPU variant, on a machine with or without a GPU. It installs into ./.venv-gpu the CUDA
# build of torch 2.13.0 from PyPI (CUDA 13.0) and CUDA's compiler, headers and NCCL as PyPI wheels
# (cuda-toolkit[nvcc,...], nvidia-nccl-cu13), assembles a CUDA home from them in .build-gpu/cuda-home (symlinks
# in nvcc's layout) and builds Horovod with HOROVOD_GPU_OPERATIONS=NCCL for the GPU architectures in
# HOROVOD_BUILD_CUDA_CC_LIST (default 75,80,86,89,90,100,120). Frameworks default to torch there. Where
# HOROVOD_CUDA_HOME names a CUDA toolkit (the GPU Docker image), that one is used instead of the wheels.
#
# Environment knobs: PYTHON (interpreter for the venv, default python3), HVDTRAIN_VENV (default .venv; .venv-gpu
# with --gpu), HVDTRAIN_FRAMEWORKS (torch,tensorflow — the default — or torch), HVDTRAIN_BUILD_DIR (default .build;
# .build-gpu with --gpu), HOROVOD_GPU_OPERATIONS (NCCL in the GPU image and with --gpu), HOROVOD_CUDA_HOME,
# HOROVOD_BUILD_CUDA_CC_LIST, HVDTRAIN_FORCE_REBUILD=1 (build again, replacing the cached wheel),
# HVDTRAIN_WHEEL_CACHE (default ~/.cache/hvdtrain-wheels), HVDTRAIN_SKIP_APT=1.
set -euo pipefail

GPU=0
for arg in "$@"; do
  case "$arg" in
    --gpu) GPU=1 ;;
    -h|--help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "hvdtrain setup: unknown argument '$arg'; allowed: --gpu (the CUDA/NCCL build), --help" >&2; exit 2 ;;
  esac
done

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ "$GPU" == "1" ]]; then
  VENV="${HVDTRAIN_VENV:-$ROOT/.venv-gpu}"
  BUILD_DIR="${HVDTRAIN_BUILD_DIR:-$ROOT/.build-gpu}"
  FRAMEWORKS="${HVDTRAIN_FRAMEWORKS:-torch}"
  export HOROVOD_GPU_OPERATIONS="${HOROVOD_GPU_OPERATIONS:-NCCL}"
  export HOROVOD_BUILD_CUDA_CC_LIST="${HOROVOD_BUILD_CUDA_CC_LIST:-75,80,86,89,90,100,120}"
else
  VENV="${HVDTRAIN_VENV:-$ROOT/.venv}"
  BUILD_DIR="${HVDTRAIN_BUILD_DIR:-$ROOT/.build}"
  FRAMEWORKS="${HVDTRAIN_FRAMEWORKS:-torch,tensorflow}"
fi
PYTHON="${PYTHON:-python3}"
HOROVOD_VERSION="0.28.1"
HOROVOD_SHA256="92a43f5a94c43907a56805bad15f19700c62ffc83b7ca483f9e104e229f67ef0"
PATCH="$ROOT/scripts/patches/horovod-$HOROVOD_VERSION.patch"
CONSTRAINTS="$ROOT/scripts/constraints.txt"
STAMP="$VENV/hvdtrain-horovod.stamp"
# Frameworks Horovod is built for: torch always; tensorflow unless HVDTRAIN_FRAMEWORKS=torch.
case "$FRAMEWORKS" in
  torch) EXTRAS="torch,dev"; HVD_MODULES="horovod.torch" ;;
  torch,tensorflow|tensorflow,torch) EXTRAS="torch,tensorflow,dev"; HVD_MODULES="horovod.torch, horovod.tensorflow" ;;
  *) echo "hvdtrain setup: HVDTRAIN_FRAMEWORKS='$FRAMEWORKS' is not allowed; use 'torch' or 'torch,tensorflow'" >&2
     exit 2 ;;
esac
CURRENT_STEP="start"

fail() {
  echo "hvdtrain setup: FAILED at step '$CURRENT_STEP': $1" >&2
  echo "hvdtrain setup: how to fix: $2" >&2
  exit 1
}
on_error() {
  local rc=$?
  echo "hvdtrain setup: FAILED at step '$CURRENT_STEP' (exit $rc); the output above says why." >&2
  echo "hvdtrain setup: nothing was reported as installed; fix the cause and re-run scripts/setup.sh (it resumes)." >&2
  exit "$rc"
}
trap on_error ERR
step() { CURRENT_STEP="$1"; echo "==> [$1] $2"; }

# ---- 1. system packages ---------------------------------------------------------------------------------
apt_packages() {
  step apt "system packages (Open MPI, compilers, ssh client/server, Slurm and munge)"
  if [[ "${HVDTRAIN_SKIP_APT:-0}" == "1" ]]; then echo "    skipped (HVDTRAIN_SKIP_APT=1)"; return; fi
  local want=(openmpi-bin libopenmpi-dev build-essential openssh-client openssh-server iproute2 procps patch)
  # Slurm and munge are for the tests' private cluster (tests/support/slurm.py). A machine with a Slurm of its own (a
  # cluster's login node: sbatch not from a Debian package) keeps it: Debian's would shadow or mismatch the site's.
  local sbatch
  sbatch="$(command -v sbatch || true)"
  if [[ -n "$sbatch" ]] && ! dpkg -S "$sbatch" >/dev/null 2>&1; then
    echo "    Slurm: this machine has its own ($sbatch); Debian's Slurm packages are not installed"
  else
    want+=(slurmctld slurmd slurm-client munge)
  fi
  local missing=()
  for p in "${want[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if [[ ${#missing[@]} -eq 0 ]]; then echo "    all present: ${want[*]}"; return; fi
  local sudo=()
  if [[ $(id -u) -ne 0 ]]; then
    command -v sudo >/dev/null || fail "missing ${missing[*]} and not root" \
      "run as root, or install them: apt-get install -y ${missing[*]}"
    sudo=(sudo)
  fi
  echo "    installing: ${missing[*]}"
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" \
    >/dev/null
  echo "    installed: ${missing[*]}"
}

# ---- 2. virtual environment ------------------------------------------------------------------------------
make_venv() {
  step venv "virtual environment at $VENV"
  command -v "$PYTHON" >/dev/null || fail "'$PYTHON' not found" "install Python 3.11 or set PYTHON=/path/to/python3.11"
  local ver
  ver="$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
  [[ "$ver" == "3.11" || "$ver" == "3.12" ]] || fail "$PYTHON is Python $ver, hvdtrain needs 3.11 or 3.12" \
    "set PYTHON=/path/to/python3.11 (the tested default) or python3.12"
  if [[ -x "$VENV/bin/python" ]]; then echo "    exists"; return; fi
  "$PYTHON" -m venv "$VENV" || fail "python -m venv failed" "apt-get install -y python3-venv (or use another Python 3.11)"
  echo "    created with $("$VENV/bin/python" --version)"
}

# ---- 3. python packages ----------------------------------------------------------------------------------
pip_packages() {
  step pip "hvdtrain + torch 2.13.0 + pinned dependencies (scripts/constraints.txt)"
  local pip=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
  # Horovod's setup.py imports packaging; it builds without isolation (against this venv's torch).
  "${pip[@]}" install -c "$CONSTRAINTS" pip setuptools wheel cmake packaging
  local gpu_pkgs=()
  if [[ "$GPU" == "1" ]]; then
    # torch's CUDA build (PyPI's torch 2.13.0 is +cu130; `!=2.13.0+cpu` passes over a local CPU build of the
    # same version) and, unless HOROVOD_CUDA_HOME names a toolkit, CUDA's compiler and headers as wheels.
    gpu_pkgs+=("torch!=2.13.0+cpu" nvidia-nccl-cu13)
    [[ -n "${HOROVOD_CUDA_HOME:-}" ]] || gpu_pkgs+=("cuda-toolkit[nvcc,crt,cccl,cudart]")
  fi
  "${pip[@]}" install -c "$CONSTRAINTS" -e "$ROOT[$EXTRAS]" "${gpu_pkgs[@]}"
  # Earlier installs put pytest-randomly here; it reorders every pytest run in this venv, users' included (a
  # distributed test suite's ranks then disagree on the order and hang). See the dev extra in pyproject.toml.
  if PYTHONPATH= "$VENV/bin/python" -c 'import importlib.metadata as m; m.distribution("pytest-randomly")' 2>/dev/null
  then
    "${pip[@]}" uninstall -y pytest-randomly
    echo "    removed pytest-randomly (it reorders every pytest run in this venv; scripts/test_order.sh brings its own)"
  fi
  echo "    torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)')," \
       "tensorflow $("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("tensorflow"))' \
                     2>/dev/null || echo none)," \
       "cmake $("$VENV/bin/cmake" --version | head -1 | awk '{print $3}')"
}

# ---- 4. horovod ------------------------------------------------------------------------------------------
build_key() {
  # Everything the built binary depends on: a change in any of these means a rebuild.
  "$VENV/bin/python" - "$HOROVOD_VERSION" "$(sha256sum "$PATCH" | cut -c1-16)" "${HOROVOD_GPU_OPERATIONS:-}${HOROVOD_GPU_OPERATIONS:+/${HOROVOD_BUILD_CUDA_CC_LIST:-all}}" "$FRAMEWORKS" <<'PY'
import importlib.util, sys
def ver(mod):
    if importlib.util.find_spec(mod) is None:
        return "none"
    from importlib.metadata import version, PackageNotFoundError
    for dist in {"torch": ["torch"], "tensorflow": ["tensorflow-cpu", "tensorflow"]}[mod]:
        try:
            return version(dist)
        except PackageNotFoundError:
            pass
    return "unknown"
print(f"horovod={sys.argv[1]} patch={sys.argv[2]} torch={ver('torch')} tensorflow={ver('tensorflow')} "
      f"gpu_ops={sys.argv[3] or 'none'} frameworks={sys.argv[4]} controllers=gloo,mpi")
PY
}

# The GPU variant's CUDA: a CUDA home assembled from the nvidia-* wheels (symlinks in nvcc's layout: nvcc.profile
# looks for bin/../lib64, where the wheels have lib/, and CMake's FindCUDAToolkit wants an unversioned libcudart.so),
# NCCL from the nvidia-nccl-cu13 wheel torch itself loads. With HOROVOD_CUDA_HOME set, that toolkit is used as is.
CUDA_ENV=()
cuda_env() {
  [[ -n "${HOROVOD_GPU_OPERATIONS:-}" ]] || return 0
  if [[ "$GPU" != "1" || -n "${HOROVOD_CUDA_HOME:-}" ]]; then
    CUDA_ENV=(HOROVOD_GPU_OPERATIONS="$HOROVOD_GPU_OPERATIONS")
    return 0
  fi
  local nv home="$BUILD_DIR/cuda-home"
  nv="$("$VENV/bin/python" -c 'import nvidia; print(list(nvidia.__path__)[0])')"
  [[ -x "$nv/cu13/bin/nvcc" && -f "$nv/nccl/include/nccl.h" ]] \
    || fail "no nvcc or nccl.h under $nv (cuda-toolkit[nvcc] / nvidia-nccl-cu13 wheels)" \
            "re-run scripts/setup.sh --gpu; or set HOROVOD_CUDA_HOME to an installed CUDA toolkit"
  rm -rf "$home"
  mkdir -p "$home/bin" "$home/lib64"
  ln -s "$nv/cu13/include" "$home/include"
  ln -s "$nv/cu13/nvvm" "$home/nvvm"
  ln -s "$nv"/cu13/bin/* "$home/bin/"
  ln -s "$nv"/cu13/lib/* "$home/lib64/"
  ln -s libcudart.so.13 "$home/lib64/libcudart.so"
  ln -s "$nv/nccl/lib/libnccl.so.2" "$home/lib64/libnccl.so"
  CUDA_ENV=(HOROVOD_GPU_OPERATIONS="$HOROVOD_GPU_OPERATIONS" HOROVOD_CUDA_HOME="$home" CUDA_HOME="$home"
            HOROVOD_NCCL_INCLUDE="$nv/nccl/include" HOROVOD_NCCL_LIB="$home/lib64" HOROVOD_NCCL_LINK=SHARED
            HOROVOD_BUILD_CUDA_CC_LIST="$HOROVOD_BUILD_CUDA_CC_LIST")
  echo "    CUDA $("$home/bin/nvcc" --version | sed -n 's/.*release \([0-9.]*\).*/\1/p') from wheels" \
       "(home: $home), NCCL from $nv/nccl, architectures $HOROVOD_BUILD_CUDA_CC_LIST"
}

# The wheel cache: a Horovod wheel built earlier on this machine is installed again, not rebuilt, when every input of
# its build is the same: the build key above, the sdist's sha256, this script's build functions, the Python, the
# compiler, Open MPI and (GPU) CUDA. A fresh machine has no cache and builds; a changed input is another key and
# rebuilds. Kept apart from hvdtrain's runtime cache (scripts/fresh_state.sh removes that one, not this).
WHEEL_CACHE="${HVDTRAIN_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hvdtrain-wheels}"
wheel_key() {  # build key -> a hash over every input of the build
  local cc mpi nvcc="none"
  cc="$( (cc --version 2>/dev/null || echo none) | head -1)"
  mpi="$( (mpirun --version 2>/dev/null || echo none) | head -1)"
  if [[ -n "${CUDA_HOME:-${HOROVOD_CUDA_HOME:-}}" || ${#CUDA_ENV[@]} -gt 0 ]]; then
    nvcc="$(env "${CUDA_ENV[@]}" bash -c '"${HOROVOD_CUDA_HOME:-${CUDA_HOME:-/nonexistent}}/bin/nvcc" --version' \
            2>/dev/null | tail -1 || echo none)"
  fi
  printf '%s\n' "$1" "sdist=$HOROVOD_SHA256" "python=$("$VENV/bin/python" -VV)" "cc=$cc" "mpi=$mpi" "nvcc=$nvcc" \
    "env=${CUDA_ENV[*]}" "script=$(declare -f horovod_build build_wheel cuda_env build_key wheel_key)" \
    | sha256sum | cut -c1-24
}

build_wheel() {  # key, wheel directory: download, check, patch and build the sdist into a wheel there
  local sdist="$BUILD_DIR/horovod-$HOROVOD_VERSION.tar.gz"
  if [[ ! -f "$sdist" ]] || ! echo "$HOROVOD_SHA256  $sdist" | sha256sum -c --quiet - 2>/dev/null; then
    rm -f "$sdist"
    "$VENV/bin/python" -m pip download -q --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$BUILD_DIR"
  fi
  echo "$HOROVOD_SHA256  $sdist" | sha256sum -c --quiet - \
    || fail "sha256 of $sdist does not match" "delete $BUILD_DIR and re-run; if it persists the download is tampered"
  local src="$BUILD_DIR/horovod-$HOROVOD_VERSION"
  rm -rf "$src"
  tar -xzf "$sdist" -C "$BUILD_DIR"
  patch -d "$src" -p1 --quiet < "$PATCH" || fail "patch did not apply" "check $PATCH against the sdist"
  echo "    patched with $(basename "$PATCH"); building ($1) — about 2-5 minutes on 2 cores (GPU: ~10)"
  local t0=$SECONDS log="$BUILD_DIR/horovod-build.log" tmp="$2.tmp.$$"
  local frameworks=(HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1)
  if [[ "$EXTRAS" == *tensorflow* ]]; then frameworks+=(HOROVOD_WITH_TENSORFLOW=1)
  else frameworks+=(HOROVOD_WITHOUT_TENSORFLOW=1); fi
  rm -rf "$tmp"
  if ! env PATH="$VENV/bin:$PATH" CMAKE_POLICY_VERSION_MINIMUM=3.5 MAKEFLAGS="-j$(nproc)" \
      HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1 "${frameworks[@]}" "${CUDA_ENV[@]}" \
      "$VENV/bin/python" -m pip wheel --no-build-isolation --no-deps --no-cache-dir -v -w "$tmp" "$src" >"$log" 2>&1
  then
    rm -rf "$tmp"
    tail -n 40 "$log" >&2
    fail "Horovod build failed (full log: $log)" \
      "read the compiler error above; missing MPI headers -> apt-get install libopenmpi-dev"
  fi
  rm -rf "$2"
  mv "$tmp" "$2"  # whole or not at all: an interrupted build leaves no wheel under the key
  echo "    built in $((SECONDS - t0)) s (log: $log)"
}

horovod_build() {
  step horovod "Horovod $HOROVOD_VERSION from the PyPI sdist, patched"
  local key
  key="$(build_key)"
  if [[ "${HVDTRAIN_FORCE_REBUILD:-0}" != "1" && -f "$STAMP" && "$(cat "$STAMP")" == "$key" ]] \
     && "$VENV/bin/python" -c "import $HVD_MODULES" 2>/dev/null; then
    echo "    already built ($key): not rebuilding"
    return
  fi
  rm -f "$STAMP"
  mkdir -p "$BUILD_DIR"
  cuda_env
  local dir
  dir="$WHEEL_CACHE/$(wheel_key "$key")"
  local wheels=("$dir"/horovod-"$HOROVOD_VERSION"-*.whl)
  if [[ "${HVDTRAIN_FORCE_REBUILD:-0}" == "1" || ! -f "${wheels[0]}" ]]; then
    mkdir -p "$WHEEL_CACHE"
    build_wheel "$key" "$dir"
    wheels=("$dir"/horovod-"$HOROVOD_VERSION"-*.whl)
  else
    echo "    the wheel built earlier from the same inputs: ${wheels[0]}"
  fi
  "$VENV/bin/python" -m pip uninstall -y -q horovod 2>/dev/null || true
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -c "$CONSTRAINTS" "${wheels[0]}"
  "$VENV/bin/python" -c "import $HVD_MODULES" \
    || fail "the Horovod wheel ${wheels[0]} does not import" "HVDTRAIN_FORCE_REBUILD=1 bash scripts/setup.sh"
  echo "$key" > "$STAMP"
}

# ---- 5. smoke test ---------------------------------------------------------------------------------------
smoke() {
  step doctor "hvdtrain doctor"
  local require=()
  [[ "${HOROVOD_GPU_OPERATIONS:-}" == "NCCL" ]] && require=(--require nccl)
  "$VENV/bin/hvdtrain" doctor "${require[@]}" || fail "hvdtrain doctor found a problem (see above)" "follow the fix it prints"
}

apt_packages
make_venv
pip_packages
horovod_build
smoke
echo "==> hvdtrain is ready: $VENV/bin/hvdtrain (activate with: source $VENV/bin/activate)"
