"""How a decoding batch runs through the search's programs (`search.start`, `search.resume`), behind one interface:
`Whole` runs a batch as one program, its encoder over the whole batch: what suits a GPU or TPU. `Scheduled`, the
default on a CPU, is a throughput layer tuned on CPUs (the measurements behind each rule: docs/benchmarks.md):

- a batch of PARTED_FROM sentences or more is decoded as two interleaved halves at once, in threads of their own,
  where the process may use two cores or more (XLA:CPU runs a step's many small ops one after another);
- finished sentences leave the batch: a program stops once at most the next of `shrink_levels` sentences are open,
  and the next goes on with those rows only (a compiled loop has one batch shape, so a batch would otherwise run
  as long as its longest sentence);
- the cache grows through `cache_lengths` (16, 32, 64, ... positions) instead of being the output limit's length, so a
  step never reads much more than twice the positions written so far;
- the encoder runs on groups of ENCODER_ROWS sources of alike length, each cut to its longest source.

Each also says what it will run, so that callers can compile it ahead (`programs`, `encoder_shapes`), and how many whole
batches `translate` should decode at once (`for_batches`). The search loop knows none of this.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np

from jax_transformer.decoding import search
from jax_transformer.decoding.search import Rows, Rules, SearchState
from jax_transformer.model.transformer import grow_cache, select_cache
from jax_transformer.settings.config import TransformerConfig


def default() -> Schedule:
    """`Scheduled()` where JAX computes on the CPU, else `Whole()`."""
    return Scheduled() if jax.default_backend() == "cpu" else Whole()


def serving() -> Schedule:
    """A service's schedule: `default()`, its batches one at a time (a service's batch is what arrived together; on
    a CPU each may be cut in halves decoded side by side), so that each batch shape runs one set of programs, all
    compiled before the service takes a request."""
    schedule = default()
    return dataclasses.replace(schedule, batches_side_by_side=False) if isinstance(schedule, Scheduled) else schedule


def search_programs(config):
    """The programs that run a model's search, `search.encoder`, `search.start` and `search.resume`: `search`'s, or
    those of an ensemble's config (`ensemble.EnsembleConfig.search_programs`), which take the same arguments."""
    return getattr(config, "search_programs", search)


def _shape(shape, dtype=jnp.int32) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype)


class Schedule:
    """What a schedule answers: how a batch decodes (`decode`), how many of `translate`'s batches run at once
    (`for_batches`), and what it will compile (`plan`, `programs`, `encoder_shapes`, `encoder_programs`). `Whole` is
    the plain one; `Scheduled` the CPU's."""


@dataclasses.dataclass(frozen=True)
class Whole(Schedule):
    """A batch as one program: the encoder over the whole batch and its whole width (one program per batch shape:
    compiling is what costs on a GPU), then the search from start to end with a cache of the output length."""

    def for_batches(self, n_batches: int) -> tuple[int, Schedule]:
        """How many of `n_batches` batches to decode at the same time, each in a thread of its own (one), and the
        schedule each then runs on."""
        return 1, self

    def decode(
        self, params, config: TransformerConfig, rules: Rules, src: np.ndarray, rows: Rows, length: int
    ) -> tuple[np.ndarray, ...]:
        """The finished hypotheses of each row of `src` (B, S), as `found` gives them, on the host. `rows`: each
        row's limit, prefix and draw id (`search.Rows`)."""
        programs = search_programs(config)
        memory = programs.encoder(params, src, config=config, width=src.shape[1])
        options = dict(config=config, length=length, cache_len=length)
        state = programs.start(params, src, memory, rules, rows, np.int32(0), **options)
        return found(state)

    def encoder_shapes(self, row_lengths: np.ndarray, width: int) -> set[tuple[int, int, int]]:
        """The (rows, cut width, batch width) of the encoder programs a batch of sources of these lengths (B,),
        `width` wide, runs."""
        return {(len(row_lengths), width, width)}

    def plan(self, rows: int, beams: int, length: int) -> Plan:
        """The programs one loop of a batch of `rows` sentences runs: one, a cache of the output length."""
        return Plan((rows,), (length,))

    def programs(
        self, params, config: TransformerConfig, rules: Rules, rows: int, width: int, length: int, phrases=None
    ) -> dict[str, Callable[[], None]]:
        """Compile jobs for the search programs a batch of (rows, width) sources runs (its `plan`), by name: calling
        them fills the cache that `decode`'s calls look in. `rules` may hold shapes (jax.ShapeDtypeStruct);
        `phrases` (P, M): the programs of rows with lexical constraints of that padded size."""
        plan, programs = self.plan(rows, rules.beams, length), search_programs(config)
        options = dict(config=config, length=length, cache_len=plan.ends[0])
        src, memory = _shape((rows, width)), _memory(config, rows, width)
        args = (params, src, memory, rules, row_shapes(rows, length, phrases), _shape(()))
        traced = []  # the first program's output state, traced once for all the programs that go on from it
        lock = threading.Lock()  # compile-ahead jobs run in threads

        def first_state():
            with lock:
                if not traced:
                    traced.append(jax.eval_shape(functools.partial(programs.start.__wrapped__, **options), *args))
                return traced[0]

        def carried(state, memory, src, level: int, end: int):  # what `decode` carries to a program of that level
            picked, memory, src = select_rows(state, memory, src, jnp.zeros(level, jnp.int32))
            return grow(picked, end), memory, src

        def compile_one(level: int, end: int, resumed: bool):
            if not resumed:
                return programs.start.compile_ahead(*args, **options)
            shapes = functools.partial(carried, level=level, end=end)
            state, part_memory, part_src = jax.eval_shape(shapes, first_state(), memory, src)
            programs.resume.compile_ahead(params, part_src, part_memory, rules, state, _shape(()), config=config)

        return {
            f"{level}x{width} cache {end}" + " resumed" * resumed: functools.partial(compile_one, level, end, resumed)
            for level, end, resumed in plan.programs
        }

    def every_program(
        self, params, config: TransformerConfig, rules: Rules, rows: int, width: int, length: int, phrases=None
    ) -> dict[str, Callable[[], None]]:
        """Compile jobs for every program a batch of (rows, width) sources may run, whatever its sources' lengths
        and however its sentences finish (a service compiles them before it takes a request), by name; `phrases`
        as `programs` says."""
        jobs = dict(self.programs(params, config, rules, rows, width, length, phrases))
        for shape, job in self.encoder_programs(params, config, [(rows, width, width)]).items():
            jobs[f"encoder {shape[0]}x{shape[1]} of width {width}"] = job
        return jobs

    def encoder_programs(self, params, config: TransformerConfig, shapes: Iterable[tuple[int, int, int]]) -> dict:
        """Compile jobs for encoder programs of these (rows, cut width, batch width) shapes, by shape."""

        def compile_one(rows: int, cut: int, width: int):
            search_programs(config).encoder.compile_ahead(params, _shape((rows, cut)), config=config, width=width)

        return {tuple(shape): functools.partial(compile_one, *shape) for shape in shapes}


@dataclasses.dataclass(frozen=True)
class Plan:
    """The search programs one loop of `levels[0]` sentences runs, listed once for `decode`, which follows it, and
    `programs`, which compiles it ahead (two copies of one state machine would have to agree)."""

    levels: tuple[int, ...]  # the sentence counts it shrinks through (`shrink_levels`), largest first
    ends: tuple[int, ...]  # the cache lengths it grows through (`cache_lengths`), shortest first

    @property
    def programs(self) -> list[tuple[int, int, bool]]:
        """(rows, cache length, resumed) of each: `search.start` at the first level and end, `search.resume` after."""
        first = (self.levels[0], self.ends[0])
        return [(level, end, (level, end) != first) for level in self.levels for end in self.ends]

    def until(self, rows: int) -> np.int32:
        """The level below `rows` at which a program of `rows` stops (0: none, it runs to the end)."""
        return np.int32(next((level for level in self.levels if level < rows), 0))


def found(state: SearchState) -> tuple[np.ndarray, ...]:
    """Each sentence's finished hypotheses, best first, on the host: tokens (B, K, L), scores (B, K), per-token
    log-probs (B, K, L) and which slots hold one (B, K) (sliced there: an eager jax op would compile a small program
    for each new shape); and their alignments (B, K, L) where the search makes them."""
    aligned = () if state.finished_alignment is None else (state.finished_alignment,)
    return tuple(
        np.asarray(x)
        for x in (state.finished_tokens, state.finished_scores, state.finished_token_scores, state.finished, *aligned)
    )


def _both(jitted, placed: tuple, host: tuple = (), **static) -> None:
    """Compiles `jitted` for arguments of these shapes twice: with `placed` as arrays committed to the default
    device, and as arrays placed nowhere (`host`: host arrays either way). A program is compiled for where its
    arguments lie: a call on another program's outputs (committed) and one on arrays not yet committed find
    different ones, and which a step between two programs gets depends on the path that led there."""
    device = jax.config.values["jax_default_device"] or jax.local_devices()[0]
    sharding = jax.sharding.SingleDeviceSharding(device)

    def committed(x):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=x.weak_type, sharding=sharding)

    for args in (jax.tree.map(committed, placed), placed):
        jitted.lower(*args, *host, **static).compile()


def row_shapes(rows: int, length: int, phrases: tuple[int, int] | None = None) -> Rows:
    """The shapes of `search.Rows` for `rows` sentences and outputs of `length` tokens; `phrases` (P, M): with
    lexical constraints of that padded size (`constraints.phrase_arrays`)."""
    found = Rows(_shape((rows,)), _shape((rows, length)), _shape((rows,)), _shape((rows,), jnp.uint32))
    if phrases is None:
        return found
    P, M = phrases
    return found.replace(phrases=_shape((rows, P, M)), phrase_len=_shape((rows, P)), ordered=_shape((rows,), bool))


def _memory(config: TransformerConfig, rows: int, width: int) -> jax.ShapeDtypeStruct:
    """The shape of the encoder's output for (rows, width) sources (`search.encoder`: float32; an ensemble's: its
    `memory_shape`)."""
    if hasattr(config, "memory_shape"):
        return config.memory_shape(rows, width)
    return _shape((rows, width, config.d_model), jnp.float32)


# =============================================================================================================
# The CPU's schedule
# =============================================================================================================

PARTED_FROM = 8  # sentences from which a batch is decoded in two halves at once
SHRINK = 4  # a batch shrinks when at most 1/SHRINK of its sentences are still open ...
SMALLEST_LEVEL = 4  # ... down to this many sentences of a beam search (a beam step costs about the same below)
SMALLEST_GREEDY_LEVEL = 1  # ... and to one of a greedy search (one row multiplies vectors, twice as fast)
PHASED_FROM = 16  # hypotheses (sentences x beams) from which the cache grows by phases
ENCODER_ROWS = 16  # sources the encoder takes at a time, alike in length ...
ENCODER_WIDTH_STEP = 8  # ... cut to the longest, rounded up to a multiple of this (or of 1/8 of the next power of
# two above 64 tokens: at most 20 widths up to 512, each a program to compile)


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the system says, else all the machine's)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def side_by_side() -> int:
    """How many decoding loops run to good effect at the same time, each in a thread of its own: 2 where the
    process may use two cores or more (tuned on 2-core machines only, hence at most 2), else 1."""
    return 2 if usable_cores() >= 2 else 1


def parallel_parts(rows: int, split: bool = True) -> int:
    """How many parts a batch of `rows` sentences is cut into, decoded at the same time: `side_by_side()` for an even
    batch of PARTED_FROM sentences or more, with `split`; else 1."""
    if not split or rows % 2 or rows < PARTED_FROM:
        return 1
    return side_by_side()


def shrink_levels(rows: int, beams: int = 1) -> tuple[int, ...]:
    """The sentence counts a batch of `rows` goes through as its sentences finish: rows, rows // 4, rows // 16, ...,
    down to SMALLEST_LEVEL sentences of a beam search, SMALLEST_GREEDY_LEVEL of a greedy one."""
    smallest = SMALLEST_GREEDY_LEVEL if beams == 1 else SMALLEST_LEVEL
    levels = [rows]
    while levels[-1] >= 2 * smallest:
        levels.append(max(levels[-1] // SHRINK, smallest))
    return tuple(levels)


def cache_lengths(length: int, hypotheses: int, first: int = 16) -> list[int]:
    """The cache lengths a batch of `hypotheses` rows (sentences x beams) goes through: 16, 32, 64, ... and `length`
    last (at most about twice the one before: 16, 32, 65, not 16, 32, 64, 65); one cache of `length` below
    PHASED_FROM hypotheses, where a step's attention is a small part of it and each program costs more than it
    saves."""
    if hypotheses < PHASED_FROM:
        return [length]
    ends = []
    while first * 2 <= length:
        ends.append(first)
        first *= 2
    return ends + [length]


def callers_settings() -> Callable[[], contextlib.AbstractContextManager]:
    """The calling thread's jax settings a decoding depends on, to put in force in another thread (jax keeps the
    matmul precision and the default device per thread). Returns a function that makes the context manager."""
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


def select_rows(state: SearchState, memory, src, index):
    """Rows `index` (N,) of a decoding batch: of its state (every array with a row per sentence, but the cache,
    whose layout `model.select_cache` knows), of the encoder's output and of the sources."""
    index = jnp.asarray(index)
    if hasattr(state.cache, "select_rows"):  # an ensemble's caches (`ensemble.EnsembleCache`)
        cache = state.cache.select_rows(index, src.shape[0])
    else:
        cache = select_cache(state.cache, index, sentences=src.shape[0])
    take = lambda x: x if jnp.ndim(x) == 0 else jnp.take(x, index, axis=0)  # noqa: E731
    # (memory: an array, or an ensemble's tuple of them, rows first)
    return jax.tree.map(take, state.replace(cache=None)).replace(cache=cache), jax.tree.map(take, memory), take(src)


def grow(state: SearchState, length: int) -> SearchState:
    """`state` with its cache (and the table of slots over it) padded to `length` positions."""
    B, K, T = state.history.shape
    history = jnp.pad(state.history, ((0, 0), (0, 0), (0, length - T)))
    if hasattr(state.cache, "grow"):  # an ensemble's caches
        return state.replace(history=history, cache=state.cache.grow(length, K))
    return state.replace(history=history, cache=grow_cache(state.cache, length, K))


# One dispatch between two programs, not a few eager ops per leaf; compiled on first use.
_select_rows_jit = jax.jit(select_rows)
_grow_jit = jax.jit(grow, static_argnames="length")


def encoder_shape(rows: int, length: int, width: int) -> tuple[int, int]:
    """(rows, width) of the program that encodes `rows` sources of at most `length` tokens for a batch `width` wide."""
    length = max(length, 1)
    step = max(ENCODER_WIDTH_STEP, (1 << (length - 1).bit_length()) // 8)
    return rows, min(width, -(-length // step) * step)


def encoder_groups(lengths: np.ndarray, width: int) -> list[tuple[np.ndarray, int]]:
    """How a batch of sources of these lengths (B,), `width` wide, is encoded: (its rows, the width they are cut to)
    for each group. At most ENCODER_ROWS sources: one group, in the batch's order; more: sorted by length (filler
    rows of PAD only first), ENCODER_ROWS at a time."""
    B = len(lengths)
    if B <= ENCODER_ROWS:
        return [(np.arange(B), encoder_shape(B, int(np.max(lengths)), width)[1])]
    order = np.argsort(lengths, kind="stable")
    chunks = [order[start : start + ENCODER_ROWS] for start in range(0, B, ENCODER_ROWS)]
    return [(rows, encoder_shape(len(rows), int(np.max(lengths[rows])), width)[1]) for rows in chunks]


@jax.jit
def _in_row_order(pieces: tuple, inverse):
    """The groups' outputs put back in the batch's row order, in one program (eager ops would compile several)."""
    return jax.tree.map(lambda *parts: jnp.concatenate(parts)[inverse], *pieces)  # an array, or an ensemble's tuple


def encode_batch(params, config: TransformerConfig, src: np.ndarray):
    """The encoder's output (B, S, D) for right-padded sources (B, S), zero past each group's width (cross-attention
    masks those positions): the encoder over `encoder_groups` (a program per group's rows, cut width and the batch's
    width), the groups back in row order. A row of PAD only (`translate`'s filler) attends over zeros: its output is
    not the whole width's, and is thrown away."""
    S = src.shape[1]
    groups = encoder_groups(np.count_nonzero(src != config.pad_id, axis=1), S)
    encoder = search_programs(config).encoder
    if len(groups) == 1:
        (_, width), *_ = groups
        return encoder(params, src[:, :width], config=config, width=S)  # (B, S, D)
    pieces = [encoder(params, src[rows, :width], config=config, width=S) for rows, width in groups]
    order = np.concatenate([rows for rows, _ in groups])
    return _in_row_order(tuple(pieces), np.argsort(order).astype(np.int32))  # (B, S, D)


@dataclasses.dataclass(frozen=True)
class Scheduled(Whole):
    """The CPU's schedule (the module docstring says what it does and why). `split`: whether a batch may be cut in
    parts (False where whole batches are decoded side by side: `for_batches`)."""

    split: bool = True
    batches_side_by_side: bool = True  # False: a batch at a time, always cut in parts (one set of programs)

    def for_batches(self, n_batches: int) -> tuple[int, Schedule]:
        """`side_by_side()` whole batches at once where there are that many, none cut in parts: each core
        multiplies matrices of twice the rows of a half batch, and one that finishes goes on with the next batch
        instead of waiting for the other half. Else 1, a batch at a time, which `decode` may cut in parts."""
        threads = side_by_side()
        if self.batches_side_by_side and n_batches >= threads > 1:
            return threads, dataclasses.replace(self, split=False)
        return 1, self

    def decode(self, params, config, rules, src, rows, length):
        """`Whole.decode`, with the batch cut in `parallel_parts(B, split)` interleaved parts decoded at once (part i
        takes rows i, i + n, ...: `translate` sorts a batch by length and puts its filler rows last, so the parts get
        alike lengths), each shrinking and growing its cache as it goes (`_decode_part`). The rows are independent: the
        results are those of one loop over the whole batch, up to the rounding of smaller matrix products."""
        n = parallel_parts(src.shape[0], self.split)
        if n == 1:
            return self._decode_part(params, config, rules, src, rows, length)
        settings = callers_settings()

        def decode_part(i: int):
            with settings():
                part = jax.tree.map(lambda x: x[i::n], rows)
                return self._decode_part(params, config, rules, src[i::n], part, length)

        with ThreadPoolExecutor(n) as pool:  # jax releases the GIL while its programs run
            done = list(pool.map(decode_part, range(n)))
        # Row j of part i is row j * n + i (the parts are of equal size).
        return tuple(np.stack(pieces, axis=1).reshape(-1, *pieces[0].shape[1:]) for pieces in zip(*done))

    def _decode_part(self, params, config, rules, src, inputs: Rows, length):
        """One part: a program until at most the next level's sentences are open or its cache is full, then the open
        rows alone (copies of a finished one fill the level) with the cache grown to the next phase, and so on. The
        loop's bookkeeping runs in numpy on host copies of the state's flags and outputs (eager jax ops would compile
        a small program for each new shape)."""
        plan = self.plan(src.shape[0], rules.beams, length)
        memory = encode_batch(params, config, src)
        options = dict(config=config, length=length, cache_len=plan.ends[0])
        programs = search_programs(config)
        state = programs.start(params, src, memory, rules, inputs, plan.until(plan.levels[0]), **options)
        owners = np.arange(plan.levels[0])  # the original row of each row; -1: a filler copy of a finished row
        results = None  # `found`'s arrays, by original row
        while True:
            real = owners >= 0
            going = np.asarray(state.open) & real
            left = np.flatnonzero(going)
            rows = min(level for level in plan.levels if level >= len(left)) if len(left) else 0  # the next level
            if rows < len(owners):  # rows leave the batch (or all are done): keep their results
                now = found(state)
                if results is None:
                    results = tuple(np.zeros((plan.levels[0], *x.shape[1:]), x.dtype) for x in now)
                for kept, x in zip(results, now):
                    kept[owners[real]] = x[real]
            if len(left) == 0:
                return results
            T = state.history.shape[-1]
            full = int(state.step) >= T  # the program stopped because its cache is full
            if rows >= len(owners) and not (full and T < length):
                raise RuntimeError(f"decoding stopped with {len(left)} of {len(owners)} rows unfinished")
            if rows < len(owners):
                spare = np.flatnonzero(~going)[0]  # a finished row: its copies fill the level's remaining rows
                index = np.concatenate([left, np.full(rows - len(left), spare)])
                owners = np.concatenate([owners[left], np.full(rows - len(left), -1)])
                state, memory, src = _select_rows_jit(state, memory, src, index)
            if full:
                state = _grow_jit(state, length=next(end for end in plan.ends if end > T))
            assert (rows, state.history.shape[-1], True) in plan.programs  # what `programs` compiles ahead
            state = programs.resume(params, src, memory, rules, state, plan.until(rows), config=config)

    def encoder_shapes(self, row_lengths, width):
        n = parallel_parts(len(row_lengths), self.split)
        shapes = set()
        for i in range(n):  # part i takes rows i, i + n, ...
            shapes.update((len(group), cut, width) for group, cut in encoder_groups(row_lengths[i::n], width))
        return shapes

    def plan(self, rows, beams, length):
        """One loop of `rows` sentences (a part of a batch) shrinks through `shrink_levels` and grows its cache through
        `cache_lengths`."""
        return Plan(shrink_levels(rows, beams), tuple(cache_lengths(length, rows * beams)))

    def programs(self, params, config, rules, rows, width, length, phrases=None):
        rows //= parallel_parts(rows, self.split)  # each part runs the programs of its own rows
        return super().programs(params, config, rules, rows, width, length, phrases)

    def every_program(self, params, config, rules, rows, width, length, phrases=None):
        """`Whole.every_program` for this schedule: besides `programs`, the encoder at every width a group of a
        part's rows may be cut to, the program that puts the groups back in order, and the steps between two
        programs (rows leaving the batch: `select_rows`; the cache growing: `grow`) at every level and cache length
        the part's plan goes through."""
        jobs = dict(self.programs(params, config, rules, rows, width, length, phrases))
        part = rows // parallel_parts(rows, self.split)
        cuts = sorted({encoder_shape(1, n, width)[1] for n in range(1, width + 1)})
        groups = [part] if part <= ENCODER_ROWS else [ENCODER_ROWS] * (part // ENCODER_ROWS) + [part % ENCODER_ROWS]
        groups = [g for g in groups if g]
        shapes = {(g, cut, width) for g in set(groups) for cut in cuts}
        for shape, job in self.encoder_programs(params, config, sorted(shapes)).items():
            jobs[f"encoder {shape[0]}x{shape[1]} of width {width}"] = job
        if (
            len(groups) > 1
        ):  # (the groups' outputs are on the device, the order a host array: as `encode_batch` calls it)
            pieces = tuple(_memory(config, g, width) for g in groups)
            jobs[f"encoder order {part}x{width}"] = lambda: _both(_in_row_order, (pieces,), (_shape((part,)),))
        plan = self.plan(part, rules.beams, length)
        options = dict(config=config, length=length, cache_len=plan.ends[0])
        src, memory = _shape((part, width)), _memory(config, part, width)
        args = (params, src, memory, rules, row_shapes(part, length, phrases), _shape(()))
        first = jax.eval_shape(functools.partial(search_programs(config).start.__wrapped__, **options), *args)

        def state(level: int, end: int):  # the shape of the state of a program of `level` rows, a cache of `end`
            def shaped(first, memory, src):
                return grow(select_rows(first, memory, src, jnp.zeros(level, jnp.int32))[0], end)

            return jax.eval_shape(shaped, first, memory, src)

        def select_job(a: int, end: int, b: int):
            _both(_select_rows_jit, (state(a, end), _memory(config, a, width)), (_shape((a, width)), _shape((b,))))

        def grow_job(level: int, end: int, to: int):
            _both(_grow_jit, (state(level, end),), length=to)

        for a in plan.levels:
            for i, end in enumerate(plan.ends):
                for b in (b for b in plan.levels if b < a):
                    jobs[f"{a}x{width} cache {end} to {b} rows"] = functools.partial(select_job, a, end, b)
                if i + 1 < len(plan.ends):
                    jobs[f"{a}x{width} cache {end} to {plan.ends[i + 1]}"] = functools.partial(
                        grow_job, a, end, plan.ends[i + 1]
                    )
        return jobs
