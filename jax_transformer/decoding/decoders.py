"""The decoders callers use. `decoder(config, decode, width)` is the one factory: a `DecodeConfig` (every decoding
choice) in, a `Decoder` out, ready to run on batches of a source width and returning `Decoded` hypotheses (n-best,
scores, per-token log-probs). `greedy_search` and `beam_search` (this project's rules) and `generate`
(transformers', for the models imported from it) are its shortcuts. Each is the one search loop of
`jax_transformer.decoding.search` with a strategy of rules, run through a schedule (`jax_transformer.decoding.schedule`:
the CPU's by default there, a batch whole elsewhere). The conventions in full: docs/internals.md#search."""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jax_transformer import checks
from jax_transformer.decoding import schedule as schedules
from jax_transformer.decoding.constraints import PHRASE_SIZES, TOKEN_SIZES, parse_size, phrase_arrays
from jax_transformer.decoding.search import Gnmt, Rows, Rules, Sampler, Transformers
from jax_transformer.errors import TokenError
from jax_transformer.settings.config import EARLY_STOPPING, DecodeConfig, TransformerConfig, beam_limit

# The length rule's defaults: DecodeConfig's (`--max-len-a`, `--max-len-b`), declared once there.
DEFAULT_MAX_LEN_A, DEFAULT_MAX_LEN_B = DecodeConfig().max_len_a, DecodeConfig().max_len_b


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
    if beam_size > beam_limit(config.tgt_vocab_size):
        raise ValueError(
            f"beam_size={beam_size} needs tgt_vocab_size >= 2 * beam_size + 3, got "
            f"{config.tgt_vocab_size}: the first step takes the 2 * beam_size best extensions of one "
            f"beam, and PAD, BOS and EOS may be banned"
        )
    if not alpha >= 0:
        raise ValueError(f"alpha must be >= 0 (the early stop relies on the penalty growing with length), got {alpha}")


def on_device(params):
    """params with its numpy leaves (a checkpoint's, as `checkpoint.load` gives them) put on the device once: a
    program called on numpy arrays copies them in at every call, and a search makes dozens of calls. Arrays already
    on a device stay where they are (`jax.device_put`, not `jnp.asarray`, which compiles a program per leaf shape)."""
    return jax.tree.map(lambda x: jax.device_put(x) if isinstance(x, np.ndarray) else x, params)


# =============================================================================================================
# A decoder: rules, an output length and the rows' limits, for batches of one source width
# =============================================================================================================


@dataclasses.dataclass(frozen=True)
class Decoded:
    """What a decoder returns for B sentences, n hypotheses each, best first: tokens (B, n, L) (no start token;
    a target prefix's tokens first; EOS where emitted; PAD after), scores (B, n) (by the rules: log P over the
    length penalty of beam search, the sum of the log-probs of greedy search and sampling; a prefix's tokens not
    counted), token_scores (B, n, L) (each token's log-prob, 0 for a prefix's; 0 after the end) and found (B, n)
    (False for a slot no hypothesis reached: its score is the rules' `impossible`); with the rules'
    `alignment_layer`, alignments (B, n, L) (the source position each token attends to most, -1 after the end;
    `decoding.alignment` makes word pairs of them), else None."""

    tokens: np.ndarray
    scores: np.ndarray
    token_scores: np.ndarray
    found: np.ndarray
    alignments: np.ndarray | None = None

    def best(self) -> tuple[np.ndarray, np.ndarray]:
        """The best hypothesis of each sentence: tokens (B, L) and score (B,)."""
        return self.tokens[:, 0], self.scores[:, 0]

    def row(self, i: int) -> Decoded:
        """Sentence i's hypotheses, a Decoded of one row."""
        aligned = None if self.alignments is None else self.alignments[i : i + 1]
        return Decoded(
            self.tokens[i : i + 1], self.scores[i : i + 1], self.token_scores[i : i + 1], self.found[i : i + 1], aligned
        )


@dataclasses.dataclass(frozen=True)
class Decoder:
    """A search ready to run on batches of sources `width` wide: its rules (a `search.Rules`), the width L of the
    tokens it returns, the length rule of its rows (GNMT's `max_len_a` x source length + `max_len_b`, capped at
    L; None: every row may produce L tokens), and how many hypotheses it returns (`n_best`: the best of the
    search's K, or as many independent samples when its rules sample)."""

    config: TransformerConfig
    rules: Rules
    length: int
    max_len_a: float | None = None
    max_len_b: float | None = None
    n_best: int = 1
    ordered_constraints: bool = False  # a row's phrases must appear in their order (`constraints`)
    phrase_size: tuple[int, int] | None = None  # (P, M) every row's phrases are padded to (None: the smallest fit)

    def limits(self, src: np.ndarray) -> np.ndarray:
        """(B,) int32: tokens each row of `src` may produce."""
        if self.max_len_a is None:
            return np.full(src.shape[0], self.length, np.int32)
        return max_new_tokens(src, self.config, self.max_len_a, self.max_len_b)

    @property
    def samples(self) -> int:
        """Rows each source is decoded as: `n_best` when sampling (one sample a row), else 1."""
        return self.n_best if self.rules.sampler is not None else 1

    def rows(
        self,
        src: np.ndarray,
        prefixes: Sequence[Sequence[int]] | None = None,
        sample: np.ndarray | None = None,
        constraints: Sequence[Sequence[Sequence[int]] | None] | None = None,
        banned: Sequence[Sequence[Sequence[int]] | None] | None = None,
    ) -> Rows:
        """Each row's `search.Rows`: its limit, its target prefix (ids, without the decoder's start token; None:
        none), its draw id (`draw_ids`, of the row's `sample` number), the phrases (id lists) it must hold
        (`constraints`) and those it must not (`banned`), a list per row or None. A prefix that leaves no room for a
        token of its own, or phrases the search cannot take (`check_phrases`), are a TokenError naming the row."""
        B = src.shape[0]
        limit = self.limits(src)
        prefix = np.full((B, self.length), self.config.pad_id, np.int32)
        prefix_len = np.zeros(B, np.int32)
        for row, ids in enumerate(prefixes or [None] * B):
            if ids is None or len(ids) == 0:
                continue
            if len(ids) >= limit[row]:
                raise TokenError(
                    f"row {row}: a target prefix of {len(ids)} tokens leaves no room for decoding (this row may "
                    f"produce {limit[row]} tokens, the prefix's and EOS included)"
                )
            checks.check_tokens(f"target prefix of row {row}", np.asarray([ids]), self.config, "target")
            if self.config.eos_id in ids:
                raise TokenError(
                    f"row {row}: a target prefix holds EOS (id {self.config.eos_id}): nothing would follow"
                )
            prefix[row, : len(ids)], prefix_len[row] = ids, len(ids)
        rows = Rows(limit=limit, prefix=prefix, prefix_len=prefix_len, draw=draw_ids(src, self.config.pad_id, sample))
        if constraints is not None and any(constraints):
            self.check_phrases(constraints, limit - prefix_len, [f"row {i}" for i in range(B)])
            phrases, lengths = phrase_arrays(constraints, self.config.pad_id, self.phrase_size)
            ordered = np.full(B, self.ordered_constraints)
            rows = rows.replace(phrases=phrases, phrase_len=lengths, ordered=ordered)
        if banned is not None and any(banned):
            self.check_phrases(banned, None, [f"row {i}" for i in range(B)], must_appear=False)
            tokens, lengths = phrase_arrays(banned, self.config.pad_id)
            rows = rows.replace(banned=tokens, banned_len=lengths)
        return rows

    def with_order(self, order: str, size: str = "") -> Decoder:
        """This decoder with its rows' phrases "ordered" or "unordered" (DecodeConfig.constraint_order), padded to
        `size` ("PxM", DecodeConfig.constraint_size; "": the smallest of PHRASE_SIZES x TOKEN_SIZES that fits)."""
        return dataclasses.replace(self, ordered_constraints=order == "ordered", phrase_size=parse_size(size))

    def check_phrases(
        self, phrases: Sequence, room: Sequence[int] | None, names: Sequence[str], must_appear: bool = True
    ) -> None:
        """A TokenError naming the row (`names`) unless each row's phrases (id lists, or None) suit this search:
        beam search (not greedy search or sampling), at most `beams` phrases of at most TOKEN_SIZES[-1] valid target
        ids each, none empty or holding EOS, and (`room`: tokens each row may produce after its prefix) their tokens
        together no more than the row may produce."""
        what = "phrases that must appear" if must_appear else "phrases that must not appear"
        for row, given in enumerate(phrases):
            if not given:
                continue
            name = names[row]
            if must_appear and (self.rules.greedy or self.rules.sampler is not None):
                raise TokenError(f"{name}: {what} need beam search (beam size 2 or more, no sampling)")
            fixed = must_appear and self.phrase_size is not None  # --constraint-size: at most its P x M
            P, M = self.phrase_size if fixed else (PHRASE_SIZES[-1], TOKEN_SIZES[-1])
            most = min(self.rules.beams, P) if must_appear else P
            if len(given) > most:
                per_beam = f"at most one per beam, of {self.rules.beams}, and " if must_appear else ""
                raise TokenError(
                    f"{name}: {len(given)} {what}, more than this search takes ({most}: {per_beam}at most "
                    f"{P}{' by --constraint-size' if fixed else ''})"
                )
            for i, ids in enumerate(given):
                if len(ids) == 0:
                    raise TokenError(f"{name}: phrase {i + 1} of the {what} is empty")
                if len(ids) > M:
                    raise TokenError(f"{name}: phrase {i + 1} has {len(ids)} tokens, more than {M}"
                                     f"{' (--constraint-size)' if fixed else ''}")  # fmt: skip
                checks.check_tokens(f"{name}, phrase {i + 1}", np.asarray([ids]), self.config, "target")
                if self.config.eos_id in ids:
                    raise TokenError(f"{name}: phrase {i + 1} holds EOS (id {self.config.eos_id})")
            if room is not None and sum(len(ids) for ids in given) > room[row]:
                raise TokenError(
                    f"{name}: its phrases have {sum(len(ids) for ids in given)} tokens in all, more than the "
                    f"{int(room[row])} this sentence may produce (after its prefix): raise the length limit"
                )

    def __call__(
        self,
        params,
        src: np.ndarray,
        schedule: schedules.Schedule | None = None,
        prefixes: Sequence[Sequence[int] | None] | None = None,
        constraints: Sequence[Sequence[Sequence[int]] | None] | None = None,
        banned: Sequence[Sequence[Sequence[int]] | None] | None = None,
    ) -> Decoded:
        """The `n_best` hypotheses of each row of checked sources `src` (B, S), each row starting from its target
        prefix if `prefixes` (B lists of ids, or None) gives one, holding the phrases (lists of ids) `constraints`
        gives it and none of those `banned` gives it (`Rows`; a list of phrases or None per row); `schedule`: how
        the batch runs (default: `schedule.default()`, the CPU's schedule there, the batch whole elsewhere)."""
        schedule = schedule or schedules.default()
        n, sample = self.samples, None
        if n > 1:  # each sample a row of its own, its draws keyed by the sentence and the sample's number
            sample = np.tile(np.arange(n), len(src))
            src = np.repeat(src, n, axis=0)
            prefixes = None if prefixes is None else [p for p in prefixes for _ in range(n)]
            banned = None if banned is None else [p for p in banned for _ in range(n)]
        rows = self.rows(src, prefixes, sample, constraints, banned)
        found = schedule.decode(on_device(params), self.config, self.rules, src, rows, self.length)
        if n > 1:  # (B * n, 1, ...) -> (B, n, ...)
            return Decoded(*(x.reshape(-1, n, *x.shape[2:]) for x in found))
        return Decoded(*(x[:, : self.n_best] for x in found))

    def programs(self, params, rows: int, width: int, schedule: schedules.Schedule) -> dict:
        """Compile jobs for what `schedule` runs this decoder as on (rows, width) sources (`Schedule.programs`)."""
        return schedule.programs(on_device(params), self.config, self.rules, rows * self.samples, width, self.length)


def draw_ids(src: np.ndarray, pad_id: int, sample: np.ndarray | None = None) -> np.ndarray:
    """(B,) uint32: each row's draw id, from its source tokens (and the number of its sample): a sentence's random
    draws depend on it and the seed only, not on its batch or its place there."""
    sample = np.zeros(len(src), np.int64) if sample is None else sample
    ids = [
        zlib.crc32(np.int64(k).tobytes(), zlib.crc32(row[row != pad_id].astype(np.int32).tobytes()))
        for row, k in zip(np.asarray(src), sample)
    ]
    return np.array(ids, np.uint32)


def decoder(config: TransformerConfig, decode: DecodeConfig, width: int) -> Decoder:
    """The one factory: the decoder `decode` asks for, on sources `width` wide. Rules "gnmt" are this project's
    search (greedy for beam_size 1), "transformers" transformers' `generate` (max_length defaults to the model's
    max_len + 1); either samples with do_sample."""
    sampler = None
    if decode.do_sample:
        sampler = Sampler(
            temperature=np.float32(decode.temperature),
            top_p=np.float32(decode.top_p),
            seed=np.uint32(decode.sample_seed),
            top_k=int(decode.top_k),
        )
    if decode.rules != "transformers":
        return gnmt_decoder(
            config,
            width,
            beam_size=decode.beams,
            alpha=decode.alpha,
            max_len_a=decode.max_len_a,
            max_len_b=decode.max_len_b,
            min_len=max(decode.min_length - 1, 0),  # min_length counts the decoder's start token
            greedy=decode.beams == 1,
            n_best=decode.n_best,
            sampler=sampler,
            alignment_layer=decode.aligned_layer(config),
        ).with_order(decode.constraint_order, decode.constraint_size)
    return transformers_decoder(
        config,
        max_length=decode.output_limit(config),
        num_beams=decode.beams,
        length_penalty=decode.alpha,
        early_stopping=decode.early_stopping,
        banned=decode.banned_ids(),
        forced_eos=decode.forced_eos,
        min_length=decode.min_length,
        forced_bos=decode.forced_bos,
        repetition_penalty=decode.repetition_penalty,
        no_repeat_ngram_size=decode.no_repeat_ngram_size,
        n_best=decode.n_best,
        sampler=sampler,
        alignment_layer=decode.aligned_layer(config),
    ).with_order(decode.constraint_order, decode.constraint_size)


def gnmt_decoder(
    config: TransformerConfig,
    width: int,
    *,
    beam_size: int = 4,
    alpha: float = 0.6,
    max_len_a: float = DEFAULT_MAX_LEN_A,
    max_len_b: float = DEFAULT_MAX_LEN_B,
    min_len: int = 0,
    greedy: bool = False,
    n_best: int = 1,
    sampler: Sampler | None = None,
    alignment_layer: int | None = None,
) -> Decoder:
    """This project's search on sources `width` wide (`search.Gnmt`): greedy, or beam search of `beam_size` with the
    GNMT length penalty of exponent `alpha`; with a `sampler`, sampling (greedy's loop, a drawn token);
    `alignment_layer`: the decoder layer whose cross-attention aligns the output (None: no alignments)."""
    _check_options(config, max_len_a, max_len_b, min_len, beam_size, alpha)
    length = output_length(width, config, max_len_a, max_len_b)
    rules = Gnmt(
        beams=1 if greedy else int(beam_size),
        greedy=greedy,
        start_id=config.start_id,
        eos_id=config.eos_id,
        penalties=jax.device_put(length_penalties(length, 0.0 if greedy else alpha)),
        min_len=np.int32(min_len),
        pad_id=config.pad_id,
        bos_id=config.bos_id,
        sampler=sampler,
        alignment_layer=alignment_layer,
    )
    return Decoder(config, rules, length, max_len_a, max_len_b, _n_best(n_best, rules))


def transformers_decoder(
    config: TransformerConfig,
    *,
    max_length: int,
    num_beams: int = 1,
    length_penalty: float = 1.0,
    early_stopping: str = "false",
    banned: tuple[int, ...] = (),
    forced_eos: bool = False,
    min_length: int = 0,
    forced_bos: int | None = None,
    repetition_penalty: float = 1.0,
    no_repeat_ngram_size: int = 0,
    n_best: int = 1,
    sampler: Sampler | None = None,
    alignment_layer: int | None = None,
) -> Decoder:
    """transformers' `generate(num_beams=..., do_sample=...)` (`search.Transformers`): outputs of max_length - 1
    tokens (the start token not counted); `alignment_layer` as for `gnmt_decoder`."""
    if not repetition_penalty > 0 or no_repeat_ngram_size < 0:
        raise ValueError(
            f"repetition_penalty must be > 0 and no_repeat_ngram_size >= 0, got {repetition_penalty} and "
            f"{no_repeat_ngram_size}"
        )
    if early_stopping not in EARLY_STOPPING:
        raise ValueError(f"early_stopping must be one of {EARLY_STOPPING}, got {early_stopping!r}")
    if not 2 <= max_length <= config.max_len + 1:
        raise ValueError(f"max_length must be in [2, config.max_len + 1 = {config.max_len + 1}], got {max_length}")
    rules = Transformers(
        beams=int(num_beams),
        greedy=num_beams == 1,
        start_id=config.start_id,
        eos_id=config.eos_id,
        min_length=np.int32(min_length),
        length_penalty=np.float32(length_penalty),
        forced_bos=np.int32(-1 if forced_bos is None else forced_bos),
        max_length=int(max_length),
        banned=tuple(int(i) for i in banned),
        forced_eos=bool(forced_eos),
        early_stopping=early_stopping,
        penalize=repetition_penalty != 1.0,
        repetition_penalty=np.float32(repetition_penalty),
        no_repeat_ngram=int(no_repeat_ngram_size),
        sampler=sampler,
        alignment_layer=alignment_layer,
    )
    return Decoder(config, rules, int(max_length) - 1, n_best=_n_best(n_best, rules))


def _n_best(n: int, rules: Rules) -> int:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 1 <= n:
        raise ValueError(f"n_best must be an int >= 1, got {n!r}")
    if rules.sampler is None and n > rules.beams:
        raise ValueError(f"n_best={n} is more than the {rules.beams} hypotheses the search keeps (its beams)")
    if rules.sampler is not None and rules.beams != 1:
        raise ValueError(f"sampling draws one hypothesis at a time: beams must be 1, got {rules.beams}")
    return int(n)


# =============================================================================================================
# The searches
# =============================================================================================================


def greedy_search(
    params,
    config: TransformerConfig,
    src,
    *,
    max_len_a: float = DEFAULT_MAX_LEN_A,
    max_len_b: float = DEFAULT_MAX_LEN_B,
    min_len: int = 0,
    schedule: schedules.Schedule | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Greedy decoding of a batch of right-padded sources (B, S).

    Returns:
        tokens (B, L) int32 (no BOS; EOS where emitted; PAD after) and scores (B,) float32, the sum of the chosen
        tokens' log-probabilities. L and the length rule: docs/internals.md#search. `schedule`: how the batch runs
        (`jax_transformer.decoding.schedule`; default: `schedule.default()`).
    """
    src = check_source(src, config)
    options = dict(max_len_a=max_len_a, max_len_b=max_len_b, min_len=min_len)
    return gnmt_decoder(config, src.shape[1], beam_size=1, greedy=True, **options)(params, src, schedule).best()


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
    schedule: schedules.Schedule | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Beam search over a batch of right-padded sources (B, S) with the GNMT length penalty.

    Returns:
        The best hypothesis of each row, tokens (B, L) int32 (no BOS; EOS where emitted; PAD after), and its score
        (B,) float32 = log P / ((5 + length) / 6) ** alpha. With alpha = 0 and beam_size = 1 this is exactly greedy
        search (with alpha > 0 the runner-up kept live when greedy's EOS finishes may later beat it). `schedule`: as
        for `greedy_search`.
    """
    src = check_source(src, config)
    options = dict(beam_size=beam_size, alpha=alpha, max_len_a=max_len_a, max_len_b=max_len_b, min_len=min_len)
    return gnmt_decoder(config, src.shape[1], **options)(params, src, schedule).best()


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
    forced_bos: int | None = None,
    repetition_penalty: float = 1.0,
    no_repeat_ngram_size: int = 0,
    schedule: schedules.Schedule | None = None,
) -> np.ndarray:
    """transformers' `generate(num_beams=..., do_sample=False)` on right-padded sources (B, S).

    Args:
        max_length: the longest output, the decoder's start token included.
        early_stopping: "false", "true" or "never", as transformers'.
        banned: ids never produced (its one-token bad_words_ids).
        forced_eos: only EOS at the last position (its forced_eos_token_id).
        min_length: no EOS before the output (start token included) is this long.
        forced_bos: the first output token (its forced_bos_token_id: a target language's code).
        repetition_penalty: a token already in the output (start token included) has its score divided by this
            when positive, multiplied when negative (its repetition_penalty; 1: off).
        no_repeat_ngram_size: no n-gram of this many tokens occurs twice in an output, start token included.
        schedule: as for `greedy_search`.

    Returns:
        tokens (B, max_length - 1) without the decoder's start token, PAD after the end. For n-best lists, scores,
        sampling and prefixes: `decoder` with a DecodeConfig.
    """
    src = check_source(src, config)
    options = dict(early_stopping=early_stopping, banned=banned, forced_eos=forced_eos, min_length=min_length)
    options.update(
        forced_bos=forced_bos, repetition_penalty=repetition_penalty, no_repeat_ngram_size=no_repeat_ngram_size
    )
    decoder = transformers_decoder(
        config, max_length=max_length, num_beams=num_beams, length_penalty=length_penalty, **options
    )
    return decoder(params, src, schedule).tokens[:, 0]
