"""Greedy and beam search for the PyTorch twin: the reference the fast Flax decoder is tested against, written to
be read, not to be fast. The semantics of `jax_transformer.decoding.decoders` exactly, target prefixes and n-best lists
included; each step re-runs the decoder over the prefix by default, or uses a key/value cache (`use_cache=True`).
docs/internals.md#torch_reference-decoding."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from jax_transformer.settings.config import TransformerConfig
from torch_reference.model import MultiHeadAttention, Transformer, compute_dtype, embed_positions, padding_mask

DEFAULT_MAX_LEN_A = 1.5
DEFAULT_MAX_LEN_B = 10


# --- lengths and length penalty (the same formulas as jax_transformer.decoding.decoders)
# -------------------------------


def max_new_tokens(src: torch.Tensor, cfg: TransformerConfig, max_len_a: float, max_len_b: float) -> list[int]:
    """Per row: min(max_len, max(1, floor(a * n + b))) for n non-PAD source tokens; 1 for an all-PAD row."""
    limits = []
    for n in (src != cfg.pad_id).sum(dim=1).tolist():
        limits.append(1 if n == 0 else min(cfg.max_len, max(1, math.floor(max_len_a * n + max_len_b))))
    return limits


def output_length(src_width: int, cfg: TransformerConfig, max_len_a: float, max_len_b: float) -> int:
    """Width of the returned token array: the limit of a source filling all `src_width` positions."""
    return min(cfg.max_len, max(1, math.floor(max_len_a * src_width + max_len_b)))


def length_penalty(length: int, alpha: float) -> float:
    """GNMT length penalty ((5 + length) / 6) ** alpha, computed in float64 and rounded to float32 once."""
    return float(np.float32(((5.0 + length) / 6.0) ** alpha))


# --- the decoder: whole prefix each step, or a key/value cache ----------------------------------------------


class PrefixDecoder:
    """Next-token log-probs by re-running the decoder over the whole prefix (BOS + tokens so far) each step."""

    def __init__(self, model: Transformer, memory: torch.Tensor, src: torch.Tensor):
        self.model, self.memory, self.src = model, memory, src
        self.prefix = torch.full((src.shape[0], 1), model.cfg.start_id, dtype=torch.long, device=src.device)  # (B, t+1)

    def step(self) -> torch.Tensor:
        """Log-probs (B, V) of the token after the current prefix."""
        hidden = self.model.decoder_hidden(self.memory, self.src, self.prefix)[:, -1:]  # (B, 1, D): last position
        return F.log_softmax(self.model.logits(hidden)[:, 0], dim=-1)  # (B, V)

    def append(self, tokens: torch.Tensor) -> None:
        """Extends every row's prefix by tokens (B,)."""
        self.prefix = torch.cat([self.prefix, tokens[:, None]], dim=1)

    def reorder(self, rows: torch.Tensor) -> None:
        """Row r now continues the hypothesis that was row rows[r] (beam search)."""
        self.prefix = self.prefix[rows]


class IncrementalDecoder:
    """The same computation with a key/value cache: each step runs the decoder on the newest token only,
    attending to the keys/values stored by earlier steps; cross-attention keys/values are projected once."""

    def __init__(self, model: Transformer, memory: torch.Tensor, src: torch.Tensor):
        self.model = model
        cfg = model.cfg
        self.cross_mask = padding_mask(src, cfg.pad_id)  # (B, 1, 1, S)
        B = src.shape[0]
        self.cross = [
            (
                layer.cross_attention.project(layer.cross_attention.key, memory),
                layer.cross_attention.project(layer.cross_attention.value, memory),
            )
            for layer in model.decoder.layers
        ]  # per layer: (B, S, H, K) twice, in the compute dtype
        empty = torch.zeros(B, 0, cfg.num_heads, cfg.head_dim, dtype=compute_dtype(cfg), device=memory.device)
        self.keys = [empty for _ in model.decoder.layers]
        self.values = [empty for _ in model.decoder.layers]
        self.last = torch.full((B,), cfg.start_id, dtype=torch.long, device=src.device)
        self.position = 0

    def _self_attention(self, i: int, module: MultiHeadAttention, h: torch.Tensor) -> torch.Tensor:
        # The newest position may see every earlier one: store its key/value, attend to all stored.
        self.keys[i] = torch.cat([self.keys[i], module.project(module.key, h)], dim=1)
        self.values[i] = torch.cat([self.values[i], module.project(module.value, h)], dim=1)
        return module.attend(module.project(module.query, h), self.keys[i], self.values[i], None)

    def step(self) -> torch.Tensor:
        model = self.model
        x = embed_positions(model.decoder, model._embed("target", self.last[:, None]), self.position)  # (B, 1, D)
        for i, layer in enumerate(model.decoder.layers):
            x = layer.residual(x, lambda h: self._self_attention(i, layer.self_attention, h), layer.self_attention_norm)
            k, v = self.cross[i]
            cross = layer.cross_attention
            x = layer.residual(
                x,
                lambda h: cross.attend(cross.project(cross.query, h), k, v, self.cross_mask),
                layer.cross_attention_norm,
            )
            x = layer.residual(x, layer.feed_forward, layer.feed_forward_norm)
        if model.decoder.final_norm is not None:
            x = model.decoder.final_norm(x)
        return F.log_softmax(model.logits(x)[:, 0], dim=-1)  # (B, V)

    def append(self, tokens: torch.Tensor) -> None:
        self.last, self.position = tokens, self.position + 1

    def reorder(self, rows: torch.Tensor) -> None:
        self.keys = [k[rows] for k in self.keys]
        self.values = [v[rows] for v in self.values]
        self.last = self.last[rows]


def _decoder(model: Transformer, memory, src, use_cache: bool):
    if isinstance(model, Ensemble):
        return EnsembleDecoder(model, memory, src, use_cache)
    return (IncrementalDecoder if use_cache else PrefixDecoder)(model, memory, src)


# --- ensembles (jax_transformer.decoding.ensemble): models decoding together ---------------------------------


class Ensemble:
    """Models decoding together, as one model to `greedy_search` and `beam_search`: at each step the weighted mean
    of their probabilities, log sum_i w_i p_i (weights normalised to sum to 1). They share the target vocabulary
    (and the sources' ids), so the first one's config answers for all."""

    def __init__(self, models: Sequence[Transformer], weights: Sequence[float] | None = None):
        weights = [1.0] * len(models) if weights is None else [float(w) for w in weights]
        self.models, self.cfg = list(models), models[0].cfg
        self.log_weights = torch.log(torch.tensor([w / sum(weights) for w in weights], dtype=torch.float32))

    @property
    def training(self) -> bool:
        return any(model.training for model in self.models)

    def parameters(self):
        return self.models[0].parameters()

    def encode(self, src: torch.Tensor) -> _Memories:
        return _Memories(model.encode(src) for model in self.models)


class _Memories(list):
    """Each member's encoder output, sliced and expanded together as one tensor would be."""

    def __getitem__(self, index):
        return _Memories(memory[index] for memory in self)

    def expand(self, *shape):
        return _Memories(memory.expand(*shape) for memory in self)


class EnsembleDecoder:
    """Each member's decoder (its own cache or prefix), stepped together; their log-probs combined."""

    def __init__(self, ensemble: Ensemble, memory: _Memories, src: torch.Tensor, use_cache: bool):
        self.decoders = [_decoder(model, m, src, use_cache) for model, m in zip(ensemble.models, list.__iter__(memory))]
        self.log_weights = ensemble.log_weights.to(src.device)

    def step(self) -> torch.Tensor:
        log_probs = torch.stack([decoder.step().float() for decoder in self.decoders])  # (M, B, V)
        return torch.logsumexp(log_probs + self.log_weights[:, None, None], dim=0)  # (B, V)

    def append(self, tokens: torch.Tensor) -> None:
        for decoder in self.decoders:
            decoder.append(tokens)

    def reorder(self, rows: torch.Tensor) -> None:
        for decoder in self.decoders:
            decoder.reorder(rows)


def _on_model_device(model: Transformer, src) -> torch.Tensor:
    """The sources as a long tensor on the model's device."""
    src = src if isinstance(src, torch.Tensor) else torch.from_numpy(np.asarray(src))
    return src.to(device=next(model.parameters()).device, dtype=torch.long)


def _check(model: Transformer, src: torch.Tensor, beam_size: int = 1) -> None:
    if model.training:
        raise ValueError("decoding needs the model in eval mode (model.eval()): dropout would make it random")
    if src.dim() != 2:
        raise ValueError(f"src must have shape (batch, length), got {tuple(src.shape)}")
    if 2 * beam_size + 3 > model.cfg.tgt_vocab_size:
        raise ValueError(
            f"beam_size={beam_size} needs tgt_vocab_size >= 2 * beam_size + 3, got {model.cfg.tgt_vocab_size}"
        )


def _restrict(log_probs: torch.Tensor, step: int, min_len: int, cfg: TransformerConfig) -> torch.Tensor:
    """PAD and BOS are never produced; EOS not before min_len tokens. Set to -inf, not renormalised."""
    log_probs = log_probs.clone()
    log_probs[..., cfg.pad_id] = -math.inf
    if cfg.bos_id is not None:
        log_probs[..., cfg.bos_id] = -math.inf
    if step < min_len:
        log_probs[..., cfg.eos_id] = -math.inf
    return log_probs


# --- target prefixes and n-best lists (jax_transformer.decoding.decoders's `prefixes` and `Decoded`) ---------------


class Hypotheses(NamedTuple):
    """The n best hypotheses of each row, best first, as jax_transformer.decoding.decoders.Decoded: tokens (B, n, L)
    long (a target prefix's tokens first, EOS where emitted, PAD after), scores (B, n) float32 (by the search's rule,
    a prefix's tokens not counted), token_scores (B, n, L) float32 (each token's log-prob: 0 for a prefix's and
    after the end) and found (B, n) bool (False for a slot no hypothesis reached: its score is -inf)."""

    tokens: torch.Tensor
    scores: torch.Tensor
    token_scores: torch.Tensor
    found: torch.Tensor


def _target_prefixes(prefixes, B: int, limits: list[int], cfg: TransformerConfig) -> list[list[int]]:
    """Each row's target prefix as a list of ids ([] for none), checked as the Flax decoder checks them."""
    if prefixes is None:
        return [[] for _ in range(B)]
    if len(prefixes) != B:
        raise ValueError(f"prefixes must give one entry per source row ({B}), got {len(prefixes)}")
    rows = []
    for row, ids in enumerate(prefixes):
        ids = [] if ids is None else [int(i) for i in ids]
        if len(ids) >= limits[row]:
            raise ValueError(
                f"row {row}: a target prefix of {len(ids)} tokens leaves no room for decoding (this row may "
                f"produce {limits[row]} tokens, the prefix's and EOS included)"
            )
        if cfg.eos_id in ids:
            raise ValueError(f"row {row}: a target prefix holds EOS (id {cfg.eos_id}): nothing would follow")
        if any(not 0 <= i < cfg.tgt_vocab_size for i in ids):
            raise ValueError(f"row {row}: a target prefix holds ids outside [0, {cfg.tgt_vocab_size})")
        rows.append(ids)
    return rows


def _force_prefix(log_probs: torch.Tensor, target_prefix: list[int], step: int) -> torch.Tensor:
    """While the target prefix lasts, its token is the only choice and scores 0: it is given, not chosen, so it
    adds nothing to log P. log_probs (..., V) of one row's hypotheses."""
    if step >= len(target_prefix):
        return log_probs
    forced = torch.full_like(log_probs, -math.inf)
    forced[..., target_prefix[step]] = 0.0
    return forced


def _check_n_best(n_best: int | None, beams: int) -> None:
    if n_best is None:  # the existing return value: the best hypothesis's tokens and score
        return
    if isinstance(n_best, bool) or not isinstance(n_best, (int, np.integer)) or not 1 <= n_best <= beams:
        raise ValueError(f"n_best must be None or an int in [1, {beams}] (the hypotheses kept), got {n_best!r}")


# --- greedy search ----------------------------------------------------------------------------------------


@torch.no_grad()
def greedy_search(
    model: Transformer,
    src: torch.Tensor,
    *,
    max_len_a: float = DEFAULT_MAX_LEN_A,
    max_len_b: float = DEFAULT_MAX_LEN_B,
    min_len: int = 0,
    use_cache: bool = False,
    n_best: int | None = None,
    prefixes: Sequence[Sequence[int] | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | Hypotheses:
    """Greedy decoding of right-padded sources (B, S) -> tokens (B, L) long, scores (B,) float32 (sum of
    log-probs). The loop stops when every row has emitted EOS or reached its length limit. `prefixes`: each row's
    target prefix (ids without the start token; None or [] for none), forced first and scored 0. With `n_best`
    (1: greedy keeps one hypothesis) a `Hypotheses` of n = 1 instead, per-token log-probs included."""
    src = _on_model_device(model, src)
    _check(model, src)
    _check_n_best(n_best, 1)
    cfg, device = model.cfg, src.device
    B = src.shape[0]
    limits = max_new_tokens(src, cfg, max_len_a, max_len_b)
    target_prefixes = _target_prefixes(prefixes, B, limits, cfg)
    length = output_length(src.shape[1], cfg, max_len_a, max_len_b)
    decoder = _decoder(model, model.encode(src), src, use_cache)
    tokens = torch.full((B, length), cfg.pad_id, dtype=torch.long, device=device)
    token_scores = torch.zeros(B, length, device=device)
    scores = torch.zeros(B, device=device)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    for t in range(length):
        if done.all():
            break
        log_probs = _restrict(decoder.step(), t, min_len, cfg)  # (B, V)
        log_probs = torch.stack([_force_prefix(row, given, t) for row, given in zip(log_probs, target_prefixes)])
        best = log_probs.argmax(dim=-1)  # (B,)  first index on ties
        token = torch.where(done, cfg.pad_id, best)
        gained = torch.where(done, 0.0, log_probs.gather(1, token[:, None])[:, 0])  # (B,)
        scores += gained
        tokens[:, t], token_scores[:, t] = token, gained
        decoder.append(token)
        done |= (token == cfg.eos_id) | torch.tensor([t + 1 >= limit for limit in limits], device=device)
    if n_best is None:
        return tokens, scores
    found = torch.ones(B, 1, dtype=torch.bool, device=device)  # every row ends, at EOS or at its limit
    return Hypotheses(tokens[:, None], scores[:, None], token_scores[:, None], found)


# --- beam search ------------------------------------------------------------------------------------------


def _top(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest values and their indices, equal values in index order (as lax.top_k)."""
    sorted_values, index = torch.sort(values, descending=True, stable=True)
    return sorted_values[:k], index[:k]


@torch.no_grad()
def beam_search(
    model: Transformer,
    src: torch.Tensor,
    *,
    beam_size: int = 4,
    alpha: float = 0.6,
    max_len_a: float = DEFAULT_MAX_LEN_A,
    max_len_b: float = DEFAULT_MAX_LEN_B,
    min_len: int = 0,
    use_cache: bool = False,
    n_best: int | None = None,
    prefixes: Sequence[Sequence[int] | None] | None = None,
    constraints: Sequence[Sequence[Sequence[int]] | None] | None = None,
    ordered: bool = False,
    banned: Sequence[Sequence[Sequence[int]] | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | Hypotheses:
    """Beam search with the GNMT length penalty, one sentence at a time -> the best hypothesis of each row,
    tokens (B, L) long and score (B,) float32 = log P / ((5 + length) / 6) ** alpha. `prefixes`: each row's
    target prefix (ids without the start token; None or [] for none), forced first, scored 0 and not counted in
    the penalty's length (the length limit counts it). With `n_best` (at most beam_size) the n best finished
    hypotheses of each row instead, a `Hypotheses` with per-token log-probs. `constraints`: each row's phrases
    (id lists; None: none) that every output must hold, in their order with `ordered` (`_Constrained`);
    `banned`: each row's phrases no output holds."""
    src = _on_model_device(model, src)
    _check(model, src, beam_size)
    _check_n_best(n_best, beam_size)
    if not alpha >= 0:
        raise ValueError(f"alpha must be >= 0, got {alpha}")
    cfg = model.cfg
    B = src.shape[0]
    limits = max_new_tokens(src, cfg, max_len_a, max_len_b)
    target_prefixes = _target_prefixes(prefixes, B, limits, cfg)
    length = output_length(src.shape[1], cfg, max_len_a, max_len_b)
    memory = model.encode(src)  # the whole batch at once (the Flax decoder encodes groups cut to their length)
    rows = [
        _beam_search_one(
            model,
            memory[b : b + 1],
            src[b : b + 1],
            beam_size,
            alpha,
            limits[b],
            length,
            min_len,
            use_cache,
            target_prefixes[b],
            _Constrained([list(p) for p in (constraints or [None] * B)[b] or []], ordered),
            [list(p) for p in (banned or [None] * B)[b] or []],
        )
        for b in range(B)
    ]
    found = Hypotheses(*(torch.stack(parts) for parts in zip(*rows)))  # (B, K, ...)
    if n_best is None:
        return found.tokens[:, 0], found.scores[:, 0]
    return Hypotheses(*(x[:, :n_best] for x in found))


def _beam_search_one(
    model,
    memory,
    src,
    K: int,
    alpha: float,
    limit: int,
    length: int,
    min_len: int,
    use_cache: bool,
    target_prefix: list[int],
    constrained: _Constrained | None = None,
    banned: list[list[int]] | None = None,
) -> Hypotheses:
    """Beam search for one sentence: memory (1, S, D), src (1, S) -> its K finished hypotheses, best first:
    tokens (K, length), scores (K,), token_scores (K, length), found (K,). With phrases to hold (`constrained`)
    the candidates and the live set are dynamic beam allocation's (`_Constrained`)."""
    cfg, device = model.cfg, src.device
    decoder = _decoder(model, memory.expand(K, -1, -1), src.expand(K, -1), use_cache)
    live = torch.full((K, length), cfg.pad_id, dtype=torch.long, device=device)  # live hypotheses, best first
    live_token_scores = torch.zeros(K, length, device=device)  # the log-prob of each of their tokens
    live_log_probs = torch.tensor([0.0] + [-math.inf] * (K - 1), device=device)  # K copies of BOS: one extends
    finished = torch.full((K, length), cfg.pad_id, dtype=torch.long, device=device)  # finished, best first
    finished_token_scores = torch.zeros(K, length, device=device)
    finished_scores = torch.full((K,), -math.inf, device=device)
    finished_flags = torch.zeros(K, dtype=torch.bool, device=device)
    for t in range(limit):
        log_probs = _restrict(decoder.step(), t, min_len, cfg)  # (K, V)
        pasts = [live[k, :t].tolist() for k in range(K)]
        log_probs = _ban_phrases(log_probs, pasts, banned or [])
        if constrained and constrained.phrases:  # no EOS before every phrase is met
            for k in range(K):
                if not constrained.all_met(pasts[k]):
                    log_probs[k, cfg.eos_id] = -math.inf
        log_probs = _force_prefix(log_probs, target_prefix, t)
        V = log_probs.shape[-1]
        # Extend every live hypothesis by every token; keep the 2K most probable extensions.
        top_log_probs, top_index = _top((live_log_probs[:, None] + log_probs).reshape(-1), 2 * K)  # (2K,)
        parents, new_tokens = top_index // V, top_index % V
        if constrained and constrained.phrases:  # and each one's best token, and each phrase's next token
            more = [(k, int(log_probs[k].argmax())) for k in range(K)]
            more += [(k, token) for k in range(K) for token in constrained.next_tokens(pasts[k])]
            extra = torch.tensor(more, dtype=torch.long, device=device).reshape(-1, 2)
            top_log_probs = torch.cat(
                [top_log_probs, live_log_probs[extra[:, 0]] + log_probs[extra[:, 0], extra[:, 1]]]
            )
            parents, new_tokens = torch.cat([parents, extra[:, 0]]), torch.cat([new_tokens, extra[:, 1]])
        candidates = live[parents].clone()
        candidates[:, t] = new_tokens
        candidate_token_scores = live_token_scores[parents].clone()
        candidate_token_scores[:, t] = log_probs[parents, new_tokens]
        ends = (new_tokens == cfg.eos_id) | (t + 1 >= limit)  # EOS, or the length limit
        # Only the K best candidates may finish (fairseq's rule). Nothing real ends inside the target prefix (it
        # holds no EOS and is shorter than the limit): what ends there is impossible (-inf) and never kept.
        first = torch.arange(len(new_tokens), device=device) < K
        if constrained and constrained.phrases:
            first, live_pick = constrained.allot(candidates[:, : t + 1].tolist(), parents, top_log_probs, ends, K)
        finishing = ends & first & (t >= len(target_prefix))
        # The length penalty counts the tokens generated after the prefix.
        penalty = length_penalty(t + 1 - len(target_prefix), alpha) if t >= len(target_prefix) else 1.0
        # Finished set: the K best of the old finished and the candidates that finish, by penalised score.
        new_scores = torch.where(finishing, top_log_probs / penalty, -math.inf)
        finished_scores, pick = _top(torch.cat([finished_scores, new_scores]), K)
        finished = torch.cat([finished, candidates])[pick]
        finished_token_scores = torch.cat([finished_token_scores, candidate_token_scores])[pick]
        finished_flags = torch.cat([finished_flags, finishing])[pick]
        if t + 1 >= limit:
            break
        # Live set: the K most probable candidates that did not end; the decoder follows their parents.
        live_log_probs, pick = _top(torch.where(ends, -math.inf, top_log_probs)[: 2 * K], K)
        if constrained and constrained.phrases:
            live_log_probs, pick = live_pick
        live = candidates[pick]
        live_token_scores = candidate_token_scores[pick]
        decoder.reorder(parents[pick])
        decoder.append(new_tokens[pick])
        # Stop when K hypotheses are finished and no live one can beat the worst of them (its log P can only
        # fall, and the penalty can at most reach that of the length limit, counted after the prefix).
        best_reachable = live_log_probs[0] / length_penalty(limit - len(target_prefix), alpha)
        if finished_flags.all() and finished_scores[-1] > best_reachable:
            break
    return Hypotheses(finished, finished_scores, finished_token_scores, finished_flags)


# =============================================================================================================
# Lexical constraints
# =============================================================================================================


def _ban_phrases(log_probs: torch.Tensor, pasts: list[list[int]], banned: list[list[int]]) -> torch.Tensor:
    """log_probs (K, V) with -inf for each token that would complete a banned phrase after hypothesis k's
    tokens `pasts[k]`."""
    if not banned:
        return log_probs
    log_probs = log_probs.clone()
    for k, past in enumerate(pasts):
        for phrase in banned:
            head = phrase[:-1]
            if len(past) >= len(head) and past[len(past) - len(head) :] == head:
                log_probs[k, phrase[-1]] = -math.inf
    return log_probs


class _Constrained:
    """One sentence's phrases that every output must hold (`ordered`: in their order, each after the previous
    one's end), read off a hypothesis's tokens each time, and dynamic beam allocation over its candidates (Post &
    Vilar 2018, as fairseq's LexicallyConstrainedBeamSearch): the Flax search's rules (`decoding.constraints`),
    written out per hypothesis."""

    def __init__(self, phrases: list[list[int]], ordered: bool):
        self.phrases, self.ordered = phrases, ordered

    def state(self, tokens: list[int]) -> tuple[list[int], list[int]]:
        """Per phrase: where it was met (the length at its last token; -1: unmet) and how many of its first tokens
        end `tokens` (0 for a met phrase, or one that may not begin yet)."""
        met, start = [], 0
        for phrase in self.phrases:
            if self.ordered and start < 0:  # the previous phrase is unmet
                met.append(-1)
                continue
            end = next(
                (i + len(phrase) for i in range(start, len(tokens) - len(phrase) + 1)
                 if tokens[i : i + len(phrase)] == phrase),
                -1,
            )  # fmt: skip
            met.append(end)
            if self.ordered:
                start = end
        progress = []
        for p, phrase in enumerate(self.phrases):
            begin = (met[p - 1] if p else 0) if self.ordered else 0
            if met[p] >= 0 or begin < 0:
                progress.append(0)
                continue
            ks = [
                k for k in range(1, len(phrase)) if len(tokens) - k >= begin and tokens[len(tokens) - k :] == phrase[:k]
            ]
            progress.append(max(ks, default=0))
        return met, progress

    def all_met(self, tokens: list[int]) -> bool:
        return all(m >= 0 for m in self.state(tokens)[0])

    def bank(self, tokens: list[int]) -> int:
        """The constraint tokens `tokens` has met: its met phrases' and its best partial match's."""
        met, progress = self.state(tokens)
        return sum(len(p) for p, m in zip(self.phrases, met) if m >= 0) + max(progress)

    def next_tokens(self, tokens: list[int]) -> list[int]:
        """For each phrase, the token that goes on with it after `tokens` (the first token of a phrase not begun),
        if it is unmet and may begin (ordered: its previous one met); PAD-free ids, phrase by phrase."""
        met, progress = self.state(tokens)
        out = []
        for p, phrase in enumerate(self.phrases):
            if met[p] < 0 and not (self.ordered and p and met[p - 1] < 0):
                out.append(phrase[progress[p]])
        return out

    def allot(self, candidates: list[list[int]], parents, log_p, ends, K: int):
        """Dynamic beam allocation over the step's candidates (their tokens so far, parents, log P, whether each
        ends): which candidates rank among the first K (those that may finish), and the live set (log P (K,),
        picks (K,)), best first. A candidate is dropped if impossible (-inf), a repeat of an earlier one (same
        parent and token), or ending with a phrase unmet; each other's bank is `bank`, its rank the number of
        better ones (higher log P, or equal and earlier) in its bank, and the candidates are taken by rank, then
        from the highest bank down."""
        n = len(candidates)
        banks = sum(len(p) for p in self.phrases) + 1
        seen, keys = set(), []
        for i, tokens in enumerate(candidates):
            pair = (int(parents[i]), tokens[-1])
            ok = bool(log_p[i] > -math.inf) and (self.all_met(tokens) or not bool(ends[i])) and pair not in seen
            if ok:
                seen.add(pair)
            keys.append((ok, self.bank(tokens) if ok else -1))
        order = []
        for i, (ok, bank) in enumerate(keys):
            if ok:
                rank = sum(
                    1 for j, (ok_j, bank_j) in enumerate(keys)
                    if ok_j and bank_j == bank and (log_p[j] > log_p[i] or (log_p[j] == log_p[i] and j < i))
                )  # fmt: skip
                order.append((rank * banks + banks - 1 - bank, i))
        order.sort()
        first = torch.zeros(n, dtype=torch.bool, device=log_p.device)
        for _, i in order[:K]:
            first[i] = True
        live = [i for _, i in order if not bool(ends[i])][:K]
        live.sort(key=lambda i: -float(log_p[i]))  # stable: equal scores keep the allotment's order
        dead = [i for i in range(n) if i not in live][: K - len(live)]  # empty slots: -inf, never extended
        pick = torch.tensor(live + dead, dtype=torch.long, device=log_p.device)
        scores = torch.cat([log_p[live], torch.full((len(dead),), -math.inf, device=log_p.device)])
        return first, (scores, pick)
