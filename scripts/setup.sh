#!/usr/bin/env bash
# scripts/setup.sh — one-command install of hvdtrain and a working Horovod on today's frameworks.
#
# What it does (each step prints what it did; a failing step names itself and how to fix it):
#   1. apt:     installs Open MPI (openmpi-bin, libopenmpi-dev), build tools, ssh client, iproute2, and
#               openssh-server (sshd for the multi-host tests' namespace hosts; not started) — only the ones
#               missing. Needs root (or sudo).
#   2. venv:    creates ./.venv (Python 3.11) unless it exists.
#   3. pip:     installs hvdtrain (editable) with torch==2.13.0 and the pinned versions in scripts/constraints.txt.
#   4. horovod: downloads the horovod==0.28.1 sdist from PyPI, checks its sha256, applies
#               scripts/patches/horovod-0.28.1.patch (C++17 for torch >= 2.1; drop XLA ops for TF >= 2.19) and
#               builds it with PyTorch ops and the Gloo and MPI controllers. Skipped when the stamp in
#               .venv/hvdtrain-horovod.stamp matches (same Horovod, patch, torch, build flags) and Horovod imports.
#   5. check:   runs `hvdtrain doctor`.
#
# Environment knobs: PYTHON (interpreter for the venv, default python3), HVDTRAIN_VENV (default .venv),
# HVDTRAIN_FRAMEWORKS (torch,tensorflow — the default — or torch),
# HOROVOD_GPU_OPERATIONS (NCCL in the GPU image), HVDTRAIN_FORCE_REBUILD=1, HVDTRAIN_SKIP_APT=1.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${HVDTRAIN_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
HOROVOD_VERSION="0.28.1"
HOROVOD_SHA256="92a43f5a94c43907a56805bad15f19700c62ffc83b7ca483f9e104e229f67ef0"
PATCH="$ROOT/scripts/patches/horovod-$HOROVOD_VERSION.patch"
CONSTRAINTS="$ROOT/scripts/constraints.txt"
BUILD_DIR="${HVDTRAIN_BUILD_DIR:-$ROOT/.build}"
STAMP="$VENV/hvdtrain-horovod.stamp"
# Frameworks Horovod is built for: torch always; tensorflow unless HVDTRAIN_FRAMEWORKS=torch.
FRAMEWORKS="${HVDTRAIN_FRAMEWORKS:-torch,tensorflow}"
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
  step apt "system packages (Open MPI, compilers, ssh client/server)"
  if [[ "${HVDTRAIN_SKIP_APT:-0}" == "1" ]]; then echo "    skipped (HVDTRAIN_SKIP_APT=1)"; return; fi
  local want=(openmpi-bin libopenmpi-dev build-essential openssh-client openssh-server iproute2 procps patch)
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
  [[ "$ver" == "3.11" ]] || fail "$PYTHON is Python $ver, hvdtrain needs 3.11" "set PYTHON=/path/to/python3.11"
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
  "${pip[@]}" install -c "$CONSTRAINTS" -e "$ROOT[$EXTRAS]"
  echo "    torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)')," \
       "tensorflow $("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("tensorflow"))' \
                     2>/dev/null || echo none)," \
       "cmake $("$VENV/bin/cmake" --version | head -1 | awk '{print $3}')"
}

# ---- 4. horovod ------------------------------------------------------------------------------------------
build_key() {
  # Everything the built binary depends on: a change in any of these means a rebuild.
  "$VENV/bin/python" - "$HOROVOD_VERSION" "$(sha256sum "$PATCH" | cut -c1-16)" "${HOROVOD_GPU_OPERATIONS:-}" "$FRAMEWORKS" <<'PY'
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
  echo "    patched with $(basename "$PATCH"); building ($key) — about 2-5 minutes on 2 cores"
  local t0=$SECONDS log="$BUILD_DIR/horovod-build.log"
  local frameworks=(HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1)
  if [[ "$EXTRAS" == *tensorflow* ]]; then frameworks+=(HOROVOD_WITH_TENSORFLOW=1)
  else frameworks+=(HOROVOD_WITHOUT_TENSORFLOW=1); fi
  "$VENV/bin/python" -m pip uninstall -y -q horovod 2>/dev/null || true
  if ! env PATH="$VENV/bin:$PATH" CMAKE_POLICY_VERSION_MINIMUM=3.5 MAKEFLAGS="-j$(nproc)" \
      HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1 "${frameworks[@]}" \
      "$VENV/bin/python" -m pip install --no-build-isolation --no-cache-dir -v "$src" >"$log" 2>&1; then
    tail -n 40 "$log" >&2
    fail "Horovod build failed (full log: $log)" \
      "read the compiler error above; missing MPI headers -> apt-get install libopenmpi-dev"
  fi
  echo "    built in $((SECONDS - t0)) s (log: $log)"
  echo "$key" > "$STAMP"
}

# ---- 5. smoke test ---------------------------------------------------------------------------------------
smoke() {
  step doctor "hvdtrain doctor"
  "$VENV/bin/hvdtrain" doctor || fail "hvdtrain doctor found a problem (see above)" "follow the fix it prints"
}

apt_packages
make_venv
pip_packages
horovod_build
smoke
echo "==> hvdtrain is ready: $VENV/bin/hvdtrain (activate with: source $VENV/bin/activate)"
