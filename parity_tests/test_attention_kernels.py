"""The attention kernels (`config.attention_kernel`): `jax.nn.dot_product_attention` ("xla" anywhere, "cudnn" on a
CUDA GPU) against the explicit softmax(Q K^T / sqrt(d_k)) V that the PyTorch twin mirrors: logits of padded and
packed batches, and every gradient. One configuration: the kernel replaces attention alone, whose inputs (masks,
projections) every configuration shares. On the CPU the xla kernel is compared in float32 (its bfloat16 program's
matmuls are checked in tests/test_precision.py); on a GPU cuDNN's in bfloat16, the only dtype it has.

Tolerances. float32: the same float32 formulas in another order of summation, as between the twins: 1e-5 on the
logits (test_forward_parity.py) and 1e-4 relative on gradients (test_loss_grad_parity.py). bfloat16: the kernels
round at other places than the explicit path (cuDNN and the xla kernel keep the scores in float32, the explicit
path rounds them to bfloat16 once), a difference of at most half a bfloat16 ulp per score; through the softmax
that moves the layer's output by a fraction of an ulp of its scale, so the bound of test_bf16_parity.py applies
unchanged: n_layers ulps of bfloat16 at the largest logit, and 2 n_layers 2^-7 per gradient tensor in norm.
(Measured on the CPU with the xla kernel in bfloat16 while writing this test: logits equal, gradients 9.4e-3 of
tolerance 6.3e-2.)
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from jax_transformer.model.transformer import Transformer, init_params
from jax_transformer.training import losses
from parity_tests.test_packing_parity import _packed
from tests.helpers.batches import make_batch
from tests.helpers.configs import PARITY_CONFIGS
from tests.helpers.tolerances import gradient_tolerance, logit_tolerance
from tests.helpers.twins import flat, max_abs_diff

LOGIT_ATOL = 1e-5  # float32: see the module docstring
GRAD_RTOL = 1e-4

# The cuDNN kernel needs a CUDA GPU; elsewhere only the xla kernel is compared.
KERNELS = ["xla", pytest.param("cudnn", marks=pytest.mark.skipif(jax.default_backend() != "gpu", reason="no GPU"))]


CONFIG = PARITY_CONFIGS["post_sinusoidal_tied_relu"]


@functools.cache
def _loss_and_grads(config, with_grads: bool):
    """jit of (params, batch) -> ((mean loss, logits), gradients or None) for `config`; packed batches too."""
    model = Transformer(config)

    def loss_fn(params, batch):
        packing = {k: v for k, v in batch.items() if k.endswith(("segments", "positions"))}
        logits = model.apply({"params": params}, batch["src"], batch["tgt_in"], **packing)
        return losses.mean_loss(logits, batch["tgt_out"], config.pad_id, 0.1), logits

    return jax.jit(jax.value_and_grad(loss_fn, has_aux=True) if with_grads else lambda *a: (loss_fn(*a), None))


def _compare(config, kernel, batch, seed=0, with_grads=True):
    """(logits, grads) of the explicit path and of `kernel`, same params and batch."""
    params = init_params(config, seed)
    (_, logits), grads = _loss_and_grads(config, with_grads)(params, batch)
    kernel_config = config.replace(attention_kernel=kernel)
    (_, kernel_logits), kernel_grads = _loss_and_grads(kernel_config, with_grads)(params, batch)
    return logits, kernel_logits, grads, kernel_grads


def _worst_gradient(grads, kernel_grads, norm: bool) -> float:
    """Largest per-tensor difference: max-abs over the tensor's max-abs (float32) or in norm (bfloat16)."""
    ours, theirs = flat(grads), flat(kernel_grads)
    measure = np.linalg.norm if norm else (lambda x: np.abs(x).max())
    # Key biases are left out: their gradient is zero analytically, noise in both (see test_loss_grad_parity.py).
    keys = [k for k in ours if not k.endswith("['key']['bias']")]
    return max(float(measure(theirs[k] - ours[k]) / measure(ours[k])) for k in keys)


@pytest.mark.slow
@pytest.mark.parametrize("kernel", KERNELS)
def test_kernel_equals_explicit_attention(kernel, parity_report):
    name = "post_sinusoidal_tied_relu"
    dtype = "bfloat16" if kernel == "cudnn" else "float32"  # cuDNN's fused attention has no float32 kernel
    config = CONFIG.replace(dtype=dtype)
    batch = make_batch(config, seed=2, src_len=12, tgt_len=10)  # even lengths: cuDNN's bias needs them
    logits, kernel_logits, grads, kernel_grads = _compare(config, kernel, batch)
    assert np.isfinite(np.asarray(kernel_logits)).all()  # the all-padding row too
    logit_tol = LOGIT_ATOL if dtype == "float32" else logit_tolerance(config, logits)
    grad_tol = GRAD_RTOL if dtype == "float32" else gradient_tolerance(config)
    diff = max_abs_diff(kernel_logits, logits)
    worst = _worst_gradient(grads, kernel_grads, norm=dtype == "bfloat16")
    parity_report(f"{kernel} kernel vs explicit: logits ({dtype})", name, diff, logit_tol)
    parity_report(f"{kernel} kernel vs explicit: gradients, rel", name, worst, grad_tol)
    assert diff <= logit_tol and worst <= grad_tol


@pytest.mark.parametrize("kernel", KERNELS)
def test_kernel_on_packed_rows(kernel, parity_report):
    """Packed rows pass their (B, 1, Tq, Tk) segment masks to the kernel: the same logits as the explicit path."""
    config = CONFIG.replace(dtype="bfloat16" if kernel == "cudnn" else "float32")
    batch, _ = _packed()
    logits, kernel_logits, _, _ = _compare(config, kernel, batch, seed=3, with_grads=False)
    real = batch["tgt_segments"] != 0
    diff = float(np.abs(np.asarray(kernel_logits) - np.asarray(logits))[real].max())
    tol = LOGIT_ATOL if config.dtype == "float32" else logit_tolerance(config, logits)
    parity_report(f"{kernel} kernel vs explicit: packed logits", config.dtype, diff, tol)
    assert diff <= tol
