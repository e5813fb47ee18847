"""Pretrained models through the command line: `train.py import` a transformers directory, `translate` as its
generate does, `export --format transformers` back (the same weights, tokenizer and generation settings, which
CTranslate2 converts), fine-tune with `train --init-from` and export the result; this project's own model written
as a MarianMTModel; and the messages for what cannot be imported or exported. Logit and token parity against
transformers is parity_tests/test_pretrained.py; this file is about the files and the commands."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from jax_transformer.checkpoint import manager as ckpt_lib
from jax_transformer.checks import check_batch
from jax_transformer.data.default_task import default_pairs
from jax_transformer.decoding.decoders import generate
from jax_transformer.errors import DataError, TokenError, UsageError
from jax_transformer.interop import hub
from jax_transformer.settings.config import DecodeConfig
from tests.helpers.pretrained import assert_same_logits, end_at_various_lengths, marian_tokenizer_files, tiny_marian
from tests.helpers.saved import load_saved_model
from tests.helpers.training import run_main, write_corpus

pytest.importorskip("transformers")

SENTENCES = list(default_pairs("valid", n=12).sources)
ATOL = 1e-5  # float32 logits, as parity_tests/test_forward_parity.py justifies


def _marian_dir(folder):
    """A tiny MarianMTModel as a save_pretrained directory with a generation_config.json of an OPUS-MT model's
    kind: beam search, the pad id banned, EOS forced at the limit."""
    from transformers import GenerationConfig, MarianTokenizer

    sizes = marian_tokenizer_files(folder)
    model = tiny_marian(sizes)
    batch = MarianTokenizer.from_pretrained(folder)(SENTENCES, return_tensors="pt", padding=True)
    end_at_various_lengths(model, batch["input_ids"], batch["attention_mask"], 24)
    model.generation_config = GenerationConfig(
        num_beams=4,
        max_length=24,
        bad_words_ids=[[sizes["pad"]]],
        decoder_start_token_id=sizes["pad"],
        eos_token_id=sizes["eos"],
        pad_token_id=sizes["pad"],
        forced_eos_token_id=sizes["eos"],
    )
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    root = tmp_path_factory.mktemp("pretrained")
    source = _marian_dir(root / "hf")
    code, out, err = run_main(["import", str(source), "--output", str(root / "run")])
    assert code == 0, out + err
    # Every weight of the model comes over (its sinusoidal positions are computed, not imported), its logits bias
    # (a buffer in transformers) too. Counted from the model itself: the pieces SentencePiece trains for the tiny
    # vocabulary differ between its versions, and with them the vocabulary's size.
    from transformers import MarianMTModel

    model = MarianMTModel.from_pretrained(source)
    weights = sum(p.numel() for name, p in model.named_parameters() if "embed_positions" not in name)
    assert "imported marian model" in out and f"{weights + model.final_logits_bias.numel():,} parameters" in out
    return root, source, root / "run"


def _hf_translate(folder, sentences, **options):
    from transformers import MarianMTModel, MarianTokenizer

    tokenizer = MarianTokenizer.from_pretrained(folder)
    model = MarianMTModel.from_pretrained(folder, attn_implementation="eager").eval()
    with torch.no_grad():
        out = model.generate(**tokenizer(sentences, return_tensors="pt", padding=True), **options)
    return tokenizer.batch_decode(out, skip_special_tokens=True)


@pytest.mark.slow
def test_import_then_translate_as_transformers_generates(imported):
    """The run directory decodes as the model's generation_config says (beam 4, pad banned, EOS forced):
    `translate` prints the text transformers' generate + decode gives."""
    root, source, run = imported
    loaded = ckpt_lib.load(run, "latest")
    stored = loaded.run
    assert stored["imported_from"]["family"] == "marian"
    assert stored["decode"]["beam_size"] == 4 and stored["decode"]["rules"] == "transformers"
    (root / "in.txt").write_text("\n".join(SENTENCES) + "\n", encoding="utf-8")
    code, out, err = run_main(["translate", "--checkpoint", str(run), "--input", str(root / "in.txt")])
    assert code == 0, out + err
    ours = out.splitlines()
    theirs = _hf_translate(source, SENTENCES)
    assert ours == theirs
    assert len({len(t.split()) for t in theirs}) >= 2  # outputs of several lengths
    # transformers' repetition controls, from the command line (its generate's own arguments of the same names).
    flags = ["--repetition-penalty", "1.4", "--no-repeat-ngram-size", "2"]
    code, out, err = run_main(["translate", "--checkpoint", str(run), "--input", str(root / "in.txt"), *flags])
    assert code == 0, out + err
    assert out.splitlines() == _hf_translate(source, SENTENCES, repetition_penalty=1.4, no_repeat_ngram_size=2)
    assert out.splitlines() != theirs


def test_export_gives_back_the_same_model_files(imported, tmp_path):
    """export --format transformers: every weight bit for bit, the tokenizer's files byte for byte, and the
    generation settings, as from_pretrained reads them; CTranslate2 converts the directory and decodes greedily the
    tokens this project's generate gives."""
    from transformers import GenerationConfig, MarianMTModel

    _, source, run = imported
    exported = tmp_path / "exported"
    code, out, err = run_main(
        ["export", "--checkpoint", str(run), "--format", "transformers", "--output", str(exported)]
    )
    assert code == 0, out + err
    assert "MarianMTModel" in out
    original = MarianMTModel.from_pretrained(source, attn_implementation="eager").state_dict()
    again = MarianMTModel.from_pretrained(exported, attn_implementation="eager").state_dict()
    assert original.keys() == again.keys()
    assert all(torch.equal(original[k], again[k]) for k in original), [
        k for k in original if not torch.equal(original[k], again[k])
    ]
    for name in ("source.spm", "target.spm", "vocab.json"):
        assert (exported / name).read_bytes() == (source / name).read_bytes(), name
    a, b = GenerationConfig.from_pretrained(source), GenerationConfig.from_pretrained(exported)
    fields = ("num_beams", "max_length", "bad_words_ids", "forced_eos_token_id", "decoder_start_token_id")
    for field in (*fields, "repetition_penalty", "no_repeat_ngram_size"):
        assert getattr(a, field) == getattr(b, field), field

    ctranslate2 = pytest.importorskip("ctranslate2")
    ctranslate2.converters.TransformersConverter(str(exported)).convert(str(tmp_path / "ct2"))
    loaded = ckpt_lib.load(run, "latest")
    tokenizer = loaded.tokenizer
    rows = [tokenizer.encode(s) + [tokenizer.eos_id] for s in SENTENCES]
    translator = ctranslate2.Translator(str(tmp_path / "ct2"), device="cpu", compute_type="float32")
    results = translator.translate_batch(
        [[tokenizer.piece(i) for i in row] for row in rows], beam_size=1, max_decoding_length=22, min_decoding_length=0
    )
    src = np.full((len(rows), max(map(len, rows))), loaded.config.pad_id, np.int32)
    for r, row in enumerate(rows):
        src[r, : len(row)] = row
    ours = generate(loaded.params, loaded.config, src, max_length=24, banned=(loaded.config.pad_id,), forced_eos=True)
    ours = [[tokenizer.piece(i) for i in row if i not in (loaded.config.pad_id, loaded.config.eos_id)] for row in ours]
    assert [r.hypotheses[0] for r in results] == ours


@pytest.mark.slow
def test_fine_tune_an_imported_model_and_export_it(imported, tmp_path):
    """train --init-from: the imported weights, tokenizer and decoding carry over, the loss falls on new data, the
    run resumes, and the fine-tuned model exports as a MarianMTModel that computes what the Flax model computes."""
    from transformers import MarianMTModel

    _, _, run = imported
    start = ckpt_lib.load(run, "latest")
    corpus = write_corpus(tmp_path)
    args = [
        "train",
        "--init-from",
        str(run),
        "--tsv",
        str(corpus),
        "--steps",
        "12",
        "--warmup-steps",
        "10",
        "--lr-scale",
        "0.3",
    ]
    args += ["--max-tokens", "512", "--eval-every", "1000", "--save-every", "1000", "--eval-sentences", "0"]
    args += ["--samples", "0", "--no-progress", "--run-dir", str(tmp_path / "tuned")]
    code, out, err = run_main(args)
    assert code == 0, out + err
    assert "starting from" in out
    tuned = ckpt_lib.load(tmp_path / "tuned", "latest")
    assert tuned.step == 12 and tuned.config == start.config
    assert tuned.tokenizer.to_bytes() == start.tokenizer.to_bytes()
    assert tuned.run["imported_from"] == start.run["imported_from"]
    decodes = [DecodeConfig.from_dict(c.run["decode"]) for c in (tuned, start)]  # the start's: what it imported
    assert decodes[0] == decodes[1] and decodes[0].beam_size == 4
    records = [json.loads(line) for line in (tmp_path / "tuned" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if r["kind"] == "train"]
    assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.5, losses  # it learned: not a frozen or reset model
    # The decoder's start vector (the pad row, zero in Marian) is still zero: Marian and CTranslate2 assume it.
    table = np.asarray(tuned.params["shared_embed"]["embedding"])
    assert not np.asarray(start.params["shared_embed"]["embedding"])[start.config.pad_id].any()
    assert not table[tuned.config.pad_id].any()

    code, out, err = run_main(["train", "--resume", str(tmp_path / "tuned"), "--steps", "14", "--no-progress"])
    assert code == 0, out + err  # a resume as for any run: the same data, settings and origin
    tuned = ckpt_lib.load(tmp_path / "tuned", "latest")
    assert tuned.step == 14 and tuned.run["imported_from"] == start.run["imported_from"]

    exported = tmp_path / "exported"
    code, out, err = run_main(
        ["export", "--checkpoint", str(tmp_path / "tuned"), "--format", "transformers", "--output", str(exported)]
    )
    assert code == 0, out + err
    model = MarianMTModel.from_pretrained(exported, attn_implementation="eager").eval()
    assert_same_logits(model, tuned.params, tuned.config, tuned.tokenizer, "fine-tuned Marian, exported")


def test_own_model_exports_as_marian(tmp_path):
    """This project's model (interleaved sinusoids, a BOS start token, no bias on tied logits) written as a
    MarianMTModel: its model dimension permuted to Marian's sinusoid halves, the missing biases as zeros: the same
    logits, and MarianTokenizer reads the SentencePiece model to the same ids."""
    from transformers import MarianMTModel, MarianTokenizer

    saved = load_saved_model("trained_tiny")
    run = {"decode": DecodeConfig().to_dict()}  # as a run stores them
    path, kind = hub.export_transformers(saved.params, saved.config, saved.tokenizer, run, tmp_path / "own")
    assert kind == "marian"
    model = MarianMTModel.from_pretrained(path, attn_implementation="eager").eval()
    assert_same_logits(model, saved.params, saved.config, saved.tokenizer, "own model as Marian")
    generation = json.loads((path / "generation_config.json").read_text())
    assert generation["num_beams"] == 4 and generation["max_length"] == saved.config.max_len + 1
    assert generation["bad_words_ids"] == [[saved.config.pad_id]]
    texts = list(saved.source_texts[:100])
    theirs = MarianTokenizer.from_pretrained(path)(texts)["input_ids"]
    assert theirs == [saved.tokenizer.encode(t) + [saved.config.eos_id] for t in texts]


def test_what_cannot_be_imported_or_exported_is_named(tmp_path):
    saved = load_saved_model("trained_tiny")
    with pytest.raises(UsageError, match="norm_first/final_norm/embedding_norm: Marian is post-norm"):
        hub.export_transformers(
            saved.params, saved.config.replace(norm_first=True, final_norm=True), saved.tokenizer, {}, tmp_path / "x"
        )
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text(json.dumps({"model_type": "bart"}))
    imports = r"this project imports 'marian', 'fsmt', 'm2m_100', 'mbart'"
    with pytest.raises(Exception, match=rf"bad/config.json: model_type 'bart'; {imports}"):
        hub.read_pretrained(tmp_path / "bad")
    dictionary = tmp_path / "dict.en.txt"
    dictionary.write_text("hello 5\nworld\n")
    with pytest.raises(DataError, match=r"dict.en.txt, line 2: expected '<symbol> <count>'"):
        hub._fairseq_dictionary(dictionary)
    with pytest.raises(UsageError, match="missing: no such file or directory"):
        hub.read_pretrained(tmp_path / "missing")
    with pytest.raises(UsageError, match="neither a transformers save_pretrained directory"):
        hub.read_pretrained(tmp_path)  # a folder without config.json


def test_packed_batches_of_a_decoder_that_starts_from_pad():
    """Marian's decoder starts from the pad id: in packed rows each target segment begins with a pad token, which
    the batch check accepts there and only there."""
    from jax_transformer.settings.config import TransformerConfig

    config = TransformerConfig(
        src_vocab_size=20, tgt_vocab_size=20, pad_id=19, eos_id=0, bos_id=None, decoder_start_id=19, max_len=8
    )
    batch = {
        "src": np.array([[5, 6, 0, 7, 0, 19]]),
        "src_segments": np.array([[1, 1, 1, 2, 2, 0]]),
        "src_positions": np.array([[0, 1, 2, 0, 1, 0]]),
        "tgt_in": np.array([[19, 8, 19, 9, 19, 19]]),
        "tgt_out": np.array([[8, 0, 9, 0, 19, 19]]),
        "tgt_segments": np.array([[1, 1, 2, 2, 0, 0]]),
        "tgt_positions": np.array([[0, 1, 0, 1, 0, 0]]),
    }
    check_batch(batch, config)
    bad = {**batch, "tgt_in": np.array([[19, 19, 19, 9, 19, 19]])}  # a pad inside segment 1
    with pytest.raises(TokenError, match=r"tgt_segments'\]\[0, 1\] = 1 is not 0 under a padding token"):
        check_batch(bad, config)


def test_the_repetition_controls_are_read_from_a_generation_config_and_written_back():
    """transformers' repetition_penalty and no_repeat_ngram_size: read at import (config.json or
    generation_config.json, the latter winning; unset or None is off), written on export only when on."""
    from jax_transformer.settings.config import preset

    read = hub.generation_settings({"no_repeat_ngram_size": 3, "repetition_penalty": 1.1}, {"repetition_penalty": 1.2})
    assert (read["repetition_penalty"], read["no_repeat_ngram_size"]) == (1.2, 3)
    off = hub.generation_settings({}, {"repetition_penalty": None})
    assert (off["repetition_penalty"], off["no_repeat_ngram_size"]) == (1.0, 0)
    config = preset("tiny", src_vocab_size=50, tgt_vocab_size=50)
    decode = {"rules": "transformers", "beam_size": 4, "alpha": 1.0}
    on = hub._generation_json(config, {**decode, "repetition_penalty": 1.2, "no_repeat_ngram_size": 3})
    assert on["repetition_penalty"] == 1.2 and on["no_repeat_ngram_size"] == 3 and on["num_beams"] == 4
    plain = hub._generation_json(config, {**decode, "repetition_penalty": 1.0})
    assert "repetition_penalty" not in plain and "no_repeat_ngram_size" not in plain
