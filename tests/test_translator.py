"""The front door for Python users, `jax_transformer.Translator`: loaded once, it gives what the functions beneath
it give (`translation.translations`, `scoring.score_pairs`, `documents.translate_document`) on the tests' saved
model; options of a call apply to that call alone; importing the package still loads no jax or torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jax_transformer.errors import ConfigError, UsageError
from tests.helpers.saved import load_saved_model, saved_run

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return saved_run(tmp_path_factory.mktemp("translator") / "run")


@pytest.fixture(scope="module")
def translator(run_dir):
    from jax_transformer import Translator

    return Translator(run_dir, "latest")


@pytest.fixture(scope="module")
def sentences():
    return list(load_saved_model("trained_tiny").source_texts[:12])


def _same(ours, theirs):
    assert [t.source for t in ours] == [t.source for t in theirs]
    for a, b in zip(ours, theirs):
        assert [h.tokens for h in a.hypotheses] == [h.tokens for h in b.hypotheses]
        assert [h.text for h in a.hypotheses] == [h.text for h in b.hypotheses]
        np.testing.assert_array_equal([h.score for h in a.hypotheses], [h.score for h in b.hypotheses])


def test_translate_gives_what_translations_gives(translator, sentences):
    from jax_transformer.decoding.translation import translations

    decode = translator.decode.replace(beam_size=3, n_best=2)
    found = translator.translate(sentences, beam_size=3, n_best=2)
    _same(found, translations(translator.params, translator.config, translator.tokenizer, sentences, decode))
    assert all(len(t.hypotheses) == 2 for t in found)
    assert all(t.hypotheses[0].score >= t.hypotheses[1].score for t in found)


def test_options_of_a_call_apply_to_it_alone(translator, sentences):
    before = translator.decode
    wide = translator.translate(sentences, beam_size=3, n_best=2)  # the decoders of the test above: no new ones
    assert translator.decode == before and all(len(t.hypotheses) == 2 for t in wide)
    again = translator.translate(sentences)
    assert all(len(t.hypotheses) == 1 for t in again)
    assert translator.decoding(beam_size=1).beam_size == 1 and translator.decoding() == before


def test_constructor_options_are_every_calls_decoding(run_dir, translator, sentences):
    from jax_transformer import Translator

    wide = Translator(run_dir, "latest", beam_size=3, n_best=2)
    assert (wide.decode.beam_size, wide.decode.n_best) == (3, 2)
    _same(wide.translate(sentences), translator.translate(sentences, beam_size=3, n_best=2))


def test_prefixes_begin_the_translations(translator, sentences):
    prefixes = [None, translator.translate(sentences[1:2])[0].text.split(" ")[0]]
    found = translator.translate(sentences[:2], prefixes=prefixes)
    assert found[1].prefix == prefixes[1] and found[1].text.startswith(prefixes[1])


def test_a_bad_option_names_itself(translator):
    with pytest.raises(ConfigError, match="--n-best 9: more than the 4 hypotheses"):
        translator.translate(["un"], n_best=9)
    with pytest.raises(ConfigError, match="options.beam_size does not apply to sampling"):
        translator.translate(["un"], do_sample=True, beam_size=2)


def test_score_gives_what_score_pairs_gives(translator, sentences):
    from jax_transformer.decoding.scoring import score_pairs

    targets = [t.text for t in translator.translate(sentences)]
    ours = translator.score(sentences, targets)
    theirs = score_pairs(translator.params, translator.config, translator.tokenizer, sentences, targets)
    assert [s.tokens for s in ours] == [s.tokens for s in theirs]
    np.testing.assert_array_equal([s.score for s in ours], [s.score for s in theirs])
    np.testing.assert_allclose([s.score for s in ours], [sum(s.token_scores) for s in ours], rtol=1e-5)


def test_a_document_keeps_its_layout(translator, sentences):
    pytest.importorskip("sentencex")
    text = f"{sentences[0]}.  {sentences[1]}.\n\n\t{sentences[2]}.\n"
    translated = translator.translate_document(text)
    assert translated.count("\n\n\t") == 1 and translated.endswith(".\n") or translated.endswith("\n")
    from jax_transformer.decoding import documents

    pieces = translator.segmenter().pieces(text)
    best = translator.translate([p for p, sentence in pieces if sentence])
    expected = iter(t.text for t in best)
    assert translated == "".join(next(expected) if sentence else p for p, sentence in pieces)
    assert isinstance(translator.segmenter(), documents.Segmenter)


def test_a_document_takes_one_translation(translator):
    with pytest.raises(UsageError, match="one translation of each sentence"):
        translator.translate_document("un. deux.", n_best=2, beam_size=2)


def test_importing_the_package_loads_no_jax_until_the_front_door_is_used():
    code = (
        "import sys, jax_transformer\n"
        "assert 'jax' not in sys.modules and 'torch' not in sys.modules, 'imported too early'\n"
        "from jax_transformer import Translator\n"
        "assert 'jax' in sys.modules and Translator.__name__ == 'Translator'\n"
        "assert 'Translator' in jax_transformer.__all__\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=120)
