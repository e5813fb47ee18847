"""PyTorch weight files: the one place that reads and writes them.

`export_torch` writes Flax parameters as a `torch_reference` state_dict file with the model config and the
tokenizer inside; `import_torch` reads such a file (or a bare torch_reference state_dict) back into Flax
parameters. The name map itself is `jax_transformer.port` (numpy only); torch is imported only inside these
functions, so importing this module does not import torch.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

import jax
import numpy as np

from jax_transformer.checkpoint import CheckpointError, check_config
from jax_transformer.config import TransformerConfig
from jax_transformer.data import Tokenizer

TORCH_FORMAT = "jax_transformer.torch_export.v1"


def export_torch(path: str | os.PathLike, params, config: TransformerConfig, tokenizer: Tokenizer | None = None) -> Path:
    """Writes Flax params as a torch_reference state_dict file: torch.save of
    {"format", "config" (JSON text), "state_dict" (name -> float32 tensor), "tokenizer" (SentencePiece bytes)}.
    Load it with `torch_reference.Transformer(TransformerConfig.from_json(d["config"])).load_state_dict(...)`."""
    import torch

    from jax_transformer.port import flax_to_torch

    state_dict = {name: torch.from_numpy(np.array(value, dtype=np.float32))
                  for name, value in flax_to_torch(jax.device_get(params)).items()}
    payload = {"format": TORCH_FORMAT, "config": config.to_json(), "state_dict": state_dict,
               "tokenizer": None if tokenizer is None else tokenizer.to_bytes()}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(payload, path)
    return path


def import_torch(path: str | os.PathLike, config: TransformerConfig | None = None):
    """Reads a PyTorch file -> (Flax params, config, tokenizer or None).

    Accepts what `export_torch` writes (config and tokenizer inside) or a bare torch_reference state_dict
    (`torch.save(model.state_dict(), path)`), which needs `config`. When both the file and `config` give a
    config they must agree (ConfigError naming the fields). Wrong names or shapes are a PortError."""
    import torch

    from jax_transformer.port import torch_to_flax

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: PyTorch file not found")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"{path}: cannot read as a PyTorch file: {e}") from None
    if not isinstance(payload, Mapping):
        raise CheckpointError(f"{path}: expected a dict (a state_dict or an export), got {type(payload).__name__}")
    tokenizer = None
    if payload.get("format") == TORCH_FORMAT:
        saved = TransformerConfig.from_json(payload["config"], source=f"{path} config")
        if config is not None:
            check_config(saved, config, where=f"PyTorch file {path}")
        config, state_dict = saved, payload["state_dict"]
        if payload.get("tokenizer") is not None:
            tokenizer = Tokenizer(payload["tokenizer"], source=f"{path} tokenizer")
    else:
        if config is None:
            raise CheckpointError(f"{path}: a bare state_dict has no config; give the model's config "
                                  f"(train.py: --preset and size flags)")
        state_dict = payload
    return torch_to_flax(state_dict, config), config, tokenizer
