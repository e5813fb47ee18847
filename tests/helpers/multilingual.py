"""Multilingual models of the families people translate with, tiny and random, built from their configs (nothing is
downloaded): NLLB-200's tokenizer (a BPE `tokenizer.json` with its 202 language codes), M2M-100's (a SentencePiece
model and vocab.json, its 100 codes numbered after the vocabulary) and mBART-50's (a Unigram `tokenizer.json` with
its 52 codes), each learned on the built-in task and written by transformers' own tokenizer class; and an
M2M100ForConditionalGeneration or MBartForConditionalGeneration of that vocabulary, its weights at a trained
model's scale (tests/helpers/pretrained.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tests.helpers.pretrained import TINY_HF, _trained_scale

FAMILIES = ("nllb", "m2m100", "mbart50")
# The built-in task is English -> French: each family's codes for the two.
LANGUAGES = {"nllb": ("eng_Latn", "fra_Latn"), "m2m100": ("en", "fr"), "mbart50": ("en_XX", "fr_XX")}


def _texts(n: int = 2000) -> list[str]:
    from jax_transformer.data.default_task import default_pairs

    pairs = default_pairs("train", n=n)
    return list(pairs.sources) + list(pairs.targets)


def _spm_model(vocab_size: int, model_type: str) -> bytes:
    """A SentencePiece model learned on both sides of the built-in task, with its own specials <unk> 0, <s> 1,
    </s> 2 (as fairseq's models are), so the pieces from id 3 on are ordinary ones."""
    import io

    import sentencepiece as spm

    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(_texts()),
        model_writer=out,
        vocab_size=vocab_size,
        model_type=model_type,
        num_threads=1,
        hard_vocab_limit=False,
        minloglevel=2,
    )
    return out.getvalue()


def nllb_tokenizer(folder: Path):
    """NllbTokenizer of a BPE of ~300 pieces learned with the tokenizers library (Metaspace, as NLLB's), saved
    to `folder` (tokenizer.json, tokenizer_config.json); returns transformers' tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import NllbTokenizer

    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)
    backend.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "<pad>", "</s>", "<unk>"], show_progress=False)
    backend.train_from_iterator(_texts(), trainer)
    model = json.loads(backend.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tokenizer = NllbTokenizer(vocab=model["vocab"], merges=merges, src_lang="eng_Latn", tgt_lang="fra_Latn")
    tokenizer.save_pretrained(folder)
    return tokenizer


def m2m100_tokenizer(folder: Path):
    """M2M100Tokenizer of a SentencePiece BPE of 300 pieces: sentencepiece.bpe.model and vocab.json (fairseq's
    <s> 0, <pad> 1, </s> 2, <unk> 3, then the pieces), saved to `folder`; returns transformers' tokenizer."""
    import sentencepiece as spm
    from transformers import M2M100Tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    data = _spm_model(300, "bpe")
    processor = spm.SentencePieceProcessor()
    processor.LoadFromSerializedProto(data)
    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    for i in range(3, processor.get_piece_size()):
        vocab.setdefault(processor.IdToPiece(i), len(vocab))
    (folder / "sentencepiece.bpe.model").write_bytes(data)
    (folder / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    tokenizer = M2M100Tokenizer(
        str(folder / "vocab.json"), str(folder / "sentencepiece.bpe.model"), src_lang="en", tgt_lang="fr"
    )
    tokenizer.save_pretrained(folder)
    return tokenizer


def mbart50_tokenizer(folder: Path):
    """MBart50Tokenizer of a SentencePiece Unigram of 300 pieces with their scores, saved to `folder`
    (tokenizer.json, and the SentencePiece model beside it as sentencepiece.bpe.model, as the hub holds mBART-50);
    returns transformers' tokenizer."""
    import sentencepiece as spm
    from transformers import MBart50Tokenizer

    data = _spm_model(300, "unigram")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sentencepiece.bpe.model").write_bytes(data)
    processor = spm.SentencePieceProcessor()
    processor.LoadFromSerializedProto(data)
    pieces = [(processor.IdToPiece(i), processor.GetScore(i)) for i in range(processor.get_piece_size())]
    # (bos_token as the released tokenizer_config.json names it; transformers 5 no longer sets it itself)
    tokenizer = MBart50Tokenizer(vocab=pieces, src_lang="en_XX", tgt_lang="fr_XX", bos_token="<s>")
    tokenizer.save_pretrained(folder)
    return tokenizer


TOKENIZERS = {"nllb": nllb_tokenizer, "m2m100": m2m100_tokenizer, "mbart50": mbart50_tokenizer}


def tiny_model(family: str, vocab_size: int, seed: int = 0):
    """A random M2M100ForConditionalGeneration (NLLB-200 and M2M-100: relu, scaled embeddings, LayerDrop as
    M2M-100's config has it) or MBartForConditionalGeneration (gelu, layernorm_embedding, learned positions, a
    random final_logits_bias), eager attention, at a trained model's scale."""
    import torch
    from transformers import M2M100Config, M2M100ForConditionalGeneration, MBartConfig, MBartForConditionalGeneration

    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab_size,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=2,
        scale_embedding=True,
        attn_implementation="eager",
        **TINY_HF,
    )
    if family == "mbart50":
        model = MBartForConditionalGeneration(MBartConfig(activation_function="gelu", **common)).eval()
        model = _trained_scale(model)
        with torch.no_grad():
            model.final_logits_bias.normal_(0.0, 0.1)
            for name, p in model.named_parameters():
                if "layernorm_embedding" in name or "layer_norm" in name:
                    p.add_(torch.randn_like(p) * 0.1)  # LayerNorms that are not the identity, as trained ones
                if "embed_positions" in name:
                    p.normal_(0.0, 0.3)
        return _louder_layers(model)
    layerdrop = 0.0 if family == "nllb" else 0.05
    config = M2M100Config(
        activation_function="relu", encoder_layerdrop=layerdrop, decoder_layerdrop=layerdrop, **common
    )
    model = _trained_scale(M2M100ForConditionalGeneration(config).eval())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layer_norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return _louder_layers(model)


def _louder_layers(model):
    """The decoder layers' outputs made 6x larger: with a table tied between input and output, a random pre-norm
    decoder otherwise repeats its input token, step after step, and outputs end at the first step or never."""
    import torch

    with torch.no_grad():
        for layer in model.model.decoder.layers:
            layer.fc2.weight.mul_(6.0)
            layer.self_attn.out_proj.weight.mul_(6.0)
    return model


def lengths_of(tokens: np.ndarray, eos: int) -> list[int]:
    """Each row's length up to and including its first EOS (the row's width where it has none)."""
    ends = tokens == eos
    return np.where(ends.any(axis=1), ends.argmax(axis=1) + 1, tokens.shape[1]).tolist()


def model_vocab_size(family: str, tokenizer) -> int:
    """The embedding table a model of this tokenizer has: M2M-100's counts its language codes and
    `num_madeup_words` placeholders after the vocabulary (transformers' v5 tokenizer leaves them out of len())."""
    if family == "m2m100":
        return tokenizer.vocab_size + len(tokenizer.lang_code_to_id) + tokenizer.num_madeup_words
    return len(tokenizer)


def end_at_various_lengths(model, input_ids, attention_mask, forced_bos: int, max_length: int) -> list[int]:
    """Raises EOS in a random model (in place) until its greedy outputs for these sources end at three lengths or
    more, none shorter than 3 and the same for raises a little smaller and larger (no near-tie decides them);
    returns those lengths. mBART raises it by its final_logits_bias; M2M-100 (no bias, its output tied to its
    input table) by moving the decoder's final LayerNorm bias along EOS's embedding, which adds the raise to EOS's
    logit (and a multiple of it to each token like EOS) and leaves every cached state as it was."""
    import torch

    eos = model.config.eos_token_id
    if model.config.model_type == "mbart":
        bias = model.final_logits_bias[0]
        direction = torch.zeros_like(bias)
        direction[eos] = 1.0
    else:
        bias = model.model.decoder.layer_norm.bias
        embedding = model.model.shared.weight[eos].detach().clone()
        direction = embedding / (embedding @ embedding)
    original = bias.detach().clone()

    def lengths_at(raise_: float) -> list[int]:
        with torch.no_grad():
            bias.copy_(original + raise_ * direction)
            out = model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                max_length=max_length,
                num_beams=1,
                do_sample=False,
                forced_bos_token_id=forced_bos,
            )
        return lengths_of(out.numpy()[:, 1:], eos)

    coarse = np.arange(0.25, 15.0, 0.25)  # the first raise where some output ends early, then finer steps there
    first = next((r for r in coarse if len(set(lengths_at(r))) > 1), coarse[-1])
    for raise_ in np.arange(max(first - 0.25, 0.0), first + 3.0, 0.05):
        lengths = lengths_at(raise_)
        if len(set(lengths)) >= 3 and min(lengths) >= 3:
            if lengths_at(raise_ - 0.02) == lengths == lengths_at(raise_ + 0.02):
                lengths_at(raise_)  # (the model left with this raise)
                return lengths
    raise AssertionError("no EOS raise makes these outputs end at three lengths; choose other sources or seed")


# What the released models' generation_config.json / config.json set, max_length aside (each test sets it within
# the tiny models' 64 positions).
RELEASED_GENERATION = {
    "nllb": {},  # facebook/nllb-200-distilled-600M: greedy, max_length 200
    "m2m100": {"num_beams": 5, "early_stopping": True},  # facebook/m2m100_418M
    "mbart50": {"num_beams": 5, "early_stopping": True, "forced_eos_token_id": 2},  # mbart-large-50-many-to-many-mmt
}


def their_tokenizer(folder: Path, family: str):
    """transformers' tokenizer of `folder`, for the family's English -> French."""
    from transformers import AutoTokenizer

    src, tgt = LANGUAGES[family]
    return AutoTokenizer.from_pretrained(folder, src_lang=src, tgt_lang=tgt)


def saved_model(family: str, folder: Path, sources: list[str], max_length: int) -> Path:
    """`folder` as a save_pretrained directory of a tiny model of `family` with its tokenizer files and the
    released model's generation settings (max_length `max_length`), EOS raised so that the greedy outputs of
    `sources` (English -> French) end at several lengths."""
    theirs = TOKENIZERS[family](folder)
    model = tiny_model(family, model_vocab_size(family, theirs))
    tokenizer = their_tokenizer(folder, family)
    batch = tokenizer(sources, return_tensors="pt", padding=True)
    code = LANGUAGES[family][1] if family != "m2m100" else f"__{LANGUAGES[family][1]}__"
    end_at_various_lengths(
        model, batch["input_ids"], batch["attention_mask"], tokenizer.convert_tokens_to_ids(code), max_length
    )
    model.save_pretrained(folder)
    generation = {"bos_token_id": 0, "decoder_start_token_id": 2, "eos_token_id": 2, "pad_token_id": 1}
    generation.update(RELEASED_GENERATION[family], max_length=max_length)
    (folder / "generation_config.json").write_text(json.dumps(generation), encoding="utf-8")
    return folder
