"""Decoding parity: the fast Flax decoder (jax_transformer.decoding: key/value cache, jit, while_loop) against the
PyTorch reference (torch_reference.decoding: the decoder re-run over the whole prefix at every step, and its own
key/value cache), on the same weights.

Tokens must be identical. They are chosen by argmax / top-k over log-probs that differ between the frameworks
only by float32 reassociation (~1e-6, see test_forward_parity.py), so a token could flip only where two
candidates are within ~1e-6 of each other. The greedy tests measure the smallest margin on the path and require
it to be far above that (1e-4), so a mismatch means a real difference, and a mismatch message prints the margin
at the first differing token.

Scores: a greedy score sums at most max_len (16 here) log-probs, a beam score the same divided by a penalty >= 1;
each log-prob agrees to ~1e-6, so sums agree to ~2e-5 at worst; 5e-5 is the tolerance. A wrong token, a missing
token or a wrong length penalty moves scores by 1e-2 or more.

Random models are tiny and mostly repeat a token, and they rarely emit EOS. To exercise EOS handling, the
untied config's output bias on EOS is raised so that EOS comes first at step 0 for about half of the rows (set
halfway between two rows' step-0 margins, so no row is near a tie), which also makes sequences end at different
steps. The batch holds a source filling all max_len positions, an empty source (EOS only) and padded rows.
Finally, a tiny model trained briefly on the default task (peaked, realistic distributions) is compared too.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from jax_transformer import decoding
from jax_transformer.config import preset
from jax_transformer.model import init_params
from tests.fixtures import DECODING_CONFIGS as CONFIGS
from tests.fixtures import DECODING_MAX_LEN as MAX_LEN
from tests.fixtures import DECODING_VOCAB as VOCAB
from tests.fixtures import corpus_batches, eos_biased, logit_tolerance, make_src, pad_rows, t, torch_twin
from torch_reference import decoding as torch_decoding

LENGTHS = (MAX_LEN, 3, 1, 9, 5, 12)  # a full-width source, an empty one (EOS only), padded ones
SCORE_ATOL = 5e-5  # see the module docstring
MIN_MARGIN = 1e-4  # greedy paths must not pass through near-ties (float32 noise is ~1e-6)

SEEDS = (0, 1, 2)

# bfloat16 decoding (test_trained_model_bf16_tokens_mostly_identical): sentences decoded, and the share of them whose
# tokens must be identical in both frameworks (issue 11's goal). Not all: the twins' bfloat16 logits differ by a
# bfloat16 ulp here and there (test_bf16_parity.py), which flips a greedy choice where the two best tokens are
# within an ulp, and once one token differs the rest of that sentence follows another path.
BF16_SENTENCES = 64
BF16_IDENTICAL_SHARE = 0.95
# Greedy search on the tiny fixture model: identical on 0.875-1.0 of the 64 sentences depending on the round of
# training it stopped at (measured, 2-core EPYC); each mismatch is checked to be a near tie instead (see the test).
BF16_GREEDY_FLOOR = 0.85


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """These models are tiny: one thread is several times faster than two on a busy machine (no hand-offs)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@torch.no_grad()
def teacher_forced_log_probs(model, src: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """Torch log-probs (B, L, V) of every step of the given outputs (no BOS; PAD after the end), with the
    tokens the decoders may never produce (PAD, BOS) at -inf, as the searches see them."""
    cfg = model.cfg
    tgt_in = np.concatenate([np.full((len(tokens), 1), cfg.bos_id), tokens[:, :-1]], axis=1)
    tgt_in[tgt_in == cfg.eos_id] = cfg.pad_id
    lp = torch.log_softmax(model(t(src), t(tgt_in)), dim=-1).cpu().numpy().copy()
    lp[:, :, [cfg.pad_id, cfg.bos_id]] = -np.inf
    return lp


def greedy_margin(model, src, tokens, min_len=0) -> float:
    """Smallest gap, along the produced greedy paths, between the chosen token's log-prob and the runner-up's."""
    lp = teacher_forced_log_probs(model, src, tokens)
    lp[:, :min_len, model.cfg.eos_id] = -np.inf
    top2 = -np.sort(-lp, axis=-1)[:, :, :2]  # (B, L, 2)
    real = tokens != model.cfg.pad_id
    return float(np.min((top2[:, :, 0] - top2[:, :, 1])[real]))


def explain_mismatch(model, src, flax_tokens, torch_tokens) -> str:
    """Where the two outputs first differ, and how far apart the two frameworks' choices were (torch log-probs
    after the shared prefix)."""
    row, t = map(int, np.argwhere(flax_tokens != torch_tokens)[0])
    lp = teacher_forced_log_probs(model, src[row : row + 1], torch_tokens[row : row + 1])[0, t]
    a, b = int(flax_tokens[row, t]), int(torch_tokens[row, t])
    return (
        f"row {row} step {t}: flax chose {a} (log-prob {lp[a]:.7f}), torch chose {b} (log-prob {lp[b]:.7f}), "
        f"gap {abs(lp[a] - lp[b]):.2e}\nflax  {flax_tokens[row].tolist()}\ntorch {torch_tokens[row].tolist()}"
    )


def with_eos_bias(config, params, src):
    """Raises the untied output bias of EOS so that EOS comes first at step 0 for about half of the rows."""
    if config.tie_output:
        return params
    first = teacher_forced_log_probs(torch_twin(config, params), src, np.zeros((len(src), 1), np.int64))[:, 0]
    return eos_biased(config, params, first)


@pytest.fixture(
    params=[(name, seed) for name in CONFIGS for seed in SEEDS],
    ids=[f"{name}-seed{seed}" for name in CONFIGS for seed in SEEDS],
)
def random_case(request):
    name, seed = request.param
    config = CONFIGS[name]
    src = make_src(config, LENGTHS, seed=seed)
    params = with_eos_bias(config, init_params(config, seed), src)
    return f"{name}-seed{seed}", config, params, torch_twin(config, params), src


def check_same(name, what, model, src, flax_out, torch_out, parity_report):
    (flax_tokens, flax_scores), (torch_tokens, torch_scores) = flax_out, torch_out
    torch_tokens, torch_scores = torch_tokens.cpu().numpy(), torch_scores.cpu().numpy()
    assert flax_tokens.shape == torch_tokens.shape
    if not np.array_equal(flax_tokens, torch_tokens):
        pytest.fail(f"{what}: tokens differ. {explain_mismatch(model, src, flax_tokens, torch_tokens)}")
    diff = float(np.max(np.abs(flax_scores - torch_scores)))
    parity_report(what, name, diff, SCORE_ATOL)
    assert diff <= SCORE_ATOL


# --- random models ------------------------------------------------------------------------------------------


def test_length_rules_agree():
    """The two implementations' length limits, output widths and length penalties are the same numbers."""
    config = CONFIGS["pre_learned_shared"]
    src = make_src(config, LENGTHS, seed=0)
    src[-1] = config.pad_id  # an all-PAD filler row
    for a, b in ((1.5, 10), (0.0, 6), (1.2, 0.5), (0.7, 3)):
        assert decoding.max_new_tokens(src, config, a, b).tolist() == torch_decoding.max_new_tokens(
            t(src), config, a, b
        )
        assert decoding.output_length(MAX_LEN, config, a, b) == torch_decoding.output_length(MAX_LEN, config, a, b)
    for alpha in (0.0, 0.6, 1.0):
        table = decoding.length_penalties(MAX_LEN, alpha)
        assert table.tolist() == [torch_decoding.length_penalty(n, alpha) for n in range(MAX_LEN + 1)]


def test_greedy_tokens_identical(random_case, parity_report):
    name, config, params, model, src = random_case
    for min_len in (0, 4):
        flax_out = decoding.greedy_search(params, config, src, min_len=min_len)
        margin = greedy_margin(model, src, flax_out[0], min_len)
        assert margin > MIN_MARGIN, f"near-tie on the greedy path (margin {margin:.1e}): choose another seed"
        for use_cache in (False, True):
            torch_out = torch_decoding.greedy_search(model, t(src), min_len=min_len, use_cache=use_cache)
            what = f"greedy{' min_len=4' if min_len else ''} vs torch {'cached' if use_cache else 'uncached'}"
            check_same(name, what, model, src, flax_out, torch_out, parity_report)
        if min_len == 0 and not config.tie_output:  # the premise of the EOS bias: some rows end at once
            first = flax_out[0][:, 0] == config.eos_id
            assert first.any() and not first.all()


def test_beam_search_identical(random_case, parity_report):
    name, config, params, model, src = random_case
    for alpha, min_len in ((0.6, 0), (0.0, 3)):
        flax_out = decoding.beam_search(params, config, src, beam_size=4, alpha=alpha, min_len=min_len)
        for use_cache in (False, True):
            torch_out = torch_decoding.beam_search(
                model, t(src), beam_size=4, alpha=alpha, min_len=min_len, use_cache=use_cache
            )
            what = f"beam 4 alpha={alpha} min_len={min_len} vs torch {'cached' if use_cache else 'uncached'}"
            check_same(name, what, model, src, flax_out, torch_out, parity_report)


def test_torch_cached_decoder_equals_prefix_decoder(parity_report):
    """The reference's own cache: per-step log-probs equal re-running the twin over the whole prefix."""
    config = CONFIGS["pre_learned_shared"]
    model, src = torch_twin(config, init_params(config, 5)), t(make_src(config, LENGTHS, seed=5))
    memory = model.encode(src)
    prefix = torch_decoding.PrefixDecoder(model, memory, src)
    cached = torch_decoding.IncrementalDecoder(model, memory, src)
    tokens = t(np.random.default_rng(5).integers(3, VOCAB, (len(src), 10)))
    worst = 0.0
    with torch.no_grad():
        for step in range(tokens.shape[1]):
            worst = max(worst, float((prefix.step() - cached.step()).abs().max()))
            prefix.append(tokens[:, step])
            cached.append(tokens[:, step])
    parity_report("torch cached vs prefix decoder log-probs", "pre_learned_shared", worst, 1e-5)
    assert worst <= 1e-5  # same formulas, different shapes: float32 reassociation only (see above)


# --- a trained model ----------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def trained():
    """A tiny model trained on batches of 48 sentence pairs of the default task (jax_transformer.training's step;
    no dropout and no label smoothing, which train fastest), and 16 validation sources. It does not translate
    well yet, but its distributions are trained ones: peaked, with EOS where sentences end. It trains in rounds
    of 100 steps until greedy search ends at least 3/4 of the validation sources with EOS (at most 1,500 steps):
    a fixed step count was not enough everywhere, as float32 rounding differs between CPUs (on one machine 400
    steps ended 14 of 16, on another 5 of 16; the share swings from round to round this early in training)."""
    from jax_transformer.data import Tokenizer, encode_corpus
    from jax_transformer.default_task import TOKENIZER_MODEL_TYPE, TOKENIZER_VOCAB_SIZE, default_pairs
    from jax_transformer.training import OptimConfig, create_train_state, make_train_step

    pairs = default_pairs("train", n=2000)
    tokenizer = Tokenizer.train(pairs.sources + pairs.targets, TOKENIZER_VOCAB_SIZE, model_type=TOKENIZER_MODEL_TYPE)
    config = preset("tiny", src_vocab_size=tokenizer.vocab_size, tgt_vocab_size=tokenizer.vocab_size, max_len=24)
    batches = corpus_batches(encode_corpus(pairs, tokenizer, config.max_len), config, 48)  # one shape: 48 x max_len
    opt = OptimConfig(lr_scale=2.0, warmup_steps=100, label_smoothing=0.0)
    state, step = create_train_state(config, opt, seed=0), make_train_step(config, opt, dropout=False)
    sources = decoding.encode_sources(tokenizer, default_pairs("valid", n=BF16_SENTENCES).sources, config)
    losses = []
    while len(losses) < 1500:
        for _ in range(100):
            state, sums = step(state, next(batches))
            losses.append(float(sums["loss"]) / float(sums["tokens"]))
        ended = np.any(decoding.greedy_search(state.params, config, pad_rows(sources))[0] == config.eos_id, axis=1)
        if len(losses) >= 400 and ended.mean() >= 0.75:
            break
    src = pad_rows(sources[:16])
    return config, state.params, torch_twin(config, state.params), src, losses, sources


def test_trained_model_greedy_and_beam_identical(trained, parity_report):
    config, params, model, src, losses, _ = trained
    assert np.mean(losses[-20:]) < 0.6 * np.mean(losses[:5]), "the fixture's model did not train"
    greedy = decoding.greedy_search(params, config, src)
    ended = np.any(greedy[0] == config.eos_id, axis=1)
    assert ended.mean() >= 0.5, f"only {ended.sum()} of {len(ended)} outputs end with EOS: is the model trained?"
    margin = greedy_margin(model, src, greedy[0])
    assert margin > MIN_MARGIN, f"near-tie on the greedy path (margin {margin:.1e})"
    check_same(
        "trained tiny",
        "greedy vs torch uncached",
        model,
        src,
        greedy,
        torch_decoding.greedy_search(model, t(src)),
        parity_report,
    )
    beam = decoding.beam_search(params, config, src, beam_size=4, alpha=0.6)
    check_same(
        "trained tiny",
        "beam 4 alpha=0.6 vs torch uncached",
        model,
        src,
        beam,
        torch_decoding.beam_search(model, t(src), beam_size=4, alpha=0.6),
        parity_report,
    )


@pytest.mark.parametrize("search", ["greedy", "beam 4"])
def test_trained_model_bf16_tokens_mostly_identical(trained, search, parity_report):
    """The trained model decoded in bfloat16 by both frameworks (Flax's cached jitted search, the twin's cached
    search) gives identical tokens on at least BF16_IDENTICAL_SHARE of BF16_SENTENCES validation sentences. The
    weights are the float32 ones trained above: bfloat16 is how they are computed, not what they are."""
    config, params, _, _, _, sources = trained
    config = config.replace(dtype="bfloat16")
    model, src = torch_twin(config, params), pad_rows(sources)
    if search == "greedy":
        flax_tokens, _ = decoding.greedy_search(params, config, src)
        torch_tokens, _ = torch_decoding.greedy_search(model, t(src), use_cache=True)
    else:
        flax_tokens, _ = decoding.beam_search(params, config, src, beam_size=4, alpha=0.6)
        torch_tokens, _ = torch_decoding.beam_search(model, t(src), beam_size=4, alpha=0.6, use_cache=True)
    same = np.all(flax_tokens == torch_tokens.cpu().numpy(), axis=1)
    ended = np.any(flax_tokens == config.eos_id, axis=1)
    print(f"bf16 {search}: {same.sum()} of {len(same)} sentences identical; {ended.sum()} end with EOS")
    parity_report(f"bf16 {search}: share of sentences not identical", "trained tiny", 1 - same.mean(), 0.05)
    assert ended.mean() >= 0.5  # a trained model's outputs, not a random model's
    if search == "greedy":
        # Every greedy sentence that differs must first differ at a near tie: the two frameworks' bfloat16 logits
        # are each within logit_tolerance of the other's (test_bf16_parity.py), so the choice between tokens a
        # and b can flip only where the twin's logits of a and b are within twice that. On this tiny model the
        # identical share swings between 0.88 and 1.0 from one round of 100 training steps to the next (measured
        # on a 2-core EPYC), so the share alone says little; the near-tie rule holds for every mismatch.
        theirs = torch_tokens.cpu().numpy()
        for row in np.flatnonzero(~same):
            at = int(np.argmax(flax_tokens[row] != theirs[row]))
            lp = teacher_forced_log_probs(model, src[row : row + 1], theirs[row : row + 1])[0, at]
            a, b = int(flax_tokens[row, at]), int(theirs[row, at])
            tgt_in = np.concatenate([[config.bos_id], theirs[row, :at]])[None]
            with torch.no_grad():
                logits = model(t(src[row : row + 1]), t(tgt_in)).float().cpu().numpy()[0, at]
            tol = 2 * logit_tolerance(config, logits)
            parity_report(
                "bf16 greedy: logit gap where the paths part", f"trained tiny row {row}", abs(lp[a] - lp[b]), tol
            )
            assert abs(lp[a] - lp[b]) <= tol, f"row {row} step {at}: tokens {a} and {b} are not a near tie"
    assert same.mean() >= (BF16_IDENTICAL_SHARE if search == "beam 4" else BF16_GREEDY_FLOOR)
