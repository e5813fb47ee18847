"""Lexical constraints, a strategy of the one search loop (`search.advance` calls it): phrases that must appear in a
row's output (ordered or unordered) and phrases that must not, all as arrays, vectorized under jit.

Positive phrases (Hu et al. 2019, Post & Vilar 2018's dynamic beam allocation, as fairseq's
`LexicallyConstrainedBeamSearch`): a row's phrases are (P, M) token arrays (`Rows.phrases`, PAD-padded, their lengths
`Rows.phrase_len`, 0 for an unused slot). Each live hypothesis carries, per phrase, where it was completed
(`SearchState.met_at`: the output length at its last token, -1 while unmet) and how many of its first tokens end the
hypothesis (`SearchState.progress`: the longest prefix of the phrase that is a suffix of the hypothesis, so a phrase
is matched wherever it occurs). Unordered: each phrase anywhere; ordered: each after the previous one's end. A step's
candidates are the rules' own (the 2K best extensions), each live hypothesis's best single extension, and for each
live hypothesis the next token of each phrase it may go on with; duplicates are dropped; each candidate's bank is
the number of constraint tokens it has met (the tokens of its met phrases and of its best partial match); the live
set is the K candidates of smallest key rank * banks + (banks - 1 - bank), rank being its place by score within its
bank (round-robin over the banks, the furthest first, unused slots passing on), then sorted by score. EOS is banned
until every phrase is met; a candidate reaching the length limit with a phrase unmet is dropped, so every finished
hypothesis holds every phrase. A row with no phrases takes the rules' plain live set: its tokens are those of a
search without constraints.

Negative phrases (`Rows.banned`, `Rows.banned_len`): a token that would complete one is made impossible (a target
prefix, forced, is not checked).

Sizes: P and M are padded to one of PHRASE_SIZES and TOKEN_SIZES (`padded_size`), so that a service can compile the
few programs ahead."""

from __future__ import annotations

import re
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np
from jax import lax

PHRASE_SIZES = (1, 2, 4, 8)  # phrases per row a program is made for
TOKEN_SIZES = (4, 8, 16)  # tokens per phrase a program is made for


def padded_size(n: int, sizes: Sequence[int], what: str) -> int:
    """The first of `sizes` that holds `n` (a ValueError naming `what` where none does)."""
    for size in sizes:
        if n <= size:
            return size
    raise ValueError(f"{n} {what}: at most {sizes[-1]}")


def parse_size(text: str, origin: str = "--constraint-size") -> tuple[int, int] | None:
    """ "PxM" (phrases per row x tokens per phrase, e.g. "2x8") as (P, M); "" is None (no fixed size). A ValueError
    naming `origin` for another form or a size past PHRASE_SIZES[-1] x TOKEN_SIZES[-1]."""
    if not text:
        return None
    found = re.fullmatch(r"\s*(\d+)\s*x\s*(\d+)\s*", text)
    size = (int(found[1]), int(found[2])) if found else None
    if size is None or not (1 <= size[0] <= PHRASE_SIZES[-1] and 1 <= size[1] <= TOKEN_SIZES[-1]):
        raise ValueError(
            f"{origin} {text!r}: expected PxM, phrases per sentence x tokens per phrase, P in 1..{PHRASE_SIZES[-1]} "
            f"and M in 1..{TOKEN_SIZES[-1]} (e.g. 2x8)"
        )
    return size


def phrase_arrays(
    phrases: Sequence[Sequence[Sequence[int]] | None], pad_id: int, size: tuple[int, int] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Each row's phrases (a list of id lists, or None: none) as (B, P, M) int32 PAD-padded tokens and (B, P) int32
    lengths (0: an unused slot), P and M padded to PHRASE_SIZES and TOKEN_SIZES, or to `size` (P, M) where given
    (a service's one compiled size; a ValueError for phrases past it)."""
    rows = [list(p or []) for p in phrases]
    phrase_sizes, token_sizes = ((size[0],), (size[1],)) if size else (PHRASE_SIZES, TOKEN_SIZES)
    P = padded_size(max((len(p) for p in rows), default=1) or 1, phrase_sizes, "phrases in a row")
    M = padded_size(max((len(x) for p in rows for x in p), default=1) or 1, token_sizes, "tokens in a phrase")
    tokens = np.full((len(rows), P, M), pad_id, np.int32)
    lengths = np.zeros((len(rows), P), np.int32)
    for b, row in enumerate(rows):
        for p, ids in enumerate(row):
            tokens[b, p, : len(ids)], lengths[b, p] = ids, len(ids)
    return tokens, lengths


# =============================================================================================================
# In the loop
# =============================================================================================================


def initial_state(B: int, K: int, P: int) -> dict:
    """The constraint fields of `SearchState` before the first step: nothing met, nothing matched."""
    return dict(met_at=jnp.full((B, K, P), -1, jnp.int32), progress=jnp.zeros((B, K, P), jnp.int32))


def _window(tokens, end, M: int):
    """tokens (B, N, L) at positions end - M .. end - 1 -> (B, N, M), -1 where a position is before the start."""
    padded = jnp.pad(tokens, ((0, 0), (0, 0), (M, 0)), constant_values=-1)
    return lax.dynamic_slice_in_dim(padded, end, M, axis=2)


def _met(met_at, lengths):
    """(B, N, P) whether each phrase is met (an unused slot always is)."""
    return (met_at >= 0) | (lengths[:, None, :] == 0)


def all_met(met_at, lengths):
    """(B, N) whether every phrase is met."""
    return jnp.all(_met(met_at, lengths), axis=-1)


def ban_unmet_eos(scores, met_at, lengths, eos_id: int, impossible=-jnp.inf):
    """scores (B, K, V) with EOS impossible for the hypotheses that have a phrase unmet."""
    eos = jnp.where(all_met(met_at, lengths), scores[..., eos_id], impossible)
    return scores.at[..., eos_id].set(eos)


def _may_start(met_at, ordered):
    """(B, N, P) the output length from which each phrase may begin: 0 unordered; ordered, the previous phrase's
    end (-1: the previous phrase is unmet, the phrase may not begin)."""
    previous = jnp.concatenate([jnp.zeros_like(met_at[..., :1]), met_at[..., :-1]], axis=-1)
    return jnp.where(ordered[:, None, None], previous, 0)


def advance_state(tokens, t, phrases, lengths, ordered, met_at):
    """The constraint state of hypotheses `tokens` (B, N, L) whose last token is at position t, from their parents'
    `met_at` (B, N, P): (met_at, progress, bank (B, N): constraint tokens met)."""
    M = phrases.shape[-1]
    window = _window(tokens, t + 1, M)  # (B, N, M) the last M tokens
    start = _may_start(met_at, ordered)  # (B, N, P)
    progress = jnp.zeros(met_at.shape, jnp.int32)
    complete = jnp.zeros(met_at.shape, bool)
    for k in range(1, M + 1):  # the phrase's first k tokens end the hypothesis, after where it may start
        same = jnp.all(phrases[:, None, :, :k] == window[:, :, None, M - k :], axis=-1)  # (B, N, P)
        match = same & (k <= lengths[:, None, :]) & (start >= 0) & (t + 1 - k >= start)
        complete = complete | (match & (k == lengths[:, None, :]))
        progress = jnp.where(match & (k < lengths[:, None, :]), k, progress)
    met_at = jnp.where(met_at >= 0, met_at, jnp.where(complete, t + 1, -1))
    met = _met(met_at, lengths)
    progress = jnp.where(met, 0, progress)
    bank = jnp.sum(jnp.where(met, lengths[:, None, :], 0), axis=-1) + jnp.max(progress, axis=-1)
    return met_at, progress, bank


def phrase_candidates(live_scores, scores, phrases, lengths, ordered, met_at, progress, impossible):
    """For each live hypothesis (B, K) and phrase, the extension by the phrase's next token: (log P, parent, token),
    each (B, K * P), `impossible` where the phrase is met or may not go on (ordered: its previous one unmet)."""
    B, K, P = met_at.shape
    token = jnp.take_along_axis(phrases[:, None], progress[..., None], axis=-1)[..., 0]  # (B, K, P)
    token = jnp.where(lengths[:, None, :] > 0, token, 0)
    gained = jnp.take_along_axis(scores, token, axis=-1)  # (B, K, P)
    usable = ~_met(met_at, lengths) & (_may_start(met_at, ordered) >= 0)
    log_p = jnp.where(usable, live_scores[:, :, None] + gained, impossible)
    parent = jnp.broadcast_to(jnp.arange(K)[None, :, None], (B, K, P))
    return log_p.reshape(B, K * P), parent.reshape(B, K * P), token.reshape(B, K * P)


def best_extensions(live_scores, scores):
    """Each live hypothesis's best single extension (first token on ties): (log P, parent, token), each (B, K)."""
    B, K, _ = scores.shape
    token = jnp.argmax(scores, axis=-1).astype(jnp.int32)  # (B, K)
    gained = jnp.take_along_axis(scores, token[..., None], axis=-1)[..., 0]
    return live_scores + gained, jnp.broadcast_to(jnp.arange(K), (B, K)), token


def allot(log_p, parents, tokens, ends, met, bank, banks: int, K: int, impossible):
    """The live set by dynamic beam allocation. log_p, parents, tokens, ends, bank (B, C): the candidates, whether
    each ends, its bank; met (B, C): whether it has met every phrase. Returns the live set's (scores (B, K), picks
    (B, K), best first) and which candidates rank among the first K (B, C: those that may finish)."""
    B, C = log_p.shape
    index = jnp.arange(C)
    valid = (log_p > impossible) & (met | ~ends)  # an ending candidate with a phrase unmet is dropped
    same = (parents[:, :, None] == parents[:, None, :]) & (tokens[:, :, None] == tokens[:, None, :])  # (B, C, C)
    earlier = index[None, :] < index[:, None]  # [i, j]: j before i
    valid = valid & ~jnp.any(same & earlier & valid[:, None, :], axis=-1)  # the first of duplicates stays
    better = (log_p[:, None, :] > log_p[:, :, None]) | ((log_p[:, None, :] == log_p[:, :, None]) & earlier)
    in_bank = (bank[:, None, :] == bank[:, :, None]) & valid[:, None, :]
    rank = jnp.sum(better & in_bank, axis=-1)  # (B, C) its place by score within its bank
    never = banks * (C + 1)  # past every valid key
    key = jnp.where(valid, rank * banks + (banks - 1 - bank), never)  # (B, C), unique where valid
    first = jnp.sum(key[:, None, :] < key[:, :, None], axis=-1) < K
    live_key = jnp.where(ends, never, key)
    pick = jnp.argsort(live_key, axis=1, stable=True)[:, :K]  # (B, K)
    taken = jnp.take_along_axis(live_key, pick, axis=1) < never
    scores = jnp.where(taken, jnp.take_along_axis(log_p, pick, axis=1), impossible)
    order = jnp.argsort(-scores, axis=1, stable=True)  # best first, as the rules' early stop expects
    return jnp.take_along_axis(scores, order, axis=1), jnp.take_along_axis(pick, order, axis=1), first & valid


def ban_phrases(scores, past, t, banned, banned_len):
    """scores (N, V) with every token that would complete a banned phrase impossible (-inf). past (N, L): the
    hypotheses' tokens before position t; banned (N, Q, M), banned_len (N, Q) (0: an unused slot)."""
    M = banned.shape[-1]
    window = _window(past[:, None], t, M)[:, 0]  # (N, M) the last M tokens
    hit = jnp.zeros(banned.shape[:2], bool)
    for k in range(1, M + 1):  # a phrase of k tokens: its first k - 1 are the last k - 1 of the hypothesis
        same = jnp.all(banned[:, :, : k - 1] == window[:, None, M - k + 1 :], axis=-1)  # (N, Q)
        hit = hit | (same & (banned_len == k) & (t >= k - 1))
    last = jnp.take_along_axis(banned, jnp.maximum(banned_len - 1, 0)[..., None], axis=-1)[..., 0]  # (N, Q)
    rows = jnp.arange(scores.shape[0])[:, None]
    mask = jnp.zeros(scores.shape, bool).at[rows, last].max(hit)
    return jnp.where(mask, -jnp.inf, scores)
