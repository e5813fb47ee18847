"""Alignments against transformers: a tiny imported model's alignments (the search's, and teacher-forced
scoring's) checked against the argmax of transformers' own `cross_attentions` of the same layer (eager attention,
output_attentions=True), averaged over heads, teacher-forced on the decoded tokens, over the source positions that
are not PAD or EOS (fairseq's `extract_hard_alignment` rule). Exact: the probabilities agree to ~1e-6 (the logits
do to 1e-5: parity_tests/test_pretrained.py), and a wrong layer, row or step moves an argmax."""

from __future__ import annotations

import numpy as np


def their_argmax(folder, src: np.ndarray, tokens: np.ndarray, config, layer: int) -> np.ndarray:
    """(B, L) the argmax over non-PAD, non-EOS source positions of transformers' layer-`layer` cross-attention,
    averaged over heads, teacher-forced on `tokens` (B, L), for the model saved in `folder`."""
    import torch
    from transformers import AutoModelForSeq2SeqLM

    model = AutoModelForSeq2SeqLM.from_pretrained(folder, attn_implementation="eager").eval()
    tgt_in = np.concatenate([np.full((len(tokens), 1), config.start_id), tokens[:, :-1]], axis=1)
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor(src, dtype=torch.long),
            attention_mask=torch.tensor(src != config.pad_id, dtype=torch.long),
            decoder_input_ids=torch.tensor(tgt_in, dtype=torch.long),
            output_attentions=True,
        )
    probs = out.cross_attentions[layer].mean(dim=1).numpy()  # (B, L, S)
    words = (src != config.pad_id) & (src != config.eos_id)
    return np.where(words[:, None, :], probs, -1.0).argmax(axis=-1)


def check_against_transformers(folder, model, tokenizer, sentences, *, max_length, beams, layer, forced_bos=None):
    """Decodes `sentences` with `model` (hub.read_pretrained's, `tokenizer` its languages set) by transformers'
    rules, `beams` hypotheses each, with alignments by decoder layer `layer` (negative: from the top), and asserts
    that every hypothesis's positions, the forced code's and EOS's included, and teacher-forced scoring's on the
    best, are transformers' argmax, and that the word pairs are sorted, each once, in range."""
    from jax_transformer.decoding import alignment, decoders
    from jax_transformer.decoding import schedule as schedules

    config = model.config
    rows = [tokenizer.encode(s) + [config.eos_id] for s in sentences]
    src = np.full((len(rows), max(map(len, rows))), config.pad_id, np.int32)
    for r, row in enumerate(rows):
        src[r, : len(row)] = row
    layer %= config.num_decoder_layers
    decoder = decoders.transformers_decoder(
        config, max_length=max_length, num_beams=beams, n_best=beams, forced_bos=forced_bos, alignment_layer=layer
    )
    found = decoder(model.params, src, schedules.Whole())
    eos = found.tokens == config.eos_id
    real = (np.cumsum(eos, axis=-1) - eos) == 0  # (B, n, L): tokens up to EOS (Marian may produce its PAD id)
    for k in range(beams):
        theirs = their_argmax(folder, src, found.tokens[:, k], config, layer)
        assert np.array_equal(np.where(real[:, k], found.alignments[:, k], -1), np.where(real[:, k], theirs, -1))
    assert (found.alignments[~real] == -1).all()

    best = found.tokens[:, 0]
    tgt_in = np.concatenate([np.full((len(best), 1), config.start_id), best[:, :-1]], axis=1)
    forced = alignment.teacher_forced_alignments(model.params, config, layer, src, tgt_in)  # (B, L)
    assert np.array_equal(np.where(real[:, 0], forced, -1), np.where(real[:, 0], found.alignments[:, 0], -1))

    for r in range(len(rows)):
        n = int(real[r, 0].sum())
        text = alignment.sentence_alignment(tokenizer, config, rows[r], best[r, :n], found.alignments[r, 0, :n])
        pairs = [tuple(map(int, pair.split("-"))) for pair in text.split()]
        target_words = max(alignment.word_indices(tokenizer, best[r, :n], "target", config), default=-1) + 1
        source_words = max(alignment.word_indices(tokenizer, rows[r], "source", config)) + 1
        assert pairs == sorted(set(pairs)) and all(0 <= i < source_words and 0 <= j < target_words for i, j in pairs)
    return found
