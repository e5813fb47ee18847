"""Trained models saved as test data (tests/data/): tests whose claims depend on trained weights decode these, so they
hold on every CPU."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

from jax_transformer.settings.config import TransformerConfig

DATA = Path(__file__).resolve().parents[1] / "data"


@dataclasses.dataclass(frozen=True)
class SavedModel:
    """A trained model saved as test data (`tests/data/*.npz`): tests decode these weights instead of training
    their own, so that what they claim does not depend on the float32 rounding of the machine they run on."""

    config: TransformerConfig
    params: Any
    sources: np.ndarray  # (N, S) int32 padded validation sources
    tokenizer: Any = None  # jax_transformer.data.Tokenizer, where the file has one
    source_texts: tuple[str, ...] = ()
    target_texts: tuple[str, ...] = ()


def load_saved_model(name: str) -> SavedModel:
    """tests/data/<name>.npz (or the file `name`, if it ends in .npz): config (JSON), params/<flax path>, sources,
    and optionally tokenizer (serialized SentencePiece model), source_texts and target_texts (written by
    tests/data/make_trained_tiny.py)."""
    from flax.traverse_util import unflatten_dict

    from jax_transformer.data.tokenizer import Tokenizer

    with np.load(name if name.endswith(".npz") else DATA / f"{name}.npz") as z:
        params = unflatten_dict({tuple(k.split("/")[1:]): z[k] for k in z.files if k.startswith("params/")})
        texts = {key: tuple(str(x) for x in z[key]) for key in ("source_texts", "target_texts") if key in z.files}
        return SavedModel(
            config=TransformerConfig.from_dict(json.loads(str(z["config"]))),
            params=params,
            sources=z["sources"].astype(np.int32),
            tokenizer=Tokenizer.from_bytes(z["tokenizer"].tobytes()) if "tokenizer" in z.files else None,
            **texts,
        )


def saved_run(directory: Path, name: str = "trained_tiny") -> Path:
    """A run directory holding the saved model `name` as its checkpoint of step 1 (Adam's state new, the default
    settings: the built-in task's English -> French), for the sub-commands that read a run (translate, serve)."""
    from jax_transformer.checkpoint import manager as checkpoint
    from jax_transformer.settings.config import OptimConfig
    from jax_transformer.training import trainer

    saved = load_saved_model(name)
    optim = OptimConfig()
    state = trainer.create_train_state(saved.config, optim, params=saved.params)
    manager = checkpoint.CheckpointManager(directory, async_save=False)
    manager.save(1, trainer.state_for_saving(state), config=saved.config, optim=optim.to_dict(),
                 tokenizer=saved.tokenizer)  # fmt: skip
    manager.close()
    return directory
