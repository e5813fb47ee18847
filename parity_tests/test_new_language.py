"""A language an imported NLLB model does not have (`train --init-from RUN --add-language xyz_Latn
--init-from-language fra_Latn`): the tokenizer and the embedding table grow by the code, the new row starts as the
chosen one's, and the export loads in transformers, whose tokenizer knows the code and whose generate, with it
forced first, gives this project's tokens (tiny random NLLB model, eager attention, float32 at "highest")."""

from __future__ import annotations

import numpy as np
import pytest

from jax_transformer.checkpoint import manager as checkpoint
from jax_transformer.decoding.decoders import generate
from jax_transformer.interop import hub, languages
from jax_transformer.model.params import flatten, unflatten
from tests.helpers.batches import pad_rows
from tests.helpers.training import run_main, write_corpus

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

SOURCES = ["one hundred and two", "seven", "forty five thousand and nine", "three", "eighty"]
CODE = "xyz_Latn"


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """A run directory `import` wrote from a tiny random NLLB model."""
    from tests.helpers.multilingual import TOKENIZERS, model_vocab_size, tiny_model

    folder = tmp_path_factory.mktemp("nllb")
    tiny_model("nllb", model_vocab_size("nllb", TOKENIZERS["nllb"](folder))).save_pretrained(folder)
    run = tmp_path_factory.mktemp("nllb_run") / "run"  # a folder of its own: other modules import beside it
    return hub.import_model(folder, run, print_fn=lambda line: None)


def test_a_new_code_exports_and_decodes_as_transformers_does(imported, tmp_path):
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    start = checkpoint.load(imported, "best")
    extended = languages.with_language(start, CODE, "fra_Latn")
    tokenizer = extended.tokenizer.with_languages("eng_Latn", CODE)
    new_id = tokenizer.forced_bos_id
    assert new_id == start.config.src_vocab_size == extended.config.src_vocab_size - 1
    table = flatten(extended.params)[("shared_embed", "embedding")]
    np.testing.assert_array_equal(table[new_id], table[start.tokenizer.codes["fra_Latn"]])
    np.testing.assert_array_equal(table[:new_id], flatten(start.params)[("shared_embed", "embedding")])
    # The row as training would leave it: its own, not a copy (a copy ties its logits with fra_Latn's).
    flat = flatten(extended.params)
    flat[("shared_embed", "embedding")] = table.copy()
    flat[("shared_embed", "embedding")][new_id] += np.random.default_rng(0).normal(0, 0.05, table.shape[1])
    params = unflatten(flat)

    out, kind = hub.export_transformers(
        params, extended.config, tokenizer, checkpoint.load(imported, "best").run, tmp_path / "hf"
    )
    theirs_tokenizer = AutoTokenizer.from_pretrained(out, src_lang="eng_Latn")
    assert theirs_tokenizer.convert_tokens_to_ids(CODE) == new_id
    assert theirs_tokenizer(SOURCES[0])["input_ids"] == tokenizer.encode(SOURCES[0]) + [extended.config.eos_id]
    model = AutoModelForSeq2SeqLM.from_pretrained(out, attn_implementation="eager").eval()
    config = extended.config
    src = pad_rows([tokenizer.encode(s) + [config.eos_id] for s in SOURCES], pad_id=config.pad_id)
    for beams in (1, 4):
        with torch.no_grad():
            theirs = model.generate(
                input_ids=torch.tensor(src, dtype=torch.long),
                attention_mask=torch.tensor(src != config.pad_id, dtype=torch.long),
                do_sample=False,
                num_beams=beams,
                max_length=16,
                forced_bos_token_id=new_id,
                forced_eos_token_id=None,
            ).numpy()[:, 1:]
        ours = generate(params, config, src, max_length=16, num_beams=beams, forced_eos=False, forced_bos=new_id)
        assert (theirs[:, 0] == new_id).all()
        assert np.array_equal(ours[:, : theirs.shape[1]], theirs), (beams, ours, theirs)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--add-language", "fra_Latn"], "--add-language 'fra_Latn': the tokenizer has it already"),
        (["--add-language", CODE, "--init-from-language", "fra_Lat"], "--init-from-language 'fra_Lat' is not a"),
        # A code of another form would be a special token found inside ordinary text ("a b Hallo", "en", "the").
        (["--add-language", "a b"], "--add-language 'a b': not of the form of this model's language codes, aaa_Aaaa"),
        (["--add-language", "en"], "--add-language 'en': not of the form of this model's language codes"),
        (["--add-language", "xyz-latn"], "the closest valid form: xyz_Latn"),
        (["--add-language", ""], "--add-language: an empty language code"),
    ],
)
def test_faults_are_named_before_any_step(imported, tmp_path, flags, message):
    corpus = write_corpus(tmp_path)
    args = ["train", "--init-from", str(imported), "--tsv", str(corpus), "--run-dir", str(tmp_path / "t")]
    code, out, err = run_main([*args, "--src-lang", "eng_Latn", "--tgt-lang", "fra_Latn", "--steps", "1", *flags])
    assert code == 1 and message in err, out + err
    assert not (tmp_path / "t" / "checkpoints").exists()


def test_train_adds_the_code_and_trains_into_it(imported, tmp_path):
    corpus = write_corpus(tmp_path)
    args = ["train", "--init-from", str(imported), "--tsv", str(corpus), "--run-dir", str(tmp_path / "t")]
    args += ["--src-lang", "eng_Latn", "--tgt-lang", CODE, "--add-language", CODE, "--init-from-language", "fra_Latn"]
    args += ["--steps", "2", "--max-tokens", "512", "--eval-every", "1000", "--samples", "0", "--no-progress"]
    code, out, err = run_main(args)
    assert code == 0, out + err
    tuned = checkpoint.load(tmp_path / "t", "latest")
    start = checkpoint.load(imported, "best")
    new_id = start.config.src_vocab_size
    assert tuned.tokenizer.codes[CODE] == new_id and tuned.config.src_vocab_size == new_id + 1
    assert tuned.tokenizer.tgt_lang == CODE and tuned.tokenizer.forced_bos_id == new_id
    table = flatten(tuned.params)[("shared_embed", "embedding")]
    started_as = flatten(start.params)[("shared_embed", "embedding")][start.tokenizer.codes["fra_Latn"]]
    assert not np.array_equal(table[new_id], started_as)  # it trained (each target's first token is the code)
