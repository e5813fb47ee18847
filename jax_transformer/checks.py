"""Token ids and shapes checked where they enter the model, so that bad input is an error naming the array, the
position and the limit (`TokenError`), not NaN logits or a silently wrong embedding row. On concrete arrays the
checks run on the host; under `jit`, lengths are checked while tracing and values by `checkify` debug checks that
are traced only inside `checked`. Where each check runs, and why: docs/internals.md#checks."""

from __future__ import annotations

import functools
import threading
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from jax_transformer.errors import TokenError
from jax_transformer.settings.config import TransformerConfig

SIDES = {"src": "source", "tgt_in": "target", "tgt_out": "target"}
# The packed-row keys, as `jax_transformer.training.trainer.PACKING_KEYS` names them (that module is above this one).
PACKING_KEYS = ("src_segments", "tgt_segments", "src_positions", "tgt_positions")
_VOCAB_FIELD = {"source": "src_vocab_size", "target": "tgt_vocab_size"}


def is_traced(x: Any) -> bool:
    """True for a jax tracer (inside jit, grad, vmap ...): its values cannot be read on the host."""
    return isinstance(x, jax.core.Tracer)


# =============================================================================================================
# Host checks (numpy)
# =============================================================================================================


def _integer_matrix(name: str, array: Any) -> np.ndarray:
    array = np.asarray(array)
    if array.ndim != 2:
        raise TokenError(f"{name} must have shape (batch, length), got shape {array.shape}")
    if not np.issubdtype(array.dtype, np.integer):
        raise TokenError(f"{name} must hold integer token ids, got dtype {array.dtype}")
    return array


def check_length(name: str, length: int, max_len: int, offset: int = 0) -> None:
    """A sequence of `length` positions starting at position `offset` must end within max_len positions."""
    if offset + length > max_len:
        where = f" starting at position {offset}" if offset else ""
        raise TokenError(f"{name} has length {length}{where}, more than config.max_len={max_len} positions")


def check_ids(name: str, array: Any, vocab_size: int, side: str = "") -> None:
    """Every id of the (B, L) integer array in [0, vocab_size); else a TokenError naming the first bad one."""
    array = _integer_matrix(name, array)
    bad = (array < 0) | (array >= vocab_size)
    if bad.any():
        r, c = np.argwhere(bad)[0]
        vocabulary = f"the {side} vocabulary" if side else "the vocabulary"
        raise TokenError(f"{name}[{r}, {c}] = {array[r, c]} is outside {vocabulary} [0, {vocab_size})")


def check_tokens(name: str, array: Any, config: TransformerConfig, side: str, *, positions_given: bool = False):
    """Ids of one side ("source" or "target") in its vocabulary and, unless packed positions are given (then
    the positions carry the limit), a length within max_len."""
    array = _integer_matrix(name, array)
    if not positions_given:
        check_length(name, array.shape[1], config.max_len)
    check_ids(name, array, getattr(config, _VOCAB_FIELD[side]), side)


def check_packing(
    tokens: Any, segments: Any, positions: Any, config: TransformerConfig, side: str, names: tuple[str, str, str]
) -> None:
    """One side of packed rows: segment ids and positions consistent with the tokens (see the module docstring).
    `names` = the names of (tokens, segments, positions) in messages."""
    tokens = _integer_matrix(names[0], tokens)
    arrays = {}
    for name, array in zip(names[1:], (segments, positions)):
        if array is None:
            continue
        array = _integer_matrix(name, array)
        if array.shape != tokens.shape:
            raise TokenError(f"{name} has shape {array.shape}, {names[0]} has {tokens.shape}: they must be equal")
        arrays[name] = array
    seg_name, pos_name = names[1], names[2]
    if pos_name in arrays:
        pos = arrays[pos_name]
        bad = (pos < 0) | (pos >= config.max_len)
        if bad.any():
            r, c = np.argwhere(bad)[0]
            raise TokenError(
                f"{pos_name}[{r}, {c}] = {pos[r, c]} is outside the positions [0, {config.max_len}) (config.max_len)"
            )
    if seg_name not in arrays:
        return
    seg = arrays[seg_name]
    real = tokens != config.pad_id
    if side == "target" and config.start_id == config.pad_id:
        # A decoder that starts from the pad id (Marian's) has a pad token at the start of every segment.
        real |= (seg != 0) & (seg != np.pad(seg[:, :-1], ((0, 0), (1, 0)), constant_values=-1))
    problems = [
        (seg < 0, "is negative"),
        (real & (seg == 0), f"is 0 (padding) under a real token {names[0]} != pad_id {config.pad_id}"),
        (~real & (seg != 0), f"is not 0 under a padding token (pad_id {config.pad_id})"),
    ]
    # Along a row the segments of real tokens never go back (1, 1, 2, 2, 2, 3, 0, 0).
    previous = np.maximum.accumulate(np.where(real, seg, 0), axis=1)
    problems.append((real & (seg < np.pad(previous[:, :-1], ((0, 0), (1, 0)))), "goes back to an earlier segment"))
    for bad, what in problems:
        if bad.any():
            r, c = np.argwhere(bad)[0]
            raise TokenError(f"{seg_name}[{r}, {c}] = {seg[r, c]} {what}")
    if pos_name in arrays:
        # Positions restart at 0 at each new segment and count up by one within it.
        pos = arrays[pos_name]
        starts = real & (seg != np.pad(seg[:, :-1], ((0, 0), (1, 0)), constant_values=-1))
        expected_prev = np.pad(pos[:, :-1], ((0, 0), (1, 0))) + 1
        bad = (starts & (pos != 0)) | (real & ~starts & (pos != expected_prev))
        if bad.any():
            r, c = np.argwhere(bad)[0]
            want = 0 if starts[r, c] else expected_prev[r, c]
            raise TokenError(
                f"{pos_name}[{r}, {c}] = {pos[r, c]}, expected {want}: positions restart at 0 at each "
                f"segment of {seg_name} and count up by one"
            )


def check_batch(batch: Mapping[str, Any], config: TransformerConfig, where: str = "batch") -> None:
    """A training or evaluation batch (src, tgt_in, tgt_out and, for packed rows, training.PACKING_KEYS):
    integer (B, L) arrays, one row count, tgt_in and tgt_out of one shape, ids in the vocabularies, lengths
    (or packed positions) within max_len, packing consistent. `where` prefixes the array names in messages."""
    missing = [key for key in SIDES if key not in batch]
    if missing:
        raise TokenError(f"{where} has no {missing} (it needs src, tgt_in and tgt_out)")
    name = lambda key: f"{where}[{key!r}]"  # noqa: E731
    # Only the model's inputs: a batch may carry other arrays (weights, indices) that are not token ids.
    arrays = {key: _integer_matrix(name(key), value) for key, value in batch.items() if key in (*SIDES, *PACKING_KEYS)}
    rows = {key: a.shape[0] for key, a in arrays.items()}
    if len(set(rows.values())) != 1:
        raise TokenError(f"{where}: the arrays have different numbers of rows: {rows}")
    if arrays["tgt_in"].shape != arrays["tgt_out"].shape:
        raise TokenError(
            f"{name('tgt_in')} has shape {arrays['tgt_in'].shape} but {name('tgt_out')} has "
            f"{arrays['tgt_out'].shape}: they must be equal (tgt_out is tgt_in shifted by one)"
        )
    for key, side in SIDES.items():
        prefix = "src" if key == "src" else "tgt"
        check_tokens(name(key), arrays[key], config, side, positions_given=f"{prefix}_positions" in arrays)
    for prefix, side in (("src", "source"), ("tgt", "target")):
        if f"{prefix}_segments" in arrays or f"{prefix}_positions" in arrays:
            tokens = "src" if prefix == "src" else "tgt_in"
            check_packing(
                arrays[tokens],
                arrays.get(f"{prefix}_segments"),
                arrays.get(f"{prefix}_positions"),
                config,
                side,
                (name(tokens), name(f"{prefix}_segments"), name(f"{prefix}_positions")),
            )
    if "src_segments" in arrays and "tgt_segments" in arrays:
        # Every target segment of a row has its source segment in that row: presence tables (B, S) per side.
        src_seg, tgt_seg = arrays["src_segments"], arrays["tgt_segments"]
        rows = np.arange(src_seg.shape[0])[:, None]
        width = int(max(src_seg.max(initial=0), tgt_seg.max(initial=0))) + 1
        src_has, tgt_has = np.zeros((len(rows), width), bool), np.zeros((len(rows), width), bool)
        src_has[rows, src_seg], tgt_has[rows, tgt_seg] = True, True
        orphans = tgt_has & ~src_has
        orphans[:, 0] = False  # padding
        if orphans.any():
            r, segment = np.argwhere(orphans)[0]
            raise TokenError(
                f"{name('tgt_segments')} row {r} has segment {segment}, which {name('src_segments')} row "
                f"{r} does not have: a target pair without its source"
            )


# =============================================================================================================
# Checks inside a traced function (checkify)
# =============================================================================================================


# How many `checkified` functions are being traced in this thread (compile-ahead traces in several threads).
_CHECKIFIED = threading.local()


def debug_checks_on() -> bool:
    """True while a function wrapped by `checkified` is being traced in this thread: the only time the model's
    debug checks are traced (see the module docstring for why not always)."""
    return getattr(_CHECKIFIED, "depth", 0) > 0


def debug_check(pred, message: str, **values) -> None:
    """`checkify.debug_check(pred, message, **values)` while `checkified` traces; nothing otherwise."""
    if debug_checks_on():
        from jax.experimental import checkify

        checkify.debug_check(pred, message, **values)


def debug_check_ids(name: str, array, vocab_size: int, side: str = "") -> None:
    """The id check of a traced (B, L) array as a debug check: traced only under `checkified`."""
    debug_check_range(name, array, vocab_size, f"the {side} vocabulary" if side else "the vocabulary")


def debug_check_range(name: str, array, limit: int, what: str) -> None:
    """Every entry of a traced (B, L) array in [0, limit), as a debug check: traced only under `checkified`."""
    if not debug_checks_on():
        return
    import jax.numpy as jnp

    bad = ((array < 0) | (array >= limit)).reshape(-1)
    first = jnp.argmax(bad)  # the first bad entry, row-major, as the host check reports
    debug_check(
        ~jnp.any(bad),
        f"{name}[{{row}}, {{column}}] = {{value}} is outside {what} [0, {limit})",
        row=first // array.shape[1],
        column=first % array.shape[1],
        value=array.reshape(-1)[first],
    )


def checkified(fn):
    """`fn` with the model's debug checks turned on: returns (error, outputs); call `error.throw()` (or
    `error.get()`) after it. Works under the caller's own `jit`; see the module docstring."""
    from jax.experimental import checkify

    @functools.wraps(fn)
    def traced_with_checks(*args, **kwargs):
        _CHECKIFIED.depth = getattr(_CHECKIFIED, "depth", 0) + 1
        try:
            return fn(*args, **kwargs)
        finally:
            _CHECKIFIED.depth -= 1

    return checkify.checkify(traced_with_checks, errors=checkify.user_checks)


# =============================================================================================================
# The model's entry points
# =============================================================================================================


def check_model_input(
    name: str, tokens, config: TransformerConfig, side: str, *, positions=None, segments=None, offset=0
) -> None:
    """What `Transformer.encode` / `decoder_hidden` check on their token input: host checks on concrete arrays;
    the shape at trace time and debug checks on tracers. `offset` is the decoding position (a tracer while
    decoding under jit, then only the debug check on the positions table applies)."""
    vocab = getattr(config, _VOCAB_FIELD[side])
    if len(np.shape(tokens)) != 2:
        raise TokenError(f"{name} must have shape (batch, length), got shape {np.shape(tokens)}")
    if positions is None and not is_traced(offset):
        check_length(name, np.shape(tokens)[1], config.max_len, int(offset))
    prefix = "src" if side == "source" else "tgt"
    if is_traced(tokens):
        debug_check_ids(name, tokens, vocab, side)
        if positions is not None and is_traced(positions):
            debug_check_range(f"{prefix}_positions", positions, config.max_len, "the positions")
        return
    if not np.issubdtype(np.asarray(tokens).dtype, np.integer):
        raise TokenError(f"{name} must hold integer token ids, got dtype {np.asarray(tokens).dtype}")
    check_ids(name, tokens, vocab, side)
    if (positions is not None and not is_traced(positions)) or (segments is not None and not is_traced(segments)):
        check_packing(
            tokens,
            None if segments is None or is_traced(segments) else segments,
            None if positions is None or is_traced(positions) else positions,
            config,
            side,
            (name, f"{prefix}_segments", f"{prefix}_positions"),
        )
