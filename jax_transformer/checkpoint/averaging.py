"""Checkpoint averaging, as fairseq's average_checkpoints.py: the elementwise mean of the parameters of a run's last
K checkpoints (summed in float64, rounded once), written as a run-like directory that evaluate, translate, export,
attention and verify read; it holds no optimiser state, so it cannot be resumed. docs/internals.md#averaging."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jax_transformer import files
from jax_transformer.checkpoint.manager import CheckpointManager, find_checkpoint_dir
from jax_transformer.errors import CheckpointError


def average_params(trees: list[Any]) -> Any:
    """The elementwise mean of parameter pytrees of one structure: float64 sums, rounded once to each leaf's dtype.

    Why float64: the sum of K float32 values is exact in float64 for any K < 2**29 when their exponents are close
    (as weights of one tensor at nearby steps are), and dividing by K then rounds once. A float32 running sum would
    round at every addition, so the mean of K identical checkpoints would not always be that checkpoint."""
    if not trees:
        raise ValueError("nothing to average")
    structure = jax.tree_util.tree_structure(trees[0])
    for i, tree in enumerate(trees[1:], start=1):
        if jax.tree_util.tree_structure(tree) != structure:
            raise ValueError(f"parameter tree {i} differs in structure from tree 0")
    leaves = [jax.tree_util.tree_leaves(tree) for tree in trees]
    averaged = []
    for index, first in enumerate(leaves[0]):
        total = np.zeros(np.shape(first), np.float64)
        for tree_leaves in leaves:
            total += np.asarray(tree_leaves[index], np.float64)
        averaged.append((total / len(trees)).astype(np.asarray(first).dtype))
    return jax.tree_util.tree_unflatten(structure, averaged)


def average_checkpoints(
    checkpoint: str | os.PathLike,
    last: int,
    output: str | os.PathLike,
    *,
    print_fn: Callable[[str], None] = print,
) -> tuple[Path, int, list[int]]:
    """Averages the parameters of the `last` newest saved steps of the run (directory) `checkpoint` into a new
    run-like directory `output` (see the module docstring). Returns (output, its step, the averaged steps).

    CheckpointError when the run has fewer steps saved than `last`, when the run directory is missing, or when
    the steps hold different model configs; ValueError for a bad `last` or an `output` that already holds files."""
    if isinstance(last, bool) or not isinstance(last, int) or last < 1:
        raise ValueError(f"--last must be an int >= 1, got {last!r}")
    source = Path(checkpoint)
    if not source.exists():
        raise CheckpointError(f"{source}: no such run directory")
    output = Path(output)
    if output.exists() and any(output.iterdir()):
        raise ValueError(f"--output {output} already exists and is not empty; choose a new directory")
    if output.absolute() == source.absolute() or find_checkpoint_dir(source) == output.absolute():
        raise ValueError("--output must be a new directory, not the run being averaged")

    manager = CheckpointManager(find_checkpoint_dir(source), read_only=True)
    try:
        saved = sorted(manager.steps())
        if len(saved) < last:
            raise CheckpointError(
                f"{manager.directory}: --last {last} asks for more checkpoints than the {len(saved)} saved "
                f"(steps {saved}); a run keeps its last --keep checkpoints (plus the best), so train with "
                f"--keep {last} or more to average {last}"
            )
        steps = saved[-last:]
        params, reference = [], None
        for step in steps:
            restored = manager.restore(step, weights_only=True)
            if reference is None:
                reference = restored
            elif restored.config != reference.config:
                raise CheckpointError(
                    f"{manager.directory}: step {step} holds a different model config from step {steps[0]} "
                    f"({sorted(restored.config.diff(reference.config))}); only checkpoints of one model average"
                )
            params.append(restored.params)
            print_fn(f"read step {step} ({len(params)} of {last})")
    finally:
        manager.close()

    averaged = average_params(params)
    run = {**reference.run, "averaged_from": {"run": str(manager.directory), "steps": steps}}
    out_manager = CheckpointManager(output / "checkpoints", keep=1, async_save=False)
    try:
        out_manager.save(
            steps[-1],
            {"step": np.asarray(steps[-1], np.int32), "params": averaged},
            config=reference.config,
            optim=reference.optim,
            tokenizer=reference.tokenizer,
            data_state=None,
            run=run,
        )
    finally:
        out_manager.close()
    reference.tokenizer.save(output / "tokenizer.model")
    files.write_text(output / "config.json", reference.config.to_json() + "\n")
    return output, steps[-1], steps
