"""Many language pairs in one run (`--language-columns`: `src_lang<TAB>tgt_lang<TAB>source<TAB>target` lines) for a
multilingual model: each sentence is marked with its own pair's codes as transformers' tokenizer marks it for that
pair (so every training row is teacher-forced into its own target language); the validation sentences of each pair
are decoded with that pair's code forced first, and BLEU/chrF are reported per pair and overall, sacreBLEU's
statistics of the pairs adding up to the whole. Bad codes and bad lines are errors naming the line, before any step.
A tiny random NLLB model (tests/helpers/multilingual.py), nothing downloaded."""

from __future__ import annotations

import json

import numpy as np
import pytest
from sacrebleu.metrics import BLEU, CHRF

from jax_transformer.checkpoint import manager as checkpoint
from jax_transformer.data import token_arrays
from jax_transformer.data.batching import encode_corpus
from jax_transformer.data.corpus import Fingerprint, corpus_fingerprint, read_tsv
from jax_transformer.data.default_task import number_pair
from jax_transformer.decoding import loading
from jax_transformer.decoding.translation import translations
from jax_transformer.errors import DataError
from jax_transformer.interop import hub
from tests.helpers.training import run_main

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

EN_FR, FR_EN = ("eng_Latn", "fra_Latn"), ("fra_Latn", "eng_Latn")


def lines(numbers) -> list[str]:
    """Each number's pair, English -> French for even numbers and French -> English for odd ones."""
    out = []
    for n in numbers:
        english, french = number_pair(n)
        out.append("\t".join((*EN_FR, english, french) if n % 2 == 0 else (*FR_EN, french, english)))
    return out


def write(path, rows: list[str]):
    path.write_text("".join(row + "\n" for row in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """(save_pretrained folder, run directory `import` wrote) of a tiny random NLLB model."""
    from tests.helpers.multilingual import TOKENIZERS, model_vocab_size, tiny_model

    folder = tmp_path_factory.mktemp("nllb")
    tiny_model("nllb", model_vocab_size("nllb", TOKENIZERS["nllb"](folder))).save_pretrained(folder)
    run = tmp_path_factory.mktemp("nllb_run") / "run"  # a folder of its own: other modules import beside it
    return folder, hub.import_model(folder, run, print_fn=lambda line: None)


def test_each_pair_is_encoded_with_its_own_codes_as_transformers_does(imported, tmp_path):
    from transformers import AutoTokenizer

    folder, run = imported
    tokenizer = checkpoint.load(run, "best").tokenizer
    path = write(tmp_path / "pairs.tsv", lines(range(40, 52)))
    corpus = read_tsv(path, language_columns=True)
    assert corpus.languages == [EN_FR if n % 2 == 0 else FR_EN for n in range(40, 52)]
    assert "12 pairs in 2 language pairs (eng_Latn-fra_Latn 6, fra_Latn-eng_Latn 6)" in corpus.describe()
    in_memory = encode_corpus(corpus, tokenizer, max_len=64)
    on_disk = token_arrays.open_encoded(
        [path], tokenizer, language_columns=True, cache_dir=tmp_path / "cache", print_fn=lambda _: None
    ).encoded(64, "error", in_memory.ids)
    theirs = AutoTokenizer.from_pretrained(folder)
    for i, (source, target, (src_lang, tgt_lang)) in enumerate(zip(corpus.sources, corpus.targets, corpus.languages)):
        theirs.src_lang, theirs.tgt_lang = src_lang, tgt_lang
        expected = theirs(source, text_target=target)
        # Theirs: [src code] pieces </s> and labels [tgt code] pieces </s>; the target's </s> is added by batching.
        assert in_memory.src[i].tolist() == expected["input_ids"], i
        assert in_memory.tgt[i].tolist() == expected["labels"][:-1], i
        assert (on_disk.src[i].tolist(), on_disk.tgt[i].tolist()) == (expected["input_ids"], expected["labels"][:-1])
    # The codes are part of what a resume compares: the same text in other pairs is other data.
    plain = Fingerprint()
    for source, target in zip(corpus.sources, corpus.targets):
        plain.add(source, target)
    assert corpus_fingerprint(corpus) != plain.hexdigest()


def test_two_pairs_train_decode_each_into_its_own_language_and_score_per_pair(imported, tmp_path):
    _, run = imported
    train = write(tmp_path / "train.tsv", lines(range(100, 260)))
    valid_lines = lines(range(1000, 1012))
    valid = write(tmp_path / "valid.tsv", valid_lines)
    args = ["train", "--init-from", str(run), "--tsv", str(train), "--valid-tsv", str(valid), "--language-columns"]
    args += ["--steps", "4", "--warmup-steps", "2", "--max-tokens", "512", "--eval-every", "4", "--beam-size", "2"]
    args += ["--samples", "0", "--no-progress", "--run-dir", str(tmp_path / "tuned")]
    code, out, err = run_main(args)
    assert code == 0, out + err
    assert "in 2 language pairs (eng_Latn-fra_Latn 80, fra_Latn-eng_Latn 80)" in out + err
    final = [json.loads(r) for r in (tmp_path / "tuned" / "metrics.jsonl").read_text().splitlines()]
    final = next(r for r in final if r["kind"] == "eval" and r["final"])
    assert final["sentences/eng_Latn-fra_Latn"] == final["sentences/fra_Latn-eng_Latn"] == 6
    assert "per language pair: eng_Latn-fra_Latn BLEU" in out

    hypotheses_file = tmp_path / "hypotheses.txt"
    args = ["evaluate", "--checkpoint", str(tmp_path / "tuned"), "--step", "latest", "--tsv", str(valid)]
    code, out, err = run_main([*args, "--language-columns", "--beam-size", "2", "--output", str(hypotheses_file)])
    assert code == 0, out + err
    result = json.loads(out.strip().splitlines()[-1])
    hypotheses = hypotheses_file.read_text(encoding="utf-8").splitlines()
    rows = [row.split("\t") for row in valid_lines]
    assert result["bleu"] == pytest.approx(final["bleu"]) and result["chrf/fra_Latn-eng_Latn"] == pytest.approx(
        final["chrf/fra_Latn-eng_Latn"]
    )  # the final evaluation of the run decodes as evaluate does

    # sacreBLEU's sufficient statistics (n-gram matches and totals, lengths; chrF's character and word n-grams),
    # read through its own extraction, which corpus_score sums (sacrebleu is pinned in .ci/constraints.txt).
    references = [[r[3] for r in rows]]
    stats = {name: cls()._extract_corpus_statistics(hypotheses, references) for name, cls in METRICS.items()}
    summed = {name: np.zeros_like(np.sum(s, axis=0)) for name, s in stats.items()}
    for pair in (EN_FR, FR_EN):
        picked = [i for i, r in enumerate(rows) if tuple(r[:2]) == pair]
        # Decoded on their own, into their own language: the pair's code is every translation's first token.
        loaded = loading.load(tmp_path / "tuned", "latest", languages=dict(zip(("src_lang", "tgt_lang"), pair)))
        sources = [rows[i][2] for i in picked]
        found = translations(loaded.params, loaded.config, loaded.tokenizer, sources, _decode(loaded), progress=False)
        assert [t.hypotheses[0].tokens[0] for t in found] == [loaded.tokenizer.codes[pair[1]]] * len(picked)
        assert [t.hypotheses[0].text for t in found] == [hypotheses[i] for i in picked]
        hyps, refs = [hypotheses[i] for i in picked], [[rows[i][3] for i in picked]]
        name = "-".join(pair)
        for metric, cls in METRICS.items():
            assert result[f"{metric}/{name}"] == pytest.approx(cls().corpus_score(hyps, refs).score, abs=1e-9)
            summed[metric] += np.sum(cls()._extract_corpus_statistics(hyps, refs), axis=0)
    # Per-pair figures add up to the whole: the pairs' statistics sum to the corpus's, which give the overall scores.
    for metric, cls in METRICS.items():
        assert summed[metric].tolist() == np.sum(stats[metric], axis=0).tolist()
        assert result[metric] == pytest.approx(cls()._compute_score_from_stats(summed[metric].tolist()).score, abs=1e-9)


METRICS = {"bleu": BLEU, "chrf": CHRF}


def _decode(loaded):
    from jax_transformer.settings.config import DecodeConfig

    return DecodeConfig.from_dict(loaded.run["decode"]).replace(beam_size=2, n_best=1)


@pytest.mark.parametrize(
    "row, message",
    [
        (
            "eng_Latn\tfra_Lat\tone\tun",
            "train.tsv, line 3: the target language column 'fra_Lat' is not a language code of this tokenizer "
            "(closest: fra_Latn",
        ),
        ("eng_Latn\tfra_Latn\tone", "train.tsv, line 3: expected src_lang<TAB>tgt_lang<TAB>source<TAB>target"),
        ("\tfra_Latn\tone\tun", "train.tsv, line 3: the first column (source language) is '', not a language code"),
    ],
)
def test_bad_lines_are_named_before_any_step(imported, tmp_path, row, message):
    _, run = imported
    rows = lines(range(100, 110))
    rows[2] = row
    args = ["train", "--init-from", str(run), "--tsv", str(write(tmp_path / "train.tsv", rows)), "--language-columns"]
    code, out, err = run_main([*args, "--steps", "1", "--run-dir", str(tmp_path / "t")])
    assert code == 1 and message in err, out + err
    assert not (tmp_path / "t" / "checkpoints").exists()


def test_language_columns_need_a_tsv_and_a_multilingual_model(tmp_path):
    tsv = write(tmp_path / "train.tsv", lines(range(100, 110)))
    code, out, err = run_main(["train", "--tsv", str(tsv), "--language-columns", "--run-dir", str(tmp_path / "a")])
    assert code == 1 and "a model trained from scratch gets a joint SentencePiece tokenizer" in err, out + err
    text = tmp_path / "x.txt"
    text.write_text("one\n", encoding="utf-8")
    args = ["train", "--src", str(text), "--tgt", str(text), "--language-columns", "--run-dir", str(tmp_path / "b")]
    code, out, err = run_main(args)
    assert code == 1 and "--language-columns: the training pairs must be a TSV file (--tsv)" in err, out + err
    with pytest.raises(DataError, match="language columns need a multilingual model's tokenizer"):
        encode_corpus(read_tsv(tsv, language_columns=True), checkpoint_free_tokenizer(), max_len=64)


def checkpoint_free_tokenizer():
    """This project's joint SentencePiece tokenizer, trained on the built-in task (it has no language codes)."""
    from jax_transformer.data.default_task import default_pairs
    from jax_transformer.data.tokenizer import Tokenizer

    pairs = default_pairs("train", n=300)
    return Tokenizer.train(list(pairs.sources) + list(pairs.targets), vocab_size=100)


def test_part_of_a_file_grouped_by_pair_still_evaluates_every_pair():
    from jax_transformer.decoding.evaluation import first_rows

    languages = [EN_FR] * 5 + [FR_EN] * 3  # a validation file grouped by pair
    assert first_rows(languages, 4) == [0, 1, 5, 6]  # --eval-sentences 4: two of each, not the first pair alone
    assert first_rows(languages, 7) == [0, 1, 2, 3, 5, 6, 7]
    assert first_rows(languages, 20) == list(range(8)) and first_rows(None, 3) == [0, 1, 2]
