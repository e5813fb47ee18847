"""Decoding (jax_transformer.decoding.decoders, .search, .schedule) against the plain model: the cache, greedy and beam
search, lengths, edge cases, the CPU's schedule, translate and the attention plot. Cross-framework checks are in
parity_tests/test_decoding_parity.py.

The oracle everywhere is the model's own teacher-forced forward pass (`Transformer.__call__`) re-run over the
whole prefix at each step: no cache, no while_loop, nothing shared with the code under test but the model.
"""

from __future__ import annotations

import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_transformer.decoding import decoders, schedule, search, translation
from jax_transformer.model.transformer import Transformer, grow_cache, init_params, select_cache
from jax_transformer.settings.config import DecodeConfig, preset
from tests.helpers.batches import make_src, pad_rows
from tests.helpers.configs import DECODING_CONFIGS
from tests.helpers.configs import DECODING_MAX_LEN as MAX_LEN
from tests.helpers.configs import DECODING_VOCAB as VOCAB
from tests.helpers.tooling import compiled_functions, cpu_schedule
from tests.helpers.twins import eos_biased

jax.config.update("jax_default_matmul_precision", "highest")

# Source rows of different lengths (tokens + EOS): one filling all max_len positions, short rows, and an empty
# source (EOS only).
LENGTHS = (MAX_LEN, 3, 1, 6, 5)

# Logits of the cached step and of the full pass are the same sums taken over different shapes (one query vs
# all, T_cache masked key slots vs T): only float32 reassociation differs. With logits of size O(1-10) and
# d_model=32 that is ~1e-6; 1e-5 leaves a 10x margin while a real cache bug (wrong position, a key not masked,
# a stale key) moves logits by O(0.1).
CACHE_ATOL = 1e-5
# A score sums up to 16 log-probs, each within ~1e-6 of the oracle's (see above), then divides by a penalty >= 1.
SCORE_ATOL = 2e-5


# Model a: post-norm, sinusoidal, untied output (whose bias lets the tests move EOS up, see eos_biased).
# Model b: pre-norm with final norms, learned positions, one shared (tied) embedding table, gelu.
CONFIG_A = DECODING_CONFIGS["post_sinusoidal_untied"]
GREEDY = DecodeConfig(beam_size=1)
CONFIG_B = DECODING_CONFIGS["pre_learned_shared"]


# --- the oracle: full forward passes over the prefix ----------------------------------------------------------

_FORWARDS: dict = {}


def full_forward(config):
    """A jitted (params, src, tgt_in) -> logits (B, T, V) for `config`, built once per config."""
    if config not in _FORWARDS:
        _FORWARDS[config] = jax.jit(lambda p, s, t: Transformer(config).apply({"params": p}, s, t))
    return _FORWARDS[config]


def step_log_probs(params, config, src, tokens, t):
    """Oracle log-probs (B, V) of token t given tokens[:, :t]: the whole prefix BOS, tokens[:, :t] through the
    model. The prefix is padded to max_len (one compilation); causal masking hides the padding from position t."""
    B = tokens.shape[0]
    tgt_in = np.full((B, config.max_len), config.pad_id, np.int32)
    tgt_in[:, 0] = config.bos_id
    tgt_in[:, 1 : t + 1] = tokens[:, :t]
    logits = full_forward(config)(params, src, tgt_in)[:, t]
    return np.array(jax.nn.log_softmax(logits, axis=-1))  # a writable copy


def oracle_greedy(
    params, config, src, max_len_a=decoders.DEFAULT_MAX_LEN_A, max_len_b=decoders.DEFAULT_MAX_LEN_B, min_len=0
):
    """Greedy decoding by full forward passes, written from the documented semantics. Also returns, per row,
    the smallest margin between the chosen token's log-prob and the runner-up's (to rule out near-ties)."""
    limits = decoders.max_new_tokens(src, config, max_len_a, max_len_b)
    L = decoders.output_length(src.shape[1], config, max_len_a, max_len_b)
    B = src.shape[0]
    tokens = np.full((B, L), config.pad_id, np.int32)
    scores = np.zeros(B, np.float32)
    gaps = np.full(B, np.inf)
    done = np.zeros(B, bool)
    for t in range(L):
        lp = step_log_probs(params, config, src, tokens, t)  # (B, V)
        lp[:, [config.pad_id, config.bos_id]] = -np.inf  # never produced
        if t < min_len:
            lp[:, config.eos_id] = -np.inf
        for row in np.flatnonzero(~done):
            best = int(np.argmax(lp[row]))
            gaps[row] = min(gaps[row], lp[row, best] - np.max(np.delete(lp[row], best)))
            tokens[row, t], scores[row] = best, scores[row] + lp[row, best]
            done[row] = best == config.eos_id or t + 1 == limits[row]
    return tokens, scores, gaps


def sequence_log_prob(params, config, src, tokens):
    """log P(tokens[b] | src[b]) by one teacher-forced pass (tokens: no BOS, PAD after the end)."""
    tgt_in = np.concatenate([np.full((len(src), 1), config.bos_id, np.int32), tokens[:, :-1]], axis=1)
    tgt_in[tgt_in == config.eos_id] = config.pad_id  # EOS is the last output, never an input
    lp = np.asarray(jax.nn.log_softmax(full_forward(config)(params, src, tgt_in), axis=-1))
    picked = np.take_along_axis(lp, tokens[:, :, None], axis=-1)[:, :, 0]
    return np.where(tokens != config.pad_id, picked, 0.0).sum(axis=1)


@pytest.fixture(scope="module")
def model_a():
    """Model a with its EOS bias raised (eos_biased: EOS first at step 0 for about half of the rows)."""
    config, src = CONFIG_A, make_src(CONFIG_A, LENGTHS)
    params = init_params(config, 0)
    first = step_log_probs(params, config, src, np.zeros((len(src), 1), np.int32), 0)
    return config, eos_biased(config, params, first), src


@pytest.fixture(scope="module")
def model_b():
    return CONFIG_B, init_params(CONFIG_B, 1), make_src(CONFIG_B, LENGTHS, seed=1)


# --- 1. the cache ------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("config", "cache_len", "grown"))
def cached_and_full_logits(params, src, tgt_in, *, config, cache_len, grown=None):
    """Logits (B, T, V) of one full teacher-forced pass, and of the cached decoder fed tgt_in one token a step;
    `grown` (steps, length): after that many steps the cache is padded to `length` positions (a next phase)."""
    model = Transformer(config)
    full = model.apply({"params": params}, src, tgt_in)
    memory = model.apply({"params": params}, src, method=Transformer.encode)
    cache = search.create_cache(model, params, memory, src, cache_len)
    kernel = search.output_kernel(model, params)  # the output projection as the decoding loops lay it out
    B = src.shape[0]

    def step(T):  # one token (B,) at position t of a cache of T positions, one slot each (history all 0)
        def one(cache, inputs):
            tokens, t = inputs
            history = jnp.zeros((B, T), jnp.int32)
            logits, cache = search.decode_step(model, params, cache, memory, src, tokens, t, history, kernel)
            return cache, logits

        return one

    steps = jnp.arange(tgt_in.shape[1])
    if grown is None:
        _, stepped = jax.lax.scan(step(cache_len), cache, (tgt_in.T, steps))  # (T, B, V)
    else:
        n, length = grown
        cache, first = jax.lax.scan(step(cache_len), cache, (tgt_in[:, :n].T, steps[:n]))
        _, rest = jax.lax.scan(step(length), grow_cache(cache, length, 1), (tgt_in[:, n:].T, steps[n:]))
        stepped = jnp.concatenate([first, rest])
    return full, stepped.transpose(1, 0, 2)


@pytest.mark.parametrize("grown", [None, (4, 13)], ids=["one cache", "grown after 4 steps"])
@pytest.mark.parametrize("norm_first", [False, True], ids=["post-norm", "pre-norm"])
@pytest.mark.parametrize("positions", ["sinusoidal", "learned"])
def test_cached_steps_equal_full_forward(norm_first, positions, grown):
    config = preset(
        "tiny",
        src_vocab_size=VOCAB,
        tgt_vocab_size=VOCAB,
        max_len=MAX_LEN,
        norm_first=norm_first,
        final_norm=norm_first,
        positions=positions,
    )
    params, src = init_params(config, 3), make_src(config, LENGTHS, seed=3)
    tgt_in = np.random.default_rng(4).integers(3, VOCAB, (len(src), 10)).astype(np.int32)
    tgt_in[:, 0] = config.bos_id
    # A cache longer than the 10 steps: its unused positions must not count; or a cache of 4 positions, full
    # after 4 steps, padded to 13 (a next phase: schedule.cache_lengths) for the other 6.
    cache_len = 13 if grown is None else grown[0]
    full, stepped = cached_and_full_logits(params, src, tgt_in, config=config, cache_len=cache_len, grown=grown)
    worst = float(np.max(np.abs(np.asarray(full) - np.asarray(stepped))))
    print(f"cached vs full logits, max abs diff {worst:.2e}")
    assert worst < CACHE_ATOL


def test_phases_double_up_to_the_cache_length():
    wide = schedule.PHASED_FROM
    assert schedule.cache_lengths(10, wide) == [10]
    assert schedule.cache_lengths(16, wide) == [16]
    assert schedule.cache_lengths(24, wide) == [24] and schedule.cache_lengths(33, wide) == [16, 33]
    assert schedule.cache_lengths(64, wide) == [16, 32, 64] and schedule.cache_lengths(65, wide) == [16, 32, 65]
    assert schedule.cache_lengths(511, wide) == [16, 32, 64, 128, 511]


def test_batches_shrink_to_4_sentences_of_a_beam_search_and_1_row_of_a_greedy_one():
    assert schedule.shrink_levels(64, beams=4) == (64, 16, 4)
    assert schedule.shrink_levels(32, beams=4) == (32, 8, 4) and schedule.shrink_levels(4, beams=4) == (4,)
    assert schedule.shrink_levels(64) == (64, 16, 4, 1) and schedule.shrink_levels(32) == (32, 8, 2, 1)
    assert schedule.shrink_levels(2) == (2, 1) and schedule.shrink_levels(1) == (1,)


def test_phases_below_a_few_hypotheses_are_one_cache():
    assert schedule.cache_lengths(65, schedule.PHASED_FROM - 1) == [65]
    assert schedule.cache_lengths(65, 1) == [65]


def test_weights_given_as_numpy_go_to_the_device_once(model_b, monkeypatch):
    # A checkpoint's numpy weights become device arrays (a program would copy numpy ones in at every call);
    # arrays already on a device are kept as they are, not copied.
    on_device = jnp.zeros(2)
    tree = {"numpy": np.arange(3, dtype=np.float32), "device": on_device}
    out = decoders.on_device(tree)
    assert isinstance(out["numpy"], jax.Array) and out["device"] is on_device
    np.testing.assert_array_equal(out["numpy"], tree["numpy"])
    # A search given numpy weights hands its encoder and every program device arrays, whichever the schedule.
    config, params, src = model_b
    seen = []

    def noting(fn):
        def called(params, *args, **kwargs):
            seen.append(all(isinstance(x, jax.Array) for x in jax.tree.leaves(params)))
            return fn(params, *args, **kwargs)

        return called

    for name in ("encoder", "start", "resume"):
        monkeypatch.setattr(search, name, noting(getattr(search, name)))
    for way in (schedule.Whole(), schedule.Scheduled()):
        seen.clear()
        decoders.greedy_search(jax.tree.map(np.asarray, params), config, src, schedule=way)
        assert seen and all(seen)


def test_the_encoder_runs_on_groups_of_alike_sources_cut_to_their_length(monkeypatch):
    """The CPU's encode_batch sorts a batch's sources by length and encodes them ENCODER_ROWS at a time, each group
    cut to its longest source rounded up to ENCODER_WIDTH_STEP: the encoder's output over the whole batch at every
    real position, zero past the group's width, every row back in its place."""
    config = CONFIG_B
    params = init_params(config, 5)
    # 16 short sources (1..7 tokens) and 4 long ones (9..14) in no order, and a filler row of PAD only: 21 rows.
    lengths = np.random.default_rng(5).permutation([1 + i % 7 for i in range(16)] + [9, 12, 13, 14]).tolist()
    src = np.concatenate([make_src(config, lengths, seed=5), np.full((1, MAX_LEN), config.pad_id, np.int32)])
    shapes, encoder = [], search.encoder

    def recorded(params, src, *, config, width):
        shapes.append(src.shape)
        return encoder(params, src, config=config, width=width)

    monkeypatch.setattr(search, "encoder", recorded)
    memory = np.asarray(schedule.encode_batch(params, config, src))
    whole = np.asarray(Transformer(config).apply({"params": params}, jnp.asarray(src), method=Transformer.encode))
    # Sorted: the filler row and 15 short ones (up to 7 tokens) in a group cut to 8 positions; the other short
    # one and the 4 long ones (up to 14) in one cut to 16, here the full width.
    assert sorted(shapes) == [(5, 16), (16, 8)]
    real = src != config.pad_id
    # The same products over fewer rows and masked keys that were exact zeros: float32 reassociation only
    # (values of LayerNorm'd size O(1): ~1e-6); CACHE_ATOL's margin. A row routed to another's place moves O(1).
    np.testing.assert_allclose(memory[real], whole[real], atol=CACHE_ATOL, rtol=0)
    first_group = [row for row, n in enumerate(lengths) if n < 7] + [len(lengths)]  # the filler row is last
    assert not memory[first_group, 8:].any()  # past its group's width: zeros
    # At most ENCODER_ROWS sources: one group, in the batch's own order, cut to its longest source (7 -> 8) and
    # padded back to the batch's width.
    short = [row for row, n in enumerate(lengths) if n <= 7]  # 16 rows, in no order
    shapes.clear()
    few = np.asarray(schedule.encode_batch(params, config, src[short]))
    assert shapes == [(16, 8)] and few.shape == (16, MAX_LEN, config.d_model)
    np.testing.assert_allclose(few[real[short]], whole[short][real[short]], atol=CACHE_ATOL, rtol=0)
    assert not few[:, 8:].any()
    assert memory[first_group, :8].any(axis=-1).all()  # every position of the group computed
    assert memory.shape == whole.shape


def test_select_rows_and_grow_follow_the_caches_layout():
    """A beam cache of 3 sentences x 2 hypotheses, 2 heads, 4 positions, laid out as MultiHeadAttention keeps it:
    keys (sentences * heads, d_k, positions * beams), values (sentences * heads, positions * beams, d_k); the
    search's table of slots (sentences, beams, positions). Each entry holds 100 * sentence + 10 * head + the slot
    column/row it sits in."""
    S, H, K, T, G = 3, 2, 1, 4, 2
    owner = 100 * np.repeat(np.arange(S), H) + 10 * np.tile(np.arange(H), S)  # (S * H,) sentence, head
    keys = owner[:, None, None] + np.arange(T * G)[None, None, :]  # (S * H, K, T * G)
    values = owner[:, None, None] + np.arange(T * G)[None, :, None]  # (S * H, T * G, K)
    cross = np.broadcast_to(100 * np.arange(S)[:, None, None, None], (S, H, 5, K))  # (sentences, heads, source, d_k)
    layer = {"self_attention": {"cached_key": keys, "cached_value": values}, "cross_attention": {"cached_key": cross}}
    cache = {"decoder": {"layer_0": layer}}

    picked = select_cache(cache, np.array([2, 0]), sentences=S)["decoder"]["layer_0"]
    # sentence 2's two heads, then sentence 0's: rows of (sentences * heads), not of sentences
    np.testing.assert_array_equal(picked["self_attention"]["cached_key"][:, 0, 0], [200, 210, 0, 10])
    np.testing.assert_array_equal(picked["self_attention"]["cached_value"][:, 0, 0], [200, 210, 0, 10])
    # the cross-attention's keys have a row per sentence: rows 2 and 0
    np.testing.assert_array_equal(picked["cross_attention"]["cached_key"][:, 0, 0, 0], [200, 0])

    grown = grow_cache(cache, 6, G)["decoder"]["layer_0"]  # 4 -> 6 positions: G more slots a position, zeros
    attention = grown["self_attention"]
    assert attention["cached_key"].shape == (S * H, K, 6 * G) and attention["cached_value"].shape == (S * H, 6 * G, K)
    np.testing.assert_array_equal(attention["cached_key"][:, :, : T * G], keys)
    assert not np.any(attention["cached_key"][:, :, T * G :]) and not np.any(attention["cached_value"][:, T * G :])
    assert grown["cross_attention"]["cached_key"].shape == cross.shape  # the source's

    # A whole decoding state: every array with a row per sentence follows, the table of slots grows with the cache.
    rules = decoders.gnmt_decoder(CONFIG_A, 8, beam_size=G).rules
    rows = search.Rows(
        limit=np.array([5, 6, 7]), prefix=np.arange(S)[:, None] * np.ones((S, 10), np.int32), prefix_len=np.arange(S),
        draw=np.arange(S, dtype=np.uint32),
    )  # fmt: skip
    state = search.initial_state(rules, np.ones((S, 8), np.int32), rows, 10, T, cache, 0)
    state = state.replace(history=np.arange(S)[:, None, None] * 100 + np.zeros((S, G, T), np.int32))
    memory, src = np.arange(S)[:, None, None] * np.ones((S, 8, 2)), np.arange(S)[:, None] * np.ones((S, 8), np.int32)
    picked, memory, src = schedule.select_rows(state, memory, src, np.array([2, 0]))
    assert picked.rows.limit.tolist() == [7, 5] and picked.history[:, 0, 0].tolist() == [200, 0]
    assert picked.rows.prefix[:, 0].tolist() == [2, 0] and picked.rows.draw.tolist() == [2, 0]
    assert memory[:, 0, 0].tolist() == [2, 0] and src[:, 0].tolist() == [2, 0]
    assert picked.cache["decoder"]["layer_0"]["self_attention"]["cached_key"][:, 0, 0].tolist() == [200, 210, 0, 10]
    assert picked.step == 0 and picked.live_tokens.shape == (2, G, 10)
    grown = schedule.grow(state, 6)
    assert grown.history.shape == (S, G, 6) and not np.any(grown.history[:, :, T:])
    assert grown.cache["decoder"]["layer_0"]["self_attention"]["cached_value"].shape == (S * H, 6 * G, K)


# --- 2. greedy search --------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["a", "b"])
def test_greedy_equals_full_forward_oracle(which, model_a, model_b):
    config, params, src = model_a if which == "a" else model_b
    assert np.all(src[0] != config.pad_id), "row 0 is a source at the maximum length"
    tokens, scores = decoders.greedy_search(params, config, src)
    assert tokens.shape == (len(src), MAX_LEN)  # 1.5 * 16 + 10 tokens, capped at max_len
    expected, expected_scores, gaps = oracle_greedy(params, config, src)
    assert gaps.min() > 1e-4, f"a near-tie ({gaps.min():.1e}) would make this comparison meaningless"
    np.testing.assert_array_equal(tokens, expected)
    np.testing.assert_allclose(scores, expected_scores, rtol=0, atol=SCORE_ATOL)
    # The output convention: no BOS, EOS where emitted, PAD after; rows without EOS stop at their limit.
    limits = decoders.max_new_tokens(src, config)
    for row, limit in zip(tokens, limits):
        produced = row[row != config.pad_id]
        assert config.bos_id not in produced
        assert np.all(row[len(produced) :] == config.pad_id)
        assert (produced[-1] == config.eos_id and len(produced) <= limit) or len(produced) == limit


def test_some_rows_finish_at_the_first_step(model_a):
    config, params, src = model_a
    tokens, scores = decoders.greedy_search(params, config, src)
    first_eos = tokens[:, 0] == config.eos_id
    assert first_eos.any() and not first_eos.all(), "the EOS bias should split the batch (see eos_biased)"
    assert np.all(tokens[first_eos, 1:] == config.pad_id)
    # Their score is the log-prob of EOS at the first step alone.
    lp0 = step_log_probs(params, config, src, np.zeros((len(src), 1), np.int32), 0)
    np.testing.assert_allclose(scores[first_eos], lp0[first_eos, config.eos_id], atol=SCORE_ATOL)
    # The others went on past the first step.
    assert np.all(tokens[~first_eos, 1] != config.pad_id)


def test_batch_of_one_empty_source_equals_its_row_in_the_batch(model_a):
    """Padding-aware: the empty source (EOS only) decoded alone, without padding, gives what it gave as a row
    of the padded batch."""
    config, params, src = model_a
    row = LENGTHS.index(1)
    batch_tokens, batch_scores = decoders.greedy_search(params, config, src)
    tokens, scores = decoders.greedy_search(params, config, src[row : row + 1, :1])  # (1, 1): just EOS
    L = tokens.shape[1]
    np.testing.assert_array_equal(tokens[0], batch_tokens[row, :L])
    assert np.all(batch_tokens[row, L:] == config.pad_id)
    np.testing.assert_allclose(scores[0], batch_scores[row], atol=SCORE_ATOL)


def test_length_limits_and_min_len(model_a):
    config, params, src = model_a
    # No EOS before 3 tokens.
    tokens, scores = decoders.greedy_search(params, config, src, min_len=3)
    assert not np.any(tokens[:, :3] == config.eos_id)
    expected, expected_scores, _ = oracle_greedy(params, config, src, min_len=3)
    np.testing.assert_array_equal(tokens, expected)
    assert np.any(tokens == config.eos_id), "some rows should still end with EOS after min_len"
    # min_len at least the limits forces every row to exactly its limit (how benchmarks fix the length).
    limits = decoders.max_new_tokens(src, config)
    for decode in (decoders.greedy_search, decoders.beam_search):
        tokens, _ = decode(params, config, src, min_len=MAX_LEN)
        assert np.count_nonzero(tokens != config.pad_id, axis=1).tolist() == limits.tolist()
        assert not np.any(tokens == config.eos_id)
    # Other length parameters: at most floor(0 * n + 6) = 6 tokens per row, and the output is 6 wide.
    tokens, _ = decoders.greedy_search(params, config, src, max_len_a=0, max_len_b=6)
    expected, _, _ = oracle_greedy(params, config, src, max_len_a=0, max_len_b=6)
    assert tokens.shape == (len(src), 6)
    np.testing.assert_array_equal(tokens, expected)


# --- 3. beam search ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["a", "b"])
def test_beam_size_one_without_penalty_is_greedy(which, model_a, model_b):
    """With alpha = 0 a single beam is greedy search: the EOS it finishes cannot be beaten by the runner-up that
    stays live (its log-prob is lower and only falls). (With alpha > 0 the live runner-up may win by growing
    longer.) Both add the same float32 log-probs in the same order, but they are two programs: on the CPU XLA
    computes each log-prob alike and the scores are bit-identical; on a GPU the two loops fuse differently and
    a log-prob may differ by a float32 ulp or two of the logits it is computed from, so the scores are compared
    within SCORE_ATOL there (16 such terms; see its comment)."""
    config, params, src = model_a if which == "a" else model_b
    greedy_tokens, greedy_scores = decoders.greedy_search(params, config, src)
    tokens, scores = decoders.beam_search(params, config, src, beam_size=1, alpha=0.0)
    np.testing.assert_array_equal(tokens, greedy_tokens)
    if jax.default_backend() == "cpu":
        np.testing.assert_array_equal(scores, greedy_scores)
    else:
        np.testing.assert_allclose(scores, greedy_scores, rtol=0, atol=SCORE_ATOL)


@pytest.mark.parametrize("alpha", [0.6, 0.0])
def test_beam_scores_are_penalised_log_probs(alpha, model_a):
    config, params, src = model_a
    tokens, scores = decoders.beam_search(params, config, src, beam_size=4, alpha=alpha)
    lengths = np.count_nonzero(tokens != config.pad_id, axis=1)
    limits = decoders.max_new_tokens(src, config)
    for row, n, limit in zip(tokens, lengths, limits):  # ends with EOS, or runs to its limit without one
        assert np.all(row[n:] == config.pad_id)
        assert (row[n - 1] == config.eos_id and config.eos_id not in row[: n - 1]) or n == limit
    assert np.any(tokens == config.eos_id), "the EOS bias should make some hypotheses end with EOS"
    # The score is log P(hypothesis) (recomputed by one teacher-forced pass) over ((5 + length) / 6) ** alpha.
    log_p = sequence_log_prob(params, config, src, tokens)
    penalty = ((5.0 + lengths) / 6.0) ** alpha
    np.testing.assert_allclose(scores, log_p / penalty, rtol=0, atol=SCORE_ATOL)


# --- 4. inputs that must be refused ------------------------------------------------------------------------


def test_bad_inputs_are_refused_with_clear_errors(model_a):
    config, params, src = model_a
    left_padded = src.copy()
    left_padded[1] = np.roll(left_padded[1], 2)
    cases = [
        (src[0], "shape"),
        (src.astype(np.float32), "integer"),
        (np.pad(src, ((0, 0), (0, config.max_len))), "max_len"),
        (np.where(src == 5, VOCAB + 1, src), "vocabulary"),
        (left_padded, "row 1"),
    ]
    for bad, message in cases:
        with pytest.raises(ValueError, match=message):
            decoders.greedy_search(params, config, bad)
    with pytest.raises(ValueError, match="beam_size"):
        decoders.beam_search(params, config, src, beam_size=(VOCAB - 2) // 2)
    with pytest.raises(ValueError, match="alpha"):
        decoders.beam_search(params, config, src, alpha=-1.0)
    with pytest.raises(ValueError, match="min_len"):
        decoders.greedy_search(params, config, src, min_len=-1)


def test_length_rule():
    config = preset("tiny", max_len=16)
    src = make_src(CONFIG_A, (8, 3, 1), width=8)  # the ids do not matter here, only the lengths
    src[2] = 0  # an all-PAD filler row
    # n = 8, 3, 0 -> floor(1.5 n + 10) capped at 16; a filler row gets one step.
    assert decoders.max_new_tokens(src, config).tolist() == [16, 14, 1]
    assert decoders.max_new_tokens(src, config, 0.5, 1).tolist() == [5, 2, 1]
    assert decoders.output_length(8, config, 0.5, 1) == 5
    np.testing.assert_allclose(decoders.length_penalties(3, 0.6), [((5 + i) / 6) ** 0.6 for i in range(4)], rtol=1e-7)


# --- translate and the attention plot ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_translator():
    from jax_transformer.data.default_task import TOKENIZER_MODEL_TYPE, default_pairs
    from jax_transformer.data.tokenizer import Tokenizer

    pairs = default_pairs("train", n=300)
    tokenizer = Tokenizer.train(pairs.sources + pairs.targets, vocab_size=200, model_type=TOKENIZER_MODEL_TYPE)
    config = preset("tiny", src_vocab_size=tokenizer.vocab_size, tgt_vocab_size=tokenizer.vocab_size, max_len=24)
    return config, init_params(config, 7), tokenizer, pairs.sources


def test_translate_keeps_order_and_reuses_compilations(tiny_translator, monkeypatch):
    config, params, tokenizer, sentences = tiny_translator
    cpu_schedule(monkeypatch)  # the CPU's programs (levels, phases) on any backend
    # Seven sentences of at most 7 tokens (+ EOS): with batch_size=4 they make two batches of shape (4, 16).
    lengths = [len(ids) for ids in tokenizer.encode_batch(sentences)]
    short = [s for s, n in zip(sentences, lengths) if 2 <= n <= 7]
    chosen = [short[i] for i in (40, 3, 25, 11, 60, 0, 17)]  # mixed lengths, unsorted
    out = translation.translate(params, config, tokenizer, chosen, GREEDY, batch_size=4, progress=False)
    # Each translation equals the decoding of that sentence as a row of a padded batch of the same shape.
    sources = translation.encode_sources(tokenizer, chosen, config)
    tokens = np.concatenate(
        [
            decoders.greedy_search(params, config, pad_rows(sources[:4], 16))[0],
            decoders.greedy_search(params, config, pad_rows(sources[4:] + [[]], 16))[0],
        ]
    )
    assert out == [tokenizer.decode(row) for row in tokens[:7]]
    # Other sentences of the same shapes compile at most the programs of that shape their outputs reach and the
    # first ones did not (a level of the shrinking batch, a cache length: compile_translation lists them all);
    # the same sentences again compile nothing.
    plan = translation.plan_translation([len(s) for s in sources], 4, config.max_len)
    assert plan.shapes() == [(4, 16)]
    jobs = translation.compile_translation(params, config, plan, GREEDY)
    planned = len([name for name in jobs if not name.startswith("encoder")])

    def compiled():
        return search.start._cache_size() + search.resume._cache_size()

    before = compiled()
    translation.translate(params, config, tokenizer, short[100:107], GREEDY, batch_size=4, progress=False)
    assert compiled() - before <= planned - 1
    before = compiled()
    translation.translate(params, config, tokenizer, short[100:107], GREEDY, batch_size=4, progress=False)
    assert compiled() == before
    with pytest.raises(ValueError, match="sentence 1 has"):
        translation.translate(params, config, tokenizer, ["one", " ".join(["ninety"] * 40)], progress=False)


def test_translation_batches_use_a_small_fixed_set_of_shapes():
    assert translation.decode_widths(128) == (16, 32, 64, 128)
    assert translation.decode_widths(24) == (16, 24) and translation.decode_widths(16) == (16,)
    # 150 sources of every length 2..51 (EOS included): two batches of 64 rows, then the last 22 sentences in 16
    # rows and 8 (2 filler rows) rather than 64 (42 filler rows); widths by the longest source of each sorted batch.
    lengths = [2 + i % 50 for i in range(150)]
    batches = translation.translation_batches(lengths, 64, 128)
    assert [(len(chunk), rows, width) for chunk, rows, width in batches] == [
        (64, 64, 32),
        (64, 64, 64),
        (16, 16, 64),
        (6, 8, 64),
    ]
    assert sorted(np.concatenate([chunk for chunk, _, _ in batches]).tolist()) == list(range(150))
    assert all(max(lengths[i] for i in chunk) <= width for chunk, _, width in batches)
    # Four batches: on the CPU's schedule with two cores or more, each decodes whole, two at once; elsewhere one at a
    # time, each cut in parts where that helps (schedule.parallel_parts).
    plan = translation.plan_translation(lengths, 64, 128, schedule.Scheduled())
    assert plan.shapes() == [(8, 64), (16, 64), (64, 32), (64, 64)]
    two = schedule.side_by_side() > 1
    assert (plan.at_once, plan.schedule) == ((2, schedule.Scheduled(split=False)) if two else (1, schedule.Scheduled()))
    plan = translation.plan_translation(lengths, 64, 128, schedule.Whole())
    assert (plan.at_once, plan.schedule) == (1, schedule.Whole())
    # Fewer sentences than batch_size: one batch of the next power of two, or two whose rows add up to fewer
    # (counting a batch of fewer than 4 rows as 4).
    rows = {n: [r for _, r, _ in translation.translation_batches([5] * n, 64, 128)] for n in (3, 5, 9, 36, 50, 63)}
    assert rows == {3: [4], 5: [8], 9: [8, 1], 36: [32, 4], 50: [64], 63: [64]}
    plan = translation.plan_translation([5, 9, 3], 64, 128, schedule.Scheduled())
    assert plan.shapes() == [(4, 16)] and plan.schedule == schedule.Scheduled()  # one batch: it may be cut in parts
    assert translation.translation_batches([], 64, 128) == []
    with pytest.raises(ValueError, match="batch_size must be an int >= 1"):
        translation.translation_batches([3], 0, 128)


def test_translate_decodes_whole_batches_side_by_side(tiny_translator, monkeypatch):
    """Where two decoding loops run side by side (the CPU's schedule on two cores or more), translate decodes each
    of two batches or more whole, two at once in threads of their own, with the caller's matmul precision and
    default device, and gives the translations of one whole batch at a time; where one loop runs at a time, it
    decodes a batch at a time in the caller's thread, letting the schedule cut it in parts."""
    config, params, tokenizer, sentences = tiny_translator
    cpu_schedule(monkeypatch)
    chosen = sentences[200:230]  # 30 sentences in batches of 8: 8, 8, 8 and 6 (in 8 rows)
    decode, caller, device = schedule.Scheduled.decode, threading.get_ident(), jax.devices("cpu")[0]
    calls, both_running, loops = [], threading.Barrier(2, timeout=60), [1]  # loops: what side_by_side says

    def watched(layer, *args, **kwargs):  # Scheduled.decode, noting where and how it was called
        settings = (jax.config.jax_default_matmul_precision, str(jax.config.jax_default_device))
        calls.append((threading.get_ident() == caller, layer.split, *settings))  # one append: atomic
        if loops[0] > 1 and len(calls) <= 2:
            both_running.wait()  # the first two batches are decoding at the same time, or this times out
        return decode(layer, *args, **kwargs)

    def translate(threads: int) -> list[str]:
        loops[0] = threads
        calls.clear()
        with jax.default_matmul_precision("float32"), jax.default_device(device):
            return translation.translate(params, config, tokenizer, chosen, GREEDY, batch_size=8, progress=False)

    monkeypatch.setattr(schedule, "side_by_side", lambda: loops[0])
    monkeypatch.setattr(schedule.Scheduled, "decode", watched)
    # One loop at a time: a batch at a time in this thread, each the schedule's to cut (here whole: one part).
    expected = translate(threads=1)
    assert calls == [(True, True, "float32", str(device))] * 4
    # Two side by side: the four batches whole, in the pool's threads, with this thread's settings; the same text.
    assert translate(threads=2) == expected
    assert calls == [(False, False, "float32", str(device))] * 4


@pytest.mark.slow
def test_translate_compiles_once_per_shape_and_ahead_of_time(tiny_translator, monkeypatch):
    """Sources of many lengths decode in the planned shapes, each program compiled once: ahead of time by
    compile_translation, after which translate compiles nothing."""
    config, params, tokenizer, sentences = tiny_translator
    cpu_schedule(monkeypatch)
    monkeypatch.setattr(schedule, "side_by_side", lambda: 2)  # the plan of a CPU of two cores, on any machine
    # A config no other test decodes with (dropout is off when decoding), so nothing is compiled for it yet.
    config = config.replace(activation_dropout=0.01)
    texts = sentences + [f"{a} {b}" for a, b in zip(sentences[::7], sentences[1::7])]  # up to 30 tokens
    lengths = [len(ids) + 1 for ids in tokenizer.encode_batch(texts)]
    chosen = [s for n in range(3, 21) for s in [s for s, m in zip(texts, lengths) if m == n][:3]]  # 3..20 tokens
    few = chosen[-3:]  # fewer sentences than batch_size: a batch of 4 rows
    plans = [
        translation.plan_translation([len(s) for s in translation.encode_sources(tokenizer, batch, config)], 8, 24)
        for batch in (chosen, few)
    ]
    # Widths 16 and max_len 24; 3 sentences: 4 rows. The many batches of `chosen` decode whole, two at once; the one
    # batch of `few` may be cut in parts (schedule.parallel_parts: not at 4 rows).
    assert [(plan.shapes(), plan.at_once) for plan in plans] == [([(8, 16), (8, 24)], 2), ([(4, 24)], 1)]
    # Greedy here; beam search goes through the same shapes (tests/test_compile.py compiles its decoders ahead).
    with compiled_functions() as compiled:
        jobs = {}
        for plan in plans:
            jobs |= translation.compile_translation(params, config, plan, GREEDY)
        for compile_job in jobs.values():
            compile_job()
    # An output limit of 24 tokens (max_len) decodes with one cache of 24 positions (schedule.cache_lengths); batches
    # of 8 rows shrink to 2 and 1, batches of 4 to 1 (schedule.shrink_levels).
    expected = [
        "gnmt greedy 1x16 cache 24 resumed",
        "gnmt greedy 1x24 cache 24 resumed",
        "gnmt greedy 2x16 cache 24 resumed",
        "gnmt greedy 2x24 cache 24 resumed",
        "gnmt greedy 4x24 cache 24",
        "gnmt greedy 8x16 cache 24",
        "gnmt greedy 8x24 cache 24",
    ]
    # The encoder runs on a batch's rows (at most schedule.ENCODER_ROWS) cut to widths of 8, 16, ... up to the
    # batch's, its output padded back to the batch's width (schedule.encode_batch): a program per group shape and
    # batch width, shared by the shapes of that width; the plans list the groups their sentences make.
    encoders = sorted({f"encoder {r}x{c} of width {w}" for plan in plans for r, c, w in plan.encoder_shapes()})
    assert sorted(jobs) == sorted(expected + encoders)
    assert sorted(name for name, _ in compiled) == sorted(
        ["jit(start)"] * 3 + ["jit(resume)"] * 4 + ["jit(encoder)"] * len(encoders)
    )
    with compiled_functions() as compiled:
        for batch in (chosen, few):
            translation.translate(params, config, tokenizer, batch, GREEDY, batch_size=8, progress=False)
    assert not {"jit(start)", "jit(resume)", "jit(encoder)"} & {name for name, _ in compiled}  # none again
    # Between the programs, only the jitted gathers and pads that move a batch from one to the next compile (once
    # per shape): the loop's bookkeeping runs in numpy, not as eager jax ops that compile a program per shape.
    assert {name for name, _ in compiled} <= {"jit(select_rows)", "jit(grow)", "jit(_in_row_order)"}, compiled


@pytest.mark.slow
def test_translation_encoders_are_the_encoder_programs_translate_runs(tiny_translator, monkeypatch):
    """A plan's encoders are the (rows, cut width, batch width) encoder programs translate runs, no more, no fewer:
    each batch's parts, its sources grouped by length, filler rows among them. (A training run compiles its
    evaluations' encoders ahead from this list: tests/test_compile.py checks that its loop compiles none.)"""
    config, params, tokenizer, sentences = tiny_translator
    cpu_schedule(monkeypatch)
    texts = sentences + [f"{a} {b}" for a, b in zip(sentences[::7], sentences[1::7])]
    lengths = [len(ids) + 1 for ids in tokenizer.encode_batch(texts)]  # + EOS
    fitting = [t for t, n in zip(texts, lengths) if n <= config.max_len]
    ran, encoder, plans = set(), search.encoder, []

    def recorded(params, src, *, config, width):
        ran.add((*src.shape, width))
        return encoder(params, src, config=config, width=width)

    monkeypatch.setattr(search, "encoder", recorded)
    # Batches of 32 (groups of 16; widths 16 and 24: the joined sentences are longer) and a tail; then 14 sentences
    # in one batch of 16 rows, 2 of them filler, cut in halves where the CPU has two cores or more.
    for batch in (fitting[:100] + fitting[-50:], fitting[100:114]):
        ran.clear()
        translation.translate(params, config, tokenizer, batch, GREEDY, batch_size=32, progress=False)
        batch_lengths = [len(s) for s in translation.encode_sources(tokenizer, batch, config)]
        plans.append(translation.plan_translation(batch_lengths, 32, config.max_len).encoder_shapes())
        assert ran == set(plans[-1])
    assert {width for _, _, width in plans[0]} == {16, 24} and (16, 8, 16) in plans[0]
    assert {(rows, width) for rows, _, width in plans[1]} == {(16 // schedule.parallel_parts(16), 16)}


def test_plot_attention_draws_every_layer_and_head(tiny_translator, tmp_path):
    from jax_transformer.decoding import attention

    config, params, tokenizer, sentences = tiny_translator
    path = attention.plot_attention(params, config, tokenizer, sentences[123], tmp_path / "attention.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The grid: one axes per (kind, layer, head); cross-attention has the source subwords on x (ending with
    # </s>) and the produced tokens on y.
    result = attention.sentence_attention(params, config, tokenizer, sentences[123])
    src = translation.encode_sources(tokenizer, [sentences[123]], config)[0]
    assert result.labels["source"] == attention.token_labels(tokenizer, src, config)
    assert result.labels["source"][-1] == "</s>"
    m = len(result.labels["produced"])
    assert result.maps["decoder/layer_1/cross_attention"].shape == (1, config.num_heads, m, len(src))
    assert result.labels["decoder_in"][0] == "<s>" and len(result.labels["decoder_in"]) == m
    fig = attention.attention_figure(result.maps, config, ("cross", "self", "encoder"), result.labels)
    assert len(fig.axes) == 3 * 2 * config.num_heads
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == result.labels["source"]
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == result.labels["produced"]
    np.testing.assert_allclose(result.maps["decoder/layer_0/cross_attention"].sum(-1), 1.0, atol=1e-5)
    with pytest.raises(ValueError, match="unknown attention kind"):
        attention.attention_figure(result.maps, config, ("bogus",), result.labels)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tie_output", [True, False], ids=["tied", "untied"])
def test_decoding_output_kernel_gives_the_models_logits(tie_output, dtype):
    """Decoding steps project through `output_kernel`'s (V, D) matrix, as kernel @ hidden^T: the same logits as the
    model's own projection, bias included, in both dtypes."""
    config = preset("tiny", src_vocab_size=VOCAB, tgt_vocab_size=VOCAB, dtype=dtype)
    config = config.replace(tie_output=tie_output, logits_bias=tie_output, share_embeddings=tie_output)
    model, params = Transformer(config), init_params(config, 5)
    bias = np.random.default_rng(6).standard_normal(VOCAB).astype(np.float32)  # a bias the test can see
    if tie_output:
        params = {**params, "logits_bias": bias}
    else:
        params = {**params, "output_proj": {**params["output_proj"], "bias": bias}}
    hidden = jax.random.normal(jax.random.key(7), (3, 2, config.d_model))
    plain = np.asarray(model.apply({"params": params}, hidden, method=Transformer.logits))
    kernel = search.output_kernel(model, params)
    assert kernel.shape == (VOCAB, config.d_model) and kernel.dtype == jnp.dtype(dtype)
    laid_out = np.asarray(model.apply({"params": params}, hidden, kernel, method=Transformer.logits))
    assert laid_out.shape == plain.shape and laid_out.dtype == np.float32
    # The same operands (rounded to the compute dtype alike), a float32 accumulator both ways: only the order of
    # the D additions may differ, each sum within D * 2^-24 of the sum of its terms' magnitudes (the recursive
    # summation bound), so two orders within twice that, plus the bias sum's own rounding (half an ulp each
    # way); a missing bias or a wrong matrix moves logits by O(1).
    terms = np.abs(np.asarray(hidden.astype(dtype), np.float32)) @ np.abs(np.asarray(kernel, np.float32)).T
    bound = 2 * config.d_model * 2.0**-24 * terms + 2.0**-23 * np.abs(plain)
    np.testing.assert_array_less(np.abs(laid_out - plain), bound)


def test_first_argmax_is_argmax_with_its_tie_break():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 300)).astype(np.float32)
    x[:8, 5] = x[:8, 200] = 10.0  # ties: the first index wins, as in argmax
    x[8:16] = 0.0  # a whole row tied
    x[16:24, :100] = -np.inf  # -inf entries (banned tokens) are never the maximum
    np.testing.assert_array_equal(np.asarray(search.first_argmax(jnp.asarray(x))), np.argmax(x, axis=-1))


@pytest.mark.parametrize("k", [1, 8])
def test_top_k_is_lax_top_k_ties_and_infinities_included(k):
    """search.top_k's two passes pick what lax.top_k picks (the reference: XLA's own TopK), index for index:
    few distinct values (ties within and across blocks), rows of -inf but a few entries, rows all -inf, widths
    that are and are not a multiple of its blocks, and too few blocks (lax.top_k itself then)."""
    rng = np.random.default_rng(0)
    for width in (64 * 50, 64 * 50 + 3, 64 * 5 + 63, 64 * 7):
        x = rng.integers(0, 6, size=(12, width)).astype(np.float32)  # many copies of each value per row
        x[3:6] = -np.inf
        x[3, [5, 70, 71, width - 1]] = [2.0, 2.0, 1.0, 2.0]  # fewer finite entries than k = 8, one in the last block
        x[7] = rng.standard_normal(width)  # distinct values
        x[8, :] = 1.0
        x[8, [64 * 3 + 5, width - 2]] = 9.0  # two blocks' maxima, all else tied
        want_values, want_index = jax.lax.top_k(jnp.asarray(x), k)
        values, index = jax.jit(search.top_k, static_argnums=1)(jnp.asarray(x), k)
        np.testing.assert_array_equal(np.asarray(values), np.asarray(want_values))
        np.testing.assert_array_equal(np.asarray(index), np.asarray(want_index))


@pytest.mark.parametrize("shift", [0.0, 100.0], ids=["logits", "logits + 100"])
@pytest.mark.parametrize("num_beams", [1, 4])
def test_generate_leaves_filler_rows_finished_from_the_start(num_beams, shift, model_a):
    """transformers-rules decoding (generate) of a batch with an all-PAD filler row, as `translate` pads its
    batches: the filler row comes out all PAD (decoded, it produced tokens up to max_length and held up the batch's
    loop), and the real rows come out as without it. Also where the logits are large and positive (every one
    shifted by 100, which changes no log-prob): greedy ranks the logits themselves, and their sums must not push
    an unfinished hypothesis into the finished set."""
    from jax_transformer.decoding.decoders import generate

    config, params, src = model_a
    params = {**params, "output_proj": {**params["output_proj"], "bias": params["output_proj"]["bias"] + shift}}
    filler = np.full((1, src.shape[1]), config.pad_id, np.int32)
    options = dict(max_length=12, num_beams=num_beams, banned=(config.pad_id,))
    alone = generate(params, config, src, **options)
    with_filler = generate(params, config, np.concatenate([src, filler]), **options)
    np.testing.assert_array_equal(with_filler[:-1], alone)
    assert np.all(with_filler[-1] == config.pad_id)
    assert np.all(alone != config.pad_id, axis=1).sum() < len(alone)  # some rows end before max_length, PAD after


def test_batch_parts_run_with_the_callers_precision_and_come_back_in_row_order(monkeypatch):
    """The CPU's schedule hands each part (schedule.parallel_parts: two on a CPU of two cores or more) every n-th row,
    decodes the parts in threads of their own, each under the caller's matmul precision (a per-thread jax setting), and
    puts the rows of every result back where they were."""
    seen = []

    def part(layer, params, config, rules, src, limit, length):  # stands in for one part's decoding
        seen.append((jax.config.jax_default_matmul_precision, np.asarray(src)[:, 0].tolist()))
        return np.asarray(src) * 10, np.asarray(limit) + 0.5

    monkeypatch.setattr(schedule.Scheduled, "_decode_part", part)
    monkeypatch.setattr(schedule, "side_by_side", lambda: 2)
    src = np.arange(8 * 3).reshape(8, 3)  # row r starts with 3 * r
    limit = np.arange(8)
    with jax.default_matmul_precision("float32"):
        tokens, scores = schedule.Scheduled().decode(None, None, None, src, limit, length=4)
    assert sorted(seen) == [("float32", list(range(3 * i, 24, 6))) for i in range(2)]  # every other row
    np.testing.assert_array_equal(tokens, src * 10)
    np.testing.assert_array_equal(scores, limit + 0.5)


@pytest.mark.slow
@pytest.mark.parametrize("search_kind", ["greedy", "beam 4", "generate greedy", "generate beam 4"])
def test_finished_sentences_leave_the_batch_and_change_nothing(search_kind, monkeypatch):
    """A batch of 32 real sentences of a trained model (saved weights: their output lengths differ, so rows finish
    at different steps), decoded on the CPU's schedule in two halves at once (schedule.parallel_parts), shrinks as they
    finish (beam 16 -> 4 sentences a half, greedy on to 1 row) and gives the tokens and scores of one loop over the
    whole batch (schedule.Whole), by both rule sets; the programs of every level are those the schedule lists
    (`programs`), compiled ahead."""
    from tests.helpers.saved import load_saved_model

    saved = load_saved_model("trained_tiny")
    config, params, src = saved.config, saved.params, saved.sources[64:96]
    transformers_rules = DecodeConfig(rules="transformers", max_length=24, banned=str(config.pad_id))
    beam_size, rules = {
        "greedy": (1, None),
        "beam 4": (4, None),
        "generate greedy": (1, transformers_rules),
        "generate beam 4": (4, transformers_rules),
    }[search_kind]
    decoder = decoders.decoder(config, (rules or DecodeConfig()).replace(beam_size=beam_size), src.shape[1])
    monkeypatch.setattr(schedule, "side_by_side", lambda: 2)  # two halves, on any machine
    layer = schedule.Scheduled()
    levels, select_rows = [], schedule._select_rows_jit

    def counted(state, memory, src, index):  # the schedule's select_rows, noting the level it shrinks to
        levels.append(len(index))
        return select_rows(state, memory, src, index)

    # The programs of every level compiled ahead, as translate does: decoding compiles nothing more.
    for compile_job in decoder.programs(params, *src.shape, layer).values():
        compile_job()
    encoders = layer.encoder_shapes(np.count_nonzero(src != config.pad_id, axis=1), src.shape[1])  # of the two halves
    for compile_job in layer.encoder_programs(decoders.on_device(params), config, encoders).values():
        compile_job()
    monkeypatch.setattr(schedule, "_select_rows_jit", counted)
    with compiled_functions() as compiled:
        tokens, scores = decoder(params, src, layer).best()
    assert not {name for name, _ in compiled} & {"jit(start)", "jit(resume)", "jit(encoder)"}, compiled
    below = schedule.shrink_levels(len(src) // 2, decoder.rules.beams)[1:]  # of a half of 16: 4 sentences; greedy 4, 1
    assert levels and set(levels) <= set(below), levels  # it shrank
    assert all(levels.count(n) <= 2 for n in below), levels  # each half once through each level
    whole_tokens, whole_scores = decoder(params, src, schedule.Whole()).best()
    np.testing.assert_array_equal(tokens, whole_tokens)
    # The same sums of log-probs, computed in matrix products of fewer rows: float32 rounding of the products
    # differs by a few ulps of log-probs ~1, summed over at most 33 tokens.
    np.testing.assert_allclose(scores, whole_scores, rtol=0, atol=1e-5)
