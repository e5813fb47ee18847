"""The weight map both ways: bit-exact round trips, strict errors, explicit dtype handling, a deliberately wrong
port that the parity checks catch, and check 5: `torch.nn.Transformer` weights give the same logits in Flax."""

import math
import re

import numpy as np
import pytest
import torch
from torch import nn

import torch_reference
from jax_transformer.errors import PortError
from jax_transformer.interop.port import flax_to_torch, from_nn_transformer, torch_name, torch_to_flax
from jax_transformer.model.params import expected_param_shapes
from jax_transformer.model.transformer import Transformer
from tests.helpers.batches import make_batch
from tests.helpers.configs import PARITY_CONFIGS as CONFIGS
from tests.helpers.twins import flat, max_abs_diff, t, twin_device, twin_models

ATOL = 1e-5  # forward quantities: see test_forward_parity.py


def test_round_trip_is_bit_exact(config_case):
    _, cfg = config_case
    _, params, torch_model = twin_models(cfg, seed=7)
    back = torch_to_flax(torch_model.state_dict(), cfg)  # torch tensors in, through the torch model
    ours, theirs = flat(params), flat(back)
    assert ours.keys() == theirs.keys()
    for path, value in ours.items():
        assert np.asarray(value).dtype == theirs[path].dtype == np.float32
        np.testing.assert_array_equal(np.asarray(value), theirs[path], err_msg=str(path))
    # and the other way: torch -> flax -> torch
    fresh = torch_reference.Transformer(cfg)
    again = flax_to_torch(torch_to_flax(fresh.state_dict(), cfg))
    for name, tensor in fresh.state_dict().items():
        np.testing.assert_array_equal(tensor.numpy(), again[name], err_msg=name)


def test_bias_switches_remove_exactly_their_parameters():
    """Each bias switch removes its biases, and only those, from both twins alike. (Biases start at zero, where
    logits cannot tell a missing bias from a present one, so this is checked on the names.)"""
    cfg = CONFIGS["post_sinusoidal_tied_relu"].replace(tie_output=False, final_norm=True)
    names = lambda c: {torch_name(path) for path in expected_param_shapes(c)}  # noqa: E731
    everything = names(cfg)
    owners = {
        "qkv_bias": r"_attention\.(query|key|value|out)\.bias",
        "ffn_bias": r"feed_forward\.linear[12]\.bias",
        "norm_bias": r"_norm\.bias",
        "output_bias": r"output_proj\.bias",
    }
    for field, pattern in owners.items():
        off = cfg.replace(**{field: False})
        flax_names = names(off)
        assert flax_names == set(torch_reference.Transformer(off).state_dict()), field
        removed = everything - flax_names
        assert removed and removed == {n for n in everything if re.search(pattern, n)}, field
    # the tied output has no bias whatever output_bias says
    tied = cfg.replace(tie_output=True)
    assert names(tied) == names(tied.replace(output_bias=False))


def test_strict_errors_list_every_offending_name():
    cfg = CONFIGS["post_sinusoidal_tied_relu"]
    state = torch_reference.numpy_state_dict(torch_reference.Transformer(cfg))
    del state["encoder.layers.0.self_attention.query.weight"]
    del state["decoder.layers.1.feed_forward_norm.bias"]
    state["encoder.layers.9.self_attention.query.weight"] = np.zeros((64, 64), np.float32)
    state["decoder.layers.0.feed_forward.linear1.weight"] = np.zeros((64, 128), np.float32)  # transposed shape
    with pytest.raises(PortError) as info:
        torch_to_flax(state, cfg)
    message = str(info.value)
    assert "4 problem(s)" in message
    assert "missing encoder.layers.0.self_attention.query.weight: expected shape (64, 64)" in message
    assert "missing decoder.layers.1.feed_forward_norm.bias: expected shape (64,)" in message
    assert "unexpected encoder.layers.9.self_attention.query.weight: shape (64, 64)" in message
    assert "shape mismatch decoder.layers.0.feed_forward.linear1.weight: expected (128, 64), got (64, 128)" in message


def test_dtypes_are_refused_or_converted_explicitly():
    cfg = CONFIGS["post_sinusoidal_tied_relu"]
    model = torch_reference.Transformer(cfg)
    half = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    with pytest.raises(PortError, match=r"dtype torch.bfloat16, expected torch.float32"):
        torch_to_flax(half, cfg)
    converted = torch_to_flax(half, cfg, convert_dtypes=True)
    assert all(np.asarray(v).dtype == np.float32 for v in flat(converted).values())
    doubles = {k: v.double().numpy() for k, v in model.state_dict().items()}
    with pytest.raises(PortError, match=r"dtype float64, expected float32"):
        torch_to_flax(doubles, cfg)
    ints = {k: v.numpy().astype(np.int32) for k, v in model.state_dict().items()}
    with pytest.raises(PortError, match="int32"):
        torch_to_flax(ints, cfg, convert_dtypes=True)  # integers are never weights


def test_a_wrong_port_is_caught(parity_report):
    """Transposing one square kernel keeps every shape valid, so only the numbers can tell: the logits check
    that passes for the right port must fail for this one."""
    cfg = CONFIGS["post_sinusoidal_tied_relu"]
    model, params, torch_model = twin_models(cfg, seed=8)
    batch = make_batch(cfg, seed=8)
    src, tgt_in = batch["src"], batch["tgt_in"]
    state = torch_reference.numpy_state_dict(torch_model)
    name = "decoder.layers.1.self_attention.value.weight"
    state[name] = state[name].T.copy()
    wrong = torch_to_flax(state, cfg)
    with torch.no_grad():
        reference = torch_model(t(src), t(tgt_in))
    right_diff = max_abs_diff(
        model.apply({"params": torch_to_flax(torch_model.state_dict(), cfg)}, src, tgt_in), reference
    )
    wrong_diff = max_abs_diff(model.apply({"params": wrong}, src, tgt_in), reference)
    parity_report("deliberately transposed kernel (must fail)", "post_sinusoidal_tied_relu", wrong_diff, ATOL)
    assert right_diff <= ATOL
    assert wrong_diff > 100 * ATOL


# --- torch.nn.Transformer ---------------------------------------------------------------------------------


class NNTransformerSeq2Seq(nn.Module):
    """How people build a translation model around torch.nn.Transformer: embeddings scaled by sqrt(d), sinusoidal
    positions, nn.Transformer (batch_first), a linear output layer."""

    def __init__(
        self, vocab, d_model=64, nhead=4, layers=2, d_ff=128, norm_first=False, activation="relu", bias=True, max_len=32
    ):
        super().__init__()
        self.d_model = d_model
        self.src_embed = nn.Embedding(vocab, d_model)
        self.tgt_embed = nn.Embedding(vocab, d_model)
        self.transformer = nn.Transformer(
            d_model,
            nhead,
            layers,
            layers,
            d_ff,
            dropout=0.0,
            batch_first=True,
            norm_first=norm_first,
            activation=activation,
            bias=bias,
        )
        self.generator = nn.Linear(d_model, vocab, bias=bias)
        position = torch.arange(max_len)[:, None]
        div = torch.exp(torch.arange(0, d_model, 2) * (-math.log(10000.0) / d_model))
        pe = torch.zeros(max_len, d_model)
        pe[:, 0::2], pe[:, 1::2] = torch.sin(position * div), torch.cos(position * div)
        self.register_buffer("pe", pe)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.xavier_uniform_(p)

    def forward(self, src, tgt, pad_id=0):
        embed = lambda e, x: e(x) * math.sqrt(self.d_model) + self.pe[: x.shape[1]]
        causal = torch.triu(torch.ones(tgt.shape[1], tgt.shape[1], dtype=torch.bool, device=tgt.device), 1)  # blocked
        out = self.transformer(
            embed(self.src_embed, src),
            embed(self.tgt_embed, tgt),
            tgt_mask=causal,
            src_key_padding_mask=src == pad_id,
            tgt_key_padding_mask=tgt == pad_id,
            memory_key_padding_mask=src == pad_id,
        )
        return self.generator(out)


# Each bias setting with both norm placements and both activations; bias=False also drops the output layer's bias.
@pytest.mark.parametrize(
    "norm_first,activation,bias",
    [(False, "relu", True), (True, "gelu", True), (False, "gelu", False), (True, "relu", False)],
)
def test_nn_transformer_import_gives_same_logits(norm_first, activation, bias, parity_report):
    torch.manual_seed(0)
    vocab = 53
    # On twin_device() like the batches t() makes (`pytest --device cuda`: both on the GPU).
    theirs = NNTransformerSeq2Seq(vocab, norm_first=norm_first, activation=activation, bias=bias).to(twin_device())
    # torch starts attention biases and LayerNorm betas at zero and LayerNorm scales at one, where a bias dropped
    # or put in the wrong place changes nothing: move every vector parameter off those values first.
    with torch.no_grad():
        for p in theirs.parameters():
            if p.dim() == 1:
                p.add_(torch.empty_like(p).uniform_(-0.2, 0.2))
    # Train mode with dropout 0 keeps torch on its plain math path (its eval-mode "fast path" packs padded
    # sequences into nested tensors and zeroes padded encoder outputs, a different but equivalent computation).
    theirs.train()
    cfg = torch_reference.config_from_nn_transformer(
        theirs.transformer,
        src_vocab_size=vocab,
        tgt_vocab_size=vocab,
        max_len=32,
        tie_output=False,
        output_bias=bias,
        dropout=0.0,
        embedding_dropout=0.0,
    )
    assert cfg.final_norm and cfg.norm_first == norm_first and cfg.activation == activation
    assert cfg.qkv_bias == cfg.ffn_bias == cfg.norm_bias == bias
    params = from_nn_transformer(
        theirs.transformer.state_dict(),
        cfg,
        source_embedding=theirs.src_embed.weight,
        target_embedding=theirs.tgt_embed.weight,
        output_weight=theirs.generator.weight,
        output_bias=theirs.generator.bias,
    )
    batch = make_batch(cfg, seed=9)
    src, tgt_in = batch["src"], batch["tgt_in"]
    # torch.nn.MultiheadAttention gives NaN for a query whose keys are all masked (softmax over -inf), so the
    # all-padding row, which this project's models keep finite, is left out of this comparison.
    ours = np.asarray(Transformer(cfg).apply({"params": params}, src, tgt_in))
    assert np.isfinite(ours).all(), "the Flax model must stay finite on the all-padding row"
    with torch.no_grad():
        reference = theirs(t(src[:-1]), t(tgt_in[:-1]))
    diff = max_abs_diff(ours[:-1], reference)
    parity_report(
        "logits vs torch.nn.Transformer", f"{'pre' if norm_first else 'post'} {activation} bias={bias}", diff, ATOL
    )
    assert diff <= ATOL


def test_nn_transformer_import_is_strict():
    cfg = torch_reference.config_from_nn_transformer(
        nn.Transformer(64, 4, 2, 2, 128, batch_first=True),
        src_vocab_size=53,
        tgt_vocab_size=53,
        max_len=32,
        tie_output=False,
    )
    model = nn.Transformer(64, 4, 1, 2, 128, batch_first=True)  # one encoder layer fewer than the config says
    embed = np.zeros((53, 64), np.float32)
    with pytest.raises(PortError, match=r"missing encoder\.layers\.1\.self_attention\.query\.weight"):
        from_nn_transformer(
            model.state_dict(),
            cfg,
            source_embedding=embed,
            target_embedding=embed,
            output_weight=embed,
            output_bias=np.zeros(53, np.float32),
        )


def test_nn_transformer_config_refuses_what_one_switch_cannot_say():
    """The config has one switch per bias and setting: layers that disagree (custom layers) are refused by name."""
    model = nn.Transformer(64, 4, 2, 2, 128, batch_first=True)
    model.decoder.layers[1].norm3 = nn.LayerNorm(64, bias=False)
    with pytest.raises(ValueError, match=r"disagree on \{'norm_bias': \[False, True\]\}"):
        torch_reference.config_from_nn_transformer(model, src_vocab_size=53, tgt_vocab_size=53)
