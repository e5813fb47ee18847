"""The models of this family the field trained, in this project's terms: transformers' Marian (OPUS-MT) and FSMT,
and fairseq's transformer checkpoints. Their configs become `TransformerConfig`s (and the generation settings they
decode with), and their weights map to and from this project's parameters on numpy arrays, by one table of names
per family. Reading and writing their files is `jax_transformer.interop.hub`; nothing here imports torch."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from jax_transformer.errors import ConfigError, PortError
from jax_transformer.model.params import expected_param_shapes, flatten, unflatten
from jax_transformer.settings.config import TransformerConfig

FAMILIES = ("marian", "fsmt", "fairseq", "m2m_100", "mbart")
ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "swish": "silu", "silu": "silu"}

# Inside a layer: their module name -> ours (the Linear / LayerNorm leaves map by _LEAF below).
_LAYER = {
    "self_attn.q_proj": "self_attention/query",
    "self_attn.k_proj": "self_attention/key",
    "self_attn.v_proj": "self_attention/value",
    "self_attn.out_proj": "self_attention/out",
    "self_attn_layer_norm": "self_attention_norm",
    "encoder_attn.q_proj": "cross_attention/query",
    "encoder_attn.k_proj": "cross_attention/key",
    "encoder_attn.v_proj": "cross_attention/value",
    "encoder_attn.out_proj": "cross_attention/out",
    "encoder_attn_layer_norm": "cross_attention_norm",
    "fc1": "feed_forward/linear1",
    "fc2": "feed_forward/linear2",
    "final_layer_norm": "feed_forward_norm",
}
_PREFIX = {"marian": "model.", "fsmt": "model.", "fairseq": "", "m2m_100": "model.", "mbart": "model."}
# The families whose one table is `model.shared` (encoder, decoder and the tied output read it).
_SHARED_TABLE = ("marian", "m2m_100", "mbart")
# mBART's learned position table has two rows before position 0 (transformers' `offset = 2`); no input reads them.
MBART_POSITION_OFFSET = 2


# =============================================================================================================
# Configs
# =============================================================================================================


def _same(hf: Mapping[str, Any], a: str, b: str, what: str) -> Any:
    if hf.get(a) != hf.get(b):
        raise ConfigError(
            f"{what}: {a}={hf.get(a)} and {b}={hf.get(b)} differ; this project's encoder and decoder share it"
        )
    return hf[a]


def _activation(name: str, what: str) -> str:
    if name not in ACTIVATIONS:
        raise ConfigError(f"{what}: activation_function {name!r} is not one of {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def _common(hf: Mapping[str, Any], what: str, layerdrop: bool = False) -> dict[str, Any]:
    """The fields transformers' translation configs name alike. `layerdrop`: the family's LayerDrop is accepted
    (it skips layers in training only; fine-tuning here keeps every layer, which the docs say)."""
    for key in ("encoder_layerdrop", "decoder_layerdrop"):
        if hf.get(key) and not layerdrop:
            raise ConfigError(f"{what}: {key}={hf[key]} (LayerDrop) has no counterpart here")
    return dict(
        d_model=hf["d_model"],
        num_heads=_same(hf, "encoder_attention_heads", "decoder_attention_heads", what),
        d_ff=_same(hf, "encoder_ffn_dim", "decoder_ffn_dim", what),
        num_encoder_layers=hf["encoder_layers"],
        num_decoder_layers=hf["decoder_layers"],
        max_len=hf["max_position_embeddings"],
        dropout=float(hf.get("dropout", 0.1)),
        attention_dropout=float(hf.get("attention_dropout", 0.0)),
        activation_dropout=float(hf.get("activation_dropout", 0.0)),
        embedding_dropout=float(hf.get("dropout", 0.1)),
        activation=_activation(hf.get("activation_function", "relu"), what),
        scale_embeddings=bool(hf.get("scale_embedding", False)),
        positions="sinusoidal",
        sinusoid_layout="halves",
        norm_first=False,
        final_norm=False,
        layer_norm_eps=1e-5,
        pad_id=hf["pad_token_id"],
        eos_id=hf["eos_token_id"],
    )


def marian_config(hf: Mapping[str, Any], what: str = "Marian config") -> TransformerConfig:
    """A transformers MarianConfig (as a dict) in this project's terms: post-norm, sinusoids in halves with the
    paper's frequencies from position 0, the decoder starting from the pad id, a bias on the tied logits
    (final_logits_bias); one shared vocabulary unless share_encoder_decoder_embeddings is false."""
    shared = bool(hf.get("share_encoder_decoder_embeddings", True))
    tied = bool(hf.get("tie_word_embeddings", True))
    vocab = hf["vocab_size"]
    return TransformerConfig(
        **_common(hf, what),
        src_vocab_size=vocab,
        tgt_vocab_size=vocab if shared else (hf.get("decoder_vocab_size") or vocab),
        bos_id=hf.get("bos_token_id"),
        decoder_start_id=hf["decoder_start_token_id"],
        sinusoid_frequencies="paper",
        position_offset=0,
        share_embeddings=shared,
        tie_output=tied,
        logits_bias=tied,  # final_logits_bias; an untied lm_head gets it as its bias
        output_bias=not tied,
    )


def fsmt_config(hf: Mapping[str, Any], what: str = "FSMT config") -> TransformerConfig:
    """A transformers FSMTConfig (as a dict): fairseq's transformer, two vocabularies, sinusoids in halves with
    tensor2tensor's frequencies counted from pad + 1, the decoder starting from EOS, no output bias."""
    return TransformerConfig(
        **_common(hf, what),
        src_vocab_size=hf["src_vocab_size"],
        tgt_vocab_size=hf["tgt_vocab_size"],
        bos_id=hf.get("bos_token_id", 0),
        decoder_start_id=hf.get("decoder_start_token_id", hf["eos_token_id"]),
        sinusoid_frequencies="tensor2tensor",
        position_offset=hf["pad_token_id"] + 1,
        share_embeddings=False,
        tie_output=bool(hf.get("tie_word_embeddings", False)),
        output_bias=False,
    )


def m2m100_config(hf: Mapping[str, Any], what: str = "M2M-100 config") -> TransformerConfig:
    """A transformers M2M100Config (M2M-100 and NLLB-200's dense models) as a dict: pre-norm with final norms, one
    table for encoder, decoder and the tied output, sinusoids in halves with tensor2tensor's frequencies counted
    from pad + 1 (as FSMT's), scaled embeddings, the decoder starting from EOS, no logits bias."""
    return TransformerConfig(
        **_one_table_pre_norm(hf, what),
        decoder_start_id=hf.get("decoder_start_token_id", hf["eos_token_id"]),
        sinusoid_frequencies="tensor2tensor",
        position_offset=hf["pad_token_id"] + 1,
        logits_bias=False,
    )


def mbart_config(hf: Mapping[str, Any], what: str = "mBART config") -> TransformerConfig:
    """A transformers MBartConfig (mBART-50 and mBART's fine-tunes) as a dict: pre-norm with final norms, a
    LayerNorm on the embeddings (layernorm_embedding), learned positions (their table's rows from
    MBART_POSITION_OFFSET on), one shared table, a bias on the tied logits (final_logits_bias)."""
    return TransformerConfig(
        **{**_one_table_pre_norm(hf, what), "positions": "learned"},
        embedding_norm=True,
        decoder_start_id=hf.get("decoder_start_token_id"),  # None: generate starts from bos_token_id
        logits_bias=True,
    )


def _one_table_pre_norm(hf: Mapping[str, Any], what: str) -> dict[str, Any]:
    """What M2M-100's and mBART's configs share: `_common`'s fields (LayerDrop accepted), pre-norm with final
    norms, one vocabulary in one table for encoder, decoder and the tied output."""
    if not hf.get("tie_word_embeddings", True):
        raise ConfigError(f"{what}: tie_word_embeddings=false (an untied lm_head) is not imported for this family")
    return {
        **_common(hf, what, layerdrop=True),
        "norm_first": True,
        "final_norm": True,
        "src_vocab_size": hf["vocab_size"],
        "tgt_vocab_size": hf["vocab_size"],
        "bos_id": hf.get("bos_token_id", 0),
        "share_embeddings": True,
        "tie_output": True,
    }


def fairseq_config(args: Mapping[str, Any], src_vocab: int, tgt_vocab: int, what: str) -> TransformerConfig:
    """A fairseq transformer's `args` (or its cfg["model"]) with its dictionaries' sizes; fairseq dictionaries put
    <s> 0, <pad> 1, </s> 2, <unk> 3."""
    get = lambda name, default=None: args.get(name, default)  # noqa: E731
    if get("encoder_normalize_before", False) != get("decoder_normalize_before", False):
        raise ConfigError(f"{what}: encoder_normalize_before and decoder_normalize_before differ")
    if get("no_token_positional_embeddings", False) or get("layernorm_embedding", False):
        raise ConfigError(f"{what}: no_token_positional_embeddings / layernorm_embedding have no counterpart here")
    learned = bool(get("encoder_learned_pos", False))
    if learned != bool(get("decoder_learned_pos", False)):
        raise ConfigError(f"{what}: encoder_learned_pos and decoder_learned_pos differ")
    if learned:
        raise ConfigError(f"{what}: learned positions (encoder_learned_pos) are not imported; sinusoidal ones are")
    d = get("encoder_embed_dim", 512)
    for name in ("decoder_embed_dim",):
        if get(name, d) != d:
            raise ConfigError(f"{what}: {name}={get(name)} differs from encoder_embed_dim={d}")
    heads, ffn = get("encoder_attention_heads", 8), get("encoder_ffn_embed_dim", 2048)
    if get("decoder_attention_heads", heads) != heads or get("decoder_ffn_embed_dim", ffn) != ffn:
        raise ConfigError(f"{what}: encoder and decoder attention heads / ffn dims differ")
    shared = bool(get("share_all_embeddings", False))
    norm_first = bool(get("encoder_normalize_before", False))
    return TransformerConfig(
        src_vocab_size=src_vocab,
        tgt_vocab_size=tgt_vocab,
        pad_id=1,
        bos_id=0,
        eos_id=2,
        decoder_start_id=2,
        d_model=d,
        num_heads=heads,
        d_ff=ffn,
        num_encoder_layers=get("encoder_layers", 6),
        num_decoder_layers=get("decoder_layers", 6),
        max_len=min(get("max_source_positions", 1024), get("max_target_positions", 1024)),
        dropout=float(get("dropout", 0.1)),
        attention_dropout=float(get("attention_dropout", 0.0)),
        activation_dropout=float(get("activation_dropout", get("relu_dropout", 0.0)) or 0.0),
        embedding_dropout=float(get("dropout", 0.1)),
        activation=_activation(get("activation_fn", "relu"), what),
        scale_embeddings=not get("no_scale_embedding", False),
        positions="sinusoidal",
        sinusoid_layout="halves",
        sinusoid_frequencies="tensor2tensor",
        position_offset=2,
        norm_first=norm_first,
        final_norm=norm_first,
        layer_norm_eps=1e-5,
        share_embeddings=shared,
        tie_output=bool(get("share_decoder_input_output_embed", False)) or shared,
        output_bias=False,
    )


# =============================================================================================================
# Weights: one table of names per family, read both ways
# =============================================================================================================


def name_table(config: TransformerConfig, family: str) -> dict[tuple[str, ...], str]:
    """{our Flax parameter path: their state_dict key} for every parameter of `config`'s model."""
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    p = _PREFIX[family]
    table = {}
    for side, n in (("encoder", config.num_encoder_layers), ("decoder", config.num_decoder_layers)):
        for i in range(n):
            for theirs, ours in _LAYER.items():
                if side == "encoder" and theirs.startswith("encoder_attn"):
                    continue
                for leaf, their_leaf in (("kernel", "weight"), ("scale", "weight"), ("bias", "bias")):
                    table[(side, f"layer_{i}", *ours.split("/"), leaf)] = f"{p}{side}.layers.{i}.{theirs}.{their_leaf}"
        if config.final_norm:
            for leaf, their_leaf in (("scale", "weight"), ("bias", "bias")):
                table[(side, "final_norm", leaf)] = f"{p}{side}.layer_norm.{their_leaf}"
        if config.embedding_norm:
            for leaf, their_leaf in (("scale", "weight"), ("bias", "bias")):
                table[(side, "embedding_norm", leaf)] = f"{p}{side}.layernorm_embedding.{their_leaf}"
        if config.positions == "learned":
            table[(side, "positions", "embedding")] = f"{p}{side}.embed_positions.weight"
    if config.share_embeddings:
        table[("shared_embed", "embedding")] = (
            "model.shared.weight" if family in _SHARED_TABLE else f"{p}encoder.embed_tokens.weight"
        )
    else:
        table[("source_embed", "embedding")] = f"{p}encoder.embed_tokens.weight"
        table[("target_embed", "embedding")] = f"{p}decoder.embed_tokens.weight"
    if not config.tie_output:
        table[("output_proj", "kernel")] = (
            "lm_head.weight" if family in _SHARED_TABLE else f"{p}decoder.output_projection.weight"
        )
        table[("output_proj", "bias")] = "final_logits_bias"  # Marian only: an untied output with a bias
    if config.logits_bias:
        table[("logits_bias",)] = "final_logits_bias"
    shapes = expected_param_shapes(config)
    return {path: name for path, name in table.items() if path in shapes}


# Keys their state_dicts may hold that are not weights, or are copies of weights: tied embeddings and heads, the
# sinusoid tables (recomputed here), fairseq's bookkeeping.
def _ignorable(key: str, family: str, config: TransformerConfig) -> bool:
    sinusoids = ("embed_positions.weight", "embed_positions.weights", "embed_positions._float_tensor")
    if key.endswith((*sinusoids, ".version")) or key == "version":
        return True
    copies = (
        {"model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight"} if config.share_embeddings else set()
    )
    if family in _SHARED_TABLE:
        copies |= {"lm_head.weight"} if config.tie_output else set()
    elif config.tie_output:
        copies |= {f"{_PREFIX[family]}decoder.output_projection.weight"}
    if family == "fairseq" and config.share_embeddings:
        copies |= {"decoder.embed_tokens.weight"}
    return key in copies


def to_params(
    state: Mapping[str, Any], config: TransformerConfig, family: str, where: str, consume: bool = False
) -> dict[str, Any]:
    """Their state_dict (numpy arrays) -> Flax params of `config`, strictly: keys missing, left over or of the wrong
    shape are reported together (PortError naming `where`). Linear weights are transposed; final_logits_bias (1, V)
    becomes a (V,) vector; tied copies must equal the weight they copy. `consume`: `state` (a dict) gives up each
    array as it is converted, so a model is in memory about once, not twice."""
    table = name_table(config, family)
    shapes = expected_param_shapes(config)
    problems, flat = [], {}
    keys = set(state)
    for path, key in table.items():
        if key not in state:
            problems.append(f"missing {key} (for {'/'.join(path)}, shape {shapes[path]})")
            continue
        array = np.asarray(state.pop(key) if consume else state[key], dtype=np.float32)
        array = array.reshape(-1) if key == "final_logits_bias" else array
        array = array.T if path[-1] == "kernel" else array
        if family == "mbart" and path[-2:] == ("positions", "embedding"):
            array = array[MBART_POSITION_OFFSET:]
        if array.shape != shapes[path]:
            problems.append(f"shape mismatch {key}: expected {shapes[path]} (as {'/'.join(path)}), got {array.shape}")
            continue
        flat[path] = np.ascontiguousarray(array)
    known = set(table.values())
    for key in sorted(keys - known):
        if not _ignorable(key, family, config):
            problems.append(f"unexpected {key}: shape {tuple(np.shape(state[key]))}")
    if problems:
        raise PortError(f"{where}: {len(problems)} problem(s) mapping {family} weights:\n  " + "\n  ".join(problems))
    return unflatten(flat)


def from_params(params: Mapping[str, Any], config: TransformerConfig, family: str) -> dict[str, np.ndarray]:
    """Flax params -> their state_dict (numpy float32), tied copies written out as the family's files hold them."""
    flat = flatten(params)
    state = {}
    for path, key in name_table(config, family).items():
        array = np.asarray(flat[path], dtype=np.float32)
        array = array.T if path[-1] == "kernel" else array
        if family == "mbart" and path[-2:] == ("positions", "embedding"):  # the rows no input reads, as zeros
            array = np.concatenate([np.zeros((MBART_POSITION_OFFSET, array.shape[1]), np.float32), array])
        state[key] = np.ascontiguousarray(array[None] if key == "final_logits_bias" else array)
    if family in _SHARED_TABLE:
        if config.share_embeddings:
            embed = state["model.shared.weight"]
            state["model.encoder.embed_tokens.weight"] = state["model.decoder.embed_tokens.weight"] = embed
        if config.tie_output:
            state["lm_head.weight"] = state["model.decoder.embed_tokens.weight"]
        if family != "m2m_100":  # a buffer of Marian's and mBART's models, zero where the model has no bias
            state.setdefault("final_logits_bias", np.zeros((1, config.tgt_vocab_size), np.float32))
    elif config.tie_output:
        state[f"{_PREFIX[family]}decoder.output_projection.weight"] = state[
            f"{_PREFIX[family]}decoder.embed_tokens.weight"
        ]
    return state


def check_copies(state: Mapping[str, Any], config: TransformerConfig, family: str, where: str) -> None:
    """A tied copy in their files (an lm_head, a shared table written twice) must equal what it copies, or the
    model they trained is not the one a tied config describes."""
    pairs = []
    p = _PREFIX[family]
    if config.tie_output:
        head = "lm_head.weight" if family in _SHARED_TABLE else f"{p}decoder.output_projection.weight"
        target = (
            "model.shared.weight"
            if family in _SHARED_TABLE and config.share_embeddings
            else f"{p}decoder.embed_tokens.weight"
        )
        if family == "fairseq" and config.share_embeddings:
            target = "encoder.embed_tokens.weight"
        pairs.append((head, target))
    for head, target in pairs:
        if head in state and target in state and not np.array_equal(np.asarray(state[head]), np.asarray(state[target])):
            raise PortError(f"{where}: {head} differs from {target}, but the config ties them")


# =============================================================================================================
# Exporting this project's own models as Marian
# =============================================================================================================


def marian_refusals(config: TransformerConfig) -> list[str]:
    """What in `config` a MarianMTModel cannot represent, each naming the setting (empty: it can)."""
    problems = []
    if config.positions != "sinusoidal":
        problems.append(f"positions={config.positions!r}: Marian has sinusoid tables only")
    if config.sinusoid_frequencies != "paper" or config.position_offset != 0:
        problems.append("sinusoid_frequencies/position_offset: Marian's table has the paper's frequencies from 0")
    if config.norm_first or config.final_norm or config.embedding_norm:
        problems.append("norm_first/final_norm/embedding_norm: Marian is post-norm without other norms")
    if config.layer_norm_eps != 1e-5:
        problems.append(f"layer_norm_eps={config.layer_norm_eps}: Marian's LayerNorms use 1e-5")
    if config.embedding_dropout != config.dropout:
        problems.append("embedding_dropout differs from dropout: Marian has one dropout for both")
    if config.bos_id is not None and config.decoder_start_id not in (None, config.bos_id):
        problems.append("decoder_start_id differs from bos_id: Marian has one decoder start token")
    return problems


def interleaved_to_halves(config: TransformerConfig) -> np.ndarray:
    """The permutation of the model dimension that takes the interleaved sinusoid table (sin, cos, sin, cos ...)
    to the halves one (sin ... sin, cos ... cos): new column j is old column perm[j]. Applied to every weight
    that reads or writes the residual stream, it turns a model into the same function in the permuted basis."""
    d = config.d_model
    return np.concatenate([np.arange(0, d, 2), np.arange(1, d, 2)])


def permute_model_dimension(params: Mapping[str, Any], config: TransformerConfig, perm: np.ndarray) -> dict:
    """Params of the same model with its residual stream's dimension permuted by `perm` (see
    `interleaved_to_halves`): embeddings' and LayerNorms' last axis, the input axis of every matrix that reads the
    stream (query/key/value, linear1, the output projection) and the output axis of every one that writes it (out,
    linear2). Attention heads and the feed-forward width are inside sub-layers and stay as they are."""
    out = {}
    for path, value in flatten(params).items():
        value = np.asarray(value)
        module, leaf = path[-2] if len(path) > 1 else "", path[-1]
        if leaf == "embedding" or module.endswith("_norm") or module == "final_norm":
            value = value[..., perm]
        elif leaf == "kernel" and module in ("query", "key", "value", "linear1", "output_proj"):
            value = value[perm, :]  # (D, out): the stream is the input
        elif leaf == "kernel" and module in ("out", "linear2"):
            value = value[:, perm]  # (in, D): the stream is the output
        elif leaf == "bias" and module in ("out", "linear2"):
            value = value[perm]
        out[path] = np.ascontiguousarray(value)
    return unflatten(out)
