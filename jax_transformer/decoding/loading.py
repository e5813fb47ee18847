"""A model ready to decode, for every caller alike (the command line's evaluate, translate, score and verify, the
benchmarks): `load` reads a run's checkpoint (or an imported model's run directory) with how to compute it
(dtype, attention kernel, int8), where its weights live (one device or a mesh) and its languages; `decoding`
gives its `DecodeConfig`, resolved by `settings.resolve` from the flags and the run's stored choice; `ensemble` makes
several loaded checkpoints one model (`decoding.ensemble`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jax_transformer.checkpoint import manager as checkpoint
from jax_transformer.checkpoint.settings import stored_settings
from jax_transformer.model.sharding import placement as mesh_placement
from jax_transformer.settings import resolve as resolution
from jax_transformer.settings.config import DecodeConfig


def load(
    directory,
    step: str | int = "best",
    *,
    compute: Mapping[str, Any] | None = None,
    quantize_weights: bool = True,
    mesh: str | None = None,
    languages: Mapping[str, str] | None = None,
    print_fn: Callable[[str], None] | None = None,
    merge_adapters: bool = True,
) -> checkpoint.Checkpoint:
    """The checkpoint `step` ("best", "latest" or a number) of the run in `directory`, its weights alone, verified
    (damaged weights are a CheckpointError; the optimizer's state, twice their size with Adam, is not read).

    compute: TransformerConfig fields of how to compute (dtype, attention_kernel, quantize): not part of the model,
        any checkpoint runs in any of them. With quantize, the weights are made int8 here (in memory only) unless
        `quantize_weights` is False (verify, which exports the float weights to the twin).
    mesh: the weights read straight onto a mesh of the devices (e.g. "fsdp=4"), split as training splits them, for
        a model that does not fit one device: each program then runs over the mesh (the compiler partitions it).
    languages: a multilingual model's src_lang / tgt_lang (default: the tokenizer's, stored at import).
    print_fn: where the one line saying what was loaded goes.
    merge_adapters: a LoRA run's adapters folded into its kernels (`lora.merged`), so that it decodes,
        quantizes and exports to the twin as the plain model it is; False keeps them (`export --format peft`).
    """
    placement = None if mesh is None else mesh_placement(mesh)
    loaded = checkpoint.load(directory, step, weights_only=True, placement=placement)
    if languages:
        from jax_transformer.data.tokenizer import with_languages

        loaded = dataclasses.replace(loaded, tokenizer=with_languages(loaded.tokenizer, **languages))
    if compute:
        loaded = dataclasses.replace(loaded, config=resolution.computed(loaded.config, compute))
    if merge_adapters and loaded.config.lora_rank:
        from jax_transformer.model.lora import merged

        params, config = merged(loaded.params, loaded.config)
        loaded = dataclasses.replace(loaded.with_params(params), config=config)
    if loaded.config.quantize != "none" and quantize_weights:
        from jax_transformer.model.quantization import quantize_params

        loaded = loaded.with_params(quantize_params(loaded.params))
    if print_fn is not None:
        note = "" if loaded.verified else f", format {loaded.format}, written before checksums: not verified"
        how = loaded.config.dtype + ("" if loaded.config.quantize == "none" else f", {loaded.config.quantize}")
        print_fn(f"loaded {loaded.directory} step {loaded.step} ({how}{note})")
    return loaded


def decoding(loaded: checkpoint.Checkpoint, given: Mapping[str, Any] | None = None) -> DecodeConfig:
    """How `loaded` decodes: each DecodeConfig field as `given` (flags), else as the run stored it, else the
    default (`settings.resolve.decoding`), checked against the model."""
    return decodings(loaded, given)[0]


def decodings(loaded: checkpoint.Checkpoint, given: Mapping[str, Any] | None = None) -> list[DecodeConfig]:
    """`decoding`, where `given` may hold lists (`evaluate --beam-size 1 4 --alpha 0.6 1.0`): every combination
    (`settings.resolve.decodings`)."""
    return resolution.decodings(loaded.config, stored_settings(loaded).get("decode", {}), given)


def ensemble(loaded: Sequence[checkpoint.Checkpoint], weights: Sequence[float] | None = None):
    """The checkpoints `loaded` (two or more, in order) as one model (`ensemble.Ensemble`), weighted by `weights`
    (default: equal): a UsageError naming both runs and what differs where they do not share a vocabulary, or
    where their weights lie on a mesh (an ensemble runs on one device), before anything is decoded."""
    from jax_transformer.decoding.ensemble import Ensemble
    from jax_transformer.decoding.translation import weights_mesh
    from jax_transformer.errors import UsageError

    for member in loaded:
        if weights_mesh(member.params) is not None:
            raise UsageError(f"{member.directory}: an ensemble runs on one device; give no --mesh")
    return Ensemble.of(
        [member.config for member in loaded],
        [member.params for member in loaded],
        weights,
        names=[f"{member.directory} (step {member.step})" for member in loaded],
        tokenizers=[member.tokenizer for member in loaded],
    )
