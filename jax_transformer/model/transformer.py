"""The encoder-decoder Transformer of "Attention Is All You Need" as Flax linen modules, with parameter names that
match the PyTorch twin (`torch_reference/model.py`) name for name. Beside teacher forcing it has a key/value cache
for decoding, attention probabilities sown into `intermediates`, packed rows (segment ids and positions), bfloat16
mixed precision (`config.dtype`) and fused attention kernels (`config.attention_kernel`): docs/internals.md#model.
Shapes: B batch, S source length, T target length, D d_model, H heads, K head_dim, V vocabulary."""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax import lax

from jax_transformer import checks
from jax_transformer.errors import ConfigError
from jax_transformer.model import quantization
from jax_transformer.model.dropout import Dropout
from jax_transformer.model.masks import decoder_masks, encoder_mask
from jax_transformer.model.positions import position_table
from jax_transformer.settings.config import TransformerConfig

# Xavier-uniform for every matrix, zeros for biases (as the Annotated Transformer initialises).
xavier_uniform = nn.initializers.xavier_uniform()


def compute_dtype(cfg: TransformerConfig) -> jnp.dtype:
    """The dtype every matmul runs in: float32 or bfloat16 (`config.dtype`; see the module docstring)."""
    return jnp.dtype(cfg.dtype)


def _layer_norm(cfg: TransformerConfig, name: str) -> nn.LayerNorm:
    # Two-pass variance E[(x - mean)^2], as torch computes it; the fast E[x^2] - mean^2 loses digits.
    # Always float32: its input is the float32 residual stream, and so is its output.
    return nn.LayerNorm(
        epsilon=cfg.layer_norm_eps, use_bias=cfg.norm_bias, use_fast_variance=False, dtype=jnp.float32, name=name
    )


class Dense(nn.Module):
    """x W + b in the compute dtype, rounded once: the operands are cast to the compute dtype, the matmul
    accumulates in float32, the bias (cast to the compute dtype) is added to that float32 accumulator, and the sum
    is rounded to the compute dtype, as torch's fused bias-matmul (`F.linear`) does. `nn.Dense` would round twice,
    the matmul's result and then the bias sum, each in bfloat16: twice the twin's error, enough to reorder a
    trained model's beam. Parameters (float32) and their names are those of `nn.Dense`. `float32_result` keeps the
    float32 sum (the output projection: logits are never rounded). `quantize`: the kernel is int8
    (`quantization`), its product float32, then as above. `lora` (rank, alpha, dropout), rank > 0: a LoRA adapter
    beside the kernel, dropout(x) A B * alpha / rank added to the accumulator as peft's `lora.Linear` adds it
    after the bias; A (D_in, r) and B (r, D_out) are the parameters lora_a and lora_b
    (jax_transformer.training.finetuning)."""

    features: int
    use_bias: bool = True
    dtype: jnp.dtype = jnp.float32
    float32_result: bool = False
    quantize: str = "none"
    lora: tuple[int, float, float] = (0, 0.0, 0.0)

    @nn.compact
    def __call__(self, x, deterministic: bool = True):
        kernel = self.param("kernel", xavier_uniform, (x.shape[-1], self.features))  # (D_in, D_out) float32 or int8
        bias = self.param("bias", nn.initializers.zeros_init(), (self.features,)) if self.use_bias else None
        quantization.check_mode(kernel, self.quantize, "/".join(self.scope.path) + "/kernel")
        if self.quantize != "none":
            y = quantization.rows_times(x, kernel, self.quantize, self.dtype)  # (..., D_out) float32
            if bias is not None:
                y = y + bias.astype(self.dtype).astype(jnp.float32)
            y = self._adapter(x, y, deterministic)
            return y if self.float32_result else y.astype(self.dtype)
        if self.dtype == jnp.float32:  # what nn.Dense computes
            y = lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))
            return self._adapter(x, y if bias is None else y + bias, deterministic)
        y = matmul_float32_result(x.astype(self.dtype), kernel.astype(self.dtype))  # (..., D_out) float32
        if bias is not None:
            y = y + bias.astype(self.dtype).astype(jnp.float32)
        y = self._adapter(x, y, deterministic)
        return y if self.float32_result else y.astype(self.dtype)

    def _adapter(self, x, y, deterministic: bool):
        """y (..., D_out) float32 plus the LoRA term of x (..., D_in), if this layer has an adapter."""
        rank, alpha, rate = self.lora
        if not rank:
            return y
        # peft's kaiming_uniform(a=sqrt(5)) for A: U(-1/sqrt(D_in), 1/sqrt(D_in)); B starts at zero, so the adapted
        # model starts as the base model.
        a = self.param("lora_a", nn.initializers.variance_scaling(1 / 3, "fan_in", "uniform"), (x.shape[-1], rank))
        b = self.param("lora_b", nn.initializers.zeros_init(), (rank, self.features))
        h = Dropout(rate)(x, deterministic=deterministic).astype(self.dtype)
        low = lax.dot_general(h, a.astype(self.dtype), (((h.ndim - 1,), (0,)), ((), ())))  # (..., r)
        delta = lax.dot_general(low, b.astype(self.dtype), (((low.ndim - 1,), (0,)), ((), ())))  # (..., D_out)
        return y + delta.astype(jnp.float32) * (alpha / rank)


# Which `lora_targets` entry each adapted matrix belongs to, by its module name (peft's q_proj ... fc2).
LORA_TARGET_OF = {"query": "q", "key": "k", "value": "v", "out": "out", "linear1": "ffn", "linear2": "ffn"}


def _dense(
    cfg: TransformerConfig, features: int, name: str | None, use_bias: bool = True, float32_result: bool = False
) -> Dense:
    # float32 parameters, computed in the compute dtype (float32 result with float32_result: the output projection).
    adapted = cfg.lora_rank and LORA_TARGET_OF.get(name) in cfg.lora_target_list
    lora = (cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout) if adapted else (0, 0.0, 0.0)
    return Dense(features, use_bias, compute_dtype(cfg), float32_result, cfg.quantize, lora, name=name)


@jax.custom_vjp
def matmul_float32_result(x, w):
    """x (..., D) @ w (D, V) for operands in a low-precision dtype, with the float32 accumulator as the result
    instead of rounding it to that dtype: the logits, where bfloat16's 8 bits would make near-ties exact ties (and
    a GPU's matrix units give float32 anyway). The backward pass casts the float32 cotangent to the operands'
    dtype, so its two matmuls run in that dtype too (jax's own transpose of a float32-result dot would multiply
    in float32)."""
    return lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _matmul_float32_result_forward(x, w):
    return matmul_float32_result(x, w), (x, w)


def _matmul_float32_result_backward(saved, g):
    x, w = saved
    g = g.astype(x.dtype)  # (..., V)
    dx = lax.dot_general(g, w, (((g.ndim - 1,), (1,)), ((), ())))  # (..., D)
    batch = tuple(range(g.ndim - 1))
    dw = lax.dot_general(x, g, ((batch, batch), ((), ())))  # (D, V)
    return dx, dw


matmul_float32_result.defvjp(_matmul_float32_result_forward, _matmul_float32_result_backward)


def vocabulary_major_logits(hidden, kernel, quantize: str = "none", dtype=jnp.float32):
    """hidden (..., D) @ kernel (V, D)^T -> (..., V) float32 logits, for the few rows of a decoding step: computed
    as kernel @ hidden^T, (V, N), then transposed. Written the plain way, XLA:CPU fused the (N, V) product with the
    log-softmax's reduction after it into one kernel that ran about twice as long as the product alone, and no
    barrier around that product split it. In this orientation the product reads the (V, D) matrix once, as it
    lies, and the barrier keeps the transpose out of it, so the reduction reads a separate (N, V) result. Operands
    in the kernel's dtype, float32 accumulator; an int8 kernel (`quantize`) through `quantization`."""
    if quantize != "none":
        products = quantization.table_times_rows(kernel, hidden, quantize, dtype)  # (V, N)
    else:
        rows = hidden.reshape(-1, hidden.shape[-1]).astype(kernel.dtype)  # (N, D)
        products = lax.dot_general(kernel, rows, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return lax.optimization_barrier(products).T.reshape(*hidden.shape[:-1], kernel.shape[0])  # (..., V)


def fused_attention(q, k, v, mask, implementation: str):
    """softmax(q k^T / sqrt(K)) v by `jax.nn.dot_product_attention`: q (B, H, Tq, K), k and v (B, H, Tk, K), mask
    broadcastable to (B, H, Tq, Tk), True = may attend. Returns (B, H, Tq, K). implementation "xla" (any device) or
    "cudnn" (cuDNN's fused kernel: a CUDA GPU, bfloat16 or float16, K a multiple of 8). Masked keys get a large
    finite negative score, so a row with every key masked attends uniformly, as in the explicit path."""
    if implementation == "cudnn" and jax.default_backend() != "gpu":
        raise ConfigError(f"attention_kernel 'cudnn' needs a CUDA GPU; this process runs on {jax.default_backend()}")
    if implementation == "cudnn":  # cuDNN takes a boolean mask as an additive bias of the full (B, 1, Tq, Tk) shape
        mask = jnp.broadcast_to(mask, (q.shape[0], 1, q.shape[2], k.shape[2]))
    as_bthk = lambda t: t.transpose(0, 2, 1, 3)  # (B, H, T, K) <-> (B, T, H, K), the function's layout
    out = jax.nn.dot_product_attention(
        as_bthk(q), as_bthk(k), as_bthk(v), mask=mask, scale=1.0 / math.sqrt(q.shape[-1]), implementation=implementation
    )
    return as_bthk(out)  # (B, H, Tq, K)


class MultiHeadAttention(nn.Module):
    """Multi-head scaled dot-product attention (paper 3.2): softmax(Q K^T / sqrt(d_k)) V on H learned projections."""

    config: TransformerConfig
    cross: bool = False  # keys/values from the encoder output instead of from the queries' own sequence

    @nn.compact
    def __call__(
        self,
        x,
        memory,
        mask,
        deterministic: bool = True,
        decode: bool = False,
        groups: int = 1,
        step=None,
    ):
        """x (B, Tq, D) queries' input; memory (B, Tk, D) keys' input for cross-attention (ignored otherwise);
        mask broadcastable to (B, H, Tq, Tk), True = may attend. Returns (B, Tq, D). `decode`: with the key/value
        cache, created by a call without `step`, written at position `step` by the calls after.

        The cache serves G = `groups` continuations of each sentence, in consecutive rows: their queries go
        together against keys/values kept once per sentence, (B / G, H, G * Tq, K). The cross-attention's memory
        has B / G rows, and the self-attention's cache has G slots per position, row r writing to slot r mod G, so
        that nothing moves when a search reorders the continuations (the mask says which slot holds each
        position of a row's past: `history_mask`)."""
        cfg = self.config
        B, Tq, _ = x.shape
        H, K = cfg.num_heads, cfg.head_dim

        def project(name, inputs):  # (B, T, D) -> (B, H, T, K), in the compute dtype
            y = _dense(cfg, cfg.d_model, name, cfg.qkv_bias)(inputs, deterministic)
            return y.reshape(inputs.shape[0], -1, H, K).transpose(0, 2, 1, 3)

        q = project("query", x)
        if self.cross:
            k, v = self._cross_keys_values(project, memory, decode)
        else:
            k, v = project("key", x), project("value", x)
            if decode:
                k, v = self._append_to_cache(k, v, groups, step)  # the cache's (B / G * H, K, Tk), (B / G * H, Tk, K)

        # Query rows per key row: 1, or the G hypotheses of a sentence (see above); the cache has H rows a sentence.
        G = groups if v.ndim == 3 else B // v.shape[0]
        if G > 1:  # the G rows' queries side by side against their sentence's keys: (B / G, H, G * Tq, K)
            q = q.reshape(-1, G, H, Tq, K).transpose(0, 2, 1, 3, 4).reshape(-1, H, G * Tq, K)

        # The fused kernels return no probabilities and apply no dropout to them: used only where neither is needed.
        kernel = cfg.attention_kernel != "explicit" and not decode and not self.is_mutable_collection("intermediates")
        if kernel and (deterministic or cfg.attention_dropout == 0.0):
            out = fused_attention(q, k, v, mask, cfg.attention_kernel)  # (B, H, Tq, K)
        else:
            out = self._attention(q, k, v, mask, deterministic)  # (B, H, Tq, K)
        if G > 1:
            out = out.reshape(-1, H, G, Tq, K).transpose(0, 2, 1, 3, 4).reshape(B, H, Tq, K)
        out = out.transpose(0, 2, 1, 3).reshape(B, Tq, cfg.d_model)  # heads concatenated
        return _dense(cfg, cfg.d_model, "out", cfg.qkv_bias)(out, deterministic)

    def _attention(self, q, k, v, mask, deterministic: bool):
        """The explicit computation: (B, H, Tq, K) queries, (B, H, Tk, K) keys and values -> (B, H, Tq, K); or,
        over the decoding cache (`_append_to_cache`), keys (B * H, K, Tk) and values (B * H, Tk, K)."""
        B, H, Tq, K = q.shape
        cached = k.ndim == 3  # the products read the cache as it lies, without a reshape (see _append_to_cache)
        if cached:
            q = q.reshape(B * H, Tq, K)
        # The scores leave the matmul in the compute dtype; scaling, masking and softmax run in float32.
        scores = jnp.einsum("...qk,...ks->...qs" if cached else "...qk,...sk->...qs", q, k)
        scores = scores.reshape(B, H, Tq, -1).astype(jnp.float32) / math.sqrt(K)  # (B, H, Tq, Tk)
        # A large finite negative instead of -inf: a row whose keys are all masked (an all-padding sequence)
        # becomes a uniform distribution instead of NaN.
        scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1)  # (B, H, Tq, Tk) float32
        self.sow("intermediates", "attention", probs)
        probs = Dropout(self.config.attention_dropout)(probs, deterministic=deterministic)
        probs = probs.astype(v.dtype)
        if cached:
            probs = probs.reshape(B * H, Tq, -1)
        return jnp.einsum("...qs,...sk->...qk", probs, v).reshape(B, H, Tq, K)

    def _cross_keys_values(self, project, memory, decode):
        if not decode:
            return project("key", memory), project("value", memory)
        # Decoding: the encoder output does not change, so its keys/values are projected once, when the cache
        # is created, and read back at every later step.
        # (The cache variables cannot be called "key"/"value": those names belong to the projection submodules.)
        if self.has_variable("cache", "cached_key"):
            return self.get_variable("cache", "cached_key"), self.get_variable("cache", "cached_value")
        k, v = project("key", memory), project("value", memory)
        self.variable("cache", "cached_key", lambda: k)
        self.variable("cache", "cached_value", lambda: v)
        return k, v

    def _append_to_cache(self, k, v, G: int, step):
        """Self-attention while decoding: writes this call's keys/values (B, H, T, K) at position `step`, each row
        in its sentence's slot r mod G, and returns all the sentence's slots: keys transposed (B / G * H, K, G *
        T_max), values (B / G * H, G * T_max, K), column/row t * G + g holding position t of slot g. The call
        without `step` creates the cache (T_max = its T) and attends over its own inputs."""
        B, H, T, K = k.shape
        # Stored in the layouts the two attention products read, and position-major, so that a step writes one
        # contiguous block (its G slots) and nothing transposes or copies the cache. A sentence's heads share the
        # first axis: with one sentence, an axis of 1 would be stripped from the products by a reshape of the
        # step's updated cache, and XLA:CPU then copied every layer's cache three times a step.
        N = B // G * H
        cached_k = self.variable("cache", "cached_key", jnp.zeros, (N, K, T * G), k.dtype)
        cached_v = self.variable("cache", "cached_value", jnp.zeros, (N, T * G, K), v.dtype)
        if step is None:
            return k, v
        as_slots = lambda x: x.reshape(B // G, G, H, T, K).transpose(0, 2, 3, 1, 4).reshape(N, T * G, K)
        cached_k.value = lax.dynamic_update_slice(cached_k.value, as_slots(k).transpose(0, 2, 1), (0, 0, step * G))
        cached_v.value = lax.dynamic_update_slice(cached_v.value, as_slots(v), (0, step * G, 0))
        return cached_k.value, cached_v.value


class FeedForward(nn.Module):
    """Position-wise feed-forward network (paper 3.3): FFN(x) = max(0, x W1 + b1) W2 + b2."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, x, deterministic: bool = True):
        cfg = self.config
        h = _dense(cfg, cfg.d_ff, "linear1", cfg.ffn_bias)(x, deterministic).astype(jnp.float32)  # (B, T, F)
        # The activation and dropout in float32; linear2 casts the result to the compute dtype.
        h = {"relu": nn.relu, "gelu": lambda y: nn.gelu(y, approximate=False), "silu": nn.silu}[cfg.activation](h)
        h = Dropout(cfg.activation_dropout)(h, deterministic=deterministic)
        return _dense(cfg, cfg.d_model, "linear2", cfg.ffn_bias)(h, deterministic)  # (B, T, D), compute dtype


def _residual(cfg, x, sublayer, norm, deterministic):
    """Residual connection around a sub-layer with dropout (paper 5.4), normalised after (post-norm, the paper:
    LayerNorm(x + Sublayer(x))) or before (pre-norm, the Annotated Transformer: x + Sublayer(LayerNorm(x))).
    The residual stream x is float32: the sub-layer's output (in the compute dtype) is upcast before dropout and
    the sum, so no small update is rounded away in bfloat16."""
    drop = Dropout(cfg.dropout)
    if cfg.norm_first:
        return x + drop(sublayer(norm(x)).astype(jnp.float32), deterministic=deterministic)
    return norm(x + drop(sublayer(x).astype(jnp.float32), deterministic=deterministic))


_REMAT_POLICIES = {
    "full": None,  # nothing saved: the whole layer is recomputed
    "dots": jax.checkpoint_policies.dots_saveable,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def _remat(layer: type[nn.Module], cfg: TransformerConfig, *static: int) -> type[nn.Module]:
    """`layer` under `jax.checkpoint` with `cfg.remat`'s policy (`nn.remat`: its parameters keep their names), or
    as it is with remat "none". `static`: the positions (self = 0) of its Python-valued arguments."""
    if cfg.remat == "none":
        return layer
    return nn.remat(layer, policy=_REMAT_POLICIES[cfg.remat], static_argnums=static)


class EncoderLayer(nn.Module):
    """Self-attention then feed-forward, each wrapped in a residual connection and LayerNorm."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, x, src_mask, deterministic: bool = True):
        cfg = self.config
        attention = MultiHeadAttention(cfg, name="self_attention")
        x = _residual(
            cfg,
            x,
            lambda h: attention(h, h, src_mask, deterministic),
            _layer_norm(cfg, "self_attention_norm"),
            deterministic,
        )
        feed_forward = FeedForward(cfg, name="feed_forward")
        return _residual(
            cfg, x, lambda h: feed_forward(h, deterministic), _layer_norm(cfg, "feed_forward_norm"), deterministic
        )


class DecoderLayer(nn.Module):
    """Masked self-attention, attention over the encoder output, then feed-forward (paper 3.1)."""

    config: TransformerConfig

    @nn.compact
    def __call__(
        self,
        x,
        memory,
        self_mask,
        cross_mask,
        deterministic: bool = True,
        decode: bool = False,
        groups: int = 1,
        step=None,
    ):
        cfg = self.config
        self_attention = MultiHeadAttention(cfg, name="self_attention")
        x = _residual(
            cfg,
            x,
            lambda h: self_attention(h, h, self_mask, deterministic, decode, groups, step),
            _layer_norm(cfg, "self_attention_norm"),
            deterministic,
        )
        cross_attention = MultiHeadAttention(cfg, cross=True, name="cross_attention")
        x = _residual(
            cfg,
            x,
            lambda h: cross_attention(h, memory, cross_mask, deterministic, decode),
            _layer_norm(cfg, "cross_attention_norm"),
            deterministic,
        )
        feed_forward = FeedForward(cfg, name="feed_forward")
        return _residual(
            cfg, x, lambda h: feed_forward(h, deterministic), _layer_norm(cfg, "feed_forward_norm"), deterministic
        )


class Positions(nn.Module):
    """Adds position information to embedded tokens: the paper's fixed sinusoids or a learned table."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, x, offset=0, positions=None):
        """x (B, T, D); offset: position of x[:, 0] (non-zero while decoding step by step); positions (B, T):
        each token's position within its pair (packed rows), instead of 0, 1, 2, ... along the row."""
        cfg = self.config
        if cfg.positions == "learned":
            table = self.param("embedding", xavier_uniform, (cfg.max_len, cfg.d_model))
        else:
            table = jnp.asarray(position_table(cfg))
        if positions is not None:
            return x + jnp.take(table, positions, axis=0)  # (B, T, D)
        return x + lax.dynamic_slice_in_dim(table, offset, x.shape[1], axis=0)[None]  # (B, T, D)


class Encoder(nn.Module):
    """Positions, optional embedding LayerNorm, embedding dropout, N encoder layers, optional final LayerNorm."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, x, src_mask, deterministic: bool = True, positions=None):
        """x (B, S, D) embedded source tokens; src_mask (B, 1, 1, S) or (B, 1, S, S) packed. Returns the memory
        (B, S, D)."""
        cfg = self.config
        x = Positions(cfg, name="positions")(x, positions=positions)
        if cfg.embedding_norm:
            x = _layer_norm(cfg, "embedding_norm")(x)
        x = Dropout(cfg.embedding_dropout)(x, deterministic=deterministic)
        for i in range(cfg.num_encoder_layers):
            x = _remat(EncoderLayer, cfg, 3)(cfg, name=f"layer_{i}")(x, src_mask, deterministic)
        if cfg.final_norm:
            x = _layer_norm(cfg, "final_norm")(x)
        return x


def _check_decoding_position(offset, length: int, max_len: int) -> None:
    """Step-by-step decoding must stay within the positions table (beyond it `dynamic_slice` would silently
    clamp and reuse the last position)."""
    if checks.is_traced(offset):
        checks.debug_check(
            offset + length <= max_len,
            f"decoding position {{position}} + {length} is beyond config.max_len={max_len} positions",
            position=offset,
        )
    else:
        checks.check_length("tgt_in (decoding step)", length, max_len, int(offset))


def history_mask(history, step, n: int, G: int):
    """The self-attention mask of n queries at positions step, ..., step + n - 1 over a cache of T positions with
    G slots each (`MultiHeadAttention._append_to_cache`), (B / G, 1, G * n, T * G): the query of row b at position
    p may see slot j at position t where t <= p and `history` (B, T) says that slot j holds position t of row b's
    past (the caller has written the slots of the n new positions too)."""
    B, T = history.shape
    causal = jnp.arange(T)[None, :] <= step + jnp.arange(n)[:, None]  # (n, T)
    held = history[:, :, None] == jnp.arange(G)  # (B, T, G)
    mask = held[:, None, :, :] & causal[None, :, :, None]  # (B, n, T, G)
    return mask.reshape(B // G, 1, G * n, T * G)


def _is_self_attention_cache(path) -> bool:
    names = [getattr(p, "key", None) for p in path]
    return names[-1] in ("cached_key", "cached_value") and "self_attention" in names


def select_cache(cache, index, sentences: int):
    """The decoding cache (`Transformer.decode`'s "cache" collection) of sentences `index` (N,) of its `sentences`:
    rows of the cross-attention's keys/values (sentences, ...) and of the self-attention's, whose first axis holds
    each sentence's heads (sentences * H, ...)."""

    def select(path, leaf):
        if _is_self_attention_cache(path):  # (sentences * H, ...) -> (sentences, H, ...) -> (N, H, ...) -> (N * H, ...)
            heads = jnp.take(leaf.reshape(sentences, -1, *leaf.shape[1:]), index, axis=0)
            return heads.reshape(-1, *leaf.shape[1:])
        return jnp.take(leaf, index, axis=0)

    return jax.tree_util.tree_map_with_path(select, cache)


def grow_cache(cache, length: int, slots: int):
    """The decoding cache with its self-attention keys/values padded from T to `length` positions of `slots` slots
    each (keys (N, K, T * slots), values (N, T * slots, K)); the new positions are masked until a step writes them."""

    def grow(path, leaf):
        if not _is_self_attention_cache(path):
            return leaf
        axis = 2 if getattr(path[-1], "key", None) == "cached_key" else 1
        padding = [(0, 0)] * leaf.ndim
        padding[axis] = (0, length * slots - leaf.shape[axis])
        return jnp.pad(leaf, padding)

    return jax.tree_util.tree_map_with_path(grow, cache)


class Decoder(nn.Module):
    """Positions, optional embedding LayerNorm, embedding dropout, N decoder layers, optional final LayerNorm."""

    config: TransformerConfig

    @nn.compact
    def __call__(
        self,
        x,
        memory,
        self_mask,
        cross_mask,
        deterministic: bool = True,
        decode: bool = False,
        positions=None,
        step=None,
        history=None,
    ):
        """x (B, T, D) embedded decoder inputs; memory (B / G, S, D): G = 1, or G continuations of each sentence
        in consecutive rows (see MultiHeadAttention). Returns hidden states (B, T, D). Decoding step by step
        (`decode`, `step`): this call's tokens are at positions step, step + 1, ..., and `history` (B, T_max) says
        which cache slot holds each position of each row's past (`history_mask`)."""
        cfg = self.config
        offset, G = 0, x.shape[0] // memory.shape[0]
        if decode and step is not None:
            offset = step
            _check_decoding_position(step, x.shape[1], cfg.max_len)
            self_mask = history_mask(history, step, x.shape[1], G)
        x = Positions(cfg, name="positions")(x, offset, positions)
        if cfg.embedding_norm:
            x = _layer_norm(cfg, "embedding_norm")(x)
        x = Dropout(cfg.embedding_dropout)(x, deterministic=deterministic)
        for i in range(cfg.num_decoder_layers):
            # (decoding step by step keeps nothing for a backward pass: no recomputation there)
            layer = (DecoderLayer if decode else _remat(DecoderLayer, cfg, 5, 6, 7))(cfg, name=f"layer_{i}")
            x = layer(x, memory, self_mask, cross_mask, deterministic, decode, G, step)
        if cfg.final_norm:
            x = _layer_norm(cfg, "final_norm")(x)
        return x


class Embed(nn.Module):
    """A token embedding table (V, D) and its lookup: `nn.Embed`'s parameter and result, and an int8 table
    (`quantization`) looked up as its rows times their scales."""

    num_embeddings: int
    features: int

    def setup(self):
        self.embedding = self.param("embedding", xavier_uniform, (self.num_embeddings, self.features))

    def __call__(self, tokens):
        if quantization.is_quantized(self.embedding):
            return quantization.lookup(self.embedding, tokens)  # (..., D) float32
        return jnp.take(self.embedding, tokens, axis=0)  # (..., D)


class Transformer(nn.Module):
    """The full model: `encode` the source once, `decode` target prefixes against it, logits over the target
    vocabulary. `__call__(src, tgt_in)` does both (teacher forcing)."""

    config: TransformerConfig

    def setup(self):
        cfg = self.config
        if cfg.share_embeddings:
            self.shared_embed = Embed(cfg.src_vocab_size, cfg.d_model)
        else:
            self.source_embed = Embed(cfg.src_vocab_size, cfg.d_model)
            self.target_embed = Embed(cfg.tgt_vocab_size, cfg.d_model)
        self.encoder = Encoder(cfg)
        self.decoder = Decoder(cfg)
        if not cfg.tie_output:
            self.output_proj = _dense(cfg, cfg.tgt_vocab_size, None, cfg.output_bias, float32_result=True)
        elif cfg.logits_bias:  # Marian's final_logits_bias, on the tied output
            self.logits_bias = self.param("logits_bias", nn.initializers.zeros_init(), (cfg.tgt_vocab_size,))

    def _embedding(self, side: str) -> Embed:
        if self.config.share_embeddings:
            return self.shared_embed
        return self.source_embed if side == "source" else self.target_embed

    def _embed(self, side: str, tokens):
        x = self._embedding(side)(tokens)  # (B, T, D)
        # The pad row gets no gradient here (torch's padding_idx): in models imported from Marian, whose decoder
        # starts from the pad token, it is zero and stays zero (training.keep_start_row keeps the tied output
        # projection's gradient off it too).
        x = jnp.where((tokens == self.config.pad_id)[..., None], lax.stop_gradient(x), x)
        # Embeddings are multiplied by sqrt(d_model) (paper 3.4) so they are not drowned by the positions.
        return x * math.sqrt(self.config.d_model) if self.config.scale_embeddings else x

    def encode(self, src, deterministic: bool = True, *, src_segments=None, src_positions=None):
        """src (B, S) token ids -> memory (B, S, D). Packed rows: segment ids and positions (B, S)."""
        checks.check_model_input("src", src, self.config, "source", positions=src_positions, segments=src_segments)
        mask = encoder_mask(src, self.config.pad_id, src_segments)
        return self.encoder(self._embed("source", src), mask, deterministic, src_positions)

    def decoder_hidden(
        self,
        memory,
        src,
        tgt_in,
        deterministic: bool = True,
        decode: bool = False,
        *,
        src_segments=None,
        tgt_segments=None,
        tgt_positions=None,
        step=None,
        history=None,
    ):
        """Decoder output before the vocabulary projection: (B, T, D). `src` (B, S) gives the padding mask;
        `decode`, `step` and `history` as for `Decoder`."""
        checks.check_model_input(
            "tgt_in", tgt_in, self.config, "target", positions=tgt_positions, segments=tgt_segments
        )
        if tuple(memory.shape[:2]) != tuple(src.shape):
            raise checks.TokenError(
                f"memory has shape {memory.shape} but src {src.shape}: memory must be the encoding of src, (B, S, D)"
            )
        if tgt_in.shape[0] % src.shape[0] or (tgt_segments is not None and tgt_in.shape[0] != src.shape[0]):
            raise checks.TokenError(
                f"tgt_in has {tgt_in.shape[0]} rows but src {src.shape[0]}: the target needs one row per source "
                f"row, or G per source row (G hypotheses of each sentence, consecutive; not with packed rows)"
            )
        self_mask, cross_mask = decoder_masks(src, tgt_in, self.config.pad_id, src_segments, tgt_segments)
        return self.decoder(
            self._embed("target", tgt_in),
            memory,
            self_mask,
            cross_mask,
            deterministic,
            decode,
            tgt_positions,
            step,
            history,
        )

    def output_kernel(self):
        """The output projection as a (V, D) matrix in the compute dtype, for `logits(kernel=...)`: the tied
        embedding table as it lies, or the untied projection's (D, V) kernel transposed. Decoding loops compute it
        once, before the loop (a transpose written inside the loop body would be redone at every step). Quantized:
        the int8 (V, D) matrix with its per-row scales."""
        dtype = compute_dtype(self.config)
        if self.config.quantize != "none":
            if self.config.tie_output:
                return self._embedding("target").embedding  # (V, D) int8
            return self.output_proj.variables["params"]["kernel"].T  # (V, D) int8 (a QArray's .T moves its scales too)
        if self.config.tie_output:
            return self._embedding("target").embedding.astype(dtype)  # (V, D)
        return self.output_proj.variables["params"]["kernel"].astype(dtype).T  # (V, D)

    def logits(self, hidden, kernel=None):
        """(B, T, D) -> (B, T, V) float32. Tied: the target embedding matrix, transposed, is the projection (paper
        3.4). `kernel`, if given, is the projection as `output_kernel` lays it out, for decoding steps
        (`vocabulary_major_logits`). The matmul's operands are in the compute dtype and its result is the float32
        accumulator (not rounded to bfloat16), so the loss and decoding's log-softmax see float32 logits."""
        if not self.config.tie_output and kernel is None:
            return self.output_proj(hidden)  # (B, T, V)
        dtype = compute_dtype(self.config)
        quantize = self.config.quantize
        if kernel is not None:
            logits = vocabulary_major_logits(hidden, kernel, quantize, dtype)  # (B, T, V)
        elif quantize != "none":
            table = self._embedding("target").embedding  # (V, D) int8
            quantization.check_mode(table, quantize, "the target embedding")
            logits = quantization.rows_times(hidden, table, quantize, dtype, contract=1)  # (B, T, V)
        elif dtype == jnp.float32:
            # hidden @ table.T (what nn.Embed.attend computes), with the table read as it lies: written as a
            # transpose, XLA may copy the whole table at every decoding step.
            logits = jnp.einsum("...d,vd->...v", hidden, self._embedding("target").embedding)
        else:
            table = self._embedding("target").embedding  # (V, D) float32
            logits = matmul_float32_result(hidden.astype(dtype), table.astype(dtype).T)  # (B, T, V)
        # Marian's logits bias on a tied output, or an untied projection's own (decoding's kernel path).
        if self.config.tie_output:
            bias = self.logits_bias if self.config.logits_bias else None
        else:
            bias = self.output_proj.variables["params"].get("bias")
        if bias is not None:  # added as a projection's bias is (cast to the compute dtype, then float32)
            logits = logits + bias.astype(dtype).astype(jnp.float32)
        return logits

    def decode(self, memory, src, tgt_in, deterministic: bool = True, decode: bool = False, kernel=None, **options):
        """memory (B, S, D), src (B, S), tgt_in (B, T) -> logits (B, T, V); `kernel` as for `logits`, `options`
        (packing, or a decoding step's `step` and `history`) as for `decoder_hidden`."""
        return self.logits(self.decoder_hidden(memory, src, tgt_in, deterministic, decode, **options), kernel)

    def __call__(
        self,
        src,
        tgt_in,
        deterministic: bool = True,
        *,
        src_segments=None,
        tgt_segments=None,
        src_positions=None,
        tgt_positions=None,
    ):
        """Teacher forcing: src (B, S), tgt_in (B, T) -> logits (B, T, V). Packed rows: segment ids and positions
        of both sides, (B, S) and (B, T)."""
        memory = self.encode(src, deterministic, src_segments=src_segments, src_positions=src_positions)
        return self.decode(
            memory,
            src,
            tgt_in,
            deterministic,
            src_segments=src_segments,
            tgt_segments=tgt_segments,
            tgt_positions=tgt_positions,
        )


def attention_maps(intermediates) -> dict[str, jnp.ndarray]:
    """Flattens the sown `intermediates` into {"encoder/layer_0/self_attention": (B, H, Tq, Tk), ...}, the same
    keys the PyTorch twin's `record_attention` gives."""
    maps = {}
    for path, value in jax.tree_util.tree_flatten_with_path(intermediates, is_leaf=lambda x: isinstance(x, tuple))[0]:
        keys = [p.key for p in path if hasattr(p, "key")]
        if keys and keys[-1] == "attention":
            maps["/".join(keys[:-1])] = value[-1]  # the last sown value: the most recent call
    return maps


def cross_attention_rows(intermediates, layer: int, rows: int):
    """Decoder layer `layer`'s cross-attention probabilities, sown by a call with "intermediates" mutable, averaged
    over heads: (rows, Tq, S), a row per query row. A decoding call lays the G = rows / sentences query rows of a
    sentence side by side (`MultiHeadAttention`): its sown array is (rows / G, H, G * Tq, S), G-major."""
    probs = intermediates["decoder"][f"layer_{layer}"]["cross_attention"]["attention"][-1]  # the last call's
    n, _, GT, S = probs.shape
    G = rows // n
    return jnp.mean(probs, axis=1).reshape(rows, GT // G, S)


def init_params(config: TransformerConfig, seed: int = 0):
    """Fresh float32 parameters for `config` (Xavier-uniform matrices, zero biases, unit LayerNorm scales). How the
    model computes (dtype, attention kernel) does not change them, so the dummy forward pass of `init` runs in
    float32, the default (op by op, as `init` does: bfloat16 ops compile slower on the CPU)."""
    dummy = jnp.ones((1, 2), dtype=jnp.int32)
    defaults = TransformerConfig().compute_settings()
    return Transformer(config.replace(**defaults)).init(jax.random.key(seed), dummy, dummy)["params"]
