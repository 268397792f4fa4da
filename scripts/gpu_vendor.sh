#!/usr/bin/env bash
# scripts/gpu_vendor.sh — fetch, on a machine with network, what scripts/gpu_check.sh needs on a GPU machine
# that has none: the Horovod 0.28.1 sdist (sha256-checked) and the wheels of hvdtrain's dependencies that the GPU
# image lacks (pydantic and its parts, zstandard, obstore; cffi for Horovod's build), for its Python (3.12, manylinux x86_64).
#
#   bash scripts/gpu_vendor.sh [DIR]          (DIR default: .gpu-vendor, ignored by git; about 17 MB)
#
# Then carry DIR to the GPU machine with the working tree and run `bash scripts/gpu_check.sh --vendor DIR`.
# DIR/MANIFEST lists every file with its sha256; gpu_check.sh refuses a vendor folder that does not match it.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${1:-$ROOT/.gpu-vendor}"
PY="${HVDTRAIN_VENDOR_PYTHON:-$ROOT/.venv/bin/python}"
GPU_PYTHON_VERSION="${HVDTRAIN_GPU_PYTHON_VERSION:-3.12}"
HOROVOD_VERSION="0.28.1"
HOROVOD_SHA256="92a43f5a94c43907a56805bad15f19700c62ffc83b7ca483f9e104e229f67ef0"
# hvdtrain's dependencies missing from the GPU image (device KINDS.md lists what it holds), at the pinned versions;
# cffi is Horovod's setup_requires (offline, setuptools would try to fetch it from PyPI).
PACKAGES=(pydantic zstandard obstore cffi)

[[ $# -le 1 && "${1:-}" != -* ]] || { echo "usage: bash scripts/gpu_vendor.sh [DIR]" >&2; exit 2; }
[[ -x "$PY" ]] || PY=python3
mkdir -p "$DIR/wheels"

sdist="$DIR/horovod-$HOROVOD_VERSION.tar.gz"
if [[ ! -f "$sdist" ]] && [[ -f "$ROOT/.build/horovod-$HOROVOD_VERSION.tar.gz" ]]; then
  cp "$ROOT/.build/horovod-$HOROVOD_VERSION.tar.gz" "$sdist"
fi
if [[ ! -f "$sdist" ]]; then
  "$PY" -m pip download -q --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$DIR"
fi
echo "$HOROVOD_SHA256  $sdist" | sha256sum -c --quiet - \
  || { echo "gpu_vendor: sha256 of $sdist does not match; delete it and re-run" >&2; exit 1; }

rm -f "$DIR"/wheels/*.whl
"$PY" -m pip download -q --only-binary=:all: --python-version "$GPU_PYTHON_VERSION" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -c "$ROOT/scripts/constraints.txt" -d "$DIR/wheels" "${PACKAGES[@]}"

(cd "$DIR" && find . -type f ! -name MANIFEST -printf '%P\n' | LC_ALL=C sort | xargs sha256sum > MANIFEST)
echo "gpu_vendor: $DIR ($(du -sh "$DIR" | cut -f1)): $(grep -c . "$DIR/MANIFEST") files for Python $GPU_PYTHON_VERSION"
