"""Ensembles (jax_transformer.decoding.ensemble): a model with itself decodes as the model alone, under every decoding
option; two models' combined distribution is the formula over their own log-probs, step by step; members of other
sizes decode together through the CPU's schedule; vocabularies that differ are refused; the command line's
`translate --checkpoint A --checkpoint B`. The twin's ensemble: parity_tests/test_ensemble_parity.py."""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest

from jax_transformer import Translator
from jax_transformer.decoding import decoders, ensemble, schedule
from jax_transformer.errors import UsageError
from jax_transformer.model.transformer import Transformer, cross_attention_rows, grow_cache, init_params, select_cache
from jax_transformer.settings.config import DecodeConfig
from tests.helpers.batches import make_src
from tests.helpers.configs import DECODING_CONFIGS
from tests.helpers.saved import saved_run
from tests.helpers.tooling import cpu_schedule
from tests.helpers.training import run_main
from tests.helpers.twins import eos_biased
from tests.test_decoding import step_log_probs

jax.config.update("jax_default_matmul_precision", "highest")

# One layer each side: the loops compile in a few seconds (tests/test_decoding.py has the two-layer models).
CONFIG = dataclasses.replace(DECODING_CONFIGS["post_sinusoidal_untied"], num_encoder_layers=1, num_decoder_layers=1)
# Another size: a wider model, the same vocabulary.
WIDER = dataclasses.replace(CONFIG, d_model=48, d_ff=96)
LENGTHS = (16, 3, 1, 6, 5)

# An ensemble of a model with itself: log(w p + w p) with w = 1/2, then the rules' log_softmax of those log-probs,
# differ from the model's log-probs by float32 rounding (~1e-7 for log-probs of O(1-10)); a score sums up to 16
# of them: 1e-5 leaves a margin of about 5 over the largest seen, while a wrong combination moves it by O(0.1).
SELF_ATOL = 1e-5


def eos_biased_model(config, seed: int):
    """Random weights with EOS raised (`twins.eos_biased`): about half of the rows end at the first step, so that
    outputs end at various lengths."""
    src = make_src(config, LENGTHS, seed=seed)
    params = init_params(config, seed)
    first = step_log_probs(params, config, src, np.zeros((len(src), 1), np.int32), 0)
    return eos_biased(config, params, first), src


@pytest.fixture(scope="module")
def model():
    return eos_biased_model(CONFIG, 0)


PREFIXES = [[5, 7], None, None, [9], None]

# Each compiles two loops of its own (about 5 s each on a shared 2-core machine): greedy in the quick suite.
DECODINGS = {
    "greedy, prefixes": (DecodeConfig(beam_size=1), PREFIXES),
    "beam 4, 3-best, prefixes": (DecodeConfig(beam_size=4, n_best=3), PREFIXES),
    "sampling, 2 samples": (DecodeConfig(beam_size=1, do_sample=True, n_best=2, top_k=10, sample_seed=3), None),
    # transformers' greedy ranks the model's raw logits, the ensemble's log-probs: the same order, the same scores
    "transformers greedy, prefixes": (DecodeConfig(rules="transformers", beam_size=1), PREFIXES),
}
SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "name", [pytest.param(name, marks=[] if name.startswith("greedy") else [SLOW]) for name in DECODINGS]
)
def test_an_ensemble_of_a_model_with_itself_decodes_as_the_model(model, name):
    params, src = model
    decode, prefixes = DECODINGS[name]
    found = ensemble.Ensemble.of([CONFIG, CONFIG], [params, params], [0.3, 0.7])
    alone = decoders.decoder(CONFIG, decode, src.shape[1])(params, src, schedule.Whole(), prefixes)
    both = decoders.decoder(found.config, decode, src.shape[1])(found.params, src, schedule.Whole(), prefixes)
    assert found.config.groups == ((0, 1),)  # one config: stacked, one program over the stack
    np.testing.assert_array_equal(both.tokens, alone.tokens)
    np.testing.assert_array_equal(both.found, alone.found)
    np.testing.assert_allclose(both.scores, alone.scores, atol=SELF_ATOL)
    np.testing.assert_allclose(both.token_scores, alone.token_scores, atol=SELF_ATOL)
    ends = {len(row[row != CONFIG.pad_id]) for row in alone.tokens[:, 0]}
    assert 1 in ends and max(ends) > 1  # some outputs end with EOS at once, others run on


@pytest.mark.slow  # a constrained beam search: two loops of its own to compile
def test_an_ensemble_of_a_model_with_itself_keeps_the_models_constrained_search(model):
    """Constraints and banned phrases are rules of the search, the ensemble only its step function: an ensemble of a
    model with itself finds the model's own constrained hypotheses, every one holding its row's phrases."""
    params, src = model
    constraints = [[[10, 11]], None, [[12]], [[13], [14, 15]], None]
    banned = [[[16]], [[17, 18]], None, None, [[16]]]
    decode = DecodeConfig(beam_size=4, n_best=2)
    found = ensemble.Ensemble.of([CONFIG, CONFIG], [params, params], [0.5, 0.5])
    alone = decoders.decoder(CONFIG, decode, src.shape[1])(params, src, schedule.Whole(), None, constraints, banned)
    both = decoders.decoder(found.config, decode, src.shape[1])(
        found.params, src, schedule.Whole(), None, constraints, banned
    )
    np.testing.assert_array_equal(both.tokens, alone.tokens)
    np.testing.assert_array_equal(both.found, alone.found)
    np.testing.assert_allclose(both.scores, alone.scores, atol=SELF_ATOL)
    for row, (phrases, bans) in enumerate(zip(constraints, banned)):
        for tokens, found_one in zip(both.tokens[row], both.found[row]):
            text = " " + " ".join(map(str, tokens[tokens != CONFIG.pad_id])) + " "
            assert found_one and all(f" {' '.join(map(str, p))} " in text for p in phrases or [])
            assert not any(f" {' '.join(map(str, p))} " in text for p in bans or [])


def test_each_step_is_the_weighted_mean_of_the_members_probabilities(model):
    """Greedy search of two models of different seeds: at every step the chosen token is the best of
    log(0.7 p_a + 0.3 p_b), with p_a and p_b the models' own distributions by their teacher-forced forward passes
    (nothing of the ensemble's code), PAD and BOS banned, and its per-token log-prob is that value."""
    params_a, src = model
    params_b, _ = eos_biased_model(CONFIG, 1)
    found = ensemble.Ensemble.of([CONFIG, CONFIG], [params_a, params_b], [0.7, 0.3])
    out = decoders.decoder(found.config, DecodeConfig(beam_size=1), src.shape[1])(found.params, src, schedule.Whole())
    tokens, token_scores = out.tokens[:, 0], out.token_scores[:, 0]
    limits = decoders.max_new_tokens(src, CONFIG)
    done = np.zeros(len(src), bool)
    moved = 0.0  # how far the combination moves a chosen token's log-prob from the first model's
    for t in range(tokens.shape[1]):
        a = step_log_probs(params_a, CONFIG, src, tokens, t)
        b = step_log_probs(params_b, CONFIG, src, tokens, t)
        combined = np.logaddexp(np.log(0.7) + a.astype(np.float64), np.log(0.3) + b.astype(np.float64))  # (B, V)
        combined[:, [CONFIG.pad_id, CONFIG.bos_id]] = -np.inf
        for row in np.flatnonzero(~done):
            ranked = np.sort(combined[row])
            assert ranked[-1] - ranked[-2] > 1e-4, f"row {row} step {t}: a near-tie, choose another seed"
            assert tokens[row, t] == np.argmax(combined[row]), f"row {row}, step {t}"
            # float32 log-probs of each model vs the oracle's (~1e-6) and the combination's rounding
            assert abs(token_scores[row, t] - combined[row, tokens[row, t]]) < 1e-5, f"row {row}, step {t}"
            moved = max(moved, abs(combined[row, tokens[row, t]] - a[row, tokens[row, t]]))
            done[row] = tokens[row, t] == CONFIG.eos_id or t + 1 == limits[row]
        if done.all():
            break
    assert done.all()
    assert moved > 0.1  # the second model counts: the test sees the combination, not the first model alone


def _teacher_forced_attention(params, config, src, tokens):
    """(B, L, S): the last decoder layer's cross-attention of a model, averaged over heads, teacher-forced on
    `tokens` (B, L) (nothing of the search's or the ensemble's code)."""
    tgt_in = np.concatenate([np.full((len(tokens), 1), config.start_id), tokens[:, :-1]], axis=1).astype(np.int32)
    _, state = Transformer(config).apply({"params": params}, src, tgt_in, mutable=["intermediates"])
    return np.asarray(cross_attention_rows(state["intermediates"], config.num_decoder_layers - 1, len(src)))


def test_an_ensembles_alignments_are_the_argmax_of_its_members_weighted_attention(model):
    """Greedy search with alignments: a model with itself aligns as the model alone; two models of different seeds
    (0.3, 0.7) align each token to the argmax of 0.3 a + 0.7 b, a and b the models' own teacher-forced
    cross-attentions (last layer, mean over heads) on the ensemble's tokens, PAD and EOS left out."""
    params_a, src = model
    params_b, _ = eos_biased_model(CONFIG, 1)
    decode = DecodeConfig(beam_size=1, alignments=True)
    alone = decoders.decoder(CONFIG, decode, src.shape[1])(params_a, src, schedule.Whole())
    twice = ensemble.Ensemble.of([CONFIG, CONFIG], [params_a, params_a], [0.3, 0.7])
    same = decoders.decoder(twice.config, decode, src.shape[1])(twice.params, src, schedule.Whole())
    np.testing.assert_array_equal(same.tokens, alone.tokens)
    np.testing.assert_array_equal(same.alignments, alone.alignments)

    pair = ensemble.Ensemble.of([CONFIG, CONFIG], [params_a, params_b], [0.3, 0.7])
    out = decoders.decoder(pair.config, decode, src.shape[1])(pair.params, src, schedule.Whole())
    tokens, aligned = out.tokens[:, 0], out.alignments[:, 0]  # (B, L)
    a = _teacher_forced_attention(params_a, CONFIG, src, tokens)
    b = _teacher_forced_attention(params_b, CONFIG, src, tokens)
    words = ((src != CONFIG.pad_id) & (src != CONFIG.eos_id))[:, None, :]  # (B, 1, S)
    mean = np.where(words, 0.3 * a + 0.7 * b, -1.0)
    real = tokens != CONFIG.pad_id
    # Exact: an argmax over float32 attentions that agree to ~1e-6 (no near-ties among these rows' positions).
    np.testing.assert_array_equal(np.where(real, aligned, -1), np.where(real, mean.argmax(-1), -1))
    assert (aligned[~real] == -1).all()
    first = np.where(words, a, -1.0).argmax(-1)
    assert (first != mean.argmax(-1))[real].any()  # the second model counts: not the first model's alignment


@pytest.mark.slow
def test_members_of_other_sizes_decode_together_through_the_cpu_schedule(model, monkeypatch):
    """A model and a wider one (two groups, stepped together) on 8 sentences, greedy: the CPU's schedule (halves,
    rows leaving the batch) gives what one program over the whole batch gives."""
    cpu_schedule(monkeypatch)
    params_a, _ = model
    params_b = init_params(WIDER, 2)
    src = make_src(CONFIG, (16, 3, 1, 6, 5, 9, 2, 12), seed=4)
    found = ensemble.Ensemble.of([CONFIG, WIDER], [params_a, params_b])
    assert found.config.groups == ((0,), (1,))
    run = decoders.decoder(found.config, DecodeConfig(beam_size=1), src.shape[1])
    whole = run(found.params, src, schedule.Whole())
    scheduled = run(found.params, src, schedule.Scheduled())
    np.testing.assert_array_equal(scheduled.tokens, whole.tokens)
    np.testing.assert_allclose(scheduled.scores, whole.scores, atol=SELF_ATOL)  # smaller products' rounding


def test_the_caches_select_rows_and_grow_as_each_members_own(model):
    """`EnsembleCache.select_rows` and `.grow` (what the CPU's schedule does between programs) give, for every
    member, what `select_cache` and `grow_cache` give for that member's cache alone."""
    params_a, src = model
    params_b = init_params(WIDER, 2)
    found = ensemble.Ensemble.of([CONFIG, WIDER, CONFIG], [params_a, params_b, init_params(CONFIG, 3)])
    assert found.config.groups == ((0, 2), (1,))
    params = found.params
    index, B = np.array([3, 0, 3], np.int32), len(src)

    rng = np.random.default_rng(0)  # an encoder output of each group, (B, M_g, S, D_g): any numbers do
    memory = tuple(
        rng.standard_normal((B, len(group), src.shape[1], found.config.group_config(g).d_model), np.float32)
        for g, group in enumerate(found.config.groups)
    )

    @jax.jit  # one program (op by op, the vmapped caches take seconds)
    def made(params, src, memory):
        caches = ensemble._caches(found.config, params, memory, src, cache_len=4, beams=2)
        got = (caches.select_rows(index, B), caches.grow(7, 2))
        members = [
            jax.tree.map(lambda x, m=m: x[m], stack)
            for stack, group in zip(caches.groups, found.config.groups)
            for m in range(len(group))
        ]
        want = [(select_cache(c, index, sentences=B), grow_cache(c, 7, 2)) for c in members]
        return got, want

    (picked, grown), want = made(params, src, memory)
    stacked = [(g, m) for g, group in enumerate(found.config.groups) for m in range(len(group))]
    assert len(stacked) == len(want) == 3
    for (g, m), (selected, grew) in zip(stacked, want):
        for got, expected in ((picked.groups[g], selected), (grown.groups[g], grew)):
            jax.tree.map(lambda x, y, m=m: np.testing.assert_array_equal(x[m], y), got, expected)


def test_members_must_share_the_target_vocabulary():
    other = dataclasses.replace(CONFIG, tgt_vocab_size=CONFIG.tgt_vocab_size + 1)
    params = [init_params(CONFIG, 0), init_params(other, 0)]
    with pytest.raises(UsageError, match=r"runs/a has tgt_vocab_size=40, runs/b has tgt_vocab_size=41"):
        ensemble.Ensemble.of([CONFIG, other], params, names=["runs/a", "runs/b"])
    eos = dataclasses.replace(CONFIG, eos_id=3)
    with pytest.raises(UsageError, match=r"runs/a has eos_id=2, runs/b has eos_id=3"):
        ensemble.Ensemble.of([CONFIG, eos], [params[0], params[0]], names=["runs/a", "runs/b"])

    @dataclasses.dataclass
    class Pieces:  # a tokenizer's two answers the check asks
        pieces: tuple

        def to_bytes(self):
            return repr(self.pieces).encode()

        def piece(self, i):
            return self.pieces[i]

    same = [params[0], params[0]]
    one, two = Pieces(("a",) * 40), Pieces(("a",) * 7 + ("b",) + ("a",) * 32)
    with pytest.raises(UsageError, match=r"tokenizers of runs/a and runs/b differ \(target id 7 is 'a' in one, 'b'"):
        ensemble.Ensemble.of([CONFIG, CONFIG], same, names=["runs/a", "runs/b"], tokenizers=[one, two])
    with pytest.raises(UsageError, match="2 weights for 3 checkpoints"):
        ensemble.Ensemble.of([CONFIG] * 3, [params[0]] * 3, [1, 2])
    with pytest.raises(UsageError, match="finite number > 0"):
        ensemble.Ensemble.of([CONFIG] * 2, same, [1, 0])


@pytest.mark.slow
def test_translate_takes_several_checkpoints(tmp_path, tiny_run):
    """`translate --checkpoint A --checkpoint A` writes what `--checkpoint A` does (n-best, scores and all); a run
    of another vocabulary is refused naming both runs, before anything is written."""
    run = saved_run(tmp_path / "a")
    source = tmp_path / "in.txt"
    source.write_text("three\ntwenty one\n\nseventy seven\n", encoding="utf-8")
    common = ["translate", "--input", str(source), "--beam-size", "2", "--n-best", "2", "--output-format", "jsonl"]
    code, alone, err = run_main(common + ["--checkpoint", str(run)])
    assert code == 0, err
    code, both, err = run_main(
        common + ["--checkpoint", str(run), "--checkpoint", str(run), "--ensemble-weights", "1", "3"]
    )
    assert code == 0, err
    alone, both = [json.loads(x) for x in alone.splitlines()], [json.loads(x) for x in both.splitlines()]
    assert len(both) == 4
    for a, b in zip(alone, both):
        assert [h["tokens"] for h in a["hypotheses"]] == [h["tokens"] for h in b["hypotheses"]]
        np.testing.assert_allclose([h["score"] for h in b["hypotheses"]], [h["score"] for h in a["hypotheses"]],
                                   atol=SELF_ATOL)  # fmt: skip
    other, _ = tiny_run
    code, out, err = run_main(
        ["translate", "--input", str(source), "--checkpoint", str(run), "--checkpoint", str(other)]
    )
    assert code != 0 and out == ""
    assert "must share their vocabulary" in err and str(run) in err and str(other) in err, err
    code, out, err = run_main(
        ["translate", "--input", str(source), "--checkpoint", str(run), "--ensemble-weights", "1"]
    )
    assert code != 0 and "--ensemble-weights weighs an ensemble" in err, err
    # The front door: a list of runs, weighted; it translates as the run alone and scores nothing.
    translator = Translator([run, run], weights=[1, 3])
    assert (
        translator.translate(["three"], beam_size=2, n_best=2)[0].hypotheses[0].tokens
        == alone[0]["hypotheses"][0]["tokens"]
    )
    with pytest.raises(UsageError, match="scoring takes one model"):
        translator.score(["three"], ["trois"])


def _perturbed_run(directory, base):
    """A run of the saved tiny model's weights, perturbed (another model of the same vocabulary)."""
    from jax_transformer.checkpoint import manager as checkpoint
    from jax_transformer.settings.config import OptimConfig
    from jax_transformer.training import trainer
    from tests.helpers.saved import load_saved_model

    saved = load_saved_model("trained_tiny")
    rng = np.random.default_rng(5)
    params = jax.tree.map(lambda x: x + 0.05 * rng.standard_normal(x.shape).astype(x.dtype), saved.params)
    state = trainer.create_train_state(saved.config, OptimConfig(), params=params)
    manager = checkpoint.CheckpointManager(directory, async_save=False)
    manager.save(1, trainer.state_for_saving(state), config=saved.config, optim=OptimConfig().to_dict(),
                 tokenizer=saved.tokenizer)  # fmt: skip
    manager.close()
    return directory


@pytest.mark.slow
def test_a_models_file_serves_an_ensemble_compiled_before_ready(tmp_path):
    """A models.json entry of `checkpoints` and `weights` serves the ensemble: every program compiled ahead
    (`service.compile_jobs`), its answer is `Translator([a, b], weights=...)`'s, and nothing compiles after ready."""
    from jax_transformer.serving import catalogue, service
    from jax_transformer.serving.programs import warm_up
    from jax_transformer.settings.config import ServeConfig

    a, b = saved_run(tmp_path / "a"), _perturbed_run(tmp_path / "b", None)
    path = tmp_path / "models.json"
    entry = {"name": "both", "checkpoints": ["a", "b"], "weights": [1, 3], "step": "latest"}
    path.write_text(json.dumps({"models": [entry]}), encoding="utf-8")
    (spec,), _ = catalogue.read(path)
    assert spec.checkpoint == [a, b] and spec.weights == [1, 3]
    translator = Translator(spec.checkpoint, spec.step, weights=spec.weights, beam_size=1)
    found = service.build(service.Entry("both", translator, spec.pairs, spec.origin), ServeConfig(max_tokens=16),
                          detect=False)  # fmt: skip
    jobs, _ = service.compile_jobs(found)
    count, _, errors = warm_up(jobs)
    assert count > 0 and not errors, errors
    (model,) = found.models
    found.watch.ready()
    model.batcher.start()
    try:
        texts = ["three", "twenty one", "seventy seven"]
        got = model.batcher.submit(texts, model.decode).result()
        assert found.health()["compilations_after_ready"] == 0
    finally:
        model.batcher.close()
    expected = translator.translate(texts)
    assert [x.hypotheses[0].text for x in got] == [x.hypotheses[0].text for x in expected]
    alone = Translator(a, "latest", beam_size=1).translate(texts)
    assert [x.hypotheses[0].tokens for x in alone] != [x.hypotheses[0].tokens for x in expected]  # b counts
