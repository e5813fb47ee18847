"""Writes tests/data/trained_tiny.npz: the tiny preset trained 150 steps on the built-in task, which the decoding
parity tests and benchmarks/bf16_decoding.py decode. Run from the repository root:
`python tests/data/make_trained_tiny.py [STEPS [OUT.npz]]` (SENTENCES=n in the environment: validation sentences).

At 150 steps the model translates about half of its validation sentences exactly: its distributions are trained
ones (peaked, with EOS where sentences end) but still hold near-ties, where a decoder's precision shows.

Tests decode these saved weights instead of training a model themselves: float32 rounding differs between CPUs,
so a model trained inside a test is another model on each machine, and a claim about its decoding (how many
sentences two searches agree on) would hold on one machine and fail on the next.

The file holds the config (JSON), the float32 parameters (`params/<flax path>`), the tokenizer (the serialized
SentencePiece model), the validation sources as padded ids (`sources`), their texts (`source_texts`) and the
reference translations (`target_texts`); `tests.helpers.saved.load_saved_model` reads it.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
from flax.traverse_util import flatten_dict

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from jax_transformer.data.batching import encode_corpus
from jax_transformer.data.default_task import TOKENIZER_MODEL_TYPE, TOKENIZER_VOCAB_SIZE, default_pairs  # noqa: E402
from jax_transformer.data.tokenizer import Tokenizer
from jax_transformer.decoding import (
    decoders,
    translation,  # noqa: E402
)
from jax_transformer.settings.config import OptimConfig, preset  # noqa: E402
from jax_transformer.training.trainer import create_train_state, make_train_step  # noqa: E402
from tests.helpers.batches import corpus_batches, pad_rows  # noqa: E402

OUT = Path(__file__).resolve().parent / "trained_tiny.npz"
STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 150
SENTENCES = int(os.environ.get("SENTENCES", 256))


def main(out: Path = OUT) -> None:
    start = time.time()
    pairs = default_pairs("train")
    tokenizer = Tokenizer.train(pairs.sources + pairs.targets, TOKENIZER_VOCAB_SIZE, model_type=TOKENIZER_MODEL_TYPE)
    config = preset("tiny", src_vocab_size=tokenizer.vocab_size, tgt_vocab_size=tokenizer.vocab_size, max_len=32)
    batches = corpus_batches(encode_corpus(pairs, tokenizer, config.max_len), config, 64)
    opt = OptimConfig(lr_scale=2.0, warmup_steps=400)
    state, step = create_train_state(config, opt, seed=0), make_train_step(config, opt)
    valid = default_pairs("valid", n=SENTENCES)
    src = pad_rows(translation.encode_sources(tokenizer, valid.sources, config))
    for i in range(1, STEPS + 1):
        state, sums = step(state, next(batches))
        if i % 500 == 0 or i == STEPS:
            tokens, _ = decoders.greedy_search(state.params, config, src)
            right = sum(tokenizer.decode(t) == ref for t, ref in zip(tokens, valid.targets))
            loss = float(sums["loss"]) / float(sums["tokens"])
            print(f"step {i}: loss {loss:.3f}, greedy exact on {right} of {SENTENCES} validation sentences", flush=True)
    params = {"params/" + "/".join(k): np.asarray(v) for k, v in flatten_dict(state.params).items()}
    np.savez_compressed(
        out,
        config=json.dumps(config.to_dict()),
        tokenizer=np.frombuffer(tokenizer.to_bytes(), dtype=np.uint8),
        sources=src,
        source_texts=np.array(valid.sources),
        target_texts=np.array(valid.targets),
        made_by=f"{Path(__file__).name}: {STEPS} steps on {platform.processor() or platform.machine()}",
        **params,
    )
    print(f"wrote {out} ({out.stat().st_size / 1024:.0f} KiB) in {time.time() - start:.0f} s")


if __name__ == "__main__":
    main(Path(sys.argv[2]) if len(sys.argv) > 2 else OUT)
