"""What a fine-tuning run trains, and its adapters in peft's terms.

- LoRA (`config.lora_rank` > 0): the model's `Dense` layers named by `config.lora_targets` carry two more
  parameters, lora_a (D_in, r) and lora_b (r, D_out) (`model.Dense`); only they are trained. `merged` folds them
  into the kernels (W + A B alpha / r), the model transformers' `merge_and_unload` gives.
- Freezing (`OptimConfig.freeze`): the parameters its patterns name are left as they are.

The training step differentiates the trained parameters only, and the optimiser holds state for them only
(`split` / `joined`, in `training.train_step`): an optax mask (`optax.masked`, `multi_transform` with
`set_to_zero`) would also keep the optimiser's state small, but the gradient would still be taken of every
parameter. The adapters are written here rather than taken from qwix's LoRA, which adds them by intercepting
`dot_general` in a wrapped module: that would miss this model's own product paths (the int8 kernels, the decoding
step's vocabulary-major logits) and draw its dropout from flax's RNG, where this model's dropout is a function of
each row's place in the global batch (`jax_transformer.dropout`), the same however the batch is split.

`peft_state` / `adapters_from_peft` map the adapters to and from the state_dict of a peft `LoraModel` on the
transformers model a run was imported from (`pretrained.name_table` gives each kernel's module).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_transformer import pretrained
from jax_transformer.config import ConfigError, TransformerConfig
from jax_transformer.errors import UsageError
from jax_transformer.port import _flatten, _unflatten, expected_param_shapes

ADAPTER_LEAVES = ("lora_a", "lora_b")
# `--freeze` names beside globs: the top-level modules (or leaves) each stands for.
FREEZE_NAMES = {
    "embeddings": ("shared_embed", "source_embed", "target_embed", "*/positions"),
    "encoder": ("encoder",),
    "decoder": ("decoder",),
}
# peft's target_modules for each `lora_targets` entry (the module names of transformers' translation models).
PEFT_MODULES = {"q": ("q_proj",), "k": ("k_proj",), "v": ("v_proj",), "out": ("out_proj",), "ffn": ("fc1", "fc2")}


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
    for path, leaf in _flatten(params).items():
        (trained if is_trained(path, config, freeze) else frozen)[path] = leaf
    return _unflatten(trained), _unflatten(frozen)


def joined(trained: Mapping[str, Any], frozen: Mapping[str, Any]) -> dict:
    """The parameter tree again from `split`'s two parts."""
    if not frozen:
        return trained
    return _unflatten({**_flatten(frozen), **_flatten(trained)})


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


# =============================================================================================================
# Adapters: added, merged
# =============================================================================================================


def adapter_paths(config: TransformerConfig) -> dict[tuple[str, ...], tuple[int, ...]]:
    """Every adapter parameter of `config`'s model with its shape."""
    return {p: s for p, s in expected_param_shapes(config).items() if p[-1] in ADAPTER_LEAVES}


def with_adapters(params: Mapping[str, Any], config: TransformerConfig, seed: int = 0) -> dict:
    """`params` of a model without adapters (or with some) completed with fresh ones for `config`: A drawn as
    the model initialises it (peft's kaiming-uniform), B zeros, so the model computes what it did before."""
    flat = _flatten(params)
    key = jax.random.key(seed)
    bound_of = lambda shape: 1 / np.sqrt(shape[0])  # noqa: E731  U(-1/sqrt(D_in), 1/sqrt(D_in))
    for i, (path, shape) in enumerate(sorted(adapter_paths(config).items())):
        if path in flat:
            continue
        if path[-1] == "lora_a":
            bound = bound_of(shape)
            flat[path] = jax.random.uniform(jax.random.fold_in(key, i), shape, jnp.float32, -bound, bound)
        else:
            flat[path] = jnp.zeros(shape, jnp.float32)
    return _unflatten(flat)


def quantized_base(params: Mapping[str, Any], config: TransformerConfig) -> dict:
    """QLoRA's parameters: the frozen base's matrices and embedding tables in int8 (`quantization.quantize_params`,
    per output channel), the adapters (never named kernel or embedding) as they are. Quantized ones stay so."""
    from jax_transformer import quantization

    check_qlora(config)
    if any(quantization.is_quantized(x) for x in jax.tree.leaves(params, is_leaf=quantization.is_quantized)):
        return dict(params)
    return quantization.quantize_params(params)


def check_qlora(config: TransformerConfig) -> None:
    """int8 in training is QLoRA's frozen base under adapters, multiplied as int8-weights (UsageError otherwise)."""
    from jax_transformer import quantization

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


def merged(params: Mapping[str, Any], config: TransformerConfig) -> tuple[dict, TransformerConfig]:
    """(params, config) of the same function without adapters: each adapted kernel W + A B alpha / r (computed in
    float32 on the host), as peft's merge_and_unload writes it. A QLoRA base is dequantized first (the int8
    values times their scales: the weights its training computed with)."""
    if not config.lora_rank:
        return dict(params), config
    from jax_transformer import quantization

    params = _float(quantization.dequantize_params(params))
    flat = {p: np.asarray(v, np.float32) for p, v in _flatten(params).items()}
    scale = config.lora_alpha / config.lora_rank
    for path in [p for p in flat if p[-1] == "lora_a"]:
        module = path[:-1]
        a, b = flat.pop(path), flat.pop((*module, "lora_b"))
        flat[(*module, "kernel")] = flat[(*module, "kernel")] + (a @ b) * scale
    return _unflatten(flat), config.replace(lora_rank=0)


def _float(tree):
    """A parameter tree read from a QLoRA checkpoint without its template, whose int8 arrays are {qvalue, scale}
    dicts, with each of them as the float32 array it stands for (symmetric: the values times their scales)."""
    if not isinstance(tree, Mapping):
        return tree
    if {"qvalue", "scale"} <= set(tree):
        return np.asarray(tree["qvalue"], np.float32) * np.asarray(tree["scale"], np.float32)
    return {key: _float(value) for key, value in tree.items()}


# =============================================================================================================
# peft's files
# =============================================================================================================


def peft_config(config: TransformerConfig, base: str) -> dict[str, Any]:
    """adapter_config.json of a peft LoraConfig for the run's adapters on the transformers model `base`."""
    targets = config.lora_target_list
    return {
        "peft_type": "LORA",
        "task_type": "SEQ_2_SEQ_LM",
        "base_model_name_or_path": base,
        "r": config.lora_rank,
        "lora_alpha": config.lora_alpha,
        "lora_dropout": config.lora_dropout,
        "target_modules": sorted(m for t in targets for m in PEFT_MODULES[t]),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
    }


def _kernel_modules(config: TransformerConfig, family: str) -> dict[tuple[str, ...], str]:
    """{our adapted module path: their module name, e.g. 'model.encoder.layers.0.self_attn.q_proj'}."""
    table = pretrained.name_table(config.replace(lora_rank=0), family)
    adapted = {p[:-1] for p in adapter_paths(config)}
    return {p[:-1]: table[p].removesuffix(".weight") for p in table if p[-1] == "kernel" and p[:-1] in adapted}


def peft_state(params: Mapping[str, Any], config: TransformerConfig, family: str) -> dict[str, np.ndarray]:
    """The adapters as peft saves them (adapter_model.safetensors): base_model.model.<module>.lora_A.weight (r, D_in)
    and .lora_B.weight (D_out, r), torch's (out, in) layout."""
    flat = _flatten(params)
    state = {}
    for ours, theirs in _kernel_modules(config, family).items():
        state[f"base_model.model.{theirs}.lora_A.weight"] = np.asarray(flat[(*ours, "lora_a")], np.float32).T
        state[f"base_model.model.{theirs}.lora_B.weight"] = np.asarray(flat[(*ours, "lora_b")], np.float32).T
    return {k: np.ascontiguousarray(v) for k, v in state.items()}


def lora_settings(adapter: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A peft adapter_config.json as this project's LoRA fields (ConfigError naming what has no counterpart)."""
    if adapter.get("peft_type") != "LORA":
        raise ConfigError(f"{where}: peft_type {adapter.get('peft_type')!r}; only LORA adapters are read")
    unsupported = {
        "use_dora": False,
        "use_rslora": False,
        "fan_in_fan_out": False,
        "bias": "none",
        "modules_to_save": None,
        "layers_to_transform": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }
    for key, off in unsupported.items():
        if adapter.get(key, off) not in (off, None, {}, [], False):
            raise ConfigError(f"{where}: {key}={adapter[key]!r} has no counterpart here (only plain LoRA is read)")
    modules = adapter.get("target_modules") or []
    modules = [modules] if isinstance(modules, str) else list(modules)
    by_module = {m: t for t, ms in PEFT_MODULES.items() for m in ms}
    unknown = [m for m in modules if m not in by_module]
    if unknown or not modules:
        raise ConfigError(f"{where}: target_modules {modules} are not among {sorted(by_module)}")
    targets = sorted({by_module[m] for m in modules}, key=list(PEFT_MODULES).index)
    if "ffn" in targets and not {"fc1", "fc2"} <= set(modules):
        raise ConfigError(f"{where}: target_modules has one of fc1/fc2 only; this project adapts both or neither")
    return {
        "lora_rank": int(adapter["r"]),
        "lora_alpha": float(adapter["lora_alpha"]),
        "lora_dropout": float(adapter.get("lora_dropout", 0.0)),
        "lora_targets": ",".join(targets),
    }


def adapters_from_peft(
    state: Mapping[str, Any], config: TransformerConfig, family: str, where: str
) -> dict[tuple[str, ...], np.ndarray]:
    """{our adapter path: array} from a peft adapter's state_dict (keys with or without peft's ".default"), strict:
    a key missing, left over or of another shape than the base model's matrices need is a ConfigError naming it
    (an adapter trained on another base has other shapes or module names)."""
    shapes = adapter_paths(config)
    keys = {k.replace(".default.", "."): k for k in state}
    problems, flat = [], {}
    for ours, theirs in _kernel_modules(config, family).items():
        for leaf, name in (("lora_a", "lora_A"), ("lora_b", "lora_B")):
            key = f"base_model.model.{theirs}.{name}.weight"
            if key not in keys:
                problems.append(f"missing {key}")
                continue
            array = np.asarray(state[keys.pop(key)], np.float32).T
            if array.shape != shapes[(*ours, leaf)]:
                problems.append(f"{key}: shape {array.T.shape}, this base needs {shapes[(*ours, leaf)][::-1]}")
                continue
            flat[(*ours, leaf)] = np.ascontiguousarray(array)
    problems += [f"unexpected {k}" for k in sorted(keys)]
    if problems:
        raise ConfigError(
            f"{where}: the adapter does not fit this base model ({len(problems)} problem(s)):\n  "
            + "\n  ".join(problems[:8])
        )
    return flat


# =============================================================================================================
# A new language code
# =============================================================================================================


def with_language(checkpoint, code: str, like: str | None = None):
    """A multilingual model's checkpoint (weights alone) extended by the language `code`: its tokenizer with the
    code as a special token of the next id (`TokenizersJsonTokenizer.with_code`), its vocabulary one larger, the
    new embedding row a copy of `like`'s row (default: the mean of every code's row), and a logits bias, where the
    model has one, extended with `like`'s entry (or the codes' mean), as transformers' resize_token_embeddings and
    a copied row make it. A table with rows beyond the tokenizer's (NLLB-200's has two) gives the code its next
    spare row instead of growing. ConfigError naming the flag for a code that exists, an unknown `like`, or a tokenizer
    without language codes in a tokenizer.json (M2M-100's are numbered after its SentencePiece vocabulary)."""
    import dataclasses

    from jax_transformer.tokenizer import LanguageCodeTokenizer, TokenizersJsonTokenizer

    tokenizer, config = checkpoint.tokenizer, checkpoint.config
    if not isinstance(tokenizer, TokenizersJsonTokenizer):
        kind = "no language codes" if not isinstance(tokenizer, LanguageCodeTokenizer) else f"{tokenizer.kind}'s codes"
        raise ConfigError(
            f"--add-language: the tokenizer of the model in {checkpoint.directory} has {kind}; new codes are added "
            f"to NLLB-200's and mBART-50's (a tokenizer.json)"
        )
    if code in tokenizer.codes or code in tokenizer.backend.get_vocab(with_added_tokens=True):
        raise ConfigError(f"--add-language {code!r}: the tokenizer has it already (id {tokenizer.codes.get(code)})")
    if like is not None and like not in tokenizer.codes:
        tokenizer.checked_language(like, "--init-from-language")  # a ConfigError-like DataError naming the closest
    extended = tokenizer.with_code(code)
    new_id, size = extended.codes[code], config.src_vocab_size
    if not (config.share_embeddings and config.tie_output and new_id <= size):
        raise ConfigError(
            f"--add-language: the new id {new_id} is beyond the next row of the model's table of {size} (this works "
            f"for one shared, tied table at least the tokenizer's size)"
        )
    rows = [tokenizer.codes[like]] if like is not None else list(tokenizer.codes.values())
    flat = {p: np.array(v) for p, v in _flatten(checkpoint.params).items()}
    for path in (("shared_embed", "embedding"), ("logits_bias",)):  # (V, D) and (V,)
        if path not in flat:
            continue
        start = flat[path][rows].mean(axis=0, keepdims=True)
        if new_id == size:
            flat[path] = np.concatenate([flat[path], start])
        else:
            flat[path][new_id] = start[0]
    config = config.replace(src_vocab_size=max(size, new_id + 1), tgt_vocab_size=max(size, new_id + 1))
    return dataclasses.replace(checkpoint, config=config, tokenizer=extended).with_params(_unflatten(flat))
