"""The PyTorch twin of `jax_transformer.model.transformer`: the same architecture, config and parameter names (a Flax
`encoder/layer_0/self_attention/query/kernel` is `encoder.layers.0.self_attention.query.weight`, transposed), the
same bfloat16 policy with explicit casts, on whatever device its parameters are. Masks: True = may attend.
docs/internals.md#torch_reference-model."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from jax_transformer.model.positions import position_table
from jax_transformer.settings.config import TransformerConfig

# --- masks (True = may attend) -----------------------------------------------------------------------


def padding_mask(tokens: torch.Tensor, pad_id: int) -> torch.Tensor:
    """(B, T) token ids -> (B, 1, 1, T) bool, True where the key is a real token."""
    return (tokens != pad_id)[:, None, None, :]


def causal_mask(length: int, device=None) -> torch.Tensor:
    """(1, 1, T, T) lower-triangular bool: position i may attend to positions 0..i."""
    return torch.tril(torch.ones(length, length, dtype=torch.bool, device=device))[None, None]


def decoder_self_mask(tgt_in: torch.Tensor, pad_id: int) -> torch.Tensor:
    """(B, T) decoder input ids -> (B, 1, T, T): causal and not padding; the first position (the decoder's start
    token, whatever its id) is always a real key."""
    first = torch.arange(tgt_in.shape[1], device=tgt_in.device) == 0
    return (padding_mask(tgt_in, pad_id) | first[None, None, None, :]) & causal_mask(tgt_in.shape[1], tgt_in.device)


def segment_mask(query_segments: torch.Tensor, key_segments: torch.Tensor) -> torch.Tensor:
    """Packed rows: (B, Tq), (B, Tk) segment ids (0 = padding) -> (B, 1, Tq, Tk), True where the key is real and
    belongs to the query's own pair."""
    same = query_segments[:, :, None] == key_segments[:, None, :]
    return (same & (key_segments != 0)[:, None, :])[:, None]


def encoder_mask(src: torch.Tensor, pad_id: int, src_segments=None) -> torch.Tensor:
    return padding_mask(src, pad_id) if src_segments is None else segment_mask(src_segments, src_segments)


def decoder_masks(src, tgt_in, pad_id: int, src_segments=None, tgt_segments=None):
    """(decoder self-attention mask, cross-attention mask), as `jax_transformer.model.masks.decoder_masks`."""
    if tgt_segments is None:
        return decoder_self_mask(tgt_in, pad_id), padding_mask(src, pad_id)
    self_mask = segment_mask(tgt_segments, tgt_segments) & causal_mask(tgt_in.shape[1], tgt_in.device)
    return self_mask, segment_mask(tgt_segments, src_segments)


# --- modules -----------------------------------------------------------------------------------------


def compute_dtype(cfg: TransformerConfig) -> torch.dtype:
    """The dtype every matmul runs in: torch.float32 or torch.bfloat16 (`config.dtype`)."""
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.dtype]


def linear(layer: nn.Linear, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`layer(x)` computed in `dtype`: the input, weight and bias are cast (the parameters stay float32, and
    autograd returns their gradients in float32); the result is in `dtype`. A no-op cast in float32."""
    bias = None if layer.bias is None else layer.bias.to(dtype)
    return F.linear(x.to(dtype), layer.weight.to(dtype), bias)


class MatmulFloat32Result(torch.autograd.Function):
    """x (..., D) @ w.T for w (V, D), operands in a low-precision dtype, result float32 (not rounded to that dtype):
    the twin of `jax_transformer.model.transformer.matmul_float32_result`, used for the logits. Forward: a float32
    matmul of the operands' values, which is exactly low-precision operands with float32 accumulation (the product of
    two bfloat16 numbers is exact in float32; torch's bfloat16 matmul would round its result). Backward: the float32
    cotangent cast to the operands' dtype, both matmuls in that dtype, as in the Flax model."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return F.linear(x.float(), w.float())

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, w = ctx.saved_tensors
        g = g.to(x.dtype)  # (..., V)
        dw = g.reshape(-1, g.shape[-1]).T @ x.reshape(-1, x.shape[-1])  # (V, D)
        return g @ w, dw


def _layer_norm(cfg: TransformerConfig) -> nn.LayerNorm:
    """A LayerNorm over d_model; its bias (beta) only with `norm_bias`, as in the Flax model."""
    return nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps, bias=cfg.norm_bias)


class MultiHeadAttention(nn.Module):
    """Multi-head scaled dot-product attention (paper 3.2): softmax(Q K^T / sqrt(d_k)) V on H learned projections."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.cfg = cfg
        self.query = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.qkv_bias)
        self.key = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.qkv_bias)
        self.value = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.qkv_bias)
        self.out = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.qkv_bias)
        self.dropout = nn.Dropout(cfg.attention_dropout)
        self.recorder: tuple[dict, str] | None = None  # set by Transformer.record_attention

    def forward(self, x: torch.Tensor, memory: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x (B, Tq, D) queries' input; memory (B, Tk, D) keys' input (pass x for self-attention)."""
        q, k, v = self.project(self.query, x), self.project(self.key, memory), self.project(self.value, memory)
        return self.attend(q, k, v, mask)

    def project(self, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """(B, T, D) -> (B, T, H, K) through one of the query/key/value projections, in the compute dtype."""
        return linear(layer, x, compute_dtype(self.cfg)).view(x.shape[0], -1, self.cfg.num_heads, self.cfg.head_dim)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Projected q (B, Tq, H, K), k and v (B, Tk, H, K), mask broadcastable to (B, H, Tq, Tk) or None ->
        the output projection of the attention (B, Tq, D)."""
        B, Tq, H, K = q.shape
        # The scores leave the matmul in the compute dtype; scaling, masking and softmax run in float32.
        scores = torch.einsum("bqhk,bshk->bhqs", q, k).float() / math.sqrt(K)  # (B, H, Tq, Tk)
        # A large finite negative instead of -inf keeps all-padding rows finite (uniform), as in the Flax model.
        if mask is not None:
            scores = scores.masked_fill(~mask, torch.finfo(torch.float32).min)
        probs = torch.softmax(scores, dim=-1)  # (B, H, Tq, Tk) float32
        if self.recorder is not None:
            sink, name = self.recorder
            sink[name] = probs.detach()
        out = torch.einsum("bhqs,bshk->bqhk", self.dropout(probs).to(v.dtype), v).reshape(B, Tq, H * K)
        return linear(self.out, out, compute_dtype(self.cfg))


class FeedForward(nn.Module):
    """Position-wise feed-forward network (paper 3.3): FFN(x) = max(0, x W1 + b1) W2 + b2."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.linear1 = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.ffn_bias)
        self.linear2 = nn.Linear(cfg.d_ff, cfg.d_model, bias=cfg.ffn_bias)
        self.activation = {"relu": nn.ReLU(), "gelu": nn.GELU(approximate="none"), "silu": nn.SiLU()}[cfg.activation]
        self.dropout = nn.Dropout(cfg.activation_dropout)
        self.compute_dtype = compute_dtype(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = linear(self.linear1, x, self.compute_dtype).float()  # (B, T, F)
        # The activation and dropout in float32; linear2 casts the result to the compute dtype.
        return linear(self.linear2, self.dropout(self.activation(h)), self.compute_dtype)  # (B, T, D), compute dtype


class Residual(nn.Module):
    """Residual connection with dropout around a sub-layer, normalised after (post-norm, the paper) or before
    (pre-norm, the Annotated Transformer). Holds only the dropout; the LayerNorm is passed in so that parameter
    names stay flat (`self_attention_norm`), as in the Flax model. The residual stream is float32: the sub-layer's
    output (compute dtype) is upcast before dropout and the sum."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.norm_first = cfg.norm_first
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x, sublayer, norm):
        if self.norm_first:
            return x + self.dropout(sublayer(norm(x)).float())
        return norm(x + self.dropout(sublayer(x).float()))


class EncoderLayer(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.self_attention = MultiHeadAttention(cfg)
        self.self_attention_norm = _layer_norm(cfg)
        self.feed_forward = FeedForward(cfg)
        self.feed_forward_norm = _layer_norm(cfg)
        self.residual = Residual(cfg)

    def forward(self, x, src_mask):
        x = self.residual(x, lambda h: self.self_attention(h, h, src_mask), self.self_attention_norm)
        return self.residual(x, self.feed_forward, self.feed_forward_norm)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.self_attention = MultiHeadAttention(cfg)
        self.self_attention_norm = _layer_norm(cfg)
        self.cross_attention = MultiHeadAttention(cfg)
        self.cross_attention_norm = _layer_norm(cfg)
        self.feed_forward = FeedForward(cfg)
        self.feed_forward_norm = _layer_norm(cfg)
        self.residual = Residual(cfg)

    def forward(self, x, memory, self_mask, cross_mask):
        x = self.residual(x, lambda h: self.self_attention(h, h, self_mask), self.self_attention_norm)
        x = self.residual(x, lambda h: self.cross_attention(h, memory, cross_mask), self.cross_attention_norm)
        return self.residual(x, self.feed_forward, self.feed_forward_norm)


class Positions(nn.Module):
    """Adds the paper's fixed sinusoids (a non-persistent buffer: not in the state_dict) or a learned table."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        if cfg.positions == "learned":
            self.weight = nn.Parameter(torch.empty(cfg.max_len, cfg.d_model))
        else:
            self.register_buffer("table", torch.from_numpy(position_table(cfg)), persistent=False)

    def forward(self, x: torch.Tensor, offset: int = 0, positions: torch.Tensor | None = None) -> torch.Tensor:
        """positions (B, T): each token's position within its pair (packed rows); else offset, offset + 1, ..."""
        table = self.weight if hasattr(self, "weight") else self.table
        if positions is not None:
            return x + table[positions]
        return x + table[offset : offset + x.shape[1]][None]


def embed_positions(side: nn.Module, x: torch.Tensor, offset: int = 0, positions=None) -> torch.Tensor:
    """Embedded tokens (B, T, D) of an Encoder or Decoder with their positions, and its embedding LayerNorm."""
    x = side.positions(x, offset, positions)
    return side.embedding_norm(x) if side.embedding_norm is not None else x


class Encoder(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.positions = Positions(cfg)
        self.embedding_norm = _layer_norm(cfg) if cfg.embedding_norm else None
        self.dropout = nn.Dropout(cfg.embedding_dropout)
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.num_encoder_layers))
        self.final_norm = _layer_norm(cfg) if cfg.final_norm else None

    def forward(self, x, src_mask, positions=None):
        x = self.dropout(embed_positions(self, x, positions=positions))
        for layer in self.layers:
            x = layer(x, src_mask)
        return self.final_norm(x) if self.final_norm is not None else x


class Decoder(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.positions = Positions(cfg)
        self.embedding_norm = _layer_norm(cfg) if cfg.embedding_norm else None
        self.dropout = nn.Dropout(cfg.embedding_dropout)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_decoder_layers))
        self.final_norm = _layer_norm(cfg) if cfg.final_norm else None

    def forward(self, x, memory, self_mask, cross_mask, positions=None):
        x = self.dropout(embed_positions(self, x, positions=positions))
        for layer in self.layers:
            x = layer(x, memory, self_mask, cross_mask)
        return self.final_norm(x) if self.final_norm is not None else x


class Transformer(nn.Module):
    """The full model with the same entry points as the Flax one: `encode`, `decoder_hidden`, `logits`,
    `decode`, and `forward(src, tgt_in)` for teacher forcing."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.cfg = cfg
        # padding_idx: the pad row gets no gradient (as the Flax model's), whatever reset_parameters puts in it.
        if cfg.share_embeddings:
            self.shared_embed = nn.Embedding(cfg.src_vocab_size, cfg.d_model, padding_idx=cfg.pad_id)
        else:
            self.source_embed = nn.Embedding(cfg.src_vocab_size, cfg.d_model, padding_idx=cfg.pad_id)
            self.target_embed = nn.Embedding(cfg.tgt_vocab_size, cfg.d_model, padding_idx=cfg.pad_id)
        self.encoder = Encoder(cfg)
        self.decoder = Decoder(cfg)
        if not cfg.tie_output:
            self.output_proj = nn.Linear(cfg.d_model, cfg.tgt_vocab_size, bias=cfg.output_bias)
        elif cfg.logits_bias:  # Marian's final_logits_bias, on the tied output
            self.logits_bias = nn.Parameter(torch.zeros(cfg.tgt_vocab_size))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Xavier-uniform for every matrix (as the Annotated Transformer), zeros for biases, ones for scales."""
        for name, p in self.named_parameters():
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
            else:
                nn.init.ones_(p)

    def _embedding(self, side: str) -> nn.Embedding:
        if self.cfg.share_embeddings:
            return self.shared_embed
        return self.source_embed if side == "source" else self.target_embed

    def _embed(self, side: str, tokens: torch.Tensor) -> torch.Tensor:
        x = self._embedding(side)(tokens)
        return x * math.sqrt(self.cfg.d_model) if self.cfg.scale_embeddings else x

    def encode(self, src: torch.Tensor, *, src_segments=None, src_positions=None) -> torch.Tensor:
        """src (B, S) -> memory (B, S, D). Packed rows: segment ids and positions (B, S)."""
        mask = encoder_mask(src, self.cfg.pad_id, src_segments)
        return self.encoder(self._embed("source", src), mask, src_positions)

    def decoder_hidden(
        self, memory, src, tgt_in, *, src_segments=None, tgt_segments=None, tgt_positions=None
    ) -> torch.Tensor:
        """(B, T, D) decoder output before the vocabulary projection."""
        self_mask, cross_mask = decoder_masks(src, tgt_in, self.cfg.pad_id, src_segments, tgt_segments)
        return self.decoder(self._embed("target", tgt_in), memory, self_mask, cross_mask, tgt_positions)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(B, T, D) -> (B, T, V) float32: operands in the compute dtype, the result the float32 accumulator (as
        the Flax model); the untied projection's bias, cast to the compute dtype, is added to it."""
        dtype = compute_dtype(self.cfg)
        weight, bias = (
            (self._embedding("target").weight, getattr(self, "logits_bias", None))
            if self.cfg.tie_output
            else (self.output_proj.weight, self.output_proj.bias)
        )
        if dtype == torch.float32:
            return F.linear(hidden, weight, bias)
        logits = MatmulFloat32Result.apply(hidden.to(dtype), weight.to(dtype))
        return logits if bias is None else logits + bias.to(dtype)

    def decode(self, memory, src, tgt_in, **packing) -> torch.Tensor:
        """memory (B, S, D), src (B, S), tgt_in (B, T) -> logits (B, T, V)."""
        return self.logits(self.decoder_hidden(memory, src, tgt_in, **packing))

    def forward(
        self,
        src: torch.Tensor,
        tgt_in: torch.Tensor,
        *,
        src_segments=None,
        tgt_segments=None,
        src_positions=None,
        tgt_positions=None,
    ) -> torch.Tensor:
        """Teacher forcing; packed rows pass segment ids and positions of both sides (see the Flax model)."""
        memory = self.encode(src, src_segments=src_segments, src_positions=src_positions)
        return self.decode(
            memory, src, tgt_in, src_segments=src_segments, tgt_segments=tgt_segments, tgt_positions=tgt_positions
        )

    @contextlib.contextmanager
    def record_attention(self) -> Iterator[dict[str, torch.Tensor]]:
        """Within the block, every attention module stores its probabilities (B, H, Tq, Tk) in the yielded dict,
        under the Flax model's key, e.g. "decoder/layer_1/cross_attention"."""
        maps: dict[str, torch.Tensor] = {}
        modules = [(n, m) for n, m in self.named_modules() if isinstance(m, MultiHeadAttention)]
        for name, module in modules:
            module.recorder = (maps, name.replace("layers.", "layer_").replace(".", "/"))
        try:
            yield maps
        finally:
            for _, module in modules:
                module.recorder = None
