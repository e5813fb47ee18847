"""What a fine-tuning run trains: with LoRA adapters (`config.lora_rank` > 0, `model.lora`) the adapters alone, on
an int8 base QLoRA's (`quantized_base`); else every parameter that `OptimConfig.freeze`'s patterns leave.

The training step differentiates the trained parameters only, and the optimiser holds state for them only
(`split` / `joined`, in `trainer.train_step`): an optax mask (`optax.masked`, `multi_transform` with
`set_to_zero`) would also keep the optimiser's state small, but the gradient would still be taken of every
parameter. The adapters are written by hand (`model.lora`) rather than taken from qwix's LoRA, which adds them by
intercepting `dot_general` in a wrapped module: that would miss this model's own product paths (the int8 kernels,
the decoding step's vocabulary-major logits) and draw its dropout from flax's RNG, where this model's dropout is a
function of each row's place in the global batch (`jax_transformer.model.dropout`), the same however the batch is
split.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from jax_transformer.errors import ConfigError, UsageError
from jax_transformer.model.lora import ADAPTER_LEAVES
from jax_transformer.model.params import expected_param_shapes, flatten, unflatten
from jax_transformer.settings.config import TransformerConfig

# `--freeze` names beside globs: the top-level modules (or leaves) each stands for.
FREEZE_NAMES = {
    "embeddings": ("shared_embed", "source_embed", "target_embed", "*/positions"),
    "encoder": ("encoder",),
    "decoder": ("decoder",),
}


# =============================================================================================================
# Which parameters train
# =============================================================================================================


def _patterns(freeze: str | None) -> list[str]:
    return [p.strip() for p in (freeze or "").split(",") if p.strip()]


def _matches(path: tuple[str, ...], pattern: str) -> bool:
    """A `--freeze` entry against a parameter path: a name of FREEZE_NAMES, or a glob matching the "/"-joined path
    or one of its leading parts (so "decoder/layer_0" names everything under it)."""
    globs = FREEZE_NAMES.get(pattern, (pattern,))
    prefixes = ["/".join(path[:i]) for i in range(1, len(path) + 1)]
    return any(fnmatch.fnmatchcase(prefix, glob) for glob in globs for prefix in prefixes)


def is_trained(path: tuple[str, ...], config: TransformerConfig, freeze: str | None) -> bool:
    """Whether the optimiser updates the parameter at `path`: with adapters, the adapters alone; else every
    parameter that no `freeze` pattern names."""
    if config.lora_rank:
        return path[-1] in ADAPTER_LEAVES
    return not any(_matches(path, pattern) for pattern in _patterns(freeze))


def check(config: TransformerConfig, freeze: str | None) -> dict[str, int]:
    """The run's choice of trained parameters, checked before anything is computed (ConfigError naming the flag):
    a `--freeze` pattern that names no parameter, --freeze with adapters (which freeze every other parameter
    already), or nothing left to train. Returns {"trained": n, "total": n} parameter counts."""
    shapes = expected_param_shapes(config)
    patterns = _patterns(freeze)
    if patterns and config.lora_rank:
        raise ConfigError("--freeze with --lora-rank: LoRA adapters are all a run trains, every other array is frozen")
    for pattern in patterns:
        if not any(_matches(path, pattern) for path in shapes):
            some = ", ".join("/".join(p) for p in list(shapes)[:4])
            raise ConfigError(
                f"--freeze {pattern!r} names no parameter: give {', '.join(FREEZE_NAMES)} or a glob over paths such "
                f"as {some}"
            )
    trained = sum(int(np.prod(s)) for p, s in shapes.items() if is_trained(p, config, freeze))
    if not trained:
        raise ConfigError(f"--freeze {freeze!r} leaves no parameter to train")
    return {"trained": trained, "total": sum(int(np.prod(s)) for s in shapes.values())}


def split(params: Mapping[str, Any], config: TransformerConfig, freeze: str | None) -> tuple[dict, dict]:
    """(trained, frozen): the parameter tree as two trees of its trained and its frozen leaves (`is_trained`).
    With nothing frozen, (params, {}) as they are: full training traces exactly as before."""
    if not config.lora_rank and not _patterns(freeze):
        return params, {}
    trained, frozen = {}, {}
    for path, leaf in flatten(params).items():
        (trained if is_trained(path, config, freeze) else frozen)[path] = leaf
    return unflatten(trained), unflatten(frozen)


def joined(trained: Mapping[str, Any], frozen: Mapping[str, Any]) -> dict:
    """The parameter tree again from `split`'s two parts."""
    if not frozen:
        return trained
    return unflatten({**flatten(frozen), **flatten(trained)})


def describe(config: TransformerConfig, freeze: str | None) -> str:
    """One line for the run's log: what is trained."""
    counts = check(config, freeze)
    trained, total = counts["trained"], counts["total"]
    share = f"{trained:,} of {total:,} parameters ({100 * trained / total:.2f}%)"
    if config.lora_rank:
        return (
            f"fine-tuning: LoRA rank {config.lora_rank}, alpha {config.lora_alpha:g}, dropout {config.lora_dropout:g} "
            f"on {config.lora_targets}: {share} trained, the rest frozen"
        )
    if freeze:
        return f"fine-tuning: {share} trained, {freeze} frozen"
    return f"training all {counts['total']:,} parameters"


def quantized_base(params: Mapping[str, Any], config: TransformerConfig) -> dict:
    """QLoRA's parameters: the frozen base's matrices and embedding tables in int8 (`quantization.quantize_params`,
    per output channel), the adapters (never named kernel or embedding) as they are. Quantized ones stay so."""
    from jax_transformer.model import quantization

    check_qlora(config)
    if any(quantization.is_quantized(x) for x in jax.tree.leaves(params, is_leaf=quantization.is_quantized)):
        return dict(params)
    return quantization.quantize_params(params)


def check_qlora(config: TransformerConfig) -> None:
    """int8 in training is QLoRA's frozen base under adapters, multiplied as int8-weights (UsageError otherwise)."""
    from jax_transformer.model import quantization

    if not config.lora_rank:
        raise UsageError(
            f"--quantize {config.quantize} in training is QLoRA: the frozen base in int8 under LoRA adapters "
            f"(--lora-rank); a model trained in full computes in float32 or bfloat16 (--dtype)"
        )
    if quantization.resolve(config.quantize) != "int8-weights":
        raise UsageError(
            f"--quantize {config.quantize} in training: QLoRA takes int8-weights (the int8 base converted inside "
            f"float products, so gradients reach the adapters below it exactly); int8-dynamic rounds the activations"
        )
