"""Checks 1-3 of the parity contract: attention, masks, encoder/decoder outputs, logits and log-probabilities.

Tolerance for every forward quantity here: absolute 1e-5. Both frameworks evaluate the same float32 formulas; what
differs is the order in which matmul/einsum/softmax reductions add float32 numbers (different BLAS kernels). Each
such reordering perturbs a sum by a few ulp of its magnitude (float32 ulp at 1.0 is 1.2e-7); the activations here
are LayerNorm-ed to order 1 and logits stay below ~10, so a few layers of such noise sit around 1e-6. A wrong
formula, transposed weight, misplaced mask or norm gives differences of order 1e-2 to 1 (see test_port.py's
deliberate-error test), so 1e-5 separates the two by more than two orders of magnitude in both directions.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import torch_reference
from jax_transformer.model import masks
from jax_transformer.model.transformer import MultiHeadAttention, attention_maps
from tests.helpers.batches import make_batch
from tests.helpers.configs import BASE
from tests.helpers.configs import PARITY_CONFIGS as CONFIGS
from tests.helpers.twins import max_abs_diff, t, twin_models

ATOL = 1e-5  # see module docstring


def test_attention_probabilities_every_layer_and_head(config_case, parity_report):
    name, cfg = config_case
    model, params, torch_model = twin_models(cfg, seed=1)
    batch = make_batch(cfg, seed=1)
    src, tgt_in = batch["src"], batch["tgt_in"]
    _, state = model.apply({"params": params}, src, tgt_in, mutable=["intermediates"])
    flax_maps = attention_maps(state["intermediates"])
    with torch.no_grad(), torch_model.record_attention() as torch_maps:
        torch_model(t(src), t(tgt_in))
    expected = {
        f"{stack}/layer_{i}/{kind}"
        for stack, n, kinds in (
            ("encoder", cfg.num_encoder_layers, ["self_attention"]),
            ("decoder", cfg.num_decoder_layers, ["self_attention", "cross_attention"]),
        )
        for i in range(n)
        for kind in kinds
    }
    assert set(flax_maps) == expected and set(torch_maps) == expected
    worst = 0.0
    for key in sorted(expected):
        assert flax_maps[key].shape[1] == cfg.num_heads
        worst = max(worst, max_abs_diff(flax_maps[key], torch_maps[key]))
        # probabilities: rows sum to one, masked keys get (numerically) nothing
        np.testing.assert_allclose(np.asarray(flax_maps[key]).sum(-1), 1.0, atol=1e-5)
    parity_report("attention probabilities (all layers/heads)", name, worst, ATOL)
    assert worst <= ATOL


def test_attention_module_output(config_case, parity_report):
    """One attention module, self and cross, with a padding+causal mask: output (B, Tq, D)."""
    name, cfg = config_case
    _, params, torch_model = twin_models(cfg, seed=2)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 7, cfg.d_model)).astype(np.float32)
    memory = rng.standard_normal((3, 5, cfg.d_model)).astype(np.float32)
    tokens = np.array([[5, 6, 7, 8, 9, 10, 11], [5, 6, 7, 0, 0, 0, 0], [0] * 7])
    self_mask = masks.decoder_self_mask(jnp.asarray(tokens), cfg.pad_id)
    cross_mask = masks.padding_mask(jnp.asarray(tokens[:, :5]), cfg.pad_id)
    layer = params["decoder"]["layer_0"]
    worst = 0.0
    for kind, mask, kv in (("self_attention", self_mask, x), ("cross_attention", cross_mask, memory)):
        out = MultiHeadAttention(cfg, cross=kind == "cross_attention").apply({"params": layer[kind]}, x, kv, mask)
        torch_module = getattr(torch_model.decoder.layers[0], kind)
        with torch.no_grad():
            ref = torch_module(t(x), t(kv), t(np.array(mask)))
        worst = max(worst, max_abs_diff(out, ref))
        assert np.isfinite(np.asarray(out)).all()  # the all-padding row included
    parity_report("attention module output", name, worst, ATOL)
    assert worst <= ATOL


def _forward_both(model, params, torch_model, src, tgt_in):
    memory = model.apply({"params": params}, src, method=model.encode)
    hidden = model.apply({"params": params}, memory, src, tgt_in, method=model.decoder_hidden)
    logits = model.apply({"params": params}, hidden, method=model.logits)
    with torch.no_grad():
        t_memory = torch_model.encode(t(src))
        t_hidden = torch_model.decoder_hidden(t_memory, t(src), t(tgt_in))
        t_logits = torch_model.logits(t_hidden)
    return {
        "encoder output": (memory, t_memory),
        "decoder output": (hidden, t_hidden),
        "logits": (logits, t_logits),
        "log-probabilities": (jax.nn.log_softmax(logits, -1), torch.log_softmax(t_logits, -1)),
    }


@pytest.mark.parametrize("seed", [0, 1])
def test_encoder_decoder_logits(config_case, seed, parity_report):
    name, cfg = config_case
    model, params, torch_model = twin_models(cfg, seed=seed)
    batch = make_batch(cfg, seed=seed)
    src, tgt_in = batch["src"], batch["tgt_in"]
    results = _forward_both(model, params, torch_model, src, tgt_in)
    for quantity, (ours, theirs) in results.items():
        assert np.isfinite(np.asarray(ours)).all(), f"{quantity}: non-finite values (all-padding row?)"
        diff = max_abs_diff(ours, theirs)
        parity_report(quantity, f"{name} seed {seed}", diff, ATOL)
        assert diff <= ATOL, f"{quantity}: {diff}"
    # the entry point used for training agrees with encode -> decode
    full = model.apply({"params": params}, src, tgt_in)
    assert max_abs_diff(full, results["logits"][0]) == 0.0


@pytest.mark.slow
def test_base_model_logits(parity_report):
    """The paper's base configuration, 6+6 layers of width 512: same 1e-5 bound on logits and probabilities."""
    model, params, torch_model = twin_models(BASE, seed=0)
    batch = make_batch(BASE, seed=0)
    src, tgt_in = batch["src"], batch["tgt_in"]
    results = _forward_both(model, params, torch_model, src, tgt_in)
    for quantity, (ours, theirs) in results.items():
        diff = max_abs_diff(ours, theirs)
        parity_report(quantity, "base", diff, ATOL)
        assert diff <= ATOL, f"{quantity}: {diff}"
    probs = jax.nn.softmax(results["logits"][0], -1)
    diff = max_abs_diff(probs, torch.softmax(results["logits"][1], -1))
    parity_report("probabilities", "base", diff, ATOL)
    assert diff <= ATOL
    _, state = model.apply({"params": params}, src, tgt_in, mutable=["intermediates"])
    with torch.no_grad(), torch_model.record_attention() as torch_maps:
        torch_model(t(src), t(tgt_in))
    worst = max(max_abs_diff(v, torch_maps[k]) for k, v in attention_maps(state["intermediates"]).items())
    parity_report("attention probabilities (all layers/heads)", "base", worst, ATOL)
    assert worst <= ATOL


# --- masks: the masks themselves and their effect --------------------------------------------------------


def test_masks_identical_in_both_frameworks(parity_report):
    cfg = CONFIGS["post_sinusoidal_tied_relu"]
    batch = make_batch(cfg)
    src, tgt_in = batch["src"], batch["tgt_in"]
    pairs = {
        "padding": (masks.padding_mask(jnp.asarray(src), 0), torch_reference.padding_mask(t(src), 0)),
        "causal": (masks.causal_mask(6), torch_reference.causal_mask(6)),
        "decoder self": (
            masks.decoder_self_mask(jnp.asarray(tgt_in), 0),
            torch_reference.decoder_self_mask(t(tgt_in), 0),
        ),
    }
    for name, (ours, theirs) in pairs.items():
        assert np.asarray(ours).dtype == np.bool_ and theirs.dtype == torch.bool
        np.testing.assert_array_equal(np.asarray(ours), theirs.cpu().numpy(), err_msg=name)
    parity_report("masks (padding, causal, combined)", "exact", 0.0, 0.0)
    # polarity: True = may attend
    pad = np.asarray(pairs["padding"][0])[:, 0, 0, :]
    np.testing.assert_array_equal(pad, src != 0)
    causal = np.asarray(pairs["causal"][0])[0, 0]
    assert causal[3, 2] and not causal[2, 3] and causal.trace() == 6


def test_padding_and_future_tokens_have_no_effect(config_case, parity_report):
    """The masks' effect, in both frameworks: appending padding leaves real positions unchanged, and changing a
    later target token leaves earlier logits unchanged (the decoder cannot look ahead)."""
    name, cfg = config_case
    model, params, torch_model = twin_models(cfg, seed=3)
    batch = make_batch(cfg, seed=3)
    src, tgt_in = batch["src"], batch["tgt_in"]
    logits = np.asarray(model.apply({"params": params}, src, tgt_in))
    with torch.no_grad():
        t_logits = torch_model(t(src), t(tgt_in)).cpu().numpy()
    padded_src = np.pad(src, ((0, 0), (0, 5)))
    padded_tgt = np.pad(tgt_in, ((0, 0), (0, 4)))
    more_pad = np.asarray(model.apply({"params": params}, padded_src, padded_tgt))[:, : tgt_in.shape[1]]
    with torch.no_grad():
        t_more_pad = torch_model(t(padded_src), t(padded_tgt)).cpu().numpy()[:, : tgt_in.shape[1]]
    # rows with real tokens; an all-padding row attends uniformly to every (masked) key, so its values
    # depend on how many keys there are and are meaningless by design (they only need to be finite)
    rows = (src != 0).any(1)
    real = (tgt_in != 0) & rows[:, None]
    diff_pad = max(np.abs(more_pad - logits)[real].max(), np.abs(t_more_pad - t_logits)[real].max())
    future = tgt_in.copy()
    future[:, 5:] = 7  # rewrite positions 5.. ; logits at positions < 5 must not move
    changed = np.asarray(model.apply({"params": params}, src, future))
    with torch.no_grad():
        t_changed = torch_model(t(src), t(future)).cpu().numpy()
    diff_future = max(
        np.abs(changed[rows, :5] - logits[rows, :5]).max(), np.abs(t_changed[rows, :5] - t_logits[rows, :5]).max()
    )
    parity_report("mask effect: extra padding", name, diff_pad, ATOL)
    parity_report("mask effect: future target tokens", name, diff_future, ATOL)
    assert diff_pad <= ATOL and diff_future <= ATOL
    # and the rewrite did change the later positions (the check can fail)
    assert np.abs(changed[:, 5:] - logits[:, 5:]).max() > 1e-3


def test_all_padding_row_is_finite_in_both():
    """A sequence with every key masked (all padding) gives finite outputs, never NaN, in both frameworks."""
    cfg = CONFIGS["post_sinusoidal_tied_relu"]
    model, params, torch_model = twin_models(cfg)
    src = np.zeros((2, 6), dtype=np.int64)
    tgt = np.zeros((2, 4), dtype=np.int64)
    ours = np.asarray(model.apply({"params": params}, src, tgt))
    with torch.no_grad():
        theirs = torch_model(t(src), t(tgt)).cpu().numpy()
    assert np.isfinite(ours).all() and np.isfinite(theirs).all()
    assert max_abs_diff(ours, theirs) <= ATOL
