"""int8 decoding (jax_transformer/model/quantization.py): which arrays are quantized and how exactly, the two products
against the arithmetic they stand for, decoding with them, and `--quantize` on the command line."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("qwix")

from jax_transformer.decoding import (
    decoders,
    schedule,  # noqa: E402
)
from jax_transformer.errors import ConfigError
from jax_transformer.model import quantization
from jax_transformer.model.transformer import Transformer, init_params  # noqa: E402
from jax_transformer.settings.config import preset  # noqa: E402
from tests.helpers.saved import load_saved_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("highest_precision")


@pytest.fixture
def highest_precision():
    with jax.default_matmul_precision("highest"):
        yield


def _config(**fields):
    fields = dict(src_vocab_size=64, tgt_vocab_size=64, dropout=0.0, embedding_dropout=0.0, **fields)
    return preset("tiny", **fields)


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.integers(3, 64, (3, 7)), jnp.int32), jnp.asarray(rng.integers(3, 64, (3, 5)), jnp.int32)


def _flat(tree):
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=quantization.is_quantized)[0]
    return {"/".join(str(getattr(p, "key", p)) for p in path): leaf for path, leaf in leaves}


def test_every_matrix_is_int8_per_output_channel_and_nothing_else():
    """Kernels (D_in, D_out) get a scale per column, token tables (V, D) a scale per row; each value is its float
    rounded to the nearest multiple of its scale, so it is off by at most half a step (qwix's absmax puts the
    channel's largest |value| at 127.5 steps: -128 exactly, or +127 clipped by half a step). Biases, LayerNorms
    and the learned position tables stay as they were."""
    config = _config(share_embeddings=False, tie_output=False, positions="learned")
    params = init_params(config)
    float_leaves, quantized_leaves = _flat(params), _flat(quantization.quantize_params(params))
    assert float_leaves.keys() == quantized_leaves.keys()
    kinds = {"kernel": 0, "table": 0}
    for name, q in quantized_leaves.items():
        w = np.asarray(float_leaves[name], np.float64)
        is_table = name.split("/")[0] in quantization.EMBEDDINGS
        if not (name.endswith("kernel") or is_table):
            assert q is float_leaves[name] or np.array_equal(q, w), name  # untouched
            continue
        kinds["table" if is_table else "kernel"] += 1
        assert quantization.is_quantized(q) and q.qvalue.dtype == jnp.int8, name
        channel = 0 if is_table else 1  # the axis with its own scales
        assert q.scale.shape == tuple(n if axis == channel else 1 for axis, n in enumerate(w.shape)), name
        values, scale = np.asarray(q.qvalue, np.float64), np.asarray(q.scale, np.float64)
        # Half a step, plus float32's rounding of w / scale (a relative 2^-24 of at most 127 steps).
        assert np.all(np.abs(values * scale - w) <= scale * (0.5 + 127 * 2.0**-23)), name
        assert set(np.max(np.abs(values), axis=1 - channel)) <= {127.0, 128.0}, name  # every channel's range used
    # 2 encoder layers (attention's 4 projections, the FFN's 2), 2 decoder layers (two attentions), the output
    assert kinds == {"kernel": 2 * (4 + 2) + 2 * (4 + 4 + 2) + 1, "table": 2}
    with pytest.raises(ConfigError, match="quantized already"):
        quantization.quantize_params(quantization.quantize_params(params))


@pytest.mark.slow
@pytest.mark.parametrize("share,tie", [(True, True), (False, False)])
def test_int8_weights_is_the_float_model_of_the_dequantized_weights(share, tie):
    """ "int8-weights" multiplies float activations by the int8 values and scales each output column after the sum:
    the float model on the dequantized weights (value x scale) but for where the scale multiplies. float32
    reassociation over sums of <= 64 products of O(1) terms, a few ulps of O(1) logits: 1e-5."""
    config = _config(share_embeddings=share, tie_output=tie)
    params = init_params(config)
    src, tgt = _inputs()
    qparams, qconfig = quantization.quantized(params, config, "int8-weights")
    ours = Transformer(qconfig).apply({"params": qparams}, src, tgt)
    reference = Transformer(config).apply({"params": quantization.dequantize_params(qparams)}, src, tgt)
    np.testing.assert_allclose(ours, reference, rtol=0, atol=1e-5)
    # and quantization moved the logits, by far less than their size
    drift = float(jnp.max(jnp.abs(ours - Transformer(config).apply({"params": params}, src, tgt))))
    assert 1e-4 < drift < 0.1 * float(jnp.max(jnp.abs(reference)))


@pytest.mark.parametrize("rows", [1, 2, 5])
def test_int8_dynamic_product_is_integer_arithmetic_scaled_once(rows):
    """ "int8-dynamic": each row of activations quantized (absmax, its own scale), an int8 x int8 product summed
    exactly in int32, then times the two scales: equal to that arithmetic done in int64 and float64, within the
    float32 rounding of the two scalings (a relative 2^-23). The compiled product is s8 x s8 -> s32. Rows stay
    independent (one row is padded to two on the CPU): row 0 is the same whatever the other rows."""
    import qwix

    rng = np.random.default_rng(rows)
    x = jnp.asarray(rng.standard_normal((rows, 48)), jnp.float32)
    kernel = quantization.quantize_params({"linear": {"kernel": rng.standard_normal((48, 40))}})["linear"]["kernel"]
    y = quantization.rows_times(x, kernel, "int8-dynamic", jnp.float32)  # (rows, 40)
    xq = qwix.quantize(x, jnp.int8, channelwise_axes=(0,))
    exact = np.asarray(xq.qvalue, np.int64) @ np.asarray(kernel.qvalue, np.int64)  # the int32 sums, exactly
    expected = exact * np.asarray(xq.scale, np.float64) * np.asarray(kernel.scale, np.float64)
    np.testing.assert_allclose(y, expected, rtol=2.0**-22, atol=1e-30)
    lowered = jax.jit(lambda x: quantization.rows_times(x, kernel, "int8-dynamic", jnp.float32)).lower(x)
    tensor = r"tensor<[\dx]*x(\w+)>"
    dots = re.findall(rf"dot_general.*\({tensor}, {tensor}\) -> {tensor}", lowered.as_text())
    assert dots == [("i8", "i8", "i32")], dots
    assert re.findall(r"= (\w+)\[[\d,]*\]\S* dot\(", lowered.compile().as_text()) == ["s32"]
    alone = quantization.rows_times(x[:1], kernel, "int8-dynamic", jnp.float32)
    np.testing.assert_array_equal(alone[0], y[0])


def test_a_quantized_tree_needs_a_quantized_config_and_back():
    config = _config(share_embeddings=True)
    params = init_params(config)
    qparams, qconfig = quantization.quantized(params, config, "int8")
    src, tgt = _inputs()
    with pytest.raises(ConfigError, match=r"encoder/layer_0/self_attention/query/kernel is float but .* 'int8'"):
        Transformer(qconfig).apply({"params": params}, src, tgt)
    with pytest.raises(ConfigError, match=r"kernel is int8 but config.quantize is 'none'"):
        Transformer(config).apply({"params": qparams}, src, tgt)
    with pytest.raises(ConfigError, match="unknown quantization 'int4'"):
        quantization.quantized(params, config, "int4")
    assert quantization.resolve("int8", "cpu") == "int8-dynamic"  # measured: docs/benchmarks.md


@pytest.mark.slow
def test_decoding_with_int8_weights_is_decoding_the_dequantized_model():
    """The trained tiny model's 64 sentences, greedy and beam 4: "int8-weights" gives the tokens of the float
    model on the dequantized weights (the products differ only by float32 reassociation, 1e-6 of the logits), and
    "int8-dynamic" (its activations rounded to 8 bits too) the float32 model's on most sentences (saved weights, so
    the count holds on every CPU)."""
    saved = load_saved_model("trained_tiny")
    src = saved.sources[:64]
    whole = schedule.Whole()  # one program per search
    qparams, qconfig = quantization.quantized(saved.params, saved.config, "int8-weights")
    dequantized = quantization.dequantize_params(qparams)
    for beam in (1, 4):
        if beam == 1:
            search = lambda p, c: decoders.greedy_search(p, c, src, schedule=whole)[0]  # noqa: E731
        else:
            search = lambda p, c: decoders.beam_search(p, c, src, beam_size=4, alpha=0.6, schedule=whole)[0]  # noqa: E731
        np.testing.assert_array_equal(search(qparams, qconfig), search(dequantized, saved.config))
    greedy = lambda p, c: decoders.greedy_search(p, c, src, schedule=whole)[0]  # noqa: E731
    dynamic = greedy(qparams, qconfig.replace(quantize="int8-dynamic"))
    same = int(np.sum(np.all(dynamic == greedy(saved.params, saved.config), axis=1)))
    assert same >= 48, f"int8-dynamic: {same}/64 sentences as in float32"
