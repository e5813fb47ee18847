"""Checkpoints with orbax: a training run saved so that it resumes exactly, or translates. Each step is written
atomically, with the train state's arrays, the config, optimiser settings, tokenizer, data position and run
settings, and a checksum of every array (one that any split of it over devices computes alike), checked on every
restore (a weights-only one checks the parameters'); a damaged step is an error naming the file at fault, and a
resume falls back to the newest step that verifies. Arrays split over devices are written and read as they lie.
Layout, formats and integrity: docs/internals.md#checkpoint."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import time
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint import checkpoint_managers as policies

from jax_transformer.data.tokenizer import Tokenizer, load_tokenizer
from jax_transformer.errors import CheckpointError, ConfigError
from jax_transformer.model.dropout import fmix32
from jax_transformer.settings.config import COMPUTE_FIELDS, TransformerConfig

FORMAT_VERSION = 4
READABLE_FORMATS = (1, 2, 3, 4)
CHECKSUM_FORMATS = (3, 4)  # formats whose steps carry checksums: SHA-256 (3), element sums (4: `array_sums`)
CHECKPOINT_SUBDIR = "checkpoints"
DAMAGED_SUFFIX = "-damaged"  # <run>/checkpoints-damaged/<step>: where `quarantine` moves damaged steps
# orbax writes a step into "<step>.orbax-checkpoint-tmp..." and renames it to "<step>" when complete.
PARTIAL_SAVE = re.compile(r"\d+\.orbax-checkpoint-tmp.*")


# Where a restore puts each array: (its name, "params/encoder/...", and its shape) -> a jax.sharding.Sharding.
Placement = Callable[[str, tuple[int, ...]], jax.sharding.Sharding]


def find_checkpoint_dir(path: str | os.PathLike) -> Path:
    """The orbax directory for a user-given path: `<path>/checkpoints` if that exists (a run directory),
    else `path` itself (already a checkpoints folder)."""
    path = Path(path).absolute()
    return path / CHECKPOINT_SUBDIR if (path / CHECKPOINT_SUBDIR).is_dir() else path


def check_config(saved: TransformerConfig, requested: TransformerConfig, where: str = "checkpoint") -> None:
    """Raises ConfigError naming every field in which `requested` differs from the config `saved` with. The
    COMPUTE_FIELDS (dtype, attention kernel) are not compared: any parameters of the model serve every value."""
    diff = {name: values for name, values in saved.diff(requested).items() if name not in COMPUTE_FIELDS}
    if diff:
        fields = "; ".join(f"{name!r}: {where} has {a!r}, requested {b!r}" for name, (a, b) in sorted(diff.items()))
        raise ConfigError(f"model config does not match the {where}: {fields}")


@dataclasses.dataclass
class Checkpoint:
    """One restored step. `state` is the saved train state as a nested dict of numpy arrays, or of jax.Arrays
    where a restore's `placement` put them (`jax_transformer.training.trainer.restore_train_state` rebuilds the
    TrainState from it)."""

    directory: Path
    step: int
    state: dict[str, Any]
    config: TransformerConfig
    optim: dict[str, Any]
    tokenizer: Tokenizer
    data_state: dict[str, int] | None
    run: dict[str, Any]
    format: int = FORMAT_VERSION
    verified: bool = True  # checksums compared; False for formats 1 and 2, which have none
    loop_state: dict[str, Any] | None = None  # the run loop's state (trainer.EarlyStopping); None before it existed

    @property
    def params(self):
        return self.state["params"]

    def with_params(self, params) -> Checkpoint:
        """This step with other parameters (quantized ones, at load), in memory."""
        return dataclasses.replace(self, state={**self.state, "params": params})


# =============================================================================================================
# Checksums
# =============================================================================================================


def _array_name(path) -> str:
    """A pytree path as "params/encoder/layer_0/..." (dict keys; list or tuple indices as numbers)."""
    return "/".join(str(getattr(key, "key", getattr(key, "idx", key))) for key in path)


def array_checksums(state: Mapping[str, Any]) -> dict[str, str]:
    """{array name: "sha256:<hex>"} of every array of a state tree; the hash covers dtype, shape and bytes. What
    format-3 steps carry; format 4 carries `array_sums`."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        array = np.ascontiguousarray(np.asarray(leaf))
        digest = hashlib.sha256(f"{array.dtype.str}{array.shape}".encode())
        digest.update(array.data if array.size else b"")
        out[_array_name(path)] = "sha256:" + digest.hexdigest()
    return out


# A step's arrays may be split over devices and processes, and read back onto another split: their checksum must
# come out the same from any split, without gathering an array anywhere (SHA-256 needs the bytes in order on one
# host; no library checksums a sharded array). So an array's checksum is a sum, over its elements, of a 64-bit
# hash of (position, bits) (MurmurHash3's finaliser, `dropout.fmix32`): sums do not depend on order, so each device
# sums its own shard and the compiler adds the shards' sums exactly (integers wrap). A change of any one element
# always changes it (at each position the hash is a bijection of the bits); random damage to several goes unseen
# with a chance of 2^-64.


def _hash(bits, position):
    """(low, high): the two 32-bit halves of the hash of elements (uint32 words) at row-major `position`s; of numpy
    arrays or of jax's, alike (uint32 products wrap in both)."""
    low = fmix32(bits + position * np.uint32(0x9E3779B1))
    high = fmix32((bits ^ np.uint32(0x5BD1E995)) + position * np.uint32(0x7FEB352D) + np.uint32(1))
    return low, high


@jax.jit
def _device_sums(x: jax.Array) -> jax.Array:
    """(2,) uint32: an array's sums, computed on the devices that hold it (the compiler adds the shards')."""
    if x.dtype == jnp.bool_:
        bits = x.astype(jnp.uint32)
    else:
        bits = jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))
        bits = bits.astype(jnp.uint32) if x.dtype.itemsize < 4 else jax.lax.bitcast_convert_type(bits, jnp.uint32)
    position, stride = jnp.zeros(bits.shape, jnp.uint32), 1  # the row-major index (mod 2^32), without a reshape
    for axis in reversed(range(bits.ndim)):
        position = position + jax.lax.broadcasted_iota(jnp.uint32, bits.shape, axis) * jnp.uint32(stride % 2**32)
        stride *= bits.shape[axis]
    low, high = _hash(bits, position)
    return jnp.stack([jnp.sum(low, dtype=jnp.uint32), jnp.sum(high, dtype=jnp.uint32)])


_SMALL = 1 << 14  # a host array of fewer elements is summed by numpy (faster than calling a program)
_CHUNKS = (1 << 16, 1 << 18, 1 << 20)  # a larger one in flat chunks of one of these lengths: three programs


@jax.jit
def _chunk_sums(bits: jax.Array, start: jax.Array, count: jax.Array) -> jax.Array:
    """(2,) uint32: the sums of the first `count` words of a flat chunk whose first word is at `start`."""
    offset = jax.lax.iota(jnp.uint32, bits.shape[0])
    low, high = _hash(bits, start + offset)
    low, high = (jnp.where(offset < count, half, jnp.uint32(0)) for half in (low, high))
    return jnp.stack([jnp.sum(low, dtype=jnp.uint32), jnp.sum(high, dtype=jnp.uint32)])


def _host_sums(array: np.ndarray) -> np.ndarray:
    """`_device_sums` of a host array, on the host's CPU: by numpy when small, else in fixed-length chunks (a program
    per chunk length, not one per array shape)."""
    array = np.ascontiguousarray(array)
    if array.dtype == np.bool_:
        words = array.astype(np.uint32)
    elif array.dtype.itemsize < 4:
        words = array.view(f"u{array.dtype.itemsize}").astype(np.uint32)
    else:  # 8-byte elements as two words each, as jax's bitcast splits them
        words = array.view(np.uint32)
    words = words.reshape(-1)
    cpu = _host_cpu()
    if words.size < _SMALL or cpu is None:  # numpy (in chunks, to bound its temporaries) where there is no CPU backend
        total = np.zeros(2, np.uint32)
        for start in range(0, words.size, _CHUNKS[-1]):
            chunk = words[start : start + _CHUNKS[-1]]
            low, high = _hash(chunk, np.arange(start, start + chunk.size, dtype=np.uint64).astype(np.uint32))
            total += np.array([low.sum(dtype=np.uint32), high.sum(dtype=np.uint32)], np.uint32)
        return total
    length = next((c for c in _CHUNKS if words.size <= c), _CHUNKS[-1])
    parts = []
    for start in range(0, max(words.size, 1), length):
        chunk = words[start : start + length]
        count = chunk.size
        if count < length:
            chunk = np.concatenate([chunk, np.zeros(length - count, np.uint32)])
        parts.append(_chunk_sums(jax.device_put(chunk, cpu), np.uint32(start % 2**32), np.uint32(count)))
    return np.sum(np.stack(jax.device_get(parts)), axis=0, dtype=np.uint32)  # wraps, as the device's sums do


def _host_cpu() -> jax.Device | None:
    """This process's own CPU device (another process's cannot run its programs); None where JAX was started
    without the CPU backend (JAX_PLATFORMS=cuda, say)."""
    try:
        return jax.local_devices(backend="cpu")[0]
    except RuntimeError:
        return None


def _on_one_cpu(leaf: jax.Array) -> bool:
    return len(leaf.devices()) == 1 and next(iter(leaf.devices())).platform == "cpu"


def array_sum(leaf) -> str:
    """ "sum64:<hex>" of one array (numpy, or a jax.Array laid out in any way, in any number of processes): its
    dtype, shape and element sums (above)."""
    header = f"{np.dtype(leaf.dtype).name}{tuple(np.shape(leaf))}".encode()
    if isinstance(leaf, jax.Array) and not _on_one_cpu(leaf):
        words = np.asarray(_device_sums(leaf).addressable_data(0))  # replicated: every process holds the (2,)
    else:  # numpy, or a CPU device's array, viewed without a copy: the same three programs for every shape
        words = _host_sums(np.asarray(leaf))
    digest = hashlib.sha256(header + words.tobytes())
    return "sum64:" + digest.hexdigest()[:32]


def array_sums(state: Mapping[str, Any]) -> dict[str, str]:
    """{array name: `array_sum`} of every array of a state tree: what format-4 steps carry."""
    return {_array_name(path): array_sum(leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]}


def _meta_checksum(meta: Mapping[str, Any]) -> str:
    """The checksum of the metadata itself, over everything but the checksums."""
    body = {k: v for k, v in meta.items() if k != "checksums"}
    return "sha256:" + hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


# The source files and lines a tensorstore error passed through, which some of its versions append after the reason
# (as a bracketed payload or bare): no use to a reader, and they would push the reason out of a shortened message.
_SOURCE_LINES = re.compile(r"\[[^\[\]]*\.cc:\d+[^\[\]]*\]|\S+\.cc:\d+")


def _short(error: BaseException, limit: int = 400) -> str:
    """An orbax / tensorstore error as one readable line, without the whole JSON spec and source lines their
    messages carry; when long, its start and its end (where tensorstore puts the operating system's reason, e.g.
    "File too large")."""
    text = str(error).split(" [tensorstore_spec=")[0]
    text = " ".join(_SOURCE_LINES.sub(" ", text).split()) or type(error).__name__
    return text if len(text) <= limit else f"{text[: limit - 150]} ... {text[-150:]}"


def partial_saves(directory: str | os.PathLike) -> list[Path]:
    """Half-written step folders in a checkpoint directory: saves that a kill or a failure interrupted. orbax
    never lists them as steps; `jax_transformer.training.run` reports and removes them when it resumes."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir() if PARTIAL_SAVE.fullmatch(p.name))


def committed_steps(directory: str | os.PathLike) -> list[int]:
    """The step folders on disk (complete saves, intact or not), read afresh from the directory."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit() and p.is_dir())


class _QuietExpectedWarnings(logging.Filter):
    """orbax's warnings about what this module does on purpose: a save without metrics when a best_fn is set
    (periodic saves have none by design), a manager opened read-only (every translate, evaluate and export
    opens one), the numpy handler registered below in place of its own, and a step folder without orbax's
    metadata file (an empty or damaged step, which `restore` reports as damaged, naming it)."""

    EXPECTED = (
        "did not provide metrics",
        "Given directory is read only",
        "read_only=True, setting save_interval",
        "overriding np.ndarray",
        "Metadata file does not exist",
    )

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(text in record.getMessage() for text in self.EXPECTED)


class _NoBackgroundTracebacks(logging.Filter):
    """A failed asynchronous save makes orbax's background threads log the same exception, with its traceback,
    several times over; `CheckpointManager` re-raises it as one CheckpointError (orbax hands every background
    failure to `wait_until_finished`), so orbax's error records that carry a traceback are dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno >= logging.ERROR and record.exc_info and "orbax" in record.pathname)


_ORBAX_CODE = os.path.dirname(ocp.__file__) + os.sep  # where an exception raised in orbax's code has a frame


class _NoUnaskedWriteErrors(logging.Filter):
    """The array writes of a failed save fail together (OCDBT puts many arrays in one file). orbax hands the first
    failure to `wait_until_finished` (one CheckpointError here) and may leave the others in asyncio tasks nobody
    asks, which asyncio logs, traceback and all, when they are collected: in some runs, not in others. Such a
    record is dropped when its exception was raised in orbax's code; a record of any other task is kept."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if error is None or "exception was never retrieved" not in record.getMessage():
            return True
        frames = traceback.walk_tb(error.__traceback__)
        return not any(frame.f_code.co_filename.startswith(_ORBAX_CODE) for frame, _ in frames)


logging.getLogger("absl").addFilter(_QuietExpectedWarnings())
logging.getLogger("absl").addFilter(_NoBackgroundTracebacks())
logging.getLogger("asyncio").addFilter(_NoUnaskedWriteErrors())

# Orbax deep-copies every numpy array it is given to save; `CheckpointManager.save` makes the one copy a save needs
# itself, so the handler's second copy (the whole model again, in memory while it writes) is turned off.
ocp.type_handlers.register_type_handler(
    np.ndarray, ocp.type_handlers.NumpyHandler(deepcopy_host_arrays=False), override=True
)


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
        self._async = async_save
        self._pending: int | None = None  # the step being written in the background
        self._failed = False  # a failed save was reported: later waits do not report it again

    # --- which steps exist ---------------------------------------------------------------------------------
    def steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def best_step(self) -> int | None:
        """The step with the highest validation score; the latest step when none was saved with a score."""
        best = self.scored_best_step()
        return self.latest_step() if best is None else best

    def scored_best_step(self) -> int | None:
        """The step with the highest validation score; None when no step was saved with a score."""
        return self._manager.best_step()

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
        asynchronously. An array split over devices (and processes) is written as it lies: each process writes
        its own shards, and nothing is gathered. `metrics` needs a "score" (higher is better) to take part in the
        choice of the best step. `loop_state`: JSON the run loop restores on resume (this module does not read it).
        A failure of this save or of the previous one is a CheckpointError (see `_save_failed`)."""
        self._finish_pending()  # one save at a time: the previous one is on disk before the next
        # An asynchronous save writes its own host copy: the training step may donate the live state's buffers
        # (which a CPU array's host view shares) while the writer reads. A synchronous one writes the arrays as
        # they are, so that an import holds the weights once, not twice, while writing.
        host_state = jax.tree.map(lambda x: _for_writing(x, copy=self._async), state)
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
        meta["checksums"] = {"arrays": array_sums(host_state), "meta": _meta_checksum(meta)}
        self._pending = int(step)
        try:
            self._manager.save(
                int(step),
                args=ocp.args.Composite(state=ocp.args.StandardSave(host_state), meta=ocp.args.JsonSave(meta)),
                metrics=None if metrics is None else {k: float(v) for k, v in metrics.items()},
                force=True,
            )
        except Exception as e:  # orbax raises OSError, ValueError (tensorstore) ... for a failed write
            raise self._save_failed(e) from None

    def _finish_pending(self) -> None:
        """Waits for the background save; its failure becomes a CheckpointError (reported once)."""
        try:
            self._manager.wait_until_finished()
        except Exception as e:
            if self._failed:
                return
            raise self._save_failed(e) from None
        self._pending = None

    def _save_failed(self, error: BaseException) -> CheckpointError:
        """The error of a failed save: what failed, that nothing of it counts, and the newest intact step."""
        step, self._pending, self._failed = self._pending, None, True
        intact = newest_intact_step(self.directory, before=step)
        keep = (
            f"the newest intact checkpoint is step {intact} ({self.directory / str(intact)})"
            if intact is not None
            else "there is no earlier intact checkpoint"
        )
        return CheckpointError(
            f"saving checkpoint step {step} in {self.directory} failed: {_short(error)}. Nothing of step {step} is "
            f"taken for a checkpoint (orbax renames a step's folder only once it is complete); {keep}"
        )

    def wait(self) -> None:
        """Blocks until every started save is complete on disk (CheckpointError if one failed)."""
        self._finish_pending()

    def close(self) -> None:
        try:
            self._finish_pending()
        finally:
            self._manager.close()

    # --- restoring -----------------------------------------------------------------------------------------
    def read_meta(self, step: int | str = "latest") -> dict[str, Any]:
        """The JSON metadata of a step (config, optimiser, data position, run settings), without the state;
        its own checksum is verified when it has one (format 3)."""
        step = self.resolve_step(step)
        try:
            meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        except Exception as e:  # orbax raises several types for unreadable files
            raise self._damaged(
                step, f"cannot read its metadata ({self._item_dir(step, 'meta')}): {_short(e)}"
            ) from None
        if not isinstance(meta, dict):
            raise self._damaged(step, f"its metadata is not a JSON object: {str(meta)[:80]!r}")
        checksums = meta.get("checksums")
        if checksums is not None and (not isinstance(checksums, dict) or checksums.get("meta") != _meta_checksum(meta)):
            raise self._damaged(
                step, f"its metadata ({self._item_dir(step, 'meta')}) does not match the checksum stored with it"
            )
        return meta

    def _item_dir(self, step: int, item: str) -> Path:
        return self.directory / str(step) / item

    def _damaged(self, step: int, reason: str) -> CheckpointError:
        return CheckpointError(f"checkpoint step {step} ({self.directory / str(step)}) is damaged: {reason}")

    def restore(
        self,
        step: int | str = "latest",
        *,
        expected_config: TransformerConfig | None = None,
        weights_only: bool = False,
        placement: Placement | None = None,
    ) -> Checkpoint:
        """Loads a step and verifies its checksums (CheckpointError naming what is damaged). With
        `expected_config`, a different saved config is a ConfigError naming the fields. `weights_only`: the
        parameters alone (`state` is {"params": ...}), verified against their own checksums: what translating,
        evaluating, exporting or starting from the weights reads, without the optimizer's state (Adam's two
        moments, twice the parameters' bytes). Damage there shows when a run resumes from the step. `placement`:
        each array read straight onto the devices `placement(name, shape)` names (each process reads only its own
        shards; the layout it was saved with does not matter), and verified there (a step of an older format: read
        onto the host, verified, then placed); without it, numpy arrays."""
        step = self.resolve_step(step)
        meta = self.read_meta(step)
        if meta.get("format") not in READABLE_FORMATS:
            raise CheckpointError(
                f"{self.directory} step {step}: checkpoint format {meta.get('format')!r}, this "
                f"code reads formats {READABLE_FORMATS}"
            )
        verified = meta["format"] in CHECKSUM_FORMATS
        # Before format 4 (SHA-256 of whole arrays, or no checksums): read whole onto the host, placed once verified.
        place_after, placement = (placement, None) if meta["format"] < 4 else (None, placement)
        if verified and not isinstance(meta.get("checksums"), dict):
            raise self._damaged(step, "its metadata has no checksums, which every format-3 step has")
        try:
            config = TransformerConfig.from_dict(meta["config"], source=f"{self.directory} step {step} config")
            tokenizer = load_tokenizer(
                base64.b64decode(meta["tokenizer"]), source=f"{self.directory} step {step} tokenizer"
            )
        except (KeyError, ValueError, TypeError) as e:  # possible only for unverified (format 1, 2) metadata
            raise self._damaged(step, f"its metadata cannot be read: {_short(e)}") from None
        if expected_config is not None:
            check_config(config, expected_config, where=f"checkpoint {self.directory} (step {step})")
        try:
            state, failure = (
                _restore_state(self._item_dir(step, "state"), params_only=weights_only, placement=placement),
                None,
            )
        except Exception as e:
            if "RESOURCE_EXHAUSTED" in str(e):  # out of memory: not damage (a resume would move the step aside)
                raise
            state, failure = None, e
        if placement is not None and _failed_anywhere(failure is not None):
            failure = failure or RuntimeError("another process could not read its shards of it")
        if failure is not None:
            raise self._damaged(
                step, f"cannot read the saved state ({self._item_dir(step, 'state')}): {_short(failure)}"
            ) from None
        if verified:
            expected = meta["checksums"].get("arrays", {})
            if weights_only:
                expected = {name: digest for name, digest in expected.items() if name.startswith("params/")}
            self._verify_arrays(step, state, expected)
        if place_after is not None:
            state = jax.tree_util.tree_map_with_path(
                lambda path, x: jax.device_put(x, place_after(_array_name(path), x.shape)), state
            )
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
            verified=verified,
            loop_state=meta.get("loop_state"),
        )

    def _verify_arrays(self, step: int, state, expected: Mapping[str, str]) -> None:
        sha = any(digest.startswith("sha256:") for digest in expected.values())  # a format-3 step
        found = array_checksums(state) if sha else array_sums(state)
        problems = [f"{name} is missing" for name in sorted(set(expected) - set(found))]
        problems += [f"{name} was not saved" for name in sorted(set(found) - set(expected))]
        problems += [
            f"{name} does not match its checksum"
            for name in sorted(set(found) & set(expected))
            if found[name] != expected[name]
        ]
        if problems:
            more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
            raise self._damaged(
                step,
                f"in {self._item_dir(step, 'state')}, array {'; array '.join(problems[:3])}{more}: its files changed "
                f"after they were written",
            )


def newest_intact_step(directory: str | os.PathLike, *, before: int | None = None) -> int | None:
    """The newest step (below `before`, if given) that restores and verifies; None if there is none."""
    for step in reversed(committed_steps(directory)):
        if before is not None and step >= before:
            continue
        try:
            load(directory, step)
        except (CheckpointError, ConfigError):
            continue
        return step
    return None


def newest_intact(
    path: str | os.PathLike, *, strict: bool = False, placement: Placement | None = None
) -> tuple[Checkpoint, list[tuple[int, CheckpointError]]]:
    """The newest step of a run that restores and verifies, for a resume, and the newer steps that did not,
    each with its error. strict: the newest step must be intact (CheckpointError otherwise, naming it and the
    step a fallback would take). placement: as `CheckpointManager.restore`'s."""
    directory = find_checkpoint_dir(path)
    steps = committed_steps(directory)
    if not steps:
        raise CheckpointError(f"{directory}: no complete checkpoint found")
    damaged: list[tuple[int, CheckpointError]] = []
    for step in reversed(steps):
        try:
            restored = load(directory, step, placement=placement)
        except CheckpointError as e:
            damaged.append((step, e))
            continue
        if strict and damaged:
            raise CheckpointError(
                f"{damaged[0][1]}. --strict-resume: not falling back to step {step}, the newest intact checkpoint "
                f"(leave out --strict-resume to continue from it)"
            )
        return restored, damaged
    raise CheckpointError(f"{directory}: none of the {len(steps)} checkpoint(s) is intact; the newest: {damaged[0][1]}")


def quarantine(directory: str | os.PathLike, step: int) -> Path:
    """Moves a damaged step folder out of the checkpoint directory, to `<directory>-damaged/<step>` (kept for a
    look, never loaded), so that the step can be saved again. Returns the new place."""
    directory = Path(directory)
    target = directory.with_name(directory.name + DAMAGED_SUFFIX) / str(step)
    if target.exists():
        target = target.with_name(f"{step}-{time.strftime('%Y%m%d-%H%M%S')}")
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(str(directory / str(step)), str(target))
    return target


def discard_partial_saves(directory: str | os.PathLike) -> list[Path]:
    """Removes the half-written folders `partial_saves` lists (a resume does, and says so: they hold nothing a
    run can use, and can be large). Returns what it removed."""
    removed = partial_saves(directory)
    for path in removed:
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    return removed


def load(
    path: str | os.PathLike,
    step: int | str = "best",
    *,
    expected_config: TransformerConfig | None = None,
    weights_only: bool = False,
    placement: Placement | None = None,
) -> Checkpoint:
    """Loads one step of a run directory (or its `checkpoints` folder) for evaluation, translation or export,
    verified: a damaged step is a CheckpointError naming it (see the module docstring). `weights_only`: the
    parameters alone; `placement`: onto devices (CheckpointManager.restore)."""
    manager = CheckpointManager(find_checkpoint_dir(path), read_only=True)
    try:
        return manager.restore(step, expected_config=expected_config, weights_only=weights_only, placement=placement)
    finally:
        manager.close()


def _failed_anywhere(failed: bool) -> bool:
    """Whether a read failed in any process: with `placement` each process reads only its own shards, so damage in
    one part shows in one process, and all must give up the step together (the checksums that follow are
    collective)."""
    if jax.process_count() == 1:
        return failed
    from jax.experimental import multihost_utils

    return bool(np.any(multihost_utils.process_allgather(np.array([failed]))))


def _restore_state(state_dir: Path, *, params_only: bool, placement: Placement | None) -> dict[str, Any]:
    """A step's `state` item as numpy arrays, or as jax.Arrays where `placement` puts them; `params_only`: {"params":
    ...} alone, the rest left unread (orbax's partial restore of the subtree its metadata describes)."""
    if not state_dir.is_dir():
        raise FileNotFoundError(f'Item "state" was not found: no folder {state_dir}')
    checkpointer = ocp.PyTreeCheckpointer()
    try:
        # The handler's own metadata: the checkpointer's would also look for a step's metadata file inside the
        # item (a warning each time) and turn an unreadable one into None instead of its error.
        tree = checkpointer.handler.metadata(epath.Path(state_dir)).tree
        if params_only:
            if "params" not in tree:
                raise KeyError(f"the saved state has no parameters (it holds {sorted(tree)})")
            tree = {"params": tree["params"]}
        item = jax.tree_util.tree_map(lambda m: np.empty(m.shape, m.dtype), tree)

        def how(path, m):
            if placement is None or (np.dtype(m.dtype).itemsize == 8 and not jax.config.jax_enable_x64):
                return ocp.RestoreArgs(restore_type=np.ndarray)  # (jax's 32-bit mode would narrow 8-byte arrays)
            return ocp.ArrayRestoreArgs(sharding=placement(_array_name(path), tuple(m.shape)), dtype=m.dtype)

        restore_args = jax.tree_util.tree_map_with_path(how, item)
        args = ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=params_only)
        return checkpointer.restore(state_dir, args=args)
    finally:
        checkpointer.close()


def _for_writing(leaf, *, copy: bool):
    """An array as a save hands it to orbax. orbax copies a device array's shards to the host before `save`
    returns; a CPU device's copy is a view of the array's buffer, which a donating step may overwrite while an
    asynchronous save still writes it: there (`copy`) the save writes a copy of its own."""
    if isinstance(leaf, jax.Array):
        on_cpu = next(iter(leaf.devices())).platform == "cpu"
        return jnp.copy(leaf) if copy and on_cpu else leaf
    return np.array(leaf, copy=copy or None)


def saved_config(directory: str | os.PathLike, step: int | str = "latest") -> TransformerConfig:
    """The model a run directory (or its checkpoints folder) saved at `step`, read from its metadata alone."""
    manager = CheckpointManager(find_checkpoint_dir(directory), read_only=True)
    return TransformerConfig.from_dict(manager.read_meta(step)["config"], source=str(directory))
