"""Checkpoints with orbax: a training run saved so that it can be resumed exactly, or used to translate.

A checkpoint directory (one per run) holds numbered steps, each written atomically by orbax (into a temporary
directory that is renamed when complete, so a process killed mid-save leaves the previous step loadable):

    <run>/checkpoints/<step>/state   the train state as a nested dict of arrays: step, params, optimiser state,
                                     the base dropout key's raw words (`training.state_for_saving`)
    <run>/checkpoints/<step>/meta    JSON: model config, optimiser config, data position (BatchStream.state()),
                                     run settings, the run loop's own state (`loop_state`: early stopping's
                                     best score and counter) and the SentencePiece model (base64), so
                                     translation later uses exactly the training vocabulary
    <run>/checkpoints/<step>/metrics JSON: validation score of that step, when it was evaluated

Which steps are kept: the last `keep` saved plus the best by validation score (orbax's LatestN and BestN
preservation policies, combined with AnyPreservationPolicy). Saving is asynchronous: `save` returns once the
state has been copied to host memory and writes to disk in the background; it waits for the previous save
first, and `wait`/`close` block until everything is on disk (call before exit).

This module knows the model config and the tokenizer, not the training loop or the optimiser: `restore` returns
the saved arrays, and `jax_transformer.training.restore_train_state` rebuilds a TrainState from them.

Formats: 2 (this code) stores the run settings grouped as `{"data": ..., "optim": ..., "loop": ...}`; format 1
(before typed keys) stored them flat. Both hold the same arrays (the dropout key as raw uint32 words), so both
load; `jax_transformer.run` reads a format-1 run's settings when resuming it.
"""

from __future__ import annotations

import base64
import dataclasses
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as policies

from jax_transformer.config import ConfigError, TransformerConfig
from jax_transformer.data import Tokenizer

FORMAT_VERSION = 2
READABLE_FORMATS = (1, 2)
CHECKPOINT_SUBDIR = "checkpoints"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, unreadable or does not fit what it is loaded into; the message says which."""


def find_checkpoint_dir(path: str | os.PathLike) -> Path:
    """The orbax directory for a user-given path: `<path>/checkpoints` if that exists (a run directory),
    else `path` itself (already a checkpoints folder)."""
    path = Path(path).absolute()
    return path / CHECKPOINT_SUBDIR if (path / CHECKPOINT_SUBDIR).is_dir() else path


def check_config(saved: TransformerConfig, requested: TransformerConfig, where: str = "checkpoint") -> None:
    """Raises ConfigError naming every field in which `requested` differs from the config `saved` with."""
    diff = saved.diff(requested)
    if diff:
        fields = "; ".join(f"{name!r}: {where} has {a!r}, requested {b!r}" for name, (a, b) in sorted(diff.items()))
        raise ConfigError(f"model config does not match the {where}: {fields}")


@dataclasses.dataclass
class Checkpoint:
    """One restored step. `state` is the saved train state as a nested dict of numpy arrays
    (`jax_transformer.training.restore_train_state` rebuilds the TrainState from it)."""

    directory: Path
    step: int
    state: dict[str, Any]
    config: TransformerConfig
    optim: dict[str, Any]
    tokenizer: Tokenizer
    data_state: dict[str, int] | None
    run: dict[str, Any]
    format: int = FORMAT_VERSION
    loop_state: dict[str, Any] | None = None  # the run loop's state (trainer.EarlyStopping); None before it existed

    @property
    def params(self):
        return self.state["params"]


class _QuietUnscoredSaves(logging.Filter):
    """orbax warns on every save without metrics when a best_fn is set; periodic saves have none by design."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "did not provide metrics" not in record.getMessage()


logging.getLogger("absl").addFilter(_QuietUnscoredSaves())


def _score(metrics: Mapping[str, Any]) -> float:
    return float(metrics["score"])


class CheckpointManager:
    """Saves and restores a run's checkpoints (see the module docstring). `keep` last steps are kept, plus the
    best by `metrics["score"]` (higher is better) among the steps saved with metrics."""

    def __init__(
        self, directory: str | os.PathLike, *, keep: int = 3, read_only: bool = False, async_save: bool = True
    ) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.directory = Path(directory).absolute()
        if read_only and not self.directory.is_dir():
            raise CheckpointError(f"{self.directory}: no checkpoint directory here")
        keep_policy = (
            None
            if read_only
            else policies.AnyPreservationPolicy(
                [
                    policies.LatestN(keep),
                    policies.BestN(get_metric_fn=_score, n=1, keep_checkpoints_without_metrics=False),
                ]
            )
        )
        options = ocp.CheckpointManagerOptions(
            preservation_policy=keep_policy,
            best_fn=_score,
            best_mode="max",
            read_only=read_only,
            enable_async_checkpointing=async_save,
            create=not read_only,
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"))

    # --- which steps exist ---------------------------------------------------------------------------------
    def steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def best_step(self) -> int | None:
        """The step with the highest validation score; the latest step when none was saved with a score."""
        best = self._manager.best_step()
        return self.latest_step() if best is None else best

    def resolve_step(self, step: int | str = "best") -> int:
        """ "best", "latest" or a step number -> a saved step number (CheckpointError if there is none)."""
        steps = self.steps()
        if not steps:
            raise CheckpointError(f"{self.directory}: no complete checkpoint found")
        if step == "latest":
            return self.latest_step()
        if step == "best":
            return self.best_step()
        try:
            step = int(step)
        except (TypeError, ValueError):
            raise CheckpointError(f"checkpoint step must be 'best', 'latest' or a number, got {step!r}") from None
        if step not in steps:
            raise CheckpointError(f"{self.directory}: no checkpoint for step {step}; saved steps are {steps}")
        return step

    # --- saving --------------------------------------------------------------------------------------------
    def save(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        config: TransformerConfig,
        optim: Mapping[str, Any],
        tokenizer: Tokenizer,
        data_state: Mapping[str, int] | None = None,
        run: Mapping[str, Any] | None = None,
        metrics: Mapping[str, float] | None = None,
        loop_state: Mapping[str, Any] | None = None,
    ) -> None:
        """Saves `state` (a nested dict of arrays: `training.state_for_saving(train_state)`) as `step`,
        asynchronously. `metrics` needs a "score" (higher is better) to take part in the choice of the best step.
        `loop_state`: JSON the run loop restores on resume (this module does not read it)."""
        self._manager.wait_until_finished()  # one save at a time: the previous one is on disk before the next
        # A host copy: the training step donates the device buffers of the live state, so the background
        # writer must not read them.
        host_state = jax.device_get(state)
        meta = {
            "format": FORMAT_VERSION,
            "step": int(step),
            "config": config.to_dict(),
            "optim": dict(optim),
            "data_state": None if data_state is None else dict(data_state),
            "run": dict(run or {}),
            "loop_state": None if loop_state is None else dict(loop_state),
            "tokenizer": base64.b64encode(tokenizer.to_bytes()).decode("ascii"),
        }
        self._manager.save(
            int(step),
            args=ocp.args.Composite(state=ocp.args.StandardSave(host_state), meta=ocp.args.JsonSave(meta)),
            metrics=None if metrics is None else {k: float(v) for k, v in metrics.items()},
            force=True,
        )

    def wait(self) -> None:
        """Blocks until every started save is complete on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()

    # --- restoring -----------------------------------------------------------------------------------------
    def read_meta(self, step: int | str = "latest") -> dict[str, Any]:
        """The JSON metadata of a step (config, optimiser, data position, run settings), without the state."""
        step = self.resolve_step(step)
        try:
            return self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        except Exception as e:  # orbax raises several types for unreadable files
            raise CheckpointError(f"{self.directory} step {step}: cannot read metadata: {e}") from None

    def restore(self, step: int | str = "latest", *, expected_config: TransformerConfig | None = None) -> Checkpoint:
        """Loads a step. With `expected_config`, a different saved config is a ConfigError naming the fields."""
        step = self.resolve_step(step)
        meta = self.read_meta(step)
        if meta.get("format") not in READABLE_FORMATS:
            raise CheckpointError(
                f"{self.directory} step {step}: checkpoint format {meta.get('format')!r}, this "
                f"code reads formats {READABLE_FORMATS}"
            )
        config = TransformerConfig.from_dict(meta["config"], source=f"{self.directory} step {step} config")
        if expected_config is not None:
            check_config(config, expected_config, where=f"checkpoint {self.directory} (step {step})")
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
        except Exception as e:
            raise CheckpointError(f"{self.directory} step {step}: cannot read the saved state: {e}") from None
        state = jax.tree_util.tree_map(np.asarray, restored["state"])
        tokenizer = Tokenizer.from_bytes(base64.b64decode(meta["tokenizer"]))
        return Checkpoint(
            directory=self.directory,
            step=step,
            state=state,
            config=config,
            optim=meta["optim"],
            tokenizer=tokenizer,
            data_state=meta.get("data_state"),
            run=meta.get("run", {}),
            format=meta["format"],
            loop_state=meta.get("loop_state"),
        )


def load(
    path: str | os.PathLike, step: int | str = "best", *, expected_config: TransformerConfig | None = None
) -> Checkpoint:
    """Loads one step of a run directory (or its `checkpoints` folder) for evaluation, translation or export."""
    manager = CheckpointManager(find_checkpoint_dir(path), read_only=True)
    try:
        return manager.restore(step, expected_config=expected_config)
    finally:
        manager.close()
