"""The one home of the data and model helpers shared by tests/, parity_tests/ and benchmarks/.

Conventions, everywhere below:
- Token ids are numpy int32 arrays (what the Flax model and the data pipeline use). PyTorch wants int64 indices:
  convert at the call, with `t()` (which turns integer arrays into int64 tensors) or `torch.from_numpy(x).long()`.
- Padding is on the right: a row is its tokens, then `config.pad_id` to the width of the batch.
- Sources end with EOS where a case says so (`make_src`, the "staircase" batches); decoder inputs start with BOS,
  and targets (`tgt_out`) are the decoder inputs shifted left, ending with EOS: tgt_in = BOS w1 .. wn,
  tgt_out = w1 .. wn EOS. Random word ids start past the special ids, so no special token appears by chance.
- Where a case wants it, the last row is all padding (an empty sentence: every key masked, zero target tokens).
- Everything is deterministic in its `seed`: the same call gives the same numbers, so the figures the parity
  tests report and the benchmark's token counts stay comparable from run to run.
- The PyTorch twin runs on `twin_device()`: $TWIN_DEVICE, "cpu" unless `pytest --device cuda` (conftest.py) or
  the environment says otherwise. `torch_twin`, `twin_models` and `t` put models and inputs there; `max_abs_diff`
  and `to_numpy` bring results back.

Nothing here imports jax or torch at module level: the benchmark imports this module before it has set up the
compilation caches that jax and torch read when they are first imported (benchmarks/run.py, isolate_caches).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jax_transformer.config import TransformerConfig, preset

# =============================================================================================================
# Configurations
# =============================================================================================================

_SMALL = dict(
    d_model=64,
    num_heads=4,
    d_ff=128,
    num_encoder_layers=2,
    num_decoder_layers=2,
    max_len=32,
    src_vocab_size=97,
    tgt_vocab_size=89,
)

# The configurations every parity check runs over (parity_tests/conftest.py's `config_case` fixture).
PARITY_CONFIGS: dict[str, TransformerConfig] = {
    # the paper: post-norm, sinusoidal, tied output, relu, biased projections
    "post_sinusoidal_tied_relu": TransformerConfig(**_SMALL),
    # the Annotated Transformer's layout: pre-norm with final norms; plus learned positions, untied, gelu, no bias
    # (and no bias anywhere: attention, feed-forward, LayerNorms, the output head, as nn.Transformer(bias=False))
    "pre_learned_untied_gelu_nobias": TransformerConfig(
        **_SMALL,
        norm_first=True,
        final_norm=True,
        positions="learned",
        tie_output=False,
        activation="gelu",
        qkv_bias=False,
        ffn_bias=False,
        norm_bias=False,
        output_bias=False,
    ),
    # one shared source/target table, unscaled embeddings, post-norm with final norms
    "post_shared_unscaled_final": TransformerConfig(
        **{**_SMALL, "tgt_vocab_size": 97}, share_embeddings=True, scale_embeddings=False, final_norm=True
    ),
    # what imported models need (Marian, fairseq): sinusoids in halves with tensor2tensor's frequencies counted
    # from position 2, silu, a bias on the tied logits, no BOS (the decoder starts from the pad id)
    "pretrained_variants": TransformerConfig(
        **_SMALL,
        sinusoid_layout="halves",
        sinusoid_frequencies="tensor2tensor",
        position_offset=2,
        activation="silu",
        logits_bias=True,
        bos_id=None,
        decoder_start_id=0,
    ),
}

# The paper's base model (512, 8 heads, 2048, 6+6, post-norm, sinusoidal, ReLU) with a small vocabulary: the
# vocabulary size does not change the per-element arithmetic, only the cost.
BASE = preset("base", src_vocab_size=1000, tgt_vocab_size=1000, max_len=32)

# The decoding tests' models (tests/test_decoding.py, parity_tests/test_decoding_parity.py): tiny, a 40-token
# vocabulary and 16 positions, so that sources filling every position and outputs cut at max_len are cheap.
DECODING_VOCAB = 40
DECODING_MAX_LEN = 16
DECODING_CONFIGS: dict[str, TransformerConfig] = {
    # the paper: post-norm, sinusoidal; untied output, whose bias lets a test move EOS up (see eos_biased)
    "post_sinusoidal_untied": preset(
        "tiny", src_vocab_size=DECODING_VOCAB, tgt_vocab_size=DECODING_VOCAB, max_len=DECODING_MAX_LEN, tie_output=False
    ),
    # pre-norm with final norms, learned positions, one shared (tied) embedding table, gelu
    "pre_learned_shared": preset(
        "tiny",
        src_vocab_size=DECODING_VOCAB,
        tgt_vocab_size=DECODING_VOCAB,
        max_len=DECODING_MAX_LEN,
        norm_first=True,
        final_norm=True,
        positions="learned",
        share_embeddings=True,
        activation="gelu",
    ),
}


# The unit-test model: one config, optimiser and batch shape (`unit_batch`) for the in-process training tests,
# so that the compiled train step (cached by make_train_step) is built once per pytest process.


def unit_config() -> TransformerConfig:
    """The tiny preset with a 50-token vocabulary and 16 positions (dropout 0.1, label smoothing 0.1)."""
    return preset("tiny", src_vocab_size=50, tgt_vocab_size=50, max_len=16)


def unit_optim():
    """The paper's Adam and schedule with a 10-step warmup (a jax_transformer.training.OptimConfig)."""
    from jax_transformer.training import OptimConfig

    return OptimConfig(warmup_steps=10)


def preset_config(name: str, vocab: int) -> TransformerConfig:
    """A preset with one vocabulary size for source and target (the benchmarks' models); dropout 0.1 and label
    smoothing 0.1 are the defaults."""
    return preset(name, src_vocab_size=vocab, tgt_vocab_size=vocab)


# =============================================================================================================
# Token ids
# =============================================================================================================


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
LAYOUTS = ("staircase", "drawn", "noise")


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


# =============================================================================================================
# Models in both frameworks
# =============================================================================================================


def ported_params(config: TransformerConfig, seed: int = 0) -> tuple[Any, dict[str, np.ndarray]]:
    """Fresh Flax parameters (init_params(config, seed)) and the same weights as a PyTorch state dict of numpy
    arrays (jax_transformer.port.flax_to_torch), for torch_reference.load_numpy_state_dict."""
    from jax_transformer.model import init_params
    from jax_transformer.port import flax_to_torch

    params = init_params(config, seed)
    return params, flax_to_torch(params)


DATA = Path(__file__).resolve().parent / "data"


@dataclasses.dataclass(frozen=True)
class SavedModel:
    """A trained model saved as test data (`tests/data/*.npz`): tests decode these weights instead of training
    their own, so that what they claim does not depend on the float32 rounding of the machine they run on."""

    config: TransformerConfig
    params: Any
    sources: np.ndarray  # (N, S) int32 padded validation sources
    tokenizer: Any = None  # jax_transformer.data.Tokenizer, where the file has one
    source_texts: tuple[str, ...] = ()
    target_texts: tuple[str, ...] = ()


def load_saved_model(name: str) -> SavedModel:
    """tests/data/<name>.npz (or the file `name`, if it ends in .npz): config (JSON), params/<flax path>, sources,
    and optionally tokenizer (serialized SentencePiece model), source_texts and target_texts (written by
    tests/data/make_trained_tiny.py)."""
    from flax.traverse_util import unflatten_dict

    from jax_transformer.tokenizer import Tokenizer

    with np.load(name if name.endswith(".npz") else DATA / f"{name}.npz") as z:
        params = unflatten_dict({tuple(k.split("/")[1:]): z[k] for k in z.files if k.startswith("params/")})
        texts = {key: tuple(str(x) for x in z[key]) for key in ("source_texts", "target_texts") if key in z.files}
        return SavedModel(
            config=TransformerConfig.from_dict(json.loads(str(z["config"]))),
            params=params,
            sources=z["sources"].astype(np.int32),
            tokenizer=Tokenizer.from_bytes(z["tokenizer"].tobytes()) if "tokenizer" in z.files else None,
            **texts,
        )


def twin_device() -> str:
    """Where the PyTorch twin runs in tests, parity tests and benchmarks: $TWIN_DEVICE ("cpu" or "cuda"; default
    "cpu"). JAX computes on its own default device (the GPU where there is one) whatever this says."""
    return os.environ.get("TWIN_DEVICE", "cpu")


def torch_twin(config: TransformerConfig, params, device: str | None = None):
    """A torch_reference.Transformer in eval mode holding the Flax `params` (ported by flax_to_torch), on `device`
    (default twin_device())."""
    import torch_reference
    from jax_transformer.port import flax_to_torch

    model = torch_reference.Transformer(config).to(device or twin_device())
    return torch_reference.load_numpy_state_dict(model, flax_to_torch(params)).eval()


def twin_models(config: TransformerConfig, seed: int = 0):
    """The same model in both frameworks: (Flax module, fresh Flax params, torch module in eval mode holding the
    same weights)."""
    from jax_transformer.model import Transformer, init_params

    params = init_params(config, seed)
    return Transformer(config), params, torch_twin(config, params)


def eos_biased(config: TransformerConfig, params, first_log_probs: np.ndarray):
    """Params whose untied output bias on EOS puts EOS first at step 0 for about half of the rows.

    Random models rarely emit EOS. `first_log_probs` (B, V) are each source row's log-probs of the first output
    token, from either framework. The bias is raised halfway between two neighbouring rows' step-0 margins (best
    other log-prob minus EOS log-prob), so no row is near a tie at step 0.
    """
    eos = config.eos_id
    margin = np.sort(np.delete(first_log_probs, eos, axis=1).max(axis=1) - first_log_probs[:, eos])
    k = len(margin) // 2
    bias = params["output_proj"]["bias"].at[eos].add((margin[k - 1] + margin[k]) / 2)
    return {**params, "output_proj": {**params["output_proj"], "bias": bias}}


# =============================================================================================================
# Comparisons
# =============================================================================================================


def t(array):
    """A numpy (or jax) array as a torch tensor on twin_device(). Integer arrays (the int32 ids above) become int64,
    torch's index type; floats and booleans keep their dtype."""
    import torch

    array = np.asarray(array)
    tensor = torch.from_numpy(array)
    tensor = tensor.long() if np.issubdtype(array.dtype, np.integer) else tensor
    return tensor.to(twin_device())


def to_numpy(tensor) -> np.ndarray:
    """A torch tensor (any device, any float dtype: bfloat16 as float32) as a numpy array."""
    import torch

    tensor = tensor.detach().cpu()
    return (tensor.float() if tensor.dtype == torch.bfloat16 else tensor).numpy()


def max_abs_diff(a, b) -> float:
    """Largest absolute elementwise difference (in float64) of two arrays or tensors of the same shape."""
    import torch

    a = to_numpy(a).astype(np.float64) if isinstance(a, torch.Tensor) else np.asarray(a, dtype=np.float64)
    b = to_numpy(b).astype(np.float64) if isinstance(b, torch.Tensor) else np.asarray(b, dtype=np.float64)
    assert a.shape == b.shape, f"shape mismatch {a.shape} vs {b.shape}"
    return float(np.max(np.abs(a - b))) if a.size else 0.0


def flat(tree) -> dict[str, np.ndarray]:
    """A pytree as {path: numpy array}, for leaf-by-leaf comparisons; typed PRNG keys as their raw words."""
    import jax

    def as_array(leaf):
        if isinstance(leaf, jax.Array) and jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        return np.asarray(leaf)

    return {jax.tree_util.keystr(path): as_array(leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


# =============================================================================================================
# Property-based tests
# =============================================================================================================


def fuzz(max_examples: int = 30):
    """The hypothesis settings of every property test: derandomized (the same examples on every run and machine,
    no example database), no deadline (hypothesis' 200 ms default would be a timing test), a few dozen examples
    (the suite's time budget), fixtures allowed (they are read, never changed, by the examples)."""
    from hypothesis import HealthCheck, settings

    return settings(
        max_examples=max_examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
    )


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


# =============================================================================================================
# bfloat16 tolerances (derived in parity_tests/test_bf16_parity.py's docstring; used there and in
# parity_tests/test_attention_kernels.py)
# =============================================================================================================

BF16_ULP_AT_1 = 2.0**-7  # bfloat16: 8 significant bits, so one ulp of a value in [1, 2) is 2^-7


def bf16_ulp(magnitude: float) -> float:
    """One bfloat16 ulp at `magnitude`: 2^(e - 7) for a value in [2^e, 2^(e+1))."""
    return BF16_ULP_AT_1 * 2.0 ** math.floor(math.log2(magnitude))


def layers(config: TransformerConfig) -> int:
    """Encoder plus decoder layers: the stages a bfloat16 difference grows through (one ulp each at most)."""
    return config.num_encoder_layers + config.num_decoder_layers


def logit_tolerance(config, logits) -> float:
    """n_layers bfloat16 ulps at the largest logit's magnitude (derivation: parity_tests/test_bf16_parity.py)."""
    return layers(config) * bf16_ulp(float(np.max(np.abs(np.asarray(logits)))))


def gradient_tolerance(config) -> float:
    """Bound on ||g_flax - g_torch|| / ||g_torch|| per gradient tensor: 2 n_layers ulps of relative size 2^-7."""
    return 2 * layers(config) * BF16_ULP_AT_1


@contextlib.contextmanager
def compiled_functions() -> Iterator[list[tuple[str, str]]]:
    """Records every function XLA compiles (or loads from the persistent cache) inside the block as (its name, e.g.
    "jit(_greedy_core)", the name of the thread that compiled it), from jax.monitoring's backend-compile events:
    compilations counted, not timed."""
    import threading

    import jax

    events: list[tuple[str, str]] = []

    def listen(event: str, seconds: float, **kwargs) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            events.append((str(kwargs.get("fun_name")), threading.current_thread().name))

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield events
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


# =============================================================================================================
# Pretrained models of the family, tiny and random, built from their configs (nothing is downloaded)
# =============================================================================================================


def sentencepiece_bytes(texts: Sequence[str], vocab_size: int) -> bytes:
    """A unigram SentencePiece model trained on `texts` (one thread: the same bytes every time)."""
    import io

    import sentencepiece as spm

    writer = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts),
        model_writer=writer,
        vocab_size=vocab_size,
        model_type="unigram",
        minloglevel=2,
        num_threads=1,
        hard_vocab_limit=False,
    )
    return writer.getvalue()


def marian_tokenizer_files(folder: Path, separate: bool = False) -> dict[str, int]:
    """MarianTokenizer's files for the built-in task (English -> French) in `folder`: source.spm, target.spm and
    vocab.json (pieces of both, </s> 0, <unk> 1, a language code, <pad> last), or with `separate` a target
    vocabulary of its own, each with </s> 0, <unk> 1, <pad> 2 (one pad_token_id serves both embedding tables, and
    transformers' MarianTokenizer takes the special ids from the source vocabulary). Returns {"src": size, "tgt":
    size, "pad", "eos"}."""
    from jax_transformer.default_task import default_pairs

    pairs = default_pairs("train", n=2000)
    models = {
        "source.spm": sentencepiece_bytes(pairs.sources, 120),
        "target.spm": sentencepiece_bytes(pairs.targets, 120),
    }
    import sentencepiece as spm

    def vocab_of(names):
        vocab = {"</s>": 0, "<unk>": 1} if not separate else {"</s>": 0, "<unk>": 1, "<pad>": 2}
        for name in names:
            processor = spm.SentencePieceProcessor()
            processor.LoadFromSerializedProto(models[name])
            for i in range(processor.get_piece_size()):
                vocab.setdefault(processor.IdToPiece(i), len(vocab))
        vocab.pop("<s>", None)
        vocab = {piece: i for i, piece in enumerate(vocab)}
        if not separate:
            vocab[">>fr<<"] = len(vocab)
            vocab["<pad>"] = len(vocab)
        return vocab

    folder.mkdir(parents=True, exist_ok=True)
    for name, data in models.items():
        (folder / name).write_bytes(data)
    source = vocab_of(["source.spm", "target.spm"] if not separate else ["source.spm"])
    (folder / "vocab.json").write_text(json.dumps(source), encoding="utf-8")
    target = source
    if separate:
        target = vocab_of(["target.spm"])
        (folder / "target_vocab.json").write_text(json.dumps(target), encoding="utf-8")
    options = {"source_lang": "en", "target_lang": "fr", "separate_vocabs": separate}
    (folder / "tokenizer_config.json").write_text(json.dumps(options), encoding="utf-8")
    return {"src": len(source), "tgt": len(target), "pad": source["<pad>"], "eos": source["</s>"]}


def learn_bpe(texts: Sequence[str], lang: str, merges: int) -> tuple[list[tuple[str, str]], list[str]]:
    """BPE merges learned on Moses-tokenized `texts` (most frequent pair first, ties by the pair), and the symbols
    they make: enough of fastBPE to build test models."""
    import collections

    import sacremoses

    tokenize = sacremoses.MosesTokenizer(lang=lang).tokenize
    counts = collections.Counter(w for t in texts for w in tokenize(t, aggressive_dash_splits=True, escape=True))
    words = {tuple(w[:-1]) + (w[-1] + "</w>",): c for w, c in counts.items()}
    learned = []
    for _ in range(merges):
        pairs = collections.Counter()
        for word, count in words.items():
            for pair in zip(word, word[1:]):
                pairs[pair] += count
        if not pairs:
            break
        best = max(pairs, key=lambda pair: (pairs[pair], pair))
        learned.append(best)
        merged = {}
        for word, count in words.items():
            out, i = [], 0
            while i < len(word):
                if i < len(word) - 1 and (word[i], word[i + 1]) == best:
                    out.append(word[i] + word[i + 1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] = count
        words = merged
    symbols = {s for w in words for s in w} | {a + b for a, b in learned} | {c for w in words for s in w for c in s}
    return learned, sorted(symbols)


def fsmt_tokenizer_files(folder: Path) -> dict[str, int]:
    """FSMTTokenizer's files for the built-in task (English -> French): vocab-src.json, vocab-tgt.json (fairseq's
    specials <s> 0, <pad> 1, </s> 2, <unk> 3 first), merges.txt, tokenizer_config.json."""
    from jax_transformer.default_task import default_pairs

    pairs = default_pairs("train", n=2000)
    source_merges, source_symbols = learn_bpe(pairs.sources, "en", 150)
    target_merges, target_symbols = learn_bpe(pairs.targets, "fr", 150)
    merges = source_merges + [m for m in target_merges if m not in source_merges]

    def vocab_of(symbols):
        vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
        for symbol in symbols:
            vocab.setdefault(symbol, len(vocab))
        return vocab

    folder.mkdir(parents=True, exist_ok=True)
    source, target = vocab_of(source_symbols), vocab_of(target_symbols)
    (folder / "vocab-src.json").write_text(json.dumps(source), encoding="utf-8")
    (folder / "vocab-tgt.json").write_text(json.dumps(target), encoding="utf-8")
    (folder / "merges.txt").write_text("".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8")
    options = {"langs": ["en", "fr"], "do_lower_case": False, "model_max_length": 1024}
    (folder / "tokenizer_config.json").write_text(json.dumps(options), encoding="utf-8")
    return {"src": len(source), "tgt": len(target)}


TINY_HF = dict(
    d_model=32,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=64,
    decoder_ffn_dim=64,
    max_position_embeddings=64,
)


def tiny_marian(sizes: Mapping[str, int], *, shared: bool = True, seed: int = 0):
    """A random MarianMTModel (eager attention, swish, scaled embeddings, a random final_logits_bias) for
    vocabularies of `sizes` (marian_tokenizer_files), its weights at a trained model's scale."""
    import torch
    from transformers import MarianConfig, MarianMTModel

    torch.manual_seed(seed)
    config = MarianConfig(
        vocab_size=sizes["src"],
        decoder_vocab_size=None if shared else sizes["tgt"],
        share_encoder_decoder_embeddings=shared,
        pad_token_id=sizes["pad"],
        eos_token_id=sizes["eos"],
        decoder_start_token_id=sizes["pad"],
        activation_function="swish",
        scale_embedding=True,
        attn_implementation="eager",
        **TINY_HF,
    )
    model = _trained_scale(MarianMTModel(config).eval())
    with torch.no_grad():
        model.final_logits_bias.normal_(0.0, 0.1)
    return model


def tiny_fsmt(sizes: Mapping[str, int], seed: int = 0):
    """A random FSMTForConditionalGeneration (eager attention) for vocabularies of `sizes` (fsmt_tokenizer_files)."""
    import torch
    from transformers import FSMTConfig, FSMTForConditionalGeneration

    torch.manual_seed(seed)
    config = FSMTConfig(
        langs=["en", "fr"],
        src_vocab_size=sizes["src"],
        tgt_vocab_size=sizes["tgt"],
        attn_implementation="eager",
        **TINY_HF,
    )
    return _trained_scale(FSMTForConditionalGeneration(config).eval())


def _trained_scale(model):
    """Weights redrawn at the scale of a trained model's, in place: transformers' init (std 0.02) leaves a tiny
    model's outputs flat and the same for every source. Matrices get std 1/sqrt(fan_in); embedding rows std
    1/sqrt(d_model) when the model scales them by sqrt(d_model), else std 1; logits come out of order 1-10."""
    import torch

    d = model.config.d_model
    rows = d**-0.5 if model.config.scale_embedding else 1.0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "embed_positions" in name:  # the sinusoids
                continue
            if "embed_tokens" in name or "shared" in name:
                p.normal_(0.0, rows)
            elif p.dim() == 2:
                p.normal_(0.0, p.shape[1] ** -0.5)
        for module in model.modules():  # the pad rows stay zero, as in the released models
            if isinstance(module, torch.nn.Embedding) and module.padding_idx is not None:
                module.weight[module.padding_idx] = 0.0
    return model


def end_at_various_lengths(model, input_ids, attention_mask, max_length: int) -> None:
    """Raises EOS in a random transformers model (in place) so that its greedy outputs for these sources end at
    several different lengths, none of them near a tie.

    Random models end all rows at once or never. Raising EOS changes no other token's rank, so a greedy output
    runs as it does with EOS banned until the first step where EOS's raised logit beats the best other one. From
    the EOS-banned run's logits each (row, step) gets the raise it needs; the raise picked lies halfway between two
    neighbouring needs, where outputs end at three or more lengths, with the widest margin of those. Marian raises
    EOS by adding to final_logits_bias; FSMT (no bias) by scaling EOS's output row, which helps where its logit is
    positive."""
    import torch

    eos, pad = model.config.eos_token_id, model.config.pad_token_id
    banned = [[eos]] + ([[pad]] if model.config.model_type == "marian" else [])
    with torch.no_grad():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_length=max_length,
            num_beams=1,
            do_sample=False,
            bad_words_ids=banned,
            output_logits=True,
            return_dict_in_generate=True,
        )
    logits = torch.stack(out.logits, dim=1).numpy()  # (B, T, V), as the model gave them
    eos_logit = logits[..., eos]
    others = np.delete(logits, [eos] + ([pad] if len(banned) > 1 else []), axis=-1).max(axis=-1)
    marian = model.config.model_type == "marian"
    with np.errstate(divide="ignore", invalid="ignore"):
        need = others - eos_logit if marian else np.where(eos_logit > 0, others / eos_logit, np.inf)  # (B, T)
    cuts = np.unique(need[np.isfinite(need) & (need > (0 if marian else 1))])
    best, best_gap = None, -1.0
    for lo, hi in zip(cuts, cuts[1:]):
        raise_ = (lo + hi) / 2
        ends = need < raise_
        lengths = np.where(ends.any(axis=1), ends.argmax(axis=1) + 1, max_length)
        gap = (hi - lo) / 2 / (1.0 if marian else raise_)
        if len(set(lengths.tolist())) >= 3 and lengths.max() >= 3 and gap > best_gap:
            best, best_gap = raise_, gap
    if best is None:
        raise AssertionError("no EOS raise makes these outputs end at three lengths; choose other sources or seed")
    with torch.no_grad():
        if marian:
            model.final_logits_bias[0, eos] += float(best)
        else:
            model.model.decoder.output_projection.weight[eos] *= float(best)
