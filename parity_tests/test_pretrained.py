"""Pretrained models against their own PyTorch code: transformers' MarianMTModel and FSMTForConditionalGeneration
(eager attention), and a fairseq checkpoint of the same FSMT weights, read by `jax_transformer.interop.hub` into this
project's Flax model.

Random tiny models of each family stand in for the real ones (no download in the suite); they have every part a
real one has: Marian's shared or separate vocabularies, scaled embeddings, swish, final_logits_bias, sinusoids in
halves from position 0, the decoder starting from the pad id; FSMT's two vocabularies, tensor2tensor frequencies
counted from pad + 1, the decoder starting from EOS. Their vocabularies and tokenizer files are real ones learned
on the built-in task (tests/helpers/pretrained.py).

Tolerance for logits: absolute 1e-5, as for the twin (parity_tests/test_forward_parity.py): the same float32
formulas summed in different orders give differences of a few ulp per layer (~1e-6 here), while a wrong mapping
(a transposed kernel, a shifted position table, a missing bias) moves logits by 1e-2 or more. Decoded tokens and
tokenizer ids must be identical.
"""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest
import torch

from jax_transformer.data.default_task import default_pairs
from jax_transformer.decoding.decoders import generate
from jax_transformer.interop import hub
from jax_transformer.model.params import flatten
from jax_transformer.model.transformer import Transformer
from tests.helpers.pretrained import (
    end_at_various_lengths,
    fsmt_tokenizer_files,
    marian_tokenizer_files,
    tiny_fsmt,
    tiny_marian,
)

pytest.importorskip("transformers")
pytest.importorskip("sacremoses")

ATOL = 1e-5  # see the module docstring


SOURCES = list(default_pairs("valid", n=8).sources)  # the sentences the generate tests decode
MAX_LENGTH = 18


def _saved(model, folder, decoded=True):
    """Saves `model` to `folder` (beside its tokenizer files); a model the generate tests decode with its EOS
    raised so that SOURCES' outputs end at several lengths (tests/helpers/pretrained.py: end_at_various_lengths)."""
    if decoded:
        batch = _their_tokenizer(folder, model.config.model_type)(SOURCES, return_tensors="pt", padding=True)
        end_at_various_lengths(model, batch["input_ids"], batch["attention_mask"], MAX_LENGTH)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def marian_dirs(tmp_path_factory):
    """{shared: save_pretrained directory of a tiny MarianMTModel with real tokenizer files}."""
    dirs = {}
    for shared in (True, False):
        folder = tmp_path_factory.mktemp("marian_shared" if shared else "marian_separate")
        sizes = marian_tokenizer_files(folder, separate=not shared)
        dirs[shared] = _saved(tiny_marian(sizes, shared=shared), folder, decoded=shared)
    return dirs


@pytest.fixture(scope="module")
def fsmt_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fsmt")
    return _saved(tiny_fsmt(fsmt_tokenizer_files(folder)), folder)


def _their_tokenizer(folder, family):
    from transformers import FSMTTokenizer, MarianTokenizer

    return (MarianTokenizer if family == "marian" else FSMTTokenizer).from_pretrained(folder)


def _their_model(folder):
    from transformers import AutoModelForSeq2SeqLM

    return AutoModelForSeq2SeqLM.from_pretrained(folder, attn_implementation="eager").eval()


def _batch(tokenizer, config, n=6, seed=0):
    """Right-padded sources of real sentences of various lengths, and teacher-forced decoder inputs (the start id,
    then target ids; padded)."""
    pairs = default_pairs("valid", n=40)
    rng = np.random.default_rng(seed)
    rows = rng.choice(len(pairs.sources), n, replace=False)
    src = [tokenizer.encode(pairs.sources[i]) + [config.eos_id] for i in rows]
    tgt = [[config.start_id] + tokenizer.encode(pairs.targets[i], side="target") for i in rows]

    def pad(seqs):
        out = np.full((len(seqs), max(map(len, seqs))), config.pad_id, np.int32)
        for r, s in enumerate(seqs):
            out[r, : len(s)] = s
        return out

    return pad(src), pad(tgt)


def _their_logits(model, src, tgt_in, pad_id):
    decoder_mask = tgt_in != pad_id
    decoder_mask[:, 0] = True  # Marian's decoder starts from the pad id itself
    with torch.no_grad():
        return model(
            input_ids=torch.tensor(src, dtype=torch.long),
            attention_mask=torch.tensor(src != pad_id, dtype=torch.long),
            decoder_input_ids=torch.tensor(tgt_in, dtype=torch.long),
            decoder_attention_mask=torch.tensor(decoder_mask, dtype=torch.long),
            use_cache=False,  # FSMT's cached path expects one new position at a time
        ).logits.numpy(), decoder_mask


def _compare_logits(folder, parity_report, case):
    model = hub.read_pretrained(folder)
    src, tgt_in = _batch(model.tokenizer, model.config)
    ours = np.asarray(Transformer(model.config).apply({"params": model.params}, src, tgt_in))
    theirs, real = _their_logits(_their_model(folder), src, tgt_in, model.config.pad_id)
    diff = float(np.abs(ours - theirs)[real].max())  # padded query positions are not outputs of either
    parity_report("pretrained logits vs transformers", case, diff, ATOL)
    assert np.abs(theirs).max() > 1.0  # logits of a trained model's size, where a wrong mapping would show
    assert diff <= ATOL


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "separate"])
def test_marian_logits_match_transformers(marian_dirs, shared, parity_report):
    _compare_logits(marian_dirs[shared], parity_report, f"marian {'shared' if shared else 'separate'}")


def test_fsmt_logits_match_transformers(fsmt_dir, parity_report):
    _compare_logits(fsmt_dir, parity_report, "fsmt")


def _fairseq_checkpoint(fsmt_dir, folder):
    """The FSMT model's weights as fairseq writes them (no "model." prefix, an output projection, the bookkeeping
    keys), its args, its dictionaries (dict.en.txt / dict.fr.txt: @@-continued pieces) and bpecodes."""
    config = json.loads((fsmt_dir / "config.json").read_text())
    their = _their_model(fsmt_dir)
    state = {k.removeprefix("model."): v.clone() for k, v in their.state_dict().items()}
    state["encoder.version"] = torch.tensor([3.0])
    state["decoder.version"] = torch.tensor([3.0])
    for side in ("encoder", "decoder"):
        state[f"{side}.embed_positions._float_tensor"] = torch.zeros(1)
        state.pop(f"{side}.embed_positions.weight", None)
    args = {
        "arch": "transformer",
        "source_lang": "en",
        "target_lang": "fr",
        "encoder_embed_dim": config["d_model"],
        "decoder_embed_dim": config["d_model"],
        "encoder_layers": config["encoder_layers"],
        "decoder_layers": config["decoder_layers"],
        "encoder_attention_heads": config["encoder_attention_heads"],
        "decoder_attention_heads": config["decoder_attention_heads"],
        "encoder_ffn_embed_dim": config["encoder_ffn_dim"],
        "decoder_ffn_embed_dim": config["decoder_ffn_dim"],
        "max_source_positions": config["max_position_embeddings"],
        "max_target_positions": config["max_position_embeddings"],
        "activation_fn": config["activation_function"],
        "share_decoder_input_output_embed": False,
        "share_all_embeddings": False,
        "encoder_normalize_before": False,
        "decoder_normalize_before": False,
        "dropout": 0.1,
    }
    path = folder / "checkpoint_best.pt"
    torch.save({"args": args, "model": state}, path, pickle_protocol=pickle.HIGHEST_PROTOCOL)
    for lang, name in (("en", "vocab-src.json"), ("fr", "vocab-tgt.json")):
        vocab = json.loads((fsmt_dir / name).read_text())
        symbols = sorted((i, s) for s, i in vocab.items() if i >= 4)
        lines = [f"{s[:-4] if s.endswith('</w>') else s + '@@'} {1000 - i}" for i, s in symbols]
        (folder / f"dict.{lang}.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    merges = (fsmt_dir / "merges.txt").read_text().splitlines()
    (folder / "bpecodes").write_text("".join(f"{m} {100 - i % 90}\n" for i, m in enumerate(merges)), encoding="utf-8")
    return path


def test_fairseq_checkpoint_reads_as_its_fsmt_conversion(fsmt_dir, tmp_path, parity_report):
    """A fairseq checkpoint and transformers' FSMT conversion of it are the same model here: the same parameters
    bit for bit, and the same tokenizer ids."""
    checkpoint = _fairseq_checkpoint(fsmt_dir, tmp_path)
    ours, converted = hub.read_pretrained(checkpoint), hub.read_pretrained(fsmt_dir)
    assert ours.family == "fairseq" and ours.config == converted.config.replace(
        max_len=ours.config.max_len, bos_id=ours.config.bos_id
    )
    a, b = flatten(ours.params), flatten(converted.params)
    assert a.keys() == b.keys()
    diff = max(float(np.abs(a[k] - b[k]).max()) for k in a)
    parity_report("fairseq checkpoint vs its FSMT conversion", "parameters", diff, 0.0)
    assert diff == 0.0
    texts = list(default_pairs("valid", n=100).sources)
    assert [ours.tokenizer.encode(t) for t in texts] == [converted.tokenizer.encode(t) for t in texts]


def _generate_both(folder, **options):
    """(their generate's tokens, ours) for SOURCES, as lists of ids without the start token and padding."""
    model = hub.read_pretrained(folder)
    config = model.config
    rows = [model.tokenizer.encode(s) + [config.eos_id] for s in SOURCES]
    src = np.full((len(rows), max(map(len, rows))), config.pad_id, np.int32)
    for r, row in enumerate(rows):
        src[r, : len(row)] = row
    with torch.no_grad():
        theirs = (
            _their_model(folder)
            .generate(
                input_ids=torch.tensor(src, dtype=torch.long),
                attention_mask=torch.tensor(src != config.pad_id, dtype=torch.long),
                do_sample=False,
                **options,
            )
            .numpy()[:, 1:]
        )
    ours = generate(
        model.params,
        config,
        src,
        max_length=options["max_length"],
        num_beams=options["num_beams"],
        length_penalty=options.get("length_penalty", 1.0),
        early_stopping={True: "true", False: "false", "never": "never"}[options.get("early_stopping", False)],
        banned=tuple(i for [i] in options.get("bad_words_ids", [])),
        forced_eos=options.get("forced_eos_token_id") is not None,
        min_length=options.get("min_length", 0),
        repetition_penalty=options.get("repetition_penalty", 1.0),
        no_repeat_ngram_size=options.get("no_repeat_ngram_size", 0),
    )

    def trimmed(row):
        row = list(row)
        while row and row[-1] == config.pad_id:
            row.pop()
        return row

    return [trimmed(r) for r in theirs], [trimmed(r) for r in ours], config


GENERATE_CASES = {
    "greedy": dict(num_beams=1),
    "beam4": dict(num_beams=4),
    "beam4 early": dict(num_beams=4, early_stopping=True),
    "beam3 never": dict(num_beams=3, early_stopping="never"),
    "beam4 alpha0.6 min5": dict(num_beams=4, length_penalty=0.6, min_length=5),
    "greedy repetition1.5": dict(num_beams=1, repetition_penalty=1.5),
    "greedy ngram2": dict(num_beams=1, no_repeat_ngram_size=2),
    "beam4 ngram3 repetition0.8": dict(num_beams=4, no_repeat_ngram_size=3, repetition_penalty=0.8),
}
REPEAT_OPTIONS = ("repetition_penalty", "no_repeat_ngram_size")


@pytest.mark.parametrize("case", GENERATE_CASES)
@pytest.mark.parametrize("family", ["marian", "fsmt"])
def test_generate_matches_transformers(family, case, marian_dirs, fsmt_dir):
    """The tokens transformers' generate picks, for greedy and beam search under each of its stopping rules, with a
    length penalty, a minimum length, the pad id banned (Marian), EOS forced at the limit, its repetition penalty
    and its n-gram bans."""
    folder = marian_dirs[True] if family == "marian" else fsmt_dir
    options = dict(GENERATE_CASES[case], max_length=MAX_LENGTH)
    config = hub.read_pretrained(folder).config
    if family == "marian":
        options["bad_words_ids"] = [[config.pad_id]]
    options["forced_eos_token_id"] = config.eos_id
    theirs, ours, config = _generate_both(folder, **options)
    assert ours == theirs
    if any(name in options for name in REPEAT_OPTIONS):  # the option must have changed what is generated
        plain, _, _ = _generate_both(folder, **{k: v for k, v in options.items() if k not in REPEAT_OPTIONS})
        assert plain != theirs, "the repetition options changed nothing here"
        return  # (whether sentences end, and where, is up to the options here)
    lengths = sorted({len(r) for r in theirs})
    if "min_length" in options:  # (min_length counts the start token)
        assert lengths[0] >= options["min_length"] - 1, lengths
        unbound, _, _ = _generate_both(folder, **{k: v for k, v in options.items() if k != "min_length"})
        assert min(map(len, unbound)) < options["min_length"] - 1, "min_length changed nothing here"
        return
    ended = [r for r in theirs if r and r[-1] == config.eos_id and len(r) < options["max_length"] - 1]
    assert len(lengths) >= 2 and lengths[-1] >= 3, lengths  # outputs of several lengths, not all EOS at once
    assert ended, "no output ended before the length limit: the stopping rules were not exercised"


@pytest.mark.parametrize("family", ["marian shared", "marian separate", "fsmt"])
def test_tokenizers_match_transformers(family, marian_dirs, fsmt_dir):
    """Ids as transformers' MarianTokenizer / FSMTTokenizer give them, on a few hundred sentences and on text with
    characters outside the vocabulary, special-token strings and odd spacing; and output rows decoded to the same
    text. Decoding here stops at a row's first EOS (an output row ends there), so rows are compared as outputs are:
    with EOS last."""
    folder = {"marian shared": marian_dirs[True], "marian separate": marian_dirs[False], "fsmt": fsmt_dir}[family]
    ours = hub.read_pretrained(folder).tokenizer
    theirs = _their_tokenizer(folder, family.split()[0])
    pairs = default_pairs("valid", n=300)
    odd = ["Hello wörld ☃ 𝔘 – “quotes” & <tags>", "a </s> b <unk> c", "", "  spaced  out  ", "twenty-one, (I think)."]
    sources = list(pairs.sources) + odd
    assert [ours.encode(s) + [ours.eos_id] for s in sources] == theirs(sources)["input_ids"]
    targets = list(pairs.targets) + odd
    if family == "fsmt":
        targets = [text for text in targets if not any(special in text for special in ours.SPECIALS)]
        # FSMTTokenizer encodes every text as the source language with the source vocabulary (it is written for
        # inference); targets are encoded as fairseq's preprocessing does: its Moses and BPE for the target
        # language, then the target vocabulary.
        lang = ours.langs[1]
        target_ids = [
            [
                ours.target_vocab.get(piece, ours.unk_id)
                for token in theirs.moses_tokenize(theirs.moses_pipeline(text, lang=lang), lang=lang)
                for piece in theirs.bpe(token).split(" ")
            ]
            + [ours.eos_id]
            for text in targets
        ]
    else:
        target_ids = theirs(text_target=targets)["input_ids"]
    assert [ours.encode(s, side="target") + [ours.eos_id] for s in targets] == target_ids
    rows = [ids for ids in target_ids if ids.count(ours.eos_id) == 1]
    assert len(rows) >= len(target_ids) - 1  # all but the text holding "</s>"
    assert [ours.decode(ids) for ids in rows] == theirs.batch_decode(rows, skip_special_tokens=True)


def test_marian_alignments_are_the_argmax_of_transformers_cross_attentions(marian_dirs):
    """Word alignments (`translate --alignments`) of a beam search of 2, both hypotheses: each token's source
    position is the argmax of transformers' last-layer cross-attention, heads averaged (tests/helpers/alignments.py)."""
    from tests.helpers.alignments import check_against_transformers

    model = hub.read_pretrained(marian_dirs[True])
    check_against_transformers(marian_dirs[True], model, model.tokenizer, SOURCES, max_length=MAX_LENGTH, beams=2,
                               layer=-1)  # fmt: skip
