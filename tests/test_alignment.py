"""Word alignments from cross-attention (`decoding.alignment`, the search's `alignment_layer`): the positions the
search keeps are the argmax of the PyTorch twin's cross-attention of the same layer, averaged over heads and
teacher-forced on the decoded tokens; turning them on changes no token; the word mapping on hand-made sentences;
the command line's outputs; a layer the model lacks named before anything is decoded. The same against
transformers' own cross-attentions on imported models: tests/helpers/alignments.py, called by
parity_tests/test_pretrained.py (Marian) and parity_tests/test_multilingual.py (NLLB, mBART)."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
import torch

from jax_transformer.decoding import alignment, decoders
from jax_transformer.decoding import schedule as schedules
from jax_transformer.errors import ConfigError, UsageError
from jax_transformer.settings.config import DecodeConfig
from tests.helpers.configs import PARITY_CONFIGS
from tests.helpers.training import run_main
from tests.helpers.twins import t, torch_twin

CONFIG = PARITY_CONFIGS["pretrained_variants"].replace(max_len=24)  # decoder start 0 = PAD, as Marian's


def _sources(config, rows: int, width: int, seed: int = 0) -> np.ndarray:
    """Right-padded random sources of several lengths, each ending with EOS."""
    rng = np.random.default_rng(seed)
    src = np.full((rows, width), config.pad_id, np.int32)
    for r, n in enumerate(rng.integers(3, width + 1, rows)):
        src[r, : n - 1] = rng.integers(4, config.src_vocab_size, n - 1)
        src[r, n - 1] = config.eos_id
    return src


def _twin_argmax(twin, config, src, tokens, layer: int) -> np.ndarray:
    """(B, L): the argmax of the twin's layer-`layer` cross-attention averaged over heads, teacher-forced on
    `tokens` (B, L), over the source positions that are not PAD or EOS (fairseq's rule)."""
    tgt_in = np.concatenate([np.full((len(tokens), 1), config.start_id), tokens[:, :-1]], axis=1).astype(np.int32)
    with torch.no_grad(), twin.record_attention() as maps:
        twin(t(src), t(tgt_in))
    probs = maps[f"decoder/layer_{layer}/cross_attention"].mean(dim=1).cpu().numpy()  # (B, L, S)
    words = (src != config.pad_id) & (src != config.eos_id)
    return np.where(words[:, None, :], probs, -1.0).argmax(axis=-1)


@pytest.fixture(scope="module")
def twins():
    """Fresh params with EOS raised so outputs end at several lengths (its logit bias halfway between two rows'
    step-0 margins, as `twins.eos_biased` does for an output projection's), and the twin holding them."""
    from jax_transformer.model.transformer import Transformer, init_params

    params = jax.jit(init_params, static_argnums=(0, 1))(CONFIG, 0)  # one program: faster than op by op, the same
    src = _sources(CONFIG, 8, 10)
    first = jax.jit(lambda p, s, t: Transformer(CONFIG).apply({"params": p}, s, t)[:, 0])
    with jax.default_matmul_precision("highest"):
        log_probs = np.asarray(jax.nn.log_softmax(first(params, src, np.full((8, 1), CONFIG.start_id, np.int32))))
    eos = CONFIG.eos_id
    margin = np.sort(np.delete(log_probs, eos, axis=1).max(axis=1) - log_probs[:, eos])
    params = {**params, "logits_bias": params["logits_bias"].at[eos].add((margin[3] + margin[4]) / 2)}
    return params, torch_twin(CONFIG, params)


def _check_against_twin(found, twin, src, layer):
    real = found.tokens != CONFIG.pad_id  # (B, n, L): the tokens of each hypothesis, EOS included
    assert (found.alignments[~real] == -1).all()  # nothing beyond a hypothesis's end
    for k in range(found.tokens.shape[1]):
        expected = _twin_argmax(twin, CONFIG, src, found.tokens[:, k], layer)  # (B, L)
        # Exact: an argmax over float32 probabilities that agree to ~1e-6; a wrong row, step or gather moves it.
        assert np.array_equal(np.where(real[:, k], found.alignments[:, k], -1), np.where(real[:, k], expected, -1))


@pytest.mark.slow
def test_beam_search_alignments_are_the_twins_cross_attention_argmax(twins):
    """Beam search of 2, both hypotheses, on the CPU's schedule (rows leave the batch, the cache grows between
    programs), two rows from a target prefix: each token's position is the twin's argmax of layer 0 (not the
    default, the last), teacher-forced on the hypothesis; the tokens, scores and per-token log-probs are those of
    the search without alignments, bit for bit."""
    params, twin = twins
    src = _sources(CONFIG, 8, 10)
    prefixes = [None, [7, 9], None, None, [11], None, None, None]
    schedule = schedules.Scheduled(split=False)
    assert len(schedule.plan(8, 2, decoders.output_length(10, CONFIG)).programs) > 1  # shrinks and grows
    with jax.default_matmul_precision("highest"):
        off = decoders.gnmt_decoder(CONFIG, 10, beam_size=2, n_best=2)(params, src, schedule, prefixes)
        aligned = decoders.gnmt_decoder(CONFIG, 10, beam_size=2, n_best=2, alignment_layer=0)
        on = aligned(params, src, schedule, prefixes)
    assert off.alignments is None
    for name in ("tokens", "scores", "token_scores", "found"):
        assert np.array_equal(getattr(off, name), getattr(on, name)), name
    lengths = (on.tokens[:, 0] != CONFIG.pad_id).sum(axis=1)
    assert len(set(lengths.tolist())) >= 3  # hypotheses that end at several lengths
    _check_against_twin(on, twin, src, 0)


def test_sampled_alignments_are_the_twins(twins):
    """Sampling (greedy search's loop, a drawn token), two samples a sentence, each a row of its own: the twin's
    argmax for each."""
    params, twin = twins
    src = _sources(CONFIG, 4, 10, seed=2)
    sample = DecodeConfig(do_sample=True, temperature=2.0, n_best=2, alignments=True, alignment_layer=0)
    with jax.default_matmul_precision("highest"):
        on = decoders.decoder(CONFIG, sample, 10)(params, src, schedules.Whole())
    assert not np.array_equal(on.tokens[:, 0], on.tokens[:, 1])
    _check_against_twin(on, twin, src, 0)
    # Teacher-forced scoring's alignments (`score --alignments`) of the same tokens: the same positions.
    tokens = on.tokens[:, 0]
    tgt_in = np.concatenate([np.full((len(tokens), 1), CONFIG.start_id), tokens[:, :-1]], axis=1)
    with jax.default_matmul_precision("highest"):
        forced = alignment.teacher_forced_alignments(params, CONFIG, 0, src, tgt_in)
    real = tokens != CONFIG.pad_id
    assert np.array_equal(np.where(real, forced, -1), np.where(real, on.alignments[:, 0], -1))


class Pieces:
    """A tokenizer of given pieces: id i is pieces[i]; the language codes `codes`."""

    def __init__(self, pieces, codes=()):
        self.pieces, self.codes = pieces, {p: pieces.index(p) for p in codes}

    def piece(self, index, side="target"):
        return self.pieces[index]


def test_subwords_map_to_words_and_pairs_to_pharaoh():
    """SentencePiece's ▁ and BPE's </w> start words; PAD, EOS, BOS and language codes are none; a word pair for
    every subword pair, each once, sorted."""
    config = CONFIG  # pad 0, bos 1, eos 2
    pieces = ["<pad>", "<s>", "</s>", "eng", "fra", "▁the", "▁cat", "s", "▁sleep", "▁les", "▁chat", "▁dor", "ment"]
    sp = Pieces(pieces, codes=("eng", "fra"))
    source = [3, 5, 6, 7, 8, 2]  # eng ▁the ▁cat s ▁sleep </s>
    target = [4, 9, 10, 11, 12, 2]  # fra ▁les ▁chat ▁dor ment </s>
    assert alignment.word_indices(sp, source, "source", config) == [-1, 0, 1, 1, 2, -1]
    assert alignment.word_indices(sp, target, "target", config) == [-1, 0, 1, 2, 2, -1]
    # The forced code aligned to "the", "les" to "the", "chat" to "cats"' two pieces' first, "dor" to the source
    # code (no word), "ment" to "sleep", EOS to "cat".
    aligned = [1, 1, 3, 0, 4, 2]
    assert alignment.sentence_alignment(sp, config, source, target, aligned) == "0-0 1-1 2-2"
    assert alignment.word_pairs([0, 1, 1, 2], [0, 0, 1, -1], [2, 1, 3, 0]) == [(1, 0), (2, 1)]
    bpe = Pieces(["<pad>", "<s>", "</s>", "un", "believ", "able</w>", "cat</w>", "s</w>"])
    assert alignment.word_indices(bpe, [3, 4, 5, 6, 7, 2], "source", config) == [0, 0, 0, 1, 2, -1]
    marian = Pieces(["<pad>", "<s>", "</s>", ">>fr<<", "▁a", "b"])
    assert alignment.word_indices(marian, [3, 5, 4, 5, 2], "source", config) == [-1, 0, 1, 1, -1]
    assert alignment.pharaoh([(0, 0), (2, 1)]) == "0-0 2-1"


def test_a_layer_the_model_lacks_is_named_before_decoding():
    decode = DecodeConfig(alignments=True, alignment_layer=2)
    with pytest.raises(ConfigError, match="decode field 'alignment_layer' is 2 .*2 decoder layers"):
        decoders.decoder(CONFIG, decode, 10)
    assert DecodeConfig(alignments=True, alignment_layer=-2).aligned_layer(CONFIG) == 0
    assert DecodeConfig(alignment_layer=7).aligned_layer(CONFIG) is None  # no alignments asked for: no check


@pytest.mark.slow
def test_translate_and_score_write_alignments(tiny_run, tmp_path):
    """translate --alignments: a jsonl "alignment" per hypothesis and a fifth tsv column, the same pairs; score
    --alignments of the best translation gives its pairs again (teacher forcing, the same layer); `Translator`'s
    translate and score the same; text output and a layer the model lacks refused before anything is written."""
    from jax_transformer.checkpoint import manager as ckpt_lib
    from jax_transformer.decoding.translation import Hypothesis, Translation, format_translation
    from jax_transformer.decoding.translator import Translator

    run, _ = tiny_run
    path = tmp_path / "input.txt"
    path.write_text("one hundred\n\ntwo thousand and five\n", encoding="utf-8")
    args = ["translate", "--checkpoint", str(run), "--input", str(path), "--beam-size", "2", "--n-best", "2"]
    code, out, err = run_main([*args, "--alignments", "--output-format", "jsonl"])
    assert code == 0, out + err
    records = [json.loads(line) for line in out.splitlines()]
    pairs = [[h["alignment"] for h in r["hypotheses"]] for r in records]
    assert len(pairs[0]) == 2 and pairs[1] == [] and all(isinstance(p, str) for p in pairs[0] + pairs[2])
    loaded = ckpt_lib.load(run, "latest")
    for record, ps in zip(records, pairs):
        for h, p in zip(record["hypotheses"], ps):
            n_source = len(loaded.tokenizer.pieces(record["source"]))
            for i, j in (map(int, pair.split("-")) for pair in p.split()):
                assert 0 <= i < n_source and 0 <= j < len(h["tokens"])
    code, out, err = run_main([*args, "--alignments", "--output-format", "tsv"])
    assert code == 0, out + err
    rows = [line.split("\t") for line in out.splitlines()]
    assert [r[4] for r in rows if r[0] != "2"] == pairs[0] + pairs[2] and rows[2] == ["2", "", "", "", ""]
    plain = Translation("one", [Hypothesis("un", [5], -1.0, [-1.0], None)])  # without the flag, records as before
    assert "alignment" not in format_translation(plain, 1, "jsonl")[0]
    assert format_translation(plain, 1, "tsv") == ["1\t1\t-1\tun"]

    pairs_path = tmp_path / "pairs.tsv"
    best = [r["hypotheses"][0]["text"] for r in (records[0], records[2])]
    pairs_path.write_text(f"one hundred\t{best[0]}\ntwo thousand and five\t{best[1]}\n", encoding="utf-8")
    score = ["score", "--checkpoint", str(run), "--tsv", str(pairs_path), "--alignments"]
    code, out, err = run_main([*score, "--output-format", "jsonl"])
    assert code == 0, out + err
    scored = [json.loads(line) for line in out.splitlines()]
    for s in scored:  # (the tokens of a text need not be those the search chose: the model's own segmentation)
        for i, j in (map(int, pair.split("-")) for pair in s["alignment"].split()):
            assert 0 <= i < len(s["tokens"]) and 0 <= j < len(s["tokens"])
    code, out, err = run_main([*score, "--output-format", "tsv"])
    assert code == 0 and [line.split("\t")[4] for line in out.splitlines()] == [s["alignment"] for s in scored]

    # The Python front door, on the same sentences (the same programs): the same pairs.
    translator = Translator(run, "latest")
    sentences = ["one hundred", "two thousand and five"]
    found = translator.translate(sentences, beam_size=2, n_best=2, alignments=True)
    assert [[h.alignment for h in t.hypotheses] for t in found] == [pairs[0], pairs[2]]
    assert [s.alignment for s in translator.score(sentences, best, alignments=True)] == [s["alignment"] for s in scored]
    assert translator.score(sentences, best)[0].alignment is None
    with pytest.raises(ConfigError, match="alignment_layer"):
        translator.translate(["one"], alignments=True, alignment_layer=-9)
    with pytest.raises(UsageError, match="--output-format tsv"):
        translator.translate_lines(["one"], print, decode=DecodeConfig(alignments=True))

    for argv, message in (
        ([*args, "--alignments"], "--alignments writes each hypothesis's word pairs beside it"),
        ([*args, "--alignments", "--alignment-layer", "5", "--output-format", "tsv"], "'alignment_layer' is 5"),
        ([*score, "--output-format", "text"], "score: --alignments needs --output-format tsv or jsonl"),
    ):
        code, out, err = run_main(argv)
        assert code in (1, 2) and message in err and out == "", err


def test_a_service_compiles_alignments_when_allowed():
    """Alignments on or off is part of a program: a service runs them only where --allow lists them (its set is
    compiled at start); the layer counted from either end is one program."""
    from jax_transformer.serving.programs import Allowed, parse_allow, signature

    base = DecodeConfig(beam_size=2)
    widths = (16,)
    assert signature(CONFIG, base.replace(alignments=True), widths) != signature(CONFIG, base, widths)
    last, top = (base.replace(alignments=True, alignment_layer=i) for i in (-1, CONFIG.num_decoder_layers - 1))
    assert signature(CONFIG, last, widths) == signature(CONFIG, top, widths)
    allowed = Allowed(CONFIG, base, parse_allow("alignments=true"))
    assert len(allowed.decodes) == 2 and allowed.fault(last, {"alignments": True}, "options") is None
    refused = Allowed(CONFIG, base, {}).fault(last, {"alignments": True}, "options")
    assert refused.startswith("options.alignments True: this service does not run it")
