"""Fast decoding: greedy and beam search over the model's key/value cache, each compiled whole (`jax.jit` around a
`lax.while_loop` that stops once every sentence is finished, or once so few are left that they go on alone in a
smaller batch: `decode_shrinking`). The same semantics as the PyTorch twin's `torch_reference/decoding.py`, which
must give the same tokens: fairseq's length limit, PAD and BOS never produced, GNMT's length penalty, fairseq's
rule for which ending hypotheses finish, ties to the lower index. The conventions in full:
docs/internals.md#decoding."""

from __future__ import annotations

import contextlib
import functools
import math
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_transformer import checks
from jax_transformer.checks import TokenError
from jax_transformer.compilation import exportable, jit_by_config
from jax_transformer.config import TransformerConfig
from jax_transformer.model import Transformer

DEFAULT_MAX_LEN_A = 1.5
DEFAULT_MAX_LEN_B = 10


# =============================================================================================================
# Lengths and scores: plain numpy, computed on the host (the PyTorch reference uses the same formulas)
# =============================================================================================================


def check_source(src: Any, config: TransformerConfig) -> np.ndarray:
    """`src` as an (B, S) int32 numpy array after checking it is a right-padded batch of valid source ids
    (`checks.TokenError`, a ValueError, naming the row and position otherwise)."""
    src = np.asarray(src)
    if src.ndim != 2 or src.shape[0] < 1 or src.shape[1] < 1:
        raise TokenError(f"src must have shape (batch, length) with both >= 1, got shape {src.shape}")
    checks.check_tokens("src", src, config, "source")
    real = src != config.pad_id
    # Right padding: once a row has a PAD, every later entry is PAD (the length is the count of real tokens).
    after_pad = real & (np.cumsum(~real, axis=1) > 0)
    if after_pad.any():
        r, c = np.argwhere(after_pad)[0]
        raise TokenError(
            f"src row {r} has token {src[r, c]} at position {c} after padding; "
            f"rows must be right-padded with pad_id={config.pad_id}"
        )
    return src.astype(np.int32)


def source_lengths(src: np.ndarray, pad_id: int) -> np.ndarray:
    """(B,) count of non-PAD tokens in each row (EOS included)."""
    return np.count_nonzero(np.asarray(src) != pad_id, axis=1)


def _length_limit(n: int, config: TransformerConfig, max_len_a: float, max_len_b: float) -> int:
    if n == 0:  # an all-PAD filler row: one step, so that it never holds up the early exit
        return 1
    return min(config.max_len, max(1, math.floor(max_len_a * n + max_len_b)))


def max_new_tokens(
    src: np.ndarray,
    config: TransformerConfig,
    max_len_a: float = DEFAULT_MAX_LEN_A,
    max_len_b: float = DEFAULT_MAX_LEN_B,
) -> np.ndarray:
    """(B,) int32: how many tokens (EOS included) each row may produce, from its source length n:
    min(config.max_len, max(1, floor(max_len_a * n + max_len_b))), and 1 for an all-PAD row (n = 0)."""
    return np.array(
        [_length_limit(int(n), config, max_len_a, max_len_b) for n in source_lengths(src, config.pad_id)],
        dtype=np.int32,
    )


def output_length(
    src_width: int,
    config: TransformerConfig,
    max_len_a: float = DEFAULT_MAX_LEN_A,
    max_len_b: float = DEFAULT_MAX_LEN_B,
) -> int:
    """Width L of the returned tokens: the limit of a row that fills all `src_width` positions."""
    return _length_limit(src_width, config, max_len_a, max_len_b)


def length_penalties(length: int, alpha: float) -> np.ndarray:
    """(length + 1,) float32 GNMT length penalty ((5 + l) / 6) ** alpha for l = 0..length (Wu et al. 2016),
    computed in float64 and rounded once, so both frameworks divide by the very same numbers."""
    return (((5.0 + np.arange(length + 1, dtype=np.float64)) / 6.0) ** alpha).astype(np.float32)


def _check_options(config: TransformerConfig, max_len_a, max_len_b, min_len, beam_size=1, alpha=0.0) -> None:
    if max_len_a < 0 or max_len_b < 0:
        raise ValueError(f"max_len_a and max_len_b must be >= 0, got {max_len_a} and {max_len_b}")
    if isinstance(min_len, bool) or not isinstance(min_len, (int, np.integer)) or min_len < 0:
        raise ValueError(f"min_len must be an int >= 0, got {min_len!r}")
    if isinstance(beam_size, bool) or not isinstance(beam_size, (int, np.integer)) or beam_size < 1:
        raise ValueError(f"beam_size must be an int >= 1, got {beam_size!r}")
    if 2 * beam_size + 3 > config.tgt_vocab_size:
        raise ValueError(
            f"beam_size={beam_size} needs tgt_vocab_size >= 2 * beam_size + 3, got "
            f"{config.tgt_vocab_size}: the first step takes the 2 * beam_size best extensions of one "
            f"beam, and PAD, BOS and EOS may be banned"
        )
    if not alpha >= 0:
        raise ValueError(f"alpha must be >= 0 (the early stop relies on the penalty growing with length), got {alpha}")


# =============================================================================================================
# The cached decoder, as pure functions of (params, cache)
# =============================================================================================================


def on_device(params):
    """params with its numpy leaves (a checkpoint's, as `checkpoint.load` gives them) put on the device once: a
    program called on numpy arrays copies them in at every call, and a search makes dozens of calls (the whole
    model's weights each time: 11-12% of greedy `translate`'s time on 100 Multi30k sentences, 3-7% of beam 4's,
    small preset, CPU). Arrays already on a device stay where they are. (`jax.device_put`, not `jnp.asarray`, which
    compiles a small program per leaf shape.)"""
    return jax.tree.map(lambda x: jax.device_put(x) if isinstance(x, np.ndarray) else x, params)


def encode_memory(model: Transformer, params, src):
    return model.apply({"params": params}, src, method=Transformer.encode)  # (B, S, D)


@functools.partial(jit_by_config, static_argnames=("config", "width"))
def _encoder(params, src, *, config: TransformerConfig, width: int):
    """src (n, w) -> the encoder's output (n, width, D), zero past w (w <= width)."""
    memory = encode_memory(Transformer(config), params, src)  # (n, w, D)
    return jnp.pad(memory, ((0, 0), (0, width - src.shape[1]), (0, 0)))


@jax.jit
def _in_row_order(pieces: tuple, inverse):
    """The groups' outputs, one after another, put back in the batch's row order: one program (an eager
    concatenate and gather would compile several for each batch shape)."""
    return jnp.concatenate(pieces)[inverse]


ENCODER_ROWS = 16  # sources the encoder of a decoding batch takes at a time on a CPU, alike in length ...
ENCODER_WIDTH_STEP = 8  # ... cut to the longest of them, rounded up to a multiple of this (or of 1/8 of the
# next power of two above 64 tokens: at most 20 widths up to 512, each a program to compile)


def _encoder_rows(rows: int) -> int:
    """Sources per encoder call: ENCODER_ROWS on a CPU (measured there), the whole batch elsewhere."""
    return ENCODER_ROWS if jax.default_backend() == "cpu" else rows


def encoder_shape(rows: int, length: int, width: int) -> tuple[int, int]:
    """(rows, width) of the program that encodes `rows` sources of at most `length` tokens for a batch `width`
    wide (`encode_batch`)."""
    length = max(length, 1)
    step = max(ENCODER_WIDTH_STEP, (1 << (length - 1).bit_length()) // 8)
    return rows, min(width, -(-length // step) * step)


def encoder_groups(lengths: np.ndarray, width: int) -> list[tuple[np.ndarray, int]]:
    """How `encode_batch` encodes a batch of sources of these lengths (B,), `width` wide: (its rows, the width they
    are cut to) for each group. At most ENCODER_ROWS sources (on a CPU; elsewhere the whole batch): one group, in
    the batch's order; more: sorted by length (filler rows of PAD only, length 0, first), ENCODER_ROWS at a time."""
    B, group = len(lengths), _encoder_rows(len(lengths))
    if group >= B:
        return [(np.arange(B), encoder_shape(B, int(np.max(lengths)), width)[1])]
    order = np.argsort(lengths, kind="stable")
    chunks = [order[start : start + group] for start in range(0, B, group)]
    return [(rows, encoder_shape(len(rows), int(np.max(lengths[rows])), width)[1]) for rows in chunks]


def encoder_shapes(rows: int, width: int) -> list[tuple[int, int]]:
    """Every shape `encode_batch` may run the encoder at for a batch of (rows, width) sources (to compile ahead)."""
    group = _encoder_rows(rows)
    sizes = {min(group, rows), rows % group} - {0}
    return sorted({encoder_shape(n, length, width) for n in sizes for length in range(1, width + 1)})


def encode_batch(params, config: TransformerConfig, src) -> jnp.ndarray:
    """The encoder's output (B, S, D) for a decoding batch of right-padded sources (B, S), zero past each group's
    width (cross-attention masks those positions). A batch is padded to one of a few widths, so that few decoders
    compile, and most of its sources are shorter: the encoder runs on groups of ENCODER_ROWS sources of alike
    length instead (on a CPU; elsewhere, not measured, the whole batch), each group cut to its longest source
    (rounded up, `encoder_shape`). On 100 Multi30k sentences (small preset, CPU) the encoder took 38% less time
    over `translate`'s batches so, and greedy `translate` 13% less (docs/benchmarks.md). Each group's (rows, cut
    width) with the batch's width S is a program of its own, which pads its output to S, compiled in a fraction of
    a second (`encoder_shapes`); the batch's groups go back in row order in one more (`_in_row_order`); a batch of
    at most ENCODER_ROWS rows is one group, in its own order. A row of PAD only (`translate`'s
    filler) attends over zeros: its output is not the whole width's, and is thrown away."""
    src = np.asarray(src)
    S = src.shape[1]
    groups = encoder_groups(source_lengths(src, config.pad_id), S)
    if len(groups) == 1:  # the batch as it is
        (_, width), *_ = groups
        return _encoder(params, src[:, :width], config=config, width=S)  # (B, S, D)
    pieces = [_encoder(params, src[rows, :width], config=config, width=S) for rows, width in groups]  # (n, S, D)
    order = np.concatenate([rows for rows, _ in groups])
    return _in_row_order(tuple(pieces), np.argsort(order).astype(np.int32))  # (B, S, D)


def create_cache(model: Transformer, params, memory, src, length: int, beams: int = 1):
    """The decoding cache for `length` target positions of `beams` hypotheses per source row: one decode call on
    a dummy (B * beams, length) target creates empty self-attention keys/values (a slot per hypothesis, see
    MultiHeadAttention) and the table of slots, and projects the cross-attention keys/values from `memory` once
    per source row: the hypotheses of a sentence share them."""
    dummy = jnp.zeros((src.shape[0] * beams, length), dtype=jnp.int32)
    _, variables = model.apply(
        {"params": params}, memory, src, dummy, decode=True, mutable=["cache"], method=Transformer.decode
    )
    return variables["cache"]


def output_kernel(model: Transformer, params):
    """The output projection laid out for decoding steps (Transformer.output_kernel), computed once per loop."""
    return model.apply({"params": params}, method=Transformer.output_kernel)


def decode_step(model: Transformer, params, cache, memory, src, tokens, kernel=None):
    """One decoder step: tokens (B,) at the cache's position -> logits (B, V) of the next token, new cache.
    `kernel`: `output_kernel`'s."""
    logits, variables = model.apply(
        {"params": params, "cache": cache},
        memory,
        src,
        tokens[:, None],
        decode=True,
        kernel=kernel,
        mutable=["cache"],
        method=Transformer.decode,
    )
    return logits[:, 0], variables["cache"]  # (B, V)


PHASED_FROM = 16  # hypotheses (rows x beams) from which a batch's cache grows by phases


def phases(length: int, hypotheses: int, first: int = 16) -> list[int]:
    """The cache lengths a decoding batch of `hypotheses` rows (sentences x beams) goes through: 16, 32, 64, ...
    and `length` last (at most about twice the one before: 16, 32, 65, not 16, 32, 64, 65). A program decodes
    until its cache is full (or its batch should shrink: `decode_shrinking`), then the next goes on with the cache
    padded to the next length. So a step attends over, and reads, never much more than twice the positions
    written so far, where one cache of the output limit's length would be read whole at every step (the model's
    max_len for generate's rules): on 64 sentences x 4 beams, 16 steps took 18% longer over a 129-position cache
    than over 17. Below PHASED_FROM hypotheses a step's attention is a small part of it, and each program a phase
    adds costs more than it saves: one cache of `length` (64 tokens at one sentence: greedy 9-17% faster, at two
    14-23%; at 16 hypotheses and more the phases were 1-10% ahead or even)."""
    if hypotheses < PHASED_FROM:
        return [length]
    ends = []
    while first * 2 <= length:
        ends.append(first)
        first *= 2
    return ends + [length]


# XLA:CPU options for the decoding loops. By default XLA:CPU's copy insertion copied the greedy loops' key/value
# caches (every layer's, twice) at every step: it could not prove that writing a step's keys in place and reading
# the cache do not clash. Its region analysis proves it and the copies go: 40 whole-cache copies of a greedy
# program down to 4, 16-20% off a greedy call (64 rows, 128 positions: 1.79 -> 1.34-1.46 s); beam search, which
# had no such copies, unchanged; compile time the same.
LOOP_CPU_OPTIONS = {"xla_cpu_copy_insertion_use_region_analysis": True}


def _key(path) -> str | None:
    return getattr(path[-1], "key", None)


def _is_self_attention_cache(path) -> bool:
    """Whether the leaf at `path` is a self-attention layer's cached keys or values (MultiHeadAttention's layout:
    a sentence's heads on the first axis, its slots' positions on the last (keys) or the one before (values))."""
    return _key(path) in ("cached_key", "cached_value") and any(
        getattr(p, "key", None) == "self_attention" for p in path
    )


def _leaf(tree, name: str):
    """The first leaf of `tree` whose path ends with key `name` (the cache's "slots" or "position")."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if _key(path) == name:
            return leaf
    raise KeyError(f"no {name!r} in the decoding state")


def cache_length(tree) -> int:
    """How many positions the decoding cache in `tree` (a state, a cache) holds: its slot table's (B, T)."""
    return _leaf(tree, "slots").shape[1]


def grow_cache(tree, length: int):
    """`tree` (a decoding state or cache) with its cache padded to `length` positions: the self-attention keys
    and values (position-major: G slots per position, see MultiHeadAttention) and the slot table. The new
    positions lie beyond the cache index, masked until a step writes them."""
    T = cache_length(tree)

    def grow(path, leaf):
        if _key(path) == "slots":
            return jnp.pad(leaf, ((0, 0), (0, length - T)))
        if _is_self_attention_cache(path):
            axis = 2 if _key(path) == "cached_key" else 1  # keys (B/G * H, K, T*G), values (B/G * H, T*G, K)
            G = leaf.shape[axis] // T
            padding = [(0, 0)] * leaf.ndim
            padding[axis] = (0, (length - T) * G)
            return jnp.pad(leaf, padding)
        return leaf

    return jax.tree_util.tree_map_with_path(grow, tree)


_grow_cache_jit = jax.jit(grow_cache, static_argnames="length")  # one dispatch between two programs, not one a leaf


def run_phase(not_finished, advance, state):
    """`lax.while_loop(not_finished, advance, state)` until the state's cache is full (its position, the steps
    taken, reaches its length): one phase of `phases`."""
    T = cache_length(state)
    return lax.while_loop(lambda s: not_finished(s) & (_leaf(s, "position") < T), advance, state)


# =============================================================================================================
# Shrinking the batch: finished sentences leave it
# =============================================================================================================

SHRINK = 4  # a batch shrinks when at most 1/SHRINK of its rows are still decoding
SMALLEST_LEVEL = 4  # ... down to this many sentences of a beam search, no fewer
SMALLEST_GREEDY_LEVEL = 1  # ... and rows of a greedy search


def shrink_levels(rows: int, beams: int = 1) -> tuple[int, ...]:
    """The row counts a decoding batch of `rows` sentences shrinks through: rows, rows // 4, rows // 16, ..., down
    to 4 sentences of a beam search, 1 row of a greedy one.

    A compiled loop has one batch shape, so a batch runs as long as its longest sentence (a greedy output that
    repeats itself to the length limit holds up 63 finished ones). `decode_shrinking` stops the loop once at most
    the next level's rows are unfinished and goes on with those rows only. A step costs about its rows' share
    of the work above a few rows, and shrinking 4-fold a time keeps the programs to compile few (one per level:
    64 -> 16 -> 4). Below, a beam search's step costs about the same at 1 sentence (4 hypotheses) as at 4: its
    levels stop at 4 sentences (on 100 Multi30k sentences, beam 4, 64 -> 16 -> 4 decoded as fast as
    64 -> 16 -> 4 -> 1, with one program fewer). A greedy step at one row multiplies vectors by the weight matrices,
    which XLA:CPU does about twice as fast as its products of 2-8 rows: its levels go on to 1 row (64 -> 16 -> 4
    -> 1, 32 -> 8 -> 2 -> 1), about 15% faster on the same sentences, whose slowest outputs repeat to the length limit
    (docs/benchmarks.md)."""
    smallest = SMALLEST_GREEDY_LEVEL if beams == 1 else SMALLEST_LEVEL
    levels = [rows]
    while levels[-1] >= 2 * smallest:
        levels.append(max(levels[-1] // SHRINK, smallest))
    return tuple(levels)


def select_rows(tree, index, beams: int = 1):
    """Rows `index` (N,) of every leaf of a tree that holds a decoding cache (a state, a cache, with other per-row
    arrays beside) whose first axis is the batch's sentences (B, ...), hypotheses (B * beams, ...; the cache's
    table of slots, named "slots") or sentences' heads (B * H, ...; the self-attention keys and values); scalars
    as they are."""
    index = jnp.asarray(index)
    hypotheses = (index[:, None] * beams + jnp.arange(beams)).reshape(-1)  # (N * beams,)
    sentences = _leaf(tree, "slots").shape[0] // beams

    def select(path, leaf):
        if jnp.ndim(leaf) == 0:
            return leaf
        if _key(path) == "slots":
            return jnp.take(leaf, hypotheses, axis=0)
        if _is_self_attention_cache(path):  # (B * H, ...) -> (B, H, ...) -> (N, H, ...) -> (N * H, ...)
            heads = jnp.take(leaf.reshape(sentences, -1, *leaf.shape[1:]), index, axis=0)
            return heads.reshape(-1, *leaf.shape[1:])
        return jnp.take(leaf, index, axis=0)

    return jax.tree_util.tree_map_with_path(select, tree)


# One dispatch between two programs, not a few eager ops per leaf (7 ms a shrink in a greedy `translate` batch);
# compiled on first use, as `_grow_cache_jit`.
_select_rows_jit = jax.jit(select_rows, static_argnames="beams")

PARTED_FROM = 8  # sentences from which a batch is decoded in two halves at once on a CPU


def _usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the system says, else all the machine's)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def side_by_side() -> int:
    """How many decoding loops run to good effect at the same time here, each in a thread of its own: 2 on a CPU
    where the process may use two cores or more, 1 elsewhere (a GPU or TPU runs one program at once). XLA:CPU runs a
    decoding step's many small ops one after another and splits only its larger products across the cores: one
    loop kept 1.5-1.7 of a 2-core EPYC's cores busy (CTranslate2, with a thread per core, 2.0), two loops side by
    side 1.9-2.0 (docs/benchmarks.md). Measured on 2-core machines only, hence at most 2."""
    return 2 if jax.default_backend() == "cpu" and _usable_cores() >= 2 else 1


def parts(rows: int, split: bool = True) -> int:
    """How many parts `decode_shrinking` cuts a batch of `rows` sentences into, each decoded at the same time by a
    thread of its own: `side_by_side()` for an even batch of at least PARTED_FROM sentences, 1 otherwise or without
    `split`. Two half batches side by side were 4-26% faster (medians) than one loop from 8 sentences up, greedy
    or beam 4, and no faster at 4 sentences (docs/benchmarks.md). `translate` decodes whole batches side by side
    instead where it has two or more (`translation.batches_at_once`)."""
    if not split or rows % 2 or rows < PARTED_FROM:
        return 1
    return side_by_side()


def callers_settings() -> Callable[[], contextlib.AbstractContextManager]:
    """The calling thread's jax settings a decoding depends on, to put in force in another thread: jax keeps the
    matmul precision and the default device (`jax.default_matmul_precision`, `jax.default_device`) per thread, and
    a new thread starts with the process's defaults. Returns a function that makes the context manager."""
    precision, device = jax.config.jax_default_matmul_precision, jax.config.jax_default_device

    @contextlib.contextmanager
    def in_force():
        with contextlib.ExitStack() as stack:
            if precision:
                stack.enter_context(jax.default_matmul_precision(precision))
            if device is not None:
                stack.enter_context(jax.default_device(device))
            yield

    return in_force


def decode_shrinking(
    run, encode, rows_args: tuple, unfinished, outputs, length: int, beams: int = 1, split: bool = True
) -> list[np.ndarray]:
    """`_decode_shrinking` on each of `parts(rows, split)` parts of the batch, at the same time, their results in
    order; each part encodes its own sources (`encode(src)`, in its thread).
    Part i takes rows i, i + n, i + 2n, ...: `translate` sorts a batch's sentences by length and puts its filler
    rows last, so interleaved parts get alike lengths (halves would not). The rows are independent: the results are
    those of one batch (up to the float rounding of smaller matrix products, as for a batch that shrinks)."""
    n = parts(rows_args[0].shape[0], split)
    if n == 1:
        return _decode_shrinking(run, encode, rows_args, unfinished, outputs, length, beams)
    settings = callers_settings()  # the parts run with the caller's precision and device

    def decode_part(i: int) -> list[np.ndarray]:
        with settings():
            part = tuple(arg[i::n] for arg in rows_args)
            return _decode_shrinking(run, encode, part, unfinished, outputs, length, beams)

    with ThreadPoolExecutor(n) as pool:  # jax releases the GIL while its programs run
        done = list(pool.map(decode_part, range(n)))
    # Each result's rows back in the batch's order: row j of part i is row j * n + i (the parts are of equal size).
    return [np.stack(pieces, axis=1).reshape(-1, *pieces[0].shape[1:]) for pieces in zip(*done)]


def _decode_shrinking(
    run, encode, rows_args: tuple, unfinished, outputs, length: int, beams: int = 1
) -> list[np.ndarray]:
    """Decodes a batch whose finished sentences leave it (see `shrink_levels`), as CTranslate2 gathers its
    unfinished ones, and whose cache grows through `phases(length, rows x beams)`. encode(src) -> the encoder's
    output (`encode_batch`); run(rows_args, leave_at, carried) -> (state, memory): a decoding program that stops
    once at most `leave_at` rows are unfinished or its cache is full, on per-row arguments `rows_args` (src
    first), starting from (None, encode(src)) or going on from a (state, memory) it returned before;
    unfinished(state) -> (B,) bool; outputs(state) -> per-row results; both numpy arrays computed on the host from
    the state's arrays (an eager jax op on a device array compiles a small program for each new shape: dozens of them,
    ~30 ms each, in a `translate` that meets a few batch shapes). The rows are independent, so the results are
    those of one loop over the whole batch (up to the float rounding of a smaller matrix product)."""
    levels = shrink_levels(rows_args[0].shape[0], beams)
    ends = phases(length, levels[0] * beams)

    def leave_at(rows: int):  # the next level below `rows` (an argument of the programs, not a static one)
        return np.int32(next((level for level in levels if level < rows), 0))

    owners = np.arange(levels[0])  # the original row of each row; -1: a filler copy of a finished row
    state, memory = run(rows_args, leave_at(levels[0]), (None, encode(rows_args[0])))
    results = None
    while True:
        real = owners >= 0
        going = np.asarray(unfinished(state)) & real
        left = np.flatnonzero(going)
        rows = min(level for level in levels if level >= len(left)) if len(left) else 0  # the next level
        if rows < len(owners):  # rows leave the batch (or all are done): keep their results
            current = [np.asarray(x) for x in outputs(state)]
            if results is None:
                results = [np.zeros((levels[0],) + x.shape[1:], x.dtype) for x in current]
            for result, x in zip(results, current):
                result[owners[real]] = x[real]
        if len(left) == 0:
            return results
        T = cache_length(state)
        full = int(_leaf(state, "position")) >= T  # the program stopped because its cache is full
        if rows >= len(owners) and not (full and T < length):
            raise RuntimeError(f"decoding stopped with {len(left)} of {len(owners)} rows unfinished")
        if rows < len(owners):
            spare = np.flatnonzero(~going)[0]  # a finished row: its copies fill the level's remaining rows
            index = np.concatenate([left, np.full(rows - len(left), spare)])
            owners = np.concatenate([owners[left], np.full(rows - len(left), -1)])
            state, memory, rows_args = _select_rows_jit((state, memory, rows_args), index, beams)
        if full:
            state = _grow_cache_jit(state, next(end for end in ends if end > T))
        state, memory = run(rows_args, leave_at(rows), (state, memory))


def encoder_jobs(params, config: TransformerConfig, shapes) -> dict:
    """Compile jobs for encoder programs of these (rows, cut width, batch width) shapes (`encode_batch`): {shape: a
    function that compiles it}."""

    def compile_one(rows: int, cut: int, width: int):
        src = jax.ShapeDtypeStruct((rows, cut), jnp.int32)
        _encoder.compile_ahead(params, src, config=config, width=width)

    return {tuple(shape): functools.partial(compile_one, *shape) for shape in shapes}


def shrinking_programs(
    core, params, rows: int, per_row, shared: tuple, static: dict, length: int, beams: int = 1, split: bool = True
) -> dict:
    """Compile jobs for the programs `decode_shrinking` runs `core` as on a batch of `rows` rows: {(rows of the
    level, cache length): a function that compiles it}; the first level's (a part's rows, `parts(rows, split)`) at
    the first cache length starts from the encoder's output (`encoder_jobs`), the others go on from a carried
    state.
    per_row(n): the per-row arguments' shapes (jax.ShapeDtypeStruct) at n rows; `shared`: the other arguments
    before leave_at; `static`: the static keyword arguments; `beams`: hypotheses per sentence.
    `compile_ahead` fills the cache calls look in (`compilation.jit_by_config`)."""
    rows //= parts(rows, split)  # each part of the batch runs the programs of its own rows
    leave_at = jax.ShapeDtypeStruct((), jnp.int32)
    ends, jobs = phases(length, rows * beams), {}
    first = (params, *per_row(rows), *shared, leave_at)

    @functools.cache
    def start():  # what the first program starts from: (None, the encoder's output (rows, S, D))
        width = first[1].shape[1]  # the batch's: `encoder_jobs` compile the encoder's programs
        encoder = functools.partial(_encoder.__wrapped__, config=static["config"], width=width)
        return None, jax.eval_shape(encoder, params, first[1])

    @functools.cache  # traced once for all the resumed programs
    def fresh():  # (state, memory) as the first program returns it; of the plain function (a jit cannot nest)
        return jax.eval_shape(functools.partial(core.__wrapped__, **static), *first, start())

    for level in shrink_levels(rows, beams):
        args = (params, *per_row(level), *shared, leave_at)
        for end in ends:
            if (level, end) == (rows, ends[0]):
                jobs[level, end] = lambda args=args: core.compile_ahead(*args, start(), **static)
                continue

            def resume(args=args, level=level, end=end):
                def carried(tree):  # what decode_shrinking carries: `level` rows of it, the cache grown to `end`
                    return grow_cache(select_rows(tree, jnp.zeros(level, jnp.int32), beams), end)

                core.compile_ahead(*args, jax.eval_shape(carried, fresh()), **static)

            jobs[level, end] = resume
    return jobs


def _next_log_probs(model, params, cache, memory, src, tokens, step, min_len, config: TransformerConfig, kernel):
    """Log-probs (B, V) of the token after `tokens` (see `_restrict` for the banned ones), and the new cache."""
    logits, cache = decode_step(model, params, cache, memory, src, tokens, kernel)
    return _restrict(jax.nn.log_softmax(logits, axis=-1), step, min_len, config), cache


def _restrict(log_probs, step, min_len, config: TransformerConfig):
    """Tokens that may not be produced get log-prob -inf (no renormalisation, as fairseq does): PAD and BOS
    always (they are never training targets), EOS while fewer than `min_len` tokens have been produced."""
    log_probs = log_probs.at[..., config.pad_id].set(-jnp.inf)
    if config.bos_id is not None:
        log_probs = log_probs.at[..., config.bos_id].set(-jnp.inf)
    eos = log_probs[..., config.eos_id]
    return log_probs.at[..., config.eos_id].set(jnp.where(step < min_len, -jnp.inf, eos))


# =============================================================================================================
# Greedy search
# =============================================================================================================


def first_argmax(x):
    """jnp.argmax over the last axis (the first index of the maximum) as two plain reductions, a max and a min
    over indices. XLA's CPU backend vectorises those but not argmax's single (value, index) reduction: over a
    (16, 8000) batch of log-probs this is 2-3x faster, ~10% of a greedy decoding step."""
    index = lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    is_max = x == jnp.max(x, axis=-1, keepdims=True)
    return jnp.min(jnp.where(is_max, index, x.shape[-1]), axis=-1)


@functools.partial(jit_by_config, static_argnames=("config", "length"), cpu_options=LOOP_CPU_OPTIONS)
def _greedy_core(params, src, max_new, min_len, leave_at, carried, *, config: TransformerConfig, length: int):
    """src (B, S), max_new (B,) -> (state, memory), once every row is finished or at most `leave_at` rows are
    not (`decode_shrinking`); `carried`: a (state, memory) returned before, to go on from, or (None, the encoder's
    output (B, S, D)) to start."""
    model = Transformer(config)
    B = src.shape[0]
    kernel = output_kernel(model, params)

    def not_finished(state):
        step, _, _, _, done, _ = state
        return (step < length) & (jnp.sum(~done) > leave_at)

    def advance(state):
        step, last, tokens, scores, done, cache = state
        log_probs, cache = _next_log_probs(model, params, cache, memory, src, last, step, min_len, config, kernel)
        # Greedy: take the most probable next token; finished rows emit PAD and add nothing to their score.
        token = jnp.where(done, config.pad_id, first_argmax(log_probs))  # (B,)
        gained = jnp.take_along_axis(log_probs, token[:, None], axis=-1)[:, 0]
        scores = scores + jnp.where(done, 0.0, gained)
        tokens = tokens.at[:, step].set(token)
        done = done | (token == config.eos_id) | (step + 1 >= max_new)
        return step + 1, token, tokens, scores, done, cache

    state, memory = carried
    if state is None:
        state = (
            jnp.array(0, jnp.int32),  # step
            jnp.full((B,), config.start_id, jnp.int32),  # last tokens
            jnp.full((B, length), config.pad_id, jnp.int32),  # tokens
            jnp.zeros((B,), jnp.float32),  # scores
            jnp.zeros((B,), bool),  # done
            create_cache(model, params, memory, src, phases(length, B)[0]),
        )
    return run_phase(not_finished, advance, state), memory


def greedy_search(
    params,
    config: TransformerConfig,
    src,
    *,
    max_len_a: float = DEFAULT_MAX_LEN_A,
    max_len_b: float = DEFAULT_MAX_LEN_B,
    min_len: int = 0,
    split: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """Greedy decoding of a batch of right-padded sources (B, S).

    Returns tokens (B, L) int32 (no BOS; EOS where emitted; PAD after) and scores (B,) float32, the sum of the
    chosen tokens' log-probabilities. See the module docstring for the length rule and L. `split`: decode the
    batch in parts side by side where that is faster (`parts`); False: whole, in the calling thread.
    """
    src = check_source(src, config)
    _check_options(config, max_len_a, max_len_b, min_len)
    length = output_length(src.shape[1], config, max_len_a, max_len_b)
    min_len, params = np.int32(min_len), on_device(params)

    def run(rows, leave_at, carried):
        src, max_new = rows
        return _greedy_core(params, src, max_new, min_len, leave_at, carried, config=config, length=length)

    rows = (src, max_new_tokens(src, config, max_len_a, max_len_b))  # numpy: a program's arguments
    encode = functools.partial(encode_batch, params, config)
    tokens, scores = decode_shrinking(
        run,
        encode,
        rows,
        unfinished=lambda s: ~np.asarray(s[4]),
        outputs=lambda s: (np.asarray(s[2]), np.asarray(s[3])),
        length=length,
        split=split,
    )
    return tokens, scores


# =============================================================================================================
# Beam search
# =============================================================================================================


@exportable  # a program that carries it can be stored (compilation.ProgramStore)
@flax.struct.dataclass
class BeamState:
    """Everything the beam search loop carries. K = beam size, L = output length."""

    step: jnp.ndarray  # () int32: tokens produced so far by every live hypothesis
    live_tokens: jnp.ndarray  # (B, K, L) int32: live hypotheses, best first
    live_log_probs: jnp.ndarray  # (B, K) float32: their log P; -inf marks an empty slot
    finished_tokens: jnp.ndarray  # (B, K, L) int32: finished hypotheses, best first
    finished_scores: jnp.ndarray  # (B, K) float32: their length-penalised scores; -inf marks an empty slot
    finished_flags: jnp.ndarray  # (B, K) bool: which finished slots hold a hypothesis
    done: jnp.ndarray  # (B,) bool: rows whose finished set can no longer change
    cache: Any  # the decoder cache of the live hypotheses, batch axis B * K


TOP_K_BLOCK = 64  # entries per block in the first pass of `top_k`


def top_k(x, k: int):
    """`lax.top_k(x, k)` over the last axis of x (R, N): the same values and indices, ties to the lower index.

    A beam step picks the 2K best of K * V extensions per sentence; XLA:CPU's TopK partially sorts every row
    entry by entry (64 rows of 32,000: 2.8 ms, a tenth of a beam-4 step; of 232,404, a Marian vocabulary's: 20 ms).
    This takes two passes instead (0.35 and 2.7 ms there): the k largest entries lie in the k blocks of 64 with
    the largest maxima, so only those k * 64 entries are sorted. (Exact, ties included: an entry >= the k-th
    largest block maximum m lies in a block whose maximum is >= m; blocks tied at m are chosen lowest index
    first, each holds an entry equal to m, and the candidates keep index order.) No NaN expected: log-probs."""
    R, N = x.shape
    blocks = -(-N // TOP_K_BLOCK)
    if blocks < k:
        return lax.top_k(x, k)
    # Each block's maximum (the last block padded with -inf), and the k blocks with the largest, in index order.
    padding = ((0, 0), (0, blocks * TOP_K_BLOCK - N))
    maxima = lax.reduce_window(x, -jnp.inf, lax.max, (1, TOP_K_BLOCK), (1, TOP_K_BLOCK), padding)  # (R, blocks)
    chosen = jnp.sort(lax.top_k(maxima, k)[1], axis=1)  # (R, k), sorted: ties go to the lower index
    index = (chosen[:, :, None] * TOP_K_BLOCK + jnp.arange(TOP_K_BLOCK)).reshape(R, k * TOP_K_BLOCK)
    # Their entries; the padding's, beyond N, are -inf and come after every real entry in index order.
    candidates = jnp.where(index < N, jnp.take_along_axis(x, jnp.minimum(index, N - 1), axis=1), -jnp.inf)
    values, picked = lax.top_k(candidates, k)  # (R, k)
    return values, jnp.take_along_axis(index, picked, axis=1)


def gather_beams(x, index):
    """x (B, N, ...), index (B, M) -> (B, M, ...): picks entries along axis 1, per row."""
    return jnp.take_along_axis(x, index.reshape(index.shape + (1,) * (x.ndim - 2)), axis=1)


def reorder_cache(cache, parents, beam_size: int):
    """Gives hypothesis k of sentence b the history of its parent: of the cache, only the table of which slot
    holds each position (B * K, T_max) has a row per hypothesis; the keys/values stay where they were written
    (see MultiHeadAttention), and the cache index and position are shared by every row."""
    if beam_size == 1:
        return cache
    B = parents.shape[0]
    flat = (jnp.arange(B)[:, None] * beam_size + parents).reshape(-1)  # (B * K,)
    decoder = cache["decoder"]
    return {**cache, "decoder": {**decoder, "slots": decoder["slots"][flat]}}


@functools.partial(jit_by_config, static_argnames=("config", "length", "beam_size"), cpu_options=LOOP_CPU_OPTIONS)
def _beam_core(
    params, src, max_new, min_len, penalties, leave_at, carried, *, config: TransformerConfig, length, beam_size
):
    """src (B, S), max_new (B,), penalties (length + 1,) -> (BeamState, memory), once every row is done or at
    most `leave_at` rows are not (`decode_shrinking`); `carried`: a (state, memory) returned before, or (None,
    the encoder's output (B, S, D)) to start."""
    model = Transformer(config)
    B, K = src.shape[0], beam_size
    # Every row is searched with K hypotheses side by side: the decoder sees a batch of B * K rows (against the
    # B sources: the K hypotheses of a sentence share its cross-attention keys/values).
    kernel = output_kernel(model, params)

    def not_finished(s: BeamState):
        return (s.step < length) & (jnp.sum(~s.done) > leave_at)

    def advance(s: BeamState) -> BeamState:
        t = s.step
        last = jnp.where(t == 0, config.start_id, s.live_tokens[:, :, jnp.maximum(t - 1, 0)])  # (B, K)
        log_probs, cache = _next_log_probs(
            model, params, s.cache, memory, src, last.reshape(-1), t, min_len, config, kernel
        )  # (B * K, V)
        V = log_probs.shape[-1]
        log_probs = log_probs.reshape(B, K, V)

        # Extend every live hypothesis by every token; keep the 2K most probable extensions.
        extended = s.live_log_probs[:, :, None] + log_probs  # (B, K, V)
        top_log_probs, top_index = top_k(extended.reshape(B, K * V), 2 * K)  # (B, 2K)
        parents, new_tokens = top_index // V, top_index % V  # (B, 2K)
        candidates = gather_beams(s.live_tokens, parents).at[:, :, t].set(new_tokens)  # (B, 2K, L)
        # A candidate ends with EOS, or when its row reaches the length limit (then without EOS). Only the K
        # best candidates may finish (as in fairseq): an ending candidate ranked below them is dropped.
        ends = (new_tokens == config.eos_id) | (t + 1 >= max_new)[:, None]  # (B, 2K)
        finishing = ends & (jnp.arange(2 * K) < K)[None, :]  # (B, 2K)

        # Live set: the K most probable candidates that did not end.
        live_log_probs, pick = lax.top_k(jnp.where(ends, -jnp.inf, top_log_probs), K)  # (B, K)
        live_tokens = gather_beams(candidates, pick)  # (B, K, L)
        cache = reorder_cache(cache, jnp.take_along_axis(parents, pick, axis=1), K)

        # Finished set: the K best of the old finished and the candidates that ended, by penalised score.
        new_scores = jnp.where(finishing, top_log_probs / penalties[t + 1], -jnp.inf)  # (B, 2K)
        scores, pick = lax.top_k(jnp.concatenate([s.finished_scores, new_scores], axis=1), K)  # (B, K)
        tokens = gather_beams(jnp.concatenate([s.finished_tokens, candidates], axis=1), pick)
        flags = gather_beams(jnp.concatenate([s.finished_flags, finishing], axis=1), pick)
        # Rows that were already done keep their finished set (their candidates could only lose, or come
        # from steps beyond their length limit).
        frozen = s.done[:, None]
        scores = jnp.where(frozen, s.finished_scores, scores)
        tokens = jnp.where(frozen[:, :, None], s.finished_tokens, tokens)
        flags = jnp.where(frozen, s.finished_flags, flags)

        # Done: the length limit is reached, or K hypotheses are finished and no live one can beat the worst.
        best_reachable = live_log_probs[:, 0] / penalties[max_new]  # (B,)
        beaten = jnp.all(flags, axis=1) & (scores[:, -1] > best_reachable)
        done = s.done | (t + 1 >= max_new) | beaten
        return BeamState(t + 1, live_tokens, live_log_probs, tokens, scores, flags, done, cache)

    state, memory = carried
    if state is None:
        first_beam_only = jnp.where(jnp.arange(K) == 0, 0.0, -jnp.inf)  # K copies of BOS: only one may extend
        state = BeamState(
            step=jnp.array(0, jnp.int32),
            live_tokens=jnp.full((B, K, length), config.pad_id, jnp.int32),
            live_log_probs=jnp.tile(first_beam_only, (B, 1)).astype(jnp.float32),
            finished_tokens=jnp.full((B, K, length), config.pad_id, jnp.int32),
            finished_scores=jnp.full((B, K), -jnp.inf, jnp.float32),
            finished_flags=jnp.zeros((B, K), bool),
            done=jnp.zeros((B,), bool),
            cache=create_cache(model, params, memory, src, phases(length, B * K)[0], beams=K),
        )
    return run_phase(not_finished, advance, state), memory


def beam_search(
    params,
    config: TransformerConfig,
    src,
    *,
    beam_size: int = 4,
    alpha: float = 0.6,
    max_len_a: float = DEFAULT_MAX_LEN_A,
    max_len_b: float = DEFAULT_MAX_LEN_B,
    min_len: int = 0,
    split: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """Beam search over a batch of right-padded sources (B, S) with the GNMT length penalty.

    Returns the best hypothesis of each row, tokens (B, L) int32 (no BOS; EOS where emitted; PAD after), and
    its score (B,) float32 = log P / ((5 + length) / 6) ** alpha. With alpha = 0 and beam_size = 1 this is
    exactly greedy search (with alpha > 0 the runner-up kept live when greedy's EOS finishes may later beat it).
    `split`: as for `greedy_search`.
    """
    src = check_source(src, config)
    _check_options(config, max_len_a, max_len_b, min_len, beam_size, alpha)
    length = output_length(src.shape[1], config, max_len_a, max_len_b)
    min_len, penalties = np.int32(min_len), jax.device_put(length_penalties(length, alpha))
    params = on_device(params)
    static = dict(config=config, length=length, beam_size=int(beam_size))

    def run(rows, leave_at, carried):
        src, max_new = rows
        return _beam_core(params, src, max_new, min_len, penalties, leave_at, carried, **static)

    rows = (src, max_new_tokens(src, config, max_len_a, max_len_b))  # numpy: a program's arguments
    # Every row ends done with at least one finished hypothesis (at the latest, its length limit finishes K).
    tokens, scores = decode_shrinking(
        run,
        functools.partial(encode_batch, params, config),
        rows,
        unfinished=lambda s: ~np.asarray(s.done),
        outputs=lambda s: (np.asarray(s.finished_tokens)[:, 0], np.asarray(s.finished_scores)[:, 0]),
        length=length,
        beams=int(beam_size),
        split=split,
    )
    return tokens, scores
