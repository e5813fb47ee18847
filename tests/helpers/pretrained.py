"""Pretrained models of the family, tiny and random, built from their configs (nothing is downloaded): tokenizer files
learned on the built-in task, a MarianMTModel and an FSMTForConditionalGeneration at a trained model's scale, and
EOS raised so outputs end at several lengths."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from jax_transformer.data.tokenizer import unigram_model_bytes

# The Marian tokenizer's SentencePiece models, learned once and saved (`python -m tests.helpers.pretrained` writes
# them): SentencePiece's training gives other pieces from one version to the next (0.2.2 and 0.2.3 do), and with
# them another vocabulary, another random model and other outputs than the tests were written for.
SAVED_SPM = Path(__file__).resolve().parent.parent / "data" / "marian_spm.npz"


def save_marian_spm() -> None:
    """SAVED_SPM from the built-in task: unigram models of 120 pieces for its English and French sides."""
    from jax_transformer.data.default_task import default_pairs

    pairs = default_pairs("train", n=2000)
    models = {"source.spm": pairs.sources, "target.spm": pairs.targets}
    arrays = {name: np.frombuffer(unigram_model_bytes(texts, 120), np.uint8) for name, texts in models.items()}
    np.savez_compressed(SAVED_SPM, **arrays)


def marian_tokenizer_files(folder: Path, separate: bool = False) -> dict[str, int]:
    """MarianTokenizer's files for the built-in task (English -> French) in `folder`: source.spm, target.spm and
    vocab.json (pieces of both, </s> 0, <unk> 1, a language code, <pad> last), or with `separate` a target
    vocabulary of its own, each with </s> 0, <unk> 1, <pad> 2 (one pad_token_id serves both embedding tables, and
    transformers' MarianTokenizer takes the special ids from the source vocabulary). Returns {"src": size, "tgt":
    size, "pad", "eos"}."""

    with np.load(SAVED_SPM) as saved:
        models = {name: saved[name].tobytes() for name in ("source.spm", "target.spm")}
    import sentencepiece as spm

    def vocab_of(names):
        vocab = {"</s>": 0, "<unk>": 1} if not separate else {"</s>": 0, "<unk>": 1, "<pad>": 2}
        for name in names:
            processor = spm.SentencePieceProcessor()
            processor.LoadFromSerializedProto(models[name])
            for i in range(processor.get_piece_size()):
                vocab.setdefault(processor.IdToPiece(i), len(vocab))
        vocab.pop("<s>", None)
        vocab = {piece: i for i, piece in enumerate(vocab)}
        if not separate:
            vocab[">>fr<<"] = len(vocab)
            vocab["<pad>"] = len(vocab)
        return vocab

    folder.mkdir(parents=True, exist_ok=True)
    for name, data in models.items():
        (folder / name).write_bytes(data)
    source = vocab_of(["source.spm", "target.spm"] if not separate else ["source.spm"])
    (folder / "vocab.json").write_text(json.dumps(source), encoding="utf-8")
    target = source
    if separate:
        target = vocab_of(["target.spm"])
        (folder / "target_vocab.json").write_text(json.dumps(target), encoding="utf-8")
    options = {"source_lang": "en", "target_lang": "fr", "separate_vocabs": separate}
    (folder / "tokenizer_config.json").write_text(json.dumps(options), encoding="utf-8")
    return {"src": len(source), "tgt": len(target), "pad": source["<pad>"], "eos": source["</s>"]}


def learn_bpe(texts: Sequence[str], lang: str, merges: int) -> tuple[list[tuple[str, str]], list[str]]:
    """BPE merges learned on Moses-tokenized `texts` (most frequent pair first, ties by the pair), and the symbols
    they make: enough of fastBPE to build test models."""
    import collections

    import sacremoses

    tokenize = sacremoses.MosesTokenizer(lang=lang).tokenize
    counts = collections.Counter(w for t in texts for w in tokenize(t, aggressive_dash_splits=True, escape=True))
    words = {tuple(w[:-1]) + (w[-1] + "</w>",): c for w, c in counts.items()}
    learned = []
    for _ in range(merges):
        pairs = collections.Counter()
        for word, count in words.items():
            for pair in zip(word, word[1:]):
                pairs[pair] += count
        if not pairs:
            break
        best = max(pairs, key=lambda pair: (pairs[pair], pair))
        learned.append(best)
        merged = {}
        for word, count in words.items():
            out, i = [], 0
            while i < len(word):
                if i < len(word) - 1 and (word[i], word[i + 1]) == best:
                    out.append(word[i] + word[i + 1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] = count
        words = merged
    symbols = {s for w in words for s in w} | {a + b for a, b in learned} | {c for w in words for s in w for c in s}
    return learned, sorted(symbols)


def fsmt_tokenizer_files(folder: Path) -> dict[str, int]:
    """FSMTTokenizer's files for the built-in task (English -> French): vocab-src.json, vocab-tgt.json (fairseq's
    specials <s> 0, <pad> 1, </s> 2, <unk> 3 first), merges.txt, tokenizer_config.json."""
    from jax_transformer.data.default_task import default_pairs

    pairs = default_pairs("train", n=2000)
    source_merges, source_symbols = learn_bpe(pairs.sources, "en", 150)
    target_merges, target_symbols = learn_bpe(pairs.targets, "fr", 150)
    merges = source_merges + [m for m in target_merges if m not in source_merges]

    def vocab_of(symbols):
        vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
        for symbol in symbols:
            vocab.setdefault(symbol, len(vocab))
        return vocab

    folder.mkdir(parents=True, exist_ok=True)
    source, target = vocab_of(source_symbols), vocab_of(target_symbols)
    (folder / "vocab-src.json").write_text(json.dumps(source), encoding="utf-8")
    (folder / "vocab-tgt.json").write_text(json.dumps(target), encoding="utf-8")
    (folder / "merges.txt").write_text("".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8")
    options = {"langs": ["en", "fr"], "do_lower_case": False, "model_max_length": 1024}
    (folder / "tokenizer_config.json").write_text(json.dumps(options), encoding="utf-8")
    return {"src": len(source), "tgt": len(target)}


TINY_HF = dict(
    d_model=32,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=64,
    decoder_ffn_dim=64,
    max_position_embeddings=64,
)


def tiny_marian(sizes: Mapping[str, int], *, shared: bool = True, seed: int = 0):
    """A random MarianMTModel (eager attention, swish, scaled embeddings, a random final_logits_bias) for
    vocabularies of `sizes` (marian_tokenizer_files), its weights at a trained model's scale."""
    import torch
    from transformers import MarianConfig, MarianMTModel

    torch.manual_seed(seed)
    config = MarianConfig(
        vocab_size=sizes["src"],
        decoder_vocab_size=None if shared else sizes["tgt"],
        share_encoder_decoder_embeddings=shared,
        pad_token_id=sizes["pad"],
        eos_token_id=sizes["eos"],
        decoder_start_token_id=sizes["pad"],
        activation_function="swish",
        scale_embedding=True,
        attn_implementation="eager",
        **TINY_HF,
    )
    model = _trained_scale(MarianMTModel(config).eval())
    with torch.no_grad():
        model.final_logits_bias.normal_(0.0, 0.1)
    return model


def tiny_fsmt(sizes: Mapping[str, int], seed: int = 0):
    """A random FSMTForConditionalGeneration (eager attention) for vocabularies of `sizes` (fsmt_tokenizer_files)."""
    import torch
    from transformers import FSMTConfig, FSMTForConditionalGeneration

    torch.manual_seed(seed)
    config = FSMTConfig(
        langs=["en", "fr"],
        src_vocab_size=sizes["src"],
        tgt_vocab_size=sizes["tgt"],
        attn_implementation="eager",
        **TINY_HF,
    )
    return _trained_scale(FSMTForConditionalGeneration(config).eval())


def _trained_scale(model):
    """Weights redrawn at the scale of a trained model's, in place: transformers' init (std 0.02) leaves a tiny
    model's outputs flat and the same for every source. Matrices get std 1/sqrt(fan_in); embedding rows std
    1/sqrt(d_model) when the model scales them by sqrt(d_model), else std 1; logits come out of order 1-10."""
    import torch

    d = model.config.d_model
    rows = d**-0.5 if model.config.scale_embedding else 1.0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "embed_positions" in name:  # the sinusoids
                continue
            if "embed_tokens" in name or "shared" in name:
                p.normal_(0.0, rows)
            elif p.dim() == 2:
                p.normal_(0.0, p.shape[1] ** -0.5)
        for module in model.modules():  # the pad rows stay zero, as in the released models
            if isinstance(module, torch.nn.Embedding) and module.padding_idx is not None:
                module.weight[module.padding_idx] = 0.0
    return model


def end_at_various_lengths(model, input_ids, attention_mask, max_length: int) -> None:
    """Raises EOS in a random transformers model (in place) so that its greedy outputs for these sources end at
    several different lengths, none of them near a tie.

    Random models end all rows at once or never. Raising EOS changes no other token's rank, so a greedy output
    runs as it does with EOS banned until the first step where EOS's raised logit beats the best other one. From
    the EOS-banned run's logits each (row, step) gets the raise it needs; the raise picked lies halfway between two
    neighbouring needs, where outputs end at three or more lengths, with the widest margin of those. Marian raises
    EOS by adding to final_logits_bias; FSMT (no bias) by scaling EOS's output row, which helps where its logit is
    positive."""
    import torch

    eos, pad = model.config.eos_token_id, model.config.pad_token_id
    banned = [[eos]] + ([[pad]] if model.config.model_type == "marian" else [])
    with torch.no_grad():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_length=max_length,
            num_beams=1,
            do_sample=False,
            bad_words_ids=banned,
            output_logits=True,
            return_dict_in_generate=True,
        )
    logits = torch.stack(out.logits, dim=1).numpy()  # (B, T, V), as the model gave them
    eos_logit = logits[..., eos]
    others = np.delete(logits, [eos] + ([pad] if len(banned) > 1 else []), axis=-1).max(axis=-1)
    marian = model.config.model_type == "marian"
    with np.errstate(divide="ignore", invalid="ignore"):
        need = others - eos_logit if marian else np.where(eos_logit > 0, others / eos_logit, np.inf)  # (B, T)
    cuts = np.unique(need[np.isfinite(need) & (need > (0 if marian else 1))])
    best, best_gap = None, -1.0
    for lo, hi in zip(cuts, cuts[1:]):
        raise_ = (lo + hi) / 2
        ends = need < raise_
        lengths = np.where(ends.any(axis=1), ends.argmax(axis=1) + 1, max_length)
        gap = (hi - lo) / 2 / (1.0 if marian else raise_)
        if len(set(lengths.tolist())) >= 3 and lengths.max() >= 3 and gap > best_gap:
            best, best_gap = raise_, gap
    if best is None:
        raise AssertionError("no EOS raise makes these outputs end at three lengths; choose other sources or seed")
    with torch.no_grad():
        if marian:
            model.final_logits_bias[0, eos] += float(best)
        else:
            model.model.decoder.output_projection.weight[eos] *= float(best)


def assert_same_logits(model, params, config, tokenizer, what: str, atol: float = 1e-5):
    """A transformers model (`model`) and this project's (`params`, `config`) give the same logits, within `atol`
    (float32: parity_tests/test_pretrained.py justifies 1e-5), on 6 validation pairs of the built-in task encoded
    by `tokenizer`; the difference is printed."""
    import torch

    from jax_transformer.data.default_task import default_pairs
    from jax_transformer.model.transformer import Transformer

    pairs = default_pairs("valid", n=6)
    src_rows = [tokenizer.encode(s) + [config.eos_id] for s in pairs.sources]
    tgt_rows = [[config.start_id] + tokenizer.encode(t, side="target") for t in pairs.targets]
    src = np.full((6, max(map(len, src_rows))), config.pad_id, np.int32)
    tgt = np.full((6, max(map(len, tgt_rows))), config.pad_id, np.int32)
    for r in range(6):
        src[r, : len(src_rows[r])], tgt[r, : len(tgt_rows[r])] = src_rows[r], tgt_rows[r]
    ours = np.asarray(Transformer(config).apply({"params": params}, src, tgt))
    real = tgt != config.pad_id
    real[:, 0] = True
    with torch.no_grad():
        theirs = model(
            input_ids=torch.tensor(src, dtype=torch.long),
            attention_mask=torch.tensor(src != config.pad_id, dtype=torch.long),
            decoder_input_ids=torch.tensor(tgt, dtype=torch.long),
            decoder_attention_mask=torch.tensor(real, dtype=torch.long),
        ).logits.numpy()
    diff = float(np.abs(ours - theirs)[real].max())
    print(f"[pretrained] {what}: largest logit difference {diff:.3e} (largest |logit| {np.abs(theirs).max():.2f})")
    assert np.abs(theirs).max() > 1.0
    assert diff <= atol


if __name__ == "__main__":
    save_marian_spm()
    print(f"wrote {SAVED_SPM}")
