#!/usr/bin/env python3
"""The multi30k recipe's de->en training run (docs/quality.md), measured from launch to exit: throughput over a
whole run (CPU) and time to BLEU 40 (GPU), each in fresh `train.py` processes.

    # once: copy the corpus into the repository's git-ignored .data/multi30k (train/val .de/.en, 5 MB)
    python benchmarks/multi30k.py prepare-data /work/shared/data/multi30k

    # the padding figures of docs/training.md's "Batching and compilation" (a minute, no training) and docs/packing.png
    python benchmarks/multi30k.py padding --plot docs/packing.png

    # CPU: target tokens/s over whole runs of N minutes (evaluations and compilation included), this checkout's
    # code (packed batches, cold compilation cache) against its bucketed batches and against the code at --old-ref
    python benchmarks/multi30k.py end-to-end --minutes 10 --json e2e.json --plot e2e.png

    # GPU: seconds from launch to validation BLEU >= 40 (greedy, 200 sentences), cold then warm compilation cache
    python benchmarks/multi30k.py time-to-bleu --json bleu40.json --plot bleu40.png   # two runs of <= 4 minutes

Both run the `multi30k` recipe (`jax_transformer/settings/configs/recipes/multi30k.json`, docs/quality.md's Multi30k
command before the 60-minute CPU recipe `multi30k-cpu`), written out as flags so that the code before recipes runs it
too (`readme_flags`: small preset, 6000-piece vocabulary, 4096 token slots, eval every 500 steps on 200 sentences,
greedy) with only `--max-minutes`, `--run-dir` and the compilation cache changed, and read what happened from the run's
metrics.jsonl: target tokens trained (the "tokens" of every step), and the wall time by phase (its "summary" record:
setup, compile, steps, eval, checkpoint). Code without that record (--old-ref) is split from its records' timestamps and
`JAX_LOG_COMPILES` lines instead, marked "estimated"."""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / ".data" / "multi30k"  # git-ignored
FILES = ("train.de", "train.en", "val.de", "val.en")
# The commit before packed batches and the compilation cache: "today's" code for the end-to-end comparison.
OLD_REF = "48ac2a0"
# JAX_LOG_COMPILES lines: tracing, lowering and XLA compilation of one function, each with its seconds.
COMPILE_LINE = re.compile(r"Finished (?:tracing|jaxpr to MLIR module conversion|XLA compilation) .* in ([0-9.e-]+) sec")


def readme_flags(data: Path, run_dir: Path, minutes: float) -> list[str]:
    """The `multi30k` recipe as explicit flags (the code at OLD_REF has no --recipe), for `minutes` of wall time."""
    return [
        "train",
        "--preset",
        "small",
        "--src",
        str(data / "train.de"),
        "--tgt",
        str(data / "train.en"),
        "--valid-src",
        str(data / "val.de"),
        "--valid-tgt",
        str(data / "val.en"),
        "--vocab-size",
        "6000",
        "--max-tokens",
        "4096",
        "--warmup",
        "300",
        "--lr-scale",
        "0.5",
        "--clip-norm",
        "1.0",
        "--steps",
        "100000",
        "--max-minutes",
        str(minutes),
        "--eval-every",
        "500",
        "--save-every",
        "250",
        "--eval-sentences",
        "200",
        "--eval-beam-size",
        "1",
        "--beam-size",
        "4",
        "--run-dir",
        str(run_dir),
        "--no-progress",
    ]


def prepare_data(source: Path) -> None:
    missing = [name for name in FILES if not (source / name).is_file()]
    if missing:
        sys.exit(f"error: {source} lacks {', '.join(missing)}")
    DATA.mkdir(parents=True, exist_ok=True)
    for name in FILES:
        shutil.copyfile(source / name, DATA / name)
    print(f"copied {', '.join(FILES)} from {source} to {DATA}")


def check_data(data: Path) -> None:
    missing = [name for name in FILES if not (data / name).is_file()]
    if missing:
        sys.exit(f"error: {data} lacks {', '.join(missing)}; run `python benchmarks/multi30k.py prepare-data DIR`")


# =============================================================================================================
# Running train.py and reading its run
# =============================================================================================================


class TrainProcess:
    """train.py in a child process; every output line kept with its seconds since launch (and printed with them,
    compilation logs aside, with `echo`)."""

    def __init__(
        self, argv: list[str], *, code: Path = REPO, env: dict[str, str] | None = None, echo: bool = False
    ) -> None:
        self.echo = echo
        env = {**os.environ, **(env or {}), "PYTHONPATH": str(code), "JAX_LOG_COMPILES": "1"}
        env.pop("JAX_COMPILATION_CACHE_DIR", None)  # each variant's cache is its --compilation-cache (or none)
        self.lines: list[tuple[float, str]] = []
        self.launch = time.monotonic()
        self.process = subprocess.Popen(
            [sys.executable, str(code / "train.py"), *argv],
            cwd=code,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.wall: float | None = None

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append((time.monotonic() - self.launch, line.rstrip("\n")))
            if self.echo and not COMPILE_LINE.search(line):
                print(f"  {self.lines[-1][0]:6.1f} s | {self.lines[-1][1]}", flush=True)

    def wait(self, timeout: float | None = None) -> int:
        code = self.process.wait(timeout)
        self._reader.join(10)
        self.wall = time.monotonic() - self.launch
        return code

    def stop(self) -> None:
        """SIGTERM: the run saves a checkpoint and exits."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def output(self) -> str:
        return "\n".join(line for _, line in self.lines if not COMPILE_LINE.search(line))[-6000:]


def read_records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            break
    return records


def compile_seconds(lines: list[tuple[float, str]]) -> float:
    """Seconds of tracing, lowering and compiling that JAX_LOG_COMPILES reported (all threads)."""
    return sum(float(match.group(1)) for _, line in lines if (match := COMPILE_LINE.search(line)))


def estimated_phases(records: list[dict], lines: list[tuple[float, str]], wall: float) -> dict[str, float]:
    """The wall time by phase of a run whose metrics have no "summary" record (the code before packed batches), from the
    times of its records (seconds since train.py started) and of its JAX_LOG_COMPILES lines (seconds since launch;
    that code compiled in the loop's own thread, so every compile second was waited for): setup until the first step
    began, eval from each evaluation's record back to its step's record, checkpoint the gaps after saving steps
    beyond the median step and the tail after the last record; compilation inside those windows is booked apart;
    steps are the rest."""
    train = [r for r in records if r["kind"] == "train"]
    if not train:
        return {}
    times = [r["elapsed_s"] for r in train]
    gaps = sorted(b - a for a, b in zip(times, times[1:])) or [0.0]
    step = gaps[len(gaps) // 2]  # the median step
    compiles = [(t, float(m.group(1))) for t, line in lines if (m := COMPILE_LINE.search(line))]  # (end, seconds)

    def compiled_in(start: float, end: float) -> float:
        return sum(seconds for t, seconds in compiles if start < t <= end)

    setup_end = max(0.0, train[0]["elapsed_s"] - step)
    step_time = {r["step"]: r["elapsed_s"] for r in train}
    windows = [(step_time.get(r["step"], r["elapsed_s"]), r["elapsed_s"]) for r in records if r["kind"] == "eval"]
    eval_s = sum(end - start - compiled_in(start, end) for start, end in windows)
    save_every = 250  # readme_flags
    checkpoint_s = sum(
        max(0.0, b["elapsed_s"] - a["elapsed_s"] - step)
        for a, b in zip(train, train[1:])
        if a["step"] % save_every == 0
    )
    last = max(r["elapsed_s"] for r in records if "elapsed_s" in r)
    checkpoint_s += max(0.0, wall - last)  # the final save and the loss curve
    setup_s = setup_end - compiled_in(0.0, setup_end)
    compile_s = sum(seconds for _, seconds in compiles)
    return {
        "setup_s": setup_s,
        "compile_s": compile_s,
        "steps_s": max(0.0, wall - setup_s - compile_s - eval_s - checkpoint_s),
        "eval_s": eval_s,
        "checkpoint_s": checkpoint_s,
        "estimated": True,
    }


def summarize_run(name: str, process: TrainProcess, run_dir: Path) -> dict:
    records = read_records(run_dir)
    tokens = sum(r.get("tokens", 0.0) for r in records if r["kind"] == "train" and "error" not in r)
    summary = next((r for r in records if r["kind"] == "summary"), None)
    wall = process.wall or (time.monotonic() - process.launch)
    if summary is not None:
        phases = {k: summary[k] for k in ("setup_s", "compile_s", "steps_s", "eval_s", "checkpoint_s")}
        # Launch to exit: the interpreter's start and the run's summary/plot after the last record.
        phases["other_s"] = max(0.0, wall - summary["elapsed_s"])
    else:
        phases = estimated_phases(records, process.lines, wall)
    evals = [r for r in records if r["kind"] == "eval"]
    steps = [r["step"] for r in records if r["kind"] == "train"]
    return {
        "name": name,
        "wall_s": round(wall, 1),
        "steps": max(steps, default=0),
        "target_tokens": int(tokens),
        "target_tokens_per_s": round(tokens / wall, 1) if wall else 0.0,
        "phases_s": {k: (round(v, 1) if isinstance(v, float) else v) for k, v in phases.items()},
        "compile_work_s": round(compile_seconds(process.lines), 1),
        "evaluations": [
            {k: e.get(k) for k in ("step", "final", "bleu", "valid_loss", "elapsed_s", "beam_size", "sentences")}
            for e in evals
        ],
        "exit_code": process.process.returncode,
    }


# =============================================================================================================
# end-to-end (CPU)
# =============================================================================================================


def old_code(ref: str, into: Path) -> Path:
    """The repository's files at git `ref`, unpacked into `into` (git archive: the repository is not touched)."""
    archive = subprocess.run(["git", "archive", ref], cwd=REPO, capture_output=True, check=True).stdout
    into.mkdir(parents=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def end_to_end(args) -> dict:
    check_data(args.data)
    work = Path(tempfile.mkdtemp(prefix="m30k-e2e-"))
    variants = args.variants.split(",")
    results = []
    try:
        for name in variants:
            run_dir, code, extra = work / name, REPO, []
            if name == "packed":
                extra = ["--compilation-cache", str(work / "xla-cache")]  # cold: a fresh folder
            elif name == "packed-warm":
                extra = ["--compilation-cache", str(work / "xla-cache")]  # after "packed": warm
            elif name == "buckets":
                extra = ["--batching", "buckets", "--compilation-cache", str(work / "xla-cache-buckets")]
            elif name == "old":
                code = old_code(args.old_ref, work / "old-code")
            else:
                sys.exit(f"error: unknown variant {name!r}")
            print(f"[{name}] {args.minutes} minutes of the multi30k recipe's run ...", flush=True)
            process = TrainProcess(readme_flags(args.data, run_dir, args.minutes) + extra, code=code)
            code_ = process.wait(timeout=60 * args.minutes + 1800)
            if code_ != 0:
                print(process.output(), file=sys.stderr)
                sys.exit(f"error: the {name} run exited with {code_}")
            results.append(summarize_run(name, process, run_dir))
            print(format_result(results[-1]), flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    base = next((r for r in results if r["name"] == "old"), None)
    for r in results:
        if base and base["target_tokens_per_s"]:
            r["vs_old"] = round(r["target_tokens_per_s"] / base["target_tokens_per_s"], 3)
    return {"benchmark": "multi30k end-to-end", "minutes": args.minutes, "old_ref": args.old_ref, "runs": results}


def format_result(r: dict) -> str:
    phases = r["phases_s"]
    wall = r["wall_s"] or 1.0
    shares = ", ".join(f"{k[:-2]} {v:.0f} s ({100 * v / wall:.0f}%)" for k, v in phases.items() if k != "estimated")
    estimated = " (estimated)" if phases.get("estimated") else ""
    bleu = [f"{e['step']}:{e['bleu']:.1f}" for e in r["evaluations"] if e.get("bleu") is not None]
    return (
        f"  {r['name']}: {r['target_tokens']:,} target tokens in {r['wall_s']:.0f} s = "
        f"{r['target_tokens_per_s']:,.0f} tokens/s over the whole run, {r['steps']} steps; wall time{estimated}: "
        f"{shares}; compile work {r['compile_work_s']:.0f} s; BLEU by step {' '.join(bleu)}"
    )


# =============================================================================================================
# time-to-bleu (GPU)
# =============================================================================================================


def time_to_bleu(args) -> dict:
    check_data(args.data)
    work = Path(tempfile.mkdtemp(prefix="m30k-bleu-"))
    cache = work / "xla-cache"  # cold for the first run, warm for the second
    results = []
    try:
        for name in ("cold", "warm"):
            run_dir = work / name
            argv = readme_flags(args.data, run_dir, args.minutes) + ["--compilation-cache", str(cache)]
            print(f"[{name} compilation cache] until validation BLEU >= {args.target} (at most {args.minutes} min)")
            process = TrainProcess(argv, echo=True)  # a run cut short by the caller still shows how far it got
            reached = None
            deadline = time.monotonic() + 60 * args.minutes + 600
            while process.process.poll() is None and time.monotonic() < deadline:
                hit = next(
                    (
                        r
                        for r in read_records(run_dir)
                        # the evaluations during training: greedy, 200 sentences (not the final beam-4 one)
                        if r["kind"] == "eval" and not r.get("final") and r.get("bleu", 0) >= args.target
                    ),
                    None,
                )
                if hit is not None:
                    reached = (time.monotonic() - process.launch, hit)
                    process.stop()
                    break
                time.sleep(0.5)
            process.wait(timeout=600)
            result = summarize_run(name, process, run_dir)
            compile_record = next((r for r in read_records(run_dir) if r["kind"] == "compile"), {})
            result.update(
                reached_bleu=reached is not None,
                seconds_to_bleu=round(reached[0], 1) if reached else None,
                bleu=reached[1]["bleu"] if reached else None,
                step_at_bleu=reached[1]["step"] if reached else None,
                compile_record={
                    k: compile_record.get(k) for k in ("seconds", "waited_s", "cache_hits", "cache_misses")
                },
            )
            results.append(result)
            if reached:
                at = f"step {result['step_at_bleu']}, {result['seconds_to_bleu']} s after launch"
                print(f"  BLEU {result['bleu']:.1f} at {at}")
            else:
                print(f"  BLEU {args.target} not reached in {args.minutes} minutes")
            print(format_result(result), flush=True)
            if args.json:  # after each run: a lease that ends during the second keeps the first
                report = {"benchmark": "multi30k time to BLEU", "target": args.target, "runs": results}
                args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return {"benchmark": "multi30k time to BLEU", "target": args.target, "runs": results}


def plot_runs(runs: list[dict], path: Path, title: str) -> None:
    """One horizontal bar per run: its wall time split by phase, labelled with target tokens/s (and, when the run
    has one, the seconds to the BLEU target)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = ("setup_s", "compile_s", "steps_s", "eval_s", "checkpoint_s", "other_s")
    fig, ax = plt.subplots(figsize=(10, 1.8 + 0.7 * len(runs)))
    for y, run in enumerate(runs):
        left = 0.0
        for k, phase in enumerate(phases):
            width = float(run["phases_s"].get(phase, 0.0))
            ax.barh(y, width, left=left, color=f"C{k}", label=phase[:-2] if y == 0 else None)
            left += width
        label = f"{run['target_tokens_per_s']:,.0f} target tokens/s"
        if run.get("seconds_to_bleu") is not None:
            label += f"; BLEU {run['bleu']:.1f} at {run['seconds_to_bleu']:.0f} s"
        ax.text(left, y, "  " + label, va="center", fontsize=9)
    ax.set_yticks(range(len(runs)), [run["name"] for run in runs])
    ax.set_xlabel("wall time from launch (s)")
    ax.set_xlim(0, 1.35 * max(run["wall_s"] for run in runs))
    ax.set_title(title)
    fig.legend(ncol=6, fontsize=8, loc="lower center")
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(path, dpi=90)


# =============================================================================================================
# padding (no training): the figures of docs/training.md's "Batching and compilation" table, and its picture
# =============================================================================================================


def padding(args) -> dict:
    """Tokenizes the corpus as the recipe's command does and counts, for length buckets and packed rows, the batch
    shapes, batches per epoch, the share of source and target slots holding a real token, and the real target
    tokens per batch; with --plot, draws one batch of each (docs/packing.png)."""
    check_data(args.data)
    sys.path.insert(0, str(REPO))
    from jax_transformer.data.batching import BatchStream, encode_corpus, eval_batches
    from jax_transformer.data.corpus import read_parallel
    from jax_transformer.data.tokenizer import PAD_ID, Tokenizer

    corpus = read_parallel(args.data / "train.de", args.data / "train.en")
    tokenizer = Tokenizer.train(corpus.sources + corpus.targets, 6000)
    encoded = encode_corpus(corpus, tokenizer, 128)
    valid = encode_corpus(read_parallel(args.data / "val.de", args.data / "val.en"), tokenizer, 128)
    result, examples = {}, {}
    for batching in ("buckets", "packed"):
        stream = BatchStream(encoded, 4096, batching=batching, seed=0)
        batches = [next(stream) for _ in range(stream.batches_per_epoch)]  # the first epoch
        slots = sum(b["src"].size for b in batches)
        target = sum(int((b["tgt_out"] != PAD_ID).sum()) for b in batches)
        evaluation = eval_batches(valid, 4096, batching=batching)
        result[batching] = {
            "shapes": [list(shape) for shape in stream.shapes],
            "batches_per_epoch": len(batches),
            "source_real": round(sum(int((b["src"] != PAD_ID).sum()) for b in batches) / slots, 4),
            "target_real": round(target / slots, 4),
            "target_tokens_per_batch": round(target / len(batches)),
            "validation_batches": len(evaluation),
            "validation_shapes": sorted({b["src"].shape for b, _ in evaluation}),
        }
        common = collections.Counter(b["src"].shape for b in batches).most_common(1)[0][0]
        examples[batching] = next(b for b in batches if b["src"].shape == common)  # a batch of the usual shape
        r = result[batching]
        print(
            f"{batching}: {len(r['shapes'])} shape(s) {r['shapes'][:3]}{'...' if len(r['shapes']) > 3 else ''}, "
            f"{r['batches_per_epoch']} batches per epoch, {100 * r['source_real']:.1f}% of source and "
            f"{100 * r['target_real']:.1f}% of target slots real, {r['target_tokens_per_batch']:,} target tokens per "
            f"batch; validation: {r['validation_batches']} batches in {len(r['validation_shapes'])} shape(s)"
        )
    if args.plot:
        plot_padding(examples, result, args.plot)
        print(f"wrote {args.plot}")
    return {"benchmark": "multi30k padding", **result}


def plot_padding(examples: dict, result: dict, path: Path) -> None:
    """Two batches of 4,096 target slots side by side: one of the most common length bucket (one pair per row) and a
    packed one (several pairs per row), one colour per pair, padding white."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, 2, figsize=(11, 5.2))
    for ax, (batching, batch) in zip(axes, examples.items()):
        real = batch["tgt_out"] != 0
        # One colour per pair (a packed row's segments, a bucket row's one pair), neighbours far apart; padding white.
        pair = batch["tgt_segments"] if batching == "packed" else np.arange(real.shape[0])[:, None] + 0 * real
        colours = np.where(real, 0.1 + 0.8 * ((pair * 0.38) % 1.0), np.nan)
        cmap = plt.get_cmap("viridis").copy()
        cmap.set_bad("white")
        ax.imshow(colours, aspect="auto", cmap=cmap, interpolation="nearest", vmin=0, vmax=1)
        rows, length = batch["tgt_out"].shape
        r = result[batching]
        ax.set_title(
            f"{batching}: {rows} rows x {length} target positions\n{100 * real.mean():.0f}% real in this batch, "
            f"{100 * r['target_real']:.0f}% over the epoch; {r['batches_per_epoch']} batches, "
            f"{len(r['shapes'])} shape(s)",
            fontsize=10,
        )
        ax.set_xlabel("position in the row")
        ax.set_ylabel("row")
    fig.suptitle("Multi30k de->en, 4,096 token slots per batch: the target side of one batch (white = padding)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare-data", help=f"copy {', '.join(FILES)} from a folder into {DATA}")
    p.add_argument("source", type=Path)
    pad = sub.add_parser("padding", help="batch shapes and the share of real tokens, buckets against packed rows")
    pad.add_argument("--data", type=Path, default=DATA, help=f"folder with {', '.join(FILES)} (default {DATA})")
    pad.add_argument("--json", type=Path, help="also write the figures as JSON")
    pad.add_argument("--plot", type=Path, help="draw one batch of each kind into this PNG (docs/packing.png)")
    for name, helptext in (
        ("end-to-end", "target tokens/s over whole runs, old and new batching (CPU)"),
        ("time-to-bleu", "seconds from launch to validation BLEU 40, cold and warm compilation cache (GPU)"),
    ):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("--data", type=Path, default=DATA, help=f"folder with {', '.join(FILES)} (default {DATA})")
        p.add_argument("--json", type=Path, help="also write the results as JSON")
        p.add_argument("--keep", action="store_true", help="keep the run directories (printed temp folder)")
        p.add_argument("--plot", type=Path, help="draw each run's wall time by phase into this PNG")
    e = sub.choices["end-to-end"]
    e.add_argument("--minutes", type=float, default=10.0, help="--max-minutes of each run (default 10)")
    e.add_argument(
        "--variants",
        default="old,packed",
        help="comma-separated runs, in this order: old (the code at --old-ref), packed (this checkout, cold "
        "compilation cache), packed-warm (again, warm cache), buckets (this checkout, --batching buckets) "
        "(default old,packed)",
    )
    e.add_argument("--old-ref", default=OLD_REF, help=f"git ref of the code to compare with (default {OLD_REF})")
    t = sub.choices["time-to-bleu"]
    t.add_argument("--minutes", type=float, default=4.0, help="--max-minutes of each run (default 4)")
    t.add_argument("--target", type=float, default=40.0, help="validation BLEU to reach (default 40)")
    args = parser.parse_args(argv)
    if args.command == "prepare-data":
        prepare_data(args.source)
        return 0
    commands = {"padding": padding, "end-to-end": end_to_end, "time-to-bleu": time_to_bleu}
    result = commands[args.command](args)
    if args.command != "padding" and args.plot:
        plot_runs(result["runs"], args.plot, f"the multi30k recipe's command: {result['benchmark']}")
        print(f"wrote {args.plot}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
