#!/usr/bin/env bash
# scripts/gpu_check.sh — verify hvdtrain's GPU path with one command, on a machine with an NVIDIA GPU, a CUDA build
# of torch already installed and no network (the lent GPU machines: Python 3.12, torch 2.11+cu130, nvcc 13.0).
#
#   bash scripts/gpu_vendor.sh                   (here, with network, once: the sdist and wheels into .gpu-vendor/)
#   bash scripts/gpu_check.sh --out DIR          (there; .gpu-vendor/ carried with the working tree)
#   device tool: run(command="bash scripts/gpu_check.sh --out $OUT", carry=[".gpu-vendor"])
#
# Steps, each timed and reported (DIR/gpu_check.json, DIR/summary.txt; all output in DIR/gpu_check.log):
#   env          GPU, driver, Python, torch, nvcc, NCCL found
#   venv         a venv layered over $PY's packages (torch) + the vendored wheels + hvdtrain (pip install -e)
#   build        Horovod 0.28.1 from the vendored sdist + scripts/patches, NCCL ops, Gloo (+ MPI if mpicc is there),
#                for this GPU's compute capability; then `hvdtrain doctor --require nccl`, `horovodrun --check-build`
#   collectives  horovodrun -np 1 --gloo: allreduce/allgather/broadcast of CUDA tensors through NCCL, checked
#   recipe       recipes/pytorch_train.py, synthetic data, ResNet on CUDA, one epoch in fp32 and one in bf16 +
#                channels-last; their summary.json (samples/s, host data wait, GPU idle between steps)
#   feed         bench/gpu_feed.py (B8): the recipe's loop fed by hvdtrain vs data already on the GPU vs torch's
#                DataLoader(pin_memory=True) vs the recipe's loop before issue 35, bf16 + channels-last; its goals
#                marked met / NOT met; then P4 on the GPU (bench/recipe_vs_synthetic.py: the recipe vs Horovod's
#                synthetic-benchmark method) and its breakdown, piece by piece (bench/step_overhead.py)
#   decode       bench/jpeg_decode.py: decoded + augmented 224 px JPEGs/s per core and on all cores for each decoder
#                (Pillow, OpenCV, simplejpeg if carried in .gpu-extra/, torchvision), nvJPEG on the GPU, and the
#                rate a ResNet-50 at bf16 + channels-last trains at (what the feed must reach)
#   jpeg         bench/gpu_jpeg.py (B9): a ResNet-50 on 224 px JPEGs, bf16 + channels-last, fed by hvdtrain (decode +
#                augment in the producers) vs decoded batches already on the GPU vs DataLoader; goals met / NOT met
#   prefetch     tests/data/test_prefetch_cuda.py + tests/data/test_prefetch.py under TORCH_CUDA_SANITIZER=1
#   h2d          bench/h2d_overlap.py: step time with the prefetcher vs synchronous copies vs data on the GPU
#   racecheck    compute-sanitizer --tool racecheck over a few of those tests (skipped where it is missing)
#   keras        the Keras recipe needs TensorFlow: run if it imports, else reported as skipped
#
# Options: --out DIR (default ./gpu-check-out), --vendor DIR (default .gpu-vendor), --python PY (default python3),
# --work DIR (build tree and venv; default a fresh temporary one), --skip LIST / --only LIST (step names, comma-
# separated), --dry-run (check the arguments and the vendor folder, print the build flags; needs no GPU),
# --budget SECONDS (default 540: every step's limit is cut so that the whole run and its report end within it; the
# device tool allows 600 s a command), --build-only (the venv and build steps alone, on a machine with or without a GPU: checks the offline build).
# Exit: 0 every step passed or was skipped, 1 a step failed, 2 bad arguments or vendor folder, 3 no GPU.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STEPS=(env venv build collectives recipe feed decode jpeg prefetch h2d racecheck keras)
OUT_DIR="$PWD/gpu-check-out" VENDOR="$ROOT/.gpu-vendor" PY=python3 WORK="" SKIP="" ONLY="" DRY=0 NEED_GPU=1 BUDGET=540
HOROVOD_VERSION="0.28.1"
HOROVOD_SHA256="92a43f5a94c43907a56805bad15f19700c62ffc83b7ca483f9e104e229f67ef0"  # as in scripts/setup.sh

die() { echo "gpu_check: $1" >&2; exit "${2:-2}"; }
in_list() { [[ ",$2," == *",$1,"* ]]; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --out|--vendor|--python|--work|--skip|--only|--budget)
      [[ $# -ge 2 && -n "$2" ]] || die "$1 needs a value (see --help)"
      case "$1" in --out) OUT_DIR="$2" ;; --vendor) VENDOR="$2" ;; --python) PY="$2" ;; --work) WORK="$2" ;;
                   --skip) SKIP="$2" ;; --only) ONLY="$2" ;; --budget) BUDGET="$2" ;; esac
      shift 2 ;;
    --dry-run) DRY=1; shift ;;
    --build-only) ONLY="venv,build"; NEED_GPU=0; shift ;;
    -h|--help) sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument '$1'; allowed: --out --vendor --python --work --skip --only --budget --dry-run \
--build-only --help" ;;
  esac
done
[[ "$BUDGET" =~ ^[0-9]+$ && "$BUDGET" -ge 60 ]] || die "--budget '$BUDGET' must be whole seconds, at least 60"
for name in ${SKIP//,/ } ${ONLY//,/ }; do
  in_list "$name" "$(IFS=,; echo "${STEPS[*]}")" || die "unknown step '$name' in --skip/--only; steps: ${STEPS[*]}"
done
command -v "$PY" >/dev/null || die "--python '$PY' not found"

# ---- the vendor folder: every file of its MANIFEST present and intact -----------------------------------------
[[ -f "$VENDOR/MANIFEST" ]] || die "no $VENDOR/MANIFEST: run 'bash scripts/gpu_vendor.sh' where there is network, \
and carry .gpu-vendor with the working tree"
(cd "$VENDOR" && sha256sum -c --quiet MANIFEST >/dev/null 2>&1) \
  || die "$VENDOR does not match its MANIFEST ($(cd "$VENDOR" && sha256sum -c --quiet MANIFEST 2>&1 | head -1)); \
re-run 'bash scripts/gpu_vendor.sh'"
VENDOR="$(cd "$VENDOR" && pwd)"
SDIST="$VENDOR/horovod-$HOROVOD_VERSION.tar.gz"
[[ -f "$SDIST" ]] || die "$SDIST is missing from the vendor folder; re-run 'bash scripts/gpu_vendor.sh'"
echo "$HOROVOD_SHA256  $SDIST" | sha256sum -c --quiet - >/dev/null 2>&1 \
  || die "$SDIST is not the Horovod $HOROVOD_VERSION sdist (sha256 differs); re-run 'bash scripts/gpu_vendor.sh'"

# ---- what the build uses: CUDA from nvcc, NCCL from torch's nvidia-nccl wheel, this GPU's architecture ---------
# The CUDA toolkit: HOROVOD_CUDA_HOME, else CUDA_HOME, else the one around the nvcc on PATH (a real toolkit: it has
# include/cuda_runtime.h; /usr/local/bin/nvcc may be a wrapper script), else /usr/local/cuda.
cuda_home() {
  local d nvcc
  nvcc="$(command -v nvcc || true)"
  for d in "${HOROVOD_CUDA_HOME:-}" "${CUDA_HOME:-}" "${nvcc:+$(dirname "$(readlink -f "$nvcc")")/..}" /usr/local/cuda; do
    [[ -n "$d" && -x "$d/bin/nvcc" && -f "$d/include/cuda_runtime.h" ]] && { (cd "$d" && pwd); return; }
  done
  echo /usr/local/cuda
}
CUDA_HOME_DIR="$(cuda_home)"
NVCC="$CUDA_HOME_DIR/bin/nvcc"
NCCL_DIR="$("$PY" -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__ or list(nvidia.nccl.__path__)[0] + "/x"))' 2>/dev/null || true)"
CC_LIST="${HOROVOD_BUILD_CUDA_CC_LIST:-$("$PY" -c 'import torch; a, b = torch.cuda.get_device_capability(0); print(f"{a}{b}")' 2>/dev/null || echo 90)}"
# MPI: optional where mpicc exists (CMake uses it if it works), left out where it does not.
MPI_FLAG=HOROVOD_WITHOUT_MPI=1
command -v mpicc >/dev/null && MPI_FLAG=""
# make -k: a failing build reports every error in one run (a GPU machine's minutes are few; Ninja, used
# where make is missing, ignores MAKEFLAGS).
build_flags() {
  echo "HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_CUDA_HOME=$CUDA_HOME_DIR CUDA_HOME=$CUDA_HOME_DIR" \
       "HOROVOD_NCCL_INCLUDE=${NCCL_DIR:-NOT_FOUND}/include HOROVOD_NCCL_LIB=$1 HOROVOD_NCCL_LINK=SHARED" \
       "HOROVOD_BUILD_CUDA_CC_LIST=$CC_LIST HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1" \
       "HOROVOD_WITHOUT_MXNET=1 HOROVOD_WITH_GLOO=1 $MPI_FLAG CMAKE_POLICY_VERSION_MINIMUM=3.5 MAKEFLAGS=-kj$(nproc)"
}
wanted() { ! in_list "$1" "$SKIP" && { [[ -z "$ONLY" ]] || in_list "$1" "$ONLY"; }; }

if [[ "$DRY" == "1" ]]; then
  echo "gpu_check: dry run: vendor folder $VENDOR intact ($(grep -c . "$VENDOR/MANIFEST") files)"
  echo "python:  $("$PY" --version 2>&1) ($PY)"
  echo "nvcc:    $NVCC$([[ -x "$NVCC" ]] || echo ' (not found here)')"
  echo "nccl:    ${NCCL_DIR:-not found here (the nvidia-nccl wheel of torch)}"
  echo "build:   $(build_flags '<work>/nccl-lib')"
  echo "steps:   $(for s in "${STEPS[@]}"; do wanted "$s" && printf '%s ' "$s"; done)"
  exit 0
fi

if [[ "$NEED_GPU" == "1" ]] && ! { nvidia-smi -L >/dev/null 2>&1 \
     && "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; }; then
  die "no NVIDIA GPU usable here (nvidia-smi and torch.cuda.is_available() must both work); nothing was built. \
Use --dry-run (arguments, vendor folder) or --build-only (the offline build) on a machine without one" 3
fi

mkdir -p "$OUT_DIR" || die "cannot create --out $OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
[[ -n "$WORK" ]] || WORK="$(mktemp -d /tmp/hvdtrain-gpu-check.XXXXXX)"
mkdir -p "$WORK/run"
LOG="$OUT_DIR/gpu_check.log" RESULTS="$WORK/steps.tsv" VENV="$WORK/venv"
VPY="$VENV/bin/python"
: > "$LOG"; : > "$RESULTS"
rm -f "$OUT_DIR"/{gpu_check.json,summary.txt,collectives.json,h2d_overlap.json,recipe_summary.json,gpu_feed.json,horovod_build.log}
export ROOT OUT_DIR VENDOR PY WORK VENV VPY SDIST NCCL_DIR CC_LIST CUDA_HOME_DIR HOROVOD_VERSION PYTHONUNBUFFERED=1
export HVDTRAIN_CACHE_DIR="$WORK/cache" HVDTRAIN_DATA_CACHE="$WORK/data-cache"
cd "$ROOT" || exit 1

# run_step NAME TIMEOUT: runs step_NAME in a child bash under `timeout`, its output into the log.
run_step() {
  local name="$1" limit="$2" t0 rc status own="$WORK/step-$1.log" left=$((DEADLINE - SECONDS))
  if ! wanted "$name"; then printf '%s\tskipped\t0\t-\tnot selected\n' "$name" >> "$RESULTS"; return; fi
  if [[ $left -lt 20 ]]; then
    printf '%s\ttimeout\t0\t-\tnot run: the --budget of %s s was spent\n' "$name" "$BUDGET" >> "$RESULTS"; return
  fi
  [[ $limit -le $((left - 10)) ]] || limit=$((left - 10))
  echo "==> [$name] (limit ${limit}s)" | tee -a "$LOG"
  t0=$(date +%s%N)
  timeout --kill-after=15 "$limit" bash -c "source '$ROOT/scripts/gpu_steps.sh'; step_$name" > "$own" 2>&1
  rc=$?
  cat "$own" >> "$LOG"
  case $rc in 0) status=pass ;; 77) status=skipped ;; 124|137) status=timeout ;; *) status=fail ;; esac
  printf '%s\t%s\t%d\t%s\t%s\n' "$name" "$status" "$(( ($(date +%s%N) - t0) / 1000000 ))" "$rc" \
    "$(grep -a '^gpu_check-note: ' "$own" | tail -1 | cut -c17-)" >> "$RESULTS"
  echo "    $status (exit $rc)" | tee -a "$LOG"
}

DEADLINE=$BUDGET  # SECONDS counts from the script's start
export BUILD_FLAGS
BUILD_FLAGS="$(build_flags "$WORK/nccl-lib")"
# The steps that prove the most come first, in case the budget runs out.
run_step env 60
run_step venv 180
run_step build 420
run_step collectives 120
run_step recipe 150
run_step feed 330
run_step decode 120
run_step jpeg 150
run_step prefetch 180
run_step h2d 180
run_step racecheck 100
run_step keras 60
"$PY" "$ROOT/scripts/gpu_report.py" "$RESULTS" "$OUT_DIR"
