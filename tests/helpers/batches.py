"""Token ids and batches built by hand: sources, padded batches of several layouts, packed rows, a corpus's batches."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import numpy as np

from jax_transformer.settings.config import TransformerConfig
from tests.helpers.configs import unit_config


def _first_word(config: TransformerConfig) -> int:
    """The lowest id a random word may take: past PAD, BOS, EOS and the unknown token after them (4 with the
    default ids 0, 1, 2)."""
    return max(config.pad_id, config.start_id, config.eos_id) + 2


def make_src(
    config: TransformerConfig, lengths: Sequence[int], *, seed: int = 0, width: int | None = None
) -> np.ndarray:
    """Right-padded sources (len(lengths), width) int32: row i holds lengths[i] - 1 random ids >= 3 (no PAD, BOS
    or EOS), then EOS, then PAD. A length of 1 is an empty sentence (EOS only); a length equal to `width` (default
    config.max_len) fills the row."""
    rng = np.random.default_rng(seed)
    src = np.full((len(lengths), width or config.max_len), config.pad_id, np.int32)
    for row, n in enumerate(lengths):
        src[row, : n - 1] = rng.integers(3, config.src_vocab_size, n - 1)
        src[row, n - 1] = config.eos_id
    return src


# How make_batch chooses each row's length (see there).
LAYOUTS = ("staircase", "drawn", "full", "noise")


def make_batch(
    config: TransformerConfig,
    seed: int = 0,
    rows: int = 4,
    src_len: int = 11,
    tgt_len: int = 9,
    *,
    layout: str = "staircase",
    padding_row: bool = True,
    src_eos: bool = True,
) -> dict[str, np.ndarray]:
    """A teacher-forcing batch with ragged right padding: {"src": (rows, src_len), "tgt_in": (rows, tgt_len),
    "tgt_out": (rows, tgt_len)}, int32. With `padding_row` the last row is all padding (it must count zero
    target tokens and stay finite).

    `layout` says how the other rows' lengths are chosen:
    - "staircase" (the parity tests'): every row a different length, fixed by its index. Row 0 fills the source
      exactly (src_len - 1 words and EOS); each later row has 3 source words and 2 target words fewer (at least
      one target word). tgt_in = BOS + words, tgt_out = words + EOS.
    - "drawn" (the benchmark's): each row's source length (positions, EOS included if any) and target length
      (predicted tokens, EOS included) drawn uniformly from [width/2, width], so some positions are padding and
      the real target tokens (`target_tokens`) are fewer than rows x tgt_len. The same BOS/EOS convention.
    - "full" (the GPU benchmark's, as packed batches are): every row fills both widths, no padding.
    - "noise" (the unit tests', `unit_batch`): random ids everywhere, no BOS or EOS (tgt_in and tgt_out are one
      drawn sequence shifted by one), drawn as whole matrices; then row r keeps src_len - r % 5 source ids and
      tgt_len + 1 - (2r) % 9 ids of its target sequence, the rest is PAD.
    `src_eos` (staircase and drawn): end each source with EOS (the default), or fill it with words only (the
    benchmark's batch).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose from {LAYOUTS}")
    rng = np.random.default_rng(seed)
    pad, bos, eos, first = config.pad_id, config.start_id, config.eos_id, _first_word(config)
    filled = rows - 1 if padding_row else rows
    if layout == "noise":
        src = rng.integers(first, config.src_vocab_size, (rows, src_len)).astype(np.int32)
        tgt = rng.integers(first, config.tgt_vocab_size, (rows, tgt_len + 1)).astype(np.int32)
        for r in range(rows):
            kept_src, kept_tgt = (src_len - r % 5, tgt_len + 1 - (2 * r) % 9) if r < filled else (0, 0)
            src[r, kept_src:] = pad
            tgt[r, kept_tgt:] = pad
        return {"src": src, "tgt_in": tgt[:, :-1], "tgt_out": tgt[:, 1:]}

    src = np.full((rows, src_len), pad, np.int32)
    tgt_in = np.full((rows, tgt_len), pad, np.int32)
    tgt_out = tgt_in.copy()
    for row in range(filled):
        # Source positions used (words, plus EOS with src_eos), then target positions (BOS + words = words + EOS).
        if layout == "staircase":
            n_src = src_len - 3 * row
        elif layout == "full":
            n_src = src_len
        else:
            n_src = rng.integers(max(int(src_eos), src_len // 2), src_len + 1)
        words = n_src - int(src_eos)
        if words < 0:
            raise ValueError(f"row {row} of {rows}: no room for a source in {src_len} positions")
        src[row, :words] = rng.integers(first, config.src_vocab_size, words)
        if src_eos:
            src[row, words] = eos
        if layout == "staircase":
            n_tgt = max(1, tgt_len - 1 - 2 * row) + 1
        elif layout == "full":
            n_tgt = tgt_len
        else:
            n_tgt = rng.integers(max(1, tgt_len // 2), tgt_len + 1)
        target_words = rng.integers(first, config.tgt_vocab_size, n_tgt - 1)
        tgt_in[row, :n_tgt] = np.concatenate([[bos], target_words])
        tgt_out[row, :n_tgt] = np.concatenate([target_words, [eos]])
    return {"src": src, "tgt_in": tgt_in, "tgt_out": tgt_out}


def unit_batch(seed: int, rows: int = 4) -> dict[str, np.ndarray]:
    """The unit tests' batch for `unit_config()`: make_batch's "noise" layout, src (rows, 10), tgt_in/tgt_out
    (rows, 10), rows of different lengths and none all padding. One shape, so one compiled train step."""
    return make_batch(unit_config(), seed, rows, 10, 10, layout="noise", padding_row=False)


def target_tokens(batch: Mapping[str, np.ndarray], pad_id: int) -> int:
    """How many target tokens a batch predicts (non-PAD tgt_out): what tokens/s figures count."""
    return int((np.asarray(batch["tgt_out"]) != pad_id).sum())


def pad_rows(rows: Sequence[Sequence[int]], width: int | None = None, pad_id: int = 0) -> np.ndarray:
    """Id lists as one right-padded int32 array (len(rows), width); width defaults to the longest row."""
    out = np.full((len(rows), width or max(map(len, rows))), pad_id, np.int32)
    for row, ids in enumerate(rows):
        out[row, : len(ids)] = ids
    return out


def packed_pairs(batch: Mapping[str, np.ndarray]) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """Every pair of a packed batch (jax_transformer.data, batching="packed"), read back through its segment ids:
    (row, source mask, target mask), the masks (L,) bool over the row, True on the pair's own positions."""
    out = []
    for row in range(batch["src"].shape[0]):
        for segment in range(1, int(batch["src_segments"][row].max()) + 1):
            out.append((row, batch["src_segments"][row] == segment, batch["tgt_segments"][row] == segment))
    return out


def unpacked(batch: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The pairs of a packed batch, each alone in its own row, in `packed_pairs` order: {src, tgt_in, tgt_out} of
    shape (pairs, L), right-padded to the packed rows' length L (one shape, so one compilation)."""
    pairs = packed_pairs(batch)
    width = batch["src"].shape[1]
    out = {key: np.zeros((len(pairs), width), np.int32) for key in ("src", "tgt_in", "tgt_out")}
    for i, (row, src_mask, tgt_mask) in enumerate(pairs):
        for key, mask in (("src", src_mask), ("tgt_in", tgt_mask), ("tgt_out", tgt_mask)):
            out[key][i, : mask.sum()] = batch[key][row, mask]
    return out


def corpus_batches(
    encoded, config: TransformerConfig, rows: int, width: int | None = None, seed: int = 0
) -> Iterator[dict[str, np.ndarray]]:
    """Endless batches of `rows` random pairs of an EncodedCorpus (jax_transformer.data), all of one shape
    (rows, width; width defaults to config.max_len), so a train step compiles once. The data.py convention:
    src = tokens + EOS (as encoded), tgt_in = BOS + tokens, tgt_out = tokens + EOS, PAD after. Pairs are drawn
    without replacement within a batch, from one generator seeded once."""
    rng = np.random.default_rng(seed)
    width = width or config.max_len
    while True:
        batch = {key: np.full((rows, width), config.pad_id, np.int32) for key in ("src", "tgt_in", "tgt_out")}
        for row, i in enumerate(rng.choice(len(encoded), rows, replace=False)):
            source, target = encoded.src[i], encoded.tgt[i]
            batch["src"][row, : len(source)] = source
            batch["tgt_in"][row, : len(target) + 1] = np.concatenate([[config.start_id], target])
            batch["tgt_out"][row, : len(target) + 1] = np.concatenate([target, [config.eos_id]])
        yield batch


def packed_batch(config: TransformerConfig, pairs: Sequence[Sequence[tuple[int, int]]], width: int, seed: int = 0):
    """A packed batch by hand: row r holds the pairs pairs[r] = [(source words, target words), ...] one after the
    other (source + EOS; BOS + target / target + EOS), with segment ids 1, 2, ... and positions restarting at 0,
    PAD (segment 0, position 0) after them; every array (rows, width) int32."""
    rng = np.random.default_rng(seed)
    first = _first_word(config)
    keys = ("src", "tgt_in", "tgt_out", "src_segments", "tgt_segments", "src_positions", "tgt_positions")
    batch = {key: np.zeros((len(pairs), width), np.int32) for key in keys}
    batch["src"][:] = batch["tgt_in"][:] = batch["tgt_out"][:] = config.pad_id
    for r, row in enumerate(pairs):
        s = t = 0
        for segment, (n_src, n_tgt) in enumerate(row, start=1):
            words = rng.integers(first, config.tgt_vocab_size, n_tgt)
            batch["src"][r, s : s + n_src + 1] = np.append(
                rng.integers(first, config.src_vocab_size, n_src), config.eos_id
            )
            batch["tgt_in"][r, t : t + n_tgt + 1] = np.append(config.start_id, words)
            batch["tgt_out"][r, t : t + n_tgt + 1] = np.append(words, config.eos_id)
            batch["src_segments"][r, s : s + n_src + 1] = segment
            batch["tgt_segments"][r, t : t + n_tgt + 1] = segment
            batch["src_positions"][r, s : s + n_src + 1] = np.arange(n_src + 1)
            batch["tgt_positions"][r, t : t + n_tgt + 1] = np.arange(n_tgt + 1)
            s, t = s + n_src + 1, t + n_tgt + 1
    return batch
