"""A LoRA run's adapters in peft's terms: adapter_config.json (`peft_config`, `lora_settings`) and the state_dict of a
peft `LoraModel` on the transformers model a run was imported from (`peft_state`, `adapters_from_peft`;
`pretrained.name_table` gives each kernel's module)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from jax_transformer.errors import ConfigError
from jax_transformer.interop import pretrained
from jax_transformer.model.lora import adapter_paths
from jax_transformer.model.params import flatten
from jax_transformer.settings.config import TransformerConfig

# peft's target_modules for each `lora_targets` entry (the module names of transformers' translation models).
PEFT_MODULES = {"q": ("q_proj",), "k": ("k_proj",), "v": ("v_proj",), "out": ("out_proj",), "ffn": ("fc1", "fc2")}


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
    flat = flatten(params)
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
