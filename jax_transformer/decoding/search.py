"""One search loop for every decoder: beam search over the model's key/value cache, greedy search being the same
loop with one hypothesis, compiled whole (`jax.jit` around a `lax.while_loop`). What differs between decoders is
their rules, a strategy object (`Rules`): how tokens are scored and banned, what score a finished hypothesis gets,
when a sentence stops. `Gnmt` is this project's (fairseq's limits, GNMT's length penalty; the PyTorch twin's
`torch_reference/decoding.py` gives the same tokens), `Transformers` is transformers' `generate`, for the models
imported from it. Either may sample instead of search (`Sampler`: temperature, top-k, top-p), and every row may
start from a target prefix of its own (`Rows`).

The loop knows nothing of the model: it calls `step_fn(tokens, cache, history, step) -> (logits, cache)`, with the
beams of each sentence folded into the batch, and keeps the beam layout itself (which cache slot holds each
position of a hypothesis's past: `SearchState.history`). `start` and `resume` are its two programs: a search from
the encoder's output, and one that goes on from a state. `jax_transformer.decoding.schedule` decides how a batch runs
through them; `jax_transformer.decoding.decoders` holds the functions callers use. Conventions in full:
docs/internals.md#search.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from jax import lax

from jax_transformer.compilation import exportable, jit_by_config
from jax_transformer.decoding import constraints
from jax_transformer.model.transformer import Transformer, cross_attention_rows
from jax_transformer.settings.config import TransformerConfig

# Shapes: B sentences, K hypotheses per sentence (beams), C candidates per sentence and step (2K; 1 for greedy),
# L output length, T cache length, V vocabulary.


@exportable
@flax.struct.dataclass
class Rows:
    """What each row of a batch brings to its search besides its source: its length limit, a target prefix (forced
    first tokens: given, not chosen, so scored 0 and not counted in the length penalty's length) and the id of
    its random draws (sampling; `decoding.draw_ids`: from the sentence itself, so that its sample does not depend on
    its batch)."""

    limit: jnp.ndarray  # (B,) int32: tokens the row may produce, EOS and prefix included
    prefix: jnp.ndarray  # (B, L) int32: the prefix's tokens first, PAD after
    prefix_len: jnp.ndarray  # (B,) int32
    draw: jnp.ndarray  # (B,) uint32
    # Lexical constraints (`decoding.constraints`); None: none, and the program is the one without them.
    phrases: jnp.ndarray | None = None  # (B, P, M) int32: phrases that must appear, PAD-padded
    phrase_len: jnp.ndarray | None = None  # (B, P) int32: their lengths, 0 for an unused slot
    ordered: jnp.ndarray | None = None  # (B,) bool: the phrases must appear in their order
    banned: jnp.ndarray | None = None  # (B, Q, M) int32: phrases that must not appear, PAD-padded
    banned_len: jnp.ndarray | None = None  # (B, Q) int32


@exportable  # a program that carries it can be stored (compilation.ProgramStore)
@flax.struct.dataclass
class SearchState:
    """Everything the loop carries."""

    step: jnp.ndarray  # () int32: tokens produced so far by every live hypothesis
    live_tokens: jnp.ndarray  # (B, K, L) int32: live hypotheses, best first, PAD beyond `step`
    live_scores: jnp.ndarray  # (B, K) float32: their log P; `rules.impossible` marks an empty slot
    finished_tokens: jnp.ndarray  # (B, K, L) int32: finished hypotheses, best first
    finished_scores: jnp.ndarray  # (B, K) float32: their scores by the rules; `rules.impossible`: an empty slot
    finished: jnp.ndarray  # (B, K) bool: which finished slots hold a hypothesis
    open: jnp.ndarray  # (B,) bool: sentences whose finished set may still change
    rows: Rows  # (B, ...) each row's limit, prefix and draw id
    live_token_scores: jnp.ndarray  # (B, K, L) float32: each live token's log-prob (0 for a prefix's)
    finished_token_scores: jnp.ndarray  # (B, K, L) float32: those of the finished hypotheses
    history: jnp.ndarray  # (B, K, T) int32: the cache slot that holds position t of each live hypothesis's past
    cache: Any  # the model's decoding cache, its self-attention with K slots per sentence
    # With `Rules.alignment_layer` set, (B, K, L) int32: the source position each token attends to most (-1 beyond
    # `step`); else None, the state of a search without alignments.
    live_alignment: Any = None
    finished_alignment: Any = None
    met_at: jnp.ndarray | None = None  # (B, K, P) int32: where each phrase was met (`constraints`); -1: unmet
    progress: jnp.ndarray | None = None  # (B, K, P) int32: each phrase's first tokens that end the hypothesis


# =============================================================================================================
# The rules: a strategy object, a pytree (static fields are part of the program, arrays are its arguments)
# =============================================================================================================


@flax.struct.dataclass
class Rules:
    """What a search's rules decide, around the loop's fixed skeleton (extend, rank, live set, finished set).
    Subclasses: `Gnmt`, `Transformers`."""

    beams: int = flax.struct.field(pytree_node=False)  # K hypotheses per sentence
    greedy: bool = flax.struct.field(pytree_node=False)  # rank by the step's scores alone, one candidate (K = 1)
    start_id: int = flax.struct.field(pytree_node=False)  # the decoder's first input
    eos_id: int = flax.struct.field(pytree_node=False)
    impossible = -jnp.inf  # the score of an empty slot and of what may not be chosen
    sampler = None  # a `Sampler` (a field of each subclass): sampling instead of search
    # The decoder layer whose cross-attention aligns each token to a source position (a field of each subclass;
    # `decoding.alignment`); None: no alignments, the loop as without them.
    alignment_layer = None

    def token_scores(self, logits, step, past):
        """(N, V) scores of the next token for ranking (log-probs, with banned tokens made impossible); `past`:
        (N, L) the hypotheses' tokens so far (positions from `step` on are padding)."""
        raise NotImplementedError

    def token_log_probs(self, scores):
        """(..., V) the log-probs of the next token that `scores` (`token_scores`') stand for: themselves."""
        return scores

    def exclude(self, scores, mask):
        """`scores` with the entries of `mask` out of the live set's reach: set to `impossible` here (transformers'
        rules add it instead)."""
        return jnp.where(mask, self.impossible, scores)

    def finished_score(self, log_p, generated):
        """(B, C) the score of hypotheses of log P `log_p` that end with `generated` (B, 1) tokens after their
        prefix."""
        raise NotImplementedError

    def still_open(self, s: SearchState, live_scores, finished_scores, finished, ends):
        """(B,) the sentences whose finished set may still change after this step (`s` is the state before it)."""
        raise NotImplementedError

    def initially_open(self, src, pad_id: int):
        """(B,) the sentences that are searched at all."""
        return jnp.ones(src.shape[0], bool)

    def candidates(self, live_scores, scores, log_probs, keys):
        """The step's candidates: (log P (B, C), parent hypothesis (B, C), token (B, C)), best first. Greedy: the
        best token of the step's scores (first index on ties), or with a `sampler` one drawn from them (`keys`
        (B, 2): the rows' keys of this step), its log P grown by its `log_probs` (`token_log_probs`); beam search:
        the 2K best extensions of the K live hypotheses (earlier beam, then lower token id, on ties)."""
        B, K, V = scores.shape
        if self.greedy:
            if K != 1:
                raise ValueError(f"greedy search has one hypothesis per sentence, got beams={K}")
            if self.sampler is None:
                token = first_argmax(scores[:, 0])[:, None]  # (B, 1)
            else:
                token = jax.vmap(jax.random.categorical)(keys, self.sampler.warp(scores[:, 0]))[:, None]
            gained = jnp.take_along_axis(log_probs[:, 0], token, axis=-1)
            return live_scores + gained, jnp.zeros_like(token), token
        extended = live_scores[:, :, None] + scores  # (B, K, V)
        log_p, index = top_k(extended.reshape(B, K * V), 2 * K)  # (B, 2K)
        return log_p, index // V, index % V


@exportable
@flax.struct.dataclass
class Sampler:
    """Sampling instead of search (one hypothesis per row): the next token is drawn from the step's scores warped
    as transformers' logits warpers do, in their order: divided by `temperature`, then only the `top_k` best
    (0: all), then only the smallest set of best tokens whose probabilities add up to more than `top_p`
    (TopPLogitsWarper: the others are those whose cumulative probability, counted from the least likely, is at
    most 1 - top_p; the best is always kept). A row's draw at step t is keyed by (seed, its draw id, t)."""

    temperature: jnp.ndarray  # () float32, > 0
    top_p: jnp.ndarray  # () float32 in (0, 1]
    seed: jnp.ndarray  # () uint32
    top_k: int = flax.struct.field(pytree_node=False, default=0)

    def warp(self, scores):
        """(N, V) the warped scores, -inf where a token may not be drawn."""
        scores = scores / self.temperature
        if self.top_k:
            kth = lax.top_k(scores, min(self.top_k, scores.shape[-1]))[0][..., -1:]  # (N, 1)
            scores = jnp.where(scores < kth, -jnp.inf, scores)
        ascending = jnp.argsort(scores, axis=-1)  # (N, V)
        ordered = jnp.take_along_axis(scores, ascending, axis=-1)
        remove = jnp.cumsum(jax.nn.softmax(ordered, axis=-1), axis=-1) <= 1 - self.top_p
        remove = remove.at[..., -1].set(False)  # the best token stays
        rows = jnp.arange(scores.shape[0])[:, None]
        removed = jnp.zeros(scores.shape, bool).at[rows, ascending].set(remove)
        return jnp.where((self.top_p < 1) & removed, -jnp.inf, scores)

    def keys(self, draw, step):
        """(B, 2) the rows' keys at `step`, from their draw ids (B,)."""
        base = jax.random.PRNGKey(self.seed)
        return jax.vmap(lambda d: jax.random.fold_in(jax.random.fold_in(base, d), step))(draw)


@exportable
@flax.struct.dataclass
class Gnmt(Rules):
    """This project's rules (as the PyTorch twin's decoders): PAD and BOS never produced, EOS not before `min_len`
    tokens; a sentence may produce `SearchState.limit` tokens (fairseq's length rule, `decoding.max_new_tokens`);
    a finished hypothesis scores log P / penalty(length), GNMT's ((5 + length) / 6) ** alpha; a sentence is done
    at its length limit, or once it has K finished hypotheses and no live one can still beat the worst of them
    (Flax's WMT example: log-probs only fall and the penalty only grows). Greedy: the sum of the log-probs, done
    at its first EOS."""

    penalties: jnp.ndarray  # (L + 1,) float32: the length penalty of each length (`decoding.length_penalties`)
    min_len: jnp.ndarray  # () int32
    pad_id: int = flax.struct.field(pytree_node=False)
    bos_id: int | None = flax.struct.field(pytree_node=False)
    sampler: Sampler | None = None
    alignment_layer: int | None = flax.struct.field(pytree_node=False, default=None)

    def token_scores(self, logits, step, past):
        # No renormalisation after the bans, as fairseq does.
        log_probs = jax.nn.log_softmax(logits, axis=-1).at[..., self.pad_id].set(-jnp.inf)
        if self.bos_id is not None:
            log_probs = log_probs.at[..., self.bos_id].set(-jnp.inf)
        eos = log_probs[..., self.eos_id]
        return log_probs.at[..., self.eos_id].set(jnp.where(step < self.min_len, -jnp.inf, eos))

    def finished_score(self, log_p, generated):
        return log_p / self.penalties[generated]  # greedy's penalties are all 1 (alpha 0): the sum itself

    def still_open(self, s, live_scores, finished_scores, finished, ends):
        if self.greedy:
            return s.open & ~finished[:, 0]
        best_reachable = live_scores[:, 0] / self.penalties[s.rows.limit - s.rows.prefix_len]  # (B,)
        beaten = jnp.all(finished, axis=1) & (finished_scores[:, -1] > best_reachable)
        return s.open & (s.step + 1 < s.rows.limit) & ~beaten


NEG = -1.0e9  # transformers' "very large negative" score, added rather than set


@exportable
@flax.struct.dataclass
class Transformers(Rules):
    """transformers' `generate(do_sample=False)` rules: at most `max_length` tokens counting the decoder's start
    token; `banned` ids never produced; EOS not before `min_length` (start token counted); `forced_bos` (a target
    language's code) the first token, scored 0; with `forced_eos` only EOS at the last position; a finished
    hypothesis scores log P / (tokens generated) ** length_penalty; unlikely choices get NEG added.
    `early_stopping` "true" stops a sentence once K hypotheses are finished, "false" once the best live
    hypothesis's log P over its current length ** length_penalty cannot beat the worst finished one, "never" (with
    a positive length_penalty) once it cannot at max_length. A row of PAD only (a filler row of `translate`'s
    batches) is finished from the start. Greedy ranks the processed logits themselves."""

    min_length: jnp.ndarray  # () int32
    length_penalty: jnp.ndarray  # () float32
    forced_bos: jnp.ndarray  # () int32: the only first token (a target language's code), or -1: any
    max_length: int = flax.struct.field(pytree_node=False)
    banned: tuple[int, ...] = flax.struct.field(pytree_node=False)
    forced_eos: bool = flax.struct.field(pytree_node=False)
    early_stopping: str = flax.struct.field(pytree_node=False)  # "false", "true" or "never"
    no_repeat_ngram: int = flax.struct.field(pytree_node=False, default=0)  # 0: off
    # Whether a repetition penalty applies is part of the program; its value is an argument, so that a service
    # runs every value with one program.
    penalize: bool = flax.struct.field(pytree_node=False, default=False)
    repetition_penalty: jnp.ndarray = 1.0  # () float32, > 0
    sampler: Sampler | None = None
    alignment_layer: int | None = flax.struct.field(pytree_node=False, default=None)
    impossible = NEG

    def token_scores(self, logits, step, past):
        scores = logits if self.greedy else jax.nn.log_softmax(logits, axis=-1)
        # In transformers' order of its logits processors: repetition penalty, n-gram bans, bad words, min length,
        # forced BOS, forced EOS. Its input_ids begin with the decoder's start token.
        if self.penalize or self.no_repeat_ngram:
            seen = jnp.concatenate([jnp.full_like(past[:, :1], self.start_id), past], axis=1)  # (N, L + 1)
            known = jnp.arange(seen.shape[1]) <= step  # (L + 1,) the start token and the `step` tokens so far
        if self.penalize:
            scores = _penalize_repeats(scores, seen, known, self.repetition_penalty)
        if self.no_repeat_ngram:
            scores = _ban_repeated_ngrams(scores, seen, step, self.no_repeat_ngram)
        for i in self.banned:
            scores = scores.at[..., i].set(-jnp.inf)
        eos = scores[..., self.eos_id]
        scores = scores.at[..., self.eos_id].set(jnp.where(step + 1 < self.min_length, -jnp.inf, eos))
        only_bos = jnp.full_like(scores, -jnp.inf).at[..., jnp.maximum(self.forced_bos, 0)].set(0.0)
        scores = jnp.where((step == 0) & (self.forced_bos >= 0), only_bos, scores)
        if self.forced_eos:  # the sequence, start token included, would reach max_length: only EOS
            only_eos = jnp.full_like(scores, -jnp.inf).at[..., self.eos_id].set(0.0)
            scores = jnp.where(step + 2 == self.max_length, only_eos, scores)
        return scores

    def token_log_probs(self, scores):
        # Greedy search and sampling rank the processed logits; their log-probs are transformers'
        # compute_transition_scores(normalize_logits=True).
        return jax.nn.log_softmax(scores, axis=-1) if self.greedy else scores

    def exclude(self, scores, mask):
        return scores + mask * NEG

    def finished_score(self, log_p, generated):
        if self.greedy:  # one hypothesis: its log P (transformers gives greedy search no sequence score)
            return log_p
        return log_p / (generated.astype(jnp.float32) ** self.length_penalty)

    def initially_open(self, src, pad_id: int):
        return ~jnp.all(src == pad_id, axis=1)

    def still_open(self, s, live_scores, finished_scores, finished, ends):
        if self.greedy:
            return s.open & ~finished[:, 0]
        never = (self.early_stopping == "never") & (self.length_penalty > 0)
        # The length after the prefix (transformers' cur_len - decoder_prompt_len); at least 1 while it is forced.
        length = jnp.where(never, self.max_length - 1.0, s.step + 1.0) - s.rows.prefix_len
        length = jnp.maximum(length, 1).astype(jnp.float32)
        best_possible = live_scores[:, 0] / (length**self.length_penalty)  # (B,)
        worst = jnp.where(finished, jnp.min(finished_scores, axis=1, keepdims=True), NEG)
        improvable = s.open & jnp.any(best_possible[:, None] > worst, axis=1)
        full = jnp.all(finished, axis=1) & (self.early_stopping == "true")
        # A sentence closes at its length limit too; every candidate ending stops the batch, as in transformers.
        return improvable & ~full & (s.step + 1 < s.rows.limit) & ~jnp.all(ends)


def _penalize_repeats(scores, seen, known, penalty):
    """transformers' RepetitionPenaltyLogitsProcessor: every token in `seen` (where `known`) has its score divided
    by `penalty` if positive, multiplied by it if negative. scores (N, V), seen (N, S)."""
    rows = jnp.arange(scores.shape[0])[:, None]
    present = jnp.zeros(scores.shape, bool).at[rows, seen].max(known[None, :])  # (N, V)
    return jnp.where(present, jnp.where(scores < 0, scores * penalty, scores / penalty), scores)


def _ban_repeated_ngrams(scores, seen, step, n: int):
    """transformers' NoRepeatNGramLogitsProcessor: with the `step + 1` known tokens of `seen` (start token first),
    a token that would complete an n-gram that occurs already is banned (-inf). scores (N, V), seen (N, S)."""
    length = step + 1  # transformers' cur_len
    S = seen.shape[1]
    tail = lax.dynamic_slice_in_dim(seen, jnp.maximum(length - (n - 1), 0), n - 1, axis=1) if n > 1 else seen[:, :0]
    starts = jnp.arange(S)  # an n-gram at each start j, complete when j + n <= length
    match = (starts + n <= length)[None, :] & (length >= n)  # (1, S)
    for i in range(n - 1):  # its first n - 1 tokens are the last n - 1 known ones
        match = match & (jnp.roll(seen, -i, axis=1) == tail[:, i : i + 1])
    following = jnp.roll(seen, -(n - 1), axis=1)  # (N, S) the n-th token of the n-gram starting at j
    rows = jnp.arange(scores.shape[0])[:, None]
    banned = jnp.zeros(scores.shape, bool).at[rows, following].max(match)
    return jnp.where(banned, -jnp.inf, scores)


# =============================================================================================================
# The loop
# =============================================================================================================


def initial_state(rules: Rules, src, rows: Rows, length: int, cache_len: int, cache, pad_id: int) -> SearchState:
    """The state before the first step: K copies of an empty hypothesis of which only the first may extend."""
    B, K = src.shape[0], rules.beams
    first_only = jnp.where(jnp.arange(K) == 0, 0.0, rules.impossible).astype(jnp.float32)
    aligned = None if rules.alignment_layer is None else jnp.full((B, K, length), -1, jnp.int32)
    more = {} if rows.phrases is None else constraints.initial_state(B, K, rows.phrases.shape[1])
    return SearchState(
        step=jnp.array(0, jnp.int32),
        live_tokens=jnp.full((B, K, length), pad_id, jnp.int32),
        live_scores=jnp.tile(first_only, (B, 1)),
        finished_tokens=jnp.full((B, K, length), pad_id, jnp.int32),
        finished_scores=jnp.full((B, K), rules.impossible, jnp.float32),
        finished=jnp.zeros((B, K), bool),
        open=rules.initially_open(src, pad_id),
        rows=jax.tree.map(jnp.asarray, rows),
        live_token_scores=jnp.zeros((B, K, length), jnp.float32),
        finished_token_scores=jnp.zeros((B, K, length), jnp.float32),
        history=jnp.zeros((B, K, cache_len), jnp.int32),
        cache=cache,
        live_alignment=aligned,
        finished_alignment=aligned,
        **more,
    )


def advance(s: SearchState, rules: Rules, step_fn) -> SearchState:
    """One step of every hypothesis: extend, rank, keep the K best live ones and the K best finished ones."""
    B, K, _ = s.live_tokens.shape
    t = s.step
    last = jnp.where(t == 0, rules.start_id, s.live_tokens[:, :, jnp.maximum(t - 1, 0)])  # (B, K)
    history = s.history.at[:, :, t].set(jnp.arange(K))  # hypothesis k's new position goes to cache slot k
    out = step_fn(last.reshape(-1), s.cache, history.reshape(B * K, -1), t)  # (B * K, V), ...
    logits, cache = out[:2]  # and with alignments, the step's (B * K, S) cross-attention: `advance_alignment`
    scores = rules.token_scores(logits, t, s.live_tokens.reshape(B * K, -1)).reshape(B, K, -1)  # (B, K, V)
    rows, constrained = s.rows, s.rows.phrases is not None
    if rows.banned is not None:  # a token that would complete a banned phrase is impossible
        banned, banned_len = (jnp.repeat(x, K, axis=0) for x in (rows.banned, rows.banned_len))
        past = s.live_tokens.reshape(B * K, -1)
        scores = constraints.ban_phrases(scores.reshape(B * K, -1), past, t, banned, banned_len).reshape(B, K, -1)
    if constrained:  # no EOS before every phrase is met
        scores = constraints.ban_unmet_eos(scores, s.met_at, rows.phrase_len, rules.eos_id, -jnp.inf)
    scores = _forced_prefix(scores, s.rows, t)

    keys = None if rules.sampler is None else rules.sampler.keys(s.rows.draw, t)  # (B, 2)
    log_probs = rules.token_log_probs(scores)  # (B, K, V)
    log_p, parents, tokens = rules.candidates(s.live_scores, scores, log_probs, keys)  # (B, C)
    C = log_p.shape[1]
    if constrained:  # and each hypothesis's best extension and the next token of each phrase it may go on with
        state = (rows.phrases, rows.phrase_len, rows.ordered, s.met_at, s.progress)
        best = constraints.best_extensions(s.live_scores, scores)
        nexts = constraints.phrase_candidates(s.live_scores, scores, *state, rules.impossible)
        log_p, parents, tokens = (jnp.concatenate(x, axis=1) for x in zip((log_p, parents, tokens), best, nexts))
    candidates = _gather(s.live_tokens, parents).at[:, :, t].set(tokens)  # (B, C, L)
    gained = _take_pairs(log_probs, parents, tokens)  # (B, C) the log-prob of each candidate's last token
    token_scores = _gather(s.live_token_scores, parents).at[:, :, t].set(gained)  # (B, C, L)
    # A candidate ends with EOS, or when its sentence reaches its length limit (then without EOS).
    ends = (tokens == rules.eos_id) | (t + 1 >= s.rows.limit)[:, None]  # (B, C)

    # Live: the K best candidates that did not end; each takes its parent's past in the cache.
    live_scores, live_pick = _best(rules.exclude(log_p[:, :C], ends[:, :C]), K)  # (B, K)
    # Finished: of the candidates that end among the first K (fairseq's rule: an ending candidate ranked below
    # them is dropped).
    first = jnp.arange(ends.shape[1]) < K
    if constrained:  # rows with phrases: the live set by dynamic beam allocation; the others as above
        met_at, progress, bank = constraints.advance_state(
            candidates, t, rows.phrases, rows.phrase_len, rows.ordered, _gather(s.met_at, parents)
        )
        met = constraints.all_met(met_at, rows.phrase_len)  # (B, C)
        banks = rows.phrases.shape[1] * rows.phrases.shape[2] + 1
        allotted = constraints.allot(log_p, parents, tokens, ends, met, bank, banks, K, rules.impossible)
        has = jnp.any(rows.phrase_len > 0, axis=1)  # (B,)
        live_scores = jnp.where(has[:, None], allotted[0], live_scores)
        live_pick = jnp.where(has[:, None], allotted[1], live_pick)
        first = jnp.where(has[:, None], allotted[2], first[None, :])
        met_at, progress = _gather(met_at, live_pick), _gather(progress, live_pick)
    else:
        met_at, progress = s.met_at, s.progress  # None: no constraints
    live_tokens = _gather(candidates, live_pick)
    live_token_scores = _gather(token_scores, live_pick)
    history = _gather(history, jnp.take_along_axis(parents, live_pick, axis=1))

    # Finished: the K best of the old and of the finishing candidates, in open sentences only.
    finishing = ends & first & s.open[:, None]  # (B, C)
    generated = (t + 1 - s.rows.prefix_len)[:, None]  # (B, 1) tokens after the prefix
    new_scores = jnp.where(finishing, rules.finished_score(log_p, generated), rules.impossible)
    finished_scores, pick = lax.top_k(jnp.concatenate([s.finished_scores, new_scores], axis=1), K)
    finished_tokens = _gather(jnp.concatenate([s.finished_tokens, candidates], axis=1), pick)
    finished_token_scores = _gather(jnp.concatenate([s.finished_token_scores, token_scores], axis=1), pick)
    finished = _gather(jnp.concatenate([s.finished, finishing], axis=1), pick)
    live_alignment, finished_alignment = s.live_alignment, s.finished_alignment  # None: no alignments
    if rules.alignment_layer is not None:
        live_alignment, finished_alignment = advance_alignment(s, out[2], parents, live_pick, pick, t)

    return s.replace(
        step=t + 1,
        live_tokens=live_tokens,
        live_scores=live_scores,
        finished_tokens=finished_tokens,
        finished_scores=finished_scores,
        finished=finished,
        open=rules.still_open(s, live_scores, finished_scores, finished, ends[:, :C]),
        live_token_scores=live_token_scores,
        finished_token_scores=finished_token_scores,
        history=history,
        cache=cache,
        live_alignment=live_alignment,
        finished_alignment=finished_alignment,
        met_at=met_at,
        progress=progress,
    )


def advance_alignment(s: SearchState, attention, parents, live_pick, finished_pick, t):
    """The alignments of `advance`'s step, gathered as its tokens are: the candidate of parent p at step t aligns to
    the source position p's step attends to most (`attention` (B * K, S), the layer's cross-attention over heads,
    -1 where no word is), its past to p's; live and finished take their picks of the candidates. Returns the new
    (live_alignment, finished_alignment), (B, K, L) each."""
    B, K, _ = s.live_tokens.shape
    source = first_argmax(attention).reshape(B, K)  # (B, K)
    aligned = _gather(s.live_alignment, parents).at[:, :, t].set(jnp.take_along_axis(source, parents, axis=1))
    finished = _gather(jnp.concatenate([s.finished_alignment, aligned], axis=1), finished_pick)  # (B, K, L)
    return _gather(aligned, live_pick), finished


def run(s: SearchState, rules: Rules, step_fn, until) -> SearchState:
    """The loop: steps until no more than `until` sentences are open (0: all done), the output length is reached,
    or the cache is full."""
    length, cache_len = s.live_tokens.shape[-1], s.history.shape[-1]

    def going(s: SearchState):
        return (s.step < length) & (s.step < cache_len) & (jnp.sum(s.open) > until)

    return lax.while_loop(going, lambda s: advance(s, rules, step_fn), s)


def _forced_prefix(scores, rows: Rows, t):
    """(B, K, V) the step's scores with a row's prefix token the only choice, scored 0, while its prefix lasts."""
    token = lax.dynamic_index_in_dim(rows.prefix, jnp.minimum(t, rows.prefix.shape[1] - 1), axis=1)  # (B, 1)
    only = jnp.where(jnp.arange(scores.shape[-1]) == token, 0.0, -jnp.inf)  # (B, V)
    return jnp.where((t < rows.prefix_len)[:, None, None], only[:, None, :], scores)


def _take_pairs(x, parents, tokens):
    """x (B, K, V) at (parent, token) pairs (B, C) -> (B, C)."""
    B, K, V = x.shape
    return jnp.take_along_axis(x.reshape(B, K * V), parents * V + tokens, axis=1)


def first_argmax(x):
    """jnp.argmax over the last axis (the first index of the maximum) as two plain reductions, a max and a min over
    indices: XLA's CPU backend vectorises those, not argmax's single (value, index) reduction."""
    index = lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    is_max = x == jnp.max(x, axis=-1, keepdims=True)
    return jnp.min(jnp.where(is_max, index, x.shape[-1]), axis=-1)


TOP_K_BLOCK = 64  # entries per block in the first pass of `top_k`


def top_k(x, k: int):
    """`lax.top_k(x, k)` over the last axis of x (R, N), the same values and indices, ties to the lower index, in
    two passes: the k largest entries lie in the k blocks of TOP_K_BLOCK with the largest maxima, so only those
    are ranked (XLA:CPU's TopK sorts a whole row entry by entry). Exact, ties included: an entry >= the k-th largest
    block maximum m lies in a block whose maximum is >= m; blocks tied at m are taken lowest index first, each
    holds an entry equal to m, and the candidates keep index order. No NaN expected: log-probs."""
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


def _best(scores, k: int):
    """lax.top_k(scores, k) over (B, C); with C == k == 1, the one candidate itself."""
    if scores.shape[1] == k == 1:
        return scores, jnp.zeros_like(scores, jnp.int32)
    return lax.top_k(scores, k)


def _gather(x, index):
    """x (B, N, ...), index (B, M) -> (B, M, ...): entries along axis 1, per sentence (nothing to pick from one)."""
    if x.shape[1] == 1 and index.shape[1] == 1:
        return x
    return jnp.take_along_axis(x, index.reshape(index.shape + (1,) * (x.ndim - 2)), axis=1)


# =============================================================================================================
# The programs: the model's cached decoder as the loop's step function
# =============================================================================================================

# XLA:CPU options for the loops: its region analysis proves that a step's in-place write of its keys and the
# cache's reads do not clash, so the greedy loops stop copying every layer's cache twice a step.
LOOP_CPU_OPTIONS = {"xla_cpu_copy_insertion_use_region_analysis": True}


@functools.partial(jit_by_config, static_argnames=("config", "width"))
def encoder(params, src, *, config: TransformerConfig, width: int):
    """src (n, w) -> the encoder's output (n, width, D), zero past w (w <= width)."""
    memory = Transformer(config).apply({"params": params}, src, method=Transformer.encode)  # (n, w, D)
    return jnp.pad(memory, ((0, 0), (0, width - src.shape[1]), (0, 0)))


def create_cache(model: Transformer, params, memory, src, length: int, beams: int = 1):
    """The decoding cache for `length` positions of `beams` hypotheses per source row: one decode call on a dummy
    (B * beams, length) target creates the empty self-attention keys/values (`beams` slots per position) and
    projects the cross-attention's keys/values from `memory`, once per sentence."""
    dummy = jnp.zeros((src.shape[0] * beams, length), dtype=jnp.int32)
    _, variables = model.apply(
        {"params": params}, memory, src, dummy, decode=True, mutable=["cache"], method=Transformer.decode
    )
    return variables["cache"]


def output_kernel(model: Transformer, params):
    """The output projection laid out for decoding steps (`Transformer.output_kernel`), computed once per loop."""
    return model.apply({"params": params}, method=Transformer.output_kernel)


def _apply_step(model: Transformer, params, cache, memory, src, tokens, step, history, kernel, mutable):
    """The cached decoder's call for one step: (logits (N, 1, V), the variables of the `mutable` collections)."""
    return model.apply(
        {"params": params, "cache": cache},
        memory,
        src,
        tokens[:, None],
        decode=True,
        kernel=kernel,
        step=step,
        history=history,
        mutable=mutable,
        method=Transformer.decode,
    )


def decode_step(model: Transformer, params, cache, memory, src, tokens, step, history, kernel=None):
    """One decoder step: tokens (N,) at position `step` of rows whose pasts `history` (N, T) places in the cache ->
    logits (N, V) of the next token, the new cache. `kernel`: `output_kernel`'s."""
    logits, variables = _apply_step(model, params, cache, memory, src, tokens, step, history, kernel, ["cache"])
    return logits[:, 0], variables["cache"]  # (N, V)


def aligned_decode_step(model: Transformer, params, cache, memory, src, tokens, step, history, kernel, layer: int):
    """`decode_step`, and decoder layer `layer`'s cross-attention of the step averaged over heads (N, S), -1 at the
    source positions no word is at (PAD, EOS: fairseq's `extract_hard_alignment` leaves them out)."""
    mutable = ["cache", "intermediates"]
    logits, variables = _apply_step(model, params, cache, memory, src, tokens, step, history, kernel, mutable)
    N = tokens.shape[0]
    attention = cross_attention_rows(variables["intermediates"], layer, N)[:, 0]  # (N, S)
    words = jnp.repeat((src != model.config.pad_id) & (src != model.config.eos_id), N // src.shape[0], axis=0)
    return logits[:, 0], variables["cache"], jnp.where(words, attention, -1.0)


def _step_function(config: TransformerConfig, params, memory, src, alignment_layer: int | None = None):
    model = Transformer(config)
    kernel = output_kernel(model, params)  # before the loop: a transpose in its body would be redone every step

    def step_fn(tokens, cache, history, step):
        if alignment_layer is None:
            return decode_step(model, params, cache, memory, src, tokens, step, history, kernel)
        return aligned_decode_step(model, params, cache, memory, src, tokens, step, history, kernel, alignment_layer)

    return step_fn


@functools.partial(jit_by_config, static_argnames=("config", "length", "cache_len"), cpu_options=LOOP_CPU_OPTIONS)
def start(
    params, src, memory, rules: Rules, rows: Rows, until, *, config: TransformerConfig, length: int, cache_len: int
):
    """A search of the sources `src` (B, S) from the encoder's output `memory` (B, S, D): outputs of `length`
    tokens, each row as its `rows` say, a cache of `cache_len` positions; runs until at most `until` sentences are
    open."""
    cache = create_cache(Transformer(config), params, memory, src, cache_len, rules.beams)
    state = initial_state(rules, src, rows, length, cache_len, cache, config.pad_id)
    return run(state, rules, _step_function(config, params, memory, src, rules.alignment_layer), until)


@functools.partial(jit_by_config, static_argnames=("config",), cpu_options=LOOP_CPU_OPTIONS)
def resume(params, src, memory, rules: Rules, state: SearchState, until, *, config: TransformerConfig):
    """`start`'s search going on from `state` (the sources and memory of its rows)."""
    return run(state, rules, _step_function(config, params, memory, src, rules.alignment_layer), until)
