"""Pictures: a run's training curves (`plot_metrics`), quality against wall-clock time for several runs
(`plot_runs`) and attention heatmaps of one sentence, one row per layer and one column per head
(`plot_attention`). docs/internals.md#visualize."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display needed
import jax.numpy as jnp  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from jax_transformer.compilation import jit_by_config  # noqa: E402
from jax_transformer.config import TransformerConfig  # noqa: E402
from jax_transformer.decoding import greedy_search  # noqa: E402
from jax_transformer.files import replaced  # noqa: E402
from jax_transformer.model import Transformer, attention_maps  # noqa: E402
from jax_transformer.translation import encode_sources  # noqa: E402

KINDS = {
    "cross": "decoder/layer_{}/cross_attention",
    "self": "decoder/layer_{}/self_attention",
    "encoder": "encoder/layer_{}/self_attention",
}


def token_labels(tokenizer, ids: Sequence[int], config: TransformerConfig) -> list[str]:
    """A readable label per id: <s>, </s>, <pad> for the specials, otherwise the subword's text."""
    specials = {config.start_id: "<s>", config.eos_id: "</s>", config.pad_id: "<pad>"}
    return [specials.get(int(i)) or tokenizer.decode([int(i)]) or f"#{int(i)}" for i in ids]


@functools.partial(jit_by_config, static_argnames=("config",))
def _attention_pass(params, src, tgt_in, *, config: TransformerConfig):
    _, state = Transformer(config).apply({"params": params}, src, tgt_in, mutable=["intermediates"])
    return attention_maps(state["intermediates"])


def collect_attention(params, config: TransformerConfig, src: np.ndarray, tgt_in: np.ndarray) -> dict[str, np.ndarray]:
    """One teacher-forced forward pass -> {"decoder/layer_0/cross_attention": (B, H, T, S), ...}."""
    maps = _attention_pass(params, jnp.asarray(src, jnp.int32), jnp.asarray(tgt_in, jnp.int32), config=config)
    return {name: np.asarray(value) for name, value in maps.items()}


def attention_figure(
    maps: dict[str, np.ndarray],
    config: TransformerConfig,
    kinds: Sequence[str],
    labels: dict[str, list[str]],
    title: str = "",
) -> plt.Figure:
    """The heatmap grid for one sentence (row 0 of each map). `labels` has "source", "decoder_in" and
    "produced" token labels. One grid row per (kind, layer), one column per head."""
    for kind in kinds:
        if kind not in KINDS:
            raise ValueError(f"unknown attention kind {kind!r}; choose from {sorted(KINDS)}")
    axes_labels = {
        "cross": (labels["source"], labels["produced"]),
        "self": (labels["decoder_in"], labels["produced"]),
        "encoder": (labels["source"], labels["source"]),
    }
    rows = [
        (kind, layer)
        for kind in kinds
        for layer in range(config.num_encoder_layers if kind == "encoder" else config.num_decoder_layers)
    ]
    if not rows:
        raise ValueError(f"the model has no layers of kinds {list(kinds)}")
    H = config.num_heads
    n_x = max(len(axes_labels[k][0]) for k in kinds)
    n_y = max(len(axes_labels[k][1]) for k in kinds)
    cell_w, cell_h = max(2.2, 0.28 * n_x + 0.9), max(2.0, 0.28 * n_y + 0.9)  # inches; room for the labels
    # "constrained" layout makes room for the tick labels when the figure is drawn (saved), not before.
    fig, axes = plt.subplots(
        len(rows), H, figsize=(cell_w * H, cell_h * len(rows)), squeeze=False, layout="constrained"
    )
    for r, (kind, layer) in enumerate(rows):
        x_labels, y_labels = axes_labels[kind]
        probs = maps[KINDS[kind].format(layer)][0]  # (H, T_query, T_key)
        for h in range(H):
            ax = axes[r, h]
            ax.imshow(probs[h], cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto", interpolation="nearest")
            ax.set_xticks(range(len(x_labels)), x_labels, rotation=90, fontsize=7)
            ax.set_yticks(range(len(y_labels)), y_labels if h == 0 else [""] * len(y_labels), fontsize=7)
            ax.set_title(f"{kind} layer {layer} head {h}", fontsize=8)
    if title:
        fig.suptitle(title, fontsize=9)
    return fig


@dataclasses.dataclass
class SentenceAttention:
    """One sentence's greedy translation and every attention map of the pass that produced it."""

    translation: str
    maps: dict[str, np.ndarray]  # {"decoder/layer_0/cross_attention": (1, H, T_query, T_key), ...}
    labels: dict[str, list[str]]  # token labels: "source", "decoder_in", "produced"


def sentence_attention(
    params, config: TransformerConfig, tokenizer, sentence: str, *, max_len_a: float = 1.5, max_len_b: float = 10
) -> SentenceAttention:
    """Translates `sentence` greedily, then re-runs the model over (source, produced target) to collect the maps."""
    src = encode_sources(tokenizer, [sentence], config)[0][None]  # (1, S): tokens + EOS
    tokens, _ = greedy_search(params, config, src, max_len_a=max_len_a, max_len_b=max_len_b)
    produced = [int(t) for t in tokens[0] if t != config.pad_id]  # y1 .. ym, EOS included if emitted
    decoder_in = np.array([[config.start_id] + produced[:-1]], dtype=np.int32)  # (1, m): row i predicts yi
    labels = {
        "source": token_labels(tokenizer, src[0], config),
        "decoder_in": token_labels(tokenizer, decoder_in[0], config),
        "produced": token_labels(tokenizer, produced, config),
    }
    return SentenceAttention(tokenizer.decode(produced), collect_attention(params, config, src, decoder_in), labels)


def plot_attention(
    params,
    config: TransformerConfig,
    tokenizer,
    sentence: str,
    path: str | os.PathLike,
    *,
    kinds: Sequence[str] = ("cross",),
    max_len_a: float = 1.5,
    max_len_b: float = 10,
    dpi: int = 120,
) -> Path:
    """Translates `sentence` greedily and writes a PNG of the attention maps of `kinds` ("cross", "self",
    "encoder"; see the module docstring) to `path`. Returns the path."""
    result = sentence_attention(params, config, tokenizer, sentence, max_len_a=max_len_a, max_len_b=max_len_b)
    fig = attention_figure(result.maps, config, kinds, result.labels, f"{sentence}  ->  {result.translation}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_figure(fig, path, dpi)
    return path


# --- training curves ----------------------------------------------------------------------------------------


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


def save_figure(fig, path: str | os.PathLike, dpi: int) -> None:
    """`fig` as an image file of the type its suffix names (PNG without one), whole or not at all; then closed."""
    try:
        with replaced(path) as temporary:
            fig.savefig(temporary, dpi=dpi, format=Path(path).suffix[1:].lower() or "png")
    finally:
        plt.close(fig)
