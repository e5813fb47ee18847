"""The configurations the tests, parity tests and benchmarks share: the parity suite's, the paper's base model, the
decoding tests' and the in-process unit-test model."""

from __future__ import annotations

from jax_transformer.settings.config import TransformerConfig, preset

_SMALL = dict(
    d_model=64,
    num_heads=4,
    d_ff=128,
    num_encoder_layers=2,
    num_decoder_layers=2,
    max_len=32,
    src_vocab_size=97,
    tgt_vocab_size=89,
)


# The configurations every parity check runs over (parity_tests/conftest.py's `config_case` fixture).
PARITY_CONFIGS: dict[str, TransformerConfig] = {
    # the paper: post-norm, sinusoidal, tied output, relu, biased projections
    "post_sinusoidal_tied_relu": TransformerConfig(**_SMALL),
    # the Annotated Transformer's layout: pre-norm with final norms; plus learned positions, untied, gelu, no bias
    # (and no bias anywhere: attention, feed-forward, LayerNorms, the output head, as nn.Transformer(bias=False))
    "pre_learned_untied_gelu_nobias": TransformerConfig(
        **_SMALL,
        norm_first=True,
        final_norm=True,
        positions="learned",
        tie_output=False,
        activation="gelu",
        qkv_bias=False,
        ffn_bias=False,
        norm_bias=False,
        output_bias=False,
    ),
    # one shared source/target table, unscaled embeddings, post-norm with final norms
    "post_shared_unscaled_final": TransformerConfig(
        **{**_SMALL, "tgt_vocab_size": 97}, share_embeddings=True, scale_embeddings=False, final_norm=True
    ),
    # what imported models need (Marian, fairseq, mBART): sinusoids in halves with tensor2tensor's frequencies
    # counted from position 2, silu, a bias on the tied logits, no BOS (the decoder starts from the pad id), a
    # LayerNorm on the embeddings
    "pretrained_variants": TransformerConfig(
        **_SMALL,
        embedding_norm=True,
        sinusoid_layout="halves",
        sinusoid_frequencies="tensor2tensor",
        position_offset=2,
        activation="silu",
        logits_bias=True,
        bos_id=None,
        decoder_start_id=0,
    ),
}


# The paper's base model (512, 8 heads, 2048, 6+6, post-norm, sinusoidal, ReLU) with a small vocabulary: the
# vocabulary size does not change the per-element arithmetic, only the cost.
BASE = preset("base", src_vocab_size=1000, tgt_vocab_size=1000, max_len=32)


# The decoding tests' models (tests/test_decoding.py, parity_tests/test_decoding_parity.py): tiny, a 40-token
# vocabulary and 16 positions, so that sources filling every position and outputs cut at max_len are cheap.
DECODING_VOCAB = 40


DECODING_MAX_LEN = 16


DECODING_CONFIGS: dict[str, TransformerConfig] = {
    # the paper: post-norm, sinusoidal; untied output, whose bias lets a test move EOS up (see eos_biased)
    "post_sinusoidal_untied": preset(
        "tiny", src_vocab_size=DECODING_VOCAB, tgt_vocab_size=DECODING_VOCAB, max_len=DECODING_MAX_LEN, tie_output=False
    ),
    # pre-norm with final norms, learned positions, one shared (tied) embedding table, gelu, a LayerNorm on the
    # embeddings (mBART's layout)
    "pre_learned_shared": preset(
        "tiny",
        src_vocab_size=DECODING_VOCAB,
        tgt_vocab_size=DECODING_VOCAB,
        max_len=DECODING_MAX_LEN,
        norm_first=True,
        final_norm=True,
        positions="learned",
        share_embeddings=True,
        activation="gelu",
        embedding_norm=True,
    ),
}


def unit_config() -> TransformerConfig:
    """The tiny preset with a 50-token vocabulary and 16 positions (dropout 0.1, label smoothing 0.1)."""
    return preset("tiny", src_vocab_size=50, tgt_vocab_size=50, max_len=16)


def unit_optim():
    """The paper's Adam and schedule with a 10-step warmup (a jax_transformer.training.trainer.OptimConfig)."""
    from jax_transformer.training.trainer import OptimConfig

    return OptimConfig(warmup_steps=10)


# Real models' shapes that the benchmarks time beside the presets (`preset_config` takes either name); random
# weights, so only the shape matters.
MODEL_SHAPES: dict[str, dict] = {
    # NLLB-200-distilled-600M's layers (M2M-100's architecture): pre-norm with final norms, one table for source,
    # target and output: 386M parameters with a 32,000-entry vocabulary, 615M with NLLB's own 256,206.
    "nllb-600m": dict(
        d_model=1024,
        num_heads=16,
        d_ff=4096,
        num_encoder_layers=12,
        num_decoder_layers=12,
        norm_first=True,
        final_norm=True,
        share_embeddings=True,
        max_len=256,
    ),
}


def preset_config(name: str, vocab: int) -> TransformerConfig:
    """A preset, or a shape of MODEL_SHAPES, with one vocabulary size for source and target (the benchmarks'
    models); dropout 0.1 and label smoothing 0.1 are the defaults."""
    if name in MODEL_SHAPES:
        return TransformerConfig(**MODEL_SHAPES[name], src_vocab_size=vocab, tgt_vocab_size=vocab)
    return preset(name, src_vocab_size=vocab, tgt_vocab_size=vocab)
