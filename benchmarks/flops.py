"""Section 2 of the benchmark: the achieved FLOP/s of the training steps, and their share of the matmul peak.

A step's time says little across model sizes and machines; FLOP/s against what the machine can do says how much
of it the step uses. The work is counted as matmul FLOPs from the shapes (`train_step_matmul_flops`: the matmuls
are nearly all of a Transformer's arithmetic, and the count does not depend on how a framework fuses or orders
them), checked two ways in every run: against the dot_general ops of the traced JAX step (`jaxpr_matmul_flops`,
which must agree exactly) and against XLA's cost analysis of the compiled step (which counts every op, so it is
somewhat higher). The peak is measured in the same run, not taken from a data sheet: n x n float32 matmuls with
jnp.dot and torch.mm (`matmul_peak`), each framework's steps compared with its own library's peak.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from benchmarks.report import add_ratio, figure, ratio
from benchmarks.train_step import JAX_LABEL, JaxTrain, interleaved, training_batch
from jax_transformer.settings.config import TransformerConfig
from tests.helpers.configs import preset_config
from tests.helpers.twins import ported_params

if TYPE_CHECKING:
    from benchmarks.common import Settings


def train_step_matmul_flops(config: TransformerConfig, batch_size: int, src_len: int, tgt_len: int) -> dict[str, float]:
    """Matmul FLOPs of one training step (forward + backward), counted from the shapes.

    A (m, k) @ (k, n) matmul costs 2*m*k*n FLOPs (one multiply and one add per term). Padding positions are
    counted: the dense computation does not skip them. With B rows, S source and T target positions,
    d = d_model, f = d_ff, V = target vocabulary, one forward pass costs:
      each encoder layer: Q, K, V and output projections 4 * 2BSd^2; scores Q K^T 2BS^2d (all heads together:
                          H * head_dim = d); probabilities @ V 2BS^2d; feed-forward 2 * 2BSdf
      each decoder layer: self-attention as above with T; cross-attention Q and output projections 2 * 2BTd^2,
                          K and V of the encoder output 2 * 2BSd^2, scores and values 2 * 2BTSd;
                          feed-forward 2 * 2BTdf
      output projection:  2BTdV
    The backward pass needs two matmuls for each forward one (the gradient with respect to each operand), so a
    training step is 3x the forward. Embedding lookups, softmax, LayerNorm, dropout, the loss and the Adam
    update are not matmuls and are not counted.
    """
    B, S, T, d, f, V = batch_size, src_len, tgt_len, config.d_model, config.d_ff, config.tgt_vocab_size
    encoder_layer = 4 * 2 * B * S * d * d + 2 * (2 * B * S * S * d) + 2 * (2 * B * S * d * f)
    decoder_layer = (
        4 * 2 * B * T * d * d
        + 2 * (2 * B * T * T * d)  # masked self-attention
        + 2 * 2 * B * T * d * d
        + 2 * 2 * B * S * d * d
        + 2 * (2 * B * T * S * d)  # cross-attention
        + 2 * (2 * B * T * d * f)
    )  # feed-forward
    output = 2 * B * T * d * V
    forward = config.num_encoder_layers * encoder_layer + config.num_decoder_layers * decoder_layer + output
    return {
        "encoder": float(config.num_encoder_layers * encoder_layer),
        "decoder": float(config.num_decoder_layers * decoder_layer),
        "output_projection": float(output),
        "forward": float(forward),
        "train_step": float(3 * forward),
    }


def jaxpr_matmul_flops(jaxpr) -> float:
    """Matmul FLOPs of a traced program: 2 * (product of the lhs dims) * (product of the rhs's free dims) for
    every dot_general, recursing into nested programs (jit, custom_jvp/vjp, remat) and multiplying a scan's
    body by its length. An exact count of what the program asks for, independent of the formula above."""
    from jax.extend.core import ClosedJaxpr, Jaxpr

    inner = jaxpr.jaxpr if isinstance(jaxpr, ClosedJaxpr) else jaxpr
    total = 0.0
    for eqn in inner.eqns:
        if eqn.primitive.name == "dot_general":
            lhs, rhs = (v.aval.shape for v in eqn.invars[:2])
            (_, rhs_contract), (_, rhs_batch) = eqn.params["dimension_numbers"]
            rhs_free = [n for d, n in enumerate(rhs) if d not in rhs_contract and d not in rhs_batch]
            total += 2.0 * float(np.prod(lhs)) * float(np.prod(rhs_free))
            continue
        repeat = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
        subs = []
        for value in eqn.params.values():
            for item in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(item, (ClosedJaxpr, Jaxpr)):
                    subs.append(jaxpr_matmul_flops(item))
        if subs:  # a cond runs one of its branches: count the largest
            total += repeat * (max(subs) if eqn.primitive.name == "cond" else sum(subs))
    return total


def traced_train_step_matmul_flops(config: TransformerConfig, batch_size: int, src_len: int, tgt_len: int) -> float:
    """jaxpr_matmul_flops of make_train_step's step, traced on shapes only (nothing is computed)."""
    import jax
    import jax.numpy as jnp

    from jax_transformer.training.trainer import OptimConfig, abstract_train_state, make_train_step

    opt = OptimConfig()
    shapes = {"src": (batch_size, src_len), "tgt_in": (batch_size, tgt_len), "tgt_out": (batch_size, tgt_len)}
    batch = {k: jax.ShapeDtypeStruct(shape, jnp.int32) for k, shape in shapes.items()}
    return jaxpr_matmul_flops(jax.make_jaxpr(make_train_step(config, opt))(abstract_train_state(config, opt), batch))


def matmul_peak(n: int, repeats: int, failures: list) -> dict[str, list[float]]:
    """Seconds per n x n float32 matmul, jnp.dot (jitted) and torch.mm interleaved: the machine's practical
    peak for each library."""
    import jax
    import jax.numpy as jnp
    import torch

    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((n, n), np.float32), rng.standard_normal((n, n), np.float32)
    ja, jb = jax.device_put(a), jax.device_put(b)
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    dot = jax.jit(jnp.dot)
    runners = {"jnp.dot": lambda: dot(ja, jb).block_until_ready(), "torch.mm": lambda: torch.mm(ta, tb)}
    for run in runners.values():  # warm-up: compile jnp.dot, let torch/MKL set up its threads
        run()
    return interleaved(runners, repeats, desc="matmul peak", failures=failures, context="flops")


def section_flops(s: Settings, figures: list, failures: list, state: dict) -> None:
    """Achieved GFLOP/s of each measured training step, and its share of the measured matmul peak."""
    peak_times = matmul_peak(s.peak_size, s.peak_repeats, failures)
    flop = 2.0 * s.peak_size**3
    peaks = {
        lib: figure(
            f"matmul peak: {lib} {s.peak_size}x{s.peak_size} float32",
            "GFLOP/s",
            times,
            lambda t: flop / t / 1e9,
            section="flops",
        )
        for lib, times in peak_times.items()
    }
    if len(peaks) == 2:
        add_ratio(peaks["jnp.dot"], "jnp.dot/torch.mm", ratio(peaks["jnp.dot"], peaks["torch.mm"]))
    figures.extend(peaks.values())
    trained = state.get("train", {})
    for name in s.presets:
        if name not in trained:  # the train section was not selected: time the JAX step alone
            config = preset_config(name, s.vocab)
            batch = training_batch(config, s.batch_size, s.length)
            runner = JaxTrain(config, batch, ported_params(config)[0])
            for _ in range(s.warmup):
                runner()
            times = interleaved(
                {JAX_LABEL: runner},
                s.repeats_for(name),
                desc=f"flops {name}",
                failures=failures,
                context=f"flops/{name}",
            )
            trained[name] = {"times": times, "runners": {JAX_LABEL: runner}, "config": config, "batch": batch}
        entry = trained[name]
        config = entry["config"]
        counts = train_step_matmul_flops(config, s.batch_size, s.length, s.length)
        # Two cross-checks of the formula: the dot_general ops of the traced step (should agree exactly) and
        # XLA's cost analysis of the compiled step (counts every op, elementwise ones too, so it is higher).
        xla = traced = None
        jax_runner = entry["runners"].get(JAX_LABEL)
        if jax_runner is not None:
            try:
                traced = traced_train_step_matmul_flops(config, s.batch_size, s.length, s.length)
                xla = jax_runner.cost_analysis().get("flops")
            except Exception as e:  # a cross-check's absence is reported, not fatal
                failures.append({"name": f"flops/{name}: cross-check", "error": f"{type(e).__name__}: {e}"})
        note = (
            f"{name}: analytic matmul FLOPs per step {counts['train_step'] / 1e9:.2f} G (3 x forward "
            f"{counts['forward'] / 1e9:.2f} G)"
            + (f"; dot_general in the traced step {traced / 1e9:.2f} G" if traced else "")
            + (f"; XLA cost analysis (all ops) {xla / 1e9:.2f} G" if xla else "")
        )
        for label, seconds in entry["times"].items():
            if not seconds:
                continue
            fig = figure(
                f"achieved {name}: {label}",
                "GFLOP/s",
                seconds,
                lambda t: counts["train_step"] / t / 1e9,
                section="flops",
                preset_name=name,
                note=note,
            )
            peak = peaks.get("jnp.dot" if label == JAX_LABEL else "torch.mm")
            if peak is not None:  # utilisation against the same library's own matmul peak
                add_ratio(fig, f"% of {'jnp.dot' if label == JAX_LABEL else 'torch.mm'} peak", 100.0 * ratio(fig, peak))
            if label == JAX_LABEL:
                if "torch.mm" in peaks:
                    add_ratio(fig, "% of torch.mm peak", 100.0 * ratio(fig, peaks["torch.mm"]))
                if traced:
                    add_ratio(fig, "traced matmul/analytic", traced / counts["train_step"])
                if xla:
                    add_ratio(fig, "XLA flops/analytic", xla / counts["train_step"])
            figures.append(fig)
