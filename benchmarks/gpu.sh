#!/usr/bin/env bash
# Every GPU measurement of docs/gpu-tpu.md as parts that each stop at a cap, ordered to fit a short lease.
#
#   bash benchmarks/gpu.sh prepare                    # HERE, once: what the GPU machine lacks, into .gpu/carry
#   bash benchmarks/gpu.sh list                       # the parts, their caps and the default plan
#   bash benchmarks/gpu.sh [PART ...]                 # THERE, from the repository root (default: the plan)
#   bash benchmarks/gpu.sh --dry-run [PART ...|all]   # print the commands without running them
#
# With the device tool: run(command="BUDGET=560 bash benchmarks/gpu.sh PART ...", carry=[".gpu/carry"],
# timeout_s=600), and the parts it skipped (it says which) in a second call while the machine is warm.
# BUDGET (seconds, default 560) bounds the parts together: each starts only with 30 s left and stops at the smaller
# of its cap and what is left. Each part's log, JSON, Markdown and pictures land in .gpu/work; after each part, and
# every 15 s meanwhile, that folder is packed into $OUT/gpu-results.tgz (the device tool returns at most 8 files),
# so a call stopped at its limit still returns what it measured.
#
# What the GPU machine lacks, copied into the git-ignored .gpu/carry by `prepare`: num2words and docopt (the
# built-in task), sacremoses (FSMT's tokenizer: parity_tests/test_pretrained.py needs it) as pure-Python sources,
# the Multi30k files (compressed), and the wheels of CTranslate2 (whose one Linux wheel holds the CUDA build) and of
# transformers at the version CI pins (the image's 5.17 is below the supported range: pyproject.toml). Everything
# carried, with the repository, must stay under 64 MiB (about 61 today).
set -euo pipefail
cd "$(dirname "$0")/.."

DRY_RUN=0
if [ "${1:-}" = "--dry-run" ]; then DRY_RUN=1; shift; fi
PY="${PYTHON:-python3}"
OUT="${OUT:-.gpu/out}"
WORK=.gpu/work
CARRY=.gpu/carry
DATA=$CARRY/data/multi30k
BUDGET="${BUDGET:-560}"  # seconds for the parts together (a device call may run 600)
WORKERS="${WORKERS:-12}"  # pytest-xdist workers sharing the one GPU (16 CPU cores on the lent machines)
DIST=worksteal
START=$SECONDS

# name, cap in seconds (for its commands together: the times an H100 took on 2026-11-27, with room), what it
# measures; the default plan is this order. They add up to more than one lease's 15 minutes: name the parts a lease
# is for (docs/gpu-tpu.md says which were measured when).
PARTS=(
  "suite              280  tests/ and parity_tests/ with both frameworks on the GPU (pytest --device cuda, $WORKERS workers)"
  "train-600m         150  the training step at NLLB-600M's shape (32k vocabulary, 64 x 128 tokens): JAX bf16 beside the twin's bf16 autocast"
  "train-600m-compile 300  the same step under torch.compile with bf16 autocast, in a process of its own"
  "train-base         150  the training step at the base preset (32k vocabulary, 128 x 128 tokens): JAX TF32 and bf16, the twin TF32 and bf16 autocast"
  "ctranslate2        400  decoding at opus-mt-en-de's shape (base, vocabulary 58,101) against CTranslate2 on the GPU, float32 and bfloat16, greedy and beam 4 at batch 1, 16, 64"
  "multi30k           300  the multi30k recipe's command: seconds from launch to validation BLEU 40, cold then warm compilation cache"
)

part_names() { local line; for line in "${PARTS[@]}"; do echo "${line%% *}"; done; }
part_cap() { local line; for line in "${PARTS[@]}"; do [ "${line%% *}" = "$1" ] && { read -r _ cap _ <<<"$line"; echo "$cap"; return; }; done; }

run() {  # run CMD... until the part's deadline (SIGINT first: pytest still reports), or print it with --dry-run
  if [ "$DRY_RUN" = 1 ]; then echo "$*"; return 0; fi
  local left=$((PART_END - SECONDS))
  if [ "$left" -lt 20 ]; then echo "== not run, $left s left of the part: $*"; return 124; fi
  timeout -s INT -k 20 "$left" "$@"
}

logged() {  # logged NAME CMD...: run CMD, its output also in $WORK/NAME.log (kept when the command fails)
  local name="$1"; shift
  if [ "$DRY_RUN" = 1 ]; then run "$@"; return 0; fi
  run "$@" 2>&1 | tee "$WORK/$name.log"
}

pack() {  # everything measured so far into $OUT/gpu-results.tgz (written aside, then renamed: never half a file)
  tar czf "$OUT/gpu-results.tgz.part" -C .gpu work 2>/dev/null && mv "$OUT/gpu-results.tgz.part" "$OUT/gpu-results.tgz"
}

machine() {  # what we run on: printed, and $WORK/machine.txt and machine.json
  nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,clocks.max.sm --format=csv || echo "no nvidia-smi"
  "$PY" - <<'EOF'
import jax, torch, flax, optax, sys
print("python", sys.version.split()[0], "| jax", jax.__version__, jax.devices(), "| flax", flax.__version__,
      "| optax", optax.__version__, "| torch", torch.__version__, "cuda", torch.version.cuda,
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA")
EOF
  "$PY" benchmarks/machine.py > "$WORK/machine.json"
}

environment() {
  export PYTHONUNBUFFERED=1
  # JAX and torch share the GPU in one process: JAX must not take 75% of its memory at start.
  export XLA_PYTHON_CLIENT_PREALLOCATE=false
  export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True  # less of torch's cache lost to fragments beside JAX's
  if ! "$PY" -c "import num2words, sacremoses" 2>/dev/null; then  # missing on the GPU image: `prepare`'s copies
    export PYTHONPATH="$CARRY/pylib${PYTHONPATH:+:$PYTHONPATH}"
  fi
  [ "$DRY_RUN" = 1 ] && return 0
  # The carried wheels (CTranslate2, transformers) in a folder of their own, ahead of the image's site-packages.
  local wheels=("$CARRY"/wheels/*.whl)
  if [ -f "${wheels[0]}" ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/carried "${wheels[@]}"
    export PYTHONPATH="/tmp/carried${PYTHONPATH:+:$PYTHONPATH}"
  else
    echo "no wheels in $CARRY/wheels: the ctranslate2 part and its tests will not run"
  fi
  # CTranslate2's CUDA build opens libcublas.so.12 and libcublasLt.so.12 by name. An image with CUDA 13 alone has the
  # .so.13 of both, whose functions CTranslate2 calls keep their names and signatures: links named .so.12 stand in.
  if ! ldconfig -p | grep -q 'libcublas\.so\.12'; then
    local lib found where
    where="$("$PY" -c 'import site; print(" ".join(site.getsitepackages()))') /usr/local /usr/lib /opt"
    mkdir -p /tmp/cublas12
    for lib in libcublas libcublasLt; do
      # shellcheck disable=SC2086  # $where: folders, one word each
      found="$(find $where -name "$lib.so.12" -print -quit 2>/dev/null || true)"
      # shellcheck disable=SC2086
      [ -n "$found" ] || found="$(find $where -name "$lib.so.13" -print -quit 2>/dev/null || true)"
      if [ -n "$found" ]; then ln -sf "$found" "/tmp/cublas12/$lib.so.12"; else echo "warning: no $lib.so.12 or .13"; fi
    done
    export LD_LIBRARY_PATH="/tmp/cublas12${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  fi
  # xdist's worksteal keeps a test file's tests together and balances the rest (loadfile waits on the longest file)
  "$PY" -m pytest --help 2>/dev/null | grep -q worksteal || DIST=loadfile
  # XLA's GPU scatters and reductions are deterministic only with this flag (conftest.py sets it for the tests);
  # an XLA that dropped it aborts on it, so fall back to its successor.
  if ! XLA_FLAGS=--xla_gpu_deterministic_ops=true "$PY" -c "import jax; jax.devices()" 2>/dev/null; then
    echo "XLA rejects --xla_gpu_deterministic_ops: the suite uses --xla_gpu_exclude_nondeterministic_ops=true"
    DETERMINISTIC="--xla_gpu_exclude_nondeterministic_ops=true"
  fi
}

train_step() {  # train_step NAME SHAPE ROWS VARIANTS: benchmarks/run.py's gpu section, training step only
  local name="$1" shape="$2" rows="$3" variants="$4"
  logged "$name" "$PY" benchmarks/run.py --sections gpu --gpu-parts train --presets "$shape" --vocab 32000 \
    --batch-size "$rows" --length 128 --repeats 10 --warmup 2 --gpu-variants "$variants" \
    --json "$WORK/$name.json" --markdown "$WORK/$name.md"
}

part() {  # part NAME: one part's commands
  case "$1" in
    suite)
      # JAX's persistent compilation cache in .gpu/cache: a rerun on the same warm machine compiles less.
      XLA_FLAGS="${XLA_FLAGS:-} ${DETERMINISTIC:-}" JAX_COMPILATION_CACHE_DIR=.gpu/cache/jax logged suite \
        "$PY" -m pytest -q -n "$WORKERS" --dist "$DIST" --device cuda -p no:cacheprovider --durations=40 \
        --junitxml "$WORK/suite.xml" tests parity_tests ;;
    train-600m)
      # Every variant's state and both frameworks' memory pools share the GPU: the TF32 variants, whose float32
      # activations are the largest, are measured at the base preset only (XLA's CPU compilation of this step alone
      # asks 29 GB of temporaries).
      train_step train-600m nllb-600m 64 jax-bfloat16,torch-autocast ;;
    train-600m-compile)  # apart: the minutes torch.compile takes cannot cost the figures of the first
      train_step train-600m-compile nllb-600m 64 torch-compile ;;
    train-base)
      train_step train-base base 128 jax-float32,jax-bfloat16,torch-tf32,torch-autocast ;;
    ctranslate2)
      # Greedy and beam 4 at batch 16, 64 and 1; float32 is full float32 on both sides (CTranslate2's float32 GEMMs
      # use cuBLAS's default math, no TF32, so JAX's matmuls run "highest"); then bfloat16 on both.
      local rows="greedy:16,greedy:64,greedy:1,beam4:16,beam4:64,beam4:1"
      local shape=(--device cuda --preset base --vocab 58101 --rows "$rows" --repeats 3 --decoders flax,ctranslate2)
      logged ct2-float32 "$PY" benchmarks/ctranslate2_decoding.py "${shape[@]}" --dtype float32 \
        --matmul-precision highest --json "$WORK/ct2-float32.json"
      logged ct2-bfloat16 "$PY" benchmarks/ctranslate2_decoding.py "${shape[@]}" --dtype bfloat16 \
        --ct2-compute-type bfloat16 --json "$WORK/ct2-bfloat16.json" ;;
    multi30k)
      # Two runs of the recipe's command (at most 2.2 minutes each: the part's cap bounds both), the first with an
      # empty compilation cache, the second with what the first wrote; each stops at the first evaluation during
      # training (greedy, 200 sentences) with BLEU >= 40 and reports the seconds since launch.
      if [ "$DRY_RUN" = 0 ]; then
        [ -f "$DATA/train.de.gz" ] || { echo "no $DATA: run 'gpu.sh prepare' here"; return 1; }
        mkdir -p /tmp/multi30k && for f in "$DATA"/*.gz; do gunzip -c "$f" > "/tmp/multi30k/$(basename "$f" .gz)"; done
      fi
      logged multi30k "$PY" benchmarks/multi30k.py time-to-bleu --data /tmp/multi30k --minutes 2.2 \
        --json "$WORK/multi30k.json" --plot "$WORK/multi30k.png" ;;
    *) echo "unknown part '$1'; the parts:"; printf '  %s\n' "${PARTS[@]}"; exit 2 ;;
  esac
}

prepare() {  # on the development machine: what the GPU machine lacks, into .gpu/carry (git-ignored)
  rm -rf "$CARRY" && mkdir -p "$CARRY/wheels" "$CARRY/pylib" "$DATA"
  # For Python 3.12 on x86-64 Linux (the GPU image's Python), at the versions CI pins
  local pins=(); mapfile -t pins < <(grep -E '^(ctranslate2|transformers)==' .ci/constraints.txt)
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 -d "$CARRY/wheels" "${pins[@]}"
  "$PY" - "$CARRY/pylib" <<'EOF'
import importlib, pathlib, shutil, sys
target = pathlib.Path(sys.argv[1])
for name in ("num2words", "docopt", "sacremoses"):  # pure Python: the source files are the package
    origin = pathlib.Path(importlib.import_module(name).__file__)
    if origin.name == "__init__.py":
        shutil.copytree(origin.parent, target / name, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
    else:
        shutil.copy2(origin, target / origin.name)
    print("copied", name, "from", origin)
EOF
  for f in "${MULTI30K:-../shared/data/multi30k}"/{train,val}.{de,en}; do gzip -c "$f" > "$DATA/$(basename "$f").gz"; done
  du -sh "$CARRY"
}

ARGS=("$@")
case "${ARGS[0]:-}" in
  prepare) prepare; exit 0 ;;
  list)
    printf '%s\n' "${PARTS[@]}"
    total=0; for name in $(part_names); do total=$((total + $(part_cap "$name"))); done
    echo "default plan: $(part_names | tr '\n' ' ')(caps add up to $total s)"
    exit 0 ;;
  all | "") mapfile -t ARGS < <(part_names) ;;
esac
environment
for name in "${ARGS[@]}"; do [ -n "$(part_cap "$name")" ] || { echo "unknown part '$name'"; part unknown; }; done

if [ "$DRY_RUN" = 1 ]; then
  for name in "${ARGS[@]}"; do echo "# $name"; part "$name"; done
  exit 0
fi

mkdir -p "$OUT" "$WORK" .gpu/cache
exec > >(tee -a "$WORK/console.log") 2>&1
echo "== $(date -Is) parts: ${ARGS[*]}; budget $BUDGET s"
machine
(while sleep 15; do pack; done) &
PACKER=$!
trap 'kill $PACKER 2>/dev/null; pack' EXIT
status=0
for name in "${ARGS[@]}"; do
  left=$((BUDGET - (SECONDS - START)))
  cap=$(part_cap "$name")
  [ "$cap" -le $((left - 10)) ] || cap=$((left - 10))
  if [ "$cap" -lt 30 ]; then echo "== $name: skipped, $left s of the budget left"; continue; fi
  echo "== $(date -Is) $name (cap $cap s, $left s of the budget left)"
  part_start=$SECONDS
  PART_END=$((SECONDS + cap))
  part "$name" || { status=$?; echo "== $name: exit status $status"; }
  echo "== $name took $((SECONDS - part_start)) s"
  pack
done
exit "$status"
