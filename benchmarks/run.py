#!/usr/bin/env python3
"""Speed of the Flax Transformer against its PyTorch reference, on this machine, in one process tree.

    python benchmarks/run.py                    # the full run (15-20 minutes on a quiet 2-core machine)
    python benchmarks/run.py --quick            # batch 16 x 32, fewer repeats, no torch.compile, 64 new tokens
                                                # when decoding: a few minutes on a quiet machine
    python benchmarks/run.py --json out.json --markdown out.md
    python benchmarks/run.py --presets tiny --sections train,flops --repeats 1 --json smoke.json   # smoke test

Sections (`--sections`, comma-separated; all by default):
  train       one training step on the same batch in every framework (batch 64 x 32 tokens; 16 x 32 with
              --quick): JAX `jit` (make_train_step) against the PyTorch reference step
              (torch_reference.training.train_step) run eagerly with Adam's default (for-loop on CPU), foreach
              and fused implementations, and with the model under torch.compile: ms/step, target tokens/s, and
              the first call's time (compilation) apart.
  flops       achieved GFLOP/s of those steps: matmul FLOPs counted from the shapes (`train_step_matmul_flops`),
              cross-checked with the traced step's dot_general ops and XLA's cost analysis, as a percentage of
              the float32 matmul peak (jnp.dot, torch.mm) measured in the same run.
  first-step  time to the first finished step (trace + compile + run) in a fresh process, persistent caches off.
  decode      greedy and beam 4 search, batch 16 and 1, 64 new tokens (benchmarks/decoding.py's
              benchmark_decoding): the cached Flax decoder against PyTorch loops that re-run the prefix.
  pmap        data parallel `pmap` and sharded `jit` (a Mesh, the batch split by rows) over 4 simulated CPU
              devices against single-device `jit`, same global batch, all in one subprocess started with
              XLA_FLAGS=--xla_force_host_platform_device_count=4.
  accumulate  gradient accumulation: the global batch in K=4 micro-batches inside one step against one step on it,
              on one device: ms/step and the compiled step's temporary memory (benchmarks/scale.py).
  multihost   the sharded step on 4 simulated devices in one process against two processes on 127.0.0.1 joined by
              jax.distributed (2 devices each), one after the other (benchmarks/scale.py).
  gpu         (only when named) the training step in every precision, JAX beside the PyTorch twin on the same
              device (the GPU where there is one), FLOP/s as a share of the device's known peak, decoding in
              float32 and bfloat16, the attention-kernel A/B, compilation cold and warm: benchmarks/gpu.py, run
              by benchmarks/gpu.sh on a GPU machine.

Fairness: the frameworks are interleaved in one loop (JAX step, torch step, ..., JAX step, ...; the order rotates
every round) so that load from other processes on a shared machine hits all of them alike. Each figure is given
at the fastest and at the median of its timed repeats, after untimed warm-up steps. Ratios are of medians.
torch runs with torch.set_num_threads(number of cores); XLA uses all cores by default.
Where JAX runs on the CPU the process keeps the memory it frees, as `train.py train` does
(jax_transformer.training.host_memory), for every framework and section; `--no-keep-freed-memory` leaves glibc's malloc
as it is.
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `python benchmarks/run.py` puts benchmarks/ first on the path, not the repo
    sys.path.insert(0, str(REPO))

# None of these imports jax or torch: both are imported inside the functions that use them, after
# `isolate_caches` (they read its settings when first imported) and only in the processes that need them.
# Each section lives in its own module: train_step.py (1), flops.py (2), children.py (3 and 5, in child
# processes), decoding.py (4), scale.py (6 and 7); report.py holds the figures and tables.
from benchmarks.children import child_first_step, child_pmap, section_first_step, section_pmap  # noqa: E402
from benchmarks.common import Settings  # noqa: E402
from benchmarks.decoding import section_decode  # noqa: E402
from benchmarks.flops import section_flops  # noqa: E402
from benchmarks.gpu import GPU_PARTS, GPU_VARIANTS, child_compile, section_gpu  # noqa: E402
from benchmarks.machine import core_count, machine_info  # noqa: E402
from benchmarks.report import DEFAULT_SECTIONS, SECTION_TITLES, SECTIONS, markdown_table, text_table  # noqa: E402
from benchmarks.scale import child_multihost, section_accumulate, section_multihost  # noqa: E402
from benchmarks.train_step import TORCH_VARIANTS, section_train, set_torch_threads  # noqa: E402
from jax_transformer.settings.config import PRESETS  # noqa: E402
from jax_transformer.training import host_memory  # noqa: E402
from tests.helpers.configs import MODEL_SHAPES  # noqa: E402

SCHEMA = "jax-transformer-benchmark/1"


# =============================================================================================================
# Settings
# =============================================================================================================


# Timed repeats per preset. The base model takes seconds per step on a 2-core CPU, so it gets fewer.
FULL_REPEATS = {"tiny": 10, "small": 6, "base": 3}
QUICK_REPEATS = {"tiny": 3, "small": 3, "base": 2}


def parse_args(argv: Sequence[str] | None = None) -> tuple[argparse.Namespace, Settings]:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="batch 16 x 32 instead of 64 x 32, fewer repeats, no torch.compile, one fresh process "
        "per first-step figure, decoding 64 new tokens with beam search at batch 1 only: a few "
        "minutes on a quiet machine",
    )
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    p.add_argument("--markdown", metavar="FILE", help="also write the table as Markdown (for docs/benchmarks.md)")
    p.add_argument(
        "--presets",
        default="small,base",
        help=f"model presets for train/flops/first-step (comma-separated, from {sorted(PRESETS)}, or the real models' "
        f"shapes {sorted(MODEL_SHAPES)}; default small,base)",
    )
    p.add_argument(
        "--aux-presets",
        default="small",
        help="presets for the decode, pmap, accumulate and multihost sections (multihost: the first only; "
        "default small: the base model's re-run-the-"
        "prefix decoding alone takes many minutes on CPU)",
    )
    p.add_argument(
        "--sections",
        default=",".join(DEFAULT_SECTIONS),
        help=f"comma-separated subset of {SECTIONS} (default: all but gpu, which benchmarks/gpu.sh asks for)",
    )
    p.add_argument(
        "--gpu-parts",
        default=",".join(GPU_PARTS),
        help=f"parts of the gpu section, comma-separated subset of {GPU_PARTS} (default all)",
    )
    p.add_argument(
        "--gpu-variants",
        help=f"the gpu section's training-step variants, comma-separated subset of {list(GPU_VARIANTS)} (default: "
        "every one that applies)",
    )
    p.add_argument("--batch-size", type=int, help="training batch rows (default 64, 16 with --quick)")
    p.add_argument("--length", type=int, default=32, help="training source/target width in tokens (default 32)")
    p.add_argument("--vocab", type=int, default=8000, help="shared vocabulary size (default 8000)")
    p.add_argument(
        "--repeats",
        type=int,
        help="timed steps per figure, for every preset (default: per preset, "
        f"{FULL_REPEATS}, with --quick {QUICK_REPEATS})",
    )
    p.add_argument("--warmup", type=int, help="untimed steps before timing (default 2, 1 with --quick)")
    p.add_argument(
        "--torch-variants",
        help=f"comma-separated subset of {list(TORCH_VARIANTS)} (default all; "
        "with --quick default,fused: torch.compile alone takes minutes to compile on 2 cores)",
    )
    p.add_argument("--decode-batch-sizes", default="16,1", help="decode section batch sizes (default 16,1)")
    p.add_argument(
        "--decode-new-tokens",
        type=int,
        help="tokens each decoded sentence gets (default 64, as the speed goal is stated)",
    )
    p.add_argument("--peak-size", type=int, default=2048, help="n of the n x n matmul peak (default 2048)")
    p.add_argument(
        "--keep-freed-memory",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep the memory the process frees, as `train.py train` does on a CPU "
        "(jax_transformer.training.host_memory), for every framework and section in the process and its children "
        "(default on)",
    )
    p.add_argument(
        "--child", choices=("first-step", "pmap", "multihost", "compile"), help=argparse.SUPPRESS
    )  # subprocesses
    p.add_argument("--coordinator", help=argparse.SUPPRESS)  # the multihost child's jax.distributed settings
    p.add_argument("--num-processes", type=int, help=argparse.SUPPRESS)
    p.add_argument("--process-id", type=int, help=argparse.SUPPRESS)
    p.add_argument("--framework", choices=("jax", "torch"), help=argparse.SUPPRESS)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help=argparse.SUPPRESS)
    p.add_argument("--compile-cache", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    def listed(text: str, allowed, what: str) -> tuple[str, ...]:
        items = tuple(x.strip() for x in text.split(",") if x.strip())
        bad = [x for x in items if x not in allowed]
        if bad or not items:
            p.error(f"{what}: unknown {bad or 'empty list'}; choose from {sorted(allowed)}")
        return items

    def positive_ints(text: str, what: str) -> tuple[int, ...]:
        try:
            values = tuple(int(x) for x in text.split(",") if x.strip())
        except ValueError:
            p.error(f"{what}: expected comma-separated integers, got {text!r}")
        if not values or min(values) < 1:
            p.error(f"{what}: expected positive integers, got {text!r}")
        return values

    quick = args.quick
    repeats = dict(QUICK_REPEATS if quick else FULL_REPEATS)
    if args.repeats is not None:
        if args.repeats < 1:
            p.error(f"--repeats must be >= 1, got {args.repeats}")
        repeats = {name: args.repeats for name in PRESETS}
    warmup = args.warmup if args.warmup is not None else (1 if quick else 2)
    if warmup < 1:
        p.error(f"--warmup must be >= 1 (the first step compiles), got {warmup}")
    batch_size = args.batch_size or (16 if quick else 64)
    new_tokens = args.decode_new_tokens or 64
    for name, value in (
        ("--batch-size", batch_size),
        ("--length", args.length),
        ("--vocab", args.vocab),
        ("--peak-size", args.peak_size),
        ("--decode-new-tokens", new_tokens),
    ):
        if value < 1:
            p.error(f"{name} must be >= 1, got {value}")
    if args.vocab < 5:
        p.error(f"--vocab must be >= 5 (ids 0-3 are pad/bos/eos/unk), got {args.vocab}")
    if args.length < 2:
        p.error(f"--length must be >= 2, got {args.length}")
    variants = args.torch_variants or ("default,fused" if quick else ",".join(TORCH_VARIANTS))
    settings = Settings(
        presets=listed(args.presets, {**PRESETS, **MODEL_SHAPES}, "--presets"),
        aux_presets=listed(args.aux_presets, PRESETS, "--aux-presets"),
        sections=listed(args.sections, SECTIONS, "--sections"),
        gpu_parts=listed(args.gpu_parts, GPU_PARTS, "--gpu-parts"),
        batch_size=batch_size,
        length=args.length,
        vocab=args.vocab,
        repeats=repeats,
        warmup=warmup,
        first_step_runs=1 if quick or args.repeats == 1 else 2,
        torch_variants=listed(variants, TORCH_VARIANTS, "--torch-variants"),
        decode_batch_sizes=positive_ints(args.decode_batch_sizes, "--decode-batch-sizes"),
        decode_new_tokens=new_tokens,
        peak_size=args.peak_size,
        peak_repeats=1 if args.repeats == 1 else max(3, min(repeats.values())),
        torch_threads=core_count(),
        quick=quick,
        gpu_variants=listed(args.gpu_variants, GPU_VARIANTS, "--gpu-variants") if args.gpu_variants else None,
    )
    return args, settings


def isolate_caches() -> None:
    """Compilation is measured from scratch: no persistent XLA compilation cache, and a fresh, empty Inductor
    cache directory for torch.compile (removed at exit). Must run before jax and torch are imported."""
    if "jax" in sys.modules or "torch" in sys.modules:
        raise RuntimeError("isolate_caches() must run before jax and torch are imported")
    os.environ["JAX_ENABLE_COMPILATION_CACHE"] = "false"
    os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
    inductor_dir = tempfile.mkdtemp(prefix="benchmark-inductor-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = inductor_dir
    atexit.register(shutil.rmtree, inductor_dir, ignore_errors=True)


# =============================================================================================================
# Main
# =============================================================================================================


SECTION_FUNCTIONS = {
    "train": section_train,
    "flops": section_flops,
    "first-step": section_first_step,
    "decode": section_decode,
    "pmap": section_pmap,
    "accumulate": section_accumulate,
    "multihost": section_multihost,
    "gpu": section_gpu,
}


def main(argv: Sequence[str] | None = None) -> int:
    args, s = parse_args(argv)
    isolate_caches()
    if args.keep_freed_memory:  # before jax or torch starts a thread, as train.py
        s = dataclasses.replace(s, freed_memory_kept=host_memory.keep_freed_memory())
    if args.child == "first-step":
        print(json.dumps(child_first_step(args.framework, s)))
        return 0
    if args.child == "pmap":
        print(json.dumps(child_pmap(s)))
        return 0
    if args.child == "multihost":
        print(json.dumps(child_multihost(s, args.coordinator, args.num_processes, args.process_id)))
        return 0
    if args.child == "compile":
        print(json.dumps(child_compile(s, args.dtype, args.compile_cache)))
        return 0

    machine = machine_info()
    set_torch_threads(s.torch_threads)
    figures: list[dict] = []
    failures: list[dict] = []
    state: dict = {}
    started = time.perf_counter()
    for section in SECTIONS:
        if section not in s.sections:
            continue
        print(f"== {SECTION_TITLES[section]}", flush=True)
        section_start = time.perf_counter()
        SECTION_FUNCTIONS[section](s, figures, failures, state)
        print(f"   ({time.perf_counter() - section_start:.0f} s)", flush=True)
    result = {
        "schema": SCHEMA,
        "machine": machine,
        "load_average_end": machine_info()["load_average"],
        "settings": {**dataclasses.asdict(s), "torch_variants": {v: TORCH_VARIANTS[v] for v in s.torch_variants}},
        "definitions": {
            "min": "the figure at the fastest timed repeat (for a time, ms or s, its minimum; for a rate, "
            "tokens/s or GFLOP/s, its maximum: higher_is_better says which)",
            "median": "the figure at the median duration of the timed repeats",
            "seconds": "the durations themselves: min, median, max over the n timed repeats",
            "ratios": "each ratio is this figure's median over the named other figure's median (x 100 for %)",
        },
        "figures": figures,
        "failures": failures,
        "wall_time_s": time.perf_counter() - started,
    }
    print()
    print(text_table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        print(f"\nwrote {args.json}")
    if args.markdown:
        Path(args.markdown).write_text(markdown_table(result), encoding="utf-8")
        print(f"wrote {args.markdown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
