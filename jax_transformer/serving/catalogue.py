"""`serve --models models.json`: the models one service serves behind one address, as LibreTranslate serves its
catalogue of pairs.

    {
      "models": [
        {"name": "en-fr", "checkpoint": "runs/en-fr", "pairs": ["en-fr"]},
        {"name": "nllb", "checkpoint": "runs/nllb", "step": "latest", "pairs": ["en-de", "de-en"],
         "decoding": {"beam_size": 2}}
      ],
      "prefer": {"en-de": "nllb"}
    }

Each entry: `name` (unique; the native API's `model`), `checkpoint` (a run directory, relative to the file's folder
unless absolute), `step` ("best", "latest" or a number; default "best"), `pairs` ("SRC-TGT" in any codes the model
takes: a model without language codes names its one pair; a multilingual model serves all its pairs unless the
entry lists some) and `decoding` (DecodeConfig fields over the run's and the command's). `checkpoints` (a list of
run directories, in place of `checkpoint`) serves an ensemble of them, weighted by `weights` (one number > 0 each;
default equal), each at `step`. `prefer` says which model serves a
pair two entries claim; without it, such a pair is an error at start."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from jax_transformer.errors import ConfigError

ENTRY_KEYS = ("name", "checkpoint", "checkpoints", "step", "pairs", "decoding", "weights")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One entry of the file, checked, not loaded."""

    name: str
    checkpoint: Path | list[Path]  # a list: an ensemble's runs
    step: str
    pairs: list[str] | None
    decoding: dict[str, Any]
    origin: str  # "models.json: models[1]", for messages
    weights: list[float] | None = None  # an ensemble's, one per run


def read(path: str | Path) -> tuple[list[ModelSpec], dict[str, str]]:
    """The entries of a models file and its "prefer"; any fault is a ConfigError naming the file and the key."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError(f"--models {path}: cannot read it: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"--models {path}: not UTF-8 text") from None
    except ValueError as e:
        raise ConfigError(f"--models {path}: not valid JSON: {e}") from None
    if not isinstance(data, dict) or not isinstance(data.get("models"), list) or not data["models"]:
        raise ConfigError(f'{path}: expected {{"models": [{{"name": ..., "checkpoint": ..., "pairs": [...]}}, ...]}}')
    unknown = sorted(set(data) - {"models", "prefer"})
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {unknown}; known: models, prefer")
    specs, names = [], set()
    for i, entry in enumerate(data["models"]):
        origin = f"{path}: models[{i}]"
        if not isinstance(entry, dict):
            raise ConfigError(f"{origin}: expected an object with name, checkpoint and pairs")
        unknown = sorted(set(entry) - set(ENTRY_KEYS))
        if unknown:
            raise ConfigError(f"{origin}: unknown key(s) {unknown}; known: {', '.join(ENTRY_KEYS)}")
        name = entry.get("name")
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{origin}.name: expected a name (text)")
        if name in names:
            raise ConfigError(f"{origin}.name {name!r}: two entries have this name")
        names.add(name)
        if "checkpoint" in entry and "checkpoints" in entry:
            raise ConfigError(f'{origin}: give "checkpoint" (a run) or "checkpoints" (an ensemble\'s runs), not both')
        ensemble = "checkpoints" in entry
        checkpoints = entry["checkpoints"] if ensemble else [entry.get("checkpoint")]
        if ensemble and (not isinstance(checkpoints, list) or len(checkpoints) < 2):
            raise ConfigError(f"{origin}.checkpoints: expected a list of two or more run directories")
        directories = []
        for j, checkpoint in enumerate(checkpoints):
            key = f"{origin}.checkpoints[{j}]" if ensemble else f"{origin}.checkpoint"
            if not isinstance(checkpoint, str) or not checkpoint:
                raise ConfigError(f"{key}: expected a run directory")
            directory = Path(checkpoint) if Path(checkpoint).is_absolute() else path.parent / checkpoint
            if not directory.exists():
                raise ConfigError(f"{key} {checkpoint!r}: {directory} does not exist")
            directories.append(directory)
        weights = entry.get("weights")
        if weights is not None and not ensemble:
            raise ConfigError(f'{origin}.weights: an ensemble\'s; give them with "checkpoints"')
        if weights is not None and (
            not isinstance(weights, list)
            or len(weights) != len(directories)
            or not all(isinstance(w, (int, float)) and not isinstance(w, bool) and w > 0 for w in weights)
        ):
            raise ConfigError(f"{origin}.weights: expected {len(directories)} numbers > 0, one per checkpoint")
        step = entry.get("step", "best")
        if isinstance(step, bool) or not isinstance(step, (str, int)):
            raise ConfigError(f"{origin}.step: expected 'best', 'latest' or a number, got {step!r}")
        pairs = entry.get("pairs")
        if pairs is not None and (
            not isinstance(pairs, list) or not pairs or not all(isinstance(p, str) and p for p in pairs)
        ):
            raise ConfigError(f'{origin}.pairs: expected a list of "SRC-TGT" texts, e.g. ["de-en"]')
        decoding = entry.get("decoding", {})
        if not isinstance(decoding, dict):
            raise ConfigError(f"{origin}.decoding: expected an object of decoding settings")
        where = directories if ensemble else directories[0]
        specs.append(ModelSpec(name, where, str(step), pairs, decoding, origin, weights))
    prefer = data.get("prefer", {})
    if not isinstance(prefer, dict) or not all(isinstance(v, str) for v in prefer.values()):
        raise ConfigError(f'{path}: prefer: expected {{"SRC-TGT": "model name", ...}}')
    for pair, name in prefer.items():
        if name not in names:
            raise ConfigError(
                f"{path}: prefer.{pair}: {name!r} is not a model of the file ({', '.join(sorted(names))})"
            )
    return specs, prefer
