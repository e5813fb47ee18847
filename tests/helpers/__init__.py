"""The helpers shared by tests/, parity_tests/ and benchmarks/ (none of them is a test), one module per kind:

- configs: the parity suite's configurations, the paper's base model, the decoding and unit-test models;
- batches: token ids and batches built by hand (padded layouts, packed rows, a corpus's batches);
- twins: the model in both frameworks (ported weights, the twin on its device) and comparing what they compute;
- saved: trained models saved as test data (tests/data/);
- tolerances: bfloat16 tolerances derived from the format;
- tooling: hypothesis settings, counting compilations;
- pretrained: tiny random transformers Marian/FSMT models with real tokenizer files;
- alignments: word alignments checked against transformers' cross-attentions;
- fairseq_constraints: fairseq's constrained beam search, loaded from its sdist and driven with the twin;
- training: train.py runs that take seconds, in this process or a child;
- parallel_paths and pause_at: programs the tests start.

Conventions, everywhere below:
- Token ids are numpy int32 arrays (what the Flax model and the data pipeline use). PyTorch wants int64 indices:
  convert at the call, with `t()` (which turns integer arrays into int64 tensors) or `torch.from_numpy(x).long()`.
- Padding is on the right: a row is its tokens, then `config.pad_id` to the width of the batch.
- Sources end with EOS where a case says so (`make_src`, the "staircase" batches); decoder inputs start with BOS,
  and targets (`tgt_out`) are the decoder inputs shifted left, ending with EOS: tgt_in = BOS w1 .. wn,
  tgt_out = w1 .. wn EOS. Random word ids start past the special ids, so no special token appears by chance.
- Where a case wants it, the last row is all padding (an empty sentence: every key masked, zero target tokens).
- Everything is deterministic in its `seed`: the same call gives the same numbers, so the figures the parity
  tests report and the benchmark's token counts stay comparable from run to run.
- The PyTorch twin runs on `twin_device()`: $TWIN_DEVICE, "cpu" unless `pytest --device cuda` (conftest.py) or
  the environment says otherwise. `torch_twin`, `twin_models` and `t` put models and inputs there; `max_abs_diff`
  and `to_numpy` bring results back.

Nothing here imports jax or torch at module level: the benchmark imports this module before it has set up the
compilation caches that jax and torch read when they are first imported (benchmarks/run.py, isolate_caches).
"""
