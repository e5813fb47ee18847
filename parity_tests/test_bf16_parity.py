"""bfloat16 parity: the Flax model and the PyTorch twin both in bfloat16 mixed precision (`config.dtype`), compared
like with like: logits, loss and every gradient. (Decoded tokens of a trained model: test_decoding_parity.py.)

What both compute: the policy of docs/gpu-tpu.md's table, the twin with explicit casts. Every matmul takes
bfloat16 operands and gives a bfloat16 result (a projection's bias added to the float32 accumulator first, then
rounded once); the residual stream, LayerNorm, the softmax, the logits and the loss are float32. So the twins round
the same values to bfloat16 at the same places, and the lowered-program and dtype tests (tests/test_precision.py)
check that they do. The Flax side is compiled as the library compiles it (`compilation.jit`: XLA's excess precision
off in bfloat16, so XLA keeps every rounding the program asks for).

The tolerances, from bfloat16's 8-bit significand (7 bits stored, 1 implicit). Neighbouring bfloat16 values in
[2^e, 2^(e+1)) are one ulp = 2^(e-7) apart, 2^-7 of the binade's lower end. Before each rounding the twins hold
float32 values that differ only by float32 noise (~1e-7 relative: accumulation order), so nearly every rounding
gives both the same bfloat16 value; where the two float32 values straddle a rounding boundary the results differ
by exactly one ulp. A layer's LayerNorm spreads such a difference over its row but keeps its size (it renormalises
the row), so each layer adds at most about one ulp of the activations' scale to what differs, with either sign:
- logits: at most n_layers (encoder + decoder layers) ulps of bfloat16 at the largest logit's magnitude, the worst
  case of one ulp per layer adding up with no cancellation (`logit_tolerance`);
- loss: 2 x the logit tolerance. The gradient of a token's cross-entropy with respect to its logits is p - q (q the
  label-smoothed target), whose entries sum to at most 2 in absolute value, so logits that move by at most d move
  each token's loss, and so their mean, by at most 2d;
- gradients: a parameter's gradient comes after the forward pass and the backward pass through the layers above
  it, up to 2 x n_layers layers of such differences: per parameter tensor ||g_flax - g_torch|| <= 2 n_layers
  2^-7 ||g_torch||. As tensor norms, not elementwise: an element of a gradient summed over many tokens can be far
  smaller than its terms (cancellation) while its rounding errors are those of the terms, so elementwise relative
  differences of such elements measure the cancellation, not the twins.
The small configurations run every code path; the base model (6+6 layers, as in test_forward_parity.py) is left
out to keep the suite fast. Measured while writing this test (CPU, the same code): its logits 2.0e-2 apart with
tolerance 0.19, its loss 5.9e-4, its gradient tensors up to 0.10 relative with tolerance 0.19.
A wrong mask, a missing scale or a transposed weight moves logits by 0.1 to several units: far above these bounds.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
import torch

from jax_transformer import compilation
from jax_transformer.interop.port import flax_to_torch
from jax_transformer.model.transformer import Transformer
from jax_transformer.training import losses
from tests.helpers.batches import make_batch
from tests.helpers.configs import PARITY_CONFIGS
from tests.helpers.tolerances import gradient_tolerance, layers, logit_tolerance
from tests.helpers.twins import max_abs_diff, t, to_numpy, torch_twin, twin_models
from torch_reference import losses as torch_losses


@functools.cache
def _flax_loss(config, with_grads: bool):
    """jit of (params, src, tgt_in, tgt_out) -> ((loss, logits), grads or None), compiled once per config."""
    model = Transformer(config)

    def loss_fn(params, src, tgt_in, tgt_out):
        logits = model.apply({"params": params}, src, tgt_in)
        return losses.mean_loss(logits, tgt_out, config.pad_id, 0.1), logits

    fn = jax.value_and_grad(loss_fn, has_aux=True) if with_grads else lambda *args: (loss_fn(*args), None)
    return compilation.jit(fn, config.dtype)


def _bf16_forward_and_grads(config, seed: int, with_grads: bool):
    config = config.replace(dtype="bfloat16")
    _, params, torch_model = twin_models(config, seed=seed)
    batch = make_batch(config, seed=seed)
    src, tgt_in, tgt_out = batch["src"], batch["tgt_in"], batch["tgt_out"]
    (loss, logits), grads = _flax_loss(config, with_grads)(params, src, tgt_in, tgt_out)
    with torch.set_grad_enabled(with_grads):
        torch_logits = torch_model(t(src), t(tgt_in))
        torch_loss = torch_losses.mean_loss(torch_logits, t(tgt_out), config.pad_id, 0.1)
    if not with_grads:
        return logits, loss, torch_logits, torch_loss, None, None
    torch_loss.backward()
    torch_grads = {name: to_numpy(p.grad) for name, p in torch_model.named_parameters()}
    return logits, loss, torch_logits, torch_loss, flax_to_torch(grads), torch_grads


def _check_logits_and_loss(name, config, logits, loss, torch_logits, torch_loss, parity_report):
    assert np.asarray(logits).dtype == np.float32 and torch_logits.dtype == torch.float32  # upcast after the matmul
    assert np.isfinite(np.asarray(logits)).all() and torch.isfinite(torch_logits).all()  # the all-padding row too
    tol = logit_tolerance(config, to_numpy(torch_logits))
    diff = max_abs_diff(logits, torch_logits)
    parity_report("bf16 logits", name, diff, tol)
    assert diff <= tol, f"logits differ by {diff:.3e} > {tol:.3e} ({diff / tol * layers(config):.1f} ulps)"
    loss_diff = abs(float(loss) - torch_loss.item())
    parity_report("bf16 loss (label smoothing 0.1)", name, loss_diff, 2 * tol)
    assert loss_diff <= 2 * tol


@pytest.mark.parametrize("seed", [0, 1])
def test_bf16_logits_loss_and_every_gradient(config_case, seed, parity_report):
    name, config = config_case
    logits, loss, torch_logits, torch_loss, grads, torch_grads = _bf16_forward_and_grads(config, seed, True)
    _check_logits_and_loss(f"{name} seed {seed}", config, logits, loss, torch_logits, torch_loss, parity_report)

    assert set(grads) == set(torch_grads)
    largest = max(float(np.abs(g).max()) for g in torch_grads.values())
    worst_name, worst = None, 0.0
    for key, ref in torch_grads.items():
        ours = np.asarray(grads[key], np.float64)
        assert grads[key].dtype == np.float32 and ref.dtype == np.float32  # float32 parameters, float32 gradients
        if key.endswith(".key.bias"):  # zero analytically (see test_loss_grad_parity.py): noise in both
            assert max(np.abs(ours).max(), np.abs(ref).max()) <= gradient_tolerance(config) * largest, key
            continue
        scale = np.linalg.norm(ref)
        assert scale > 0, f"{key}: zero gradient in torch (the check would be vacuous)"
        relative = float(np.linalg.norm(ours - ref) / scale)
        if relative >= worst:
            worst_name, worst = key, relative
    parity_report("bf16 gradients, rel. norm per tensor", f"{name} seed {seed}", worst, gradient_tolerance(config))
    assert worst <= gradient_tolerance(config), f"{worst_name}: {worst:.3e}"


def test_bf16_differs_from_float32():
    """The comparison above is not float32 against float32 in disguise: the twin's bfloat16 logits differ from its
    float32 logits by more than float32 noise (1e-5, see test_forward_parity.py), and by no more than the same
    per-layer bound (each layer's roundings, 2^-8 relative each, move its LayerNorm-ed output by about an ulp).
    (That every Flax matmul runs in bfloat16 is checked on the compiled program, tests/test_precision.py.)"""
    config = PARITY_CONFIGS["post_sinusoidal_tied_relu"]
    batch = make_batch(config, seed=0)
    _, params, float32_twin = twin_models(config, seed=0)
    bfloat16_twin = torch_twin(config.replace(dtype="bfloat16"), params)
    with torch.no_grad():
        diff = max_abs_diff(*(m(t(batch["src"]), t(batch["tgt_in"])) for m in (float32_twin, bfloat16_twin)))
    assert 1e-5 < diff <= logit_tolerance(config, to_numpy(float32_twin(t(batch["src"]), t(batch["tgt_in"]))))
