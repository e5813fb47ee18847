"""Ensembles of checkpoints in the one search loop: several models decode together, their next-token distributions
combined at every step, and the search (`search.run`, any rules: beam, n-best, sampling, prefixes) sees one model.

The combination is fairseq's, with weights: the weighted mean of the members' probabilities,
log sum_i w_i p_i(y | x, y<t) with sum_i w_i = 1, returned to the loop as log-probs. It is a distribution (Marian's
weighted sum of log-probs is not: its scores stop being log P, and the rules' log_softmax would turn it into a
product of experts), so scores stay log-probs, the rules' bounds on them hold, and sampling draws from the mixture.
An ensemble of a model with itself gives that model's log-probs (up to rounding).

What the ensemble is: `Ensemble`, its static description `EnsembleConfig` (the members' configs, which are stacked)
and its weights (`params`: each group's stacked weights and log-weights). Members of one config form a group: their
weights are stacked and they run as one program over the stack (`jax.vmap` over the ensemble axis: one encoder, one
decoder step); groups of other sizes run side by side in the same step. Each member keeps its own cache
(`EnsembleCache`: one stacked cache per group), every cache laid out as the loop's `history` says.

The schedule (`schedule.Whole`, `schedule.Scheduled`) runs an ensemble through this module's programs (`encoder`,
`start`, `resume`: `EnsembleConfig.search_programs`), with the same signatures as `search`'s; the encoder's output
is a tuple (one (B, M, S, D) array per group: rows first, so that the schedule selects rows of it as of one
model's), and the cache knows how to select rows and grow (`EnsembleCache.select_rows`, `.grow`).

Members must share the target vocabulary (the tokenizer, the config's target vocabulary size and special ids):
`Ensemble.of` refuses others, naming both runs and what differs, before any decoding. The source side too: every
member reads the same source ids (one tokenizer for all).
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jax_transformer.compilation import exportable, jit_by_config
from jax_transformer.decoding import search
from jax_transformer.decoding.search import LOOP_CPU_OPTIONS, Rows, Rules, SearchState
from jax_transformer.errors import UsageError
from jax_transformer.model.transformer import Transformer, grow_cache, select_cache
from jax_transformer.settings.config import TransformerConfig

# The config fields every member must agree on (the target vocabulary and the loop's special ids; one tokenizer
# reads the sources for all, so the source vocabulary too), which the ensemble answers for all.
SHARED_FIELDS = ("tgt_vocab_size", "src_vocab_size", "pad_id", "eos_id", "bos_id", "start_id")


@dataclasses.dataclass(frozen=True)
class EnsembleConfig:
    """The static part of an ensemble (a program's `config`): its members' configs, in order, and its groups (the
    indices of the members of one config, stacked and run as one program). It answers the config fields the
    decoders read as one model's: the shared ones (`SHARED_FIELDS`), `max_len` (the smallest: a source and an
    output must fit every member) and `dtype` (the first member's; how to compute is given for all)."""

    members: tuple[TransformerConfig, ...]
    groups: tuple[tuple[int, ...], ...]

    def __getattr__(self, name: str):
        if name in SHARED_FIELDS or name in ("dtype", "quantize"):
            return getattr(self.members[0], name)
        raise AttributeError(f"an ensemble's config has no field {name!r} of one model")

    @property
    def max_len(self) -> int:
        return min(member.max_len for member in self.members)

    @property
    def num_decoder_layers(self) -> int:
        """The decoder layers every member has (the shallowest's): the layers an alignment layer may name."""
        return min(member.num_decoder_layers for member in self.members)

    @property
    def search_programs(self):
        """The programs a schedule runs an ensemble with (this module's `encoder`, `start`, `resume`)."""
        return sys.modules[__name__]

    def memory_shape(self, rows: int, width: int) -> tuple:
        """The shapes of `encoder`'s output for (rows, width) sources: (rows, M_g, width, D_g) per group, float32."""
        return tuple(
            jax.ShapeDtypeStruct((rows, len(group), width, self.group_config(g).d_model), jnp.float32)
            for g, group in enumerate(self.groups)
        )

    def group_config(self, g: int) -> TransformerConfig:
        return self.members[self.groups[g][0]]


@dataclasses.dataclass(frozen=True)
class Ensemble:
    """Models decoding together: `config` (static) and `params` ({"groups": each group's weights stacked on a first
    axis, "log_weights": each group's members' log-weights (M_g,)}), with the runs they came from (`names`) and
    their normalised `weights` in member order."""

    config: EnsembleConfig
    params: Any
    names: tuple[str, ...]
    weights: tuple[float, ...]

    @classmethod
    def of(
        cls,
        configs: Sequence[TransformerConfig],
        params: Sequence[Any],
        weights: Sequence[float] | None = None,
        *,
        names: Sequence[str] | None = None,
        tokenizers: Sequence[Any] | None = None,
    ) -> Ensemble:
        """An ensemble of models (their configs and weights, in order), weighted by `weights` (default: equal;
        normalised to sum to 1). `names` (the runs, for messages) and `tokenizers` (compared for a shared
        vocabulary): a UsageError naming both runs and what differs where two members do not share it."""
        n = len(configs)
        names = tuple(str(x) for x in (names or [f"model {i}" for i in range(n)]))
        if n < 1 or len(params) != n or len(names) != n:
            raise ValueError(
                f"an ensemble needs one config, params and name per member: {n}, {len(params)}, {len(names)}"
            )
        weights = [1.0] * n if weights is None else [float(w) for w in weights]
        if len(weights) != n:
            raise UsageError(
                f"ensemble weights (--ensemble-weights): {len(weights)} weights for {n} checkpoints; give one each"
            )
        if not all(np.isfinite(w) and w > 0 for w in weights):
            raise UsageError(f"ensemble weights (--ensemble-weights): each must be a finite number > 0, got {weights}")
        check_shared_vocabulary(configs, names, tokenizers)
        order: dict[TransformerConfig, list[int]] = {}
        for i, config in enumerate(configs):
            order.setdefault(config, []).append(i)
        groups = tuple(tuple(members) for members in order.values())
        total = sum(weights)
        normalised = tuple(w / total for w in weights)
        # On the host (a checkpoint's weights are numpy arrays): eager jnp.stack would compile a program per shape.
        stack = lambda *xs: np.stack([np.asarray(x) for x in xs])  # noqa: E731
        stacked = tuple(jax.tree.map(stack, *(params[i] for i in group)) for group in groups)
        log_weights = tuple(np.log(np.array([normalised[i] for i in group], np.float32)) for group in groups)
        config = EnsembleConfig(tuple(configs), groups)
        return cls(config, {"groups": stacked, "log_weights": log_weights}, names, normalised)


def check_shared_vocabulary(configs: Sequence[TransformerConfig], names: Sequence[str], tokenizers=None) -> None:
    """A UsageError naming the first member and the one that differs, and what differs, unless every member has
    the first's vocabulary: the config's vocabulary sizes and special ids (`SHARED_FIELDS`) and the tokenizer."""
    for i in range(1, len(configs)):
        for field in SHARED_FIELDS:
            a, b = getattr(configs[0], field), getattr(configs[i], field)
            if a != b:
                raise UsageError(
                    f"an ensemble's models must share their vocabulary: {names[0]} has {field}={a}, {names[i]} has "
                    f"{field}={b}"
                )
        if tokenizers is not None and tokenizers[0].to_bytes() != tokenizers[i].to_bytes():
            raise UsageError(
                f"an ensemble's models must share their vocabulary: the tokenizers of {names[0]} and {names[i]} "
                f"differ ({_tokenizer_difference(tokenizers[0], tokenizers[i], configs[0].tgt_vocab_size)})"
            )


def _tokenizer_difference(a, b, size: int) -> str:
    """What tells two tokenizers apart, in words: the first target id whose piece differs, where they say."""
    try:
        for i in range(size):
            if a.piece(i) != b.piece(i):
                return f"target id {i} is {a.piece(i)!r} in one, {b.piece(i)!r} in the other"
    except (IndexError, ValueError, KeyError, TypeError):
        pass
    return "their files differ"


# =============================================================================================================
# The cache and the step function
# =============================================================================================================


@exportable
@flax.struct.dataclass
class EnsembleCache:
    """Each group's decoding cache, its members stacked on a first axis (the model's layout below it)."""

    groups: tuple

    def select_rows(self, index, sentences: int) -> EnsembleCache:
        """The caches of sentences `index` (N,) of `sentences` (`model.select_cache`, under each stack)."""
        select = jax.vmap(lambda cache: select_cache(cache, index, sentences=sentences))
        return EnsembleCache(tuple(select(cache) for cache in self.groups))

    def grow(self, length: int, slots: int) -> EnsembleCache:
        """The caches grown to `length` positions (`model.grow_cache`, under each stack)."""
        return EnsembleCache(tuple(jax.vmap(lambda c: grow_cache(c, length, slots))(cache) for cache in self.groups))


def combine(log_probs, log_weights):
    """The ensemble's next-token log-probs log sum_i w_i p_i: log_probs (M, N, V) of each member, log_weights
    (M,) -> (N, V). `jax.nn.logsumexp`'s steps, unrolled over the members (M is static and small): XLA:CPU's
    reduction over a major axis of (M, N, V) (a YNNPACK fusion) ran several times slower than these elementwise ops."""
    terms = [log_probs[i] + log_weights[i] for i in range(log_probs.shape[0])]  # (N, V) each
    top = functools.reduce(jnp.maximum, terms)
    top = jax.lax.stop_gradient(jnp.where(jnp.isfinite(top), top, 0.0))  # as logsumexp: -inf rows stay -inf
    return jnp.log(functools.reduce(jnp.add, [jnp.exp(t - top) for t in terms])) + top


def step_function(config: EnsembleConfig, params, memory, src, alignment_layer: int | None = None):
    """The loop's `step_fn(tokens, cache, history, step) -> (log-probs (N, V), cache)` of an ensemble: each group
    steps its stacked members at once (vmap), every member's log-probs combined (`combine`). With `alignment_layer`,
    also that layer's cross-attention (N, S) of every member (`search.aligned_decode_step`), averaged with the
    ensemble's weights (the weights of the distributions; -1 at PAD and EOS, as for one model)."""
    models = [Transformer(config.group_config(g)) for g in range(len(config.groups))]
    # The output projections laid out once before the loop, as `search` does for one model.
    kernels = [jax.vmap(functools.partial(search.output_kernel, m))(p) for m, p in zip(models, params["groups"])]

    def step_fn(tokens, cache: EnsembleCache, history, step):
        log_probs, caches, attentions = [], [], []
        for g, model in enumerate(models):

            def member(p, c, m, k, model=model):
                if alignment_layer is None:
                    return search.decode_step(model, p, c, m, src, tokens, step, history, k)
                return search.aligned_decode_step(model, p, c, m, src, tokens, step, history, k, alignment_layer)

            out = jax.vmap(member, in_axes=(0, 0, 1, 0))(params["groups"][g], cache.groups[g], memory[g], kernels[g])
            log_probs.append(jax.nn.log_softmax(out[0].astype(jnp.float32), axis=-1))  # (M_g, N, V)
            caches.append(out[1])
            attentions.extend(out[2:])  # (M_g, N, S), with alignments
        log_weights = jnp.concatenate(params["log_weights"])
        combined = combine(jnp.concatenate(log_probs), log_weights), EnsembleCache(tuple(caches))
        if alignment_layer is None:
            return combined
        weights = jnp.exp(log_weights)[:, None, None]  # (M, 1, 1), summing to 1: PAD and EOS stay -1
        return *combined, jnp.sum(weights * jnp.concatenate(attentions).astype(jnp.float32), axis=0)  # (N, S)

    return step_fn


# =============================================================================================================
# The programs: `search.encoder`, `search.start` and `search.resume` of an ensemble
# =============================================================================================================


@functools.partial(jit_by_config, static_argnames=("config", "width"))
def encoder(params, src, *, config: EnsembleConfig, width: int):
    """src (n, w) -> each group's encoder output (n, M_g, width, D), zero past w."""
    out = []
    for g, stacked in enumerate(params["groups"]):
        one = functools.partial(search.encoder.__wrapped__, src=src, config=config.group_config(g), width=width)
        out.append(jnp.swapaxes(jax.vmap(lambda p, one=one: one(p))(stacked), 0, 1))  # (n, M_g, width, D)
    return tuple(out)


def _caches(config: EnsembleConfig, params, memory, src, cache_len: int, beams: int) -> EnsembleCache:
    caches = []
    for g, stacked in enumerate(params["groups"]):
        model = Transformer(config.group_config(g))

        def create(p, m, model=model):
            return search.create_cache(model, p, m, src, cache_len, beams)

        caches.append(jax.vmap(create, in_axes=(0, 1))(stacked, memory[g]))
    return EnsembleCache(tuple(caches))


@functools.partial(jit_by_config, static_argnames=("config", "length", "cache_len"), cpu_options=LOOP_CPU_OPTIONS)
def start(params, src, memory, rules: Rules, rows: Rows, until, *, config: EnsembleConfig, length: int, cache_len: int):
    """`search.start` of an ensemble: `memory` is `encoder`'s (a tuple, one array per group)."""
    cache = _caches(config, params, memory, src, cache_len, rules.beams)
    state = search.initial_state(rules, src, rows, length, cache_len, cache, config.pad_id)
    return search.run(state, rules, step_function(config, params, memory, src, rules.alignment_layer), until)


@functools.partial(jit_by_config, static_argnames=("config",), cpu_options=LOOP_CPU_OPTIONS)
def resume(params, src, memory, rules: Rules, state: SearchState, until, *, config: EnsembleConfig):
    """`search.resume` of an ensemble."""
    return search.run(state, rules, step_function(config, params, memory, src, rules.alignment_layer), until)
