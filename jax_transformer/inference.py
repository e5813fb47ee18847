"""A model ready to decode, for every caller alike (the command line's evaluate, translate, score and verify, the
benchmarks): `load` reads a run's checkpoint (or an imported model's run directory) with how to compute it
(dtype, attention kernel, int8), where its weights live (one device or a mesh) and its languages; `decoding`
resolves its `DecodeConfig` once, a flag over the run's stored choice (an imported model's is its
generation_config), over the defaults, and checks it against the model before anything compiles."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jax_transformer import checkpoint
from jax_transformer.config import ConfigError, DecodeConfig, check_decoding
from jax_transformer.distributed import DataParallel
from jax_transformer.run import stored_settings


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
    merge_adapters: a LoRA run's adapters folded into its kernels (`finetuning.merged`), so that it decodes,
        quantizes and exports to the twin as the plain model it is; False keeps them (`export --format peft`).
    """
    placement = None if mesh is None else DataParallel("sharded", 1, mesh).placement
    loaded = checkpoint.load(directory, step, weights_only=True, placement=placement)
    if languages:
        from jax_transformer.tokenizer import with_languages

        loaded = dataclasses.replace(loaded, tokenizer=with_languages(loaded.tokenizer, **languages))
    if compute:
        loaded = dataclasses.replace(loaded, config=loaded.config.replace(**compute))
    if merge_adapters and loaded.config.lora_rank:
        from jax_transformer.finetuning import merged

        params, config = merged(loaded.params, loaded.config)
        loaded = dataclasses.replace(loaded.with_params(params), config=config)
    if loaded.config.quantize != "none" and quantize_weights:
        from jax_transformer.quantization import quantize_params

        loaded = loaded.with_params(quantize_params(loaded.params))
    if print_fn is not None:
        note = "" if loaded.verified else f", format {loaded.format}, written before checksums: not verified"
        how = loaded.config.dtype + ("" if loaded.config.quantize == "none" else f", {loaded.config.quantize}")
        print_fn(f"loaded {loaded.directory} step {loaded.step} ({how}{note})")
    return loaded


def decoding(loaded: checkpoint.Checkpoint, given: Mapping[str, Any] | None = None) -> DecodeConfig:
    """How `loaded` decodes: each DecodeConfig field as `given` (flags), else as the run stored it, else the
    default; checked against the model (`config.check_decoding`: beam widths, lengths and ids) and between fields
    (n-best, sampling), a ConfigError naming the flag otherwise."""
    return decodings(loaded, given)[0]


def decodings(loaded: checkpoint.Checkpoint, given: Mapping[str, Any] | None = None) -> list[DecodeConfig]:
    """`decoding`, where `given` may hold lists (`evaluate --beam-size 1 4 --alpha 0.6 1.0`): every combination, in
    the order given, without repeats; greedy search (beam 1) once, whatever the alphas."""
    given = dict(given or {})
    if given.get("do_sample") and "beam_size" in given:
        raise ConfigError("--beam-size does not apply to sampling (--do-sample draws one hypothesis per sample)")
    stored = stored_settings(loaded).get("decode", {})
    lists = {k: v for k, v in given.items() if isinstance(v, Sequence) and not isinstance(v, str)}
    grid, found = [], []
    for values in itertools.product(*lists.values()):
        choice = {**given, **dict(zip(lists, values))}
        if choice.get("beam_size", stored.get("beam_size")) == 1 and "alpha" in lists:
            choice["alpha"] = lists["alpha"][0]  # no length penalty in greedy search: one row for it
        if choice not in grid:
            grid.append(choice)
    for choice in grid:
        decode = DecodeConfig.from_dict({**stored, **choice}, source="decoding settings")
        check_decoding(loaded.config, decode, {"--beam-size": [decode.beams]}, given=choice)
        found.append(decode)
    return found
