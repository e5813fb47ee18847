"""Pictures of training: a run's curves (`plot_metrics`: loss and BLEU/chrF per evaluation) and quality against
wall-clock time for several runs (`plot_runs`). docs/internals.md#visualize."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display needed
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from jax_transformer.files import save_figure  # noqa: E402


def plot_metrics(metrics_path: str | os.PathLike, png_path: str | os.PathLike) -> Path | None:
    """Loss curve (training loss, smoothed, and validation loss) and BLEU/chrF per evaluation, as a PNG."""
    records = [json.loads(line) for line in Path(metrics_path).read_text(encoding="utf-8").splitlines() if line]
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    if not train:
        return None
    fig, (ax_loss, ax_bleu) = plt.subplots(1, 2, figsize=(11, 4))
    steps = np.array([r["step"] for r in train])
    loss = np.array([r["loss"] for r in train])
    ax_loss.plot(steps, loss, color="tab:blue", alpha=0.25, linewidth=0.8)
    window = max(1, len(loss) // 50)  # a moving average over ~2% of the run
    smooth = np.convolve(loss, np.ones(window) / window, mode="valid")
    ax_loss.plot(steps[window - 1 :], smooth, color="tab:blue", label="train (label-smoothed)")
    if evals:
        ax_loss.plot(
            [r["step"] for r in evals],
            [r["valid_loss"] for r in evals],
            "o-",
            color="tab:orange",
            label="validation (label-smoothed)",
        )
    ax_loss.set(xlabel="step", ylabel="loss per target token", title="Loss")
    ax_loss.legend()
    scored = [r for r in evals if "bleu" in r]
    if scored:
        ax_bleu.plot([r["step"] for r in scored], [r["bleu"] for r in scored], "o-", label="BLEU")
        ax_bleu.plot([r["step"] for r in scored], [r["chrf"] for r in scored], "s-", label="chrF")
        ax_bleu.legend()
    ax_bleu.set(xlabel="step", ylabel="score", title="Validation BLEU / chrF (sacrebleu)")
    fig.tight_layout()
    save_figure(fig, png_path, 100)
    return Path(png_path)


# --- quality against wall-clock time, several runs ---------------------------------------------------------------


@dataclasses.dataclass
class RunCurve:
    """The evaluations of one run against wall-clock minutes (see `run_curve`)."""

    label: str
    minutes: list[float]  # evaluations during training
    bleu: list[float | None]  # None where that evaluation had no BLEU
    loss: list[float]
    final: dict | None  # the final evaluation's record (beam_size, every sentence), with "minutes" added


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The records of a metrics.jsonl, in file order; a run directory may be given for its metrics.jsonl."""
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no metrics.jsonl here (give a run directory or its metrics.jsonl)")
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}, line {number}: not JSON ({e})") from None
    return records


def run_curve(path: str | os.PathLike, label: str | None = None) -> RunCurve:
    """The validation BLEU and loss of a run (directory or metrics.jsonl) against minutes of wall time.

    `elapsed_s` counts from the start of each `train.py` command, so a resumed run starts again from 0; the
    minutes here add the earlier commands' time (the last record before the clock went back), so that a run
    resumed twice is drawn as one run over the total time its commands took."""
    records = read_metrics(path)
    offset, previous = 0.0, 0.0
    minutes_of = []
    for record in records:
        elapsed = float(record.get("elapsed_s", previous))
        if elapsed < previous:  # a resumed command: its clock starts again
            offset += previous
        previous = elapsed
        minutes_of.append((offset + elapsed) / 60.0)
    curve = RunCurve(label or str(path), [], [], [], None)
    for record, minutes in zip(records, minutes_of):
        if record.get("kind") != "eval":
            continue
        if record.get("final"):
            curve.final = {**record, "minutes": minutes}
        else:
            curve.minutes.append(minutes)
            curve.bleu.append(record.get("bleu"))
            curve.loss.append(record["valid_loss"])
    return curve


def plot_runs(
    paths: Sequence[str | os.PathLike], png_path: str | os.PathLike, labels: Sequence[str] | None = None
) -> tuple[Path, list[RunCurve]]:
    """Validation BLEU (left) and validation loss (right) of several runs against wall-clock minutes, one colour
    per run: lines for the evaluations during training, a star for each run's final evaluation (its beam and
    every sentence, so it may sit above the line). Returns (the PNG's path, the curves drawn)."""
    if labels is not None and len(labels) != len(paths):
        raise ValueError(f"{len(labels)} labels for {len(paths)} runs")
    curves = [run_curve(p, None if labels is None else labels[i]) for i, p in enumerate(paths)]
    fig, (ax_bleu, ax_loss) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, curve in enumerate(curves):
        color = f"C{i}"
        scored = [(m, b) for m, b in zip(curve.minutes, curve.bleu) if b is not None]
        if scored:
            ax_bleu.plot(*zip(*scored), "o-", color=color, markersize=3, label=curve.label)
        ax_loss.plot(curve.minutes, curve.loss, "o-", color=color, markersize=3, label=curve.label)
        final = curve.final
        if final is not None and "bleu" in final:
            ax_bleu.plot(
                [final["minutes"]],
                [final["bleu"]],
                "*",
                color=color,
                markersize=12,
                label=f"{curve.label}: final, beam {final.get('beam_size')}, {final.get('sentences')} sentences "
                f"({final['bleu']:.2f})",
            )
    ax_bleu.set(xlabel="wall-clock minutes", ylabel="BLEU (sacreBLEU)", title="Validation BLEU")
    ax_loss.set(xlabel="wall-clock minutes", ylabel="loss per target token", title="Validation loss")
    for ax in (ax_bleu, ax_loss):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    png_path = Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    save_figure(fig, png_path, 100)
    return png_path, curves
