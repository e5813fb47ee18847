"""Attention heatmaps of one sentence, one row per layer and one column per head (`plot_attention`), and the maps
behind them (`sentence_attention`). docs/internals.md#visualize."""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display needed
import jax.numpy as jnp  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from jax_transformer.compilation import jit_by_config  # noqa: E402
from jax_transformer.decoding.decoders import DEFAULT_MAX_LEN_A, DEFAULT_MAX_LEN_B, greedy_search  # noqa: E402
from jax_transformer.decoding.translation import encode_sources  # noqa: E402
from jax_transformer.files import save_figure  # noqa: E402
from jax_transformer.model.transformer import Transformer, attention_maps  # noqa: E402
from jax_transformer.settings.config import TransformerConfig  # noqa: E402

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
    params,
    config: TransformerConfig,
    tokenizer,
    sentence: str,
    *,
    max_len_a: float = DEFAULT_MAX_LEN_A,
    max_len_b: float = DEFAULT_MAX_LEN_B,
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
    max_len_a: float = DEFAULT_MAX_LEN_A,
    max_len_b: float = DEFAULT_MAX_LEN_B,
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
