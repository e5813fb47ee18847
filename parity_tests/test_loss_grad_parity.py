"""Check 4 of the parity contract: label-smoothed cross-entropy ignoring padding, and the gradient of every
parameter, for the same weights and batch in both frameworks.

Loss tolerance: absolute 1e-5, for the reasons given in test_forward_parity.py (the loss is a mean of per-token
log-softmax values of order 1-10).
Gradient tolerance: relative 1e-4, measured per parameter as max|g_jax - g_torch| / max|g_torch|. A backward pass
multiplies the forward rounding noise (~1e-6 relative) through every layer's Jacobian and sums it over every token
that used the weight, in a different order per framework; a few times 1e-6 relative is what float32 gives, so 1e-4
keeps a margin of more than an order of magnitude. Normalising by the parameter's largest gradient (not
elementwise) keeps near-zero entries, whose relative error is meaningless, from dominating. A wrong mask, missing
label smoothing or a transposed weight moves gradients by 1e-2 relative or more.
The tightest case measured is the base model's deepest decoder self-attention query/key weights at
initialisation (about 7e-5 relative): attention there is almost uniform, so their gradient is small (~1e-4) and
is a difference of nearly equal terms in the softmax backward (p * (g - sum p g)); the absolute disagreement is
~5e-9, the same float32 noise as everywhere else.
"""

import jax
import numpy as np
import pytest

from jax_transformer.interop.port import flax_to_torch
from jax_transformer.training import losses
from tests.helpers.batches import make_batch
from tests.helpers.configs import BASE
from tests.helpers.twins import t, twin_models
from torch_reference import losses as torch_losses

LOSS_ATOL = 1e-5
GRAD_RTOL = 1e-4


def _loss_and_grads(cfg, seed, smoothing):
    model, params, torch_model = twin_models(cfg, seed=seed)
    batch = make_batch(cfg, seed=seed)
    src, tgt_in, tgt_out = batch["src"], batch["tgt_in"], batch["tgt_out"]

    def loss_fn(p):
        return losses.mean_loss(model.apply({"params": p}, src, tgt_in), tgt_out, cfg.pad_id, smoothing)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    torch_loss = torch_losses.mean_loss(torch_model(t(src), t(tgt_in)), t(tgt_out), cfg.pad_id, smoothing)
    torch_loss.backward()
    torch_grads = {name: p.grad.cpu() for name, p in torch_model.named_parameters()}
    return loss, flax_to_torch(grads), torch_loss, torch_grads


# The key projection's bias adds q . b_k to every score of a query row alike, and softmax ignores such a shift,
# so its gradient is exactly zero in exact arithmetic: both frameworks return rounding noise (~1e-9) there. Those
# parameters are checked to be zero (below 1e-6 of the model's largest gradient) instead of compared relatively.
ZERO_GRADIENT_SUFFIX = ".key.bias"


def _worst_relative(grads, torch_grads):
    assert set(grads) == set(torch_grads), set(grads) ^ set(torch_grads)
    largest = max(np.abs(g.numpy()).max() for g in torch_grads.values())
    worst_name, worst = None, 0.0
    for name, g in grads.items():
        ref = torch_grads[name].numpy()
        if name.endswith(ZERO_GRADIENT_SUFFIX):
            assert max(np.abs(g).max(), np.abs(ref).max()) < 1e-6 * largest, f"{name}: gradient should be zero"
            continue
        scale = np.abs(ref).max()
        assert scale > 0, f"{name}: zero gradient in torch (the check would be vacuous)"
        rel = np.abs(g - ref).max() / scale
        if rel >= worst:
            worst_name, worst = name, rel
    return worst_name, worst


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_loss_and_every_gradient(config_case, smoothing, parity_report):
    name, cfg = config_case
    loss, grads, torch_loss, torch_grads = _loss_and_grads(cfg, seed=4, smoothing=smoothing)
    loss_diff = abs(float(loss) - torch_loss.item())
    parity_report(f"loss (label smoothing {smoothing})", name, loss_diff, LOSS_ATOL)
    assert loss_diff <= LOSS_ATOL
    worst_name, worst = _worst_relative(grads, torch_grads)
    parity_report(f"gradients, relative (smoothing {smoothing})", name, worst, GRAD_RTOL)
    assert worst <= GRAD_RTOL, f"{worst_name}: relative gradient difference {worst}"


def test_loss_ignores_padding_and_smooths_labels():
    """The loss is over real target tokens only, and label smoothing changes it: checked against a direct numpy
    computation of the definition, so a loss that counted padding or ignored smoothing would fail."""
    cfg = BASE.replace(num_encoder_layers=1, num_decoder_layers=1, d_model=64, num_heads=4, d_ff=64)
    model, params, torch_model = twin_models(cfg, seed=5)
    batch = make_batch(cfg, seed=5)
    src, tgt_in, tgt_out = batch["src"], batch["tgt_in"], batch["tgt_out"]
    logits = np.asarray(model.apply({"params": params}, src, tgt_in), dtype=np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    real = tgt_out != cfg.pad_id
    eps = 0.1
    nll = -np.take_along_axis(logp, tgt_out[..., None], -1)[..., 0]
    smoothed = (1 - eps) * nll + eps * (-logp.mean(-1))  # target (1-eps) one-hot + eps/V uniform
    expected = smoothed[real].mean()
    ours = float(losses.mean_loss(logits.astype(np.float32), tgt_out, cfg.pad_id, eps))
    theirs = torch_losses.mean_loss(t(logits.astype(np.float32)), t(tgt_out), cfg.pad_id, eps).item()
    assert abs(ours - expected) < 1e-5 and abs(theirs - expected) < 1e-5
    assert abs(expected - nll[real].mean()) > 1e-3  # smoothing matters here
    assert abs(expected - smoothed.mean()) > 1e-3  # and so does ignoring padding
    sums = losses.loss_sums(logits.astype(np.float32), tgt_out, cfg.pad_id, eps)
    assert float(sums["tokens"]) == real.sum()


@pytest.mark.slow
def test_base_model_gradients(parity_report):
    """The paper's base configuration: loss and every gradient, same tolerances."""
    loss, grads, torch_loss, torch_grads = _loss_and_grads(BASE, seed=0, smoothing=0.1)
    loss_diff = abs(float(loss) - torch_loss.item())
    parity_report("loss (label smoothing 0.1)", "base", loss_diff, LOSS_ATOL)
    worst_name, worst = _worst_relative(grads, torch_grads)
    parity_report("gradients, relative (smoothing 0.1)", "base", worst, GRAD_RTOL)
    assert loss_diff <= LOSS_ATOL
    assert worst <= GRAD_RTOL, f"{worst_name}: relative gradient difference {worst}"
