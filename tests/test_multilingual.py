"""NLLB-200 and mBART-50 through the command line: `train.py import` a transformers directory, `translate` with
`--src-lang` / `--tgt-lang` as transformers' generate + batch_decode does, `export --format transformers` back (the
same weights, tokenizer files and generation settings, which CTranslate2 converts), fine-tune with
`train --init-from` and export the result; and the messages for what cannot be read. Logit, token and tokenizer
parity against transformers for all three families is parity_tests/test_multilingual.py; this file is about the
files and the commands. Tiny random models (tests/helpers/multilingual.py), nothing downloaded."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from jax_transformer.checkpoint import manager as ckpt_lib
from jax_transformer.data.default_task import default_pairs
from jax_transformer.decoding.decoders import generate
from jax_transformer.errors import ConfigError, DataError
from jax_transformer.interop import hub
from jax_transformer.settings.config import DecodeConfig
from tests.helpers.batches import pad_rows
from tests.helpers.multilingual import LANGUAGES, saved_model, their_tokenizer
from tests.helpers.pretrained import assert_same_logits
from tests.helpers.training import run_main, write_corpus

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

SENTENCES = list(default_pairs("valid", n=8).sources)
MAX_LENGTH = 20
ATOL = 1e-5  # float32 logits, as parity_tests/test_multilingual.py justifies
FAMILIES = ("nllb", "mbart50")  # NLLB: M2M100ForConditionalGeneration, greedy; mBART-50: beam 5, learned positions


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """{family: (save_pretrained directory, run directory imported from it)}."""
    out = {}
    for family in FAMILIES:
        root = tmp_path_factory.mktemp(family)
        source = saved_model(family, root / "hf", SENTENCES, MAX_LENGTH)
        code, stdout, stderr = run_main(["import", str(source), "--output", str(root / "run")])
        assert code == 0, stdout + stderr
        assert f"imported {'m2m_100' if family == 'nllb' else 'mbart'} model" in stdout
        out[family] = source, root / "run"
    return out


def _their_translations(folder, family, sentences):
    from transformers import AutoModelForSeq2SeqLM

    tokenizer = their_tokenizer(folder, family)
    model = AutoModelForSeq2SeqLM.from_pretrained(folder, attn_implementation="eager").eval()
    bos = tokenizer.convert_tokens_to_ids(LANGUAGES[family][1])
    with torch.no_grad():
        out = model.generate(**tokenizer(sentences, return_tensors="pt", padding=True), forced_bos_token_id=bos)
    return tokenizer.batch_decode(out, skip_special_tokens=True)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_import_then_translate_as_transformers_generates(family, imported, tmp_path):
    """The run directory decodes as the model's generation_config.json says, into the language --tgt-lang
    names: `translate` prints what transformers' generate (forced_bos_token_id) + batch_decode gives."""
    source, run = imported[family]
    stored = ckpt_lib.load(run, "latest").run
    assert stored["decode"]["rules"] == "transformers"
    assert stored["decode"]["beam_size"] == {"nllb": 1, "mbart50": 5}[family]
    (tmp_path / "in.txt").write_text("\n".join(SENTENCES) + "\n", encoding="utf-8")
    src, tgt = LANGUAGES[family]
    args = ["translate", "--checkpoint", str(run), "--input", str(tmp_path / "in.txt")]
    code, out, err = run_main([*args, "--src-lang", src, "--tgt-lang", tgt])
    assert code == 0, out + err
    theirs = _their_translations(source, family, SENTENCES)
    assert out.splitlines() == theirs
    assert len({len(t.split()) for t in theirs}) >= 2  # outputs of several lengths
    code, out, err = run_main([*args, "--src-lang", src, "--tgt-lang", tgt.lower()])
    assert code != 0 and f"--tgt-lang {tgt.lower()!r} is not a language code" in err + out and tgt in err + out


def test_export_gives_back_the_same_model_files(imported, tmp_path):
    """export --format transformers of the imported mBART-50: its class and config, every weight bit for bit
    (the learned position table's two rows before position 0, which no input reads, as zeros), the tokenizer's
    files that AutoTokenizer loads, the generation settings; CTranslate2 converts the directory and decodes
    greedily, with the target language's code as its prefix, the tokens this project's generate gives."""
    from transformers import AutoModelForSeq2SeqLM, GenerationConfig

    source, run = imported["mbart50"]
    exported = tmp_path / "exported"
    code, out, err = run_main(
        ["export", "--checkpoint", str(run), "--format", "transformers", "--output", str(exported)]
    )
    assert code == 0, out + err
    assert "MBartForConditionalGeneration" in out
    original = AutoModelForSeq2SeqLM.from_pretrained(source).state_dict()
    again = AutoModelForSeq2SeqLM.from_pretrained(exported).state_dict()
    assert original.keys() == again.keys()
    for key in original:
        a, b = original[key], again[key]
        if key.endswith("embed_positions.weight"):
            a, b = a[2:], b[2:]
        assert torch.equal(a, b), key
    assert json.loads((exported / "config.json").read_text())["architectures"] == ["MBartForConditionalGeneration"]
    assert (exported / "tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()
    assert (
        their_tokenizer(exported, "mbart50")(SENTENCES)["input_ids"]
        == their_tokenizer(source, "mbart50")(SENTENCES)["input_ids"]
    )
    a, b = GenerationConfig.from_pretrained(source), GenerationConfig.from_pretrained(exported)
    for field in ("num_beams", "max_length", "early_stopping", "forced_eos_token_id", "decoder_start_token_id"):
        assert getattr(a, field) == getattr(b, field), field

    ctranslate2 = pytest.importorskip("ctranslate2")
    ctranslate2.converters.TransformersConverter(str(exported)).convert(str(tmp_path / "ct2"))
    loaded = ckpt_lib.load(run, "latest")
    tokenizer = loaded.tokenizer.with_languages(*LANGUAGES["mbart50"])
    rows = [tokenizer.encode(s) + [tokenizer.eos_id] for s in SENTENCES]
    translator = ctranslate2.Translator(str(tmp_path / "ct2"), device="cpu", compute_type="float32")
    code = LANGUAGES["mbart50"][1]
    results = translator.translate_batch(
        [[tokenizer.piece(i) for i in row] for row in rows],
        target_prefix=[[code]] * len(rows),
        beam_size=1,
        max_decoding_length=MAX_LENGTH - 1,
    )
    src = pad_rows(rows, pad_id=loaded.config.pad_id)
    # (CTranslate2 does not force EOS at the limit: neither does this generate)
    ours = generate(loaded.params, loaded.config, src, max_length=MAX_LENGTH, forced_bos=tokenizer.forced_bos_id)
    special = (loaded.config.pad_id, loaded.config.eos_id)
    ours = [[tokenizer.piece(i) for i in row if i not in special] for row in ours]
    assert [r.hypotheses[0] for r in results] == ours


@pytest.mark.slow
def test_fine_tune_an_imported_model_and_export_it(imported, tmp_path):
    """train --init-from an imported NLLB model with --src-lang / --tgt-lang: the weights, tokenizer (its languages
    as given) and decoding carry over, the loss falls, and the fine-tuned model exports as an
    M2M100ForConditionalGeneration whose logits are the Flax model's."""
    from transformers import AutoModelForSeq2SeqLM

    _, run = imported["nllb"]
    start = ckpt_lib.load(run, "latest")
    src, tgt = LANGUAGES["nllb"]
    args = ["train", "--init-from", str(run), "--tsv", str(write_corpus(tmp_path)), "--src-lang", src]
    args += ["--tgt-lang", tgt, "--steps", "10", "--warmup-steps", "8", "--lr-scale", "0.3", "--max-tokens", "512"]
    args += ["--eval-every", "1000", "--save-every", "1000", "--eval-sentences", "0", "--samples", "0"]
    args += ["--no-progress", "--run-dir", str(tmp_path / "tuned")]
    code, out, err = run_main(args)
    assert code == 0, out + err
    tuned = ckpt_lib.load(tmp_path / "tuned", "latest")
    assert tuned.step == 10 and tuned.config == start.config
    assert (tuned.tokenizer.src_lang, tuned.tokenizer.tgt_lang) == (src, tgt)
    assert tuned.run["imported_from"] == start.run["imported_from"]
    assert DecodeConfig.from_dict(tuned.run["decode"]) == DecodeConfig.from_dict(start.run["decode"])
    records = [json.loads(line) for line in (tmp_path / "tuned" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if r["kind"] == "train"]
    assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.3, losses  # it learned

    exported = tmp_path / "exported"
    code, out, err = run_main(
        ["export", "--checkpoint", str(tmp_path / "tuned"), "--format", "transformers", "--output", str(exported)]
    )
    assert code == 0, out + err
    assert json.loads((exported / "tokenizer_config.json").read_text())["tgt_lang"] == tgt
    model = AutoModelForSeq2SeqLM.from_pretrained(exported, attn_implementation="eager").eval()
    assert_same_logits(model, tuned.params, tuned.config, tuned.tokenizer, "fine-tuned NLLB, exported")


def test_what_cannot_be_read_is_named(imported, tmp_path):
    """Another model type (NLLB-MoE) names its model_type and the supported ones; a weights file cut short, a
    shard index whose shard is missing and a damaged tokenizer.json each name the file; a language code given to a
    model without codes says so."""
    source, run = imported["nllb"]
    folder = tmp_path / "copy"
    shutil.copytree(source, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "nllb-moe"}))
    with pytest.raises(ConfigError, match=r"model_type 'nllb-moe'; this project imports 'marian', 'fsmt', 'm2m_100'"):
        hub.read_pretrained(folder)
    (folder / "config.json").write_text(json.dumps(config))
    weights = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(weights[:100_000])
    with pytest.raises(DataError, match=r"model.safetensors: not a complete safetensors file \(100,000 bytes\)"):
        hub.read_pretrained(folder)
    (folder / "model.safetensors").write_bytes(weights)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "model-00002.safetensors"}}))
    with pytest.raises(DataError, match=r"model.safetensors.index.json: its shard\(s\) \['model-00002.safetensors'\]"):
        hub.read_pretrained(folder)
    (folder / "model.safetensors.index.json").unlink()
    (folder / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    with pytest.raises(DataError, match=r"copy/tokenizer.json: not a tokenizer the tokenizers library reads"):
        hub.read_pretrained(folder)
    code, out, err = run_main(["import", str(folder), "--output", str(tmp_path / "run")])
    assert code != 0 and "tokenizer.json" in err + out and not (tmp_path / "run").exists()


def test_mbart_without_tokenizer_json_reads_its_sentencepiece_model(imported, tmp_path):
    """An mBART-50 directory with sentencepiece.bpe.model and no tokenizer.json (as older uploads hold it) gives
    transformers' ids, language codes included; a damaged SentencePiece model names the file."""
    source, _ = imported["mbart50"]
    folder = tmp_path / "spm-only"
    shutil.copytree(source, folder)
    (folder / "tokenizer.json").unlink()
    tokenizer = hub.read_pretrained(folder).tokenizer.with_languages(*LANGUAGES["mbart50"])
    theirs = their_tokenizer(source, "mbart50")
    texts = [*SENTENCES, "  odd   spacing, \u00fcml\u00e4ut and \u2603"]
    assert [tokenizer.encode(text) + [tokenizer.eos_id] for text in texts] == theirs(texts)["input_ids"]
    assert tokenizer.codes == hub.read_pretrained(source).tokenizer.codes  # the 52 codes, at the same ids
    (folder / "sentencepiece.bpe.model").write_bytes(b"not a model")
    with pytest.raises(DataError, match=r"spm-only/sentencepiece.bpe.model: not a SentencePiece model"):
        hub.read_pretrained(folder)
    (folder / "sentencepiece.bpe.model").unlink()
    with pytest.raises(DataError, match=r"\['tokenizer.json' or 'sentencepiece.bpe.model'\] missing"):
        hub.read_pretrained(folder)
