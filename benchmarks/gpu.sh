#!/usr/bin/env bash
# The GPU runs as steps that each end within 10 minutes, most important first (docs/gpu-tpu.md).
#
#   bash benchmarks/gpu.sh prepare             # HERE, once, on the development machine: see "prepare" below
#   bash benchmarks/gpu.sh prepare ctranslate2 # HERE, once more for the ctranslate2 step: its wheel, .gpu/wheels
#   bash benchmarks/gpu.sh list                # the steps, in the order to run them
#   bash benchmarks/gpu.sh STEP                # on the GPU machine, from the repository root
#   bash benchmarks/gpu.sh --dry-run STEP|all  # print what a step would run, without running it
#
# Each step prints the machine (GPU, driver, jax/torch versions) and writes its log, JSON and Markdown under $OUT
# (the device tool returns what is there; default .gpu/out), at most 7 files. With the device tool, one step per
# call: run(command="bash benchmarks/gpu.sh STEP", carry=[".gpu/carry"], timeout_s=600); the ctranslate2 step
# carries [".gpu/carry", ".gpu/wheels"]. LIMIT (seconds, default 570) bounds a step's commands together.
#
# What the GPU machine needs beyond the repository, copied into the git-ignored .gpu/carry by `prepare`:
# num2words and docopt (pure Python; the built-in task needs them and the GPU image lacks them) and the Multi30k
# files; `prepare ctranslate2` puts CTranslate2's wheel (43 MB) in .gpu/wheels, carried by its step alone (what
# is carried must stay under 64 MiB). JAX's persistent compilation cache lives in .gpu/cache (git-ignored, not
# carried): it survives between calls while the machine stays warm, so a repeated step compiles less.
set -euo pipefail
cd "$(dirname "$0")/.."

DRY_RUN=0
if [ "${1:-}" = "--dry-run" ]; then DRY_RUN=1; shift; fi
STEP="${1:-list}"
PY="${PYTHON:-python3}"
OUT="${OUT:-.gpu/out}"
LIMIT="${LIMIT:-570}"  # seconds: a step's commands are interrupted (SIGINT: pytest still reports) inside 10 minutes
DATA=.gpu/carry/data/multi30k

# Ranked: (1) the suite green on the GPU, (2) bf16 vs float32 step, JAX vs the twin, (3) Multi30k, (4) the rest.
STEPS=(
  "suite-tests         tests/ on the GPU (JAX there; deterministic GPU ops and no preallocation: conftest.py)"
  "suite-parity-1      parity_tests, first half, the PyTorch twin on the GPU too (pytest --device cuda)"
  "suite-parity-2      parity_tests, second half, the twin on the GPU"
  "bf16-step-base      base preset 256 x 64 (16k token slots): JAX float32/TF32, highest, bf16, bf16+cuDNN vs the twin"
  "bf16-step-base-25k  base preset 512 x 64 (~25k target tokens, the paper's batch): the same variants"
  "multi30k            the multi30k recipe's command: seconds from launch to BLEU 40, cold then warm compilation cache"
  "bf16-step-small     small preset 128 x 32 (launch-bound): the same variants"
  "torch-compile-base  base 256 x 64 again with torch.compile (bf16 autocast) among the variants"
  "decode              greedy and beam 4, float32 and bfloat16, JAX vs the twin's cached decoder, batch 64 and 1"
  "compile             the training step's compilation, cold and warm persistent cache, base and small"
  "benchmark-quick     benchmarks/run.py --quick: sections 1-5 on this machine (pmap on simulated CPU devices)"
  "ctranslate2         decoding rows against CTranslate2 on the GPU: float32, bfloat16, and its float16"
)

run() {  # run (or, with --dry-run, print) a command; it stops after $LIMIT seconds with SIGINT
  if [ "$DRY_RUN" = 1 ]; then echo "$*"; return 0; fi
  timeout -s INT "$LIMIT" "$@"
}

logged() {  # logged NAME CMD...: run CMD, its output also in $OUT/NAME.log (kept when the command fails)
  local name="$1"; shift
  if [ "$DRY_RUN" = 1 ]; then run "$@"; return 0; fi
  set -o pipefail
  run "$@" 2>&1 | tee "$OUT/$name.log"
}

machine() {  # what we run on: printed, and $OUT/machine.json
  [ "$DRY_RUN" = 1 ] && return 0
  mkdir -p "$OUT" .gpu/cache
  echo "== $(date -Is) step $STEP"
  nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv || echo "no nvidia-smi"
  "$PY" - <<'EOF'
import jax, torch, sys
print("python", sys.version.split()[0], "| jax", jax.__version__, jax.devices(), "| torch", torch.__version__,
      "cuda", torch.version.cuda, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA")
EOF
  "$PY" benchmarks/machine.py > "$OUT/machine.json"
}

environment() {
  export PYTHONUNBUFFERED=1
  # JAX and torch share the GPU in one process: JAX must not take 75% of its memory at start.
  export XLA_PYTHON_CLIENT_PREALLOCATE=false
  export CUBLAS_WORKSPACE_CONFIG=:4096:8  # deterministic cuBLAS (torch.use_deterministic_algorithms)
  if ! "$PY" -c "import num2words" 2>/dev/null; then  # missing on the GPU image: the copy `prepare` made
    export PYTHONPATH=".gpu/carry/pylib${PYTHONPATH:+:$PYTHONPATH}"
  fi
}

suite() {  # suite NAME PYTEST-ARGS...: the tests with JAX's persistent compilation cache kept in .gpu/cache
  local name="$1"; shift
  if [ "$DRY_RUN" = 0 ] &&
    ! XLA_FLAGS=--xla_gpu_deterministic_ops=true "$PY" -c "import jax; jax.devices()" 2>/dev/null; then
    # conftest.py adds --xla_gpu_deterministic_ops=true unless XLA_FLAGS names a *deterministic_ops flag already;
    # an XLA that dropped that flag aborts on it, so use its successor.
    echo "XLA rejects --xla_gpu_deterministic_ops: using --xla_gpu_exclude_nondeterministic_ops=true"
    export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_exclude_nondeterministic_ops=true"
  fi
  JAX_COMPILATION_CACHE_DIR=.gpu/cache/jax logged "$name" "$PY" -m pytest -q --durations=25 \
    --junitxml "$OUT/$name.xml" "$@"
}

bench() {  # bench NAME RUN.PY-ARGS...: benchmarks/run.py with its JSON and Markdown under $OUT
  local name="$1"; shift
  logged "$name" "$PY" benchmarks/run.py "$@" --json "$OUT/$name.json" --markdown "$OUT/$name.md"
}

multi30k() {  # benchmarks/multi30k.py time-to-bleu: two runs of the multi30k recipe's command (at most 4 minutes each),
  # the first with an empty compilation cache, the second with the cache the first wrote; each stops at the first
  # evaluation during training (greedy, 200 sentences) with BLEU >= 40 and reports the seconds since launch.
  if [ "$DRY_RUN" = 0 ] && [ ! -f "$DATA/train.de" ]; then
    echo "no $DATA: run 'bash benchmarks/gpu.sh prepare' here first"; exit 1
  fi
  logged multi30k "$PY" benchmarks/multi30k.py time-to-bleu --data "$DATA" --minutes 4 --json "$OUT/multi30k.json" \
    --plot "$OUT/multi30k.png"
}

ctranslate2_rows() {  # benchmarks/ctranslate2_decoding.py on the GPU: greedy and beam 4 at batch 16, 64 and 1
  local LIMIT=$((LIMIT / 3))  # three processes, the step inside LIMIT (`run` reads it)
  # CTranslate2's wheel is carried (the image lacks it) and installed outside the image's site-packages.
  if ! "$PY" -c "import ctranslate2" 2>/dev/null; then
    local wheels=(.gpu/wheels/ctranslate2-*.whl)
    if [ "$DRY_RUN" = 0 ] && { [ "${#wheels[@]}" != 1 ] || [ ! -f "${wheels[0]}" ]; }; then
      echo "want one ctranslate2 wheel in .gpu/wheels, found: ${wheels[*]}; run" \
        "'bash benchmarks/gpu.sh prepare ctranslate2' here and carry .gpu/wheels"; exit 1
    fi
    [ "$DRY_RUN" = 1 ] || "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/ct2site "${wheels[0]}"
    export PYTHONPATH="/tmp/ct2site${PYTHONPATH:+:$PYTHONPATH}"
  fi
  # Its CUDA build opens libcublas.so.12 and libcublasLt.so.12 by name. An image with CUDA 13 alone has the .so.13
  # of both, whose functions CTranslate2 calls keep their names and signatures: links named .so.12 stand in.
  if [ "$DRY_RUN" = 0 ] && ! ldconfig -p | grep -q 'libcublas\.so\.12'; then
    local lib found where
    where="$("$PY" -c 'import site; print(" ".join(site.getsitepackages()))') /usr/local /usr/lib /opt"
    mkdir -p /tmp/cublas12
    for lib in libcublas libcublasLt; do
      # shellcheck disable=SC2086  # $where: folders, one word each
      found="$(find $where -name "$lib.so.12" -print -quit 2>/dev/null || true)"
      # shellcheck disable=SC2086
      [ -n "$found" ] || found="$(find $where -name "$lib.so.13" -print -quit 2>/dev/null || true)"
      if [ -n "$found" ]; then
        ln -sf "$found" "/tmp/cublas12/$lib.so.12"; echo "$lib.so.12 -> $found"
      else
        echo "warning: neither $lib.so.12 nor $lib.so.13 found: CTranslate2 will not run on the GPU"
      fi
    done
    export LD_LIBRARY_PATH="/tmp/cublas12${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  fi
  [ "$DRY_RUN" = 1 ] || "$PY" -c "import ctranslate2 as c; print('ctranslate2', c.__version__, 'GPUs', \
    c.get_cuda_device_count(), 'compute types', sorted(c.get_supported_compute_types('cuda')))"
  local rows="greedy:16,greedy:64,greedy:1,beam4:16,beam4:64,beam4:1" common="--device cuda --repeats 5"
  local bench=benchmarks/ctranslate2_decoding.py
  # float32 both sides: CTranslate2's float32 is full float32 on the GPU (no TF32), so JAX's matmuls "highest"
  logged ct2-float32 "$PY" "$bench" $common --rows "$rows" --dtype float32 --matmul-precision highest \
    --decoders flax,ctranslate2 --json "$OUT/ct2-float32.json"
  logged ct2-bfloat16 "$PY" "$bench" $common --rows "$rows" --dtype bfloat16 --ct2-compute-type bfloat16 \
    --decoders flax,ctranslate2 --json "$OUT/ct2-bfloat16.json"
  # CTranslate2's float16 beside its bfloat16 (the Flax model has no float16 policy: its bfloat16 rows are above)
  logged ct2-float16 "$PY" "$bench" $common --rows "$rows" --ct2-compute-type float16 --decoders ctranslate2 \
    --json "$OUT/ct2-float16.json"
}

prepare() {  # on the development machine: what the GPU machine lacks, into .gpu/carry (git-ignored)
  if [ "${1:-}" = ctranslate2 ]; then
    # CTranslate2 for Python 3.12 on x86-64 Linux (the GPU image's Python): its one wheel holds the CUDA build.
    rm -rf .gpu/wheels && mkdir -p .gpu/wheels
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 -d .gpu/wheels "ctranslate2==${CTRANSLATE2_VERSION:-4.8.5}"
  fi
  local pylib=.gpu/carry/pylib
  mkdir -p "$pylib"
  "$PY" - "$pylib" <<'EOF'
import importlib, pathlib, shutil, sys
target = pathlib.Path(sys.argv[1])
for name in ("num2words", "docopt"):  # pure Python: the source files are the package
    origin = pathlib.Path(importlib.import_module(name).__file__)
    if origin.name == "__init__.py":
        shutil.copytree(origin.parent, target / name, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__"))
    else:
        shutil.copy2(origin, target / origin.name)
    print("copied", name, "from", origin)
EOF
  if [ "${1:-}" != ctranslate2 ]; then
    mkdir -p "$DATA"
    cp "${MULTI30K:-../shared/data/multi30k}"/{train,val}.{de,en} "$DATA"/
  fi
  du -sh .gpu/carry .gpu/wheels 2>/dev/null || true
}

environment
case "$STEP" in
  list) printf '%s\n' "${STEPS[@]}" ;;
  prepare) prepare "${2:-}" ;;
  suite-tests) machine; suite suite-tests tests ;;
  suite-parity-1) machine; suite suite-parity-1 --device cuda parity_tests/test_forward_parity.py \
      parity_tests/test_loss_grad_parity.py parity_tests/test_bf16_parity.py parity_tests/test_attention_kernels.py \
      parity_tests/test_training_parity.py ;;
  suite-parity-2) machine; suite suite-parity-2 --device cuda parity_tests/test_decoding_parity.py \
      parity_tests/test_packing_parity.py parity_tests/test_port_parity.py parity_tests/test_weight_files.py ;;
  bf16-step-base) machine; bench bf16-step-base --sections gpu --gpu-parts train --quick --presets base \
      --batch-size 256 --length 64 --repeats 20 --warmup 2 ;;
  bf16-step-base-25k) machine; bench bf16-step-base-25k --sections gpu --gpu-parts train --quick --presets base \
      --batch-size 512 --length 64 --repeats 20 --warmup 2 ;;
  multi30k) machine; multi30k ;;
  bf16-step-small) machine; bench bf16-step-small --sections gpu --gpu-parts train --quick --presets small \
      --batch-size 128 --length 32 --repeats 30 --warmup 2 ;;
  torch-compile-base) machine; bench torch-compile-base --sections gpu --gpu-parts train --presets base \
      --batch-size 256 --length 64 --repeats 20 --warmup 2 ;;
  decode) machine; bench decode --sections gpu --gpu-parts decode --aux-presets small,base \
      --decode-batch-sizes 64,1 --decode-new-tokens 64 --repeats 10 ;;
  compile) machine; bench compile --sections gpu --gpu-parts compile --presets base,small --batch-size 256 \
      --length 64 ;;
  benchmark-quick) machine; bench benchmark-quick --quick ;;
  ctranslate2) machine; ctranslate2_rows ;;
  all)
    [ "$DRY_RUN" = 1 ] || { echo "'all' is for --dry-run: on the GPU run one step per call (10-minute limit)"; exit 1; }
    for line in "${STEPS[@]}"; do
      step="${line%% *}"
      echo "# $step"
      bash "$0" --dry-run "$step"
    done ;;
  *) echo "unknown step '$STEP'; the steps:"; printf '  %s\n' "${STEPS[@]}"; exit 2 ;;
esac
