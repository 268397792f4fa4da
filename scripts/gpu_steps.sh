# scripts/gpu_steps.sh — the steps of scripts/gpu_check.sh (sourced; each runs in its own bash under `timeout`).
# Environment from gpu_check.sh: ROOT OUT_DIR VENDOR PY WORK VENV VPY SDIST NCCL_DIR CC_LIST CUDA_HOME_DIR
# BUILD_FLAGS.
# A step exits 0 (pass), 77 (skipped) or anything else (fail); a line "gpu_check-note: TEXT" is its summary.
# shellcheck shell=bash

note() { echo "gpu_check-note: $*"; }
# A step that stops at a failing command (set -e) still leaves a note naming it.
set -E
trap 'note "failed (exit $?): $BASH_COMMAND"' ERR

# The headline numbers of a step's JSON for its note (never fails: "no numbers" if the file is missing or odd).
numbers() {
  "$VPY" - "$1" "$2" <<'PY' 2>/dev/null || echo "no numbers"
import json, sys
kind, d = sys.argv[1], json.load(open(sys.argv[2]))
if kind == "recipe":
    line = f"{d['samples_per_sec']:.0f} samples/s, data wait {d['data_wait_share']:.1%} of step"
    if d.get("gpu_idle_share") is not None:
        line += f", GPU idle {d['gpu_idle_share']:.1%} between steps"
elif kind == "feed":  # B8: hvdtrain's feed vs data on the GPU vs DataLoader, with the goals
    med = d["median"]
    line = (", ".join(f"{f} {m['samples_per_s']:.0f}/s" for f, m in med.items())
            + "; " + "; ".join(f"{k}: {g['value']:.3g} {'met' if g['met'] else 'NOT met'}"
                               for k, g in d["goals"].items()))
elif kind == "p4":  # the recipe vs Horovod's synthetic-benchmark method
    line = (f"recipe {d['recipe_img_per_sec_per_worker']['mean']:.0f} vs synthetic method "
            f"{d['synthetic_img_per_sec_per_worker']['mean']:.0f} img/s (means) = {d['ratio_recipe_over_synthetic']:.3f}x"
            f", {d['paired_ratio_median']:.3f}x median of paired ratios")
elif kind == "steps":  # the recipe's step built up piece by piece from Horovod's synthetic-benchmark step
    line = ", ".join(f"{k} {v:.3f} ms ({d['ratio_vs_synthetic'][k]:.3f}x)" for k, v in d["ms_per_step"].items())
elif kind == "decode":  # images/s on all cores per decoder, nvJPEG, what a ResNet-50 consumes
    line = (", ".join(f"{k} {v.get('all_cores', 'skipped')}" for k, v in d["decoders"].items())
            + f"; nvjpeg {d.get('nvjpeg_batch_64')}/s; ResNet-50 bf16 trains at {d.get('resnet50_bf16_cl_batch_256')}/s")
elif kind == "jpeg":  # B9: ResNet-50 on JPEGs fed by hvdtrain vs data on the GPU vs DataLoader, with the goals
    med = d["median"]
    line = (", ".join(f"{f} {m['samples_per_s']:.0f}/s" for f, m in med.items())
            + " (feed alone: " + ", ".join(f"{f} {v:.0f}/s" for f, v in d["feed_only_samples_per_s"].items())
            + f"); hvdtrain GPU idle {med['hvdtrain']['gpu_idle_share']:.2%}; "
            + "; ".join(f"{k}: {g['value']:.3g} {'met' if g['met'] else 'NOT met'}" for k, g in d["goals"].items()))
else:  # h2d: per workload, the step time vs data already on the GPU and the host's wait in next()
    line = ("; ".join(
        f"{n} {w['modes']['prefetch']['ratio_vs_resident']:.3f}x resident (goal <= 1.02 "
        f"{'met' if w['goals']['prefetch_ratio_met'] else 'NOT met'}), host wait in next() "
        f"{w['modes']['prefetch']['wait_share']:.1%} of step (goal <= 1% "
        f"{'met' if w['goals']['prefetch_wait_met'] else 'NOT met'})" for n, w in d["workloads"].items()))
if not line:
    sys.exit(1)
print(line)
PY
}

step_env() {
  set -e
  nvidia-smi
  "$PY" - <<'PY'
import json, os, platform, shutil, subprocess, torch
p = torch.cuda.get_device_properties(0)
nvcc = shutil.which("nvcc")
env = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
       "gpu": p.name, "capability": f"{p.major}.{p.minor}", "memory_gib": round(p.total_memory / 2**30, 1),
       "gpus": torch.cuda.device_count(), "nccl_torch": ".".join(map(str, torch.cuda.nccl.version())),
       "nvcc": subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.split("\n")[-2]
               if nvcc else None,
       "nccl_dir": os.environ.get("NCCL_DIR") or None, "cores": os.cpu_count()}
json.dump(env, open(os.path.join(os.environ["WORK"], "env.json"), "w"), indent=2)
print(json.dumps(env, indent=2))
print(f"gpu_check-note: {env['gpu']} (sm_{p.major}{p.minor}), Python {env['python']}, torch {env['torch']}, "
      f"NCCL {env['nccl_torch']}")
PY
  [[ -n "$NCCL_DIR" && -f "$NCCL_DIR/include/nccl.h" ]] || { note "no nccl.h under torch's nvidia-nccl wheel"; exit 1; }
}

step_venv() {
  set -e
  # The machine's python3 may itself be a venv (the GPU image's is), whose packages --system-site-packages would
  # not show: a .pth file layers this venv over whatever site-packages $PY has (torch, numpy, pip, setuptools).
  # Its lines run site.addsitedir, so the base's own .pth files run too (setuptools' distutils shim, which
  # Horovod's build and horovodrun import on Python 3.12). What is installed here comes first on sys.path.
  # --without-pip: the base's pip serves (ensurepip may be missing, e.g. Ubuntu without python3-venv).
  "$PY" -m venv --without-pip "$VENV"
  "$PY" - > "$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_hvdtrain_base.pth" <<'PY'
import os, site
for p in site.getsitepackages():
    if os.path.isdir(p):
        print(f"import site; site.addsitedir({p!r})")
PY
  "$VPY" -c 'import setuptools, distutils.sysconfig, distutils.spawn, torch, pip'  # setuptools first: its shim
  "$VPY" -m pip install -q --no-index --no-deps --no-cache-dir "$VENDOR"/wheels/*.whl
  # hvdtrain itself, as a user installs it (pyproject's requires-python must admit this Python).
  "$VPY" -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir -e "$ROOT"
  "$VPY" -c 'import hvdtrain.cli, hvdtrain.data, hvdtrain.stream, pydantic, torch; print("imports ok")'
  note "venv over $("$VPY" --version) with $(ls "$VENDOR"/wheels/*.whl | wc -l) vendored wheels + hvdtrain -e"
}

step_build() {
  set -e
  local src="$WORK/horovod-$HOROVOD_VERSION" t0=$SECONDS
  [[ -f "$NCCL_DIR/include/nccl.h" ]] || { note "no nccl.h: torch's nvidia-nccl wheel not found by $PY"; exit 1; }
  rm -rf "$src" "$WORK/nccl-lib"
  tar -xzf "$SDIST" -C "$WORK"
  local patchfile="$ROOT/scripts/patches/horovod-$HOROVOD_VERSION.patch" gen=()
  if command -v patch >/dev/null; then patch -d "$src" -p1 --quiet < "$patchfile"
  elif command -v git >/dev/null; then (cd "$src" && git apply -p1 "$patchfile")
  else note "neither patch nor git is installed: cannot apply $patchfile"; exit 1; fi
  # Horovod's setup.py runs CMake's default generator (make); without make, Ninja (setup.py's "-- VERBOSE=1"
  # would be a ninja target, so it goes).
  if ! command -v make >/dev/null && command -v ninja >/dev/null; then
    sed -i "s/make_args.append('VERBOSE=1')/pass/" "$src/setup.py"
    gen=(CMAKE_GENERATOR=Ninja)
  fi
  # The nvidia-nccl wheel ships only libnccl.so.2; CMake's find_library wants libnccl.so.
  mkdir -p "$WORK/nccl-lib"
  ln -s "$NCCL_DIR/lib/libnccl.so.2" "$WORK/nccl-lib/libnccl.so"
  echo "build flags: $BUILD_FLAGS"
  # shellcheck disable=SC2086  # BUILD_FLAGS is a list of NAME=VALUE words
  if ! env $BUILD_FLAGS "${gen[@]}" PIP_NO_INDEX=1 PATH="$VENV/bin:$PATH" \
      "$VPY" -m pip install --no-index --no-deps --no-build-isolation --no-cache-dir -v "$src" > "$WORK/build.log" 2>&1
  then
    cp "$WORK/build.log" "$OUT_DIR/horovod_build.log"
    grep -n -m 30 -E '(error|Error|ERROR)[: ]' "$WORK/build.log"
    tail -n 60 "$WORK/build.log"
    note "Horovod build failed (the whole log: horovod_build.log)"; exit 1
  fi
  local built=$((SECONDS - t0))
  "$VENV/bin/horovodrun" --check-build
  "$VENV/bin/hvdtrain" doctor --require nccl
  note "Horovod $HOROVOD_VERSION with NCCL ops built in ${built} s for sm_$CC_LIST; doctor: NCCL ops built"
}

step_prefetch() {
  TORCH_CUDA_SANITIZER=1 "$VPY" -m pytest -q -p no:cacheprovider -p no:randomly \
    --junitxml="$WORK/prefetch-junit.xml" tests/data/test_prefetch_cuda.py tests/data/test_prefetch.py
  local rc=$?
  note "$(grep -o '<testsuite [^>]*' "$WORK/prefetch-junit.xml" 2>/dev/null | head -1 \
          | grep -oE '(errors|failures|skipped|tests)="[0-9]+"' | tr '\n' ' ')(TORCH_CUDA_SANITIZER=1)"
  return $rc
}

step_racecheck() {
  local cs
  cs="$(command -v compute-sanitizer || echo "$CUDA_HOME_DIR/bin/compute-sanitizer")"
  [[ -x "$cs" ]] || { note "compute-sanitizer not installed"; exit 77; }
  "$cs" --tool racecheck --error-exitcode 9 --print-limit 20 \
    "$VPY" -m pytest -q -p no:cacheprovider -p no:randomly tests/data/test_prefetch_cuda.py -k "n_batches"
  local rc=$?
  note "racecheck over the prefetcher's 1, 2 and 7 batch tests: exit $rc"
  return $rc
}

step_collectives() {
  "$VENV/bin/horovodrun" -np 1 -H localhost:1 --gloo \
    "$VPY" tests/scripts/gpu_collectives.py --out "$OUT_DIR/collectives.json"
  local rc=$?
  note "NCCL collectives on CUDA tensors (-np 1): exit $rc, $OUT_DIR/collectives.json"
  return $rc
}

step_h2d() {
  "$VPY" bench/h2d_overlap.py --rounds 2 --steps 60 --warmup 10 --json "$OUT_DIR/h2d_overlap.json"
  local rc=$?
  note "bench/h2d_overlap.py exit $rc: $(numbers h2d "$OUT_DIR/h2d_overlap.json") (h2d_overlap.json)"
  return $rc
}

step_recipe() {
  set -e
  local common=(--dataset synthetic --model resnet --synthetic-shape 3,32,32 --synthetic-samples 40000
                --batch-size 128 --epochs 1 --no-progress)
  "$VENV/bin/horovodrun" -np 1 -H localhost:1 --gloo "$VPY" recipes/pytorch_train.py "${common[@]}" \
    --run-dir "$WORK/run/pytorch"
  cp "$WORK/run/pytorch/summary.json" "$OUT_DIR/recipe_summary.json"
  "$VENV/bin/horovodrun" -np 1 -H localhost:1 --gloo "$VPY" recipes/pytorch_train.py "${common[@]}" \
    --precision bf16 --channels-last --run-dir "$WORK/run/pytorch-bf16"
  # kept in WORK (gpu_check.json embeds it): the device tool brings back at most 8 files from OUT
  cp "$WORK/run/pytorch-bf16/summary.json" "$WORK/recipe_bf16_summary.json"
  note "PyTorch recipe, ResNet on CUDA, one epoch of batches of 128: fp32 $(numbers recipe \
"$OUT_DIR/recipe_summary.json"); bf16 + channels-last $(numbers recipe "$WORK/recipe_bf16_summary.json")"
}

step_feed() {
  local rc rc_p4 rc_steps
  "$VENV/bin/horovodrun" -np 1 -H localhost:1 --gloo "$VPY" bench/gpu_feed.py --json "$OUT_DIR/gpu_feed.json"
  rc=$?
  # P4 on the GPU: the recipe's loop vs Horovod's synthetic-benchmark method, same model and batch, interleaved; then
  # where the difference goes, piece by piece. Kept in WORK (gpu_check.json embeds them): the device tool brings back
  # at most 8 files from OUT.
  "$VPY" bench/recipe_vs_synthetic.py --np 1 --batch-size 256 --width 64 --num-workers 4 --num-iters 6 \
    --num-batches-per-iter 200 --num-warmup-batches 200 && cp bench/out/recipe_vs_synthetic.json "$WORK/p4_gpu.json"
  rc_p4=$?
  "$VENV/bin/horovodrun" -np 1 -H localhost:1 --gloo "$VPY" bench/step_overhead.py --batch-size 256 --width 64 \
    --num-workers 4 --steps 100 --rounds 5 --json "$WORK/step_overhead.json"
  rc_steps=$?
  note "B8 bench/gpu_feed.py exit $rc: $(numbers feed "$OUT_DIR/gpu_feed.json") (gpu_feed.json); P4 exit $rc_p4: \
$(numbers p4 "$WORK/p4_gpu.json"); step overhead exit $rc_steps: $(numbers steps "$WORK/step_overhead.json")"
  [[ $rc -eq 0 && $rc_p4 -eq 0 && $rc_steps -eq 0 ]]
}

step_decode() {
  # Optional wheels for the decoder comparison (simplejpeg): .gpu-extra/*.whl, carried with the working tree.
  compgen -G "$ROOT/.gpu-extra/*.whl" >/dev/null \
    && "$VPY" -m pip install -q --no-index --no-deps --no-cache-dir "$ROOT"/.gpu-extra/*.whl
  # kept in WORK (gpu_check.json embeds it): the device tool brings back at most 8 files from OUT
  "$VPY" bench/jpeg_decode.py --json "$WORK/jpeg_decode.json"
  local rc=$?
  note "bench/jpeg_decode.py exit $rc: $(numbers decode "$WORK/jpeg_decode.json") (in gpu_check.json)"
  return $rc
}

step_jpeg() {
  df -h /dev/shm  # its producers' slots and the DataLoader's batches in flight: ~3 GB at the defaults
  # kept in WORK (gpu_check.json embeds it): the device tool brings back at most 8 files from OUT
  "$VPY" bench/gpu_jpeg.py --json "$WORK/gpu_jpeg.json"
  local rc=$?
  note "B9 bench/gpu_jpeg.py exit $rc: $(numbers jpeg "$WORK/gpu_jpeg.json") (in gpu_check.json)"
  return $rc
}

step_keras() {
  if ! "$VPY" -c 'import tensorflow' 2>/dev/null; then
    note "TensorFlow is not installed on this machine: the Keras recipe cannot run here"
    exit 77
  fi
  echo "TensorFlow present, but Horovod was built here without TensorFlow ops: not run"
  note "TensorFlow present; Horovod built without TF ops here (HOROVOD_WITHOUT_TENSORFLOW=1): Keras not run"
  exit 77
}
