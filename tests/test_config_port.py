"""The shared config (validation, JSON round trip), the torch-free promise of `jax_transformer`, and how the model
reads and checks its parameters."""

import json
import subprocess
import sys

import pytest

from jax_transformer.errors import ConfigError
from jax_transformer.settings.config import OptimConfig, TransformerConfig, preset
from tests.helpers.configs import PARITY_CONFIGS


def test_default_is_the_papers_base_model():
    c = TransformerConfig()
    assert (c.d_model, c.num_heads, c.d_ff, c.num_encoder_layers, c.num_decoder_layers) == (512, 8, 2048, 6, 6)
    assert c.dropout == 0.1 and not c.norm_first and c.positions == "sinusoidal" and c.activation == "relu"


def test_json_round_trip():
    c = preset(
        "small",
        src_vocab_size=123,
        tgt_vocab_size=123,
        norm_first=True,
        positions="learned",
        share_embeddings=True,
        activation="gelu",
        ffn_bias=False,
        norm_bias=False,
        output_bias=False,
    )
    assert TransformerConfig.from_json(c.to_json()) == c
    assert hash(c) == hash(TransformerConfig.from_json(c.to_json()))  # usable as a static jit argument


def test_json_written_before_the_bias_switches_loads_with_every_bias():
    values = json.loads(preset("tiny").to_json())
    for name in ("ffn_bias", "norm_bias", "output_bias"):
        del values[name]
    c = TransformerConfig.from_json(json.dumps(values))
    assert c.qkv_bias and c.ffn_bias and c.norm_bias and c.output_bias


@pytest.mark.parametrize(
    "changes,field",
    [
        (dict(d_model=100, num_heads=8), "'d_model' (100) must be divisible by 'num_heads' (8)"),
        (dict(positions="rotary"), "'positions' must be one of"),
        (dict(activation="swish"), "'activation' must be one of"),
        (dict(dropout=1.0), "'dropout' must be in [0, 1)"),
        (dict(share_embeddings=True, src_vocab_size=10, tgt_vocab_size=11), "'share_embeddings' needs"),
        (dict(d_model="512"), "'d_model' must be an int"),
        (dict(norm_first=1), "'norm_first' must be true or false"),
        (dict(ffn_bias="no"), "'ffn_bias' must be true or false"),
        (dict(norm_bias=0), "'norm_bias' must be true or false"),
        (dict(output_bias=None), "'output_bias' must be true or false"),
        (dict(eos_id=0), "pad_id, bos_id, eos_id must differ"),
    ],
)
def test_invalid_values_name_the_field(changes, field):
    with pytest.raises(ConfigError) as info:
        TransformerConfig(**changes)
    assert field in str(info.value)


def test_unknown_names_are_listed():
    with pytest.raises(ConfigError, match=r"unknown TransformerConfig field\(s\) \['dmodel', 'heads'\]"):
        TransformerConfig.from_dict({"dmodel": 3, "heads": 2})
    with pytest.raises(ConfigError, match=r"unknown OptimConfig field\(s\) \['warmup'\]"):
        OptimConfig.from_dict({"warmup": 3})
    with pytest.raises(ConfigError, match="not valid JSON"):
        TransformerConfig.from_json("{nope")
    with pytest.raises(ConfigError, match="unknown preset 'huge'"):
        preset("huge")


def test_diff_names_changed_fields():
    a = preset("tiny")
    assert a.diff(a.replace(d_ff=128, dropout=0.0)) == {"d_ff": (64, 128), "dropout": (0.1, 0.0)}


def test_importing_the_flax_package_never_imports_torch():
    code = (
        "import sys, jax_transformer, jax_transformer.model.transformer, jax_transformer.interop.port, "
        "jax_transformer.training.losses, jax_transformer.data.corpus, jax_transformer.data.tokenizer, "
        "jax_transformer.data.batching; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_port_without_torch_is_exact_and_shapes_are_checked():
    import jax
    import numpy as np

    from jax_transformer.errors import PortError
    from jax_transformer.interop.port import flax_to_torch, torch_to_flax
    from jax_transformer.model.transformer import init_params

    cfg = preset("tiny", src_vocab_size=40, tgt_vocab_size=40)
    params = init_params(cfg, 3)
    state = flax_to_torch(params)
    assert state["encoder.layers.0.self_attention.query.weight"].shape == (cfg.d_model, cfg.d_model)
    np.testing.assert_array_equal(
        state["decoder.layers.1.feed_forward.linear1.weight"],
        np.asarray(params["decoder"]["layer_1"]["feed_forward"]["linear1"]["kernel"]).T,
    )
    back = torch_to_flax(state, cfg)
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(back)):
        np.testing.assert_array_equal(np.asarray(a), b)
    with pytest.raises(PortError, match="d_ff|expected"):
        torch_to_flax(state, cfg.replace(d_ff=32))


# Learned positions, untied output, LayerNorms without bias; one shared table; Marian's logits bias on a tied output.
PARAMETER_CASES = {
    "pre_learned_untied_gelu_nobias": PARITY_CONFIGS["pre_learned_untied_gelu_nobias"],
    "post_shared_unscaled_final": PARITY_CONFIGS["post_shared_unscaled_final"],
    "tied_logits_bias": PARITY_CONFIGS["post_sinusoidal_tied_relu"].replace(logits_bias=True),
}


@pytest.mark.parametrize("case", PARAMETER_CASES)
def test_a_parameter_of_another_shape_is_named_with_both_shapes(case):
    """A parameter tree that does not fit the config is Flax's ScopeParamShapeError, naming the parameter and both
    shapes, not a broadcast or a wrong answer."""
    import flax.errors
    import jax
    import jax.numpy as jnp

    from jax_transformer.model.transformer import Transformer, init_params

    config = PARAMETER_CASES[case]
    params = init_params(config, 0)
    src, tgt = jnp.ones((2, 5), jnp.int32), jnp.ones((2, 4), jnp.int32)
    assert Transformer(config).apply({"params": params}, src, tgt).shape == (2, 4, config.tgt_vocab_size)
    kernel = "['decoder']['layer_0']['feed_forward']['linear1']['kernel']"
    cut = lambda path, x: x[:, :-1] if jax.tree_util.keystr(path) == kernel else x  # noqa: E731
    wrong = jax.tree_util.tree_map_with_path(cut, params)
    d, f = config.d_model, config.d_ff
    message = rf'"kernel" in "/decoder/layer_0/feed_forward/linear1".*shape \({d}, {f}\).*shape \({d}, {f - 1}\)'
    with pytest.raises(flax.errors.ScopeParamShapeError, match=message):
        Transformer(config).apply({"params": wrong}, src, tgt)
