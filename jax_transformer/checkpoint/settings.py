"""The settings a run stored with its checkpoints, as one dict of groups ({"preset", "seed", "data", "optim", "loop",
"decode", ...}), whatever the checkpoint's format: what a resume compares, what decoding starts from and what an
export names as its base model."""

from __future__ import annotations

from typing import Any

from jax_transformer.checkpoint.manager import Checkpoint
from jax_transformer.errors import CheckpointError, ConfigError, DataError
from jax_transformer.settings.config import DataConfig, decoding_in_one_group

# A format-1 checkpoint (before settings were grouped) stored its run settings flat; this maps them.
_FORMAT1_LOOP = (
    "steps",
    "eval_every",
    "save_every",
    "max_minutes",
    "keep",
    "eval_beam_size",
    "beam_size",
    "alpha",
    "eval_sentences",
    "samples",
)


def stored_settings(restored: Checkpoint) -> dict[str, Any]:
    """The run settings a checkpoint stored, as {"preset", "seed", "data", "optim", "loop", "decode", ...}."""
    run = dict(restored.run)
    if restored.format >= 2:
        return decoding_in_one_group({**run, "optim": dict(restored.optim)})
    data: dict[str, Any] = {
        k: run[k] for k in ("vocab_size", "tokenizer_type", "max_tokens", "on_empty", "on_too_long") if k in run
    }
    for prefix, spec in (("", run.get("train_data")), ("valid_", run.get("valid_data"))):
        if spec and spec.get("kind") == "parallel":
            data.update({prefix + "src": spec["src"], prefix + "tgt": spec["tgt"]})
        elif spec and spec.get("kind") == "tsv":
            data[prefix + "tsv"] = spec["tsv"]
    try:
        data_config = DataConfig.from_dict(data, source=f"{restored.directory} (format 1) data settings")
    except (DataError, ConfigError) as e:
        raise CheckpointError(
            f"{restored.directory}: cannot read the run settings of this format-1 "
            f"checkpoint to resume it ({e}); evaluate, translate and export still work"
        ) from None
    return decoding_in_one_group(
        {
            "preset": run.get("preset"),
            "seed": run.get("seed", 0),
            "data": data_config.to_dict(),
            "optim": dict(restored.optim),
            "loop": {k: run[k] for k in _FORMAT1_LOOP if k in run},
            "train_fingerprint": run.get("train_fingerprint"),
            "devices": run.get("devices"),
        }
    )
