#!/usr/bin/env python3
"""A model trained here on one domain, fine-tuned to another for the same minutes in full and with LoRA: BLEU on the
new domain's validation set before and after, the parameters each trained, the steps each took. docs/training.md.

    python train.py train --recipe multi30k-cpu --src multi30k/train.de --tgt multi30k/train.en \\
        --valid-src multi30k/val.de --valid-tgt multi30k/val.en --max-minutes 22 --run-dir runs/m30k
    python benchmarks/domain_finetuning.py --base runs/m30k --data ../shared/data/anki-deu-eng --minutes 8

Each fine-tuning is `train --init-from BASE` on DATA/train.{de,en} with DATA/valid.{de,en} evaluated at its end
(beam 4, every sentence), the Noam schedule with a short warm-up at a peak learning rate typical of each mode
(full: 5e-4; LoRA: 2e-3, rank 16, alpha 32, every matrix). The runs go one after the other: the machine to each.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.machine import machine_info  # noqa: E402

WARMUP = 100
# --lr-scale for each mode's peak learning rate: Noam's peak is scale * d_model^-0.5 * warmup^-0.5.
MODES = {
    "full": (5e-4, []),
    "LoRA r16": (2e-3, ["--lora-rank", "16", "--lora-alpha", "32", "--lora-targets", "q,k,v,out,ffn"]),
}


def run(args: list[str], log: Path) -> float:
    began = time.time()
    with open(log, "w") as f:
        code = subprocess.run(
            [sys.executable, str(REPO / "train.py"), *args], stdout=f, stderr=subprocess.STDOUT
        ).returncode
    if code:
        raise SystemExit(f"train.py {args[0]} failed ({code}); see {log}")
    return time.time() - began


def final_bleu(run_dir: Path) -> dict:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    final = [r for r in records if r.get("kind") == "eval" and r.get("final")][-1]
    steps = max(r["step"] for r in records if r.get("kind") == "train")
    return {"bleu": final["bleu"], "chrf": final["chrf"], "steps": steps}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=Path, required=True, help="the run directory to start from")
    parser.add_argument("--data", type=Path, required=True, help="a folder with train.de/en and valid.de/en")
    parser.add_argument("--minutes", type=float, default=8.0, help="training minutes of each fine-tuning")
    parser.add_argument("--work", type=Path, default=Path("runs/domain"), help="where the runs go")
    args = parser.parse_args(argv)
    info = machine_info()
    print(f"machine: {info['cpu_model']}, {info['cores']} cores; {info['libraries']}", flush=True)
    args.work.mkdir(parents=True, exist_ok=True)
    d = args.data
    valid = ["--src", str(d / "valid.de"), "--tgt", str(d / "valid.en")]
    out = args.work / "before.json"
    run(["evaluate", "--checkpoint", str(args.base), *valid, "--beam-size", "4"], args.work / "before.log")
    lines = (args.work / "before.log").read_text().splitlines()
    before = json.loads(next(line for line in reversed(lines) if line.startswith("{")))
    out.write_text(json.dumps(before) + "\n")
    print(f"before: BLEU {before['bleu']:.2f}, chrF {before['chrf']:.2f}", flush=True)
    rows = []
    d_model = json.loads((args.base / "config.json").read_text())["d_model"]
    for mode, (peak, flags) in MODES.items():
        scale = peak / (d_model**-0.5 * WARMUP**-0.5)
        run_dir = args.work / mode.split()[0].lower()
        train = ["train", "--init-from", str(args.base), "--run-dir", str(run_dir), "--no-progress"]
        train += ["--src", str(d / "train.de"), "--tgt", str(d / "train.en")]
        train += ["--valid-src", str(d / "valid.de"), "--valid-tgt", str(d / "valid.en"), "--eval-every", "1000000"]
        train += ["--max-minutes", str(args.minutes), "--steps", "1000000", "--save-every", "1000000"]
        train += ["--warmup-steps", str(WARMUP), "--lr-scale", f"{scale:.6g}", *flags]
        seconds = run(train, args.work / f"{run_dir.name}.log")
        log = (args.work / f"{run_dir.name}.log").read_text()
        trained = next((line for line in log.splitlines() if "fine-tuning:" in line or "training all" in line), "")
        rows.append({"mode": mode, "seconds": round(seconds), "trained": trained.strip(), **final_bleu(run_dir)})
        print(json.dumps(rows[-1]), flush=True)
    print(f"\n| | BLEU | chrF | steps in {args.minutes:g} min | trained |\n|---|---:|---:|---:|---|")
    print(f"| before | {before['bleu']:.2f} | {before['chrf']:.2f} | - | - |")
    for r in rows:
        print(f"| {r['mode']} | {r['bleu']:.2f} | {r['chrf']:.2f} | {r['steps']:,} | {r['trained']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
