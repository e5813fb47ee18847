#!/usr/bin/env python3
"""Several training recipes on one corpus at once: validation BLEU against steps, to choose a recipe.

    python benchmarks/recipe_sweep.py --data .data/multi30k --minutes 8 --out sweep benchmarks/recipes/*.json

Each recipe (a JSON file of the form of `jax_transformer/settings/configs/recipes/`, read by `train.py train --recipe
FILE`) trains in its own `train.py` process, all at the same time (`--parallel-runs`; on a GPU small models leave most
of the device idle, so several fit beside each other: each process gets an equal share of the GPU memory), for
`--minutes` of wall time. The runs share the machine, so their wall times say little; what a sweep measures is quality
against *steps*: `sweep.json` holds every evaluation (step, BLEU, loss) of every recipe, `sweep.png` draws BLEU against
steps, and the table printed at the end gives each recipe's BLEU at the steps of `--at-steps` (e.g. the steps another
machine makes in 30 and 60 minutes, which `train.py`'s step times there give) and its best.

Why by hand: a sweep of training commands with per-process GPU memory shares is a dozen lines over subprocess;
the experiment managers that do it (hydra, wandb sweeps) are not dependencies of this project.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def run_recipes(recipes: list[Path], data: Path, out: Path, minutes: float, parallel: int, extra: list[str]) -> dict:
    """Trains every recipe (at most `parallel` at once) for `minutes`; returns {name: its records}."""
    out.mkdir(parents=True, exist_ok=True)
    waiting, running, done = list(recipes), {}, {}
    share = 0.9 / max(1, min(parallel, len(recipes)))
    while waiting or running:
        while waiting and len(running) < parallel:
            recipe = waiting.pop(0)
            name = recipe.stem
            argv = [
                sys.executable,
                str(REPO / "train.py"),
                "train",
                "--recipe",
                str(recipe),
                "--src",
                str(data / "train.de"),
                "--tgt",
                str(data / "train.en"),
                "--valid-src",
                str(data / "val.de"),
                "--valid-tgt",
                str(data / "val.en"),
                "--max-minutes",
                str(minutes),
                "--run-dir",
                str(out / name),
                "--no-progress",
                *extra,
            ]
            env = dict(os.environ, XLA_PYTHON_CLIENT_MEM_FRACTION=f"{share:.2f}", PYTHONUNBUFFERED="1")
            log = open(out / f"{name}.log", "wb")
            running[name] = (subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO), log)
            print(f"started {name}", flush=True)
        for name, (process, log) in list(running.items()):
            if process.poll() is not None:
                log.close()
                done[name] = process.returncode
                del running[name]
                print(f"{name} ended with exit code {process.returncode}", flush=True)
        time.sleep(2)
    results = {}
    for recipe in recipes:
        metrics = out / recipe.stem / "metrics.jsonl"
        records = (
            [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.exists() else []
        )
        results[recipe.stem] = {
            "recipe": json.loads(recipe.read_text()),
            "exit_code": done.get(recipe.stem),
            "evals": [
                {
                    k: r.get(k)
                    for k in ("step", "elapsed_s", "bleu", "chrf", "valid_loss", "final", "beam_size", "sentences")
                }
                for r in records
                if r.get("kind") == "eval"
            ],
            "last_step": max((r["step"] for r in records if r.get("kind") == "train"), default=0),
        }
    return results


def bleu_at(evals: list[dict], step: int) -> float | None:
    """The BLEU of the last evaluation during training at or before `step` (None if there is none)."""
    before = [e for e in evals if not e.get("final") and e.get("bleu") is not None and e["step"] <= step]
    return before[-1]["bleu"] if before else None


def table(results: dict, at_steps: list[int]) -> str:
    head = ["recipe", "last step"] + [f"BLEU @{s}" for s in at_steps] + ["best (step)", "final"]
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for name, r in results.items():
        during = [e for e in r["evals"] if not e.get("final") and e.get("bleu") is not None]
        best = max(during, key=lambda e: e["bleu"], default=None)
        final = next((e for e in r["evals"] if e.get("final") and e.get("bleu") is not None), None)
        cells = [name, str(r["last_step"])]
        cells += [f"{b:.2f}" if (b := bleu_at(r["evals"], s)) is not None else "-" for s in at_steps]
        cells.append(f"{best['bleu']:.2f} ({best['step']})" if best else "-")
        cells.append(f"{final['bleu']:.2f} (beam {final['beam_size']}, {final['sentences']})" if final else "-")
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    for name, r in results.items():
        during = [e for e in r["evals"] if not e.get("final") and e.get("bleu") is not None]
        if during:
            ax.plot([e["step"] for e in during], [e["bleu"] for e in during], "o-", markersize=3, label=name)
    ax.set(xlabel="step", ylabel="validation BLEU (greedy, evaluation sentences)", title="Recipes: BLEU against steps")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("recipes", nargs="+", type=Path, help="recipe JSON files (train.py --recipe)")
    p.add_argument("--data", type=Path, required=True, help="folder with train.de, train.en, val.de, val.en")
    p.add_argument("--out", type=Path, required=True, help="folder for the runs, sweep.json and sweep.png")
    p.add_argument("--minutes", type=float, default=8.0, help="wall-time budget of every run (default 8)")
    p.add_argument("--parallel-runs", type=int, default=8, help="runs at the same time (default 8)")
    p.add_argument("--at-steps", default="1000,2000,3000,4000", help="steps at which the table reads the BLEU")
    args, extra = p.parse_known_args(argv)  # anything else goes to every train.py
    for recipe in args.recipes:
        if not recipe.is_file():
            p.error(f"{recipe}: no such recipe file")
    results = run_recipes(args.recipes, args.data, args.out, args.minutes, args.parallel_runs, extra)
    (args.out / "sweep.json").write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    plot(results, args.out / "sweep.png")
    print(table(results, [int(s) for s in args.at_steps.split(",")]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
