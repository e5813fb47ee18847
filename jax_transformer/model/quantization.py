"""int8 decoding: a trained model's matrices quantized after training, per output channel, with Google's JAX
quantization library qwix (`qwix.quantize` makes the int8 arrays and their scales, `qwix.dot_general` multiplies
with them). Nothing here is a kernel of its own: what is written by hand is which arrays are quantized, along
which axis, and how the model's products call qwix.

What is quantized: every `Dense` kernel (attention projections, feed-forward layers, an untied output projection),
(D_in, D_out) with one scale per output column; every token embedding table, (V, D) with one scale per row, which
serves both its uses, the lookup (a row times its scale) and the tied output projection (hidden @ table^T, whose
output channels are the rows). Learned position tables, biases and LayerNorms stay float32, and so do the
attention's scores, softmax and the accumulations' scaling (docs/decoding.md#int8).

Two ways to multiply (`config.quantize`):
- "int8-dynamic": each product's activations are quantized too, per row at run time (absmax), and the product is
  int8 x int8 -> int32 (the compiled HLO's dots are s8 x s8 -> s32), scaled back to float32 after.
- "int8-weights": the int8 weights are converted to the compute dtype inside the product and the result scaled
  per output channel; the activations stay float.
`resolve("int8")` picks one per backend, by measurement where there is one (`BACKEND_MODES`, docs/benchmarks.md).

Quantization happens at load, in memory: a quantized tree is never written over a float32 checkpoint.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from jax_transformer.errors import ConfigError
from jax_transformer.settings.config import QUANTIZE_MODES, TransformerConfig

# `--quantize int8` per backend. cpu: measured (docs/benchmarks.md#int8): XLA:CPU runs an int8 x int8 product
# through YNNPACK, while an int8 weight converted inside a float product is materialised in float32 at every call,
# slower than float32 itself. gpu, tpu: not measured here; int8 x int8 is what their matrix units run natively.
BACKEND_MODES = {"cpu": "int8-dynamic", "gpu": "int8-dynamic", "tpu": "int8-dynamic"}

# Top-level modules holding token embedding tables (the model's `nn.Embed`s).
EMBEDDINGS = ("shared_embed", "source_embed", "target_embed")


def resolve(mode: str, backend: str | None = None) -> str:
    """`config.quantize` as the products compute it: "int8" becomes the backend's choice (at trace time)."""
    if mode not in QUANTIZE_MODES:
        raise ConfigError(f"unknown quantization {mode!r}; choose one of {', '.join(QUANTIZE_MODES)}")
    if mode == "int8":
        return BACKEND_MODES.get(backend or jax.default_backend(), "int8-dynamic")
    return mode


def is_quantized(x: Any) -> bool:
    """Whether `x` is a quantized array (a qwix QArray), without importing qwix for float models."""
    return hasattr(x, "qvalue") and hasattr(x, "scale")


def quantize_params(params) -> dict:
    """The float parameter tree with every Dense kernel and token embedding table replaced by an int8 qwix QArray
    (symmetric, absmax, float32 scales: per output column of a kernel, per row of a table); everything else as
    it was. The tree keeps its structure and names, so the model reads it as it reads the float one."""
    import qwix  # an optional dependency: the `quantize` extra

    _register_for_program_store()
    int8 = jnp.dtype("int8")  # a dtype, not the jnp.int8 class: the programs' stored trees name it (see below)

    def quantize(path, leaf):
        keys = [getattr(p, "key", None) for p in path]
        if keys[-1] == "kernel" and leaf.ndim == 2:  # (D_in, D_out): one scale per output column
            return qwix.quantize(jnp.asarray(leaf, jnp.float32), int8, channelwise_axes=(1,))
        if keys[-1] == "embedding" and keys[0] in EMBEDDINGS:  # (V, D): one scale per row
            return qwix.quantize(jnp.asarray(leaf, jnp.float32), int8, channelwise_axes=(0,))
        return leaf

    if any(is_quantized(x) for x in jax.tree.leaves(params, is_leaf=is_quantized)):
        raise ConfigError("the parameters are quantized already")
    return jax.tree_util.tree_map_with_path(quantize, params)


@functools.cache
def _register_for_program_store() -> None:
    """QArray registered with jax.export, so that the decoding programs that take quantized parameters can be stored
    as traced (`compilation.ProgramStore`); its one static field, the int8 dtype, by name."""
    import qwix
    from jax import export

    export.register_pytree_node_serialization(
        qwix.QArray,
        serialized_name="qwix.QArray",
        serialize_auxdata=lambda aux: ",".join(jnp.dtype(t).name for t in aux).encode(),
        deserialize_auxdata=lambda data: tuple(jnp.dtype(name) for name in data.decode().split(",")),
    )


def quantized(params, config: TransformerConfig, mode: str = "int8") -> tuple[dict, TransformerConfig]:
    """(the quantized parameters, the config that computes with them): the Python API of `--quantize`."""
    resolve(mode)  # a valid mode
    if mode == "none":
        return params, config.replace(quantize="none")
    return quantize_params(params), config.replace(quantize=mode)


def dequantize_params(params) -> dict:
    """The float tree a quantized one stands for (each int8 value times its scale): the float model whose products
    "int8-weights" computes."""
    import qwix

    return jax.tree.map(lambda x: qwix.dequantize(x) if is_quantized(x) else x, params, is_leaf=is_quantized)


def check_mode(kernel, mode: str, name: str) -> None:
    """A quantized kernel needs a quantized config and a float one a float config: an error naming the array."""
    if is_quantized(kernel) != (mode != "none"):
        have = "int8" if is_quantized(kernel) else "float"
        raise ConfigError(
            f"parameter {name} is {have} but config.quantize is {mode!r}: quantize the parameters and the config "
            f"together (jax_transformer.model.quantization.quantized)"
        )


# XLA:CPU multiplies an int8 matrix by a single int8 row in a scalar loop, far slower than float32 (a decoding step
# of one sentence; docs/benchmarks.md#int8); from two rows on, the product goes to YNNPACK. One row is padded to two
# there; other backends take the product as it is.
def _min_rows() -> int:
    return 2 if jax.default_backend() == "cpu" else 1


def _rows_quantized(rows, mode: str, dtype):
    """rows (N, D) as the product's other operand: int8 per row ("int8-dynamic"), else the compute dtype."""
    if resolve(mode) != "int8-dynamic":
        return rows.astype(dtype)
    import qwix

    return qwix.quantize(rows.astype(jnp.float32), jnp.int8, channelwise_axes=(0,))


def _rows(x):
    """x (..., D) as the (N, D) rows of a product, padded to `_min_rows()`; and N."""
    rows = x.reshape(-1, x.shape[-1])  # (N, D)
    n = rows.shape[0]
    return jnp.pad(rows, ((0, max(0, _min_rows() - n)), (0, 0))), n


def rows_times(x, w, mode: str, dtype, contract: int = 0):
    """x (..., D) times the QArray `w` contracted over its axis `contract` -> (..., F) float32: a kernel (D, F)
    with contract 0, a table (V, D) with contract 1 (the tied projection, hidden @ table^T)."""
    import qwix

    rows, n = _rows(x)
    y = qwix.dot_general(_rows_quantized(rows, mode, dtype), w, (((1,), (contract,)), ((), ())))  # (N, F)
    return y[:n].astype(jnp.float32).reshape(*x.shape[:-1], y.shape[-1])


def table_times_rows(table, x, mode: str, dtype):
    """table (V, D) @ x (..., D)^T -> (V, N) float32, N the rows of x: the vocabulary-major product of a decoding
    step (`model.vocabulary_major_logits`), the table a QArray with per-row scales."""
    import qwix

    rows, n = _rows(x)
    y = qwix.dot_general(table, _rows_quantized(rows, mode, dtype), (((1,), (1,)), ((), ())))  # (V, N)
    return y[:, :n].astype(jnp.float32)


def lookup(table, tokens):
    """Rows of a quantized table (V, D) for `tokens` (...) -> (..., D) float32: each int8 row times its scale."""
    rows = jnp.take(table.qvalue, tokens, axis=0).astype(jnp.float32)  # (..., D)
    return rows * jnp.take(table.scale, tokens, axis=0)  # scale (V, 1) -> (..., 1)
