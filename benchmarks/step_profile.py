#!/usr/bin/env python3
"""Where the training step's time goes: a `jax.profiler` trace of the compiled step, its ops summed per category.

    python benchmarks/step_profile.py                         # small and base presets, batch 16 x 32, 10 steps
    python benchmarks/step_profile.py --presets small --plot docs/step_profile.png --json profile.json

The step is the project's own (benchmarks/train_step.py's JaxTrain: jax_transformer.training.trainer.make_train_step
under jit, the paper's Adam, dropout on). Its optimised HLO names every op the trace shows; each op's category comes
from the source locations XLA keeps in the op's metadata (the jax op names, which carry the Flax module path):

    matmul           dot products: XLA:CPU's YNNPACK fusions and dots (projections, attention products, output)
    softmax/LayerNorm  softmax, log-softmax (the loss) and LayerNorm, forward and backward
    dropout          the dropout masks and their application
    optimizer        Adam's update (the `optimizer` named scope of training.train_step)
    copies           copies and transposes XLA inserts between layouts
    other            the rest: embeddings, residual adds, the loss's gathers, broadcasts, reductions

Op times are summed over the traced steps and divided by their number. XLA:CPU runs independent ops on all cores
at once, so the categories add up to more than the wall time of a step: the shares say where the work is, the wall
time what it costs. The matmul rate inside the step (matmul FLOPs counted from the shapes, benchmarks/flops.py,
over the matmul ops' summed time) is set against `jnp.dot`'s own rate on an n x n matmul measured in the same run.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `python benchmarks/step_profile.py` puts benchmarks/ first on the path
    sys.path.insert(0, str(REPO))

from benchmarks.machine import machine_info  # noqa: E402

CONTAINERS = ("while", "call", "conditional")
CATEGORIES = ("matmul", "softmax/LayerNorm", "dropout", "optimizer", "copies", "other")
NOT_ON_CPU = (
    "step_profile reads XLA:CPU's op events (each named after its HLO op); JAX runs on {backend!r} here, whose "
    "trace names its kernels instead: run it on a CPU (JAX_PLATFORMS=cpu)"
)
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = .*?\b([\w\-]+)\(")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_CALLS = re.compile(r"calls=%([\w.\-]+)")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.\-]+) ")


def hlo_ops(hlo_text: str) -> dict[str, dict]:
    """Instruction name -> {"opcode", "op_names" (its own and, for a fusion, those of the ops fused into it)}."""
    by_computation: dict[str, list[str]] = collections.defaultdict(list)
    ops: dict[str, dict] = {}
    computation = None
    for line in hlo_text.splitlines():
        header = _COMPUTATION.match(line)
        if header and line.rstrip().endswith("{"):
            computation = header.group(1)
            continue
        found = _INSTRUCTION.match(line)
        if not found:
            continue
        name, opcode = found.groups()
        calls = _CALLS.search(line)
        ops[name] = dict(opcode=opcode, op_names=_OP_NAME.findall(line), calls=calls.group(1) if calls else None)
        by_computation[computation].append(name)

    def names_within(computation: str | None, depth: int = 0) -> list[str]:
        if computation is None or depth > 3:
            return []
        out = []
        for inner in by_computation.get(computation, []):
            out += ops[inner]["op_names"] + names_within(ops[inner]["calls"], depth + 1)
        return out

    for op in ops.values():
        if op["opcode"] == "fusion":
            op["op_names"] = op["op_names"] + names_within(op["calls"])
    return ops


def category(name: str, op: dict | None) -> str:
    """One op's category (see the module's docstring); the first rule that holds wins."""
    opcode = op["opcode"] if op else ""
    text = " ".join(op["op_names"]).lower() if op else ""
    if name.startswith(("ynn_fusion", "dot", "onednn")) or opcode in ("dot", "convolution"):
        return "matmul"
    if "optimizer" in text:
        return "optimizer"
    if "dropout" in text:
        return "dropout"
    if any(word in text for word in ("softmax", "logsumexp", "norm")):
        return "softmax/LayerNorm"
    if name.startswith(("copy", "transpose")) or opcode in ("copy", "transpose"):
        return "copies"
    return "other"


def op_times(trace_dir: Path, ops: dict[str, dict]) -> dict[str, float]:
    """Microseconds per HLO op summed over the trace (the Perfetto trace's complete events named after the ops)."""
    files = sorted(trace_dir.rglob("*.trace.json.gz"))
    if not files:
        raise FileNotFoundError(f"no *.trace.json.gz under {trace_dir}: the profiler wrote no trace")
    events = json.loads(gzip.decompress(files[-1].read_bytes()))["traceEvents"]
    total: dict[str, float] = collections.Counter()
    for event in events:
        name = event.get("name")
        # A while loop's (or call's) event spans its body's ops, which the trace times one by one: not counted twice.
        if event.get("ph") == "X" and name in ops and ops[name]["opcode"] not in CONTAINERS and "dur" in event:
            total[name] += float(event["dur"])
    return dict(total)


def profile_preset(preset_name: str, batch_size: int, length: int, steps: int, vocab: int, log=print) -> dict:
    import jax

    from benchmarks.flops import train_step_matmul_flops
    from benchmarks.train_step import JaxTrain, training_batch
    from tests.helpers.configs import preset_config
    from tests.helpers.twins import ported_params

    if jax.default_backend() != "cpu":
        raise RuntimeError(NOT_ON_CPU.format(backend=jax.default_backend()))
    config = preset_config(preset_name, vocab)
    batch = training_batch(config, batch_size, length)
    params, _ = ported_params(config)
    step = JaxTrain(config, batch, params)
    log(f"[{preset_name}] compiling and warming up")
    for _ in range(3):
        step()
    walls = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        walls.append(time.perf_counter() - start)
    ops = hlo_ops(step.step_fn.lower(step.state, step.batch).compile().as_text())
    with tempfile.TemporaryDirectory() as tmp:
        jax.profiler.start_trace(tmp, create_perfetto_trace=True)
        for _ in range(steps):
            step()
        jax.profiler.stop_trace()
        times = op_times(Path(tmp), ops)
    per_category = dict.fromkeys(CATEGORIES, 0.0)
    top: dict[str, list] = {c: [] for c in CATEGORIES}
    for name, microseconds in times.items():
        c = category(name, ops.get(name))
        per_category[c] += microseconds / steps / 1000.0
        top[c].append((microseconds / steps / 1000.0, name))
    flops = train_step_matmul_flops(config, batch_size, length, length)["train_step"]
    matmul_s = per_category["matmul"] / 1000.0
    log(f"[{preset_name}] wall {1000 * statistics.median(walls):.1f} ms/step (median of {steps})")
    return dict(
        preset=preset_name,
        batch=[batch_size, length],
        wall_ms_median=1000 * statistics.median(walls),
        wall_ms_min=1000 * min(walls),
        op_ms=per_category,
        largest_ops={c: [(round(ms, 3), n) for ms, n in sorted(top[c], reverse=True)[:5]] for c in CATEGORIES},
        matmul_gflop=flops / 1e9,
        matmul_gflops_in_ops=flops / matmul_s / 1e9 if matmul_s else None,
        step_gflops=flops / statistics.median(walls) / 1e9,
    )


def jnp_dot_rate(n: int = 2048, repeats: int = 10) -> float:
    """GFLOP/s of jnp.dot on n x n float32 (the fastest of `repeats` calls): XLA's own matmul rate here."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    a = jax.device_put(np.random.default_rng(0).standard_normal((n, n), np.float32))
    dot = jax.jit(jnp.dot)
    dot(a, a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dot(a, a).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2.0 * n**3 / best / 1e9


def table(report: dict) -> str:
    lines = ["| preset | wall ms/step | " + " | ".join(f"{c} ms (%)" for c in CATEGORIES) + " |"]
    lines.append("|---|---:|" + "---:|" * len(CATEGORIES))
    for row in report["presets"]:
        total = sum(row["op_ms"].values())
        cells = " | ".join(f"{row['op_ms'][c]:.1f} ({100 * row['op_ms'][c] / total:.0f}%)" for c in CATEGORIES)
        lines.append(f"| {row['preset']} | {row['wall_ms_median']:.1f} | {cells} |")
    peak = report["jnp_dot_gflops"]
    lines.append("")
    for row in report["presets"]:
        lines.append(
            f"{row['preset']}: {row['matmul_gflop']:.2f} GFLOP of matmuls per step; matmul ops at "
            f"{row['matmul_gflops_in_ops']:.0f} GFLOP/s ({100 * row['matmul_gflops_in_ops'] / peak:.0f}% of "
            f"jnp.dot's {peak:.0f}); the step at {row['step_gflops']:.0f} GFLOP/s of wall time "
            f"({100 * row['step_gflops'] / peak:.0f}% of jnp.dot's)"
        )
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["presets"]
    fig, ax = plt.subplots(figsize=(9, 1.8 + 0.7 * len(rows)))
    for i, row in enumerate(rows):
        left = 0.0
        for c, colour in zip(CATEGORIES, plt.cm.tab10.colors):
            ax.barh(i, row["op_ms"][c], left=left, color=colour, label=c if i == 0 else None)
            left += row["op_ms"][c]
        ax.plot([row["wall_ms_median"]] * 2, [i - 0.4, i + 0.4], color="black", lw=2, label="wall" if i == 0 else None)
    ax.set_yticks(range(len(rows)), [f"{r['preset']} ({r['batch'][0]} x {r['batch'][1]})" for r in rows])
    ax.set_xlabel("op time per training step, ms (summed over both cores' ops; black: wall time)")
    ax.legend(ncol=7, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.22), frameon=False)
    ax.set_title(f"Training step by op category, {report['machine']['cpu_model']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", default="small,base", help="comma-separated presets (default: small,base)")
    parser.add_argument("--batch-size", type=int, default=16, help="rows per batch (default: 16)")
    parser.add_argument("--length", type=int, default=32, help="tokens per row (default: 32)")
    parser.add_argument("--vocab", type=int, default=8000, help="vocabulary size (default: 8000)")
    parser.add_argument("--steps", type=int, default=10, help="steps timed and traced (default: 10)")
    parser.add_argument("--json", type=Path, help="also write the report here")
    parser.add_argument("--plot", type=Path, help="also draw the categories as a bar chart (PNG) here")
    parser.add_argument(
        "--keep-freed-memory",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep the memory the process frees, as `train.py train` does "
        "(jax_transformer.training.host_memory; default on)",
    )
    args = parser.parse_args(argv)
    from jax_transformer.training import host_memory

    kept = args.keep_freed_memory and host_memory.keep_freed_memory()  # before jax starts its threads
    import jax

    if jax.default_backend() != "cpu":
        parser.error(NOT_ON_CPU.format(backend=jax.default_backend()))
    info = machine_info()
    report = {"machine": info, "freed_memory_kept": kept, "jnp_dot_gflops": jnp_dot_rate(), "presets": []}
    for name in args.presets.split(","):
        report["presets"].append(profile_preset(name, args.batch_size, args.length, args.steps, args.vocab))
    features = " ".join(info["cpu_features"])
    print(f"machine: {info['cpu_model']}, {info['cores']} cores ({features}); jax {info['libraries'].get('jax')}")
    print(f"date: {info['date']}; freed memory {'kept (as train.py train)' if kept else 'not kept'}")
    print(table(report))
    for row in report["presets"]:
        for c in CATEGORIES:
            ops = ", ".join(f"{n} {ms:.2f}" for ms, n in row["largest_ops"][c][:3])
            print(f"  {row['preset']} {c}: largest ops (ms/step) {ops}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    if args.plot:
        plot(report, args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
