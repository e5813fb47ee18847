"""The one resolution of settings: what every command computes with, decided here and nowhere else.

Each setting is, in this order: the flag given (or a request's option, in `serve`), else what the run stored with
its checkpoint (a resume; a model decoding as it was trained or imported to), else what the model a run starts
from decodes with (`train --init-from`: an imported model's generation_config), else the recipe's, else the
dataclass's default. The training run's settings (`resolve`), the model a command computes (`model_config`,
`requested_model`, `computed`) and the decoding of `evaluate`, `translate`, `score`, `serve`, `verify` and the
run's evaluations (`decodings`, `decoding`, `request_decoding`, `evaluation_decoding`, `forced_language`) all come
from this module; each rule between settings (a beam against the vocabulary, the length defaults, sampling against
beams) is written once, in `config` or here.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from jax_transformer.errors import ConfigError, UsageError
from jax_transformer.settings.config import (
    COMPUTE_FIELDS,
    GROUPS,
    PRESETS,
    DataConfig,
    DecodeConfig,
    LoopConfig,
    OptimConfig,
    ParallelConfig,
    TransformerConfig,
    check_decoding,
    load_recipe,
    preset,
)

# =============================================================================================================
# A training run's settings
# =============================================================================================================

DEFAULT_PRESET = {"numbers": "tiny", "files": "small"}


# The recipe a run gets when none is named: the numbers task's own; for data files none (the dataclass defaults
# and the small preset): the measured recipes stop after a fixed number of minutes, which a run on other data
# should not inherit without asking for it (`--recipe multi30k-cpu`).
DEFAULT_RECIPE: dict[str, str | None] = {"numbers": "numbers", "files": None}

# What an exact resume needs unchanged (validation files, the loop's budgets and the decoding may change).
FROZEN_DATA_FIELDS = (
    "src",
    "tgt",
    "tsv",
    "vocab_size",
    "tokenizer_type",
    "max_tokens",
    "row_multiple",
    "batching",
    "pack_length",
    "on_empty",
    "on_too_long",
)


@dataclasses.dataclass(frozen=True)
class RunSettings:
    """A training run's settings, resolved (`resolve`). `model` holds the TransformerConfig fields chosen over the
    preset's; the vocabulary sizes come later, from the tokenizer."""

    preset: str
    recipe: str | None
    seed: int
    model: dict[str, Any]
    data: DataConfig
    optim: OptimConfig
    loop: LoopConfig
    parallel: ParallelConfig
    decode: DecodeConfig = DecodeConfig()

    @property
    def task(self) -> str:
        """ "numbers" (the built-in task) or "files"."""
        return "numbers" if self.data.uses_default_task else "files"


def resolve(
    given: Mapping[str, Any], stored: Mapping[str, Any] | None = None, inherited: Mapping[str, Any] | None = None
) -> RunSettings:
    """A run's settings, decided once: each field is the given value (a flag), else what a resumed checkpoint
    stored (`stored`), else what the model a run starts from decodes with (`inherited`: its "decode" group;
    `train --init-from`), else the recipe's, else the dataclass default; the preset
    likewise, its default the task's.

    `given`: {"preset", "recipe", "seed"} and the groups {"model", "data", "optim", "loop", "parallel"}, each a
    partial dict (missing or None: not given). On a resume, the recipe and every setting an exact continuation
    depends on (the seed, the optimiser, the training data and its batching, the best-checkpoint metric) must be
    left out or equal to the stored value, else a UsageError names it. `parallel` describes the machine and is
    never restored."""
    groups = {name: {k: v for k, v in (given.get(name) or {}).items() if v is not None} for name in GROUPS}
    parallel = ParallelConfig.from_dict({k: v for k, v in (given.get("parallel") or {}).items() if v is not None})
    recipe_name = _choose_recipe(given.get("recipe"), groups["data"], stored)
    # A resume has every setting stored already; a fresh run takes what is not given from its recipe.
    recipe = load_recipe(recipe_name) if recipe_name and stored is None else {}
    layers = (recipe, inherited or {}, stored or {})
    below = {group: {k: v for layer in layers for k, v in layer.get(group, {}).items()} for group in GROUPS}
    if stored is not None:
        _check_frozen("seed", given.get("seed"), stored["seed"])
        for name, value in groups["optim"].items():
            _check_frozen(name, value, stored["optim"].get(name))
        # The best checkpoint so far and early stopping's best score were chosen by the stored metric.
        _check_frozen("best_metric", groups["loop"].get("best_metric"), stored["loop"].get("best_metric", "bleu"))
    data = _resolve_data(groups["data"], stored, recipe.get("data", {}))
    task = "numbers" if data.uses_default_task else "files"
    preset_name = given.get("preset") or (stored or {}).get("preset") or recipe.get("preset") or DEFAULT_PRESET[task]
    if preset_name not in PRESETS:
        raise ConfigError(f"unknown preset {preset_name!r}; choose one of {sorted(PRESETS)}")
    optim = OptimConfig.from_dict({**below["optim"], **groups["optim"]}, source="optimiser settings")
    loop = LoopConfig.from_dict({**below["loop"], **groups["loop"]}, source="loop settings")
    if optim.schedule in ("linear", "cosine") and optim.decay_steps is None:  # decays to 0 at the run's last step
        optim = optim.replace(decay_steps=loop.steps)
    if optim.schedule in ("linear", "cosine") and loop.steps > optim.decay_steps:
        fix = "; a resume keeps its schedule" if stored is not None else ", or a later --decay-steps"
        raise ConfigError(
            f"--steps {loop.steps} goes past --decay-steps {optim.decay_steps}, where --schedule {optim.schedule} "
            f"reaches a learning rate of 0: the steps after it would change nothing (give --steps "
            f"{optim.decay_steps} or fewer{fix})"
        )
    return RunSettings(
        preset=preset_name,
        recipe=recipe_name,
        seed=stored["seed"] if stored is not None else (given.get("seed") or 0),
        model={**recipe.get("model", {}), **groups["model"]},
        data=data,
        optim=optim,
        loop=loop,
        parallel=parallel,
        decode=DecodeConfig.from_dict({**below["decode"], **groups["decode"]}, source="decoding settings"),
    )


def _choose_recipe(name: str | None, given_data: Mapping[str, Any], stored: Mapping[str, Any] | None) -> str | None:
    """The recipe of a run: the one named, else (on a resume) the stored one, else the task's default."""
    if name is not None and stored is None:
        load_recipe(name)  # fails early, naming what is wrong
    if stored is not None:
        saved = stored.get("recipe")
        if name is not None and name != saved:
            raise UsageError(
                f"--resume: the run was started with recipe {saved!r}; a resume continues with its stored "
                f"settings (leave out --recipe {name})"
            )
        if "recipe" in stored:
            return saved
        files = stored["data"].get("src") or stored["data"].get("tsv")  # a checkpoint from before recipes
    else:
        files = given_data.get("src") or given_data.get("tsv")
    return name or DEFAULT_RECIPE["files" if files else "numbers"]


def _resolve_data(given: Mapping[str, Any], stored: Mapping[str, Any] | None, recipe: Mapping[str, Any]) -> DataConfig:
    """The run's DataConfig: given, else the recipe's. On a resume the stored files and batching stay; new
    validation files may be given."""
    if stored is None:
        return DataConfig.from_dict({**recipe, **given})
    # Runs from before packed batches existed batched by length buckets; before row_multiple was a setting, the
    # rows of every batch were a multiple of the device count.
    saved = {"batching": "buckets", "row_multiple": stored.get("devices") or 1, **stored["data"]}
    for name in FROZEN_DATA_FIELDS:
        if given.get(name) is not None:
            value = str(Path(given[name]).absolute()) if name in ("src", "tgt", "tsv") else given[name]
            _check_frozen(name, value, saved.get(name))
    return DataConfig.from_dict({**saved, **{k: v for k, v in given.items() if k not in FROZEN_DATA_FIELDS}})


def _check_frozen(name: str, given: Any, stored: Any) -> None:
    if given is not None and given != stored:
        raise UsageError(
            f"--resume: the checkpoint was trained with {name}={stored!r}, but {name}={given!r} was "
            f"given; an exact resume needs the same value (leave the flag out)"
        )


# =============================================================================================================
# The model a command computes
# =============================================================================================================


def model_config(preset_name: str, vocab_size: int, fields: Mapping[str, Any]) -> TransformerConfig:
    """A new model: the preset, with the tokenizer's vocabulary on both sides, under the fields given (the flags
    over the recipe's). Source and target share one SentencePiece vocabulary here, so the embedding table is
    shared unless a field says otherwise."""
    base = dict(src_vocab_size=vocab_size, tgt_vocab_size=vocab_size, share_embeddings=True)
    return preset(preset_name, **{**base, **fields})


def requested_model(
    saved: TransformerConfig, preset_name: str | None = None, given: Mapping[str, Any] | None = None
) -> TransformerConfig:
    """The model asked for over a saved one (a checkpoint's, a weight file's, an imported model's): the preset
    named, then the fields given, over `saved`. What may differ from `saved` is the caller's to check
    (`checkpoint.manager.check_config`: a resume may change how to compute, not the model)."""
    changes = {**(PRESETS[preset_name] if preset_name else {}), **(given or {})}
    return saved.replace(**changes) if changes else saved


def computed(config: TransformerConfig, compute: Mapping[str, Any] | None) -> TransformerConfig:
    """`config`'s model computed as asked: the COMPUTE_FIELDS given (dtype, attention kernel, remat, int8) over
    it; any parameters of the model serve in any of them. A field that would change the model is a ConfigError."""
    compute = dict(compute or {})
    other = sorted(set(compute) - set(COMPUTE_FIELDS))
    if other:
        raise ConfigError(f"{', '.join(other)}: not how to compute ({', '.join(COMPUTE_FIELDS)}) but the model itself")
    return config.replace(**compute) if compute else config


# =============================================================================================================
# How a model decodes
# =============================================================================================================


def decoding(
    config: TransformerConfig, stored: Mapping[str, Any] | None = None, given: Mapping[str, Any] | None = None
) -> DecodeConfig:
    """How `config`'s model decodes: each DecodeConfig field as `given` (flags), else as the run stored it
    (`stored`: its "decode" group; an imported model's is its generation_config), else the default; checked
    against the model (`config.check_decoding`: beam widths, lengths and ids) and between fields (n-best,
    sampling), a ConfigError naming the flag otherwise."""
    return decodings(config, stored, given)[0]


def decodings(
    config: TransformerConfig, stored: Mapping[str, Any] | None = None, given: Mapping[str, Any] | None = None
) -> list[DecodeConfig]:
    """`decoding`, where `given` may hold lists (`evaluate --beam-size 1 4 --alpha 0.6 1.0`): every combination, in
    the order given, without repeats; greedy search (beam 1) once, whatever the alphas."""
    given = dict(given or {})
    stored = dict(stored or {})
    lists = {k: v for k, v in given.items() if isinstance(v, Sequence) and not isinstance(v, str)}
    grid, found = [], []
    for values in itertools.product(*lists.values()):
        choice = {**given, **dict(zip(lists, values))}
        if choice.get("beam_size", stored.get("beam_size")) == 1 and "alpha" in lists:
            choice["alpha"] = lists["alpha"][0]  # no length penalty in greedy search: one row for it
        if choice not in grid:
            grid.append(choice)
    for choice in grid:
        decode = _over(stored, choice, "decoding settings", flag=lambda name: "--" + name.replace("_", "-"))
        check_decoding(config, decode, {"--beam-size": [decode.beams]}, given=choice)
        found.append(decode)
    return found


def request_decoding(
    config: TransformerConfig, base: DecodeConfig, options: Mapping[str, Any], field: str = "options"
) -> DecodeConfig:
    """A request's decoding (`serve`): the fields it gives (DecodeConfig's names) over the service's own
    decoding, by the same rules as the flags over a run's; its errors name `field`.NAME."""
    if not options:
        return base
    decode = _over(base.to_dict(), options, field, flag=lambda name: f"{field}.{name}")
    check_decoding(config, decode, {f"{field}.beam_size": [decode.beams]}, given=options)
    return decode


def allowed_decodings(base: DecodeConfig, values: Mapping[str, Sequence[Any]]) -> tuple[list[DecodeConfig], list[str]]:
    """A service's allowed set (`serve --allow`): every combination of `values` (field -> values) over `base` that is
    a valid decoding, and, for the others, why not (n_best above the beam, a sampling option without sampling)."""
    names = list(values)
    found, refused = [], []
    for combo in itertools.product(*(values[name] for name in names)):
        chosen = dict(zip(names, combo))
        try:
            found.append(DecodeConfig.from_dict({**base.to_dict(), **chosen}, source="--allow"))
        except ConfigError as e:
            refused.append(f"{chosen}: {e}")
    return found, refused


def with_field_of(decode: DecodeConfig, other: DecodeConfig, name: str) -> DecodeConfig:
    """`decode` with field `name` as `other` has it (a ConfigError where that is no valid decoding)."""
    return decode.replace(**{name: getattr(other, name)})


def _over(below: Mapping[str, Any], choice: Mapping[str, Any], source: str, flag) -> DecodeConfig:
    """`choice` over `below`, with the one rule between sampling and beams: sampling draws one hypothesis per
    sample, so a beam width given with it is an error; one below it (a run's stored beam) stays, unused
    (`DecodeConfig.beams` is 1)."""
    if choice.get("do_sample") and "beam_size" in choice:
        raise ConfigError(
            f"{flag('beam_size')} does not apply to sampling ({flag('do_sample')} draws one hypothesis per sample)"
        )
    return DecodeConfig.from_dict({**below, **choice}, source=source)


def evaluation_decoding(decode: DecodeConfig, eval_beam_size: int | None = None) -> DecodeConfig:
    """How an evaluation decodes (BLEU, chrF): the decoding's best hypothesis only, with the evaluations' own beam
    width during training (`--eval-beam-size`; None: the decoding's, as the final evaluation and `evaluate`)."""
    decode = decode.replace(n_best=1)
    return decode if eval_beam_size is None else decode.replace(beam_size=eval_beam_size)


def forced_language(decode: DecodeConfig | None, forced_bos: int | None) -> DecodeConfig:
    """`decode` (None: the default) with a multilingual model's target language code as the first output token
    (`forced_bos`: the tokenizer's; None for a model without language codes). A model with codes decodes by
    transformers' rules unless told otherwise."""
    if forced_bos is None:
        return decode or DecodeConfig()
    return (decode or DecodeConfig(rules="transformers")).replace(forced_bos=forced_bos)
