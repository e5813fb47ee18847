"""Decoding as transformers' `generate` does it, for the models imported from it (Marian, FSMT): greedy search and
beam search with its rules, compiled whole like `jax_transformer.decoding` (whose cache, steps and shrinking batches
it reuses), so an imported model gives the tokens its PyTorch implementation gives.

Where transformers' rules differ from this project's (GNMT's, `decoding.beam_search`): the output may be at most
`max_length` tokens long counting the decoder's start token; at the last position only EOS may come
(`forced_eos`, transformers' ForcedEOSTokenLogitsProcessor); `banned` ids (its bad_words_ids of one token) are never
produced, nothing else is; a finished hypothesis scores log P / (generated tokens)^length_penalty; of the 2K best
extensions, those among the first K that end (EOS, or the length limit) join the finished set, which keeps the K
best; `early_stopping` True stops a sentence once K hypotheses are finished, False once the best running
hypothesis's log P divided by its current length^length_penalty cannot beat the worst finished one, "never" (with
a positive length_penalty) once it cannot at max_length. The search ends when no sentence can improve (`_open`).
A row of PAD only (a filler row of `translate`'s fixed batch shapes) is finished from the start and comes out all
PAD: decoded, it could keep the whole batch's loop running to max_length.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_transformer.compilation import exportable, jit_by_config
from jax_transformer.config import TransformerConfig
from jax_transformer.decoding import (
    LOOP_CPU_OPTIONS,
    check_source,
    create_cache,
    decode_shrinking,
    decode_step,
    encode_batch,
    first_argmax,
    gather_beams,
    on_device,
    output_kernel,
    phases,
    reorder_cache,
    run_phase,
    shrinking_programs,
    top_k,
)
from jax_transformer.model import Transformer

EARLY_STOPPING = ("false", "true", "never")
NEG = -1.0e9  # transformers' "very large negative" for scores that must not be chosen


def _processed(
    log_probs, generated: int, max_length: int, config: TransformerConfig, banned: tuple, forced_eos, min_length
):
    """transformers' logits processors on next-token log-probs (B, V) after `generated` tokens: banned ids -inf;
    EOS -inf before min_length; at the last position (the sequence would reach max_length) everything but EOS."""
    for i in banned:
        log_probs = log_probs.at[..., i].set(-jnp.inf)
    eos = config.eos_id
    log_probs = log_probs.at[..., eos].set(jnp.where(generated + 1 < min_length, -jnp.inf, log_probs[..., eos]))
    if forced_eos:
        last = generated + 1 == max_length - 1  # the sequence (start token included) is max_length - 1 long
        only_eos = jnp.full_like(log_probs, -jnp.inf).at[..., eos].set(0.0)
        log_probs = jnp.where(last, only_eos, log_probs)
    return log_probs


@functools.partial(
    jit_by_config, static_argnames=("config", "max_length", "banned", "forced_eos"), cpu_options=LOOP_CPU_OPTIONS
)
def _greedy_core(
    params, src, min_length, leave_at, carried, *, config: TransformerConfig, max_length, banned, forced_eos
):
    """src (B, S) -> (state, memory), once every row is done or at most `leave_at` rows are not
    (`decoding.decode_shrinking`); `carried`: a (state, memory) returned before, to go on from, or (None, the
    encoder's output) to start."""
    model, B, L = Transformer(config), src.shape[0], max_length - 1
    kernel = output_kernel(model, params)

    def advance(state):
        t, last, tokens, done, cache = state
        logits, cache = decode_step(model, params, cache, memory, src, last, kernel)
        scores = _processed(logits, t, max_length, config, banned, forced_eos, min_length)
        token = jnp.where(done, config.pad_id, first_argmax(scores))  # finished rows get PAD, as transformers does
        done = done | (token == config.eos_id) | (t + 2 >= max_length)
        return t + 1, token, tokens.at[:, t].set(token), done, cache

    state, memory = carried
    if state is None:
        state = (
            jnp.array(0, jnp.int32),  # t
            jnp.full((B,), config.start_id, jnp.int32),  # last tokens
            jnp.full((B, L), config.pad_id, jnp.int32),  # tokens
            jnp.all(src == config.pad_id, axis=1),  # done: filler rows from the start
            create_cache(model, params, memory, src, phases(L, B)[0]),
        )
    return run_phase(lambda s: (s[0] < L) & (jnp.sum(~s[3]) > leave_at), advance, state), memory


@exportable  # a program that carries it can be stored (compilation.ProgramStore)
@flax.struct.dataclass
class _Beams:
    t: jnp.ndarray  # () tokens generated so far
    running: jnp.ndarray  # (B, K, L) running hypotheses
    running_scores: jnp.ndarray  # (B, K) their log P (NEG: an empty slot)
    finished: jnp.ndarray  # (B, K, L) finished hypotheses, best first
    finished_scores: jnp.ndarray  # (B, K) their scores (NEG: an empty slot)
    is_finished: jnp.ndarray  # (B, K) which finished slots hold a hypothesis
    improvable: jnp.ndarray  # (B,) transformers' early-stop heuristic: can this sentence still improve?
    all_stopped: jnp.ndarray  # () every candidate of the last step hit a stopping criterion
    cache: Any


@functools.partial(
    jit_by_config,
    static_argnames=("config", "max_length", "beam_size", "early_stopping", "banned", "forced_eos"),
    cpu_options=LOOP_CPU_OPTIONS,
)
def _beam_core(
    params,
    src,
    min_length,
    length_penalty,
    leave_at,
    carried,
    *,
    config,
    max_length,
    beam_size,
    early_stopping,
    banned,
    forced_eos,
):
    """src (B, S) -> (_Beams, memory), once every sentence is done or at most `leave_at` are not
    (`decoding.decode_shrinking`); `carried`: a (state, memory) returned before, to go on from, or (None, the
    encoder's output) to start."""
    model, B, K, L = Transformer(config), src.shape[0], beam_size, max_length - 1
    kernel = output_kernel(model, params)

    def more(s: _Beams):
        return jnp.sum(_open(s, L, early_stopping)) > leave_at

    def advance(s: _Beams) -> _Beams:
        t = s.t
        last = jnp.where(t == 0, config.start_id, s.running[:, :, jnp.maximum(t - 1, 0)]).reshape(-1)
        logits, cache = decode_step(model, params, s.cache, memory, src, last, kernel)
        log_probs = _processed(jax.nn.log_softmax(logits, -1), t, max_length, config, banned, forced_eos, min_length)
        V = log_probs.shape[-1]
        total = (log_probs.reshape(B, K, V) + s.running_scores[:, :, None]).reshape(B, K * V)
        top_scores, top = top_k(total, 2 * K)  # (B, 2K)
        parents, tokens = top // V, top % V
        candidates = gather_beams(s.running, parents).at[:, :, t].set(tokens)  # (B, 2K, L)
        stops = (tokens == config.eos_id) | (t + 2 >= max_length)  # EOS, or the sequence reaches max_length
        # Running: the K best candidates that did not stop.
        running_scores, pick = lax.top_k(top_scores + stops * NEG, K)
        running = gather_beams(candidates, pick)
        cache = reorder_cache(cache, jnp.take_along_axis(parents, pick, axis=1), K)
        # Finished: of the first K candidates, those that stopped, scored by length; the K best of old and new.
        just_finished = stops & (jnp.arange(2 * K) < K)[None, :]
        scores = top_scores / ((t + 1.0) ** length_penalty)
        full = jnp.all(s.is_finished, axis=1, keepdims=True) & (early_stopping == "true")
        scores = scores + full * NEG + (~s.improvable[:, None]) * NEG + (~just_finished) * NEG
        merged = jnp.concatenate([s.finished_scores, scores], axis=1)
        finished_scores, pick = lax.top_k(merged, K)
        finished = gather_beams(jnp.concatenate([s.finished, candidates], axis=1), pick)
        is_finished = gather_beams(jnp.concatenate([s.is_finished, just_finished], axis=1), pick)
        # The heuristic, with the length after this step.
        length = jnp.where((early_stopping == "never") & (length_penalty > 0), max_length - 1.0, t + 1.0)
        best_possible = running_scores[:, 0] / (length**length_penalty)
        worst = jnp.where(is_finished, jnp.min(finished_scores, axis=1, keepdims=True), NEG)
        improvable = s.improvable & jnp.any(best_possible[:, None] > worst, axis=1)
        return _Beams(
            t + 1, running, running_scores, finished, finished_scores, is_finished, improvable, jnp.all(stops), cache
        )

    state, memory = carried
    if state is None:
        start = jnp.where(jnp.arange(K) == 0, 0.0, NEG)
        state = _Beams(
            t=jnp.array(0, jnp.int32),
            running=jnp.full((B, K, L), config.pad_id, jnp.int32),
            running_scores=jnp.tile(start, (B, 1)).astype(jnp.float32),
            finished=jnp.full((B, K, L), config.pad_id, jnp.int32),
            finished_scores=jnp.full((B, K), NEG, jnp.float32),
            is_finished=jnp.zeros((B, K), bool),
            improvable=~jnp.all(src == config.pad_id, axis=1),  # filler rows have nothing to improve
            all_stopped=jnp.array(False),
            # a source's K hypotheses share its keys/values
            cache=create_cache(model, params, memory, src, phases(L, B * K)[0], beams=K),
        )
    return run_phase(more, advance, state), memory


def _flags(s: _Beams) -> _Beams:
    """The state's per-sentence flags and step on the host (what `_open` reads), without its tokens and cache."""
    return jax.device_get(s.replace(running=None, finished=None, cache=None))


def _open(s: _Beams, L: int, early_stopping: str, xp=jnp):
    """(B,) the sentences whose finished set can still change: improvable, not yet full under early_stopping
    True (transformers marks those done), before the length limit. The search ends when none is. `xp`: jax.numpy
    in the loop, numpy on a host copy of the state (`decoding.decode_shrinking`)."""
    full = xp.all(s.is_finished, axis=1) & (early_stopping == "true")
    return s.improvable & ~full & (s.t < L) & ~s.all_stopped


def generate(
    params,
    config: TransformerConfig,
    src,
    *,
    max_length: int,
    num_beams: int = 1,
    length_penalty: float = 1.0,
    early_stopping: str = "false",
    banned: tuple[int, ...] = (),
    forced_eos: bool = False,
    min_length: int = 0,
    split: bool = True,
) -> np.ndarray:
    """transformers' `generate(num_beams=..., do_sample=False)` on right-padded sources (B, S): tokens (B,
    max_length - 1) without the decoder's start token, PAD after the end. `early_stopping`: "false", "true" or
    "never"; `banned`: ids never produced; `forced_eos`: only EOS at the last position; `split`: as for
    `decoding.greedy_search`."""
    src = check_source(src, config)
    if early_stopping not in EARLY_STOPPING:
        raise ValueError(f"early_stopping must be one of {EARLY_STOPPING}, got {early_stopping!r}")
    if not 2 <= max_length <= config.max_len + 1:
        raise ValueError(f"max_length must be in [2, config.max_len + 1 = {config.max_len + 1}], got {max_length}")
    options = dict(
        config=config, max_length=int(max_length), banned=tuple(int(i) for i in banned), forced_eos=bool(forced_eos)
    )
    min_length, params = np.int32(min_length), on_device(params)
    encode = functools.partial(encode_batch, params, config)
    if num_beams == 1:

        def run(rows, leave_at, carried):
            return _greedy_core(params, rows[0], min_length, leave_at, carried, **options)

        (tokens,) = decode_shrinking(
            run,
            encode,
            (src,),
            unfinished=lambda s: ~np.asarray(s[3]),
            outputs=lambda s: (np.asarray(s[2]),),
            length=max_length - 1,
            split=split,
        )
        return tokens
    length_penalty = np.float32(length_penalty)
    options.update(beam_size=int(num_beams), early_stopping=early_stopping)

    def run(rows, leave_at, carried):
        return _beam_core(params, rows[0], min_length, length_penalty, leave_at, carried, **options)

    (tokens,) = decode_shrinking(
        run,
        encode,
        (src,),
        unfinished=lambda s: _open(_flags(s), max_length - 1, early_stopping, np),
        outputs=lambda s: (np.asarray(s.finished)[:, 0],),
        length=max_length - 1,
        beams=int(num_beams),
        split=split,
    )
    return tokens


def _options(config: TransformerConfig, decode) -> dict[str, Any]:
    """generate's keyword arguments from a `DecodeConfig` (max_length defaults to the model's max_len + 1)."""
    max_length = decode.max_length or config.max_len + 1
    return dict(
        max_length=min(max_length, config.max_len + 1),
        early_stopping=decode.early_stopping,
        banned=decode.banned_ids(),
        forced_eos=decode.forced_eos,
        min_length=decode.min_length,
    )


def generate_as(
    params, config: TransformerConfig, src, decode, *, num_beams: int, length_penalty: float, split: bool = True
) -> np.ndarray:
    """`generate` with the settings of a `DecodeConfig` (its rules "transformers")."""
    options = _options(config, decode)
    return generate(params, config, src, num_beams=num_beams, length_penalty=length_penalty, split=split, **options)


def compile_generate(
    params, config: TransformerConfig, rows: int, width: int, num_beams: int, decode, split: bool = True
) -> dict:
    """Compile jobs for the programs `generate_as` runs on (rows, width) sources (with `split`), {rows of a level
    of `decoding.shrink_levels`: a function that compiles it}: run them and its calls compile nothing."""
    options = _options(config, decode)
    static = dict(
        config=config,
        max_length=options["max_length"],
        banned=tuple(options["banned"]),
        forced_eos=bool(options["forced_eos"]),
    )
    scalar = jax.ShapeDtypeStruct((), jnp.int32)
    per_row = lambda n: (jax.ShapeDtypeStruct((n, width), jnp.int32),)  # noqa: E731
    length = static["max_length"] - 1  # tokens produced at most: the cache's last length
    if num_beams == 1:
        return shrinking_programs(_greedy_core, params, rows, per_row, (scalar,), static, length, split=split)
    static.update(beam_size=int(num_beams), early_stopping=options["early_stopping"])
    penalty = jax.ShapeDtypeStruct((), jnp.float32)
    return shrinking_programs(
        _beam_core, params, rows, per_row, (scalar, penalty), static, length, int(num_beams), split=split
    )
