"""Packed rows: several sentence pairs in one row (segment ids, positions restarting at each pair) give every pair
the logits, loss and gradients it gets alone, in the Flax model and in the PyTorch twin, and the twins agree on
the packed batch: for rows packed by hand, and for a batch the data pipeline's packer cut from real tokenized text.

Why the match is (nearly) exact: a key of another pair gets the score finfo.min, whose exp underflows to exactly
0, so each softmax sees only its own pair; positions index the same table rows. What remains is float32
summation order (a longer row sums more exact zeros in another order), so logits agree to ~1e-6 as in
test_forward_parity.py, and the tolerance is that file's 1e-5 absolute.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jax_transformer.interop.port import flax_to_torch
from jax_transformer.model.transformer import Transformer, init_params
from jax_transformer.training.losses import loss_sums
from tests.helpers.batches import packed_pairs, unpacked
from tests.helpers.configs import PARITY_CONFIGS as CONFIGS
from tests.helpers.twins import max_abs_diff, t, torch_twin, twin_models
from torch_reference.losses import loss_sums as torch_loss_sums

LOGIT_TOL = 1e-5  # float32 summation order only (see the module docstring)
GRAD_TOL = 1e-4  # relative to the largest gradient, as test_loss_grad_parity.py

# Three pairs (source ids + EOS, target ids): two packed into row 0, one into row 1; rows 16 wide.
PAIRS = [([5, 9, 13, 2], [7, 8, 11]), ([21, 6, 2], [30, 31, 32, 33, 34]), ([17, 18, 19, 20, 22, 2], [40, 41])]
ROWS = [[0, 1], [2]]
WIDTH = 16


def _alone(pair):
    """A one-row batch holding only `pair`, right-padded to WIDTH (one shape for every pair: one compilation)."""
    src, tgt = pair
    batch = {key: np.zeros((1, WIDTH), np.int32) for key in ("src", "tgt_in", "tgt_out")}
    batch["src"][0, : len(src)] = src
    batch["tgt_in"][0, : len(tgt) + 1] = [1] + tgt
    batch["tgt_out"][0, : len(tgt) + 1] = tgt + [2]
    return batch


def _packed():
    """The pairs packed by ROWS, and for every pair (row, source slice, target slice)."""
    batch = {
        k: np.zeros((len(ROWS), WIDTH), np.int32)
        for k in ("src", "tgt_in", "tgt_out", "src_segments", "tgt_segments", "src_positions", "tgt_positions")
    }
    where = {}
    for r, members in enumerate(ROWS):
        s_at = t_at = 0
        for segment, i in enumerate(members, start=1):
            src, tgt = PAIRS[i]
            ns, nt = len(src), len(tgt) + 1
            batch["src"][r, s_at : s_at + ns] = src
            batch["tgt_in"][r, t_at : t_at + nt] = [1] + tgt
            batch["tgt_out"][r, t_at : t_at + nt] = tgt + [2]
            batch["src_segments"][r, s_at : s_at + ns] = segment
            batch["tgt_segments"][r, t_at : t_at + nt] = segment
            batch["src_positions"][r, s_at : s_at + ns] = np.arange(ns)
            batch["tgt_positions"][r, t_at : t_at + nt] = np.arange(nt)
            where[i] = (r, slice(s_at, s_at + ns), slice(t_at, t_at + nt))
            s_at, t_at = s_at + ns, t_at + nt
    return batch, where


def _flax_logits(model, params, batch):
    packing = {k: jnp.asarray(v) for k, v in batch.items() if k.endswith(("segments", "positions"))}
    return np.asarray(
        model.apply({"params": params}, jnp.asarray(batch["src"]), jnp.asarray(batch["tgt_in"]), **packing)
    )


def _torch_logits(model, batch):
    tensors = {k: t(v) for k, v in batch.items() if k != "tgt_out"}
    with torch.no_grad():
        return model(tensors.pop("src"), tensors.pop("tgt_in"), **tensors).cpu().numpy()


@pytest.fixture(params=["post_sinusoidal_tied_relu", "pre_learned_untied_gelu_nobias"])
def twins(request):
    config = CONFIGS[request.param]
    params = init_params(config, seed=3)
    torch_model = torch_twin(config, params)
    return request.param, config, Transformer(config), params, torch_model


def test_each_packed_pair_gets_its_own_logits_in_both_frameworks(twins, parity_report):
    name, config, model, params, torch_model = twins
    packed, where = _packed()
    flax_packed, torch_packed = _flax_logits(model, params, packed), _torch_logits(torch_model, packed)
    worst = {"flax packed vs alone": 0.0, "torch packed vs alone": 0.0, "flax vs torch, packed": 0.0}
    for i, pair in enumerate(PAIRS):
        r, _, t = where[i]
        alone, n = _alone(pair), len(pair[1]) + 1  # the pair's target positions (BOS + target)
        flax_alone, torch_alone = _flax_logits(model, params, alone)[0, :n], _torch_logits(torch_model, alone)[0, :n]
        worst["flax packed vs alone"] = max(
            worst["flax packed vs alone"], float(np.abs(flax_packed[r, t] - flax_alone).max())
        )
        worst["torch packed vs alone"] = max(
            worst["torch packed vs alone"], float(np.abs(torch_packed[r, t] - torch_alone).max())
        )
    real = packed["tgt_segments"] != 0
    worst["flax vs torch, packed"] = float(np.abs(flax_packed - torch_packed)[real].max())
    for check, value in worst.items():
        parity_report(f"logits, {check}", name, value, LOGIT_TOL)
        assert value <= LOGIT_TOL, check
    # The check can fail: without segment ids the first row's second pair sees the first pair.
    unpacked = _flax_logits(model, params, {k: packed[k] for k in ("src", "tgt_in")})
    r, _, t = where[1]
    alone = _flax_logits(model, params, _alone(PAIRS[1]))[0, : len(PAIRS[1][1]) + 1]
    assert np.abs(unpacked[r, t] - alone).max() > 1e-2


def test_packed_loss_and_gradients_equal_the_pairs_alone(twins, parity_report):
    """Loss sums are sums over real target tokens, so the packed batch's loss and gradient equal the sums over the
    pairs computed one by one: in Flax, and the twin's gradient on the packed batch equals Flax's."""
    name, config, model, params, torch_model = twins
    packed, _ = _packed()

    def summed(p, batch):
        packing = {k: v for k, v in batch.items() if k.endswith(("segments", "positions"))}
        logits = model.apply({"params": p}, batch["src"], batch["tgt_in"], **packing)
        sums = loss_sums(logits, batch["tgt_out"], config.pad_id, 0.1)
        return sums["loss"], sums

    grad_fn = jax.jit(jax.grad(summed, has_aux=True))
    packed_grads, packed_sums = grad_fn(params, {k: jnp.asarray(v) for k, v in packed.items()})
    alone_grads, alone_loss, alone_tokens = None, 0.0, 0.0
    for pair in PAIRS:
        g, s = grad_fn(params, {k: jnp.asarray(v) for k, v in _alone(pair).items()})
        alone_grads = g if alone_grads is None else jax.tree_util.tree_map(jnp.add, alone_grads, g)
        alone_loss, alone_tokens = alone_loss + float(s["loss"]), alone_tokens + float(s["tokens"])
    assert float(packed_sums["tokens"]) == alone_tokens == sum(len(t) + 1 for _, t in PAIRS)
    loss_diff = abs(float(packed_sums["loss"]) - alone_loss) / alone_loss
    scale = max(float(jnp.abs(g).max()) for g in jax.tree_util.tree_leaves(alone_grads))
    grad_diff = (
        max(
            float(jnp.abs(a - b).max())
            for a, b in zip(jax.tree_util.tree_leaves(packed_grads), jax.tree_util.tree_leaves(alone_grads))
        )
        / scale
    )

    # The twin on the same packed batch (train mode for autograd, dropout 0 in these configs' eval sense).
    torch_model.train()
    for module in torch_model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    tensors = {k: t(v) for k, v in packed.items()}
    logits = torch_model(
        tensors["src"], tensors["tgt_in"], **{k: v for k, v in tensors.items() if k.endswith(("segments", "positions"))}
    )
    torch_loss_sums(logits, tensors["tgt_out"], config.pad_id, 0.1)["loss"].backward()
    torch_grads = {k: p.grad.cpu().numpy() for k, p in torch_model.named_parameters()}
    flax_as_torch = flax_to_torch(jax.device_get(packed_grads))
    twin_diff = max(float(np.abs(flax_as_torch[k] - torch_grads[k]).max()) for k in torch_grads) / scale

    parity_report("packed loss vs pairs alone, rel", name, loss_diff, 1e-6)
    parity_report("packed gradients vs pairs alone, rel", name, grad_diff, GRAD_TOL)
    parity_report("packed gradients flax vs torch, rel", name, twin_diff, GRAD_TOL)
    assert loss_diff <= 1e-6  # a sum of the same float32 terms in another order: a few ulp
    assert grad_diff <= GRAD_TOL and twin_diff <= GRAD_TOL


@pytest.fixture(scope="module")
def real_packed_batch():
    """A batch cut by the data pipeline's packer (BatchStream, batching="packed") from real text: the built-in
    task's English -> French sentences, tokenized by a SentencePiece model trained on them. (config, batch)."""
    from jax_transformer.data import default_task
    from jax_transformer.data.batching import BatchStream, encode_corpus
    from jax_transformer.data.tokenizer import Tokenizer

    pairs = default_task.default_pairs("train", n=400)
    tokenizer = Tokenizer.train(pairs.sources + pairs.targets, 200, model_type=default_task.TOKENIZER_MODEL_TYPE)
    encoded = encode_corpus(pairs, tokenizer, max_len=32)
    batch = next(BatchStream(encoded, max_tokens=256, batching="packed", seed=1))
    return tokenizer.vocab_size, batch


@pytest.mark.slow
@pytest.mark.parametrize("name", ["post_sinusoidal_tied_relu", "pre_learned_untied_gelu_nobias"])
def test_pairs_packed_by_the_data_pipeline_get_their_own_logits_and_loss(name, real_packed_batch, parity_report):
    """Every pair of the packed batch against the same pair alone in a row of an unpacked batch (one pair per row,
    the bucketed batches' layout), in both frameworks; and the packed loss sums against the unpacked ones."""
    vocab, batch = real_packed_batch
    config = CONFIGS[name].replace(src_vocab_size=vocab, tgt_vocab_size=vocab, max_len=32)
    model, params, torch_model = twin_models(config, seed=4)
    pairs, alone = packed_pairs(batch), unpacked(batch)
    assert len(pairs) > 1.5 * batch["src"].shape[0]  # rows hold several pairs each
    logits = {
        "flax": (_flax_logits(model, params, batch), _flax_logits(model, params, alone)),
        "torch": (_torch_logits(torch_model, batch), _torch_logits(torch_model, alone)),
    }
    for framework, (packed, single) in logits.items():
        worst = max(max_abs_diff(packed[r, m], single[i, : m.sum()]) for i, (r, _, m) in enumerate(pairs))
        parity_report(f"logits, pipeline-packed vs alone, {framework}", name, worst, LOGIT_TOL)
        assert worst <= LOGIT_TOL
        # The loss sums of the packed batch are those of the pairs alone (sums over the same real tokens).
        sums = loss_sums if framework == "flax" else torch_loss_sums
        wrap = jnp.asarray if framework == "flax" else torch.from_numpy
        packed_sums = sums(wrap(packed), wrap(batch["tgt_out"].astype(np.int64)), config.pad_id, 0.1)
        alone_sums = sums(wrap(single), wrap(alone["tgt_out"].astype(np.int64)), config.pad_id, 0.1)
        assert float(packed_sums["tokens"]) == float(alone_sums["tokens"]) == int((batch["tgt_out"] != 0).sum())
        loss_diff = abs(float(packed_sums["loss"]) - float(alone_sums["loss"])) / float(alone_sums["loss"])
        parity_report(f"loss, pipeline-packed vs alone, {framework}, rel", name, loss_diff, 1e-6)
        assert loss_diff <= 1e-6  # the same float32 terms summed in another order: a few ulp
    real = batch["tgt_segments"] != 0
    twin_diff = max_abs_diff(logits["flax"][0][real], logits["torch"][0][real])
    parity_report("logits, pipeline-packed, flax vs torch", name, twin_diff, LOGIT_TOL)
    assert twin_diff <= LOGIT_TOL
